"""Issue #23 item 1: the Python worker must not grow per request. The runtime's HttpCoordinator kept
one entry per invocation forever (~2.1 KB a request); chatstream/worker_fix.py deletes it. Measured
on the worker process itself (its RSS from /_devhost/stats), after a warm-up."""

from __future__ import annotations

import asyncio

import httpx
import pytest

REQUESTS = 20_000
WARM_UP = 2_000
CONCURRENCY = 8
MAX_BYTES_PER_REQUEST = 200
pytestmark = pytest.mark.timeout(600)  # ~100 s here; slower on a busy machine


def worker_rss_kb(app) -> int:
    stats = httpx.get(app.url + "/_devhost/stats", timeout=10).json()
    (worker,) = stats["workers"]
    return worker["rss_kb"]


async def mixed_requests(base: str, count: int) -> None:
    """Mostly GET /api/v1/models (the cheapest request: what grows is the worker's, not the app's),
    with a non-streamed and a streamed completion and an unknown route in every 20."""
    chat = {"model": "gpt-test", "messages": [{"role": "user", "content": "[scenario:length] hi"}]}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        kind = i % 20
        if kind == 0:
            r = await client.post(base + "/api/v1/chat/completions", json=chat)
        elif kind == 1:
            r = await client.post(base + "/api/v1/chat/completions", json={**chat, "stream": True})
        elif kind == 2:
            r = await client.get(base + "/api/v1/nothing-here")
            assert r.status_code == 404
            return
        else:
            r = await client.get(base + "/api/v1/models")
        assert r.status_code == 200, r.text

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=CONCURRENCY)) as client:

        async def lane(start: int) -> None:
            for i in range(start, count, CONCURRENCY):
                await one(client, i)

        await asyncio.gather(*(lane(k) for k in range(CONCURRENCY)))


def test_the_worker_does_not_grow_per_request(app):
    asyncio.run(mixed_requests(app.url, WARM_UP))
    before = worker_rss_kb(app)
    asyncio.run(mixed_requests(app.url, REQUESTS))
    grown = (worker_rss_kb(app) - before) * 1024
    print(f"worker RSS: {before} kB after the warm-up, +{grown / REQUESTS:.0f} B per request over {REQUESTS}")
    assert grown / REQUESTS <= MAX_BYTES_PER_REQUEST, f"the worker grew {grown / REQUESTS:.0f} B per request"
