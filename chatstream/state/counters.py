"""Limits that hold across every instance, under any burst, through timeouts and crashes
(docs/callers.md): requests and tokens per minute, token and spend budgets, of callers and teams,
overall and per model.

**The model.** A limit is one counter row per window (counter_row.py): ``taken``, what of the
window is out, equals what its instances hold (their holdings' ``held``) plus what was spent. An
instance holds a share so as to serve reservations without a store call (its ``Lease``: a local
balance), and changes the row by one kind of write only, an *exchange*: one ETag-conditional write
of its own holding and ``taken`` that takes from the row what waiting reservations need (granting
those that fit under the limit, in order: a large one does not block smaller ones behind it), gives
back what came back, and moves what was spent from held to spent (a budget's charges in order: the
holding's ``applied`` is the last in). ONE exchange per counter and instance is in flight; what comes
meanwhile waits for the next. A dead instance's holding in a budget row is taken out by its recovery
(journal.py); minute windows end.

**A lone request's spare.** A lone request takes one more request's worth for the next one, kept
``SPARE_SECONDS`` from the last request it served, so that requests at a steady pace need no
exchange before their upstream call. What every instance keeps idle together stays under
``SPARE_SHARE`` of the limit, however many instances there are.

**Every write is idempotent.** When an exchange's answer is lost, nothing is given back on a guess:
the next exchange learns from the row whether it landed, and until then the counter's reservations
answer "unavailable". So the row equals what the instances hold plus what was spent, whatever
pattern of timeouts the store has.

**What a recovery needs.** This instance's journal lists a budget counter before any of it is held
here (``WriteAhead``), and a charge enters a budget's row only once its ledger row is written
(``Reservation.confirm``), in the order charges were made; the holding stays while a charge is not in
yet, or while the journal knows a lost part (``Counters.keep``).

Admission is exact per window, refused on a fresh read; a spent charge may take a row past its
limit (the next request is refused); ``x-ratelimit-remaining-*`` is an estimate (docs/callers.md)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..errors import StoreError
from . import counter_row
from .counter_row import (
    MAX_ATTEMPTS,
    CounterKey,
    CounterRow,
    Holding,
    Period,
    newer,
    seconds_to_next_minute,
    window_of,
)
from .instances import Instances
from .port import LimitRef, Rate, Refused, Unavailable
from .store import CALL_TIMEOUT, Store

log = logging.getLogger("chatstream")

RESERVE_TIMEOUT = CALL_TIMEOUT  # a reservation that needs the store and hears nothing this long: unavailable
SLOW_TIMEOUT = 8.0  # ...but one whose exchange is answering slowly waits this long before giving up
SPARE_SECONDS = 3.0  # a lone request's spare outlives a pause of a few seconds between requests
SPARE_SHARE = 0.1


@dataclass(frozen=True)
class Want:
    """What a reservation needs of one counter (``key``): ``need`` of its ``limit`` in the current
    window of its limit's period."""

    key: CounterKey
    ref: LimitRef
    limit: int
    need: int

    @property
    def period(self) -> Period:
        return self.ref.period or "minute"  # (a per-minute limit names no period)


@dataclass
class _Written:
    """One exchange's write (``Lease.uncertain`` while its answer is lost)."""

    row: CounterRow  # what it writes (conditioned on its ETag: counter_row.write)
    delta: int  # what it takes of the row (negative: gives back)
    charges: list[_Staged]  # the charges it applies
    balance_out: int  # the balance it took out of the books while in flight (it keeps ``delta`` more)


@dataclass(eq=False)  # (one charge is in the books or not: ``in`` asks for this one)
class _Staged:
    lease: Lease
    seq: int
    amount: int
    confirmed: bool = False  # its ledger row is written: it may enter the row
    journal: int = 0  # the number of the journal a landed write listed it settled in (0: none yet)


@dataclass(eq=False)
class Part:
    """What a reservation asks of one counter: ``need`` of ``lease``. ``granted``: True once it holds
    it, in ``window`` from the books of ``generation`` (books dropped since then take nothing back);
    False when the limit leaves no room; cancelled when the store does not tell, or when the
    reservation gives up."""

    lease: Lease
    need: int
    granted: asyncio.Future[bool]
    window: str = ""
    generation: int = 0


class Lease:
    """One counter as this instance holds it (module docstring). Local books, in the counter's window:
    ``held == balance + sum(parts' needs) + sum(staged)``, where ``held`` is this instance's holding in
    the row as last written. A charge past the balance leaves it below 0: the next exchange takes the
    rest from the row."""

    def __init__(self, counters: Counters, key: CounterKey):
        self.counters = counters
        self.key = key
        self.limit = 0
        self.period: Period = "minute"
        self.window: str | None = None
        self.generation = 0  # moves on when the books are dropped (a new window, a recovery elsewhere)
        self.held = 0
        self.in_row = False  # this instance's holding is in the row, as last written here (gone: taken over)
        self.balance = 0
        self.staged: deque[_Staged] = deque()
        self.seq = 0  # the last charge's number
        self.applied = 0  # the last charge in the row
        self.exchange = 0
        self.kept = 0  # lost parts this instance's journal knows of (``Counters.keep``): the holding stays
        self.waiters: deque[Part] = deque()  # parts the next exchange answers
        self.flight: asyncio.Task | None = None
        self.retry: asyncio.TimerHandle | None = None
        self.backoff = 0.5
        self.spare = 0  # a lone request's spare (module docstring): what it may keep idle (0: none)...
        self.spare_ends: asyncio.TimerHandle | None = None  # ...until this ends it
        self.top_up = False  # a request served from the spare settled since: take that again
        self.uncertain: _Written | None = None
        self.seen = CounterRow()  # the row as this instance last read or wrote it
        self.known = False  # ...and whether that is still worth acting on

    # --- what reservations do ------------------------------------------------------------------

    def advance(self, window: str | None) -> None:
        """Move to ``window`` unless the lease is already there or later: what was held belonged to
        the window that ended (the row's next write starts the new one)."""
        if window is not None and self.window != window and not newer(self.window, window):
            self.window = window
            self._drop_books()

    def _drop_books(self, kept: Sequence[_Staged] = ()) -> None:
        """New books, with only the ``kept`` charges in them: the row pays what they take."""
        self.generation += 1
        self.held = 0
        self.staged = deque(kept)
        self.balance = -sum(staged.amount for staged in kept)
        self.in_row = False
        self.applied = 0

    def ask(self, need: int, window: str) -> Part:
        """Granted from the balance at once, or else by the next exchange."""
        self.advance(window)
        part = Part(self, need, asyncio.get_running_loop().create_future())
        if self.waiters or self.uncertain is not None or self._servable() < need:
            self.waiters.append(part)
            self.kick()
        else:
            if self.spare:
                self._keep_spare(self.spare)  # served from the spare: it is kept for the next request (a steady pace)
            self._grant(part)
        return part

    def _grant(self, part: Part) -> None:
        assert self.window is not None
        self.balance -= part.need  # to the part (``held`` counts it still)
        part.window, part.generation = self.window, self.generation
        part.granted.set_result(True)

    def give_back(self, part: Part) -> None:
        if part.need > 0 and part.generation == self.generation:  # (a new window is new books too)
            self.balance += part.need
            self.kick()

    def settle(self, part: Part, spent: Mapping[CounterKey, int]) -> _Staged | None:
        """``Reservation.settle`` of one part: the rest comes back, the spending is charged."""
        if part.window != self.window:
            return None  # a window that is over needs nothing
        self.give_back(part)  # (books dropped since, taken over elsewhere: the row pays all of the charge)
        if self.spare:
            self.top_up = True  # what it spent of the spare is taken again, after the request
        return self.charge(part.need if self.key.row.startswith("rpm") else max(0, int(spent.get(self.key, 0))))

    def charge(self, amount: int) -> _Staged | None:
        """``amount`` spent in the books' window (a correction: either sign), paid from the balance.
        A budget's charge is staged: it enters the row once confirmed (its ledger row written). A
        minute window is never taken over (it ends by itself): its charge leaves the books at once."""
        self.balance -= amount
        staged = None
        if self.period == "minute":
            self.held -= amount
        else:
            self.seq += 1
            staged = _Staged(self, self.seq, amount)
            self.staged.append(staged)
        self.kick()
        return staged

    def confirm(self, staged: _Staged, less: int) -> None:
        """``Reservation.confirm``: what ``less`` took of the books comes back to the balance."""
        less = min(less, staged.amount)
        if less > 0 and not staged.confirmed and staged in self.staged:
            staged.amount -= less
            self.balance += less
        staged.confirmed = True
        self.kick()

    def used(self) -> int:
        """What is out of the limit but this instance's balance: the row as last read or written, less
        the balance (below 0: charges the row has not had yet)."""
        return self.seen.taken_in(self.window) - self.balance

    def remaining(self) -> int:
        return max(0, self.limit - self.used())

    def _servable(self) -> int:
        """What the balance serves without a store call: all of it, but of a row seen past its limit
        (more was spent than reserved) only what the limit leaves: the next exchange decides."""
        return min(self.balance, self.remaining())

    def in_use(self) -> bool:
        """Whether this instance has books on the counter, or may hold some of it in the row without
        knowing it yet (a write for waiting reservations, one whose answer was lost)."""
        return any((self.held, self.balance, self.staged, self.waiters, self.uncertain, self.kept))

    def _keep_spare(self, spare: int) -> None:
        """Keep ``spare`` for ``SPARE_SECONDS`` from now; 0: the spare ends, and an exchange gives back
        what it kept."""
        if self.spare_ends is not None:
            self.spare_ends.cancel()
        self.spare = spare
        self.spare_ends = asyncio.get_running_loop().call_later(SPARE_SECONDS, self._keep_spare, 0) if spare else None
        if not spare:
            self.kick()

    # --- the single flight ------------------------------------------------------------------

    def kick(self) -> None:
        if self.flight is None and not self.counters.closed and self._has_work():
            self.flight = asyncio.ensure_future(self._run())

    def _pending(self) -> list[Part]:
        return [part for part in self.waiters if not part.granted.done()]

    def _confirmed(self) -> list[_Staged]:
        """The staged charges that may enter the row now: confirmed, in order (a charge waits for
        every earlier one, so ``applied`` is a prefix)."""
        return list(itertools.takewhile(lambda staged: staged.confirmed, self.staged))

    def _has_work(self) -> bool:
        return (
            self.uncertain is not None
            or (self.top_up and self.spare > 0)
            or bool(self._pending())
            or bool(self._confirmed())
            or not 0 <= self.balance <= self.spare  # below 0, a charge past the balance: the row pays
            or self._lingers()
        )

    def _lingers(self) -> bool:
        """Whether this instance's holding is in a budget row only for lost parts that let go since."""
        return self.in_row and self.period != "minute" and not (self.kept or self.held or self.staged)

    async def _run(self) -> None:
        try:
            while not self.counters.closed:
                if self.uncertain is None:  # what the balance holds is served first
                    fits = _fitting(self._pending(), self._servable())
                    self._answer(fits, fits)
                if not self._has_work():
                    return
                try:
                    await self._exchange()
                    self.backoff = 0.5
                except StoreError as exc:
                    self.known = False
                    self._fail()
                    if self.retry is None and self._has_work():
                        self.retry = asyncio.get_running_loop().call_later(self.backoff, self._retry)
                        self.backoff = min(self.backoff * 2, 30.0)
                    log.warning("limits: a %s counter exchange failed: %s", self.key.row, exc)
                    return
        except Exception:  # a bug of ours: the reservations waiting hear "unavailable", not nothing
            log.exception("limits: a %s counter exchange failed", self.key.row)
            self._fail()
        finally:
            self.flight = None

    def _fail(self) -> None:  # the store did not tell: the waiting reservations are unavailable
        for part in self.waiters:
            part.granted.cancel()
        self.waiters.clear()

    def _retry(self) -> None:
        self.retry = None
        self.kick()

    async def _exchange(self) -> None:
        """One exchange (module docstring): each attempt reads the row unless it is known, then
        writes; a conflict or a takeover tries again. A write whose answer was lost goes first: the
        row unchanged since its condition, it is sent again (at most one lands); else ``_landed``."""
        counters = self.counters
        self.advance(window_of(self.period, counters.clock()))
        top_up, self.top_up = self.top_up, False
        fresh = False
        for _ in range(MAX_ATTEMPTS):
            if not self.known:
                self.seen = await counter_row.read(counters.store, *self.key, SLOW_TIMEOUT)
                self.known = fresh = True
            seen = self.seen
            written, self.uncertain = self.uncertain, None
            if written is not None and seen.etag == written.row.etag:
                await self._send(written, again=True)
                continue
            if written is not None:
                self._follow(written, self._landed(written, seen))
            if seen.etag is not None and newer(seen.window, self.window):
                self.advance(seen.window)  # another instance's clock is a little ahead: follow it
            same = seen.counts_in(self.window)
            taken = seen.taken if same else 0
            holds = dict(seen.holds) if same else {}
            if self.in_row and counters.instance not in holds and same:
                await self._taken_over()
                continue
            window = self.window  # (the window ``taken`` and ``holds`` are of, whatever the awaits below)
            waiters = self._pending()
            if self.period != "minute" and self.held == 0 and (waiters or self.staged) and counters.journal is not None:
                # A budget's first capacity (or charge) here: the journal lists the counter before the
                # row has our holding, so a takeover of this instance finds it.
                await counters.journal.list_counter(self.key, self.in_use)
                waiters = self._pending()
            room = self.limit - taken + self.balance  # a row in debt: the balance pays it first
            chosen = _fitting(waiters, room)
            total = sum(waiter.need for waiter in chosen)
            if len(chosen) < len(waiters) and not fresh:
                self.known = False  # refuse only on what the store says now
                continue
            # The spare (module docstring): what this instance keeps unassigned after the exchange.
            idle = sum(e.idle for name, e in holds.items() if name != counters.instance)
            spare_room = max(0, int(self.limit * SPARE_SHARE) - idle)
            lone = self.period == "minute" and len(waiters) == 1 and bool(chosen)
            if lone:  # it takes one more for the next request, as far as the limit leaves
                keep = spare = max(0, min(total, spare_room, room - total))
            else:  # while it has a spare, at most that stays idle here; after a request it served, that again
                spare = 0 if waiters else self.spare
                keep = max(0, min(self.balance, spare), min(spare, spare_room, room) if top_up else 0)
            delta = total + keep - self.balance  # a balance below 0 (charged past it): the row pays
            entering = self._confirmed()
            spent = sum(staged.amount for staged in entering)
            if delta == 0 and not entering and not chosen and not self._lingers():
                self._answer(waiters, chosen)
                return
            self.exchange += 1  # this write's number, in the holding (the same if it is sent again)
            held = self.held + delta - spent
            kept = self.kept and counters.instance in holds  # a lost part's raise may enter here (``kept``)
            if held > 0 or len(self.staged) > len(entering) or kept:  # a charge not in yet: the holding stays
                holds[counters.instance] = Holding(
                    held, entering[-1].seq if entering else self.applied, self.exchange, keep
                )
            else:
                holds.pop(counters.instance, None)  # nothing held here: nothing to take over
            row = replace(seen, window=window, taken=max(0, taken + delta), holds=holds)
            written = _Written(row, delta, entering, self.balance)
            # What this write settles leaves the books while it is in flight, so that nothing serves a
            # reservation from capacity on its way back to the store (a give-back meanwhile stays).
            self.balance -= written.balance_out
            if not await self._send(written, waiters, chosen):
                continue
            if lone:
                self._keep_spare(spare)
            return
        raise StoreError("the counter kept changing under this instance")

    async def _taken_over(self) -> None:
        """This instance's holding left the row (0 too: a charge not in yet): another instance
        took this one over (it was too slow to beat) and settled it from its journal. The books start
        again, with the charges no sealed journal listed (the taker did not apply them: once the
        journal has met the seal, those of a journal before its own)."""
        log.warning("limits: %s was taken over from this instance elsewhere", self.key)
        number = await self.counters.journal.met_seal() if self.counters.journal is not None else 1
        if number is None:
            raise StoreError("this instance's journal could not be written to meet its seal")
        self._drop_books([staged for staged in self.staged if not 0 < staged.journal < number])

    def _landed(self, written: _Written, seen: CounterRow) -> bool:
        """Whether ``written``, whose answer was lost, landed, by the row read since (it changed):
        this instance's holding says (each write carries the next exchange number)."""
        mine, wrote = seen.holds.get(self.counters.instance), written.row.holds.get(self.counters.instance)
        if seen.window != written.row.window:
            return False
        if wrote is None:  # it took the holding out: gone means it landed, unless a takeover took it
            return mine is None and not self.counters.instances.fenced.is_set()
        return mine is not None and mine.exchange >= wrote.exchange

    async def _send(
        self, written: _Written, waiters: Sequence[Part] = (), chosen: Sequence[Part] = (), *, again: bool = False
    ) -> bool:
        """The books follow the write: False if the row changed since it was read; no answer:
        ``uncertain``. Sent ``again`` (its answer was lost), a changed row says nothing of the first
        sending, which may have landed meanwhile: it stays ``uncertain``, for the next read to decide."""
        try:
            row = await counter_row.write(self.counters.store, *self.key, written.row, SLOW_TIMEOUT)
        except StoreError:
            self.uncertain = written
            raise
        self.seen, self.known = (row, True) if row is not None else (self.seen, False)
        if row is None and again:
            self.uncertain = written
            return False
        self._follow(written, row is not None, waiters, chosen)
        return row is not None

    def _follow(
        self, written: _Written, landed: bool, waiters: Sequence[Part] = (), chosen: Sequence[Part] = ()
    ) -> None:
        """The books follow a write: landed, the ``chosen`` waiters it granted are served; not (and
        never will), what it took out of the balance comes back."""
        if landed and written.charges and self.counters.journal is not None:
            self.counters.journal.changed()  # it may drop the charges now in the row
        if written.row.window != self.window:
            return
        if not landed:
            self.balance += written.balance_out
            return
        self.held += written.delta - sum(staged.amount for staged in written.charges)
        self.in_row = self.counters.instance in written.row.holds
        self.balance += written.balance_out + written.delta  # what it keeps, and what it grants (served next)
        for staged in written.charges:
            if self.staged and self.staged[0] is staged:
                self.staged.popleft()
            self.applied = staged.seq
        self._answer(waiters, chosen)

    def _answer(self, waiters: Sequence[Part], chosen: Sequence[Part]) -> None:
        """The chosen waiters are granted from the balance, the others refused (one that gave up
        meanwhile leaves its share in the balance)."""
        picked = set(chosen)  # (a Part is hashed by identity)
        for part in waiters:
            if part.granted.done():
                continue
            if part in picked:
                self._grant(part)
            else:
                part.granted.set_result(False)
        self.waiters = deque(part for part in self.waiters if not part.granted.done())


@dataclass
class Reservation:
    """What one admitted request holds: ``settle`` it once its usage is known, or ``release`` it if
    it never ran. Settled (or made by ``Counters.adjust``), its charges wait in the budget counters
    until ``confirm()`` (their ledger rows written), then enter the rows."""

    parts: list[Part] = field(default_factory=list)  # what it holds (settled or released: nothing)
    rates: dict[str, Rate] = field(default_factory=dict)  # tokens, requests per minute, when limited: x-ratelimit-*
    charges: list[_Staged] = field(default_factory=list)  # settled: staged in the budget counters

    def settle(self, spent: Mapping[CounterKey, int]) -> Reservation:
        """Charge what was spent per counter (``spent[key]``; requests count 1 whatever): the rest
        goes back; more is taken, past the limit if need be (it was spent). Once only."""
        parts, self.parts = self.parts, []
        self.charges += [c for part in parts if (c := part.lease.settle(part, spent)) is not None]
        return self

    def release(self) -> None:
        """Nothing is charged: everything reserved (the request too) goes back."""
        parts, self.parts = self.parts, []
        for part in parts:
            part.lease.give_back(part)

    @property
    def needs(self) -> dict[CounterKey, int]:  # what it holds per budget counter, for the journal
        return {p.lease.key: p.need for p in self.parts if p.lease.period != "minute"}

    @property
    def seqs(self) -> dict[CounterKey, int]:  # per counter, its charge's number (for the journal)
        return {charge.lease.key: charge.seq for charge in self.charges}

    async def entered(self, within: float) -> bool:
        """Wait until each budget counter's row has this instance's holding (``Lease.in_row``; a
        correction where it held nothing: its first exchange) or the charge in, at most ``within`` seconds."""
        return await _until(
            lambda: all(c.lease.in_row or c not in c.lease.staged for c in self.charges),
            lambda: [charge.lease for charge in self.charges],
            within,
        )

    def journaled(self, number: int) -> None:
        """A landed write of journal ``number`` lists it settled: a takeover applies it from there."""
        for charge in self.charges:
            charge.journal = charge.journal or number

    def confirm(self, less: Mapping[CounterKey, int] | None = None) -> None:
        """The charge's ledger rows are written: its charges enter the rows, ``less`` (per counter)
        taken out first (segments whose ledger row another instance wrote and counted). All of it
        less (a request a takeover charged): its charges let go, whichever books they were staged on
        (left unconfirmed, one would keep this instance's holding in the row until the window ended)."""
        for charge in self.charges:
            charge.lease.confirm(charge, (less or {}).get(charge.lease.key, 0))

    def counted(self) -> bool:
        """Whether every budget charge is in its row (or needs nothing any more: its window is over,
        or the counter was taken over elsewhere)."""
        return all(charge not in charge.lease.staged for charge in self.charges)


class WriteAhead(Protocol):
    """What the counters need of this instance's journal: ``Journal``'s methods of these names
    (journal.py); ``changed``: charges entered a row (it may drop them)."""

    async def list_counter(self, key: CounterKey, holding: Callable[[], bool]) -> None: ...

    async def met_seal(self) -> int | None: ...

    def changed(self) -> None: ...


class Counters:
    """The limits of every caller and team, as this instance takes part in them (one per instance)."""

    def __init__(
        self,
        store: Store,
        instances: Instances,
        journal: WriteAhead | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.store = store
        self.instances = instances  # who holds (its id: the row's holding), and whether it was fenced
        self.journal = journal
        self.clock = clock or store.clock.now
        self.closed = False
        self._leases: dict[CounterKey, Lease] = {}
        self._pruned_at = ""

    @property
    def instance(self) -> str:
        return self.instances.id

    def _lease(self, want: Want) -> Lease:
        lease = self._leases.get(want.key)
        if lease is None:
            lease = self._leases[want.key] = Lease(self, want.key)
        lease.limit = want.limit  # an admin's change applies from the next request
        lease.period = want.period
        return lease

    def _prune(self, now: float) -> None:
        """Once a minute: forget the leases that hold nothing (a counter used again re-reads)."""
        minute = window_of("minute", now)
        if minute != self._pruned_at:
            self._pruned_at = minute
            for key in [k for k, lease in self._leases.items() if lease.flight is None and not lease.in_use()]:
                del self._leases[key]

    async def reserve(self, wants: Sequence[Want]) -> Reservation | Refused | Unavailable:
        """Reserve each ``Want``, all or nothing: a refusal by one gives back at once what the others
        reserved; so does a reservation cancelled while it waits (its caller gone)."""
        now = self.clock()
        for want in wants:
            if want.need > want.limit:
                return Refused(want.ref, want.limit, 0, want.need, _retry_after(want, now), alone=True)
        self._prune(now)
        # What the balances hold is granted at once: a request they all serve needs no loop hop.
        parts = [self._lease(w).ask(w.need, window_of(w.period, now)) for w in wants]
        waiting = [part.granted for part in parts if not part.granted.done()]
        if waiting:
            try:
                await self._wait(waiting)
            except BaseException:  # the reserving task was cancelled (its caller hung up): nothing is kept
                Reservation(_granted(parts)).release()
                raise
        granted = _granted(parts)
        asked = list(zip(parts, wants, strict=True))
        if len(granted) == len(parts):
            return Reservation(granted, self._rates(asked, now))
        Reservation(granted).release()  # all or nothing: what the others reserved goes back
        refused = [(part, w) for part, w in asked if not (part.granted.cancelled() or part.granted.result())]
        return self._refusal(refused, now) if refused else Unavailable()

    async def _wait(self, futures: list[asyncio.Future[bool]]) -> None:
        """Until every future is answered, or the store is taken for down (``RESERVE_TIMEOUT``), or
        slow for too long (``SLOW_TIMEOUT``)."""
        clock = self.store.clock
        asked = clock.answered_at
        _, pending = await asyncio.wait(futures, timeout=RESERVE_TIMEOUT)
        # Slow is not down: the store answered something meanwhile, or its answers have been slow
        # lately (a busy store: ``patience``); one that answered quickly until it stopped answering is down.
        if pending and (clock.answered_at > asked or clock.patience(RESERVE_TIMEOUT) > RESERVE_TIMEOUT):
            await asyncio.wait(pending, timeout=SLOW_TIMEOUT - RESERVE_TIMEOUT)

    def _refusal(self, refused: list[tuple[Part, Want]], now: float) -> Refused:
        order = {"spend": 0, "tokens": 1}
        part, want = min(refused, key=lambda refusal: order.get(refusal[0].lease.key.row, 2))
        lease = part.lease
        return Refused(want.ref, lease.limit, max(0, lease.used()), want.need, _retry_after(want, now))

    def _rates(self, asked: list[tuple[Part, Want]], now: float) -> dict[str, Rate]:
        """The tightest per-minute limit of each kind, for OpenAI's x-ratelimit-* headers."""
        reset = seconds_to_next_minute(now)
        rates: dict[str, Rate] = {}
        for part, want in asked:
            kind = {"tokens_per_minute": "tokens", "requests_per_minute": "requests"}.get(want.ref.kind)
            if kind is None:
                continue
            rate = Rate(part.lease.limit, part.lease.remaining(), reset)
            if kind not in rates or rate.remaining < rates[kind].remaining:
                rates[kind] = rate
        return rates

    def adjust(self, wants: Sequence[Want], at: float) -> Reservation:
        """Correct what a reservation made at ``at`` spent, by each want's ``need`` (either sign), in
        the windows it was made in when they are still current (``Lease.charge``): the corrections
        wait for ``Reservation.confirm`` (their ledger row written), as a settle's charges do."""
        now = self.clock()
        adjusted = Reservation()
        for want in wants:
            if not want.need or want.key.row.startswith("rpm"):
                continue
            lease = self._lease(want)
            lease.advance(window_of(want.period, now))
            if window_of(want.period, at) == lease.window and (charge := lease.charge(want.need)) is not None:
                adjusted.charges.append(charge)
        return adjusted

    def keep(self, keys: Iterable[CounterKey]) -> Callable[[], None]:
        """A lost part this instance's journal knows of, whose raise a takeover of this instance would
        count in the budget rows ``keys``: this instance's holding in each stays while it does, holding
        nothing perhaps (a takeover counts a dead instance's charges only where it has a holding:
        journal.py). The function returned lets go (once)."""
        leases = [lease for key in keys if (lease := self._leases.get(key)) is not None]
        for lease in leases:
            lease.kept += 1

        def let_go() -> None:
            for lease in leases:
                lease.kept -= 1
                lease.kick()
            leases.clear()

        return let_go

    async def flush(self, within: float = 5.0) -> bool:
        """Wait until this instance holds nothing and has nothing in flight (tests, shutdown): True if
        it got there within ``within`` seconds."""

        def done() -> bool:
            for lease in self._leases.values():
                lease._keep_spare(0)  # (what is left to give back starts an exchange)
            return all(lease.flight is None for lease in self._leases.values())

        return await _until(done, lambda: list(self._leases.values()), within)

    async def close(self) -> None:
        self.closed = True
        flights = [lease.flight for lease in self._leases.values() if lease.flight is not None]
        for flight in flights:
            flight.cancel()
        await asyncio.gather(*flights, return_exceptions=True)


def _fitting(waiters: list[Part], room: int) -> list[Part]:
    """The waiters that fit in ``room``, in order (a large one does not block smaller ones behind it)."""
    fits = []
    for waiter in waiters:
        if waiter.need <= room:
            fits.append(waiter)
            room -= waiter.need
    return fits


async def _until(done: Callable[[], bool], leases: Callable[[], list[Lease]], within: float) -> bool:
    """Wait until ``done()``, at most ``within`` seconds: for the ``leases``' flights while there
    are some, else a little (a failed exchange waits for its retry)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not done() and (left := deadline - loop.time()) > 0:
        flights = [lease.flight for lease in leases() if lease.flight is not None]
        if flights:
            await asyncio.wait(flights, timeout=left)
        else:
            await asyncio.sleep(min(0.05, left))
    return done()


def _granted(parts: list[Part]) -> list[Part]:  # those still waiting give up (unavailable)
    for part in parts:
        part.granted.cancel()
    return [part for part in parts if not part.granted.cancelled() and part.granted.result()]


def _retry_after(want: Want, now: float) -> float | None:
    return seconds_to_next_minute(now) if want.period == "minute" else None
