"""A stream's reader slots: the limit of readers per stream holds across instances: each reader holds
one of the stream's ``max_readers_per_stream`` slot rows (partition ``{id}``, RowKeys
``slot-00``…), taken with an insert (or, when its holder stopped refreshing it, a conditional
replace), so the check and the taking are one write."""

from __future__ import annotations

import asyncio
import random
import secrets

from ...errors import AlreadyExists, Modified, NotFound, StoreError, StoreUnavailable
from ..store import STREAMS_TABLE, Where
from .config import Context
from .errors import TooManyReaders


class Slot:
    """One of a stream's reader slots, held while the reader reads (refreshed every
    ``read_refresh_seconds``; free ``slot_seconds`` after its holder stopped)."""

    def __init__(self, ctx: Context, stream_id: str, key: str, holder: str, etag: str):
        self._ctx = ctx
        self._stream_id = stream_id
        self._key = key
        self._holder = holder
        self._etag = etag
        self._keeping = ctx.spawn(self._keep())

    @classmethod
    async def take(cls, ctx: Context, stream_id: str) -> Slot:
        """A free slot: one insert into a random one; if it is taken, one look at them all, then two
        free or expired ones at most, twice. TooManyReaders when none is left (or the others were
        quicker: never one too many); StoreError. A write whose answer was lost may have taken a
        slot: it is given back (its row names this holder)."""
        store, cfg = ctx.store, ctx.config
        holder = secrets.token_hex(6)
        keys = [f"slot-{i:02d}" for i in range(cfg.max_readers_per_stream)]
        random.shuffle(keys)

        async def write(key: str, etag: str | None) -> Slot:
            row = _slot_row(ctx, stream_id, key, holder)
            try:
                if etag is None:
                    return cls(ctx, stream_id, key, holder, await store.insert(STREAMS_TABLE, row))
                return cls(ctx, stream_id, key, holder, await store.replace(STREAMS_TABLE, row, etag=etag))
            except StoreUnavailable:
                ctx.later(lambda: _give_back(ctx, stream_id, key, holder))
                raise

        try:
            return await write(keys[0], None)
        except AlreadyExists:
            pass
        for _ in range(2):
            where = Where(partition=stream_id, rows_from="slot-", rows_to="slot.", select=("until",))
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

    async def _keep(self) -> None:
        refresh = self._ctx.config.read_refresh_seconds
        pause = refresh
        while True:
            await asyncio.sleep(pause)
            try:
                row = _slot_row(self._ctx, self._stream_id, self._key, self._holder)
                self._etag = await self._ctx.store.replace(STREAMS_TABLE, row, etag=self._etag)
                pause = refresh
            except (Modified, NotFound):
                return  # it expired and was taken (this reader was too slow): it reads on
            except StoreError:
                # Again soon, not a whole interval later: the slot outlives its last refresh by
                # slot_seconds (about three intervals), and a busy store can fail two in a row.
                pause = min(1.0, refresh / 4)

    def release(self) -> None:
        if self._keeping is not None:
            self._keeping.cancel()
            self._keeping = None
            self._ctx.later(self._give_back)

    async def _give_back(self) -> None:
        try:
            await self._ctx.store.delete(STREAMS_TABLE, self._stream_id, self._key, etag=self._etag)
        except Modified:  # a refresh landed as it was cancelled: the row is still ours if it names us
            await _give_back(self._ctx, self._stream_id, self._key, self._holder)


def _slot_row(ctx: Context, stream_id: str, key: str, holder: str) -> dict:
    until = ctx.now() + ctx.config.slot_seconds
    return {"PartitionKey": stream_id, "RowKey": key, "holder": holder, "until": until, "expires": until}


async def _give_back(ctx: Context, stream_id: str, key: str, holder: str) -> None:
    """Free the slot ``key`` if ``holder`` holds it (a conditional delete: never someone else's)."""
    row = await ctx.store.get(STREAMS_TABLE, stream_id, key, select=("holder",))
    if row is not None and row.get("holder") == holder:
        await ctx.store.delete(STREAMS_TABLE, stream_id, key, etag=row.etag)
