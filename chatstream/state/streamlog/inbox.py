"""What a reader tells a stream's producing instance through the store.

A producing instance's inbox is its partition ``i-{instance}`` of ``chatstreamStreams``, which it
reads with one query every ``inbox_seconds`` (``inbox_young_seconds`` while a stream of its is
young), whatever the number of its streams (``serve``, which also ticks its producers: fast writes,
abandonment, the time cap, this instance's new id once ``Instances`` fenced it):

- ``c-{id}``: cancel this stream (``cancel``);
- ``r-{id}-{reader}``: a reader on another instance follows this stream, at ``read_at`` (the store's
  time), refreshed while it reads, ``left`` once it is gone; ``ack``: it wants to know the last id
  handed out (the producer stores ``: ack reader L`` in the log).

A reader's ``r-`` row is its ``Registration``: written while the stream is produced on another
instance, refreshed every ``read_refresh_seconds`` by one task, deleted or marked ``left`` as the
reader ends. (Versions before this one also kept ``slot-NN`` rows in the stream's partition, a
bound of readers per stream on all instances; nothing here reads them: they expire and are swept.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Mapping

from ...errors import StoreError
from ..store import STREAMS_TABLE, Where
from .config import Context
from .format import ID_LENGTH
from .producer import Producer

log = logging.getLogger("chatstream")


def inbox_partition(instance: str) -> str:
    return f"i-{instance}"


async def serve(ctx: Context, producers: Mapping[str, Producer]) -> None:
    """Read the inbox, deliver its rows to ``producers`` (the streams produced here, by id) and tick
    them, while there are any."""
    cfg, loop = ctx.config, asyncio.get_running_loop()
    warned_at = -60.0
    while producers:
        now = loop.time()
        instance = ctx.instances.id
        try:
            where = Where(
                partition=inbox_partition(instance), rows_from="c", select=("read_at", "left", "ack"), limit=1000
            )
            for row in await ctx.store.query(STREAMS_TABLE, where):
                _deliver(ctx, producers, instance, row)
        except Exception as exc:  # nothing stops the inbox: the next tick tries again
            if now - warned_at > 10.0:
                warned_at = now
                if isinstance(exc, StoreError):
                    log.warning("resumable streams: the inbox could not be read: %s", exc)
                else:
                    log.exception("resumable streams: the inbox could not be read")
        now_store = ctx.now()
        young = False
        for producer in list(producers.values()):
            producer.tick(now, now_store)
            young = young or producer.young()
        # Reads begin every interval, however long this one took (a busy loop, a slow store).
        interval = cfg.inbox_young_seconds if young else cfg.inbox_seconds
        await asyncio.sleep(max(0.2 * interval, now + interval - loop.time()))


def _deliver(ctx: Context, producers: Mapping[str, Producer], instance: str, row: Mapping) -> None:
    """One inbox row: a cancel; a reader elsewhere following, wanting an ack, or gone."""
    key: str = row["RowKey"]
    producer = producers.get(key[2 : 2 + ID_LENGTH])  # c-{id} or r-{id}-{reader}
    done = key.startswith("c-") or producer is None or bool(row.get("left"))
    if producer is not None:
        if key.startswith("c-"):
            producer.request_stop("cancelled")
        elif key.startswith("r-"):
            reader = key[3 + ID_LENGTH :]
            producer.reader_elsewhere(
                float(row.get("read_at") or 0.0), not row.get("left"), reader if row.get("ack") else None
            )
    if done:  # read once: delete it (also what is left of streams no longer here)
        ctx.later(lambda: ctx.store.delete(STREAMS_TABLE, inbox_partition(instance), key))


async def cancel(ctx: Context, instance: str, stream_id: str) -> None:
    """Ask ``instance`` to stop its stream ``stream_id``. StoreError when the store fails."""
    row = {"PartitionKey": inbox_partition(instance), "RowKey": f"c-{stream_id}", "expires": ctx.now() + 60.0}
    await ctx.store.upsert(STREAMS_TABLE, row)


class Registration:
    """A reader's row in the inbox of its stream's producing instance, while that is another one
    (module docstring); ``id`` names it, and the producer's ack (``Tail.acks``)."""

    def __init__(self, ctx: Context, stream_id: str):
        self._ctx = ctx
        self._stream_id = stream_id
        self.id = secrets.token_hex(6)
        self._at: str | None = None  # the instance whose inbox holds this reader's row
        self._refreshing: asyncio.Task | None = None

    async def open(self, at: str | None) -> None:
        """The reader's first row, in the inbox of ``at`` (the producing instance, when another one).
        StoreError (then nothing is left behind)."""
        try:
            await self.follow(at)
        except StoreError:
            if at is not None:  # (its answer lost: it may have landed)
                self._ctx.spawn(self._leave(at, quietly=True))
            raise

    async def follow(self, at: str | None) -> None:
        """The stream is produced on ``at`` now (None: here, or by nobody): the row moves there (the
        one it leaves is deleted), and is refreshed from then on. StoreError."""
        if at == self._at:
            return
        if at is not None:
            await self._ctx.store.upsert(STREAMS_TABLE, self._inbox_row(at, ack=True))
            if self._refreshing is None:
                self._refreshing = self._ctx.spawn(self._refresh())
        if self._at is not None:
            self._ctx.spawn(self._leave(self._at, quietly=True))
        self._at = at

    async def _refresh(self) -> None:
        refresh = self._ctx.config.read_refresh_seconds
        pause = refresh
        while True:
            await asyncio.sleep(pause)
            try:
                if self._at is not None:
                    await self._ctx.store.upsert(STREAMS_TABLE, self._inbox_row(self._at, ack=True))
                pause = refresh
            except StoreError:
                pause = min(1.0, refresh / 4)  # again soon: a busy store can fail two in a row

    def release(self, read_to_end: bool = False) -> None:
        """Stop refreshing, and leave (once; ``_leave``)."""
        if self._refreshing is not None:
            self._refreshing.cancel()
            self._refreshing = None
        if self._at is not None:
            self._ctx.spawn(self._leave(self._at, quietly=read_to_end))
            self._at = None

    async def _leave(self, at: str, *, quietly: bool) -> None:
        """Say in the inbox of ``at`` when this reader left (the abandonment clock starts then);
        ``quietly``: delete the row (read to its end, or the stream went on elsewhere). A row left
        behind expires and is swept."""
        with contextlib.suppress(StoreError):
            if quietly:
                await self._ctx.store.delete(STREAMS_TABLE, inbox_partition(at), f"r-{self._stream_id}-{self.id}")
            else:
                await self._ctx.store.upsert(STREAMS_TABLE, self._inbox_row(at, left=True))

    def _inbox_row(self, at: str, **fields: bool) -> dict:
        now = self._ctx.now()
        return {
            "PartitionKey": inbox_partition(at),
            "RowKey": f"r-{self._stream_id}-{self.id}",
            "read_at": now,
            "expires": now + self._ctx.config.reader_row_seconds,
            **fields,
        }
