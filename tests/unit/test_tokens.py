"""chatstream/tokens.py: counts agree with the counts OpenAI published (its cookbook's figures,
measured against the API's own prompt_tokens), the encoding per model, reservations and caps."""

from __future__ import annotations

import time

import pytest

from chatstream import tokens

# OpenAI cookbook, "How to count tokens with tiktoken": its example conversation is 129 prompt tokens
# for gpt-3.5-turbo and gpt-4, 124 for gpt-4o and gpt-4o-mini, as the API itself reported.
COOKBOOK_MESSAGES = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate jargon "
        "into plain English.",
    },
    {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
    {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch "
        "base on opportunities for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client deliverable.",
    },
]
# ... and with this tool, 101 (gpt-4o, gpt-4o-mini) and 105 (gpt-4, gpt-3.5-turbo).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {
                    "type": "string",
                    "description": "The unit of temperature to return",
                    "enum": ["celsius", "fahrenheit"],
                },
            },
            "required": ["location"],
        },
    },
}
WEATHER_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant that can answer to questions about the weather."},
    {"role": "user", "content": "What's the weather like in San Francisco?"},
]


@pytest.mark.parametrize(
    ("model", "text", "count"),
    [
        ("gpt-4o", "hello world", 2),
        ("gpt-4", "hello world", 2),
        ("gpt-4o-mini", "tiktoken is great!", 6),
        ("gpt-4", "tiktoken is great!", 6),
        ("gpt-4o", "antidisestablishmentarianism", 6),
        ("gpt-4", "antidisestablishmentarianism", 6),
        ("gpt-4o", "2 + 2 = 4", 7),
        ("gpt-3.5-turbo", "2 + 2 = 4", 7),
        ("gpt-4o", "お誕生日おめでとう", 8),
        ("gpt-4", "お誕生日おめでとう", 9),
        ("gpt-4o", "", 0),
        ("gpt-4o", "<|endoftext|>", 7),  # special-token text in a message is plain text
    ],
)
def test_counts_agree_with_openais(model, text, count):
    assert tokens.count_text(model, text) == count


def test_the_token_ids_are_openais():
    assert tokens.encoding_for("gpt-4o").encode("tiktoken is great!") == [83, 8251, 2488, 382, 2212, 0]
    assert tokens.encoding_for("gpt-4").encode("tiktoken is great!") == [83, 1609, 5963, 374, 2294, 0]


@pytest.mark.parametrize(
    ("model", "prompt"), [("gpt-4o", 124), ("gpt-4o-mini", 124), ("gpt-4", 129), ("gpt-3.5-turbo", 129)]
)
def test_chat_prompts_follow_openais_formula(model, prompt):
    assert tokens.count_prompt(model, {"messages": COOKBOOK_MESSAGES}) == prompt


@pytest.mark.parametrize(
    ("model", "prompt"), [("gpt-4o", 101), ("gpt-4o-mini", 101), ("gpt-4", 105), ("gpt-3.5-turbo", 105)]
)
def test_tools_are_counted_as_the_cookbook_counts_them(model, prompt):
    assert tokens.count_prompt(model, {"messages": WEATHER_MESSAGES, "tools": [WEATHER_TOOL]}) == prompt


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-mini-2024-07-18", "o200k_base"),
        ("gpt-4.1-nano", "o200k_base"),
        ("gpt-4.5-preview", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("o1", "o200k_base"),
        ("o4-mini", "o200k_base"),
        ("my-azure-deployment", "o200k_base"),
        ("", "o200k_base"),
        (None, "o200k_base"),
        ("llama3", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("gpt-4-0613", "cl100k_base"),
        ("gpt-4-32k", "cl100k_base"),
        ("GPT-3.5-Turbo", "cl100k_base"),
        ("gpt-35-turbo", "cl100k_base"),
        ("text-embedding-3-small", "cl100k_base"),
        ("text-embedding-ada-002", "cl100k_base"),
        ("openai/gpt-4", "cl100k_base"),
        ("openai/gpt-4o", "o200k_base"),
    ],
)
def test_the_encoding_per_model(model, encoding):
    assert tokens.encoding_name(model) == encoding


def test_counts_are_the_packages_own():
    """The Rust extension counts as bpe-openai's public API encodes: long texts, lone surrogates."""
    import bpe_openai

    long = ("The quick brown fox jumps over the lazy dog; 12345 — naïve café, お誕生日.\n  " * 4000) + "z" * 120_000
    for model, name in (("gpt-4o", "o200k_base"), ("gpt-4", "cl100k_base")):
        encoding = bpe_openai.get_encoding(name)
        for text in (long, "a\ud800b \udfff", "<|endoftext|> hi"):
            assert tokens.count_text(model, text) == len(encoding.encode_ordinary(text))


def test_content_parts_tool_calls_and_images():
    parts = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello world"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 5000, "detail": "low"}},
                ],
            }
        ]
    }
    assert tokens.count_prompt("gpt-4o", parts) == 3 + 1 + 2 + 85 + 3  # role "user" is 1 token
    call = {
        "messages": [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            }
        ]
    }
    assert (
        tokens.count_prompt("gpt-4o", call)
        == 3 + 1 + 3 + tokens.count_text("gpt-4o", "get_weather") + tokens.count_text("gpt-4o", '{"city":"Paris"}') + 3
    )


def test_responses_bodies():
    assert tokens.count_prompt("gpt-4o", {"input": "hello world"}) == 3 + 1 + 2 + 3
    with_instructions = tokens.count_prompt("gpt-4o", {"input": "hello world", "instructions": "Be brief."})
    assert with_instructions == 9 + 3 + 1 + tokens.count_text("gpt-4o", "Be brief.")
    items = {
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello world"}]},
            {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
        ]
    }
    assert tokens.count_prompt("gpt-4o", items) == (3 + 1 + 2) + (3 + tokens.count_text("gpt-4o", "22C")) + 3
    flat_tool = {"type": "function", **WEATHER_TOOL["function"]}
    tool_cost = 101 - tokens.count_prompt("gpt-4o", {"messages": WEATHER_MESSAGES})  # the cookbook's, gpt-4o
    assert (
        tokens.count_prompt("gpt-4o", {"input": "x", "tools": [flat_tool]})
        == tokens.count_prompt("gpt-4o", {"input": "x"}) + tool_cost
    )


def test_a_prompt_counts_its_message_and_the_reply_primer():
    assert tokens.count_prompt("gpt-4o", {"messages": [{"role": "user", "content": "hello world"}]}) == 3 + 1 + 2 + 3
    assert tokens.count_prompt("gpt-4o", {"input": "hello world"}) == 9


def test_the_default_cap_is_added_only_when_none_is_named():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert tokens.with_default_cap(chat, 4096) == {**chat, "max_completion_tokens": 4096}
    assert tokens.with_default_cap({**chat, "max_tokens": 9}, 4096) == {**chat, "max_tokens": 9}
    assert tokens.with_default_cap({"input": "hi"}, 4096) == {"input": "hi", "max_output_tokens": 4096}
    assert "max_completion_tokens" not in chat  # the caller's dict is not changed


def test_per_call_cost():
    tokens.preload()
    text = "The quick brown fox jumps over the lazy dog. " * 22  # about 1,000 characters
    n = 200
    started = time.perf_counter()
    for _ in range(n):
        tokens.count_text("gpt-4o", text)
    per_call = (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(n):
        tokens.count_prompt("gpt-4o", {"messages": COOKBOOK_MESSAGES})
    per_prompt = (time.perf_counter() - started) / n
    print(
        f"\ntokens: {per_call * 1e6:.0f} µs per 1,000 characters, {per_prompt * 1e6:.0f} µs for the "
        f"cookbook's 6-message prompt"
    )
    assert per_call < 0.005  # generous: a regression by orders of magnitude, not noise, fails this
