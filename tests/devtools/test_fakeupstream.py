"""fakeupstream, started for real (`python -m tools.fakeupstream --port 0`) and spoken to over HTTP."""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from fakeupstream_reads import cuts_inside_characters, hang_up_on_stall, headers_only, raw_reads, stream_record

from tools.fakeupstream import (
    AFTER_FINISH_EXTRA,
    COMPLETION_TOKENS,
    NAMES,
    TEXTS,
    TOOL_CALL_ARGUMENTS,
    TOOL_CALL_ID,
    TOOL_CALL_NAME,
    cadence_text,
    choice_text,
)

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"fakeupstream listening on http://127\.0\.0\.1:(\d+)\n")
USER = [{"role": "user", "content": "Tell me something nice"}]  # 4 prompt "tokens" (words)

pytestmark = pytest.mark.timeout(30)


def start(*args: str, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.fakeupstream", "--port", "0", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    if not select.select([proc.stdout], [], [], 15)[0]:
        proc.kill()
        raise AssertionError(f"no ready line; stderr: {log.read_text()}")
    line = proc.stdout.readline()
    m = READY.fullmatch(line)
    assert m, (line, log.read_text())
    return proc, f"http://127.0.0.1:{m.group(1)}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, base = start(log=tmp_path_factory.mktemp("fakeupstream") / "stderr.log")
    yield base
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=5)


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="sk-test", max_retries=0, timeout=10) as c:
        yield c


def events(raw: bytes) -> list:
    """Parse a complete SSE body strictly: only `data: ...\\n\\n` events."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-80:]
    out = []
    for event in text[:-2].split("\n\n"):
        assert event.startswith("data: "), event
        out.append(event[6:] if event == "data: [DONE]" else json.loads(event[6:]))
    return out


def post_raw(server: str, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server + path, json=body, headers={"authorization": "Bearer sk-test"}, timeout=10)


# --------------------------------------------------------------------- wire format


def test_normal_stream_with_sdk_and_usage(client):
    stream = client.chat.completions.create(
        model="normal", messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXTS["normal"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == {
        "prompt_tokens": 4,
        "completion_tokens": COMPLETION_TOKENS["normal"],
        "total_tokens": 14,
    }
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.model for c in chunks} == {"normal"}


def test_raw_wire_format(server):
    r = post_raw(server, {"model": "normal", "messages": USER, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    evs = events(r.content)
    assert evs[-1] == "[DONE]"
    first, finish = evs[0], evs[-2]
    head = {
        "id": first["id"],
        "object": "chat.completion.chunk",
        "created": first["created"],
        "model": "normal",
        "system_fingerprint": "fp_fake",
    }
    assert first == {
        **head,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "", "refusal": None},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    assert finish == {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
    deltas = [e["choices"][0]["delta"]["content"] for e in evs[1:-2]]
    assert len(deltas) == 10 and "".join(deltas) == TEXTS["normal"]
    assert "usage" not in json.dumps(evs[:-1])  # no include_usage -> no usage anywhere
    assert r.content.startswith(b'data: {"id":"chatcmpl-')  # compact JSON, raw UTF-8 on the wire
    assert "🙂🚀".encode() in r.content and "日本語のテキスト".encode() in r.content


def test_n2_interleaves_choices(server):
    evs = events(post_raw(server, {"model": "normal", "messages": USER, "stream": True, "n": 2}).content)[:-1]
    indexes = [e["choices"][0]["index"] for e in evs]
    assert indexes == [0, 1] * (len(evs) // 2)
    texts = [
        "".join(e["choices"][0]["delta"].get("content") or "" for e in evs if e["choices"][0]["index"] == i)
        for i in (0, 1)
    ]
    assert texts == [TEXTS["normal"], choice_text(TEXTS["normal"], 1)]


def test_non_streaming_completion(client):
    done = client.chat.completions.create(model="length", messages=USER)
    assert done.object == "chat.completion"
    assert done.choices[0].message.content == TEXTS["length"]
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (4, 4, 8)


def test_models_list(client):
    assert [m.id for m in client.models.list()] == list(NAMES)


def test_split_utf8_arrives_cut_inside_characters(server):
    reads = raw_reads(f"{server}/v1/chat/completions", {"model": "split_utf8", "messages": USER, "stream": True})
    whole = b"".join(reads)
    assert len(reads) >= 10
    assert cuts_inside_characters(reads), "no read ended inside a multi-byte character"
    assert any(piece.endswith(b"dat") for piece in reads)
    evs = events(whole)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in evs[:-1]) == TEXTS["split_utf8"]


# ------------------------------------------------------------------- azure shape


def test_azure_filters_with_azure_sdk(server):
    with openai.AzureOpenAI(
        azure_endpoint=server, api_version="2024-10-21", api_key="azure-key-1234", max_retries=0, timeout=10
    ) as az:
        chunks = list(
            az.chat.completions.create(
                model="azure_filters", messages=USER, stream=True, stream_options={"include_usage": True}
            )
        )
    first = chunks[0]
    assert first.choices == [] and first.model == ""
    assert first.model_extra["prompt_filter_results"][0]["prompt_index"] == 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].delta)
    assert text == TEXTS["azure_filters"]
    content = [c for c in chunks if c.choices and c.choices[0].delta and c.choices[0].delta.content]
    assert {c.model for c in content} == {"azure_filters"}  # the deployment name
    assert content[0].choices[0].model_extra["content_filter_results"]["hate"] == {
        "filtered": False,
        "severity": "safe",
    }
    assert any(c.choices and "content_filter_offsets" in c.choices[0].model_extra for c in chunks)
    assert chunks[-1].usage.completion_tokens == COMPLETION_TOKENS["azure_filters"]

    rec = httpx.get(f"{server}/_scripted/requests").json()[-1]
    assert rec["path"] == "/openai/deployments/azure_filters/chat/completions"
    assert rec["query"] == {"api-version": "2024-10-21"}
    assert rec["headers"]["api-key"] == "azure-key-1234"


def test_azure_v1_chat_with_the_plain_sdk(server):
    """Azure's GA v1 API: the plain client on {endpoint}/openai/v1/, the deployment as the model."""
    with openai.OpenAI(base_url=f"{server}/openai/v1/", api_key="azure-key-1234", max_retries=0, timeout=10) as az:
        chunks = list(az.chat.completions.create(model="normal", messages=USER, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXTS["normal"]
    rec = httpx.get(f"{server}/_scripted/requests").json()[-1]
    assert (rec["path"], rec["query"]) == ("/openai/v1/chat/completions", {})
    assert rec["headers"]["authorization"] == "Bearer azure-key-1234"


def test_azure_without_api_version_is_404(server):
    r = post_raw(server, {"messages": USER}, "/openai/deployments/normal/chat/completions")
    assert r.status_code == 404
    assert r.json() == {"error": {"code": "404", "message": "Resource not found"}}


def test_an_unknown_scenario_to_switch_to_is_a_400_that_lists_the_known_ones(server):
    before = httpx.get(server + "/_scripted/default", timeout=5).json()
    for path, body, kind in (
        ("/_scripted/default", {"scenario": "nope"}, "scenario"),
        ("/_scripted/default", [1], "scenario"),
        ("/_scripted/follow_ups", {"scenario": "nope"}, "follow-up scenario"),
    ):
        r = httpx.post(server + path, json=body, timeout=5)
        error = r.json()["error"]
        assert r.status_code == 400 and (error["code"], error["param"]) == ("unknown_scenario", "scenario"), r.text
        assert error["message"].startswith(f"Unknown {kind} ") and "Known: " in error["message"]
    assert httpx.get(server + "/_scripted/default", timeout=5).json() == before  # unchanged


# ------------------------------------------------------------------------ errors


def test_rate_limited_raises_with_retry_after(client):
    with pytest.raises(openai.RateLimitError) as ei:
        client.chat.completions.create(model="rate_limited", messages=USER, stream=True)
    err = ei.value
    assert err.status_code == 429
    assert err.response.headers["retry-after"] == "1"
    assert err.response.headers["retry-after-ms"] == "1000"
    assert (err.type, err.code, err.param) == ("requests", "rate_limit_exceeded", None)


@pytest.mark.parametrize(
    "name, status, type_, code, param",
    [
        ("bad_request", 400, "invalid_request_error", None, "messages"),
        ("forbidden", 403, "request_forbidden", "unsupported_country_region_territory", None),
        ("model_not_found", 404, "invalid_request_error", "model_not_found", None),
        ("server_error", 500, "server_error", None, None),
        ("overloaded", 503, "server_error", None, None),
        ("context_length_exceeded", 400, "invalid_request_error", "context_length_exceeded", "messages"),
        ("content_policy_violation", 400, "invalid_request_error", "content_policy_violation", None),
        ("insufficient_quota", 429, "insufficient_quota", "insufficient_quota", None),
    ],
)
def test_error_scenarios(server, name, status, type_, code, param):
    r = post_raw(server, {"model": name, "messages": USER, "stream": True})
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (type_, code, param)
    assert set(error) == {"message", "type", "param", "code"}
    assert ("retry-after" in r.headers) == (name == "overloaded")


def test_unauthorized_masks_the_key(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="sk-secret-key-9876abcd", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as ei:
            c.chat.completions.create(model="unauthorized", messages=USER)
    assert ei.value.code == "invalid_api_key"
    assert "Incorrect API key provided: sk-...abcd." in ei.value.message
    assert "secret" not in ei.value.message


def test_reset_breaks_the_stream_and_is_recorded(client, server):
    stream = client.chat.completions.create(model="reset", messages=USER, stream=True)
    got = []
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert "".join(got) == TEXTS["reset"]
    assert stream_record(server, stream.response.headers["x-request-id"])["outcome"] == "reset"

    with pytest.raises(httpx.RemoteProtocolError):  # plain httpx: incomplete chunked body
        post_raw(server, {"model": "reset", "messages": USER, "stream": True})


def test_midstream_error_and_malformed_line(client, server):
    with pytest.raises(openai.APIError, match="The server had an error while processing your request."):
        for _ in client.chat.completions.create(model="error_midstream", messages=USER, stream=True):
            pass
    raw = post_raw(server, {"model": "malformed", "messages": USER, "stream": True}).content
    assert raw.endswith(b'\n\ndata: {"id": "broken", not json\n\n') and b"[DONE]" not in raw


def test_after_finish_sends_extra_content(server):
    evs = events(
        post_raw(
            server,
            {"model": "after_finish", "messages": USER, "stream": True, "stream_options": {"include_usage": True}},
        ).content
    )
    finish_at = next(i for i, e in enumerate(evs) if e["choices"] and e["choices"][0]["finish_reason"])
    before = "".join(e["choices"][0]["delta"].get("content") or "" for e in evs[:finish_at])
    after = "".join(e["choices"][0]["delta"].get("content") or "" for e in evs[finish_at + 1 : -2])
    assert (before, after) == (TEXTS["after_finish"], AFTER_FINISH_EXTRA)
    assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 2 and evs[-1] == "[DONE]"


def test_tool_calls_with_sdk(client):
    chunks = list(client.chat.completions.create(model="tool_calls", messages=USER, stream=True))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert (calls[0].id, calls[0].type, calls[0].function.name) == (TOOL_CALL_ID, "function", TOOL_CALL_NAME)
    assert "".join(c.function.arguments for c in calls) == TOOL_CALL_ARGUMENTS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# ------------------------------------------------------- disconnects and cadence


def test_client_hanging_up_on_stall_is_recorded(server):
    body = {"model": "stall", "messages": USER, "stream": True}
    hang_up_on_stall(server, "/v1/chat/completions", body, b"data: ", 3)  # role + 2 deltas, then silence


def test_stall_first_sends_headers_only(server):
    body = {"model": "stall_first", "messages": USER, "stream": True}
    request_id = headers_only(f"{server}/v1/chat/completions", body)
    assert stream_record(server, request_id)["outcome"] == "client_disconnected"


def test_cadence_timing(server):
    body = {"model": "cadence", "messages": USER, "stream": True}
    arrivals, seen = [], b""
    with httpx.Client(timeout=5) as c:
        t0 = time.monotonic()
        with c.stream("POST", f"{server}/v1/chat/completions", json=body) as r:
            for piece in r.iter_raw():
                seen += piece
                arrivals += [time.monotonic() - t0] * piece.count(b'"content":"')
    evs = events(seen)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in evs[:-1]) == cadence_text(40)
    content_times = arrivals[1:]  # the first '"content":""' is the role chunk
    assert len(content_times) == 40
    assert 0.09 <= content_times[0] < 0.8
    assert 0.7 <= content_times[-1] - content_times[0] < 2.0  # 39 intervals of 20 ms, margin for load


# ------------------------------------------------------ scenario choice and records


def test_scenario_choice_order_and_records(server):
    httpx.delete(f"{server}/_scripted/requests")
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 7}
    r = post_raw(server, body)
    assert r.json()["choices"][0]["message"]["content"] == "You said: hello there"  # default: echo
    assert r.json()["model"] == "gpt-4o"

    marked = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x [scenario:length]"}]}
    assert post_raw(server, marked).json()["choices"][0]["finish_reason"] == "length"
    unknown = {"model": "gpt-4o", "messages": [{"role": "user", "content": "[scenario:nope]"}]}
    r = post_raw(server, unknown)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

    assert httpx.post(f"{server}/_scripted/default", json={"scenario": "slow"}).json() == {
        "scenario": "slow",
        "times": None,
    }
    try:
        assert (
            post_raw(server, {"model": "gpt-4o", "messages": USER}).json()["choices"][0]["message"]["content"]
            == TEXTS["slow"]
        )
        assert post_raw(server, marked).json()["choices"][0]["finish_reason"] == "length"  # marker beats default
    finally:
        httpx.post(f"{server}/_scripted/default", json={"scenario": "echo"})

    records = httpx.get(f"{server}/_scripted/requests").json()
    assert [r["json"] for r in records] == [body, marked, unknown, {"model": "gpt-4o", "messages": USER}, marked]
    first = records[0]
    assert (first["method"], first["path"], first["query"]) == ("POST", "/v1/chat/completions", {})
    assert first["headers"]["authorization"] == "Bearer sk-test"
    assert first["headers"]["content-type"] == "application/json"
    assert abs(first["received_at"] - time.time()) < 5
    assert len({r["id"] for r in records}) == 5

    httpx.delete(f"{server}/_scripted/requests")
    assert httpx.get(f"{server}/_scripted/requests").json() == []
    assert httpx.get(f"{server}/_scripted/streams").json() == []


# ----------------------------------------------------------------------- the CLI


def test_cli_refuses_other_hosts():
    r = subprocess.run(
        [sys.executable, "-m", "tools.fakeupstream", "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert r.returncode == 2 and "127.0.0.1 only" in r.stderr and r.stdout == ""


def test_delta_chars_makes_each_cadence_delta_that_long_streamed_or_not(tmp_path):
    proc, base = start(
        "--deltas",
        "5",
        "--delta-chars",
        "1000",
        "--first-token-ms",
        "1",
        "--interval-ms",
        "1",
        log=tmp_path / "stderr.log",
    )
    try:
        evs = events(post_raw(base, {"model": "cadence", "messages": USER, "stream": True}).content)
        deltas = [e["choices"][0]["delta"].get("content") for e in evs[:-1]]
        assert [len(d) for d in deltas if d] == [1000] * 5
        assert "".join(d or "" for d in deltas) == cadence_text(5, 1000)
        assert cadence_text(5, 1000).startswith("lorem lorem ")
        whole = post_raw(base, {"model": "cadence", "messages": USER}).json()
        assert whole["choices"][0]["message"]["content"] == cadence_text(5, 1000)
        assert whole["usage"]["completion_tokens"] == 5
    finally:
        proc.kill()
        proc.wait()


def test_cli_flags_and_quick_stop_with_open_stream(tmp_path):
    proc, base = start(
        "--scenario",
        "stall",
        "--deltas",
        "3",
        "--first-token-ms",
        "1",
        "--interval-ms",
        "1",
        log=tmp_path / "stderr.log",
    )
    try:
        evs = events(post_raw(base, {"model": "cadence", "messages": USER, "stream": True}).content)
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in evs[:-1]) == cadence_text(3)
        with httpx.Client(timeout=5) as c:
            with c.stream("POST", f"{base}/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
                next(r.iter_raw())  # the default scenario, stall, is now holding the stream open
                t0 = time.monotonic()
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=3)
                assert time.monotonic() - t0 < 2
    finally:
        proc.kill()
        proc.wait()


def test_a_default_for_the_next_requests_only(server):
    """``times``: one 429, then the default before it again (a provider's blip)."""
    before = httpx.get(f"{server}/_scripted/default", timeout=5).json()["scenario"]
    answer = httpx.post(f"{server}/_scripted/default", json={"scenario": "rate_limited", "times": 2}, timeout=5)
    assert answer.json() == {"scenario": "rate_limited", "times": 2}
    body = {"model": "gpt-4o", "messages": USER}
    assert [post_raw(server, body).status_code for _ in range(3)] == [429, 429, 200]
    assert httpx.get(f"{server}/_scripted/default", timeout=5).json() == {"scenario": before, "times": None}
    for bad in (0, -1, "2", True):
        r = httpx.post(f"{server}/_scripted/default", json={"scenario": "slow", "times": bad}, timeout=5)
        assert r.status_code == 400
    assert httpx.get(f"{server}/_scripted/default", timeout=5).json()["scenario"] == before


def test_stale_closes_a_request_on_a_kept_connection_unanswered(server):
    """/_scripted/stale: the keep-alive race. A request on a connection that has answered before is
    not answered (the connection closed, nothing recorded); one on a new connection is, and control
    requests always are."""
    chat = {"model": "normal", "messages": USER}
    with httpx.Client(base_url=server, timeout=10) as kept:
        before = kept.get("/_scripted/count").json()["requests"]
        assert kept.post("/_scripted/stale", json={"times": 1}).json() == {
            "times": 1,
            "connections": "kept",
            "dropped": 0,
        }
        # the control request's connection, kept: closed unanswered, seen as the server's hang-up, or
        # as a reset when the request's body arrived after the close (a real server's close does both)
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            kept.post("/v1/chat/completions", json=chat)
        assert kept.post("/v1/chat/completions", json=chat).status_code == 200  # a new connection
        assert kept.get("/_scripted/stale").json() == {"times": 0, "connections": "kept", "dropped": 1}
        assert kept.get("/_scripted/count").json()["requests"] == before + 1
        kept.post("/_scripted/stale", json={"times": 1, "connections": "any"}).raise_for_status()
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        post_raw(server, chat)  # a new connection
    with httpx.Client(base_url=server, timeout=10) as control:
        assert control.get("/_scripted/stale").json() == {"times": 0, "connections": "any", "dropped": 2}
        for wrong in ({"times": -1}, {"times": True}, {"times": 1, "connections": "new"}, {}):
            assert control.post("/_scripted/stale", json=wrong).status_code == 400, wrong
