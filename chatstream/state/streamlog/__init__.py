"""Resumable streams' storage (docs/resumable.md): a stream's SSE events numbered, kept in the shared
store, replayed on any instance, followed live, cancelled from any instance, taken over by another
instance when its producer dies or drains, and deleted after their TTL. The request path drives it
through ``StreamLog`` (log.py); everything it imports is named here.

The design, one module per concept:

- format.py — what is stored: the stream id (its start by the store's clock, 128 random bits),
  the record (one row: route, owner, producing instance, epoch, expiry, the request a
  continuation needs), the event log (an append blob of the route's events, opaque, numbered and framed by
  chatstream/sse.py, with our markers as comments:
  end, lost, the epoch fence of a takeover, hand-over, acks; made at the first write: a stream that
  ends before it has its whole log in the record instead), and ``Tail``, which reads it.
- producer.py — ``Producer``: numbers and keeps events in memory (``Kept``, no I/O); ids of a
  takeover's producer are of its epoch, so an id names one event everywhere (format.EPOCH_IDS).
  Readers here get what is stored; only the live caller is ahead of the log.
- writer.py — ``Writer``: stores a producer's events in the background in whole-event blocks at
  the expected append position; a foreign byte at that position means it was taken over: it stops
  (``moved``). How far the log trails the live caller: at most ``checkpoint_seconds`` (5 s) or
  ``flush_bytes``; ``fast_flush_seconds`` (100 ms) while a reader follows (here or elsewhere), after
  the caller hung up, and after a takeover.
- readers.py — ``Reader``: follows a stream from its producer's memory when it is here, else from
  the store, through any takeover; slots.py — reader slots in the store (the per-stream limit
  across instances).
- inbox.py — a producing instance's inbox rows: cancels, readers elsewhere (fast writes, acks,
  abandonment), one query per tick for all its streams.
- takeover.py — ``claim``: one winner by a conditional write on the record, then the fence in the
  log; what a continuation needs (``Claim``).
- log.py — ``StreamLog``, the public face; config.py (``ResumeConfig``, and ``Context``: what the
  parts share), errors.py (its domain errors).

Liveness is ``Instances`` (state/instances.py): one bounded heartbeat row per instance, nothing per
stream; every time that crosses instances is the store's clock. Sweeps run on one instance (the
duty holder, ``Instances.every``)."""

from .config import ResumeConfig
from .errors import (
    InvalidStreamId,
    PastTheEnd,
    StreamLogError,
    StreamNotFound,
    TooManyReaders,
    TooManyStreams,
    Unavailable,
)
from .format import EncodeError, LogError, check_stream_id, log_tag, new_stream_id, started_at
from .log import StreamLog, TakeOverHook
from .producer import MOVED, Producer
from .readers import Reader
from .takeover import Claim

__all__ = [
    "MOVED",
    "Claim",
    "EncodeError",
    "InvalidStreamId",
    "LogError",
    "PastTheEnd",
    "Producer",
    "Reader",
    "ResumeConfig",
    "StreamLog",
    "StreamLogError",
    "StreamNotFound",
    "TakeOverHook",
    "TooManyReaders",
    "TooManyStreams",
    "Unavailable",
    "check_stream_id",
    "log_tag",
    "new_stream_id",
    "started_at",
]
