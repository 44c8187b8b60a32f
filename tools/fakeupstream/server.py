"""The ASGI app: routing, scenario choice and recording; a stream is played by wire.py.

A plain ASGI callable (no framework) so that the per-chunk path is just
"sleep until the deadline, send pre-built bytes". It runs under uvicorn.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any
from urllib.parse import parse_qsl

from . import scenarios as sc
from .keepalive import StaleConnections
from .params import chat_param_problem
from .responses import ResponsesApi
from .scenarios import Cadence, Request, Scenario
from .wire import ApiError, DeliberateReset, invalid, marked, play, send_json, timed

_DEPLOYMENT_PATH = re.compile(r"^/openai/deployments/([^/]+)/chat/completions$")
_MODELS_CREATED = 1_700_000_000


# A stream record keeps when the first CONTENT_TIMES chunks with text went out (content_sent_at), so
# that a test can tell the relay's delay from the upstream's own.
CONTENT_TIMES = 64
_CONTENT = re.compile(rb'"content":"[^"]')


class _QuietResets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], DeliberateReset))


async def _read_body(receive) -> bytes | None:
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


class FakeUpstream:
    """The ASGI app. `requests` and `streams` are the records served under /_scripted/."""

    def __init__(
        self,
        default_scenario: str = "echo",
        cadence: Cadence | None = None,
        max_records: int = 10_000,
        responses: bool = True,
    ):
        self.scenarios: dict[str, Scenario] = sc.scenarios_with(cadence or Cadence())
        if default_scenario not in self.scenarios:
            raise ValueError(f"unknown scenario {default_scenario!r}")
        self.default_scenario = default_scenario
        # POST /_scripted/default with "times": the default plays for that many more chat requests,
        # then the one before it is the default again (a provider's blip: one 429, one 500).
        self.default_times: int | None = None
        self.default_after = default_scenario
        self.requests: deque[dict] = deque(maxlen=max_records)
        self.streams: deque[dict] = deque(maxlen=max_records)
        self._ids = itertools.count(1)
        # Set by tests (/_scripted/follow_ups, /_scripted/error_headers): what every follow-up about a
        # stored response plays instead of its answer, and the headers every error answer carries.
        self.follow_up_scenario: str | None = None
        self.error_headers: dict[str, str] = {}
        # Set by tests (/_scripted/failure, /_scripted/continuation): every streamed chat answer cut
        # after N deltas, and how a request to continue an answer is answered.
        self.failure: sc.Failure | None = None
        self.continuation = sc.ContinueMode()
        self.received = 0  # API requests ever received (the record lists keep only the latest)
        # /_scripted/stale: requests on kept-alive connections closed unanswered (keepalive.py; served
        # by __main__ with its protocol, in-process without it).
        self.stale = StaleConnections()
        # The `held` streams waiting for POST /_scripted/release.
        self.held: set[asyncio.Future] = set()
        # The Responses API (responses.py); None answers its routes with 404, as servers without it do.
        self.responses = ResponsesApi(self, cadence, max_records) if responses else None
        self._models = {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": _MODELS_CREATED, "owned_by": "fakeupstream"}
                for name in self.scenarios
            ],
        }
        logging.getLogger("uvicorn.error").addFilter(_QuietResets())

    # ------------------------------------------------------------------ dispatch

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        try:
            await self._http(scope, receive, send)
        finally:
            if scope.get("client"):
                self.stale.answered.add(tuple(scope["client"]))

    async def _http(self, scope, receive, send) -> None:
        method, path = scope["method"], scope["path"]
        if path.startswith("/_scripted/"):
            body = await _read_body(receive)
            if body is not None:
                query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
                await self._control(send, method, path, body, query)
            return

        received_at = time.time()
        body = await _read_body(receive)
        if body is None:
            return
        record = self._record(scope, body, received_at)
        rid = [(b"x-request-id", record["id"].encode())]
        query = record["query"]
        try:
            if method == "POST" and path in (
                "/v1/chat/completions",
                "/chat/completions",
                "/openai/v1/chat/completions",
            ):
                await self._chat(receive, send, record, deployment=None)
            elif method == "POST" and (m := _DEPLOYMENT_PATH.match(path)) and "api-version" in query:
                await self._chat(receive, send, record, deployment=m.group(1))
            elif self.responses and (route := self.responses.route(method, path)):
                await self.responses.handle(route, receive, send, record)
            elif path.startswith("/openai/"):
                await send_json(send, 404, {"error": {"code": "404", "message": "Resource not found"}}, rid)
            elif method == "GET" and path in ("/v1/models", "/models"):
                await send_json(send, 200, self._models, rid)
            else:
                raise ApiError(404, sc.error_body(f"Invalid URL ({method} {path})", "invalid_request_error"))
        except ApiError as e:
            await send_json(send, e.status, e.body, rid + e.headers)

    def _record(self, scope, body: bytes, received_at: float) -> dict:
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            name, value = k.decode("latin-1").lower(), v.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        record = {
            "id": f"req_{next(self._ids)}",
            "method": scope["method"],
            "path": scope["path"],
            "query": dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)),
            "headers": headers,
            "json": parsed,
            "received_at": received_at,
        }
        self.requests.append(record)
        self.received += 1
        return record

    async def _control(self, send, method: str, path: str, body: bytes, query: dict[str, str]) -> None:
        if path == "/_scripted/requests" and method == "GET":
            records = list(self.requests)
            last = query.get("last", "")
            await send_json(send, 200, records[-int(last) :] if last.isdigit() and int(last) else records)
        elif path == "/_scripted/requests" and method == "DELETE":
            self.requests.clear()
            self.streams.clear()
            await send_json(send, 200, {"cleared": True})
        elif path == "/_scripted/count" and method == "GET":
            await send_json(send, 200, {"requests": self.received})
        elif path == "/_scripted/streams" and method == "GET":
            await send_json(send, 200, list(self.streams))
        elif path == "/_scripted/default" and method in ("GET", "POST"):
            if method == "POST":
                name = _json_field(body, "scenario")
                if name not in self.scenarios:
                    await _unknown_scenario(send, "scenario", name, self.scenarios)
                    return
                times = _json_field(body, "times")
                if times is not None and (not isinstance(times, int) or isinstance(times, bool) or times < 1):
                    await send_json(
                        send, 400, sc.error_body("times: a positive integer or null", "invalid_request_error")
                    )
                    return
                self.default_after = self.default_scenario if times is not None else name
                self.default_scenario, self.default_times = name, times
            await send_json(send, 200, {"scenario": self.default_scenario, "times": self.default_times})
        elif path == "/_scripted/follow_ups" and method in ("GET", "POST"):
            if method == "POST":
                name = _json_field(body, "scenario")
                if name is not None and name not in FOLLOW_UP_SCENARIOS:
                    await _unknown_scenario(send, "follow-up scenario", name, FOLLOW_UP_SCENARIOS)
                    return
                self.follow_up_scenario = name
            await send_json(send, 200, {"scenario": self.follow_up_scenario})
        elif path == "/_scripted/failure" and method in ("GET", "POST"):
            if method == "POST":
                try:
                    self.failure = sc.Failure.parse(_json_field(body, None))
                except ValueError as exc:
                    await send_json(send, 400, sc.error_body(str(exc), "invalid_request_error"))
                    return
            await send_json(send, 200, self.failure.as_dict() if self.failure else {})
        elif path == "/_scripted/continuation" and method in ("GET", "POST"):
            if method == "POST":
                try:
                    self.continuation = sc.ContinueMode.parse(_json_field(body, None))
                except ValueError as exc:
                    await send_json(send, 400, sc.error_body(str(exc), "invalid_request_error"))
                    return
            await send_json(send, 200, self.continuation.as_dict())
        elif path == "/_scripted/stale" and method in ("GET", "POST"):
            if method == "POST":
                times, connections = _json_field(body, "times"), _json_field(body, "connections") or "kept"
                if (
                    not isinstance(times, int)
                    or isinstance(times, bool)
                    or times < 0
                    or connections not in ("kept", "any")
                ):
                    await send_json(
                        send,
                        400,
                        sc.error_body('times: an integer >= 0; connections: "kept" or "any"', "invalid_request_error"),
                    )
                    return
                self.stale.arm(times, connections == "any")
            await send_json(send, 200, self.stale.as_dict())
        elif path == "/_scripted/release" and method in ("GET", "POST"):
            if method == "GET":
                await send_json(send, 200, {"held": len(self.held)})
                return
            released, self.held = self.held, set()
            for waiter in released:
                if not waiter.done():  # (cancelled: its client hung up)
                    waiter.set_result(None)
            await send_json(send, 200, {"released": len(released)})
        elif path == "/_scripted/error_headers" and method in ("GET", "POST"):
            if method == "POST":
                headers = _json_field(body, None)
                if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
                    await send_json(
                        send,
                        400,
                        sc.error_body("Send a JSON object of header names to strings.", "invalid_request_error"),
                    )
                    return
                self.error_headers = headers
            await send_json(send, 200, self.error_headers)
        else:
            await send_json(send, 404, sc.error_body(f"Invalid URL ({method} {path})", "invalid_request_error"))

    # ---------------------------------------------------------- chat completions

    def _pick(self, body: dict, deployment: str | None, spend: bool = False) -> str:
        """Scenario: the model (or deployment) name, else a [scenario:NAME] marker, else the default
        (``spend``: a request plays it, one of its ``times``)."""
        model = body.get("model") or deployment
        if isinstance(model, str) and model in self.scenarios:
            return model
        found = marked(_last_user_text(body["messages"]), self.scenarios, "messages")
        if found:
            return found
        name = self.default_scenario
        if spend and self.default_times is not None:
            self.default_times -= 1
            if self.default_times == 0:
                self.default_scenario, self.default_times = self.default_after, None
        return name

    async def _chat(self, receive, send, record: dict, deployment: str | None) -> None:
        body = record["json"]
        if not isinstance(body, dict):
            raise invalid(
                "We could not parse the JSON body of your request. (HINT: This likely means you "
                "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
            )
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise invalid("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
        problem = chat_param_problem(body, prefix=self.continuation.prefix)
        if problem:
            raise invalid(*problem)
        n = body.get("n") or 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
            raise invalid(f"Invalid 'n': {n!r}. Expected an integer from 1 to 128.", "n", "invalid_value")

        # A request to go on with an answer: the conversation before it picks the scenario.
        going_on = sc.continuation_of(body, lambda history: self._answer(body, history, deployment)[1])
        name = self._pick({**body, "messages": going_on.history} if going_on else body, deployment, spend=True)
        scn = self.scenarios[name]
        model = deployment or (body["model"] if isinstance(body.get("model"), str) else name)
        if scn.error:
            raise self._scenario_error(scn, model, record["headers"])
        if scn.end == "hang":
            await self.hang(receive, record["id"], name)
            return

        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        prompt_tokens = sc.count_prompt_tokens(messages)
        req = Request(
            model=model,
            n=n,
            prompt_tokens=prompt_tokens,
            cached_tokens=prompt_tokens // 2 if isinstance(body.get("prompt_cache_key"), str) else 0,
            include_usage=stream and isinstance(options, dict) and options.get("include_usage") is True,
        )
        deltas = sc.word_deltas(sc.echo_text(_last_user_text(messages))) if name == "echo" else None
        if going_on is not None:
            deltas = self.continuation.deltas(going_on)
        if stream and self.failure is not None:
            scn, deltas = self.failure.applied(scn, scn.deltas if deltas is None else deltas)
            self.failure = self.failure.spent()
        rid = [(b"x-request-id", record["id"].encode())]
        if not stream:
            await send_json(send, 200, sc.completion_body(scn, req, deltas), rid)
            return
        await self._play(receive, send, record["id"], name, sc.stream_plan(scn, req, deltas), rid)

    def _answer(self, body: dict, history: list, deployment: str | None) -> tuple[Scenario, tuple[str, ...]]:
        """The scenario and the deltas this server would answer ``history`` with (for its text)."""
        try:
            name = self._pick({**body, "messages": history}, deployment)
        except ApiError:
            return self.scenarios[self.default_scenario], ()
        scn = self.scenarios[name]
        return scn, sc.word_deltas(sc.echo_text(_last_user_text(history))) if name == "echo" else scn.deltas

    def _scenario_error(self, scn: Scenario, model: str, headers: dict) -> ApiError:
        err = scn.error
        assert err is not None
        key = headers.get("api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
        auth = (
            f"Authorization: {headers['authorization']}"
            if "authorization" in headers
            else f"api-key: {headers.get('api-key', '')}"
        )
        message = err.message.format(model=model, key=sc.mask_key(key), auth=auth)
        if err.code == "invalid_api_key" and not key:
            message = (
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        extra = []
        if err.retry_after_s is not None:
            extra = [
                (b"retry-after", str(max(1, round(err.retry_after_s))).encode()),
                (b"retry-after-ms", str(round(err.retry_after_s * 1000)).encode()),
            ]
        if self.error_headers:  # a test's own (any text, in UTF-8), instead of the scenario's
            extra = [(k.lower().encode(), v.encode()) for k, v in self.error_headers.items()]
        return ApiError(err.status, sc.error_body(message, err.type, err.code, err.param), extra)

    async def hang(self, receive, request_id: str, name: str, **fields: Any) -> None:
        """No answer at all until the client hangs up (recorded as a stream that ends then)."""
        record = {
            "request_id": request_id,
            "scenario": name,
            "started_at": time.time(),
            "ended_at": None,
            "outcome": None,
            **fields,
        }
        self.streams.append(record)
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
            record["outcome"] = "client_disconnected"
        finally:
            record["outcome"] = record["outcome"] or "error"
            record["ended_at"] = time.time()

    # ------------------------------------------------------------------ playback

    async def _play(self, receive, send, request_id: str, name: str, plan: list, headers: list) -> None:
        """Send the plan's frames at their deadlines; record how the stream ended."""
        record = {
            "request_id": request_id,
            "scenario": name,
            "started_at": time.time(),
            "ended_at": None,
            "outcome": None,
            "content_sent_at": [],
        }
        self.streams.append(record)
        sent_at = record["content_sent_at"]

        def sent(item: bytes) -> None:
            if len(sent_at) < CONTENT_TIMES and _CONTENT.search(item):
                sent_at.append(time.time())

        await play(receive, send, record, self._released(timed(plan)), headers, sent)

    async def _released(self, source: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The source's items, each ``HOLD`` waited out until POST /_scripted/release."""
        async for item in source:
            if item is not sc.HOLD:
                yield item
                continue
            waiter = asyncio.get_running_loop().create_future()
            self.held.add(waiter)
            try:
                await waiter
            finally:
                self.held.discard(waiter)


# What a follow-up (retrieve, re-stream, cancel, delete, input_items) can play instead of its answer.
FOLLOW_UP_SCENARIOS = (
    "rate_limited",
    "server_error",
    "overloaded",
    "key_in_error_400",
    "key_in_error_404",
    "key_in_error_429",
    "hang",
    "reset",
)


async def _unknown_scenario(send, kind: str, name: Any, known: Iterable[str]) -> None:
    """The 400 for a scenario name the server does not know, listing the ones it does."""
    message = f"Unknown {kind} {name!r}. Known: {', '.join(known)}"
    await send_json(send, 400, sc.error_body(message, "invalid_request_error", "unknown_scenario", "scenario"))


def _json_field(body: bytes, name: str | None) -> Any:
    """``name`` of the JSON object ``body`` (None when absent or not JSON); the object itself for None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if name is None:
        return data
    return data.get(name) if isinstance(data, dict) else None


def _last_user_text(messages: list) -> str:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return sc.message_text(m.get("content"))
    return ""


def create_app(
    default_scenario: str = "echo", cadence: Cadence | None = None, max_records: int = 10_000, responses: bool = True
) -> FakeUpstream:
    """A new app with its own records. `cadence` configures the `cadence` scenario.
    `responses=False` answers the Responses API's routes with 404."""
    return FakeUpstream(default_scenario, cadence, max_records, responses)
