"""chatstream/lifecycle.py in-process: the drain's grace and its bound, the cut of a running stream
(one final instance_draining event, the upstream closed, the record written), the last stream's
final event held for the on_drain callbacks, bounded callbacks, the 503 for a new request, and the
SIGTERM handler chained in front of the one in place. The end-to-end drain, through the local host
and the real worker, is tests/test_drain.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from chatstream.apis.chat import ChatApi
from chatstream.apis.openai_chat import OpenAIChatApi
from chatstream.endpoint import Endpoint
from chatstream.errors import ApiError, ErrorKind, instance_draining
from chatstream.lifecycle import AFTER_GRACE, CALLBACKS_WAIT, Lifecycle, Stream, host_shutdown_timeout
from chatstream.pipeline import Pipeline
from chatstream.record import StreamRecord
from chatstream.settings import Settings, SettingsError
from chatstream.stream import Chunk, Done, Ends, Event, Failed, TimeLimits

from .test_failover import ScriptedClient, ScriptedStream, chunk, pooled

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time


def done() -> Done:
    return Done("stop", {0: "stop"}, None, "m", "id-1", 0)


async def events(count: int, every: float, record: StreamRecord, log: list[str], limits: TimeLimits, ends: Ends):
    """A stream of ``count`` chunks ``every`` seconds apart, then Done; what happened, in ``log``.
    Its waits go through ``limits``, a limit's error (the drain's cut) ends it, and ``ends`` is told
    of its ends, as the stream core does (stream.relay): its upstream closed before the final event."""
    ends.begin()
    try:
        final: Event | None = None
        try:
            for i in range(count):
                await limits.wait(asyncio.sleep(every))
                limits.got_chunk()
                if i == 0:
                    record.first_output()  # as the stream core does
                    limits.got_output()
                yield Chunk({"i": i})
            final = done()
        except ApiError as error:
            record.failed(error.type)
            final = Failed(error)
        finally:
            log.append("closed")
        await ends.last(final)
        yield final
    finally:
        ends.over()


def guarded(life: Lifecycle, count: int, every: float, record: StreamRecord, log: list[str] | None = None):
    """``events`` with the drain's ends, with the stream's time limits."""
    limits = TimeLimits(Settings.from_env({}))
    ends = Stream(life, record, limits, lambda: None)
    return events(count, every, record, [] if log is None else log, limits, ends)


async def read_all(stream) -> list[tuple[float, Event]]:
    loop = asyncio.get_running_loop()
    return [(loop.time(), item) async for item in stream]


# --- the grace and its bound --------------------------------------------------------------------


def test_the_grace_is_drain_seconds_within_the_hosts_shutdown_timeout():
    assert Lifecycle(20, 5).grace == 5 - AFTER_GRACE  # the host cuts at 5 s, whatever the app does
    assert Lifecycle(2, 30).grace == 2
    assert Lifecycle(20, 1).grace == 0
    assert Lifecycle(0, 30).grace == 0


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, 5.0), ("", 5.0), ("25", 25.0), ("0", 0.0), ("2.5", 5.0), ("-3", 5.0), ("x", 5.0)]
)
def test_the_hosts_shutdown_timeout_is_read_as_the_host_reads_it(value, seconds):
    environ = {} if value is None else {"ASPNETCORE_SHUTDOWNTIMEOUTSECONDS": value}
    assert host_shutdown_timeout(environ) == seconds


def test_drain_seconds_defaults_to_20_and_is_checked():
    assert Settings.from_env({}).drain_seconds == 20
    assert Settings.from_env({"DRAIN_SECONDS": "0"}).drain_seconds == 0
    assert Settings.from_env({"DRAIN_SECONDS": "230"}).drain_seconds == 230
    for bad in ("-1", "231", "soon", "nan"):
        with pytest.raises(SettingsError, match="DRAIN_SECONDS"):
            Settings.from_env({"DRAIN_SECONDS": bad})


# --- streams during a drain ---------------------------------------------------------------------


async def test_a_stream_that_ends_within_the_grace_ends_as_usual():
    life = Lifecycle(2, 30, signals=False)
    record, log = StreamRecord(endpoint="chat", model="m"), []
    stream = guarded(life, 5, 0.05, record, log)
    reading = asyncio.ensure_future(read_all(stream))
    await asyncio.sleep(0.07)
    drain = life.drain()
    items = [item for _, item in await reading]
    assert [type(i) for i in items] == [Chunk] * 5 + [Done]
    await asyncio.wait_for(drain, 2)
    assert life.drained.is_set() and log == ["closed"] and record.error is None


async def test_at_the_end_of_the_grace_a_running_stream_ends_with_one_retryable_instance_draining_event():
    life = Lifecycle(0.2, 30, signals=False)
    record, log = StreamRecord(endpoint="chat", model="m"), []
    loop = asyncio.get_running_loop()
    stream = guarded(life, 1000, 0.05, record, log)
    reading = asyncio.ensure_future(read_all(stream))
    await asyncio.sleep(0.12)
    started = loop.time()
    await asyncio.wait_for(life.drain(), 3)
    items = await reading
    finals = [item for _, item in items if not isinstance(item, Chunk)]
    assert len(finals) == 1 and isinstance(finals[0], Failed)
    error = finals[0].error
    assert error.type == ErrorKind.INSTANCE_DRAINING and error.retryable and error.status == 503
    assert 0.15 < items[-1][0] - started < 1.0, "the cut comes at the end of the grace"
    assert log == ["closed"], "the stream's upstream is closed at the cut"
    assert record.error == "instance_draining" and not record.disconnected


async def test_a_resumable_stream_is_not_cut_it_is_left_to_the_callbacks():
    record, log = StreamRecord(endpoint="chat", model="m"), []
    record.stream_id = "s-1"
    seen: list[bool] = []

    async def hand_over():
        seen.append(reading.done())  # the stream still runs when the callbacks are called

    life = Lifecycle(0.1, 30, on_drain=[hand_over], signals=False)
    stream = guarded(life, 10, 0.05, record, log)
    reading = asyncio.ensure_future(read_all(stream))
    await asyncio.sleep(0.02)
    await asyncio.wait_for(life.drain(), 3)
    assert seen == [False]
    items = [item for _, item in await reading]
    assert isinstance(items[-1], Done) and len(items) == 11


async def test_the_last_streams_final_event_waits_for_the_on_drain_callbacks():
    """The host kills the worker once its last request is over: the charges must be settled first."""
    loop = asyncio.get_running_loop()
    settled: list[float] = []

    async def settle():
        await asyncio.sleep(0.3)
        settled.append(loop.time())

    life = Lifecycle(0.2, 30, on_drain=[settle], signals=False)
    records = [StreamRecord(endpoint="chat", model="m") for _ in range(3)]
    lengths = [2, 1000, 1000]  # the first ends within the grace; the others are cut
    readers = [asyncio.ensure_future(read_all(guarded(life, n, 0.05, r, []))) for n, r in zip(lengths, records)]
    await asyncio.sleep(0.02)
    await asyncio.wait_for(life.drain(), 3)
    ends = [items[-1][0] for items in await asyncio.gather(*readers)]
    assert ends[0] < settled[0], "a stream ending while others run is not held"
    assert max(ends) >= settled[0], "the last one's final event went out after the callbacks"
    assert sorted(ends)[1] < settled[0], "only the last one is held"


async def test_a_stream_closed_before_its_first_event_task_started_is_not_left_to_the_drain(caplog):
    """The endpoint's handler cancelled while its first-event task has not started: it cancels that
    task and closes the events (endpoint._close_events), so its relay never starts. The drain must
    not count that stream, wait its grace for it, or cut the record of a request that is over."""
    life = Lifecycle(2, 30, signals=False)
    record = StreamRecord(endpoint="chat", model="m")
    stream = guarded(life, 1000, 0.05, record, [])
    first = asyncio.ensure_future(anext(stream))  # the first-event task, not started yet
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await stream.aclose()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.WARNING, logger="chatstream"):
        await asyncio.wait_for(life.drain(), 5)
    assert loop.time() - started < 1.0, "the drain waited its grace for a stream that is gone"
    assert "draining: 0 stream(s) running" in caplog.text and "0 stream(s) ended instance_draining" in caplog.text
    assert record.error is None and record.stop_reason is None


async def test_a_request_admitted_as_the_drain_begins_is_waited_for_as_a_stream():
    """Chaos seed 97: two requests admitted just before SIGTERM were still in their admission (a
    store call) when the drain looked; their streams started after the streams then running had
    ended, and the drain, seeing none, went on to close the app under them. A request counts from
    its admission (``starting``): its stream gets the grace and ends as usual, before the callbacks."""
    loop = asyncio.get_running_loop()
    settled: list[float] = []

    async def settle():
        settled.append(loop.time())

    life = Lifecycle(2, 30, on_drain=[settle], signals=False)
    record = StreamRecord(endpoint="chat", model="m")

    async def request() -> list[tuple[float, Event]]:
        with life.starting():
            life.admit()
            await asyncio.sleep(0.3)  # its admission, on a slow store
            reading = asyncio.ensure_future(read_all(guarded(life, 5, 0.05, record, [])))
            await asyncio.sleep(0)  # (its first event asked for: it runs)
        return await reading

    answered = asyncio.ensure_future(request())
    await asyncio.sleep(0.01)
    await asyncio.wait_for(life.drain(), 5)
    items = await answered
    assert isinstance(items[-1][1], Done) and record.error is None, items[-1]
    assert settled and settled[0] >= items[-2][0], "the callbacks ran while the stream was running"


async def test_kept_work_is_waited_for_within_the_grace_and_done_before_the_on_drain_callbacks():
    """A takeover's raise of a lost part (nobody else can make it): with no stream running, the drain
    still gives it the grace, and the on_drain callbacks (the charges settled) come after it."""
    loop = asyncio.get_running_loop()
    happened: list[tuple[str, float]] = []

    async def raise_lost():
        await asyncio.sleep(0.8)  # its continuation regenerates what the caller had
        happened.append(("raised", loop.time()))

    async def settle():
        happened.append(("settled", loop.time()))

    life = Lifecycle(2, 30, on_drain=[settle], signals=False)
    life.keep(asyncio.ensure_future(raise_lost()))
    started = loop.time()
    await asyncio.wait_for(life.drain(), 5)
    assert [what for what, _ in happened] == ["raised", "settled"]
    assert happened[1][1] - started < 1.5, "the drain waited the whole grace after the work was done"


async def test_kept_work_still_running_at_the_graces_end_is_told_so_and_given_a_moment():
    """Work that would run past the grace is told (``grace_over``) and finishes with what it has
    before the on_drain callbacks; work that does not is left behind, and the drain still ends."""
    loop = asyncio.get_running_loop()
    happened: list[str] = []

    async def raise_lost():
        await life.grace_over.wait()
        happened.append("raised with what it had")

    async def hangs():
        await asyncio.Event().wait()

    async def settle():
        happened.append("settled")

    life = Lifecycle(0.5, 30, on_drain=[settle], signals=False)
    life.keep(asyncio.ensure_future(raise_lost()))
    stuck = asyncio.ensure_future(hangs())
    life.keep(stuck)
    started = loop.time()
    await asyncio.wait_for(life.drain(), 5)
    assert happened == ["raised with what it had", "settled"]
    assert loop.time() - started < 0.5 + 0.5 + CALLBACKS_WAIT + 1.0
    stuck.cancel()


async def test_a_callback_that_fails_or_overruns_is_logged_and_the_drain_still_ends(caplog):
    closed: list[str] = []

    async def fails():
        raise RuntimeError("store down")

    async def hangs():
        await asyncio.Event().wait()

    async def close():
        closed.append("closed")

    life = Lifecycle(0, 30, on_drain=[fails, hangs], closing=[close], signals=False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.ERROR, logger="chatstream"):
        await asyncio.wait_for(life.drain(), 5)
    assert loop.time() - started < CALLBACKS_WAIT + 1.0
    assert closed == ["closed"] and life.drained.is_set()
    assert "a on_drain callback failed" in caplog.text and "did not finish within" in caplog.text


# --- the cut, through the stream's time limits (TimeLimits.cut) ---------------------------------


async def test_the_cut_ends_the_wait_in_progress_at_once_and_every_later_one_with_its_error():
    limits = TimeLimits(Settings.from_env({}))
    loop = asyncio.get_running_loop()
    waiting = asyncio.ensure_future(limits.wait(asyncio.sleep(30)))
    await asyncio.sleep(0.01)
    started = loop.time()
    limits.cut(instance_draining())
    with pytest.raises(ApiError) as raised:
        await waiting
    assert raised.value.type == ErrorKind.INSTANCE_DRAINING and loop.time() - started < 0.5
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    with pytest.raises(ApiError, match="shutting down"):  # the next wait (a stream parked when it came)
        await limits.wait(asyncio.sleep(30))
    with pytest.raises(ApiError, match="shutting down"):  # a chunk already in hand
        limits.got_chunk()


async def test_a_cancel_racing_the_cut_stays_a_cancel():
    """A cancel that is not the cut (the caller hung up) is never taken for it, nor swallowed."""
    limits = TimeLimits(Settings.from_env({}))
    waiting = asyncio.ensure_future(limits.wait(asyncio.sleep(30)))
    await asyncio.sleep(0.01)
    limits.cut(instance_draining())
    waiting.cancel()  # before the task runs again
    with pytest.raises(asyncio.CancelledError):
        await waiting


# --- through the endpoint -----------------------------------------------------------------------


def serve(endpoint: Endpoint) -> httpx.AsyncClient:
    async def handler(request):
        return await endpoint(request)

    app = Starlette(routes=[Route("/x", handler, methods=["POST"])])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


async def test_a_new_request_while_draining_is_a_retryable_503_before_any_upstream_call():
    client = ScriptedClient(ScriptedStream([chunk(role=True), chunk("hi", "stop")]))
    upstreams = pooled({"a": client})
    life = Lifecycle(1, 30, signals=False)
    endpoint = Endpoint(ChatApi(), upstreams.settings, upstreams, Pipeline(), None, None, life)
    await asyncio.wait_for(life.drain(), 3)
    async with serve(endpoint) as http:
        response = await http.post("/x", json={"prompt": "hi"})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "instance_draining" and response.json()["error"]["retryable"]
    assert response.headers["retry-after"] == "1"
    assert response.headers["x-should-retry"] == "true", "an SDK may retry it: it reaches another instance"
    assert client.calls == 0


async def test_a_cut_openai_stream_ends_with_one_error_chunk_in_openais_shape():
    stream = ScriptedStream([chunk(role=True), chunk("Hel"), chunk("lo")], hang=True)
    upstreams = pooled({"a": ScriptedClient(stream)})
    life = Lifecycle(0.1, 30, signals=False)
    endpoint = Endpoint(OpenAIChatApi(), upstreams.settings, upstreams, Pipeline(), None, None, life)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    asyncio.get_running_loop().call_later(0.3, life.drain)  # httpx's ASGI transport reads the whole body
    async with serve(endpoint) as http:
        response = await http.post("/x", json=body)
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert json.loads(lines[-1])["error"]["code"] == "instance_draining"
    assert sum('"error"' in line for line in lines) == 1 and "[DONE]" not in lines
    assert stream.closed


async def test_a_stream_cut_before_its_first_output_is_a_503_and_its_log_line_says_so(caplog):
    stream = ScriptedStream([chunk(role=True)], hang=True)
    upstreams = pooled({"a": ScriptedClient(stream)})
    life = Lifecycle(0.1, 30, signals=False)
    endpoint = Endpoint(ChatApi(), upstreams.settings, upstreams, Pipeline(), None, None, life)
    asyncio.get_running_loop().call_later(0.2, life.drain)
    with caplog.at_level(logging.INFO, logger="chatstream"):
        async with serve(endpoint) as http:
            response = await http.post("/x", json={"prompt": "hi"})
    assert response.status_code == 503 and response.json()["error"]["type"] == "instance_draining"
    assert response.headers["x-should-retry"] == "true" and stream.closed
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith('{"event"')]
    assert [(line["status"], line["error"], line["disconnected"]) for line in lines] == [
        (503, "instance_draining", False)
    ]


# --- the signal ---------------------------------------------------------------------------------


async def test_sigterm_starts_the_drain_and_goes_on_to_the_handler_that_was_there_after_it():
    calls: list[tuple[str, float]] = []
    loop = asyncio.get_running_loop()

    def runtimes_handler(signum, frame):  # the handler in place before ours: the runtime's (uvicorn's)
        calls.append(("previous", loop.time()))

    async def close():
        calls.append(("closed", loop.time()))

    before = signal.signal(signal.SIGTERM, runtimes_handler)
    try:
        life = Lifecycle(0.2, 30, closing=[close])
        life.admit()  # the first request installs the handler
        record = StreamRecord(endpoint="chat", model="m")
        reading = asyncio.ensure_future(read_all(guarded(life, 1000, 0.05, record, [])))
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(life.drained.wait(), 3)
        await asyncio.sleep(0.05)
        items = await reading
        assert isinstance(items[-1][1], Failed)
        assert [what for what, _ in calls] == ["closed", "previous"], "the runtime's handler runs once, last"
        assert signal.getsignal(signal.SIGTERM) is runtimes_handler, "its handler is back in place"
    finally:
        signal.signal(signal.SIGTERM, before)


async def test_a_second_sigterm_goes_on_to_the_runtimes_handler_at_once():
    calls: list[str] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("previous"))
    try:
        life = Lifecycle(0.5, 30)
        life.admit()
        record = StreamRecord(endpoint="chat", model="m")
        reading = asyncio.ensure_future(read_all(guarded(life, 1000, 0.05, record, [])))
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert life.draining.is_set() and calls == []
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.05)
        assert calls == ["previous"], "the second one is not held back"
        await asyncio.wait_for(life.drained.wait(), 3)
        await reading
        assert calls == ["previous"], "and the end of the drain does not pass it on again"
    finally:
        signal.signal(signal.SIGTERM, before)
