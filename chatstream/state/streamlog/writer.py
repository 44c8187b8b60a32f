"""Storing one resumable stream (``Writer``, for its ``Producer``): the record at the start, then
whole-event blocks appended at the expected position (the blob made before the first), at most every
``fast_flush_seconds`` while someone follows (elsewhere, or here), else every
``checkpoint_seconds``; the end marker and the record's end last. A stream that ends before its
first write, with nobody elsewhere following it by then (the inbox read once more after its end to
tell), is stored by the record's end alone: its whole log in the record, no blob (two store calls
in all).

It stops storing when the store fails for ``give_up_seconds`` (it ends the stored log with a
``stream_lost`` error as soon as the store lets it: the live stream goes on), and for good when its
append finds someone else's bytes at its position: another instance took the stream over
(``moved("taken_over")``). A hand-over stores what is kept with a ``: handover`` marker
(``moved("handed_over")``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ... import sse
from ...errors import AlreadyExists, Modified, NotFound, StoreError, StoreUnavailable
from ..store import NEW, STREAMS_TABLE
from .config import Context
from .format import (
    BLOCK_LIMIT,
    BLOCKS_LIMIT,
    END,
    HANDOVER,
    INLINE_EVENTS,
    LOST,
    RECORD_ROW,
    Record,
    ack_marker,
    epoch_id,
    error_event,
    log_tag,
    record_over,
    request_blob,
    text_units,
)

log = logging.getLogger("chatstream")

Moved = Literal["taken_over", "handed_over"]


class Kept:
    """The events a producer keeps, by position (1, 2, …), with what its writer needs to store them:
    the producer adds to it, its writer reads it. ``end``: the final event is kept (``lost``: it is
    our stream_lost); ``handing_over``: nothing more is kept, the stream goes on elsewhere."""

    def __init__(self, epoch: int, stored: list[bytes], fences: list[tuple[int, int]]):
        self.events = stored
        self.size = sum(map(len, stored))
        self.end = False
        self.lost = False
        self.handing_over = False
        self.epoch = epoch
        self.fences = fences  # the takeovers before this producer (format.never_stored)
        self._seam = len(stored)  # the positions stored by earlier producers

    def id(self, at: int) -> int:
        """The id of the event at position ``at`` (0: none)."""
        if at > self._seam:
            return epoch_id(self.epoch, at)
        return sse.event_id(self.events[at - 1]) or 0 if at else 0

    def add(self, event: bytes) -> None:
        self.events.append(event)
        self.size += len(event)


@dataclass(frozen=True)
class _Attempt:
    """One append: the events it carries, its bytes, whether it ends the log or hands it over."""

    count: int
    block: bytes
    end: bool
    handover: bool
    acks: tuple[str, ...]


class _Fenced(Exception):
    """The blob holds someone else's bytes at this producer's position: the stream was taken over."""


class Writer:
    """Stores the events ``kept`` of one stream (module docstring). ``kick`` wakes it; ``done`` is set
    once it has finished (stored, given up, or moved); ``resumable`` turns False when it gives up.
    It tells its producer when more is stored (``stored_more``) and when the stream goes on
    elsewhere (``moved``)."""

    def __init__(
        self,
        ctx: Context,
        record: Record,
        kept: Kept,
        *,
        started: float,
        stored_bytes: int,
        large_request: str | None,
        continuing: bool,
        stored_more: Callable[[], None],
        moved: Callable[[Moved], None],
    ):
        self._ctx = ctx
        self._cfg = ctx.config
        self._loop = asyncio.get_running_loop()
        self.record = record
        self._kept = kept
        self._id = record.stream_id
        self._tag = log_tag(record.stream_id)
        self._started = started
        self._stored_more = stored_more
        self._moved = moved
        self._large_request = large_request
        self._create_first = not continuing
        self._blob = continuing  # the blob exists (a continuation's: the takeover's fence made it)
        self._inline_tried = False
        self._end_seen_at: float | None = None  # an ending writer waits for an inbox read begun after this
        self._inbox_read = asyncio.Event()
        self.resumable = True
        self.handed_over = False
        self.done = asyncio.Event()
        self.kick = asyncio.Event()
        self.stored = len(kept.events)  # events in the blob
        self.stored_bytes = stored_bytes  # the blob's length
        self._stored_size = kept.size  # the bytes of the events in it (markers aside)
        self._blocks = 0
        self._uncertain: list[_Attempt] = []  # appends not answered since the last confirmed one
        self._acks: list[str] = []
        self._repoint_to: str | None = None
        self._flush_now = False
        self._fast = False
        self._following = False
        self._fast_until = self._loop.time() + self._cfg.read_fresh_seconds if continuing else 0.0
        self._idle = False
        self._last_write = started if not continuing else 0.0  # the first checkpoint is one interval in
        self.end_written = False
        self._readers_here = 0

    # -- what the producer asks -----------------------------------------------------------------

    def follow(self, following: bool) -> None:
        """Whether a reader elsewhere follows the stream (fast writes while one does)."""
        self._following = following
        self._update_fast()

    def follow_here(self, readers: int) -> None:
        """How many readers here follow the stream (fast writes while one does)."""
        self._readers_here = readers
        self._update_fast()

    def hurry(self) -> None:
        """Store what is in hand now, then write fast for a while."""
        self._flush_now = True
        self._fast_until = self._loop.time() + self._cfg.read_fresh_seconds
        self._update_fast()
        self.kick.set()

    def _update_fast(self) -> None:
        following = self._following or self._readers_here > 0
        fast = (following or self._loop.time() < self._fast_until) and not self.done.is_set()
        if fast != self._fast:
            self._ctx.fast_writers += 1 if fast else -1
            self._fast = fast
            if fast:
                self.kick.set()

    def ack(self, nonce: str) -> None:
        self._acks.append(nonce)
        self.kick.set()

    def repoint(self, instance: str) -> None:
        self._repoint_to = instance
        self.kick.set()

    def ticked(self, began: float) -> None:
        """The inbox was read (from ``began`` on) and what it held delivered."""
        if self._end_seen_at is not None and began >= self._end_seen_at:
            self._inbox_read.set()

    def nudge(self) -> None:
        """After an append: an idle writer starts its checkpoint wait now; a fast one, or one with
        ``flush_bytes`` waiting, writes."""
        if self._idle or self._fast or self._unstored() >= self._cfg.flush_bytes:
            self.kick.set()

    def _unstored(self) -> int:
        return self._kept.size - self._stored_size

    def _interval(self) -> float:
        cfg = self._cfg
        self._update_fast()
        if not self._fast:
            return cfg.checkpoint_seconds
        return max(cfg.fast_flush_seconds, self._ctx.fast_writers / cfg.write_rate)

    # -- the task -------------------------------------------------------------------------------

    async def run(self) -> None:
        instances = self._ctx.instances
        instances.need()
        try:
            try:
                if not self._create_first or await self._create():
                    await self._write_all()
            except Exception:  # a bug of ours must not take the live stream with it
                log.exception("stream %s: storing failed", self._tag)
                self.give_up("internal error")
        finally:
            self.done.set()
            self._update_fast()
            self._stored_more()
            instances.done()

    def give_up(self, why: str) -> None:
        if not self.resumable:
            return
        self.resumable = False
        self._stored_more()
        log.warning("stream %s is not resumable: %s", self._tag, why)
        self._ctx.spawn(self._store_lost())

    async def _create(self) -> bool:
        """The record (after this instance's first beat: nobody must see a stream before its
        producer's lease), the large request's own blob before it. The log's blob waits for the
        first write (a takeover makes it when the stream's producer died before)."""
        ctx, store = self._ctx, self._ctx.store
        deadline = self._loop.time() + self._cfg.give_up_seconds
        await ctx.instances.first_beat()
        # By the store's clock as the beat heard it (before any answer, this machine's own was used).
        elapsed = self._loop.time() - self._started
        self.record.created = ctx.now() - elapsed
        self.record.expires = self.record.created + self._cfg.max_stream_seconds + self._cfg.ttl_seconds
        self.record.instance = ctx.instances.id
        row = self.record.row()

        async def put_request() -> None:
            if self._large_request is not None:
                with contextlib.suppress(Modified):  # Modified: an earlier attempt landed
                    await store.put(request_blob(self._id), self._large_request.encode(), etag=NEW)

        async def insert() -> None:
            try:
                self.record.etag = await store.insert(STREAMS_TABLE, row)
            except AlreadyExists:  # an earlier attempt landed, its answer lost: its ETag is the row's
                found = await store.get(STREAMS_TABLE, self._id, RECORD_ROW, select=("instance", "epoch"))
                if found is None or found.get("instance") != row["instance"] or found.get("epoch") != 1:
                    raise _Fenced() from None
                self.record.etag = found.etag

        for step in (put_request, insert):
            while True:
                try:
                    # The insert is the request's own (it makes the stream resumable, and a reader
                    # elsewhere waits for it): it does not queue behind other streams' writes.
                    async with ctx.bulk if step is put_request else contextlib.nullcontext():
                        await step()
                    break
                except _Fenced:
                    self.give_up("its record is someone else's")
                    return False
                except StoreError as exc:
                    if self._loop.time() > deadline:
                        self.give_up(f"the store is unavailable ({exc})")
                        return False
                    await asyncio.sleep(0.25)
        self._large_request = None
        return True

    async def _write_all(self) -> None:
        p = self._kept
        failing_since: float | None = None
        while True:
            self.kick.clear()
            if self._repoint_to is not None:
                await self._repoint()
            ending = p.end and not self.end_written
            pending = len(p.events) > self.stored or ending or bool(self._acks) or p.handing_over
            if not pending and p.end:
                break
            if p.end and not self._blob and not self._inline_tried:
                if await self._end_inline():
                    return
                continue
            if self._blocks >= BLOCKS_LIMIT - 2:
                self.give_up("the stream has too many blocks")
                return
            now = self._loop.time()
            due = self._last_write + self._interval()
            urgent = (
                p.end
                or self._flush_now
                or p.handing_over
                or bool(self._acks)
                or self._unstored() >= self._cfg.flush_bytes
            )
            if pending and (urgent or now >= due):
                self._flush_now = False
                self._last_write = now
                try:
                    await self._write_block()
                    failing_since = None
                except _Fenced:
                    self._moved("taken_over")
                    return
                except StoreError as exc:
                    failing_since = failing_since or now
                    if now - failing_since > self._cfg.give_up_seconds or not isinstance(exc, StoreUnavailable):
                        self.give_up(str(exc))
                        return
                    await asyncio.sleep(min(0.5, max(self._cfg.fast_flush_seconds, now - failing_since)))
                if self.handed_over:
                    self._moved("handed_over")
                    return
                continue
            self._idle = not pending
            try:
                async with asyncio.timeout(max(0.0, due - now) if pending else None):
                    await self.kick.wait()
            except TimeoutError:
                pass
            finally:
                self._idle = False
        await self._store_end()

    def _compose(self) -> _Attempt:
        p = self._kept
        first = self.stored
        limit = min(BLOCK_LIMIT - 4096, self._cfg.max_stream_bytes + 64)
        count, size = 0, 0
        for event in p.events[first:]:
            if count and size + len(event) > limit:
                break
            count += 1
            size += len(event)
        parts = p.events[first : first + count]
        whole = first + count == len(p.events)
        acks = tuple(self._acks) if whole else ()
        parts.extend(ack_marker(nonce, p.id(first + count)) for nonce in acks)
        end = p.end and whole
        handover = p.handing_over and whole and not end
        if end:
            parts.append(sse.comment(LOST if p.lost else END))
        elif handover:
            parts.append(sse.comment(HANDOVER))
        return _Attempt(count, b"".join(parts), end, handover, acks)

    async def _write_block(self) -> None:
        store = self._ctx.store
        attempt = self._compose()
        offset = self.stored_bytes
        # A reader elsewhere waits for it: ahead of the other streams' writes (ResumeConfig.bulk_calls).
        turn = self._ctx.bulk.first() if self._following or attempt.acks else self._ctx.bulk
        try:
            async with turn:
                try:
                    await store.append(self._id, attempt.block, at=offset)
                except NotFound:
                    # Not made yet (a reader elsewhere makes it as it registers, so the write it
                    # waits for is one call): make it, then append.
                    if self._blob:
                        raise
                    with contextlib.suppress(AlreadyExists):  # an earlier attempt landed, or a takeover's fence
                        await store.append_create(self._id)
                    self._blob = True
                    await store.append(self._id, attempt.block, at=offset)
            self._blob = True
        except StoreUnavailable:
            # No answer: it may still land. Every attempt since the last confirmed one is at this
            # same offset, so the store takes at most one of them; the next one's answer says which.
            self._uncertain.append(attempt)
            raise
        except Modified:
            found = await store.read(self._id, offset)
            landed = next((a for a in (attempt, *self._uncertain) if found.startswith(a.block)), None)
            if landed is None:
                raise _Fenced() from None
            if len(found) > len(landed.block):
                self._confirm(landed, offset)
                raise _Fenced() from None
            attempt = landed
        self._confirm(attempt, offset)

    def _confirm(self, attempt: _Attempt, offset: int) -> None:
        self._uncertain.clear()
        self._stored_size += sum(map(len, self._kept.events[self.stored : self.stored + attempt.count]))
        self.stored += attempt.count
        self.stored_bytes = offset + len(attempt.block)
        self._blocks += 1
        self._acks = [a for a in self._acks if a not in attempt.acks]
        self.end_written = self.end_written or attempt.end
        self.handed_over = self.handed_over or attempt.handover
        self._stored_more()

    async def _repoint(self) -> None:
        instance, self._repoint_to = self._repoint_to, None
        assert instance is not None
        fields = {"PartitionKey": self._id, "RowKey": RECORD_ROW, "instance": instance}
        try:
            self.record.etag = await self._ctx.store.merge(STREAMS_TABLE, fields, etag=self.record.etag)
            self.record.instance = instance
        except (Modified, NotFound):
            pass  # taken over meanwhile: the next append finds the fence
        except StoreError:
            self._repoint_to = self._repoint_to or instance  # again at the next turn

    def _end_fields(self) -> dict:
        p, now = self._kept, self._ctx.now()
        state = "lost" if p.lost else "ended"
        last = p.id(len(p.events))
        return record_over(
            self._id, state, now + self._cfg.ttl_seconds, finished=now, last_id=last, size=self.stored_bytes
        )

    async def _end_inline(self) -> bool:
        """The stream ended before its first write: unless a reader elsewhere follows it (the inbox
        is read once more after the end to tell), its whole log goes into the record with the
        record's end, and no blob is made. False: write the blob as usual."""
        p, cfg = self._kept, self._cfg
        self._inline_tried = True
        if self._following or self._acks or p.handing_over:
            return False
        # A reader registered before the end is seen by an inbox read begun after it (its rows are
        # delivered before the producers tick); one that came later reads this record first.
        self._end_seen_at = self._loop.time()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(cfg.inbox_seconds + 1.0):
                await self._inbox_read.wait()
        if self._following or self._acks or p.handing_over or self.stored:
            return False
        block = b"".join(p.events) + sse.comment(LOST if p.lost else END)
        try:
            text = block.decode()
        except UnicodeDecodeError:
            return False
        if len(text) > INLINE_EVENTS or text_units(text) > INLINE_EVENTS:
            return False
        merged = await self._merge_end({**self._end_fields(), "events": text, "size": len(block)})
        if merged is None:
            self.give_up("the store is unavailable")
            return True
        if not merged:
            self._moved("taken_over")  # the record is another producer's: nothing of this one is stored
            return True
        self.stored = len(p.events)
        self.stored_bytes = len(block)
        self._stored_size = p.size
        self.end_written = True
        self._stored_more()
        return True

    async def _store_end(self) -> None:
        """The record says the stream is over (and expires a TTL from now). When it fails the end is
        still in the blob (and the record is deleted at its first expiry)."""
        if await self._merge_end(self._end_fields()) is None:
            log.warning("stream %s: its end could not be recorded; it is deleted later", self._tag)

    async def _merge_end(self, fields: dict) -> bool | None:
        """Merge the record's end, on its ETag (only this epoch's producer may), for up to
        ``give_up_seconds``. True: merged; False: the record is someone else's (taken over); None:
        the store failed throughout."""
        deadline = self._loop.time() + self._cfg.give_up_seconds
        unanswered = False
        while True:
            try:
                async with self._ctx.bulk:
                    self.record.etag = await self._ctx.store.merge(STREAMS_TABLE, fields, etag=self.record.etag)
                return True
            except (Modified, NotFound):
                return unanswered  # True: an earlier attempt landed (its answer lost) and changed the ETag
            except StoreError as exc:
                unanswered = unanswered or isinstance(exc, StoreUnavailable)
                if self._loop.time() > deadline:
                    return None
                await asyncio.sleep(0.5)

    async def _store_lost(self) -> None:
        """Given up: as soon as the store lets it (within the stream's cap), end the stored log with a
        ``stream_lost`` error at the stored position (in the record when there is no blob yet), and
        record it lost: readers elsewhere end there instead of waiting."""
        ctx = self._ctx
        deadline = self._loop.time() + self._cfg.max_stream_seconds
        pause = 0.5
        appended = False
        while self._loop.time() < deadline and not ctx.closed:
            number = self._kept.id(self.stored + 1)
            message = "the stream stopped being stored"
            block = error_event(ctx.encode_error, self.record.route, "stream_lost", message, number) + sse.comment(LOST)
            try:
                if self._blob and not appended:
                    try:
                        await ctx.store.append(self._id, block, at=self.stored_bytes)
                    except Modified:
                        # One of the writes whose answer was lost landed after all: from after it.
                        found = await ctx.store.read(self._id, self.stored_bytes)
                        landed = next((a for a in self._uncertain if found == a.block), None)
                        if landed is None:
                            return  # someone else's bytes there: taken over
                        self._confirm(landed, self.stored_bytes)
                        continue
                    appended = True
                inline = {} if self._blob else {"events": block.decode()}
                fields = record_over(self._id, "lost", ctx.now() + self._cfg.ttl_seconds, **inline)
                await ctx.store.merge(STREAMS_TABLE, fields, etag=self.record.etag)
                return
            except (Modified, NotFound):
                return  # the record is someone else's now, or gone
            except StoreError:
                await asyncio.sleep(pause)
                pause = min(5.0, pause * 2)
