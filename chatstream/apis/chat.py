"""POST /api/chat, our own small API: its request contract, its events and its errors (docs/api.md).

Request: ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}, ...]}`` (never both), plus
optional ``model``, ``temperature``, ``top_p``, ``max_tokens``, ``seed``, ``stop``; strict: unknown
fields are refused. Always streamed: ``data: {"delta": "..."}`` per piece of text, then exactly one
``event: done`` or ``event: error``. Errors: ``{"error": {"type", "message", "param"?, "retryable"}}``."""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable
from typing import Annotated, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from .. import sse
from ..continuation import Known
from ..errors import ApiError
from ..http import dumps, error_headers, stored_objects, validate_object
from ..pipeline import CallRequest, Pipeline
from ..record import StreamRecord
from ..stream import Chunk, Done, Event, Failed
from .completions import CompletionsApi

MAX_MESSAGES = 1000
MAX_STOP = 4
NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    model: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(gt=0, le=1_000_000)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_STOP)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator("messages")
    @classmethod
    def _has_user_text(cls, value: list[Message] | None) -> list[Message] | None:
        if value is not None and not any(m.role == "user" and m.content.strip() for m in value):
            raise ValueError("needs at least one non-empty user message")
        return value

    @model_validator(mode="after")
    def _prompt_xor_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages', not both and not neither")
        return self

    def to_params(self, default_model: str) -> dict:
        """The chat.completions parameters for this request (always streamed, with usage), with the
        optional ones the caller set."""
        if self.prompt is not None:
            messages = [{"role": "user", "content": self.prompt}]
        else:
            messages = [{"role": m.role, "content": m.content} for m in self.messages or ()]
        params = {"model": self.model or default_model, "messages": messages, "stream": True}
        params["stream_options"] = {"include_usage": True}
        sampling = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "stop": self.stop,
        }  # model_dump(include=..., exclude_none=True) reads the same, in field order, for ~5x the CPU
        params.update((name, value) for name, value in sampling.items() if value is not None)
        return params


def _param(loc: tuple, error_type: str) -> str | None:
    """The caller's field path (``messages[0].role``) from a pydantic error location, which also
    holds union member tags such as ``str`` or ``list[...]`` that the caller never wrote."""
    known = set(ChatRequest.model_fields) | set(Message.model_fields)
    last = len(loc) - 1
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in known or (error_type == "extra_forbidden" and i == last):
            path += ("." if path else "") + part
    return path or None


def _describe(first: dict) -> tuple[str, str | None]:
    param = _param(first["loc"], first["type"])
    if first["type"] == "extra_forbidden":
        return f"unknown field {param!r}", param
    message = first["msg"].removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def validate_chat_request(data: object) -> ChatRequest:
    return validate_object(ChatRequest, data, _describe)


def chat_text(chunk: dict) -> str | None:
    """Choice 0's content in a chunk, if any."""
    for choice in chunk["choices"]:
        if choice.get("index", 0) == 0:
            delta = choice.get("delta")
            return delta.get("content") if delta else None
    return None


# What ``dumps`` makes of a str, without its encoder's dispatch on the type (json.encoder's C
# function that JSONEncoder(ensure_ascii=False).encode calls for a str): the per-delta path's.
_json_text = json.encoder.encode_basestring
# sse.event(dumps({"delta": text})) is _BEFORE + dumps(text) + _AFTER
_BEFORE, _AFTER = sse.around(b'{"delta":', b"}")


def encode(item: Event, stream_id: str | None = None) -> bytes | None:
    """One event as /api/chat writes it; a resumable stream's final event also carries its id."""
    if type(item) is Chunk:
        text = item.text if item.text is not None else chat_text(item.data)  # the protocol's reading, if any
        if not text:
            return None
        try:
            value = _json_text(text).encode("utf-8")  # dumps(text)
        except UnicodeEncodeError:  # a lone surrogate from upstream: dumps escapes it
            value = dumps(text)
        return _BEFORE + value + _AFTER
    if isinstance(item, Done):
        done = {"finish_reason": item.finish_reason, "usage": item.usage, "model": item.model, "id": item.id}
        if item.continued:
            done["continued"] = list(item.continued)
        return sse.event(dumps({**done, "stream_id": stream_id} if stream_id else done), b"done")
    assert isinstance(item, Failed)
    body = item.error.body()
    return sse.event(dumps({**body, "stream_id": stream_id} if stream_id else body), b"error")


class ChatApi(CompletionsApi):
    name = "chat"
    completes = False  # always streamed

    def parse(self, data: object, default_model: str) -> CallRequest:
        return CallRequest(params=validate_chat_request(data).to_params(default_model), endpoint=self.name)

    def encoder(self, call: CallRequest) -> Callable[[Event], bytes | None]:
        if call.stream_id is None:
            return encode
        return lambda item: encode(item, call.stream_id)  # the final event names the resumable stream

    def error_response(self, error: ApiError) -> Response:
        return JSONResponse(error.body(), status_code=error.status, headers=error_headers(error))

    async def completion(self, body: dict, pipeline: Pipeline, record: StreamRecord) -> dict:
        raise AssertionError("/api/chat is always streamed")

    def known(self, events: bytes) -> Known:
        deltas = [event.get("delta") for event in stored_objects(events)]
        return Known("".join(delta for delta in deltas if isinstance(delta, str)))
