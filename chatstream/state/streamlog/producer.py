"""The producing side of a resumable stream (``Producer``): it numbers the events as the route appends
them and keeps them in memory (``append``: no I/O), and stores them in the background (``run``).
Readers here are served what is stored, from memory; only the live caller is ahead of the log, so
that no reader holds an id the log never had if this instance dies (format.EPOCH_IDS).

Storing: the record at the start, then one loop writes what is due (``_due``: the kept events, the
acks readers elsewhere asked for, the marker that closes the log: end, lost or handover) in blocks
appended at the stored end, then the record's end (the whole log in it when no blob was made:
format.py). Each call waits as long as a busy store takes (``BUSY_TIMEOUT``: nobody waits on it).
A store failing for ``give_up_seconds`` stops the storing (the live stream goes on; the log is
closed with a ``stream_lost`` error as soon as the store lets it); someone else's bytes at the
append position stop it for good: another instance took the stream over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Literal

from ... import sse
from ...errors import AlreadyExists, Modified, NotFound, StoreError, StoreUnavailable
from ..store import BUSY_TIMEOUT, NEW, STREAMS_TABLE
from .config import Context
from .format import (
    BLOCK_LIMIT,
    BLOCKS_LIMIT,
    END,
    EPOCH_IDS,
    HANDOVER,
    LOST,
    RECORD_ROW,
    Record,
    ack_marker,
    epoch_id,
    fits_record,
    log_tag,
    never_stored,
    position,
    record_over,
    request_blob,
)

log = logging.getLogger("chatstream")

StopReason = Literal["cancelled", "abandoned", "timeout", "taken_over", "handed_over"]
# The stream goes on elsewhere: the relay stops, and its live caller resumes with Last-Event-ID.
MOVED: tuple[StopReason, ...] = ("taken_over", "handed_over")


@dataclass(frozen=True)
class _Attempt:
    """One append: the events it carries, its bytes, the marker that closes the log with it (END,
    LOST, HANDOVER; None: it stays open), the acks it stores."""

    count: int
    block: bytes
    closes: bytes | None
    acks: tuple[str, ...]


class Producer:
    """One stream produced on this instance. Made by ``StreamLog.start`` (a new stream) or by a claim
    (a stream taken over: its stored events are kept here, and ids go on after them); see
    ``StreamLog`` for the request path's contract."""

    def __init__(
        self,
        ctx: Context,
        record: Record,
        *,
        stored: list[bytes] | None = None,
        stored_bytes: int = 0,
        fences: list[tuple[int, int]] | None = None,
        large_request: str | None = None,
        received: int = 0,
    ):
        continuing = stored is not None
        self.id = record.stream_id
        self.route = record.route
        self.owner = record.owner
        # Set when the relay must stop (``stop_reason``: a cancel from any instance, via the inbox;
        # nobody reading for abandon_seconds; the time cap; or MOVED, the stream going on elsewhere:
        # taken over, or handed over as this instance drains). It closes the upstream at once and
        # appends the route's final event, finish_reason ``cancelled``; MOVED: the live caller's
        # answer ends with ``moved_event()`` instead.
        self.stop_requested = asyncio.Event()
        self.stop_reason: StopReason | None = None
        self.moved = asyncio.Event()
        self._ctx = ctx
        self._cfg = ctx.config
        self._record = record
        self._tag = log_tag(self.id)
        self._loop = asyncio.get_running_loop()
        # Started by the store's clock: a continuation's cap counts from the stream's own start.
        self._started = self._loop.time() - max(0.0, ctx.now() - record.created)
        self._born = self._loop.time()
        # -- in memory: what is kept, by position (1, 2, …), the stored events of earlier producers first
        self._events = list(stored or ())
        self._size = sum(map(len, self._events))
        self._seam = len(self._events)  # the positions stored by earlier producers
        self.epoch = record.epoch  # the stream's producers so far, this one included (Record.epoch)
        self._fences = list(fences or ())  # the takeovers before this producer (format.never_stored)
        self._handed = len(self._events)  # positions handed out (to the live caller)
        self.end: bytes | None = None  # the final event is kept: END (the route's) or LOST (our stream_lost)
        self._final_by_caller = False  # the route appended its final event: it appends no more
        self._handing_over = False  # nothing more is kept: the stream goes on elsewhere
        self._waiters: list[asyncio.Future] = []  # readers here waiting for a change (``changed``)
        # -- who reads it: abandonment, fast writes
        self._caller_here = not continuing  # the original caller (a continuation has none)
        self._attached = int(self._caller_here)  # ...and the readers here
        self._alone_since = self._loop.time()
        self._remote_read_at = 0.0  # the store's time a reader elsewhere was last seen (abandonment)
        self._remote_follow_at = 0.0  # ...and last seen still following (fast writes)
        self._following = False  # a reader elsewhere follows
        # A continuation whose asking reader's client holds events its log never had (that reader ended
        # with stream_lost): the position it reached, which the continuation is run to even with nobody
        # reading, since its events up to there are what that client is charged (Claim.stand_ins); 0: none.
        reached = position(received)
        self.stand_in_to = reached if reached > len(self._events) else 0
        # -- storing (module docstring)
        # False once storing failed for good (the live stream goes on; readers elsewhere get stream_lost).
        self.resumable = True
        self._large_request = large_request
        self._blob = continuing  # the blob exists (a continuation's: the takeover's fence made it)
        self._inline_tried = False  # the end, with no blob yet: its whole log tried in the record (once)
        self._storing_over = asyncio.Event()  # storing finished (stored, given up, or moved)
        self._kick = asyncio.Event()  # wakes the storing
        self._stored = len(self._events)  # events in the blob
        self._stored_bytes = stored_bytes  # the blob's length
        self._stored_size = self._size  # the bytes of the events in it (markers aside)
        self._closed: bytes | None = None  # the marker that closed the stored log (_Attempt.closes)
        self._blocks = 0  # appended to the blob (at most BLOCKS_LIMIT)
        self._uncertain: list[_Attempt] = []  # appends not answered since the last confirmed one
        self._acks: list[str] = []  # acks to store with the next write...
        self._acked: set[str] = set()  # ...and every one asked for (each is stored once)
        self._fast = False
        self._fast_until = self._loop.time() + self._cfg.read_fresh_seconds if continuing else 0.0
        self._idle = False
        self._last_write = self._started if not continuing else 0.0  # the first checkpoint is one interval in

    # -- the request path's side --------------------------------------------------------------

    @property
    def last_id(self) -> int:
        """The id of the last event handed out."""
        return self._id_at(self._handed)

    def never_stored(self, after: int) -> bool:
        """Whether ``after`` is an id an earlier producer of this stream handed out and never stored."""
        return never_stored(after, self._fences)

    def append(self, data: bytes, *, final: bool = False) -> bytes:
        """Number ``data`` (one or more complete SSE events, LF line ends, each ending with a blank
        line) and keep it for the readers; return it with an ``id: N`` line first in each event:
        the bytes to send to the live caller. Comment-only events (``: keep-alive``) pass through
        unnumbered and unkept. ``final``: ``data`` holds the stream's final event(s). No I/O."""
        if not data.endswith(sse.END_OF_EVENT) or b"\r" in data:
            raise ValueError("append takes whole SSE events with LF line ends")
        if self._final_by_caller:
            raise RuntimeError("append after the final event")
        if self._handing_over or self.moved.is_set():
            # The stream goes on elsewhere from its stored end: the live caller gets nothing past it
            # (its resume there would hold ids never stored), and the final event tells it to resume.
            self._final_by_caller = final
            return self.moved_event() if final else b""
        last_blank = len(data) - 2
        if last_blank <= 0:
            return data
        if data.find(sse.END_OF_EVENT) == last_blank:  # one event: the common case
            parts = [data]
        else:
            parts = [part + sse.END_OF_EVENT for part in sse.split(data)[0] if part]
        out = []
        for part in parts:
            if sse.is_comment(part[:-2]):  # (a keep-alive)
                out.append(part)
                continue
            self._handed += 1
            event = sse.numbered(epoch_id(self.epoch, self._handed), part)
            out.append(event)
            self._keep(event)
        if final:
            self._final_by_caller = True
            if self.end is None:
                self.end = END
                self._kick.set()
        if self._waiters:  # (a call and a list fewer per event when nobody here waits)
            self._wake()
        # An idle storing starts its checkpoint wait now; a fast one, or one with flush_bytes waiting, writes.
        if self._idle or self._fast or self._size - self._stored_size >= self._cfg.flush_bytes:
            self._kick.set()
        return out[0] if len(out) == 1 else b"".join(out)

    def caller_gone(self) -> None:
        """The original caller hung up: keep producing (the generation goes on and is stored), and
        call ``finish`` as usual. Starts the abandonment clock once no reader is left; stores what is
        in hand now and writes fast for a while (a resume elsewhere is likely)."""
        if self._caller_here:
            self._caller_here = False
            self.detach()
        if self.end is None:  # (read to its end: nothing more comes, and the end is written at once)
            self._last_write = -math.inf  # what is in hand is written now
            self._fast_until = self._loop.time() + self._cfg.read_fresh_seconds
            self._update_fast()
            self._kick.set()

    def finish(self) -> None:
        """The stream is over (call it in ``finally``, once). If no final event was appended, the
        stored stream ends with a ``stream_lost`` error. Returns at once; the last write goes on in
        the background (``wait_stored``)."""
        if self.end is None and not self._handing_over:
            self._end_with_error("the stream ended without its final event")
        self._kick.set()

    async def wait_stored(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - the documented interface
        """Wait until storing is done; True if the whole stream is stored."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._storing_over.wait(), timeout)
        stored_all = self.end is not None and self._stored == len(self._events)
        return self._storing_over.is_set() and self.resumable and stored_all

    async def hand_over(self, timeout: float) -> bool:  # noqa: ASYNC109 - the documented interface
        """Store what is kept with a ``: handover`` marker, then store nothing more: a reader on
        another instance takes the stream over at once (no lease to wait for). The live caller gets
        nothing more (``append``). True once the marker is stored."""
        if self.end is not None or not self.resumable or self._storing_over.is_set():
            return False
        self._handing_over = True
        self._kick.set()
        await self.wait_stored(timeout)
        return self._closed == HANDOVER

    def moved_event(self) -> bytes:
        """What ends the live caller's answer once the stream goes on elsewhere."""
        return self._ctx.moved_event(self.route)

    # -- what readers here use ------------------------------------------------------------------

    def _readable(self) -> int:
        """What readers here may have (module docstring): what is stored; once storing failed for
        good nobody else can go on with the stream, so what is kept."""
        return self._stored if self.resumable else len(self._events)

    def events_after(self, cursor: int, *, all_kept: bool = False) -> bytes:
        """The readable events after id ``cursor`` (b"" when there are none yet); ``all_kept``: all
        it kept, stored or not (what it generated: ``Claim.stand_ins``)."""
        at, end = position(cursor), len(self._events) if all_kept else self._readable()
        return b"".join(self._events[at:end]) if at < end else b""

    @property
    def last_readable(self) -> int:
        """The id of the last readable event (0: none)."""
        return self._id_at(self._readable())

    @property
    def end_readable(self) -> bool:
        """The final event is readable (the last of ``events_after``)."""
        return self.end is not None and (self._closed in (END, LOST) or not self.resumable)

    async def changed(self) -> None:
        """Wait for the next change: an event kept or stored, the end, a move."""
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        await waiter

    def attach(self) -> None:
        self._attached += 1
        self._update_fast()

    def detach(self) -> None:
        self._attached -= 1
        if self._attached <= 0:
            self._attached = 0
            self._alone_since = self._loop.time()
        self._update_fast()

    # -- what the inbox delivers ----------------------------------------------------------------

    def request_stop(self, reason: StopReason) -> None:
        if self.stop_reason is None and not self._final_by_caller:
            self.stop_reason = reason
            self.stop_requested.set()
            log.info("stream %s: stop requested (%s)", self._tag, reason)

    def reader_elsewhere(self, read_at: float, following: bool, ack: str | None) -> None:
        """A reader on another instance said it reads (at ``read_at``, the store's time), or left; it
        may want an ack (``format.ack_marker``): stored with the next write, which is now."""
        read_at = min(read_at, self._ctx.now())
        self._remote_read_at = max(self._remote_read_at, read_at)
        if following:
            self._remote_follow_at = max(self._remote_follow_at, read_at)
            self._following = True
            self._update_fast()
        if ack is not None and ack not in self._acked:
            self._acked.add(ack)
            self._acks.append(ack)
            self._kick.set()

    def young(self) -> bool:
        return self._loop.time() - self._born < self._cfg.young_seconds

    def tick(self, now: float, now_store: float) -> None:
        """Every inbox tick (``now``: when its read began, having delivered what it held): fast
        writes while a reader elsewhere follows; this instance's new id (the storing writes it into
        the record: ``_repoint``); abandonment; the time cap."""
        cfg = self._cfg
        if self._record.instance != self._ctx.instances.id:
            self._kick.set()
        self._following = now_store - self._remote_follow_at < cfg.read_fresh_seconds
        self._update_fast()
        if self.end is not None or self.moved.is_set():
            return
        if now - self._started > cfg.max_stream_seconds:
            log.warning("stream %s ran past %.0f s without finishing: ended here", self._tag, cfg.max_stream_seconds)
            self.request_stop("timeout")
            self._end_with_error("the stream ran past its time limit")
            return
        if self._attached == 0 and (
            (now - self._alone_since >= cfg.abandon_seconds and now_store - self._remote_read_at >= cfg.abandon_seconds)
            or self._unwanted(now_store)
        ):
            self.request_stop("abandoned")

    def _unwanted(self, now_store: float) -> bool:
        """A continuation nobody can use any more: its log holds what stands for the unstored events
        its asking reader's client had (``stand_in_to``), nobody here reads it (the caller checks), no
        reader elsewhere was seen lately, and it is past its young seconds (readers elsewhere find
        a takeover's new instance within about one of their polls and state checks)."""
        return (
            0 < self.stand_in_to <= self._readable()
            and now_store - self._remote_read_at >= self._cfg.read_fresh_seconds
            and not self.young()
        )

    # -- in memory ------------------------------------------------------------------------------

    def _id_at(self, at: int) -> int:
        """The id of the event at position ``at`` (0: none)."""
        if at > self._seam:
            return epoch_id(self.epoch, at)
        return sse.event_id(self._events[at - 1]) or 0 if at else 0

    def _keep(self, event: bytes) -> None:
        if self.end is not None:
            return  # the live caller only: past the kept end
        too_long = self._size + len(event) > self._cfg.max_stream_bytes or len(self._events) >= EPOCH_IDS - 2
        if too_long or len(event) > BLOCK_LIMIT - 64:
            log.warning(
                "stream %s is over %d bytes: it is not resumable past event %d",
                self._tag,
                self._cfg.max_stream_bytes,
                self.last_readable,
            )
            self._end_with_error("the stream is too long to be resumed")  # in this event's place
            return
        self._events.append(event)
        self._size += len(event)

    def _end_with_error(self, message: str) -> None:
        at = len(self._events) + 1
        event = self._ctx.error_event(self.route, "stream_lost", message, self._id_at(at))
        self._events.append(event)
        self._size += len(event)
        self._handed = max(self._handed, at)
        self.end = LOST
        self._wake()
        self._kick.set()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _moved(self, reason: StopReason) -> None:
        """The stream goes on elsewhere: nothing more is stored here; readers here follow the store."""
        if self.moved.is_set():
            return
        self.moved.set()
        if reason == "taken_over":
            log.warning("stream %s was taken over by another instance: this producer stops", self._tag)
        self.request_stop(reason)
        self._wake()

    # -- storing (the log's side) ---------------------------------------------------------------

    async def run(self) -> None:
        """Store the stream; then return at its end (the log knows it until then: readers here,
        cancels and abandonment still need it when it is not stored any more)."""
        try:  # (seen alive first: ``_create`` waits for this instance's first beat, a takeover did)
            if self._blob or await self._create():  # (a continuation's record is the claim's)
                await self._write_all()
        except Exception:  # a bug of ours must not take the live stream with it
            log.exception("stream %s: storing failed", self._tag)
            self._give_up("internal error")
        finally:
            self._storing_over.set()
            self._update_fast()
            self._wake()
        while self.end is None and not self.moved.is_set():
            await self.changed()

    def _update_fast(self) -> None:
        following = self._following or self._attached > self._caller_here
        fast = (following or self._loop.time() < self._fast_until) and not self._storing_over.is_set()
        if fast != self._fast:
            self._ctx.fast_writers += 1 if fast else -1
            self._fast = fast
            if fast:
                self._kick.set()

    def _give_up(self, why: str) -> None:
        if not self.resumable:
            return
        self.resumable = False
        self._wake()
        log.warning("stream %s is not resumable: %s", self._tag, why)
        self._ctx.spawn(self._store_lost())

    async def _create(self) -> bool:
        """The record (after this instance's first beat: nobody must see a stream before its
        producer's lease), tried every 0.25 s for ``give_up_seconds``, each call as long as a busy
        store takes but not past ``lost_record_seconds`` more (a reader elsewhere waits for the
        record that long: readers.read_record). A second try cut at 1.8 s, after an unanswered
        first one, gave up on a store that answered the lost record's insert next (25 of
        test_resumable's 200 under load). The log's blob waits for the first write (a takeover
        makes it when the stream's producer died before)."""
        ctx, record = self._ctx, self._record
        deadline = self._loop.time() + self._cfg.give_up_seconds
        waited_for = deadline + self._cfg.lost_record_seconds
        await ctx.instances.first_beat()
        # By the store's clock as the beat heard it (before any answer, this machine's own was used).
        record.created = ctx.now() - (self._loop.time() - self._started)
        record.expires = record.created + self._cfg.max_stream_seconds + self._cfg.ttl_seconds
        record.instance = ctx.instances.id
        while True:
            try:
                if await self._insert({}, min(BUSY_TIMEOUT, waited_for - self._loop.time())):
                    return True
                self._give_up("its record is someone else's")
                return False
            except StoreError as exc:  # any failure tried again (a table 404s while it is made again)
                if self._loop.time() > deadline:
                    self._give_up(f"the store is unavailable ({exc})")
                    return False
                await asyncio.sleep(0.25)

    async def _write_end(self, closes: bytes, patience: float, whole: str | None = None) -> bool | StoreError:
        """The stream's end in its record (``closes``: the log's last marker, END or LOST; ``whole``:
        the whole log, when no blob holds it), merged on its ETag, or carried by its insert when the
        create never landed (given up: readers wait for it, ResumeConfig.lost_record_seconds). Tried
        every 0.5 s (given up: twice as long each time, to 5 s, and no more once the log closes) for
        ``patience`` seconds. True: written; False: the record is another producer's (taken over); a
        StoreError: the store failed throughout (its last)."""
        ctx, record = self._ctx, self._record
        deadline, pause, unanswered = self._loop.time() + patience, 0.5, False
        state, more = "ended" if closes == END else "lost", {} if whole is None else {"events": whole}
        while True:
            fields = record_over(self.id, state, ctx.now() + self._cfg.ttl_seconds, **more)
            try:
                # (An insert that found an earlier one of its own, without the end, merges it too.)
                if not record.etag and not await self._insert(fields, BUSY_TIMEOUT):
                    return False
                async with ctx.turns():
                    record.etag = await ctx.store.merge(STREAMS_TABLE, fields, etag=record.etag, timeout=BUSY_TIMEOUT)
                return True
            except (Modified, NotFound):
                return unanswered  # True: an earlier attempt landed (its answer lost) and changed the ETag
            except StoreError as exc:
                unanswered = unanswered or isinstance(exc, StoreUnavailable)
                if self._loop.time() > deadline or (ctx.closed and not self.resumable):
                    return exc
                await asyncio.sleep(pause)
                pause = 0.5 if self.resumable else min(5.0, pause * 2)  # (given up: the store is down)

    async def _insert(self, fields: dict, timeout: float) -> bool:  # noqa: ASYNC109 - a store call's bound
        """Insert the record with ``fields``, the large request's own blob first. False: the record
        there is not this producer's (one of its own, an earlier insert whose answer was lost, is:
        its ETag is kept). StoreError."""
        store, record = self._ctx.store, self._record
        if self._large_request is not None:
            async with self._ctx.turns():
                with contextlib.suppress(Modified):  # Modified: an earlier attempt landed
                    await store.put(request_blob(self.id), self._large_request.encode(), etag=NEW, timeout=timeout)
            self._large_request = None
        try:  # the request's own call (a reader elsewhere waits for it): not behind other streams' writes
            record.etag = await store.insert(STREAMS_TABLE, {**record.row(), **fields}, timeout=timeout)
            return True
        except AlreadyExists:
            found = await store.get(STREAMS_TABLE, self.id, RECORD_ROW, select=("instance", "epoch"), timeout=timeout)
            if found is None or (found.get("instance"), found.get("epoch")) != (record.instance, record.epoch):
                return False
            record.etag = found.etag
            return True

    async def _write_all(self) -> None:
        """The storing loop (module docstring): after the record's insert, to the record's end."""
        failing_since: float | None = None
        while self._closed is None:
            self._kick.clear()
            if self._record.instance != self._ctx.instances.id:
                await self._repoint()
            self._update_fast()
            wait = self._due()
            if wait > 0:
                self._idle = wait == math.inf
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(None if self._idle else wait):
                        await self._kick.wait()
                self._idle = False
                continue
            if self._blocks >= BLOCKS_LIMIT - 2:
                self._give_up("the stream has too many blocks")
                return
            if self.end is not None and not self._blob and not self._inline_tried:
                if await self._end_inline():
                    return
                continue
            now = self._last_write = self._loop.time()
            try:
                await self._write_block(self._compose())
                failing_since = None
            except Modified:  # someone else's bytes at its position (_write_block)
                self._moved("taken_over")
                return
            except StoreError as exc:
                failing_since = failing_since or now
                if now - failing_since > self._cfg.give_up_seconds or not isinstance(exc, StoreUnavailable):
                    self._give_up(str(exc))
                    return
                await asyncio.sleep(min(0.5, max(self._cfg.fast_flush_seconds, now - failing_since)))
        if self._closed == HANDOVER:
            self._moved("handed_over")
        elif isinstance(failed := await self._write_end(self._closed, self._cfg.give_up_seconds), StoreError):
            # When that fails the end is still in the log (the record is deleted at its first expiry).
            log.warning("stream %s: its end could not be recorded (%s); it is deleted later", self._tag, failed)

    def _due(self) -> float:
        """How long until the next write is due: 0, now; inf, nothing to write (an append wakes it)."""
        if not (len(self._events) > self._stored or self.end or self._acks or self._handing_over):
            return math.inf
        if self.end or self._handing_over or self._acks or self._size - self._stored_size >= self._cfg.flush_bytes:
            return 0.0
        interval = self._cfg.checkpoint_seconds
        if self._fast:
            interval = max(self._cfg.fast_flush_seconds, self._ctx.fast_writers / self._cfg.write_rate)
        return self._last_write + interval - self._loop.time()

    def _compose(self) -> _Attempt:
        first = self._stored
        limit = min(BLOCK_LIMIT - 4096, self._cfg.max_stream_bytes + 64)
        count, size = 0, 0
        for event in self._events[first:]:
            if count and size + len(event) > limit:
                break
            count += 1
            size += len(event)
        parts = self._events[first : first + count]
        whole = first + count == len(self._events)
        acks = tuple(self._acks) if whole else ()
        parts.extend(ack_marker(nonce, self._id_at(first + count)) for nonce in acks)
        closes = None
        if whole and (self.end or self._handing_over):
            closes = self.end or HANDOVER
            parts.append(sse.comment(closes))
        return _Attempt(count, b"".join(parts), closes, acks)

    async def _write_block(self, attempt: _Attempt) -> _Attempt:
        """Append ``attempt`` at the stored end; the attempt that landed there (an earlier one whose
        answer was lost, perhaps). Modified: someone else's bytes are there (a takeover's fence)."""
        store = self._ctx.store
        offset = self._stored_bytes
        followed = self._following or bool(attempt.acks)

        async def make() -> None:
            with contextlib.suppress(AlreadyExists):  # an earlier attempt landed, a reader's, or a takeover's fence
                await store.append_create(self.id, timeout=BUSY_TIMEOUT)
            self._blob = True

        try:  # a reader elsewhere waits for it: ahead of the other streams' writes (ResumeConfig.bulk_calls)
            async with self._ctx.turns(first=followed):
                if not (self._blob or followed):  # the first write, nobody known elsewhere: made first
                    await make()
                try:
                    await store.append(self.id, attempt.block, at=offset, timeout=BUSY_TIMEOUT)
                except NotFound:
                    # Not made yet, though a reader elsewhere was known (it makes it as it registers,
                    # so the write it waits for is one call): make it, then append.
                    if self._blob:
                        raise
                    await make()
                    await store.append(self.id, attempt.block, at=offset, timeout=BUSY_TIMEOUT)
            self._blob = True
        except StoreUnavailable:
            # No answer: it may still land. Every attempt since the last confirmed one is at this
            # same offset, so the store takes at most one of them; the next one's answer says which.
            self._uncertain.append(attempt)
            raise
        except Modified:
            self._blob = True  # (made elsewhere, by a reader as it registered perhaps: something stored is in it)
            found = await store.read(self.id, offset, timeout=BUSY_TIMEOUT)
            landed = next((a for a in (attempt, *self._uncertain) if found.startswith(a.block)), None)
            if landed is None:
                raise
            if len(found) > len(landed.block):
                self._confirm(landed, offset)
                raise
            attempt = landed
        self._confirm(attempt, offset)
        return attempt

    def _confirm(self, attempt: _Attempt, offset: int) -> None:
        self._uncertain.clear()
        self._stored_size += sum(map(len, self._events[self._stored : self._stored + attempt.count]))
        self._stored += attempt.count
        self._stored_bytes = offset + len(attempt.block)
        self._blocks += 1
        self._acks = [a for a in self._acks if a not in attempt.acks]
        self._closed = self._closed or attempt.closes
        self._wake()

    async def _repoint(self) -> None:
        """This instance goes on under a new id (``Instances`` declared it dead while it was only
        slow): say so in the record, unless the stream was taken over meanwhile."""
        instance = self._ctx.instances.id
        fields = {"PartitionKey": self.id, "RowKey": RECORD_ROW, "instance": instance}
        try:
            self._record.etag = await self._ctx.store.merge(STREAMS_TABLE, fields, etag=self._record.etag)
            self._record.instance = instance
        except (Modified, NotFound):
            self._record.instance = instance  # taken over meanwhile: the next append finds the fence
        except StoreError:
            pass  # again at the next turn

    async def _end_inline(self) -> bool:
        """The stream ended before its first write: unless a reader elsewhere is known to follow it,
        its whole log goes into the record with the record's end, and no blob is made (a reader
        elsewhere the producer has not seen yet reads the record beside the blob: readers.Reader._poll).
        False: write the blob as usual."""
        self._inline_tried = True
        attempt = self._compose()  # (ended: its marker is END or LOST, a hand-over's too)
        try:
            text = attempt.block.decode()
        except UnicodeDecodeError:
            return False
        # (An append whose answer was lost may be in a blob a reader reads; closes None: more than one block.)
        if self._following or self._acks or self._uncertain or attempt.closes is None or not fits_record(text):
            return False
        ended = await self._write_end(attempt.closes, self._cfg.give_up_seconds, text)
        if isinstance(ended, StoreError):
            self._give_up(f"the store is unavailable ({ended})")
        elif not ended:
            self._moved("taken_over")  # the record is another producer's: nothing of this one is stored
        else:
            self._confirm(attempt, 0)
        return True

    async def _store_lost(self) -> None:
        """Given up: as soon as the store lets it (within the stream's cap), close the stored log with
        a ``stream_lost`` error at the stored position (in the record when there is no blob), and
        record its end: readers elsewhere end there instead of waiting."""
        deadline, pause = self._loop.time() + self._cfg.max_stream_seconds, 0.5
        while self._closed is None and self._loop.time() < deadline and not self._ctx.closed:
            message, number = "the stream stopped being stored", self._id_at(self._stored + 1)
            block = self._ctx.error_event(self.route, "stream_lost", message, number) + sse.comment(LOST)
            if not self._blob:
                await self._write_end(LOST, deadline - self._loop.time(), block.decode())
                return
            try:  # (one of the writes whose answer was lost may land first: then after it)
                await self._write_block(_Attempt(0, block, LOST, ()))
            except (Modified, NotFound):
                return  # the log is someone else's now, or gone
            except StoreError:
                await asyncio.sleep(pause)
                pause = min(5.0, pause * 2)
        if self._closed in (END, LOST):
            await self._write_end(self._closed, deadline - self._loop.time())
