"""What a reader tells a stream's producing instance through the store, and its hold on the stream.

A producing instance's inbox is its partition ``i-{instance}`` of ``chatstreamStreams``, which it
reads with one query every ``inbox_seconds`` (``inbox_young_seconds`` while a stream of its is
young), whatever the number of its streams (``serve``, which also ticks its producers: fast writes,
abandonment, the time cap, this instance's new id once ``Instances`` fenced it):

- ``c-{id}``: cancel this stream (``cancel``);
- ``r-{id}-{reader}``: a reader on another instance follows this stream, at ``read_at`` (the store's
  time), refreshed while it reads, ``left`` once it is gone; ``ack``: it wants to know the last id
  handed out (the producer stores ``: ack reader L`` in the log).

A reader's hold on a stream (``Slot``), named by the reader's id: its slot and, while the stream is
produced on another instance, its ``r-`` row in that instance's inbox, taken at once, refreshed
every ``read_refresh_seconds`` by one task, given back together. The slots make the limit of readers
per stream hold across instances: each reader holds one of the stream's ``max_readers_per_stream``
slot rows (partition ``{id}``, RowKeys ``slot-00``…), taken with an insert (or, when its holder
stopped refreshing it, a conditional replace), so the check and the taking are one write.

A slot is a lease until ``until`` (the store's time); another reader may take it after that, so
its holder hands out nothing past it (``holding``) until a refresh has landed (a replace on its
ETag: nobody took it meanwhile); a holder whose slot was taken (a store too slow under load) stops:
the limit holds at every moment."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import Mapping

from ...errors import AlreadyExists, Modified, NotFound, StoreError, StoreUnavailable
from ..store import STREAMS_TABLE, Row, Where
from .config import Context
from .errors import TooManyReaders
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


HOLD_MARGIN = 1.0  # seconds: the store's time is known to a second (whole-second Date headers)


class Slot:
    """A reader's slot, and its inbox row while the stream is produced elsewhere (module docstring);
    ``id`` names both, and the producer's ack (``Tail.acks``)."""

    def __init__(self, ctx: Context, stream_id: str):
        self._ctx = ctx
        self._stream_id = stream_id
        self.id = secrets.token_hex(6)
        self._key = ""
        self._etag: str | None = None  # while the slot is this reader's
        self._at: str | None = None  # the instance whose inbox holds this reader's row
        self._refreshing: asyncio.Task | None = None
        self._until = 0.0  # the slot is this reader's until then (its last write that landed)
        self._news = asyncio.Event()  # set (and replaced) after each refresh: ``holding`` waits on it

    async def hold(self, at: str | None) -> None:
        """A free slot, with the reader's row in the inbox of ``at`` (the producing instance, when
        another one) at once. TooManyReaders when no slot is left; StoreError (then nothing is held)."""
        answers = await asyncio.gather(self._take(), self.follow(at), return_exceptions=True)
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is not None:
            if at is not None and at != self._at:  # (its answer lost: it may have landed)
                self._ctx.spawn(self._leave(at, quietly=True))
            self.release()
            raise failed
        self._refreshing = self._ctx.spawn(self._refresh())

    async def _take(self) -> None:
        """One insert into a random slot; if it is taken, one look at them all, then two free or
        expired ones at most, twice. TooManyReaders when none is left (or the others were quicker:
        never one too many); StoreError."""
        ctx, store = self._ctx, self._ctx.store
        keys = [f"slot-{i:02d}" for i in range(ctx.config.max_readers_per_stream)]
        random.shuffle(keys)

        async def write(key: str, etag: str | None) -> None:
            try:
                await self._write(key, etag)
            except StoreUnavailable:  # its answer lost: it may have taken the slot
                ctx.later(lambda: self._give_back(key))
                raise

        try:
            return await write(keys[0], None)
        except AlreadyExists:
            pass
        for _ in range(2):
            where = Where(partition=self._stream_id, rows_from="slot-", rows_to="slot.", select=("until",))
            held = {row["RowKey"]: row for row in await store.query(STREAMS_TABLE, where)}
            now = ctx.now()
            free = [k for k in keys if k not in held]
            expired = [k for k in keys if k in held and float(held[k].get("until") or 0.0) < now]
            if not free and not expired:
                break
            for key in (free + expired)[:2]:
                try:
                    return await write(key, held[key].etag if key in held else None)
                except (AlreadyExists, Modified, NotFound):
                    continue
        raise TooManyReaders("too many readers of this stream")

    async def _write(self, key: str, etag: str | None) -> None:
        """Take the slot ``key`` (an insert; on ``etag``, a replace: also a refresh) for ``slot_seconds``."""
        until = self._ctx.now() + self._ctx.config.slot_seconds
        row = {"PartitionKey": self._stream_id, "RowKey": key, "holder": self.id, "until": until, "expires": until}
        store = self._ctx.store
        if etag is None:
            self._etag = await store.insert(STREAMS_TABLE, row)
        else:
            self._etag = await store.replace(STREAMS_TABLE, row, etag=etag)
        self._key, self._until = key, until

    async def follow(self, at: str | None) -> None:
        """The stream is produced on ``at`` now (None: here, or by nobody): the inbox row moves there
        (the one it leaves is deleted). StoreError."""
        if at == self._at:
            return
        if at is not None:
            await self._ctx.store.upsert(STREAMS_TABLE, self._inbox_row(at, ack=True))
        if self._at is not None:
            self._ctx.spawn(self._leave(self._at, quietly=True))
        self._at = at

    async def _refresh(self) -> None:
        refresh = self._ctx.config.read_refresh_seconds
        pause = self._pause(refresh)
        while True:
            await asyncio.sleep(pause)
            try:
                if self._etag is not None:
                    try:
                        await self._write(self._key, self._etag)
                    except (Modified, NotFound):
                        # A refresh whose answer was lost landed (the row names this reader: it holds on),
                        # or the slot expired and was taken (this reader was too slow: it stops, ``holding``).
                        held = await self._held(self._key)
                        self._etag = held.etag if held is not None else None
                        self._until = float(held.get("until") or 0.0) if held is not None else 0.0
                    news, self._news = self._news, asyncio.Event()
                    news.set()
                if self._at is not None:
                    await self._ctx.store.upsert(STREAMS_TABLE, self._inbox_row(self._at, ack=True))
                pause = self._pause(refresh)
            except StoreError:
                # Again soon, not a whole interval later: the slot outlives its last refresh by
                # slot_seconds (about three intervals), and a busy store can fail two in a row.
                pause = min(1.0, refresh / 4)

    def _pause(self, refresh: float) -> float:
        """Until the next refresh: ``refresh``, sooner when a write that landed late left the slot
        less time (its ``until`` was set as it was sent)."""
        if self._etag is None:  # (taken by another reader: this one is stopping)
            return refresh
        return max(0.05, min(refresh, (self._until - HOLD_MARGIN - self._ctx.now()) / 3))

    async def holding(self) -> bool:
        """Whether this reader may hand out more: at once while its slot's time runs; past it, once
        the next refresh lands (only if nobody took the slot), waiting at most ``give_up_seconds``.
        False: another reader took the slot, or the store did not answer that long."""
        ctx = self._ctx
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ctx.config.give_up_seconds
        while self._etag is not None and ctx.now() >= self._until - HOLD_MARGIN:
            if self._refreshing is None or loop.time() >= deadline:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._news.wait(), deadline - loop.time())
        return self._etag is not None

    def release(self, read_to_end: bool = False) -> None:
        """Give both back (once; the inbox row: ``_leave``)."""
        if self._refreshing is not None:
            self._refreshing.cancel()
            self._refreshing = None
        if self._etag is not None:
            etag, self._etag = self._etag, None
            self._ctx.later(lambda: self._give_back(self._key, etag))
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

    async def _give_back(self, key: str, etag: str | None = None) -> None:
        """Free the slot ``key`` if this reader holds it (on ``etag``, its last write's, else if it
        names it): never someone else's."""
        if etag is not None:
            with contextlib.suppress(Modified):
                return await self._ctx.store.delete(STREAMS_TABLE, self._stream_id, key, etag=etag)
        row = await self._held(key)
        if row is not None:
            await self._ctx.store.delete(STREAMS_TABLE, self._stream_id, key, etag=row.etag)

    async def _held(self, key: str) -> Row | None:
        row = await self._ctx.store.get(STREAMS_TABLE, self._stream_id, key, select=("holder", "until"))
        return row if row is not None and row.get("holder") == self.id else None
