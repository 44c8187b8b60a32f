"""chatstream/state/quota.py against a real Azurite: capacity leases per instance, exact admission
under a burst split over two instances, slack given back, windows, budgets, and a store that stops
answering (503 within 2 s, then recovery by itself)."""

from __future__ import annotations

import asyncio
import secrets
import time
from datetime import UTC, datetime

import pytest
from store_proxy import StoreProxy

from chatstream.errors import ApiError
from chatstream.state.callers import Caller
from chatstream.state.legacy_store import LIMITS_TABLE, StorageConfig, Store
from chatstream.state.quota import Quota, Reservation

# A fixed instant 17.3 s into a minute (and into a UTC day and month): windows do not move unless a
# test moves the clock.
T0 = 1_796_083_217.3
DEAD_STORE = (
    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;"
    "TableEndpoint=http://127.0.0.1:9/devstoreaccount1;"
)


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def caller(**limits) -> Caller:
    return Caller(name=f"q-{secrets.token_hex(4)}", id=secrets.token_hex(6), created_at=datetime.now(UTC), **limits)


def store(azurite) -> Store:
    return Store(StorageConfig(connection_string=azurite.connection_string))


async def taken(azurite, who: Caller, kind: str) -> int:
    s = store(azurite)
    try:
        row = await (await s.table(LIMITS_TABLE)).get_entity(who.limits_partition, kind)
        value = row["taken"]
        return int(getattr(value, "value", value))
    finally:
        await s.close()


async def refused(coro) -> ApiError:
    with pytest.raises(ApiError) as info:
        await coro
    return info.value


async def test_a_burst_of_200_over_two_instances_admits_exactly_the_limit(azurite):
    who = caller(tokens_per_minute=10_000)
    stores = [store(azurite), store(azurite)]
    clock = Clock()
    quotas = [Quota(stores[0], "instance-a", clock), Quota(stores[1], "instance-b", clock)]
    try:
        for s in stores:  # the tables exist before the clock starts (an app's first call makes them)
            await s.table(LIMITS_TABLE)
        started = time.perf_counter()
        results = await asyncio.gather(*(quotas[i % 2].reserve(who, 100) for i in range(200)), return_exceptions=True)
        elapsed = time.perf_counter() - started
        admitted = [r for r in results if isinstance(r, Reservation)]
        refusals = [r for r in results if isinstance(r, ApiError)]
        assert len(admitted) + len(refusals) == 200, [r for r in results if not isinstance(r, (Reservation, ApiError))]
        assert all(r.status == 429 and r.type == "rate_limit_exceeded" for r in refusals)
        assert len(admitted) * 100 <= 10_000
        assert len(admitted) >= 95  # close to the limit: nothing is left sitting on an instance
        assert await taken(azurite, who, "tpm") == len(admitted) * 100
        writes = sum(q.writes for q in quotas)
        reads = sum(q.reads for q in quotas)
        conflicts = sum(q.conflicts for q in quotas)
        print(
            f"\nburst: {len(admitted)} of 200 admitted ({len(admitted) * 100} tokens) in {elapsed * 1000:.0f} ms; "
            f"store: {writes} writes ({conflicts} conflicts), {reads} reads"
        )
        assert writes + reads <= 20  # instead of one conditional write per request, retried on every conflict
    finally:
        for s in stores:
            await s.close()


async def test_slack_given_back_by_one_instance_is_usable_by_the_other(azurite):
    who = caller(tokens_per_minute=1_000)
    a, b = store(azurite), store(azurite)
    clock = Clock()
    qa, qb = Quota(a, "a", clock), Quota(b, "b", clock)
    try:
        held = await qa.reserve(who, 1_000)
        assert (await refused(qb.reserve(who, 100))).status == 429
        await held.settle(400)  # 600 back to the store
        assert qa.held() == 0
        assert await taken(azurite, who, "tpm") == 400
        second = await qb.reserve(who, 600)
        assert (await refused(qb.reserve(who, 1))).type == "rate_limit_exceeded"
        await second.settle(600)
        await held.settle(0)  # idempotent: the first settle stands
        assert await taken(azurite, who, "tpm") == 1_000
    finally:
        await a.close()
        await b.close()


async def test_requests_per_minute_and_a_release_gives_the_request_back(azurite):
    who = caller(requests_per_minute=3)
    s = store(azurite)
    quota = Quota(s, "a", Clock())
    try:
        held = [await quota.reserve(who, 0) for _ in range(3)]
        error = await refused(quota.reserve(who, 0))
        assert error.type == "rate_limit_exceeded" and "requests per min" in error.message
        assert error.headers["Retry-After"] == "43"
        assert error.headers["x-ratelimit-limit-requests"] == "3"
        assert error.headers["x-ratelimit-remaining-requests"] == "0"
        await held[0].release()
        await quota.reserve(who, 0)
        await held[1].settle(10)  # a settled request still counts
        assert (await refused(quota.reserve(who, 0))).status == 429
        assert await taken(azurite, who, "rpm") == 3
    finally:
        await s.close()


async def test_a_refused_request_takes_nothing(azurite):
    who = caller(requests_per_minute=10, tokens_per_minute=100, token_budget=1_000)
    s = store(azurite)
    quota = Quota(s, "a", Clock())
    try:
        first = await quota.reserve(who, 80)
        error = await refused(quota.reserve(who, 50))  # tokens refuse it; its request and budget go back
        assert error.type == "rate_limit_exceeded" and "tokens per min" in error.message
        assert await quota.flush()
        assert (
            await taken(azurite, who, "rpm"),
            await taken(azurite, who, "tpm"),
            await taken(azurite, who, "budget"),
        ) == (1, 80, 80)
        await first.settle(80)
    finally:
        await s.close()


async def test_retry_after_is_the_seconds_to_the_next_window_and_the_window_resets(azurite):
    who = caller(tokens_per_minute=500)
    s = store(azurite)
    clock = Clock(T0)  # 17.3 s into the minute
    quota = Quota(s, "a", clock)
    try:
        ok = await quota.reserve(who, 500)
        assert ok.headers["x-ratelimit-limit-tokens"] == "500"
        assert ok.headers["x-ratelimit-remaining-tokens"] == "0"
        assert ok.headers["x-ratelimit-reset-tokens"] == "42.7s"
        error = await refused(quota.reserve(who, 1))
        assert error.headers["Retry-After"] == "43" and "try again in 43s" in error.message
        clock.now = T0 + 40  # 57.3 s into the minute
        assert (await refused(quota.reserve(who, 1))).headers["Retry-After"] == "3"
        clock.now = T0 + 43  # the next minute: the whole limit again
        again = await quota.reserve(who, 500)
        assert again.headers["x-ratelimit-remaining-tokens"] == "0"
        await ok.settle(100)  # slack of a minute that is over: dropped, not given to this one
        assert await taken(azurite, who, "tpm") == 500
        await again.settle(200)
        assert await taken(azurite, who, "tpm") == 200
    finally:
        await s.close()


async def test_a_request_larger_than_the_whole_limit_is_refused_without_a_store_call(azurite):
    who = caller(tokens_per_minute=1_000, token_budget=5_000)
    s = store(azurite)
    quota = Quota(s, "a", Clock())
    try:
        error = await refused(quota.reserve(who, 1_001))
        assert (error.status, error.type, error.retryable) == (429, "rate_limit_exceeded", False)
        assert error.headers["x-should-retry"] == "false" and "Lower max_tokens" in error.message
        who2 = caller(token_budget=5_000)
        error = await refused(quota.reserve(who2, 5_001))
        assert error.type == "insufficient_quota" and error.headers["x-should-retry"] == "false"
        assert "lower max_tokens" in error.message
        assert quota.reads == quota.writes == 0
    finally:
        await s.close()


@pytest.mark.parametrize("period", ["total", "day", "month"])
async def test_budgets_are_exact_after_settles(azurite, period):
    who = caller(token_budget=1_000, budget_period=period)
    a, b = store(azurite), store(azurite)
    clock = Clock()
    qa, qb = Quota(a, "a", clock), Quota(b, "b", clock)
    try:
        charges = [(300, 120), (400, 400), (200, 250)]  # (reserved, charged): the last one used more
        for i, (reserved, charged) in enumerate(charges):
            r = await (qa if i % 2 else qb).reserve(who, reserved)
            await r.settle(charged)
        assert await qa.flush() and await qb.flush()
        assert await taken(azurite, who, "budget") == 770
        error = await refused(qa.reserve(who, 231))
        assert (error.status, error.type, error.retryable) == (429, "insufficient_quota", False)
        assert error.headers["x-should-retry"] == "false" and "230 of its 1000" in error.message
        last = await qb.reserve(who, 230)
        await last.settle(230)
        assert await taken(azurite, who, "budget") == 1_000
        clock.now += 40 * 86400  # a later day and month
        if period == "total":
            assert (await refused(qa.reserve(who, 1))).type == "insufficient_quota"
        else:
            fresh = await qa.reserve(who, 1_000)
            await fresh.settle(10)
            assert await taken(azurite, who, "budget") == 10
    finally:
        await a.close()
        await b.close()


async def test_a_caller_without_limits_needs_no_store(azurite):
    quota = Quota(Store(StorageConfig(connection_string=DEAD_STORE)), "a", Clock())
    r = await quota.reserve(caller(), 10_000)
    assert r.headers == {}
    await r.settle(5)


async def test_a_store_that_refuses_connections_fails_within_two_seconds():
    s = Store(StorageConfig(connection_string=DEAD_STORE))
    quota = Quota(s, "a", Clock())
    try:
        started = time.monotonic()
        error = await refused(quota.reserve(caller(tokens_per_minute=100), 10))
        assert (error.status, error.type, error.retryable) == (503, "caller_store_unavailable", True)
        assert time.monotonic() - started < 2.0
    finally:
        await s.close()


async def test_a_store_that_hangs_fails_within_two_seconds_and_recovery_is_automatic(azurite):
    proxy = await StoreProxy(azurite.connection_string).start()
    s = Store(StorageConfig(connection_string=proxy.connection_string))
    quota = Quota(s, "a", Clock())
    who = caller(tokens_per_minute=1_000, requests_per_minute=100)
    try:
        held = await quota.reserve(who, 100)
        proxy.set_mode("blackhole")
        started = time.monotonic()
        results = await asyncio.gather(*(quota.reserve(who, 100) for _ in range(5)), return_exceptions=True)
        elapsed = time.monotonic() - started
        # The first reservation took one more request's worth ahead (leases.HOLD_SHARE): at most that one
        # is served without the store; every other fails closed.
        served = [r for r in results if isinstance(r, Reservation)]
        assert len(served) <= 1
        assert all(
            isinstance(r, ApiError) and r.status == 503 and r.type == "caller_store_unavailable"
            for r in results
            if r not in served
        ), results
        assert elapsed < 2.0
        for reservation in served:
            await reservation.release()
        await held.settle(40)  # the store does not answer: the slack stays on this instance, retried
        proxy.set_mode("forward")
        ok = await quota.reserve(who, 100)  # nothing to restart: the next call works
        assert await quota.flush(10)
        await ok.settle(100)
        assert await taken(azurite, who, "tpm") == 140
        assert await taken(azurite, who, "rpm") == 2  # the refused ones took nothing
    finally:
        await s.close()
        await proxy.close()


@pytest.mark.parametrize("seed", [20, 7, 8])
async def test_staggered_arrivals_with_settles_never_overshoot(azurite, seed):
    """Reservations arriving over time on two instances, each settled after a while below what it
    reserved: at every admission what is held plus what was spent stays within the limit, and the
    store ends with exactly what was spent."""
    import random

    rng = random.Random(seed)
    who = caller(tokens_per_minute=10_000)
    stores = [store(azurite), store(azurite)]
    clock = Clock()
    quotas = [Quota(stores[0], "a", clock), Quota(stores[1], "b", clock)]
    in_use = 0  # reserved by held reservations + charged by settled ones
    worst = 0
    spent = 0
    admitted = 0

    async def one(i: int) -> None:
        nonlocal in_use, worst, spent, admitted
        await asyncio.sleep(rng.random() * 0.3)
        try:
            r = await quotas[i % 2].reserve(who, 300)
        except ApiError as exc:
            assert exc.status == 429
            return
        admitted += 1
        in_use += 300
        worst = max(worst, in_use)
        await asyncio.sleep(rng.random() * 0.1)
        charged = rng.randrange(0, 301)
        in_use -= 300 - charged  # before settle: the slack may be reused as soon as settle gives it back
        spent += charged
        await r.settle(charged)

    try:
        for s in stores:
            await s.table(LIMITS_TABLE)
        await asyncio.gather(*(one(i) for i in range(200)))
        for q in quotas:
            assert await q.flush()
        assert worst <= 10_000
        assert admitted > 10_000 // 300  # slack given back let more in than the limit / reservation
        assert await taken(azurite, who, "tpm") == spent
        print(
            f"\nstaggered: {admitted} of 200 admitted, {sum(q.writes for q in quotas)} writes "
            f"({sum(q.conflicts for q in quotas)} conflicts), {sum(q.reads for q in quotas)} reads"
        )
    finally:
        for s in stores:
            await s.close()


async def test_a_background_reservation_is_settled_later_by_another_instance(azurite):
    who = caller(tokens_per_minute=10_000, token_budget=50_000, budget_period="day")
    a, b = store(azurite), store(azurite)
    clock = Clock()
    qa, qb = Quota(a, "a", clock), Quota(b, "b", clock)
    try:
        r = await qa.reserve(who, 4_000)  # the background response starts on instance a...
        clock.now += 5
        await qb.settle_elsewhere(who, 4_000, r.at, 1_500)  # ...and its usage shows up on instance b
        assert await qa.flush()  # a gives back what it held ahead for a next request (leases.HOLD_SECONDS)
        assert await taken(azurite, who, "budget") == 1_500
        assert await taken(azurite, who, "tpm") == 1_500
        clock.now += 60  # a minute later only the budget's day is still current
        r2 = await qa.reserve(who, 1_000)
        await qb.settle_elsewhere(who, 1_000, r2.at - 60, 2_000)  # reserved in the minute that is over
        assert await qa.flush()
        assert await taken(azurite, who, "budget") == 3_500
        assert await taken(azurite, who, "tpm") == 1_000  # this minute's row holds r2's reservation
    finally:
        await a.close()
        await b.close()


async def test_sequential_requests_are_served_from_what_the_instance_holds_ahead(azurite):
    """One request at a time (the common case of one caller): the first exchange takes one more
    request's worth ahead, so the next ones need no store write while the instance holds it (at most
    HOLD_SECONDS); then it goes back, and the row holds exactly what was spent."""
    from chatstream.state.leases import HOLD_SECONDS

    s = store(azurite)
    quota = Quota(s, "a", Clock())
    who = caller(tokens_per_minute=100_000)
    try:
        for i in range(5):
            reservation = await quota.reserve(who, 1_000)
            if i == 0:
                writes = quota.writes
            await reservation.settle(10)
        assert quota.writes == writes, "the four after the first needed no store write"
        started = time.monotonic()
        assert await quota.flush()
        assert time.monotonic() - started <= HOLD_SECONDS + 0.5
        assert await taken(azurite, who, "tpm") == 50
    finally:
        await s.close()
