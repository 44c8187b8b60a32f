"""Following a stream produced on another instance (``RemoteReaders``): the stream's entity and
stored log, polled as it grows; the reader's row in the producer's inbox (so the producer writes
fast and knows it is read); the producer's liveness; a Last-Event-ID past what is stored yet."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
from azure.data.tables import UpdateMode

from ..legacy_store import StoreUnavailable
from .calls import StreamStore, quietly
from .config import ResumeConfig
from .errors import BadLastEventId, StreamNotFound
from .format import END, LOST, STREAM_ROW, Tail, error_event
from .ids import ROUTES, Route, started_at
from .liveness import SKEW, InstanceRows, Liveness, listed, mark_lost, producer_alive
from .readers import Events


@dataclass
class RemoteRead:
    """One reader here of a stream stored elsewhere: what it follows, from where, and its row
    (``nonce``) in the producing instance's inbox once ``registered``."""

    stream_id: str
    entity: dict
    route: Route
    after: int
    tail: Tail
    nonce: str
    registered: bool = False


class _Cadence:
    """When a remote reader next polls the blob (``poll``), checks the producer, says it still reads."""

    def __init__(self, config: ResumeConfig, now: float):
        self._cfg = config
        self.poll = config.poll_seconds
        self._idle = 0
        self._next_state = now + config.state_seconds
        self._next_refresh = now + config.read_refresh_seconds

    def read(self, got: bool) -> None:
        """After a read that ``got`` bytes or not (see ResumeConfig.poll_seconds)."""
        cfg = self._cfg
        if got:
            self.poll, self._idle = cfg.poll_seconds, 0
        else:
            self._idle += 1
            idle = self._idle
            self.poll = (
                cfg.poll_seconds / 3 if idle <= 3 else min(cfg.max_poll_seconds, cfg.poll_seconds * 1.5 ** (idle - 3))
            )

    def state_due(self, now: float) -> bool:
        if now >= self._next_state:
            self._next_state = now + self._cfg.state_seconds
            return True
        return False

    def refresh_due(self, now: float) -> bool:
        if now >= self._next_refresh:
            self._next_refresh = now + self._cfg.read_refresh_seconds
            return True
        return False


class RemoteReaders:
    """The readers of streams that are not produced here, for one stream log."""

    def __init__(self, streams: StreamStore):
        self._log = streams
        # Fresh for half a state check: a reader's check sees a row read at most that long before.
        self._rows = InstanceRows(streams, streams.config.state_seconds / 2)

    async def open(self, stream_id: str, after: int, caller: str | None) -> tuple[Route, Callable[[], Events]]:
        """The stream's route and its events after ``after``; raises before anything is read out."""
        entity = await self.stream_entity(stream_id, caller)
        route: Route = entity["route"] if entity.get("route") in ROUTES else "chat"
        tail = Tail(after)
        first = tail.feed(await self._read_blob(stream_id, 0))
        at = RemoteRead(stream_id, entity, route, after, tail, secrets.token_hex(4))
        try:
            if tail.end is None and entity.get("state") == "live":
                await self._register(at)
                at.registered = True
            if after > tail.last_id and tail.end is None and entity.get("state") == "live":
                first += await self._check_past_end(stream_id, entity, after, tail)
            if tail.end == END and after > tail.last_id:
                raise BadLastEventId(f"Last-Event-ID {after} is past the end of the stream ({tail.last_id})")
        except BaseException:
            if at.registered:
                self._forget(at)
            raise
        return route, lambda: self._follow(at, first)

    async def stream_entity(self, stream_id: str, caller: str | None) -> dict:
        """The stream's record, once it is written: its producer writes it in the background as the
        stream starts (the id goes out at once), so for a stream started less than ``give_up_seconds``
        ago (it retries that long) a missing record is waited for."""
        config = self._log.config
        young_until = started_at(stream_id) + config.give_up_seconds + SKEW
        pause = config.young_poll_seconds
        while True:
            try:
                entity = await self._log._call_table(lambda t: t.get_entity(stream_id, STREAM_ROW))
                break
            except ResourceNotFoundError:
                if time.time() + pause > young_until or started_at(stream_id) > time.time() + SKEW:
                    raise StreamNotFound("no such stream") from None
            await asyncio.sleep(pause)
            # Longer each time: a record that is late is late because the store is busy (its write
            # waits its turn, ResumeConfig.bulk_calls); polling it faster would only add to that.
            pause = min(1.0, pause * 1.5)
        if entity.get("expires", 0) < time.time():
            raise StreamNotFound("no such stream")
        owner = entity.get("owner")
        if owner is not None and owner != caller:
            raise StreamNotFound("no such stream")
        return dict(entity)

    async def _check_past_end(self, stream_id: str, entity: dict, after: int, tail: Tail) -> bytes:
        """Last-Event-ID ``after`` is past what is stored of a live stream. Either the producer has
        not written it yet (it does within inbox_seconds of seeing this reader), or the id was never
        handed out: wait for the stored log to reach it, or for a heartbeat composed after the
        client got ``after`` (two beats after the first one read here) to show the producer's last
        id. BadLastEventId only when proven; otherwise the reader follows (and skips to ``after``).
        Returns what was read meanwhile."""
        config = self._log.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.past_end_wait_seconds
        next_beat_check = loop.time()
        first_beat: int | None = None
        read = b""
        while after > tail.last_id and tail.end is None and loop.time() < deadline:
            if loop.time() >= next_beat_check:
                next_beat_check = loop.time() + min(0.5, config.heartbeat_seconds / 2)
                row = await self._rows.get(str(entity.get("instance")))
                if row is None or float(row.get("lease_until", 0)) + SKEW < time.time():
                    break  # its instance is gone: the reader will say stream_lost
                beat = int(row.get("beat") or 0)
                if first_beat is None:
                    first_beat = beat
                elif beat >= first_beat + 2:
                    stored = listed(row)
                    if stream_id in stored and after > stored[stream_id]:
                        raise BadLastEventId(
                            f"Last-Event-ID {after} is past the end of the stream ({stored[stream_id]})"
                        )
                    break  # handed out, or no longer stored (the reader tells which)
            await asyncio.sleep(config.poll_seconds)
            read += tail.feed(await self._read_blob(stream_id, tail.offset))
        return read

    async def _follow(self, at: RemoteRead, first: bytes) -> Events:
        loop = asyncio.get_running_loop()
        cfg = self._log.config
        tail = at.tail
        self._log.remote_readers += 1
        try:
            if first:
                yield first
            cadence = _Cadence(cfg, loop.time())
            failing_since: float | None = None
            watch = Liveness()
            while tail.end is None:
                await asyncio.sleep(max(cadence.poll, self._log.remote_readers / cfg.read_rate))
                now = loop.time()
                try:
                    # Every read is handed out before any other store call: nothing read is lost.
                    out = await self._poll(at)
                    cadence.read(bool(out))
                    if out:
                        yield out
                    if tail.end is not None:
                        break
                    if cadence.state_due(now) and not await producer_alive(self._rows, cfg, at.entity, watch):
                        # Nobody stores it any more: one more read for what was stored last.
                        out = await self._poll(at)
                        if out:
                            yield out
                        if tail.end is None:
                            self._log._spawn(mark_lost(self._log, at.stream_id))  # deleted after the TTL
                            yield self._error(at.route, "stream_lost", "the stream's producer was lost", tail.cursor)
                            return
                        break
                    if at.registered and cadence.refresh_due(now):
                        await self._register(at)
                    failing_since = None
                except (StoreUnavailable, HttpResponseError):
                    failing_since = failing_since or now
                    if now - failing_since > cfg.give_up_seconds:
                        # Not an event of the stream: no id, so a client asks again after tail.cursor.
                        yield self._log.encode_error(
                            at.route, "store_unavailable", "the stream's store is unavailable", True, tail.cursor + 1
                        )
                        return
            if tail.end == LOST and not (tail.cursor == tail.last_id and tail.cursor > at.after):
                yield self._error(at.route, "stream_lost", "the stream was lost before its end", tail.cursor)
        finally:
            self._log.remote_readers -= 1
            if at.registered:
                self._forget(at)

    async def _poll(self, at: RemoteRead) -> bytes:
        """The stream's new whole events, read in turn with this instance's other background calls."""
        async with self._log.bulk:
            return at.tail.feed(await self._read_blob(at.stream_id, at.tail.offset))

    def _error(self, route: Route, type: str, message: str, cursor: int) -> bytes:
        """The retryable error event that ends a reader whose client has every event up to ``cursor``."""
        return error_event(self._log.encode_error, route, type, message, True, cursor + 1)

    async def _read_blob(self, stream_id: str, offset: int) -> bytes:
        """The blob's bytes from ``offset`` (b"" when it has no more, or does not exist yet)."""
        return await self._log._read_range(stream_id, offset)

    async def _register(self, at: RemoteRead) -> None:
        now = time.time()
        row = {
            "PartitionKey": f"i-{at.entity['instance']}",
            "RowKey": f"r-{at.stream_id}-{at.nonce}",
            "read_at": now,
            "expires": now + self._log.config.reader_row_seconds,
        }
        await self._log._call_table(lambda t: t.upsert_entity(row, mode=UpdateMode.REPLACE))

    def _forget(self, at: RemoteRead) -> None:
        """The reader left: say when (the abandonment clock starts then); the producer deletes the row.
        A reader that read the stream to its end deletes its row itself: nobody needs it any more."""
        pk, rk = f"i-{at.entity['instance']}", f"r-{at.stream_id}-{at.nonce}"
        if at.tail.end is not None:
            self._log._spawn(quietly(lambda: self._log._call_table(lambda t: t.delete_entity(pk, rk))))
            return
        now = time.time()
        row = {
            "PartitionKey": f"i-{at.entity['instance']}",
            "RowKey": f"r-{at.stream_id}-{at.nonce}",
            "read_at": now,
            "left": True,
            "expires": now + self._log.config.reader_row_seconds,
        }
        self._log._spawn(
            quietly(lambda: self._log._call_table(lambda t: t.upsert_entity(row, mode=UpdateMode.REPLACE)))
        )
