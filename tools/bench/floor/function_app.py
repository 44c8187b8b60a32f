"""The floor for tools/bench (the ``floor`` and ``floor2`` paths of run.py): the least a streaming relay
on this runtime must do, to tell the runtime's own cost per request and per delta from this app's
(tools/bench/README.md, "The floor").

POST /api/chat is relayed to OPENAI_BASE_URL with one shared aiohttp session per worker process, its
connector **uncapped** (aiohttp's default connector allows 100 connections: at 300 and 1,000
concurrent streams the floor would queue its upstream requests behind them, which measures that
queue, not the runtime; the app's SDK transport takes 1,000). Idle connections are kept 4 s, under the
upstream's (uvicorn's) 5 s: with aiohttp's default 15 s a request could take a connection the upstream
was closing and fail (ServerDisconnectedError; the app's SDK keeps them 5 s and retries). It sends the upstream the same request
the app sends (model, messages, ``stream``, ``stream_options.include_usage``), so the upstream does
the same work for both. The upstream's bytes are split into events on blank lines; each ``data:``
event is decoded and its text re-sent as ``{"delta": ...}`` (the JSON encoder built once), then
``event: done``. A caller who hangs up closes the upstream response (the generator is closed in
``finally``, also when Starlette cancelled the task while the generator was parked at ``yield``).

Nothing else: no SDK, request validation, time limits, status rule (the response head goes out
before the upstream answers), pipeline, pool, error handling, log line or telemetry. Not a
template: it skips everything a caller relies on."""

import json
import os

import aiohttp
import azure.functions as func
from azurefunctions.extensions.http.fastapi import Request, StreamingResponse

BASE = os.environ.get("OPENAI_BASE_URL", "")
HEADERS = {"content-type": "application/json", "authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "x")}
DONE = b'event: done\ndata: {"finish_reason":"stop"}\n\n'
SSE = {"Cache-Control": "no-store"}
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

app = func.FunctionApp(http_auth_level=func.AuthLevel.ANONYMOUS)
_session: aiohttp.ClientSession | None = None


def _event(text: str) -> bytes:
    return b"data: " + _encode({"delta": text}).encode() + b"\n\n"


async def _relay(body: dict):
    global _session
    if _session is None:  # no connection cap (limit=0); idle connections kept 4 s: see the module docstring
        _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0))
    payload = {
        "model": body.get("model") or os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": body["prompt"]}],
    }
    async with _session.post(BASE + "/chat/completions", json=payload, headers=HEADERS) as resp:
        buffer = b""
        async for piece in resp.content.iter_any():
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: "):
                    continue
                data = ev[6:]
                if data == b"[DONE]":
                    break
                choices = json.loads(data).get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content")
                if text:
                    yield _event(text)
    yield DONE


class _Closing(StreamingResponse):
    """Closes the body generator (the upstream response with it) however the response ends."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@app.route(route="chat", methods=["POST"])
async def chat(req: Request) -> StreamingResponse:
    body = json.loads(await req.body())
    return _Closing(_relay(body), media_type="text/event-stream", headers=SSE)
