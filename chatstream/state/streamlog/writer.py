"""The background writer of one resumable stream (``StreamWriter``): creates the stream's entity
and append blob, then appends its kept events in whole-event blocks, at most every
``fast_flush_seconds`` while a reader on another instance follows, otherwise every
``checkpoint_seconds`` (and at once when ``flush_bytes`` wait, the final event is in, or the caller
hung up); records the end, or gives up storing (the live stream goes on) when the store fails for
``give_up_seconds`` or the blob is not what was written."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from azure.core import MatchConditions
from azure.core.exceptions import HttpResponseError, ResourceExistsError, ResourceNotFoundError
from azure.data.tables import UpdateMode

from ..legacy_store import StoreUnavailable
from .calls import StreamStore
from .format import BLOCK_LIMIT, BLOCKS_LIMIT, END, LOST, STREAM_ROW
from .ids import Route
from .kept import KeptEvents
from .liveness import mark_lost

log = logging.getLogger("chatstream")


class WriterHost(StreamStore, Protocol):
    """What a writer needs of its stream log besides the store: to wait for the instance's first
    heartbeat, so that no reader sees a stream before its lease."""

    async def _beat_first(self) -> None: ...


class Inconsistent(StoreUnavailable):
    """The blob is not what this producer wrote: stop storing the stream."""


class StreamWriter:
    """Stores one stream's ``KeptEvents``. Its producer sets ``kick`` when there is something to
    do, ``flush_now`` when a resume is likely, ``fast`` while a reader elsewhere follows; ``idle``
    says it waits with nothing pending; ``done`` is set once it has finished (stored or given up);
    ``resumable`` turns False when it gives up."""

    def __init__(
        self,
        host: WriterHost,
        kept: KeptEvents,
        stream_id: str,
        route: Route,
        owner: str | None,
        tag: str,
        started: float,
    ):
        self.id = stream_id
        self.route: Route = route
        self.owner = owner
        self._tag = tag
        self._log = host
        self._cfg = host.config
        self._kept = kept
        self._loop = asyncio.get_running_loop()
        self._created_at = time.time()
        self.resumable = True
        self.done = asyncio.Event()
        self.kick = asyncio.Event()
        self.flush_now = False
        self._fast = False
        self.idle = False  # waiting with nothing pending (an append must wake it)
        self.stored = 0  # events in the blob
        self.stored_bytes = 0  # the blob's length
        self._blocks = 0
        self._uncertain: list[tuple[int, int, bool]] = []  # unanswered writes: (events, bytes, with end)
        self._last_write = started  # the first checkpoint is one interval in
        self._end_marker_written = False

    @property
    def fast(self) -> bool:
        """Writing every fast_flush_seconds (or slower when many do, ResumeConfig.write_rate)."""
        return self._fast

    @fast.setter
    def fast(self, value: bool) -> None:
        value = value and not self.done.is_set()
        if value != self._fast:
            self._log.fast_writers += 1 if value else -1
            self._fast = value

    def _interval(self) -> float:
        cfg = self._cfg
        if not self._fast:
            return cfg.checkpoint_seconds
        return max(cfg.fast_flush_seconds, self._log.fast_writers / cfg.write_rate)

    def nudge(self) -> None:
        """After an append: an idle writer starts its checkpoint wait now; a fast one, or one with
        ``flush_bytes`` waiting, writes."""
        if self.idle or self.fast or self._kept.size - self.stored_bytes >= self._cfg.flush_bytes:
            self.kick.set()

    async def run(self) -> None:
        try:
            try:
                if await self._create():
                    await self._write_all()
            except Exception:  # a bug of ours must not take the live stream with it
                log.exception("stream %s: storing failed", self._tag)
                self.give_up("internal error")
            self.done.set()
            # Not stored (given up): readers here, cancel and abandonment still need it until its end.
            while not self._kept.end:
                await self._kept.changed()
        finally:
            self.done.set()
            self.fast = False

    def give_up(self, why: str) -> None:
        if not self.resumable:
            return
        self.resumable = False
        log.warning("stream %s is not resumable: %s", self._tag, why)
        self._log._spawn(self._mark_lost())

    async def _create(self) -> bool:
        deadline = self._loop.time() + self._cfg.give_up_seconds
        await self._log._beat_first()
        entity = {
            "PartitionKey": self.id,
            "RowKey": STREAM_ROW,
            "route": self.route,
            "instance": self._log.instance,
            "created": self._created_at,
            "state": "live",
            "expires": self._created_at + self._cfg.max_stream_seconds + self._cfg.ttl_seconds,
        }
        if self.owner is not None:
            entity["owner"] = self.owner
        steps: list[Callable[[], Awaitable[Any]]] = [
            lambda: self._log._call_table(lambda t: t.create_entity(entity)),
            # If-None-Match: a create that timed out here and lands late must not empty the blob.
            lambda: self._log._call_blob(
                lambda c: c.get_blob_client(self.id).create_append_blob(match_condition=MatchConditions.IfMissing)
            ),
        ]
        for step in steps:
            while True:
                try:
                    async with self._log.bulk:
                        await step()
                    break
                except ResourceExistsError:  # an earlier attempt landed
                    break
                except StoreUnavailable:
                    if self._loop.time() > deadline:
                        self.give_up("the store is unavailable")
                        return False
                    await asyncio.sleep(0.25)
        return True

    async def _write_all(self) -> None:
        kept = self._kept
        failing_since: float | None = None
        while True:
            self.kick.clear()
            pending = len(kept.events) > self.stored or (kept.end and not self._end_marker_written)
            if not pending and kept.end:
                break
            if self._blocks >= BLOCKS_LIMIT - 1:
                self.give_up("the stream has too many blocks")
                return
            now = self._loop.time()
            due = self._last_write + self._interval()
            urgent = kept.end or self.flush_now or kept.size - self.stored_bytes >= self._cfg.flush_bytes
            if pending and (urgent or now >= due):
                self.flush_now = False
                self._last_write = now
                try:
                    await self._write_block()
                    failing_since = None
                except StoreUnavailable as exc:
                    failing_since = failing_since or now
                    if now - failing_since > self._cfg.give_up_seconds or isinstance(exc, Inconsistent):
                        self.give_up(str(exc))
                        return
                    await asyncio.sleep(min(0.5, max(self._cfg.fast_flush_seconds, now - failing_since)))
                continue
            self.idle = not pending
            try:
                async with asyncio.timeout(max(0.0, due - now) if pending else None):
                    await self.kick.wait()
            except TimeoutError:
                pass
            finally:
                self.idle = False
        await self._mark_ended()

    async def _write_block(self) -> None:
        kept = self._kept
        first = self.stored
        limit = min(BLOCK_LIMIT - 16, self._cfg.max_stream_bytes + 64)
        count, size = 0, 0
        for event in kept.events[first:]:
            if count and size + len(event) > limit:
                break
            count += 1
            size += len(event)
        parts = kept.events[first : first + count]
        last = kept.end and first + count == len(kept.events)
        if last:
            parts.append((LOST if kept.lost else END) + b"\n\n")
        block = b"".join(parts)
        offset = self.stored_bytes
        attempt = (count, len(block), last)
        try:
            async with self._log.bulk:
                await self._log._call_blob(
                    lambda c: c.get_blob_client(self.id).append_block(block, appendpos_condition=offset)
                )
        except StoreUnavailable:
            # No answer: it may still have landed. Every attempt since the last confirmed write is
            # at this same offset, so the store took at most one of them; the next one's 412 says which.
            self._uncertain.append(attempt)
            raise
        except HttpResponseError as exc:
            if exc.status_code != 412:
                raise StoreUnavailable(f"append failed (HTTP {exc.status_code})") from None
            size = (await self._log._call_blob(lambda c: c.get_blob_client(self.id).get_blob_properties())).size
            landed = [a for a in (attempt, *self._uncertain) if size == offset + a[1]]
            if not landed:
                raise Inconsistent("the stored log is not what was written") from None
            attempt = landed[0]
        self._uncertain.clear()
        count, written, last = attempt
        self.stored = first + count
        self.stored_bytes = offset + written
        self._blocks += 1
        if last:
            self._end_marker_written = True

    async def _mark_ended(self) -> None:
        now = time.time()
        fields = {
            "PartitionKey": self.id,
            "RowKey": STREAM_ROW,
            "state": "lost" if self._kept.lost else "ended",
            "finished": now,
            "expires": now + self._cfg.ttl_seconds,
            "last_id": len(self._kept.events),
            "size": self.stored_bytes,
        }
        deadline = self._loop.time() + self._cfg.give_up_seconds
        while True:
            try:
                async with self._log.bulk:
                    await self._log._call_table(lambda t: t.update_entity(fields, mode=UpdateMode.MERGE))
                return
            except ResourceNotFoundError:
                return
            except StoreUnavailable:
                # The blob has its end marker: readers end right; only the deletion comes later.
                if self._loop.time() > deadline:
                    log.warning("stream %s: its end could not be recorded; it is deleted later", self._tag)
                    return
                await asyncio.sleep(0.5)

    async def _mark_lost(self) -> None:
        await mark_lost(self._log, self.id)
