"""A burst, in-process: ``--streams`` requests arriving at once on one event loop, through the app's
``POST /api/chat`` and through the floor's relay (quick.py's replay: only the network replaced), bursts
of the two paths alternating in one process. The upstream answers each request ``--first-ms`` after
it was sent, then one event every ``--interval-ms`` (as the scripted upstream's cadence scenario).

Time is the process's CPU time (``time.process_time``): on one event loop, what delays a request is
the work the loop does before its turn, and CPU time counts that without the machine's other load
(which stretches wall-clock figures several times on a busy 2-core machine). Per request: ``send``,
the CPU from the burst's start until its upstream request is sent; ``relay``, from its first content
delta being read until that delta is written; **added** = send + relay, the CPU-time share of its
added time to first delta. Printed per path: the medians over the bursts of each burst's p50 and p99
of these, and the process CPU per stream of a burst (whole streams). Compare paths within one run.

    .venv/bin/python tools/bench/burst.py [--streams 100] [--bursts 10] [--profile FILE]

``--profile FILE``: cProfile (process time) of one app burst from its start until its last upstream
request is sent, into FILE. ``--app-tree DIR``: the app (chatstream) from another tree (a variant
run.py or quick.py exported), the floor and this script from this one. ``--json``: a last line with
the printed medians, for quick.py's A/B.

``--instructions``: the instructions the process runs (valgrind's callgrind, ~20 s a path) from one
burst's start until its last upstream request is sent, per request, for the floor and the app (after
three bursts to warm up), and their ratio: the same figure as send p99's CPU, the collector's work
included, but counted, not timed, so the machine's other load does not move it (a timed A/B of a 3%
change is lost in it on a busy 2-core machine; this one repeats to ~0.1%). Needs valgrind."""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parents[1]))
sys.path.insert(0, str(BENCH))
import quick  # noqa: E402  (tools/bench/quick.py: the replay)

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]  # the stdlib's profile, not ours


class _TimedContent(quick._Content):
    """The recorded pieces: the role chunk at once, the first content ``first`` s after the request
    was sent, then one every ``interval`` s (the cadence scenario's timing)."""

    def __init__(self, pieces: list[bytes], sent: float, first: float, interval: float, index: int) -> None:
        super().__init__(pieces)
        self._due = sent
        self._next = first
        self._interval = interval
        self._index = index
        self._read = 0

    async def readany(self) -> bytes:
        wait = self._due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        else:
            await asyncio.sleep(0)
        self._due += self._next
        self._next = self._interval
        self._read += 1
        if self._read == 2:  # the first content delta, handed to the reader
            BurstSession.arrived[self._index] = time.process_time()
        piece = next(self._pieces, b"")
        self._eof = not piece
        return piece


class _TimedResponse(quick._Response):
    def __init__(self, pieces: list[bytes], sent: float, first: float, interval: float, index: int) -> None:
        self.content = _TimedContent(pieces, sent, first, interval, index)


_index: contextvars.ContextVar[int] = contextvars.ContextVar("index")


class BurstSession(quick.ReplaySession):
    first = 0.1
    interval = 0.02
    sent: list[float] = []  # noqa: RUF012 - per burst, each request's send time (process CPU)
    arrived: list[float] = []  # noqa: RUF012 - and when its first content delta was read (process CPU)
    on_all_sent = None  # called when the burst's last request is sent

    def _answer(self) -> quick._Response:
        index = _index.get()
        BurstSession.sent[index] = time.process_time()
        if BurstSession.on_all_sent is not None and all(BurstSession.sent):
            BurstSession.on_all_sent()
        return _TimedResponse(quick.ReplaySession.pieces, time.perf_counter(), self.first, self.interval, index)

    async def request(self, method: str, url: str, **kwargs: object) -> quick._Response:
        return self._answer()

    def post(self, url: str, **kwargs: object) -> quick._Response:
        json.dumps(kwargs.get("json")).encode()
        return self._answer()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _burst(serve, n: int, body: bytes, hang_up: bool) -> dict[str, list[float]]:
    """``n`` requests at once; per request its arrival → first delta written, and the send times."""
    BurstSession.sent = [0.0] * n
    BurstSession.arrived = [0.0] * n
    start = time.process_time()
    firsts: list[float] = [0.0] * n

    async def one(i: int) -> None:
        _index.set(i)
        done = asyncio.Event()

        async def send(message: dict) -> None:
            if not firsts[i] and b'"delta"' in message.get("body", b""):
                firsts[i] = time.process_time() - start
                if hang_up:
                    done.set()

        await serve(quick._scope("/api/chat", body), quick._receiver(body, done), send)

    await asyncio.gather(*(one(i) for i in range(n)))
    return {
        "first": firsts,
        "send": [t - start for t in BurstSession.sent],
        "arrived": [t - start for t in BurstSession.arrived],
    }


def _instrument(state: str) -> None:
    """Callgrind's counting on or off for this process (it started with it off)."""
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], capture_output=True, check=True)


def _all_sent_counted() -> None:
    BurstSession.on_all_sent = None  # once
    _instrument("off")


def _instructions(args: argparse.Namespace) -> None:
    """``--instructions``: each path's burst counted in a child under callgrind (module docstring)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (callgrind and callgrind_control)")
    per_request = {}
    for path in ("floor", "app"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "callgrind.out"
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
            command += [sys.executable, __file__, "--counted", path, "--streams", str(args.streams)]
            command += ["--deltas", str(args.deltas), "--first-ms", str(args.first_ms)]
            command += ["--interval-ms", str(args.interval_ms)]
            command += ["--app-tree", args.app_tree] if args.app_tree else []
            subprocess.run(command, check=True, capture_output=True, timeout=900)
            totals = re.search(r"^totals: (\d+)", out.read_text(), re.M)
            if totals is None:
                raise SystemExit(f"callgrind wrote no totals for the {path}")
            per_request[path] = int(totals[1]) / args.streams
    print(f"\n{args.streams} requests at once: instructions from the burst's start until its last upstream request")
    print(f"is sent, per request: floor {per_request['floor']:,.0f}, app {per_request['app']:,.0f}", end="")
    print(f" ({per_request['app'] / per_request['floor']:.2f}x)")
    if args.json:
        print(json.dumps({"instructions per request": per_request}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--bursts", type=int, default=10, help="bursts per path")
    p.add_argument("--deltas", type=int, default=40)
    p.add_argument("--first-ms", type=float, default=100)
    p.add_argument("--interval-ms", type=float, default=20)
    p.add_argument("--profile", metavar="FILE")
    p.add_argument("--app-tree", metavar="DIR", help="import chatstream from this tree")
    p.add_argument("--json", action="store_true", help="a last line of JSON: the medians printed")
    p.add_argument("--instructions", action="store_true", help="count instructions until the last send (valgrind)")
    p.add_argument("--counted", choices=("floor", "app"), help=argparse.SUPPRESS)  # the child under callgrind
    args = p.parse_args()
    if args.instructions:
        _instructions(args)
        return
    if args.app_tree:
        sys.path.insert(0, str(Path(args.app_tree).resolve()))
    import aiohttp

    aiohttp.ClientSession = BurstSession  # type: ignore[misc]
    BurstSession.first, BurstSession.interval = args.first_ms / 1000, args.interval_ms / 1000
    quick.ReplaySession.pieces = quick.record(args.deltas)
    body = json.dumps(quick.PROMPT).encode()

    async def run() -> None:
        serves = {name: quick._handler(name, {}) for name in ("floor", "app")}
        from chatstream import memory

        if hasattr(memory, "started"):  # as function_app.py ends its start-up (a tree that has it)
            memory.started()
        for serve in serves.values():  # warm-up
            await _burst(serve, 20, body, False)
        if args.counted:  # under callgrind: one burst counted from its start to its last send
            for _ in range(3):
                await _burst(serves[args.counted], args.streams, body, False)
            BurstSession.on_all_sent = _all_sent_counted
            _instrument("on")
            await _burst(serves[args.counted], args.streams, body, False)
            return
        if args.profile:
            import cProfile

            profiler = cProfile.Profile(time.process_time)
            BurstSession.on_all_sent = profiler.disable  # the requests up to their upstream calls
            profiler.enable()
            await _burst(serves["app"], args.streams, body, True)
            profiler.disable()
            profiler.dump_stats(args.profile)
            print(f"wrote {args.profile}")
            return
        figures: dict[str, dict[str, list[float]]] = {name: {} for name in serves}
        pooled: dict[str, list[float]] = {name: [] for name in serves}  # every request's added, all bursts
        pauses: dict[str, list[float]] = {name: [] for name in serves}  # the garbage collector's, in bursts
        collector: list[float] = []
        began = [0.0]

        def timed(phase: str, info: dict) -> None:
            if phase == "start":
                began[0] = time.process_time()
            else:
                collector.append(time.process_time() - began[0])

        gc.callbacks.append(timed)
        for b in range(args.bursts):
            order = list(serves) if b % 2 == 0 else list(reversed(serves))
            for name in order:
                cpu = time.process_time()
                collector.clear()
                t = await _burst(serves[name], args.streams, body, False)
                cpu = time.process_time() - cpu
                pauses[name].extend(collector)
                await asyncio.sleep(0.05)
                send, first = t["send"], t["first"]
                relay = [f - a for f, a in zip(first, t["arrived"], strict=True)]
                added = [s + r for s, r in zip(send, relay, strict=True)]
                row = figures[name]
                for key, values in (("send", send), ("relay", relay), ("added", added)):
                    row.setdefault(key + " p50", []).append(_pct(values, 0.5) * 1000)
                    row.setdefault(key + " p99", []).append(_pct(values, 0.99) * 1000)
                row.setdefault("cpu ms/stream", []).append(cpu / args.streams * 1000)
                pooled[name].extend(added)
        keys = list(figures["app"])
        print(
            f"\n{args.streams} requests at once, {args.bursts} bursts per path; medians of the bursts' figures (ms)\n"
        )
        print("| path | " + " | ".join(keys) + " |")
        print("|---|" + "---:|" * len(keys))
        for name, row in figures.items():
            print(f"| {name} | " + " | ".join(f"{statistics.median(row[k]):.1f}" for k in keys) + " |")
        ratios = [statistics.median(figures["app"][k]) / statistics.median(figures["floor"][k]) for k in keys]
        print("| app ÷ floor | " + " | ".join(f"{r:.2f}×" for r in ratios) + " |")
        print("\nadded, every request of every burst (as run.py pools a level's waves): p50 / p99 / max ms")
        for name, values in pooled.items():
            print(f"  {name}: " + " / ".join(f"{_pct(values, q) * 1000:.1f}" for q in (0.5, 0.99, 1.0)))
        print("garbage collections during the bursts: count, total and longest ms")
        for name, values in pauses.items():
            print(f"  {name}: {len(values)}, {sum(values) * 1000:.1f}, {max(values, default=0) * 1000:.1f}")
        if args.json:
            out = {
                name: {k: statistics.median(v) for k, v in row.items()}
                | {"gc ms": sum(pauses[name]) * 1000, "gc longest ms": max(pauses[name], default=0) * 1000}
                for name, row in figures.items()
            }
            print(json.dumps(out))

    asyncio.run(run())


if __name__ == "__main__":
    main()
