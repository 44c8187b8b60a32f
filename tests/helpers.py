"""Helpers shared by test modules (import them from here; fixtures stay in conftest.py)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servers import Upstream

# A recognisable key: tests check it never leaks into responses or logs.
TEST_KEY = "sk-test-SECRET-4f9c2a7e1bQZXW"


def app_env(upstream: Upstream, **overrides: str) -> dict[str, str]:
    """The app settings of a test app talking to the scripted ``upstream``, plus ``overrides``."""
    env = {"OPENAI_BASE_URL": upstream.base_url, "OPENAI_API_KEY": TEST_KEY, "OPENAI_MODEL": "gpt-test",
           "UPSTREAM_MAX_RETRIES": "0"}
    env.update(overrides)
    return env


def examples(n: int) -> int:
    """``max_examples`` for a property test in tests/unit: ``n`` keeps the unit tests within their
    10 s budget; ``UNIT_EXAMPLES_SCALE=10`` (say) explores ten times as many examples."""
    return max(1, round(n * float(os.environ.get("UNIT_EXAMPLES_SCALE", "1"))))
