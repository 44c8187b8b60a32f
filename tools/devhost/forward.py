"""HTTP/1.1 from the host to the worker's HTTP server: the request body is streamed while the
response is read, and the response body is handed over as it arrives.

Written on asyncio's Protocol with httptools (the C parser uvicorn uses) instead of httpx, for two
reasons measured here: httpx sends the whole request body before it reads the response, so a
function's early answer (413 for a body over the limit) could not reach the caller until the body
was all sent; and per-chunk costs of a general client (pool bookkeeping, stream wrappers) dominated
the host's CPU under many concurrent streams. The real host forwards with YARP, which does both."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator

import httptools

HIGH_WATER = 256 * 1024  # stop reading from the worker while this much is waiting for the caller
IDLE_REUSE = 4.0  # seconds; uvicorn closes a keep-alive connection 5 s after its last response ended


class WorkerConnectionError(Exception):
    """The connection to the worker failed or closed before the response was complete."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: list[_Connection]):
        self.pool = pool  # the idle list this connection sits in between requests
        self.transport: asyncio.Transport | None = None
        self.response: WorkerResponse | None = None
        self.lost = False
        self.idle_since = 0.0
        self._can_write: asyncio.Future | None = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        if self.response is not None:
            self.response.feed(data)
        else:
            # Bytes on an idle connection belong to no request: a late part of an earlier answer.
            # Handing them to the next request would give its caller someone else's answer.
            self.lost = True
            if self in self.pool:
                self.pool.remove(self)
            self.transport.close()

    def connection_lost(self, exc):
        self.lost = True
        if self in self.pool:  # the worker closed an idle keep-alive connection
            self.pool.remove(self)
        if self.response is not None:
            self.response.lost(exc)
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_exception(WorkerConnectionError("connection to the worker lost"))

    def pause_writing(self):
        self._can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self):
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)
        self._can_write = None

    async def write(self, data: bytes) -> None:
        if self.lost:
            raise WorkerConnectionError("connection to the worker lost")
        self.transport.write(data)
        if self._can_write is not None:
            await self._can_write


class WorkerResponse:
    """One response from the worker: ``status`` and ``headers`` once ``started`` is done, then
    ``aiter_raw()`` for the body. httptools calls the ``on_*`` methods as bytes are fed."""

    def __init__(self, conn: _Connection):
        self._conn = conn
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self.started = self._loop.create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._keep_alive = False
        self._interim = False  # inside a 1xx interim response
        self._trailing = False  # bytes came after the response was complete

    # -- httptools callbacks
    def on_message_begin(self):
        if self._complete:  # the worker sent more after the response: the connection is not clean
            self._trailing = True

    def on_header(self, name: bytes, value: bytes):
        self.headers.append((name, value))

    def on_headers_complete(self):
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # An interim response (100 Continue, 103 Early Hints) is never the answer: skip it and
            # its (empty) message, and wait for the final one. 101 would switch protocols, which
            # the host never asks for.
            self.headers = []
            if status == 101:
                self._fail(WorkerConnectionError("the worker switched protocols (101)"))
                self._conn.transport.close()
                return
            self._interim = True
            return
        self.status = status
        if not self.started.done():
            self.started.set_result(self)

    def on_body(self, body: bytes):
        if self._trailing:
            return
        self._chunks.append(bytes(body))
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def on_message_complete(self):
        if self._interim:
            self._interim = False
            return
        if self._trailing:
            return
        self._complete = True
        # The worker's keep-alive timer started when it sent this end, not when the caller has read
        # it all and the connection goes back to the pool (a slow caller: seconds later).
        self._conn.idle_since = time.monotonic()
        # Read it now: once feed_data returns, the parser has reset for the next message.
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    # -- fed by the connection
    def feed(self, data: bytes):
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(WorkerConnectionError(f"bad response from the worker: {exc}"))
            self._conn.transport.close()

    def lost(self, exc):
        if not self._complete:
            self._fail(WorkerConnectionError(f"the worker closed the connection ({exc or 'EOF'})"))

    def _fail(self, error: Exception):
        self._error = error
        if not self.started.done():
            self.started.set_exception(error)
        self._wake()

    def _wake(self):
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def complete(self) -> bool:
        return self._complete

    @property
    def keep_alive(self) -> bool:
        """The connection can carry another request: the final response was read to its end, the
        worker did not ask to close, nothing followed it, and all of it was handed over (nothing
        buffered, reading not paused)."""
        return self._complete and self._keep_alive and not self._trailing and not self._chunks and not self._paused

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives; pieces waiting together are joined into one."""
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._conn.transport.resume_reading()
                yield data
                continue
            if self._complete:
                return
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter
            self._waiter = None


class Forwarder:
    """Keep-alive connections to the worker's server, one request at a time on each."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._idle: list[_Connection] = []
        self._spare: asyncio.Future | None = None
        self.opened = 0  # connections made to the worker so far
        self._host_header = f"{host}:{port}".encode()

    async def _connect(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.lost and now - conn.idle_since < IDLE_REUSE:
                if not self._idle:
                    self._open_spare()
                return conn
            conn.transport.close()
        conn = await self._new_connection()
        self._open_spare()
        return conn

    async def _new_connection(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Connection(self._idle), self.host, self.port)
        self.opened += 1
        return conn

    def _open_spare(self) -> None:
        """Connect one idle connection ahead, off the request's path: a request whose caller hangs
        up cannot give its connection back, and connecting costs ~0.3 ms of the next request's
        time to first byte otherwise."""
        if self._spare is not None and not self._spare.done():
            return

        async def connect():
            try:
                conn = await self._new_connection()
            except OSError:
                return
            conn.idle_since = time.monotonic()
            self.release(conn, reusable=True)

        self._spare = asyncio.ensure_future(connect())

    def release(self, conn: _Connection, reusable: bool) -> None:
        conn.response = None
        if reusable and not conn.lost:
            self._idle.append(conn)
        else:
            conn.transport.close()

    async def send(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes] | None,
        chunked: bool,
    ) -> Exchange:
        conn = await self._connect()
        response = conn.response = WorkerResponse(conn)
        head = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", self._host_header, b"\r\n"]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        if chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        head.append(b"\r\n")
        conn.transport.write(b"".join(head))
        exchange = Exchange(self, conn, response)
        if body is not None:
            exchange.pump = asyncio.ensure_future(_pump(conn, body, chunked))
        return exchange

    def close(self) -> None:
        if self._spare is not None:
            self._spare.cancel()
        for conn in list(self._idle):
            conn.transport.close()
        self._idle.clear()


async def _pump(conn: _Connection, body: AsyncIterator[bytes], chunked: bool) -> None:
    async for piece in body:
        if chunked:
            await conn.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        else:
            await conn.write(piece)
    if chunked:
        await conn.write(b"0\r\n\r\n")


class Exchange:
    """A request in flight on one connection: await ``response.started``, read ``response``'s body,
    then ``close()`` (which returns the connection to the pool when it is clean)."""

    def __init__(self, forwarder: Forwarder, conn: _Connection, response: WorkerResponse):
        self.forwarder, self.conn, self.response = forwarder, conn, response
        self.pump: asyncio.Future | None = None
        self._closed = False

    async def start(self) -> WorkerResponse:
        """Wait for the response head; a request-body failure (the caller left) ends it too."""
        if self.pump is None:
            return await self.response.started
        done, _ = await asyncio.wait({self.response.started, self.pump}, return_when=asyncio.FIRST_COMPLETED)
        if self.response.started in done:
            return self.response.started.result()
        self.pump.result()  # raises if the body could not be read or sent
        return await self.response.started

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pump_ok = self.pump is None or (
            self.pump.done() and not self.pump.cancelled() and self.pump.exception() is None
        )
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()
        started = self.response.started
        if not started.done():
            started.cancel()
        elif not started.cancelled():
            started.exception()  # retrieved: a failure here was already handled or is moot
        self.forwarder.release(self.conn, reusable=pump_ok and self.response.keep_alive)
