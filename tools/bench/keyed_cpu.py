"""What a keyed request costs this process in CPU over an unkeyed one (issue #44), in-process:

    .venv/bin/python tools/bench/keyed_cpu.py [--rounds 8] [--streams 40] [--concurrency 1]
                                              [--profile DIR] [--deltas 40]

One process serves the app twice, as tools/bench/admission.py builds it: unkeyed and with
``CALLER_KEYS=required`` on a real Azurite started here (the caller without limits, the bench's
``keys`` path). The scripted upstream (its own process) sends ``--deltas`` deltas at once (no
cadence), so a block costs its CPU, not its waits. Requests go through the ASGI handler (no HTTP
server; the caller's side only counts bytes). A round runs a block of ``--streams`` unkeyed streams
and one of keyed streams (``--concurrency`` at once), alternating which goes first; each block is
timed with ``time.process_time`` (every thread of this process: the upstream and Azurite are apart)
up to its background charges written (``Accounting.flush``). Printed: the keyed block's extra CPU
per request, round by round (median and range). ``--profile DIR``: cProfile (process time) of one
more block of each kind, ``DIR/plain.prof`` and ``DIR/keyed.prof``, and their difference by
function (per request, top 40)."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # the stdlib's profile, not tools/bench/profile.py

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import time

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
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


def _receiver(body: bytes):
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


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
    response = await app.chat(Request(scope, _receiver(body)))
    await response(scope, _receiver(body), send)
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


def _apps(upstream: str, store: str):
    """The app unkeyed and keyed (admission.py's settings, without its store instrumentation)."""
    from chatstream.app import create_app
    from chatstream.settings import Settings

    environ = {"OPENAI_BASE_URL": upstream, "OPENAI_API_KEY": "sk-keyedcpu", "OPENAI_MODEL": MODEL}
    keyed_env = {**environ, "AzureWebJobsStorage": store, "CALLER_KEYS": "required"}
    plain = create_app(Settings.from_env(environ), environ=environ)
    return plain, create_app(Settings.from_env(keyed_env), environ=keyed_env)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--deltas", type=int, default=40)
    parser.add_argument("--profile", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    from admission import setup_callers

    from tests.servers import Azurite, Upstream

    upstream = Upstream("--first-token-ms", "0", "--interval-ms", "0", "--deltas", str(args.deltas))
    azurite = Azurite()
    try:
        plain, keyed = _apps(upstream.base_url, azurite.connection_string)

        async def run() -> None:
            keys = await setup_callers(keyed)
            key = keys["keys"]
            counter = [0]
            for app, k in ((plain, None), (keyed, key)) * 2:  # warm-up
                await _block(app, k, args.streams, args.concurrency, counter)
            extra = []
            for r in range(args.rounds):
                times = {}
                order = ((plain, None), (keyed, key)) if r % 2 == 0 else ((keyed, key), (plain, None))
                for app, k in order:
                    t = time.process_time()
                    await _block(app, k, args.streams, args.concurrency, counter)
                    times[k is not None] = time.process_time() - t
                per = (times[True] - times[False]) / args.streams * 1000
                extra.append(per)
                print(
                    f"round {r}: plain {times[False] / args.streams * 1000:.3f} ms/req, "
                    f"keyed {times[True] / args.streams * 1000:.3f} ms/req, extra {per:+.3f}",
                    flush=True,
                )
            print(
                f"keyed extra CPU per request: median {statistics.median(extra):+.3f} ms "
                f"(range {min(extra):+.3f} .. {max(extra):+.3f}), {args.rounds} rounds of {args.streams} "
                f"at concurrency {args.concurrency}"
            )
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
