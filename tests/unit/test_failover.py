"""chatstream/upstreams/failover.py in-process: the pool in the request path, with stand-in clients that
play scripted streams (no HTTP). What the core gets when an entry fails before or after its first
output, the walk across entries, the single upstream's own cooldown, and the follow-ups' search for the
entry that holds a response."""

from __future__ import annotations

import asyncio
import json
import random

import httpx2
import openai
import pytest

from chatstream.apis.completions import CompletionsApi, CompletionStream
from chatstream.continuation import CONTINUE_PROMPT
from chatstream.errors import ApiError, UpstreamReported
from chatstream.pipeline import CallRequest, Pipeline
from chatstream.record import StreamRecord
from chatstream.settings import Settings
from chatstream.stream import Done, Ends, Failed, TimeLimits, relay
from chatstream.upstreams.config import entries
from chatstream.upstreams.failover import Upstreams
from chatstream.upstreams.health import SINGLE
from chatstream.upstreams.outcomes import Outcome, OutcomeKind
from chatstream.upstreams.pool import Pool

from .upstream_helpers import Clock, status_error

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time

REQUEST = httpx2.Request("POST", "http://up.test/v1/chat/completions")


class ScriptedStream:
    """Stands in for an UpstreamStream: yields ``chunks`` (an exception in them is raised; then blocks
    forever if ``hang``), each as a read of its own."""

    ready = 0
    request_id = "req-upstream-1"
    failure = None  # as UpstreamStream.failure: how its reader explains a failure (set by PeekedStream)

    def __init__(self, chunks: list, hang: bool = False):
        self.chunks, self.hang, self.closed = chunks, hang, False
        self._iterator = self._run()

    def __aiter__(self):
        return self._iterator

    async def _run(self):
        for chunk in self.chunks:
            if isinstance(chunk, Exception) and self.failure is not None:
                raise self.failure(chunk) from None
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk
        if self.hang:
            await asyncio.Event().wait()

    async def close(self) -> None:
        self.closed = True


class ScriptedClient:
    """A stand-in SDK client: ``post`` answers with the next of ``answers`` (a stream, a JSON body, or an
    exception to raise); ``get`` does the same for follow-ups."""

    timeout = None

    def __init__(self, *answers, name: str = ""):
        self.answers, self.calls, self.name = list(answers), 0, name
        self.bodies: list[dict] = []  # what each post sent

    async def _next(self):
        self.calls += 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, float):  # stall this long
            await asyncio.sleep(answer)
            return {"slept": answer}
        return answer

    async def post(self, path, **kwargs):
        self.bodies.append(kwargs.get("body") or {})
        answer = await self._next()
        if isinstance(answer, dict) and kwargs.get("cast_to") is httpx2.Response:
            return httpx2.Response(200, json=answer, headers={"x-request-id": f"req-{self.name}"})
        return answer

    async def get(self, path, **kwargs):
        return await self._next()

    async def delete(self, path, **kwargs):
        return await self._next()

    async def close(self) -> None:
        pass


def chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> dict:
    delta = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def params(stream: bool = True) -> dict:
    return {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def pooled(clients: dict[str, ScriptedClient], **settings_env: str) -> Upstreams:
    raw = json.dumps([{"name": n, "base_url": f"http://{n}/v1", "priority": i} for i, n in enumerate(clients)])
    settings = Settings.from_env({"UPSTREAMS": raw, **settings_env})
    return Upstreams(settings, Pool(entries(settings, {}), now=Clock()), clients)


def single(client: ScriptedClient, clock: Clock | None = None) -> Upstreams:
    settings = Settings.from_env({"OPENAI_BASE_URL": "http://up.test/v1"})
    return Upstreams(settings, Pool(entries(settings, {}), now=clock or Clock(), policy=SINGLE), {"default": client})


async def run(upstreams: Upstreams, continue_max: int = 0) -> tuple[list, StreamRecord]:
    record = StreamRecord(endpoint="chat", model="gpt-test")
    protocol = CompletionStream(Pipeline())
    call = CallRequest(params=params(), endpoint="chat")
    continuation = CompletionsApi().continuation(call, upstreams, protocol, record, continue_max)
    events = [
        e
        async for e in relay(
            upstreams,
            "/chat/completions",
            params(),
            protocol,
            TimeLimits(upstreams.settings),
            record,
            Ends(lambda: None),
            continuation,
        )
    ]
    return events, record


def lost() -> openai.APIConnectionError:
    exc = openai.APIConnectionError(request=REQUEST)
    exc.__cause__ = httpx2.ReadError("reset by peer")
    return exc


# --- the walk ---------------------------------------------------------------------------------


async def test_the_chunks_read_to_find_the_first_output_reach_the_core_in_order():
    good = ScriptedStream([chunk(role=True), chunk("Hel"), chunk("lo"), chunk(finish="stop")])
    empty = ScriptedStream([])  # ends before any output: the entry's failure, the request moves on
    upstreams = pooled({"empty": ScriptedClient(empty), "good": ScriptedClient(good)})
    events, record = await run(upstreams)
    assert [e.data["choices"][0]["delta"] for e in events[:-1]] == [
        {"role": "assistant"},
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "stop"
    assert (record.upstream, record.attempts, record.deltas) == ("good", 2, 2)
    assert record.attempt_errors == [{"upstream": "empty", "error": "upstream_incomplete"}], "every attempt's error"
    assert record.request_id == "req-upstream-1", "the upstream's x-request-id"
    assert empty.closed and good.closed
    state = {e["name"]: e for e in upstreams.state()["upstreams"]}
    assert state["empty"]["counters"]["failovers"] == 1


async def test_a_connection_cut_before_any_output_is_said_as_such_and_fails_over():
    cut = ScriptedStream([chunk(role=True), lost()])  # answered 200, then died before the first token
    good = ScriptedStream([chunk("ok", "stop")])
    events, record = await run(pooled({"cut": ScriptedClient(cut), "good": ScriptedClient(good)}))
    assert isinstance(events[-1], Done) and record.upstream == "good"
    assert record.attempt_errors == [{"upstream": "cut", "error": "upstream_disconnected"}]
    events, _ = await run(pooled({"cut": ScriptedClient(ScriptedStream([chunk(role=True), lost()]))}))
    error = events[-1].error
    assert (error.status, error.type) == (502, "upstream_disconnected") and "cut" in error.message


async def test_failures_after_the_first_output_reach_the_core_explained_and_count_against_the_entry():
    for tail, kind in (
        (lost(), "upstream_disconnected"),
        (openai.APIError("overloaded", REQUEST, body=None), "upstream_error"),
        (UpstreamReported("x"), "upstream_error"),
    ):
        stream = ScriptedStream([chunk("a"), tail])
        upstreams = pooled({"only": ScriptedClient(stream)})
        events, record = await run(upstreams)
        assert isinstance(events[-1], Failed) and events[-1].error.type == kind and record.error == kind
        assert stream.closed
        counters = upstreams.state()["upstreams"][0]["counters"]
        assert counters["failures"] == 1 and counters["failovers"] == 0, "a mid-stream failure is no failover"


async def test_an_error_after_the_finish_is_ignored():
    for tail in (lost(), openai.APIError("late", REQUEST, body=None)):
        events, record = await run(pooled({"only": ScriptedClient(ScriptedStream([chunk("a", "stop"), tail]))}))
        assert isinstance(events[-1], Done) and record.error is None


async def test_opening_fails_with_no_connection_at_all():
    refused = openai.APIConnectionError(request=REQUEST)
    refused.__cause__ = httpx2.ConnectError("refused")
    events, record = await run(pooled({"only": ScriptedClient(refused)}))
    assert (events[-1].error.status, events[-1].error.type) == (503, "upstream_unavailable")
    assert not record.disconnected


async def test_a_caller_hanging_up_during_the_walk_closes_the_stream_and_frees_the_probe_slot():
    hanging = ScriptedStream([chunk(role=True)], hang=True)
    upstreams = pooled({"slow": ScriptedClient(hanging)})
    clock = upstreams.pool._now
    attempt = upstreams.pool.acquire(upstreams.pool.entries[0], "gpt-test")  # open the breaker
    attempt.report(Outcome(OutcomeKind.CONNECT_FAILED))
    clock.t += 5.0  # half-open: the next request is its probe
    record = StreamRecord(endpoint="chat", model="gpt-test")
    task = asyncio.ensure_future(
        upstreams.open(
            "/chat/completions", params(), CompletionStream(Pipeline()), TimeLimits(upstreams.settings), record
        )
    )
    await asyncio.sleep(0.05)
    assert upstreams.state()["upstreams"][0]["probing"] is True
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hanging.closed
    (state,) = upstreams.state()["upstreams"]
    assert state["probing"] is False and state["state"] == "half_open", "a cancelled probe says nothing"


async def test_weights_split_first_attempts_within_a_priority():
    raw = json.dumps(
        [
            {"name": "heavy", "base_url": "http://h/v1", "weight": 3},
            {"name": "light", "base_url": "http://l/v1"},
            {"name": "spare", "base_url": "http://s/v1", "priority": 2, "weight": 100},
        ]
    )
    settings = Settings.from_env({"UPSTREAMS": raw})
    clients = {
        e.name: ScriptedClient({"object": "chat.completion", "choices": []}, name=e.name) for e in entries(settings, {})
    }
    upstreams = Upstreams(settings, Pool(entries(settings, {}), rng=random.Random(1414)), clients)
    for _ in range(800):
        await upstreams.complete("/chat/completions", params(False), StreamRecord(endpoint="openai", model="gpt-test"))
    share = clients["heavy"].calls / 800
    assert abs(share - 0.75) < 0.04, share
    assert clients["spare"].calls == 0, "a lower priority only gets what the higher one cannot take"


async def test_a_completion_carries_the_upstreams_request_id():
    record = StreamRecord(endpoint="openai", model="gpt-test", request_id="ours")
    upstreams = pooled({"a": ScriptedClient({"choices": []}, name="a")})
    assert await upstreams.complete("/chat/completions", params(False), record) == {"choices": []}
    assert record.request_id == "req-a"


async def test_same_entry_first_retries_a_5xx_once_and_never_waits_past_the_first_token_limit():
    blip = ScriptedClient(status_error(500), ScriptedStream([chunk("ok", "stop")]))
    other = ScriptedClient(ScriptedStream([chunk("b", "stop")]))
    upstreams = pooled({"a": blip, "b": other}, UPSTREAM_RETRY_SERVER_ERROR="true")
    events, record = await run(upstreams)
    assert isinstance(events[-1], Done) and (record.upstream, record.attempts) == ("a", 2)
    assert (blip.calls, other.calls) == (2, 0)
    # A 502 answer again on the retry: once only, then b.
    down = ScriptedClient(status_error(502))
    events, record = await run(pooled({"a": down, "b": other}, UPSTREAM_RETRY_SERVER_ERROR="true"))
    assert (record.upstream, record.attempts, down.calls) == ("b", 3, 2)
    # A 429 asking for 20 s, allowed 30, with 5 s to the first token: not waited for.
    limited = ScriptedClient(status_error(429, {"retry-after": "20"}))
    upstreams = pooled(
        {"a": limited, "b": other}, UPSTREAM_RETRY_AFTER_WAIT_SECONDS="30", FIRST_TOKEN_TIMEOUT_SECONDS="5"
    )
    events, record = await run(upstreams)
    assert (record.upstream, record.attempts, limited.calls) == ("b", 2, 1)


# --- the single upstream --------------------------------------------------------------------------


async def test_the_single_upstream_honours_its_own_retry_after_without_calling_it_again():
    clock = Clock()
    client = ScriptedClient(status_error(429, {"retry-after": "20"}), ScriptedStream([chunk("ok", "stop")]))
    upstreams = single(client, clock)
    events, _ = await run(upstreams)
    assert events[-1].error.status == 429 and client.calls == 1
    for _ in range(3):  # a client that retries on its own schedule, ignoring x-should-retry
        clock.t += 5
        events, _ = await run(upstreams)
        error = events[-1].error
        assert (error.status, error.type) == (429, "rate_limited") and client.calls == 1, "no upstream call"
        assert int(error.headers["Retry-After"]) == 20 - (clock.t - 1000)
    clock.t += 6
    events, _ = await run(upstreams)
    assert isinstance(events[-1], Done) and client.calls == 2
    state = upstreams.state()["upstreams"][0]["counters"]
    assert state["cooldowns"] == 1 and state["failovers"] == 0, "a single entry has nowhere to fail over to"


async def test_the_single_upstream_without_retry_after_is_tried_again_at_once_and_has_no_breaker():
    client = ScriptedClient(
        status_error(429),
        status_error(500),
        status_error(500),
        status_error(500),
        ScriptedStream([chunk("ok", "stop")]),
    )
    upstreams = single(client)
    for status in (429, 502, 502, 502):
        events, _ = await run(upstreams)
        assert events[-1].error.status == status
    events, _ = await run(upstreams)
    assert isinstance(events[-1], Done) and client.calls == 5


# --- follow-ups: the entry that holds the response -----------------------------------------------


@pytest.mark.parametrize(
    "first",
    [
        status_error(429, {"retry-after": "3"}),
        status_error(500),
        status_error(404),
        openai.APIConnectionError(request=REQUEST),
        5.0,
    ],
)
async def test_a_follow_up_reaches_the_entry_that_holds_the_response(first):
    holder = ScriptedClient({"id": "resp_1", "object": "response"})
    upstreams = pooled({"a": ScriptedClient(first), "b": holder})
    body = await upstreams.each(lambda client: client.get("/responses/resp_1"), attempt_timeout=0.2)
    assert body == {"id": "resp_1", "object": "response"} and holder.calls == 1


async def test_a_follow_up_everyone_says_404_to_is_a_404_and_a_transient_failure_wins_over_404():
    upstreams = pooled({"a": ScriptedClient(status_error(404)), "b": ScriptedClient(status_error(404))})
    with pytest.raises(ApiError) as info:
        await upstreams.each(lambda client: client.get("/responses/resp_1"), attempt_timeout=1)
    assert info.value.status in (400, 404)
    upstreams = pooled(
        {"a": ScriptedClient(status_error(429, {"retry-after": "3"})), "b": ScriptedClient(status_error(404))}
    )
    with pytest.raises(ApiError) as info:
        await upstreams.each(lambda client: client.get("/responses/resp_1"), attempt_timeout=1)
    assert info.value.status == 429, "the response may be on the entry that could not answer"


async def test_a_follow_up_stops_at_an_answer_that_is_about_the_request():
    upstreams = pooled({"a": ScriptedClient(status_error(400)), "b": ScriptedClient({"id": "resp_1"})})
    with pytest.raises(ApiError) as info:
        await upstreams.each(lambda client: client.get("/responses/resp_1"), attempt_timeout=1)
    assert info.value.status == 400


# --- going on after a failure mid-answer (continuation.py) ---------------------------------------


def texts(events) -> str:
    return "".join(
        e.data["choices"][0]["delta"].get("content") or "" for e in events if not isinstance(e, (Done, Failed))
    )


async def test_an_answer_cut_mid_stream_goes_on_on_the_next_entry_and_the_first_one_counts_the_failure():
    a = ScriptedClient(ScriptedStream([chunk(role=True), chunk("Hel"), chunk("lo, "), lost()]))
    b = ScriptedClient(ScriptedStream([chunk(role=True), chunk("Hello, "), chunk("world"), chunk(finish="stop")]))
    c = ScriptedClient(ScriptedStream([chunk("never", "stop")]))
    upstreams = pooled({"a": a, "b": b, "c": c})
    events, record = await run(upstreams, continue_max=2)
    assert texts(events) == "Hello, world" and isinstance(events[-1], Done)
    assert events[-1].continued == (
        {"from": "a", "to": "b", "after_chars": 7, "reason": "upstream_disconnected", "seam": "matched", "dropped": 7},
    )
    assert b.bodies[0]["messages"][1:] == [
        {"role": "assistant", "content": "Hello, "},
        {"role": "user", "content": CONTINUE_PROMPT},
    ]
    assert b.bodies[0]["model"] == "gpt-test" and c.calls == 0
    state = {e["name"]: e for e in upstreams.state()["upstreams"]}
    assert state["a"]["counters"]["failures"] == 1 and state["a"]["counters"]["failovers"] == 0
    assert state["b"]["counters"]["successes"] == 1
    assert (record.upstream, record.attempts) == ("b", 2)


async def test_without_a_continuation_a_cut_answer_ends_as_before():
    a = ScriptedClient(ScriptedStream([chunk("Hel"), lost()]))
    b = ScriptedClient(ScriptedStream([chunk("never", "stop")]))
    events, record = await run(pooled({"a": a, "b": b}), continue_max=0)
    assert isinstance(events[-1], Failed) and events[-1].error.type == "upstream_disconnected" and b.calls == 0


async def test_a_single_upstream_goes_on_on_itself():
    client = ScriptedClient(
        ScriptedStream([chunk("One, "), chunk("two, "), lost()]),
        ScriptedStream([chunk("One, two, "), chunk("three."), chunk(finish="stop")]),
    )
    events, record = await run(single(client), continue_max=2)
    assert texts(events) == "One, two, three." and events[-1].continued[0]["to"] == "default"
    assert client.calls == 2 and client.bodies[1]["messages"][-2]["content"] == "One, two, "


class CoolingStream(ScriptedStream):
    """Before it fails, its entry gets a 429's cooldown (as if another request had just had one)."""

    def __init__(self, chunks, upstreams: Upstreams, seconds: float):
        super().__init__(chunks)
        self.upstreams, self.seconds = upstreams, seconds

    async def _run(self):
        async for item in super()._run():
            yield item
        pool = self.upstreams.pool
        attempt = pool.acquire(pool.entries[0], "gpt-test")
        assert attempt is not None
        attempt.report(Outcome(OutcomeKind.RATE_LIMITED, 429, cooldown=self.seconds))
        raise (self.failure(lost()) if self.failure is not None else lost()) from None


async def test_the_only_entry_is_waited_for_while_it_cools_down():
    settings = Settings.from_env({"OPENAI_BASE_URL": "http://up.test/v1"})
    client = ScriptedClient()
    upstreams = Upstreams(settings, Pool(entries(settings, {}), policy=SINGLE), {"default": client})
    client.answers = [
        CoolingStream([chunk("Wait "), chunk("for it")], upstreams, 0.5),
        ScriptedStream([chunk("Wait for it"), chunk("..."), chunk(finish="stop")]),
    ]
    started = asyncio.get_running_loop().time()
    events, _ = await run(upstreams, continue_max=1)
    assert texts(events) == "Wait for it..." and isinstance(events[-1], Done)
    assert asyncio.get_running_loop().time() - started >= 0.5, "not before the cooldown ended"
