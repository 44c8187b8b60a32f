"""This instance's journal: its durable memory of what it owes (its open reservations and the charges
it has not written everywhere yet); and ``Recovery``, which settles a dead instance's journal (the
duty holder calls it for each instance it finds dead: instances.py).

One blob per instance, ``instances/<id>.json`` in the app's container, rewritten (under its ETag) at
most every ``JOURNAL_SECONDS`` while anything changed: its requests (``JournalEntry``), open with a
checkpoint of what they generated or settled with their charges, and the budget counters this
instance holds capacity of (listed before it takes any: counters.py). A request is listed before its
upstream call goes out (``listed``), so whatever an upstream was asked for is in a journal.

A charge is listed, then its ledger row is written (ledger.py), then it enters the budget counters'
rows (counters.py), then it leaves the journal: a row holds this instance's charges up to its holding's
``applied`` number, and a row without its holding owes nothing (a correction where it held nothing is
listed once it has one: accounting._correct). Not recovered: requests admitted while the journal
could not be written (a store outage: listed once it is back), and charges made while the store could
not be written at all, by an instance that then died.

``Recovery.recover(dead, taker)`` takes four steps, each idempotent (a ledger row is inserted once, a
row it raised says by how much, a counter entry is taken out once): a takeover that dies midway is
done again by the next duty holder, and two at once charge everything once.

1. **Seal** the journal (``sealed_by``, on its ETag): the dead instance, if it was only slow, cannot
   write it again and learns it was taken over (moved to a new id first: once it is sealed or gone).
2. **Ledger**: every settled charge's row is written (one someone else wrote first is theirs to
   count; a taker's raise of a lost part counts if it is in the row). An open entry (a request, or
   a lost part its taker knew of) is charged ``ended: lost``: its row raised (``ledger.raised``) to
   its checkpoint, or to what its producer's part of the stream's log holds if more (``told``).
   Only what the raise adds is counted, and the row records the raise, so a recovery run again,
   or twice at once, counts it once (a taker counts its own raises).
3. **Counters**: in each budget counter row it held (counter_row.py), the dead instance's holding goes
   out: ``taken`` loses what it held and gains what it spent that the row does not have yet (its
   charges after the holding's ``applied`` number, its open requests at their checkpoint), if of the
   row's window (its ledger day's): a charge of a window that is over enters no row. Minute windows
   end by themselves.
4. **Delete** the journal; the duty holder then deletes the dead instance's row.

Not here: the dead instance's resumable streams. A reader takes each over (streamlog/takeover.py)
and charges the lost part from the log: the row step 2 finds written by someone else."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from .. import tokens
from ..errors import Modified, NotFound, StoreError
from . import counter_row
from .counter_row import MAX_ATTEMPTS, CounterKey, window_of
from .counters import SLOW_TIMEOUT, Reservation
from .instances import Instances
from .ledger import TAKEOVER, Charge, Ledger, Payer, raised
from .port import Used
from .prices import Price
from .store import NEW, Store, compact_json
from .streamlog.format import producer_events, stored_log

log = logging.getLogger("chatstream")

JOURNAL_SECONDS = 0.5
# A write a change wakes waits this long first, unless something waits for it (``listed``,
# ``list_counter``): a request's upstream call goes out before the journal's store call.
WAKE_DELAY = 0.02
# A budget counter stays listed this long after it was last needed: the caller's next request holds
# it again without a journal write first (list_counter); a takeover reads its row, nothing else.
LISTED_SECONDS = 60.0


def journal_name(instance: str) -> str:
    return f"instances/{instance}.json"


@dataclass
class JournalEntry:
    """One request in the journal, open or settled; or a correction of one (``accounting._correct``,
    settled), or a taker's knowledge of a lost part (``accounting.regenerating``, open)."""

    # In its journal document (``serialised``):
    key: str  # its request's id; a correction (accounting._correct): that and what it corrects
    payer: Payer
    model: str
    prompt_tokens: int  # counted: what a partial answer is charged as its prompt
    needs: dict[CounterKey, int]  # reserved of each budget counter
    price: Price | None = None  # what an open entry's checkpoint is charged at (a settled one: its charges)
    segment: int = 0  # its first segment: a stream's takeover charges in a block of its own (accounting.py)
    stream: str | None = None  # a resumable stream's id: its log shows what its caller was sent
    epoch: int = 1  # which producer of that stream this request is (1: the original)
    state: str = "open"  # open | settled
    charges: list[Charge] = field(default_factory=list)
    spent: dict[CounterKey, int] = field(default_factory=dict)  # settled: of each budget counter (stored "amounts")
    seqs: dict[CounterKey, int] = field(default_factory=dict)  # settled: their numbers there (``reservation.seqs``)
    counted_tokens: int = 0  # of the checkpoint, counted so far (read back: all of it, ``generated``)
    # The request path's, never in the journal:
    generated: Callable[[], Mapping[int, str]] | None = None  # the text so far per choice (checkpoints)
    floor: Callable[[], int] | None = None  # tokens known generated besides that text (a checkpoint's part)
    counted_chars: dict[int, int] = field(default_factory=dict)  # per choice: the text ``counted_tokens`` has
    reservation: Reservation = field(default_factory=Reservation)  # what it holds; settled: its charges there
    listed: bool = False  # it is in a written journal (as it was then)
    journaled: bool = False  # its settled form is in a written journal
    written: asyncio.Event = field(default_factory=asyncio.Event)  # its ledger rows are in
    taken_over: bool = False  # taken over elsewhere (this instance was declared dead): not ours to charge
    # ``serialised``'s caches: the JSON of the fields set at opening; of all but the checkpoint, with
    # the (state, segment, stream, epoch) it was made of
    _fixed: str = field(default="", repr=False)
    _head: tuple[tuple, str] = field(default=((), ""), repr=False)

    def checkpoint(self) -> int:
        """Completion tokens generated so far: each choice's text up to its last space counted once
        (a word split between two counts would count more tokens than the whole text does), plus
        the rest counted anew; and ``floor``, tokens known generated whose text is not known."""
        floor = self.floor() if self.floor is not None else 0
        if self.generated is None:
            return self.counted_tokens + floor
        rest = 0
        for choice, text in self.generated().items():
            counted = self.counted_chars.get(choice, 0)
            cut = text.rfind(" ", counted)
            if cut > counted:
                self.counted_tokens += tokens.count_text(self.model, text[counted:cut])
                self.counted_chars[choice] = counted = cut
            rest += tokens.count_text(self.model, text[counted:]) if len(text) > counted else 0
        return self.counted_tokens + rest + floor

    def lost_charge(self, author: str, logged: int = 0) -> Charge:
        """What an open entry charges, ``ended: lost``: its checkpoint, or ``logged`` tokens if more."""
        used = Used(self.prompt_tokens, 0, max(logged, self.checkpoint()))
        return Charge.made(self.payer, self.model, used, self.price, "lost", author, self.segment)

    def serialised(self) -> str:
        """Its document in the journal, as JSON. Only an open request's checkpoint (``generated``, its
        last field) is encoded at every write; the rest is kept until its state, segment, stream or
        epoch changes."""
        fields = (self.state, self.segment, self.stream, self.epoch)
        if self._head[0] != fields:
            if not self._fixed:
                fixed = {
                    "id": self.key,
                    **self.payer.values(),
                    "model": self.model,
                    "prompt": self.prompt_tokens,
                    "needs": _named(self.needs),
                }
                self._fixed = f'{compact_json(fixed)[:-1]},"price":{_price_json(self.price)}'
            self._head = (fields, f"{self._fixed},{compact_json(self._changing())[1:-1]}")
        return f'{self._head[1]},"generated":{self.checkpoint()}}}' if self.state == "open" else self._head[1] + "}"

    def _changing(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"state": self.state}
        if self.segment:
            doc["segment"] = self.segment
        if self.stream is not None:
            doc["stream"], doc["epoch"] = self.stream, self.epoch
        if self.state == "settled":
            doc["charges"] = [c.values() for c in self.charges]
            doc["amounts"] = _named(self.spent)
            doc["seqs"] = _named(self.seqs)
        return doc

    @classmethod
    def read(cls, doc: Mapping[str, Any]) -> JournalEntry:
        """An entry as a written journal holds it (an open one's checkpoint as ``counted_tokens``)."""

        def parsed(named: Mapping[str, Any] | None) -> dict[CounterKey, Any]:
            return {CounterKey.parse(key): value for key, value in (named or {}).items()}

        return cls(
            doc["id"],
            Payer.of(doc),
            doc["model"],
            int(doc.get("prompt") or 0),
            parsed(doc.get("needs")),
            Price.of(doc["price"]) if doc.get("price") else None,
            counted_tokens=int(doc.get("generated") or 0),
            segment=int(doc.get("segment") or 0),
            stream=doc.get("stream"),
            epoch=int(doc.get("epoch") or 1),
            state=doc.get("state") or "open",
            charges=[Charge.of(c) for c in doc.get("charges") or []],
            spent=parsed(doc.get("amounts")),
            seqs=parsed(doc.get("seqs")),
        )


class Journal:
    """This instance's journal (module docstring)."""

    def __init__(self, store: Store, ledger: Ledger, instances: Instances):
        self.store = store
        self.ledger = ledger
        self.instances = instances
        self.interval = JOURNAL_SECONDS
        self.entries: dict[str, JournalEntry] = {}
        self._holding: dict[CounterKey, Callable[[], bool]] = {}  # budget counter -> whether the counters hold some
        self._listed_counters: set[CounterKey] = set()  # budget counters in the last written journal
        self._needed_at: dict[CounterKey, float] = {}  # budget counter -> when it was last needed (LISTED_SECONDS)
        self._lapse: float | None = None  # when the first counter listed but not needed lapses (_listing)
        self._next: asyncio.Future[None] | None = None  # done when the next write to start ends
        self._etag: str | None = None
        self._instance: str | None = None  # the incarnation this journal is written for
        self._dirty = asyncio.Event()
        self._urgent = asyncio.Event()  # a request waits for the next write (_next_write): no pause first
        self._writer: asyncio.Task | None = None
        self._rows: asyncio.Task | None = None  # writes the ledger rows of what it lists (_write_rows)
        self._quiet = asyncio.Event()  # set while no write is in flight
        self._quiet.set()
        self._closed = False
        self._failing = False  # the last write failed: requests do not wait for a listing
        self.number = 1  # which journal of this process: one more each time one was found sealed (_taken_over)

    # --- what the request path tells it ----------------------------------------------------------

    def open(self, entry: JournalEntry) -> JournalEntry:
        self.entries[entry.key] = entry
        self.changed()
        return entry

    def drop(self, entry: JournalEntry) -> None:
        """A request that reserved nothing in the end (released): it leaves the journal."""
        if self.entries.pop(entry.key, None) is not None:
            self.changed()

    def settle(self, entry: JournalEntry, charges: list[Charge], spent: Mapping[CounterKey, int]) -> None:
        """The request is over, having ``spent`` (per counter): its reservation settled, listed as
        settled, then its ledger rows, then the counters (module docstring); all in the background."""
        entry.reservation.settle(spent)
        if entry.taken_over:  # taken over, the journal learnt it first: its taker charged it
            entry.reservation.confirm(less=spent)  # all of it less: nothing enters a row here
            return
        entry.state = "settled"
        entry.charges = charges
        entry.spent = {key: spent.get(key, 0) for key in entry.needs}
        entry.seqs = entry.reservation.seqs
        entry.generated = None
        self.changed()

    async def listed(self, entry: JournalEntry, within: float) -> None:
        """Wait until a written journal lists ``entry``, at most ``within`` seconds; not while it cannot
        be written (a store outage): the request goes on, listed once it can be."""
        if entry.listed or self._failing or self._closed:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await asyncio.shield(self._next_write())  # opened before: the next write lists it

    async def list_counter(self, key: CounterKey, holding: Callable[[], bool]) -> None:
        """Before this instance holds any of budget counter ``key``: a written journal lists it, and
        goes on listing it while ``holding()`` (and ``LISTED_SECONDS`` after)."""
        self._holding[key] = holding
        while key not in self._listed_counters and not self._closed:  # a write that failed (or was fenced): the next
            self._needed_at[key] = asyncio.get_running_loop().time()
            await asyncio.shield(self._next_write())

    def urgent(self) -> None:
        """The next write starts without a pause (its checkpoints cannot wait: this instance stops)."""
        self._urgent.set()
        self.changed()

    def _next_write(self) -> asyncio.Future[None]:
        """Done when the next write to start ends (landed or not); it starts without a pause."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        self.urgent()
        return self._next

    def changed(self) -> None:
        self.instances.serve()  # (beating: what the journal lists is this instance's while it is seen alive)
        self._dirty.set()
        if (self._writer is None or self._writer.done()) and not self._closed:
            self._writer = asyncio.ensure_future(self._write_loop())

    # --- writing it ------------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        backoff = self.interval
        woken = True  # a new writer, or one that waited for a change: WAKE_DELAY first
        while not self._closed:
            if not self._dirty.is_set():
                with contextlib.suppress(TimeoutError):  # (a lapse: written again without it)
                    async with asyncio.timeout_at(self._lapse):
                        await self._dirty.wait()
                woken = True
            if woken and not self._urgent.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(WAKE_DELAY):
                        await self._urgent.wait()
            woken = False
            self._dirty.clear()
            self._urgent.clear()
            self._quiet.clear()
            try:
                await self._write()
                backoff = self.interval
                self._failing = False
            except Exception as exc:  # the store's failure, or a bug of ours: neither stops the journal
                if isinstance(exc, StoreError):
                    log.warning("journal: could not be written (%s); retrying", exc)
                else:
                    log.exception("journal: writing failed")
                self._failing = True
                self._dirty.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            finally:
                self._quiet.set()
            with contextlib.suppress(TimeoutError):  # the pause between writes, unless a request waits
                async with asyncio.timeout(self.interval):
                    await self._urgent.wait()
            if any(e.state == "open" and e.generated is not None for e in self.entries.values()):
                self._dirty.set()  # open requests: their checkpoints go on

    async def _write(self) -> None:
        """One write; whoever waits for the next one (``_next_write``) hears when it ends."""
        landing, self._next = self._next, None
        try:
            await self._write_once()
        finally:
            if landing is not None and not landing.done():
                landing.set_result(None)

    async def _write_once(self) -> None:
        instance = self.instances.id
        name = journal_name(instance)
        if instance != self._instance:  # a new incarnation (the old one was declared dead): a new journal
            if self._instance is not None and self._etag is not None:
                await self._hand_over(self._instance)
            self._instance, self._etag = instance, None
        self.entries = {  # settled requests whose ledger rows and counter charges are all in leave it
            key: e
            for key, e in self.entries.items()
            if not (e.state == "settled" and e.written.is_set() and e.reservation.counted())
        }
        listed = self._listing()
        # A counter this write drops is not listed once it lands: one held again meanwhile (list_counter)
        # waits for the next write, not for this one.
        self._listed_counters &= set(listed)
        if not self.entries and not listed:
            if self._etag is not None:
                with contextlib.suppress(StoreError):
                    await self.store.delete_blob(name)
                self._etag = None
            return
        settled_now = [e for e in self.entries.values() if e.state == "settled" and not e.journaled]
        in_doc = list(self.entries.values())
        head = {"instance": instance, "at": self.store.clock.now(), "counters": [str(key) for key in listed]}
        entries = ",".join(e.serialised() for e in in_doc)
        data = f'{compact_json(head)[:-1]},"entries":[{entries}]}}'.encode()
        try:
            self._etag = await self.store.put(name, data, etag=self._etag or NEW)
        except Modified:
            if (etag := await self._unsealed(name)) is None:
                self._taken_over()
                return
            # Our own journal: a write of ours landed with its answer lost, or a delete of it failed.
            self._etag = await self.store.put(name, data, etag=etag)
        self._listed_counters = set(listed)
        for entry in in_doc:
            entry.listed = True
        for entry in settled_now:
            entry.journaled = True
            entry.reservation.journaled(self.number)
        if settled_now and (self._rows is None or self._rows.done()) and not self._closed:
            self._rows = asyncio.ensure_future(self._write_rows())

    def _listing(self) -> list[CounterKey]:
        """The counters to list: those held, or needed by a request, within ``LISTED_SECONDS`` (with no
        request listed, the writer writes again when they lapse)."""
        now = asyncio.get_running_loop().time()
        needed = {key for key, holding in self._holding.items() if holding()}
        needed |= {key for e in self.entries.values() for key in e.needs}
        kept = {key: at for key, at in self._needed_at.items() if now - at < LISTED_SECONDS and key not in needed}
        self._lapse = min(kept.values()) + LISTED_SECONDS + 0.01 if kept and not self.entries else None
        self._needed_at = kept | dict.fromkeys(needed, now)
        self._holding = {key: holding for key, holding in self._holding.items() if key in needed}
        return sorted(needed | set(kept))

    async def _write_rows(self) -> None:
        """The ledger rows of the settled requests a written journal lists, tried again until they are
        in; then their charges enter the budget counters, but for rows another instance wrote first
        (that one counts them). Off the writer's path: a listing does not wait for rows."""
        backoff = self.interval
        while waiting := [e for e in self.entries.values() if e.journaled and not e.written.is_set()]:
            landed = iter(await self.ledger.write([c for e in waiting for c in e.charges]))
            failed = 0
            for entry in waiting:
                outcome = [next(landed) for _ in entry.charges]
                if None in outcome:
                    failed += outcome.count(None)
                    continue
                entry.written.set()
                theirs = [c for c, t in zip(entry.charges, outcome, strict=True) if t]
                entry.reservation.confirm(amounts(entry.needs, theirs))  # now the counters take them in
            self.changed()  # entries all in leave the journal
            if failed:
                log.warning("usage ledger: %d charge(s) wait for the store; retrying in %.1f s", failed, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            else:
                backoff = self.interval

    async def _unsealed(self, name: str) -> str | None:
        """The ETag of journal ``name`` if it is there unsealed; None if another instance sealed it
        (or sealed and deleted it: taken over)."""
        found = await self.store.get_blob(name)
        return found[1] if found is not None and not json.loads(found[0]).get("sealed_by") else None

    async def _hand_over(self, old: str) -> None:
        """This instance was declared dead as ``old`` before a write met the seal: what that journal
        listed is its taker's once it is sealed or gone; until then (``old``'s row still there) the
        write waits, failing. Unsealed with the row gone, nobody will take it: it stays ours."""
        if await self._unsealed(journal_name(old)) is None:
            self._taken_over()
        elif await self.instances.silent_for(old) < float("inf"):
            raise StoreError("the journal of this instance's previous incarnation waits for its takeover")

    def _taken_over(self) -> None:
        """The journal was sealed elsewhere: this instance was taken over (too slow to beat). What it
        listed is the taker's now; what came after goes on under the new incarnation's journal."""
        log.warning("journal: sealed by another instance (this one was taken over); starting a new one")
        for key, entry in list(self.entries.items()):
            if entry.listed:  # the taker settled it from the sealed journal: not ours any more
                entry.taken_over = True
                if not entry.journaled:  # settled here since (or open: nothing staged): as in ``settle``
                    entry.reservation.confirm(less=entry.spent)
                del self.entries[key]
        self._etag = None
        self._listed_counters = set()
        self._needed_at.clear()
        self.number += 1

    async def met_seal(self) -> int | None:
        """A budget row lost this instance's holding (counters.py): this journal's ``number`` once a write
        tells whether it was sealed (``_taken_over``); None if it could not be written."""
        if self._etag is not None and not self._closed:  # (None: nothing written since the last seal met)
            await asyncio.shield(self._next_write())
        return self.number if self._etag is None or not self._failing else None

    async def flush(self, within: float = 5.0) -> bool:
        """Wait until everything settled is written everywhere (tests, shutdown)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while loop.time() < deadline:
            settled = any(e.state == "settled" for e in self.entries.values())
            if not settled and not self._dirty.is_set() and self._quiet.is_set():  # entries leave in a write
                return True
            self.changed()
            await asyncio.sleep(0.05)
        return False

    async def close(self) -> None:
        """Stop the writer (the write in flight ends first) and write once more what is left: after a
        flush, with the counters given back, nothing, and the journal goes."""
        self._closed = True
        if self._next is not None and not self._next.done():
            self._next.set_result(None)  # no write waits for it any more
        self._needed_at.clear()  # a graceful stop leaves no journal listing what it no longer holds
        if self._writer is not None:
            if not self._writer.done():
                await self._quiet.wait()  # a store call: bounded
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        if self._rows is not None:  # rows not written yet: their requests stay in the journal
            self._rows.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rows
        with contextlib.suppress(StoreError):
            await self._write()


def amounts(keys: Iterable[CounterKey], charges: list[Charge]) -> dict[CounterKey, int]:
    """What ``charges`` spend of each counter of ``keys``: of a spend budget (row ``spend``) their
    cost in pico-dollars, of any other their tokens."""
    tokens, cost = sum(c.total_tokens for c in charges), sum(c.cost or 0 for c in charges)
    return {key: cost if key.row == "spend" else tokens for key in keys}


# What a stream's route makes of its stored events (route, events): the text its caller was sent.
Told = Callable[[str, bytes], str]


class Recovery:
    """Settles a dead instance's journal (module docstring); ``told``: None, the checkpoint alone."""

    def __init__(self, store: Store, ledger: Ledger, told: Told | None = None):
        self.store = store
        self.ledger = ledger
        self.told = told

    async def recover(self, dead: str, taker: str) -> None:
        """Steps 1-4 of the module docstring; safe to run again, and on two instances at once."""
        doc = await self._seal(dead, taker)  # 1.
        if doc is None:
            return  # nothing was owed (or a takeover finished already)
        entries = [JournalEntry.read(entry) for entry in doc.get("entries") or []]
        owed = [(entry, await self._charge(entry, dead)) for entry in entries]  # 2.
        counters = [CounterKey.parse(key) for key in doc.get("counters") or []]
        for key in counters:  # 3.
            await self._settle_counter(key, dead, owed)
        with contextlib.suppress(StoreError):  # 4. (if it fails, a next run finds every step done)
            await self.store.delete_blob(journal_name(dead))
        log.info("journal of %s taken over: %d request(s), %d counter(s)", dead, len(entries), len(counters))

    async def _seal(self, dead: str, taker: str) -> dict[str, Any] | None:
        """Step 1: the journal as sealed by ``taker`` (None: there is none)."""
        name = journal_name(dead)
        for _ in range(MAX_ATTEMPTS):  # the dead instance (if only slow) may write it meanwhile: read, seal again
            found = await self.store.get_blob(name)
            if found is None:
                return None
            data, etag = found
            doc = json.loads(data)
            doc["sealed_by"] = taker
            try:
                await self.store.put(name, compact_json(doc).encode(), etag=etag)
                return doc
            except (Modified, NotFound):  # written meanwhile (or deleted: the next read says)
                continue
        raise StoreError("the journal kept changing while it was being sealed")

    async def _logged_tokens(self, entry: JournalEntry) -> int:
        """Completion tokens of an open entry's part of its stream's log (0: none, or not read)."""
        if self.told is None or not entry.stream:
            return 0
        try:
            found = await stored_log(self.store, entry.stream)
        except (StoreError, NotFound) as exc:
            log.warning("journal: a stream's log could not be read (%s): its checkpoint is charged", exc)
            return 0
        if found is None:
            return 0
        record, data = found
        text = self.told(record.route, producer_events(data, entry.epoch))
        return tokens.count_text(entry.model, text) if text else 0

    async def _charge(self, entry: JournalEntry, dead: str) -> dict[CounterKey, int]:
        """Step 2 for one entry: what it brings into each budget counter, less what others count."""
        if entry.state != "settled":  # an open request, or a taker's knowledge of a lost part: raised
            charge = entry.lost_charge(TAKEOVER + dead, await self._logged_tokens(entry))
            for _ in range(MAX_ATTEMPTS):
                write, adds = raised(await self.ledger.find(charge), charge, charge.author)
                if write is None or await self._write([write]) == [False]:  # (True: the row changed first)
                    return amounts(entry.needs, [adds])
            raise StoreError(f"the ledger row of {charge.request_id} kept changing while it was being recovered")
        theirs = await self._write(entry.charges)  # (a stream's taker charged a part first: it counts it)
        less = amounts(entry.needs, [c for c, t in zip(entry.charges, theirs, strict=True) if t])
        # Less what others count, at most all of it; a correction's give-back (negative) as it is.
        return {k: min(v, max(0, v - less.get(k, 0))) for k, v in entry.spent.items()}

    async def _write(self, charges: list[Charge]) -> list[bool]:
        """``Ledger.write`` for a recovery: each charge's row landed (False) or another's (True)."""
        theirs = await self.ledger.write(charges)
        if None in theirs:
            raise StoreError("the usage ledger could not be written")
        return [bool(t) for t in theirs]

    async def _settle_counter(
        self, key: CounterKey, dead: str, owed: list[tuple[JournalEntry, dict[CounterKey, int]]]
    ) -> None:
        """Step 3 for one budget counter row; a conflict re-reads."""
        partition, row = key
        for _ in range(MAX_ATTEMPTS):
            found = await counter_row.read(self.store, partition, row, SLOW_TIMEOUT)
            holds = dict(found.holds)
            held = holds.pop(dead, None)
            if held is None:
                return  # done (here or by another taker), or no row
            unapplied = sum(
                brings[key]
                for entry, brings in owed
                if key in brings
                and _in_window(found.window, entry.payer.day)
                and not (entry.state == "settled" and entry.seqs.get(key, 0) <= held.applied)
            )
            taken = max(0, found.taken - held.held + unapplied)
            changed = replace(found, taken=taken, holds=holds)
            if await counter_row.write(self.store, partition, row, changed, SLOW_TIMEOUT) is not None:
                return
        raise StoreError(f"the counter {key} kept changing while it was being recovered")


def _in_window(window: str | None, day: str) -> bool:
    """Whether a budget row's ``window`` is that of a request started on ``day`` (its ledger day): a
    charge of a window that is over goes into no row (counters.py), not into the next window's."""
    at = datetime.strptime(day, "%Y%m%d").replace(tzinfo=UTC).timestamp()
    return window in {window_of(period, at) for period in ("day", "month", "total")}


@functools.lru_cache(maxsize=64)
def _price_json(price: Price | None) -> str:
    """A price as a journal entry holds it: made once per price, not per request (every request at
    that price names it)."""
    return compact_json(price.entity() if price is not None else None)


def _named(per_counter: Mapping[CounterKey, Any]) -> dict[str, Any]:
    """Per counter, as the journal document stores it ("partition/row" -> value)."""
    return {str(key): value for key, value in per_counter.items()}
