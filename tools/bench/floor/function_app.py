"""The floor for tools/bench (``run.py --floor``): the least a streaming relay on this runtime can do,
to tell the runtime's own cost per request and per delta from this app's (tools/bench/README.md,
"The floor").

POST /api/chat is relayed to OPENAI_BASE_URL with one shared aiohttp session: each upstream data
line is decoded and its content re-sent as ``{"delta": ...}``, then ``event: done``, in /api/chat's
format so the benchmark's client reads it like the app. No SDK, no validation, time limits,
pipeline, pool, log line or error handling: not a template, it skips everything a caller relies on."""
import json
import os

import aiohttp
import azure.functions as func
from azurefunctions.extensions.http.fastapi import Request, StreamingResponse

BASE = os.environ.get("OPENAI_BASE_URL", "")
HEADERS = {"content-type": "application/json", "authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "x")}
DONE = b'event: done\ndata: {"finish_reason":"stop"}\n\n'
SSE = {"Cache-Control": "no-store"}

app = func.FunctionApp(http_auth_level=func.AuthLevel.ANONYMOUS)
_session: aiohttp.ClientSession | None = None


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"delta": text}, ensure_ascii=False).encode() + b"\n\n"


async def _relay(body: dict):
    global _session
    if _session is None:
        _session = aiohttp.ClientSession()
    payload = {"model": body.get("model") or "gpt-4o-mini", "stream": True,
               "messages": [{"role": "user", "content": body["prompt"]}]}
    async with _session.post(BASE + "/chat/completions", json=payload, headers=HEADERS) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            choices = json.loads(data).get("choices") or [{}]
            text = (choices[0].get("delta") or {}).get("content")
            if text:
                yield _event(text)
    yield DONE


@app.route(route="chat", methods=["POST"])
async def chat(req: Request) -> StreamingResponse:
    body = json.loads(await req.body())
    return StreamingResponse(_relay(body), media_type="text/event-stream", headers=SSE)
