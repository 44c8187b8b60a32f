"""A resumed reading's keep-alives (chatstream/resumable.py): a caller that leaves while its reading
waits for the stream closes the reading cleanly, whatever step the reading was in; an instance that
stops ends the reading at once with ``stream_moved``, unless it is over."""

from __future__ import annotations

import asyncio
from typing import cast

from chatstream.resumable import _with_keep_alives
from chatstream.sse import KEEP_ALIVE
from chatstream.state.streamlog import Reader

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
