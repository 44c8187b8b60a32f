"""chatstream/state/counters.py on the in-process store: exact admission under a burst over two
instances, capacity given back, all or nothing across limits, and the counter rows staying equal to
what was spent through lost answers and a frozen store (an instance that dies: test_journal.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import idle_clock  # waits with nothing to do skipped (tests/idle_clock.py)
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from memory_store import Fault, MemoryData, MemoryStore, stored

from chatstream.errors import StoreTimeout
from chatstream.state.accounting import Admission
from chatstream.state.callers import Caller, CallerSpec
from chatstream.state.counter_row import CounterKey, parse_holds, window_of
from chatstream.state.counters import Counters, Reservation, Want
from chatstream.state.instances import Instances
from chatstream.state.journal import Recovery, journal_name
from chatstream.state.port import LimitRef, Refused, Unavailable, Used
from chatstream.state.store import CALL_TIMEOUT, LIMITS_TABLE, USAGE_TABLE, Op

from .state_helpers import account, admit, counter, finish, instance, kill, until, usage

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time

T0 = 1_796_083_217.3  # 17.3 s into a minute, day and month: windows stay put unless a test moves them


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def want(row: str, limit: int, need: int, period: str = "minute", partition: str = "c|1") -> Want:
    kind = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute", "tokens": "token_budget", "spend": "spend_budget"}
    ref = LimitRef("caller", "c", kind[row], None, None if period == "minute" else period)
    return Want(CounterKey(partition, row), ref, limit, need)


def counters(data: MemoryData, name: str, clock: Clock | None = None, **kw) -> Counters:
    store = MemoryStore(data)
    return Counters(store, Instances(store, instance_id=name), clock=clock or Clock(), **kw)


def row(data: MemoryData, partition: str, key: str) -> dict:
    return data.tables[LIMITS_TABLE][partition][key][0]


async def test_a_burst_of_200_over_two_instances_admits_exactly_the_limit():
    data = MemoryData()
    clock = Clock()
    two = [counters(data, "a", clock), counters(data, "b", clock)]
    results = await asyncio.gather(*(two[i % 2].reserve([want("tpm", 10_000, 100)]) for i in range(200)))
    admitted = [r for r in results if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, Refused)]
    assert len(admitted) + len(refused) == 200
    assert len(admitted) == 100  # exactly: nothing is left sitting on an instance
    assert all(r.limit.kind == "tokens_per_minute" and r.retry_after and 0 < r.retry_after <= 60 for r in refused)
    assert row(data, "c|1", "tpm")["taken"] == 100 * 100
    writes = data.calls.get("insert", 0) + data.calls.get("replace", 0)
    assert writes <= 40  # leases: a few exchanges, not one per request


async def test_settled_below_the_reservation_gives_back_and_a_lone_request_needs_no_store_write():
    data = MemoryData()
    c = counters(data, "a")
    first = await c.reserve([want("tpm", 1000, 100)])
    assert isinstance(first, Reservation)
    first.settle({CounterKey("c|1", "tpm"): 30})
    await asyncio.sleep(0.05)  # what came back beyond the spare goes back (after the request)
    calls = sum(data.calls.values())
    second = await c.reserve([want("tpm", 1000, 100)])  # served from what the first one left here
    assert isinstance(second, Reservation) and sum(data.calls.values()) == calls
    second.release()
    assert await c.flush(3)
    assert row(data, "c|1", "tpm")["taken"] == 30


async def test_requests_at_a_steady_pace_are_served_from_the_spare_without_a_store_call_before_them():
    data = MemoryData()
    c = counters(data, "a")
    before = []
    for _ in range(6):  # one at a time, each settled before the next (a caller's sequential requests)
        calls = sum(data.calls.values())
        got = await c.reserve([want("tpm", 100_000, 100)])
        assert isinstance(got, Reservation)
        before.append(sum(data.calls.values()) - calls)
        got.settle({CounterKey("c|1", "tpm"): 60})
        await asyncio.sleep(0.05)  # the spare is filled again after the request
    assert before[0] > 0 and before[1:] == [0] * 5
    assert await c.flush(3)
    assert row(data, "c|1", "tpm")["taken"] == 6 * 60  # exactly what was spent, once the spare is given back


async def test_all_or_nothing_a_refusal_by_the_team_gives_back_what_the_caller_reserved():
    data = MemoryData()
    c = counters(data, "a")
    team_budget = want("tokens", 150, 100, period="month", partition="team:t|1")
    ok = await c.reserve([want("tpm", 10_000, 100), team_budget])
    assert isinstance(ok, Reservation)
    no = await c.reserve([want("tpm", 10_000, 100), team_budget])
    assert isinstance(no, Refused) and no.limit.kind == "token_budget" and no.retry_after is None
    ok.settle({CounterKey("c|1", "tpm"): 100, CounterKey("team:t|1", "tokens"): 100}).confirm()
    assert await c.flush(3)
    assert row(data, "c|1", "tpm")["taken"] == 100  # the refused one's 100 came back at once


async def test_a_request_larger_than_the_limit_is_refused_alone_without_a_store_call():
    data = MemoryData()
    c = counters(data, "a")
    refused = await c.reserve([want("tpm", 50, 100)])
    assert isinstance(refused, Refused) and refused.alone
    assert data.calls == {}


async def test_a_store_that_does_not_answer_is_unavailable_within_the_bound():
    data = MemoryData()
    c = counters(data, "a")
    MemoryStore(data).freeze()
    loop = asyncio.get_running_loop()
    started = loop.time()
    answer = await c.reserve([want("tpm", 1000, 100)])
    assert isinstance(answer, Unavailable)
    assert loop.time() - started < 2.5
    MemoryStore(data).thaw()
    assert isinstance(await c.reserve([want("tpm", 1000, 100)]), Reservation)  # back by itself


async def test_a_slow_store_is_not_a_dead_one():
    """An exchange that takes 2.5 s (past the 1.8 s bound for a store that says nothing) while the
    store answers other calls: the request waits for it."""
    data = MemoryData()
    c = counters(data, "a")
    store = c.store
    assert isinstance(store, MemoryStore)
    store.inject(Fault("slow", frozenset({"get"}), delay=2.5))
    other = counters(data, "b")

    async def chatter() -> None:  # the store answering meanwhile (other callers, other counters)
        for _ in range(30):
            await c.store.get(LIMITS_TABLE, "x", "y")
            await asyncio.sleep(0.1)

    busy = asyncio.ensure_future(chatter())
    answer = await c.reserve([want("tpm", 1000, 100)])
    busy.cancel()
    assert isinstance(answer, Reservation), answer
    del other


def _spent(charges: list[tuple[int, int]]) -> int:
    return sum(s for _, s in charges)


async def _settle_all(c: Counters, reservations: list[tuple[Reservation, int]]) -> None:
    for reservation, spent in reservations:
        settlement = reservation.settle({CounterKey("c|1", "tokens"): spent})
        settlement.confirm()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(0, 200), st.sampled_from(["none", "lose", "refuse"])), min_size=5, max_size=30),
    st.integers(0, 10**6),
)
@example(steps=[(0, "refuse")] * 5, seed=0)  # every write refused: the row is never written
def test_the_budget_row_equals_what_was_spent_whatever_answers_are_lost(steps, seed):
    """A budget of 2,400 (as the probe had): rounds of reservations and settles while the store loses
    answers after applying the write, or refuses: afterwards the row equals the sum of what was
    spent and settled, exactly; nothing was given back twice."""

    async def run() -> None:
        data = MemoryData()
        rng = random.Random(seed)
        two = [counters(data, "a"), counters(data, "b")]
        spent_total = 0
        for spend, fault in steps:
            c = two[rng.randrange(2)]
            store = c.store
            assert isinstance(store, MemoryStore)
            if fault == "lose":
                store.inject(Fault("lose_answer", frozenset({"replace", "insert"}), times=rng.randrange(1, 3)))
            elif fault == "refuse":
                store.inject(Fault("unavailable", frozenset({"replace", "insert", "get"}), times=1))
            reserved = await c.reserve([want("tokens", 2_400, 200, period="month")])
            if isinstance(reserved, Reservation):
                settlement = reserved.settle({CounterKey("c|1", "tokens"): min(spend, 250)})
                settlement.confirm()
                spent_total += min(spend, 250)
            store.faults.clear()
            if rng.random() < 0.3:
                await asyncio.sleep(0.02)
        for c in two:
            for _ in range(20):
                if await c.flush(2):
                    break
                await asyncio.sleep(0.6)  # a failed exchange tries again after its backoff
        if "tokens" not in data.tables.get(LIMITS_TABLE, {}).get("c|1", {}):
            assert spent_total == 0  # every write was refused: no row, nothing admitted
            return
        found = row(data, "c|1", "tokens")
        holds = parse_holds(found.get("holds"))
        held = sum(e.held for e in holds.values())
        assert found["taken"] - held == spent_total, (found, spent_total)
        assert held == 0, found  # flushed: what was reserved and not spent went back to the row

    idle_clock.run(run())  # its waits skipped too, as the async tests here


async def test_a_frozen_store_during_settles_leaves_the_row_equal_to_what_was_spent():
    """SIGSTOP on the store as requests settle: every write that timed out lands when it thaws;
    none of it is given back on a guess, so nothing is counted twice and the budget holds."""
    data = MemoryData()
    clock = Clock()
    two = [counters(data, "a", clock), counters(data, "b", clock)]
    budget = 2_400
    spent = 0
    admitted = 0
    for round_ in range(20):
        results = await asyncio.gather(*(two[i % 2].reserve([want("tokens", budget, 200, "month")]) for i in range(12)))
        held = [r for r in results if isinstance(r, Reservation)]
        admitted += len(held)
        if round_ % 3 == 0:
            MemoryStore(data).freeze()
            asyncio.get_running_loop().call_later(0.3, MemoryStore(data).thaw)
        for r in held:
            r.settle({CounterKey("c|1", "tokens"): 150}).confirm()
            spent += 150
        await asyncio.sleep(0.05)
    MemoryStore(data).thaw()
    for c in two:
        for _ in range(30):
            if await c.flush(1):
                break
            await asyncio.sleep(0.5)
    found = row(data, "c|1", "tokens")
    holds = parse_holds(found.get("holds"))
    assert found["taken"] - sum(e.held for e in holds.values()) == spent
    assert spent <= budget  # reservations of 200 settled at 150: never more than the budget
    assert spent >= budget - 2 * 200  # ...and the budget was not lost to the freezes either
    assert admitted == spent // 150


async def test_a_row_written_by_an_older_version_with_a_limit_column_is_read_and_reused():
    data = MemoryData()
    old = {"PartitionKey": "c|1", "RowKey": "tokens", "window": window_of("month", T0), "taken": 900, "limit": 5000}
    await MemoryStore(data).insert(LIMITS_TABLE, {**old, "holds": ""})
    c = counters(data, "a")
    refused = await c.reserve([want("tokens", 1000, 200, "month")])  # the limit is the request's, not the row's
    assert isinstance(refused, Refused) and refused.used == 900
    reserved = await c.reserve([want("tokens", 1000, 100, "month")])
    assert isinstance(reserved, Reservation)
    reserved.settle({CounterKey("c|1", "tokens"): 100}).confirm()
    assert await c.flush(3)
    assert row(data, "c|1", "tokens")["taken"] == 1000 and "limit" not in row(data, "c|1", "tokens")


async def test_a_minute_window_turns_over():
    data = MemoryData()
    clock = Clock()
    c = counters(data, "a", clock)
    assert isinstance(await c.reserve([want("rpm", 2, 1)]), Reservation)
    assert isinstance(await c.reserve([want("rpm", 2, 1)]), Reservation)
    refused = await c.reserve([want("rpm", 2, 1)])
    assert isinstance(refused, Refused) and 42 <= (refused.retry_after or 0) <= 43
    clock.now += 60
    assert isinstance(await c.reserve([want("rpm", 2, 1)]), Reservation)


async def test_a_give_back_whose_answer_was_lost_is_not_given_back_twice():
    """The probe's cause: a write that times out but was applied was followed by a give-back, which
    the next exchange gave back again. Now the row is read first: the write is found landed."""
    data = MemoryData()
    c = counters(data, "a")
    store = c.store
    assert isinstance(store, MemoryStore)
    first = await c.reserve([want("tokens", 2_400, 200, "month")])
    assert isinstance(first, Reservation)
    store.inject(Fault("lose_answer", frozenset({"replace"}), times=1))
    first.settle({CounterKey("c|1", "tokens"): 150}).confirm()  # gives 50 back, applies 150: the answer is lost
    for _ in range(10):
        if await c.flush(1):
            break
        await asyncio.sleep(0.6)
    found = row(data, "c|1", "tokens")
    assert found["taken"] == 150 and not found.get("holds")
    second = await c.reserve([want("tokens", 2_400, 200, "month")])
    assert isinstance(second, Reservation)
    second.settle({CounterKey("c|1", "tokens"): 150}).confirm()
    assert await c.flush(3)
    assert row(data, "c|1", "tokens")["taken"] == 300


class _LandsLate(MemoryStore):
    """A store whose next replace times out unapplied and lands just after the next read of its row:
    the write sent again after that read finds its condition failed."""

    late: Callable[[], object] | None = None

    async def replace(self, table, entity, *, etag=None, timeout=CALL_TIMEOUT):
        if self.late is None:
            values = stored(Op("replace", entity, etag))
            self.late = lambda: self._write(table, "replace", values, etag)
            raise StoreTimeout("the store did not answer in time (it lands later)")
        return await super().replace(table, entity, etag=etag, timeout=timeout)

    async def get(self, table, partition, row, *, select=None, timeout=CALL_TIMEOUT):
        found = await super().get(table, partition, row, select=select, timeout=timeout)
        if self.late is not None:
            late, self.late = self.late, lambda: None
            late()
        return found


async def test_a_lost_write_that_lands_as_it_is_sent_again_is_found_landed_not_counted_twice():
    """A write whose answer was lost, the row unchanged when read: the same write goes again and
    its condition fails, because the first one landed meanwhile. That failure says nothing of the
    first: the row is read again and the holding decides (on c769786 the give-back and the charge it
    carried were taken for not landed, the holding for taken over, and the charge applied twice)."""
    data = MemoryData()
    store = _LandsLate(data)
    store.late = lambda: None  # (the first replace goes through)
    c = Counters(store, Instances(store, instance_id="a"), clock=Clock())
    first = await c.reserve([want("tokens", 2_400, 200, "month")])
    assert isinstance(first, Reservation)
    assert await c.flush(3)
    store.late = None  # the next replace: its answer is lost, it lands late
    first.settle({CounterKey("c|1", "tokens"): 150}).confirm()  # gives 50 back, applies 150
    for _ in range(10):
        if await c.flush(1):
            break
        await asyncio.sleep(0.6)
    found = row(data, "c|1", "tokens")
    assert found["taken"] == 150 and not found.get("holds"), found


async def test_an_entry_kept_for_a_lost_part_leaves_the_row_once_let_go_though_that_exchange_failed():
    """``Counters.keep`` holds a's entry in a budget row (holding nothing) while its journal knows a
    lost part; let go, an exchange takes the holding out: after one that failed too (b changed the row
    meanwhile, and a's read of it failed)."""
    data = MemoryData()
    a, b = counters(data, "a"), counters(data, "b")
    store = a.store
    assert isinstance(store, MemoryStore)
    key = CounterKey("c|1", "tokens")
    first = await a.reserve([want("tokens", 2_400, 200, "month")])
    assert isinstance(first, Reservation)
    let_go = a.keep([key])
    first.settle({key: 150}).confirm()
    assert await a.flush(3)
    assert parse_holds(row(data, "c|1", "tokens")["holds"])["a"].held == 0  # kept, holding nothing
    other = await b.reserve([want("tokens", 2_400, 100, "month")])
    assert isinstance(other, Reservation)
    other.settle({key: 10}).confirm()
    assert await b.flush(3)
    store.inject(Fault("unavailable", frozenset({"get"}), times=1))
    let_go()
    for _ in range(10):
        await asyncio.sleep(0.6)
        if await a.flush(1) and not row(data, "c|1", "tokens").get("holds"):
            break
    found = row(data, "c|1", "tokens")
    assert found["taken"] == 160 and not found.get("holds")


async def test_idle_capacity_held_by_many_instances_stays_under_a_tenth_of_the_limit():
    """The probe: a lone request takes one more request's worth for the next, up to 10% of a minute
    limit; over N instances that was N × 10% idle. Now the share is split over the instances that
    hold some: whatever their number, together they keep at most about a tenth."""
    data = MemoryData()
    clock = Clock()
    many = [counters(data, f"i{n}", clock) for n in range(8)]
    for c in many:  # one lone request on each, one after the other
        reserved = await c.reserve([want("tpm", 10_000, 500)])
        assert isinstance(reserved, Reservation)
        reserved.release()
    await asyncio.sleep(0.05)  # the last release goes back by its flight
    found = row(data, "c|1", "tpm")
    idle = sum(e.held for e in parse_holds(found["holds"]).values())  # nothing is reserved: all of it idle
    assert idle <= 10_000 // 10 + 8, idle  # rounding: a token per instance at most
    assert found["taken"] == idle


def _team_tokens(limit: int, need: int) -> Want:
    return want("tokens", limit, need, period="month", partition="team:t|1")


async def _whole(data: MemoryData, c: Counters, spent: dict[tuple[str, str], int], limits: dict[tuple[str, str], int]):
    """Flushed, every row holds nothing for ``c`` and has taken exactly what was ``spent``; a request
    of all that is left of each limit is admitted (nothing stays reserved here)."""
    for _ in range(20):
        if await c.flush(1):
            break
        await asyncio.sleep(0.6)  # a failed exchange tries again after its backoff
    for (partition, key), limit in limits.items():
        found = data.tables.get(LIMITS_TABLE, {}).get(partition, {}).get(key)
        taken, holds = (found[0]["taken"], parse_holds(found[0].get("holds"))) if found else (0, {})
        assert (taken, sum(e.held for e in holds.values())) == (spent.get((partition, key), 0), 0), (key, found)
        rest = limit - spent.get((partition, key), 0)
        whole = [want(key, limit, rest, period="minute" if key == "tpm" else "month", partition=partition)]
        again = await c.reserve(whole)
        assert isinstance(again, Reservation), (key, again)
        again.release()


@pytest.mark.parametrize("granted", ["from the spare", "by its exchange"])
async def test_a_reservation_cancelled_while_it_waits_gives_back_what_one_limit_granted(granted):
    """The caller hangs up while its admission waits for the store: the caller's tokens per minute
    granted (served from the spare, or by an exchange that answered), the team's budget still waiting
    (a frozen store, or a slow one). What was granted, and what is granted after, comes back."""
    data = MemoryData()
    c = counters(data, "a")
    store = c.store
    assert isinstance(store, MemoryStore)
    if granted == "from the spare":
        first = await c.reserve([want("tpm", 10_000, 100)])  # a lone request: one more kept for the next
        assert isinstance(first, Reservation)
        first.release()
        await asyncio.sleep(0.05)
        store.freeze()
        wants = [want("tpm", 10_000, 100), _team_tokens(2_400, 200)]
    else:  # the team's counter answers slowly (its flight starts first: its read is the first call)
        store.inject(Fault("slow", frozenset({"get"}), delay=1.0))
        wants = [_team_tokens(2_400, 200), want("tpm", 10_000, 100)]
    asking = asyncio.ensure_future(c.reserve(wants))
    await asyncio.sleep(0.3)  # under RESERVE_TIMEOUT: the reservation still waits
    assert not asking.done()
    if granted == "from the spare":
        assert data.calls["get"] == 1 + 1  # the team's read only (tpm served from the spare here)
    asking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asking
    store.thaw()
    await asyncio.sleep(1.0)  # the slow answer comes, and the frozen calls time out
    await _whole(data, c, {}, {("c|1", "tpm"): 10_000, ("team:t|1", "tokens"): 2_400})


async def test_a_refusal_by_one_limit_after_another_granted_gives_the_granted_part_back():
    """The team's budget refuses (on a slow read) after the caller's tokens per minute were granted
    by their exchange: the reservation is refused and the granted part comes back."""
    data = MemoryData()
    c = counters(data, "a")
    store = c.store
    assert isinstance(store, MemoryStore)
    spent = await c.reserve([_team_tokens(2_400, 2_300)])
    assert isinstance(spent, Reservation)
    spent.settle({CounterKey("team:t|1", "tokens"): 2_300}).confirm()
    assert await c.flush(3)
    store.inject(Fault("slow", frozenset({"get"}), delay=1.0))  # the team's re-read (its flight runs first)
    refused = await c.reserve([_team_tokens(2_400, 200), want("tpm", 10_000, 100)])
    assert isinstance(refused, Refused) and refused.limit.kind == "token_budget", refused
    await _whole(data, c, {("team:t|1", "tokens"): 2_300}, {("c|1", "tpm"): 10_000, ("team:t|1", "tokens"): 2_400})


@pytest.mark.parametrize("need", [-150, 150])
async def test_a_correction_where_nothing_is_held_enters_with_an_entry_that_stays_until_it_is_in(need: int):
    """A budget correction (``need`` -150: a give-back; 150: more) on an instance that holds nothing of
    the row: its first exchange puts this instance's holding in the row (``Reservation.entered``: then it
    may be journaled), the holding stays until the correction is confirmed and in (held 0 or below, as
    older versions read it too), and then goes."""
    data = MemoryData()
    a, b = counters(data, "a"), counters(data, "b")
    first = await a.reserve([want("tokens", 2_400, 200, "month")])
    assert isinstance(first, Reservation)
    first.settle({CounterKey("c|1", "tokens"): 200}).confirm()
    assert await a.flush(3) and row(data, "c|1", "tokens")["taken"] == 200
    settlement = b.adjust([want("tokens", 2_400, need, "month")], T0)
    assert await settlement.entered(3)
    entry = parse_holds(row(data, "c|1", "tokens")["holds"])["b"]
    assert entry.held == need and entry.applied == 0  # what the row took of it, not in yet
    assert row(data, "c|1", "tokens")["taken"] == 200 + need
    await asyncio.sleep(0.5)
    assert "b" in parse_holds(row(data, "c|1", "tokens")["holds"])  # unconfirmed: it stays
    settlement.confirm()
    assert await b.flush(3)
    found = row(data, "c|1", "tokens")
    assert found["taken"] == 200 + need and not found.get("holds")


async def test_a_row_in_debt_is_refused_with_what_was_spent_and_a_hold_serves_nothing_until_the_next_minute():
    """b spends past the tokens per minute (more than it reserved: the tokens were spent): the row is
    in debt. a, keeping a lone request's spare, learns it when its spare is topped up; its next request
    is refused (the spare serves none while the row is over: admitted, it was told 20 remained),
    saying what was spent (not the limit less a's spare); the next minute admits."""
    data = MemoryData()
    clock = Clock()
    a, b = counters(data, "a", clock), counters(data, "b", clock)
    tpm = CounterKey("c|1", "tpm")
    first = await a.reserve([want("tpm", 1000, 100)])  # a lone request: a keeps 100 more for the next
    assert isinstance(first, Reservation)
    first.settle({tpm: 100})
    await asyncio.sleep(0.05)
    over = await b.reserve([want("tpm", 1000, 100)])
    assert isinstance(over, Reservation)
    over.settle({tpm: 1000})
    await asyncio.sleep(0.05)  # b's charge past its balance goes to the row
    assert row(data, "c|1", "tpm")["taken"] == 1200  # 1,100 spent, a's spare of 100: 200 over
    served = await a.reserve([want("tpm", 1000, 50)])  # from a's spare: a does not know yet
    assert isinstance(served, Reservation)
    served.settle({tpm: 30})  # the spare topped up: a reads the row in debt
    await asyncio.sleep(0.05)
    refused = await a.reserve([want("tpm", 1000, 50)])
    assert isinstance(refused, Refused) and refused.used == 1130, refused  # 100 + 30 + 1,000 spent
    assert 42 <= (refused.retry_after or 0) <= 43
    clock.now += 60
    assert isinstance(await a.reserve([want("tpm", 1000, 150)]), Reservation)


async def test_a_budget_in_debt_is_refused_with_what_was_spent():
    """A correction (a lost part charged after the fact) takes a budget past its limit: a request
    is refused, saying what was spent (not the limit), with no retry time (the budget's period)."""
    data = MemoryData()
    c = counters(data, "a")
    tokens = CounterKey("c|1", "tokens")
    first = await c.reserve([want("tokens", 1000, 900, "month")])
    assert isinstance(first, Reservation)
    first.settle({tokens: 900}).confirm()
    c.adjust([want("tokens", 1000, 300, "month")], T0).confirm()
    assert await c.flush(3)
    assert row(data, "c|1", "tokens")["taken"] == 1200
    refused = await c.reserve([want("tokens", 1000, 10, "month")])
    assert isinstance(refused, Refused) and refused.used == 1200 and refused.retry_after is None, refused


async def _a_holding_a_background_response():
    """Instances a and b on one account, caller c (a month's token budget) whose background response
    a admitted and answered: it goes on upstream, and what it reserved is held until it is seen."""
    data = account()
    a, acc_a = instance(data, "instance-a")
    b, _ = instance(data, "instance-b")
    await a.registry.create(CallerSpec(name="c", token_budget=100_000, budget_period="month"))
    caller = await a.registry.get(Caller, "c")
    background, rec = await admit(acc_a, caller, "later", max_output_tokens=4000, background=True)
    assert isinstance(background, Admission)
    await acc_a.own("response", "resp_bg", background, background=True)
    finish(acc_a, background, rec, None)
    assert await acc_a.flush(5)
    return data, a, acc_a, b, caller


def _row_equals_ledger(data: MemoryData, partition: str, key: str) -> None:
    """The budget row has taken what the ledger holds, and no instance holds any of it."""
    ledger = [v for p in data.tables[USAGE_TABLE].values() for v, _ in p.values()]
    found = counter(data, partition, key)
    assert (found["taken"], found["holds"]) == (sum(r["prompt_tokens"] + r["completion_tokens"] for r in ledger), "")


async def test_an_entry_holding_0_with_a_charge_not_in_yet_learns_of_its_takeover_and_counts_nothing_twice():
    """a holds r0's reservation in its caller's budget row, and a give-back of exactly as much (a
    background response's usage seen, below what it reserved) waits for its ledger row: a's entry
    stays in the row, holding 0. a is only slow: b takes it over (the give-back applied, r0 charged
    at its checkpoint). a's next exchange (r0's settle) must see that its holding went, as it does when
    it held more than 0: before, it gave r0's reservation back a second time, the row below the
    ledger by as much."""
    data, a, acc_a, b, caller = await _a_holding_a_background_response()
    budget = (caller.limits_partition, "tokens")
    reserved = counter(data, *budget)["taken"]
    r0, rec0 = await admit(acc_a, caller, "zero", max_output_tokens=100)
    assert isinstance(r0, Admission)
    held = counter(data, *budget)["taken"] - reserved
    assert isinstance(a.store, MemoryStore)
    ledger_down = a.store.inject(Fault("unavailable", table=USAGE_TABLE, times=10**9))
    used = Used(10, 0, reserved - held - 10)  # its usage seen: ``held`` below what it reserved
    await acc_a.charge_seen(caller, "response", "resp_bg", "gpt-4o", used, "responses")
    await until(lambda: parse_holds(counter(data, *budget)["holds"])["instance-a"].held == 0, what="a holds 0")
    await until(lambda: b"resp_bg/seen" in bytes(data.blobs[journal_name("instance-a")][0]), what="journaled")
    journal_down = a.store.inject(Fault("unavailable", frozenset({"put"}), table="blob", times=10**9))
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    journal_down.times = ledger_down.times = 0
    await until(lambda: r0.entry.taken_over, what="a's journal meets the seal")
    finish(acc_a, r0, rec0, usage(r0.entry.prompt_tokens, 5))  # its exchange finds a's entry gone
    assert await acc_a.flush(5)
    ledger = [v for p in data.tables[USAGE_TABLE].values() for v, _ in p.values()]
    assert len(ledger) == 2  # the background response, r0 at its checkpoint (b's)
    _row_equals_ledger(data, *budget)
    await a.close()
    await b.close()


async def test_a_per_minute_correction_where_nothing_is_held_enters_the_row():
    """A correction of tokens per minute (a lost part charged after the fact) on an instance that
    holds none of the row: it enters the row. Before, its books below 0 were taken for a takeover of
    this instance (a holding gone while it held): dropped, with a warning."""
    data = MemoryData()
    a, b = counters(data, "a"), counters(data, "b")
    first = await a.reserve([want("tpm", 1000, 100)])
    assert isinstance(first, Reservation)
    first.release()
    assert await a.flush(3) and row(data, "c|1", "tpm")["taken"] == 0
    b.adjust([want("tpm", 1000, 150)], T0)
    assert await b.flush(3)
    assert row(data, "c|1", "tpm")["taken"] == 150


async def test_a_correction_the_sealed_journal_did_not_list_still_enters_the_row_after_the_takeover():
    """a holds r0's reservation; a correction (a background response's usage seen, above what it
    reserved) is staged while a's journal cannot be written, and b seals it without the correction
    (so b does not apply it, and takes out a's entry). a's journal then starts anew with it (it is
    a's), and its ledger row is written; a's counters, seeing their entry gone, keep the charges no
    sealed journal listed (the journal numbers each charge it lists settled). Before, they dropped
    every staged charge: the row ended 1,002 below the ledger."""
    data, a, acc_a, b, caller = await _a_holding_a_background_response()
    budget = (caller.limits_partition, "tokens")
    r0, rec0 = await admit(acc_a, caller, "zero", max_output_tokens=100)
    assert isinstance(r0, Admission) and isinstance(a.store, MemoryStore)
    journal_down = a.store.inject(Fault("unavailable", frozenset({"put"}), table="blob", times=10**9))
    ledger_down = a.store.inject(Fault("unavailable", table=USAGE_TABLE, times=10**9))
    await acc_a.charge_seen(caller, "response", "resp_bg", "gpt-4o", Used(10, 0, 5000), "responses")
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    journal_down.times = ledger_down.times = 0
    await until(lambda: r0.entry.taken_over, what="a's journal meets the seal")
    finish(acc_a, r0, rec0, usage(r0.entry.prompt_tokens, 5))
    assert await acc_a.flush(5)
    ledger = [v for p in data.tables[USAGE_TABLE].values() for v, _ in p.values()]
    assert len(ledger) == 2  # the background response (a's), r0 at its checkpoint (b's)
    _row_equals_ledger(data, *budget)
    await a.close()
    await b.close()


async def test_a_charge_the_sealed_journal_listed_is_not_applied_again_when_the_counters_learn_first():
    """a settles r1 (journaled, its ledger row written) while its budget row cannot be written; b
    seals a's journal and applies r1. a's counters then find their entry gone before a's journal
    has met the seal (it has nothing to write): they have it written first (it meets the seal), and
    drop r1's charge, the taker's now. The row ends at the ledger, r1 counted once."""
    data = account()
    a, acc_a = instance(data, "instance-a")
    b, _ = instance(data, "instance-b")
    await a.registry.create(CallerSpec(name="c", token_budget=100_000, budget_period="month"))
    caller = await a.registry.get(Caller, "c")
    r0, _ = await admit(acc_a, caller, "zero", max_output_tokens=100)
    r1, rec1 = await admit(acc_a, caller, "one", max_output_tokens=100)
    assert isinstance(r0, Admission) and isinstance(r1, Admission) and isinstance(a.store, MemoryStore)
    counters_down = a.store.inject(Fault("unavailable", table=LIMITS_TABLE, times=10**9))
    finish(acc_a, r1, rec1, usage(r1.entry.prompt_tokens, 40))
    await until(lambda: r1.entry.written.is_set(), what="r1 journaled and its ledger row written")
    await asyncio.sleep(1.0)  # a's journal writes once more (r1's row in), then has nothing to write
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    assert not r0.entry.taken_over  # a's journal has not met the seal yet
    counters_down.times = 0
    await until(lambda: r0.entry.taken_over, what="a's counters have a's journal meet the seal")
    assert await acc_a.flush(5)
    ledger = [v for p in data.tables[USAGE_TABLE].values() for v, _ in p.values()]
    assert len(ledger) == 2  # r1 (a's), r0 at its checkpoint (b's)
    _row_equals_ledger(data, caller.limits_partition, "tokens")
    await a.close()
    await b.close()


FOREIGN_ITEMS = ("op:x=1/2/3/4/5", "y=1/2/3/4/5")  # (counter_row.py: a later version's holds items)
FOREIGN_COLUMNS = {"later": "kept", "count": 7}


async def _add_foreign(data: MemoryData, partition: str, key: str, **found: object) -> None:
    """A later version's holds items and columns in the row (inserted with ``found`` if not there)."""
    store = MemoryStore(data)
    old = await store.get(LIMITS_TABLE, partition, key)
    entity = {"PartitionKey": partition, "RowKey": key, **(old or found), **FOREIGN_COLUMNS}
    entity["holds"] = " ".join([str(entity.get("holds") or ""), *FOREIGN_ITEMS]).strip()
    if old is None:
        await store.insert(LIMITS_TABLE, entity)
    else:
        await store.replace(LIMITS_TABLE, entity, etag=old.etag)


def _kept_foreign(found: dict) -> bool:
    return set(FOREIGN_ITEMS) <= set(found["holds"].split()) and FOREIGN_COLUMNS.items() <= found.items()


async def test_a_later_versions_holds_items_and_columns_survive_every_write_of_the_row():
    """Step 1 of a two-deploy change (counter_row.py): holds items this version does not parse and
    columns it does not know are kept verbatim by an exchange, by the first write of a new window and
    by a recovery taking a dead instance's holding out, and never counted. Before, each write dropped them."""
    data = MemoryData()
    clock = Clock()
    c = counters(data, "a", clock)
    month = window_of("month", T0)
    await _add_foreign(data, "c|1", "tokens", window=month, taken=300)
    reserved = await c.reserve([want("tokens", 1000, 100, "month")])
    assert isinstance(reserved, Reservation)
    reserved.settle({CounterKey("c|1", "tokens"): 60}).confirm()
    assert await c.flush(3)
    found = row(data, "c|1", "tokens")
    assert _kept_foreign(found) and found["taken"] == 360 and parse_holds(found["holds"]) == {}
    await _add_foreign(data, "c|1", "rpm", window=window_of("minute", T0 - 60), taken=5)
    assert isinstance(await c.reserve([want("rpm", 10, 1)]), Reservation)  # a new window's first write
    assert await c.flush(5)
    found = row(data, "c|1", "rpm")
    assert _kept_foreign(found) and (found["window"], found["taken"]) == (window_of("minute", T0), 1)

    data = account()
    a, acc_a = instance(data, "instance-a")
    b, _ = instance(data, "instance-b")
    await a.registry.create(CallerSpec(name="c", token_budget=100_000, budget_period="month"))
    caller = await a.registry.get(Caller, "c")
    admitted, rec = await admit(acc_a, caller, "open when a dies")
    assert isinstance(admitted, Admission)
    await until(lambda: rec.id.encode() in bytes(data.blobs[journal_name("instance-a")][0]), what="journaled")
    await kill(a)
    await _add_foreign(data, caller.limits_partition, "tokens")
    await Recovery(b.store, b.ledger).recover("instance-a", "instance-b")
    found = counter(data, caller.limits_partition, "tokens")
    ledger = [v for p in data.tables[USAGE_TABLE].values() for v, _ in p.values()]
    assert _kept_foreign(found) and parse_holds(found["holds"]) == {}
    assert found["taken"] == sum(r["prompt_tokens"] + r["completion_tokens"] for r in ledger) > 0
    await b.close()
