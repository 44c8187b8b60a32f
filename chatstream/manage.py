"""The admin API, under ``/api/manage/`` (docs/callers.md): callers (create, list, read, change,
delete, rotate a key), teams, prices, and usage (JSON, or CSV for finance).

Who may call it, and why not ``/api/admin/``: function_app.py, where the routes are declared.

Every answer is JSON with ``Cache-Control: no-store`` (the usage also CSV, with ``Accept: text/csv``
or ``?format=csv``); errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``),
turned from the registry's answers (state/port.py) here. A key appears in exactly two answers: the
201 of a create and the answer of a rotate; never in a list, a read, an error or a log line."""

from __future__ import annotations

import csv
import io
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.requests import Request

from .apis.openai_chat import error_response
from .errors import ApiError, ClientGone, ErrorKind, StoreError, invalid_request
from .http import NO_STORE, read_json, validate_object, with_request_id
from .state import counter_row
from .state.callers import (
    NAME_PATTERN,
    Caller,
    CallerPatch,
    CallerSpec,
    Limits,
    Team,
    TeamPatch,
    TeamSpec,
)
from .state.ledger import MAX_USAGE_DAYS, ZEROS
from .state.port import Conflict, Invalid, Missing, Unreadable
from .state.prices import PICO, Price, PriceSpec, usd
from .state.shared import SharedState
from .state.stored import iso

log = logging.getLogger("chatstream")

MAX_ADMIN_BODY = 64 * 1024  # a caller's definition is a few hundred bytes
S = TypeVar("S", bound=BaseModel)
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _json(body: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=NO_STORE)


def _limits_json(limits: Limits) -> dict[str, Any]:
    return {
        "tokens_per_minute": limits.tokens_per_minute,
        "requests_per_minute": limits.requests_per_minute,
        "token_budget": limits.token_budget,
        "spend_budget": usd(limits.spend_budget),
        "budget_period": limits.budget_period,
        "models": list(limits.models) if limits.models is not None else None,
        "model_limits": {m: limit.model_dump() for m, limit in limits.model_limits.items()} or None,
    }


def caller_json(caller: Caller) -> dict[str, Any]:
    """A caller as the admin API shows it: everything but the key (its last 4 characters only)."""
    return {
        "object": "caller",
        "name": caller.name,
        "id": caller.id,
        "team": caller.team,
        **_limits_json(caller),
        "expires_at": iso(caller.expires_at),
        "created_at": iso(caller.created_at),
        "key_hint": caller.key_hint,
    }


def team_json(team: Team) -> dict[str, Any]:
    return {
        "object": "team",
        "name": team.name,
        "id": team.id,
        **_limits_json(team),
        "created_at": iso(team.created_at),
    }


def price_json(price: Price) -> dict[str, Any]:
    return {
        "object": "price",
        "model": price.model,
        "input": usd(price.input * 10**6),
        "cached_input": usd(price.cached_input * 10**6),
        "output": usd(price.output * 10**6),
        "unit": "USD per 1M tokens",
        "updated_at": iso(price.updated_at),
    }


@dataclass(frozen=True)
class Collection:
    """One of the admin API's collections: what it holds, what a create (POST) and a change (PATCH,
    a price's PUT) take, the path parameter naming an item, and how an item is shown."""

    cls: type[Caller] | type[Team] | type[Price]
    object: str
    create: type[CallerSpec] | type[TeamSpec] | None  # None: an item is PUT (a price)
    change: type[CallerPatch] | type[TeamPatch] | None
    param: str
    json: Callable[[Any], dict[str, Any]]


COLLECTIONS = {
    "callers": Collection(Caller, "caller", CallerSpec, CallerPatch, "name", caller_json),
    "teams": Collection(Team, "team", TeamSpec, TeamPatch, "name", team_json),
    "prices": Collection(Price, "price", None, None, "model", price_json),
}


async def _shown(
    state: SharedState, admin: Collection, items: Sequence[Caller | Team | Price | Unreadable]
) -> list[dict[str, Any]]:
    """Items as a list or a read shows them: a caller or team with how much of its budgets is taken;
    one whose row holds none (a hand edit) as ``unreadable`` (why), for an admin to delete it (or
    set it again: a price)."""
    spent = await _budgets_now(state, [o for o in items if isinstance(o, Caller | Team)])
    return [
        _unreadable_json(admin, o)
        if isinstance(o, Unreadable)
        else {**admin.json(o), **(spent.get(o.limits_partition, {}) if not isinstance(o, Price) else {})}
        for o in items
    ]


def _unreadable_json(admin: Collection, found: Unreadable) -> dict[str, Any]:
    shown = {"object": admin.object, admin.param: found.name, "unreadable": found.why}
    return shown | ({"id": found.id} if found.id else {})


def validate(model: type[S], data: object) -> S:
    """A JSON body as ``model`` (the registry's typed request), or a 400 naming the field of
    pydantic's error (cut at 64 characters; never echoing the value): "unknown field" for one the
    admin API does not know, a nested field's path in brackets."""

    def describe(first: dict) -> tuple[str, str | None]:
        loc = [str(p) for p in first["loc"]]
        param = loc[0] if loc else None
        if param is not None and len(param) > 64:
            param = param[:64] + "…"
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field"
        elif len(loc) > 1:
            message = f"[{']['.join(p[:64] for p in loc[1:])}]: {message}"
        return (f"{param}: {message}" if param else message), param

    return validate_object(model, data, describe)


def _admin_error(error: Exception) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, Invalid):
        return invalid_request(str(error), error.param)
    if isinstance(error, Missing):
        return ApiError(404, f"{error.kind.split()[0]}_not_found", str(error)[:200], "name")
    if isinstance(error, Conflict):
        return ApiError(409, "conflict", str(error))
    if isinstance(error, ClientGone):
        return invalid_request("the body was not sent completely")
    # A StoreError, the registry's or a read made here: nothing was changed, or the change may be
    # retried (every admin write is idempotent or conditional).
    log.warning("admin API: the store did not answer: %s", error)
    return ApiError(
        503, ErrorKind.CALLER_STORE_UNAVAILABLE, "the app's store did not answer in time; try again", retryable=True
    )


class Manage:
    """The admin API's handlers: each takes the request and returns a response. Without the app's
    storage (``state`` None) every one answers 503 naming the setting; the rest of the app runs."""

    def __init__(self, state: SharedState | None):
        self.state = state

    async def _answer(self, handler: Callable[[SharedState], Awaitable[Response]]) -> Response:
        try:
            if self.state is None:
                message = "AzureWebJobsStorage is not set: callers need the app's storage"
                raise ApiError(503, "caller_store_not_configured", message)
            self.state.instances.serve()  # an instance the operators use takes its part in the duty too
            return with_request_id(await handler(self.state))
        except (ApiError, Invalid, Missing, Conflict, ClientGone, StoreError) as error:
            return with_request_id(error_response(_admin_error(error)))
        except Exception:
            log.exception("admin API: the request failed")
            return with_request_id(error_response(ApiError(500, "internal_error", "the request failed unexpectedly")))

    async def _body(self, request: Request, model: type[S]) -> S:
        """The body as the registry's typed request (Invalid, naming the field, if it is not one)."""
        return validate(model, await read_json(request, MAX_ADMIN_BODY))

    # --- callers, teams and prices: one path (function_app.py names the collection) ----------------

    async def collection(self, request: Request, kind: str) -> Response:
        admin = COLLECTIONS[kind]

        async def run(state: SharedState) -> Response:
            if request.method == "POST" and admin.create is not None:
                made, key = await state.registry.create(await self._body(request, admin.create))
                return _json({**admin.json(made), **({"key": key} if key else {})}, 201)
            return _json({"object": "list", "data": await _shown(state, admin, await state.registry.list(admin.cls))})

        return await self._answer(run)

    async def item(self, request: Request, kind: str) -> Response:
        admin = COLLECTIONS[kind]
        name = request.path_params.get(admin.param) or ""

        async def run(state: SharedState) -> Response:
            registry = state.registry
            if request.method == "PATCH" and admin.change is not None:
                return _json(
                    admin.json(await registry.update(admin.cls, name, await self._body(request, admin.change)))
                )
            if request.method == "PUT":
                return _json(admin.json(await registry.set_price(name, await self._body(request, PriceSpec))))
            if request.method == "DELETE":
                gone = await registry.delete(admin.cls, name)
                shown = gone.name if isinstance(gone, Unreadable) else getattr(gone, admin.param)
                return _json({"object": f"{admin.object}.deleted", admin.param: shown, "deleted": True})
            return _json((await _shown(state, admin, [await registry.get(admin.cls, name)]))[0])

        return await self._answer(run)

    async def rotate(self, request: Request) -> Response:
        async def run(state: SharedState) -> Response:
            caller, key = await state.registry.rotate(request.path_params.get("name") or "")
            return _json({**caller_json(caller), "key": key})

        return await self._answer(run)

    # --- usage --------------------------------------------------------------------------------

    async def usage(self, request: Request) -> Response:
        async def run(state: SharedState) -> Response:
            query = request.query_params
            caller = _filter(query.get("caller"), "caller")
            team = _filter(query.get("team"), "team")
            model = query.get("model") or None
            if model is not None and (len(model) > 256 or not model.isprintable()):
                raise invalid_request("model: not a model name", "model")
            today = datetime.fromtimestamp(state.store.clock.now(), UTC).date()
            end = _date(query.get("to"), "to") or today
            start = _date(query.get("from"), "from") or end - min(timedelta(days=29), end - date.min)
            if start > end:
                raise invalid_request("from: must not be after to", "from")
            if (end - start).days + 1 > MAX_USAGE_DAYS:
                raise invalid_request(f"from: a query covers at most {MAX_USAGE_DAYS} days", "from")
            # By id (a name made again is another caller or team); a deleted one's rows go by name.
            caller_id = await _id_of(state, Caller, caller)
            team_id = await _id_of(state, Team, team)
            rows = await state.ledger.usage(start, end, caller_id, team, model, team_id)
            if caller is not None and caller_id is None:
                rows = [r for r in rows if r["caller"] == caller]
            if query.get("format") == "csv" or "text/csv" in (request.headers.get("accept") or ""):
                name = f"usage-{start.isoformat()}-{end.isoformat()}.csv"
                return Response(
                    as_csv(rows),
                    media_type="text/csv; charset=utf-8",
                    headers={**NO_STORE, "Content-Disposition": f'attachment; filename="{name}"'},
                )
            return _json(
                {
                    "object": "usage",
                    "caller": caller,
                    "team": team,
                    "model": model,
                    "from": start.isoformat(),
                    "to": end.isoformat(),
                    "data": rows,
                    "total": totals(rows),
                }
            )

        return await self._answer(run)


async def _id_of(state: SharedState, cls: type[Caller] | type[Team], name: str | None) -> str | None:
    """The id of the caller or team ``name`` (None: no name, or it was deleted)."""
    if name is None:
        return None
    try:
        return (await state.registry.get(cls, name)).id  # (an unreadable one's, if its row has it)
    except Missing:
        return None


async def _budgets_now(state: SharedState, owners: Sequence[Caller | Team]) -> dict[str, dict[str, Any]]:
    """How much of each budget is taken this period (spent, or held by a request in flight), from the
    counter rows: ``token_budget_used``, ``spend_budget_used`` (USD)."""
    now = state.store.clock.now()
    out: dict[str, dict[str, Any]] = {}
    for key, field in (("tokens", "token_budget_used"), ("spend", "spend_budget_used")):
        budgeted = [o for o in owners if (o.token_budget if key == "tokens" else o.spend_budget) is not None]
        periods = {o.limits_partition: o.budget_period for o in budgeted}
        if periods:
            taken = await counter_row.taken_this_period(state.store, key, periods, now, 10.0)
            for partition, amount in taken.items():
                out.setdefault(partition, {})[field] = usd(amount) if key == "spend" else amount
    return out


def _filter(value: str | None, param: str) -> str | None:
    if not value:
        return None
    if not NAME_PATTERN.fullmatch(value):
        raise invalid_request(f"{param}: not a {param} name", param)
    return value


def _date(value: str | None, param: str) -> date | None:
    if not value:
        return None
    if not _DATE.fullmatch(value):
        raise invalid_request(f"{param}: a date as YYYY-MM-DD", param)
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise invalid_request(f"{param}: not a valid date", param) from None


# --- usage as the admin API answers it ----------------------------------------------------------


def totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The sums over usage rows (the admin API's ``total``)."""
    total: dict[str, Any] = {f: sum(int(r[f]) for r in rows) for f in ZEROS}
    total["cost_usd"] = usd(total["cost_picousd"])
    return total


CSV_COLUMNS = (
    "day",
    "caller",
    "team",
    "model",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "total_tokens",
    "cost_usd",
    "unpriced_requests",
)


def as_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """Usage rows for finance: one line per day, caller, team and model; ``cost_usd`` an exact
    decimal (12 places); a last line of totals."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow([_csv_value(row, c) for c in CSV_COLUMNS])
    total = totals(rows)
    writer.writerow(["total", "", "", "", *(_csv_value(total, c) for c in CSV_COLUMNS[4:])])
    return out.getvalue()


def usd_text(pico: int) -> str:
    """Pico-dollars as an exact decimal USD string (12 places, for finance)."""
    sign = "-" if pico < 0 else ""
    whole, frac = divmod(abs(pico), PICO)
    return f"{sign}{whole}.{frac:012d}"


def _csv_value(row: Mapping[str, Any], column: str) -> str:
    if column == "cost_usd":
        return usd_text(int(row["cost_picousd"]))
    value = row.get(column)
    text = "" if value is None else str(value)
    # A cell a spreadsheet would run as a formula is quoted as text (caller names are ours; models are not).
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text
