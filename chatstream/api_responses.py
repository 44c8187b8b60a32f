"""POST /api/v1/responses and its follow-ups: OpenAI's Responses API, for the OpenAI SDKs'
``client.responses``, the Agents SDK and the Vercel AI SDK's default ``openai()`` provider
(docs/openai.md, "Responses").

Forward-compatible like chat completions: the relay checks only the fields it reads (``model``,
``input``, ``instructions``, ``stream``, ``background``, ``tools``); every other field goes to the
upstream unchanged. Errors are OpenAI's (api_openai.error_response).

Streams: the upstream's events are forwarded as named events (``event: <type>``), with their
``sequence_number`` and order unchanged. ``response.created`` / ``response.in_progress`` (and a
background response's ``response.queued``) are held until the first event that is real output, so the
status rule (endpoint.py) can still answer an early failure with an HTTP status. The stream is done
at ``response.completed``, ``response.incomplete`` or ``response.failed``; the usage comes from the
terminal event's ``response.usage``. A failure after output ends the stream with an ``error`` event
(``{"type": "error", "sequence_number": next, "code", "message", "param"}``, the documented shape).

Text steps (``BLOCKED_TERMS`` and your own) see every text the model streams: each content part's
text or refusal (per ``output_index``/``content_index``), each function call's arguments, each
reasoning summary part and reasoning text. The repeated full texts (``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, the terminal ``response``, the
non-streamed response) are replaced by what was released for that part, so a reader of the deltas and
a reader of the final object see the same text. To give a filter's held-back tail a place in the
deltas without inventing events (which would shift every later ``sequence_number``), each delta event
is sent when the next upstream event arrives while text steps are on: the part's last delta then
carries the tail. Without text steps every event is forwarded unchanged as it arrives.

Background responses (``"background": true``): a caller hanging up closes the upstream stream, as for
any stream, and sends no cancel request, so the response goes on at the upstream: resume it with
``GET /api/v1/responses/{id}?stream=true&starting_after=N`` or cancel it with
``POST /api/v1/responses/{id}/cancel``. (Closing a background response's stream does not cancel it at
OpenAI.) A foreground stream's upstream is closed, stopping the generation, when the caller hangs up.

Azure OpenAI: the calls go to Azure's v1 API, ``{AZURE_OPENAI_ENDPOINT}/openai/v1/responses``, with the
deployment name as ``model`` in the body and no ``api-version`` (the v1 API needs none; the SDK's Azure
client would otherwise call ``/openai/responses?api-version=AZURE_OPENAI_API_VERSION``)."""
from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
import openai
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from . import sse
from .api_openai import describe, error_response, passed_on
from .body import validate_object
from .errors import (UPSTREAM_ERRORS, ApiError, UpstreamMalformed, UpstreamReported, from_upstream, invalid_request,
                     upstream_field)
from .limits import TimeLimits
from .pipeline import CallRequest, Pipeline, TextFilter
from .record import StreamRecord
from .settings import Settings
from .stream import Chunk, Done, Event, Failed, Fed, encoded, relay
from .upstream import UpstreamStream

log = logging.getLogger("chatstream")

# Events held until the first real output (the status rule waits for output).
OPENING = frozenset({"response.created", "response.in_progress", "response.queued"})
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Delta events carrying text, and the text channel each one belongs to.
TEXT_DELTAS = frozenset({"response.output_text.delta", "response.refusal.delta", "response.reasoning_text.delta",
                         "response.function_call_arguments.delta", "response.reasoning_summary_text.delta"})
# Internal: one upstream event may release two events (a held delta and itself).
BATCH = "chatstream.events"
_EVENT_TYPE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,200}")
# Upstream 404 codes that mean the model (Azure: the deployment) is unknown, not the API.
_MODEL_MISSING = {"model_not_found", "DeploymentNotFound"}


# ---------------------------------------------------------------------------------------- request

class ResponsesRequest(BaseModel):
    """The fields the relay reads; any other field is kept and passed on as it came."""
    model_config = ConfigDict(extra="allow", strict=True)

    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    stream: StrictBool | None = None
    background: StrictBool | None = None
    tools: list[Any] | None = None


def _describe(first: dict) -> tuple[str, str | None]:
    message, param = describe(first)
    if param == "input":  # pydantic's union message would list its branches
        message = "input: must be a string or an array of input items"
    return message, param


def validate(data: object) -> ResponsesRequest:
    return validate_object(ResponsesRequest, data, _describe)


# ---------------------------------------------------------------------------------------- text channels

def _delta_key(data: dict) -> tuple | None:
    """The text channel of a delta or done event: ``("c", output, content)`` for a content part's text
    or refusal, ``("a", output)`` for function-call arguments, ``("s", output, summary)`` for a
    reasoning summary part."""
    kind = data.get("type", "")
    if kind.startswith("response.function_call_arguments."):
        return ("a", _index(data, "output_index"))
    if kind.startswith(("response.reasoning_summary_text.", "response.reasoning_summary_part.")):
        return ("s", _index(data, "output_index"), _index(data, "summary_index"))
    if kind.startswith(("response.output_text.", "response.refusal.", "response.reasoning_text.",
                        "response.content_part.")):
        return ("c", _index(data, "output_index"), _index(data, "content_index"))
    return None


def _index(data: dict, name: str) -> int:
    value = data.get(name, 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UpstreamMalformed(f"the model server sent an event whose {name} is not a number")
    return value


def _text_field(part: dict) -> str | None:
    """The field holding a content part's text: ``text`` (output_text, reasoning_text) or ``refusal``."""
    if isinstance(part.get("text"), str):
        return "text"
    if isinstance(part.get("refusal"), str):
        return "refusal"
    return None


class ResponseStream:
    """One streamed response: ``feed`` each upstream event, forward what it returns."""

    def __init__(self, pipeline: Pipeline, record: StreamRecord, resumed: bool = False):
        self._make_filter = pipeline.text_filter if pipeline.filters_text else None
        self.feed_waits = pipeline.moderates
        self._record = record
        # A re-stream after ``starting_after``: its deltas are only the end of each text, so the full
        # texts are the upstream's, through the text steps whole (as GET /responses/{id} gives them).
        self._resumed = resumed
        self._filters: dict[tuple, TextFilter] = {}
        self._released: dict[tuple, str] = {}  # what the filters released, per channel
        self._texts: dict[tuple, str] = {}  # each channel's full text, once done
        self._flushed: set[tuple] = set()
        self._pending: tuple[tuple, dict] | None = None  # a delta event waiting for the next event
        self._last_delta: dict[tuple, dict] = {}
        self._extra: list[dict] = []  # tails whose last delta was already sent
        self.status: str | None = None
        self.model = self.id = self.created = None

    # -- the core's protocol
    @property
    def done(self) -> bool:
        return self.status is not None

    @property
    def finished(self) -> bool:
        return self.done

    def note(self, data: dict) -> None:
        response = data.get("response")
        if isinstance(response, dict):
            self.model = response.get("model") or self.model
            self.id = response.get("id") or self.id
            self.created = response.get("created_at") or self.created
            if isinstance(response.get("usage"), dict):
                self._record.usage = response["usage"]

    async def feed(self, data: dict) -> Fed:
        kind = data.get("type")
        if not isinstance(kind, str) or not _EVENT_TYPE.fullmatch(kind):
            raise UpstreamMalformed("the model server sent an event without a valid type")
        if kind == "error":
            raise _error_event(data)
        if kind in TEXT_DELTAS and not isinstance(data.get("delta"), str):
            raise UpstreamMalformed(f"the model server sent a {kind} event without a text delta")
        self.note(data)
        output = kind not in OPENING
        delta = kind in TEXT_DELTAS
        if kind in TERMINAL:
            status = (data.get("response") or {}).get("status") if isinstance(data.get("response"), dict) else None
            self.status = status if isinstance(status, str) else kind.removeprefix("response.")
        if self._make_filter is None:
            if kind == "response.output_text.delta":
                self._keep(data.get("delta"))
            return Fed(data, output=output, delta=delta)
        events = await self._filtered(kind, data)
        if not events:
            return Fed(None)
        return Fed(events[0] if len(events) == 1 else {BATCH: events}, output=output, delta=delta)

    def summary(self) -> Done:
        return Done(self.status, {}, self._record.usage, self.model, self.id, self.created)

    # -- text steps
    def _keep(self, text) -> None:
        if isinstance(text, str):
            self._record.keep_text(0, text)

    async def _filtered(self, kind: str, data: dict) -> list[dict]:
        events = []
        key = _delta_key(data)
        if kind in TEXT_DELTAS and key is not None:
            if key in self._flushed:  # a delta after its part was done: nothing more may go out
                return self._release() + [{**data, "delta": ""}]
            text = await self._filter(key).feed(data["delta"])
            self._released[key] = self._released.get(key, "") + text
            new = {**data, "delta": text}
            events = self._release()
            self._pending = (key, new)
            self._last_delta[key] = new
            if kind == "response.output_text.delta":
                self._keep(text)
            return events
        self._extra = []
        rewritten = await self._rewrite(kind, data)
        events = self._release() + self._extra + [rewritten]
        self._extra = []
        return events

    def _release(self) -> list[dict]:
        if self._pending is None:
            return []
        _, event = self._pending
        self._pending = None
        return [event]

    def _filter(self, key: tuple) -> TextFilter:
        if key not in self._filters:
            self._filters[key] = self._make_filter()
        return self._filters[key]

    async def _full(self, key: tuple, text: str) -> str:
        """The text of a whole part: what was released for it (its held tail flushed into its last
        delta first), or, for a part that came without deltas (or a resumed stream), the upstream's
        text through filters of its own."""
        if key not in self._texts:
            if key in self._filters and key not in self._flushed:
                tail = await self._filters[key].flush()
                if tail:
                    self._released[key] += tail
                    self._carry(key, tail)
                    if key[0] == "c" and self._last_delta[key].get("type") == "response.output_text.delta":
                        self._keep(tail)
            self._flushed.add(key)
            if key in self._filters and not self._resumed:
                self._texts[key] = self._released[key]
            else:
                text_filter = self._make_filter()
                self._texts[key] = await text_filter.feed(text) + await text_filter.flush()
        return self._texts[key]

    def _carry(self, key: tuple, tail: str) -> None:
        """Put a flushed tail into the channel's last delta: the one still pending, normally (its part
        is done right after it). If another event came in between, that delta has been sent, and a copy
        of it carries the tail (same ``sequence_number``: nothing later is renumbered)."""
        if self._pending is not None and self._pending[0] == key:
            self._pending = (key, {**self._pending[1], "delta": self._pending[1]["delta"] + tail})
        else:
            self._extra.append({**self._last_delta[key], "delta": tail})

    async def _rewrite(self, kind: str, data: dict) -> dict:
        """A new event whose full texts are the released ones (the upstream's dict is not changed)."""
        key = _delta_key(data)
        new = data
        if key is not None:
            if kind in ("response.output_text.done", "response.reasoning_text.done",
                        "response.reasoning_summary_text.done") and isinstance(data.get("text"), str):
                new = {**data, "text": await self._full(key, data["text"])}
            elif kind == "response.refusal.done" and isinstance(data.get("refusal"), str):
                new = {**data, "refusal": await self._full(key, data["refusal"])}
            elif kind == "response.function_call_arguments.done" and isinstance(data.get("arguments"), str):
                new = {**data, "arguments": await self._full(key, data["arguments"])}
            elif kind in ("response.content_part.done", "response.reasoning_summary_part.done") \
                    and isinstance(data.get("part"), dict):
                field = _text_field(data["part"])
                if field:
                    new = {**data, "part": {**data["part"], field: await self._full(key, data["part"][field])}}
        elif kind == "response.output_item.done" and isinstance(data.get("item"), dict):
            new = {**data, "item": await self._item(_index(data, "output_index"), data["item"])}
        elif kind in TERMINAL and isinstance(data.get("response"), dict):
            new = {**data, "response": await self._response(data["response"])}
        return new

    async def _item(self, index: int, item: dict) -> dict:
        new = dict(item)
        if isinstance(item.get("arguments"), str) and item.get("type") == "function_call":
            new["arguments"] = await self._full(("a", index), item["arguments"])
        for name, letter in (("content", "c"), ("summary", "s")):
            parts = item.get(name)
            if not isinstance(parts, list):
                continue
            new_parts = []
            for i, part in enumerate(parts):
                field = _text_field(part) if isinstance(part, dict) else None
                if field:
                    part = {**part, field: await self._full((letter, index, i), part[field])}
                new_parts.append(part)
            new[name] = new_parts
        return new

    async def _response(self, response: dict) -> dict:
        output = response.get("output")
        if not isinstance(output, list):
            return response
        items = [await self._item(i, item) if isinstance(item, dict) else item for i, item in enumerate(output)]
        return {**response, "output": items}


def _error_event(data: dict) -> ApiError:
    """The upstream's ``error`` event (documented flat shape, or nested under ``error``)."""
    inner = data.get("error") if isinstance(data.get("error"), dict) else data
    message = inner.get("message")
    return UpstreamReported(message if isinstance(message, str) else "an error occurred during streaming")


# ---------------------------------------------------------------------------------------- encoding

class ResponseEncoder:
    """Our events as the Responses API writes them: ``event: <type>\\ndata: <json>\\n\\n``."""

    def __init__(self) -> None:
        self.last_sequence = -1

    def __call__(self, event: Event) -> bytes | None:
        if isinstance(event, Chunk):
            events = event.data.get(BATCH) or [event.data]
            out = []
            for data in events:
                number = data.get("sequence_number")
                if isinstance(number, int) and not isinstance(number, bool):
                    self.last_sequence = max(self.last_sequence, number)
                out.append(sse.event(data, data["type"].encode()))
            return b"".join(out)
        if isinstance(event, Done):
            return None  # the terminal event was forwarded: nothing more to say
        error = event.error
        self.last_sequence += 1
        return sse.event({"type": "error", "sequence_number": self.last_sequence, "code": error.type,
                          "message": error.message, "param": error.param}, b"error")


# ---------------------------------------------------------------------------------------- non-streamed

async def filter_response(body: dict, pipeline: Pipeline, record: StreamRecord) -> dict:
    """A whole ``response`` object with its output texts through the text steps (a new dict)."""
    if not isinstance(body.get("output", []), list):
        raise UpstreamMalformed("the response is not an object with an output list")
    record.usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
    record.finish_reason = body.get("status") if isinstance(body.get("status"), str) else None
    if pipeline.filters_text:
        body = await ResponseStream(pipeline, record)._response(body)
    for item in body.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message" and isinstance(item.get("content"), list):
            for part in item["content"]:
                if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    record.keep_text(0, part["text"])
    return body


# ---------------------------------------------------------------------------------------- the adapter

class ResponsesApi:
    name = "responses"
    path = "/responses"
    completes = True

    def parse(self, data: object, settings: Settings) -> CallRequest:
        validate(data)
        return CallRequest(params=passed_on(data, settings), endpoint=self.name)

    def protocol(self, call: CallRequest, pipeline: Pipeline, record: StreamRecord) -> ResponseStream:
        return ResponseStream(pipeline, record)

    def encoder(self, call: CallRequest) -> ResponseEncoder:
        return ResponseEncoder()

    error_response = staticmethod(error_response)
    completion = staticmethod(filter_response)


# ---------------------------------------------------------------------------------------- the upstream

def no_responses_api() -> ApiError:
    return ApiError(501, "responses_not_supported",
                    "the upstream has no Responses API (POST /responses answered 404); use /api/v1/chat/completions")


class ResponsesClient:
    """The SDK client as the Responses API calls need it: for Azure OpenAI, the v1 API
    (``/openai/v1/responses``, no ``api-version``); an upstream 404 on creating a response that is not
    about the model means the upstream lacks the API (501). Only ``get``, ``post``, ``delete`` and the
    client's ``timeout``."""

    def __init__(self, client: openai.AsyncOpenAI, azure: bool):
        self.client = client
        self.azure = azure

    @property
    def timeout(self):
        return self.client.timeout

    def _args(self, path: str, kwargs: dict) -> tuple[str, dict]:
        if not self.azure:
            return path, kwargs
        options = dict(kwargs.get("options") or {})
        options["params"] = {**(options.get("params") or {}), "api-version": openai.omit}
        return "/v1" + path, {**kwargs, "options": options}

    async def post(self, path: str, **kwargs):
        path_sent, kwargs = self._args(path, kwargs)
        try:
            return await self.client.post(path_sent, **kwargs)
        except openai.NotFoundError as exc:
            if path == "/responses" and upstream_field(exc, "code") not in _MODEL_MISSING:
                raise no_responses_api() from None
            raise

    async def get(self, path: str, **kwargs):
        path, kwargs = self._args(path, kwargs)
        return await self.client.get(path, **kwargs)

    async def delete(self, path: str, **kwargs):
        path, kwargs = self._args(path, kwargs)
        return await self.client.delete(path, **kwargs)


class RawStream(openai.AsyncStream[bytes]):
    """An upstream body passed on as it comes, bytes unchanged (a re-stream of a stored response)."""

    async def __stream__(self) -> AsyncIterator[bytes]:
        async for piece in self.response.aiter_bytes():
            yield piece


# ---------------------------------------------------------------------------------------- follow-ups

class ResponseFollowUps:
    """GET/DELETE /api/v1/responses/{id}, POST …/{id}/cancel, GET …/{id}/input_items: relayed to the
    upstream as they came (query parameters too, except the Functions key ``code``). With text steps
    on, the response objects (retrieve, cancel) have their output texts through them, and a re-stream
    goes through ``ResponseStream``; without, a re-stream's bytes are passed on unchanged."""

    def __init__(self, settings: Settings, client: ResponsesClient, pipeline: Pipeline):
        self.settings = settings
        self.client = client
        self.pipeline = pipeline

    async def retrieve(self, request: Request) -> Response:
        response_id = _response_id(request)
        if isinstance(response_id, Response):
            return response_id
        query = _query(request)
        if str(query.get("stream", "")).lower() == "true":
            if self.pipeline.filters_text:
                return await self._restream_filtered(response_id, query)
            return await self._restream(response_id, query)
        return await self._call("get", f"/responses/{response_id}", query)

    async def delete(self, request: Request) -> Response:
        response_id = _response_id(request)
        if isinstance(response_id, Response):
            return response_id
        return await self._call("delete", f"/responses/{response_id}", _query(request))

    async def cancel(self, request: Request) -> Response:
        response_id = _response_id(request)
        if isinstance(response_id, Response):
            return response_id
        return await self._call("post", f"/responses/{response_id}/cancel", _query(request))

    async def input_items(self, request: Request) -> Response:
        response_id = _response_id(request)
        if isinstance(response_id, Response):
            return response_id
        return await self._call("get", f"/responses/{response_id}/input_items", _query(request))

    async def _call(self, method: str, path: str, query: dict) -> Response:
        try:
            body = await getattr(self.client, method)(path, cast_to=object, options={"params": query})
        except UPSTREAM_ERRORS as exc:
            return _error(_follow_up_error(exc))
        except ApiError as error:
            return _error(error)
        if not isinstance(body, dict):
            return _error(UpstreamMalformed("the model server sent a malformed answer"))
        if self.pipeline.filters_text and body.get("object") == "response":
            try:
                body = await filter_response(body, self.pipeline, StreamRecord(endpoint="responses", model=""))
            except ApiError as error:
                return _error(error)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    async def _restream(self, response_id: str, query: dict) -> Response:
        from .endpoint import SSE_HEADERS, WRITE_GRACE_SECONDS, EventStreamResponse

        try:
            stream = await self.client.get(f"/responses/{response_id}", cast_to=object, options={"params": query},
                                           stream=True, stream_cls=RawStream)
        except UPSTREAM_ERRORS as exc:
            return _error(_follow_up_error(exc))
        except ApiError as error:  # e.g. no upstream configured
            return _error(error)
        give_up_at = asyncio.get_running_loop().time() + self.settings.total_timeout + WRITE_GRACE_SECONDS
        return EventStreamResponse(_relay_bytes(stream), give_up_at, headers=SSE_HEADERS)


    async def _restream_filtered(self, response_id: str, query: dict) -> Response:
        """A re-stream with the text steps on: the upstream's events through the stream core."""
        from .endpoint import SSE_HEADERS, WRITE_GRACE_SECONDS, EventStreamResponse

        record = StreamRecord(endpoint="responses", model="")
        protocol = ResponseStream(self.pipeline, record, resumed=True)
        limits = TimeLimits(self.settings)
        opened = lambda: self.client.get(f"/responses/{response_id}", cast_to=object,  # noqa: E731
                                         options={"params": query}, stream=True, stream_cls=UpstreamStream)
        events = relay(opened, protocol, limits, record)
        first = await anext(events)
        if isinstance(first, Failed):
            await events.aclose()
            error = first.error
            if error.type == "model_not_found":  # a 404 here is about the response, not a model
                error = ApiError(404, "not_found", f"Response with id '{response_id}' not found.")
            return _error(error)
        return EventStreamResponse(_encoded(first, events, ResponseEncoder()),
                                   limits.total_at + WRITE_GRACE_SECONDS, headers=SSE_HEADERS)


async def _encoded(first: Event, events: AsyncIterator[Event], encode: ResponseEncoder) -> AsyncIterator[bytes]:
    try:
        async for data in encoded(first, events, encode):
            yield data
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()


async def _relay_bytes(stream: RawStream) -> AsyncIterator[bytes]:
    try:
        async for piece in stream:
            yield piece
    except Exception as exc:  # noqa: BLE001 - the caller's stream just ends; the cause is logged
        log.warning("a response re-stream ended early: %s", type(exc).__name__)
    finally:
        with anyio.CancelScope(shield=True):  # the caller may have hung up: still close the upstream
            await stream.close()


def _response_id(request: Request) -> str | Response:
    response_id = request.path_params.get("response_id", "")
    if not RESPONSE_ID.fullmatch(response_id):
        return _error(invalid_request("the response id must look like resp_… (letters, digits, _ and -)",
                                      "response_id"))
    return response_id


def _query(request: Request) -> dict:
    query: dict[str, Any] = {}
    for key, value in request.query_params.multi_items():
        if key == "code":  # the Functions key is ours, not the upstream's
            continue
        if key in query:
            query[key] = [*query[key], value] if isinstance(query[key], list) else [query[key], value]
        else:
            query[key] = value
    return query


def _follow_up_error(exc: BaseException) -> ApiError:
    if isinstance(exc, openai.NotFoundError):
        message = exc.body.get("message") if isinstance(exc.body, dict) else None
        return ApiError(404, "not_found", message if isinstance(message, str) else "response not found")
    return from_upstream(exc, "")


def _error(error: ApiError) -> Response:
    return error_response(error)
