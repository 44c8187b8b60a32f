"""chatstream/manage.py over HTTP, in process (httpx's ASGITransport over a Starlette app that mounts
the handlers as function_app.py does) on the in-process store:
statuses, OpenAI-shaped errors, no-store, the key only in the answers of create and rotate, teams,
prices, and usage as JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import logging
from datetime import UTC, datetime

import httpx
import pytest
from memory_store import Fault, MemoryStore
from starlette.applications import Starlette
from starlette.routing import Route

from chatstream.manage import Manage
from chatstream.settings import Settings, SettingsError
from chatstream.state.callers import Caller
from chatstream.state.ledger import Charge
from chatstream.state.prices import PriceSpec
from chatstream.state.shared import SharedState
from chatstream.state.store import CALLERS_TABLE, LIMITS_TABLE, USAGE_TABLE

from .state_helpers import account, admit, finish, settings, usage

# Waits with nothing to do are skipped, not slept (tests/idle_clock.py): timers, limits and
# leases fire in the order real time gives them.
pytestmark = pytest.mark.skips_idle_time


def app_for(manage: Manage) -> Starlette:
    def collection(kind: str):
        async def handler(request):
            return await manage.collection(request, kind)

        return handler

    def item(kind: str):
        async def handler(request):
            return await manage.item(request, kind)

        return handler

    return Starlette(
        routes=[
            Route("/api/manage/callers", collection("callers"), methods=["GET", "POST"]),
            Route("/api/manage/callers/{name}", item("callers"), methods=["GET", "PATCH", "DELETE"]),
            Route("/api/manage/callers/{name}/rotate", manage.rotate, methods=["POST"]),
            Route("/api/manage/teams", collection("teams"), methods=["GET", "POST"]),
            Route("/api/manage/teams/{name}", item("teams"), methods=["GET", "PATCH", "DELETE"]),
            Route("/api/manage/prices", collection("prices"), methods=["GET"]),
            Route("/api/manage/prices/{model:path}", item("prices"), methods=["GET", "PUT", "DELETE"]),
            Route("/api/manage/usage", manage.usage, methods=["GET"]),
        ]
    )


class Admin:
    """The admin API of one instance on its own in-process account."""

    def __init__(self, state: SharedState | None = None):
        self.state = state or SharedState.on(MemoryStore(account()), settings())
        self.state.journal.interval = 0.05
        self.store = self.state.store
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app_for(Manage(self.state))), base_url="http://app"
        )

    async def __aenter__(self) -> Admin:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.http.aclose()
        await self.state.close()


def openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "chatstream_kind"}
    assert error["code"] == code and error["param"] == param, error
    assert response.headers["cache-control"] == "no-store"
    assert response.headers["x-request-id"]
    return error


async def test_the_caller_lifecycle_over_http(caplog):
    caplog.set_level(logging.DEBUG)
    async with Admin() as admin:
        http = admin.http
        created = await http.post(
            "/api/manage/callers", json={"name": "app", "tokens_per_minute": 1000, "models": ["gpt-4o-mini"]}
        )
        assert created.status_code == 201 and created.headers["cache-control"] == "no-store"
        key = created.json()["key"]
        assert key.startswith("csk-") and created.json()["name"] == "app" and created.json()["key_hint"] == key[-4:]
        keys = [key]
        listed = await http.get("/api/manage/callers")
        assert listed.status_code == 200 and listed.headers["cache-control"] == "no-store"
        assert [c["name"] for c in listed.json()["data"]] == ["app"] and listed.json()["object"] == "list"
        one = await http.get("/api/manage/callers/app")
        assert one.json()["tokens_per_minute"] == 1000 and "key" not in one.json()
        patched = await http.patch("/api/manage/callers/app", json={"tokens_per_minute": 2000, "models": None})
        assert patched.status_code == 200 and patched.json()["tokens_per_minute"] == 2000
        assert patched.json()["models"] is None and "key" not in patched.json()
        rotated = await http.post("/api/manage/callers/app/rotate")
        assert rotated.status_code == 200 and rotated.json()["key"] != key
        keys.append(rotated.json()["key"])
        assert rotated.json()["id"] == created.json()["id"]
        deleted = await http.delete("/api/manage/callers/app")
        assert deleted.status_code == 200
        assert deleted.json() == {"object": "caller.deleted", "name": "app", "deleted": True}
        openai_error(await http.get("/api/manage/callers/app"), 404, "caller_not_found", "name")
        bodies = listed.text + one.text + patched.text + deleted.text + (await http.get("/api/manage/callers")).text
        for k in keys:
            assert k not in bodies and k not in caplog.text


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b'{"name": "a", "tokens_per_minute": -1}', 400, "invalid_request", "tokens_per_minute"),
        (b'{"name": "a", "extra": 1}', 400, "invalid_request", "extra"),
        (b'{"name": "a\\u0000b"}', 400, "invalid_request", "name"),
        (b'{"name": "' + b"n" * 10_000 + b'"}', 400, "invalid_request", "name"),
        (b'{"name": "a", "spend_budget": 0.0000001}', 400, "invalid_request", "spend_budget"),
        (b'{"name": "a", "team": "nobody"}', 400, "invalid_request", "team"),
        (b'{"name": "a", "tokens_per_minute": 1e400}', 400, "invalid_request", None),
        (b"[1, 2]", 400, "invalid_request", None),
        (b"not json", 400, "invalid_request", None),
        (b'{"name": "' + b"n" * 70_000 + b'"}', 413, "request_too_large", None),
    ],
)
async def test_bad_bodies_are_openai_shaped_errors_naming_the_field(body, status, code, param):
    async with Admin() as admin:
        response = await admin.http.post(
            "/api/manage/callers", content=body, headers={"content-type": "application/json"}
        )
        error = openai_error(response, status, code, param)
        assert len(error["message"]) < 300 and "nnnnnnnnnn" not in error["message"]


async def test_duplicates_content_types_and_unknown_callers():
    async with Admin() as admin:
        http = admin.http
        assert (await http.post("/api/manage/callers", json={"name": "a"})).status_code == 201
        openai_error(await http.post("/api/manage/callers", json={"name": "a"}), 400, "invalid_request", "name")
        openai_error(
            await http.post("/api/manage/callers", content=b"name=x", headers={"content-type": "text/plain"}),
            415,
            "unsupported_media_type",
        )
        openai_error(await http.patch("/api/manage/callers/a", json={"name": "x"}), 400, "invalid_request", "name")
        openai_error(await http.post("/api/manage/callers/nobody-here/rotate"), 404, "caller_not_found", "name")
        openai_error(await http.delete("/api/manage/callers/nobody-here"), 404, "caller_not_found", "name")
        openai_error(await http.get("/api/manage/callers/%0A"), 404, "caller_not_found", "name")


async def test_teams_over_http():
    async with Admin() as admin:
        http = admin.http
        made = await http.post(
            "/api/manage/teams", json={"name": "search", "spend_budget": 25.5, "budget_period": "month"}
        )
        assert made.status_code == 201 and made.json()["object"] == "team" and made.json()["spend_budget"] == 25.5
        assert made.headers["cache-control"] == "no-store"
        openai_error(await http.post("/api/manage/teams", json={"name": "search"}), 400, "invalid_request", "name")
        member = await http.post("/api/manage/callers", json={"name": "dev", "team": "search"})
        assert member.status_code == 201 and member.json()["team"] == "search"
        listed = await http.get("/api/manage/teams")
        [team] = listed.json()["data"]
        assert team["name"] == "search" and team["spend_budget_used"] == 0.0
        patched = await http.patch("/api/manage/teams/search", json={"requests_per_minute": 5})
        assert patched.status_code == 200 and patched.json()["requests_per_minute"] == 5
        assert patched.json()["spend_budget"] == 25.5
        openai_error(await http.delete("/api/manage/teams/search"), 409, "conflict")
        assert (await http.delete("/api/manage/callers/dev")).status_code == 200
        gone = await http.delete("/api/manage/teams/search")
        assert gone.json() == {"object": "team.deleted", "name": "search", "deleted": True}
        openai_error(await http.get("/api/manage/teams/search"), 404, "team_not_found", "name")
        openai_error(await http.patch("/api/manage/teams/search", json={}), 404, "team_not_found", "name")


async def test_prices_over_http():
    async with Admin() as admin:
        http = admin.http
        put = await http.put(
            "/api/manage/prices/gpt-4o-mini", json={"input": 0.15, "cached_input": 0.075, "output": 0.6}
        )
        assert put.status_code == 200 and put.headers["cache-control"] == "no-store"
        assert {k: put.json()[k] for k in ("model", "input", "cached_input", "output", "unit")} == {
            "model": "gpt-4o-mini",
            "input": 0.15,
            "cached_input": 0.075,
            "output": 0.6,
            "unit": "USD per 1M tokens",
        }
        deployment = await http.put("/api/manage/prices/team/east/gpt-4o", json={"input": 2.5, "output": 10})
        assert deployment.json()["model"] == "team/east/gpt-4o" and deployment.json()["cached_input"] == 2.5
        assert (await http.get("/api/manage/prices/team/east/gpt-4o")).json()["input"] == 2.5
        listed = await http.get("/api/manage/prices")
        assert [p["model"] for p in listed.json()["data"]] == ["gpt-4o-mini", "team/east/gpt-4o"]
        error = openai_error(
            await http.put("/api/manage/prices/m", json={"input": 0.1234567, "output": 1}),
            400,
            "invalid_request",
            "input",
        )
        assert "0.1234567" not in error["message"]
        openai_error(
            await http.put("/api/manage/prices/m", json={"input": -1, "output": 1}), 400, "invalid_request", "input"
        )
        openai_error(await http.put("/api/manage/prices/m", content=b"[]"), 400, "invalid_request")
        for field in ("input", "output"):  # null is not a price (was a 500)
            error = openai_error(
                await http.put("/api/manage/prices/m", json={"input": 1, "output": 1, field: None}),
                400,
                "invalid_request",
                field,
            )
            assert error["message"] == f"{field}: must be a number"
        nulled = await http.put("/api/manage/prices/m", json={"input": 1, "output": 2, "cached_input": None})
        assert nulled.status_code == 200 and nulled.json()["cached_input"] == 1  # null: the input price
        deleted = await http.delete("/api/manage/prices/gpt-4o-mini")
        assert deleted.json() == {"object": "price.deleted", "model": "gpt-4o-mini", "deleted": True}
        openai_error(await http.get("/api/manage/prices/gpt-4o-mini"), 404, "price_not_found", "name")
        openai_error(await http.delete("/api/manage/prices/gpt-4o-mini"), 404, "price_not_found", "name")


def charge(caller_id: str, day: str, prompt: int, completion: int, cost: int | None, **kw) -> Charge:
    return Charge(
        caller=kw.pop("caller", "app"),
        caller_id=caller_id,
        model=kw.pop("model", "gpt-4o"),
        endpoint="openai",
        request_id=kw.pop("request_id", f"r{day}{prompt}{completion}"),
        day=day,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cost=cost,
        ended="completed",
        **kw,
    )


async def test_usage_as_json_and_csv():
    async with Admin() as admin:
        http = admin.http
        search = (await http.post("/api/manage/teams", json={"name": "search"})).json()["id"]
        made = (await http.post("/api/manage/callers", json={"name": "app", "team": "search"})).json()
        ledger = admin.state.ledger
        await ledger.write(
            [
                charge(made["id"], "20261001", 10, 20, 1_500_000, team="search", team_id=search),
                charge(made["id"], "20261001", 1, 2, None, team="search", team_id=search),
                charge(made["id"], "20261002", 5, 5, 10**12 + 1, team="search", team_id=search),
                charge("other", "20261001", 100, 100, 7, caller="other", model="=cmd()"),
            ]
        )
        response = await http.get(
            "/api/manage/usage", params={"caller": "app", "from": "2026-10-01", "to": "2026-10-31"}
        )
        assert response.status_code == 200 and response.headers["cache-control"] == "no-store"
        body = response.json()
        assert (body["caller"], body["from"], body["to"]) == ("app", "2026-10-01", "2026-10-31")
        assert [(r["day"], r["prompt_tokens"], r["completion_tokens"], r["requests"]) for r in body["data"]] == [
            ("2026-10-01", 11, 22, 2),
            ("2026-10-02", 5, 5, 1),
        ]
        assert body["data"][0]["unpriced_requests"] == 1 and body["data"][0]["team"] == "search"
        total = body["total"]
        assert (total["prompt_tokens"], total["completion_tokens"], total["total_tokens"], total["requests"]) == (
            16,
            27,
            43,
            3,
        )
        assert total["cost_picousd"] == 10**12 + 1 + 1_500_000 and total["unpriced_requests"] == 1
        everyone = (await http.get("/api/manage/usage", params={"from": "2026-10-01", "to": "2026-10-01"})).json()
        assert {r["caller"] for r in everyone["data"]} == {"app", "other"}
        team = (await http.get("/api/manage/usage", params={"team": "search", "from": "2026-10-01"})).json()
        assert team["total"]["requests"] == 3
        model = (await http.get("/api/manage/usage", params={"model": "=cmd()", "from": "2026-10-01"})).json()
        assert [r["caller"] for r in model["data"]] == ["other"]
        # A caller deleted: its rows by name.
        await http.delete("/api/manage/callers/app")
        gone = (await http.get("/api/manage/usage", params={"caller": "app", "from": "2026-10-01"})).json()
        assert gone["total"]["requests"] == 3

        as_csv = await http.get(
            "/api/manage/usage", params={"from": "2026-10-01", "to": "2026-10-31"}, headers={"accept": "text/csv"}
        )
        assert as_csv.status_code == 200 and as_csv.headers["content-type"].startswith("text/csv")
        assert as_csv.headers["cache-control"] == "no-store"
        assert 'filename="usage-2026-10-01-2026-10-31.csv"' in as_csv.headers["content-disposition"]
        lines = list(csv.reader(io.StringIO(as_csv.text)))
        assert lines[0][:4] == ["day", "caller", "team", "model"]
        assert ["2026-10-02", "app", "search", "gpt-4o", "1", "5", "0", "5", "10", "1.000000000001", "0"] in lines
        assert any(line[3] == "'=cmd()" for line in lines)  # not a formula
        assert lines[-1][:5] == ["total", "", "", "", "4"] and lines[-1][9] == "1.000001500008"
        by_format = await http.get(
            "/api/manage/usage", params={"from": "2026-10-01", "to": "2026-10-31", "format": "csv"}
        )
        assert by_format.text == as_csv.text


async def test_usage_by_team_follows_the_team_not_its_name():
    """A team deleted and made again under its name: ``usage?team=`` shows the new team's usage, not
    the old one's (as for callers); the deleted one's rows are still there by name until then."""
    async with Admin() as admin:
        http = admin.http
        old = (await http.post("/api/manage/teams", json={"name": "squad"})).json()["id"]
        await admin.state.ledger.write([charge("c-old", "20261001", 10, 20, 7, team="squad", team_id=old)])
        assert (await http.delete("/api/manage/teams/squad")).status_code == 200
        gone = (await http.get("/api/manage/usage", params={"team": "squad", "from": "2026-10-01"})).json()
        assert gone["total"]["requests"] == 1  # a deleted team: its rows by name
        new = (await http.post("/api/manage/teams", json={"name": "squad"})).json()["id"]
        assert new != old
        fresh = (await http.get("/api/manage/usage", params={"team": "squad", "from": "2026-10-01"})).json()
        assert fresh["total"]["requests"] == 0, "the old team's usage is not the new one's"
        await admin.state.ledger.write([charge("c-new", "20261002", 1, 2, 3, team="squad", team_id=new)])
        fresh = (await http.get("/api/manage/usage", params={"team": "squad", "from": "2026-10-01"})).json()
        assert (fresh["total"]["requests"], fresh["total"]["cost_picousd"]) == (1, 3)
        as_csv = await http.get("/api/manage/usage", params={"team": "squad", "from": "2026-10-01", "format": "csv"})
        assert "2026-10-01" not in as_csv.text and "2026-10-02" in as_csv.text


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"from": "yesterday"}, "from"),
        ({"to": "2026-13-01"}, "to"),
        ({"to": "2026-02-30"}, "to"),
        ({"from": "2026-10-02", "to": "2026-10-01"}, "from"),
        ({"from": "2024-01-01", "to": "2026-01-01"}, "from"),
        ({"caller": "a b"}, "caller"),
        ({"team": "a/b"}, "team"),
        ({"model": "x" * 300}, "model"),
        ({"model": "a\nb"}, "model"),
    ],
)
async def test_bad_usage_queries_are_400s_naming_the_parameter(params, param):
    async with Admin() as admin:
        openai_error(await admin.http.get("/api/manage/usage", params=params), 400, "invalid_request", param)


async def test_usage_at_the_ends_of_the_calendar_is_an_answer():
    async with Admin() as admin:
        for params in (
            {"from": "9999-01-01", "to": "9999-12-31"},
            {"to": "9999-12-31"},
            {"from": "0001-01-01", "to": "0001-01-01"},
            {"to": "0001-01-05"},  # the default 30 days would start before the first day there is
        ):
            response = await admin.http.get("/api/manage/usage", params=params)
            assert response.status_code == 200, (params, response.text)
            assert response.json()["data"] == [] and response.json()["total"]["requests"] == 0


async def test_callers_and_teams_show_what_their_budgets_have_taken():
    async with Admin() as admin:
        http = admin.http
        state = admin.state
        await http.post("/api/manage/teams", json={"name": "t", "token_budget": 1_000})
        await http.post("/api/manage/callers", json={"name": "c", "team": "t", "spend_budget": 2, "token_budget": 500})
        caller = await state.registry.get(Caller, "c")
        assert state.accounting is not None
        await state.registry.set_price("gpt-4o", PriceSpec(input=1, output=1))
        admitted, rec = await admit(state.accounting, caller, max_tokens=10)
        finish(state.accounting, admitted, rec, usage(30, 12))
        assert await state.accounting.flush(5)
        one = (await http.get("/api/manage/callers/c")).json()
        assert one["token_budget_used"] == 42 and one["spend_budget_used"] == 42 / 10**6
        team = (await http.get("/api/manage/teams/t")).json()
        assert team["token_budget_used"] == 42 and "spend_budget_used" not in team


async def test_without_a_store_every_route_answers_503_naming_the_setting():
    manage = Manage(SharedState.from_settings(Settings.from_env({}), {}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app_for(manage)), base_url="http://app") as http:
        for response in (
            await http.get("/api/manage/callers"),
            await http.post("/api/manage/callers", json={}),
            await http.get("/api/manage/teams"),
            await http.get("/api/manage/prices"),
            await http.get("/api/manage/usage"),
        ):
            error = openai_error(response, 503, "caller_store_not_configured")
            assert "AzureWebJobsStorage" in error["message"]
    with pytest.raises(SettingsError, match="AzureWebJobsStorage__tableServiceUri"):  # refused at start-up
        SharedState.from_settings(Settings.from_env({}), {"AzureWebJobsStorage__tableServiceUri": "http://x"})


async def test_a_store_that_fails_is_a_503_never_a_500():
    async with Admin() as admin:
        store = admin.store
        assert isinstance(store, MemoryStore)
        store.inject(Fault("unavailable", frozenset({"batch"})))
        openai_error(await admin.http.post("/api/manage/callers", json={"name": "a"}), 503, "caller_store_unavailable")
        # (on the callers' table: the duty, which the admin API starts, reads the streams' table meanwhile)
        store.inject(Fault("unavailable", frozenset({"get"}), table=CALLERS_TABLE))
        openai_error(await admin.http.get("/api/manage/callers/a"), 503, "caller_store_unavailable")
        store.inject(Fault("unavailable", frozenset({"query"}), table=CALLERS_TABLE))
        openai_error(await admin.http.get("/api/manage/teams"), 503, "caller_store_unavailable")
        # The counter rows of a caller with a budget, and the ledger, are read as the answer is made.
        assert (await admin.http.post("/api/manage/callers", json={"name": "b", "token_budget": 5})).status_code == 201
        store.inject(Fault("unavailable", frozenset({"query"}), table=LIMITS_TABLE))
        openai_error(await admin.http.get("/api/manage/callers"), 503, "caller_store_unavailable")
        store.inject(Fault("unavailable", frozenset({"query"}), table=LIMITS_TABLE))
        openai_error(await admin.http.get("/api/manage/callers/b"), 503, "caller_store_unavailable")
        store.inject(Fault("unavailable", frozenset({"query"}), table=USAGE_TABLE))
        openai_error(await admin.http.get("/api/manage/usage"), 503, "caller_store_unavailable")
        store.inject(Fault("unavailable", frozenset({"batch"})))  # a price is written as the others are
        openai_error(
            await admin.http.put("/api/manage/prices/m", json={"input": 1, "output": 1}),
            503,
            "caller_store_unavailable",
        )


def test_the_key_is_in_no_answer_but_create_and_rotate():
    # Any answer but create (201) and rotate is built from caller_json, which has no key field.
    from chatstream.manage import caller_json
    from chatstream.state.callers import Caller

    public = caller_json(Caller(name="n", id="i", created_at=datetime.now(UTC), key_hint="abcd"))
    assert "key" not in public and "key_hash" not in json.dumps(public)
