"""Resumable streams end to end (RESUMABLE_STREAMS=on, docs/resumable.md): two app instances on one
real Azurite and one scripted upstream that streams slowly enough to be cut; streams dropped on one
instance and resumed on the other, cancelled, abandoned, their producer killed, and many at once."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest
from helpers import app_env
from servers import App, Upstream

from tools.fakeupstream.scenarios import cadence_text

DELTAS = 60  # the upstream's cadence stream: 60 words, the first after 100 ms, then one every 40 ms


@pytest.fixture(scope="module")
def slow_upstream():
    server = Upstream("--scenario", "cadence", "--deltas", str(DELTAS), "--interval-ms", "40")
    yield server
    server.stop()


def resumable_env(upstream, azurite, **extra: str) -> dict[str, str]:
    return app_env(upstream, AzureWebJobsStorage=azurite.connection_string, RESUMABLE_STREAMS="on", **extra)


@pytest.fixture(scope="module")
def pair(slow_upstream, azurite):
    a = App(resumable_env(slow_upstream, azurite, RESUME_TTL_SECONDS="4"))
    b = App(resumable_env(slow_upstream, azurite, RESUME_TTL_SECONDS="4"))
    yield a, b
    a.stop()
    b.stop()


def events(text: str) -> list[tuple[int, str, str]]:
    """(id, event name, data) of each event in an SSE text (keep-alives have no id: left out)."""
    found = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line and not line.startswith(":"))
        if "id" in fields:
            found.append((int(fields["id"]), fields.get("event", "message"), fields.get("data", "")))
    return found


def chat_text(evs) -> str:
    return "".join(json.loads(d)["delta"] for _, name, d in evs if name == "message")


def read_some(url: str, body: dict, count: int, headers: dict | None = None) -> tuple[str, list]:
    """Start a stream, read ``count`` events, hang up: (stream id, the events read)."""
    got = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        stream_id = response.headers["x-stream-id"]
        buffer = ""
        for piece in response.iter_text():
            buffer += piece
            got = events(buffer.rsplit("\n\n", 1)[0] + "\n\n") if "\n\n" in buffer else []
            if len(got) >= count:
                break
    return stream_id, got[:count]


def resume(app: App, stream_id: str, after: int | None, headers: dict | None = None) -> httpx.Response:
    extra = {"Last-Event-ID": str(after)} if after is not None else {}
    return httpx.get(f"{app.url}/api/streams/{stream_id}", headers={**extra, **(headers or {})}, timeout=60)


def test_dropped_on_one_instance_resumed_on_the_other_exactly_once(pair, slow_upstream):
    a, b = pair
    marker = f"m{time.time_ns()}"
    stream_id, first = read_some(a.chat_url, {"prompt": f"go {marker}"}, 10)
    assert [i for i, _, _ in first] == list(range(1, 11))
    rest = events(resume(b, stream_id, first[-1][0]).text)
    whole = first + rest
    assert [i for i, _, _ in whole] == list(range(1, len(whole) + 1)), "every event once, in order"
    assert chat_text(whole) == cadence_text(DELTAS)
    finals = [(name, json.loads(d)) for _, name, d in whole if name in ("done", "error")]
    assert len(finals) == 1 and finals[0][0] == "done" and finals[0][1]["stream_id"] == stream_id
    record = slow_upstream.wait_stream_end("cadence", timeout=10)
    assert record["outcome"] == "completed", "the hang-up did not stop the generation"
    sent = [r for r in slow_upstream.requests(last=20) if marker in json.dumps(r.get("json"))]
    assert len(sent) == 1, "one upstream request for the whole answer"


def test_three_drops_in_one_answer(pair):
    a, b = pair
    stream_id, got = read_some(a.chat_url, {"prompt": "three drops"}, 5)
    for app in (b, a, b):  # read a few, hang up, go on elsewhere
        last = got[-1][0]
        with httpx.stream(
            "GET", f"{app.url}/api/streams/{stream_id}", headers={"Last-Event-ID": str(last)}, timeout=30
        ) as response:
            buffer = ""
            for piece in response.iter_text():
                buffer += piece
                new = events(buffer.rsplit("\n\n", 1)[0] + "\n\n") if "\n\n" in buffer else []
                if len(new) >= 5:
                    got += new[:5]
                    break
    got += events(resume(a, stream_id, got[-1][0]).text)
    assert [i for i, _, _ in got] == list(range(1, len(got) + 1))
    assert chat_text(got) == cadence_text(DELTAS) and got[-1][1] == "done"


def test_the_chat_completions_route_resumes_in_its_own_format(pair):
    a, b = pair
    body = {"messages": [{"role": "user", "content": "completions"}], "stream": True}
    stream_id, first = read_some(a.url + "/api/v1/chat/completions", body, 4)
    rest = events(resume(b, stream_id, first[-1][0]).text)
    chunks = [json.loads(d) for _, _, d in first + rest if d != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == cadence_text(DELTAS) and rest[-1][2] == "[DONE]"


def test_cancel_on_the_other_instance_closes_the_upstream_within_a_second(pair, slow_upstream):
    a, b = pair
    stream_id, _ = read_some(a.chat_url, {"prompt": "cancel me"}, 2)
    asked = time.monotonic()
    answer = httpx.post(f"{b.url}/api/streams/{stream_id}/cancel", timeout=30)
    assert answer.status_code == 200 and answer.json()["cancelled"] is True
    record = slow_upstream.wait_stream_end("cadence", timeout=5)
    assert (
        record["outcome"] == "client_disconnected" and record["ended_at"] - time.time() + time.monotonic() - asked < 1.0
    )
    final = events(resume(b, stream_id, None).text)[-1]
    assert final[1] == "done" and json.loads(final[2])["finish_reason"] == "cancelled"


def test_a_stream_nobody_reads_is_abandoned(slow_upstream, azurite, start_app):
    app = start_app(**resumable_env(slow_upstream, azurite, RESUME_ABANDON_SECONDS="1"))
    slow = {"prompt": "abandon me"}
    read_some(app.chat_url, slow, 1)
    left = time.monotonic()
    record = slow_upstream.wait_stream_end("cadence", timeout=5)
    assert record["outcome"] == "client_disconnected", "abandoned: the upstream was closed"
    assert time.monotonic() - left < 1 + 2


def test_a_producer_that_dies_ends_every_reader_with_stream_lost(slow_upstream, azurite, start_app):
    a = start_app(**resumable_env(slow_upstream, azurite, RESUME_TTL_SECONDS="3"))
    b = start_app(**resumable_env(slow_upstream, azurite, RESUME_TTL_SECONDS="3"))
    stream_id, first = read_some(a.chat_url, {"prompt": "kill the producer"}, 3)
    worker = httpx.get(a.url + "/_devhost/stats", timeout=10).json()["workers"][0]["pid"]
    with httpx.stream(
        "GET", f"{b.url}/api/streams/{stream_id}", headers={"Last-Event-ID": "3"}, timeout=30
    ) as response:
        buffer = ""
        killed = None
        for piece in response.iter_text():
            buffer += piece
            if killed is None and buffer.count("\n\n") >= 2:
                os.kill(worker, signal.SIGKILL)
                killed = time.monotonic()
    ended = time.monotonic() - killed
    last = events(buffer)[-1]
    assert last[1] == "error" and json.loads(last[2])["error"]["type"] == "stream_lost", buffer[-300:]
    assert json.loads(last[2])["error"]["retryable"] is True and ended < 10
    time.sleep(3 + 2)  # past the TTL (and a sweep)
    assert resume(b, stream_id, None).status_code == 404


@pytest.mark.parametrize("value", ["-1", "abc", "1e3", "9" * 16, "12x", "0x10"])
def test_a_bad_last_event_id_is_a_400(pair, value):
    a, _ = pair
    stream_id, _ = read_some(a.chat_url, {"prompt": "bad ids"}, 1)
    answer = httpx.get(f"{a.url}/api/streams/{stream_id}", headers={"Last-Event-ID": value}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert httpx.get(f"{a.url}/api/streams/{stream_id}", params={"last_event_id": value}, timeout=30).status_code == 400


def test_past_the_end_and_unknown_ids_are_4xx_never_5xx(pair):
    a, b = pair
    stream_id, _ = read_some(a.chat_url, {"prompt": "past the end"}, 1)
    whole = events(resume(a, stream_id, None).text)
    assert resume(b, stream_id, whole[-1][0]).status_code == 200  # nothing after the last: an empty resume
    assert resume(b, stream_id, whole[-1][0] + 5).status_code == 400
    for bad in ("nope", "A" * 30, "A" * 200, "A%20B"):
        answer = httpx.get(f"{a.url}/api/streams/{bad}", timeout=30)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", bad
    for bad in ("A%0D%0AB", "%2E%2E", "..%2F..%2Fetc", "a/b"):  # no route matches: the host's own 404, never a 5xx
        assert httpx.get(f"{a.url}/api/streams/{bad}", timeout=30).status_code == 404
    assert httpx.post(f"{a.url}/api/streams/{'A' * 22}/cancel", timeout=30).status_code == 404


def test_a_resume_of_a_stream_still_starting_replays_it_from_the_start(pair):
    a, b = pair
    with httpx.stream("POST", a.chat_url, json={"prompt": "early"}, timeout=30) as response:
        stream_id = response.headers["x-stream-id"]  # the headers go out with the first output
        replay = resume(b, stream_id, None)
    evs = events(replay.text)
    assert replay.status_code == 200 and chat_text(evs) == cadence_text(DELTAS) and evs[-1][1] == "done"


def test_with_caller_keys_only_the_streams_caller_resumes_or_cancels_it(slow_upstream, azurite, start_app):
    app = start_app(**resumable_env(slow_upstream, azurite, CALLER_KEYS="required"))
    keys = [
        httpx.post(app.url + "/api/manage/callers", json={"name": f"r-{time.time_ns()}-{i}"}, timeout=30).json()["key"]
        for i in range(2)
    ]
    mine, theirs = ({"api-key": k} for k in keys)
    stream_id, first = read_some(app.chat_url, {"prompt": "mine"}, 2, headers=mine)
    assert resume(app, stream_id, 2, headers=theirs).status_code == 404
    assert httpx.post(f"{app.url}/api/streams/{stream_id}/cancel", headers=theirs, timeout=30).status_code == 404
    assert resume(app, stream_id, 2).status_code == 401
    rest = events(resume(app, stream_id, 2, headers=mine).text)
    assert chat_text(first + rest) == cadence_text(DELTAS)


def worker_figures(app: App) -> dict:
    stats = httpx.get(app.url + "/_devhost/stats", timeout=10).json()
    return {
        "in_flight": sum(w["in_flight"] for w in stats["workers"]),
        "tasks": stats["tasks"],
        "open_fds": stats["open_fds"],
    }


@pytest.fixture(scope="module")
def paced_upstream():
    """40 words 200 ms apart: 200 such streams at once are 1,000 deltas a second through the apps.
    At 100 ms apart (2,000 a second) the two cores were saturated by the two instances, Azurite and
    this client: Azurite then answered in seconds, heartbeats missed their lease, and a live
    producer could be taken for dead (a stream_lost for a stream that ended well). This test is
    about exactness and cleanup under load and drops, not the machine's ceiling (make bench is)."""
    server = Upstream("--scenario", "cadence", "--deltas", "40", "--interval-ms", "200")
    yield server
    server.stop()


@pytest.mark.alone
def test_200_concurrent_streams_with_random_drops_and_resumes_are_all_exact(paced_upstream, azurite, start_app):
    """Issue #21's load test: 200 resumable streams at once over two instances, each dropped after a
    random number of events (or read to its end) and resumed on the other instance; a 503 (the
    instance too busy to reach the store within the 1.8 s bound) is retried after its Retry-After,
    as a client does."""
    # A TTL long enough for a resume that this loaded machine delays (a stream that ended longer ago
    # than the TTL is rightly gone), short enough to see the rows deleted.
    a, b = (start_app(**resumable_env(paced_upstream, azurite, RESUME_TTL_SECONDS="12")) for _ in range(2))
    deltas = 40
    rng = random.Random(2121)
    count = 200
    before = [worker_figures(app) for app in (a, b)]
    retried = []

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str]:
        apps = [a, b]
        got: list = []
        await asyncio.sleep(i * 0.01)  # arrivals over 2 s (each stream lasts 8 s or more): all 200 at once
        started_at = time.time()
        async with client.stream("POST", apps[i % 2].chat_url, json={"prompt": f"many {i}"}) as response:
            stream_id = response.headers["x-stream-id"]
            buffer = ""
            drop_after = rng.randint(1, deltas + 5)
            async for piece in response.aiter_text():
                # Only the whole events that arrived now are parsed (this client shares the two cores).
                whole, sep, buffer = (buffer + piece).rpartition("\n\n")
                got += events(whole + sep) if sep else []
                if len(got) >= drop_after:
                    got = got[:drop_after]
                    break
        if got and got[-1][1] == "done":
            return stream_id, chat_text(got)
        other = apps[(i + 1) % 2]
        for _ in range(10):
            response = await client.get(
                f"{other.url}/api/streams/{stream_id}", headers={"Last-Event-ID": str(got[-1][0]) if got else "0"}
            )
            if response.status_code != 503:
                break
            retried.append(i)
            await asyncio.sleep(float(response.headers["retry-after"]))
        rest = events(response.text)
        if response.status_code != 200 or not rest:
            tag = stream_id[8:14]
            said = [line for app in apps for line in app.log().splitlines() if tag in line or "WARNING" in line]
            raise AssertionError(
                (i, response.status_code, response.text[:200], f"{time.time() - started_at:.1f} s", said[-10:])
            )
        assert [e[0] for e in got + rest] == list(range(1, len(got) + len(rest) + 1)), i
        if rest[-1][1] != "done":
            tag = stream_id[8:14]
            said = [line for app in apps for line in app.log().splitlines() if tag in line or "WARNING" in line]
            raise AssertionError((i, rest[-1], f"{time.time() - started_at:.1f} s", said[-10:]))
        return stream_id, chat_text(got + rest)

    async def run():
        limits = httpx.Limits(max_connections=count * 2 + 10)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(count)))

    started = time.monotonic()
    done = asyncio.run(run())
    took = time.monotonic() - started
    assert all(text == cadence_text(deltas) for _, text in done)
    warned = [line for app in (a, b) for line in app.log().splitlines() if "WARNING" in line]
    print(f"\n{count} streams, {len(retried)} resumes retried after a 503, {took:.1f} s, {len(warned)} warnings")
    print("\n".join(warned[:10]))
    # Back to the baseline: no request in flight, no task or descriptor left behind.
    deadline = time.monotonic() + 15
    while True:
        after = [worker_figures(app) for app in (a, b)]
        settled = all(
            x["in_flight"] == 0 and x["tasks"] <= y["tasks"] + 5 and x["open_fds"] <= y["open_fds"] + 10
            for x, y in zip(before, after, strict=True)
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert settled, (before, after)
    # After the TTL and a sweep (every TTL / 4), nothing of them is left in the store.
    ids = {stream_id for stream_id, _ in done}
    deadline = time.monotonic() + 12 + 20
    while True:
        rows, blobs = stored(azurite, ids)
        if (not rows and not blobs) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not rows and not blobs, (len(rows), len(blobs))


def stored(azurite, ids: set[str]) -> tuple[list, list]:
    """The Streams table's rows and the container's blobs that belong to streams in ``ids``."""
    from azure.data.tables import TableServiceClient
    from azure.storage.blob import BlobServiceClient

    table = TableServiceClient.from_connection_string(azurite.connection_string).get_table_client("chatstreamStreams")
    rows = [
        r
        for r in table.list_entities(select=["PartitionKey", "RowKey"])
        if r["PartitionKey"] in ids or any(i in r["RowKey"] for i in ids)
    ]
    container = BlobServiceClient.from_connection_string(azurite.connection_string).get_container_client(
        "chatstream-streams"
    )
    blobs = [blob.name for blob in container.list_blobs() if blob.name in ids]
    return rows, blobs
