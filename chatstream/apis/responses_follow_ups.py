"""The calls about a stored response: ``GET /api/v1/responses/{id}`` (also re-streamed with
``?stream=true&starting_after=N``), ``DELETE``, ``POST …/{id}/cancel`` and ``GET …/{id}/input_items``.

Only the upstream entry that made a response knows its id, so each call asks the entries in priority
order, moving on past a 404, a 429, a 5xx, a failed connection or a timeout (``Upstreams.each``).
Each obeys the app's time limits (an answer within the first-token limit, a re-stream within the
idle and total limits), ends when the caller hangs up (closing the upstream), and writes one log
line. Only the query parameters OpenAI defines for the call are passed on (never the Functions key).
With text steps on, response objects have their texts through them, and a re-stream goes through the
stream core with a ``ResponseStream`` (as every re-stream does, so it gets the same final events)."""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .. import telemetry
from ..endpoint import stream_response, unless_gone
from ..errors import (
    ApiError,
    ClientGone,
    ErrorKind,
    as_status,
    first_token_expired,
    internal_error,
    invalid_request,
    total_expired,
)
from ..http import NO_STORE, EventStreamResponse
from ..pipeline import Pipeline
from ..record import StreamRecord
from ..settings import Settings
from ..state.accounting import Accounting
from ..state.callers import Caller
from ..state.port import Unavailable
from ..stream import Ends, StreamProtocol, TimeLimits, UpstreamChunks, relay
from ..upstreams.clients import SdkClient
from ..upstreams.failover import Upstreams
from .openai_chat import error_response
from .refusals import authenticated, store_unavailable
from .responses_stream import ResponseEncoder, ResponseStream, filter_response
from .usage import usage_of

log = logging.getLogger("chatstream")

RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,200}")
_OVER = frozenset({"completed", "incomplete", "failed", "cancelled"})  # a response's final statuses
# Each call: the method and path suffix it is relayed with, and the query parameters OpenAI defines
# for it; any other is dropped (the Functions key `code` among them, in any case).
_CALLS = {
    "retrieve": ("get", "", frozenset({"include", "include[]", "include_obfuscation", "stream", "starting_after"})),
    "input_items": ("get", "/input_items", frozenset({"after", "before", "include", "include[]", "limit", "order"})),
    "cancel": ("post", "/cancel", frozenset()),
    "delete": ("delete", "", frozenset()),
}


class ResponseFollowUps:
    """The four calls, and a re-stream's ``stream.Upstream``: a stored response's events from
    whichever entry holds it (``open``, its query as the relay's ``params``)."""

    def __init__(self, settings: Settings, upstreams: Upstreams, pipeline: Pipeline, accounting: Accounting | None):
        self.settings = settings
        self.upstreams = upstreams
        self.pipeline = pipeline
        self.accounting = accounting  # CALLER_KEYS=required: a response is read, changed only by its caller
        # One entry's share of the wait for an answer; the whole wait is the first-token limit.
        self.attempt_timeout = min(
            settings.entry_first_token_timeout or settings.first_token_timeout, settings.first_token_timeout
        )

    async def open(
        self, path: str, params: dict, protocol: StreamProtocol, limits: TimeLimits, record: StreamRecord
    ) -> UpstreamChunks:
        return await self.upstreams.reopen(path, params, protocol, self.attempt_timeout)

    async def __call__(self, request: Request, operation: str) -> Response:
        """``operation`` (``retrieve``, ``delete``, ``cancel``, ``input_items``) on the response the
        path names: the id checked, the call made, one log line, errors in OpenAI's shape."""
        query = _query(request, operation)
        record = StreamRecord(endpoint=f"responses.{operation}", model="")
        record.request_id = record.id
        telemetry.begin(record)
        streaming = False
        try:
            caller = await authenticated(self.accounting, request.headers) if self.accounting else None
            response_id = request.path_params.get("response_id", "")
            if not RESPONSE_ID.fullmatch(response_id):
                raise invalid_request("the response id must look like resp_… (letters, digits, _ and -)", "response_id")
            if caller is not None and self.accounting is not None:
                record.caller = caller.name
                owned = await self.accounting.owned(caller, "response", response_id)
                if isinstance(owned, Unavailable):
                    raise store_unavailable()
                if owned is None:  # not revealed to others
                    raise ApiError(404, ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.")
            if operation == "retrieve" and str(query.get("stream", "")).lower() == "true":
                response = await self._restream(request, response_id, query, record)
            else:
                response = await self._answer(request, operation, response_id, query, record, caller)
            streaming = isinstance(response, EventStreamResponse)  # its log line comes when it ends
            return response
        except ClientGone:
            record.hung_up(499)
            return Response(status_code=499)
        except ApiError as error:
            return self._refuse(record, error)
        except Exception:  # a bug of ours
            log.exception("a response follow-up failed (%s)", operation)
            return self._refuse(record, internal_error())
        finally:
            if not streaming:
                _finish(record)

    async def _answer(
        self,
        request: Request,
        operation: str,
        response_id: str,
        query: dict,
        record: StreamRecord,
        caller: Caller | None,
    ) -> Response:
        method, suffix, _ = _CALLS[operation]
        path = f"/responses/{response_id}{suffix}"

        async def call(client: SdkClient) -> Any:
            return await getattr(client, method)(path, cast_to=object, options={"params": query})

        first_token, total = self.settings.first_token_timeout, self.settings.total_timeout
        expired = first_token_expired if first_token < total else total_expired
        body = await unless_gone(
            request, self.upstreams.each(call, self.attempt_timeout), min(first_token, total), expired
        )
        if not isinstance(body, dict):
            raise ApiError(
                502, ErrorKind.UPSTREAM_MALFORMED, "the model server sent a malformed answer", retryable=True
            )
        if self.pipeline.filters_text and body.get("object") == "response":
            body = await filter_response(body, self.pipeline, StreamRecord(endpoint="responses", model=""))
        record.ended(body.get("status") if isinstance(body.get("status"), str) else None, None)
        if self.accounting is not None and caller is not None:
            await self._account(operation, response_id, body, record, caller)
        return JSONResponse(body, headers={**NO_STORE, "x-request-id": record.request_id})

    async def _account(
        self, operation: str, response_id: str, body: dict, record: StreamRecord, caller: Caller
    ) -> None:
        """A deleted response is no one's any more; one read back finished is charged, once."""
        assert self.accounting is not None
        if operation == "delete" and body.get("deleted"):
            await self.accounting.forget("response", response_id)
        elif body.get("object") == "response" and body.get("status") in _OVER:
            used = usage_of(body.get("usage"))
            if used is not None:
                model = str(body.get("model") or "")
                await self.accounting.charge_seen(caller, "response", response_id, model, used, record.endpoint)

    def _refuse(self, record: StreamRecord, error: ApiError) -> Response:
        response = error_response(as_status(error))
        response.headers["x-request-id"] = record.request_id
        record.refused(response.status_code, error.type)
        return response

    async def _restream(self, request: Request, response_id: str, query: dict, record: StreamRecord) -> Response:
        """A stored response's events again, after ``starting_after``: through the stream core."""
        limits = TimeLimits(self.settings)
        protocol = ResponseStream(self.pipeline if self.pipeline.filters_text else None, resumed=True)
        events = relay(
            self,
            f"/responses/{response_id}",
            query,
            protocol,
            limits,
            record,
            Ends(functools.partial(_finish, record)),
        )
        return await stream_response(
            request,
            events,
            ResponseEncoder(),
            limits,
            record,
            self.settings.heartbeat,
            lambda error: self._refuse(record, error),
            {},
        )


def _finish(record: StreamRecord) -> None:
    if record.report():
        log.info(record.log_line())
        telemetry.finish(record)


def _query(request: Request, operation: str) -> dict:
    """The query parameters OpenAI defines for ``operation``, in the caller's order; a repeated one
    as the list of its values."""
    params, allowed = request.query_params, _CALLS[operation][2]
    lists = {key: params.getlist(key) for key in params if key in allowed}
    return {key: values[0] if len(values) == 1 else values for key, values in lists.items()}
