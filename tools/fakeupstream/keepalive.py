"""The connection level: uvicorn's HTTP protocol, with the keep-alive race played on demand.

A server closes an idle kept-alive connection when its keep-alive timeout runs out (uvicorn's, vLLM's
and LiteLLM's: 5 s); a client that sends a request on that connection at that moment gets the
connection closed without an answer. ``POST /_scripted/stale {"times": N}`` plays this for the next N
API requests that come on a connection which has answered a request before: their bytes are dropped
and the connection closed (FIN), nothing answered, nothing recorded (the request never reached the
server). ``{"times": N, "connections": "any"}`` does it to new connections too (a server that cuts
every connection before answering). Control requests (``/_scripted/``) always pass."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

# The first bytes of a request (a body's later bytes start otherwise).
_REQUEST_START = re.compile(rb"(?:GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) /")


class StaleConnections:
    """What ``/_scripted/stale`` armed, and the connections that answered a request (by peer address)."""

    def __init__(self) -> None:
        self.times = 0
        self.any_connection = False
        self.dropped = 0
        self.answered: set[Any] = set()

    def arm(self, times: int, any_connection: bool) -> None:
        self.times, self.any_connection = times, any_connection

    def as_dict(self) -> dict:
        return {"times": self.times, "connections": "any" if self.any_connection else "kept", "dropped": self.dropped}

    def drops(self, peer: Any, data: bytes) -> bool:
        """Whether the request starting with ``data`` on the connection from ``peer`` is dropped."""
        if self.times <= 0 or not _REQUEST_START.match(data) or b" /_scripted/" in data.split(b"\r\n", 1)[0]:
            return False
        if not (self.any_connection or peer in self.answered):
            return False
        self.times -= 1
        self.dropped += 1
        return True


def protocol(stale: StaleConnections) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``) that drops what ``stale`` says."""

    class Protocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.stale_transport = transport
            self.stale_peer = transport.get_extra_info("peername")
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if stale.drops(self.stale_peer, data):
                stale.answered.discard(self.stale_peer)
                self.stale_transport.close()
                return
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            stale.answered.discard(self.stale_peer)
            super().connection_lost(exc)

    return Protocol
