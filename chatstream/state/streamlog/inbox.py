"""A producing instance's inbox: what other instances tell it about its streams, as rows in its own
partition ``i-{instance}`` of ``chatstreamStreams``, which it reads with one query every
``inbox_seconds`` (``inbox_young_seconds`` while a stream of its is young), whatever the number of
its streams:

- ``c-{id}``: cancel this stream (``cancel``);
- ``r-{id}-{reader}``: a reader on another instance follows this stream, at ``read_at`` (the store's
  time), refreshed while it reads (``register``; slots.py keeps it with the reader's slot), ``left``
  once it is gone (``leave``); ``ack``: it wants to know the last id handed out (the producer stores
  ``: ack reader L`` in the log).

It also ticks the producers (fast writes, abandonment, the time cap, this instance's new id once
``Instances`` fenced it: the inbox is then the new id's)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
    """Read the inbox, deliver its rows to ``producers`` (the log's: the streams produced here, by
    id) and tick them, while there are any (``StreamLog`` runs it when there are again)."""
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


async def register(ctx: Context, instance: str, stream_id: str, reader: str) -> None:
    """A reader here follows ``stream_id`` produced by ``instance`` (and wants an ack)."""
    await ctx.store.upsert(STREAMS_TABLE, _reader_row(ctx, instance, stream_id, reader, ack=True))


async def leave(ctx: Context, instance: str, stream_id: str, reader: str, *, quietly: bool) -> None:
    """The reader left: say when (the abandonment clock starts then; the producer deletes the row);
    ``quietly``: delete the row (the reader read the stream to its end, or the stream went on
    elsewhere: nobody needs it any more). Best effort: a row left behind expires and is swept."""
    with contextlib.suppress(StoreError):
        if quietly:
            await ctx.store.delete(STREAMS_TABLE, inbox_partition(instance), f"r-{stream_id}-{reader}")
        else:
            await ctx.store.upsert(STREAMS_TABLE, _reader_row(ctx, instance, stream_id, reader, left=True))


def _reader_row(ctx: Context, instance: str, stream_id: str, reader: str, **fields: bool) -> dict:
    now = ctx.now()
    return {
        "PartitionKey": inbox_partition(instance),
        "RowKey": f"r-{stream_id}-{reader}",
        "read_at": now,
        "expires": now + ctx.config.reader_row_seconds,
        **fields,
    }
