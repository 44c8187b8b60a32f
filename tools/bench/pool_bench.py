"""What the upstream pool costs (docs/maintainers.md, "What a pool failover costs"): time to first
delta through the app with one upstream, and with three where the first answers 429 (so every measured request
fails over to the second), against the scripted upstreams on 127.0.0.1.

    .venv/bin/python tools/bench/pool_bench.py [--requests 30] [--doc docs/pool.md]

Three cases, sequential requests (one at a time, so the figures are latencies, not load):
  one entry       UPSTREAMS unset: the single upstream, as before the pool;
  failover        three entries, the first answering 429 with retry-after 1 s; each request waits
                  out that cooldown first, so each one pays the 429 round trip and the move on;
  during cooldown the same pool inside the cooldown: the 429 entry is skipped without a call.
The median and p90 of each, and the added time of a failover over one entry, are written between
the markers in the doc (``make bench`` runs this after the side-by-side benchmark)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
BEGIN, END = "<!-- pool-bench:begin -->", "<!-- pool-bench:end -->"


def start(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AZURE_OPENAI_", "UPSTREAM"))}
    full.update({"PYTHONPATH": str(ROOT), **(env or {})})
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        found = READY.search(line or "")
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"did not start: {args}")


def first_delta_ms(client: httpx.Client, url: str) -> float:
    body = {"model": "gpt-bench", "stream": True, "messages": [{"role": "user", "content": "hello pool"}]}
    started = time.perf_counter()
    with client.stream("POST", url + "/api/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                ttfd = (time.perf_counter() - started) * 1000
                break
        else:
            raise RuntimeError("no content delta")
        for _ in lines:  # read to the end, so the connection is reused
            pass
    return ttfd


def measure(url: str, requests: int, gap: float) -> list[float]:
    with httpx.Client(timeout=30) as client:
        first_delta_ms(client, url)  # warm-up: imports, connections
        samples = []
        for _ in range(requests):
            if gap:
                time.sleep(gap)
            samples.append(first_delta_ms(client, url))
    return samples


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"n": len(samples), "p50": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))]}


def run(requests: int) -> dict:
    limited, limited_url = start(["-m", "tools.fakeupstream", "--port", "0", "--scenario", "rate_limited"])
    healthy = [start(["-m", "tools.fakeupstream", "--port", "0", "--scenario", "echo"]) for _ in range(2)]
    apps = []
    try:
        one, one_url = start(
            ["-m", "tools.devhost", "--port", "0", "."],
            {"OPENAI_BASE_URL": healthy[0][1] + "/v1", "OPENAI_API_KEY": "sk-bench"},
        )
        apps.append(one)
        entries = [
            {"name": "first-429", "base_url": limited_url + "/v1", "priority": 1},
            {"name": "second", "base_url": healthy[0][1] + "/v1", "priority": 2},
            {"name": "third", "base_url": healthy[1][1] + "/v1", "priority": 3},
        ]
        pool, pool_url = start(
            ["-m", "tools.devhost", "--port", "0", "."],
            {"UPSTREAMS": json.dumps(entries), "OPENAI_API_KEY": "sk-bench"},
        )
        apps.append(pool)
        results = {
            "one entry": measure(one_url, requests, 0),
            "failover": measure(pool_url, requests, 1.2),  # past the 1 s cooldown each time
            "during cooldown": measure(pool_url, requests, 0),
        }
    finally:
        for proc in [*apps, limited, *(p for p, _ in healthy)]:
            proc.terminate()
            proc.wait(10)
    return {name: summary(samples) for name, samples in results.items()}


def render(figures: dict) -> str:
    base = figures["one entry"]["p50"]
    lines = [
        BEGIN,
        "",
        f"_Written by `tools/bench/pool_bench.py` on {time.strftime('%Y-%m-%d')}; "
        "sequential requests, scripted upstreams (echo) on 127.0.0.1, 2-core machine._",
        "",
        "| case | requests | TTFD p50 | TTFD p90 | added p50 over one entry |",
        "|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        lines.append(f"| {name} | {f['n']} | {f['p50']:.1f} ms | {f['p90']:.1f} ms | {f['p50'] - base:+.1f} ms |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--doc", default=str(ROOT / "docs" / "maintainers.md"))
    args = parser.parse_args()
    figures = run(args.requests)
    table = render(figures)
    print(table)
    doc = Path(args.doc)
    text = doc.read_text(encoding="utf-8")
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + table + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n## What a pool failover costs\n\n" + table + "\n"
    doc.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
