"""The request parameters OpenAI's chat-completions API knows (CreateChatCompletionRequest in its
published OpenAPI spec), and the checks it makes that tests rely on: an unknown parameter or an
out-of-range temperature is a 400 naming the parameter, as OpenAI answers it."""

from __future__ import annotations

KNOWN_CHAT_PARAMS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "metadata",
        "modalities",
        "model",
        "moderation",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)


# What vLLM's OpenAI-compatible server also takes: a true prefix continuation of a final assistant message.
PREFIX_PARAMS = frozenset({"continue_final_message", "add_generation_prompt"})


def chat_param_problem(body: dict, prefix: bool = False) -> tuple[str, str, str] | None:
    """(message, param, code) of the first problem OpenAI would answer with a 400, or None.
    ``prefix``: the server also takes vLLM's ``continue_final_message`` and ``add_generation_prompt``."""
    for name in body:
        if name not in KNOWN_CHAT_PARAMS and not (prefix and name in PREFIX_PARAMS):
            return f"Unrecognized request argument supplied: {name}", name, "unknown_parameter"
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 2:
        return (
            f"Invalid 'temperature': decimal {'above maximum' if temperature > 2 else 'below minimum'} value. "
            f"Expected a value {'<= 2' if temperature > 2 else '>= 0'}, but got {temperature} instead.",
            "temperature",
            "decimal_above_max_value" if temperature > 2 else "decimal_below_min_value",
        )
    return None
