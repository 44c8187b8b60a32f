"""chatstream/limits.py: which limit is in force in each phase of a stream, which error it raises, and
``wait``/``check_total``/``on_total`` on a real asyncio loop with tiny limits."""

from __future__ import annotations

import asyncio
import time

import pytest

from chatstream.errors import TimeLimit, first_token_expired, idle_expired, total_expired
from chatstream.settings import Settings
from chatstream.stream import TimeLimits

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time


def settings(first=1.0, idle=0.5, total=10.0, usage_wait=0.25) -> Settings:
    return Settings.model_validate(
        {
            "FIRST_TOKEN_TIMEOUT_SECONDS": first,
            "IDLE_TIMEOUT_SECONDS": idle,
            "TOTAL_TIMEOUT_SECONDS": total,
            "USAGE_WAIT_SECONDS": usage_wait,
        }
    )


class Clock:
    """A loop stand-in for the deadline arithmetic: only ``time()`` is read."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def time(self) -> float:
        return self.now


def test_the_three_errors():
    for error, kind, retryable in (
        (first_token_expired(), "upstream_timeout", True),
        (idle_expired(), "upstream_timeout", True),
        (total_expired(), "total_timeout", False),
    ):  # the same request would hit it again
        assert isinstance(error, TimeLimit)
        assert (error.status, error.type, error.retryable) == (504, kind, retryable)
    assert first_token_expired().message == "no first token within the time limit"
    assert idle_expired().message == "the model stopped sending within the idle limit"
    assert total_expired().message == "the stream hit its total time limit"


# --------------------------------------------------------------------------- the deadline by phase


def test_before_output_the_first_token_limit_is_in_force():
    clock = Clock()
    limits = TimeLimits(settings(first=1, total=10), clock)
    assert (limits.deadline, limits.total_at) == (101, 110)
    assert not limits.output_started and not limits.waiting
    assert limits.error().message == first_token_expired().message


def test_before_output_the_error_is_first_token_even_when_total_is_shorter():
    clock = Clock()
    limits = TimeLimits(settings(first=5, total=2), clock)
    assert limits.deadline == limits.total_at == 102
    assert limits.error().type == "upstream_timeout" and limits.error().message == first_token_expired().message


def test_chunks_before_output_do_not_move_the_deadline():
    clock = Clock()
    limits = TimeLimits(settings(first=1, idle=0.5), clock)
    clock.now = 100.5
    limits.got_chunk()
    assert limits.deadline == 101


def test_after_output_the_idle_limit_runs_from_each_chunk():
    clock = Clock()
    limits = TimeLimits(settings(first=1, idle=0.5, total=10), clock)
    clock.now = 100.8
    limits.got_output()
    assert limits.output_started and limits.deadline == pytest.approx(101.3)
    assert limits.error().message == idle_expired().message
    clock.now = 102.0
    limits.got_chunk()
    assert limits.deadline == pytest.approx(102.5)


def test_near_the_end_the_total_limit_caps_the_idle_one_and_names_itself():
    clock = Clock()
    limits = TimeLimits(settings(first=1, idle=0.5, total=10), clock)
    limits.got_output()
    clock.now = 109.8
    limits.got_chunk()
    assert limits.deadline == 110
    assert limits.error().type == "total_timeout"


def test_finishing_waits_briefly_for_the_usage_within_the_total():
    clock = Clock()
    limits = TimeLimits(settings(idle=5, usage_wait=0.25, total=10), clock)
    limits.got_output()
    clock.now = 101
    limits.finishing()
    assert limits.deadline == pytest.approx(101.25)
    clock.now = 109.9
    limits.finishing()
    assert limits.deadline == 110


def test_a_zero_usage_wait_is_now():
    clock = Clock()
    limits = TimeLimits(settings(usage_wait=0), clock)
    limits.finishing()
    assert limits.deadline == 100


def test_check_total():
    clock = Clock()
    limits = TimeLimits(settings(total=10), clock)
    clock.now = 109.99
    limits.check_total()
    clock.now = 110
    with pytest.raises(TimeLimit) as info:
        limits.check_total()
    assert info.value.type == "total_timeout"


# ------------------------------------------------------------------------------ on a real loop


async def test_the_running_loop_is_the_default():
    limits = TimeLimits(settings())
    assert limits.loop is asyncio.get_running_loop()


async def test_wait_returns_the_result_and_marks_the_wait():
    limits = TimeLimits(settings())
    seen = []

    async def work():
        seen.append(limits.waiting)
        return 42

    assert await limits.wait(work()) == 42
    assert seen == [True] and not limits.waiting


async def test_wait_passes_other_errors_and_clears_the_mark():
    limits = TimeLimits(settings())

    async def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        await limits.wait(boom())
    assert not limits.waiting


async def test_wait_before_output_raises_first_token():
    limits = TimeLimits(settings(first=0.02))
    with pytest.raises(TimeLimit) as info:
        await limits.wait(asyncio.sleep(5))
    assert info.value.message == first_token_expired().message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert not limits.waiting


async def test_wait_after_output_raises_idle():
    limits = TimeLimits(settings(first=5, idle=0.02))
    limits.got_output()
    with pytest.raises(TimeLimit) as info:
        await limits.wait(asyncio.sleep(5))
    assert info.value.message == idle_expired().message


async def test_wait_at_the_total_raises_total():
    limits = TimeLimits(settings(first=5, idle=5, total=0.03))
    limits.got_output()
    with pytest.raises(TimeLimit) as info:
        await limits.wait(asyncio.sleep(5))
    assert info.value.type == "total_timeout"


async def test_wait_cancels_the_work_it_gave_up_on():
    limits = TimeLimits(settings(first=0.02))
    cancelled = asyncio.Event()

    async def slow():
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeLimit):
        await limits.wait(slow())
    assert cancelled.is_set()


async def test_an_expired_deadline_fails_the_next_wait_at_once():
    limits = TimeLimits(settings(first=0.01))
    await asyncio.sleep(0.03)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeLimit):
        await limits.wait(asyncio.sleep(5))
    assert loop.time() - started < 1


async def test_check_total_on_a_real_loop():
    limits = TimeLimits(settings(total=0.02))
    limits.check_total()
    await asyncio.sleep(0.04)
    with pytest.raises(TimeLimit):
        limits.check_total()


async def test_on_total_calls_back_at_the_total_limit():
    limits = TimeLimits(settings(total=0.03))
    fired = asyncio.Event()
    loop = asyncio.get_running_loop()
    limits.on_total(lambda: fired.set())
    await asyncio.wait_for(fired.wait(), 5)
    assert loop.time() >= limits.total_at


async def test_on_total_waits_out_a_wait_and_the_deadlines_before_the_total_limit():
    """The stream's one timer calls back at the total limit, not at an earlier deadline, nor while
    a wait is in progress (the limit ends that wait itself), and once."""
    limits = TimeLimits(settings(first=0.02, idle=0.02, total=0.12))
    fired: list[float] = []
    loop = asyncio.get_running_loop()
    limits.on_total(lambda: fired.append(loop.time()))
    await limits.wait(asyncio.sleep(0.01))  # within the first-token limit
    limits.got_output()
    await asyncio.sleep(0.05)  # parked past the idle deadline: not the total limit yet
    assert fired == []
    await asyncio.sleep(0.15)
    assert len(fired) == 1 and fired[0] >= limits.total_at


async def test_on_total_ends_with_close():
    limits = TimeLimits(settings(total=0.02))
    fired = []
    limits.on_total(lambda: fired.append(1))
    limits.close()
    await asyncio.sleep(0.05)
    assert fired == []


# One timer per stream (``wait`` re-arms it instead of a new asyncio.timeout per chunk).


async def test_a_deadline_that_moved_on_is_waited_for_not_the_first_one():
    limits = TimeLimits(settings(first=5, idle=0.2))
    limits.got_output()
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(4):  # 0.6 s in all, each wait within the idle limit: the first timer fires mid-way
        await limits.wait(asyncio.sleep(0.15))
        limits.got_chunk()
    with pytest.raises(TimeLimit) as info:
        await limits.wait(asyncio.sleep(5))
    assert info.value.message == idle_expired().message
    assert 0.75 <= loop.time() - started < 2.0


async def test_a_deadline_moved_earlier_is_armed_again():
    limits = TimeLimits(settings(first=5, idle=0.05))
    await limits.wait(asyncio.sleep(0))  # the timer is set for the first-token limit, 5 s away
    limits.got_output()  # now the idle limit: 0.05 s
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeLimit):
        await limits.wait(asyncio.sleep(5))
    assert loop.time() - started < 1


async def test_the_caller_cancelling_a_wait_is_not_a_time_limit():
    limits = TimeLimits(settings(first=0.2))
    task = asyncio.ensure_future(limits.wait(asyncio.sleep(5)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.3)  # the timer fires with nobody waiting: nothing happens
    assert await limits.wait(asyncio.sleep(0, "next")) == "next"


@pytest.mark.parametrize("limit_first", [True, False])
async def test_a_cancellation_racing_the_limit_stays_a_cancellation(limit_first):
    limits = TimeLimits(settings(first=0.05))
    task = asyncio.ensure_future(limits.wait(asyncio.sleep(5)))
    await asyncio.sleep(0.01)
    time.sleep(0.06)  # the limit is due, but the loop cannot run its timer yet
    if limit_first:
        limits._fire()  # the timer's callback, then the caller's cancel, before the task runs again
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_close_drops_the_timer():
    limits = TimeLimits(settings(first=5))
    await limits.wait(asyncio.sleep(0))
    assert limits._timer is not None
    limits.close()
    assert limits._timer is None
    limits.close()  # twice is fine
