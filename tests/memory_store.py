"""An in-process ``Store`` (store.py) for unit tests: the same answers as Table storage and Blob
storage give for everything the app asks (tests/store_contract.py runs one suite against this and
against Azurite), in memory, in microseconds.

Several ``MemoryStore`` objects may share one ``MemoryData``: one per simulated instance, each with
its own clock. And the failures a real store has can be put on it (``inject``): an answer lost after
the write was applied (the store timed out on us but did the work), a store that refuses, a slow
one, and ``freeze``, which is what SIGSTOP does to Azurite: calls wait, time out, and those still
queued are applied when it thaws."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from chatstream.errors import AlreadyExists, Modified, NotFound, StoreTimeout, StoreUnavailable
from chatstream.state.store import (
    CALL_TIMEOUT,
    NEW,
    Op,
    Row,
    StoreClock,
    Where,
    check_batch,
)

# ``not_found``: the store answers 404 for the table itself (one deleted under the app, before the
# edge re-creates it): an error that is not an outage, which no background loop may die of.
FaultMode = Literal["lose_answer", "unavailable", "slow", "not_found"]


@dataclass
class Fault:
    """A failure of the next ``times`` calls of the named ``ops`` (all when empty) on ``table``
    (any when None; blob calls have the table ``"blob"``)."""

    mode: FaultMode
    ops: frozenset[str] = frozenset()
    table: str | None = None
    times: int = 1
    delay: float = 0.0

    def applies(self, op: str, table: str) -> bool:
        return self.times > 0 and (not self.ops or op in self.ops) and self.table in (None, table)


@dataclass
class MemoryData:
    """What one simulated storage account holds: tables of partitions of rows, and blobs."""

    tables: dict[str, dict[str, dict[str, tuple[dict[str, Any], str]]]] = field(default_factory=dict)
    blobs: dict[str, tuple[bytearray, str, str]] = field(default_factory=dict)  # name -> (data, etag, kind)
    version: int = 0
    frozen: asyncio.Event | None = None  # set: running; cleared: frozen (see MemoryStore.freeze)
    queued: list[Callable[[], None]] = field(default_factory=list)  # writes to apply at thaw
    calls: dict[str, int] = field(default_factory=dict)
    wall: Callable[[], float] = time.time  # the store's own clock: its answers carry it (a Date)

    def etag(self) -> str:
        self.version += 1
        return f'W/"{self.version}"'


class MemoryStore:
    """The store in this process (module docstring)."""

    def __init__(self, data: MemoryData | None = None, clock: StoreClock | None = None):
        self.data = data if data is not None else MemoryData()
        self.clock = clock or StoreClock()
        self.faults: list[Fault] = []

    # --- failures ---------------------------------------------------------------------------

    def inject(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def freeze(self) -> None:
        """Calls wait from now on (a stopped store): one that times out raises StoreTimeout, and its
        write, if it was one, is applied when the store thaws, as a stopped server does."""
        if self.data.frozen is None:
            self.data.frozen = asyncio.Event()
        self.data.frozen.clear()

    def thaw(self) -> None:
        queued, self.data.queued = self.data.queued, []
        for apply in queued:
            apply()
        if self.data.frozen is not None:
            self.data.frozen.set()

    async def _call(self, op: str, table: str, timeout: float, work: Callable[[], Any], write: bool) -> Any:
        """Run ``work`` as the store would: after any failure put on it, within ``timeout``."""
        self.data.calls[op] = self.data.calls.get(op, 0) + 1
        await asyncio.sleep(0)  # a store call is never synchronous: let others run, as a real one does
        fault = next((f for f in self.faults if f.applies(op, table)), None)
        if fault is not None:
            fault.times -= 1
            if fault.mode == "unavailable":
                self.clock.failed()
                raise StoreUnavailable("the store failed (injected)")
            if fault.mode == "not_found":
                raise NotFound("the table is not there (injected)")
            if fault.mode == "lose_answer":
                work()
                self.clock.failed()
                raise StoreTimeout("the store did not answer in time (injected, applied)")
            await asyncio.sleep(min(fault.delay, timeout))
            if fault.delay > timeout:
                if write:
                    work()
                self.clock.failed()
                raise StoreTimeout("the store did not answer in time (injected, slow)")
        frozen = self.data.frozen
        if frozen is not None and not frozen.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await frozen.wait()
            except TimeoutError:
                if write:
                    self.data.queued.append(lambda: _quietly(work))
                self.clock.failed()
                raise StoreTimeout("the store did not answer in time (frozen)") from None
        try:
            self.clock.took(0.0)
            return work()
        finally:
            # An answer, with its Date, to the microsecond (Azure's has whole seconds): unit tests run
            # with leases of a fraction of a second. StoreClock's own tests cover whole seconds.
            self.clock.observe(self.data.wall())

    # --- tables ------------------------------------------------------------------------------

    def _partition(self, table: str, partition: str) -> dict[str, tuple[dict[str, Any], str]]:
        return self.data.tables.setdefault(table, {}).setdefault(partition, {})

    async def get(
        self,
        table: str,
        partition: str,
        row: str,
        *,
        select: Sequence[str] | None = None,
        timeout: float = CALL_TIMEOUT,
    ) -> Row | None:
        def work() -> Row | None:
            found = self._partition(table, partition).get(row)
            if found is None:
                return None
            values, etag = found
            return Row.of(_select(values, select), etag)

        return await self._call("get", table, timeout, work, write=False)

    async def insert(self, table: str, entity: Mapping[str, Any], *, timeout: float = CALL_TIMEOUT) -> str:
        values = stored(Op("insert", entity))
        return await self._call("insert", table, timeout, lambda: self._write(table, "insert", values, None), True)

    async def replace(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> str:
        values = stored(Op("replace", entity, etag))
        return await self._call("replace", table, timeout, lambda: self._write(table, "replace", values, etag), True)

    async def merge(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> str:
        values = stored(Op("merge", entity, etag))
        return await self._call("merge", table, timeout, lambda: self._write(table, "merge", values, etag), True)

    async def upsert(self, table: str, entity: Mapping[str, Any], *, timeout: float = CALL_TIMEOUT) -> str:
        values = stored(Op("upsert", entity))
        return await self._call("upsert", table, timeout, lambda: self._write(table, "upsert", values, None), True)

    async def delete(
        self, table: str, partition: str, row: str, *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> None:
        keys = stored(Op("delete", {"PartitionKey": partition, "RowKey": row}, etag))
        await self._call("delete", table, timeout, lambda: self._write(table, "delete", keys, etag), True)

    def _check(self, table: str, kind: str, values: Mapping[str, Any], etag: str | None) -> None:
        rows = self._partition(table, values["PartitionKey"])
        found = rows.get(values["RowKey"])
        if kind == "insert" and found is not None:
            raise AlreadyExists("the row exists")
        if kind == "delete" and found is None:
            return  # a delete of a row that is not there is quiet, as the service's SDK makes it
        if kind in ("replace", "merge", "delete"):  # the row must be there (If-Match: * without an etag)
            if found is None:
                raise NotFound("no such row")
            if etag is not None and found[1] != etag:
                raise Modified("the row changed")

    def _apply(self, table: str, kind: str, values: Mapping[str, Any]) -> str | None:
        rows = self._partition(table, values["PartitionKey"])
        key = values["RowKey"]
        if kind == "delete":
            rows.pop(key, None)
            return None
        merged = dict(values)
        if kind == "merge" and key in rows:
            merged = {**rows[key][0], **values}
        etag = self.data.etag()
        rows[key] = (merged, etag)
        return etag

    def _write(self, table: str, kind: str, values: Mapping[str, Any], etag: str | None) -> str | None:
        self._check(table, kind, values, etag)
        return self._apply(table, kind, values)

    async def query(self, table: str, where: Where, *, timeout: float = CALL_TIMEOUT) -> list[Row]:
        def work() -> list[Row]:
            partitions = self.data.tables.get(table, {})
            names = [where.partition] if where.partition is not None else sorted(partitions)
            found: list[Row] = []
            for name in names:
                rows = partitions.get(name, {})
                for key in sorted(rows):
                    values, etag = rows[key]
                    if matches(where, values):
                        found.append(Row.of(_select(values, where.select), etag))
                        if where.limit is not None and len(found) >= where.limit:
                            return found
            return found

        return await self._call("query", table, timeout, work, write=False)

    async def batch(self, table: str, ops: Sequence[Op], *, timeout: float = CALL_TIMEOUT) -> None:
        check_batch(ops)
        prepared = [(op.kind, stored(op), op.etag) for op in ops]

        def work() -> None:
            for index, (kind, values, etag) in enumerate(prepared):  # all or nothing
                try:
                    if kind == "delete" and values["RowKey"] not in self._partition(table, values["PartitionKey"]):
                        raise NotFound("no such row")  # quiet alone; in a transaction, Table storage refuses it
                    self._check(table, kind, values, etag)
                except (AlreadyExists, Modified, NotFound) as error:
                    error.index = index
                    raise error from None
            for kind, values, _ in prepared:
                self._apply(table, kind, values)

        await self._call("batch", table, timeout, work, write=True)

    # --- blobs ----------------------------------------------------------------------------------

    async def append_create(self, name: str, *, timeout: float = CALL_TIMEOUT) -> None:
        def work() -> None:
            if name in self.data.blobs:
                raise AlreadyExists("the blob exists")
            self.data.blobs[name] = (bytearray(), self.data.etag(), "append")

        await self._call("append_create", "blob", timeout, work, write=True)

    async def append(self, name: str, data: bytes, *, at: int, timeout: float = CALL_TIMEOUT) -> int:
        chunk = bytes(data)

        def work() -> int:
            found = self.data.blobs.get(name)
            if found is None:
                raise NotFound("no such blob")
            content, _, kind = found
            if kind != "append":
                raise Modified("not an append blob")
            if len(content) != at:
                raise Modified("the blob is not at the expected length")
            content.extend(chunk)
            self.data.blobs[name] = (content, self.data.etag(), kind)
            return len(content)

        return await self._call("append", "blob", timeout, work, write=True)

    async def read(self, name: str, offset: int = 0, *, timeout: float = CALL_TIMEOUT) -> bytes:
        def work() -> bytes:
            found = self.data.blobs.get(name)
            return bytes(found[0][offset:]) if found is not None else b""

        return await self._call("read", "blob", timeout, work, write=False)

    async def put(self, name: str, data: bytes, *, etag: str | None = None, timeout: float = CALL_TIMEOUT) -> str:
        content = bytes(data)

        def work() -> str:
            found = self.data.blobs.get(name)
            if etag == NEW and found is not None:
                raise Modified("the blob exists")
            if etag not in (None, NEW) and (found is None or found[1] != etag):
                raise Modified("the blob changed")
            new = self.data.etag()
            self.data.blobs[name] = (bytearray(content), new, "block")
            return new

        return await self._call("put", "blob", timeout, work, write=True)

    async def get_blob(self, name: str, *, timeout: float = CALL_TIMEOUT) -> tuple[bytes, str] | None:
        def work() -> tuple[bytes, str] | None:
            found = self.data.blobs.get(name)
            return (bytes(found[0]), found[1]) if found is not None else None

        return await self._call("get_blob", "blob", timeout, work, write=False)

    async def delete_blob(self, name: str, *, timeout: float = CALL_TIMEOUT) -> None:
        def work() -> None:
            self.data.blobs.pop(name, None)  # quiet when it is not there

        await self._call("delete_blob", "blob", timeout, work, write=True)

    async def close(self) -> None:
        return None


def stored(op: Op) -> dict[str, Any]:
    """What the store keeps of a (checked) write: no None values."""
    return {k: v for k, v in op.entity.items() if v is not None}


def _select(values: Mapping[str, Any], select: Sequence[str] | None) -> dict[str, Any]:
    if select is None:
        return dict(values)
    keep = {"PartitionKey", "RowKey", *select}
    return {k: v for k, v in values.items() if k in keep}


def _quietly(work: Callable[[], Any]) -> None:
    # A queued write whose condition no longer holds is refused, as the real store would refuse it.
    with contextlib.suppress(AlreadyExists, Modified, NotFound):
        work()


def matches(where: Where, row: Mapping[str, Any]) -> bool:
    """Whether ``row`` is one ``where`` answers (what the service's filter does)."""
    key = row["RowKey"]
    if where.partition is not None and row["PartitionKey"] != where.partition:
        return False
    if where.rows_from is not None and key < where.rows_from:
        return False
    if where.rows_to is not None and key >= where.rows_to:
        return False
    if any(row.get(name) != value for name, value in where.equal.items()):
        return False
    return all(name in row and row[name] < value for name, value in where.less.items())
