"""A TCP proxy in front of the app that drops connections mid-answer, as a network does: the tests of
the clients' reconnection (tests/test_playground.py, tests/test_client_cs.py,
tests/test_resuming_clients.py) point a client at it.

Bytes pass both ways unchanged, but for one header: an ``Origin`` naming the proxy is rewritten to
the app's own (the local host serves browser requests from its own origin only, and to the page, the
proxy is the app). A *cut* is armed by the request line it waits for (e.g.
``b"POST /api/chat "``): the connection that next sends it is reset (RST, as a dropped network or a
recycled instance looks to a client) once ``after`` bytes of the answer have been passed on and
``HOLD_BEFORE_RESET`` has passed, wherever the bytes end: inside the headers, an event, a UTF-8
character or a chunk's framing. Cuts are used in the order they were added, one per matching
request. ``drop()`` resets every open connection at once; ``refuse(seconds)`` resets every new
connection for a while (the app unreachable). ``responses`` records the status line of every
answer. Threads only: usable from sync tests and Playwright's sync API."""

from __future__ import annotations

import contextlib
import re
import select
import socket
import struct
import threading
import time

HOLD_BEFORE_RESET = 0.5  # seconds between a cut's last byte and its reset
REQUEST_LINE = re.compile(rb"((?:GET|POST|PUT|DELETE|HEAD|OPTIONS|PATCH) [^\r\n ]+ HTTP/1\.[01])\r\n")
STATUS_LINE = re.compile(rb"(?:^|\r\n)(HTTP/1\.[01] \d{3}[^\r\n]*)\r\n")


class CutProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.target = (host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._origin = re.compile(rb"(\r\norigin: *)http://(127\.0\.0\.1|localhost):%d\r\n" % self.port, re.I)
        self._target_origin = b"http://127.0.0.1:%d" % target_port
        self._lock = threading.Lock()
        self._cuts: list[tuple[bytes, int]] = []
        self._refuse_until = 0.0
        self.cut_at: list[float] = []  # time.time() of each cut made
        self.refused = 0  # connections reset while refusing
        self.requests: list[bytes] = []  # the first line of every request seen, in order
        self.responses: list[tuple[float, bytes]] = []  # (time.time(), status line) of every answer seen
        self._open: set[socket.socket] = set()  # client sockets being served
        self._drops = 0  # drop() calls so far: a connection older than the last one is reset
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, request_line: bytes, after: int) -> None:
        """Arm a cut: the next request starting with ``request_line`` gets ``after`` bytes of its answer."""
        with self._lock:
            self._cuts.append((request_line, after))

    def pending_cuts(self) -> int:
        with self._lock:
            return len(self._cuts)

    def refuse(self, seconds: float) -> None:
        with self._lock:
            self._refuse_until = time.monotonic() + seconds

    def drop(self) -> int:
        """Reset every open connection (within 50 ms); returns how many there were."""
        with self._lock:
            self._drops += 1
            return len(self._open)

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.drop()

    # ------------------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = time.monotonic() < self._refuse_until
            if refusing:
                self.refused += 1
                _reset(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.target, timeout=10)
        except OSError:
            _reset(client)
            return
        server.settimeout(None)
        with self._lock:
            self._open.add(client)
            drops = self._drops
        budget: int | None = None  # bytes of the answer still to pass before the cut
        cut = False
        try:
            while True:
                readable, _, _ = select.select([client, server], [], [], 0.05)
                if self._drops != drops:
                    self.cut_at.append(time.time())
                    cut = True
                    break
                if not readable:
                    continue
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        break
                    for line in REQUEST_LINE.findall(data):  # (a connection may carry several requests)
                        self.requests.append(line)
                        with self._lock:
                            for i, (prefix, after) in enumerate(self._cuts):
                                if budget is None and line.startswith(prefix):
                                    budget = after
                                    del self._cuts[i]
                                    break
                    server.sendall(self._origin.sub(lambda m: m.group(1) + self._target_origin + b"\r\n", data))
                if server in readable:
                    data = server.recv(65536)
                    if not data:
                        break
                    self.responses.extend((time.time(), line) for line in STATUS_LINE.findall(data))
                    if budget is not None and len(data) >= budget:
                        client.sendall(data[:budget])
                        # The reset a moment later, not at once: a browser discards what it received
                        # but its page had not read yet when the connection errors (a ReadableStream
                        # drops its queue), so on a loaded machine an instant reset could take back
                        # the events just passed on. A network that stalls, then drops.
                        time.sleep(HOLD_BEFORE_RESET)
                        self.cut_at.append(time.time())
                        cut = True
                        break
                    client.sendall(data)
                    if budget is not None:
                        budget -= len(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(client)
        # A cut resets the client's side, as a dropped network or a recycled instance looks to a
        # client; the app's side just closes (the app sees a hang-up). Otherwise both close as usual.
        if cut:
            _reset(client)
        for sock in (client, server) if not cut else (server,):
            with contextlib.suppress(OSError):
                sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with RST rather than FIN: the peer's next read fails with 'connection reset'."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
