"""chatstream/state/owners.py on the in-process store: what a caller creates is its own (by id), and a
background response is charged exactly once across every instance, whatever answers are lost."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from memory_store import Fault, MemoryData, MemoryStore

from chatstream.errors import StoreError
from chatstream.state.callers import Caller
from chatstream.state.owners import RESPONSE_LIFETIME, Owned, Owners
from chatstream.state.store import RESPONSES_TABLE, StoreClock


async def test_what_a_caller_creates_belongs_to_it():
    owners = Owners(MemoryStore())
    assert await owners.owned("response", "resp_1") is None
    await owners.own("response", "resp_1", Owned("alice-id"))
    await owners.own("response", "resp_1", Owned("alice-id"))  # idempotent
    await owners.own("response", "resp_1", Owned("bob-id"))  # the first owner stands
    owned = await owners.owned("response", "resp_1")
    assert owned is not None and owned.caller_id == "alice-id"
    assert await owners.owned("stream", "resp_1") is None  # kinds are apart
    await owners.set_context("response", "resp_1", 1234)
    owned = await owners.owned("response", "resp_1")
    assert owned is not None and owned.context == 1234
    await owners.set_context("response", "resp_nobody", 5)  # quiet
    await owners.forget("response", "resp_1")
    assert await owners.owned("response", "resp_1") is None
    await owners.forget("response", "resp_1")
    odd = "resp/odd#id?\n"
    await owners.own("response", odd, Owned("alice-id"))
    assert (await owners.owned("response", odd)) is not None


def test_an_owner_is_its_caller_by_id_or_a_row_before_ids_by_name():
    alice = Caller(name="alice", id="alice-id", created_at=datetime.now(UTC))
    again = Caller(name="alice", id="alice-new", created_at=datetime.now(UTC))
    assert Owned("alice-id").by(alice) and not Owned("alice-id").by(again)
    old = Owned.of({"caller": "alice"})  # a row written before ids
    assert old is not None and old.by(alice) and old.by(again)
    assert not old.by(Caller(name="bob", id="alice-id", created_at=datetime.now(UTC)))
    with pytest.raises(ValueError, match="caller_id"):  # a charge mark without an owner names nobody
        Owned.of({"context": 5})


def test_an_owner_row_reads_as_the_previous_version_wrote_it_and_writes_what_it_reads():
    """The previous version wrote an owner row by hand (no ``context`` until ``set_context``, the
    price as JSON text) and read one with ``int``/``float``/``bool``: both forms read the same."""
    price = {"model": "m", "input": 1, "cached_input": 1, "output": 2, "updated_at": "2026-01-01T00:00:00Z"}
    old = {"caller_id": "alice-id", "charged": False, "reserved": 500, "reserved_spend": 7, "reserved_at": 10.5}
    owned = Owned.of(old | {"price": json.dumps(price), "created": 1.0, "expires": 2.0})
    assert (owned.caller_id, owned.context, owned.reserved, owned.reserved_at) == ("alice-id", 0, 500, 10.5)
    assert owned.price is not None and owned.price.output == 2 and not owned.charged
    written = owned.entity()
    assert written == old | {"context": 0, "price": json.dumps(price)}
    assert Owned.of(written) == owned


async def test_a_background_response_is_charged_once_across_instances():
    data = MemoryData()
    owners = [Owners(MemoryStore(data)), Owners(MemoryStore(data))]
    await owners[0].own("response", "resp_bg", Owned("alice-id", reserved=500, reserved_spend=7, reserved_at=10.0))
    results = await asyncio.gather(*(owners[i % 2].first_charge("response", "resp_bg") for i in range(20)))
    assert results.count(True) == 1
    assert await owners[1].first_charge("response", "resp_bg") is False
    owned = await owners[0].owned("response", "resp_bg")
    assert owned is not None and (owned.caller_id, owned.reserved, owned.reserved_spend) == ("alice-id", 500, 7)
    # Charged by the request that made it: never charged again when seen.
    await owners[0].own("response", "resp_done", Owned("alice-id", charged=True))
    assert await owners[1].first_charge("response", "resp_done") is False
    # Never owned (made before callers were on): the first mark wins.
    assert [await owners[0].first_charge("response", "resp_old") for _ in range(2)] == [True, False]


@pytest.mark.parametrize("owned", [True, False])
async def test_a_first_charge_whose_answer_was_lost_is_still_the_first(owned):
    """The mark lands but its answer is lost: the caller that made it must still learn it is the
    one that charges (else nobody ever does), and nobody else may."""
    data = MemoryData()
    store = MemoryStore(data)
    owners, other = Owners(store), Owners(MemoryStore(data))
    if owned:
        await owners.own("response", "resp_bg", Owned("alice-id"))
    store.inject(Fault("lose_answer", frozenset({"merge", "insert"}), table=RESPONSES_TABLE))
    assert await owners.first_charge("response", "resp_bg") is True
    assert await other.first_charge("response", "resp_bg") is False
    assert await owners.first_charge("response", "resp_bg") is False


async def test_a_store_that_fails_raises_the_stores_error():
    store = MemoryStore()
    owners = Owners(store)
    store.inject(Fault("unavailable", times=3))
    for call in (
        owners.owned("response", "r"),
        owners.own("response", "r", Owned("a")),
        owners.first_charge("response", "r"),
    ):
        with pytest.raises(StoreError):
            await call


async def test_the_sweep_deletes_rows_past_their_lifetime():
    elapsed = [0.0]
    store = MemoryStore(clock=StoreClock(monotonic=lambda: elapsed[0]))
    owners = Owners(store)
    now = store.clock.now()
    await owners.own("response", "older", Owned("a"))
    elapsed[0] = 1000.0
    await owners.own("response", "newer", Owned("a"))
    assert await owners.sweep(now + RESPONSE_LIFETIME + 100) == 1
    assert await owners.owned("response", "older") is None and await owners.owned("response", "newer") is not None
