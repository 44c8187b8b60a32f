"""A reader on another instance, in-process: how far it trails the producer's caller, and the store
calls a stream makes, with the resumable streams' real cadences (ResumeConfig's defaults) and a
store whose every call takes a set time. Two StreamLogs on one in-memory account (tests/memory_store.py)
stand for the producing instance and the reader's; the producer starts with the bench's first delta
(100 ms in, when the app starts it: its record is stored as its id goes out) and appends the rest
(one every 20 ms), and a reader on the other instance opens one stream in ten as the
first delta goes out (when the bench's follower gets the stream id), as tools/bench/run.py's resume
path does, without HTTP, the app or a busy machine: what the cadences alone cost.

    .venv/bin/python tools/bench/follow_lag.py [--streams 100] [--deltas 40] [--latency-ms 20] [--waves 3]
                                              [--busy-ms 0] [--set fast_flush_seconds=0.05 ...]

Prints the lag p50/p99 (ms, over the deltas appended after the reader opened), the same for each
reader's first delta (the opening's handshake: record, slot and inbox row, the producer's inbox read,
its write, the reader's poll), the store calls per stream without a reader (a wave where none
follows) and per stream with one (the difference a reader makes to a wave, per reader), inbox and
heartbeat reads included, and what a reader adds by call.

What it showed (2026-12-05, issue #44): a reader that opened with the first delta waited for five
or six store calls in turn (the record, which ~half the readers read before its insert lands, then
again 50 ms later; its inbox row; the producer's inbox read, every 100 ms while the stream is young;
its write; the reader's poll); each later delta, for the producer's next write (100 ms apart) and
the reader's next poll. Now the record is read again after half the missed read's time, and a
young stream's inbox row is written as the record is read, in the inbox of the instance whose
stream a reader there opened last (readers.py): 10 deltas, first-delta p99 at 20 ms a call
336-399 -> 181-217 ms, all deltas' 336-361 -> 188-206; at 40 ms, 430-830 -> 330-700 and
410-790 -> 310-510 (the machine's load moves these by 50-100 ms; compare runs side by side).
Inbox reads every 50 ms, poll spreading at twice the rate, flushes every 50 ms, and an inbox read
as each record lands gained 0-20 ms (within the noise) for more calls: the served lag under
--busy-ms 2 is the store's queue (first-delta p50 ~480 ms before and after, p99 746 -> 586),
which more calls lengthen.
2026-12-06: under --busy-ms 2 a third of the 10-delta readers are seen too late (the whole log
goes into the record at the end) and waited for their record read after an empty blob read: the
two side by side, 10-delta p99 795 -> 704 (--busy-ms 1: 374 -> 345). Tried and dropped (no
steady gain side by side): inbox reads overlapping when one takes longer than its interval
(--busy-ms 2 p99 -25%, --busy-ms 1 +30%), the record read every poll while nothing is stored,
polls after a miss at 1/6 of poll_seconds with a 0.95 lead, inbox_young_seconds 0.05, bulk_calls
4 or 64. Without a busy store the lag is the write interval (mean 50 ms), a write, ~20 ms of poll
phase and a read; fewer ms there takes more writes and polls."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


async def wave(a, b, args, follow: bool, rng: random.Random) -> tuple[list[float], list[float], dict[str, int]]:
    from chatstream import sse
    from chatstream.http import dumps

    lags: list[float] = []
    firsts: list[float] = []
    appended: dict[tuple[int, int], float] = {}

    async def read(n: int, stream_id: str, opened: float) -> None:
        reader = await b.open_reader(stream_id, None, None)
        first = True
        async for chunk in reader:
            now = time.monotonic()
            for part in chunk.split(b"\n\n"):
                if part.startswith(b"id: "):
                    i = int(part[4 : part.index(b"\n")])
                    sent = appended.get((n, i))
                    if sent is not None and sent >= opened:
                        lags.append((now - sent) * 1000)
                        if first:
                            firsts.append((now - sent) * 1000)
                            first = False

    async def one(n: int) -> None:
        await asyncio.sleep(n * args.stagger_ms / 1000)
        await asyncio.sleep(args.first_ms / 1000)
        producer = a.start("chat", None)  # as the app does: once the first event is in hand
        readers = []
        for i in range(args.deltas + 1):
            last = i == args.deltas
            payload = {"finish_reason": "stop"} if last else {"delta": f"w{i} "}
            event = sse.event(dumps(payload), b"done" if last else None)
            appended[(n, i + 1)] = time.monotonic()
            producer.append(event, final=last)
            if i == 0 and follow and n % args.follow_every == 0:
                readers.append(asyncio.ensure_future(read(n, producer.id, time.monotonic())))
            if not last:
                await asyncio.sleep(args.interval_ms / 1000)
        producer.finish()
        await asyncio.gather(*readers)

    calls = dict(a.store.data.calls)
    await asyncio.gather(*(one(n) for n in range(args.streams)))
    await asyncio.sleep(args.settle)  # the last writes, the readers' leaving, the inbox's deletes
    ops = {op: n - calls.get(op, 0) for op, n in a.store.data.calls.items() if n != calls.get(op, 0)}
    return lags, firsts, ops


async def main_async(args) -> dict:
    from memory_store import MemoryData, MemoryStore
    from unit.streamlog_helpers import encode_error

    from chatstream.state.instances import Instances
    from chatstream.state.store import StoreClock
    from chatstream.state.streamlog.config import ResumeConfig
    from chatstream.state.streamlog.log import StreamLog

    rng = random.Random(args.seed)
    server = asyncio.Lock()  # --busy-ms: the store serves one call at a time (Azurite's one thread)

    class SlowStore(MemoryStore):
        """Every call takes ``--latency-ms`` (lognormal, that median, ``--jitter`` sigma), and holds
        the store alone for ``--busy-ms`` of it (calls queue behind one another: the store's load)."""

        async def _call(self, op, table, timeout, work, write):
            await asyncio.sleep(args.latency_ms / 1000 * rng.lognormvariate(0, args.jitter))
            if args.busy_ms:
                async with server:
                    await asyncio.sleep(args.busy_ms / 1000)
            return await super()._call(op, table, timeout, work, write)

    data = MemoryData()
    logs = []
    for _ in range(2):
        store = SlowStore(data, StoreClock())
        logs.append(StreamLog(store, Instances(store), encode_error, ResumeConfig(**args.set)))
    a, b = logs
    out: dict = {"lag": [], "first": [], "plain_calls": [], "followed_calls": []}
    ops: dict[str, float] = {}
    readers = len(range(0, args.streams, args.follow_every))
    try:
        await wave(a, b, args, False, rng)  # warm-up: first beats
        for _ in range(args.waves):
            _, _, plain_ops = await wave(a, b, args, False, rng)
            lags, firsts, followed_ops = await wave(a, b, args, True, rng)
            plain, followed = sum(plain_ops.values()), sum(followed_ops.values())
            out["lag"] += lags
            out["first"] += firsts
            out["plain_calls"].append(plain / args.streams)
            out["followed_calls"].append((followed - plain) / readers + plain / args.streams)
            for op in set(plain_ops) | set(followed_ops):
                extra = (followed_ops.get(op, 0) - plain_ops.get(op, 0)) / readers
                ops[op] = ops.get(op, 0.0) + extra / args.waves
    finally:
        for streams in logs:
            await streams.close(timeout=1.0)
            await streams.instances.close()
    return {
        "lag_ms": {"p50": pct(out["lag"], 50), "p99": pct(out["lag"], 99), "n": len(out["lag"])},
        "first_lag_ms": {"p50": pct(out["first"], 50), "p99": pct(out["first"], 99), "n": len(out["first"])},
        "calls_per_stream_without_reader": round(sum(out["plain_calls"]) / args.waves, 2),
        "calls_per_stream_with_reader": round(sum(out["followed_calls"]) / args.waves, 2),
        "calls_a_reader_adds": {op: round(n, 2) for op, n in sorted(ops.items()) if round(n, 2)},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--follow-every", type=int, default=10)
    p.add_argument("--deltas", type=int, default=40)
    p.add_argument("--first-ms", type=float, default=100)
    p.add_argument("--interval-ms", type=float, default=20)
    p.add_argument("--stagger-ms", type=float, default=1.0)
    p.add_argument("--latency-ms", type=float, default=20.0, help="a store call's median time (default 20 ms)")
    p.add_argument("--jitter", type=float, default=0.5, help="lognormal sigma of a call's time (default 0.5)")
    p.add_argument("--busy-ms", type=float, default=0.0, help="each call holds the store alone this long (default 0)")
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=44)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="a ResumeConfig field (e.g. poll_seconds=0.05)",
    )
    args = p.parse_args(argv)
    args.set = {k: float(v) for k, v in (x.split("=", 1) for x in args.set)}
    print(json.dumps(asyncio.run(main_async(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
