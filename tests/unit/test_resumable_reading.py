"""A resumed reading's keep-alives (chatstream/resumable.py): a caller that leaves while its reading
waits for the stream closes the reading cleanly, whatever step the reading was in; an instance that
stops ends the reading at once with ``stream_moved``, unless it is over."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from chatstream.resumable import _with_keep_alives
from chatstream.sse import KEEP_ALIVE
from chatstream.state.streamlog.readers import Reader

MOVED = b"event: error\ndata: stream_moved\n\n"


class Reading:
    """Like the stream log's Reader: an async generator behind ``__anext__``, closed by ``aclose``."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.leaving = asyncio.Event()  # StreamLog.move_readers
        self.over = False
        self.closed = False
        self._events = self._read()

    async def _read(self):
        yield b"id: 1\ndata: {}\n\n"
        await self.gate.wait()  # a reading that waits for its stream (a takeover, a frozen store)
        self.over = True
        yield b"id: 2\ndata: {}\n\n"

    def moved_event(self) -> bytes:
        self.over = True
        return MOVED

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._events)

    async def aclose(self) -> None:
        await self._events.aclose()  # raises RuntimeError while the generator runs in another task
        self.closed = True


def keep_alives(reading: Reading, heartbeat: float):
    return _with_keep_alives(cast(Reader, reading), heartbeat)


async def test_a_caller_gone_while_the_reading_waits_closes_it_cleanly():
    reading = Reading()
    body = keep_alives(reading, heartbeat=0.01)
    assert await anext(body) == b"id: 1\ndata: {}\n\n"
    assert await anext(body) == KEEP_ALIVE  # the reading waits, in a task of its own
    await body.aclose()  # the response closes its content first, then the reading (on_close)
    await reading.aclose()
    assert reading.closed


async def test_the_reading_read_to_its_end_ends_the_body():
    reading = Reading()
    reading.gate.set()
    assert [data async for data in keep_alives(reading, heartbeat=5)] == [
        b"id: 1\ndata: {}\n\n",
        b"id: 2\ndata: {}\n\n",
    ]


async def test_an_instance_that_stops_ends_a_waiting_reading_with_stream_moved_once():
    reading = Reading()
    body = keep_alives(reading, heartbeat=5)
    assert await anext(body) == b"id: 1\ndata: {}\n\n"
    asyncio.get_running_loop().call_later(0.05, reading.leaving.set)
    async with asyncio.timeout(1):  # not at the next heartbeat
        assert [data async for data in body] == [MOVED]
    await reading.aclose()  # the reading's step was cancelled and waited for: it closes cleanly
    assert reading.closed


async def test_a_reading_that_handed_out_its_end_gets_no_stream_moved():
    reading = Reading()
    reading.gate.set()
    body = keep_alives(reading, heartbeat=5)
    assert await anext(body) == b"id: 1\ndata: {}\n\n"
    assert await anext(body) == b"id: 2\ndata: {}\n\n"
    reading.leaving.set()
    assert [data async for data in body] == []


async def _relayed_with_slow_writes(endpoint: str, answer, protocol) -> list[tuple[bytes, bool]]:
    """``answer`` (its items) relayed to a live caller by a resumable stream on one instance whose
    stream writes are slow (its beats are not): each piece the caller got (keep-alives left out),
    and whether the log held the whole answer then."""
    from types import SimpleNamespace

    from memory_store import Fault

    from chatstream.record import StreamRecord
    from chatstream.resumable import Resumable
    from chatstream.state.store import STREAMS_TABLE
    from chatstream.stream import Done

    from .streamlog_helpers import DONE, QUICK, delta, instances

    async with instances(1, **QUICK) as (a,):
        producer = a.start(endpoint, None)
        for table in (STREAMS_TABLE, "blob"):
            a.store.inject(Fault("slow", table=table, delay=0.3, times=10**9))

        def encode(item) -> bytes:
            return DONE if isinstance(item, Done) else delta(item.data["i"])

        events = answer()
        first = asyncio.ensure_future(anext(events))
        limits = SimpleNamespace(total_at=asyncio.get_running_loop().time() + 60)
        resumable = Resumable(a, heartbeat=5, accounting=None)
        response = resumable.respond(
            producer,
            first,
            events,
            encode,
            cast(Any, protocol),
            cast(Any, limits),
            StreamRecord(endpoint=endpoint, model="m"),
            {},
        )
        seen = []
        async with asyncio.timeout(10):
            async for data in response.body_iterator:  # type: ignore[attr-defined]
                seen.append((data, producer.end_readable))
        await producer.wait_stored(5)
    return [(data, bool(stored)) for data, stored in seen if not data.startswith(b":")]


async def test_the_live_callers_last_event_comes_once_the_log_holds_the_whole_answer():
    """An instance killed as an answer ends: its caller read all of it, and the dead instance's
    recovery charges what the log holds (the journal's checkpoint is up to 0.5 s behind). So the
    final event goes to the live caller only once the log has it (a chaos soak found lost parts
    read to their end charged 37-41 of 42 tokens)."""
    from types import SimpleNamespace

    from chatstream.stream import Chunk, Done

    from .streamlog_helpers import DONE

    async def answer():
        for i in range(3):
            yield Chunk({"i": i})
        yield Done("stop", {0: "stop"}, None, None, None, None)

    seen = await _relayed_with_slow_writes("chat", answer, SimpleNamespace(done=False))
    assert seen[-1][0].endswith(DONE) and seen[-1][1]  # the log held the end when the caller got it
    assert not seen[0][1]  # (the deltas before it did not wait)


async def test_the_chunk_that_completes_an_answer_goes_out_with_its_final_event_once_the_log_holds_both():
    """Chaos seed 97: an instance killed as chat-completions answers ended; their callers held the
    finish_reason chunk, which the log never held, so a resume after it got stream_lost for an
    answer they had whole. That chunk now waits for the final event (and the log) too."""
    from types import SimpleNamespace

    from chatstream.stream import Chunk, Done

    from .streamlog_helpers import DONE, delta

    protocol = SimpleNamespace(done=False)

    async def answer():
        for i in range(3):
            yield Chunk({"i": i})
        protocol.done = True  # (the protocol has read the finish_reason)
        yield Chunk({"i": 99})
        yield Done("stop", {0: "stop"}, None, None, None, None)

    seen = await _relayed_with_slow_writes("openai", answer, protocol)
    assert len(seen) == 4 and seen[-1][1], seen  # three deltas, then the finish and the end together
    assert delta(99) in seen[-1][0] and seen[-1][0].endswith(DONE), seen[-1]
