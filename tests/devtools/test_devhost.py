"""The local host (tools/devhost/) on the real runtime: routing, settings, invocation ids, hang-ups,
start-up failures and stopping."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from chat import prompt
from servers import ROOT, App, run_devhost

PROBE = ROOT / "tests" / "apps" / "probe"


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    app_dir = tmp_path_factory.mktemp("probe")
    shutil.copy(PROBE / "function_app.py", app_dir)
    (app_dir / "local.settings.json").write_text(
        json.dumps(
            {
                "IsEncrypted": False,
                "Values": {"FROM_FILE": "file-value", "BOTH": "file-loses", "FUNCTIONS_WORKER_RUNTIME": "python"},
            }
        )
    )
    return app_dir


@pytest.fixture(scope="module")
def probe(probe_dir):
    server = App({"BOTH": "environment-wins"}, app_dir=probe_dir)
    yield server
    server.stop()


def test_routes_and_route_params(probe):
    r = httpx.get(probe.url + "/api/echo/a/b%20c?x=1&y=")
    assert r.status_code == 200
    assert r.json()["rest"] == "a/b c"
    assert r.json()["query"] == {"x": "1", "y": ""}
    assert httpx.post(probe.url + "/api/echo/x", content=b"payload").json()["body"] == "payload"


def test_unknown_route_is_404_and_wrong_method_is_405(probe):
    assert httpx.get(probe.url + "/api/nope").status_code == 404
    assert httpx.get(probe.url + "/env/x").status_code == 404, "routes live under the /api prefix"
    r = httpx.delete(probe.url + "/api/env/x")
    assert r.status_code == 405
    assert r.headers["allow"] == "GET"


def test_local_settings_values_are_applied_and_environment_wins(probe):
    assert httpx.get(probe.url + "/api/env/FROM_FILE").json()["value"] == "file-value"
    assert httpx.get(probe.url + "/api/env/BOTH").json()["value"] == "environment-wins"


def test_caller_cannot_choose_the_invocation_id(probe):
    r = httpx.get(probe.url + "/api/echo/x", headers={"x-ms-invocation-id": "chosen-by-caller"})
    assert r.status_code == 200
    seen = r.json()["invocation_id"]
    assert seen and seen != "chosen-by-caller"


def test_function_exception_is_500(probe):
    assert httpx.get(probe.url + "/api/boom").status_code == 500
    probe.wait_log(r"RuntimeError: boom")


def test_route_prefix_comes_from_host_json(tmp_path):
    shutil.copy(PROBE / "function_app.py", tmp_path)
    (tmp_path / "host.json").write_text(json.dumps({"version": "2.0", "extensions": {"http": {"routePrefix": "v2"}}}))
    server = App({}, app_dir=tmp_path)
    try:
        assert httpx.get(server.url + "/v2/env/HOME").status_code == 200
        assert httpx.get(server.url + "/api/env/HOME").status_code == 404
    finally:
        server.stop()


def test_hang_up_drops_the_forwarded_request(probe, tmp_path):
    marker = tmp_path / "closed"
    with httpx.Client(timeout=10) as client:
        with client.stream("GET", probe.url + "/api/ticks", params={"marker": str(marker)}) as r:
            lines = r.iter_lines()
            assert next(lines) == "tick 0"
            assert next(lines) == "tick 1"
            hung_up = time.monotonic()
    while not marker.exists() and time.monotonic() - hung_up < 2:
        time.sleep(0.01)
    assert marker.exists(), "the function's generator was not closed after the caller left"
    assert time.monotonic() - hung_up < 1.0


def test_chat_hang_up_closes_the_upstream_within_a_second(app, upstream):
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", app.chat_url, json=prompt("stall")) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first delta is here; the upstream now stalls
            hung_up = time.time()
    record = upstream.wait_stream_end("stall", timeout=3)
    assert record["outcome"] == "client_disconnected"
    assert record["ended_at"] - hung_up < 1.0
    app.wait_log(r'"event": "chat_stream"[^\n]*"disconnected": true')


def test_app_without_streaming_enabled_fails_to_load_like_under_func():
    result = run_devhost(app_dir=ROOT / "tests" / "apps" / "no_streaming")
    assert result.returncode == 1
    assert "FunctionLoadError" in result.stderr
    assert "Request" in result.stderr
    assert "listening" not in result.stdout


def test_bad_setting_stops_the_app_with_a_message_naming_it(tmp_path):
    result = run_devhost({"IDLE_TIMEOUT_SECONDS": "soon", "OPENAI_API_KEY": "sk-never-printed-123"})
    assert result.returncode == 1
    assert "IDLE_TIMEOUT_SECONDS" in result.stderr
    assert "sk-never-printed-123" not in result.stderr + result.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_stream_ends_the_stream_with_a_retryable_error_and_the_host_within_its_timeout(upstream, sig):
    """Ctrl+C stops the host as SIGTERM does (as func start): the app's drain (chatstream/lifecycle.py)
    ends the stalled stream with its final event before the host's 5 s shutdown timeout."""
    server = App({"OPENAI_BASE_URL": upstream.base_url, "OPENAI_API_KEY": "sk-x"})
    client = httpx.Client(timeout=10)
    try:
        with client.stream("POST", server.chat_url, json=prompt("stall")) as r:
            lines = r.iter_lines()
            seen = [next(lines)]
            sent = time.monotonic()
            server.proc.send_signal(sig)
            seen += list(lines)
        server.proc.wait(timeout=10)
        took = time.monotonic() - sent
    finally:
        client.close()
        server.stop()
    assert "event: error" in seen and '"type":"instance_draining"' in "".join(seen).replace(" ", "")
    assert took < 5 + 2.0, f"the host exited {took:.1f} s after the signal"
    assert server.proc.returncode in (0, -sig, 128 + sig, 130)
    with socket.socket() as s:  # the port is free again (a server may bind it: it closed the connection last)
        port = int(server.url.rsplit(":", 1)[1])
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_connections_to_the_worker_are_reused(probe):
    with httpx.Client(timeout=10) as client:
        for _ in range(3):  # warm: the pool and its spare connection
            assert client.get(probe.url + "/api/echo/x").status_code == 200
        before = client.get(probe.url + "/_devhost/stats").json()
        for _ in range(20):
            assert client.get(probe.url + "/api/echo/x").status_code == 200
        after = client.get(probe.url + "/_devhost/stats").json()
    assert after["idle_worker_connections"] >= 1
    assert after["worker_connections_opened"] - before["worker_connections_opened"] <= 1, (before, after)
    assert after["open_fds"] <= before["open_fds"] + 1, (before, after)
