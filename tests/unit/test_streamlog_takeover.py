"""The stream log's fixes of issue #29 (rows within Table storage's limits, one clock, loops that
survive) and issue #30's storage side (another instance takes a stream over when its producer dies,
is fenced or drains), on the in-process store; and how closely a reader elsewhere follows."""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from dataclasses import replace
from typing import Any

import pytest
from memory_store import Fault, MemoryData

from chatstream.state.instances import Instances
from chatstream.state.store import STREAMS_TABLE, Row, StoreClock, check_entity
from chatstream.state.streamlog.errors import PastTheEnd, StreamNotFound
from chatstream.state.streamlog.format import RECORD_ROW, Record, epoch_id, position, started_at
from chatstream.state.streamlog.log import StreamLog
from chatstream.state.streamlog.producer import Producer
from chatstream.state.streamlog.takeover import Claim

from .streamlog_helpers import (
    DONE,
    LIFE,
    QUICK,
    ROOT,
    CountingStore,
    delta,
    encode_error,
    event,
    events_of,
    ids_in,
    instances,
    kill,
    numbered,
    open_when_visible,
    produce,
    read_all,
    regenerating,
)

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): leases, cadences and
# limits run in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time


# -- issue #29: bounded rows, one clock, loops that survive ---------------------------------------


async def test_a_thousand_streams_on_one_instance_write_only_rows_within_table_storage_limits():
    """The old heartbeat row listed every stream it stored (~35,000 characters at max_producers
    1,000: over a property's 64 KiB, so the write was refused and the heartbeat task ended).
    Liveness is now one row per instance that lists nothing; every row written stays in bounds."""
    async with instances(2, **QUICK) as (a, b):
        producers = [a.start("chat", f"caller{i}", request={"n": i}) for i in range(1000)]
        for p in producers:
            p.append(delta(0))
        await asyncio.sleep(1.0)
        data = a.store.data  # type: ignore[attr-defined]
        rows = [values for partition in data.tables[STREAMS_TABLE].values() for values, _ in partition.values()]
        for row in rows:
            check_entity(row)  # what Table storage would refuse: none
        instance_row = data.tables[STREAMS_TABLE]["instances"][a.instances.id][0]
        assert set(instance_row) == {"PartitionKey", "RowKey", "at", "lease"}
        assert await b.instances.alive(a.instances.id)
        assert all(p.resumable for p in producers)
        reader = await b.open_reader(producers[-1].id, None, "caller999")
        await produce(producers[-1], [])
        assert await read_all(reader) == numbered([delta(0), DONE])
        for p in producers[:-1]:
            await produce(p, [], gap=0)


@pytest.mark.parametrize("skew", [30.0, -30.0])
async def test_an_instance_whose_clock_is_thirty_seconds_off_is_read_like_any_other(skew):
    """Everything that crosses instances is on the store's clock: a young stream of an instance
    whose clock is 30 s ahead (or behind) is waited for, not answered 404; its liveness and its
    expiry read the same on every instance. (Old code: the id carried the producer's own clock, so
    a record not yet written was 404 at once; expiry and leases compared two machines' clocks.)"""
    async with instances(2, skews=(skew, 0.0), **QUICK, ttl_seconds=1.0, sweep_every=3600) as (a, b):
        await a.instances.first_beat()
        slow_record = Fault("slow", ops=frozenset({"insert"}), table=STREAMS_TABLE, times=1, delay=0.6)
        producer = a.start("chat", None)
        a.store.inject(slow_record)  # type: ignore[attr-defined] - the record lands 0.6 s late
        started = time.monotonic()
        reader = await b.open_reader(producer.id, None, None)  # waited for, not 404
        assert 0.4 < time.monotonic() - started < 2.0
        assert abs(started_at(producer.id) - time.time()) < 2.0  # the store's clock, not A's own
        body = [delta(i) for i in range(30)]  # 0.6 s: longer than a lease, alive all along
        rest = asyncio.ensure_future(produce(producer, body, gap=0.02))
        assert await read_all(reader, limit=10) == numbered([*body, DONE])
        await rest
        assert await producer.wait_stored(5)
        await asyncio.sleep(0.3)
        assert await read_all(await b.open_reader(producer.id, None, None)) == numbered([*body, DONE])  # within its TTL
        await asyncio.sleep(0.9)
        for streams in (a, b):
            with pytest.raises(StreamNotFound):  # past it, on both
                await streams.open_reader(producer.id, None, None)


async def test_background_loops_survive_errors_that_are_not_outages():
    """The store answers 404 for its table for a while (it was deleted under the app; the edge
    re-creates it on use): the inbox, the readers and the sweep go on and recover. (Old code: the
    inbox and heartbeat loops ended on anything but StoreUnavailable, for good.)"""
    async with instances(2, **QUICK, sweep_every=0.1) as (a, b):
        producer = a.start("chat", None)
        producer.append(delta(0))
        reading = asyncio.ensure_future(read_all(await open_when_visible(b, producer.id, None)))
        a.store.inject(Fault("not_found", ops=frozenset({"query"}), times=40))  # type: ignore[attr-defined] - inbox, duty
        b.store.inject(Fault("not_found", ops=frozenset({"read", "get"}), times=5))  # type: ignore[attr-defined]
        async with asyncio.timeout(5):  # until every injected answer was given
            while any(f.times for s in (a, b) for f in s.store.faults):  # type: ignore[attr-defined]
                await asyncio.sleep(0.05)
        producer.append(delta(1))
        assert await b.cancel(producer.id, None) is True  # the inbox reads again
        async with asyncio.timeout(2):
            await producer.stop_requested.wait()
        await produce(producer, [], final=event({"finish_reason": "cancelled"}, b"done"))
        assert [n for n, _ in events_of(await reading)] == [1, 2, 3]


# -- issue #30: another instance takes the stream over ---------------------------------------------


async def test_a_dead_producer_is_taken_over_and_every_reader_gets_one_whole_answer():
    calls: list[Claim] = []
    async with instances(3, take_over=regenerating(calls=calls), **QUICK) as (a, b, c):
        producer = a.start("chat", "alice", request={"deltas": 80}, request_id="req-1")
        for i in range(30):
            producer.append(delta(i))
            await asyncio.sleep(0.01)
        reader_b = await open_when_visible(b, producer.id, None, "alice")
        reader_c = await open_when_visible(c, producer.id, 5, "alice")
        got_b = b""
        async with asyncio.timeout(5):
            while len(events_of(got_b)) < 30:
                got_b += await anext(reader_b)
        kill(a)
        killed = time.monotonic()
        first_new = None
        async with asyncio.timeout(10):
            async for chunk in reader_b:
                first_new = first_new or time.monotonic()
                got_b += chunk
        got_c = await read_all(reader_c)
        expected = numbered([delta(i) for i in range(80)] + [DONE], seam=30)
        assert got_b == expected and got_c == expected[expected.index(b"id: 6\n") :]
        assert len(calls) == 1 and calls[0].last_id == 30 and calls[0].producer.owner == "alice"
        assert calls[0].request_id == "req-1" and calls[0].request == {"deltas": 80}
        assert calls[0].events == numbered([delta(i) for i in range(30)]) and calls[0].producer.epoch == 2
        assert first_new is not None
        print(f"\nproducer killed: new output on the other instance after {first_new - killed:.2f} s (lease 0.4 s)")
        assert first_new - killed < LIFE.lease_seconds + 1.5
        late = await read_all(await c.open_reader(producer.id, None, "alice"))  # later, from the store
        assert late == expected


async def test_readers_on_two_instances_racing_for_a_dead_stream_claim_it_once():
    calls: list[Claim] = []
    async with instances(5, take_over=regenerating(calls=calls), **QUICK) as logs:
        a, others = logs[0], logs[1:]
        producer = a.start("openai", None, request={"deltas": 40})
        for i in range(10):
            producer.append(delta(i))
        readers = [await open_when_visible(streams, producer.id, None) for streams in others for _ in range(2)]
        await asyncio.sleep(0.3)
        kill(a)
        got = await asyncio.gather(*(read_all(r) for r in readers))
        assert all(g == numbered([delta(i) for i in range(40)] + [DONE], seam=10) for g in got)
        assert len(calls) == 1


async def test_a_slow_producer_declared_dead_is_fenced_and_stores_nothing_after_the_takeover():
    async with instances(2, take_over=regenerating(gap=0.005), **QUICK) as (a, b):
        producer = a.start("chat", None, request={"deltas": 50})
        for i in range(10):
            producer.append(delta(i))
        reader = await open_when_visible(b, producer.id, None)
        await asyncio.sleep(0.3)  # the ten are stored
        # A slows down (its beats time out, its appends take 1.2 s): B finds it dead and takes over
        # while A's next append is still on its way; when it lands, its position is gone.
        a.store.inject(Fault("slow", ops=frozenset({"replace", "insert"}), times=10**9, delay=0.5))  # type: ignore[attr-defined]
        a.store.inject(Fault("slow", ops=frozenset({"append"}), times=10**9, delay=1.2))  # type: ignore[attr-defined]
        for i in range(10, 20):
            producer.append(delta(i))  # handed out to A's live caller; its write is the one fenced
            await asyncio.sleep(0.01)
        got = await read_all(reader, limit=10)
        async with asyncio.timeout(5):
            await producer.moved.wait()
        assert producer.stop_reason == "taken_over" and producer.stop_requested.is_set()
        blob = bytes(a.store.data.blobs[producer.id][0])  # type: ignore[attr-defined]
        before, marker, after = blob.partition(b": epoch 2 ")
        first, rest = ids_in(before), ids_in(after)
        assert got == numbered([delta(i) for i in range(50)] + [DONE], seam=len(first))
        assert marker and first == list(range(1, len(first) + 1)) and len(first) <= 20
        # A wrote nothing after the fence: B's go on from it, with its epoch's ids
        assert rest == [epoch_id(2, i) for i in range(len(first) + 1, 52)]
        assert b": epoch" not in after and after.endswith(b": end\n\n")
        assert producer.moved_event().startswith(b"event: error\n")  # what A's live caller is told


async def test_a_last_write_of_the_dead_producer_landing_as_the_claim_is_made_is_fenced_after():
    """The dead producer's last write lands between the claim's read of the log and its fence: the
    fence fails on its position, goes after that write, and the claim counts it as stored (its
    events, its last id), so that the continuation goes on from it: one whole answer."""
    calls: list[Claim] = []
    async with instances(2, take_over=regenerating(calls=calls), **QUICK) as (a, b):
        producer = a.start("chat", None, request={"deltas": 40})
        for i in range(10):
            producer.append(delta(i))
        reader = await open_when_visible(b, producer.id, None)
        got = b""
        async with asyncio.timeout(5):
            while len(events_of(got)) < 10:
                got += await anext(reader)
        kill(a)
        replace = b.store.replace

        async def landing_first(table: str, entity: Any, **kw: Any) -> str:
            if entity.get("RowKey") == RECORD_ROW:
                b.store.replace = replace  # type: ignore[method-assign]
                blob = b.store.data.blobs[producer.id][0]  # type: ignore[attr-defined]
                await b.store.append(producer.id, numbered([delta(10)], first=11), at=len(blob))
            return await replace(table, entity, **kw)

        b.store.replace = landing_first  # type: ignore[method-assign]
        got += await read_all(reader)
        assert got == numbered([delta(i) for i in range(40)] + [DONE], seam=11)
        assert len(calls) == 1 and calls[0].last_id == 11
        assert calls[0].events == numbered([delta(i) for i in range(11)])
        blob = bytes(b.store.data.blobs[producer.id][0])  # type: ignore[attr-defined]
        assert ids_in(blob.partition(b": epoch 2 11\n")[0]) == list(range(1, 12))


def test_a_record_an_earlier_version_ended_at_its_fence_reads_as_this_version_writes_it():
    """Before this version a fence that found the stream over also wrote ``finished`` and ``last_id``
    into the record: nothing reads them, so either version reads the other's record alike."""
    record = Record("s" * 30, "chat", None, "i-1", 2, 1.0, 2.0, state="ended")
    earlier = Row.of({**record.row(), "finished": 1.5, "last_id": 11}, "e")
    assert Record.of(earlier) == Record.of(Row.of(record.row(), "e")) == replace(record, etag="e")


async def test_a_handed_over_stream_is_taken_over_at_once_without_a_lease_to_wait_for():
    life = replace(LIFE, lease_seconds=5.0)
    async with instances(2, take_over=regenerating(), life=life, **QUICK) as (a, b):
        producer = a.start("chat", None, request={"deltas": 30})
        for i in range(10):
            producer.append(delta(i))
        reader = await open_when_visible(b, producer.id, None)
        async with asyncio.timeout(5):
            got = await anext(reader)
        started = time.monotonic()
        ended = a.start("chat", None)
        await produce(ended, [])
        assert await a.drain() == 1  # SIGTERM: A hands over what it produces (the ended one needs none)
        assert producer.moved.is_set() and producer.stop_reason == "handed_over"
        # A's live caller got nothing past what was handed over (B goes on from there, under its ids):
        # the relay's last appends give it nothing, its final one the event that says resume.
        assert producer.last_id == 10 and producer.append(delta(10)) == b""
        assert producer.append(DONE, final=True) == producer.moved_event()
        assert await b.instances.alive(a.instances.id)  # A is alive: no lease expired
        got += await read_all(reader)
        print(f"\nhanded over: the reader elsewhere had the continuation {time.monotonic() - started:.2f} s later")
        assert got == numbered([delta(i) for i in range(30)] + [DONE], seam=10)
        assert time.monotonic() - started < 2.0


async def stored_to_ten_then_killed(a: StreamLog, deltas: int) -> Producer:
    """A stream on ``a`` (its request: ``deltas`` deltas) whose caller had events 1..20 of which only
    1..10 were stored (its writes trail by up to a checkpoint: the store fails the rest), then ``a``
    dies."""
    producer = a.start("chat", None, request={"deltas": deltas})
    for i in range(10):
        producer.append(delta(i))
    producer.caller_gone()  # stores what is in hand now
    await asyncio.sleep(0.3)
    a.store.inject(Fault("unavailable", ops=frozenset({"append"}), times=10**9))  # type: ignore[attr-defined]
    for i in range(10, 20):
        producer.append(delta(i))
    kill(a)
    return producer


async def test_a_last_event_id_a_dead_producer_never_stored_ends_with_stream_lost():
    """The dead producer's caller had events 1..20; only 1..10 were stored (its writes trail by up
    to a checkpoint). The continuation makes 11.. again, under its own epoch's ids (a model does
    not write the same text twice): a resume after 15, or after 40, cannot be made whole and ends
    with stream_lost at once, never with other text; one after 10 gets the continuation exactly."""
    async with instances(2, take_over=regenerating(), **{**QUICK, "checkpoint_seconds": 30.0}) as (a, b):
        producer = await stored_to_ten_then_killed(a, 30)
        reader = await b.open_reader(producer.id, 15, None)  # opened before the takeover: it follows it
        got = events_of(await read_all(reader))
        assert [n for n, _ in got] == [16] and b'"type":"stream_lost"' in got[0][1], got
        for after in (15, 20, 40):  # after it
            got = events_of(await read_all(await b.open_reader(producer.id, after, None)))
            assert [n for n, _ in got] == [after + 1] and b'"type":"stream_lost"' in got[0][1], got
        whole = await read_all(await b.open_reader(producer.id, 10, None))
        assert whole == numbered([delta(i) for i in range(10, 30)] + [DONE], 11, seam=10)
        with pytest.raises(PastTheEnd):
            await b.open_reader(producer.id, epoch_id(2, 40), None)


async def test_a_reader_ahead_of_the_log_long_after_its_producer_went_silent_is_not_made_to_wait():
    """A reader whose client has ids the dead producer never stored waits for that producer (a slow
    one only stores them late) before the takeover ends it with stream_lost: for give_up_seconds,
    counted from when the producer's instance went silent, not from when this reader first looked.
    A reading that comes after others were cut (instances stopped one after the other) is not made
    to wait again, and its client's reconnect bound does not run out (chaos seed 7)."""
    patience = 3.0
    quick = {**QUICK, "checkpoint_seconds": 30.0, "give_up_seconds": patience}
    async with instances(2, take_over=regenerating(), **quick) as (a, b):
        producer = await stored_to_ten_then_killed(a, 30)
        await asyncio.sleep(LIFE.lease_seconds + patience + 0.5)  # silent for longer than the patience
        opened = asyncio.get_running_loop().time()
        got = events_of(await read_all(await b.open_reader(producer.id, 15, None)))
        took = asyncio.get_running_loop().time() - opened
        assert [n for n, _ in got] == [16] and b'"type":"stream_lost"' in got[0][1], got
        assert took < patience - 0.5, f"{took:.2f} s: the patience counted again from this reading"


async def test_a_continuation_only_a_stream_lost_reader_asked_for_stops_once_past_its_position():
    """As above, the log holding 1..10 of the caller's 1..20: the reader after 15 that asks for the
    takeover gets stream_lost, and nobody else reads. The continuation (1,000 deltas, 10 s) runs on
    only until its log holds position 15 (its events up to there are what that caller is charged:
    Claim.stand_ins) and its young seconds are past, then stops (abandoned); a later reader after 10
    gets the stream to that cut, one final event."""
    cfg = {**QUICK, "checkpoint_seconds": 30.0, "young_seconds": 0.3}
    async with instances(2, take_over=regenerating(), **cfg) as (a, b):
        producer = await stored_to_ten_then_killed(a, 1000)
        got = events_of(await read_all(await b.open_reader(producer.id, 15, None)))
        assert [n for n, _ in got] == [16] and b'"type":"stream_lost"' in got[0][1], got
        continuation = b.producing(producer.id)
        assert continuation is not None and continuation.stand_in_to == 15
        async with asyncio.timeout(5):
            await continuation.stop_requested.wait()
        assert continuation.stop_reason == "abandoned"
        rest = events_of(await read_all(await b.open_reader(producer.id, 10, None)))
        assert 5 <= len(rest) - 1 < 500 and rest[-1][1] == DONE[:-2], len(rest)
        assert [position(n) for n, _ in rest] == list(range(11, 11 + len(rest)))


async def test_the_stand_ins_of_a_continuation_that_ran_to_its_end_are_all_it_generated_stored_or_not():
    """As above, but the continuation is short: it runs to its end, and its store is slow, so its
    last events are not stored yet when it ends, which is when the request path reads the stand-ins
    (Endpoint._charge_received). They are the continuation's events up to the reader's position,
    stored or not: before, only the stored ones (a chaos soak charged two lost parts 1 and 2
    tokens below what their callers had received, the continuation's last write still in flight)."""
    stand_ins: list[bytes] = []
    done = asyncio.Event()

    async def hook(claim: Claim) -> None:
        for i in range(position(claim.last_id), 20):
            claim.producer.append(delta(i))
            await asyncio.sleep(0.01)
        claim.producer.append(DONE, final=True)
        claim.producer.finish()
        stand_ins.append(claim.stand_ins())
        done.set()

    cfg = {**QUICK, "checkpoint_seconds": 30.0}
    async with instances(2, take_over=hook, **cfg) as (a, b):
        producer = await stored_to_ten_then_killed(a, 20)
        slow = b.store.inject(Fault("slow", ops=frozenset({"append"}), delay=1.0, times=10**9))  # type: ignore[attr-defined]
        got = events_of(await read_all(await b.open_reader(producer.id, 15, None)))
        assert [n for n, _ in got] == [16] and b'"type":"stream_lost"' in got[0][1], got
        async with asyncio.timeout(5):
            await done.wait()
        slow.times = 0
        assert [(position(n), e) for n, e in events_of(stand_ins[0])] == [(i + 1, delta(i)[:-2]) for i in range(10, 15)]


async def test_a_continuations_stand_ins_are_known_as_soon_as_it_has_them_not_only_at_its_end():
    """Chaos seed 2027, k2027-7-75: the caller held 12 tokens of which the log had 10; the taker's
    continuation had the stand-ins within ~0.6 s but the raise waited for its end, and its instance
    was killed 1.3 s later: the lost part stayed charged 10. ``Claim.stood_in`` returns once the
    continuation has kept position 15 (the reader's), while it still runs: the request path charges
    them then (Endpoint.take_over); a continuation that ends short never gets there."""
    claims: list[Claim] = []
    async with instances(
        2, take_over=regenerating(gap=0.05, calls=claims), **{**QUICK, "checkpoint_seconds": 30.0}
    ) as (
        a,
        b,
    ):
        producer = await stored_to_ten_then_killed(a, 40)
        got = events_of(await read_all(await b.open_reader(producer.id, 15, None)))
        assert [n for n, _ in got] == [16] and b'"type":"stream_lost"' in got[0][1], got
        claim = claims[0]
        async with asyncio.timeout(5):
            await claim.stood_in()
        assert claim.past_stored == 5 and claim.unstood() == 0
        assert [(position(n), e) for n, e in events_of(claim.stand_ins())] == [
            (i + 1, delta(i)[:-2]) for i in range(10, 15)
        ]
        assert not claim.producer.end_readable and not claim.producer.stop_requested.is_set()  # it goes on
    short: list[Claim] = []
    async with instances(2, take_over=regenerating(calls=short), **{**QUICK, "checkpoint_seconds": 30.0}) as (a, b):
        producer = await stored_to_ten_then_killed(a, 13)  # the continuation ends at 13, short of 15
        await read_all(await b.open_reader(producer.id, 15, None))
        await asyncio.sleep(1.0)
        assert short[0].past_stored == 5 and short[0].unstood() == 1  # (its stand-ins: 11..13, its final event)
        assert [position(n) for n, _ in events_of(short[0].stand_ins())] == [11, 12, 13, 14]


async def test_without_its_request_stored_a_dead_producers_stream_cannot_be_continued():
    calls: list[Claim] = []
    async with instances(2, take_over=regenerating(calls=calls), **QUICK) as (a, b):
        producer = a.start("chat", None)  # no request: nothing to continue from
        producer.append(delta(0))
        reader = await open_when_visible(b, producer.id, None)
        await asyncio.sleep(0.2)
        kill(a)
        events = events_of(await read_all(reader))
        assert [n for n, _ in events] == [1, 2] and b'"stream_lost"' in events[-1][1] and not calls


async def _ended_by_a_takeover_that_fails(sabotage) -> tuple[Any, Any]:
    """Two instances; a producer on the first with a request, a reader on the second; ``sabotage(b,
    producer)`` then the first killed: the reader's events end with stream_lost, nothing claimed; the
    record and the producer after."""
    calls: list[Claim] = []
    async with instances(2, take_over=regenerating(calls=calls), **QUICK) as (a, b):
        producer = a.start("chat", None, request={"deltas": 10})
        producer.append(delta(0))
        reader = await open_when_visible(b, producer.id, None)
        await asyncio.sleep(0.2)
        await sabotage(b, producer)
        kill(a)
        events = events_of(await read_all(reader))
        assert [n for n, _ in events] == [1, 2] and b'"stream_lost"' in events[-1][1] and not calls
        await asyncio.sleep(0.2)
        return await b.store.get(STREAMS_TABLE, producer.id, RECORD_ROW), producer


async def test_a_stored_request_that_does_not_parse_ends_the_readers_with_stream_lost():
    """(Never stored so: a hand edit.) Nothing is claimed (the record keeps its epoch); the readers
    end with stream_lost, the record says lost."""

    async def unparsable(b, producer) -> None:
        await b.store.merge(STREAMS_TABLE, {"PartitionKey": producer.id, "RowKey": RECORD_ROW, "request": "{"})

    record, producer = await _ended_by_a_takeover_that_fails(unparsable)
    assert record is not None and record.get("epoch", 0) == producer.epoch and record["state"] == "lost"


async def test_a_store_failing_during_the_takeover_ends_the_readers_with_one_final_error():
    async def failing(b, producer) -> None:
        b.store.inject(Fault("unavailable", ops=frozenset({"replace"}), table=STREAMS_TABLE, times=10**9))

    await _ended_by_a_takeover_that_fails(failing)


async def test_a_continued_stream_is_cancelled_abandoned_and_swept_like_any_other():
    async with instances(3, take_over=regenerating(gap=0.05), **QUICK) as (a, b, c):
        producer = a.start("chat", None, request={"deltas": 200})
        producer.append(delta(0))
        reader = await open_when_visible(b, producer.id, None)
        await asyncio.sleep(0.2)
        kill(a)
        got = b""
        async with asyncio.timeout(5):
            while len(events_of(got)) < 5:
                got += await anext(reader)
        assert await c.cancel(producer.id, None) is True  # reaches the continuation on B
        got += await read_all(reader)
        assert events_of(got)[-1][1] == DONE[:-2] and len(events_of(got)) < 200


async def test_a_stream_cancelled_while_its_producer_is_dead_is_not_generated_again():
    calls: list[Claim] = []
    async with instances(3, take_over=regenerating(calls=calls), **QUICK) as (a, b, c):
        producer = a.start("chat", None, request={"deltas": 100})
        producer.append(delta(0))
        await (await open_when_visible(b, producer.id, None)).aclose()
        kill(a)
        await asyncio.sleep(LIFE.lease_seconds + 0.2)
        assert await c.cancel(producer.id, None) is True  # nobody reads A's inbox: the record says it
        events = events_of(await read_all(await b.open_reader(producer.id, None, None)))
        # The takeover stopped at once: what was stored (delta 0, if it was), then the final event.
        assert len(calls) == 1 and calls[0].producer.stop_reason == "cancelled"
        assert [position(n) for n, _ in events] == list(range(1, len(events) + 1)) and len(events) <= 2
        assert events[-1][1] == DONE[:-2]


# -- the lag behind the live caller, and what the docs name ----------------------------------------


async def test_a_reader_elsewhere_follows_a_short_stream_closely_from_its_first_events():
    """40-delta streams (20 ms apart) with a reader on another instance from their start, at the
    default cadences: the producer reads its inbox every 100 ms while a stream is young, so it
    writes fast at once (issue #34: short streams lagged ~1.3 s, the inbox being read every 0.5 s)."""
    async with instances(2) as (a, b):
        lags: list[float] = []

        async def one(k: int) -> None:
            await asyncio.sleep(k * 0.05)
            producer = a.start("chat", None)
            appended: dict[int, float] = {}
            producer.append(delta(0))
            appended[1] = time.monotonic()
            reader = await open_when_visible(b, producer.id, None)

            async def generate() -> None:
                for i in range(1, 40):
                    await asyncio.sleep(0.02)
                    producer.append(delta(i))
                    appended[i + 1] = time.monotonic()
                producer.append(DONE, final=True)
                producer.finish()

            task = asyncio.ensure_future(generate())
            async with asyncio.timeout(10):
                async for chunk in reader:
                    now = time.monotonic()
                    lags.extend(now - appended[n] for n, _ in events_of(chunk) if n in appended)
            await task

        await asyncio.gather(*(one(k) for k in range(8)))
        lags.sort()
        p50, p99 = lags[len(lags) // 2], lags[int(len(lags) * 0.99)]
        print(f"\nreader elsewhere, 8 streams of 40 deltas: lag p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
        # Quiet: p99 < 0.45 s. The margins hold with both cores busy (p99 1.09 s seen under a full
        # make test beside other work); the fault this guards against lagged ~1.3 s at p50.
        assert p50 < 0.6 and p99 < 2.0, (p50, p99)


async def test_a_reader_elsewhere_polls_close_behind_each_write_not_anywhere_in_its_interval():
    """Blob calls of 30 ms, a delta every 20 ms: the producer appends every 100 ms (start to start),
    and the reader's poll after new bytes begins 0.9 x 100 ms after the last one began, so its polls
    drift earlier until one lands just before a write and finds nothing: each write is read within
    about a third of an interval. Polls paced 100 ms from the end of a read (before issue #44) ran
    130 ms apart and read each write anywhere 0-100 ms after it landed (median ~50 ms)."""
    async with instances(2) as (a, b):
        loop = asyncio.get_running_loop()
        landed: list[tuple[int, float]] = []  # (the blob's length after a write, when it landed)
        reads: list[tuple[int, float]] = []  # (the blob's length a read saw, when)
        append, read = a.store.append, b.store.read

        async def slow_append(name: str, data: bytes, *, at: int, timeout: float = 1.8) -> int:
            await asyncio.sleep(0.03)
            length = await append(name, data, at=at, timeout=timeout)
            landed.append((length, loop.time()))
            return length

        async def slow_read(name: str, offset: int = 0, *, timeout: float = 1.8) -> bytes:
            await asyncio.sleep(0.03)
            data = await read(name, offset, timeout=timeout)
            reads.append((offset + len(data), loop.time()))
            return data

        a.store.append, b.store.read = slow_append, slow_read  # type: ignore[method-assign]
        producer = a.start("chat", None)
        producer.append(delta(0))
        reader = await open_when_visible(b, producer.id, None)
        task = asyncio.ensure_future(produce(producer, [delta(i) for i in range(1, 150)], gap=0.02))
        await read_all(reader)
        await task
    gaps = []
    for length, at in landed[5:-1]:  # (past the reader's first polls; the end is read at once)
        seen = next((t for n, t in reads if n >= length and t >= at), None)
        assert seen is not None
        gaps.append(seen - at)
    gaps.sort()
    assert len(gaps) >= 20 and gaps[len(gaps) // 2] < 0.035, gaps
    assert len(reads) < 1.6 * len(landed), (len(reads), len(landed))  # the polls that find nothing


def test_every_module_path_the_stream_logs_docs_name_exists():
    """Docstrings and docs/resumable.md name only modules that exist (resumable.py said
    ``state/streamlog.py``, readers.py ``stream_remote.py``)."""
    package = ROOT / "chatstream" / "state" / "streamlog"
    texts = [*package.glob("*.py"), ROOT / "chatstream" / "resumable.py", ROOT / "docs" / "resumable.md"]
    bases = [package, ROOT / "chatstream" / "state", ROOT / "chatstream", ROOT, ROOT / "tests"]
    missing = []
    for path in texts:
        for name in re.findall(r"[\w/]+\.py\b", path.read_text()):
            if not any((base / name).exists() for base in bases):
                missing.append((path.name, name))
    assert not missing


@pytest.mark.skipif(not os.environ.get("STREAMLOG_FIGURES"), reason="a figure for docs/resumable.md")
async def test_figures_takeover_at_the_default_timings():
    """A producer killed at a random point of its beat, at the default lease (4.5 s), beat (1.5 s)
    and state check (1 s): when the reader elsewhere gets new output (issue #30's target: 15 s)."""
    waits = []
    for _ in range(5):
        data = MemoryData()
        logs = []
        for _ in range(2):
            store = CountingStore(data, StoreClock())
            logs.append(StreamLog(store, Instances(store), encode_error, take_over=regenerating(gap=0.02)))
        a, b = logs
        producer = a.start("chat", None, request={"deltas": 200})
        for i in range(10):
            producer.append(delta(i))
        reader = await open_when_visible(b, producer.id, None)
        async with asyncio.timeout(10):
            await anext(reader)
        await asyncio.sleep(random.uniform(1.0, 2.5))
        kill(a)
        killed = time.monotonic()
        async with asyncio.timeout(30):
            async for chunk in reader:
                if any(n > 10 for n, _ in events_of(chunk)):
                    break
        waits.append(time.monotonic() - killed)
        await reader.aclose()
        for streams in logs:
            await streams.close(timeout=0.3)
            await streams.instances.close()
    print(f"\ndefault timings: new output {', '.join(f'{w:.1f}' for w in waits)} s after the producer's death")


class _NoLog:
    """The same relay loop without resumability: append returns the bytes."""

    def append(self, data: bytes, *, final: bool = False) -> bytes:
        return data

    def finish(self) -> None:
        pass


@pytest.mark.skipif(not os.environ.get("STREAMLOG_FIGURES"), reason="a figure for docs/resumable.md")
@pytest.mark.skips_idle_time(False)  # real time: it waits on Azurite, another process
async def test_figures_producer_cpu_on_azurite(azurite):
    """CPU the stream log adds to a 40-delta stream (20 ms apart, the bench's answer), 50 at once,
    with nobody reading elsewhere: process CPU against the same loop without it, on Azurite
    (the instance's beat and inbox included)."""
    from chatstream.state.store_account import Account
    from chatstream.state.store_azure import AzureStore

    store = AzureStore(Account(azurite.connection_string))
    streams = StreamLog(store, Instances(store), encode_error)
    body = [delta(i) for i in range(40)]

    async def run(make) -> float:
        started = time.process_time()
        producers = [make() for _ in range(50)]
        await asyncio.gather(*(produce(x, body, gap=0.02) for x in producers))
        for x in producers:
            if hasattr(x, "wait_stored"):
                assert await x.wait_stored(30)
        return time.process_time() - started

    await run(lambda: streams.start("chat", None, request={"messages": [{"role": "user", "content": "hi"}]}))
    without = await run(_NoLog)
    with_log = await run(lambda: streams.start("chat", None, request={"messages": [{"role": "user", "content": "hi"}]}))
    print(
        f"\n50 streams x 40 deltas: {without * 1000:.0f} ms CPU without the log, {with_log * 1000:.0f} ms with it: "
        f"+{(with_log - without) / 50 * 1000:.2f} ms per stream; store calls {store.calls}"
    )
    await streams.close()
    await streams.instances.close()
    await store.close()
