"""The total time limit holds however slowly the caller reads (hardening item 7): the stream core
parked at ``yield`` behind a caller who stopped reading still closes the upstream at the limit, and
chunks that were already buffered do not carry the stream past it."""

from __future__ import annotations

import asyncio
import time

import idle_clock  # waits with nothing to do skipped (tests/idle_clock.py)

from chatstream.apis.completions import CompletionStream
from chatstream.pipeline import Pipeline
from chatstream.record import StreamRecord
from chatstream.settings import Settings
from chatstream.stream import Chunk, Ends, Failed, TimeLimits, relay

from .stream_helpers import Opener


def chunk(i: int) -> dict:
    return {
        "id": "c",
        "model": "m",
        "created": 1,
        "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}],
    }


class EndlessUpstream:
    """An upstream that always has the next chunk ready (as if buffered), and notes when it is closed."""

    ready = 0  # each chunk is a read of its own (stream.py writes the chunks in hand together)

    def __init__(self, pause: float = 0.0):
        self.pause = pause
        self.closed_at: float | None = None

    async def __aiter__(self):
        i = 0
        while True:
            if self.pause:
                await asyncio.sleep(self.pause)
            i += 1
            yield chunk(i)

    async def close(self) -> None:
        self.closed_at = time.monotonic()


def settings(total: float) -> Settings:
    return Settings.from_env(
        {
            "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
            "TOTAL_TIMEOUT_SECONDS": str(total),
            "IDLE_TIMEOUT_SECONDS": "30",
            "FIRST_TOKEN_TIMEOUT_SECONDS": "30",
        }
    )


def start(upstream: EndlessUpstream, total: float):
    record = StreamRecord(endpoint="openai", model="m")
    limits = TimeLimits(settings(total))

    async def open_stream():
        return upstream

    return relay(
        Opener(open_stream), "/chat/completions", {}, CompletionStream(Pipeline()), limits, record, Ends(lambda: None)
    ), record


def test_a_caller_that_stops_reading_does_not_keep_the_upstream_open_past_the_total_limit():
    async def run():
        upstream = EndlessUpstream(pause=0.01)
        events, record = start(upstream, total=0.5)
        started = time.monotonic()
        assert isinstance(await anext(events), Chunk)
        await asyncio.sleep(1.3)  # the caller reads nothing: the core is parked at yield
        assert upstream.closed_at is not None, "the upstream was still open after the total limit"
        assert upstream.closed_at - started < 0.5 + 0.5
        last = await anext(events)  # reading again: the stream ends with the limit's error
        assert isinstance(last, Failed) and last.error.type == "total_timeout"
        await events.aclose()
        assert record.error == "total_timeout"

    idle_clock.run(run())


def test_buffered_chunks_do_not_carry_a_stream_past_the_total_limit():
    async def run():
        upstream = EndlessUpstream(pause=0.0)  # every chunk ready at once: no wait ever times out
        events, _ = start(upstream, total=0.3)
        started = time.monotonic()
        async for event in events:
            if isinstance(event, Failed):
                assert event.error.type == "total_timeout"
                break
            await asyncio.sleep(0)
        assert time.monotonic() - started < 0.3 + 0.5
        await events.aclose()

    idle_clock.run(run())
