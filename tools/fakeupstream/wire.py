"""What both APIs share on the wire: the scenario a request's ``[scenario:NAME]`` marker names, an
error or JSON answer, and a stream of pre-built writes played to its end, a hang-up, or a reset on
purpose, with how it ended in its stream record."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from . import scenarios as sc
from .scenarios import RESET, STALL

JSON = (b"content-type", b"application/json")
SSE = (b"content-type", b"text/event-stream; charset=utf-8")
MARKER = re.compile(r"\[scenario:([^\]\s]+)\]")


class ApiError(Exception):
    """An error answer: its status, JSON body and extra headers."""

    def __init__(self, status: int, body: dict, headers: list | None = None):
        self.status, self.body, self.headers = status, body, headers or []


def invalid(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> ApiError:
    return ApiError(status, sc.error_body(message, "invalid_request_error", code, param))


def marked(text: str, known: Collection[str], param: str) -> str | None:
    """The scenario a ``[scenario:NAME]`` marker in ``text`` names (None: no marker); a name not in
    ``known`` is a 400 on ``param``."""
    found = MARKER.search(text)
    if not found:
        return None
    if found.group(1) not in known:
        message = f"Unknown scenario {found.group(1)!r} in [scenario:...] marker. Known: {', '.join(known)}"
        raise invalid(message, param, "unknown_scenario")
    return found.group(1)


class DeliberateReset(Exception):
    """Raised mid-body on purpose: uvicorn then closes the socket without ending the chunked body."""


async def send_json(send, status: int, obj: Any, headers: list | None = None) -> None:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [JSON, (b"content-length", str(len(body)).encode()), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def timed(plan: list[tuple[float, Any]]) -> AsyncIterator[Any]:
    """A plan's items, each at its seconds after the first is asked for."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for at, item in plan:
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item


async def play(
    receive,
    send,
    record: dict,
    source: AsyncIterator[Any],
    headers: list,
    sent: Callable[[bytes], None] | None = None,
) -> None:
    """Send the source's writes (``sent`` told of each); ``RESET`` drops the connection, ``STALL``
    waits for the client to hang up. ``record`` gets the stream's end: ``ended_at`` and its
    ``outcome`` (completed, reset, client_disconnected, or error at a server shutdown)."""
    task = asyncio.current_task()
    assert task is not None
    finished = disconnected = False

    async def watch_for_disconnect() -> None:
        nonlocal disconnected
        while (await receive())["type"] != "http.disconnect":
            pass
        if not finished:
            disconnected = True
            task.cancel()

    watcher = asyncio.create_task(watch_for_disconnect())
    outcome = "error"
    try:
        await send({"type": "http.response.start", "status": 200, "headers": [SSE, *headers]})
        async for item in source:
            if item is RESET:
                outcome = "reset"
                raise DeliberateReset(f"scenario {record['scenario']}: connection dropped on purpose")
            if item is STALL:
                await asyncio.get_running_loop().create_future()  # until the watcher cancels us
            await send({"type": "http.response.body", "body": item, "more_body": True})
            if sent is not None:
                sent(item)
        finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        outcome = "completed"
    except asyncio.CancelledError:
        if not disconnected:
            raise  # server shutdown: outcome "error"
        task.uncancel()
        outcome = "client_disconnected"
    finally:
        finished = True
        watcher.cancel()
        record["ended_at"] = time.time()
        record["outcome"] = outcome
