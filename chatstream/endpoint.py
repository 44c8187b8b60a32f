"""The two endpoints over HTTP: read and check the request, run the pipeline's before-steps, start
the shared relay, and choose the response by the status rule.

Status rule: the response headers wait for the first delta, or for the first heartbeat, whichever
comes first. Until then a failure is a real HTTP status with a JSON error body; after it, the final
error event. Once the headers are out without content, ``: keep-alive`` comments go out every
``HEARTBEAT_SECONDS`` until the first delta. A caller that hangs up at any point closes the upstream.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

import anyio
import openai
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import contract, errors, openai_contract, sse, telemetry
from .errors import ApiError
from .pipeline import CallRequest, ModerationStop, Pipeline, Rejection, StepFailed
from .relay import Chunk, Event, Failed, StreamRecord, relay
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


class Endpoint:
    """One endpoint: ``parse`` turns the body into a CallRequest; ``encoder`` and ``error_response``
    speak the endpoint's wire format. Everything else (limits, pipeline, relay, status rule) is
    shared."""

    name = "chat"

    def __init__(self, settings: Settings, client: openai.AsyncOpenAI, pipeline: Pipeline | None = None):
        self.settings = settings
        self.client = client
        self.pipeline = pipeline or Pipeline()

    # -- what differs between endpoints
    def parse(self, data: object) -> CallRequest:
        raise NotImplementedError

    def encoder(self, call: CallRequest) -> Callable[[Event], bytes | None]:
        raise NotImplementedError

    def error_response(self, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status,
                            headers={"Cache-Control": "no-store", **error.headers})

    def status_of(self, error: ApiError) -> int:
        """The HTTP status this endpoint answers ``error`` with."""
        return error.status

    # -- shared
    async def __call__(self, request: Request) -> Response:
        record = StreamRecord(model=self.settings.default_model, endpoint=self.name)
        telemetry.begin(record)
        try:
            contract.require_json_content_type(request.headers.get("content-type"))
            raw = await read_body(request, self.settings.max_body_bytes)
            call = self.parse(contract.parse_json_body(raw))
            record.model = call.params["model"]
            if not self.settings.upstream_configured:
                raise ApiError(503, "not_configured",
                               "no model upstream is configured: set OPENAI_API_KEY, OPENAI_BASE_URL or "
                               "AZURE_OPENAI_ENDPOINT")
            await self.pipeline.run_before(call)
            record.model = call.params["model"]
            self._check_model(record.model)  # after the before-steps: they may choose the model
        except (Rejection, StepFailed) as exc:
            return self._refuse(record, exc.error)
        except ApiError as error:
            return self._refuse(record, error)
        except Exception:  # a bug of ours: still a JSON answer, a log line, an ended span
            log.exception("chat request failed before the stream (model=%s)", record.model)
            return self._refuse(record, ApiError(500, "internal_error", "the request failed unexpectedly"))
        if not call.params.get("stream"):
            return await self._complete(request, call, record)

        encode = self.encoder(call)
        events = self._guarded(relay(self.client, call.params, self.settings, record, self.pipeline), record)
        first = asyncio.ensure_future(anext(events))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({first, gone}, timeout=self.settings.heartbeat, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not first.done():
            if gone.done():  # the caller left while we waited for the first token
                record.status = 499  # nginx's "client closed request"; nobody receives it
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                await events.aclose()
                return Response(status_code=499)
        elif isinstance(first.result(), Failed):
            record.status = self.status_of(first.result().error)
            await events.aclose()
            return self.error_response(first.result().error)
        return EventStreamResponse(self._body(first, events, encode), headers=SSE_HEADERS)

    def _check_model(self, model: str) -> None:
        allowed = self.settings.allowed_models
        if allowed and model not in allowed:
            raise ApiError(400, "model_not_allowed",
                           f"model {model!r} is not allowed here; use one of: {', '.join(allowed)}", "model")

    def _refuse(self, record: StreamRecord, error: ApiError) -> Response:
        record.status, record.error = self.status_of(error), error.type
        self._finish(record)
        return self.error_response(error)

    async def _body(self, first: asyncio.Future, events: AsyncIterator[Event], encode) -> AsyncIterator[bytes]:
        try:
            if not first.done():
                yield sse.KEEP_ALIVE  # the headers go out now; say so to proxies at once
                while not first.done():
                    await asyncio.wait({first}, timeout=self.settings.heartbeat)
                    if not first.done():
                        yield sse.KEEP_ALIVE
            data = encode(first.result())
            if data:
                yield data
            async for event in events:
                data = encode(event)
                if data:
                    yield data
        finally:
            if not first.done():
                first.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(first, return_exceptions=True)
            with anyio.CancelScope(shield=True):
                await events.aclose()

    async def _guarded(self, events: AsyncIterator[Event], record: StreamRecord) -> AsyncIterator[Event]:
        """Ends every stream with exactly one Done or Failed, even on a bug of ours, and writes the
        one log line per request when the stream is over."""
        try:
            try:
                async for event in events:
                    yield event
                    if not isinstance(event, Chunk):
                        return
            except Exception:
                log.exception("chat stream failed (model=%s)", record.model)
                record.error = "internal_error"
                yield Failed(ApiError(500, "internal_error", "the stream failed unexpectedly", retryable=True))
        finally:
            await events.aclose()
            self._finish(record)

    def _finish(self, record: StreamRecord) -> None:
        log.info(json.dumps(record.as_log(), ensure_ascii=False))
        telemetry.finish(record)
        if self.pipeline.wants_result:
            self.pipeline.run_after(record.result())

    async def _complete(self, request: Request, call: CallRequest, record: StreamRecord) -> Response:
        """A non-streamed answer; only endpoints whose contract allows ``stream: false`` have one."""
        raise NotImplementedError


class ChatEndpoint(Endpoint):
    """POST /api/chat: our own small contract (docs/api.md)."""

    name = "chat"

    def parse(self, data: object) -> CallRequest:
        request = contract.validate_chat_request(data)
        return CallRequest(request.to_params(self.settings.default_model), self.name)

    def encoder(self, call: CallRequest):
        return sse.encode_chat


class OpenAIEndpoint(Endpoint):
    """POST /api/v1/chat/completions: OpenAI's wire format, streamed or not."""

    name = "openai"

    def parse(self, data: object) -> CallRequest:
        request = openai_contract.validate(data)
        params = request.model_dump(exclude_none=True)
        params.setdefault("model", self.settings.default_model)
        include_usage = False
        if params.get("stream"):
            # Usage is always asked for (the log line needs it); the caller gets it only if asked.
            include_usage = bool((params.get("stream_options") or {}).get("include_usage"))
            params["stream_options"] = {**(params.get("stream_options") or {}), "include_usage": True}
        return CallRequest(params, self.name, include_usage)

    def encoder(self, call: CallRequest):
        return lambda event: sse.encode_openai(event, call.include_usage)

    def error_response(self, error: ApiError) -> JSONResponse:
        return JSONResponse(openai_contract.error_body(error), status_code=openai_contract.status_for(error),
                            headers={"Cache-Control": "no-store", **error.headers})

    def status_of(self, error: ApiError) -> int:
        return openai_contract.status_for(error)

    async def _complete(self, request: Request, call: CallRequest, record: StreamRecord) -> Response:
        """A non-streamed completion: the upstream's JSON, its text through the pipeline's text steps."""
        call.params.pop("stream", None)
        task = asyncio.ensure_future(self.client.chat.completions.with_raw_response.create(**call.params))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, timeout=self.settings.total_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        try:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if gone.done():
                    record.status, record.disconnected = 499, True
                    return Response(status_code=499)
                raise ApiError(504, "total_timeout", "the completion hit its total time limit", retryable=False)
            try:
                raw = task.result()
                body = json.loads(raw.http_response.content)
                if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
                    raise ValueError("the completion is not an object with choices")
            except (openai.APIError, ValueError) as exc:
                raise errors.from_upstream(exc, record.model) from None
            record.usage = body.get("usage")
            texts = await self._filter_choices(body)
            record.finish_reason = next((c.get("finish_reason") for c in body["choices"]
                                         if isinstance(c, dict) and c.get("index", 0) == 0), None)
            if record.texts is None and self.pipeline.wants_result:
                record.texts = {i: [t] for i, t in texts.items()}
            return JSONResponse(body, headers={"Cache-Control": "no-store"})
        except ApiError as error:
            record.status, record.error = self.status_of(error), error.type
            return self.error_response(error)
        except (StepFailed, ModerationStop) as exc:
            record.status, record.error = self.status_of(exc.error), exc.error.type
            return self.error_response(exc.error)
        finally:
            self._finish(record)

    async def _filter_choices(self, body: dict) -> dict[int, str]:
        texts = {}
        for choice in body["choices"]:
            if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
                continue
            message = choice["message"]
            content = message.get("content")
            if isinstance(content, str):
                text_filter = self.pipeline.text_filter()
                if text_filter is not None:
                    content = await text_filter.feed(content) + await text_filter.flush()
                    message["content"] = content
                texts[choice.get("index", 0)] = content
        return texts
