"""Callers' limits and money through churn (docs/callers.md, docs/reliability.md): an instance killed
mid-stream gives its budget back at what it generated; a store frozen while requests settle, or down
for half a minute, loses and doubles no charge; instances whose clocks are 30 s apart agree on one
minute. Real app processes on the local host, a real Azurite, the scripted upstream."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import threading
import time
import uuid

import httpx
import pytest
from azure.core.exceptions import ResourceNotFoundError
from azure.data.tables import TableServiceClient
from helpers import app_env
from servers import Azurite

from chatstream.state.streamlog.format import EPOCH_IDS

MODEL = "gpt-test"


def env(upstream, azurite, **extra: str) -> dict[str, str]:
    return app_env(upstream, AzureWebJobsStorage=azurite.connection_string, CALLER_KEYS="required", **extra)


def caller(app, **spec) -> tuple[str, str, str]:
    who = f"churn-{secrets.token_hex(4)}"
    made = httpx.post(f"{app.url}/api/manage/callers", json={"name": who, **spec}, timeout=30)
    assert made.status_code == 201, made.text
    return who, made.json()["key"], made.json()["id"]


def two_instances(upstream, azurite, start_app, **spec) -> tuple:
    """Instances A and B on one storage account, and a caller made on A with ``spec``:
    ``(a, b, who, key, caller_id)``."""
    a = start_app(**env(upstream, azurite))
    b = start_app(**env(upstream, azurite))
    return a, b, *caller(a, **spec)


def ask(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def table(azurite, name: str):
    return TableServiceClient.from_connection_string(azurite.connection_string).get_table_client(name)


def ledger(azurite, caller_name: str) -> list[dict]:
    try:
        rows = table(azurite, "chatstreamUsage").query_entities("caller eq @c", parameters={"c": caller_name})
        return [{k: getattr(v, "value", v) for k, v in row.items()} for row in rows]
    except ResourceNotFoundError:
        return []


def counter(azurite, partition: str, row: str) -> tuple[int, int]:
    """A counter row's ``taken`` and what instances hold of it (the rest is spent)."""
    found = table(azurite, "chatstreamLimits").get_entity(partition, row)
    held = sum(int(item.split("=")[1].split("/")[0]) for item in (found.get("holds") or "").split())
    return int(getattr(found["taken"], "value", found["taken"])), held


def spent(rows: list[dict]) -> int:
    return sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)


def streams_on(
    app, key: str, body: dict, count: int, barrier: threading.Barrier | None = None
) -> list[threading.Thread]:
    """``count`` threads, each streaming ``body`` as a chat completion on ``app`` to its end, or until
    the instance is killed; with ``barrier``, each waits at it once its fifth line came (a few words in).
    Not started."""

    def one() -> None:
        try:
            with httpx.stream(
                "POST", f"{app.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=30
            ) as response:
                for n, _ in enumerate(response.iter_lines()):
                    if n == 4 and barrier is not None:
                        barrier.wait()
        except (httpx.HTTPError, threading.BrokenBarrierError):
            pass  # its instance was killed

    return [threading.Thread(target=one, daemon=True) for _ in range(count)]


@pytest.mark.alone
def test_a_killed_instances_budget_comes_back_at_what_it_generated(upstream, azurite, start_app):
    """Five streams on A, each reserving prompt + 4,096 of a month's budget; A is killed (host and
    worker) mid-stream. Within 60 s B, doing the duty, has settled them from A's journal: each in the
    ledger at what it had generated (``lost``), the budget row holding exactly that, nothing of A's."""
    a, b, who, key, caller_id = two_instances(
        upstream, azurite, start_app, token_budget=1_000_000, budget_period="month"
    )
    assert (
        httpx.post(f"{b.url}/api/v1/chat/completions", headers={"api-key": key}, json=ask("hi"), timeout=30).status_code
        == 200
    )
    words_in = threading.Barrier(6)
    streams = streams_on(a, key, ask(f"[scenario:slow] {uuid.uuid4().hex}", stream=True), 5, words_in)
    for thread in streams:
        thread.start()
    words_in.wait(timeout=30)  # every stream a few words in (however slow the machine made their start)
    time.sleep(0.75)  # a journal write after them (every 0.5 s), well before the streams' end (~1.6 s on)
    taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
    assert held >= 5 * 4096, (taken, held)
    a.stop(signal.SIGKILL)
    killed = time.monotonic()
    while True:
        rows = [r for r in ledger(azurite, who) if r["ended"] == "lost"]
        taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
        if len(rows) == 5 and held == 0:
            break
        assert time.monotonic() - killed < 60, (rows, taken, held)
        time.sleep(0.5)
    print(f"recovered {time.monotonic() - killed:.1f} s after the kill")
    everything = ledger(azurite, who)
    assert taken == spent(everything), "the budget row holds exactly what the ledger charged"
    assert all(0 < r["completion_tokens"] < 20 for r in rows), rows  # what was generated, not the 4,096 reserved


@pytest.mark.alone
@pytest.mark.timeout(300)
def test_a_store_frozen_while_requests_settle_never_lets_a_caller_past_its_budget(upstream, start_app):
    """The probe: rounds of 12 concurrent requests over two instances, the store stopped (SIGSTOP) for
    4 s as the first of a round ends. Before, writes that timed out but landed were given back twice
    and the caller ran to 372% of its budget. Now: the ledger never passes the budget, and the
    budget row equals the ledger once everything settled."""
    store = Azurite()
    try:
        a = start_app(**env(upstream, store))
        b = start_app(**env(upstream, store))
        budget = 2_400
        who, key, caller_id = caller(a, token_budget=budget, budget_period="month")
        refused = 0
        for round_ in range(12):
            statuses = asyncio.run(_round(a.url, b.url, key, store, freeze=round_ % 2 == 0))
            print(f"round {round_}: {statuses.count(200)} admitted, {statuses.count(429)} refused")
            refused += statuses.count(429)
            if statuses.count(200) == 0:
                break
        deadline = time.monotonic() + 60
        while True:
            rows = ledger(store, who)
            taken, held = counter(store, f"{who}|{caller_id}", "tokens")
            if held == 0 and taken == spent(rows):
                break
            if time.monotonic() > deadline:
                open("/tmp/churn_a.log", "w").write(a.log())
                open("/tmp/churn_b.log", "w").write(b.log())
            assert time.monotonic() < deadline, (taken, held, spent(rows), len(rows))
            time.sleep(0.5)
        assert spent(rows) <= budget, spent(rows)
        assert refused > 0, "the budget ran out: the caller was refused"
    finally:
        store.stop()


async def _round(a: str, b: str, key: str, store: Azurite, freeze: bool) -> list[int]:
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(i: int) -> int:
            url = (a, b)[i % 2] + "/api/v1/chat/completions"
            words = " ".join(["word"] * 60)  # a prompt of some size: the budget runs out within a few rounds
            body = ask(
                f"[scenario:slow] round {i} {words}" if i else f"[scenario:normal] first {words}",
                max_tokens=200,
                stream=True,
            )
            async with client.stream("POST", url, json=body, headers={"api-key": key}) as response:
                await response.aread()
                if i == 0 and freeze and response.status_code == 200:
                    os.kill(store.node_pid, signal.SIGSTOP)  # as the first request of the round ends
                    asyncio.get_running_loop().call_later(4.0, os.kill, store.node_pid, signal.SIGCONT)
                return response.status_code

        try:
            return list(await asyncio.gather(*(one(i) for i in range(12))))
        finally:
            await asyncio.sleep(4.2 if freeze else 0.2)
            os.kill(store.node_pid, signal.SIGCONT)


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_charges_wait_out_a_store_outage_and_none_is_lost(upstream, start_app):
    """The probe: a store down for over 25 s lost every charge made meanwhile. Now they wait, in the
    journal and the ledger's queue, and are all written once it is back."""
    store = Azurite()
    try:
        app = start_app(**env(upstream, store, CALLER_CACHE_SECONDS="30"))
        who, key, _ = caller(app)
        assert (
            httpx.post(
                f"{app.url}/api/v1/chat/completions", headers={"api-key": key}, json=ask("warm"), timeout=30
            ).status_code
            == 200
        )
        time.sleep(1.0)
        os.kill(store.node_pid, signal.SIGSTOP)
        try:
            with httpx.Client(timeout=30) as client:
                for i in range(20):  # admitted on what the instance knows; their charges cannot be written now
                    answer = client.post(
                        f"{app.url}/api/v1/chat/completions",
                        headers={"api-key": key},
                        json=ask(f"[scenario:normal] {i}"),
                    )
                    assert answer.status_code == 200, answer.text
            time.sleep(28)
        finally:
            os.kill(store.node_pid, signal.SIGCONT)
        deadline = time.monotonic() + 40
        while len(rows := ledger(store, who)) < 21:
            assert time.monotonic() < deadline, f"{len(rows)} of 21 charges written"
            time.sleep(0.5)
        assert len(rows) == 21, "none lost, none twice"
    finally:
        store.stop()


def test_instances_whose_clocks_are_30_s_apart_agree_on_the_minute(upstream, azurite, start_app):
    """Windows are the store's: a caller's minute limit refused on either instance says the same
    Retry-After, whatever the instances' own clocks say."""
    ahead = start_app(**env(upstream, azurite, CHATSTREAM_TEST_CLOCK_OFFSET_SECONDS="30"))
    behind = start_app(**env(upstream, azurite, CHATSTREAM_TEST_CLOCK_OFFSET_SECONDS="-30"))
    _, key, _ = caller(ahead, requests_per_minute=4)
    for attempt in range(3):
        statuses, waits = [], []
        for app in (ahead, behind, ahead, behind, ahead, behind):
            answer = httpx.post(
                f"{app.url}/api/v1/chat/completions", headers={"api-key": key}, json=ask("hi"), timeout=30
            )
            statuses.append(answer.status_code)
            if answer.status_code == 429:
                waits.append(int(answer.headers["Retry-After"]))
        if statuses.count(200) == 4 or attempt == 2:
            break
        time.sleep(max(waits or [1]) + 0.5)  # a window turned during the round: the next one
    assert statuses.count(200) == 4, statuses
    assert len(waits) == 2 and abs(waits[0] - waits[1]) <= 2, waits


@pytest.mark.alone
@pytest.mark.parametrize("period", ["total", "month"])
def test_a_killed_instances_requests_reach_the_usage_api(upstream, azurite, start_app, period):
    """What operators see: a caller with a token budget (total, or by month) streams 4 answers on A
    (max_tokens 2,000 each); A, which holds the duty, is SIGKILLed a few words in. B has served
    nothing but the admin API. Within 20 s B's usage API (JSON and CSV) has the 4 requests, ``lost``,
    at what they had generated, and B admits a request against the budget given back. (Before, B
    never joined the duty without a keyed request of its own: 0 requests after 90 s.)"""
    a, b, who, key, _ = two_instances(upstream, azurite, start_app, token_budget=20_000, budget_period=period)
    started = threading.Barrier(5, timeout=60)
    body = ask(f"[scenario:slow] {uuid.uuid4().hex}", stream=True, max_tokens=2_000)
    streams = streams_on(a, key, body, 4, started)
    for thread in streams:
        thread.start()
    started.wait()
    time.sleep(0.7)  # a journal write
    a.stop(signal.SIGKILL)
    killed = time.monotonic()
    while True:
        usage = httpx.get(f"{b.url}/api/manage/usage", params={"caller": who}, timeout=30)
        assert usage.status_code == 200, usage.text
        total = usage.json()["total"]
        if total.get("requests") == 4:
            break
        assert time.monotonic() - killed < 60, (usage.json(), ledger(azurite, who))
        time.sleep(1)
    print(f"in the usage API {time.monotonic() - killed:.1f} s after the kill: {total}")
    # A held the duty (it answered the admin API first): B takes it once A's row is past its lease,
    # not after 3 of the duty's ticks (30 s before). ~6 s here; the bound leaves room for a busy machine.
    assert time.monotonic() - killed < 20
    assert 0 < total["completion_tokens"] < 4 * 100, total
    assert [row["ended"] for row in usage.json()["data"]] == [{"lost": 4}], usage.json()["data"]
    csv = httpx.get(f"{b.url}/api/manage/usage", params={"caller": who, "format": "csv"}, timeout=30)
    assert csv.status_code == 200 and f"total,,,,4,{total['prompt_tokens']}," in csv.text, csv.text
    admitted = httpx.post(
        f"{b.url}/api/v1/chat/completions", headers={"api-key": key}, json=ask("hi", max_tokens=15_000), timeout=30
    )
    assert admitted.status_code == 200, admitted.text


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_a_stream_taken_over_twice_keeps_a_ledger_row_per_producer(azurite, start_app):
    """A keyed resumable stream whose producer A dies, whose first taker B dies too, and which C
    finishes: three producers, three upstream requests, and a ledger row for each producer's part
    (before, both continuations were written as segment 1: one row lost). The reader (from the start:
    the caller's 3 events were never stored, test_resumable) gets every id once, in order, and one
    final event; the budget row equals the ledger; nothing stays held."""
    from servers import Upstream

    upstream = Upstream("--scenario", "cadence", "--deltas", "120", "--interval-ms", "50")
    try:
        settings = {"RESUMABLE_STREAMS": "on", "RESUME_TTL_SECONDS": "60"}
        a, b, c = (start_app(**env(upstream, azurite, **settings)) for _ in range(3))
        who, key, caller_id = caller(a, token_budget=1_000_000, budget_period="month")
        for app in (a, b, c):  # each instance warm (its store clients, the tables)
            warm = httpx.post(f"{app.url}/api/chat", headers={"api-key": key}, json={"prompt": "warm"}, timeout=30)
            assert warm.status_code == 200, warm.text
        prompt = f"three producers {uuid.uuid4().hex}"
        base = upstream.count()  # the upstream's requests so far: from here on, this stream's only
        ids: list[int] = []
        with httpx.stream(
            "POST", f"{a.url}/api/chat", headers={"api-key": key}, json={"prompt": prompt}, timeout=30
        ) as response:
            assert response.status_code == 200
            stream_id = response.headers["x-stream-id"]
            for line in response.iter_lines():
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
                    if len(ids) == 3:
                        break
        a.stop(signal.SIGKILL)
        finals: list[str] = []
        ids = []

        def read_on(app, until) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not finals:
                headers = {"api-key": key, **({"Last-Event-ID": str(ids[-1])} if ids else {})}
                with httpx.stream("GET", f"{app.url}/api/streams/{stream_id}", headers=headers, timeout=60) as r:
                    if r.status_code != 200:
                        time.sleep(0.5)
                        continue
                    for line in r.iter_lines():
                        if line.startswith("id: ") and (not ids or int(line[4:]) > ids[-1]):
                            ids.append(int(line[4:]))
                        elif line in ("event: done", "event: error"):
                            finals.append(line[7:])
                        if until():
                            return
                if until():
                    return

        # B's reader finds A dead and B takes over; once B has stored some of its own, B dies.
        read_on(b, lambda: len(ids) >= 3 + 8 and upstream.count() >= base + 2)
        assert not finals and upstream.count() == base + 2, (finals, ids)
        b.stop(signal.SIGKILL)
        read_on(c, lambda: bool(finals))  # C's reader finds B dead: C takes over and finishes
        assert finals == ["done"], (finals, ids)
        assert ids == sorted(ids) and [i % EPOCH_IDS for i in ids] == list(range(1, len(ids) + 1)), ids
        assert upstream.count() == base + 3
        deadline = time.monotonic() + 60
        while True:
            rows = ledger(azurite, who)
            # The stream's request: the one whose rows go past the first producer's block.
            ours = {r["request_id"] for r in rows if int(r["segment"]) >= 20}
            segments = sorted(int(r["segment"]) for r in rows if r["request_id"] in ours)
            taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
            if len(segments) == 3 and held == 0 and taken == spent(rows):
                break
            assert time.monotonic() < deadline, (segments, [(r["request_id"], r["segment"], r["ended"]) for r in rows])
            time.sleep(0.5)
        assert len(ours) == 1 and segments == [0, 20, 40], segments  # A's, B's, C's
    finally:
        upstream.stop()


@pytest.mark.alone
def test_requests_an_instance_sent_upstream_just_before_it_died_are_in_the_ledger(upstream, azurite, start_app):
    """Five streams on A, four of them admitted within half a second of A's last journal write (the
    journal's pause); A is SIGKILLed the moment the upstream has all five, before their callers get
    their headers. Every request the upstream received is in the ledger (``lost``), the budget row
    equals the ledger, nothing held. (Before, a request admitted after the journal's last write
    was lost with its instance: 1 of 5 rows in 3 runs.)"""
    a, b, who, key, caller_id = two_instances(
        upstream, azurite, start_app, token_budget=1_000_000, budget_period="month"
    )
    for app in (a, b):  # each instance warm (its store clients, the tables; B takes the duty)
        warm = httpx.post(f"{app.url}/api/v1/chat/completions", headers={"api-key": key}, json=ask("hi"), timeout=30)
        assert warm.status_code == 200, warm.text
    time.sleep(1.0)  # the warm requests' charges settled and A's journal quiet
    base = upstream.count()
    threads = streams_on(a, key, ask(f"[scenario:slow] {uuid.uuid4().hex}", stream=True), 5)
    threads[0].start()
    deadline = time.monotonic() + 10
    while upstream.count() < base + 1:  # the first one's journal write, then the pause
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05)
    for thread in threads[1:]:
        thread.start()
    while upstream.count() < base + 5:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    a.stop(signal.SIGKILL)
    killed = time.monotonic()
    while True:
        rows = [r for r in ledger(azurite, who) if r["ended"] == "lost"]
        taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
        if len(rows) >= 5 and held == 0:
            break
        if time.monotonic() - killed > 60:
            break
        time.sleep(0.5)
    print(f"{len(rows)} lost rows {time.monotonic() - killed:.1f} s after the kill")
    assert len(rows) == 5, rows
    assert held == 0 and taken == spent(ledger(azurite, who)), (taken, held)


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_a_killed_streams_lost_part_is_charged_at_least_what_its_caller_received(azurite, start_app):
    """A keyed resumable /api/chat stream on A (1,000 deltas, one every 20 ms: 20 s); A is SIGKILLed
    the moment its caller has read 30 events, long before A's first write of the stream's log (5 s):
    the log holds nothing. The caller resumes on B with its Last-Event-ID: B takes the stream over,
    and the caller, holding events no log stored (the continuation's are other text), gets one final
    ``stream_lost`` (docs/api.md: send again), never other text. A's part is in the ledger (``lost``)
    at no less than the text its caller read, the budget row equals the ledger, nothing held. (Before,
    it stood at A's journal's last checkpoint, written up to 0.5 s before the kill: 0-25 deltas short;
    5 lost parts 26 tokens short in a chaos soak.) Nobody reads the continuation: its upstream call
    is closed once its log holds 30 events (what stands for the caller's, charged), seconds in, not
    run for nobody to the answer's end (20 s) or RESUME_ABANDON_SECONDS (30 s); a reader from the
    start gets it to that cut, ended ``cancelled``."""
    from servers import Upstream

    from chatstream import tokens

    upstream = Upstream("--scenario", "cadence", "--deltas", "1000", "--interval-ms", "20")
    try:
        settings = {"RESUMABLE_STREAMS": "on", "RESUME_TTL_SECONDS": "60"}
        a, b = (start_app(**env(upstream, azurite, **settings)) for _ in range(2))
        who, key, caller_id = caller(a, token_budget=1_000_000, budget_period="month")
        stream_id, ids, received, killed = _killed_after_30(a, (a, b), key)
        got = "".join(received)
        finals, codes = _final_events_resumed_on(b, stream_id, key, ids)  # B takes A's streams over
        assert finals == ["error"] and codes == ["stream_lost"], (finals, codes)
        assert ids[:30] == list(range(1, 31)) and len(ids) == 31 and ids[30] > 30, ids
        want = tokens.count_text(MODEL, got)
        deadline = time.monotonic() + 60
        while True:  # (B's raise of A's part to what its caller read is a correction of its own: it may land last)
            rows = ledger(azurite, who)
            lost = [r for r in rows if r["ended"] == "lost"]
            taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
            raised = bool(lost) and lost[0]["completion_tokens"] >= want
            if lost and raised and held == 0 and taken == spent(rows) and len(rows) == 2 + 2:
                break
            if time.monotonic() >= deadline:
                break  # (the assertions below say what is wrong)
            time.sleep(0.5)
        assert held == 0 and taken == spent(rows) and len(rows) == 2 + 2, (rows, taken, held)
        print(f"A's part charged {lost[0]['completion_tokens']} tokens; its caller read {want} ({len(ids)} events)")
        assert len(lost) == 1 and lost[0]["completion_tokens"] >= want, (lost, want)
        continued = [s for s in upstream.streams() if s["started_at"] > killed]
        assert len(continued) == 1 and continued[0]["ended_at"] is not None, continued
        ran = continued[0]["ended_at"] - continued[0]["started_at"]
        print(f"the continuation's upstream call closed after {ran:.1f} s ({continued[0]['outcome']})")
        assert continued[0]["outcome"] == "client_disconnected" and ran < 12, continued
        # A reader from the start still gets the stream: to the cut, ended as an abandoned one is.
        later = httpx.get(f"{b.url}/api/streams/{stream_id}", headers={"api-key": key}, timeout=30)
        lines = later.text.splitlines()
        assert later.status_code == 200 and sum(line.startswith("id: ") for line in lines) > 30, later.text[-300:]
        assert [line for line in lines if line.startswith("event: ")] == ["event: done"], later.text[-300:]
        assert json.loads(lines[lines.index("event: done") + 1][6:])["finish_reason"] == "cancelled"
    finally:
        upstream.stop()


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_a_lost_part_whose_continuation_is_refused_is_charged_at_least_a_token_per_event_its_caller_read(
    azurite, start_app
):
    """As above, and the caller's budget is spent when B takes the stream over (the admin cut it to
    1 token): the continuation is refused at admission, that refusal the final event in the log (the caller, past the stored end, gets ``stream_lost``), and nothing stands in for
    the 30 events it read past the stored end. B charges A's part
    all the same: /api/chat writes no event for an empty delta, so each of those is at least one
    token (before, A's part stood at A's journal's last checkpoint, up to 0.5 s of events short)."""
    from servers import Upstream

    upstream = Upstream("--scenario", "cadence", "--deltas", "1000", "--interval-ms", "20")
    try:
        settings = {"RESUMABLE_STREAMS": "on", "RESUME_TTL_SECONDS": "60"}
        a, b = (start_app(**env(upstream, azurite, **settings)) for _ in range(2))
        who, key, caller_id = caller(a, token_budget=1_000_000, budget_period="month")
        stream_id, ids, received, killed = _killed_after_30(a, (a, b), key)
        cut = httpx.patch(f"{b.url}/api/manage/callers/{who}", json={"token_budget": 1}, timeout=30)
        assert cut.status_code == 200, cut.text
        finals, codes = _final_events_resumed_on(b, stream_id, key, ids)  # B takes A's stream over
        assert finals == ["error"] and codes == ["stream_lost"], (finals, codes)  # (it holds unstored events)
        assert not [s for s in upstream.streams() if s["started_at"] > killed], "the continuation was called"
        later = httpx.get(f"{b.url}/api/streams/{stream_id}", headers={"api-key": key}, timeout=30)
        assert "insufficient_quota" in later.text.splitlines()[-2], later.text[-300:]  # a reader from the start
        deadline = time.monotonic() + 60
        while True:
            rows = ledger(azurite, who)
            lost = [r for r in rows if r["ended"] == "lost" and int(r.get("segment") or 0) == 0]
            taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
            if lost and held == 0 and taken == spent(rows) and lost[0]["completion_tokens"] >= len(received):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert lost and held == 0 and taken == spent(rows) and len(rows) == 2 + 1, (rows, taken, held)
        print(f"A's part charged {lost[0]['completion_tokens']} tokens; its caller read {len(received)} events")
        assert lost[0]["completion_tokens"] >= len(received), (lost, len(received))
    finally:
        upstream.stop()


def _final_events_resumed_on(app, stream_id: str, key: str, ids: list[int]) -> tuple[list[str], list[str]]:
    """The stream resumed on ``app`` after ``ids[-1]`` (the caller's position), once ``app`` takes it
    over (after the dead producer's lease: within 60 s): the names of its final events and the types
    of its errors after them; the ids it sends are added to ``ids``."""
    finals: list[str] = []
    codes: list[str] = []
    deadline = time.monotonic() + 60
    while not finals and time.monotonic() < deadline:
        headers = {"api-key": key, "Last-Event-ID": str(ids[-1])}
        with httpx.stream("GET", f"{app.url}/api/streams/{stream_id}", headers=headers, timeout=60) as r:
            if r.status_code != 200:
                time.sleep(0.5)
                continue
            for line in r.iter_lines():
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
                elif line in ("event: done", "event: error"):
                    finals.append(line[7:])
                elif line.startswith("data: ") and finals:
                    codes.append(str(json.loads(line[6:])["error"]["type"]))
    return finals, codes


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_a_lost_part_is_raised_to_what_its_caller_received_even_if_its_taker_dies_mid_continuation(azurite, start_app):
    """As above with three instances, and B, the taker, is SIGKILLed too once its continuation is
    past the caller's position (60 of its deltas sent: the stand-ins for the caller's 30 events
    and 0.6 s more), before the continuation stops (its young seconds, 2 s). A's part is charged at
    least what its caller read all the same (chaos seed 2027: 10 of 12, the raise made only at the
    continuation's end, which B did not live to see); C recovers A and B."""
    from servers import Upstream

    from chatstream import tokens

    upstream = Upstream("--scenario", "cadence", "--deltas", "1000", "--interval-ms", "20")
    try:
        settings = {"RESUMABLE_STREAMS": "on", "RESUME_TTL_SECONDS": "60"}
        a, b, c = (start_app(**env(upstream, azurite, **settings)) for _ in range(3))
        who, key, caller_id = caller(a, token_budget=1_000_000, budget_period="month")
        stream_id, ids, received, killed = _killed_after_30(a, (a, b, c), key)
        finals, _ = _final_events_resumed_on(b, stream_id, key, ids)
        assert finals == ["error"], finals
        deadline = time.monotonic() + 30
        while True:  # B's continuation past the caller's 30 events (and 0.6 s more), still running
            continued = [s for s in upstream.streams() if s["started_at"] > killed]
            if continued and len(continued[0]["content_sent_at"]) >= 60:
                break
            assert time.monotonic() < deadline, continued
            time.sleep(0.02)
        b.stop(signal.SIGKILL)
        assert upstream.streams() and continued[0]["ended_at"] is None, "the continuation stopped first"
        want = tokens.count_text(MODEL, "".join(received))
        deadline = time.monotonic() + 90
        while True:  # C recovers A and B
            rows = ledger(azurite, who)
            lost = [r for r in rows if r["ended"] == "lost" and int(r.get("segment") or 0) == 0]
            taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
            if lost and held == 0 and taken == spent(rows) and lost[0]["completion_tokens"] >= want:
                break
            assert time.monotonic() < deadline, (lost, want, taken, held)
            time.sleep(0.5)
        print(f"A's part charged {lost[0]['completion_tokens']} tokens; its caller read {want}")
    finally:
        upstream.stop()


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_a_killed_chat_completions_streams_lost_part_is_charged_at_least_what_its_caller_received(azurite, start_app):
    """As above on /api/v1/chat/completions (issue #45's first suspect, an off-by-one between its role
    chunk and the stand-ins' positions: ruled out): a 40-delta answer, one every 50 ms; A is
    SIGKILLed the moment its caller has read 28 deltas (its events 2..29, the role chunk first),
    before A's first write of the log. The caller resumes on B after its id: B takes over (its
    continuation's role chunk is event 1, as A's was), the caller gets ``stream_lost``, and the
    continuation (short) runs to its end. A's part is in the ledger at no less than the text its
    caller read, counted as the app counts it (as the chaos soak counts it)."""
    from servers import Upstream

    from chatstream import tokens

    upstream = Upstream("--scenario", "cadence", "--deltas", "40", "--interval-ms", "50")
    try:
        settings = {"RESUMABLE_STREAMS": "on", "RESUME_TTL_SECONDS": "60"}
        a, b = (start_app(**env(upstream, azurite, **settings)) for _ in range(2))
        who, key, caller_id = caller(a, token_budget=1_000_000, budget_period="month")
        for app in (a, b):  # each instance warm (its store clients, the tables); a short answer
            short = {"prompt": "warm [scenario:normal]"}
            warm = httpx.post(f"{app.url}/api/chat", headers={"api-key": key}, json=short, timeout=30)
            assert warm.status_code == 200, warm.text
        ids: list[int] = []
        received: list[str] = []
        body = ask(f"[scenario:cadence] {uuid.uuid4().hex}", stream=True, max_tokens=100)
        body["stream_options"] = {"include_usage": True}
        with httpx.stream(
            "POST", f"{a.url}/api/v1/chat/completions", headers={"api-key": key}, json=body, timeout=30
        ) as response:
            assert response.status_code == 200
            stream_id = response.headers["x-stream-id"]
            for line in response.iter_lines():
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
                elif line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices") or ():
                        received.append(str(choice.get("delta", {}).get("content") or ""))
                    if sum(1 for r in received if r) == 28:
                        a.stop(signal.SIGKILL)
                        break
        got = "".join(received)
        codes: list[str] = []
        deadline = time.monotonic() + 60
        while not codes and time.monotonic() < deadline:  # B takes A's streams over once A's lease is past
            headers = {"api-key": key, "Last-Event-ID": str(ids[-1])}
            with httpx.stream("GET", f"{b.url}/api/streams/{stream_id}", headers=headers, timeout=60) as r:
                if r.status_code != 200:
                    time.sleep(0.5)
                    continue
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        assert "error" in data, data  # never other text after the caller's own
                        codes.append(str(data["error"].get("code")))
        assert codes == ["stream_lost"], codes
        assert ids == list(range(1, 30)), ids
        want = tokens.count_text(MODEL, got)
        deadline = time.monotonic() + 60
        while True:  # (B's raise of A's part to what its caller read is a correction of its own: it may land last)
            rows = ledger(azurite, who)
            lost = [r for r in rows if r["ended"] == "lost"]
            taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
            raised = bool(lost) and lost[0]["completion_tokens"] >= want
            if lost and raised and held == 0 and taken == spent(rows) and len(rows) == 2 + 2:
                break
            if time.monotonic() >= deadline:
                break  # (the assertions below say what is wrong)
            time.sleep(0.5)
        assert held == 0 and taken == spent(rows) and len(rows) == 2 + 2, (rows, taken, held)
        print(f"A's part charged {lost[0]['completion_tokens']} tokens; its caller read {want} ({got!r})")
        assert len(lost) == 1 and lost[0]["completion_tokens"] >= want, (lost, want)
    finally:
        upstream.stop()


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_a_stream_handed_over_on_sigterm_is_charged_once_in_the_budget(azurite, start_app):
    """Keyed resumable /api/chat streams on A, A SIGTERMed a few events in: A hands each over, its
    reader resumes on B, B takes it over and charges A's part at what the log shows while A, still
    alive, settles the same part itself. The ledger has one row per producer's part, and the budget
    row (tokens) equals the ledger, nothing held. (Before, both charges entered the budget row: it
    stood one lost part per stream above the ledger.)"""
    from servers import Upstream

    upstream = Upstream("--scenario", "cadence", "--deltas", "60", "--interval-ms", "50")
    try:
        settings = {"RESUMABLE_STREAMS": "on", "RESUME_TTL_SECONDS": "60", "DRAIN_SECONDS": "1"}
        a = start_app(**env(upstream, azurite, **settings, ASPNETCORE_SHUTDOWNTIMEOUTSECONDS="10"))
        b = start_app(**env(upstream, azurite, **settings))
        who, key, caller_id = caller(a, token_budget=1_000_000, budget_period="total")
        for app in (a, b):
            warm = httpx.post(f"{app.url}/api/chat", headers={"api-key": key}, json={"prompt": "warm"}, timeout=30)
            assert warm.status_code == 200, warm.text
        started = threading.Barrier(4, timeout=60)
        finals: list[str] = []

        def one(i: int) -> None:
            ids: list[int] = []
            stream_id = ""
            with httpx.stream(
                "POST", f"{a.url}/api/chat", headers={"api-key": key}, json={"prompt": f"handed {i}"}, timeout=30
            ) as response:
                stream_id = response.headers["x-stream-id"]
                for line in response.iter_lines():
                    if line.startswith("id: "):
                        ids.append(int(line[4:]))
                        if len(ids) == 3:
                            started.wait()
            for _ in range(20):  # told to resume (stream_moved): on B, after the last id
                headers = {"api-key": key, "Last-Event-ID": str(ids[-1])}
                with httpx.stream("GET", f"{b.url}/api/streams/{stream_id}", headers=headers, timeout=60) as r:
                    if r.status_code == 200:
                        for line in r.iter_lines():
                            if line in ("event: done", "event: error"):
                                finals.append(line[7:])
                                return
                time.sleep(0.5)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(3)]
        for thread in threads:
            thread.start()
        started.wait()
        a.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(90)
        assert finals == ["done"] * 3, finals
        deadline = time.monotonic() + 60
        while True:
            rows = ledger(azurite, who)
            taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
            if held == 0 and taken == spent(rows) and len(rows) >= 2 + 3 * 2:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print(f"{len(rows)} rows, budget row {taken} (held {held}), ledger {spent(rows)}")
        assert held == 0 and taken == spent(rows), (taken, held, spent(rows))
        assert len(rows) == 2 + 3 * 2, [(r["request_id"], r["segment"], r["ended"], r["author"]) for r in rows]
    finally:
        upstream.stop()


def _killed_after_30(a, apps, key: str) -> tuple[str, list[int], list[str], float]:
    """Each of ``apps`` warm (its store clients, the tables: a short answer); then a long /api/chat
    answer on ``a``, read to its 30th event, and ``a`` SIGKILLed: the stream's id, the ids and
    deltas its caller read, and when ``a`` was killed (time.time())."""
    for app in apps:
        short = {"prompt": "warm [scenario:normal]"}
        warm = httpx.post(f"{app.url}/api/chat", headers={"api-key": key}, json=short, timeout=30)
        assert warm.status_code == 200, warm.text
    ids: list[int] = []
    received: list[str] = []
    with httpx.stream(
        "POST", f"{a.url}/api/chat", headers={"api-key": key}, json={"prompt": uuid.uuid4().hex}, timeout=30
    ) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-stream-id"]
        for line in response.iter_lines():
            if line.startswith("id: "):
                ids.append(int(line[4:]))
            elif line.startswith("data: "):
                received.append(str(json.loads(line[6:]).get("delta") or ""))
                if len(ids) == 30:
                    a.stop(signal.SIGKILL)
                    return stream_id, ids, received, time.time()
    raise AssertionError(f"the answer ended after {len(ids)} events, before its 30th")


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_a_lost_part_is_raised_to_what_its_caller_received_when_its_taker_is_sigtermed(azurite, start_app):
    """As above, and B, the taker, gets SIGTERM (a deploy) the moment its continuation's upstream call
    starts, before the continuation has regenerated the caller's 30 events (what raises A's part to
    what its caller read). B serves no request then, so its host kills its worker ~0.5 s after the
    SIGTERM, too soon for the continuation: B's drain writes its journal at once and as the
    stand-ins come, with what B knows of A's part (the stand-ins' text, each event not stood in for
    yet at one token). C recovers B and raises A's part to it: at least what its caller read; the
    budget row equals the ledger. (Before, the drain handed the stream over at once, the raise was
    cancelled, and nothing said so: A's part stayed at what the log held; then, B's log said what it
    had not charged, and the part stayed short.)"""
    from servers import Upstream

    from chatstream import tokens

    upstream = Upstream("--scenario", "cadence", "--deltas", "1000", "--interval-ms", "20")
    try:
        settings = {"RESUMABLE_STREAMS": "on", "RESUME_TTL_SECONDS": "60"}
        a, b, c = (start_app(**env(upstream, azurite, **settings)) for _ in range(3))
        who, key, caller_id = caller(a, token_budget=1_000_000, budget_period="month")
        stream_id, ids, received, killed = _killed_after_30(a, (a, b, c), key)
        finals, _ = _final_events_resumed_on(b, stream_id, key, ids)
        assert finals == ["error"], finals
        continued = [s for s in upstream.streams() if s["started_at"] > killed]
        deadline = time.monotonic() + 30
        while not continued:  # (the reader may end before the continuation's call starts)
            assert time.monotonic() < deadline, "B's continuation never started"
            time.sleep(0.01)
            continued = [s for s in upstream.streams() if s["started_at"] > killed]
        b.proc.send_signal(signal.SIGTERM)
        sent = len(continued[0]["content_sent_at"])
        print(f"B SIGTERMed {sent} deltas into its continuation")
        assert sent < 30, "the continuation had regenerated the caller's events before the SIGTERM"
        assert b.proc.wait(30) is not None
        want = tokens.count_text(MODEL, "".join(received))
        deadline = time.monotonic() + 90
        while True:  # C recovers what A and B left
            rows = ledger(azurite, who)
            lost = [r for r in rows if r["ended"] == "lost" and int(r.get("segment") or 0) == 0]
            taken, held = counter(azurite, f"{who}|{caller_id}", "tokens")
            if lost and held == 0 and taken == spent(rows) and lost[0]["completion_tokens"] >= want:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert lost and held == 0 and taken == spent(rows), (rows, taken, held)
        charged = lost[0]["completion_tokens"]
        print(f"A's part charged {charged} tokens; its caller read {want}")
        print("\n".join(line for line in b.log().splitlines() if "WARNING" in line or "ERROR" in line)[-4000:])
        assert charged >= want, (charged, want)
    finally:
        upstream.stop()
