"""Everything a caller can be told went wrong, as one hierarchy::

    Exception
    ├── ApiError                 a status, an ErrorKind, a message for the caller, retryable, headers
    │   ├── Rejection            a before-step refused the request (its own 4xx)
    │   ├── StepFailed           a pipeline step raised, or left what the endpoint cannot serve (500)
    │   ├── ModerationStop       the moderation check stopped the stream (content_filter)
    │   ├── TimeLimit            first-token, idle or total limit passed (504; stream.TimeLimits)
    │   ├── UpstreamMalformed    the upstream sent what its API does not allow: not JSON, wrong shape (502)
    │   └── UpstreamReported     the upstream's stream carried an error event (502)
    ├── ClientGone               the caller hung up: nobody to tell (logged as a disconnect)
    └── StoreError               the shared store (Azure Tables/Blobs), mapped once at its edge (state/store_azure.py)
        ├── StoreUnavailable     no usable answer: no connection, a 5xx, throttling, an authorization failure
        │   └── StoreTimeout     no answer within the call's bound (the call may still be applied later)
        ├── NotFound             the row or blob is not there
        ├── AlreadyExists        an insert found the row (or blob) there
        └── Modified             a condition failed: the ETag, or an append blob's position

Before the first output an endpoint answers an ApiError as an HTTP status with the API's JSON body;
after it, as the stream's final error event, each API in its own wire format. Messages never carry
a secret. What the upstream SDK raises becomes an ApiError in one place, ``upstreams/outcomes.py``
(``classify``), which also says what the failure means for the pool entry. What the storage SDKs
raise becomes a StoreError in one place, ``state/store_azure.py`` (``store_error``); the state layer
answers the request path in domain results (``state/port.py``), only the HTTP layer in statuses.
Anything else that escapes our code is a bug: answered as 500 ``internal_error``, logged with its
traceback."""

from __future__ import annotations

import email.utils
import importlib
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class ErrorKind(StrEnum):
    """The ``type`` (/api/chat) or ``code`` (OpenAI shape) of every error the app reports."""

    INVALID_REQUEST = "invalid_request"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    REQUEST_TOO_LARGE = "request_too_large"
    PROMPT_TOO_LONG = "prompt_too_long"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_ALLOWED = "model_not_allowed"
    REJECTED = "rejected"
    CONTENT_FILTER = "content_filter"
    PIPELINE_ERROR = "pipeline_error"
    INTERNAL_ERROR = "internal_error"
    NOT_CONFIGURED = "not_configured"
    RATE_LIMITED = "rate_limited"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_AUTH = "upstream_auth"
    UPSTREAM_AUTH_UNAVAILABLE = "upstream_auth_unavailable"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_DISCONNECTED = "upstream_disconnected"
    UPSTREAM_INCOMPLETE = "upstream_incomplete"
    UPSTREAM_MALFORMED = "upstream_malformed"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    TOTAL_TIMEOUT = "total_timeout"
    RESPONSES_NOT_SUPPORTED = "responses_not_supported"
    # Callers (CALLER_KEYS=required): OpenAI's own codes where OpenAI has one.
    INVALID_API_KEY = "invalid_api_key"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    INSUFFICIENT_QUOTA = "insufficient_quota"
    CALLER_STORE_UNAVAILABLE = "caller_store_unavailable"
    # Resumable streams.
    STREAM_LOST = "stream_lost"  # the stream is over and could not be made whole: send again
    STREAM_MOVED = "stream_moved"  # this reading ends, the stream goes on elsewhere: resume it
    STREAM_STORE_UNAVAILABLE = "stream_store_unavailable"
    # The instance is shutting down (a deploy, a restart): lifecycle.py.
    INSTANCE_DRAINING = "instance_draining"


_KINDS = frozenset(ErrorKind)


@dataclass(frozen=True, slots=True)
class ProviderError:
    """What the upstream's own error object said: passed on to the caller as it came (docs/openai.md),
    since clients branch on the provider's codes (``context_length_exceeded``). Strings, or None."""

    code: str | None = None
    type: str | None = None
    param: str | None = None


def error_field(body: object, name: str) -> str | None:
    """A string field (``message``, ``code``, ``type``, ``param``) of an upstream's error body
    (``{"error": {...}}`` or the object itself), never with a key the app holds (``redact``); None
    when it has no such string."""
    inner = body.get("error", body) if isinstance(body, dict) else None
    value = inner.get(name) if isinstance(inner, dict) else None
    return redact(value) if isinstance(value, str) and value else None


def provider_error(body: object) -> ProviderError | None:
    """The ``code``, ``type`` and ``param`` of an upstream's error body, each a string or None (vLLM's
    numeric ``code`` is a status, not a code); None when the body is no error object."""
    inner = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(inner, dict) or not any(name in inner for name in ("code", "type", "message")):
        return None
    return ProviderError(error_field(body, "code"), error_field(body, "type"), error_field(body, "param"))


class ApiError(Exception):
    """``type``: an ErrorKind, or a string of a before-step's own (Rejection). ``provider``: the
    upstream's own error, when this is one the upstream reported."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        param: str | None = None,
        retryable: bool = False,
        headers: Mapping[str, str] | None = None,
        provider: ProviderError | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.type: str = ErrorKind(type) if type in _KINDS else type
        self.message = message
        self.param = param
        self.retryable = retryable
        self.headers: dict[str, str] = dict(headers or {})
        self.provider = provider

    def body(self) -> dict:
        """The error as /api/chat writes it: ``{"error": {"type", "message", "param"?, "code"?,
        "upstream_type"?, "retryable"}}`` (``code`` and ``upstream_type``: the upstream's own)."""
        error: dict[str, object] = {"type": str(self.type), "message": self.message}
        if self.param is not None:
            error["param"] = self.param
        if self.provider is not None and self.provider.code is not None:
            error["code"] = self.provider.code
        if self.provider is not None and self.provider.type is not None:
            error["upstream_type"] = self.provider.type
        error["retryable"] = self.retryable
        return {"error": error}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {str(self.type)!r}, {self.message!r})"


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, ErrorKind.INVALID_REQUEST, message, param)


class Rejection(ApiError):
    def __init__(self, status: int, message: str, type: str = ErrorKind.REJECTED, param: str | None = None):
        super().__init__(status, type, message, param)


class StepFailed(ApiError):
    def __init__(self, step: str, message: str | None = None):
        super().__init__(500, ErrorKind.PIPELINE_ERROR, message or f"the pipeline step {step!r} failed")
        self.step = step


class ModerationStop(ApiError):
    def __init__(self, reason: str):
        super().__init__(400, ErrorKind.CONTENT_FILTER, f"stopped by moderation: {reason}")


class TimeLimit(ApiError):
    def __init__(self, type: str, message: str, retryable: bool = True):
        super().__init__(504, type, message, retryable=retryable)


class UpstreamMalformed(ApiError):
    def __init__(self, what: str = "the model server sent a malformed chunk"):
        super().__init__(502, ErrorKind.UPSTREAM_MALFORMED, what, retryable=True)


class UpstreamReported(ApiError):
    def __init__(self, message: str, provider: ProviderError | None = None):
        super().__init__(
            502,
            ErrorKind.UPSTREAM_ERROR,
            f"the model server reported an error: {redact(message)}",
            param=provider.param if provider is not None else None,
            retryable=True,
            provider=provider,
        )


class ClientGone(Exception): ...


class StoreError(Exception):
    """Raised by the store, and by the state modules when a row kept changing under them; its
    message never carries a key or a SAS. A batch's error says which operation failed (``index``)."""

    index: int | None = None


class StoreUnavailable(StoreError): ...


class StoreTimeout(StoreUnavailable): ...  # a write may still land later: writes are idempotent


class NotFound(StoreError): ...


class AlreadyExists(StoreError): ...


class Modified(StoreError): ...


def first_token_expired() -> TimeLimit:
    return TimeLimit(ErrorKind.UPSTREAM_TIMEOUT, "no first token within the time limit")


def idle_expired() -> TimeLimit:
    return TimeLimit(ErrorKind.UPSTREAM_TIMEOUT, "the model stopped sending within the idle limit")


def total_expired() -> TimeLimit:
    # Not retryable: the same request would hit the same limit again, generating (and paying) as long.
    return TimeLimit(ErrorKind.TOTAL_TIMEOUT, "the stream hit its total time limit", retryable=False)


def incomplete() -> ApiError:
    return ApiError(
        502, ErrorKind.UPSTREAM_INCOMPLETE, "the model server ended the stream without a finish reason", retryable=True
    )


def instance_draining() -> ApiError:
    """This instance is shutting down (lifecycle.py): a new request, or the rest of a stream cut at the
    end of the drain, belongs on another instance. The SDKs may retry it (``x-should-retry: true``):
    no upstream call was made for a refused request, and a retry reaches another instance."""
    return ApiError(
        503,
        ErrorKind.INSTANCE_DRAINING,
        "this instance is shutting down (a deploy or a restart): retry the request, another instance takes it",
        retryable=True,
        headers={"Retry-After": "1"},
    )


def internal_error() -> ApiError:
    return ApiError(500, ErrorKind.INTERNAL_ERROR, "the request failed unexpectedly", retryable=True)


# Failures of the upstream: retryable inside the app (the pool tries its next entry, an answer goes
# on on another), but when one reaches the caller as a status the app has already spent its own
# retries (UPSTREAM_MAX_RETRIES) or answers from an upstream's cooldown: sending it again at once
# would repeat them (the OpenAI SDKs 3 x 3 upstream calls for one call). ``Retry-After`` says when.
_RETRIED = frozenset(
    {
        ErrorKind.RATE_LIMITED,
        ErrorKind.UPSTREAM_UNAVAILABLE,
        ErrorKind.UPSTREAM_AUTH,
        ErrorKind.UPSTREAM_AUTH_UNAVAILABLE,
        ErrorKind.UPSTREAM_ERROR,
        ErrorKind.UPSTREAM_DISCONNECTED,
        ErrorKind.UPSTREAM_INCOMPLETE,
        ErrorKind.UPSTREAM_MALFORMED,
        ErrorKind.UPSTREAM_TIMEOUT,
        ErrorKind.INTERNAL_ERROR,  # a bug of ours, maybe after the upstream call
    }
)


def as_status(error: ApiError) -> ApiError:
    """The error as an HTTP status tells the caller: ``retryable`` only where sending the same request
    again can succeed without repeating upstream calls the app made for it (a per-minute limit, the
    store, a draining instance); an upstream failure is not (``_RETRIED``). A final error event keeps
    the error's own ``retryable``."""
    if not error.retryable or error.type not in _RETRIED:
        return error
    return ApiError(
        error.status, error.type, error.message, error.param, False, error.headers, error.provider
    )  # the upstream's own code, type and param kept


def http_errors(*names: str) -> tuple[type[BaseException], ...]:
    """The named exception classes of the SDK's HTTP library (httpx2 in openai 3.x, httpx before):
    the first of the two found, so that httpx, which only the tests use beside openai 3.x, is not
    imported by the app."""
    for module in ("httpx2", "httpx"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        return tuple(getattr(mod, n) for n in names if hasattr(mod, n))
    return ()


# --- Retry-After ------------------------------------------------------------------------------

# A caller is never told to wait longer than this, whatever an upstream said.
MAX_RETRY_AFTER = 3600


def _number(value: str) -> float | None:
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def parse_retry_after(headers: Mapping[str, str], wall_now: float | None = None) -> float | None:
    """The seconds an upstream's ``Retry-After`` (delay-seconds or an HTTP-date) or
    ``retry-after-ms`` ask for; None when neither says anything usable. Garbage, NaN, infinities and
    negative values are nothing usable; 0 and a past date are 0 (the caller of this decides what a
    zero means). Header names in any case."""
    lower = {k.lower(): v for k, v in headers.items()}
    found: list[float] = []
    raw = lower.get("retry-after")
    if raw is not None:
        seconds = _number(raw)
        if seconds is None:
            try:
                when = email.utils.parsedate_to_datetime(raw)
            except (TypeError, ValueError, IndexError, OverflowError):
                when = None
            if when is not None and when.tzinfo is not None:
                seconds = when.timestamp() - (time.time() if wall_now is None else wall_now)
                seconds = max(seconds, 0.0)
        if seconds is not None and seconds >= 0:
            found.append(seconds)
    ms = _number(lower["retry-after-ms"]) if "retry-after-ms" in lower else None
    if ms is not None and ms >= 0:
        found.append(ms / 1000)
    return max(found) if found else None


def retry_after_headers(seconds: float | None, ms: bool = False) -> dict[str, str]:
    """What a caller is told: ``Retry-After`` in whole seconds (rounded up, at least 1, at most
    MAX_RETRY_AFTER), plus ``retry-after-ms`` when asked (the upstream gave one)."""
    if seconds is None or not math.isfinite(seconds):
        return {}
    bounded = min(max(seconds, 0.0), float(MAX_RETRY_AFTER))
    headers = {"Retry-After": str(max(1, math.ceil(bounded)))}
    if ms:
        headers["retry-after-ms"] = str(max(1, math.ceil(bounded * 1000)))
    return headers


# --- secrets ----------------------------------------------------------------------------------

# Every upstream key the app was configured with, and every Entra ID token it obtained: an upstream
# may quote them back (an error message repeating the Authorization header), so any upstream text
# passed on to a caller or written to a log goes through ``redact`` first.
_SECRETS: set[str] = set()
_MIN_SECRET = 8  # shorter values would redact ordinary words (a test key like "x")
REDACTED = "[redacted]"


def register_secret(value: str | None) -> None:
    if value and len(value) >= _MIN_SECRET:
        _SECRETS.add(value)


def redact(text: str) -> str:
    """``text`` without any registered secret."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


class _Redacting(logging.Filter):
    """``redact`` on every message and traceback the app's logger writes (exceptions included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


logging.getLogger("chatstream").addFilter(_Redacting())


# Characters that could forge or garble a log line: C0 and C1 controls (newlines among them; JSON
# output has its C0 escaped already), Unicode line and paragraph separators, the bidi overrides.
_UNSAFE_IN_LOGS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def log_safe(text: str) -> str:
    """``text`` (already JSON, or any caller-chosen string) with every character that could start a
    new log line or hide part of one escaped as ``\\uXXXX``, and without any upstream key or token."""
    return _UNSAFE_IN_LOGS.sub(lambda m: f"\\u{ord(m.group()):04x}", redact(text))
