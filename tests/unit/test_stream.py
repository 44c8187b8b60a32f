"""chatstream/stream.py, the stream core: ``relay(open_stream, protocol, limits, record)`` against an
in-memory upstream, with ``completions.CompletionStream`` as the protocol. What it forwards and holds,
the one final event (``Done`` or ``Failed``) for every way a stream can end, the time limits, and the
upstream closed in every case."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx2
import openai
import pytest

from chatstream.apis.completions import CompletionStream
from chatstream.errors import ApiError, Rejection, UpstreamReported
from chatstream.guard import Redactor
from chatstream.pipeline import Pipeline
from chatstream.record import StreamRecord
from chatstream.settings import Settings
from chatstream.stream import Chunk, Done, Ends, Failed, TimeLimits, encoded, relay

from .stream_helpers import Opener
from .test_pipeline import Bomb

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time

REQUEST = httpx2.Request("POST", "http://upstream.test/v1/chat/completions")
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def limits_settings(**values) -> Settings:
    base = {
        "FIRST_TOKEN_TIMEOUT_SECONDS": 5,
        "IDLE_TIMEOUT_SECONDS": 5,
        "TOTAL_TIMEOUT_SECONDS": 10,
        "USAGE_WAIT_SECONDS": 0.5,
    }
    return Settings.model_validate({**base, **values})


class Sleep:
    def __init__(self, seconds: float):
        self.seconds = seconds


class Gate:
    """Script step: wait until the test opens it."""

    def __init__(self):
        self.event = asyncio.Event()


class Upstream:
    """An in-memory upstream stream: iterating it plays the script (dicts are yielded, a ``Sleep`` or
    ``Gate`` waits, an exception is raised); ``close()`` records that it was called. Dicts that
    follow each other in the script count as one read: ``ready`` says how many are still in hand."""

    def __init__(self, script):
        self.script = list(script)
        self.closed = 0
        self.read = 0
        self.ready = 0
        self._iterator = self._play()

    def __aiter__(self):
        return self._iterator  # one iteration, however often the core asks (as the SDK's stream)

    async def _play(self):
        for i, step in enumerate(self.script):
            if isinstance(step, Sleep):
                await asyncio.sleep(step.seconds)
            elif isinstance(step, Gate):
                await step.event.wait()
            elif isinstance(step, BaseException):
                raise step
            else:
                self.read += 1
                after = self.script[i + 1 :]
                self.ready = next((n for n, x in enumerate(after) if not isinstance(x, dict)), len(after))
                yield step
        self.ready = 0

    async def close(self):
        self.closed += 1


def chunk(delta=None, finish=None, index=0, **extra) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-test-2024",
        "choices": [{"index": index, "delta": delta or {}, "finish_reason": finish}],
        **extra,
    }


def multi(*choices) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-test-2024",
        "choices": [{"index": i, "delta": d, "finish_reason": f} for i, d, f in choices],
    }


def usage_chunk(usage=USAGE) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-test-2024",
        "choices": [],
        "usage": usage,
    }


ROLE = chunk({"role": "assistant", "content": ""})
NORMAL = [ROLE, chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk({}, "stop"), usage_chunk()]


class Run:
    """One relay over an in-memory upstream."""

    def __init__(self, script, *, pipeline=None, choices=1, settings=None, protocol=None, open_stream=None):
        self.upstream = Upstream(script)
        self.record = StreamRecord(endpoint="openai", model="gpt-test")
        self.protocol = protocol or CompletionStream(pipeline or Pipeline(), choices)
        self.settings = settings or limits_settings()
        self.open_stream = open_stream or self._open

    async def _open(self):
        return self.upstream

    def events(self, ends: Ends | None = None):
        self.limits = TimeLimits(self.settings)
        path, protocol = "/chat/completions", self.protocol
        return relay(Opener(self.open_stream), path, {}, protocol, self.limits, self.record, ends or Ends(lambda: None))

    async def all(self) -> list:
        return [event async for event in self.events()]


def texts(events) -> list[str]:
    return [c["delta"].get("content") or "" for e in events if isinstance(e, Chunk) for c in e.data["choices"]]


def failure(events):
    assert isinstance(events[-1], Failed), events[-1]
    assert not any(isinstance(e, (Done, Failed)) for e in events[:-1])
    return events[-1].error


# ------------------------------------------------------------------------------ normal streams


async def test_a_normal_stream():
    run = Run(NORMAL)
    events = await run.all()
    assert [type(e) for e in events] == [Chunk, Chunk, Chunk, Chunk, Done]
    assert [e.data for e in events[:4]] == NORMAL[:4]
    assert events[-1] == Done("stop", {0: "stop"}, USAGE, "gpt-test-2024", "chatcmpl-1", 1700000000)
    assert run.record.finish_reason == "stop" and run.record.usage == USAGE
    assert run.record.error is None and not run.record.disconnected
    assert run.upstream.closed == 1


async def test_deltas_are_counted_and_the_first_delta_is_timed():
    run = Run(NORMAL)
    before = time.perf_counter()
    await run.all()
    assert run.record.deltas == 2, "the role chunk and the finish chunk are not deltas"
    assert before <= run.record.first_delta_at <= time.perf_counter()


async def test_the_role_chunk_is_held_until_content():
    gate = Gate()
    run = Run([ROLE, chunk({"content": ""}), gate, chunk({"content": "Hi"}), chunk({}, "stop")])
    events = run.events()
    first = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.02)
    assert not first.done(), "nothing is sent before the first output"
    assert run.upstream.read == 2 and run.record.first_delta_at is None
    gate.event.set()
    assert (await first).data == ROLE
    assert (await anext(events)).data == chunk({"content": ""})
    assert (await anext(events)).data["choices"][0]["delta"] == {"content": "Hi"}
    assert run.record.first_delta_at is not None
    rest = [e async for e in events]
    assert isinstance(rest[-1], Done)


async def test_a_finish_without_content_is_output_and_releases_the_held_chunks():
    run = Run([ROLE, chunk({}, "content_filter")])
    events = await run.all()
    assert [e.data for e in events[:2]] == [ROLE, chunk({}, "content_filter")]
    assert events[-1].finish_reason == "content_filter"
    assert run.record.deltas == 0 and run.record.first_delta_at is not None


async def test_a_tool_call_and_a_refusal_are_output():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    for delta in ({"tool_calls": [call]}, {"refusal": "No."}):
        run = Run([ROLE, chunk(delta), chunk({}, "stop")])
        events = await run.all()
        assert [type(e) for e in events] == [Chunk, Chunk, Chunk, Done]
        assert run.record.deltas == 1


async def test_azure_empty_choices_frames_are_dropped():
    prompt_filter = {
        "id": "",
        "object": "",
        "created": 0,
        "model": "",
        "choices": [],
        "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": {}}],
    }
    run = Run([prompt_filter, ROLE, chunk({"content": "a"}), {"choices": []}, chunk({}, "stop"), usage_chunk()])
    events = await run.all()
    assert all(e.data["choices"] for e in events if isinstance(e, Chunk))
    assert texts(events) == ["", "a", ""]
    assert events[-1].model == "gpt-test-2024" and events[-1].id == "chatcmpl-1", "empty ids do not replace real ones"


async def test_unknown_fields_pass_through_and_the_input_is_not_changed():
    extra = chunk(
        {"content": "a", "future": 1}, system_fingerprint="fp_1", content_filter_results={"hate": {"filtered": False}}
    )
    run = Run([extra, chunk({}, "stop")])
    events = await run.all()
    assert events[0].data == extra


async def test_usage_is_read_after_the_finish():
    run = Run([ROLE, chunk({"content": "a"}), chunk({}, "stop"), Sleep(0.02), usage_chunk()])
    events = await run.all()
    assert events[-1].usage == USAGE and run.record.usage == USAGE


async def test_a_missing_usage_is_not_a_failure_and_waits_only_usage_wait():
    run = Run(
        [chunk({"content": "a"}), chunk({}, "stop"), Sleep(5), usage_chunk()],
        settings=limits_settings(USAGE_WAIT_SECONDS=0.05),
    )
    started = time.monotonic()
    events = await run.all()
    assert time.monotonic() - started < 2
    assert isinstance(events[-1], Done) and events[-1].usage is None
    assert run.upstream.closed == 1


async def test_an_upstream_error_after_the_finish_is_ignored():
    # The upstream explains its failures as ApiErrors (upstreams/failover.py; test_failover.py has the SDK's).
    for tail in (ApiError(502, "upstream_disconnected", "lost"), UpstreamReported("late")):
        run = Run([chunk({"content": "a"}), chunk({}, "stop"), tail])
        events = await run.all()
        assert isinstance(events[-1], Done) and run.record.error is None


async def test_nothing_after_the_finish_is_forwarded():
    run = Run(
        [
            chunk({"content": "a"}),
            chunk({"content": "b"}, "stop"),
            chunk({"content": "late"}),
            chunk({}, "stop"),
            usage_chunk(),
        ]
    )
    events = await run.all()
    assert texts(events) == ["a", "b"]
    assert events[-1].usage == USAGE, "the usage after them is still read"


async def test_n2_interleaved_finishes():
    run = Run(
        [
            multi((0, {"role": "assistant"}, None), (1, {"role": "assistant"}, None)),
            multi((1, {"content": "B"}, None)),
            multi((0, {"content": "A"}, None), (1, {}, "length")),
            multi((1, {"content": "late for 1"}, None), (0, {"content": "A2"}, None)),
            multi((0, {}, "stop")),
            usage_chunk(),
        ],
        choices=2,
    )
    events = await run.all()
    chunks = [e.data for e in events if isinstance(e, Chunk)]
    forwarded = [(c["index"], c["delta"].get("content"), c["finish_reason"]) for d in chunks for c in d["choices"]]
    assert forwarded == [
        (0, None, None),
        (1, None, None),
        (1, "B", None),
        (0, "A", None),
        (1, None, "length"),
        (0, "A2", None),
        (0, None, "stop"),
    ]
    done = events[-1]
    assert done.finish_reason == "stop" and done.finish_reasons == {0: "stop", 1: "length"}
    assert done.usage == USAGE
    assert run.record.deltas == 3


async def test_n2_ending_after_one_choice_finished_is_done():
    run = Run([multi((0, {"content": "A"}, None), (1, {"content": "B"}, None)), multi((1, {}, "stop"))], choices=2)
    events = await run.all()
    assert isinstance(events[-1], Done)
    assert events[-1].finish_reasons == {1: "stop"} and events[-1].finish_reason is None


# ---------------------------------------------------------------------------------- failures


async def test_a_stream_ending_without_a_finish_is_incomplete():
    run = Run([ROLE, chunk({"content": "a"})])
    events = await run.all()
    error = failure(events)
    assert (error.status, error.type, error.retryable) == (502, "upstream_incomplete", True)
    assert texts(events) == ["", "a"]
    assert run.record.error == "upstream_incomplete" and run.upstream.closed == 1


async def test_an_empty_stream_is_incomplete():
    run = Run([])
    assert failure(await run.all()).type == "upstream_incomplete"


@pytest.mark.parametrize(
    "bad",
    [
        {"choices": "abc"},
        {"choices": {"0": {}}},
        {"choices": [1]},
        {"choices": [{"delta": "text"}]},
        {"choices": [{"delta": {"content": 5}}]},
        {"choices": [{"delta": {"refusal": ["x"]}}]},
        {"choices": [{"delta": {"tool_calls": {"index": 0}}}]},
        {"choices": [{"index": 0, "delta": {}}, "x"]},
    ],
)
async def test_malformed_choices_are_upstream_malformed(bad):
    run = Run([ROLE, bad, chunk({}, "stop")])
    error = failure(await run.all())
    assert (error.status, error.type) == (502, "upstream_malformed")
    assert run.upstream.closed == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"choices": [{"index": [0], "delta": {"content": "x"}}]},
        {"choices": [{"index": {"i": 0}, "delta": {}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": "f"}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": [0], "function": {"arguments": "{}"}}]}}]},
    ],
)
async def test_odd_indexes_and_tool_calls_are_upstream_malformed(bad):
    pipeline = Pipeline()
    pipeline.text(lambda: Redactor(["secret"]))
    run = Run([ROLE, bad, chunk({}, "stop")], pipeline=pipeline)
    events = await run.all()
    if isinstance(events[-1], Failed):
        assert events[-1].error.type == "upstream_malformed"


async def test_a_malformed_chunk_after_output_is_still_malformed():
    run = Run([chunk({"content": "a"}), {"choices": [None]}])
    events = await run.all()
    assert texts(events) == ["a"] and failure(events).type == "upstream_malformed"


async def test_an_error_event_inside_the_stream():
    run = Run([chunk({"content": "a"}), UpstreamReported("overloaded")])
    error = failure(await run.all())
    assert (error.status, error.type) == (502, "upstream_error")


async def test_an_unexplained_exception_from_the_upstream_is_a_bug_of_ours():
    run = Run([chunk({"content": "a"}), openai.APIConnectionError(request=REQUEST)])
    error = failure(await run.all())
    assert (error.status, error.type) == (500, "internal_error") and run.upstream.closed == 1


async def test_a_text_step_that_raises_is_pipeline_error(caplog):
    pipeline = Pipeline()
    pipeline.text(Bomb)
    run = Run([ROLE, chunk({"content": "one "}), chunk({"content": "bomb"}), chunk({}, "stop")], pipeline=pipeline)
    with caplog.at_level(logging.ERROR, logger="chatstream"):
        events = await run.all()
    error = failure(events)
    assert (error.status, error.type) == (500, "pipeline_error") and "Bomb" in error.message
    assert texts(events) == ["", "one "]
    assert run.record.error == "pipeline_error" and run.upstream.closed == 1
    assert not any("chat stream failed" in r.getMessage() for r in caplog.records), "not reported as a bug of ours"


async def test_moderation_stop_is_content_filter():
    async def check(text):
        return "no" if "bad" in text else True

    pipeline = Pipeline()
    pipeline.moderate(check, every=1)
    run = Run(
        [ROLE, chunk({"content": "good "}), chunk({"content": "bad"}), chunk({"content": "more"}), chunk({}, "stop")],
        pipeline=pipeline,
    )
    events = await run.all()
    error = failure(events)
    assert (error.status, error.type, error.message) == (400, "content_filter", "stopped by moderation: no")
    assert "bad" not in "".join(texts(events))
    assert run.upstream.closed == 1 and run.upstream.read == 3, "nothing more is read from the upstream"


async def test_moderation_before_any_output_sends_nothing():
    async def check(text):
        return False

    pipeline = Pipeline()
    pipeline.moderate(check, every=1)
    run = Run([ROLE, chunk({"content": "x"}), chunk({}, "stop")], pipeline=pipeline)
    events = await run.all()
    assert len(events) == 1 and failure(events).type == "content_filter"
    assert run.record.first_delta_at is None


class BrokenProtocol(CompletionStream):
    async def feed(self, data):
        if data["choices"] and data["choices"][0]["delta"].get("content") == "boom":
            raise ValueError("a bug of ours")
        return await super().feed(data)


@pytest.mark.parametrize("before_output", [True, False])
async def test_a_bug_in_the_protocol_is_internal_error_and_logged_with_its_traceback(caplog, before_output):
    script = (
        [ROLE, chunk({"content": "boom"})]
        if before_output
        else [ROLE, chunk({"content": "a"}), chunk({"content": "boom"})]
    )
    run = Run(script + [chunk({}, "stop")])
    run.protocol = BrokenProtocol(Pipeline())
    with caplog.at_level(logging.ERROR, logger="chatstream"):
        events = await run.all()
    error = failure(events)
    assert (error.status, error.type, error.retryable) == (500, "internal_error", True)
    assert error.type != "upstream_malformed"
    [entry] = [r for r in caplog.records if "chat stream failed" in r.getMessage()]
    assert "endpoint=openai" in entry.getMessage()
    assert entry.exc_info and entry.exc_info[0] is ValueError
    assert run.record.error == "internal_error" and run.upstream.closed == 1


async def test_an_api_error_from_the_protocol_is_passed_as_it_is():
    rejection = Rejection(451, "not here")

    class Refusing(CompletionStream):
        async def feed(self, data):
            raise rejection

    run = Run([chunk({"content": "a"})])
    run.protocol = Refusing(Pipeline())
    assert failure(await run.all()) is rejection


# ----------------------------------------------------------------------- connection failures


async def test_a_failure_after_output_ends_with_the_chunks_made_then_the_error():
    run = Run([ROLE, chunk({"content": "a"}), ApiError(502, "upstream_disconnected", "lost")])
    events = await run.all()
    error = failure(events)
    assert (error.status, error.type) == (502, "upstream_disconnected")
    assert texts(events) == ["", "a"] and run.upstream.closed == 1


async def test_opening_the_stream_fails():
    async def refuse():
        raise ApiError(503, "upstream_unavailable", "could not reach the model server")

    run = Run([], open_stream=refuse)
    error = failure(await run.all())
    assert error.type == "upstream_unavailable"
    assert run.upstream.closed == 0, "nothing was opened"
    assert not run.record.disconnected


async def test_opening_the_stream_is_bounded_by_the_first_token_limit():
    async def hang():
        await asyncio.sleep(5)

    run = Run([], open_stream=hang, settings=limits_settings(FIRST_TOKEN_TIMEOUT_SECONDS=0.05))
    error = failure(await run.all())
    assert (error.status, error.type) == (504, "upstream_timeout")


# ------------------------------------------------------------------------------- time limits


async def test_first_token_timeout():
    run = Run([ROLE, Sleep(5), chunk({"content": "late"})], settings=limits_settings(FIRST_TOKEN_TIMEOUT_SECONDS=0.05))
    started = time.monotonic()
    events = await run.all()
    assert time.monotonic() - started < 2
    error = failure(events)
    assert (error.status, error.type) == (504, "upstream_timeout")
    assert error.message == "no first token within the time limit"
    assert len(events) == 1, "the held role chunk is not sent"
    assert run.upstream.closed == 1


async def test_idle_timeout_after_output():
    run = Run(
        [ROLE, chunk({"content": "a"}), chunk({"content": "b"}), Sleep(5), chunk({"content": "late"})],
        settings=limits_settings(IDLE_TIMEOUT_SECONDS=0.05),
    )
    events = await run.all()
    error = failure(events)
    assert error.type == "upstream_timeout" and error.message == "the model stopped sending within the idle limit"
    assert texts(events) == ["", "a", "b"] and run.upstream.closed == 1


async def test_slow_but_steady_chunks_do_not_trip_the_idle_limit():
    script = [chunk({"content": "a"})]
    for _ in range(6):
        script += [Sleep(0.02), chunk({"content": "a"})]
    run = Run(script + [chunk({}, "stop")], settings=limits_settings(IDLE_TIMEOUT_SECONDS=0.5))
    events = await run.all()
    assert isinstance(events[-1], Done)


async def test_the_idle_limit_runs_between_upstream_chunks():
    script = [chunk({"content": "a"})]
    for _ in range(8):
        script += [Sleep(0.03), {"choices": [], "content_filter_results": {}}]
    run = Run(script + [chunk({}, "stop")], settings=limits_settings(IDLE_TIMEOUT_SECONDS=0.1))
    events = await run.all()
    assert isinstance(events[-1], Done), events[-1]


async def test_the_total_limit_while_waiting_on_the_upstream():
    run = Run(
        [chunk({"content": "a"}), Sleep(5)], settings=limits_settings(TOTAL_TIMEOUT_SECONDS=0.1, IDLE_TIMEOUT_SECONDS=5)
    )
    error = failure(await run.all())
    assert (error.status, error.type) == (504, "total_timeout")


class SlowStep:
    """A text step that takes its time (blocking): chunks already buffered arrive without a wait."""

    def feed(self, text):
        time.sleep(0.02)
        return text

    def flush(self):
        return ""


async def test_the_total_limit_holds_for_buffered_chunks():
    pipeline = Pipeline()
    pipeline.text(SlowStep)
    run = Run(
        [chunk({"content": "a"}) for _ in range(100)] + [chunk({}, "stop")],
        pipeline=pipeline,
        settings=limits_settings(TOTAL_TIMEOUT_SECONDS=0.1),
    )
    events = await run.all()
    assert failure(events).type == "total_timeout"
    assert len(texts(events)) < 20, "stopped well before the 100 buffered chunks"
    assert run.upstream.closed == 1


async def test_the_total_limit_holds_for_a_caller_who_reads_slowly():
    run = Run(
        [chunk({"content": "a"}) for _ in range(100)] + [chunk({}, "stop")],
        settings=limits_settings(TOTAL_TIMEOUT_SECONDS=0.1),
    )
    events = []
    async for event in run.events():
        events.append(event)
        await asyncio.sleep(0.03)
    assert failure(events).type == "total_timeout"
    assert len(events) < 10


async def test_a_stream_parked_behind_a_caller_who_stopped_reading_is_closed_at_the_total_limit():
    run = Run(
        [chunk({"content": "a"}) for _ in range(5)] + [chunk({}, "stop")],
        settings=limits_settings(TOTAL_TIMEOUT_SECONDS=0.1),
    )
    events = run.events()
    assert isinstance(await anext(events), Chunk)
    await asyncio.sleep(0.25)  # the caller reads nothing past the limit
    assert run.upstream.closed >= 1, "closed while parked, before the caller came back"
    rest = [e async for e in events]
    assert failure(rest).type == "total_timeout"


# ------------------------------------------------------------------------- the caller leaves


async def test_a_caller_who_stops_early_closes_the_upstream():
    run = Run(NORMAL)
    events = run.events()
    first = await anext(events)
    assert isinstance(first, Chunk)
    await events.aclose()
    assert run.upstream.closed == 1
    assert run.record.disconnected
    assert run.record.error is None


async def test_a_caller_who_hangs_up_while_the_core_waits_closes_the_upstream():
    run = Run([ROLE, chunk({"content": "a"}), Sleep(5)])

    async def consume(events):
        async for _ in events:
            pass

    task = asyncio.ensure_future(consume(run.events()))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.upstream.closed == 1 and run.record.disconnected


async def test_closing_after_the_final_event_is_not_a_disconnect():
    run = Run([chunk({"content": "a"}), chunk({"content": "b"})])  # ends in Failed
    events = run.events()
    seen = [await anext(events) for _ in range(3)]
    assert isinstance(seen[-1], Failed) and seen[-1].error.type == "upstream_incomplete"
    await events.aclose()
    assert not run.record.disconnected and run.upstream.closed == 1


async def test_the_upstream_is_closed_once_after_done():
    run = Run(NORMAL)
    await run.all()
    assert run.upstream.closed == 1 and not run.record.disconnected


# ------------------------------------------------------------------------------ writes: chunks in hand go together


def encode_text(event) -> bytes | None:
    if isinstance(event, Chunk):
        return "".join(c["delta"].get("content") or "" for c in event.data["choices"]).encode() or None
    return b"|end" if isinstance(event, Done) else b"|failed"


async def writes(run: Run) -> list[tuple[float, bytes]]:
    """What the endpoint would write, and when (seconds from the start)."""
    events = run.events()
    start = time.monotonic()
    first = await anext(events)
    return [(time.monotonic() - start, data) async for data in encoded(first, events, encode_text)]


async def test_chunks_read_together_are_written_together():
    words = [chunk({"content": w}) for w in ("a", "b", "c")]
    run = Run([ROLE, *words, Sleep(0.05), chunk({"content": "d"}), chunk({}, "stop"), usage_chunk()])
    assert [data for _, data in await writes(run)] == [b"abc", b"d", b"|end"]


async def test_each_chunk_of_its_own_read_is_written_alone():
    run = Run(
        [
            ROLE,
            chunk({"content": "a"}),
            Sleep(0.01),
            chunk({"content": "b"}),
            Sleep(0.01),
            chunk({}, "stop"),
            Sleep(0.01),
            usage_chunk(),
        ]
    )
    assert [data for _, data in await writes(run)] == [b"a", b"b", b"|end"]


async def test_what_is_in_hand_never_waits_for_the_next_read():
    run = Run(
        [
            ROLE,
            chunk({"content": "a"}),
            chunk({"content": "b"}),
            Sleep(0.5),
            chunk({"content": "c"}),
            chunk({}, "stop"),
            usage_chunk(),
        ]
    )
    (at, data), *rest = await writes(run)
    assert data == b"ab" and at < 0.25, f"written after {at:.3f} s: it waited for the upstream"
    assert [data for _, data in rest] == [b"c", b"|end"]


async def test_chunks_filtered_away_do_not_hold_back_what_is_in_hand():
    # The usage chunk (no choices) is not forwarded: "b" must not wait for a chunk that never comes.
    run = Run(
        [
            ROLE,
            chunk({"content": "a"}),
            chunk({"content": "b"}),
            chunk(choices=[]),
            Sleep(0.5),
            chunk({}, "stop"),
            usage_chunk(),
        ]
    )
    (at, data), *_ = await writes(run)
    assert data == b"ab" and at < 0.25


async def test_a_failure_after_chunks_in_hand_writes_them_then_the_error():
    run = Run([ROLE, chunk({"content": "a"}), chunk({"content": "b"}), {"choices": "not a list"}])
    assert [data for _, data in await writes(run)] == [b"ab", b"|failed"]
    assert run.record.deltas == 2


async def test_the_finish_is_written_before_the_usage_wait():
    run = Run([ROLE, chunk({"content": "a"}), chunk({}, "stop"), Sleep(0.4), usage_chunk()])
    events = run.events()
    start = time.monotonic()
    out = encoded(await anext(events), events, encode_text)
    assert await anext(out) == b"a"  # "a" and the finish chunk (which encodes to nothing) in one write
    assert time.monotonic() - start < 0.2
    assert await anext(out) == b"|end"


async def test_with_moderation_a_chunk_in_hand_does_not_wait_for_the_next_ones_check():
    async def check(text):
        if "b" in text:
            await asyncio.sleep(0.5)  # the check of the second chunk is slow
        return True

    pipeline = Pipeline()
    pipeline.moderate(check, every=1)
    run = Run(
        [ROLE, chunk({"content": "a"}), chunk({"content": "b"}), chunk({}, "stop"), usage_chunk()], pipeline=pipeline
    )
    (at, data), *rest = await writes(run)
    assert data == b"a" and at < 0.25, f"'a' written after {at:.3f} s: it waited for the check of 'b'"
    assert [data for _, data in rest] == [b"b", b"|end"]


# ------------------------------------------------------------------------------ the ends told


class Told(Ends):
    """``Ends`` that write what they are told in ``log``, where the upstream's close goes too."""

    def __init__(self, log: list[str], before_last=None):
        super().__init__(lambda: log.append("on_end"), before_last)
        self.log = log

    def begin(self) -> None:
        self.log.append("begin")

    def over(self) -> None:
        self.log.append("over")
        super().over()


def told(script, log: list[str], **run) -> Run:
    """A Run whose upstream writes its close in ``log``."""
    result = Run(script, **run)
    close = result.upstream.close

    async def closing():
        log.append("closed")
        await close()

    result.upstream.close = closing
    return result


async def run_out(events) -> None:
    async for _ in events:
        pass


FAILING = [ROLE, chunk({"content": "a"}), ApiError(502, "upstream_disconnected", "lost")]


@pytest.mark.parametrize("script", [NORMAL, FAILING], ids=["done", "failed"])
async def test_the_final_event_goes_out_after_the_upstreams_close_and_before_last_and_on_end_after_it(script):
    log: list[str] = []

    async def before_last():
        log.append("before_last")

    run = told(script, log)
    async for event in run.events(Told(log, before_last)):
        if not isinstance(event, Chunk):
            log.append(type(event).__name__)
    final = "Done" if script is NORMAL else "Failed"
    assert log == ["begin", "closed", "before_last", final, "over", "on_end"]


@pytest.mark.parametrize("leaves", ["unread", "opening", "mid-stream", "before_last", "final"])
async def test_on_end_runs_once_however_the_caller_leaves(leaves):
    """The caller leaves (its read cancelled, or the events closed) at each point of the stream: the
    upstream is closed, and ``on_end`` runs once; a stream never read was never begun or ended."""
    log: list[str] = []
    hold = asyncio.Event()

    async def slow_open():
        await asyncio.sleep(5 if leaves == "opening" else 0)
        return run.upstream

    async def before_last():
        log.append("before_last")
        await hold.wait()

    run = told(NORMAL, log, open_stream=slow_open)
    events = run.events(Told(log, before_last))
    if leaves in ("opening", "before_last"):
        reading = asyncio.ensure_future(anext(events) if leaves == "opening" else run_out(events))
        await asyncio.sleep(0.05)
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
    elif leaves != "unread":
        hold.set()
        while not isinstance(await anext(events), Done if leaves == "final" else Chunk):
            pass
    await events.aclose()
    if leaves == "unread":
        assert log == []
        return
    assert log.count("on_end") == 1 and log[-2:] == ["over", "on_end"], log
    assert ("closed" in log) == (leaves != "opening"), log
    if leaves != "before_last":  # (then the answer was whole: its record says how it ended)
        assert run.record.disconnected == (leaves != "final")


@pytest.mark.parametrize("script", [NORMAL, FAILING], ids=["done", "failed"])
async def test_an_upstream_close_that_raises_still_lets_the_final_event_out(script, caplog):
    """The close comes before the final event: a close that fails is logged, and the caller still
    gets its one final event, as when the close came after it."""
    log: list[str] = []
    run = told(script, log)

    async def failing_close():
        raise RuntimeError("the connection was already gone")

    run.upstream.close = failing_close
    with caplog.at_level(logging.ERROR, logger="chatstream"):
        events = [event async for event in run.events(Told(log))]
    assert isinstance(events[-1], Done if script is NORMAL else Failed)
    assert "closing the upstream stream failed" in caplog.text and log[-1] == "on_end"
