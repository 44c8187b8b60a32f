"""The reader side of resumable streams on this instance: ``Reader`` (what ``open_reader`` returns),
``ReaderSlots`` (the readers served here, counted for the limits) and ``follow_local`` (a stream
produced here, served from its producer's memory and woken on every append). Following a stream
produced elsewhere is stream_remote.py."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from .config import ResumeConfig
from .format import EncodeError, error_event
from .ids import Route
from .producer import Producer

Events = AsyncGenerator[bytes, None]


class Reader:
    """A resumed stream: an async iterator of bytes (the SSE events after Last-Event-ID, then the
    live ones up to the final event). ``route`` is the format of its events. Close it with
    ``aclose`` (Starlette's StreamingResponse does) when the caller goes."""

    def __init__(self, route: Route, events: Events, release: Callable[[], None]):
        self.route: Route = route
        self._events = events
        self._release = release

    def __aiter__(self) -> Reader:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._events)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._release()

    def __del__(self) -> None:
        self._release()


class ReaderSlots:
    """The readers this instance serves, in all (``total``) and per stream."""

    def __init__(self) -> None:
        self.total = 0
        self._of: dict[str, int] = {}

    def full(self, stream_id: str, config: ResumeConfig) -> bool:
        """No room for one more reader of ``stream_id`` (max_readers, max_readers_per_stream)."""
        return self.total >= config.max_readers or self._of.get(stream_id, 0) >= config.max_readers_per_stream

    def open(self, stream_id: str, route: Route, make: Callable[[], Events]) -> Reader:
        """A reader of the events ``make`` gives, holding its slot until it is closed or its events end."""
        self.total += 1
        self._of[stream_id] = self._of.get(stream_id, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.total -= 1
                left = self._of.get(stream_id, 1) - 1
                if left > 0:
                    self._of[stream_id] = left
                else:
                    self._of.pop(stream_id, None)

        async def events() -> Events:
            inner = make()
            try:
                async for chunk in inner:
                    yield chunk
            finally:
                try:
                    await inner.aclose()
                finally:
                    release()

        return Reader(route, events(), release)


async def follow_local(producer: Producer, after: int, encode_error: EncodeError) -> Events:
    """The events of a stream produced here after event ``after``, then the live ones to its end."""
    cursor = after
    kept = producer._kept
    producer._attach()
    try:
        while True:
            count = len(kept.events)
            if count > cursor:
                chunk = b"".join(kept.events[cursor:count])
                cursor = count
                yield chunk
                continue
            if kept.end:
                if kept.lost and not (cursor == len(kept.events) and cursor > after):
                    # The client is past what was kept: it still gets a final event.
                    yield error_event(
                        encode_error,
                        producer.route,
                        "stream_lost",
                        "the stream was lost before its end",
                        True,
                        cursor + 1,
                    )
                return
            await kept.changed()
    finally:
        producer._detach()
