"""The record of one request: what its log line, its telemetry and the after-steps report.

Each fact is written by the module that owns it, through a method: the endpoint (the model, a
refusal, a hang-up), the pool (which entries were tried and why each failed), the stream core (the
first output, the deltas, how the stream ended). It is read once the request is over."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from .errors import log_safe


@dataclass(frozen=True, kw_only=True)
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
    caller: str | None = None

    @property
    def text(self) -> str:
        return self.texts.get(0, "")


# A delta shorter than this is joined with its neighbours when kept (TextParts); a longer one is
# kept as it came, the same object wherever it is kept.
SHARED_CHARS = 256
JOIN_EVERY = 256  # short pieces joined into one string at a time
_append = list.append


class TextParts(list[str]):
    """Text kept from a stream's deltas for as long as the stream lasts (what was generated, what a
    continuation goes on after): ``"".join(parts)`` is the text. Runs of ``JOIN_EVERY`` short pieces
    are joined into one string as they come: a string object costs ~50 bytes besides its characters,
    so 4-character deltas kept one by one took 13 times their text, and their many small objects
    kept the allocator's pools from being given back after the stream."""

    __slots__ = ("_run",)

    def __init__(self, parts: list[str] | tuple[str, ...] = ()):
        super().__init__(parts)
        self._run = 0  # the short pieces at the end, not joined yet

    def append(self, piece: str) -> None:
        if len(piece) >= SHARED_CHARS:
            self._join()
            _append(self, piece)
            return
        _append(self, piece)  # list's own, not super()'s lookup: this runs for every delta
        self._run += 1
        if self._run >= JOIN_EVERY:
            self._join()

    def _join(self) -> None:
        run, self._run = self._run, 0
        if run > 1:
            joined = "".join(self[-run:])
            del self[-run:]
            _append(self, joined)


@dataclass(slots=True)
class Segment:
    """One upstream stream an answer was read from: the first, then one per continuation
    (continuation.py). ``text``: what it generated for choice 0 before the text steps, a repeat the
    seam dropped included (what the upstream charges for); ``usage``: what it reported, if anything
    (a stream that failed mid-answer usually reports none); ``prompt_tokens``: a continuation's
    prompt as sent, counted (the text so far and the instruction to go on: what it is charged when
    it reports no usage); None: the request's own prompt."""

    upstream: str | None
    usage: dict | None = None
    parts: list[str] = field(default_factory=TextParts)  # ``text``, as it came (kept compactly)
    request_id: str | None = None  # the upstream's x-request-id for it
    prompt_tokens: int | None = None
    model: str | None = None  # the model name its upstream was sent (``StreamRecord.upstream_model``)

    @property
    def text(self) -> str:
        return "".join(self.parts)


# json.dumps(..., ensure_ascii=False), built once: json.dumps with any option builds an encoder per call.
_LINE = json.JSONEncoder(ensure_ascii=False).encode


def _new_id() -> str:
    """A request's own id: 32 random hex digits, as ``uuid4().hex`` was (unique across instances,
    unguessable), for a quarter of its cost (no UUID object: ~0.7 µs a request instead of ~2.7)."""
    return secrets.token_hex(16)


@dataclass(kw_only=True)
class StreamRecord:
    endpoint: str
    model: str
    request_id: str = ""  # x-request-id: the upstream's when it sent one, else the app's own
    id: str = field(default_factory=_new_id)  # the app's own, unique whatever the upstream says
    caller: str | None = None  # the caller key's name (CALLER_KEYS=required)
    caller_id: str | None = None  # ...its id (what it owns is owned by the id)
    team: str | None = None  # ...its team's name
    cost: int | None = None  # what it cost, in pico-USD (None: not charged, or the model has no price)
    started: float = field(default_factory=time.perf_counter)
    model_accepted: bool = False  # a bounded name (ALLOWED_MODELS, the default) or one the upstream served
    first_delta_at: float | None = None
    deltas: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    status: int = 200
    disconnected: bool = False
    upstream: str | None = None  # the pool entry that served the request (or the last one tried)
    upstream_model: str | None = None  # ...the model name it was sent (its ``deployments`` may map ``model``)
    attempts: int = 0  # pool entries tried for it (1 without a failover)
    answered: bool = False  # an upstream took the request (answered 200): from then on it may cost tokens
    prompt_only: bool = False  # a non-streamed call cut short in flight: the upstream read (and bills) its prompt
    stream_id: str | None = None  # a resumable stream's id
    stop_reason: str | None = None  # a resumable stream stopped: cancelled, abandoned
    attempt_errors: list[dict] = field(default_factory=list)  # each failed attempt: entry and error
    # A streamed answer with a continuation (continuation.py): each seam (``continued``: from, to,
    # after_chars, reason, seam, dropped) and, for a chat answer, each upstream stream it was read
    # from (its ``usage`` is then their sum). An answer read from one stream has no segment.
    segments: list[Segment] = field(default_factory=list)
    continued: list[dict] = field(default_factory=list)
    texts: dict[int, list[str]] | None = None  # kept only when an after-step wants them
    telemetry: Span | None = field(default=None, repr=False)  # its span, from telemetry.begin to finish
    reported: bool = False  # its log line is written

    # -- the endpoint's facts
    def chose_model(self, model: str, accepted: bool) -> None:
        """The model the request will use (after the before-steps); ``accepted``: a bounded name
        that may become a metric dimension before the upstream serves it."""
        self.model, self.model_accepted = model, accepted

    def refused(self, status: int, error: str, model_refused: bool = False) -> None:
        """The request ends with an error status (before any output)."""
        self.status, self.error = status, error
        if model_refused:
            self.model_accepted = False

    def hung_up(self, status: int | None = None) -> None:
        """The caller left before the answer was over (499 when it left before the headers)."""
        if self.finish_reason == "cancelled" or self.stop_reason == "draining":
            return  # a resumable stream stopped on purpose (stopped), or cut by the drain: not a hang-up
        self.disconnected = True
        if status is not None:
            self.status = status

    # -- the pool's facts
    def attempting(self, entry: str, model: str | None = None) -> None:
        self.upstream, self.upstream_model = entry, model
        self.attempts += 1

    def cut_short(self) -> None:
        """A non-streamed call in flight was abandoned (the caller hung up, a time limit): the
        upstream has the prompt, and charges for it, though no answer came."""
        self.prompt_only = True

    def upstream_answered(self) -> None:
        self.answered = True

    def attempt_failed(self, entry: str, error: str) -> None:
        self.attempt_errors.append({"upstream": entry, "error": error})

    # -- the continuation's facts
    def segment(self, segment: Segment) -> None:
        """The answer is read from another upstream stream (its first, or a continuation)."""
        self.segments.append(segment)

    def continued_on(self, seam: dict) -> None:
        """The answer went on on another stream after its upstream failed mid-answer."""
        self.continued.append(seam)

    # -- the stream core's facts
    def first_output(self) -> None:
        """The upstream served the model: from here on, its name may be a metric dimension."""
        self.first_delta_at = time.perf_counter()
        self.model_accepted = True

    def stopped(self, reason: str) -> None:
        """A resumable stream was cancelled (``cancelled``) or abandoned (``abandoned``): it ends with
        finish_reason ``cancelled``."""
        self.finish_reason = "cancelled"
        self.stop_reason = reason

    def drained(self, error: str) -> None:
        """The instance's drain cut the stream (lifecycle.py): it ends with ``error``, not as a hang-up."""
        self.error, self.stop_reason = error, "draining"

    def ended(self, finish_reason: str | None, usage: dict | None) -> None:
        self.finish_reason, self.usage = finish_reason, usage

    def failed(self, error: str) -> None:
        self.error = error

    def keep_text(self, index: int, text: str) -> None:
        if self.texts is not None and text:
            self.texts.setdefault(index, []).append(text)

    # -- reading it
    def report(self) -> bool:
        """Mark the record reported: True the first time (write its log line then), False after."""
        first, self.reported = not self.reported, True
        return first

    def ttfd_ms(self) -> float | None:
        return None if self.first_delta_at is None else round((self.first_delta_at - self.started) * 1000, 1)

    def duration_ms(self) -> float:
        return round((time.perf_counter() - self.started) * 1000, 1)

    def as_log(self) -> dict:
        line = {
            "event": "chat_stream",
            "endpoint": self.endpoint,
            "model": self.model,
            "status": self.status,
            "ttfd_ms": self.ttfd_ms(),
            "duration_ms": self.duration_ms(),
            "deltas": self.deltas,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "error": self.error,
            "disconnected": self.disconnected,
            "upstream": self.upstream,
            "attempts": self.attempts,
            "request_id": self.request_id or None,
        }
        if self.attempt_errors:
            line["attempt_errors"] = self.attempt_errors
        if self.continued:
            line["continued"] = self.continued
        if self.caller is not None:
            line["caller"] = self.caller
        if self.team is not None:
            line["team"] = self.team
        if self.cost is not None:
            line["cost_usd"] = self.cost / 10**12
        if self.stream_id is not None:
            line["stream_id"] = self.stream_id
        if self.stop_reason is not None:
            line["stop_reason"] = self.stop_reason
        return line

    def log_line(self) -> str:
        return log_safe(_LINE(self.as_log()))

    def result(self) -> StreamResult:
        return StreamResult(
            endpoint=self.endpoint,
            model=self.model,
            texts={i: "".join(t) for i, t in (self.texts or {}).items()},
            finish_reason=self.finish_reason,
            usage=self.usage,
            ttfd_ms=self.ttfd_ms(),
            duration_ms=self.duration_ms(),
            deltas=self.deltas,
            disconnected=self.disconnected,
            error=self.error,
            status=self.status,
            caller=self.caller,
        )
