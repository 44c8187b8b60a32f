"""Cold start: how long ``import function_app`` takes and how much memory it leaves, against the three
packages the design card names alone. A script, not a test:

    .venv/bin/python tools/bench/coldstart.py [--runs 9] [--compare DIR] [--no-bytecode-cache] [--modules]
    .venv/bin/python tools/bench/coldstart.py --served 20 [--compare DIR]

Each scenario is imported in fresh processes (``--runs`` each, interleaved, after one warm-up run per
scenario that fills a bytecode cache in a temporary folder, as a deployed app has one):

* card:  ``import azure.functions, azurefunctions.extensions.http.fastapi, openai``;
* app:   ``import function_app`` with the default settings (an upstream is set: the app needs one);
* keyed: the same with ``CALLER_KEYS=required`` and ``RESUMABLE_STREAMS=on``, the store set to
  Azurite's well-known development account (nothing listens there: importing does not call it).
  "after 1 count" is the process once it has counted one prompt's tokens as a keyed request does
  (the tokenizer's tables loaded), and how long that count took (it waits for the tables when the
  app's thread that builds them at start-up has not finished; the RSS right after the import may
  or may not include them).

``--compare DIR`` also imports the app (app@DIR, keyed@DIR) from another checkout, e.g. a
``git archive`` of the commit before a change, in the same interleaved rounds: before and after
under the same load. Printed as a Markdown table: the import's wall time inside the process
(median, lowest, highest), its CPU time (the process's, all threads; steadier than wall time on a
busy machine), the process's RSS after it (median), and the medians' difference from the card's.
The settings come only from the scenario (the caller's environment's app settings are dropped).
``--no-bytecode-cache`` compiles the app's own modules in every run, as with PYTHONDONTWRITEBYTECODE
and no ``__pycache__``; ``--modules`` also lists the top-level modules each scenario loads beyond
the card's.

``--served N`` measures an instance instead: the app served by tools/devhost (one worker) against the
scripted upstream, unkeyed, then keyed (``CALLER_KEYS=required``, a caller made through the admin
API, Azurite in memory: ``make azurite``; its tables and container made first, as infra/ makes them in
Azure), then keyed + resumable; N streamed chat completions each,
then the host's and the worker's RSS from ``/_devhost/stats`` and the worker's split into anonymous
memory and file pages (clean pages of libraries and wheels, which the kernel drops under pressure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.azurite.__main__ import ACCOUNT, ACCOUNT_KEY  # noqa: E402 - after sys.path names the repository

AZURITE = (
    f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
    f"BlobEndpoint=http://127.0.0.1:10000/{ACCOUNT};TableEndpoint=http://127.0.0.1:10002/{ACCOUNT};"
)
UPSTREAM = {"OPENAI_API_KEY": "coldstart", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
CARD = "import azure.functions, azurefunctions.extensions.http.fastapi, openai"
COUNT = "from chatstream import tokens; tokens.count_text('gpt-4o-mini', 'How long is a piece of string?')"

# name: (import statement, app settings, code run after the import whose RSS is shown too, or None)
SCENARIOS: dict[str, tuple[str, dict[str, str], str | None]] = {
    "card": (CARD, {}, None),
    "app": ("import function_app", UPSTREAM, None),
    "keyed": (
        "import function_app",
        {**UPSTREAM, "CALLER_KEYS": "required", "RESUMABLE_STREAMS": "on", "AzureWebJobsStorage": AZURITE},
        COUNT,
    ),
}

# What runs in each fresh process: time the import, read VmRSS, optionally run more and read it again.
PROBE = r"""
import json, sys, time
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) * 1024
t0, c0 = time.perf_counter(), time.process_time()
exec(sys.argv[1])
took, cpu = time.perf_counter() - t0, time.process_time() - c0
top = lambda m: ".".join(m.split(".")[: 2 if m.startswith("azure.") else 1])
out = {"s": took, "cpu": cpu, "rss": rss(), "modules": sorted({top(m) for m in sys.modules})}
if sys.argv[2]:
    t1 = time.perf_counter()
    exec(sys.argv[2])
    out["s_after"], out["rss_after"] = time.perf_counter() - t1, rss()
print(json.dumps(out))
"""

# The environment kept from the caller's: what finds Python and its packages, nothing the app reads.
KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")


def run(name: str, pycache: str | None, root: Path = ROOT) -> dict:
    statement, settings, after = SCENARIOS[name.split("@")[0]]
    env = {k: v for k, v in os.environ.items() if k in KEEP}
    env.update(settings)
    if pycache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = pycache
    return fresh(sys.executable, PROBE, [statement, after or ""], env, root, f"{name}: the import")


def fresh(python: str | Path, code: str, args: list[str], env: dict[str, str], cwd: Path, what: str) -> Any:
    """``code`` run by ``python -c`` in a fresh process (``args`` after it): its last line of output,
    as JSON. SystemExit naming ``what`` when the process fails (memsplit.py and run.py's cold
    starts use it too)."""
    cmd = [str(python), "-c", code, *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def served(trees: list[Path], requests: int) -> None:
    """``--served``: each variant of the app from each tree, one at a time, on one upstream and store."""
    import httpx

    from tests.servers import Azurite, Served, Upstream

    upstream, azurite = Upstream(), Azurite()
    _make_store(azurite.connection_string)
    settings = {"OPENAI_BASE_URL": upstream.base_url, "OPENAI_API_KEY": "coldstart", "UPSTREAM_MAX_RETRIES": "0"}
    keyed = {**settings, "CALLER_KEYS": "required", "AzureWebJobsStorage": azurite.connection_string}
    variants = {"unkeyed": settings, "keyed": keyed, "keyed + resumable": {**keyed, "RESUMABLE_STREAMS": "on"}}
    print(f"{requests} streamed completions per instance; MB; load {os.getloadavg()[0]:.2f}")
    print()
    print("| instance | host + worker | worker | worker: anonymous | worker: file pages |")
    print("|---|---|---|---|---|")
    try:
        for tree in trees:
            for name, env in variants.items():
                app = Served(["-m", "tools.devhost", "--port", "0", str(tree)], env=env, cwd=tree, timeout=90)
                try:
                    headers = {}
                    if env.get("CALLER_KEYS"):
                        made = httpx.post(
                            f"{app.url}/api/manage/callers", json={"name": f"c{time.time_ns()}"}, timeout=30
                        )
                        made.raise_for_status()
                        headers["Authorization"] = f"Bearer {made.json()['key']}"
                    with httpx.Client(timeout=60) as client:
                        for i in range(requests):
                            body = {
                                "model": "gpt-4o-mini",
                                "stream": True,
                                "messages": [{"role": "user", "content": f"hi {i}"}],
                            }
                            with client.stream(
                                "POST", f"{app.url}/api/v1/chat/completions", json=body, headers=headers
                            ) as r:
                                assert r.status_code == 200, r.read()
                                for _ in r.iter_bytes():
                                    pass
                    time.sleep(1)  # what the requests left running in the background settles
                    stats = httpx.get(f"{app.url}/_devhost/stats", timeout=10).json()
                    (worker,) = stats["workers"]
                    split = _smaps(worker["pid"])
                    label = name if tree == ROOT else f"{name}@{tree}"
                    print(
                        f"| {label} | {stats['rss_kb'] / 1024:.0f} | {worker['rss_kb'] / 1024:.0f} | "
                        f"{split['Anonymous'] / 1024:.0f} | {(split['Rss'] - split['Anonymous']) / 1024:.0f} |"
                    )
                finally:
                    app.stop()
    finally:
        upstream.stop()
        azurite.stop()


def _make_store(connection_string: str) -> None:
    """The store's tables and container, as infra/ makes them in Azure: an instance finds them there
    (one that makes them loads the SDKs' async clients to do it, ~2 MB)."""
    from azure.core.exceptions import ResourceExistsError
    from azure.data.tables import TableServiceClient
    from azure.storage.blob import BlobServiceClient

    from chatstream.state import store

    with TableServiceClient.from_connection_string(connection_string) as tables:
        for name in (
            store.CALLERS_TABLE,
            store.LIMITS_TABLE,
            store.USAGE_TABLE,
            store.RESPONSES_TABLE,
            store.STREAMS_TABLE,
        ):
            tables.create_table_if_not_exists(name)
    with BlobServiceClient.from_connection_string(connection_string) as blobs, contextlib.suppress(ResourceExistsError):
        blobs.create_container(store.STREAMS_CONTAINER)


def _smaps(pid: int) -> dict[str, int]:
    """kB by field of /proc/PID/smaps_rollup (Rss, Anonymous...)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if v.strip().endswith("kB")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per scenario (default 9)")
    parser.add_argument("--no-bytecode-cache", action="store_true", help="compile the app's modules every run")
    parser.add_argument("--modules", action="store_true", help="list the top-level modules beyond the card's")
    parser.add_argument("--compare", type=Path, metavar="DIR", help="also import the app from this checkout")
    parser.add_argument("--served", type=int, metavar="N", help="serve the app instead; N requests per instance")
    args = parser.parse_args()
    if args.served:
        served([ROOT, *([args.compare.resolve()] if args.compare else [])], args.served)
        return

    roots = {name: ROOT for name in SCENARIOS}
    if args.compare:
        roots.update({f"{name}@{args.compare}": args.compare.resolve() for name in SCENARIOS if name != "card"})
    with tempfile.TemporaryDirectory(prefix="coldstart-pyc-") as tmp:
        pycache = None if args.no_bytecode_cache else tmp
        results: dict[str, list[dict]] = {name: [] for name in roots}
        for name, root in roots.items():  # warm-up: fills the bytecode cache and the page cache
            run(name, pycache, root)
        for _ in range(args.runs):
            for name, root in roots.items():
                results[name].append(run(name, pycache, root))

    mb = 1024 * 1024
    card_s = statistics.median(r["s"] for r in results["card"])
    card_cpu = statistics.median(r["cpu"] for r in results["card"])
    card_rss = statistics.median(r["rss"] for r in results["card"])
    print(f"{args.runs} fresh processes per scenario, Python {sys.version.split()[0]}, load {os.getloadavg()[0]:.2f}")
    print()
    print("| scenario | import s: median (low–high) | vs card | CPU s | vs card | RSS MB | vs card | after 1 count |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        times = sorted(r["s"] for r in rows)
        s, rss = statistics.median(times), statistics.median(r["rss"] for r in rows)
        cpu = statistics.median(r["cpu"] for r in rows)
        after = [r["rss_after"] for r in rows if "rss_after" in r]
        after_s = [r["s_after"] for r in rows if "s_after" in r]
        after_txt = (
            f"{statistics.median(after) / mb:.0f} MB (+{(statistics.median(after) - card_rss) / mb:.0f}), "
            f"took {statistics.median(after_s) * 1000:.0f} ms"
            if after
            else "–"
        )
        print(
            f"| {name} | {s:.3f} ({times[0]:.3f}–{times[-1]:.3f}) | {s - card_s:+.3f} | {cpu:.3f} | "
            f"{cpu - card_cpu:+.3f} | {rss / mb:.0f} | {(rss - card_rss) / mb:+.0f} | {after_txt} |"
        )
    if args.modules:
        card_modules = set(results["card"][0]["modules"])
        print()
        for name, rows in results.items():
            if name != "card":
                print(f"{name}: beyond the card: {' '.join(sorted(set(rows[0]['modules']) - card_modules))}")


if __name__ == "__main__":
    main()
