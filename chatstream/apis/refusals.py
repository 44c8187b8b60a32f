"""The caller key read from a request's headers (``caller_key``: the state gets the key, never the
headers), and the shared state's answers (state/port.py) as a caller sees them: OpenAI's statuses,
codes and wording, ``Retry-After``, ``x-should-retry`` and the ``x-ratelimit-*`` headers. The one
place where a refused key, model or limit becomes HTTP; every route uses it."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..errors import ApiError, ErrorKind, log_safe
from ..pipeline import CallRequest
from ..record import StreamRecord
from ..state.accounting import Accounting, Admission
from ..state.callers import Caller
from ..state.port import KeyRefused, ModelRefused, Rate, Refused, Unavailable, Unknown, Unreadable
from ..state.prices import usd
from .usage import admission_request

_LIMIT_NAME = {
    "tokens_per_minute": "tokens per min (TPM)",
    "requests_per_minute": "requests per min (RPM)",
    "token_budget": "token budget",
    "spend_budget": "spend budget",
}
_PERIOD = {"day": "today (UTC)", "month": "this month (UTC)", "total": "in total"}


def duration(seconds: float) -> str:
    """A time span as OpenAI writes ``x-ratelimit-reset-*``: ``250ms``, ``17.5s``, ``1m3s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{text}" if minutes else text


def rate_headers(rates: Mapping[str, Rate]) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-limit/remaining/reset-{tokens,requests}`` for the tightest limits."""
    headers: dict[str, str] = {}
    for kind, rate in rates.items():
        headers[f"x-ratelimit-limit-{kind}"] = str(rate.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(rate.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = duration(rate.reset_seconds)
    return headers


def store_unavailable() -> ApiError:
    """The store is slow or down: nothing was started, nothing charged."""
    return ApiError(
        503,
        ErrorKind.CALLER_STORE_UNAVAILABLE,
        "the app's caller store did not answer in time; nothing was charged, try again",
        retryable=True,
        headers={"Retry-After": "2"},
    )


def _money(pico: int) -> str:
    amount = usd(pico) or 0.0
    return f"${amount:,.2f}" if amount >= 1 else f"${amount:.6f}".rstrip("0").rstrip(".") if amount else "$0"


def _who(refused: Refused) -> str:
    limit = refused.limit
    who = f"{limit.scope} {log_safe(limit.owner)!r}"
    return f"{who} for model {log_safe(limit.model)[:80]!r}" if limit.model else who


def caller_key(headers: Mapping[str, str]) -> str | None:
    """The caller key a request carries, as OpenAI clients send it (``Authorization: Bearer KEY``)
    or as Azure OpenAI's clients do (``api-key: KEY``); None when it carries neither."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("api-key")
    return key.strip() if key and key.strip() else None


async def authenticated(accounting: Accounting, headers: Mapping[str, str]) -> Caller:
    """The request's caller (by the key its headers carry), or the ApiError that refuses it (401, 503)."""
    found = await accounting.authenticate(caller_key(headers))
    if isinstance(found, Caller):
        return found
    raise error(found)


async def admitted(
    accounting: Accounting, caller: Caller, call: CallRequest, record: StreamRecord, default_max: int
) -> Admission:
    """The request admitted (reserved against every limit), or the ApiError that refuses it. The
    default output cap is added to ``call.params`` when the request named none (apis/usage.py)."""
    found = await accounting.admit(caller, admission_request(call, record, default_max))
    if isinstance(found, Admission):
        return found
    raise error(found)


def error(answer: object) -> ApiError:
    """The ApiError for a refusal of the shared state (anything that is not the admitted object)."""
    if isinstance(answer, KeyRefused):
        message = (
            "This caller key has expired."
            if answer.expired
            else "Incorrect API key provided: the caller key is unknown, revoked or rotated."
        )
        return ApiError(401, ErrorKind.INVALID_API_KEY, message)
    if isinstance(answer, Unavailable):
        return store_unavailable()
    if isinstance(answer, Unreadable):
        name = log_safe(answer.name)[:80]
        whose, path = (f"{answer.scope} {name!r}", f"/api/manage/{answer.scope}s/{name}") if name else ("caller", "")
        return ApiError(
            503,
            ErrorKind.NOT_CONFIGURED,
            f"The record of this key's {whose} is unreadable in the app's store: its requests are refused until "
            f"an admin deletes it{f' (DELETE {path})' if path else ''} and creates it again.",
        )
    if isinstance(answer, ModelRefused):
        model = log_safe(answer.model)[:80]
        if answer.unreadable:
            return ApiError(
                503,
                ErrorKind.NOT_CONFIGURED,
                f"The price of the model {model!r} is unreadable in the app's store: its requests are refused "
                "until an admin sets it again with PUT /api/manage/prices/{model}.",
                "model",
            )
        if answer.unpriced:
            return ApiError(
                400,
                "model_not_priced",
                f"The model {model!r} has no price, and this {answer.scope} has a spend budget: its cost cannot be "
                "held. An admin sets it with PUT /api/manage/prices/{model}.",
                "model",
            )
        return ApiError(
            404,
            ErrorKind.MODEL_NOT_FOUND,
            f"The model {model!r} does not exist or this caller does not have access to it.",
            "model",
        )
    if isinstance(answer, Unknown):
        return ApiError(
            404,
            ErrorKind.NOT_FOUND,
            f"Previous response with id {log_safe(answer.id)[:80]!r} not found.",
            "previous_response_id",
        )
    if isinstance(answer, Refused):
        return _refused(answer)
    raise TypeError(f"not a refusal: {type(answer).__name__}")


def _refused(refused: Refused) -> ApiError:
    limit = refused.limit
    name = _LIMIT_NAME[limit.kind]
    if limit.kind.endswith("_per_minute"):
        if refused.alone:
            return ApiError(
                429,
                ErrorKind.RATE_LIMIT_EXCEEDED,
                f"Request too large for {_who(refused)} on {name}: Limit {refused.value}, Requested "
                f"{refused.requested}. Lower max_tokens (or shorten the prompt) so that prompt + max_tokens fits the "
                "limit.",
            )
        wait = max(1, math.ceil(refused.retry_after or 1))
        return ApiError(
            429,
            ErrorKind.RATE_LIMIT_EXCEEDED,
            f"Rate limit reached for {_who(refused)} on {name}: Limit {refused.value}, Used {refused.used}, "
            f"Requested {refused.requested}. Please try again in {wait}s.",
            retryable=True,
            headers={"Retry-After": str(wait)},
        )
    period = _PERIOD.get(limit.period or "total", "in total")
    owner = f"{limit.scope.capitalize()} {log_safe(limit.owner)!r}"
    if limit.kind == "spend_budget":
        whole, left, need = (
            _money(refused.value),
            _money(max(0, refused.value - refused.used)),
            _money(refused.requested),
        )
        if refused.alone:
            message = (
                f"This request may cost up to {need} (its prompt and max_tokens at the model's price), more than the "
                f"whole spend budget of {owner.lower()} ({whole} {period}): lower max_tokens."
            )
        else:
            message = (
                f"{owner} has {left} of its {whole} spend budget left {period}; this request may cost up to {need} "
                "(its prompt and max_tokens at the model's price). Lower max_tokens, or ask for a larger budget."
            )
    elif refused.alone:
        message = (
            f"This request may need {refused.requested} tokens (prompt + max_tokens), more than the whole token "
            f"budget of {owner.lower()} ({refused.value} {period}): lower max_tokens."
        )
    else:
        message = (
            f"{owner} has {max(0, refused.value - refused.used)} of its {refused.value} budget tokens left {period}; "
            f"this request may need {refused.requested} (prompt + max_tokens). Lower max_tokens, or ask for a "
            "larger budget."
        )
    return ApiError(429, ErrorKind.INSUFFICIENT_QUOTA, message)
