"""The usage ledger: one row per charge, never lost and never twice, and usage summed by caller, team,
model and day (docs/callers.md).

Table ``chatstreamUsage``, one partition per caller (``u:<caller id>``: a caller deleted and created
again under its name starts a new one), RowKey ``<day>|<request id>|<segment>``: the UTC day the
request started, the app's request id, and the segment (an answer continued on another upstream is
charged per segment). The key is fixed by the request, so writing a charge again (a retry after a
lost answer, another instance settling a dead one's request) adds nothing, and only the writer whose
row landed counts it in the budget counters. A row holds a ``Charge`` and the raises made on it
(``ops``: ``raised``); every row is written by ``write``."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any, Self

from ..errors import AlreadyExists, Modified, NotFound, StoreError
from .port import Ended, Used
from .prices import Price, usd
from .store import USAGE_TABLE, Op, Store, Where, key_part

log = logging.getLogger("chatstream")

MAX_USAGE_DAYS = 366  # the longest period one usage query may cover
USAGE_TIMEOUT = 20.0  # a usage query (admin only) may read many rows
SUMMED = ("prompt_tokens", "cached_tokens", "completion_tokens")  # usage's sums of the rows' fields
ZEROS = (*SUMMED, "total_tokens", "requests", "unpriced_requests", "cost_picousd")


@dataclass(frozen=True, kw_only=True)
class Payer:
    """Who pays for which request, and the UTC day it started (``YYYYMMDD``: its rows' key). Its
    journal entry holds it; each of its charges is made of it."""

    caller: str
    caller_id: str
    team: str | None = None
    team_id: str | None = None
    request_id: str
    endpoint: str
    day: str

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> Self:
        """One as the journal keeps it (``values``), or a charge as its ledger row holds it (``entity``)."""
        found = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
        return cls(**{"day": str(values.get("RowKey") or "")[:8], **found})

    def values(self) -> dict[str, Any]:
        """Its fields by name (not ``asdict``: its deep copy cost more than the rest of a charge)."""
        return dict(vars(self))


@dataclass(frozen=True, kw_only=True)
class Charge(Payer):
    """One charge: a request's (or one segment's) usage and cost."""

    model: str
    prompt_tokens: int
    completion_tokens: int
    ended: Ended
    cached_tokens: int = 0
    cost: int | None = None  # pico-dollars; None: the model had no price
    segment: int = 0
    upstream: str | None = None  # the pool entry that served it
    upstream_id: str = ""  # the upstream's x-request-id
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    author: str = ""  # the instance that wrote it; a recovery: TAKEOVER + the dead instance's id
    # A raise (``raised``): the raises the row holds, this one's last (``by=tokens/cost``); ``over``: the
    # ETag of the row it is made on (None: an insert).
    ops: str = ""
    over: str | None = None

    @classmethod
    def made(
        cls,
        payer: Payer,
        model: str,
        used: Used,
        price: Price | None,
        ended: Ended,
        author: str,
        segment: int = 0,
        upstream_id: str | None = None,
    ) -> Charge:
        """One segment of ``payer``'s request, at ``price`` (None: unpriced)."""
        return cls(
            **payer.values(),
            model=model,
            segment=segment,
            upstream=used.upstream,
            upstream_id=used.request_id or upstream_id or "",
            prompt_tokens=used.prompt,
            cached_tokens=used.cached,
            completion_tokens=used.completion,
            cost=price.cost(used.prompt, used.cached, used.completion) if price is not None else None,
            ended=ended,
            author=author,
        )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def partition(self) -> str:
        return f"u:{self.caller_id}"

    @property
    def row_key(self) -> str:
        return f"{self.day}|{key_part(self.request_id)}|{self.segment:02d}"

    def entity(self) -> dict[str, Any]:
        values = {"PartitionKey": self.partition, "RowKey": self.row_key, **self.values()}
        del values["day"], values["over"]  # the day is in the RowKey; ``over`` is the write's own
        if not values["ops"]:
            del values["ops"]
        return values


TAKEOVER = "takeover:"  # (``Charge.author``)


def raised(there: Charge | None, charge: Charge, by: str) -> tuple[Charge | None, Charge]:
    """The one way a row is raised: row ``there`` (``Ledger.find``; None: none yet) raised to
    ``charge``, as (the write, what it adds). The write is made on that row (its author kept:
    ``write`` lands it only if the row did not change first) and records its op ``by=tokens/cost``,
    ``by`` naming who raised it (a recovery: TAKEOVER + the dead instance; a stream's taker: an id of
    its own). What it adds is a charge of the difference, in its prompt tokens. No write if the row
    holds as much already (it adds nothing), or if ``by`` raised it already (it adds what that raise
    did: a recovery run again, or twice at once, counts it once)."""
    ops = {who: counted for who, _, counted in (op.rpartition("=") for op in there.ops.split())} if there else {}
    if by in ops:  # (a bare id, a taker's op as an older version wrote it, names no one)
        tokens, _, cost = ops[by].partition("/")
        return None, replace(charge, prompt_tokens=int(tokens), completion_tokens=0, cost=int(cost))
    write, adds, cost = charge, charge.total_tokens, charge.cost or 0
    if there is not None:
        adds, cost = adds - there.total_tokens, cost - (there.cost or 0)
        if adds <= 0:
            return None, replace(charge, prompt_tokens=0, completion_tokens=0, cost=0)
        write = replace(charge, author=there.author, ops=there.ops, over=there.over)
    write = replace(write, ops=f"{write.ops} {by}={adds}/{cost}".strip())
    return write, replace(charge, prompt_tokens=adds, completion_tokens=0, cost=cost)


class Ledger:
    def __init__(self, store: Store):
        self.store = store

    # --- writing ----------------------------------------------------------------------------

    async def write(self, charges: Sequence[Charge]) -> list[bool | None]:
        """Write ``charges``: per partition, in transactions of up to 100 rows; a raise on its own. Per
        charge: None if it did not land (write it again), else whether its row is another instance's,
        found there first (that writer counted it), or, of a raise, the row changed first."""
        found: dict[int, bool] = {}  # charge (index) -> theirs
        rows: dict[tuple[str, str], list[int]] = {}  # (partition, row key) -> its charges
        for i, charge in enumerate(charges):
            if not charge.ops:
                rows.setdefault((charge.partition, charge.row_key), []).append(i)
                continue
            try:
                found[i] = not await self._raise(charge)
            except StoreError:
                continue
            except Exception:  # a bug of ours: said loudly, counted nowhere, the rest goes on
                log.exception("usage ledger: the charge of request %s cannot be written", charge.request_id[:12])
                found[i] = True
        chunks = _transactions((partition, row) for (partition, _), row in rows.items())
        while chunks:
            chunk = chunks.pop(0)
            try:
                await self._insert(charges, chunk, found)
            except StoreError:
                continue
            except Exception:  # a bug of ours (a row the store cannot keep): said loudly, the rest goes on
                first = charges[chunk[0][0]].request_id[:12]
                log.exception("usage ledger: %d charge(s) cannot be written (request %s...)", len(chunk), first)
                # One at a time: the good ones land, a bad one is let go (it can never be written).
                if len(chunk) > 1:
                    chunks += [[row] for row in chunk]
                    continue
                found.update(dict.fromkeys(chunk[0], False))
        return [found.get(i) for i in range(len(charges))]

    async def _insert(self, charges: Sequence[Charge], chunk: list[list[int]], found: dict[int, bool]) -> None:
        """Insert a row per item of ``chunk`` (the charges of one row) as one transaction; a row already
        there (ours, its answer lost; or another's) is taken out and the rest tried again."""
        chunk = list(chunk)
        while chunk:
            try:
                await self.store.batch(USAGE_TABLE, [Op("insert", charges[row[0]].entity()) for row in chunk])
                break
            except AlreadyExists as exc:
                index = exc.index or 0  # (None: the store did not say which)
                row = chunk.pop(index if 0 <= index < len(chunk) else 0)
                there = await self.find(charges[row[0]])  # theirs if another wrote it
                theirs = there is not None and there.author != charges[row[0]].author
                found.update(dict.fromkeys(row, theirs))
        for row in chunk:
            found.update(dict.fromkeys(row, False))

    async def find(self, charge: Charge) -> Charge | None:
        """The charge's row as the ledger holds it (written by whoever came first), ``over`` its ETag."""
        row = await self.store.get(USAGE_TABLE, charge.partition, charge.row_key)
        return replace(Charge.of(row), over=row.etag) if row is not None else None

    async def _raise(self, charge: Charge) -> bool:
        """Write a raise on the row it was made on (``over``): True if it is in the row (now or
        before); False if the row changed first."""
        try:
            if charge.over is None:
                await self.store.insert(USAGE_TABLE, charge.entity())
            else:
                await self.store.replace(USAGE_TABLE, charge.entity(), etag=charge.over)
            return True
        except NotFound:  # the row it was made on is gone: inserted
            return await self._raise(replace(charge, over=None))
        except (AlreadyExists, Modified):
            there = await self.find(charge)
            return there is None or charge.ops.split()[-1] in there.ops.split()

    # --- reading ----------------------------------------------------------------------------

    async def usage(
        self,
        start: date,
        end: date,
        caller_id: str | None = None,
        team: str | None = None,
        model: str | None = None,
        team_id: str | None = None,
    ) -> list[dict[str, Any]]:
        """Tokens, requests (with how they ended) and cost by caller, team, model and UTC day, over
        ``start`` to ``end`` inclusive, optionally of one caller (by id), team (by id; by name: the
        rows of deleted teams of that name) or model."""
        equal: dict[str, Any] = {}
        if team_id is not None:
            equal["team_id"] = team_id
        elif team is not None:
            equal["team"] = team
        if model is not None:
            equal["model"] = model
        where = Where(
            partition=f"u:{caller_id}" if caller_id is not None else None,
            rows_from=f"{start:%Y%m%d}",
            rows_to="99999999~" if end >= date.max else f"{end + timedelta(days=1):%Y%m%d}",
            equal=equal,
            select=("caller", "caller_id", "team", "model", *SUMMED, "cost", "ended"),
        )
        return summarize(await self.store.query(USAGE_TABLE, where, timeout=USAGE_TIMEOUT))

    async def sweep(self, keep_days: int, now: float, limit: int = 1000) -> int:
        """Delete at most ``limit`` charges older than ``keep_days`` days; the number deleted."""
        cutoff = datetime.fromtimestamp(now, UTC).date() - timedelta(days=keep_days)
        old = await self.store.query(
            USAGE_TABLE, Where(rows_to=f"{cutoff:%Y%m%d}", select=(), limit=limit), timeout=USAGE_TIMEOUT
        )
        deleted = 0
        for chunk in _transactions((row["PartitionKey"], row) for row in old):
            ops = [Op("delete", {"PartitionKey": r["PartitionKey"], "RowKey": r["RowKey"]}) for r in chunk]
            await self.store.batch(USAGE_TABLE, ops, timeout=USAGE_TIMEOUT)
            deleted += len(chunk)
        return deleted


def _transactions(keyed: Iterable[tuple[str, Any]]) -> list[list[Any]]:
    """Items of (partition, item) as the store's transactions take them: one partition, at most 100
    items each (``store.check_batch``)."""
    by_partition: dict[str, list[Any]] = {}
    for partition, item in keyed:
        by_partition.setdefault(partition, []).append(item)
    return [items[at : at + 100] for items in by_partition.values() for at in range(0, len(items), 100)]


def summarize(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    sums: dict[tuple[str, ...], dict[str, Any]] = {}
    for row in rows:
        day = str(row["RowKey"])[:8]
        key = (f"{day[:4]}-{day[4:6]}-{day[6:]}", *(str(row.get(name) or "") for name in ("caller", "team", "model")))
        if key not in sums:
            names = {"day": key[0], "caller": key[1], "team": key[2] or None, "model": key[3]}
            sums[key] = names | dict.fromkeys(ZEROS, 0) | {"ended": {}}
        entry = sums[key]
        for name in SUMMED:
            entry[name] += int(row.get(name) or 0)
        entry["total_tokens"] = entry["prompt_tokens"] + entry["completion_tokens"]
        entry["requests"] += 1
        cost = row.get("cost")
        if cost is None:
            entry["unpriced_requests"] += 1
        else:
            entry["cost_picousd"] += int(cost)
        ended = str(row.get("ended") or "unknown")
        entry["ended"][ended] = entry["ended"].get(ended, 0) + 1
    return [sums[key] | {"cost_usd": usd(sums[key]["cost_picousd"])} for key in sorted(sums)]
