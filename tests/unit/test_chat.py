"""chatstream/api_chat.py: the /api/chat contract (every rule, the ``param`` path of each error, the
upstream parameters it makes) and the bytes its encoder writes for each stream event."""

from __future__ import annotations

import json

import pytest

from chatstream.apis.chat import MAX_MESSAGES, ChatApi, chat_text, encode, validate_chat_request
from chatstream.apis.completions import CompletionStream
from chatstream.errors import ApiError, TimeLimit
from chatstream.pipeline import Pipeline
from chatstream.settings import Settings
from chatstream.stream import Chunk, Done, Failed

USER = {"role": "user", "content": "hi"}


def refused(body) -> ApiError:
    with pytest.raises(ApiError) as info:
        validate_chat_request(body)
    error = info.value
    assert (error.status, error.type, error.retryable) == (400, "invalid_request", False)
    return error


# ----------------------------------------------------------------------------- what is accepted


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi"},
        {"prompt": " x "},
        {"messages": [USER]},
        {"messages": [{"role": "system", "content": ""}, {"role": "assistant", "content": "a"}, USER]},
        {"messages": [USER] * MAX_MESSAGES},
        {
            "prompt": "hi",
            "model": "m" * 256,
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 1_000_000,
            "seed": -(2**63),
            "stop": "END",
        },
        {
            "prompt": "hi",
            "temperature": 2,
            "top_p": 0.0,
            "max_tokens": 1,
            "seed": 2**63 - 1,
            "stop": ["a", "b", "c", "d"],
        },
        {
            "prompt": "hi",
            "model": None,
            "temperature": None,
            "top_p": None,
            "max_tokens": None,
            "seed": None,
            "stop": None,
        },
    ],
)
def test_valid_bodies(body):
    validate_chat_request(body)


# ------------------------------------------------------------------------------ what is refused


@pytest.mark.parametrize("body", [[], "hi", None, 1, [{"prompt": "hi"}]])
def test_the_body_must_be_an_object(body):
    error = refused(body)
    assert error.message == "the body must be a JSON object" and error.param is None


@pytest.mark.parametrize(
    "body", [{}, {"prompt": "hi", "messages": [USER]}, {"prompt": None}, {"prompt": None, "messages": None}]
)
def test_prompt_xor_messages(body):
    error = refused(body)
    assert error.message == "give either 'prompt' or 'messages', not both and not neither"
    assert error.param is None


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"prompt": ""}, "prompt", "prompt: must not be empty"),
        ({"prompt": " \n\t"}, "prompt", "prompt: must not be empty"),
        ({"prompt": 5}, "prompt", "prompt: Input should be a valid string"),
        ({"prompt": ["hi"]}, "prompt", "prompt: Input should be a valid string"),
        ({"messages": []}, "messages", "messages: List should have at least 1 item after validation, not 0"),
        (
            {"messages": [USER] * (MAX_MESSAGES + 1)},
            "messages",
            "messages: List should have at most 1000 items after validation, not 1001",
        ),
        ({"messages": "hi"}, "messages", "messages: Input should be a valid list"),
        ({"messages": ["hi"]}, "messages[0]", "messages[0]: Input should be a valid dictionary or instance of Message"),
        (
            {"messages": [USER, {"role": "tool", "content": "x"}]},
            "messages[1].role",
            "messages[1].role: Input should be 'system', 'user' or 'assistant'",
        ),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "messages[0].role: Field required"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "messages[0].content: Field required"),
        (
            {"messages": [{"role": "user", "content": None}]},
            "messages[0].content",
            "messages[0].content: Input should be a valid string",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
            "messages[0].content",
            "messages[0].content: Input should be a valid string",
        ),
        (
            {"messages": [{"role": "system", "content": "x"}]},
            "messages",
            "messages: needs at least one non-empty user message",
        ),
        (
            {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},
            "messages",
            "messages: needs at least one non-empty user message",
        ),
        ({"prompt": "x", "model": ""}, "model", "model: String should have at least 1 character"),
        ({"prompt": "x", "model": "m" * 257}, "model", "model: String should have at most 256 characters"),
        ({"prompt": "x", "model": 4}, "model", "model: Input should be a valid string"),
        ({"prompt": "x", "temperature": 2.01}, "temperature", "temperature: Input should be less than or equal to 2"),
        (
            {"prompt": "x", "temperature": -0.1},
            "temperature",
            "temperature: Input should be greater than or equal to 0",
        ),
        ({"prompt": "x", "temperature": "1"}, "temperature", "temperature: Input should be a valid number"),
        ({"prompt": "x", "temperature": True}, "temperature", "temperature: Input should be a valid number"),
        ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p: Input should be less than or equal to 1"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens: Input should be greater than 0"),
        ({"prompt": "x", "max_tokens": 1.0}, "max_tokens", "max_tokens: Input should be a valid integer"),
        (
            {"prompt": "x", "max_tokens": 1_000_001},
            "max_tokens",
            "max_tokens: Input should be less than or equal to 1000000",
        ),
        ({"prompt": "x", "seed": 2**63}, "seed", "seed: Input should be less than 9223372036854775808"),
        ({"prompt": "x", "seed": 1.5}, "seed", "seed: Input should be a valid integer"),
        ({"prompt": "x", "stop": ""}, "stop", "stop: String should have at least 1 character"),
        ({"prompt": "x", "stop": 3}, "stop", "stop: Input should be a valid string"),
    ],
)
def test_each_rule_names_its_field(body, param, message):
    error = refused(body)
    assert (error.param, error.message) == (param, message)
    assert error.body()["error"]["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "stream": True}, "stream"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "tools": []}, "tools"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
        ({"messages": [USER, {"role": "user", "content": "x", "model": "m"}]}, "messages[1].model"),
        ({"messages": [USER, {"role": "user", "content": "x", "str": 1}]}, "messages[1].str"),
    ],
)
def test_unknown_fields_are_refused_by_path(body, param):
    error = refused(body)
    assert (error.param, error.message) == (param, f"unknown field {param!r}")


@pytest.mark.parametrize(
    "stop, param, says",
    [
        (["a", ""], "stop[1]", "at least 1 character"),
        (["a"] * 5, "stop", "at most 4 items"),
        ([], "stop", "at least 1 item"),
    ],
)
def test_a_bad_stop_list_says_what_is_wrong_with_it(stop, param, says):
    error = refused({"prompt": "x", "stop": stop})
    assert error.param == param and says in error.message


# ------------------------------------------------------------------------------ to the upstream


def test_to_params_from_a_prompt():
    request = validate_chat_request({"prompt": "hi"})
    assert request.to_params("gpt-default") == {
        "model": "gpt-default",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_to_params_from_messages_with_every_option():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    request = validate_chat_request(
        {
            "messages": messages,
            "model": "m",
            "temperature": 0.5,
            "top_p": 0.9,
            "max_tokens": 5,
            "seed": 7,
            "stop": ["END"],
        }
    )
    assert request.to_params("gpt-default") == {
        "model": "m",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 5,
        "seed": 7,
        "stop": ["END"],
    }


def test_to_params_leaves_out_what_was_not_set():
    params = validate_chat_request({"prompt": "hi", "temperature": None, "seed": 0}).to_params("d")
    assert "temperature" not in params and params["seed"] == 0


def test_to_params_gives_new_messages_each_time():
    request = validate_chat_request({"messages": [USER]})
    first = request.to_params("d")
    first["messages"].append({"role": "user", "content": "added by a before-step"})
    assert request.to_params("d")["messages"] == [USER]


async def test_the_adapter():
    api = ChatApi()
    settings = Settings.from_env({"OPENAI_API_KEY": "k", "OPENAI_MODEL": "gpt-x"})
    call = api.parse({"prompt": "hi", "seed": 1}, settings.default_model)
    assert call.endpoint == "chat" and call.include_usage is False
    assert call.params["model"] == "gpt-x" and call.params["stream"] is True and call.params["seed"] == 1
    assert (api.name, api.path, api.completes) == ("chat", "/chat/completions", False)
    protocol = api.protocol(call, Pipeline(), False)
    assert isinstance(protocol, CompletionStream)
    await protocol.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    assert protocol.done, "one choice"
    assert api.encoder(call) is encode


def test_the_adapter_error_response():
    response = ChatApi().error_response(
        ApiError(429, "rate_limited", "slow", retryable=True, headers={"Retry-After": "3"})
    )
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert json.loads(response.body) == {"error": {"type": "rate_limited", "message": "slow", "retryable": True}}


# ------------------------------------------------------------------------------------ encoding


def chunk(*choices, **extra) -> Chunk:
    return Chunk({"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": list(choices), **extra})


def test_a_chunk_with_text_is_one_delta_event():
    data = encode(chunk({"index": 0, "delta": {"role": "assistant", "content": 'Hé "x"\n'}}))
    assert data == 'data: {"delta":"Hé \\"x\\"\\n"}\n\n'.encode()


@pytest.mark.parametrize(
    "choice",
    [
        {"index": 0, "delta": {"role": "assistant"}},
        {"index": 0, "delta": {"content": ""}},
        {"index": 0, "delta": {"content": None}},
        {"index": 0, "delta": {}, "finish_reason": "stop"},
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}},
        {"index": 0, "delta": {"refusal": "no"}},
        {"index": 0},
        {"index": 1, "delta": {"content": "choice one"}},
    ],
)
def test_a_chunk_without_choice_zeros_text_writes_nothing(choice):
    assert encode(chunk(choice)) is None


def test_choice_zero_is_found_wherever_it_is_and_without_an_index():
    assert (
        chat_text({"choices": [{"index": 1, "delta": {"content": "b"}}, {"index": 0, "delta": {"content": "a"}}]})
        == "a"
    )
    assert chat_text({"choices": [{"delta": {"content": "a"}}]}) == "a"
    assert chat_text({"choices": []}) is None


def test_done():
    done = Done("stop", {0: "stop"}, {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}, "m-2024", "c1", 7)
    assert encode(done) == (
        b'event: done\ndata: {"finish_reason":"stop","usage":{"prompt_tokens":1,'
        b'"completion_tokens":2,"total_tokens":3},"model":"m-2024","id":"c1"}\n\n'
    )


def test_done_without_usage():
    assert (
        encode(Done(None, {}, None, None, None, None))
        == b'event: done\ndata: {"finish_reason":null,"usage":null,"model":null,"id":null}\n\n'
    )


def test_failed():
    data = encode(Failed(TimeLimit("upstream_timeout", "no first token")))
    assert data == (
        b'event: error\ndata: {"error":{"type":"upstream_timeout","message":"no first token","retryable":true}}\n\n'
    )


def test_failed_with_a_param():
    data = encode(Failed(ApiError(400, "model_not_found", "no such model", "model")))
    assert json.loads(data.split(b"data: ", 1)[1]) == {
        "error": {"type": "model_not_found", "message": "no such model", "param": "model", "retryable": False}
    }


@pytest.mark.parametrize(
    "text", ["lorem ", 'a "quote" \\ back\nslash', "café 日本語 🙂", "\ud800 lone surrogate", "\x00\x1f"]
)
def test_a_delta_event_is_the_json_of_its_object(text):
    from chatstream import sse
    from chatstream.http import dumps

    data = {"choices": [{"index": 0, "delta": {"content": text}}]}
    assert encode(Chunk(data)) == sse.event(dumps({"delta": text}))
