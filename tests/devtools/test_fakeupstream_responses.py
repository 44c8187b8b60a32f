"""fakeupstream's Responses API, started for real and spoken to with the `openai` SDK and raw HTTP."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from fakeupstream_reads import cuts_inside_characters, hang_up_on_stall, headers_only, raw_reads, stream_record
from servers import Upstream

from tools.fakeupstream import (
    FAILED_ERROR,
    FUNCTION_CALL_ARGUMENTS,
    FUNCTION_CALL_ID,
    FUNCTION_CALL_NAME,
    REASONING_SUMMARY,
    RESPONSES_OUTPUT_TOKENS,
    RESPONSES_REASONING_TOKENS,
    RESPONSES_TEXTS,
    TEXTS,
    echo_text,
)

INPUT = "Tell me something nice"  # 4 input "tokens" (words)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def server():
    upstream = Upstream()
    yield upstream.url
    upstream.stop()


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="sk-test", max_retries=0, timeout=10) as c:
        yield c


def parse_sse(raw: bytes) -> list[dict]:
    """Parse a complete Responses SSE body strictly: `event: T\\ndata: {"type": T, ...}\\n\\n` blocks."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-80:]
    out = []
    for block in text[:-2].split("\n\n"):
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[6:])
        assert data["type"] == event_line[7:]
        out.append(data)
    return out


def assert_consecutive(events, first: int = 0) -> None:
    numbers = [e["sequence_number"] if isinstance(e, dict) else e.sequence_number for e in events]
    assert numbers == list(range(first, first + len(numbers))), numbers


def post(server: str, body: dict, path: str = "/v1/responses", **kw) -> httpx.Response:
    return httpx.post(server + path, json=body, headers={"authorization": "Bearer sk-test"}, timeout=10, **kw)


def text_of(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


# --------------------------------------------------------------------- wire format


def test_stream_with_sdk_text_and_usage(client):
    events = list(client.responses.create(model="normal", input=INPUT, stream=True))
    assert_consecutive(events)
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.type for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert text_of(events) == RESPONSES_TEXTS["normal"] == TEXTS["normal"]
    done = events[-1].response
    assert (done.status, done.object, done.model, done.output_text) == (
        "completed",
        "response",
        "normal",
        TEXTS["normal"],
    )
    assert done.id.startswith("resp_") and {e.response.id for e in events[:2]} == {done.id}
    assert done.usage.model_dump() == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "cache_write_tokens_details": None},
        "output_tokens": 10,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 14,
    }
    assert RESPONSES_OUTPUT_TOKENS["normal"] == 10


def test_raw_wire_format(server):
    r = post(server, {"model": "normal", "input": INPUT, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert b"[DONE]" not in r.content
    assert r.content.startswith(b'event: response.created\ndata: {"type":"response.created","sequence_number":0,')
    assert "🙂🚀".encode() in r.content and "日本語のテキスト".encode() in r.content  # raw UTF-8, compact JSON
    evs = parse_sse(r.content)
    assert_consecutive(evs)
    created, item_added, part_added, first_delta = evs[0], evs[2], evs[3], evs[4]
    assert created["response"]["status"] == "in_progress" and created["response"]["output"] == []
    assert created["response"]["usage"] is None
    msg_id = item_added["item"]["id"]
    assert item_added == {
        "type": "response.output_item.added",
        "sequence_number": 2,
        "output_index": 0,
        "item": {"id": msg_id, "type": "message", "status": "in_progress", "content": [], "role": "assistant"},
    }
    assert msg_id.startswith("msg_")
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
    assert part_added == {"type": "response.content_part.added", "sequence_number": 3, **where, "part": part}
    obfuscation = first_delta.pop("obfuscation")
    assert isinstance(obfuscation, str) and obfuscation
    assert first_delta == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        **where,
        "delta": "Hello! This is the scripted **normal** reply.\n",
        "logprobs": [],
    }
    text = TEXTS["normal"]
    assert evs[-4] == {
        "type": "response.output_text.done",
        "sequence_number": 14,
        **where,
        "text": text,
        "logprobs": [],
    }
    assert evs[-3] == {
        "type": "response.content_part.done",
        "sequence_number": 15,
        **where,
        "part": {**part, "text": text},
    }
    done_item = {
        "id": msg_id,
        "type": "message",
        "status": "completed",
        "content": [{**part, "text": text}],
        "role": "assistant",
    }
    assert evs[-2] == {"type": "response.output_item.done", "sequence_number": 16, "output_index": 0, "item": done_item}
    final = evs[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [done_item]
    assert final["completed_at"] >= final["created_at"]
    assert "output_text" not in final  # an SDK convenience property, not on the wire

    r = post(
        server, {"model": "normal", "input": INPUT, "stream": True, "stream_options": {"include_obfuscation": False}}
    )
    assert b"obfuscation" not in r.content


def test_stream_helper_and_reasoning(client):
    with client.responses.stream(model="reasoning", input=INPUT) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert_consecutive(events)
    types = [e.type for e in events]
    assert types.index("response.reasoning_summary_text.delta") < types.index("response.output_text.delta")
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == REASONING_SUMMARY
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].summary[0].text == REASONING_SUMMARY
    assert final.output_text == RESPONSES_TEXTS["reasoning"]
    assert final.usage.output_tokens == RESPONSES_OUTPUT_TOKENS["reasoning"]
    assert final.usage.output_tokens_details.reasoning_tokens == RESPONSES_REASONING_TOKENS["reasoning"] == 5
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]


def test_non_streamed_create(client, server):
    done = client.responses.create(model="normal", input=INPUT, instructions="Be brief.", metadata={"k": "v"})
    assert (done.object, done.status, done.output_text) == ("response", "completed", TEXTS["normal"])
    assert (done.instructions, done.metadata) == ("Be brief.", {"k": "v"})
    assert done.usage.input_tokens == 6 and done.usage.total_tokens == 16  # instructions count as input
    raw = post(server, {"model": "normal", "input": INPUT})
    assert raw.headers["content-type"] == "application/json" and "output_text" not in raw.json()


def test_function_call_streaming(client):
    tools = [{"type": "function", "name": FUNCTION_CALL_NAME, "parameters": {}}]
    events = list(client.responses.create(model="function_call", input=INPUT, stream=True, tools=tools))
    assert_consecutive(events)
    added = next(e for e in events if e.type == "response.output_item.added").item
    assert (added.type, added.call_id, added.name, added.arguments, added.status) == (
        "function_call",
        FUNCTION_CALL_ID,
        FUNCTION_CALL_NAME,
        "",
        "in_progress",
    )
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) == 10 and {e.item_id for e in deltas} == {added.id}
    assert "".join(e.delta for e in deltas) == FUNCTION_CALL_ARGUMENTS
    args_done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args_done.arguments == FUNCTION_CALL_ARGUMENTS
    assert args_done.model_extra["name"] == FUNCTION_CALL_NAME  # in the API reference, not in the SDK type
    final = events[-1].response
    assert final.output[0].arguments == FUNCTION_CALL_ARGUMENTS and final.output[0].status == "completed"
    assert final.tools[0].name == FUNCTION_CALL_NAME  # request parameters are echoed


def test_echo_list_input_and_scenario_marker(client):
    said = [{"role": "user", "content": [{"type": "input_text", "text": "héllo 🙂 there"}]}]
    events = list(client.responses.create(model="gpt-4o", input=said, stream=True))
    assert text_of(events) == echo_text("héllo 🙂 there")
    assert events[-1].response.model == "gpt-4o"
    marked = [{"role": "developer", "content": "x"}, {"role": "user", "content": "go [scenario:incomplete]"}]
    done = client.responses.create(model="gpt-4o", input=marked)
    assert (done.status, done.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert done.output_text == RESPONSES_TEXTS["incomplete"] == TEXTS["length"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="gpt-4o", input="[scenario:nope]")
    assert (ei.value.code, ei.value.param) == ("unknown_scenario", "input")


def test_split_utf8_arrives_cut_inside_characters(server):
    reads = raw_reads(f"{server}/v1/responses", {"model": "split_utf8", "input": INPUT, "stream": True})
    whole = b"".join(reads)
    assert len(reads) >= 20
    assert cuts_inside_characters(reads), "no read ended inside a multi-byte character"
    assert any(piece.endswith(b"eve") for piece in reads)
    assert any(piece.endswith(b"\n") and not piece.endswith(b"\n\n") for piece in reads)  # between the lines
    evs = parse_sse(whole)
    assert_consecutive(evs)
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == TEXTS["split_utf8"]


# ------------------------------------------------------------------------ failures


def test_failed_after_some_output(client):
    events = list(client.responses.create(model="failed", input=INPUT, stream=True))
    assert_consecutive(events)
    assert text_of(events) == RESPONSES_TEXTS["failed"] == TEXTS["error_midstream"]
    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.response.status == "failed"
    assert failed.response.error.model_dump(exclude_none=True) == FAILED_ERROR
    assert failed.response.output[0].content[0].text == TEXTS["error_midstream"]
    assert failed.response.usage is None


def test_error_event_variants(client, server):
    events = list(client.responses.create(model="error_event", input=INPUT, stream=True))
    assert_consecutive(events)
    assert text_of(events) == RESPONSES_TEXTS["error_event"]
    last = events[-1]
    assert (last.type, last.code, last.param) == ("error", "server_error", None)
    assert last.message.startswith("The server had an error")

    # The nested shape carries an "error" key, which the SDK raises as an APIError.
    with pytest.raises(openai.APIError, match="The server had an error"):
        list(client.responses.create(model="error_event_nested", input=INPUT, stream=True))
    evs = parse_sse(post(server, {"model": "error_event_nested", "input": INPUT, "stream": True}).content)
    assert_consecutive(evs)
    assert evs[-1] == {
        "type": "error",
        "sequence_number": len(evs) - 1,
        "error": {
            "type": "server_error",
            "code": "server_error",
            "message": evs[-1]["error"]["message"],
            "param": None,
        },
    }


def test_rate_limited_raises_with_retry_after(client):
    with pytest.raises(openai.RateLimitError) as ei:
        client.responses.create(model="rate_limited", input=INPUT, stream=True)
    err = ei.value
    assert err.status_code == 429
    assert (err.response.headers["retry-after"], err.response.headers["retry-after-ms"]) == ("1", "1000")
    assert (err.type, err.code) == ("requests", "rate_limit_exceeded")


@pytest.mark.parametrize("name, status, retry_after", [("server_error", 500, None), ("overloaded", 503, "1")])
def test_server_errors_before_the_stream(server, name, status, retry_after):
    r = post(server, {"model": name, "input": INPUT, "stream": True})
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "server_error"
    assert r.headers.get("retry-after") == retry_after


def test_reset_is_recorded(client, server):
    stream = client.responses.create(model="reset", input=INPUT, stream=True)
    got = []
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for event in stream:
            got.append(event)
    assert text_of(got) == RESPONSES_TEXTS["reset"]
    assert stream_record(server, stream.response.headers["x-request-id"])["outcome"] == "reset"


def test_hanging_up_on_a_stall_is_recorded(server):
    body = {"model": "stall", "input": INPUT, "stream": True}
    # created, in_progress, item, part, 2 deltas; then silence
    seen, rec = hang_up_on_stall(server, "/v1/responses", body, b"event: ", 6)
    assert (rec["scenario"], rec["api"]) == ("stall", "responses")
    assert rec["response_id"] == parse_sse(seen.split(b"event: response.output_item")[0])[0]["response"]["id"]


def test_stall_first_sends_headers_only(server):
    body = {"model": "stall_first", "input": INPUT, "stream": True}
    request_id = headers_only(f"{server}/v1/responses", body)
    assert stream_record(server, request_id)["outcome"] == "client_disconnected"


# ---------------------------------------------------------------------- background


def test_background_stream_resumed_with_starting_after(client, server):
    first = client.responses.create(model="slow", input=INPUT, background=True, stream=True)
    seen = []
    for event in first:
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    first.close()  # hanging up leaves the background response running
    created = seen[0].response
    assert (created.status, created.background) == ("queued", True)
    assert [e.type for e in seen[:3]] == ["response.created", "response.queued", "response.in_progress"]
    last_seen = seen[-1].sequence_number

    polled = client.responses.retrieve(created.id)
    assert polled.status == "in_progress" and polled.output_text.startswith(seen[-1].delta)

    rest = list(client.responses.retrieve(created.id, stream=True, starting_after=last_seen))
    assert rest[0].sequence_number == last_seen + 1
    assert_consecutive(seen + rest)
    assert text_of(seen + rest) == TEXTS["slow"]
    assert rest[-1].type == "response.completed" and rest[-1].response.output_text == TEXTS["slow"]
    assert client.responses.retrieve(created.id).status == "completed"

    # The whole stream again, filtered by the SDK's stream helper.
    with client.responses.stream(response_id=created.id, starting_after=last_seen) as again:
        assert [e.sequence_number for e in again] == [e.sequence_number for e in rest]

    records = [r for r in httpx.get(f"{server}/_scripted/streams").json() if r.get("response_id") == created.id]
    assert [r["outcome"] for r in records] == ["client_disconnected", "completed", "completed"]


def test_background_poll_cancel_input_items_delete(client):
    said = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "input_text", "text": "second"}]},
    ]
    queued = client.responses.create(model="slow", input=said, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    time.sleep(0.5)
    running = client.responses.retrieve(queued.id)
    assert running.status == "in_progress" and 0 < len(running.output_text) < len(TEXTS["slow"])

    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.usage is None
    time.sleep(0.3)
    assert client.responses.retrieve(queued.id).output_text == cancelled.output_text  # generation stopped
    assert client.responses.cancel(queued.id).status == "cancelled"  # idempotent

    items = client.responses.input_items.list(queued.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [
        ("user", "second"),
        ("assistant", "ok"),
        ("user", "first"),
    ]  # newest first
    assert [i.content[0].type for i in items.data] == ["input_text", "output_text", "input_text"]
    page = client.responses.input_items.list(queued.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["first", "ok"] and page.has_more
    assert page.first_id == page.data[0].id and page.last_id == page.data[1].id

    client.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.retrieve(queued.id)
    assert ei.value.body == {
        "message": f"Response with id '{queued.id}' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_stored_foreground_response_and_unknown_ids(client, server):
    done = client.responses.create(model="normal", input=INPUT)
    assert client.responses.retrieve(done.id).output_text == TEXTS["normal"]
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled or re-streamed
        client.responses.cancel(done.id)
    with pytest.raises(openai.BadRequestError):
        list(client.responses.retrieve(done.id, stream=True))
    follow_up = client.responses.create(model="echo", input="more", previous_response_id=done.id)
    assert follow_up.previous_response_id == done.id

    not_stored = client.responses.create(model="normal", input=INPUT, store=False)
    for path in (f"/v1/responses/{not_stored.id}", "/v1/responses/resp_nope/input_items"):
        r = httpx.get(server + path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.delete(f"{server}/v1/responses/resp_nope").status_code == 404
    assert httpx.post(f"{server}/v1/responses/resp_nope/cancel").status_code == 404
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="normal", input=INPUT, previous_response_id="resp_nope")
    assert ei.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="normal", input=INPUT, background=True, store=False)
    assert ei.value.param == "store"


def test_unknown_parameter_is_a_400(server):
    r = post(server, {"model": "normal", "input": INPUT, "messages": []})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": "Unknown parameter: 'messages'.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "unknown_parameter",
        }
    }


# ------------------------------------------------------------ azure, records, switch


def test_azure_v1_path(server):
    httpx.delete(f"{server}/_scripted/requests")
    with openai.AzureOpenAI(
        base_url=f"{server}/openai/v1/", api_key="azure-key-1234", api_version="preview", max_retries=0, timeout=10
    ) as az:
        events = list(az.responses.create(model="normal", input=INPUT, stream=True))
        assert text_of(events) == TEXTS["normal"]
        assert az.responses.retrieve(events[-1].response.id).status == "completed"
    with openai.OpenAI(
        base_url=f"{server}/openai/v1",
        api_key="unused",
        default_headers={"api-key": "azure-key-5678"},
        max_retries=0,
        timeout=10,
    ) as c:
        assert c.responses.create(model="function_call", input=INPUT).output[0].arguments == FUNCTION_CALL_ARGUMENTS

    records = httpx.get(f"{server}/_scripted/requests").json()
    assert [(r["method"], r["path"], r["query"]) for r in records] == [
        ("POST", "/openai/v1/responses", {"api-version": "preview"}),
        ("GET", f"/openai/v1/responses/{events[-1].response.id}", {"api-version": "preview"}),
        ("POST", "/openai/v1/responses", {}),
    ]
    assert records[0]["headers"]["api-key"] == "azure-key-1234"
    assert records[0]["json"] == {"model": "normal", "input": INPUT, "stream": True}
    assert records[2]["headers"]["api-key"] == "azure-key-5678"
    streams = httpx.get(f"{server}/_scripted/streams").json()
    assert len(streams) == 1 and streams[0]["request_id"] == records[0]["id"]
    assert set(streams[0]) == {"request_id", "scenario", "started_at", "ended_at", "outcome", "api", "response_id"}
    assert (streams[0]["scenario"], streams[0]["outcome"]) == ("normal", "completed")


def test_no_responses_switch():
    upstream = Upstream("--no-responses")
    try:
        with openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="sk-test", max_retries=0, timeout=10) as c:
            with pytest.raises(openai.NotFoundError):
                c.responses.create(model="normal", input=INPUT, stream=True)
            chat = c.chat.completions.create(model="normal", messages=[{"role": "user", "content": INPUT}])
            assert chat.choices[0].message.content == TEXTS["normal"]  # chat completions still work
        assert post(upstream.url, {"model": "normal", "input": INPUT}, "/openai/v1/responses").status_code == 404
        assert [r["path"] for r in upstream.requests()] == [
            "/v1/responses",
            "/v1/chat/completions",
            "/openai/v1/responses",
        ]
    finally:
        upstream.stop()
