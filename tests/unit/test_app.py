"""chatstream/app.py in-process: what create_app builds from the settings, the small routes (models,
the 404 under /api/v1, the pool's state) and closing the clients."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from chatstream.app import create_app
from chatstream.settings import Settings, SettingsError


def client_for(app) -> httpx.AsyncClient:
    async def models(request):
        return await app.models(request)

    async def model(request):
        return await app.model(request)

    async def missing(request):
        return await app.not_found(request)

    async def pool(request):
        return await app.pool_state(request)

    routes = [
        Route("/api/v1/models", models),
        Route("/api/v1/models/{model}", model),
        Route("/api/_pool", pool),
        Route("/api/v1/{rest:path}", missing, methods=["GET", "POST"]),
    ]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=Starlette(routes=routes)), base_url="http://app")


async def test_models_and_the_404s_are_openais():
    app = create_app(Settings.from_env({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_MODEL": "m-1"}), environ={})
    async with client_for(app) as client:
        assert (await client.get("/api/v1/models")).json()["data"][0]["id"] == "m-1"
        assert (await client.get("/api/v1/models/m-1")).json()["id"] == "m-1"
        gone = await client.get("/api/v1/models/nope")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        other = await client.post("/api/v1/embeddings")
        assert other.status_code == 404 and other.json()["error"]["type"] == "invalid_request_error"
    await app.close()


async def test_the_pool_state_never_shows_a_key_or_a_credential():
    env = {
        "UPSTREAMS": json.dumps([{"name": "a", "base_url": "http://a.test/v1", "api_key_setting": "A_KEY"}]),
        "A_KEY": "sk-app-SECRET-1234567890",
    }
    app = create_app(Settings.from_env(env), environ=env)
    async with client_for(app) as client:
        state = (await client.get("/api/_pool")).text
    assert "SECRET" not in state and '"key_setting":"A_KEY"' in state
    await app.close()


def test_a_bad_upstream_url_stops_the_app_naming_the_setting_never_the_value():
    for env in (
        {"OPENAI_BASE_URL": "http://user:SECRET@up.test/v1"},
        {"OPENAI_BASE_URL": "http://up.test/v1?api-key=SECRET"},
    ):
        with pytest.raises(SettingsError) as caught:
            create_app(Settings.from_env(env), environ=env)
        assert "OPENAI_BASE_URL" in str(caught.value) and "SECRET" not in str(caught.value)


def test_caller_keys_without_a_store_stop_the_app_saying_what_to_set():
    with pytest.raises(SettingsError, match="CALLER_KEYS=required needs the app's storage: set AzureWebJobsStorage"):
        create_app(Settings.from_env({"CALLER_KEYS": "required"}), environ={"CALLER_KEYS": "required"})


def test_the_clients_are_closed_with_the_loop_that_used_them():
    """asyncio.run closes the async generators left on its loop: the app's closer among them."""
    app = create_app(Settings.from_env({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}), environ={})
    client = app.upstreams.clients["default"]

    async def use():
        app.upstreams._close_with_the_loop()
        await asyncio.sleep(0)

    asyncio.run(use())
    assert client.is_closed()


async def _team_app():
    """An app on an in-memory store, the models m-1 and m-2, a caller "c" of a team "t" that may
    use m-1: the app, its state and the caller's headers."""
    from chatstream.app import ChatApp
    from chatstream.pipeline import Pipeline
    from chatstream.state.callers import CallerSpec, TeamSpec
    from chatstream.upstreams.failover import Upstreams

    from .state_helpers import account, instance

    state, _ = instance(account(), "a")
    settings = Settings.from_env({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "ALLOWED_MODELS": "m-1,m-2"})
    app = ChatApp(settings, Pipeline(), Upstreams.from_settings(settings, {}), state, signals=False)
    await state.registry.create(TeamSpec(name="t", models=["m-1"]))
    _, key = await state.registry.create(CallerSpec(name="c", team="t"))
    return app, state, {"api-key": key}


async def test_models_answer_503_when_the_callers_team_cannot_be_read():
    """The caller's team (its model list) not read, the store unavailable: a 503 to retry, as a
    model route answers then, not the app's models unfiltered by the team."""
    from memory_store import Fault, MemoryStore

    from chatstream.state.store import CALLERS_TABLE

    app, state, headers = await _team_app()
    async with client_for(app) as client:
        assert [m["id"] for m in (await client.get("/api/v1/models", headers=headers)).json()["data"]] == ["m-1"]
        state.registry.cache.forget("t|t")  # the team's answer ran out; the key's is still kept
        assert isinstance(state.store, MemoryStore)
        state.store.inject(Fault("unavailable", frozenset({"get"}), table=CALLERS_TABLE, times=10**9))
        for path in ("/api/v1/models", "/api/v1/models/m-2"):
            refused = await client.get(path, headers=headers)
            assert refused.status_code == 503 and refused.headers["x-should-retry"] == "true", refused.text
            assert refused.json()["error"]["code"] == "caller_store_unavailable" and "retry-after" in refused.headers
    await app.close()


async def test_models_need_no_price_and_list_the_teams_while_the_prices_cannot_be_read():
    """The prices' read failing, the team's answer kept: the models routes answer from the team as
    before (a failure of the prices' read must not stand for the team's)."""
    from memory_store import Fault, MemoryStore

    from chatstream.state.store import CALLERS_TABLE

    app, state, headers = await _team_app()
    async with client_for(app) as client:
        assert (await client.get("/api/v1/models", headers=headers)).status_code == 200
        state.registry.cache.forget("prices")
        assert isinstance(state.store, MemoryStore)
        state.store.inject(Fault("unavailable", frozenset({"query"}), table=CALLERS_TABLE, times=10**9))
        listed = await client.get("/api/v1/models", headers=headers)
        assert [m["id"] for m in listed.json()["data"]] == ["m-1"], listed.text
        assert (await client.get("/api/v1/models/m-1", headers=headers)).status_code == 200
        assert (await client.get("/api/v1/models/m-2", headers=headers)).status_code == 404
    await app.close()
