"""The Responses API's follow-ups (GET, resume, cancel, DELETE, input_items) under failure, issue #23
items 2-4 and 11: they find the entry that holds the response past others' errors, obey the app's
time limits, close the upstream when the caller hangs up, log one line each, and pass on only the
query parameters OpenAI defines. Over HTTP, against the app on the local host and scripted upstreams
(``/_scripted/follow_ups`` makes an upstream answer every follow-up with a chosen failure)."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest
from helpers import app_env
from servers import App, Upstream

pytestmark = pytest.mark.timeout(120)


def play(server: Upstream, scenario: str) -> None:
    server.http.post("/_scripted/default", json={"scenario": scenario}).raise_for_status()


def follow_ups(server: Upstream, scenario: str | None) -> None:
    server.http.post("/_scripted/follow_ups", json={"scenario": scenario}).raise_for_status()


def log_lines(app: App, endpoint: str) -> list[dict]:
    lines = [json.loads(m) for m in re.findall(r'\{"event": "chat_stream".*', app.log())]
    return [line for line in lines if line["endpoint"] == endpoint]


def wait_log_lines(app: App, endpoint: str, count: int) -> list[dict]:
    deadline = time.monotonic() + 5
    while len(found := log_lines(app, endpoint)) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} {endpoint} log lines:\n{app.log()[-3000:]}"
        time.sleep(0.05)
    return found


def events_of(body: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"^data: (.*)$", body, re.M)]


def create(app: App, scenario: str | None, **extra) -> dict:
    """A response created through the app (``scenario`` None: each upstream plays its default)."""
    r = httpx.post(
        app.url + "/api/v1/responses",
        timeout=20,
        json={"model": "gpt-test", "input": f"[scenario:{scenario}] hi" if scenario else "hi", **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()


def wait_status(app: App, response_id: str, status: str, timeout: float = 8) -> dict:
    deadline = time.monotonic() + timeout
    while (body := httpx.get(f"{app.url}/api/v1/responses/{response_id}", timeout=20).json())["status"] != status:
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    return body


def hang_records(server: Upstream, response_id: str) -> list[dict]:
    return [s for s in server.streams() if s["scenario"] == "hang" and s.get("response_id") == response_id]


# ------------------------------------------------------------------------- 2. the entry that holds it


@pytest.fixture(scope="module")
def pair():
    a, b = Upstream("--scenario", "server_error"), Upstream("--scenario", "normal")
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def pooled(pair):
    """a first, b second; a's 500 on every create sends each response to b."""
    a, b = pair
    app = App(
        app_env(
            a,
            UPSTREAMS=json.dumps(
                [
                    {"name": "a", "base_url": a.base_url, "priority": 1},
                    {"name": "b", "base_url": b.base_url, "priority": 2},
                ]
            ),
            UPSTREAM_FIRST_TOKEN_TIMEOUT_SECONDS="1",
            FIRST_TOKEN_TIMEOUT_SECONDS="10",
        )
    )
    yield app
    app.stop()
    follow_ups(a, None)


@pytest.mark.parametrize("failure", ["rate_limited", "server_error", "overloaded", "hang"])
def test_a_follow_up_reaches_the_entry_that_holds_the_response(pooled, pair, failure):
    a, b = pair
    stored, deleted = create(pooled, None), create(pooled, None)
    play(b, "slow")
    try:
        background = create(pooled, None, background=True)
    finally:
        play(b, "normal")
    assert b.requests(last=1)[-1]["json"]["input"] == "hi", "the pool sent them to b"
    follow_ups(a, failure)
    try:
        base = pooled.url + "/api/v1/responses/"
        with httpx.Client(timeout=10) as client:
            started = time.monotonic()
            got = client.get(base + stored["id"])
            assert got.status_code == 200 and got.json()["id"] == stored["id"], got.text
            items = client.get(base + stored["id"] + "/input_items", params={"limit": "1"})
            assert items.status_code == 200 and items.json()["data"][0]["content"][0]["text"] == "hi"
            resumed = client.get(base + background["id"], params={"stream": "true", "starting_after": "2"})
            assert resumed.status_code == 200 and events_of(resumed.text)[0]["sequence_number"] == 3, resumed.text
            assert events_of(resumed.text)[-1]["type"] == "response.completed"
            cancelled = client.post(base + background["id"] + "/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["id"] == background["id"], cancelled.text
            gone = client.delete(base + deleted["id"])
            assert gone.status_code == 200 and gone.json()["deleted"] is True, gone.text
            took = time.monotonic() - started
    finally:
        follow_ups(a, None)
    # A stalled entry costs each follow-up its share (UPSTREAM_FIRST_TOKEN_TIMEOUT_SECONDS, 1 s), no more.
    assert took < (5 * 1.0 + 2.5 if failure == "hang" else 2.5), took
    if failure == "hang":
        ended = [r for r in hang_records(a, stored["id"]) if r["ended_at"] is not None]
        assert len(ended) == 2 and all(r["outcome"] == "client_disconnected" for r in ended), "a was let go"
    line = wait_log_lines(pooled, "responses.cancel", 1)[-1]
    assert line["status"] == 200


def test_a_response_no_entry_holds_is_a_404_within_the_limits(pooled, pair):
    a, b = pair
    follow_ups(a, "hang")
    try:
        started = time.monotonic()
        r = httpx.get(pooled.url + "/api/v1/responses/resp_held_by_nobody", timeout=10)
    finally:
        follow_ups(a, None)
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout", "a stalled, b said 404"
    assert time.monotonic() - started < 3
    r = httpx.get(pooled.url + "/api/v1/responses/resp_held_by_nobody", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------ 3. limits, hang-ups, log lines


@pytest.fixture(scope="module")
def limited(upstream):
    app = App(
        app_env(
            upstream,
            TOTAL_TIMEOUT_SECONDS="8",
            FIRST_TOKEN_TIMEOUT_SECONDS="2",
            IDLE_TIMEOUT_SECONDS="3",
            UPSTREAM_MAX_RETRIES="2",
        )
    )
    yield app
    app.stop()
    follow_ups(upstream, None)


def test_follow_ups_obey_the_time_limits_and_log_one_line_each(limited, upstream):
    stored = create(limited, "normal")
    base = limited.url + "/api/v1/responses/" + stored["id"]
    calls = [
        ("retrieve", "GET", base, {}),
        ("cancel", "POST", base + "/cancel", {}),
        ("delete", "DELETE", base, {}),
        ("input_items", "GET", base + "/input_items", {}),
        ("retrieve", "GET", base, {"stream": "true", "starting_after": "1"}),
    ]
    follow_ups(upstream, "hang")
    try:
        for operation, method, url, params in calls:
            before = len(log_lines(limited, f"responses.{operation}"))
            started = time.monotonic()
            r = httpx.request(method, url, params=params, timeout=20)
            took = time.monotonic() - started
            assert r.status_code == 504, (operation, r.status_code, r.text)
            assert r.json()["error"]["code"] == "upstream_timeout", r.text
            assert 1.9 <= took < 3.5, (operation, took)  # the first-token limit, 2 s (not 3 SDK attempts)
            line = wait_log_lines(limited, f"responses.{operation}", before + 1)[-1]
            assert line["status"] == 504 and line["error"] == "upstream_timeout"
            assert line["request_id"] == r.headers["x-request-id"]
    finally:
        follow_ups(upstream, None)
    assert len(hang_records(upstream, stored["id"])) == len(calls), "one upstream call each: no SDK retries"


def hang_up_after(url: str, method: str, seconds: float) -> float:
    """Send a request, hang up after ``seconds`` without reading an answer; the time of the hang-up."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    path = "/" + url.split("//", 1)[1].split("/", 1)[1]
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode())
        time.sleep(seconds)
        hung_up = time.time()
    return hung_up


@pytest.mark.parametrize(
    "operation, method, suffix",
    [
        ("retrieve", "GET", ""),
        ("cancel", "POST", "/cancel"),
        ("delete", "DELETE", ""),
        ("input_items", "GET", "/input_items"),
        ("retrieve", "GET", "?stream=true&starting_after=1"),
    ],
)
def test_a_hang_up_during_a_follow_up_closes_the_upstream_within_a_second(limited, upstream, operation, method, suffix):
    stored = create(limited, "normal")
    before = len(log_lines(limited, f"responses.{operation}"))
    follow_ups(upstream, "hang")
    try:
        hung_up = hang_up_after(f"{limited.url}/api/v1/responses/{stored['id']}{suffix}", method, 0.5)
        deadline = time.monotonic() + 3
        while not (ended := [r for r in hang_records(upstream, stored["id"]) if r["ended_at"]]):
            assert time.monotonic() < deadline, "the upstream call was never closed"
            time.sleep(0.02)
    finally:
        follow_ups(upstream, None)
    assert ended[0]["outcome"] == "client_disconnected" and ended[0]["ended_at"] - hung_up < 1.0
    line = wait_log_lines(limited, f"responses.{operation}", before + 1)[-1]
    assert line["status"] == 499 and line["disconnected"] is True


# -------------------------------------------------------------------------------- 4. resume edge cases

TERMS = "scripted,slowly"


@pytest.fixture(scope="module")
def guarded(upstream):
    app = App(app_env(upstream, BLOCKED_TERMS=TERMS, IDLE_TIMEOUT_SECONDS="3", FIRST_TOKEN_TIMEOUT_SECONDS="5"))
    yield app
    app.stop()


@pytest.fixture(scope="module")
def plain(upstream):
    app = App(app_env(upstream, IDLE_TIMEOUT_SECONDS="3", FIRST_TOKEN_TIMEOUT_SECONDS="5"))
    yield app
    app.stop()


def resume(app: App, response_id: str, after: int | str, timeout: float = 20) -> httpx.Response:
    return httpx.get(
        f"{app.url}/api/v1/responses/{response_id}",
        timeout=timeout,
        params={"stream": "true", "starting_after": str(after)},
    )


@pytest.mark.parametrize("which", ["guarded", "plain"])
def test_resuming_at_or_past_the_last_event_is_an_empty_stream_not_an_error(request, which):
    app = request.getfixturevalue(which)
    response_id = create(app, "normal", background=True)["id"]
    wait_status(app, response_id, "completed")
    last = events_of(resume(app, response_id, -1).text)[-1]
    assert last["type"] == "response.completed"
    for after in (last["sequence_number"], last["sequence_number"] + 1, 1000, 10**26):
        r = resume(app, response_id, after)
        assert r.status_code == 200, (after, r.status_code, r.text)
        assert events_of(r.text) == [], (after, r.text)
    rest = events_of(resume(app, response_id, last["sequence_number"] - 1).text)
    assert [e["type"] for e in rest] == ["response.completed"]


@pytest.mark.parametrize("which", ["guarded", "plain"])
def test_a_reset_during_a_resume_ends_with_an_error_event(request, upstream, which):
    app = request.getfixturevalue(which)
    response_id = create(app, "slow", background=True)["id"]
    time.sleep(0.7)  # a few deltas logged
    follow_ups(upstream, "reset")  # the re-stream sends what is logged, then drops the connection
    try:
        r = resume(app, response_id, 2)
    finally:
        follow_ups(upstream, None)
    events = events_of(r.text)
    assert r.status_code == 200 and events[0]["sequence_number"] == 3
    assert events[-1]["type"] == "error" and events[-1]["code"] == "upstream_disconnected", events[-1]
    assert events[-1]["sequence_number"] == events[-2]["sequence_number"] + 1


@pytest.mark.parametrize("which", ["guarded", "plain"])
def test_a_stall_during_a_resume_ends_with_an_error_event_at_the_idle_limit(request, upstream, which):
    app = request.getfixturevalue(which)
    response_id = create(app, "stall", background=True)["id"]  # halts after its second delta
    time.sleep(0.3)
    started = time.monotonic()
    r = resume(app, response_id, 2)
    took = time.monotonic() - started
    events = events_of(r.text)
    assert r.status_code == 200 and events[0]["sequence_number"] == 3
    assert events[-1]["type"] == "error" and events[-1]["code"] == "upstream_timeout", events[-1]
    assert 2.9 <= took < 5, took  # IDLE_TIMEOUT_SECONDS=3


def resumed_stream_ended(upstream: Upstream, response_id: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        records = [s for s in upstream.streams() if s.get("response_id") == response_id]  # the resume's only
        if ended := [s for s in records if s["ended_at"] is not None]:
            return ended[-1]
        assert time.monotonic() < deadline, f"the resumed upstream stream was never closed: {records}"
        time.sleep(0.02)


@pytest.mark.parametrize("which", ["guarded", "plain"])
def test_a_hang_up_during_a_resume_closes_the_upstream_within_a_second(request, upstream, which):
    app = request.getfixturevalue(which)
    # Mid-stream: the caller has read the first events.
    response_id = create(app, "slow", background=True)["id"]
    with httpx.Client(timeout=20) as client:
        with client.stream(
            "GET", f"{app.url}/api/v1/responses/{response_id}", params={"stream": "true", "starting_after": "0"}
        ) as r:
            assert r.status_code == 200
            next(r.iter_raw())
            hung_up = time.time()
    record = resumed_stream_ended(upstream, response_id)
    assert record["outcome"] == "client_disconnected" and record["ended_at"] - hung_up < 1.0
    # Before any output: a background response that halted after its 7 events (0-6), resumed after the last.
    response_id = create(app, "stall", background=True)["id"]
    time.sleep(0.3)
    hung_up = hang_up_after(f"{app.url}/api/v1/responses/{response_id}?stream=true&starting_after=6", "GET", 0.5)
    record = resumed_stream_ended(upstream, response_id)
    assert record["outcome"] == "client_disconnected" and record["ended_at"] - hung_up < 1.0
    line = wait_log_lines(app, "responses.retrieve", 1)[-1]
    assert line["status"] == 499 and line["disconnected"] is True


# ------------------------------------------------------------------------------ 11. query parameters


def test_only_the_query_parameters_openai_defines_reach_the_upstream(app, upstream):
    stored = create(app, "normal")
    base = f"{app.url}/api/v1/responses/{stored['id']}"
    secret = {"code": "fn-key-1", "Code": "fn-key-2", "CODE": "fn-key-3", "cOdE": "fn-key-4"}
    cases = [
        (
            "GET",
            base,
            {"include[]": "message.output_text.logprobs", "foo": "bar"},
            {"include[]": "message.output_text.logprobs"},
        ),
        (
            "GET",
            base + "/input_items",
            {"limit": "1", "order": "asc", "api-version": "x", "stream": "true"},
            {"limit": "1", "order": "asc"},
        ),
        ("DELETE", base, {"force": "1"}, {}),
    ]
    for method, url, params, forwarded in cases:
        r = httpx.request(method, url, params={**secret, **params}, timeout=10)
        assert r.status_code == 200, r.text
        assert upstream.requests(last=1)[-1]["query"] == forwarded
    assert not any(v in json.dumps(upstream.requests(last=5)) for v in secret.values())


# ------------------------------------------------------------------ 13. who can reach a stored response


def test_without_callers_the_function_key_reaches_any_stored_response(app, upstream):
    """docs/openai.md, "Who can read, cancel or delete a stored response": without CALLER_KEYS the
    follow-ups act on any response the upstream account holds, even one made by another program."""
    elsewhere = upstream.http.post(
        "/v1/responses", json={"model": "gpt-test", "input": "[scenario:slow] hi", "background": True}
    ).json()
    base = f"{app.url}/api/v1/responses/{elsewhere['id']}"
    assert httpx.get(base, timeout=10).json()["id"] == elsewhere["id"]
    assert httpx.get(base + "/input_items", timeout=10).json()["data"][0]["content"][0]["text"] == "[scenario:slow] hi"
    assert httpx.post(base + "/cancel", timeout=10).json()["status"] == "cancelled"
    assert httpx.delete(base, timeout=10).json()["deleted"] is True
