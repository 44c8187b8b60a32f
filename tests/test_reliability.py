"""Never hang, never leak, always end cleanly: hang-ups, time limits, the status rule, upstream
faults, retries and load, each measured through the local host and the scripted upstream.
docs/reliability.md lists these scenarios with the test that proves each."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
import uuid

import httpx
import pytest
from chat import chat, prompt

from tools.fakeupstream.scenarios import TEXTS


def tag() -> str:
    return uuid.uuid4().hex


def sent_with(upstream, marker: str) -> list[dict]:
    """The chat requests whose last message contains ``marker`` (the shared upstream also records other
    APIs' requests, which have no messages)."""
    return [
        r
        for r in upstream.requests(last=50)
        if isinstance(r["json"], dict)
        and r["json"].get("messages")
        and marker in str(r["json"]["messages"][-1].get("content"))
    ]


def ends_once(result) -> None:
    assert result.terminal_events() in (["done"], ["error"]), result.events
    assert result.events[-1][1] in ("done", "error")


# ---------------------------------------------------------------------------------- time limits


@pytest.fixture(scope="module")
def tight(upstream):
    """An app with short limits: heartbeat 0.5 s, first token 2.5 s, idle 1 s."""
    from helpers import app_env
    from servers import App

    server = App(
        app_env(
            upstream,
            HEARTBEAT_SECONDS="0.5",
            FIRST_TOKEN_TIMEOUT_SECONDS="2.5",
            IDLE_TIMEOUT_SECONDS="1",
            TOTAL_TIMEOUT_SECONDS="30",
        )
    )
    yield server
    server.stop()


def test_stalled_upstream_ends_with_retryable_error_within_idle_limit(tight):
    # Not continued (an answer that is: test_pool_failover.py's continuation tests).
    result = chat(tight.chat_url, prompt("stall"), headers={"x-chatstream-continue": "off"})
    assert result.status == 200
    ends_once(result)
    event, data = result.last
    assert event == "error"
    assert data["error"]["type"] == "upstream_timeout"
    assert data["error"]["retryable"] is True
    last_delta = [t for t, e, _ in result.events if e == "message"][-1]
    silence = result.events[-1][0] - last_delta
    assert 0.9 <= silence <= 2.5, f"error came {silence:.2f}s after the last delta"


def raw_stream(url: str, body: dict, timeout: float = 20) -> tuple[int, list[tuple[float, str]]]:
    """Status and every line of the body with its arrival time (comments included)."""
    lines = []
    started = time.monotonic()
    with httpx.Client(timeout=timeout) as client:
        with client.stream("POST", url, json=body) as r:
            for line in r.iter_lines():
                lines.append((time.monotonic() - started, line))
            return r.status_code, lines


def test_slow_first_token_gets_headers_then_keep_alives_then_an_error_event(tight):
    status, lines = raw_stream(tight.chat_url, prompt("stall_first"))
    assert status == 200
    keep_alives = [t for t, line in lines if line.startswith(":")]
    assert len(keep_alives) >= 3, lines
    assert keep_alives[0] < 1.5, "headers and the first keep-alive go out at the first heartbeat"
    gaps = [b - a for a, b in zip(keep_alives, keep_alives[1:])]
    assert all(0.3 < g < 1.5 for g in gaps), gaps  # heartbeat 0.5 s, margin for a loaded machine
    assert [line for _, line in lines if line.startswith("event:")] == ["event: error"]
    last_t, last_line = [(t, line) for t, line in lines if line][-1]
    assert '"type":"upstream_timeout"' in last_line
    assert 2.3 <= last_t <= 4.5, "ends at the first-token limit"


def test_first_token_limit_before_the_first_heartbeat_is_a_504_status(start_app):
    app = start_app(HEARTBEAT_SECONDS="5", FIRST_TOKEN_TIMEOUT_SECONDS="1")
    started = time.monotonic()
    result = chat(app.chat_url, prompt("stall_first"))
    assert result.status == 504
    assert result.body["error"]["type"] == "upstream_timeout"
    assert result.body["error"]["retryable"] is False  # the app tried: as its x-should-retry says
    assert result.headers["x-should-retry"] == "false"
    assert 0.9 <= time.monotonic() - started <= 3


def test_total_limit_ends_a_live_stream(start_app):
    # `slow` answers 0.2 s to 2.0 s: 1.5 s leaves a loaded machine 1.3 s for the first delta (at 1 s, a
    # CI run beside a chaos soak got none in time: a 504, not the cut this test is about).
    app = start_app(TOTAL_TIMEOUT_SECONDS="1.5", IDLE_TIMEOUT_SECONDS="5")
    result = chat(app.chat_url, prompt("slow"))
    assert result.status == 200
    ends_once(result)
    assert result.last[0] == "error"
    assert result.last[1]["error"]["type"] == "total_timeout"
    assert 0 < len(result.deltas) < len(TEXTS["slow"].split())
    assert result.events[-1][0] < 2.5


# ----------------------------------------------------------------------------- upstream failures


@pytest.mark.parametrize(
    "scenario,status,type_,retryable",
    [
        ("rate_limited", 429, "rate_limited", False),
        ("bad_request", 400, "invalid_request", False),
        ("unauthorized", 502, "upstream_auth", False),
        ("forbidden", 502, "upstream_auth", False),
        ("model_not_found", 400, "model_not_found", False),
        ("server_error", 502, "upstream_error", False),
        ("overloaded", 502, "upstream_error", False),
    ],
)
def test_upstream_errors_before_the_stream_are_statuses(app, upstream, scenario, status, type_, retryable):
    # A 429 cools its model down on the app's single upstream (Retry-After): a model of its own.
    result = chat(
        app.chat_url,
        {**prompt(scenario), "model": "gpt-rate-limited"} if scenario == "rate_limited" else prompt(scenario),
    )
    assert result.status == status, result.raw
    error = result.body["error"]
    assert error["type"] == type_
    assert error["retryable"] is retryable  # the app has retried the upstream already
    assert result.headers["x-should-retry"] == "false"  # the header says the same
    if scenario == "rate_limited":
        assert result.headers["retry-after"] == "1"
    if scenario in ("unauthorized", "forbidden"):
        assert error["message"] == "upstream authentication failed"
    if scenario == "model_not_found":
        assert "'gpt-test'" in error["message"] and error["param"] == "model"
    if scenario == "bad_request":
        upstream_message = [r for r in upstream.requests(last=5) if r["json"]][-1]
        assert error["message"] and upstream_message


def test_upstream_refusing_connections_is_503(start_app):
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = start_app(OPENAI_BASE_URL=f"http://127.0.0.1:{port}/v1")
    result = chat(app.chat_url, {"prompt": "hi"})
    assert result.status == 503
    assert result.body["error"] == {
        "type": "upstream_unavailable",
        "message": "could not reach the model server",
        "retryable": False,  # the app has retried already, as x-should-retry says
    }


@pytest.mark.parametrize(
    "scenario,type_",
    [
        ("reset", "upstream_disconnected"),
        ("malformed", "upstream_malformed"),
        ("odd_shape", "upstream_malformed"),
        ("error_midstream", "upstream_error"),
    ],
)
def test_mid_stream_faults_end_with_one_error_event(app, scenario, type_):
    result = chat(app.chat_url, prompt(scenario))
    assert result.status == 200
    assert result.deltas, "text was streamed before the fault"
    ends_once(result)
    event, data = result.last
    assert event == "error"
    assert data["error"]["type"] == type_
    assert data["error"]["retryable"] is True


# ------------------------------------------------------------------------------------- retries


def test_retries_before_the_first_delta_honour_retry_after(start_app, upstream):
    app = start_app(UPSTREAM_MAX_RETRIES="2")
    marker = tag()
    started = time.monotonic()
    result = chat(app.chat_url, prompt("overloaded", marker))
    elapsed = time.monotonic() - started
    assert result.status == 502
    attempts = sent_with(upstream, marker)
    assert len(attempts) == 3
    gaps = [b["received_at"] - a["received_at"] for a, b in zip(attempts, attempts[1:])]
    assert all(g >= 0.9 for g in gaps), f"retry-after: 1 was not honoured: {gaps}"
    assert elapsed >= 1.8


def test_retries_are_bounded_by_the_first_token_limit(start_app, upstream):
    app = start_app(UPSTREAM_MAX_RETRIES="5", FIRST_TOKEN_TIMEOUT_SECONDS="1.5", HEARTBEAT_SECONDS="10")
    marker = tag()
    started = time.monotonic()
    result = chat(app.chat_url, prompt("rate_limited", marker))
    assert result.status == 504
    assert time.monotonic() - started < 3
    assert len(sent_with(upstream, marker)) <= 2


def test_no_retry_once_content_was_sent(start_app, upstream):
    """No SDK retry after text went out. (With continuations on, the answer goes on with a request of
    its own instead: test_pool_failover.py; here they are off for the request.)"""
    app = start_app(UPSTREAM_MAX_RETRIES="3")
    marker = tag()
    result = chat(app.chat_url, prompt("reset", marker), headers={"x-chatstream-continue": "off"})
    assert result.last[0] == "error"
    assert len(sent_with(upstream, marker)) == 1
    carrying = [r for r in upstream.requests(last=50) if marker in json.dumps((r["json"] or {}).get("messages"))]
    assert len(carrying) == 1, "no request at all after the first"


# ----------------------------------------------------------------------------------- hang-ups


def test_hang_up_while_waiting_for_the_first_token_closes_the_upstream(app, upstream):
    marker = tag()
    with httpx.Client(timeout=10) as client:
        request = client.build_request("POST", app.chat_url, json=prompt("stall_first", marker))
        response = client.send(request, stream=True) if False else None  # headers are held: don't wait
        del response
        with socket.create_connection(("127.0.0.1", int(app.url.rsplit(":", 1)[1]))) as s:
            body = request.content
            s.sendall(
                b"POST /api/chat HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            deadline = time.monotonic() + 5
            while not sent_with(upstream, marker) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert sent_with(upstream, marker), "the upstream never got the request"
            time.sleep(0.3)
            hung_up = time.time()
    record = upstream.wait_stream_end("stall_first", timeout=3)
    assert record["outcome"] == "client_disconnected"
    assert record["ended_at"] - hung_up < 1.0
    app.wait_log(r'"status": 499[^\n]*"disconnected": true')


async def _drop_at_random(client: httpx.AsyncClient, url: str, rng: random.Random) -> None:
    scenario = rng.choice(["slow", "normal", "stall", "stall_first"])
    keep = rng.randint(-1, 4)  # -1: hang up before the response starts
    try:
        async with asyncio.timeout(rng.uniform(0.05, 0.3) if keep < 0 else 10):
            async with client.stream("POST", url, json=prompt(scenario)) as r:
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if n > keep * 2:
                        break
    except TimeoutError:
        pass


def _stats(app) -> dict:
    """Tasks, descriptors and memory summed over the host and its worker processes."""
    stats = httpx.get(app.url + "/_devhost/stats").json()
    assert stats["workers"], stats  # the worker's own figures are in the sums
    return stats


def _settle(app, upstream, baseline: dict, timeout: float = 12.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        running = [s for s in upstream.streams() if s["ended_at"] is None]
        now = _stats(app)
        if not running and now["tasks"] <= baseline["tasks"] and now["open_fds"] <= baseline["open_fds"] + 2:
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.25)


def test_two_hundred_dropped_streams_leave_nothing_behind(start_app, upstream):
    app = start_app(HEARTBEAT_SECONDS="0.3")
    rng = random.Random(1234)

    async def wave():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=15, limits=limits) as client:
            await asyncio.gather(*(_drop_at_random(client, app.chat_url, rng) for _ in range(200)))

    time.sleep(6)  # let start-up connections idle out
    asyncio.run(wave())  # warm-up: imports, pools, caches
    baseline = _settle(app, upstream, {"tasks": 10**6, "open_fds": 10**6})
    asyncio.run(wave())
    after = _settle(app, upstream, baseline)
    print("leak check:", baseline, after)
    assert not [s for s in upstream.streams() if s["ended_at"] is None], "an upstream stream is still open"
    assert after["tasks"] <= baseline["tasks"], (baseline, after)
    assert after["open_fds"] <= baseline["open_fds"] + 2, (baseline, after)
    assert after["rss_kb"] - baseline["rss_kb"] < 15_000, (baseline, after)


# ---------------------------------------------------------------------------------------- load


def test_two_hundred_concurrent_streams_are_all_exact(app):
    async def one(client, i):
        scenario = ("normal", "split_utf8", "azure_filters", "slow")[i % 4]
        async with client.stream("POST", app.chat_url, json=prompt(scenario)) as r:
            assert r.status_code == 200
            text, last = [], None
            from httpx_sse import EventSource

            async for sse in EventSource(r).aiter_sse():
                if sse.event == "message":
                    text.append(sse.json()["delta"])
                else:
                    last = sse.event
            return scenario, "".join(text), last

    async def run():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run())
    assert len(results) == 200
    for scenario, text, last in results:
        assert last == "done"
        assert text == TEXTS[scenario]


# ------------------------------------------------------------------------------ hostile input


def _raw_request(app, head: bytes, body_parts, pause: float = 0.0, timeout: float = 5.0) -> tuple[bytes, float, int]:
    """Send ``head`` then body parts; returns (response bytes, seconds to first response byte,
    body bytes sent by then)."""
    port = int(app.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(timeout)
        s.sendall(head)
        sent = 0
        started = time.monotonic()
        s.setblocking(False)
        for part in body_parts:
            try:
                data = s.recv(65536)
                if data:
                    s.setblocking(True)
                    return data + _read_rest(s), time.monotonic() - started, sent
            except BlockingIOError:
                pass
            try:
                s.sendall(part)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                break
            sent += len(part)
            time.sleep(pause)
        s.setblocking(True)
        data = s.recv(65536)
        return data + _read_rest(s), time.monotonic() - started, sent


def _read_rest(s: socket.socket) -> bytes:
    s.settimeout(0.3)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def test_oversized_body_is_413_before_it_is_read(app, upstream):
    before = upstream.count()
    head = b"POST /api/chat HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 5000000\r\n\r\n"
    parts = [b"{" + b" " * 9999] + [b" " * 10000] * 499
    response, seconds, sent = _raw_request(app, head, parts, pause=0.01)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b'"type":"request_too_large"' in response
    assert sent < 1_000_000, f"{sent} bytes were sent before the 413"
    assert upstream.count() == before


def test_oversized_chunked_body_is_413(app):
    head = b"POST /api/chat HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    parts = [b"%x\r\n%s\r\n" % (8192, b" " * 8192)] * 500  # 4 MiB offered
    response, _, sent = _raw_request(app, head, parts, pause=0.002)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert sent <= 2_000_000, f"{sent} bytes were sent before the 413"


def test_huge_arrays_are_400(app):
    body = {"messages": [{"role": "user", "content": "x"}] * 5000}
    result = chat(app.chat_url, body)
    assert result.status == 400
    assert result.body["error"]["param"] == "messages"
