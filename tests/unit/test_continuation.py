"""chatstream/continuation.py: an answer whose upstream fails after output goes on on another
stream. The seam (``Seam``) against every cut of the scripted answers and any chunking of the
continuation, whether the model starts again, repeats the tail or goes on exactly; then the whole of
it through the stream core (``relay``) against in-memory upstreams: one text, one final event, the
guard across the seam, and the failures that are not continued."""

from __future__ import annotations

import asyncio
import re

import httpx2
import openai
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from chatstream.apis.completions import CompletionStream
from chatstream.continuation import (
    CONTINUE_PROMPT,
    LEADING_SPACE,
    MIN_OVERLAP,
    ChatContinuation,
    Seam,
    add_usage,
    continuation_request,
    overlap,
    turned_off,
)
from chatstream.errors import ApiError, ErrorKind, ModerationStop, UpstreamReported
from chatstream.guard import Redactor
from chatstream.pipeline import Pipeline
from chatstream.record import StreamRecord
from chatstream.settings import Settings
from chatstream.stream import Chunk, Done, Ends, Failed, TimeLimits, relay
from chatstream.upstreams.config import Entry
from chatstream.upstreams.outcomes import classify
from tools.fakeupstream.scenarios import TEXTS

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time

REQUEST = httpx2.Request("POST", "http://upstream.test/v1/chat/completions")
# Every scripted answer but the benchmark's, which repeats eight words over and over: a repeat of
# its tail cannot be told from new text (the module docstring says so).
ANSWERS = [text for name, text in TEXTS.items() if text and name != "cadence"]


# --- the seam ---------------------------------------------------------------------------------


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def across(known: str, pieces: list[str], dedupe: bool = True) -> tuple[str, int]:
    """What passes a seam after ``known`` when the continuation comes as ``pieces`` (then a finish
    without text, as a chunk with a finish_reason); and the most it held at once."""
    seam = Seam(known, dedupe)
    out, most = [], 0
    for i, piece in enumerate([*pieces, ""]):
        out += [text for _, text in seam.feed(i, piece, final=i == len(pieces))]
        most = max(most, seam.holding)
    return "".join(out), most


# How a model asked to go on may start: again from the start, again from a tail of at least
# MIN_OVERLAP characters, again from the cut word or the last sentence, exactly where it stopped; and
# with a line break or a space first.
MODES = ("restart", "tail", "word", "sentence", "exact")
LEADS = ("", " ", "\n", "\n\n")


def repeat_of(known: str, mode: str, length: int) -> str | None:
    """What a continuation in ``mode`` repeats of ``known`` (None: the mode does not fit this cut)."""
    if mode == "restart":
        return known
    if mode == "exact":
        return ""
    if mode == "tail":
        return known[-length:] if MIN_OVERLAP <= length < len(known) else None
    if mode == "word":  # the cut word, or what of it the text so far has ("were pl" + "playing")
        start = len(known)
        while start and known[start - 1].isalnum():
            start -= 1
        return known[start:] if start < len(known) else None
    # The last sentence, begun again: a repeat when long enough, or when the cut is in a word.
    found = re.search(r"(?:^|[.!?:]\s+)([^\W_][^.!?:]*)\Z", known)
    if found is None or (len(found.group(1)) < MIN_OVERLAP and not known[-1].isalnum()):
        return None
    return found.group(1)


@st.composite
def cut_answers(draw):
    """A scripted answer cut at any position, how a model goes on (``MODES``), what whitespace it
    starts with (``LEADS``; only before a repeat of the whole text or a tail of MIN_OVERLAP or more,
    which tells it from new text), and any chunking of what it sends."""
    answer = draw(st.sampled_from(ANSWERS))
    k = draw(st.integers(1, len(answer) - 1))
    known, rest = answer[:k], answer[k:]
    repeat = repeat_of(known, draw(st.sampled_from(MODES)), draw(st.integers(MIN_OVERLAP, max(MIN_OVERLAP, k - 1))))
    repeat = known if repeat is None else repeat
    lead = draw(st.sampled_from(LEADS)) if repeat == known or len(repeat) >= MIN_OVERLAP else ""
    sent = lead + repeat + rest
    cuts = draw(st.lists(st.integers(1, max(1, len(sent) - 1)), max_size=12))
    return known, rest, pieces_of(sent, cuts)


@settings(max_examples=examples(600), deadline=None)
@given(cut_answers())
def test_the_seam_passes_the_new_text_once_for_every_cut_and_chunking(case):
    known, rest, pieces = case
    passed, most = across(known, pieces)
    assert passed == rest
    assert most <= len(known) + LEADING_SPACE + max(map(len, pieces)), "the hold is bounded by the text so far"


def test_the_seam_is_exact_at_every_cut_of_every_scripted_answer():
    """Hypothesis draws; this walks every cut and repeat, with the continuation in one piece and in
    single characters."""
    for answer in ANSWERS:
        for k in range(1, len(answer)):
            known, rest = answer[:k], answer[k:]
            repeats = {known[k - j :] for j in (0, k, *range(MIN_OVERLAP, k))}
            repeats |= {r for mode in ("word", "sentence") if (r := repeat_of(known, mode, 0)) is not None}
            for repeat in repeats:
                for lead in LEADS if repeat == known or len(repeat) >= MIN_OVERLAP else ("",):
                    sent = lead + repeat + rest
                    assert across(known, [sent])[0] == rest, (answer, k, lead, repeat)
                    if k % 7 == 0 and repeat in ("", known):
                        assert across(known, list(sent))[0] == rest, (answer, k, lead, repeat)


@settings(max_examples=examples(200), deadline=None)
@given(st.text(max_size=40), st.text(max_size=40), st.lists(st.integers(1, 80), max_size=8))
def test_a_prefix_continuation_passes_as_it_comes(known, sent, cuts):
    assert across(known, pieces_of(sent, cuts), dedupe=False) == (sent, 0)


@settings(max_examples=examples(600), deadline=None)
@given(
    st.text(alphabet="ab .\n", min_size=1, max_size=30),
    st.text(alphabet="ab .\n", max_size=30),
    st.lists(st.integers(1, 60), max_size=8),
)
def test_the_seam_drops_the_longest_repeat_whatever_the_text(known, sent, cuts):
    """Any text, repetitive on purpose and with whitespace anywhere: the seam drops exactly
    ``overlap``, however the continuation comes in pieces (it holds while a longer repeat is
    possible, and no longer)."""
    passed, most = across(known, pieces_of(sent, cuts))
    assert passed == sent[overlap(known, sent) :]
    assert most <= len(known) + LEADING_SPACE + max(map(len, pieces_of(sent, cuts)), default=0)


def test_overlap_takes_the_whole_text_a_long_tail_or_the_cut_word():
    assert overlap("Hello there", "Hello there, friend") == 11  # started again
    assert overlap("Hello there", "\nHello there, friend") == 12  # ... on a new line
    assert overlap("Hello there", " Hello there, friend") == 12  # ... after a space
    assert overlap("one two three four", "three four five") == 10  # the tail repeated
    assert overlap("one two three four", "\nthree four five") == 11
    assert overlap("one two three four", "four five") == 4  # the cut word again
    assert overlap("they were pl", "playing") == 2  # the cut word begun again: "were playing"
    assert overlap("they were pl", "were playing") == 7
    assert overlap("It rained. They were pl", "They were playing") == 12  # the last sentence
    assert overlap("one two three four", " four five") == 0  # a space, then a short repeat: new text
    assert overlap("we went to", " today") == 0  # ("to" + " today" is not "today")
    assert overlap("abc", "abcdef") == 3  # the whole text so far, however short
    assert overlap("the end of it", " and more") == 0
    assert overlap("the end.", "end.") == 0  # no cut word: the text so far ends with no word
    assert overlap("Hello there", "     Hello there") == 0  # more whitespace than LEADING_SPACE
    # The limit, as documented: a word that begins with its own cut fragment loses it, and a model
    # that starts again in other words shows both wordings.
    assert overlap("a co", "conut") == 2
    assert overlap("The kids were pl", "The children were playing") == 0


# --- the request, usage, the header --------------------------------------------------------------


def entry(name: str, continuation: str = "prompt") -> Entry:
    return Entry(name=name, kind="openai", url=f"http://{name}.test/v1", continuation=continuation)  # type: ignore[arg-type]


def test_the_continuation_request_carries_the_text_so_far():
    params = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    prompt = continuation_request(params, "Hello, wor", entry("b"))
    assert prompt["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello, wor"},
        {"role": "user", "content": CONTINUE_PROMPT},
    ]
    assert "continue_final_message" not in prompt and params["messages"] == [{"role": "user", "content": "hi"}]
    prefix = continuation_request({**params, "max_tokens": 10}, "Hello, wor", entry("v", "prefix"))
    assert prefix["messages"][-1] == {"role": "assistant", "content": "Hello, wor"}
    assert prefix["continue_final_message"] is True and prefix["add_generation_prompt"] is False
    assert prefix["max_tokens"] == 10 - 3, "the cap less what was generated (Hello , wor: 3 tokens)"
    assert (
        continuation_request({**params, "max_completion_tokens": 2}, "Hello, wor", entry("b"))["max_completion_tokens"]
        == 1
    )


def test_with_no_text_so_far_the_continuation_is_the_request_as_it_was():
    """A stream taken over from a log holding none of the answer: no empty assistant turn and no
    instruction (a model answers the instruction: the chaos soak saw "...about the interruption.")."""
    params = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 9}
    for kind in ("prompt", "prefix"):
        again = continuation_request(params, "", entry("b", kind))
        assert again == params and again is not params


def test_usage_adds_up_with_its_details():
    a = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    b = {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "total_tokens": 13,
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    assert add_usage(add_usage(None, a), b) == {
        "prompt_tokens": 14,
        "completion_tokens": 7,
        "total_tokens": 21,
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    assert add_usage(None, None) is None and add_usage(a, None) == a


def test_the_header_turns_it_off():
    assert turned_off({"x-chatstream-continue": "off"}) and turned_off({"x-chatstream-continue": " OFF "})
    assert not turned_off({}) and not turned_off({"x-chatstream-continue": "on"})


# --- through the stream core --------------------------------------------------------------------


class Stream:
    """An in-memory upstream stream (an exception in the script is raised, a float sleeps); ``entry``
    as failover.PeekedStream has it."""

    ready = 0
    request_id = None

    def __init__(self, name: str, script: list):
        self.entry = entry(name, "prefix" if name.startswith("v") else "prompt")
        self.script = script
        self.closed = False
        self._iterator = self._play()

    def __aiter__(self):
        return self._iterator

    async def _play(self):
        for step in self.script:
            if isinstance(step, BaseException):  # explained, as failover.PeekedStream does
                raise step if isinstance(step, ApiError) else classify(step, midstream=True).error
            if isinstance(step, float):
                await asyncio.sleep(step)
                continue
            yield step

    async def close(self) -> None:
        self.closed = True


class Pool:
    """Stands in for failover.Upstreams: ``open`` gives the first stream, ``open_next`` each next one
    (or raises what is scripted), and keeps the requests the continuations made."""

    def __init__(self, first: Stream, *after: Stream | ApiError):
        self.first, self.after = first, list(after)
        self.requests: list[dict] = []
        self.failed: list[set[str]] = []

    async def open(self, path, params, protocol, limits, record):
        record.attempting(self.first.entry.name)
        return self.first

    async def open_next(self, path, model, request, protocol, limits, record, failed):
        self.failed.append(set(failed))
        following = self.after.pop(0)
        if isinstance(following, ApiError):
            raise following
        self.requests.append(request(following.entry))
        record.attempting(following.entry.name)
        return following


def chunk(content=None, finish=None, id="chatcmpl-a", created=1, **delta) -> dict:
    if content is not None:
        delta["content"] = content
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": "gpt-test",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def usage(prompt: int, completion: int) -> dict:
    return {
        "id": "x",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


ROLE = {"role": "assistant", "refusal": None}
LOST = openai.APIConnectionError(request=REQUEST)


def deltas(*texts: str, finish: str | None = "stop", id="chatcmpl-a", created=1) -> list[dict]:
    return [chunk("", role="assistant", id=id, created=created), *(chunk(t, id=id, created=created) for t in texts)] + (
        [chunk(finish=finish, id=id, created=created)] if finish else []
    )


def limits_settings(**values) -> Settings:
    base = {"FIRST_TOKEN_TIMEOUT_SECONDS": 5, "IDLE_TIMEOUT_SECONDS": 5, "TOTAL_TIMEOUT_SECONDS": 10}
    return Settings.model_validate({**base, **values, "USAGE_WAIT_SECONDS": 0.2})


async def run(pool: Pool, pipeline=None, most: int = 2, settings=None, params=None):
    record = StreamRecord(endpoint="chat", model="gpt-test")
    protocol = CompletionStream(pipeline or Pipeline())
    params = params or {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    continuation = ChatContinuation(pool, "/chat/completions", params, protocol, record, most)  # type: ignore[arg-type]
    limits = TimeLimits(settings or limits_settings())
    events = [
        e
        async for e in relay(
            pool, "/chat/completions", params, protocol, limits, record, Ends(lambda: None), continuation
        )
    ]
    return events, record


def chunks_of(events) -> list[dict]:
    return [e.data for e in events if isinstance(e, Chunk)]


def content(events) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks_of(events) if c["choices"])


async def test_a_lost_connection_goes_on_on_the_next_stream_with_one_text_and_one_final_event():
    a = Stream("a", [*deltas("Hello, ", "this is ", "the answer", finish=None), LOST])
    b = Stream("b", [*deltas("Hello, this is the ", "answer in ", "full.", id="chatcmpl-b", created=2), usage(20, 6)])
    events, record = await run(Pool(a, b))
    assert content(events) == "Hello, this is the answer in full."
    assert [type(e) for e in events].count(Done) == 1 and isinstance(events[-1], Done)
    done = events[-1]
    assert done.continued == (
        {
            "from": "a",
            "to": "b",
            "after_chars": 25,
            "reason": "upstream_disconnected",
            "seam": "matched",
            "dropped": 25,
        },
    )
    assert done.usage == {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26}
    assert (done.id, done.created) == ("chatcmpl-a", 1), "the answer's id, not the continuation's"
    assert a.closed and b.closed
    sent = chunks_of(events)
    assert {c["id"] for c in sent} == {"chatcmpl-a"} and {c["created"] for c in sent} == {1}
    assert sum(1 for c in sent if c["choices"][0]["delta"].get("role")) == 1, "one role chunk"
    assert sent[-1]["choices"][0]["finish_reason"] == "stop" and sent[-1]["continued"] == list(done.continued)
    assert [(s.upstream, s.text, s.usage) for s in record.segments] == [
        ("a", "Hello, this is the answer", None),
        ("b", "Hello, this is the answer in full.", {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26}),
    ], "each stream's own text before the seam, its repeat included"
    assert record.continued == list(done.continued) and record.usage == done.usage
    assert record.upstream == "b" and record.attempts == 2 and record.error is None


async def test_usage_is_the_sum_of_every_stream_that_reported_one():
    a = Stream("a", [*deltas("Partial ", "answer", finish=None), usage(5, 2), LOST])
    b = Stream("b", [*deltas("Partial answer", " and the rest."), usage(12, 4)])
    events, record = await run(Pool(a, b))
    assert content(events) == "Partial answer and the rest."
    assert events[-1].usage == {"prompt_tokens": 17, "completion_tokens": 6, "total_tokens": 23}


async def test_a_stall_goes_on_after_the_idle_limit():
    a = Stream("a", [*deltas("Thinking ", "about it", finish=None), 30.0])
    b = Stream("b", deltas("ing about it", " and done."))
    events, _ = await run(Pool(a, b), settings=limits_settings(IDLE_TIMEOUT_SECONDS=0.2))
    assert content(events) == "Thinking about it and done."
    assert events[-1].continued[0]["reason"] == "upstream_timeout"


async def test_an_error_event_and_a_stream_ended_early_go_on_too():
    for failure, reason in ((UpstreamReported("overloaded"), "upstream_error"), (None, "upstream_incomplete")):
        a = Stream("a", [*deltas("One, ", "two, ", finish=None), *([failure] if failure else [])])
        events, _ = await run(Pool(a, Stream("b", deltas("One, two, ", "three."))))
        assert content(events) == "One, two, three."
        assert events[-1].continued[0]["reason"] == reason


async def test_a_prefix_continuation_is_passed_on_as_it_comes():
    a = Stream("a", [*deltas("ha ha ", "ha ha ", finish=None), LOST])
    v = Stream("v", deltas("ha ha ", "ha!"))  # a true prefix continuation: its text is all new
    pool = Pool(a, v)
    events, _ = await run(pool)
    assert content(events) == "ha ha ha ha ha ha ha!"
    assert pool.requests[0]["continue_final_message"] is True


async def test_the_guard_catches_a_term_split_over_the_seam():
    pipeline = Pipeline()
    pipeline.text(lambda: Redactor(["secret plan"]))
    a = Stream("a", [*deltas("Here is the sec", finish=None), LOST])
    b = Stream("b", deltas("Here is the secret plan.", " Done."))
    events, _ = await run(Pool(a, b), pipeline)
    assert content(events) == "Here is the [redacted]. Done."


async def test_a_tool_call_in_progress_is_not_continued():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"ci'}}
    a = Stream("a", [chunk(None, role="assistant", tool_calls=[call]), LOST])
    pool = Pool(a, Stream("b", deltas("never")))
    events, record = await run(pool)
    assert isinstance(events[-1], Failed) and events[-1].error.type == ErrorKind.UPSTREAM_DISCONNECTED
    assert not any(c["choices"][0].get("finish_reason") for c in chunks_of(events)), "no call is finished"
    assert pool.requests == [] and record.continued == []


async def test_failures_that_are_not_the_upstreams_are_not_continued():
    """A 4xx-shaped error event, the total limit and a moderation stop end the answer as before."""
    refused = classify(openai.APIError("bad", REQUEST, body={"type": "invalid_request_error"})).error
    assert not refused.retryable
    for failure, kind in ((refused, ErrorKind.UPSTREAM_ERROR), (ModerationStop("no"), ErrorKind.CONTENT_FILTER)):
        pool = Pool(Stream("a", [*deltas("Some text ", finish=None), failure]), Stream("b", deltas("never")))
        events, _ = await run(pool)
        assert isinstance(events[-1], Failed) and events[-1].error.type == kind and pool.requests == []
    slow = Stream("a", [*deltas("Some ", finish=None), 0.3, *deltas("more", finish=None), 30.0])
    pool = Pool(slow, Stream("b", deltas("never")))
    events, _ = await run(pool, settings=limits_settings(TOTAL_TIMEOUT_SECONDS=0.2, IDLE_TIMEOUT_SECONDS=1))
    assert isinstance(events[-1], Failed) and events[-1].error.type == ErrorKind.TOTAL_TIMEOUT and pool.requests == []


async def test_at_most_continue_max_continuations_then_the_last_failure():
    def failing(name):
        return Stream(name, [*deltas("Again and again ", finish=None), LOST])

    pool = Pool(failing("a"), failing("b"), failing("a"), Stream("b", deltas("never")))
    events, record = await run(pool, most=2)
    assert isinstance(events[-1], Failed) and events[-1].error.type == ErrorKind.UPSTREAM_DISCONNECTED
    assert content(events) == "Again and again ", "the repeats were dropped"
    assert [s["to"] for s in record.continued] == ["b", "a"] and len(pool.after) == 1
    assert pool.failed == [{"a"}, {"a", "b"}]


async def test_when_no_stream_can_be_had_the_failure_that_broke_the_answer_stands():
    unavailable = ApiError(503, ErrorKind.UPSTREAM_UNAVAILABLE, "none", retryable=True)
    events, record = await run(Pool(Stream("a", [*deltas("Half ", finish=None), LOST]), unavailable))
    assert isinstance(events[-1], Failed) and events[-1].error.type == ErrorKind.UPSTREAM_DISCONNECTED
    assert content(events) == "Half " and record.continued == [] and record.error == "upstream_disconnected"


async def test_text_held_at_the_seam_when_the_next_stream_fails_too_is_not_lost():
    """b repeats the start and fails before it gets past the text so far: nothing of it went out,
    and the third stream goes on from the same text so far."""
    a = Stream("a", [*deltas("The first part, ", "then more", finish=None), LOST])
    b = Stream("b", [*deltas("The first part, then", finish=None), LOST])
    c = Stream("c", deltas("The first part, then more, ", "and the end."))
    pool = Pool(a, b, c)
    events, record = await run(pool)
    assert content(events) == "The first part, then more, and the end."
    assert pool.requests[1]["messages"][1]["content"] == "The first part, then more"
    assert [s["after_chars"] for s in record.continued] == [25, 25]
