"""chatstream/state/streamlog/, the storage layer of resumable streams, on the in-process store
(tests/memory_store.py: the same answers as Azurite, tests/store_contract.py): numbering, replay and
follow on two instances, cancel, abandonment, expiry and the sweep, the store failing, the bounds,
many streams at once. Takeovers and the fixes of issue #29: test_streamlog_takeover.py. The e2e
tests (two app processes on Azurite): tests/test_resumable.py."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace

import pytest
from memory_store import Fault, MemoryData

from chatstream import sse
from chatstream.state.instances import PARTITION, Instances
from chatstream.state.store import STREAMS_TABLE, StoreClock
from chatstream.state.streamlog.config import ResumeConfig, Turns
from chatstream.state.streamlog.errors import PastTheEnd, StreamLogUnavailable, StreamNotFound, TooManyReaders
from chatstream.state.streamlog.format import Record, check_stream_id, new_stream_id, started_at
from chatstream.state.streamlog.log import StreamLog, sweep

from .streamlog_helpers import (
    DONE,
    LIFE,
    QUICK,
    CountingStore,
    delta,
    encode_error,
    event,
    events_of,
    instances,
    kill,
    not_found,
    numbered,
    open_when_visible,
    produce,
    read_all,
)

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): leases, cadences and
# limits run in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time

# -- ids, Last-Event-ID, append ------------------------------------------------------------------


def test_ids_are_128_bit_url_safe_and_anything_else_is_refused():
    now = time.time()
    ids = {new_stream_id(now) for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 30 and check_stream_id(i) == i for i in ids)
    assert all(abs(started_at(i) - now) < 0.01 for i in ids) and len({i[8:] for i in ids}) == 1000
    for bad in ["", "../../etc/passwd", "a/b", "x" * 29, "x" * 31, "%2e%2e%2f" + "x" * 21, "x" * 29 + "é", None, 12]:
        with pytest.raises(StreamNotFound) as raised:
            check_stream_id(bad)  # type: ignore[arg-type] - wrong types on purpose
        assert raised.value.reason == "malformed id"


def test_the_errors_carry_no_http_status():
    from chatstream.state.streamlog import errors

    assert not any(hasattr(cls, "status") for cls in vars(errors).values() if isinstance(cls, type))


async def test_append_numbers_each_event_and_passes_keep_alives_through():
    async with instances(1) as (a,):
        producer = a.start("openai", None)
        assert producer.append(sse.KEEP_ALIVE) == sse.KEEP_ALIVE  # before the first event: no id
        assert producer.append(b'data: {"x":1}\n\n') == b'id: 1\ndata: {"x":1}\n\n'
        usage_and_done = b'data: {"usage":{}}\n\n' + b"data: [DONE]\n\n"
        together = producer.append(b": keep-alive\n\n" + usage_and_done, final=True)
        assert together == b': keep-alive\n\nid: 2\ndata: {"usage":{}}\n\nid: 3\ndata: [DONE]\n\n'
        with pytest.raises(RuntimeError):
            producer.append(b"data: late\n\n")
        for bad in (b"data: no blank line\n", b"data: crlf\r\n\r\n"):
            with pytest.raises(ValueError):
                a.start("chat", None).append(bad)
        producer.finish()
        assert await producer.wait_stored(5)
        reader = await a.open_reader(producer.id, None, None)
        assert reader.route == "openai"
        assert await read_all(reader) == b'id: 1\ndata: {"x":1}\n\nid: 2\ndata: {"usage":{}}\n\nid: 3\ndata: [DONE]\n\n'


# -- replay and follow ---------------------------------------------------------------------------


async def test_replay_after_n_then_follow_to_the_end_on_both_instances():
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("chat", "alice")
        body = [delta(i) for i in range(60)]
        expected = numbered(body + [DONE])
        for i in range(20):
            producer.append(body[i])
        # Readers on A (in memory) and on B (from the store) join mid-stream, after event 12.
        here = await a.open_reader(producer.id, 12, "alice")
        there = await open_when_visible(b, producer.id, 12, "alice")
        rest = asyncio.ensure_future(produce(producer, body[20:]))
        got_here, got_there = await asyncio.gather(read_all(here), read_all(there))
        live = await rest
        suffix = expected[expected.index(b"id: 13\n") :]
        assert got_here == suffix and got_there == suffix
        assert [n for n, _ in events_of(got_there)] == list(range(13, 62))
        assert live == expected[expected.index(b"id: 21\n") :]
        assert await producer.wait_stored(5)
        # Once stored, any instance replays it all from the blob: from the start, after N, after the end.
        for streams in (a, b):
            assert await read_all(await streams.open_reader(producer.id, None, "alice")) == expected
            assert await read_all(await streams.open_reader(producer.id, 0, "alice")) == expected
            assert await read_all(await streams.open_reader(producer.id, 60, "alice")) == numbered([DONE], 61)
            assert await read_all(await streams.open_reader(producer.id, 61, "alice")) == b""


async def test_a_stream_still_starting_is_followed_from_its_first_event():
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("chat", None)
        there = await open_when_visible(b, producer.id, None)  # no event yet, no blob content yet
        here = await a.open_reader(producer.id, None, None)
        await asyncio.sleep(0.1)
        task = asyncio.ensure_future(produce(producer, [delta(i) for i in range(5)]))
        got = await asyncio.gather(read_all(here), read_all(there))
        await task
        assert got[0] == got[1] == numbered([delta(i) for i in range(5)] + [DONE])


async def test_a_reader_of_a_young_stream_is_seen_by_its_likely_producer_while_its_record_is_read():
    """Issue #44: a reader elsewhere registers with the instance whose stream a reader there opened
    last while it reads the new stream's record, so its producer writes for it one record read
    sooner; a stream of a third instance is followed all the same (the row moves there)."""
    async with instances(3, **{**QUICK, "checkpoint_seconds": 30.0}) as (a, b, c):
        first = a.start("chat", None)
        first.append(delta(0))
        await (await open_when_visible(b, first.id, None)).aclose()  # b has read a stream of a's
        await produce(first, [])
        get = b.store.get
        slow: set[str] = set()

        async def slow_record(table, partition, row, **kw):  # the store slow to answer these records
            if partition in slow:
                await asyncio.sleep(1.0)
            return await get(table, partition, row, **kw)

        b.store.get = slow_record  # type: ignore[method-assign]
        for producing in (a, c):
            producer = producing.start("chat", None)
            slow.add(producer.id)
            producer.append(delta(0))
            opening = asyncio.ensure_future(open_when_visible(b, producer.id, None))
            blobs = producing.store.data.blobs  # type: ignore[attr-defined]
            if producing is a:  # its producer writes for the reader before the record is read
                async with asyncio.timeout(0.9):
                    while not blobs.get(producer.id, (b"",))[0]:
                        await asyncio.sleep(0.01)
                assert not opening.done()
            reader = await opening
            await produce(producer, [delta(i) for i in range(1, 4)])
            assert await read_all(reader) == numbered([delta(i) for i in range(4)] + [DONE])


async def test_only_the_owner_may_read_or_cancel():
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("chat", "alice")
        producer.append(delta(0))
        await (await open_when_visible(b, producer.id, None, "alice")).aclose()
        for streams in (a, b):
            for caller in ("bob", None):
                assert await not_found(streams.open_reader(producer.id, None, caller)) == "another caller's"
                assert await not_found(streams.cancel(producer.id, caller)) == "another caller's"
        assert not producer.stop_requested.is_set()
        unowned = a.start("chat", None)  # caller keys off: the id is the capability
        unowned.append(delta(0))
        reader = await open_when_visible(b, unowned.id, None, "anyone")
        async with asyncio.timeout(5):
            assert (await anext(reader)).startswith(b"id: 1\n")
        await reader.aclose()
        for p in (producer, unowned):
            await produce(p, [])


async def test_unknown_malformed_and_past_the_end_are_clear_errors():
    async with instances(2, **QUICK) as (a, b):
        unknown = new_stream_id(time.time() - 3600)  # an hour old: no record means none, at once
        for streams in (a, b):
            started = time.monotonic()
            assert await not_found(streams.open_reader(unknown, None, None)) == "no record"
            calls = sum(streams.store.counts.values())  # type: ignore[attr-defined] - the counting store's
            assert await not_found(streams.open_reader("../" + "x" * 27, None, None)) == "malformed id"
            assert sum(streams.store.counts.values()) == calls  # type: ignore[attr-defined] - never looked up
            assert await not_found(streams.cancel(unknown, None)) == "no record"
            assert time.monotonic() - started < 1
            with pytest.raises(ValueError):  # an event id, which the API layer read from Last-Event-ID
                await streams.open_reader(new_stream_id(time.time()), -1, None)
        producer = a.start("chat", None)
        for i in range(3):
            producer.append(delta(i))
        with pytest.raises(PastTheEnd):  # live, here: the producer knows its last id
            await a.open_reader(producer.id, 4, None)
        await (await open_when_visible(b, producer.id, None)).aclose()
        started = time.monotonic()
        with pytest.raises(PastTheEnd):  # live, elsewhere: proven by the producer's ack of this reader
            await b.open_reader(producer.id, 50, None)
        assert time.monotonic() - started < 1
        # 3 is the last id: a legitimate resume waits for it to be stored, then follows.
        reader = await b.open_reader(producer.id, 3, None)
        await produce(producer, [delta(3)])
        assert await read_all(reader) == numbered([delta(3), DONE], 4)
        assert await producer.wait_stored(5)
        for streams in (a, b):
            with pytest.raises(PastTheEnd):  # finished: past its last event (5)
                await streams.open_reader(producer.id, 6, None)
            assert await read_all(await streams.open_reader(producer.id, 5, None)) == b""
    # Started just now: its record may still be on its way, so it is waited for (give_up_seconds +
    # lost_record_seconds + 2 s).
    async with instances(1, give_up_seconds=0.1, lost_record_seconds=0.0, young_poll_seconds=0.05) as (c,):
        started = time.monotonic()
        assert await not_found(c.open_reader(new_stream_id(time.time()), None, None)) == "no record"
        assert 1.6 < time.monotonic() - started < 0.1 + 2 + 1.5


# -- cancel, abandonment, death ------------------------------------------------------------------


async def test_cancel_on_another_instance_reaches_the_producer_at_its_next_inbox_read():
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("chat", "alice")
        producer.append(delta(0))
        reader = await open_when_visible(b, producer.id, None, "alice")
        started = time.monotonic()
        assert await b.cancel(producer.id, "alice") is True
        async with asyncio.timeout(1.0):
            await producer.stop_requested.wait()
        assert producer.stop_reason == "cancelled" and time.monotonic() - started < 0.5
        cancelled = event({"finish_reason": "cancelled"}, b"done")
        await produce(producer, [], final=cancelled)
        assert (await read_all(reader)).endswith(b"id: 2\n" + cancelled)
        assert await producer.wait_stored(5)
        assert await b.cancel(producer.id, "alice") is False  # already over
        # On the producer's own instance the stop is immediate.
        local = a.start("chat", None)
        assert await a.cancel(local.id, None) is True and local.stop_requested.is_set()
        await produce(local, [], final=cancelled)


async def test_a_producer_whose_instance_goes_on_under_a_new_id_points_its_record_at_it():
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("chat", None)
        producer.append(delta(0))
        reader = await open_when_visible(b, producer.id, None)  # (its record is stored)
        old = a.instances.id
        await a.store.delete(STREAMS_TABLE, PARTITION, old)  # declared dead elsewhere: its next beat says so
        async with asyncio.timeout(5.0):
            while a.instances.id == old or (await a.store.get(STREAMS_TABLE, producer.id, "stream"))["instance"] == old:
                await asyncio.sleep(0.05)
        assert (await a.store.get(STREAMS_TABLE, producer.id, "stream"))["instance"] == a.instances.id
        await produce(producer, [delta(1)])
        await reader.aclose()


async def test_a_stream_nobody_reads_is_abandoned():
    async with instances(2, **{**QUICK, "abandon_seconds": 0.4}) as (a, b):
        producer = a.start("chat", None)
        producer.append(delta(0))
        await asyncio.sleep(0.6)
        assert not producer.stop_requested.is_set()  # the caller is still there
        # A reader on B keeps it alive while it reads, past the abandon time.
        reader = await open_when_visible(b, producer.id, None)
        reading = asyncio.ensure_future(read_all(reader))
        producer.caller_gone()
        await asyncio.sleep(1.0)
        assert not producer.stop_requested.is_set()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await reader.aclose()
        left = time.monotonic()
        async with asyncio.timeout(3.0):
            await producer.stop_requested.wait()
        assert producer.stop_reason == "abandoned"
        assert 0.35 <= time.monotonic() - left <= 2.0
        await produce(producer, [], final=event({"finish_reason": "cancelled"}, b"done"))


async def test_without_a_takeover_a_producer_that_dies_gives_every_reader_what_was_stored_then_stream_lost():
    async with instances(3, **QUICK) as (a, b, c):
        producer = a.start("chat", None)
        for i in range(30):
            producer.append(delta(i))
        reader = await open_when_visible(b, producer.id, None)
        got = b""
        async with asyncio.timeout(5):
            while len(events_of(got)) < 30:
                got += await anext(reader)
        producer.append(delta(30))  # handed out, never stored
        kill(a)
        killed = time.monotonic()
        got += await read_all(reader, limit=5)
        lost_after = time.monotonic() - killed
        events = events_of(got)
        assert [n for n, _ in events] == list(range(1, 32))
        assert json.loads(events[-1][1].split(b"data: ", 1)[1])["error"]["type"] == "stream_lost"
        # within the lease (0.4 s here; 4.5 s by default), a state check and a beat
        assert lost_after < LIFE.lease_seconds + 1.0
        late = events_of(await read_all(await c.open_reader(producer.id, None, None), limit=5))
        assert late[:-1] == events[:-1] and b'"stream_lost"' in late[-1][1]


# -- TTL and the sweep ---------------------------------------------------------------------------


async def test_a_finished_stream_expires_after_its_ttl_and_the_sweep_deletes_it():
    async with instances(2, **QUICK, ttl_seconds=0.5, sweep_every=3600) as (a, b):  # swept by hand here
        producer = a.start(
            "chat", None, request={"model": "m", "messages": [{"role": "user", "content": "x" * 40_000}]}
        )
        await produce(producer, [delta(i) for i in range(3)])
        assert await producer.wait_stored(5)
        reader = await b.open_reader(producer.id, None, None)
        assert await read_all(reader) == numbered([delta(i) for i in range(3)] + [DONE])
        await asyncio.sleep(0.7)
        for streams in (a, b):  # expired: not found even before any sweep
            assert await not_found(streams.open_reader(producer.id, None, None)) == "expired"
        data = a.store.data  # type: ignore[attr-defined] - the memory store's account
        assert f"{producer.id}.request" in data.blobs  # the large request's own blob
        assert producer.id not in data.blobs  # ended before its first write: its log is in the record
        await asyncio.sleep(0.1)
        await sweep(b.store, b.config)
        assert producer.id not in data.blobs and f"{producer.id}.request" not in data.blobs
        assert await sweep(b.store, b.config) >= 1  # the record goes a sweep after its blobs
        assert not data.tables[STREAMS_TABLE].get(producer.id)


async def test_a_blob_a_late_create_makes_after_the_sweep_goes_at_the_next_sweep():
    """A create sent while the stream was live (its producer's, or a reader's as it registers) that a
    busy store applies only after the sweep deleted the stream's blob: the next sweep deletes that
    blob, then the record. (The record went with the first sweep: nothing ever found the blob again.)"""
    async with instances(2, **QUICK, ttl_seconds=0.5, sweep_every=3600) as (a, b):  # swept by hand here
        producer = a.start("chat", None)
        await produce(producer, [delta(i) for i in range(3)])
        assert await producer.wait_stored(5)
        await asyncio.sleep(0.7)
        data = a.store.data  # type: ignore[attr-defined] - the memory store's account
        await sweep(b.store, b.config)
        await a.store.append_create(producer.id)  # the late create lands
        await sweep(b.store, b.config)
        assert producer.id not in data.blobs
        assert not data.tables[STREAMS_TABLE].get(producer.id)


async def test_sweeps_run_on_one_instance_however_many_there_are():
    async with instances(4, **QUICK, sweep_every=0.1) as logs:
        for streams in logs:  # each produces: each beats and takes part in the duty
            await produce(streams.start("chat", None), [delta(0)])
        await asyncio.sleep(1.0)
        sweeps = [streams.store.counts.get("sweep", 0) for streams in logs]  # type: ignore[attr-defined]
        print(f"\nsweeps per instance over 1 s (every 0.1 s): {sweeps}")
        assert sum(sweeps) >= 3 and sorted(sweeps)[-2] <= 1, sweeps  # one duty holder does them


# -- the store failing --------------------------------------------------------------------------


async def test_a_store_that_fails_never_stalls_the_live_stream():
    async with instances(2, **{**QUICK, "give_up_seconds": 0.5}) as (a, b):
        producer = a.start("chat", None)
        producer.append(delta(0))
        reader_b = await open_when_visible(b, producer.id, None)
        async with asyncio.timeout(5):
            assert (await anext(reader_b)).startswith(b"id: 1\n")
        reader_a = await a.open_reader(producer.id, None, None)
        for streams in (a, b):
            streams.store.inject(Fault("unavailable", times=10**9))  # type: ignore[attr-defined]
        started = time.perf_counter()
        live = [producer.append(delta(i)) for i in range(1, 200)]
        assert time.perf_counter() - started < 0.05 and live[-1].startswith(b"id: 200\n")
        async with asyncio.timeout(5):  # the next write fails, then give_up_seconds later it stops
            while producer.resumable:
                await asyncio.sleep(0.05)
        # A reader here still gets everything, from memory.
        await produce(producer, [])
        assert await read_all(reader_a) == numbered([delta(i) for i in range(200)] + [DONE])
        # A reader elsewhere gets a clear error event, not a hang.
        tail = await read_all(reader_b, limit=5)
        assert b'"store_unavailable"' in tail and b"id: " not in tail.rsplit(b"\n\n", 2)[-2]
        with pytest.raises(StreamLogUnavailable):  # opening: unavailable within the call bound
            await b.open_reader(producer.id, None, None)
        # The store back: the stored log ends with stream_lost where it stopped, so that a reader
        # elsewhere ends there instead of waiting.
        for streams in (a, b):
            streams.store.faults.clear()  # type: ignore[attr-defined]
        async with asyncio.timeout(5):
            while b": lost" not in bytes(a.store.data.blobs[producer.id][0]):  # type: ignore[attr-defined]
                await asyncio.sleep(0.05)
        again = events_of(await read_all(await b.open_reader(producer.id, None, None), limit=5))
        assert again[0][0] == 1 and b'"stream_lost"' in again[-1][1] and again[-1][0] == len(again)


async def test_a_stream_lost_end_whose_answer_was_lost_is_not_taken_for_a_takeover():
    """Storing given up, the stream_lost end lands but its answer is lost: the retry finds its own
    bytes there (not another producer's), and the record is still marked lost."""
    async with instances(1, **{**QUICK, "give_up_seconds": 0.3}) as (a,):
        producer = a.start("chat", None)
        producer.append(delta(0))
        async with asyncio.timeout(5):
            while producer.last_readable == 0:  # stored: the blob exists
                await asyncio.sleep(0.02)
        a.store.inject(Fault("unavailable", times=10**9))  # type: ignore[attr-defined]
        producer.append(delta(1))
        async with asyncio.timeout(5):
            while producer.resumable:
                await asyncio.sleep(0.02)
        a.store.faults.clear()  # type: ignore[attr-defined]
        a.store.inject(Fault("lose_answer", ops=frozenset({"append"}), table="blob"))  # type: ignore[attr-defined]
        rows = a.store.data.tables[STREAMS_TABLE][producer.id]  # type: ignore[attr-defined]
        async with asyncio.timeout(10):
            while rows["stream"][0].get("state") != "lost":
                await asyncio.sleep(0.05)
        assert bytes(a.store.data.blobs[producer.id][0]).count(b": lost") == 1  # type: ignore[attr-defined]
        await produce(producer, [])


async def test_a_stream_whose_record_never_landed_is_recorded_lost_once_the_store_answers():
    """The store refused the record's insert until the producer gave up: once it answers, the record
    is made, lost, so that a resume ends with stream_lost (send again), not 404 no such stream (seen
    under load: test_resumable's 200 streams with two busy loops)."""
    async with instances(2, **{**QUICK, "give_up_seconds": 0.3}) as (a, b):
        refused = Fault("unavailable", ops=frozenset({"insert"}), table=STREAMS_TABLE, times=10**9)
        a.store.inject(refused)  # type: ignore[attr-defined]
        producer = a.start("chat", None)
        live = await produce(producer, [delta(i) for i in range(3)])
        assert live == numbered([delta(0), delta(1), delta(2), DONE])  # the live caller got it all
        async with asyncio.timeout(5):
            while producer.resumable:
                await asyncio.sleep(0.05)
        a.store.faults.clear()  # type: ignore[attr-defined]
        rows = a.store.data.tables[STREAMS_TABLE]  # type: ignore[attr-defined]
        async with asyncio.timeout(10):
            while "stream" not in rows.get(producer.id, {}):
                await asyncio.sleep(0.05)
        assert rows[producer.id]["stream"][0]["state"] == "lost"
        for after in (None, 2):
            got = events_of(await read_all(await b.open_reader(producer.id, after, None), limit=5))
            assert len(got) == 1 and b'"stream_lost"' in got[0][1], got


async def test_a_records_insert_unanswered_once_is_waited_for_as_long_as_a_busy_store_takes():
    """The store stops answering as the stream starts and answers again 10.5 s later: the record's
    first insert is cut at 8 s (BUSY_TIMEOUT), its second is waited for and the stream stays
    resumable (before, the second try had what was left of give_up_seconds, 1.8 s, and the producer
    gave up on a store that answered the lost record's insert next)."""
    async with instances(2, **{**QUICK, "give_up_seconds": 10.0}) as (a, b):
        await a.instances.first_beat()
        a.store.freeze()  # type: ignore[attr-defined]
        producer = a.start("chat", None)
        live = await produce(producer, [delta(i) for i in range(3)])
        await asyncio.sleep(10.5)
        a.store.thaw()  # type: ignore[attr-defined]
        assert await producer.wait_stored(30) and producer.resumable
        assert await read_all(await b.open_reader(producer.id, None, None), limit=5) == live


async def test_a_records_insert_meeting_a_missing_table_is_tried_again():
    """The streams table answers 404 (deleted under the app, re-created by the edge) to the record's
    first inserts: the insert is tried again until give_up_seconds, as any store failure, and the
    stream stays resumable (not given up at once as "its record is someone else's")."""
    async with instances(2, **{**QUICK, "give_up_seconds": 5.0}) as (a, b):
        a.store.inject(Fault("not_found", ops=frozenset({"insert"}), table=STREAMS_TABLE, times=2))  # type: ignore[attr-defined]
        producer = a.start("chat", None)
        live = await produce(producer, [delta(i) for i in range(3)])
        assert await producer.wait_stored(5)
        assert await read_all(await b.open_reader(producer.id, None, None), limit=5) == live


async def test_a_producer_whose_record_is_another_producers_never_overwrites_it():
    """Issue #45: the record's insert refused until another producer's record is there (a takeover
    racing the first write): the producer gives up ("its record is someone else's"), and its
    stream_lost never lands on that record (it merged with the empty ETag of a record it never
    read: store_azure sent that as any version; both stores now refuse it, store.Op)."""
    async with instances(2, **{**QUICK, "give_up_seconds": 5.0}) as (a, b):
        refused = Fault("unavailable", ops=frozenset({"insert"}), table=STREAMS_TABLE, times=10**9)
        a.store.inject(refused)  # type: ignore[attr-defined]
        producer = a.start("chat", None)
        await produce(producer, [delta(i) for i in range(3)])
        async with asyncio.timeout(5):
            while refused.times == 10**9:  # its insert was tried
                await asyncio.sleep(0.01)
        now = b.store.clock.now()
        theirs = Record(producer.id, "chat", None, b.instances.id, 2, now, now + 600.0)
        await b.store.insert(STREAMS_TABLE, theirs.row())
        a.store.faults.clear()  # type: ignore[attr-defined]
        async with asyncio.timeout(5):
            while producer.resumable:
                await asyncio.sleep(0.01)
        # its stream_lost is written in the background (spawned as it gave up), if at all: wait for it
        async with asyncio.timeout(10):
            while any("_store_lost" in task.get_coro().__qualname__ for task in a.tasks):  # type: ignore[union-attr]
                await asyncio.sleep(0.01)
        row = a.store.data.tables[STREAMS_TABLE][producer.id]["stream"][0]  # type: ignore[attr-defined]
        assert (row["state"], row["instance"], row["epoch"], row.get("events")) == ("live", b.instances.id, 2, None)


async def test_a_frozen_store_delays_the_stored_log_and_loses_nothing():
    async with instances(2, **{**QUICK, "give_up_seconds": 5.0}) as (a, b):
        producer = a.start("chat", None)
        producer.append(delta(0))
        reader = await open_when_visible(b, producer.id, None)
        a.store.freeze()  # type: ignore[attr-defined] - SIGSTOP: calls wait, time out, land at thaw
        body = [delta(i) for i in range(1, 30)]
        for event in body:
            producer.append(event)
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        a.store.thaw()  # type: ignore[attr-defined]
        await produce(producer, [])
        assert await read_all(reader, limit=10) == numbered([delta(0), *body, DONE])
        assert await producer.wait_stored(5)


# -- bounds --------------------------------------------------------------------------------------


async def test_a_stream_over_the_size_limit_stays_live_but_is_resumable_only_up_to_it():
    async with instances(2, **QUICK, max_stream_bytes=4000) as (a, b):
        producer = a.start("chat", None)
        body = [delta(i) for i in range(200)]  # ~40 bytes each
        live = await produce(producer, body, gap=0)
        assert live == numbered(body + [DONE])  # the caller got all of it
        assert await producer.wait_stored(5)
        for streams in (a, b):
            stored = events_of(await read_all(await streams.open_reader(producer.id, None, None)))
            assert stored[-1][0] == len(stored) < 200 and b'"stream_lost"' in stored[-1][1]
            past = events_of(await read_all(await streams.open_reader(producer.id, 150, None)))
            assert len(past) == 1 and past[0][0] == 151 and b'"stream_lost"' in past[0][1]


async def test_readers_are_bounded_per_stream_and_per_instance_on_each_instance_apart():
    """Each instance counts its own readers: 16 of one stream (the 17th is refused, with the answer
    it got when the bound was the stream's on all instances), 150 opened at once on each instance
    admit exactly what is left of 16 there, each instance's counted apart. A reader on the
    producing instance makes no store call for its place: the stream's partition holds its record
    alone, and only readers elsewhere have an inbox row. A reader closed frees its place at once."""
    async with instances(2, **QUICK, max_readers=40) as (a, b):
        producer, other, third = (a.start("chat", None) for _ in range(3))
        producer.append(delta(0))
        first = await open_when_visible(b, producer.id, None)
        results = await asyncio.gather(
            *(streams.open_reader(producer.id, None, None) for streams in [a] * 150 + [b] * 150),
            return_exceptions=True,
        )
        admitted = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, TooManyReaders)]
        assert (len(admitted), len(refused)) == (31, 269)
        for streams in (a, b):
            with pytest.raises(TooManyReaders, match="too many readers of this stream"):
                await streams.open_reader(producer.id, None, None)
        rows = a.store.data.tables[STREAMS_TABLE]  # type: ignore[attr-defined]
        assert list(rows[producer.id]) == ["stream"]
        assert len([key for key in rows[f"i-{a.instances.id}"] if key.startswith(f"r-{producer.id}")]) == 16
        readers = [first, *admitted]
        for stream_id, count in ((other.id, 16), (third.id, 8)):
            readers += [await a.open_reader(stream_id, None, None) for _ in range(count)]
        with pytest.raises(TooManyReaders, match="too many readers on this instance"):  # A serves 40
            await a.open_reader(third.id, None, None)
        await admitted[0].aclose()  # (one of A's: its place is free again at once)
        await (await a.open_reader(producer.id, None, None)).aclose()
        for reader in readers:
            await reader.aclose()
        assert (a.readers, b.readers) == (0, 0)
        for p in (producer, other, third):
            await produce(p, [])


async def test_a_slot_row_an_earlier_version_wrote_is_not_counted_and_is_swept():
    """During a deploy, instances of the version before still write ``slot-NN`` rows into a stream's
    partition: this version admits its readers regardless, and the sweep deletes such a row once it
    has expired (``expires``, as on every row of the table)."""
    async with instances(2, **QUICK, max_readers_per_stream=1, sweep_every=3600) as (a, b):
        producer = a.start("chat", None)
        producer.append(delta(0))
        await (await open_when_visible(b, producer.id, None)).aclose()
        now = time.time()
        old = {
            "PartitionKey": producer.id,
            "RowKey": "slot-00",
            "holder": "f00d",
            "until": now + 0.3,
            "expires": now + 0.3,
        }
        await a.store.insert(STREAMS_TABLE, old)
        reader = await b.open_reader(producer.id, None, None)
        await produce(producer, [delta(1)])
        assert len(events_of(await read_all(reader))) == 3
        await asyncio.sleep(0.4)
        assert await sweep(a.store, a.config) >= 1
        assert "slot-00" not in a.store.data.tables[STREAMS_TABLE][producer.id]  # type: ignore[attr-defined]


async def test_writes_are_batched():
    """Nobody reading elsewhere: one write per checkpoint; a reader elsewhere: at most one per fast flush."""
    async with instances(2, **{**QUICK, "checkpoint_seconds": 1.0, "fast_flush_seconds": 0.05}) as (a, b):
        quiet, followed = a.start("chat", None), a.start("chat", None)
        reader = await open_when_visible(b, followed.id, None)
        drain = asyncio.ensure_future(read_all(reader))
        body = [delta(i) for i in range(150)]
        started = time.monotonic()
        await asyncio.gather(produce(quiet, body, gap=0.01), produce(followed, body, gap=0.01))
        took = time.monotonic() - started
        await drain
        assert await quiet.wait_stored(5) and await followed.wait_stored(5)
        counts = [a.store.counts.get(f"append:{p.id}", 0) for p in (quiet, followed)]  # type: ignore[attr-defined]
        print(f"\n150 events over {took:.1f} s: {counts[0]} blob writes nobody elsewhere, {counts[1]} followed")
        assert counts[0] <= took / 1.0 + 2
        assert took / 0.05 / 3 <= counts[1] <= took / 0.05 + 3


async def test_a_streams_first_write_makes_its_blob_before_appending_when_no_reader_is_known():
    """A stream nobody follows, past one checkpoint: its blob is made, then appended to, twice (the
    checkpoint, the end). Before, the first append went first and was refused (no blob yet): a
    quarter of such a stream's blob writes, and 200 calls of test_resumable's 200-stream burst."""
    async with instances(2, **{**QUICK, "checkpoint_seconds": 1.0}) as (a, b):
        producer = a.start("chat", None)
        live = await produce(producer, [delta(i) for i in range(15)], gap=0.1)
        assert await producer.wait_stored(5)
        assert a.store.counts[f"append:{producer.id}"] == 2  # type: ignore[attr-defined]
        assert a.store.data.calls["append_create"] == 1  # type: ignore[attr-defined]
        assert await read_all(await b.open_reader(producer.id, None, None)) == live


async def test_a_short_stream_nobody_follows_is_stored_in_its_record_alone():
    """Ended before its first write, with nobody elsewhere following: the record's insert and its
    end, which carries the whole log; no blob. Read back exactly on both instances."""
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("chat", None)
        live = await produce(producer, [delta(i) for i in range(40)], gap=0.001)
        assert await producer.wait_stored(5)
        assert a.store.counts.get(f"append:{producer.id}", 0) == 0  # type: ignore[attr-defined]
        assert producer.id not in a.store.data.blobs  # type: ignore[attr-defined]
        row = a.store.data.tables[STREAMS_TABLE][producer.id]["stream"][0]  # type: ignore[attr-defined]
        assert row["events"].encode() == live + b": end\n\n"  # the whole log, its end marker last
        for streams in (a, b):
            assert await read_all(await streams.open_reader(producer.id, None, None)) == live
        assert await read_all(await b.open_reader(producer.id, 20, None)) == live[live.index(b"id: 21\n") :]


async def test_a_stream_whose_first_block_landed_unanswered_in_a_blob_made_elsewhere_ends_in_the_blob():
    """The blob was there before the first write (a reader elsewhere made it as it registered), and
    that write's answer was lost: the next attempt finds it landed. Ended later with nobody
    following, the rest is not put in the record as if it were the whole log (on c769786 it was:
    a reader got the stream without its first event)."""
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("chat", None)
        await a.store.append_create(producer.id)  # (as a reader elsewhere does when it registers)
        a.store.inject(Fault("lose_answer", ops=frozenset({"append"}), table="blob"))  # type: ignore[attr-defined]
        first = producer.append(delta(0))
        async with asyncio.timeout(5):
            while producer.last_readable == 0:  # stored, though its answer was lost
                await asyncio.sleep(0.02)
        live = first + await produce(producer, [delta(i) for i in range(1, 5)], gap=0.001)
        assert await producer.wait_stored(5)
        for streams in (a, b):
            assert await read_all(await streams.open_reader(producer.id, None, None)) == live


async def test_a_short_stream_that_ends_as_its_instance_closes_is_recorded_whole_through_a_store_hiccup():
    """A drain (SIGTERM) closes the log as a short stream ends: its record's end, which carries the
    whole log, meets one failed call. It is tried again within the close's wait, as before the log
    closed: read elsewhere, the stream is exact (not a live record with nothing stored, which a
    takeover answers again from the start once its instance is gone: charged twice, and stream_lost
    for a client that holds ids of it)."""
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("chat", None)
        live = await produce(producer, [delta(i) for i in range(5)], gap=0.001)
        a.store.inject(Fault("unavailable", ops=frozenset({"merge"}), table=STREAMS_TABLE))  # type: ignore[attr-defined]
        await a.close(timeout=5.0)
        row = a.store.data.tables[STREAMS_TABLE][producer.id]["stream"][0]  # type: ignore[attr-defined]
        assert (row["state"], row.get("events") is not None) == ("ended", True)
        assert await read_all(await b.open_reader(producer.id, None, None), limit=5) == live


async def test_a_failing_stores_record_end_is_tried_every_half_second_as_before():
    """A stream's end, recorded in its record while the store refuses every merge: tried every 0.5 s
    for give_up_seconds, each call bounded by BUSY_TIMEOUT, as the end's own loop did before one
    record-write loop served the insert too (the insert's cadence, every 0.25 s, is the request's
    own: a reader elsewhere waits for it)."""
    async with instances(1, **{**QUICK, "give_up_seconds": 2.0}) as (a,):
        producer = a.start("chat", None)
        producer.append(delta(0))
        async with asyncio.timeout(5):
            while producer.id not in a.store.data.blobs:  # type: ignore[attr-defined] - the log's blob is there
                await asyncio.sleep(0.02)
        refused = Fault("unavailable", ops=frozenset({"merge"}), table=STREAMS_TABLE, times=10**9)
        a.store.inject(refused)  # type: ignore[attr-defined]
        producer.append(DONE, final=True)
        producer.finish()
        await producer.wait_stored(10)  # (False: its end is not recorded)
        assert 10**9 - refused.times <= 5  # 0, 0.5, 1, 1.5, 2 s (every 0.25 s: 9)


async def test_a_reader_elsewhere_that_comes_as_a_short_stream_ends_gets_it_exactly():
    """A reader elsewhere registered just before the end (seen or not by the producer): it gets the
    whole stream, from the blob or from the record, and soon."""
    for wait in (0.0, 0.01, 0.03, 0.06):
        async with instances(2, **QUICK) as (a, b):
            producer = a.start("chat", None)
            body = [producer.append(delta(i)) for i in range(5)]
            reader = await open_when_visible(b, producer.id, None)
            drain = asyncio.ensure_future(read_all(reader, limit=5))
            await asyncio.sleep(wait)
            body.append(producer.append(DONE, final=True))
            producer.finish()
            started = time.monotonic()
            assert await drain == b"".join(body)
            assert time.monotonic() - started < 1.5


async def test_a_short_streams_end_waits_for_no_inbox_read_and_a_reader_it_never_saw_gets_it_whole():
    """A reader elsewhere registers just before a short stream ends, before the producer's next inbox
    read: the end is stored at once, the whole log in the record (it used to wait for that read, 90
    ms at p50 of a stream's final event, 310 ms past its young seconds), and the reader, which finds
    the blob empty, reads the record beside it within a few polls: every event and the end."""
    async with instances(2, **{**QUICK, "inbox_seconds": 30.0, "inbox_young_seconds": 30.0}) as (a, b):
        producer = a.start("chat", None)
        body = [producer.append(delta(i)) for i in range(5)]
        reader = await open_when_visible(b, producer.id, None)  # after the producer's first inbox read
        drain = asyncio.ensure_future(read_all(reader, limit=5))
        await asyncio.sleep(0.01)  # (it polls the empty blob)
        body.append(producer.append(DONE, final=True))
        producer.finish()
        started = time.monotonic()
        assert await producer.wait_stored(5)
        assert time.monotonic() - started < 0.05
        assert await drain == b"".join(body)
        assert time.monotonic() - started < 6 * a.config.poll_seconds
        assert a.store.counts.get(f"append:{producer.id}", 0) == 0  # (in the record alone)


async def test_a_short_stream_whose_first_append_went_unanswered_ends_in_the_blob_a_reader_follows():
    """A reader elsewhere the producer has not seen yet follows the blob; the caller hangs up, the
    first append lands but its answer is lost, and the stream ends: its end goes into the blob after
    that block, not with the whole log into the record (the reader, past offset 0, would not look
    there until it found the producer gone: seconds)."""
    async with instances(2, **{**QUICK, "inbox_seconds": 30.0, "inbox_young_seconds": 30.0}) as (a, b):
        producer = a.start("chat", None)
        body = [producer.append(delta(i)) for i in range(5)]
        reader = await open_when_visible(b, producer.id, None)
        drain = asyncio.ensure_future(read_all(reader, limit=5))
        a.store.inject(Fault("lose_answer", ops=frozenset({"append"}), table="blob"))  # type: ignore[attr-defined]
        producer.caller_gone()  # (what is in hand is written now)
        async with asyncio.timeout(2):
            while not a.store.data.blobs[producer.id][0]:  # type: ignore[attr-defined]
                await asyncio.sleep(0.001)
        body.append(producer.append(DONE, final=True))
        producer.finish()
        started = time.monotonic()
        assert await drain == b"".join(body)
        assert time.monotonic() - started < 0.2


# -- endings this package writes itself ----------------------------------------------------------


async def test_a_stream_that_ends_without_its_final_event_is_stored_as_lost():
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("openai", None)
        producer.append(b'data: {"choices":[]}\n\n')
        producer.finish()  # no final event: the relay died, say
        assert await producer.wait_stored(5)
        for streams in (a, b):
            events = events_of(await read_all(await streams.open_reader(producer.id, None, None)))
            assert [n for n, _ in events] == [1, 2]
            assert json.loads(events[1][1][6:])["error"]["code"] == "stream_lost"  # OpenAI's shape


async def test_an_openai_error_chunk_ends_the_stream_without_done():
    async with instances(2, **QUICK) as (a, b):
        producer = a.start("openai", None)
        error = event({"error": {"message": "boom", "type": "server_error", "param": None, "code": "x"}})
        live = await produce(producer, [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'], final=error)
        assert await producer.wait_stored(5)
        assert await read_all(await b.open_reader(producer.id, None, None)) == live
        assert b"[DONE]" not in live and live.endswith(error)


async def test_a_producer_past_its_time_cap_is_ended_and_asked_to_stop():
    async with instances(1, **QUICK, max_stream_seconds=0.3) as (a,):
        producer = a.start("chat", None)
        producer.append(delta(0))
        async with asyncio.timeout(3):
            await producer.stop_requested.wait()
        assert producer.stop_reason == "timeout"
        assert producer.append(delta(1)).startswith(b"id: 3\n")  # the live caller is not cut off
        producer.append(DONE, final=True)
        producer.finish()
        assert await producer.wait_stored(5)
        stored = events_of(await read_all(await a.open_reader(producer.id, None, None)))
        assert [n for n, _ in stored] == [1, 2] and b'"stream_lost"' in stored[1][1]


def test_settings():
    from chatstream.settings import Settings, SettingsError

    default = Settings.from_env({})
    assert (default.resumable_streams, default.resume_abandon_seconds, default.resume_ttl_seconds) == (False, 30, 600)
    on = Settings.from_env(
        {
            "RESUMABLE_STREAMS": "on",
            "RESUME_ABANDON_SECONDS": "5",
            "RESUME_TTL_SECONDS": "60",
            "TOTAL_TIMEOUT_SECONDS": "100",
        }
    )
    assert on.resumable_streams is True and Settings.from_env({"RESUMABLE_STREAMS": "off"}).resumable_streams is False
    config = ResumeConfig.from_settings(on)
    assert (config.abandon_seconds, config.ttl_seconds, config.max_stream_seconds) == (5, 60, 160)
    for name, bad in [("RESUMABLE_STREAMS", "maybe"), ("RESUME_ABANDON_SECONDS", "0"), ("RESUME_TTL_SECONDS", "x")]:
        with pytest.raises(SettingsError, match=name):
            Settings.from_env({name: bad})


# -- many streams --------------------------------------------------------------------------------


async def test_200_concurrent_streams_with_drops_and_resumes():
    rng = random.Random(21)
    baseline = len(asyncio.all_tasks())
    resumes = {"here": 0, "elsewhere": 0}
    async with instances(2, **QUICK) as (a, b):

        async def one(k: int) -> None:
            await asyncio.sleep(k * 0.005)  # arrivals spread over 1 s
            owner = f"caller{k % 7}"
            producer = a.start(rng.choice(["chat", "openai"]), owner)
            body = [event({"delta": f"s{k}e{i} ✓"}) for i in range(rng.randint(10, 40))]
            expected = numbered(body + [DONE])
            got = b""
            drop_at = rng.randint(0, len(body))
            dropped = asyncio.Event()

            async def generate() -> None:
                nonlocal got
                for i, event in enumerate(body):
                    out = producer.append(event)
                    if i < drop_at:
                        got += out  # the live caller, until it drops
                    elif i == drop_at:
                        producer.caller_gone()
                        dropped.set()
                    await asyncio.sleep(rng.uniform(0.0, 0.02))
                out = producer.append(DONE, final=True)
                if drop_at >= len(body):
                    got += out
                producer.finish()
                dropped.set()

            generating = asyncio.ensure_future(generate())
            await dropped.wait()
            while not got.endswith(b"id: %d\n" % (len(body) + 1) + DONE):
                last = events_of(got)[-1][0] if got else None
                streams = rng.choice([a, b])
                resumes["here" if streams is a else "elsewhere"] += 1
                reader = await open_when_visible(streams, producer.id, last, owner, limit=10)
                chunks = rng.randint(1, 4)  # read a little, then drop again (or to the end)
                async with asyncio.timeout(10):
                    async for chunk in reader:
                        got += chunk
                        chunks -= 1
                        if chunks == 0 and rng.random() < 0.5:
                            break
                await reader.aclose()
            await generating
            assert got == expected, k

        await asyncio.gather(*(one(k) for k in range(200)))
        print(
            f"\n200 streams: {resumes['here']} resumes on the producing instance, {resumes['elsewhere']} on the other"
        )
        async with asyncio.timeout(5):
            while a.producers or a.readers or b.readers:
                await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)
    assert len(asyncio.all_tasks()) == baseline


async def test_the_readers_of_one_instance_share_its_liveness_reads():
    """Twenty readers on B of twenty streams produced on A: B reads A's instance row about once per
    fresh_seconds for all of them (Instances.alive), not once per reader per state check."""
    async with instances(2, life=replace(LIFE, fresh_seconds=0.1), **QUICK) as (a, b):
        producers = [a.start("chat", None) for _ in range(20)]
        readers = [await open_when_visible(b, p.id, None) for p in producers]
        before = b.store.counts.get("get:instances", 0)  # type: ignore[attr-defined]
        body = [delta(i) for i in range(30)]
        started = time.monotonic()
        got = await asyncio.gather(*(read_all(r) for r in readers), *(produce(p, body, gap=0.03) for p in producers))
        took = time.monotonic() - started
        assert all(g == numbered(body + [DONE]) for g in got[:20])
        reads = b.store.counts.get("get:instances", 0) - before  # type: ignore[attr-defined]
        print(f"\n20 readers of one instance's streams for {took:.1f} s: {reads} reads of its instance row")
        assert reads <= took / 0.1 + 5


async def test_background_writes_and_polls_wait_their_turn():
    """With bulk_calls=2, the producers' writes on A and the readers' polls on B are never more than
    two at a time on either instance, and every answer is still exact."""
    most = {"n": 0, "max": 0}

    class Gauged(CountingStore):
        async def append(self, name: str, data: bytes, *, at: int, timeout: float = 1.8) -> int:
            most["n"] += 1
            most["max"] = max(most["max"], most["n"])
            try:
                await asyncio.sleep(0.01)  # a store that takes its time
                return await super().append(name, data, at=at, timeout=timeout)
            finally:
                most["n"] -= 1

    data = MemoryData()
    store = Gauged(data, StoreClock())
    a = StreamLog(store, Instances(store, LIFE), encode_error, ResumeConfig(**QUICK, bulk_calls=2))
    async with instances(1, data=data, **QUICK) as (b,):
        producers = [a.start("openai", None) for _ in range(12)]
        readers = [await open_when_visible(b, p.id, None) for p in producers]
        body = [delta(i) for i in range(20)]
        got = await asyncio.gather(*(read_all(r) for r in readers), *(produce(p, body, gap=0.02) for p in producers))
        assert all(g == numbered(body + [DONE]) for g in got[:12])
        assert 1 <= most["max"] <= 2, most
    await a.close()
    await a.instances.close()


async def test_a_write_a_reader_waits_for_takes_its_turn_first():
    """Turns (ResumeConfig.bulk_calls): the calls waiting for a turn go in order, except a write a
    reader elsewhere waits for, which goes ahead of them; never more than the limit at once, and a
    waiter cancelled, or cancelled just as its turn came, leaves no turn behind."""
    turns = Turns(1)
    order: list[str] = []

    async def call(name: str, first: bool = False) -> None:
        async with turns(first=first):
            order.append(name)
            await asyncio.sleep(0.01)

    async with turns():  # the one turn is taken: everyone below waits
        tasks = [asyncio.ensure_future(call(n)) for n in ("end 1", "end 2")]
        tasks.append(asyncio.ensure_future(call("for a reader", first=True)))
        gone = asyncio.ensure_future(call("cancelled"))
        await asyncio.sleep(0)
        gone.cancel()
    await asyncio.gather(*tasks)
    assert order == ["for a reader", "end 1", "end 2"]
    late = asyncio.ensure_future(call("given, then cancelled"))
    async with turns():
        await asyncio.sleep(0)
    late.cancel()  # its turn was given as the block above ended, before it could run
    await asyncio.gather(late, return_exceptions=True)
    async with asyncio.timeout(1):
        async with turns():
            pass


async def test_a_reader_here_gets_what_is_stored_only_and_only_the_live_caller_is_ahead():
    """A reader on the producing instance reads from memory, but no further than the log: if the
    instance died, a reader ahead of it would hold ids no other instance can give it the rest after
    (format.EPOCH_IDS). The live caller is never held back."""
    async with instances(1, **{**QUICK, "give_up_seconds": 30.0}) as (a,):
        producer = a.start("chat", None)
        for i in range(3):
            producer.append(delta(i))
        reader = await a.open_reader(producer.id, None, None)
        got = b""
        async with asyncio.timeout(5):
            while len(events_of(got)) < 3:
                got += await anext(reader)
        a.store.inject(Fault("unavailable", ops=frozenset({"append"}), times=10**9))  # type: ignore[attr-defined]
        assert producer.append(delta(3)).startswith(b"id: 4\n")  # the live caller has it at once
        pending = asyncio.ensure_future(anext(reader))
        done, _ = await asyncio.wait({pending}, timeout=0.5)
        assert not done, "a reader here got an event the log does not have"
        a.store.faults.clear()  # type: ignore[attr-defined]
        await produce(producer, [])
        async with asyncio.timeout(5):
            got += await pending
        assert got + await read_all(reader) == numbered([delta(i) for i in range(4)] + [DONE])
