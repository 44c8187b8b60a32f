"""Shared by the stream log's unit tests (test_streamlog.py, test_streamlog_takeover.py): instances on
one in-process account, killing one, reading a log, producing a stream, and a request path's
continuation for takeovers.

Two "instances" are two StreamLogs, each with its own MemoryStore (its own clock) and its own
Instances, on one MemoryData (one storage account): a reader on B has no producer in memory and
reads the blob and the table as another machine would. An instance is killed by cancelling its
tasks (no goodbye), slowed by faults on its own store, and the account frozen as SIGSTOP does to
Azurite."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
from memory_store import MemoryData, MemoryStore

from chatstream import sse
from chatstream.http import dumps
from chatstream.state.instances import Instances, InstanceTiming
from chatstream.state.store import StoreClock, Where
from chatstream.state.streamlog.config import ResumeConfig
from chatstream.state.streamlog.errors import StreamLogUnavailable, StreamNotFound
from chatstream.state.streamlog.format import epoch_id, position
from chatstream.state.streamlog.log import StreamLog, sweep
from chatstream.state.streamlog.takeover import Claim

ROOT = Path(__file__).resolve().parents[2]


def event(payload: Any, name: bytes | None = None) -> bytes:
    """One event of JSON, as the API encoders write them."""
    return sse.event(dumps(payload), name)


# Leases of a fraction of a second, so that deaths show within one: the same logic as 4.5 s.
LIFE = InstanceTiming(beat_seconds=0.05, lease_seconds=0.4, duty_seconds=0.05, fresh_seconds=0.0)
# The cadences scaled down alike (the defaults' ratios).
QUICK = {
    "state_seconds": 0.1,
    "inbox_seconds": 0.05,
    "inbox_young_seconds": 0.02,
    "poll_seconds": 0.02,
    "max_poll_seconds": 0.05,
    "young_poll_seconds": 0.02,
    "fast_flush_seconds": 0.02,
    "checkpoint_seconds": 0.5,
    "give_up_seconds": 2.0,
    "past_end_wait_seconds": 2.0,
}


def encode_error(route, type, message) -> bytes:
    if route == "chat":
        return event({"error": {"type": type, "message": message, "retryable": True}}, b"error")
    return event({"error": {"message": message, "type": "server_error", "param": None, "code": type}})


def delta(i: int) -> bytes:
    return event({"delta": f"w{i} 日本 🙂\n"})


DONE = event({"finish_reason": "stop", "usage": None}, b"done")


def events_of(body: bytes) -> list[tuple[int, bytes]]:
    """(id, the event without its id line) for each event of an SSE body; asserts every event has an id."""
    out = []
    for part in body.split(b"\n\n")[:-1]:
        head, _, rest = part.partition(b"\n")
        assert head.startswith(b"id: "), part
        out.append((int(head[4:]), rest))
    assert body.endswith(b"\n\n") or not body
    return out


def ids_in(stored: bytes) -> list[int]:
    """The ids of the events of a stored log (our comment lines left out)."""
    return [int(part[4 : part.index(b"\n")]) for part in stored.split(b"\n\n") if part.startswith(b"id: ")]


def numbered(events: list[bytes], first: int = 1, seam: int | None = None) -> bytes:
    """``events`` with the ids of positions ``first``…; with ``seam``, the positions after it are
    the takeover's (epoch 2's ids, format.EPOCH_IDS)."""
    return b"".join(
        b"id: %d\n%s" % (epoch_id(2 if seam is not None and first + i > seam else 1, first + i), e)
        for i, e in enumerate(events)
    )


class CountingStore(MemoryStore):
    """The in-process store, counting this instance's calls by operation and blob (instrumentation
    only: every call is the memory store's own)."""

    def __init__(self, data: MemoryData, clock: StoreClock):
        super().__init__(data, clock)
        self.counts: dict[str, int] = {}

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    async def append(self, name: str, data: bytes, *, at: int, timeout: float = 1.8) -> int:
        self._count(f"append:{name}")
        self._count("append")
        return await super().append(name, data, at=at, timeout=timeout)

    async def query(self, table: str, where: Where, *, timeout: float = 1.8):
        self._count("sweep" if where.less else "query")
        return await super().query(table, where, timeout=timeout)

    async def get(self, table, partition, row, *, select=None, timeout: float = 1.8):
        self._count("get:instances" if partition == "instances" else "get")
        return await super().get(table, partition, row, select=select, timeout=timeout)


Hook = Any


@contextlib.asynccontextmanager
async def instances(
    n: int = 2,
    *,
    data: MemoryData | None = None,
    skews=(),
    take_over: Hook = None,
    life=LIFE,
    sweep_every: float | None = None,
    **config,
):
    """``n`` StreamLogs (instances) on one MemoryData; ``skews``: seconds each one's clock is off;
    ``sweep_every``: seconds between their sweeps (the config's ``sweep_seconds`` otherwise)."""
    data = data or MemoryData()
    logs = []
    for i in range(n):
        skew = skews[i] if i < len(skews) else 0.0
        store = CountingStore(data, StoreClock(wall=lambda skew=skew: time.time() + skew))
        hook = take_over(i) if callable(take_over) and getattr(take_over, "per_instance", False) else take_over
        cfg = ResumeConfig(**config)
        swept = Instances(
            store, life, sweeps=[(sweep_every or cfg.sweep_seconds, functools.partial(sweep, store, cfg))]
        )
        logs.append(StreamLog(store, swept, encode_error, cfg, take_over=hook))
    try:
        yield logs
    finally:
        for streams in logs:
            await streams.close(timeout=0.3)
            await streams.instances.close()


def kill(streams: StreamLog) -> None:
    """The instance dies: its tasks stop where they are, nothing says goodbye."""
    for task in streams.tasks:
        task.cancel()
    life = streams.instances
    life._closed = True
    for task in (life._beating, life._duty):
        if task is not None:
            task.cancel()


async def read_all(reader, limit: float = 15.0) -> bytes:
    out = []
    async with asyncio.timeout(limit):
        async for chunk in reader:
            out.append(chunk)
    return b"".join(out)


async def open_when_visible(streams: StreamLog, stream_id: str, after, caller=None, limit: float = 3.0):
    """open_reader on another instance, retried while the new stream's record is not written yet."""
    deadline = time.monotonic() + limit
    while True:
        try:
            return await streams.open_reader(stream_id, after, caller)
        except (StreamNotFound, StreamLogUnavailable):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


async def not_found(call: Awaitable) -> str:
    """Why ``call`` (an open_reader or a cancel) raised StreamNotFound: its ``reason``."""
    with pytest.raises(StreamNotFound) as raised:
        await call
    return raised.value.reason


async def produce(producer, events: list[bytes], gap: float = 0.01, final: bytes = DONE) -> bytes:
    """Append ``events`` then ``final``; the bytes the live caller would have got."""
    live = []
    for event in events:
        live.append(producer.append(event))
        await asyncio.sleep(gap)
    live.append(producer.append(final, final=True))
    producer.finish()
    return b"".join(live)


def regenerating(deltas_of=lambda request: request["deltas"], gap: float = 0.01, calls=None):
    """A request path's continuation for these tests: the stored request says how many deltas the
    answer has, and the rest is regenerated exactly after the stored ones (as the scripted upstream
    does): delta(i) for the event with id i + 1."""

    async def hook(claim: Claim) -> None:
        if calls is not None:
            calls.append(claim)
        for i in range(position(claim.last_id), deltas_of(claim.request)):
            if claim.producer.stop_requested.is_set():
                break
            claim.producer.append(delta(i))
            await asyncio.sleep(gap)
        claim.producer.append(DONE, final=True)
        claim.producer.finish()

    return hook
