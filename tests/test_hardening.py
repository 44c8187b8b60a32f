r"""What an outside attack on the app found (issue: hardening, items 4-13), each proved over HTTP
against the app on the local host and the scripted upstream.

What broke, what happens now, and the test that holds it (each failed on the code before the fix):

Each test below failed on the code before the fix (checked by running it against that commit).

| # | what broke | what happens now | test |
|---|---|---|---|
| 4 | a number overflowing to infinity (`1e999`, anywhere in the body) was a 502 `upstream_malformed`; with Azure, `"model": "."` or `".."` was a 502 | both are 400 before any upstream call: JSON numbers must be finite; an Azure model must be one plain deployment-name segment (`[A-Za-z0-9][A-Za-z0-9_.-]{0,63}`). Malformed upstream data raises its own `UpstreamMalformed`; a `ValueError` of ours is a logged 500 bug | `test_hardening.py::test_numbers_that_overflow_to_infinity_are_a_400_before_any_upstream_call`, `::test_azure_model_names_that_are_not_one_path_segment_are_a_400` |
| 5 | `MAX_PROMPT_CHARS` bypassed through tool-call arguments, `refusal`, image data URLs, tool descriptions, `prediction`, non-string text parts | every caller text that reaches the model counts ([pipeline.md](docs/pipeline.md#what-max_prompt_chars-counts)) | `test_hardening.py::test_max_prompt_chars_counts_every_text_that_reaches_the_model` (7 vectors) |
| 6 | `BLOCKED_TERMS` missed tool-call arguments and `refusal` | each has its own filter per choice, streamed and not; property-tested for any chunking | `test_hardening.py::test_blocked_terms_are_redacted_in_streamed_tool_call_arguments`, `::..._non_streamed_...`; `tests/unit/test_completions.py` |
| 7 | a caller that stopped reading for 25 s of an 8 s `TOTAL_TIMEOUT_SECONDS` got `[DONE]` at 29 s | a watchdog closes the upstream at the limit even while the stream is parked behind the slow caller; chunks already buffered are checked against the limit; the response gives up writing 2 s after the limit | `tests/unit/test_stream_limits.py` (the upstream is closed within 0.5 s of the limit while the consumer reads nothing) |
| 8 | a hang-up during the body upload was logged as a 500 with a traceback | a `ClientGone` disconnect: `status 499, "disconnected": true`, no traceback | `test_hardening.py::test_a_hang_up_during_the_body_upload_is_a_disconnect_not_a_500` |
| 9 | `model: "gpt\u0085\u2028INFO ..."` went raw into the log; refused models became metric dimensions | C1 controls, U+2028/2029 and bidi overrides are escaped in every log line; only a model the app and its upstream accepted becomes the metric `model` dimension (others: `(other)`) | `test_hardening.py::test_caller_chosen_text_cannot_forge_log_lines`; `test_telemetry.py::test_refused_models_are_not_metric_dimensions` |
| 10 | keyless Azure without a token: 500 with a traceback per request | 503 `upstream_auth_unavailable`, one warning line with the credential's message | `test_hardening.py::test_keyless_azure_without_a_token_is_a_503_that_says_so` |
| 11 | one SDK call ending in `RateLimitError` reached the upstream 9 times | error responses carry `x-should-retry: false` (with `Retry-After`): 3 upstream calls with `UPSTREAM_MAX_RETRIES=2` | `test_hardening.py::test_one_sdk_call_reaches_the_upstream_at_most_one_plus_the_apps_retries` |
| 12 | `prompt_cache_key`, `verbosity`, `safety_identifier`, ... were refused with 400 | fields the relay does not read go to the upstream unchanged; the upstream's 400 comes back with its message and `param` | `test_openai_endpoint.py::test_newer_openai_parameters_reach_the_upstream_unchanged`, `::test_fields_the_relay_does_not_read_are_the_upstreams_to_refuse` |
| 13 | `models.retrieve(...)` and legacy `completions.create` got an empty 404 | `GET /api/v1/models/{id}`; a catch-all route answers other `/api/v1/` paths with OpenAI's 404 | `test_hardening.py::test_models_retrieve_and_unknown_routes_answer_in_openai_shape` |
| core | a before-step setting `stream=False` on `/api/chat`, or adding an unknown parameter to a non-streamed `/api/v1` call, gave a plain-text 500 with no log line | a JSON `500 pipeline_error` / the upstream's 400, each with its log line and ended span | `test_pipeline.py::test_a_before_step_turning_streaming_off_on_api_chat_is_a_json_error`, `::test_a_before_step_adding_an_unknown_parameter_to_a_non_streamed_call_is_a_json_error` |
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import pytest
from azure.core.exceptions import ClientAuthenticationError
from chat import chat
from helpers import TEST_KEY

from chatstream.guard import redact_whole
from tools.fakeupstream.scenarios import TOOL_CALL_ARGUMENTS


def sdk_for(app, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.url + "/api/v1", api_key="unused", **kwargs)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def post_json(url: str, raw: bytes) -> httpx.Response:
    return httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=20)


# ----------------------------------------------------------------------------- 4. bad input is a 400


@pytest.mark.parametrize(
    "path,body",
    [
        ("/api/chat", b'{"prompt": "hi", "temperature": 1e999}'),
        ("/api/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi","x":1e999}]}'),
        ("/api/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"logit_bias":{"1":-1e999}}'),
        ("/api/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"tools":[{"x":1e400}]}'),
        ("/api/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"response_format":{"t":2e308}}'),
    ],
)
def test_numbers_that_overflow_to_infinity_are_a_400_before_any_upstream_call(app, upstream, path, body):
    before = upstream.count()
    r = post_json(app.url + path, body)
    assert r.status_code == 400, r.text
    assert "out of range" in r.text
    assert upstream.count() == before


@pytest.fixture(scope="module")
def azure_app(upstream):
    from helpers import app_env
    from servers import App

    server = App(
        app_env(
            upstream,
            AZURE_OPENAI_ENDPOINT=upstream.url,
            AZURE_OPENAI_DEPLOYMENT="normal",
            AZURE_OPENAI_API_KEY=TEST_KEY,
        )
    )
    yield server
    server.stop()


@pytest.mark.parametrize("model", [".", "..", "a/b", "x?y", "normal#", " normal"])
def test_azure_model_names_that_are_not_one_path_segment_are_a_400(azure_app, upstream, model):
    before = upstream.count()
    for path in ("/api/chat", "/api/v1/chat/completions"):
        body = {"prompt": "hi", "model": model} if path == "/api/chat" else {"model": model, "messages": user("hi")}
        r = httpx.post(azure_app.url + path, json=body, timeout=20)
        assert r.status_code == 400, (path, r.text)
        assert "deployment name" in r.text
    assert upstream.count() == before
    assert chat(azure_app.chat_url, {"prompt": "[scenario:normal] hi", "model": "normal"}).status == 200


# ----------------------------------------------------------------------------- 5. MAX_PROMPT_CHARS

LONG = "x" * 50_000
BYPASSES = {
    "tool_call_arguments": {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": LONG}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    },
    "refusal": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "refusal": LONG}]},
    "image_data_url": {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + LONG}}]}
        ]
    },
    "tool_description": {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": LONG}}],
    },
    "tool_schema_property_name": {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {LONG: {"type": "string"}}}},
            }
        ],
    },
    "prediction": {"messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content", "content": LONG}},
    "non_string_text_part": {"messages": [{"role": "user", "content": [{"type": "text", "text": [LONG]}]}]},
}


@pytest.fixture(scope="module")
def limited_app(upstream):
    from helpers import app_env
    from servers import App

    server = App(app_env(upstream, MAX_PROMPT_CHARS="100", MAX_BODY_BYTES=str(4 * 1024 * 1024)))
    yield server
    server.stop()


@pytest.mark.parametrize("name", sorted(BYPASSES))
def test_max_prompt_chars_counts_every_text_that_reaches_the_model(limited_app, upstream, name):
    before = upstream.count()
    r = httpx.post(limited_app.url + "/api/v1/chat/completions", json=BYPASSES[name], timeout=20)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "prompt_too_long"
    assert upstream.count() == before


def test_max_prompt_chars_still_lets_short_prompts_through(limited_app):
    body = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "[scenario:normal] hi"}]
    }
    assert httpx.post(limited_app.url + "/api/v1/chat/completions", json=body, timeout=20).status_code == 200


# ----------------------------------------------------------------------------- 6. BLOCKED_TERMS everywhere


@pytest.fixture(scope="module")
def guarded_app(upstream):
    from helpers import app_env
    from servers import App

    server = App(app_env(upstream, BLOCKED_TERMS="Paris,celsius"))
    yield server
    server.stop()


def test_blocked_terms_are_redacted_in_streamed_tool_call_arguments(guarded_app):
    stream = sdk_for(guarded_app).chat.completions.create(model="tool_calls", messages=user("weather?"), stream=True)
    arguments = "".join(
        tc.function.arguments or ""
        for chunk in stream
        if chunk.choices
        for tc in (chunk.choices[0].delta.tool_calls or [])
    )
    assert arguments == redact_whole(TOOL_CALL_ARGUMENTS, ["Paris", "celsius"])
    assert "Paris" not in arguments and "[redacted]" in arguments


def test_blocked_terms_are_redacted_in_non_streamed_tool_call_arguments(guarded_app):
    result = sdk_for(guarded_app).chat.completions.create(model="tool_calls", messages=user("weather?"))
    arguments = result.choices[0].message.tool_calls[0].function.arguments
    assert arguments == redact_whole(TOOL_CALL_ARGUMENTS, ["Paris", "celsius"])


# ----------------------------------------------------------------------------- 7. total limit, slow reader
# In-process (tests/unit/test_stream_limits.py): a consumer that stops reading is what parks the core
# at ``yield``, and over HTTP the buffers between the caller and the worker make that moment depend
# on the machine's socket buffer sizes.


# ----------------------------------------------------------------------------- 8. hang-up during upload


def test_a_hang_up_during_the_body_upload_is_a_disconnect_not_a_500(start_app):
    app = start_app()
    port = int(app.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /api/chat HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100000\r\n\r\n{"prompt": "'
        )
        time.sleep(0.3)
    app.wait_log(r'"status": 499[^\n]*"disconnected": true')
    time.sleep(0.3)
    log = app.log()
    assert "Traceback" not in log and "internal_error" not in log and '"status": 500' not in log


# ----------------------------------------------------------------------------- 9. log injection


def test_caller_chosen_text_cannot_forge_log_lines(app):
    evil = 'gpt\u0085\u2028INFO chatstream: {"forged": true}\u009b31m\u202e'
    r = httpx.post(app.chat_url, json={"prompt": "[scenario:normal] hi", "model": evil}, timeout=20)
    r.read()
    line = app.wait_log(r'\{"event": "chat_stream"[^\n]*\\u0085[^\n]*').group(0)
    assert "\\u2028" in line and "\\u009b" in line and "\\u202e" in line
    log = app.log()
    for raw in ("\u0085", "\u2028", "\u009b", "\u202e"):
        assert raw not in log


# ----------------------------------------------------------------------------- 11. retries do not multiply


def test_one_sdk_call_reaches_the_upstream_at_most_one_plus_the_apps_retries(start_app, upstream):
    app = start_app(UPSTREAM_MAX_RETRIES="2")
    before = upstream.count()
    with pytest.raises(openai.RateLimitError) as info:
        sdk_for(app).chat.completions.create(model="rate_limited", messages=user("hi"), stream=True)  # SDK defaults
    assert upstream.count() - before == 3, "1 + UPSTREAM_MAX_RETRIES, not multiplied by the SDK's own retries"
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.response.headers["x-should-retry"] == "false"


# ----------------------------------------------------------------------------- 13. unknown OpenAI routes


def test_models_retrieve_and_unknown_routes_answer_in_openai_shape(app):
    client = sdk_for(app)
    assert client.models.retrieve("gpt-test").id == "gpt-test"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-test", prompt="hi")
    assert "Invalid URL" in info.value.body["message"]
    r = httpx.get(app.url + "/api/v1/files/abc", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(app.url + "/api/v1/models", timeout=10).status_code == 200  # the real routes still win


# ----------------------------------------------------------------------------- 10. keyless Azure, no token


class NoTokenCredential:
    """DefaultAzureCredential when none of its sources works (no managed identity, no az login)."""

    async def get_token(self, *scopes, **kwargs):
        raise ClientAuthenticationError(
            "DefaultAzureCredential failed to retrieve a token from the included "
            "credentials. Attempted credentials: ManagedIdentityCredential: no endpoint"
        )

    async def close(self) -> None:
        pass


def test_keyless_azure_without_a_token_is_a_503_that_says_so(upstream, caplog):
    from starlette.applications import Starlette
    from starlette.routing import Route

    from chatstream.app import create_app
    from chatstream.settings import Settings

    settings = Settings.from_env(
        {"AZURE_OPENAI_ENDPOINT": upstream.url, "AZURE_OPENAI_DEPLOYMENT": "normal", "UPSTREAM_MAX_RETRIES": "0"}
    )
    chat_app = create_app(settings, credential=NoTokenCredential())

    async def run() -> list[httpx.Response]:
        async def chat_route(request):
            return await chat_app.chat(request)

        async def completions_route(request):
            return await chat_app.chat_completions(request)

        asgi = Starlette(
            routes=[
                Route("/api/chat", chat_route, methods=["POST"]),
                Route("/api/v1/chat/completions", completions_route, methods=["POST"]),
            ]
        )
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://app") as client:
            return [
                await client.post("/api/chat", json={"prompt": "hi"}),
                await client.post("/api/v1/chat/completions", json={"messages": user("hi")}),
            ]

    with caplog.at_level("INFO", logger="chatstream"):
        chat_answer, openai_answer = asyncio.run(run())
    assert chat_answer.status_code == 503
    assert chat_answer.json()["error"]["type"] == "upstream_auth_unavailable"
    assert openai_answer.status_code == 503 and openai_answer.json()["error"]["code"] == "upstream_auth_unavailable"
    assert not any(r.exc_info for r in caplog.records), "no traceback: it is not a bug of ours"
    assert [r for r in caplog.records if "Entra ID" in r.getMessage() and "ManagedIdentityCredential" in r.getMessage()]
