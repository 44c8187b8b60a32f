"""This process as one instance of the app in the shared store, and the others as it sees them: who
is alive, who died, and who does the work one instance does for all.

- **Alive.** From its first request until it stops, this instance beats: its row (table
  ``chatstreamStreams``, partition ``instances``) rewritten every ``beat_seconds`` with ``at``, the
  store's time (``StoreClock``: every instance reads the same clock). A row older than
  ``lease_seconds`` is a dead instance's.
- **Fenced.** An instance declared dead that was only slow finds its row gone (or taken) at its next
  beat: this incarnation is over (``fenced``: what it held was taken over); it beats on under a new id.
- **The duty.** One instance at a time, whichever takes the ``duty`` row when it is free, finds the
  dead instances (one query) and takes each over: its row taken, what it owed settled (``recover``:
  journal.py), its row deleted; and runs the periodic sweeps (``sweeps``). Every instance reads the
  duty row, one point read per ``duty_seconds``; the holder then rewrites it, under its ETag.

Every store call here is bounded; a failed one is tried again at the next tick, and no loop here
ends on an error (liveness would go with it): unexpected ones are logged."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from ..errors import AlreadyExists, Modified, NotFound, StoreError
from .store import STREAMS_TABLE, Store, Where

log = logging.getLogger("chatstream")

PARTITION = "instances"
DUTY = "~duty"  # sorts after every instance id (ids are [a-z0-9-])
Recover = Callable[[str, str], Awaitable[None]]  # (dead, taker)
Sweep = tuple[float, Callable[[], Awaitable[object]]]  # (seconds, sweep)


def new_instance_id() -> str:
    """A name for one incarnation of this process: readable in logs, unique across restarts."""
    host = "".join(c for c in socket.gethostname().lower() if c.isalnum() or c == "-")[:24] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class InstanceTiming:
    beat_seconds: float = 1.5
    lease_seconds: float = 4.5  # no beat for this long (by the store's clock): dead
    duty_seconds: float = 5.0  # the duty's tick: the holder's work, the others' look at the duty row
    fresh_seconds: float = 0.5  # one read of another instance's row serves every question for this long


class Instances:
    """This instance's heartbeat, its view of the others, and the duty (module docstring)."""

    def __init__(
        self,
        store: Store,
        timing: InstanceTiming | None = None,
        instance_id: str | None = None,
        recover: Recover | None = None,
        sweeps: Sequence[Sweep] = (),
    ):
        """``recover(dead, taker)``: the duty holder's settling of one dead instance (it may run again
        for the same one); each of ``sweeps`` runs about every ``seconds`` on the duty holder."""
        self.store = store
        self.timing = timing or InstanceTiming()
        self.id = instance_id or new_instance_id()
        self.fenced = asyncio.Event()  # set when an incarnation of this process was declared dead
        self._etag: str | None = None
        self._beating: asyncio.Task | None = None
        self._first: asyncio.Future | None = None
        self._duty: asyncio.Task | None = None
        self._recover = recover
        self._sweeps = [(seconds, sweep, [0.0]) for seconds, sweep in sweeps]
        self._rows: dict[str, tuple[float, asyncio.Future]] = {}
        self._closed = False

    async def _logged(self, what: str, step: Callable[[], Awaitable[object]]) -> bool:
        """Run ``step``, a failure logged, never raised (module docstring); False: the store did not answer."""
        try:
            await step()
        except StoreError as exc:
            log.warning("instance %s: %s failed: %s", self.id, what, exc)
            return False
        except Exception:
            log.exception("instance %s: %s failed", self.id, what)
        return True

    # --- being alive ---------------------------------------------------------------------------

    async def first_beat(self) -> None:
        """Wait (at most 2 s) until this instance's row is in the store: nobody elsewhere can see
        something of ours before they can see we are alive."""
        self.serve()
        if self._first is not None:
            await asyncio.wait([self._first], timeout=2.0)

    def serve(self) -> None:
        """This instance is serving (from its first request on): it beats, and takes its part in the duty."""
        if self._closed:
            return
        if self._beating is None or self._beating.done():
            self._first = asyncio.get_running_loop().create_future()
            self._beating = asyncio.ensure_future(self._beat_loop())
        if self._duty is None or self._duty.done():
            self._duty = asyncio.ensure_future(self._duty_loop())

    async def _beat_loop(self) -> None:
        timing = self.timing
        while not self._closed:
            try:
                answered = await self._logged("heartbeat", self._beat_once)
            finally:
                if self._first is not None and not self._first.done():
                    self._first.set_result(None)
            # A missed beat reads as death elsewhere: try again soon.
            await asyncio.sleep(timing.beat_seconds if answered else min(timing.beat_seconds, 0.25))

    async def _beat_once(self) -> None:
        lease = self.timing.lease_seconds
        row = {"PartitionKey": PARTITION, "RowKey": self.id, "at": self.store.clock.now(), "lease": lease}
        # The beat takes at most half a lease: a busy instance's calls are slow, and a missed lease
        # reads as death elsewhere.
        bound = lease / 2
        if self._etag is None:  # a new id's row (an earlier try of ours may have landed, its answer lost)
            self._etag = await self.store.upsert(STREAMS_TABLE, row, timeout=bound)
            return
        try:
            self._etag = await self.store.replace(STREAMS_TABLE, row, etag=self._etag, timeout=bound)
        except (NotFound, Modified):
            # Taken over, or only a beat of ours whose answer was lost landing late: the row says.
            current = await self.store.get(STREAMS_TABLE, PARTITION, self.id, timeout=bound)
            if current is None or current.get("taken_by"):
                self._incarnate()
                return
            self._etag = await self.store.replace(STREAMS_TABLE, row, etag=current.etag, timeout=bound)

    def _can_judge(self) -> bool:
        """Whether a silence of others means anything: only once no call of ours to the store has
        failed for a whole lease and a beat (when the store itself stops answering, everyone falls
        silent, and nobody is dead for it)."""
        return self.store.clock.quiet_for() >= self.timing.lease_seconds + self.timing.beat_seconds

    def _incarnate(self) -> None:
        old = self.id
        self.id = new_instance_id()
        self._etag = None
        self.fenced.set()
        log.warning("instance %s was declared dead elsewhere (it was too slow to beat); now %s", old, self.id)

    async def _leave(self) -> None:
        """The row goes: nothing is held here, nobody needs to find us dead."""
        if self._etag is not None:
            with contextlib.suppress(StoreError):
                await self.store.delete(STREAMS_TABLE, PARTITION, self.id, etag=self._etag)
            self._etag = None

    # --- the others ------------------------------------------------------------------------------

    async def alive(self, instance: str) -> bool:
        """Whether ``instance`` beat within its lease, by the store's clock (right after the store
        itself was out: alive, its silence says nothing). StoreError when the store cannot tell."""
        if instance == self.id:
            return not self._closed
        row = await self._row_of(instance)
        return row is not None and (self._past_lease(row) <= 0 or (not row.get("taken_by") and not self._can_judge()))

    async def silent_for(self, instance: str) -> float:
        """How long ``instance`` has been past its lease, by the store's clock (0.0 while it beats;
        inf when it has no row: it left, or was found dead and its row deleted). StoreError when the
        store cannot tell."""
        if instance == self.id:
            return 0.0
        row = await self._row_of(instance)
        return float("inf") if row is None else max(0.0, self._past_lease(row))

    async def _row_of(self, instance: str) -> dict | None:
        """Another instance's row (None: none), read at most once per ``fresh_seconds``."""
        now = asyncio.get_running_loop().time()
        last = self._rows.get(instance)
        if last is None or (last[1].done() and (now - last[0] > self.timing.fresh_seconds or last[1].exception())):
            if len(self._rows) > 256:
                self._rows = {k: v for k, v in self._rows.items() if now - v[0] < 60.0}
            read = asyncio.ensure_future(self.store.get(STREAMS_TABLE, PARTITION, instance))
            read.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, if nobody waits
            last = (now, read)
            self._rows[instance] = last
        return await asyncio.shield(last[1])  # a reader that leaves does not cancel it for the others

    def _past_lease(self, row: dict) -> float:
        """How long ago ``row`` ran past its lease, by the store's clock (<= 0: it beats)."""
        lease = float(row.get("lease") or self.timing.lease_seconds)
        return self.store.clock.now() - float(row.get("at") or 0.0) - lease

    # --- the duty ------------------------------------------------------------------------------

    async def _duty_loop(self) -> None:
        while not self._closed:
            await self._logged("the duty tick", self._duty_tick)
            await asyncio.sleep(self.timing.duty_seconds)

    async def _duty_tick(self) -> None:
        now = self.store.clock.now()
        row = {"PartitionKey": PARTITION, "RowKey": DUTY, "holder": self.id, "at": now}
        current = await self.store.get(STREAMS_TABLE, PARTITION, DUTY)
        try:
            if current is None:
                await self.store.insert(STREAMS_TABLE, row)
            elif await self._free(current, now):  # (ours, refreshed; or free, taken)
                await self.store.replace(STREAMS_TABLE, row, etag=current.etag)
            else:
                return
        except (AlreadyExists, NotFound, Modified):
            return  # another instance was first
        await self._do_duty()

    async def _free(self, duty: dict, now: float) -> bool:
        """Whether the duty is ours to take: the row names us, or its holder did not refresh it for 3
        ticks, or is a dead instance (its own row past its lease, or taken over; a holder without a
        row, which holds nothing and so does not beat, is judged by the duty row's age alone)."""
        holder = str(duty.get("holder") or "")
        if holder == self.id or now - float(duty.get("at") or 0.0) > 3 * self.timing.duty_seconds:
            return True
        if not holder or not self._can_judge():
            return False
        return 0.0 < await self.silent_for(holder) < float("inf")  # a taken row's ``at`` is 0: past it

    async def _do_duty(self) -> None:
        rows = await self.store.query(STREAMS_TABLE, Where(partition=PARTITION, rows_to=DUTY), timeout=10.0)
        judge = self._can_judge()
        for row in rows:
            other = row["RowKey"]
            if other == self.id or self._past_lease(row) <= 0:  # (a taken row's ``at`` is 0: past it)
                continue
            if judge or row.get("taken_by") == self.id:
                await self._take_over(row)
        loop = asyncio.get_running_loop()
        for seconds, sweep, last in self._sweeps:
            if loop.time() - last[0] >= seconds:
                last[0] = loop.time()
                await self._logged("a sweep", sweep)

    async def _take_over(self, row: dict) -> None:
        """Take (on its ETag: if it was only slow, its next beat fails), settle and delete a dead row."""
        other = row["RowKey"]
        etag = getattr(row, "etag", None)
        if row.get("taken_by") != self.id:
            taken = {"PartitionKey": PARTITION, "RowKey": other, "taken_by": self.id, "at": 0.0}
            try:
                etag = await self.store.replace(STREAMS_TABLE, taken, etag=etag)
            except (NotFound, Modified):
                return  # it beat meanwhile (alive after all), or another holder took it
            log.warning("instance %s: instance %s stopped beating; taking over what it held", self.id, other)
        try:
            if self._recover is not None:
                await self._recover(other, self.id)
        except Exception:  # logged; its row stays taken, so the next tick tries again
            log.exception("instance %s: taking over %s failed; trying again later", self.id, other)
            return
        with contextlib.suppress(StoreError):
            await self.store.delete(STREAMS_TABLE, PARTITION, other, etag=etag)

    async def close(self, leave: bool = True) -> None:
        """Stop beating; ``leave``: delete our row (nothing is owed). Without it the row ages and
        the duty holder takes over what this instance still owes (its journal)."""
        self._closed = True
        for task in (self._beating, self._duty):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._beating, self._duty) if t is not None), return_exceptions=True)
        if leave:
            await self._leave()
