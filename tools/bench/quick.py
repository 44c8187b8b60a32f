"""``make bench-quick``: the CPU each streamed delta costs in this app's process against the floor's
(the bare relay, tools/bench/floor/), in-process, in under a minute; for A/B runs of a change.

    .venv/bin/python tools/bench/quick.py [--rounds 7] [--streams 200] [--long 200] [--deltas 40]
                                          [--variant NAME=git:REF|patch:FILE|DIR|env:NAME=VALUE,...]
                                          [--profile FILE [--profile-streams short]] [--kept]
                                          [--route chat|openai] [--obfuscated] [--filtered] [--instructions]

A recorded stream of the scripted upstream (tools/fakeupstream, scenario ``cadence``: a role chunk,
the content chunks, the finish, the usage, ``[DONE]``; one event per network read) is replayed
through each path's whole request, in one process, one stream after another (``--obfuscated``: its
chunks with choices carry OpenAI's ``obfuscation``, a random string after them, as OpenAI's do;
``--filtered``: their choice Azure's ``content_filter_results``, as Azure OpenAI's do):

* **app**: ``POST /api/chat`` (``--route openai``: ``POST /api/v1/chat/completions`` with ``stream:
  true``, as the OpenAI SDKs call it) through the ASGI handler the function app routes to
  (chatstream/app.py, no pipeline steps, no caller keys): request parsing, the SDK's request and chunk handling over our
  transport, the stream core, continuation bookkeeping, the encoder, the record, the response's writes;
* **floor**: the floor's relay and response (tools/bench/floor/function_app.py) on the same request;
* each ``--variant``: the app from another tree (``git:REF``, ``patch:FILE``, a folder), as run.py's,
  or this tree's with app settings of its own (``env:NAME=VALUE,...``: ``env:BLOCKED_TERMS=x``, say).

Only the network is replaced: aiohttp's session hands out the recorded pieces, one per read (one
turn of the event loop each, as a socket read wakes the reader), and ASGI ``send`` takes the bytes.
Both paths pay that the same. Each path runs in a process of its own, warmed up. A round streams,
per path, ``--streams`` answers of ``--long`` deltas and as many of ``SHORT`` deltas, in blocks:
every path's block in turn, the lengths alternating (a drift of the machine's load hits every path
alike), each block timed with ``time.process_time`` in its process. Printed, from the median block
of each length and from the quickest one (the least disturbed by the machine's other load): the CPU
per delta (the slope between the two lengths), per stream (the rest: the request, the first and last
events), all-in per delta for streams of ``--deltas``, each path's ratio to the floor, and the app's
to each variant. ``--profile FILE`` writes cProfile statistics (process time) of one block of the
app's long streams instead. ``--kept``: every app path keeps its streams' texts, as a keyed
request's are kept (the generated text its charge counts): an after-step that does nothing.

CPU time counts only this process, so the machine's other load moves these figures less than
wall-clock ones, but it still does (caches, frequency): compare paths of one run. The other load
(cores busy with processes not this script's, from /proc/stat) is recorded per round and printed.

``--instructions``: instead of the timed rounds, the instructions one block of each length runs
(valgrind's callgrind, each path's child under it, counting only the block), per delta and per
stream as above: counted, not timed, so the machine's other load does not move them (runs of one
tree repeat within ~0.2%: an A/B of a 1% change, which the timed rounds lose in the noise of a busy
2-core machine). About 2 minutes for two trees. Needs valgrind.

Then, unless ``--bursts 0``, the first delta under a burst, in-process: ``burst.py`` (300 requests at
once on one loop, the upstream's cadence, process CPU time) for the app and each git/patch/folder
``--variant``, runs alternating: each tree's added time to first delta p99 (the CPU-time share: the
work done before a request's first delta is written), the collector's CPU and longest pause in the
bursts, CPU per stream; medians over the runs with their lowest and highest. About 20 s a run.

Then, unless ``--pairs 0``, the end-to-end figures: ``tools/bench/run.sh`` serves the floor and the
app (and each git/patch/folder ``--variant``) on devhost, ``--pairs`` waves each of 100 and 300
concurrent streams, the paths alternating wave by wave (the order rotating), and ``ab.py`` pairs
each app wave with the floor's of the same round: CPU per stream, the worker's, added first-delta
p50 / p99, as medians of the pairs with their lowest and highest, and the other load during them.
A single end-to-end run decides nothing on this machine (the floor itself moves 25-50% between
runs); the pairs' ratios and their spread do. About 2 minutes; needs tools/bench/.venv (``make
bench`` makes it; skipped with a note when it is missing).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.util
import json
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
SHORT = 4  # deltas of the short streams (the per-delta figure is the slope between the two lengths)
BLOCKS = 4  # each length's streams in this many blocks, the lengths alternating
WARMUP = 30  # streams before timing (imports done, caches filled)
BASE_URL = "http://127.0.0.1:9/v1"  # never dialled: the session below answers
PROMPT = {"prompt": "Say something."}
OPENAI = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": PROMPT["prompt"]}], "stream": True}
ROUTES = {"chat": ("/api/chat", "chat"), "openai": ("/api/v1/chat/completions", "chat_completions")}
if sys.path and Path(sys.path[0]).resolve() == BENCH:  # the stdlib's profile, not tools/bench/profile.py
    del sys.path[0]


# --- the child: one path, one round ----------------------------------------------------------------


def record(deltas: int, obfuscated: bool = False, filtered: bool = False) -> list[bytes]:
    """The scripted upstream's answer to the app's request, one event per piece (as the cadence
    scenario writes them: one write per chunk); ``obfuscated``: OpenAI's padding in each chunk with
    choices; ``filtered``: Azure's filter results in its choice."""
    from tools.fakeupstream.scenarios import Cadence
    from tools.fakeupstream.server import create_app

    upstream = create_app("cadence", Cadence(0, 0, deltas, 0))
    body = json.dumps(
        {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": PROMPT["prompt"]}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    out = bytearray()

    async def send(message: dict) -> None:
        out.extend(message.get("body", b""))

    asyncio.run(upstream(_scope("/v1/chat/completions", body), _receiver(body), send))
    events = [event for event in bytes(out).split(b"\n\n") if event]
    if obfuscated:
        events = [
            event[:-1] + b',"obfuscation":"%s"}' % b"aZ3k9QxT"[: 1 + i % 8] if b'"choices":[{' in event else event
            for i, event in enumerate(events)
        ]
    if filtered:
        results = b",".join(
            b'"%s":{"filtered":false,"severity":"safe"}' % name
            for name in (b"hate", b"self_harm", b"sexual", b"violence")
        )
        events = [
            event.replace(b'"logprobs":', b'"content_filter_results":{%s},"logprobs":' % results) for event in events
        ]
    return [event + b"\n\n" for event in events]


def _scope(path: str, body: bytes) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # uvicorn's
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 7071),
    }


def _receiver(body: bytes, gone: asyncio.Event | None = None):
    """ASGI receive: the body, then nothing until the caller hangs up (``gone`` set; never, by
    default: a caller who stays, the wait cancelled when the response is over)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    return receive


class _Content:
    """The upstream body as aiohttp's reader hands it out: one recorded piece per read, each read
    one turn of the event loop."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = iter(pieces)
        self._eof = False

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        piece = next(self._pieces, b"")
        self._eof = not piece
        return piece

    def at_eof(self) -> bool:
        return self._eof

    async def iter_any(self):
        while piece := await self.readany():
            yield piece


class _Response:
    status = 200
    reason = "OK"
    raw_headers = ((b"Content-Type", b"text/event-stream; charset=utf-8"), (b"x-request-id", b"req_bench"))

    def __init__(self, pieces: list[bytes]) -> None:
        self.content = _Content(pieces)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class ReplaySession:
    """aiohttp.ClientSession for both paths (the app's transport calls ``request``, the floor
    ``post``): every request is answered with ``pieces``."""

    pieces: ClassVar[list[bytes]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def request(self, method: str, url: str, **kwargs: object) -> _Response:
        return _Response(ReplaySession.pieces)

    def post(self, url: str, **kwargs: object) -> _Response:
        json.dumps(kwargs.get("json")).encode()  # what aiohttp's JSON payload does with it
        return _Response(ReplaySession.pieces)

    async def close(self) -> None:
        pass


def _handler(path: str, settings_env: dict[str, str], kept: bool = False, route: str = "chat"):
    """``async (scope, receive, send)`` for one request of ``path`` (app or floor) on the app's
    ``route`` (``ROUTES``); ``kept``: the app's pipeline has an after-step (that does nothing), so its
    streams keep their texts as a keyed request's do (``--kept``)."""
    from starlette.requests import Request

    if path == "floor":
        os.environ["OPENAI_BASE_URL"] = BASE_URL
        spec = importlib.util.spec_from_file_location("bench_floor", BENCH / "floor" / "function_app.py")
        assert spec is not None and spec.loader is not None
        floor = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(floor)

        async def serve_floor(scope, receive, send) -> None:
            request = Request(scope, receive)
            body = json.loads(await request.body())  # the floor's route, as it reads the request
            response = floor._Closing(floor._relay(body), media_type="text/event-stream", headers=floor.SSE)
            await response(scope, receive, send)

        return serve_floor

    from chatstream.app import create_app
    from chatstream.pipeline import Pipeline
    from chatstream.settings import Settings

    environ = {"OPENAI_BASE_URL": BASE_URL, "OPENAI_API_KEY": "sk-bench", **settings_env}
    settings = Settings.from_env(environ)
    pipeline = Pipeline.from_settings(settings)
    if kept:
        pipeline.after(lambda result: None)
    chat_app = create_app(settings, pipeline, environ=environ)
    endpoint = getattr(chat_app, ROUTES[route][1])

    async def serve_app(scope, receive, send) -> None:
        response = await endpoint(Request(scope, receive))
        await response(scope, receive, send)

    return serve_app


async def _streams(serve, n: int, body: bytes, url: str) -> int:
    """``n`` requests of ``url`` one after another; the bytes written."""
    written = 0

    async def send(message: dict) -> None:
        nonlocal written
        written += len(message.get("body", b""))

    for _ in range(n):
        await serve(_scope(url, body), _receiver(body), send)
    return written


def child(args: argparse.Namespace) -> None:
    """One path in a process of its own: warms up, says ``ready``, then for each line on stdin,
    ``long`` or ``short``, streams a block of that length and answers the process CPU seconds it took
    (``KIND FILE``: that block under cProfile, into FILE; ``KIND count``: that block counted by
    callgrind, the process running under it with counting off)."""
    import aiohttp

    aiohttp.ClientSession = ReplaySession  # type: ignore[misc] - the network, replaced for both paths
    pieces = {kind: record(n, args.obfuscated, args.filtered) for kind, n in (("long", args.long), ("short", SHORT))}
    route = "chat" if args.path == "floor" else args.route  # the floor has its one route
    url = ROUTES[route][0]
    body = json.dumps(OPENAI if route == "openai" else PROMPT).encode()

    async def main() -> None:
        serve = _handler(args.path, dict(item.split("=", 1) for item in args.env), args.kept, route)
        ReplaySession.pieces = pieces["long"]
        out = await _streams(serve, WARMUP, body, url)
        assert out > args.long * 10, f"{args.path}: the warm-up streamed {out} bytes"
        print("ready", flush=True)
        for line in sys.stdin:
            kind, _, profile = line.strip().partition(" ")
            ReplaySession.pieces = pieces[kind]
            profiler = None
            if profile == "count":
                _instrument("on")
            elif profile:
                import cProfile

                profiler = cProfile.Profile(time.process_time)  # CPU: not the time other processes took
                profiler.enable()
            cpu = time.process_time()
            await _streams(serve, args.streams // BLOCKS, body, url)
            took = time.process_time() - cpu
            if profile == "count":
                _instrument("off")
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(profile)
            print(took, flush=True)

    asyncio.run(main())


def _instrument(state: str) -> None:
    """Callgrind's counting on or off for this process (``--instructions``)."""
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], capture_output=True, check=True)


# --- the driver --------------------------------------------------------------------------------


class _Child:
    """A child process serving one path from one tree."""

    def __init__(
        self, path: str, tree: Path, settings_env: str, args: argparse.Namespace, under: Sequence[str] = ()
    ) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
        for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "UPSTREAMS", "AZURE_OPENAI_ENDPOINT", "AzureWebJobsStorage"):
            env.pop(name, None)
        self.patience = 900.0 if under else 120.0  # seconds an answer may take (valgrind: ~50x slower)
        command = [*under, sys.executable, str(Path(__file__).resolve()), "--child", path]
        command += ["--streams", str(args.streams), "--long", str(args.long)]
        command += [arg for item in settings_env.split(",") if item for arg in ("--env", item)]
        command += ["--kept"] if args.kept else []
        command += ["--route", args.route] + (["--obfuscated"] if args.obfuscated else [])
        command += ["--filtered"] if args.filtered else []
        self.name = f"{path} ({tree})"
        self.proc = subprocess.Popen(
            command, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if self._line(self.patience) != "ready":
            raise SystemExit(f"{self.name} did not start")

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.close()
            raise SystemExit(f"{self.name}: no answer in {timeout:.0f} s")
        line = self.proc.stdout.readline().strip()
        if not line:
            self.close()
            raise SystemExit(f"{self.name} ended")
        return line

    def block(self, command: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return float(self._line(self.patience))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(self.patience / 12)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_procstat = None


def _busy() -> tuple[float, float, float]:
    """(machine busy CPU s, this script's tree's CPU s, monotonic s): two of these give the other load."""
    global _procstat
    if _procstat is None:  # tools/bench/procstat.py, by its path (this folder is off sys.path: see above)
        spec = importlib.util.spec_from_file_location("bench_procstat", BENCH / "procstat.py")
        assert spec is not None and spec.loader is not None
        _procstat = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_procstat)
    procstat = _procstat
    return procstat.machine_busy_seconds()[0], procstat.tree_cpu_seconds(os.getpid()), time.monotonic()


def _other(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Cores kept busy by processes that are not this script's (or its children) between two ``_busy``."""
    span = after[2] - before[2]
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / span) if span > 0 else 0.0


def bursts(args: argparse.Namespace, trees: dict[str, Path]) -> None:
    """burst.py for each tree (module docstring), ``args.bursts`` runs each, the trees alternating."""
    keys = ("added p99", "send p99", "gc ms", "gc longest ms", "cpu ms/stream")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    names = list(trees)
    for r in range(args.bursts):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            command = [sys.executable, str(BENCH / "burst.py"), "--streams", "300", "--bursts", "5", "--json"]
            command += ["--app-tree", str(trees[name])]
            before = _busy()
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                print(f"burst.py ({name}) failed: {done.stderr[-500:]}")
                return
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(result["app"] | {"other": _other(before, _busy()), "floor": result["floor"]})
    print(
        f"\n300 requests at once, in-process (burst.py: 5 bursts a run, {args.bursts} runs per tree, alternating): "
        "medians over the runs [lowest, highest], ms"
    )
    print("\n| app from | " + " | ".join(keys) + " | added p99 ÷ floor's | other load (cores) |")
    print("|---|" + "---|" * (len(keys) + 2))
    for name, rows in runs.items():

        def cell(values: list[float]) -> str:
            return f"{statistics.median(values):.1f} [{min(values):.1f}, {max(values):.1f}]"

        cells = [cell([row[k] for row in rows]) for k in keys]
        ratio = [row["added p99"] / row["floor"]["added p99"] for row in rows]
        other = statistics.median(row["other"] for row in rows)
        print(f"| {name} | " + " | ".join(cells) + f" | {statistics.median(ratio):.2f}× | {other:.2f} |")


def instructions(args: argparse.Namespace, paths: dict[str, tuple[str, Path, str]]) -> None:
    """``--instructions`` (module docstring): one block of each length per path, each in a child
    under callgrind, two at a time."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (callgrind and callgrind_control)")
    started = time.monotonic()

    def counted(job: tuple[str, str]) -> int:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "callgrind.out"
            under = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
            one = _Child(*paths[job[0]], args, under=under)
            try:
                one.block(f"{job[1]} count")
            finally:
                one.close()
            totals = re.search(r"^totals: (\d+)", out.read_text(), re.M)
            if totals is None:
                raise SystemExit(f"callgrind wrote no totals for {job}")
            return int(totals[1])

    jobs = [(name, kind) for name in paths for kind in ("long", "short")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        counts = dict(zip(jobs, pool.map(counted, jobs), strict=True))
    streams = args.streams // BLOCKS
    figures = {}
    for name in paths:
        per_delta = (counts[name, "long"] - counts[name, "short"]) / (streams * (args.long - SHORT))
        figures[name] = (per_delta, counts[name, "short"] / streams - per_delta * SHORT)
    print(
        f"\ninstructions (callgrind), in-process replay ({ROUTES[args.route][0]}): a block of {streams} streams of "
        f"{args.long} and of {SHORT} deltas per path\n"
    )
    print("| path | per delta | per stream | ÷ floor: per delta, per stream |")
    print("|---|---|---|---|")
    for name, (delta, stream) in figures.items():
        floor = figures["floor"]
        print(f"| {name} | {delta:,.0f} | {stream:,.0f} | {delta / floor[0]:.3f}×, {stream / floor[1]:.3f}× |")
    for name in list(paths)[2:]:
        app, other = figures["app"], figures[name]
        print(f"\napp ÷ {name}: per delta {app[0] / other[0]:.4f}, per stream {app[1] / other[1]:.4f}")
    print(f"\n({time.monotonic() - started:.0f} s)")


def served_pairs(args: argparse.Namespace) -> None:
    """The end-to-end pairs (module docstring): run.sh, then ab.py floor against app and each variant."""
    bench_python = BENCH / ".venv" / "bin" / "python"
    if not bench_python.exists():
        print("\nend-to-end pairs skipped: tools/bench/.venv is missing (`make bench` creates it)")
        return
    out = BENCH / "out" / "quick-served"
    variants = [v for v in args.variant if not v.partition("=")[2].startswith("env:")]
    command = [str(BENCH / "run.sh"), "--paths", "direct,floor,app", "--levels", "100,300"]
    command += ["--waves", f"100:{args.pairs},300:{args.pairs}", "--short-waves", "0", "--cold-starts", "0"]
    command += ["--no-client-check", "--wait-quiet", "0", "--settle", "0.5", "--no-docs", "--out", str(out)]
    command += [arg for v in variants for arg in ("--variant", v)]
    print(f"\nend-to-end pairs: {' '.join(command[1:])} (log: {out}.log)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "w") as log:
        code = subprocess.call(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    if code != 0:
        print(f"run.sh failed ({code}): see {out}.log")
        return
    for a, b in [("floor", "app")] + [(v.partition("=")[0], "app") for v in variants]:
        subprocess.call([str(bench_python), str(BENCH / "ab.py"), str(out / "results.json"), a, b], cwd=ROOT)


def _figures(t: dict, args: argparse.Namespace) -> dict:
    """µs per delta (slope), µs per stream (intercept), µs per delta all-in at --deltas."""
    streams = args.streams // BLOCKS * BLOCKS  # of each length
    per_delta = (t["long"] - t["short"]) / (streams * (args.long - SHORT))
    per_stream = t["short"] / streams - per_delta * SHORT
    return {
        "delta": per_delta * 1e6,
        "stream": per_stream * 1e6,
        "all_in": (per_delta + per_stream / args.deltas) * 1e6,
    }


def _paired(app: dict[str, list[float]], other: dict[str, list[float]], args: argparse.Namespace) -> list[list[float]]:
    """The app's figures ÷ another path's, round by round (the blocks of one round ran side by side,
    so a change in the machine's load between rounds cancels out): per delta, per stream, all-in."""
    out: list[list[float]] = [[], [], []]
    for r in range(args.rounds):
        one = slice(r * BLOCKS, (r + 1) * BLOCKS)
        mine = _figures({kind: sum(times[one]) for kind, times in app.items()}, args)
        theirs = _figures({kind: sum(times[one]) for kind, times in other.items()}, args)
        for i, key in enumerate(("delta", "stream", "all_in")):
            out[i].append(mine[key] / theirs[key])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--streams", type=int, default=200, help="streams of each length per round")
    p.add_argument("--deltas", type=int, default=40, help="content deltas of a stream, for the all-in figure")
    p.add_argument("--long", type=int, default=200, help="content deltas of the long streams")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="git:REF, patch:FILE, DIR or env:NAME=VALUE,...",
    )
    p.add_argument("--profile", metavar="FILE", help="cProfile one app block of long streams into FILE, then stop")
    p.add_argument(
        "--profile-streams",
        choices=("long", "short"),
        default="long",
        help="which block --profile profiles: short streams show the per-stream work",
    )
    p.add_argument(
        "--bursts",
        type=int,
        default=3,
        help="burst.py runs per tree (300 requests at once, in-process; 0: none; ~20 s a run)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=4,
        help="end-to-end waves per path at 100 and at 300 streams, paired with the floor's (0: none; ~2 minutes)",
    )
    p.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions (valgrind's callgrind) instead of timing: per delta and per stream, once per path",
    )
    p.add_argument("--child", choices=("app", "floor"), help=argparse.SUPPRESS)
    p.add_argument("--env", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument(
        "--kept",
        action="store_true",
        help="the app's streams keep their texts, as a keyed request's do (an after-step that does nothing)",
    )
    p.add_argument(
        "--route",
        choices=tuple(ROUTES),
        default="chat",
        help="the app's route: /api/chat, or openai: /api/v1/chat/completions (stream: true); the floor's is its own",
    )
    p.add_argument(
        "--obfuscated", action="store_true", help="the recorded chunks carry OpenAI's obfuscation field, as OpenAI's do"
    )
    p.add_argument(
        "--filtered", action="store_true", help="the recorded chunks' choice carries Azure's content_filter_results"
    )
    args = p.parse_args()
    if args.child:
        args.path = args.child
        child(args)
        return
    if args.profile:
        app = _Child("app", ROOT, "", args)
        try:
            app.block(f"{args.profile_streams} {Path(args.profile).resolve()}")
        finally:
            app.close()
        print(f"wrote {args.profile}: .venv/bin/python -m pstats {args.profile}")
        return
    paths: dict[str, tuple[str, Path, str]] = {"floor": ("floor", ROOT, ""), "app": ("app", ROOT, "")}
    if args.variant:
        sys.path.insert(0, str(BENCH))
        import run

        for spec in args.variant:
            name, _, where = spec.partition("=")
            if where.startswith("env:"):
                paths[name] = ("app", ROOT, where[4:])
                continue
            paths[name] = ("app", Path(run.prepare_variant(name, where, BENCH / "out" / "quick")["dir"]), "")
    if args.instructions:
        instructions(args, paths)
        return
    started = time.monotonic()
    names = list(paths)
    children = {name: _Child(*spec, args) for name, spec in paths.items()}
    blocks: dict[str, dict[str, list[float]]] = {name: {"long": [], "short": []} for name in paths}
    others: list[float] = []  # the other load of each round (cores)
    try:
        for r in range(args.rounds):
            before = _busy()
            # Blocks of every path in turn, the lengths alternating: a drift of the machine hits all alike.
            for b in range(BLOCKS * 2):
                kind = "long" if b % 2 == 0 else "short"
                turn = (r + b) % len(names)
                for name in names[turn:] + names[:turn]:
                    blocks[name][kind].append(children[name].block(kind))
            others.append(_other(before, _busy()))
            print(
                f"round {r + 1}/{args.rounds} done ({time.monotonic() - started:.0f} s, "
                f"other load {others[-1]:.2f} cores)",
                file=sys.stderr,
            )
    finally:
        for one in children.values():
            one.close()
    # Each figure from the median block of each length, and from the quickest (the least disturbed).
    stats = {"median": statistics.median, "min": min}
    figures = {
        (name, stat): _figures({kind: f(times) * BLOCKS for kind, times in kinds.items()}, args)
        for name, kinds in blocks.items()
        for stat, f in stats.items()
    }
    keys = ("delta", "stream", "all_in")
    print(
        f"\nin-process replay ({ROUTES[args.route][0]}): {args.rounds} rounds of {args.streams} streams of {args.long} and of {SHORT} "
        f"deltas, in blocks of {args.streams // BLOCKS}; process CPU of the median block / of the quickest block\n"
    )
    print(
        f"| path | µs per delta | µs per stream | µs per delta all-in ({args.deltas}) "
        "| ÷ floor: per delta, per stream, all-in |"
    )
    print("|---|---|---|---|---|")
    for name in names:
        row = [" / ".join(f"{figures[name, stat][key]:.1f}" for stat in stats) for key in keys]
        ratios = [
            " / ".join(f"{figures[name, stat][key] / figures['floor', stat][key]:.2f}×" for stat in stats)
            for key in keys
        ]
        print(f"| {name} | " + " | ".join(row) + " | " + ", ".join(ratios) + " |")
    for name in names[2:]:
        ratios = [
            " / ".join(f"{figures['app', stat][key] / figures[name, stat][key]:.3f}" for stat in stats) for key in keys
        ]
        print(f"\napp ÷ {name}: per delta {ratios[0]}, per stream {ratios[1]}, all-in {ratios[2]}")
    print()
    for name in [n for n in names if n != "app"]:
        paired = _paired(blocks["app"], blocks[name], args)
        print(
            f"app ÷ {name}, paired (each round's blocks against the same round's, median of {args.rounds} "
            "rounds [lowest, highest]): "
            + ", ".join(
                f"{label} {statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"
                for label, values in zip(("per delta", "per stream", "all-in"), paired, strict=True)
            )
        )
    print(
        f"other load during the rounds (cores busy with processes not this script's): median "
        f"{statistics.median(others):.2f} [{min(others):.2f}, {max(others):.2f}]"
    )
    print(f"\n({time.monotonic() - started:.0f} s)")
    if args.bursts:
        bursts(args, {name: tree for name, (path, tree, env) in paths.items() if path == "app" and not env})
    if args.pairs:
        served_pairs(args)


if __name__ == "__main__":
    main()
