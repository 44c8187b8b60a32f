"""The request contract of POST /api/chat: one typed, validated request, or a 4xx ApiError.

Body: ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}, ...]}`` (never both), plus
optional ``model``, ``temperature``, ``top_p``, ``max_tokens``, ``seed``, ``stop``. See docs/api.md."""
from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator,
                      model_validator)

from .errors import ApiError, invalid_request

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
        """The chat.completions parameters for this request (always streamed, with usage)."""
        return {"model": self.model or default_model, "messages": self.upstream_messages(), "stream": True,
                "stream_options": {"include_usage": True}, **self.sampling()}

    def upstream_messages(self) -> list[dict]:
        if self.prompt is not None:
            return [{"role": "user", "content": self.prompt}]
        return [{"role": m.role, "content": m.content} for m in self.messages or ()]

    def sampling(self) -> dict:
        """The optional parameters the caller set, as keyword arguments for the SDK."""
        return self.model_dump(include={"temperature", "top_p", "max_tokens", "seed", "stop"}, exclude_none=True)


def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> object:
    """Strict JSON: UTF-8 only, no NaN/Infinity, no lone surrogates, bounded nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_request("the body is not valid UTF-8") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise invalid_request("the body is nested too deeply") from None
    except ValueError as exc:
        raise invalid_request(f"the body is not valid JSON: {exc}") from None
    if _has_lone_surrogate(data):
        raise invalid_request("the body contains an unpaired UTF-16 surrogate escape")
    return data


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


def validate_chat_request(data: object) -> ChatRequest:
    if not isinstance(data, dict):
        raise invalid_request("the body must be a JSON object")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        param = _param(first["loc"], first["type"])
        if first["type"] == "extra_forbidden":
            message = f"unknown field {param!r}"
        else:
            message = first["msg"].removeprefix("Value error, ")
            message = f"{param}: {message}" if param else message
        raise invalid_request(message, param) from None


# curl -d sends application/x-www-form-urlencoded unless told otherwise; a JSON body is never valid
# form data for this endpoint, so that type (and none at all) is read as JSON. Anything else is 415.
_ACCEPTED_AS_JSON = {"", "application/json", "application/x-www-form-urlencoded"}


def require_json_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media not in _ACCEPTED_AS_JSON and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, "unsupported_media_type", "send the body as Content-Type: application/json")
