"""The API key never leaves the app: not in a response body or header, not in a log line, in any
scenario the scripted upstream can play (including its 401, whose message quotes the masked key)."""

from __future__ import annotations

import httpx
from chat import prompt
from helpers import TEST_KEY, app_env
from servers import App

from tools.fakeupstream.scenarios import NAMES


def test_key_never_appears_in_responses_or_logs(upstream):
    app = App(
        app_env(
            upstream,
            HEARTBEAT_SECONDS="0.5",
            FIRST_TOKEN_TIMEOUT_SECONDS="2",
            IDLE_TIMEOUT_SECONDS="1",
            UPSTREAM_MAX_RETRIES="1",
        )
    )
    seen = []
    try:
        with httpx.Client(timeout=20) as client:
            bodies = [prompt(name) for name in NAMES] + [
                {"prompt": ""},
                {"prompt": "x", "bad": 1},
                {"prompt": "x", "model": "model_not_found"},
            ]
            for body in bodies:
                with client.stream("POST", app.chat_url, json=body) as r:
                    seen.append(str(r.status_code) + repr(r.headers.raw) + r.read().decode("utf-8", "replace"))
            seen.append(client.get(app.url + "/api/nope").text)
    finally:
        app.stop()
    seen.append(app.log())
    everything = "\n".join(seen)
    assert len(seen) == len(NAMES) + 5
    assert "chat_stream" in everything, "the log was captured"
    masked = TEST_KEY[:3] + "..." + TEST_KEY[-4:]
    for secret in (TEST_KEY, TEST_KEY[8:], masked, TEST_KEY[-4:]):
        assert secret not in everything, f"{secret!r} leaked"
