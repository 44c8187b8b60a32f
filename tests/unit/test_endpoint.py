"""chatstream/endpoint.py in-process: the status rule, headers and the log line, over httpx's ASGI
transport, with the real pool and stand-in upstream clients that play scripted streams."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from chatstream.apis.chat import ChatApi
from chatstream.apis.openai_chat import OpenAIChatApi
from chatstream.endpoint import Endpoint
from chatstream.pipeline import Pipeline
from chatstream.settings import Settings

from .test_failover import ScriptedClient, ScriptedStream, chunk, pooled
from .upstream_helpers import status_error

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time


def serve(endpoint: Endpoint) -> httpx.AsyncClient:
    async def handler(request):
        return await endpoint(request)

    app = Starlette(routes=[Route("/x", handler, methods=["POST"])])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


def endpoint(api, *answers, **settings_env: str) -> Endpoint:
    upstreams = pooled({"a": ScriptedClient(*answers)}, **settings_env)
    return Endpoint(api, upstreams.settings, upstreams, Pipeline(), None)


async def test_a_stream_goes_out_as_events_with_the_upstreams_request_id():
    stream = ScriptedStream([chunk(role=True), chunk("Hel"), chunk("lo", "stop")])
    async with serve(endpoint(ChatApi(), stream)) as client:
        response = await client.post("/x", json={"prompt": "hi"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["x-request-id"] == ScriptedStream.request_id
    assert '"delta":"Hel"' in response.text and "event: done" in response.text


async def test_a_failure_before_the_first_output_is_a_status_with_the_apis_error_body():
    async with serve(endpoint(OpenAIChatApi(), status_error(400, body={"error": {"message": "no"}}))) as client:
        response = await client.post("/x", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "no",
        "type": "invalid_request_error",
        "param": None,
        "code": None,  # the upstream's own: it sent none
        "chatstream_kind": "invalid_request",
    }
    assert response.headers["x-should-retry"] == "false" and response.headers["x-request-id"]


async def test_bad_input_is_a_4xx_before_any_upstream_call():
    client_stub = ScriptedClient(ScriptedStream([chunk("x", "stop")]))
    upstreams = pooled({"a": client_stub})
    chat = Endpoint(ChatApi(), upstreams.settings, upstreams, Pipeline(), None)
    async with serve(chat) as client:
        for body, status in ((b"{", 400), (b'{"prompt": ""}', 400), (b"[]", 400)):
            response = await client.post("/x", content=body, headers={"content-type": "application/json"})
            assert response.status_code == status, body
        assert (await client.post("/x", content=b"x", headers={"content-type": "text/plain"})).status_code == 415
    assert client_stub.calls == 0


async def test_keep_alives_hold_the_headers_until_the_first_output_then_the_text():
    class Slow(ScriptedStream):
        async def _run(self):
            await asyncio.sleep(0.3)
            yield chunk("late", "stop")

    async with serve(endpoint(ChatApi(), Slow([]), HEARTBEAT_SECONDS="0.1")) as client:
        response = await client.post("/x", json={"prompt": "hi"})
    assert response.status_code == 200
    assert response.text.startswith(": keep-alive\n\n")
    assert '"delta":"late"' in response.text


async def test_a_completion_is_json_with_its_request_id(caplog):
    answer = {
        "id": "c1",
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    with caplog.at_level(logging.INFO, logger="chatstream"):
        async with serve(endpoint(OpenAIChatApi(), answer)) as client:
            response = await client.post("/x", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "ok"
    assert response.headers["x-request-id"] == "req-"  # ScriptedClient names its request ids req-<name>
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith('{"event"')]
    assert line["request_id"] == "req-" and line["usage"]["total_tokens"] == 2 and line["status"] == 200


def test_the_settings_an_endpoint_reads_once():
    settings = Settings.from_env({"OPENAI_MODEL": "m-1", "ALLOWED_MODELS": "m-1,m-2"})
    upstreams = pooled({"a": ScriptedClient()})
    e = Endpoint(ChatApi(), settings, upstreams, Pipeline(), None)
    assert e.default_model == "m-1" and e.allowed == frozenset({"m-1", "m-2"})
