"""chatstream/state/accounting.py with a real CallRequest and StreamRecord, on the in-process store:
what ``admit`` answers (Admission, Refused, ModelRefused, Unavailable, Unknown), limits of a caller
and its team all or nothing, per-model limits, unpriced models, and what ``charge`` writes: the
upstream's usage at its exact price, a partial answer's counted text, nothing for an answer never
given, a background response once."""

from __future__ import annotations

import asyncio

import pytest
from memory_store import Fault, MemoryData, MemoryStore

from chatstream import tokens
from chatstream.apis.usage import usage_of
from chatstream.state.accounting import Admission
from chatstream.state.callers import CallerSpec, TeamSpec
from chatstream.state.owners import Owners
from chatstream.state.port import ModelRefused, Refused, Unavailable, Unknown, Usage, Used
from chatstream.state.prices import PriceSpec
from chatstream.state.store import CALLERS_TABLE, LIMITS_TABLE, USAGE_TABLE

from .state_helpers import MODEL, account, admit, asked, call, charge, counter, finish, instance, record, until, usage

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time


def ledger_rows(data: MemoryData) -> list[dict]:
    return [values for partition in data.tables.get(USAGE_TABLE, {}).values() for values, _ in partition.values()]


async def test_an_admission_reserves_the_prompt_and_the_output_cap_and_says_the_rates():
    data = account()
    state, acc = instance(data, "a")
    caller, _ = await state.registry.create(CallerSpec(name="c", tokens_per_minute=50_000, requests_per_minute=10))
    request = call("hello there", n=2)
    admitted = await acc.admit(caller, asked(request, record()))
    assert isinstance(admitted, Admission)
    assert request.params["max_completion_tokens"] == 4096  # the default cap, sent to the upstream
    prompt = tokens.count_prompt(MODEL, request.params)
    assert admitted.entry.prompt_tokens == prompt
    assert [w.need for w in admitted.wants] == [1, prompt + 2 * 4096]
    rates = admitted.entry.reservation.rates
    assert rates["tokens"].limit == 50_000 and rates["requests"].limit == 10
    assert rates["tokens"].remaining <= 50_000 - prompt - 2 * 4096
    capped = await acc.admit(caller, asked(call("hi", max_tokens=7), record()))
    assert isinstance(capped, Admission) and capped.wants[1].need == capped.entry.prompt_tokens + 7
    assert "max_completion_tokens" not in call("hi", max_tokens=7).params
    await state.close()


async def test_caller_and_team_limits_hold_all_or_nothing():
    data = account()
    state, acc = instance(data, "a")
    team, _ = await state.registry.create(TeamSpec(name="t", requests_per_minute=3))
    caller, _ = await state.registry.create(CallerSpec(name="c", team="t", token_budget=100_000))
    other, _ = await state.registry.create(CallerSpec(name="d", team="t"))
    held = []
    for who in (caller, other, caller):
        admitted, _ = await admit(acc, who, max_tokens=10)
        assert isinstance(admitted, Admission)
        held.append(admitted)
    refused, _ = await admit(acc, caller, max_tokens=10)
    assert isinstance(refused, Refused)
    assert (refused.limit.scope, refused.limit.owner, refused.limit.kind) == ("team", "t", "requests_per_minute")
    assert refused.retry_after is not None and 0 < refused.retry_after <= 60
    for admission in held:
        admission.entry.reservation.release()
    assert await acc.flush(5)
    # The refused request's caller budget came back at once (a leak would stay held in the row).
    assert counter(data, caller.limits_partition, "tokens").get("taken", 0) == 0
    assert counter(data, team.limits_partition, "rpm").get("taken", 0) == 0
    # The other way round: the caller's budget refuses, the team's request comes back.
    small, _ = await state.registry.create(CallerSpec(name="s", team="t", token_budget=50))
    refused, _ = await admit(acc, small, max_tokens=100)
    assert isinstance(refused, Refused) and refused.alone and refused.limit.scope == "caller"
    assert await acc.flush(5)
    assert counter(data, team.limits_partition, "rpm").get("taken", 0) == 0
    await state.close()


async def test_a_team_budget_refuses_and_gives_back_what_the_caller_reserved():
    data = account()
    state, acc = instance(data, "a")
    team, _ = await state.registry.create(TeamSpec(name="t", token_budget=300))
    caller, _ = await state.registry.create(CallerSpec(name="c", team="t", tokens_per_minute=10_000))
    first, rec = await admit(acc, caller, max_tokens=200)
    assert isinstance(first, Admission)
    refused, _ = await admit(acc, caller, max_tokens=200)
    assert isinstance(refused, Refused) and refused.limit.scope == "team" and refused.limit.kind == "token_budget"
    assert refused.retry_after is None
    finish(acc, first, rec, usage(5, 20))
    assert await acc.flush(5)
    assert counter(data, caller.limits_partition, "tpm")["taken"] == 25  # not 25 + the refused one's
    assert counter(data, team.limits_partition, "tokens")["taken"] == 25
    await state.close()


async def test_a_per_model_limit_refuses_only_that_model():
    data = account()
    state, acc = instance(data, "a")
    caller, _ = await state.registry.create(
        CallerSpec(name="c", model_limits={"gpt-4o": {"requests_per_minute": 1, "tokens_per_minute": 100_000}})
    )
    first, _ = await admit(acc, caller, model="gpt-4o")
    assert isinstance(first, Admission)
    refused, _ = await admit(acc, caller, model="gpt-4o")
    assert isinstance(refused, Refused)
    assert (refused.limit.model, refused.limit.kind, refused.limit.scope) == ("gpt-4o", "requests_per_minute", "caller")
    for _ in range(5):
        other, _ = await admit(acc, caller, model="gpt-4o-mini")
        assert isinstance(other, Admission) and not other.wants  # no limit on it at all
    team, _ = await state.registry.create(TeamSpec(name="t", model_limits={"gpt-4o-mini": {"tokens_per_minute": 50}}))
    member, _ = await state.registry.create(CallerSpec(name="m", team="t"))
    refused, _ = await admit(acc, member, model="gpt-4o-mini", max_tokens=100)
    assert isinstance(refused, Refused) and refused.alone and refused.limit.scope == "team"
    assert isinstance((await admit(acc, member, model="gpt-4o", max_tokens=100))[0], Admission)
    del team
    await state.close()


async def test_models_a_caller_or_its_team_may_not_use_are_refused_by_name():
    data = account()
    state, acc = instance(data, "a")
    await state.registry.create(TeamSpec(name="t", models=["gpt-4o-mini"]))
    caller, _ = await state.registry.create(CallerSpec(name="c", models=["gpt-4o", "gpt-4o-mini"], team="t"))
    assert (await admit(acc, caller, model="o1"))[0] == ModelRefused("o1")
    assert (await admit(acc, caller, model="gpt-4o"))[0] == ModelRefused("gpt-4o", scope="team")
    assert isinstance((await admit(acc, caller, model="gpt-4o-mini"))[0], Admission)
    await state.close()


async def test_an_unpriced_model_is_refused_to_a_spend_budget_and_free_for_everyone_else():
    data = account()
    state, acc = instance(data, "a")
    await state.registry.create(TeamSpec(name="rich", spend_budget=5))
    spender, _ = await state.registry.create(CallerSpec(name="s", spend_budget=1))
    member, _ = await state.registry.create(CallerSpec(name="m", team="rich"))
    free, _ = await state.registry.create(CallerSpec(name="f", token_budget=10_000))
    assert (await admit(acc, spender, model="local"))[0] == ModelRefused("local", unpriced=True, scope="caller")
    assert (await admit(acc, member, model="local"))[0] == ModelRefused("local", unpriced=True, scope="team")
    admitted, rec = await admit(acc, free, model="local")
    assert isinstance(admitted, Admission) and admitted.entry.price is None
    finish(acc, admitted, rec, usage(10, 10))
    assert await acc.flush(5)
    assert rec.cost is None
    [row] = ledger_rows(data)
    assert row.get("cost") is None and row["model"] == "local"
    assert counter(data, free.limits_partition, "tokens")["taken"] == 20
    await state.close()


async def test_an_unreadable_price_refuses_only_its_model_whatever_the_budget():
    """A price row a hand edit or an older version left unreadable (here: no output price): its
    model's requests are refused, saying so; every other model is admitted as before."""
    data = account()
    state, acc = instance(data, "a")
    await state.registry.set_price(MODEL, PriceSpec(input=1, output=2))
    row = {"PartitionKey": "prices", "RowKey": "p|broken", "model": "broken", "input": 5, "cached_input": 5}
    await state.store.upsert(CALLERS_TABLE, row | {"updated_at": "2026-01-01T00:00:00Z"})
    spender, _ = await state.registry.create(CallerSpec(name="s", spend_budget=1))
    free, _ = await state.registry.create(CallerSpec(name="f"))
    for caller in (spender, free):
        assert (await admit(acc, caller, model="broken"))[0] == ModelRefused("broken", unreadable=True)
        admitted, rec = await admit(acc, caller, max_tokens=10)
        assert isinstance(admitted, Admission) and admitted.entry.price is not None
        finish(acc, admitted, rec, usage(10, 10))
    assert await acc.flush(5)
    await state.close()


async def test_a_spend_budget_reserves_the_most_the_request_may_cost_and_settles_to_the_cost():
    data = account()
    state, acc = instance(data, "a")
    price = await state.registry.set_price(MODEL, PriceSpec(input=2.5, cached_input=1.25, output=10))
    caller, _ = await state.registry.create(CallerSpec(name="c", spend_budget=0.05, budget_period="day"))
    admitted, rec = await admit(acc, caller, "some prompt", max_tokens=1000)
    assert isinstance(admitted, Admission)
    [spend] = admitted.wants
    assert spend.key.row == "spend" and spend.need == price.most(admitted.entry.prompt_tokens, 1000)
    assert spend.need == admitted.entry.prompt_tokens * 2_500_000 + 1000 * 10_000_000
    refused, _ = await admit(acc, caller, "some prompt", max_tokens=5000)  # 5000 × $10/M = $0.05 alone
    assert isinstance(refused, Refused) and refused.alone and refused.limit.kind == "spend_budget"
    finish(acc, admitted, rec, usage(1_000, 300, cached=600))
    assert await acc.flush(5)
    cost = 400 * 2_500_000 + 600 * 1_250_000 + 300 * 10_000_000  # cached tokens at the cached price
    assert rec.cost == cost == 4_750_000_000
    [row] = ledger_rows(data)
    assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"], row["cost"]) == (1000, 600, 300, cost)
    assert counter(data, caller.limits_partition, "spend")["taken"] == cost
    await state.close()


async def test_a_price_change_applies_to_the_requests_admitted_after_it():
    """A request is charged at the price it was admitted (and reserved) at: one in flight when the
    price changes keeps the old one, the next request has the new one."""
    data = account()
    state, acc = instance(data, "a")
    await state.registry.set_price(MODEL, PriceSpec(input=1, output=1))
    caller, _ = await state.registry.create(CallerSpec(name="c"))
    before, rec = await admit(acc, caller)
    assert isinstance(before, Admission)
    await state.registry.set_price(MODEL, PriceSpec(input=3, output=5))
    after, rec_after = await admit(acc, caller)
    assert isinstance(after, Admission)
    finish(acc, before, rec, usage(10, 10))
    finish(acc, after, rec_after, usage(10, 10))
    assert await acc.flush(5)
    assert sorted(r["cost"] for r in ledger_rows(data)) == [
        10 * 1_000_000 + 10 * 1_000_000,
        10 * 3_000_000 + 10 * 5_000_000,
    ]
    await state.close()


async def test_a_partial_answer_is_charged_its_prompt_and_the_text_generated_of_every_choice():
    data = account()
    state, acc = instance(data, "a")
    caller, _ = await state.registry.create(CallerSpec(name="c", token_budget=100_000))
    admitted, rec = await admit(acc, caller, "tell me a story", n=2)
    assert isinstance(admitted, Admission)
    texts = ["Once upon a time there was", " a fox who ran."]
    rec.hung_up()
    finish(acc, admitted, rec, None, generated={0: texts})
    assert await acc.flush(5)
    [row] = ledger_rows(data)
    completion = tokens.count_text(MODEL, "".join(texts))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (admitted.entry.prompt_tokens, completion)
    assert row["ended"] == "disconnected" and row["upstream"] == "main"
    assert counter(data, caller.limits_partition, "tokens")["taken"] == admitted.entry.prompt_tokens + completion
    await state.close()


async def test_a_request_no_upstream_answered_is_released_and_writes_no_row():
    data = account()
    state, acc = instance(data, "a")
    caller, _ = await state.registry.create(CallerSpec(name="c", token_budget=100_000, tokens_per_minute=100_000))
    admitted, rec = await admit(acc, caller)
    assert isinstance(admitted, Admission)
    finish(acc, admitted, rec, None, answered=False, error="upstream_unavailable")
    assert await acc.flush(5)
    assert ledger_rows(data) == []
    assert counter(data, caller.limits_partition, "tokens").get("taken", 0) == 0
    assert counter(data, caller.limits_partition, "tpm").get("taken", 0) == 0
    assert not state.journal.entries
    await state.close()


async def test_segments_are_one_row_each():
    from chatstream.record import Segment

    data = account()
    state, acc = instance(data, "a")
    await state.registry.set_price(MODEL, PriceSpec(input=1, output=2))
    caller, _ = await state.registry.create(CallerSpec(name="c", spend_budget=1))
    admitted, rec = await admit(acc, caller)
    assert isinstance(admitted, Admission)
    rec.upstream_answered()
    segments = [
        Segment("east", usage={"prompt_tokens": 10, "completion_tokens": 5}),
        Segment(
            "west", usage={"prompt_tokens": 15, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 5}}
        ),
    ]
    charge(acc, admitted, rec, None, segments)
    assert await acc.flush(5)
    found = sorted(ledger_rows(data), key=lambda r: r["segment"])
    assert [(r["segment"], r["upstream"], r["prompt_tokens"], r["completion_tokens"]) for r in found] == [
        (0, "east", 10, 5),
        (1, "west", 15, 7),
    ]
    cost = (10 * 1 + 5 * 2 + 10 * 1 + 5 * 1 + 7 * 2) * 10**6
    assert sum(r["cost"] for r in found) == cost == counter(data, caller.limits_partition, "spend")["taken"]
    await state.close()


async def test_a_segment_without_usage_is_charged_the_prompt_it_was_sent():
    """A continuation that failed too reports no usage: its prompt is what its request carried (the
    text so far and the instruction to go on), counted when it was sent; the first, the request's."""
    from chatstream.record import Segment

    data = account()
    state, acc = instance(data, "a")
    caller, _ = await state.registry.create(CallerSpec(name="c"))
    admitted, rec = await admit(acc, caller)
    assert isinstance(admitted, Admission)
    rec.upstream_answered()
    first = Segment("a")
    first.parts.append("Once upon a time")
    failed = Segment("b", prompt_tokens=87)
    failed.parts.append("Once upon")
    last = Segment("a", usage={"prompt_tokens": 95, "completion_tokens": 20}, prompt_tokens=90)
    charge(acc, admitted, rec, None, [first, failed, last])
    assert await acc.flush(5)
    found = sorted(ledger_rows(data), key=lambda r: r["segment"])
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in found] == [
        (admitted.entry.prompt_tokens, tokens.count_text(MODEL, "Once upon a time")),
        (87, tokens.count_text(MODEL, "Once upon")),
        (95, 20),  # reported: the upstream's own count
    ]
    await state.close()


async def test_the_store_down_is_unavailable_and_nothing_is_held():
    data = account()
    state, acc = instance(data, "a")
    await state.registry.create(TeamSpec(name="t"))
    caller, _ = await state.registry.create(CallerSpec(name="c", team="t", token_budget=1_000))
    store = state.store
    assert isinstance(store, MemoryStore)
    store.inject(Fault("unavailable", frozenset({"get"}), table=CALLERS_TABLE))
    assert isinstance((await admit(acc, caller, max_tokens=10))[0], Unavailable)  # the team could not be read
    store.inject(Fault("unavailable", frozenset({"get"}), table=CALLERS_TABLE))
    assert isinstance((await admit(acc, caller, model="other", max_tokens=10))[0], Unavailable)  # nor its price
    store.inject(Fault("unavailable", frozenset({"get", "insert", "replace"}), table=LIMITS_TABLE, times=1000))
    assert isinstance((await admit(acc, caller, max_tokens=10))[0], Unavailable)
    store.faults.clear()
    assert await acc.flush(5)
    assert counter(data, caller.limits_partition, "tokens").get("taken", 0) == 0
    await state.close()


async def test_a_previous_response_of_another_caller_is_unknown_and_ones_own_reserves_its_context():
    data = account()
    state, acc = instance(data, "a")
    alice, _ = await state.registry.create(CallerSpec(name="alice", token_budget=1_000_000))
    bob, _ = await state.registry.create(CallerSpec(name="bob"))
    first, rec = await admit(acc, alice)
    assert isinstance(first, Admission)
    await acc.own("response", "resp_1", first, background=False)
    await acc.keep_context(first, Usage((Used(10, 0, 20),), "completed", reported=True))  # before its last event
    assert (await Owners(state.store).owned("response", "resp_1")).context == 30
    finish(acc, first, rec, usage(10, 20))
    assert await acc.flush(5)
    await Owners(state.store).set_context("response", "resp_1", 5_000)
    answer, _ = await admit(acc, bob, previous_response_id="resp_1")
    assert answer == Unknown("response", "resp_1")
    assert (await admit(acc, bob, previous_response_id="resp_nobody"))[0] == Unknown("response", "resp_nobody")
    follow, _ = await admit(acc, alice, previous_response_id="resp_1", max_tokens=10)
    assert isinstance(follow, Admission)
    assert follow.entry.prompt_tokens == tokens.count_prompt(MODEL, call(previous_response_id="resp_1").params) + 5_000
    assert await acc.owned(alice, "response", "resp_1") is not None
    assert await acc.owned(bob, "response", "resp_1") is None
    await state.close()


async def test_a_conversation_or_stored_items_reserve_the_referenced_context_once_and_are_not_charged_it():
    """Their size is not known here: REFERENCED_CONTEXT_TOKENS is reserved on top of the prompt
    counted (once, whether the request names a conversation, stored items or both), never charged
    (the counted prompt is what a partial answer is charged)."""
    data = account()
    state, acc = instance(data, "a")
    caller, _ = await state.registry.create(CallerSpec(name="c", token_budget=1_000_000))
    plain, _ = await admit(acc, caller, max_tokens=10)
    talk, _ = await admit(acc, caller, max_tokens=10, conversation="conv_1")
    items = [{"type": "item_reference", "id": "msg_1"}]
    both = await acc.admit(caller, asked(call(max_tokens=10, conversation="conv_1", input=items), record()))
    assert isinstance(plain, Admission) and isinstance(talk, Admission) and isinstance(both, Admission)
    assert talk.entry.prompt_tokens == plain.entry.prompt_tokens  # counted: what a partial answer is charged
    [need] = [w.need for w in talk.wants]
    assert need == plain.wants[0].need + 16_384
    assert both.wants[0].need == both.entry.prompt_tokens + 10 + 16_384
    await state.close()


async def test_a_background_response_is_charged_once_when_seen_on_any_instance():
    data = account()
    a, acc_a = instance(data, "a")
    b, acc_b = instance(data, "b")
    price = await a.registry.set_price(MODEL, PriceSpec(input=1, output=4))
    caller, _ = await a.registry.create(CallerSpec(name="c", token_budget=100_000, spend_budget=1))
    admitted, rec = await admit(acc_a, caller, max_output_tokens=1000, background=True)
    assert isinstance(admitted, Admission)
    await acc_a.own("response", "resp_bg", admitted, background=True)
    finish(acc_a, admitted, rec, None)  # the request is over; the response goes on upstream
    assert await acc_a.flush(5)
    assert ledger_rows(data) == []
    reserved = admitted.wants[0].need
    assert counter(data, caller.limits_partition, "tokens")["taken"] == reserved  # held until seen
    # The price raised x10 while it runs: it is charged at the price it was admitted (and reserved) at.
    await a.registry.set_price(MODEL, PriceSpec(input=10, output=40))
    seen = Used(40, 0, 60)
    await asyncio.gather(
        *(
            acc.charge_seen(caller, "response", "resp_bg", MODEL, seen, "responses")
            for acc in (acc_a, acc_b, acc_a, acc_b)
        )
    )
    for acc in (acc_a, acc_b):
        assert await acc.flush(5)
    [row] = ledger_rows(data)
    assert (row["prompt_tokens"], row["completion_tokens"], row["ended"]) == (40, 60, "background")
    assert row["cost"] == price.cost(40, 0, 60)
    await until(lambda: counter(data, caller.limits_partition, "tokens")["taken"] == 100, what="corrected")
    assert counter(data, caller.limits_partition, "spend")["taken"] == price.cost(40, 0, 60)
    # Seen again later: nothing more.
    await acc_b.charge_seen(caller, "response", "resp_bg", MODEL, seen, "responses")
    assert await acc_b.flush(5)
    assert len(ledger_rows(data)) == 1
    # Its size is kept: continuing it reserves it.
    follow, _ = await admit(acc_b, caller, previous_response_id="resp_bg", max_tokens=1)
    assert isinstance(follow, Admission) and follow.entry.prompt_tokens >= 100
    await a.close()
    await b.close()


async def test_the_prices_not_read_leave_the_team_known_its_refusal_and_its_budget():
    """The prices' read failing (the store's queries), the team's answer still kept: a model the team
    does not allow is refused as the team's (not "unavailable"), and a background response seen
    then is corrected in the team's budget too (on c769786 both lost the team with the prices)."""
    data = account()
    state, acc = instance(data, "a")
    team, _ = await state.registry.create(TeamSpec(name="t", models=[MODEL], token_budget=100_000))
    caller, _ = await state.registry.create(CallerSpec(name="c", team="t"))
    admitted, rec = await admit(acc, caller, max_output_tokens=1000, background=True)
    assert isinstance(admitted, Admission)
    await acc.own("response", "resp_bg", admitted, background=True)
    finish(acc, admitted, rec, None)
    assert await acc.flush(5)
    state.registry.cache.forget("prices")  # their answer ran out; the team's is still kept
    assert isinstance(state.store, MemoryStore)
    state.store.inject(Fault("unavailable", frozenset({"query"}), table=CALLERS_TABLE, times=10**9))
    assert (await admit(acc, caller, model="o1"))[0] == ModelRefused("o1", scope="team")
    assert isinstance((await admit(acc, caller))[0], Unavailable)  # a model it allows needs its price
    await acc.charge_seen(caller, "response", "resp_bg", MODEL, Used(40, 0, 60), "responses")
    assert await acc.flush(5)
    await until(lambda: counter(data, team.limits_partition, "tokens")["taken"] == 100, what="the team's")
    await state.close()


@pytest.mark.parametrize("background", [False, True])
async def test_a_response_its_request_charged_is_not_charged_again_when_read_back(background):
    """A stored response (or a background one streamed to its end) has its usage in the request
    itself: charged then. Reading it back later (GET /responses/{id}, on any instance) adds nothing."""
    data = account()
    a, acc_a = instance(data, "a")
    b, acc_b = instance(data, "b")
    caller, _ = await a.registry.create(CallerSpec(name="c", token_budget=100_000))
    admitted, rec = await admit(acc_a, caller, max_output_tokens=1000, background=background, stream=True)
    assert isinstance(admitted, Admission)
    await acc_a.own("response", "resp_1", admitted, background=background)
    finish(acc_a, admitted, rec, usage(40, 60))
    assert await acc_a.flush(5)
    for acc in (acc_b, acc_a):
        await acc.charge_seen(caller, "response", "resp_1", MODEL, Used(40, 0, 60), "responses")
        assert await acc.flush(5)
    [row] = ledger_rows(data)
    assert (row["prompt_tokens"], row["completion_tokens"], row["request_id"]) == (40, 60, rec.id)
    assert counter(data, caller.limits_partition, "tokens")["taken"] == 100
    await a.close()
    await b.close()


def test_usage_is_read_from_chat_and_responses_shapes_and_garbage_is_none():
    assert usage_of({"prompt_tokens": 10, "completion_tokens": 5}) == usage_of({"input_tokens": 10, "output_tokens": 5})
    found = usage_of({"input_tokens": 10, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 4}})
    assert found is not None and (found.prompt, found.cached, found.completion) == (10, 4, 5)
    odd = usage_of({"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 11}})
    assert odd is not None and odd.cached == 0  # more cached than prompt: not believed
    for garbage in (None, [], {"prompt_tokens": "10", "completion_tokens": 5}, {"prompt_tokens": 1.5}, {}):
        assert usage_of(garbage) is None


async def test_a_partial_stream_of_several_choices_is_charged_the_text_of_every_choice():
    """n=2, the upstream cut mid-answer: what both choices generated is charged, not only choice 0's."""
    from chatstream.apis.completions import CompletionStream

    data = account()
    state, acc = instance(data, "a")
    caller, _ = await state.registry.create(CallerSpec(name="c", token_budget=100_000))
    admitted, rec = await admit(acc, caller, n=2)
    assert isinstance(admitted, Admission)
    stream = CompletionStream(None, choices=2, keep=True)
    texts = {0: ["Once upon", " a time"], 1: ["There was", " a fox who ran", " far away"]}
    for step in range(3):
        for index, pieces in texts.items():
            if step < len(pieces):
                delta = {"content": pieces[step]}
                await stream.feed({"id": "c1", "choices": [{"index": index, "delta": delta, "finish_reason": None}]})
    finish(acc, admitted, rec, None, generated=stream.generated, error="upstream_disconnected")
    assert await acc.flush(5)
    [row] = ledger_rows(data)
    each = sum(tokens.count_text(MODEL, "".join(pieces)) for pieces in texts.values())
    assert row["completion_tokens"] == each  # each choice counted on its own text
    await state.close()


async def test_a_segment_served_as_another_model_is_charged_its_price_when_it_has_one():
    """An entry's ``deployments`` sent the model under another name: that name's price and name when
    it has a price (an open model), else the requested model's (an Azure deployment name)."""
    from chatstream.record import Segment

    data = account()
    state, acc = instance(data, "a")
    await state.registry.set_price(MODEL, PriceSpec(input=1, output=2))
    await state.registry.set_price("llama", PriceSpec(input=0.1, output=0.2))
    caller, _ = await state.registry.create(CallerSpec(name="c", spend_budget=1))
    admitted, rec = await admit(acc, caller)
    assert isinstance(admitted, Admission)
    rec.upstream_answered()
    segments = [
        Segment("ptu", usage={"prompt_tokens": 10, "completion_tokens": 5}, model="gpt-ptu-deployment"),
        Segment("vllm", usage={"prompt_tokens": 20, "completion_tokens": 10}, model="llama"),
    ]
    charge(acc, admitted, rec, None, segments)
    assert await acc.flush(5)
    found = sorted(ledger_rows(data), key=lambda r: r["segment"])
    assert [(r["model"], r["cost"]) for r in found] == [
        (MODEL, (10 * 1 + 5 * 2) * 10**6),
        ("llama", 20 * 100_000 + 10 * 200_000),
    ]
    assert sum(r["cost"] for r in found) == counter(data, caller.limits_partition, "spend")["taken"]
    # The log line's cost: at the served name's price once this instance keeps it (read by the charge).
    assert rec.cost == sum(r["cost"] for r in found)
    await state.close()


async def test_the_log_lines_cost_is_the_ledgers_for_a_model_served_under_a_name_this_instance_never_priced():
    """The log line's cost is taken before the charge is made, at the prices the charge uses: both
    the ones its admission read (every model's, one read), even for a name this instance had not
    priced before, and even if a price changes before the answer is over."""
    from chatstream.record import Segment

    data = account()
    state, acc = instance(data, "a")
    other, _ = instance(data, "b")  # the prices are set elsewhere: this instance keeps none of them
    await other.registry.set_price(MODEL, PriceSpec(input=1, output=2))
    await other.registry.set_price("llama", PriceSpec(input=0.1, output=0.2))
    caller, _ = await other.registry.create(CallerSpec(name="c", spend_budget=1))
    admitted, rec = await admit(acc, caller)
    assert isinstance(admitted, Admission)
    await state.registry.set_price("llama", PriceSpec(input=5, output=5))  # after the admission
    rec.upstream_answered()
    segments = [Segment("vllm", usage={"prompt_tokens": 20, "completion_tokens": 10}, model="llama")]
    charge(acc, admitted, rec, None, segments)  # as the endpoint does: the log line's cost, the charge after it
    assert await acc.flush(5)
    [row] = ledger_rows(data)
    assert (row["model"], row["cost"]) == ("llama", 20 * 100_000 + 10 * 200_000) and rec.cost == row["cost"]
    await other.close()
    await state.close()


async def test_an_admission_cancelled_while_the_journal_lists_it_keeps_nothing():
    """The caller hangs up (its task is cancelled) after the limits granted the request, while the
    journal write that lists it answers slowly: what was reserved comes back, the journal drops it."""
    data = account()
    state, acc = instance(data, "a")
    caller, _ = await state.registry.create(CallerSpec(name="c", tokens_per_minute=50_000, token_budget=100_000))
    first, rec = await admit(acc, caller, max_tokens=10)  # the journal and the counters written once
    assert isinstance(first, Admission)
    finish(acc, first, rec, usage(5, 5))
    assert await acc.flush(5)
    store = state.store
    assert isinstance(store, MemoryStore)
    store.inject(Fault("slow", frozenset({"put"}), table="blob", delay=1.5))  # under LISTED_WITHIN
    asking = asyncio.ensure_future(admit(acc, caller, max_tokens=10))
    await until(lambda: len(state.journal.entries) == 1, what="the request opened in the journal")
    await asyncio.sleep(0.3)
    assert not asking.done()  # waiting for its listing
    asking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asking
    assert await acc.flush(5)
    assert not state.journal.entries
    for row in ("tokens", "tpm"):
        found = counter(data, caller.limits_partition, row)
        assert (found["taken"], found.get("holds") or "") == (10, ""), found
    await state.close()
