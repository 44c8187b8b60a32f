"""The pool in the request path (issue #14): which upstream entry a request goes to, and moving it
to the next one when an entry fails before any output.

``Upstreams`` is the pool (chatstream/pool.py) with one SDK client per entry. For a streamed
request, ``open_first_output`` walks the candidates: per entry it opens the stream and reads it
until the API's protocol says the first output came (a throwaway protocol without the pipeline's
text steps, so nothing the caller sees is touched). A 429, 408/409, 5xx, a connection failure, an
error event or a malformed chunk, or the per-entry first-token limit moves the request to the next
entry; anything else (400, 401/403, 404 …) is the answer, as with a single upstream. The stream it
returns replays the chunks it read and then goes on with the entry's stream, so the stream core
(stream.py) sees one ordinary upstream stream: its held chunks, time limits and closing all work as
before. After the first output the request stays on its entry; a later failure is the stream's
final error event, and counts against that entry's health.

The whole walk is one wait of the core (``limits.wait(open_stream())``), so it stays within
``FIRST_TOKEN_TIMEOUT_SECONDS``. Non-streamed calls walk the candidates the same way, one whole call
per entry.

Without ``UPSTREAMS`` the single-upstream settings form a pool of one entry, ``default``, whose
cooldowns and breaker never hold a request back: it is always tried, and its errors reach the
caller exactly as before."""
from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio
import openai

from . import telemetry
from .errors import ApiError, UpstreamMalformed, UpstreamReported, invalid_request
from .limits import TimeLimits, first_token_expired
from .pool import (Attempt, Entry, Outcome, OutcomeKind, Policy, Pool, PoolConfigError, PoolEvent, classify,
                   legacy_entry)
from .record import StreamRecord, log_safe
from .settings import Settings, SettingsError
from .stream import StreamProtocol, incomplete
from .upstream import _DEPLOYMENT_NAME, UpstreamStream, check_model_name, complete, entra_token_provider, \
    make_client, make_entry_client

log = logging.getLogger("chatstream")
# asyncio may run a timer up to its clock resolution early: a cancellation this close to the
# request's first-token deadline is that deadline.
_TIMER_SLACK = 0.01

# The single upstream of the legacy settings: outcomes are counted (pool state, telemetry) but never
# hold a request back, so nothing changes for an app without UPSTREAMS.
PASS_THROUGH = Policy(failure_threshold=2**31, open_on_connect_failure=False, cooldown_min=0.0, cooldown_max=0.0)


def outcome_of(exc: BaseException) -> Outcome:
    """``pool.classify`` plus our own errors for what the upstream sent: a malformed chunk and a
    stream that ended before any output are the server's failures."""
    if isinstance(exc, (UpstreamMalformed, UpstreamReported)) or \
            (isinstance(exc, ApiError) and exc.type == "upstream_incomplete"):
        return Outcome(OutcomeKind.SERVER_ERROR)
    if isinstance(exc, ApiError) and exc.type == "upstream_timeout":  # the per-entry first-token limit
        return Outcome.first_token_timeout()
    if isinstance(exc, ApiError):
        return Outcome(OutcomeKind.OTHER)
    return classify(exc)


def _log_event(event: PoolEvent) -> None:
    """The pool's changes as log lines and metrics."""
    if event.event == "cooldown":
        telemetry.upstream_event("cooldowns", event.entry)
        if not event.seconds:  # the single upstream of the legacy settings never cools down
            return
        log.warning("upstream %s: %s, cooling down %.1fs for %s", event.entry, event.reason, event.seconds or 0,
                    log_safe(event.deployment or ""))
    elif event.event == "open":
        log.warning("upstream %s: %s, skipped for %.1fs (breaker open)", event.entry, event.reason, event.seconds or 0)
    elif event.event == "closed":
        log.info("upstream %s: answered again (breaker closed)", event.entry)
    elif event.event == "config_problem":
        if event.reason == OutcomeKind.QUOTA_EXHAUSTED:
            log.error("upstream %s: its quota is used up (insufficient_quota): check the account's billing",
                      event.entry)
        else:
            log.error("upstream %s: authentication failed: check its key (api_key_setting) or, for Entra ID, "
                      "the app identity's role on that resource", event.entry)


class PeekedStream:
    """An upstream stream whose first chunks were already read (up to the first output): iterating
    it gives those chunks again, then the rest of the stream. A failure after them is reported to
    the entry's attempt (it counts against the entry's health, never as a failover)."""

    def __init__(self, stream: UpstreamStream, peeked: list[dict], attempt: Attempt):
        self._stream = stream
        self._peeked = peeked
        self._replaying = 0  # peeked chunks not yet given again
        self._attempt = attempt
        self._closed = False
        self._iterator = self._chunks()  # one iterator, as AsyncStream: the core iterates it twice

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._iterator

    @property
    def ready(self) -> int:
        """Chunks in hand (see UpstreamStream.ready)."""
        return self._replaying + self._stream.ready

    async def _chunks(self) -> AsyncIterator[dict]:
        peeked, self._peeked = self._peeked, []
        for i, data in enumerate(peeked, 1):
            self._replaying = len(peeked) - i
            yield data
        try:
            async for data in self._stream:
                yield data
        except Exception as exc:
            if not self._closed:
                self._attempt.report(outcome_of(exc))
            raise

    async def close(self) -> None:
        self._closed = True
        await self._stream.close()

    @property
    def response(self):
        return self._stream.response


async def _close(stream: UpstreamStream | None) -> None:
    if stream is not None:
        with anyio.CancelScope(shield=True):
            await stream.close()


async def _peek(stream: UpstreamStream, probe: StreamProtocol) -> list[dict]:
    """Read ``stream`` up to its first output (as ``probe`` sees it); the chunks read. An answer
    that is complete without output is the core's to judge, as with a single upstream; a stream that
    ends before either is the entry's failure."""
    chunks = aiter(stream)
    held: list[dict] = []
    while True:
        try:
            data = await anext(chunks)
        except StopAsyncIteration:
            if probe.finished:
                return held
            raise incomplete() from None
        held.append(data)
        fed = await probe.feed(data)
        if (fed.data is not None and fed.output) or probe.done:
            return held


class EachEntry:
    """``get`` / ``post`` / ``delete`` for calls about something only the entry that made it knows
    (a stored response's id): asked of each entry in priority order, health aside; a 404 or a
    failed connection moves on to the next, and the last one's error is the answer. With one entry
    it is that entry's client."""

    def __init__(self, clients: list):
        self.clients = clients

    async def _each(self, method: str, path: str, kwargs: dict):
        last: BaseException | None = None
        for client in self.clients:
            try:
                return await getattr(client, method)(path, **kwargs)
            except (openai.NotFoundError, openai.APIConnectionError) as exc:
                last = exc
        if last is None:
            raise ApiError(503, "not_configured", "no model upstream is configured")
        raise last

    async def get(self, path: str, **kwargs):
        return await self._each("get", path, kwargs)

    async def post(self, path: str, **kwargs):
        return await self._each("post", path, kwargs)

    async def delete(self, path: str, **kwargs):
        return await self._each("delete", path, kwargs)


class Upstreams:
    """The pool and one SDK client per entry; shared by every endpoint of the app."""

    def __init__(self, settings: Settings, pool: Pool, clients: Mapping[str, openai.AsyncOpenAI], pooled: bool):
        self.settings = settings
        self.pool = pool
        self.clients = dict(clients)
        self.pooled = pooled  # from UPSTREAMS (else the single-upstream settings)

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str] | None = None,
                      client: openai.AsyncOpenAI | None = None, credential=None, **pool_args: Any) -> "Upstreams":
        """``UPSTREAMS`` when set (a bad value raises SettingsError naming the setting and the
        entry), else the single upstream (``client``, or one made from the settings).
        ``pool_args``: ``now``, ``rng``, ``policy`` for the Pool."""
        pool_args.setdefault("on_event", _log_event)
        if not settings.pooled:
            return cls.single(settings, client, credential, **pool_args)
        try:
            pool = Pool.from_settings(settings.upstreams, os.environ if environ is None else environ, **pool_args)
        except PoolConfigError as exc:
            raise SettingsError(str(exc)) from None
        # With somewhere else to go, the SDK must not retry the same entry first (honouring a
        # Retry-After of up to minutes): the pool moves the request on instead.
        retries = settings.upstream_max_retries if len(pool.entries) == 1 else 0
        provider = None
        if any(e.kind == "azure" and e.api_key is None for e in pool.entries):
            provider = entra_token_provider(credential)
        clients = {e.name: make_entry_client(e, settings, retries, provider) for e in pool.entries}
        return cls(settings, pool, clients, pooled=True)

    @classmethod
    def single(cls, settings: Settings, client: openai.AsyncOpenAI | None = None, credential=None,
               **pool_args: Any) -> "Upstreams":
        """The single-upstream settings as a pass-through pool of one entry (none if unconfigured)."""
        kind = settings.upstream_kind
        key = settings.azure_openai_api_key if kind == "azure" else settings.openai_api_key
        entry = legacy_entry(kind, base_url=settings.openai_base_url, endpoint=settings.azure_openai_endpoint,
                             api_version=settings.azure_openai_api_version, api_key=key)
        pool_args.setdefault("policy", PASS_THROUGH)
        pool = Pool([entry] if entry else [], **pool_args)
        clients = {entry.name: client or make_client(settings, credential)} if entry else {}
        return cls(settings, pool, clients, pooled=False)

    @property
    def configured(self) -> bool:
        return self.pool.configured

    def map_clients(self, wrap: Callable[[Entry, Any], Any]) -> "Upstreams":
        """The same pool (one health and one set of counters) with each entry's client wrapped,
        e.g. in the Responses API's client (api_responses.ResponsesClient)."""
        return Upstreams(self.settings, self.pool, {e.name: wrap(e, self.clients[e.name]) for e in self.pool.entries},
                         self.pooled)

    def each_entry(self) -> "EachEntry":
        """A client for calls about something one entry holds (a stored response): see EachEntry."""
        ordered = sorted(self.pool.entries, key=lambda e: e.priority)
        return EachEntry([self.clients[e.name] for e in ordered])

    def model_names(self) -> tuple[str, ...] | None:
        """The models the entries list, when every entry lists its own; None: any model."""
        if not self.pooled or any(e.models is None for e in self.pool.entries):
            return None
        return tuple(dict.fromkeys(m for e in self.pool.entries for m in e.models or ()))

    def check_model(self, model: str) -> None:
        """400 for a model no entry serves, or one that cannot be an Azure deployment name."""
        if not self.pooled:
            check_model_name(self.settings, model)
            return
        if not self.pool.serves(model):
            raise ApiError(400, "model_not_allowed", f"model {model!r} is not served by any upstream here", "model")
        for entry in self.pool.entries:
            if entry.serves(model) and entry.kind == "azure" and not _DEPLOYMENT_NAME.fullmatch(entry.deployment(model)):
                raise invalid_request(f"model {model!r} is not a valid Azure OpenAI deployment name", "model")

    def _unavailable(self, model: str) -> ApiError:
        """Every entry serving ``model`` is cooling down or out: answered without an upstream call."""
        blocked = self.pool.unavailable(model)
        seconds = max(1, math.ceil(blocked.retry_after)) if blocked else 1
        headers = {"Retry-After": str(seconds)}
        if blocked is not None and blocked.reason == "rate_limited":
            return ApiError(429, "rate_limited", "every upstream serving this model is rate limited; retry later",
                            retryable=True, headers=headers)
        return ApiError(503, "upstream_unavailable", "no upstream serving this model is available now; retry later",
                        retryable=True, headers=headers)

    def _entry_deadline(self, limits: TimeLimits, last: bool) -> float | None:
        """When this entry's first output is due, if before the request's own first-token deadline."""
        per_entry = self.settings.entry_first_token_timeout
        if per_entry is None or last:
            return None
        at = limits.loop.time() + per_entry
        return at if at < limits.deadline else None

    def _attempts(self, model: str, record: StreamRecord):
        """(entry, attempt, is_last) for each candidate that can still take the request."""
        candidates = self.pool.candidates(model)
        if not candidates:
            raise self._unavailable(model)
        for i, entry in enumerate(candidates):
            attempt = self.pool.acquire(entry, model)
            if attempt is None:
                continue
            record.upstream = entry.name
            record.attempts += 1
            telemetry.upstream_event("requests", entry.name)
            yield entry, attempt, i == len(candidates) - 1

    def _failed(self, attempt: Attempt, exc: BaseException) -> bool:
        """Report a failed attempt; whether the request moves to the next entry."""
        outcome = outcome_of(exc)
        attempt.report(outcome)
        if outcome.failover:
            telemetry.upstream_event("failovers", attempt.entry.name, reason=outcome.kind.value)
            log.info("upstream %s: %s before any output; the request moves on to the next free entry, if any",
                     attempt.entry.name, outcome.kind.value)
        return outcome.failover

    async def open_first_output(self, path: str, params: dict, make_probe: Callable[[], StreamProtocol],
                                limits: TimeLimits, record: StreamRecord) -> PeekedStream:
        """The first entry, in the pool's order, whose stream reaches its first output; else the
        last failure (or 429/503 with Retry-After when no entry could be tried)."""
        model = params["model"]
        last: BaseException | None = None
        for entry, attempt, is_last in self._attempts(model, record):
            stream = None
            try:
                async with asyncio.timeout_at(self._entry_deadline(limits, is_last)):
                    stream = await UpstreamStream.open(self.clients[entry.name], path,
                                                       {**params, "model": entry.deployment(model)})
                    peeked = await _peek(stream, make_probe())
            except asyncio.CancelledError:
                # The request's own first-token limit (the core turns it into the error), or the
                # caller hung up (says nothing about the entry).
                if limits.loop.time() >= limits.deadline - _TIMER_SLACK:
                    attempt.report(Outcome.first_token_timeout())
                else:
                    attempt.release()
                await _close(stream)
                raise
            except TimeoutError:
                await _close(stream)
                last = first_token_expired()
                self._failed(attempt, last)
                continue
            except Exception as exc:
                await _close(stream)
                if self._failed(attempt, exc):
                    last = exc
                    continue
                raise
            attempt.report(Outcome.success())
            return PeekedStream(stream, peeked, attempt)
        if last is None:
            raise self._unavailable(model)
        raise last

    async def complete(self, path: str, params: dict, record: StreamRecord) -> dict:
        """A non-streamed call: the first entry that answers it, in the pool's order."""
        model = params["model"]
        last: BaseException | None = None
        for entry, attempt, _ in self._attempts(model, record):
            try:
                body = await complete(self.clients[entry.name], path, {**params, "model": entry.deployment(model)})
            except asyncio.CancelledError:
                attempt.release()
                raise
            except Exception as exc:
                if self._failed(attempt, exc):
                    last = exc
                    continue
                raise
            attempt.report(Outcome.success())
            return body
        if last is None:
            raise self._unavailable(model)
        raise last

    def state(self) -> dict:
        """What GET /api/_pool shows: never a key, only the name of the setting holding it."""
        return {"source": "UPSTREAMS" if self.pooled else "single", "upstreams": self.pool.state()}
