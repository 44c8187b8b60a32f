"""What the request path (accounting.py: ``authenticate``, ``admit``, ``charge``) and the admin API
(registry.py) tell the shared state, and what it answers: domain values, in the state's own words.
Only the HTTP layer turns requests into them (apis/usage.py) and them into statuses, OpenAI's codes
and messages, and headers (apis/refusals.py, manage.py, resumable.py). The admin API answers the
object, or raises ``Invalid`` (which field, why: never the value), ``Missing``, ``Conflict``; or the
store's StoreError, when it did not answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scope = Literal["caller", "team"]


@dataclass(frozen=True)
class AdmissionRequest:
    """A request to be admitted: ``prompt_tokens`` counted with the model's tokenizer, at most
    ``output_tokens`` generated (the output cap times the choices), and what it carries by reference:
    a previous response (the caller's), or a conversation or stored items (``references``)."""

    request_id: str
    endpoint: str
    model: str
    prompt_tokens: int
    output_tokens: int
    previous: str | None = None
    references: bool = False


@dataclass(frozen=True)
class Used:
    """One segment's usage: prompt (with how much of it was cached) and completion tokens."""

    prompt: int
    cached: int
    completion: int
    upstream: str | None = None
    request_id: str | None = None  # the upstream's x-request-id for it
    model: str | None = None  # the model name its upstream was sent, when not the requested one

    @property
    def total(self) -> int:
        return self.prompt + self.completion


# How a charged request ended, as its ledger row says: a request's own end (apis/usage.py), a part
# lost with its instance (``lost``), a background response charged when its usage was seen.
Ended = Literal["completed", "disconnected", "timeout", "failed", "cancelled", "lost", "background"]


@dataclass(frozen=True)
class Usage:
    """What a finished request used: each segment of its answer (none: no upstream took it), how it
    ended, whether the upstream reported it (else it was counted here), the upstream's request id."""

    segments: tuple[Used, ...]
    ended: Ended
    reported: bool = False
    upstream_id: str | None = None


@dataclass(frozen=True)
class LimitRef:
    """Which limit: of the caller or of its team (``owner`` names it), which kind, for which model
    (per-model limits) and over which period (budgets)."""

    scope: Scope
    owner: str
    kind: Literal["requests_per_minute", "tokens_per_minute", "token_budget", "spend_budget"]
    model: str | None = None
    period: str | None = None  # day, month, total: budgets


@dataclass(frozen=True)
class Refused:
    """A limit leaves no room for this request: ``value`` the limit, ``used`` what is taken of it as
    this instance knows, ``requested`` what the request needs (tokens, requests, or pico-USD);
    ``retry_after``: seconds until the minute turns (None: a budget); ``alone``: the request by
    itself is larger than the limit."""

    limit: LimitRef
    value: int
    used: int
    requested: int
    retry_after: float | None = None
    alone: bool = False


@dataclass(frozen=True)
class Unavailable:
    """The store did not answer in time (or too many unknown keys are being checked at once):
    nothing was reserved or charged."""


@dataclass(frozen=True)
class KeyRefused:
    """The key is unknown, revoked, rotated, or expired."""

    expired: bool = False


@dataclass(frozen=True)
class Unreadable:
    """The record of the caller (its key's) or of its team in the store holds none (a hand edit, a bad
    write; ``why``: which field, never its value): its requests are refused, and the admin API shows
    it as this, until an admin deletes it (registry.py)."""

    scope: Scope
    name: str
    why: str
    id: str | None = None


@dataclass(frozen=True)
class ModelRefused:
    """The caller (or its team) may not use this model; or it has a spend budget and the model has
    no price, so its cost cannot be held; or the model's price row is ``unreadable`` (prices.py)."""

    model: str
    unpriced: bool = False
    unreadable: bool = False
    scope: Scope = "caller"


@dataclass(frozen=True)
class Unknown:
    """What the request refers to is not the caller's (or not there): a previous response."""

    kind: str
    id: str


@dataclass(frozen=True)
class Rate:
    """One per-minute limit as an answer's ``x-ratelimit-*`` headers show it."""

    limit: int
    remaining: int
    reset_seconds: float


# --- the admin API's outcomes (raised; manage.py writes the HTTP answer) -----------------------------


class Invalid(Exception):
    """Bad input: ``param`` names the field; the message never echoes the value."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Missing(Exception):
    """No such caller, team or price."""

    def __init__(self, kind: str, name: str):
        super().__init__(f"no {kind} named {name!r}")
        self.kind = kind


class Conflict(Exception):
    """The change cannot be made now (a team that still has callers; repeated concurrent changes)."""
