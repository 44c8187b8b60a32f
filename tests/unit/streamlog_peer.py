"""A resumable-stream producer in a process of its own, for test_streamlog.py (another "instance"):

    python tests/unit/streamlog_peer.py CONNECTION_STRING EVENTS INTERVAL_MS

Starts one /api/chat stream, prints ``stream <id>``, then appends EVENTS delta events, one every
INTERVAL_MS, each carrying ``t``: time.monotonic() when it was appended (the same clock as the
test process on Linux), then the ``done`` event; prints ``stored`` once all is stored and exits.
The test kills it (SIGKILL) to play a producer whose instance dies."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from chatstream import http as sse  # noqa: E402 - after sys.path names the repository
from chatstream.state.legacy_store import StorageConfig, Store  # noqa: E402 - after sys.path names the repository
from chatstream.state.streamlog import StreamLog  # noqa: E402 - after sys.path names the repository


def encode_error(route, type, message, retryable, next_id) -> bytes:
    return sse.event({"error": {"type": type, "message": message, "retryable": retryable}}, b"error")


async def main(connection: str, events: int, interval: float) -> None:
    store = Store(StorageConfig(connection_string=connection))
    streams = StreamLog(store, encode_error)
    producer = streams.start("chat", None)
    print("stream", producer.id, flush=True)
    producer.caller_gone()  # nobody reads it live: only resumed readers
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i in range(events):
        await asyncio.sleep(max(0.0, start + i * interval - loop.time()))
        producer.append(sse.event({"delta": f"w{i} ", "t": time.monotonic()}))
    producer.append(sse.event({"finish_reason": "stop"}, b"done"), final=True)
    producer.finish()
    print("stored" if await producer.wait_stored(30) else "not stored", flush=True)
    await streams.close()
    await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1000))
