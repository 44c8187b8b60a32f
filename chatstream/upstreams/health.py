"""One entry's health: its 429 cooldowns (per deployment) and its circuit breaker, and what each
outcome does to them. Pure logic on plain numbers; the pool (pool.py) owns one ``Health`` per
entry and calls it with the clock's time.

Cooldowns are kept per entry *and deployment*: Azure OpenAI and OpenAI limit each deployment or
model separately, so one model's 429 says nothing about another's. The breaker (connection failures,
5xx, timeouts) is per entry: it is about the server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .outcomes import ANSWERED, HEALTH_FAILURE, Outcome, OutcomeKind


@dataclass(frozen=True)
class Policy:
    """Cooldown and breaker numbers (seconds). Defaults are the documented behaviour."""

    failure_threshold: int = 3  # consecutive failures that open the breaker
    failure_window: float = 60.0  # a failure older than this no longer counts toward the streak
    open_on_connect_failure: bool = True  # a failure to connect opens the breaker at once
    # First open; doubled on each failed probe up to backoff_max, so an open entry is probed at least
    # every backoff_max seconds whatever its history (UPSTREAM_OPEN_SECONDS, UPSTREAM_PROBE_SECONDS).
    backoff_initial: float = 5.0
    backoff_max: float = 10.0
    cooldown_default: float = 10.0  # a 429 whose headers say nothing usable
    cooldown_min: float = 1.0  # shortest cooldown after any 429
    cooldown_max: float = 300.0  # longest (Azure may ask for a day when a quota is used up)
    probe_wait: float = 1.0  # retry_after while another request is probing the only entry


# The single upstream (no UPSTREAMS): no breaker (with nowhere else to go, the upstream's own answer
# is the best one), and a cooldown only for as long as its 429 asked, so that a client retrying on
# its own schedule does not reach the upstream again before then.
SINGLE = Policy(failure_threshold=2**31, open_on_connect_failure=False, cooldown_default=0.0, cooldown_min=0.0)


@dataclass
class Counters:
    requests: int = 0
    successes: int = 0
    failures: int = 0
    failovers: int = 0
    cooldowns: int = 0
    opens: int = 0


@dataclass
class Health:
    """An entry's breaker and cooldowns. ``open_until``: the breaker is open until then, half-open
    after it until a probe reports; ``generation`` is bumped on each opening so that attempts
    started before it do not move the breaker."""

    failures: int = 0  # consecutive
    last_failure: float = -math.inf
    open_until: float | None = None
    opens_in_a_row: int = 0  # back-off level
    generation: int = 0
    probing: bool = False  # a half-open probe is in flight
    cooldowns: dict[str, float] = field(default_factory=dict)  # deployment → until
    counters: Counters = field(default_factory=Counters)

    def wait(self, deployment: str, now: float, policy: Policy) -> tuple[float, str] | None:
        """None if the entry can take a request for ``deployment`` now; else (seconds, why)."""
        waits: list[tuple[float, str]] = []
        if self.open_until is not None:
            if now < self.open_until:
                waits.append((self.open_until - now, "open"))
            elif self.probing:
                waits.append((policy.probe_wait, "probing"))
        until = self.cooldowns.get(deployment)
        if until is not None:
            if now < until:
                waits.append((until - now, "cooling_down"))
            else:
                del self.cooldowns[deployment]
        if not waits:
            return None
        why = "cooling_down" if all(w == "cooling_down" for _, w in waits) else "unavailable"
        return max(seconds for seconds, _ in waits), why

    def cool_down(self, deployment: str, outcome: Outcome, now: float, policy: Policy) -> float:
        """Put ``deployment`` out for the 429's wait (bounded by the policy); the seconds."""
        if outcome.kind is OutcomeKind.QUOTA_EXHAUSTED:
            seconds = policy.cooldown_max
        elif outcome.cooldown is None:
            seconds = policy.cooldown_default
        else:
            seconds = outcome.cooldown
        seconds = min(max(seconds, policy.cooldown_min), policy.cooldown_max)
        # Expired cooldowns go now, not only when their name is asked for again: the names may be
        # the callers' (an entry without ``models``), and must not pile up.
        self.cooldowns = {d: u for d, u in self.cooldowns.items() if u > now}
        until = now + seconds
        self.counters.cooldowns += 1
        if seconds > 0 and until > self.cooldowns.get(deployment, -math.inf):
            self.cooldowns[deployment] = until
        return seconds

    def breaker(self, outcome: Outcome, now: float, policy: Policy, probe: bool) -> str | None:
        """Move the breaker on this era's outcome (``probe``: the half-open probe's first report);
        ``open`` or ``closed`` when it changed."""
        if outcome.kind in HEALTH_FAILURE:
            if probe:
                return self._open(now, policy)
            if now - self.last_failure > policy.failure_window:
                self.failures = 0
            self.failures += 1
            self.last_failure = now
            if self.failures >= policy.failure_threshold or (
                outcome.kind is OutcomeKind.CONNECT_FAILED and policy.open_on_connect_failure
            ):
                return self._open(now, policy)
        elif outcome.kind in ANSWERED:
            self.failures = 0
            if probe:
                self.open_until = None
                self.opens_in_a_row = 0
                return "closed"
        return None

    def _open(self, now: float, policy: Policy) -> str:
        seconds = min(policy.backoff_initial * (2 ** min(self.opens_in_a_row, 32)), policy.backoff_max)
        self.opens_in_a_row += 1
        self.open_until = now + seconds
        self.generation += 1
        self.failures = 0
        self.counters.opens += 1
        return "open"

    def next_probe(self, now: float) -> float | None:
        """Seconds until the breaker lets a probe through (0: the next request probes, or one is in
        flight); None while it is closed. Reads ``open_until`` once: a metrics thread may call it."""
        until = self.open_until
        return None if until is None else max(until - now, 0.0)

    def state(self, now: float) -> tuple[str, float | None, dict[str, float]]:
        """(state, seconds until it changes, cooldowns left per deployment), for the status page."""
        self.cooldowns = {d: u for d, u in self.cooldowns.items() if u > now}
        cooling = {d: round(until - now, 3) for d, until in sorted(self.cooldowns.items())}
        if self.open_until is not None and now < self.open_until:
            return "open", self.open_until - now, cooling
        if self.open_until is not None:
            return "half_open", None, cooling
        if cooling:
            return "cooling_down", max(cooling.values()), cooling
        return "ok", None, cooling
