"""Resumable streams' storage layer (docs/resumable.md): ``StreamLog`` (log.py) and the names an
integrator uses, from the modules of this package."""

from .config import ResumeConfig
from .errors import BadLastEventId, InvalidStreamId, StreamLogError, StreamNotFound, TooManyReaders, TooManyStreams
from .format import BLOCK_LIMIT, BLOCKS_LIMIT, EncodeError
from .ids import ROUTES, Route, StopReason, check_stream_id, log_tag, new_stream_id, parse_last_event_id, started_at
from .log import StreamLog
from .producer import Producer
from .readers import Reader

__all__ = [
    "BLOCKS_LIMIT",
    "BLOCK_LIMIT",
    "ROUTES",
    "BadLastEventId",
    "EncodeError",
    "InvalidStreamId",
    "Producer",
    "Reader",
    "ResumeConfig",
    "Route",
    "StopReason",
    "StreamLog",
    "StreamLogError",
    "StreamNotFound",
    "TooManyReaders",
    "TooManyStreams",
    "check_stream_id",
    "log_tag",
    "new_stream_id",
    "parse_last_event_id",
    "started_at",
]
