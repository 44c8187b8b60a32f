"""Caller keys end to end (CALLER_KEYS=required, docs/callers.md): the app on the local host, on a real
Azurite, against the scripted upstream; two app instances on one Azurite where the claim is about every
instance. Keys come from the admin API (/api/manage/...), as an operator makes them."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import signal
import time
import uuid

import httpx
import openai
import pytest
from azure.data.tables import TableServiceClient, UpdateMode
from helpers import TEST_KEY, app_env
from servers import App, Azurite

from chatstream.state.counters import SPARE_SECONDS
from chatstream.tokens import count_prompt, count_text
from tools.fakeupstream.scenarios import NORMAL_DELTAS, SLOW_DELTAS, TEXTS, count_prompt_tokens

MODEL = "gpt-test"


def callers_env(upstream, azurite, **extra: str) -> dict[str, str]:
    return app_env(upstream, AzureWebJobsStorage=azurite.connection_string, CALLER_KEYS="required", **extra)


def create(app: App, **spec) -> tuple[str, str]:
    """A new caller (a unique name) and its key."""
    name = spec.pop("name", f"team-{secrets.token_hex(4)}")
    response = httpx.post(app.url + "/api/manage/callers", json={"name": name, **spec}, timeout=30)
    assert response.status_code == 201, response.text
    return name, response.json()["key"]


def ask(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


@pytest.fixture(scope="module")
def keyed(upstream, azurite):
    server = App(callers_env(upstream, azurite))
    yield server
    server.stop()


def test_a_key_made_with_one_call_works_with_the_openai_sdk(keyed, upstream):
    name, key = create(keyed, tokens_per_minute=50_000)
    sdk = openai.OpenAI(api_key=key, base_url=keyed.url + "/api/v1", max_retries=0)
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "[scenario:echo] hi"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert raw.headers["x-ratelimit-limit-tokens"] == "50000"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 50_000
    assert text.startswith("You said")
    # Azure OpenAI's header works too; no key, a wrong key: 401 invalid_api_key, and no upstream call.
    ok = httpx.post(keyed.url + "/api/v1/chat/completions", headers={"api-key": key}, json=ask("hi"), timeout=30)
    assert ok.status_code == 200 and ok.headers["x-request-id"]
    before = upstream.count()
    for headers in ({}, {"Authorization": "Bearer csk-" + "x" * 43}, {"Authorization": f"Bearer {TEST_KEY}"}):
        refused = httpx.post(keyed.url + "/api/v1/chat/completions", headers=headers, json=ask("hi"), timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + "/api/v1/models", timeout=30).status_code == 401
    assert httpx.get(keyed.url + "/api/v1/models", headers={"api-key": key}, timeout=30).status_code == 200
    assert upstream.count() == before
    assert key not in keyed.log(), "a key never reaches a log line"


def test_a_model_the_caller_may_not_use_is_404_and_a_spent_budget_is_insufficient_quota(keyed, upstream):
    _, key = create(keyed, models=["gpt-other"], token_budget=5000, budget_period="day")
    headers = {"Authorization": f"Bearer {key}"}
    before = upstream.count()
    refused = httpx.post(keyed.url + "/api/v1/chat/completions", headers=headers, json=ask("hi"), timeout=30)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    too_big = httpx.post(
        keyed.url + "/api/v1/chat/completions",
        headers=headers,
        json={**ask("hi"), "model": "gpt-other", "max_tokens": 6000},
        timeout=30,
    )
    assert too_big.status_code == 429 and too_big.json()["error"]["code"] == "insufficient_quota"
    assert too_big.headers["x-should-retry"] == "false"
    assert upstream.count() == before, "a refused request is never sent upstream"


def test_a_response_belongs_to_the_caller_that_created_it(keyed):
    _, alice = create(keyed)
    _, bob = create(keyed)
    created = httpx.post(
        keyed.url + "/api/v1/responses",
        headers={"api-key": alice},
        json={"model": MODEL, "input": "[scenario:normal] hi", "store": True},
        timeout=30,
    )
    assert created.status_code == 200, created.text
    rid = created.json()["id"]
    mine = httpx.get(f"{keyed.url}/api/v1/responses/{rid}", headers={"api-key": alice}, timeout=30)
    assert mine.status_code == 200 and mine.json()["id"] == rid
    for method in ("GET", "DELETE"):
        other = httpx.request(method, f"{keyed.url}/api/v1/responses/{rid}", headers={"api-key": bob}, timeout=30)
        assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
    assert (
        httpx.post(f"{keyed.url}/api/v1/responses/{rid}/cancel", headers={"api-key": bob}, timeout=30).status_code
        == 404
    )


def spoil(azurite, row_key: str, **fields) -> None:
    """A caller's, team's or price's row as a hand edit in Storage Explorer may leave it (``None``: removed)."""
    table = TableServiceClient.from_connection_string(azurite.connection_string).get_table_client("chatstreamCallers")
    partition = {"t": "teams", "p": "prices"}.get(row_key[0], "callers")
    row = dict(table.get_entity(partition, row_key)) | fields
    table.upsert_entity({k: v for k, v in row.items() if v is not None}, mode=UpdateMode.REPLACE)


@pytest.mark.parametrize("bad", [{"models": "[not json"}, {"id": None}, {"tokens_per_minute": "100"}])
def test_an_unreadable_caller_or_team_is_a_clear_503_and_the_admin_api_shows_and_deletes_it(keyed, azurite, bad):
    """Its key's requests: a 503 naming the unreadable record (not a 500); the admin API reads and
    lists it as unreadable (before, a list left it out: an operator never saw it), refuses a patch
    (409: delete and create it again) and deletes it whole."""
    manage = keyed.url + "/api/manage"
    name, key = create(keyed, models=[MODEL])
    digest = hashlib.sha256(key.encode()).hexdigest()
    for row_key in (f"c|{name}", f"k|{digest}"):
        spoil(azurite, row_key, **bad)
    url, headers = keyed.url + "/api/v1/chat/completions", {"api-key": key}
    for _ in range(2):
        refused = httpx.post(url, headers=headers, json=ask("hi"), timeout=30)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "not_configured" and f"caller {name!r} is unreadable" in error["message"], error
    shown = httpx.get(f"{manage}/callers/{name}", timeout=30)
    assert shown.status_code == 200 and shown.json()["unreadable"].split(":")[0] in bad, shown.text
    [listed] = [c for c in httpx.get(f"{manage}/callers", timeout=30).json()["data"] if c["name"] == name]
    assert listed == shown.json() and "key_hint" not in listed, listed
    patched = httpx.patch(f"{manage}/callers/{name}", json={"tokens_per_minute": 5}, timeout=30)
    assert patched.status_code == 409 and "delete it and create it again" in patched.text, patched.text
    gone = httpx.delete(f"{manage}/callers/{name}", timeout=30)
    assert gone.status_code == 200 and gone.json()["deleted"] is True, gone.text
    assert httpx.get(f"{manage}/callers/{name}", timeout=30).status_code == 404
    assert httpx.post(url, headers=headers, json=ask("hi"), timeout=30).status_code == 401

    team = f"t-{secrets.token_hex(4)}"
    assert httpx.post(f"{manage}/teams", json={"name": team}, timeout=30).status_code == 201
    member, key = create(keyed, team=team)
    spoil(azurite, f"t|{team}", **bad)
    refused = httpx.post(url, headers={"api-key": key}, json=ask("hi"), timeout=30)
    assert refused.status_code == 503 and f"team {team!r} is unreadable" in refused.text, refused.text
    shown = httpx.get(f"{manage}/teams/{team}", timeout=30).json()
    assert "unreadable" in shown and shown["object"] == "team", shown
    assert [t for t in httpx.get(f"{manage}/teams", timeout=30).json()["data"] if t["name"] == team] == [shown]
    [listed] = [c for c in httpx.get(f"{manage}/callers", timeout=30).json()["data"] if c["name"] == member]
    assert listed["team"] == team and "unreadable" not in listed  # its caller reads (its requests refused)
    assert httpx.delete(f"{manage}/teams/{team}", timeout=30).status_code == 409  # it still has a caller
    assert httpx.delete(f"{manage}/callers/{member}", timeout=30).status_code == 200
    assert httpx.delete(f"{manage}/teams/{team}", timeout=30).status_code == 200
    assert "Traceback" not in keyed.log()


def test_a_revoked_key_stops_on_every_instance_within_the_cache_time(upstream, azurite, start_app):
    a = start_app(**callers_env(upstream, azurite, CALLER_CACHE_SECONDS="2"))
    b = start_app(**callers_env(upstream, azurite, CALLER_CACHE_SECONDS="2"))
    name, key = create(a)
    headers = {"api-key": key}
    assert (
        httpx.post(b.url + "/api/v1/chat/completions", headers=headers, json=ask("hi"), timeout=30).status_code == 200
    )
    assert httpx.delete(f"{a.url}/api/manage/callers/{name}", timeout=30).status_code == 200
    revoked = time.monotonic()
    while True:
        status = httpx.post(b.url + "/api/v1/chat/completions", headers=headers, json=ask("hi"), timeout=30).status_code
        if status == 401:
            break
        assert time.monotonic() - revoked < 2.5, "B still takes the revoked key"
        time.sleep(0.1)


def stall_request(marker: str, reserve: int) -> dict:
    body = ask(f"[scenario:stall] {marker}")
    body["max_tokens"] = reserve - count_prompt(MODEL, body)
    body["stream"] = True
    return body


async def burst(urls: list[str], key: str, body: dict, n: int) -> list[int]:
    """``n`` streamed requests at once, spread over ``urls``; each held open until every one has its
    status (a stalled stream holds its reservation), then all closed. The statuses."""
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        statuses: list[int] = [0] * n
        got = asyncio.Event()
        release = asyncio.Event()

        async def one(i: int) -> None:
            url = urls[i % len(urls)] + "/api/v1/chat/completions"
            async with client.stream("POST", url, json=body, headers={"api-key": key}) as response:
                statuses[i] = response.status_code
                if all(statuses):
                    got.set()
                await release.wait()

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        await asyncio.wait_for(got.wait(), 90)
        release.set()
        await asyncio.gather(*tasks)
        return statuses


@pytest.mark.alone
def test_a_burst_over_two_instances_never_admits_more_than_the_limit(upstream, azurite, start_app):
    a = start_app(**callers_env(upstream, azurite, IDLE_TIMEOUT_SECONDS="120"))
    b = start_app(**callers_env(upstream, azurite, IDLE_TIMEOUT_SECONDS="120"))
    _, key = create(a, tokens_per_minute=10_000)
    marker = uuid.uuid4().hex
    body = stall_request(marker, 100)
    assert count_prompt(MODEL, body) + body["max_tokens"] == 100
    started = time.monotonic()
    statuses = asyncio.run(burst([a.url, b.url], key, body, 200))
    admitted, refused = statuses.count(200), statuses.count(429)
    assert admitted + refused == 200, statuses
    assert admitted * 100 <= 10_000, "never more than the limit in one window"
    assert admitted >= 90, f"the limit is used, not wasted: {admitted} admitted"  # minus the seconds a window turns
    sent = [r for r in upstream.requests(last=400) if marker in json.dumps(r.get("json"))]
    assert len(sent) == admitted, "every refused request got its 429 without an upstream call"
    print(f"burst: {admitted} admitted, {refused} refused in {time.monotonic() - started:.1f} s")


@pytest.mark.alone
def test_the_store_down_fails_closed_within_two_seconds_and_recovers(upstream, start_app):
    store = Azurite()
    try:
        app = start_app(**callers_env(upstream, store))
        _, known = create(app, tokens_per_minute=100_000)
        _, new = create(app, tokens_per_minute=100_000)
        assert (
            httpx.post(
                app.url + "/api/v1/chat/completions", headers={"api-key": known}, json=ask("hi"), timeout=30
            ).status_code
            == 200
        )
        time.sleep(SPARE_SECONDS + 1)  # what the instance held ahead has gone back to the store: the next one needs it
        before = upstream.count()
        os.kill(store.node_pid, signal.SIGSTOP)  # a store that takes connections and never answers
        try:
            answers = []
            for key in (known, new):  # a reservation needs the store; so does a key not seen yet
                started = time.monotonic()
                down = httpx.post(
                    app.url + "/api/v1/chat/completions",
                    headers={"api-key": key},
                    json=ask("hi", max_tokens=50),
                    timeout=30,
                )
                answers.append((down, time.monotonic() - started))
            started = time.monotonic()
            on_chat = httpx.post(
                app.url + "/api/chat", headers={"api-key": known}, json={"prompt": "hi", "max_tokens": 50}, timeout=30
            )
            took_chat = time.monotonic() - started
        finally:
            os.kill(store.node_pid, signal.SIGCONT)
        for down, took in answers:
            assert down.status_code == 503 and down.json()["error"]["code"] == "caller_store_unavailable", down.text
            assert took < 2.5, took
            # The probe: x-should-retry false while the body said retryable. Nothing was started: retry.
            assert down.headers["x-should-retry"] == "true" and down.headers["retry-after"] == "2"
        assert on_chat.status_code == 503 and took_chat < 2.5, (on_chat.text, took_chat)
        error = on_chat.json()["error"]
        assert error["type"] == "caller_store_unavailable" and error["retryable"] is True
        assert on_chat.headers["x-should-retry"] == "true", "the header says what the body says"
        assert upstream.count() == before, "no stream started"
        for key in (known, new):
            back = httpx.post(
                app.url + "/api/v1/chat/completions", headers={"api-key": key}, json=ask("hi"), timeout=30
            )
            assert back.status_code == 200, "it recovers by itself"
    finally:
        store.stop()


def ledger_rows(azurite, caller: str) -> dict[str, dict]:
    """The caller's charges by the x-request-id its answers carried (one segment each here)."""
    service = TableServiceClient.from_connection_string(azurite.connection_string)
    rows = service.get_table_client("chatstreamUsage").query_entities("caller eq @c", parameters={"c": caller})
    return {row["upstream_id"]: {k: getattr(v, "value", v) for k, v in row.items()} for row in rows}


KINDS = ("complete", "stream", "hang_up", "timeout", "reset", "error", "refused")


def mixed_body(i: int) -> dict:
    kind = KINDS[i % len(KINDS)]
    scenario = {
        "complete": "normal",
        "stream": "normal",
        "hang_up": "slow",
        "timeout": "stall",
        "reset": "reset",
        "error": "error_midstream",
        "refused": "normal",
    }[kind]
    body = ask(f"[scenario:{scenario}] request {i}", stream=kind != "complete")
    if kind == "refused":
        body["model"] = "gpt-not-mine"  # the caller may use MODEL only: 404, before any upstream call
    return body


def delta_text(line: str) -> str:
    """The text a chat-completions SSE line carries."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


async def mixed(url: str, key: str, n: int) -> list[tuple[int, str, str | None, str]]:
    """``n`` requests of every kind: (i, kind, x-request-id, the text the caller got). A ``hang_up``
    whose answer ended before the caller could hang up (the idle limit fired first on a loaded
    machine) comes back as ``hang_up_late``: it was a timeout, and is charged as one."""
    limits = httpx.Limits(max_connections=60)
    sem = asyncio.Semaphore(40)
    async with httpx.AsyncClient(timeout=60, limits=limits, headers={"api-key": key}) as client:

        async def one(i: int) -> tuple[int, str, str | None, str]:
            kind, body = KINDS[i % len(KINDS)], mixed_body(i)
            async with sem:
                if kind == "complete":
                    response = await client.post(url, json=body)
                    return i, kind, response.headers.get("x-request-id"), ""
                async with client.stream("POST", url, json=body) as response:
                    seen = ""
                    async for line in response.aiter_lines():
                        seen += delta_text(line)
                        if kind == "hang_up" and "arrives" in seen:
                            break  # hang up mid-stream
                    else:
                        if kind == "hang_up":
                            kind = "hang_up_late"
                    return i, kind, response.headers.get("x-request-id"), seen

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_the_ledger_charges_exactly_what_was_used_over_1000_mixed_requests(upstream, azurite, start_app):
    # Continuations off: each failed answer is one upstream stream, charged as one row. (With them on,
    # a reset that loses its last delta in the TCP reset is continued, and charged in two segments:
    # tests/test_spend.py checks those.)
    env = callers_env(upstream, azurite, IDLE_TIMEOUT_SECONDS="0.5", CONTINUE_ON_UPSTREAM_FAILURE="false")
    app = start_app(**env)
    name, key = create(app, models=[MODEL])
    results = asyncio.run(mixed(app.url + "/api/v1/chat/completions", key, 1000))
    deadline = time.monotonic() + 20  # the charges are written in the background
    while len(rows := ledger_rows(azurite, name)) < sum(1 for r in results if r[1] != "refused"):
        assert time.monotonic() < deadline, f"{len(rows)} ledger rows"
        time.sleep(0.5)
    for i, kind, request_id, seen in results:
        if kind == "refused":
            assert request_id not in rows, "a refused request is never charged"
            continue
        row = rows.pop(request_id)
        body = mixed_body(i)
        if kind in ("complete", "stream"):  # exactly the upstream's reported usage
            assert (row["ended"], row["prompt_tokens"], row["completion_tokens"]) == (
                "completed",
                count_prompt_tokens(body["messages"]),
                len(NORMAL_DELTAS),
            ), row
            continue
        reported = count_prompt_tokens(body["messages"])  # the upstream's own count (not the tokenizer's)
        if kind == "hang_up" and row["prompt_tokens"] == reported != count_prompt(MODEL, body):
            # On a loaded machine the relay can read the slow answer to its end, its usage included,
            # before it sees the hang-up (CI, 2026-12-03): then it is charged the upstream's own usage,
            # exactly, as any answer whose usage arrived.
            assert row["completion_tokens"] == len(SLOW_DELTAS), row
            assert row["ended"] in ("disconnected", "timeout", "completed"), row
            continue
        assert row["prompt_tokens"] == count_prompt(MODEL, body), "the prompt, counted with the model's tokenizer"
        if kind != "hang_up":  # the text actually generated (all of it reached the caller), counted the same way
            assert row["completion_tokens"] == count_text(MODEL, seen) > 0, (kind, seen, row)
            assert row["ended"] == ("timeout" if kind in ("timeout", "hang_up_late") else "failed"), (kind, row)
        else:  # the relay may have read on a little after the caller hung up, never past the answer
            # A hang-up and the idle limit can race on a loaded machine (an upstream that falls silent
            # just as the caller leaves): the row says whichever the app saw first; both charge the
            # same, the prompt and what was generated (docs/callers.md).
            assert row["ended"] in ("disconnected", "timeout"), row
            assert count_text(MODEL, seen) <= row["completion_tokens"] <= count_text(MODEL, TEXTS["slow"])
    assert not rows, f"no charge without a request: {list(rows)[:3]}"
