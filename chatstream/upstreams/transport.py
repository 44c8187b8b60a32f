"""The HTTP layer under the openai SDK's clients, through its public ``http_client`` parameter: an
httpx2 client (the SDK's defaults, ``openai.DefaultAsyncHttpx2Client``) on a transport of our own,
``AiohttpTransport``, which sends with aiohttp (reading the upstream's body was most of the
worker's CPU per delta with httpx2's own transport: docs/benchmarks.md).

- aiohttp's errors become httpx2's, each as what it is (``mapped``): a refused connection is a
  ConnectError, a cut one a ReadError or RemoteProtocolError, only a timer a timeout; the SDK
  turns them into APIConnectionError / APITimeoutError, and the pool tells them apart.
- A request whose kept-alive connection closed before any byte of its answer is sent once more, at
  once, on a new connection (``AiohttpTransport``): the keep-alive race, not the upstream's failure.
- 1,000 connections (the SDK's ``DEFAULT_CONNECTION_LIMITS``; aiohttp's own default is 100), idle
  ones kept 5 s; no cookie jar (the httpx2 client keeps cookies, as over any transport); proxies
  from HTTP(S)_PROXY / NO_PROXY, read once.
- The body's reader is also in the response's extensions (``body_reader``), so that a stream can
  read it without the generators of the layers between (httpx2's bound stream, ``aiter_raw``).
- ``HttpClient.build_request`` parses each request URL (with its query) once per client, and
  ``HttpClient.send`` hands a request straight to the transport when httpx2 would add nothing."""

from __future__ import annotations

import contextlib
import functools
import logging
import ssl
import time
import urllib.request
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx2
import openai
from httpx2._client import BoundAsyncStream  # private: see HttpClient.send

# The extension of a response from AiohttpTransport that holds its body's reader.
BODY = "chatstream.body"
_httpx2_log = logging.getLogger("httpx2")  # httpx2's request log (HttpClient.send writes its line)
# Its INFO line per upstream request would double what Azure's worker forwards to the host (and
# Application Insights bills): the request's own record line (endpoint.py) names the upstream and
# its answer already. Warnings and errors still pass.
_httpx2_log.setLevel(logging.WARNING)
# Distinct request URLs a client keeps parsed: a few per API and deployment; beyond this, parsed
# every time.
URL_CACHE_SIZE = 256


def mapped(exc: aiohttp.ClientError) -> httpx2.TransportError:
    """An aiohttp error as the httpx2 error it is (the SDK maps httpx2's; its retries and our pool's
    outcomes depend on which one)."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # connecting, or waiting for a pooled connection
        return httpx2.ConnectTimeout(message)
    if isinstance(exc, aiohttp.ServerTimeoutError):  # a read timer (sock_read)
        return httpx2.ReadTimeout(message)
    if isinstance(exc, aiohttp.ClientProxyConnectionError | aiohttp.ClientHttpProxyError):
        return httpx2.ProxyError(message)
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ServerFingerprintMismatch):
        return httpx2.ConnectError(message)  # refused, DNS, TLS: nothing was sent
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientResponseError):
        return httpx2.RemoteProtocolError(message)  # closed before or inside the answer's head, or a malformed one
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return httpx2.UnsupportedProtocol(message)
    return httpx2.ReadError(message)  # reset, or the body cut short (ClientOSError, ClientPayloadError)


# What ``Body.read`` raises (aiohttp's errors): ``mapped`` makes each the httpx2 error it is.
RAW_ERRORS = aiohttp.ClientError


class Body(httpx2.AsyncByteStream):
    """An aiohttp response's body as httpx2 reads it: ``async for piece in body`` yields what each
    read brings (aiohttp's ``readany``), errors mapped. ``UpstreamStream`` reads it directly, through
    ``read`` (aiohttp's ``readany`` itself: b"" at the end, ``RAW_ERRORS`` unmapped), a coroutine
    fewer per piece. ``aclose`` gives the connection back when the body was read to its end, else
    closes it (which stops the upstream's generation)."""

    __slots__ = ("_content", "_response", "read")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self._content = response.content
        self.read = self._content.readany

    def __aiter__(self) -> Body:
        return self

    async def __anext__(self) -> bytes:
        try:
            piece = await self.read()
        except RAW_ERRORS as exc:
            raise mapped(exc) from exc
        if not piece:
            raise StopAsyncIteration
        return piece

    async def aclose(self) -> None:
        if self._content.at_eof():
            self._response.release()
        else:
            self._response.close()


def body_reader(response: httpx2.Response) -> Body | None:
    """The body's reader of a response from AiohttpTransport (its raw bytes, before any content
    decoding), to read directly; None for a response from another transport."""
    body = response.extensions.get(BODY)
    return body if isinstance(body, Body) else None


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx2's trust (SSL_CERT_FILE / SSL_CERT_DIR when set), one context for every client."""
    return httpx2.create_ssl_context()


@functools.lru_cache(maxsize=64)
def _timeout(pool: float | None, connect: float | None, read: float | None) -> aiohttp.ClientTimeout:
    """aiohttp's timers for httpx2's (see AiohttpTransport), one object per set (it is frozen)."""
    return aiohttp.ClientTimeout(total=None, connect=pool, sock_connect=connect, sock_read=read)


def _unanswered(exc: aiohttp.ClientError) -> bool:
    """Whether ``exc``, raised sending a request and waiting for its answer's head, means the connection
    ended unanswered: closed before any byte of a status line came, or reset. A reset says neither
    whether a head was begun nor how long the server had the request (aiohttp's ClientOSError keeps
    no more): any reset before the head is whole counts, and the caller bounds the time
    (``RESEND_WITHIN``; tests/unit/test_clients.py, its ``reset`` and ``reset_late`` cases)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return isinstance(exc.message, str)  # else the part of the head that came
    return isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError)


async def _reused(_session: aiohttp.ClientSession, context: SimpleNamespace, _params: object) -> None:
    context.trace_request_ctx[REUSED] = True  # the request's own dict (handle_async_request)


REUSED = "reused"  # set in a request's trace context when its connection came from the pool
# A reused connection that ended unanswered within this long of the request's sending is the race's
# (the server's closing was already on its way: it comes within a round trip, plus a busy loop's
# lag); later, the server had the request and may have worked on it: not sent again.
RESEND_WITHIN = 2.0
_TRACE = aiohttp.TraceConfig()
_TRACE.on_connection_reuseconn.append(_reused)
_TRACE.freeze()


class AiohttpTransport(httpx2.AsyncBaseTransport):
    """httpx2's transport interface over one aiohttp session (made at the first request, on the
    running loop). The request's ``timeout`` extension sets aiohttp's timers: ``connect`` the
    socket's connect (TLS included), ``pool`` the wait for a connection and the connect together,
    ``read`` each read (None for a stream: the stream core bounds reads itself); aiohttp has no
    write timer.

    The keep-alive race: a server closes a connection that has been idle for its keep-alive timeout
    (uvicorn's, so vLLM's and LiteLLM's: 5 s, as long as we keep one), and a request sent on it as it
    closes gets no answer (the closing is still on its way, or unread by a busy loop). So a request
    whose connection came from the pool (aiohttp's tracing tells) and closed before any byte of the
    answer, or was reset before its head was whole (``_unanswered``), is sent once more, at once,
    through a second session whose connections are always new and closed after use (made when first
    needed). Browsers do so for any method (the server never read it; the SDK's own retries resend
    any request that lost its connection). It costs no retry of ours and no failure in the pool's
    health. Anything else (a new connection cut so, or later than ``RESEND_WITHIN``) is the
    upstream's failure. The idle lifetime stays the SDK's 5 s: a shorter one would spare 5 s servers
    the race but not those with shorter timeouts (gunicorn's 2 s), and cost a new connection (a TLS
    handshake) for each request 4-5 s after the last to servers that keep them longer; the resend
    covers every server."""

    def __init__(self) -> None:
        self._proxies = urllib.request.getproxies()  # the environment's, as httpx2 would read them
        self._proxy_of: dict[tuple[str, str, int | None], str | None] = {}
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # for a request sent again: new connections
        self._url_text: dict[int, tuple[httpx2.URL, str]] = {}  # str(url) by URL object (HttpClient keeps them)

    def _open(self, fresh: bool = False) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=openai.DEFAULT_CONNECTION_LIMITS.max_connections or 0,
            keepalive_timeout=None if fresh else openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry,
            force_close=fresh,
            ssl=_ssl_context(),
        )
        session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,  # httpx2 decodes a content coding (aiter_bytes, aread)
            timeout=aiohttp.ClientTimeout(total=None),
            trace_configs=None if fresh else [_TRACE],
        )
        if fresh:
            self._fresh = session
        else:
            self._session = session
        return session

    def _proxy(self, url: httpx2.URL) -> str | None:
        if not self._proxies:
            return None
        origin = (url.scheme, url.host, url.port)
        if origin not in self._proxy_of:
            proxy = self._proxies.get(url.scheme) or self._proxies.get("all")
            if proxy and urllib.request.proxy_bypass(url.host):  # NO_PROXY
                proxy = None
            self._proxy_of[origin] = proxy
        return self._proxy_of[origin]

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        session = self._session or self._open()
        limits = request.extensions.get("timeout") or {}
        timeout = _timeout(limits.get("pool"), limits.get("connect"), limits.get("read"))
        content = await request.aread()
        headers: Iterable[tuple[str, str]] = request.headers.multi_items()
        url = self._url_text.get(id(request.url))  # the text of each URL object kept (they are immutable)
        if url is None or url[0] is not request.url:
            url = (request.url, str(request.url))  # yarl keeps the URLs it parsed
            if len(self._url_text) >= URL_CACHE_SIZE:
                self._url_text.clear()
            self._url_text[id(request.url)] = url
        url = url[1]
        trace: dict[str, bool] = {}
        sent = time.monotonic()
        try:
            try:
                answer = await session.request(
                    request.method,
                    url,
                    headers=headers,  # pairs: a repeated header stays repeated
                    data=content or None,
                    allow_redirects=False,  # the httpx2 client follows them
                    timeout=timeout,
                    proxy=self._proxy(request.url),
                    trace_request_ctx=trace,
                )
            except aiohttp.ClientError as exc:
                if not (trace.get(REUSED) and _unanswered(exc) and time.monotonic() - sent < RESEND_WITHIN):
                    raise
                answer = await (self._fresh or self._open(fresh=True)).request(
                    request.method,
                    url,
                    headers=headers,
                    data=content or None,
                    allow_redirects=False,
                    timeout=timeout,
                    proxy=self._proxy(request.url),
                )
        except aiohttp.ClientError as exc:
            raise mapped(exc) from exc
        body = Body(answer)
        extensions: dict[str, Any] = {"http_version": b"HTTP/1.1", BODY: body}
        if answer.reason:
            extensions["reason_phrase"] = answer.reason.encode("ascii", "replace")
        response = httpx2.Response(
            answer.status, headers=answer.raw_headers, stream=body, request=request, extensions=extensions
        )
        if all(name.isascii() and value.isascii() for name, value in answer.raw_headers):
            response.headers.encoding = "ascii"  # what httpx2 finds first, by decoding each header in Python
        return response

    async def aclose(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()


class KeptHeaders(httpx2.Headers):
    """httpx2's Headers, kept to be copied for many requests, that decode their pairs of strings
    (``multi_items``: every header decoded anew each time, once by the SDK and once by the
    transport per request) once for all their copies, until a copy is changed. Reused's
    ``_build_headers`` and ``HttpClient.build_request`` keep them. httpx2's own methods change
    headers only through ``__setitem__`` and ``__delitem__`` (and a set ``encoding``). A copy also
    knows the encoding httpx2 finds for its headers (each header decoded once more, per copy, at its
    first ``encoding``: the SDK's header lookups, ~4% of its CPU per request), until it is changed."""

    def __init__(
        self, headers: httpx2.Headers, pairs: list[tuple[str, str]] | None = None, encoding: str | None = None
    ) -> None:
        super().__init__(headers)
        self._found = encoding  # what ``encoding`` finds while the pairs are the kept ones
        self._pairs = pairs
        if pairs is None:
            self._pairs = super().multi_items()

    def copied(self) -> KeptHeaders:
        """A copy for one request (as ``httpx2.Headers(self)``), its pairs decoded already."""
        return KeptHeaders(self, self._pairs, self.encoding)

    def multi_items(self) -> list[tuple[str, str]]:
        if self._pairs is None:
            return super().multi_items()
        return list(self._pairs)

    def set_length(self, length: int) -> None:
        """``self["Content-Length"] = str(length)`` where that header is the last and the only one
        (``length_last``): its value replaced in place, its pairs kept, without httpx2's search for
        duplicates."""
        raw, lower, old = self._list[-1]
        assert raw == b"Content-Length" and self._pairs is not None and old.isascii()
        value = str(length)
        self._list[-1] = (raw, lower, value.encode("ascii"))
        self._pairs = [*self._pairs[:-1], ("content-length", value)]

    def __setitem__(self, key: str, value: str) -> None:
        self._pairs = None
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._pairs = None
        super().__delitem__(key)

    @property
    def encoding(self) -> str:
        if self._encoding is None and self._pairs is not None and self._found is not None:
            self._encoding = self._found  # as httpx2 finds it (and keeps it) for the same headers
        return httpx2.Headers.encoding.fget(self)  # type: ignore[attr-defined]

    @encoding.setter
    def encoding(self, value: str) -> None:
        self._pairs = None
        self._encoding = value


def length_last(raw: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's one ``Content-Length`` header is its last (``KeptHeaders.set_length``)."""
    return bool(raw) and raw[-1][0] == b"Content-Length" and [n.lower() for n, _ in raw].count(b"content-length") == 1


class HttpClient(httpx2.AsyncClient):
    """The httpx2 client the SDK is given: the SDK's defaults (``openai.DefaultAsyncHttpx2Client``'s), on
    ``AiohttpTransport`` unless given another transport, and every request through that transport
    (no proxy mounts of httpx2's own: the transport reads the environment's).

    ``build_request`` builds the request httpx2 builds, for less: the parsed URL of each URL string
    and query the SDK hands it is kept (the same few per client; httpx2 parses each twice per
    request), and so are the headers httpx2 makes of each URL and list of SDK headers (the SDK sends
    the same ones for every request of a client: httpx2 would normalise and look up each of them
    three times, about a third of the SDK's own CPU per request); a request gets a copy with its
    own ``Content-Length``, and its body as the stream httpx2 would make of it. The client's own
    headers are fixed when it is made (nothing here changes them). Anything the
    SDK does not send (cookies, params or extensions on the client, a body other than bytes) goes
    the way httpx2 goes."""

    def __init__(self, transport: httpx2.AsyncBaseTransport | None = None) -> None:
        super().__init__(
            transport=transport or AiohttpTransport(),
            timeout=openai.DEFAULT_TIMEOUT,  # the SDK's defaults (it passes its own timeout with each request)
            follow_redirects=True,
            trust_env=False,
        )
        self._parsed: dict[tuple[str, str | None], httpx2.URL] = {}
        self._prepared: dict[tuple, KeptHeaders] = {}  # what httpx2 made of each URL and SDK headers
        self._opened = False  # httpx2's send has run once (the client's state is "opened")

    async def send(
        self,
        request: httpx2.Request,
        *,
        stream: bool = False,
        auth: Any = httpx2.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx2.USE_CLIENT_DEFAULT,
    ) -> httpx2.Response:
        """httpx2's ``send``, without the layers that do nothing for the SDK's requests: with no auth
        (the SDK's headers carry the key), no event hooks, no credentials in the URL and the request's
        timeouts set, httpx2's auth flow and timeout defaults are no-ops, so the request goes to the
        transport and its response gets what httpx2's ``_send_single_request`` gives it (the request,
        the timed body, the cookies kept, the encoding, its log line); a redirect continues in
        httpx2's own redirect handling. About 7% of the CPU a request takes before its first delta
        (tools/bench/burst.py). ``BoundAsyncStream`` is httpx2's private body wrapper (the response's
        ``elapsed``); test_clients.py checks the responses against httpx2's own."""
        if (
            not self._opened
            or auth is not httpx2.USE_CLIENT_DEFAULT
            or self.auth is not None
            or "timeout" not in request.extensions
            or request.url.userinfo
            or self.event_hooks["request"]
            or self.event_hooks["response"]
            or self.is_closed
        ):
            self._opened = True
            return await super().send(request, stream=stream, auth=auth, follow_redirects=follow_redirects)
        start = time.perf_counter()
        try:
            response = await self._transport.handle_async_request(request)
        except httpx2.RequestError as exc:  # as httpx2's request_context: the error names its request
            exc.request = request
            raise
        response.request = request
        response.stream = BoundAsyncStream(response.stream, start=start)  # type: ignore[arg-type]
        self.cookies.extract_cookies(response)
        response.default_encoding = self._default_encoding
        if _httpx2_log.isEnabledFor(logging.INFO):
            _httpx2_log.info(
                'HTTP Request: %s %s "%s %d %s"',
                request.method,
                request.url,
                response.http_version,
                response.status_code,
                response.reason_phrase,
            )
        try:
            follow = self.follow_redirects if follow_redirects is httpx2.USE_CLIENT_DEFAULT else follow_redirects
            if 300 <= response.status_code < 400 and response.has_redirect_location:  # (its status check is slower)
                if not follow:
                    with contextlib.suppress(httpx2.RemoteProtocolError):
                        response.next_request = self._build_redirect_request(request, response)
                    return response
                redirect = self._build_redirect_request(request, response)
                await response.aread()
                response = await self._send_handling_redirects(redirect, follow_redirects=follow, history=[response])
            if not stream:
                await response.aread()
            return response
        except BaseException:
            await response.aclose()
            raise

    def build_request(
        self,
        method: str,
        url: httpx2.URL | str,
        *,
        content: Any = None,
        params: Any = None,
        headers: Any = None,
        timeout: Any = httpx2.USE_CLIENT_DEFAULT,
        **others: Any,
    ) -> httpx2.Request:
        parsed = None
        if isinstance(url, str) and (params is None or isinstance(params, str)) and not self.params:
            parsed = self._url(url, params)
        if parsed is not None:
            url, params = parsed, None  # the URL object is taken as it is
        if (
            parsed is None
            or not isinstance(headers, list)
            or not isinstance(content, bytes | None)
            or any(value is not None for value in others.values())  # data, files, json, cookies, extensions
            or self.cookies
        ):
            return super().build_request(
                method, url, content=content, params=params, headers=headers, timeout=timeout, **others
            )
        limits = self.timeout if timeout is httpx2.USE_CLIENT_DEFAULT else httpx2.Timeout(timeout)
        extensions = {"timeout": limits.as_dict()}
        key = (method, url, tuple(headers), None if content is None else bool(content))
        kept = self._prepared.get(key)
        if kept is None:
            named = {name.lower() for name, _ in headers}
            own = [(name, value) for name, value in self.headers.raw if name.lower().decode("latin-1") not in named]
            request = httpx2.Request(method, url, content=content, headers=own + headers, extensions=extensions)
            if not content or length_last(request.headers.raw):
                if len(self._prepared) >= URL_CACHE_SIZE:  # an Entra token changes hourly: old ones go
                    self._prepared.clear()
                self._prepared[key] = KeptHeaders(request.headers)
            return request
        headers_sent = kept.copied()  # no header is parsed again
        if content:
            headers_sent.set_length(len(content))
        request = httpx2.Request(method, url, stream=httpx2.ByteStream(content or b""), extensions=extensions)
        request.headers = headers_sent  # (given to Request, they would be copied into plain Headers)
        request.read()  # as httpx2 does for a body in hand
        return request

    def with_body(self, request: httpx2.Request, content: bytes) -> httpx2.Request:
        """A request as ``request`` (one this client built with a body, kept as it was built: see
        ``keepable``) with ``content`` as its body: its method, URL, headers (with its own
        ``Content-Length``) and extensions, as ``build_request`` builds it, without building any of
        them again (Reused keeps one per kind of request a client sends). A new ``httpx2.Request``
        of the attributes httpx2's own has (test_clients.py checks them)."""
        headers = request.headers.copied() if isinstance(request.headers, KeptHeaders) else KeptHeaders(request.headers)
        headers.set_length(len(content))
        made = httpx2.Request.__new__(httpx2.Request)
        made.method, made.url, made.headers = request.method, request.url, headers
        made.extensions = dict(request.extensions)
        made.stream = httpx2.ByteStream(content)
        made._content = content  # as ``read`` keeps it
        return made

    def keepable(self, request: httpx2.Request) -> httpx2.Request | None:
        """``request`` (just built by this client, not sent yet) as ``with_body`` takes it, kept apart
        from the request itself (which its sender may change); None when another body would change
        more than its ``Content-Length`` (no body, or the header not last)."""
        if not request.content or self.cookies or not length_last(request.headers.raw):
            return None
        kept = httpx2.Request.__new__(httpx2.Request)
        kept.method, kept.url, kept.headers = request.method, request.url, KeptHeaders(request.headers)
        kept.extensions = dict(request.extensions)
        return kept

    def _url(self, url: str, params: str | None) -> httpx2.URL | None:
        key = (url, params)
        parsed = self._parsed.get(key)
        if parsed is None:
            parsed = httpx2.URL(url) if params is None else httpx2.URL(url, params=params)  # as httpx2.Request
            if parsed.is_relative_url:  # merged with the client's base URL by httpx2
                return None
            if len(self._parsed) < URL_CACHE_SIZE:
                self._parsed[key] = parsed
        return parsed
