"""The stream core, shared by every API: upstream chunks in, events out: ``Chunk`` for each chunk
worth forwarding (already through the pipeline's text steps), then exactly one ``Done`` or
``Failed``.

What it guarantees whatever the API: chunks before the first output (a role chunk, say) are held
and sent with it, so that the status rule can wait for real output; every wait on the upstream is
bounded by the time limits (limits.py), and the total limit holds even when the caller stops
reading; a failure of any kind ends the stream with one ``Failed`` (a bug of ours is logged with
its traceback and reported as ``internal_error``, never blamed on the upstream); the upstream
response is closed however the stream ends, including when the caller hangs up.

When one read from the upstream brought several chunks (a backlog, under load), the chunks made of
them are marked ``more``: the endpoint sends them in one write with the chunk that follows, which
is already in hand (nothing that is ready waits for the network, nor for a moderation check: with
one, each chunk goes out on its own).

What differs per upstream API (chat completions, responses) is the ``protocol``: it filters each
chunk (``feed`` → ``Fed``), says when the answer is complete (``done``), reads what comes after
(``note``, e.g. the usage) and sums the stream up (``summary``)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import anyio

from .errors import UPSTREAM_ERRORS, ApiError, from_upstream
from .limits import TimeLimits
from .record import StreamRecord
from .upstream import UpstreamStream

log = logging.getLogger("chatstream")


@dataclass(slots=True)
class Chunk:
    data: dict  # an upstream chunk (chat.completion.chunk, or a Responses event)
    more: bool = False  # the next event is already in hand: write this one together with it


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str | None  # choice 0's (for responses: the response's status)
    finish_reasons: dict[int, str]
    usage: dict | None
    model: str | None
    id: str | None
    created: int | None


@dataclass(frozen=True, slots=True)
class Failed:
    error: ApiError


Event = Chunk | Done | Failed


@dataclass(frozen=True, slots=True)
class Fed:
    """What a protocol makes of one upstream chunk: the chunk to forward (None: nothing), whether it
    is output (the status rule waits for output), and whether it counts as a delta."""
    data: dict | None
    output: bool = False
    delta: bool = False


class StreamProtocol(Protocol):
    feed_waits: bool  # ``feed`` may wait (on a moderation check): chunks in hand are not held for it
    @property
    def done(self) -> bool: ...  # the answer is complete
    @property
    def finished(self) -> object: ...  # truthy once some part of it finished (a choice, say)
    async def feed(self, data: dict) -> Fed: ...
    def note(self, data: dict) -> None: ...
    def summary(self) -> Done: ...


async def encoded(first: Event, events: AsyncIterator[Event], encode: Callable[[Event], bytes | None]
                  ) -> AsyncIterator[bytes]:
    """``first`` and then ``events`` up to the final one, encoded: one piece of bytes per write, the
    chunks marked ``more`` joined with the events that follow them."""
    pending: list[bytes] = []
    event = first
    while True:
        data = encode(event)
        if data:
            pending.append(data)
        last = not isinstance(event, Chunk)
        if pending and (last or not event.more):
            yield pending[0] if len(pending) == 1 else b"".join(pending)
            pending = []
        if last:
            return
        try:
            event = await anext(events)
        except StopAsyncIteration:
            if pending:
                yield b"".join(pending)
            return


def incomplete() -> ApiError:
    return ApiError(502, "upstream_incomplete", "the model server ended the stream without a finish reason",
                    retryable=True)


async def relay(open_stream: Callable[[], Awaitable[UpstreamStream]], protocol: StreamProtocol,
                limits: TimeLimits, record: StreamRecord) -> AsyncIterator[Event]:
    stream: UpstreamStream | None = None
    watchdog = None
    ended = False
    try:
        stream = await limits.wait(open_stream())
        watchdog = limits.on_total(lambda: _close_parked(stream, limits))
        async with contextlib.aclosing(_forward(stream, protocol, limits, record)) as forwarded:
            async for chunk in forwarded:
                yield chunk
        await _read_rest(aiter(stream), protocol, limits)
        done = protocol.summary()
        record.finish_reason = done.finish_reason
        ended = True
        yield done
    except Exception as exc:  # noqa: BLE001 - every failure becomes the one final event
        ended = True
        yield Failed(_failure(exc, record))
    finally:
        if not ended:
            record.disconnected = True
        if watchdog is not None:
            watchdog.cancel()
        limits.close()
        if stream is not None:
            # Shielded: when the caller hung up we run inside a cancelled scope, and the upstream
            # connection must still be closed (that is what stops the paid generation).
            with anyio.CancelScope(shield=True):
                await stream.close()


async def _forward(stream: UpstreamStream, protocol: StreamProtocol, limits: TimeLimits,
                   record: StreamRecord) -> AsyncIterator[Chunk]:
    chunks = aiter(stream)
    held: list[dict] = []  # chunks before the first output
    ready: Chunk | None = None  # the last chunk made, kept until we know whether another follows at once
    try:
        while not protocol.done:
            if ready is not None and (not stream.ready or protocol.feed_waits):  # what comes next may wait
                yield ready
                ready = None
                limits.check_total()  # the caller may have read slowly while we were parked at yield
            try:
                data = await limits.wait(anext(chunks))
            except StopAsyncIteration:
                if protocol.finished:  # a choice never finished but the stream ended cleanly
                    break
                raise incomplete() from None
            limits.check_total()  # buffered chunks arrive without waiting: the total limit still holds
            limits.got_chunk()  # the idle limit runs between upstream chunks, forwarded or not
            fed = await protocol.feed(data)
            if fed.data is None:
                continue
            if record.first_delta_at is None:
                if not fed.output:
                    held.append(fed.data)
                    continue
                record.first_delta_at = time.perf_counter()
                record.model_accepted = True  # the upstream served the model: it may be a metric dimension
                limits.got_output()
                for early in held:
                    yield Chunk(early, more=True)
            if fed.delta:
                record.deltas += 1
            if ready is not None:
                ready.more = True
                yield ready
            ready = Chunk(fed.data)
    except Exception:
        if ready is not None:  # what was made before the failure still goes out, then the error
            yield ready
        raise
    if ready is not None:
        yield ready


async def _read_rest(chunks: AsyncIterator[dict], protocol: StreamProtocol, limits: TimeLimits) -> None:
    """After the answer is complete, read on briefly for what follows it (the usage), and to the end
    of the body so the SDK can reuse the connection. Missing it is not a failure."""
    limits.finishing()
    try:
        async with asyncio.timeout_at(limits.deadline):
            async for data in chunks:
                protocol.note(data)
    except (TimeoutError, ApiError, *UPSTREAM_ERRORS):
        pass


_closing: set[asyncio.Future] = set()


def _close_parked(stream: UpstreamStream, limits: TimeLimits) -> None:
    """At the total limit: a stream parked behind a caller who stopped reading is not waiting on the
    upstream (that wait would expire by itself), so close the upstream now; the core reports the
    limit when the caller reads again."""
    if not limits.waiting:
        task = asyncio.ensure_future(stream.close())
        _closing.add(task)  # keep a reference until it is done (the loop holds only a weak one)
        task.add_done_callback(_closing.discard)


def _failure(exc: Exception, record: StreamRecord) -> ApiError:
    if isinstance(exc, ApiError):
        error = exc
    elif isinstance(exc, UPSTREAM_ERRORS):
        error = from_upstream(exc, record.model, midstream=record.first_delta_at is not None)
    else:
        log.exception("chat stream failed (endpoint=%s)", record.endpoint)
        error = ApiError(500, "internal_error", "the stream failed unexpectedly", retryable=True)
    record.error = error.type
    return error
