"""A resumed reading's keep-alives (chatstream/resumable.py): a caller that leaves while its reading
waits for the stream closes the reading cleanly, whatever step the reading was in."""

from __future__ import annotations

import asyncio

from chatstream.resumable import _with_keep_alives
from chatstream.sse import KEEP_ALIVE


class Reading:
    """Like the stream log's Reader: an async generator behind ``__anext__``, closed by ``aclose``."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.closed = False
        self._events = self._read()

    async def _read(self):
        yield b"id: 1\ndata: {}\n\n"
        await self.gate.wait()  # a reading that waits for its stream (a takeover, a frozen store)
        yield b"id: 2\ndata: {}\n\n"

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._events)

    async def aclose(self) -> None:
        await self._events.aclose()  # raises RuntimeError while the generator runs in another task
        self.closed = True


async def test_a_caller_gone_while_the_reading_waits_closes_it_cleanly():
    reading = Reading()
    body = _with_keep_alives(reading, heartbeat=0.01)
    assert await anext(body) == b"id: 1\ndata: {}\n\n"
    assert await anext(body) == KEEP_ALIVE  # the reading waits, in a task of its own
    await body.aclose()  # the response closes its content first, then the reading (on_close)
    await reading.aclose()
    assert reading.closed


async def test_the_reading_read_to_its_end_ends_the_body():
    reading = Reading()
    reading.gate.set()
    assert [data async for data in _with_keep_alives(reading, heartbeat=5)] == [
        b"id: 1\ndata: {}\n\n",
        b"id: 2\ndata: {}\n\n",
    ]
