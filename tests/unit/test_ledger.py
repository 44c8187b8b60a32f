"""chatstream/state/ledger.py on the in-process store: one row per charge and segment, idempotent by
(day, request id, segment), written by the journal in one transaction per partition, written again
until it lands through a store that refuses or loses answers (none lost, none twice), usage summed
exactly, the CSV for finance, and the retention sweep."""

from __future__ import annotations

import asyncio
import csv
import io
import math
import secrets
from dataclasses import asdict, replace
from datetime import UTC, date, datetime

import pytest
from memory_store import Fault, MemoryData, MemoryStore

from chatstream.manage import as_csv, totals
from chatstream.state.counter_row import day_of, window_of
from chatstream.state.journal import JournalEntry
from chatstream.state.ledger import Charge, Ledger, Payer, raised, summarize
from chatstream.state.shared import SharedState
from chatstream.state.store import USAGE_TABLE

from .state_helpers import account, instance, until

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time


def charge(
    caller: str = "a",
    model: str = "gpt-4o",
    day: str = "20261103",
    prompt: int = 10,
    completion: int = 5,
    ended: str = "completed",
    request_id: str | None = None,
    cost: int | None = 0,
    cached: int = 0,
    team: str | None = None,
    segment: int = 0,
) -> Charge:
    return Charge(
        caller=caller,
        caller_id=f"id-{caller}",
        team=team,
        team_id=f"tid-{team}" if team else None,
        model=model,
        endpoint="openai",
        request_id=request_id or secrets.token_hex(6),
        day=day,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cost=cost,
        ended=ended,
        segment=segment,
        author="instance-a",
    )


def rows(data: MemoryData) -> list[dict]:
    return [values for partition in data.tables.get(USAGE_TABLE, {}).values() for values, _ in partition.values()]


async def test_one_row_per_charge_and_segment_idempotent_by_day_request_and_segment():
    data = MemoryData()
    ledger = Ledger(MemoryStore(data))
    first = charge(request_id="resp_1/odd#id?\n", prompt=10, completion=20)
    assert await ledger.write([first]) == [False]
    assert await ledger.write([first]) == [False]  # a retry after a lost answer: its own row
    assert await ledger.write([charge(request_id="resp_1/odd#id?\n", prompt=99, completion=99)]) == [False]  # again
    assert await ledger.write([charge(request_id="resp_1/odd#id?\n", segment=1, prompt=0, completion=7)]) == [False]
    found = sorted(rows(data), key=lambda r: r["segment"])
    assert [(r["request_id"], r["segment"], r["prompt_tokens"], r["completion_tokens"]) for r in found] == [
        ("resp_1/odd#id?\n", 0, 10, 20),
        ("resp_1/odd#id?\n", 1, 0, 7),
    ]
    assert all(r["PartitionKey"] == "u:id-a" for r in found)
    # Another instance's row, found there first: theirs (that writer counted it).
    assert await ledger.write([replace(first, author="instance-b"), charge(request_id="next")]) == [True, False]
    # A raise (a stream's taker, a recovery): made on the row as read, its author kept; it lands once
    # (again: in the row); one made on a row that changed since counts nothing.
    row = await ledger.find(first)
    up = raised(row, replace(first, completion_tokens=30, cost=7, author="instance-c"), "op1")
    late = raised(row, replace(first, completion_tokens=25, cost=5), "op2")
    held = raised(row, first, "op3")  # the row holds as much: no write, it adds nothing
    assert held[0] is None and held[1].total_tokens == 0 and held[1].cost == 0
    assert up[0] is not None and late[0] is not None and up[1].total_tokens == 10 and up[1].cost == 7
    assert await ledger.write([up[0]]) == [False] and await ledger.write([up[0]]) == [False]
    assert await ledger.write([late[0]]) == [True]
    there = await ledger.find(first)
    assert there is not None and there.completion_tokens == 30 and there.author == "instance-a"
    # A raise by op1 again (a recovery run again) adds what op1 added, with no write; op2 never landed.
    higher = replace(first, completion_tokens=99)
    again = raised(there, higher, "op1")
    assert again[0] is None and (again[1].total_tokens, again[1].cost) == (10, 7)
    assert raised(there, higher, "op2")[0] is not None
    # A row as the previous version left it (a taker's op a bare id) is raised the same, and an op of
    # this one reads as no recovery's there (the previous version looks for "takeover:<id>=" only).
    older = replace(there, ops="a1b2c3 takeover:x=5/7 d4e5f6=1/2")
    recovered = raised(older, higher, "takeover:x")
    assert recovered[0] is None and (recovered[1].total_tokens, recovered[1].cost) == (5, 7)
    assert raised(replace(there, ops="a1b2c3 d4e5f6=1/2"), higher, "a1b2c3")[0] is not None
    # 10 concurrent writes of one request: one row.
    same = await asyncio.gather(*(ledger.write([charge(request_id="same", day="20261104")]) for _ in range(10)))
    assert same == [[False]] * 10
    assert sum(1 for r in rows(data) if r["request_id"] == "same") == 1


async def settled(state: SharedState, charges: list[Charge]) -> list[JournalEntry]:
    """Each charge a request of its own settled on ``state`` (no budgets), at about one moment."""
    entries = []
    for c in charges:
        payer = Payer.of(asdict(c))
        entry = state.journal.open(JournalEntry(c.request_id, payer, c.model, c.prompt_tokens, {}))
        state.journal.settle(entry, [c], {})
        entries.append(entry)
    return entries


async def test_charges_are_batched_per_partition_in_transactions_of_100():
    """The journal writes the rows of the requests one write of it lists: per partition, in
    transactions of up to 100 rows."""
    data = account()
    state, _ = instance(data, "instance-a")
    store = state.store
    assert isinstance(store, MemoryStore)
    calls: list[tuple[str, int]] = []  # the ledger's: (call, rows)
    batch, insert = store.batch, store.insert

    async def batched(table, ops, **kw):
        calls.extend([("batch", len(ops))] if table == USAGE_TABLE else [])
        return await batch(table, ops, **kw)

    async def inserted(table, entity, **kw):
        calls.extend([("insert", 1)] if table == USAGE_TABLE else [])
        return await insert(table, entity, **kw)

    store.batch, store.insert = batched, inserted
    charges = [charge("a") for _ in range(150)] + [charge("b") for _ in range(30)] + [charge("c")]
    await settled(state, charges)
    assert await state.journal.flush(5)
    assert sorted(calls) == [("batch", 1), ("batch", 30), ("batch", 50), ("batch", 100)]  # a: 100 + 50, b, c
    assert len(rows(data)) == 181
    await state.close()


async def test_a_row_the_store_cannot_keep_is_let_go_and_the_rest_of_its_transaction_lands(caplog):
    """A bug of ours (a row the store refuses for good, not a store failure): its transaction is
    tried one row at a time, the good rows land, the bad one is logged and let go."""
    data = MemoryData()
    store = MemoryStore(data)
    real = store.batch

    async def batch(table, ops, **kw):
        if any(op.entity.get("request_id") == "bad" for op in ops):
            raise ValueError("a value the store cannot keep")
        return await real(table, ops, **kw)

    store.batch = batch
    ledger = Ledger(store)
    written = await ledger.write([charge(request_id="good-1"), charge(request_id="bad"), charge(request_id="good-2")])
    assert written == [False, False, False]  # none to write again
    assert sorted(r["request_id"] for r in rows(data)) == ["good-1", "good-2"]
    assert "charge(s) cannot be written (request bad...)" in caplog.text


async def test_charges_are_written_again_until_they_land_none_lost_none_twice():
    """The store refuses a transaction, then applies one but loses its answer: every charge is in
    the ledger exactly once afterwards, and each request is written (its counters may take it in)
    only then; a graceful stop waits for them all and leaves no journal."""
    data = account()
    state, _ = instance(data, "instance-a")
    store = state.store
    assert isinstance(store, MemoryStore)
    store.inject(Fault("unavailable", frozenset({"batch"}), table=USAGE_TABLE))
    store.inject(Fault("lose_answer", frozenset({"batch"}), table=USAGE_TABLE))
    charges = [charge(caller, request_id=f"r{i}") for i, caller in enumerate(["a", "b"] * 20)]
    entries = await settled(state, charges)
    await until(lambda: store.faults[0].times == 0, what="a transaction refused")
    assert not all(e.written.is_set() for e in entries) and len(rows(data)) < 40  # not done before they landed
    await state.close()
    assert all(e.written.is_set() for e in entries)
    keys = sorted((r["caller"], r["request_id"]) for r in rows(data))
    assert keys == sorted((c.caller, c.request_id) for c in charges)  # each once
    assert all(f.times == 0 for f in store.faults)
    assert not data.blobs  # no journal left: nothing owed


async def test_usage_sums_by_caller_team_model_and_day_exactly():
    data = MemoryData()
    ledger = Ledger(MemoryStore(data))
    charges = [
        charge("a", "gpt-4o", "20261103", 10, 5, cost=1_234_567, cached=4, team="search"),
        charge("a", "gpt-4o", "20261103", 7, 3, "disconnected", cost=1, team="search"),
        charge("a", "local", "20261103", 100, 0, "failed", cost=None, team="search"),  # unpriced
        charge("a", "gpt-4o", "20261104", 1, 1, cost=100_000_000_000_000, team="search"),  # $100
        charge("b", "gpt-4o", "20261103", 50, 50, "timeout", cost=3),
        charge("a", "gpt-4o", "20261109", 1000, 1000, cost=5, team="search"),
    ]
    assert await ledger.write(charges) == [False] * len(charges)
    found = await ledger.usage(date(2026, 11, 3), date(2026, 11, 4), caller_id="id-a")
    assert [(r["day"], r["model"], r["prompt_tokens"], r["completion_tokens"], r["requests"]) for r in found] == [
        ("2026-11-03", "gpt-4o", 17, 8, 2),
        ("2026-11-03", "local", 100, 0, 1),
        ("2026-11-04", "gpt-4o", 1, 1, 1),
    ]
    first = found[0]
    assert first["ended"] == {"completed": 1, "disconnected": 1} and first["total_tokens"] == 25
    assert first["cached_tokens"] == 4 and first["team"] == "search" and first["caller"] == "a"
    assert first["cost_picousd"] == 1_234_568 and first["cost_usd"] == 0.000001234568
    assert found[1]["unpriced_requests"] == 1 and found[1]["cost_picousd"] == 0
    total = totals(found)
    assert total["requests"] == 4 and total["unpriced_requests"] == 1 and total["total_tokens"] == 127
    assert total["cost_picousd"] == 100_000_000_000_000 + 1_234_568
    assert total["cost_usd"] == 100.000001234568
    everyone = await ledger.usage(date(2026, 11, 3), date(2026, 11, 3))
    assert {(r["caller"], r["model"]) for r in everyone} == {("a", "gpt-4o"), ("a", "local"), ("b", "gpt-4o")}
    team = await ledger.usage(date(2026, 11, 1), date(2026, 11, 30), team="search")
    assert {r["caller"] for r in team} == {"a"} and sum(r["requests"] for r in team) == 5
    model = await ledger.usage(date(2026, 11, 1), date(2026, 11, 30), model="local")
    assert [(r["caller"], r["requests"]) for r in model] == [("a", 1)]
    assert await ledger.usage(date(2026, 11, 5), date(2026, 11, 8), caller_id="id-a") == []
    assert await ledger.usage(date(9999, 1, 1), date(9999, 12, 31)) == []  # the last days there are
    assert await ledger.usage(date(1, 1, 1), date(1, 1, 1)) == []


def test_a_sum_of_many_small_costs_is_exact():
    costs = [1, 10**12 - 1, 333_333_333_333, 666_666_666_667] * 250
    found = summarize(
        [{"RowKey": "20261103|r|00", "caller": "a", "model": "m", "cost": c, "prompt_tokens": 1} for c in costs]
    )
    assert found[0]["cost_picousd"] == sum(costs) == 500 * 10**12
    assert found[0]["cost_usd"] == 500.0


def test_the_csv_has_exact_decimals_a_totals_line_and_no_formulas():
    usage = summarize(
        [
            {
                "RowKey": "20261103|r1|00",
                "caller": "a",
                "team": "search",
                "model": "gpt-4o",
                "prompt_tokens": 3,
                "completion_tokens": 4,
                "cost": 1_234_567,
                "ended": "completed",
            },
            {
                "RowKey": "20261103|r2|00",
                "caller": "a",
                "team": "search",
                "model": '=HYPERLINK("x")',
                "prompt_tokens": 1,
                "cost": None,
            },
            {"RowKey": "20261104|r3|00", "caller": "b", "model": "+cmd", "cost": 10**14 + 1},
            {"RowKey": "20261104|r4|00", "caller": "b", "model": "@sum", "cost": 0},
            {"RowKey": "20261104|r5|00", "caller": "b", "model": "-2+3", "cost": 0},
        ]
    )
    text = as_csv(usage)
    assert text.endswith("\r\n")
    lines = list(csv.reader(io.StringIO(text)))
    assert lines[0] == [
        "day", "caller", "team", "model", "requests", "prompt_tokens", "cached_tokens", "completion_tokens",
        "total_tokens", "cost_usd", "unpriced_requests",
    ]  # fmt: skip
    by_model = {line[3]: line for line in lines[1:-1]}
    assert by_model["gpt-4o"] == ["2026-11-03", "a", "search", "gpt-4o", "1", "3", "0", "4", "7", "0.000001234567", "0"]
    assert by_model['\'=HYPERLINK("x")'][-2:] == ["0.000000000000", "1"]  # a formula is text
    for quoted in ("'+cmd", "'@sum", "'-2+3"):
        assert quoted in by_model
    assert by_model["'+cmd"][9] == "100.000000000001"
    assert lines[-1] == ["total", "", "", "", "5", "4", "0", "4", "8", "100.000001234568", "1"]
    assert as_csv([]).splitlines()[-1] == "total,,,,0,0,0,0,0,0.000000000000,0"


async def test_the_retention_sweep_deletes_old_charges_only_and_is_bounded():
    data = MemoryData()
    ledger = Ledger(MemoryStore(data))
    now = datetime(2026, 11, 30, 12, tzinfo=UTC).timestamp()
    old = [charge(c, day="20261020", request_id=f"old{i}{c}") for i in range(60) for c in ("a", "b")]
    kept = [charge("a", day=d) for d in ("20261031", "20261101", "20261130")]
    await ledger.write(old + kept)
    assert await ledger.sweep(30, now, limit=100) == 100  # the cutoff: 2026-10-31
    assert await ledger.sweep(30, now, limit=100) == 20
    assert await ledger.sweep(30, now) == 0
    assert sorted(r["day"] if "day" in r else r["RowKey"][:8] for r in rows(data)) == [
        "20261031",
        "20261101",
        "20261130",
    ]


async def test_a_charge_round_trips_through_the_journal_form_and_its_ledger_row():
    c = charge(request_id="r", cost=None, team="t", cached=3)
    assert Charge.of(asdict(c)) == c
    ledger = Ledger(MemoryStore(MemoryData()))
    assert await ledger.write([c]) == [False]
    there = await ledger.find(c)
    assert there is not None and replace(there, over=None) == c  # its day from the RowKey
    assert day_of(datetime(2026, 11, 3, 23, 59, 59, tzinfo=UTC).timestamp()) == "20261103"


def test_a_requests_ledger_day_is_its_reservations_day_window_to_the_last_float_before_midnight():
    """The ledger day of a request (``day_of``) is the day window its reservation was made in
    (``window_of``), and both are the day datetime makes of the time, as the month window is
    (datetime rounds a time to the microsecond, so the last floats before midnight are the next
    day): a recovery counts a charge only in the windows of its ledger day."""
    midnight = datetime(2026, 12, 1, tzinfo=UTC).timestamp()  # (a month's first: the month window too)
    at = midnight + 1e-6
    while at > midnight - 1e-6:  # the floats within a microsecond of midnight
        day = datetime.fromtimestamp(at, UTC).strftime("%Y%m%d")
        assert day_of(at) == day == window_of("day", at)[1:] and window_of("month", at)[1:] == day[:6]
        at = math.nextafter(at, 0)
    assert day_of(midnight - 1e-3) == "20261130" and day_of(midnight) == "20261201"
