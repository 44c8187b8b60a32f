"""POST /api/v1/responses and its follow-ups with the official openai SDK as the client, through the
local host on the real runtime, against the scripted upstream (its Responses API)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from helpers import app_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import App, Upstream

from chatstream.guard import redact_whole
from tools.fakeupstream import FUNCTION_CALL_ARGUMENTS, FUNCTION_CALL_NAME, REASONING_SUMMARY, RESPONSES_TEXTS

pytestmark = pytest.mark.timeout(60)

WEATHER_TOOL = {
    "type": "function",
    "name": FUNCTION_CALL_NAME,
    "description": "Weather for a place",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
}
TERMS = ["scripted", "café", "日本語", "🙂🚀", "Paris", "slowly", "hundred"]
SYSTEM = "You are terse."


def sdk_for(app: App) -> openai.OpenAI:
    # The function key goes in a header (or ?code=); the local host does not check it, Azure does.
    return openai.OpenAI(
        base_url=app.url + "/api/v1",
        api_key="unused",
        max_retries=0,
        timeout=20,
        default_headers={"x-functions-key": "test-key"},
    )


@pytest.fixture(scope="module")
def sdk(app):
    client = sdk_for(app)
    yield client
    client.close()


@pytest.fixture(scope="module")
def guarded(upstream):
    """An app with the built-in pipeline steps on."""
    server = App(
        app_env(
            upstream,
            BLOCKED_TERMS=",".join(TERMS),
            SYSTEM_PROMPT=SYSTEM,
            MAX_PROMPT_CHARS="200",
            IDLE_TIMEOUT_SECONDS="1",
            ALLOWED_MODELS="gpt-test",
        )
    )
    client = sdk_for(server)
    yield client
    client.close()
    server.stop()


def ask(scenario: str, text: str = "hello") -> str:
    return f"[scenario:{scenario}] {text}"


def deltas(events, kind: str = "response.output_text.delta") -> str:
    return "".join(e.delta for e in events if e.type == kind)


def stream_record(upstream: Upstream, response_id: str, timeout: float = 5.0) -> dict:
    """The scripted upstream's record of the Responses stream of ``response_id``, once it has ended."""
    deadline = time.monotonic() + timeout
    while True:
        records = [s for s in upstream.streams() if s.get("api") == "responses" and s.get("response_id") == response_id]
        if records and records[-1]["ended_at"] is not None:
            return records[-1]
        assert time.monotonic() < deadline, f"no ended stream for {response_id}: {records}"
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("scenario", ["normal", "split_utf8"])
def test_streamed_text_is_exact_with_usage(sdk, scenario):
    events = list(sdk.responses.create(model="gpt-test", input=ask(scenario), stream=True))
    assert deltas(events) == RESPONSES_TEXTS[scenario]  # newlines, quotes, emoji, CJK, split UTF-8
    assert [e.sequence_number for e in events] == list(range(len(events))), "every event, in order"
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    assert final.output_text == RESPONSES_TEXTS[scenario]
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens > 0


def test_stream_helper_and_final_response(sdk):
    with sdk.responses.stream(model="gpt-test", input=ask("normal")) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == RESPONSES_TEXTS["normal"]
    assert final.status == "completed"


def test_non_streamed_create(sdk):
    response = sdk.responses.create(model="gpt-test", input=ask("normal"), instructions="Be kind.")
    assert response.object == "response" and response.status == "completed"
    assert response.output_text == RESPONSES_TEXTS["normal"]
    assert response.usage.output_tokens > 0


def test_function_call_with_streamed_arguments(sdk, upstream):
    with sdk.responses.stream(
        model="gpt-test", input=ask("function_call", "weather in Paris?"), tools=[WEATHER_TOOL]
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert deltas(events, "response.function_call_arguments.delta") == FUNCTION_CALL_ARGUMENTS
    call = final.output[0]
    assert (call.type, call.name, call.arguments) == ("function_call", FUNCTION_CALL_NAME, FUNCTION_CALL_ARGUMENTS)
    assert upstream.requests(last=1)[0]["json"]["tools"] == [WEATHER_TOOL]


def test_reasoning_events_are_forwarded(sdk):
    events = list(sdk.responses.create(model="gpt-test", input=ask("reasoning"), stream=True))
    assert deltas(events, "response.reasoning_summary_text.delta") == REASONING_SUMMARY
    assert deltas(events) == RESPONSES_TEXTS["reasoning"]


def test_fields_the_relay_does_not_read_reach_the_upstream_unchanged(sdk, upstream):
    extra = {
        "prompt_cache_key": "user-42",
        "safety_identifier": "h4sh",
        "metadata": {"k": "v"},
        "text": {"verbosity": "low"},
        "store": True,
        "truncation": "auto",
    }
    sdk.responses.create(model="gpt-test", input=ask("normal"), stream=True, extra_body=extra).close()
    sent = upstream.requests(last=1)[0]["json"]
    for name, value in extra.items():
        assert sent[name] == value


# ---------------------------------------------------------------------------------------- errors


def test_rate_limit_raises_rate_limit_error_with_retry_after(sdk):
    for stream in (True, False):
        with pytest.raises(openai.RateLimitError) as info:
            # A model of its own: the single upstream cools it down for the 429's Retry-After.
            sdk.responses.create(model=f"gpt-rate-limited-{stream}", input=ask("rate_limited"), stream=stream)
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "1"
        # The upstream's own type and code (OpenAI's 429s say "requests" or "tokens"), ours beside them.
        assert info.value.body["type"] == "requests" and info.value.body["code"] == "rate_limit_exceeded"
        assert info.value.body["chatstream_kind"] == "rate_limited"


def test_upstream_bad_request_raises_bad_request_error(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model="gpt-test", input=ask("bad_request"), stream=True)
    assert info.value.body["param"] == "input"


def test_what_the_relay_reads_is_checked_before_any_upstream_call(sdk, upstream):
    before = upstream.count()
    for body, param in [
        ({"input": 5}, "input"),
        ({"input": ["an item must be an object"]}, "input"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
        ({"input": "x", "background": 1}, "background"),
        ({"input": "x", "tools": {}}, "tools"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.post("/responses", body={"model": "gpt-test", **body}, cast_to=object)
        assert info.value.body["param"] == param, body
        assert info.value.body["type"] == "invalid_request_error"
    assert upstream.count() == before


# A value of the wrong type for each kind of field fields.py declares.
WRONG = {
    "a string": [{"id": "resp_1"}],
    "an integer": "5",
    "a number": "0.5",
    "a boolean": "true",
    "an object": ["x"],
    "an array of objects": ["x"],
    "an array of strings": "text",
    "one of a string or an object": 5,
    "one of a string or an array of strings": {"stop": "x"},
}


@pytest.mark.parametrize("path", ["/api/v1/chat/completions", "/api/v1/responses"])
def test_a_field_of_the_wrong_type_is_the_callers_400_naming_it_and_never_reaches_the_upstream(app, upstream, path):
    """Issue 42: ``previous_response_id`` as a list or an object reached the upstream, came back as a
    502 and counted against the entry. Every documented field the relay passes on is checked by type."""
    from chatstream.apis.fields import expected_types
    from chatstream.apis.openai_chat import OpenAIChatRequest
    from chatstream.apis.responses import ResponsesRequest

    model = OpenAIChatRequest if path.endswith("completions") else ResponsesRequest
    base = {"model": "gpt-test", "stream": True}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if model is OpenAIChatRequest else {"input": "hi"}
    cases = [(field, WRONG[expected]) for field, expected in expected_types(model).items()]
    if model is ResponsesRequest:
        cases += [("previous_response_id", {"id": "resp_1"}), ("previous_response_id", ["resp_1", "resp_2"])]
    assert len(cases) > 20
    before = upstream.count()
    with httpx.Client(timeout=15) as client:
        for field, value in cases:
            r = client.post(app.url + path, json={**base, field: value})
            assert r.status_code == 400, (field, value, r.text)
            error = r.json()["error"]
            assert error["param"] == field and error["type"] == "invalid_request_error", error
            assert error["message"].startswith(f"Invalid type for '{field}': expected "), error
        assert upstream.count() == before, "nothing reached the upstream"
        fine = client.post(app.url + path, json={**base, "stream": False, "temperature": 1, "user": "u-1"})
        assert fine.status_code == 200, "an integer is a number; the right types pass"


def test_mid_stream_error_event_ends_the_stream_with_an_error_event(sdk):
    events = list(sdk.responses.create(model="gpt-test", input=ask("error_event"), stream=True))
    assert deltas(events) == RESPONSES_TEXTS["error_event"], "the text before the failure arrived"
    assert events[-1].type == "error" and events[-1].code == "server_error", "the upstream's own code"
    assert (events[-1].model_extra or {})["chatstream_kind"] == "upstream_error"
    assert events[-1].sequence_number == events[-2].sequence_number + 1


def test_upstream_without_responses_api_is_501(start_app):
    bare = Upstream("--no-responses")
    try:
        server = start_app(OPENAI_BASE_URL=bare.base_url)
        with sdk_for(server) as client:
            for stream in (True, False):
                with pytest.raises(openai.APIStatusError) as info:
                    client.responses.create(model="gpt-test", input="hi", stream=stream)
                assert info.value.status_code == 501
                assert "no Responses API" in info.value.body["message"]
                assert info.value.body["code"] == "responses_not_supported"
            chat = client.chat.completions.create(model="normal", messages=[{"role": "user", "content": "hi"}])
            assert chat.choices[0].message.content, "chat completions still work there"
    finally:
        bare.stop()


# ---------------------------------------------------------------------------------------- hang-ups


def test_hang_up_closes_a_foreground_upstream_within_a_second(sdk, upstream):
    stream = sdk.responses.create(model="gpt-test", input=ask("stall"), stream=True)
    response_id = None
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            break
    hung_up = time.time()
    stream.close()
    record = stream_record(upstream, response_id)
    assert record["outcome"] == "client_disconnected"
    assert record["ended_at"] - hung_up < 1.0


def test_hang_up_does_not_cancel_a_background_response_and_it_resumes(sdk, upstream):
    stream = sdk.responses.create(model="gpt-test", input=ask("slow"), stream=True, background=True)
    seen = []
    for event in stream:
        seen.append(event)
        if len([e for e in seen if e.type == "response.output_text.delta"]) == 3:
            break
    stream.close()
    response_id = seen[0].response.id
    assert seen[0].response.background is True
    assert stream_record(upstream, response_id)["outcome"] == "client_disconnected"

    # The caller comes back and resumes after the last event it saw.
    last = seen[-1].sequence_number
    rest = list(sdk.responses.retrieve(response_id, stream=True, starting_after=last))
    assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    assert deltas(seen) + deltas(rest) == RESPONSES_TEXTS["slow"]
    assert rest[-1].type == "response.completed"
    assert sdk.responses.retrieve(response_id).status == "completed"
    assert not [r for r in upstream.requests(last=20) if r["path"].endswith("/cancel")], "no cancel was sent"


def test_a_background_response_completes_after_the_caller_hangs_up(sdk):
    stream = sdk.responses.create(model="gpt-test", input=ask("slow"), stream=True, background=True)
    first = next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 6
    while (response := sdk.responses.retrieve(first.response.id)).status != "completed":
        assert time.monotonic() < deadline, response.status
        time.sleep(0.2)
    assert response.output_text == RESPONSES_TEXTS["slow"]


# ---------------------------------------------------------------------------------------- follow-ups


def test_retrieve_input_items_and_delete(sdk):
    created = sdk.responses.create(model="gpt-test", input=ask("normal", "first question"))
    again = sdk.responses.retrieve(created.id)
    assert again.id == created.id and again.output_text == RESPONSES_TEXTS["normal"]
    items = sdk.responses.input_items.list(created.id, limit=5)
    assert items.data[0].content[0].text == ask("normal", "first question")
    sdk.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as info:
        sdk.responses.retrieve(created.id)
    assert created.id in info.value.body["message"]


@pytest.mark.parametrize("client", ["sdk", "guarded"])
def test_resuming_an_unknown_response_is_not_found(request, client):
    """Both re-stream paths: bytes passed on (no text steps) and through ResponseStream (text steps)."""
    with pytest.raises(openai.NotFoundError):
        request.getfixturevalue(client).responses.retrieve("resp_unknown", stream=True, starting_after=3)


def test_cancel_a_background_response(sdk):
    queued = sdk.responses.create(model="gpt-test", input=ask("slow"), background=True)
    assert queued.status == "queued"
    cancelled = sdk.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"


@pytest.mark.parametrize(
    "response_id,status",
    [
        ("not-a-response", 400),
        ("resp_a%20b", 400),
        ("resp_a.b", 400),
        ("resp_%2E%2E", 400),
        ("resp_..%2Fx", 404),  # the host decodes %2F before routing: no route matches (OpenAI's 404)
    ],
)
def test_response_ids_are_checked_before_they_reach_a_url(app, upstream, response_id, status):
    before = upstream.count()
    r = httpx.get(f"{app.url}/api/v1/responses/{response_id}", timeout=10)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "response_id"
    assert upstream.count() == before


def test_the_functions_key_is_not_forwarded(app, upstream):
    created = httpx.post(
        f"{app.url}/api/v1/responses",
        params={"code": "test-key"},
        json={"model": "gpt-test", "input": ask("normal")},
        timeout=10,
    ).json()
    r = httpx.get(
        f"{app.url}/api/v1/responses/{created['id']}/input_items", params={"code": "test-key", "limit": "1"}, timeout=10
    )
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    assert upstream.requests(last=1)[0]["query"] == {"limit": "1"}


# ---------------------------------------------------------------------------------------- pipeline


def test_blocked_terms_deltas_and_final_response_say_the_same(guarded):
    want = redact_whole(RESPONSES_TEXTS["normal"], TERMS)
    assert want != RESPONSES_TEXTS["normal"]
    with guarded.responses.stream(model="gpt-test", input=ask("normal")) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert deltas(events) == want
    assert [e for e in events if e.type == "response.output_text.done"][0].text == want
    assert final.output_text == want
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert guarded.responses.create(model="gpt-test", input=ask("normal")).output_text == want
    with guarded.responses.stream(model="gpt-test", input=ask("function_call"), tools=[WEATHER_TOOL]) as stream:
        args = deltas(list(stream), "response.function_call_arguments.delta")
        call = stream.get_final_response().output[0]
    assert args == call.arguments == redact_whole(FUNCTION_CALL_ARGUMENTS, TERMS)


def test_blocked_terms_hold_for_retrieve_and_a_resumed_stream(guarded):
    want = redact_whole(RESPONSES_TEXTS["slow"], TERMS)
    assert want != RESPONSES_TEXTS["slow"]
    stream = guarded.responses.create(model="gpt-test", input=ask("slow"), stream=True, background=True)
    seen = []
    for event in stream:
        seen.append(event)
        if len([e for e in seen if e.type == "response.output_text.delta"]) == 4:
            break
    stream.close()
    rest = list(guarded.responses.retrieve(seen[0].response.id, stream=True, starting_after=seen[-1].sequence_number))
    assert deltas(seen) + deltas(rest) == want
    assert rest[-1].type == "response.completed" and rest[-1].response.output_text == want
    assert [e.sequence_number for e in rest][0] == seen[-1].sequence_number + 1
    assert guarded.responses.retrieve(seen[0].response.id).output_text == want


def test_a_time_limit_after_output_ends_with_an_error_event_numbered_next(guarded, upstream):
    started = time.monotonic()
    events = list(guarded.responses.create(model="gpt-test", input=ask("stall"), stream=True))
    assert time.monotonic() - started < 5
    assert any(e.type == "response.output_text.delta" for e in events)
    assert events[-1].type == "error" and events[-1].code == "upstream_timeout"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert stream_record(upstream, events[0].response.id)["outcome"] == "client_disconnected", (
        "the stalled upstream was closed"
    )


def test_system_prompt_prompt_limit_and_allowed_models(guarded, upstream):
    guarded.responses.create(model="gpt-test", input=ask("normal"), instructions="Answer in French.")
    assert upstream.requests(last=1)[0]["json"]["instructions"] == f"{SYSTEM}\n\nAnswer in French."
    before = upstream.count()
    with pytest.raises(openai.APIStatusError) as info:
        guarded.responses.create(
            model="gpt-test", input=[{"role": "user", "content": "x" * 150}], instructions="y" * 60, stream=True
        )
    assert info.value.status_code == 413 and info.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as info:
        guarded.responses.create(model="gpt-other", input="hi", stream=True)
    assert info.value.body["code"] == "model_not_allowed"
    assert upstream.count() == before


# ---------------------------------------------------------------------------------------- Azure


@pytest.mark.parametrize("version", ["", "2024-10-21"])
def test_azure_goes_through_the_v1_responses_path(start_app, upstream, version):
    """On Azure's v1 API (the default) and on a dated one alike: the dated API has no Responses."""
    server = start_app(
        AZURE_OPENAI_ENDPOINT=upstream.url,
        AZURE_OPENAI_DEPLOYMENT="gpt-test",
        AZURE_OPENAI_API_KEY="azure-test-key",
        AZURE_OPENAI_API_VERSION=version,
    )
    with sdk_for(server) as client:
        events = list(client.responses.create(input=ask("normal"), stream=True))
        assert deltas(events) == RESPONSES_TEXTS["normal"]
        sent = upstream.requests(last=1)[0]
        assert sent["path"] == "/openai/v1/responses"
        assert "api-version" not in sent["query"], "Azure's v1 API takes no api-version"
        if version:  # the SDK's Azure client
            assert sent["headers"]["api-key"] == "azure-test-key"
        else:
            assert sent["headers"]["authorization"] == "Bearer azure-test-key"
        assert sent["json"]["model"] == "gpt-test", "the deployment name is the model"
        response_id = events[-1].response.id
        assert client.responses.retrieve(response_id).output_text == RESPONSES_TEXTS["normal"]
        assert upstream.requests(last=1)[0]["path"] == f"/openai/v1/responses/{response_id}"


def test_upstream_failed_and_incomplete_responses_are_forwarded_as_they_came(sdk):
    failed = list(sdk.responses.create(model="gpt-test", input=ask("failed"), stream=True))
    assert deltas(failed) == RESPONSES_TEXTS["failed"]
    assert failed[-1].type == "response.failed" and failed[-1].response.error.code == "server_error"
    incomplete = list(sdk.responses.create(model="gpt-test", input=ask("incomplete"), stream=True))
    assert incomplete[-1].type == "response.incomplete"
    assert incomplete[-1].response.incomplete_details.reason == "max_output_tokens"
    assert deltas(incomplete) == RESPONSES_TEXTS["incomplete"]


# ---------------------------------------------------------------------------------------- hostile input

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_json = st.recursive(
    _scalars,
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)),
    max_leaves=8,
)
_items = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "x"]), "content": st.one_of(st.text(max_size=10), _json)}
    ),
    max_size=2,
)
_fields = {
    "input": st.one_of(st.just(ask("normal")), _items, _json),
    "model": st.one_of(st.just("gpt-test"), _json),
    "instructions": _json,
    "stream": st.one_of(st.just(True), _json),
    "background": _json,
    "tools": _json,
    "store": _json,
    "previous_response_id": _json,
    "temperature": _json,
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.fixed_dictionaries({}, optional=_fields), _json))
def test_odd_bodies_are_never_a_5xx_and_every_stream_ends_with_a_last_event(app, body):
    with httpx.stream("POST", f"{app.url}/api/v1/responses", json=body, timeout=15) as r:
        raw = r.read()
    assert r.status_code < 500, (r.status_code, raw[:300])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        last = [line for line in raw.decode().split("\n") if line.startswith("event: ")][-1]
        assert last in (
            "event: response.completed",
            "event: response.incomplete",
            "event: response.failed",
            "event: error",
        ), raw[-300:]
    else:
        assert isinstance(r.json(), dict)
