"""fakeupstream: a scripted OpenAI-compatible server, chat completions and Responses (dev and test tool).

    python -m tools.fakeupstream --port 0 --scenario echo     # prints "fakeupstream listening on http://127.0.0.1:PORT"

or in-process: `fakeupstream.app` / `fakeupstream.create_app(...)` (ASGI). See README.md.
"""

from .responses import (
    FAILED_ERROR,
    FUNCTION_CALL_ARGUMENTS,
    FUNCTION_CALL_ID,
    FUNCTION_CALL_NAME,
    REASONING_SUMMARY,
    RESPONSES_NAMES,
    RESPONSES_OUTPUT_TOKENS,
    RESPONSES_REASONING_TOKENS,
    RESPONSES_TEXTS,
)
from .scenarios import (
    AFTER_FINISH_EXTRA,
    COMPLETION_TOKENS,
    NAMES,
    SCENARIOS,
    TEXTS,
    TOOL_CALL_ARGUMENTS,
    TOOL_CALL_ID,
    TOOL_CALL_NAME,
    Cadence,
    cadence_text,
    choice_text,
    echo_text,
)
from .server import FakeUpstream, create_app

app = create_app()

__all__ = [
    "AFTER_FINISH_EXTRA",
    "COMPLETION_TOKENS",
    # the Responses API (responses.py)
    "FAILED_ERROR",
    "FUNCTION_CALL_ARGUMENTS",
    "FUNCTION_CALL_ID",
    "FUNCTION_CALL_NAME",
    "NAMES",
    "REASONING_SUMMARY",
    "RESPONSES_NAMES",
    "RESPONSES_OUTPUT_TOKENS",
    "RESPONSES_REASONING_TOKENS",
    "RESPONSES_TEXTS",
    "SCENARIOS",
    "TEXTS",
    "TOOL_CALL_ARGUMENTS",
    "TOOL_CALL_ID",
    "TOOL_CALL_NAME",
    "Cadence",
    "FakeUpstream",
    "app",
    "cadence_text",
    "choice_text",
    "create_app",
    "echo_text",
]
