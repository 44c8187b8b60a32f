"""The HTTP transport under the openai SDK's clients: the SDK's aiohttp client (``AioHttpClient``,
the ``openai[aiohttp]`` extra) with aiohttp's connection errors mapped back to what httpx2 raises
(the SDK's adapter maps every one of them to httpx2.ConnectTimeout, so a refused connection would
be taken for a timeout), the body's aiohttp reader handed to ``UpstreamStream`` (``AIOHTTP_BODY``),
and request URLs parsed once per path (``PreparedUrls``, ``AioHttpClient._merge_url``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx2
import openai

try:  # how the SDK's aiohttp adapter maps aiohttp's errors to httpx2's (used when a body is read directly)
    from openai._vendor.httpx_aiohttp.transport import map_aiohttp_exceptions as aiohttp_errors
except ImportError:  # another SDK layout: bodies are read through httpx2, as before
    aiohttp_errors = None


class _RemappingTransport(httpx2.AsyncBaseTransport):
    """Wraps the SDK's aiohttp transport: its ConnectTimeout for errors that are no timeout becomes
    ConnectError (could not connect) or ReadError/RemoteProtocolError (connection lost)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except httpx2.ConnectTimeout as exc:
            raise remapped(exc) from exc.__cause__
        # The body as aiohttp reads it, for UpstreamStream: one iterator per piece instead of four
        # generators (the adapter's, ours below, httpx2's bound stream and its aiter_raw).
        body = getattr(response.stream, "_aiohttp_response", None)
        if aiohttp_errors is not None and isinstance(body, aiohttp.ClientResponse):
            response.extensions[AIOHTTP_BODY] = body.content
        response.stream = _RemappingStream(response.stream)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _RemappingStream(httpx2.AsyncByteStream):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except httpx2.ConnectTimeout as exc:
            raise remapped(exc) from exc.__cause__

    async def aclose(self) -> None:
        await self._inner.aclose()


# The extension of a response from AioHttpClient that holds aiohttp's reader of its body.
AIOHTTP_BODY = "chatstream.aiohttp_body"


def remapped(exc: httpx2.ConnectTimeout) -> Exception:
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
    remapped (``_RemappingTransport``), and the URLs of its requests parsed once (``_merge_url``)."""

    def _init_transport(self, *args, **kwargs):
        return _RemappingTransport(super()._init_transport(*args, **kwargs))

    def _init_proxy_transport(self, *args, **kwargs):
        return _RemappingTransport(super()._init_proxy_transport(*args, **kwargs))

    def _merge_url(self, url: httpx2.URL | str) -> httpx2.URL:
        # The SDK hands every request's URL over as a string, parsed again here each time: the same
        # few strings, so the parsed (immutable) URL is kept, for as long as the base URL stays.
        if not isinstance(url, str):
            return super()._merge_url(url)
        cache = self.__dict__.setdefault("_chatstream_urls", {})
        hit = cache.get(url)
        if hit is not None and hit[0] is self._base_url:
            return hit[1]
        merged = super()._merge_url(url)
        if len(cache) < URL_CACHE_SIZE:
            cache[url] = (self._base_url, merged)
        return merged


# Distinct URLs a client keeps parsed: a few per API and deployment; beyond this, parsed every time.
URL_CACHE_SIZE = 256


class PreparedUrls:
    """The SDK client's ``_prepare_url`` (two URL parses per request: the path, then the join with
    the base URL or the Azure endpoint) once per path, for as long as the base URL stays; the URL
    objects are immutable. The paths are the API's (for Azure, with the deployment)."""

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
