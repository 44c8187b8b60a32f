"""The time limits of one stream, and which error each one raises.

- first token: from the request until the first output (``FIRST_TOKEN_TIMEOUT_SECONDS``);
- idle: between two upstream chunks once output has started (``IDLE_TIMEOUT_SECONDS``);
- total: the whole stream, however slowly the caller reads (``TOTAL_TIMEOUT_SECONDS``).

Every wait on the upstream goes through ``wait``, bounded by the limit in force, with one timer per
stream (see ``wait``). The total limit is also checked on every chunk (chunks already buffered
arrive without a wait), and the stream core arms ``on_total`` so that a stream parked behind a
caller who stopped reading is closed at the limit all the same."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .errors import TimeLimit
from .settings import Settings

T = TypeVar("T")


def first_token_expired() -> TimeLimit:
    return TimeLimit("upstream_timeout", "no first token within the time limit")


def idle_expired() -> TimeLimit:
    return TimeLimit("upstream_timeout", "the model stopped sending within the idle limit")


def total_expired() -> TimeLimit:
    # Not retryable: the same request would hit the same limit again, generating (and paying) as long.
    return TimeLimit("total_timeout", "the stream hit its total time limit", retryable=False)


class TimeLimits:
    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop or asyncio.get_running_loop()
        now = self.loop.time()
        self.total_at = now + settings.total_timeout
        self.deadline = min(self.total_at, now + settings.first_token_timeout)
        self.idle = settings.idle_timeout
        self.usage_wait = settings.usage_wait
        self.output_started = False
        self.waiting = False  # inside ``wait``: the limit in force ends that wait by itself
        self._task: asyncio.Task | None = None  # the task inside ``wait``
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._fired = False  # the timer cancelled the waiting task

    def error(self) -> TimeLimit:
        """The error for the limit in force now."""
        if not self.output_started:
            return first_token_expired()
        return total_expired() if self.deadline >= self.total_at else idle_expired()

    def check_total(self) -> None:
        if self.loop.time() >= self.total_at:
            raise total_expired()

    def got_output(self) -> None:
        """Output went to the caller: from now on the idle limit runs between chunks."""
        self.output_started = True
        self.deadline = min(self.total_at, self.loop.time() + self.idle)

    def got_chunk(self) -> None:
        """A chunk came from the upstream (whether or not anything of it is forwarded)."""
        if self.output_started:
            self.deadline = min(self.total_at, self.loop.time() + self.idle)

    def finishing(self) -> None:
        """Every choice has finished: only the usage is still awaited, briefly."""
        self.deadline = min(self.total_at, self.loop.time() + self.usage_wait)

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result, or the error of the limit in force when it runs out first.

        Like ``asyncio.timeout_at(self.deadline)``, but with one timer for the whole stream instead
        of one per chunk: the deadline moves on with every chunk, and the timer, when it fires
        before the current deadline, sleeps again until it. Per chunk that is two attribute writes
        instead of a timer handle pushed into and cancelled from the loop's heap (measured: ~3% of
        the worker's CPU at 100 streams)."""
        task = asyncio.current_task()
        cancelling = task.cancelling()
        self._task, self.waiting = task, True
        if self._timer is None or self._timer_at > self.deadline:
            self._arm()
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

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = self.deadline
        self._timer = self.loop.call_at(self.deadline, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._task is None:
            return  # not waiting: the next wait arms the timer again
        if self.loop.time() < self.deadline:
            self._arm()  # the deadline moved on since the timer was set
            return
        self._fired = True
        self._task.cancel()

    def close(self) -> None:
        """The stream is over: drop the timer (it holds the last waiting task until it fires)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_total(self, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_at(self.total_at, callback)
