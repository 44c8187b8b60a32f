"""Readers of resumable streams on this instance (``StreamLog.open_reader``): a ``Reader`` follows
the stream to its final event wherever it is produced: from its producer's memory when that is
here (what is stored of it, woken on every write), else from the store (the blob polled as it
grows, the reader registered in the producer's inbox so that it writes fast, its instance's
liveness checked). A reader that finds the producer gone asks its log to take the stream over
(``StreamLog.take_over``) and follows the continuation: one answer, ids going on, one final event."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

from ...errors import StoreError
from ..store import STREAMS_TABLE
from .config import Context
from .errors import PastTheEnd, StreamLogUnavailable, StreamNotFound
from .format import (
    END,
    LOST,
    READER_FIELDS,
    RECORD_ROW,
    Record,
    Tail,
    log_tag,
    record_over,
    started_at,
)
from .inbox import Registration
from .producer import Producer
from .takeover import producer_gone

log = logging.getLogger("chatstream")

Events = AsyncGenerator[bytes, None]


async def read_record(ctx: Context, stream_id: str, caller: str | None) -> Record:
    """The stream's record, once it is written: its producer writes it in the background as the
    stream starts (the id goes out at once), so for a stream started less than ``give_up_seconds``
    ago (by the store's clock, which every instance reads alike) a missing record is waited for, and
    ``lost_record_seconds`` more: a producer that gave up on it then records the stream lost.
    StreamNotFound (none, expired, another caller's); StoreError when the store fails."""
    cfg = ctx.config
    born = started_at(stream_id) or ctx.now()  # 0: started before its producer heard the store's clock
    # Two seconds more: how far two readings of the store's clock differ.
    young_until = born + cfg.give_up_seconds + cfg.lost_record_seconds + 2.0
    pause, then = None, cfg.young_poll_seconds
    loop = asyncio.get_running_loop()
    while True:
        sent = loop.time()
        row = await ctx.store.get(STREAMS_TABLE, stream_id, RECORD_ROW, select=READER_FIELDS)
        if row is not None:
            break
        # The first read again after half the time it took: a reader that comes with the stream's
        # first events (its id goes out as the record's insert is sent) often reads just before
        # the insert lands, which takes about as long as that read.
        pause = min(then, (loop.time() - sent) / 2) if pause is None else pause
        now = ctx.now()
        if now + pause > young_until or born > now + 2.0:
            raise StreamNotFound("no record")
        await asyncio.sleep(pause)
        # Longer each time: a record that is late is late because the store is busy; polling it
        # faster would only add to that. But not past 0.1 s in the stream's first second, when the
        # record is normally on its way.
        pause, then = then, min(1.0 if now > born + 1.0 else 0.1, then * 1.5)
    record = Record.of(row)
    if record.expires < ctx.now():
        raise StreamNotFound("expired")
    if record.owner is not None and record.owner != caller:
        raise StreamNotFound("another caller's")
    return record


# A reader from the store polls the blob a third of poll_seconds apart while nothing comes (after
# three such polls, slower and slower, to max_poll_seconds). After new bytes the next poll begins a
# little less than poll_seconds after this one began: the polls drift earlier until one comes just
# before a write lands and finds nothing (then a third of poll_seconds later: that write waits
# ~33 ms, not 100), so they stay close behind the producer's writes, not at whatever distance
# behind them they happened to start (~50 ms on average).
_LEAD = 0.9


class Reader:
    """A resumed stream (module docstring): the bytes after event ``after`` to the final event, in
    ``route``'s format; ``tail.cursor`` is the last id the client has. Close it with ``aclose``
    (Starlette's StreamingResponse does): until then, or its end, it counts in ``ctx.readers`` and,
    while its stream is produced on another instance, is registered in that one's inbox (inbox.py)."""

    def __init__(
        self,
        ctx: Context,
        stream_id: str,
        after: int,
        producing: Callable[[str], Producer | None],  # (``StreamLog.producing``)
        take_over: Callable[[str, int], Awaitable[bool]],  # (``StreamLog.take_over``)
    ):
        ctx.readers[stream_id] += 1
        self._counted = True  # (until released)
        self._ctx = ctx
        self._cfg = ctx.config
        self._producing, self._take_over = producing, take_over
        self.stream_id = stream_id
        self.route = ""  # (known once opened)
        self.after = after
        self._registration = Registration(ctx, stream_id)
        self.record: Record | None = None
        self.tail = Tail(after)
        self.over = False  # the reading has handed out its end (its final event, or its own error)
        # Set when this instance stops: the reading ends now, unless it is over, with ``moved_event()``.
        self.leaving = ctx.leaving
        self._grew_at: float | None = None  # when this reader last saw the log grow (this process's clock)
        self._gone_at: float | None = None  # when it first found the producer gone
        self._record_at = asyncio.get_running_loop().time() + 3 * self._cfg.poll_seconds  # (_poll)
        self._tag = log_tag(stream_id)
        self._first = b""  # what the opening read: handed out first
        self._events = self._read()

    def __aiter__(self) -> Reader:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await anext(self._events)
        except BaseException:
            await self.aclose()
            raise

    def moved_event(self) -> bytes:
        """The reading's end when this instance stops (as its producer's live caller's): it is ``over``."""
        self.over = True
        return self._ctx.moved_event(self.route)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        self._registration.release(read_to_end=self.tail.end is not None)
        if self._counted:
            self._counted = False
            self._ctx.readers[self.stream_id] -= 1
            if not self._ctx.readers[self.stream_id]:
                del self._ctx.readers[self.stream_id]

    def __del__(self) -> None:
        self._release()

    # -- opening -------------------------------------------------------------------------------

    async def opened(self, caller: str | None) -> Reader:
        """This reader, opened: checked, what is stored read (from the producer when it is here: no
        store call, else ``_open_stored``); else released (a store that fails: StreamLogUnavailable)."""
        try:
            producer = self._producing(self.stream_id)
            if producer is None:
                await self._open_stored(caller)
                return self
            if producer.owner is not None and producer.owner != caller:
                raise StreamNotFound("another caller's")
            never_stored = producer.never_stored(self.after)  # the reader ends with stream_lost at once
            if self.after > producer.last_id and producer.end != LOST and not never_stored:
                raise PastTheEnd(self.after, producer.last_id)
            self.route = producer.route
        except BaseException as exc:
            self._release()
            if isinstance(exc, StoreError):
                raise StreamLogUnavailable(f"the stream's store is unavailable ({exc})") from None
            raise
        return self

    async def _open_stored(self, caller: str | None) -> None:
        """A stream produced elsewhere (or by nobody any more): its record, then its registration and
        the stored log at once, then ``after`` checked. A young stream's inbox row is written as the
        record is read, to the instance whose stream a reader here opened last: most often (two
        instances: always) the producer, which then sees the reader one record read sooner."""
        ctx, registration, stream_id = self._ctx, self._registration, self.stream_id
        guess = ctx.last_producer if ctx.now() - started_at(stream_id) < ctx.config.young_seconds else None
        record, _ = await asyncio.gather(
            read_record(ctx, stream_id, caller),
            registration.follow(guess) if guess is not None else asyncio.sleep(0),  # (failed: ``open`` again)
            return_exceptions=True,
        )
        if not isinstance(record, Record):
            raise record
        self.record, self.route = record, record.route
        live = record.state == "live"
        if live and record.instance != ctx.instances.id:
            ctx.last_producer = record.instance
        stored = record.log_from(0)  # ended before its first write: the whole log is in the record
        registered, data, _ = await asyncio.gather(
            registration.open(record.instance if live else None),
            ctx.store.read(stream_id) if stored is None else asyncio.sleep(0, stored),
            # Its blob made now if not yet (best effort): the producer's first write for this reader is one call.
            ctx.store.append_create(stream_id) if live and stored is None else asyncio.sleep(0),
            return_exceptions=True,
        )
        if isinstance(registered, BaseException) or not isinstance(data, bytes):
            raise registered if isinstance(registered, BaseException) else data  # type: ignore[misc] - one failed
        self._first = self.tail.feed(data)
        if self.after > self.tail.last_id and not self.tail.broken:
            self._first += await self._past_the_end(live)

    # -- reading ---------------------------------------------------------------------------------

    async def _read(self) -> Events:
        first, self._first = self._first, b""
        if first:
            yield first
        while not self.over:
            producer = self._producing(self.stream_id)
            source = self._from_memory(producer) if producer is not None else self._from_store()
            try:
                async for chunk in source:
                    yield chunk
            finally:
                await source.aclose()

    # -- from memory ----------------------------------------------------------------------------

    async def _from_memory(self, producer: Producer) -> Events:
        """Until the stream ends, or goes on elsewhere (``moved``: then from the store)."""
        producer.attach()
        try:
            await self._registration.follow(None)  # (a stream taken over here)
            if producer.never_stored(self.tail.cursor):
                yield self._broken()
                return
            while True:
                readable = producer.last_readable
                if readable > self.tail.cursor:
                    data = producer.events_after(self.tail.cursor)
                    self.tail.cursor = readable
                    yield data
                    continue
                if producer.end_readable:
                    if ending := self._end(producer.end, readable):
                        yield ending
                    return
                if producer.moved.is_set():  # (as this instance stops, the reading ends with ``leaving``)
                    log.info("stream %s: a reader here follows it on another instance now", self._tag)
                    self.tail, self.record = Tail(self.tail.cursor), None  # read both again from the store
                    return
                await producer.changed()
        finally:
            producer.detach()

    # -- from the store -------------------------------------------------------------------------

    async def _from_store(self, wanted: Callable[[], bool] = lambda: True) -> Events:
        """Until the stream ends, or is produced here (taken over by this instance), or ``wanted()``
        is False (the opening's wait past the end)."""
        ctx, cfg, tail = self._ctx, self._cfg, self.tail
        loop = asyncio.get_running_loop()
        now = last_new = loop.time()
        # (_LEAD.) The polls stay quick until a write comes (one is on its way: the reader just
        # registered) for as long as the producer may take to see this reader (an inbox read, then its
        # write): a slower poll would add up to max_poll_seconds.
        poll, idle, quick_until = cfg.poll_seconds / 3, 1, now + cfg.inbox_seconds + 0.5
        state_at = now + cfg.state_seconds  # the producer's next check
        failing_since: float | None = None
        ctx.remote_readers += 1
        try:
            while tail.end is None and not tail.broken:
                if self._producing(self.stream_id) is not None or not wanted():
                    return  # taken over here (from memory now), or the opening's wait is over
                wait = max(poll, ctx.remote_readers / cfg.read_rate)
                await asyncio.sleep(max(0.2 * wait, now + wait - loop.time()))
                now = loop.time()
                try:
                    if self.record is None or tail.epoch > self.record.epoch:  # taken over elsewhere
                        self.record = await self._reread()
                    await self._registration.follow(self.record.instance if self.record.state == "live" else None)
                    # Every read is handed out before any other store call: nothing read is lost.
                    out = await self._poll()
                    if out:
                        poll, idle, quick_until, last_new = cfg.poll_seconds * _LEAD, 0, 0.0, now
                        yield out
                    else:
                        idle += loop.time() >= quick_until
                        slower = min(cfg.max_poll_seconds, cfg.poll_seconds * 1.5 ** (idle - 3))
                        poll = cfg.poll_seconds / 3 if idle <= 3 else slower
                    if tail.end is not None or tail.broken:
                        break
                    if now >= state_at:
                        state_at = now + cfg.state_seconds
                        if await self._gone(now):
                            if out := await self._producer_gone():
                                yield out
                            if self.over:
                                return
                        if self._gone_at is None and now - last_new > cfg.give_up_seconds:  # still stored?
                            last_new = now
                            self.record = await self._reread()
                            if self.record.state == "lost":
                                yield self._lost("the stream stopped being stored")
                                return
                    failing_since = None
                except StoreError:
                    failing_since = failing_since or now
                    if now - failing_since > cfg.give_up_seconds:
                        self.over = True
                        yield ctx.error_event(self.route, "store_unavailable", "the stream's store is unavailable")
                        return
            if ending := self._broken() if tail.broken else self._end(tail.end, tail.last_id):
                yield ending
        finally:
            ctx.remote_readers -= 1

    async def _poll(self) -> bytes:
        """The stream's new whole events, read in turn with this instance's other background calls
        (from the record when the whole log is there). While nothing is stored, the record is read
        beside the blob every few polls: the stream may have ended with its whole log in it (its
        producer did not see this reader in time)."""
        tail, loop = self.tail, asyncio.get_running_loop()
        assert self.record is not None
        data = self.record.log_from(tail.offset)
        if data is None:
            again = tail.offset == 0 and loop.time() >= self._record_at
            async with self._ctx.turns():
                if not again:
                    data = await self._ctx.store.read(self.stream_id, tail.offset)
                else:  # both at once: a reader the producer saw too late waits one call, not two
                    self._record_at = loop.time() + 3 * self._cfg.poll_seconds
                    data, record = await asyncio.gather(self._ctx.store.read(self.stream_id, 0), self._reread())
                    if not data:
                        self.record = record
                        data = record.log_from(0) or b""
        out = tail.feed(data)
        if data:
            self._grew_at = loop.time()
        return out

    async def _reread(self) -> Record:
        row = await self._ctx.store.get(STREAMS_TABLE, self.stream_id, RECORD_ROW, select=READER_FIELDS)
        if row is None:  # swept: its TTL passed (a record of nobody's, lost)
            return Record(self.stream_id, self.route, None, "", self.tail.epoch, 0.0, 0.0, state="lost")
        return Record.of(row)

    async def _gone(self, now: float) -> bool:
        """Whether the producer is gone for good (``producer_gone``): handed over, or found gone twice,
        a check apart (a producer renamed under load, Instances fenced it, says so in the record
        meanwhile; a dead one stays gone). A reader ahead of the log (its client has ids not stored
        yet) waits longer: a takeover ends it with stream_lost, and a producer only slow stores
        them; not when its instance has been silent that long already (a reader that comes late,
        after other readings of it were cut: chaos seed 7)."""
        record, tail, patience = self.record, self.tail, self._cfg.give_up_seconds
        assert record is not None
        growing = self._grew_at is not None and now - self._grew_at < self._ctx.instances.timing.lease_seconds
        if not await producer_gone(self._ctx, record, tail, growing):
            self._gone_at = None
            return False
        if not tail.handover:
            if self._gone_at is None:
                self._gone_at = now
                return False
            ahead = tail.cursor > tail.last_id and now - self._gone_at < patience
            if ahead and (not record.instance or await self._ctx.instances.silent_for(record.instance) < patience):
                return False
        self._gone_at = None
        return True

    async def _producer_gone(self) -> bytes:
        """Nobody produces the stream: what was stored last, then a takeover (or it went on
        elsewhere meanwhile), else ``stream_lost`` (the reading is over)."""
        out = await self._poll()  # one more read for what was stored last
        tail = self.tail
        assert self.record is not None
        if tail.end is not None or tail.broken:
            return out  # over after all (or for this reader): the loop ends it
        fresh = await self._reread()
        if (
            fresh.instance != self.record.instance
            or fresh.epoch != self.record.epoch
            or fresh.state == "ended"
            or fresh.events is not None
        ):
            self.record = fresh  # another producer since (follow it), or over (read on to the end)
            return out
        if fresh.state != "live" or not await self._take_over(self.stream_id, tail.cursor):
            log.warning("stream %s: its producer is gone and it cannot be continued", self._tag)
            # Nobody produces it any more: it is deleted ttl_seconds from now, like a stream that ended.
            over = record_over(self.stream_id, "lost", self._ctx.now() + self._cfg.ttl_seconds)
            self._ctx.later(lambda: self._ctx.store.merge(STREAMS_TABLE, over))
            return out + self._lost("the stream's producer was lost")
        self.record = await self._reread()  # it goes on: whoever produces it now (here: from memory)
        return out

    def _lost(self, message: str) -> bytes:
        """The reading ends with our stream_lost."""
        self.over = True
        return self._ctx.error_event(self.route, "stream_lost", message, self.tail.cursor + 1)

    def _end(self, end: bytes | None, last_id: int) -> bytes:
        """The stream is over (``end``, its log's marker): what the reading gets besides the events. LOST:
        our stream_lost, unless the client has just got it (its last event, ``last_id``)."""
        self.over = True
        cursor = self.tail.cursor
        if end == LOST and not (cursor == last_id and cursor > self.after):
            return self._lost("the stream was lost before its end")
        return b""

    def _broken(self) -> bytes:
        """The reading is after an id that a producer, gone since, handed out but never stored; what
        follows was made again by another producer and is other text (a model does not say the same
        twice): the client cannot be given the rest of its own."""
        log.warning("stream %s: a reader after an event its lost producer never stored: stream_lost", self._tag)
        return self._lost("the events after this one were lost with the instance that produced them")

    async def _past_the_end(self, live: bool) -> bytes:
        """``after`` is past what is stored: PastTheEnd when the stream ended before it, or when its
        producer acks this reader with an earlier last id; a ``live`` stream is followed meanwhile
        (``_from_store``, at most ``past_end_wait_seconds``) until the stored log reaches ``after``, or
        the ack, or the producer is found gone, or the reading is over. What was read meanwhile is
        returned (handed out first)."""
        tail, loop = self.tail, asyncio.get_running_loop()
        deadline = loop.time() + self._cfg.past_end_wait_seconds

        def waiting() -> bool:
            gone = self._gone_at is not None or tail.handover  # no ack comes: the reading takes it over
            acked = self._registration.id in tail.acks
            return self.after > tail.last_id and not acked and not gone and loop.time() < deadline

        read = b""
        if live:
            async with contextlib.aclosing(self._from_store(waiting)) as following:
                async for out in following:
                    read += out
        acked = tail.acks.get(self._registration.id)
        if not tail.broken and (
            (tail.end == END and self.after > tail.last_id) or (acked is not None and self.after > acked)
        ):
            raise PastTheEnd(self.after, tail.last_id)
        return read
