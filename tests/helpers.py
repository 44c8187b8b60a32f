"""Helpers shared by the test modules (fixtures stay in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

# A recognisable key: tests check it never leaks into responses or logs.
TEST_KEY = "sk-test-SECRET-4f9c2a7e1bQZXW"


def app_env(upstream, **overrides: str) -> dict[str, str]:
    """App settings pointing at the scripted ``upstream`` (a servers.Upstream), plus ``overrides``."""
    env = {
        "OPENAI_BASE_URL": upstream.base_url,
        "OPENAI_API_KEY": TEST_KEY,
        "OPENAI_MODEL": "gpt-test",
        "UPSTREAM_MAX_RETRIES": "0",
    }
    env.update(overrides)
    return env


def function_bindings(*unset: str) -> dict[str, dict]:
    """Each function's HTTP trigger binding as the host reads it from function_app.py's metadata, by
    function name, imported with no setting whose name starts with one of ``unset``."""
    code = (
        "import json, function_app\n"
        "print(json.dumps({f.get_function_name(): json.loads(f.get_raw_bindings()[0])\n"
        "                  for f in function_app.app.get_functions()}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(unset)}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def examples(n: int) -> int:
    """``max_examples`` for a property test in tests/unit: ``n`` keeps the unit tests within their
    10 s budget; ``UNIT_EXAMPLES_SCALE=10`` (say) explores ten times as many examples."""
    return max(1, round(n * float(os.environ.get("UNIT_EXAMPLES_SCALE", "1"))))


class InProcessApp:
    """The app's endpoints (create_app) served by uvicorn on 127.0.0.1:<free port> in a thread of the
    test process: no local host, no worker. For tests that need the app's objects in their own process
    (telemetry's in-memory exporter) or many requests cheaply (the hostile-input fuzzing)."""

    def __init__(self, upstream_base_url: str, **settings: str):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        from chatstream.app import create_app
        from chatstream.settings import Settings

        values = {
            "OPENAI_BASE_URL": upstream_base_url,
            "OPENAI_API_KEY": "sk-test",
            "OPENAI_MODEL": "gpt-test",
            "UPSTREAM_MAX_RETRIES": "0",
            **settings,
        }
        app = create_app(Settings.from_env(values))

        def route(path: str, endpoint) -> Route:
            async def handler(request):  # a function, so Starlette passes the Request
                return await endpoint(request)

            return Route(path, handler, methods=["POST"])

        api = Starlette(routes=[route("/api/chat", app.chat), route("/api/v1/chat/completions", app.chat_completions)])
        self.server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.chat_url = self.url + "/api/chat"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
