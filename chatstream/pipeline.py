"""Steps around the model call, shared by both endpoints.

Declare them in function_app.py::

    pipeline = Pipeline.from_settings(settings)      # the built-in steps the settings switch on

    @pipeline.before                                 # before the call: change or reject the request
    def tag_user(call: CallRequest) -> None:
        call.params["user"] = "web"

    pipeline.text(lambda: MyFilter())                # on the stream: a fresh filter per stream/choice

    @pipeline.after                                  # after the stream: never delays the caller
    async def store(result: StreamResult) -> None: ...

- A before-step gets the ``CallRequest`` (``params`` are the OpenAI chat-completions parameters about
  to be sent) and may change it, or raise ``Rejection(status, message)`` for a 4xx before any
  upstream call. Sync or async.
- A text step is any object with ``feed(text) -> str`` and ``flush() -> str``: it sees the text as it
  flows and returns what may be released now, holding back only what it must (``flush`` releases
  the rest when the choice finishes). A factory makes one per stream and choice.
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

from .errors import ApiError
from .guard import ModerationGate, Redactor

log = logging.getLogger("chatstream")


class TextStep(Protocol):
    def feed(self, text: str) -> str: ...
    def flush(self) -> str: ...


@dataclass
class CallRequest:
    """The call about to be made: ``params`` for chat.completions.create (``model``, ``messages``,
    sampling options, ``stream``...), and which endpoint it came through (``chat`` or ``openai``)."""
    params: dict[str, Any]
    endpoint: str
    include_usage: bool = False  # the caller asked for the usage chunk (OpenAI endpoint, streamed)

    @property
    def messages(self) -> list[dict]:
        return self.params["messages"]


@dataclass(frozen=True)
class StreamResult:
    """What an after-step sees. ``texts`` holds each choice's released text (index → text)."""
    endpoint: str
    model: str
    texts: dict[int, str]
    finish_reason: str | None
    usage: dict | None
    ttfd_ms: float | None
    duration_ms: float
    deltas: int
    disconnected: bool
    error: str | None
    status: int

    @property
    def text(self) -> str:
        return self.texts.get(0, "")


class Rejection(Exception):
    """Raised by a before-step: the caller gets ``status`` with a JSON error body."""

    def __init__(self, status: int, message: str, type: str = "rejected", param: str | None = None):
        super().__init__(message)
        self.error = ApiError(status, type, message, param)


class StepFailed(Exception):
    def __init__(self, step: str):
        super().__init__(step)
        self.step = step
        self.error = ApiError(500, "pipeline_error", f"the pipeline step {step!r} failed", retryable=False)


class ModerationStop(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.error = ApiError(400, "content_filter", f"stopped by moderation: {reason}", retryable=False)


async def _call(step, arg) -> None:
    """Run a step that may be sync or async."""
    result = step(arg)
    if inspect.isawaitable(result):
        await result


def _name(step) -> str:
    return getattr(step, "__qualname__", None) or type(step).__name__


class TextFilter:
    """One choice's text path: the text steps in order, then the moderation gate."""

    def __init__(self, steps: list[tuple[str, TextStep]], gate: ModerationGate | None):
        self.steps = steps
        self.gate = gate

    def _through(self, text: str) -> str:
        for name, step in self.steps:
            if not text:
                return ""
            try:
                text = step.feed(text)
            except Exception:
                log.exception("pipeline text step %s failed", name)
                raise StepFailed(name) from None
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
        for name, step in self.steps:
            try:
                carry = (step.feed(carry) if carry else "") + step.flush()
            except Exception:
                log.exception("pipeline text step %s failed", name)
                raise StepFailed(name) from None
        if self.gate is not None:
            reason = (await self.gate.push(carry)) if carry else None
            reason = reason or await self.gate.close()
            if reason is not None:
                raise ModerationStop(reason)
        return carry


class Pipeline:
    def __init__(self) -> None:
        self._before: list[Callable[[CallRequest], Any]] = []
        self._text: list[Callable[[], TextStep]] = []
        self._after: list[Callable[[StreamResult], Any]] = []
        self._moderation: tuple[Callable[[str], Awaitable[Any]], int] | None = None
        self._background: set[asyncio.Task] = set()

    # -- declaring steps
    def before(self, step: Callable[[CallRequest], Any]):
        self._before.append(step)
        return step

    def text(self, factory: Callable[[], TextStep]):
        self._text.append(factory)
        return factory

    def after(self, step: Callable[[StreamResult], Any]):
        self._after.append(step)
        return step

    def moderate(self, check: Callable[[str], Awaitable[Any]], every: int = 200):
        if every <= 0:
            raise ValueError("every must be > 0")
        self._moderation = (check, every)
        return check

    @classmethod
    def from_settings(cls, settings) -> "Pipeline":
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
    @property
    def filters_text(self) -> bool:
        return bool(self._text) or self._moderation is not None

    @property
    def wants_result(self) -> bool:
        return bool(self._after)

    async def run_before(self, call: CallRequest) -> None:
        for step in self._before:
            try:
                await _call(step, call)
            except Rejection:
                raise
            except Exception:
                log.exception("pipeline before-step %s failed", _name(step))
                raise StepFailed(_name(step)) from None

    def text_filter(self) -> TextFilter | None:
        if not self.filters_text:
            return None
        gate = ModerationGate(self._moderation[0], self._moderation[1]) if self._moderation else None
        return TextFilter([(_name(f), f()) for f in self._text], gate)

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
        call.params["messages"] = [{"role": "system", "content": text}, *call.messages]
    return prepend_system_prompt


def _chars(content) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: count the text ones
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def max_prompt_chars(limit: int):
    def reject_long_prompts(call: CallRequest) -> None:
        total = sum(_chars(m.get("content")) for m in call.messages if isinstance(m, dict))
        if total > limit:
            raise Rejection(413, f"the prompt has {total} characters; the limit is {limit}", "prompt_too_long",
                            "messages")
    return reject_long_prompts
