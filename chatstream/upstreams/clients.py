"""The clients of the upstreams: one openai SDK client per entry (OpenAI and compatible servers, or
Azure OpenAI with a key or Entra ID), their streams read as raw chunks, their whole answers, and the
Responses API's view of a client (``ResponsesClient``).

The openai SDK does the request: retries (honouring ``retry-after``), timeouts, typed errors, Azure
URLs and Entra ID tokens. Stream chunks are decoded here with ``json.loads`` instead of the SDK's
typed models (building a ChatCompletionChunk costs ~30x more), and raw dicts keep every field the
upstream sent (Azure's filter results, new fields) for pass-through.

The clients use the SDK's aiohttp transport (``openai.DefaultAioHttpClient``, the ``openai[aiohttp]``
extra) instead of its default httpx2 one: reading the upstream's body was most of the worker's CPU
per delta (docs/benchmarks.md). The SDK's adapter maps every other aiohttp connection error to
httpx2.ConnectTimeout; transport.py puts them back to what httpx2 raises (ConnectError,
ReadError, RemoteProtocolError), keeping the aiohttp exception in the cause chain, so that a refused
connection is not taken for a timeout."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import httpx2
import openai

from ..errors import ApiError, ErrorKind, UpstreamMalformed, http_errors, register_secret
from ..http import SSEFramer
from ..settings import Settings
from .config import Entry
from .outcomes import upstream_field
from .transport import AIOHTTP_BODY, AioHttpClient, PreparedUrls, aiohttp_errors, remapped

# Sent when the upstream needs no key (a local vLLM/Ollama/LM Studio behind OPENAI_BASE_URL); the
# SDK refuses to start without one.
NO_KEY = "not-needed"
ENTRA_SCOPE = "https://cognitiveservices.azure.com/.default"
# Azure OpenAI puts the model (the deployment name) in the URL path, so only a name that is one
# plain path segment may go there ("." or ".." would change the path the SDK builds).
DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Upstream 404 codes that mean the model (Azure: the deployment) is unknown, not the API.
_MODEL_MISSING = {"model_not_found", "DeploymentNotFound"}

TokenProvider = Callable[[], Awaitable[str]]


class SdkClient(Protocol):
    """What the app calls on an upstream client: the SDK's documented low-level methods (with the
    overloads the SDK declares) and its timeouts. ``openai.AsyncOpenAI`` is one; ``ResponsesClient``
    is another."""

    @property
    def timeout(self) -> float | httpx2.Timeout | None: ...
    @property
    def post(self) -> Callable[..., Awaitable[Any]]: ...
    @property
    def get(self) -> Callable[..., Awaitable[Any]]: ...
    @property
    def delete(self) -> Callable[..., Awaitable[Any]]: ...
    @property
    def close(self) -> Callable[[], Awaitable[None]]: ...


# --- building clients -------------------------------------------------------------------------


# The SDK's classes with PreparedUrls, under the SDK's names (they go into the User-Agent header).
_AsyncOpenAI = type("AsyncOpenAI", (PreparedUrls, openai.AsyncOpenAI), {"__module__": __name__})
_AsyncAzureOpenAI = type("AsyncAzureOpenAI", (PreparedUrls, openai.AsyncAzureOpenAI), {"__module__": __name__})


def make_client(
    entry: Entry, settings: Settings, max_retries: int, token_provider: TokenProvider | None = None
) -> openai.AsyncOpenAI:
    """The SDK client for one upstream entry (``UPSTREAMS``, or the single upstream): its URL and key,
    the app's time limits, and ``max_retries`` (0 when the pool has other entries to move to). An
    Azure entry without a key uses ``token_provider`` (Entra ID)."""
    # The relay enforces first-token, idle and total limits itself; the SDK's read timeout is only
    # a backstop for non-streamed calls, so it sits above both.
    read = max(settings.first_token_timeout, settings.idle_timeout) + 5
    common: dict[str, Any] = dict(
        max_retries=max_retries,
        http_client=AioHttpClient(),
        timeout=openai.Timeout(read, connect=settings.upstream_connect_timeout, write=30.0, pool=30.0),
    )
    key = entry.api_key.get_secret_value() if entry.api_key is not None else None
    register_secret(key)
    if entry.kind == "azure":
        if key is not None:
            return _AsyncAzureOpenAI(azure_endpoint=entry.url, api_version=entry.api_version, api_key=key, **common)
        # No azure_deployment: the SDK puts the request's model in the URL
        # (/openai/deployments/{model}/...), so a request may name another deployment.
        return _AsyncAzureOpenAI(
            azure_endpoint=entry.url,
            api_version=entry.api_version,
            azure_ad_token_provider=token_provider or entra_token_provider(),
            **common,
        )
    return _AsyncOpenAI(api_key=key or NO_KEY, base_url=entry.url, **common)


def entra_token_provider(credential: Any = None) -> TokenProvider:
    """An async callable returning a bearer token for Azure OpenAI; azure-identity caches the token
    and refreshes it before it expires. Each token is registered as a secret (never passed on)."""
    from azure.identity.aio import DefaultAzureCredential, get_bearer_token_provider

    provider = get_bearer_token_provider(credential or DefaultAzureCredential(), ENTRA_SCOPE)

    async def token() -> str:
        value = await provider()
        register_secret(value)
        return value

    return token


def check_deployment_name(model: str) -> None:
    if not DEPLOYMENT_NAME.fullmatch(model):
        raise ApiError(
            400, ErrorKind.INVALID_REQUEST, f"model {model!r} is not a valid Azure OpenAI deployment name", "model"
        )


# --- calls ------------------------------------------------------------------------------------


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
    async def open(
        cls, client: SdkClient, path: str, params: dict, method: str = "post", query: dict | None = None
    ) -> UpstreamStream:
        # The stream core bounds every read itself; aiohttp would re-arm a read timer per chunk.
        options: dict[str, Any] = {}
        if isinstance(client.timeout, httpx2.Timeout):  # a client with no SDK timeouts keeps its own
            options["timeout"] = _without_read_limit(client.timeout)
        if query:
            options["params"] = query
        if method == "get":
            return await client.get(path, cast_to=object, stream=True, stream_cls=cls, options=options)
        return await client.post(path, body=params, cast_to=object, stream=True, stream_cls=cls, options=options)

    @property
    def request_id(self) -> str | None:
        return self.response.headers.get("x-request-id")

    def __aiter__(self) -> AsyncIterator[dict]:
        # The stream's own generator: the SDK's __aiter__ wraps it in one more generator per chunk.
        return self._iterator

    async def __stream__(self) -> AsyncIterator[dict]:
        framer = SSEFramer()
        # Without a content coding (an event stream normally has none) the raw bytes are the body:
        # one generator and one decoder call less per piece than aiter_bytes; from AioHttpClient,
        # aiohttp's own reader of them, past the four generators of the layers between.
        coded = self.response.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")
        direct = None if coded or aiohttp_errors is None else self.response.extensions.get(AIOHTTP_BODY)
        if direct is not None and aiohttp_errors is not None:
            pieces, errors = direct.iter_any(), aiohttp_errors()
        else:
            pieces = self.response.aiter_bytes() if coded else self.response.aiter_raw()
            errors = contextlib.nullcontext()
        try:
            with errors:  # aiohttp's errors as httpx2's, as the SDK's adapter maps them
                async for piece in pieces:
                    if framer.done:
                        continue  # read to the end of the body, so the connection can be reused
                    payloads = framer.feed(piece)
                    for i, payload in enumerate(payloads, 1):
                        self.ready = len(payloads) - i
                        yield _decode(self.response, payload)
            if direct is not None:
                await self.response.aclose()  # the body is over: the connection goes back, as aiter_raw does
        except httpx2.ConnectTimeout as exc:  # read directly: first what _RemappingStream makes of it
            try:
                raise remapped(exc) from exc.__cause__
            except _TIMEOUT_ERRORS + _TRANSPORT_ERRORS as mapped:
                raise _sdk_error(self.response, mapped) from mapped
        except _TIMEOUT_ERRORS + _TRANSPORT_ERRORS as exc:
            raise _sdk_error(self.response, exc) from exc


def _sdk_error(response: httpx2.Response, exc: BaseException) -> openai.APIConnectionError:
    """A read error of httpx2's as the SDK reports it (a timeout, or a lost connection)."""
    if isinstance(exc, _TIMEOUT_ERRORS):
        return openai.APITimeoutError(request=response.request)
    return openai.APIConnectionError(request=response.request)


def _without_read_limit(timeout: httpx2.Timeout) -> httpx2.Timeout:
    """The client's timeouts without the read one (non-streamed calls keep it as their backstop)."""
    return httpx2.Timeout(connect=timeout.connect, read=None, write=timeout.write, pool=timeout.pool)


def _decode(response: httpx2.Response, payload: bytes) -> dict:
    try:
        data = json.loads(payload)
    except ValueError:  # not JSON, or not UTF-8
        raise UpstreamMalformed() from None
    if not isinstance(data, dict):
        raise UpstreamMalformed()
    if data.get("error") and "choices" not in data and "type" not in data:  # chat completions' error event
        error = data["error"]
        message = error.get("message") if isinstance(error, dict) else None
        raise openai.APIError(
            message if isinstance(message, str) else "An error occurred during streaming", response.request, body=error
        )
    return data


async def complete(client: SdkClient, path: str, params: dict) -> tuple[dict, str | None]:
    """One non-streamed call: the upstream's JSON object, and its ``x-request-id``."""
    response = await client.post(path, body=params, cast_to=httpx2.Response)
    try:
        body = json.loads(response.content)
    except ValueError:
        raise UpstreamMalformed("the model server sent a malformed answer") from None
    if not isinstance(body, dict):
        raise UpstreamMalformed("the model server sent a malformed answer")
    return body, response.headers.get("x-request-id")


# The SDK's HTTP library raises these while a body is read; the SDK maps them only inside its own
# decoder, so they are mapped the same way here.
_TIMEOUT_ERRORS = http_errors("TimeoutException")
_TRANSPORT_ERRORS = http_errors("TransportError")


# --- the Responses API's view of a client ---------------------------------------------------


def no_responses_api() -> ApiError:
    return ApiError(
        501,
        ErrorKind.RESPONSES_NOT_SUPPORTED,
        "the upstream has no Responses API (POST /responses answered 404); use /api/v1/chat/completions",
    )


class ResponsesClient:
    """An SDK client as the Responses API calls need it: for Azure OpenAI, the v1 API
    (``/openai/v1/responses``, no ``api-version``); an upstream 404 on creating a response that is not
    about the model means the upstream lacks the API (501)."""

    def __init__(self, client: SdkClient, azure: bool):
        self.client = client
        self.azure = azure

    @property
    def timeout(self) -> float | httpx2.Timeout | None:
        return self.client.timeout

    def _args(self, path: str, kwargs: dict) -> tuple[str, dict]:
        if not self.azure:
            return path, kwargs
        options = dict(kwargs.get("options") or {})
        options["params"] = {**(options.get("params") or {}), "api-version": openai.omit}
        return "/v1" + path, {**kwargs, "options": options}

    async def post(self, path: str, **kwargs: Any) -> Any:
        path_sent, kwargs = self._args(path, kwargs)
        try:
            return await self.client.post(path_sent, **kwargs)
        except openai.NotFoundError as exc:
            if path == "/responses" and upstream_field(exc, "code") not in _MODEL_MISSING:
                raise no_responses_api() from None
            raise

    async def get(self, path: str, **kwargs: Any) -> Any:
        path, kwargs = self._args(path, kwargs)
        return await self.client.get(path, **kwargs)

    async def delete(self, path: str, **kwargs: Any) -> Any:
        path, kwargs = self._args(path, kwargs)
        return await self.client.delete(path, **kwargs)

    async def close(self) -> None:
        pass  # the SDK client is closed by its owner


class RawStream(openai.AsyncStream[bytes]):
    """An upstream body passed on as it comes, bytes unchanged (a re-stream of a stored response)."""

    async def __stream__(self) -> AsyncIterator[bytes]:
        async for piece in self.response.aiter_bytes():
            yield piece
