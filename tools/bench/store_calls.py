"""CPU per store call, in-process, on a real Azurite started here: N sequential calls of each hot kind
(insert, get, replace under an ETag, merge, upsert, append_create, append, read, put, and a
batch of one insert and of ten, a query of ten rows) through
``AzureStore``, timed with time.process_time (this process's CPU: the client side only).

    .venv/bin/python tools/bench/store_calls.py [--n 300]"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


async def bench(connection: str, n: int) -> dict[str, float]:
    from chatstream.state.store import LIMITS_TABLE, Op, Where
    from chatstream.state.store_account import Account
    from chatstream.state.store_azure import AzureStore

    store = AzureStore(Account(connection))
    out: dict[str, float] = {}
    row = {"n": 7, "pico": 123_456_789_012_345, "x": 1.5, "ok": True, "s": "text"}

    async def timed(name: str, make) -> None:
        await make(-1)  # warm: tables, container, connections, SAS
        cpu = time.process_time()
        for i in range(n):
            await make(i)
        out[name] = round((time.process_time() - cpu) / n * 1000, 3)

    etags: dict[int, str] = {}

    async def insert(i: int) -> None:
        etags[i] = await store.insert(LIMITS_TABLE, {"PartitionKey": "bench", "RowKey": f"r{i}", **row})

    async def replace(i: int) -> None:
        etags[i] = await store.replace(LIMITS_TABLE, {"PartitionKey": "bench", "RowKey": f"r{i}", **row}, etag=etags[i])

    async def merge(i: int) -> None:
        await store.merge(LIMITS_TABLE, {"PartitionKey": "bench", "RowKey": f"r{i}", "m": i})

    async def upsert(i: int) -> None:
        await store.upsert(LIMITS_TABLE, {"PartitionKey": "bench", "RowKey": f"u{i}", **row})

    async def get(i: int) -> None:
        await store.get(LIMITS_TABLE, "bench", f"r{i}")

    async def append_create(i: int) -> None:
        await store.append_create(f"bench/{i}")

    async def append(i: int) -> None:
        await store.append(f"bench/{i}", b"x" * 200, at=0)

    async def read(i: int) -> None:
        await store.read(f"bench/{i}", 100)

    async def batch(i: int) -> None:
        entity = {"PartitionKey": f"b{i}", "RowKey": "c", **row}
        await store.batch(LIMITS_TABLE, [Op("insert", entity)])

    async def batch10(i: int) -> None:
        await store.batch(
            LIMITS_TABLE, [Op("insert", {"PartitionKey": f"t{i}", "RowKey": f"c{k}", **row}) for k in range(10)]
        )

    async def query(i: int) -> None:  # ten rows of one partition (a batch10's), three properties each
        await store.query(LIMITS_TABLE, Where(partition=f"t{max(i, 0)}", rows_from="c", select=("n", "x", "ok")))

    async def put(i: int) -> None:
        await store.put(f"bench/j{i}", b"y" * 500)

    try:
        for name, make in (
            ("insert", insert),
            ("get", get),
            ("replace", replace),
            ("merge", merge),
            ("upsert", upsert),
            ("append_create", append_create),
            ("append", append),
            ("read", read),
            ("put", put),
            ("batch", batch),
            ("batch10", batch10),
            ("query", query),
        ):
            await timed(name, make)
    finally:
        await store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    from servers import Azurite

    azurite = Azurite()
    try:
        print(json.dumps(asyncio.run(bench(azurite.connection_string, args.n))))
    finally:
        azurite.stop()


if __name__ == "__main__":
    main()
