"""Money, teams and limits per model, end to end (CALLER_KEYS=required, docs/callers.md): the app on the
local host on a real Azurite against the scripted upstream; prices, teams and callers made through the
admin API as an operator makes them. What is claimed about every instance is tested on two."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

import httpx
import pytest
from azure.data.tables import TableServiceClient
from helpers import app_env
from servers import App

from tools.fakeupstream.scenarios import NORMAL_DELTAS, count_prompt_tokens

MODEL = "gpt-test"
OTHER = "gpt-other"
PICO = 10**12


def env(upstream, azurite, **extra: str) -> dict[str, str]:
    return app_env(upstream, AzureWebJobsStorage=azurite.connection_string, CALLER_KEYS="required", **extra)


@pytest.fixture(scope="module")
def keyed(upstream, azurite):
    server = App(env(upstream, azurite))
    yield server
    server.stop()


def admin(app: App, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"{app.url}/api/manage/{path}", json=body, timeout=30)


def name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def caller(app: App, **spec) -> tuple[str, str]:
    who = spec.pop("name", name("c"))
    made = admin(app, "POST", "callers", {"name": who, **spec})
    assert made.status_code == 201, made.text
    return who, made.json()["key"]


def team(app: App, **spec) -> str:
    which = spec.pop("name", name("t"))
    made = admin(app, "POST", "teams", {"name": which, **spec})
    assert made.status_code == 201, made.text
    return which


def ask(text: str, model: str = MODEL, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def chat(app: App, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{app.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=60)


def ledger(azurite, **equal: str) -> list[dict]:
    from azure.core.exceptions import ResourceNotFoundError

    service = TableServiceClient.from_connection_string(azurite.connection_string)
    query = " and ".join(f"{k} eq @{k}" for k in equal)
    try:
        rows = list(service.get_table_client("chatstreamUsage").query_entities(query, parameters=equal))
    except ResourceNotFoundError:  # nothing written yet: the app makes the table on first use
        return []
    return [{k: getattr(v, "value", v) for k, v in row.items()} for row in rows]


def pico_per_token(usd_per_million: float) -> int:
    return round(usd_per_million * 10**6)


def streamed_text(app, key: str, body: dict) -> str:
    """The text of a streamed chat completion on ``app``, as its chunks carried it."""
    with httpx.stream(
        "POST", f"{app.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=60
    ) as r:
        return "".join(
            (json.loads(line[6:]).get("choices") or [{}])[0].get("delta", {}).get("content") or ""
            for line in r.iter_lines()
            if line.startswith("data: {") and json.loads(line[6:]).get("choices")
        )


def test_prices_are_exact_validated_and_never_echo_a_bad_value(keyed):
    model = name("m")
    put = admin(keyed, "PUT", f"prices/{model}", {"input": 0.15, "output": 0.6})
    assert put.status_code == 200, put.text
    assert put.json()["cached_input"] == 0.15 and put.json()["output"] == 0.6  # cached_input defaults to input
    assert admin(keyed, "GET", f"prices/{model}").json()["input"] == 0.15
    assert any(p["model"] == model for p in admin(keyed, "GET", "prices").json()["data"])
    for bad, param in (
        ({"input": "0.15", "output": 1}, "input"),
        ({"input": 0.1234567, "output": 1}, "input"),
        ({"input": -1, "output": 1}, "input"),
        ({"input": 1, "output": True}, "output"),
        ({"input": 1}, "output"),
        ({"input": 1, "output": 1, "typo": 1}, "typo"),
    ):
        refused = admin(keyed, "PUT", f"prices/{model}", bad)
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == param, (bad, refused.text)
        assert "0.1234567" not in error["message"] and "'0.15'" not in error["message"]
    assert admin(keyed, "DELETE", f"prices/{model}").status_code == 200
    assert admin(keyed, "GET", f"prices/{model}").status_code == 404


def test_a_charge_costs_exactly_what_the_price_table_says_cached_tokens_included(keyed, azurite):
    admin(keyed, "PUT", f"prices/{MODEL}", {"input": 2.5, "cached_input": 1.25, "output": 10})
    who, key = caller(keyed, spend_budget=5)
    body = ask("[scenario:normal] price this please", prompt_cache_key="k1", stream=True)
    with httpx.stream(
        "POST", f"{keyed.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=60
    ) as r:
        assert r.status_code == 200
        r.read()
    prompt = count_prompt_tokens(body["messages"])
    cached, completion = prompt // 2, len(NORMAL_DELTAS)
    expected = (prompt - cached) * pico_per_token(2.5) + cached * pico_per_token(1.25) + completion * pico_per_token(10)
    rows = _wait_rows(azurite, 1, caller=who)
    assert (rows[0]["prompt_tokens"], rows[0]["cached_tokens"], rows[0]["completion_tokens"]) == (
        prompt,
        cached,
        completion,
    )
    assert rows[0]["cost"] == expected
    usage = admin(keyed, "GET", f"usage?caller={who}").json()
    assert usage["total"]["cost_picousd"] == expected
    assert usage["total"]["cost_usd"] == pytest.approx(expected / PICO)
    csv = httpx.get(f"{keyed.url}/api/manage/usage?caller={who}", headers={"Accept": "text/csv"}, timeout=30)
    assert csv.headers["content-type"].startswith("text/csv")
    whole, frac = divmod(expected, PICO)
    assert f"{whole}.{frac:012d}" in csv.text  # exact, for finance


def test_an_unpriced_model_is_refused_with_a_money_budget_and_free_without(keyed, azurite, upstream):
    model = name("unpriced")
    _, budgeted = caller(keyed, spend_budget=1)
    free, plain = caller(keyed)
    before = upstream.count()
    refused = chat(keyed, budgeted, ask("[scenario:normal] hi", model=model))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_priced"
    assert model in refused.json()["error"]["message"] and refused.json()["error"]["param"] == "model"
    assert upstream.count() == before
    assert chat(keyed, plain, ask("[scenario:normal] hi", model=model)).status_code == 200
    rows = _wait_rows(azurite, 1, caller=free)
    assert rows[0].get("cost") is None
    usage = admin(keyed, "GET", f"usage?caller={free}").json()
    assert usage["total"]["unpriced_requests"] == 1 and usage["total"]["cost_picousd"] == 0


def test_a_price_row_left_without_a_price_refuses_only_its_model(keyed, azurite):
    """A price row edited by hand (Storage Explorer) into no price, here its output price deleted: that
    model's requests are refused naming its price, within the cache time; every other model goes on."""
    import time

    _, key = caller(keyed)
    broken = name("broken")
    row = {"PartitionKey": "prices", "RowKey": f"p|{broken}", "model": broken, "input": 5, "cached_input": 5}
    service = TableServiceClient.from_connection_string(azurite.connection_string)
    service.get_table_client("chatstreamCallers").upsert_entity(row | {"updated_at": "2026-01-01"})
    deadline = time.monotonic() + 10 + 5  # CALLER_CACHE_SECONDS, and some
    while (refused := chat(keyed, key, ask("[scenario:normal] hi", model=broken))).status_code == 200:
        assert time.monotonic() < deadline, "the unreadable price was never noticed"
        time.sleep(0.5)
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["param"]) == (503, "not_configured", "model"), refused.text
    assert f"price of the model {broken!r} is unreadable" in error["message"]
    assert chat(keyed, key, ask("[scenario:normal] hi")).status_code == 200


def test_a_per_model_limit_refuses_that_model_and_leaves_another_untouched(keyed, upstream):
    _, key = caller(keyed, model_limits={OTHER: {"requests_per_minute": 2}})
    for _ in range(2):
        assert chat(keyed, key, ask("[scenario:normal] hi", model=OTHER)).status_code == 200
    before = upstream.count()
    third = chat(keyed, key, ask("[scenario:normal] hi", model=OTHER))
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_exceeded"
    assert OTHER in third.json()["error"]["message"] and int(third.headers["Retry-After"]) >= 1
    assert upstream.count() == before
    for _ in range(5):
        assert chat(keyed, key, ask("[scenario:normal] hi")).status_code == 200  # MODEL has no such limit


def test_a_teams_limit_holds_over_its_callers_and_names_the_team_not_another_caller(keyed):
    import time

    squad = team(keyed, requests_per_minute=3)
    first, one = caller(keyed, team=squad)
    second, two = caller(keyed, team=squad)
    for _ in range(3):  # a round that straddles a minute's turn (a loaded machine) is tried again
        minute = int(time.time() // 60)
        statuses = [chat(keyed, key, ask("[scenario:normal] hi")).status_code for key in (one, two, one, two)]
        if int(time.time() // 60) == minute:
            break
        time.sleep(60 - time.time() % 60 + 0.5)
    assert statuses.count(200) == 3 and statuses[-1] == 429, statuses
    message = chat(keyed, two, ask("[scenario:normal] hi")).json()["error"]["message"]
    assert squad in message and first not in message and second not in message
    assert admin(keyed, "DELETE", f"teams/{squad}").status_code == 409  # it has callers
    assert (
        admin(keyed, "POST", "callers", {"name": name("c"), "team": "no-such-team"}).json()["error"]["param"] == "team"
    )


@pytest.mark.alone
def test_a_team_spend_budget_holds_over_300_concurrent_requests_on_two_instances(upstream, azurite, start_app):
    """Two callers of one team, 300 requests at once over two instances, a team budget that holds 30
    of them in flight: at most 30 are admitted, the ledger's costs never pass the budget, every refused
    request made no upstream call, every admitted one is in the ledger with the cost the price table
    gives. The upstream holds every admitted answer (``held``) until all 300 are admitted or refused:
    every admission comes before any end, however long a loaded machine takes to admit them (with
    answers of a fixed length, early ones ended and freed their reservations while later ones were
    still being admitted: 53 admitted, rightly)."""
    a = start_app(**env(upstream, azurite))
    b = start_app(**env(upstream, azurite))
    model = name("priced")
    admin(a, "PUT", f"prices/{model}", {"input": 1, "output": 10})
    marker = uuid.uuid4().hex
    body = ask(f"[scenario:held] {marker}", model=model, max_tokens=100, stream=True)
    from chatstream.tokens import count_prompt

    reserve_each = count_prompt(model, body) * pico_per_token(1) + 100 * pico_per_token(10)
    budget_usd = round(30 * reserve_each / PICO, 6)
    squad = team(a, spend_budget=budget_usd, budget_period="month")
    keys = [caller(a, team=squad)[1], caller(a, team=squad)[1]]
    statuses, released = asyncio.run(_burst([a.url, b.url], keys, body, 300, upstream.url))
    admitted = statuses.count(200)
    assert admitted + statuses.count(429) == 300, statuses
    assert released == admitted, "every admitted answer was still running when the last request was decided"
    assert 20 <= admitted <= 30, admitted
    sent = [r for r in upstream.requests(last=700) if marker in json.dumps(r.get("json"))]
    assert len(sent) == admitted, "a refused request is never sent upstream"
    rows = _wait_rows(azurite, admitted, team=squad)
    prompt = count_prompt_tokens(body["messages"])
    for row in rows:
        assert row["cost"] == row["prompt_tokens"] * pico_per_token(1) + row["completion_tokens"] * pico_per_token(10)
        assert row["prompt_tokens"] == prompt
    assert sum(r["cost"] for r in rows) <= budget_usd * PICO


async def _burst(urls: list[str], keys: list[str], body: dict, n: int, upstream: str) -> tuple[list[int], int]:
    """The n requests' statuses, sent at once to ``urls`` in turn; their ``held`` answers are released
    once every request is answered (refused) or held upstream (admitted); and how many were released."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=180, limits=limits) as client:

        async def one(i: int) -> int:
            url = urls[i % len(urls)] + "/api/v1/chat/completions"
            async with client.stream("POST", url, json=body, headers={"api-key": keys[i % len(keys)]}) as response:
                await response.aread()
                return response.status_code

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        deadline = time.monotonic() + 120
        while True:
            held = (await client.get(f"{upstream}/_scripted/release")).json()["held"]
            answered = sum(task.done() for task in tasks)
            if held + answered >= n or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        released = (await client.post(f"{upstream}/_scripted/release")).json()["released"]
        statuses = list(await asyncio.gather(*tasks))
        assert held + answered == n, f"in 120 s, {answered} of {n} requests answered and {held} held upstream"
        return statuses, released


def test_a_continued_response_reserves_what_it_carries(keyed, azurite):
    """The probe: previous_response_id reserved only what the request itself contained, while the
    upstream charged the whole conversation. Now the previous response's size is reserved: a chain of
    continuations stops at the budget."""
    who, key = caller(keyed, token_budget=1_000, budget_period="day")
    previous = None
    admitted = 0
    for i in range(30):
        body = {"model": MODEL, "input": f"[scenario:normal] turn {i}", "max_output_tokens": 20, "store": True}
        if previous is not None:
            body["previous_response_id"] = previous
        answer = httpx.post(f"{keyed.url}/api/v1/responses", headers={"api-key": key}, json=body, timeout=60)
        if answer.status_code != 200:
            assert answer.status_code == 429 and answer.json()["error"]["code"] == "insufficient_quota", answer.text
            break
        admitted += 1
        previous = answer.json()["id"]
    assert 2 <= admitted < 30
    rows = _wait_rows(azurite, admitted, caller=who)
    assert sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows) <= 1_000


def test_someone_elses_previous_response_is_not_found(keyed):
    _, alice = caller(keyed)
    _, bob = caller(keyed)
    made = httpx.post(
        f"{keyed.url}/api/v1/responses",
        headers={"api-key": alice},
        json={"model": MODEL, "input": "[scenario:normal] mine", "store": True},
        timeout=60,
    )
    assert made.status_code == 200
    stolen = httpx.post(
        f"{keyed.url}/api/v1/responses",
        headers={"api-key": bob},
        json={"model": MODEL, "input": "go on", "previous_response_id": made.json()["id"]},
        timeout=60,
    )
    assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("cap", [0.5, "100", 1e9, True, -1, 0])
def test_an_output_cap_is_one_integer_or_refused(keyed, upstream, cap):
    _, key = caller(keyed, token_budget=1_000_000)
    before = upstream.count()
    refused = chat(keyed, key, ask("hi", max_tokens=1, max_completion_tokens=cap))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_completion_tokens", refused.text
    assert upstream.count() == before


def test_two_output_caps_reach_the_upstream_as_the_smaller(keyed, upstream):
    _, key = caller(keyed, token_budget=1_000_000)
    marker = uuid.uuid4().hex
    assert chat(keyed, key, ask(f"hi {marker}", max_tokens=7, max_completion_tokens=900)).status_code == 200
    sent = next(r["json"] for r in upstream.requests(last=50) if marker in json.dumps(r.get("json")))
    assert sent["max_tokens"] == 7 and sent["max_completion_tokens"] == 7


def test_a_caller_made_again_under_its_name_starts_afresh(keyed, azurite):
    who, key = caller(keyed)
    made = httpx.post(
        f"{keyed.url}/api/v1/responses",
        headers={"api-key": key},
        json={"model": MODEL, "input": "[scenario:normal] old", "store": True},
        timeout=60,
    )
    _wait_rows(azurite, 1, caller=who)
    assert admin(keyed, "DELETE", f"callers/{who}").status_code == 200
    _, again = caller(keyed, name=who)
    old = httpx.get(f"{keyed.url}/api/v1/responses/{made.json()['id']}", headers={"api-key": again}, timeout=30)
    assert old.status_code == 404, "the old caller's response is not the new one's"
    usage = admin(keyed, "GET", f"usage?caller={who}").json()
    assert usage["total"]["requests"] == 0, "nor is its usage"


def test_models_lists_what_the_caller_may_use(keyed):
    _, key = caller(keyed, models=["gpt-a", "gpt-b"])
    listed = httpx.get(f"{keyed.url}/api/v1/models", headers={"api-key": key}, timeout=30).json()
    assert sorted(m["id"] for m in listed["data"]) == ["gpt-a", "gpt-b"]
    assert httpx.get(f"{keyed.url}/api/v1/models/gpt-a", headers={"api-key": key}, timeout=30).status_code == 200
    assert httpx.get(f"{keyed.url}/api/v1/models/{MODEL}", headers={"api-key": key}, timeout=30).status_code == 404


def _wait_rows(azurite, n: int, timeout: float = 20.0, **equal: str) -> list[dict]:
    import time

    deadline = time.monotonic() + timeout
    while len(rows := ledger(azurite, **equal)) < n:
        assert time.monotonic() < deadline, f"{len(rows)} of {n} ledger rows"
        time.sleep(0.2)
    return rows


def test_every_choice_is_charged_when_an_answer_with_n_2_breaks_off(keyed, azurite):
    """The probe: n = 2 and a reset counted choice 0's text only (8 of 47 tokens)."""
    from chatstream.tokens import count_text

    who, key = caller(keyed)
    body = ask("[scenario:reset] two of them", n=2, stream=True)
    texts: dict[int, str] = {}
    with httpx.stream(
        "POST", f"{keyed.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    texts[choice["index"]] = texts.get(choice["index"], "") + (
                        (choice.get("delta") or {}).get("content") or ""
                    )
    assert set(texts) == {0, 1} and all(texts.values())
    row = _wait_rows(azurite, 1, caller=who)[0]
    assert row["completion_tokens"] == count_text(MODEL, texts[0]) + count_text(MODEL, texts[1]), (row, texts)


def test_a_non_streamed_call_abandoned_in_flight_is_charged_its_prompt(keyed, azurite):
    """The probe: a caller that hung up on a non-streamed call after the upstream took its prompt left
    no ledger row (a streamed one was charged the prompt)."""
    from chatstream.tokens import count_prompt

    who, key = caller(keyed)
    body = ask("[scenario:hang] " + "long prompt " * 50)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{keyed.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=1.5)
    row = _wait_rows(azurite, 1, caller=who)[0]
    assert (row["prompt_tokens"], row["completion_tokens"], row["ended"]) == (
        count_prompt(MODEL, body),
        0,
        "disconnected",
    )


def test_a_continued_answer_is_charged_per_segment(azurite):
    """An answer whose upstream broke off after 3 deltas goes on (continuation.py): each segment is
    one ledger row, the broken one at its prompt and what it generated, the continuation at its usage."""
    from servers import Upstream

    from chatstream.tokens import count_prompt

    upstream = Upstream()
    app = App(env(upstream, azurite))
    try:
        who, key = caller(app)
        upstream.http.post("/_scripted/failure", json={"after": 3, "end": "reset", "times": 1}).raise_for_status()
        body = ask("[scenario:normal] go on please", stream=True)
        seen = streamed_text(app, key, body)
        assert seen == "".join(NORMAL_DELTAS)
        rows = sorted(_wait_rows(azurite, 2, caller=who), key=lambda r: r["segment"])
        assert [r["segment"] for r in rows] == [0, 1] and {r["request_id"] for r in rows} == {rows[0]["request_id"]}
        assert rows[0]["prompt_tokens"] == count_prompt(MODEL, body) and rows[0]["completion_tokens"] > 0
        assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]  # it carried the text so far
        second = upstream.requests(last=1)[0]
        assert rows[1]["upstream_id"] == second["id"] and rows[1]["completion_tokens"] > 0  # its own usage
    finally:
        app.stop()
        upstream.stop()


def test_a_price_raised_while_requests_stream_does_not_push_a_team_past_its_money_budget(keyed, azurite):
    """The probe: a price raised x10 while admitted requests streamed took a team's money budget to
    866% (reserved at the old price, charged at the new one). A request is charged at the price it
    was admitted at; the change applies to the requests admitted after it."""
    from chatstream.tokens import count_prompt

    model = name("repriced")
    assert admin(keyed, "PUT", f"prices/{model}", {"input": 1, "output": 10}).status_code == 200
    body = ask(f"[scenario:slow] {uuid.uuid4().hex}", model=model, max_tokens=20, stream=True)
    reserve_each = count_prompt(model, body) * pico_per_token(1) + 20 * pico_per_token(10)
    squad = team(keyed, spend_budget=round(3 * reserve_each / PICO, 6), budget_period="month")
    _, key = caller(keyed, team=squad)

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event() for _ in range(3)]

            async def one(i: int) -> str:
                async with client.stream(
                    "POST", f"{keyed.url}/api/v1/chat/completions", headers={"api-key": key}, json=body
                ) as r:
                    assert r.status_code == 200, await r.aread()
                    text = ""
                    async for line in r.aiter_lines():
                        started[i].set()  # admitted, and its upstream answering
                        text += line
                    return text

            streams = [asyncio.create_task(one(i)) for i in range(3)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
            raised = await client.put(
                f"{keyed.url}/api/manage/prices/{model}", json={"input": 10, "output": 100}, timeout=30
            )
            assert raised.status_code == 200, raised.text
            return await asyncio.gather(*streams)

    texts = asyncio.run(run())
    assert all("[DONE]" in t for t in texts)
    rows = _wait_rows(azurite, 3, team=squad)
    for row in rows:  # each at the price it was admitted at
        assert row["cost"] == row["prompt_tokens"] * pico_per_token(1) + row["completion_tokens"] * pico_per_token(10)
    budget = round(3 * reserve_each / PICO, 6) * PICO
    assert sum(r["cost"] for r in rows) <= budget
    shown = admin(keyed, "GET", f"teams/{squad}").json()
    assert shown["spend_budget_used"] <= shown["spend_budget"], shown


def test_a_failed_continuation_is_charged_the_prompt_it_was_sent(azurite):
    """The probe: an answer continued a -> b -> a where b failed too charged b's segment the original
    prompt plus the text before it (40 tokens), while the request b was sent, with the instruction to
    go on, counts 87. Every segment is charged what was sent to it and what it generated."""
    from servers import Upstream

    from chatstream.continuation import CONTINUE_PROMPT
    from chatstream.tokens import count_prompt

    upstream = Upstream()
    app = App(env(upstream, azurite))
    try:
        who, key = caller(app)
        upstream.http.post("/_scripted/failure", json={"after": 3, "end": "reset", "times": 2}).raise_for_status()
        marker = uuid.uuid4().hex
        body = ask(f"[scenario:normal] go on twice {marker}", stream=True)
        seen = streamed_text(app, key, body)
        assert seen == "".join(NORMAL_DELTAS)
        sent = [r for r in upstream.requests(last=10) if marker in json.dumps(r.get("json"))]
        assert len(sent) == 3, "the answer, a continuation that failed too, and the one that finished"
        rows = sorted(_wait_rows(azurite, 3, caller=who), key=lambda r: r["segment"])
        assert [r["segment"] for r in rows] == [0, 1, 2]
        failed = sent[1]["json"]
        assert failed["messages"][-1]["content"] == CONTINUE_PROMPT
        assert rows[0]["prompt_tokens"] == count_prompt(MODEL, sent[0]["json"]) == count_prompt(MODEL, body)
        assert rows[1]["prompt_tokens"] == count_prompt(MODEL, failed), "what was sent, the instruction included"
        assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"] + rows[0]["completion_tokens"]
        assert rows[0]["completion_tokens"] > 0 and rows[1]["completion_tokens"] > 0  # what each generated
        assert rows[2]["upstream_id"] == sent[2]["id"] and rows[2]["completion_tokens"] > 0  # its own usage
    finally:
        app.stop()
        upstream.stop()


def test_a_price_change_reaches_every_instance_within_the_cache_time(upstream, azurite, start_app):
    """docs/callers.md: a change applies at once on the instance that made it, within
    CALLER_CACHE_SECONDS on every other (the probe: the other kept the old price ~7 s while the docs
    said "from the moment it is made"). B has the price cached when A changes it; every request sent
    to B later than the cache time after the change is charged the new price."""
    import time

    cache = 2.0
    a = start_app(**env(upstream, azurite, CALLER_CACHE_SECONDS=str(cache)))
    b = start_app(**env(upstream, azurite, CALLER_CACHE_SECONDS=str(cache)))
    model = name("moving")
    assert admin(a, "PUT", f"prices/{model}", {"input": 1, "output": 10}).status_code == 200
    who, key = caller(a)
    body = ask("[scenario:normal] what does it cost", model=model)
    assert chat(b, key, body).status_code == 200  # B has the price now
    assert admin(a, "PUT", f"prices/{model}", {"input": 3, "output": 30}).status_code == 200
    changed = time.monotonic()
    sent: dict[str, float] = {}  # the upstream's x-request-id: seconds after the change it was sent
    while (after := time.monotonic() - changed) < cache + 1.5:
        answer = chat(b, key, body)
        assert answer.status_code == 200, answer.text
        sent[answer.headers["x-request-id"]] = after
        time.sleep(0.1)
    rows = {r["upstream_id"]: r for r in _wait_rows(azurite, len(sent) + 1, caller=who)}
    new = []
    for request_id, after in sent.items():
        row = rows[request_id]
        old_cost = row["prompt_tokens"] * pico_per_token(1) + row["completion_tokens"] * pico_per_token(10)
        assert row["cost"] in (old_cost, 3 * old_cost), row
        new.append((after, row["cost"] == 3 * old_cost))
    late = [is_new for after, is_new in new if after > cache + 0.25]  # slack: the store clock's own steps
    assert late and all(late), f"B charged the old price after {cache} s: {new}"
    first_new = min(after for after, is_new in new if is_new)
    print(f"B's first request at the new price: {first_new:.2f} s after the change (bound {cache} s)")


def test_a_team_made_again_under_its_name_starts_afresh_in_usage(keyed, azurite):
    """The probe: a team deleted and made again under its name showed the old team's usage in
    ``usage?team=`` (the name went to the ledger; callers went by id and were right)."""
    squad = team(keyed)
    old, key = caller(keyed, team=squad)
    assert chat(keyed, key, ask("[scenario:normal] the old team's")).status_code == 200
    _wait_rows(azurite, 1, team=squad)
    assert admin(keyed, "GET", f"usage?team={squad}").json()["total"]["requests"] == 1
    assert admin(keyed, "DELETE", f"callers/{old}").status_code == 200
    assert admin(keyed, "DELETE", f"teams/{squad}").status_code == 200
    assert admin(keyed, "GET", f"usage?team={squad}").json()["total"]["requests"] == 1  # deleted: by name
    team(keyed, name=squad)
    assert admin(keyed, "GET", f"usage?team={squad}").json()["total"]["requests"] == 0, "not the old team's"
    _, key = caller(keyed, team=squad)
    assert chat(keyed, key, ask("[scenario:normal] the new team's")).status_code == 200
    _wait_rows(azurite, 2, team=squad)
    assert admin(keyed, "GET", f"usage?team={squad}").json()["total"]["requests"] == 1


def test_a_background_response_is_charged_at_the_price_it_was_admitted_at(keyed, azurite):
    """A background response is charged when its usage is first seen, maybe long after it was
    admitted: at the price it was admitted (and reserved) at, kept with it, not the one of then."""
    import time

    model = name("bg")
    assert admin(keyed, "PUT", f"prices/{model}", {"input": 1, "output": 10}).status_code == 200
    who, key = caller(keyed, spend_budget=1)
    made = httpx.post(
        f"{keyed.url}/api/v1/responses",
        headers={"api-key": key},
        json={"model": model, "input": "[scenario:normal] in the background", "background": True, "store": True},
        timeout=60,
    )
    assert made.status_code == 200, made.text
    assert admin(keyed, "PUT", f"prices/{model}", {"input": 10, "output": 100}).status_code == 200
    deadline = time.monotonic() + 30
    while True:
        seen = httpx.get(f"{keyed.url}/api/v1/responses/{made.json()['id']}", headers={"api-key": key}, timeout=30)
        assert seen.status_code == 200, seen.text
        if seen.json()["status"] == "completed":
            break
        assert time.monotonic() < deadline, seen.json()["status"]
        time.sleep(0.2)
    [row] = _wait_rows(azurite, 1, caller=who)
    assert row["ended"] == "background"
    assert row["cost"] == row["prompt_tokens"] * pico_per_token(1) + row["completion_tokens"] * pico_per_token(10)


def test_a_fallback_serving_another_model_names_it_and_is_charged_its_price(azurite):
    """Issue 42: a ``base_url`` entry may serve a requested model as one of its own (``deployments``).
    The primary answers 500; the fallback serves ``gpt-test`` as ``llama-test``: the caller's chunks
    and usage name it, and the ledger row is that model's, at its price."""
    from servers import Upstream

    primary, fallback = Upstream("--scenario", "server_error"), Upstream("--scenario", "normal")
    pool = [
        {"name": "primary", "base_url": primary.base_url, "priority": 1},
        {"name": "vllm", "base_url": fallback.base_url, "priority": 2, "deployments": {MODEL: "llama-test"}},
    ]
    app = App(env(fallback, azurite, UPSTREAMS=json.dumps(pool)))
    try:
        admin(app, "PUT", f"prices/{MODEL}", {"input": 2.5, "output": 10})
        admin(app, "PUT", "prices/llama-test", {"input": 0.1, "output": 0.2})
        who, key = caller(app, spend_budget=5)
        body = ask("a question for the pool", stream=True, stream_options={"include_usage": True})
        with httpx.stream(
            "POST", f"{app.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=60
        ) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert {c["model"] for c in chunks} == {"llama-test"}, "every chunk, the usage one too, names it"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(NORMAL_DELTAS)
        assert primary.count() == 1 and fallback.requests(last=1)[0]["json"]["model"] == "llama-test"
        (row,) = _wait_rows(azurite, 1, caller=who)
        prompt = chunks[-1]["usage"]["prompt_tokens"]
        assert (row["model"], row["upstream"], row["prompt_tokens"]) == ("llama-test", "vllm", prompt)
        assert row["cost"] == prompt * pico_per_token(0.1) + len(NORMAL_DELTAS) * pico_per_token(0.2)

        # An answer the primary begins and the fallback goes on with: each segment at its own model's price.
        primary.http.post("/_scripted/default", json={"scenario": "normal"}).raise_for_status()
        primary.http.post("/_scripted/failure", json={"after": 3, "times": 1}).raise_for_status()
        who, key = caller(app, spend_budget=5)
        with httpx.stream(
            "POST", f"{app.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=60
        ) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join((c["choices"] or [{}])[0].get("delta", {}).get("content") or "" for c in chunks)
        assert text == "".join(NORMAL_DELTAS) and chunks[-1]["continued"][0]["to"] == "vllm"
        assert chunks[-1]["model"] == "llama-test", "the usage chunk names the model that finished the answer"
        rows = sorted(_wait_rows(azurite, 2, caller=who), key=lambda r: r["segment"])
        assert [(r["model"], r["upstream"]) for r in rows] == [(MODEL, "primary"), ("llama-test", "vllm")]
        prices = {MODEL: (2.5, 10), "llama-test": (0.1, 0.2)}
        for r in rows:
            cost_in, cost_out = (pico_per_token(p) for p in prices[r["model"]])
            assert r["cost"] == r["prompt_tokens"] * cost_in + r["completion_tokens"] * cost_out, r
    finally:
        app.stop()
        primary.stop()
        fallback.stop()
