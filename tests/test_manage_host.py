"""The admin API through the real local host (tools/devhost, the Python worker, function_app.py's
routes) on a real Azurite: one POST creates a caller, GET lists it, and the key shows up only in the
answer to the POST, never in a listing or the app's log."""

from __future__ import annotations

import secrets

import httpx


def test_a_caller_created_with_one_post_is_listed(start_app, azurite):
    app = start_app(AzureWebJobsStorage=azurite.connection_string)
    name = f"host-{secrets.token_hex(4)}"
    with httpx.Client(base_url=app.url, timeout=20) as http:
        created = http.post("/api/manage/callers", json={"name": name, "tokens_per_minute": 10_000})
        assert created.status_code == 201, created.text
        assert created.headers["cache-control"] == "no-store"
        key = created.json()["key"]
        listed = http.get("/api/manage/callers")
        assert listed.status_code == 200
        assert [c["tokens_per_minute"] for c in listed.json()["data"] if c["name"] == name] == [10_000]
        one = http.get(f"/api/manage/callers/{name}")
        assert one.status_code == 200 and one.json()["key_hint"] == key[-4:]
        bad = http.post("/api/manage/callers", json={"name": name})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
    for text in (listed.text, one.text, bad.text, app.log()):
        assert key not in text
