"""POST /api/v1/chat/completions with the official openai SDK as the client, through the local host
on the real runtime, against the scripted upstream."""

from __future__ import annotations

import httpx
import openai
import pytest

from tools.fakeupstream.scenarios import AFTER_FINISH_EXTRA, TEXTS, TOOL_CALL_ARGUMENTS, TOOL_CALL_NAME, choice_text

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_CALL_NAME,
        "description": "Weather for a place",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["location"],
        },
    },
}


@pytest.fixture(scope="module")
def sdk(app):
    # The function key goes in a header (or ?code=); the local host does not check it, Azure does.
    client = openai.OpenAI(
        base_url=app.url + "/api/v1", api_key="unused", max_retries=0, default_headers={"x-functions-key": "test-key"}
    )
    yield client
    client.close()


def user(scenario: str, text: str = "hello") -> list[dict]:
    return [{"role": "user", "content": f"[scenario:{scenario}] {text}"}]


def test_streamed_text_and_usage(sdk):
    stream = sdk.chat.completions.create(
        model="gpt-test", messages=user("normal"), stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXTS["normal"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_no_usage_chunk_unless_asked(sdk, upstream):
    chunks = list(sdk.chat.completions.create(model="gpt-test", messages=user("normal"), stream=True))
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    assert upstream.requests(last=1)[-1]["json"]["stream_options"] == {"include_usage": True}, (
        "usage is still asked of the upstream, for the log line"
    )


def test_nothing_after_finish_and_no_filter_frames(sdk):
    chunks = list(sdk.chat.completions.create(model="gpt-test", messages=user("after_finish"), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == TEXTS["after_finish"] and AFTER_FINISH_EXTRA not in text
    azure = list(sdk.chat.completions.create(model="gpt-test", messages=user("azure_filters"), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in azure) == TEXTS["azure_filters"]


def test_non_streamed_completion(sdk):
    completion = sdk.chat.completions.create(model="gpt-test", messages=user("normal"))
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content == TEXTS["normal"]
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.total_tokens > 0


def test_streamed_tool_call_deltas_are_reassembled_by_the_sdk(sdk, upstream):
    with sdk.chat.completions.stream(
        model="gpt-test", messages=user("tool_calls", "weather in Paris?"), tools=[WEATHER_TOOL], tool_choice="auto"
    ) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == TOOL_CALL_NAME
    assert call.function.arguments == TOOL_CALL_ARGUMENTS
    assert final.choices[0].finish_reason == "tool_calls"
    sent = upstream.requests(last=1)[-1]["json"]
    assert sent["tools"] == [WEATHER_TOOL] and sent["tool_choice"] == "auto"


def test_two_choices_are_kept_apart(sdk):
    stream = sdk.chat.completions.create(model="gpt-test", messages=user("normal"), n=2, stream=True)
    texts: dict[int, str] = {}
    finishes = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: choice_text(TEXTS["normal"], 0), 1: choice_text(TEXTS["normal"], 1)}
    assert finishes == {0: "stop", 1: "stop"}


def test_rate_limit_raises_rate_limit_error(sdk):
    with pytest.raises(openai.RateLimitError) as info:
        # A model of its own: the app's single upstream cools that model down for the 429's Retry-After.
        sdk.chat.completions.create(model="gpt-rate-limited", messages=user("rate_limited"), stream=True)
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "rate_limit_exceeded", "the upstream's own code"
    assert info.value.body["type"] == "requests" and info.value.body["chatstream_kind"] == "rate_limited"


@pytest.mark.parametrize(
    "scenario, param",
    [("context_length_exceeded", "messages"), ("content_policy_violation", None)],
)
def test_the_upstreams_error_code_type_and_param_reach_the_caller_on_every_route(sdk, app, scenario, param):
    """Issue 42: an upstream 400 keeps OpenAI's code on chat completions, /api/chat and the Responses
    API; the app's own classification is chatstream_kind (on /api/chat: its type, as always)."""
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="gpt-test", messages=user(scenario), stream=True)
    assert info.value.code == scenario and info.value.type == "invalid_request_error"
    assert info.value.param == param and info.value.body["chatstream_kind"] == "invalid_request"

    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="gpt-test", messages=user(scenario))  # not streamed
    assert info.value.code == scenario

    r = httpx.post(app.chat_url, json={"prompt": f"[scenario:{scenario}] hi"}, timeout=20)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request" and error["code"] == scenario
    assert error["upstream_type"] == "invalid_request_error" and error.get("param") == param

    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model="gpt-test", input=f"[scenario:{scenario}] hi", stream=True)
    assert info.value.code == scenario and info.value.type == "invalid_request_error"
    assert info.value.param == (param and "input") and info.value.body["chatstream_kind"] == "invalid_request"


def test_malformed_request_raises_bad_request_error(sdk, upstream):
    """What the relay reads itself (n, messages) is checked before any upstream call."""
    before = upstream.count()
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="gpt-test", messages=user("normal"), stream=True, n=0)
    assert info.value.body["param"] == "n"
    assert info.value.body["type"] == "invalid_request_error"
    assert upstream.count() == before


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": 5}, "temperature"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ],
)
def test_fields_the_relay_does_not_read_are_the_upstreams_to_refuse(sdk, upstream, kwargs, param):
    before = upstream.count()
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="gpt-test", messages=user("normal"), stream=True, **kwargs)
    assert info.value.body["param"] == param
    assert param in info.value.body["message"]  # the upstream's own message
    assert upstream.count() == before + 1, "sent once, not retried by the SDK or the app"


NEWER_PARAMS = {
    "prompt_cache_key": "user-42",
    "prompt_cache_retention": "24h",
    "safety_identifier": "h4sh",
    "verbosity": "low",
    "web_search_options": {},
    "audio": {"voice": "alloy", "format": "wav"},
    "moderation": {"mode": "x"},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "tool_choice": None,
}


@pytest.mark.parametrize("stream", [True, False])
def test_newer_openai_parameters_reach_the_upstream_unchanged(sdk, upstream, stream):
    """Forward-compatible: fields the relay does not act on go to the upstream as they came (nulls
    included), so new SDK options (prompt_cache_key=, verbosity=...) work without an app release."""
    result = sdk.chat.completions.create(
        model="gpt-test", messages=user("normal"), stream=stream, extra_body=NEWER_PARAMS
    )
    text = (
        "".join(c.choices[0].delta.content or "" for c in result if c.choices)
        if stream
        else result.choices[0].message.content
    )
    assert text == TEXTS["normal"]
    sent = upstream.requests(last=1)[0]["json"]
    for name, value in NEWER_PARAMS.items():
        assert sent[name] == value


def test_unknown_model_raises_not_found(sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="model_not_found", messages=user("normal"), stream=True)


def test_mid_stream_failure_raises_api_error_in_the_sdk(sdk):
    stream = sdk.chat.completions.create(model="gpt-test", messages=user("error_midstream"), stream=True)
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            received.append(chunk)
    assert received, "the text before the failure arrived"
    assert "upstream" in str(info.value.body)


def test_models_list(sdk):
    assert [m.id for m in sdk.models.list()] == ["gpt-test"]


def test_function_key_in_query_is_accepted(app):
    r = httpx.post(
        app.url + "/api/v1/chat/completions",
        params={"code": "test-key"},
        json={"model": "gpt-test", "messages": user("normal")},
        timeout=10,
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == TEXTS["normal"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": ["user"], "content": "x"}],
        [{"role": {"a": 1}, "content": "x"}],
        [{"role": "user", "content": 5}],
        ["not an object"],
    ],
)
def test_odd_messages_are_400_not_500(app, upstream, messages):
    before = upstream.count()
    r = httpx.post(app.url + "/api/v1/chat/completions", json={"model": "gpt-test", "messages": messages}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert upstream.count() == before
