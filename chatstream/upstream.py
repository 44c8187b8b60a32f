"""The upstream client: one AsyncOpenAI per app, built from the settings. The SDK brings retries
(with ``retry-after``), timeouts and typed errors."""
from __future__ import annotations

import openai

from .settings import Settings

# Sent when the upstream needs no key (a local vLLM/Ollama/LM Studio behind OPENAI_BASE_URL); the
# SDK refuses to start without one.
NO_KEY = "not-needed"


def make_client(settings: Settings) -> openai.AsyncOpenAI:
    key = settings.openai_api_key.get_secret_value() if settings.openai_api_key else NO_KEY
    # The relay enforces first-token, idle and total limits itself; the SDK's read timeout is only
    # a backstop in case a limit is missed, so it sits above both.
    read = max(settings.first_token_timeout, settings.idle_timeout) + 5
    return openai.AsyncOpenAI(
        api_key=key,
        base_url=settings.openai_base_url,
        max_retries=settings.upstream_max_retries,
        timeout=openai.Timeout(read, connect=settings.upstream_connect_timeout, write=30.0, pool=30.0),
    )
