"""OpenAI's Responses API (`/v1/responses`, Azure's `/openai/v1/responses`) for the scripted server.

Kept apart from the chat-completions code: its own scenario table, its own event
scripts, and a store of responses for retrieve / cancel / delete / input_items.
`server.FakeUpstream` only routes matching requests here (`ResponsesApi.route`).

A scenario becomes a *script*: `(seconds_after_start, event | RESET | STALL)` steps,
where an event is a dict `{"type", "sequence_number", ...}`. Sequence numbers start
at 0 and go up by one per event. A streamed request plays the script as
`event: <type>\\ndata: <compact JSON>\\n\\n` frames; a non-streamed request gets the
response object the script ends with; a `background` request plays the script
into a stored run that streams can follow (`GET /v1/responses/{id}?stream=true`).

Token counting (deterministic, no tokenizer), as for chat:
  * input_tokens = whitespace-separated words in `instructions` and all input text, plus the
    previous response's total_tokens when the request names one (`previous_response_id`);
  * output_tokens = text deltas + function-argument deltas + reasoning-summary
    deltas; reasoning_tokens = the reasoning-summary deltas.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import re
import secrets
import string
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from . import scenarios as sc
from .scenarios import RESET, STALL, Cadence, HttpError
from .wire import ApiError, invalid, marked, play, send_json, timed

# --------------------------------------------------------------------------- texts

REASONING_SUMMARY_DELTAS = (
    "**Weighing the answer**\n\n",
    "The user asked ",
    "something simple; ",
    "a short, friendly reply ",
    "will do — with 🙂 and 日本語.",
)
REASONING_SUMMARY = "".join(REASONING_SUMMARY_DELTAS)
REASONING_ANSWER_DELTAS = ("After some thought: ", "the answer ", "is 42. ", "🙂")
AUDIO_CHUNK = "UklGRiQAAABXQVZFZm10IBAAAAABAAEA"  # base64 of a few bytes of a WAV header
AUDIO_TRANSCRIPT_DELTAS = ("Spoken: ", "the scripted ", "answer, ", "out loud.")

FUNCTION_CALL_ID = sc.TOOL_CALL_ID
FUNCTION_CALL_NAME = sc.TOOL_CALL_NAME
FUNCTION_CALL_ARGUMENT_DELTAS = sc.TOOL_CALL_ARGUMENT_DELTAS
FUNCTION_CALL_ARGUMENTS = sc.TOOL_CALL_ARGUMENTS

#: `response.error` of the `failed` scenario (the API reference's example error).
FAILED_ERROR = {"code": "server_error", "message": "The model failed to generate a response."}
ERROR_EVENT_MESSAGE = "The server had an error while processing your request. Sorry about that!"
#: Reason given by the `incomplete` scenario.
INCOMPLETE_DETAILS = {"reason": "max_output_tokens"}

QUEUED_S = 0.05  # background responses stay `queued` this long before `response.in_progress`
SPLIT_WRITE_GAP_S = sc.SPLIT_WRITE_GAP_S

# --------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class ResponsesScenario:
    name: str
    summary: str
    deltas: tuple[str, ...] = ()  # output text deltas (function_call: argument fragments)
    first_s: float = 0.01  # first delta, after the opening events at 0
    interval_s: float = 0.01
    # "message" | "function_call" | "reasoning" (a reasoning item with a summary, then a message) |
    # "audio" (audio chunks and their transcript: response.audio.delta / .transcript.delta)
    kind: str = "message"
    # How it ends: "completed", "incomplete" (response.incomplete), "failed" (response.failed),
    # "error_event" / "error_event_nested" (an `error` event), "reset" (drop the connection),
    # "stall" (silence until the client hangs up).
    end: str = "completed"
    opening: bool = True  # False: no event at all (stall_first)
    items: bool = True  # False: the opening events only, then the end (reset_first)
    split_writes: bool = False
    error: HttpError | None = None

    @property
    def text(self) -> str:
        return "" if self.kind == "function_call" else "".join(self.deltas)


_RS = ResponsesScenario
_CHAT = sc.SCENARIOS

_LIST = [
    _RS("echo", "`You said: <last user input text>` in word deltas, 30 ms apart", first_s=0.03, interval_s=0.03),
    _RS("normal", "chat's `normal` text: blank lines, quotes, emoji, CJK; 10 deltas 10 ms apart", sc.NORMAL_DELTAS),
    _RS(
        "slow", "10 deltas, 200 ms apart, first after 200 ms (2 s in all)", sc.SLOW_DELTAS, first_s=0.2, interval_s=0.2
    ),
    _RS(
        "split_utf8",
        "network writes cut inside `event:`, between the event and data lines, and inside "
        "UTF-8 characters, 20 ms apart",
        sc.SPLIT_UTF8_DELTAS,
        split_writes=True,
    ),
    _RS(
        "cadence",
        "benchmark stream: --deltas words, first after --first-token-ms, then every --interval-ms",
        sc.cadence_deltas(40),
        first_s=0.1,
        interval_s=0.02,
    ),
    _RS(
        "function_call",
        "one `function_call` item (get_weather), arguments streamed in 10 pieces",
        FUNCTION_CALL_ARGUMENT_DELTAS,
        kind="function_call",
    ),
    _RS(
        "reasoning",
        "a `reasoning` item whose summary is streamed, then the message",
        REASONING_ANSWER_DELTAS,
        kind="reasoning",
    ),
    _RS(
        "audio",
        "a spoken answer: response.audio.delta chunks, each with its response.audio.transcript.delta",
        AUDIO_TRANSCRIPT_DELTAS,
        kind="audio",
    ),
    _RS(
        "incomplete",
        "text cut mid-word, then `response.incomplete` (reason max_output_tokens)",
        sc.LENGTH_DELTAS,
        end="incomplete",
    ),
    _RS(
        "failed",
        "2 deltas, then `response.failed` with `response.error` (server_error)",
        sc.ERROR_MIDSTREAM_DELTAS,
        end="failed",
    ),
    _RS(
        "error_event",
        "2 deltas, then an `error` event as documented (code/message/param at the top)",
        sc.ERROR_MIDSTREAM_DELTAS,
        end="error_event",
    ),
    _RS(
        "error_event_nested",
        "2 deltas, then an `error` event as seen in the wild (an `error` object inside)",
        sc.ERROR_MIDSTREAM_DELTAS,
        end="error_event_nested",
    ),
    _RS("reset", "3 deltas, then the connection is dropped mid-body", sc.RESET_DELTAS, end="reset"),
    _RS("stall_first", "headers, then nothing at all until the client hangs up", opening=False, end="stall"),
    _RS("stall", "opening events + 2 deltas, then nothing until the client hangs up", sc.STALL_DELTAS, end="stall"),
    _RS("reset_first", "the opening events, then the connection drops before any output", end="reset", items=False),
    _RS("hang", "no answer at all, not even headers, streamed or not, until the client hangs up", end="hang"),
    _RS("rate_limited", "429 rate_limit_exceeded, retry-after: 1", error=_CHAT["rate_limited"].error),
    *(
        _RS(name, _CHAT[name].summary, error=_CHAT[name].error)
        for name in ("key_in_error_400", "key_in_error_404", "key_in_error_429")
    ),
    _RS(
        "bad_request",
        "400 invalid_request_error, param `input`",
        error=replace(_CHAT["bad_request"].error, message="Invalid 'input': scripted bad request.", param="input"),
    ),
    _RS(
        "context_length_exceeded",
        "400 context_length_exceeded, param `input`",
        error=replace(_CHAT["context_length_exceeded"].error, param="input"),
    ),
    *(
        _RS(name, _CHAT[name].summary, error=_CHAT[name].error)
        for name in ("content_policy_violation", "insufficient_quota")
    ),
    _RS("unauthorized", "401 invalid_api_key, message shows the masked key", error=_CHAT["unauthorized"].error),
    _RS("model_not_found", "404 model_not_found", error=_CHAT["model_not_found"].error),
    _RS("server_error", "500 server_error", error=_CHAT["server_error"].error),
    _RS("overloaded", "503 server_error, retry-after: 1", error=_CHAT["overloaded"].error),
]
RESPONSES_SCENARIOS: dict[str, ResponsesScenario] = {s.name: s for s in _LIST}
RESPONSES_NAMES = tuple(RESPONSES_SCENARIOS)

#: The full `output_text` each scenario sends (for failures: what is sent before the failure).
#: `echo` is `scenarios.echo_text(...)`; `cadence` is for the default 40 deltas. Errors: "".
RESPONSES_TEXTS: dict[str, str] = {s.name: s.text for s in _LIST if s.name != "echo"}
#: usage.output_tokens and usage.output_tokens_details.reasoning_tokens of a finished response.
RESPONSES_REASONING_TOKENS: dict[str, int] = {
    s.name: len(REASONING_SUMMARY_DELTAS) if s.kind == "reasoning" else 0 for s in _LIST if s.name != "echo"
}
RESPONSES_OUTPUT_TOKENS: dict[str, int] = {
    s.name: len(s.deltas) + RESPONSES_REASONING_TOKENS[s.name] for s in _LIST if s.name != "echo"
}


def responses_scenarios_with(cadence: Cadence) -> dict[str, ResponsesScenario]:
    out = dict(RESPONSES_SCENARIOS)
    out["cadence"] = replace(
        out["cadence"],
        deltas=sc.cadence_deltas(cadence.deltas, cadence.delta_chars),
        first_s=cadence.first_token_ms / 1000,
        interval_s=cadence.interval_ms / 1000,
    )
    return out


# ------------------------------------------------------------------------ input

#: The create parameters OpenAI knows: CreateResponse in its published OpenAPI spec, plus the ones the
#: `openai` SDK (3.x) sends beyond it. Any other top-level field is a 400 `unknown_parameter`.
KNOWN_RESPONSES_PARAMS = frozenset(
    {
        "background",
        "context_management",
        "conversation",
        "include",
        "input",
        "instructions",
        "max_output_tokens",
        "max_tool_calls",
        "metadata",
        "model",
        "moderation",
        "parallel_tool_calls",
        "previous_response_id",
        "prompt",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning",
        "safety_identifier",
        "service_tier",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "truncation",
        "user",
        "access_programs",
        "background_options",
        "image",  # in the SDK's ResponseCreateParams
    }
)


def last_user_text(input_: Any) -> str:
    """The text the `echo` scenario and `[scenario:NAME]` markers look at: a string input, or
    the last `role: user` message of an input list."""
    if isinstance(input_, str):
        return input_
    if isinstance(input_, list):
        for item in reversed(input_):
            if isinstance(item, dict) and item.get("role") == "user":
                return sc.message_text(item.get("content"))
    return ""


def count_input_tokens(input_: Any, instructions: Any = None) -> int:
    words = len(instructions.split()) if isinstance(instructions, str) else 0
    if isinstance(input_, str):
        return words + len(input_.split())
    for item in input_ if isinstance(input_, list) else ():
        if isinstance(item, dict):
            words += len(sc.message_text(item.get("content")).split())
    return words


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(25)


def input_items(input_: Any) -> list[dict]:
    """The input as `GET /v1/responses/{id}/input_items` lists it (each item gets an id)."""
    raw = [{"role": "user", "content": input_}] if isinstance(input_, str) else input_ or []
    items = []
    for item in raw:
        if not isinstance(item, dict):
            continue
        if "role" in item and item.get("type", "message") == "message":
            content = item.get("content")
            if isinstance(content, str):
                kind = "output_text" if item["role"] == "assistant" else "input_text"
                content = [{"type": kind, "text": content, **({"annotations": []} if kind == "output_text" else {})}]
            items.append(
                {
                    "id": item.get("id") or _new_id("msg_"),
                    "type": "message",
                    "role": item["role"],
                    "content": content,
                    "status": item.get("status", "completed"),
                }
            )
        else:
            items.append({"id": _new_id("item_"), **item} if "id" not in item else dict(item))
    return items


# ------------------------------------------------------------------- the objects


@dataclass
class Context:
    """What a script depends on, from one create request."""

    model: str
    body: dict
    input_tokens: int = 0
    background: bool = False
    id: str = field(default_factory=lambda: _new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list | None = None,
        *,
        usage: dict | None = None,
        error: dict | None = None,
        incomplete_details: dict | None = None,
        completed_at: int | None = None,
    ) -> dict:
        """A `response` object, in the field order the API sends (request parameters echoed)."""
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": self.background,
            "completed_at": completed_at,
            "error": error,
            "incomplete_details": incomplete_details,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "max_tool_calls": b.get("max_tool_calls"),
            "model": self.model,
            "output": output if output is not None else [],
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "prompt_cache_key": b.get("prompt_cache_key"),
            "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
            "safety_identifier": b.get("safety_identifier"),
            "service_tier": b.get("service_tier") or "default",
            "store": b.get("store", True),
            "temperature": b.get("temperature", 1.0),
            "text": b.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "top_logprobs": b.get("top_logprobs", 0),
            "top_p": b.get("top_p", 1.0),
            "truncation": b.get("truncation", "disabled"),
            "usage": usage,
            "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }

    def usage(self, output_tokens: int, reasoning_tokens: int) -> dict:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": self.input_tokens + output_tokens,
        }


def _message_item(item_id: str, status: str, text: str | None) -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "status": status, "content": content, "role": "assistant"}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def _function_item(item_id: str, status: str, arguments: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "arguments": arguments,
        "call_id": FUNCTION_CALL_ID,
        "name": FUNCTION_CALL_NAME,
    }


def _reasoning_item(item_id: str, summary: str | None) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [] if summary is None else [{"type": "summary_text", "text": summary}],
    }


# ---------------------------------------------------------------------- scripts

TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
STREAM_ONLY_ENDS = ("error_event", "error_event_nested", "reset", "stall")


class _Script:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.steps: list[tuple[float, Any]] = []
        self.output: list[dict] = []  # items as they are when done
        self.output_tokens = 0
        self.reasoning_tokens = 0

    def emit(self, at: float, type_: str, **fields: Any) -> None:
        self.steps.append((at, {"type": type_, "sequence_number": len(self.steps), **fields}))

    def add(self, at: float, item: Any) -> None:  # RESET / STALL (no sequence number)
        self.steps.append((at, item))


def script(
    scn: ResponsesScenario, ctx: Context, deltas: tuple[str, ...] | None = None, end: str | None = None
) -> list[tuple[float, Any]]:
    """The timed events of one response. `deltas` overrides the scenario's (echo), `end` its ending."""
    deltas = scn.deltas if deltas is None else deltas
    end = end or scn.end
    s = _Script(ctx)
    if not scn.opening and end in STREAM_ONLY_ENDS:
        s.add(0.0, STALL)
        return s.steps
    t = 0.0
    if ctx.background:
        s.emit(0.0, "response.created", response=ctx.response("queued"))
        s.emit(0.0, "response.queued", response=ctx.response("queued"))
        t = QUEUED_S
    else:
        s.emit(0.0, "response.created", response=ctx.response("in_progress"))
    s.emit(t, "response.in_progress", response=ctx.response("in_progress"))
    if not scn.items:
        s.add(t + scn.interval_s, RESET if end == "reset" else STALL)
        return s.steps

    clock = iter(t + scn.first_s + k * scn.interval_s for k in range(10**9))
    last = t
    partial: list[dict] = []  # the output as it stands when a failure interrupts it
    if scn.kind == "reasoning":
        rs_id = _new_id("rs_")
        index = len(s.output)
        s.emit(t, "response.output_item.added", output_index=index, item=_reasoning_item(rs_id, None))
        s.emit(
            t,
            "response.reasoning_summary_part.added",
            item_id=rs_id,
            output_index=index,
            summary_index=0,
            part={"type": "summary_text", "text": ""},
        )
        for piece in REASONING_SUMMARY_DELTAS:
            last = next(clock)
            s.emit(
                last,
                "response.reasoning_summary_text.delta",
                item_id=rs_id,
                output_index=index,
                summary_index=0,
                delta=piece,
            )
        s.emit(
            last,
            "response.reasoning_summary_text.done",
            item_id=rs_id,
            output_index=index,
            summary_index=0,
            text=REASONING_SUMMARY,
        )
        s.emit(
            last,
            "response.reasoning_summary_part.done",
            item_id=rs_id,
            output_index=index,
            summary_index=0,
            part={"type": "summary_text", "text": REASONING_SUMMARY},
        )
        item = _reasoning_item(rs_id, REASONING_SUMMARY)
        s.emit(last, "response.output_item.done", output_index=index, item=item)
        s.output.append(item)
        s.output_tokens += len(REASONING_SUMMARY_DELTAS)
        s.reasoning_tokens += len(REASONING_SUMMARY_DELTAS)
        t = last

    index = len(s.output)
    if scn.kind == "audio":
        return _audio(s, scn, ctx, t, index, deltas, clock)
    if scn.kind == "function_call":
        fc_id = _new_id("fc_")
        s.emit(t, "response.output_item.added", output_index=index, item=_function_item(fc_id, "in_progress", ""))
        for piece in deltas:
            last = next(clock)
            s.emit(last, "response.function_call_arguments.delta", item_id=fc_id, output_index=index, delta=piece)
        arguments = "".join(deltas)
        partial = [*s.output, _function_item(fc_id, "in_progress", arguments)]
        done_events = [
            (
                "response.function_call_arguments.done",
                {"item_id": fc_id, "name": FUNCTION_CALL_NAME, "output_index": index, "arguments": arguments},
            ),
        ]
        final_item = _function_item(fc_id, "completed", arguments)
    else:
        msg_id = _new_id("msg_")
        s.emit(t, "response.output_item.added", output_index=index, item=_message_item(msg_id, "in_progress", None))
        s.emit(
            t, "response.content_part.added", item_id=msg_id, output_index=index, content_index=0, part=_text_part("")
        )
        for piece in deltas:
            last = next(clock)
            s.emit(
                last,
                "response.output_text.delta",
                item_id=msg_id,
                output_index=index,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        text = "".join(deltas)
        partial = [*s.output, _message_item(msg_id, "in_progress", text)]
        where = {"item_id": msg_id, "output_index": index, "content_index": 0}
        done_events = [
            ("response.output_text.done", {**where, "text": text, "logprobs": []}),
            ("response.content_part.done", {**where, "part": _text_part(text)}),
        ]
        final_item = _message_item(msg_id, "incomplete" if end == "incomplete" else "completed", text)
    s.output_tokens += len(deltas)

    later = last + scn.interval_s
    if end in ("completed", "incomplete"):
        for type_, fields in done_events:
            s.emit(last, type_, **fields)
        s.emit(last, "response.output_item.done", output_index=index, item=final_item)
        s.output.append(final_item)
        usage = ctx.usage(s.output_tokens, s.reasoning_tokens)
        done_at = ctx.created_at + round(last)
        if end == "completed":
            s.emit(
                last,
                "response.completed",
                response=ctx.response("completed", s.output, usage=usage, completed_at=done_at),
            )
        else:
            s.emit(
                last,
                "response.incomplete",
                response=ctx.response("incomplete", s.output, usage=usage, incomplete_details=INCOMPLETE_DETAILS),
            )
    elif end == "failed":
        s.emit(later, "response.failed", response=ctx.response("failed", partial, error=dict(FAILED_ERROR)))
    elif end == "error_event":
        s.emit(later, "error", code="server_error", message=ERROR_EVENT_MESSAGE, param=None)
    elif end == "error_event_nested":
        s.emit(
            later,
            "error",
            error={"type": "server_error", "code": "server_error", "message": ERROR_EVENT_MESSAGE, "param": None},
        )
    elif end == "reset":
        s.add(later, RESET)
    else:  # stall
        s.add(later, STALL)
    return s.steps


def _audio(
    s: _Script, scn: ResponsesScenario, ctx: Context, t: float, index: int, deltas: tuple[str, ...], clock
) -> list[tuple[float, Any]]:
    """A spoken answer: audio chunks with their transcript (`response.audio.transcript.delta`). As in
    the API's types, the transcript is in those events only: no output item carries it."""
    msg_id = _new_id("msg_")
    s.emit(t, "response.output_item.added", output_index=index, item=_message_item(msg_id, "in_progress", None))
    last = t
    for piece in deltas:
        last = next(clock)
        s.emit(last, "response.audio.delta", delta=AUDIO_CHUNK)
        s.emit(last, "response.audio.transcript.delta", delta=piece)
    s.emit(last, "response.audio.done")
    s.emit(last, "response.audio.transcript.done")
    item = {**_message_item(msg_id, "completed", None)}
    s.emit(last, "response.output_item.done", output_index=index, item=item)
    s.output.append(item)
    s.output_tokens += len(deltas)
    s.emit(
        last,
        "response.completed",
        response=ctx.response(
            "completed", s.output, usage=ctx.usage(s.output_tokens, 0), completed_at=ctx.created_at + round(last)
        ),
    )
    return s.steps


def apply(snapshot: dict, event: dict) -> dict:
    """The response object after one more event (what `GET /v1/responses/{id}` shows mid-way)."""
    type_ = event["type"]
    if "response" in event:
        return copy.deepcopy(event["response"])
    out = snapshot["output"]
    if type_ == "response.output_item.added":
        out.append(copy.deepcopy(event["item"]))
    elif type_ == "response.output_item.done":
        out[event["output_index"]] = copy.deepcopy(event["item"])
    elif type_ == "response.content_part.added":
        out[event["output_index"]]["content"].append(copy.deepcopy(event["part"]))
    elif type_ == "response.output_text.delta":
        out[event["output_index"]]["content"][event["content_index"]]["text"] += event["delta"]
    elif type_ == "response.function_call_arguments.delta":
        out[event["output_index"]]["arguments"] += event["delta"]
    elif type_ == "response.reasoning_summary_part.added":
        out[event["output_index"]]["summary"].append(copy.deepcopy(event["part"]))
    elif type_ == "response.reasoning_summary_text.delta":
        out[event["output_index"]]["summary"][event["summary_index"]]["text"] += event["delta"]
    elif type_ == "error":
        err = event.get("error") or event
        snapshot["status"] = "failed"
        snapshot["error"] = {"code": err.get("code"), "message": err.get("message")}
    return snapshot


def final_response(steps: list[tuple[float, Any]], start: dict) -> dict:
    snapshot = copy.deepcopy(start)
    for _, event in steps:
        if isinstance(event, dict):
            snapshot = apply(snapshot, event)
    return snapshot


# ------------------------------------------------------------------- the wire

_DELTAS = (
    "response.output_text.delta",
    "response.function_call_arguments.delta",
    "response.reasoning_summary_text.delta",
)
_PAD = string.ascii_letters + string.digits
_random = random.Random()


def obfuscation(delta: str) -> str:
    """Random padding, as OpenAI adds to delta events unless `include_obfuscation` is false."""
    return "".join(_random.choices(_PAD, k=1 + (-len(delta.encode())) % 16))


def frame(event: dict, obfuscate: bool) -> bytes:
    if obfuscate and event["type"] in _DELTAS:
        event = {**event, "obfuscation": obfuscation(event["delta"])}
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def wire_plan(steps: list[tuple[float, Any]], obfuscate: bool, split: bool) -> list[tuple[float, Any]]:
    """Timed byte writes: events due at the same instant go out in one write."""
    out: list[tuple[float, Any]] = []
    for at, item in steps:
        data = frame(item, obfuscate) if isinstance(item, dict) else item
        if out and isinstance(data, bytes) and isinstance(out[-1][1], bytes) and out[-1][0] == at:
            out[-1] = (at, out[-1][1] + data)
        else:
            out.append((at, data))
    if split:
        tail = [step for step in out if not isinstance(step[1], bytes)]
        out = _split_writes(b"".join(item for _, item in out if isinstance(item, bytes)))
        out += [(out[-1][0] + SPLIT_WRITE_GAP_S, item) for _, item in tail]
    return out


def _split_writes(stream: bytes) -> list[tuple[float, Any]]:
    """Cut each event inside `event:`, between its two lines, and inside its first multi-byte character."""
    cuts = set()
    pos = stream.find(b"event: ")
    while pos != -1:
        end = stream.find(b"\n\n", pos)
        data = stream.find(b"\ndata: ", pos) + 1
        cuts.update((pos + 3, data))  # b"eve" | b"nt: x\n" | b"data: ..."
        for j in range(data, end):
            if stream[j] >= 0xC0:  # lead byte of a multi-byte character
                cuts.add(j + 1)
                break
        pos = stream.find(b"event: ", end)
    return sc.split_at(stream, cuts)


# ------------------------------------------------------------------ stored runs


class Run:
    """A stored response. Background runs generate their events in a task; streams follow them."""

    def __init__(
        self, ctx: Context, scenario: str, items: list[dict], snapshot: dict, background: bool, streamable: bool
    ):
        self.ctx, self.scenario, self.input_items = ctx, scenario, items
        self.snapshot, self.background, self.streamable = snapshot, background, streamable
        self.events: list[dict] = []
        self.done = not background
        self.task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    def add(self, event: dict) -> None:
        self.events.append(event)
        self.snapshot = apply(self.snapshot, event)
        self._notify()

    def finish(self, status: str | None = None) -> None:
        if status:
            self.snapshot["status"] = status
        self.done = True
        self._notify()

    def stop(self, status: str | None = None) -> None:
        """Stop generating (cancel, delete); followers end after the events already logged."""
        if self.task and not self.task.done():
            self.task.cancel()
        if not self.done:
            self.finish(status)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def generate(self, steps: list[tuple[float, Any]]) -> None:
        async for event in timed(steps):
            if not isinstance(event, dict):  # RESET / STALL: generation halts, status stays as it is
                await asyncio.get_running_loop().create_future()
            self.add(event)
        self.finish()

    async def follow_cut(self, obfuscate: bool, deltas: int) -> AsyncIterator[Any]:
        """As ``follow`` from the start, one event per write, but the connection drops (RESET) after
        ``deltas`` text deltas; the run goes on generating (a background response outlives it)."""
        i = sent = 0
        while True:
            changed = self._changed
            if i < len(self.events):
                event = self.events[i]
                i += 1
                yield frame(event, obfuscate)
                if event.get("type") == "response.output_text.delta":
                    sent += 1
                    if sent >= deltas:
                        yield RESET
                        return
            elif self.done:
                return
            else:
                await changed.wait()

    async def follow(self, after: int, obfuscate: bool) -> AsyncIterator[bytes]:
        """Frames of the events with sequence_number > after, live until the run is done."""
        i = max(0, after + 1)
        while True:
            changed = self._changed
            if i < len(self.events):
                yield b"".join(frame(e, obfuscate) for e in self.events[i:])
                i = len(self.events)
            elif self.done:
                return
            else:
                await changed.wait()


# ------------------------------------------------------------------------ API


def _not_found(response_id: str) -> ApiError:
    return invalid(f"Response with id '{response_id}' not found.", status=404)


#: /v1/responses (OpenAI), /responses (base URL without /v1), /openai/v1/responses (Azure v1).
PATH = re.compile(r"^(?:/v1|/openai/v1)?/responses(?:/([^/]+)(/cancel|/input_items)?)?$")


class ResponsesApi:
    """Handles the Responses routes for a `FakeUpstream` (its records and default scenario)."""

    def __init__(self, app: Any, cadence: Cadence | None = None, max_records: int = 10_000):
        self.app = app
        self.scenarios = responses_scenarios_with(cadence or Cadence())
        self.store: OrderedDict[str, Run] = OrderedDict()
        self.max_records = max_records

    @staticmethod
    def route(method: str, path: str) -> tuple[str, str | None] | None:
        m = PATH.match(path)
        if not m:
            return None
        response_id, action = m.groups()
        if response_id is None:
            return ("create", None) if method == "POST" else None
        key = {
            (None, "GET"): "retrieve",
            (None, "DELETE"): "delete",
            ("/cancel", "POST"): "cancel",
            ("/input_items", "GET"): "input_items",
        }.get((action, method))
        return (key, response_id) if key else None

    async def handle(self, route: tuple[str, str | None], receive, send, record: dict) -> None:
        rid = [(b"x-request-id", record["id"].encode())]
        action, response_id = route
        try:
            if action == "create":
                await self._create(receive, send, record, rid)
                return
            if self.app.follow_up_scenario is not None:
                await self._follow_up_scenario(receive, send, record, action, response_id or "", rid)
                return
            run = self.store.get(response_id or "")
            if run is None:
                raise _not_found(response_id or "")
            if action == "retrieve":
                await self._retrieve(receive, send, record, run, rid)
            elif action == "delete":
                run.stop("cancelled")
                del self.store[run.ctx.id]
                await send_json(send, 200, {"id": run.ctx.id, "object": "response", "deleted": True}, rid)
            elif action == "cancel":
                if not run.background:
                    raise invalid("Only responses created with background=true can be cancelled.")
                run.stop("cancelled")
                await send_json(send, 200, run.snapshot, rid)
            else:
                await send_json(send, 200, self._input_items(run, record["query"]), rid)
        except ApiError as e:
            await send_json(send, e.status, e.body, rid + e.headers)

    async def _follow_up_scenario(self, receive, send, record: dict, action: str, response_id: str, rid: list) -> None:
        """What a test set with /_scripted/follow_ups: its error, no answer (hang), or (reset) a
        re-stream of the events logged so far that then drops the connection."""
        name = self.app.follow_up_scenario
        if name == "hang":
            await self.app.hang(receive, record["id"], name, api="responses", response_id=response_id)
            return
        if name == "reset":
            run = self.store.get(response_id)
            if run is None or action != "retrieve" or record["query"].get("stream", "").lower() != "true":
                raise _not_found(response_id)
            after = int(record["query"].get("starting_after") or -1)
            logged = [frame(e, False) for e in run.events[max(0, after + 1) :]]
            await self._stream(receive, send, record, run, timed([(0.0, b"".join(logged)), (0.05, RESET)]), rid)
            return
        err = self.app._scenario_error(self.scenarios[name], "", record["headers"])
        raise ApiError(err.status, err.body, err.headers)

    # ---------------------------------------------------------------- create

    def _pick(self, body: dict) -> str:
        model = body.get("model")
        if isinstance(model, str) and model in self.scenarios:
            return model
        found = marked(last_user_text(body.get("input")), self.scenarios, "input")
        if found:
            return found
        default = self.app.default_scenario
        return default if default in self.scenarios else "echo"

    async def _create(self, receive, send, record: dict, rid: list) -> None:
        body = record["json"]
        if not isinstance(body, dict):
            raise invalid(
                "We could not parse the JSON body of your request. (HINT: This likely means you "
                "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
            )
        for name in body:
            if name not in KNOWN_RESPONSES_PARAMS:
                raise invalid(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise invalid("Missing required parameter: 'model'.", "model", "missing_required_parameter")
        input_ = body.get("input")
        if input_ is not None and not isinstance(input_, (str, list)):
            raise invalid(
                f"Invalid type for 'input': expected one of a string or array of input items, "
                f"but got {type(input_).__name__} instead.",
                "input",
                "invalid_type",
            )
        background, stream = body.get("background") is True, body.get("stream") is True
        if background and body.get("store") is False:
            raise invalid("Background mode requires store=true.", "store")
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.store:
            raise invalid(
                f"Previous response with id '{previous}' not found.",
                "previous_response_id",
                "previous_response_not_found",
            )

        name = self._pick(body)
        scn = self.scenarios[name]
        if scn.error:
            err = self.app._scenario_error(scn, body["model"], record["headers"])
            raise ApiError(err.status, err.body, err.headers)
        if scn.end == "hang":
            await self.app.hang(receive, record["id"], name, api="responses")
            return

        # As a real model does: a continued response carries what it continues (its input and output).
        carried = 0
        if previous is not None:
            earlier = (getattr(self.store[previous], "snapshot", None) or {}).get("usage") or {}
            carried = int(earlier.get("total_tokens") or 0)
        ctx = Context(
            model=body["model"],
            body=body,
            background=background,
            input_tokens=count_input_tokens(input_, body.get("instructions")) + carried,
        )
        deltas = sc.word_deltas(sc.echo_text(last_user_text(input_))) if name == "echo" else None
        options = body.get("stream_options")
        obfuscate = not (isinstance(options, dict) and options.get("include_obfuscation") is False)
        items = input_items(input_)
        store = body.get("store") is not False

        if background:
            steps = script(scn, ctx, deltas)
            run = Run(ctx, name, items, ctx.response("queued"), background=True, streamable=stream)
            self._keep(run)
            run.task = asyncio.create_task(run.generate(steps))
            failure = self.app.failure  # /_scripted/failure: this stream drops, the response goes on
            if stream and failure is not None and failure.end == "reset" and failure.chars is None:
                self.app.failure = failure.spent()
                await self._stream(receive, send, record, run, run.follow_cut(obfuscate, failure.after), rid)
            elif stream:
                await self._stream(receive, send, record, run, run.follow(-1, obfuscate), rid)
            else:
                await send_json(send, 200, run.snapshot, rid)
            return

        played = script(scn, ctx, deltas)
        whole = played if stream or scn.end not in STREAM_ONLY_ENDS else script(scn, ctx, deltas, end="completed")
        final = final_response(whole, ctx.response("in_progress"))
        if store:
            self._keep(Run(ctx, name, items, final, background=False, streamable=False))
        if not stream:
            await send_json(send, 200, final, rid)
            return
        run = Run(ctx, name, items, final, background=False, streamable=False)
        await self._stream(receive, send, record, run, timed(wire_plan(played, obfuscate, scn.split_writes)), rid)

    def _keep(self, run: Run) -> None:
        self.store[run.ctx.id] = run
        while len(self.store) > self.max_records:
            _, old = self.store.popitem(last=False)
            old.stop()

    # ------------------------------------------------------ retrieve, list

    async def _retrieve(self, receive, send, record: dict, run: Run, rid: list) -> None:
        query = record["query"]
        if query.get("stream", "").lower() != "true":
            await send_json(send, 200, run.snapshot, rid)
            return
        if not run.background:
            raise invalid("This response cannot be streamed because it was not created with background=true.", "stream")
        after = query.get("starting_after", "")
        try:
            starting_after = int(after) if after else -1
        except ValueError:
            raise invalid(
                f"Invalid 'starting_after': {after!r}. Expected an integer.", "starting_after", "invalid_type"
            ) from None
        obfuscate = query.get("include_obfuscation", "true").lower() != "false"
        await self._stream(receive, send, record, run, run.follow(starting_after, obfuscate), rid)

    @staticmethod
    def _input_items(run: Run, query: dict) -> dict:
        items = list(run.input_items)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid(f"Invalid value for 'order': {order!r}. Expected 'asc' or 'desc'.", "order")
        if order == "desc":
            items.reverse()
        after = query.get("after")
        if after:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        try:
            limit = int(query.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise invalid("Invalid 'limit': expected an integer from 1 to 100.", "limit")
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    # -------------------------------------------------------------- playback

    async def _stream(self, receive, send, request: dict, run: Run, source: AsyncIterator[Any], headers: list) -> None:
        """Send the source's writes; record how the stream ended (as chat streams are recorded).

        A client hanging up ends this stream only: a background run keeps generating."""
        record = {
            "request_id": request["id"],
            "scenario": run.scenario,
            "started_at": time.time(),
            "ended_at": None,
            "outcome": None,
            "api": "responses",
            "response_id": run.ctx.id,
        }
        self.app.streams.append(record)
        await play(receive, send, record, source, headers)
