"""The capacity one instance holds of one counter (a caller's tpm, rpm or budget) and its single
flight to the store: the mechanism behind quota.py (docs/callers.md, "Capacity leases")."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from datetime import UTC, datetime
from typing import Protocol

from azure.core import MatchConditions
from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError
from azure.data.tables import EdmType, EntityProperty, UpdateMode

from ..errors import ApiError
from .calls import StoreDown, bounded, store_unavailable
from .legacy_store import LIMITS_TABLE, Store

log = logging.getLogger("chatstream")

WINDOW_SECONDS = 60
MAX_ATTEMPTS = 50  # conflicting writes one exchange retries (each after a fresh read) within its bound
# A lone request (no other waiting) takes one more request's worth for the next one, and the instance
# keeps what it holds this long before giving it back, so that sequential traffic does not pay a store
# write per request. Bounded: at most HOLD_SHARE of the limit, for HOLD_SECONDS, minute windows only
# (a budget's capacity held by an instance that dies would stay lost until the period ends).
HOLD_SECONDS = 1.0
HOLD_SHARE = 0.1


class LeaseOwner(Protocol):
    """What a lease needs from its instance's Quota: the store, the clock, and its store-call counts."""

    store: Store
    instance_id: str
    reads: int
    writes: int
    conflicts: int

    def clock(self) -> float: ...


def _newer(a: str | None, b: str | None) -> bool:
    """Whether window ``a`` comes after window ``b`` (windows of one kind compare as strings)."""
    return a is not None and b is not None and len(a) == len(b) and a[:1] == b[:1] and a > b


def window_of(kind: str, now: float, period: str = "total") -> str:
    if kind != "budget":
        return f"{int(now // WINDOW_SECONDS):010d}"
    if period == "day":
        return datetime.fromtimestamp(now, UTC).strftime("d%Y%m%d")
    if period == "month":
        return datetime.fromtimestamp(now, UTC).strftime("m%Y%m")
    return "total"


class Refused(Exception):
    def __init__(self, lease: Lease):
        super().__init__(lease.kind)
        self.lease = lease


class Waiter:
    __slots__ = ("future", "need")

    def __init__(self, need: int, future: asyncio.Future):
        self.need = need
        self.future = future


class Lease:
    """One counter (a caller's tpm, rpm or budget) as this instance holds it."""

    def __init__(self, quota: LeaseOwner, partition: str, kind: str):
        self.quota = quota
        self.partition = partition
        self.kind = kind
        self.limit = 0
        self.period = "total"  # the budget's (day, month, total)
        self.window: str | None = None
        self.balance = 0  # granted to this instance, not assigned to any reservation
        self.debt = 0  # charged beyond what was reserved, not yet added to the row
        self.waiters: deque[Waiter] = deque()
        self.flight: asyncio.Task | None = None
        self.retry: asyncio.TimerHandle | None = None
        self.backoff = 1.0
        self.hold_until = 0.0  # the balance is kept, not given back, until then
        self.hold_timer: asyncio.TimerHandle | None = None
        # The row as this instance last read or wrote it.
        self.known = False
        self.exists = False
        self.row_window: str | None = None
        self.row_taken = 0
        self.etag: str | None = None

    # --- what reservations do ----------------------------------------------------------------

    def advance(self, window: str | None) -> None:
        """Move to ``window`` unless the lease is already there or later: what was held belonged to
        the window that ended."""
        if window is not None and self.window != window and not _newer(self.window, window):
            self.window = window
            self.balance = 0
            self.debt = 0

    async def acquire(self, need: int, window: str) -> str:
        """``need`` units of this counter; the window they were granted in. Raises ``Refused`` when
        the limit leaves no room, an ApiError 503 when the store does not answer."""
        self.advance(window)
        if not self.waiters and self.balance >= need:
            self.balance -= need
            assert self.window is not None  # advance() just set it
            return self.window
        waiter = Waiter(need, asyncio.get_running_loop().create_future())
        self.waiters.append(waiter)
        self.kick()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.give_back(need, future.result())  # granted just as the reservation gave up
            raise

    def give_back(self, amount: int, window: str | None) -> None:
        if amount > 0 and window == self.window:  # a window that is over needs nothing back
            self.balance += amount
            self.kick()

    def charge_extra(self, amount: int, window: str | None) -> None:
        if amount > 0 and window == self.window:
            used = min(self.balance, amount)
            self.balance -= used
            self.debt += amount - used
            if self.debt:
                self.kick()

    def remaining(self) -> int:
        taken = self.row_taken if self.exists and self.row_window == self.window else 0
        return max(0, self.limit - taken) + self.balance

    # --- the single flight ------------------------------------------------------------------

    def kick(self) -> None:
        if self.flight is None:
            self.flight = asyncio.ensure_future(self._run())

    def _pending(self) -> list[Waiter]:
        return [w for w in self.waiters if not w.future.done()]

    def _serve_from_balance(self) -> None:
        if not self.balance or not self.waiters:
            return
        keep: deque[Waiter] = deque()
        for waiter in self.waiters:
            if waiter.future.done():
                continue
            if waiter.need <= self.balance:
                self.balance -= waiter.need
                waiter.future.set_result(self.window)
            else:
                keep.append(waiter)
        self.waiters = keep

    def _has_work(self) -> bool:
        holding = asyncio.get_running_loop().time() < self.hold_until
        return bool(self._pending()) or self.debt > 0 or (self.balance > 0 and not holding)

    def _hold(self) -> None:
        """Keep the balance for HOLD_SECONDS, then give it back (a timer kicks the flight)."""
        self.hold_until = asyncio.get_running_loop().time() + HOLD_SECONDS
        if self.hold_timer is None:
            self.hold_timer = asyncio.get_running_loop().call_later(HOLD_SECONDS + 0.01, self._hold_over)

    def _hold_over(self) -> None:
        self.hold_timer = None
        left = self.hold_until - asyncio.get_running_loop().time()
        if left > 0:
            self.hold_timer = asyncio.get_running_loop().call_later(left + 0.01, self._hold_over)
        elif self.balance:
            self.kick()

    async def _run(self) -> None:
        try:
            while True:
                self._serve_from_balance()
                if not self._has_work():
                    return
                try:
                    await bounded(self._exchange())
                    self.backoff = 1.0
                except StoreDown as exc:
                    self.known = False
                    self._fail(store_unavailable())
                    if self.balance or self.debt:
                        self._retry_later()
                    log.warning("caller limits: a %s counter exchange failed: %s", self.kind, exc)
                    return
        finally:
            self.flight = None

    def _fail(self, error: ApiError) -> None:
        for waiter in self.waiters:
            if not waiter.future.done():
                waiter.future.set_exception(error)
        self.waiters.clear()

    def _retry_later(self) -> None:
        if self.retry is None:

            def again() -> None:
                self.retry = None
                if self.flight is None and self._has_work():
                    self.kick()

            self.retry = asyncio.get_running_loop().call_later(self.backoff, again)
            self.backoff = min(self.backoff * 2, 30.0)

    async def _exchange(self) -> None:
        """One grant/return: read if needed, compute, one conditional write; a conflict re-reads."""
        self.advance(window_of(self.kind, self.quota.clock(), self.period))
        fresh = False
        for _ in range(MAX_ATTEMPTS):
            if not self.known:
                await self._read()
                fresh = True
            if self.exists and _newer(self.row_window, self.window):
                self.advance(self.row_window)  # another instance's clock is a little ahead: follow it
            current = self.row_taken if self.exists and self.row_window == self.window else 0
            window, balance, debt = self.window, self.balance, self.debt
            waiters = self._pending()
            room = max(0, self.limit - current) + balance
            chosen, total = _fitting(waiters, room)
            if len(chosen) < len(waiters) and not fresh:
                self.known = False  # refuse only on what the store says now
                continue
            extra = 0
            if self.kind != "budget" and len(waiters) == 1 and chosen:  # a lone request: one more for the next
                extra = max(0, min(chosen[0].need, int(self.limit * HOLD_SHARE), room - total))
            taken = max(0, current + total + extra - balance + debt)
            # The balance and debt this write settles leave the lease while it is in flight, so that
            # nothing serves a reservation from capacity that is on its way back to the store.
            self.balance -= balance
            self.debt -= debt
            try:
                if taken != current:
                    await self._write(taken, window)
            except (ResourceModifiedError, ResourceExistsError, ResourceNotFoundError):
                self._restore(window, balance, debt)
                self.quota.conflicts += 1
                self.known = False
                continue
            except BaseException:  # the bound ran out, or the store failed: nothing was settled
                self._restore(window, balance, debt)
                raise
            if extra and self.window == window:
                self.balance += extra
                self._hold()
            self._answer(waiters, chosen, window)
            return
        raise StoreDown("the counter kept changing under this instance")

    def _answer(self, waiters: list[Waiter], chosen: list[Waiter], window: str | None) -> None:
        """After the write: the chosen waiters are admitted in ``window``, the others refused."""
        picked = {id(w) for w in chosen}
        for waiter in chosen:
            if waiter.future.done():  # it gave up meanwhile: its share comes back
                self.give_back(waiter.need, window)
            else:
                waiter.future.set_result(window)
        for waiter in waiters:
            if id(waiter) not in picked and not waiter.future.done():
                waiter.future.set_exception(Refused(self))
        handled = {id(w) for w in waiters}
        self.waiters = deque(w for w in self.waiters if id(w) not in handled and not w.future.done())

    def _restore(self, window: str | None, balance: int, debt: int) -> None:
        if self.window == window:
            self.balance += balance
            self.debt += debt

    async def _table(self):
        return await self.quota.store.table(LIMITS_TABLE)

    async def _read(self) -> None:
        table = await self._table()
        self.quota.reads += 1
        try:
            row = await table.get_entity(self.partition, self.kind)
        except ResourceNotFoundError:
            self.exists, self.row_window, self.row_taken, self.etag = False, None, 0, None
        else:
            taken = row.get("taken", 0)
            self.exists, self.row_window, self.etag = True, row.get("window"), row.metadata["etag"]
            self.row_taken = int(taken.value if isinstance(taken, EntityProperty) else taken)
        self.known = True

    async def _write(self, taken: int, window: str | None) -> None:
        table = await self._table()
        entity = {
            "PartitionKey": self.partition,
            "RowKey": self.kind,
            "window": window,
            "taken": EntityProperty(taken, EdmType.INT64),
            "limit": EntityProperty(self.limit, EdmType.INT64),
            "by": self.quota.instance_id,
        }
        self.quota.writes += 1
        if self.exists:
            answer = await table.update_entity(
                entity, mode=UpdateMode.REPLACE, etag=self.etag, match_condition=MatchConditions.IfNotModified
            )
        else:
            answer = await table.create_entity(entity)
        self.exists, self.row_window, self.row_taken, self.etag = True, window, taken, answer["etag"]

    def idle(self) -> bool:
        return self.flight is None and not self.waiters and not self.balance and not self.debt


def _fitting(waiters: list[Waiter], room: int) -> tuple[list[Waiter], int]:
    """The waiters that fit in ``room``, in order (a large one does not block smaller ones behind it)."""
    chosen: list[Waiter] = []
    total = 0
    for waiter in waiters:
        if total + waiter.need <= room:
            chosen.append(waiter)
            total += waiter.need
    return chosen, total
