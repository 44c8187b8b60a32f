"""What a failed upstream call means, in one place: ``classify(exc)`` gives what the caller is told
(an ``ApiError``) and what the pool records for the entry (an ``Outcome``: cooldown, breaker,
failover). Every upstream failure goes through it, streamed or not, and so do our own errors about
what the upstream sent (a malformed chunk, a stream that ended early)."""

from __future__ import annotations

import logging
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, TypeGuard

import openai

from ..errors import (
    ApiError,
    ErrorKind,
    TimeLimit,
    error_field,
    first_token_expired,
    http_errors,
    internal_error,
    log_safe,
    parse_retry_after,
    provider_error,
    redact,
    retry_after_headers,
)

if TYPE_CHECKING:
    from azure.core.exceptions import ClientAuthenticationError

log = logging.getLogger("chatstream")


def _no_entra_token(exc: BaseException) -> TypeGuard[ClientAuthenticationError]:
    """azure-identity's error when no Entra ID token can be had. azure-core defines it and is imported
    only with a setting that needs it (Entra ID, the store): not loaded, no such error exists."""
    exceptions = sys.modules.get("azure.core.exceptions")
    return exceptions is not None and isinstance(exc, exceptions.ClientAuthenticationError)


class OutcomeKind(StrEnum):
    SUCCESS = "success"  # the first delta arrived (or the call succeeded)
    RATE_LIMITED = "rate_limited"  # 429: this entry's deployment cools down
    QUOTA_EXHAUSTED = "quota_exhausted"  # 429 insufficient_quota (billing): cools down for the maximum
    CONNECT_FAILED = "connect_failed"  # no connection (refused, DNS, TLS, connect timeout): nothing was sent
    CONNECTION_LOST = "connection_lost"  # connected, then the connection broke
    TIMEOUT = "timeout"  # no answer / first token in time
    SERVER_ERROR = "server_error"  # 5xx, 408, 409, an error event or a malformed chunk from the server
    AUTH_ERROR = "auth_error"  # 401/403: our configuration (key, role), not the entry's health
    CONTEXT_LENGTH = "context_length"  # 400 context_length_exceeded: too long for this entry's model
    CONTENT_FILTER = "content_filter"  # 400 content_policy_violation / content_filter: the prompt refused
    CLIENT_ERROR = "client_error"  # other 4xx (400, 404, 413, 422 …): the request's problem
    OTHER = "other"  # not an upstream failure (a bug of ours): no effect on the entry


# The entry's own failures: they count against its breaker.
HEALTH_FAILURE = frozenset(
    {OutcomeKind.CONNECT_FAILED, OutcomeKind.CONNECTION_LOST, OutcomeKind.TIMEOUT, OutcomeKind.SERVER_ERROR}
)
COOLDOWN = frozenset({OutcomeKind.RATE_LIMITED, OutcomeKind.QUOTA_EXHAUSTED})  # the deployment cools down
FAILOVER = HEALTH_FAILURE | COOLDOWN  # the request moves on to the next candidate
# The server answered: a probe that gets one of these proves the entry reachable.
ANSWERED = frozenset(OutcomeKind) - HEALTH_FAILURE - {OutcomeKind.OTHER}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt on an entry came to. ``cooldown``: for a 429, the seconds its headers ask
    for (None when they said nothing usable). ``failover``: the request goes on to the next
    candidate (only before the first output)."""

    kind: OutcomeKind
    status: int | None = None
    cooldown: float | None = None
    failover: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "failover", self.kind in FAILOVER)


SUCCESS = Outcome(OutcomeKind.SUCCESS)
TIMED_OUT = Outcome(OutcomeKind.TIMEOUT)


# The codes providers give these 400s: OpenAI's and Azure OpenAI's; vLLM and other compatible
# servers say it only in words ("This model's maximum context length is 4096 tokens. ...").
_CONTEXT_LENGTH_CODES = frozenset({"context_length_exceeded"})
_CONTENT_FILTER_CODES = frozenset({"content_policy_violation", "content_filter"})


def outcome_of_status(
    status: int, headers: Mapping[str, str] | None = None, code: str | None = None, message: str | None = None
) -> Outcome:
    """An HTTP error status (and, for 429, its headers; the error's ``code`` and ``message``)."""
    if status == 400 and (code in _CONTEXT_LENGTH_CODES or "maximum context length" in (message or "").lower()):
        return Outcome(OutcomeKind.CONTEXT_LENGTH, status)
    if status == 400 and code in _CONTENT_FILTER_CODES:
        return Outcome(OutcomeKind.CONTENT_FILTER, status)
    if status == 429:
        if code == "insufficient_quota":
            return Outcome(OutcomeKind.QUOTA_EXHAUSTED, status)
        return Outcome(OutcomeKind.RATE_LIMITED, status, cooldown_from_headers(headers or {}))
    if status in (401, 403):
        return Outcome(OutcomeKind.AUTH_ERROR, status)
    if status >= 500 or status in (408, 409):
        return Outcome(OutcomeKind.SERVER_ERROR, status)
    if 400 <= status < 500:
        return Outcome(OutcomeKind.CLIENT_ERROR, status)
    return Outcome(OutcomeKind.OTHER, status)


# --- 429 headers ------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def _duration(value: str) -> float | None:
    """``12``, ``0.5`` (Azure: seconds) or ``6m0s``, ``1s``, ``20ms`` (OpenAI: a duration)."""
    value = value.strip()
    try:
        return float(value)
    except ValueError:
        pass
    pos, seconds = 0, 0.0
    for match in _DURATION.finditer(value):
        if match.start() != pos:
            return None
        seconds += float(match.group(1)) * _UNIT[match.group(2)]
        pos = match.end()
    return seconds if 0 < pos == len(value) else None


def cooldown_from_headers(headers: Mapping[str, str], wall_now: float | None = None) -> float | None:
    """Seconds a 429's headers ask to wait: the largest of ``Retry-After`` (seconds or HTTP-date),
    ``retry-after-ms`` and ``x-ratelimit-reset-requests`` / ``x-ratelimit-reset-tokens`` (seconds
    on Azure, a duration such as ``6m0s`` on OpenAI). A 429 does not say which limit tripped, so
    the latest one is the only wait sure to be past it. Values that are not finite and positive are
    ignored (Azure sends ``0`` and ``-1`` as placeholders; a past date is no wait either): None
    when nothing usable is left, and the pool uses its default."""
    found = [parse_retry_after(headers, wall_now) or 0.0]
    lower = {k.lower(): v for k, v in headers.items()}
    for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
        seconds = _duration(lower[name]) if name in lower else None
        if seconds is not None and seconds == seconds and seconds != float("inf"):
            found.append(seconds)
    longest = max(found)
    return longest if longest > 0 else None


# --- exceptions --------------------------------------------------------------------------------

_CONNECT_ERRORS = (*http_errors("ConnectError", "ConnectTimeout"), ConnectionRefusedError, socket.gaierror)


def _connect_failure(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, _CONNECT_ERRORS):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


@dataclass(frozen=True, slots=True)
class Classified:
    error: ApiError  # what the caller is told
    outcome: Outcome  # what the pool records for the entry


def classify(exc: BaseException, model: str = "", *, midstream: bool = False) -> Classified:
    """An exception from an upstream call (opening it, reading it, or our own error about what it
    sent) → what the caller is told and what the entry's health records. ``midstream``: output has
    already been sent (the status is then only informative). Anything that is not about the
    upstream is a bug of ours: 500, and no effect on the entry."""
    if isinstance(exc, ApiError):
        return Classified(exc, _own_outcome(exc))
    if _no_entra_token(exc):
        # Not a bug and not the caller's: one line with the credential's own account of what it
        # tried (it names credential types, never a secret), no traceback.
        log.warning("could not get an Entra ID token for Azure OpenAI: %s", log_safe(redact(exc.message or str(exc))))
        return Classified(
            ApiError(
                503,
                ErrorKind.UPSTREAM_AUTH_UNAVAILABLE,
                "the app could not get an Entra ID token for Azure OpenAI",
                retryable=True,
            ),
            Outcome(OutcomeKind.OTHER),
        )
    if isinstance(exc, openai.APIStatusError):
        outcome = outcome_of_status(exc.status_code, exc.response.headers, _code(exc), error_field(exc.body, "message"))
        return Classified(_status_error(exc, model, outcome), outcome)
    if isinstance(exc, openai.APITimeoutError):  # before APIConnectionError: it is a subclass
        kind = OutcomeKind.CONNECT_FAILED if _connect_failure(exc) else OutcomeKind.TIMEOUT
        return Classified(
            ApiError(504, ErrorKind.UPSTREAM_TIMEOUT, "the model did not answer in time", retryable=True), Outcome(kind)
        )
    if isinstance(exc, openai.APIConnectionError):
        return _connection_failure(exc, midstream)
    if isinstance(exc, TimeoutError):  # the per-entry first-token limit
        return Classified(first_token_expired(), TIMED_OUT)
    if isinstance(exc, openai.APIError):  # an error payload inside the stream
        status = event_status(exc.body)
        provider = provider_error(exc.body)
        param = provider.param if provider is not None else None
        if status is not None and _requests_fault(status):  # a 4xx-shaped event: the request's problem
            message, retryable, kind = "the model server refused the request", False, OutcomeKind.CLIENT_ERROR
        else:
            message, retryable, kind = "the model server reported an error", True, OutcomeKind.SERVER_ERROR
        error = ApiError(
            502, ErrorKind.UPSTREAM_ERROR, f"{message}: {redact(exc.message)}", param, retryable, provider=provider
        )
        return Classified(error, Outcome(kind, status))
    return Classified(internal_error(), Outcome(OutcomeKind.OTHER))


# An error event's ``type`` when it carries no status: OpenAI's error types, and the exception names
# vLLM and other OpenAI-compatible servers put there.
_TYPE_STATUS = {
    "invalid_request_error": 400,
    "badrequesterror": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "notfounderror": 404,
    "rate_limit_error": 429,
    "server_error": 500,
    "internalservererror": 500,
}


def event_status(body: object) -> int | None:
    """The HTTP status an error event's body is shaped like: its numeric ``code`` or ``status``
    (vLLM sends ``"code": 400``), else what its ``type`` means; None when it says neither (a server
    error, as OpenAI's own mid-stream errors)."""
    if not isinstance(body, dict):
        return None
    for name in ("code", "status", "status_code"):
        value = body.get(name)
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599:
            return value
    kind = body.get("type")
    return _TYPE_STATUS.get(kind.lower()) if isinstance(kind, str) else None


def _requests_fault(status: int) -> bool:
    return 400 <= status < 500 and status not in (408, 409, 429)


_CONTINUABLE = frozenset(
    {
        ErrorKind.UPSTREAM_DISCONNECTED,  # the connection broke
        ErrorKind.UPSTREAM_ERROR,  # an error event shaped like a server error (retryable)
        ErrorKind.UPSTREAM_TIMEOUT,  # no chunk within the idle limit
        ErrorKind.UPSTREAM_MALFORMED,  # undecodable data
        ErrorKind.UPSTREAM_INCOMPLETE,  # the body ended without a finish reason
    }
)


def may_continue(error: ApiError) -> bool:
    """Whether an answer that failed with ``error`` after output went to the caller may go on on
    another entry (continuation.py): after the upstream's own failures, never a time limit of the
    caller's, a moderation stop or a bug of ours."""
    return error.retryable and error.type in _CONTINUABLE


def _connection_failure(exc: openai.APIConnectionError, midstream: bool) -> Classified:
    """No connection at all (503: nothing was sent), or one the server cut (502: it answered, then
    dropped it, before or after the first output)."""
    if _connect_failure(exc):
        return Classified(
            ApiError(503, ErrorKind.UPSTREAM_UNAVAILABLE, "could not reach the model server", retryable=True),
            Outcome(OutcomeKind.CONNECT_FAILED),
        )
    message = (
        "the connection to the model server was lost"
        if midstream
        else "the model server cut the connection before its first output"
    )
    return Classified(
        ApiError(502, ErrorKind.UPSTREAM_DISCONNECTED, message, retryable=True), Outcome(OutcomeKind.CONNECTION_LOST)
    )


def _own_outcome(error: ApiError) -> Outcome:
    if error.type in (ErrorKind.UPSTREAM_MALFORMED, ErrorKind.UPSTREAM_ERROR, ErrorKind.UPSTREAM_INCOMPLETE):
        return Outcome(OutcomeKind.SERVER_ERROR)
    if isinstance(error, TimeLimit) and error.type == ErrorKind.UPSTREAM_TIMEOUT:  # a first-token limit
        return TIMED_OUT
    return Outcome(OutcomeKind.OTHER)


def _code(exc: openai.APIStatusError) -> str | None:
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) else error_field(exc.body, "code")


def _status_error(exc: openai.APIStatusError, model: str, outcome: Outcome) -> ApiError:
    """What the caller is told of an upstream's error answer: its status mapped to ours, with the
    upstream's own ``code``, ``type`` and ``param`` (``provider``) passed on, except for 401/403,
    which are about our credentials, not the caller's."""
    status = exc.status_code
    message = error_field(exc.body, "message") or redact(exc.message)
    if status in (401, 403):
        return ApiError(502, ErrorKind.UPSTREAM_AUTH, "upstream authentication failed")
    provider = provider_error(exc.body)
    param = provider.param if provider is not None else None
    if status == 404:
        return ApiError(
            400,
            ErrorKind.MODEL_NOT_FOUND,
            f"model {model!r} is not available on the upstream",
            param or "model",
            provider=provider,
        )
    if status == 429:
        headers = exc.response.headers
        wait = parse_retry_after(headers)
        return ApiError(
            429,
            ErrorKind.RATE_LIMITED,
            message,
            param,
            retryable=True,
            headers=retry_after_headers(wait, ms="retry-after-ms" in headers),
            provider=provider,
        )
    if status in (400, 422):
        return ApiError(400, ErrorKind.INVALID_REQUEST, message, param, provider=provider)
    return ApiError(
        502,
        ErrorKind.UPSTREAM_ERROR,
        f"the model server failed (HTTP {status})",
        param,
        retryable=outcome.kind is OutcomeKind.SERVER_ERROR,
        provider=provider,
    )
