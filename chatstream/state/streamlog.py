"""Resumable streams, the storage layer (issue #21): a stream's SSE events numbered, kept in the
shared store, replayed to any instance, followed live, cancelled from any instance, and deleted
after their TTL. The request path (routes, the relay) is not here: it drives this module through
``StreamLog.start`` (the producer side) and ``open_reader`` / ``cancel`` (the resume and cancel
routes). docs/resumable.md has the design, the costs and the guarantees.

What is stored (``chatstreamStreams`` table, ``chatstream-streams`` container):

- the event log: the append blob ``{id}``, whose content *is* the SSE stream with its ``id:``
  lines, written in whole events (a block never ends mid-event), ended by the comment ``: end``
  (the last event is the route's final one) or ``: lost`` (the last event is an error written by
  this module: the stream stopped being stored before its end);
- the stream's entity, PartitionKey = id, RowKey ``stream``: route, owner, producer instance,
  created, state (``live`` / ``ended`` / ``lost``), last id, size, ``expires`` (what the sweeper
  and the readers go by);
- per producing instance (process), partition ``i-{instance}``: the heartbeat row ``alive``
  (lease, beat, and the streams it is storing with their last ids) that tells a slow producer from
  a dead one and a live stream from a lost one, and the inbox of that instance:
  ``c-{id}`` (cancel this stream) and ``r-{id}-{reader}`` (a reader on another instance is
  following this stream, at ``read_at``). The instance reads its inbox with one query every
  ``inbox_seconds``, whatever the number of its streams.

The producer never waits for the store: ``append`` numbers the events and returns at once; one
task per stream writes them in the background, at most every ``fast_flush_seconds`` while a
reader on another instance follows the stream, otherwise every ``checkpoint_seconds`` (and
whenever ``flush_bytes`` are waiting, the final event is in, or the caller has hung up). Readers on
the producer's own instance are served from memory and woken on every append."""
from __future__ import annotations

import asyncio
import logging
import random
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from azure.core import MatchConditions
from azure.core.exceptions import (AzureError, HttpResponseError, ResourceExistsError, ResourceModifiedError,
                                   ResourceNotFoundError)
from azure.data.tables import UpdateMode
from azure.data.tables.aio import TableClient
from azure.storage.blob.aio import ContainerClient

from .store import CALL_TIMEOUT, STREAMS_CONTAINER, STREAMS_TABLE, Store, StoreUnavailable

log = logging.getLogger("chatstream")
T = TypeVar("T")

Route = Literal["chat", "openai"]
ROUTES: tuple[Route, ...] = ("chat", "openai")
StopReason = Literal["cancelled", "abandoned", "timeout"]

# A stream id: 16 random bytes, URL-safe base64 without padding (128 bits).
_ID_BYTES = 16
_ID = re.compile(r"[A-Za-z0-9_-]{22}")
# Last-Event-ID: a decimal event id, at most 15 digits (ids stay exact in a double and in JSON).
_LAST_ID = re.compile(r"[0-9]{1,15}")
_END = b": end"
_LOST = b": lost"
_STREAM_ROW = "stream"
_ALIVE_ROW = "alive"
BLOCK_LIMIT = 4 * 1024 * 1024  # the largest append block
BLOCKS_LIMIT = 50_000  # blocks an append blob may have
_SKEW = 1.0  # seconds of wall-clock difference tolerated between instances for a lease


class EncodeError(Protocol):
    """The integrator's encoder for an error event this module has to write (a stream that lost its
    producer, a store that failed...): one complete SSE event in ``route``'s format, without an
    ``id:`` line (the log adds ``id: next_id``). ``type`` is ``stream_lost`` or ``store_unavailable``."""

    def __call__(self, route: Route, type: str, message: str, retryable: bool, next_id: int) -> bytes: ...


class StreamLogError(Exception):
    """A request this layer refuses; ``status`` is the HTTP status the integrator should answer."""
    status = 400


class StreamNotFound(StreamLogError):
    """Unknown, expired, or started by another caller (the same answer, so nothing leaks)."""
    status = 404


class InvalidStreamId(StreamNotFound):
    """Not an id this module makes (wrong length, path characters...): never looked up."""


class BadLastEventId(StreamLogError):
    """Last-Event-ID is not a non-negative integer of at most 15 digits, or is past the stream's end."""
    status = 400


class TooManyReaders(StreamLogError):
    status = 429


class TooManyStreams(StreamLogError):
    """This instance already produces ``max_producers`` streams: stream this one without resumability."""
    status = 503


@dataclass(frozen=True)
class ResumeConfig:
    abandon_seconds: float = 30.0  # RESUME_ABANDON_SECONDS
    ttl_seconds: float = 600.0  # RESUME_TTL_SECONDS
    # A producer not finished this long after it started is ended here (stream_lost) and asked to
    # stop: set it above the relay's own total limit.
    max_stream_seconds: float = 660.0
    fast_flush_seconds: float = 0.1  # a reader on another instance follows: one write per 100 ms at most
    checkpoint_seconds: float = 5.0  # nobody elsewhere follows: one write per 5 s at most
    flush_bytes: int = 512 * 1024  # ...or as soon as this much waits
    max_stream_bytes: int = 16 * 1024 * 1024  # kept (memory, blob) per stream; beyond it: not resumable
    # A remote reader polls the blob every poll_seconds after new bytes (about the producer's write
    # cadence, so it locks onto it), a third of that after an empty read while bytes flow (so a
    # write that lands just after a poll waits ~33 ms, not 100), then slower to max_poll_seconds.
    poll_seconds: float = 0.1
    max_poll_seconds: float = 0.5
    state_seconds: float = 1.0  # a remote reader checks the producer's lease this often
    inbox_seconds: float = 0.5  # a producing instance reads its inbox (cancels, remote readers) this often
    heartbeat_seconds: float = 1.5
    lease_seconds: float = 4.5  # a producing instance whose heartbeat is older is dead
    give_up_seconds: float = 10.0  # the store failing this long: a producer stops storing, a reader ends
    # Last-Event-ID past what is stored of a live stream elsewhere: wait at most this long for the
    # producer to store it, or for its heartbeat to prove the id was never handed out (two beats).
    past_end_wait_seconds: float = 5.0
    max_readers: int = 256  # readers this instance serves at once
    max_readers_per_stream: int = 16
    max_producers: int = 1000
    max_sweep: int = 1000  # rows one sweep deletes at most
    sweep_every: float | None = None  # seconds between sweeps; None: from the TTL (sweep_seconds)

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> ResumeConfig:
        """From the app's Settings: RESUME_ABANDON_SECONDS, RESUME_TTL_SECONDS, TOTAL_TIMEOUT_SECONDS."""
        return cls(abandon_seconds=settings.resume_abandon_seconds, ttl_seconds=settings.resume_ttl_seconds,
                   max_stream_seconds=settings.total_timeout + 60.0, **overrides)

    @property
    def read_refresh_seconds(self) -> float:
        """How often a remote reader says it is still reading."""
        return max(0.2, min(5.0, self.abandon_seconds / 3))

    @property
    def read_fresh_seconds(self) -> float:
        """A reader's ``read_at`` younger than this means it is following (fast writes)."""
        return 2 * self.read_refresh_seconds + 1.0

    @property
    def sweep_seconds(self) -> float:
        """A quarter of the TTL, within 1 s..5 min: a stream is deleted at most 25% after its TTL."""
        if self.sweep_every is not None:
            return self.sweep_every
        return max(1.0, min(300.0, self.ttl_seconds / 4))


def new_stream_id() -> str:
    return secrets.token_urlsafe(_ID_BYTES)


def check_stream_id(stream_id: str) -> str:
    if not isinstance(stream_id, str) or _ID.fullmatch(stream_id) is None:
        raise InvalidStreamId("no such stream")
    return stream_id


def parse_last_event_id(header: str | None, query: str | None = None) -> int | None:
    """The event id a resume continues after: the ``Last-Event-ID`` header, else the
    ``last_event_id`` query parameter; None (from the start) when neither is given or the header is
    empty (what EventSource sends before any id). BadLastEventId for anything else than 0..10^15-1."""
    value = header if header is not None else query
    if value is None or (header is not None and not header.strip()):
        return None if header is None or query is None else parse_last_event_id(None, query)
    value = value.strip()
    if _LAST_ID.fullmatch(value) is None:
        raise BadLastEventId("Last-Event-ID must be a non-negative integer of at most 15 digits")
    return int(value)


def _is_comment(part: bytes) -> bool:
    return all(line.startswith(b":") for line in part.split(b"\n"))


def _unavailable(exc: BaseException) -> bool:
    """A store failure (vs an answer such as 404/409/412 the caller handles)."""
    status = exc.status_code if isinstance(exc, HttpResponseError) else None
    if status is not None:
        return status >= 500 or status in (401, 403, 408, 429)
    return True


async def _bounded(call: Awaitable[T], timeout: float = CALL_TIMEOUT) -> T:
    """One store call within ``timeout``; store failures become StoreUnavailable."""
    try:
        async with asyncio.timeout(timeout):
            return await call
    except TimeoutError:
        raise StoreUnavailable("the store did not answer in time") from None
    except (AzureError, OSError) as exc:
        if _unavailable(exc):
            status = getattr(exc, "status_code", None)
            raise StoreUnavailable(f"the store failed ({type(exc).__name__}{f', HTTP {status}' if status else ''})") \
                from None
        raise


class _Inconsistent(StoreUnavailable):
    """The blob is not what this producer wrote: stop storing the stream."""


class _Tail:
    """Reads a stored log as it grows: the events after ``cursor``, the end marker, the last id."""

    def __init__(self, after: int):
        self.cursor = after  # the last id handed out (or skipped)
        self.last_id = 0  # the last id stored so far
        self.end: bytes | None = None  # _END or _LOST once read
        self.rest = b""
        self.offset = 0  # bytes of the blob consumed

    def feed(self, data: bytes) -> bytes:
        self.offset += len(data)
        buffer = self.rest + data if self.rest else data
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self.rest = buffer
            return b""
        self.rest = buffer[cut + 2:]
        out = []
        for part in buffer[:cut].split(b"\n\n"):
            if part.startswith(b"id: "):
                newline = part.find(b"\n")
                number = int(part[4:newline] if newline > 0 else part[4:])
                self.last_id = number
                if number > self.cursor:
                    out.append(part)
                    self.cursor = number
            elif part in (_END, _LOST):
                self.end = part
        return b"\n\n".join(out) + b"\n\n" if out else b""


class Producer:
    """One stream being produced on this instance. Made by ``StreamLog.start``; see its docstring
    for the contract. ``stop_requested`` is set when the stream is cancelled (on any instance) or
    abandoned; ``stop_reason`` says which."""

    def __init__(self, streams: StreamLog, stream_id: str, route: Route, owner: str | None):
        self.id = stream_id
        self.route: Route = route
        self.owner = owner
        self.stop_requested = asyncio.Event()
        self.stop_reason: StopReason | None = None
        self._tag = stream_id[:6] + "…"  # for logs: the id itself is the capability when caller keys are off
        self._log = streams
        self._cfg = streams.config
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._created_at = time.time()
        self._last_id = 0  # ids handed out (to the live caller)
        self._events: list[bytes] = []  # kept events; _events[i] has id i + 1
        self._size = 0
        self._stored = 0  # events in the blob
        self._stored_bytes = 0  # the blob's length
        self._blocks = 0
        self._end_kept = False  # the kept log has its final event (the route's or our error)
        self._lost = False  # ...and it is our error (stored as ": lost")
        self._final_by_caller = False
        self._finished = False
        self._resumable = True
        self._waiters: list[asyncio.Future] = []
        self._kick = asyncio.Event()
        self._flush_now = False
        self._fast = False
        self._writer_idle = False  # the writer waits with nothing pending (an append must wake it)
        self._uncertain: list[tuple[int, int, bool]] = []  # unanswered writes: (events, bytes, with end)
        self._last_write = self._started  # the first checkpoint is one interval in
        self._attached = 1  # the original caller, then readers here
        self._caller_here = True
        self._alone_since = 0.0
        self._remote_read_at = 0.0  # the last sign of a reader elsewhere (abandonment)
        self._remote_follow_at = 0.0  # the last sign of a reader elsewhere still following (fast writes)
        self._done = asyncio.Event()  # the background writer has finished (stored or given up)

    # -- the producer's side ------------------------------------------------------------------

    @property
    def last_id(self) -> int:
        return self._last_id

    @property
    def resumable(self) -> bool:
        """False once storing failed for good (the live stream goes on; readers elsewhere get stream_lost)."""
        return self._resumable

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
            if data[0] == 58 and _is_comment(data[:end]):  # ':'
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
                if part[0] == 58 and _is_comment(part):
                    pieces.append(part + b"\n\n")
                    continue
                self._last_id += 1
                event = b"id: %d\n%s\n\n" % (self._last_id, part)
                pieces.append(event)
                self._keep(event)
            out = b"".join(pieces)
        if final and not self._end_kept:
            self._final_by_caller = True
            self._end_kept = True
            self._kick.set()
        elif final:
            self._final_by_caller = True
        if self._waiters:
            self._wake()
        if self._writer_idle or self._fast or self._size - self._stored_bytes >= self._cfg.flush_bytes:
            self._kick.set()  # idle: it starts its checkpoint wait now
        return out

    def caller_gone(self) -> None:
        """The original caller hung up: keep producing (the generation goes on and is stored), and
        call ``finish`` as usual. Starts the abandonment clock once no reader is left."""
        if self._caller_here:
            self._caller_here = False
            self._detach()
        self._flush_now = True  # a resume is likely: store what is in hand now
        self._kick.set()

    def finish(self) -> None:
        """The stream is over (call it in ``finally``, once). If no final event was appended, the
        stored stream ends with a ``stream_lost`` error. Returns at once; the last write goes on in
        the background (``wait_stored``)."""
        if self._finished:
            return
        self._finished = True
        if not self._end_kept:
            self._end_with_error("the stream ended without its final event")
        self._kick.set()

    async def wait_stored(self, timeout: float | None = None) -> bool:
        """Wait until the background writer is done; True if the whole stream is stored."""
        try:
            async with asyncio.timeout(timeout):
                await self._done.wait()
        except TimeoutError:
            return False
        return self._resumable and self._stored == len(self._events) and self._end_kept

    # -- in-memory log ------------------------------------------------------------------------

    def _keep(self, event: bytes) -> None:
        if self._end_kept:
            return  # after the kept end (over the size limit, or forced end): the live caller only
        if self._size + len(event) > self._cfg.max_stream_bytes or len(event) > BLOCK_LIMIT - 64:
            log.warning("stream %s is over %d bytes: it is not resumable past event %d", self._tag,
                        self._cfg.max_stream_bytes, self._last_id - 1)
            self._end_with_error("the stream is too long to be resumed")  # in this event's place
            return
        self._events.append(event)
        self._size += len(event)

    def _end_with_error(self, message: str) -> None:
        number = len(self._events) + 1
        body = self._log.encode_error(self.route, "stream_lost", message, True, number)
        event = b"id: %d\n%s" % (number, body)
        self._events.append(event)
        self._size += len(event)
        self._last_id = max(self._last_id, number)
        self._end_kept = True
        self._lost = True
        self._wake()
        self._kick.set()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _changed(self) -> None:
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        await waiter

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
        if fast and not self._fast:
            self._kick.set()
        self._fast = fast
        if self._end_kept:
            return
        if now - self._started > self._cfg.max_stream_seconds:
            log.warning("stream %s ran past %.0f s without finishing: ended here", self._tag,
                        self._cfg.max_stream_seconds)
            self._request_stop("timeout")
            self._end_with_error("the stream ran past its time limit")
            return
        if (self._attached == 0 and now - self._alone_since >= self._cfg.abandon_seconds
                and now_wall - self._remote_read_at >= self._cfg.abandon_seconds):
            self._request_stop("abandoned")

    # -- the background writer ----------------------------------------------------------------

    async def _run(self) -> None:
        try:
            try:
                if await self._create():
                    await self._write_all()
            except Exception:  # a bug of ours must not take the live stream with it
                log.exception("stream %s: storing failed", self._tag)
                self._give_up("internal error")
            self._done.set()
            # Not stored (given up): readers here, cancel and abandonment still need it until its end.
            while not self._end_kept:
                await self._changed()
        finally:
            self._done.set()
            self._log._release(self)

    async def _create(self) -> bool:
        deadline = self._loop.time() + self._cfg.give_up_seconds
        await self._log._beat_first()
        entity = {"PartitionKey": self.id, "RowKey": _STREAM_ROW, "route": self.route,
                  "instance": self._log.instance, "created": self._created_at, "state": "live",
                  "expires": self._created_at + self._cfg.max_stream_seconds + self._cfg.ttl_seconds}
        if self.owner is not None:
            entity["owner"] = self.owner
        steps: list[Callable[[], Awaitable[Any]]] = [
            lambda: self._log._call_table(lambda t: t.create_entity(entity)),
            # If-None-Match: a create that timed out here and lands late must not empty the blob.
            lambda: self._log._call_blob(lambda c: c.get_blob_client(self.id).create_append_blob(
                match_condition=MatchConditions.IfMissing)),
        ]
        for step in steps:
            while True:
                try:
                    await step()
                    break
                except ResourceExistsError:  # an earlier attempt landed
                    break
                except StoreUnavailable:
                    if self._loop.time() > deadline:
                        self._give_up("the store is unavailable")
                        return False
                    await asyncio.sleep(0.25)
        return True

    async def _write_all(self) -> None:
        failing_since: float | None = None
        while True:
            self._kick.clear()
            pending = len(self._events) > self._stored or (self._end_kept and not self._end_marker_written)
            if not pending and self._end_kept:
                break
            if self._blocks >= BLOCKS_LIMIT - 1:
                self._give_up("the stream has too many blocks")
                return
            now = self._loop.time()
            due = self._last_write + (self._cfg.fast_flush_seconds if self._fast else self._cfg.checkpoint_seconds)
            urgent = self._end_kept or self._flush_now or self._size - self._stored_bytes >= self._cfg.flush_bytes
            if pending and (urgent or now >= due):
                self._flush_now = False
                self._last_write = now
                try:
                    await self._write_block()
                    failing_since = None
                except StoreUnavailable as exc:
                    failing_since = failing_since or now
                    if now - failing_since > self._cfg.give_up_seconds or isinstance(exc, _Inconsistent):
                        self._give_up(str(exc))
                        return
                    await asyncio.sleep(min(0.5, max(self._cfg.fast_flush_seconds, now - failing_since)))
                continue
            self._writer_idle = not pending
            try:
                async with asyncio.timeout(max(0.0, due - now) if pending else None):
                    await self._kick.wait()
            except TimeoutError:
                pass
            finally:
                self._writer_idle = False
        await self._mark_ended()

    _end_marker_written = False

    async def _write_block(self) -> None:
        first = self._stored
        limit = min(BLOCK_LIMIT - 16, self._cfg.max_stream_bytes + 64)
        count, size = 0, 0
        for event in self._events[first:]:
            if count and size + len(event) > limit:
                break
            count += 1
            size += len(event)
        parts = self._events[first:first + count]
        last = self._end_kept and first + count == len(self._events)
        if last:
            parts.append((_LOST if self._lost else _END) + b"\n\n")
        block = b"".join(parts)
        offset = self._stored_bytes
        attempt = (count, len(block), last)
        try:
            await self._log._call_blob(lambda c: c.get_blob_client(self.id).append_block(
                block, appendpos_condition=offset))
        except StoreUnavailable:
            # No answer: it may still have landed. Every attempt since the last confirmed write is
            # at this same offset, so the store took at most one of them; the next one's 412 says which.
            self._uncertain.append(attempt)
            raise
        except HttpResponseError as exc:
            if exc.status_code != 412:
                raise StoreUnavailable(f"append failed (HTTP {exc.status_code})") from None
            size = (await self._log._call_blob(lambda c: c.get_blob_client(self.id).get_blob_properties())).size
            landed = [a for a in (attempt, *self._uncertain) if size == offset + a[1]]
            if not landed:
                raise _Inconsistent("the stored log is not what was written") from None
            attempt = landed[0]
        self._uncertain.clear()
        count, written, last = attempt
        self._stored = first + count
        self._stored_bytes = offset + written
        self._blocks += 1
        if last:
            self._end_marker_written = True

    async def _mark_ended(self) -> None:
        now = time.time()
        fields = {"PartitionKey": self.id, "RowKey": _STREAM_ROW, "state": "lost" if self._lost else "ended",
                  "finished": now, "expires": now + self._cfg.ttl_seconds, "last_id": len(self._events),
                  "size": self._stored_bytes}
        deadline = self._loop.time() + self._cfg.give_up_seconds
        while True:
            try:
                await self._log._call_table(lambda t: t.update_entity(fields, mode=UpdateMode.MERGE))
                return
            except ResourceNotFoundError:
                return
            except StoreUnavailable:
                # The blob has its end marker: readers end right; only the deletion comes later.
                if self._loop.time() > deadline:
                    log.warning("stream %s: its end could not be recorded; it is deleted later", self._tag)
                    return
                await asyncio.sleep(0.5)

    def _give_up(self, why: str) -> None:
        if not self._resumable:
            return
        self._resumable = False
        log.warning("stream %s is not resumable: %s", self._tag, why)
        self._log._spawn(self._log._mark_lost(self.id))


class Reader:
    """A resumed stream: an async iterator of bytes (the SSE events after Last-Event-ID, then the
    live ones up to the final event). ``route`` is the format of its events. Close it with
    ``aclose`` (Starlette's StreamingResponse does) when the caller goes."""

    def __init__(self, route: Route, events: AsyncIterator[bytes], release: Callable[[], None]):
        self.route: Route = route
        self._events = events
        self._release = release

    def __aiter__(self) -> Reader:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._events)

    async def aclose(self) -> None:
        try:
            await self._events.aclose()  # type: ignore[attr-defined]
        finally:
            self._release()

    def __del__(self) -> None:
        self._release()


class StreamLog:
    """The resumable-streams store of one instance (one per process). The integrator's contract:

    Producing (a streamed /api/chat or /api/v1/chat/completions response, RESUMABLE_STREAMS on):
      1. ``producer = log.start(route, owner)`` before the response starts; send the header
         ``x-stream-id: producer.id``. (TooManyStreams: stream it without resumability.)
      2. For each encoded piece: ``out = producer.append(data, final=...)``, and send ``out``
         (not ``data``) to the live caller; ``final=True`` with the route's last event(s).
      3. The relay must outlive the HTTP response: on a hang-up call ``producer.caller_gone()`` and
         keep relaying (appending) to the end; do not close the upstream.
      4. Watch ``producer.stop_requested`` (an asyncio.Event; cancel on any instance, or nobody
         reading for RESUME_ABANDON_SECONDS): close the upstream at once and append the route's
         final event with finish_reason ``cancelled`` (final=True).
      5. ``producer.finish()`` in ``finally``.
      The store is never waited on: if it fails, the live stream is unaffected and
      ``producer.resumable`` turns False (readers elsewhere get ``stream_lost``).

    Resuming: ``reader = await log.open_reader(id, parse_last_event_id(header, query), caller)``,
    then stream ``reader`` (an SSE body in ``reader.route``'s format). Cancelling:
    ``await log.cancel(id, caller)``. Errors: StreamNotFound 404 (unknown, expired, malformed, or
    another caller's), BadLastEventId 400, TooManyReaders 429, StoreUnavailable 503.

    ``close()`` at shutdown. The store (``Store``) stays the integrator's to close."""

    def __init__(self, store: Store, encode_error: EncodeError, config: ResumeConfig | None = None,
                 instance: str | None = None):
        self.store = store
        self.encode_error = encode_error
        self.config = config or ResumeConfig()
        self.instance = instance or secrets.token_hex(8)
        self._producers: dict[str, Producer] = {}
        self._tasks: set[asyncio.Task] = set()
        self._readers = 0
        self._readers_of: dict[str, int] = {}
        self._table: TableClient | None = None
        self._container: ContainerClient | None = None
        self._heartbeat: asyncio.Task | None = None
        self._inbox: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self._beat_ready: asyncio.Future | None = None
        self._beat = 0
        self._closed = False

    # -- the integrator's side ----------------------------------------------------------------

    def start(self, route: Route, owner: str | None) -> Producer:
        """A new resumable stream produced here (no I/O: storing starts in the background)."""
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}")
        if self._closed:
            raise RuntimeError("the stream log is closed")
        if len(self._producers) >= self.config.max_producers:
            raise TooManyStreams("too many resumable streams on this instance")
        producer = Producer(self, new_stream_id(), route, owner)
        self._producers[producer.id] = producer
        self._ensure_background()
        self._spawn(producer._run())
        return producer

    async def open_reader(self, stream_id: str, after: int | None, caller: str | None) -> Reader:
        """The events of ``stream_id`` after event ``after`` (None: from the start), then the live
        ones to the final event. Raises before anything is sent (see the class docstring)."""
        check_stream_id(stream_id)
        if self._closed:
            raise StoreUnavailable("the stream log is closed")
        if after is not None and (not isinstance(after, int) or after < 0 or after >= 10 ** 15):
            raise BadLastEventId("Last-Event-ID must be a non-negative integer of at most 15 digits")
        if self._readers >= self.config.max_readers or \
                self._readers_of.get(stream_id, 0) >= self.config.max_readers_per_stream:
            raise TooManyReaders("too many readers")
        self._ensure_sweeper()
        producer = self._producers.get(stream_id)
        if producer is not None:
            if producer.owner is not None and producer.owner != caller:
                raise StreamNotFound("no such stream")
            if after is not None and after > producer.last_id and not producer._lost:
                raise BadLastEventId(f"Last-Event-ID {after} is past the end of the stream ({producer.last_id})")
            return self._reader(stream_id, producer.route, lambda: self._follow_local(producer, after or 0))
        return await self._open_remote(stream_id, after or 0, caller)

    async def cancel(self, stream_id: str, caller: str | None) -> bool:
        """Ask the stream's producer (on whatever instance) to stop. True if the stream was live,
        False if it had already ended. StreamNotFound / StoreUnavailable as for open_reader."""
        check_stream_id(stream_id)
        self._ensure_sweeper()
        producer = self._producers.get(stream_id)
        if producer is not None:
            if producer.owner is not None and producer.owner != caller:
                raise StreamNotFound("no such stream")
            if producer._end_kept:
                return False
            producer._request_stop("cancelled")
            return True
        entity = await self._stream_entity(stream_id, caller)
        if entity.get("state") != "live":
            return False
        now = time.time()
        message = {"PartitionKey": f"i-{entity['instance']}", "RowKey": f"c-{stream_id}", "expires": now + 60.0}
        await self._call_table(lambda t: t.upsert_entity(message, mode=UpdateMode.REPLACE))
        return True

    async def close(self, timeout: float = 5.0) -> None:
        """Stop: producers get ``timeout`` seconds to store what they hold, then every task of this
        log is cancelled."""
        self._closed = True
        writers = [asyncio.ensure_future(p._done.wait()) for p in list(self._producers.values())]
        if writers:
            await asyncio.wait(writers, timeout=timeout)
            for waiter in writers:
                waiter.cancel()
            await asyncio.gather(*writers, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def sweep_once(self) -> int:
        """Delete what has expired (blobs, then their rows); the number of rows deleted."""
        now = time.time()
        rows: list[dict] = []

        async def collect(table: TableClient) -> None:
            query = table.query_entities("expires lt @now", parameters={"now": now},
                                         select=["PartitionKey", "RowKey"], results_per_page=100)
            async for row in query:
                rows.append(row)
                if len(rows) >= self.config.max_sweep:
                    break

        await self._call_table(collect, timeout=max(CALL_TIMEOUT, 10.0))
        gate = asyncio.Semaphore(8)

        async def delete(row: Any) -> int:
            async with gate:
                try:
                    if row["RowKey"] == _STREAM_ROW:
                        try:
                            await self._call_blob(lambda c: c.delete_blob(row["PartitionKey"]))
                        except ResourceNotFoundError:
                            pass
                    await self._call_table(lambda t: t.delete_entity(
                        row["PartitionKey"], row["RowKey"], etag=row.metadata["etag"],
                        match_condition=MatchConditions.IfNotModified))
                    return 1
                except (ResourceNotFoundError, ResourceModifiedError, StoreUnavailable, HttpResponseError):
                    return 0

        return sum(await asyncio.gather(*(delete(row) for row in rows)))

    # -- readers ------------------------------------------------------------------------------

    def _reader(self, stream_id: str, route: Route, make: Callable[[], AsyncIterator[bytes]]) -> Reader:
        self._readers += 1
        self._readers_of[stream_id] = self._readers_of.get(stream_id, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._readers -= 1
                left = self._readers_of.get(stream_id, 1) - 1
                if left > 0:
                    self._readers_of[stream_id] = left
                else:
                    self._readers_of.pop(stream_id, None)

        async def events() -> AsyncIterator[bytes]:
            inner = make()
            try:
                async for chunk in inner:
                    yield chunk
            finally:
                try:
                    await inner.aclose()  # type: ignore[attr-defined]
                finally:
                    release()

        return Reader(route, events(), release)

    async def _follow_local(self, producer: Producer, after: int) -> AsyncIterator[bytes]:
        cursor = after
        producer._attach()
        try:
            while True:
                kept = len(producer._events)
                if kept > cursor:
                    chunk = b"".join(producer._events[cursor:kept])
                    cursor = kept
                    yield chunk
                    continue
                if producer._end_kept:
                    if producer._lost and not (cursor == len(producer._events) and cursor > after):
                        # The client is past what was kept: it still gets a final event.
                        yield self._error(producer.route, "stream_lost", "the stream was lost before its end",
                                          True, cursor + 1)
                    return
                await producer._changed()
        finally:
            producer._detach()

    async def _open_remote(self, stream_id: str, after: int, caller: str | None) -> Reader:
        entity = await self._stream_entity(stream_id, caller)
        route: Route = entity["route"] if entity.get("route") in ROUTES else "chat"
        tail = _Tail(after)
        first = tail.feed(await self._read_blob(stream_id, 0))
        nonce = secrets.token_hex(4)
        registered = False
        try:
            if tail.end is None and entity.get("state") == "live":
                await self._register_reader(entity, stream_id, nonce)
                registered = True
            if after > tail.last_id and tail.end is None and entity.get("state") == "live":
                first += await self._check_past_end(stream_id, entity, after, tail)
            if tail.end == _END and after > tail.last_id:
                raise BadLastEventId(f"Last-Event-ID {after} is past the end of the stream ({tail.last_id})")
        except BaseException:
            if registered:
                self._forget_reader(entity, stream_id, nonce)
            raise
        return self._reader(stream_id, route,
                            lambda: self._follow_remote(stream_id, entity, route, after, tail, first, nonce,
                                                               registered))

    async def _check_past_end(self, stream_id: str, entity: dict, after: int, tail: _Tail) -> bytes:
        """Last-Event-ID ``after`` is past what is stored of a live stream. Either the producer has
        not written it yet (it does within inbox_seconds of seeing this reader), or the id was never
        handed out: wait for the stored log to reach it, or for a heartbeat composed after the
        client got ``after`` (two beats after the first one read here) to show the producer's last
        id. BadLastEventId only when proven; otherwise the reader follows (and skips to ``after``).
        Returns what was read meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.past_end_wait_seconds
        next_beat_check = loop.time()
        first_beat: int | None = None
        read = b""
        while after > tail.last_id and tail.end is None and loop.time() < deadline:
            if loop.time() >= next_beat_check:
                next_beat_check = loop.time() + min(0.5, self.config.heartbeat_seconds / 2)
                row = await self._instance_row(entity)
                if row is None or float(row.get("lease_until", 0)) + _SKEW < time.time():
                    break  # its instance is gone: the reader will say stream_lost
                beat = int(row.get("beat") or 0)
                if first_beat is None:
                    first_beat = beat
                elif beat >= first_beat + 2:
                    listed = _listed(row)
                    if stream_id in listed and after > listed[stream_id]:
                        raise BadLastEventId(f"Last-Event-ID {after} is past the end of the stream "
                                             f"({listed[stream_id]})")
                    break  # handed out, or no longer stored (the reader tells which)
            await asyncio.sleep(self.config.poll_seconds)
            read += tail.feed(await self._read_blob(stream_id, tail.offset))
        return read

    async def _instance_row(self, entity: dict) -> Any:
        instance = entity.get("instance")
        try:
            return await self._call_table(lambda t: t.get_entity(f"i-{instance}", _ALIVE_ROW))
        except ResourceNotFoundError:
            return None

    async def _follow_remote(self, stream_id: str, entity: dict, route: Route, after: int, tail: _Tail,
                             first: bytes, nonce: str, registered: bool) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        cfg = self.config
        try:
            if first:
                yield first
            poll = cfg.poll_seconds
            idle = 0
            now = loop.time()
            next_state = now + cfg.state_seconds
            next_refresh = now + cfg.read_refresh_seconds
            failing_since: float | None = None
            watch = _Liveness()
            while tail.end is None:
                await asyncio.sleep(poll)
                now = loop.time()
                try:
                    # Every read is handed out before any other store call: nothing read is lost.
                    out = tail.feed(await self._read_blob(stream_id, tail.offset))
                    if out:
                        poll, idle = cfg.poll_seconds, 0
                        yield out
                    else:
                        idle += 1
                        poll = (cfg.poll_seconds / 3 if idle <= 3 else
                                min(cfg.max_poll_seconds, cfg.poll_seconds * 1.5 ** (idle - 3)))
                    if tail.end is not None:
                        break
                    if now >= next_state:
                        next_state = now + cfg.state_seconds
                        if not await self._producer_alive(entity, watch):
                            # Nobody stores it any more: one more read for what was stored last.
                            out = tail.feed(await self._read_blob(stream_id, tail.offset))
                            if out:
                                yield out
                            if tail.end is None:
                                yield self._error(route, "stream_lost", "the stream's producer was lost",
                                                  True, tail.cursor + 1)
                                return
                            break
                    if registered and now >= next_refresh:
                        next_refresh = now + cfg.read_refresh_seconds
                        await self._register_reader(entity, stream_id, nonce)
                    failing_since = None
                except (StoreUnavailable, HttpResponseError):
                    failing_since = failing_since or now
                    if now - failing_since > cfg.give_up_seconds:
                        yield self._error(route, "store_unavailable", "the stream's store is unavailable",
                                          True, tail.cursor + 1)
                        return
            if tail.end == _LOST and not (tail.cursor == tail.last_id and tail.cursor > after):
                yield self._error(route, "stream_lost", "the stream was lost before its end", True,
                                  tail.cursor + 1)
        finally:
            if registered:
                self._forget_reader(entity, stream_id, nonce)

    def _error(self, route: Route, type: str, message: str, retryable: bool, number: int) -> bytes:
        return b"id: %d\n%s" % (number, self.encode_error(route, type, message, retryable, number))

    async def _stream_entity(self, stream_id: str, caller: str | None) -> dict:
        try:
            entity = await self._call_table(lambda t: t.get_entity(stream_id, _STREAM_ROW))
        except ResourceNotFoundError:
            raise StreamNotFound("no such stream") from None
        if entity.get("expires", 0) < time.time():
            raise StreamNotFound("no such stream")
        owner = entity.get("owner")
        if owner is not None and owner != caller:
            raise StreamNotFound("no such stream")
        return dict(entity)

    async def _read_blob(self, stream_id: str, offset: int) -> bytes:
        """The blob's bytes from ``offset`` (b"" when it has no more, or does not exist yet)."""
        async def read(container: ContainerClient) -> bytes:
            download = await container.get_blob_client(stream_id).download_blob(offset=offset)
            return await download.readall()
        try:
            return await self._call_blob(read)
        except ResourceNotFoundError:
            return b""
        except HttpResponseError as exc:
            if exc.status_code == 416:  # nothing past offset (Azure; Azurite answers empty)
                return b""
            raise StoreUnavailable(f"the store failed (HTTP {exc.status_code})") from None

    async def _producer_alive(self, entity: dict, watch: _Liveness | None) -> bool:
        """False if nobody is storing the stream any more: its instance's heartbeat stopped (by this
        reader's clock when it ``watch``es, else by the lease time), or the instance's last beat no
        longer lists it (it ended, and its end marker is in the blob; or it stopped being stored).
        The caller reads the blob once more: no end marker then means the stream is lost.
        StoreUnavailable when the store cannot tell."""
        row = await self._instance_row(entity)
        now = time.time()
        if row is None:
            alive = now - float(entity.get("created", 0)) < 2 * self.config.lease_seconds
        elif watch is None:
            alive = float(row.get("lease_until", 0)) + _SKEW >= now
        else:  # long past its lease (beyond any skew), or no new beat for a lease by our clock
            alive = (watch.saw(row.get("beat"), self.config.lease_seconds + _SKEW)
                     and float(row.get("lease_until", 0)) + 10 * self.config.lease_seconds >= now)
        if alive and row is not None and float(row.get("at", 0)) > float(entity.get("created", 0)):
            alive = entity["PartitionKey"] in _listed(row)
        return alive

    async def _register_reader(self, entity: dict, stream_id: str, nonce: str) -> None:
        now = time.time()
        row = {"PartitionKey": f"i-{entity['instance']}", "RowKey": f"r-{stream_id}-{nonce}", "read_at": now,
               "expires": now + 2 * self.config.abandon_seconds + 60.0}
        await self._call_table(lambda t: t.upsert_entity(row, mode=UpdateMode.REPLACE))

    def _forget_reader(self, entity: dict, stream_id: str, nonce: str) -> None:
        """The reader left: say when (the abandonment clock starts then); the producer deletes the row."""
        now = time.time()
        row = {"PartitionKey": f"i-{entity['instance']}", "RowKey": f"r-{stream_id}-{nonce}", "read_at": now,
               "left": True, "expires": now + 2 * self.config.abandon_seconds + 60.0}
        self._spawn(self._quietly(lambda: self._call_table(lambda t: t.upsert_entity(row, mode=UpdateMode.REPLACE))))

    # -- the instance's background work ------------------------------------------------------

    def _ensure_background(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._beat_ready = asyncio.get_running_loop().create_future()
            self._heartbeat = self._spawn(self._heartbeat_loop())
        if self._inbox is None or self._inbox.done():
            self._inbox = self._spawn(self._inbox_loop())
        self._ensure_sweeper()

    def _ensure_sweeper(self) -> None:
        if not self._closed and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = self._spawn(self._sweep_loop())

    async def _beat_first(self) -> None:
        """Wait (bounded) for this instance's first heartbeat, so no reader sees a stream before its lease."""
        if self._beat_ready is not None:
            try:
                async with asyncio.timeout(CALL_TIMEOUT + 0.2):
                    await asyncio.shield(self._beat_ready)
            except TimeoutError:
                pass

    async def _heartbeat_loop(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        idle_since: float | None = None
        while True:
            now = time.time()
            self._beat += 1
            # ``streams``: "id:last_id ..." of the streams this instance is storing right now, at
            # ``at`` (its own clock, the clock of their ``created``): one that is not listed any more
            # ended or was lost; ``last_id`` is the last id handed out to its live caller.
            storing = " ".join(f"{p.id}:{p._last_id}" for p in self._producers.values()
                               if p._resumable and not p._done.is_set())
            row = {"PartitionKey": f"i-{self.instance}", "RowKey": _ALIVE_ROW, "beat": self._beat, "at": now,
                   "lease_until": now + cfg.lease_seconds, "expires": now + cfg.lease_seconds + 60.0,
                   "streams": storing}
            try:
                await self._call_table(lambda t, row=row: t.upsert_entity(row, mode=UpdateMode.REPLACE))
            except StoreUnavailable as exc:
                log.warning("resumable streams: heartbeat failed: %s", exc)
            finally:
                if self._beat_ready is not None and not self._beat_ready.done():
                    self._beat_ready.set_result(None)
            await asyncio.sleep(cfg.heartbeat_seconds)
            # Linger a lease after the last stream, so that a next one needs no new first beat.
            if self._producers:
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            elif loop.time() - idle_since > cfg.lease_seconds:
                return

    async def _inbox_loop(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        query_failed_at = 0.0
        while self._producers:
            now, now_wall = loop.time(), time.time()
            try:
                for row in await self._read_inbox():
                    self._deliver(row, now_wall)
            except StoreUnavailable as exc:
                if now - query_failed_at > 10:
                    log.warning("resumable streams: the inbox could not be read: %s", exc)
                    query_failed_at = now
            for producer in list(self._producers.values()):
                producer._tick(now, now_wall)
            await asyncio.sleep(cfg.inbox_seconds)

    async def _read_inbox(self) -> list[Any]:
        async def query(table: TableClient) -> list[Any]:
            found = table.query_entities("PartitionKey eq @pk and RowKey gt @lo",
                                         parameters={"pk": f"i-{self.instance}", "lo": "b"},
                                         select=["RowKey", "read_at", "left"])
            return [row async for row in found]
        return await self._call_table(query)

    def _deliver(self, row: Any, now_wall: float) -> None:
        """One inbox row: a cancel; a remote reader following (``read_at``) or gone (``left``)."""
        key: str = row["RowKey"]
        producer = self._producers.get(key[2:24])
        done = key.startswith("c-") or producer is None or bool(row.get("left"))
        if key.startswith("c-") and producer is not None:
            producer._request_stop("cancelled")
        elif key.startswith("r-") and producer is not None:
            read_at = min(float(row.get("read_at") or 0), now_wall)
            producer._remote_read_at = max(producer._remote_read_at, read_at)
            if not row.get("left"):
                producer._remote_follow_at = max(producer._remote_follow_at, read_at)
        if done:  # read once: delete it (also what is left of streams no longer here)
            pk = f"i-{self.instance}"
            self._spawn(self._quietly(lambda: self._call_table(lambda t: t.delete_entity(pk, key))))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_seconds * random.uniform(0.8, 1.2))
            try:
                deleted = await self.sweep_once()
                if deleted:
                    log.info("resumable streams: %d expired rows deleted", deleted)
            except StoreUnavailable as exc:
                log.warning("resumable streams: sweep failed: %s", exc)
            except Exception:
                log.exception("resumable streams: sweep failed")

    async def _mark_lost(self, stream_id: str) -> None:
        now = time.time()
        fields = {"PartitionKey": stream_id, "RowKey": _STREAM_ROW, "state": "lost",
                  "expires": now + self.config.ttl_seconds}
        await self._quietly(lambda: self._call_table(lambda t: t.update_entity(fields, mode=UpdateMode.MERGE)))

    def _release(self, producer: Producer) -> None:
        if self._producers.get(producer.id) is producer:
            del self._producers[producer.id]

    # -- plumbing ----------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task | None:
        if self._closed:  # nothing starts after close()
            coro.close()  # type: ignore[attr-defined]
            return None
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    async def _quietly(call: Callable[[], Awaitable[Any]]) -> None:
        try:
            await call()
        except Exception as exc:  # noqa: BLE001  # best effort: a row left behind expires and is swept
            log.debug("resumable streams: %s", exc)

    async def _call_table(self, op: Callable[[TableClient], Awaitable[T]], timeout: float = CALL_TIMEOUT) -> T:
        if self._table is None:
            self._table = await self.store.table(STREAMS_TABLE)
        return await _bounded(op(self._table), timeout)

    async def _call_blob(self, op: Callable[[ContainerClient], Awaitable[T]]) -> T:
        if self._container is None:
            self._container = await self.store.container(STREAMS_CONTAINER)
        return await _bounded(op(self._container))


def _listed(row: Any) -> dict[str, int]:
    """The streams an instance's heartbeat row lists as being stored, with their last ids."""
    listed = {}
    for token in str(row.get("streams") or "").split():
        stream_id, _, last = token.partition(":")
        listed[stream_id] = int(last) if last.isdigit() else 0
    return listed


class _Liveness:
    """A remote reader's view of the producer's heartbeat: dead when the beat has not changed for
    a lease, by the reader's own clock (so a skewed clock cannot make a live producer look dead)."""

    def __init__(self) -> None:
        self.beat: Any = None
        self.changed_at = time.monotonic()

    def saw(self, beat: Any, lease: float) -> bool:
        now = time.monotonic()
        if beat != self.beat:
            self.beat, self.changed_at = beat, now
            return True
        return now - self.changed_at <= lease
