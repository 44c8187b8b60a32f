"""The contract of POST /api/v1/chat/completions: OpenAI's chat-completions request, checked enough
that nothing malformed reaches the upstream, and OpenAI-shaped errors
(``{"error": {"message", "type", "param", "code"}}``) with the statuses the SDKs map to their
exception classes (400 BadRequestError, 404 NotFoundError, 413/415/422, 429 RateLimitError, 5xx)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from .errors import ApiError

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
Number = Annotated[float, Field(strict=True)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None


class OpenAIChatRequest(BaseModel):
    """The chat.completions parameters we accept and pass on. Unknown fields are refused, as
    OpenAI does ("Unrecognized request argument supplied")."""
    model_config = ConfigDict(extra="forbid", strict=True)

    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=1000)]
    model: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=8)] | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Number] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    seed: StrictInt | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    reasoning_effort: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None

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
        return messages


def validate(data: object) -> OpenAIChatRequest:
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "the body must be a JSON object")
    try:
        return OpenAIChatRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        loc = [str(p) for p in first["loc"] if not str(p).startswith(("list[", "function-", "constrained-"))]
        param = loc[0] if loc else None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, "invalid_request", f"Unrecognized request argument supplied: {param}", param) from None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, "invalid_request", f"{param}: {message}" if param else message, param) from None


_TYPE_BY_STATUS = {429: "rate_limit_error", 401: "authentication_error", 403: "permission_error"}


def error_body(error: ApiError) -> dict:
    """Our ApiError in OpenAI's error shape; ``code`` carries our error type."""
    if error.status in _TYPE_BY_STATUS:
        kind = _TYPE_BY_STATUS[error.status]
    elif error.status >= 500 or error.status == 200:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.type}}


def status_for(error: ApiError) -> int:
    # The SDKs raise NotFoundError for 404: an unknown model is a 404 on OpenAI's API.
    return 404 if error.type == "model_not_found" else error.status

