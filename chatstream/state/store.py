"""The store's edge: what every part of the shared state asks of Azure Tables and Blobs (``Store``),
with its rows, queries and operations. It imports no backend: the Function App's storage account
implements it (store_azure.py; Azurite locally), and so does the unit tests' in-process store
(tests/memory_store.py). One contract suite runs on both (tests/store_contract.py), so a unit test
on memory means what it says on Azurite.

Every call is bounded in time (``timeout``, default ``CALL_TIMEOUT``) and raises only the store's
own errors (errors.py: ``StoreError`` and its family). What a call answers:

- rows: ``get`` a row or None; ``insert`` (AlreadyExists), ``replace`` and ``merge`` (the row must
  exist: NotFound; with an ETag: Modified when it changed), ``upsert``, ``delete`` (quiet when the
  row is not there; with an ETag: Modified when it changed), ``query`` (a partition and a RowKey
  range, property conditions, a bound on the rows), ``batch`` (one partition, all or nothing: the
  failing operation's error, with its ``index``; a delete of a row that is not there fails it);
- blobs, in the app's one container: an append blob made once (``append_create``) and appended to
  at an expected length (``append``: Modified when the blob is not that long: the fence of a stream's
  single writer), read from an offset (``read``), and whole blobs written under a condition
  (``put``/``get_blob``: an instance's journal); ``delete_blob`` is quiet when it is not there.

The store also keeps the time (``clock``): what crosses instances (windows, expiries, the age of a
stream) is decided on the store's clock, not on two machines' wall clocks. And every write (``Op``)
is checked against Table storage's limits, by both backends (``check_entity``)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import quote

# The tables and the container the app keeps its state in (infra/ creates them and scopes the app
# identity's roles to them; on Azurite the app creates them).
CALLERS_TABLE = "chatstreamCallers"
LIMITS_TABLE = "chatstreamLimits"
USAGE_TABLE = "chatstreamUsage"
RESPONSES_TABLE = "chatstreamResponses"
STREAMS_TABLE = "chatstreamStreams"
STREAMS_CONTAINER = "chatstream-streams"

# A call on the request path waits this long at most for the store (one retry included).
CALL_TIMEOUT = 1.8
# A call nobody waits on (a stream's storing), or one on a request's path while the store's answers
# are slow lately (StoreClock.patience): a busy store (Azurite on a loaded 2-core machine: 2-10 s, its
# fast answers in between) answers within this.
BUSY_TIMEOUT = 8.0
# ``put``'s etag for "only if the blob does not exist yet".
NEW = "*new"
# What the app writes to the store as JSON (rows' bodies, journals), compact and ASCII-escaped: one
# encoder (json.dumps with options makes one per call).
compact_json = json.JSONEncoder(separators=(",", ":")).encode
_BAD_KEY = re.compile(r"[/\\#?\x00-\x1f\x7f-\x9f]")


class Row(dict):
    """A row as the store answered it: its properties (keys included; numbers int or float), its ETag."""

    etag: str = ""

    @classmethod
    def of(cls, values: Mapping[str, Any], etag: str) -> Row:
        row = cls(values)
        row.etag = etag
        return row


@dataclass(frozen=True)
class Where:
    """A query: one partition (or every one), RowKeys in [``rows_from``, ``rows_to``), properties
    equal to / less than the given values, the properties to answer (``select``; the
    keys are always answered), at most ``limit`` rows (None: all, which a caller must bound)."""

    partition: str | None = None
    rows_from: str | None = None
    rows_to: str | None = None
    equal: Mapping[str, Any] = field(default_factory=dict)
    less: Mapping[str, Any] = field(default_factory=dict)
    select: tuple[str, ...] | None = None
    limit: int | None = None


OpKind = Literal["insert", "replace", "merge", "upsert", "delete"]


@dataclass(frozen=True)
class Op:
    """A write of a row, alone or in a ``batch``, checked when made (``check_entity``, a ValueError):
    ``replace``/``merge``/``delete`` under ``etag`` (None: any version; "", a row never read, is a
    bug: one store would send it as any version, another fail it); ``delete`` needs only the keys."""

    kind: OpKind
    entity: Mapping[str, Any]
    etag: str | None = None

    def __post_init__(self) -> None:
        check_entity(self.entity, keys_only=self.kind == "delete")
        if self.etag == "":
            raise ValueError("an empty ETag (None: any version)")


class StoreClock:
    """The store's time: the store's ``Date`` (whole seconds) as its answers arrive, carried on this
    process's monotonic clock. ``now()`` is seconds since 1970 by the store's clock, so instances
    whose own clocks disagree by any amount still agree on it within about a second. Before the
    first answer it is this machine's own clock (``wall``)."""

    def __init__(self, wall: Any = time.time, monotonic: Any = time.monotonic):
        self._monotonic = monotonic
        self._base = wall() - monotonic()  # store time = monotonic + base: once observed, the best sample
        self._best_at = 0.0  # when that sample was taken
        self.observed = False  # an answer of the store has set it
        self.answered_at = 0.0  # when the store last answered anything (this process's monotonic clock)
        self.failed_at = float("-inf")  # when a call last got no usable answer (same clock)
        self.latency = 0.0  # how long the store's answers take lately (seconds, a moving average)

    def now(self) -> float:
        return self._monotonic() + self._base

    def took(self, seconds: float) -> None:
        """A call was answered after ``seconds``: a busy store answers late, a stopped one not at all."""
        self.latency += 0.2 * (seconds - self.latency)

    def patience(self, bound: float = CALL_TIMEOUT) -> float:
        """How long a call on a request's path may wait: ``bound``, or ``BUSY_TIMEOUT`` while the
        store's answers are slow lately (a busy store is not a stopped one)."""
        return BUSY_TIMEOUT if self.latency > bound / 4 else bound

    def failed(self) -> None:
        self.failed_at = self._monotonic()

    def quiet_for(self) -> float:
        return self._monotonic() - self.failed_at

    def observe(self, date_seconds: float) -> None:
        """An answer said the store's clock read ``date_seconds`` (whole seconds, truncated) when it
        was sent: the store's time is at least that now. So every sample is at most the true offset,
        and the largest is the closest (a Date is up to a second behind, and the answer took its time
        to arrive). The largest of the last minute is kept, so a store clock that steps back is
        followed within a minute."""
        mono = self._monotonic()
        self.answered_at = mono
        sample = date_seconds - mono
        if not self.observed or sample >= self._base or mono - self._best_at > 60.0:
            self._base, self._best_at, self.observed = sample, mono, True


class Store(Protocol):
    clock: StoreClock

    async def get(
        self, table: str, partition: str, row: str, *, select: Sequence[str] | None = None, timeout: float = ...
    ) -> Row | None: ...
    async def insert(self, table: str, entity: Mapping[str, Any], *, timeout: float = ...) -> str: ...
    async def replace(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = ...
    ) -> str: ...
    async def merge(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = ...
    ) -> str: ...
    async def upsert(self, table: str, entity: Mapping[str, Any], *, timeout: float = ...) -> str: ...
    async def delete(
        self, table: str, partition: str, row: str, *, etag: str | None = None, timeout: float = ...
    ) -> None: ...
    async def query(self, table: str, where: Where, *, timeout: float = ...) -> list[Row]: ...
    async def batch(self, table: str, ops: Sequence[Op], *, timeout: float = ...) -> None: ...

    async def append_create(self, name: str, *, timeout: float = ...) -> None: ...
    async def append(self, name: str, data: bytes, *, at: int, timeout: float = ...) -> int: ...
    async def read(self, name: str, offset: int = 0, *, timeout: float = ...) -> bytes: ...
    async def put(self, name: str, data: bytes, *, etag: str | None = None, timeout: float = ...) -> str: ...
    async def get_blob(self, name: str, *, timeout: float = ...) -> tuple[bytes, str] | None: ...
    async def delete_blob(self, name: str, *, timeout: float = ...) -> None: ...

    async def close(self) -> None: ...


def check_key(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > 1024 or _BAD_KEY.search(value):
        raise ValueError(f"{name}: not a valid table key")


def check_entity(entity: Mapping[str, Any], keys_only: bool = False) -> None:
    """Table storage's limits (Azurite does not enforce them all), a ValueError for each: a string
    property of at most 32,768 UTF-16 code units, at most 252 properties of our own (besides the
    keys and Timestamp), an entity under 1 MiB, keys of at most 1 KiB without ``/ \\ # ?`` or
    control characters. None values are not stored (the store keeps no nulls): not counted. Breaking
    one is a bug of ours
    (https://learn.microsoft.com/rest/api/storageservices/understanding-the-table-service-data-model)."""
    check_key("PartitionKey", entity.get("PartitionKey"))
    check_key("RowKey", entity.get("RowKey"))
    if keys_only:
        return
    own = [k for k, v in entity.items() if v is not None and k not in ("PartitionKey", "RowKey")]
    if len(own) > 252:
        raise ValueError("an entity has at most 252 properties of our own")
    size = 0
    for name in own:
        value = entity[name]
        if not isinstance(name, str) or not name or len(name) > 255:
            raise ValueError("a property name is 1 to 255 characters")
        if isinstance(value, str):
            units = len(value) if value.isascii() else len(value.encode("utf-16-le", "surrogatepass")) // 2
            if units > 32 * 1024:
                raise ValueError(f"property {name!r} is over Table storage's 64 KiB ({units} UTF-16 units)")
            size += 2 * units
        elif isinstance(value, bool):
            size += 1
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"property {name!r} is outside Int64")
            size += 8
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"property {name!r} is not a finite number")
            size += 8
        else:
            raise ValueError(f"property {name!r} has a type the store does not keep ({type(value).__name__})")
        size += 2 * len(name)
    if size > 1024 * 1024 - 4096:
        raise ValueError("an entity is over Table storage's 1 MiB")


def key_part(text: str) -> str:
    """``text`` as part of a PartitionKey/RowKey: the characters the service refuses (``/ \\ # ?``,
    control characters), ``%`` and ``|`` (our separator) percent-encoded; a long one shortened with
    its hash, so that two texts never share a key."""
    encoded = quote(text, safe="-._~:;,=+!*()[]@$&' ")
    if len(encoded) > 200:
        encoded = encoded[:150] + "~" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return encoded


def check_batch(ops: Sequence[Op]) -> None:
    """A batch's operations: 1 to 100, one partition, each row once."""
    if not 1 <= len(ops) <= 100:
        raise ValueError("a batch has 1 to 100 operations")
    partitions = {op.entity.get("PartitionKey") for op in ops}
    rows = [op.entity.get("RowKey") for op in ops]
    if len(partitions) != 1 or len(set(rows)) != len(rows):
        raise ValueError("a batch is one partition, each row once")
