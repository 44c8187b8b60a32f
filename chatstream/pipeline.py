"""Steps around the model call, shared by every endpoint.

Declare them in function_app.py::

    pipeline = Pipeline.from_settings(settings)      # the built-in steps the settings switch on

    @pipeline.before                                 # before the call: change or reject the request
    def tag_user(call: CallRequest) -> None:
        call.params["user"] = "web"

    pipeline.text(lambda: MyFilter())                # on the stream: a fresh filter per stream/choice

    @pipeline.after                                  # after the stream: never delays the caller
    async def store(result: StreamResult) -> None: ...

- A before-step gets the ``CallRequest`` (``params`` are the upstream API's parameters about to be
  sent) and may change it, or raise ``Rejection(status, message)`` for a 4xx before any
  upstream call. Sync or async.
- A text step is any object with ``feed(text) -> str`` and ``flush() -> str``: it sees the text as it
  flows and returns what may be released now, holding back only what it must (``flush`` releases
  the rest when the choice finishes). A factory makes one per stream, choice and text: the content,
  the refusal and each tool call's arguments are filtered apart.
- ``pipeline.moderate(check, every=N)``: an async ``check(text_so_far)`` called every N released
  characters; returning ``False`` or a reason string stops the stream (upstream closed, final
  ``error`` event of type ``content_filter``).
- An after-step gets the ``StreamResult`` once the stream is over, in a background task.
A step that raises is logged with its name; the caller gets a 500 ``pipeline_error`` status before
the first delta, or a final ``error`` event after it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import ApiError, ErrorKind, ModerationStop, Rejection, StepFailed
from .guard import ModerationGate, Redactor
from .record import StreamResult
from .settings import Settings

log = logging.getLogger("chatstream")


class TextStep(Protocol):
    def feed(self, text: str) -> str: ...
    def flush(self) -> str: ...


@dataclass(kw_only=True)
class CallRequest:
    """The call about to be made: ``params``, the body for the upstream API (for chat completions:
    ``model``, ``messages``, sampling options, ``stream``...; for responses: ``model``, ``input``,
    ``instructions``...), and which endpoint it came through (``chat``, ``openai``, ``responses``)."""

    params: dict[str, Any]
    endpoint: str
    include_usage: bool = False  # the caller asked for the usage chunk (OpenAI endpoint, streamed)
    stream_id: str | None = None  # a resumable stream's id (RESUMABLE_STREAMS=on), once it has one

    @property
    def messages(self) -> list[dict]:
        return self.params["messages"]


async def _call(step, arg) -> None:
    """Run a step that may be sync or async."""
    result = step(arg)
    if inspect.isawaitable(result):
        await result


def _name(step) -> str:
    return getattr(step, "__qualname__", None) or type(step).__name__


class TextFilter:
    """One choice's text path: the text steps in order, then the moderation gate."""

    def __init__(self, steps: list[TextStep], gate: ModerationGate | None):
        self.steps = steps
        self.gate = gate

    def _through(self, text: str) -> str:
        for step in self.steps:
            if not text:
                return ""
            try:
                text = step.feed(text)
            except Exception:
                log.exception("pipeline text step %s failed", type(step).__qualname__)
                raise StepFailed(type(step).__qualname__) from None
        return text

    async def feed(self, text: str) -> str:
        text = self._through(text)
        if text and self.gate is not None:
            reason = await self.gate.push(text)
            if reason is not None:
                raise ModerationStop(reason)
        return text

    async def flush(self) -> str:
        """The choice finished: each step releases what it held, passed through the steps after it."""
        carry = ""
        for step in self.steps:
            try:
                carry = (step.feed(carry) if carry else "") + step.flush()
            except Exception:
                log.exception("pipeline text step %s failed", type(step).__qualname__)
                raise StepFailed(type(step).__qualname__) from None
        if self.gate is not None:
            reason = (await self.gate.push(carry)) if carry else None
            reason = reason or await self.gate.close()
            if reason is not None:
                raise ModerationStop(reason)
        return carry


class Pipeline:
    """The steps, and what they make the endpoints do: ``has_before`` (run the before-steps),
    ``filters_text`` (text steps or moderation on the output), ``moderates`` (a moderation check:
    filtering a chunk may wait on it, a network call), ``wants_result`` (after-steps)."""

    def __init__(self) -> None:
        self._before: list[Callable[[CallRequest], Any]] = []
        self._text: list[Callable[[], TextStep]] = []
        self._after: list[Callable[[StreamResult], Any]] = []
        self._moderation: tuple[Callable[[str], Awaitable[Any]], int] | None = None
        self._background: set[asyncio.Task] = set()
        self.has_before = self.filters_text = self.moderates = self.wants_result = False

    # -- declaring steps
    def before(self, step: Callable[[CallRequest], Any]):
        self._before.append(step)
        self.has_before = True
        return step

    def text(self, factory: Callable[[], TextStep]):
        self._text.append(factory)
        self.filters_text = True
        return factory

    def after(self, step: Callable[[StreamResult], Any]):
        self._after.append(step)
        self.wants_result = True
        return step

    def moderate(self, check: Callable[[str], Awaitable[Any]], every: int = 200):
        ModerationGate(check, every)  # checks ``every`` now, not at the first stream
        self._moderation = (check, every)
        self.filters_text = self.moderates = True
        return check

    @classmethod
    def from_settings(cls, settings: Settings) -> Pipeline:
        """The built-in steps that SYSTEM_PROMPT, MAX_PROMPT_CHARS and BLOCKED_TERMS switch on."""
        pipeline = cls()
        if settings.max_prompt_chars:  # first: it measures the caller's input, not our system prompt
            pipeline.before(max_prompt_chars(settings.max_prompt_chars))
        if settings.system_prompt:
            pipeline.before(system_prompt(settings.system_prompt))
        if settings.blocked_terms:
            terms = list(settings.blocked_terms)
            pipeline.text(lambda: Redactor(terms))
        return pipeline

    # -- running them
    async def run_before(self, call: CallRequest) -> None:
        for step in self._before:
            try:
                await _call(step, call)
            except ApiError:  # Rejection, or any error a step chose to answer with
                raise
            except Exception:
                log.exception("pipeline before-step %s failed", _name(step))
                raise StepFailed(_name(step)) from None

    def text_filter(self) -> TextFilter:
        gate = ModerationGate(*self._moderation) if self._moderation else None
        return TextFilter([f() for f in self._text], gate)

    def run_after(self, result: StreamResult) -> None:
        if not self._after:
            return
        task = asyncio.get_running_loop().create_task(self._after_steps(result))
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    async def _after_steps(self, result: StreamResult) -> None:
        for step in self._after:
            try:
                await _call(step, result)
            except Exception:
                log.exception("pipeline after-step %s failed", _name(step))


# ---------------------------------------------------------------------------- built-in steps


def system_prompt(text: str):
    def prepend_system_prompt(call: CallRequest) -> None:
        if "messages" in call.params:
            call.params["messages"] = [{"role": "system", "content": text}, *call.messages]
        else:  # the Responses API: in front of the caller's instructions
            instructions = call.params.get("instructions")
            call.params["instructions"] = f"{text}\n\n{instructions}" if instructions else text

    return prepend_system_prompt


# The request fields whose text reaches the model (chat completions and responses). Within them
# every string counts, ids included (a caller chooses them, and the model sees a tool call's id),
# except the values of these keys: closed sets of names the upstream checks (docs/pipeline.md).
PROMPT_FIELDS = (
    "messages",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "prediction",
    "response_format",
    "input",
    "instructions",
    "text",
    "prompt",
)
_STRUCTURE_KEYS = frozenset({"role", "type", "detail", "status", "strict"})


def prompt_chars(params: dict) -> int:
    """The characters of caller text in ``params`` that reach the model (docs/pipeline.md)."""
    return sum(_count(params.get(field)) for field in PROMPT_FIELDS)


_SCHEMA_KEYS = frozenset({"parameters", "schema", "json_schema"})  # JSON schemas: their property names count too


def _count(value, in_schema: bool = False) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(
            (len(k) if in_schema else 0)
            + (_count(v, in_schema or k in _SCHEMA_KEYS) if in_schema or k not in _STRUCTURE_KEYS else 0)
            for k, v in value.items()
        )
    if isinstance(value, list):
        return sum(_count(v, in_schema) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return len(repr(value))  # a number where text belongs still reaches the model as text
    return 0


def max_prompt_chars(limit: int):
    def reject_long_prompts(call: CallRequest) -> None:
        total = prompt_chars(call.params)
        if total > limit:
            raise Rejection(
                413,
                f"the prompt has {total} characters; the limit is {limit}",
                ErrorKind.PROMPT_TOO_LONG,
                "messages" if "messages" in call.params else "input",
            )

    return reject_long_prompts
