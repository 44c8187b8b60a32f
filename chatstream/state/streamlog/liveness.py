"""Whether a stream produced on another instance is still being stored, as a reader there tells it:
the producing instance's heartbeat row (its lease, its beat, the streams it lists), read by the
lease time or, for a reader that ``watch``es, by the reader's own clock."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from azure.core.exceptions import ResourceNotFoundError
from azure.data.tables import UpdateMode

from ..legacy_store import StoreUnavailable
from .calls import StreamStore, quietly
from .config import ResumeConfig
from .format import ALIVE_ROW, STREAM_ROW
from .ids import log_tag

log = logging.getLogger("chatstream")

SKEW = 1.0  # seconds of wall-clock difference tolerated between instances for a lease


def listed(row: Any) -> dict[str, int]:
    """The streams an instance's heartbeat row lists as being stored, with their last ids."""
    found = {}
    for token in str(row.get("streams") or "").split():
        stream_id, _, last = token.partition(":")
        found[stream_id] = int(last) if last.isdigit() else 0
    return found


class Liveness:
    """A remote reader's view of the producer's heartbeat: dead when the beat has not changed for
    a lease, by the reader's own clock (so a skewed clock cannot make a live producer look dead)."""

    def __init__(self) -> None:
        self.beat: Any = None
        self.changed_at = time.monotonic()

    def saw(self, beat: Any, lease: float) -> bool:
        now = time.monotonic()
        if beat != self.beat:
            self.beat, self.changed_at = beat, now
            return True
        return now - self.changed_at <= lease


class InstanceRows:
    """The heartbeat rows of the instances that produce what this instance's remote readers
    follow: one read of an instance's row serves every reader that asks within ``fresh`` seconds
    (and every one that asks while it is under way), so a hundred readers of one producer cost one
    read, not a hundred, each ``state_seconds``. A failed read is not kept."""

    def __init__(self, streams: StreamStore, fresh: float):
        self._log = streams
        self._fresh = fresh
        self._rows: dict[str, tuple[float, asyncio.Future]] = {}

    async def get(self, instance: str) -> Any:
        """The heartbeat row of ``instance`` (None: there is none). StoreUnavailable as for any read."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        held = self._rows.get(instance)
        if held is None or (held[1].done() and (now - held[0] > self._fresh or held[1].exception() is not None)):
            if len(self._rows) > 64:  # instances long gone (each recycled instance has a new name)
                self._rows = {k: v for k, v in self._rows.items() if now - v[0] < 60.0}
            read = self._log._spawn(self._read(instance))
            if read is None:
                raise StoreUnavailable("the stream log is closed")
            read.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved, if nobody waits
            held = (now, read)
            self._rows[instance] = held
        # Shielded: a reader that leaves while the read is under way does not cancel it for the others.
        return await asyncio.shield(held[1])

    async def _read(self, instance: str) -> Any:
        try:
            return await self._log._call_table(lambda t: t.get_entity(f"i-{instance}", ALIVE_ROW))
        except ResourceNotFoundError:
            return None


async def producer_alive(rows: InstanceRows, config: ResumeConfig, entity: dict, watch: Liveness | None) -> bool:
    """False if nobody is storing the stream any more: its instance's heartbeat stopped (by this
    reader's clock when it ``watch``es, else by the lease time), or the instance's last beat no
    longer lists it (it ended, and its end marker is in the blob; or it stopped being stored).
    The caller reads the blob once more: no end marker then means the stream is lost.
    StoreUnavailable when the store cannot tell."""
    row = await rows.get(str(entity.get("instance")))
    now = time.time()
    if row is None:
        alive = now - float(entity.get("created", 0)) < 2 * config.lease_seconds
    elif watch is None:
        alive = float(row.get("lease_until", 0)) + SKEW >= now
    else:  # long past its lease (beyond any skew), or no new beat for a lease by our clock
        alive = (
            watch.saw(row.get("beat"), config.lease_seconds + SKEW)
            and float(row.get("lease_until", 0)) + 10 * config.lease_seconds >= now
        )
    if not alive:
        log.warning("stream %s: its instance's heartbeat stopped", log_tag(entity["PartitionKey"]))
    elif row is not None and float(row.get("at", 0)) > float(entity.get("created", 0)):
        alive = entity["PartitionKey"] in listed(row)
    return alive


async def mark_lost(streams: StreamStore, stream_id: str) -> None:
    """Record that nobody stores ``stream_id`` any more (its producer gave up, or died: a reader
    found out): it is deleted ``ttl_seconds`` from now, like a stream that ended."""
    fields = {
        "PartitionKey": stream_id,
        "RowKey": STREAM_ROW,
        "state": "lost",
        "expires": time.time() + streams.config.ttl_seconds,
    }
    await quietly(lambda: streams._call_table(lambda t: t.update_entity(fields, mode=UpdateMode.MERGE)))
