"""A pool of upstreams (issue #14): which entry serves a request, in which order they are tried, and
what each attempt's outcome does to the entry (429 cooldowns, a circuit breaker for failing ones).

Pure logic: no HTTP, no settings object; the clock and the random source are injectable, so it is
tested in-process with a fake clock. It runs on one asyncio loop, so it has no locks; nothing
here awaits.

The request path uses it like this (see docs/pool.md)::

    for entry in pool.candidates(model):
        attempt = pool.acquire(entry, model)    # None: taken out (or its probe taken) meanwhile
        if attempt is None:
            continue
        with attempt:                           # frees a half-open probe slot however it ends
            try:
                stream = await open_stream(client_for(entry), entry.deployment(model))
                first = await first_delta(stream)
            except Exception as exc:
                outcome = classify(exc)
                attempt.report(outcome)
                if outcome.failover:
                    continue
                raise
            attempt.report(Outcome.success())
            ... relay the stream; report a later failure on the same attempt ...
            break
    else:
        # No candidate got through: the last attempt's error (as errors.from_upstream maps it), or,
        # when there was no candidate at all, pool.unavailable(model): 429 / 503 with Retry-After.
        ...

Cooldowns (after a 429) are kept per entry *and deployment*: Azure OpenAI and OpenAI limit each
deployment or model separately, so one model's 429 says nothing about another's. The breaker
(connection failures, 5xx, timeouts) is per entry: it is about the server."""
from __future__ import annotations

import email.utils
import json
import math
import random
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import openai
from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, ValidationError, model_validator

from .errors import http_errors

SETTING = "UPSTREAMS"
DEFAULT_API_VERSION = "2024-10-21"  # as AZURE_OPENAI_API_VERSION's default in settings.py
LEGACY_NAME = "default"


class PoolConfigError(Exception):
    """``UPSTREAMS`` (or a setting it names) has a value the app cannot run with. The message names
    the setting and the entry, never a value that could be a key."""


# --------------------------------------------------------------------------------------------
# Entries: the validated, immutable description of one upstream.


@dataclass(frozen=True, eq=False, repr=False)
class Entry:
    """One upstream of the pool. ``api_key`` is the resolved key (masked in every repr); ``auth``
    says how to authenticate: ``key``, ``entra`` (Azure without a key) or ``none``."""

    name: str
    kind: Literal["openai", "azure"]
    url: str  # base_url (openai) or azure_endpoint (azure), without a trailing slash
    api_version: str | None = None  # azure only
    api_key: SecretStr | None = field(default=None, repr=False)
    key_setting: str | None = None  # the app setting the key came from (safe to log)
    priority: int = 1
    weight: float = 1.0
    models: tuple[str, ...] | None = None  # None: serves any model
    deployments: Mapping[str, str] = field(default_factory=dict)

    @property
    def auth(self) -> Literal["key", "entra", "none"]:
        if self.api_key is not None:
            return "key"
        return "entra" if self.kind == "azure" else "none"

    @property
    def base_url(self) -> str | None:
        return self.url if self.kind == "openai" else None

    @property
    def azure_endpoint(self) -> str | None:
        return self.url if self.kind == "azure" else None

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def __repr__(self) -> str:  # never the key, nor credentials a legacy URL might carry
        return (f"Entry({self.name!r}, {self.kind}, {_display_url(self.url)!r}, auth={self.auth}, "
                f"priority={self.priority}, weight={self.weight}, models={self.models!r})")

    def deployment(self, model: str) -> str:
        """The name sent upstream for ``model``: for Azure OpenAI the deployment it maps to
        (the model name itself when unmapped), otherwise the model name."""
        return self.deployments.get(model, model)


# --------------------------------------------------------------------------------------------
# UPSTREAMS: parsing and validation.

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_SETTING_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_KEY_VAULT_REFERENCE = "@Microsoft.KeyVault("

Name = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=_NAME)]
NonEmpty = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class _EntrySpec(BaseModel):
    """One element of UPSTREAMS as written by the user."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: Name
    base_url: str | None = None
    azure_endpoint: str | None = None
    api_version: NonEmpty | None = None
    api_key_setting: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=_SETTING_NAME)] | None = None
    priority: int = Field(1, ge=0, le=1000)
    weight: float = Field(1.0, gt=0, le=1_000_000, allow_inf_nan=False)
    models: list[NonEmpty] | None = Field(None, min_length=1)
    deployments: dict[NonEmpty, NonEmpty] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "_EntrySpec":
        if (self.base_url is None) == (self.azure_endpoint is None):
            raise ValueError("needs exactly one of base_url (OpenAI or a compatible server) and azure_endpoint "
                             "(Azure OpenAI)")
        for key in ("base_url", "azure_endpoint"):
            value = getattr(self, key)
            if value is not None and _url_problem(value):
                raise ValueError(f"{key}: {_url_problem(value)}")
        if self.base_url is not None:
            for key in ("api_version", "deployments"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}: only for an azure_endpoint entry")
        if self.models is not None and len(set(self.models)) != len(self.models):
            raise ValueError("models: a model is listed twice")
        if self.deployments and self.models is not None:
            unserved = sorted(set(self.deployments) - set(self.models))
            if unserved:
                raise ValueError(f"deployments: maps {', '.join(map(repr, unserved))}, which models does not list")
        return self


def _url_problem(url: str) -> str | None:
    """What is wrong with an upstream URL, without quoting it (it could carry credentials)."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a bad port
    except ValueError:
        return "is not a valid URL"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    if parts.username is not None or parts.password is not None:
        return "must not carry credentials (use api_key_setting)"
    if parts.query or parts.fragment:
        return "must not have a query or a fragment"
    if any(c.isspace() for c in url):
        return "must not contain spaces"
    del port
    return None


_PATTERN_HINTS = {
    "name": "use letters, digits, '.', '_' and '-', starting with a letter or digit",
    "api_key_setting": "must be the name of an app setting (letters, digits and '_')",
}


def _where(index: int, item: object) -> str:
    name = item.get("name") if isinstance(item, dict) else None
    if isinstance(name, str) and name and len(name) <= 64 and name.isprintable():
        return f'{SETTING}[{index}] ({json.dumps(name)})'
    return f"{SETTING}[{index}]"


def _problems(exc: ValidationError) -> list[str]:
    """pydantic's errors as ``field: message``, never with the input (it could be a key)."""
    out = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = ".".join(str(p) for p in error["loc"])
        msg = error["msg"].removeprefix("Value error, ")
        if error["type"] == "string_pattern_mismatch":
            msg = _PATTERN_HINTS.get(loc, msg)
        if error["type"] == "extra_forbidden":
            msg = "unknown key"
            if loc in ("api_key", "key", "apiKey"):
                msg += " (a key never goes in UPSTREAMS: put it in its own app setting and name that setting " \
                       "in api_key_setting)"
        out.append(f"{loc}: {msg}" if loc else msg)
    return out


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the key {json.dumps(key)} appears twice in one object")
        seen[key] = value
    return seen


def _load(raw: str) -> list:
    try:
        data = json.loads(raw, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise PoolConfigError(f"{SETTING}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except ValueError as exc:  # from the hooks: the message is ours and quotes no value
        raise PoolConfigError(f"{SETTING}: not valid JSON ({exc})") from None
    if not isinstance(data, list):
        raise PoolConfigError(f"{SETTING}: must be a JSON list of upstream objects")
    if not data:
        raise PoolConfigError(f"{SETTING}: the list is empty (leave the setting out to use the single upstream "
                              "settings)")
    return data


def _key(spec: "_EntrySpec", where: str, environ: Mapping[str, str]) -> SecretStr | None:
    """The entry's key from the setting it names; PoolConfigError (never quoting the value) if unusable."""
    if spec.api_key_setting is None:
        return None
    value = environ.get(spec.api_key_setting, "")
    if not value.strip():
        raise PoolConfigError(f"{where}: api_key_setting: the app setting {spec.api_key_setting} is not set or empty")
    if value.startswith(_KEY_VAULT_REFERENCE):
        raise PoolConfigError(f"{where}: api_key_setting: the app setting {spec.api_key_setting} holds an unresolved "
                              "Key Vault reference (check the app's identity can read the secret)")
    return SecretStr(value)


def _entry(spec: "_EntrySpec", key: SecretStr | None) -> Entry:
    azure = spec.azure_endpoint is not None
    return Entry(
        name=spec.name,
        kind="azure" if azure else "openai",
        url=(spec.azure_endpoint or spec.base_url).rstrip("/"),
        api_version=(spec.api_version or DEFAULT_API_VERSION) if azure else None,
        api_key=key,
        key_setting=spec.api_key_setting,
        priority=spec.priority,
        weight=spec.weight,
        models=tuple(spec.models) if spec.models is not None else None,
        deployments=dict(spec.deployments or {}),
    )


def parse_upstreams(raw: str, environ: Mapping[str, str]) -> list[Entry]:
    """``UPSTREAMS`` → its entries, each key read from the setting its ``api_key_setting`` names.
    Raises PoolConfigError listing every problem found."""
    problems: list[str] = []
    entries: list[Entry] = []
    names: dict[str, int] = {}
    for index, item in enumerate(_load(raw)):
        where = _where(index, item)
        if not isinstance(item, dict):
            problems.append(f"{where}: must be a JSON object")
            continue
        try:
            spec = _EntrySpec.model_validate(item)
        except ValidationError as exc:
            problems.extend(f"{where}: {p}" for p in _problems(exc))
            continue
        folded = spec.name.casefold()
        if folded in names:
            problems.append(f"{where}: name: the same name as {SETTING}[{names[folded]}] (names must be unique, "
                            "ignoring case)")
            continue
        names[folded] = index
        try:
            entries.append(_entry(spec, _key(spec, where, environ)))
        except PoolConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise PoolConfigError("invalid app settings: " + "; ".join(problems))
    return entries


def legacy_entry(kind: str, *, base_url: str | None = None, endpoint: str | None = None,
                 api_version: str | None = None, api_key: str | SecretStr | None = None,
                 name: str = LEGACY_NAME) -> Entry | None:
    """The one entry the single-upstream settings describe (``kind`` as Settings.upstream_kind:
    ``openai``, ``azure`` or ``none``); None for ``none``. It serves any model, so a request may
    name another model (or Azure deployment) as before."""
    if isinstance(api_key, str):
        api_key = SecretStr(api_key) if api_key else None
    if kind == "none":
        return None
    if kind == "azure":
        if not endpoint:
            raise PoolConfigError("AZURE_OPENAI_ENDPOINT: required for an Azure OpenAI upstream")
        return Entry(name=name, kind="azure", url=endpoint.rstrip("/"), api_version=api_version or DEFAULT_API_VERSION,
                     api_key=api_key)
    if kind == "openai":
        # No base_url: the SDK's default (api.openai.com), as make_client does today.
        return Entry(name=name, kind="openai", url=(base_url or "https://api.openai.com/v1").rstrip("/"),
                     api_key=api_key)
    raise PoolConfigError(f"unknown upstream kind {kind!r}")


# --------------------------------------------------------------------------------------------
# Outcomes of one attempt.


class OutcomeKind(StrEnum):
    SUCCESS = "success"                    # the first delta arrived (or the call succeeded)
    RATE_LIMITED = "rate_limited"          # 429: this entry's deployment cools down
    QUOTA_EXHAUSTED = "quota_exhausted"    # 429 insufficient_quota (billing): cools down for the maximum
    CONNECT_FAILED = "connect_failed"      # no connection (refused, DNS, TLS, connect timeout): nothing was sent
    CONNECTION_LOST = "connection_lost"    # connected, then the connection broke
    TIMEOUT = "timeout"                    # no answer / first token in time
    SERVER_ERROR = "server_error"          # 5xx, 408, 409, an error event or a malformed chunk from the server
    AUTH_ERROR = "auth_error"              # 401/403: our configuration (key, role), not the entry's health
    CLIENT_ERROR = "client_error"          # other 4xx (400, 404, 413, 422 …): the request's problem
    OTHER = "other"                        # not an upstream failure (a bug of ours): no effect on the entry


_FAILOVER = {OutcomeKind.RATE_LIMITED, OutcomeKind.QUOTA_EXHAUSTED, OutcomeKind.CONNECT_FAILED,
             OutcomeKind.CONNECTION_LOST, OutcomeKind.TIMEOUT, OutcomeKind.SERVER_ERROR}
_HEALTH_FAILURE = {OutcomeKind.CONNECT_FAILED, OutcomeKind.CONNECTION_LOST, OutcomeKind.TIMEOUT,
                   OutcomeKind.SERVER_ERROR}
_COOLDOWN = {OutcomeKind.RATE_LIMITED, OutcomeKind.QUOTA_EXHAUSTED}
# The server answered: a probe that gets one of these proves the entry reachable.
_ANSWERED = {OutcomeKind.SUCCESS, OutcomeKind.RATE_LIMITED, OutcomeKind.QUOTA_EXHAUSTED, OutcomeKind.AUTH_ERROR,
             OutcomeKind.CLIENT_ERROR}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt on an entry came to. ``cooldown``: for a 429, the seconds its headers ask
    for (already parsed; None when they said nothing usable)."""

    kind: OutcomeKind
    status: int | None = None
    cooldown: float | None = None

    @property
    def failover(self) -> bool:
        """Whether the request should go on to the next candidate (only before the first delta)."""
        return self.kind in _FAILOVER

    @property
    def config_problem(self) -> bool:
        """Worth an error log naming the entry: our key or role is wrong, or the account has no
        quota left."""
        return self.kind in (OutcomeKind.AUTH_ERROR, OutcomeKind.QUOTA_EXHAUSTED)

    @classmethod
    def success(cls) -> "Outcome":
        return cls(OutcomeKind.SUCCESS)

    @classmethod
    def first_token_timeout(cls) -> "Outcome":
        return cls(OutcomeKind.TIMEOUT)

    @classmethod
    def rate_limited(cls, headers: Mapping[str, str] | None = None, *, wall_now: float | None = None,
                     status: int = 429) -> "Outcome":
        return cls(OutcomeKind.RATE_LIMITED, status, cooldown_from_headers(headers or {}, wall_now=wall_now))

    @classmethod
    def from_status(cls, status: int, headers: Mapping[str, str] | None = None, *, code: str | None = None,
                    wall_now: float | None = None) -> "Outcome":
        """An HTTP error status (and, for 429, its headers and the error's ``code``)."""
        if status == 429:
            if code == "insufficient_quota":
                return cls(OutcomeKind.QUOTA_EXHAUSTED, status)
            return cls.rate_limited(headers, wall_now=wall_now)
        if status in (401, 403):
            return cls(OutcomeKind.AUTH_ERROR, status)
        if status >= 500 or status in (408, 409):
            return cls(OutcomeKind.SERVER_ERROR, status)
        if 400 <= status < 500:
            return cls(OutcomeKind.CLIENT_ERROR, status)
        return cls(OutcomeKind.OTHER, status)


# --- 429 headers --------------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def _seconds(value: str) -> float | None:
    """``12``, ``0.5`` (Azure: seconds) or ``6m0s``, ``1s``, ``20ms`` (OpenAI: a duration)."""
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION.finditer(value):
            if match.start() != pos:
                return None
            seconds += float(match.group(1)) * _UNIT[match.group(2)]
            pos = match.end()
        if pos == 0 or pos != len(value):
            return None
    return seconds if math.isfinite(seconds) else None


def _number(value: str) -> float | None:
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _retry_after(value: str, wall_now: float) -> float | None:
    """``Retry-After``: delay-seconds (fractions tolerated) or an HTTP-date."""
    seconds = _number(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return when.timestamp() - wall_now


def cooldown_from_headers(headers: Mapping[str, str], *, wall_now: float | None = None) -> float | None:
    """Seconds a 429's headers ask to wait: the largest of ``Retry-After`` (seconds or HTTP-date),
    ``retry-after-ms`` and ``x-ratelimit-reset-requests`` / ``x-ratelimit-reset-tokens`` (seconds
    on Azure, a duration such as ``6m0s`` on OpenAI). A 429 does not say which limit tripped, so
    the latest one is the only wait sure to be past it. Values that are not finite and positive
    are ignored (Azure sends ``0`` and ``-1`` as placeholders); an explicit ``Retry-After`` of 0
    or a past date gives 0. None: nothing usable (the pool then uses its default)."""
    wall_now = time.time() if wall_now is None else wall_now
    lower = {k.lower(): v for k, v in headers.items()}
    found: list[float] = []
    explicit = False
    if "retry-after" in lower:
        seconds = _retry_after(lower["retry-after"], wall_now)
        if seconds is not None:
            explicit = True
            found.append(seconds)
    if "retry-after-ms" in lower:
        ms = _number(lower["retry-after-ms"])
        if ms is not None:
            explicit = True
            found.append(ms / 1000)
    for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
        if name in lower:
            seconds = _seconds(lower[name])
            if seconds is not None and seconds > 0:
                found.append(seconds)
    positive = [s for s in found if s > 0]
    if positive:
        return max(positive)
    return 0.0 if explicit else None


# --- exceptions from the openai SDK ---------------------------------------------------------------

_CONNECT_ERRORS = http_errors("ConnectError", "ConnectTimeout") + (ConnectionRefusedError, socket.gaierror)


def _connect_failure(exc: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, _CONNECT_ERRORS):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _error_code(exc: Any) -> str | None:
    code = getattr(exc, "code", None)
    if isinstance(code, str):
        return code
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("code"), str):
            return inner["code"]
    return None


def classify(exc: BaseException, headers: Mapping[str, str] | None = None, *,
             wall_now: float | None = None) -> Outcome:
    """An exception raised while opening or reading an upstream stream → its Outcome.
    ``headers``: the error response's headers when the exception does not carry them (an
    APIStatusError does). A TimeoutError is the relay's own first-token limit."""
    if isinstance(exc, openai.APIStatusError):
        merged = dict(exc.response.headers.items()) if exc.response is not None else {}
        merged.update(headers or {})
        return Outcome.from_status(exc.status_code, merged, code=_error_code(exc), wall_now=wall_now)
    if isinstance(exc, openai.APITimeoutError):  # before APIConnectionError: it is a subclass
        return Outcome(OutcomeKind.CONNECT_FAILED if _connect_failure(exc) else OutcomeKind.TIMEOUT)
    if isinstance(exc, openai.APIConnectionError):
        return Outcome(OutcomeKind.CONNECT_FAILED if _connect_failure(exc) else OutcomeKind.CONNECTION_LOST)
    if isinstance(exc, TimeoutError):  # asyncio's and anyio's timeouts are TimeoutError on 3.11+
        return Outcome(OutcomeKind.TIMEOUT)
    if isinstance(exc, openai.APIError):  # an error event in the stream
        return Outcome(OutcomeKind.SERVER_ERROR)
    return Outcome(OutcomeKind.OTHER)  # a ValueError here would be a bug of ours, not the entry's health


# --------------------------------------------------------------------------------------------
# The pool.


@dataclass(frozen=True)
class Policy:
    """Cooldown and breaker numbers (seconds). Defaults are the documented behaviour."""

    failure_threshold: int = 3          # consecutive failures that open the breaker
    failure_window: float = 60.0        # a failure older than this no longer counts toward the streak
    open_on_connect_failure: bool = True  # a failure to connect opens the breaker at once
    backoff_initial: float = 5.0        # first open; doubled on each reopening
    backoff_max: float = 300.0
    cooldown_default: float = 10.0     # a 429 whose headers say nothing usable
    cooldown_min: float = 1.0           # shortest cooldown after any 429
    cooldown_max: float = 300.0         # longest (Azure may ask for a day when a quota is used up)
    probe_wait: float = 1.0             # retry_after while another request is probing the only entry


@dataclass
class _Counters:
    requests: int = 0
    successes: int = 0
    failures: int = 0
    failovers: int = 0
    cooldowns: int = 0
    opens: int = 0


@dataclass
class _Health:
    failures: int = 0                   # consecutive
    last_failure: float = -math.inf
    open_until: float | None = None     # breaker open until then; half-open after, until a probe reports
    opens_in_a_row: int = 0             # back-off level
    generation: int = 0                 # bumped on each opening: stale attempts do not move the breaker
    probing: bool = False               # a half-open probe is in flight
    cooldowns: dict[str, float] = field(default_factory=dict)  # deployment → until
    counters: _Counters = field(default_factory=_Counters)


@dataclass(frozen=True)
class PoolEvent:
    """A change worth a log line: ``cooldown`` (seconds, deployment), ``open`` (seconds),
    ``closed``, ``config_problem`` (status)."""

    entry: str
    event: str
    reason: str
    seconds: float | None = None
    deployment: str | None = None


@dataclass(frozen=True)
class Unavailable:
    """Why no entry can take a model's request now: ``retry_after`` seconds until the soonest is
    free; ``reason`` ``rate_limited`` when every entry serving it is cooling down after 429s (answer
    429), else ``unavailable`` (answer 503)."""

    retry_after: float
    reason: Literal["rate_limited", "unavailable"]


class Attempt:
    """One try of one entry, from ``Pool.acquire``. Report its outcome with ``report`` (more than
    once is fine: success at the first delta, then a mid-stream failure). Use it as a context
    manager, or call ``release``: a half-open probe slot is freed even if the request is cancelled
    before it reports (a cancelled probe says nothing about the entry, so the next request probes)."""

    __slots__ = ("pool", "entry", "model", "deployment", "probe", "_generation", "_released", "_reported",
                 "_delivered")

    def __init__(self, pool: "Pool", entry: Entry, model: str, probe: bool, generation: int) -> None:
        self.pool = pool
        self.entry = entry
        self.model = model
        self.deployment = entry.deployment(model)
        self.probe = probe
        self._generation = generation
        self._released = False
        self._reported = False
        self._delivered = False  # success reported: later failures are mid-stream (no failover)

    def report(self, outcome: Outcome) -> None:
        self.pool._record(self, outcome)
        self._reported = True
        if outcome.kind is OutcomeKind.SUCCESS:
            self._delivered = True
        self.release()

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self.probe:
                self.pool._health[self.entry.name].probing = False

    def __enter__(self) -> "Attempt":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Attempt({self.entry.name!r}, {self.deployment!r}, probe={self.probe})"


def _display_url(url: str) -> str:
    """The URL without any user:password (UPSTREAMS refuses them; a legacy setting might not)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _weighted_order(entries: list[Entry], rng: random.Random) -> list[Entry]:
    """Weighted sampling without replacement: each entry draws an exponential clock with rate
    ``weight``; sorted by it, the first is entry i with probability w_i / Σw, and so on for the
    rest (Efraimidis–Spirakis)."""
    keyed = [(-math.log(1.0 - rng.random()) / e.weight, i, e) for i, e in enumerate(entries)]
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [e for _, _, e in keyed]


class Pool:
    """The entries and their health. ``now`` is a monotonic clock, ``rng`` the random source for the
    weighted order; ``on_event`` hears of cooldowns, breakers opening and closing, and
    configuration problems (for log lines)."""

    def __init__(self, entries: Iterable[Entry], *, policy: Policy | None = None,
                 now: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None,
                 on_event: Callable[[PoolEvent], None] | None = None) -> None:
        self.entries: tuple[Entry, ...] = tuple(entries)
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names):
            raise PoolConfigError(f"{SETTING}: entry names must be unique")
        self.policy = policy or Policy()
        self._now = now
        self._rng = rng or random.Random()
        self._on_event = on_event
        self._health: dict[str, _Health] = {e.name: _Health() for e in self.entries}

    # --- construction from settings ---------------------------------------------------------

    @classmethod
    def from_settings(cls, upstreams: str | None, environ: Mapping[str, str],
                      legacy: Mapping[str, Any] | None = None, **kwargs: Any) -> "Pool":
        """``UPSTREAMS`` when set (not empty), else the single upstream described by ``legacy``
        (``kind``, ``base_url``, ``endpoint``, ``api_version``, ``api_key``: the values of
        Settings.upstream_kind and the OPENAI_* / AZURE_OPENAI_* settings). With neither, the pool
        is empty (``configured`` is false)."""
        if upstreams is not None and upstreams.strip():
            return cls(parse_upstreams(upstreams, environ), **kwargs)
        legacy = dict(legacy or {"kind": "none"})
        entry = legacy_entry(legacy.pop("kind", "none"), **legacy)
        return cls([entry] if entry else [], **kwargs)

    @property
    def configured(self) -> bool:
        return bool(self.entries)

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def serves(self, model: str) -> bool:
        """Whether any entry serves ``model`` (if not: a 400 naming the model, no upstream call)."""
        return any(e.serves(model) for e in self.entries)

    # --- choosing ---------------------------------------------------------------------------

    def _wait(self, entry: Entry, model: str, now: float) -> tuple[float, str] | None:
        """None if the entry can take a request for ``model`` now; else (seconds, why)."""
        health = self._health[entry.name]
        waits: list[tuple[float, str]] = []
        if health.open_until is not None:
            if now < health.open_until:
                waits.append((health.open_until - now, "open"))
            elif health.probing:
                waits.append((self.policy.probe_wait, "probing"))
        deployment = entry.deployment(model)
        until = health.cooldowns.get(deployment)
        if until is not None:
            if now < until:
                waits.append((until - now, "cooling_down"))
            else:
                del health.cooldowns[deployment]
        if not waits:
            return None
        why = "cooling_down" if all(w == "cooling_down" for _, w in waits) else "unavailable"
        return max(seconds for seconds, _ in waits), why

    def candidates(self, model: str) -> list[Entry]:
        """The entries to try for ``model``, in order: those serving it and free now (not cooling
        down, breaker not open, no probe of theirs in flight); lowest priority number first, a
        weighted random order within a priority."""
        now = self._now()
        free = [e for e in self.entries if e.serves(model) and self._wait(e, model, now) is None]
        ordered: list[Entry] = []
        for priority in sorted({e.priority for e in free}):
            ordered.extend(_weighted_order([e for e in free if e.priority == priority], self._rng))
        return ordered

    def acquire(self, entry: Entry, model: str) -> Attempt | None:
        """Start an attempt on ``entry`` (checked again: the request may have awaited other entries
        since ``candidates``). A half-open entry gives its one probe slot to this attempt; None when
        the entry is no longer free."""
        now = self._now()
        if not entry.serves(model) or self._wait(entry, model, now) is not None:
            return None
        health = self._health[entry.name]
        probe = health.open_until is not None  # free and open_until set: half-open
        if probe:
            health.probing = True
        health.counters.requests += 1
        return Attempt(self, entry, model, probe, health.generation)

    def unavailable(self, model: str) -> Unavailable | None:
        """When entries serve ``model`` but none is free: how long until the soonest is, and why.
        None when one is free, or when none serves the model."""
        now = self._now()
        waits = []
        for entry in self.entries:
            if entry.serves(model):
                wait = self._wait(entry, model, now)
                if wait is None:
                    return None
                waits.append(wait)
        if not waits:
            return None
        reason = "rate_limited" if all(why == "cooling_down" for _, why in waits) else "unavailable"
        return Unavailable(min(seconds for seconds, _ in waits), reason)

    def retry_after(self, model: str) -> float | None:
        """Seconds until the soonest entry serving ``model`` is free, when none is now (the caller
        answers with ``Retry-After: ceil(seconds)`` without calling any upstream); else None."""
        blocked = self.unavailable(model)
        return blocked.retry_after if blocked else None

    # --- outcomes ---------------------------------------------------------------------------

    def report(self, attempt: Attempt, outcome: Outcome) -> None:
        """Record the outcome of an attempt (the same as ``attempt.report(outcome)``). An attempt,
        not a bare entry: it carries the deployment a 429 cools down, and whether it is the
        half-open probe."""
        attempt.report(outcome)

    def _emit(self, event: PoolEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def _cool_down(self, health, deployment: str, outcome: Outcome, now: float) -> float:
        """Put ``deployment`` of an entry out for the 429's wait (bounded by the policy); the seconds."""
        policy = self.policy
        if outcome.kind is OutcomeKind.QUOTA_EXHAUSTED:
            seconds = policy.cooldown_max
        elif outcome.cooldown is None:
            seconds = policy.cooldown_default
        else:
            seconds = outcome.cooldown
        seconds = min(max(seconds, policy.cooldown_min), policy.cooldown_max)
        # Expired cooldowns go now, not only when their name is asked for again: the names may be
        # the callers' (an entry without ``models``), and must not pile up.
        health.cooldowns = {d: u for d, u in health.cooldowns.items() if u > now}
        until = now + seconds
        if seconds > 0 and until > health.cooldowns.get(deployment, -math.inf):
            health.cooldowns[deployment] = until
        return seconds

    def _record(self, attempt: Attempt, outcome: Outcome) -> None:
        entry, health, policy = attempt.entry, self._health[attempt.entry.name], self.policy
        now = self._now()
        counters = health.counters
        if outcome.failover and not attempt._delivered:
            counters.failovers += 1
        if outcome.config_problem:
            self._emit(PoolEvent(entry.name, "config_problem", outcome.kind.value, deployment=attempt.deployment))

        if outcome.kind in _COOLDOWN:
            counters.cooldowns += 1
            seconds = self._cool_down(health, attempt.deployment, outcome, now)
            self._emit(PoolEvent(entry.name, "cooldown", outcome.kind.value, seconds, attempt.deployment))
        elif outcome.kind is OutcomeKind.SUCCESS:
            counters.successes += 1
        elif outcome.kind in _HEALTH_FAILURE:
            counters.failures += 1

        # The breaker moves only on this era's attempts: the probe while half-open, or any
        # attempt while closed that started after the last opening.
        half_open_probe = attempt.probe and not attempt._released  # its first report, slot still held
        closed_now = health.open_until is None and attempt._generation == health.generation
        if not (half_open_probe or closed_now):
            return
        if outcome.kind in _HEALTH_FAILURE:
            if half_open_probe:
                self._open(entry, health, now, outcome)
                return
            if now - health.last_failure > policy.failure_window:
                health.failures = 0
            health.failures += 1
            health.last_failure = now
            if health.failures >= policy.failure_threshold or (
                    outcome.kind is OutcomeKind.CONNECT_FAILED and policy.open_on_connect_failure):
                self._open(entry, health, now, outcome)
        elif outcome.kind in _ANSWERED:
            health.failures = 0
            if half_open_probe:
                health.open_until = None
                health.opens_in_a_row = 0
                self._emit(PoolEvent(entry.name, "closed", outcome.kind.value))

    def _open(self, entry: Entry, health: _Health, now: float, outcome: Outcome) -> None:
        policy = self.policy
        seconds = min(policy.backoff_initial * (2 ** min(health.opens_in_a_row, 32)), policy.backoff_max)
        health.opens_in_a_row += 1
        health.open_until = now + seconds
        health.generation += 1
        health.failures = 0
        health.counters.opens += 1
        self._emit(PoolEvent(entry.name, "open", outcome.kind.value, seconds))

    # --- reporting --------------------------------------------------------------------------

    def state(self) -> list[dict]:
        """Per entry, for a status endpoint and telemetry: never a key (only the name of the
        setting holding it)."""
        now = self._now()
        out = []
        for entry in self.entries:
            health = self._health[entry.name]
            for deployment, until in list(health.cooldowns.items()):
                if until <= now:
                    del health.cooldowns[deployment]
            cooling = {d: round(until - now, 3) for d, until in sorted(health.cooldowns.items())}
            if health.open_until is not None and now < health.open_until:
                state, until = "open", health.open_until - now
            elif health.open_until is not None:
                state, until = "half_open", None
            elif cooling:
                state, until = "cooling_down", max(cooling.values())
            else:
                state, until = "ok", None
            out.append({
                "name": entry.name,
                "kind": entry.kind,
                "url": _display_url(entry.url),
                "auth": entry.auth,
                "key_setting": entry.key_setting,
                "priority": entry.priority,
                "weight": entry.weight,
                "models": list(entry.models) if entry.models is not None else None,
                "state": state,
                "until": round(until, 3) if until is not None else None,
                "probing": health.probing,
                "cooldowns": cooling,
                "consecutive_failures": health.failures,
                "counters": vars(health.counters).copy(),
            })
        return out
