"""Resumable streams in the request path (``RESUMABLE_STREAMS=on``, docs/resumable.md): a streamed
``/api/chat`` or ``/api/v1/chat/completions`` answer is produced by a task of its own, numbered and
kept by the stream log (state/streamlog/), and the caller is one reader of it. So a hang-up no longer
stops the generation: it goes on and is stored, and ``GET /api/streams/{id}`` with ``Last-Event-ID``
continues it on any instance. ``POST /api/streams/{id}/cancel`` stops it, and so does nobody reading it
for ``RESUME_ABANDON_SECONDS``: the upstream is closed and the stream ends with ``finish_reason``
``cancelled``.

The status rule is the same as for any stream: until the first output (or the first heartbeat) a
failure is an HTTP status, and a caller that leaves then stops it (there is no stream id to resume
yet); after it, every event has an ``id:`` line and the answer has ``x-stream-id``.

The stream log answers in domain errors (state/streamlog/errors.py); this module alone turns them
into statuses and bodies (``_error``): not found 404, a bad Last-Event-ID 400, too many readers 429,
the store unavailable 503 (with ``Retry-After``)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Literal

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .apis.refusals import authenticated
from .errors import ApiError, ErrorKind, invalid_request, log_safe
from .http import NO_STORE, EventStreamResponse, error_headers
from .record import StreamRecord
from .sse import KEEP_ALIVE
from .state.accounting import Accounting
from .state.streamlog.errors import (
    PastTheEnd,
    StreamLogError,
    StreamLogUnavailable,
    StreamNotFound,
    TooManyReaders,
    TooManyStreams,
)
from .state.streamlog.format import EncodeError, LogError, log_tag
from .state.streamlog.log import StreamLog
from .state.streamlog.producer import MOVED, Producer
from .state.streamlog.readers import Reader
from .stream import Chunk, Done, Event, Failed, StreamProtocol, TimeLimits

log = logging.getLogger("chatstream")

# The stream log's name for a stream's events' format (it stores it, opaque, with the stream).
Route = Literal["chat", "openai"]

Encode = Callable[[Event], bytes | None]

# The live caller's last event waits (at most this long) until the log holds the whole answer: an
# instance that dies as the answer ends has it all in its log, and its recovery charges all of it
# (docs/callers.md). One store write at the end of a stream; nothing per delta. The chunk that
# completes the answer waits with it (chaos seed 97: three chat-completions callers held the
# finish_reason chunk of an instance killed before it stored it; resumed, they got stream_lost
# after an answer they had whole).
END_STORED_WITHIN = 2.0


class Resumable:
    """The producing side (``respond``) and the two routes (``resume``, ``cancel``)."""

    def __init__(self, streams: StreamLog, heartbeat: float, accounting: Accounting | None):
        self.streams = streams
        self.heartbeat = heartbeat
        self.accounting = accounting  # caller keys: a stream is resumed or cancelled by its own caller only
        self._producing: set[asyncio.Task] = set()

    # --- producing ------------------------------------------------------------------------------

    def start(self, route: Route, record: StreamRecord, params: Mapping[str, Any] | None = None) -> Producer | None:
        """A new stream's producer, or None when this instance produces too many (then the answer
        streams as usual, without resumability). ``params``: the upstream request as the route
        made it, stored for a continuation elsewhere."""
        try:
            # Owned by the caller's id; the app's own request id (what its charges are keyed by).
            return self.streams.start(route, record.caller_id, request=params, request_id=record.id)
        except TooManyStreams:
            log.warning("resumable streams: this instance is full; a stream goes without resumability")
            return None

    def respond(
        self,
        producer: Producer,
        first: asyncio.Future,
        events: AsyncGenerator[Event],
        encode: Encode,
        protocol: StreamProtocol,
        limits: TimeLimits,
        record: StreamRecord,
        headers: dict[str, str],
    ) -> Response:
        """The answer once the first event is in hand or on its way: its producer runs as a task of
        its own, and this response reads what it appends."""
        out: asyncio.Queue[bytes | None] = asyncio.Queue()
        task = asyncio.create_task(self._produce(producer, first, events, encode, protocol, record, out))
        self._producing.add(task)
        task.add_done_callback(self._producing.discard)
        return EventStreamResponse(
            _live(first, out, self.heartbeat),
            limits.total_at,
            on_close=lambda: _gone(producer),
            headers={**headers, "x-request-id": record.request_id, "x-stream-id": producer.id},
        )

    async def produce(
        self,
        producer: Producer,
        events: AsyncGenerator[Event],
        encode: Encode,
        protocol: StreamProtocol,
        record: StreamRecord,
    ) -> None:
        """Drive ``producer`` with ``events`` to their end with no live caller (a stream taken over
        here: its readers follow the log): the same stops and final events as ``respond``'s."""
        first = asyncio.ensure_future(anext(events))
        out: asyncio.Queue[bytes | None] = asyncio.Queue()  # nobody reads it: every reader reads the log
        await self._produce(producer, first, events, encode, protocol, record, out)

    async def _produce(
        self,
        producer: Producer,
        first: asyncio.Future,
        events: AsyncGenerator[Event],
        encode: Encode,
        protocol: StreamProtocol,
        record: StreamRecord,
        out: asyncio.Queue[bytes | None],
    ) -> None:
        """Every event to the log (and to the live caller while it reads), to the final one; a stop
        (cancel, abandonment) closes the upstream and ends the stream ``cancelled``. The relay is
        awaited here directly (no task, no wait per event): a stop cancels this task where it waits,
        as closing the upstream would."""
        task = asyncio.current_task()
        relaying = True

        def on_stop(_: object) -> None:
            if relaying and task is not None:
                task.cancel()

        stop = asyncio.ensure_future(producer.stop_requested.wait())
        stop.add_done_callback(on_stop)
        try:
            try:
                item = await first
                batch: list[bytes] = []
                while not producer.stop_requested.is_set():
                    data = encode(item)
                    if data:
                        batch.append(data)
                    final = not isinstance(item, Chunk)
                    # A chunk that completes the answer (its finish_reason) goes out with the final
                    # event, once the log holds both: a caller never holds an end the log lacks.
                    if batch and not (isinstance(item, Chunk) and (item.more or protocol.done)):
                        data = producer.append(b"".join(batch), final=final)
                        if final:
                            relaying = False
                            await producer.wait_stored(END_STORED_WITHIN)
                        out.put_nowait(data)
                        batch = []
                    if final:
                        relaying = False
                        return
                    item = await anext(events)
            except asyncio.CancelledError:
                if task is None or not producer.stop_requested.is_set() or task.cancelling() > 1:
                    raise  # cancelled from elsewhere (shutdown), not by the stop
                task.uncancel()
            relaying = False
            await _stopped(first, events, record, protocol, encode, producer, out)
        except Exception:
            log.exception("resumable stream %s: the producer failed", log_tag(producer.id))
        finally:
            relaying = False
            stop.cancel()
            producer.finish()
            out.put_nowait(None)
            with anyio.CancelScope(shield=True):
                await events.aclose()

    # --- the routes -------------------------------------------------------------------------------

    async def resume(self, request: Request) -> Response:
        """``GET /api/streams/{id}``: the events after ``Last-Event-ID`` (or ``?last_event_id``), then
        the live ones to the final event."""
        stream_id = request.path_params.get("stream_id", "")
        try:
            caller = await self._caller(request)
            after = last_event_id(request.headers.get("last-event-id"), request.query_params.get("last_event_id"))
            reader = await self.streams.open_reader(stream_id, after, caller)
        except (ApiError, StreamLogError) as error:
            return _error(error, stream_id)
        # A resumed stream follows its producer, bounded by the same limit.
        give_up = asyncio.get_running_loop().time() + self.streams.config.max_stream_seconds
        return EventStreamResponse(_with_keep_alives(reader, self.heartbeat), give_up, on_close=reader.aclose)

    async def cancel(self, request: Request) -> Response:
        """``POST /api/streams/{id}/cancel``: the stream's producer, wherever it runs, stops within a
        second; the stream ends ``cancelled``."""
        stream_id = request.path_params.get("stream_id", "")
        try:
            caller = await self._caller(request)
            live = await self.streams.cancel(stream_id, caller)
        except (ApiError, StreamLogError) as error:
            return _error(error, stream_id)
        return JSONResponse({"id": stream_id, "object": "stream.cancel", "cancelled": live}, headers=NO_STORE)

    async def _caller(self, request: Request) -> str | None:
        if self.accounting is None:
            return None  # without caller keys the stream id is the capability
        return (await authenticated(self.accounting, request.headers)).id


async def _stopped(
    pending: asyncio.Future,
    events: AsyncGenerator[Event],
    record: StreamRecord,
    protocol: StreamProtocol,
    encode: Encode,
    producer: Producer,
    out: asyncio.Queue[bytes | None],
) -> None:
    """Cancelled or abandoned: close the upstream now, then the final event, ``cancelled``. Taken
    over or handed over: the stream goes on elsewhere; the live caller is told to resume there."""
    moved = producer.stop_reason in MOVED
    if not moved:
        record.stopped(producer.stop_reason or "cancelled")
    pending.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(pending, return_exceptions=True)
        await events.aclose()  # the relay closes the upstream connection: the generation stops
    if moved:
        out.put_nowait(producer.moved_event())
        return
    model, created = getattr(protocol, "model", None), getattr(protocol, "created", None)
    done = Done("cancelled", {0: "cancelled"}, None, model, protocol.id, created)
    data = encode(done)
    if data:
        out.put_nowait(producer.append(data, final=True))


async def _live(first: asyncio.Future, out: asyncio.Queue[bytes | None], heartbeat: float) -> AsyncIterator[bytes]:
    """What the original caller reads: keep-alives until the first output, then what the producer
    appends, as it appends it."""
    if not first.done():
        yield KEEP_ALIVE  # the headers go out now; say so to proxies at once
        while not first.done() and out.empty():
            await asyncio.wait({first}, timeout=heartbeat)
            if not first.done() and out.empty():
                yield KEEP_ALIVE
    while (data := await out.get()) is not None:
        if data:  # (nothing while the stream is handed over: Producer.append)
            yield data


async def _gone(producer: Producer) -> None:
    """The original caller's answer is over (read to the end, or it hung up): the stream goes on."""
    producer.caller_gone()


async def _with_keep_alives(reader: Reader, heartbeat: float) -> AsyncIterator[bytes]:
    """A reader's bytes, with a keep-alive comment whenever nothing came for ``heartbeat`` seconds (a
    resumed stream may wait long for the producer). The reader's next step runs in a task of its own;
    at the end that task is cancelled and waited for, so that the reader is not running when the
    response closes it (a caller gone while a reading waited for its stream: "aclose(): asynchronous
    generator is already running", the chaos soak's seed 4242). When this instance stops
    (``Reader.leaving``) the reading ends at once with ``stream_moved``, unless it is over."""
    pending = asyncio.ensure_future(anext(reader))
    leaving = asyncio.ensure_future(reader.leaving.wait())
    try:
        while True:
            waits = {pending} if reader.over else {pending, leaving}
            done, _ = await asyncio.wait(waits, timeout=heartbeat, return_when=asyncio.FIRST_COMPLETED)
            if pending in done:
                try:
                    data = pending.result()
                except StopAsyncIteration:
                    return
                yield data
                pending = asyncio.ensure_future(anext(reader))
            elif leaving in done:
                yield reader.moved_event()
                return
            else:
                yield KEEP_ALIVE
    finally:
        leaving.cancel()
        if not pending.done():
            pending.cancel()
            await asyncio.wait({pending})
        if not pending.cancelled():
            pending.exception()  # (retrieved: the reader's own end, StopAsyncIteration or its error)


# Last-Event-ID: a decimal event id, at most 15 digits (ids stay exact in a double and in JSON).
_LAST_ID = re.compile(r"[0-9]{1,15}")


def last_event_id(header: str | None, query: str | None = None) -> int | None:
    """The event id a resume continues after: the ``Last-Event-ID`` header, else the
    ``last_event_id`` query parameter; None (from the start) when neither is given or the header is
    empty (what EventSource sends before any id). A 400 for anything else than 0..10^15-1."""
    value = header if header is not None and header.strip() else query
    if value is None:
        return None
    value = value.strip()
    if _LAST_ID.fullmatch(value) is None:
        raise invalid_request("Last-Event-ID must be a non-negative integer of at most 15 digits")
    return int(value)


_STATUSES: tuple[tuple[type[StreamLogError], int, ErrorKind], ...] = (
    (StreamNotFound, 404, ErrorKind.NOT_FOUND),
    (TooManyReaders, 429, ErrorKind.RATE_LIMITED),
    (StreamLogUnavailable, 503, ErrorKind.STREAM_STORE_UNAVAILABLE),
)


def _error(error: ApiError | StreamLogError, stream_id: str) -> Response:
    """An error of the stream routes. A stream's route is not known before it is found, so the body
    is both shapes at once: /api/chat's (``type``, ``message``, ``retryable``) and OpenAI's
    (``message``, ``type``, ``code``, ``param``): ``type`` and ``code`` carry our kind. A stream not
    found is logged with the reason, which its body does not tell."""
    if isinstance(error, StreamNotFound):
        log.info("stream %s: not found (%s)", log_safe(log_tag(stream_id)), error.reason)
    if isinstance(error, PastTheEnd):
        error = invalid_request(f"Last-Event-ID {error.after} is past the end of the stream ({error.last})")
    if not isinstance(error, ApiError):
        found = ((s, k) for cls, s, k in _STATUSES if isinstance(error, cls))
        status, kind = next(found, (400, ErrorKind.INVALID_REQUEST))
        retryable = status >= 429
        error = ApiError(
            status, kind, str(error), retryable=retryable, headers={"Retry-After": "1"} if retryable else {}
        )
    kind = str(error.type)
    body = {
        "error": {
            "message": error.message,
            "type": kind,
            "code": kind,
            "param": None,
            "chatstream_kind": kind,
            "retryable": error.retryable,
        }
    }
    return JSONResponse(body, status_code=error.status, headers=error_headers(error))


_LOG_ERRORS: dict[LogError, ErrorKind] = {
    "stream_lost": ErrorKind.STREAM_LOST,
    "stream_moved": ErrorKind.STREAM_MOVED,
    "store_unavailable": ErrorKind.STREAM_STORE_UNAVAILABLE,
}


def encode_error(encoders: dict[str, Encode]) -> EncodeError:
    """The stream log's encoder for an error event it writes itself (``LogError``, all retryable):
    in the route's format, as the route's own encoder writes a final error."""

    def encode(route: str, type: LogError, message: str) -> bytes:
        data = encoders[route](Failed(ApiError(502, _LOG_ERRORS[type], message, retryable=True)))
        return data or b""

    return encode
