"""A clock that skips the time a test spends with nothing to do (the ``skips_idle_time`` marker of
tests/unit): while such a test runs on ``IdleSkippingLoop``, a wait for a timer with nothing else
ready (no callback, no I/O) ends at once, and the loop's time, ``time.monotonic()`` and
``time.time()`` move on by what was skipped. Work still takes its real time; only idleness is free,
so timers, deadlines, leases and time limits fire in the order real time gives them, without
waiting for them. A wait with no timer at all (for I/O or another thread only) blocks as usual, and
nothing is skipped while a call of ``run_in_executor`` (``asyncio.to_thread``) runs; a test that
waits on a socket, a process or a thread of its own (anyio's, Starlette's sync endpoints) while a
timer runs must not be marked.

Imported before anything imports chatstream (tests/conftest.py first, tests/unit/conftest.py), so
that defaults bound at import (``StoreClock(wall=time.time, monotonic=time.monotonic)``,
``MemoryData.wall``) read it too. Outside such a test ``time.time()`` is the real clock and
``time.monotonic()`` the real one plus what earlier tests skipped (it never goes back)."""

from __future__ import annotations

import asyncio
import sys
import time

assert "chatstream" not in sys.modules, "tests/idle_clock.py must be imported before chatstream"

_monotonic = time.monotonic
_time = time.time
_skipped = 0.0  # seconds skipped by every skipping loop so far
_wall_from: float | None = None  # _skipped when the running skipping loop started (None: none runs)


def monotonic() -> float:
    return _monotonic() + _skipped


def wall() -> float:
    return _time() if _wall_from is None else _time() + (_skipped - _wall_from)


time.monotonic = monotonic
time.time = wall


class IdleSkippingLoop(asyncio.SelectorEventLoop):
    """An event loop whose waits for a timer are skipped when nothing else is ready (one at a time)."""

    def __init__(self) -> None:
        global _wall_from
        super().__init__()
        assert _wall_from is None, "one skipping loop at a time"
        _wall_from = _skipped
        self._in_threads = 0  # run_in_executor calls not done: their thread works, the loop is not idle
        select = self._selector.select  # type: ignore[attr-defined]

        def skipping(timeout: float | None = None):
            global _skipped
            if timeout is None or timeout <= 0 or self._in_threads:
                return select(timeout)
            events = select(0)
            if not events:
                _skipped += timeout
            return events

        self._selector.select = skipping  # type: ignore[attr-defined]

    def time(self) -> float:
        return monotonic()

    def run_in_executor(self, executor, func, *args):
        future = super().run_in_executor(executor, func, *args)
        self._in_threads += 1

        def done(_: asyncio.Future) -> None:
            self._in_threads -= 1

        future.add_done_callback(done)
        return future

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:
        self._in_threads += 1  # a thread joins the executor's threads meanwhile
        try:
            await super().shutdown_default_executor(timeout)
        finally:
            self._in_threads -= 1

    def close(self) -> None:
        global _wall_from
        super().close()
        _wall_from = None


def run(coro):
    """``asyncio.run(coro)`` on an IdleSkippingLoop (a sync test that runs a loop of its own)."""
    with asyncio.Runner(loop_factory=IdleSkippingLoop) as runner:
        return runner.run(coro)
