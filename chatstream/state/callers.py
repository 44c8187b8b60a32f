"""Who may call the model routes, and within what (docs/callers.md): a caller (its key shown once,
when it is created or rotated; the store keeps only the key's SHA-256), its team (limits held over
all of its callers together), and the limits a request must fit, all of its caller's and its team's
or nothing (counters.py); and what an admin may say about them: the typed requests (``CallerSpec``,
``CallerPatch``, ``TeamSpec``, ``TeamPatch``) the admin API reads a body into (manage.py) and hands
the registry (registry.py), which keeps them (as rows: stored.py; money in pico-USD: prices.py)."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import field
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
)
from pydantic.dataclasses import dataclass

from .prices import PICO, usd_amount
from .stored import Stored

KEY_SHAPE = re.compile(r"csk-[A-Za-z0-9_-]{43}")  # csk- and 256 random bits, base64url (new_key)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")

# The bounds of a caller's or a team's settings (docs/callers.md, "Limits").
PositiveTokens = Annotated[StrictInt, Field(ge=1, le=10**9)]
PositiveRequests = Annotated[StrictInt, Field(ge=1, le=10**6)]
PositiveBudget = Annotated[StrictInt, Field(ge=1, le=10**12)]
MAX_SPEND_BUDGET = Decimal(1_000_000)  # USD
MAX_MODELS = 100
MAX_MODEL_LIMITS = 50
MAX_MODEL_NAME = 256
Period = Literal["day", "month", "total"]


def hash_key(key: str) -> str:
    """The stored form of a key. A fast hash is right here: the key is 256 random bits, so nobody
    can guess it from its hash however many hashes per second they try; slow, salted password
    hashes (bcrypt, argon2) exist for low-entropy passwords, would cost milliseconds per check, and
    their salt would rule out the point-read index."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    return "csk-" + secrets.token_urlsafe(32)


class ModelLimit(BaseModel):
    """A per-model limit, as an admin gives it and as a caller or team keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_minute: PositiveTokens | None = None
    requests_per_minute: PositiveRequests | None = None


@dataclass(frozen=True, kw_only=True)
class Limits(Stored):
    """What a caller and a team both have: a name and an id, the limits a request must fit, and the
    models it may use."""

    SCOPE: ClassVar[Literal["caller", "team"]] = "caller"
    name: str
    id: str  # made at creation: one deleted and created again under its name starts afresh
    created_at: datetime
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None
    token_budget: int | None = None
    spend_budget: int | None = None  # pico-dollars
    budget_period: Period = "total"
    models: tuple[str, ...] | None = None
    model_limits: Mapping[str, ModelLimit] = field(default_factory=dict)

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def limits_partition(self) -> str:
        """Its counters' partition in ``chatstreamLimits`` (counter_row.py)."""
        return limits_partition(self.SCOPE, self.name, self.id)


@dataclass(frozen=True, kw_only=True)
class Team(Limits):
    SCOPE: ClassVar[Literal["caller", "team"]] = "team"


@dataclass(frozen=True, kw_only=True)
class Caller(Limits):
    """A caller as the request path sees it (never its key)."""

    team: str | None = None
    team_id: str | None = None
    expires_at: datetime | None = None
    key_hint: str = ""  # the key's last 4 characters, to tell keys apart

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at.timestamp() <= now


def limits_partition(scope: str, name: str, owner_id: str) -> str:
    """The partition of a caller's or team's counters in ``chatstreamLimits``: by name and id."""
    return f"team:{name}|{owner_id}" if scope == "team" else f"{name}|{owner_id}"


# --- what an admin may say (validated) ----------------------------------------------------------


def model_name(model: str) -> bool:
    """Whether ``model`` can name a model (in a price, and a caller's or team's models and limits)."""
    return 0 < len(model) <= MAX_MODEL_NAME and model == model.strip() and not _CONTROL.search(model)


def _names(models: list[str]) -> list[str]:
    for i, model in enumerate(models):
        if not model_name(model):
            raise ValueError(f"models[{i}]: 1 to {MAX_MODEL_NAME} characters, no controls or surrounding spaces")
    if len(set(models)) != len(models):
        raise ValueError("names a model twice")
    return models


class TeamPatch(BaseModel):
    """A change to a team: the fields given change (``null`` removes a limit or the model list, and
    sets the default period). Each is validated into what a caller or team keeps (``Limits``): USD
    into pico-dollars, the model list into a tuple. The other requests add to it."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_minute: PositiveTokens | None = None
    requests_per_minute: PositiveRequests | None = None
    token_budget: PositiveBudget | None = None
    spend_budget: Any = None
    # null: the default period, in a new caller as in a patch
    budget_period: Annotated[Period, BeforeValidator(lambda period: "total" if period is None else period)] = "total"
    models: Annotated[list[str], Field(min_length=1, max_length=MAX_MODELS)] | None = None
    model_limits: Annotated[dict[str, ModelLimit], Field(max_length=MAX_MODEL_LIMITS)] | None = {}

    @field_validator("spend_budget")
    @classmethod
    def _spend(cls, value: object) -> int | None:
        if value is None:
            return None
        amount = usd_amount(value, MAX_SPEND_BUDGET)
        if amount <= 0:
            raise ValueError("must be more than 0")
        return int(amount * PICO)

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: list[str] | None) -> tuple[str, ...] | None:
        return None if models is None else tuple(_names(models))

    @field_validator("model_limits")
    @classmethod
    def _model_limit_names(cls, limits: dict[str, ModelLimit] | None) -> dict[str, ModelLimit]:
        limits = limits or {}
        _names(list(limits))
        for model, limit in limits.items():
            if limit.tokens_per_minute is None and limit.requests_per_minute is None:
                raise ValueError(f"[{model[:64]}] names no limit")
        return limits


def _name(message: str) -> BeforeValidator:
    def check(value: object) -> object:
        if isinstance(value, str) and not NAME_PATTERN.fullmatch(value):
            raise ValueError(message)
        return value

    return BeforeValidator(check)


def _before_9000(value: datetime | None) -> datetime | None:
    if value is not None and value.year > 9000:
        raise ValueError("must be before the year 9000")
    return value


Name = Annotated[str, _name("must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit")]


class CallerPatch(TeamPatch):
    """A change to a caller: the fields given change (``null`` also removes the team or the expiry);
    the name cannot change."""

    expires_at: Annotated[AwareDatetime | None, AfterValidator(_before_9000)] = None
    team: Annotated[str | None, _name("not a team name")] = None


class CallerSpec(CallerPatch):
    """A new caller."""

    name: Name


class TeamSpec(TeamPatch):
    """A new team."""

    name: Name
