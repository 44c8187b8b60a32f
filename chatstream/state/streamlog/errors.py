"""The requests the resumable-streams layer refuses (streamlog.py): each error carries the HTTP
status the integrator answers with."""

from __future__ import annotations


class StreamLogError(Exception):
    """A request this layer refuses; ``status`` is the HTTP status the integrator should answer."""

    status = 400


class StreamNotFound(StreamLogError):
    """Unknown, expired, or started by another caller (the same answer, so nothing leaks)."""

    status = 404


class InvalidStreamId(StreamNotFound):
    """Not an id this module makes (wrong length, path characters...): never looked up."""


class BadLastEventId(StreamLogError):
    """Last-Event-ID is not a non-negative integer of at most 15 digits, or is past the stream's end."""

    status = 400


class TooManyReaders(StreamLogError):
    status = 429


class TooManyStreams(StreamLogError):
    """This instance already produces ``max_producers`` streams: stream this one without resumability."""

    status = 503
