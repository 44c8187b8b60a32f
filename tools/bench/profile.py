"""Where the serving processes' CPU goes: py-spy against the app (devhost: its host process and its
worker process, recorded apart) or LiteLLM during 100-stream waves.

    tools/bench/profile.sh [--target app|litellm] [--streams 100] [--seconds 20] [--rate 100] [--probe]

Starts the scripted upstream and the target like tools/bench/run.py does (the app with one worker
process), warms up, then records twice while waves of ``--streams`` concurrent streams run back to
back (bounded by ``--seconds``); for the app, one py-spy on the host and one on the worker at once:
  tools/bench/out/profile-<target>[-host|-worker].svg       flamegraph (open it in a browser)
  tools/bench/out/profile-<target>[-host|-worker]-top.txt   self and inclusive samples per package and per function
  tools/bench/out/profile-<target>[-host|-worker].raw.txt   collapsed stacks (the input of the -top.txt file)
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import run  # noqa: E402 - after sys.path names the repository

PYSPY = Path(sys.executable).parent / "py-spy"
SCAFFOLD = re.compile(
    r"(<frozen runpy>|tools/devhost/(__main__|worker_process)\.py|asyncio/(runners|base_events|events)\.py)\)$"
)
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def area(filename: str) -> str:
    """A frame's package: site-packages/<pkg>, a folder of this repo, or stdlib:<module>."""
    f = filename.replace("\\", "/")
    if "/site-packages/" in f:
        part = f.split("/site-packages/", 1)[1].split("/", 1)[0]
        return part.removesuffix(".py")
    root = str(run.ROOT) + "/"
    if f.startswith(root):
        return f[len(root) :].split("/", 1)[0].removesuffix(".py")
    m = re.search(r"/lib/python3\.\d+/(.+)", f)
    if m:
        return "stdlib:" + m.group(1).split("/", 1)[0].removesuffix(".py")
    return f.rsplit("/", 1)[-1] or "?"


def parse_frame(frame: str) -> tuple[str, str]:
    """('func (file)', area) of one py-spy frame ``func (file:line)``."""
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip(), "?"
    file = m.group("file")
    short = re.sub(r"^.*/lib/python3\.\d+/", "", file.split("/site-packages/", 1)[-1]).replace(str(run.ROOT) + "/", "")
    return f"{m.group('func')} ({short})", area(file)


# Stages of a request, for "where does the CPU go". A sample under the upstream request's open, or
# under the reading of its response, belongs to that stage whatever it does inside; any other
# sample goes to the stage of its innermost frame that matches one (frames below the event loop's
# entry only).
CONTEXT_STAGES = (
    ("upstream request: open (openai SDK, httpx2, connect)", ("UpstreamStream.open",)),
    (
        "upstream response: read chunks (httpx2, httpcore2, h11), SSE framing, json",
        ("UpstreamStream.__stream__", "AsyncStream.__aiter__"),
    ),
)
STAGES = (
    ("socket writes (send syscalls)", ("_SelectorSocketTransport.write",)),
    ("chatstream: endpoint, relay, SSE encoding, log line", ("/chatstream/", "/json/")),
    ("gRPC: invocation messages", ("/grpc/", "tools/devhost/rpc.py", "Dispatcher.", "WorkerProcess.")),
    ("runtime: invocation, pairing request and invocation", ("azure_functions_runtime",)),
    ("devhost: routing, proxying, forwarding", ("tools/devhost/proxy.py", "tools/devhost/forward.py")),
    (
        "HTTP server and framework: uvicorn, httptools, FastAPI, Starlette, anyio",
        ("/uvicorn/", "/starlette/", "/fastapi/", "httptools", "/anyio/"),
    ),
    ("openai SDK, httpx2 (closing, other)", ("/openai/", "/httpx2/", "/httpcore2/", "/h11/")),
    ("logging", ("/logging/",)),
    ("event loop: select/epoll", ("selectors.py",)),
    ("event loop: scheduling, transports, reads", ("/asyncio/",)),
    ("other threads (gRPC poller, executor; mostly waiting)", ("threading.py", "concurrent/futures")),
)


def stages(raw: Path) -> list[tuple[str, float]]:
    """Share of the samples per stage (STAGES), largest first."""
    counts: Counter = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        k = 0
        while k < len(frames) - 1 and SCAFFOLD.search(frames[k]):
            k += 1
        inner = ";".join(frames[k:])
        stage = next((name for name, pats in CONTEXT_STAGES if any(p in inner for p in pats)), None)
        for frame in [] if stage else reversed(frames[k:]):
            stage = next((name for name, pats in STAGES if any(p in frame for p in pats)), None)
            if stage:
                break
        counts[stage or "other"] += n
    return [(name, n / total) for name, n in counts.most_common()] if total else []


def top_functions(raw: Path, limit: int = 35) -> str:
    self_fn, incl_fn, self_area, incl_area = Counter(), Counter(), Counter(), Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [parse_frame(f) for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        self_fn[frames[-1][0]] += n
        self_area[frames[-1][1]] += n
        # Inclusive counts skip the entry point and the event loop's own frames at the root of every
        # stack (they would be ~100% and say nothing); the loop's work still counts as self time.
        k = 0
        while k < len(frames) - 1 and SCAFFOLD.search(frames[k][0]):
            k += 1
        for fn in {f for f, _ in frames[k:]}:
            incl_fn[fn] += n
        for a in {a for _, a in frames[k:]}:
            incl_area[a] += n
    if not total:
        return "no samples\n"
    out = [f"{total} samples (only samples where a thread was running Python or native code; idle waits excluded)", ""]
    out.append("Samples by stage of the request (first matching rule in tools/bench/profile.py STAGES)")
    for name, share in stages(raw):
        out.append(f"  {100 * share:5.1f}%  {name}")
    out.append("")

    def table(title, counter, k):
        out.append(title)
        for name, n in counter.most_common(k):
            out.append(f"  {100 * n / total:5.1f}%  {n:7d}  {name}")
        out.append("")

    table("Self samples by package (where the CPU is spent)", self_area, 25)
    table("Inclusive samples by package (work done under a package's frames)", incl_area, 25)
    table("Self samples by function", self_fn, limit)
    table("Inclusive samples by function", incl_fn, limit)
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="py-spy profile of the app (or LiteLLM) under load")
    p.add_argument(
        "--target",
        choices=("app", "floor", "keys", "resume", "litellm"),
        default="app",
        help="the path to profile (default app; floor: the bare relay, to compare)",
    )
    p.add_argument("--streams", type=int, default=100, help="concurrent streams per wave (default 100)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each recording (default 20 s)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second (default 100)")
    p.add_argument(
        "--probe",
        action="store_true",
        help="hang up after the first delta: profiles the request side (time to first delta) only",
    )
    p.add_argument(
        "--short",
        action="store_true",
        help="10-delta streams (the upstream's `normal` scenario): mostly the per-request work",
    )
    p.add_argument("--out", default=str(BENCH / "out"))
    a = p.parse_args(argv)
    tag = (
        a.target
        + ("-probe" if a.probe else "")
        + ("-short" if a.short else "")
        + (f"-{a.streams}" if a.streams != 100 else "")
    )
    if not PYSPY.exists():
        print(f"{PYSPY} is missing: run `make bench` (tools/bench/requirements.txt installs py-spy)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    bargs = run.parse_args(
        [
            "--paths",
            f"direct,{a.target}",
            "--no-docs",
            "--out",
            str(out / "profile-run"),
            "--levels",
            str(a.streams),
            "--trials",
            "0",
            "--probes",
            "0",
            "--short-waves",
            "0",
            "--extra-levels",
            str(a.streams),
            "--wait-quiet",
            "0",
        ]
    )
    if run.os.environ.get("BENCH_NETNS") == "1":
        run._loopback_up()
    bench = run.Bench(bargs)
    spied: dict[str, tuple[int, bool]] = {}
    results = []
    try:
        bench.start()
        pid = bench.serving_pid[a.target]
        if a.target in bench.app_paths:  # the host and its worker process, each with its own py-spy
            spied = {f"{tag}-host": (pid, False)}
            spied.update(
                {
                    f"{tag}-worker" + (f"{i + 1}" if i else ""): (w, False)
                    for i, w in enumerate(p for p in run.procstat.descendants(pid) if p != pid)
                }
            )
        else:
            spied = {tag: (pid, True)}
        run.log(
            f"warm-up; then py-spy on {a.target} ({', '.join(f'{k}: pid {p}' for k, (p, _) in spied.items())}) "
            f"during {a.streams}-stream waves"
        )
        for _ in range(3):
            bench.wave("warmup", a.target, 1, 0, record=False)
        bench.wave("warmup", a.target, a.streams, 0.1, record=False, settle=0.5)
        for fmt, suffix in (("flamegraph", ".svg"), ("raw", ".raw.txt")):
            spies = [
                subprocess.Popen(
                    [
                        str(PYSPY),
                        "record",
                        "--pid",
                        str(p),
                        "--duration",
                        str(int(a.seconds)),
                        "--rate",
                        str(a.rate),
                        "--format",
                        fmt,
                        "-o",
                        str(out / f"{name}{suffix}"),
                        "--full-filenames",
                        *(["--subprocesses"] if sub else []),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
                for name, (p, sub) in spied.items()
            ]
            time.sleep(1.0)  # let py-spy attach
            deltas = waves = 0
            t0 = time.perf_counter()
            max_waves = math.ceil(a.seconds) + 5  # a bound, whatever happens to py-spy
            while any(s.poll() is None for s in spies) and waves < max_waves:
                w = bench.wave(
                    "profile", a.target, a.streams, 0.1, record=False, settle=0.1, probe=a.probe, short=a.short
                )
                deltas += sum(len(r["d"]) for r in w["records"])
                waves += 1
            for spy in spies:
                try:
                    msg = spy.communicate(timeout=a.seconds + 30)[0].decode(errors="replace").strip()
                except subprocess.TimeoutExpired:
                    spy.kill()
                    msg = spy.communicate()[0].decode(errors="replace").strip()
                run.log(
                    f"{fmt}: {waves} waves, {deltas} deltas in {time.perf_counter() - t0:.0f} s; "
                    f"{msg.splitlines()[-1] if msg else ''}"
                )
            results.append((fmt, waves, deltas))
    finally:
        bench.stop()
    _, waves, deltas = results[-1] if results else (None, 0, 0)
    for name, (p, _) in spied.items():
        raw = out / f"{name}.raw.txt"
        if not raw.exists():
            continue
        head = (
            f"py-spy {a.rate} Hz on {name} (pid {p}), {a.seconds:g} s while {waves} waves of {a.streams} "
            f"concurrent streams ran ({deltas} deltas"
            + (", each stream hung up after its first delta" if a.probe else "")
            + ")\n\n"
        )
        text = head + top_functions(raw)
        (out / f"{name}-top.txt").write_text(text)
        print(text)
        run.log(f"wrote {out / f'{name}.svg'} and {out / f'{name}-top.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
