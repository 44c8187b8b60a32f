"""chatstream/upstreams/clients.py and transport.py: the SDK on our aiohttp transport through its
public ``http_client``. Connection errors come out as the SDK's types they are (a refused connection
or a reset is APIConnectionError, not APITimeoutError) and the pool tells a failure to connect from
a lost connection; streams have no read timer, whole answers do; chunks are raw dicts; a body is read
to its end and its connection reused; 1,000 connections; requests are the SDK's own; an entry
without a key sends no Authorization header. In-process loopback servers only."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import ssl
import struct
import time

import aiohttp
import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatstream.errors import UpstreamMalformed
from chatstream.upstreams import transport
from chatstream.upstreams.clients import UpstreamStream
from chatstream.upstreams.outcomes import OutcomeKind, classify
from chatstream.upstreams.transport import BODY, HttpClient, mapped

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (aiohttp.ConnectionTimeoutError("connect timed out"), httpx2.ConnectTimeout),
        (aiohttp.SocketTimeoutError("read timed out"), httpx2.ReadTimeout),
        (aiohttp.ServerDisconnectedError(), httpx2.RemoteProtocolError),
        (aiohttp.ClientOSError(104, "reset"), httpx2.ReadError),
        (aiohttp.ClientPayloadError("cut short"), httpx2.ReadError),
        (aiohttp.InvalidURL("x"), httpx2.UnsupportedProtocol),
    ],
)
def test_aiohttp_errors_become_the_httpx2_errors_they_are(raised, expected):
    assert type(mapped(raised)) is expected


async def _serve(mode: str):
    async def handler(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        if mode == "mid_body":
            writer.write(HEAD + _chunked(CHUNK))
            await writer.drain()
            await asyncio.sleep(0.05)
        if mode == "disconnect":
            writer.close()
            return
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST

    return await asyncio.start_server(handler, "127.0.0.1", 0)


def _client(port: int, **kw) -> openai.AsyncOpenAI:
    kw.setdefault("timeout", 5)
    return openai.AsyncOpenAI(
        api_key="k", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, http_client=HttpClient(), **kw
    )


async def _failure(port: int) -> BaseException:
    client = _client(port)
    try:
        stream = await UpstreamStream.open(client, "/chat/completions", {"model": "m", "stream": True})
        async for _ in stream:
            pass
    except Exception as exc:
        return exc
    finally:
        await client.close()
    raise AssertionError("no error")


async def test_refused_connection_is_a_connect_failure():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        exc = await _failure(port)
    assert type(exc) is openai.APIConnectionError
    assert isinstance(exc.__cause__, httpx2.ConnectError)
    assert classify(exc).outcome.kind is OutcomeKind.CONNECT_FAILED


async def test_reset_or_disconnect_is_a_lost_connection():
    for mode in ("before_headers", "mid_body", "disconnect"):
        server = await _serve(mode)
        try:
            exc = await _failure(server.sockets[0].getsockname()[1])
        finally:
            server.close()
        assert type(exc) is openai.APIConnectionError, (mode, exc)
        assert classify(exc).outcome.kind is OutcomeKind.CONNECTION_LOST, mode


def _self_signed(directory) -> ssl.SSLContext:
    """A server context with a certificate for 127.0.0.1 that no one trusts."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
    return context


async def test_an_untrusted_certificate_is_a_connect_failure_and_nothing_is_sent(tmp_path):
    """TLS is verified (httpx2's trust): a server whose certificate no one signed is never sent
    the request, and the pool takes it for a failure to connect."""
    heads = []

    async def handler(reader, writer):
        with contextlib.suppress(Exception):
            heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=_self_signed(tmp_path))
    client = openai.AsyncOpenAI(
        api_key="k",
        base_url=f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1",
        max_retries=0,
        timeout=5,
        http_client=HttpClient(),
    )
    try:
        with pytest.raises(openai.APIConnectionError) as caught:
            await UpstreamStream.open(client, "/chat/completions", {"model": "m", "stream": True})
    finally:
        await client.close()
        server.close()
    assert isinstance(caught.value.__cause__, httpx2.ConnectError) and heads == []
    assert classify(caught.value).outcome.kind is OutcomeKind.CONNECT_FAILED


class _Recording(httpx2.AsyncBaseTransport):
    def __init__(self, body: bytes):
        self.body, self.timeouts, self.requests = body, [], []

    async def handle_async_request(self, request):
        self.timeouts.append(request.extensions.get("timeout"))
        self.requests.append(request)
        kind = "application/json" if self.body.startswith(b"{") else "text/event-stream"
        return httpx2.Response(
            200, headers={"content-type": kind}, stream=httpx2.ByteStream(self.body), request=request
        )


async def test_a_stream_has_no_read_timeout_but_keeps_the_others_and_a_completion_keeps_all():
    from chatstream.upstreams.clients import complete

    recording = _Recording(CHUNK + b"data: [DONE]\n\n")
    timeout = openai.Timeout(65.0, connect=3.0, write=30.0, pool=30.0)
    client = openai.AsyncOpenAI(
        api_key="k",
        base_url="http://upstream.test/v1",
        timeout=timeout,
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=recording),
    )
    stream = await UpstreamStream.open(client, "/chat/completions", {"model": "m", "stream": True})
    assert [data async for data in stream] == [{"choices": [{"index": 0, "delta": {"content": "a"}}]}]
    recording.body = b'{"choices": []}'
    assert await complete(client, "/chat/completions", {"model": "m"}) == ({"choices": []}, None)
    streamed, completed = recording.timeouts
    assert streamed == {"connect": 3.0, "read": None, "write": 30.0, "pool": 30.0}
    assert completed == {"connect": 3.0, "read": 65.0, "write": 30.0, "pool": 30.0}


async def test_the_transport_times_the_reads_of_a_whole_answer_and_not_those_of_a_stream():
    """Both answers stall 1 s after their head; the client's read timeout is 0.3 s: the whole
    answer times out (APITimeoutError), the stream waits for its chunk (the core bounds it)."""
    from chatstream.upstreams.clients import complete

    async def handler(reader, writer):
        request = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(int(request.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        if b'"stream":true' in body.replace(b" ", b""):
            writer.write(HEAD)
            await writer.drain()
            await asyncio.sleep(1.0)
            writer.write(_chunked(CHUNK, b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            await asyncio.sleep(1.0)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        await reader.read()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = _client(server.sockets[0].getsockname()[1], timeout=openai.Timeout(0.3, connect=3.0))
    try:
        started = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            await complete(client, "/chat/completions", {"model": "m"})
        assert time.monotonic() - started < 0.9
        stream = await UpstreamStream.open(client, "/chat/completions", {"model": "m", "stream": True})
        assert [d["choices"][0]["delta"]["content"] async for d in stream] == ["a"]
    finally:
        await client.close()
        server.close()


async def test_a_responses_stream_opens_through_the_responses_client_without_a_read_timeout():
    from chatstream.upstreams.clients import ResponsesClient

    recording = _Recording(b'data: {"type":"response.created"}\n\ndata: [DONE]\n\n')
    timeout = openai.Timeout(65.0, connect=3.0, write=30.0, pool=30.0)
    sdk = openai.AsyncOpenAI(
        api_key="k",
        base_url="http://upstream.test/v1",
        timeout=timeout,
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=recording),
    )
    stream = await UpstreamStream.open(ResponsesClient(sdk, dated=False), "/responses", {"model": "m", "stream": True})
    assert [data async for data in stream] == [{"type": "response.created"}]
    assert recording.timeouts == [{"connect": 3.0, "read": None, "write": 30.0, "pool": 30.0}]


async def test_a_client_without_sdk_timeouts_opens_a_stream_with_its_own_settings():
    class Minimal:  # a stand-in client: no SDK timeouts
        timeout = None

        async def post(self, path, **kwargs):
            self.kwargs = kwargs
            return "opened"

    client = Minimal()
    assert await UpstreamStream.open(client, "/chat/completions", {"model": "m"}) == "opened"
    assert "timeout" not in client.kwargs["options"]  # None would mean "no timeout at all" to the SDK


async def test_a_body_is_read_directly_to_its_end_and_its_connection_reused():
    """From our transport the stream reads the body's reader itself (BODY), the same events; the
    body is read past [DONE] to its end, the response closed there, and the next stream goes over
    the same connection."""
    body = CHUNK + b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n' + b"data: [DONE]\n\n"
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        while await reader.readuntil(b"\r\n\r\n"):
            await reader.readexactly(2)  # the request's body ({} below)
            writer.write(HEAD)
            for piece in (body[:10], body[10:70], body[70:], b": after the end\n\n"):
                writer.write(_chunked(piece))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = _client(server.sockets[0].getsockname()[1])
    try:
        for _ in range(2):
            stream = await UpstreamStream.open(client, "/chat/completions", {})
            assert BODY in stream.response.extensions
            got = [d["choices"][0]["delta"]["content"] async for d in stream]
            assert got == ["a", "b"] and stream.response.is_closed
            await stream.close()
        assert connections == 1
    finally:
        await client.close()
        server.close()


async def _streamed(body: bytes) -> list[dict]:
    """The chunks an UpstreamStream reads from an answer whose body is ``body``."""

    async def handler(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD + _chunked(body) + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = _client(server.sockets[0].getsockname()[1])
    try:
        stream = await UpstreamStream.open(client, "/chat/completions", {})
        try:
            return [data async for data in stream]
        finally:
            await stream.close()
    finally:
        await client.close()
        server.close()


@pytest.mark.parametrize("extra", [b"", b"x-note: caf\xc3\xa9\r\n", b"x-note: caf\xe9\r\n"])
async def test_a_responses_headers_read_as_httpx2_reads_them(extra):
    """The transport tells httpx2 the encoding of an all-ASCII head (AiohttpTransport): the same one,
    and the same values, as httpx2 finds for the same header bytes (UTF-8 or Latin-1 ones as well)."""

    async def handler(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(HEAD.replace(b"\r\n\r\n", b"\r\n" + extra + b"x-request-id: r1\r\n\r\n") + _chunked(CHUNK))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = _client(server.sockets[0].getsockname()[1])
    try:
        stream = await UpstreamStream.open(client, "/chat/completions", {})
        headers = stream.response.headers
        fresh = httpx2.Headers(headers.raw)
        assert (headers.encoding, headers.multi_items()) == (fresh.encoding, fresh.multi_items())
        assert stream.request_id == "r1"
        await stream.close()
    finally:
        await client.close()
        server.close()


async def test_chunks_are_read_as_utf8_json_with_whitespace_around_it():
    text = "h\u00e9 \u2713 \U0001f600"
    body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"' + text.encode() + b'"}}]}\n\n'
        b'data:  \t{"choices":[]} \n\n'
        b"data: [DONE]\n\n"
    )
    assert await _streamed(body) == [{"choices": [{"index": 0, "delta": {"content": text}}]}, {"choices": []}]


@pytest.mark.parametrize(
    "payload",
    [b"\xff{}", b'{"choices":', b"[1]", "\ufeff{}".encode()],
    ids=["not UTF-8", "not JSON", "not an object", "a byte order mark (UTF-8 only at a stream's start)"],
)
async def test_a_chunk_that_is_not_a_utf8_json_object_is_upstream_malformed(payload):
    with pytest.raises(UpstreamMalformed):
        await _streamed(b"data: " + payload + b"\n\n")


def _usual(content: str, **top) -> dict:
    """A usual delta, as OpenAI streams it (``top``: fields after the choices)."""
    choice = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice], **top}


async def test_each_chunk_reads_as_json_reads_it_the_usual_delta_through_its_skeleton():
    """The usual delta is read through the stream's skeleton (clients._Skeleton: the last such
    chunk's text around its content and obfuscation) and every chunk, fitting or not, is what
    json.loads makes of its payload: equal, its keys in the same order."""
    chunks = [
        {**_usual(""), "choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None}}]},
        _usual("a"),
        _usual('b "quoted" \\ back\nslash \u00e9 \U0001f600 h\u00e9 \x00'),
        _usual("caf\u00e9", model="other"),  # another field differs: decoded whole, a new skeleton
        _usual("d"),
        _usual("e", obfuscation="xY"),
        _usual("f", obfuscation='a"b'),
        {**_usual("g"), "choices": [{**_usual("g")["choices"][0], "logprobs": {"content": [{"token": "g"}]}}]},
        _usual("h"),
        {**_usual(""), "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**_usual(""), "choices": [], "usage": {"total_tokens": 3}},
    ]
    payloads = [json.dumps(chunk, separators=(",", ":"), ensure_ascii=i % 2 == 0) for i, chunk in enumerate(chunks)]
    payloads.insert(
        5,
        '{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
        '"delta":{"content":"i"},"logprobs":null,"finish_reason":null}]} ',
    )  # whitespace after it
    body = b"".join(b"data: " + p.encode() + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"
    got = await _streamed(body)
    expected = [json.loads(p) for p in payloads]
    assert got == expected and [json.dumps(g) for g in got] == [json.dumps(e) for e in expected]


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.text(), min_size=2, max_size=4),
    padded=st.booleans(),
    ascii_only=st.booleans(),
)
def test_a_skeleton_reads_what_json_reads(texts, padded, ascii_only):
    """Any content (and padding) written by any JSON encoder: a skeleton reads it as json.loads does;
    a payload that differs anywhere else does not fit."""
    from chatstream.upstreams.clients import _Skeleton

    def text(content: str, **changes) -> str:
        chunk = _usual(content, **({"obfuscation": content[::-1]} if padded else {}))
        return json.dumps({**chunk, **changes}, ensure_ascii=ascii_only, separators=(",", ":"))

    first = text(texts[0])
    skeleton = _Skeleton.of(first, json.loads(first))
    assert skeleton is not None
    for content in texts[1:]:
        payload = text(content)
        read = skeleton.read(payload)
        assert read == json.loads(payload) and list(read or {}) == list(json.loads(payload))
        assert skeleton.read(text(content, model="n")) is None
        assert skeleton.read(text(content, created=2)) is None


async def test_a_chunk_that_fits_a_skeleton_but_for_a_broken_string_is_upstream_malformed():
    good = json.dumps(_usual("a"), separators=(",", ":")).encode()
    broken = good.replace(b'"content":"a"', b'"content":"a\\x"')
    with pytest.raises(UpstreamMalformed):
        await _streamed(b"data: " + good + b"\n\ndata: " + broken + b"\n\n")


async def test_a_thousand_connections_are_allowed_not_aiohttps_hundred():
    """150 streams at once each get a connection of their own: the server holds every answer until
    all 150 are open (aiohttp's default connector would queue the last 50)."""
    count, opened = 150, 0
    everyone = asyncio.Event()

    async def handler(reader, writer):
        nonlocal opened
        await reader.readuntil(b"\r\n\r\n")
        opened += 1
        if opened == count:
            everyone.set()
        try:
            await asyncio.wait_for(everyone.wait(), 10)
        except TimeoutError:
            writer.close()
            return
        writer.write(HEAD + _chunked(CHUNK, b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await asyncio.start_server(handler, "127.0.0.1", 0, backlog=count)
    client = _client(server.sockets[0].getsockname()[1], timeout=20)

    async def one() -> list:
        stream = await UpstreamStream.open(client, "/chat/completions", {"model": "m", "stream": True})
        return [d async for d in stream]

    try:
        results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
        assert opened == count
        assert all(isinstance(r, list) and len(r) == 1 for r in results), results[:3]
    finally:
        await client.close()
        server.close()


async def test_the_environments_proxy_is_used_and_no_proxy_honoured(monkeypatch):
    """HTTP_PROXY (read when the transport is made, as httpx2 reads it) carries requests to other
    hosts; a host NO_PROXY names is reached directly."""
    lines = []

    async def handler(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        lines.append(head.split(b"\r\n")[0].decode())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    from chatstream.upstreams.clients import complete

    try:
        for base in ("http://up.test/v1", f"http://127.0.0.1:{port}/v1"):
            client = openai.AsyncOpenAI(api_key="k", base_url=base, max_retries=0, timeout=5, http_client=HttpClient())
            try:
                assert await complete(client, "/chat/completions", {"model": "m"}) == ({}, None)
            finally:
                await client.close()
    finally:
        server.close()
    assert lines == ["POST http://up.test/v1/chat/completions HTTP/1.1", "POST /v1/chat/completions HTTP/1.1"]


async def test_an_entry_without_a_key_sends_no_authorization_header(monkeypatch):
    """make_client's client for an entry without a key: streams, whole answers and follow-ups (get,
    delete) go without Authorization; the key the SDK was given never leaves the process; other
    headers are kept."""
    from chatstream.settings import Settings
    from chatstream.upstreams.clients import complete, make_client
    from chatstream.upstreams.config import Entry

    recording = _Recording(b'{"choices": []}')
    monkeypatch.setattr(transport, "AiohttpTransport", lambda: recording)
    app_settings = Settings.from_env({"OPENAI_BASE_URL": "http://upstream.test/v1"})
    client = make_client(Entry(name="v", kind="openai", url="http://upstream.test/v1"), app_settings, 2)
    await complete(client, "/chat/completions", {"model": "m"})
    await client.get("/responses/r1", cast_to=object, options={"params": {"include": "x"}, "headers": {"X-A": "1"}})
    await client.delete("/responses/r1", cast_to=object)
    recording.body = CHUNK + b"data: [DONE]\n\n"
    stream = await UpstreamStream.open(client, "/chat/completions", {"model": "m", "stream": True})
    assert len([d async for d in stream]) == 1
    assert len(recording.requests) == 4
    for request in recording.requests:
        assert "authorization" not in request.headers
        assert all(b"not-needed" not in value for _, value in request.headers.raw)
    assert recording.requests[1].headers["x-a"] == "1" and recording.requests[1].url.params["include"] == "x"


def test_the_sdk_parts_reused_keep_the_shape_relied_on():
    """Reused overrides the SDK's private ``_prepare_url(url: str) -> URL`` and builds the private
    ``FinalRequestOptions`` that its ``post`` builds, handing them to ``request`` (no public hook
    does either): if the SDK renames or reshapes any of them, this fails, not production."""
    from openai._base_client import AsyncAPIClient
    from openai._models import FinalRequestOptions

    from chatstream.upstreams.clients import Reused, _AsyncAzureOpenAI, _AsyncOpenAI

    for sdk_class in (openai.AsyncOpenAI, openai.AsyncAzureOpenAI):
        assert list(inspect.signature(sdk_class._prepare_url).parameters) == ["self", "url"], sdk_class
        assert sdk_class.post is AsyncAPIClient.post, "the SDK class builds its own post"
    post = list(inspect.signature(AsyncAPIClient.post).parameters)
    assert post == ["self", "path", "cast_to", "body", "content", "files", "options", "stream", "stream_cls"]
    request = list(inspect.signature(AsyncAPIClient.request).parameters)
    assert request == ["self", "cast_to", "options", "stream", "stream_cls"]
    assert {"method", "url", "json_data", "content", "files", "timeout", "headers", "params"} <= set(
        FinalRequestOptions.model_fields
    )
    post_source = inspect.getsource(AsyncAPIClient.post)
    assert (
        'FinalRequestOptions.construct(\n            method="post", url=path, json_data=body, content=content'
        in post_source
    )
    assert "return await self.request(cast_to, opts, stream=stream, stream_cls=stream_cls)" in post_source
    from openai._response import AsyncAPIResponse
    from openai._streaming import extract_stream_chunk_type

    for sdk_class in (openai.AsyncOpenAI, openai.AsyncAzureOpenAI):
        assert list(inspect.signature(sdk_class._build_headers).parameters) == ["self", "options", "retries_taken"]
        assert list(inspect.signature(sdk_class._idempotency_key).parameters) == ["self"]
        assert list(inspect.signature(sdk_class._validate_headers).parameters) == ["self", "headers", "custom_headers"]
        assert list(inspect.signature(sdk_class._process_response).parameters) == [
            "self",
            "cast_to",
            "options",
            "response",
            "stream",
            "stream_cls",
            "retries_taken",
        ]
    assert extract_stream_chunk_type(UpstreamStream) is dict  # the cast_to the SDK gives our streams
    assert "self._stream_cls(" in inspect.getsource(AsyncAPIResponse._parse)
    for ours in (_AsyncOpenAI, _AsyncAzureOpenAI):  # ahead of the SDK class in the MRO
        assert ours._prepare_url is Reused._prepare_url and ours.post is Reused.post
        assert ours._build_headers is Reused._build_headers
        assert ours._process_response is Reused._process_response
        assert ours._idempotency_key is Reused._idempotency_key
        assert ours._send_request is Reused._send_request and ours.custom_auth is Reused.custom_auth
        assert ours._prepare_options is Reused._prepare_options
        assert ours._prepare_request is Reused._prepare_request
        # No idempotency header on the SDK's clients: the key the SDK makes per request is never sent.
        made = (
            ours(api_key="k", base_url="http://h.test/v1")
            if ours is _AsyncOpenAI
            else ours(api_key="k", azure_endpoint="https://h.test", api_version="1")
        )
        assert made._idempotency_header is None
        # The auth layers Reused skips when a client has none of them (their attributes, as the SDK keeps them).
        assert made._provider_runtime is None and made._workload_identity_auth is None and made._plain()

    async def token() -> str:
        return "k"

    provided = _AsyncOpenAI(api_key=token, base_url="http://h.test/v1")  # an Entra ID token as the key
    assert provided._api_key_provider is not None
    assert "return await self._client.send(request, stream=stream, **kwargs)" in inspect.getsource(
        AsyncAPIClient._send_request
    )
    assert inspect.getsource(AsyncAPIClient._prepare_options).rstrip().endswith("return options")
    assert inspect.getsource(AsyncAPIClient._prepare_request).rstrip().endswith("return None")
    assert AsyncAPIClient.custom_auth.fget(made) is None  # type: ignore[attr-defined]
    client = _AsyncOpenAI(api_key="k", base_url="http://127.0.0.1:9/v1", http_client=HttpClient())
    client._build_request(FinalRequestOptions.construct(method="post", url="/chat/completions", json_data={}))
    assert "/chat/completions" in client.__dict__["_chatstream_urls"], "the SDK no longer builds URLs with it"
    assert client.__dict__["_chatstream_headers"], "the SDK no longer builds headers with it"


async def test_kept_headers_follow_a_changed_key_token_or_header():
    """The headers kept per client (Reused._build_headers) are the SDK's for the same inputs: a key
    refreshed (an Entra ID token as the v1 API's key), an Azure AD token, a header of the request's
    own, an omitted one, another timeout: each request carries what the SDK's own class sends."""
    from openai._models import FinalRequestOptions

    from chatstream.upstreams.clients import _AsyncAzureOpenAI, _AsyncOpenAI

    def options(headers=None, timeout=None):
        extra = {"headers": headers} if headers is not None else {}
        extra |= {"timeout": timeout} if timeout is not None else {}
        return FinalRequestOptions.construct(method="post", url="/chat/completions", json_data={}, **extra)

    tokens = iter(f"token-{i}" for i in range(100))

    async def provider() -> str:
        return next(tokens)

    builds = [
        lambda cls, http: cls(api_key="sk-1", base_url="http://up.test/v1", http_client=http),
        lambda cls, http: cls(
            azure_endpoint="https://r.test", api_version="2024-10-21", azure_ad_token="t-1", http_client=http
        ),
    ]
    for build, ours_class, sdk_class in zip(
        builds, (_AsyncOpenAI, _AsyncAzureOpenAI), (openai.AsyncOpenAI, openai.AsyncAzureOpenAI), strict=True
    ):
        ours, theirs = build(ours_class, HttpClient()), build(sdk_class, openai.DefaultAsyncHttpx2Client())
        for step in range(4):
            for client in (ours, theirs):
                if step == 1:
                    client.api_key = "sk-2"
                if step == 2 and isinstance(client, openai.AsyncAzureOpenAI):
                    client._azure_ad_token = "t-2"
            for made in (
                options(),
                options({"x-a": "1"}),
                options({"OpenAI-Organization": openai.omit}),
                options(timeout=httpx2.Timeout(7.0)),
                options(),
            ):
                for retries in (0, 1):
                    sent = [c._build_headers(made, retries_taken=retries).raw for c in (ours, theirs)]
                    assert sent[0] == sent[1], (step, made.headers, retries)
                    ours_sent, theirs_sent = (c._build_request(made, retries_taken=retries) for c in (ours, theirs))
                    assert ours_sent.headers.raw == theirs_sent.headers.raw  # ours kept (Reused._build_request)
                    assert ours_sent.content == theirs_sent.content
    refreshed = _AsyncOpenAI(api_key=provider, base_url="http://up.test/v1", http_client=HttpClient())
    seen, sent = set(), set()
    for _ in range(3):
        made = await refreshed._prepare_options(options())
        seen.add(refreshed._build_headers(made)["authorization"])
        sent.add(refreshed._build_request(made).headers["authorization"])  # the request kept follows the token
    assert seen == {"Bearer token-0", "Bearer token-1", "Bearer token-2"}
    assert sent == {"Bearer token-0", "Bearer token-1", "Bearer token-2"}


class _OmittingAuth:
    """An SDK client for an upstream that takes no key, the SDK's documented way: ``Authorization``
    omitted in each request's options (the reference for make_client's, which omits it in its
    default headers)."""

    def __init__(self, client: openai.AsyncOpenAI) -> None:
        self.client = client

    @property
    def timeout(self):
        return self.client.timeout

    async def post(self, path: str, **kwargs):
        options = dict(kwargs.pop("options", None) or {})
        options["headers"] = {**(options.get("headers") or {}), "Authorization": openai.omit}
        return await self.client.post(path, options=options, **kwargs)


class _Answers(httpx2.AsyncBaseTransport):
    """Records every request; answers 500 to the first of each path (so that the SDK retries, after
    the 1 ms its retry-after-ms asks for: the SDK's own backoff is 0.5 s), then a stream or a JSON
    body."""

    def __init__(self):
        self.requests, self.seen = [], set()

    async def handle_async_request(self, request):
        self.requests.append(request)
        if request.url.path not in self.seen:
            self.seen.add(request.url.path)
            headers = {"retry-after-ms": "1"}
            return httpx2.Response(500, headers=headers, json={"error": {"message": "again"}}, request=request)
        if b'"stream":true' in request.content:
            body = CHUNK + b"data: [DONE]\n\n"
            stream = httpx2.ByteStream(body)
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=stream, request=request)
        return httpx2.Response(200, json={"choices": []}, request=request)


async def test_the_kept_request_options_send_the_requests_the_sdk_sends():
    """Through post (streams, whole answers, retries after a 500, the Responses API's Azure paths, an
    entry without a key, the body changing per call): every request our clients send is the one the
    SDK's own classes send, and the options kept are left as they were built."""
    from openai._models import FinalRequestOptions

    from chatstream.upstreams.clients import ResponsesClient, _AsyncAzureOpenAI, _AsyncOpenAI, complete

    timeout = openai.Timeout(65.0, connect=3.0, write=30.0, pool=30.0)
    kinds = {
        "openai": lambda cls, t: cls(api_key="sk-o", base_url="http://up.test/v1", **t),
        "azure": lambda cls, t: cls(azure_endpoint="https://res.test", api_version="2024-10-21", api_key="az", **t),
        "keyless": lambda cls, t: (
            cls(api_key="not-needed", base_url="http://up.test/v1", default_headers={"Authorization": openai.omit}, **t)
            if cls is _AsyncOpenAI
            else _OmittingAuth(cls(api_key="not-needed", base_url="http://up.test/v1", **t))
        ),
    }
    sdk_classes = {"openai": (_AsyncOpenAI, openai.AsyncOpenAI), "azure": (_AsyncAzureOpenAI, openai.AsyncAzureOpenAI)}

    async def calls(client, azure: bool) -> None:
        for model in ("m1", "m2", "m1"):
            stream = await UpstreamStream.open(client, "/chat/completions", {"model": model, "stream": True})
            assert [d async for d in stream] == [{"choices": [{"index": 0, "delta": {"content": "a"}}]}]
            assert await complete(client, "/chat/completions", {"model": model, "n": 2}) == ({"choices": []}, None)
            responses = ResponsesClient(client, dated=azure)
            stream = await UpstreamStream.open(responses, "/responses", {"model": model, "stream": True})
            assert len([d async for d in stream]) == 1

    def shape(request: httpx2.Request) -> tuple:
        headers = request.headers
        return request.method, str(request.url), headers.raw, headers.multi_items(), request.content, request.extensions

    for kind, build in kinds.items():
        ours_class, sdk_class = sdk_classes.get(kind, sdk_classes["openai"])
        sent = []
        for cls in (ours_class, sdk_class):
            answers = _Answers()
            client = build(
                cls, {"timeout": timeout, "max_retries": 2, "http_client": httpx2.AsyncClient(transport=answers)}
            )
            await calls(client, azure=kind == "azure")
            sent.append([shape(r) for r in answers.requests])
            kept = getattr(client, "client", client).__dict__.get("_chatstream_options", {})
            for options in kept.values():  # as built: nothing set on the kept ones
                given = {k: getattr(options, k) for k in options.model_fields_set - {"method", "url"}}
                fresh = FinalRequestOptions.construct(method="post", url=options.url, **given)
                assert options.json_data is None and options.method == "post"
                assert repr(options) == repr(fresh) and options.model_fields_set == fresh.model_fields_set
        ours, theirs = sent
        assert len(ours) > 9 and ours == theirs, kind  # 9 calls, the first on each path retried


def test_cached_urls_build_the_requests_the_sdk_builds():
    """make_client's clients keep parsed URLs (Reused, HttpClient.build_request): every request
    is the one the SDK's own classes build on the SDK's own httpx2 client, OpenAI and Azure (the v1
    API; a dated one: a deployment per model, api-version), the second time too, and after the base
    URL changes."""
    from openai._models import FinalRequestOptions
    from pydantic import SecretStr

    from chatstream.settings import Settings
    from chatstream.upstreams.clients import make_client
    from chatstream.upstreams.config import Entry

    settings = Settings.from_env({"OPENAI_API_KEY": "sk-x"})
    entries = [
        Entry(name="o", kind="openai", url="http://127.0.0.1:9/v1", api_key=SecretStr("sk-o")),
        Entry(
            name="a",
            kind="azure",
            url="https://res.openai.azure.com",
            api_key=SecretStr("az-k"),
            api_version="2024-10-21",
        ),
        Entry(name="v1", kind="azure", url="https://res.openai.azure.com", api_key=SecretStr("az-k")),
    ]

    def shape(request: httpx2.Request) -> tuple:
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"x-stainless-retry-count"]  # in order
        sent = (request.method, str(request.url), headers, request.content, request.extensions)
        return (*sent, sorted(vars(request)), request.headers.multi_items(), b"".join(request.stream))

    for entry in entries:
        ours = make_client(entry, settings, 2)
        assert isinstance(ours, openai.AsyncOpenAI) and isinstance(ours._client, HttpClient)
        plain = (
            openai.AsyncAzureOpenAI(
                azure_endpoint=entry.url,
                api_version=entry.api_version,
                api_key="az-k",
                max_retries=2,
                http_client=openai.DefaultAsyncHttpx2Client(),
                timeout=ours.timeout,
            )
            if entry.dated
            else openai.AsyncOpenAI(
                api_key="az-k" if entry.kind == "azure" else "sk-o",
                base_url=entry.url + "/openai/v1" if entry.kind == "azure" else entry.url,
                max_retries=2,
                http_client=openai.DefaultAsyncHttpx2Client(),
                timeout=ours.timeout,
            )
        )
        for round_ in range(3):
            if round_ == 2:  # a new base URL: nothing parsed for the old one is used
                ours.base_url = plain.base_url = str(plain.base_url).replace("127.0.0.1:9", "127.0.0.1:8")
            for model in ("m1", "m2", "m1"):
                for url in ("/chat/completions", "/responses"):

                    def options(url=url, model=model, round_=round_):
                        return FinalRequestOptions.construct(
                            method="post",
                            url=url,
                            json_data={"model": model, "stream": True, "input": "é" * len(model) * round_},
                            idempotency_key="stainless-python-retry-1",
                        )

                    for retries in (0, 1):
                        made = [c._build_request(options(), retries_taken=retries) for c in (ours, plain)]
                        assert shape(made[0]) == shape(made[1])
                        made[0].headers["x-changed"] = "by whoever sent it"  # a request's headers are its own
        # A request of each kind is kept (Reused._build_request), but for a dated API version's (its query).
        assert bool(ours.__dict__.get("_chatstream_requests")) is not entry.dated


def test_http_client_builds_the_request_httpx2_builds():
    """HttpClient.build_request against httpx2's own, for what the SDK sends (pairs of headers,
    bytes of other lengths or none, a query string, a timeout) and for what it does not (a relative
    URL, dict headers, cookies or params on the client, a JSON body, extensions): the same method,
    URL, headers in order (case kept), body and extensions, the second time too (from the kept
    headers), and after a request sent changed its own."""
    headers = [("accept", "application/json"), ("user-agent", "AsyncOpenAI/Python"), ("x-a", "1"), ("x-a", "2")]
    calls = [
        dict(method="POST", url="https://h.test/v1/chat/completions", content=b"{}", headers=headers, timeout=5.0),
        dict(method="POST", url="https://h.test/v1/chat/completions", content=b'{"model":"m"}', headers=headers),
        dict(method="POST", url="https://h.test/v1/chat/completions", content=b"", headers=headers),
        dict(method="POST", url="https://h.test/v1/chat/completions", headers=headers),
        dict(method="GET", url="https://h.test/v1/chat/completions", headers=headers),
        dict(method="POST", url="https://h.test/openai/x", params="api-version=1", headers=headers, files=None),
        dict(method="GET", url="https://h.test/v1/r?a=1", params="b=2", headers=headers, timeout=httpx2.Timeout(3)),
        dict(method="GET", url="https://h.test/v1/r", headers={"Accept": "x"}),
        dict(method="POST", url="https://h.test/v1/r", json={"a": 1}, headers=headers, extensions={"x": 1}),
    ]

    def shape(request: httpx2.Request) -> tuple:
        headers = request.headers
        return request.method, str(request.url), headers.raw, headers.multi_items(), request.content, request.extensions

    for setup in ({}, {"cookies": {"c": "1"}}, {"params": {"p": "1"}}, {"base_url": "https://base.test/x/"}):
        ours = HttpClient(httpx2.MockTransport(lambda r: httpx2.Response(200)))
        theirs = httpx2.AsyncClient(timeout=openai.DEFAULT_TIMEOUT, follow_redirects=True, trust_env=False)
        for client in (ours, theirs):
            for name, value in setup.items():
                setattr(client, name, value)
        relative = [dict(method="GET", url="/relative", headers=headers)] if "base_url" in setup else []
        for call in (calls + relative) * 2:
            assert shape(ours.build_request(**call)) == shape(theirs.build_request(**call)), (setup, call)
    fresh = HttpClient(httpx2.MockTransport(lambda r: httpx2.Response(200)))
    first = fresh.build_request(**calls[0])  # the one whose headers are kept
    first.headers["x-changed"] = "by whoever sent it"  # a request's headers are its own
    assert shape(fresh.build_request(**calls[0])) == shape(theirs.build_request(**calls[0]))


async def test_http_client_sends_as_httpx2_sends():
    """HttpClient.send hands the SDK's requests straight to the transport: each response is the one
    httpx2's own send gives on the same transport (status, request, history, cookies kept, a
    redirect followed or not, the body read or left to stream, httpx2's timed body), and a
    transport error names its request, the first request and one with auth going httpx2's way."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/moved":
            return httpx2.Response(307, headers={"location": "/v1/chat"})
        if request.url.path == "/gone":
            raise httpx2.ConnectError("refused")
        headers = {"set-cookie": "s=1; Path=/"} if request.url.path == "/cookie" else {}
        return httpx2.Response(200, headers=headers, content=b"data: {}\n\n")

    def shape(response: httpx2.Response, client: httpx2.AsyncClient) -> tuple:
        return (
            response.status_code,
            str(response.url),
            response.request.content,
            [(r.status_code, str(r.url)) for r in response.history],
            None if response.next_request is None else str(response.next_request.url),
            response.is_stream_consumed,
            type(response.stream).__name__,
            dict(client.cookies),
        )

    async def run(client: httpx2.AsyncClient) -> list:
        out = []
        for path, stream, follow in [
            ("/v1/chat", True, httpx2.USE_CLIENT_DEFAULT),
            ("/v1/chat", True, httpx2.USE_CLIENT_DEFAULT),
            ("/v1/chat", False, httpx2.USE_CLIENT_DEFAULT),
            ("/cookie", True, httpx2.USE_CLIENT_DEFAULT),
            ("/moved", True, httpx2.USE_CLIENT_DEFAULT),
            ("/moved", True, False),
            ("/moved", False, True),
        ]:
            request = client.build_request("POST", f"https://h.test{path}", content=b"{}", timeout=5.0)
            response = await client.send(request, stream=stream, follow_redirects=follow)
            await response.aclose()
            out.append(shape(response, client))
        request = client.build_request("POST", "https://h.test/gone", content=b"{}", timeout=5.0)
        with pytest.raises(httpx2.ConnectError) as raised:
            await client.send(request)
        out.append(raised.value.request is request)
        return out

    ours = HttpClient(httpx2.MockTransport(answer))
    theirs = httpx2.AsyncClient(
        transport=httpx2.MockTransport(answer), timeout=openai.DEFAULT_TIMEOUT, follow_redirects=True
    )
    assert await run(ours) == await run(theirs)
    basic = HttpClient(httpx2.MockTransport(answer))
    basic.auth = ("u", "p")  # not the SDK's way: httpx2's own send adds the header
    for _ in range(2):
        response = await basic.send(basic.build_request("POST", "https://h.test/v1/chat", content=b"{}"))
        assert response.request.headers["authorization"].startswith("Basic ")


def test_kept_headers_decode_as_httpx2_headers_do_until_changed():
    """KeptHeaders hand out the pairs they decoded once: a copy's, and after any change (a header
    set, the length replaced, removed, popped, an encoding set) the pairs are httpx2's own for the
    same headers; so is the encoding found."""
    from chatstream.upstreams.transport import KeptHeaders, length_last

    def set_length(headers: httpx2.Headers, length: int) -> None:
        if isinstance(headers, KeptHeaders):
            assert length_last(headers.raw)
            headers.set_length(length)
        else:
            headers["Content-Length"] = str(length)

    base = [("Accept", "application/json"), ("X-A", "1"), ("x-a", "2"), ("Content-Length", "2")]
    changes = [
        lambda h: None,
        lambda h: set_length(h, 123),
        lambda h: h.__setitem__("x-new", "v"),
        lambda h: h.__delitem__("accept"),
        lambda h: h.pop("x-a"),
        lambda h: setattr(h, "encoding", "iso-8859-1"),
    ]
    for last in (b"2", "\u00e9".encode()):  # all ASCII, or the last value not (httpx2 finds utf-8)
        kept = KeptHeaders(
            httpx2.Headers([(k.encode(), v.encode()) for k, v in base[:-1]] + [(b"Content-Length", last)])
        )
        for change in changes if last.isascii() else changes[:1] + changes[2:]:  # (a length is ASCII)
            for read_first in (False, True):  # the kept ones' encoding known before the copy, or not
                if read_first:
                    assert kept.encoding == httpx2.Headers(kept).encoding
                ours, theirs = kept.copied(), httpx2.Headers(kept)
                for headers in (ours, theirs):
                    change(headers)
                assert ours.raw == theirs.raw and ours.multi_items() == theirs.multi_items(), change
                assert ours.encoding == theirs.encoding, change
                assert kept.multi_items() == httpx2.Headers(kept.raw).multi_items()  # the kept ones unchanged


@pytest.mark.parametrize("end", ["close", "reset", "head_begun", "reset_late"])
async def test_a_kept_connection_closed_before_its_answer_sends_the_request_once_more_on_a_new_one(end, monkeypatch):
    """The keep-alive race: each connection answers its first request, and closes (FIN), resets (RST),
    or begins a status line and closes, as the next request comes on it. Closed or reset before any
    byte of the answer: the request goes once more, on a new connection, and the stream gets its
    answer. A head begun is an answer cut: the error, not sent again; so is a reset that came after
    the server had the request longer than the race takes (``reset_late``: it may have worked on it)."""
    if end == "reset_late":
        monkeypatch.setattr(transport, "RESEND_WITHIN", 0.1)
    body = CHUNK + b"data: [DONE]\n\n"
    requests: list[int] = []  # the connection (1, 2, ...) of each request received

    async def handler(reader, writer):
        connection = len({*requests}) + 1
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        requests.append(connection)
        writer.write(HEAD + _chunked(body) + b"0\r\n\r\n")
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)  # read: closed with unread bytes, a socket would reset
            requests.append(connection)
            if end == "reset_late":
                await asyncio.sleep(0.6)
            if end in ("reset", "reset_late"):
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            if end == "head_begun":
                writer.write(b"HTTP/1.1 200")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = _client(server.sockets[0].getsockname()[1])
    try:
        outcomes = []
        for _ in range(2):
            try:
                stream = await UpstreamStream.open(client, "/chat/completions", {})
                outcomes.append([d["choices"][0]["delta"]["content"] async for d in stream])
                await stream.close()
            except openai.APIConnectionError as exc:
                outcomes.append(classify(exc).outcome.kind)
    finally:
        await client.close()
        server.close()
    if end in ("head_begun", "reset_late"):
        assert outcomes == [["a"], OutcomeKind.CONNECTION_LOST] and requests == [1, 1]
    else:
        assert outcomes == [["a"], ["a"]] and requests == [1, 1, 2]
