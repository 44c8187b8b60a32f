"""This instance's background work for resumable streams (``InstanceWork``), shared by all the
streams it produces: the heartbeat (its lease, and the streams it is storing with their last ids),
the inbox (cancels and readers elsewhere, one query every ``inbox_seconds``) and the sweeper (what
has expired, deleted every ``sweep_seconds``, by whichever instance gets there first)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError, ResourceModifiedError, ResourceNotFoundError
from azure.data.tables import UpdateMode
from azure.data.tables.aio import TableClient

from ..legacy_store import CALL_TIMEOUT, StoreUnavailable
from .calls import StreamStore, quietly
from .format import ALIVE_ROW, STREAM_ROW
from .ids import ID_LENGTH
from .producer import Producer

log = logging.getLogger("chatstream")


class InstanceWork:
    """The heartbeat, inbox and sweeper tasks of one stream log. The heartbeat and the inbox run
    while the instance produces streams (the heartbeat a lease longer); the sweeper until close."""

    def __init__(self, streams: StreamStore, producers: dict[str, Producer]):
        self._log = streams
        self._producers = producers  # the log's own: the streams produced here, by id
        self._heartbeat: asyncio.Task | None = None
        self._inbox: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self._beat_ready: asyncio.Future | None = None
        self._beat = 0

    def ensure_background(self) -> None:
        if self._heartbeat is None or self._heartbeat.done():
            self._beat_ready = asyncio.get_running_loop().create_future()
            self._heartbeat = self._log._spawn(self._heartbeat_loop())
        if self._inbox is None or self._inbox.done():
            self._inbox = self._log._spawn(self._inbox_loop())
        self.ensure_sweeper()

    def ensure_sweeper(self) -> None:
        if not self._log._closed and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = self._log._spawn(self._sweep_loop())

    async def beat_first(self) -> None:
        """Wait (bounded) for this instance's first heartbeat, so no reader sees a stream before its lease."""
        if self._beat_ready is not None:
            try:
                async with asyncio.timeout(CALL_TIMEOUT + 0.2):
                    await asyncio.shield(self._beat_ready)
            except TimeoutError:
                pass

    async def sweep_once(self) -> int:
        """Delete what has expired (blobs, then their rows); the number of rows deleted."""
        streams = self._log
        now = time.time()
        rows: list[dict] = []

        async def collect(table: TableClient) -> None:
            query = table.query_entities(
                "expires lt @now", parameters={"now": now}, select=["PartitionKey", "RowKey"], results_per_page=100
            )
            async for row in query:
                rows.append(row)
                if len(rows) >= streams.config.max_sweep:
                    break

        await streams._call_table(collect, limit=max(CALL_TIMEOUT, 10.0))
        gate = asyncio.Semaphore(8)

        async def delete(row: Any) -> int:
            async with gate:
                try:
                    if row["RowKey"] == STREAM_ROW:
                        with contextlib.suppress(ResourceNotFoundError):
                            await streams._call_blob(lambda c: c.delete_blob(row["PartitionKey"]))
                    await streams._call_table(
                        lambda t: t.delete_entity(
                            row["PartitionKey"],
                            row["RowKey"],
                            etag=row.metadata["etag"],
                            match_condition=MatchConditions.IfNotModified,
                        )
                    )
                    return 1
                except (ResourceNotFoundError, ResourceModifiedError, StoreUnavailable, HttpResponseError):
                    return 0

        return sum(await asyncio.gather(*(delete(row) for row in rows)))

    async def _heartbeat_loop(self) -> None:
        cfg = self._log.config
        loop = asyncio.get_running_loop()
        idle_since: float | None = None
        while True:
            now = time.time()
            self._beat += 1
            # ``streams``: "id:last_id ..." of the streams this instance is storing right now, at
            # ``at`` (its own clock, the clock of their ``created``): one that is not listed any more
            # ended or was lost; ``last_id`` is the last id handed out to its live caller.
            storing = " ".join(
                f"{p.id}:{p._last_id}" for p in self._producers.values() if p.resumable and not p._done.is_set()
            )
            row = {
                "PartitionKey": f"i-{self._log.instance}",
                "RowKey": ALIVE_ROW,
                "beat": self._beat,
                "at": now,
                "lease_until": now + cfg.lease_seconds,
                "expires": now + cfg.lease_seconds + 60.0,
                "streams": storing,
            }
            # A beat is off the request path: it may take half a lease (a busy instance's calls are
            # slow, and a missed lease reads as death elsewhere), and a failed one is tried again soon.
            pause = cfg.heartbeat_seconds
            try:
                await self._log._call_table(
                    lambda t, row=row: t.upsert_entity(row, mode=UpdateMode.REPLACE), cfg.lease_seconds / 2
                )
            except StoreUnavailable as exc:
                log.warning("resumable streams: heartbeat failed: %s", exc)
                pause = min(pause, 0.25)
            finally:
                if self._beat_ready is not None and not self._beat_ready.done():
                    self._beat_ready.set_result(None)
            await asyncio.sleep(pause)
            # Linger a lease after the last stream, so that a next one needs no new first beat.
            if self._producers:
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            elif loop.time() - idle_since > cfg.lease_seconds:
                return

    async def _inbox_loop(self) -> None:
        cfg = self._log.config
        loop = asyncio.get_running_loop()
        query_failed_at = 0.0
        while self._producers:
            now, now_wall = loop.time(), time.time()
            try:
                for row in await self._read_inbox():
                    self._deliver(row, now_wall)
            except StoreUnavailable as exc:
                if now - query_failed_at > 10:
                    log.warning("resumable streams: the inbox could not be read: %s", exc)
                    query_failed_at = now
            for producer in list(self._producers.values()):
                producer._tick(now, now_wall)
            await asyncio.sleep(cfg.inbox_seconds)

    async def _read_inbox(self) -> list[Any]:
        async def query(table: TableClient) -> list[Any]:
            found = table.query_entities(
                "PartitionKey eq @pk and RowKey gt @lo",
                parameters={"pk": f"i-{self._log.instance}", "lo": "b"},
                select=["RowKey", "read_at", "left"],
            )
            return [row async for row in found]

        return await self._log._call_table(query)

    def _deliver(self, row: Any, now_wall: float) -> None:
        """One inbox row: a cancel; a remote reader following (``read_at``) or gone (``left``)."""
        key: str = row["RowKey"]
        producer = self._producers.get(key[2 : 2 + ID_LENGTH])  # c-{id} or r-{id}-{nonce}
        done = key.startswith("c-") or producer is None or bool(row.get("left"))
        if key.startswith("c-") and producer is not None:
            producer._request_stop("cancelled")
        elif key.startswith("r-") and producer is not None:
            read_at = min(float(row.get("read_at") or 0), now_wall)
            producer._remote_read_at = max(producer._remote_read_at, read_at)
            if not row.get("left"):
                producer._remote_follow_at = max(producer._remote_follow_at, read_at)
        if done:  # read once: delete it (also what is left of streams no longer here)
            pk = f"i-{self._log.instance}"
            self._log._spawn(quietly(lambda: self._log._call_table(lambda t: t.delete_entity(pk, key))))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self._log.config.sweep_seconds * random.uniform(0.8, 1.2))
            try:
                deleted = await self.sweep_once()
                if deleted:
                    log.info("resumable streams: %d expired rows deleted", deleted)
            except StoreUnavailable as exc:
                log.warning("resumable streams: sweep failed: %s", exc)
            except Exception:
                log.exception("resumable streams: sweep failed")
