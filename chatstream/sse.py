"""Server-sent events on bytes: the one place that knows their syntax. Writing ours: ``event`` (a
``data:`` payload, optionally named; ``around`` one in pieces), ``numbered`` (an ``id:`` line put before
a framed event), ``comment``. Reading: ``Parser`` reads anyone's stream (the upstream's, or our own
stored events) into its ``data`` payloads; ``split`` cuts a stream as we write it (LF line ends, the
``id:`` line first) into whole events, which ``event_id``, ``comment_text`` and ``is_comment`` read,
so that the stream log stores and replays events as opaque bytes without parsing them.

The payloads are bytes (the API layer's JSON): this module frames them and knows nothing of what they
say. Everything works on bytes so that json.loads gets whole UTF-8 text however the network split it,
and so that no text or line layer costs more generators per chunk, which matters at thousands of
chunks per second."""

from __future__ import annotations

from collections.abc import Iterable

END_OF_EVENT = b"\n\n"


def event(data: bytes, name: bytes | None = None) -> bytes:
    """One event: ``data: <data>``, with ``event: <name>`` first when named. ``data`` is one line (our
    payloads are compact JSON, which has no raw line ends); it is not checked, on the per-delta path."""
    if name:
        return b"event: " + name + b"\ndata: " + data + END_OF_EVENT
    return b"data: " + data + END_OF_EVENT


def around(head: bytes, tail: bytes) -> tuple[bytes, bytes]:
    """What goes before and after a value written apart: ``before + value + after`` is
    ``event(head + value + tail)``. The per-delta path's (a JSON object around a value, without a
    dict to build and walk, or a call to frame it, for every delta)."""
    return b"data: " + head, tail + END_OF_EVENT


def numbered(number: int, framed: bytes) -> bytes:
    """``framed`` (one whole event, as ``event`` makes it) with ``id: <number>`` as its first line."""
    return b"id: %d\n%s" % (number, framed)


def comment(text: bytes) -> bytes:
    """A comment-only event (``: <text>``): readers see nothing, proxies see traffic."""
    return b": " + text + END_OF_EVENT


KEEP_ALIVE = comment(b"keep-alive")


def is_comment(part: bytes) -> bool:
    """Whether ``part`` (an event without its blank line) is comment lines only."""
    return part.startswith(b":") and all(line.startswith(b":") for line in part.split(b"\n"))


def comment_text(part: bytes) -> bytes | None:
    """The text of ``part`` when it is one comment line as ``comment`` writes it, else None."""
    if part.startswith(b": ") and b"\n" not in part:
        return part[2:]
    return None


def event_id(part: bytes) -> int | None:
    """The id of ``part`` (an event as ``numbered`` writes it, with or without its blank line);
    None for an event without an id first."""
    if not part.startswith(b"id: "):
        return None
    newline = part.find(b"\n")
    return int(part[4:newline] if newline > 0 else part[4:])


def split(buffer: bytes) -> tuple[list[bytes], bytes]:
    """``buffer`` (events as we write them: LF line ends) cut into its whole events, each without its
    blank line, and the rest (an event not complete yet)."""
    cut = buffer.rfind(END_OF_EVENT)
    if cut < 0:
        return [], buffer
    return buffer[:cut].split(END_OF_EVENT), buffer[cut + 2 :]


def join(parts: Iterable[bytes]) -> bytes:
    """Events as ``split`` gives them, back to a stream."""
    return b"".join(part + END_OF_EVENT for part in parts)


class Parser:
    """Reads an event stream: ``feed(piece)`` returns the ``data`` of each event completed by
    ``piece`` (data lines joined with LF), up to ``[DONE]``. Lines end with LF, CRLF or CR, also
    when a CRLF is split between pieces; comments, ``event:`` and ``id:`` lines carry nothing the
    relay reads."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self._cr = False  # the last piece ended with CR: an LF starting the next one belongs to it
        self.done = False

    def feed(self, piece: bytes) -> list[bytes]:
        if (
            not self._buffer
            and not self._data
            and not self._cr
            and piece.startswith(b"data: ")
            and piece.endswith(b"\n\n")
            and piece.count(b"\n") == 2
            and b"\r" not in piece
        ):  # the common piece: exactly one event of one data line
            payload = piece[6:-2]
            if payload == b"[DONE]":
                self.done = True
                return []
            return [payload]
        if not piece:
            return []
        if self._cr and piece.startswith(b"\n"):
            piece = piece[1:]
        self._cr = piece.endswith(b"\r")
        buffer = self._buffer + piece
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, self._buffer = buffer.split(b"\n")
        events = []
        for line in lines:
            if line.startswith(b"data:"):
                self._data.append(line[6:] if line.startswith(b"data: ") else line[5:])
            elif not line and self._data:  # a blank line ends the event
                payload = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                self._data = []
                if payload == b"[DONE]":
                    self.done = True
                    break
                events.append(payload)
        return events
