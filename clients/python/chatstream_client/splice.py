"""The splice: what passes from a resumable stream's successive bodies to the SDK reading it.

The bodies are the original answer and each resume (``GET …/streams/{id}`` with ``Last-Event-ID``).
Only whole events pass (the bytes of a partial one are held until its blank line, and dropped at a
cut), each at most once (an event whose integer ``id:`` is not above the last one passed is dropped),
and nothing after the stream's final event; comments (the app's keep-alives) not at all. So the SDK
reads one stream, byte for byte what it would have read without a cut, keep-alives aside.
Sans I/O: the transports feed it bytes and ask it what happened.

SSE framing (the WHATWG rules): lines end with LF, CRLF or CR, an event ends at an empty line, a line
starting with ``:`` is a comment. The final event is ``event: done`` or ``event: error`` (``/api/chat``),
``data: [DONE]`` or a ``data:`` object with a top-level ``error`` (chat completions). On a resumable
stream every event of the stream has an ``id:``; a final-shaped event *without* one is an error of
the reading, not of the stream (``stream_store_unavailable``, ``stream_moved``: the app asks the
client to come back after the same id): it is held, and the body it came in ends there."""

from __future__ import annotations

import json
import re

_LINE_END = re.compile(rb"[\r\n]")
_FINAL_NAMES = (b"done", b"error")


class Splice:
    """Feed it each body's bytes (``feed``), tell it when a body ends (``body_ended``)."""

    def __init__(self) -> None:
        self.last_id: str | None = None  # the id of the last event passed on (sent as Last-Event-ID)
        self.final = False  # the stream's final event has been passed on: nothing more passes
        self.held: bytes | None = None  # an id-less error event that ended the current body
        self.passed_events = 0  # events with an id passed on so far (progress, for the retry bound)
        self._buffer = bytearray()  # bytes of the current body not passed on yet
        self._scan = 0  # where the next line starts in _buffer
        self._after_cr = False  # the last line ended with a CR at the end of the data: an LF next is its
        self._lf_passes = False  # that line was the end of an event that passed: so does its LF
        self._reset_event()

    @property
    def body_over(self) -> bool:
        """The current body has nothing more to give: the final event, or an id-less error, came."""
        return self.final or self.held is not None

    def feed(self, data: bytes) -> bytes:
        """Bytes of the current body (any split); the whole events among them to pass on, in order."""
        if self.body_over or not data:
            if self.final and self._after_cr and self._lf_passes and data[:1] == b"\n":
                self._after_cr = False
                return b"\n"  # the LF of the final event's last CRLF
            self._after_cr = False
            return b""
        buffer = self._buffer
        buffer += data
        out = bytearray()
        start = 0  # the start of the event being read
        scan = self._scan
        if self._after_cr:
            self._after_cr = False
            if buffer[scan : scan + 1] == b"\n":  # the LF of a CRLF split across two reads
                scan += 1
                if self._line_count == 0:  # it followed the empty line that ended the last event
                    if self._lf_passes:  # (which passed on)
                        out += buffer[:scan]
                    start = scan
        while True:
            found = _LINE_END.search(buffer, scan)
            if found is None:
                break
            end = found.start()
            line = bytes(buffer[scan:end])
            after = end + 1
            if buffer[end] == 0x0D:  # CR: CRLF, or a CR alone
                if after < len(buffer):
                    if buffer[after] == 0x0A:
                        after += 1
                else:
                    self._after_cr = True  # decided by the next byte
            scan = after
            if line:
                self._field(line)
                continue
            event = bytes(buffer[start:scan])
            start = scan
            passed = self._dispatch(event)
            self._lf_passes = bool(passed)
            if passed:
                out += passed
            if self.body_over:
                break
        if self.body_over:
            buffer.clear()
            self._scan = 0
        else:
            del buffer[:start]
            self._scan = scan - start
        return bytes(out)

    def body_ended(self) -> None:
        """The current body ended, cleanly or not: its partial event is dropped, and the next body
        (a resume) starts afresh. The held event, if any, stays until ``take_held``."""
        self._buffer.clear()
        self._scan = 0
        self._after_cr = False
        self._reset_event()

    def take_held(self) -> bytes:
        """The held id-less error (giving up: the SDK gets the app's own last word) and forget it."""
        held, self.held = self.held or b"", None
        return held

    def resume(self) -> None:
        """A new body starts (a resume): the held event of the last one is dropped."""
        self.held = None
        self.body_ended()

    # ------------------------------------------------------------------------------------------

    def _reset_event(self) -> None:
        self._line_count = 0
        self._id: str | None = None
        self._name = b""
        self._data: list[bytes] = []

    def _field(self, line: bytes) -> None:
        self._line_count += 1
        if line.startswith(b":"):
            return  # a comment
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"id":
            if b"\0" not in value:
                self._id = value.decode("utf-8", "replace")
        elif name == b"event":
            self._name = value
        elif name == b"data":
            self._data.append(value)

    def _dispatch(self, event: bytes) -> bytes:
        """One whole event (its lines and the empty line ending it): the bytes to pass on."""
        event_id, name, data = self._id, self._name, self._data
        self._reset_event()
        if event_id is None:
            if data and _is_final(name, data):
                self.held = event  # the reading ended, not the stream: come back after the same id
                return b""
            if not data and not name:
                # A comment (a keep-alive) or an empty line: nothing for the SDK. openai-python
                # (3.57) even dispatches one, once it has seen an id, as an event of empty data, and
                # fails on its JSON (a resume that waited for the stream sends keep-alives).
                return b""
            return event  # an event we do not know
        if _not_after(event_id, self.last_id):
            return b""  # already passed on (a resume replayed it)
        self.last_id = event_id
        self.passed_events += 1
        if _is_final(name, data):
            self.final = True
        return event


def _not_after(event_id: str, last: str | None) -> bool:
    if last is None or not (event_id.isdigit() and last.isdigit()):
        return False
    return int(event_id) <= int(last)


def _is_final(name: bytes, data: list[bytes]) -> bool:
    if name in _FINAL_NAMES:
        return True
    if name not in (b"", b"message"):
        return False
    text = b"\n".join(data)
    if text == b"[DONE]":
        return True
    if b'"error"' not in text:
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and "error" in value
