"""UPSTREAMS wired into the request path (issue #14, docs/pool.md): three scripted upstreams (three
processes) behind one app started with UPSTREAMS; each upstream plays its own default scenario
(requests carry no scenario marker), so one entry can fail while the others answer.

The cooldown and breaker timings are also checked in-process with a clock the test controls
(``Upstreams`` talking HTTP to the same scripted upstreams), and the weighted split with fake
clients, so nothing here waits for a back-off."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import time

import httpx
import openai
import pytest
from chat import chat
from helpers import TEST_KEY
from servers import ROOT, App, Upstream

from chatstream.apis.completions import CompletionStream
from chatstream.pipeline import Pipeline
from chatstream.record import StreamRecord
from chatstream.settings import Settings
from chatstream.stream import Done, Ends, Failed, TimeLimits, relay
from chatstream.upstreams.failover import Upstreams
from tools.fakeupstream.scenarios import (
    NORMAL_DELTAS,
    RESET_DELTAS,
    TEXTS,
    TOOL_CALL_ARGUMENT_DELTAS,
    count_prompt_tokens,
)

NORMAL = TEXTS["normal"]
HI = {"prompt": "hi"}  # no scenario marker: each upstream plays its default


@pytest.fixture(scope="module")
def three():
    servers = [Upstream("--scenario", "normal") for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def ups(three):
    """The three upstreams, each back on its default scenario ``normal``."""
    for server in three:
        server.http.post("/_scripted/default", json={"scenario": "normal"}).raise_for_status()
        server.http.post("/_scripted/failure", json={}).raise_for_status()
        server.http.post("/_scripted/continuation", json={}).raise_for_status()
    return three


def play(server: Upstream, scenario: str) -> None:
    server.http.post("/_scripted/default", json={"scenario": scenario}).raise_for_status()


def entry(name: str, server: Upstream | str, **extra) -> dict:
    url = server if isinstance(server, str) else server.base_url
    return {"name": name, "base_url": url, **extra}


def upstreams(*entries: dict) -> str:
    return json.dumps(list(entries))


def counts(*servers: Upstream) -> list[int]:
    return [s.count() for s in servers]


def refused_url() -> str:
    """A local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def log_record(app: App, pattern: str) -> dict:
    line = app.wait_log(r'\{"event": "chat_stream"[^\n]*' + pattern + r"[^\n]*")
    return json.loads(line.group(0))


def pool_state(app: App) -> dict[str, dict]:
    r = httpx.get(app.url + "/api/_pool", timeout=10)
    assert r.status_code == 200
    return {e["name"]: e for e in r.json()["upstreams"]}


# ------------------------------------------------------------------------------------- over HTTP


def test_priority_order_and_the_pool_route(ups, start_app, upstream):
    a, b, c = ups
    app = start_app(
        UPSTREAMS=upstreams(
            entry("c", c, priority=3), entry("a", a, priority=1, api_key_setting="A_KEY"), entry("b", b, priority=2)
        ),
        A_KEY=TEST_KEY,
    )
    before = counts(a, b, c)
    legacy_before = upstream.count()  # start_app also sets OPENAI_BASE_URL to this one: UPSTREAMS wins
    for _ in range(3):
        result = chat(app.chat_url, HI)
        assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b, c), before)] == [3, 0, 0]
    assert upstream.count() == legacy_before
    assert a.requests(last=1)[-1]["headers"]["authorization"] == f"Bearer {TEST_KEY}"
    record = log_record(app, r'"upstream": "a", "attempts": 1')
    assert record["status"] == 200
    r = httpx.get(app.url + "/api/_pool", timeout=10)
    assert TEST_KEY not in r.text, "the status route never shows a key"
    state = {e["name"]: e for e in r.json()["upstreams"]}
    assert r.json()["source"] == "UPSTREAMS"
    assert state["a"]["state"] == "ok" and state["a"]["key_setting"] == "A_KEY"
    assert state["a"]["counters"]["requests"] == 3 and state["a"]["counters"]["successes"] == 3
    assert state["b"]["counters"]["requests"] == 0


def test_429_moves_the_request_on_and_cools_the_entry_down(ups, start_app):
    a, b, c = ups
    play(a, "rate_limited")  # retry-after: 1
    app = start_app(UPSTREAMS=upstreams(entry("a", a, priority=1), entry("b", b, priority=2)))
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b), before)] == [1, 1]
    # While it cools down (Retry-After: 1) the first entry is not called at all. (A clock the test
    # controls: test_cooldown_follows_the_clock; non-streamed calls: the all-cooling-down test.)
    result = chat(app.chat_url, HI)
    assert result.status == 200
    assert [n - m for n, m in zip(counts(a, b), before)] == [1, 2]
    log_record(app, r'"upstream": "b", "attempts": 2')
    log_record(app, r'"upstream": "b", "attempts": 1')
    assert pool_state(app)["a"]["counters"]["cooldowns"] == 1

    # Once the cooldown is over (Retry-After: 1) it is tried first again.
    time.sleep(1.2)
    play(a, "normal")
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b), before)] == [2, 2]


def test_5xx_and_503_fail_over_without_the_sdk_retrying_the_same_entry(ups, start_app):
    a, b, c = ups
    play(a, "server_error")
    play(b, "overloaded")
    app = start_app(
        UPSTREAMS=upstreams(entry("a", a, priority=1), entry("b", b, priority=2), entry("c", c, priority=3)),
        UPSTREAM_MAX_RETRIES="2",
    )  # the SDK would retry each entry twice
    before = counts(a, b, c)
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b, c), before)] == [1, 1, 1], "one call per entry"
    log_record(app, r'"upstream": "c", "attempts": 3')
    # Non-streamed calls fail over the same way, one whole call per entry.
    r = httpx.post(
        app.url + "/api/v1/chat/completions",
        timeout=10,
        json={"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == NORMAL
    assert [n - m for n, m in zip(counts(a, b, c), before)] == [2, 2, 2]
    log_record(app, r'"endpoint": "openai"[^\n]*"upstream": "c", "attempts": 3')
    state = pool_state(app)
    assert state["a"]["consecutive_failures"] == 2 and state["a"]["counters"]["failovers"] == 2
    assert state["a"]["state"] == "ok", "a 5xx is one failure; the third in a row opens the breaker"


def test_refused_connection_opens_the_breaker_at_once(ups, start_app):
    a, b, c = ups
    app = start_app(UPSTREAMS=upstreams(entry("down", refused_url(), priority=1), entry("b", b, priority=2)))
    before = counts(b)
    for _ in range(3):
        result = chat(app.chat_url, HI)
        assert result.status == 200 and result.text == NORMAL
    assert counts(b)[0] - before[0] == 3
    log_record(app, r'"upstream": "b", "attempts": 2')
    log_record(app, r'"upstream": "b", "attempts": 1')  # the open entry is skipped
    state = pool_state(app)["down"]
    assert state["state"] == "open" and state["counters"]["requests"] == 1
    assert "breaker open" in app.log()


def test_a_healed_primary_serves_again_within_the_probe_interval(ups, start_app):
    """Issue 42: a primary answering 503 for a while, then healthy, with a request every half second:
    however many probes failed during the outage, it is probed again within UPSTREAM_PROBE_SECONDS
    and serves the next request after that (the back-off used to double up to 300 s)."""
    a, b, c = ups
    play(a, "overloaded")  # 503
    probe_every = 3.0
    app = start_app(
        UPSTREAMS=upstreams(entry("a", a, priority=1), entry("b", b, priority=2)),
        UPSTREAM_OPEN_SECONDS="1",
        UPSTREAM_PROBE_SECONDS=str(probe_every),
    )
    outage_ends = time.monotonic() + 9
    for _ in range(200):  # bounded: ~18 requests in 9 s
        if time.monotonic() >= outage_ends:
            break
        result = chat(app.chat_url, HI)
        assert result.status == 200 and result.text == NORMAL, "the fallback answers during the outage"
        time.sleep(0.5)
    state = pool_state(app)["a"]
    # Three failures opened it, then probes failed after 1 s and 2 s: doubling on would be 4, 8 … s.
    assert state["counters"]["opens"] >= 3, state
    assert state["state"] in ("open", "half_open") and 0 <= state["next_probe"] <= probe_every, state
    assert re.search(r"upstream a: server_error, breaker open: skipped, next probe in \d", app.log())

    play(a, "normal")  # healed
    healed = time.monotonic()
    back_after = None
    for _ in range(100):  # bounded: one request every half second for at most ~20 s
        if time.monotonic() - healed > probe_every + 20:
            break
        before = a.count()
        result = chat(app.chat_url, HI)
        assert result.status == 200 and result.text == NORMAL
        if a.count() > before:  # a took it: healed, so it answered
            back_after = time.monotonic() - healed
            break
        time.sleep(0.5)
    assert back_after is not None, "the healed primary never served again"
    # Within the probe interval, plus the pause between requests and two requests' time on a busy
    # machine (2.2 s measured on a quiet one).
    assert back_after <= probe_every + 4, back_after
    state = pool_state(app)["a"]
    assert state["state"] == "ok" and state["next_probe"] is None


def test_all_entries_cooling_down_is_a_429_with_retry_after_and_no_upstream_call(ups, start_app):
    a, b, c = ups
    play(a, "rate_limited")
    play(b, "rate_limited")
    app = start_app(UPSTREAMS=upstreams(entry("a", a, priority=1), entry("b", b, priority=1)))
    first = chat(app.chat_url, HI)
    assert first.status == 429, "the last entry's own 429 when every one was tried"
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 429
    assert result.body["error"]["type"] == "rate_limited" and result.body["error"]["retryable"] is False
    assert result.headers["retry-after"] == "1"
    assert result.headers["x-should-retry"] == "false"
    r = httpx.post(
        app.url + "/api/v1/chat/completions",
        timeout=10,
        json={"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert counts(a, b) == before, "no upstream was called"
    log_record(app, r'"status": 429[^\n]*"attempts": 0')


def test_without_continuations_a_failure_after_the_first_delta_ends_the_stream_on_its_entry(ups, start_app):
    a, b, c = ups
    play(a, "reset")  # 3 deltas, then the connection drops
    app = start_app(
        UPSTREAMS=upstreams(entry("a", a, priority=1), entry("b", b, priority=2)), CONTINUE_ON_UPSTREAM_FAILURE="off"
    )
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 200
    assert result.text == "".join(RESET_DELTAS)
    assert result.terminal_events() == ["error"]
    assert result.last[1]["error"]["type"] == "upstream_disconnected"
    assert [n - m for n, m in zip(counts(a, b), before)] == [1, 0], "no second entry is called"
    log_record(app, r'"upstream": "a", "attempts": 1')
    state = pool_state(app)["a"]
    assert state["counters"]["failures"] == 1 and state["counters"]["failovers"] == 0


def test_a_slow_first_token_moves_to_the_next_entry_within_the_first_token_limit(ups, start_app):
    a, b, c = ups
    play(a, "stall_first")
    app = start_app(
        UPSTREAMS=upstreams(entry("a", a, priority=1), entry("b", b, priority=2)),
        UPSTREAM_FIRST_TOKEN_TIMEOUT_SECONDS="1",
        FIRST_TOKEN_TIMEOUT_SECONDS="10",
    )
    started = time.monotonic()
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL
    assert 1.0 <= time.monotonic() - started < 5
    log_record(app, r'"upstream": "b", "attempts": 2')
    a.wait_stream_end("stall_first")  # the stalled stream was closed


def test_models_go_to_the_entries_that_serve_them(ups, start_app):
    a, b, c = ups
    app = start_app(
        UPSTREAMS=upstreams(
            entry("a", a, models=["model-a"]),
            entry("b", b, models=["model-b"]),
            {
                "name": "c",
                "azure_endpoint": c.url,
                "api_key_setting": "C_KEY",
                "models": ["model-a", "model-c"],
                "deployments": {"model-c": "deploy-c"},
                "priority": 2,
            },
        ),
        C_KEY="azure-key-c",
    )
    before = counts(a, b, c)
    for model, where in (("model-b", b), ("model-a", a), ("model-c", c)):
        result = chat(app.chat_url, {**HI, "model": model})
        assert result.status == 200 and result.text == NORMAL, model
        sent = where.requests(last=1)[-1]
        assert sent["json"]["model"] == ("deploy-c" if where is c else model)
    assert c.requests(last=1)[-1]["path"] == "/openai/v1/chat/completions"  # Azure's v1 API
    assert c.requests(last=1)[-1]["headers"]["authorization"] == "Bearer azure-key-c"
    assert [n - m for n, m in zip(counts(a, b, c), before)] == [1, 1, 1]

    result = chat(app.chat_url, {**HI, "model": "model-z"})
    assert result.status == 400
    assert result.body["error"]["type"] == "model_not_allowed" and result.body["error"]["param"] == "model"
    assert [n - m for n, m in zip(counts(a, b, c), before)] == [1, 1, 1], "no upstream call"
    models = httpx.get(app.url + "/api/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["model-a", "model-b", "model-c"]


@pytest.mark.parametrize(
    "value, message",
    [
        ("not json", r"UPSTREAMS: not valid JSON"),
        (
            '[{"name": "a", "base_url": "http://127.0.0.1:1/v1"}, {"name": "bad", "base_url": "http://x/v1", "weight": 0}]',
            r'UPSTREAMS\[1\] \("bad"\): weight: Input should be greater than 0',
        ),
        (
            '[{"name": "k", "base_url": "http://x/v1", "api_key": "' + TEST_KEY + '"}]',
            r'UPSTREAMS\[0\] \("k"\): api_key: unknown key \(a key never goes in UPSTREAMS',
        ),
        (
            '[{"name": "m", "base_url": "http://x/v1", "api_key_setting": "MISSING_KEY"}]',
            r'UPSTREAMS\[0\] \("m"\): api_key_setting: the app setting MISSING_KEY is not set or empty',
        ),
    ],
)
def test_a_bad_upstreams_value_stops_the_app_with_a_clear_message(ups, value, message):
    with pytest.raises(RuntimeError) as failed:
        App({"UPSTREAMS": value, "OPENAI_API_KEY": TEST_KEY})
    text = str(failed.value)
    assert "SettingsError" in text
    assert re.search(message, text), text[-2000:]
    assert TEST_KEY not in text, "never a key in the message"


# ---------------------------------------------------------------------------- in-process wiring


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def in_process(env: dict[str, str], clock: Clock, **pool_args) -> Upstreams:
    settings = Settings.from_env({"UPSTREAM_MAX_RETRIES": "0", **env})
    return Upstreams.from_settings(settings, now=clock, **pool_args)


def params(stream: bool = False) -> dict:
    p = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        p["stream"] = True
    return p


async def stream_once(pool: Upstreams) -> tuple[object, StreamRecord]:
    """One streamed request through the core, as the endpoint runs it; its final event."""
    return await stream_once_with(pool, StreamRecord(endpoint="chat", model="gpt-test"))


def test_cooldown_follows_the_clock(ups):
    a, b, c = ups
    play(a, "rate_limited")
    clock = Clock()
    pool = in_process({"UPSTREAMS": upstreams(entry("a", a, priority=1), entry("b", b, priority=2))}, clock)

    async def run():
        record = StreamRecord(endpoint="openai", model="gpt-test")
        body = await pool.complete("/chat/completions", params(), record)
        assert body["choices"][0]["message"]["content"] == NORMAL
        assert (record.upstream, record.attempts) == ("b", 2)
        before = counts(a)
        clock.t += 0.9  # Retry-After: 1
        final, record = await stream_once(pool)
        assert isinstance(final, Done) and (record.upstream, record.attempts) == ("b", 1)
        assert counts(a) == before, "a is not called while it cools down"
        clock.t += 0.2
        play(a, "normal")
        final, record = await stream_once(pool)
        assert isinstance(final, Done) and (record.upstream, record.attempts) == ("a", 1)
        await asyncio.gather(*(cl.close() for cl in pool.clients.values()))

    asyncio.run(run())


def test_breaker_opens_after_failures_and_a_half_open_probe_closes_it(ups):
    a, b, c = ups
    play(a, "server_error")
    clock = Clock()
    pool = in_process({"UPSTREAMS": upstreams(entry("a", a, priority=1), entry("b", b, priority=2))}, clock)

    async def run():
        for _ in range(3):  # three consecutive 500s open the breaker
            final, record = await stream_once(pool)
            assert isinstance(final, Done) and (record.upstream, record.attempts) == ("b", 2)
        state = {e["name"]: e for e in pool.state()["upstreams"]}
        assert state["a"]["state"] == "open"
        before = counts(a)
        final, record = await stream_once(pool)
        assert (record.upstream, record.attempts) == ("b", 1) and counts(a) == before

        clock.t += 5.0  # the first back-off: half-open, the next request probes a
        play(a, "normal")
        final, record = await stream_once(pool)
        assert isinstance(final, Done) and (record.upstream, record.attempts) == ("a", 1)
        state = {e["name"]: e for e in pool.state()["upstreams"]}
        assert state["a"]["state"] == "ok" and state["a"]["counters"]["opens"] == 1
        await asyncio.gather(*(cl.close() for cl in pool.clients.values()))

    asyncio.run(run())


def test_every_entry_failing_answers_the_last_error(ups):
    a, b, c = ups
    play(a, "server_error")
    play(b, "bad_request")  # not a failover: that answer, c is never called
    clock = Clock()
    pool = in_process(
        {"UPSTREAMS": upstreams(entry("a", a, priority=1), entry("b", b, priority=2), entry("c", c, priority=3))}, clock
    )
    before = counts(c)

    async def run():
        final, record = await stream_once(pool)
        assert isinstance(final, Failed) and final.error.status == 400 and final.error.type == "invalid_request"
        assert (record.upstream, record.attempts) == ("b", 2)
        await asyncio.gather(*(cl.close() for cl in pool.clients.values()))

    asyncio.run(run())
    assert counts(c) == before


def test_the_request_first_token_limit_during_the_walk_counts_against_the_entry(ups):
    a, b, c = ups
    play(a, "stall_first")
    clock = Clock()
    pool = in_process(
        {
            "UPSTREAMS": upstreams(entry("a", a, priority=1), entry("b", b, priority=2)),
            "FIRST_TOKEN_TIMEOUT_SECONDS": "1",
        },
        clock,
    )
    before = counts(b)

    async def run():
        final, record = await stream_once(pool)
        assert isinstance(final, Failed) and final.error.type == "upstream_timeout"
        assert (record.upstream, record.attempts) == ("a", 1)
        await asyncio.gather(*(cl.close() for cl in pool.clients.values()))

    asyncio.run(run())
    assert counts(b) == before, "no time was left for b"
    a.wait_stream_end("stall_first")  # the stalled stream was closed
    state = {e["name"]: e for e in pool.state()["upstreams"]}
    assert state["a"]["consecutive_failures"] == 1 and state["a"]["probing"] is False


def test_per_entry_metrics_and_the_span_name_the_entry(ups):
    from test_telemetry import READER, SPANS, _install_providers

    from chatstream import telemetry

    _install_providers()
    a, b, c = ups
    play(a, "rate_limited")
    first, second = f"a-{time.monotonic_ns()}", f"b-{time.monotonic_ns()}"
    pool = in_process({"UPSTREAMS": upstreams(entry(first, a, priority=1), entry(second, b, priority=2))}, Clock())

    async def run():
        record = StreamRecord(endpoint="chat", model=f"pool-model-{first}")
        telemetry.begin(record)
        final, _ = await stream_once_with(pool, record)
        telemetry.finish(record)
        assert isinstance(final, Done)
        await asyncio.gather(*(cl.close() for cl in pool.clients.values()))
        return record

    record = asyncio.run(run())
    (span,) = [s for s in SPANS.get_finished_spans() if s.attributes.get("gen_ai.request.model") == record.model]
    assert span.attributes["chat.upstream"] == second and span.attributes["chat.attempts"] == 2

    values: dict[tuple, int] = {}
    data = READER.get_metrics_data()
    for resource_metrics in data.resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if point.attributes.get("upstream") in (first, second):
                        key = (metric.name, point.attributes["upstream"], point.attributes.get("reason"))
                        values[key] = values.get(key, 0) + point.value
    assert values == {
        ("chat.upstream.requests", first, None): 1,
        ("chat.upstream.requests", second, None): 1,
        ("chat.upstream.failovers", first, "rate_limited"): 1,
        ("chat.upstream.cooldowns", first, None): 1,
    }


async def stream_once_with(pool: Upstreams, record: StreamRecord):
    limits = TimeLimits(pool.settings)
    final = None
    async for event in relay(
        pool, "/chat/completions", params(True), CompletionStream(Pipeline()), limits, record, Ends(lambda: None)
    ):
        final = event
    return final, record


def test_401_moves_on_and_is_logged_for_its_entry_unless_routed_to_stop(ups, start_app):
    a, b, c = ups
    play(a, "unauthorized")
    pool = upstreams(entry("east", a, priority=1, api_key_setting="EAST_KEY"), entry("west", b, priority=2))
    app = start_app(UPSTREAMS=pool, EAST_KEY=TEST_KEY)
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL, "auth errors go to the next entry by default"
    assert [n - m for n, m in zip(counts(a, b), before)] == [1, 1]
    app.wait_log(r"upstream east: authentication failed")
    log_record(app, r'"status": 200[^\n]*"upstream": "west", "attempts": 2')
    assert pool_state(app)["east"]["counters"]["failures"] == 0, "our key, not the entry's health"
    assert TEST_KEY not in app.log()

    app = start_app(UPSTREAMS=pool, EAST_KEY=TEST_KEY, UPSTREAM_ERROR_ROUTES="auth=stop")
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 502 and result.body["error"]["type"] == "upstream_auth"
    assert "code" not in result.body["error"], "never the upstream's invalid_api_key: the caller's key is fine"
    assert [n - m for n, m in zip(counts(a, b), before)] == [1, 0]
    log_record(app, r'"status": 502[^\n]*"upstream": "east", "attempts": 1')


def test_same_entry_first_waits_out_a_short_retry_after_and_retries_a_5xx_once(ups, start_app):
    """Issue 42: with UPSTREAM_RETRY_AFTER_WAIT_SECONDS a 429 asking for 1 s is waited out on the same
    entry; with UPSTREAM_RETRY_SERVER_ERROR a 500 is tried once more there; each once per request."""
    a, b, c = ups
    pool = upstreams(entry("a", a, priority=1), entry("b", b, priority=2))
    app = start_app(UPSTREAMS=pool, UPSTREAM_RETRY_AFTER_WAIT_SECONDS="2", UPSTREAM_RETRY_SERVER_ERROR="true")

    a.http.post("/_scripted/default", json={"scenario": "rate_limited", "times": 1}).raise_for_status()
    before = counts(a, b)
    started = time.monotonic()
    result = chat(app.chat_url, HI)
    took = time.monotonic() - started
    assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b), before)] == [2, 0], "the 429, then the same entry again"
    assert 1.0 <= took < 1.0 + 10, took  # the Retry-After (1 s), and no more than a busy machine adds
    log_record(app, r'"upstream": "a", "attempts": 2')

    a.http.post("/_scripted/default", json={"scenario": "server_error", "times": 1}).raise_for_status()
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b), before)] == [2, 0], "the 500, then the same entry at once"
    assert pool_state(app)["a"]["counters"]["failures"] == 1, "the 500 still counts against the entry"

    play(a, "server_error")  # not a blip: once more on a, then b
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b), before)] == [2, 1]
    log_record(app, r'"upstream": "b", "attempts": 3')

    # A wait longer than the setting moves on at once, as without it.
    app = start_app(UPSTREAMS=pool, UPSTREAM_RETRY_AFTER_WAIT_SECONDS="0.5")
    play(a, "rate_limited")
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 200 and [n - m for n, m in zip(counts(a, b), before)] == [1, 1]


def test_a_context_length_error_goes_to_an_entry_with_a_larger_window(ups, start_app):
    """Issue 42: a 400 context_length_exceeded moves the request on only to entries that declare a
    larger context_window (b declares none: skipped); it counts nothing against the entry."""
    a, b, c = ups
    play(a, "context_length_exceeded")
    app = start_app(
        UPSTREAMS=upstreams(
            entry("small", a, priority=1, context_window=8192),
            entry("unknown", b, priority=2),
            entry("large", c, priority=3, context_window=128000),
        )
    )
    before = counts(a, b, c)
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b, c), before)] == [1, 0, 1]
    log_record(app, r'"upstream": "large", "attempts": 2')
    state = pool_state(app)["small"]
    assert state["state"] == "ok" and state["counters"]["failures"] == 0 and state["counters"]["failovers"] == 1
    # No entry larger than the largest: the upstream's own 400, its code kept.
    play(c, "context_length_exceeded")
    r = httpx.post(
        app.url + "/api/v1/chat/completions",
        json={"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=20,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert [n - m for n, m in zip(counts(a, b, c), before)] == [2, 0, 2]


def test_a_content_filter_refusal_is_the_answer_unless_configured(ups, start_app):
    a, b, c = ups
    play(a, "content_policy_violation")
    pool = upstreams(entry("a", a, priority=1), entry("b", b, priority=2))
    app = start_app(UPSTREAMS=pool)
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 400 and result.body["error"]["code"] == "content_policy_violation"
    assert [n - m for n, m in zip(counts(a, b), before)] == [1, 0]
    app = start_app(UPSTREAMS=pool, UPSTREAM_ERROR_ROUTES="content_filter=next")
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL
    assert [n - m for n, m in zip(counts(a, b), before)] == [2, 1]


def test_keyless_azure_entries_share_one_entra_credential(ups):
    from test_upstreams import TokenCredential

    from chatstream.upstreams.clients import ENTRA_SCOPE

    a, b, c = ups
    play(a, "server_error")
    credential = TokenCredential(lifetime=3600)
    env = {
        "UPSTREAMS": upstreams(
            {
                "name": "east",
                "azure_endpoint": a.url,
                "priority": 1,
                "deployments": {"gpt-test": "dep-east"},
                "models": ["gpt-test"],
            },
            {"name": "west", "azure_endpoint": b.url, "priority": 2, "api_version": "2025-01-01-preview"},
        )
    }
    settings = Settings.from_env({"UPSTREAM_MAX_RETRIES": "0", **env})
    pool = Upstreams.from_settings(settings, credential=credential)

    async def run():
        final, record = await stream_once(pool)
        assert isinstance(final, Done) and (record.upstream, record.attempts) == ("west", 2)
        await asyncio.gather(*(cl.close() for cl in pool.clients.values()))

    asyncio.run(run())
    east, west = a.requests(last=1)[-1], b.requests(last=1)[-1]
    assert (east["path"], east["query"], east["json"]["model"]) == ("/openai/v1/chat/completions", {}, "dep-east")
    assert west["path"] == "/openai/deployments/gpt-test/chat/completions"
    assert west["query"] == {"api-version": "2025-01-01-preview"}
    assert east["headers"]["authorization"] == west["headers"]["authorization"] == "Bearer token-1"
    assert credential.calls == [(ENTRA_SCOPE,)], "one token for both entries"


def test_the_responses_api_fails_over_and_follow_ups_find_the_entry_that_holds_the_response(ups, start_app):
    from tools.fakeupstream import RESPONSES_TEXTS

    a, b, c = ups
    play(a, "server_error")
    app = start_app(UPSTREAMS=upstreams(entry("a", a, priority=1), entry("b", b, priority=2)))
    sdk = openai.OpenAI(base_url=app.url + "/api/v1", api_key="unused", max_retries=0, timeout=20)
    try:
        before = counts(a, b)
        events = list(sdk.responses.create(model="gpt-test", input="hello", stream=True))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == RESPONSES_TEXTS["normal"]
        assert [n - m for n, m in zip(counts(a, b), before)] == [1, 1]
        log_record(app, r'"endpoint": "responses"[^\n]*"upstream": "b", "attempts": 2')

        created = sdk.responses.create(model="gpt-test", input="hello")
        assert created.output_text == RESPONSES_TEXTS["normal"]
        play(a, "normal")
        again = sdk.responses.retrieve(created.id)  # a does not know it (404), b does
        assert again.id == created.id and again.output_text == RESPONSES_TEXTS["normal"]
        assert a.requests(last=1)[-1]["path"] == b.requests(last=1)[-1]["path"] == f"/v1/responses/{created.id}"
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve("resp_unknown_to_everyone")
    finally:
        sdk.close()


# ------------------------------------------------------------------ the walk with scripted streams


# ------------------------------------------- an answer cut mid-stream goes on on the next entry

CUT = "".join(NORMAL_DELTAS[:3])  # what the first entry sends before it fails


def fail(server: Upstream, end: str = "reset", after: int = 3, **more) -> None:
    """Every streamed answer of ``server`` (or the next ``times``) stops after ``after`` deltas."""
    server.http.post("/_scripted/failure", json={"after": after, "end": end, **more}).raise_for_status()


def going_on(server: Upstream, mode: str = "restart", **more) -> None:
    """How ``server`` answers a request to go on with an answer."""
    server.http.post("/_scripted/continuation", json={"mode": mode, **more}).raise_for_status()


def a_then_b(start_app, a: Upstream, b: Upstream, b_extra: dict | None = None, **settings: str) -> App:
    return start_app(
        UPSTREAMS=upstreams(entry("a", a, priority=1), entry("b", b, priority=2, **(b_extra or {}))), **settings
    )


@pytest.mark.parametrize(
    "end, reason",
    [("reset", "upstream_disconnected"), ("stall", "upstream_timeout"), ("error_midstream", "upstream_error")],
)
def test_an_answer_cut_after_three_deltas_goes_on_on_the_next_entry(ups, start_app, end, reason):
    a, b, c = ups
    fail(a, end)
    app = a_then_b(start_app, a, b, IDLE_TIMEOUT_SECONDS="1")
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.status == 200 and result.text == NORMAL, "the whole answer, each character once"
    assert result.terminal_events() == ["done"]
    done = result.last[1]
    assert done["continued"] == [
        {"from": "a", "to": "b", "after_chars": len(CUT), "reason": reason, "seam": "matched", "dropped": len(CUT)}
    ]
    assert [n - m for n, m in zip(counts(a, b), before)] == [1, 1]
    sent = b.requests(last=1)[-1]["json"]
    assert sent["messages"][:2] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": CUT}]
    assert sent["messages"][2]["role"] == "user", "the instruction to go on"
    record = log_record(app, r'"upstream": "b", "attempts": 2')
    assert record["continued"] == done["continued"] and record["error"] is None
    assert record["usage"] == done["usage"] and done["usage"]["completion_tokens"] > 0
    state = pool_state(app)["a"]
    assert state["counters"]["failures"] == (0 if end == "stall" else 1), "as without continuations"


@pytest.mark.parametrize("mode", ["restart", "tail"])
def test_a_continuation_that_repeats_the_answer_or_its_tail_leaves_no_duplicate(ups, start_app, mode):
    a, b, c = ups
    fail(a, after=5)
    going_on(b, mode, tail=25)
    app = a_then_b(start_app, a, b)
    result = chat(app.chat_url, HI)
    assert result.text == NORMAL and result.terminal_events() == ["done"]
    assert result.last[1]["continued"][0]["after_chars"] == len("".join(NORMAL_DELTAS[:5]))


# Where the cut word "Paulo" is begun again: "Pa" + "Paulo".
PAULO = NORMAL.index("Paulo") + 2


@pytest.mark.parametrize(
    "cut, how",
    [
        (45, {"mode": "restart", "lead": "\n"}),  # each cut of issue 42: the whole answer again, on a new line
        (97, {"mode": "restart", "lead": "\n"}),
        (180, {"mode": "restart", "lead": " "}),
        (180, {"mode": "restart", "lead": "\n"}),
        (97, {"mode": "tail", "tail": 20, "lead": "\n"}),  # the last words again
        (PAULO, {"mode": "tail", "tail": 2}),  # the cut word again
    ],
)
def test_a_continuation_that_starts_again_on_a_new_line_or_with_the_cut_word_leaves_no_duplicate(
    ups, start_app, cut, how
):
    a, b, c = ups
    a.http.post("/_scripted/failure", json={"chars": cut, "times": 1}).raise_for_status()
    going_on(b, **how)
    app = a_then_b(start_app, a, b)
    result = chat(app.chat_url, HI)
    assert result.text == NORMAL, "the caller's text is the answer, each character once"
    assert result.terminal_events() == ["done"]
    seam = result.last[1]["continued"]
    repeated = cut if how["mode"] == "restart" else how["tail"]
    assert [(s["from"], s["to"], s["after_chars"], s["seam"]) for s in seam] == [("a", "b", cut, "matched")]
    assert seam[0]["dropped"] == len(how.get("lead", "")) + repeated


def test_both_entries_failing_is_the_final_error_within_the_total_limit(ups, start_app):
    a, b, c = ups
    fail(a, "stall")
    fail(b, "stall")
    app = a_then_b(start_app, a, b, IDLE_TIMEOUT_SECONDS="1", TOTAL_TIMEOUT_SECONDS="8")
    before = counts(a, b)
    started = time.monotonic()
    result = chat(app.chat_url, HI)
    assert time.monotonic() - started < 8 + 2
    assert result.text == CUT, "what went out once, nothing twice"
    assert result.terminal_events() == ["error"] and result.last[1]["error"]["type"] == "upstream_timeout"
    assert [n - m for n, m in zip(counts(a, b), before)] == [2, 1], "a, b, then a again: CONTINUE_MAX=2"
    record = log_record(app, r'"error": "upstream_timeout"[^\n]*"attempts": 3')
    assert [s["to"] for s in record["continued"]] == ["b", "a"]

    fail(a, "reset")
    fail(b, "reset")
    result = chat(app.url + "/api/chat", HI, headers={"x-chatstream-continue": "off"})
    assert result.text == CUT and result.last[1]["error"]["type"] == "upstream_disconnected"
    assert [n - m for n, m in zip(counts(a, b), before)] == [3, 1], "the header turns it off"


def test_a_limit_of_ours_or_a_4xx_shaped_error_event_is_not_continued(ups, start_app):
    a, b, c = ups
    fail(a, "error_4xx")
    app = a_then_b(start_app, a, b)
    before = counts(a, b)
    result = chat(app.chat_url, HI)
    assert result.text == CUT and result.last[1]["error"]["type"] == "upstream_error"
    assert result.last[1]["error"]["retryable"] is False
    play(a, "slow")  # 2 s in all
    fail(a, "stall", after=9)
    app = a_then_b(start_app, a, b, TOTAL_TIMEOUT_SECONDS="1.5")
    result = chat(app.chat_url, HI)
    assert result.last[1]["error"]["type"] == "total_timeout"
    assert [n - m for n, m in zip(counts(a, b), before)] == [2, 0]


def test_a_term_blocked_across_the_seam_is_still_caught(ups, start_app):
    a, b, c = ups
    term = "🚀 and"  # the end of the fifth delta and the start of the sixth
    cut = "".join(NORMAL_DELTAS[:5])
    assert term not in cut and cut.endswith(term[0]) and NORMAL.count(term) == 1
    fail(a, after=5)
    app = a_then_b(start_app, a, b, BLOCKED_TERMS=term)
    result = chat(app.chat_url, HI)
    assert result.text == NORMAL.replace(term, "[redacted]")
    assert result.last[1]["continued"][0]["to"] == "b"


def test_a_tool_call_cut_mid_arguments_ends_with_the_error_and_no_finished_call(ups, start_app):
    a, b, c = ups
    play(a, "tool_calls")
    fail(a, after=4)
    app = a_then_b(start_app, a, b)
    before = counts(a, b)
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "weather?"}], "stream": True}
    with httpx.stream("POST", app.url + "/api/v1/chat/completions", json=body, timeout=20) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "upstream_disconnected"
    assert not any(c["choices"][0].get("finish_reason") for c in events[:-1]), "never a finished call"
    arguments = "".join(
        call["function"].get("arguments") or ""
        for chunk in events[:-1]
        for call in chunk["choices"][0]["delta"].get("tool_calls") or ()
    )
    assert arguments == "".join(TOOL_CALL_ARGUMENT_DELTAS[:4])
    assert [n - m for n, m in zip(counts(a, b), before)] == [1, 0], "not continued"


def test_the_openai_sdk_gets_one_answer_its_usage_summed_and_where_it_was_continued(ups, start_app):
    a, b, c = ups
    fail(a)
    app = a_then_b(start_app, a, b)
    sdk = openai.OpenAI(base_url=app.url + "/api/v1", api_key="unused", max_retries=0, timeout=20)
    try:
        messages = [{"role": "user", "content": "hi"}]
        chunks = list(
            sdk.chat.completions.create(
                model="gpt-test", messages=messages, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == NORMAL
        assert len({ch.id for ch in chunks}) == 1, "one answer, one id"
        finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
        seam = [
            {
                "from": "a",
                "to": "b",
                "after_chars": len(CUT),
                "reason": "upstream_disconnected",
                "seam": "matched",
                "dropped": len(CUT),
            }
        ]
        assert (finish[0].model_extra or {})["continued"] == seam
        usage_chunk = chunks[-1]
        assert usage_chunk.choices == [] and (usage_chunk.model_extra or {})["continued"] == seam
        b_usage = b.requests(last=1)[-1]["json"]
        assert usage_chunk.usage is not None and usage_chunk.usage.prompt_tokens == count_prompt_tokens(
            b_usage["messages"]
        ), "a reported no usage: the sum is b's"
        with sdk.chat.completions.stream(model="gpt-test", messages=messages) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        assert final.choices[0].message.content == NORMAL and final.choices[0].finish_reason == "stop"
    finally:
        sdk.close()


def test_an_entry_that_continues_a_prefix_gets_continue_final_message(ups, start_app):
    a, b, c = ups
    fail(a)
    going_on(b, "restart", prefix=True)  # as vLLM: takes continue_final_message, and then goes on exactly
    app = a_then_b(start_app, a, b, b_extra={"continue": "prefix"})
    result = chat(app.chat_url, HI)
    assert result.text == NORMAL and result.last[1]["continued"][0]["to"] == "b"
    sent = b.requests(last=1)[-1]["json"]
    assert sent["messages"][-1] == {"role": "assistant", "content": CUT}
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False


def test_a_single_upstream_continues_on_itself(start_app):
    own = Upstream("--scenario", "normal")
    try:
        fail(own, times=1)
        app = start_app(OPENAI_BASE_URL=own.base_url)
        result = chat(app.chat_url, HI)
        assert result.text == NORMAL and result.last[1]["continued"] == [
            {
                "from": "default",
                "to": "default",
                "after_chars": len(CUT),
                "reason": "upstream_disconnected",
                "seam": "matched",
                "dropped": len(CUT),
            }
        ]
        assert own.count() == 2
    finally:
        own.stop()


def test_a_background_response_whose_stream_drops_is_re_attached_on_its_entry_exactly(ups, start_app):
    from tools.fakeupstream import RESPONSES_TEXTS

    a, b, c = ups
    fail(a, after=3, times=1)  # the create's stream drops after three deltas; the response goes on
    app = a_then_b(start_app, a, b)
    before = counts(a, b)
    sdk = openai.OpenAI(base_url=app.url + "/api/v1", api_key="unused", max_retries=0, timeout=20)
    try:
        events = list(sdk.responses.create(model="gpt-test", input="hello", stream=True, background=True))
    finally:
        sdk.close()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == RESPONSES_TEXTS["normal"]
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "every event once, in order"
    (completed,) = [e for e in events if e.type == "response.completed"]
    (seam,) = (completed.model_extra or {})["continued"]
    assert seam["from"] == seam["to"] == "a" and seam["reason"] == "upstream_disconnected"
    reattached = a.requests(last=1)[-1]
    assert reattached["method"] == "GET" and reattached["path"] == f"/v1/responses/{completed.response.id}"
    delta_numbers = [e.sequence_number for e in events if e.type == "response.output_text.delta"]
    assert reattached["query"]["stream"] == "true" and reattached["query"]["starting_after"] == str(delta_numbers[2])
    assert [n - m for n, m in zip(counts(a, b), before)] == [2, 0], "only the entry that holds it"
    log_record(app, r'"endpoint": "responses"[^\n]*"continued"')


def test_the_c_sharp_client_and_the_ai_sdk_read_a_continued_answer_as_one(ups, start_app):
    """Two of the clients of the matrix against a continued answer: the C# console client
    (/api/chat) and the Vercel AI SDK's streamText (/api/v1/chat/completions, usage included)."""
    from test_client_cs import run_chat
    from test_hardening_two import AISDK

    a, b, c = ups
    fail(a)
    app = a_then_b(start_app, a, b)
    exe = ROOT / "client_cs" / "bin" / "chat.exe"
    cs, aisdk = exe.is_file() and shutil.which("mono"), (AISDK / "node_modules" / "ai").is_dir()
    if not (cs or aisdk):
        pytest.skip("neither client is built (make client-mono, make aisdk; make test builds both)")
    if cs:  # built by `make client-mono` (test_client_cs builds it too)
        proc = run_chat(exe, "--url", app.chat_url, "--stats", "hi")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.decode() in (NORMAL, NORMAL + "\n")
        assert b"finish reason: stop" in proc.stderr
    if aisdk:  # `make aisdk`
        fail(a)
        out = subprocess.run(
            ["node", str(AISDK / "stream_usage.mjs"), app.url + "/api/v1", "hi"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["ok"] and result["text"] == NORMAL and result["finishReason"] == "stop", result
        assert result["usage"]["completionTokens"] > 0
    assert len(log_records(app, r'"continued"')) == int(bool(cs)) + int(aisdk), "every answer was continued"


def log_records(app: App, pattern: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r'\{"event": "chat_stream"[^\n]*' + pattern + r"[^\n]*", app.log())]


def test_the_span_and_the_metrics_say_where_an_answer_was_continued(ups):
    from test_telemetry import READER, SPANS, _install_providers

    from chatstream import telemetry
    from chatstream.apis.completions import CompletionsApi
    from chatstream.pipeline import CallRequest

    _install_providers()
    a, b, c = ups
    fail(a)
    first = f"a-{time.monotonic_ns()}"
    pool = in_process({"UPSTREAMS": upstreams(entry(first, a, priority=1), entry("b", b, priority=2))}, Clock())

    async def run():
        record = StreamRecord(endpoint="chat", model=f"continued-{first}")
        telemetry.begin(record)
        protocol = CompletionStream(Pipeline())
        call = CallRequest(params=params(True), endpoint="chat")
        continuation = CompletionsApi().continuation(call, pool, protocol, record, 2)
        limits = TimeLimits(pool.settings)
        events = [
            e
            async for e in relay(
                pool, "/chat/completions", params(True), protocol, limits, record, Ends(lambda: None), continuation
            )
        ]
        telemetry.finish(record)
        await asyncio.gather(*(cl.close() for cl in pool.clients.values()))
        return events, record

    events, record = asyncio.run(run())
    assert isinstance(events[-1], Done) and events[-1].continued[0]["from"] == first
    (span,) = [s for s in SPANS.get_finished_spans() if s.attributes.get("gen_ai.request.model") == record.model]
    assert span.attributes["chat.continuations"] == 1
    assert json.loads(span.attributes["chat.continued"]) == list(events[-1].continued)
    points = [
        (point.attributes.get("reason"), point.value)
        for resource_metrics in READER.get_metrics_data().resource_metrics
        for scope in resource_metrics.scope_metrics
        for metric in scope.metrics
        if metric.name == "chat.upstream.continuations"
        for point in metric.data.data_points
        if point.attributes.get("upstream") == first
    ]
    assert points == [("upstream_disconnected", 1)]


def test_a_resumable_stream_continued_keeps_its_ids_and_a_resume_reads_the_same_answer(ups, start_app, azurite):
    """With RESUMABLE_STREAMS=on the events of a continued answer go on numbering (1, 2, 3, …, one
    done), and reading the stream again from an id before the seam gives the same text."""
    a, b, c = ups
    fail(a)
    app = a_then_b(start_app, a, b, AzureWebJobsStorage=azurite.connection_string, RESUMABLE_STREAMS="on")
    with httpx.stream("POST", app.chat_url, json=HI, timeout=30) as response:
        stream_id = response.headers["x-stream-id"]
        body = response.read().decode()
    blocks = [dict(line.split(": ", 1) for line in b.split("\n") if ": " in line) for b in body.split("\n\n")]
    numbered = [(int(f["id"]), f.get("event", "message"), json.loads(f["data"])) for f in blocks if "id" in f]
    assert [n for n, _, _ in numbered] == list(range(1, len(numbered) + 1))
    assert [e for _, e, _ in numbered if e != "message"] == ["done"]
    assert "".join(d["delta"] for _, e, d in numbered if e == "message") == NORMAL
    assert numbered[-1][2]["continued"][0]["to"] == "b" and numbered[-1][2]["stream_id"] == stream_id
    again = httpx.get(f"{app.url}/api/streams/{stream_id}", headers={"Last-Event-ID": "2"}, timeout=30).text
    rest = [json.loads(line[6:]) for line in again.split("\n") if line.startswith("data: ")]
    assert "".join(d["delta"] for _, e, d in numbered[:2]) + "".join(r.get("delta", "") for r in rest) == NORMAL
