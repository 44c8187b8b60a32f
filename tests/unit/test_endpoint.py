"""chatstream/endpoint.py in-process: the status rule, headers and the log line, over httpx's ASGI
transport, with the real pool and stand-in upstream clients that play scripted streams."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest
from memory_store import Fault, MemoryData, MemoryStore
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from chatstream import tokens
from chatstream.apis.chat import ChatApi
from chatstream.apis.openai_chat import OpenAIChatApi
from chatstream.endpoint import Endpoint
from chatstream.pipeline import Pipeline
from chatstream.settings import Settings
from chatstream.state.accounting import Accounting, Admission
from chatstream.state.callers import Caller, CallerSpec
from chatstream.state.counter_row import parse_holds
from chatstream.state.shared import SharedState
from chatstream.stream import Failed

from .state_helpers import MODEL, account, admit, counter, finish, instance, until, usage
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


class Hanging(ScriptedClient):
    """An upstream that never answers the request: ``calls`` counts them, ``cancelled`` the ones dropped."""

    def __init__(self):
        super().__init__()
        self.cancelled = 0

    async def post(self, path, **kwargs):
        self.calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def keyed_request(key: str, body: dict, hang_up: asyncio.Event) -> Request:
    """A request as the worker hands it over: its body, then the caller's hang-up when ``hang_up`` is set."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await hang_up.wait()
        return {"type": "http.disconnect"}

    headers = [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": "/x", "query_string": b"", "headers": headers}
    return Request(scope, receive)


@dataclass
class Keyed:
    """An instance with caller keys and one caller, "c" (50,000 TPM, a 100,000-token budget), and a
    chat-completions endpoint whose one upstream never answers (``keyed``)."""

    data: MemoryData
    state: SharedState
    accounting: Accounting
    caller: Caller
    key: str
    upstream: Hanging
    endpoint: Endpoint

    async def nothing_held(self, taken: int = 0) -> None:
        """Nothing reserved is held any more, nothing is open in the journal; ``taken`` tokens charged."""
        assert await self.accounting.flush(5)
        assert not self.state.journal.entries
        for row in ("tokens", "tpm"):
            found = counter(self.data, self.caller.limits_partition, row)
            assert not parse_holds(found.get("holds")) and (found.get("taken") or 0) == taken, found


async def keyed() -> Keyed:
    data = account()
    state, acc = instance(data, "a")
    caller, key = await state.registry.create(CallerSpec(name="c", tokens_per_minute=50_000, token_budget=100_000))
    upstream = Hanging()
    upstreams = pooled({"u": upstream})
    endpoint = Endpoint(OpenAIChatApi(), upstreams.settings, upstreams, Pipeline(), acc)
    return Keyed(data, state, acc, caller, key, upstream, endpoint)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_handler_cancelled_after_admission_gives_back_what_it_reserved(stream):
    """The handler's task is cancelled once the request is admitted and the upstream asked, before it
    answers: the upstream call is dropped, the reservation settled, the journal entry closed. A
    stream the upstream never answered costs nothing; a non-streamed call dropped in flight, its
    prompt (the upstream has read it)."""
    k = await keyed()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    handler = asyncio.ensure_future(k.endpoint(keyed_request(k.key, body, asyncio.Event())))
    await until(lambda: k.upstream.calls == 1, what="the upstream asked")
    assert len(k.state.journal.entries) == 1  # admitted
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert k.upstream.cancelled == 1  # the upstream call did not go on on its own
    await k.nothing_held(0 if stream else tokens.count_prompt(MODEL, body))
    await k.state.close()


async def test_a_caller_gone_during_a_slow_admission_stops_it_before_the_upstream():
    """The store is slow to list the admission in the journal and the caller hangs up meanwhile: a
    499, what was reserved comes back, and the upstream is never asked."""
    k = await keyed()
    first, rec = await admit(k.accounting, k.caller, max_tokens=10)  # the journal and the counters written once
    assert isinstance(first, Admission)
    finish(k.accounting, first, rec, usage(5, 5))
    assert await k.accounting.flush(5)
    store = k.state.store
    assert isinstance(store, MemoryStore)
    store.inject(Fault("slow", frozenset({"put"}), table="blob", delay=1.5))  # under LISTED_WITHIN
    hang_up = asyncio.Event()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    handler = asyncio.ensure_future(k.endpoint(keyed_request(k.key, body, hang_up)))
    await until(lambda: len(k.state.journal.entries) == 1, what="the request opened in the journal")
    assert not handler.done()  # waiting for its listing
    hang_up.set()
    response = await handler
    assert response.status_code == 499 and k.upstream.calls == 0
    await k.nothing_held(taken=10)  # the first request's
    await k.state.close()


@pytest.mark.parametrize("ends", ["a", "b", "limit", "done_before", "cancelled"])
async def test_first_done_returns_when_either_is_done_or_at_its_limit_and_leaves_no_callback(ends):
    """``first_done`` is ``asyncio.wait(FIRST_COMPLETED)`` for two with a limit: it returns when
    either future is done (or already was), or at the limit; cancelled, it raises. Either way it
    leaves no callback on the futures."""
    from chatstream.endpoint import first_done

    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    if ends == "done_before":
        b.set_result(None)
    waiting = asyncio.ensure_future(first_done(a, b, 30.0 if ends != "limit" else 0.05))
    await asyncio.sleep(0.01)
    if ends == "a":
        a.set_result(None)
    elif ends == "b":
        b.set_exception(RuntimeError("b failed"))  # done as well: its outcome is the caller's to read
    elif ends == "cancelled":
        waiting.cancel()
    if ends == "cancelled":
        with pytest.raises(asyncio.CancelledError):
            await waiting
    else:
        await asyncio.wait_for(waiting, 5)
    assert ends != "limit" or not (a.done() or b.done())
    for future in (a, b):
        assert not future._callbacks  # asyncio's Future: the callbacks not yet run
    if ends == "b":
        b.exception()  # retrieved


class Producing:
    """Stands in for ``Resumable`` in a takeover: ``produce`` reads the events to their end."""

    def __init__(self) -> None:
        self.events: list = []

    async def produce(self, producer, events, encode, protocol, record) -> None:
        async for event in events:
            self.events.append(event)


async def test_a_takeover_that_cannot_go_on_ends_with_one_stream_lost_event_and_one_log_line(caplog):
    """The lost producer had sent a tool call (a continuation cannot go on from one): no upstream
    call, one final ``stream_lost``, and the stream's record written once."""
    tool_call = {"index": 0, "id": "t1", "type": "function", "function": {"name": "f", "arguments": ""}}
    stored = {"id": "c1", "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [tool_call]}}]}
    producer = SimpleNamespace(id="s-1", owner=None, epoch=0, stand_in_to=False)
    request = {"params": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}}
    events = f"data: {json.dumps(stored)}\n\n".encode()
    claim = SimpleNamespace(request=request, producer=producer, request_id="r-1", events=events)
    upstream, producing = ScriptedClient(), Producing()
    upstreams = pooled({"a": upstream})
    chat = Endpoint(OpenAIChatApi(), upstreams.settings, upstreams, Pipeline(), None, producing)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="chatstream"):
        await chat.take_over(claim)  # type: ignore[arg-type]
    [final] = producing.events
    assert isinstance(final, Failed) and final.error.type == "stream_lost" and upstream.calls == 0
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith('{"event"')]
    assert [(line["request_id"], line["error"]) for line in lines] == [("r-1", "stream_lost")]
