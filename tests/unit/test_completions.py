"""chatstream/completions.py: chat completions through the pipeline's text steps. ``CompletionStream``
never changes the upstream's dicts; ``BLOCKED_TERMS`` are redacted in the content, the refusal and the
tool-call arguments, each right for any chunking (hypothesis); ``filter_completion`` does the same for a
whole non-streamed answer."""

from __future__ import annotations

import copy

import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from chatstream.apis.completions import CompletionStream, filter_completion
from chatstream.errors import UpstreamMalformed
from chatstream.guard import Redactor, redact_whole
from chatstream.pipeline import Pipeline
from chatstream.record import StreamRecord
from chatstream.stream import NOTHING, Done

TERMS = ["secret", "sec", "cretin", "é😀"]
PIECES = ["secret", "sec", "ret", "cre", "tin", "s", "e", "c", "r", "t", "i", "n", " ", "é", "😀", "x", '{"a":']


def redacting(terms=TERMS) -> Pipeline:
    pipeline = Pipeline()
    pipeline.text(lambda: Redactor(terms))
    return pipeline


def record() -> StreamRecord:
    return StreamRecord(endpoint="openai", model="m", texts={})


def chunk(delta=None, finish=None, index=0, **extra) -> dict:
    choice = {"index": index, "delta": delta if delta is not None else {}, "finish_reason": finish}
    return {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice], **extra}


def tool_fragment(arguments: str, index: int = 0, **fields) -> dict:
    return {"index": index, "function": {"arguments": arguments}, **fields}


async def feed_all(stream: CompletionStream, chunks: list[dict]) -> list[dict]:
    """The forwarded chunks (feeds every chunk; checks none of them was changed)."""
    forwarded = []
    for data in chunks:
        before = copy.deepcopy(data)
        fed = await stream.feed(data)
        assert data == before, "feed changed the upstream's dict"
        if fed is not NOTHING:
            forwarded.append(fed.data)
    return forwarded


def channel_text(forwarded: list[dict], channel, choice: int = 0) -> str:
    out = []
    for data in forwarded:
        for c in data["choices"]:
            if c["index"] != choice:
                continue
            delta = c["delta"]
            if isinstance(channel, tuple):
                out += [
                    t["function"]["arguments"]
                    for t in delta.get("tool_calls") or []
                    if t.get("index") == channel[1] and (t.get("function") or {}).get("arguments")
                ]
            else:
                out.append(delta.get(channel) or "")
    return "".join(out)


# ---------------------------------------------------------------------- feed: new dicts only


@pytest.mark.parametrize("pipeline", [Pipeline(), redacting()], ids=["plain", "redacting"])
async def test_feed_never_changes_its_input_and_returns_new_dicts(pipeline):
    stream = CompletionStream(pipeline)
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "a sec"}),
        chunk({"tool_calls": [tool_fragment("", id="call_1", type="function")]}),
        chunk({"tool_calls": [tool_fragment('{"k": "secr')]}),
        chunk({"refusal": "no sec"}),
        chunk({"content": "ret"}),
        {"id": "c1", "choices": [{"index": 0, "finish_reason": "stop"}]},  # no delta: one is made
        {"id": "c1", "choices": [], "usage": {"total_tokens": 3}},
    ]
    originals = copy.deepcopy(chunks)
    for data, original in zip(chunks, originals):
        fed = await stream.feed(data)
        assert data == original
        if fed is not NOTHING and pipeline.filters_text:
            assert fed.data is not data
            for new, old in zip(fed.data["choices"], data["choices"]):
                assert new is not old and new.get("delta") is not old.get("delta")


async def test_without_text_steps_chunks_are_forwarded_as_they_came():
    stream = CompletionStream(Pipeline())
    data = chunk({"content": "a secret"}, system_fingerprint="fp")
    fed = await stream.feed(data)
    assert fed.data == data and fed.output and fed.delta


async def test_the_plain_path_gives_what_the_general_path_gives():
    """Without text steps, the common chunk (one choice, a delta of role and content, and OpenAI's
    role chunk with its null refusal) is decided without copying (``CompletionStream._read_plain``),
    with kept texts (``keep=True``: a keyed request's) or without: the same events, flags, state and
    kept texts as the general path, for plain and other shapes."""
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"role": "assistant", "content": "", "refusal": None}),
        chunk({"role": "assistant", "refusal": "no"}),
        chunk({"content": "a"}, logprobs=None),
        chunk({"content": None}),
        chunk({"role": "assistant"}),
        {"id": "c1", "choices": [{"delta": {"content": "no index"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "b"}, "content_filter_results": {}}]},
        chunk({"content": "c", "refusal": None}),
        chunk({"tool_calls": [tool_fragment("{}")]}),
        {"id": "c1", "choices": [{"index": 0, "finish_reason": None}]},  # no delta: the general path makes one
        chunk({"content": ""}, ""),
        chunk({}, "stop"),
        chunk({"content": "after the finish"}),
        {"id": "c1", "choices": [], "usage": {"total_tokens": 3}},
    ]
    plain, kept, general = (CompletionStream(Pipeline(), keep=keep) for keep in (False, True, True))
    general._read_plain = general.note  # it notes every chunk, then declines: the general path decides
    for data in chunks:
        slow = await general.feed(copy.deepcopy(data))
        for stream in (plain, kept):
            fast = await stream.feed(copy.deepcopy(data))
            assert (fast.data, fast.output, fast.delta, fast.batch) == (slow.data, slow.output, slow.delta, slow.batch)
            assert stream.finished == general.finished and stream.done == general.done
    assert plain.summary() == kept.summary() == general.summary()
    assert kept.generated == general.generated and kept.released == general.released
    assert kept.generated is not None and kept.released is not None
    assert "".join(kept.generated[0]) == "noano indexbc{}" and "".join(kept.released[0]) == "ano indexbc"
    with pytest.raises(UpstreamMalformed):
        await CompletionStream(Pipeline()).feed({"choices": [{"index": 0, "delta": {"content": 5}}]})


async def test_fed_flags():
    stream = CompletionStream(Pipeline(), choices=2)
    assert (await stream.feed(chunk({"role": "assistant"}))).output is False
    assert (await stream.feed({"choices": []})) is NOTHING
    fed = await stream.feed(chunk({}, "stop", index=1))
    assert fed.output and not fed.delta
    fed = await stream.feed(chunk({"content": "x"}))
    assert fed.output and fed.delta
    assert not stream.done and stream.finished == {1: "stop"}
    await stream.feed(chunk({"content": "late"}, index=1))
    assert (await stream.feed(chunk({"content": "late"}, index=1))) is NOTHING
    await stream.feed(chunk({}, "length"))
    assert stream.done


async def test_note_and_summary():
    stream = CompletionStream(Pipeline(), keep=True)
    stream.note({"id": "c1", "model": "m-1", "created": 5})
    stream.note({"id": "", "model": None, "choices": []})
    stream.note({"usage": {"total_tokens": 9}})
    await stream.feed(chunk({"content": "ab"}, "stop"))
    assert stream.summary() == Done("stop", {0: "stop"}, {"total_tokens": 9}, "m", "c1", 5)
    assert stream.released == {0: ["ab"]} and stream.generated == {0: ["ab"]}


async def test_a_choice_held_back_entirely_is_not_sent_but_its_role_is():
    stream = CompletionStream(redacting())
    assert (await stream.feed(chunk({"content": "sec"}))) is NOTHING
    fed = await stream.feed(chunk({"role": "assistant", "content": "re"}))
    assert fed.data["choices"][0]["delta"] == {"role": "assistant", "content": ""} and not fed.output


async def test_the_flushed_tail_goes_into_the_finishing_chunk_even_without_a_delta():
    stream = CompletionStream(redacting())
    await stream.feed(chunk({"content": "a se"}))
    fed = await stream.feed({"choices": [{"index": 0, "finish_reason": "stop"}]})
    assert fed.data["choices"][0] == {"index": 0, "finish_reason": "stop", "delta": {"content": "se"}}
    assert fed.output and fed.delta


async def test_a_tool_calls_held_arguments_are_flushed_as_a_fragment_of_that_call():
    stream = CompletionStream(redacting())
    await stream.feed(
        chunk(
            {
                "tool_calls": [
                    tool_fragment("", 0, id="call_a", type="function"),
                    tool_fragment("", 1, id="call_b", type="function"),
                ]
            }
        )
    )
    fed = await stream.feed(chunk({"tool_calls": [tool_fragment("x se", 0), tool_fragment("cr", 1)]}))
    assert fed.data["choices"][0]["delta"]["tool_calls"] == [tool_fragment("x ", 0)], (
        "a fragment left with nothing is dropped"
    )
    fed = await stream.feed(chunk({}, "tool_calls"))
    assert fed.data["choices"][0]["delta"]["tool_calls"] == [tool_fragment("se", 0), tool_fragment("cr", 1)]


async def test_released_content_is_kept_for_the_after_steps():
    stream = CompletionStream(redacting(), choices=2, keep=True)
    await feed_all(
        stream,
        [
            chunk({"content": "a secret"}),
            chunk({"content": "b"}, index=1),
            chunk({"content": " x se"}, "stop"),
            chunk({}, "stop", index=1),
        ],
    )
    assert {i: "".join(t) for i, t in stream.released.items()} == {0: "a [redacted] x se", 1: "b"}


@pytest.mark.parametrize(
    "bad",
    [
        {"choices": "x"},
        {"choices": {"a": 1}},
        {"choices": [None]},
        {"choices": [{"delta": 1}]},
        {"choices": [{"delta": {"content": {"text": "x"}}}]},
        {"choices": [{"delta": {"tool_calls": "x"}}]},
    ],
)
async def test_malformed_choices(bad):
    with pytest.raises(UpstreamMalformed):
        await CompletionStream(Pipeline()).feed(bad)


# ---------------------------------------------------------- redaction for any chunking (hypothesis)

texts = st.lists(st.sampled_from(PIECES), max_size=20).map("".join)


def split(text: str, cuts: list[int]) -> list[str]:
    points = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    return [text[a:b] for a, b in zip(points, points[1:])]


def delta_for(channel, piece: str) -> dict:
    if channel == "content":
        return {"content": piece}
    if channel == "refusal":
        return {"refusal": piece}
    return {"tool_calls": [tool_fragment(piece, channel[1])]}


def interleavings(labels: list, counts: list[int]):
    """An order in which to send ``counts[i]`` pieces labelled ``labels[i]`` (each label's pieces keep
    their own order): one draw, a permutation of the multiset of labels."""
    return st.permutations([label for label, n in zip(labels, counts) for _ in range(n)])


def drive(coro):
    """Run a coroutine that never suspends (text steps without moderation await nothing real) without
    an event loop: the property tests run it hundreds of times."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("the coroutine suspended")


@st.composite
def split_texts(draw):
    text = draw(texts)
    return text, split(text, draw(st.lists(st.integers(0, len(text)), max_size=12)))


@settings(max_examples=examples(150), deadline=None)
@given(channel=st.sampled_from(["content", "refusal", ("tool", 0)]), case=split_texts())
def test_each_text_channel_is_redacted_for_any_chunking(channel, case):
    text, pieces = case
    chunks = [chunk({"role": "assistant"})]
    if channel != "content" and channel != "refusal":
        chunks.append(chunk({"tool_calls": [tool_fragment("", 0, id="call_1", type="function")]}))
    chunks += [chunk(delta_for(channel, p)) for p in pieces]
    chunks.append(chunk({}, "stop"))

    forwarded = drive(feed_all(CompletionStream(redacting()), chunks))
    assert channel_text(forwarded, channel) == redact_whole(text, TERMS)


@settings(max_examples=examples(100), deadline=None)
@given(cases=st.tuples(split_texts(), split_texts(), split_texts(), split_texts()), data=st.data())
def test_channels_interleaved_are_redacted_apart(cases, data):
    """Content, refusal and two tool calls' arguments interleaved in one choice, each split its own
    way: every channel comes out as its whole text redacted, as if it had been alone."""
    channels = ["content", "refusal", ("tool", 0), ("tool", 1)]
    queues = {ch: list(pieces) for ch, (_, pieces) in zip(channels, cases)}
    chunks = [
        chunk(
            {
                "tool_calls": [
                    tool_fragment("", 0, id="a", type="function"),
                    tool_fragment("", 1, id="b", type="function"),
                ]
            }
        )
    ]
    for channel in data.draw(interleavings(channels, [len(q) for q in queues.values()])):
        chunks.append(chunk(delta_for(channel, queues[channel].pop(0))))
    chunks.append(chunk({}, "stop"))

    forwarded = drive(feed_all(CompletionStream(redacting()), chunks))
    for channel, (text, _) in zip(channels, cases):
        assert channel_text(forwarded, channel) == redact_whole(text, TERMS), channel


@settings(max_examples=examples(75), deadline=None)
@given(first=split_texts(), second=split_texts(), data=st.data())
def test_choices_are_redacted_apart(first, second, data):
    queues = {0: list(first[1]), 1: list(second[1])}
    chunks = [
        chunk({"content": queues[index].pop(0)}, index=index)
        for index in data.draw(interleavings([0, 1], [len(q) for q in queues.values()]))
    ]
    chunks += [chunk({}, "stop", index=1), chunk({}, "stop", index=0)]
    stream = CompletionStream(redacting(), choices=2)
    forwarded = drive(feed_all(stream, chunks))
    assert stream.done
    assert channel_text(forwarded, "content", 0) == redact_whole(first[0], TERMS)
    assert channel_text(forwarded, "content", 1) == redact_whole(second[0], TERMS)


async def test_legacy_function_call_arguments_are_redacted_too():
    stream = CompletionStream(redacting())
    forwarded = await feed_all(
        stream,
        [
            chunk({"function_call": {"name": "f", "arguments": "a sec"}}),
            chunk({"function_call": {"arguments": "ret b"}}),
            chunk({}, "function_call"),
        ],
    )
    arguments = "".join(
        c["delta"].get("function_call", {}).get("arguments", "") for d in forwarded for c in d["choices"]
    )
    assert arguments == "a [redacted] b"


# ------------------------------------------------------------------- a whole (non-streamed) answer

COMPLETION = {
    "id": "chatcmpl-9",
    "object": "chat.completion",
    "model": "m-1",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": "a secret here",
                "refusal": "no sec, no cretin",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "secret", "arguments": '{"q": "secret"}'},
                    },
                    {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                    "odd",
                ],
            },
        },
        {"index": 1, "finish_reason": "stop", "message": {"role": "assistant", "content": "é😀!"}},
        "not a choice",
    ],
    "usage": {"total_tokens": 12},
}


async def test_filter_completion_redacts_every_text_and_leaves_the_input_alone():
    body = copy.deepcopy(COMPLETION)
    rec = record()
    out = await filter_completion(body, redacting(), rec)
    assert body == COMPLETION, "the upstream's body is not changed"
    message = out["choices"][0]["message"]
    assert message["content"] == "a [redacted] here"
    assert message["refusal"] == "no [redacted], no [redacted]"
    assert message["tool_calls"][0]["function"] == {"name": "secret", "arguments": '{"q": "[redacted]"}'}, (
        "the function name is not text: only the arguments are redacted"
    )
    assert message["tool_calls"][1:] == COMPLETION["choices"][0]["message"]["tool_calls"][1:]
    assert out["choices"][1]["message"]["content"] == "[redacted]!"
    assert out["choices"][2] == "not a choice"
    assert {k: v for k, v in out.items() if k != "choices"} == {k: v for k, v in COMPLETION.items() if k != "choices"}
    assert rec.usage == {"total_tokens": 12} and rec.finish_reason == "tool_calls"
    assert rec.texts == {0: ["a [redacted] here"], 1: ["[redacted]!"]}


async def test_filter_completion_without_text_steps_changes_nothing():
    out = await filter_completion(copy.deepcopy(COMPLETION), Pipeline(), record())
    assert out == COMPLETION


@pytest.mark.parametrize("body", [{}, {"choices": None}, {"choices": {"0": {}}}, {"error": "x"}])
async def test_filter_completion_without_choices_is_malformed(body):
    with pytest.raises(UpstreamMalformed):
        await filter_completion(body, redacting(), record())


async def test_filter_completion_redacts_legacy_function_call_arguments():
    body = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "function_call",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "f", "arguments": "a secret"},
                },
            }
        ]
    }
    out = await filter_completion(body, redacting(), record())
    assert out["choices"][0]["message"]["function_call"]["arguments"] == "a [redacted]"
