"""The record of one request: what the end-of-request log line, the telemetry and the after-steps
report. The endpoint creates it, the stream core fills in what the stream did, and it is read once
the request is over."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .telemetry import StreamTelemetry

# Characters that could forge or garble a log line: C0 and C1 controls (newlines among them; JSON
# output has its C0 escaped already), Unicode line and paragraph separators, the bidi overrides.
_UNSAFE_IN_LOGS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def log_safe(text: str) -> str:
    """``text`` (already JSON, or any caller-chosen string) with every character that could start a
    new log line or hide part of one escaped as ``\\uXXXX``."""
    return _UNSAFE_IN_LOGS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


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

    @property
    def text(self) -> str:
        return self.texts.get(0, "")


@dataclass(kw_only=True)
class StreamRecord:
    endpoint: str
    model: str
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
    attempts: int = 0  # pool entries tried for it (1 without a failover)
    texts: dict[int, list[str]] | None = None  # kept only when an after-step wants them
    telemetry: StreamTelemetry | None = field(default=None, repr=False)

    def ttfd_ms(self) -> float | None:
        return None if self.first_delta_at is None else round((self.first_delta_at - self.started) * 1000, 1)

    def duration_ms(self) -> float:
        return round((time.perf_counter() - self.started) * 1000, 1)

    def failed(self, status: int, error: str) -> None:
        self.status, self.error = status, error

    def keep_text(self, index: int, text: str) -> None:
        if self.texts is not None and text:
            self.texts.setdefault(index, []).append(text)

    def as_log(self) -> dict:
        return {"event": "chat_stream", "endpoint": self.endpoint, "model": self.model, "status": self.status,
                "ttfd_ms": self.ttfd_ms(), "duration_ms": self.duration_ms(), "deltas": self.deltas,
                "finish_reason": self.finish_reason, "usage": self.usage, "error": self.error,
                "disconnected": self.disconnected, "upstream": self.upstream, "attempts": self.attempts}

    def log_line(self) -> str:
        return log_safe(json.dumps(self.as_log(), ensure_ascii=False))

    def result(self) -> StreamResult:
        return StreamResult(endpoint=self.endpoint, model=self.model,
                            texts={i: "".join(t) for i, t in (self.texts or {}).items()},
                            finish_reason=self.finish_reason, usage=self.usage, ttfd_ms=self.ttfd_ms(),
                            duration_ms=self.duration_ms(), deltas=self.deltas, disconnected=self.disconnected,
                            error=self.error, status=self.status)
