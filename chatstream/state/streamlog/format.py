"""What a resumable stream looks like in the store: the event log (an append blob whose content is
the SSE stream with its ``id:`` lines, ended by ``: end`` or ``: lost``), the keys of its rows, the
append blob's limits, the error events this layer writes itself (``EncodeError``), and ``Tail``,
which reads a stored log as it grows."""

from __future__ import annotations

from typing import Protocol

from .ids import Route

END = b": end"  # the log's last event is the route's final one
LOST = b": lost"  # the log's last event is an error written here: the stream stopped being stored
STREAM_ROW = "stream"  # the stream's entity (PartitionKey = id)
ALIVE_ROW = "alive"  # an instance's heartbeat (PartitionKey = i-{instance})
BLOCK_LIMIT = 4 * 1024 * 1024  # the largest append block
BLOCKS_LIMIT = 50_000  # blocks an append blob may have


class EncodeError(Protocol):
    """The integrator's encoder for an error event this module has to write (a stream that lost its
    producer, a store that failed...): one complete SSE event in ``route``'s format, without an
    ``id:`` line (the log adds ``id: next_id``). ``type`` is ``stream_lost`` or ``store_unavailable``."""

    def __call__(self, route: Route, type: str, message: str, retryable: bool, next_id: int) -> bytes: ...


def error_event(
    encode_error: EncodeError, route: Route, type: str, message: str, retryable: bool, number: int
) -> bytes:
    """An error event of ours, numbered ``number``."""
    return b"id: %d\n%s" % (number, encode_error(route, type, message, retryable, number))


def is_comment(part: bytes) -> bool:
    return all(line.startswith(b":") for line in part.split(b"\n"))


class Tail:
    """Reads a stored log as it grows: the events after ``cursor``, the end marker, the last id."""

    def __init__(self, after: int):
        self.cursor = after  # the last id handed out (or skipped)
        self.last_id = 0  # the last id stored so far
        self.end: bytes | None = None  # END or LOST once read
        self.rest = b""
        self.offset = 0  # bytes of the blob consumed

    def feed(self, data: bytes) -> bytes:
        self.offset += len(data)
        buffer = self.rest + data if self.rest else data
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self.rest = buffer
            return b""
        self.rest = buffer[cut + 2 :]
        out = []
        for part in buffer[:cut].split(b"\n\n"):
            if part.startswith(b"id: "):
                newline = part.find(b"\n")
                number = int(part[4:newline] if newline > 0 else part[4:])
                self.last_id = number
                if number > self.cursor:
                    out.append(part)
                    self.cursor = number
            elif part in (END, LOST):
                self.end = part
        return b"\n\n".join(out) + b"\n\n" if out else b""
