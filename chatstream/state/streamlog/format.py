"""What a resumable stream is in the store, and what names it: the stream id; the stream's record
(one row) and its event log (an append blob of the route's events, opaque, numbered and framed by
chatstream/sse.py, with the markers this package writes); and ``Tail``, which reads a stored log as
it grows.

The event log, blob ``{id}``: whole events (a block never ends mid-event), each ``id: N`` first, and
comment lines of ours (``sse.comment``), which no reader passes on:

- ``: end`` — the last event is the route's final one; ``: lost`` — it is an error written here (the
  stream stopped being stored before its end);
- ``: epoch E L`` — another instance took the stream over (epoch E) after event L: the fence, appended
  at the stored end, so the previous producer's next append fails on its append position;
- ``: handover`` — its producer stopped (its instance drains): a reader takes it over at once;
- ``: ack NONCE L`` — the producer saw the reader NONCE registered (``inbox.py``) when it had handed
  out events up to L, all stored before this line: a reading after an id above L asks for one never handed out.

The record, row ``stream`` of partition ``{id}`` in ``chatstreamStreams``: ``Record``. The request a
continuation needs (the route's params as JSON) is in the record when small, else in the blob
``{id}.request``. The blob is made at the producer's first write: a stream that ends before it (one
nobody elsewhere followed, shorter than a checkpoint) has its whole log in the record instead
(``events``, written with its end), and no blob."""

from __future__ import annotations

import base64
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ... import sse
from .errors import InvalidStreamId

Route = Literal["chat", "openai"]
ROUTES: tuple[Route, ...] = ("chat", "openai")

# --- ids ------------------------------------------------------------------------------------

# A stream id: its start time by the store's clock (milliseconds since 1970, 6 bytes) and 16 random
# bytes, URL-safe base64 without padding (8 + 22 characters). The time lets a reader elsewhere tell
# a stream whose record is still being written from one that does not exist; the 128 random bits
# are the capability.
ID_LENGTH = 30
_ID = re.compile(r"[A-Za-z0-9_-]{30}")


def new_stream_id(now: float | None) -> str:
    """A new id for a stream started at ``now`` (the store's clock, seconds; None when this process
    has not heard the store's clock yet: the id then says so, and a reader waits for its record as
    for a young one)."""
    started = int((now or 0.0) * 1000).to_bytes(6, "big")
    return base64.urlsafe_b64encode(started).decode() + secrets.token_urlsafe(16)


def started_at(stream_id: str) -> float:
    """When the stream ``stream_id`` (a checked id) was started, by the store's clock (seconds; 0:
    not known, ``new_stream_id``)."""
    return int.from_bytes(base64.urlsafe_b64decode(stream_id[:8]), "big") / 1000


def log_tag(stream_id: str) -> str:
    """How logs name a stream: six of its random characters (the whole id is the capability to read
    it when caller keys are off, so it is never logged)."""
    return stream_id[8:14] + "…"


def check_stream_id(stream_id: str) -> str:
    if not isinstance(stream_id, str) or _ID.fullmatch(stream_id) is None:
        raise InvalidStreamId("no such stream")
    return stream_id


# --- the record -------------------------------------------------------------------------------

RECORD_ROW = "stream"
INLINE_REQUEST = 30_000  # characters of request JSON kept in the record itself (a property holds 32,768)
INLINE_EVENTS = 30_000  # characters of a whole log kept in the record (``Record.events``) instead of a blob


def text_units(text: str) -> int:
    """UTF-16 code units (what a table property's limit counts)."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def request_blob(stream_id: str) -> str:
    return f"{stream_id}.request"


def inbox_partition(instance: str) -> str:
    """The partition of the instance's inbox (inbox.py)."""
    return f"i-{instance}"


@dataclass
class Record:
    """A stream's row: what a reader needs (route, owner, which instance produces it now, whether it
    is over, when it expires) and what a continuation needs (the request, the app's request id).
    Times are the store's clock. ``epoch`` counts the producers: 1, then one more per takeover."""

    stream_id: str
    route: Route
    owner: str | None
    instance: str
    epoch: int
    created: float
    expires: float
    state: str = "live"  # live | ended | lost
    request_id: str | None = None
    request: str | None = None  # the request JSON, when it is small enough to be here
    request_stored: bool = False  # ...or it is in the blob request_blob(id)
    cancelled: bool = False  # cancelled while nobody produced it: a takeover stops at once
    # The whole log, end marker included, when the stream ended before its blob was made (then
    # there is no blob): written with the record's end, never with ``row``.
    events: str | None = None
    etag: str = ""

    def row(self) -> dict[str, Any]:
        return {
            "PartitionKey": self.stream_id,
            "RowKey": RECORD_ROW,
            "route": self.route,
            "owner": self.owner,
            "instance": self.instance,
            "epoch": self.epoch,
            "created": self.created,
            "expires": self.expires,
            "state": self.state,
            "request_id": self.request_id,
            "request": self.request,
            "request_blob": self.request_stored or None,
            "cancelled": self.cancelled or None,
        }

    @classmethod
    def of(cls, row: Any) -> Record:
        route = row.get("route")
        return cls(
            stream_id=row["PartitionKey"],
            route=route if route in ROUTES else "chat",
            owner=row.get("owner"),
            instance=str(row.get("instance") or ""),
            epoch=int(row.get("epoch") or 1),
            created=float(row.get("created") or 0.0),
            expires=float(row.get("expires") or 0.0),
            state=str(row.get("state") or "live"),
            request_id=row.get("request_id"),
            request=row.get("request"),
            request_stored=bool(row.get("request_blob")),
            cancelled=bool(row.get("cancelled")),
            events=row.get("events"),
            etag=getattr(row, "etag", ""),
        )


# What a reader reads of the record (never the request, which may be 60 KB; the log when it is there).
READER_FIELDS = ("route", "owner", "instance", "epoch", "created", "expires", "state", "events")

# --- the event log ----------------------------------------------------------------------------

# The markers, comment texts (``sse.comment``).
END = b"end"
LOST = b"lost"
HANDOVER = b"handover"
_EPOCH = b"epoch "
_ACK = b"ack "
BLOCK_LIMIT = 4 * 1024 * 1024  # the largest append block
BLOCKS_LIMIT = 50_000  # blocks an append blob may have


def epoch_marker(epoch: int, after: int) -> bytes:
    return sse.comment(b"%s%d %d" % (_EPOCH, epoch, after))


def ack_marker(nonce: str, last_id: int) -> bytes:
    return sse.comment(b"%s%s %d" % (_ACK, nonce.encode(), last_id))


class EncodeError(Protocol):
    """The request path's encoder for an error event this package has to write (a stream that lost its
    producer, a store that failed...): one complete SSE event in ``route``'s format, without an
    ``id:`` line. ``type`` is ``stream_lost`` (the stream ends here), ``stream_moved`` (this reading
    ends, the stream goes on elsewhere) or ``store_unavailable`` (this reading ends)."""

    def __call__(self, route: Route, type: str, message: str, retryable: bool, next_id: int) -> bytes: ...


def error_event(encode_error: EncodeError, route: Route, type: str, message: str, number: int) -> bytes:
    """A retryable error event of ours, numbered ``number``."""
    return sse.numbered(number, encode_error(route, type, message, True, number))


def split_events(data: bytes) -> list[bytes]:
    """The numbered events of stored bytes (whole events), each with its blank line; comments dropped."""
    return [part + sse.END_OF_EVENT for part in sse.split(data)[0] if sse.event_id(part) is not None]


class Tail:
    """Reads a stored log as it grows: ``feed`` the bytes from ``offset`` on, get the events after
    ``cursor`` (each once). What it has seen: the last id stored (``last_id``), the end marker
    (``end``), the last event (``final``), the latest takeover (``epoch``, ``seam``: the last id
    before it), a hand-over since then (``handover``) and the producers' acks (``acks``)."""

    def __init__(self, after: int):
        self.cursor = after  # the last id handed out (or skipped)
        self.last_id = 0
        self.end: bytes | None = None
        self.final = b""
        self.epoch = 1
        self.seam: int | None = None
        self.handover = False
        self.acks: dict[str, int] = {}
        self.rest = b""
        self.offset = 0  # bytes of the blob consumed

    def feed(self, data: bytes) -> bytes:
        self.offset += len(data)
        parts, self.rest = sse.split(self.rest + data if self.rest else data)
        out = []
        for part in parts:
            number = sse.event_id(part)
            if number is not None:
                self.last_id = number
                self.final = part
                if number > self.cursor:
                    out.append(part)
                    self.cursor = number
                continue
            marker = sse.comment_text(part)
            if marker is None:
                continue
            if marker in (END, LOST):
                self.end = marker
            elif marker.startswith(_EPOCH):
                epoch, _, after = marker[len(_EPOCH) :].partition(b" ")
                self.epoch, self.seam, self.handover = int(epoch), int(after), False
            elif marker == HANDOVER:
                self.handover = True
            elif marker.startswith(_ACK):
                nonce, _, last = marker[len(_ACK) :].partition(b" ")
                self.acks[nonce.decode()] = int(last)
        return sse.join(out)

    def past_seam(self, after: int) -> bool:
        """Whether a client at ``after`` may hold events a dead producer handed out but never stored
        (past the latest takeover's seam): those ids cannot be checked any more."""
        return self.seam is not None and after > self.seam
