"""What happens when an instance is found dead: the one place that says it.

The duty holder (instances.py) finds an instance whose heartbeat is past its lease and takes its
row (a conditional write: if it was only slow, its next beat fails and it knows it was fenced). Then
``Recovery.recover(dead, taker)`` settles what the dead instance owed, from its journal
(journal.py: its open requests at their last checkpoint, its settled charges, the budget counters it
held capacity of), in four steps:

1. **Seal** the journal: ``sealed_by`` written on its ETag, so that the dead instance, if it was
   only slow, cannot write it again and learns it was taken over (journal.py).
2. **Ledger**: every listed charge's row that is not there yet is written (ledger.py); an open
   request is charged what it had generated at its last checkpoint, ``ended: lost``. A row someone
   else wrote first (a stream's taker charging the lost part from its log) is theirs to count in the
   counters; one below the checkpoint (a log is stored every few seconds) is raised to it, what the
   taker counted kept in the row, and only the difference is counted here. A taker's own charge of
   a lost part (``accounting.charge_lost``, in its journal too) counts what it added if it is in
   the row (its id in ``ops``: ``Ledger.apply``), written now if the row is as it was read.
3. **Counters**: in each budget counter row it held (counter_row.py), the dead instance's entry goes
   out: ``taken`` loses what it held and gains what it spent that the row does not have yet (its
   charges after the entry's ``applied`` number, and its open requests at what they generated).
   Minute windows need nothing: they end.
4. **Delete** the journal; the duty holder then deletes the dead instance's row.

Each step is idempotent: a ledger row is inserted once (a second insert finds it), a raised row
keeps what was counted of it, a counter entry is taken out once (a conditional write; gone means
done). So a takeover that dies mid-way is done again by the next duty holder, and two holders that
recover the same instance at the same time (a duty handed over while its holder was only slow)
charge everything once. Until step 4 the dead instance's row stays taken: a failure is tried again
at the next duty tick.

Not here: the dead instance's resumable streams. Their readers find the producer gone and one of them
goes on with the stream (state/streamlog/takeover.py), charging the lost part from the log
(accounting.charge_lost): the row that step 2 finds written by someone else."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import replace
from typing import Any

from ..errors import Modified, NotFound, StoreError
from . import counter_row
from .counter_row import MAX_ATTEMPTS
from .counters import SLOW_TIMEOUT
from .journal import amounts, journal_name
from .ledger import Charge, Ledger, Payer, theirs, tokens_of
from .port import Used
from .prices import Price
from .store import Store

log = logging.getLogger("chatstream")

SEAL_ATTEMPTS = 10  # the dead instance (if only slow) may write its journal meanwhile: read and seal again


class Recovery:
    """Settles a dead instance's journal (module docstring): ``recover`` is what the duty holder
    calls for each instance it finds dead."""

    def __init__(self, store: Store, ledger: Ledger):
        self.store = store
        self.ledger = ledger
        self.timeout = SLOW_TIMEOUT

    async def recover(self, dead: str, taker: str) -> None:
        """Steps 1-4 of the module docstring; safe to run again, and on two instances at once."""
        doc = await self._seal(dead, taker)  # 1.
        if doc is None:
            return  # nothing was owed (or a takeover finished already)
        entries = doc.get("entries") or []
        owed = [(entry, await self._charge(entry, dead)) for entry in entries]  # 2.
        for key in doc.get("counters") or []:  # 3.
            await self._give_back(key, dead, owed)
        with contextlib.suppress(StoreError):  # 4. (if it fails, a next run finds every step done)
            await self.store.delete_blob(journal_name(dead))
        log.info(
            "journal of %s taken over: %d request(s), %d counter(s)", dead, len(entries), len(doc.get("counters") or [])
        )

    async def _seal(self, dead: str, taker: str) -> dict[str, Any] | None:
        """Step 1: the journal as sealed by ``taker`` (None: there is none)."""
        name = journal_name(dead)
        for _ in range(SEAL_ATTEMPTS):
            found = await self.store.get_blob(name)
            if found is None:
                return None
            data, etag = found
            doc = json.loads(data)
            doc["sealed_by"] = taker
            try:
                await self.store.put(name, json.dumps(doc, separators=(",", ":")).encode(), etag=etag)
                return doc
            except (Modified, NotFound):  # written meanwhile (or deleted: the next read says)
                continue
        raise StoreError("the journal kept changing while it was being sealed")

    async def _charge(self, entry: dict[str, Any], dead: str) -> dict[str, int]:
        """Step 2 for one journal entry: its ledger rows written; what it brings into each budget
        counter ("partition/row" -> amount), less what others count."""
        charges = _charges_of(entry, dead)
        others: list[Charge] = []  # segments someone else charged first (a stream's taker): theirs to count
        counted: list[tuple[int, int]] = []  # (tokens, cost) a taker counted of a row raised to the checkpoint
        for charge in charges:
            if charge.ops:  # a write made on what its row held (a stream's lost part): counted if it is in
                if not await self.ledger.apply(charge):
                    others.append(charge)
                continue
            there = await self.ledger.write_now(charge)
            for _ in range(MAX_ATTEMPTS):
                if there is None or not theirs(there, dead, f"takeover:{dead}"):
                    break
                # A stream's taker charged this lost part first, from its log: theirs to count, unless
                # it is below this checkpoint (a log is stored every few seconds): then it is raised
                # to the checkpoint, what the taker counted kept in the row.
                if entry.get("state") == "settled" or tokens_of(there) >= charge.total_tokens:
                    others.append(charge)
                    there = None
                    break
                elsewhere = {
                    "counted_tokens": tokens_of(there),
                    "counted_cost": int(there.get("cost") or 0),
                    "ops": there.get("ops") or "",  # the writes it holds (Ledger.apply)
                }
                if await self.ledger.replace_below(charge, there, **elsewhere):
                    there = elsewhere  # the row as raised: what the taker counted of it
                    break
                there = await self.ledger.write_now(charge)  # it changed meanwhile (raised by another taker)
            else:
                raise StoreError(f"the ledger row of {charge.request_id} kept changing while it was being recovered")
            if there is not None and "counted_tokens" in there:  # raised, now or by an earlier run
                counted.append((int(there["counted_tokens"]), int(there.get("counted_cost") or 0)))
        kinds = entry.get("kinds") or {}
        less = amounts(kinds, others)
        for key, kind in kinds.items():
            less[key] = less.get(key, 0) + sum(cost if kind == "spend" else n for n, cost in counted)
        brings = entry.get("amounts") if entry.get("state") == "settled" else amounts(kinds, charges)
        return {k: max(0, int(v) - less.get(k, 0)) for k, v in (brings or {}).items()}

    async def _give_back(self, key: str, dead: str, owed: list[tuple[dict[str, Any], dict[str, int]]]) -> None:
        """Step 3 for one budget counter row ("partition/row"): the dead instance's entry out,
        ``taken`` less what it held, plus what its entries bring that the row does not have yet (a
        settled charge numbered at most the entry's ``applied`` is in). A conflict re-reads."""
        partition, _, row = key.partition("/")
        for _ in range(MAX_ATTEMPTS):
            found = await counter_row.read(self.store, partition, row, self.timeout)
            holds = dict(found.holds)
            held = holds.pop(dead, None)
            if held is None:
                return  # done (here or by another taker), or no row
            unapplied = sum(
                brings[key]
                for entry, brings in owed
                if key in brings
                and not (entry.get("state") == "settled" and int((entry.get("seqs") or {}).get(key, 0)) <= held.applied)
            )
            taken = max(0, found.taken - held.held + max(0, unapplied))
            try:
                await counter_row.write(
                    self.store, partition, row, replace(found, taken=taken, holds=holds), found.etag, self.timeout
                )
                return
            except (Modified, NotFound):
                continue
        raise StoreError(f"the counter {key} kept changing while it was being recovered")


def _charges_of(entry: dict[str, Any], dead: str) -> list[Charge]:
    """What a journal entry charges: its own charges when settled; for an open request, what it had
    generated at its last checkpoint (``ended: lost``)."""
    if entry.get("state") == "settled":
        return [Charge.of(c) for c in entry.get("charges") or []]
    price = Price.of(entry["price"]) if entry.get("price") else None
    # An entry's "id" is its request's (older journals name it nowhere else).
    payer = Payer.of({"request_id": entry["id"], **entry})
    generated = Used(int(entry.get("prompt") or 0), 0, int(entry.get("generated") or 0))
    segment = int(entry.get("segment") or 0)
    return [Charge.made(payer, entry["model"], generated, price, "lost", f"takeover:{dead}", segment)]
