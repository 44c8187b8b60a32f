"""chatstream/api_openai.py: the OpenAI chat-completions contract (only ``model``, ``messages``,
``stream``, ``stream_options`` and ``n`` are checked; everything else passes unchanged), its error
shapes and statuses, and the bytes its encoder writes."""

from __future__ import annotations

import copy
import json

import pytest

from chatstream.apis.completions import CompletionStream, filter_completion
from chatstream.apis.openai_chat import (
    OPENAI_DONE,
    ROLES,
    ChunkEncoder,
    OpenAIChatApi,
    encode,
    error_body,
    error_response,
    model_object,
    models_list,
    status_for,
    validate,
)
from chatstream.errors import ApiError, StepFailed, TimeLimit, invalid_request
from chatstream.pipeline import Pipeline
from chatstream.settings import Settings
from chatstream.stream import Chunk, Done, Failed

USER = {"role": "user", "content": "hi"}
SETTINGS = Settings.from_env({"OPENAI_API_KEY": "k", "OPENAI_MODEL": "gpt-default"})


def refused(body) -> ApiError:
    with pytest.raises(ApiError) as info:
        validate(body)
    assert (info.value.status, info.value.type) == (400, "invalid_request")
    return info.value


# ------------------------------------------------------------------------------------ contract


@pytest.mark.parametrize("role", sorted(ROLES))
@pytest.mark.parametrize("content", ["hi", "", None, [], [{"type": "text", "text": "hi"}], [{"anything": 1}]])
def test_valid_roles_and_contents(role, content):
    validate({"messages": [{"role": role, "content": content}]})


def test_a_message_without_content_passes():
    validate({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]})


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({}, "messages", "messages: Field required"),
        ({"messages": []}, "messages", "messages: List should have at least 1 item after validation, not 0"),
        (
            {"messages": [USER] * 1001},
            "messages",
            "messages: List should have at most 1000 items after validation, not 1001",
        ),
        ({"messages": "hi"}, "messages", "messages: Input should be a valid list"),
        ({"messages": [1]}, "messages", "messages: Input should be a valid dictionary"),
        (
            {"messages": [USER, {"content": "x"}]},
            "messages",
            "messages: messages[1].role must be one of assistant, developer, function, system, tool, user",
        ),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            "messages",
            "messages: messages[0].role must be one of assistant, developer, function, system, tool, user",
        ),
        (
            {"messages": [{"role": ["user"], "content": "x"}]},
            "messages",
            "messages: messages[0].role must be one of assistant, developer, function, system, tool, user",
        ),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages",
            "messages: messages[0].content must be a string, an array of parts, or null",
        ),
        (
            {"messages": [{"role": "user", "content": {"text": "x"}}]},
            "messages",
            "messages: messages[0].content must be a string, an array of parts, or null",
        ),
        (
            {"messages": [{"role": "user", "content": ["x"]}]},
            "messages",
            "messages: messages[0].content: each part must be an object",
        ),
        ({"messages": [USER], "model": ""}, "model", "model: String should have at least 1 character"),
        ({"messages": [USER], "model": "m" * 257}, "model", "model: String should have at most 256 characters"),
        ({"messages": [USER], "model": 5}, "model", "model: Input should be a valid string"),
        ({"messages": [USER], "stream": "true"}, "stream", "stream: Input should be a valid boolean"),
        ({"messages": [USER], "stream": 1}, "stream", "stream: Input should be a valid boolean"),
        (
            {"messages": [USER], "stream_options": 5},
            "stream_options",
            "stream_options: Input should be a valid dictionary or instance of StreamOptions",
        ),
        (
            {"messages": [USER], "stream_options": {"include_usage": "yes"}},
            "stream_options",
            "stream_options: Input should be a valid boolean",
        ),
        ({"messages": [USER], "n": 0}, "n", "n: Input should be greater than or equal to 1"),
        ({"messages": [USER], "n": 9}, "n", "n: Input should be less than or equal to 8"),
        ({"messages": [USER], "n": 2.0}, "n", "n: Input should be a valid integer"),
        ({"messages": [USER], "n": True}, "n", "n: Input should be a valid integer"),
    ],
)
def test_the_checked_fields(body, param, message):
    error = refused(body)
    assert (error.param, error.message) == (param, message)


@pytest.mark.parametrize("body", [[], "x", None, [USER]])
def test_the_body_must_be_an_object(body):
    assert refused(body).message == "the body must be a JSON object"


UNCHECKED = {  # values of the right type (only that is checked: fields.py), nulls, a field to come
    "temperature": 7,
    "top_p": -5,
    "max_tokens": 0,
    "seed": -1,
    "stop": [""],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": None,
    "response_format": None,
    "user": None,
    "metadata": {"k": None},
    "some_future_field": {"nested": [1, None, "x"]},
    "logit_bias": {"123": -100},
}


def test_unknown_and_unchecked_fields_pass_unchanged_including_nulls():
    body = {"messages": [USER], "model": "m", **UNCHECKED}
    before = copy.deepcopy(body)
    call = OpenAIChatApi().parse(body, SETTINGS.default_model)
    assert call.params == before
    assert body == before, "the caller's body is not changed"
    assert call.params is not body


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "hot"),
        ("max_tokens", "lots"),
        ("seed", 1.5),
        ("stop", {"weird": True}),
        ("user", ["u"]),
        ("tools", ["not an object"]),
    ],
)
def test_a_documented_field_of_the_wrong_type_is_a_400_naming_it(field, value):
    with pytest.raises(ApiError) as info:
        OpenAIChatApi().parse({"messages": [USER], field: value}, SETTINGS.default_model)
    assert info.value.status == 400 and info.value.param == field
    assert info.value.message.startswith(f"Invalid type for '{field}': expected ")


def test_nulls_for_the_checked_fields_mean_unset():
    call = OpenAIChatApi().parse(
        {"messages": [USER], "model": None, "stream": None, "stream_options": None, "n": None}, SETTINGS.default_model
    )
    assert call.params["model"] == "gpt-default"
    assert call.params["stream"] is None and call.params["stream_options"] is None and call.params["n"] is None
    assert call.include_usage is False


def test_the_default_model_fills_in_a_missing_one():
    assert OpenAIChatApi().parse({"messages": [USER]}, SETTINGS.default_model).params["model"] == "gpt-default"
    assert (
        OpenAIChatApi().parse({"messages": [USER], "model": "mine"}, SETTINGS.default_model).params["model"] == "mine"
    )


@pytest.mark.parametrize(
    "options, include_usage",
    [
        (None, False),
        ({}, False),
        ({"include_usage": False}, False),
        ({"include_usage": None}, False),
        ({"include_usage": True}, True),
    ],
)
def test_streamed_calls_always_ask_for_usage_but_pass_it_on_only_if_asked(options, include_usage):
    body = {"messages": [USER], "stream": True}
    if options is not None:
        body["stream_options"] = options
    call = OpenAIChatApi().parse(body, SETTINGS.default_model)
    assert call.params["stream_options"] == {**(options or {}), "include_usage": True}
    assert call.include_usage is include_usage
    assert call.endpoint == "openai"


def test_other_stream_options_are_kept_and_the_callers_dict_is_not_changed():
    options = {"include_usage": False, "future_option": 1}
    call = OpenAIChatApi().parse(
        {"messages": [USER], "stream": True, "stream_options": options}, SETTINGS.default_model
    )
    assert call.params["stream_options"] == {"include_usage": True, "future_option": 1}
    assert options == {"include_usage": False, "future_option": 1}


def test_a_non_streamed_call_is_left_alone():
    call = OpenAIChatApi().parse(
        {"messages": [USER], "stream": False, "stream_options": {"include_usage": True}}, SETTINGS.default_model
    )
    assert call.params["stream_options"] == {"include_usage": True} and call.include_usage is False


@pytest.mark.parametrize("n, choices", [(None, 1), (1, 1), (3, 3)])
async def test_the_adapter_waits_for_n_choices(n, choices):
    api = OpenAIChatApi()
    assert (api.name, api.path, api.completes) == ("openai", "/chat/completions", True)
    assert api.completion is filter_completion
    call = api.parse({"messages": [USER], "stream": True, **({} if n is None else {"n": n})}, SETTINGS.default_model)
    protocol = api.protocol(call, Pipeline(), False)
    assert isinstance(protocol, CompletionStream)
    for index in range(choices):
        assert not protocol.done
        await protocol.feed({"choices": [{"index": index, "delta": {}, "finish_reason": "stop"}]})
    assert protocol.done


# -------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "error, status, kind",
    [
        (invalid_request("bad", "messages"), 400, "invalid_request_error"),
        (ApiError(413, "request_too_large", "big"), 413, "invalid_request_error"),
        (ApiError(415, "unsupported_media_type", "json"), 415, "invalid_request_error"),
        (ApiError(422, "rejected", "policy"), 422, "invalid_request_error"),
        (ApiError(400, "model_not_found", "no model", "model"), 404, "invalid_request_error"),
        (ApiError(400, "content_filter", "stopped"), 400, "invalid_request_error"),
        (ApiError(401, "x", "m"), 401, "authentication_error"),
        (ApiError(403, "x", "m"), 403, "permission_error"),
        (ApiError(429, "rate_limited", "slow", retryable=True), 429, "rate_limit_error"),
        (StepFailed("s"), 500, "server_error"),
        (ApiError(502, "upstream_error", "m"), 502, "server_error"),
        (ApiError(503, "upstream_unavailable", "m"), 503, "server_error"),
        (TimeLimit("upstream_timeout", "m"), 504, "server_error"),
    ],
)
def test_error_shape_and_status(error, status, kind):
    assert status_for(error) == status
    assert error_body(error) == {
        "error": {
            "message": error.message,
            "type": kind,
            "param": error.param,
            "code": error.type,
            "chatstream_kind": error.type,
        }
    }


def test_error_response_carries_status_and_headers():
    response = error_response(ApiError(429, "rate_limited", "slow", retryable=True, headers={"Retry-After": "9"}))
    assert response.status_code == 429 and response.headers["retry-after"] == "9"
    assert json.loads(response.body) == {
        "error": {
            "message": "slow",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limited",
            "chatstream_kind": "rate_limited",
        }
    }
    assert error_response(ApiError(400, "model_not_found", "gone", "model")).status_code == 404
    assert OpenAIChatApi().error_response is error_response


# ------------------------------------------------------------------------------------ encoding

CHUNK = {
    "id": "c1",
    "object": "chat.completion.chunk",
    "created": 5,
    "model": "m",
    "choices": [{"index": 0, "delta": {"content": "hé"}, "finish_reason": None}],
    "future": {"x": None},
}
DONE = Done("stop", {0: "stop"}, {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, "m-2024", "c1", 5)


def test_a_chunk_is_written_as_it_came():
    for include_usage in (False, True):
        data = encode(Chunk(CHUNK), include_usage)
        assert data.startswith(b"data: ") and data.endswith(b"\n\n") and data.count(b"\n") == 2
        assert json.loads(data[6:]) == CHUNK
        assert "hé".encode() in data


def test_done_without_usage_is_just_done():
    assert encode(DONE, False) == OPENAI_DONE == b"data: [DONE]\n\n"


def test_done_with_usage_sends_the_usage_chunk_first():
    data = encode(DONE, True)
    assert data.endswith(b"\n\ndata: [DONE]\n\n")
    usage_event = data[: -len(OPENAI_DONE)]
    assert usage_event == (
        b'data: {"id":"c1","object":"chat.completion.chunk","created":5,"model":"m-2024",'
        b'"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}\n\n'
    )


def test_failed_is_an_error_event_without_done():
    data = encode(Failed(TimeLimit("upstream_timeout", "slow")), True)
    assert data == (
        b'data: {"error":{"message":"slow","type":"server_error","param":null,"code":"upstream_timeout",'
        b'"chatstream_kind":"upstream_timeout"}}\n\n'
    )
    assert b"[DONE]" not in data


def test_the_adapters_encoder_follows_the_call():
    api = OpenAIChatApi()
    asked = api.parse(
        {"messages": [USER], "stream": True, "stream_options": {"include_usage": True}}, SETTINGS.default_model
    )
    not_asked = api.parse({"messages": [USER], "stream": True}, SETTINGS.default_model)
    assert api.encoder(asked)(DONE) == encode(DONE, True)
    assert api.encoder(not_asked)(DONE) == OPENAI_DONE


def _fed(data: dict) -> Chunk:
    """``data`` as the stream core hands it to the encoder (through the protocol, without text steps)."""
    plain = CompletionStream(None).plain
    assert plain is not None
    fed = plain(data)
    assert fed is not None and fed.data is data
    return fed


def _usual(content: str, **changes) -> dict:
    choice = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": [choice]}
    for key, value in changes.items():
        where = choice if key in ("index", "logprobs", "finish_reason", "delta", "content_filter_results") else chunk
        if value is _DROP:
            del where[key]
        else:
            where[key] = value
    return chunk


_DROP = object()
CHANGED = [  # each differs from the usual chunk elsewhere than its content: never written through the template
    {"id": "c2"},  # a continuation's chunk named otherwise
    {"model": "m-2024"},
    {"created": 6},
    {"created": 5.0},  # == 5, its JSON is not
    {"object": None},
    {"obfuscation": "xyz"},  # a key more
    {"id": _DROP},  # a key less
    {"system_fingerprint": "fp"},
    {"logprobs": {"content": []}},
    {"finish_reason": "stop"},
    {"delta": {"role": "assistant", "content": "x"}},
    {"content_filter_results": {"hate": {"filtered": False}}},
    {"usage": {"total_tokens": 1}},
]


def test_usual_chunks_are_written_as_encode_writes_them():
    encoder = ChunkEncoder(False)
    role = _usual("", delta={"role": "assistant", "content": ""})
    chunks = [role, *(_usual(text) for text in ("hé", "", 'lo "quoted"\n', "\ud800", "😀"))]
    for data in chunks:
        assert encoder(_fed(data)) == encode(Chunk(data), False)
    assert encoder.template is not None  # the usual chunks went through it


@pytest.mark.parametrize("changes", CHANGED)
def test_a_chunk_that_differs_elsewhere_is_never_written_through_the_template(changes):
    encoder = ChunkEncoder(False)
    assert encoder(_fed(_usual("a"))) == encode(Chunk(_usual("a")), False)
    assert encoder.template is not None
    changed = _usual("b", **changes)
    written = encoder(_fed(changed))
    assert written == encode(Chunk(changed), False)  # its own JSON, with every value as it is
    assert written != encode(Chunk(_usual("b")), False)
    assert encoder(_fed(_usual("c"))) == encode(Chunk(_usual("c")), False)  # the template again after it


def test_a_template_is_made_only_from_scalars_and_only_once_it_can_be():
    encoder = ChunkEncoder(False)
    first = _usual("a", created=5.0)  # a float: -0.0 == 0.0, so never in a template
    assert encoder(_fed(first)) == encode(Chunk(first), False)
    assert encoder.template is None
    assert encoder(_fed(_usual("b"))) == encode(Chunk(_usual("b")), False)
    assert encoder.template is not None
    reordered = {"model": "m", **_usual("c")}  # the same keys in another order: the same object
    assert json.loads(encoder(_fed(reordered))[6:]) == reordered


@pytest.mark.parametrize("other", [True, 1.0])
def test_an_equal_value_of_another_type_is_written_as_it_is(other):
    encoder = ChunkEncoder(False)
    encoder(_fed(_usual("a", created=1)))
    assert encoder.template is not None
    changed = _usual("b", created=other)  # == 1, but its JSON is true / 1.0
    assert encoder(_fed(changed)) == encode(Chunk(changed), False)
    assert json.dumps(other).encode() in encoder(_fed(changed))


def _obfuscated(content: str, padding: object = "Zq", **changes) -> dict:
    return {**_usual(content, **changes), "obfuscation": padding}  # OpenAI's: after choices, random


def test_openais_obfuscation_is_a_second_hole():
    encoder = ChunkEncoder(False)
    chunks = [_obfuscated(text, padding) for text, padding in (("a", "x"), ("b", "lRK2aBv"), ("c", ""), ("d", "é"))]
    for data in chunks:
        assert encoder(_fed(data)) == encode(Chunk(data), False)
    assert encoder.template is not None and b"lRK2aBv" not in encoder.template.tail
    for changed in (
        _obfuscated("e", 5),  # not a string
        _obfuscated("e", None),
        _usual("e"),  # none at all
        _obfuscated("e", "y", id="c2"),
        {**_obfuscated("e"), "usage": None},  # a key more
    ):
        assert encoder(_fed(changed)) == encode(Chunk(changed), False)
    reordered = {"obfuscation": "z", **_usual("f")}
    assert json.loads(encoder(_fed(reordered))[6:]) == reordered


@pytest.mark.parametrize(
    "make",
    [
        lambda text: {"obfuscation": text * 3, **_usual(text)},  # before the choices
        lambda text: {**_obfuscated(text, text * 3), "usage": None},  # not the last key
        lambda text: _usual(text + "é", model="\ud800"),  # a lone surrogate elsewhere: the JSON is escaped
        lambda text: _usual(text, model='"delta":{"content":"x"}'),  # the cut's marker inside a value
    ],
)
def test_unusual_streams_are_written_as_encode_writes_them(make):
    encoder = ChunkEncoder(False)
    for text in ("a", "b", "c", "d", "e", "f"):
        data = make(text)
        assert encoder(_fed(data)) == encode(Chunk(data), False)


FILTERED = {  # Azure's, in every choice
    "hate": {"filtered": False, "severity": "safe"},
    "protected_material_code": {"filtered": False, "detected": False},
    "jailbroken": [{"filtered": False}, 0],
}


def _azure(content: str, **changes) -> dict:
    return _usual(content, content_filter_results=copy.deepcopy(FILTERED), **changes)


def test_azures_filter_results_are_in_the_template():
    encoder = ChunkEncoder(False)
    for text in ("a", "b", "c"):
        assert encoder(_fed(_azure(text))) == encode(Chunk(_azure(text)), False)
    assert encoder.template is not None and b"severity" in encoder.template.tail


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("hate", "filtered"), 0),  # == False, its JSON is not
        (("hate", "filtered"), True),
        (("hate", "severity"), "low"),
        (("protected_material_code", "detected"), None),
        (("jailbroken", 1), False),  # == 0
        (("jailbroken", 1), 0.0),
        (("jailbroken", 0, "filtered"), 0),
    ],
)
def test_a_filter_result_that_differs_is_written_as_it_is(path, value):
    encoder = ChunkEncoder(False)
    encoder(_fed(_azure("a")))
    assert encoder.template is not None
    changed = _azure("b")
    where = changed["choices"][0]["content_filter_results"]
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    assert encoder(_fed(changed)) == encode(Chunk(changed), False)
    assert encoder(_fed(_azure("c"))) == encode(Chunk(_azure("c")), False)


def test_a_float_anywhere_makes_no_template():
    encoder = ChunkEncoder(False)
    for text in ("a", "b", "c", "d", "e"):
        data = _usual(text, content_filter_results={"hate": {"score": 0.0}})
        assert encoder(_fed(data)) == encode(Chunk(data), False)
    assert encoder.template is None


def test_a_guarded_chunk_is_written_whole():
    # A text step's chunk is a new dict without Chunk.text: the encoder reads the chunk itself.
    encoder = ChunkEncoder(False)
    encoder(_fed(_usual("a")))
    replaced = _usual("[blocked]")
    assert encoder(Chunk(replaced)) == encode(Chunk(replaced), False)


# -------------------------------------------------------------------------------------- models


def test_models():
    assert model_object("m") == {"id": "m", "object": "model", "created": 0, "owned_by": "chatstream"}
    assert models_list(("a", "b")) == {"object": "list", "data": [model_object("a"), model_object("b")]}
    assert models_list(()) == {"object": "list", "data": []}
