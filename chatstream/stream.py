"""The stream core, shared by every API: upstream chunks in, events out: ``Chunk`` for each chunk
worth forwarding (already through the pipeline's text steps), then exactly one ``Done`` or
``Failed``.

What it guarantees whatever the API: chunks before the first output (a role chunk, say) are held
and sent with it, so that the status rule can wait for real output; every wait on the upstream is
bounded by the time limits (``TimeLimits``), and the total limit holds even when the caller stops
reading; a failure of any kind ends the stream with one ``Failed`` (a bug of ours is logged with
its traceback and reported as ``internal_error``, never blamed on the upstream); the upstream
stream is closed however the stream ends, including when the caller hangs up.

When one read from the upstream brought several chunks (a backlog, under load), the chunks made of
them are marked ``more``: the endpoint sends them in one write with the chunk that follows, which
is already in hand (nothing that is ready waits for the network, nor for a moderation check: with
one, each chunk goes out on its own).

The seams are the protocols below: what differs per upstream API (``StreamProtocol``), the pool
(``Upstream``, ``UpstreamChunks``), how an answer goes on after its upstream failed mid-answer
(``Continuation``); the protocol and its text steps never see a continuation's seam."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import anyio

from .errors import (
    ApiError,
    ErrorKind,
    first_token_expired,
    idle_expired,
    incomplete,
    internal_error,
    total_expired,
)
from .record import StreamRecord
from .settings import Settings

log = logging.getLogger("chatstream")
T = TypeVar("T")

# --- events -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Chunk:
    """What a protocol makes of one upstream chunk (``StreamProtocol.feed``), and the event the
    relay forwards. One object per chunk, made once: it runs for every delta."""

    data: dict  # the chunk to forward (a chat.completion.chunk, or a Responses event)
    output: bool = False  # it is output (the status rule waits for output)
    delta: bool = False  # it counts as a delta
    batch: tuple[dict, ...] = ()  # further events released with ``data`` (a held delta, then this one)
    # ``data`` is the upstream's chunk as it came and this is choice 0's content in it (None: read
    # ``data``): the chunk is read once, the continuation and the encoder take the text from here
    text: str | None = None
    more: bool = False  # set by the relay: the next event is already in hand, write this one with it


NOTHING = Chunk({})  # a protocol's answer for an upstream chunk with nothing to forward (never forwarded)


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str | None  # choice 0's (for responses: the response's status)
    finish_reasons: dict[int, str]
    usage: dict | None
    model: str | None
    id: str | None
    created: int | None
    continued: tuple[dict, ...] = ()  # the seams of a continued answer (continuation.py)


@dataclass(frozen=True, slots=True)
class Failed:
    error: ApiError


Event = Chunk | Done | Failed
# A continuation's hooks on a stream's chunks: one before the protocol (``mend``), or one after it
# (``saw``), or neither (``Continuation.hands``).
Hands = tuple[Callable[[dict], Sequence[dict]] | None, Callable[[dict, Chunk], None] | None]


class Ends:
    """What a stream's relay tells of its ends (``relay``'s ``ends``): ``begin`` at its first read;
    ``last`` with the final event in hand (its upstream closed by then), awaited before that event
    goes out; ``over`` once the stream is over, however it ends. Calls, not a generator around the
    relay's: a layer there would cost every delta. This one awaits ``before_last`` (what a response
    it created carries, kept) before the final event and calls ``on_end`` (the endpoint's record
    keeping: the log line, the charge) once, at the end; lifecycle.Stream adds the drain's."""

    __slots__ = ("_ended", "before_last", "on_end")

    def __init__(self, on_end: Callable[[], None], before_last: Callable[[], Awaitable[None]] | None = None) -> None:
        self.on_end = on_end
        self.before_last = before_last
        self._ended = False

    def begin(self) -> None:
        pass

    async def last(self, event: Event) -> None:
        if self.before_last is not None:
            await self.before_last()

    def over(self) -> None:
        self.end()

    def end(self) -> None:
        """``on_end``, the first time only."""
        if not self._ended:
            self._ended = True
            self.on_end()


class StreamProtocol(Protocol):
    """One upstream API's stream, seen by the core (apis/completions.py, apis/responses_stream.py)."""

    feed_waits: bool  # ``feed`` may wait (on a moderation check): chunks in hand are not held
    # Per choice, when kept: what the text steps released, and what the model generated (before them).
    released: dict[int, list[str]] | None
    generated: dict[int, list[str]] | None
    id: str | None  # the answer's id, once the upstream said it
    usage: dict | None  # the last usage the upstream reported
    plain: Callable[[dict], Chunk | None] | None  # ``feed`` without awaiting (None: it cannot)

    @property
    def done(self) -> bool: ...  # the answer is complete
    @property
    def finished(self) -> object: ...  # truthy once some part of it finished (a choice, say)
    async def feed(self, data: dict) -> Chunk: ...  # NOTHING: nothing to forward

    def note(self, data: dict) -> None: ...  # a chunk after the answer (the usage)
    def summary(self) -> Done: ...
    def probe(self) -> StreamProtocol: ...  # the same kind, without text steps: the pool's look for the first output


class UpstreamChunks(Protocol):
    """An open upstream stream: its chunks as dicts, how many are already in hand, and closing it
    (which stops the generation)."""

    @property
    def ready(self) -> int: ...
    @property
    def request_id(self) -> str | None: ...
    def __aiter__(self) -> AsyncIterator[dict]: ...
    async def close(self) -> None: ...


class Upstream(Protocol):
    """What the core asks for a stream: one opened up to its first output, as ``protocol.probe()``
    sees it (upstreams/failover.py), within the limits."""

    async def open(
        self, path: str, params: dict, protocol: StreamProtocol, limits: TimeLimits, record: StreamRecord
    ) -> UpstreamChunks: ...


class Continuation(Protocol):
    """How one answer goes on when its upstream fails after output went to the caller
    (continuation.py): ``hands`` says, once per stream, what of it sees that stream's chunks: a
    ``mend`` that gets every chunk before the protocol and gives what the protocol is to see (the
    seam between two streams), or (a stream it passes on as it comes: the first) a ``saw`` that gets
    each chunk after the protocol, with what the protocol read of it (``Chunk.text``); ``note`` a
    chunk after the answer (the usage); ``may_continue`` judges a failure, ``reopen`` opens the next
    stream (raising when none could be had), ``summary`` completes the final event."""

    def hands(self) -> Hands: ...
    def note(self, data: dict) -> None: ...
    def may_continue(self, error: ApiError) -> bool: ...
    async def reopen(self, error: ApiError, limits: TimeLimits) -> UpstreamChunks: ...
    def summary(self, done: Done) -> Done: ...


# --- time limits ------------------------------------------------------------------------------


class TimeLimits:
    """The time limits of one stream, and which error each one raises:

    - first token: from the request until the first output (``FIRST_TOKEN_TIMEOUT_SECONDS``);
    - idle: between two upstream chunks once output has started (``IDLE_TIMEOUT_SECONDS``);
    - total: the whole stream, however slowly the caller reads (``TOTAL_TIMEOUT_SECONDS``).

    Every wait on the upstream goes through ``wait``, bounded by the limit in force, with one timer
    per stream. The total limit is also checked on every chunk (chunks already buffered arrive
    without a wait), and ``on_total`` closes a stream parked behind a caller who stopped reading.

    ``cut`` ends the stream early with an error of the caller's (the instance's drain, lifecycle.py):
    the total limit runs out now, with that error: the wait in progress ends at once, as does the
    next one, or the next chunk. Nothing on the path of a delta pays for it."""

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_running_loop()
        # The loop's clock: asyncio's own loop reads time.monotonic (read here without its method).
        self._clock = time.monotonic if type(self.loop).time is asyncio.BaseEventLoop.time else self.loop.time
        now = self.loop.time()
        self.total_at = now + settings.total_timeout
        self.first_token = settings.first_token_timeout
        self.deadline = min(self.total_at, now + self.first_token)
        self.idle = settings.idle_timeout
        self.usage_wait = settings.usage_wait
        self.output_started = False
        self.reopening = False  # the answer goes on on another stream: its first output is awaited
        self.waiting = False  # inside ``wait``: the limit in force ends that wait by itself
        self._task: asyncio.Task | None = None  # the task inside ``wait``
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._fired = False  # the timer cancelled the waiting task
        self._cut: ApiError | None = None  # ``cut``'s error
        self._parked: Callable[[], None] | None = None  # ``on_total``'s callback

    def error(self) -> ApiError:
        """The error for the limit in force now."""
        if self._cut is not None:
            return self._cut
        if not self.output_started:
            return first_token_expired()
        if self.deadline >= self.total_at:
            return total_expired()
        return first_token_expired() if self.reopening else idle_expired()

    def check_total(self) -> None:
        if self.loop.time() >= self.total_at:
            raise self._cut or total_expired()

    def got_output(self) -> None:
        """Output went to the caller: from now on the idle limit runs between chunks."""
        self.output_started = True
        self.reopening = False
        self.deadline = min(self.total_at, self.loop.time() + self.idle)

    def continuing(self) -> None:
        """The upstream failed mid-answer and the answer goes on on another stream: its first output
        is due within the first-token limit (and the total one)."""
        self.reopening = True
        self.deadline = min(self.total_at, self.loop.time() + self.first_token)

    def got_chunk(self) -> None:
        """A chunk came from the upstream (whether or not anything of it is forwarded): the total
        limit is checked (buffered chunks arrive without a wait), and once output has started the
        idle limit runs from now. One clock read for both: this runs for every chunk."""
        now = self._clock()
        if now >= self.total_at:
            raise self._cut or total_expired()
        if self.output_started:
            self.deadline = min(self.total_at, now + self.idle)

    def finishing(self) -> None:
        """Every choice has finished: only the usage is still awaited, briefly."""
        self.deadline = min(self.total_at, self.loop.time() + self.usage_wait)

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result, or the error of the limit in force when it runs out first.

        Like ``asyncio.timeout_at(self.deadline)``, but with one timer for the whole stream instead
        of one per chunk: the deadline moves on with every chunk, and the timer, when it fires
        before the current deadline, sleeps again until it (docs/benchmarks.md has the figures)."""
        task = asyncio.current_task()
        assert task is not None, "TimeLimits.wait runs in a task"
        cancelling = task.cancelling()
        self._task, self.waiting = task, True
        if self._timer is None or self._timer_at > self.deadline:
            self._arm(self.deadline)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self._fired and self._take_back(task) <= cancelling:  # our cancellation, not the caller's
                raise self.error() from None
            raise
        finally:
            if self._fired:  # the timer fired, yet the wait ended another way: take its cancel back
                self._take_back(task)
            self.waiting, self._task = False, None

    def _take_back(self, task: asyncio.Task) -> int:
        self._fired = False
        return task.uncancel()

    def cut(self, error: ApiError) -> None:
        """The stream ends now, with ``error`` (see the class docstring): its limits run out at once."""
        self._cut = error
        self.total_at = self.deadline = self.loop.time()
        if self._task is not None and not self._fired:
            self._fired = True
            self._task.cancel()  # taken back by ``wait``, as the timer's

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._task is None:  # not waiting (parked at a yield): the next wait arms the timer again
            if self._parked is not None:  # ...and at the total limit ``on_total``'s callback is due
                if self.loop.time() < self.total_at:
                    self._arm(self.total_at)
                else:
                    callback, self._parked = self._parked, None
                    callback()
            return
        if self.loop.time() < self.deadline:
            self._arm(self.deadline)  # the deadline moved on since the timer was set
            return
        self._fired = True
        self._task.cancel()

    def close(self) -> None:
        """The stream is over: drop the timer (it holds the last waiting task until it fires)."""
        self._parked = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_total(self, callback: Callable[[], None]) -> None:
        """``callback`` at the total limit if the stream is not inside ``wait`` then (a wait ends by
        itself), once, until ``close``: through the stream's one timer, not one more per stream."""
        self._parked = callback
        if self._timer is None:
            self._arm(self.total_at)


# --- the relay --------------------------------------------------------------------------------


class _Current:
    """The upstream stream an answer is being read from (a continuation replaces it)."""

    __slots__ = ("stream",)

    def __init__(self) -> None:
        self.stream: UpstreamChunks | None = None


async def relay(
    upstream: Upstream,
    path: str,
    params: dict,
    protocol: StreamProtocol,
    limits: TimeLimits,
    record: StreamRecord,
    ends: Ends,
    continuation: Continuation | None = None,
) -> AsyncGenerator[Event]:
    """The events of one streamed call: ``upstream.open`` up to the first output, then each chunk
    through ``protocol`` (and, with a ``continuation``, on other streams after a failure mid-answer),
    then exactly one ``Done`` or ``Failed``, its upstream closed before it goes out; ``ends`` told of
    each end (``Ends``). One generator: every layer between the upstream and the caller costs every
    delta."""
    ends.begin()
    current = _Current()
    final: Done | Failed | None = None
    try:
        try:
            stream = current.stream = await limits.wait(upstream.open(path, params, protocol, limits, record))
            limits.on_total(functools.partial(_close_parked, current, limits))
            chunks = aiter(stream)
            mend, saw = continuation.hands() if continuation is not None else (None, None)
            plain = protocol.plain
            held: list[Chunk] = []  # chunks before the first output
            ready: Chunk | None = None  # the last chunk made, kept until we know whether another follows at once
            parked = False  # parked at a yield since the last chunk: the caller may have read slowly
            try:
                while not protocol.done:
                    if ready is not None and (not stream.ready or protocol.feed_waits):  # what comes next may wait
                        yield ready
                        ready = None
                        parked = True
                    try:
                        raw = await limits.wait(anext(chunks))
                    except (StopAsyncIteration, ApiError) as exc:  # ApiError: the upstream's (failover.py), a limit
                        if parked:  # past the total limit while parked: that is the failure (check_total)
                            limits.check_total()
                        if isinstance(exc, ApiError):
                            failure = exc
                        elif protocol.finished:  # a choice never finished but the stream ended cleanly
                            break
                        else:
                            failure = incomplete()
                        if continuation is None or not limits.output_started or not continuation.may_continue(failure):
                            raise failure from None
                        if ready is not None:  # what is in hand goes out before the wait for the next stream
                            yield ready
                            ready = None
                        stream = await _reopen(current, continuation, failure, limits)
                        chunks = aiter(stream)
                        mend, saw = continuation.hands()
                        continue
                    # The total limit (buffered chunks arrive without a wait, and the caller may have read
                    # slowly while we were parked at yield), the idle one from now.
                    limits.got_chunk()
                    parked = False
                    for data in mend(raw) if mend is not None else (raw,):
                        fed = plain(data) if plain is not None else None  # no coroutine for the common chunk
                        if fed is None:
                            fed = await protocol.feed(data)
                        if saw is not None:
                            saw(data, fed)  # after the protocol: what it read of the chunk (read once)
                        if fed is NOTHING:
                            continue
                        if record.first_delta_at is None:
                            if not fed.output:
                                held.append(fed)
                                continue
                            record.first_output()
                            limits.got_output()
                            for early in held:
                                early.more = True
                                yield early
                        if fed.delta:
                            record.deltas += 1
                        if ready is not None:
                            ready.more = True
                            yield ready
                        ready = fed
            except Exception:
                if ready is not None:  # what was made before the failure still goes out, then the error
                    yield ready
                raise
            if ready is not None:
                yield ready
            assert current.stream is not None
            await _read_rest(aiter(current.stream), protocol, limits, continuation)
            # The answer is complete: the upstream is closed now, not shielded (a shield costs ~3.5 µs a
            # stream). A cancel or a failure during this close leaves ``current.stream`` set: the
            # shielded close below does it, as it did every close before.
            try:
                await current.stream.close()
                current.stream = None
            except Exception:  # noqa: BLE001 - see above
                pass
            done = protocol.summary()
            if continuation is not None:
                done = continuation.summary(done)
            record.ended(done.finish_reason, done.usage)
            final = done
        except Exception as exc:  # noqa: BLE001 - every failure becomes the one final event
            final = Failed(_failure(exc, record))
        finally:
            if final is None:
                record.hung_up()
            limits.close()
            if current.stream is not None:
                # Shielded: when the caller hung up we run inside a cancelled scope, and the upstream
                # connection must still be closed (that is what stops the paid generation).
                with anyio.CancelScope(shield=True):
                    try:
                        await current.stream.close()
                    except Exception:  # the final event goes out all the same (it did before the close)
                        log.exception("closing the upstream stream failed (endpoint=%s)", record.endpoint)
        assert final is not None  # else what ended the stream goes on up from the finally above
        await ends.last(final)
        yield final
    finally:
        ends.over()


async def _reopen(
    current: _Current, continuation: Continuation, failure: ApiError, limits: TimeLimits
) -> UpstreamChunks:
    """The stream the answer goes on from after ``failure``; when none could be had, ``failure``
    ends the answer (or the total limit, or the drain's cut, when that is what ended the wait)."""
    failed, current.stream = current.stream, None
    if failed is not None:
        with anyio.CancelScope(shield=True):
            await failed.close()  # a stalled stream still generates: stop it
    limits.continuing()
    try:
        stream = await limits.wait(continuation.reopen(failure, limits))
    except ApiError as exc:
        # the total limit, or the drain's cut (TimeLimits.cut), ends it as itself
        raise (exc if exc.type in (ErrorKind.TOTAL_TIMEOUT, ErrorKind.INSTANCE_DRAINING) else failure) from None
    current.stream = stream
    limits.got_output()
    return stream


async def _read_rest(
    chunks: AsyncIterator[dict], protocol: StreamProtocol, limits: TimeLimits, continuation: Continuation | None
) -> None:
    """After the answer is complete, read on briefly for what follows it (the usage), and to the end
    of the body so the connection can be reused. Missing it is not a failure."""
    limits.finishing()
    try:
        async with asyncio.timeout_at(limits.deadline):
            async for data in chunks:
                protocol.note(data)
                if continuation is not None:
                    continuation.note(data)
    except (TimeoutError, ApiError):  # a timeout, an error event or a broken connection after the answer
        pass


_closing: set[asyncio.Future] = set()


def _close_parked(current: _Current, limits: TimeLimits) -> None:
    """At the total limit: a stream parked behind a caller who stopped reading is not waiting on the
    upstream (that wait would expire by itself), so close the upstream now; the core reports the
    limit when the caller reads again."""
    if not limits.waiting and current.stream is not None:
        task = asyncio.ensure_future(current.stream.close())
        _closing.add(task)  # keep a reference until it is done (the loop holds only a weak one)
        task.add_done_callback(_closing.discard)


def _failure(exc: Exception, record: StreamRecord) -> ApiError:
    """The upstream explains its own failures as ApiErrors (upstreams/failover.py); anything else
    is a bug of ours."""
    if isinstance(exc, ApiError):
        error = exc
    else:
        log.exception("chat stream failed (endpoint=%s)", record.endpoint)
        error = internal_error()
    record.failed(error.type)
    return error


async def encoded(
    first: Event,
    events: AsyncIterator[Event],
    encode: Callable[[Event], bytes | None],
    ended: Callable[[int], Awaitable[None]] | None = None,
) -> AsyncGenerator[bytes]:
    """``first`` and then ``events`` up to the final one, encoded: one piece of bytes per write, the
    chunks marked ``more`` joined with the events that follow them. ``ended``: awaited with the bytes
    written when it ends, however it ends. After the final event is written, ``events`` is read once
    more, to its end (a relay's is its ``finally``: the record's end), so that ``ended`` finds it over
    and has no close to shield (~3% of a short stream's CPU)."""
    pending: list[bytes] = []  # the encoded events of chunks marked ``more``, not written yet
    event = first
    written = 0
    try:
        while True:
            data = encode(event)
            if type(event) is not Chunk:  # the final event: the rest goes out with it
                if data:
                    pending.append(data)
                if pending:
                    data = b"".join(pending)
                    written += len(data)
                    yield data
                await anext(events, None)  # the end of the events (nothing follows the final one)
                return
            if event.more:
                if data:
                    pending.append(data)
            elif pending:
                if data:
                    pending.append(data)
                data = b"".join(pending)
                pending = []
                written += len(data)
                yield data
            elif data:  # the usual delta: its own write
                written += len(data)
                yield data
            try:
                event = await anext(events)
            except StopAsyncIteration:
                if pending:
                    data = b"".join(pending)
                    written += len(data)
                    yield data
                return
    finally:
        if ended is not None:
            await ended(written)
