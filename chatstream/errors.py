"""The one error type the endpoint answers with, and how upstream (openai SDK) failures map to it.

Before the first delta an ApiError becomes an HTTP status with a JSON body; after it, the final
``error`` event of the stream. Messages are written for the caller and never carry a secret."""
from __future__ import annotations

from dataclasses import dataclass, field

import openai


@dataclass
class ApiError(Exception):
    status: int
    type: str
    message: str
    param: str | None = None
    retryable: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        error = {"type": self.type, "message": self.message}
        if self.param is not None:
            error["param"] = self.param
        error["retryable"] = self.retryable
        return {"error": error}


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param)


def _upstream_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
    return exc.message


def _retry_after(exc: openai.APIStatusError) -> dict[str, str]:
    headers = exc.response.headers
    if "retry-after" in headers:
        return {"Retry-After": headers["retry-after"]}
    if "retry-after-ms" in headers:
        try:
            return {"Retry-After": str(max(1, round(float(headers["retry-after-ms"]) / 1000)))}
        except ValueError:
            pass
    return {}


def from_upstream(exc: BaseException, model: str, midstream: bool = False) -> ApiError:
    """Map an exception raised by the openai SDK (or its transport) to what the caller sees.
    ``midstream``: text has already been sent (the status is then only informative)."""
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
        return ApiError(502, "upstream_auth", "upstream authentication failed", retryable=False)
    if isinstance(exc, openai.NotFoundError):
        return ApiError(400, "model_not_found", f"model {model!r} is not available on the upstream",
                        param="model")
    if isinstance(exc, openai.RateLimitError):
        return ApiError(429, "rate_limited", _upstream_message(exc), retryable=True, headers=_retry_after(exc))
    if isinstance(exc, openai.BadRequestError) or (isinstance(exc, openai.APIStatusError) and exc.status_code == 422):
        return ApiError(400, "invalid_request", _upstream_message(exc))
    if isinstance(exc, openai.APIStatusError):
        return ApiError(502, "upstream_error", f"the model server failed (HTTP {exc.status_code})",
                        retryable=exc.status_code >= 500 or exc.status_code in (408, 409))
    if isinstance(exc, openai.APIError):  # an error payload inside the stream
        return ApiError(502, "upstream_error", f"the model server reported an error: {exc.message}", retryable=True)
    if isinstance(exc, ValueError):  # a chunk that is not JSON
        return ApiError(502, "upstream_malformed", "the model server sent a malformed chunk", retryable=True)
    return ApiError(500, "internal_error", "the stream failed unexpectedly", retryable=True)
