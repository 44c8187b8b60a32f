"""The contract of the store's edge (chatstream/state/store.py), one suite for both backends: run on
the in-process store by tests/unit/test_store_memory.py and on a real Azurite by
tests/test_store_azurite.py. Each check takes a fresh ``Store`` and a unique prefix for its keys."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from chatstream.errors import AlreadyExists, Modified, NotFound
from chatstream.state.store import LIMITS_TABLE, NEW, Op, Store, Where

T = LIMITS_TABLE
Check = Callable[[Store, str], Awaitable[None]]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


@check
async def rows_round_trip_with_their_types(store: Store, p: str) -> None:
    assert await store.get(T, p, "a") is None
    etag = await store.insert(
        T, {"PartitionKey": p, "RowKey": "a", "n": 7, "big": 2**62, "x": 1.5, "ok": True, "s": "é🙂"}
    )
    row = await store.get(T, p, "a")
    assert row is not None and row.etag == etag
    assert (row["n"], row["big"], row["x"], row["ok"], row["s"]) == (7, 2**62, 1.5, True, "é🙂")
    assert type(row["n"]) is int and type(row["big"]) is int
    assert set(await store.get(T, p, "a", select=["n"]) or {}) >= {"PartitionKey", "RowKey", "n"}


@check
async def an_insert_finds_the_row_there(store: Store, p: str) -> None:
    await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})
    with pytest.raises(AlreadyExists):
        await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 2})
    row = await store.get(T, p, "a")
    assert row is not None and row["n"] == 1


@check
async def replace_and_merge_hold_their_conditions(store: Store, p: str) -> None:
    old = await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1, "keep": "k"})
    new = await store.replace(T, {"PartitionKey": p, "RowKey": "a", "n": 2}, etag=old)
    assert new != old
    with pytest.raises(Modified):
        await store.replace(T, {"PartitionKey": p, "RowKey": "a", "n": 3}, etag=old)
    row = await store.get(T, p, "a")
    assert row is not None and row["n"] == 2 and "keep" not in row
    await store.merge(T, {"PartitionKey": p, "RowKey": "a", "m": 5}, etag=new)
    row = await store.get(T, p, "a")
    assert row is not None and (row["n"], row["m"]) == (2, 5)
    with pytest.raises(Modified):
        await store.merge(T, {"PartitionKey": p, "RowKey": "a", "m": 6}, etag=new)
    for write in (store.replace, store.merge):
        with pytest.raises(NotFound):
            await write(T, {"PartitionKey": p, "RowKey": "missing", "n": 1})
    await store.replace(T, {"PartitionKey": p, "RowKey": "a", "n": 9})  # no etag: unconditional
    row = await store.get(T, p, "a")
    assert row is not None and row["n"] == 9
    # an empty ETag (a row never read) is refused before any call, not sent as any version
    for write in (store.replace, store.merge):
        with pytest.raises(ValueError, match="empty ETag"):
            await write(T, {"PartitionKey": p, "RowKey": "a", "n": 10}, etag="")
    with pytest.raises(ValueError, match="empty ETag"):
        await store.delete(T, p, "a", etag="")
    with pytest.raises(ValueError, match="empty ETag"):
        await store.batch(T, [Op("merge", {"PartitionKey": p, "RowKey": "a", "n": 10}, "")])
    row = await store.get(T, p, "a")
    assert row is not None and row["n"] == 9


@check
async def upsert_and_delete(store: Store, p: str) -> None:
    await store.upsert(T, {"PartitionKey": p, "RowKey": "a", "n": 1, "x": "y"})
    await store.upsert(T, {"PartitionKey": p, "RowKey": "a", "n": 2})
    row = await store.get(T, p, "a")
    assert row is not None and row["n"] == 2 and "x" not in row
    await store.delete(T, p, "missing")  # quiet
    with pytest.raises(Modified):
        await store.delete(T, p, "a", etag="W/\"datetime'2000-01-01T00%3A00%3A00.0000000Z'\"")
    await store.delete(T, p, "a", etag=row.etag)
    assert await store.get(T, p, "a") is None


@check
async def queries_by_partition_range_and_properties(store: Store, p: str) -> None:
    for i in range(6):
        await store.insert(T, {"PartitionKey": p, "RowKey": f"r{i}", "n": i, "kind": "odd" if i % 2 else "even"})
    await store.insert(T, {"PartitionKey": p + "x", "RowKey": "r1", "n": 100, "kind": "odd"})
    keys = [r["RowKey"] for r in await store.query(T, Where(partition=p, rows_from="r1", rows_to="r4"))]
    assert keys == ["r1", "r2", "r3"]
    odd = await store.query(T, Where(partition=p, equal={"kind": "odd"}, less={"n": 5}))
    assert [r["n"] for r in odd] == [1, 3]
    low = await store.query(T, Where(partition=p, less={"n": 2}, select=("n",)))
    assert [r["n"] for r in low] == [0, 1] and "kind" not in low[0]
    assert len(await store.query(T, Where(partition=p, limit=2))) == 2
    both = await store.query(T, Where(rows_from="r1", rows_to="r2", equal={"kind": "odd"}))
    assert sorted(r["PartitionKey"] for r in both if r["PartitionKey"].startswith(p)) == [p, p + "x"]


@check
async def a_batch_is_all_or_nothing(store: Store, p: str) -> None:
    etag = await store.insert(T, {"PartitionKey": p, "RowKey": "c", "n": 1})
    with pytest.raises(AlreadyExists) as failed:
        await store.batch(
            T,
            [
                Op("insert", {"PartitionKey": p, "RowKey": "a", "n": 1}),
                Op("insert", {"PartitionKey": p, "RowKey": "c", "n": 2}),
            ],
        )
    assert getattr(failed.value, "index", None) == 1
    assert await store.get(T, p, "a") is None
    with pytest.raises(Modified):
        await store.batch(
            T,
            [
                Op("insert", {"PartitionKey": p, "RowKey": "a", "n": 1}),
                Op(
                    "replace",
                    {"PartitionKey": p, "RowKey": "c", "n": 3},
                    etag="W/\"datetime'2000-01-01T00%3A00%3A00.0000000Z'\"",
                ),
            ],
        )
    assert await store.get(T, p, "a") is None
    await store.batch(
        T,
        [
            Op("insert", {"PartitionKey": p, "RowKey": "a", "n": 1}),
            Op("replace", {"PartitionKey": p, "RowKey": "c", "n": 3}, etag=etag),
            Op("upsert", {"PartitionKey": p, "RowKey": "d", "n": 4}),
        ],
    )
    rows = {r["RowKey"]: r["n"] for r in await store.query(T, Where(partition=p))}
    assert rows == {"a": 1, "c": 3, "d": 4}
    await store.batch(
        T, [Op("delete", {"PartitionKey": p, "RowKey": "a"}), Op("merge", {"PartitionKey": p, "RowKey": "c", "m": 1})]
    )
    rows = {r["RowKey"]: r.get("m") for r in await store.query(T, Where(partition=p))}
    assert rows == {"c": 1, "d": None}


@check
async def a_batch_delete_of_a_row_that_is_not_there_fails_the_batch(store: Store, p: str) -> None:
    # Unlike a single delete (quiet), Table storage refuses the whole transaction (404 for that one).
    await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})
    with pytest.raises(NotFound) as failed:
        await store.batch(
            T, [Op("delete", {"PartitionKey": p, "RowKey": "a"}), Op("delete", {"PartitionKey": p, "RowKey": "gone"})]
        )
    assert getattr(failed.value, "index", None) == 1
    assert await store.get(T, p, "a") is not None


@check
async def a_batch_checks_its_rows_and_keeps_no_nulls(store: Store, p: str) -> None:
    with pytest.raises(ValueError):  # checked before any call, as a single write is
        await store.batch(T, [Op("upsert", {"PartitionKey": p, "RowKey": "a", "n": 2**63})])
    await store.batch(T, [Op("insert", {"PartitionKey": p, "RowKey": "a", "n": 1, "gone": None})])
    await store.batch(T, [Op("merge", {"PartitionKey": p, "RowKey": "a", "m": 2, "n": None})])
    row = await store.get(T, p, "a")
    assert row is not None and (row["n"], row["m"]) == (1, 2) and "gone" not in row


@check
async def table_storage_limits_are_checked_before_any_call(store: Store, p: str) -> None:
    for entity in (
        {"PartitionKey": p, "RowKey": "a", "s": "x" * (32 * 1024 + 1)},
        {"PartitionKey": p, "RowKey": "a", "s": "🙂" * (16 * 1024 + 1)},  # two UTF-16 units each
        {"PartitionKey": p, "RowKey": "a", **{f"p{i}": i for i in range(253)}},
        {"PartitionKey": p, "RowKey": "a/b"},
        {"PartitionKey": p, "RowKey": "a", "n": 2**63},
    ):
        with pytest.raises(ValueError):
            await store.insert(T, entity)
    assert await store.get(T, p, "a") is None
    await store.insert(T, {"PartitionKey": p, "RowKey": "a", "s": "x" * (32 * 1024)})  # exactly the limit


@check
async def append_blobs_grow_only_at_their_expected_length(store: Store, p: str) -> None:
    name = f"{p}-log"
    assert await store.read(name) == b"" and await store.get_blob(name) is None
    await store.append_create(name)
    with pytest.raises(AlreadyExists):
        await store.append_create(name)
    assert await store.append(name, b"abc", at=0) == 3
    with pytest.raises(Modified):
        await store.append(name, b"xyz", at=0)  # another writer got there first: fenced
    assert await store.append(name, b"de", at=3) == 5
    assert await store.read(name) == b"abcde" and await store.read(name, 3) == b"de"
    assert await store.read(name, 5) == b"" and (await store.get_blob(name) or (b"",))[0] == b"abcde"
    with pytest.raises(NotFound):
        await store.append(f"{p}-none", b"x", at=0)
    await store.delete_blob(name)
    await store.delete_blob(name)  # quiet
    assert await store.get_blob(name) is None


@check
async def whole_blobs_are_written_under_a_condition(store: Store, p: str) -> None:
    name = f"{p}-journal"
    assert await store.get_blob(name) is None
    first = await store.put(name, b"one", etag=NEW)
    with pytest.raises(Modified):
        await store.put(name, b"two", etag=NEW)
    second = await store.put(name, b"two", etag=first)
    with pytest.raises(Modified):
        await store.put(name, b"three", etag=first)  # someone wrote since: fenced
    assert await store.get_blob(name) == (b"two", second)
    await store.put(name, b"four")  # unconditional
    found = await store.get_blob(name)
    assert found is not None and found[0] == b"four"


@check
async def the_store_keeps_the_time(store: Store, p: str) -> None:
    await store.upsert(T, {"PartitionKey": p, "RowKey": "t"})
    assert abs(store.clock.now() - time.time()) < 2.5  # Azurite runs on this machine


@check
async def concurrent_conditional_writes_let_exactly_one_win(store: Store, p: str) -> None:
    etag = await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 0})

    async def write(i: int) -> bool:
        try:
            await store.replace(T, {"PartitionKey": p, "RowKey": "a", "n": i}, etag=etag)
            return True
        except Modified:
            return False

    assert sum(await asyncio.gather(*(write(i) for i in range(1, 9)))) == 1
