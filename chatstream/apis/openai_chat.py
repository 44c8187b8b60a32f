"""POST /api/v1/chat/completions and GET /api/v1/models: OpenAI's chat-completions API, for the
OpenAI SDKs and the tools built on them (docs/openai.md). Its request contract, its events and its
errors, in OpenAI's shapes.

Forward-compatible: the relay checks the fields it reads or limits (``model``, ``messages``,
``stream``, ``stream_options``, ``n``) and the types of OpenAI's others (fields.py); every field goes
to the upstream unchanged, and the upstream's own 400 comes back as a 400 with its message, code, type
and param. Errors are ``{"error": {"message", "type", "param", "code", "chatstream_kind"}}`` with the
statuses the SDKs map to their
exception classes (400 BadRequestError, 404 NotFoundError, 413/415/422, 429 RateLimitError, 5xx)."""

from __future__ import annotations

import json
import json.encoder
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from .. import sse
from ..continuation import Known, known_from_chunks
from ..errors import ApiError, ErrorKind
from ..http import dumps, error_headers, stored_objects, validate_object
from ..pipeline import CallRequest
from ..stream import Chunk, Done, Event
from .completions import CompletionsApi, filter_completion
from .fields import ChatFields, type_problem

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
OPENAI_DONE = sse.event(b"[DONE]")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None


class OpenAIChatRequest(ChatFields):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=1000)]
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=8)] | None = None

    @field_validator("messages")
    @classmethod
    def _messages_have_roles(cls, messages: list[dict]) -> list[dict]:
        for i, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise ValueError(f"messages[{i}].content must be a string, an array of parts, or null")
            if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
                raise ValueError(f"messages[{i}].content: each part must be an object")
        return messages


def describe(first: dict) -> tuple[str, str | None]:
    """A pydantic error as OpenAI words it: the top-level field as ``param``, its message after it."""
    loc = [str(p) for p in first["loc"] if not str(p).startswith(("list[", "function-", "constrained-"))]
    param = loc[0] if loc else None
    message = first["msg"].removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def validate(data: object) -> OpenAIChatRequest:
    return validate_object(
        OpenAIChatRequest, data, lambda first: type_problem(OpenAIChatRequest, first) or describe(first)
    )


def passed_on(data: object, default_model: str) -> dict:
    """The parameters of a request ``data`` that was validated: every field unchanged (those the
    relay does not read too), a missing model the default."""
    assert isinstance(data, dict)  # validation refuses anything else
    params = dict(data)
    if params.get("model") is None:
        params["model"] = default_model
    return params


_TYPE_BY_STATUS = {429: "rate_limit_error", 401: "authentication_error", 403: "permission_error"}


def error_body(error: ApiError) -> dict:
    """Our ApiError in OpenAI's error shape. An error the upstream reported keeps its ``code`` and
    ``type`` (``context_length_exceeded``); ours has our error type as ``code``; ``chatstream_kind``
    is always our error type."""
    provider = error.provider
    if provider is not None and provider.type is not None:
        kind = provider.type
    elif error.status in _TYPE_BY_STATUS:
        kind = _TYPE_BY_STATUS[error.status]
    elif error.status >= 500:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    code = provider.code if provider is not None else error.type
    return {
        "error": {
            "message": error.message,
            "type": kind,
            "param": error.param,
            "code": code,
            "chatstream_kind": error.type,
        }
    }


def status_for(error: ApiError) -> int:
    # The SDKs raise NotFoundError for 404: an unknown model is a 404 on OpenAI's API (on /api/chat
    # it is a 400: docs/api.md).
    return 404 if error.type == ErrorKind.MODEL_NOT_FOUND else error.status


_HOLE = "\ue000chatstream content\ue000"  # a content no chunk has (private use): where the template's split is
_HOLE_JSON = dumps(_HOLE)
_PAD = "\ue001chatstream padding\ue001"  # the same for OpenAI's ``obfuscation``: random, in every chunk
_PAD_JSON = dumps(_PAD)
VARYING = "obfuscation"  # a top-level string that differs from chunk to chunk (OpenAI's, after choices)
_json_text = json.encoder.encode_basestring  # what ``dumps`` makes of a str, without its dispatch (chat.py's)


class _Template:
    """The event of a usual chunk around its content, for the chunks of one stream that differ from it
    only there: ``head + dumps(content) + tail`` is what ``sse.event(dumps(chunk))`` makes of such a
    chunk, without walking the whole dict for every delta (make bench-quick --route openai has the figures). Made
    from a chunk whose values (choices aside) are JSON strings, integers, booleans, nulls, or objects
    and arrays of them (Azure's ``content_filter_results``), and whose one choice's delta is
    ``{"content": str}``; a chunk fits when it and its choice are equal to the template's but for the
    content (dict equality: the same keys, equal values), each integer or boolean of the template's
    type in it too, however deep (``1 == True``, but their JSON differs; no floats: ``-0.0 == 0.0``).
    Its keys may come in another order: its JSON is then the template's order, an object of the same
    meaning. OpenAI's ``obfuscation`` (a string after choices, random in every chunk: ``VARYING``) is
    a second hole, when the template's chunk has one. Anything else (the role chunk, the finish, a
    guard's or a continuation's chunk of another shape) is encoded whole."""

    __slots__ = ("choice", "choice_numbers", "deep", "head", "mid", "numbers", "tail", "top", "unique", "varying")

    def __init__(self, data: dict, numbers: list[tuple[tuple, type]]) -> None:
        choice = data["choices"][0]
        self.top = dict(data)  # its "choices" (and its choice's "delta") set to the chunk's on each look
        self.choice = dict(choice)
        # The integers and booleans (paths from the chunk): its own, its choice's, deeper ones.
        flat: list[tuple[Any, type]] = []
        inner: list[tuple[Any, type]] = []
        deep: list[tuple[tuple, type]] = []
        for path, kind in numbers:
            if len(path) == 1:
                flat.append((path[0], kind))
            elif len(path) == 3 and path[0] == "choices":  # _scan's paths in the choice: ("choices", 0, key)
                inner.append((path[2], kind))
            else:
                deep.append((path, kind))
        self.numbers, self.choice_numbers, self.deep = tuple(flat), tuple(inner), tuple(deep)
        self.varying = type(data.get(VARYING)) is str
        shape = {**data, "choices": [{**choice, "delta": {"content": _HOLE}}]}
        if self.varying:
            shape[VARYING] = _PAD
        whole = dumps(shape)
        self.head, _, self.tail = whole.partition(_HOLE_JSON)
        self.mid = b""
        self.unique = whole.count(_HOLE_JSON) == 1  # else a value holds the hole too: no template
        if self.varying:  # the tail: mid, the padding's JSON, tail
            self.mid, _, self.tail = self.tail.partition(_PAD_JSON)
            self.unique = self.unique and whole.count(_PAD_JSON) == 1 and bool(self.tail)  # after the content
        self.head, self.tail = sse.around(self.head, self.tail)

    @staticmethod
    def of(data: dict) -> _Template | None:
        """A template made from ``data``, when it has the usual shape (a plain chunk: choices is a list
        of one dict whose delta is a dict)."""
        choice = data["choices"][0]
        delta = choice["delta"]
        if len(delta) != 1 or type(delta.get("content")) is not str:
            return None
        numbers: list[tuple[tuple, type]] = []
        for key, value in data.items():
            if key != "choices" and not _scan(value, (key,), numbers):
                return None
        for key, value in choice.items():
            if key != "delta" and not _scan(value, ("choices", 0, key), numbers):
                return None
        template = _Template(data, numbers)
        return template if template.unique else None

    def fits(self, data: dict, choice: dict) -> bool:
        """Whether ``data`` (a plain chunk with content: ``choice`` is its one choice, whose delta has
        ``content`` and perhaps ``role``) is this template's chunk with other content."""
        delta = choice["delta"]
        if len(delta) != 1:
            return False
        top, inner = self.top, self.choice
        top["choices"] = data["choices"]  # the same object: equal at once
        inner["delta"] = delta
        if self.varying:
            padding = data.get(VARYING)
            if type(padding) is not str:
                return False
            top[VARYING] = padding
        if data != top or choice != inner:
            return False
        for key, kind in self.numbers:
            if type(data[key]) is not kind:
                return False
        for key, kind in self.choice_numbers:
            if type(choice[key]) is not kind:
                return False
        for path, kind in self.deep:
            value = data
            for key in path:
                value = value[key]
            if type(value) is not kind:
                return False
        return True


def _scan(value: object, path: tuple, numbers: list[tuple[tuple, type]]) -> bool:
    """Whether ``value`` (at ``path`` in a chunk) can be in a template: JSON strings, integers,
    booleans and nulls, in objects and arrays; its integers and booleans go into ``numbers``."""
    kind = type(value)
    if kind is str or value is None:
        return True
    if kind is int or kind is bool:
        numbers.append((path, kind))
        return True
    if isinstance(value, dict):
        return all(_scan(v, (*path, k), numbers) for k, v in value.items())
    if isinstance(value, list):
        return all(_scan(v, (*path, i), numbers) for i, v in enumerate(value))
    return False  # a float: -0.0 == 0.0, and their JSON differs


class ChunkEncoder:
    """One stream's events in OpenAI's shapes (``encode``): its chunks through a ``_Template`` when they
    fit the stream's (made from its first usual content chunk, looked for in its first ``TRIES``
    chunks with content), else whole."""

    TRIES = 4
    __slots__ = ("include_usage", "template", "tries")

    def __init__(self, include_usage: bool) -> None:
        self.include_usage = include_usage
        self.template: _Template | None = None
        self.tries = self.TRIES

    def __call__(self, item: Event) -> bytes:
        if type(item) is Chunk and item.text:  # a plain chunk (completions.py) with content
            data = item.data
            choice = data["choices"][0]
            template = self.template
            if template is None and self.tries:
                self.tries -= 1
                template = self.template = _Template.of(data)
            if template is not None and template.fits(data, choice):  # the chunk's own values, in its JSON
                try:
                    content = _json_text(item.text).encode("utf-8")  # dumps(item.text): the delta's content
                except UnicodeEncodeError:  # a lone surrogate from upstream: dumps escapes it
                    content = dumps(item.text)
                if template.varying:
                    return template.head + content + template.mid + dumps(data[VARYING]) + template.tail
                return template.head + content + template.tail
        return encode(item, self.include_usage)


def encode(item: Event, include_usage: bool) -> bytes:
    if isinstance(item, Chunk):
        return sse.event(dumps(item.data))
    if isinstance(item, Done):
        last = {"id": item.id, "object": "chat.completion.chunk", "created": item.created, "model": item.model}
        if item.finish_reason == "cancelled":  # a resumable stream stopped: its choices end "cancelled"
            last["choices"] = [{"index": i, "delta": {}, "finish_reason": "cancelled"} for i in item.finish_reasons]
        elif include_usage:
            last |= {"choices": [], "usage": item.usage}
            if item.continued:
                last["continued"] = list(item.continued)
        else:
            return OPENAI_DONE
        return sse.event(dumps(last)) + OPENAI_DONE
    return sse.event(dumps(error_body(item.error)))


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=status_for(error), headers=error_headers(error))


class OpenAIChatApi(CompletionsApi):
    name = "openai"
    completes = True

    def parse(self, data: object, default_model: str) -> CallRequest:
        validate(data)
        params = passed_on(data, default_model)
        include_usage = False
        if params.get("stream"):
            # Usage is always asked for (the log line needs it); the caller gets it only if asked.
            include_usage = bool((params.get("stream_options") or {}).get("include_usage"))
            params["stream_options"] = {**(params.get("stream_options") or {}), "include_usage": True}
        return CallRequest(params=params, endpoint=self.name, include_usage=include_usage)

    def encoder(self, call: CallRequest) -> ChunkEncoder:
        return ChunkEncoder(call.include_usage)

    error_response = staticmethod(error_response)
    completion = staticmethod(filter_completion)

    def known(self, events: bytes) -> Known:
        return known_from_chunks(stored_objects(events))


def models_list(names) -> dict:
    return {"object": "list", "data": [model_object(name) for name in names]}


def model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "chatstream"}
