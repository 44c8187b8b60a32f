"""Shared by the unit tests of chatstream/upstreams/: a fake clock, entries, pools and SDK errors."""

from __future__ import annotations

import random

import httpx2
import openai

from chatstream.upstreams.config import Entry
from chatstream.upstreams.health import Policy
from chatstream.upstreams.outcomes import Outcome, OutcomeKind, classify, outcome_of_status
from chatstream.upstreams.pool import Pool

SECRET = "sk-pool-SECRET-7d1e0b9c3aQZ"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def entry(name: str, priority: int = 1, weight: float = 1.0, models=None, **kw) -> Entry:
    return Entry(
        name=name,
        kind=kw.pop("kind", "openai"),
        url=kw.pop("url", f"http://{name}.test/v1"),
        priority=priority,
        weight=weight,
        models=tuple(models) if models else None,
        **kw,
    )


def make_pool(*entries: Entry, seed: int = 7, **policy) -> tuple[Pool, Clock]:
    clock = Clock()
    return Pool(entries, policy=Policy(**policy), now=clock, rng=random.Random(seed)), clock


def names(entries) -> list[str]:
    return [e.name for e in entries]


def named(pool: Pool, name: str) -> Entry:
    return next(e for e in pool.entries if e.name == name)


def attempt(pool: Pool, name: str, model: str = "gpt-4o", outcome: Outcome | None = None):
    a = pool.acquire(named(pool, name), model)
    assert a is not None, f"{name} is not free"
    if outcome is not None:
        a.report(outcome)
    return a


def status_error(status: int, headers: dict | None = None, body: object = None) -> openai.APIStatusError:
    request = httpx2.Request("POST", "http://up.test/v1/chat/completions")
    response = httpx2.Response(status, headers=headers or {}, request=request)
    cls = {
        429: openai.RateLimitError,
        401: openai.AuthenticationError,
        403: openai.PermissionDeniedError,
        404: openai.NotFoundError,
        400: openai.BadRequestError,
        422: openai.UnprocessableEntityError,
        409: openai.ConflictError,
    }.get(status, openai.InternalServerError if status >= 500 else openai.APIStatusError)
    return cls("upstream said no", response=response, body=body)


def outcome_of(exc: BaseException) -> Outcome:
    return classify(exc).outcome


def retry_after(pool: Pool, model: str) -> float | None:
    """Seconds until the soonest entry serving ``model`` is free, when none is now."""
    blocked = pool.unavailable(model)
    return blocked.retry_after if blocked else None


SERVER_ERROR = outcome_of_status(500)
CONNECT_FAILED = Outcome(OutcomeKind.CONNECT_FAILED)
