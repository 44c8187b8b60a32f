"""The clients of the upstreams: one openai SDK client per entry (OpenAI and compatible servers, or
Azure OpenAI with a key or Entra ID), their streams read as raw chunks, their whole answers, and the
Responses API's view of a client (``ResponsesClient``).

The openai SDK does the request: retries (honouring ``retry-after``), timeouts, typed errors, Azure
URLs and Entra ID tokens. It is given our HTTP client (transport.py: aiohttp underneath) through
its public ``http_client`` parameter. Stream chunks are decoded here from the body's raw bytes (as UTF-8,
by the json module) instead of the SDK's typed models (building a ChatCompletionChunk costs ~30x more),
and raw dicts keep every field the upstream sent (Azure's filter results, new fields) for
pass-through.

Azure OpenAI is called on its GA v1 API (``{endpoint}/openai/v1``, OpenAI's paths: the plain client,
the key or Entra ID token as the bearer) unless an entry names a dated ``api_version`` (the SDK's
Azure client: ``/openai/deployments/{deployment}/...?api-version=``, the key in ``api-key``).

Private parts of the SDK are used where nothing public serves (``Reused``: what the SDK would
rebuild for every request, kept; requirements.txt pins the SDK's minor version, and
tests/unit/test_clients.py fails if any changes shape and checks every request against the SDK's own)."""

from __future__ import annotations

import functools
import json
from _json import scanstring  # json.decoder's, without the module's attribute typeshed does not declare
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

import httpx2
import openai
from openai._constants import RAW_RESPONSE_HEADER  # private: the header that asks for the SDK's response wrapper
from openai._models import FinalRequestOptions  # private: see Reused
from openai._utils._json import _CustomEncoder  # private: the SDK's JSON body encoder (openapi_dumps)

from ..errors import ApiError, ErrorKind, UpstreamMalformed, error_field, http_errors, register_secret
from ..settings import Settings
from ..sse import Parser
from .config import Entry
from .transport import RAW_ERRORS, URL_CACHE_SIZE, HttpClient, KeptHeaders, body_reader, mapped

# The SDK will not start without a key: an entry that takes none (a vLLM or Ollama server in a
# private network) gives it this one, which no request carries (its client omits Authorization).
NO_KEY = "not-needed"
ENTRA_SCOPE = "https://cognitiveservices.azure.com/.default"
# What the SDK's options carry as their idempotency key when the client has no header to send it in.
UNSENT_IDEMPOTENCY_KEY = "unsent"
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


class Reused:
    """What the SDK client builds anew for every request and can keep, as a mixin before the SDK's
    class (both are private to the SDK: no public hook builds them):

    - ``_prepare_url``: the request URL (two URL parses: the path, then the join with the base URL
      or the Azure endpoint), kept per path for as long as the base URL stays;
    - ``post``'s request options (a pydantic model whose defaults are deep-copied each time, about
      15% of the SDK's instructions per request): one per path and options is kept, and each call
      gets a copy with its own body, which the SDK's ``request`` copies again before its retries (it
      replaces, never changes, what the copies share). Anything else (files, raw content, options
      that cannot be compared) goes through the SDK's own ``post``.

    - ``_build_headers``: the request's headers (the client's, the auth ones, the request's own,
      the retry count and read timeout: ~15 dict entries merged, then parsed into httpx2's Headers),
      kept per set of those inputs, which are the same for every request of a client until a key or
      token changes; each request gets a copy (the SDK changes its own). ~8% of the CPU a request
      takes before its first delta (tools/bench/burst.py). A client with an idempotency header (a
      new value per request) builds them each time.
    - ``_build_request``: the request of a JSON body (no query, files or cookies), kept per path and
      set of header inputs (as above) and given each time with its own body (``HttpClient.with_body``):
      the SDK's merging of the request's parts, then httpx2's of the client's, are done once. ~6% of
      the CPU a short stream takes in-process.

    - ``_idempotency_key``: a new uuid4 per request for the client's idempotency header, which the
      SDK's OpenAI and Azure clients do not have (nothing sends the key): one unsent constant then;
    - ``_process_response`` of a stream of ours (``UpstreamStream``): the stream itself, as the
      SDK's ``AsyncAPIResponse.parse`` makes it (without the response wrapper, the type-argument
      lookup and two header searches around it); a raw response or a post-parser goes the SDK's way.
      With the idempotency key: ~4% of the CPU a request takes before its first delta.
    - the layers the SDK's clients put around preparing and sending a request for what none of ours
      use (a provider runtime, a workload identity, an API key provider: ``openai/lib/_client_auth.py``,
      each a call and an import per request), skipped when the client has none: the request goes
      to the HTTP client as the SDK's base client sends it (``_send_request``), with no custom auth,
      no request hook and the options as they are; an Azure client prepares its options its own way.
      ~4% of the CPU a stream takes in-process (make bench-quick).

    And ``_validate_headers`` lets a client omit ``Authorization`` in its own default headers (an
    entry without a key: make_client), where the SDK accepts the omission only per request. URL
    objects are immutable."""

    def _build_headers(self, options: FinalRequestOptions, *, retries_taken: int = 0) -> httpx2.Headers:
        build = super()._build_headers  # type: ignore[misc] - the SDK client class after this mixin
        if self._idempotency_header:  # type: ignore[attr-defined] - the SDK client's
            return build(options, retries_taken=retries_taken)
        key = self._headers_key(options, retries_taken)
        cache = self.__dict__.setdefault("_chatstream_headers", {})
        try:
            kept = cache.get(key)
        except TypeError:  # a value that cannot be compared
            return build(options, retries_taken=retries_taken)
        if kept is None:
            kept = build(options, retries_taken=retries_taken)
            if len(cache) >= URL_CACHE_SIZE:  # a key or token changed many times: the old ones go
                cache.clear()
            cache[key] = KeptHeaders(kept)
            return kept
        return kept.copied()

    def _headers_key(self, options: FinalRequestOptions, retries_taken: int) -> tuple:
        """What the SDK builds a request's headers of (without an idempotency header): the same for
        every request of a client until a key or token changes."""
        timeout = self.timeout if isinstance(options.timeout, openai.NotGiven) else options.timeout  # type: ignore[attr-defined]
        if isinstance(timeout, httpx2.Timeout):
            timeout = ("timeout", timeout.connect, timeout.read, timeout.write, timeout.pool)
        return (
            _pairs(self._auth_headers(options.security)),  # type: ignore[attr-defined] - the SDK client's
            _pairs(self.default_headers),  # type: ignore[attr-defined]
            _pairs(options.headers or {}),
            retries_taken,
            timeout,
        )

    def _build_request(self, options: FinalRequestOptions, *, retries_taken: int = 0) -> httpx2.Request:
        build = super()._build_request  # type: ignore[misc] - the SDK client class after this mixin
        body, client = options.json_data, self._client  # type: ignore[attr-defined] - the SDK client's
        if (
            type(body) is not dict
            or options.method != "post"
            or options.extra_json is not None
            or options.files is not None
            or options.content is not None
            or options.params
            or self._idempotency_header  # type: ignore[attr-defined]
            or not isinstance(client, HttpClient)
            or client.cookies
            or self.default_query  # type: ignore[attr-defined]
            or self._auth_query(options.security)  # type: ignore[attr-defined]
        ):
            return build(options, retries_taken=retries_taken)
        cache = self.__dict__.setdefault("_chatstream_requests", {})
        base = self._base_url  # type: ignore[attr-defined]
        try:
            hit = cache.get(key := (options.url, self._headers_key(options, retries_taken)))
        except TypeError:  # a value that cannot be compared
            return build(options, retries_taken=retries_taken)
        if hit is not None and hit[0] is base:
            return client.with_body(hit[1], _dumps(body).encode())
        request = build(options, retries_taken=retries_taken)
        kept = client.keepable(request)
        if kept is not None:
            if len(cache) >= URL_CACHE_SIZE:  # a key or token changed many times: the old ones go
                cache.clear()
            cache[key] = (base, kept)
        return request

    def _plain(self) -> bool:
        """Whether the client has none of the SDK's auth layers (the request is sent as it is built)."""
        return self._provider_runtime is None and self._workload_identity_auth is None  # type: ignore[attr-defined]

    @property
    def custom_auth(self) -> httpx2.Auth | None:
        return None if self._plain() else super().custom_auth  # type: ignore[misc] - the SDK client class after this mixin

    async def _prepare_options(self, options: FinalRequestOptions) -> FinalRequestOptions:
        if self._plain() and self._api_key_provider is None and not isinstance(self, openai.AsyncAzureOpenAI):  # type: ignore[attr-defined]
            return options
        return await super()._prepare_options(options)  # type: ignore[misc] - the SDK client class after this mixin

    async def _prepare_request(self, request: httpx2.Request) -> None:
        if not self._plain():
            await super()._prepare_request(request)  # type: ignore[misc] - the SDK client class after this mixin

    async def _send_request(self, request: httpx2.Request, *, stream: bool, **kwargs: Any) -> httpx2.Response:
        if self._plain():
            return await self._client.send(request, stream=stream, **kwargs)  # type: ignore[attr-defined]
        return await super()._send_request(request, stream=stream, **kwargs)  # type: ignore[misc] - the SDK client class after this mixin

    def _prepare_url(self, url: str) -> httpx2.URL:
        cache = self.__dict__.setdefault("_chatstream_urls", {})
        hit = cache.get(url)
        base = self._base_url  # type: ignore[attr-defined] - a mixin: the SDK client class has it
        if hit is not None and hit[0] is base:
            return hit[1]
        prepared = super()._prepare_url(url)  # type: ignore[misc] - the SDK client class after this mixin
        if len(cache) < URL_CACHE_SIZE:
            cache[url] = (base, prepared)
        return prepared

    def _validate_headers(self, headers: Any, custom_headers: Any) -> None:
        if not isinstance(self._custom_headers.get("Authorization"), openai.Omit):  # type: ignore[attr-defined]
            super()._validate_headers(headers, custom_headers)  # type: ignore[misc] - the SDK client class after this mixin

    def _idempotency_key(self) -> str:
        if self._idempotency_header:  # type: ignore[attr-defined] - the SDK client's
            return super()._idempotency_key()  # type: ignore[misc] - the SDK client class after this mixin
        return UNSENT_IDEMPOTENCY_KEY

    async def _process_response(
        self,
        *,
        cast_to: Any,
        options: FinalRequestOptions,
        response: httpx2.Response,
        stream: bool,
        stream_cls: Any,
        retries_taken: int = 0,
    ) -> Any:
        if (
            stream
            and isinstance(stream_cls, type)
            and issubclass(stream_cls, UpstreamStream)
            and isinstance(options.post_parser, openai.NotGiven)
            and RAW_RESPONSE_HEADER not in response.request.headers
        ):
            return stream_cls(cast_to=dict, response=response, client=self, options=options)
        return await super()._process_response(  # type: ignore[misc] - the SDK client class after this mixin
            cast_to=cast_to,
            options=options,
            response=response,
            stream=stream,
            stream_cls=stream_cls,
            retries_taken=retries_taken,
        )

    async def post(
        self,
        path: str,
        *,
        cast_to: Any,
        body: Any = None,
        content: Any = None,
        files: Any = None,
        options: Mapping[str, Any] = {},  # the SDK's signature; never changed here
        stream: bool = False,
        stream_cls: Any = None,
    ) -> Any:
        key = _frozen(path, options) if content is None and files is None and isinstance(body, dict | None) else None
        cache = self.__dict__.setdefault("_chatstream_options", {})
        kept = cache.get(key) if key is not None else None
        if kept is None:
            if key is None or len(cache) >= URL_CACHE_SIZE:
                return await super().post(  # type: ignore[misc] - the SDK client class after this mixin
                    path,
                    cast_to=cast_to,
                    body=body,
                    content=content,
                    files=files,
                    options=options,
                    stream=stream,
                    stream_cls=stream_cls,
                )
            kept = cache[key] = FinalRequestOptions.construct(
                method="post", url=path, json_data=None, content=None, files=None, **options
            )
        request = self.request  # type: ignore[attr-defined] - the SDK client's
        return await request(cast_to, kept.model_copy(update={"json_data": body}), stream=stream, stream_cls=stream_cls)


# The SDK's request body encoder (openapi_dumps's, private: pinned with the SDK), built once: that
# builds one per request.
_dumps = _CustomEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode

_OMITTED = ("omitted",)  # an openai.Omit in a key (each is its own object; they all mean the same)


def _pairs(headers: Mapping[str, Any]) -> tuple:
    """Headers as part of a key, in order (the order they are sent in). A list made inline, not a
    generator resumed per header (~16 per request)."""
    return tuple([(name, _OMITTED if isinstance(value, openai.Omit) else value) for name, value in headers.items()])


def _frozen(path: str, options: Mapping[str, Any]) -> tuple | None:
    """``options`` as a key of the kept request options, or None if a value cannot be compared. A
    value that is not hashable (an httpx2.Timeout) counts by identity: the kept options hold it, so
    it stays alive (UpstreamStream.open passes the same one each time)."""
    items: list = [path]
    for name, value in options.items():
        if isinstance(value, Mapping):
            value = tuple(value.items())
        try:
            hash(value)
        except TypeError:
            if isinstance(value, tuple):
                return None  # a list in a header or parameter
            value = ("id", id(value))
        items.append((name, value))
    return tuple(items)


# The SDK's classes with Reused, under the SDK's names (they go into the User-Agent header).
_AsyncOpenAI = type("AsyncOpenAI", (Reused, openai.AsyncOpenAI), {"__module__": __name__})
_AsyncAzureOpenAI = type("AsyncAzureOpenAI", (Reused, openai.AsyncAzureOpenAI), {"__module__": __name__})


def make_client(
    entry: Entry, settings: Settings, max_retries: int, token_provider: TokenProvider | None = None
) -> SdkClient:
    """The SDK client for one upstream entry (``UPSTREAMS``, or the single upstream): its URL and key,
    the app's time limits, and ``max_retries`` (0 when the pool has other entries to move to). An
    Azure entry calls the v1 API unless it names a dated ``api_version``, and without a key uses
    ``token_provider`` (Entra ID); any other entry without a key sends no Authorization header."""
    # The relay enforces first-token, idle and total limits itself; the SDK's read timeout is only
    # a backstop for non-streamed calls, so it sits above both.
    read = max(settings.first_token_timeout, settings.idle_timeout) + 5
    common: dict[str, Any] = dict(
        max_retries=max_retries,
        http_client=HttpClient(),
        timeout=openai.Timeout(read, connect=settings.upstream_connect_timeout, write=30.0, pool=30.0),
    )
    key = entry.api_key.get_secret_value() if entry.api_key is not None else None
    register_secret(key)
    if entry.kind == "azure" and not entry.dated:
        # Azure's GA v1 API: OpenAI's paths under /openai/v1 (the deployment as the model), no
        # api-version, the plain client; the key, or an Entra ID token, goes as the bearer token.
        auth = key if key is not None else token_provider or entra_token_provider()
        return _AsyncOpenAI(api_key=auth, base_url=entry.url + "/openai/v1", **common)
    if entry.kind == "azure":  # a dated API version: /openai/deployments/{model}/...?api-version=
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
    if key is None:  # the SDK's own way to send no Authorization header (Reused._validate_headers)
        common["default_headers"] = {"Authorization": openai.omit}
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


# --- calls ------------------------------------------------------------------------------------


class UpstreamStream(openai.AsyncStream[dict]):
    """One streamed call (chat completions or responses): ``async for data in stream`` yields each
    ``data:`` payload as a dict until ``[DONE]`` (the body is still read to its end, so that the
    connection is reused), or the end of the body; ``close()`` drops the connection (stopping the
    generation).

    The request goes through the SDK's documented low-level ``client.post``, with this class as its
    ``stream_cls``; ``create()`` would first run its type-driven transform over the parameters, about
    1 ms per request here for plain dicts that need none. The stream is the SDK's with its public
    iteration (``__aiter__``, ``__anext__``) reading the public ``response`` here, from the raw bytes
    (from our transport, aiohttp's read of its body itself: the layers between cost every piece)."""

    ready = 0  # chunks already read from the upstream and not yet handed out (stream.py batches them)
    # A failure reading the stream, as its reader explains it (failover.PeekedStream: the ApiError,
    # the entry told); None: raised as it is. Here, not in a generator around this one: that cost
    # every chunk.
    failure: Callable[[Exception], Exception] | None = None

    def __init__(self, *, response: httpx2.Response, **sdk: Any) -> None:
        super().__init__(response=response, **sdk)
        self._chunks = self._read()

    @classmethod
    async def open(
        cls, client: SdkClient, path: str, params: dict, method: str = "post", query: dict | None = None
    ) -> UpstreamStream:
        # The stream core bounds every read itself; aiohttp would re-arm a read timer per chunk.
        options: dict[str, Any] = {}
        timeout = client.timeout
        if isinstance(timeout, httpx2.Timeout):  # a client with no SDK timeouts keeps its own
            options["timeout"] = _without_read_limit(timeout.connect, timeout.write, timeout.pool)
        if query:
            options["params"] = query
        if method == "get":
            return await client.get(path, cast_to=object, stream=True, stream_cls=cls, options=options)
        return await client.post(path, body=params, cast_to=object, stream=True, stream_cls=cls, options=options)

    @property
    def request_id(self) -> str | None:
        return self.response.headers.get("x-request-id")

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._chunks

    async def __anext__(self) -> dict:
        return await anext(self._chunks)

    async def _read(self) -> AsyncIterator[dict]:
        response = self.response
        framer = Parser()
        # Without a content coding (an event stream normally has none) the raw bytes are the body.
        coded = response.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")
        direct = None if coded else body_reader(response)
        if direct is not None:
            read = direct.read  # aiohttp's own read (a coroutine fewer per piece): its errors mapped below
        else:
            pieces = aiter(response.aiter_bytes() if coded else response.aiter_raw())
            read = functools.partial(anext, pieces, b"")  # (neither yields an empty piece)
        skeleton: _Skeleton | None = None  # the usual delta's text, read for less (made at most TRIES times)
        tries = _Skeleton.TRIES
        try:
            try:
                while piece := await read():  # b"" at the body's end
                    if framer.done:
                        continue  # read to the end of the body, so the connection can be reused
                    payloads = framer.feed(piece)
                    left = len(payloads)
                    for payload in payloads:
                        left -= 1
                        self.ready = left  # (the usual read brings one event: nothing else in hand)
                        try:
                            text = payload.decode("utf-8", "surrogatepass")
                        except UnicodeDecodeError:
                            raise UpstreamMalformed() from None
                        data = skeleton.read(text) if skeleton is not None else None
                        if data is None:
                            data = _decode(response, text)
                            if tries and (made := _Skeleton.of(text, data)) is not None:
                                skeleton, tries = made, tries - 1
                        yield data
                if direct is not None:
                    await response.aclose()  # the body is over: the connection goes back, as aiter_raw does
            except _READ_ERRORS as exc:
                raise _sdk_error(response, exc) from exc
            except RAW_ERRORS as exc:  # Body.read's
                raise _sdk_error(response, mapped(exc)) from exc
        except Exception as exc:
            if self.failure is None:
                raise
            raise self.failure(exc) from None


def _sdk_error(response: httpx2.Response, exc: BaseException) -> openai.APIConnectionError:
    """A read error of httpx2's as the SDK reports it (a timeout, or a lost connection)."""
    if isinstance(exc, _TIMEOUT_ERRORS):
        return openai.APITimeoutError(request=response.request)
    return openai.APIConnectionError(request=response.request)


@functools.cache
def _without_read_limit(connect: float | None, write: float | None, pool: float | None) -> httpx2.Timeout:
    """The client's timeouts without the read one (non-streamed calls keep it as their backstop)."""
    return httpx2.Timeout(connect=connect, read=None, write=write, pool=pool)


# An event stream is UTF-8 whatever it says (WHATWG HTML, "Server-sent events": always decoded as
# UTF-8; a byte order mark counts only at the stream's start, before any data line): decoded as such,
# not through json.loads's guess among UTF-8/16/32, about 1 µs a chunk (make bench-quick). The usual
# payload, one JSON text with nothing around it, is read by raw_decode alone (without decode's two
# whitespace matches around it, another ~0.4 µs); anything else by decode, as json.loads would.
_json = json.JSONDecoder()


def _decode(response: httpx2.Response, text: str) -> dict:
    try:
        try:
            data, end = _json.raw_decode(text)
            if end != len(text):  # whitespace after it (or something else: decode says what)
                data = _json.decode(text)
        except ValueError:  # whitespace before it, or not JSON: decode's answer
            data = _json.decode(text)
    except ValueError:  # not JSON
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


_scan = scanstring  # json's: one JSON string at an index (after its opening quote): (its value, its end)
_CONTENT = '"content":"'
_PADDING = '"obfuscation":"'  # OpenAI's: a random string in every chunk with choices, after them


class _Skeleton:
    """A chunk's text around its strings that change from delta to delta, for the chunks of one
    stream that differ from it only there: choice 0's content (the usual delta repeats every other
    field) and, when it has one, OpenAI's ``obfuscation``. A payload that is the skeleton's text
    with other JSON strings in those places is read as the skeleton's chunk with those values,
    without decoding the rest again: what json.loads makes of it (the same keys in the same order,
    equal values; the values besides those are the skeleton's chunk's own objects, read-only as
    every upstream chunk is), for about a fifth of the instructions. Made from a chunk whose one
    choice's delta is its content, a string, and whose text holds ``"content":`` once (so that it is
    that key, written compactly) and ``"obfuscation":`` at most once; anything else is decoded whole."""

    TRIES = 4  # skeletons a stream makes at most (the role chunk's, then the usual delta's, say)
    __slots__ = ("choice", "data", "delta", "head", "mid", "tail", "varying")

    def __init__(self, data: dict, head: str, mid: str, tail: str) -> None:
        self.data = data
        self.choice = data["choices"][0]
        self.delta = self.choice["delta"]
        self.head, self.mid, self.tail = head, mid, tail
        self.varying = bool(mid)  # the obfuscation is a second string: mid is the text between them

    @staticmethod
    def of(text: str, data: dict) -> _Skeleton | None:
        choices = data.get("choices")
        if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
            return None
        delta = choices[0].get("delta")
        if type(delta) is not dict or len(delta) != 1 or type(delta.get("content")) is not str:
            return None  # (a role chunk's skeleton would fit no delta)
        if text.count('"content":') != 1:
            return None
        start = text.find(_CONTENT) + len(_CONTENT)
        if start < len(_CONTENT):  # ("content": with a space after it)
            return None
        content, end = _scan(text, start)
        if content != delta["content"]:
            return None
        if type(data.get("obfuscation")) is not str or text.count('"obfuscation":') != 1:
            return _Skeleton(data, text[:start], "", text[end:])
        at = text.find(_PADDING, end) + len(_PADDING)
        if at < len(_PADDING):  # before the content, or not compact
            return None
        padding, after = _scan(text, at)
        if padding != data["obfuscation"]:
            return None
        return _Skeleton(data, text[:start], text[end:at], text[after:])

    def read(self, text: str) -> dict | None:
        """``text`` as a chunk, when it is this skeleton with other strings in its places; else None."""
        head = self.head
        if not text.startswith(head):
            return None
        padding = ""
        try:
            content, end = _scan(text, len(head))
            if self.varying:
                if not text.startswith(self.mid, end):
                    return None
                padding, end = _scan(text, end + len(self.mid))
        except ValueError:  # not a string there: decoded whole (which says what is wrong)
            return None
        tail = self.tail
        if len(text) - end != len(tail) or not text.endswith(tail):
            return None
        data = {**self.data, "choices": [{**self.choice, "delta": {**self.delta, "content": content}}]}
        if self.varying:
            data["obfuscation"] = padding  # (in its place: the key is there)
        return data


async def complete(client: SdkClient, path: str, params: dict) -> tuple[dict, str | None]:
    """One non-streamed call: the upstream's JSON object, and its ``x-request-id``."""
    response = await client.post(path, body=params, cast_to=httpx2.Response)
    request_id = response.headers.get("x-request-id")
    # An answer can be MBs: its bytes, their text and the parsed object are each as big, so each is
    # dropped as soon as the next one is made (two of them at a time, not three).
    raw = response.content
    del response
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # what json.loads does with bytes
        del raw
        body = json.loads(text)
    except ValueError:  # not JSON, or not in its encoding
        raise UpstreamMalformed("the model server sent a malformed answer") from None
    if not isinstance(body, dict):
        raise UpstreamMalformed("the model server sent a malformed answer")
    return body, request_id


# The SDK's HTTP library raises these while a body is read; the SDK maps them only inside its own
# decoder, so they are mapped the same way here.
_TIMEOUT_ERRORS = http_errors("TimeoutException")
_READ_ERRORS = _TIMEOUT_ERRORS + http_errors("TransportError")


# --- the Responses API's view of a client ---------------------------------------------------


class ResponsesClient:
    """An SDK client as the Responses API calls need it: an Azure client on a dated API version
    (``dated``) calls the v1 API (``/openai/v1/responses``, no ``api-version``), which has it; an
    upstream 404 on creating a response that is not about the model means the upstream lacks the
    API (501)."""

    def __init__(self, client: SdkClient, dated: bool):
        self.client = client
        self.dated = dated

    @property
    def timeout(self) -> float | httpx2.Timeout | None:
        return self.client.timeout

    def _args(self, path: str, kwargs: dict) -> tuple[str, dict]:
        if not self.dated:
            return path, kwargs
        options = dict(kwargs.get("options") or {})
        options["params"] = {**(options.get("params") or {}), "api-version": openai.omit}
        return "/v1" + path, {**kwargs, "options": options}

    async def post(self, path: str, **kwargs: Any) -> Any:
        path_sent, kwargs = self._args(path, kwargs)
        try:
            return await self.client.post(path_sent, **kwargs)
        except openai.NotFoundError as exc:
            if path == "/responses" and error_field(exc.body, "code") not in _MODEL_MISSING:
                raise ApiError(
                    501,
                    ErrorKind.RESPONSES_NOT_SUPPORTED,
                    "the upstream has no Responses API (POST /responses answered 404); use /api/v1/chat/completions",
                ) from None
            raise

    async def get(self, path: str, **kwargs: Any) -> Any:
        path, kwargs = self._args(path, kwargs)
        return await self.client.get(path, **kwargs)

    async def delete(self, path: str, **kwargs: Any) -> Any:
        path, kwargs = self._args(path, kwargs)
        return await self.client.delete(path, **kwargs)

    async def close(self) -> None:
        pass  # the SDK client is closed by its owner
