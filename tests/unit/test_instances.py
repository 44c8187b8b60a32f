"""chatstream/state/instances.py on the in-process store: beats, liveness by the store's clock,
fencing a slow instance, one duty holder, takeover of the dead."""

from __future__ import annotations

import asyncio
import time

import pytest
from memory_store import Fault, MemoryData, MemoryStore

from chatstream.state.instances import Instances, InstanceTiming
from chatstream.state.store import StoreClock

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time

FAST = InstanceTiming(beat_seconds=0.05, lease_seconds=0.3, duty_seconds=0.05, fresh_seconds=0.0)


def instance(data: MemoryData, skew: float = 0.0, timing: InstanceTiming = FAST, recover=None, sweeps=()) -> Instances:
    clock = StoreClock(wall=lambda: time.time() + skew)
    return Instances(MemoryStore(data, clock), timing, recover=recover, sweeps=sweeps)


async def test_a_serving_instance_beats_and_the_others_see_it_alive():
    data = MemoryData()
    a, b = instance(data), instance(data)
    a.serve()
    await a.first_beat()
    assert await b.alive(a.id)
    assert not await b.alive("nobody-1-0")
    await a.close()
    assert not await b.alive(a.id)  # it left: its row went with it
    await b.close()


async def test_a_dead_instance_is_taken_over_once_and_its_row_goes():
    data = MemoryData()
    taken: list[tuple[str, str]] = []
    a = instance(data)
    b, c = (instance(data, recover=lambda dead, taker: _note(taken, taker, dead)) for _ in range(2))
    for watcher in (b, c):
        watcher.serve()
    a.serve()
    await a.first_beat()
    a._beating.cancel()  # killed: no more beats, no goodbye
    dead = a.id
    deadline = time.monotonic() + 3
    while not taken and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    assert [d for _, d in taken] == [dead], taken  # exactly one holder took it over, once
    assert not await b.alive(dead)
    assert data.tables["chatstreamStreams"]["instances"].get(dead) is None
    for x in (a, b, c):
        await x.close()


async def test_a_slow_instance_declared_dead_is_fenced_and_goes_on_under_a_new_id(caplog):
    data = MemoryData()
    taken: list[tuple[str, str]] = []
    a, b = instance(data), instance(data, recover=lambda dead, taker: _note(taken, taker, dead))
    b.serve()
    a.serve()
    await a.first_beat()
    old = a.id
    a._beating.cancel()  # frozen, as a process stopped by the OS
    rows = data.tables["chatstreamStreams"]["instances"]
    deadline = time.monotonic() + 3
    while (not taken or old in rows) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert taken == [(b.id, old)] and old not in rows  # taken over, its row gone
    a._beating = None  # it wakes up
    a.serve()
    await asyncio.wait_for(a.fenced.wait(), 2)
    fenced = [r for r in caplog.records if r.getMessage().startswith(f"instance {old} was declared dead elsewhere")]
    assert len(fenced) == 1 and a.id != old
    await asyncio.sleep(0.1)
    assert await b.alive(a.id)
    await a.close()
    await b.close()


async def test_clocks_thirty_seconds_apart_agree_on_who_is_alive():
    data = MemoryData()
    ahead, behind = instance(data, skew=30.0), instance(data, skew=-30.0)
    ahead.serve()
    behind.serve()
    await ahead.first_beat()
    await behind.first_beat()
    await asyncio.sleep(0.2)
    assert await behind.alive(ahead.id) and await ahead.alive(behind.id)
    assert abs(ahead.store.clock.now() - behind.store.clock.now()) < 1.5
    await ahead.close()
    await behind.close()


async def test_sweeps_run_on_one_instance_however_many_there_are():
    data = MemoryData()
    runs: list[str] = []
    many = [instance(data, sweeps=[(0.0, lambda i=i: _note(runs, i, "sweep"))]) for i in range(6)]
    for x in many:
        x.serve()
    await asyncio.sleep(0.6)
    assert runs and len({who for who, _ in runs}) == 1
    reads = data.calls.get("get", 0)
    for x in many:
        await x.close()
    assert reads < 6 * 0.6 / 0.05 * 2  # a point read of the duty row per tick each, not a scan


async def _note(into: list, who: str, what: str) -> None:
    into.append((who, what))


async def test_a_dead_duty_holder_is_replaced_within_a_lease_and_a_tick_and_taken_over():
    """The duty holder itself dies (it beat: it held something). Another instance takes the duty as
    soon as the holder's row is past its lease, not after 3 of the duty's ticks, and takes the dead
    holder over. (Here a tick is 1 s and the lease 0.3 s: before, the duty stayed with the dead
    holder for 3 s.)"""
    timing = InstanceTiming(beat_seconds=0.05, lease_seconds=0.3, duty_seconds=1.0, fresh_seconds=0)
    data = MemoryData()
    a = instance(data, timing=timing)
    a.serve()
    await a.first_beat()
    await asyncio.sleep(0.1)  # a's duty tick: it holds the duty
    assert data.tables["chatstreamStreams"]["instances"]["~duty"][0]["holder"] == a.id
    taken: list[str] = []
    b = instance(data, timing=timing, recover=lambda dead, taker: _note(taken, taker, dead))
    b.serve()
    await asyncio.sleep(0.1)
    for task in (a._beating, a._duty):
        task.cancel()  # killed
    killed = time.monotonic()
    while not taken and time.monotonic() - killed < 5:
        await asyncio.sleep(0.02)
    assert taken == [(b.id, a.id)] and time.monotonic() - killed < 0.3 + 1.0 + 0.5, (taken, time.monotonic() - killed)
    assert data.tables["chatstreamStreams"]["instances"]["~duty"][0]["holder"] == b.id
    await b.close()
    await a.close(leave=False)


async def test_a_duty_holder_whose_duty_failed_does_it_at_its_next_tick():
    """The duty's work fails once (the store does not answer its query of the instances): the holder
    keeps the duty and does it at its next tick, not 3 ticks later, when a duty row nobody refreshed
    would be free again."""
    timing = InstanceTiming(beat_seconds=0.05, lease_seconds=0.3, duty_seconds=1.0, fresh_seconds=0)
    data = MemoryData()
    runs: list[tuple[str, str]] = []
    a = instance(data, timing=timing, sweeps=[(0.0, lambda: _note(runs, "a", "sweep"))])
    a.store.inject(Fault("unavailable", frozenset({"query"})))
    a.serve()
    await asyncio.sleep(1.5)  # the first tick's duty failed; the second's ran
    assert runs == [("a", "sweep")], runs
    await a.close()
