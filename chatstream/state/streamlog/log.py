"""Resumable streams, the storage layer (issue #21): a stream's SSE events numbered, kept in the
shared store, replayed to any instance, followed live, cancelled from any instance, and deleted
after their TTL. The request path (routes, the relay) is not here: it drives this module through
``StreamLog.start`` (the producer side) and ``open_reader`` / ``cancel`` (the resume and cancel
routes). docs/resumable.md has the design, the costs and the guarantees.

What is stored (``chatstreamStreams`` table, ``chatstream-streams`` container):

- the event log: the append blob ``{id}``, whose content *is* the SSE stream with its ``id:``
  lines, written in whole events (a block never ends mid-event), ended by the comment ``: end``
  (the last event is the route's final one) or ``: lost`` (the last event is an error written by
  this module: the stream stopped being stored before its end);
- the stream's entity, PartitionKey = id, RowKey ``stream``: route, owner, producer instance,
  created, state (``live`` / ``ended`` / ``lost``), last id, size, ``expires`` (what the sweeper
  and the readers go by);
- per producing instance (process), partition ``i-{instance}``: the heartbeat row ``alive``
  (lease, beat, and the streams it is storing with their last ids) that tells a slow producer from
  a dead one and a live stream from a lost one, and the inbox of that instance:
  ``c-{id}`` (cancel this stream) and ``r-{id}-{reader}`` (a reader on another instance is
  following this stream, at ``read_at``). The instance reads its inbox with one query every
  ``inbox_seconds``, whatever the number of its streams.

The producer never waits for the store: ``append`` numbers the events and returns at once; one
task per stream writes them in the background, at most every ``fast_flush_seconds`` while a
reader on another instance follows the stream, otherwise every ``checkpoint_seconds`` (and
whenever ``flush_bytes`` are waiting, the final event is in, or the caller has hung up). Readers on
the producer's own instance are served from memory and woken on every append.

This package is the interface (``StreamLog`` here, and what the integrator imports from the
package); its parts: ids.py (routes, stream ids, Last-Event-ID), errors.py, config.py
(``ResumeConfig``), format.py (what is stored, ``EncodeError``, reading a stored log), calls.py
(bounded store calls), producer.py with kept.py and writer.py (the producer side), readers.py,
remote.py and liveness.py (the reader side), instance.py (heartbeat, inbox, sweeper)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
from azure.data.tables import UpdateMode
from azure.data.tables.aio import TableClient
from azure.storage.blob.aio import ContainerClient

from ..legacy_store import (
    CALL_TIMEOUT,
    STREAMS_CONTAINER,
    STREAMS_TABLE,
    BlobReads,
    NoSasAccess,
    Store,
    StoreUnavailable,
)
from .calls import bounded
from .config import ResumeConfig
from .errors import BadLastEventId, StreamNotFound, TooManyReaders, TooManyStreams
from .format import EncodeError
from .ids import ROUTES, Route, check_stream_id, new_stream_id
from .instance import InstanceWork
from .producer import Producer
from .readers import Reader, ReaderSlots, follow_local
from .remote import RemoteReaders

T = TypeVar("T")
log = logging.getLogger("chatstream")


class StreamLog:
    """The resumable-streams store of one instance (one per process). The integrator's contract:

    Producing (a streamed /api/chat or /api/v1/chat/completions response, RESUMABLE_STREAMS on):
      1. ``producer = log.start(route, owner)`` before the response starts; send the header
         ``x-stream-id: producer.id``. (TooManyStreams: stream it without resumability.)
      2. For each encoded piece: ``out = producer.append(data, final=...)``, and send ``out``
         (not ``data``) to the live caller; ``final=True`` with the route's last event(s).
      3. The relay must outlive the HTTP response: on a hang-up call ``producer.caller_gone()`` and
         keep relaying (appending) to the end; do not close the upstream.
      4. Watch ``producer.stop_requested`` (an asyncio.Event; cancel on any instance, or nobody
         reading for RESUME_ABANDON_SECONDS): close the upstream at once and append the route's
         final event with finish_reason ``cancelled`` (final=True).
      5. ``producer.finish()`` in ``finally``.
      The store is never waited on: if it fails, the live stream is unaffected and
      ``producer.resumable`` turns False (readers elsewhere get ``stream_lost``).

    Resuming: ``reader = await log.open_reader(id, parse_last_event_id(header, query), caller)``,
    then stream ``reader`` (an SSE body in ``reader.route``'s format). Cancelling:
    ``await log.cancel(id, caller)``. Errors: StreamNotFound 404 (unknown, expired, malformed, or
    another caller's), BadLastEventId 400, TooManyReaders 429, StoreUnavailable 503.

    ``close()`` at shutdown. The store (``Store``) stays the integrator's to close."""

    def __init__(
        self, store: Store, encode_error: EncodeError, config: ResumeConfig | None = None, instance: str | None = None
    ):
        self.store = store
        self.encode_error = encode_error
        self.config = config or ResumeConfig()
        self.instance = instance or secrets.token_hex(8)
        self._producers: dict[str, Producer] = {}
        self._tasks: set[asyncio.Task] = set()
        self._slots = ReaderSlots()
        self._table: TableClient | None = None
        self._container: ContainerClient | None = None
        self._reads: BlobReads | None = None
        self._sdk_reads = False  # no SAS with this identity: remote reads through the SDK
        self._closed = False
        self._work = InstanceWork(self, self._producers)  # heartbeat, inbox, sweeper
        self._remote = RemoteReaders(self)
        self.fast_writers = 0  # see StreamStore
        self.remote_readers = 0
        self.bulk = asyncio.Semaphore(self.config.bulk_calls)

    # -- the integrator's side ----------------------------------------------------------------

    def start(self, route: Route, owner: str | None) -> Producer:
        """A new resumable stream produced here (no I/O: storing starts in the background)."""
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}")
        if self._closed:
            raise RuntimeError("the stream log is closed")
        if len(self._producers) >= self.config.max_producers:
            raise TooManyStreams("too many resumable streams on this instance")
        producer = Producer(self, new_stream_id(), route, owner)
        self._producers[producer.id] = producer
        self._work.ensure_background()
        self._spawn(producer._run())
        return producer

    async def open_reader(self, stream_id: str, after: int | None, caller: str | None) -> Reader:
        """The events of ``stream_id`` after event ``after`` (None: from the start), then the live
        ones to the final event. Raises before anything is sent (see the class docstring)."""
        check_stream_id(stream_id)
        if self._closed:
            raise StoreUnavailable("the stream log is closed")
        if after is not None and (not isinstance(after, int) or after < 0 or after >= 10**15):
            raise BadLastEventId("Last-Event-ID must be a non-negative integer of at most 15 digits")
        if self._slots.full(stream_id, self.config):
            raise TooManyReaders("too many readers")
        self._work.ensure_sweeper()
        producer = self._producers.get(stream_id)
        if producer is not None:
            if producer.owner is not None and producer.owner != caller:
                raise StreamNotFound("no such stream")
            if after is not None and after > producer.last_id and not producer._kept.lost:
                raise BadLastEventId(f"Last-Event-ID {after} is past the end of the stream ({producer.last_id})")
            return self._slots.open(
                stream_id, producer.route, lambda: follow_local(producer, after or 0, self.encode_error)
            )
        route, events = await self._remote.open(stream_id, after or 0, caller)
        return self._slots.open(stream_id, route, events)

    async def cancel(self, stream_id: str, caller: str | None) -> bool:
        """Ask the stream's producer (on whatever instance) to stop. True if the stream was live,
        False if it had already ended. StreamNotFound / StoreUnavailable as for open_reader."""
        check_stream_id(stream_id)
        self._work.ensure_sweeper()
        producer = self._producers.get(stream_id)
        if producer is not None:
            if producer.owner is not None and producer.owner != caller:
                raise StreamNotFound("no such stream")
            if producer._kept.end:
                return False
            producer._request_stop("cancelled")
            return True
        entity = await self._remote.stream_entity(stream_id, caller)
        if entity.get("state") != "live":
            return False
        now = time.time()
        message = {"PartitionKey": f"i-{entity['instance']}", "RowKey": f"c-{stream_id}", "expires": now + 60.0}
        await self._call_table(lambda t: t.upsert_entity(message, mode=UpdateMode.REPLACE))
        return True

    async def close(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 - the documented interface (docs/resumable.md)
        """Stop: producers get ``timeout`` seconds to store what they hold, then every task of this
        log is cancelled."""
        self._closed = True
        writers = [asyncio.ensure_future(p._done.wait()) for p in list(self._producers.values())]
        if writers:
            await asyncio.wait(writers, timeout=timeout)
            for waiter in writers:
                waiter.cancel()
            await asyncio.gather(*writers, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def sweep_once(self) -> int:
        """Delete what has expired (blobs, then their rows); the number of rows deleted."""
        return await self._work.sweep_once()

    # -- for its parts -------------------------------------------------------------------------

    @property
    def _readers(self) -> int:
        """The readers this instance serves now."""
        return self._slots.total

    async def _beat_first(self) -> None:
        """Wait (bounded) for this instance's first heartbeat, so no reader sees a stream before its lease."""
        await self._work.beat_first()

    def _release(self, producer: Producer) -> None:
        if self._producers.get(producer.id) is producer:
            del self._producers[producer.id]

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
        if self._closed:  # nothing starts after close()
            coro.close()
            return None
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _call_table(self, op: Callable[[TableClient], Awaitable[T]], limit: float = CALL_TIMEOUT) -> T:
        if self._table is None:
            self._table = await self.store.table(STREAMS_TABLE)
        return await bounded(op(self._table), limit)

    async def _read_range(self, stream_id: str, offset: int) -> bytes:
        """The stream's stored bytes from ``offset`` (a remote reader's poll: the cheap path)."""
        if not self._sdk_reads:
            if self._reads is None:
                self._reads = await self.store.blob_reads(STREAMS_CONTAINER)
            try:
                return await bounded(self._reads.read(stream_id, offset))
            except NoSasAccess as exc:
                log.warning("resumable streams: remote readers read through the SDK: %s", exc)
                self._sdk_reads = True

        async def read(container: ContainerClient) -> bytes:
            download = await container.get_blob_client(stream_id).download_blob(offset=offset)
            return await download.readall()

        try:
            return await self._call_blob(read)
        except ResourceNotFoundError:
            return b""
        except HttpResponseError as exc:
            if exc.status_code == 416:  # nothing past offset (Azure; Azurite answers empty)
                return b""
            raise StoreUnavailable(f"the store failed (HTTP {exc.status_code})") from None

    async def _call_blob(self, op: Callable[[ContainerClient], Awaitable[T]]) -> T:
        if self._container is None:
            self._container = await self.store.container(STREAMS_CONTAINER)
        return await bounded(op(self._container))
