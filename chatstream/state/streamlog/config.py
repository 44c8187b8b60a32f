"""The tuning of resumable streams (``ResumeConfig``: two settings, the producer's cap, cadences and
limits; docs/resumable.md gives the bounds) and what the parts of one stream log share (``Context``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from ... import sse
from ...errors import StoreError
from ..instances import Instances
from ..store import BUSY_TIMEOUT, Store
from .format import EncodeError, LogError

log = logging.getLogger("chatstream")


@dataclass(frozen=True)
class ResumeConfig:
    abandon_seconds: float = 30.0  # RESUME_ABANDON_SECONDS
    ttl_seconds: float = 600.0  # RESUME_TTL_SECONDS
    # A producer not finished this long after it started is ended here (stream_lost) and asked to
    # stop: set it above the relay's own total limit.
    max_stream_seconds: float = 660.0
    # How far the stored log may trail what the live caller got (what a takeover regenerates): one
    # write every checkpoint_seconds, or as soon as flush_bytes wait; every fast_flush_seconds while
    # a reader elsewhere follows, for read_fresh_seconds after the caller hung up (a resume is likely)
    # and after a takeover.
    fast_flush_seconds: float = 0.1
    checkpoint_seconds: float = 5.0
    flush_bytes: int = 512 * 1024
    max_stream_bytes: int = 16 * 1024 * 1024  # kept (memory, blob) per stream; beyond it: not resumable
    # A remote reader polls the blob about every poll_seconds (the producer's fast writes) while bytes
    # flow, then slower, to max_poll_seconds (readers.Reader._from_store).
    poll_seconds: float = 0.1
    max_poll_seconds: float = 0.5
    # Many streams followed at once: the instance's fast writes and remote polls are spread so that
    # together they stay under write_rate and read_rate calls a second (each stream's interval grows
    # with their number): a store call costs ~1-2 ms of CPU (docs/resumable.md).
    write_rate: float = 100.0
    read_rate: float = 200.0
    # ...and at most this many of them are in flight at once (Turns): when the store is slow they
    # wait here, not in its queue ahead of the heartbeat, the inbox and the routes' own calls.
    bulk_calls: int = 16
    young_poll_seconds: float = 0.05  # a reader elsewhere waits for a young stream's record (read_record)
    state_seconds: float = 1.0  # a remote reader checks that the producer's instance is alive this often
    # A producing instance reads its inbox every inbox_seconds, every inbox_young_seconds while one of
    # its streams is younger than young_seconds: a reader that comes with a stream's first events (a
    # second screen) is seen at once, so it follows closely short streams too.
    inbox_seconds: float = 0.5
    inbox_young_seconds: float = 0.1
    young_seconds: float = 2.0
    give_up_seconds: float = 10.0  # the store failing this long: a producer stops storing, a reader ends
    # A reader elsewhere waits this much longer for a record: the create's last call (of a busy store),
    # or a producer that gave up before its record landed writes it, lost.
    lost_record_seconds: float = BUSY_TIMEOUT
    # A reading that starts past what is stored of a live stream elsewhere: wait at most this long for the
    # producer to store it, or to acknowledge the reader with its last id.
    past_end_wait_seconds: float = 5.0
    max_readers: int = 256  # readers this instance serves at once
    max_readers_per_stream: int = 16  # readers of one stream this instance serves at once
    max_producers: int = 1000
    max_sweep: int = 1000  # rows one sweep deletes at most

    @classmethod
    def from_settings(cls, settings: Any) -> ResumeConfig:
        """From the app's Settings: RESUME_ABANDON_SECONDS, RESUME_TTL_SECONDS, TOTAL_TIMEOUT_SECONDS."""
        return cls(
            abandon_seconds=settings.resume_abandon_seconds,
            ttl_seconds=settings.resume_ttl_seconds,
            max_stream_seconds=settings.total_timeout + 60.0,
        )

    @property
    def read_refresh_seconds(self) -> float:
        """How often a reader elsewhere says it is still reading (its inbox row)."""
        return max(0.2, min(5.0, self.abandon_seconds / 3))

    @property
    def reader_row_seconds(self) -> float:
        """How long a reader's inbox row outlives its last write (then the sweep takes it)."""
        return min(2 * self.abandon_seconds + 60.0, max(self.ttl_seconds, 3 * self.read_refresh_seconds + 5.0))

    @property
    def read_fresh_seconds(self) -> float:
        """A reader elsewhere seen within this long means it is following (fast writes)."""
        return 2 * self.read_refresh_seconds + 1.0

    @property
    def sweep_seconds(self) -> float:
        """A quarter of the TTL, within 1 s..5 min: a stream is deleted at most 25% after its TTL."""
        return max(1.0, min(300.0, self.ttl_seconds / 4))


class Turns:
    """At most ``calls`` background store calls at once (``async with turns():``); a call that a reader
    waits for (``turns(first=True)``, a write of a stream someone follows) goes ahead of the others that
    wait (the other streams' checkpoints and ends): their turns are in order."""

    def __init__(self, calls: int):
        self._free = calls
        self._waiting: tuple[deque[asyncio.Future], deque[asyncio.Future]] = (deque(), deque())

    @contextlib.asynccontextmanager
    async def __call__(self, first: bool = False) -> AsyncIterator[None]:
        if self._free > 0 and not (self._waiting[0] or self._waiting[1]):
            self._free -= 1
        else:
            turn = asyncio.get_running_loop().create_future()
            self._waiting[0 if first else 1].append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._give()  # given just as it was cancelled: to the next one
                raise
        try:
            yield
        finally:
            self._give()

    def _give(self) -> None:
        for waiting in self._waiting:
            while waiting:
                turn = waiting.popleft()
                if not turn.done():
                    turn.set_result(None)
                    return
        self._free += 1


class Context:
    """What the parts of one stream log share: the store, this instance (``instances``: its id, its
    heartbeat, the others' liveness), the settings, the error encoder, and the rest below."""

    def __init__(self, store: Store, instances: Instances, config: ResumeConfig, encode_error: EncodeError):
        self.store = store
        self.instances = instances
        self.config = config
        self._encode_error = encode_error
        self.turns = Turns(config.bulk_calls)  # the turns background calls take at the store
        # The producers writing fast and the readers following from the store here: each one's
        # cadence grows with their number.
        self.fast_writers = self.remote_readers = 0
        # The readers this instance serves, by stream (at most max_readers, max_readers_per_stream of one).
        self.readers: Counter[str] = Counter()
        self.last_producer: str | None = None  # the instance whose stream a reader here opened last (readers.py)
        self.closed = False
        self.leaving = asyncio.Event()  # this instance stops: every reading here ends with stream_moved
        self.tasks: set[asyncio.Task] = set()  # the background tasks (none after close)

    def error_event(self, route: str, type: LogError, message: str, number: int | None = None) -> bytes:
        """One of our error events (format.LogError) in ``route``'s format, numbered ``number``; None:
        no id, not an event of the stream (a reading's own end: its client asks again after the last
        id it got, as after a cut)."""
        data = self._encode_error(route, type, message)
        return data if number is None else sse.numbered(number, data)

    def moved_event(self, route: str) -> bytes:
        """What ends a reading (a live caller's, a reader's) once its stream goes on elsewhere."""
        return self.error_event(route, "stream_moved", "the stream goes on on another instance: resume it")

    def now(self) -> float:
        """The store's time (seconds since 1970): every time that crosses instances is on it."""
        return self.store.clock.now()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
        """Run ``coro`` in the background (its error logged); None once closed (it is not run)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a reader collected outside the loop: nothing to run it on
            loop = None
        if self.closed or loop is None:
            coro.close()
            return None
        task = loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def later(self, call: Callable[[], Awaitable[Any]]) -> None:
        """A best-effort store call in the background (a row left behind expires and is swept)."""

        async def run() -> None:
            with contextlib.suppress(StoreError):
                await call()

        self.spawn(run())

    def _ended(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("resumable streams: a background task failed", exc_info=task.exception())

    async def close(self) -> None:
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
