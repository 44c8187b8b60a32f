"""Callers: who may call the model routes, with their own keys and limits (docs/callers.md). Here: a
caller, its key (made, hashed, read from a request), and what an admin may say about it (validated);
the registry that keeps them is registry.py.

A caller has a name (admin-chosen), optional limits (tokens and requests per minute, a token budget
per day, month or in total), optionally the models it may use and an expiry. Its key is shown once,
when it is created or rotated; the store keeps only the key's SHA-256.

Table ``chatstreamCallers``, one partition (``callers``), so that every change is one atomic
entity-group transaction:

- ``c|<name>``: the caller (limits, models, expiry, created, key hash and hint);
- ``k|<sha256 of the key>``: the key index, holding a copy of the caller, so that authenticating a
  key is one point read. Create, update, rotate and delete change both rows in one transaction,
  the caller row under its ETag (two admins patching at once do not lose an update).

``CallerRegistry.authenticate`` caches each answer (a caller, or "no such key") per instance for
``cache_seconds``: a revoked or rotated key stops working on every instance within that time, and a
key check costs a store read only once per key, instance and period."""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from ..errors import ApiError, invalid_request

log = logging.getLogger("chatstream")

KEY_PREFIX = "csk-"
KEY_BYTES = 32  # 256 random bits: base64url, 43 characters after the prefix
_KEY_SHAPE = re.compile(r"csk-[A-Za-z0-9_-]{43}")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# The bounds of a caller's settings (docs/callers.md, "Limits").
MAX_TOKENS_PER_MINUTE = 1_000_000_000
MAX_REQUESTS_PER_MINUTE = 1_000_000
MAX_TOKEN_BUDGET = 1_000_000_000_000
MAX_MODELS = 100
MAX_MODEL_NAME = 256
MAX_CACHED_KEYS = 10_000  # key answers (callers and "no such key") kept per instance, least recent dropped

PARTITION = "callers"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

PositiveTokens = Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_PER_MINUTE)]
PositiveRequests = Annotated[StrictInt, Field(ge=1, le=MAX_REQUESTS_PER_MINUTE)]
PositiveBudget = Annotated[StrictInt, Field(ge=1, le=MAX_TOKEN_BUDGET)]
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_NAME)]
Period = Literal["day", "month", "total"]


def hash_key(key: str) -> str:
    """The stored form of a key. A fast hash is right here: the key is 256 random bits, so nobody
    can guess it from its hash however many hashes per second they try; slow, salted password
    hashes (bcrypt, argon2) exist for low-entropy passwords, would cost milliseconds per check, and
    their salt would rule out the point-read index."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The caller key a request carries, as OpenAI clients send it (``Authorization: Bearer KEY``)
    or as Azure OpenAI's clients do (``api-key: KEY``); None when it carries neither."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("api-key")
    return key.strip() if key and key.strip() else None


@dataclass(frozen=True, kw_only=True)
class Caller:
    """A caller as the request path sees it (never its key)."""

    name: str
    id: str  # made at creation: a caller deleted and created again under its name starts afresh
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    token_budget: int | None = None
    budget_period: Period = "total"
    models: tuple[str, ...] | None = None
    expires_at: datetime | None = None
    created_at: datetime
    key_hint: str = ""  # the key's last 4 characters, to tell keys apart

    @property
    def limits_partition(self) -> str:
        """Its counters' partition in ``chatstreamLimits`` (chatstream/state/quota.py)."""
        return f"{self.name}|{self.id}"

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at.timestamp() <= now

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def require_model(self, model: str) -> None:
        """A 404 ``model_not_found`` (OpenAI's answer for a model one may not use) unless allowed."""
        if not self.allows(model):
            raise ApiError(
                404,
                "model_not_found",
                f"The model {model!r} does not exist or this caller does not have access to it.",
                "model",
            )

    def public(self) -> dict[str, Any]:
        """The caller as the admin API shows it: everything but the key (its last 4 characters only)."""
        return {
            "object": "caller",
            "name": self.name,
            "id": self.id,
            "tokens_per_minute": self.tokens_per_minute,
            "requests_per_minute": self.requests_per_minute,
            "token_budget": self.token_budget,
            "budget_period": self.budget_period,
            "models": list(self.models) if self.models is not None else None,
            "expires_at": _iso(self.expires_at),
            "created_at": _iso(self.created_at),
            "key_hint": self.key_hint,
        }


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z") if value is not None else None


class _Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens_per_minute: PositiveTokens | None = None
    requests_per_minute: PositiveRequests | None = None
    token_budget: PositiveBudget | None = None
    budget_period: Period = "total"
    models: Annotated[list[ModelName], Field(min_length=1, max_length=MAX_MODELS)] | None = None
    expires_at: AwareDatetime | None = None

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: list[str] | None) -> list[str] | None:
        if models is None:
            return None
        for i, model in enumerate(models):
            if _CONTROL.search(model) or model != model.strip():
                raise ValueError(f"models[{i}] has control characters or surrounding spaces")
        if len(set(models)) != len(models):
            raise ValueError("names a model twice")
        return models

    @field_validator("expires_at")
    @classmethod
    def _in_range(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.year > 9000:
            raise ValueError("must be before the year 9000")
        return value


class CallerSpec(_Limits):
    """``POST /api/manage/callers``."""

    name: str

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: object) -> object:
        if isinstance(value, str) and not NAME_PATTERN.fullmatch(value):
            raise ValueError("must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value


class CallerPatch(_Limits):
    """``PATCH /api/manage/callers/{name}``: the fields given change (``null`` removes a limit, the
    model list or the expiry); the name cannot change."""

    budget_period: Period | None = None  # type: ignore[assignment] - a patch may leave it out (the base requires it)


def _describe(exc: ValidationError) -> ApiError:
    """pydantic's first error as a 400 naming the field (never echoing the value)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    if param is not None and len(param) > 64:
        param = param[:64] + "…"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    elif len(loc) > 1:
        message = f"[{']['.join(loc[1:])}]: {message}"
    return invalid_request(f"{param}: {message}" if param else message, param)


def _validate(model: type[BaseModel], data: object) -> Any:
    if not isinstance(data, Mapping):
        raise invalid_request("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _describe(exc) from None


def invalid_key(expired: bool = False) -> ApiError:
    """401 for a key that is unknown, revoked, rotated or expired; the message never carries the key."""
    message = (
        "This caller key has expired."
        if expired
        else "Incorrect API key provided: the caller key is unknown, revoked or rotated."
    )
    return ApiError(401, "invalid_api_key", message)
