r"""Hardening, round two (issue #23): what an outside probe and eleven real clients found, each proved
over HTTP against the app on the local host and the scripted upstream. The Responses follow-ups
(items 2-4, 11) are in test_follow_ups.py, the worker's memory (item 1) in test_worker_memory.py.

Every item, what happens now, and its test:

Each test below fails on the code before its fix (commit 059c534) and passes now: checked by
running the same test file against a checkout of that commit, `CHATSTREAM_APP_ROOT=/path/to/checkout
.venv/bin/python -m pytest tests/<file>.py` (the app and its local host from the checkout, the
scripted upstream from this tree), except where the row says it was checked by reading the old code.
Tests are in `tests/test_hardening_two.py` unless named otherwise; `test_follow_ups.py` is
`tests/test_follow_ups.py`.

| # | what broke | what happens now | test |
|---|---|---|---|
| 1 | each worker grew ~2.1 KB per request, without bound (the Python worker's `HttpCoordinator`, below) | `chatstream/worker_fix.py` deletes the worker's entry for an invocation once its response is taken, for azure-functions-runtime 1.0.0–1.3.0 only. 20,000 mixed requests after a warm-up: +2,167 B per request before, +13 B now | `test_worker_memory.py::test_the_worker_does_not_grow_per_request`; `tests/unit/test_worker_fix.py` (on the runtime's own class) |
| 2 | with `UPSTREAMS`, a follow-up stopped at the first entry's error: GET/resume/cancel/DELETE answered 429/502 while entry B held the response; with A stalled, 60 s | each entry in priority order, past 404, 429, 5xx, failed connections and no answer within its share (`UPSTREAM_FIRST_TOKEN_TIMEOUT_SECONDS`): with A stalled, each follow-up costs A's share (1 s in the test) and no more | `test_follow_ups.py::test_a_follow_up_reaches_the_entry_that_holds_the_response` (A: 429, 500, 503, no answer), `::test_a_response_no_entry_holds_is_a_404_within_the_limits` |
| 3 | follow-ups ignored the limits (504 after 31 s: three SDK attempts), did not watch for a hang-up, wrote no log line | an answer within `FIRST_TOKEN_TIMEOUT_SECONDS` (else `504 upstream_timeout`, one upstream call), the upstream closed < 1 s after a hang-up (`499`), one log line each (`responses.<operation>`, with `request_id`) | `test_follow_ups.py::test_follow_ups_obey_the_time_limits_and_log_one_line_each`, `::test_a_hang_up_during_a_follow_up_closes_the_upstream_within_a_second` (5 operations) |
| 4 | resumes: with `BLOCKED_TERMS`, `starting_after` at or past the last event (38, 1000, 10^26) was a 502; without text steps an upstream reset or stall ended as a clean 200 (a stall after the SDK's 10 s read timeout); with text steps a hang-up before the first resumed event left the upstream open until the first-token limit | every re-stream goes through the stream core: past the end, an empty `200`; a reset, `error` `upstream_disconnected`; a stall, `error` `upstream_timeout` at `IDLE_TIMEOUT_SECONDS`; a hang-up closes the upstream < 1 s | `test_follow_ups.py::test_resuming_at_or_past_the_last_event_is_an_empty_stream_not_an_error[guarded]`, `::test_a_reset_during_a_resume_ends_with_an_error_event[plain]`, `::test_a_stall_during_a_resume_ends_with_an_error_event_at_the_idle_limit[plain]`, `::test_a_hang_up_during_a_resume_closes_the_upstream_within_a_second[guarded]` (the other variants held before and are kept) |
| 5 | a non-streamed call reaching `TOTAL_TIMEOUT_SECONDS` answered an empty `499` and logged `"disconnected": true` | `504` `total_timeout` in OpenAI's shape, logged as such; the upstream call closed (`unless_gone` no longer takes its own cancellation of the disconnect watcher for a hang-up) | `test_non_streamed_calls_at_the_total_limit_are_a_504_total_timeout` |
| 6 | an upstream that answered 200 and then cut the stream before the first output was "503 could not reach the model server" | `502` `upstream_disconnected`, "the model server cut the connection before its first output"; still a failover | `test_an_upstream_that_answers_then_cuts_the_stream_before_any_output_is_a_502`, `test_a_cut_before_the_first_output_still_fails_over` |
| 7 | `Retry-After` passed through unchecked (`-5`, `nan`, `inf`, `1e308`, `99999999999`, `garbage`, `é`, past dates); `0`/negative/past cooled an entry 1 s where docs/pool.md said ignored | a caller gets whole seconds 1–3600 or no header, and `retry-after-ms` only where the upstream sent one; values ≤ 0, past dates and garbage are ignored for cooldowns (the 10 s default) | `test_a_caller_only_ever_gets_a_valid_retry_after` (13 values), `test_retry_after_ms_is_passed_on_where_the_upstream_gave_one`, `test_a_zero_negative_or_past_retry_after_is_ignored_and_the_entry_cools_down_ten_seconds` |
| 8 | a client ignoring `x-should-retry` multiplied the retries: one Vercel AI SDK `generateText` made 3 × 3 upstream calls | the single upstream honours its own 429's `Retry-After` (429 with the seconds left, no upstream call): one AI SDK 4.x call (its own 2 s/4 s backoff) against `Retry-After: 8` and `UPSTREAM_MAX_RETRIES=1` makes 2 upstream calls (6 before) | `test_one_ai_sdk_call_costs_at_most_one_plus_the_apps_retries` (the real SDK, `tests/clients/aisdk/`) |
| 9 | no `x-request-id` | every answer has one (the upstream's, on its errors too, else the app's), as the log line's `request_id` and the span's `chat.request_id` | `test_every_answer_carries_x_request_id_and_the_log_line_has_it`; `test_telemetry.py::test_the_span_has_the_request_id_the_caller_got` (in-process: checked by reading the old code, which had no request id) |
| 10 | an upstream quoting its `Authorization` header in a 400/404/429 message sent the key to the caller, in 25 endpoint/follow-up combinations | every configured key and Entra ID token is replaced by `[redacted]` in any upstream text passed on, and in every log line and traceback of the app's logger | `test_an_upstream_quoting_its_key_never_shows_it_to_a_caller_or_in_a_log[openai,azure,azure-dated]` (30 calls each: 25 leaked before); `tests/unit/test_record.py::test_no_upstream_key_in_a_log_line_message_or_traceback`, `::test_every_entra_id_token_is_registered_as_a_secret` |
| 11 | follow-ups stripped only a lowercase `code`: `?Code=…` reached the upstream | only the query parameters OpenAI defines per call are passed on | `test_follow_ups.py::test_only_the_query_parameters_openai_defines_reach_the_upstream` |
| 12 | `OPENAI_BASE_URL` with `?api-key=` showed the key on `/api/_pool`; with `user:pass@` the app started and answered 500s | checked at start-up like an `UPSTREAMS` entry (also `AZURE_OPENAI_ENDPOINT`): no user, password, query or fragment; the message names the setting, never the value | `test_a_base_url_with_credentials_stops_the_app_naming_the_setting_never_the_value` (5 values) |
| 13 | docs/openai.md did not say who can read, cancel or delete a stored response | it does ("Who can read, cancel or delete a stored response"): anyone with the function key, for any id, without callers; only the creating caller with `CALLER_KEYS=required` | `test_docs.py::test_openai_md_says_who_can_read_cancel_or_delete_a_stored_response` (the old docs have no such section); the behaviour: `test_follow_ups.py::test_without_callers_the_function_key_reaches_any_stored_response`, `test_callers.py::test_a_response_belongs_to_the_caller_that_created_it` |
| 14 | `BLOCKED_TERMS` missed `response.audio.transcript.delta` | the transcript goes through the text steps; its held tail goes out at `.transcript.done` | `test_blocked_terms_are_redacted_in_an_audio_transcript`; `tests/unit/test_responses_stream.py::test_an_audio_transcript_is_redacted_for_any_chunking` |
| 15 | `MAX_PROMPT_CHARS` did not count ids (`call_id`, item ids, `tool_call_id`) | they count; what is only referenced (`previous_response_id`, `conversation`, `item_reference`, files) is listed in docs/pipeline.md as not countable | `test_max_prompt_chars_counts_the_ids_a_caller_sends` (4 requests with 5,000-character ids) |
| 16 | `UPSTREAMS` 30,000 levels deep: a `RecursionError` not naming the setting; 1,000 entries: 23 s and 912 MB to start | at most 64 entries, 8 levels, 256 KiB, refused naming `UPSTREAMS` (docs/pool.md) | `test_upstreams_beyond_its_documented_bounds_stops_the_app_naming_the_setting`; `tests/unit/test_upstreams_config.py` (the 256 KiB bound: more than one environment variable holds on Linux) |
| 17 | a response id with CR/LF (`%0D%0A`) got FastAPI's `{"detail":"Not Found"}` (the worker's HTTP route did not match a line feed; the invocation then waited forever), or the local host's empty 405/404 | the worker's route matches any path (`worker_fix.route_any_path`), the local host's catch-alls take any character: every answer under `/api/v1/` is OpenAI's shape (400 for a malformed id, 404 otherwise) | `test_every_error_under_api_v1_is_in_openai_shape_whatever_the_path_holds` (9 paths × 3 methods); `tests/unit/test_worker_fix.py::test_the_workers_http_route_matches_a_path_with_a_line_feed`, `tests/devtools/test_devhost_routes.py::test_a_line_feed_in_the_path_still_reaches_a_route_as_in_asp_net` |
| 18 | processes that built the app printed aiohttp's "Unclosed client session" at exit | the upstream clients close with the event loop that used them | `test_a_process_that_builds_the_app_and_serves_requests_exits_without_unclosed_sessions` |
| 19 | eight callers who did not read 4.9 MB answers and hung up left the worker 25–37 MB bigger for good on the streamed route (`/api/chat`; 3–14 MB non-streamed): the C allocator kept the freed answers | once answers that ended add up to 4 MB, `malloc_trim` gives the memory back (`chatstream/memory.py`); a non-streamed answer is written in 64 KB pieces the server takes one at a time (so it is over when its caller has it or has hung up, and is dropped past the total limit as a stream is), without ever building its whole text. Now: back within 1 MB of where it was at once after the hang-ups; while held, +14 MB (non-streamed) and +40 MB (streamed) for 39 MB of answers | `test_worker_memory.py::test_callers_who_do_not_read_big_answers_hold_them_once_and_give_them_back` (checked against d1e421c: +35 MB 15 s after the streamed ones); `tests/unit/test_memory.py` |

The scripted upstream gained what these tests need (tools/fakeupstream/README.md): the scenarios
`reset_first`, `hang`, `key_in_error_400`/`404`/`429` and (Responses) `audio`;
`POST /_scripted/follow_ups` (what every follow-up plays instead of its answer: an error, no answer,
or a re-stream that drops) and `POST /_scripted/error_headers` (a chosen `Retry-After`).

### For the runtime's maintainers: `HttpCoordinator` keeps one entry per invocation

To be filed at https://github.com/Azure/azure-functions-python-worker.

**What.** With HTTP streaming (the `azurefunctions-extensions-http-fastapi` extension), every HTTP
invocation leaves an `AsyncContextReference` (two `asyncio.Event`s and six fields, ~2.1 KB with its
dict slot) in `HttpCoordinator._context_references`, keyed by its invocation id, and nothing removes
it. A worker's memory grows with the number of requests it has served: measured through a local
host on the real worker, +2,167 B per request over 20,000 requests (`GET` of a small JSON answer);
an instance serving a million requests carries some 2 GB more.

**Where.** `azure-functions-runtime` 1.3.0 (the newest release; Python 3.13),
`azure_functions_runtime/http_v2.py`, class `HttpCoordinator` (the singleton `http_coordinator`):
`set_http_request` and `get_http_request_async` add the entry; `_pop_http_request` and
`_pop_http_response` set its `http_request` / `http_response` back to `None` but leave the entry in
the dict. The same code is in `azure_functions_worker/http_v2.py` (the worker for Python ≤ 3.12).
A fix: delete the entry in `await_http_response_async` once the response is popped (by then
`invocation_request` has set the response and returned: it does not await after
`set_http_response`).

**Minimal reproduction** (no host needed; the runtime's own coordinator):

```python
import asyncio
from azure_functions_runtime.http_v2 import http_coordinator


async def invocation(i):
    # what the worker's HTTP server (catch_all) and invocation_request do for one HTTP invocation
    async def server_side():
        http_coordinator.set_http_request(f"inv-{i}", object())
        return await http_coordinator.await_http_response_async(f"inv-{i}")

    async def function_side():
        await http_coordinator.get_http_request_async(f"inv-{i}")
        http_coordinator.set_http_response(f"inv-{i}", object())

    await asyncio.gather(server_side(), function_side())


async def main():
    for i in range(10_000):
        await invocation(i)
    print(len(http_coordinator._context_references))  # 10000: every invocation is still there


asyncio.run(main())
```

Or end to end: any HTTP-streaming function app on the worker, 20,000 `GET`s, and the worker's RSS
grows about 2 KB per request. The app works around it in `chatstream/worker_fix.py` (checked
versions only, and only inside that worker); remove the workaround once a fixed runtime ships.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from chat import chat, prompt
from helpers import TEST_KEY, app_env
from servers import APP_ROOT, ROOT, App, Upstream

pytestmark = pytest.mark.timeout(180)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def completion(scenario: str, **extra) -> dict:
    return {"model": "gpt-test", "messages": user(f"[scenario:{scenario}] hi"), **extra}


def response(scenario: str, **extra) -> dict:
    return {"model": "gpt-test", "input": f"[scenario:{scenario}] hi", **extra}


def log_lines(app: App) -> list[dict]:
    return [json.loads(m) for m in re.findall(r'\{"event": "chat_stream".*', app.log())]


def wait_log_line(app: App, **expected) -> dict:
    """The newest log line with every ``expected`` field, waiting up to 5 s for it."""
    deadline = time.monotonic() + 5
    while True:
        found = [line for line in log_lines(app) if all(line.get(k) == v for k, v in expected.items())]
        if found:
            return found[-1]
        assert time.monotonic() < deadline, f"no log line with {expected}:\n{app.log()[-3000:]}"
        time.sleep(0.05)


def hang_record_since(upstream: Upstream, since: float) -> dict:
    """The scripted upstream's record of a ``hang`` answer started after ``since``, once it has ended."""
    deadline = time.monotonic() + 5
    while True:
        found = [s for s in upstream.streams() if s["scenario"] == "hang" and s["started_at"] >= since - 0.2]
        if found and found[-1]["ended_at"] is not None:
            return found[-1]
        assert time.monotonic() < deadline, f"no ended hang since {since}: {found}"
        time.sleep(0.02)


def set_error_headers(upstream: Upstream, headers: dict[str, str]) -> None:
    upstream.http.post("/_scripted/error_headers", json=headers).raise_for_status()


@pytest.fixture
def error_headers(upstream):
    """Set the headers the scripted upstream's error answers carry; back to the scenario's after."""
    yield lambda headers: set_error_headers(upstream, headers)
    set_error_headers(upstream, {})


# ------------------------------------------------------------------- 5. non-streamed calls at the total limit


def test_non_streamed_calls_at_the_total_limit_are_a_504_total_timeout(start_app, upstream):
    app = start_app(TOTAL_TIMEOUT_SECONDS="2")
    for path, body, endpoint in (
        ("/api/v1/chat/completions", completion("hang"), "openai"),
        ("/api/v1/responses", response("hang"), "responses"),
    ):
        started, sent = time.monotonic(), time.time()
        r = httpx.post(app.url + path, json=body, timeout=20)
        elapsed = time.monotonic() - started
        assert r.status_code == 504, (path, r.status_code, r.text)
        assert r.json() == {
            "error": {
                "message": "the stream hit its total time limit",
                "type": "server_error",
                "param": None,
                "code": "total_timeout",
                "chatstream_kind": "total_timeout",
            }
        }
        assert 1.9 <= elapsed < 4, elapsed
        line = wait_log_line(app, endpoint=endpoint, status=504)
        assert line["error"] == "total_timeout" and line["disconnected"] is False
        assert hang_record_since(upstream, sent)["outcome"] == "client_disconnected", "the upstream call was closed"


def test_a_caller_hanging_up_on_a_non_streamed_call_is_still_a_499_that_closes_the_upstream(start_app, upstream):
    """The other side of item 5: a real hang-up is still told apart from the total limit."""
    import socket

    app = start_app(TOTAL_TIMEOUT_SECONDS="20")
    host, port = app.url.removeprefix("http://").split(":")
    body = json.dumps(completion("hang")).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /api/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        time.sleep(0.5)
        hung_up = time.time()
    record = hang_record_since(upstream, hung_up - 0.5)
    assert record["outcome"] == "client_disconnected" and record["ended_at"] - hung_up < 1.0
    line = wait_log_line(app, endpoint="openai", status=499)
    assert line["disconnected"] is True


# ----------------------------------------------------------------- 6. a 200 that dies before the first token


def test_an_upstream_that_answers_then_cuts_the_stream_before_any_output_is_a_502(app, upstream):
    result = chat(app.chat_url, prompt("reset_first"))
    assert result.status == 502, (result.status, result.body)
    assert result.body["error"]["type"] == "upstream_disconnected"
    assert result.body["error"]["message"] == "the model server cut the connection before its first output"
    for path, body in (
        ("/api/v1/chat/completions", completion("reset_first", stream=True)),
        ("/api/v1/responses", response("reset_first", stream=True)),
    ):
        r = httpx.post(app.url + path, json=body, timeout=20)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_disconnected", (path, r.text)


def test_a_cut_before_the_first_output_still_fails_over(start_app):
    first, second = Upstream("--scenario", "reset_first"), Upstream("--scenario", "normal")
    try:
        app = start_app(
            UPSTREAMS=json.dumps(
                [
                    {"name": "a", "base_url": first.base_url, "priority": 1},
                    {"name": "b", "base_url": second.base_url, "priority": 2},
                ]
            )
        )
        result = chat(app.chat_url, {"prompt": "hi"})
        assert result.status == 200 and result.terminal_events() == ["done"]
        line = wait_log_line(app, endpoint="chat", upstream="b")
        assert line["attempts"] == 2
        assert line["attempt_errors"] == [{"upstream": "a", "error": "upstream_disconnected"}]
    finally:
        first.stop()
        second.stop()


# --------------------------------------------------------------------------------- 7. Retry-After

BAD_RETRY_AFTER = [
    "-5",
    "nan",
    "inf",
    "-inf",
    "1e308",
    "99999999999",
    "garbage",
    "é",
    "",
    "0x10",
    "Wed, 21 Oct 2015 07:28:00 GMT",
    "1.5e3",
    "2.5",
]


@pytest.fixture(scope="module")
def plain_app(upstream):
    """An app of this module's own, on the session's scripted upstream."""
    server = App(app_env(upstream))
    yield server
    server.stop()


@pytest.mark.parametrize("value", BAD_RETRY_AFTER)
def test_a_caller_only_ever_gets_a_valid_retry_after(plain_app, error_headers, value):
    error_headers({"retry-after": value})
    model = f"model-{BAD_RETRY_AFTER.index(value)}"  # a cooldown of its own (the single upstream's is per model)
    answers = [
        httpx.post(
            plain_app.url + "/api/v1/chat/completions", json=completion("rate_limited", model=model), timeout=20
        ),
        httpx.post(plain_app.chat_url, json={**prompt("rate_limited"), "model": model}, timeout=20),
    ]
    for r in answers:  # the upstream's 429, then the upstream's or the app's own while it cools down
        assert r.status_code == 429
        retry_after = r.headers.get("retry-after")
        if retry_after is not None:
            assert re.fullmatch(r"[1-9][0-9]{0,3}", retry_after), retry_after
            assert 1 <= int(retry_after) <= 3600
        assert "retry-after-ms" not in r.headers, "the upstream sent none"
    # Bounded, rounded up; a past date is "now": the least a caller is told, 1 s.
    expected = {
        "1e308": "3600",
        "99999999999": "3600",
        "1.5e3": "1500",
        "2.5": "3",
        "Wed, 21 Oct 2015 07:28:00 GMT": "1",
    }
    assert answers[0].headers.get("retry-after") == expected.get(value)


def test_retry_after_ms_is_passed_on_where_the_upstream_gave_one(plain_app, error_headers):
    error_headers({"retry-after": "2", "retry-after-ms": "1500"})
    body = completion("rate_limited", model="model-ms")
    r = httpx.post(plain_app.url + "/api/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 429 and r.headers["retry-after"] == "2" and r.headers["retry-after-ms"] == "2000"
    error_headers({"retry-after-ms": "nan"})
    r = httpx.post(plain_app.url + "/api/v1/chat/completions", json={**body, "model": "model-ms2"}, timeout=20)
    assert r.status_code == 429 and "retry-after-ms" not in r.headers


def test_a_zero_negative_or_past_retry_after_is_ignored_and_the_entry_cools_down_ten_seconds():
    """docs/pool.md: values <= 0 are ignored, and a 429 whose headers say nothing usable cools its
    entry down (for that model) for the default 10 s."""
    limited, spare = Upstream("--scenario", "rate_limited"), Upstream("--scenario", "normal")
    app = App(
        app_env(
            limited,
            UPSTREAMS=json.dumps(
                [
                    {"name": "a", "base_url": limited.base_url, "priority": 1},
                    {"name": "b", "base_url": spare.base_url, "priority": 2},
                ]
            ),
        )
    )
    try:
        for i, value in enumerate(["0", "-1", "Wed, 21 Oct 2015 07:28:00 GMT"]):
            set_error_headers(limited, {"retry-after": value})
            model = f"model-{i}"
            assert chat(app.chat_url, {"prompt": "hi", "model": model}).status == 200  # a: 429, b serves it
            time.sleep(1.5)  # past a 1 s cooldown
            before = limited.count()
            assert chat(app.chat_url, {"prompt": "hi", "model": model}).status == 200
            assert limited.count() == before, f"a still cools down after Retry-After: {value}"
            state = {e["name"]: e for e in httpx.get(app.url + "/api/_pool", timeout=10).json()["upstreams"]}
            assert 7 < state["a"]["cooldowns"][model] <= 10, state["a"]
    finally:
        app.stop()
        limited.stop()
        spare.stop()


# ------------------------------------------------------------------------------------ 9. x-request-id


def test_every_answer_carries_x_request_id_and_the_log_line_has_it(app, upstream):
    sdk = openai.OpenAI(base_url=app.url + "/api/v1", api_key="unused", max_retries=0)
    created = sdk.chat.completions.create(model="gpt-test", messages=user("[scenario:normal] hi"))
    upstream_id = upstream.requests(last=1)[-1]["id"]
    assert created._request_id == upstream_id, "the upstream's id, as the SDK exposes it"
    wait_log_line(app, endpoint="openai", request_id=upstream_id)

    with sdk.chat.completions.with_streaming_response.create(
        model="gpt-test", messages=user("hi"), stream=True
    ) as streamed:
        assert streamed.headers["x-request-id"] == upstream.requests(last=1)[-1]["id"]
    raw = sdk.responses.with_raw_response.create(model="gpt-test", input="hi")
    assert raw.headers["x-request-id"] == upstream.requests(last=1)[-1]["id"]

    # Answered without an upstream id: the app's own, in the log line too.
    answers = [
        httpx.post(app.chat_url, json={"prompt": ""}, timeout=10),
        httpx.post(app.url + "/api/v1/chat/completions", json={"messages": []}, timeout=10),
        httpx.get(app.url + "/api/v1/models", timeout=10),
        httpx.get(app.url + "/api/v1/nothing", timeout=10),
        httpx.post(app.chat_url, json=prompt("rate_limited"), timeout=10),
        httpx.get(app.url + "/api/v1/responses/resp_unknown", timeout=10),
    ]
    for r in answers:
        assert re.fullmatch(r"[0-9a-f]{32}|req_\d+", r.headers.get("x-request-id", "")), (r.request.url, r.headers)
    wait_log_line(app, endpoint="chat", status=400, request_id=answers[0].headers["x-request-id"])
    wait_log_line(app, endpoint="responses.retrieve", request_id=answers[-1].headers["x-request-id"])


# ------------------------------------------------------------------------- 10. keys quoted by the upstream

LEAKY = ("key_in_error_400", "key_in_error_404", "key_in_error_429")


def leaky_calls(base: str, scenario: str, n: int) -> list[tuple[str, httpx.Response]]:
    """Every endpoint and follow-up, the upstream answering ``scenario`` (a model of its own per call,
    so that no 429 cooldown keeps a later call from reaching the upstream)."""
    out = []
    with httpx.Client(timeout=20) as client:

        def post(name: str, path: str, body: dict) -> None:
            out.append((name, client.post(base + path, json={**body, "model": f"m{n}-{len(out)}"})))

        post("chat", "/api/chat", prompt(scenario))
        post("completions", "/api/v1/chat/completions", completion(scenario))
        post("completions stream", "/api/v1/chat/completions", completion(scenario, stream=True))
        post("responses", "/api/v1/responses", response(scenario))
        post("responses stream", "/api/v1/responses", response(scenario, stream=True))
        rid = "/api/v1/responses/resp_0123456789"
        out.append(("retrieve", client.get(base + rid)))
        out.append(("resume", client.get(base + rid, params={"stream": "true", "starting_after": "3"})))
        out.append(("cancel", client.post(base + rid + "/cancel")))
        out.append(("delete", client.delete(base + rid)))
        out.append(("input_items", client.get(base + rid + "/input_items")))
    return out


@pytest.mark.parametrize("kind", ["openai", "azure", "azure-dated"])
def test_an_upstream_quoting_its_key_never_shows_it_to_a_caller_or_in_a_log(upstream, kind):
    azure = {
        "AZURE_OPENAI_ENDPOINT": upstream.url,
        "AZURE_OPENAI_DEPLOYMENT": "gpt-test",
        "AZURE_OPENAI_API_KEY": TEST_KEY,
    }
    settings = {  # Azure's v1 API sends the key as the bearer, a dated version in api-key
        "azure": azure,
        "azure-dated": {**azure, "AZURE_OPENAI_API_VERSION": "2024-10-21"},
        "openai": {},
    }[kind]
    app = App(app_env(upstream, **settings))
    seen, quoted = [], 0
    try:
        for n, scenario in enumerate(LEAKY):
            upstream.http.post("/_scripted/follow_ups", json={"scenario": scenario}).raise_for_status()
            before = upstream.count()
            calls = leaky_calls(app.url, scenario, n)
            assert upstream.count() - before == len(calls), "every call reached the upstream"
            for name, r in calls:
                assert r.status_code in (400, 404, 429, 501), (scenario, name, r.status_code, r.text)
                answer = f"{r.status_code} {r.headers.raw!r} {r.text}"
                seen.append((f"{scenario} {name}", answer))
                quoted += "[redacted]" in r.text
    finally:
        upstream.http.post("/_scripted/follow_ups", json={"scenario": None})
        app.stop()
    leaked = [where for where, answer in seen if TEST_KEY[8:] in answer]
    assert not leaked, f"the key reached the caller in {len(leaked)} calls: {leaked}"
    assert "chat_stream" in app.log() and TEST_KEY[8:] not in app.log()
    assert quoted >= 15, "the upstream's messages reach the caller, without the key"


# ------------------------------------------------------------------ 8. a client that retries on its own

AISDK = ROOT / "tests" / "clients" / "aisdk"


@pytest.fixture(scope="module")
def aisdk() -> list[str]:
    """The Vercel AI SDK (tests/clients/aisdk, pinned by its package-lock.json): the command that runs
    one generateText call."""
    if not (AISDK / "node_modules" / "ai").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=AISDK, check=True, timeout=300)
    return ["node", str(AISDK / "generate.mjs")]


def test_one_ai_sdk_call_costs_at_most_one_plus_the_apps_retries(start_app, upstream, error_headers, aisdk):
    """The AI SDK (4.x) retries a 429 twice with its own backoff (2 s, then 4 s), whatever
    x-should-retry and Retry-After say. While the upstream's Retry-After runs, the app answers 429
    with the time left and calls no upstream, so the SDK's retries cost nothing upstream."""
    app = start_app(UPSTREAM_MAX_RETRIES="1")
    error_headers({"retry-after": "8"})  # longer than the SDK's whole backoff (6 s)
    before = upstream.count()
    run = subprocess.run(
        [*aisdk, app.url + "/api/v1", "[scenario:rate_limited] hi"], capture_output=True, text=True, timeout=120
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and result["statuses"] == [429, 429, 429], result  # three app requests
    assert upstream.count() - before == 2, "1 + UPSTREAM_MAX_RETRIES upstream calls for the one SDK call"
    lines = [line for line in log_lines(app) if line["endpoint"] == "openai"]
    assert [(line["status"], line["attempts"]) for line in lines] == [(429, 1), (429, 0), (429, 0)]


# -------------------------------------------------------------- 12. a base URL that carries credentials


@pytest.mark.parametrize(
    "setting, value",
    [
        ("OPENAI_BASE_URL", "http://127.0.0.1:9/v1?api-key=SECRETVALUE"),
        ("OPENAI_BASE_URL", "http://user:SECRETVALUE@127.0.0.1:9/v1"),
        ("OPENAI_BASE_URL", "http://127.0.0.1:9/v1#SECRETVALUE"),
        ("AZURE_OPENAI_ENDPOINT", "https://user:SECRETVALUE@example.openai.azure.com"),
        ("AZURE_OPENAI_ENDPOINT", "https://example.openai.azure.com/?api-key=SECRETVALUE"),
    ],
)
def test_a_base_url_with_credentials_stops_the_app_naming_the_setting_never_the_value(setting, value):
    env = {setting: value, "OPENAI_API_KEY": TEST_KEY, "AZURE_OPENAI_DEPLOYMENT": "gpt-test"}
    try:
        app = App(env)
    except RuntimeError as failed:
        text = str(failed)
        assert "SettingsError" in text and f"invalid app settings: {setting}:" in text, text[-2000:]
        assert "SECRETVALUE" not in text and TEST_KEY not in text
        return
    try:
        pool = httpx.get(app.url + "/api/_pool", timeout=10).text
        answer = httpx.post(app.chat_url, json={"prompt": "hi"}, timeout=10)
    finally:
        app.stop()
    pytest.fail(f"the app started: /api/_pool showed {pool!r}; /api/chat answered {answer.status_code}")


# ---------------------------------------------------------------------------- 16. UPSTREAMS' bounds


@pytest.mark.parametrize(
    "value, message",
    [
        ("[" * 30_000 + "]" * 30_000, "UPSTREAMS: nested deeper than 8 levels"),
        (
            json.dumps([{"name": f"e{i}", "base_url": f"http://127.0.0.1:9/v{i}"} for i in range(65)]),
            "UPSTREAMS: 65 entries; at most 64",
        ),
    ],
)  # MAX_CHARS (256 KiB) is above what one environment variable can hold here: tests/unit/test_upstreams_config.py
def test_upstreams_beyond_its_documented_bounds_stops_the_app_naming_the_setting(value, message):
    started = time.monotonic()
    try:
        app = App({"UPSTREAMS": value})
    except RuntimeError as failed:
        text = str(failed)
        assert "SettingsError" in text and message in text, text[-2000:]
        assert "RecursionError" not in text
        assert time.monotonic() - started < 30
        return
    app.stop()
    pytest.fail("the app started")


# -------------------------------------------------------------------- 17. every /api/v1/ error is OpenAI's


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/responses/resp_a%0D%0Ab",
        "/api/v1/responses/resp_a%0Ab/cancel",
        "/api/v1/responses/resp_a%0Ab/input_items",
        "/api/v1/responses/resp_%0A",
        "/api/v1/models/gpt%0Atest",
        "/api/v1/x%0Ay",
        "/api/v1/chat/completions%0A",
        "/api/v1/responses/resp_a%00b",
        "/api/v1/responses/resp_a%2Fb",
    ],
)
def test_every_error_under_api_v1_is_in_openai_shape_whatever_the_path_holds(plain_app, upstream, path):
    before = upstream.count()
    for method in ("GET", "POST", "DELETE"):
        r = httpx.request(method, plain_app.url + path, timeout=10)
        assert r.status_code in (400, 404), (method, path, r.status_code, r.text)
        error = r.json()["error"]
        assert (
            set(error) == {"message", "type", "param", "code", "chatstream_kind"}
            and error["type"] == "invalid_request_error"
        ), r.text
        assert r.headers["x-request-id"]
    assert upstream.count() == before, "no id with a control character reaches the upstream"


# ------------------------------------------------------------------ 18. the clients closed at shutdown


def test_a_process_that_builds_the_app_and_serves_requests_exits_without_unclosed_sessions(upstream):
    """The app served in a process of its own (uvicorn, as tests/helpers.InProcessApp does), a streamed
    and a non-streamed request, then the server stops and the process exits: aiohttp must not report
    an unclosed client session or connector (the upstream clients are closed with the loop)."""
    script = "\n".join(
        [
            "import sys",
            f"sys.path[:0] = [{str(APP_ROOT)!r}, {str(ROOT / 'tests')!r}]",
            "import httpx",
            "from helpers import InProcessApp",
            f"app = InProcessApp({upstream.base_url!r})",
            "streamed = httpx.post(app.chat_url, json={'prompt': '[scenario:normal] hi'}, timeout=20)",
            "whole = httpx.post(app.url + '/api/v1/chat/completions', timeout=20,",
            "                   json={'model': 'gpt-test', 'messages': [{'role': 'user', 'content': 'hi'}]})",
            "print(streamed.status_code, whole.status_code)",
            "app.stop()",
        ]
    )
    run = subprocess.run(
        [sys.executable, "-X", "dev", "-c", script], capture_output=True, text=True, timeout=60, cwd=APP_ROOT
    )
    assert run.returncode == 0 and run.stdout.split() == ["200", "200"], run.stdout + run.stderr
    assert "Unclosed" not in run.stderr, run.stderr


# ------------------------------------------------------------------ 14. a spoken answer's transcript

AUDIO_TERMS = ["Spoken: the", "scripted"]  # the first spans two deltas ("Spoken: " + "the scripted ")


def test_blocked_terms_are_redacted_in_an_audio_transcript(upstream):
    from chatstream.guard import redact_whole
    from tools.fakeupstream import RESPONSES_TEXTS

    app = App(app_env(upstream, BLOCKED_TERMS=",".join(AUDIO_TERMS)))
    try:
        r = httpx.post(app.url + "/api/v1/responses", json=response("audio", stream=True), timeout=20)
    finally:
        app.stop()
    events = [json.loads(m) for m in re.findall(r"^data: (.*)$", r.text, re.M)]
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.audio.transcript.delta")
    assert (
        transcript == redact_whole(RESPONSES_TEXTS["audio"], AUDIO_TERMS) == "[redacted] [redacted] answer, out loud."
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events))), "no event added or dropped"
    assert events[-1]["type"] == "response.completed"


# ------------------------------------------------------------------------- 15. MAX_PROMPT_CHARS and ids

LONG_ID = "x" * 5_000
LONG_IDS = {
    "responses call_id": (
        "/api/v1/responses",
        {
            "model": "gpt-test",
            "input": [{"type": "function_call_output", "call_id": "call_" + LONG_ID, "output": "ok"}],
        },
    ),
    "responses item id": (
        "/api/v1/responses",
        {"model": "gpt-test", "input": [{"type": "message", "role": "user", "id": "msg_" + LONG_ID, "content": "hi"}]},
    ),
    "responses item_reference": (
        "/api/v1/responses",
        {"model": "gpt-test", "input": [{"type": "item_reference", "id": "msg_" + LONG_ID}]},
    ),
    "chat tool_call_id": (
        "/api/v1/chat/completions",
        {
            "model": "gpt-test",
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "call_" + LONG_ID, "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_" + LONG_ID, "content": "ok"},
            ],
        },
    ),
}


@pytest.fixture(scope="module")
def prompt_limited(upstream):
    server = App(app_env(upstream, MAX_PROMPT_CHARS="1000"))
    yield server
    server.stop()


@pytest.mark.parametrize("name", sorted(LONG_IDS))
def test_max_prompt_chars_counts_the_ids_a_caller_sends(prompt_limited, upstream, name):
    path, body = LONG_IDS[name]
    before = upstream.count()
    r = httpx.post(prompt_limited.url + path, json=body, timeout=20)
    assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_long", r.text
    assert upstream.count() == before
