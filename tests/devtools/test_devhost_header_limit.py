"""The local host's head size limit: a request whose request line and headers exceed 64 KiB
(65,536 bytes, the default of DEVHOST_MAX_HEADER_BYTES) gets 431, and one within it is served,
whether the head arrives in one write, in pieces, or pipelined behind another request. Raw sockets
against the app on the local host; sizes are of the whole head, blank line included."""

from __future__ import annotations

import socket
import time

import pytest

LIMIT = 64 * 1024
PAUSE = 0.2  # between pieces, so that each arrives in a read of its own


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def head(size: int, target: str = "/api/v1/models") -> bytes:
    """A GET whose request line and headers are exactly ``size`` bytes."""
    start = f"GET {target} HTTP/1.1\r\nHost: x\r\nX-Pad: ".encode()
    pad = size - len(start) - 4
    assert pad > 0
    return start + b"p" * pad + b"\r\n\r\n"


def pieces(data: bytes) -> list[bytes]:
    """``data`` in three writes: a small first piece, then up to 10 bytes short of the limit, then
    the rest (so the read that crosses the limit is the one that completes the head)."""
    cut = min(LIMIT - 10, len(data) - 1)
    return [data[:1000], data[1000:cut], data[cut:]]


def answers(port: int, writes: list[bytes], count: int, timeout: float = 10.0) -> list[int]:
    """Send ``writes`` (pausing between them), then read up to ``count`` answers until the server
    closes; their statuses."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        for i, data in enumerate(writes):
            if i:
                time.sleep(PAUSE)
            try:
                s.sendall(data)
            except OSError:  # refused and closed: what was answered is still to be read
                break
        buf, statuses = b"", []
        deadline = time.monotonic() + timeout
        while len(statuses) < count and time.monotonic() < deadline:
            if b"\r\n\r\n" in buf:
                top, rest = buf.split(b"\r\n\r\n", 1)
                lines = top.decode("latin-1").split("\r\n")
                fields = dict(line.lower().split(": ", 1) for line in lines[1:])
                if fields.get("transfer-encoding") == "chunked":  # a streamed answer
                    end = rest.find(b"\r\n0\r\n\r\n")
                    length = -1 if end == -1 else end + 7
                else:
                    length = int(fields.get("content-length", "0"))
                if 0 <= length <= len(rest):
                    statuses.append(int(lines[0].split()[1]))
                    buf = rest[length:]
                    continue
            try:
                data = s.recv(65536)
            except OSError:
                break
            if not data:
                break
            buf += data
        return statuses
    finally:
        s.close()


@pytest.mark.parametrize("size", [LIMIT + 1, 65 * 1024, 128 * 1024], ids=["64KiB+1", "65KiB", "128KiB"])
@pytest.mark.parametrize("mode", ["one write", "pieces"])
def test_a_head_over_64_kib_gets_431(app, size, mode):
    data = head(size)
    assert answers(_port(app), [data] if mode == "one write" else pieces(data), 1) == [431]


@pytest.mark.parametrize("size", [63 * 1024, LIMIT - 1, LIMIT], ids=["63KiB", "64KiB-1", "64KiB"])
@pytest.mark.parametrize("mode", ["one write", "pieces"])
def test_a_head_of_64_kib_or_less_is_served(app, size, mode):
    data = head(size)
    assert answers(_port(app), [data] if mode == "one write" else pieces(data), 1) == [200]


CHAT = b'{"prompt":"[scenario:echo] pipelined"}'
FIRST = {
    "without a body": b"GET /api/v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    "with a content-length body": b"POST /api/chat HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(CHAT), CHAT),
    "with a chunked body": b"POST /api/chat HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT),
}


@pytest.mark.parametrize("first", list(FIRST))
def test_a_pipelined_head_is_counted_from_its_own_first_byte(app, first):
    """Two requests in one write: the second head is measured exactly, wherever the first ends."""
    port = _port(app)
    assert answers(port, [FIRST[first] + head(LIMIT)], 2, timeout=20) == [200, 200]
    # One byte more and the second request is refused: the connection ends without its answer
    # (an answer to the first may still be on its way, so nothing can follow it but the close).
    assert answers(port, [FIRST[first] + head(LIMIT + 1)], 2, timeout=20)[1:] in ([], [431])
