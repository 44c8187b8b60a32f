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


def instance(
    data: MemoryData, skew: float = 0.0, timing: InstanceTiming = FAST, recover=None, sweeps=(), name=None
) -> Instances:
    clock = StoreClock(wall=lambda: time.time() + skew)
    return Instances(MemoryStore(data, clock), timing, name, recover=recover, sweeps=sweeps)


async def test_an_instance_that_needs_it_beats_and_the_others_see_it_alive():
    data = MemoryData()
    a, b = instance(data), instance(data)
    a.need()
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
        watcher.need()
    a.need()
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
    b.need()
    a.need()
    await a.first_beat()
    old = a.id
    a._beating.cancel()  # frozen, as a process stopped by the OS
    rows = data.tables["chatstreamStreams"]["instances"]
    deadline = time.monotonic() + 3
    while (not taken or old in rows) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert taken == [(b.id, old)] and old not in rows  # taken over, its row gone
    a._beating = None  # it wakes up
    a.need()
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
    ahead.need()
    behind.need()
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
        x.need()
    await asyncio.sleep(0.6)
    assert runs and len({who for who, _ in runs}) == 1
    reads = data.calls.get("get", 0) + data.calls.get("query", 0)
    for x in many:
        await x.close()
    assert reads < 6 * 0.6 / 0.05 * 2  # one query of the instances per tick each, no read per instance


async def _note(into: list, who: str, what: str) -> None:
    into.append((who, what))


async def test_a_dead_duty_holder_is_replaced_within_a_lease_and_a_tick_and_taken_over():
    """The duty holder (the lowest live id) dies. The next lowest takes the duty at its first tick
    after the holder's row is past its lease, and takes the dead holder over. (Here a tick is 1 s and
    the lease 0.3 s.)"""
    timing = InstanceTiming(beat_seconds=0.05, lease_seconds=0.3, duty_seconds=1.0, fresh_seconds=0)
    data = MemoryData()
    runs: list[tuple[str, str]] = []
    a = instance(data, timing=timing, sweeps=[(0.0, lambda: _note(runs, "a", "sweep"))], name="a-1")
    a.need()
    await a.first_beat()
    taken: list[str] = []
    sweeps = [(0.0, lambda: _note(runs, "b", "sweep"))]
    b = instance(data, timing=timing, recover=lambda dead, taker: _note(taken, taker, dead), sweeps=sweeps, name="b-1")
    await b.first_beat()
    await asyncio.sleep(1.1)  # each one's tick: a holds the duty
    assert set(runs) == {("a", "sweep")}, runs
    for task in (a._beating, a._duty):
        task.cancel()  # killed
    killed = time.monotonic()
    while not taken and time.monotonic() - killed < 5:
        await asyncio.sleep(0.02)
    assert taken == [(b.id, a.id)] and time.monotonic() - killed < 0.3 + 1.0 + 0.5, (taken, time.monotonic() - killed)
    assert runs[-1] == ("b", "sweep")
    await b.close()
    await a.close(leave=False)


async def test_the_previous_versions_duty_row_is_no_instance_and_holds_no_duty():
    """A mixed deploy: the previous version's ``~duty`` row, naming a live holder of its own, is
    neither taken over as a dead instance nor keeps this version from doing the duty."""
    data = MemoryData()
    old = {"PartitionKey": "instances", "RowKey": "~duty", "holder": "old-1", "at": time.time()}
    await MemoryStore(data).insert("chatstreamStreams", old)
    taken: list[tuple[str, str]] = []
    a = instance(data)
    b = instance(data, recover=lambda dead, taker: _note(taken, taker, dead))
    a.need()
    b.need()
    await a.first_beat()
    a._beating.cancel()  # killed
    deadline = time.monotonic() + 3
    while not taken and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert taken == [(b.id, a.id)], taken
    assert data.tables["chatstreamStreams"]["instances"]["~duty"][0]["holder"] == "old-1"
    await a.close(leave=False)
    await b.close()


async def test_a_duty_holder_whose_duty_failed_does_it_at_its_next_tick():
    """The duty's work fails once (the store does not answer its query of the instances): the holder
    does it at its next tick."""
    timing = InstanceTiming(beat_seconds=0.05, lease_seconds=0.3, duty_seconds=1.0, fresh_seconds=0)
    data = MemoryData()
    runs: list[tuple[str, str]] = []
    a = instance(data, timing=timing, sweeps=[(0.0, lambda: _note(runs, "a", "sweep"))])
    a.store.inject(Fault("unavailable", frozenset({"query"})))
    a.need()
    await asyncio.sleep(2.5)  # the first tick's duty failed (at 1 s); the second's ran
    assert runs == [("a", "sweep")], runs
    await a.close()
