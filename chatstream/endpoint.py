"""One endpoint over HTTP, the same for every API: read and check the request, run the pipeline's
before-steps, then either stream (through the stream core) or answer at once, and write the one log
line, the span and the after-steps when the request is over. What differs per API (its request
contract, its events, its errors) is the ``api`` adapter (api_chat.py, api_openai.py, api_responses.py).

Status rule: the response headers wait for the first output, or for the first heartbeat, whichever
comes first. Until then a failure is a real HTTP status with the API's JSON error body; after it,
the API's final error event. Once the headers are out without output, ``: keep-alive`` comments go
out every ``HEARTBEAT_SECONDS`` until the first output. A caller that hangs up at any point closes
the upstream.

Every error response carries ``x-should-retry: false``: the app has already spent its own upstream
retries (``UPSTREAM_MAX_RETRIES``), and the OpenAI SDKs would otherwise retry the whole chain again
(3 × 3 upstream calls for one SDK call). ``Retry-After`` still says when to come back."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
import openai
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import sse, telemetry
from .body import parse_json_body, read_body, require_json_content_type
from .errors import ERROR_HEADERS, UPSTREAM_ERRORS, ApiError, ClientGone, StepFailed, from_upstream
from .failover import Upstreams
from .limits import TimeLimits, total_expired
from .pipeline import CallRequest, Pipeline
from .record import StreamRecord
from .settings import Settings
from .stream import Chunk, Event, Failed, StreamProtocol, encoded, relay

log = logging.getLogger("chatstream")
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
# Errors that mean the upstream did not take the model: the name must not become a metric dimension.
_MODEL_REFUSED = {"model_not_found", "invalid_request"}
# After the total limit, how long a response blocked by a caller who stopped reading may still try
# to write its final event before the connection is dropped.
WRITE_GRACE_SECONDS = 2.0


class Api(Protocol):
    """What an API adapter provides (see api_chat.ChatApi, api_openai.OpenAIChatApi)."""
    name: str
    path: str  # the upstream path it calls: /chat/completions, /responses
    completes: bool  # it has a non-streamed form

    def parse(self, data: object, settings: Settings) -> CallRequest: ...
    def protocol(self, call: CallRequest, pipeline: Pipeline, record: StreamRecord) -> StreamProtocol: ...
    def encoder(self, call: CallRequest) -> Callable[[Event], bytes | None]: ...
    def error_response(self, error: ApiError) -> Response: ...
    async def completion(self, body: dict, pipeline: Pipeline, record: StreamRecord) -> dict: ...


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its event generator, even when the caller hung up
    while the generator was parked at ``yield`` (Starlette then only cancels the sending task), and
    that gives up writing shortly after the stream's total limit, however slowly the caller reads.
    ``on_close`` runs last in every case, also when Starlette never started the body (a caller gone
    before the first write): a generator that never ran has no ``finally`` of its own to run."""
    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, content, give_up_at: float, on_close: Callable[[], Awaitable[None]] | None = None,
                 **kwargs):
        super().__init__(content, **kwargs)
        self.give_up_at = give_up_at
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with asyncio.timeout_at(self.give_up_at):
                await super().__call__(scope, receive, send)
        except TimeoutError:
            log.warning("a caller stopped reading past the total time limit; dropping its connection")
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                if self.on_close is not None:
                    await self.on_close()


async def _close_events(first: asyncio.Future, events: AsyncIterator[Event]) -> None:
    """Stop waiting for the first event and close the event stream (the upstream with it); safe to
    call more than once."""
    with anyio.CancelScope(shield=True):
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        await events.aclose()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T], timeout: float) -> T:
    """``work``'s result, or ``ClientGone`` if the caller hangs up first, or the total limit."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone() if gone.done() else total_expired()


class Endpoint:
    def __init__(self, api: Api, settings: Settings, upstreams: Upstreams | openai.AsyncOpenAI, pipeline: Pipeline):
        """``upstreams``: the app's pool (failover.Upstreams), or one SDK client (a pool of one)."""
        self.api = api
        self.settings = settings
        self.upstreams = upstreams if isinstance(upstreams, Upstreams) else Upstreams.single(settings, upstreams)
        self.pipeline = pipeline

    async def __call__(self, request: Request) -> Response:
        record = StreamRecord(endpoint=self.api.name, model=self.settings.default_model)
        telemetry.begin(record)
        try:
            call = await self._prepare(request, record)
            if call.params.get("stream"):
                return await self._stream(request, call, record)
            return await self._complete(request, call, record)
        except ClientGone:
            record.status, record.disconnected = 499, True  # nginx's "client closed request"
            self._finish(record)
            return Response(status_code=499)
        except ApiError as error:
            return self._refuse(record, error)
        except Exception:  # a bug of ours: still a JSON answer, a log line, an ended span
            log.exception("request failed before the stream (endpoint=%s)", record.endpoint)
            return self._refuse(record, ApiError(500, "internal_error", "the request failed unexpectedly"))

    async def _prepare(self, request: Request, record: StreamRecord) -> CallRequest:
        """The request, read, checked and through the before-steps; or an ApiError."""
        require_json_content_type(request.headers.get("content-type"))
        raw = await read_body(request, self.settings.max_body_bytes)
        call = self.api.parse(parse_json_body(raw), self.settings)
        record.model = call.params["model"]
        if not self.upstreams.configured:
            raise ApiError(503, "not_configured", "no model upstream is configured: set UPSTREAMS, "
                                                  "OPENAI_API_KEY, OPENAI_BASE_URL or AZURE_OPENAI_ENDPOINT")
        await self.pipeline.run_before(call)
        model = call.params.get("model")
        if not isinstance(model, str) or not model:
            raise StepFailed("before", "a before-step left the request without a model name")
        record.model = model
        self._check_model(model)  # after the before-steps: they may choose the model
        if not call.params.get("stream") and not self.api.completes:
            raise StepFailed("before", f"a before-step turned streaming off, which /api/{self.api.name} cannot do")
        # A bounded set of names may become metric dimensions at once; any other only once the
        # upstream has served it (its first output, or its completion): see telemetry.py.
        record.model_accepted = bool(self.settings.allowed_models) or model == self.settings.default_model
        if self.pipeline.wants_result:
            record.texts = {}
        return call

    def _check_model(self, model: str) -> None:
        allowed = self.settings.allowed_models
        if allowed and model not in allowed:
            raise ApiError(400, "model_not_allowed",
                           f"model {model!r} is not allowed here; use one of: {', '.join(allowed)}", "model")
        self.upstreams.check_model(model)  # a model no upstream serves: 400, no upstream call

    def _refuse(self, record: StreamRecord, error: ApiError) -> Response:
        response = self._error_response(error)
        record.failed(response.status_code, error.type)
        if error.type in _MODEL_REFUSED:
            record.model_accepted = False
        self._finish(record)
        return response

    def _error_response(self, error: ApiError) -> Response:
        response = self.api.error_response(error)
        response.headers.update(ERROR_HEADERS)
        return response

    async def _complete(self, request: Request, call: CallRequest, record: StreamRecord) -> Response:
        """A non-streamed answer: the upstream's JSON, its texts through the pipeline's text steps."""
        try:
            body = await _unless_gone(request, self.upstreams.complete(self.api.path, call.params, record),
                                      self.settings.total_timeout)
        except UPSTREAM_ERRORS as exc:
            raise from_upstream(exc, record.model) from None
        record.model_accepted = True  # the upstream served it
        body = await self.api.completion(body, self.pipeline, record)
        self._finish(record)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    async def _stream(self, request: Request, call: CallRequest, record: StreamRecord) -> Response:
        limits = TimeLimits(self.settings)
        protocol = self.api.protocol(call, self.pipeline, record)
        # The pool's walk up to the first output (failover.py); its protocol copies only look for
        # that output: no text steps, their own record.
        probe = lambda: self.api.protocol(call, Pipeline(), StreamRecord(endpoint=record.endpoint,  # noqa: E731
                                                                          model=record.model))
        opened = lambda: self.upstreams.open_first_output(self.api.path, call.params, probe, limits,  # noqa: E731
                                                          record)
        events = self._finishing(relay(opened, protocol, limits, record), record)
        first = asyncio.ensure_future(anext(events))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({first, gone}, timeout=self.settings.heartbeat, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if gone.done():  # the caller left while we waited for the first token
            record.status = 499
            await _close_events(first, events)
            return Response(status_code=499)
        if first.done() and isinstance(first.result(), Failed):
            error = first.result().error
            response = self._error_response(error)
            record.status = response.status_code
            record.model_accepted = record.model_accepted and error.type not in _MODEL_REFUSED
            await events.aclose()
            return response
        body = self._body(first, events, self.api.encoder(call))
        return EventStreamResponse(body, limits.total_at + WRITE_GRACE_SECONDS,
                                   on_close=lambda: _close_events(first, events), headers=SSE_HEADERS)

    async def _body(self, first: asyncio.Future, events: AsyncIterator[Event], encode) -> AsyncIterator[bytes]:
        try:
            if not first.done():
                yield sse.KEEP_ALIVE  # the headers go out now; say so to proxies at once
                while not first.done():
                    await asyncio.wait({first}, timeout=self.settings.heartbeat)
                    if not first.done():
                        yield sse.KEEP_ALIVE
            async for data in encoded(first.result(), events, encode):
                yield data
        finally:
            await _close_events(first, events)

    async def _finishing(self, events: AsyncIterator[Event], record: StreamRecord) -> AsyncIterator[Event]:
        """The core's events, up to the final one; the request's record is finished when they end."""
        try:
            async for event in events:
                yield event
                if not isinstance(event, Chunk):
                    return
        finally:
            await events.aclose()
            self._finish(record)

    def _finish(self, record: StreamRecord) -> None:
        log.info(record.log_line())
        telemetry.finish(record)
        if self.pipeline.wants_result:
            self.pipeline.run_after(record.result())

