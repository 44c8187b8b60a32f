"""chatstream/apis/usage.py: what the state is told of a request, from a real CallRequest and
StreamRecord: the admission request (prompt counted, default cap added, referenced context) and
what a finished request used (reported usage, counted text, a prompt read and abandoned, nothing)."""

from __future__ import annotations

from chatstream import tokens
from chatstream.apis.usage import admission_request, ended, request_usage
from chatstream.errors import ErrorKind
from chatstream.pipeline import CallRequest
from chatstream.record import Segment, StreamRecord
from chatstream.state.port import Used

MODEL = "gpt-4o"


def record() -> StreamRecord:
    return StreamRecord(endpoint="openai", model=MODEL)


def test_the_admission_request_counts_the_prompt_adds_the_default_cap_and_names_the_referenced_context():
    call = CallRequest(
        params={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3}, endpoint="openai"
    )
    rec = record()
    asked = admission_request(call, rec, 100)
    assert call.params["max_completion_tokens"] == 100  # sent to the upstream: what is reserved bounds it
    assert (asked.request_id, asked.endpoint, asked.model) == (rec.id, "openai", MODEL)
    assert asked.prompt_tokens == tokens.count_prompt(MODEL, call.params) and asked.output_tokens == 300
    assert (asked.previous, asked.references) == (None, False)
    responses = CallRequest(
        params={
            "model": MODEL,
            "input": [{"type": "item_reference", "id": "msg_1"}],
            "previous_response_id": "resp_1",
            "max_output_tokens": 7,
        },
        endpoint="responses",
    )
    asked = admission_request(responses, record(), 100)
    assert (asked.previous, asked.references, asked.output_tokens) == ("resp_1", True, 7)
    assert "max_completion_tokens" not in responses.params


def test_the_output_reserved_is_n_times_the_cap_named_else_the_default():
    def output(**params) -> int:
        call = CallRequest(
            params={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **params}, endpoint="openai"
        )
        return admission_request(call, record(), 4096).output_tokens

    assert output() == 4096 and output(max_tokens=50) == 50
    assert output(max_completion_tokens=70, n=3) == 210
    assert output(max_tokens=True) == 4096  # not a number: the default cap is added and reserved


def test_a_finished_request_used_what_its_upstream_reported_else_what_was_sent_and_generated():
    reported = record()
    reported.attempting("east", "gpt-4o-deployment")
    reported.upstream_answered()
    reported.request_id = "req-up"
    reported.usage = {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}
    used = request_usage(MODEL, 99, reported, {0: ["ignored"]})
    assert used.segments == (Used(10, 4, 5, "east", model="gpt-4o-deployment"),)
    assert (used.reported, used.upstream_id, used.ended) == (True, "req-up", "completed")

    cut = record()
    cut.attempting("east")
    cut.upstream_answered()
    cut.hung_up()
    used = request_usage(MODEL, 12, cut, {0: ["Once upon", " a time"], 1: ["There was"]})
    each = tokens.count_text(MODEL, "Once upon a time") + tokens.count_text(MODEL, "There was")
    assert used.segments == (Used(12, 0, each, "east"),) and not used.reported and used.ended == "disconnected"

    abandoned = record()
    abandoned.attempting("east")
    abandoned.cut_short()
    abandoned.failed(ErrorKind.TOTAL_TIMEOUT)
    used = request_usage(MODEL, 12, abandoned, None)
    assert used.segments == (Used(12, 0, 0, "east"),) and used.ended == "timeout"

    never = record()
    never.failed(ErrorKind.UPSTREAM_UNAVAILABLE)
    assert request_usage(MODEL, 12, never, None).segments == ()


def test_a_continued_answer_used_each_segment_on_its_own():
    rec = record()
    rec.upstream_answered()
    first = Segment("a")
    first.parts.append("Once upon")
    failed = Segment("b", prompt_tokens=87, model=MODEL)  # sent the requested name: not a served one
    failed.parts.append("a time")
    last = Segment("a", usage={"input_tokens": 95, "output_tokens": 20}, request_id="req-a")
    rec.segment(first)
    rec.segment(failed)
    rec.segment(last)
    rec.continued_on({"from": "a", "to": "b"})
    used = request_usage(MODEL, 12, rec, None)
    assert used.segments == (
        Used(12, 0, tokens.count_text(MODEL, "Once upon"), "a"),
        Used(87, 0, tokens.count_text(MODEL, "a time"), "b"),
        Used(95, 0, 20, "a", "req-a"),
    )


def test_how_a_request_ended_a_hang_up_first():
    rec = record()
    assert ended(rec) == "completed"
    rec.failed("cancelled")
    assert ended(rec) == "cancelled"
    rec.failed(ErrorKind.UPSTREAM_TIMEOUT)
    assert ended(rec) == "timeout"
    rec.hung_up()
    assert ended(rec) == "disconnected"
