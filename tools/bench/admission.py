"""The store calls a keyed request makes before its upstream call, and what admission adds to its
first delta, at the benchmark's 1-stream pace:

    .venv/bin/python tools/bench/admission.py [--rounds 60] [--gap 0.05] [--probe-every 1] [--json OUT]

Serves the app in-process (uvicorn on 127.0.0.1) twice: unkeyed (``app``) and with
``CALLER_KEYS=required`` on a real Azurite started here, with three callers as run.py makes them:
without limits (``keys``), with a tokens_per_minute limit (``keyslim``) and in a team with a spend
budget on a priced model (``keyteam``). Requests go one at a time, round-robin over the paths with
``--gap`` between them (run.py's 1-stream level: full streams, and first-delta probes that hang up
after the first delta). Every call of the keyed app's store is logged with its start and duration;
a call that starts after a request arrived and ends before its admission is over (``admit``
returned: the next thing is the upstream call) is one of that request's calls before the upstream.
Prints, per path: the store calls before the upstream per request (count, by kind, time spent
waiting on them), the time from the request's arrival to its admission (p50, p90), and the first
delta as the client saw it (p50) and its excess over the unkeyed app."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections import Counter as Tally
from pathlib import Path

from chatstream.state.callers import CallerSpec, TeamSpec
from chatstream.state.prices import PriceSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODEL = "cadence"
PRICE = {"input": 0.15, "cached_input": 0.075, "output": 0.60}
VERBOSE: set[str] = set()
STORE_METHODS = (
    "get",
    "insert",
    "replace",
    "merge",
    "upsert",
    "delete",
    "query",
    "batch",
    "put",
    "get_blob",
    "delete_blob",
)


class Log:
    """Store calls and request marks, on the server's loop (time.perf_counter seconds)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, str]] = []  # (start, end, what)
        self.requests: dict[str, dict] = {}  # marker -> {"arrived", "admitted"}


def _short(target: str) -> str:
    """A call's table or blob and row, without the names that differ per caller or instance."""
    table, _, row = target.partition(":")
    table = table.split("/")[0]
    if row.startswith(("k|", "vm-")) or "-" in row:
        row = row.split("|")[0] + "|…" if "|" in row else "…"
    return f"{table}:{row}" if row else table


def _task() -> str:
    """The coroutine the call runs in: the request's own, or a background one (a lease's flight,
    the journal's writer...)."""
    task = asyncio.current_task()
    coro = task.get_coro() if task is not None else None
    name = getattr(coro, "__qualname__", "?")
    return "request" if name.startswith(("RequestResponseCycle", "Server", "run_asgi")) else name


def instrument(store, log: Log) -> None:
    for name in STORE_METHODS:
        original = getattr(store, name)

        async def wrapped(*args, __original=original, __name=name, **kwargs):
            target = args[0] if args else ""
            if __name in ("get", "insert", "replace", "merge", "upsert", "delete", "batch"):
                row = args[1] if len(args) > 1 else {}
                if isinstance(row, dict):  # an entity: its partition and row
                    target = f"{target}:{row.get('RowKey', '')}"
                elif len(args) > 2:
                    target = f"{target}:{args[2]}"
            what = f"{__name} {_short(str(target))} ({_task()})"
            start = time.perf_counter()
            try:
                return await __original(*args, **kwargs)
            finally:
                log.calls.append((start, time.perf_counter(), what))

        setattr(store, name, wrapped)


def build(upstream: str, store: str | None, log: Log):
    from starlette.applications import Starlette
    from starlette.routing import Route

    from chatstream.app import create_app
    from chatstream.settings import Settings

    environ = {"OPENAI_BASE_URL": upstream, "OPENAI_API_KEY": "sk-admission", "OPENAI_MODEL": MODEL}
    plain = create_app(Settings.from_env(environ), environ=environ)
    keyed_env = {**environ, "AzureWebJobsStorage": store or "", "CALLER_KEYS": "required"}
    keyed = create_app(Settings.from_env(keyed_env), environ=keyed_env)
    assert keyed.state is not None and keyed.state.accounting is not None
    instrument(keyed.state.store, log)
    accounting = keyed.state.accounting
    admit = accounting.admit

    async def timed_admit(caller, call, record, endpoint=None):
        found = await admit(caller, call, record, endpoint)
        marker = call.params.get("messages", [{}])[-1].get("content") if isinstance(call.params, dict) else None
        if marker in log.requests:
            log.requests[marker]["admitted"] = time.perf_counter()
        return found

    accounting.admit = timed_admit  # type: ignore[method-assign]

    async def plain_chat(request):
        return await plain.chat(request)

    async def keyed_chat(request):
        body = json.loads(await request.body())
        log.requests[body["prompt"]] = {"arrived": time.perf_counter()}
        return await keyed.chat(request)

    api = Starlette(
        routes=[Route("/u/api/chat", plain_chat, methods=["POST"]), Route("/k/api/chat", keyed_chat, methods=["POST"])]
    )
    return api, plain, keyed


async def setup_callers(keyed) -> dict[str, str]:
    registry = keyed.state.registry
    keys = {}
    _, keys["keys"] = await registry.create(CallerSpec(name="bench-nolimit"))
    _, keys["keyslim"] = await registry.create(CallerSpec(name="bench-limited", tokens_per_minute=1_000_000_000))
    await registry.set_price(MODEL, PriceSpec.model_validate(PRICE))
    await registry.create(TeamSpec(name="bench-team", spend_budget=1_000_000))
    _, keys["keyteam"] = await registry.create(CallerSpec(name="bench-team-member", team="bench-team"))
    return keys


def client_run(base: str, keys: dict[str, str], args, out: list[dict], log: Log) -> None:
    import httpx

    paths = ["app", "keys", "keyslim", "keyteam"]
    with httpx.Client(base_url=base, timeout=30) as client:
        for r in range(args.warmup + args.rounds):
            for i in range(len(paths)):
                path = paths[(i + r) % len(paths)]
                marker = f"admission {path} {r}"
                probe = args.probe_every and r % args.probe_every == 0
                headers = {"Authorization": f"Bearer {keys[path]}"} if path in keys else {}
                url = "/u/api/chat" if path == "app" else "/k/api/chat"
                t0 = time.perf_counter()
                first = None
                with client.stream("POST", url, json={"prompt": marker}, headers=headers) as response:
                    for chunk in response.iter_raw():
                        if first is None and b"data:" in chunk:
                            first = time.perf_counter()
                            if probe:
                                break
                if r >= args.warmup:
                    out.append({"path": path, "marker": marker, "sent": t0, "first": first, "probe": bool(probe)})
                time.sleep(args.gap)


def report(records: list[dict], log: Log) -> dict:
    calls = sorted(log.calls)
    result: dict = {}
    firsts = {
        p: statistics.median([r["first"] - r["sent"] for r in records if r["path"] == p])
        for p in sorted({r["path"] for r in records})
    }
    for path in ("app", "keys", "keyslim", "keyteam"):
        mine = [r for r in records if r["path"] == path]
        counts, waits, admits, kinds = [], [], [], Tally()
        for r in mine:
            marks = log.requests.get(r["marker"])
            if not marks or "admitted" not in marks:
                continue
            a, b = marks["arrived"], marks["admitted"]
            before = [(s, e, w) for s, e, w in calls if s >= a and e <= b]
            counts.append(len(before))
            if VERBOSE and path in VERBOSE:
                print(
                    f"{path} {r['marker']} at {a:.3f} calls={[(round((s - a) * 1000, 1), round((e - s) * 1000, 1), w) for s, e, w in before]}"
                )
            kinds.update(w for *_, w in before)
            # time the request waited on the store: the union of those calls' intervals
            spans, end = 0.0, a
            for s, e, _ in before:
                if e > end:
                    spans += e - max(s, end)
                    end = e
            waits.append(spans * 1000)
            admits.append((b - a) * 1000)
        row = {
            "first_delta_p50_ms": round(firsts[path] * 1000, 2),
            "over_app_ms": round((firsts[path] - firsts["app"]) * 1000, 2),
        }
        if counts:
            n = len(counts)
            admits.sort()
            row.update(
                requests=n,
                store_calls_before_upstream_per_request=round(sum(counts) / n, 2),
                requests_with_none=sum(1 for c in counts if c == 0),
                by_kind={k: round(v / n, 2) for k, v in sorted(kinds.items())},
                store_wait_ms_mean=round(statistics.mean(waits), 2),
                store_wait_ms_p50=round(statistics.median(waits), 2),
                arrival_to_admitted_ms_p50=round(statistics.median(admits), 2),
                arrival_to_admitted_ms_p90=round(admits[int(0.9 * (n - 1))], 2),
            )
        result[path] = row
    keyed = sum(1 for r in records if r["path"] != "app")
    background = [w for _, _, w in calls if "Instances." not in w and "serve)" not in w]
    result["keyed_store_calls_per_request_all"] = round(len(background) / max(1, keyed), 2)  # before and after
    durations: dict[str, list[float]] = {}
    for s, e, w in calls:
        durations.setdefault(w, []).append((e - s) * 1000)
    result["store_call_ms_p50"] = {w: round(statistics.median(d), 2) for w, d in sorted(durations.items())}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.05, help="pause after each request (run.py's --gap)")
    parser.add_argument("--probe-every", type=int, default=1, help="every Nth round probes (1: all; 0: none)")
    parser.add_argument("--interval-ms", type=float, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--verbose", default="", help="paths whose every request is listed (comma-separated)")
    args = parser.parse_args()
    VERBOSE.update(p for p in args.verbose.split(",") if p)
    import uvicorn
    from servers import Azurite, Upstream

    upstream = Upstream("--interval-ms", str(args.interval_ms))
    azurite = Azurite()
    log = Log()
    records: list[dict] = []
    try:
        api, plain, keyed = build(upstream.base_url, azurite.connection_string, log)
        config = uvicorn.Config(api, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)

        async def serve() -> None:
            task = asyncio.ensure_future(server.serve())
            while not server.started:  # noqa: ASYNC110 - uvicorn offers no event for it
                await asyncio.sleep(0.02)
            port = server.servers[0].sockets[0].getsockname()[1]
            keys = await setup_callers(keyed)
            thread = threading.Thread(
                target=client_run, args=(f"http://127.0.0.1:{port}", keys, args, records, log), daemon=True
            )
            thread.start()
            while thread.is_alive():  # noqa: ASYNC110 - the client runs in its own thread
                await asyncio.sleep(0.1)
            await keyed.state.accounting.flush(within=5)
            server.should_exit = True
            await task

        asyncio.run(serve())
    finally:
        upstream.stop()
        azurite.stop()
    result = report(records, log)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
