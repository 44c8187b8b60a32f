"""The Responses stream protocol (chatstream/api_responses.py) in-process, with BLOCKED_TERMS' Redactor
as the text step: however the upstream splits a text into deltas, the deltas a caller joins, every
repeated full text (``output_text.done``, ``content_part.done``, ``output_item.done``, the terminal
``response``) and the non-streamed response all say ``redact_whole(text)``; sequence numbers and event
order are the upstream's; the upstream's dicts are not changed."""

from __future__ import annotations

import asyncio
import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from chatstream.apis.responses_stream import ResponseEncoder, ResponseStream, filter_response
from chatstream.guard import Redactor, redact_whole
from chatstream.pipeline import Pipeline
from chatstream.record import StreamRecord
from chatstream.stream import NOTHING, Chunk, Done

TERMS = ["secret", "sec", "日本", "🙂🚀", "ab"]
ALPHABET = ["s", "e", "c", "r", "t", "a", "b", " ", "\n", "日", "本", "🙂", "🚀", "é"]
texts = st.text(alphabet=ALPHABET, max_size=60)


def pipeline() -> Pipeline:
    p = Pipeline()
    p.text(lambda: Redactor(TERMS))
    return p


def cuts(draw, text: str) -> list[str]:
    points = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    points = [p for p in points if 0 < p < len(text)]
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def started_response() -> dict:
    """The response object of the first events of a stream (a new one each time)."""
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "m",
        "output": [],
        "usage": None,
        "status": "in_progress",
    }


def script(text_chunks: list[str], arg_chunks: list[str], summary_chunks: list[str]) -> list[dict]:
    """A Responses stream as OpenAI sends it: a reasoning item (summary), a message, a function call."""
    text, args, summary = "".join(text_chunks), "".join(arg_chunks), "".join(summary_chunks)
    reasoning = {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": summary}]}
    message = {
        "id": "msg_1",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}],
    }
    call = {
        "id": "fc_1",
        "type": "function_call",
        "status": "completed",
        "arguments": args,
        "call_id": "call_1",
        "name": "get_weather",
    }
    base = started_response()
    events: list[dict] = [
        {"type": "response.created", "response": base},
        {"type": "response.in_progress", "response": base},
        {"type": "response.output_item.added", "output_index": 0, "item": {**reasoning, "summary": []}},
        {
            "type": "response.reasoning_summary_part.added",
            "output_index": 0,
            "summary_index": 0,
            "item_id": "rs_1",
            "part": {"type": "summary_text", "text": ""},
        },
        *(
            {
                "type": "response.reasoning_summary_text.delta",
                "output_index": 0,
                "summary_index": 0,
                "item_id": "rs_1",
                "delta": d,
                "obfuscation": "xx",
            }
            for d in summary_chunks
        ),
        {
            "type": "response.reasoning_summary_text.done",
            "output_index": 0,
            "summary_index": 0,
            "item_id": "rs_1",
            "text": summary,
        },
        {
            "type": "response.reasoning_summary_part.done",
            "output_index": 0,
            "summary_index": 0,
            "item_id": "rs_1",
            "part": {"type": "summary_text", "text": summary},
        },
        {"type": "response.output_item.done", "output_index": 0, "item": reasoning},
        {
            "type": "response.output_item.added",
            "output_index": 1,
            "item": {**message, "status": "in_progress", "content": []},
        },
        {
            "type": "response.content_part.added",
            "output_index": 1,
            "content_index": 0,
            "item_id": "msg_1",
            "part": {"type": "output_text", "annotations": [], "logprobs": [], "text": ""},
        },
        *(
            {
                "type": "response.output_text.delta",
                "output_index": 1,
                "content_index": 0,
                "item_id": "msg_1",
                "delta": d,
                "logprobs": [],
            }
            for d in text_chunks
        ),
        {
            "type": "response.output_text.done",
            "output_index": 1,
            "content_index": 0,
            "item_id": "msg_1",
            "text": text,
            "logprobs": [],
        },
        {
            "type": "response.content_part.done",
            "output_index": 1,
            "content_index": 0,
            "item_id": "msg_1",
            "part": message["content"][0],
        },
        {"type": "response.output_item.done", "output_index": 1, "item": message},
        {
            "type": "response.output_item.added",
            "output_index": 2,
            "item": {**call, "arguments": "", "status": "in_progress"},
        },
        *(
            {"type": "response.function_call_arguments.delta", "output_index": 2, "item_id": "fc_1", "delta": d}
            for d in arg_chunks
        ),
        {
            "type": "response.function_call_arguments.done",
            "output_index": 2,
            "item_id": "fc_1",
            "name": "get_weather",
            "arguments": args,
        },
        {"type": "response.output_item.done", "output_index": 2, "item": call},
        {
            "type": "response.completed",
            "response": {
                **base,
                "status": "completed",
                "output": [reasoning, message, call],
                "usage": {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3},
            },
        },
    ]
    return [{**e, "sequence_number": i} for i, e in enumerate(events)]


async def run(events: list[dict], p: Pipeline) -> tuple[list[dict], ResponseStream]:
    stream = ResponseStream(p, keep=True)
    out = []
    for event in events:
        assert not stream.done
        fed = await stream.feed(event)
        if fed is not NOTHING:
            out.extend([fed.data, *fed.batch])
    assert stream.done
    return out, stream


def joined(events: list[dict], kind: str, output_index: int) -> str:
    return "".join(e["delta"] for e in events if e["type"] == kind and e["output_index"] == output_index)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_deltas_and_every_full_text_are_the_same_redacted_text(data):
    text, args, summary = data.draw(texts), data.draw(texts), data.draw(texts)
    text_chunks, arg_chunks, summary_chunks = cuts(data.draw, text), cuts(data.draw, args), cuts(data.draw, summary)
    events = script(text_chunks, arg_chunks, summary_chunks)
    before = copy.deepcopy(events)
    out, stream = asyncio.run(run(events, pipeline()))
    assert events == before, "the upstream's dicts are not changed"
    assert [e["sequence_number"] for e in out] == [e["sequence_number"] for e in events], (
        "every event, in order, with its own number"
    )

    want_text, want_args, want_summary = (redact_whole(t, TERMS) for t in (text, args, summary))
    by_type = {}
    for e in out:
        by_type.setdefault(e["type"], []).append(e)
    assert joined(out, "response.output_text.delta", 1) == want_text
    assert joined(out, "response.function_call_arguments.delta", 2) == want_args
    assert joined(out, "response.reasoning_summary_text.delta", 0) == want_summary
    assert by_type["response.output_text.done"][0]["text"] == want_text
    assert by_type["response.content_part.done"][0]["part"]["text"] == want_text
    assert by_type["response.function_call_arguments.done"][0]["arguments"] == want_args
    assert by_type["response.reasoning_summary_text.done"][0]["text"] == want_summary
    assert by_type["response.reasoning_summary_part.done"][0]["part"]["text"] == want_summary
    items = {e["output_index"]: e["item"] for e in by_type["response.output_item.done"]}
    final = by_type["response.completed"][0]["response"]["output"]
    for item in (items, dict(enumerate(final))):
        assert item[0]["summary"][0]["text"] == want_summary
        assert item[1]["content"][0]["text"] == want_text
        assert item[2]["arguments"] == want_args
    assert "".join(stream.released.get(0, [])) == want_text
    assert stream.summary().usage["total_tokens"] == 3

    body = by_type["response.completed"][0]["response"]
    upstream_body = events[-1]["response"]
    record2 = StreamRecord(endpoint="responses", model="m")
    filtered = asyncio.run(filter_response(upstream_body, pipeline(), record2))
    assert filtered["output"] == body["output"], "the non-streamed response says the same"
    assert upstream_body == before[-1]["response"]


def test_without_text_steps_events_pass_unchanged_and_at_once():
    events = script(["Hello ", "secret ", "world"], ['{"a":', "1}"], ["think"])
    out, _ = asyncio.run(run(events, Pipeline()))
    assert out == events and all(a is b for a, b in zip(out, events))


def test_opening_events_are_not_output_and_the_terminal_status_is_the_finish_reason():
    events = script(["Hi"], ["{}"], ["s"])
    stream = ResponseStream(Pipeline())

    async def feed_all():
        return [await stream.feed(e) for e in events]

    fed = asyncio.run(feed_all())
    assert [f.output for f in fed[:2]] == [False, False] and all(f.output for f in fed[2:])
    assert sum(f.delta for f in fed) == 3
    done = stream.summary()
    assert (done.finish_reason, done.id, done.model) == ("completed", "resp_1", "m")


def test_encoder_names_each_event_and_ends_a_failure_with_the_next_sequence_number():
    from chatstream.errors import ApiError
    from chatstream.stream import Failed

    encode = ResponseEncoder()
    a = {"type": "response.output_text.delta", "sequence_number": 4, "delta": "é"}
    b = {"type": "response.output_text.delta", "sequence_number": 5, "delta": "x"}
    assert (
        encode(Chunk(a))
        == (
            "event: response.output_text.delta\n"
            'data: {"type":"response.output_text.delta","sequence_number":4,"delta":"é"}\n\n'
        ).encode()
    )
    assert encode(Chunk(b)).startswith(b"event: response.output_text.delta\ndata: ")
    assert encode(Done("completed", {}, None, None, None, None)) is None
    tail = encode(Failed(ApiError(504, "idle_timeout", "the model went quiet")))
    assert (
        tail == b'event: error\ndata: {"type":"error","sequence_number":6,"code":"idle_timeout",'
        b'"message":"the model went quiet","param":null,"chatstream_kind":"idle_timeout"}\n\n'
    )


def test_odd_upstream_events_are_upstream_malformed_not_a_bug_of_ours():
    import pytest

    from chatstream.errors import UpstreamMalformed

    odd = [
        {"type": None},
        {"type": "a\nb"},
        {"type": "response.output_text.delta", "delta": 5},
        {"type": "response.output_text.delta", "delta": "x", "output_index": [1]},
        {"type": "response.output_item.done", "output_index": "1", "item": {}},
    ]
    for event in odd:
        stream = ResponseStream(pipeline())
        with pytest.raises(UpstreamMalformed):
            asyncio.run(stream.feed(event))


def test_an_upstream_error_event_fails_the_stream():
    import pytest

    from chatstream.errors import ApiError

    for event in (
        {"type": "error", "code": "server_error", "message": "boom"},
        {"type": "error", "error": {"type": "server_error", "message": "boom"}},
    ):
        with pytest.raises(ApiError) as info:
            asyncio.run(ResponseStream(Pipeline()).feed(event))
        assert info.value.type == "upstream_error" and "boom" in info.value.message


def audio_script(chunks: list[str], done: bool) -> list[dict]:
    """A spoken answer: its transcript comes only in transcript deltas (the done event has no text)."""
    base = started_response()
    events: list[dict] = [
        {"type": "response.created", "response": base},
        {"type": "response.output_item.added", "output_index": 0, "item": {"type": "message"}},
    ]
    for chunk in chunks:
        events += [
            {"type": "response.audio.delta", "delta": "AAAA"},
            {"type": "response.audio.transcript.delta", "delta": chunk},
        ]
    events += [{"type": "response.audio.done"}] + ([{"type": "response.audio.transcript.done"}] if done else [])
    events += [{"type": "response.completed", "response": {**base, "status": "completed"}}]
    return [{**e, "sequence_number": i} for i, e in enumerate(events)]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_an_audio_transcript_is_redacted_for_any_chunking(data):
    """Issue #23 item 14: response.audio.transcript.delta is a text the model streams."""
    text = data.draw(texts)
    events = audio_script(cuts(data.draw, text), done=data.draw(st.booleans()))
    out, _ = asyncio.run(run(events, pipeline()))
    assert "".join(e["delta"] for e in out if e["type"] == "response.audio.transcript.delta") == redact_whole(
        text, TERMS
    )
    numbers = [e["sequence_number"] for e in out]
    # Every event in order; a tail held until after another event rides in a copy of the last
    # transcript delta, with that delta's number (nothing later is renumbered), as for every text.
    assert list(dict.fromkeys(numbers)) == [e["sequence_number"] for e in events]
    copies = [e for e in out if numbers.count(e["sequence_number"]) > 1]
    assert all(e["type"] == "response.audio.transcript.delta" for e in copies)
