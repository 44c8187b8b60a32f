"""The store's contract (tests/store_contract.py) on the in-process store, and what only it has: the
failures a test puts on it (an answer lost after the write landed, a refusal, a slow or frozen store)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from memory_store import Fault, MemoryData, MemoryStore
from store_contract import CHECKS

from chatstream.errors import StoreTimeout, StoreUnavailable
from chatstream.state.store import LIMITS_TABLE

_prefix = itertools.count()


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
async def test_the_contract(check):
    await check(MemoryStore(), f"p{next(_prefix)}")


async def test_a_lost_answer_was_applied_and_a_refusal_was_not():
    store = MemoryStore()
    store.inject(Fault("lose_answer", frozenset({"insert"})))
    with pytest.raises(StoreTimeout):
        await store.insert(LIMITS_TABLE, {"PartitionKey": "p", "RowKey": "a"})
    assert await store.get(LIMITS_TABLE, "p", "a") is not None
    store.inject(Fault("unavailable", frozenset({"insert"})))
    with pytest.raises(StoreUnavailable):
        await store.insert(LIMITS_TABLE, {"PartitionKey": "p", "RowKey": "b"})
    assert await store.get(LIMITS_TABLE, "p", "b") is None


async def test_a_frozen_store_applies_what_timed_out_when_it_thaws():
    data = MemoryData()
    a, b = MemoryStore(data), MemoryStore(data)  # two instances on one account
    a.freeze()
    with pytest.raises(StoreTimeout):
        await b.insert(LIMITS_TABLE, {"PartitionKey": "p", "RowKey": "a"}, timeout=0.05)
    assert data.tables.get(LIMITS_TABLE, {}).get("p", {}).get("a") is None
    reading = asyncio.ensure_future(b.get(LIMITS_TABLE, "p", "a", timeout=2))
    await asyncio.sleep(0.05)
    a.thaw()
    assert await reading is not None  # the queued insert landed first, as a stopped server's backlog


def test_the_store_clock_follows_whole_second_dates_from_below():
    """Dates are whole seconds, truncated, and arrive late: the clock keeps the best sample, which is
    never ahead of the store, and after answers spread over a second it is within 0.1 s of it."""
    from chatstream.state.store import StoreClock

    mono = [1000.0]
    offset = 12345.678  # the store's time minus this machine's monotonic clock
    clock = StoreClock(wall=lambda: mono[0] + offset - 30.0, monotonic=lambda: mono[0])  # our wall clock is 30 s off
    assert abs(clock.now() - (mono[0] + offset)) > 29
    for _ in range(40):
        mono[0] += 0.027
        store_time = mono[0] + offset
        clock.observe(float(int(store_time - 0.004)))  # sent 4 ms ago, truncated
        assert clock.now() <= mono[0] + offset + 1e-9
    assert abs(clock.now() - (mono[0] + offset)) < 0.1
