"""One error hierarchy for everything a caller can be told, and how upstream failures map to it.

Every failure the app reports is an ``ApiError``: a status, a type, a message written for the caller,
a retryable flag, and headers (``Retry-After``). Before the first output an endpoint answers it as an
HTTP status with a JSON body; after it, as the final error event of the stream, each API adapter in
its own wire format. Messages never carry a secret.

Anything else that escapes our code (a ``ValueError``, a ``TypeError``...) is a bug: the endpoint
logs it with its traceback and answers 500 ``internal_error``. Malformed data from the upstream is
never one of those: the upstream code raises ``UpstreamMalformed`` for it."""
from __future__ import annotations

import logging
import math

import openai
from azure.core.exceptions import ClientAuthenticationError

from .record import log_safe

log = logging.getLogger("chatstream")


class ApiError(Exception):
    def __init__(self, status: int, type: str, message: str, param: str | None = None,
                 retryable: bool = False, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.retryable = retryable
        self.headers = headers or {}

    def body(self) -> dict:
        """The error as /api/chat writes it: ``{"error": {"type", "message", "param"?, "retryable"}}``."""
        error = {"type": self.type, "message": self.message}
        if self.param is not None:
            error["param"] = self.param
        error["retryable"] = self.retryable
        return {"error": error}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.type!r}, {self.message!r})"


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param)


class Rejection(ApiError):
    """Raised by a before-step: the caller gets ``status`` with a JSON error body."""

    def __init__(self, status: int, message: str, type: str = "rejected", param: str | None = None):
        super().__init__(status, type, message, param)


class StepFailed(ApiError):
    """A pipeline step raised (or left the request in a state the endpoint cannot serve)."""

    def __init__(self, step: str, message: str | None = None):
        super().__init__(500, "pipeline_error", message or f"the pipeline step {step!r} failed")
        self.step = step


class ModerationStop(ApiError):
    def __init__(self, reason: str):
        super().__init__(400, "content_filter", f"stopped by moderation: {reason}")


class TimeLimit(ApiError):
    """One of the stream's time limits passed (chatstream/limits.py says which)."""

    def __init__(self, type: str, message: str, retryable: bool = True):
        super().__init__(504, type, message, retryable=retryable)


class UpstreamMalformed(ApiError):
    """The upstream sent data that is not what its API promises (not JSON, the wrong shape)."""

    def __init__(self, what: str = "the model server sent a malformed chunk"):
        super().__init__(502, "upstream_malformed", what, retryable=True)


class UpstreamReported(ApiError):
    """The upstream's stream carried an error event of its own (a server-side failure)."""

    def __init__(self, message: str):
        super().__init__(502, "upstream_error", f"the model server reported an error: {message}", retryable=True)


class ClientGone(Exception):
    """The caller hung up (while sending its body, or while waiting). Not an error of anyone's to
    report: it is logged and counted as a disconnect."""


# Sent with every error response: the app has already spent its own upstream retries
# (UPSTREAM_MAX_RETRIES), and the OpenAI SDKs would otherwise retry the whole chain again.
ERROR_HEADERS = {"Cache-Control": "no-store", "x-should-retry": "false"}


def http_errors(*names: str) -> tuple[type[BaseException], ...]:
    """The named exception classes of the SDK's HTTP library (httpx2 in openai 3.x, httpx before)."""
    import importlib
    found = []
    for module in ("httpx2", "httpx"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        found.extend(getattr(mod, n) for n in names if hasattr(mod, n))
    return tuple(found)


# What the upstream call can raise besides our own errors: the SDK's (and its transport's, mapped
# by the SDK or by upstream.py), and azure-identity's when no Entra ID token can be had.
UPSTREAM_ERRORS = (openai.APIError, ClientAuthenticationError)


def upstream_field(exc: openai.APIStatusError, name: str) -> str | None:
    """A string field (``message``, ``param``, ``code``) of the upstream's error body, if any."""
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get(name), str):
            return inner[name]
    return None


def _upstream_message(exc: openai.APIStatusError) -> str:
    return upstream_field(exc, "message") or exc.message


def retry_after(headers) -> dict[str, str]:
    """``Retry-After`` for the caller from an upstream response's headers, if it sent one."""
    if "retry-after" in headers:
        return {"Retry-After": headers["retry-after"]}
    if "retry-after-ms" in headers:
        try:
            seconds = float(headers["retry-after-ms"]) / 1000
        except ValueError:
            return {}
        if math.isfinite(seconds):  # rounded up: coming back a little early would meet the limit again
            return {"Retry-After": str(max(1, math.ceil(seconds)))}
    return {}


def from_upstream(exc: BaseException, model: str, midstream: bool = False) -> ApiError:
    """Map an exception from the upstream call (one of ``UPSTREAM_ERRORS``) to what the caller sees.
    ``midstream``: output has already been sent (the status is then only informative)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ClientAuthenticationError):
        # Not a bug and not the caller's: one line with the credential's own account of what it
        # tried (it names credential types, never a secret), no traceback.
        log.warning("could not get an Entra ID token for Azure OpenAI: %s", log_safe(exc.message or str(exc)))
        return ApiError(503, "upstream_auth_unavailable",
                        "the app could not get an Entra ID token for Azure OpenAI", retryable=True)
    if isinstance(exc, openai.APITimeoutError):
        return ApiError(504, "upstream_timeout", "the model did not answer in time", retryable=True)
    if isinstance(exc, openai.APIConnectionError):
        if midstream:
            return ApiError(502, "upstream_disconnected", "the connection to the model server was lost",
                            retryable=True)
        return ApiError(503, "upstream_unavailable", "could not reach the model server", retryable=True)
    if isinstance(exc, (openai.AuthenticationError, openai.PermissionDeniedError)):
        # Our credentials, not the caller's: say so without the upstream's details (they may
        # quote part of the key).
        return ApiError(502, "upstream_auth", "upstream authentication failed")
    if isinstance(exc, openai.NotFoundError):
        return ApiError(400, "model_not_found", f"model {model!r} is not available on the upstream", "model")
    if isinstance(exc, openai.RateLimitError):
        return ApiError(429, "rate_limited", _upstream_message(exc), retryable=True,
                        headers=retry_after(exc.response.headers))
    if isinstance(exc, openai.BadRequestError) or (isinstance(exc, openai.APIStatusError) and exc.status_code == 422):
        return ApiError(400, "invalid_request", _upstream_message(exc), upstream_field(exc, "param"))
    if isinstance(exc, openai.APIStatusError):
        return ApiError(502, "upstream_error", f"the model server failed (HTTP {exc.status_code})",
                        retryable=exc.status_code >= 500 or exc.status_code in (408, 409))
    if isinstance(exc, openai.APIError):  # an error payload inside the stream
        return ApiError(502, "upstream_error", f"the model server reported an error: {exc.message}", retryable=True)
    raise TypeError(f"not an upstream error: {type(exc).__name__}")  # a bug of ours: the caller's 500
