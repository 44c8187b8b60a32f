"""What names a resumable stream and a place in it: the routes whose streams are kept, the stream
id (when it was started, and 16 random bytes: the capability to read it), and the Last-Event-ID a
resume continues after."""

from __future__ import annotations

import base64
import re
import secrets
import time
from typing import Literal

from .errors import BadLastEventId, InvalidStreamId

Route = Literal["chat", "openai"]
ROUTES: tuple[Route, ...] = ("chat", "openai")
StopReason = Literal["cancelled", "abandoned", "timeout"]

# A stream id: its start time (milliseconds since 1970 in 6 bytes) and 16 random bytes, URL-safe
# base64 without padding (8 + 22 characters). The time lets a reader elsewhere tell a stream whose
# record is still being written from one that does not exist; the 128 random bits are the capability.
_ID_BYTES = 16
ID_LENGTH = 30
_ID = re.compile(r"[A-Za-z0-9_-]{30}")
# Last-Event-ID: a decimal event id, at most 15 digits (ids stay exact in a double and in JSON).
_LAST_ID = re.compile(r"[0-9]{1,15}")


def new_stream_id(now: float | None = None) -> str:
    started = int((time.time() if now is None else now) * 1000).to_bytes(6, "big")
    return base64.urlsafe_b64encode(started).decode() + secrets.token_urlsafe(_ID_BYTES)


def started_at(stream_id: str) -> float:
    """When the stream ``stream_id`` (a checked id) was started, by its producer's clock (seconds)."""
    return int.from_bytes(base64.urlsafe_b64decode(stream_id[:8]), "big") / 1000


def log_tag(stream_id: str) -> str:
    """How logs name a stream: six of its random characters (the whole id is the capability to read
    it when caller keys are off, so it is never logged)."""
    return stream_id[8:14] + "…"


def check_stream_id(stream_id: str) -> str:
    if not isinstance(stream_id, str) or _ID.fullmatch(stream_id) is None:
        raise InvalidStreamId("no such stream")
    return stream_id


def parse_last_event_id(header: str | None, query: str | None = None) -> int | None:
    """The event id a resume continues after: the ``Last-Event-ID`` header, else the
    ``last_event_id`` query parameter; None (from the start) when neither is given or the header is
    empty (what EventSource sends before any id). BadLastEventId for anything else than 0..10^15-1."""
    value = header if header is not None else query
    if value is None or (header is not None and not header.strip()):
        return None if header is None or query is None else parse_last_event_id(None, query)
    value = value.strip()
    if _LAST_ID.fullmatch(value) is None:
        raise BadLastEventId("Last-Event-ID must be a non-negative integer of at most 15 digits")
    return int(value)
