"""The types of OpenAI's documented request fields that the relay passes on without reading them
(chat completions and the Responses API). A caller's value of the wrong type is the caller's 400,
naming the field, before anything reaches an upstream: a server that answered it with a 5xx would
count it against its pool entry (docs/pool.md). Only the type is checked; the values (ranges,
names, the items of an array) stay the upstream's to judge, with a 4xx that counts against no entry.
A field not listed here goes on unchecked, as it came (forward-compatible)."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictFloat | StrictInt
Object = dict[str, Any]


class SharedFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    metadata: Object | None = None
    parallel_tool_calls: StrictBool | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    service_tier: StrictStr | None = None
    store: StrictBool | None = None
    temperature: Number | None = None
    tool_choice: StrictStr | Object | None = None
    tools: list[Object] | None = None
    top_logprobs: StrictInt | None = None
    top_p: Number | None = None
    user: StrictStr | None = None


class ChatFields(SharedFields):
    audio: Object | None = None
    frequency_penalty: Number | None = None
    function_call: StrictStr | Object | None = None
    functions: list[Object] | None = None
    logit_bias: Object | None = None
    logprobs: StrictBool | None = None
    max_completion_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None
    modalities: list[StrictStr] | None = None
    prediction: Object | None = None
    presence_penalty: Number | None = None
    reasoning_effort: StrictStr | None = None
    response_format: Object | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    verbosity: StrictStr | None = None
    web_search_options: Object | None = None


class ResponsesFields(SharedFields):
    conversation: StrictStr | Object | None = None
    include: list[StrictStr] | None = None
    max_output_tokens: StrictInt | None = None
    max_tool_calls: StrictInt | None = None
    previous_response_id: StrictStr | None = None
    prompt: Object | None = None
    reasoning: Object | None = None
    stream_options: Object | None = None
    text: Object | None = None
    truncation: StrictStr | None = None


_WORDS = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "object": "an object",
    "array": "an array",
}


def type_problem(model: type[BaseModel], first: dict) -> tuple[str, str] | None:
    """OpenAI's wording for a wrong type in one of the fields this module declares (``first``: a
    pydantic error of ``model``, which has them): the message and the field; None when the error is
    about something else."""
    loc = first.get("loc") or ()
    field = loc[0] if loc and isinstance(loc[0], str) else ""
    expected = expected_types(model).get(field)
    if expected is None or not first["type"].endswith("_type"):
        return None
    return f"Invalid type for '{field}': expected {expected}.", field


@functools.cache
def expected_types(model: type[BaseModel]) -> dict[str, str]:
    """What each declared field accepts, in JSON's words, from the model's JSON schema."""
    declared = {
        name
        for base in (SharedFields, ChatFields, ResponsesFields)
        if issubclass(model, base)
        for name in base.__annotations__
    }
    out = {}
    for name, schema in model.model_json_schema()["properties"].items():
        if name not in declared:
            continue
        options = schema.get("anyOf", [schema])
        kinds = [option.get("type") for option in options]
        words = []
        for option, kind in zip(options, kinds, strict=True):
            if kind == "array" and option.get("items", {}).get("type") in ("string", "object"):
                words.append(f"an array of {option['items']['type']}s")
            elif kind in _WORDS and not (kind == "integer" and "number" in kinds):  # a number takes integers
                words.append(_WORDS[kind])
        if words:
            out[name] = words[0] if len(words) == 1 else "one of " + ", ".join(words[:-1]) + " or " + words[-1]
    return out
