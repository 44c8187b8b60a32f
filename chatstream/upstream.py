"""The upstream: an OpenAI or Azure OpenAI client built from the settings, its streams read as raw
chunks, and its non-streamed answers.

The openai SDK does the request: retries (honouring ``retry-after``), timeouts, typed errors, Azure
URLs and Entra ID tokens. The stream's chunks are decoded here with ``json.loads`` instead of the
SDK's typed models: building a ChatCompletionChunk costs ~96 µs per chunk against ~3 µs for
json.loads (measured on this machine), which decides how many streams one worker carries, and raw
dicts keep every field the upstream sent (Azure's filter results, new fields) for pass-through.

The clients use the SDK's aiohttp transport (``openai.DefaultAioHttpClient``, the ``openai[aiohttp]``
extra) instead of its default httpx2/httpcore2/h11 one: reading the upstream's body was most of the
worker's CPU per delta. Measured here (tools/bench, direct+app, 3 interleaved runs each, 100
streams, 1 worker): worker CPU per delta all-in 0.448 → 0.328 ms (fit: 5.9 → 4.1 ms/request +
0.299 → 0.224 ms/delta), added time-to-first-delta p99 +1,446 → +1,089 ms (noisy), inter-delta gap
p99 115 → 64 ms; 1 stream: worker 1.11 → 0.88 ms/delta, TTFD unchanged. (An earlier A/B: 0.293 →
0.160 ms/delta, TTFD p99 +1,372 → +699 ms.)
The SDK's adapter maps every other aiohttp connection error to httpx2.ConnectTimeout (a refused
connection would become APITimeoutError, a reset or disconnect before the response a timeout and a
"connect failure" in chatstream/pool.py);
``_RemappingTransport`` below puts them back to what httpx2 raises (ConnectError, ReadError,
RemoteProtocolError), keeping the aiohttp exception and its OS error in the cause chain."""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import aiohttp
import httpx2
import openai

from .errors import UpstreamMalformed, http_errors, invalid_request
from .settings import Settings
from .sse import SSEFramer

if TYPE_CHECKING:
    from .pool import Entry

# Sent when the upstream needs no key (a local vLLM/Ollama/LM Studio behind OPENAI_BASE_URL); the
# SDK refuses to start without one.
NO_KEY = "not-needed"
ENTRA_SCOPE = "https://cognitiveservices.azure.com/.default"
# Azure OpenAI puts the model (the deployment name) in the URL path, so only a name that is one
# plain path segment may go there ("." or ".." would change the path the SDK builds).
_DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_model_name(settings: Settings, model: str) -> None:
    if settings.upstream_kind == "azure" and not _DEPLOYMENT_NAME.fullmatch(model):
        raise invalid_request(f"model {model!r} is not a valid Azure OpenAI deployment name", "model")


def _common(settings: Settings, max_retries: int) -> dict:
    # The relay enforces first-token, idle and total limits itself; the SDK's read timeout is only
    # a backstop in case a limit is missed, so it sits above both.
    read = max(settings.first_token_timeout, settings.idle_timeout) + 5
    return dict(max_retries=max_retries, http_client=AioHttpClient(),
                timeout=openai.Timeout(read, connect=settings.upstream_connect_timeout, write=30.0, pool=30.0))


class _RemappingTransport(httpx2.AsyncBaseTransport):
    """Wraps the SDK's aiohttp transport: its ConnectTimeout for errors that are no timeout becomes
    ConnectError (could not connect) or ReadError/RemoteProtocolError (connection lost)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except httpx2.ConnectTimeout as exc:
            raise _remapped(exc) from exc.__cause__
        response.stream = _RemappingStream(response.stream)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _RemappingStream(httpx2.AsyncByteStream):
    def __init__(self, inner) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except httpx2.ConnectTimeout as exc:
            raise _remapped(exc) from exc.__cause__

    async def aclose(self) -> None:
        await self._inner.aclose()


def _remapped(exc: httpx2.ConnectTimeout) -> Exception:
    cause = exc.__cause__
    if cause is None or isinstance(cause, (aiohttp.ServerTimeoutError, TimeoutError)):
        return exc  # a real timeout (aiohttp's connect timeout is a ServerTimeoutError)
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx2.ConnectError(str(exc))
    if isinstance(cause, aiohttp.ServerDisconnectedError):
        return httpx2.RemoteProtocolError(str(exc))
    return httpx2.ReadError(str(exc))


class AioHttpClient(openai.DefaultAioHttpClient):
    """``openai.DefaultAioHttpClient`` (the SDK's defaults, aiohttp underneath) with its errors
    remapped (``_RemappingTransport``)."""

    def _init_transport(self, *args, **kwargs):
        return _RemappingTransport(super()._init_transport(*args, **kwargs))

    def _init_proxy_transport(self, *args, **kwargs):
        return _RemappingTransport(super()._init_proxy_transport(*args, **kwargs))


def make_client(settings: Settings, credential=None) -> openai.AsyncOpenAI:
    """The SDK client for the configured upstream. ``credential`` (an azure-identity async
    credential) is only used for keyless Azure OpenAI; default: DefaultAzureCredential."""
    common = _common(settings, settings.upstream_max_retries)
    if settings.upstream_kind == "azure":
        if settings.azure_openai_api_key is not None:
            auth = {"api_key": settings.azure_openai_api_key.get_secret_value()}
        else:
            auth = {"azure_ad_token_provider": entra_token_provider(credential)}
        # No azure_deployment: the SDK puts the request's model in the URL
        # (/openai/deployments/{model}/...), so a request may name another deployment.
        return openai.AsyncAzureOpenAI(azure_endpoint=settings.azure_openai_endpoint,
                                       api_version=settings.azure_openai_api_version, **auth, **common)
    key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else NO_KEY
    return openai.AsyncOpenAI(api_key=key, base_url=settings.openai_base_url, **common)


def make_entry_client(entry: "Entry", settings: Settings, max_retries: int, token_provider=None) -> openai.AsyncOpenAI:
    """The SDK client for one ``UPSTREAMS`` entry (chatstream/pool.py): its own URL and key, the
    app's time limits, and ``max_retries`` (0 when the pool has other entries to move to).
    ``token_provider``: the Entra ID token provider shared by keyless Azure entries."""
    common = _common(settings, max_retries)
    key = entry.api_key.get_secret_value() if entry.api_key is not None else None
    if entry.kind == "azure":
        auth = {"api_key": key} if key is not None else {"azure_ad_token_provider": token_provider or entra_token_provider()}
        return openai.AsyncAzureOpenAI(azure_endpoint=entry.url, api_version=entry.api_version, **auth, **common)
    return openai.AsyncOpenAI(api_key=key or NO_KEY, base_url=entry.url, **common)


def entra_token_provider(credential=None):
    """An async callable returning a bearer token for Azure OpenAI; azure-identity caches the token
    and refreshes it before it expires."""
    from azure.identity.aio import DefaultAzureCredential, get_bearer_token_provider

    return get_bearer_token_provider(credential or DefaultAzureCredential(), ENTRA_SCOPE)


class UpstreamStream(openai.AsyncStream[dict]):
    """One streamed call (chat completions or responses): ``async for data in stream`` yields each
    ``data:`` payload as a dict until ``[DONE]`` or the end of the body; ``close()`` drops the
    connection (stopping the generation).

    The request goes through the SDK's documented low-level ``client.post`` (retries, timeouts,
    typed errors, Azure's deployment URLs and auth all apply); ``create()`` would first run its
    type-driven transform over the parameters, about 1 ms per request here for plain dicts that
    need none."""

    ready = 0  # chunks already read from the upstream and not yet handed out (stream.py batches them)

    @classmethod
    async def open(cls, client: openai.AsyncOpenAI, path: str, params: dict) -> "UpstreamStream":
        extra = {}
        timeout = getattr(client, "timeout", None)
        if isinstance(timeout, httpx2.Timeout):  # an SDK client (a stand-in may have no timeouts)
            extra["options"] = {"timeout": _without_read_limit(timeout)}
        return await client.post(path, body=params, cast_to=object, stream=True, stream_cls=cls, **extra)

    def __aiter__(self) -> AsyncIterator[dict]:
        # The stream's own generator: the SDK's __aiter__ wraps it in one more generator per chunk.
        return self._iterator

    async def __stream__(self) -> AsyncIterator[dict]:
        framer = SSEFramer()
        # Without a content coding (an event stream normally has none) the raw bytes are the body:
        # one generator and one decoder call less per piece than aiter_bytes.
        coded = self.response.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")
        try:
            async for piece in (self.response.aiter_bytes() if coded else self.response.aiter_raw()):
                if framer.done:
                    continue  # read to the end of the body, so the connection can be reused
                payloads = framer.feed(piece)
                for i, payload in enumerate(payloads, 1):
                    self.ready = len(payloads) - i
                    yield _decode(self.response, payload)
        except _TIMEOUT_ERRORS as exc:
            raise openai.APITimeoutError(request=self.response.request) from exc
        except _TRANSPORT_ERRORS as exc:
            raise openai.APIConnectionError(request=self.response.request) from exc


def _without_read_limit(timeout: httpx2.Timeout) -> httpx2.Timeout:
    """The client's timeouts without the read one, for streams: the stream core bounds every read
    itself (limits.py), and aiohttp would re-arm a read timer on every chunk it receives (~2% of the
    worker's CPU at 100 streams). Non-streamed calls keep it as their backstop."""
    return httpx2.Timeout(connect=timeout.connect, read=None, write=timeout.write, pool=timeout.pool)


def _decode(response, payload: bytes) -> dict:
    try:
        data = json.loads(payload)
    except ValueError:  # not JSON, or not UTF-8
        raise UpstreamMalformed() from None
    if not isinstance(data, dict):
        raise UpstreamMalformed()
    if data.get("error") and "choices" not in data and "type" not in data:  # chat completions' error event
        raise _stream_error(response, data["error"])
    return data


async def complete(client: openai.AsyncOpenAI, path: str, params: dict) -> dict:
    """One non-streamed call: the upstream's JSON object."""
    try:
        body = await client.post(path, body=params, cast_to=object)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UpstreamMalformed("the model server sent a malformed answer") from None
    if not isinstance(body, dict):  # the SDK hands back text when the body is not JSON
        raise UpstreamMalformed("the model server sent a malformed answer")
    return body


def _stream_error(response, error) -> openai.APIError:
    message = error.get("message") if isinstance(error, dict) else None
    return openai.APIError(message if isinstance(message, str) else "An error occurred during streaming",
                           response.request, body=error)


# The SDK's HTTP library raises these while a body is read; the SDK maps them only inside its own
# decoder, so they are mapped the same way here.
_TIMEOUT_ERRORS = http_errors("TimeoutException")
_TRANSPORT_ERRORS = http_errors("TransportError")
