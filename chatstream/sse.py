"""Server-sent events (text/event-stream) in both directions: ``SSEFramer`` reads the upstream's
stream, and ``event``/``KEEP_ALIVE`` write ours. Both work on bytes (see SSEFramer for why)."""
from __future__ import annotations

import json

KEEP_ALIVE = b": keep-alive\n\n"


# Built once: json.dumps with any option builds a new encoder per call.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_ESCAPED = json.JSONEncoder(separators=(",", ":")).encode


def dumps(payload) -> bytes:
    """Compact JSON in UTF-8 (raw, not \\u-escaped: smaller, and what OpenAI sends)."""
    try:
        return _COMPACT(payload).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from upstream: escape it rather than fail
        return _ESCAPED(payload).encode("ascii")


def event(payload, name: bytes | None = None) -> bytes:
    """One event: ``data: <json>`` (with ``event: <name>`` first when named)."""
    head = b"event: " + name + b"\ndata: " if name else b"data: "
    return head + dumps(payload) + b"\n\n"


class SSEFramer:
    """Server-sent events on bytes: ``feed(piece)`` returns the ``data`` of each event completed by
    ``piece`` (data lines joined with LF), up to ``[DONE]``. Lines end with LF, CRLF or CR, also
    when a CRLF is split between pieces; comments, ``event:`` and ``id:`` lines carry nothing for
    chat completions. It works on bytes so that json.loads gets whole UTF-8 text however the network
    split it, and so that no text or line layer costs two more generators per chunk (as httpx's
    would), which matters at thousands of chunks per second."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self._cr = False  # the last piece ended with CR: an LF starting the next one belongs to it
        self.done = False

    def feed(self, piece: bytes) -> list[bytes]:
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
