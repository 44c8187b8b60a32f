"""Upstream chunks → stream events, shared by both endpoints: ``Chunk`` for each upstream chunk worth
forwarding (its text already through the pipeline's text steps), then exactly one ``Done`` or
``Failed``.

Rules: chunks with empty ``choices`` (Azure's filter frames, the usage chunk) are not forwarded;
chunks before the first one with content (the role chunk) are held and sent with it, so that the
status rule can wait for real content; nothing a choice sends after its ``finish_reason`` is
forwarded, and once every choice has finished only the usage chunk is read, for at most
``usage_wait`` seconds; every wait on the upstream is bounded (first token, idle, total); the
upstream response is closed however the generator ends, including when the caller hangs up."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import openai

from . import errors
from .pipeline import ModerationStop, Pipeline, StepFailed, StreamResult, TextFilter
from .settings import Settings
from .upstream import UpstreamStream


@dataclass(slots=True)
class Chunk:
    data: dict  # an OpenAI chat.completion.chunk


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: str | None  # choice 0's
    finish_reasons: dict[int, str]
    usage: dict | None
    model: str | None
    id: str | None
    created: int | None


@dataclass(frozen=True, slots=True)
class Failed:
    error: errors.ApiError


Event = Chunk | Done | Failed


@dataclass
class StreamRecord:
    """What the end-of-request log line (and the after-steps) report."""
    model: str
    endpoint: str = "chat"
    started: float = field(default_factory=time.perf_counter)
    first_delta_at: float | None = None
    deltas: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    status: int = 200
    disconnected: bool = False
    texts: dict[int, list[str]] | None = None  # kept only when an after-step wants them
    telemetry: object = field(default=None, repr=False)  # the span handle (chatstream.telemetry)

    def as_log(self) -> dict:
        now = time.perf_counter()
        ttfd = None if self.first_delta_at is None else round((self.first_delta_at - self.started) * 1000, 1)
        return {"event": "chat_stream", "endpoint": self.endpoint, "model": self.model, "status": self.status,
                "ttfd_ms": ttfd, "duration_ms": round((now - self.started) * 1000, 1), "deltas": self.deltas,
                "finish_reason": self.finish_reason, "usage": self.usage, "error": self.error,
                "disconnected": self.disconnected}

    def result(self) -> StreamResult:
        log = self.as_log()
        return StreamResult(self.endpoint, self.model, {i: "".join(t) for i, t in (self.texts or {}).items()},
                            self.finish_reason, self.usage, log["ttfd_ms"], log["duration_ms"], self.deltas,
                            self.disconnected, self.error, self.status)


class _Expired(Exception):
    def __init__(self, error: errors.ApiError):
        self.error = error


def _well_formed(choice) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta") or {}
    return isinstance(delta, dict) and isinstance(delta.get("content") or "", str)


def _has_substance(delta: dict) -> bool:
    return bool(delta.get("content") or delta.get("tool_calls") or delta.get("refusal")
                or delta.get("function_call"))


async def relay(client: openai.AsyncOpenAI, params: dict, settings: Settings, record: StreamRecord,
                pipeline: Pipeline | None = None) -> AsyncIterator[Event]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    total_deadline = started + settings.total_timeout
    deadline = min(total_deadline, started + settings.first_token_timeout)
    limit_error = errors.ApiError(504, "upstream_timeout", "no first token within the time limit", retryable=True)
    choices_wanted = params.get("n") or 1
    filters: dict[int, TextFilter | None] = {}
    make_filter = pipeline.text_filter if pipeline is not None and pipeline.filters_text else None
    if pipeline is not None and pipeline.wants_result:
        record.texts = {}
    finished: dict[int, str] = {}
    held: list[dict] = []  # chunks before the first one with content
    stream: UpstreamStream | None = None
    ended = False  # a Done or Failed was produced
    model = id_ = created = None

    try:
        try:
            async with asyncio.timeout_at(deadline):
                stream = await UpstreamStream.open(client, params)
        except TimeoutError:
            raise _Expired(limit_error) from None
        chunks = aiter(stream)
        while len(finished) < choices_wanted:
            try:
                async with asyncio.timeout_at(deadline):
                    data = await anext(chunks)
            except TimeoutError:
                raise _Expired(limit_error) from None
            except StopAsyncIteration:
                if finished:  # a choice never finished but the stream ended cleanly
                    break
                raise _Expired(errors.ApiError(502, "upstream_incomplete",
                                               "the model server ended the stream without a finish reason",
                                               retryable=True)) from None
            model = data.get("model") or model
            id_ = data.get("id") or id_
            created = data.get("created") or created
            if data.get("usage"):
                record.usage = data["usage"]
            choices = data.get("choices")
            if not choices:
                continue
            if not isinstance(choices, list) or not all(map(_well_formed, choices)):
                raise ValueError("a chunk's choices are not objects with a delta object")
            substance = finishing = False
            kept = []
            for choice in choices:
                index = choice.get("index", 0)
                if index in finished:
                    continue  # nothing after a choice's finish_reason is forwarded
                delta = choice.get("delta")
                if delta is None:  # attach it, so released text written below is forwarded
                    delta = choice["delta"] = {}
                reason = choice.get("finish_reason")
                if make_filter is not None:
                    if index not in filters:
                        filters[index] = make_filter()
                    text = delta.get("content")
                    if text:
                        delta["content"] = text = await filters[index].feed(text)
                    if reason:
                        tail = await filters[index].flush()
                        if tail:
                            delta["content"] = (delta.get("content") or "") + tail
                    if "content" in delta and not delta["content"] and not reason and not _has_substance(delta):
                        if len(delta) == 1:
                            continue  # everything was held back: nothing to send for this choice
                if record.texts is not None and delta.get("content"):
                    record.texts.setdefault(index, []).append(delta["content"])
                if reason:
                    finished[index] = reason
                substance = substance or _has_substance(delta)
                finishing = finishing or bool(reason)
                kept.append(choice)
            if not kept:
                continue
            if len(kept) != len(choices):
                data = {**data, "choices": kept}
            if not substance and not finishing and record.first_delta_at is None:
                held.append(data)
                continue
            if record.first_delta_at is None:
                record.first_delta_at = time.perf_counter()
                limit_error = errors.ApiError(504, "upstream_timeout",
                                              "the model stopped sending within the idle limit", retryable=True)
                for early in held:
                    yield Chunk(early)
                held.clear()
            if substance:
                record.deltas += 1
            yield Chunk(data)
            deadline = min(total_deadline, loop.time() + settings.idle_timeout)
            if deadline == total_deadline:
                limit_error = errors.ApiError(504, "total_timeout", "the stream hit its total time limit",
                                              retryable=False)
        record.finish_reason = finished.get(0) or next(iter(finished.values()), None)
        # Only the usage chunk may follow; wait for it briefly, forward nothing. Reading on to
        # [DONE] (within the same wait) lets the SDK reuse the connection for the next request.
        deadline = min(total_deadline, loop.time() + settings.usage_wait)
        try:
            async with asyncio.timeout_at(deadline):
                async for data in chunks:
                    if data.get("usage"):
                        record.usage = data["usage"]
        except (TimeoutError, openai.APIError, ValueError):
            pass  # no usage is not a failure: the answer is complete
        ended = True
        yield Done(record.finish_reason, dict(finished), record.usage, model, id_, created)
    except (_Expired, StepFailed, ModerationStop) as exc:
        ended = True
        record.error = exc.error.type
        yield Failed(exc.error)
    except (openai.APIError, ValueError) as exc:
        ended = True
        error = errors.from_upstream(exc, record.model, midstream=record.first_delta_at is not None)
        record.error = error.type
        yield Failed(error)
    finally:
        if not ended:
            record.disconnected = True
        if stream is not None:
            # Shielded: when the caller hung up we run inside a cancelled scope, and the upstream
            # connection must still be closed (that is what stops the paid generation).
            with anyio.CancelScope(shield=True):
                await stream.close()
