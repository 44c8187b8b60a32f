"""The upstreams in the request path: the pool (pool.py) with one SDK client per entry.

For a streamed request, ``open`` walks the candidates: per entry it opens the stream and reads it
until the API's protocol (a probe of it, without text steps) says the first output came. A 429,
408/409, 5xx, a connection failure, an error event or a malformed chunk, or the per-entry
first-token limit moves the request to the next entry; a context-length, content-filter, auth or
quota error goes where ``pool.route`` says (UPSTREAM_ERROR_ROUTES: after a context-length error only
entries with a larger ``context_window``); anything else (400, 404 …) is the answer, as with a
single upstream. The stream it returns replays the chunks it read and then goes on with the
entry's stream, so the stream core sees one ordinary upstream stream. After the first output the
request stays on its entry; a later failure counts against that entry's health, and the answer
either goes on on another stream (``open_next``: continuation.py; ``reattach``: apis/responses.py) or ends with the
final error event. Failures reach the core already explained (``classify``): an ``ApiError`` for
the caller, the ``Outcome`` for the entry.

The whole walk is one wait of the core, so it stays within ``FIRST_TOKEN_TIMEOUT_SECONDS``.
Non-streamed calls walk the candidates the same way, one whole call per entry. Without
``UPSTREAMS`` the single-upstream settings form a pool of one entry, ``default`` (health.SINGLE)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Generator, Iterator, Mapping
from types import CoroutineType
from typing import Any, TypeVar

import anyio
import openai

from .. import telemetry
from ..errors import ApiError, ErrorKind, error_field, incomplete, retry_after_headers
from ..record import StreamRecord
from ..settings import Settings
from ..stream import StreamProtocol, TimeLimits, UpstreamChunks
from . import config
from .clients import (
    ResponsesClient,
    SdkClient,
    UpstreamStream,
    complete,
    entra_token_provider,
    make_client,
)
from .config import Entry
from .health import SINGLE, Policy
from .outcomes import (
    SUCCESS,
    TIMED_OUT,
    Classified,
    Outcome,
    OutcomeKind,
    classify,
)
from .pool import Attempt, Pool

log = logging.getLogger("chatstream")
T = TypeVar("T")
# asyncio may run a timer up to its clock resolution early: a cancellation this close to the
# request's first-token deadline is that deadline.
_TIMER_SLACK = 0.01
# An entry with no first-output limit of its own (the last one, or no ENTRY_FIRST_TOKEN_TIMEOUT):
# its call goes without a timeout scope (one object fewer while it waits for its first chunk).
_NO_LIMIT = contextlib.nullcontext()
# Azure OpenAI puts the model (the deployment name) in the URL path, so only a name that is one
# plain path segment may go there ("." or ".." would change the path the SDK builds).
DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class PeekedStream:
    """An upstream stream read up to its first output (``_peek``): the chunks read, then the rest of
    the stream; a failure after them goes through ``_Midstream``. Its own iterator, with a plain
    ``__anext__`` handing out the stream's own reads (a generator around them cost every chunk)."""

    def __init__(self, stream: UpstreamStream, peeked: list[dict], attempt: Attempt | None, model: str):
        self._stream = stream
        self._peeked = peeked
        self._given = 0  # peeked chunks given again
        self._midstream = stream.failure = _Midstream(attempt, model)
        self._next = aiter(stream).__anext__

    def __aiter__(self) -> AsyncIterator[dict]:
        return self  # one iterator, as AsyncStream: the core iterates it twice

    def __anext__(self) -> Awaitable[dict]:
        if self._given < len(self._peeked):
            data = self._peeked[self._given]
            self._given += 1
            if self._given == len(self._peeked):
                self._peeked = []
                self._given = 0
            return _Given(data)
        return self._next()

    @property
    def ready(self) -> int:
        """Chunks in hand (see UpstreamStream.ready)."""
        return len(self._peeked) - self._given + self._stream.ready

    @property
    def request_id(self) -> str | None:
        return self._stream.request_id

    @property
    def entry(self) -> Entry | None:
        """The pool entry this stream comes from (None for a stored stream read again)."""
        attempt = self._midstream.attempt
        return attempt.entry if attempt is not None else None

    async def close(self) -> None:
        self._midstream.closed = True
        await self._stream.close()


class _Given:
    """A chunk in hand, as an awaitable (``PeekedStream.__anext__``)."""

    __slots__ = ("data",)

    def __init__(self, data: dict) -> None:
        self.data = data

    def __await__(self) -> Generator[Any, None, dict]:
        return self.data
        yield  # a generator that returns at once


class _Midstream:
    """A failure of a stream after its first output, explained (``classify``: a bug of ours
    included) and told to the entry's attempt, unless the stream was closed (by us) first. An
    object of its own, not a bound method of the PeekedStream: no reference cycle."""

    __slots__ = ("attempt", "closed", "model")

    def __init__(self, attempt: Attempt | None, model: str) -> None:
        self.attempt = attempt
        self.model = model
        self.closed = False

    def __call__(self, exc: Exception) -> Exception:
        failure = classify(exc, self.model, midstream=True)
        if not self.closed and self.attempt is not None:
            self.attempt.report(failure.outcome)
        return failure.error


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
        if fed.output or probe.done:  # (NOTHING is no output)
            return held


async def _reread(client: SdkClient, path: str, query: dict, probe: StreamProtocol) -> PeekedStream:
    """A stored event stream (``GET path?query``) read up to its first output; closed if that fails."""
    stream = await UpstreamStream.open(client, path, {}, method="get", query=query)
    try:
        peeked = await _peek(stream, probe)
    except BaseException:
        await _close(stream)
        raise
    return PeekedStream(stream, peeked, None, "")


class _Way:
    """One request's way through the pool's candidates: after a context-length error, only entries
    declaring a larger ``context_window`` than the entries that refused it (one declaring none counts
    as 0); ``again``: try the entry just tried once more; ``deadline``: the request's first-token
    deadline (loop time), if any."""

    __slots__ = ("again", "deadline", "min_window", "retried")

    def __init__(self, deadline: float | None = None) -> None:
        self.again = False
        self.deadline = deadline
        self.min_window: int | None = None
        self.retried: set[str] = set()

    def allows(self, entry: Entry) -> bool:
        return self.min_window is None or (entry.context_window or 0) > self.min_window

    def larger_than(self, entry: Entry) -> None:
        self.min_window = max(self.min_window or 0, entry.context_window or 0)


class Upstreams:
    """The pool and one client per entry; shared by every endpoint of the app (``stream.Upstream``)."""

    def __init__(self, settings: Settings, pool: Pool, clients: Mapping[str, SdkClient]):
        self.settings = settings
        self.pool = pool
        self.clients = dict(clients)
        self.pooled = settings.pooled  # from UPSTREAMS (else the single-upstream settings)
        self.configured = bool(pool.entries)
        self._closer: AsyncIterator[None] | None = None

    @classmethod
    def from_settings(
        cls, settings: Settings, environ: Mapping[str, str] | None = None, credential: Any = None, **pool_args: Any
    ) -> Upstreams:
        """The entries of the settings (``UPSTREAMS``, or the single upstream; a bad value raises
        SettingsError naming the setting and the entry), each with a client. ``environ``: where the
        keys ``api_key_setting`` names are read (default: the process environment); ``credential``:
        for Entra ID (default: DefaultAzureCredential); ``pool_args``: ``now``, ``rng``, ``policy``."""
        entries = config.entries(settings, os.environ if environ is None else environ)
        if not settings.pooled:
            pool_args.setdefault("policy", SINGLE)
        else:
            probe = settings.upstream_probe_seconds
            pool_args.setdefault(
                "policy", Policy(backoff_initial=min(settings.upstream_open_seconds, probe), backoff_max=probe)
            )
        pool_args.setdefault("routes", settings.error_routes)
        # With somewhere else to go, the SDK must not retry the same entry first (honouring a
        # Retry-After of up to minutes): the pool moves the request on instead.
        retries = settings.upstream_max_retries if len(entries) == 1 else 0
        provider = None
        if any(e.kind == "azure" and e.api_key is None for e in entries):
            provider = entra_token_provider(credential)
        clients = {e.name: make_client(e, settings, retries, provider) for e in entries}
        return cls(settings, Pool(entries, **pool_args), clients)

    def for_responses(self) -> Upstreams:
        """The same pool (one health, one set of counters) with each client as the Responses API
        calls it (Azure's v1 paths for an entry on a dated API version)."""
        clients = {e.name: ResponsesClient(self.clients[e.name], dated=e.dated) for e in self.pool.entries}
        return Upstreams(self.settings, self.pool, clients)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

    def _close_with_the_loop(self) -> None:
        """Close the clients when the event loop shuts down: ``asyncio.run`` (the worker's, a
        test's) closes every async generator still open on its loop, and this one's ``finally``
        closes the clients, whose aiohttp sessions would otherwise warn at exit. The Functions
        runtime has no shutdown hook for an app."""

        async def closer() -> AsyncIterator[None]:
            try:
                yield
            finally:
                await self.close()

        self._closer = closer()
        self._closer_started = asyncio.ensure_future(anext(self._closer))

    # --- before any call ---------------------------------------------------------------------

    def model_names(self) -> tuple[str, ...] | None:
        """The models the entries list, when every entry lists its own; None: any model."""
        if not self.pooled or any(e.models is None for e in self.pool.entries):
            return None
        return tuple(dict.fromkeys(m for e in self.pool.entries for m in e.models or ()))

    def check_model(self, model: str) -> None:
        """400 for a model no entry serves, or one that cannot be an Azure deployment name."""
        if self.pooled and not self.pool.serves(model):
            raise ApiError(
                400, ErrorKind.MODEL_NOT_ALLOWED, f"model {model!r} is not served by any upstream here", "model"
            )
        for entry in self.pool.entries:
            deployment = entry.deployment(model)
            if entry.kind == "azure" and entry.serves(model) and not DEPLOYMENT_NAME.fullmatch(deployment):
                raise ApiError(
                    400,
                    ErrorKind.INVALID_REQUEST,
                    f"model {deployment!r} is not a valid Azure OpenAI deployment name",
                    "model",
                )

    def _unavailable(self, model: str) -> ApiError:
        """Every entry serving ``model`` is cooling down or out: answered without an upstream call."""
        blocked = self.pool.unavailable(model)
        headers = retry_after_headers(blocked.retry_after if blocked else 1.0)
        status, kind, message = 503, ErrorKind.UPSTREAM_UNAVAILABLE, "no upstream serving this model is available now"
        if blocked is not None and blocked.reason == "rate_limited":
            which = "every upstream" if self.pooled else "the upstream"
            status, kind, message = 429, ErrorKind.RATE_LIMITED, f"{which} serving this model is rate limited"
        return ApiError(status, kind, message + "; retry later", retryable=True, headers=headers)

    def _attempts(
        self, model: str, record: StreamRecord, way: _Way, candidates: list[Entry] | None = None
    ) -> Iterator[tuple[Entry, Attempt, bool]]:
        """(entry, attempt, is_last) for each candidate (default: the pool's, in its order) that can
        still take the request and that ``way`` allows; an entry again when ``way`` says so."""
        if self._closer is None:
            self._close_with_the_loop()
        if candidates is None:
            candidates = self.pool.candidates(model)
        if not candidates:
            raise self._unavailable(model)
        for i, entry in enumerate(candidates):
            while way.allows(entry) and (attempt := self.pool.acquire(entry, model)) is not None:
                record.attempting(entry.name, entry.deployment(model))
                telemetry.upstream_event("requests", entry.name)
                yield entry, attempt, i == len(candidates) - 1
                if not way.again:
                    break
                way.again = False

    async def _failed(
        self, attempt: Attempt, exc: Exception, record: StreamRecord, way: _Way, first: bool = True
    ) -> Classified:
        """A failed attempt, explained (``classify``: a bug of ours included) and reported. The request
        goes on (the failure returned) on the same entry once more (the same-entry policy, after
        waiting), or on the next candidate that ``pool.route`` allows; else the failure's error is
        raised. ``first``: the answer's first call, whose ``x-request-id`` the caller gets."""
        request_id = getattr(exc, "request_id", None)  # the SDK's: an error answer's x-request-id
        if first and isinstance(request_id, str) and request_id:
            record.request_id = request_id
        failure = classify(exc, attempt.model)
        attempt.report(failure.outcome)
        record.attempt_failed(attempt.entry.name, failure.error.type)
        route = self.pool.route(failure.outcome)
        if route == "stop":
            raise failure.error from None
        if len(self.pool.entries) > 1:
            if route == "larger":
                way.larger_than(attempt.entry)
            elif await self._again(attempt, failure.outcome, way):
                return failure
            telemetry.upstream_event("failovers", attempt.entry.name, reason=failure.outcome.kind.value)
            log.info(
                "upstream %s: %s before any output; the request moves on to the next free entry%s, if any",
                attempt.entry.name,
                failure.outcome.kind.value,
                " with a larger context_window" if route == "larger" else "",
            )
        return failure

    async def _again(self, attempt: Attempt, outcome: Outcome, way: _Way) -> bool:
        """The same-entry policy: after a 429 whose cooldown is at most
        UPSTREAM_RETRY_AFTER_WAIT_SECONDS, wait it out; after a 5xx answer, with
        UPSTREAM_RETRY_SERVER_ERROR, go again at once; once per entry and request, within the
        request's time (``way.deadline``). Whether to try the entry again."""
        name = attempt.entry.name
        if name in way.retried:
            return False
        if outcome.kind is OutcomeKind.RATE_LIMITED:
            wait = self.pool.wait(attempt.entry, attempt.model) or 0.0
            if wait > self.settings.upstream_retry_after_wait:
                return False
        elif outcome.kind is OutcomeKind.SERVER_ERROR and (outcome.status or 0) >= 500:
            if not self.settings.upstream_retry_server_error:
                return False
            wait = 0.0
        else:
            return False
        loop = asyncio.get_running_loop()
        if way.deadline is not None and loop.time() + wait >= way.deadline:
            return False
        way.retried.add(name)
        log.info("upstream %s: %s; trying it again in %.1fs", name, outcome.kind.value, wait)
        if wait > 0:
            await asyncio.sleep(wait + _TIMER_SLACK)  # a timer may fire early: the cooldown must be over
        way.again = True
        return True

    def _entry_deadline(self, limits: TimeLimits, last: bool) -> float | None:
        """When this entry's first output is due, if before the request's own first-token deadline."""
        per_entry = self.settings.entry_first_token_timeout
        if per_entry is None or last:
            return None
        at = limits.loop.time() + per_entry
        return at if at < limits.deadline else None

    # --- calls -------------------------------------------------------------------------------

    def open(
        self, path: str, params: dict, protocol: StreamProtocol, limits: TimeLimits, record: StreamRecord
    ) -> CoroutineType[Any, Any, UpstreamChunks]:
        """The first entry, in the pool's order, whose stream reaches its first output; else the
        last failure (or 429/503 with Retry-After when no entry could be tried). Awaited as a
        coroutine function's call (it is the walk's: one coroutine fewer waiting a request)."""
        return self._walk(path, params["model"], params, protocol, limits, record, None)

    async def open_next(
        self,
        path: str,
        model: str,
        request: Callable[[Entry], dict],
        protocol: StreamProtocol,
        limits: TimeLimits,
        record: StreamRecord,
        failed: Collection[str],
    ) -> PeekedStream:
        """The stream an answer goes on from after its upstream failed mid-answer (continuation.py):
        the walk of ``open`` with ``request(entry)`` as each entry's parameters, the entries that did
        not fail this answer (``failed``) first, then the others, each in the pool's order. When no
        entry is free now (cooling down, breaker open) it waits for the soonest one: the core bounds
        the whole of it by the limits."""
        while not (candidates := self.pool.candidates(model)):
            blocked = self.pool.unavailable(model)
            await asyncio.sleep(max(0.05, blocked.retry_after if blocked is not None else 1.0))
        ordered = [e for e in candidates if e.name not in failed] + [e for e in candidates if e.name in failed]
        return await self._walk(path, model, request, protocol, limits, record, ordered)

    async def _walk(
        self,
        path: str,
        model: str,
        request: dict | Callable[[Entry], dict],
        protocol: StreamProtocol,
        limits: TimeLimits,
        record: StreamRecord,
        candidates: list[Entry] | None,
    ) -> PeekedStream:
        """The walk itself. ``request``: the parameters for every entry, or how each entry's are
        made; ``candidates``: a continuation's order (None: the pool's, for the answer's first
        stream, whose ``x-request-id`` the caller gets; a continuation's stays on its segment)."""
        first = candidates is None
        way = _Way(limits.deadline)
        last: Classified | None = None
        for entry, attempt, is_last in self._attempts(model, record, way, candidates):
            stream = None
            try:
                deadline = self._entry_deadline(limits, is_last)
                params = request if isinstance(request, dict) else request(entry)
                async with _NO_LIMIT if deadline is None else asyncio.timeout_at(deadline):
                    stream = await UpstreamStream.open(
                        self.clients[entry.name], path, {**params, "model": entry.deployment(model)}
                    )
                    record.upstream_answered()
                    peeked = await _peek(stream, protocol.probe())
            except asyncio.CancelledError:
                # The request's own first-token limit (the core turns it into the error), or the
                # caller hung up (says nothing about the entry).
                if limits.loop.time() >= limits.deadline - _TIMER_SLACK:
                    attempt.report(TIMED_OUT)
                else:
                    attempt.release()
                await _close(stream)
                raise
            except Exception as exc:  # noqa: BLE001 - classify() explains any failure, a bug of ours included
                await _close(stream)
                last = await self._failed(attempt, exc, record, way, first)
                continue
            attempt.report(SUCCESS)
            if first:
                record.request_id = stream.request_id or record.request_id
            return PeekedStream(stream, peeked, attempt, model)
        raise last.error if last is not None else self._unavailable(model)

    async def reattach(self, name: str, path: str, query: dict, probe: StreamProtocol) -> PeekedStream:
        """The event stream of something only entry ``name`` holds (a background response), again,
        read up to its first output: on that entry whatever its health, since no other has it."""
        try:
            return await _reread(self.clients[name], path, query, probe)
        except Exception as exc:  # noqa: BLE001 - classify() explains any failure, a bug of ours included
            raise classify(exc).error from None

    async def complete(self, path: str, params: dict, record: StreamRecord) -> dict:
        """A non-streamed call: the first entry that answers it, in the pool's order."""
        model = params["model"]
        last: Classified | None = None
        way = _Way()
        for entry, attempt, _ in self._attempts(model, record, way):
            try:
                body, request_id = await complete(
                    self.clients[entry.name], path, {**params, "model": entry.deployment(model)}
                )
            except asyncio.CancelledError:
                attempt.release()
                record.cut_short()  # the caller left with the call in flight: the upstream has its prompt
                raise
            except Exception as exc:  # noqa: BLE001 - classify() explains any failure, a bug of ours included
                last = await self._failed(attempt, exc, record, way)
                continue
            attempt.report(SUCCESS)
            record.upstream_answered()
            record.request_id = request_id or record.request_id
            return body
        raise last.error if last is not None else self._unavailable(model)

    async def each(self, call: Callable[[SdkClient], Awaitable[T]], attempt_timeout: float) -> T:
        """``call`` on each entry in priority order, health aside, for something only the entry that
        made it knows (a stored response): a 404, 429, 5xx, a connection failure or ``attempt_timeout``
        moves on to the next. The answer is the first success; else a 404 when every entry said
        404, or the last other failure."""
        ordered = sorted(self.pool.entries, key=lambda e: e.priority)
        failure: Classified | None = None
        not_found: ApiError | None = None
        for entry in ordered:
            try:
                async with asyncio.timeout(attempt_timeout):
                    return await call(self.clients[entry.name])
            except Exception as exc:  # noqa: BLE001 - classify() explains any failure, a bug of ours included
                found = classify(exc)
                if isinstance(exc, openai.NotFoundError):  # not this entry's: the next one may hold it
                    not_found = ApiError(404, ErrorKind.NOT_FOUND, error_field(exc.body, "message") or "not found")
                elif found.outcome.failover or found.error.type == ErrorKind.UPSTREAM_TIMEOUT:
                    failure = found
                else:
                    raise found.error from None
        if failure is not None:
            raise failure.error
        if not_found is not None:
            raise not_found
        raise ApiError(503, ErrorKind.NOT_CONFIGURED, "no model upstream is configured")

    async def reopen(self, path: str, query: dict, protocol: StreamProtocol, attempt_timeout: float) -> UpstreamChunks:
        """The event stream of something one entry holds (a stored response), from the first entry
        that has it (``each``), read up to its first output."""
        return await self.each(lambda client: _reread(client, path, query, protocol.probe()), attempt_timeout)

    def state(self) -> dict:
        """What GET /api/_pool shows: never a key, only the name of the setting holding it."""
        return {"source": "UPSTREAMS" if self.pooled else "single", "upstreams": self.pool.state()}
