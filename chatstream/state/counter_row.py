"""A limit's counter row in ``chatstreamLimits``, as stored: PartitionKey the caller's or team's
``limits_partition``, RowKey ``rpm``, ``tpm``, ``tokens``, ``spend``, ``rpm@<model>`` or
``tpm@<model>``; ``window`` (the minute, ``d20261201``, ``m202612`` or ``total``), ``taken`` (what of
that window is out: spent, or held by instances) and ``holds``: each instance's ``Holding``,
``<instance>=<held>/<applied>/<exchange>/<idle>`` (older rows' ``limit`` column is ignored, and gone
after their next write). A row whose window is older than now counts as empty: rows are reused, never
piled up. Everything reads and writes it through this module.

**What a later version may add.** A ``holds`` item that is not a holding of that form (``op:x=...``,
``x=1/2/3/4/5``) and any other column (a str, int, float or bool, as the store writes them) are
another version's: every write of the row keeps them verbatim, whatever the window (a new window's
first write too), and this version never counts them in ``taken`` or takes them for an instance's
share; their writer owns their lifetime. So an item a later version adds must not parse as a holding."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, NamedTuple

from ..errors import AlreadyExists, Modified, NotFound
from .store import LIMITS_TABLE, Row, Store, Where

WINDOW_SECONDS = 60
MAX_ATTEMPTS = 50  # conflicting writes one change of a row retries (each after a fresh read)
Period = str  # "minute", "day", "month", "total"
_OWN = {"PartitionKey", "RowKey", "window", "taken", "holds", "limit"}  # this version's columns, and the retired one


class CounterKey(NamedTuple):
    """A counter's row, wherever a counter is named; the journal stores it as ``"partition/row"``
    (``str``, read back by ``parse``: a partition has no ``/``, store.key_part)."""

    partition: str
    row: str

    def __str__(self) -> str:
        return f"{self.partition}/{self.row}"

    @classmethod
    def parse(cls, text: str) -> CounterKey:
        partition, _, row = text.partition("/")
        return cls(partition, row)


def window_of(period: Period, now: float) -> str:
    if period == "minute":
        return f"{int(now // WINDOW_SECONDS):010d}"
    if period == "day":
        return "d" + day_of(now)
    if period == "month":
        return datetime.fromtimestamp(now, UTC).strftime("m%Y%m")
    return "total"


def day_of(seconds: float) -> str:
    """The UTC day of ``seconds`` since 1970 (``YYYYMMDD``): a day window's, and a request's ledger
    day (its reservation's day window); made once a day, not per request. As datetime has it (the
    month window's): it rounds to the microsecond, so the last floats before midnight are the next day."""
    days = int(seconds // 86400)
    if seconds - days * 86400 > 86400 - 1e-6:
        return datetime.fromtimestamp(seconds, UTC).strftime("%Y%m%d")
    return _day(days)


@functools.lru_cache(maxsize=4)
def _day(days: int) -> str:
    return datetime.fromtimestamp(days * 86400, UTC).strftime("%Y%m%d")


def seconds_to_next_minute(now: float) -> float:
    return WINDOW_SECONDS - (now % WINDOW_SECONDS)


def newer(a: str | None, b: str | None) -> bool:
    """Whether window ``a`` comes after window ``b`` (windows of one kind compare as strings)."""
    return a is not None and b is not None and len(a) == len(b) and a[:1] == b[:1] and a > b


@dataclass(frozen=True)
class Holding:
    """One instance's part of a counter row: what it holds, the last charge of it applied, its last
    exchange's number, and of ``held`` what it keeps idle for a next request (its spare)."""

    held: int = 0
    applied: int = 0
    exchange: int = 0
    idle: int = 0


def _holding(item: str) -> tuple[str, Holding] | None:
    name, _, values = item.partition("=")
    parts = values.split("/")
    if name and len(parts) in (3, 4) and all(p.lstrip("-").isdigit() for p in parts):
        return name, Holding(*(int(p) for p in parts))
    return None


def _split_holds(text: str | None) -> tuple[dict[str, Holding], tuple[str, ...]]:
    """The holdings of a ``holds`` text, and the items that are not (a later version's), each item parsed once."""
    holdings: dict[str, Holding] = {}
    foreign: list[str] = []
    for item in (text or "").split():
        if (holding := _holding(item)) is None:
            foreign.append(item)
        else:
            holdings[holding[0]] = holding[1]
    return holdings, tuple(foreign)


def parse_holds(text: str | None) -> dict[str, Holding]:
    return _split_holds(text)[0]


@dataclass(frozen=True)
class CounterRow:
    """A counter row as read or written (``etag`` None: not there)."""

    etag: str | None = None
    window: str | None = None
    taken: int = 0
    holds: Mapping[str, Holding] = field(default_factory=dict)
    foreign: tuple[str, ...] = ()  # a later version's holds items (module docstring), kept verbatim
    columns: Mapping[str, Any] = field(default_factory=dict)  # ...and its columns

    @classmethod
    def of(cls, row: Row | None) -> CounterRow:
        if row is None:
            return cls()
        holds, foreign = _split_holds(row.get("holds"))
        columns = {name: value for name, value in row.items() if name not in _OWN}
        return cls(row.etag, row.get("window"), int(row.get("taken") or 0), holds, foreign, columns)

    def counts_in(self, window: str | None) -> bool:
        """Whether the row is there and is ``window``'s (else it counts as empty)."""
        return self.etag is not None and self.window == window

    def taken_in(self, window: str | None) -> int:
        return self.taken if self.counts_in(window) else 0


async def read(store: Store, partition: str, key: str, bound: float) -> CounterRow:
    """The row (the store call bounded by ``bound`` seconds)."""
    return CounterRow.of(await store.get(LIMITS_TABLE, partition, key, timeout=bound))


async def write(store: Store, partition: str, key: str, row: CounterRow, bound: float) -> CounterRow | None:
    """Write ``row`` conditioned on its ETag, the row's it was made on (None: an insert): the row as
    written, or None when the condition failed (the row changed, or was inserted or deleted, since)."""
    holdings = [f"{name}={h.held}/{h.applied}/{h.exchange}/{h.idle}" for name, h in sorted(row.holds.items())]
    entity = {
        **row.columns,
        "PartitionKey": partition,
        "RowKey": key,
        "window": row.window,
        "taken": row.taken,
        "holds": " ".join([*holdings, *row.foreign]),
    }
    try:
        if row.etag is None:
            etag = await store.insert(LIMITS_TABLE, entity, timeout=bound)
        else:
            etag = await store.replace(LIMITS_TABLE, entity, etag=row.etag, timeout=bound)
    except (Modified, AlreadyExists, NotFound):
        return None
    return replace(row, etag=etag)


async def taken_this_period(
    store: Store, key: str, periods: Mapping[str, Period], now: float, bound: float
) -> dict[str, int]:
    """What the ``key`` counter (``tokens``, ``spend``) of each partition in ``periods`` has taken in
    its period's current window (no row, or an older window's: 0), read in one query."""
    rows = await store.query(LIMITS_TABLE, Where(rows_from=key, rows_to=key + "!"), timeout=bound)
    found = {row["PartitionKey"]: CounterRow.of(row) for row in rows}
    return {p: found.get(p, CounterRow()).taken_in(window_of(period, now)) for p, period in periods.items()}


async def forget(store: Store, partition: str, bound: float) -> None:
    """Delete every counter row of ``partition`` (a deleted caller's or team's)."""
    for row in await store.query(LIMITS_TABLE, Where(partition=partition, select=()), timeout=bound):
        await store.delete(LIMITS_TABLE, partition, row["RowKey"], timeout=bound)
