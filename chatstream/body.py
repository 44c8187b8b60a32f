"""Reading a request body, the same for every API: the content type, the size limit (413 as soon
as it is known, without reading the rest) and strict JSON."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from .errors import ApiError, ClientGone, invalid_request

M = TypeVar("M", bound=BaseModel)

# curl -d sends application/x-www-form-urlencoded unless told otherwise; a JSON body is never valid
# form data for these endpoints, so that type (and none at all) is read as JSON. Anything else is
# 415. (Cross-site form posts are refused by origin, before this: docs/deploy.md.)
_ACCEPTED_AS_JSON = {"", "application/json", "application/x-www-form-urlencoded"}


def require_json_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media not in _ACCEPTED_AS_JSON and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, "unsupported_media_type", "send the body as Content-Type: application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` (the rest is not read).
    A caller that hangs up while sending it raises ``ClientGone``."""
    too_large = ApiError(413, "request_too_large", f"the body exceeds {limit} bytes")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise ClientGone() from None
    return bytes(body)


MAX_DEPTH = 128  # JSON nesting a request may have: far beyond any API's, and bounded for our recursion


def _too_deep(value) -> bool:
    """Whether ``value`` nests deeper than MAX_DEPTH (iterative: it must not recurse itself)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > MAX_DEPTH:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


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


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: valid JSON syntax, but no JSON encoder can send it on
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def parse_json_body(raw: bytes) -> object:
    """Strict JSON: UTF-8 only, no NaN/Infinity (nor numbers that overflow to it), no lone
    surrogates, bounded nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_request("the body is not valid UTF-8") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite)
    except RecursionError:
        raise invalid_request("the body is nested too deeply") from None
    except ValueError as exc:
        raise invalid_request(f"the body is not valid JSON: {exc}") from None
    if _too_deep(data):
        raise invalid_request(f"the body is nested deeper than {MAX_DEPTH} levels")
    if _has_lone_surrogate(data):
        raise invalid_request("the body contains an unpaired UTF-16 surrogate escape")
    return data


def validate_object(model: type[M], data: object, describe: Callable[[dict], tuple[str, str | None]]) -> M:
    """``data`` as an API's request model, or a 400: ``describe`` turns pydantic's error into the
    API's (message, param). Of several errors, the first that is not a union branch's type mismatch
    is the one that says what is wrong (for ``stop: ["a", ""]``: the empty item, not "not a string")."""
    if not isinstance(data, dict):
        raise invalid_request("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        telling = [e for e in errors if not e["type"].endswith("_type")] if len(errors) > 1 else []
        message, param = describe((telling or errors)[0])
        raise invalid_request(message, param) from None
