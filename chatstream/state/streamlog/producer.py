"""The producer side of a resumable stream (``Producer``): numbers the events as the route appends
them and keeps them in memory, without I/O; its ``StreamWriter`` stores them in the background.
Also where a stop is requested: a cancel (from any instance), nobody reading for
``abandon_seconds``, or the time cap."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from .format import BLOCK_LIMIT, is_comment
from .ids import Route, StopReason, log_tag
from .kept import KeptEvents
from .writer import StreamWriter, WriterHost

log = logging.getLogger("chatstream")


class ProducerHost(WriterHost, Protocol):
    """The stream log of a producer: it forgets the producer once its stream is over."""

    def _release(self, producer: Producer) -> None: ...


class Producer:
    """One stream being produced on this instance. Made by ``StreamLog.start``; see its docstring
    for the contract. ``stop_requested`` is set when the stream is cancelled (on any instance) or
    abandoned; ``stop_reason`` says which."""

    def __init__(self, streams: ProducerHost, stream_id: str, route: Route, owner: str | None):
        self.id = stream_id
        self.route: Route = route
        self.owner = owner
        self.stop_requested = asyncio.Event()
        self.stop_reason: StopReason | None = None
        self._tag = log_tag(stream_id)
        self._log = streams
        self._cfg = streams.config
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._last_id = 0  # ids handed out (to the live caller)
        self._kept = KeptEvents(self._loop)
        self._writer = StreamWriter(streams, self._kept, stream_id, route, owner, self._tag, self._started)
        self._final_by_caller = False
        self._finished = False
        self._attached = 1  # the original caller, then readers here
        self._caller_here = True
        self._alone_since = 0.0
        self._remote_read_at = 0.0  # the last sign of a reader elsewhere (abandonment)
        self._remote_follow_at = 0.0  # the last sign of a reader elsewhere still following (fast writes)

    # -- the producer's side ------------------------------------------------------------------

    @property
    def last_id(self) -> int:
        return self._last_id

    @property
    def resumable(self) -> bool:
        """False once storing failed for good (the live stream goes on; readers elsewhere get stream_lost)."""
        return self._writer.resumable

    def append(self, data: bytes, *, final: bool = False) -> bytes:
        """Number ``data`` (one or more complete SSE events, LF line ends, each ending with a blank
        line) and keep it for the readers; return it with an ``id: N`` line first in each event:
        the bytes to send to the live caller. Comment-only events (``: keep-alive``) pass through
        unnumbered and unkept. ``final``: ``data`` holds the stream's final event(s). No I/O."""
        if not data.endswith(b"\n\n") or b"\r" in data:
            raise ValueError("append takes whole SSE events with LF line ends")
        if self._final_by_caller:
            raise RuntimeError("append after the final event")
        end = len(data) - 2
        if end <= 0:
            return data
        if data.find(b"\n\n") == end:  # one event: the common case
            if data[0] == 58 and is_comment(data[:end]):  # ':'
                out = data
            else:
                self._last_id += 1
                out = b"id: %d\n%s" % (self._last_id, data)
                self._keep(out)
        else:
            pieces = []
            for part in data[:end].split(b"\n\n"):
                if not part:
                    continue
                if part[0] == 58 and is_comment(part):
                    pieces.append(part + b"\n\n")
                    continue
                self._last_id += 1
                event = b"id: %d\n%s\n\n" % (self._last_id, part)
                pieces.append(event)
                self._keep(event)
            out = b"".join(pieces)
        if final and not self._kept.end:
            self._final_by_caller = True
            self._kept.end = True
            self._writer.kick.set()
        elif final:
            self._final_by_caller = True
        if self._kept.waiters:
            self._kept.wake()
        self._writer.nudge()
        return out

    def caller_gone(self) -> None:
        """The original caller hung up: keep producing (the generation goes on and is stored), and
        call ``finish`` as usual. Starts the abandonment clock once no reader is left."""
        if self._caller_here:
            self._caller_here = False
            self._detach()
        self._writer.flush_now = True  # a resume is likely: store what is in hand now
        self._writer.kick.set()

    def finish(self) -> None:
        """The stream is over (call it in ``finally``, once). If no final event was appended, the
        stored stream ends with a ``stream_lost`` error. Returns at once; the last write goes on in
        the background (``wait_stored``)."""
        if self._finished:
            return
        self._finished = True
        if not self._kept.end:
            self._end_with_error("the stream ended without its final event")
        self._writer.kick.set()

    async def wait_stored(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109 - the documented interface (docs/resumable.md)
        """Wait until the background writer is done; True if the whole stream is stored."""
        try:
            async with asyncio.timeout(timeout):
                await self._writer.done.wait()
        except TimeoutError:
            return False
        return self._writer.resumable and self._writer.stored == len(self._kept.events) and self._kept.end

    # -- in-memory log ------------------------------------------------------------------------

    def _keep(self, event: bytes) -> None:
        kept = self._kept
        if kept.end:
            return  # after the kept end (over the size limit, or forced end): the live caller only
        if kept.size + len(event) > self._cfg.max_stream_bytes or len(event) > BLOCK_LIMIT - 64:
            log.warning(
                "stream %s is over %d bytes: it is not resumable past event %d",
                self._tag,
                self._cfg.max_stream_bytes,
                self._last_id - 1,
            )
            self._end_with_error("the stream is too long to be resumed")  # in this event's place
            return
        kept.events.append(event)
        kept.size += len(event)

    def _end_with_error(self, message: str) -> None:
        kept = self._kept
        number = len(kept.events) + 1
        body = self._log.encode_error(self.route, "stream_lost", message, True, number)
        event = b"id: %d\n%s" % (number, body)
        kept.events.append(event)
        kept.size += len(event)
        self._last_id = max(self._last_id, number)
        kept.end = True
        kept.lost = True
        kept.wake()
        self._writer.kick.set()

    def _attach(self) -> None:
        self._attached += 1

    def _detach(self) -> None:
        self._attached -= 1
        if self._attached <= 0:
            self._attached = 0
            self._alone_since = self._loop.time()

    def _request_stop(self, reason: StopReason) -> None:
        if self.stop_reason is None and not self._final_by_caller:
            self.stop_reason = reason
            self.stop_requested.set()
            log.info("stream %s: stop requested (%s)", self._tag, reason)

    def _tick(self, now: float, now_wall: float) -> None:
        """Every inbox tick: fast writes while a remote reader follows; abandonment; the time cap."""
        fast = now_wall - self._remote_follow_at < self._cfg.read_fresh_seconds
        if fast and not self._writer.fast:
            self._writer.kick.set()
        self._writer.fast = fast
        if self._kept.end:
            return
        if now - self._started > self._cfg.max_stream_seconds:
            log.warning(
                "stream %s ran past %.0f s without finishing: ended here", self._tag, self._cfg.max_stream_seconds
            )
            self._request_stop("timeout")
            self._end_with_error("the stream ran past its time limit")
            return
        if (
            self._attached == 0
            and now - self._alone_since >= self._cfg.abandon_seconds
            and now_wall - self._remote_read_at >= self._cfg.abandon_seconds
        ):
            self._request_stop("abandoned")

    # -- storing (its StreamWriter) -----------------------------------------------------------

    @property
    def _done(self) -> asyncio.Event:
        """Set once the background writer has finished (stored or given up)."""
        return self._writer.done

    async def _run(self) -> None:
        try:
            await self._writer.run()
        finally:
            self._log._release(self)

    def _give_up(self, why: str) -> None:
        self._writer.give_up(why)
