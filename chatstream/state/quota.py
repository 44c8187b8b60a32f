"""Token and request limits that hold across every instance, under any burst (docs/callers.md).

Each limit of a caller is one counter row in ``chatstreamLimits``: PartitionKey
``<caller name>|<caller id>``, RowKey ``tpm`` / ``rpm`` / ``budget``, holding ``window`` (the
minute index for tpm and rpm; ``d20261201``, ``m202612`` or ``total`` for the budget) and ``taken``,
the capacity of that window handed out to instances (held by them, reserved by requests, or spent).
A row whose window is older than now counts as empty: rows are reused, never piled up.

**Capacity leases.** Each instance (``Quota``) holds a local balance per counter. A reservation is
served from it without a store call; when it is short, the reservation waits while ONE store exchange
per counter and instance is in flight (single flight). That exchange asks for the sum of what all the
waiting reservations need, no more (so an instance never sits on capacity another needs), as one
ETag-conditional write (``If-Match``; an insert when the row is missing) that grants what fits under
the limit. Requests of one instance therefore never conflict with each other; only instances do, and
a conflict costs one re-read. Capacity that comes back (a reservation settled below what it reserved,
a request released or refused) goes back to the store at once, by the same single flight
(``taken -= slack``) unless a waiting reservation can use it; for a minute that is over it is simply
dropped (that window is over).

What is exact, and what is not:

- Admission is exact per window: the sum of what the store granted never exceeds the limit, so the
  reservations admitted in one window never exceed it, whatever the concurrency or the number of
  instances. Refusals are decided on a fresh read of the row, never on a cached view.
- Windows are fixed (minute, UTC day, UTC month), so ``Retry-After`` (seconds to the next window) is
  when the capacity is certainly back.
- An instance that dies holding balance: for minute windows it ends with the window; for a budget it
  is lost (under-admission, bounded by what that instance held: at most what its in-flight requests
  had reserved). A write whose answer was lost (the store timed out after applying it) loses what it
  granted the same way.
- ``x-ratelimit-remaining-*`` is an estimate: the limit less ``taken`` as this instance last read or
  wrote it, plus its own balance; other instances' changes since then are not in it (usually that
  exchange was the one that admitted the request itself, a few milliseconds old).

Every store call here is bounded: a reservation that needs the store and does not get it within
``RESERVE_TIMEOUT`` fails with 503 ``caller_store_unavailable`` (nothing reserved); capacity that could
not be given back is retried with a backoff of 1 s doubling to 30 s. Nothing else is remembered about
an outage: the next reservation tries again."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ..errors import ApiError
from .callers import Caller
from .calls import store_unavailable
from .leases import WINDOW_SECONDS, Lease, Refused, window_of
from .legacy_store import CALL_TIMEOUT, Store

log = logging.getLogger("chatstream")

RESERVE_TIMEOUT = CALL_TIMEOUT  # a reservation that needs the store answers within this (1.8 s), or 503
_HEADER_SUFFIX = {"tpm": "tokens", "rpm": "requests"}
_LIMIT_NAME = {"tpm": "tokens per min (TPM)", "rpm": "requests per min (RPM)"}


def seconds_to_next_minute(now: float) -> float:
    return WINDOW_SECONDS - (now % WINDOW_SECONDS)


def retry_after(now: float) -> int:
    """Whole seconds until the next minute window (at least 1): when the capacity is certainly back."""
    return max(1, math.ceil(seconds_to_next_minute(now)))


def duration(seconds: float) -> str:
    """A time span as OpenAI writes ``x-ratelimit-reset-*``: ``250ms``, ``17.5s``, ``1m3s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{text}" if minutes else text


class Reservation:
    """What one request holds: settle it once its usage is known, or release it if it never ran."""

    def __init__(
        self, quota: Quota, caller: Caller, tokens: int, parts: list[tuple[Lease, int, str]], headers: dict[str, str]
    ):
        self.quota = quota
        self.caller = caller
        self.tokens = tokens
        self.parts = parts
        self.headers = headers  # OpenAI's x-ratelimit-* headers for the answer (empty without limits)
        self.state = "held"
        self.at = quota.clock()  # for Quota.settle_elsewhere (a background response settled later)

    async def settle(self, charged_tokens: int) -> None:
        """Charge ``charged_tokens`` (prompt + completion) instead of what was reserved: the rest goes
        back to the store, or more is taken (beyond the limit if need be: the tokens were spent).
        Idempotent (a second call, or one after ``release``, does nothing). Waits for the store at
        most 2 s; never raises (what the store did not take is retried)."""
        if self.state != "held":
            return
        self.state = "settled"
        difference = max(0, int(charged_tokens)) - self.tokens
        for lease, _, window in self.parts:
            if lease.kind == "rpm":
                continue  # the request happened: it counts
            if difference < 0:
                lease.give_back(-difference, window)
            elif difference > 0:
                lease.charge_extra(difference, window)
        await self._wait()

    async def release(self) -> None:
        """Nothing is charged: everything reserved (the request too) goes back."""
        if self.state != "held":
            return
        self.state = "released"
        for lease, need, window in self.parts:
            lease.give_back(need, window)
        await self._wait()

    async def _wait(self) -> None:
        flights = [lease.flight for lease, _, _ in self.parts if lease.flight is not None]
        if flights:  # a flight's own bound is CALL_TIMEOUT: this sees how it ended
            await asyncio.wait(flights, timeout=CALL_TIMEOUT + 0.2)


class Quota:
    """The limits of every caller, as this instance takes part in them (one per instance)."""

    def __init__(self, store: Store, instance_id: str, clock: Callable[[], float] = time.time):
        self.store = store
        self.instance_id = instance_id
        self.clock = clock
        self._leases: dict[tuple[str, str], Lease] = {}
        self._pruned_at = ""
        # Store calls made (docs/callers.md's figures and the tests read them).
        self.reads = 0
        self.writes = 0
        self.conflicts = 0

    window_of = staticmethod(window_of)

    def _lease(self, caller: Caller, kind: str, limit: int) -> Lease:
        key = (caller.limits_partition, kind)
        lease = self._leases.get(key)
        if lease is None:
            lease = self._leases[key] = Lease(self, caller.limits_partition, kind)
        lease.limit = limit  # an admin's change applies from the next request
        if kind == "budget":
            lease.period = caller.budget_period
        return lease

    def _prune(self, now: float) -> None:
        """Once a minute: forget the leases that hold nothing (a caller that comes back re-reads)."""
        minute = self.window_of("tpm", now)
        if minute != self._pruned_at:
            self._pruned_at = minute
            for key in [k for k, lease in self._leases.items() if lease.idle()]:
                del self._leases[key]

    async def reserve(self, caller: Caller, tokens: int) -> Reservation:
        """Reserve one request and ``tokens`` tokens against every limit the caller has, all or
        nothing. Raises ApiError 429 ``rate_limit_exceeded`` (``Retry-After``), 429
        ``insufficient_quota`` (``x-should-retry: false``) or 503 ``caller_store_unavailable``; a
        refused request holds nothing."""
        if type(tokens) is not int or tokens < 0:
            raise ValueError("tokens must be a non-negative int")
        now = self.clock()
        wanted: list[tuple[str, int, int]] = []
        if caller.requests_per_minute:
            wanted.append(("rpm", 1, caller.requests_per_minute))
        if caller.tokens_per_minute:
            if tokens > caller.tokens_per_minute:
                raise _too_large(caller, tokens, now)
            wanted.append(("tpm", tokens, caller.tokens_per_minute))
        if caller.token_budget:
            if tokens > caller.token_budget:
                raise _over_budget(caller, tokens, None)
            wanted.append(("budget", tokens, caller.token_budget))
        if not wanted:
            return Reservation(self, caller, tokens, [], {})
        self._prune(now)
        leases = [(self._lease(caller, kind, limit), need) for kind, need, limit in wanted]
        acquiring = [lease.acquire(need, self.window_of(lease.kind, now, lease.period)) for lease, need in leases]
        try:
            async with asyncio.timeout(RESERVE_TIMEOUT):
                results = await asyncio.gather(*acquiring, return_exceptions=True)
        except TimeoutError:
            raise store_unavailable() from None  # each acquire gave back what it had got
        granted = [(lease, need, r) for (lease, need), r in zip(leases, results, strict=True) if isinstance(r, str)]
        if len(granted) < len(leases):
            for lease, need, window in granted:
                lease.give_back(need, window)
            raise self._refusal(caller, tokens, [r for r in results if not isinstance(r, str)], leases, now)
        return Reservation(self, caller, tokens, granted, self._headers(leases, now))

    def _headers(self, leases: list[tuple[Lease, int]], now: float) -> dict[str, str]:
        headers: dict[str, str] = {}
        reset = duration(seconds_to_next_minute(now))
        for lease, _ in leases:
            suffix = _HEADER_SUFFIX.get(lease.kind)
            if suffix is not None:
                headers[f"x-ratelimit-limit-{suffix}"] = str(lease.limit)
                headers[f"x-ratelimit-remaining-{suffix}"] = str(lease.remaining())
                headers[f"x-ratelimit-reset-{suffix}"] = reset
        return headers

    def _refusal(self, caller: Caller, tokens: int, errors: list[Any], leases, now: float) -> ApiError:
        for error in errors:
            if isinstance(error, ApiError):
                return error  # the store did not answer
        for error in errors:
            if not isinstance(error, Refused):
                raise error  # a bug of ours: the endpoint's 500
        kinds = {error.lease.kind for error in errors}
        if "budget" in kinds:
            lease = next(e.lease for e in errors if e.lease.kind == "budget")
            return _over_budget(caller, tokens, lease)
        kind = "tpm" if "tpm" in kinds else "rpm"
        lease = next(e.lease for e in errors if e.lease.kind == kind)
        wait = retry_after(now)
        requested = tokens if kind == "tpm" else 1
        headers = {"Retry-After": str(wait), "x-should-retry": "true", **self._headers(leases, now)}
        return ApiError(
            429,
            "rate_limit_exceeded",
            f"Rate limit reached for caller {caller.name!r} on {_LIMIT_NAME[kind]}: Limit {lease.limit}, "
            f"Used {lease.limit - lease.remaining()}, Requested {requested}. "
            f"Please try again in {wait}s.",
            retryable=True,
            headers=headers,
        )

    async def settle_elsewhere(self, caller: Caller, reserved: int, at: float, charged: int) -> None:
        """Settle a reservation that this object does not hold: one made ``at`` (its ``Reservation.at``)
        for ``reserved`` tokens on any instance, and left as spent (a background response, whose usage
        shows up later, maybe on another instance): the difference to ``charged`` is given back or taken,
        in the windows the reservation was in if they are still current (a minute that is over, or a
        budget day or month that is over, needs nothing). Call it once per reservation (``Owners.
        first_charge`` says which instance does)."""
        difference = max(0, int(charged)) - reserved
        parts = []
        for kind, limit in (("tpm", caller.tokens_per_minute), ("budget", caller.token_budget)):
            if limit and difference:
                lease = self._lease(caller, kind, limit)
                window = self.window_of(kind, at, lease.period)
                lease.advance(self.window_of(kind, self.clock(), lease.period))
                if lease.window == window:
                    if difference < 0:
                        lease.give_back(-difference, window)
                    else:
                        lease.charge_extra(difference, window)
                    parts.append(lease)
        flights = [lease.flight for lease in parts if lease.flight is not None]
        if flights:
            await asyncio.wait(flights, timeout=CALL_TIMEOUT)

    async def flush(self, within: float = 5.0) -> bool:
        """Wait until this instance holds nothing and has nothing in flight (tests, shutdown): True if
        it got there within ``within`` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            flights = [lease.flight for lease in self._leases.values() if lease.flight is not None]
            if flights:
                await asyncio.wait(flights, timeout=max(0.0, deadline - time.monotonic()))
                continue
            busy = [lease for lease in self._leases.values() if lease.balance or lease.debt]
            if not busy:
                return True
            for lease in busy:
                lease.kick()
            await asyncio.sleep(0)
        return False

    def held(self) -> int:
        """Capacity this instance holds unassigned, summed over counters (diagnostics)."""
        return sum(lease.balance for lease in self._leases.values())


def _too_large(caller: Caller, tokens: int, now: float) -> ApiError:
    return ApiError(
        429,
        "rate_limit_exceeded",
        f"Request too large for caller {caller.name!r} on tokens per min (TPM): "
        f"Limit {caller.tokens_per_minute}, Requested {tokens}. Lower max_tokens (or shorten the "
        f"prompt) so that prompt + max_tokens fits the limit.",
        headers={
            "x-should-retry": "false",
            "x-ratelimit-limit-tokens": str(caller.tokens_per_minute),
            "x-ratelimit-reset-tokens": duration(seconds_to_next_minute(now)),
        },
    )


def _over_budget(caller: Caller, tokens: int, lease: Lease | None) -> ApiError:
    period = {"day": "today (UTC)", "month": "this month (UTC)", "total": "in total"}[caller.budget_period]
    budget = caller.token_budget
    if lease is None:
        message = (
            f"This request may need {tokens} tokens (prompt + max_tokens), more than the whole token "
            f"budget of caller {caller.name!r} ({budget} {period}): lower max_tokens."
        )
    else:
        left = lease.remaining()
        message = (
            f"Caller {caller.name!r} has {left} of its {budget} budget tokens left {period}; this request "
            f"may need {tokens} (prompt + max_tokens). Lower max_tokens, or ask for a larger budget."
        )
    return ApiError(429, "insufficient_quota", message, headers={"x-should-retry": "false"})
