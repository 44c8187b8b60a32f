"""A deploy or a restart, end to end: SIGTERM to the local host (which delivers it as the Functions
host and the platform do: tools/devhost/README.md, "Stopping") with 20 streams in flight through the
real worker. Within the grace every stream finishes as usual; past it each one still running ends
with exactly one retryable ``instance_draining`` event, its upstream closed; nothing hangs; the host
leaves within its bound; a request during the drain is refused (by the host, or by the app with a
retryable 503); DRAIN_SECONDS is checked at start-up (chatstream/lifecycle.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from chat import prompt
from helpers import app_env
from httpx_sse import EventSource
from servers import App, Upstream, run_devhost

from tools.fakeupstream.scenarios import SLOW_DELTAS, cadence_text

STREAMS = 20
SLOW_TEXT = "".join(SLOW_DELTAS)


@pytest.fixture(scope="module")
def long_upstream():
    """The scripted upstream with a long ``cadence``: 200 words 50 ms apart (10 s)."""
    server = Upstream("--deltas", "200", "--interval-ms", "50")
    yield server
    server.stop()


class Reader(threading.Thread):
    """One streamed request in a thread: its events as they arrive (or its status and body)."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.status: int | None = None
        self.events: list[tuple[str, dict]] = []
        self.error: Exception | None = None
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=30) as r:
                self.status = r.status_code
                for sse in EventSource(r).iter_sse():
                    self.events.append((sse.event, json.loads(sse.data) if sse.data.startswith("{") else sse.data))
                    self.first.set()
        except Exception as exc:  # kept for the assertion
            self.error = exc
        self.first.set()

    @property
    def text(self) -> str:
        return "".join(d["delta"] for e, d in self.events if e == "message")

    def finals(self) -> list[tuple[str, dict]]:
        return [(e, d) for e, d in self.events if e in ("done", "error")]


def start_streams(app: App, scenario: str, count: int = STREAMS) -> list[Reader]:
    readers = [Reader(app.chat_url, prompt(scenario, f"stream {i}")) for i in range(count)]
    for reader in readers:
        assert reader.first.wait(30), "a stream never started"
        assert reader.error is None and reader.status == 200, (reader.status, reader.error)
    return readers


def test_streams_that_can_finish_within_the_grace_finish_as_usual(upstream):
    app = App(app_env(upstream, DRAIN_SECONDS="10", ASPNETCORE_SHUTDOWNTIMEOUTSECONDS="15"))
    try:
        readers = start_streams(app, "slow")  # 2 s each
        sent = time.monotonic()
        app.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # the host takes no new connection (Kestrel's way)
            httpx.post(app.chat_url, json=prompt("slow"), timeout=5)
        for reader in readers:
            reader.join(15)
        last_end = time.monotonic() - sent
        app.proc.wait(15)
        exited = time.monotonic() - sent
    finally:
        app.stop()
    for reader in readers:
        assert not reader.is_alive() and reader.error is None, reader.error
        assert reader.text == SLOW_TEXT
        assert [e for e, _ in reader.finals()] == ["done"] and reader.finals()[0][1]["finish_reason"] == "stop"
    assert exited < last_end + 3.0, f"the host left {exited - last_end:.1f} s after its last stream ended"
    assert "drained in" in app.log()


def test_past_the_grace_each_stream_ends_with_one_retryable_instance_draining_event(long_upstream):
    app = App(app_env(long_upstream, DRAIN_SECONDS="1"))  # the host's timeout: its default, 5 s
    try:
        readers = start_streams(app, "cadence")  # 10 s each
        sent = time.monotonic()
        app.proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(15)
        app.proc.wait(15)
        exited = time.monotonic() - sent
    finally:
        app.stop()
    full = cadence_text(200)
    for reader in readers:
        assert not reader.is_alive(), "a stream hangs"
        assert reader.error is None, reader.error
        finals = reader.finals()
        assert len(finals) == 1 and finals[-1] == reader.events[-1], reader.events[-3:]
        event, data = finals[0]
        assert event == "error" and data["error"]["type"] == "instance_draining" and data["error"]["retryable"]
        assert reader.text and full.startswith(reader.text) and reader.text != full
    assert exited < 1 + 4.0, f"the host left {exited:.1f} s after SIGTERM (grace 1 s)"
    log = app.log()
    assert log.count('"error": "instance_draining"') == STREAMS, "one log line each, with the reason"
    assert '"disconnected": true' not in log
    # Each upstream stream was closed at the cut (that is what stops the paid generation).
    records = [s for s in long_upstream.streams() if s["scenario"] == "cadence"][-STREAMS:]
    assert all(s["outcome"] == "client_disconnected" for s in records), [s["outcome"] for s in records]


def test_a_worker_sent_sigterm_refuses_new_requests_with_a_retryable_503_and_finishes_its_streams(upstream):
    """The platform's container stop signals the worker too; a request that still reaches it (here:
    the host was not signalled) gets the app's answer before any upstream call."""
    app = App(app_env(upstream, DRAIN_SECONDS="4"))
    try:
        worker = httpx.get(app.url + "/_devhost/stats", timeout=10).json()["workers"][0]["pid"]
        readers = start_streams(app, "slow", 3)
        calls = upstream.count()
        os.kill(worker, signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(app.chat_url, json=prompt("slow", "late"), timeout=10)
        assert upstream.count() == calls, "no upstream call for a refused request"
        for reader in readers:
            reader.join(15)
        # Then the runtime's own handling: its server stops, the process ends by SIGTERM, the host
        # starts another worker.
        app.wait_log(rf"worker 1 \(pid {worker}\) exited \(killed by SIGTERM\)", timeout=15)
    finally:
        app.stop()
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "instance_draining" and refused.json()["error"]["retryable"]
    assert refused.headers["retry-after"] == "1" and refused.headers["x-should-retry"] == "true"
    for reader in readers:
        assert reader.text == SLOW_TEXT and [e for e, _ in reader.finals()] == ["done"]


def test_an_openai_stream_past_the_grace_ends_with_one_error_chunk(long_upstream):
    app = App(app_env(long_upstream, DRAIN_SECONDS="1"))
    body = {"model": "cadence", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    data: list[str] = []
    try:
        with httpx.stream("POST", app.url + "/api/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                    if len(data) == 3:
                        app.proc.send_signal(signal.SIGTERM)
        app.proc.wait(15)
    finally:
        app.stop()
    errors = [json.loads(d) for d in data if d.startswith('{"error"')]
    assert len(errors) == 1 and data[-1].startswith('{"error"') and "[DONE]" not in data
    assert errors[0]["error"]["code"] == "instance_draining" and errors[0]["error"]["type"] == "server_error"


@pytest.mark.parametrize("value", ["-1", "231", "soon"])
def test_a_bad_drain_seconds_stops_the_app_naming_the_setting(value):
    result = run_devhost({"DRAIN_SECONDS": value, "OPENAI_API_KEY": "sk-x"})
    assert result.returncode == 1
    assert "DRAIN_SECONDS" in result.stderr


@pytest.mark.alone
@pytest.mark.timeout(240)
def test_resumable_streams_are_handed_over_on_sigterm_and_none_is_lost(long_upstream, azurite, start_app):
    """A deploy that recreates an instance, with resumable streams and caller keys: SIGTERM to A with
    20 streams in flight. Past its grace A hands each stream over (a mark in its log) and tells its
    live callers to resume; each client (openai-python's transport of clients/python, pointed at B)
    resumes on B, which takes the stream over at once and goes on with the answer. Every answer is
    exact, with one final event; the ledger holds every request."""
    import openai
    from chatstream_client import ResumingTransport

    env = {
        "AzureWebJobsStorage": azurite.connection_string,
        "RESUMABLE_STREAMS": "on",
        "CALLER_KEYS": "required",
        "DRAIN_SECONDS": "1",
    }
    a = start_app(**app_env(long_upstream, **env, ASPNETCORE_SHUTDOWNTIMEOUTSECONDS="10"))
    b = start_app(**app_env(long_upstream, **env))
    name = f"drain-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    made = httpx.post(f"{a.url}/api/manage/callers", json={"name": name}, timeout=30)
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    texts: list[str | None] = [None] * STREAMS
    finishes: list[list[str]] = [[] for _ in range(STREAMS)]
    started = threading.Barrier(STREAMS + 1, timeout=60)

    def one(i: int) -> None:
        transport = ResumingTransport(streams_url=f"{b.url}/api/streams/{{id}}")
        client = openai.OpenAI(
            base_url=a.url + "/api/v1",
            api_key=key,
            http_client=httpx.Client(transport=transport, timeout=60),
            max_retries=0,
        )
        text = ""
        stream = client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": f"[scenario:cadence] {i}"}], stream=True
        )
        for n, chunk in enumerate(stream):
            if n == 1:
                started.wait()
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[i].append(choice.finish_reason)
        texts[i] = text

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    started.wait()
    a.proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(120)
    expected = cadence_text(200)
    assert all(t == expected for t in texts), [None if t is None else len(t) for t in texts]
    assert all(f == ["stop"] for f in finishes), finishes
    assert a.proc.wait(30) is not None
    service = __import__("azure.data.tables", fromlist=["TableServiceClient"]).TableServiceClient
    table = service.from_connection_string(azurite.connection_string).get_table_client("chatstreamUsage")
    deadline = time.monotonic() + 60
    while True:  # each went on on B: its lost part (segment 0) and its continuation (1) are two rows
        rows = list(table.query_entities("caller eq @c", parameters={"c": name}))
        requests = {row["request_id"] for row in rows}
        continued = {row["request_id"] for row in rows if int(getattr(row["segment"], "value", row["segment"])) >= 1}
        if len(requests) == len(continued) == STREAMS:
            break
        assert time.monotonic() < deadline, f"{len(requests)} requests, {len(continued)} continued in the ledger"
        time.sleep(0.5)


class DocsClient(threading.Thread):
    """A streamed chat completion read as docs/api.md ("Resuming a stream") tells a client to: keep
    the stream id and the last event id handled; when the body ends before ``[DONE]`` (a cut, or an
    id-less ``stream_moved``/``stream_store_unavailable`` event), ``GET /api/streams/ID`` with
    ``Last-Event-ID``; handle an event only if its own id is above the last one handled. Plain httpx
    and a line parser: no SDK, no transport of ours."""

    READING_ENDS = ("stream_moved", "stream_store_unavailable")

    def __init__(self, url: str, resume_url: str, key: str, content: str):
        super().__init__(daemon=True)
        self.url, self.resume_url, self.content = url, resume_url, content
        self.headers = {"Authorization": f"Bearer {key}"}
        self.text, self.finishes, self.readings_ended, self.final_errors = "", [], [], []
        self.stream_id: str | None = None
        self.last = 0
        self.deltas = 0
        self.done = False
        self.resumes = 0
        self.start()

    def run(self) -> None:
        body = {"model": "gpt-test", "stream": True, "messages": [{"role": "user", "content": self.content}]}
        try:
            with httpx.stream("POST", self.url, json=body, headers=self.headers, timeout=30) as r:
                assert r.status_code == 200, r.read()
                self.stream_id = r.headers["x-stream-id"]
                self.read(r)
        except httpx.TransportError:
            pass
        deadline = time.monotonic() + 90
        while not self.done and self.stream_id and time.monotonic() < deadline and self.resumes < 30:
            time.sleep(0.25)
            self.resumes += 1
            headers = {**self.headers, "Last-Event-ID": str(self.last)}
            try:
                with httpx.stream("GET", f"{self.resume_url}/{self.stream_id}", headers=headers, timeout=30) as r:
                    if r.status_code in (408, 429) or r.status_code >= 500:
                        continue
                    assert r.status_code == 200, (r.status_code, r.read())
                    self.read(r)
            except httpx.TransportError:
                continue

    def read(self, response: httpx.Response) -> None:
        event_id: int | None = None
        for line in response.iter_lines():
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                data = line[6:]
                if event_id is not None and event_id <= self.last:
                    continue  # handled already
                if data == "[DONE]":
                    self.done = True
                    return
                obj = json.loads(data)
                if "error" in obj:
                    kind = obj["error"].get("code") or obj["error"].get("type")  # OpenAI's shape: our kind is the code
                    if event_id is None and kind in self.READING_ENDS:
                        self.readings_ended.append(kind)
                        return
                    self.final_errors.append(obj["error"])
                    self.done = True
                    return
                for choice in obj["choices"]:
                    self.text += choice["delta"].get("content") or ""
                    self.deltas += 1 if choice["delta"].get("content") else 0
                    if choice.get("finish_reason"):
                        self.finishes.append(choice["finish_reason"])
                if event_id is not None:
                    self.last = event_id
            elif line == "":
                event_id = None


@pytest.mark.alone
@pytest.mark.timeout(240)
@pytest.mark.parametrize("deltas", [20, 200])
def test_a_client_that_follows_the_docs_loses_nothing_to_a_sigterm(azurite, start_app, deltas):
    """A restart or a deploy that recreates an instance: SIGTERM to C's host (the host's default
    shutdown timeout, 5 s) with five resumable keyed streams in flight, each after its first deltas.
    Answers that can finish within the grace (20 deltas, 1 s) finish on C, with nothing to resume;
    longer ones (200 deltas, 10 s) are handed over at the grace's end: the live caller's reading
    ends with ``stream_moved`` (never ``stream_lost``, which tells a client to send again), and a
    client that does what docs/api.md says resumes on B and gets the exact answer, one ``stop``."""
    upstream = Upstream("--deltas", str(deltas), "--interval-ms", "50")
    try:
        env = {"AzureWebJobsStorage": azurite.connection_string, "RESUMABLE_STREAMS": "on", "CALLER_KEYS": "required"}
        b = start_app(**app_env(upstream, **env))
        c = start_app(**app_env(upstream, **env))
        made = httpx.post(f"{b.url}/api/manage/callers", json={"name": f"docs-{os.getpid()}-{deltas}"}, timeout=30)
        assert made.status_code == 201, made.text
        key = made.json()["key"]
        clients = [
            DocsClient(f"{c.url}/api/v1/chat/completions", f"{b.url}/api/streams", key, f"[scenario:cadence] {i}")
            for i in range(5)
        ]
        deadline = time.monotonic() + 60
        while not all(client.deltas >= 3 for client in clients):
            assert time.monotonic() < deadline, [client.deltas for client in clients]
            time.sleep(0.02)
        c.proc.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(120)
        expected = cadence_text(deltas)
        for client in clients:
            assert client.final_errors == [], client.final_errors
            diverge = next((i for i, (x, y) in enumerate(zip(client.text, expected)) if x != y), None)
            assert client.text == expected and client.finishes == ["stop"] and client.done, (
                diverge,
                client.text[(diverge or 0) - 40 : (diverge or 0) + 40],
                client.last,
                len(client.text),
                client.finishes,
                client.readings_ended,
            )
            assert set(client.readings_ended) <= {"stream_moved"}, client.readings_ended
            if deltas == 20:
                assert client.resumes == 0, "an answer that fits in the grace finishes where it started"
        assert c.proc.wait(30) is not None
    finally:
        upstream.stop()


class Reading(threading.Thread):
    """``GET /api/streams/ID`` after ``last`` on one instance, in a thread: the events with an id
    (their data), each id-less error's kind with when it came (monotonic), and how it ended."""

    def __init__(self, url: str, last: int):
        super().__init__(daemon=True)
        self.url, self.last = url, last
        self.data: list[str] = []
        self.ends: list[tuple[str, float]] = []  # id-less errors: (kind, when)
        self.after_end: list[str] = []  # anything after an id-less error (nothing, ever)
        self.status: int | None = None
        self.error: Exception | None = None
        self.got = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            headers = {"Last-Event-ID": str(self.last)}
            with httpx.stream("GET", self.url, headers=headers, timeout=30) as r:
                self.status = r.status_code
                event_id: int | None = None
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        event_id = int(line[4:])
                    elif line.startswith("data: "):
                        if self.ends:
                            self.after_end.append(line)
                        elif event_id is None and line != "data: [DONE]":
                            self.ends.append((json.loads(line[6:])["error"]["code"], time.monotonic()))
                        else:
                            assert event_id is None or event_id > self.last, (event_id, self.last)  # each once
                            self.last = event_id or self.last
                            self.data.append(line[6:])
                            self.got.set()
                    elif line == "":
                        event_id = None
        except Exception as exc:  # kept for the assertion
            self.error = exc
        self.got.set()


def openai_text(data: list[str]) -> tuple[str, list[str]]:
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]


def first_events(url: str, content: str, count: int) -> tuple[str, list[str], int]:
    """Start a resumable stream, read ``count`` events, hang up: (stream id, their data, last id)."""
    body = {"model": "gpt-test", "stream": True, "messages": [{"role": "user", "content": content}]}
    data, last = [], 0
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id: "):
                last = int(line[4:])
            elif line.startswith("data: "):
                data.append(line[6:])
                if len(data) == count:
                    return r.headers["x-stream-id"], data, last
    raise AssertionError("the stream ended early")


def test_readers_served_by_a_draining_instance_move_at_once(long_upstream, azurite, start_app):
    """SIGTERM to A (the host's default shutdown timeout, 5 s; DRAIN_SECONDS' default, so a 3.5 s
    grace) while A serves two readers: one resuming a stream produced on B (it reads the store), one
    of a stream A produces itself (it reads A's memory). Each ends within a second or two with one
    id-less ``stream_moved``, long before the host's timeout would cut it (as a SIGKILL would at
    once): nothing after it, no event twice. Resumed on B after their last ids, both answers are
    exact, with one ``stop``."""
    env = {"AzureWebJobsStorage": azurite.connection_string, "RESUMABLE_STREAMS": "on"}
    a = start_app(**app_env(long_upstream, **env))
    b = start_app(**app_env(long_upstream, **env))
    on_b, on_b_data, on_b_last = first_events(f"{b.url}/api/v1/chat/completions", "[scenario:cadence] b", 3)
    on_a, on_a_data, on_a_last = first_events(f"{a.url}/api/v1/chat/completions", "[scenario:cadence] a", 3)
    readers = {
        on_b: (on_b_data, Reading(f"{a.url}/api/streams/{on_b}", on_b_last)),
        on_a: (on_a_data, Reading(f"{a.url}/api/streams/{on_a}", on_a_last)),
    }
    for _, reading in readers.values():
        assert reading.got.wait(30) and reading.error is None and reading.status == 200, (reading.status, reading.error)
    sent = time.monotonic()
    a.proc.send_signal(signal.SIGTERM)
    expected = cadence_text(200)
    for stream_id, (before, reading) in readers.items():
        reading.join(15)
        assert reading.error is None and not reading.is_alive(), reading.error
        assert [kind for kind, _ in reading.ends] == ["stream_moved"], (stream_id, reading.ends, reading.data[-2:])
        assert reading.after_end == [], reading.after_end
        moved_after = reading.ends[0][1] - sent
        assert moved_after < 2.5, f"a reader on A moved {moved_after:.2f} s after SIGTERM (the host cuts at 5 s)"
        # The client resumes on B after its last id: the rest of the answer, exactly once.
        rest, last = [], reading.last
        for _ in range(20):
            again = Reading(f"{b.url}/api/streams/{stream_id}", last)
            again.join(60)
            rest += again.data
            last = again.last
            if rest and rest[-1] == "[DONE]":
                break
            assert again.status in (200, 429, 503), (again.status, again.error)
            time.sleep(0.25)
        text, finishes = openai_text(before + reading.data + rest)
        assert text == expected and finishes == ["stop"], (stream_id, len(text), finishes)
    assert a.proc.wait(30) is not None
