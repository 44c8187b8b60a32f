"""Taking a stream over when its producer is gone: ``claim`` lets exactly one instance win a live
stream whose producing instance is dead (``Instances``: no beat for a lease, by the store's clock)
or that its producer handed over (``: handover`` in the log), and gives it what a continuation
needs (``Claim``).

The claim is two conditional writes: the record (instance → this one, epoch + 1, on its ETag: one
winner), then the fence in the log (``: epoch E L`` appended at the stored end, on the append
position: a producer that was only slow finds it at its next append and stops, ``Producer.moved``).
What was stored before the fence is the stream so far; the new producer appends after it, its ids
those of its epoch (``format.EPOCH_IDS``): never one the previous producer may have handed out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, replace
from typing import Any, Literal

from ... import sse
from ...errors import AlreadyExists, Modified, NotFound, StoreError
from ..store import STREAMS_TABLE
from .config import Context
from .format import (
    LOST,
    RECORD_ROW,
    Record,
    Tail,
    epoch_marker,
    log_tag,
    position,
    producer_events,
    record_over,
    request_blob,
    split_events,
)
from .producer import Producer

log = logging.getLogger("chatstream")


@dataclass(frozen=True)
class Claim:
    """A stream taken over by this instance: what the request path needs to continue the answer on
    ``producer`` (the stream's ``id``, ``route``, ``owner`` and ``epoch`` are its), driven to its end
    as a new stream's, after the stored ``events`` (as a reader replays them; the last: ``last_id``)."""

    request: dict[str, Any]  # the route's params, as the original request stored them
    request_id: str | None  # the app's request id of the original request (its charges)
    events: bytes
    last_id: int
    producer: Producer
    lost_events: bytes  # the stored events of the lost producer itself (after the previous takeover)
    # How many events the reader that asked for the takeover held past the stored end (the lost
    # producer's, unstored: ``stand_ins``).
    past_stored: int

    def stand_ins(self) -> bytes:
        """The continuation's events that stand for the ``past_stored`` ones (b"" when none): those of
        the positions up to ``producer.stand_in_to`` (ids differ per producer; positions agree), stored
        or not (when the continuation ends, its last write may still be on its way)."""
        stand_in_to = self.producer.stand_in_to
        if not stand_in_to:
            return b""
        ours = sse.split(self.producer.events_after(self.last_id, all_kept=True))[0]
        return sse.join(e for e in ours if position(sse.event_id(e) or 0) <= stand_in_to)

    def unstood(self) -> int:
        """How many of the ``past_stored`` it has not stood in for yet."""
        return max(0, self.past_stored - len(sse.split(self.stand_ins())[0]))

    async def stood_in(self) -> None:
        """Wait until every one is stood in for (the continuation's end may never come here); for ever
        if the continuation ends short: cancel it then."""
        while self.unstood():
            await self.producer.changed()


async def producer_gone(ctx: Context, record: Record, tail: Tail, growing: bool = False) -> bool:
    """Whether nobody produces the stream any more: it was handed over, or its instance is dead by
    the store's clock. Not while the log is ``growing`` (a reader saw it grow within a lease: proof
    of life whatever the beats say, and a busy instance's beats are late), nor while the stream is
    younger than a lease (its producer's first beat may still be on its way). StoreError when the
    store cannot tell."""
    if tail.handover or not record.instance:
        return True
    if growing or ctx.now() - record.created < ctx.instances.timing.lease_seconds:
        return False
    return not await ctx.instances.alive(record.instance)


async def claim(ctx: Context, stream_id: str, received: int) -> Claim | bool:
    """Take ``stream_id`` over for a reader that has the events up to ``received``: the claim, its
    producer not yet run (``StreamLog`` runs it). Else True: it goes on without this claim (another
    instance won it, its producer lives, or it is over), False: it cannot be continued (stream_lost)."""
    store = ctx.store
    tag = log_tag(stream_id)
    try:
        row = await store.get(STREAMS_TABLE, stream_id, RECORD_ROW)
        if row is None:
            return False
        record = Record.of(row)
        if record.state != "live":
            return True
        tail = Tail(0)
        events = bytearray(tail.feed(await store.read(stream_id)))  # (all of them: after id 0)
        if tail.end is not None or record.instance == ctx.instances.id or not await producer_gone(ctx, record, tail):
            return True
        request = record.request.encode() if record.request is not None else None
        if request is None and record.request_stored:
            found = await store.get_blob(request_blob(stream_id))
            request = found[0] if found is not None else None
        if request is None:
            log.warning("stream %s: its producer is gone and its request was not stored: it cannot be continued", tag)
            return False
    except StoreError as exc:
        log.warning("stream %s: its producer is gone, and the store failed on the takeover: %s", tag, exc)
        return False
    try:
        params = json.loads(request)
    except (ValueError, RecursionError):  # (never stored so)
        log.warning("stream %s: its producer is gone and its request does not parse: it cannot be continued", tag)
        return False
    await ctx.instances.first_beat()  # we produce it from now on: this instance is seen alive first
    won = replace(record, instance=ctx.instances.id, epoch=record.epoch + 1)
    try:
        won.etag = await store.replace(STREAMS_TABLE, won.row(), etag=record.etag)
    except (Modified, NotFound):
        return True
    except StoreError as exc:  # perhaps applied: then nobody produces it until its expiry
        log.warning("stream %s: the takeover's record write failed: %s", tag, exc)
        return False
    fenced = await _fence(ctx, won, tail, events)
    if fenced != "fenced":
        return fenced == "over"
    stored = split_events(bytes(events))
    fences = [*tail.fences, (won.epoch, tail.last_id)]
    stored_bytes = tail.offset + len(epoch_marker(won.epoch, tail.last_id))
    producer = Producer(ctx, won, stored=stored, stored_bytes=stored_bytes, fences=fences, received=received)
    if won.cancelled:
        producer.request_stop("cancelled")
    log.warning(
        "stream %s: its producer (%s) is gone; taken over here after event %d (epoch %d)",
        tag,
        record.instance,
        tail.last_id,
        won.epoch,
    )
    return Claim(
        request=params,
        request_id=won.request_id,
        events=bytes(events),
        last_id=tail.last_id,
        producer=producer,
        lost_events=producer_events(bytes(events), tail.epoch),
        past_stored=max(0, producer.stand_in_to - position(tail.last_id)),
    )


async def _fence(ctx: Context, won: Record, tail: Tail, events: bytearray) -> Literal["fenced", "over", "failed"]:
    """Append the epoch marker at the stored end (``tail`` and its ``events`` grow with what the old
    producer stored before it). "over": the old producer stored the end meanwhile (the record, ours
    now, says so); "failed": the store failed for ``give_up_seconds``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.config.give_up_seconds
    store = ctx.store
    while loop.time() < deadline:
        try:
            await store.append(won.stream_id, epoch_marker(won.epoch, tail.last_id), at=tail.offset)
            return "fenced"
        except Modified:  # the old producer's last write landed: fence after it
            more = b""
            with contextlib.suppress(StoreError):
                more = await store.read(won.stream_id, tail.offset)
            if more:
                events.extend(tail.feed(more))
                if tail.end is not None:
                    state = "lost" if tail.end == LOST else "ended"
                    over = record_over(won.stream_id, state, ctx.now() + ctx.config.ttl_seconds)
                    with contextlib.suppress(StoreError):  # else it expires later
                        await store.merge(STREAMS_TABLE, over, etag=won.etag)
                    return "over"
        except NotFound:  # it died before it made the blob: made here, then fenced
            try:
                await store.append_create(won.stream_id)
            except AlreadyExists:
                pass
            except StoreError:
                await asyncio.sleep(0.25)  # as any failure: not again at once
        except StoreError:
            await asyncio.sleep(0.25)
    log.warning("stream %s: the takeover could not fence the log (the store failed)", log_tag(won.stream_id))
    return "failed"
