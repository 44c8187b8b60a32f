"""Upstream chunks → stream events: one ``Delta`` per non-empty content delta, then exactly one
``Done`` or ``Failed``.

Rules: chunks with empty ``choices`` (Azure's filter frames, the usage chunk) are skipped; nothing
after the chunk with a ``finish_reason`` is forwarded, only the usage chunk that follows is read,
for at most ``usage_wait`` seconds; every wait on the upstream is bounded (first token, idle, total);
the upstream response is closed however the generator ends, including when the caller hangs up."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import openai

from . import errors
from .contract import ChatRequest
from .settings import Settings
from .sse import Delta, Done, Event, Failed


@dataclass
class StreamRecord:
    """What the end-of-request log line reports."""
    model: str
    started: float = field(default_factory=time.perf_counter)
    first_delta_at: float | None = None
    deltas: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    status: int = 200
    disconnected: bool = False

    def as_log(self) -> dict:
        now = time.perf_counter()
        ttfd = None if self.first_delta_at is None else round((self.first_delta_at - self.started) * 1000, 1)
        return {"event": "chat_stream", "model": self.model, "status": self.status, "ttfd_ms": ttfd,
                "duration_ms": round((now - self.started) * 1000, 1), "deltas": self.deltas,
                "finish_reason": self.finish_reason, "usage": self.usage, "error": self.error,
                "disconnected": self.disconnected}


class _Expired(Exception):
    def __init__(self, error: errors.ApiError):
        self.error = error


def _usage(chunk) -> dict | None:
    usage = getattr(chunk, "usage", None)
    return usage.model_dump(exclude_none=True) if usage is not None else None


async def relay(client: openai.AsyncOpenAI, request: ChatRequest, settings: Settings,
                record: StreamRecord) -> AsyncIterator[Event]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    total_deadline = started + settings.total_timeout
    deadline = min(total_deadline, started + settings.first_token_timeout)
    limit_error = errors.ApiError(504, "upstream_timeout", "no first token within the time limit", retryable=True)
    stream = None
    ended = False  # a Done or Failed was produced
    model = id_ = None

    async def next_chunk(it):
        try:
            async with asyncio.timeout_at(deadline):
                return await anext(it)
        except TimeoutError:
            raise _Expired(limit_error) from None

    try:
        try:
            async with asyncio.timeout_at(deadline):
                stream = await client.chat.completions.create(
                    model=record.model, messages=request.upstream_messages(), stream=True,
                    stream_options={"include_usage": True}, **request.sampling())
        except TimeoutError:
            raise _Expired(limit_error) from None
        it = aiter(stream)
        finish = None
        while finish is None:
            try:
                chunk = await next_chunk(it)
            except StopAsyncIteration:
                raise _Expired(errors.ApiError(502, "upstream_incomplete",
                                               "the model server ended the stream without a finish reason",
                                               retryable=True)) from None
            model = chunk.model or model
            id_ = chunk.id or id_
            if chunk.usage is not None:
                record.usage = _usage(chunk)
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = choice.delta.content if choice.delta is not None else None
            if text:
                if record.first_delta_at is None:
                    record.first_delta_at = time.perf_counter()
                    limit_error = errors.ApiError(504, "upstream_timeout",
                                                  "the model stopped sending within the idle limit",
                                                  retryable=True)
                record.deltas += 1
                yield Delta(text)
                deadline = min(total_deadline, loop.time() + settings.idle_timeout)
                if deadline == total_deadline:
                    limit_error = errors.ApiError(504, "total_timeout", "the stream hit its total time limit",
                                                  retryable=False)
            finish = choice.finish_reason
        record.finish_reason = finish
        # Only the usage chunk may follow; wait for it briefly, forward nothing.
        deadline = min(total_deadline, loop.time() + settings.usage_wait)
        try:
            while record.usage is None:
                chunk = await next_chunk(it)
                if chunk.usage is not None:
                    record.usage = _usage(chunk)
        except (StopAsyncIteration, _Expired, openai.APIError, ValueError):
            pass  # no usage is not a failure: the answer is complete
        ended = True
        yield Done(finish, record.usage, model, id_)
    except _Expired as exc:
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
