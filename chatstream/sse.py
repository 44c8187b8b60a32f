"""Events of the /api/chat stream, and their bytes on the wire (text/event-stream).

``data: {"delta": "..."}`` per piece of text, then exactly one ``event: done`` or ``event: error``;
``: keep-alive`` comments carry nothing. Text travels inside JSON, so newlines and any Unicode
arrive exactly."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import ApiError

KEEP_ALIVE = b": keep-alive\n\n"


@dataclass(frozen=True, slots=True)
class Delta:
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str
    usage: dict | None
    model: str | None
    id: str | None


@dataclass(frozen=True, slots=True)
class Failed:
    error: ApiError


Event = Delta | Done | Failed


def _json(payload) -> bytes:
    try:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from upstream: escape it rather than fail
        return json.dumps(payload, separators=(",", ":")).encode("ascii")


def encode(event: Event) -> bytes:
    if isinstance(event, Delta):
        return b"data: " + _json({"delta": event.text}) + b"\n\n"
    if isinstance(event, Done):
        body = {"finish_reason": event.finish_reason, "usage": event.usage, "model": event.model, "id": event.id}
        return b"event: done\ndata: " + _json(body) + b"\n\n"
    return b"event: error\ndata: " + _json(event.error.body()) + b"\n\n"
