"""The instance's end, as its streams see it: serving, then draining on SIGTERM, then gone.

What Azure does (sources in tools/devhost/README.md, "Stopping"): a scale-in or a rolling update
drains an instance without telling the app (the front end sends it no new request; the host waits
for the requests in flight, HTTP ones up to 230 s). A restart, or a deploy that recreates the
instances, sends SIGTERM: the Functions host stops accepting at once, gives the requests in flight
its shutdown timeout (``ASPNETCORE_SHUTDOWNTIMEOUTSECONDS``, 5 s by default), cuts what is left
and kills the worker (SIGKILL: the Python worker is sent no ``WorkerTerminate``); the container
stop also sends the worker process SIGTERM, and that is the signal this module acts on. Neither
the runtime nor the ``azure-functions`` library offers the app a shutdown hook.

On SIGTERM the instance drains (``Lifecycle.drain``):

1. ``draining`` is set: a new request to a model route gets ``503`` ``instance_draining``
   (retryable, ``Retry-After: 1``, ``x-should-retry: true``) before any upstream call; the
   ``on_draining`` callbacks run at once: the readers of resumable streams served here end with
   ``stream_moved`` now, not at the grace's end: they have nothing to finish here (their stream is
   stored, or its producer here stores it for a reader elsewhere), and every second they stay is
   their client's, cut by the host at its timeout (a SIGKILL would cut them at once);
2. the streams running here, resumable or not (and the requests admitted whose stream has not
   started yet: ``starting``), go on for the grace: ``DRAIN_SECONDS``, but never
   past the host's shutdown timeout less ``AFTER_GRACE`` (what follows needs that long, and the
   host cuts at its timeout whatever the app does); a stream that ends within it ends as usual;
3. then every stream still running that is not resumable ends with one final ``instance_draining``
   error event in its route's format (``retryable: true``), its upstream closed and its record (log
   line, charge) written as usual; resumable streams are left to the ``on_drain`` callbacks (the
   hand-over: their live callers get ``stream_moved`` and resume elsewhere; one not handed over in
   time is taken over as after a crash);
4. the ``on_drain`` callbacks are awaited together, bounded (``CALLBACKS_WAIT``): the hand-over of
   resumable streams and the settling of charges belong there. Work ``kept`` (``Lifecycle.keep``: a
   charge nobody else can make) is waited for before them: within the grace as a stream is, then
   told the grace is over (``grace_over``) and given ``CUT_WAIT`` to finish with what it has. The
   last stream's final event waits for the callbacks: the host kills the worker as soon as its last
   request is over;
5. the ``closing`` callbacks (``ChatApp.close``: upstream clients, stores), then the signal goes on
   to the handler that was there before: the runtime's (its HTTP server stops, and the process ends
   by SIGTERM, as without the app's drain).

The handler is chained in front of the runtime's at the first request (``admit``): the runtime's
HTTP server installs its own when it starts serving, after the app is imported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import FrameType

from .errors import ErrorKind, instance_draining
from .record import StreamRecord
from .stream import Ends, Event, Failed, TimeLimits

log = logging.getLogger("chatstream")

HOST_SHUTDOWN_TIMEOUT = "ASPNETCORE_SHUTDOWNTIMEOUTSECONDS"  # the Functions host's, read as it reads it
HOST_DEFAULT_SHUTDOWN = 5.0  # ASP.NET Core's web host default, which the Functions host keeps
AFTER_GRACE = 1.5  # of the host's timeout, kept for what follows the grace (the waits below, and margin)
CUT_WAIT = 0.5  # the cut streams reach their final event (upstream closed, record written), kept work ends
CALLBACKS_WAIT = 0.75  # the on_drain callbacks, together
CLOSE_WAIT = 0.5  # the closing callbacks, together

Callback = Callable[[], Awaitable[object]]  # what it answers is not read


def host_shutdown_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """The seconds the Functions host gives requests after SIGTERM: ``ASPNETCORE_SHUTDOWNTIMEOUTSECONDS``
    when it is a whole number (what the host accepts), else its default, 5."""
    raw = environ.get(HOST_SHUTDOWN_TIMEOUT, "").strip()
    return float(raw) if raw.isascii() and raw.isdigit() else HOST_DEFAULT_SHUTDOWN


class Stream(Ends):
    """One stream running on this instance, as the drain sees it: its ends (``Ends``), its time
    limits (``limits``, which the drain cuts). It counts for the drain from its relay's first read
    on: one closed before that (its handler cancelled first) never ran, so nothing would take it back."""

    __slots__ = ("cut", "ending", "life", "limits", "record")

    def __init__(
        self,
        life: Lifecycle,
        record: StreamRecord,
        limits: TimeLimits,
        on_end: Callable[[], None],
        before_last: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(on_end, before_last)
        self.life = life
        self.record = record
        self.limits = limits
        self.cut = False  # the grace is over: it ends now, with instance_draining
        self.ending = False  # its final event is in hand

    def begin(self) -> None:
        self.life._streams.add(self)
        self.life._changed.set()

    async def last(self, event: Event) -> None:
        if not (self.cut and type(event) is Failed):  # (a stream cut keeps no context: it failed)
            await super().last(event)
        if self.life._holds(self):
            self.end()  # the stream's record (log line, charge) is written now
            await self.life._wait_settled()

    def over(self) -> None:
        self.life._streams.discard(self)
        self.life._changed.set()
        self.end()

    @property
    def resumable(self) -> bool:
        """A resumable stream (it has an id): handed over at a drain, never cut here."""
        return self.record.stream_id is not None

    def cut_now(self) -> None:
        """Through the stream's own time limits (``TimeLimits.cut``): its wait on the upstream ends
        now (or its next one, or its next chunk), and the stream core ends it with the one final
        ``instance_draining``, its upstream closed, as when a limit runs out. Nothing per delta."""
        self.cut = True
        self.record.drained(ErrorKind.INSTANCE_DRAINING)
        self.limits.cut(instance_draining())


class Lifecycle:
    """See the module docstring: ``grace`` is step 2's, ``on_draining`` step 1's callbacks,
    ``on_drain`` step 4's, ``closing`` step 5's. ``signals=False``: SIGTERM is not watched
    (in-process tests start the drain with ``drain()``)."""

    def __init__(
        self,
        drain_seconds: float,
        host_timeout: float = HOST_DEFAULT_SHUTDOWN,
        *,
        on_drain: Sequence[Callback] = (),
        closing: Sequence[Callback] = (),
        on_draining: Sequence[Callable[[], None]] = (),
        signals: bool = True,
    ):
        self.grace = max(0.0, min(drain_seconds, host_timeout - AFTER_GRACE))
        self.signals = signals
        self.draining = asyncio.Event()
        self.drained = asyncio.Event()  # the drain is over (its callbacks awaited, the app closed)
        self._streams: set[Stream] = set()
        self._on_drain: list[Callback] = list(on_drain)
        self._closing: list[Callback] = list(closing)
        self._on_draining = list(on_draining)
        self.grace_over = asyncio.Event()  # kept work finishes now, with what it has
        self._kept: set[asyncio.Future] = set()
        self._starting = 0  # requests admitted whose stream is not running yet (``starting``)
        self._changed = asyncio.Event()  # a stream started, ended or has its final event in hand, kept work ended
        self._settled = asyncio.Event()  # the on_drain callbacks are done
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._installed = False
        self._signalled = False
        self._passed_on = False
        self._previous: object = None  # the SIGTERM handler before ours

    # --- the request path -----------------------------------------------------------------------

    def admit(self) -> None:
        """A request begins: from the first one on, SIGTERM starts the drain (``install``); while
        draining, a new request is refused with ``instance_draining`` (an ApiError)."""
        if not self._installed:
            self.install()
        if self.draining.is_set():
            raise instance_draining()

    def starting(self) -> Lifecycle:
        """A request, from before ``admit`` until its stream runs (its relay's first read: ``Stream``)
        or it is answered: the drain waits for it within the grace as for a stream. (Chaos seed 97:
        two requests admitted as SIGTERM came reached their upstream after the two streams then
        running had ended; the drain, seeing none, closed the app under them: upstream_timeout.)
        The lifecycle itself is the context manager (it only counts), not a generator and its wrapper
        per request: two objects fewer for the garbage collector to walk while a request waits."""
        return self

    def __enter__(self) -> None:
        self._starting += 1

    def __exit__(self, *exc: object) -> None:
        self._starting -= 1
        self._changed.set()

    def keep(self, work: asyncio.Future) -> None:
        """Work this instance must finish before it goes (a charge nobody else can make): waited
        for as the module docstring's step 4 says; whatever it does past that is cut with the
        process: it says so itself."""
        if work.done():
            return
        self._kept.add(work)
        work.add_done_callback(self._unkeep)

    def _unkeep(self, work: asyncio.Future) -> None:
        self._kept.discard(work)
        self._changed.set()

    def _holds(self, stream: Stream) -> bool:
        """A stream's final event is in hand: whether it waits for the ``on_drain`` callbacks (step
        4): while draining, the last stream running does once its output has started (then no status
        answer follows the final event, so its record may be written before it goes out)."""
        stream.ending = True
        self._changed.set()
        if not self.draining.is_set() or stream.resumable or stream.record.first_delta_at is None:
            return False
        return self._cut_ending()

    async def _wait_settled(self) -> None:
        try:
            async with asyncio.timeout(AFTER_GRACE):
                await self._settled.wait()
        except TimeoutError:
            pass

    # --- the signal -----------------------------------------------------------------------------

    def install(self) -> None:
        """Chain a SIGTERM handler in front of the one in place (the runtime's). Only from the main
        thread, where signal handlers live; idempotent."""
        if self._installed or not self.signals or threading.current_thread() is not threading.main_thread():
            self._installed = True
            return
        self._installed = True
        self._loop = asyncio.get_running_loop()
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signalled:  # a second SIGTERM: the runtime's own handling, at once
            self._pass_on(signum, frame)
            return
        self._signalled = True
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.drain)

    def _pass_on(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """The signal to the handler that was there before ours (once), as if ours had never been."""
        if self._passed_on:
            return
        self._passed_on = True
        previous = self._previous
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)  # type: ignore[arg-type]
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.raise_signal(signal.SIGTERM)  # the default action: the process ends

    # --- the drain ------------------------------------------------------------------------------

    def drain(self) -> asyncio.Task:
        """Start draining (once; on SIGTERM, or directly); the task ends when the drain is over."""
        if self._task is None:
            self.draining.set()
            for callback in self._on_draining:
                try:
                    callback()
                except Exception:
                    log.exception("drain: an on_draining callback failed")
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return self._task

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        log.warning(
            "draining: %d stream(s) running get %.1f s (DRAIN_SECONDS, within the host's %s)",
            len(self._streams),
            self.grace,
            HOST_SHUTDOWN_TIMEOUT,
        )
        # Resumable streams too (they may end here), and the kept work.
        await self._until(
            lambda: all(s.ending for s in self._streams) and not self._kept and not self._starting, started + self.grace
        )
        self.grace_over.set()
        cut = [s for s in self._streams if not s.ending and not s.resumable]
        for stream in cut:
            stream.cut_now()
        if cut or self._kept:
            await self._until(lambda: self._cut_ending() and not self._kept, loop.time() + CUT_WAIT)
        await _bounded("on_drain", self._on_drain, CALLBACKS_WAIT)
        self._settled.set()
        await self._until(lambda: not any(not s.resumable for s in self._streams), loop.time() + CUT_WAIT)
        await _bounded("closing", self._closing, CLOSE_WAIT)
        log.warning(
            "drained in %.1f s: %d stream(s) ended instance_draining, %d still running (resumable)",
            loop.time() - started,
            len(cut),
            len(self._streams),
        )
        self.drained.set()
        if self._signalled:
            self._pass_on()

    def _cut_ending(self) -> bool:
        return all(s.ending or s.resumable for s in self._streams)

    async def _until(self, condition: Callable[[], bool], deadline: float) -> None:
        """Wait until ``condition()`` (checked whenever a stream changes), or ``deadline``."""
        try:
            async with asyncio.timeout_at(deadline):
                while not condition():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            pass


async def _bounded(what: str, callbacks: list[Callback], limit: float) -> None:
    """Every callback, together, within ``limit``; a failure or an overrun is logged, never raised."""
    if not callbacks:
        return
    tasks = [asyncio.ensure_future(callback()) for callback in callbacks]
    done, pending = await asyncio.wait(tasks, timeout=limit)
    for task in pending:
        task.cancel()
        log.error("drain: a %s callback did not finish within %.2f s; cancelled", what, limit)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.error("drain: a %s callback failed", what, exc_info=task.exception())
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
