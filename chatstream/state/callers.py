"""Who may call the model routes, and within what (docs/callers.md): a caller (its key shown once,
when it is created or rotated; the store keeps only the key's SHA-256), its team (limits held over
all of its callers together), and the limits a request must fit, all of its caller's and its team's
or nothing (counters.py); and what an admin may say about them: the typed requests (``CallerSpec``,
``CallerPatch``, ``TeamSpec``, ``TeamPatch``) the admin API reads a body into (manage.py) and hands
the registry (registry.py), which keeps them. Here too: ``Stored``, the row codec of callers, teams,
prices and owner rows, and pico-USD (``PICO``, ``usd``); how money is kept exactly: prices.py."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import field, fields
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
)
from pydantic.dataclasses import dataclass

KEY_SHAPE = re.compile(r"csk-[A-Za-z0-9_-]{43}")  # csk- and 256 random bits, base64url (new_key)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PICO = 10**12  # pico-dollars per USD
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


def usd(pico: int | None) -> float | None:
    """Pico-dollars as USD for an answer (exact: budgets and prices have at most 6 decimals)."""
    return None if pico is None else float(Decimal(pico) / PICO)


class ModelLimit(BaseModel):
    """A per-model limit, as an admin gives it and as a caller or team keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_minute: PositiveTokens | None = None
    requests_per_minute: PositiveRequests | None = None


@dataclass(frozen=True, config=ConfigDict(strict=True))
class Stored:
    """A caller, team, price or owner row (owners.py; pydantic checks its types, strictly, whenever
    one is made), as its row keeps its properties (``entity``) and back (``of``; a property left out
    or empty: the field's default; a whole-number Double, a number typed in by hand, as its integer):
    times as ISO text, the model list, the per-model limits and a price (an owner row's) as JSON."""

    def entity(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for f in fields(self):
            item = getattr(self, f.name)
            if isinstance(item, datetime):
                item = iso(item)
            elif f.name == "models" and item is not None:
                item = json.dumps(list(item))
            elif f.name == "model_limits":
                item = json.dumps({m: limit.model_dump() for m, limit in item.items()}) if item else None
            elif isinstance(item, Stored):
                item = json.dumps(item.entity())
            row[f.name] = item
        return row

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Self:
        """What ``row`` keeps; ValueError naming the field and why (never its value) when it holds
        none: a field missing, not JSON, or of another type (a hand edit, a bad write: registry.py)."""
        values = {f.name: row[f.name] for f in fields(cls) if row.get(f.name) not in (None, "")}
        for name, item in values.items():
            try:
                if name.endswith("_at") and isinstance(item, str):
                    values[name] = datetime.fromisoformat(item)
                elif name in ("models", "model_limits"):
                    item = json.loads(item)
                    values[name] = tuple(item) if name == "models" and isinstance(item, list) else item
                elif isinstance(item, float) and item.is_integer():
                    values[name] = int(item)
            except json.JSONDecodeError:
                raise ValueError(f"{name}: not JSON") from None
            except (TypeError, ValueError):
                raise ValueError(f"{name}: not of its type") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            errors = exc.errors()
            wrong = [e for e in errors if e["type"] != "missing"]
            if wrong:
                raise ValueError(f"{wrong[0]['loc'][0]}: {wrong[0]['msg'][:120]}") from None
            raise ValueError(f"{', '.join(str(e['loc'][0]) for e in errors)}: missing") from None


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


def iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z") if value is not None else None


# --- what an admin may say (validated) ----------------------------------------------------------


def usd_amount(value: object, maximum: Decimal) -> Decimal:
    """A USD amount (a JSON number) as a decimal; ValueError why it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    amount = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if not amount.is_finite() or amount < 0:
        raise ValueError("must be a non-negative number")
    if amount > maximum:
        raise ValueError(f"must be at most {maximum}")
    exponent = amount.normalize().as_tuple().exponent
    if isinstance(exponent, int) and exponent < -6:
        raise ValueError("has more than 6 decimal places")
    return amount


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
