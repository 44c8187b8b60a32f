"""Scenario texts, and the chunk scripts that put them on the wire.

A scenario is data (its deltas, their timing, how the stream ends, or the HTTP
error it answers with). `stream_plan()` turns a scenario and one request into a
*plan*: a list of `(seconds_after_start, bytes | RESET | STALL)` steps that the
server plays back. Everything that does not change per chunk is serialised
once: the `data: {"id":...,"choices":[` prefix once per request, each choice
object once per (index, text) thanks to an LRU cache.

Token counting (documented, deterministic, not a tokenizer):
  * completion_tokens = number of content deltas per choice (one delta = one
    "token"; for tool_calls, the number of argument fragments), times n;
    extra deltas sent after the finish chunk (`after_finish`) are not counted.
  * prompt_tokens = number of whitespace-separated words in the text of all
    request messages; with `prompt_cache_key` in the request, half of them (rounded down)
    are reported as `prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

# --------------------------------------------------------------------------- texts

NORMAL_DELTAS = (
    "Hello! This is the scripted **normal** reply.\n",
    "\n",
    'It has "quotes", a back\\slash, ',
    "and accented Latin: café, naïve, Ærøskøbing, São Paulo.\n\n",
    "Emoji from the astral plane: 🙂🚀",
    " and 👍🏽.\n",
    "CJK: 日本語のテキスト",
    "、中文、한국어。\n",
    "\n- one\n- two\n",
    "Last line, no trailing newline.",
)
SLOW_DELTAS = tuple(
    w + " " for w in ["This", "reply", "arrives", "slowly,", "one", "word", "every", "two", "hundred"]
) + ("milliseconds.",)
SPLIT_UTF8_DELTAS = ("Grüße ", "🙂🚀 ", "日本語の", "テキスト ", "— ñandú, € 5 ", "ok 👍🏽")
AZURE_DELTAS = ("Hello ", "from ", "Azure ", "OpenAI ", "— ça ", "marche 🙂")
LENGTH_DELTAS = ("The answer is long, ", "so it gets cut off ", "when max_tokens runs ", "o")
CONTENT_FILTER_DELTAS = ("Here is the first part of the answer, ", "and then")
AFTER_FINISH_DELTAS = ("The whole answer ", "ends here.")
AFTER_FINISH_EXTRA_DELTAS = ("EXTRA TEXT SENT AFTER finish_reason ", "MUST NOT BE FORWARDED")
AFTER_FINISH_EXTRA = "".join(AFTER_FINISH_EXTRA_DELTAS)
RESET_DELTAS = ("Partial answer, ", "the connection ", "drops after this")
STALL_DELTAS = ("Thinking", " about it…")
MALFORMED_DELTAS = ("Before the ", "broken line ")
ERROR_MIDSTREAM_DELTAS = ("Started fine, ", "then failed ")
# For pages that show replies: markup a page must show as text and never run.
HTML_DELTAS = (
    "Markup, shown as text: ",
    "<img src=x onerror=alert(1)>",
    " <script>window.__xss = 1</script>",
    ' <b>not bold</b> &amp; <a href="javascript:alert(2)">no link</a>',
)
CADENCE_WORDS = ("lorem ", "ipsum ", "dolor ", "sit ", "amet ", "consectetur ", "adipiscing ", "elit ")

TOOL_CALL_ID = "call_fakeupstream0001"
TOOL_CALL_NAME = "get_weather"
TOOL_CALL_ARGUMENT_DELTAS = ('{"', "location", '":"', "Paris", ", France", '","', "unit", '":"', "celsius", '"}')
TOOL_CALL_ARGUMENTS = "".join(TOOL_CALL_ARGUMENT_DELTAS)  # {"location":"Paris, France","unit":"celsius"}

MALFORMED_LINE = b'data: {"id": "broken", not json\n\n'
ODD_SHAPE_LINE = (
    b'data: {"id": "odd", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": "text"}]}\n\n'
)
MIDSTREAM_ERROR = {
    "error": {
        "message": "The server had an error while processing your request.",
        "type": "server_error",
        "param": None,
        "code": None,
    }
}
# A mid-stream error shaped like a 4xx: the request's problem, not the server's.
MIDSTREAM_ERROR_4XX = {
    "error": {
        "message": "The request was refused while its answer was generated.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
}
ECHO_PREFIX = "You said: "
SYSTEM_FINGERPRINT = "fp_fake"
SPLIT_WRITE_GAP_S = 0.02


def echo_text(user_text: str) -> str:
    """The full reply of the `echo` scenario for a last user message."""
    return ECHO_PREFIX + user_text


def word_deltas(text: str) -> tuple[str, ...]:
    """Split into word-sized deltas (each word keeps its following whitespace)."""
    return tuple(re.findall(r"\s*\S+\s*|\s+", text))


def cadence_deltas(count: int, chars: int = 0) -> tuple[str, ...]:
    """``count`` short words; with ``chars``, each one repeated and cut to exactly that many characters."""
    words = CADENCE_WORDS if not chars else tuple((w * (chars // len(w) + 1))[:chars] for w in CADENCE_WORDS)
    return tuple(words[i % len(words)] for i in range(count))


def cadence_text(count: int = 40, chars: int = 0) -> str:
    return "".join(cadence_deltas(count, chars))


def choice_text(text: str, index: int) -> str:
    """With n > 1, choice i > 0 gets the same deltas, the first one prefixed by `[choice i] `."""
    return text if index == 0 else f"[choice {index}] {text}"


def _choice_deltas(deltas: tuple[str, ...], index: int) -> tuple[str, ...]:
    if index == 0 or not deltas:
        return deltas
    return (choice_text(deltas[0], index),) + deltas[1:]


# ----------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class HttpError:
    """An error answered before any stream starts (OpenAI's error body)."""

    status: int
    message: str  # may use {model}, {key} (the masked API key) and {auth} (the credential header, as received)
    type: str
    code: str | None = None
    param: str | None = None
    retry_after_s: float | None = None  # adds retry-after and retry-after-ms headers


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    deltas: tuple[str, ...] = ()
    first_s: float = 0.01  # first content delta, after the role chunk at 0
    interval_s: float = 0.01  # between content deltas
    finish_reason: str = "stop"
    # How the stream ends: "done" (finish, usage, [DONE]); "after_finish" (finish, extra
    # content, usage, [DONE]); "reset" (drop the connection); "stall" (silence until the
    # client hangs up); "malformed" / "error_midstream" (a bad line, then end the body); "hang" (no
    # answer at all, streamed or not, until the client hangs up).
    end: str = "done"
    role_chunk: bool = True
    style: str = "openai"  # "openai" | "azure" | "tool_calls"
    split_writes: bool = False  # cut the byte stream inside UTF-8 characters
    held: bool = False  # after the role chunk, nothing until POST /_scripted/release
    error: HttpError | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


# An upstream (or a proxy in front of it) that repeats the request's credentials in its error message.
KEY_IN_ERROR = "{what} (scripted): the request carried {{auth}}"


def _err(status, message, type_, code=None, param=None, retry_after_s=None) -> HttpError:
    return HttpError(status, message, type_, code, param, retry_after_s)


_LIST = [
    Scenario("echo", "`You said: <last user message>` in word deltas, 30 ms apart", first_s=0.03, interval_s=0.03),
    Scenario("normal", "multi-line text with blank lines, emoji, CJK, accents; 10 deltas 10 ms apart", NORMAL_DELTAS),
    Scenario(
        "slow", "10 deltas, 200 ms apart, first after 200 ms (2 s in all)", SLOW_DELTAS, first_s=0.2, interval_s=0.2
    ),
    Scenario(
        "held",
        "the role chunk, then nothing until POST /_scripted/release, then the `slow` text at once",
        SLOW_DELTAS,
        held=True,
    ),
    Scenario(
        "slow_normal",
        "the `normal` text (newlines, emoji, CJK), 10 deltas 150 ms apart",
        NORMAL_DELTAS,
        first_s=0.15,
        interval_s=0.15,
    ),
    Scenario(
        "html",
        "a reply with HTML markup (`<img src=x onerror=alert(1)>`, a script tag) to be shown as text",
        HTML_DELTAS,
    ),
    Scenario(
        "split_utf8",
        "network writes cut inside UTF-8 characters and inside `data:`, 20 ms apart",
        SPLIT_UTF8_DELTAS,
        split_writes=True,
    ),
    Scenario(
        "azure_filters",
        "Azure frames: prompt_filter_results first, content_filter_results, "
        "content_filter_offsets and empty-choices frames after the finish",
        AZURE_DELTAS,
        style="azure",
    ),
    Scenario("length", "text cut mid-word, finish_reason `length`", LENGTH_DELTAS, finish_reason="length"),
    Scenario(
        "content_filter",
        "text cut short, finish_reason `content_filter`",
        CONTENT_FILTER_DELTAS,
        finish_reason="content_filter",
    ),
    Scenario(
        "after_finish",
        "after the finish chunk, more content (AFTER_FINISH_EXTRA), then usage, [DONE]",
        AFTER_FINISH_DELTAS,
        end="after_finish",
    ),
    Scenario(
        "tool_calls",
        "one tool call streamed in pieces, finish_reason `tool_calls`",
        TOOL_CALL_ARGUMENT_DELTAS,
        style="tool_calls",
        finish_reason="tool_calls",
    ),
    Scenario("reset", "3 deltas, then the connection is dropped mid-body", RESET_DELTAS, end="reset"),
    Scenario("stall_first", "headers, then nothing at all until the client hangs up", role_chunk=False, end="stall"),
    Scenario("stall", "role + 2 deltas, then nothing until the client hangs up", STALL_DELTAS, end="stall"),
    Scenario("reset_first", "the role chunk, then the connection drops before any content", end="reset"),
    Scenario(
        "hang",
        "no answer at all, not even headers, streamed or not, until the client hangs up",
        role_chunk=False,
        end="hang",
    ),
    Scenario(
        "malformed",
        '2 deltas, then `data: {"id": "broken", not json`, then the body ends',
        MALFORMED_DELTAS,
        end="malformed",
    ),
    Scenario(
        "odd_shape",
        "2 deltas, then valid JSON of the wrong shape (a delta that is a string), then the end",
        MALFORMED_DELTAS,
        end="odd_shape",
    ),
    Scenario(
        "error_midstream",
        '2 deltas, then a `data: {"error":...}` frame, then the body ends',
        ERROR_MIDSTREAM_DELTAS,
        end="error_midstream",
    ),
    Scenario(
        "cadence",
        "benchmark stream: --deltas words, first after --first-token-ms, then every --interval-ms",
        cadence_deltas(40),
        first_s=0.1,
        interval_s=0.02,
    ),
    Scenario(
        "rate_limited",
        "429 rate_limit_exceeded, retry-after: 1",
        error=_err(
            429,
            "Rate limit reached for {model} in organization org-fakeupstream on requests per min (RPM): "
            "Limit 3, Used 3, Requested 1. Please try again in 1s.",
            "requests",
            "rate_limit_exceeded",
            retry_after_s=1,
        ),
    ),
    Scenario(
        "bad_request",
        "400 invalid_request_error, param `messages`",
        error=_err(400, "Invalid 'messages': scripted bad request.", "invalid_request_error", None, "messages"),
    ),
    Scenario(
        "context_length_exceeded",
        "400 context_length_exceeded, param `messages` (OpenAI's words)",
        error=_err(
            400,
            "This model's maximum context length is 128000 tokens. However, your messages resulted in "
            "130412 tokens. Please reduce the length of the messages.",
            "invalid_request_error",
            "context_length_exceeded",
            "messages",
        ),
    ),
    Scenario(
        "content_policy_violation",
        "400 content_policy_violation (OpenAI's safety system refused the prompt)",
        error=_err(
            400,
            "Your request was rejected as a result of our safety system.",
            "invalid_request_error",
            "content_policy_violation",
        ),
    ),
    Scenario(
        "insufficient_quota",
        "429 insufficient_quota (billing), no retry-after",
        error=_err(
            429,
            "You exceeded your current quota, please check your plan and billing details.",
            "insufficient_quota",
            "insufficient_quota",
        ),
    ),
    Scenario(
        "unauthorized",
        "401 invalid_api_key, message shows the masked key",
        error=_err(
            401,
            "Incorrect API key provided: {key}. You can find your API key at "
            "https://platform.openai.com/account/api-keys.",
            "invalid_request_error",
            "invalid_api_key",
        ),
    ),
    Scenario(
        "forbidden",
        "403 unsupported_country_region_territory",
        error=_err(
            403,
            "Country, region, or territory not supported",
            "request_forbidden",
            "unsupported_country_region_territory",
        ),
    ),
    Scenario(
        "model_not_found",
        "404 model_not_found",
        error=_err(
            404,
            "The model `{model}` does not exist or you do not have access to it.",
            "invalid_request_error",
            "model_not_found",
        ),
    ),
    Scenario(
        "key_in_error_400",
        "400 whose message quotes the request's Authorization (or api-key) header",
        error=_err(400, KEY_IN_ERROR.format(what="Invalid request"), "invalid_request_error"),
    ),
    Scenario(
        "key_in_error_404",
        "404 whose message quotes the request's Authorization (or api-key) header",
        error=_err(404, KEY_IN_ERROR.format(what="Not found"), "invalid_request_error"),
    ),
    Scenario(
        "key_in_error_429",
        "429 whose message quotes the request's Authorization (or api-key) header",
        error=_err(429, KEY_IN_ERROR.format(what="Rate limited"), "requests", "rate_limit_exceeded", retry_after_s=1),
    ),
    Scenario(
        "server_error",
        "500 server_error",
        error=_err(500, "The server had an error while processing your request. Sorry about that!", "server_error"),
    ),
    Scenario(
        "overloaded",
        "503 server_error, retry-after: 1",
        error=_err(503, "The engine is currently overloaded, please try again later", "server_error", retry_after_s=1),
    ),
]
SCENARIOS: dict[str, Scenario] = {s.name: s for s in _LIST}
NAMES = tuple(SCENARIOS)

#: Full content text of each scenario for n=1 (`echo` is `echo_text(...)`; `cadence`
#: is for the default 40 deltas, see `cadence_text(count)`). Errors and stall_first: "".
TEXTS: dict[str, str] = {s.name: s.text for s in _LIST if s.name != "echo"}
#: completion_tokens reported for n=1 (see the module docstring).
COMPLETION_TOKENS: dict[str, int] = {s.name: len(s.deltas) for s in _LIST if s.name != "echo"}


@dataclass(frozen=True)
class Cadence:
    first_token_ms: float = 100
    interval_ms: float = 20
    deltas: int = 40
    delta_chars: int = 0  # 0: the words as they are; else each delta this long (big answers)


def scenarios_with(cadence: Cadence) -> dict[str, Scenario]:
    out = dict(SCENARIOS)
    out["cadence"] = replace(
        SCENARIOS["cadence"],
        deltas=cadence_deltas(cadence.deltas, cadence.delta_chars),
        first_s=cadence.first_token_ms / 1000,
        interval_s=cadence.interval_ms / 1000,
    )
    return out


# ------------------------------------------------------------------------- helpers


def message_text(content: Any) -> str:
    """Text of a message `content` (a string, or a list of {"type": "text", "text": ...} parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def count_prompt_tokens(messages: list) -> int:
    return sum(len(message_text(m.get("content")).split()) for m in messages if isinstance(m, dict))


def mask_key(key: str) -> str:
    """`sk-test-1234abcd` -> `sk-...abcd` (short keys are fully starred)."""
    return f"{key[:3]}...{key[-4:]}" if len(key) >= 8 else "*" * len(key)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


@dataclass
class Request:
    """What a plan depends on, from one chat-completions request."""

    model: str
    n: int = 1
    include_usage: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0  # with `prompt_cache_key`: half the prompt, as if it was cached
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or new_completion_id()
        self.created = self.created or int(time.time())


def usage(req: Request, completion_tokens: int) -> dict:
    body = {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": completion_tokens * req.n,
        "total_tokens": req.prompt_tokens + completion_tokens * req.n,
    }
    if req.cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": req.cached_tokens, "audio_tokens": 0}
    return body


# ------------------------------------------------------------- stream plans (wire)

RESET = object()  # drop the connection here
STALL = object()  # send nothing more, until the client hangs up
HOLD = object()  # send nothing more until POST /_scripted/release (the server's)
DONE = b"data: [DONE]\n\n"

_NULLS = '"logprobs":null,"finish_reason":null}'


@lru_cache(maxsize=8192)
def _content_choice(index: int, text: str) -> bytes:
    return f'{{"index":{index},"delta":{{"content":{_dumps(text)}}},{_NULLS}'.encode()


@lru_cache(maxsize=256)
def _role_choice(index: int) -> bytes:
    delta = '{"role":"assistant","content":"","refusal":null}'
    return f'{{"index":{index},"delta":{delta},{_NULLS}'.encode()


@lru_cache(maxsize=256)
def _finish_choice(index: int, reason: str) -> bytes:
    return f'{{"index":{index},"delta":{{}},"logprobs":null,"finish_reason":{_dumps(reason)}}}'.encode()


def _tool_header_choice(index: int) -> bytes:
    call_id = TOOL_CALL_ID if index == 0 else f"{TOOL_CALL_ID}_{index}"
    call = {"index": 0, "id": call_id, "type": "function", "function": {"name": TOOL_CALL_NAME, "arguments": ""}}
    delta = {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None}
    return _dumps({"index": index, "delta": delta, "logprobs": None, "finish_reason": None}).encode()


@lru_cache(maxsize=256)
def _tool_fragment_choice(index: int, fragment: str) -> bytes:
    delta = {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}
    return _dumps({"index": index, "delta": delta, "logprobs": None, "finish_reason": None}).encode()


class _Frames:
    """Collects timed frames for one OpenAI-shaped stream."""

    def __init__(self, req: Request):
        self.req = req
        head = _dumps(
            {
                "id": req.id,
                "object": "chat.completion.chunk",
                "created": req.created,
                "model": req.model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
            }
        )
        self.prefix = b"data: " + head[:-1].encode() + b',"choices":['
        self.suffix = b'],"usage":null}\n\n' if req.include_usage else b"]}\n\n"
        self.steps: list[tuple[float, Any]] = []

    def add(self, at: float, item: Any) -> None:
        self.steps.append((at, item))

    def chunk(self, at: float, choice: bytes) -> None:
        self.add(at, self.prefix + choice + self.suffix)

    def usage_chunk(self, at: float, completion_tokens: int) -> None:
        if self.req.include_usage:
            tail = b'],"usage":' + _dumps(usage(self.req, completion_tokens)).encode() + b"}\n\n"
            self.add(at, self.prefix + tail)


def stream_plan(scn: Scenario, req: Request, deltas: tuple[str, ...] | None = None) -> list[tuple[float, Any]]:
    """The timed frames of one streamed response. `deltas` overrides the scenario's (echo)."""
    deltas = scn.deltas if deltas is None else deltas
    if scn.style == "azure":
        steps = _azure_plan(scn, req, deltas)
    else:
        steps = _openai_plan(scn, req, deltas)
    if scn.split_writes:
        steps = _split_inside_characters(b"".join(item for _, item in steps))
    return _coalesce(steps)


def _openai_plan(scn: Scenario, req: Request, deltas: tuple[str, ...]) -> list[tuple[float, Any]]:
    f, n = _Frames(req), req.n
    tools = scn.style == "tool_calls"
    if scn.role_chunk:
        for i in range(n):
            f.chunk(0.0, _tool_header_choice(i) if tools else _role_choice(i))
    if scn.held:
        f.add(0.0, HOLD)
    per_choice = [_choice_deltas(deltas, i) for i in range(n)]
    t = 0.0
    for k in range(len(deltas)):
        t = scn.first_s + k * scn.interval_s
        for i in range(n):
            f.chunk(t, _tool_fragment_choice(i, deltas[k]) if tools else _content_choice(i, per_choice[i][k]))
    later = t + scn.interval_s
    if scn.end == "reset":
        f.add(later, RESET)
    elif scn.end == "stall":
        f.add(later, STALL)
    elif scn.end == "malformed":
        f.add(later, MALFORMED_LINE)
    elif scn.end == "odd_shape":
        f.add(later, ODD_SHAPE_LINE)
    elif scn.end == "error_midstream":
        f.add(later, b"data: " + _dumps(MIDSTREAM_ERROR).encode() + b"\n\n")
    elif scn.end == "error_4xx":
        f.add(later, b"data: " + _dumps(MIDSTREAM_ERROR_4XX).encode() + b"\n\n")
    else:
        for i in range(n):
            f.chunk(t, _finish_choice(i, scn.finish_reason))
        if scn.end == "after_finish":
            for k, extra in enumerate(AFTER_FINISH_EXTRA_DELTAS):
                for i in range(n):
                    f.chunk(later + k * scn.interval_s, _content_choice(i, extra))
            t = later + len(AFTER_FINISH_EXTRA_DELTAS) * scn.interval_s
        f.usage_chunk(t, len(deltas))
        f.add(t, DONE)
    return f.steps


# Azure OpenAI's content-safety annotations (all "safe").
_SAFE = {"filtered": False, "severity": "safe"}
AZURE_CONTENT_FILTER_RESULTS = {"hate": _SAFE, "self_harm": _SAFE, "sexual": _SAFE, "violence": _SAFE}
AZURE_PROMPT_FILTER_RESULTS = [
    {
        "prompt_index": 0,
        "content_filter_results": {**AZURE_CONTENT_FILTER_RESULTS, "jailbreak": {"filtered": False, "detected": False}},
    }
]


def _azure_plan(scn: Scenario, req: Request, deltas: tuple[str, ...]) -> list[tuple[float, Any]]:
    """Azure's frames, keys in Azure's (alphabetical) order; not on the benchmark's hot path."""
    steps: list[tuple[float, Any]] = []
    extra = {"usage": None} if req.include_usage else {}
    anon = {"created": 0, "id": "", "model": "", "object": ""}  # Azure's id-less frames
    real = {
        "created": req.created,
        "id": req.id,
        "model": req.model,
        "object": "chat.completion.chunk",
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }

    def frame(at: float, choices: list, base: dict, **more: Any) -> None:
        obj = {"choices": choices, **base, **more, **extra}
        steps.append(
            (
                at,
                b"data: "
                + json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()
                + b"\n\n",
            )
        )

    def choice(i: int, delta: dict, finish: str | None = None, results: dict | None = None) -> dict:
        return {
            "content_filter_results": {} if results is None else results,
            "delta": delta,
            "finish_reason": finish,
            "index": i,
            "logprobs": None,
        }

    n = req.n
    frame(0.0, [], anon, prompt_filter_results=AZURE_PROMPT_FILTER_RESULTS)
    for i in range(n):
        frame(0.0, [choice(i, {"content": "", "refusal": None, "role": "assistant"})], real)
    per_choice = [_choice_deltas(deltas, i) for i in range(n)]
    t = 0.0
    for k in range(len(deltas)):
        t = scn.first_s + k * scn.interval_s
        for i in range(n):
            frame(t, [choice(i, {"content": per_choice[i][k]}, results=AZURE_CONTENT_FILTER_RESULTS)], real)
    for i in range(n):
        frame(t, [choice(i, {}, scn.finish_reason)], real)
    for i in range(n):
        size = len("".join(per_choice[i]))
        frame(
            t,
            [
                {
                    "content_filter_offsets": {"check_offset": 0, "start_offset": 0, "end_offset": size},
                    "content_filter_results": AZURE_CONTENT_FILTER_RESULTS,
                    "delta": {},
                    "finish_reason": None,
                    "index": i,
                }
            ],
            anon,
        )
    frame(t, [], anon)
    if req.include_usage:
        obj = {"choices": [], **real, "usage": usage(req, len(deltas))}
        steps.append((t, b"data: " + _dumps(dict(sorted(obj.items()))).encode() + b"\n\n"))
    steps.append((t, DONE))
    return steps


def _split_inside_characters(stream: bytes) -> list[tuple[float, Any]]:
    """Cut each frame inside `data:` and inside its first multi-byte UTF-8 character."""
    cuts = set()
    pos = stream.find(b"data: ")
    while pos != -1:
        end = stream.find(b"\n\n", pos)
        cuts.add(pos + 3)  # b"dat" | b"a: ..."
        for j in range(pos, end):
            if stream[j] >= 0xC0:  # lead byte of a multi-byte character
                cuts.add(j + 1)
                break
        pos = stream.find(b"data: ", end)
    return split_at(stream, cuts)


def split_at(stream: bytes, cuts: set[int]) -> list[tuple[float, Any]]:
    """``stream`` cut at ``cuts`` into writes ``SPLIT_WRITE_GAP_S`` apart."""
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(stream)), len(stream)]
    pieces = [stream[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    return [(k * SPLIT_WRITE_GAP_S, piece) for k, piece in enumerate(pieces)]


def _coalesce(steps: list[tuple[float, Any]]) -> list[tuple[float, Any]]:
    """Join consecutive byte frames due at the same instant into one write."""
    out: list[tuple[float, Any]] = []
    for at, item in steps:
        if out and isinstance(item, bytes) and isinstance(out[-1][1], bytes) and out[-1][0] == at:
            out[-1] = (at, out[-1][1] + item)
        else:
            out.append((at, item))
    return out


# ------------------------------------------------- failures mid-answer, and going on after one

FAILURE_ENDS = ("reset", "stall", "error_midstream", "error_4xx", "malformed")
CONTINUE_MODES = ("restart", "tail", "exact")


@dataclass(frozen=True)
class Failure:
    """Streamed chat answers are cut after ``after`` deltas (text or tool-call fragments), or after
    ``chars`` characters of text (a chat answer's; the delta at the cut is split), and end as ``end``
    does in the scenario table (``error_4xx``: an error event shaped like a 400); the next ``times``
    of them (None: every one)."""

    after: int
    end: str = "reset"
    times: int | None = None
    chars: int | None = None

    @classmethod
    def parse(cls, data: Any) -> Failure | None:
        if not data or not isinstance(data, dict):
            return None
        after, end, times, chars = data.get("after"), data.get("end", "reset"), data.get("times"), data.get("chars")
        if chars is not None:
            if not isinstance(chars, int) or isinstance(chars, bool) or chars < 0 or after is not None:
                raise ValueError("'chars' must be a whole number of characters, 0 or more, instead of 'after'")
            after = 0
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise ValueError("'after' must be a whole number of deltas, 0 or more")
        if end not in FAILURE_ENDS:
            raise ValueError(f"'end' must be one of {', '.join(FAILURE_ENDS)}")
        if times is not None and (not isinstance(times, int) or isinstance(times, bool) or times < 1):
            raise ValueError("'times' must be a whole number of answers, 1 or more, or null")
        return cls(after, end, times, chars)

    def as_dict(self) -> dict:
        if self.chars is not None:
            return {"chars": self.chars, "end": self.end, "times": self.times}
        return {"after": self.after, "end": self.end, "times": self.times}

    def spent(self) -> Failure | None:
        """What is left of it once it cut one more answer."""
        if self.times is None:
            return self
        return replace(self, times=self.times - 1) if self.times > 1 else None

    def applied(self, scn: Scenario, deltas: tuple[str, ...]) -> tuple[Scenario, tuple[str, ...]]:
        if self.chars is None:
            return replace(scn, end=self.end), deltas[: self.after]
        kept, left = [], self.chars
        for delta in deltas:
            if left <= 0:
                break
            kept.append(delta[:left])
            left -= len(kept[-1])
        return replace(scn, end=self.end), tuple(kept)


@dataclass(frozen=True)
class GoingOn:
    """A request to go on with an answer: the conversation before it (``history``), the answer so far
    (``partial``, all of it when the scenario failed after its whole text), the deltas of the whole
    answer as this server gives it (``full``), and whether it asked for the rest exactly
    (``continue_final_message``)."""

    history: list
    partial: str
    full: tuple[str, ...]
    exact: bool


def continuation_of(body: dict, answer: Any) -> GoingOn | None:
    """Whether ``body`` asks to go on with an answer: its last message is the assistant's, or the
    assistant's followed by one user message (a chat model told to go on), and that assistant text is
    the start of what this server answers the conversation before it with (``answer(history)``: the
    deltas). None: an ordinary request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    if messages[-1].get("role") == "assistant":
        history, partial = messages[:-1], message_text(messages[-1].get("content"))
        exact = body.get("continue_final_message") is True
    elif (
        messages[-1].get("role") == "user"
        and len(messages) >= 2
        and isinstance(messages[-2], dict)
        and messages[-2].get("role") == "assistant"
        # A user message naming a scenario is a conversation's next turn, not a request to go on.
        and not re.search(r"\[scenario:", message_text(messages[-1].get("content")))
    ):
        history, partial, exact = messages[:-2], message_text(messages[-2].get("content")), False
    else:
        return None
    full = tuple(answer(history))
    whole = "".join(full)
    if not partial or not whole.startswith(partial):
        return None
    return GoingOn(history, partial, full, exact)


@dataclass(frozen=True)
class ContinueMode:
    """How a request to go on is answered (``POST /_scripted/continuation``): ``restart`` from the
    beginning (what chat models asked to go on often do), repeat the last ``tail`` characters of the
    answer so far and go on (``tail``), or the rest only (``exact``, always with
    ``continue_final_message``); ``lead``: whitespace sent first (a restart on a new line: ``"\n"``).
    ``prefix``: accept vLLM's ``continue_final_message`` and ``add_generation_prompt`` (OpenAI answers
    them with a 400). The deltas are cut at word bounds, not where the first answer's were."""

    mode: str = "restart"
    tail: int = 20
    prefix: bool = False
    lead: str = ""

    @classmethod
    def parse(cls, data: Any) -> ContinueMode:
        data = data if isinstance(data, dict) else {}
        mode, tail, prefix = data.get("mode", "restart"), data.get("tail", 20), data.get("prefix", False)
        lead = data.get("lead", "")
        if mode not in CONTINUE_MODES:
            raise ValueError(f"'mode' must be one of {', '.join(CONTINUE_MODES)}")
        if not isinstance(tail, int) or isinstance(tail, bool) or tail < 1:
            raise ValueError("'tail' must be a whole number of characters, 1 or more")
        if not isinstance(prefix, bool):
            raise ValueError("'prefix' must be true or false")
        if not isinstance(lead, str) or lead.strip():
            raise ValueError("'lead' must be whitespace")
        return cls(mode, tail, prefix, lead)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "tail": self.tail, "prefix": self.prefix, "lead": self.lead}

    def deltas(self, going: GoingOn) -> tuple[str, ...]:
        whole = "".join(going.full)
        rest = whole[len(going.partial) :]
        if going.exact or self.mode == "exact":
            return word_deltas(rest)
        if self.mode == "tail":
            return word_deltas(self.lead + going.partial[-self.tail :] + rest)
        return word_deltas(self.lead + whole)


# ------------------------------------------------------------ non-streaming bodies


def completion_body(scn: Scenario, req: Request, deltas: tuple[str, ...] | None = None) -> dict:
    """A full `chat.completion` object with the scenario's whole text."""
    deltas = scn.deltas if deltas is None else deltas
    choices = []
    for i in range(req.n):
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(_choice_deltas(deltas, i)),
            "refusal": None,
            "annotations": [],
        }
        if scn.style == "tool_calls":
            call_id = TOOL_CALL_ID if i == 0 else f"{TOOL_CALL_ID}_{i}"
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": TOOL_CALL_NAME, "arguments": TOOL_CALL_ARGUMENTS},
                }
            ]
        choice = {"index": i, "message": message, "logprobs": None, "finish_reason": scn.finish_reason}
        if scn.style == "azure":
            choice["content_filter_results"] = AZURE_CONTENT_FILTER_RESULTS
        choices.append(choice)
    body = {
        "id": req.id,
        "object": "chat.completion",
        "created": req.created,
        "model": req.model,
        "choices": choices,
        "usage": usage(req, len(deltas)),
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    if scn.style == "azure":
        body["prompt_filter_results"] = AZURE_PROMPT_FILTER_RESULTS
    return body
