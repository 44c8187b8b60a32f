"""The httpx transports: an answer with ``x-stream-id`` (a resumable stream of the app) reaches the
client as one uninterrupted body, resumed through ``GET …/streams/{id}`` after every cut; every other
answer passes through untouched. The rules are in resumption.py."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx

from .resumption import CUT, FORWARDED, Backoff, GiveUp, Resumption, StreamsUrl, resumable_stream_id


class ResumingTransport(httpx.BaseTransport):
    """``httpx.Client(transport=ResumingTransport())``: wraps ``transport`` (default: an
    ``httpx.HTTPTransport(**options)``, so ``verify=``, ``limits=``, ``proxy=``… go here)."""

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        backoff: Backoff | None = None,
        streams_url: StreamsUrl | None = None,
        forward_headers: tuple[str, ...] = FORWARDED,
        **options: Any,
    ):
        if transport is not None and options:
            raise TypeError("pass either a transport or the options of a new httpx.HTTPTransport")
        self._transport = transport or httpx.HTTPTransport(**options)
        self._backoff = backoff or Backoff()
        self._streams_url = streams_url
        self._forwarded = tuple(name.lower() for name in forward_headers)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._transport.handle_request(request)
        stream_id = resumable_stream_id(response)
        if stream_id is None or not isinstance(response.stream, httpx.SyncByteStream):
            return response
        state = Resumption(request, stream_id, self._backoff, self._streams_url, self._forwarded)
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_Spliced(self._transport, state, response.stream),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._transport.close()


class AsyncResumingTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=AsyncResumingTransport())``: as ResumingTransport, wrapping an
    ``httpx.AsyncHTTPTransport``."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        backoff: Backoff | None = None,
        streams_url: StreamsUrl | None = None,
        forward_headers: tuple[str, ...] = FORWARDED,
        **options: Any,
    ):
        if transport is not None and options:
            raise TypeError("pass either a transport or the options of a new httpx.AsyncHTTPTransport")
        self._transport = transport or httpx.AsyncHTTPTransport(**options)
        self._backoff = backoff or Backoff()
        self._streams_url = streams_url
        self._forwarded = tuple(name.lower() for name in forward_headers)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._transport.handle_async_request(request)
        stream_id = resumable_stream_id(response)
        if stream_id is None or not isinstance(response.stream, httpx.AsyncByteStream):
            return response
        state = Resumption(request, stream_id, self._backoff, self._streams_url, self._forwarded)
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_AsyncSpliced(self._transport, state, response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._transport.aclose()


class _Spliced(httpx.SyncByteStream):
    def __init__(self, transport: httpx.BaseTransport, state: Resumption, body: httpx.SyncByteStream):
        self._transport = transport
        self._state = state
        self._body: httpx.SyncByteStream | None = body
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        splice = self._state.splice
        while self._body is not None:
            error: Exception | None = None
            try:
                for data in self._body:
                    out = splice.feed(data)
                    if out:
                        yield out
                    if splice.held is not None:
                        break  # the reading ended (the app's own error event): resume
            except CUT as cut:
                error = cut
            finally:
                self._close_body()
            if splice.final or self._closed:
                return
            self._state.cut(error)
            try:
                self._body = self._reconnect()
            except GiveUp as reason:
                failure = self._state.failure(reason)
                if failure is not None:
                    raise failure from None
                yield splice.take_held()
                return

    def _reconnect(self) -> httpx.SyncByteStream:
        hint: float | None = None
        while True:
            time.sleep(self._state.next_delay(hint))
            if self._closed:
                raise GiveUp("the response was closed")
            try:
                response = self._transport.handle_request(self._state.request())
            except CUT as error:
                self._state.note(error)
                hint = None
                continue
            try:
                hint = self._state.judge(response)
            except GiveUp:
                response.close()
                raise
            if hint is None and isinstance(response.stream, httpx.SyncByteStream):
                return response.stream
            response.close()

    def _close_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            body.close()

    def close(self) -> None:
        self._closed = True
        self._close_body()


class _AsyncSpliced(httpx.AsyncByteStream):
    def __init__(self, transport: httpx.AsyncBaseTransport, state: Resumption, body: httpx.AsyncByteStream):
        self._transport = transport
        self._state = state
        self._body: httpx.AsyncByteStream | None = body
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        splice = self._state.splice
        while self._body is not None:
            error: Exception | None = None
            try:
                async for data in self._body:
                    out = splice.feed(data)
                    if out:
                        yield out
                    if splice.held is not None:
                        break  # the reading ended (the app's own error event): resume
            except CUT as cut:
                error = cut
            finally:
                await self._close_body()
            if splice.final or self._closed:
                return
            self._state.cut(error)
            try:
                self._body = await self._reconnect()
            except GiveUp as reason:
                failure = self._state.failure(reason)
                if failure is not None:
                    raise failure from None
                yield splice.take_held()
                return

    async def _reconnect(self) -> httpx.AsyncByteStream:
        hint: float | None = None
        while True:
            await anyio.sleep(self._state.next_delay(hint))
            if self._closed:
                raise GiveUp("the response was closed")
            try:
                response = await self._transport.handle_async_request(self._state.request())
            except CUT as error:
                self._state.note(error)
                hint = None
                continue
            try:
                hint = self._state.judge(response)
            except GiveUp:
                await response.aclose()
                raise
            if hint is None and isinstance(response.stream, httpx.AsyncByteStream):
                return response.stream
            await response.aclose()

    async def _close_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            with anyio.CancelScope(shield=True):
                await body.aclose()

    async def aclose(self) -> None:
        self._closed = True
        await self._close_body()
