"""The producing side of a resumable stream (``Producer``): it numbers the events as the route appends
them and keeps them in memory (``Kept``; no I/O), and its ``Writer`` (writer.py) stores them in the
background. Readers here are served what is stored, from memory; only the live caller is ahead of
the log, so that no reader holds an id the log never had if this instance dies (format.EPOCH_IDS).

Also where a stop is requested: a cancel (from any instance, via the inbox), nobody reading for
``abandon_seconds``, the time cap, or the stream going on elsewhere (``moved``: taken over, or
handed over by ``hand_over`` when this instance drains)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from ... import sse
from .config import Context
from .format import BLOCK_LIMIT, EPOCH_IDS, Record, epoch_id, error_event, log_tag, never_stored, position
from .writer import Kept, Writer

log = logging.getLogger("chatstream")

StopReason = Literal["cancelled", "abandoned", "timeout", "taken_over", "handed_over"]  # (writer.Moved among them)
# The stream goes on elsewhere: the relay stops, and its live caller resumes with Last-Event-ID.
MOVED: tuple[StopReason, ...] = ("taken_over", "handed_over")


class Producer:
    """One stream produced on this instance. Made by ``StreamLog.start`` (a new stream) or by a claim
    (a stream taken over: its stored events are kept here, and ids go on after them); see
    ``StreamLog`` for the request path's contract. ``stop_requested`` is set when the stream is
    cancelled (on any instance), abandoned, past its time cap, or moved elsewhere; ``stop_reason``
    says which. ``moved`` is set once the stream goes on elsewhere (taken over, handed over)."""

    def __init__(
        self,
        ctx: Context,
        record: Record,
        release: Callable[[Producer], None],
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
        self.stop_requested = asyncio.Event()
        self.stop_reason: StopReason | None = None
        self.moved = asyncio.Event()
        self._kept = Kept(record.epoch, list(stored or ()), list(fences or ()))
        self._ctx = ctx
        self._cfg = ctx.config
        self._tag = log_tag(self.id)
        self._release = release
        self._loop = asyncio.get_running_loop()
        # Started by the store's clock: a continuation's cap counts from the stream's own start.
        self._started = self._loop.time() - max(0.0, ctx.now() - record.created)
        self._born = self._loop.time()
        self._handed = len(self._kept.events)  # positions handed out (to the live caller)
        self._waiters: list[asyncio.Future] = []
        self._final_by_caller = False
        self._finished = False
        self._caller_here = not continuing  # the original caller (a continuation has none)
        self._attached = int(self._caller_here)  # ...and the readers here
        self._alone_since = self._loop.time()
        self._remote_read_at = 0.0  # the store's time a reader elsewhere was last seen (abandonment)
        self._remote_follow_at = 0.0  # ...and last seen still following (fast writes)
        self._acked: set[str] = set()
        # A continuation whose asking reader's client holds events its log never had (that reader
        # ended with stream_lost): the position it reached, which the continuation is run to even
        # with nobody reading, since its events up to there are what that client is charged
        # (Claim.stand_ins); 0: none.
        self.unstored = position(received) if position(received) > len(self._kept.events) else 0
        self._writer = Writer(
            ctx,
            record,
            self._kept,
            started=self._started,
            stored_bytes=stored_bytes,
            large_request=large_request,
            continuing=continuing,
            stored_more=self._wake,
            moved=self._moved,
        )

    # -- the request path's side --------------------------------------------------------------

    @property
    def last_id(self) -> int:
        """The id of the last event handed out."""
        return self._kept.id(self._handed)

    def never_stored(self, after: int) -> bool:
        """Whether ``after`` is an id an earlier producer of this stream handed out and never stored."""
        return never_stored(after, self._kept.fences)

    @property
    def resumable(self) -> bool:
        """False once storing failed for good (the live stream goes on; readers elsewhere get stream_lost)."""
        return self._writer.resumable

    def append(self, data: bytes, *, final: bool = False) -> bytes:
        """Number ``data`` (one or more complete SSE events, LF line ends, each ending with a blank
        line) and keep it for the readers; return it with an ``id: N`` line first in each event:
        the bytes to send to the live caller. Comment-only events (``: keep-alive``) pass through
        unnumbered and unkept. ``final``: ``data`` holds the stream's final event(s). No I/O."""
        if not data.endswith(sse.END_OF_EVENT) or b"\r" in data:
            raise ValueError("append takes whole SSE events with LF line ends")
        if self._final_by_caller:
            raise RuntimeError("append after the final event")
        kept = self._kept
        if kept.handing_over or self.moved.is_set():
            # The stream goes on elsewhere from its stored end: the live caller gets nothing past it
            # (its resume there would hold ids never stored), and the final event tells it to resume.
            self._final_by_caller = final
            return self.moved_event() if final else b""
        end = len(data) - 2
        if end <= 0:
            return data
        if data.find(sse.END_OF_EVENT) == end:  # one event: the common case
            parts = [data]
        else:
            parts = [part + sse.END_OF_EVENT for part in sse.split(data)[0] if part]
        out = []
        for part in parts:
            if sse.is_comment(part[:-2]):  # (a keep-alive)
                out.append(part)
                continue
            self._handed += 1
            event = sse.numbered(epoch_id(kept.epoch, self._handed), part)
            out.append(event)
            self._keep(event)
        if final:
            self._final_by_caller = True
            if not kept.end:
                kept.end = True
                self._writer.kick.set()
        if self._waiters:
            self._wake()
        self._writer.nudge()
        return out[0] if len(out) == 1 else b"".join(out)

    def caller_gone(self) -> None:
        """The original caller hung up: keep producing (the generation goes on and is stored), and
        call ``finish`` as usual. Starts the abandonment clock once no reader is left; stores what is
        in hand now and writes fast for a while (a resume elsewhere is likely)."""
        if self._caller_here:
            self._caller_here = False
            self.detach()
        if not self._kept.end:  # (read to its end: nothing more comes, and the end is written at once)
            self._writer.hurry()

    def finish(self) -> None:
        """The stream is over (call it in ``finally``, once). If no final event was appended, the
        stored stream ends with a ``stream_lost`` error. Returns at once; the last write goes on in
        the background (``wait_stored``)."""
        if self._finished:
            return
        self._finished = True
        if not self._kept.end and not self._kept.handing_over:
            self._end_with_error("the stream ended without its final event")
        self._writer.kick.set()

    async def wait_stored(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - the documented interface
        """Wait until the background writer is done; True if the whole stream is stored."""
        done = await _within(timeout, self._writer.done.wait())
        return done and self._writer.resumable and self._writer.stored == len(self._kept.events) and self._kept.end

    async def hand_over(self, timeout: float) -> bool:  # noqa: ASYNC109 - the documented interface
        """Store what is kept with a ``: handover`` marker, then store nothing more: a reader on
        another instance takes the stream over at once (no lease to wait for). The live caller gets
        nothing more (``append``). True once the marker is stored."""
        if self._kept.end or not self._writer.resumable or self._writer.done.is_set():
            return False
        self._kept.handing_over = True
        self._writer.kick.set()
        return await _within(timeout, self._writer.done.wait()) and self._writer.handed_over

    def moved_event(self) -> bytes:
        """What ends the live caller's answer once the stream goes on elsewhere: a retryable
        ``stream_moved`` error without an id (it is not an event of the stream), so its client
        resumes after the last id it got, as after a cut."""
        return self._ctx.encode_error(self.route, "stream_moved", "the stream goes on on another instance: resume it")

    # -- what readers here use ------------------------------------------------------------------

    def _readable(self) -> int:
        """What readers here may have (module docstring): what is stored; once storing failed for
        good nobody else can go on with the stream, so what is kept."""
        return self._writer.stored if self._writer.resumable else len(self._kept.events)

    def events_after(self, cursor: int, *, unstored: bool = False) -> bytes:
        """The readable events after id ``cursor`` (b"" when there are none yet); ``unstored``: all
        it kept, stored or not (what it generated: ``Claim.stand_ins``)."""
        at, end = position(cursor), len(self._kept.events) if unstored else self._readable()
        return b"".join(self._kept.events[at:end]) if at < end else b""

    @property
    def kept(self) -> int:
        """The id of the last readable event (0: none)."""
        return self._kept.id(self._readable())

    @property
    def stored_end(self) -> bool:
        """The final event is readable (the last of ``events_after``)."""
        return self._writer.end_written or (self._kept.end and not self._writer.resumable)

    @property
    def ended(self) -> bool:
        """The final event is kept."""
        return self._kept.end

    @property
    def ended_lost(self) -> bool:
        """The final event kept is our ``stream_lost`` error."""
        return self._kept.lost

    async def changed(self) -> None:
        """Wait for the next change: an event kept, the end, a move."""
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        await waiter

    def attach(self) -> None:
        self._attached += 1
        self._writer.follow_here(self._attached - self._caller_here)

    def detach(self) -> None:
        self._attached -= 1
        if self._attached <= 0:
            self._attached = 0
            self._alone_since = self._loop.time()
        self._writer.follow_here(self._attached - self._caller_here)

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
            self._writer.follow(True)
        if ack is not None and ack not in self._acked:
            self._acked.add(ack)
            self._writer.ack(ack)

    def repoint(self, instance: str) -> None:
        """This instance goes on under a new id (it was declared dead while only slow): say so in
        the record, unless the stream was taken over meanwhile."""
        self._writer.repoint(instance)

    def young(self) -> bool:
        return self._loop.time() - self._born < self._cfg.young_seconds

    def tick(self, now: float, now_store: float) -> None:
        """Every inbox tick (``now``: when its read began): fast writes while a reader elsewhere
        follows; abandonment; the time cap."""
        cfg = self._cfg
        self._writer.ticked(now)
        self._writer.follow(now_store - self._remote_follow_at < cfg.read_fresh_seconds)
        if self._kept.end or self.moved.is_set():
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
        its asking reader's client had (``unstored``), nobody here reads it (the caller checks), no
        reader elsewhere was seen lately, and it is past its young seconds (readers elsewhere find
        a takeover's new instance within about one of their polls and state checks)."""
        return (
            0 < self.unstored <= self._readable()
            and now_store - self._remote_read_at >= self._cfg.read_fresh_seconds
            and not self.young()
        )

    # -- the log's side -------------------------------------------------------------------------

    @property
    def storing(self) -> bool:
        """Its writer still runs (stored or given up, it is done)."""
        return not self._writer.done.is_set()

    async def run(self) -> None:
        """Store the stream; then stay known to the log until its end (readers here, cancels and
        abandonment still need it when it is not stored any more)."""
        try:
            await self._writer.run()
            while not self._kept.end and not self.moved.is_set():
                await self.changed()
        finally:
            self._release(self)

    # -- in memory ------------------------------------------------------------------------------

    def _keep(self, event: bytes) -> None:
        kept = self._kept
        if kept.end:
            return  # the live caller only: past the kept end
        too_long = kept.size + len(event) > self._cfg.max_stream_bytes or len(kept.events) >= EPOCH_IDS - 2
        if too_long or len(event) > BLOCK_LIMIT - 64:
            log.warning(
                "stream %s is over %d bytes: it is not resumable past event %d",
                self._tag,
                self._cfg.max_stream_bytes,
                self.kept,
            )
            self._end_with_error("the stream is too long to be resumed")  # in this event's place
            return
        kept.add(event)

    def _end_with_error(self, message: str) -> None:
        kept = self._kept
        at = len(kept.events) + 1
        kept.add(error_event(self._ctx.encode_error, self.route, "stream_lost", message, kept.id(at)))
        self._handed = max(self._handed, at)
        kept.end = kept.lost = True
        self._wake()
        self._writer.kick.set()

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


async def _within(timeout: float | None, done: Awaitable[object]) -> bool:  # noqa: ASYNC109
    """Whether ``done`` came within ``timeout`` seconds (None: no limit)."""
    try:
        async with asyncio.timeout(timeout):
            await done
    except TimeoutError:
        return False
    return True
