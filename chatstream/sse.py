"""Stream events → bytes on the wire (text/event-stream), for each endpoint.

/api/chat: ``data: {"delta": "..."}`` per piece of text, then exactly one ``event: done`` or
``event: error``. /api/v1/chat/completions: OpenAI's own chunks, then ``data: [DONE]`` (or, after a
failure, OpenAI's ``data: {"error": ...}`` and the end of the stream, which the SDKs raise as
APIError). ``: keep-alive`` comments carry nothing in either."""
from __future__ import annotations

import json

from .openai_contract import error_body
from .relay import Chunk, Done, Event, Failed

KEEP_ALIVE = b": keep-alive\n\n"
OPENAI_DONE = b"data: [DONE]\n\n"


def _json(payload) -> bytes:
    try:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from upstream: escape it rather than fail
        return json.dumps(payload, separators=(",", ":")).encode("ascii")


def chat_text(chunk: dict) -> str | None:
    """Choice 0's content in a chunk, if any."""
    for choice in chunk["choices"]:
        if choice.get("index", 0) == 0:
            delta = choice.get("delta")
            return delta.get("content") if delta else None
    return None


def encode_chat(event: Event) -> bytes | None:
    if isinstance(event, Chunk):
        text = chat_text(event.data)
        return b"data: " + _json({"delta": text}) + b"\n\n" if text else None
    if isinstance(event, Done):
        body = {"finish_reason": event.finish_reason, "usage": event.usage, "model": event.model, "id": event.id}
        return b"event: done\ndata: " + _json(body) + b"\n\n"
    return b"event: error\ndata: " + _json(event.error.body()) + b"\n\n"


def encode_openai(event: Event, include_usage: bool) -> bytes:
    if isinstance(event, Chunk):
        return b"data: " + _json(event.data) + b"\n\n"
    if isinstance(event, Done):
        if include_usage:
            usage_chunk = {"id": event.id, "object": "chat.completion.chunk", "created": event.created,
                           "model": event.model, "choices": [], "usage": event.usage}
            return b"data: " + _json(usage_chunk) + b"\n\n" + OPENAI_DONE
        return OPENAI_DONE
    assert isinstance(event, Failed)
    return b"data: " + _json(error_body(event.error)) + b"\n\n"
