"""``StreamLog``: the stream log of this instance as the request path sees it (the package docstring
has the design)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ...errors import StoreError
from ..instances import Instances
from ..store import STREAMS_TABLE, Store, Where
from . import inbox, takeover
from .config import Context, ResumeConfig
from .errors import StreamLogUnavailable, StreamNotFound, TooManyReaders, TooManyStreams
from .format import (
    RECORD_ROW,
    EncodeError,
    Record,
    check_stream_id,
    fits_record,
    log_tag,
    new_stream_id,
    request_blob,
)
from .producer import Producer
from .readers import Reader, read_record
from .takeover import Claim

log = logging.getLogger("chatstream")

TakeOverHook = Callable[[Claim], Awaitable[None]]


class StreamLog:
    """The resumable streams of one instance (one per process); resumable.py is the request path's
    use of it (a streamed /api/chat or /api/v1/chat/completions response, RESUMABLE_STREAMS on).

    Producing: ``producer = log.start(...)`` before the response starts (send ``x-stream-id:
    producer.id``); each encoded piece through ``producer.append`` (send what it returns); on a
    hang-up ``producer.caller_gone()``, and relaying goes on; ``producer.stop_requested`` watched;
    ``producer.finish()`` in ``finally``. Each one's docstring says how. The store is never waited
    on: if it fails, the live stream is unaffected and ``producer.resumable`` turns False.

    Resuming: ``reader = await log.open_reader(id, after, caller)``, then stream ``reader`` (an SSE
    body in ``reader.route``'s format). Cancelling: ``await log.cancel(id, caller)``. Errors:
    errors.py. Taking over: with ``take_over`` given, a reader that finds the producer gone claims
    the stream and runs ``take_over(claim)`` as a task, which continues the answer on
    ``claim.producer`` as a new stream's; without it, such readers end with ``stream_lost``. When
    this instance stops (SIGTERM): ``move_readers()``, then ``drain()``, and ``close()`` at
    shutdown. The store and ``instances`` stay their owner's to close."""

    def __init__(
        self,
        store: Store,
        instances: Instances,
        encode_error: EncodeError,
        config: ResumeConfig | None = None,
        take_over: TakeOverHook | None = None,
    ):
        self.store = store
        self.instances = instances
        self.config = config or ResumeConfig()
        self._ctx = Context(store, instances, self.config, encode_error)
        self._take_over = take_over
        self._producers: dict[str, Producer] = {}
        self._claims: dict[str, asyncio.Future[bool]] = {}
        self._draining = False  # this instance hands its streams over: it takes none over itself
        self._inbox: asyncio.Task | None = None  # inbox.serve, while this instance produces anything

    # -- producing ------------------------------------------------------------------------------

    def start(
        self, route: str, owner: str | None, request: Mapping[str, Any] | None = None, request_id: str | None = None
    ) -> Producer:
        """A new resumable stream produced here (no I/O: storing starts in the background).
        ``route``: the request path's name for its events' format (given back with a ``Claim``);
        ``request``: what a continuation needs to go on (the route's params, JSON). TooManyStreams:
        stream it without resumability."""
        ctx, cfg = self._ctx, self.config
        if ctx.closed:
            raise RuntimeError("the stream log is closed")
        if len(self._producers) >= cfg.max_producers:
            raise TooManyStreams("too many resumable streams on this instance")
        now = ctx.now()
        stream_id = new_stream_id(now if self.store.clock.observed else None)
        body = None
        if request is not None:
            try:
                body = json.dumps(request, separators=(",", ":"), ensure_ascii=False)
            except (TypeError, ValueError) as exc:
                log.warning(
                    "stream %s: its request cannot be stored (%s): it cannot be continued", log_tag(stream_id), exc
                )
        inline = body is not None and fits_record(body)
        record = Record(
            stream_id=stream_id,
            route=route,
            owner=owner,
            instance=self.instances.id,
            epoch=1,
            created=now,
            expires=now + cfg.max_stream_seconds + cfg.ttl_seconds,
            request_id=request_id,
            request=body if inline else None,
            request_stored=body is not None and not inline,
        )
        producer = Producer(ctx, record, large_request=None if inline else body)
        self._run(producer)
        return producer

    def _run(self, producer: Producer) -> None:
        """Known here (readers, the inbox) while it runs."""
        self._producers[producer.id] = producer
        if self._inbox is None or self._inbox.done():
            self._inbox = self._ctx.spawn(inbox.serve(self._ctx, self._producers))

        async def run() -> None:
            try:
                await producer.run()
            finally:
                if self._producers.get(producer.id) is producer:
                    del self._producers[producer.id]

        self._ctx.spawn(run())

    # -- reading and cancelling -----------------------------------------------------------------

    async def open_reader(self, stream_id: str, after: int | None, caller: str | None) -> Reader:
        """The events of ``stream_id`` after event ``after`` (the last id the caller has; None: from
        the start), then the live ones to the final event. Raises before anything is sent:
        StreamNotFound (unknown, expired, malformed, another caller's), PastTheEnd, TooManyReaders,
        StreamLogUnavailable."""
        check_stream_id(stream_id)
        if after is not None and after < 0:
            raise ValueError("an event id is never negative")
        if self._ctx.closed:
            raise StreamLogUnavailable("the stream log is closed")
        if self._ctx.readers.total() >= self.config.max_readers:
            raise TooManyReaders("too many readers on this instance")
        if self._ctx.readers[stream_id] >= self.config.max_readers_per_stream:
            raise TooManyReaders("too many readers of this stream")
        return await Reader(self._ctx, stream_id, after or 0, self.producing, self.take_over).opened(caller)

    def producing(self, stream_id: str) -> Producer | None:
        """The stream's producer here, unless it went on elsewhere (for readers)."""
        producer = self._producers.get(stream_id)
        return producer if producer is not None and not producer.moved.is_set() else None

    async def cancel(self, stream_id: str, caller: str | None) -> bool:
        """Ask the stream's producer (on whatever instance) to stop. True if the stream was live,
        False if it had already ended. StreamNotFound / StreamLogUnavailable as for open_reader."""
        check_stream_id(stream_id)
        producer = self.producing(stream_id)
        if producer is not None:
            if producer.owner is not None and producer.owner != caller:
                raise StreamNotFound("another caller's")
            if producer.end is not None:
                return False
            producer.request_stop("cancelled")
            return True
        try:
            record = await read_record(self._ctx, stream_id, caller)
            if record.state != "live":
                return False
            await inbox.cancel(self._ctx, record.instance, stream_id)
            if not await self.instances.alive(record.instance):  # nobody reads that inbox: a takeover must stop
                fields = {"PartitionKey": stream_id, "RowKey": RECORD_ROW, "cancelled": True}
                await self.store.merge(STREAMS_TABLE, fields)
        except StoreError as exc:
            raise StreamLogUnavailable(f"the stream's store is unavailable ({exc})") from None
        return True

    # -- taking over ----------------------------------------------------------------------------

    async def take_over(self, stream_id: str, received: int) -> bool:
        """A reader here found the producer gone: claim the stream and continue it with the hook.
        Concurrent readers here share one attempt (the first one's ``received``: ``Producer.stand_in_to``).
        True: the stream goes on (here, elsewhere, over; or another instance takes it: this one
        drains or is full); False: it cannot be continued (stream_lost)."""
        if self._take_over is None:
            return False
        if self._ctx.closed or self._draining or len(self._producers) >= self.config.max_producers:
            return True
        pending = self._claims.get(stream_id)
        if pending is None:
            pending = self._claims[stream_id] = asyncio.ensure_future(self._claim(stream_id, received))
            pending.add_done_callback(lambda _: self._claims.pop(stream_id, None))
        return await asyncio.shield(pending)

    async def _claim(self, stream_id: str, received: int) -> bool:
        won = await takeover.claim(self._ctx, stream_id, received)
        if isinstance(won, Claim):
            self._run(won.producer)
            self._ctx.spawn(self._continue(won))
        return won is not False

    async def _continue(self, won: Claim) -> None:
        assert self._take_over is not None
        try:
            await self._take_over(won)
        except Exception:  # the request path's bug: the stream still ends (stream_lost)
            log.exception("stream %s: continuing it failed", log_tag(won.producer.id))
        finally:
            won.producer.finish()

    def move_readers(self) -> None:
        """This instance stops (SIGTERM): every reader it serves, and any opened from now on, ends
        with ``stream_moved`` now (``Reader.leaving``), so that its client resumes elsewhere at once."""
        if not self._ctx.leaving.is_set():
            log.warning("stream log: %d reader(s) here move to another instance", self.readers)
        self._ctx.leaving.set()

    async def drain(self, timeout: float = 5.0) -> int:  # noqa: ASYNC109 - the documented interface
        """Hand every stream produced here over (``Producer.hand_over``), at once, and take nothing over
        from now on; how many were."""
        self._draining = True
        producers = [p for p in self._producers.values() if not p.moved.is_set()]
        handed = await asyncio.gather(*(p.hand_over(timeout) for p in producers))
        return sum(handed)

    # -- housekeeping ---------------------------------------------------------------------------

    async def close(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 - the documented interface
        """Stop: producers get ``timeout`` seconds to store what they hold, then every task of this
        log is cancelled."""
        producers = list(self._producers.values())
        self._ctx.closed = True
        await asyncio.gather(*(p.wait_stored(timeout) for p in producers))
        for pending in list(self._claims.values()):
            pending.cancel()
        await self._ctx.close()

    @property
    def tasks(self) -> frozenset[asyncio.Task]:
        """This log's background tasks (tests: kill an instance by cancelling them)."""
        return frozenset(self._ctx.tasks)

    @property
    def readers(self) -> int:
        """The readers this instance serves now."""
        return self._ctx.readers.total()

    @property
    def producers(self) -> int:
        """The streams this instance produces now."""
        return len(self._producers)


async def sweep(store: Store, config: ResumeConfig) -> int:
    """The duty's sweep of resumable streams (``config.sweep_seconds`` apart; shared.py gives it to
    ``Instances``): delete what has expired, a stream's blobs, then its rows; the number of rows
    deleted (at most ``config.max_sweep``). A stream's record is only marked ``swept`` with its
    blobs' first delete, and deleted at the next sweep, after its blobs' second: a blob made by a
    create the store applied late (a producer's or a reader's, sent while the stream was live, queued
    in a busy store past the TTL) lands after the first delete, and with the record gone nothing
    would find it again."""
    where = Where(
        less={"expires": store.clock.now()}, select=("expires", "request_blob", "swept"), limit=config.max_sweep
    )
    rows = await store.query(STREAMS_TABLE, where, timeout=10.0)
    gate = asyncio.Semaphore(8)

    async def delete(row: Any) -> int:
        stream_id = row["PartitionKey"]
        async with gate:
            try:
                if row["RowKey"] == RECORD_ROW:
                    if row.get("request_blob"):
                        await store.delete_blob(request_blob(stream_id))
                    await store.delete_blob(stream_id)
                    if not row.get("swept"):
                        swept = {"PartitionKey": stream_id, "RowKey": RECORD_ROW, "swept": True}
                        await store.merge(STREAMS_TABLE, swept, etag=row.etag)
                        return 0
                await store.delete(STREAMS_TABLE, stream_id, row["RowKey"], etag=row.etag)
                return 1
            except StoreError:
                return 0

    deleted = sum(await asyncio.gather(*(delete(row) for row in rows)))
    if deleted:
        log.info("resumable streams: %d expired rows deleted", deleted)
    return deleted
