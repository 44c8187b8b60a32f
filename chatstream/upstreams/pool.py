"""The pool: which entries may serve a request, in which order they are tried, and what each
attempt's outcome does to its entry (through the entry's ``Health``: 429 cooldowns, the breaker),
logged and counted as it happens.

No HTTP, no settings object; the clock and the random source are injectable, so it is tested
in-process with a fake clock. It runs on one asyncio loop, so it has no locks; nothing here
awaits. The request path (failover.py) uses it like this (see docs/pool.md)::

    for entry in pool.candidates(model):
        attempt = pool.acquire(entry, model)    # None: taken out (or its probe taken) meanwhile
        if attempt is None:
            continue
        ... open the entry's stream up to its first output ...
        attempt.report(outcome)                 # SUCCESS, or classify(exc).outcome
        pool.route(outcome)                     # next, larger (context window) or stop
    # no attempt at all: pool.unavailable(model) says why (429 / 503 with Retry-After)"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, cast

from .. import telemetry
from ..errors import log_safe
from ..settings import ERROR_ROUTES
from .config import Entry, display_url
from .health import Health, Policy
from .outcomes import COOLDOWN, HEALTH_FAILURE, Outcome, OutcomeKind

log = logging.getLogger("chatstream")
Route = Literal["next", "larger", "stop"]
# The error classes of UPSTREAM_ERROR_ROUTES: upstream errors that say nothing about the entry's
# health, and whose right next step depends on the pool (settings.ERROR_ROUTES has the defaults).
ROUTED = {
    "context_length": OutcomeKind.CONTEXT_LENGTH,
    "content_filter": OutcomeKind.CONTENT_FILTER,
    "auth": OutcomeKind.AUTH_ERROR,
    "quota": OutcomeKind.QUOTA_EXHAUSTED,
}


@dataclass(frozen=True)
class NoneFree:
    """Why no entry can take a model's request now: ``retry_after`` seconds until the soonest is
    free; ``reason`` ``rate_limited`` when every entry serving it is cooling down after 429s (answer
    429), else ``unavailable`` (answer 503)."""

    retry_after: float
    reason: Literal["rate_limited", "unavailable"]


class Attempt:
    """One try of one entry, from ``Pool.acquire``. Report its outcome with ``report`` (more than
    once is fine: success at the first output, then a mid-stream failure), or ``release`` it: a
    half-open probe slot is freed even if the request is cancelled before it reports (a cancelled
    probe says nothing about the entry, so the next request probes)."""

    __slots__ = ("delivered", "deployment", "entry", "generation", "model", "pool", "probe", "released")

    def __init__(self, pool: Pool, entry: Entry, model: str, probe: bool, generation: int) -> None:
        self.pool = pool
        self.entry = entry
        self.model = model
        self.deployment = entry.deployment(model)
        self.probe = probe
        self.generation = generation
        self.released = False
        self.delivered = False  # success reported: later failures are mid-stream (no failover)

    def report(self, outcome: Outcome) -> None:
        self.pool.record(self, outcome)
        if outcome.kind is OutcomeKind.SUCCESS:
            self.delivered = True
        self.release()

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self.probe:
                self.pool.health[self.entry.name].probing = False


def _weighted_order(entries: list[Entry], rng: random.Random) -> list[Entry]:
    """Weighted sampling without replacement: each entry draws an exponential clock with rate
    ``weight``; sorted by it, the first is entry i with probability w_i / Σw, and so on for the
    rest (Efraimidis–Spirakis)."""
    keyed = [(-math.log(1.0 - rng.random()) / e.weight, i, e) for i, e in enumerate(entries)]
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [e for _, _, e in keyed]


class Pool:
    """The entries and their health. ``now`` is a monotonic clock, ``rng`` the random source for the
    weighted order."""

    def __init__(
        self,
        entries: Iterable[Entry],
        *,
        policy: Policy | None = None,
        now: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        routes: Mapping[str, str] | None = None,
    ) -> None:
        self.entries: tuple[Entry, ...] = tuple(entries)
        self.policy = policy or Policy()
        self._now = now
        self._rng = rng or random.Random()
        self.health: dict[str, Health] = {e.name: Health() for e in self.entries}
        self._ordered = len({e.priority for e in self.entries}) == len(self.entries)  # no ties: no draw
        chosen = {**ERROR_ROUTES, **(routes or {})}
        self.routes: dict[OutcomeKind, Route] = {kind: cast(Route, chosen[name]) for name, kind in ROUTED.items()}

    def serves(self, model: str) -> bool:
        """Whether any entry serves ``model`` (if not: a 400 naming the model, no upstream call)."""
        return any(e.serves(model) for e in self.entries)

    # --- choosing ---------------------------------------------------------------------------

    def candidates(self, model: str) -> list[Entry]:
        """The entries to try for ``model``, in order: those serving it and free now (not cooling
        down, breaker not open, no probe of theirs in flight); lowest priority number first, a
        weighted random order within a priority."""
        now = self._now()
        free = [e for e in self.entries if e.serves(model) and self._waits(e, model, now) is None]
        if self._ordered:
            return sorted(free, key=lambda e: e.priority)
        ordered: list[Entry] = []
        for priority in sorted({e.priority for e in free}):
            ordered.extend(_weighted_order([e for e in free if e.priority == priority], self._rng))
        return ordered

    def acquire(self, entry: Entry, model: str) -> Attempt | None:
        """Start an attempt on ``entry`` (checked again: the request may have awaited other entries
        since ``candidates``). A half-open entry gives its one probe slot to this attempt; None when
        the entry is no longer free."""
        health = self.health[entry.name]
        if not entry.serves(model) or self._waits(entry, model, self._now()) is not None:
            return None
        probe = health.open_until is not None  # free and open_until set: half-open
        if probe:
            health.probing = True
        health.counters.requests += 1
        return Attempt(self, entry, model, probe, health.generation)

    def wait(self, entry: Entry, model: str) -> float | None:
        """Seconds until ``entry`` can take a request for ``model`` again; None: it can now."""
        wait = self._waits(entry, model, self._now())
        return wait[0] if wait is not None else None

    def _waits(self, entry: Entry, model: str, now: float) -> tuple[float, str] | None:
        return self.health[entry.name].wait(entry.deployment(model), now, self.policy)

    def route(self, outcome: Outcome) -> Route:
        """Where a request goes after a failed attempt: ``next`` candidate, only those with a
        ``larger`` context window, or ``stop`` (the failure is the answer). The routed classes as
        configured; the entry's own failures (429, 5xx, connections, time) always move on."""
        routed = self.routes.get(outcome.kind)
        if routed is not None:
            return routed
        return "next" if outcome.failover else "stop"

    def unavailable(self, model: str) -> NoneFree | None:
        """When entries serve ``model`` but none is free: how long until the soonest is, and why.
        None when one is free, or when none serves the model."""
        now = self._now()
        waits = []
        for entry in self.entries:
            if entry.serves(model):
                wait = self._waits(entry, model, now)
                if wait is None:
                    return None
                waits.append(wait)
        if not waits:
            return None
        reason = "rate_limited" if all(why == "cooling_down" for _, why in waits) else "unavailable"
        return NoneFree(min(seconds for seconds, _ in waits), reason)

    # --- outcomes ---------------------------------------------------------------------------

    def record(self, attempt: Attempt, outcome: Outcome) -> None:
        """An attempt's outcome (use ``attempt.report``): counters, cooldowns, the breaker."""
        name, health = attempt.entry.name, self.health[attempt.entry.name]
        reason = outcome.kind.value
        now = self._now()
        if self.route(outcome) != "stop" and not attempt.delivered and len(self.entries) > 1:  # somewhere to go
            health.counters.failovers += 1
        if outcome.kind is OutcomeKind.AUTH_ERROR:
            log.error(
                "upstream %s: authentication failed: check its key (api_key_setting) or, for Entra ID, "
                "the app identity's role on that resource",
                name,
            )
        elif outcome.kind is OutcomeKind.QUOTA_EXHAUSTED:
            log.error("upstream %s: its quota is used up (insufficient_quota): check the account's billing", name)
        if outcome.kind in COOLDOWN:
            seconds = health.cool_down(attempt.deployment, outcome, now, self.policy)
            telemetry.upstream_event("cooldowns", name)
            log.warning(
                "upstream %s: %s, cooling down %.1fs for %s", name, reason, seconds, log_safe(attempt.deployment)
            )
        elif outcome.kind is OutcomeKind.SUCCESS:
            health.counters.successes += 1
        elif outcome.kind in HEALTH_FAILURE:
            health.counters.failures += 1
        # The breaker moves only on this era's attempts: the probe while half-open, or any attempt
        # while closed that started after the last opening.
        probe = attempt.probe and not attempt.released  # its first report, slot still held
        if probe or (health.open_until is None and attempt.generation == health.generation):
            change = health.breaker(outcome, now, self.policy, probe)
            if change is not None:
                telemetry.upstream_event("breaker", name, state=change, reason=reason)
            if change == "open":
                assert health.open_until is not None
                log.warning(
                    "upstream %s: %s, breaker open: skipped, next probe in %.1fs", name, reason, health.open_until - now
                )
            elif change == "closed":
                log.info("upstream %s: answered again (breaker closed)", name)

    # --- reporting --------------------------------------------------------------------------

    def probes(self) -> list[tuple[str, float | None]]:
        """(entry name, seconds until its breaker lets a probe through; None: closed), per entry.
        Reads only: the metrics exporter's thread calls it (telemetry.watch_probes)."""
        now = self._now()
        return [(e.name, self.health[e.name].next_probe(now)) for e in self.entries]

    def state(self) -> list[dict]:
        """Per entry, for a status endpoint: never a key (only the name of the setting holding it)."""
        now = self._now()
        out = []
        for entry in self.entries:
            health = self.health[entry.name]
            state, until, cooling = health.state(now)
            out.append(
                {
                    "name": entry.name,
                    "kind": entry.kind,
                    "url": display_url(entry.url),
                    "auth": entry.auth,
                    "key_setting": entry.key_setting,
                    "priority": entry.priority,
                    "weight": entry.weight,
                    "models": list(entry.models) if entry.models is not None else None,
                    "state": state,
                    "until": round(until, 3) if until is not None else None,
                    "probing": health.probing,
                    "next_probe": round(probe, 3) if (probe := health.next_probe(now)) is not None else None,
                    "cooldowns": cooling,
                    "consecutive_failures": health.failures,
                    "counters": vars(health.counters).copy(),
                }
            )
        return out
