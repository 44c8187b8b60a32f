"""POST /api/chat over HTTP: read and validate the request, start the relay, and choose the
response by the status rule.

Status rule: the response headers wait for the first delta, or for the first heartbeat, whichever
comes first. Until then a failure is a real HTTP status with a JSON error body; after it, the final
``error`` event. Once the headers are out without content, ``: keep-alive`` comments go out every
``HEARTBEAT_SECONDS`` until the first delta."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import anyio
import openai
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import contract, sse
from .errors import ApiError
from .relay import StreamRecord, relay
from .settings import Settings

log = logging.getLogger("chatstream")

SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its event generator, even when the caller hung up
    while the generator was parked at ``yield`` (Starlette then only cancels the sending task)."""
    media_type = "text/event-stream; charset=utf-8"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status,
                        headers={"Cache-Control": "no-store", **error.headers})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` (the rest is not read)."""
    too_large = ApiError(413, "request_too_large", f"the body exceeds {limit} bytes")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _finish(record: StreamRecord) -> None:
    log.info(json.dumps(record.as_log(), ensure_ascii=False))


class ChatEndpoint:
    def __init__(self, settings: Settings, client: openai.AsyncOpenAI):
        self.settings = settings
        self.client = client

    async def __call__(self, request: Request) -> Response:
        record = StreamRecord(model=self.settings.openai_model)
        try:
            contract.require_json_content_type(request.headers.get("content-type"))
            raw = await read_body(request, self.settings.max_body_bytes)
            chat = contract.validate_chat_request(contract.parse_json_body(raw))
            if not self.settings.upstream_configured:
                raise ApiError(503, "not_configured",
                               "no model upstream is configured: set OPENAI_API_KEY or OPENAI_BASE_URL")
        except ApiError as error:
            record.status, record.error = error.status, error.type
            _finish(record)
            return error_response(error)
        record.model = chat.model or self.settings.openai_model

        events = self._guarded(relay(self.client, chat, self.settings, record), record)
        first = asyncio.ensure_future(anext(events))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({first, gone}, timeout=self.settings.heartbeat,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not first.done():
            if gone.done():  # the caller left while we waited for the first token
                record.status = 499  # nginx's "client closed request"; nobody receives it
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                await events.aclose()
                return Response(status_code=499)
            return EventStreamResponse(self._body(first, events), headers=SSE_HEADERS)
        event = first.result()
        if isinstance(event, sse.Failed):
            record.status = event.error.status
            await events.aclose()
            return error_response(event.error)
        return EventStreamResponse(self._body(first, events), headers=SSE_HEADERS)

    async def _body(self, first: asyncio.Future, events: AsyncIterator[sse.Event]) -> AsyncIterator[bytes]:
        try:
            if not first.done():
                yield sse.KEEP_ALIVE  # the headers go out now; say so to proxies at once
                while not first.done():
                    await asyncio.wait({first}, timeout=self.settings.heartbeat)
                    if not first.done():
                        yield sse.KEEP_ALIVE
            yield sse.encode(first.result())
            async for event in events:
                yield sse.encode(event)
        finally:
            if not first.done():
                first.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(first, return_exceptions=True)
            with anyio.CancelScope(shield=True):
                await events.aclose()

    @staticmethod
    async def _guarded(events: AsyncIterator[sse.Event], record: StreamRecord) -> AsyncIterator[sse.Event]:
        """Ends every stream with exactly one Done or Failed, even on a bug of ours, and writes the
        one log line per request when the stream is over."""
        try:
            try:
                async for event in events:
                    yield event
                    if not isinstance(event, sse.Delta):
                        return
            except Exception:
                log.exception("chat stream failed (model=%s)", record.model)
                record.error = "internal_error"
                yield sse.Failed(ApiError(500, "internal_error", "the stream failed unexpectedly", retryable=True))
        finally:
            await events.aclose()
            _finish(record)
