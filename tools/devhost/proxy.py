"""The host's HTTP front: match the route, then forward the raw request to the worker's HTTP
server with an ``x-ms-invocation-id`` header while sending the matching invocation, and relay the
response back chunk by chunk, unbuffered. When the caller hangs up, the forwarded request is
dropped, which makes the worker's Starlette cancel the function's stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from urllib.parse import parse_qsl

from . import cors
from .forward import WorkerConnectionError
from .routes import Route, match
from .worker import WorkerPool, WorkerProcess

log = logging.getLogger("devhost")

INVOCATION_HEADER = b"x-ms-invocation-id"
# Hop-by-hop headers (RFC 9110 7.6.1) are not forwarded in either direction; the framing headers
# are set by whoever writes the next hop.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Expect: 100-continue is answered by the front server (it sends the interim 100 when the body is
# first read); forwarded, it would make the worker send an interim response of its own.
NOT_FORWARDED = HOP_BY_HOP | {INVOCATION_HEADER, b"host", b"expect"}
# How long a failed invocation waits for the worker's own error response before the host answers.
FAILED_INVOCATION_GRACE = 1.0
# How long an invocation whose HTTP request got no answer from the worker (the forward failed, the
# caller left first) may still pair with it before the host cancels it (worker_process.py).
UNPAIRED_GRACE = 1.0
UNREACHED_WAIT = 2.0  # how long a request waits for an unreachable worker's exit to be noticed


class _Unreached(Exception):
    """The worker's HTTP server refused the connection before any of the request was read."""


class ClientGone(Exception):
    """The caller hung up before the request body was read."""


class Host:
    """ASGI application serving every HTTP function of the worker processes in ``workers``."""

    def __init__(self, workers: WorkerPool, routes: list[Route], cors_policy: cors.CorsPolicy = cors.CorsPolicy()):
        self.workers = workers
        self.routes = routes
        self.cors = cors_policy
        self.in_flight = 0  # function requests being served now

    async def aclose(self) -> None:
        pass  # the pool closes each worker's connections when it stops

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        server = scope.get("server")
        outcome, origin = cors.decide(self.cors, scope["headers"], server[1] if server else None)
        if outcome == cors.REFUSE:
            log.warning(
                "refused %s %r from %s (not an allowed origin; see --cors)",
                scope["method"],
                scope["path"],
                repr(origin) if origin is not None else "another site",
            )
            await _json(send, cors.refusal_body(origin), 403)
            return
        if outcome == cors.SERVE_CORS:
            if scope["method"] == "OPTIONS" and any(
                k.lower() == b"access-control-request-method" for k, _ in scope["headers"]
            ):
                await _plain(send, 204, cors.preflight_headers(self.cors, origin, scope["headers"]))
                return
            send = _adding_headers(send, cors.response_headers(self.cors, origin))
        if scope["path"] == "/_devhost/stats":
            if scope["method"] != "GET":
                await _plain(send, 405, [(b"allow", b"GET")])
                return
            await _json(send, json.dumps(await self.workers.stats()).encode())
            return
        route, params, allowed = match(self.routes, scope["path"], scope["method"])
        if route is None:
            extra = [(b"allow", ", ".join(allowed).encode())] if allowed else []
            await _plain(send, 405 if allowed else 404, extra)
            return
        await self._invoke(route, params, scope, receive, send)

    async def _invoke(self, route: Route, params, scope, receive, send):
        # The HTTP request and its invocation go to the same worker process. One that cannot be
        # reached before any of the request was read may have died a moment ago (its exit not yet
        # noticed): the request waits for another, as it does while a worker restarts.
        for last in (False, True):
            worker = await self.workers.acquire()
            if worker is None:
                log.error("no worker process is ready to take 'Functions.%s'", route.name)
                await _plain(send, 503)
                return
            worker.in_flight += 1
            self.in_flight += 1
            try:
                await self._invoke_on(worker, route, params, scope, receive, send, last)
                return
            except _Unreached:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(worker.exited), UNREACHED_WAIT)
            finally:
                worker.in_flight -= 1
                self.in_flight -= 1

    async def _invoke_on(self, worker: WorkerProcess, route: Route, params, scope, receive, send, last: bool = True):
        invocation_id = str(uuid.uuid4())
        started = time.perf_counter()
        # A caller must never choose the invocation id (it would pair its request with another
        # invocation): drop theirs and hop-by-hop headers, add ours.
        # So are the headers that the caller's Connection header names (RFC 9110 7.6.1), such as
        # HTTP2-Settings of a declined h2c upgrade.
        named = {t.strip().lower() for k, v in scope["headers"] if k.lower() == b"connection" for t in v.split(b",")}
        headers = [
            (k.lower(), v) for k, v in scope["headers"] if k.lower() not in NOT_FORWARDED and k.lower() not in named
        ]
        caller_framing = {
            k.lower(): v for k, v in scope["headers"] if k.lower() in (b"content-length", b"transfer-encoding")
        }
        headers.append((INVOCATION_HEADER, invocation_id.encode()))
        raw_query = scope.get("query_string", b"")
        target = scope.get("raw_path") or scope["path"].encode()
        if raw_query:
            target += b"?" + raw_query
        host = dict(scope["headers"]).get(b"host", b"localhost").decode("latin-1")
        url = f"{scope.get('scheme', 'http')}://{host}{target.decode('latin-1')}"

        has_body = b"content-length" in caller_framing or b"transfer-encoding" in caller_framing
        body_done = asyncio.Event()
        disconnected = asyncio.Event()

        read = False

        async def request_body():
            nonlocal read
            while True:
                read = True
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
            if has_body:
                await body_done.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        log.info("Executing 'Functions.%s' (Id=%s)", route.name, invocation_id)
        try:
            exchange = await worker.forwarder.send(
                scope["method"],
                target,
                headers,
                request_body() if has_body else None,
                chunked=has_body and b"content-length" not in caller_framing,
            )
        except OSError as exc:
            if not last and not read:
                raise _Unreached from exc
            log.error("cannot reach the worker's HTTP server: %s", exc)
            await _plain(send, 502)
            return
        forward = asyncio.ensure_future(exchange.start())
        invocation = asyncio.ensure_future(
            worker.invoke(
                invocation_id,
                route.function_id,
                route.trigger_param,
                method=scope["method"],
                url=url,
                headers={k.decode("latin-1"): v.decode("latin-1") for k, v in headers},
                query=dict(parse_qsl(raw_query.decode("latin-1"), keep_blank_values=True)),
                params=params,
            )
        )
        watcher = asyncio.ensure_future(watch_disconnect())
        gone = asyncio.ensure_future(disconnected.wait())
        outcome = "Succeeded"
        response = None
        try:
            response = await self._await_response(forward, invocation, gone)
            if response is None:
                if disconnected.is_set():
                    outcome = "Cancelled (caller disconnected)"
                else:
                    outcome = "Failed"
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
        except WorkerConnectionError as exc:
            outcome = "Failed"
            log.error("forwarding to the worker failed: %s", exc)
            await _plain(send, 502)
        except asyncio.CancelledError:  # the host's shutdown timeout passed: the request is cut
            outcome = "Cancelled (the host's shutdown timeout passed)"
            raise
        finally:
            for task in (forward, watcher, gone):
                task.cancel()
            exchange.close()
            if invocation.done():
                self._log_invocation(route, invocation_id, invocation)
            else:
                invocation.add_done_callback(lambda t: self._log_invocation(route, invocation_id, t))
                if response is None:  # its request may never reach the worker, which would wait for it forever
                    asyncio.get_running_loop().call_later(UNPAIRED_GRACE, worker.cancel, invocation_id)
            log.info(
                "Executed 'Functions.%s' (%s, Id=%s, Duration=%dms)",
                route.name,
                outcome,
                invocation_id,
                (time.perf_counter() - started) * 1000,
            )

    async def _await_response(self, forward, invocation, gone):
        """The worker's response, or None when the host must answer itself (failed invocation the
        worker never paired with the request) or the caller is gone."""
        done, _ = await asyncio.wait({forward, invocation, gone}, return_when=asyncio.FIRST_COMPLETED)
        if forward in done:
            return forward.result()
        if gone in done:
            return None
        if (
            not invocation.cancelled()
            and invocation.exception() is None
            and invocation.result().result.status == invocation.result().result.Success
        ):
            # Success: the worker has (or will have) the response; wait for it alone.
            done, _ = await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
            return forward.result() if forward in done else None
        done, _ = await asyncio.wait(
            {forward, gone}, timeout=FAILED_INVOCATION_GRACE, return_when=asyncio.FIRST_COMPLETED
        )
        return forward.result() if forward in done else None

    @staticmethod
    async def _relay(response, send) -> None:
        headers = [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except WorkerConnectionError as exc:  # the worker dropped the connection mid-body
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
        if result.status == result.Cancelled:
            log.warning(
                "Invocation of 'Functions.%s' (Id=%s) cancelled: %s",
                route.name,
                invocation_id,
                result.exception.message,
            )
        elif result.status != result.Success:
            log.error(
                "Executed 'Functions.%s' (Failed, Id=%s): %s", route.name, invocation_id, result.exception.message
            )


async def _plain(send, status: int, headers=()) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0"), *headers]})
    await send({"type": "http.response.body", "body": b""})


async def _json(send, body: bytes, status: int = 200) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _adding_headers(send, extra: list[tuple[bytes, bytes]]):
    """``send`` with ``extra`` headers added to the response head."""

    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return wrapped
