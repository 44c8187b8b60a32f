"""The store's contract (tests/store_contract.py) on the in-process store, and what only it has: the
failures a test puts on it (an answer lost after the write landed, a refusal, a slow or frozen store)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from store_contract import CHECKS

from chatstream.errors import StoreTimeout, StoreUnavailable
from chatstream.state.store import LIMITS_TABLE
from chatstream.state.store_memory import Fault, MemoryData, MemoryStore

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
