"""The admin API for callers, under ``/api/manage/`` (docs/callers.md): create, list, read, change,
delete callers, rotate a caller's key, read usage.

``/api/admin/...`` would be the obvious path, but the Functions host refuses any route template that
starts with ``admin`` (its own admin API's), even under the ``api`` prefix. function_app.py declares
these routes with ``AuthLevel.ADMIN``: in Azure only the host's master key opens them; the local
hosts (``func start``, tools/devhost) check no key at all.

Every answer is JSON with ``Cache-Control: no-store``; errors are OpenAI-shaped
(``{"error": {"message", "type", "param", "code"}}``). A key appears in exactly two answers: the 201
of a create and the answer of a rotate; never in a list, a read, an error or a log line."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, date, datetime, timedelta
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request

from .apis.openai_chat import error_response
from .errors import ApiError, ClientGone, invalid_request
from .http import parse_json_body, read_body, require_json_content_type, with_request_id
from .state.callers import NAME_PATTERN
from .state.ledger import MAX_USAGE_DAYS, totals
from .state.shared import SharedState

log = logging.getLogger("chatstream")

MAX_ADMIN_BODY = 64 * 1024  # a caller's definition is a few hundred bytes
NO_STORE = {"Cache-Control": "no-store"}
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _json(body: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=NO_STORE)


class Manage:
    """The admin API's handlers: each takes the request and returns a JSONResponse. Without the app's
    storage (``state`` None) every one answers 503 naming the setting; the rest of the app runs."""

    def __init__(self, state: SharedState | None, clock: Callable[[], float] = time.time):
        self.state = state
        self.clock = clock

    async def _answer(self, handler: Callable[[SharedState], Awaitable[JSONResponse]]) -> JSONResponse:
        return with_request_id(await self._answered(handler))

    async def _answered(self, handler: Callable[[SharedState], Awaitable[JSONResponse]]) -> JSONResponse:
        if self.state is None:
            return error_response(
                ApiError(
                    503, "caller_store_not_configured", "AzureWebJobsStorage is not set: callers need the app's storage"
                )
            )
        try:
            return await handler(self.state)
        except ApiError as error:
            return error_response(error)
        except ClientGone:
            return error_response(invalid_request("the body was not sent completely"))
        except Exception:
            log.exception("admin API: the request failed")
            return error_response(ApiError(500, "internal_error", "the request failed unexpectedly"))

    async def _body(self, request: Request) -> object:
        require_json_content_type(request.headers.get("content-type"))
        return parse_json_body(await read_body(request, MAX_ADMIN_BODY))

    # --- routes that serve several methods (function_app.py) ----------------------------------

    async def callers(self, request: Request) -> JSONResponse:
        """``/api/manage/callers``: GET lists, POST creates."""
        return await (self.create(request) if request.method == "POST" else self.list(request))

    async def caller(self, request: Request) -> JSONResponse:
        """``/api/manage/callers/{name}``: GET, PATCH, DELETE."""
        if request.method == "PATCH":
            return await self.update(request)
        if request.method == "DELETE":
            return await self.delete(request)
        return await self.get(request)

    # --- one handler per operation ------------------------------------------------------------

    async def create(self, request: Request) -> JSONResponse:
        async def run(state: SharedState) -> JSONResponse:
            caller, key = await state.registry.create(await self._body(request))
            return _json({**caller.public(), "key": key}, 201)

        return await self._answer(run)

    async def list(self, request: Request) -> JSONResponse:
        async def run(state: SharedState) -> JSONResponse:
            callers = await state.registry.list()
            return _json({"object": "list", "data": [c.public() for c in callers]})

        return await self._answer(run)

    async def get(self, request: Request) -> JSONResponse:
        async def run(state: SharedState) -> JSONResponse:
            return _json((await state.registry.get(_name(request))).public())

        return await self._answer(run)

    async def update(self, request: Request) -> JSONResponse:
        async def run(state: SharedState) -> JSONResponse:
            name = _name(request)
            caller = await state.registry.update(name, await self._body(request))
            return _json(caller.public())

        return await self._answer(run)

    async def delete(self, request: Request) -> JSONResponse:
        async def run(state: SharedState) -> JSONResponse:
            caller = await state.registry.delete(_name(request))
            return _json({"object": "caller.deleted", "name": caller.name, "deleted": True})

        return await self._answer(run)

    async def rotate(self, request: Request) -> JSONResponse:
        async def run(state: SharedState) -> JSONResponse:
            caller, key = await state.registry.rotate(_name(request))
            return _json({**caller.public(), "key": key})

        return await self._answer(run)

    async def usage(self, request: Request) -> JSONResponse:
        """``GET /api/manage/usage?caller=&from=YYYY-MM-DD&to=YYYY-MM-DD``: tokens and requests by
        caller, model and UTC day (default: the 30 days up to today; at most 366 days)."""

        async def run(state: SharedState) -> JSONResponse:
            query = request.query_params
            caller = query.get("caller") or None
            if caller is not None and not NAME_PATTERN.fullmatch(caller):
                raise invalid_request("caller: not a caller name", "caller")
            today = datetime.fromtimestamp(self.clock(), UTC).date()
            end = _date(query.get("to"), "to") or today
            start = _date(query.get("from"), "from") or end - timedelta(days=29)
            if start > end:
                raise invalid_request("from: must not be after to", "from")
            if (end - start).days + 1 > MAX_USAGE_DAYS:
                raise invalid_request(f"from: a query covers at most {MAX_USAGE_DAYS} days", "from")
            rows = await state.ledger.usage(caller, start, end)
            return _json(
                {
                    "object": "usage",
                    "caller": caller,
                    "from": start.isoformat(),
                    "to": end.isoformat(),
                    "data": rows,
                    "total": totals(rows),
                }
            )

        return await self._answer(run)


def _name(request: Request) -> str:
    return request.path_params.get("name") or ""


def _date(value: str | None, param: str) -> date | None:
    if not value:
        return None
    if not _DATE.fullmatch(value):
        raise invalid_request(f"{param}: a date as YYYY-MM-DD", param)
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise invalid_request(f"{param}: not a valid date", param) from None
