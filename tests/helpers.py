"""Helpers shared by the test modules (fixtures stay in conftest.py)."""
from __future__ import annotations

# A recognisable key: tests check it never leaks into responses or logs.
TEST_KEY = "sk-test-SECRET-4f9c2a7e1bQZXW"


def app_env(upstream, **overrides: str) -> dict[str, str]:
    """App settings pointing at the scripted ``upstream`` (a servers.Upstream), plus ``overrides``."""
    env = {"OPENAI_BASE_URL": upstream.base_url, "OPENAI_API_KEY": TEST_KEY, "OPENAI_MODEL": "gpt-test",
           "UPSTREAM_MAX_RETRIES": "0"}
    env.update(overrides)
    return env
