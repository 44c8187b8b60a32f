"""chatstream/state/ledger.py and owners.py against a real Azurite: one row per charge, sums by
caller, model and day, idempotent on the request id; ownership and the one first charge."""

from __future__ import annotations

import asyncio
import secrets
from datetime import UTC, date, datetime

import pytest

from chatstream.errors import ApiError
from chatstream.state.ledger import Charge, Ledger, totals
from chatstream.state.legacy_store import StorageConfig, Store
from chatstream.state.owners import Owners


@pytest.fixture
def store(azurite):
    s = Store(StorageConfig(connection_string=azurite.connection_string))
    yield s
    asyncio.run(s.close())


def at(day: int, hour: int = 12) -> datetime:
    return datetime(2026, 11, day, hour, 0, 0, tzinfo=UTC)


def charge(
    caller: str,
    model: str,
    when: datetime,
    prompt: int,
    completion: int,
    ended: str = "completed",
    request_id: str | None = None,
) -> Charge:
    return Charge(
        caller=caller,
        model=model,
        request_id=request_id or f"chatcmpl-{secrets.token_hex(6)}",
        endpoint="openai",
        prompt_tokens=prompt,
        completion_tokens=completion,
        ended=ended,
        at=when,
    )


async def test_usage_sums_by_caller_model_and_day(store):
    ledger = Ledger(store)
    a, b = f"a-{secrets.token_hex(3)}", f"b-{secrets.token_hex(3)}"
    charges = [
        charge(a, "gpt-4o", at(3, 1), 10, 5),
        charge(a, "gpt-4o", at(3, 23), 7, 3, "disconnected"),
        charge(a, "gpt-4o-mini", at(3), 100, 0, "failed"),
        charge(a, "gpt-4o", at(4), 1, 1),
        charge(b, "gpt-4o", at(3), 50, 50, "timeout"),
        charge(a, "gpt-4o", at(9), 1000, 1000),
    ]
    assert all(await asyncio.gather(*(ledger.record(c) for c in charges)))
    rows = await ledger.usage(a, date(2026, 11, 3), date(2026, 11, 4))
    assert [(r["model"], r["day"], r["prompt_tokens"], r["completion_tokens"], r["requests"]) for r in rows] == [
        ("gpt-4o", "2026-11-03", 17, 8, 2),
        ("gpt-4o", "2026-11-04", 1, 1, 1),
        ("gpt-4o-mini", "2026-11-03", 100, 0, 1),
    ]
    assert rows[0]["ended"] == {"completed": 1, "disconnected": 1} and rows[0]["total_tokens"] == 25
    assert totals(rows) == {"prompt_tokens": 118, "completion_tokens": 9, "total_tokens": 127, "requests": 4}
    everyone = await ledger.usage(None, date(2026, 11, 3), date(2026, 11, 3))
    mine = [r for r in everyone if r["caller"] in (a, b)]
    assert {(r["caller"], r["model"]) for r in mine} == {(a, "gpt-4o"), (a, "gpt-4o-mini"), (b, "gpt-4o")}
    assert await ledger.usage(a, date(2026, 11, 5), date(2026, 11, 8)) == []


async def test_recording_a_request_twice_adds_nothing(store):
    ledger = Ledger(store)
    who = f"c-{secrets.token_hex(3)}"
    first = charge(who, "gpt-4o", at(5), 10, 20, request_id="resp_1/odd#id?")
    assert await ledger.record(first) is True
    assert await ledger.record(first) is False  # a retry after a lost answer
    later = charge(who, "gpt-4o", at(6), 99, 99, request_id="resp_1/odd#id?")  # the same request, seen again
    assert await ledger.record(later) is False
    rows = await ledger.usage(who, date(2026, 11, 1), date(2026, 11, 30))
    assert [(r["prompt_tokens"], r["completion_tokens"], r["requests"]) for r in rows] == [(10, 20, 1)]
    results = await asyncio.gather(
        *(ledger.record(charge(who, "m", at(7), 1, 1, request_id="same")) for _ in range(10))
    )
    assert results.count(True) == 1


async def test_a_store_that_does_not_answer_is_a_503():
    s = Store(
        StorageConfig(
            connection_string="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            "AccountKey=a2V5;TableEndpoint=http://127.0.0.1:9/devstoreaccount1;"
        )
    )
    try:
        with pytest.raises(ApiError) as info:
            await Ledger(s).record(charge("x", "m", at(1), 1, 1))
        assert info.value.type == "caller_store_unavailable"
        with pytest.raises(ApiError):
            await Owners(s).owner("response", "resp_x")
    finally:
        await s.close()


async def test_what_a_caller_creates_belongs_to_it(store):
    owners = Owners(store)
    rid = f"resp_{secrets.token_hex(8)}"
    assert await owners.owner("response", rid) is None
    assert await owners.claim("response", rid, "alice") is True
    assert await owners.claim("response", rid, "alice") is True  # idempotent
    assert await owners.claim("response", rid, "bob") is False
    assert await owners.owner("response", rid) == "alice"
    assert await owners.owner("stream", rid) is None  # kinds are apart
    await owners.forget("response", rid)
    assert await owners.owner("response", rid) is None
    await owners.forget("response", rid)


async def test_a_background_response_is_charged_once(store):
    owners = [Owners(store), Owners(store)]
    rid = f"resp_{secrets.token_hex(8)}"
    await owners[0].claim("response", rid, "alice")
    results = await asyncio.gather(*(owners[i % 2].first_charge("response", rid) for i in range(20)))
    assert results.count(True) == 1
    assert await owners[1].first_charge("response", rid) is False
    assert await owners[0].owner("response", rid) == "alice"
    never_claimed = f"resp_{secrets.token_hex(8)}"
    assert [await owners[0].first_charge("response", never_claimed) for _ in range(2)] == [True, False]
