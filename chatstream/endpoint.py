"""One endpoint over HTTP, the same for every API: read and check the request, run the pipeline's
before-steps, then either stream (through the stream core) or answer at once, and write the one log
line, the span and the after-steps when the request is over. What differs per API (its request
contract, its events, its errors) is the ``Api`` adapter (apis/).

Status rule: the response headers wait for the first output, or for the first heartbeat, whichever
comes first. Until then a failure is a real HTTP status with the API's JSON error body; after it,
the API's final error event. Once the headers are out without output, ``: keep-alive`` comments go
out every ``HEARTBEAT_SECONDS`` until the first output. A caller that hangs up at any point closes
the upstream.

An error status's headers (``x-should-retry``, ``Retry-After``): errors.as_status and
http.error_headers; every answer's ``x-request-id``: http.with_request_id."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response

from . import memory, telemetry, tokens
from .apis.completions import CompletionsApi
from .apis.refusals import admitted, authenticated, rate_headers
from .apis.usage import admission_request, request_usage
from .continuation import ChatContinuation, Known, turned_off
from .errors import ApiError, ClientGone, ErrorKind, StepFailed, as_status, internal_error, total_expired
from .http import NO_STORE, EventStreamResponse, JsonAnswer, read_json
from .lifecycle import Lifecycle, Stream
from .pipeline import CallRequest, Pipeline
from .record import StreamRecord
from .resumable import Resumable, Route
from .settings import Settings
from .sse import KEEP_ALIVE
from .state.accounting import RAISED_WITHIN, Accounting, Admission
from .state.callers import Caller
from .state.registry import Registry
from .state.streamlog.format import started_at
from .state.streamlog.takeover import Claim
from .stream import Continuation, Ends, Event, Failed, StreamProtocol, TimeLimits, encoded, relay
from .upstreams.failover import Upstreams

log = logging.getLogger("chatstream")
T = TypeVar("T")

# Errors that mean the upstream did not take the model: the name must not become a metric dimension.
_MODEL_REFUSED = frozenset({ErrorKind.MODEL_NOT_FOUND, ErrorKind.INVALID_REQUEST})


class Api(Protocol):
    """What an API adapter provides (apis/chat.py, apis/openai_chat.py, apis/responses.py)."""

    name: str

    @property
    def owns(self) -> str | None: ...  # what a call creates that belongs to its caller (``response``), if any

    path: str  # the upstream path it calls: /chat/completions, /responses
    completes: bool  # it has a non-streamed form

    def parse(self, data: object, default_model: str) -> CallRequest: ...
    def protocol(self, call: CallRequest, pipeline: Pipeline, keep: bool) -> StreamProtocol: ...
    def encoder(self, call: CallRequest) -> Callable[[Event], bytes | None]: ...
    def error_response(self, error: ApiError) -> Response: ...
    async def completion(self, body: dict, pipeline: Pipeline, record: StreamRecord) -> dict: ...
    def continuation(
        self, call: CallRequest, upstreams: Upstreams, protocol: StreamProtocol, record: StreamRecord, most: int
    ) -> Continuation | None: ...  # how a streamed answer goes on after its upstream failed mid-answer


async def _close_events(first: asyncio.Future, events: AsyncGenerator[Event]) -> None:
    """Stop waiting for the first event and close the event stream (the upstream with it); safe to
    call more than once. Shielded (it runs on the way out of a cancelled task), unless both are over
    already: the response's close after its body closed them costs no shield (~4 µs a stream)."""
    # getasyncgenstate: Python 3.12+ (the app runs on 3.13; pyright checks as 3.11, for the client)
    if first.done() and inspect.getasyncgenstate(events) == inspect.AGEN_CLOSED:  # pyright: ignore[reportAttributeAccessIssue]
        return
    with anyio.CancelScope(shield=True):
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        await events.aclose()


_NO_CONTEXT = contextvars.Context()  # for callbacks that read no context variable (first_done)


class _Wake:
    """``first_done``'s waker: ends the wait, once (one object, where a closure would be three)."""

    __slots__ = ("_waiter",)

    def __init__(self, waiter: asyncio.Future) -> None:
        self._waiter = waiter

    def __call__(self, _: object = None) -> None:
        if not self._waiter.done():
            self._waiter.set_result(None)


async def first_done(a: asyncio.Future, b: asyncio.Future, limit: float) -> None:
    """Returns when ``a`` or ``b`` is done, or after ``limit`` seconds: ``asyncio.wait`` with
    ``FIRST_COMPLETED`` for two, for less. Its waker reads no context variable, so its callbacks and
    timer run in one empty context instead of a copy each; no sets, no closure over the wait's own
    state. A request waiting for its first event holds 9 objects fewer for the garbage collector to
    walk (and ~2 µs less work): under a burst every collection walks every waiting request's."""
    if a.done() or b.done():
        return
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    wake = _Wake(waiter)
    a.add_done_callback(wake, context=_NO_CONTEXT)
    b.add_done_callback(wake, context=_NO_CONTEXT)
    timer = loop.call_later(limit, wake, context=_NO_CONTEXT)
    try:
        await waiter
    finally:
        timer.cancel()
        a.remove_done_callback(wake)
        b.remove_done_callback(wake)


async def wait_disconnect(request: Request) -> None:
    """Returns when the caller hangs up. The body must have been read: the next ASGI message can
    then only be the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(
    request: Request, work: Awaitable[T], limit: float, expired: Callable[[], ApiError] = total_expired
) -> T:
    """``work``'s result, or ``ClientGone`` if the caller hangs up first, or ``expired()`` at ``limit``."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await first_done(task, gone, limit)
    except BaseException:  # cancelled itself: the work stops with it, not left running on its own
        task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, return_exceptions=True)
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone() if gone.done() and not gone.cancelled() else expired()


class Endpoint:
    def __init__(
        self,
        api: Api,
        settings: Settings,
        upstreams: Upstreams,
        pipeline: Pipeline,
        accounting: Accounting | None,
        resumable: Resumable | None = None,
        lifecycle: Lifecycle | None = None,  # (none: one never drained)
        registry: Registry | None = None,
    ):
        self.api = api
        self.settings = settings
        self.upstreams = upstreams
        self.pipeline = pipeline
        self.accounting = accounting  # CALLER_KEYS=required: callers' keys, limits and charges
        self.resumable = resumable  # RESUMABLE_STREAMS=on: streams outlive their caller's connection
        # The drain on SIGTERM: no new stream, the running ones ended in time.
        self.lifecycle = lifecycle or Lifecycle(settings.drain_seconds, signals=False)
        self.registry = registry  # with accounting: a taken-over stream's caller, by its id
        self.default_model = settings.default_model
        self.allowed = frozenset(settings.allowed_models)

    async def __call__(self, request: Request) -> Response:
        with self.lifecycle.starting():  # a drain beginning now waits for its stream
            record = StreamRecord(endpoint=self.api.name, model=self.default_model)
            record.request_id = record.id  # until the upstream says its own
            telemetry.begin(record)
            ending = _Ending(self, record)
            try:
                self.lifecycle.admit()  # while draining: 503 instance_draining, before any other work
                caller = await authenticated(self.accounting, request.headers) if self.accounting else None
                call = await self._prepare(request, record)
                if caller is not None and self.accounting is not None:  # CALLER_KEYS=required
                    record.caller, record.caller_id, record.team = caller.name, caller.id, caller.team
                    # Stopped if the caller hangs up while a slow store holds it (what it reserved comes back).
                    ending.admission = await unless_gone(
                        request,
                        admitted(self.accounting, caller, call, record, self.settings.default_max_output_tokens),
                        self.settings.total_timeout,
                    )
                if call.params.get("stream"):
                    return await self._stream(request, call, ending)
                return await self._complete(request, call, ending)
            except ClientGone:
                record.hung_up(499)  # nginx's "client closed request"
                ending.finish()
                return Response(status_code=499)
            except ApiError as error:
                return ending.refuse(error)
            except Exception:  # a bug of ours: still a JSON answer, a log line, an ended span
                log.exception("request failed before the stream (endpoint=%s)", record.endpoint)
                return ending.refuse(internal_error())
            except BaseException:  # cancelled: nobody gets an answer; what was admitted is settled (once: finish)
                record.hung_up(499)
                ending.finish()
                raise

    async def _prepare(self, request: Request, record: StreamRecord) -> CallRequest:
        """The request, read, checked and through the before-steps; or an ApiError."""
        call = self.api.parse(await read_json(request, self.settings.max_body_bytes), self.default_model)
        record.chose_model(call.params["model"], False)
        if not self.upstreams.configured:
            raise ApiError(
                503,
                ErrorKind.NOT_CONFIGURED,
                "no model upstream is configured: set UPSTREAMS, "
                "OPENAI_API_KEY, OPENAI_BASE_URL or AZURE_OPENAI_ENDPOINT",
            )
        if self.pipeline.has_before:
            await self.pipeline.run_before(call)
        model = call.params.get("model")
        if not isinstance(model, str) or not model:
            raise StepFailed("before", "a before-step left the request without a model name")
        if self.allowed and model not in self.allowed:  # after the before-steps: they may choose the model
            raise ApiError(
                400,
                ErrorKind.MODEL_NOT_ALLOWED,
                f"model {model!r} is not allowed here; use one of: {', '.join(sorted(self.allowed))}",
                "model",
            )
        self.upstreams.check_model(model)  # a model no upstream serves: 400, no upstream call
        call.params = tokens.single_cap(call.params)  # one validated output cap: what is reserved is what is sent
        if not call.params.get("stream") and not self.api.completes:
            raise StepFailed("before", f"a before-step turned streaming off, which /api/{self.api.name} cannot do")
        # A bounded set of names may become metric dimensions at once; any other only once the
        # upstream has served it (its first output, or its completion): see telemetry.py.
        record.chose_model(model, bool(self.allowed) or model == self.default_model)
        return call

    async def _complete(self, request: Request, call: CallRequest, ending: _Ending) -> Response:
        """A non-streamed answer: the upstream's JSON, its texts through the pipeline's text steps."""
        record, admission = ending.record, ending.admission
        give_up_at = asyncio.get_running_loop().time() + self.settings.total_timeout
        work = self.upstreams.complete(self.api.path, call.params, record)
        body = await unless_gone(request, work, self.settings.total_timeout)
        record.model_accepted = True  # the upstream served it
        if self.pipeline.wants_result:
            record.texts = {}
        body = await self.api.completion(body, self.pipeline, record)
        if admission is not None and isinstance(body.get("id"), str):
            await self._own(admission, body["id"], call)
            await ending.keep_context()
        ending.finish()
        return JsonAnswer(body, give_up_at, headers={**NO_STORE, **ending.headers()})

    async def _stream(self, request: Request, call: CallRequest, ending: _Ending) -> Response:
        record, admission = ending.record, ending.admission
        limits = TimeLimits(self.settings)
        protocol = self.api.protocol(call, self.pipeline, self.pipeline.wants_result or admission is not None)
        ending.protocol = protocol
        if admission is not None:
            # What it has generated so far: the journal's checkpoints (what a takeover charges if we die).
            admission.entry.generated = ending.generated
        continuation = self.api.continuation(call, self.upstreams, protocol, record, self._continuations(request))
        # Without an admission there is no context to keep before the final event.
        before_last = ending.keep_context if admission is not None else None
        # The drain (lifecycle.py) may cut the stream, and hold the last one's final event.
        ends = Stream(self.lifecycle, record, limits, ending.finish, before_last)
        events = relay(self.upstreams, self.api.path, call.params, protocol, limits, record, ends, continuation)
        encode = self.api.encoder(call)
        headers = ending.headers()
        respond = self._resumable(call, limits, headers, ending)
        response = await stream_response(
            request,
            events,
            encode,
            limits,
            record,
            self.settings.heartbeat,
            ending.error_response,
            headers,
            respond,
        )
        if admission is not None and protocol.id:  # the id came with the first events
            try:
                await self._own(admission, protocol.id, call)
            except BaseException:  # cancelled: this answer never goes out; its events end here (and charge)
                if isinstance(response, EventStreamResponse):
                    await response.close()
                raise
        return response

    def _continuations(self, request: Request) -> int:
        """How often a streamed answer may go on on another stream after its upstream failed mid-answer."""
        if not self.settings.continue_on_upstream_failure or turned_off(request.headers):
            return 0
        return self.settings.continue_max

    def _resumable(
        self, call: CallRequest, limits: TimeLimits, headers: dict[str, str], ending: _Ending
    ) -> Callable[[asyncio.Future, AsyncGenerator[Event]], Response | None] | None:
        """With RESUMABLE_STREAMS=on, how a streamed /api/chat or chat-completions answer is made once its
        first event is in hand: produced by a task of its own, resumable (resumable.py)."""
        resumable, record, admission, protocol = self.resumable, ending.record, ending.admission, ending.protocol
        assert protocol is not None
        if resumable is None or self.api.name not in ("chat", "openai"):
            return None
        route: Route = "chat" if self.api.name == "chat" else "openai"

        def answer(first: asyncio.Future, events: AsyncGenerator[Event]) -> Response | None:
            producer = resumable.start(route, record, {"params": call.params, "include_usage": call.include_usage})
            if producer is None:
                return None  # this instance is full: streamed as usual
            call.stream_id = record.stream_id = producer.id
            if self.accounting is not None and admission is not None:  # a recovery charges what its log holds
                self.accounting.produces(admission, producer.id)
            encode = self.api.encoder(call)  # now with the stream's id (/api/chat's final event names it)
            return resumable.respond(producer, first, events, encode, protocol, limits, record, headers)

        return answer

    async def take_over(self, claim: Claim) -> None:
        """A resumable stream of this route whose producer was lost (its instance died, or handed
        it over on SIGTERM): the answer goes on here, after what its log holds, on
        ``claim.producer``; every reader, on any instance, follows the log (docs/resumable.md).

        The request is the one the lost producer sent (stored with the stream); the text so far is
        what the log shows the caller got; the continuation is opened as one of an upstream failure
        mid-answer (continuation.py: the seam drops a repeat). With caller keys the stream's caller
        is charged the lost part at what the log shows (segment 0), raised at the end to what the
        reader that asked for the takeover had received (``_charge_received``), and the
        continuation at its usage; a limit that refuses the continuation ends the stream with that
        refusal, the lost part charged all the same (``Accounting.charge_refused``)."""
        stored = claim.request
        call = CallRequest(
            params=stored["params"], endpoint=self.api.name, include_usage=bool(stored.get("include_usage"))
        )
        call.stream_id = claim.producer.id
        record = StreamRecord(endpoint=self.api.name, model=call.params.get("model") or self.default_model)
        record.id = record.request_id = claim.request_id or record.id
        record.stream_id = claim.producer.id
        record.chose_model(record.model, True)
        telemetry.begin(record)
        encode = self.api.encoder(call)
        protocol = self.api.protocol(call, self.pipeline, True)
        known = self.api.known(claim.events) if isinstance(self.api, CompletionsApi) else Known("")
        ending = _Ending(self, record, protocol)
        ends = Ends(ending.finish)
        try:
            if known.blocked is not None:
                raise ApiError(
                    502, ErrorKind.STREAM_LOST, f"the answer's {known.blocked} cannot be continued", retryable=True
                )
            if self.accounting is not None and claim.producer.owner is not None:
                admission = ending.admission = await self._admit_taken_over(claim, call, record, known)
                admission.entry.generated = ending.generated
                self.accounting.produces(admission, claim.producer.id, claim.producer.epoch)
            lost = ApiError(502, ErrorKind.STREAM_LOST, "the instance producing the stream was lost", retryable=True)
            plan = ChatContinuation.resuming(
                self.upstreams, self.api.path, call.params, protocol, record, self.settings.continue_max, known, lost
            )
            limits = TimeLimits(self.settings)
            events = relay(plan, self.api.path, call.params, protocol, limits, record, ends, plan)
        except ApiError as error:
            events = _failed(error, record, ends)
        assert self.resumable is not None
        raising: asyncio.Task | None = None
        over = asyncio.Event()  # the continuation ended (short, perhaps: then the raise is made with what it has)
        if ending.admission is not None and claim.producer.stand_in_to:
            raising = asyncio.ensure_future(self._charge_received(claim, known, ending.admission, over))
            self.lifecycle.keep(raising)  # a drain waits for it (nobody else can make it)
        try:
            await self.resumable.produce(claim.producer, events, encode, protocol, record)
        finally:
            over.set()
        if raising is not None:
            await raising

    async def _admit_taken_over(self, claim: Claim, call: CallRequest, record: StreamRecord, known: Known) -> Admission:
        """The taken-over stream's caller, admitted for the continuation; the lost part charged at
        what the log holds of it, admitted or refused (a budget spent, the model)."""
        assert self.accounting is not None and self.registry is not None and claim.producer.owner is not None
        caller = await self.registry.caller_by_id(claim.producer.owner)
        if not isinstance(caller, Caller):
            raise ApiError(502, ErrorKind.STREAM_LOST, "the stream's caller is gone", retryable=False)
        record.caller, record.caller_id, record.team = caller.name, caller.id, caller.team
        default_max = self.settings.default_max_output_tokens
        lost, before = self._lost(claim, known)
        started, epoch = started_at(claim.producer.id), claim.producer.epoch
        try:
            admission = await admitted(self.accounting, caller, call, record, default_max)
        except ApiError:
            asked = admission_request(call, record, default_max)
            floor = self._unknown(claim)[1]  # nothing stands in for what its caller had past the stored end
            self.accounting.charge_refused(caller, asked, started, lost.text, epoch, before, floor)
            raise
        await self.accounting.charge_lost(admission, started, lost.text, epoch, before)
        return admission

    def _lost(self, claim: Claim, known: Known) -> tuple[Known, str]:
        """What the log holds of the lost producer's part, and of the earlier producers' before it."""
        lost = self.api.known(claim.lost_events) if isinstance(self.api, CompletionsApi) else known
        return lost, known.text[: len(known.text) - len(lost.text)] if known.text.endswith(lost.text) else ""

    def _unknown(self, claim: Claim) -> tuple[int, int]:
        """Of the events the reader that asked for the takeover held past the stored end, how many
        the continuation has not stood in for yet, and the tokens they are known to hold at least.

        That bound is known on /api/chat only: it writes no event for an empty delta, so each is at
        least one generated token. Chat completions forward the upstream's chunks as they came, and
        some carry no token (the role chunk, Azure's content-filter chunks with an empty delta, the
        empty deltas of OpenAI-compatible servers): none is known to hold any."""
        unknown = claim.unstood()
        return unknown, unknown if self.api.name == "chat" else 0

    async def _charge_received(self, claim: Claim, known: Known, admission: Admission, over: asyncio.Event) -> None:
        """When the reader that asked for the takeover had ids past the stored end, the lost producer
        gave its client those events, unstored. The continuation's events of the same ids (which
        that reader skipped) stand for them: the lost part is charged with their text too (at least
        what its caller received), and each event not stood in for yet at its floor (``_unknown``),
        unless a charge of it is higher already; raised once the continuation has them all
        (``Claim.stood_in``), or with what it has when the continuation ended short (``over``), the
        drain's grace is over, or this is cancelled (the raise goes on: ``Accounting.regenerating``;
        waiting out a failing store, for nobody else knows that part).

        Until then this instance's journal holds what it knows of that part, as its checkpoint
        (``Accounting.regenerating``, written every half second): if this instance dies first, its
        recovery raises the part to it (chaos seed 2027: a taker killed before the raise left 10 of
        12 tokens charged). A drain (SIGTERM; ``Lifecycle.keep``) writes the journal at once and as
        the stand-ins come in: the host kills a worker with no request in flight ~0.5 s after it."""
        if not isinstance(self.api, CompletionsApi) or self.accounting is None:
            return
        api, life = self.api, self.lifecycle
        lost, before = self._lost(claim, known)

        def text() -> str:  # what the lost producer's part is known to hold
            return lost.text + api.known(claim.stand_ins()).text

        regenerated = self.accounting.regenerating(
            admission,
            started_at(claim.producer.id),
            text,
            lambda: self._unknown(claim)[1],
            claim.producer.epoch,
            before,
        )
        try:
            while claim.unstood() and not (over.is_set() or life.grace_over.is_set()):
                if life.draining.is_set():  # stopping: the journal says at once what is known, as it grows
                    self.accounting.write_checkpoints()
                    await _any(claim.producer.changed(), over.wait(), life.grace_over.wait())
                else:
                    await _any(claim.stood_in(), over.wait(), life.draining.wait())
        finally:  # however the wait ends (cancelled too: the request's end, a drain), raised with what is known
            unknown, floor = self._unknown(claim)
            stood_in = api.known(claim.stand_ins()).text
            raised = regenerated(RAISED_WITHIN if stood_in or floor else 0.0)
        await asyncio.shield(raised)  # (cancelled meanwhile: it goes on)
        if unknown:  # refused (a budget, the upstream), stopped, or the drain's grace over
            log.warning(
                "request %s (stream %s): of the %d event(s) its caller had past the stored end, %d not stood "
                "in for by the continuation: charged at %d token(s) (their floor)",
                admission.entry.payer.request_id,
                claim.producer.id,
                claim.past_stored,
                unknown,
                floor,
            )

    async def _own(self, admission: Admission, created: str, call: CallRequest) -> None:
        """What the caller created is the caller's: follow-ups answer 404 to anyone else."""
        if self.accounting is not None and self.api.owns is not None:
            await self.accounting.own(self.api.owns, created, admission, bool(call.params.get("background")))


class _Ending:
    """How one request ends, for every part that takes part in it: its record kept (the log line,
    the charge, the span, once: ``finish``), an error answered as the API does (``error_response``,
    ``refuse``), what a response it created carries kept before the caller has the answer
    (``keep_context``), and, once it streams (``protocol``), what it has generated so far
    (``generated``, for a keyed request's journal). One object, not a closure each: a closure and
    each variable it shares are objects the garbage collector walks while the request waits for its
    first event (six of them)."""

    __slots__ = ("admission", "endpoint", "protocol", "record")

    def __init__(self, endpoint: Endpoint, record: StreamRecord, protocol: StreamProtocol | None = None) -> None:
        self.endpoint = endpoint
        self.record = record
        self.protocol = protocol
        self.admission: Admission | None = None  # with caller keys, once admitted

    def finish(self) -> None:
        record, admission, protocol = self.record, self.admission, self.protocol
        if protocol is not None and protocol.released is not None:
            record.texts = protocol.released
        if not record.report():
            return
        accounting = self.endpoint.accounting
        if accounting is not None and admission is not None:
            generated = protocol.generated if protocol is not None else None
            used = request_usage(admission.entry.model, admission.entry.prompt_tokens, record, generated)
            record.cost = accounting.charge(admission, used)  # in the background: after the log line and the span
        log.info(record.log_line())
        telemetry.finish(record)
        if self.endpoint.pipeline.wants_result:
            self.endpoint.pipeline.run_after(record.result())

    def refuse(self, error: ApiError) -> Response:
        response = self.error_response(error)
        self.record.refused(response.status_code, error.type, model_refused=error.type in _MODEL_REFUSED)
        self.finish()
        return response

    def error_response(self, error: ApiError) -> Response:
        response = self.endpoint.api.error_response(as_status(error))
        response.headers.update(self.headers())
        return response

    def headers(self) -> dict[str, str]:
        """The headers every answer carries: its request id, and the caller's rate-limit headers."""
        rates = self.admission.entry.reservation.rates if self.admission is not None else {}
        return {"x-request-id": self.record.request_id, **rate_headers(rates)}

    async def keep_context(self) -> None:
        """What a response this request created carries is in its owner row before the caller has
        the answer: a continuation of it, sent at once to any instance, reserves that."""
        accounting, admission, record = self.endpoint.accounting, self.admission, self.record
        if accounting is not None and admission is not None and admission.created is not None and record.usage:
            await accounting.keep_context(
                admission, request_usage(admission.entry.model, admission.entry.prompt_tokens, record, None)
            )

    def generated(self) -> dict[int, str]:
        generated = self.protocol.generated if self.protocol is not None else None
        return {i: "".join(p) for i, p in (generated or {}).items()}


async def _any(*waits: Awaitable[object]) -> None:
    """Returns once one of ``waits`` is done (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _failed(error: ApiError, record: StreamRecord, ends: Ends) -> AsyncGenerator[Event]:
    """A stream of one final error event (a takeover that cannot go on), ``ends`` told as a relay
    tells them."""
    ends.begin()
    try:
        record.failed(error.type)
        final = Failed(error)
        await ends.last(final)
        yield final
    finally:
        ends.over()


async def stream_response(
    request: Request,
    events: AsyncGenerator[Event],
    encode: Callable[[Event], bytes | None],
    limits: TimeLimits,
    record: StreamRecord,
    heartbeat: float,
    error_response: Callable[[ApiError], Response],
    headers: dict[str, str],
    respond: Callable[[asyncio.Future, AsyncGenerator[Event]], Response | None] | None = None,
) -> Response:
    """The status rule over a stream of events: wait for the first event or the first heartbeat; a
    failure before then is ``error_response``, a caller gone meanwhile a 499; else the event stream,
    with keep-alives until the first output."""
    first = asyncio.ensure_future(anext(events))
    gone = asyncio.ensure_future(wait_disconnect(request))
    listened = False  # whether the event stream goes on listening with ``gone``
    try:
        try:
            await first_done(first, gone, heartbeat)
        except BaseException:  # cancelled itself: the upstream is closed, the record and charge written
            record.hung_up(499)
            await _close_events(first, events)
            raise
        if gone.done() and not gone.cancelled():  # the caller left while we waited for the first token
            record.hung_up(499)
            await _close_events(first, events)
            return Response(status_code=499)
        failed = first.result() if first.done() else None
        if isinstance(failed, Failed):
            error = failed.error
            response = error_response(error)
            record.refused(response.status_code, error.type, model_refused=error.type in _MODEL_REFUSED)
            await events.aclose()
            return response
        answer = respond(first, events) if respond is not None else None  # a resumable stream's answer
        if answer is not None:
            return answer
        listened = True
        return EventStreamResponse(
            _body(first, events, encode, heartbeat),
            limits.total_at,
            on_close=functools.partial(_close_events, first, events),  # no closure: cells while it waits
            headers={**headers, "x-request-id": record.request_id},  # the upstream's id, once it is known
            listener=gone,
            closed_by_body=True,  # _body closes the events as it ends
        )
    finally:
        if not listened:
            gone.cancel()


def _body(
    first: asyncio.Future, events: AsyncGenerator[Event], encode: Callable[[Event], bytes | None], heartbeat: float
) -> AsyncGenerator[bytes]:
    """The response's body: the events encoded (``encoded`` itself when the first event is in hand:
    a generator around it would cost every delta), after keep-alives while it is not. When it ends
    the events are closed at once (their record, the log line and the charge, is written then, not
    after the response's last write), and a big answer's memory goes back to the OS (memory.py)."""

    async def ended(written: int) -> None:
        await _close_events(first, events)
        memory.released(written)

    if first.done():
        return encoded(first.result(), events, encode, ended)
    return _after_keep_alives(first, events, encode, heartbeat, ended)


async def _after_keep_alives(
    first: asyncio.Future,
    events: AsyncGenerator[Event],
    encode: Callable[[Event], bytes | None],
    heartbeat: float,
    ended: Callable[[int], Awaitable[None]],
) -> AsyncGenerator[bytes]:
    try:
        yield KEEP_ALIVE  # the headers go out now; say so to proxies at once
        while not first.done():
            await asyncio.wait({first}, timeout=heartbeat)
            if not first.done():
                yield KEEP_ALIVE
        async with contextlib.aclosing(encoded(first.result(), events, encode, ended)) as body:
            async for data in body:
                yield data
    finally:
        await _close_events(first, events)
