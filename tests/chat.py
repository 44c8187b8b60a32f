"""A small test client for POST /api/chat: the events as they arrive, with their arrival times."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
from httpx_sse import EventSource


@dataclass
class Result:
    status: int
    headers: httpx.Headers
    events: list[tuple[float, str, object]] = field(default_factory=list)  # (seconds since send, event, data)
    body: object = None  # the JSON body of a non-stream answer
    raw: bytes = b""

    @property
    def text(self) -> str:
        return "".join(d["delta"] for _, e, d in self.events if e == "message")

    @property
    def deltas(self) -> list[str]:
        return [d["delta"] for _, e, d in self.events if e == "message"]

    @property
    def last(self) -> tuple[str, object]:
        _, event, data = self.events[-1]
        return event, data

    def terminal_events(self) -> list[str]:
        return [e for _, e, _ in self.events if e in ("done", "error")]


def chat(
    url: str, body=None, *, content: bytes | None = None, headers: dict | None = None, timeout: float = 30.0
) -> Result:
    hdrs = {"content-type": "application/json", **(headers or {})}
    data = content if content is not None else json.dumps(body).encode()
    started = time.monotonic()
    with httpx.Client(timeout=timeout) as client:
        with client.stream("POST", url, content=data, headers=hdrs) as response:
            result = Result(response.status_code, response.headers)
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                result.raw = response.read()
                result.body = json.loads(result.raw) if result.raw else None
                return result
            for sse in EventSource(response).iter_sse():
                result.events.append((time.monotonic() - started, sse.event, json.loads(sse.data)))
    return result


def prompt(scenario: str, text: str = "hello") -> dict:
    """A request body whose prompt picks a scenario of the scripted upstream."""
    return {"prompt": f"[scenario:{scenario}] {text}"}
