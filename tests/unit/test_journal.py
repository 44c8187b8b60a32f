"""chatstream/state/journal.py on the in-process store: an instance dies with requests open and settled
(its tasks stop, nothing is flushed), and another takes it over: every ledger row that was missing is
written (an open request as ``lost``, at its last checkpoint), each budget counter row ends at exactly
what was spent, a second takeover adds nothing, a request someone else charged is not charged again,
and a slow instance whose journal was sealed stops owning what it had listed."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from memory_store import Fault, MemoryData, MemoryStore

from chatstream import tokens
from chatstream.errors import StoreError
from chatstream.state import journal
from chatstream.state.accounting import RAISED_WITHIN, Accounting, Admission
from chatstream.state.callers import Caller, CallerSpec, Team, TeamSpec
from chatstream.state.counter_row import day_of, parse_holds
from chatstream.state.instances import InstanceTiming
from chatstream.state.journal import Recovery, journal_name
from chatstream.state.ledger import Charge, Payer, raised
from chatstream.state.port import Unavailable, Used
from chatstream.state.prices import Price, PriceSpec
from chatstream.state.shared import SharedState
from chatstream.state.store import LIMITS_TABLE, STREAMS_TABLE, USAGE_TABLE

from .state_helpers import (
    MODEL,
    account,
    admit,
    asked,
    call,
    counter,
    finish,
    instance,
    kill,
    record,
    ticking,
    until,
    usage,
)

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time

BUDGETS = {"token_budget": 1_000_000, "spend_budget": 10, "budget_period": "month"}
GENERATED = "The quick brown fox jumps over the lazy dog, and then it runs off into the woods again."


async def setup(data: MemoryData) -> tuple[SharedState, Accounting, SharedState, Accounting, Caller, Price]:
    a, acc_a = instance(data, "instance-a")
    b, acc_b = instance(data, "instance-b")
    price = await a.registry.set_price(MODEL, PriceSpec(input=1, cached_input=0.5, output=2))
    await a.registry.create(TeamSpec.model_validate({"name": "t", **BUDGETS}))
    caller, _ = await a.registry.create(CallerSpec.model_validate({"name": "c", "team": "t", **BUDGETS}))
    return a, acc_a, b, acc_b, caller, price


def ledger_rows(data: MemoryData) -> dict[str, dict]:
    return {
        values["request_id"]: values
        for partition in data.tables.get(USAGE_TABLE, {}).values()
        for values, _ in partition.values()
    }


def journal_doc(data: MemoryData, name: str) -> dict | None:
    found = data.blobs.get(journal_name(name))
    return json.loads(bytes(found[0])) if found else None


def entry_of(data: MemoryData, name: str, request_id: str) -> dict | None:
    doc = journal_doc(data, name) or {}
    return next((e for e in doc.get("entries") or [] if e["id"] == request_id), None)


def budget_rows(data: MemoryData, caller: Caller, team_partition: str) -> list[dict]:
    return [counter(data, p, r) for p in (caller.limits_partition, team_partition) for r in ("tokens", "spend")]


def spent_exactly(data: MemoryData, caller: Caller, team_partition: str, tokens_: int, cost: int) -> None:
    """Every budget row of the caller and its team: nothing held, taken == what was spent."""
    for row in budget_rows(data, caller, team_partition):
        assert not parse_holds(row.get("holds")), row
        assert row["taken"] == (cost if row["RowKey"] == "spend" else tokens_), row


def spent_as_the_ledger(data: MemoryData, caller: Caller, team_partition: str, rows) -> None:
    """``spent_exactly`` at what the ledger ``rows`` hold, tokens and cost."""
    spent_exactly(
        data,
        caller,
        team_partition,
        sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows),
        sum(r["cost"] for r in rows),
    )


async def three_requests(data: MemoryData):
    """On instance a: r1 settled and everywhere; r2 settled, in the journal, its ledger row not written
    (the store refuses a's transactions); r3 open, its checkpoint in the journal."""
    a, acc_a, b, acc_b, caller, price = await setup(data)
    r1, rec1 = await admit(acc_a, caller, "one")
    assert isinstance(r1, Admission)
    finish(acc_a, r1, rec1, usage(100, 50, cached=20))
    assert await acc_a.flush(5)
    assert isinstance(a.store, MemoryStore)
    a.store.inject(Fault("unavailable", frozenset({"batch"}), table=USAGE_TABLE, times=10_000))
    r2, rec2 = await admit(acc_a, caller, "two")
    r3, rec3 = await admit(acc_a, caller, "three")
    assert isinstance(r2, Admission) and isinstance(r3, Admission)
    r3.entry.generated = lambda: {0: GENERATED}
    finish(acc_a, r2, rec2, usage(200, 80))

    def journaled() -> bool:
        two, three = entry_of(data, "instance-a", rec2.id), entry_of(data, "instance-a", rec3.id)
        return bool(two and two["state"] == "settled" and three and three.get("generated"))

    await until(journaled, what="the journal lists r2 settled and r3's checkpoint")
    await kill(a)
    assert set(ledger_rows(data)) == {rec1.id}
    held = parse_holds(counter(data, caller.limits_partition, "tokens")["holds"])
    assert held["instance-a"].held >= r3.entry.prompt_tokens + 4096  # r3's reservation stays in the row
    generated = tokens.count_text(MODEL, GENERATED)
    costs = (
        price.cost(100, 20, 50),
        price.cost(200, 0, 80),
        price.cost(r3.entry.prompt_tokens, 0, generated),
    )
    return a, b, caller, (rec1, rec2, rec3), (150, 280, r3.entry.prompt_tokens + generated), costs


async def test_a_dead_instance_is_recovered_exactly_and_a_second_takeover_adds_nothing():
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    rows = ledger_rows(data)
    assert set(rows) == {rec1.id, rec2.id, rec3.id}
    assert (rows[rec2.id]["prompt_tokens"], rows[rec2.id]["completion_tokens"]) == (200, 80)
    assert rows[rec2.id]["author"] == "instance-a" and rows[rec2.id]["ended"] == "completed"
    lost = rows[rec3.id]
    assert lost["ended"] == "lost" and lost["author"] == "takeover:instance-a"
    assert (lost["prompt_tokens"], lost["completion_tokens"]) == (
        spent[2] - lost["completion_tokens"],
        lost["completion_tokens"],
    )
    assert lost["completion_tokens"] == tokens.count_text(MODEL, GENERATED) and lost["cost"] == costs[2]
    assert [rows[r.id]["cost"] for r in (rec1, rec2, rec3)] == list(costs)
    spent_exactly(data, caller, team, sum(spent), sum(costs))
    assert journal_doc(data, "instance-a") is None  # done: the journal goes
    before = (dict(data.tables[LIMITS_TABLE]), len(rows))
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    assert len(ledger_rows(data)) == before[1]
    spent_exactly(data, caller, team, sum(spent), sum(costs))
    await b.close()


@pytest.mark.parametrize("crossed", [False, True])
@pytest.mark.parametrize("hops", [0, 1, 2, 3, 5, 8])
async def test_two_instances_recovering_the_same_dead_one_at_once_charge_everything_once(hops: int, crossed: bool):
    """Two duty holders (a duty handed over while the first was only slow) find the same dead
    instance and recover it at the same time, c ``hops`` loop turns after b. r3's stream was taken
    over first, its lost part charged from a log that had little of it (to be raised to a's
    checkpoint). ``crossed``: b's raise of that row lands late (c raised it meanwhile) and c's
    counter reads are slow (b gives the counters back first): before, b then counted r3 as the
    taker's alone, and the budget rows ended below the ledger. Both recoveries succeed; every
    request is in the ledger once; each budget row holds exactly the ledger, nothing stays held; the
    dead journal is gone."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    acc_b = await charged_by_its_taker(b, caller, rec3.id, "The")
    c, _ = instance(data, "instance-c")
    if crossed:
        assert isinstance(b.store, MemoryStore) and isinstance(c.store, MemoryStore)
        b.store.inject(Fault("slow", frozenset({"replace"}), table=USAGE_TABLE, delay=0.05))
        c.store.inject(Fault("slow", frozenset({"get"}), table=LIMITS_TABLE, times=10, delay=0.2))

    async def later(recovery: Recovery, taker: str) -> None:
        for _ in range(hops):
            await asyncio.sleep(0)
        await recovery.recover("instance-a", taker)

    await asyncio.gather(
        Recovery(b.store, b.ledger).recover("instance-a", "instance-b"),
        later(Recovery(c.store, c.ledger), "instance-c"),
    )
    assert await acc_b.flush(5)
    rows = ledger_rows(data)
    assert set(rows) == {rec1.id, rec2.id, rec3.id}
    assert [rows[r.id]["cost"] for r in (rec1, rec2, rec3)] == list(costs)
    assert rows[rec3.id]["author"] == "instance-b"  # raised to a's checkpoint, its author kept
    spent_as_the_ledger(data, caller, team, rows.values())
    assert journal_doc(data, "instance-a") is None
    await b.close()
    await c.close()


async def test_a_takeover_that_dies_midway_is_done_again_without_adding_twice():
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    assert isinstance(b.store, MemoryStore)
    b.store.inject(Fault("unavailable", frozenset({"replace"}), table=LIMITS_TABLE, times=1))
    with pytest.raises(StoreError):  # the ledger rows are written, the first counter row is not
        await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    assert set(ledger_rows(data)) == {rec1.id, rec2.id, rec3.id}
    doc = journal_doc(data, "instance-a")
    assert doc is not None and doc["sealed_by"] == "instance-b"
    c, _ = instance(data, "instance-c")  # the next duty holder does it again
    await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    assert len(ledger_rows(data)) == 3
    spent_exactly(data, caller, team, sum(spent), sum(costs))
    await b.close()
    await c.close()


async def test_a_request_someone_else_charged_is_not_charged_again():
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    entry = entry_of(data, "instance-a", rec3.id)
    assert entry is not None
    # r3's stream was taken over elsewhere and charged there, at more than a's checkpoint (its
    # counters are that instance's; below it, the takeover raises it: ..._raised_by_the_takeover).
    theirs = Charge(
        caller="c",
        caller_id=caller.id,
        model=MODEL,
        endpoint="openai",
        request_id=rec3.id,
        day=entry["day"],
        prompt_tokens=1,
        completion_tokens=200,
        ended="completed",
        author="instance-z",
    )
    assert await b.ledger.write([theirs]) == [False]
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    rows = ledger_rows(data)
    assert rows[rec3.id]["author"] == "instance-z" and rows[rec3.id]["completion_tokens"] == 200
    spent_exactly(data, caller, team, spent[0] + spent[1], costs[0] + costs[1])
    await b.close()


async def test_a_settled_request_whose_row_someone_else_wrote_first_is_counted_by_them_only():
    """r2 settled in a's journal, its ledger row not written when a died; meanwhile a stream's taker
    charged that part (and counted it in its own counters). The takeover adds r2 to no counter."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    entry = entry_of(data, "instance-a", rec2.id)
    assert entry is not None and entry["state"] == "settled"
    theirs = Charge.of({**entry["charges"][0], "completion_tokens": 3, "author": "instance-z"})
    assert await b.ledger.write([theirs]) == [False]
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    rows = ledger_rows(data)
    assert rows[rec2.id]["author"] == "instance-z" and rows[rec3.id]["author"] == "takeover:instance-a"
    spent_exactly(data, caller, team, spent[0] + spent[2], costs[0] + costs[2])
    await b.close()


async def taking_over(b: SharedState, caller: Caller, request_id: str) -> tuple[Accounting, Admission]:
    """Instance b takes the stream of ``request_id`` over (as Endpoint.take_over does): its
    continuation admitted, charged under the stream's request id. (b's accounting, the admission.)"""
    acc_b = b.accounting
    assert acc_b is not None
    taken = record()
    taken.id = taken.request_id = request_id
    going_on = await acc_b.admit(caller, asked(call("three"), taken))
    assert isinstance(going_on, Admission)
    return acc_b, going_on


async def charged_by_its_taker(b: SharedState, caller: Caller, request_id: str, shown: str) -> Accounting:
    """Instance b takes the stream of ``request_id`` over: its lost part charged at what the log
    shows, ``shown``; the continuation admitted and let go. b's accounting."""
    acc_b, going_on = await taking_over(b, caller, request_id)
    await acc_b.charge_lost(going_on, going_on.started, shown, epoch=2)
    going_on.entry.reservation.release()
    acc_b.journal.drop(going_on.entry)
    assert await acc_b.flush(5)
    return acc_b


async def test_a_checkpoint_below_what_the_streams_log_shows_is_raised_by_its_taker():
    """r3 open on a when it died: the takeover charged it at a's last journal checkpoint. Then a
    reader resumes r3's stream on b, whose log shows more of a's part than the checkpoint: b raises
    the row to what the log shows (its author stays the takeover's) and the budget rows follow."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == tokens.count_text(MODEL, GENERATED)
    shown = GENERATED + " It came back at dusk, tired and happy."
    await charged_by_its_taker(b, caller, rec3.id, shown)
    row = ledger_rows(data)[rec3.id]
    assert row["completion_tokens"] == tokens.count_text(MODEL, shown) and row["author"] == "takeover:instance-a"
    rows = ledger_rows(data).values()
    spent_as_the_ledger(data, caller, team, rows)
    await b.close()


async def test_a_takers_part_below_the_dead_instances_checkpoint_is_raised_by_the_takeover():
    """r3's stream was taken over before a's journal was: its taker charged a's part from a log that
    had little of it (a log is stored every few seconds). The journal's takeover raises the row to
    its checkpoint (the taker's author kept, what the raise counted said in the row) and counts only
    the difference; done again, it adds nothing."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    acc_b = await charged_by_its_taker(b, caller, rec3.id, "The")
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == 1
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    row = ledger_rows(data)[rec3.id]
    assert row["completion_tokens"] == tokens.count_text(MODEL, GENERATED) and row["author"] == "instance-b"
    assert await acc_b.flush(5)
    spent_exactly(data, caller, team, sum(spent), sum(costs))
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")  # nothing left: adds nothing
    spent_exactly(data, caller, team, sum(spent), sum(costs))
    await b.close()


async def test_a_takers_part_raised_to_what_its_caller_received_is_counted_once():
    """r3's taker charged a's part from a log that had little of it, then learned that the caller
    had received more (its reader's Last-Event-ID, past the stored end: Endpoint._charge_received):
    the same call again raises the taker's own row and counts the difference; the dead instance's
    takeover, whose checkpoint is below it, leaves it. The budget rows hold exactly the ledger."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
    received = GENERATED + " It came back at dusk, tired and happy."
    await acc_b.charge_lost(going_on, going_on.started, received, epoch=2, patience=RAISED_WITHIN)  # as the endpoint
    going_on.entry.reservation.release()
    acc_b.journal.drop(going_on.entry)
    assert await acc_b.flush(5)
    row = ledger_rows(data)[rec3.id]
    assert row["completion_tokens"] == tokens.count_text(MODEL, received) and row["author"] == "instance-b"
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == tokens.count_text(MODEL, received)
    spent_as_the_ledger(data, caller, team, ledger_rows(data).values())
    await b.close()


async def test_a_takers_raise_to_what_its_caller_received_outlasts_a_store_freeze():
    """The raise to what the caller received is made when the continuation ends; if the store is
    frozen then, it waits for the store (bounded), for nobody else can make it: the dead instance's
    recovery knows only its checkpoint (seed 4242 of the soak: 21 charged for 29 received, the
    store frozen 4.7 s at the continuation's end)."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    assert isinstance(b.store, MemoryStore)
    await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
    assert await acc_b.flush(5)
    received = GENERATED + " It came back at dusk, tired and happy."
    b.store.inject(Fault("unavailable", frozenset({"get"}), table=USAGE_TABLE, times=3))
    await acc_b.charge_lost(going_on, going_on.started, received, epoch=2, patience=5.0)
    going_on.entry.reservation.release()
    acc_b.journal.drop(going_on.entry)
    assert await acc_b.flush(5)
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == tokens.count_text(MODEL, received)
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")  # a's checkpoint is below it
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == tokens.count_text(MODEL, received)
    team = (await b.registry.get(Team, "t")).limits_partition
    spent_as_the_ledger(data, caller, team, ledger_rows(data).values())
    await b.close()


async def test_a_takers_raise_waits_out_a_store_outage_that_also_holds_its_first_charge():
    """As above, but the store refuses the ledger's writes from the taker's first charge of the part
    ("The") on, for 15 s, and the raise to what the caller received
    is made meanwhile (``patience``: the endpoint's ``RAISED_WITHIN``). The raise waits for the first
    charge's row as long as it waits for the store: made before that row is in, it was a second
    insert of the same row, which found another there and counted nothing (the row kept the dead
    instance's checkpoint, 20 of the 30 tokens received)."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    assert isinstance(b.store, MemoryStore)
    refused = b.store.inject(
        Fault("unavailable", frozenset({"insert", "replace", "batch"}), table=USAGE_TABLE, times=10**9)
    )
    await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
    assert rec3.id not in ledger_rows(data)

    async def outage_ends() -> None:
        await asyncio.sleep(15.0)
        refused.times = 0

    ending = asyncio.ensure_future(outage_ends())
    received = GENERATED + " It came back at dusk, tired and happy."
    await acc_b.charge_lost(going_on, going_on.started, received, epoch=2, patience=60.0)
    await ending
    going_on.entry.reservation.release()
    acc_b.journal.drop(going_on.entry)
    assert await acc_b.flush(30)
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == tokens.count_text(MODEL, received)
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")  # a's checkpoint is below it
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == tokens.count_text(MODEL, received)
    team = (await b.registry.get(Team, "t")).limits_partition
    spent_as_the_ledger(data, caller, team, ledger_rows(data).values())
    await b.close()


async def test_a_takers_raise_whose_row_the_dead_instances_recovery_rewrites_meanwhile_is_made_again():
    """r3's taker b charged a's part from the log ("The"), then raises it to what its caller received
    (with patience: nobody else knows it). Between b's read of the row and its write on that row's
    ETag, a's recovery (on c) raises the row to a's checkpoint: b's write finds the row changed and
    counts nothing. The raise is made again on the row as it is now: the row ends at what the caller
    received, every budget row exactly the ledger (before, the row kept a's checkpoint)."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
    assert await acc_b.flush(5)
    c, _ = instance(data, "instance-c")
    assert isinstance(b.store, MemoryStore)
    replace = b.store.replace
    recovered: list[str] = []

    async def recovery_first(table: str, entity, **kw):  # b's raise reaches the store: a's recovery lands first
        if table == USAGE_TABLE and not recovered:
            recovered.append(entity["request_id"])
            await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
        return await replace(table, entity, **kw)

    b.store.replace = recovery_first  # type: ignore[method-assign]
    received = GENERATED + " It came back at dusk, tired and happy."
    await acc_b.charge_lost(going_on, going_on.started, received, epoch=2, patience=5.0)
    going_on.entry.reservation.release()
    acc_b.journal.drop(going_on.entry)
    assert await acc_b.flush(5)
    assert recovered == [rec3.id]
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == tokens.count_text(MODEL, received)
    spent_as_the_ledger(data, caller, team, ledger_rows(data).values())
    await b.close()
    await c.close()


@pytest.mark.parametrize("first", ["taker", "recovery"])
async def test_a_takers_raise_between_two_runs_of_a_recovery_that_died_midway_is_counted_once(first: str):
    """r3's taker b charged a's part from the log ("The"; ``recovery``: not yet); a's recovery (on c)
    raises the row to a's checkpoint, b's count kept in it (or writes it), and dies after the
    caller's budget rows, before the team's. b then raises the row to what its caller received, and
    counts the difference; c runs the recovery again. The team's rows get a's checkpoint less what b
    counted, once: before, b's raise dropped what the row said b had counted (or said nothing of
    it), and the run again charged b's amounts twice (team tokens 487 for a ledger of 468)."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    if first == "taker":
        await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
        assert await acc_b.flush(5)
    c, _ = instance(data, "instance-c")
    assert isinstance(c.store, MemoryStore)
    replace = c.store.replace

    async def team_rows_fail(table: str, entity, **kw):  # the recovery dies at the team's first row
        if table == LIMITS_TABLE and entity["PartitionKey"] == team:
            raise StoreError("unavailable")
        return await replace(table, entity, **kw)

    c.store.replace = team_rows_fail  # type: ignore[method-assign]
    with pytest.raises(StoreError):
        await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    c.store.replace = replace  # type: ignore[method-assign]
    row = ledger_rows(data)[rec3.id]  # it says what a's recovery counted of it (its raise, or all)
    made = row["prompt_tokens"] + row["completion_tokens"]
    there = Charge.of(row)
    write, counted = raised(there, there, "takeover:instance-a")
    assert write is None and counted.total_tokens == made - (
        1 + going_on.entry.prompt_tokens if first == "taker" else 0
    )
    received = GENERATED + " It came back at dusk, tired and happy."
    await acc_b.charge_lost(going_on, going_on.started, received, epoch=2, patience=RAISED_WITHIN)
    going_on.entry.reservation.release()
    acc_b.journal.drop(going_on.entry)
    assert await acc_b.flush(5)
    await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    assert ledger_rows(data)[rec3.id]["completion_tokens"] == tokens.count_text(MODEL, received)
    spent_as_the_ledger(data, caller, team, ledger_rows(data).values())
    await b.close()
    await c.close()


@pytest.mark.parametrize("dies", ["after_its_ledger_row", "before_its_ledger_row"])
async def test_a_takers_raise_to_what_its_caller_received_survives_the_takers_death(dies: str):
    """r3's taker b charged a's part from the log ("The"), then at the stream's end raised it to what
    its caller received; b dies before that correction reaches the budget rows (``after_its_ledger_row``:
    the row raised, the counters not; before, the difference was lost with b: a soak ended with a
    team's spend row $0.00015 below the ledger), or before the raise reaches the ledger at all. The
    correction was journaled first: the takeovers of b and a apply it exactly once, the row at what
    the caller received, every budget row exactly the ledger."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    assert isinstance(b.store, MemoryStore)
    await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
    assert await acc_b.flush(5)
    received = GENERATED + " It came back at dusk, tired and happy."
    raised = tokens.count_text(MODEL, received)

    def lost_row() -> dict:
        return next(
            v
            for p in data.tables[USAGE_TABLE].values()
            for v, _ in p.values()
            if v["segment"] == 0 and v["request_id"] == rec3.id
        )

    b.store.inject(Fault("unavailable", table=LIMITS_TABLE, times=10**9))  # the counters stop here
    if dies == "before_its_ledger_row":
        b.store.inject(Fault("unavailable", frozenset({"replace", "batch"}), table=USAGE_TABLE, times=10**9))
    await acc_b.charge_lost(going_on, going_on.started, received, epoch=2)
    if dies == "after_its_ledger_row":
        await until(lambda: lost_row()["completion_tokens"] == raised, what="the row raised")
    else:
        await until(
            lambda: any(e["state"] == "settled" for e in (journal_doc(data, "instance-b") or {}).get("entries", [])),
            what="the correction journaled",
        )
        await asyncio.sleep(0.1)  # its ledger write fails meanwhile
        assert lost_row()["completion_tokens"] == 1
    await kill(b)
    c, _ = instance(data, "instance-c")
    await Recovery(c.store, c.ledger).recover("instance-b", "instance-c")
    await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    assert lost_row()["completion_tokens"] == raised
    rows = [values for partition in data.tables[USAGE_TABLE].values() for values, _ in partition.values()]
    assert len(rows) == 4  # r1, r2, r3's lost part, and b's continuation (charged as lost: prompt only)
    spent_as_the_ledger(data, caller, team, rows)
    await c.close()


@pytest.mark.parametrize("row", ["takers", "recoverys", "none"])
async def test_a_taker_that_dies_before_its_raise_has_its_lost_part_raised_by_its_recovery_once(row: str):
    """r3's taker b charged a's part from the log ("The"; ``recoverys``: a's recovery wrote the row at
    a's checkpoint first; ``none``: no row yet), and its continuation stood in for more of what the
    caller received, but b dies before it raises the row to it (a soak's taker killed as its stand-ins
    came: 10 of 12 tokens charged). b's journal held what it knew (``Accounting.regenerating``): b's
    recovery raises the row to it; run twice at once, then again, it counts the raise once; every
    budget row exactly the ledger."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    c, _ = instance(data, "instance-c")
    if row == "recoverys":
        await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    if row != "none":
        await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
        assert await acc_b.flush(5)
    received = GENERATED + " It came back at dusk, tired and happy."
    stood_in = [GENERATED]
    acc_b.regenerating(going_on, going_on.started, lambda: stood_in[0], lambda: 2)
    stood_in[0] = received  # the rest stood in for, and two events of unknown text

    def knows() -> bool:
        return (entry_of(data, "instance-b", f"{rec3.id}/lost2") or {}).get("generated") == raised

    raised = tokens.count_text(MODEL, received) + 2
    await until(knows, what="b's journal knows the part")
    await kill(b)
    await asyncio.gather(*(Recovery(c.store, c.ledger).recover("instance-b", "instance-c") for _ in range(2)))
    await Recovery(c.store, c.ledger).recover("instance-b", "instance-c")
    rows = [values for partition in data.tables[USAGE_TABLE].values() for values, _ in partition.values()]
    assert [r["completion_tokens"] for r in rows if r["request_id"] == rec3.id and r["segment"] == 0] == [raised]
    await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    rows = [values for partition in data.tables[USAGE_TABLE].values() for values, _ in partition.values()]
    assert [r["completion_tokens"] for r in rows if r["request_id"] == rec3.id and r["segment"] == 0] == [raised]
    assert len(rows) == 4  # r1, r2, r3's lost part, and b's continuation (charged as lost: prompt only)
    spent_as_the_ledger(data, caller, team, rows)
    await c.close()


async def test_what_a_taker_knows_as_it_raises_is_journaled_at_once_not_at_the_next_interval():
    """b's knowledge of a's lost part grows just before b raises the part's row (its continuation's
    last stand-ins came), and b dies before the raise lands (the store does not answer it): b's
    journal holds what b knew then, written as the raise starts, not up to an interval later (a
    soak's taker killed 0.3 s after: 36 of 41 tokens charged). b's journal interval is long here,
    so only that write can carry it; b's recovery raises the row to it."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    known = [GENERATED]
    raise_part = acc_b.regenerating(going_on, going_on.started, lambda: known[0], lambda: 0)

    def journaled() -> int | None:
        return (entry_of(data, "instance-b", f"{rec3.id}/lost2") or {}).get("generated")

    def etag() -> str:
        return data.blobs[journal_name("instance-b")][1]

    await until(lambda: journaled() == tokens.count_text(MODEL, GENERATED), what="b's journal knows the part")
    b.journal.interval, before = 30.0, etag()
    await until(lambda: etag() != before, what="b's journal written once more (its writer then waits 30 s)")
    await asyncio.sleep(0.05)
    known[0] = GENERATED + " It came back at dusk, tired and happy."
    raised = tokens.count_text(MODEL, known[0])
    assert isinstance(b.store, MemoryStore)
    b.store.inject(Fault("unavailable", table=USAGE_TABLE, times=10**6))  # the raise does not land
    raise_part(RAISED_WITHIN)
    await until(lambda: journaled() == raised, what="b's journal knows what b raises to", within=2.0)
    await kill(b)
    c, _ = instance(data, "instance-c")
    await Recovery(c.store, c.ledger).recover("instance-b", "instance-c")
    await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    rows = [values for partition in data.tables[USAGE_TABLE].values() for values, _ in partition.values()]
    assert [r["completion_tokens"] for r in rows if r["request_id"] == rec3.id and r["segment"] == 0] == [raised]
    await c.close()


async def test_a_takers_raise_made_by_its_recovery_counts_in_the_budgets_after_its_continuation_let_go():
    """As above (row "takers"), and b's continuation has ended, its reservation given back, before b
    dies with the raise still in its journal (the endpoint raises once the continuation is over: a
    continuation that ended short, a drain's). b's entry stays in each budget row while its journal
    knows the lost part, holding nothing (``Counters.keep``), so b's recovery counts the raise in
    the rows as in the ledger (before that: 439 taken for 470 in the ledger, the 31 tokens the raise
    added)."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    c, _ = instance(data, "instance-c")
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
    assert await acc_b.flush(5)
    received = GENERATED + " It came back at dusk, tired and happy."
    acc_b.regenerating(going_on, going_on.started, lambda: received, lambda: 2)
    raised = tokens.count_text(MODEL, received) + 2

    def knows() -> bool:
        return (entry_of(data, "instance-b", f"{rec3.id}/lost2") or {}).get("generated") == raised

    await until(knows, what="b's journal knows the part")
    going_on.entry.reservation.release()  # the continuation is over (let go: charged_by_its_taker)
    acc_b.journal.drop(going_on.entry)
    assert await acc_b.flush(5)
    await kill(b)
    await Recovery(c.store, c.ledger).recover("instance-b", "instance-c")
    await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    rows = [values for partition in data.tables[USAGE_TABLE].values() for values, _ in partition.values()]
    assert [r["completion_tokens"] for r in rows if r["request_id"] == rec3.id and r["segment"] == 0] == [raised]
    spent_as_the_ledger(data, caller, team, rows)
    await c.close()


async def test_a_takers_entry_kept_for_its_lost_part_leaves_the_budget_rows_once_it_raised_the_part():
    """As above, b alive: while its journal knows the lost part, b's entry stays in each budget row
    it would count in (holding nothing once the continuation let go: ``Counters.keep``); b raises
    the part itself, and its holding leaves the rows; every budget row exactly the ledger."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    c, _ = instance(data, "instance-c")
    acc_b, going_on = await taking_over(b, caller, rec3.id)
    await acc_b.charge_lost(going_on, going_on.started, "The", epoch=2)
    assert await acc_b.flush(5)
    received = GENERATED + " It came back at dusk, tired and happy."
    regenerated = acc_b.regenerating(going_on, going_on.started, lambda: received, lambda: 2)
    going_on.entry.reservation.release()
    acc_b.journal.drop(going_on.entry)
    for _ in range(2):  # its continuation let go, then its raise in (not yet regenerated)
        assert await acc_b.flush(5)
        for partition in (caller.limits_partition, team):
            assert parse_holds(counter(data, partition, "tokens")["holds"])["instance-b"].held == 0
        await acc_b.charge_lost(going_on, going_on.started, received, epoch=2, floor=2)
    await regenerated(0.0)  # (raised already)
    assert await acc_b.flush(5)
    await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    rows = [values for partition in data.tables[USAGE_TABLE].values() for values, _ in partition.values()]
    raised = tokens.count_text(MODEL, received) + 2
    assert [r["completion_tokens"] for r in rows if r["request_id"] == rec3.id and r["segment"] == 0] == [raised]
    spent_as_the_ledger(data, caller, team, rows)  # (and no entry left in a row)
    await b.close()
    await c.close()


async def test_a_part_settled_by_its_live_producer_after_its_taker_charged_it_is_counted_once():
    """A stream handed over (or taken from an instance that was only slow): the taker b charges the
    producer's part from the log (segment 0) and goes on; the producer a, alive, settles the same
    part afterwards. One row per part, and the budget rows hold exactly the ledger (before, a's
    settle entered the counters too: one part counted twice)."""
    data = account()
    a, acc_a, b, acc_b, caller, price = await setup(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    first, rec = await admit(acc_a, caller, "a story")
    assert isinstance(first, Admission)
    taken = record()
    taken.id = taken.request_id = rec.id  # the taker charges under the stream's request id
    going_on = await acc_b.admit(caller, asked(call("a story"), taken))
    assert isinstance(going_on, Admission)
    await acc_b.charge_lost(going_on, first.started, "Once upon a time", epoch=2)
    assert going_on.lost_raise is not None
    await asyncio.wait_for(going_on.lost_raise.written.wait(), 5)  # journaled, then in the ledger
    rec.hung_up()
    finish(acc_a, first, rec, None, generated={0: ["Once upon a time there was a fox"]})
    finish(acc_b, going_on, taken, usage(40, 12))
    assert await acc_a.flush(5) and await acc_b.flush(5)
    rows = [values for partition in data.tables[USAGE_TABLE].values() for values, _ in partition.values()]
    assert sorted((r["segment"], r["author"]) for r in rows) == [(0, "instance-b"), (20, "instance-b")]
    spent_as_the_ledger(data, caller, team, rows)
    await a.close()
    await b.close()


async def test_a_slow_instance_whose_journal_was_sealed_stops_owning_what_it_had_listed():
    data = account()
    a, acc_a, b, acc_b, caller, price = await setup(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    r1, rec1 = await admit(acc_a, caller, "one")
    assert isinstance(r1, Admission)
    r1.entry.generated = lambda: {0: GENERATED}
    await until(lambda: bool((entry_of(data, "instance-a", rec1.id) or {}).get("generated")), what="checkpoint")
    # a is only slow: b finds it dead and takes it over (r1 is charged as lost at its checkpoint).
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    lost = ledger_rows(data)[rec1.id]
    assert lost["ended"] == "lost"
    # a wakes up: r1 ends with the upstream's usage; a must not charge it (b did), nor hold for it.
    finish(acc_a, r1, rec1, usage(r1.entry.prompt_tokens, 500))
    await until(lambda: r1.entry.taken_over, what="a learns its journal was sealed: r1 is not its own any more")
    r2, rec2 = await admit(acc_a, caller, "two")  # what comes after is a's, under a new journal
    assert isinstance(r2, Admission)
    finish(acc_a, r2, rec2, usage(10, 5))
    assert await acc_a.flush(5)
    rows = ledger_rows(data)
    assert set(rows) == {rec1.id, rec2.id}
    assert rows[rec1.id] == lost
    cost = lost["cost"] + price.cost(10, 0, 5)
    spent_exactly(data, caller, team, lost["prompt_tokens"] + lost["completion_tokens"] + 15, cost)
    await a.close()
    await b.close()


@pytest.mark.parametrize("sealed", ["before", "after"])
async def test_a_slow_instance_declared_dead_before_its_journal_meets_the_seal_counts_nothing_twice(sealed):
    """a is only slow: r1 is settled, in a's journal and in the ledger, but not in the budget rows yet
    (a's counter writes fail). b takes a's instance row (``taken_by``) and a's next beat moves a to a
    new id; b settles a's journal (r1 into the rows) ``before`` a's journal writes again, now under
    its new name, or ``after`` it tried. a's journal never meets the seal, yet knows that what it had
    listed is b's (the old journal sealed or gone, or still there while b's takeover is not over: it
    waits), so a's counters do not bring r1 into the rows a second time (they did: 300 for 150)."""
    data = account()
    a, acc_a, b, acc_b, caller, price = await setup(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    r1, rec1 = await admit(acc_a, caller, "one")
    assert isinstance(r1, Admission) and isinstance(a.store, MemoryStore)
    rows_blocked = a.store.inject(Fault("unavailable", frozenset({"replace"}), table=LIMITS_TABLE, times=10**9))
    finish(acc_a, r1, rec1, usage(100, 50))
    await until(lambda: r1.entry.written.is_set(), what="r1 journaled settled, and in the ledger")
    journal_blocked = a.store.inject(Fault("unavailable", frozenset({"put"}), table="blob", times=10**9))
    taken = {"PartitionKey": "instances", "RowKey": "instance-a", "taken_by": "instance-b", "at": 0.0}
    await b.store.upsert(STREAMS_TABLE, taken)
    await until(lambda: a.instances.id != "instance-a", within=10, what="a's beat finds its row taken: a new id")
    if sealed == "after":
        journal_blocked.times = 0
        acc_a.write_checkpoints()
        await asyncio.sleep(0.5)
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    await b.store.delete(STREAMS_TABLE, "instances", "instance-a")  # the takeover is over
    rows_blocked.times = journal_blocked.times = 0
    assert await acc_a.flush(5)
    assert r1.entry.taken_over
    spent_as_the_ledger(data, caller, team, ledger_rows(data).values())
    await a.close()
    await b.close()


@pytest.mark.parametrize("first", ["journal", "counters"])
async def test_a_slow_instance_that_learns_of_its_takeover_before_a_listed_request_ends_charges_it_once(first, caplog):
    """a is only slow: b takes it over with r0 and r1 open (both charged as lost at their checkpoints).
    a learns of it from its journal (a write meets the seal) and from its counters (an exchange finds
    its holding gone: r0's settle), in either order, and only then does r1 end: r1 is b's, charged once
    (the takeover's row); a's counters neither charge it again nor keep a holding for it in a row."""
    data = account()
    a, acc_a, b, acc_b, caller, price = await setup(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    r0, rec0 = await admit(acc_a, caller, "zero")
    r1, rec1 = await admit(acc_a, caller, "one")
    assert isinstance(r0, Admission) and isinstance(r1, Admission)
    r1.entry.generated = lambda: {0: GENERATED}
    await until(lambda: bool((entry_of(data, "instance-a", rec1.id) or {}).get("generated")), what="checkpoint")
    assert isinstance(a.store, MemoryStore)
    blocked = a.store.inject(Fault("unavailable", frozenset({"put"}), table="blob", times=10**9))
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    lost = ledger_rows(data)
    assert {lost[r.id]["ended"] for r in (rec0, rec1)} == {"lost"}
    if first == "journal":
        blocked.times = 0
        await until(lambda: r0.entry.taken_over and r1.entry.taken_over, what="a's journal meets the seal")
    finish(acc_a, r0, rec0, usage(r0.entry.prompt_tokens, 3))  # its settle's exchange finds a's entry gone
    await until(lambda: "was taken over from this instance elsewhere" in caplog.text, what="a's counters learn")
    finish(acc_a, r1, rec1, usage(r1.entry.prompt_tokens, 500))
    if first == "counters":
        await until(lambda: r1.entry.state == "settled", what="r1 settled before the journal can tell a of the seal")
        blocked.times = 0
        await until(lambda: r0.entry.taken_over and r1.entry.taken_over, what="a's journal meets the seal")
    assert await acc_a.flush(5)
    assert ledger_rows(data) == lost
    spent_as_the_ledger(data, caller, team, lost.values())
    await a.close()
    await b.close()


async def test_the_duty_holder_takes_a_dead_instance_over_by_itself():
    fast = InstanceTiming(beat_seconds=0.05, lease_seconds=0.3, duty_seconds=0.05, fresh_seconds=0)
    data = account()
    a, acc_a = instance(data, "instance-a", fast)
    b, acc_b = instance(data, "instance-b", fast)
    await a.registry.create(CallerSpec(name="c", token_budget=100_000, budget_period="day"))
    caller = await a.registry.get(Caller, "c")
    r1, rec1 = await admit(acc_a, caller, "one")
    assert isinstance(r1, Admission)
    r1.entry.generated = lambda: {0: GENERATED}
    await until(lambda: bool((entry_of(data, "instance-a", rec1.id) or {}).get("generated")), what="checkpoint")
    b.instances.serve()  # b serves too
    await kill(a)
    instances = data.tables[STREAMS_TABLE]["instances"]
    assert "instance-a" in instances
    await until(lambda: "instance-a" not in instances, what="b takes a over (its row goes once it is settled)")
    row = counter(data, caller.limits_partition, "tokens")
    assert not parse_holds(row.get("holds"))
    assert row["taken"] == r1.entry.prompt_tokens + tokens.count_text(MODEL, GENERATED)
    assert ledger_rows(data)[rec1.id]["ended"] == "lost"
    await b.close()


@pytest.mark.parametrize(("answered", "blob_seconds", "counter_seconds"), [(5, 0.0, 0.0), (5, 0.2, 0.0), (0, 0.0, 0.2)])
async def test_a_graceful_stop_settles_and_writes_everything_and_leaves_no_journal(
    answered, blob_seconds, counter_seconds
):
    """Also when each journal write, or each counter write, takes a while: the stop waits for the
    journal's write in flight, and its last word (nothing is owed: it goes) is written after the
    counters gave back what they held."""
    data = account()
    a, acc_a, b, acc_b, caller, price = await setup(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    assert isinstance(a.store, MemoryStore)
    a.store.inject(Fault("slow", frozenset({"replace"}), table=LIMITS_TABLE, delay=counter_seconds, times=1000))
    done = []
    for i in range(answered):
        r, rec = await admit(acc_a, caller, f"request {i}")
        assert isinstance(r, Admission)
        finish(acc_a, r, rec, usage(30 + i, 7))
        done.append(rec.id)
    for _ in range(2):  # no upstream took these: released, nothing charged
        r, rec = await admit(acc_a, caller, "never answered")
        assert isinstance(r, Admission)
        finish(acc_a, r, rec, None, answered=False)
    a.store.inject(Fault("slow", frozenset({"put", "delete_blob"}), delay=blob_seconds, times=1000))
    await a.close()
    assert set(ledger_rows(data)) == set(done)
    tokens_ = sum(37 + i for i in range(answered))
    spent_exactly(data, caller, team, tokens_, sum(price.cost(30 + i, 0, 7) for i in range(answered)))
    assert journal_doc(data, "instance-a") is None
    await b.close()


async def test_a_budgets_first_hold_waits_for_a_journal_write_not_for_the_pause_between_writes():
    """The journal must list a budget counter before this instance holds any of it: one write
    (microseconds here), not the rest of the journal's half-second pause after its last write (a
    caller with a budget asking again once its previous request was settled everywhere, or just
    after another caller's request, waited up to 0.5 s)."""
    import time

    data = account()
    a, acc = instance(data, "instance-a", journal_seconds=0.5)  # the app's interval
    one, _ = await a.registry.create(CallerSpec(name="one", token_budget=10**9))
    two, _ = await a.registry.create(CallerSpec(name="two", token_budget=10**9))
    tokens.count_text(MODEL, "the tokenizer's tables are built once")
    first, _ = await admit(acc, one, "first")  # the journal is written for it, then pauses
    assert isinstance(first, Admission)
    started = time.monotonic()
    second, _ = await admit(acc, two, "second")
    waited = time.monotonic() - started
    assert isinstance(second, Admission)
    assert waited < 0.25, waited
    await a.close()


async def one_request_settled(a: SharedState, acc: Accounting) -> Caller:
    """A caller with a token budget, its first request settled everywhere (on instance ``a``)."""
    caller, _ = await a.registry.create(CallerSpec(name="c", token_budget=10**9))
    first, rec = await admit(acc, caller, "first")
    assert isinstance(first, Admission)
    finish(acc, first, rec, usage(10, 10))
    assert await acc.flush(5)
    return caller


async def test_a_budget_counter_stays_listed_for_listed_seconds_then_the_empty_journal_goes(monkeypatch):
    """A request settled everywhere leaves its budget counter listed for ``LISTED_SECONDS`` (the
    caller's next request holds it without a journal write first); once that lapses, the journal,
    listing nothing, is written again by itself: deleted."""
    monkeypatch.setattr(journal, "LISTED_SECONDS", 0.6)
    data = account()
    a, acc = instance(data, "instance-a")
    caller = await one_request_settled(a, acc)
    doc = journal_doc(data, "instance-a")
    assert doc is not None and not doc["entries"] and doc["counters"] == [f"{caller.limits_partition}/tokens"]
    await until(lambda: journal_doc(data, "instance-a") is None, within=3.0, what="the lapse")
    await a.close()


async def test_a_budget_held_again_while_the_write_that_drops_its_counter_is_in_flight_stays_listed(monkeypatch):
    """A budget counter lapses (``LISTED_SECONDS``): the write that drops it is in flight (a slow
    delete of the empty journal) when the caller's next request holds the budget again. That hold
    waits for a journal that lists the counter, not for the write in flight: if the instance dies
    then, its takeover gives the hold back (it stayed in the row for good)."""
    monkeypatch.setattr(journal, "LISTED_SECONDS", 0.3)
    data = account()
    a, acc = instance(data, "instance-a")
    b, _ = instance(data, "instance-b")
    caller = await one_request_settled(a, acc)
    assert isinstance(a.store, MemoryStore)
    a.store.inject(Fault("slow", frozenset({"delete_blob"}), table="blob", delay=1.0))
    await until(lambda: data.calls.get("delete_blob", 0) >= 1, what="the lapse's write in flight")
    second = asyncio.ensure_future(admit(acc, caller, "second"))

    def held() -> bool:
        return "instance-a" in parse_holds(counter(data, caller.limits_partition, "tokens").get("holds"))

    await until(held, what="the budget held again")
    await kill(a)
    second.cancel()
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    row = counter(data, caller.limits_partition, "tokens")
    charged = sum(r["prompt_tokens"] + r["completion_tokens"] for r in ledger_rows(data).values())
    assert not held() and row["taken"] == charged, row  # (the second charged as lost if it was listed)
    await b.close()


async def test_a_hold_whose_answer_was_lost_is_listed_until_known_so_a_takeover_gives_it_back():
    """The first write of a budget's hold lands but its answer is lost: until the row is read back
    the instance does not know it holds anything, yet the journal must go on listing the counter;
    if the instance dies meanwhile, the takeover gives the hold back."""
    data = account()
    a, acc_a = instance(data, "instance-a")
    b, _ = instance(data, "instance-b")
    x, _ = await a.registry.create(CallerSpec(name="x", token_budget=100_000))
    y, _ = await a.registry.create(CallerSpec(name="y"))
    assert isinstance(a.store, MemoryStore)
    a.store.inject(Fault("lose_answer", frozenset({"insert"}), table=LIMITS_TABLE))
    lost, _ = await admit(acc_a, x, max_tokens=100)
    assert isinstance(lost, Unavailable)  # the store may have taken it: not known yet
    assert "instance-a" in (counter(data, x.limits_partition, "tokens").get("holds") or "")
    other, _ = await admit(acc_a, y)  # another request: the journal is written again meanwhile
    assert isinstance(other, Admission)
    await until(lambda: other.entry.listed, what="a journal write")
    await kill(a)  # before the lost answer is looked into
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    row = counter(data, x.limits_partition, "tokens")
    assert not parse_holds(row.get("holds")) and row["taken"] == 0, row
    await b.close()


@pytest.mark.parametrize("fault", ["lose_answer", "unavailable"])
async def test_a_journal_write_whose_answer_was_lost_is_not_taken_for_a_seal(fault, monkeypatch):
    """A journal write lands but its answer is lost (or the delete of an empty journal fails): the
    next write meets a blob it did not expect. That is this instance's own journal, not a takeover's
    seal: nothing it listed may be dropped, every charge is written and counted."""
    monkeypatch.setattr(journal, "LISTED_SECONDS", 0.0)  # an empty journal goes at once (its delete fails)
    data = account()
    a, acc_a = instance(data, "instance-a")
    caller, _ = await a.registry.create(CallerSpec(name="c", token_budget=100_000))
    assert isinstance(a.store, MemoryStore)
    if fault == "unavailable":  # a journal that went empty and could not be deleted
        first, rec = await admit(acc_a, caller, "first")
        assert isinstance(first, Admission)
        a.store.inject(Fault("unavailable", frozenset({"delete_blob"})))
        finish(acc_a, first, rec, usage(10, 10))
        assert await acc_a.flush(5)
        assert journal_doc(data, "instance-a") is not None  # left there
    r1, rec1 = await admit(acc_a, caller, "one")
    assert isinstance(r1, Admission)
    r1.entry.generated = lambda: {0: GENERATED}
    await until(lambda: bool((entry_of(data, "instance-a", rec1.id) or {}).get("generated")), what="listed")
    if fault == "lose_answer":
        lost = a.store.inject(Fault("lose_answer", frozenset({"put"})))
        r1.entry.generated = lambda: {0: GENERATED + " more"}  # the next checkpoint's write: its answer is lost
        await until(lambda: lost.times == 0, what="the lost write")
    finish(acc_a, r1, rec1, usage(50, 20))
    assert await acc_a.flush(5)
    assert not r1.entry.taken_over
    rows = ledger_rows(data)
    assert rows[rec1.id]["ended"] == "completed" and rows[rec1.id]["author"] == "instance-a"
    expected = 70 + (20 if fault == "unavailable" else 0)
    assert counter(data, caller.limits_partition, "tokens")["taken"] == expected
    await a.close()
    assert journal_doc(data, "instance-a") is None


async def test_an_instance_that_dies_mid_stream_is_charged_what_it_had_generated():
    """Through the endpoint: a streamed request checkpoints what it has generated into the journal
    as it goes; the instance dies mid-answer; the takeover charges the prompt and those tokens."""
    import httpx
    from starlette.applications import Starlette
    from starlette.routing import Route

    from chatstream.apis.openai_chat import OpenAIChatApi
    from chatstream.endpoint import Endpoint
    from chatstream.pipeline import Pipeline

    from .test_failover import ScriptedClient, ScriptedStream, chunk, pooled

    pieces = [f" word{i}" for i in range(12)]

    class Slow(ScriptedStream):
        async def _run(self):
            yield chunk(role=True)
            for piece in pieces:
                yield chunk(piece)
                await asyncio.sleep(0.02)
            await asyncio.Event().wait()  # the rest never comes: the instance dies first

    data = account()
    a, acc_a = instance(data, "instance-a")
    b, _ = instance(data, "instance-b")
    caller, key = await a.registry.create(CallerSpec(name="c", token_budget=100_000))
    upstreams = pooled({"u": ScriptedClient(Slow([]))})
    endpoint = Endpoint(OpenAIChatApi(), upstreams.settings, upstreams, Pipeline(), acc_a)

    async def handler(request):
        return await endpoint(request)

    app = Starlette(routes=[Route("/v1/chat/completions", handler, methods=["POST"])])
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "stream": True}
    asking = asyncio.ensure_future(
        http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    )
    generated = tokens.count_text(MODEL, "".join(pieces))

    def checkpointed() -> bool:
        doc = journal_doc(data, "instance-a") or {}
        return any(e.get("generated") == generated for e in doc.get("entries") or [])

    await until(checkpointed, what="the journal's checkpoint of everything generated")
    await kill(a)
    asking.cancel()
    await asyncio.gather(asking, return_exceptions=True)
    await http.aclose()
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    [row] = ledger_rows(data).values()
    assert row["ended"] == "lost" and row["completion_tokens"] == generated
    taken = counter(data, caller.limits_partition, "tokens")["taken"]
    assert taken == row["prompt_tokens"] + generated and not parse_holds(
        counter(data, caller.limits_partition, "tokens").get("holds")
    )
    await b.close()


STREAM = "s" * 30  # a resumable stream's id


async def streaming_on_a(data: MemoryData, checkpoint: str, epoch: int = 1):
    """On instance a: one open request producing resumable stream ``STREAM``, its checkpoint
    ``checkpoint`` in the journal, as its ``epoch``-th producer; then a dies. (a, b, caller, its record, the team's partition)."""
    a, acc_a, b, _, caller, _ = await setup(data)
    r, rec = await admit(acc_a, caller, "tell")
    assert isinstance(r, Admission)
    r.entry.generated = lambda: {0: checkpoint}
    if epoch > 1:  # a took the stream over (Endpoint.take_over): its own block of segments
        r.entry.segment = (epoch - 1) * 20
    acc_a.produces(r, STREAM, epoch)

    def journaled() -> bool:
        entry = entry_of(data, "instance-a", rec.id)
        return bool(entry and entry.get("stream") == STREAM and entry.get("generated"))

    await until(journaled, what="the journal lists the stream and its checkpoint")
    await kill(a)
    team = (await b.registry.get(Team, "t")).limits_partition
    return a, b, caller, rec, team


async def logged(b: SharedState, *parts: str | int, end: bool = True, inline: bool = False) -> None:
    """The stream's record and log, as its producers stored them: chat-completions chunks of each
    text of ``parts``; an int E there: the fence of the E-th producer's takeover. ``inline``: a
    stream that ended before its blob was made, its log in its record."""
    from chatstream import sse
    from chatstream.state.streamlog.format import END, RECORD_ROW, epoch_marker

    record = {"PartitionKey": STREAM, "RowKey": RECORD_ROW, "route": "openai"}
    if not inline:
        await b.store.insert(STREAMS_TABLE, record)
        await b.store.append_create(STREAM)
    log_, number, epoch = b"", 0, 1
    for part in parts:
        if isinstance(part, int):
            log_ += epoch_marker(part, number)
            epoch = part
            continue
        for word in part.split(" "):
            number = (epoch - 1) * 1_000_000 + (number % 1_000_000) + 1
            chunk = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": word + " "}}]}
            log_ += sse.numbered(number, b"data: " + json.dumps(chunk).encode() + sse.END_OF_EVENT)
    log_ += sse.comment(END) if end else b""
    if inline:
        await b.store.insert(STREAMS_TABLE, {**record, "state": "ended", "events": log_.decode()})
    else:
        await b.store.append(STREAM, log_, at=0)


def told(route: str, events: bytes) -> str:
    from chatstream.app import _told

    return _told(route, events)


@pytest.mark.parametrize("inline", [False, True])
async def test_a_stream_that_finished_before_its_charge_was_saved_is_charged_what_its_log_holds(inline: bool):
    """A resumable stream finished on a (its log holds the whole answer and its end) and a died
    before its charge was in the journal, whose last checkpoint is short of the end (a chaos soak:
    40 tokens sent, 39 charged). The takeover charges what the log holds; the budgets follow.
    ``inline``: a short stream, ended before its blob was made: its log is in its record (a soak:
    41 charged of 42 its caller read)."""
    data = account()
    a, b, caller, rec, team = await streaming_on_a(data, GENERATED)
    whole = GENERATED + " It came back at dusk, tired and happy."
    await logged(b, whole, inline=inline)
    await Recovery(b.store, b.ledger, told).recover("instance-a", "instance-b")
    [row] = ledger_rows(data).values()
    sent = tokens.count_text(MODEL, "".join(word + " " for word in whole.split(" ")))  # (logged's chunks)
    assert sent > tokens.count_text(MODEL, GENERATED)
    assert row["ended"] == "lost" and row["author"] == "takeover:instance-a" and row["completion_tokens"] == sent
    spent_as_the_ledger(data, caller, team, [row])
    await Recovery(b.store, b.ledger, told).recover("instance-a", "instance-b")  # again: adds nothing
    spent_as_the_ledger(data, caller, team, ledger_rows(data).values())
    await b.close()


@pytest.mark.parametrize("checkpoint", ["The", GENERATED + " " + GENERATED])
async def test_a_dead_producers_part_is_its_own_of_the_log_and_never_less_than_its_checkpoint(checkpoint: str):
    """a was the stream's second producer (it took it over): the log has the first producer's part,
    a's fence and part, and a third producer's after it. a's entry is charged a's part only; a
    checkpoint above what the log holds (the log is stored every few seconds) stays the charge."""
    data = account()
    a, b, caller, rec, team = await streaming_on_a(data, checkpoint, epoch=2)
    await logged(b, "first producer's words", 2, GENERATED, 3, "third producer's many many words", end=False)
    await Recovery(b.store, b.ledger, told).recover("instance-a", "instance-b")
    [row] = ledger_rows(data).values()
    from chatstream.state.streamlog.format import producer_events

    part = told("openai", producer_events(bytes(data.blobs[STREAM][0]), 2))
    assert part.split() == GENERATED.split()
    want = max(tokens.count_text(MODEL, part), tokens.count_text(MODEL, checkpoint))
    assert row["completion_tokens"] == want and row["segment"] == 20
    spent_as_the_ledger(data, caller, team, [row])
    await b.close()


async def test_a_stream_whose_taker_charged_the_log_first_is_not_charged_again():
    """a died mid-stream; a reader resumed it on b first, which charged a's part from the log (and
    what its caller received beyond it). The recovery finds that row at no less than the log: it is
    the taker's to count, and nothing is counted twice."""
    data = account()
    a, b, caller, rec, team = await streaming_on_a(data, "The")
    await logged(b, GENERATED, end=False)
    acc_b = await charged_by_its_taker(b, caller, rec.id, GENERATED + " and more")
    await Recovery(b.store, b.ledger, told).recover("instance-a", "instance-b")
    assert await acc_b.flush(5)
    rows = [r for r in ledger_rows(data).values()]
    [row] = [r for r in rows if r["ended"] == "lost"]
    assert row["completion_tokens"] == tokens.count_text(MODEL, GENERATED + " and more")
    assert row["author"] == "instance-b"
    spent_as_the_ledger(data, caller, team, rows)
    await b.close()


def test_a_checkpoint_counts_the_text_as_a_whole_however_it_arrived():
    """The journal's checkpoint of an open request, taken as its text grows in pieces that split
    words, counts what counting the whole text counts (before, the pieces were counted apart: in
    the chaos soak a lost part of 41 tokens was charged 48)."""
    from chatstream.state.journal import JournalEntry
    from chatstream.state.ledger import Payer

    whole = "lorem ipsum dolor sit amet consectetur adipiscing elit " * 6
    so_far = {0: ""}
    payer = Payer(caller="c", caller_id="c1", request_id="r", endpoint="openai", day="20261204")
    entry = JournalEntry("r", payer, MODEL, 3, {}, generated=lambda: so_far)
    for end in range(0, len(whole) + 1, 7):
        so_far[0] = whole[:end]
        assert entry.checkpoint() == tokens.count_text(MODEL, whole[:end])
    so_far[0] = whole
    assert entry.checkpoint() == tokens.count_text(MODEL, whole)


def test_the_journal_stores_a_counter_as_partition_slash_row_as_older_versions_read_and_wrote_it():
    """In memory a budget counter is a CounterKey; the journal document keeps the older "partition/row"
    strings, so a journal written before (or after) is taken over the same."""
    from chatstream.state.counter_row import CounterKey
    from chatstream.state.journal import JournalEntry
    from chatstream.state.ledger import Payer

    key = CounterKey("team:t|1", "tokens")
    assert str(key) == "team:t|1/tokens" and CounterKey.parse("team:t|1/tokens") == key
    payer = Payer(caller="c", caller_id="c1", team="t", team_id="1", request_id="r", endpoint="openai", day="20261204")
    spend = CounterKey("team:t|1", "spend")
    doc = json.loads(JournalEntry("r", payer, MODEL, 3, {key: 100, spend: 7}).serialised())
    assert doc["needs"] == {"team:t|1/tokens": 100, "team:t|1/spend": 7}
    # What the previous version wrote besides ("kinds", a lost part's "lost" flag) is read the same.
    older = {**doc, "kinds": {"team:t|1/tokens": "tokens", "team:t|1/spend": "spend"}, "lost": True}
    assert JournalEntry.read(older).serialised() == JournalEntry.read(doc).serialised()


async def test_a_background_responses_usage_seen_is_journaled_and_charged_once_if_its_instance_dies():
    """A background response read back over on B (its usage seen) is charged there: journaled first,
    like every charge. B dies before the ledger row lands; A's takeover writes the row and corrects
    the budgets, exactly."""
    data = account()
    a, acc_a, b, acc_b, caller, price = await setup(data)
    admitted, rec = await admit(acc_a, caller, max_output_tokens=1000, background=True)
    assert isinstance(admitted, Admission)
    await acc_a.own("response", "resp_bg", admitted, background=True)
    finish(acc_a, admitted, rec, None)  # over here; the response goes on upstream: its reservation held
    assert await acc_a.flush(5)
    assert isinstance(b.store, MemoryStore)
    going, _ = await admit(acc_b, caller, "going on")  # B holds capacity of the budgets meanwhile
    assert isinstance(going, Admission)
    b.store.inject(Fault("unavailable", table=USAGE_TABLE, times=10**9))
    await acc_b.charge_seen(caller, "response", "resp_bg", MODEL, Used(40, 0, 60), "responses")
    await until(lambda: entry_of(data, "instance-b", "resp_bg/seen") is not None, what="journaled on B")
    assert ledger_rows(data) == {}
    await kill(b)
    team = (await a.registry.get(Team, "t")).limits_partition
    for _ in range(2):  # a second takeover adds nothing
        await Recovery(a.store, a.ledger).recover("instance-b", "instance-a")
        rows = ledger_rows(data)
        assert len(rows) == 2 and rows[going.entry.key]["ended"] == "lost"
        row = rows["resp_bg"]
        assert (row["prompt_tokens"], row["completion_tokens"], row["ended"]) == (40, 60, "background")
        assert row["cost"] == price.cost(40, 0, 60)
        spent_as_the_ledger(data, caller, team, rows.values())
    await a.close()


@pytest.mark.parametrize("at_once", [False, True])
@pytest.mark.parametrize("dies", ["before_it_is_applied", "after_it_is_applied"])
@pytest.mark.parametrize("completion", [60, 3000])
async def test_a_correction_by_an_instance_that_never_held_its_budgets_is_applied_once_if_it_dies(
    completion: int, dies: str, at_once: bool
):
    """As above, but B never reserved against the budgets: it holds no part of their rows. Its
    correction (``completion`` 60: a give-back, the response used less than it reserved; 3000: more)
    is journaled, and B dies before it reaches the rows, or after, its journal still listing it
    (its journal writes fail from then on). The takeover applies it exactly once; two at once
    (``at_once``), or a second one after, add nothing. Before, it was lost: a takeover gave back
    only in rows where the dead instance had a holding (a row 908 tokens above the ledger)."""
    data = account()
    a, acc_a, b, acc_b, caller, price = await setup(data)
    admitted, rec = await admit(acc_a, caller, max_output_tokens=1000, background=True)
    assert isinstance(admitted, Admission)
    await acc_a.own("response", "resp_bg", admitted, background=True)
    finish(acc_a, admitted, rec, None)
    assert await acc_a.flush(5)
    assert isinstance(b.store, MemoryStore)
    ledger_down = b.store.inject(Fault("unavailable", table=USAGE_TABLE, times=10**9))
    await acc_b.charge_seen(caller, "response", "resp_bg", MODEL, Used(40, 0, completion), "responses")
    await until(lambda: entry_of(data, "instance-b", "resp_bg/seen") is not None, what="journaled on B")
    assert ledger_rows(data) == {}
    if dies == "after_it_is_applied":
        b.store.inject(Fault("unavailable", frozenset({"put"}), table="blob", times=10**9))
        ledger_down.times = 0
        await until(
            lambda: counter(data, caller.limits_partition, "tokens")["taken"] == 40 + completion,
            what="the correction in the caller's row",
        )
        assert entry_of(data, "instance-b", "resp_bg/seen") is not None
    await kill(b)
    team = (await a.registry.get(Team, "t")).limits_partition
    c, _ = instance(data, "instance-c")
    recoveries = [Recovery(a.store, a.ledger).recover("instance-b", "instance-a")]
    recoveries.append(Recovery(c.store, c.ledger).recover("instance-b", "instance-c"))
    if at_once:
        await asyncio.gather(*recoveries)
    else:
        for recovery in recoveries:
            await recovery
    rows = ledger_rows(data)
    assert list(rows) == ["resp_bg"] and rows["resp_bg"]["cost"] == price.cost(40, 0, completion)
    spent_as_the_ledger(data, caller, team, rows.values())
    assert journal_doc(data, "instance-b") is None
    await a.close()
    await c.close()


@pytest.mark.parametrize(("period", "days"), [("day", 1), ("month", 31)])
async def test_a_charge_whose_window_ended_before_it_entered_its_row_is_not_applied_to_the_next_window(
    period: str, days: int
):
    """A settles r1 late in a budget window (its ledger row cannot be written: the charge stays
    staged, and its journal lists it settled); the window ends (the store's clock moves ``days``
    on), and r2, admitted in the new window, takes A's entry into the rows of the new window, whose
    ``applied`` number knows nothing of r1 (books of a window that ended are dropped). A dies. The
    takeover charges r1's ledger row, and the new window's rows r2 alone: r1's window is over."""
    shift = [0.0]
    clock = ticking()
    data = MemoryData(wall=lambda: clock() + shift[0])
    a, acc_a = instance(data, "instance-a")
    b, _ = instance(data, "instance-b")
    price = await a.registry.set_price(MODEL, PriceSpec(input=1, cached_input=0.5, output=2))
    budgets = {**BUDGETS, "budget_period": period}
    await a.registry.create(TeamSpec.model_validate({"name": "t", **budgets}))
    caller, _ = await a.registry.create(CallerSpec.model_validate({"name": "c", "team": "t", **budgets}))
    assert isinstance(a.store, MemoryStore)
    a.store.inject(Fault("unavailable", frozenset({"batch"}), table=USAGE_TABLE, times=10**9))
    r1, rec1 = await admit(acc_a, caller, "one")
    assert isinstance(r1, Admission)
    finish(acc_a, r1, rec1, usage(100, 50))
    await until(
        lambda: (entry_of(data, "instance-a", rec1.id) or {}).get("state") == "settled", what="r1 journaled settled"
    )
    old = counter(data, caller.limits_partition, "tokens")["window"]
    shift[0] = days * 86_400.0
    await a.store.get(LIMITS_TABLE, "x", "y")  # an answer of the store: its clock is read
    r2, rec2 = await admit(acc_a, caller, "two")
    assert isinstance(r2, Admission)
    team = (await b.registry.get(Team, "t")).limits_partition
    for row in budget_rows(data, caller, team):
        assert row["window"] != old and "instance-a=" in row["holds"], row  # A's entry, in the new window
    assert entry_of(data, "instance-a", rec1.id) is not None and entry_of(data, "instance-a", rec2.id) is not None
    await kill(a)
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    rows = ledger_rows(data)
    assert set(rows) == {rec1.id, rec2.id}
    assert rows[rec1.id]["author"] == "instance-a" and rows[rec1.id]["prompt_tokens"] == 100
    spent_as_the_ledger(data, caller, team, [rows[rec2.id]])  # r2's checkpoint alone
    assert rows[rec2.id]["cost"] == price.cost(r2.entry.prompt_tokens, 0, 0)
    await b.close()


async def test_a_takers_raise_to_what_its_caller_received_cancelled_while_it_waits_is_made_all_the_same():
    """Endpoint._charge_received, on a real takeover: the dead producer's caller had events 1..15 of
    which the log held 1..10; b's continuation has stood in for 11 and 12 when its upstream stalls,
    and the task is cancelled (the request ends, the instance stops) while it waits for the rest.
    The part is raised to what b knew (the log's text, the two stand-ins, and the three events not
    stood in for at their floor: one token each on /api/chat), once, and b's knowledge of it leaves
    the journal and the budget rows: before, that journal entry stayed open and b's entry stayed in
    every budget row for good, holding nothing, and the part was never raised."""
    from chatstream.apis.chat import ChatApi
    from chatstream.endpoint import Endpoint
    from chatstream.pipeline import Pipeline

    from .streamlog_helpers import QUICK, delta, instances, read_all
    from .streamlog_helpers import kill as kill_log
    from .test_failover import ScriptedClient, pooled

    data = account()
    _, _, b, acc_b, caller, _ = await setup(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    claims: list = []
    stalled = asyncio.Event()

    async def continuation(claim) -> None:  # its upstream stalls after two deltas
        claims.append(claim)
        for i in (10, 11):
            claim.producer.append(delta(i))
        stalled.set()
        await asyncio.Event().wait()

    async with instances(2, data=data, take_over=continuation, **{**QUICK, "checkpoint_seconds": 30.0}) as (x, y):
        params = {"model": MODEL, "messages": [{"role": "user", "content": "count"}]}
        producer = x.start("chat", caller.id, request={"params": params}, request_id="r-stream")
        for i in range(10):
            producer.append(delta(i))
        producer.caller_gone()  # stores what is in hand now
        await asyncio.sleep(0.3)
        x.store.inject(Fault("unavailable", ops=frozenset({"append"}), times=10**9))  # type: ignore[attr-defined]
        for i in range(10, 15):
            producer.append(delta(i))
        kill_log(x)
        await read_all(await y.open_reader(producer.id, 15, caller.id))  # stream_lost; the takeover goes on
        async with asyncio.timeout(5):
            await stalled.wait()
        [claim] = claims
        taken = record()
        taken.id = taken.request_id = "r-stream"
        going_on = await acc_b.admit(caller, asked(call("count"), taken))
        assert isinstance(going_on, Admission)
        upstreams = pooled({"u": ScriptedClient()})
        endpoint = Endpoint(ChatApi(), upstreams.settings, upstreams, Pipeline(), acc_b)
        known = ChatApi().known(claim.events)
        raising = asyncio.ensure_future(endpoint._charge_received(claim, known, going_on, asyncio.Event()))
        knows = f"r-stream/lost{claim.producer.epoch}"
        await until(lambda: entry_of(data, "instance-b", knows) is not None, what="b's journal knows the part")
        raising.cancel()
        with pytest.raises(asyncio.CancelledError):
            await raising
        going_on.entry.reservation.release()  # the continuation is over
        acc_b.journal.drop(going_on.entry)
        assert await acc_b.flush(5)
        assert knows not in acc_b.journal.entries and not (journal_doc(data, "instance-b") or {}).get("entries")
        rows = [values for partition in data.tables[USAGE_TABLE].values() for values, _ in partition.values()]
        text = "".join(ChatApi().known(delta(i)).text for i in range(12))
        assert [r["completion_tokens"] for r in rows if r["segment"] == 0] == [tokens.count_text(MODEL, text) + 3]
        spent_as_the_ledger(data, caller, team, rows)  # (and b's entry gone from every row)
    await b.close()


@pytest.mark.parametrize("died", ["after_counting", "before_counting", "before_counting_and_a_taker_raised_it"])
async def test_a_row_an_older_versions_recovery_wrote_without_its_raise_op_is_never_counted_twice(died: str):
    """A deploy: an older version's recovery of a (from before a raise's op said what it counted) wrote r3's row as
    it did (author takeover:instance-a, no op of its own) and died: after counting it in the budget
    rows (a's entry out of them, the journal not deleted yet), or before; then, perhaps, r3's
    stream's taker b raised the row to what its caller received, counting its raise (the author
    kept). The row does not say what that recovery counted: a newer recovery counts none of it (only
    a raise above it). So the budget rows never hold a token twice: exactly the ledger when that
    recovery counted it, below the ledger by its part when it did not (counting the row as its own
    would count the taker's raise twice) (journal.py, step 2)."""
    data = account()
    a, b, caller, (rec1, rec2, rec3), spent, costs = await three_requests(data)
    team = (await b.registry.get(Team, "t")).limits_partition
    name = journal_name("instance-a")
    unsealed = bytes(data.blobs[name][0])
    c, _ = instance(data, "instance-c")  # the newer version
    if died == "after_counting":  # (made here by today's recovery, then its row as the older one left it)
        await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
        await b.store.put(name, unsealed)  # died before step 4
    else:  # died between steps 2 and 3: a's entry still in every budget row
        entry = entry_of(data, "instance-a", rec3.id)
        assert entry is not None
        payer = Payer.of({"request_id": entry["id"], **entry})
        generated = Used(entry["prompt"], 0, entry["generated"])
        lost = Charge.made(payer, MODEL, generated, Price.of(entry["price"]), "lost", "takeover:instance-a")
        assert await b.ledger.write([lost]) == [False]
    older = Charge.of(ledger_rows(data)[rec3.id])
    there = await b.ledger.find(older)
    assert there is not None
    await b.store.replace(USAGE_TABLE, replace(older, ops="").entity(), etag=there.over)  # no op says what it counted
    if died == "before_counting_and_a_taker_raised_it":
        await charged_by_its_taker(b, caller, rec3.id, GENERATED + " It came back at dusk, tired and happy.")
        assert ledger_rows(data)[rec3.id]["completion_tokens"] > older.completion_tokens
    for _ in range(2):  # (run again: nothing left, it adds nothing)
        await Recovery(c.store, c.ledger).recover("instance-a", "instance-c")
    assert data.blobs.get(name) is None
    rows = ledger_rows(data)
    if died == "after_counting":
        spent_as_the_ledger(data, caller, team, rows.values())
    else:  # below the ledger by the older recovery's part of r3's row, never above it
        less = [older.prompt_tokens, older.completion_tokens, older.cost or 0]
        r3 = rows[rec3.id] | {
            "prompt_tokens": rows[rec3.id]["prompt_tokens"] - less[0],
            "completion_tokens": rows[rec3.id]["completion_tokens"] - less[1],
            "cost": rows[rec3.id]["cost"] - less[2],
        }
        spent_as_the_ledger(data, caller, team, [r3 if r is rows[rec3.id] else r for r in rows.values()])
    await b.close()
    await c.close()


async def test_a_lost_part_raised_after_midnight_is_charged_on_the_day_its_taker_journaled_it():
    """A taker that does not know when its stream started (``started`` None) dates the lost part by
    its clock once: the journal's knowledge of it and the raise name the same day, so the raise
    lands in the row a recovery would write, not in a second one the next day."""
    data = account()
    _, _, b, _, caller, _ = await setup(data)
    acc_b, going_on = await taking_over(b, caller, "req-midnight")
    before, after = 1_796_169_599.0, 1_796_169_601.0  # 23:59:59 and 00:00:01 UTC
    readings = iter([before])
    acc_b.counters.clock = lambda: next(readings, after)
    raise_it = acc_b.regenerating(going_on, None, lambda: "The end of the tale.", lambda: 0)
    await raise_it(0.0)
    going_on.entry.reservation.release()
    acc_b.journal.drop(going_on.entry)
    assert await acc_b.flush(5)
    row = ledger_rows(data)["req-midnight"]
    assert row["RowKey"][:8] == day_of(before) != day_of(after), row
    await b.close()
