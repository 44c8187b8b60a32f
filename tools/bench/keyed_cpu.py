"""What a keyed request costs this process in CPU over an unkeyed one (issue #44), in-process:

    .venv/bin/python tools/bench/keyed_cpu.py [--rounds 8] [--streams 40] [--concurrency 1]
        [--first-ms 0 --interval-ms 0] [--instructions] [--profile DIR]
        [--spy DIR [--spy-blocks 10] [--py-spy BIN]]

One process serves the app twice, as tools/bench/admission.py builds it: unkeyed and with
``CALLER_KEYS=required`` on a real Azurite started here (the caller without limits, the bench's
``keys`` path). The scripted upstream (its own process) sends ``--deltas`` deltas, at once by
default (a block costs its CPU, not its waits); ``--first-ms 100 --interval-ms 20`` is the bench's
cadence, under which the journal rewrites its open entries' checkpoints while the streams last.
Requests go through the ASGI handler (no HTTP server; the caller's side only counts bytes). A round
runs a block of ``--streams`` unkeyed streams and one of keyed streams (``--concurrency`` at once),
alternating which goes first; each block is timed with ``time.process_time`` (every thread of this
process: the upstream and Azurite are apart) up to its background charges written
(``Accounting.flush``). Printed per round: CPU per request of each, the garbage collector's passes
and the keyed app's store calls per request; then the keyed block's extra CPU per request (median
and range). The keyed app's timers (heartbeats, lease expiry) also run in the unkeyed blocks.

``--instructions``: each block's instructions (valgrind's callgrind: this process runs again under
it, counting only the blocks, its hash seed fixed, the collector run before each) instead of its
CPU time: counted, not timed, so the machine's other load does not move them (two runs of one tree
agree within 0.1%); an A/B of two trees is two runs, one after the other. About a minute with
``--rounds 2 --streams 20``. Needs valgrind.

``--profile DIR``: cProfile (process time) of one more block of each kind, ``DIR/plain.prof`` and
``DIR/keyed.prof``, and their difference by function (per request; cProfile inflates small calls).
``--spy DIR``: py-spy (sampling; it stops the process for each sample: none of its own CPU counts) on this process during ``--spy-blocks`` blocks of
each kind: the CPU per request by cause (``CAUSES``: the first keyed-only part in a sample's stack),
keyed against unkeyed."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # the stdlib's profile, not tools/bench/profile.py

import argparse
import asyncio
import cProfile
import gc
import json
import os
import pstats
import re
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import astuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools" / "bench"))
import quick  # noqa: E402  (tools/bench/quick.py: its ASGI receive; it takes its folder off the path again)

MODEL = "cadence"


def _scope(body: bytes, key: str | None) -> dict:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/chat",
        "raw_path": b"/api/chat",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 7071),
    }


async def _one(app, key: str | None, n: int) -> int:
    from starlette.requests import Request

    body = json.dumps({"prompt": f"bench {n}: say something."}).encode()
    written = 0
    status = 0

    async def send(message: dict) -> None:
        nonlocal written, status
        status = message.get("status", status)
        written += len(message.get("body", b""))

    scope = _scope(body, key)
    response = await app.chat(Request(scope, quick._receiver(body)))
    await response(scope, quick._receiver(body), send)
    assert status == 200, f"status {status}"
    return written


async def _block(app, key: str | None, streams: int, concurrency: int, counter: list[int]) -> None:
    for start in range(0, streams, concurrency):
        batch = range(start, min(streams, start + concurrency))
        counter[0] += len(batch)
        await asyncio.gather(*(_one(app, key, counter[0] + i) for i in batch))
    if key is not None:
        assert await app.state.accounting.flush(within=10), "charges not written in 10 s"


def _diff(plain: pstats.Stats, keyed: pstats.Stats, n: int, top: int = 40) -> None:
    def table(stats: pstats.Stats) -> dict[str, tuple[float, float, int]]:
        out = {}
        for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            short = file.split("/site-packages/")[-1].replace(str(ROOT) + "/", "")
            out[f"{func} ({short}:{line})"] = (tt, ct, nc)
        return out

    a, b = table(plain), table(keyed)
    rows = []
    for name in set(a) | set(b):
        ta, ca, na = a.get(name, (0.0, 0.0, 0))
        tb, cb, nb = b.get(name, (0.0, 0.0, 0))
        rows.append((cb - ca, tb - ta, (nb - na) / n, name))
    print(f"\nkeyed - plain, per request (ms; cProfile inflates): inclusive, self, calls: top {top} by inclusive")
    for dc, dt, dn, name in sorted(rows, reverse=True)[:top]:
        print(f"{dc / n * 1000:8.3f} {dt / n * 1000:8.3f} {dn:7.1f}  {name}")
    print(f"\ntop {top} by self")
    for dc, dt, dn, name in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"{dc / n * 1000:8.3f} {dt / n * 1000:8.3f} {dn:7.1f}  {name}")


# What a sample of the keyed app's is spent on: the first of these found in its stack, from the
# outside in (a store call made by the journal is the journal's), and apart whether it is inside a
# store call (the REST request and its answer).
CAUSES = (
    ("journal (accounting/journal)", ("state/journal.py",)),
    ("ledger rows (background charge)", ("state/ledger.py",)),
    ("counters: leases, reservations, flushes", ("state/counters.py", "state/counter_row.py")),
    ("charge (accounting._charge, settle)", ("_charge (", "_settle (")),
    ("key lookup (authenticate)", ("authenticated (", "authenticate (")),
    ("prompt token counting", ("chatstream/tokens.py",)),
    ("admission (admit, other)", ("admitted (", " admit (")),
    ("usage and cost", ("request_usage (", "cost_of (")),
    ("log line", ("log_line (", "logging/")),
    ("telemetry", ("chatstream/telemetry.py",)),
    ("registry, callers, prices", ("state/registry.py", "state/callers.py", "state/prices.py")),
    ("other state/", ("chatstream/state/",)),
)
STORE = ("state/store_azure.py", "state/store_account.py", "aiohttp/", "email/")


def _cause(stack: list[str]) -> str:
    for name, marks in CAUSES:
        if any(m in frame for frame in stack for m in marks):
            inside = any(m in frame for frame in stack for m in STORE)
            return f"{name}{': store calls' if inside else ''}"
    if any("aiohttp/" in frame for frame in stack):
        return "aiohttp outside a request (answers read: upstream and store)"
    return "rest of the request (HTTP, relay, encoder, runtime)"


async def _spy(args, paths, counter: list[int]) -> None:
    """py-spy (tools/bench/.venv's or on PATH) on this process while blocks of one kind run, each
    kind in turn: the CPU per request by cause (CAUSES), keyed against plain."""

    import shutil
    import signal

    spy = args.py_spy or shutil.which("py-spy") or str(ROOT / "tools/bench/.venv/bin/py-spy")
    args.spy.mkdir(parents=True, exist_ok=True)
    found: dict[str, dict[str, float]] = {}
    for app, key in paths:
        kind = "keyed" if key else "plain"
        out = args.spy / f"{kind}.txt"
        proc = await asyncio.create_subprocess_exec(
            *(spy, "record", "--pid", str(os.getpid()), "--rate", "500"),
            *("--format", "raw", "-o", str(out)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await asyncio.sleep(1.0)
        cpu, n = time.process_time(), 0
        for _ in range(args.spy_blocks):
            await _block(app, key, args.streams, args.concurrency, counter)
            n += args.streams
        cpu = time.process_time() - cpu
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)
        tally: dict[str, int] = {}
        for line in out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            cause = _cause(stack.split(";"))
            tally[cause] = tally.get(cause, 0) + int(count)
        total = sum(tally.values()) or 1
        found[kind] = {c: cpu * v / total / n * 1000 for c, v in tally.items()}
        found[kind]["(all)"] = cpu / n * 1000
    print(
        f"\nCPU ms per request by cause (py-spy samples x process time), keyed - plain, {args.spy_blocks} blocks each:"
    )
    for cause in sorted(set(found["keyed"]) | set(found["plain"]), key=lambda c: -found["keyed"].get(c, 0)):
        k, p = found["keyed"].get(cause, 0.0), found["plain"].get(cause, 0.0)
        print(f"{k - p:+8.3f}  (keyed {k:.3f}, plain {p:.3f})  {cause}")


class _Instructions:
    """Callgrind's count of this process's instructions a block at a time (``--instructions``: this
    process runs under callgrind, counting off but in the blocks), read from a dump after each."""

    def __init__(self, out: str) -> None:
        self.out = out  # callgrind's --callgrind-out-file: its dumps are OUT.1, OUT.2, ...
        self.dumps = 0

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(os.getpid())], capture_output=True, check=True)

    def start(self) -> None:
        self._control("--zero")
        self._control("--instr=on")

    def stop(self) -> int:
        self._control("--instr=off")
        self._control("--dump")
        self.dumps += 1
        totals = re.search(r"^totals: (\d+)", Path(f"{self.out}.{self.dumps}").read_text(), re.M)
        assert totals is not None, f"callgrind wrote no totals in {self.out}.{self.dumps}"
        return int(totals[1])


def _under_callgrind(args: argparse.Namespace) -> None:
    """``--instructions``: this script again, under callgrind (its children, Azurite and the
    upstream, are not), printing what it prints."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (callgrind and callgrind_control)")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "callgrind.out")
        under = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        env = {**os.environ, COUNTED: out, "PYTHONHASHSEED": "0"}
        done = subprocess.run([*under, sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env=env)
    if done.returncode != 0:
        raise SystemExit(done.returncode)


COUNTED = "KEYED_CPU_CALLGRIND_OUT"  # set in the run under callgrind: where its dumps go


class _GcTimes:
    """The garbage collector's passes (per generation: count, process time) while a block runs."""

    def __init__(self) -> None:
        self.passes: dict[int, list[float]] = {}
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def clear(self) -> None:
        self.passes = {}

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.passes.setdefault(info["generation"], []).append(time.process_time() - self._start)

    def summary(self, n: int) -> str:
        return " ".join(f"g{g}:{len(v) / n:.2f}x/{sum(v) / n * 1000:.3f}ms" for g, v in sorted(self.passes.items()))


GC = _GcTimes()


def _apps(upstream: str, store: str, counted: bool = False):
    """The app unkeyed and keyed (admission.py's settings, without its store instrumentation).
    ``counted`` (``--instructions``): the keyed app's timers (its heartbeats and duty, the caller
    cache's expiry) 20 times slower, so that callgrind's slowness does not bring more of their store
    calls into a block: a block's count is then the same from run to run."""
    from chatstream.app import create_app
    from chatstream.settings import Settings
    from chatstream.state.instances import InstanceTiming

    environ = {"OPENAI_BASE_URL": upstream, "OPENAI_API_KEY": "sk-keyedcpu", "OPENAI_MODEL": MODEL}
    keyed_env = {**environ, "AzureWebJobsStorage": store, "CALLER_KEYS": "required"}
    if counted:
        keyed_env["CALLER_CACHE_SECONDS"] = "30"  # (its bound)
    plain = create_app(Settings.from_env(environ), environ=environ)
    keyed = create_app(Settings.from_env(keyed_env), environ=keyed_env)
    if counted:
        assert keyed.state is not None
        keyed.state.instances.timing = InstanceTiming(*(20 * s for s in astuple(InstanceTiming())))
    return plain, keyed


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--deltas", type=int, default=40)
    parser.add_argument("--first-ms", type=float, default=0, help="the upstream's first delta after (bench: 100)")
    parser.add_argument("--interval-ms", type=float, default=0, help="between deltas (bench: 20)")
    parser.add_argument(
        "--instructions", action="store_true", help="count each block's instructions (callgrind), not its CPU time"
    )
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--spy", type=Path, help="py-spy of blocks of each kind into this folder")
    parser.add_argument("--spy-blocks", type=int, default=10)
    parser.add_argument("--py-spy", help="the py-spy binary (default: on PATH, else tools/bench/.venv's)")
    args = parser.parse_args()
    if args.instructions and COUNTED not in os.environ:
        _under_callgrind(args)
        return
    counting = _Instructions(os.environ[COUNTED]) if args.instructions else None
    unit = "instructions" if counting is not None else "ms"

    def shown(value: float, sign: str = "") -> str:
        return format(value, f"{sign},.0f" if counting is not None else f"{sign}.3f")

    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    from admission import setup_callers

    from tests.servers import Azurite, Upstream

    upstream = Upstream(
        "--first-token-ms", str(args.first_ms), "--interval-ms", str(args.interval_ms), "--deltas", str(args.deltas)
    )
    azurite = Azurite()
    try:
        plain, keyed = _apps(upstream.base_url, azurite.connection_string, counting is not None)

        async def run() -> None:
            keys = await setup_callers(keyed)
            assert keyed.state is not None
            store = keyed.state.store
            key = keys["keys"]
            counter = [0]
            for app, k in ((plain, None), (keyed, key)) * 2:  # warm-up
                await _block(app, k, args.streams, args.concurrency, counter)
            extra = []
            for r in range(args.rounds):
                took: dict[bool, float] = {}  # per request: ms of CPU, or instructions
                order = ((plain, None), (keyed, key)) if r % 2 == 0 else ((keyed, key), (plain, None))
                gcs, calls, system = {}, {}, {}
                for app, k in order:
                    GC.clear()
                    before = dict(getattr(store, "calls", {}))
                    sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
                    if counting is not None:
                        gc.collect()  # the collector's passes in the block the same from run to run
                        counting.start()
                        await _block(app, k, args.streams, args.concurrency, counter)
                        took[k is not None] = counting.stop() / args.streams
                    else:
                        t = time.process_time()
                        await _block(app, k, args.streams, args.concurrency, counter)
                        took[k is not None] = (time.process_time() - t) / args.streams * 1000
                    system[k is not None] = (
                        (resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0) / args.streams * 1000
                    )
                    gcs[k is not None] = GC.summary(args.streams)
                    after = getattr(store, "calls", {})
                    calls[k is not None] = " ".join(
                        f"{op}:{(n - before.get(op, 0)) / args.streams:.2f}"
                        for op, n in sorted(after.items())
                        if n > before.get(op, 0)
                    )
                extra.append(took[True] - took[False])
                print(
                    f"round {r}: plain {shown(took[False])} {unit}/req, keyed {shown(took[True])} {unit}/req, "
                    f"extra {shown(extra[-1], '+')} (of which system time: plain {system[False]:.3f} ms, keyed "
                    f"{system[True]:.3f} ms); gc plain {gcs[False]}, keyed {gcs[True]}; keyed app's store calls "
                    f"per request: in plain blocks {calls[False] or 0}, in keyed blocks {calls[True]}",
                    flush=True,
                )
            print(
                f"keyed extra {unit} per request: median {shown(statistics.median(extra), '+')} "
                f"(range {shown(min(extra), '+')} .. {shown(max(extra), '+')}), {args.rounds} rounds of "
                f"{args.streams} at concurrency {args.concurrency}"
            )
            if args.spy:
                await _spy(args, ((plain, None), (keyed, key)), counter)
            if args.profile:
                args.profile.mkdir(parents=True, exist_ok=True)
                for name, app, k in (("plain", plain, None), ("keyed", keyed, key)):
                    profiler = cProfile.Profile(time.process_time)
                    profiler.enable()
                    await _block(app, k, args.streams, args.concurrency, counter)
                    profiler.disable()
                    profiler.dump_stats(args.profile / f"{name}.prof")
                _diff(
                    pstats.Stats(str(args.profile / "plain.prof")),
                    pstats.Stats(str(args.profile / "keyed.prof")),
                    args.streams,
                )

        asyncio.run(run())
    finally:
        upstream.stop()
        azurite.stop()


if __name__ == "__main__":
    main()
