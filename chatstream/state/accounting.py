"""A caller's request, admitted and charged (``CALLER_KEYS=required``), in the state's own words
(port.py). What a request reserves and what it is charged, at which price: docs/callers.md.

- A request: ``authenticate``; ``admit`` reserves against every limit of the caller and of its team
  at once (counters.py: all or nothing); ``charge`` settles it, each segment of the answer one ledger
  row (an answer no upstream took writes no row and releases the reservation).
- A resumable stream: ``produces`` names it; taken over, the lost producer's part is charged by
  ``charge_lost`` (``charge_refused``: its continuation refused; ``regenerating``: still growing).
- What a request created: ``own``, ``owned``, ``forget``, ``keep_context``; ``charge_seen``
  charges a background response once its usage is read back.

Every charge is in the journal first, then the ledger, then the counters (journal.py): never lost,
never counted twice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .. import tokens
from ..errors import StoreError
from .callers import Caller, Team
from .counter_row import CounterKey, day_of
from .counters import Counters, Reservation, Want
from .instances import Instances
from .journal import Journal, JournalEntry, amounts
from .ledger import TAKEOVER, Charge, Ledger, Payer, raised
from .owners import Owned, Owners
from .port import (
    AdmissionRequest,
    KeyRefused,
    LimitRef,
    ModelRefused,
    Refused,
    Unavailable,
    Unknown,
    Unreadable,
    Usage,
    Used,
)
from .prices import Price, Prices
from .registry import Registry
from .store import key_part

log = logging.getLogger("chatstream")


@dataclass
class Admission:
    """What one admitted request holds: its caller, and its journal entry (who pays, the model, the
    counted prompt, the price, and its reservation of ``wants``)."""

    caller: Caller
    wants: list[Want]  # what it needs of every limit of its caller and team
    entry: JournalEntry
    started: float
    prices: Mapping[str, Price]  # every model's, as admitted: what its answer is charged at (``_charges``)
    created: tuple[str, str] | None = None  # (kind, id) of what the request created, once owned
    background: bool = False  # a background response: charged when its usage is seen (``charge_seen``)
    lost_raise: JournalEntry | None = None  # its last raise of a taken-over stream's lost part (``charge_lost``)


RAISED_WITHIN = 60.0  # a raise to what a caller received waits at most this long for a failing store
RETRY_SECONDS = 0.5  # ...trying again this often
LISTED_WITHIN = 2.0  # an admission waits at most this long for the journal write that lists it (journal.listed)
# A flush waits for the charges in flight (and a taker's raises) until this long before its end: the
# journal's and the counters' writes then have it (a drain's flush has 0.7 s: app.py).
FLUSH_KEEP = 0.3
# A resumable stream's n-th producer charges from ledger segment (n - 1) * this: more than an answer's
# segments on one producer (CONTINUE_MAX <= 10).
SEGMENTS_PER_PRODUCER = 20


def _wants(caller: Caller, team: Team | None, model: str, tokens_need: int, spend_need: int) -> list[Want]:
    """What a request needs of every limit of its caller and of its team (the one list of them):
    one request, ``tokens_need`` tokens, ``spend_need`` pico-USD; a charge's correction needs the
    differences of the same list."""
    wants: list[Want] = []
    for owner in (caller, team) if team is not None else (caller,):
        per_model = owner.model_limits.get(model)
        rpm, tpm = (per_model.requests_per_minute, per_model.tokens_per_minute) if per_model else (None, None)
        for row, kind, limit, need, period, named in (
            ("rpm", "requests_per_minute", owner.requests_per_minute, 1, "minute", None),
            ("tpm", "tokens_per_minute", owner.tokens_per_minute, tokens_need, "minute", None),
            ("tokens", "token_budget", owner.token_budget, tokens_need, owner.budget_period, None),
            ("spend", "spend_budget", owner.spend_budget, spend_need, owner.budget_period, None),
            (f"rpm@{key_part(model)}", "requests_per_minute", rpm, 1, "minute", model),
            (f"tpm@{key_part(model)}", "tokens_per_minute", tpm, tokens_need, "minute", model),
        ):
            if limit:
                ref = LimitRef(owner.SCOPE, owner.name, kind, named, None if period == "minute" else period)  # type: ignore[arg-type]
                wants.append(Want(CounterKey(owner.limits_partition, row), ref, limit, need))
    return wants


class Accounting:
    def __init__(
        self,
        registry: Registry,
        counters: Counters,
        journal: Journal,
        ledger: Ledger,
        owners: Owners,
        referenced_context: int,
        instances: Instances,
    ):
        self.instances = instances
        self.registry = registry
        self.counters = counters
        self.journal = journal
        self.ledger = ledger
        self.owners = owners
        self.referenced_context = referenced_context  # tokens a conversation / item_reference may carry
        self._background: set[asyncio.Task] = set()

    async def authenticate(self, key: str | None) -> Caller | KeyRefused | Unreadable | Unavailable:
        """The caller of a request's key (None: the request carried none)."""
        self.instances.serve()  # this instance takes its part in the duty from its first request
        return await self.registry.authenticate(key)

    async def admit(
        self, caller: Caller, asked: AdmissionRequest
    ) -> Admission | Refused | ModelRefused | Unavailable | Unknown | Unreadable:
        """The caller and its team may use the model, and every limit of theirs holds this request:
        reserved (module docstring)."""
        model = asked.model
        if not caller.allows(model):
            return ModelRefused(model)
        terms = await self.registry.terms(caller)  # (a store read only when a cached answer ran out)
        if isinstance(terms, Unavailable | Unreadable):
            return terms
        team, prices = terms
        if team is not None and not team.allows(model):
            return ModelRefused(model, scope="team")
        if isinstance(prices, Unavailable):
            return prices
        if model in prices.unreadable:
            return ModelRefused(model, unreadable=True)
        price = prices.get(model)
        if price is None and (caller.spend_budget or (team is not None and team.spend_budget)):
            return ModelRefused(model, unpriced=True, scope="caller" if caller.spend_budget else "team")
        found = await self._context(caller, asked)
        if isinstance(found, Unknown | Unavailable):
            return found
        known, estimated = found
        counted = asked.prompt_tokens + known  # what it carries for sure
        prompt = counted + estimated  # ...and what it may carry: reserved, charged only as reported
        output = asked.output_tokens
        spend = price.most(prompt, output) if price is not None else 0
        wants = _wants(caller, team, model, prompt + output, spend)
        started = self.counters.clock()  # the reservation's windows' time: its ledger day is theirs
        reserved = await self.counters.reserve(wants)
        if not isinstance(reserved, Reservation):
            return reserved
        payer = _payer(caller, team, asked.request_id, asked.endpoint, started)
        entry = JournalEntry(asked.request_id, payer, model, counted, reserved.needs, price, reservation=reserved)
        self.journal.open(entry)
        # Listed before the upstream is asked (journal.py): a death from here on is settled from there.
        try:
            await self.journal.listed(entry, LISTED_WITHIN)
        except BaseException:  # cancelled (its caller hung up): nothing is kept
            reserved.release()
            self.journal.drop(entry)
            raise
        return Admission(caller, wants, entry, started, prices)

    async def _context(self, caller: Caller, asked: AdmissionRequest) -> tuple[int, int] | Unknown | Unavailable:
        """The tokens a request carries by reference, (known, estimated): a previous response (the
        caller's own) its size, once known; a conversation or stored items ``referenced_context``.
        Both are reserved; a partial answer without the upstream's usage is charged the known part."""
        known = extra = 0
        if asked.previous:
            owned = await self.owned(caller, "response", asked.previous)
            if isinstance(owned, Unavailable):
                return owned
            if owned is None:
                return Unknown("response", asked.previous)
            if owned.context:
                known += owned.context
            else:
                extra += self.referenced_context
        if asked.references:
            extra += self.referenced_context
        return known, extra

    async def keep_context(self, admission: Admission, usage: Usage) -> None:
        """What the response ``admission`` created carries (its last segment, as reported) is kept in
        its owner row, for a continuation's reservation: before its caller has it (the endpoint)."""
        if admission.created is not None and usage.reported and usage.segments:
            try:
                await self.owners.set_context(*admission.created, usage.segments[-1].total)
            except StoreError as exc:  # a continuation then reserves the estimate
                log.warning("owners: %s %s: its size could not be kept: %s", *admission.created, exc)

    def produces(self, admission: Admission, stream_id: str, epoch: int = 1) -> None:
        """The request produces resumable stream ``stream_id`` (as its ``epoch``-th producer): a
        recovery charges it at least what that producer's part of the log holds (journal.py)."""
        admission.entry.stream, admission.entry.epoch = stream_id, epoch
        self.journal.changed()

    def write_checkpoints(self) -> None:
        """The journal is written now with every checkpoint (this instance is stopping)."""
        self.journal.urgent()

    def charge(self, admission: Admission, usage: Usage) -> int | None:
        """Settle the admission once the request is over (module docstring), in the background; what
        it costs (pico-USD; None: no price), for its log line, span and metrics."""
        charges = self._charges(admission, usage)
        self._spawn(self._charge(admission, usage, charges))
        costs = [c.cost for c in charges]
        return sum(c or 0 for c in costs) if any(c is not None for c in costs) else None

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """``work`` in the background: ``flush`` waits for it."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _charges(self, admission: Admission, usage: Usage) -> list[Charge]:
        """The answer's segments' charges: each at the price it was admitted (and reserved) at, as its
        log line says; a segment served under another name (an entry's ``deployments``) that had a
        price of its own when the request was admitted: at that price, under that name."""
        entry, author = admission.entry, self.counters.instance
        charges = []
        for i, u in enumerate(usage.segments):
            own = admission.prices.get(u.model) if u.model else None
            model, price = (u.model, own) if u.model and own is not None else (entry.model, entry.price)
            segment = entry.segment + i
            charges.append(Charge.made(entry.payer, model, u, price, usage.ended, author, segment, usage.upstream_id))
        return charges

    async def _charge(self, admission: Admission, usage: Usage, charges: list[Charge]) -> None:
        # A background response that goes on upstream (no usage yet), or that was charged already where
        # it was read back: held, and corrected when its usage is seen (charge_seen). Else charged now,
        # and never again.
        if admission.background and admission.created is not None:
            first = False
            if usage.reported:
                try:
                    first = await self.owners.first_charge(*admission.created)
                except StoreError as exc:  # not known: held, so that reading it back later charges it once
                    log.warning("owners: a background response's charge could not be marked: %s", exc)
            if not first:  # what it reserved is spent until its usage is seen; not in the ledger until then
                spent = {w.key: w.need for w in admission.wants}
                self.journal.settle(admission.entry, [], spent)
                return
        if not usage.segments:
            admission.entry.reservation.release()
            self.journal.drop(admission.entry)
            return
        spent = amounts([w.key for w in admission.wants], charges)
        self.journal.settle(admission.entry, charges, spent)

    async def charge_lost(
        self,
        admission: Admission,
        started: float | None,
        text: str,
        epoch: int = 2,
        before: str = "",
        patience: float = 0.0,
        floor: int = 0,
    ) -> None:
        """Charge the lost part of a resumable stream taken over here as its ``epoch``-th producer: at
        least ``text`` (what the log shows the lost producer generated after ``before``) and ``floor``
        tokens more (events its caller received, text unknown). Call it right after the admission, and
        again as ``text`` grows. The part's ledger row (none, a recovery's, or an earlier raise's) is
        raised to that (``ledger.raised``), what the raise adds counted as a correction (``_correct``).
        Never raises: for ``patience`` seconds a store failure is tried again, a raise waits for the
        previous one's row, and one whose row changed first is made again; after that, the dead
        instance's recovery charges the part at its checkpoint."""
        started = started or self.counters.clock()  # when the stream started (unknown: now)
        part = self._lost_part(admission, started, epoch, before)
        made = part.lost_charge(self.counters.instance, tokens.count_text(admission.entry.model, text) + floor)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + patience
        again = False
        while True:
            if admission.lost_raise is not None:  # the previous raise lands first: this one is made on it
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(give_up):  # (a failing store holds it too)
                        await admission.lost_raise.written.wait()
                if again and not admission.lost_raise.written.is_set():
                    return  # journaled: it lands, or counts nothing if the row changed first
            try:
                there = await self.ledger.find(made)
            except StoreError as exc:
                if loop.time() >= give_up:
                    log.warning("a taken-over stream's first part is left to its instance's takeover: %s", exc)
                    return
                await asyncio.sleep(RETRY_SECONDS)
                continue
            # A row the lost producer wrote itself (a hand-over) is counted by it; a row of the dead
            # instance's recovery (its journal's checkpoint) or of an earlier raise here is raised.
            if there is not None and not there.author.startswith(TAKEOVER) and there.author != made.author:
                return
            op = secrets.token_hex(6)
            charge, adds = raised(there, made, op)
            if charge is None:
                return
            spent = amounts([w.key for w in admission.wants], [adds])
            wants = [replace(w, need=spent[w.key]) for w in admission.wants]  # its limits, by what it adds
            admission.lost_raise = await self._correct(f"{made.request_id}/{op}", charge, wants, started)
            if loop.time() >= give_up:
                return
            again = True  # once its row is written: the row read again, raised again if it changed first

    def charge_refused(
        self,
        caller: Caller,
        asked: AdmissionRequest,
        started: float | None,
        text: str,
        epoch: int,
        before: str,
        floor: int,
    ) -> None:
        """A resumable stream taken over here whose continuation (``asked``) was refused at admission
        (a budget spent, the model no longer the caller's): its lost part is charged all the same,
        as ``charge_lost`` charges it (``text`` and ``floor``), holding nothing; in the background."""
        self._spawn(self._charge_refused(caller, asked, started or self.counters.clock(), text, epoch, before, floor))

    async def _charge_refused(
        self, caller: Caller, asked: AdmissionRequest, started: float, text: str, epoch: int, before: str, floor: int
    ) -> None:
        terms = await self.registry.terms(caller)
        team, prices = terms if isinstance(terms, tuple) else (None, terms)
        if isinstance(prices, Unavailable | Unreadable):
            log.warning("a taken-over stream's first part is left to its instance's recovery: team or prices not read")
            return
        payer = _payer(caller, team, asked.request_id, asked.endpoint, started)
        entry = JournalEntry(asked.request_id, payer, asked.model, asked.prompt_tokens, {}, prices.get(asked.model))
        wants = _wants(caller, team, asked.model, 0, 0)  # the limits its charge corrects
        admission = Admission(caller, wants, entry, started, prices)
        await self.charge_lost(admission, started, text, epoch, before, RAISED_WITHIN, floor)

    def _lost_part(self, admission: Admission, started: float, epoch: int, before: str) -> JournalEntry:
        """A taken-over stream's lost part: the first segment of its ``epoch - 1``-th producer's block,
        on the stream's day, its prompt with ``before``. Sets ``admission`` to charge from its own block."""
        entry, lost = admission.entry, (max(2, epoch) - 2) * SEGMENTS_PER_PRODUCER
        entry.segment = lost + SEGMENTS_PER_PRODUCER  # (the next block: this producer's)
        payer = replace(entry.payer, day=day_of(started))
        prompt = entry.prompt_tokens + (tokens.count_text(entry.model, before) if before else 0)
        needs = {w.key: 0 for w in admission.wants if w.period != "minute"}  # the rows a raise enters
        key = f"{payer.request_id}/lost{epoch}"
        return JournalEntry(key, payer, entry.model, prompt, needs, entry.price, segment=lost)

    def regenerating(
        self,
        admission: Admission,
        started: float | None,
        text: Callable[[], str],
        floor: Callable[[], int],
        epoch: int = 2,
        before: str = "",
    ) -> Callable[[float], asyncio.Task]:
        """What this taker knows its lost producer generated (``text()`` and ``floor()`` tokens more,
        growing), journaled as that part's checkpoint: if this instance dies before it raised the
        part's row to it, its recovery does. The function returned (given ``charge_lost``'s
        ``patience``) raises it to what is known then, in the background (a request cancelled
        meanwhile still makes it), and the knowledge leaves the journal and the budget rows."""
        started = started or self.counters.clock()  # read once: the part's day is one, whenever it is raised
        knows = self._lost_part(admission, started, epoch, before)
        knows.generated, knows.floor = lambda: {0: text()}, floor
        let_go = self.counters.keep(knows.needs)  # a takeover counts the raise where it has an entry
        self.journal.open(knows)

        async def raise_it(known: str, more: int, patience: float) -> None:
            await self.charge_lost(admission, started, known, epoch, before, patience, more)
            self.journal.drop(knows)
            let_go()

        def raise_now(patience: float) -> asyncio.Task:
            self.journal.urgent()  # what is known now, journaled at once: the raise may not land
            return self._spawn(raise_it(text(), floor(), patience))

        return raise_now

    async def _correct(self, key: str, charge: Charge, wants: list[Want], at: float) -> JournalEntry:
        """A charge made after its request was settled (a stream's lost part, a background response's
        usage seen): the budgets corrected by each want's need in the windows of ``at``, as the
        journal's settled entry ``key``, once this instance has its holding in each budget row."""
        adjusted = self.counters.adjust(wants, at)
        await adjusted.entered(LISTED_WITHIN)
        needs = {w.key: w.need for w in wants if w.period != "minute"}
        payer = Payer.of(charge.values())
        entry = JournalEntry(key, payer, charge.model, charge.prompt_tokens, needs, reservation=adjusted)
        self.journal.settle(self.journal.open(entry), [charge], needs)
        return entry

    async def own(self, kind: str, created: str, admission: Admission, background: bool) -> None:
        """What the request created is its caller's; a background response's reservation is kept,
        to be corrected when its usage is seen."""
        wants = admission.wants if background else []  # (a request charged when it ends keeps nothing)
        reserved = max((w.need for w in wants if w.key.row in ("tokens", "tpm")), default=0)
        spend = max((w.need for w in wants if w.key.row == "spend"), default=0)
        try:
            owned = Owned(
                admission.caller.id,
                reserved=reserved,
                reserved_spend=spend,
                reserved_at=admission.started,
                price=admission.entry.price if background else None,  # what it is charged at when its usage is seen
                charged=not background,  # charged by this request when it ends: reading it back adds nothing
            )
            await self.owners.own(kind, created, owned)
        except StoreError as exc:
            log.warning("owners: %s %s could not be claimed: %s", kind, created[:12], exc)
        admission.created, admission.background = (kind, created), background

    async def owned(self, caller: Caller, kind: str, id: str) -> Owned | Unavailable | None:
        """``kind``/``id``'s owner row if it is ``caller``'s, else None (follow-ups answer 404 to anyone else)."""
        try:
            owned = await self.owners.owned(kind, id)
        except StoreError:
            return Unavailable()
        return owned if owned is not None and owned.by(caller) else None

    async def forget(self, kind: str, id: str) -> None:
        try:
            await self.owners.forget(kind, id)
        except StoreError as exc:
            log.warning("owners: %s could not be forgotten: %s", kind, exc)

    async def charge_seen(self, caller: Caller, kind: str, id: str, model: str, used: Used, endpoint: str) -> None:
        """A stored response read back, over, that used ``used``: its size is kept, and if nobody
        charged it yet (a background response), it is charged now, corrected from what it reserved."""
        try:
            await self.owners.set_context(kind, id, used.total)
            if not await self.owners.first_charge(kind, id):
                return
            owned = await self.owners.owned(kind, id) or Owned(caller.id)  # (no row: nothing reserved)
        except StoreError as exc:
            log.warning("owners: a background response could not be charged now: %s", exc)
            return
        terms = await self.registry.terms(caller)
        team, prices = terms if isinstance(terms, tuple) else (None, None)  # not read: no team, no price
        price = owned.price  # admitted at (rows before it: as of now)
        if price is None and isinstance(prices, Prices):
            price = prices.get(model)
        started = owned.reserved_at or self.counters.clock()
        payer = _payer(caller, team, id, endpoint, started)
        charge = Charge.made(payer, model, used, price, "background", self.counters.instance)
        tokens_diff, spend_diff = used.total - owned.reserved, (charge.cost or 0) - owned.reserved_spend
        await self._correct(f"{id}/seen", charge, _wants(caller, team, model, tokens_diff, spend_diff), started)

    async def flush(self, within: float = 5.0) -> bool:
        """Wait for the charges in flight to be settled and written everywhere (tests, shutdown); the
        journal and the counters keep the last ``FLUSH_KEEP`` (a raise still waiting is journaled)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        waited = deadline - min(FLUSH_KEEP, within / 2)
        while self._background and loop.time() < waited:
            await asyncio.wait(list(self._background), timeout=max(0.0, waited - loop.time()))
        left = max(0.0, deadline - loop.time())
        ok = await self.journal.flush(left)
        return await self.counters.flush(max(0.1, deadline - loop.time())) and ok


def _payer(caller: Caller, team: Team | None, request_id: str, endpoint: str, started: float) -> Payer:
    named = {"team": team.name, "team_id": team.id} if team is not None else {}
    return Payer(
        caller=caller.name, caller_id=caller.id, **named, request_id=request_id, endpoint=endpoint, day=day_of(started)
    )
