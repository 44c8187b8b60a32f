"""The chaos soak (``make chaos``; docs/maintainers.md, "The chaos soak"): one Azurite, three instances
of the app on it (tools/devhost, ``CALLER_KEYS=required``, ``RESUMABLE_STREAMS=on``), the scripted
upstream answering 40 deltas 50 ms apart; a few callers and a team with money budgets. For
``--minutes`` (5), ``--clients`` (12) clients send chat completions (openai-python), ``/api/chat``
(httpx) and Responses (openai-python) requests, every one through the project's resuming transport
(clients/python), spread over the instances, resuming through a front door that sends each
connection to a live instance (as the platform's load balancer does); every 8-15 s something goes wrong: an instance's host
SIGKILLed or SIGTERMed (and started again), the store frozen (SIGSTOP of Azurite for 1-8 s), the
upstream cutting (reset) or stalling a few answers.

At the end it checks what the docs promise:

- every answer exact (the scripted upstream's text is known), with one final event; a Responses
  stream (not resumable) may end with an error event or a cut, never short without one, and so may a
  resumable stream whose caller held events its killed instance never stored (``stream_lost``: the
  rest would be other text with a real model);
- every upstream call of every request exactly once in the ledger (``chatstreamUsage``), at the
  upstream's usage when the call completed, at what the upstream sent when it did not (a resumable
  stream's part lost with its instance: at least what its caller had got from it); a request lost
  whole with its instance (no row carries an upstream id) found through its stream's record, else
  its rows matched to such requests by count and amount;
- ``GET /api/manage/usage`` equal to the ledger, per caller and per team;
- the budget rows (``chatstreamLimits``) equal to the ledger, no reservation left held, no budget passed.

It prints the seed, the count of each chaos event and of each outcome, the failed checks, and exits
1 on any loss. In the logs directory (``--logs``, else a temporary one): ``report.json`` (examples of
each failure), ``results.jsonl`` (every request) and the servers' logs. The seed fixes every choice (which request, caller, instance, event, when); the timing
is the machine's, so a replay hits the same plan, not always the same interleaving:
``make chaos CHAOS_ARGS="--seed 1234 --minutes 2"``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from azure.core.exceptions import ResourceNotFoundError
from azure.data.tables import TableServiceClient
from chatstream_client import Backoff, ResumingTransport

from chatstream import tokens
from chatstream.state.journal import JOURNAL_SECONDS
from tools.fakeupstream.scenarios import cadence_text

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
MODEL = "gpt-test"
DELTAS = 40
IN_FLIGHT = 3  # tokens the upstream may have sent and the app not read when it closes a call (a delta or two)
# ...or more on a busy machine: what the upstream sent this long before it saw the call closed (a
# worker behind on its reads by a few deltas; seed 4242 at load 12: 5 deltas unread, 0.3 s)
IN_FLIGHT_SECONDS = 0.5
# A dead instance's journal last recorded what it had read at most this long before it died: written
# every JOURNAL_SECONDS while anything changed (docs/callers.md: "up to ~0.6 s"), behind the upstream
# by what a busy worker had not read yet
JOURNAL_LAG_SECONDS = JOURNAL_SECONDS + 0.1 + IN_FLIGHT_SECONDS
EXPECTED = cadence_text(DELTAS)
MAX_TOKENS = 100
PRICE = {"input": 10, "output": 30}  # USD per million tokens
EVENTS = ("sigkill", "sigterm", "freeze", "upstream_reset", "upstream_stall")
WEIGHTS = (3, 3, 2, 1, 1)
KINDS = ("chat_completions", "chat", "responses")
KIND_WEIGHTS = (5, 3, 2)
RESUMABLE = ("chat_completions", "chat")
REQUEST_SECONDS = 120.0  # one request, all its reconnects included
SETTLE_SECONDS = 150.0  # after the run: recoveries (a dead instance's duty) land within this
MARKER = re.compile(r"chaos (k\d+-\d+-\d+-a\d+)")


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Process:
    """A server started as a subprocess: its first stdout line matching ``ready`` says it serves; its
    stderr goes to a log file (appended over restarts)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], ready: str, logs: Path):
        self.name, self.args, self.env, self.ready = name, args, env, re.compile(ready)
        self.log_path = logs / f"{name}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.url = ""
        self.starts = 0

    def start(self, timeout: float = 90.0) -> None:
        with self.log_path.open("a") as stderr:
            stderr.write(f"\n===== start {self.starts + 1} at {time.strftime('%H:%M:%S')} =====\n")
            stderr.flush()
            self.proc = subprocess.Popen(
                [sys.executable, *self.args],
                cwd=ROOT,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        self.starts += 1
        proc, found, lines = self.proc, threading.Event(), []
        self.lines = lines

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                m = self.ready.search(line)
                if m and not found.is_set():
                    self.url = m.group(1)
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start; its log: {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        self.signal(signal.SIGTERM)
        if not self.wait(timeout):
            self.kill()


class Instance(Process):
    """One instance of the app: the local host on a fixed port (clients find it there again after a
    restart). ``up``: clients may pick it; it is not while it is killed, draining or starting."""

    def __init__(self, index: int, env: dict[str, str], logs: Path):
        self.port = free_port()
        super().__init__(
            f"instance-{index}",
            ["-m", "tools.devhost", "--port", str(self.port), str(ROOT)],
            env,
            r"listening on (http://127\.0\.0\.1:\d+)",
            logs,
        )
        self.up = False
        self.busy = threading.Lock()  # held from a signal to the restart


class FrontDoor:
    """The platform's load balancer, as resumes meet it: one address; each TCP connection is piped to
    an instance that is up, chosen at random (a resume after a kill reaches a live instance, as
    ``GET /api/streams/{id}`` on the app's one host name would in Azure)."""

    def __init__(self, instances: list[Instance]):
        self.instances = instances
        self.rng = random.Random()
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.url = f"http://{HOST}:{self.sock.getsockname()[1]}"
        ready = threading.Event()
        threading.Thread(target=self.loop.run_until_complete, args=(self.serve(ready),), daemon=True).start()
        ready.wait(10)

    async def serve(self, ready: threading.Event) -> None:
        server = await asyncio.start_server(self.pipe, sock=self.sock, backlog=1024)
        ready.set()
        async with server:
            await server.serve_forever()

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        live = [i for i in self.instances if i.up]
        try:
            if not live:
                return
            there = self.rng.choice(live)
            to_reader, to_writer = await asyncio.wait_for(asyncio.open_connection(HOST, there.port), 5)
        except (OSError, TimeoutError):
            writer.close()
            return

        async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                sink.close()

        await asyncio.gather(copy(reader, to_writer), copy(to_reader, writer), return_exceptions=True)


@dataclass
class Result:
    """One client request and how it ended."""

    marker: str  # of the request; each attempt's prompt carries marker-aN
    kind: str
    caller: str
    instance: int = -1
    status: int | None = None  # of the answer that started the stream (None: none did)
    refusals: list[str] = field(default_factory=list)  # before any stream: retried on another instance
    attempts: list[str] = field(default_factory=list)  # the markers sent, one per attempt
    text: str = ""
    finals: list[str] = field(default_factory=list)  # "done", or "error:<type>"
    message: str = ""  # of the final error event
    cut: str | None = None  # the exception that ended the reading
    cuts: list[int] = field(default_factory=list)  # len(text) at each cut its resuming transport saw
    outcome: str = ""
    stream_id: str | None = None


class Resumes(logging.Handler):
    """What the resuming transports did (their log, chatstream_client): counts by kind, and each
    stream's own lines (for the report of a lost one)."""

    KINDS = (
        (re.compile(r"cut after id"), "cut"),
        (re.compile(r"resume answered (\d+)"), "resume answered {0}"),
        (re.compile(r"reconnect failed"), "reconnect failed"),
        (re.compile(r"giving up: (.*)"), "gave up: {0}"),
    )

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()
        self.by_stream: dict[str, list[str]] = {}
        self.guard = threading.Lock()
        self.reading = threading.local()  # .result: the Result its thread reads (a transport logs in it)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        stream = re.search(r"stream (\S+?):? ", message)
        with self.guard:
            for pattern, kind in self.KINDS:
                m = pattern.search(message)
                if m:
                    self.counts[kind.format(*m.groups())] += 1
            result = getattr(self.reading, "result", None)
            if result is not None and "cut after id" in message:
                result.cuts.append(len(result.text))  # what its caller had got when the producer was cut
            if stream:
                lines = self.by_stream.setdefault(stream.group(1), [])
                if len(lines) < 30:
                    lines.append(f"{time.strftime('%H:%M:%S')} {message}")


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.logs = Path(args.logs or tempfile.mkdtemp(prefix="chaos-"))
        self.logs.mkdir(parents=True, exist_ok=True)
        self.events: Counter[str] = Counter()
        self.event_log: list[tuple[float, str]] = []
        self.results: list[Result] = []
        self.lock = threading.Lock()
        self.stop_clients = threading.Event()
        self.started = 0.0
        self.azurite: Process | None = None
        self.upstream: Process | None = None
        self.instances: list[Instance] = []
        self.callers: dict[str, dict[str, Any]] = {}  # name -> {key, id, team, token_budget, spend_budget}
        self.team: dict[str, Any] = {}
        self.connection_string = ""
        self.node_pid = 0
        self.resumes = Resumes()
        self.front: FrontDoor
        client_log = logging.getLogger("chatstream_client")
        client_log.setLevel(logging.INFO)
        client_log.addHandler(self.resumes)

    # --- the servers ------------------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AZURE_OPENAI_"))}
        env.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
        return env

    def start_servers(self) -> None:
        env = self.base_env()
        self.azurite = Process(
            "azurite", ["-m", "tools.azurite", "--in-memory"], env, r"azurite listening on (http://\S+)", self.logs
        )
        self.azurite.start()
        deadline = time.monotonic() + 20
        while not any(line.startswith("AzureWebJobsStorage=") for line in self.azurite.lines):
            if time.monotonic() > deadline:
                raise RuntimeError("Azurite printed no connection string")
            time.sleep(0.05)
        line = next(line for line in self.azurite.lines if line.startswith("AzureWebJobsStorage="))
        self.connection_string = line.split("=", 1)[1].strip()
        assert self.azurite.proc is not None
        pid = self.azurite.proc.pid
        self.node_pid = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
        self.upstream = Process(
            "upstream",
            ["-m", "tools.fakeupstream", "--port", "0", "--deltas", str(DELTAS), "--interval-ms", "50"]
            + ["--max-records", "200000"],
            env,
            r"listening on (http://127\.0\.0\.1:\d+)",
            self.logs,
        )
        self.upstream.start()
        app_env = {
            **env,
            "OPENAI_BASE_URL": self.upstream.url + "/v1",
            "OPENAI_API_KEY": "sk-chaos-scripted",
            "OPENAI_MODEL": MODEL,
            "UPSTREAM_MAX_RETRIES": "0",
            "AzureWebJobsStorage": self.connection_string,
            "CALLER_KEYS": "required",
            "RESUMABLE_STREAMS": "on",
            "IDLE_TIMEOUT_SECONDS": "3",  # a stalled upstream is given up (and the answer continued) soon
        }
        self.instances = [Instance(i, app_env, self.logs) for i in range(3)]
        threads = [threading.Thread(target=i.start) for i in self.instances]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for instance in self.instances:
            if not instance.alive():
                raise RuntimeError(f"{instance.name} did not start; its log: {instance.log_path}")
            instance.up = True
        self.front = FrontDoor(self.instances)
        log(f"Azurite, the upstream ({self.upstream.url}), 3 instances and their front door ({self.front.url}) up")
        log(f"logs in {self.logs}")

    def stop_servers(self) -> None:
        if self.node_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.node_pid, signal.SIGCONT)
        for instance in self.instances:
            instance.up = False
        threads = [threading.Thread(target=i.stop) for i in self.instances]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for server in (self.upstream, self.azurite):
            if server is not None:
                server.stop()

    def manage(self, method: str, path: str, body: dict | None = None) -> dict:
        url = f"{self.instances[0].url}/api/manage/{path}"
        answer = httpx.request(method, url, json=body, timeout=30)
        if answer.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {answer.status_code} {answer.text}")
        return answer.json()

    def set_up_callers(self) -> None:
        """A price; a team with a spend budget and two callers (one with its own spend budget); a
        caller with a token budget; one with no limit. Budgets sized to run out late in the run."""
        scale = self.args.minutes * self.args.clients / 12  # about what a run of this size spends
        team_budget = round(0.18 * scale, 6)
        self.manage("PUT", f"prices/{MODEL}", PRICE)
        team = self.manage(
            "POST", "teams", {"name": "chaos-team", "spend_budget": team_budget, "budget_period": "total"}
        )
        self.team = {"name": "chaos-team", "id": team["id"], "spend_budget": team_budget}
        specs = {
            "chaos-a": {"team": "chaos-team", "spend_budget": round(0.08 * scale, 6), "budget_period": "total"},
            "chaos-b": {"team": "chaos-team"},
            "chaos-c": {"token_budget": max(500, round(4500 * scale)), "budget_period": "total"},
            "chaos-d": {},
        }
        for name, spec in specs.items():
            made = self.manage("POST", "callers", {"name": name, **spec})
            self.callers[name] = {"key": made["key"], "id": made["id"], **spec}

    def up(self) -> list[Instance]:
        return [i for i in self.instances if i.up]

    def pick(self, rng: random.Random) -> Instance:
        for _ in range(200):  # every instance down at once is not planned, but may happen briefly
            live = self.up()
            if live:
                return rng.choice(live)
            time.sleep(0.1)
        return rng.choice(self.instances)

    # --- chaos ------------------------------------------------------------------------------------

    def note(self, event: str, detail: str = "") -> None:
        """Count a chaos event (by its name) and log it (with its detail)."""
        with self.lock:
            self.events[event] += 1
            self.event_log.append((round(time.monotonic() - self.started, 1), f"{event} {detail}".strip()))
        log(f"{event} {detail}".strip())

    def chaos(self, until: float) -> None:
        wanted = [e for e in self.args.events.split(",") if e]
        weights = [WEIGHTS[EVENTS.index(e)] for e in wanted]
        low, high = self.args.interval
        done = 0
        while done < self.args.max_events:
            wait = self.rng.uniform(low, high)
            if time.monotonic() + wait > until or not wanted:
                return
            time.sleep(wait)
            event = self.rng.choices(wanted, weights)[0]
            done += 1
            if event in ("sigkill", "sigterm"):
                self.signal_instance(event)
            elif event == "freeze":
                seconds = self.rng.uniform(1, 8)
                self.note("freeze", f"{seconds:.1f} s")
                os.kill(self.node_pid, signal.SIGSTOP)
                try:
                    time.sleep(seconds)
                finally:
                    os.kill(self.node_pid, signal.SIGCONT)
            else:
                end = event.split("_")[1]
                after, times = self.rng.randint(2, 30), self.rng.randint(1, 3)
                self.note(event, f"the next {times} answers cut after {after} deltas")
                assert self.upstream is not None
                httpx.post(
                    f"{self.upstream.url}/_scripted/failure",
                    json={"after": after, "end": end, "times": times},
                    timeout=10,
                ).raise_for_status()

    def signal_instance(self, event: str) -> None:
        candidates = [i for i in self.instances if i.up]
        if len(candidates) < 2:  # one instance is always left to serve
            self.note(f"{event}_skipped", "one instance up")
            return
        instance = self.rng.choice(candidates)
        restart_after = self.rng.uniform(1, 3)
        instance.busy.acquire()
        instance.up = False
        instance.signal(signal.SIGKILL if event == "sigkill" else signal.SIGTERM)
        self.note(event, instance.name)

        def restart() -> None:
            try:
                if not instance.wait(30):
                    self.note("sigterm_hung", f"{instance.name} still running 30 s after SIGTERM: killed")
                    instance.kill()
                code = instance.proc.returncode if instance.proc is not None else None
                if event == "sigterm":
                    with self.lock:
                        self.events[f"sigterm_exit_{code}"] += 1
                time.sleep(restart_after)
                instance.start()
                instance.up = True
                log(f"{instance.name} restarted")
            except Exception as exc:  # noqa: BLE001 - counted, and the run goes on on the others
                self.note("restart_failed", f"{instance.name}: {exc}")
            finally:
                instance.busy.release()

        threading.Thread(target=restart, daemon=True).start()

    # --- clients ----------------------------------------------------------------------------------

    def client(self, index: int, until: float) -> None:
        rng = random.Random(f"{self.args.seed}-{index}")
        n = 0
        while time.monotonic() < until and n < self.args.max_requests and not self.stop_clients.is_set():
            kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
            name = rng.choice(sorted(self.callers))
            result = Result(f"k{self.args.seed}-{index}-{n}", kind, name)
            try:
                self.one(result, rng)
            except Exception as exc:  # noqa: BLE001 - an unexpected failure is an outcome too
                result.cut = f"client bug? {type(exc).__name__}: {exc}"
            result.outcome = classify(result)
            with self.lock:
                self.results.append(result)
            n += 1
            if result.status is None:
                time.sleep(rng.uniform(0.5, 1.5))  # refused (a budget spent): not in a tight loop

    def one(self, result: Result, rng: random.Random) -> None:
        key = self.callers[result.caller]["key"]
        self.resumes.reading.result = result
        for attempt in range(4):  # a refusal before the stream (retryable) is retried on another instance
            result.attempts.append(f"{result.marker}-a{attempt}")
            prompt = f"[scenario:cadence] chaos {result.attempts[-1]}"
            instance = self.pick(rng)
            result.instance = self.instances.index(instance)
            transport = ResumingTransport(
                backoff=Backoff(max_attempts=8, max_seconds=30), streams_url=f"{self.front.url}/api/streams/{{id}}"
            )
            http = httpx.Client(transport=transport, timeout=httpx.Timeout(60, connect=5))
            try:
                refusal = self.read(result, instance, http, key, prompt)
            finally:
                http.close()
            if refusal is None:
                return
            result.refusals.append(refusal)
            if not retryable(refusal):
                return
            time.sleep(rng.uniform(0.2, 1.0))

    def read(self, result: Result, instance: Instance, http: httpx.Client, key: str, prompt: str) -> str | None:
        """One attempt; a refusal before the stream started (then nothing is recorded), or None."""
        if result.kind == "chat":
            return self.read_chat(result, instance, http, key, prompt)
        client = openai.OpenAI(base_url=instance.url + "/api/v1", api_key=key, max_retries=0, http_client=http)
        try:
            if result.kind == "chat_completions":
                stream: Any = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": prompt}],
                    stream=True,
                    max_tokens=MAX_TOKENS,
                    stream_options={"include_usage": True},
                )
            else:
                stream = client.responses.create(model=MODEL, input=prompt, stream=True, max_output_tokens=MAX_TOKENS)
        except openai.APIStatusError as exc:
            return refusal_of(exc.status_code, exc.response.text)
        except openai.APIConnectionError as exc:
            return f"connect {type(exc.__cause__ or exc).__name__}"
        result.status = 200
        result.stream_id = stream.response.headers.get("x-stream-id")
        try:
            for item in stream:
                if result.kind == "chat_completions":
                    for choice in item.choices:
                        result.text += choice.delta.content or ""
                        if choice.finish_reason:
                            result.finals.append("done" if choice.finish_reason == "stop" else choice.finish_reason)
                elif item.type == "response.output_text.delta":
                    result.text += item.delta
                elif item.type == "response.completed":
                    result.finals.append("done")
                elif item.type in ("error", "response.failed", "response.incomplete"):
                    code = getattr(item, "code", None) or item.type
                    result.finals.append(f"error:{code}")
        except openai.APIConnectionError as exc:  # the transport gave up
            result.cut = type(exc.__cause__ or exc).__name__
        except openai.APIError as exc:  # an error event in the stream
            body = exc.body if isinstance(exc.body, dict) else {}
            code = body.get("code") or body.get("type") or type(exc).__name__
            result.finals.append(f"error:{code}")
            result.message = str(body.get("message") or exc.message)
        except httpx.HTTPError as exc:
            result.cut = type(exc).__name__
        return None

    def read_chat(self, result: Result, instance: Instance, http: httpx.Client, key: str, prompt: str) -> str | None:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS}
        try:
            with http.stream("POST", instance.url + "/api/chat", json=body, headers={"api-key": key}) as answer:
                if answer.status_code != 200:
                    return refusal_of(answer.status_code, answer.read().decode(errors="replace"))
                result.status = 200
                result.stream_id = answer.headers.get("x-stream-id")
                try:
                    for event, data in sse_events(answer):
                        if event == "message":
                            result.text += json.loads(data).get("delta", "")
                        elif event == "done":
                            result.finals.append("done")
                        elif event == "error":
                            error = json.loads(data).get("error", {})
                            result.finals.append(f"error:{error.get('type') or error.get('code')}")
                            result.message = str(error.get("message") or "")
                except httpx.HTTPError as exc:
                    result.cut = type(exc).__name__
        except httpx.HTTPError as exc:
            if result.status is None:
                return f"connect {type(exc).__name__}"
            result.cut = type(exc).__name__
        return None

    # --- the run ----------------------------------------------------------------------------------

    def run(self) -> int:
        log(f'seed {self.args.seed} (replay: make chaos CHAOS_ARGS="--seed {self.args.seed}")')
        try:
            self.start_servers()
            self.set_up_callers()
            self.started = time.monotonic()
            until = self.started + self.args.minutes * 60
            clients = [
                threading.Thread(target=self.client, args=(i, until), daemon=True) for i in range(self.args.clients)
            ]
            for thread in clients:
                thread.start()
            self.chaos(until)
            for thread in clients:
                thread.join(max(1.0, until - time.monotonic()) + REQUEST_SECONDS)
            self.stop_clients.set()
            log(f"{len(self.results)} requests; bringing every instance up, then letting charges settle")
            for instance in self.instances:
                with instance.busy:
                    if not instance.alive():
                        instance.start()
                        instance.up = True
            report = Checks(self).run()
        finally:
            self.stop_servers()
        return self.report(report)

    def report(self, checks: dict[str, Any]) -> int:
        outcomes = Counter(r.outcome for r in self.results)
        refusals = Counter(x for r in self.results for x in r.refusals)
        losses = sum(n for o, n in outcomes.items() if o.startswith("lost"))
        failed = {k: v for k, v in checks["failures"].items() if v}
        summary = {
            "seed": self.args.seed,
            "minutes": self.args.minutes,
            "clients": self.args.clients,
            "requests": len(self.results),
            "events": dict(sorted(self.events.items())),
            "outcomes": dict(sorted(outcomes.items())),
            "refusals_retried_or_final": dict(sorted(refusals.items())),
            "resuming_transports": dict(sorted(self.resumes.counts.items())),
            "by_kind": {
                kind: dict(sorted(Counter(r.outcome for r in self.results if r.kind == kind).items())) for kind in KINDS
            },
            "ledger": checks["counts"],
            "failures": failed,
            "passed": losses == 0 and not failed,
        }
        details = {
            "summary": summary,
            "examples": checks["examples"],
            "event_log": self.event_log,
            "lost_requests": [
                {**r.__dict__, **diverges(r.text), "transport": self.resumes.by_stream.get(r.stream_id or "", [])}
                for r in self.results
                if r.outcome.startswith("lost")
            ][:50],
        }
        (self.logs / "report.json").write_text(json.dumps(details, indent=2, default=str))
        with (self.logs / "results.jsonl").open("w") as out:  # every request, for a post-mortem
            for r in self.results:
                out.write(json.dumps({**r.__dict__, "text": len(r.text)}) + "\n")
        print(json.dumps(summary, indent=2))
        print(
            f"CHAOS {'PASSED' if summary['passed'] else 'FAILED'} seed={self.args.seed}; details: "
            f"{self.logs / 'report.json'}",
            flush=True,
        )
        return 0 if summary["passed"] else 1


def sse_events(answer: httpx.Response):
    """(event, data) of an SSE body (the app's /api/chat: one data line per event)."""
    event, data = "message", []
    for line in answer.iter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def diverges(text: str) -> dict[str, Any]:
    """Where a text leaves the answer, with a few characters of each around it."""
    at = next(
        (i for i, (a, b) in enumerate(zip(text, EXPECTED, strict=False)) if a != b), min(len(text), len(EXPECTED))
    )
    return {"diverges_at": at, "expected_there": EXPECTED[at : at + 30], "got_there": text[at : at + 30]}


def refusal_of(status: int, body: str) -> str:
    """``<status> <the error's code>`` (or the body's start, when it is not the app's error JSON)."""
    try:
        error = json.loads(body).get("error")
        code = (error.get("code") or error.get("type")) if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        code = None
    return f"{status} {code or repr(body[:40])}"


def retryable(refusal: str) -> bool:
    return refusal.startswith(("connect", "503", "502", "500")) or refusal == "429 rate_limit_exceeded"


# The message of a stream_lost whose caller held events its killed producer never stored (state/streamlog/readers.py).
UNSTORED = "lost with the instance that produced them"


def classify(r: Result) -> str:
    """The outcome's name: ``exact``; ``refused:<why>``; ``expected:<how>`` (a Responses stream, not
    resumable, ended by an error event or a cut, its text a prefix of the answer); ``lost:<how>``."""
    if r.status is None:
        return f"refused:{r.refusals[-1] if r.refusals else 'nothing'}"
    prefix = EXPECTED.startswith(r.text)
    if r.text == EXPECTED and r.finals == ["done"]:
        # (cut after its final event: its instance was killed before the body's last bytes; the
        # caller has the whole answer and its end, and its SDK raises only after them)
        return "exact" if r.cut is None else "expected:exact_then_cut"
    if not prefix:
        return "lost:garbled_text"
    if len(r.finals) > 1:
        return "lost:several_final_events"
    if r.finals == ["done"]:
        return "lost:short_text_with_done"  # a silent loss
    how = r.finals[0] if r.finals else f"cut:{r.cut}"
    if r.kind not in RESUMABLE:
        return f"expected:{how}"
    if how == "error:stream_lost" and UNSTORED in r.message:
        # Its caller held events its killed instance never stored: the rest would be other text, so
        # the stream ends with stream_lost (docs/api.md: send again), its text a prefix of the answer.
        return "expected:stream_lost_unstored"
    return f"lost:{how}"


def words(payload: Any) -> int:
    """The scripted upstream's prompt_tokens: whitespace-separated words of all the text in the request."""
    if payload is None:
        return 0
    body = payload
    texts: list[str] = []
    if "messages" in body:
        for message in body["messages"]:
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts += [p.get("text", "") for p in content if isinstance(p, dict)]
    else:
        texts.append(str(body.get("instructions") or ""))
        given = body.get("input")
        if isinstance(given, str):
            texts.append(given)
        elif isinstance(given, list):
            for item in given:
                content = item.get("content") if isinstance(item, dict) else None
                if isinstance(content, str):
                    texts.append(content)
                elif isinstance(content, list):
                    texts += [p.get("text", "") for p in content if isinstance(p, dict)]
    return sum(len(t.split()) for t in texts)


class Checks:
    """The end-of-run checks over the upstream's records, the ledger, the usage API and the budget rows."""

    def __init__(self, soak: Soak):
        self.soak = soak
        self.failures: Counter[str] = Counter()
        self.examples: dict[str, list[Any]] = {}
        self.tables = TableServiceClient.from_connection_string(soak.connection_string)

    def fail(self, what: str, example: Any, n: int = 1) -> None:
        self.failures[what] += n
        self.examples.setdefault(what, [])
        if len(self.examples[what]) < 5:
            self.examples[what].append(example)

    def rows(self, table: str) -> list[dict[str, Any]]:
        try:
            found = self.tables.get_table_client(table).list_entities()
            return [{k: getattr(v, "value", v) for k, v in row.items()} for row in found]
        except ResourceNotFoundError:
            return []

    def settle(self) -> tuple[list[dict], list[dict]]:
        """Wait until no budget row is held by any instance and the ledger stopped growing (a dead
        instance's requests are recovered by another one), at most SETTLE_SECONDS."""
        deadline = time.monotonic() + SETTLE_SECONDS
        last, stable_since = -1, time.monotonic()
        while True:
            ledger, limits = self.rows("chatstreamUsage"), self.rows("chatstreamLimits")
            held = sum(held_of(r) for r in limits if r.get("RowKey") in ("tokens", "spend"))
            if len(ledger) != last:
                last, stable_since = len(ledger), time.monotonic()
            if held == 0 and time.monotonic() - stable_since > 15:
                return ledger, limits
            if time.monotonic() > deadline:
                log(f"not settled after {SETTLE_SECONDS:.0f} s: {held} still held")
                return ledger, limits
            time.sleep(2)

    def run(self) -> dict[str, Any]:
        soak = self.soak
        ledger, limits = self.settle()
        assert soak.upstream is not None
        up = httpx.Client(base_url=soak.upstream.url, timeout=60)
        requests = up.get("/_scripted/requests").json()
        streams = {s["request_id"]: s for s in up.get("/_scripted/streams").json()}
        by_marker: dict[str, list[dict]] = {}
        for record in requests:
            m = MARKER.search(json.dumps(record.get("json")))
            if m:
                by_marker.setdefault(m.group(1), []).append(record)
        for calls in by_marker.values():
            calls.sort(key=lambda c: c["received_at"])
        (soak.logs / "upstream.json").write_text(
            json.dumps({"requests": requests, "streams": list(streams.values())}, default=str)
        )
        (soak.logs / "ledger.json").write_text(json.dumps({"usage": ledger, "limits": limits}, default=str))
        by_upstream_id: dict[str, list[dict]] = {}
        by_request: dict[str, list[dict]] = {}
        for row in ledger:
            by_upstream_id.setdefault(str(row.get("upstream_id") or ""), []).append(row)
            by_request.setdefault(str(row.get("request_id")), []).append(row)
        linked_requests: set[str] = set()
        counts: Counter[str] = Counter()
        wanted: dict[str, list[tuple[int, int]]] = {}  # per caller: bounds of its requests with no linked row
        attempts = [
            (result, marker, i == len(result.attempts) - 1 and result.status is not None)
            for result in soak.results
            for i, marker in enumerate(result.attempts)
        ]
        for result, marker, answered in attempts:
            calls = by_marker.get(marker, [])
            counts["upstream_calls"] += len(calls)
            index = result.attempts.index(marker)
            refusal = result.refusals[index] if not answered and index < len(result.refusals) else ""
            if calls and refusal[:1].isdigit():
                self.fail("upstream_called_for_a_refused_request", {"marker": marker, "refusal": refusal})
            elif calls and not answered:
                counts["attempts_called_upstream_but_no_answer_reached_the_client"] += 1
            ids = {str(row["request_id"]) for c in calls for row in by_upstream_id.get(c["id"], [])}
            if calls and not ids and answered and result.stream_id:
                # Every segment lost with its instance (no row carries an upstream id): a resumable
                # stream's record names the app's request id, which its rows carry.
                found = self.stream_request_id(result.stream_id)
                if found in by_request:
                    ids = {found}
                    counts["requests_linked_by_their_stream_record"] += 1
            if len(ids) > 1:
                self.fail("request_charged_under_several_ids", {"marker": marker, "ids": sorted(ids)})
            linked_requests |= ids
            rows = sorted((row for i in ids for row in by_request.get(i, [])), key=lambda r: r["RowKey"])
            if calls and not rows:
                counts["requests_with_no_linked_row"] += 1  # only lost segments: matched below
                wanted.setdefault(result.caller, []).append(lost_bounds(result, calls, streams, answered))
                continue
            rows, uncalled = without_uncalled_continuations(rows, len(calls))
            counts["prompt_only_rows_of_continuations_cut_before_their_upstream_call"] += uncalled
            if len(rows) != len(calls):
                self.fail(
                    "segments_in_ledger_differ_from_upstream_calls",
                    {"marker": marker, "calls": [c["id"] for c in calls], "rows": [r["RowKey"] for r in rows]},
                )
            call_ids = {c["id"] for c in calls}
            unlinked_rows = [r for r in rows if str(r.get("upstream_id") or "") not in call_ids]
            unlinked_calls = []
            for call in calls:
                mine = [r for r in rows if r.get("upstream_id") == call["id"]]
                if len(mine) > 1:
                    self.fail("upstream_call_charged_twice", {"marker": marker, "call": call["id"]})
                read = len(calls) if answered else 0  # (an attempt refused or cut before its answer: nothing read)
                if mine:
                    self.check_segment(marker, call, streams.get(call["id"]) or {}, mine[0], counts, result, read)
                else:
                    unlinked_calls.append(call)
            # A segment lost with its instance is charged without the upstream's id: in call order.
            lost = list(zip(unlinked_calls, unlinked_rows, strict=False))
            for i, (call, row) in enumerate(lost):
                counts["segments_charged_without_upstream_id"] += 1
                # The continuation that stood in for this part, when it was lost with its instance too.
                after = lost[i + 1] if i + 1 < len(lost) else None
                taker = streams.get(after[0]["id"]) if after is not None and after[1].get("ended") == "lost" else None
                self.check_segment(marker, call, streams.get(call["id"]) or {}, row, counts, result, read, taker)
            for row in rows:
                if row.get("caller") != result.caller:
                    self.fail("charged_to_another_caller", {"marker": marker, "row": row["RowKey"]})
        unlinked = [r for r in ledger if str(r.get("request_id")) not in linked_requests]
        counts["ledger_rows"] = len(ledger)
        counts["ended_lost_rows"] = sum(1 for r in ledger if r.get("ended") == "lost")
        counts["rows_linked_to_no_request"] = len(unlinked)
        if unlinked or counts["requests_with_no_linked_row"]:
            for name in soak.callers:
                bounds = wanted.get(name, [])
                mine = [r for r in unlinked if r.get("caller") == name]
                cut = sum(
                    1 for res, marker, _ in attempts if res.caller == name and cut_uncalled(res, marker, by_marker)
                )
                check = match_lost_requests(mine, bounds, cut)
                counts["prompt_only_rows_of_attempts_cut_before_their_upstream_call"] += check.get("cut_uncalled", 0)
                counts["rows_linked_to_no_request_charged_within_their_bounds"] += check.get("within", 0)
                if "failure" in check:
                    self.fail(
                        check["failure"],
                        {
                            "caller": name,
                            "requests_without_row": len(bounds),
                            "rows_without_request": check["orphans"],
                            "completion_tokens_of_rows": check.get("charged"),
                            "bounds_of_requests": check.get("bounds"),
                        },
                        check["by"],
                    )
        self.check_usage_api(ledger)
        self.check_budgets(ledger, limits)
        return {"failures": dict(self.failures), "examples": self.examples, "counts": dict(counts)}

    def check_segment(
        self,
        marker: str,
        call: dict,
        stream: dict,
        row: dict,
        counts: Counter,
        result: Result | None = None,
        calls: int = 1,
        taker: dict | None = None,
    ) -> None:
        """One upstream call's charge: at the upstream's usage when the call completed and was
        settled so; otherwise (cut, stalled, its instance dead) at what the upstream sent on it,
        counted as the app counts text (chatstream.tokens). A resumable stream's first part lost
        with its instance: at least what its caller had got when it was cut, or all it got when it was
        never cut (one upstream call: it read it all from that instance; docs/callers.md), at
        most what the upstream sent (what the dead instance had read, or had in its socket, but not
        passed on: counted, not a failure). A continuation that only a caller told ``stream_lost``
        asked for, stopped once past that caller's position (docs/resumable.md) or abandoned before
        (nobody read it for RESUME_ABANDON_SECONDS: ``cancelled``), is charged as a
        hang-up is: what the app had read when it closed the call, at most what the upstream sent and
        at most ``IN_FLIGHT`` tokens or ``IN_FLIGHT_SECONDS`` of its deltas fewer (what was in the
        socket, or not yet read by a busy worker), or, when the upstream had
        finished meanwhile, the whole text counted as the app counts it (its usage never read).
        ``calls``: the upstream calls of the attempt (0: one its caller got no answer from);
        ``taker``: the upstream's record of the continuation that stood in for this part, when that
        continuation was lost with its instance too (``received_from_the_lost_instance``)."""
        where = {"marker": marker, "call": call["id"], "row": row["RowKey"], "ended": row.get("ended")}
        charged = int(row["completion_tokens"])
        sent = len(stream["content_sent_at"]) if "content_sent_at" in stream else None
        stopped = (
            row.get("ended") in ("disconnected", "cancelled")  # (or abandoned first: RESUME_ABANDON_SECONDS)
            and int(row.get("segment") or 0) > 0
            and result is not None
            and result.outcome == "expected:stream_lost_unstored"
            and sent is not None
        )
        if stopped:
            assert sent is not None
            generated = tokens.count_text(MODEL, cadence_text(sent))
            closed = stream.get("ended_at")
            late = sum(1 for t in stream["content_sent_at"] if closed is not None and t >= closed - IN_FLIGHT_SECONDS)
            read_at_least = min(generated - IN_FLIGHT, tokens.count_text(MODEL, cadence_text(sent - late)))
            if read_at_least <= charged <= generated:
                counts["continuations_stopped_for_nobody"] += 1
                counts["completion_tokens_in_flight_at_the_stop_uncharged"] += generated - charged
            else:
                self.fail(
                    "stopped_continuation_charged_other_than_read",
                    {**where, "charged": charged, "generated": generated},
                )
            return
        if stream.get("outcome") == "completed" and row.get("upstream_id") == call["id"]:
            usage = (words(call.get("json")), DELTAS if sent is None else sent)
            if (int(row["prompt_tokens"]), charged) == usage:
                counts["segments_charged_at_usage"] += 1
            else:
                self.fail("completed_call_charged_other_than_its_usage", {**where, "charged": charged, "usage": usage})
            return
        if sent is None:
            counts["segments_unchecked_responses_cut"] += 1
            return
        generated = tokens.count_text(MODEL, cadence_text(sent))
        received = received_from_the_lost_instance(result, row, calls, stream, taker)
        recorded = journal_record(stream) if row.get("ended") == "lost" else None
        if charged < generated and received is not None and charged >= received:
            counts["lost_parts_charged_at_least_what_their_caller_received"] += 1
            counts["completion_tokens_generated_but_never_delivered_uncharged"] += generated - charged
        elif charged < generated and received is None and recorded is not None and charged >= recorded:
            # Lost with its instance and read by nobody (a continuation whose asking reader was told
            # stream_lost): docs/callers.md promises its journal's last record, up to ~0.6 s short.
            counts["lost_parts_nobody_read_charged_at_least_their_journal_record"] += 1
            counts["completion_tokens_generated_but_never_delivered_uncharged"] += generated - charged
        elif charged < generated:
            # A caller never cut read this part live from the instance it was lost with (it died as
            # the answer ended, before its charge was stored): a failure of its own name.
            live = received is not None and result is not None and not result.cuts
            self.fail(
                "lost_part_read_live_charged_less_than_its_caller_received"
                if live
                else "segment_charged_less_than_generated",
                {**where, "charged": charged, "generated": generated, "caller_received": received},
            )
            counts["completion_tokens_short"] += generated - charged
        elif charged > generated:
            self.fail("segment_charged_more_than_generated", {**where, "charged": charged, "generated": generated})
        else:
            counts["segments_charged_at_generated"] += 1

    def stream_request_id(self, stream_id: str) -> str | None:
        """The app's request id of resumable stream ``stream_id``, from its record (kept
        RESUME_TTL_SECONDS, 10 minutes); None when it is not there."""
        try:
            record = self.tables.get_table_client("chatstreamStreams").get_entity(stream_id, "stream")
        except ResourceNotFoundError:
            return None
        found = record.get("request_id")
        return str(found) if found else None

    def check_usage_api(self, ledger: list[dict]) -> None:
        soak = self.soak
        base = soak.up()[0].url if soak.up() else soak.instances[0].url
        for name in soak.callers:
            mine = [r for r in ledger if r.get("caller") == name]
            want = (len(mine), sum(int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in mine))
            want_cost = sum(int(r.get("cost") or 0) for r in mine)
            answer = httpx.get(f"{base}/api/manage/usage", params={"caller": name}, timeout=60).json()
            total = answer.get("total", {})
            got = (int(total.get("requests", -1)), int(total.get("total_tokens", -1)))
            if got != want or int(total.get("cost_picousd", -1)) != want_cost:
                self.fail(
                    "usage_api_differs_from_ledger",
                    {"caller": name, "usage_api": [*got, total.get("cost_picousd")], "ledger": [*want, want_cost]},
                )
        team = soak.team["name"]
        mine = [r for r in ledger if r.get("team") == team]
        answer = httpx.get(f"{base}/api/manage/usage", params={"team": team}, timeout=60).json()
        if int(answer.get("total", {}).get("requests", -1)) != len(mine):
            self.fail(
                "usage_api_differs_from_ledger", {"team": team, "usage_api": answer.get("total"), "rows": len(mine)}
            )

    def check_budgets(self, ledger: list[dict], limits: list[dict]) -> None:
        soak = self.soak
        rows = {(r["PartitionKey"], r["RowKey"]): r for r in limits}
        owners = [
            (f"{name}|{c['id']}", [r for r in ledger if r.get("caller") == name], c) for name, c in soak.callers.items()
        ]
        team = soak.team
        owners.append((f"team:{team['name']}|{team['id']}", [r for r in ledger if r.get("team") == team["name"]], team))
        for partition, mine, spec in owners:
            tokens = sum(int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in mine)
            cost = sum(int(r.get("cost") or 0) for r in mine)
            for row_key, spent, budget in (
                ("tokens", tokens, spec.get("token_budget")),
                ("spend", cost, round(spec["spend_budget"] * 10**12) if spec.get("spend_budget") else None),
            ):
                if budget is None:
                    continue
                row = rows.get((partition, row_key))
                taken = int(row.get("taken") or 0) if row else 0
                held = held_of(row) if row else 0
                where = f"{partition} {row_key}"
                if held:
                    self.fail("reservation_left_held", {"row": where, "held": held})
                if taken - held != spent:
                    self.fail(
                        "budget_row_differs_from_ledger", {"row": where, "row_spent": taken - held, "ledger": spent}
                    )
                if spent > budget:
                    self.fail("budget_passed", {"row": where, "ledger": spent, "budget": budget})


def without_uncalled_continuations(rows: list[dict], calls: int) -> tuple[list[dict], int]:
    """A request's ``rows`` (in segment order) without those of continuations that never called the
    upstream, and how many: a taker lists a continuation in its journal before the call (journal.py),
    so one killed between the two leaves a row its recovery charged at the prompt alone (lost, no
    completion token, no upstream id), as a first attempt's (``match_lost_requests``). Only rows past
    ``calls`` upstream calls, and only if every one of them is such a row."""
    extra = len(rows) - calls
    if calls == 0 or extra <= 0:
        return rows, 0
    uncalled = [
        row
        for row in rows
        if row.get("ended") == "lost"
        and int(row.get("segment") or 0) > 0
        and not int(row.get("completion_tokens") or 0)
        and not row.get("upstream_id")
    ][-extra:]
    if len(uncalled) < extra:
        return rows, 0
    return [row for row in rows if not any(row is u for u in uncalled)], extra


def cut_uncalled(result: Result, marker: str, by_marker: dict[str, list[dict]]) -> bool:
    """Whether the attempt ``marker`` was cut before any answer (its instance killed: a refusal that is
    no HTTP status, ``connect RemoteProtocolError``...) and no upstream call came of it."""
    index = result.attempts.index(marker)
    return index < len(result.refusals) and not result.refusals[index][:1].isdigit() and not by_marker.get(marker)


def received_from_the_lost_instance(
    result: Result | None, row: dict, calls: int, stream: dict | None = None, taker: dict | None = None
) -> int | None:
    """Completion tokens a resumable stream's caller had got from the instance its first part was
    lost with (``row``: that part, ``lost``, segment 0), counted as the app counts text: what it had
    when it was cut; when it was never cut and its attempt made one upstream call, all it got (it
    read it all there). ``calls``: the upstream calls of the attempt, 0 for one the caller got no
    answer from (refused or cut first: the result's text is another attempt's). None: no bound.

    Cut, with one upstream call: nothing continued the stream (its taker's continuation refused,
    e.g. the caller's budget spent), so no continuation stands for what the caller held unstored
    (endpoint.take_over): docs/callers.md promises the journal's last record, at most
    ``JOURNAL_LAG_SECONDS`` before the call (``stream``, the upstream's record) was closed. Cut, and
    continued by a taker that died too (``taker``: its continuation's record): what the taker knew of
    the caller's part (its stand-ins) reached only its journal, so the larger of the two journals'
    last records (docs/callers.md)."""
    if result is None or calls == 0 or row.get("ended") != "lost" or int(row.get("segment") or 0) != 0:
        return None
    if result.cuts:
        got = tokens.count_text(MODEL, result.text[: result.cuts[0]])
        recorded = journal_record(stream) if calls == 1 else None
        if calls > 1 and taker is not None:
            recorded = max(journal_record(stream) or 0, journal_record(taker) or 0)
        return got if recorded is None else min(got, recorded)
    if result.kind in RESUMABLE and calls == 1 and result.text:
        return tokens.count_text(MODEL, result.text)
    return None


def journal_record(stream: dict | None) -> int | None:
    """The completion tokens a dead instance's journal had surely recorded of upstream call
    ``stream`` (the upstream's record; None without its timings): what the upstream sent
    ``JOURNAL_LAG_SECONDS`` before the call was closed (its instance killed), counted as the app
    counts text."""
    if stream is None or stream.get("ended_at") is None or "content_sent_at" not in stream:
        return None
    sent = sum(1 for t in stream["content_sent_at"] if t < stream["ended_at"] - JOURNAL_LAG_SECONDS)
    return tokens.count_text(MODEL, cadence_text(sent))


def lost_bounds(result: Result, calls: list[dict], streams: dict[str, dict], answered: bool) -> tuple[int, int]:
    """The completion tokens a request is charged when all its rows were lost with its instance
    (no row carries the id of an upstream call): at least what its caller got from that instance
    (a resumable stream's, ``received_from_the_lost_instance``; else 0: the journal's last record,
    which the soak cannot see), at most what the upstream sent on all its calls, counted as the
    app counts text (a Responses call's count is not recorded: the whole answer)."""
    high = 0
    for call in calls:
        stream = streams.get(call["id"]) or {}
        sent = len(stream["content_sent_at"]) if "content_sent_at" in stream else DELTAS
        high += tokens.count_text(MODEL, cadence_text(sent)) if sent else 0
    read = len(calls) if answered else 0
    only = streams.get(calls[0]["id"]) if len(calls) == 1 else None
    low = received_from_the_lost_instance(result, {"ended": "lost", "segment": 0}, read, only) or 0
    return low, high


def match_lost_requests(rows: list[dict], wanted: list[tuple[int, int]], cut_uncalled: int) -> dict[str, Any]:
    """A caller's ledger rows linked to no request (``rows``: none carries the id of an upstream call
    a request made, and no stream record links them) against its requests that called the upstream
    and have no row (``wanted``: the bounds of each one's completion tokens, ``lost_bounds``): a
    request whose every segment was lost with its instance is charged without the upstream's id,
    so they are matched by count and amount: each request one request id's rows, their completion
    tokens within its bounds. Besides those, an attempt cut before any answer that no upstream
    call came of (``cut_uncalled``: its instance killed between the admission and the call) may
    have a row: its instance's journal listed it before the call (journal.py), and the recovery,
    not knowing whether the call went out, charges its prompt (``lost``, no completion token).
    Each extra row must be such a prompt-only one, at most one per such attempt. Returns
    ``orphans`` (the requests of ``rows``), ``cut_uncalled`` (the rows of such attempts),
    ``within`` (requests matched within their bounds) and, when they do not match, ``failure``
    and ``by`` (with ``charged`` and ``bounds`` for an amount that fits no request)."""
    completion: dict[str, int] = {}
    for row in rows:
        rid = str(row.get("request_id"))
        completion[rid] = completion.get(rid, 0) + int(row.get("completion_tokens") or 0)
    orphans = len(completion)
    prompt_only = sum(1 for c in completion.values() if c == 0)
    extra = orphans - len(wanted)
    if extra < 0:
        return {"orphans": orphans, "failure": "requests_missing_from_ledger", "by": -extra}
    if extra > min(prompt_only, cut_uncalled):
        return {"orphans": orphans, "failure": "rows_of_no_request", "by": extra - min(prompt_only, cut_uncalled)}
    # The extra rows are prompt-only ones (any of them: alike); each request then takes the smallest
    # charge left that is within its bounds, the one that ends lowest first (a matching, if any is).
    charged = sorted(completion.values())
    for _ in range(extra):
        charged.remove(0)
    left = list(charged)
    unmatched = 0
    for low, high in sorted(wanted, key=lambda b: (b[1], b[0])):
        fits = next((c for c in left if low <= c <= high), None)
        if fits is None:
            unmatched += 1
        else:
            left.remove(fits)
    out: dict[str, Any] = {"orphans": orphans, "cut_uncalled": extra, "within": len(wanted) - unmatched}
    if unmatched:
        out.update(
            failure="lost_rows_charged_outside_what_their_requests_got_and_sent",
            by=unmatched,
            charged=charged,
            bounds=sorted(wanted),
        )
    return out


def held_of(row: dict) -> int:
    """What instances hold of a counter row (its ``holds``: ``<instance>=<held>/...``)."""
    return sum(int(item.split("=")[1].split("/")[0]) for item in str(row.get("holds") or "").split())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long clients send requests (default 5)")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients (default 12)")
    p.add_argument("--seed", type=int, default=None, help="replay a run (default: a new one, printed)")
    p.add_argument("--events", default=",".join(EVENTS), help=f"which chaos events (default: {','.join(EVENTS)})")
    p.add_argument("--max-events", type=int, default=1000, help="at most this many chaos events")
    p.add_argument(
        "--interval",
        type=float,
        nargs=2,
        default=(8.0, 15.0),
        metavar=("LOW", "HIGH"),
        help="seconds between chaos events (default 8 15)",
    )
    p.add_argument("--max-requests", type=int, default=100_000, help="per client")
    p.add_argument("--logs", default=None, help="where the servers' logs and report.json go (default: a temp dir)")
    args = p.parse_args(argv)
    unknown = set(args.events.split(",")) - set(EVENTS) - {""}
    if unknown:
        p.error(f"unknown events: {', '.join(sorted(unknown))}")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(10**6)
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
