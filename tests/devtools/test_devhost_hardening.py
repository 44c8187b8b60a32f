r"""The local host (tools/devhost/) under hostile or unusual HTTP: Expect: 100-continue, oversized and
slow requests, upgrades, cross-site callers. Every test talks to real processes over sockets.

Findings of an outside attack on the local host and on the C# client, and what each now does:

Findings of an outside attack on the local host (`tools/devhost/`) and on the C# client, and what
each now does. The front server's limits are settings of the host (environment variable or flag of
`python -m tools.devhost`): `DEVHOST_MAX_HEADER_BYTES` / `--max-header-bytes` (65536),
`DEVHOST_HEADER_TIMEOUT_SECONDS` / `--header-timeout` (10), `DEVHOST_BODY_TIMEOUT_SECONDS` /
`--body-timeout` (15), `DEVHOST_KEEPALIVE_TIMEOUT_SECONDS` / `--keepalive-timeout` (15, was 30);
allowed browser origins: `--cors` / `CORS_ALLOWED_ORIGINS` / local.settings.json `Host.CORS`. A bad
value stops the host with exit 2 naming the setting ([tools/devhost/README.md](tools/devhost/README.md#settings)).
The tests use 1.5 s deadlines. Tests are in
`tests/devtools/test_devhost_hardening.py` unless named otherwise.

uvicorn's httptools protocol, which the front server uses, has no head size limit
(`h11_max_incomplete_event_size` is read by uvicorn's h11 protocol only), no head or body deadline,
and starts its keep-alive timer only after a first response. `tools/devhost/front.py` subclasses it
rather than switching to h11, which costs more CPU per request and per chunk.

| item | behaviour | test |
|---|---|---|
| `Expect: 100-continue` | the front server sends the one interim `100 Continue`; `Expect` is not forwarded; an interim 1xx from the worker is skipped, never relayed as the answer; a worker connection is reused only when its final response was read to the end with nothing after it, and bytes arriving on an idle one close it. Before: the caller got the worker's `100` as its final answer, the connection went back to the pool mid-answer, and in a chain A→E caller D received C's text | `test_expect_100_continue_never_hands_a_caller_someone_elses_answer`, `test_expect_100_continue_caller_hang_up_still_closes_its_upstream`, `test_forwarder_skips_interim_responses_and_never_reuses_an_unclean_connection` |
| oversized head | a request line + headers (blank line included) over 64 KiB (65,536 bytes): `431` JSON `request_header_fields_too_large`, connection closed, whether the head comes in one write, in pieces or pipelined behind another request (each read is fed to the parser in slices that end where a head or a body ends, so a head is counted from its own first byte and the parser is never fed more than 64 KiB of it); the rest of the upload is read and dropped for up to 2 s so that the caller gets the answer rather than a reset. Before: a 16 MiB header was a `200` and raised peak RSS by 147 MB; now a 64 MiB one is refused at once, +0.4 MB. Before the slicing, a head completed by the read that crossed the limit was served (a 65 KiB head in one write, or in pieces, was a `200`) | `test_oversized_headers_get_431_and_memory_stays_low`; `tests/devtools/test_devhost_header_limit.py`: 64 KiB + 1, 65 KiB and 128 KiB get `431`, 63 KiB, 64 KiB − 1 and 64 KiB are served, each in one write and in pieces, and pipelined behind a request without a body, with a length or chunked |
| partial or slow headers | `408` when the head is not complete within the header deadline of its first byte (or of the connection's opening); a connection that sends nothing is closed without an answer. 300 partial-header connections: all closed with `408` 1.52 s after opening (before: none closed) | `test_partial_header_connections_are_closed_by_the_header_deadline`, `test_slow_headers_get_408_at_the_header_deadline`, `test_a_connection_that_sends_nothing_is_closed` |
| slow body | `408` at the body deadline (1.50 s measured) when no answer has started: the application sees the caller as gone, so the forwarded request is dropped; otherwise the connection is closed | `test_slow_body_gets_408_at_the_body_deadline` |
| idle keep-alive | closed after the keep-alive deadline (1.50 s measured), also when the answer came before the body had all arrived | `test_idle_keep_alive_connections_are_closed` |
| h2c upgrade (`curl --http2` on http://) | answered over HTTP/1.1 with `connection: close`; the body of such a request (length or chunked) is read with its own framing, since llhttp hands every byte after an upgrade request's head to the new protocol. Before: the body never reached the function and the call hung until the caller gave up | `test_h2c_upgrade_is_ignored_and_the_request_answered_over_http11` |
| WebSocket upgrade | declined (`ws="none"`): the route's plain HTTP answer (`405` on `/api/chat`), connection closed. Before: `500` | `test_websocket_upgrade_is_refused_with_a_plain_http_answer` |
| `/_devhost/stats` | `GET` only, `405 Allow: GET` otherwise | `test_stats_answers_get_only` |
| bad limit setting | exit 2 naming the variable or flag | `test_a_bad_limit_setting_stops_the_host_naming_it` |
| cross-site browser requests | a foreign `Origin` (also `null`, another local port, a DNS-rebinding name), or `Sec-Fetch-Site: cross-site`/`same-site` without one: `403` JSON `cross_origin_forbidden` before the function runs (the upstream receives nothing). Before: a form-encoded POST from any page was a `200` completion | `test_cross_site_requests_are_refused_before_the_function_runs` |
| same origin, no origin | `http://127.0.0.1:PORT` / `http://localhost:PORT` and callers without `Origin` (curl, SDKs) served as before, without CORS headers | `test_same_origin_and_origin_less_callers_are_served` |
| allowed origins | `Access-Control-Allow-Origin` (+ `Vary: Origin`) on every answer, the host's own 404/405 included; preflights `204` with the asked method and headers, `Access-Control-Max-Age: 600`; `*` allows any origin; `Host.CORS` read like `func start`; a malformed origin stops the host naming the setting | `test_allowed_origins_get_cors_headers_and_preflight_answers`, `test_cors_flag_star_allows_any_origin`, `test_cors_from_local_settings_host_section_like_func`, `test_a_malformed_cors_origin_stops_the_host_naming_the_setting` |
| route precedence | literal segments beat parameters, parameters beat catch-alls, shorter beats longer, independent of declaration order (as ASP.NET routing in the Functions host), so a coming `v1/{*rest}` never hides `v1/models`; a route matching the path but not the method lets the next one take it | `tests/devtools/test_devhost_routes.py` |
| C# client: key over plain HTTP | the function key goes over `http://` only to `localhost`, `127.0.0.0/8` or `::1`; otherwise the client stops before any name lookup or connection, with a message on stderr and exit 2, unless `--allow-insecure-key`. Before: sent to any URL. The caller key (`--caller-key`, `CALLER_KEY`) follows the same rule | `test_client_cs.py::test_key_over_plain_http_to_another_host_is_refused_before_any_connection`, `test_client_cs.py::test_key_goes_to_loopback_over_plain_http`, `test_client_cs.py::test_caller_key_over_plain_http_to_another_host_is_refused_with_nothing_sent` |
| C# client SIGINT tests in the background | the tests reset SIGINT to its default in each client child (a background `make test &` has it ignored, and exec keeps it so). With `trap '' INT`: 3 of 5 failed before, 5 pass now | `test_client_cs.py::test_sigint_*`, `test_client_cs.py::test_app_sigint_*` |
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid

import h11
import pytest

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


def exchange(
    port: int,
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes = b"",
    *,
    expect_continue: bool = False,
    timeout: float = 10.0,
    sock: socket.socket | None = None,
    stop_after_first_data: bool = False,
) -> tuple[Answer, socket.socket]:
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
        answer, s = exchange(port, "POST", "/api/chat", JSON, chat_body(text), expect_continue=(name == "A"), timeout=8)
        s.close()
        got[name] = answer
    seen = {name: (answer.status, answer.error, answer.sse_text()) for name, answer in got.items()}
    for name, answer in got.items():
        expected = echo_text(f"[scenario:echo] caller {name} {run}")
        # The host's log says why it answered itself (a 502 names the worker connection's failure).
        assert answer.error is None and answer.status == 200, (seen, app.log()[-4000:])
        assert answer.sse_text() == expected, seen
        assert b"event: done" in answer.body
    assert got["A"].interim == [100], "exactly one interim 100 Continue (the front server's own)"
    assert all(got[n].interim == [] for n in "BCDE")


def test_expect_100_continue_caller_hang_up_still_closes_its_upstream(app, upstream):
    port = _port(app)
    answer, s = exchange(
        port,
        "POST",
        "/api/chat",
        JSON,
        chat_body(f"[scenario:stall] {uuid.uuid4().hex}"),
        expect_continue=True,
        timeout=8,
        stop_after_first_data=True,
    )
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
        server, port = await _scripted_worker(
            [
                [
                    b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n",
                    b"HTTP/1.1 100 Continue\r\n\r\n",
                    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
                    b"first",
                ],
                # a complete answer with a second one glued to it in the same write
                [
                    b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecond"
                    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale"
                ],
                [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nthird"],
            ]
        )
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


# ------------------------------------------------------------------------- limits on the front server

LIMITS = {
    "DEVHOST_HEADER_TIMEOUT_SECONDS": "1.5",
    "DEVHOST_BODY_TIMEOUT_SECONDS": "1.5",
    "DEVHOST_KEEPALIVE_TIMEOUT_SECONDS": "1.5",
}


@pytest.fixture(scope="module")
def limited(upstream):
    """The app with short front-server deadlines (1.5 s), so that the tests run in seconds."""
    from conftest import app_env
    from servers import App

    server = App(app_env(upstream, **LIMITS))
    yield server
    server.stop()


def _status_line(data: bytes) -> str:
    return data.split(b"\r\n", 1)[0].decode("latin-1")


def _read_until_closed(s: socket.socket, timeout: float) -> tuple[bytes, float | None]:
    """Everything the server sends until it closes the connection (or timeout); and when it closed."""
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            piece = s.recv(65536)
        except TimeoutError:
            break
        except OSError:  # reset
            return data, time.monotonic()
        if not piece:
            return data, time.monotonic()
        data += piece
    return data, None


def _peak_rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_oversized_headers_get_431_and_memory_stays_low(limited):
    """Measured before the fix: a 16 MB header was accepted (200) and the host's peak RSS grew by
    147 MB. Now the head is refused once it passes 64 KiB and the rest is discarded unread."""
    pid = limited.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark to the current RSS
    before = _peak_rss_kib(pid)
    s = socket.create_connection(("127.0.0.1", _port(limited)), timeout=10)
    sent = [0]

    def send():
        try:
            s.sendall(b"GET /api/v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
            piece = b"a" * 65536
            for _ in range(256):  # 16 MiB
                s.sendall(piece)
                sent[0] += len(piece)
            s.sendall(b"\r\n\r\n")
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    started = time.monotonic()
    sender.start()
    data, closed = _read_until_closed(s, 10)
    sender.join(10)
    s.close()
    assert _status_line(data) == "HTTP/1.1 431 Request Header Fields Too Large", data[:300]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "request_header_fields_too_large"
    assert closed is not None and closed - started < 5
    growth = _peak_rss_kib(pid) - before
    assert growth < 16 * 1024, f"peak RSS grew by {growth} KiB for a 16 MiB header"
    # A header just under the limit still works.
    answer, s = exchange(_port(limited), "GET", "/api/v1/models", [("x-pad", "b" * 60_000)])
    s.close()
    assert answer.status == 200, (answer.status, answer.error)


def test_partial_header_connections_are_closed_by_the_header_deadline(limited):
    """300 connections that never finish their headers (a slowloris) are all closed once the 1.5 s
    header deadline passes; a normal caller is served meanwhile. Before: they stayed open."""
    port = _port(limited)
    conns = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /api/v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            conns.append(s)
        opened = time.monotonic()
        answer, s = exchange(port, "GET", "/api/v1/models", [])
        s.close()
        assert answer.status == 200
        deadline = opened + 10
        closed, statuses = 0, set()
        for s in conns:
            data, when = _read_until_closed(s, max(0.01, deadline - time.monotonic()))
            if when is not None:
                closed += 1
                statuses.add(_status_line(data) if data else "")
        elapsed = time.monotonic() - opened
    finally:
        for s in conns:
            s.close()
    assert closed == len(conns), f"{closed}/{len(conns)} closed after {elapsed:.1f} s"
    assert statuses <= {"HTTP/1.1 408 Request Timeout"}, statuses
    assert elapsed < 10


def test_slow_headers_get_408_at_the_header_deadline(limited):
    """Headers trickled one byte every 50 ms keep the connection busy but never finish: 408 after
    the header deadline, whatever the pace."""
    s = socket.create_connection(("127.0.0.1", _port(limited)), timeout=5)
    head = b"GET /api/v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Drip: " + b"d" * 400 + b"\r\n\r\n"
    started = time.monotonic()
    answered = b""
    try:
        for byte in head:
            s.sendall(bytes([byte]))
            time.sleep(0.05)
            s.settimeout(0.001)
            with contextlib.suppress(TimeoutError, BlockingIOError):
                answered += s.recv(4096)
            if answered or time.monotonic() - started > 8:
                break
    except OSError:
        pass
    data, closed = _read_until_closed(s, 5)
    s.close()
    answered += data
    elapsed = time.monotonic() - started
    assert _status_line(answered) == "HTTP/1.1 408 Request Timeout", answered[:200]
    assert 1.3 < elapsed < 6, elapsed


def test_slow_body_gets_408_at_the_body_deadline(limited):
    """A body that does not arrive in time: 408 at the body deadline, the connection closed, and the
    forwarded request dropped (the next caller is served normally)."""
    port = _port(limited)
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    body = chat_body(f"[scenario:echo] slow body {uuid.uuid4().hex[:6]}")
    s.sendall(
        b"POST /api/chat HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body[:10])
    )
    started = time.monotonic()
    for piece in body[10:20]:  # a byte every 100 ms: alive, but too slow
        try:
            s.sendall(bytes([piece]))
        except OSError:
            break
        time.sleep(0.1)
    data, closed = _read_until_closed(s, 8)
    s.close()
    assert _status_line(data) == "HTTP/1.1 408 Request Timeout", data[:200]
    assert closed is not None and 1.3 < closed - started < 6, closed and closed - started
    text = f"[scenario:echo] after slow body {uuid.uuid4().hex[:6]}"
    answer, s = exchange(port, "POST", "/api/chat", JSON, chat_body(text))
    s.close()
    assert answer.status == 200 and answer.sse_text() == echo_text(text)


def test_idle_keep_alive_connections_are_closed(limited):
    answer, s = exchange(_port(limited), "GET", "/api/v1/models", [])
    assert answer.status == 200
    idle_from = time.monotonic()
    data, closed = _read_until_closed(s, 8)
    s.close()
    assert data == b""
    assert closed is not None and 1.3 < closed - idle_from < 5, closed and closed - idle_from


def test_a_connection_that_sends_nothing_is_closed(limited):
    s = socket.create_connection(("127.0.0.1", _port(limited)), timeout=5)
    opened = time.monotonic()
    data, closed = _read_until_closed(s, 8)
    s.close()
    assert data == b"", "nothing to answer: closed without a response"
    assert closed is not None and closed - opened < 5


H2C = [("connection", "Upgrade, HTTP2-Settings"), ("upgrade", "h2c"), ("http2-settings", "AAMAAABkAAQCAAAAAAIAAAAA")]


def test_h2c_upgrade_is_ignored_and_the_request_answered_over_http11(limited):
    """What `curl --http2 -d ... http://` sends. Before: the body was never delivered (the parser
    takes the bytes after an upgrade request's head for the new protocol) and the call hung."""
    text = f"[scenario:echo] h2c {uuid.uuid4().hex[:6]}"
    answer, s = exchange(_port(limited), "POST", "/api/chat", H2C + JSON, chat_body(text), timeout=8)
    s.close()
    assert answer.error is None and answer.status == 200, (answer.status, answer.error)
    assert answer.sse_text() == echo_text(text)
    assert answer.headers.get("connection") == "close"
    answer, s = exchange(_port(limited), "GET", "/api/v1/models", H2C, timeout=8)
    s.close()
    assert answer.status == 200 and answer.error is None


def test_websocket_upgrade_is_refused_with_a_plain_http_answer(limited):
    """Before: 500 (the front server switched to WebSocket and the host does not speak it)."""
    ws = [
        ("connection", "Upgrade"),
        ("upgrade", "websocket"),
        ("sec-websocket-version", "13"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ]
    for target, expected in (("/api/chat", 405), ("/api/v1/models", 200)):
        answer, s = exchange(_port(limited), "GET", target, ws, timeout=8)
        s.close()
        assert answer.error is None and answer.status == expected, (target, answer.status, answer.error)
        assert answer.headers.get("connection") == "close"


def test_stats_answers_get_only(limited):
    port = _port(limited)
    answer, s = exchange(port, "GET", "/_devhost/stats", [])
    s.close()
    assert answer.status == 200 and "tasks" in json.loads(answer.body)
    for method in ("POST", "DELETE", "PUT"):
        answer, s = exchange(port, method, "/_devhost/stats", [])
        s.close()
        assert answer.status == 405 and answer.headers.get("allow") == "GET", (method, answer.status)


def test_a_bad_limit_setting_stops_the_host_naming_it():
    from servers import run_devhost

    for env, name in (
        ({"DEVHOST_BODY_TIMEOUT_SECONDS": "soon"}, "DEVHOST_BODY_TIMEOUT_SECONDS"),
        ({"DEVHOST_MAX_HEADER_BYTES": "-1"}, "DEVHOST_MAX_HEADER_BYTES"),
    ):
        result = run_devhost(env)
        assert result.returncode == 2, result.stderr
        assert name in result.stderr
    result = run_devhost(args=("--header-timeout", "0"))
    assert result.returncode == 2 and "--header-timeout" in result.stderr, result.stderr


# ------------------------------------------------------------------------- cross-site callers


def _served_devhost(*args: str, env: dict | None = None, app_dir=None):
    from servers import ROOT, Served

    return Served(["-m", "tools.devhost", "--port", "0", *args, str(app_dir or ROOT)], env=env)


FORM = [("content-type", "application/x-www-form-urlencoded")]


def test_cross_site_requests_are_refused_before_the_function_runs(app, upstream):
    """What a web page can make a browser send to a developer's local host without a preflight: a
    form-encoded POST (the app reads it as JSON, so `curl -d` works) with a foreign Origin. Before:
    200 and a completion paid with the developer's key."""
    port = _port(app)
    before = upstream.count()
    body = chat_body("[scenario:echo] from a web page")
    for headers, method, target, payload in (
        (FORM + [("origin", "https://evil.example")], "POST", "/api/chat", body),
        (JSON + [("origin", "https://evil.example"), ("sec-fetch-site", "cross-site")], "POST", "/api/chat", body),
        (FORM + [("origin", "null")], "POST", "/api/chat", body),  # sandboxed frames, file:// pages
        (FORM + [("origin", f"http://rebound.example:{port}")], "POST", "/api/v1/chat/completions", body),
        ([("origin", "http://localhost:3000")], "GET", "/api/v1/models", b""),  # another local port
        ([("sec-fetch-site", "cross-site")], "GET", "/api/v1/models", b""),  # no Origin, but the browser says so
        ([("sec-fetch-site", "same-site")], "GET", "/_devhost/stats", b""),
    ):
        answer, s = exchange(port, method, target, headers, payload)
        s.close()
        assert answer.status == 403, (headers, answer.status, answer.body[:200])
        error = json.loads(answer.body)["error"]
        assert error["type"] == "cross_origin_forbidden" and "CORS_ALLOWED_ORIGINS" in error["message"]
        assert "access-control-allow-origin" not in answer.headers
    assert upstream.count() == before, "a refused request reached the upstream"
    # A refused preflight gets no CORS headers either.
    answer, s = exchange(
        port, "OPTIONS", "/api/chat", [("origin", "https://evil.example"), ("access-control-request-method", "POST")]
    )
    s.close()
    assert answer.status == 403 and "access-control-allow-origin" not in answer.headers


def test_same_origin_and_origin_less_callers_are_served(app):
    port = _port(app)
    for headers in (
        [],  # curl -d '{...}'
        [("origin", f"http://127.0.0.1:{port}"), ("sec-fetch-site", "same-origin")],
        [("origin", f"http://localhost:{port}")],
        [("origin", f"HTTP://LOCALHOST:{port}")],
        [("sec-fetch-site", "none")],
    ):  # typed into the address bar
        text = f"[scenario:echo] same origin {uuid.uuid4().hex[:6]}"
        answer, s = exchange(port, "POST", "/api/chat", FORM + headers, chat_body(text))
        s.close()
        assert answer.status == 200 and answer.sse_text() == echo_text(text), (headers, answer.status)
        assert "access-control-allow-origin" not in answer.headers


def test_allowed_origins_get_cors_headers_and_preflight_answers(upstream):
    from conftest import app_env

    server = _served_devhost(
        env=app_env(upstream, CORS_ALLOWED_ORIGINS="https://playground.example/, http://localhost:3000")
    )
    try:
        port = _port(server)
        answer, s = exchange(
            port,
            "OPTIONS",
            "/api/v1/chat/completions",
            [
                ("origin", "https://playground.example"),
                ("access-control-request-method", "POST"),
                ("access-control-request-headers", "content-type, x-functions-key, authorization"),
            ],
        )
        s.close()
        assert answer.status == 204, answer.status
        h = answer.headers
        assert h["access-control-allow-origin"] == "https://playground.example"
        assert "POST" in h["access-control-allow-methods"]
        allowed_headers = {x.strip().lower() for x in h["access-control-allow-headers"].split(",")}
        assert {"content-type", "x-functions-key", "authorization"} <= allowed_headers
        assert "origin" in h["vary"].lower() and int(h["access-control-max-age"]) > 0

        text = f"[scenario:echo] allowed {uuid.uuid4().hex[:6]}"
        answer, s = exchange(port, "POST", "/api/chat", JSON + [("origin", "http://localhost:3000")], chat_body(text))
        s.close()
        assert answer.status == 200 and answer.sse_text() == echo_text(text)
        assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "origin" in answer.headers["vary"].lower()
        # Also on the host's own answers (404 here), so that a page can read them.
        answer, s = exchange(port, "GET", "/api/nope", [("origin", "http://localhost:3000")])
        s.close()
        assert answer.status == 404 and answer.headers["access-control-allow-origin"] == "http://localhost:3000"
        # Not listed: refused.
        answer, s = exchange(port, "POST", "/api/chat", FORM + [("origin", "http://localhost:3001")], chat_body("x"))
        s.close()
        assert answer.status == 403
    finally:
        server.stop()


def test_cors_flag_star_allows_any_origin(upstream):
    from conftest import app_env

    server = _served_devhost("--cors", "*", env=app_env(upstream))
    try:
        text = f"[scenario:echo] star {uuid.uuid4().hex[:6]}"
        answer, s = exchange(
            _port(server), "POST", "/api/chat", FORM + [("origin", "https://anywhere.example")], chat_body(text)
        )
        s.close()
        assert answer.status == 200 and answer.sse_text() == echo_text(text)
        assert answer.headers["access-control-allow-origin"] == "*"
    finally:
        server.stop()


def test_cors_from_local_settings_host_section_like_func(tmp_path):
    """`func start` reads Host.CORS from local.settings.json; so does the local host."""
    import shutil

    from servers import ROOT

    shutil.copy(ROOT / "tests" / "apps" / "probe" / "function_app.py", tmp_path)
    (tmp_path / "local.settings.json").write_text(
        json.dumps({"IsEncrypted": False, "Values": {}, "Host": {"CORS": "https://a.example"}})
    )
    server = _served_devhost(app_dir=tmp_path)
    try:
        port = _port(server)
        answer, s = exchange(port, "GET", "/api/echo/x", [("origin", "https://a.example")])
        s.close()
        assert answer.status == 200 and answer.headers["access-control-allow-origin"] == "https://a.example"
        answer, s = exchange(port, "GET", "/api/echo/x", [("origin", "https://b.example")])
        s.close()
        assert answer.status == 403
    finally:
        server.stop()


def test_a_malformed_cors_origin_stops_the_host_naming_the_setting():
    from servers import run_devhost

    result = run_devhost({"CORS_ALLOWED_ORIGINS": "https://ok.example, not an origin"})
    assert result.returncode == 2, result.stderr
    assert "CORS_ALLOWED_ORIGINS" in result.stderr and "not an origin" in result.stderr
