"""chatstream/state/registry.py (and callers.py, prices.py) on the in-process store: callers and their
keys (shown once, only the hash stored, one point read per key, cached for ``cache_seconds`` with
negative answers, refused on every instance within that time once revoked or rotated), expiry,
concurrent patches, the bucket for made-up keys, teams, prices, and bad input naming the field."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from datetime import UTC, datetime

import pytest
from memory_store import Fault, MemoryData, MemoryStore

from chatstream.errors import ApiError, StoreError
from chatstream.manage import caller_json, price_json, team_json, validate
from chatstream.state.callers import Caller, CallerPatch, CallerSpec, Team, TeamPatch, TeamSpec, hash_key
from chatstream.state.port import Conflict, Invalid, KeyRefused, Missing, Unavailable, Unreadable
from chatstream.state.prices import Price, Prices, PriceSpec
from chatstream.state.registry import AHEAD_DELAY, LOOKUPS_PER_SECOND, Registry
from chatstream.state.store import CALLERS_TABLE, LIMITS_TABLE

T0 = 1_796_083_217.3


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def registry(data: MemoryData | None = None, cache: float = 10.0, clock: Clock | None = None) -> Registry:
    return Registry(MemoryStore(data or MemoryData()), cache_seconds=cache, clock=clock or Clock())


def reads(data: MemoryData) -> int:
    """The store's point reads: here, the key checks that reached it (a caller without a team is
    created without one)."""
    return data.calls.get("get", 0)


async def team_of(reg: Registry, caller: Caller | Unreadable) -> Team | Unreadable | Unavailable | None:
    """The caller's team as the request path reads it (``terms``)."""
    assert isinstance(caller, Caller)
    terms = await reg.terms(caller)
    return terms if isinstance(terms, Unreadable | Unavailable) else terms[0]


async def prices_of(reg: Registry) -> Prices | Unavailable:
    """Every model's price as the request path reads it (``terms``, for a caller without a team)."""
    terms = await reg.terms(Caller(name="p", id="p", created_at=datetime.now(UTC)))
    assert not isinstance(terms, Unreadable)
    return terms if isinstance(terms, Unavailable) else terms[1]


def made_up() -> str:
    return "csk-" + secrets.token_urlsafe(32)


def stored(data: MemoryData) -> str:
    """Everything the store holds, as text."""
    return repr(data.tables) + repr(data.blobs)


async def test_create_list_get_update_rotate_delete():
    data = MemoryData()
    reg = registry(data)
    caller, key = await reg.create(
        CallerSpec(
            name="search",
            tokens_per_minute=10_000,
            requests_per_minute=60,
            token_budget=5_000_000,
            spend_budget=12.5,
            budget_period="month",
            models=["gpt-4o-mini", "gpt-4o"],
            model_limits={"gpt-4o": {"tokens_per_minute": 2_000}},
        )
    )
    assert key.startswith("csk-") and len(key) == 47 and caller.key_hint == key[-4:]
    assert (caller.tokens_per_minute, caller.requests_per_minute, caller.token_budget) == (10_000, 60, 5_000_000)
    assert caller.spend_budget == 12_500_000_000_000  # pico-USD, exact
    assert caller.models == ("gpt-4o-mini", "gpt-4o") and caller.budget_period == "month"
    assert caller.model_limits["gpt-4o"].tokens_per_minute == 2_000
    assert "key" not in caller_json(caller) and caller_json(caller)["spend_budget"] == 12.5
    # Only the hash is stored; the key index is a point read of k|<hash>.
    assert key not in stored(data) and key[4:] not in stored(data)
    assert data.tables[CALLERS_TABLE]["callers"][f"k|{hash_key(key)}"][0]["name"] == "search"
    gets = data.calls.get("get", 0)
    found = await reg.authenticate(key)
    assert isinstance(found, Caller) and found.name == "search" and found.id == caller.id
    assert data.calls["get"] == gets + 1 and data.calls.get("query", 0) == 0
    assert [c.name for c in await reg.list(Caller)] == ["search"]
    assert await reg.get(Caller, "search") == caller

    updated = await reg.update(Caller, "search", CallerPatch(tokens_per_minute=20_000, models=None))
    assert updated.tokens_per_minute == 20_000 and updated.models is None and updated.requests_per_minute == 60
    assert updated.spend_budget == caller.spend_budget and updated.model_limits == caller.model_limits
    assert await reg.get(Caller, "search") == updated
    found = await reg.authenticate(key)  # this instance forgot its cached answer
    assert isinstance(found, Caller) and found.tokens_per_minute == 20_000

    rotated, new = await reg.rotate("search")
    assert new != key and rotated.key_hint == new[-4:] and rotated.id == caller.id
    assert isinstance(await reg.authenticate(key), KeyRefused)
    assert isinstance(await reg.authenticate(new), Caller)
    assert f"k|{hash_key(key)}" not in data.tables[CALLERS_TABLE]["callers"]

    assert (await reg.delete(Caller, "search")).name == "search"
    assert isinstance(await reg.authenticate(new), KeyRefused)
    for missing in (
        reg.get(Caller, "search"),
        reg.delete(Caller, "search"),
        reg.update(Caller, "search", CallerPatch()),
        reg.rotate("search"),
    ):
        with pytest.raises(Missing):
            await missing
    assert await reg.list(Caller) == []
    # A caller made again under the name is a new one: a new id (fresh counters and ledger), a new key.
    again, key_again = await reg.create(CallerSpec(name="search"))
    assert again.id != caller.id and again.tokens_per_minute is None and key_again not in (key, new)
    assert again.limits_partition != caller.limits_partition


async def test_delete_drops_the_callers_counter_rows():
    data = MemoryData()
    reg = registry(data)
    caller, _ = await reg.create(CallerSpec(name="a", token_budget=100))
    store = reg.store
    await store.insert(LIMITS_TABLE, {"PartitionKey": caller.limits_partition, "RowKey": "tokens", "taken": 5})
    await store.insert(LIMITS_TABLE, {"PartitionKey": "someone|else", "RowKey": "tokens", "taken": 7})
    await reg.delete(Caller, "a")
    assert not data.tables[LIMITS_TABLE].get(caller.limits_partition)
    assert data.tables[LIMITS_TABLE]["someone|else"]


async def test_key_checks_are_cached_for_cache_seconds_negative_answers_too_and_shared_by_concurrent_checks():
    clock = Clock()
    data = MemoryData()
    reg = registry(data, cache=10.0, clock=clock)
    _, key = await reg.create(CallerSpec(name="a"))
    callers = await asyncio.gather(*(reg.authenticate(key) for _ in range(20)))
    assert all(isinstance(c, Caller) and c.name == "a" for c in callers)
    assert reads(data) == 1  # one read for 20 concurrent first checks
    clock.now += 9.9
    await reg.authenticate(key)
    assert reads(data) == 1
    clock.now += 0.2  # past cache_seconds: asked again
    await reg.authenticate(key)
    assert reads(data) == 2
    # A key that cannot be one of ours costs no read; a well-shaped unknown one is remembered as unknown.
    for bad in (None, "", "sk-123", "csk-short", key + "x", key[:-1] + "!", 5):
        assert isinstance(await reg.authenticate(bad), KeyRefused)  # type: ignore[arg-type]
    assert reads(data) == 2
    unknown = made_up()
    for _ in range(3):
        assert isinstance(await reg.authenticate(unknown), KeyRefused)
    assert reads(data) == 3
    clock.now += 10.1
    assert isinstance(await reg.authenticate(unknown), KeyRefused)
    assert reads(data) == 4


async def test_a_key_in_steady_use_is_read_again_ahead_in_the_background_never_on_the_path():
    data = MemoryData()
    clock = Clock()
    reg = registry(data, 10.0, clock)
    _, key = await reg.create(CallerSpec(name="a"))
    assert isinstance(await reg.authenticate(key), Caller)
    assert reads(data) == 1
    for _ in range(5):  # a request every 3 s for 15 s: each answer from the cache
        clock.now += 3
        before = reads(data)
        assert isinstance(await reg.authenticate(key), Caller)
        assert reads(data) == before, "fresh when the request comes: no read on its path"
        # the read ahead (in the last 2 s of an answer's 10) runs in the background
        await asyncio.sleep(AHEAD_DELAY + 0.05)
    assert reads(data) == 2  # once per period, as before: ahead of time
    await reg.delete(Caller, "a")
    clock.now += 10.01  # a change still takes effect within cache_seconds
    assert isinstance(await reg.authenticate(key), KeyRefused)


@pytest.mark.parametrize("change", ["delete", "rotate"])
async def test_a_revoked_or_rotated_key_stops_on_another_instance_within_the_cache_time(change):
    data = MemoryData()
    clock = Clock()
    admin, other = registry(data, 10.0, clock), registry(data, 10.0, clock)  # two instances, one store
    _, key = await admin.create(CallerSpec(name="a"))
    assert isinstance(await other.authenticate(key), Caller)  # cached there now
    clock.now += 3
    if change == "delete":
        await admin.delete(Caller, "a")
    else:
        _, new = await admin.rotate("a")
        assert isinstance(await other.authenticate(new), Caller)  # the new key works at once
    assert isinstance(await admin.authenticate(key), KeyRefused)  # at once where the change was made
    clock.now += 6.9  # the other instance's answer is 9.9 s old
    assert isinstance(await other.authenticate(key), Caller)
    clock.now += 0.2  # 10.1 s: refused, 7.1 s after the change
    assert isinstance(await other.authenticate(key), KeyRefused)


async def test_an_update_reaches_another_instance_within_the_cache_time():
    data = MemoryData()
    clock = Clock()
    admin, other = registry(data, 2.0, clock), registry(data, 2.0, clock)
    _, key = await admin.create(CallerSpec(name="a", tokens_per_minute=100))
    first = await other.authenticate(key)
    assert isinstance(first, Caller) and first.tokens_per_minute == 100
    await admin.update(Caller, "a", CallerPatch(tokens_per_minute=200))
    clock.now += 2.01
    later = await other.authenticate(key)
    assert isinstance(later, Caller) and later.tokens_per_minute == 200


async def test_expired_keys_are_refused_even_when_cached_and_a_past_expiry_is_refused_at_creation():
    clock = Clock()
    reg = registry(cache=30.0, clock=clock)
    expires = datetime.fromtimestamp(clock.now + 3600, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    caller, key = await reg.create(CallerSpec(name="a", expires_at=expires))
    assert caller.expires_at is not None and isinstance(await reg.authenticate(key), Caller)
    clock.now += 3601
    refused = await reg.authenticate(key)
    assert refused == KeyRefused(expired=True)
    with pytest.raises(Invalid) as info:
        await reg.create(validate(CallerSpec, {"name": "b", "expires_at": "2001-01-01T00:00:00Z"}))
    assert info.value.param == "expires_at"
    with pytest.raises(Invalid) as info:
        await reg.update(Caller, "a", validate(CallerPatch, {"expires_at": "2001-01-01T00:00:00Z"}))
    assert info.value.param == "expires_at"
    unexpired = await reg.update(Caller, "a", CallerPatch(expires_at=None))
    assert unexpired.expires_at is None
    assert isinstance(await reg.authenticate(key), Caller)


async def test_concurrent_patches_on_two_instances_lose_no_update():
    data = MemoryData()
    a, b = registry(data), registry(data)
    await a.create(CallerSpec(name="x"))
    patches = [
        {"tokens_per_minute": 111},
        {"requests_per_minute": 22},
        {"token_budget": 3_333},
        {"models": ["m1"]},
        {"spend_budget": 4.25},
    ]
    await asyncio.gather(*((a, b)[i % 2].update(Caller, "x", validate(CallerPatch, p)) for i, p in enumerate(patches)))
    assert data.calls["batch"] > 1 + len(patches)  # they met: some were refused by the ETag and redone
    final = await a.get(Caller, "x")
    assert (final.tokens_per_minute, final.requests_per_minute, final.token_budget) == (111, 22, 3_333)
    assert final.models == ("m1",) and final.spend_budget == 4_250_000_000_000
    # ...and the key index holds the same caller as the caller row.
    index = [row for k, (row, _) in data.tables[CALLERS_TABLE]["callers"].items() if k.startswith("k|")]
    assert len(index) == 1 and index[0]["tokens_per_minute"] == 111 and index[0]["spend_budget"] == 4_250_000_000_000


async def test_a_patch_with_null_removes_a_limit_and_the_period_defaults():
    reg = registry()
    await reg.create(CallerSpec(name="a", tokens_per_minute=5, token_budget=9, budget_period="day"))
    updated = await reg.update(Caller, "a", CallerPatch(tokens_per_minute=None, budget_period=None))
    assert (updated.tokens_per_minute, updated.token_budget, updated.budget_period) == (None, 9, "total")
    assert (await reg.get(Caller, "a")) == updated


def test_null_is_the_default_period_when_made_as_when_changed():
    """A new caller or team given ``"budget_period": null`` gets the default, as a patch does (it was a 400)."""
    for spec in (CallerSpec, TeamSpec):
        assert spec.model_validate({"name": "a", "budget_period": None}).budget_period == "total"
    assert CallerPatch.model_validate({"budget_period": None}).budget_period == "total"


async def test_a_flood_of_made_up_keys_is_bounded_and_known_callers_still_get_in():
    clock = Clock()
    data = MemoryData()
    reg = registry(data, cache=10.0, clock=clock)
    _, key = await reg.create(CallerSpec(name="known"))
    assert isinstance(await reg.authenticate(key), Caller)
    clock.now += 10.5  # its cached answer is stale: the next check reads the store again
    flood = await asyncio.gather(*(reg.authenticate(made_up()) for _ in range(300)))
    assert reads(data) <= 1 + 2 * LOOKUPS_PER_SECOND  # the bucket, not one read per made-up key
    assert sum(isinstance(f, Unavailable) for f in flood) >= 300 - 2 * LOOKUPS_PER_SECOND
    assert all(isinstance(f, KeyRefused | Unavailable) for f in flood)
    # The flood waits its turn; a caller this instance knows does not.
    assert isinstance(await reg.authenticate(key), Caller)


async def test_concurrent_first_checks_of_one_key_take_one_lookup_of_the_bucket():
    """A caller's burst of 200 requests as its cached answer runs out (every ``cache_seconds``): one
    store read, and none of them is refused as if it were a flood of made-up keys."""
    clock = Clock()
    data = MemoryData()
    reg = registry(data, cache=10.0, clock=clock)
    _, key = await reg.create(CallerSpec(name="busy"))
    for _ in range(3):
        burst = await asyncio.gather(*(reg.authenticate(key) for _ in range(200)))
        assert all(isinstance(c, Caller) for c in burst), {type(c).__name__ for c in burst}
        clock.now += 10.5
    assert reads(data) == 3


async def test_a_store_that_fails_is_unavailable_and_not_remembered():
    reg = registry()
    _, key = await reg.create(CallerSpec(name="a"))
    store = reg.store
    assert isinstance(store, MemoryStore)
    store.inject(Fault("unavailable", frozenset({"get"})))
    assert isinstance(await reg.authenticate(key), Unavailable)
    assert isinstance(await reg.authenticate(key), Caller)  # the outage was not cached: asked again
    store.inject(Fault("unavailable", frozenset({"batch"})))
    with pytest.raises(StoreError):
        await reg.create(CallerSpec(name="b"))
    store.inject(Fault("unavailable", frozenset({"query"})))
    with pytest.raises(StoreError):
        await reg.list(Caller)


async def test_a_duplicate_name_is_invalid_naming_the_field_and_the_first_one_stands():
    reg = registry()
    await reg.create(CallerSpec(name="a"))
    with pytest.raises(Invalid) as info:
        await reg.create(CallerSpec(name="a", tokens_per_minute=5))
    assert info.value.param == "name" and "already exists" in str(info.value)
    assert (await reg.get(Caller, "a")).tokens_per_minute is None


# --- teams -----------------------------------------------------------------------------------------


async def test_teams_create_get_patch_and_delete_once_they_have_no_callers():
    clock = Clock()
    reg = registry(cache=10.0, clock=clock)
    team, _ = await reg.create(TeamSpec(name="search", spend_budget=100, budget_period="day"))
    assert team.spend_budget == 100 * 10**12 and team_json(team)["spend_budget"] == 100.0
    with pytest.raises(Invalid) as info:
        await reg.create(TeamSpec(name="search"))
    assert info.value.param == "name"
    assert [t.name for t in await reg.list(Team)] == ["search"]
    patched = await reg.update(
        Team, "search", TeamPatch(tokens_per_minute=1_000, model_limits={"m": {"requests_per_minute": 2}})
    )
    assert patched.tokens_per_minute == 1_000 and patched.spend_budget == team.spend_budget
    assert patched.model_limits["m"].requests_per_minute == 2 and patched.id == team.id
    assert await reg.get(Team, "search") == patched

    with pytest.raises(Invalid) as info:  # a caller's team must exist
        await reg.create(CallerSpec(name="a", team="nope"))
    assert info.value.param == "team"
    caller, _ = await reg.create(CallerSpec(name="a", team="search"))
    assert caller.team == "search" and caller.team_id == team.id
    assert await team_of(reg, caller) == patched
    with pytest.raises(Conflict):
        await reg.delete(Team, "search")
    moved = await reg.update(Caller, "a", CallerPatch(team=None))
    assert moved.team is None and moved.team_id is None
    assert (await reg.delete(Team, "search")).name == "search"
    for missing in (reg.get(Team, "search"), reg.update(Team, "search", TeamPatch()), reg.delete(Team, "search")):
        with pytest.raises(Missing):
            await missing
    with pytest.raises(Invalid):
        await reg.update(Caller, "a", CallerPatch(team="search"))


async def test_a_team_deleted_and_made_again_is_a_new_team_to_its_old_callers():
    clock = Clock()
    reg = registry(cache=1.0, clock=clock)
    await reg.create(TeamSpec(name="t", token_budget=10))
    caller, _ = await reg.create(CallerSpec(name="a", team="t"))
    assert await team_of(reg, caller) is not None
    # A race left the caller without its team (deleted as the caller was made): its limits don't apply.
    await reg.store.delete(CALLERS_TABLE, "teams", "t|t")
    await reg.create(TeamSpec(name="t", token_budget=99))
    clock.now += 1.1
    assert await team_of(reg, caller) is None
    assert await team_of(reg, await reg.get(Caller, "a")) is None  # its stored team id is the old one's


async def test_team_answers_are_cached_like_keys():
    clock = Clock()
    data = MemoryData()
    admin, other = registry(data, 5.0, clock), registry(data, 5.0, clock)
    await admin.create(TeamSpec(name="t", tokens_per_minute=10))
    caller, _ = await admin.create(CallerSpec(name="a", team="t"))
    first = await team_of(other, caller)
    assert first is not None and not isinstance(first, Unavailable) and first.tokens_per_minute == 10
    await admin.update(Team, "t", TeamPatch(tokens_per_minute=20))
    gets = data.calls["get"]
    cached = await team_of(other, caller)
    assert cached is not None and not isinstance(cached, Unavailable) and cached.tokens_per_minute == 10
    assert data.calls["get"] == gets
    clock.now += 5.1
    fresh = await team_of(other, caller)
    assert fresh is not None and not isinstance(fresh, Unavailable) and fresh.tokens_per_minute == 20


# --- prices ----------------------------------------------------------------------------------------


async def price_of(reg: Registry, model: str) -> Price | None:
    """The model's price as the request path reads it (``terms``: every model's, in one read)."""
    prices = await prices_of(reg)
    assert not isinstance(prices, Unavailable)
    return prices.get(model)


async def test_prices_put_get_list_delete_exactly_in_pico_dollars():
    clock = Clock()
    data = MemoryData()
    reg, other = registry(data, 5.0, clock), registry(data, 5.0, clock)
    price = await reg.set_price("gpt-4o-mini", PriceSpec(input=0.15, cached_input=0.075, output=0.6))
    assert (price.input, price.cached_input, price.output) == (150_000, 75_000, 600_000)  # pico-USD per token
    assert price_json(price)["input"] == 0.15 and price_json(price)["cached_input"] == 0.075
    # 1,000 prompt tokens of which 400 cached, 250 completion: 600×0.15 + 400×0.075 + 250×0.6 per million
    assert price.cost(1_000, 400, 250) == 600 * 150_000 + 400 * 75_000 + 250 * 600_000 == 270_000_000
    assert price.most(1_000, 250) == 1_000 * 150_000 + 250 * 600_000
    same = await reg.set_price("deploy/gpt-4o", PriceSpec(input=2.5, output=10))  # cached_input defaults to input
    assert same.cached_input == same.input == 2_500_000 and same.output == 10_000_000
    assert [p.model for p in await reg.list(Price)] == ["deploy/gpt-4o", "gpt-4o-mini"]
    assert (await reg.get(Price, "deploy/gpt-4o")).input == 2_500_000
    assert await price_of(other, "gpt-4o-mini") == price
    assert await price_of(other, "unpriced") is None
    # A change applies from when it is made, on every instance within the cache time.
    await reg.set_price("gpt-4o-mini", PriceSpec(input=0.3, output=1.2))
    local = await price_of(reg, "gpt-4o-mini")
    assert isinstance(local, Price) and local.input == 300_000
    cached = await price_of(other, "gpt-4o-mini")
    assert isinstance(cached, Price) and cached.input == 150_000
    clock.now += 5.1
    fresh = await price_of(other, "gpt-4o-mini")
    assert isinstance(fresh, Price) and fresh.input == 300_000
    assert (await reg.delete(Price, "gpt-4o-mini")).model == "gpt-4o-mini"
    assert await price_of(reg, "gpt-4o-mini") is None
    for model in ("gpt-4o-mini", "", "x" * 300):
        with pytest.raises(Missing):
            await reg.get(Price, model)
    with pytest.raises(Missing):
        await reg.delete(Price, "gpt-4o-mini")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 0.0000015, "output": 1}, "input"),  # 7 decimal places
        ({"input": 1, "output": 1.1234567}, "output"),
        ({"input": -1, "output": 1}, "input"),
        ({"input": 1, "output": 1, "cached_input": -0.5}, "cached_input"),
        ({"input": "0.15", "output": 1}, "input"),
        ({"input": True, "output": 1}, "input"),
        ({"input": 1e400, "output": 1}, "input"),
        ({"input": 100_001, "output": 1}, "input"),
        ({"output": 1}, "input"),
        ({"input": 1}, "output"),
        ({"input": 1, "output": 1, "currency": "EUR"}, "currency"),
    ],
)
async def test_bad_prices_are_invalid_naming_the_field_never_the_value(body, param):
    reg = registry()
    with pytest.raises(ApiError) as info:  # the admin API's 400 (manage.validate)
        await reg.set_price("m", validate(PriceSpec, body))
    assert info.value.param == param and str(info.value).startswith(param)
    for value in body.values():
        if isinstance(value, float | str) and not isinstance(value, bool) and value not in (1, 1.0):
            assert str(value) not in str(info.value)
    assert await reg.list(Price) == []


async def test_a_price_of_six_decimals_and_zero_are_exact():
    reg = registry()
    price = await reg.set_price("m", PriceSpec(input=0.000001, output=0, cached_input=99_999.999999))
    assert (price.input, price.output, price.cached_input) == (1, 0, 99_999_999_999)
    assert price.cost(3, 1, 7) == 2 * 1 + 1 * 99_999_999_999
    for model in ("", " m", "m\n", "x" * 257, 5):
        with pytest.raises(Invalid) as info:
            await reg.set_price(model, PriceSpec(input=1, output=1))  # type: ignore[arg-type]
        assert info.value.param == "model"
    odd = "gpt\u200b4"  # a name a caller's models may hold can be priced (one rule for a model name)
    await reg.create(CallerSpec(name="z", models=[odd]))
    assert (await reg.set_price(odd, PriceSpec(input=1, output=1))).model == (await reg.get(Price, odd)).model == odd


async def write_raw_price(data: MemoryData, model: str, **fields: object) -> None:
    """A price row as a hand edit (Storage Explorer) or an older version may have left it: the
    fields given replace the stored ones, ``None`` removes one."""
    row = {"PartitionKey": "prices", "RowKey": f"p|{model}", "model": model, "input": 1, "output": 1}
    row |= {"cached_input": 1, "updated_at": "2026-01-01T00:00:00Z"} | fields
    await MemoryStore(data).upsert(CALLERS_TABLE, {k: v for k, v in row.items() if v is not None})


@pytest.mark.parametrize(
    "bad",
    [{"input": None}, {"output": "ten"}, {"cached_input": 1.5}, {"input": True}, {"output": -3}, {"updated_at": "x"}],
)
async def test_an_unreadable_price_row_costs_only_its_model_and_is_logged_once_with_its_key(bad, caplog):
    clock, data = Clock(), MemoryData()
    reg = registry(data, 1.0, clock)
    good = await reg.set_price("good", PriceSpec(input=1, output=2))
    await write_raw_price(data, "broken", **bad)
    await write_raw_price(data, "whole", input=150_000.0)  # a Double that is a whole number reads as one
    with caplog.at_level(logging.WARNING, logger="chatstream"):
        for _ in range(3):  # every read of the prices finds it: logged the first time only
            prices = await prices_of(reg)
            assert not isinstance(prices, Unavailable)
            assert prices["good"] == good and prices["whole"].input == 150_000 and "broken" not in prices
            assert prices.unreadable == {"broken"}
            clock.now += 1.1
        listed = await reg.list(Price)  # the admin's list shows it as unreadable, among the others
        assert [getattr(p, "model", None) for p in listed] == [None, "good", "whole"]
        assert isinstance(listed[0], Unreadable) and listed[0].name == "broken"
    logged = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(logged) == 1 and "price row 'p|broken'" in logged[0], logged
    await reg.set_price("broken", PriceSpec(input=3, output=4))  # an admin sets it again: it is read
    prices = await prices_of(reg)
    assert not isinstance(prices, Unavailable) and prices["broken"].input == 3_000_000 and not prices.unreadable


async def test_an_unreadable_caller_row_is_listed_as_such_and_still_holds_its_team(caplog):
    data = MemoryData()
    reg = registry(data)
    await reg.create(TeamSpec(name="t"))
    await reg.create(CallerSpec(name="a"))
    await MemoryStore(data).upsert(CALLERS_TABLE, {"PartitionKey": "callers", "RowKey": "c|b", "team": "t"})
    with caplog.at_level(logging.WARNING, logger="chatstream"):
        for _ in range(2):  # (logged once)
            listed = await reg.list(Caller)
            assert [(c.name, type(c)) for c in listed] == [("a", Caller), ("b", Unreadable)]
        with pytest.raises(Conflict):
            await reg.delete(Team, "t")
    logged = [r.getMessage() for r in caplog.records if "'c|b'" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("caller row 'c|b' of table chatstreamCallers is unreadable")


async def spoil(data: MemoryData, row_key: str, **fields: object) -> None:
    """A row as a hand edit (Storage Explorer) or a bad write may leave it: the fields given replace
    the stored ones, ``None`` removes one."""
    store = MemoryStore(data)
    partition = "teams" if row_key.startswith("t|") else "callers"
    row = dict(await store.get(CALLERS_TABLE, partition, row_key) or {}) | fields
    await store.upsert(CALLERS_TABLE, {k: v for k, v in row.items() if v is not None})


BAD_ROWS = [{"models": "[not json"}, {"id": None}, {"tokens_per_minute": "100"}, {"created_at": 5}]


@pytest.mark.parametrize("bad", BAD_ROWS)
async def test_an_unreadable_caller_refuses_its_key_saying_so_and_is_shown_and_deleted_whole(bad, caplog):
    """Its key's requests are refused as Unreadable (logged once per version of the row, read again
    each cache period), never a crash; the admin reads it as unreadable, cannot patch or rotate it
    (Conflict), and deletes both its rows."""
    clock, data = Clock(), MemoryData()
    reg = registry(data, 1.0, clock)
    caller, key = await reg.create(CallerSpec(name="a", models=["m"]))
    for row_key in ("c|a", f"k|{hash_key(key)}"):
        await spoil(data, row_key, **bad)
    with caplog.at_level(logging.WARNING, logger="chatstream"):
        for _ in range(3):
            found = await reg.authenticate(key)
            assert isinstance(found, Unreadable) and (found.scope, found.name) == ("caller", "a"), found
            assert key not in found.why and "100" not in found.why and "not json" not in found.why
            clock.now += 1.1
        shown = await reg.get(Caller, "a")
        assert isinstance(shown, Unreadable) and shown.name == "a" and shown.why == found.why
        with pytest.raises(Conflict, match="unreadable"):
            await reg.update(Caller, "a", CallerPatch(tokens_per_minute=5))
        with pytest.raises(Conflict, match="unreadable"):
            await reg.rotate("a")
    logged = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(logged) == 2, logged  # the key index once (3 reads), the caller row once (get, update, rotate)
    assert sum("'c|a'" in line for line in logged) == 1
    assert isinstance(await reg.delete(Caller, "a"), Unreadable)
    assert not data.tables[CALLERS_TABLE].get("callers"), "both rows are gone"
    assert isinstance(await reg.authenticate(key), KeyRefused)
    made, _ = await reg.create(CallerSpec(name="a"))  # and it can be created again
    assert made.id != caller.id


async def test_a_whole_number_typed_in_by_hand_reads_as_its_integer_in_every_kind():
    """Storage Explorer types a number as a Double: 100.0 reads as 100 in a caller or team row as it
    did in a price row (a caller's was unreadable, its key refused); 1.5 stays unreadable."""
    data = MemoryData()
    reg = registry(data)
    _, key = await reg.create(CallerSpec(name="a", tokens_per_minute=5))
    await reg.create(TeamSpec(name="t", token_budget=7))
    for row_key in ("c|a", f"k|{hash_key(key)}"):
        await spoil(data, row_key, tokens_per_minute=100.0)
    await spoil(data, "t|t", token_budget=900.0)
    found = await reg.authenticate(key)
    assert isinstance(found, Caller) and found.tokens_per_minute == 100
    team = await reg.get(Team, "t")
    assert isinstance(team, Team) and team.token_budget == 900
    await spoil(data, "t|t", token_budget=1.5)
    assert isinstance(await reg.get(Team, "t"), Unreadable)


async def test_an_unreadable_team_refuses_its_callers_saying_so_and_is_deleted_once_it_has_none():
    data = MemoryData()
    reg = registry(data)
    team, _ = await reg.create(TeamSpec(name="t", tokens_per_minute=100))
    caller, key = await reg.create(CallerSpec(name="a", team="t"))
    await spoil(data, "t|t", tokens_per_minute=1.5)
    found = await reg.authenticate(key)
    assert isinstance(found, Caller)
    answer = await team_of(reg, found)
    assert isinstance(answer, Unreadable) and (answer.scope, answer.name, answer.id) == ("team", "t", team.id)
    assert isinstance(await reg.get(Team, "t"), Unreadable)
    with pytest.raises(Conflict, match="unreadable"):
        await reg.update(Team, "t", TeamPatch(tokens_per_minute=5))
    with pytest.raises(Conflict, match="still has 1 caller"):
        await reg.delete(Team, "t")
    await reg.delete(Caller, "a")
    assert isinstance(await reg.delete(Team, "t"), Unreadable)
    assert not data.tables[CALLERS_TABLE].get("teams")


async def test_a_caller_row_without_its_key_hash_is_deleted_with_the_key_index_that_names_it():
    data = MemoryData()
    reg = registry(data)
    _, key = await reg.create(CallerSpec(name="a"))
    _, other = await reg.create(CallerSpec(name="b"))
    await spoil(data, "c|a", key_hash=None, id=None)
    await reg.delete(Caller, "a")
    assert isinstance(await reg.authenticate(key), KeyRefused)
    assert isinstance(await reg.authenticate(other), Caller)


async def test_a_caller_whose_key_index_is_gone_is_deleted():
    """A readable caller row whose key index a hand edit removed: deleted (it was a 409 after five
    tries, the transaction's delete of the missing index failing each time)."""
    data = MemoryData()
    reg = registry(data)
    _, key = await reg.create(CallerSpec(name="a"))
    await reg.store.delete(CALLERS_TABLE, "callers", f"k|{hash_key(key)}")
    assert (await reg.delete(Caller, "a")).name == "a"
    assert not data.tables[CALLERS_TABLE].get("callers")


# --- what an admin may say ---------------------------------------------------------------------------

LONG = "x" * 10_000


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"name": "a", "colour": "red"}, "colour"),
        ({"name": "a", "tokens_per_minute": -1}, "tokens_per_minute"),
        ({"name": "a", "tokens_per_minute": 0}, "tokens_per_minute"),
        ({"name": "a", "tokens_per_minute": 10**30}, "tokens_per_minute"),
        ({"name": "a", "tokens_per_minute": 1_000_000_001}, "tokens_per_minute"),
        ({"name": "a", "tokens_per_minute": "100"}, "tokens_per_minute"),
        ({"name": "a", "tokens_per_minute": True}, "tokens_per_minute"),
        ({"name": "a", "tokens_per_minute": 1.5}, "tokens_per_minute"),
        ({"name": "a", "requests_per_minute": 1_000_001}, "requests_per_minute"),
        ({"name": "a", "requests_per_minute": -5}, "requests_per_minute"),
        ({"name": "a", "token_budget": -5}, "token_budget"),
        ({"name": "a", "token_budget": 10**13}, "token_budget"),
        ({"name": "a", "spend_budget": 0}, "spend_budget"),
        ({"name": "a", "spend_budget": -1}, "spend_budget"),
        ({"name": "a", "spend_budget": 1.0000001}, "spend_budget"),
        ({"name": "a", "spend_budget": "5"}, "spend_budget"),
        ({"name": "a", "spend_budget": 1_000_001}, "spend_budget"),
        ({"name": "a", "budget_period": "week"}, "budget_period"),
        ({"name": "a", "models": []}, "models"),
        ({"name": "a", "models": ["m"] * 101}, "models"),
        ({"name": "a", "models": ["m" * 257]}, "models"),
        ({"name": "a", "models": ["a", "a"]}, "models"),
        ({"name": "a", "models": ["a\nb"]}, "models"),
        ({"name": "a", "models": [" a"]}, "models"),
        ({"name": "a", "models": "gpt-4o"}, "models"),
        ({"name": "a", "model_limits": {"m": {}}}, "model_limits"),
        ({"name": "a", "model_limits": {"m": {"tokens_per_minute": 0}}}, "model_limits"),
        ({"name": "a", "model_limits": {"m": {"colour": 1}}}, "model_limits"),
        ({"name": "a", "model_limits": {"m\n": {"tokens_per_minute": 5}}}, "model_limits"),
        ({"name": "a", "model_limits": [1]}, "model_limits"),
        ({"name": "a", "team": "a b"}, "team"),
        ({"name": "a", "expires_at": "tomorrow"}, "expires_at"),
        ({"name": "a", "expires_at": "2030-01-01T00:00:00"}, "expires_at"),  # no time zone
        ({"name": "a", "expires_at": "9999-01-01T00:00:00Z"}, "expires_at"),
        ({"name": "a\nb"}, "name"),
        ({"name": "a\x00"}, "name"),
        ({"name": "a\u2028"}, "name"),
        ({"name": LONG}, "name"),
        ({"name": ""}, "name"),
        ({"name": "-a"}, "name"),
        ({"name": "a b"}, "name"),
        ({"name": "ä"}, "name"),
        ({"name": "a/b"}, "name"),
        ({"name": None}, "name"),
        ({"name": 5}, "name"),
        ({}, "name"),
        ({"name": "a", LONG: 1}, "x" * 64 + "…"),
    ],
)
async def test_bad_admin_input_is_invalid_naming_the_field_never_the_value(body, param):
    data = MemoryData()
    reg = registry(data)
    with pytest.raises((Invalid, ApiError)) as info:  # the registry's refusal, or the body's 400
        await reg.create(validate(CallerSpec, body))
    assert info.value.param == param, str(info.value)
    assert str(info.value).startswith(param) and len(str(info.value)) < 300
    for value in body.values():  # never echoed
        if isinstance(value, str) and len(value) >= 3:
            assert value not in str(info.value)
    assert not data.tables.get(CALLERS_TABLE)  # nothing was written
    if param not in ("team", "expires_at"):  # a team's settings are validated the same way
        with pytest.raises((Invalid, ApiError)) as info:
            await reg.create(validate(TeamSpec, body))
        assert info.value.param == param


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"name": "other"}, "name"),
        ({"tokens_per_minute": -1}, "tokens_per_minute"),
        ({"budget_period": "year"}, "budget_period"),
        ({"key": "csk-x"}, "key"),
        ({"id": "x"}, "id"),
        ({"spend_budget": 0.1234567}, "spend_budget"),
    ],
)
def test_bad_patches_are_invalid_naming_the_field(patch, param):
    for model in (CallerPatch, TeamPatch):  # what the admin API hands the registry, or a 400
        with pytest.raises(ApiError) as info:
            validate(model, patch)
        assert info.value.param == param


async def test_names_that_cannot_be_a_caller_are_missing_without_a_store_read():
    data = MemoryData()
    reg = registry(data)
    for name in ("", "a b", "\n", "x" * 100, "a/b"):
        with pytest.raises(Missing) as info:
            await reg.get(Caller, name)
        assert "\n" not in str(info.value)
        with pytest.raises(Missing):
            await reg.get(Team, name)
    assert data.calls.get("get", 0) == 0


async def test_keys_never_reach_a_log_an_error_an_answer_or_the_store(caplog):
    caplog.set_level(logging.DEBUG)
    data = MemoryData()
    reg = registry(data, cache=0.01)
    caller, key = await reg.create(CallerSpec(name="a", tokens_per_minute=100))
    await reg.authenticate(key)
    rotated, new = await reg.rotate("a")
    errors: list[str] = []
    with pytest.raises(Invalid) as info:
        await reg.create(CallerSpec(name="a"))
    errors.append(str(info.value))
    answers = [
        caller_json(caller),
        caller_json(rotated),
        caller_json(await reg.get(Caller, "a")),
        [caller_json(c) for c in await reg.list(Caller)],
    ]
    await reg.delete(Caller, "a")
    text = caplog.text + json.dumps(answers) + stored(data) + " ".join(errors)
    for k in (key, new):
        assert k not in text and k[4:] not in text
    assert hash_key(new) not in json.dumps(answers)  # the hash is the store's business only
    assert f'"key_hint": "{new[-4:]}"' in json.dumps(answers)


async def test_model_access_and_concurrent_creates_of_one_name():
    reg = registry()
    results = await asyncio.gather(
        *(reg.create(CallerSpec(name="same", models=["gpt-4o-mini"])) for _ in range(5)), return_exceptions=True
    )
    made = [r for r in results if isinstance(r, tuple)]
    assert len(made) == 1 and all(isinstance(r, Invalid) for r in results if r not in made)
    caller = made[0][0]
    assert caller.allows("gpt-4o-mini") and not caller.allows("gpt-4o")
