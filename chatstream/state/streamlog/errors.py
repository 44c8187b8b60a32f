"""What the stream log answers the request path when it cannot do what was asked: domain errors,
not HTTP (resumable.py turns them into statuses and bodies)."""

from __future__ import annotations


class StreamLogError(Exception):
    """A request the stream log refuses or cannot serve (the message is for the caller)."""


class StreamNotFound(StreamLogError):
    """Unknown, expired, started by another caller (the same answer, so nothing leaks), or not an id
    this package makes (wrong length, path characters...: never looked up). ``reason``: which, for
    the log (the caller's message is the same for all)."""

    def __init__(self, reason: str):
        super().__init__("no such stream")
        self.reason = reason


class PastTheEnd(StreamLogError):
    """A reading asked to start after an event the stream never had: ``after`` is past ``last``, the
    stream's last event."""

    def __init__(self, after: int, last: int):
        super().__init__(f"event {after} is past the end of the stream ({last})")
        self.after = after
        self.last = last


class TooManyReaders(StreamLogError):
    """This instance serves ``max_readers_per_stream`` readers of the stream, or ``max_readers``."""


class TooManyStreams(StreamLogError):
    """This instance already produces ``max_producers`` streams: stream this one without resumability."""


class StreamLogUnavailable(StreamLogError):
    """The store did not answer (in time): try again shortly."""
