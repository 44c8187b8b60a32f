"""chatstream/manage.py over HTTP, in process (httpx's ASGITransport over a Starlette app that mounts
the handlers as function_app.py does), on a real Azurite: statuses, OpenAI-shaped errors, no-store,
and the key only in the answers of create and rotate."""

from __future__ import annotations

import json
import logging
import secrets
from datetime import UTC, datetime

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from chatstream.manage import Manage
from chatstream.settings import Settings, SettingsError
from chatstream.state.ledger import Charge, Ledger
from chatstream.state.shared import SharedState


def app_for(manage: Manage) -> Starlette:
    return Starlette(
        routes=[
            Route("/api/manage/callers", manage.callers, methods=["GET", "POST"]),
            Route("/api/manage/callers/{name}", manage.caller, methods=["GET", "PATCH", "DELETE"]),
            Route("/api/manage/callers/{name}/rotate", manage.rotate, methods=["POST"]),
            Route("/api/manage/usage", manage.usage, methods=["GET"]),
        ]
    )


class Admin:
    def __init__(self, azurite):
        env = {"AzureWebJobsStorage": azurite.connection_string}
        self.state = SharedState.from_settings(Settings.from_env(env), env)
        self.store = self.state.store
        self.manage = Manage(self.state)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app_for(self.manage)), base_url="http://app")

    async def close(self):
        await self.http.aclose()
        await self.state.close()


def name() -> str:
    return f"app-{secrets.token_hex(4)}"


def openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param
    assert response.headers["cache-control"] == "no-store"
    return error


async def test_the_lifecycle_over_http(azurite, caplog):
    caplog.set_level(logging.DEBUG)
    admin = Admin(azurite)
    http = admin.http
    who = name()
    try:
        created = await http.post(
            "/api/manage/callers", json={"name": who, "tokens_per_minute": 1000, "models": ["gpt-4o-mini"]}
        )
        assert created.status_code == 201 and created.headers["cache-control"] == "no-store"
        key = created.json()["key"]
        assert key.startswith("csk-") and created.json()["name"] == who
        assert created.json()["key_hint"] == key[-4:]
        keys = [key]

        listed = await http.get("/api/manage/callers")
        assert listed.status_code == 200 and listed.headers["cache-control"] == "no-store"
        assert who in [c["name"] for c in listed.json()["data"]]
        one = await http.get(f"/api/manage/callers/{who}")
        assert one.json()["tokens_per_minute"] == 1000 and "key" not in one.json()

        patched = await http.patch(f"/api/manage/callers/{who}", json={"tokens_per_minute": 2000, "models": None})
        assert patched.status_code == 200 and patched.json()["tokens_per_minute"] == 2000
        assert patched.json()["models"] is None and "key" not in patched.json()

        rotated = await http.post(f"/api/manage/callers/{who}/rotate")
        assert rotated.status_code == 200 and rotated.json()["key"] != key
        keys.append(rotated.json()["key"])
        assert (await admin.state.registry.authenticate(keys[1])).name == who

        deleted = await http.delete(f"/api/manage/callers/{who}")
        assert deleted.json() == {"object": "caller.deleted", "name": who, "deleted": True}
        openai_error(await http.get(f"/api/manage/callers/{who}"), 404, "caller_not_found", "name")
        bodies = listed.text + one.text + patched.text + deleted.text + (await http.get("/api/manage/callers")).text
        for k in keys:
            assert k not in bodies and k not in caplog.text
    finally:
        await admin.close()


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b'{"name": "a", "tokens_per_minute": -1}', 400, "invalid_request", "tokens_per_minute"),
        (b'{"name": "a", "extra": 1}', 400, "invalid_request", "extra"),
        (b'{"name": "a\\u0000b"}', 400, "invalid_request", "name"),
        (b'{"name": "' + b"n" * 10_000 + b'"}', 400, "invalid_request", "name"),
        (b'{"name": "a", "tokens_per_minute": 1e400}', 400, "invalid_request", None),
        (b"[1, 2]", 400, "invalid_request", None),
        (b"not json", 400, "invalid_request", None),
        (b'{"name": "' + b"n" * 70_000 + b'"}', 413, "request_too_large", None),
    ],
)
async def test_bad_bodies(azurite, body, status, code, param):
    admin = Admin(azurite)
    try:
        response = await admin.http.post(
            "/api/manage/callers", content=body, headers={"content-type": "application/json"}
        )
        error = openai_error(response, status, code, param)
        assert len(error["message"]) < 300
    finally:
        await admin.close()


async def test_duplicates_content_types_and_unknown_callers(azurite):
    admin = Admin(azurite)
    http = admin.http
    who = name()
    try:
        assert (await http.post("/api/manage/callers", json={"name": who})).status_code == 201
        openai_error(await http.post("/api/manage/callers", json={"name": who}), 400, "invalid_request", "name")
        openai_error(
            await http.post("/api/manage/callers", content=b"name=x", headers={"content-type": "text/plain"}),
            415,
            "unsupported_media_type",
        )
        openai_error(await http.patch(f"/api/manage/callers/{who}", json={"name": "x"}), 400, "invalid_request", "name")
        openai_error(await http.post("/api/manage/callers/nobody-here/rotate"), 404, "caller_not_found", "name")
        openai_error(await http.delete("/api/manage/callers/nobody-here"), 404, "caller_not_found", "name")
        openai_error(await http.get("/api/manage/callers/%0A"), 404, "caller_not_found", "name")
    finally:
        await admin.close()


async def test_usage(azurite):
    admin = Admin(azurite)
    who = name()
    try:
        ledger = Ledger(admin.store)
        for day, prompt, completion in ((1, 10, 20), (1, 1, 2), (2, 5, 5)):
            await ledger.record(
                Charge(
                    caller=who,
                    model="gpt-4o",
                    request_id=secrets.token_hex(6),
                    endpoint="openai",
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    ended="completed",
                    at=datetime(2026, 10, day, 9, tzinfo=UTC),
                )
            )
        response = await admin.http.get(
            "/api/manage/usage", params={"caller": who, "from": "2026-10-01", "to": "2026-10-31"}
        )
        assert response.status_code == 200 and response.headers["cache-control"] == "no-store"
        body = response.json()
        assert [(r["day"], r["prompt_tokens"], r["completion_tokens"], r["requests"]) for r in body["data"]] == [
            ("2026-10-01", 11, 22, 2),
            ("2026-10-02", 5, 5, 1),
        ]
        assert body["total"] == {"prompt_tokens": 16, "completion_tokens": 27, "total_tokens": 43, "requests": 3}
        for params, param in (
            ({"from": "yesterday"}, "from"),
            ({"to": "2026-13-01"}, "to"),
            ({"from": "2026-10-02", "to": "2026-10-01"}, "from"),
            ({"from": "2024-01-01", "to": "2026-01-01"}, "from"),
            ({"caller": "a b"}, "caller"),
        ):
            openai_error(await admin.http.get("/api/manage/usage", params=params), 400, "invalid_request", param)
    finally:
        await admin.close()


async def test_without_a_store_every_route_answers_503_naming_the_setting():
    manage = Manage(SharedState.from_settings(Settings.from_env({}), {}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app_for(manage)), base_url="http://app") as http:
        for response in (
            await http.get("/api/manage/callers"),
            await http.post("/api/manage/callers", json={}),
            await http.get("/api/manage/usage"),
        ):
            error = openai_error(response, 503, "caller_store_not_configured")
            assert "AzureWebJobsStorage" in error["message"]
    with pytest.raises(SettingsError, match="AzureWebJobsStorage__tableServiceUri"):  # refused at start-up
        SharedState.from_settings(Settings.from_env({}), {"AzureWebJobsStorage__tableServiceUri": "http://x"})


def test_the_key_is_in_no_answer_but_create_and_rotate():
    # The handlers that may show a key: create (201) and rotate. Any other answer is built from
    # Caller.public(), which has no key field at all.
    from chatstream.state.callers import Caller

    public = Caller(name="n", id="i", created_at=datetime.now(UTC), key_hint="abcd").public()
    assert "key" not in public and "key_hash" not in json.dumps(public)
