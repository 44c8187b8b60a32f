"""What a resumable stream is in the store, and what names it: the stream id; the stream's record
(one row) and its event log (an append blob of the route's events, opaque, numbered and framed by
chatstream/sse.py, with the markers this package writes); and ``Tail``, which reads a stored log as
it grows.

The event log, blob ``{id}``: whole events (a block never ends mid-event), each ``id: N`` first, and
comment lines of ours (``sse.comment``), which no reader passes on:

- ``: end`` — the last event is the route's final one; ``: lost`` — it is an error written here (the
  stream stopped being stored before its end);
- ``: epoch E L`` — another instance took the stream over (epoch E) after event L (the fence:
  takeover.py). Ids above L that earlier producers handed out were never stored (``Tail.broken``);
- ``: handover`` — its producer stopped (its instance drains): a reader takes it over at once;
- ``: ack NONCE L`` — the producer saw the reader NONCE registered (``inbox.py``) when it had handed
  out events up to L, all stored before this line: a reading after an id above L asks for one never handed out.

The record, row ``stream`` of partition ``{id}`` in ``chatstreamStreams``: ``Record``. The request a
continuation needs (the route's params as JSON) is in the record when small, else in the blob
``{id}.request``. The blob is made at the producer's first write: a stream that ends before it (one
nobody elsewhere followed, shorter than a checkpoint) has its whole log in the record instead
(``events``, written with its end), and no blob: ``stored_log`` reads either."""

from __future__ import annotations

import base64
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ... import sse
from ..store import STREAMS_TABLE, Store
from .errors import StreamNotFound

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
        raise StreamNotFound("malformed id")
    return stream_id


# An event's id: its position in the stream (1, 2, 3…) plus ``EPOCH_IDS`` for every takeover before
# the producer that made it (epoch E numbers its first event ``(E - 1) * EPOCH_IDS + L + 1`` after a
# fence at L). The live caller of a producer that dies holds ids its log never stored; the new
# producer's ids never reuse them, so an id names one event on every instance, and a client holding
# one of them is told its text cannot be made whole (``never_stored``) instead of being handed other
# text under the same ids. A stream has fewer positions than this (``Producer`` ends it before).
EPOCH_IDS = 1_000_000


def epoch_id(epoch: int, position: int) -> int:
    """The id of the event at ``position`` made by the producer of ``epoch``."""
    return (epoch - 1) * EPOCH_IDS + position


def position(event_id: int) -> int:
    """Where the event ``event_id`` is in its stream (1 for the first)."""
    return event_id % EPOCH_IDS


def never_stored(after: int, fences: list[tuple[int, int]]) -> bool:
    """Whether the id ``after`` is one a producer handed out and never stored: above a fence's last
    stored id L, and of an epoch before the fence's E (``fences``: each (E, L) of the log)."""
    return any(seam < after < epoch_id(epoch, 0) for epoch, seam in fences)


# --- the record -------------------------------------------------------------------------------

RECORD_ROW = "stream"


def fits_record(text: str) -> bool:
    """Whether ``text`` (the request JSON, a whole log: ``Record.events``) is kept in the record
    itself: at most 30,000 UTF-16 code units (a property holds 32,768)."""
    return len(text) <= 30_000 and len(text.encode("utf-16-le", "surrogatepass")) // 2 <= 30_000


def request_blob(stream_id: str) -> str:
    return f"{stream_id}.request"


@dataclass
class Record:
    """A stream's row: what a reader needs (route, owner, which instance produces it now, whether it
    is over, when it expires) and what a continuation needs (the request, the app's request id).
    Times are the store's clock. ``epoch`` counts the producers: 1, then one more per takeover."""

    stream_id: str
    route: str  # the request path's name for its events' format (opaque here)
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
    events: str | None = None  # the whole log when no blob was made (module docstring): not in ``row``
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
        return cls(
            stream_id=row["PartitionKey"],
            route=str(row.get("route") or ""),
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

    def log_from(self, offset: int) -> bytes | None:
        """The stored log from ``offset`` on when the record holds it whole (``events``: no blob)."""
        return self.events.encode()[offset:] if self.events is not None else None


async def stored_log(store: Store, stream_id: str) -> tuple[Record, bytes] | None:
    """A stream's record and its whole stored log (None: no record): the record's ``events`` when it
    holds it, else the blob (NotFound: none)."""
    row = await store.get(STREAMS_TABLE, stream_id, RECORD_ROW)
    if row is None:
        return None
    record = Record.of(row)
    inline = record.log_from(0)
    return record, inline if inline is not None else await store.read(stream_id)


def record_over(stream_id: str, state: str, expires: float, **more: Any) -> dict[str, Any]:
    """The record's fields that say the stream is over (``state`` ``ended`` or ``lost``), to merge:
    it is deleted at ``expires``."""
    return {"PartitionKey": stream_id, "RowKey": RECORD_ROW, "state": state, "expires": expires, **more}


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


# The errors this package writes as events (all retryable, ``Context.error_event``): ``stream_lost``
# (the stream, or this reader's text, cannot go on), ``stream_moved`` (this reading ends, the stream
# goes on elsewhere), ``store_unavailable`` (this reading ends).
LogError = Literal["stream_lost", "stream_moved", "store_unavailable"]
# The request path's encoder for them: one complete SSE event in the route's format, without an
# ``id:`` line (route, error, message).
EncodeError = Callable[[str, LogError, str], bytes]


def split_events(data: bytes) -> list[bytes]:
    """The numbered events of stored bytes (whole events), each with its blank line; comments dropped."""
    return [part + sse.END_OF_EVENT for part in sse.split(data)[0] if sse.event_id(part) is not None]


class Tail:
    """Reads a stored log as it grows: ``feed`` the bytes from ``offset`` on, get the events after
    ``cursor`` (each once). What it has seen: the last id stored (``last_id``), the end marker
    (``end``), the takeovers (``fences``: (epoch, last id before it); ``epoch``: the latest's), a
    hand-over since then (``handover``) and the producers' acks (``acks``).
    ``broken``: the cursor is an id the log never stored (``never_stored``): nothing after it can
    be handed out."""

    def __init__(self, after: int):
        self.cursor = after  # the last id handed out (or skipped)
        self.last_id = 0
        self.end: bytes | None = None
        self.fences: list[tuple[int, int]] = []
        self.handover = False
        self.broken = False
        self.acks: dict[str, int] = {}
        self.rest = b""
        self.offset = 0  # bytes of the blob consumed

    @property
    def epoch(self) -> int:
        return self.fences[-1][0] if self.fences else 1

    def feed(self, data: bytes) -> bytes:
        self.offset += len(data)
        parts, self.rest = sse.split(self.rest + data if self.rest else data)
        out = []
        for part in parts:
            number = sse.event_id(part)
            if number is not None:
                self.last_id = number
                if number > self.cursor and not self.broken:
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
                self.fences.append((int(epoch), int(after)))
                self.handover = False
                # Every event handed out before a fence is at most its L: a cursor above it (of an
                # earlier epoch) came from the client, and no later fence makes it whole.
                self.broken = self.broken or never_stored(self.cursor, self.fences[-1:])
            elif marker == HANDOVER:
                self.handover = True
            elif marker.startswith(_ACK):
                nonce, _, last = marker[len(_ACK) :].partition(b" ")
                self.acks[nonce.decode()] = int(last)
        return sse.join(out)


def producer_events(data: bytes, epoch: int) -> bytes:
    """The events the ``epoch``-th producer stored in a log (``data``, from its start): those with
    its ids, ``epoch_id``'s (all between its fence and the next one: a fence stops the previous
    producer's appends)."""
    return b"".join(event for event in split_events(data) if (sse.event_id(event) or 0) // EPOCH_IDS + 1 == epoch)
