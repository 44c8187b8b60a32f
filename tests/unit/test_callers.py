"""chatstream/state/callers.py against a real Azurite: the registry's admin operations, key checks
cached per instance (and how fast a revoked or rotated key stops working on another instance),
expiry, bad input naming the field, and keys that never reach a log, an error or the store."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

import pytest

from chatstream.errors import ApiError
from chatstream.state.callers import hash_key, key_from_headers
from chatstream.state.legacy_store import CALLERS_TABLE, StorageConfig, Store
from chatstream.state.registry import CallerRegistry

DEAD_STORE = (
    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;"
    "TableEndpoint=http://127.0.0.1:9/devstoreaccount1;"
)


class Clock:
    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def name() -> str:
    return f"team-{secrets.token_hex(4)}"


@pytest.fixture
def stores(azurite):
    made: list[Store] = []

    def make() -> Store:
        made.append(Store(StorageConfig(connection_string=azurite.connection_string)))
        return made[-1]

    yield make
    for store in made:
        asyncio.run(store.close())


async def error_of(coro) -> ApiError:
    with pytest.raises(ApiError) as info:
        await coro
    return info.value


async def test_create_list_get_update_rotate_delete(stores):
    registry = CallerRegistry(stores(), cache_seconds=5)
    who = name()
    caller, key = await registry.create(
        {
            "name": who,
            "tokens_per_minute": 10_000,
            "requests_per_minute": 60,
            "token_budget": 5_000_000,
            "budget_period": "month",
            "models": ["gpt-4o-mini", "gpt-4o"],
        }
    )
    assert key.startswith("csk-") and len(key) == 47 and caller.key_hint == key[-4:]
    assert (caller.tokens_per_minute, caller.requests_per_minute, caller.token_budget) == (10_000, 60, 5_000_000)
    assert caller.models == ("gpt-4o-mini", "gpt-4o") and caller.budget_period == "month"
    assert (await registry.authenticate(key)).name == who
    assert who in [c.name for c in await registry.list()]
    assert await registry.get(who) == caller

    updated = await registry.update(who, {"tokens_per_minute": 20_000, "models": None})
    assert updated.tokens_per_minute == 20_000 and updated.models is None and updated.requests_per_minute == 60
    assert await registry.get(who) == updated
    assert (await registry.authenticate(key)).tokens_per_minute == 20_000  # this instance forgot its cache

    rotated, new = await registry.rotate(who)
    assert new != key and rotated.key_hint == new[-4:] and rotated.id == caller.id
    assert (await error_of(registry.authenticate(key))).type == "invalid_api_key"
    assert (await registry.authenticate(new)).name == who

    deleted = await registry.delete(who)
    assert deleted.name == who
    assert (await error_of(registry.authenticate(new))).status == 401
    assert (await error_of(registry.get(who))).status == 404
    assert (await error_of(registry.delete(who))).status == 404
    assert (await error_of(registry.update(who, {}))).status == 404
    # A caller made again under the name is a new one: a new id (fresh counters), a new key.
    again, _ = await registry.create({"name": who})
    assert again.id != caller.id and again.tokens_per_minute is None


async def test_key_checks_are_cached_and_shared_by_concurrent_requests(stores):
    registry = CallerRegistry(stores(), cache_seconds=30)
    _, key = await registry.create({"name": name()})
    reads = registry.store_reads
    callers = await asyncio.gather(*(registry.authenticate(key) for _ in range(50)))
    assert len({c.name for c in callers}) == 1
    assert registry.store_reads == reads + 1  # one read for 50 concurrent first checks
    await registry.authenticate(key)
    assert registry.store_reads == reads + 1
    # A key that is not one of ours (wrong shape) costs no store read; an unknown one is remembered too.
    for bad in (None, "", "sk-123", "csk-short", key + "x", key[:-1] + "!"):
        assert (await error_of(registry.authenticate(bad))).type == "invalid_api_key"
    assert registry.store_reads == reads + 1
    unknown = "csk-" + "A" * 43
    for _ in range(3):
        assert (await error_of(registry.authenticate(unknown))).status == 401
    assert registry.store_reads == reads + 2


async def test_the_cache_is_bounded(stores):
    registry = CallerRegistry(stores(), cache_seconds=30, cache_size=5)
    for _ in range(20):
        await error_of(registry.authenticate("csk-" + secrets.token_urlsafe(32)))
    assert len(registry._cache) == 5


@pytest.mark.parametrize("change", ["delete", "rotate"])
async def test_a_revoked_or_rotated_key_stops_working_on_another_instance_within_the_cache_time(stores, change):
    cache = 0.5
    admin = CallerRegistry(stores(), cache_seconds=cache)
    other = CallerRegistry(stores(), cache_seconds=cache)  # another instance of the app
    who = name()
    _, key = await admin.create({"name": who})
    assert (await other.authenticate(key)).name == who  # cached there now
    if change == "delete":
        await admin.delete(who)
    else:
        _, new = await admin.rotate(who)
        assert (await other.authenticate(new)).name == who  # the new key works at once
    changed = time.monotonic()
    while True:
        try:
            await other.authenticate(key)
        except ApiError as exc:
            assert exc.type == "invalid_api_key"
            break
        await asyncio.sleep(0.02)
    stopped_after = time.monotonic() - changed
    assert stopped_after <= cache + 0.1
    print(
        f"\n{change}: the old key stopped on the other instance after {stopped_after * 1000:.0f} ms "
        f"(cache {cache * 1000:.0f} ms)"
    )


async def test_an_update_reaches_another_instance_within_the_cache_time(stores):
    admin = CallerRegistry(stores(), cache_seconds=0.3)
    other = CallerRegistry(stores(), cache_seconds=0.3)
    who = name()
    _, key = await admin.create({"name": who, "tokens_per_minute": 100})
    assert (await other.authenticate(key)).tokens_per_minute == 100
    await admin.update(who, {"tokens_per_minute": 200})
    await asyncio.sleep(0.35)
    assert (await other.authenticate(key)).tokens_per_minute == 200


async def test_expired_keys_are_refused_even_when_cached(stores):
    clock = Clock()
    registry = CallerRegistry(stores(), cache_seconds=30, clock=clock)
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(clock.now + 3600))
    caller, key = await registry.create({"name": name(), "expires_at": expires})
    assert caller.expires_at is not None and (await registry.authenticate(key)).name == caller.name
    clock.now += 3601
    error = await error_of(registry.authenticate(key))
    assert (error.status, error.type) == (401, "invalid_api_key") and "expired" in error.message
    # A key made with an expiry in the past is refused at creation.
    error = await error_of(registry.create({"name": name(), "expires_at": "2001-01-01T00:00:00Z"}))
    assert (error.status, error.param) == (400, "expires_at")


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
        ({"name": "a", "budget_period": "week"}, "budget_period"),
        ({"name": "a", "models": []}, "models"),
        ({"name": "a", "models": ["m"] * 101}, "models"),
        ({"name": "a", "models": ["m" * 257]}, "models"),
        ({"name": "a", "models": ["a", "a"]}, "models"),
        ({"name": "a", "models": ["a\nb"]}, "models"),
        ({"name": "a", "models": "gpt-4o"}, "models"),
        ({"name": "a", "expires_at": "tomorrow"}, "expires_at"),
        ({"name": "a", "expires_at": "2030-01-01T00:00:00"}, "expires_at"),  # no time zone
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
async def test_bad_admin_input_is_a_400_naming_the_field(stores, body, param):
    registry = CallerRegistry(stores())
    error = await error_of(registry.create(body))
    assert (error.status, error.type, error.param) == (400, "invalid_request", param)
    assert error.message.startswith(param) and len(error.message) < 300
    assert LONG not in error.message


async def test_a_duplicate_name_is_a_400_naming_the_field(stores):
    registry = CallerRegistry(stores())
    who = name()
    await registry.create({"name": who})
    error = await error_of(registry.create({"name": who, "tokens_per_minute": 5}))
    assert (error.status, error.param) == (400, "name") and "already exists" in error.message
    assert (await registry.get(who)).tokens_per_minute is None  # the first one stands


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"name": "other"}, "name"),
        ({"tokens_per_minute": -1}, "tokens_per_minute"),
        ({"budget_period": "year"}, "budget_period"),
        ({"key": "csk-x"}, "key"),
    ],
)
async def test_bad_patches_are_400s_naming_the_field(stores, patch, param):
    registry = CallerRegistry(stores())
    who = name()
    await registry.create({"name": who})
    error = await error_of(registry.update(who, patch))
    assert (error.status, error.param) == (400, param)


async def test_a_patch_with_null_removes_a_limit(stores):
    registry = CallerRegistry(stores())
    who = name()
    await registry.create({"name": who, "tokens_per_minute": 5, "token_budget": 9, "budget_period": "day"})
    updated = await registry.update(who, {"tokens_per_minute": None, "budget_period": None})
    assert (updated.tokens_per_minute, updated.token_budget, updated.budget_period) == (None, 9, "total")


async def test_keys_never_reach_a_log_an_error_an_answer_or_the_store(stores, azurite, caplog):
    caplog.set_level(logging.DEBUG)
    store = stores()
    registry = CallerRegistry(store, cache_seconds=0.01)
    who = name()
    caller, key = await registry.create({"name": who, "tokens_per_minute": 100})
    keys = [key]
    await registry.authenticate(key)
    rotated, new = await registry.rotate(who)
    keys.append(new)
    errors = [await error_of(registry.authenticate(key)), await error_of(registry.create({"name": who}))]
    answers = [
        caller.public(),
        rotated.public(),
        (await registry.get(who)).public(),
        [c.public() for c in await registry.list()],
    ]
    await registry.delete(who)
    errors.append(await error_of(registry.authenticate(new)))
    table = await store.table(CALLERS_TABLE)
    rows = [dict(r) async for r in table.list_entities()]
    text = caplog.text + json.dumps(answers) + repr(rows) + " ".join(e.message + repr(e.headers) for e in errors)
    for k in keys:
        assert k not in text and k[4:] not in text
    assert hash_key(new) not in json.dumps(answers)  # the hash is the store's business only
    assert f'"key_hint": "{new[-4:]}"' in json.dumps(answers)


async def test_a_store_that_does_not_answer_is_a_503_within_two_seconds():
    store = Store(StorageConfig(connection_string=DEAD_STORE))
    registry = CallerRegistry(store)
    try:
        started = time.monotonic()
        error = await error_of(registry.authenticate("csk-" + "B" * 43))
        assert (error.status, error.type) == (503, "caller_store_unavailable")
        assert time.monotonic() - started < 2.0
        assert not registry._cache  # an outage is not remembered: the next check asks again
        assert (await error_of(registry.create({"name": "a"}))).status == 503
    finally:
        await store.close()


def test_the_key_is_read_from_openai_or_azure_headers():
    assert key_from_headers({"authorization": "Bearer csk-abc"}) == "csk-abc"
    assert key_from_headers({"authorization": "bearer  csk-abc "}) == "csk-abc"
    assert key_from_headers({"api-key": "csk-abc"}) == "csk-abc"
    assert key_from_headers({"authorization": "Basic xyz"}) is None
    assert key_from_headers({}) is None


async def test_model_access(stores):
    registry = CallerRegistry(stores())
    caller, _ = await registry.create({"name": name(), "models": ["gpt-4o-mini"]})
    caller.require_model("gpt-4o-mini")
    error = await error_of(asyncio.to_thread(caller.require_model, "gpt-4o"))
    assert (error.status, error.type, error.param) == (404, "model_not_found", "model")
