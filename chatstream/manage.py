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
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request

from .api_openai import error_response
from .body import parse_json_body, read_body, require_json_content_type
from .errors import ApiError, ClientGone, invalid_request
from .settings import Settings
from .state.callers import NAME_PATTERN, CallerRegistry
from .state.ledger import MAX_USAGE_DAYS, Ledger, totals
from .state.store import Store, StoreConfigError, store_from_env

log = logging.getLogger("chatstream")

MAX_ADMIN_BODY = 64 * 1024  # a caller's definition is a few hundred bytes
NO_STORE = {"Cache-Control": "no-store"}
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _json(body: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=NO_STORE)


class Manage:
    """The admin API's handlers: each takes the request and returns a JSONResponse."""

    def __init__(self, registry: CallerRegistry | None, ledger: Ledger | None, clock: Callable[[], float] = time.time,
                 unavailable: str | None = None):
        self.registry = registry  # the request path should authenticate with this same registry
        self.ledger = ledger
        self.clock = clock
        self._unavailable = unavailable

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str] = os.environ,
                      store: Store | None = None) -> Manage:
        """Handlers on the app's store (``AzureWebJobsStorage``), or on ``store`` when the app already
        has one; without any, every handler answers 503 saying which setting is missing."""
        if store is None:
            try:
                store = store_from_env(environ)
            except StoreConfigError as exc:  # named in every answer; the rest of the app still runs
                log.error("the admin API is off: %s", exc)
                return cls(None, None, unavailable=str(exc))
        if store is None:
            return cls(None, None, unavailable="AzureWebJobsStorage is not set: callers need the app's storage")
        return cls(CallerRegistry(store, settings.caller_cache_seconds), Ledger(store))

    async def _answer(self, handler: Callable[[], Awaitable[JSONResponse]]) -> JSONResponse:
        if self.registry is None or self.ledger is None:
            return error_response(ApiError(503, "caller_store_not_configured", self._unavailable or "no store"))
        try:
            return await handler()
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
        async def run() -> JSONResponse:
            caller, key = await self.registry.create(await self._body(request))  # type: ignore[union-attr]
            return _json({**caller.public(), "key": key}, 201)
        return await self._answer(run)

    async def list(self, request: Request) -> JSONResponse:
        async def run() -> JSONResponse:
            callers = await self.registry.list()  # type: ignore[union-attr]
            return _json({"object": "list", "data": [c.public() for c in callers]})
        return await self._answer(run)

    async def get(self, request: Request) -> JSONResponse:
        async def run() -> JSONResponse:
            return _json((await self.registry.get(_name(request))).public())  # type: ignore[union-attr]
        return await self._answer(run)

    async def update(self, request: Request) -> JSONResponse:
        async def run() -> JSONResponse:
            name = _name(request)
            caller = await self.registry.update(name, await self._body(request))  # type: ignore[union-attr]
            return _json(caller.public())
        return await self._answer(run)

    async def delete(self, request: Request) -> JSONResponse:
        async def run() -> JSONResponse:
            caller = await self.registry.delete(_name(request))  # type: ignore[union-attr]
            return _json({"object": "caller.deleted", "name": caller.name, "deleted": True})
        return await self._answer(run)

    async def rotate(self, request: Request) -> JSONResponse:
        async def run() -> JSONResponse:
            caller, key = await self.registry.rotate(_name(request))  # type: ignore[union-attr]
            return _json({**caller.public(), "key": key})
        return await self._answer(run)

    async def usage(self, request: Request) -> JSONResponse:
        """``GET /api/manage/usage?caller=&from=YYYY-MM-DD&to=YYYY-MM-DD``: tokens and requests by
        caller, model and UTC day (default: the 30 days up to today; at most 366 days)."""
        async def run() -> JSONResponse:
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
            rows = await self.ledger.usage(caller, start, end)  # type: ignore[union-attr]
            return _json({"object": "usage", "caller": caller, "from": start.isoformat(), "to": end.isoformat(),
                          "data": rows, "total": totals(rows)})
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
