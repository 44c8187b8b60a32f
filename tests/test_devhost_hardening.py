"""The local host (tools/devhost/) under hostile or unusual HTTP: Expect: 100-continue, oversized and
slow requests, upgrades, cross-site callers. Every test talks to real processes over sockets.
docs/reliability.md ("Local host and C# client hardening") lists these with what they prove."""
from __future__ import annotations

import json
import socket
import time
import uuid

import h11

from tools.fakeupstream.scenarios import echo_text


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


class Answer:
    def __init__(self):
        self.interim: list[int] = []
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.error: str | None = None

    def sse_text(self) -> str:
        """The concatenated deltas of an /api/chat answer."""
        text = ""
        for line in self.body.decode("utf-8", "replace").splitlines():
            if line.startswith("data: "):
                data = json.loads(line[6:])
                if "delta" in data:
                    text += data["delta"]
        return text


def exchange(port: int, method: str, target: str, headers: list[tuple[str, str]], body: bytes = b"",
             *, expect_continue: bool = False, timeout: float = 10.0, sock: socket.socket | None = None,
             stop_after_first_data: bool = False) -> tuple[Answer, socket.socket]:
    """One request over a raw socket, read with h11 (which knows interim 1xx responses). Returns the
    answer and the socket (still open, for the caller to close or reuse)."""
    s = sock or socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.settimeout(timeout)
    conn = h11.Connection(h11.CLIENT)
    all_headers = [("host", f"127.0.0.1:{port}"), *headers]
    if body:
        all_headers.append(("content-length", str(len(body))))
    if expect_continue:
        all_headers.append(("expect", "100-continue"))
    s.sendall(conn.send(h11.Request(method=method, target=target, headers=all_headers)))
    answer = Answer()
    deadline = time.monotonic() + timeout
    body_sent = not body

    def send_body():
        s.sendall(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))

    if body and not expect_continue:
        send_body()
        body_sent = True
    elif not body:
        s.sendall(conn.send(h11.EndOfMessage()))
    try:
        while time.monotonic() < deadline:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if not body_sent and answer.interim:
                    send_body()
                    body_sent = True
                s.settimeout(max(0.05, deadline - time.monotonic()))
                data = s.recv(65536)
                conn.receive_data(data)
                if not data and conn.their_state is not h11.DONE:
                    answer.error = "connection closed before the answer was complete"
                    break
                continue
            if isinstance(event, h11.InformationalResponse):
                answer.interim.append(event.status_code)
            elif isinstance(event, h11.Response):
                answer.status = event.status_code
                answer.headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                answer.body += bytes(event.data)
                if stop_after_first_data and b"data: " in answer.body:
                    return answer, s
            elif isinstance(event, h11.EndOfMessage):
                return answer, s
            elif isinstance(event, h11.ConnectionClosed):
                answer.error = "connection closed"
                return answer, s
        answer.error = answer.error or f"no complete answer within {timeout} s"
    except (h11.RemoteProtocolError, OSError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    return answer, s


def chat_body(text: str) -> bytes:
    return json.dumps({"prompt": text}).encode()


JSON = [("content-type", "application/json")]


# ------------------------------------------------------------------------- Expect: 100-continue

def test_expect_100_continue_never_hands_a_caller_someone_elses_answer(app):
    """Callers A..E one after the other, A with Expect: 100-continue. Each must get exactly its own
    echo; before the fix A got the worker's interim 100 as its final answer, its connection to the
    worker went back to the pool mid-answer, and B then received A's text."""
    port = _port(app)
    run = uuid.uuid4().hex[:8]
    got = {}
    for name in "ABCDE":
        text = f"[scenario:echo] caller {name} {run}"
        answer, s = exchange(port, "POST", "/api/chat", JSON, chat_body(text),
                             expect_continue=(name == "A"), timeout=8)
        s.close()
        got[name] = answer
    seen = {name: (answer.status, answer.error, answer.sse_text()) for name, answer in got.items()}
    for name, answer in got.items():
        expected = echo_text(f"[scenario:echo] caller {name} {run}")
        assert answer.error is None and answer.status == 200, seen
        assert answer.sse_text() == expected, seen
        assert b"event: done" in answer.body
    assert got["A"].interim == [100], "exactly one interim 100 Continue (the front server's own)"
    assert all(got[n].interim == [] for n in "BCDE")


def test_expect_100_continue_caller_hang_up_still_closes_its_upstream(app, upstream):
    port = _port(app)
    answer, s = exchange(port, "POST", "/api/chat", JSON, chat_body(f"[scenario:stall] {uuid.uuid4().hex}"),
                         expect_continue=True, timeout=8, stop_after_first_data=True)
    try:
        assert answer.status == 200 and b"data: " in answer.body, (answer.status, answer.error, answer.body[:200])
    finally:
        s.close()
    hung_up = time.time()
    record = upstream.wait_stream_end("stall", timeout=5)
    assert record["outcome"] == "client_disconnected"
    assert record["ended_at"] - hung_up < 2.0
    # And the next caller on a fresh connection gets its own answer.
    text = f"[scenario:echo] after hang-up {uuid.uuid4().hex[:8]}"
    answer, s = exchange(port, "POST", "/api/chat", JSON, chat_body(text), timeout=8)
    s.close()
    assert answer.status == 200 and answer.sse_text() == echo_text(text), (answer.error, answer.body[:300])


# The forwarder against a scripted worker: interim responses and bytes after the answer.

async def _scripted_worker(script: list[list[bytes]]):
    """A server on 127.0.0.1 answering the n-th request it reads (on any connection) with the pieces
    of script[n], written 50 ms apart."""
    import asyncio
    answers = iter(script)

    async def handle(reader, writer):
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                for i, piece in enumerate(next(answers)):
                    if i:
                        await asyncio.sleep(0.05)
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, StopIteration):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _forward_once(forwarder) -> tuple[int, bytes]:
    exchange = await forwarder.send("GET", b"/x", [], None, chunked=False)
    try:
        response = await exchange.start()
        status = response.status  # what the proxy relays: the status when the head is complete
        body = b"".join([piece async for piece in response.aiter_raw()])
        return status, body
    finally:
        exchange.close()


def test_forwarder_skips_interim_responses_and_never_reuses_an_unclean_connection():
    import asyncio

    from tools.devhost.forward import Forwarder

    async def main():
        server, port = await _scripted_worker([
            [b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n", b"HTTP/1.1 100 Continue\r\n\r\n",
             b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", b"first"],
            # a complete answer with a second one glued to it in the same write
            [b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecond"
             b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale"],
            [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nthird"],
        ])
        forwarder = Forwarder("127.0.0.1", port)
        try:
            first = await _forward_once(forwarder)
            second = await _forward_once(forwarder)
            third = await _forward_once(forwarder)
        finally:
            forwarder.close()
            server.close()
        return first, second, third

    first, second, third = asyncio.run(asyncio.wait_for(main(), 10))
    assert first == (200, b"first")
    assert second == (200, b"second"), "bytes after the answer are not part of it"
    assert third == (200, b"third"), "the connection that carried extra bytes was not reused"
