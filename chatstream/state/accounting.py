"""A caller's request, admitted and charged (``CALLER_KEYS=required``, docs/callers.md): what the
endpoints call, in the state's own words (port.py)::

    found = await accounting.authenticate(key)                # Caller | KeyRefused | Unavailable
    admitted = await accounting.admit(caller, call, record)   # Admission | Refused | ModelRefused | ...
    accounting.charge(admitted, record, generated)            # when the request is over (background)

``admit`` checks the model against the caller's and its team's, reserves against every limit of
both (counters.py: all or nothing): one request; the prompt's tokens (counted with the model's
tokenizer), the context a ``previous_response_id`` carries, plus the output cap (``max_tokens``,
``max_completion_tokens`` or ``max_output_tokens``, one validated integer; ``DEFAULT_MAX_OUTPUT_TOKENS``,
added to the upstream request, when the caller named none) times ``n``; and, where a spend budget
applies, the most that may cost (prices.py). A model without a price cannot be used by a caller or
team with a spend budget; for everyone else it costs $0 and shows as unpriced.

``charge`` settles it, each segment of the answer (an answer continued on another upstream has
several) one ledger row:

- the upstream reported usage: exactly that usage (cached prompt tokens priced as such);
- the upstream took the request but the answer ended early (a hang-up, a time limit, an upstream
  failure mid-stream): the prompt as sent, counted (a continuation's: the text so far and the
  instruction to go on, ``Segment.prompt_tokens``), plus the tokens of the text actually generated
  (before the text steps: what the model produced, not what the caller was shown), every choice;
- a non-streamed call abandoned in flight (a hang-up, a time limit): its counted prompt (the
  upstream has read it);
- no upstream took it: nothing; the reservation is released and no ledger row is written.

Each at the requested model's price, under its name; a segment whose pool entry was sent another
model name (its ``deployments``) that has a price of its own: at that price, under that name.

The charge is in the journal first, then the ledger, then the counters (journal.py): never lost,
never counted twice, whatever the store or the instance does meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .. import tokens
from ..errors import ErrorKind, StoreError
from ..pipeline import CallRequest
from ..record import Segment, StreamRecord
from .callers import Caller, Limits, Team
from .counters import Counters, Reservation, Want
from .instances import Instances
from .journal import Journal, JournalEntry
from .ledger import Charge, Ledger, day_of, tokens_of
from .owners import Owners
from .port import KeyRefused, LimitRef, ModelRefused, Rate, Refused, Unavailable
from .prices import Price
from .registry import Registry

log = logging.getLogger("chatstream")

_OVER = frozenset({"completed", "incomplete", "failed", "cancelled"})  # a response's final statuses


@dataclass(frozen=True)
class Unknown:
    """What the request refers to is not the caller's (or not there): a ``previous_response_id``."""

    kind: str
    id: str


@dataclass
class Admission:
    """What one admitted request holds: its caller and team, its reservation and the counted prompt."""

    caller: Caller
    team: Team | None
    reservation: Reservation
    prompt_tokens: int  # counted: what a partial answer is charged as its prompt
    model: str
    price: Price | None
    entry: JournalEntry | None
    started: float
    created: tuple[str, str] | None = None  # (kind, id) of what the request created, once claimed
    background: bool = False  # a background response: charged when its usage is seen (``charge_seen``)
    wants: list[Want] = field(default_factory=list)
    segment_base: int = 0  # a stream taken over: its segments are a block of their own (``charge_lost``)

    @property
    def rates(self) -> dict[str, Rate]:
        """The per-minute limits for OpenAI's ``x-ratelimit-*`` headers (``tokens``, ``requests``)."""
        return self.reservation.rates


LISTED_WITHIN = 2.0  # an admission waits at most this long for the journal write that lists it (journal.listed)
SEGMENTS_PER_PRODUCER = 20  # more than an answer's segments on one producer (CONTINUE_MAX <= 10)


def segment_base(epoch: int) -> int:
    """The first ledger segment of a resumable stream's ``epoch``-th producer (1: the original)."""
    return (max(1, epoch) - 1) * SEGMENTS_PER_PRODUCER


def ended(record: StreamRecord) -> str:
    """How a request ended, for its ledger row. A hang-up and a time limit can race: whichever the
    request saw first is what it records (a caller gone before the limit fired is ``disconnected``)."""
    if record.disconnected:
        return "disconnected"
    if record.error in (ErrorKind.UPSTREAM_TIMEOUT, ErrorKind.TOTAL_TIMEOUT):
        return "timeout"
    if record.error == "cancelled" or record.finish_reason == "cancelled":
        return "cancelled"
    return "failed" if record.error else "completed"


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


def _served(admission: Admission, model: str | None) -> str | None:
    """The model name an upstream was sent, when it is not the requested one."""
    return model if model and model != admission.model else None


def usage_of(usage: Mapping | None) -> Used | None:
    """An upstream's usage (chat: prompt/completion_tokens, prompt_tokens_details.cached_tokens;
    Responses: input/output_tokens, input_tokens_details.cached_tokens); None when it has neither."""
    if not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if type(prompt) is not int or type(completion) is not int:
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    cached = cached if type(cached) is int and 0 <= cached <= prompt else 0
    return Used(prompt, cached, completion)


def _limit_wants(
    limits: Limits, scope: str, owner: str, partition: str, model: str, tokens_need: int, spend_need: int
) -> list[Want]:
    wants: list[Want] = []

    def want(row: str, kind: str, limit: int | None, need: int, period: str, model_name: str | None = None) -> None:
        if limit:
            ref = LimitRef(scope, owner, kind, model_name, None if period == "minute" else period)  # type: ignore[arg-type]
            wants.append(Want(partition, row, ref, limit, need, period))

    want("rpm", "requests_per_minute", limits.requests_per_minute, 1, "minute")
    want("tpm", "tokens_per_minute", limits.tokens_per_minute, tokens_need, "minute")
    want("tokens", "token_budget", limits.token_budget, tokens_need, limits.budget_period)
    want("spend", "spend_budget", limits.spend_budget, spend_need, limits.budget_period)
    per_model = limits.model_limits.get(model)
    if per_model is not None:
        from .store import key_part

        want(f"rpm@{key_part(model)}", "requests_per_minute", per_model.requests_per_minute, 1, "minute", model)
        want(f"tpm@{key_part(model)}", "tokens_per_minute", per_model.tokens_per_minute, tokens_need, "minute", model)
    return wants


class Accounting:
    def __init__(
        self,
        registry: Registry,
        counters: Counters,
        journal: Journal,
        ledger: Ledger,
        owners: Owners,
        default_max_output: int,
        referenced_context: int = 16_384,
        instances: Instances | None = None,
    ):
        self.instances = instances
        self.registry = registry
        self.counters = counters
        self.journal = journal
        self.ledger = ledger
        self.owners = owners
        self.default_max_output = default_max_output
        self.referenced_context = referenced_context  # tokens a conversation / item_reference may carry
        self._background: set[asyncio.Task] = set()

    async def authenticate(self, key: str | None) -> Caller | KeyRefused | Unavailable:
        """The caller of a request's key (None: the request carried none)."""
        if self.instances is not None:
            self.instances.serve()  # this instance takes its part in the duty from its first request
        return await self.registry.authenticate(key)

    async def admit(
        self, caller: Caller, call: CallRequest, record: StreamRecord, endpoint: str | None = None
    ) -> Admission | Refused | ModelRefused | Unavailable | Unknown:
        """The caller and its team may use the model, and every limit of theirs holds this request:
        reserved (module docstring). The output cap is added to ``call.params`` when the request
        named none."""
        model = call.params["model"]
        if not caller.allows(model):
            return ModelRefused(model)
        # The team and the price (each a store read only when its cached answer ran out).
        team, price = await self.registry.team_and_price(caller, model)
        if isinstance(team, Unavailable):
            return team
        if team is not None and not team.allows(model):
            return ModelRefused(model, scope="team")
        if isinstance(price, Unavailable):
            return price
        if price is None and (caller.spend_budget or (team is not None and team.spend_budget)):
            return ModelRefused(model, unpriced=True, scope="caller" if caller.spend_budget else "team")
        found = await self._context(caller, call.params)
        if isinstance(found, Unknown | Unavailable):
            return found
        known, estimated = found
        call.params = tokens.with_default_cap(call.params, self.default_max_output)
        counted = tokens.count_prompt(model, call.params) + known  # what it carries for sure
        prompt = counted + estimated  # ...and what it may carry: reserved, charged only as reported
        output = tokens.choices(call.params) * (tokens.output_cap(call.params) or self.default_max_output)
        spend = price.most(prompt, output) if price is not None else 0
        wants = _limit_wants(caller, "caller", caller.name, caller.limits_partition, model, prompt + output, spend)
        if team is not None:
            wants += _limit_wants(team, "team", team.name, team.limits_partition, model, prompt + output, spend)
        reserved = await self.counters.reserve(wants)
        if not isinstance(reserved, Reservation):
            return reserved
        started = self.counters.clock()
        entry = self.journal.open(
            JournalEntry(
                request_id=record.id,
                caller=caller.name,
                caller_id=caller.id,
                team=team.name if team is not None else None,
                team_id=team.id if team is not None else None,
                model=model,
                endpoint=endpoint or record.endpoint,
                day=day_of(started),
                prompt_tokens=counted,
                needs=reserved.needs,
                kinds={k: ("spend" if k.endswith("/spend") else "tokens") for k in reserved.needs},
                price=price,
            )
        )
        # Listed before the upstream is asked (journal.py): a death from here on is settled from there.
        await self.journal.listed(entry, LISTED_WITHIN)
        return Admission(caller, team, reserved, counted, model, price, entry, started, wants=wants)

    async def _context(self, caller: Caller, params: Mapping) -> tuple[int, int] | Unknown | Unavailable:
        """The tokens a Responses request carries by reference, (known, estimated): a
        ``previous_response_id`` must be the caller's own, and its size is known once it finished; a
        ``conversation`` or an ``item_reference``, or a previous response not finished yet, is
        estimated as ``referenced_context``. Both are reserved; an answer that ends early without
        the upstream's usage is charged the known part only."""
        known = extra = 0
        previous = params.get("previous_response_id")
        if isinstance(previous, str) and previous:
            try:
                owned = await self.owners.owned("response", previous)
            except StoreError:
                return Unavailable()
            if owned is None or not _mine(owned.caller_id, caller):
                return Unknown("response", previous)
            if owned.context:
                known += owned.context
            else:
                extra += self.referenced_context
        if params.get("conversation") or _references_items(params.get("input")):
            extra += self.referenced_context
        return known, extra

    def progress(self, admission: Admission, generated) -> None:
        """How the journal reads what the request has generated so far (its checkpoints)."""
        if admission.entry is not None:
            admission.entry.generated = generated

    def charge(
        self,
        admission: Admission | None,
        record: StreamRecord,
        generated: Mapping[int, Sequence[str]] | None,
        segments: Sequence[Segment] | None = None,
    ) -> None:
        """Settle the admission once the request is over (module docstring): in the background."""
        if admission is None:
            return
        segments = segments if segments is not None else (record.segments if record.continued else None)
        segments = segments if segments is not None else (record.segments if record.continued else None)
        task = asyncio.get_running_loop().create_task(self._charge(admission, record, generated, segments))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def cost_of(self, admission: Admission | None, record: StreamRecord, generated) -> int | None:
        """What the request costs at the price it was admitted with, or a served model's kept here
        (pico-USD; None: no price), for its log line, span and metrics, before the charge itself, at
        that same price, is written in the background (a price change applies to the requests
        admitted after it)."""
        if admission is None or admission.price is None:
            return None
        segments = record.segments if record.continued else None
        used = self._used(admission, record, generated, segments)
        if not used:
            return None
        price = admission.price
        at = [(self.registry.price_kept(u.model) if u.model else None) or price for u in used]
        return sum(p.cost(u.prompt, u.cached, u.completion) for p, u in zip(at, used, strict=True))

    def _used(
        self, admission: Admission, record: StreamRecord, generated: Mapping[int, Sequence[str]] | None, segments
    ) -> list[Used]:
        """What each segment of the answer used: its reported usage; else, when its upstream took it,
        its prompt as sent (a continuation's carries the text before it and the instruction to go on)
        and the tokens it generated."""
        model = admission.model
        if segments:
            used: list[Used] = []
            for segment in segments:
                reported = usage_of(segment.usage)
                served = _served(admission, segment.model)
                if reported is not None:
                    used.append(
                        Used(
                            reported.prompt,
                            reported.cached,
                            reported.completion,
                            segment.upstream,
                            segment.request_id,
                            served,
                        )
                    )
                elif segment.answered:
                    prompt = segment.prompt_tokens if segment.prompt_tokens is not None else admission.prompt_tokens
                    completion = tokens.count_text(model, segment.text)
                    used.append(Used(prompt, 0, completion, segment.upstream, segment.request_id, served))
            return used
        reported = usage_of(record.usage)
        served = _served(admission, record.upstream_model)
        if reported is not None:
            return [Used(reported.prompt, reported.cached, reported.completion, record.upstream, model=served)]
        if record.answered:
            completion = sum(tokens.count_text(model, "".join(parts)) for parts in (generated or {}).values())
            return [Used(admission.prompt_tokens, 0, completion, record.upstream, model=served)]
        if record.prompt_only:  # a non-streamed call abandoned in flight: the upstream has read the prompt
            return [Used(admission.prompt_tokens, 0, 0, record.upstream, model=served)]
        return []

    async def _charge(self, admission: Admission, record: StreamRecord, generated, segments) -> None:
        # A background response that goes on upstream (no usage yet), or that was charged already where
        # it was read back: held, and corrected when its usage is seen (charge_seen). Else charged now,
        # and never again.
        if (
            admission.background
            and admission.created is not None
            and (usage_of(record.usage) is None or not await self._first_charge(*admission.created))
        ):
            self._hold_for_background(admission)
            return
        used = self._used(admission, record, generated, segments)
        if not used:
            admission.reservation.release()
            if admission.entry is not None:
                self.journal.drop(admission.entry)
            return
        price = admission.price  # the price it was admitted (and reserved) at, as its log line says
        how = ended(record)
        # A segment served under a name with a price of its own is charged that price, under that name.
        served = await self._served_prices(used)
        at = [
            (u.model, served[u.model]) if u.model in served else (record.model or admission.model, price) for u in used
        ]
        charges = [
            Charge(
                caller=admission.caller.name,
                caller_id=admission.caller.id,
                team=admission.team.name if admission.team is not None else None,
                team_id=admission.team.id if admission.team is not None else None,
                model=model,
                endpoint=record.endpoint,
                request_id=record.id,
                segment=admission.segment_base + i,
                day=day_of(admission.started),
                upstream=u.upstream,
                upstream_id=u.request_id or record.request_id,
                prompt_tokens=u.prompt,
                cached_tokens=u.cached,
                completion_tokens=u.completion,
                cost=charged.cost(u.prompt, u.cached, u.completion) if charged is not None else None,
                ended=how,
                author=self.counters.instance,
            )
            for i, (u, (model, charged)) in enumerate(zip(used, at, strict=True))
        ]
        tokens_used = sum(u.total for u in used)
        cost = sum(c.cost or 0 for c in charges)
        spent = {w.key: (cost if w.row == "spend" else tokens_used) for w in admission.wants}
        record.cost = cost if any(p is not None for _, p in at) else None
        if admission.created is not None and usage_of(record.usage) is not None:
            with contextlib.suppress(StoreError):  # what continuing it will carry, for its reservation
                await self.owners.set_context(*admission.created, used[-1].total)
        settlement = admission.reservation.settle(spent)
        amounts = {f"{w.partition}/{w.row}": spent[w.key] for w in admission.wants if w.period != "minute"}
        if admission.entry is not None:
            self.journal.settle(admission.entry, charges, amounts, settlement)

    async def _served_prices(self, used: Sequence[Used]) -> dict[str, Price]:
        """The price of each model the answer was served as under another name than the requested
        one (an entry's ``deployments``), when that name has one of its own; the others are charged
        the requested model's."""
        out: dict[str, Price] = {}
        for model in {u.model for u in used if u.model}:
            price = await self.registry.price(model)
            if isinstance(price, Price):
                out[model] = price
        return out

    async def _first_charge(self, kind: str, id: str) -> bool:
        try:
            return await self.owners.first_charge(kind, id)
        except StoreError as exc:  # not known: held, so that reading it back later charges it once
            log.warning("owners: a background response's charge could not be marked: %s", exc)
            return False

    def _hold_for_background(self, admission: Admission) -> None:
        """A background response: what it reserved is spent until its usage is seen (conservative),
        then corrected (``charge_seen``). Not in the ledger until then."""
        spent = {w.key: w.need for w in admission.wants}
        settlement = admission.reservation.settle(spent)
        amounts = {f"{w.partition}/{w.row}": w.need for w in admission.wants if w.period != "minute"}
        if admission.entry is not None:
            self.journal.settle(admission.entry, [], amounts, settlement)

    async def charge_lost(
        self, admission: Admission, started: float, text: str, epoch: int = 2, before: str = ""
    ) -> None:
        """A resumable stream taken over here (its producer's instance died, or drained), as its
        ``epoch``-th producer: the lost producer's part of the answer (``text``: what the log shows it
        generated, after ``before``, the earlier producers' part) is charged as the first segment of
        that producer's block, unless the dead instance's takeover (journal.py) charged it first; the
        continuation here is charged from the first segment of its own block (``admission``). So
        however many times a stream is taken over, each producer's segments are rows of their own.
        Never raises: on a store failure the journal's takeover charges that part at its checkpoint.
        Call it right after the admission (before any await): the journal lists the block with it;
        again with a longer ``text`` (what its caller was found to have received): the row is raised
        to it, the difference counted."""
        admission.segment_base = segment_base(epoch)
        if admission.entry is not None:
            admission.entry.segment = admission.segment_base
        caller, team, price = admission.caller, admission.team, admission.price
        completion = tokens.count_text(admission.model, text)
        # A producer after a takeover sent the answer so far along with the prompt.
        prompt = admission.prompt_tokens + (tokens.count_text(admission.model, before) if before else 0)
        cost = price.cost(prompt, 0, completion) if price is not None else None
        charge = Charge(
            caller=caller.name,
            caller_id=caller.id,
            team=team.name if team is not None else None,
            team_id=team.id if team is not None else None,
            model=admission.model,
            endpoint=admission.entry.endpoint if admission.entry is not None else "",
            request_id=admission.entry.request_id if admission.entry is not None else "",
            day=day_of(started),
            prompt_tokens=prompt,
            completion_tokens=completion,
            cost=cost,
            ended="lost",
            author=self.counters.instance,
            segment=segment_base(epoch - 1),
        )
        try:
            there = await self.ledger.write_now(charge)
            # Charged already: by the dead instance's takeover at its journal's checkpoint (counted
            # there; raised here to what the log shows, and the difference counted), by this call
            # before (the same), or by the producer itself (a hand-over: it counted it).
            author = str(there.get("author") or "") if there is not None else ""
            raised = (
                there is not None
                and (author.startswith("takeover:") or author == charge.author)
                and await self.ledger.replace_below(charge, there, author=author)
            )
        except StoreError as exc:
            log.warning("a taken-over stream's first part is left to its instance's takeover: %s", exc)
            return
        spent, cost = prompt + completion, cost or 0
        if there is not None:
            if not raised:
                return
            spent -= tokens_of(there)
            cost -= int(there.get("cost") or 0)
        corrections = _limit_wants(caller, "caller", caller.name, caller.limits_partition, admission.model, spent, cost)
        if team is not None:
            corrections += _limit_wants(team, "team", team.name, team.limits_partition, admission.model, spent, cost)
        self.counters.adjust(corrections, started)

    async def claim(self, kind: str, created: str, admission: Admission, background: bool) -> None:
        """What the request created (``response`` ``created``) is its caller's. A background
        response's reservation is recorded, to be corrected when its usage is seen."""
        reserved = max((w.need for w in admission.wants if w.row in ("tokens", "tpm")), default=0) if background else 0
        spend = max((w.need for w in admission.wants if w.row == "spend"), default=0) if background else 0
        try:
            await self.owners.claim(
                kind,
                created,
                admission.caller.id,
                reserved,
                admission.started,
                reserved_spend=spend,
                charged=not background,  # charged by this request when it ends: reading it back adds nothing
                price=admission.price if background else None,  # what it is charged at when its usage is seen
            )
        except StoreError as exc:
            log.warning("owners: %s %s could not be claimed: %s", kind, created[:12], exc)
        admission.created, admission.background = (kind, created), background

    async def owned(self, caller: Caller, kind: str, id: str) -> bool | Unavailable:
        """Whether ``kind``/``id`` is ``caller``'s (follow-ups answer 404 to anyone else)."""
        try:
            owned = await self.owners.owned(kind, id)
        except StoreError:
            return Unavailable()
        return owned is not None and _mine(owned.caller_id, caller)

    async def forget(self, kind: str, id: str) -> None:
        try:
            await self.owners.forget(kind, id)
        except StoreError as exc:
            log.warning("owners: %s could not be forgotten: %s", kind, exc)

    async def charge_seen(self, caller: Caller, kind: str, id: str, body: Mapping, record: StreamRecord) -> None:
        """A stored response read back (a follow-up): when it is over and carries its usage, its size
        is kept (a continuation of it reserves that), and if nobody charged it yet (on any
        instance), it is charged now: a background response."""
        used = usage_of(body.get("usage")) if body.get("status") in _OVER else None
        if used is None:
            return
        try:
            await self.owners.set_context(kind, id, used.total)
            if not await self.owners.first_charge(kind, id):
                return
            owned = await self.owners.owned(kind, id)
        except StoreError as exc:
            log.warning("owners: a background response could not be charged now: %s", exc)
            return
        model = str(body.get("model") or "")
        team = await self.registry.team_of(caller)
        team = team if isinstance(team, Team) else None
        price = owned.price if owned is not None and owned.price is not None else await self.registry.price(model)
        price = price if isinstance(price, Price) else None  # admitted at (rows before it: as of now)
        cost = price.cost(used.prompt, used.cached, used.completion) if price is not None else None
        started = owned.reserved_at if owned is not None and owned.reserved_at else self.counters.clock()
        charge = Charge(
            caller=caller.name,
            caller_id=caller.id,
            team=team.name if team is not None else None,
            team_id=team.id if team is not None else None,
            model=model,
            endpoint=record.endpoint,
            request_id=id,
            day=day_of(started),
            prompt_tokens=used.prompt,
            cached_tokens=used.cached,
            completion_tokens=used.completion,
            cost=cost,
            ended="background",
            author=self.counters.instance,
        )
        self.ledger.submit([charge])
        tokens_diff = used.total - (owned.reserved if owned is not None else 0)
        spend_diff = (cost or 0) - (owned.reserved_spend if owned is not None else 0)
        corrections = _limit_wants(
            caller, "caller", caller.name, caller.limits_partition, model, tokens_diff, spend_diff
        )
        if team is not None:
            corrections += _limit_wants(team, "team", team.name, team.limits_partition, model, tokens_diff, spend_diff)
        self.counters.adjust(corrections, started)

    async def flush(self, within: float = 5.0) -> bool:
        """Wait for the charges in flight to be settled and written everywhere (tests, shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while self._background and loop.time() < deadline:
            await asyncio.wait(list(self._background), timeout=max(0.0, deadline - loop.time()))
        left = max(0.0, deadline - loop.time())
        ok = await self.journal.flush(left)
        ok = await self.ledger.drain(max(0.0, deadline - loop.time())) and ok
        return await self.counters.flush(max(0.1, deadline - loop.time())) and ok

    drain = flush


def _mine(owner: str, caller: Caller) -> bool:
    return owner == caller.id or owner == f"name:{caller.name}"  # rows claimed before ids by name


def _references_items(items: object) -> bool:
    return isinstance(items, list) and any(isinstance(i, Mapping) and i.get("type") == "item_reference" for i in items)
