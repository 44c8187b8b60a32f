"""The three upstream kinds: OpenAI-compatible (the rest of the suite), Azure OpenAI with a key
(through the local host), and Azure OpenAI with Entra ID (the client built by chatstream.upstream,
with a credential that hands out known tokens, talking HTTP to the scripted upstream)."""

from __future__ import annotations

import asyncio
import time

import pytest
from azure.core.credentials import AccessToken
from chat import chat, prompt
from servers import App

from chatstream.settings import Settings
from chatstream.upstreams.clients import ENTRA_SCOPE, UpstreamStream, entra_token_provider, make_client
from chatstream.upstreams.config import entries
from tools.fakeupstream.scenarios import TEXTS


@pytest.mark.parametrize("version", [None, "2024-10-21"])
def test_azure_openai_with_a_key(upstream, version):
    """Without AZURE_OPENAI_API_VERSION, Azure's GA v1 API (OpenAI's path under /openai/v1, the
    deployment as the model, the key as the bearer, no api-version); with one, the dated API (the
    deployment in the path, the api-version, the key in api-key)."""
    env = {"AZURE_OPENAI_ENDPOINT": upstream.url, "AZURE_OPENAI_DEPLOYMENT": "normal", "AZURE_OPENAI_API_KEY": "az-k1"}
    app = App({**env, "AZURE_OPENAI_API_VERSION": version} if version else env)
    try:
        result = chat(app.chat_url, {"prompt": "hi"})
    finally:
        app.stop()
    assert result.status == 200
    assert result.text == TEXTS["normal"]
    sent = upstream.requests(last=1)[-1]
    assert sent["json"]["model"] == "normal"
    if version is None:
        assert (sent["path"], sent["query"]) == ("/openai/v1/chat/completions", {})
        assert sent["headers"]["authorization"] == "Bearer az-k1"
        assert "api-key" not in sent["headers"]
    else:
        assert (sent["path"], sent["query"]) == (
            "/openai/deployments/normal/chat/completions",
            {"api-version": version},
        )
        assert sent["headers"]["api-key"] == "az-k1"
        assert "authorization" not in sent["headers"]


class TokenCredential:
    """Hands out token-1, token-2, ... each valid for ``lifetime`` seconds, counting the calls."""

    def __init__(self, lifetime: int):
        self.lifetime = lifetime
        self.calls: list[tuple[str, ...]] = []

    async def get_token(self, *scopes, **kwargs) -> AccessToken:
        self.calls.append(scopes)
        return AccessToken(f"token-{len(self.calls)}", int(time.time()) + self.lifetime)

    async def close(self) -> None:
        pass


async def _two_requests(upstream, credential, version: str = "") -> list[str]:
    settings = Settings.from_env(
        {
            "AZURE_OPENAI_ENDPOINT": upstream.url,
            "AZURE_OPENAI_DEPLOYMENT": "normal",
            "AZURE_OPENAI_API_VERSION": version,
        }
    )
    (entry,) = entries(settings, {})
    client = make_client(entry, settings, settings.upstream_max_retries, entra_token_provider(credential))
    for _ in range(2):
        stream = await UpstreamStream.open(
            client,
            "/chat/completions",
            {"model": "normal", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        )
        text = ""
        async for chunk in stream:
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
        assert text == TEXTS["normal"]
    await client.close()
    return [r["headers"].get("authorization") for r in upstream.requests(last=2)]


@pytest.mark.parametrize("version", ["", "2024-10-21"])
def test_entra_token_is_sent_and_cached(upstream, version):
    credential = TokenCredential(lifetime=3600)
    seen = asyncio.run(_two_requests(upstream, credential, version))
    assert seen == ["Bearer token-1", "Bearer token-1"], "a valid token is reused"
    assert credential.calls == [(ENTRA_SCOPE,)]
    sent = upstream.requests(last=1)[-1]
    assert "api-key" not in sent["headers"]
    if version:
        assert (sent["path"], sent["query"]) == (
            "/openai/deployments/normal/chat/completions",
            {"api-version": version},
        )
    else:
        assert (sent["path"], sent["query"]) == ("/openai/v1/chat/completions", {})


def test_entra_token_near_expiry_is_refreshed(upstream):
    credential = TokenCredential(lifetime=60)  # inside azure-core's refresh window (5 min)
    seen = asyncio.run(_two_requests(upstream, credential))
    assert seen == ["Bearer token-1", "Bearer token-2"]
    assert len(credential.calls) == 2


def test_a_server_that_takes_no_key_gets_no_authorization_header(upstream):
    """OPENAI_BASE_URL without OPENAI_API_KEY (a vLLM server inside a VNet), then an UPSTREAMS entry
    with a base_url and no api_key_setting: a streamed chat, a whole completion, a response and a
    follow-up on it (GET) reach the scripted upstream with no Authorization header at all."""
    import json

    import httpx

    for env in (
        {"OPENAI_BASE_URL": upstream.base_url},
        {"UPSTREAMS": json.dumps([{"name": "vllm", "base_url": upstream.base_url}])},
    ):
        upstream.clear()
        app = App({**env, "OPENAI_MODEL": "gpt-test", "UPSTREAM_MAX_RETRIES": "0"})
        try:
            assert chat(app.chat_url, prompt("normal")).text == TEXTS["normal"]
            whole = httpx.post(
                app.url + "/api/v1/chat/completions",
                timeout=20,
                json={"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]},
            )
            created = httpx.post(app.url + "/api/v1/responses", timeout=20, json={"model": "gpt-test", "input": "hi"})
            fetched = httpx.get(f"{app.url}/api/v1/responses/{created.json()['id']}", timeout=20)
        finally:
            app.stop()
        assert (whole.status_code, created.status_code, fetched.status_code) == (200, 200, 200), fetched.text
        sent = upstream.requests()
        assert [r["method"] for r in sent] == ["POST", "POST", "POST", "GET"], env
        assert [r["headers"].get("authorization") for r in sent] == [None] * 4, env


@pytest.fixture(scope="module")
def allowlisted(upstream):
    from helpers import app_env

    app = App(app_env(upstream, ALLOWED_MODELS="gpt-test, normal"))
    yield app
    app.stop()


def test_model_allowlist(allowlisted, upstream):
    before = upstream.count()
    result = chat(allowlisted.chat_url, {**prompt("normal"), "model": "slow"})
    assert result.status == 400
    error = result.body["error"]
    assert error["type"] == "model_not_allowed" and error["param"] == "model"
    assert "gpt-test, normal" in error["message"]
    assert upstream.count() == before
    assert chat(allowlisted.chat_url, {**prompt("normal"), "model": "normal"}).text == TEXTS["normal"]

    import httpx

    r = httpx.post(
        allowlisted.url + "/api/v1/chat/completions",
        timeout=10,
        json={"model": "slow", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_allowed"
    models = httpx.get(allowlisted.url + "/api/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["gpt-test", "normal"]


def test_a_request_lost_to_a_closing_kept_alive_connection_is_sent_again():
    """The keep-alive race (a server closing an idle kept-alive connection as the next request goes out
    on it, at its keep-alive timeout: uvicorn's, vLLM's, LiteLLM's 5 s) played by the scripted upstream
    at once: the request goes out once more, on a new connection, and the caller gets its answer (with
    one upstream and no retries of the SDK's). A new connection cut before any answer is still the
    upstream's failure: 502, and not sent again."""
    import httpx
    from helpers import app_env
    from servers import Upstream

    upstream = Upstream()
    app = App(app_env(upstream))
    control = httpx.Client(base_url=upstream.url, timeout=10)
    try:
        control.post("/_scripted/stale", json={"times": 1}).raise_for_status()
        first = chat(app.chat_url, prompt("normal"))  # a new connection, then kept
        second = chat(app.chat_url, prompt("normal"))  # the kept one: closed unanswered
        after_kept = control.get("/_scripted/stale").json()
        control.post("/_scripted/stale", json={"times": 1, "connections": "any"}).raise_for_status()
        cut = chat(app.chat_url, prompt("normal"))
        after_cut = control.get("/_scripted/stale").json()
        received = upstream.count()
    finally:
        control.close()
        app.stop()
        upstream.stop()
    assert (first.status, first.text) == (200, TEXTS["normal"])
    assert after_kept["dropped"] == 1, after_kept
    assert (second.status, second.text) == (200, TEXTS["normal"]), second.events
    assert cut.status == 502 and cut.body["error"]["type"] == "upstream_disconnected", (cut.status, cut.body)
    assert after_cut["dropped"] == 2 and after_cut["times"] == 0, after_cut
    assert received == 2, "a dropped request never reached the server"
