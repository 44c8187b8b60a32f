"""The host's caller-facing HTTP/1.1 server: uvicorn's httptools protocol plus the limits it lacks.

uvicorn's httptools protocol (the one uvicorn picks when httptools is installed) has no limit on the
size of a request head (``h11_max_incomplete_event_size`` is read by the h11 protocol only), no
deadline for a head or a body, and arms its keep-alive timer only after a response, so a connection
that never completes a request stays open forever. This subclass adds, per connection:

- a head size limit: a request line and headers (blank line included) of more than
  ``max_header_bytes`` get ``431`` and the connection is closed, however the bytes are split into
  reads and whatever request came before them on the connection. The parser is never fed more
  than ``max_header_bytes`` of one head: each read is fed in slices that end where a head or a
  body ends (llhttp wants CRLF line ends, so a head and a chunked body both end at the first
  ``\r\n\r\n``; a content-length body after that many bytes), so every head is counted from its
  own first byte;
- a head deadline (``header_timeout``), counted from the connection's opening or from the first
  byte of a later request: ``408``, or a silent close when nothing was sent at all;
- a body deadline (``body_timeout``) from the end of the head to the end of the body: ``408`` when no
  answer has started (the application then sees the caller as gone), else the connection is closed;
- the keep-alive deadline also after a response that finished before its request's body did.

A refusal is written with ``connection: close``; the connection then keeps reading (and dropping)
for up to ``LINGER`` seconds, so that a caller still sending gets to read the answer instead of a
reset.

Upgrades are declined. llhttp takes every byte after the head of a request with ``Connection:
upgrade`` and ``Upgrade:`` (and of CONNECT) as the new protocol's, so the request would have no body
and the connection no further requests. A declined upgrade's body is therefore parsed here (a body-
only parser fed a synthetic head with the same framing), the request is answered over HTTP/1.1 as
if the upgrade headers were absent, and the connection is closed after the answer. With
``ws="none"`` uvicorn never switches to WebSocket, so ``Upgrade: websocket`` gets the plain HTTP
answer of its route, and ``Upgrade: h2c`` (``curl --http2`` on http://) an HTTP/1.1 one.
"""

from __future__ import annotations

import asyncio
import json

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .config import FrontSettings

LINGER = 2.0  # seconds a refused connection keeps draining the caller's bytes before it closes


def _refusal(status: int, reason: str, kind: str, message: str) -> bytes:
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class _DeclinedUpgradeBody:
    """Reads the body of a request whose upgrade was declined, with the framing of its head."""

    def __init__(self, protocol: FrontProtocol, chunked: bool, length: int):
        self.protocol = protocol
        self.done = False
        self.parser = httptools.HttpRequestParser(self)
        framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % length
        self.parser.feed_data(b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n")

    def feed(self, data: bytes) -> None:
        if not self.done:
            self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self.done:
            self.protocol._declined_upgrade_body(body)

    def on_message_complete(self) -> None:
        if not self.done:
            self.done = True
            self.protocol._declined_upgrade_body_complete()


class _Ignore:
    done = True

    def feed(self, data: bytes) -> None:
        pass


class FrontProtocol(HttpToolsProtocol):
    settings = FrontSettings()  # set on the subclass made by protocol_class()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._phase = "head"  # head: reading a request's head; body: its body; idle: between requests
        self._head_bytes = 0  # bytes of the current head fed to the parser so far
        self._body_left: int | None = None  # of a content-length body; None: chunked or no body
        self._tail = b""  # the last 3 bytes fed, for a blank line split across reads
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._after_upgrade: _DeclinedUpgradeBody | _Ignore | None = None  # takes over from the parser
        self._upgrade_framing: tuple[bool, int] | None = None  # a declined upgrade's body still to come

    # -- deadlines

    def _arm(self, delay: float, callback) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _arm_keepalive(self) -> None:
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _head_timeout(self) -> None:
        self._deadline = None
        if self._refused or self.transport.is_closing():
            return
        if self._answering():
            self.transport.close()  # a partial pipelined head behind an answer still being sent
        elif self._head_bytes == 0:
            self.transport.close()  # nothing was asked: nothing to answer
        else:
            self._refuse(
                408,
                "Request Timeout",
                "request_timeout",
                f"the request headers did not arrive within {self.settings.header_timeout:g} s",
            )

    def _body_timeout(self) -> None:
        self._deadline = None
        if self._refused or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            # The application sees the caller as gone (its receive() says http.disconnect and what
            # it sends is dropped), and the caller gets the 408.
            cycle.disconnected = True
            cycle.message_event.set()
            self._refuse(
                408,
                "Request Timeout",
                "request_timeout",
                f"the request body did not arrive within {self.settings.body_timeout:g} s",
                instead_of_answer=True,
            )
        else:
            self.transport.close()

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, reason: str, kind: str, message: str, *, instead_of_answer=False) -> None:
        """Answer ``status`` and close. ``instead_of_answer``: the refusal replaces the current
        request's answer (which has not started); otherwise it is for a request not yet started, and
        is only written when no earlier answer is still pending."""
        if self._answering() and not instead_of_answer:
            self.transport.close()  # an earlier answer is pending: nothing else can be written
            return
        self._refused = True
        self._disarm()
        self._unset_keepalive_if_required()
        self.transport.write(_refusal(status, reason, kind, message))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()  # keep draining, so that the caller is not reset before it reads
        self._deadline = self.loop.call_later(LINGER, self.transport.close)

    # -- asyncio.Protocol

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.settings.header_timeout, self._head_timeout)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: dropped unread
        self._unset_keepalive_if_required()
        if self._after_upgrade is not None:
            try:
                self._after_upgrade.feed(data)
            except httptools.HttpParserError:
                self.transport.close()
            return
        pos = 0
        while pos < len(data) and not self._refused and not self.transport.is_closing():
            if self._phase == "idle":  # the first byte of the next request
                self._begin_head()
            if self._phase == "head":
                room = self.settings.max_header_bytes - self._head_bytes
                if room <= 0:  # the limit is reached and the head goes on
                    self._refuse(
                        431,
                        "Request Header Fields Too Large",
                        "request_header_fields_too_large",
                        f"the request line and headers exceed {self.settings.max_header_bytes} bytes",
                    )
                    return
                stop = min(self._after_blank_line(data, pos), pos + room)
                self._head_bytes += stop - pos
            elif self._body_left:
                stop = pos + min(self._body_left, len(data) - pos)
                self._body_left -= stop - pos
            else:  # a chunked body ends with a blank line
                stop = self._after_blank_line(data, pos)
            piece = data if pos == 0 and stop == len(data) else memoryview(data)[pos:stop]
            self._tail = (self._tail + bytes(piece[-3:]))[-3:]
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade as exc:
                self._upgrade_declined(data[pos + exc.args[0] :])
                return
            except httptools.HttpParserError:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
            pos = stop

    def _begin_head(self) -> None:
        self._phase = "head"
        self._head_bytes = 0
        self._body_left = None
        self._unset_keepalive_if_required()  # armed if the previous answer was complete
        self._arm(self.settings.header_timeout, self._head_timeout)

    def _after_blank_line(self, data: bytes, pos: int) -> int:
        """The index just past the first ``\r\n\r\n`` that ends in ``data[pos:]`` (it may begin in
        the bytes fed before), or ``len(data)``."""
        joined = self._tail + data[pos : pos + 3]
        found = joined.find(b"\r\n\r\n")
        if found != -1:
            return pos + found + 4 - len(self._tail)
        found = data.find(b"\r\n\r\n", pos)
        return len(data) if found == -1 else found + 4

    # -- parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase != "head":  # data_received feeds a new head from its start: not expected
            self._begin_head()

    def on_headers_complete(self) -> None:
        self._disarm()
        self._phase = "body"
        upgrade = self.parser.should_upgrade()
        super().on_headers_complete()
        # llhttp has checked the framing: a request with Transfer-Encoding is chunked; one with a
        # valid Content-Length has that many bytes of body; one with neither has none.
        self._body_left = None
        if not any(name == b"transfer-encoding" for name, _ in self.headers):
            for name, value in self.headers:
                if name == b"content-length":
                    self._body_left = int(value)
        if upgrade:
            # Answered over HTTP/1.1; the parser stops at an upgrade, so the connection ends here.
            self.cycle.keep_alive = False
            framing = {
                name: value.strip().lower()
                for name, value in self.headers
                if name in (b"content-length", b"transfer-encoding")
            }
            chunked = b"chunked" in framing.get(b"transfer-encoding", b"")
            try:
                length = int(framing.get(b"content-length", b"0"))
            except ValueError:
                length = 0
            if chunked or length > 0:
                self._upgrade_framing = (chunked, length)
        self._arm(self.settings.body_timeout, self._body_timeout)

    def on_message_complete(self) -> None:
        if self._upgrade_framing is not None:
            return  # llhttp ends an upgrade request at its head; its body is read after the upgrade
        self._disarm()
        self._phase = "idle"
        self._head_bytes = 0
        self._body_left = None
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.pipeline:
            self._arm_keepalive()  # answered before the body had all arrived

    # -- declined upgrades

    def _upgrade_declined(self, rest: bytes) -> None:
        if self._upgrade_framing is None:
            self._after_upgrade = _Ignore()
            return
        chunked, length = self._upgrade_framing
        self._after_upgrade = _DeclinedUpgradeBody(self, chunked, length)
        if rest:
            try:
                self._after_upgrade.feed(rest)
            except httptools.HttpParserError:
                self.transport.close()

    def _declined_upgrade_body(self, body: bytes) -> None:
        self.on_body(body)

    def _declined_upgrade_body_complete(self) -> None:
        self._upgrade_framing = None
        self.on_message_complete()


def protocol_class(settings: FrontSettings) -> type[FrontProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, bound to ``settings``."""
    return type("FrontProtocol", (FrontProtocol,), {"settings": settings})
