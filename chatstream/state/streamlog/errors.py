"""What the stream log answers the request path when it cannot do what was asked: domain errors,
not HTTP (resumable.py turns them into statuses and bodies)."""

from __future__ import annotations


class StreamLogError(Exception):
    """A request the stream log refuses or cannot serve (the message is for the caller)."""


class StreamNotFound(StreamLogError):
    """Unknown, expired, or started by another caller (the same answer, so nothing leaks)."""


class InvalidStreamId(StreamNotFound):
    """Not an id this package makes (wrong length, path characters...): never looked up."""


class BadLastEventId(StreamLogError):
    """Last-Event-ID is not a non-negative integer of at most 15 digits, or is past the stream's end."""


class TooManyReaders(StreamLogError):
    """The stream has ``max_readers_per_stream`` readers (on all instances), or this instance serves
    ``max_readers``."""


class TooManyStreams(StreamLogError):
    """This instance already produces ``max_producers`` streams: stream this one without resumability."""


class Unavailable(StreamLogError):
    """The store did not answer (in time): try again shortly."""
