"""Token counts with the model's real tokenizer, offline: what a request reserves before the call
(its prompt plus its output cap) and what a stream that ended early is charged (its prompt plus the
text actually generated).

The tokenizer is ``bpe-openai`` (PyPI): OpenAI's o200k_base and cl100k_base tables ship inside its
wheel, so nothing is downloaded at run time (``tiktoken`` fetches its tables from the network on first
use, which a locked-down Function App cannot do). Its counts are tiktoken's (tests/unit/test_tokens.py
checks them against counts OpenAI published). Counting uses its Rust extension alone (``_bindings``):
the package's own ``__init__`` builds Python dicts of all three of its vocabularies for its
tiktoken-style decoding API (about 60 MB and 0.4 s), which counting never reads.

Which encoding (``encoding_for``): the part of the model name after the last ``/`` (routers name
models ``openai/gpt-4o``), lower-cased, then

- cl100k_base: ``gpt-4`` and its dated/turbo/32k variants (not ``gpt-4o``, ``gpt-4.1``, ``gpt-4.5``),
  ``gpt-3.5*`` and Azure's ``gpt-35*``, ``text-embedding-3*`` and ``text-embedding-ada-002``;
- o200k_base: everything else: ``gpt-4o*``, ``gpt-4.1*``, ``gpt-4.5*``, ``gpt-5*``, the o-series
  (``o1``, ``o3``, ``o4-mini``...), ``gpt-oss``, and any name we do not know (an Azure deployment
  name, a local model), because that is what every current OpenAI model uses.

An encoding's tables are built on its first use, once per process: o200k_base about 45 ms and 34 MB,
cl100k_base 20 ms and 15 MB, so only the families in use cost memory. They are built from data
compiled into the extension (32 and 14 MB more), read once: its pages are given back after each
build (``memory.drop_read_pages``; they would otherwise stay resident), and so is the C heap the
build freed (``memory.trim``: 1.2 MB the preload thread's arena kept). ``preload()`` builds
o200k_base's at start-up, off the request path; a count after that is microseconds (measured:
0.8 µs for 20 characters, 15 µs for 1,000).

Chat prompts follow OpenAI's published formula (3 tokens per message, 1 more when it has a ``name``,
3 to prime the reply; tools as in OpenAI's cookbook); the Responses API publishes none, so its
prompts are counted the same way, an estimate that the upstream's reported usage replaces at settle.
Images count a fixed estimate (``IMAGE_TOKENS``); audio and files are not counted."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import memory
from .errors import invalid_request

if TYPE_CHECKING:
    from bpe_openai._bindings import PyTokenizer

O200K = "o200k_base"
CL100K = "cl100k_base"

_CL100K_PREFIXES = ("gpt-3.5", "gpt-35", "text-embedding-3", "text-embedding-ada-002")
_NOT_CL100K = ("gpt-4o", "gpt-4.", "gpt-4-o")  # gpt-4o*, gpt-4.1*, gpt-4.5*: o200k

# An image in a prompt: OpenAI bills 85 tokens at low detail and 85 + 170 per 512-px tile at high
# detail (765 for a 1024x1024 image). The size is not known without fetching it, so a fixed estimate.
IMAGE_TOKENS = {"low": 85, "high": 765, "auto": 765}

_BINDINGS = "bpe_openai._bindings"
_tokenizers: dict[str, PyTokenizer] = {}
_lock = threading.Lock()


def encoding_name(model: str | None) -> str:
    """The encoding of ``model`` (see the module docstring)."""
    name = (model or "").rsplit("/", 1)[-1].strip().lower()
    if name.startswith(_CL100K_PREFIXES):
        return CL100K
    if name.startswith("gpt-4") and not name.startswith(_NOT_CL100K):
        return CL100K
    return O200K


def _bindings():
    """bpe-openai's Rust extension, loaded from the package's folder without running the package's
    ``__init__`` (see the module docstring); an ``import bpe_openai`` later finds it loaded."""
    module = sys.modules.get(_BINDINGS)
    if module is None:
        package = importlib.util.find_spec("bpe_openai")  # finds the folder, runs nothing
        folders = package.submodule_search_locations if package else None
        spec = importlib.machinery.PathFinder.find_spec(_BINDINGS, folders) if folders else None
        if spec is None or spec.loader is None:
            raise ImportError(f"{_BINDINGS} not found: is bpe-openai installed?")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[_BINDINGS] = module
    return module


def encoding_for(model: str | None) -> PyTokenizer:
    """The tokenizer of ``model``'s encoding (``encode``, ``count``), built on first use and kept."""
    name = encoding_name(model)
    tokenizer = _tokenizers.get(name)
    if tokenizer is None:
        built = None
        with _lock:  # preload() may run in a thread while a request counts
            tokenizer = _tokenizers.get(name)
            if tokenizer is None:
                built = _bindings()
                tokenizer = _tokenizers[name] = built.tokenizer_for_encoding(name)
        if built is not None and built.__file__:  # the data it was built from (module docstring), once
            memory.drop_read_pages(built.__file__)  # out of the lock: a count need not wait for it
            memory.trim()  # and the build's freed temporaries
    return tokenizer


def preload() -> None:
    """Build o200k_base's tables now (every current model's): call it at start-up, in a thread, so
    that the first request does not pay for it. Another family's is built on its first use."""
    encoding_for(None)


def count_text(model: str | None, text: str | None) -> int:
    """Tokens of ``text`` as the model's tokenizer splits it (special-token text counts as plain text,
    as the API treats it in a message)."""
    if not text:
        return 0
    encoding = encoding_for(model)
    try:
        return encoding.count(text)
    except UnicodeEncodeError:  # lone surrogates: counted as U+FFFD, as bpe-openai's encode_ordinary does
        return encoding.count(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))


def _image_tokens(part: Mapping) -> int:
    image = part.get("image_url")
    detail = part.get("detail") or (image.get("detail") if isinstance(image, Mapping) else None) or "auto"
    return IMAGE_TOKENS.get(detail, IMAGE_TOKENS["auto"])


# Keys of an item or content part that carry no text the model reads as tokens (or whose size is not
# tokens: base64 images, audio, files).
_NOT_TEXT = frozenset(
    {
        "type",
        "id",
        "call_id",
        "status",
        "detail",
        "image_url",
        "file_id",
        "file_data",
        "file_url",
        "filename",
        "data",
        "format",
        "input_audio",
        "audio",
        "annotations",
        "logprobs",
        "encrypted_content",
    }
)


def _content_tokens(model: str | None, content: Any) -> int:
    """A message's content: a string, or parts (text, images...), or anything nested."""
    if content is None:
        return 0
    if isinstance(content, str):
        return count_text(model, content)
    if isinstance(content, list):
        return sum(_content_tokens(model, part) for part in content)
    if isinstance(content, Mapping):
        if content.get("type") in ("image_url", "input_image"):
            return _image_tokens(content)
        total = 0
        for key, value in content.items():
            if key not in _NOT_TEXT:
                total += _content_tokens(model, value)
        return total
    return 0  # numbers, booleans: part of a structure, not of the text


def _chat_messages(model: str | None, messages: list) -> int:
    """OpenAI's formula: 3 per message, every string field's tokens, 1 more for a ``name``; tool calls
    (and other structured fields) by their text."""
    total = 0
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        total += 3
        for key, value in message.items():
            if isinstance(value, str):
                total += count_text(model, value)
                if key == "name":
                    total += 1
            elif key == "content":
                total += _content_tokens(model, value)
            elif key == "tool_calls" and isinstance(value, list):
                for call in value:
                    function = call.get("function") if isinstance(call, Mapping) else None
                    if isinstance(function, Mapping):
                        total += (
                            3
                            + count_text(model, _str(function.get("name")))
                            + count_text(model, _str(function.get("arguments")))
                        )
    return total + 3  # every reply is primed with <|start|>assistant<|message|>


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _function_tools(model: str | None, tools: list) -> int:
    """Function definitions as OpenAI's cookbook counts them (it matches the API's prompt_tokens for
    gpt-4o and gpt-4); other tool types by the text of their JSON."""
    o200k = encoding_name(model) == O200K
    func_init, prop_init, prop_key, enum_init, enum_item, func_end = (7 if o200k else 10), 3, 3, -3, 3, 12
    total = 0
    functions = 0
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function") if isinstance(tool.get("function"), Mapping) else None
        if function is None and tool.get("type") == "function":
            function = tool  # the Responses API's flat shape
        if function is None:
            total += count_text(model, json.dumps(tool, ensure_ascii=False))
            continue
        functions += 1
        total += func_init
        description = _str(function.get("description")).removesuffix(".")
        total += count_text(model, f"{_str(function.get('name'))}:{description}")
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if isinstance(properties, Mapping) and properties:
            total += prop_init
            for key, prop in properties.items():
                total += prop_key
                prop = prop if isinstance(prop, Mapping) else {}
                enum = prop.get("enum")
                if isinstance(enum, list):
                    total += enum_init
                    for item in enum:
                        total += enum_item + count_text(model, item if isinstance(item, str) else json.dumps(item))
                p_type = prop.get("type")
                p_type = p_type if isinstance(p_type, str) else json.dumps(p_type)
                p_desc = _str(prop.get("description")).removesuffix(".")
                total += count_text(model, f"{key}:{p_type}:{p_desc}")
    return total + (func_end if functions else 0)


def _responses_input(model: str | None, params: Mapping) -> int:
    """A Responses body: ``instructions`` as a system message, ``input`` as a user message when it is
    a string, otherwise each item as a message (3 + its text)."""
    total = 0
    instructions = params.get("instructions")
    if isinstance(instructions, str) and instructions:
        total += 3 + count_text(model, "system") + count_text(model, instructions)
    items = params.get("input")
    if isinstance(items, str):
        total += 3 + count_text(model, "user") + count_text(model, items)
    elif isinstance(items, list):
        for item in items:
            if isinstance(item, Mapping):
                total += 3 + _content_tokens(model, item)
            elif isinstance(item, str):
                total += 3 + count_text(model, item)
    return total + 3


def count_prompt(model: str | None, params: Mapping[str, Any]) -> int:
    """The prompt tokens of a request body: chat completions (``messages``, ``tools``, legacy
    ``functions``) or Responses (``input``, ``instructions``, ``tools``)."""
    if "messages" in params:
        messages = params.get("messages")
        total = _chat_messages(model, messages if isinstance(messages, list) else [])
    else:
        total = _responses_input(model, params)
    tools = params.get("tools")
    if isinstance(tools, list) and tools:
        total += _function_tools(model, tools)
    functions = params.get("functions")  # the legacy chat field: the same definitions, unwrapped
    if isinstance(functions, list) and functions:
        total += _function_tools(model, [{"type": "function", "function": f} for f in functions])
    return total


CAP_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens")
MAX_OUTPUT_CAP = 1_000_000


def single_cap(params: dict[str, Any]) -> dict[str, Any]:
    """The request's output cap as one validated integer: every cap field it names must be an integer
    from 1 to ``MAX_OUTPUT_CAP`` (a float, a string, ``1e9``, a bool: 400 naming the field), and when
    it names several, each is set to the smallest, so that what the app reserves is what the
    upstream gets, whichever field the upstream reads."""
    given = {f: params[f] for f in CAP_FIELDS if params.get(f) is not None}
    for name, value in given.items():
        if type(value) is not int or not 1 <= value <= MAX_OUTPUT_CAP:
            raise invalid_request(f"{name}: must be an integer from 1 to {MAX_OUTPUT_CAP}", name)
    if len(set(given.values())) > 1:
        smallest = min(given.values())
        return {**params, **dict.fromkeys(given, smallest)}
    return params


def output_cap(params: Mapping[str, Any]) -> int | None:
    """The output cap the request names (the smallest, if it names several: ``single_cap`` makes
    them one), or None."""
    caps = [v for f in CAP_FIELDS if type(v := params.get(f)) is int and v > 0]
    return min(caps) if caps else None


def choices(params: Mapping[str, Any]) -> int:
    n = params.get("n")
    return n if type(n) is int and n > 0 else 1


def with_default_cap(params: dict[str, Any], default_max: int) -> dict[str, Any]:
    """``params`` with the default output cap added when the request names none, so the reservation
    bounds what the model may generate: ``max_output_tokens`` for a Responses body (``input``),
    otherwise ``max_completion_tokens`` (OpenAI's and Azure OpenAI's current field; the o-series
    refuse ``max_tokens``)."""
    if output_cap(params) is not None:
        return params
    field = "max_completion_tokens" if "messages" in params else "max_output_tokens"
    return {**params, field: default_max}
