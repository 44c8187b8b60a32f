"""What the tests of tools/fakeupstream read from it the same way for each API: a stream's raw
reads, where they cut characters, a stream that sends only its headers, and its stream records."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest


def stream_record(server: str, request_id: str, wait_s: float = 1.0) -> dict:
    """The server's record of the stream ``request_id``, once it has an outcome (or ``wait_s`` passed)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = [r for r in httpx.get(f"{server}/_scripted/streams").json() if r["request_id"] == request_id]
        assert len(records) == 1
        if records[0]["outcome"] is not None or time.monotonic() > deadline:
            return records[0]
        time.sleep(0.02)


def raw_reads(url: str, body: dict) -> list[bytes]:
    """A streamed request's body, as the reads that brought it."""

    async def read() -> list[bytes]:
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", url, json=body) as r:
                return [chunk async for chunk in r.aiter_raw()]

    return asyncio.run(read())


def cuts_inside_characters(reads: list[bytes]) -> list[int]:
    """The offsets where a read (not the last) ended inside a multi-byte UTF-8 character."""
    whole, cuts, pos = b"".join(reads), [], 0
    for piece in reads[:-1]:
        pos += len(piece)
        try:
            whole[:pos].decode("utf-8")
        except UnicodeDecodeError:
            cuts.append(pos)
    return cuts


def headers_only(url: str, body: dict) -> str:
    """A streamed request answered 200 whose body sends nothing (a read times out at 0.3 s), given
    up on; its request id."""
    with httpx.Client(timeout=httpx.Timeout(5, read=0.3)) as c:
        with c.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                next(r.iter_raw())
            return r.headers["x-request-id"]


def hang_up_on_stall(server: str, path: str, body: dict, marker: bytes, count: int) -> tuple[bytes, dict]:
    """A stream that goes silent after ``count`` ``marker``s, read that far, still open 0.1 s later,
    then hung up on: what was read, and the stream's record (client_disconnected within 1 s)."""
    with httpx.Client(timeout=5) as c:
        with c.stream("POST", server + path, json=body) as r:
            request_id, seen, pieces = r.headers["x-request-id"], b"", r.iter_raw()
            while seen.count(marker) < count:
                seen += next(pieces)  # (a `for ... break` would close the connection right away)
            time.sleep(0.1)
            assert stream_record(server, request_id, wait_s=0)["outcome"] is None  # still open
            assert seen.count(marker) == count
        hung_up = time.time()
    rec = stream_record(server, request_id)
    assert rec["outcome"] == "client_disconnected"
    assert rec["ended_at"] - hung_up < 1.0
    return seen, rec
