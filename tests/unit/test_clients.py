"""chatstream/upstream.py's aiohttp transport: connection errors come out as the SDK's types they had
with httpx2 (a refused connection or a reset is APIConnectionError, not APITimeoutError), and the
pool still tells a failure to connect from a lost connection. In-process loopback servers only."""

from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
import httpx2
import openai

from chatstream.upstreams.clients import UpstreamStream
from chatstream.upstreams.outcomes import OutcomeKind, classify
from chatstream.upstreams.transport import AioHttpClient, remapped

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'


def _connect_timeout(cause: BaseException) -> httpx2.ConnectTimeout:
    exc = httpx2.ConnectTimeout("x")
    exc.__cause__ = cause
    return exc


def test_remapped_keeps_real_timeouts_and_restores_the_rest():
    real = _connect_timeout(aiohttp.ConnectionTimeoutError("connect timed out"))
    assert remapped(real) is real
    assert isinstance(remapped(_connect_timeout(aiohttp.ServerDisconnectedError())), httpx2.RemoteProtocolError)
    assert isinstance(remapped(_connect_timeout(aiohttp.ClientOSError(104, "reset"))), httpx2.ReadError)


async def _serve(mode: str):
    async def handler(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        if mode == "mid_body":
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
            )
            await writer.drain()
            await asyncio.sleep(0.05)
        if mode == "disconnect":
            writer.close()
            return
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST

    return await asyncio.start_server(handler, "127.0.0.1", 0)


async def _failure(port: int) -> BaseException:
    client = openai.AsyncOpenAI(
        api_key="k", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=5, http_client=AioHttpClient()
    )
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


class _Recording(httpx2.AsyncBaseTransport):
    def __init__(self, body: bytes):
        self.body, self.timeouts = body, []

    async def handle_async_request(self, request):
        self.timeouts.append(request.extensions.get("timeout"))
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
    stream = await UpstreamStream.open(ResponsesClient(sdk, azure=False), "/responses", {"model": "m", "stream": True})
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


async def test_an_aiohttp_body_is_read_directly_and_released_at_its_end():
    """From AioHttpClient the stream reads aiohttp's reader itself (AIOHTTP_BODY), the same events,
    and the response is closed (its connection back in the pool) as soon as the body ends."""
    from chatstream.upstreams.transport import AIOHTTP_BODY

    body = CHUNK + b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n' + b"data: [DONE]\n\n"

    async def handler(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in (body[:10], body[10:70], body[70:]):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(
        api_key="k",
        base_url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1",
        max_retries=0,
        timeout=5,
        http_client=AioHttpClient(),
    )
    try:
        stream = await UpstreamStream.open(client, "/chat/completions", {"model": "m", "stream": True})
        assert AIOHTTP_BODY in stream.response.extensions
        got = [d["choices"][0]["delta"]["content"] async for d in stream]
        assert got == ["a", "b"] and stream.response.is_closed
        await stream.close()
    finally:
        await client.close()
        server.close()


def test_cached_urls_build_the_requests_the_sdk_builds():
    """make_client's clients keep parsed URLs (chatstream's PreparedUrls and AioHttpClient._merge_url):
    every request is the one the SDK's own classes build, OpenAI and Azure (a deployment per model,
    api-version), the second time too, and after the base URL changes."""
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
    ]

    def shape(request: httpx2.Request) -> tuple:
        headers = sorted((k, v) for k, v in request.headers.items() if k != "x-stainless-retry-count")
        return request.method, str(request.url), headers, request.content, request.extensions.get("timeout")

    for entry in entries:
        ours = make_client(entry, settings, 2)
        plain = (
            openai.AsyncAzureOpenAI(
                azure_endpoint=entry.url,
                api_version=entry.api_version,
                api_key="az-k",
                max_retries=2,
                http_client=AioHttpClient(),
                timeout=ours.timeout,
            )
            if entry.kind == "azure"
            else openai.AsyncOpenAI(
                api_key="sk-o", base_url=entry.url, max_retries=2, http_client=AioHttpClient(), timeout=ours.timeout
            )
        )
        for round_ in range(3):
            if round_ == 2:  # a new base URL: nothing parsed for the old one is used
                ours.base_url = plain.base_url = str(plain.base_url).replace("127.0.0.1:9", "127.0.0.1:8")
            for model in ("m1", "m2", "m1"):
                for url in ("/chat/completions", "/responses"):

                    def options(url=url, model=model):
                        return FinalRequestOptions.construct(
                            method="post",
                            url=url,
                            json_data={"model": model, "stream": True},
                            idempotency_key="stainless-python-retry-1",
                        )

                    assert shape(ours._build_request(options())) == shape(plain._build_request(options()))
