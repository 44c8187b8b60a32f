"""The host's HTTP front: match the route, then forward the raw request to the worker's HTTP
server with an ``x-ms-invocation-id`` header while sending the matching invocation, and relay the
response back chunk by chunk, unbuffered. When the caller hangs up, the forwarded request is
dropped, which makes the worker's Starlette cancel the function's stream."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from urllib.parse import parse_qsl

import httpx

from .routes import Route, match
from .worker import Worker

log = logging.getLogger("devhost")

INVOCATION_HEADER = "x-ms-invocation-id"
# Hop-by-hop headers (RFC 9110 7.6.1) are not forwarded in either direction.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"})
# How long a failed invocation waits for the worker's own error response before the host answers.
FAILED_INVOCATION_GRACE = 1.0


class Host:
    """ASGI application serving every HTTP function of ``worker``."""

    def __init__(self, worker: Worker, routes: list[Route]):
        self.worker = worker
        self.routes = routes
        self.client = httpx.AsyncClient(
            base_url=worker.http_uri or "http://127.0.0.1", timeout=httpx.Timeout(None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1000))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        route, params, allowed = match(self.routes, scope["path"], scope["method"])
        if route is None:
            extra = [(b"allow", ", ".join(allowed).encode())] if allowed else []
            await _plain(send, 405 if allowed else 404, extra)
            return
        await self._invoke(route, params, scope, receive, send)

    async def _invoke(self, route: Route, params, scope, receive, send):
        invocation_id = str(uuid.uuid4())
        started = time.perf_counter()
        # A caller must never choose the invocation id (it would pair its request with another
        # invocation): drop theirs and hop-by-hop headers, add ours.
        headers = [(k, v) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in HOP_BY_HOP | {INVOCATION_HEADER, "host"}]
        headers.append((INVOCATION_HEADER.encode(), invocation_id.encode()))
        raw_query = scope.get("query_string", b"")
        target = scope.get("raw_path") or scope["path"].encode()
        target += b"?" + raw_query if raw_query else b""
        host = dict(scope["headers"]).get(b"host", b"localhost").decode("latin-1")
        url = f"{scope.get('scheme', 'http')}://{host}{scope['path']}" + (f"?{raw_query.decode('latin-1')}" if raw_query else "")

        body_done = asyncio.Event()
        disconnected = asyncio.Event()

        async def request_body():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    raise ClientGone
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    body_done.set()
                    return

        async def watch_disconnect():
            await body_done.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        log.info("Executing 'Functions.%s' (Id=%s)", route.name, invocation_id)
        request = self.client.build_request(
            scope["method"], target.decode("latin-1"), headers=headers, content=request_body())
        forward = asyncio.ensure_future(self.client.send(request, stream=True))
        invocation = asyncio.ensure_future(self.worker.invoke(
            invocation_id, route.function_id, route.trigger_param, method=scope["method"], url=url,
            headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers},
            query=dict(parse_qsl(raw_query.decode("latin-1"), keep_blank_values=True)), params=params))
        watcher = asyncio.ensure_future(watch_disconnect())
        gone = asyncio.ensure_future(disconnected.wait())
        outcome = "Succeeded"
        try:
            response = await self._await_response(forward, invocation, gone)
            if response is None:
                outcome = "Failed" if not disconnected.is_set() else "Cancelled (caller disconnected)"
                if not disconnected.is_set():
                    await _plain(send, 500)
                return
            relay = asyncio.ensure_future(self._relay(response, send))
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not relay.done():  # the caller hung up: stop reading from the worker
                relay.cancel()
                outcome = "Cancelled (caller disconnected)"
            await asyncio.gather(relay, return_exceptions=True)
        except ClientGone:
            outcome = "Cancelled (caller disconnected)"
        except httpx.HTTPError as exc:
            outcome = "Failed"
            log.error("forwarding to the worker failed: %r", exc)
            await _plain(send, 502)
        finally:
            for task in (forward, watcher, gone):
                task.cancel()
            if forward.done() and not forward.cancelled() and forward.exception() is None:
                await forward.result().aclose()
            if invocation.done() and not invocation.cancelled():
                self._log_invocation(route, invocation_id, invocation)
            else:
                invocation.add_done_callback(lambda t: self._log_invocation(route, invocation_id, t))
            log.info("Executed 'Functions.%s' (%s, Id=%s, Duration=%dms)", route.name, outcome,
                     invocation_id, (time.perf_counter() - started) * 1000)

    async def _await_response(self, forward, invocation, gone):
        """The worker's response, or None when the host must answer itself (failed invocation the
        worker never paired with the request) or the caller is gone."""
        while True:
            done, _ = await asyncio.wait({forward, invocation, gone}, return_when=asyncio.FIRST_COMPLETED)
            if forward in done:
                return forward.result()
            if gone in done:
                return None
            if invocation in done:
                if not invocation.cancelled() and invocation.exception() is None \
                        and invocation.result().result.status == invocation.result().result.Success:
                    # Success: the worker has (or will have) the response; wait for it alone.
                    done, _ = await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
                    return forward.result() if forward in done else None
                try:
                    return await asyncio.wait_for(asyncio.shield(forward), FAILED_INVOCATION_GRACE)
                except TimeoutError:
                    return None

    async def _relay(self, response: httpx.Response, send) -> None:
        headers = [(k, v) for k, v in response.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:  # the worker dropped the connection mid-body
            log.warning("worker response ended early: %s", exc)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _log_invocation(self, route: Route, invocation_id: str, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("Invocation of 'Functions.%s' (Id=%s) raised: %r", route.name, invocation_id, task.exception())
            return
        result = task.result().result
        if result.status != result.Success:
            log.error("Executed 'Functions.%s' (Failed, Id=%s): %s", route.name, invocation_id,
                      result.exception.message)


class ClientGone(Exception):
    """The caller hung up before the request body was read."""


async def _plain(send, status: int, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", b"0"), *headers]})
    await send({"type": "http.response.body", "body": b""})
