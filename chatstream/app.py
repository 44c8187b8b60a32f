"""The app's parts, built once from the settings for function_app.py (and any other app declaring
its own pipeline): ``create_app(settings, pipeline)`` gives the handler behind each route."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .apis import openai_chat
from .apis.chat import ChatApi
from .apis.openai_chat import OpenAIChatApi
from .apis.responses import ResponsesApi
from .apis.responses_follow_ups import ResponseFollowUps
from .endpoint import Endpoint
from .errors import ApiError, ErrorKind
from .pipeline import Pipeline
from .settings import Settings
from .upstreams.failover import Upstreams

log = logging.getLogger("chatstream")


class ChatApp:
    """The handlers behind the routes of function_app.py."""

    def __init__(self, settings: Settings, pipeline: Pipeline, upstreams: Upstreams):
        self.settings = settings
        self.pipeline = pipeline
        self.upstreams = upstreams  # one pool for every endpoint
        self.chat = Endpoint(ChatApi(), settings, upstreams, pipeline)
        self.chat_completions = Endpoint(OpenAIChatApi(), settings, upstreams, pipeline)
        # The Responses API: the same pool, each client as Responses calls need it (Azure's v1 paths).
        responses = upstreams.for_responses()
        self.responses = Endpoint(ResponsesApi(), settings, responses, pipeline)
        self.response_follow_ups = ResponseFollowUps(settings, responses, pipeline)
        self.model_names = settings.allowed_models or upstreams.model_names() or (settings.default_model,)

    async def pool_state(self, request: Request) -> Response:
        """GET /api/_pool: each upstream entry's state and counters (never a key)."""
        return JSONResponse(self.upstreams.state(), headers={"Cache-Control": "no-store"})

    async def models(self, request: Request) -> Response:
        """GET /api/v1/models: the models a caller may name."""
        return JSONResponse(openai_chat.models_list(self.model_names))

    async def model(self, request: Request) -> Response:
        """GET /api/v1/models/{model}: one of them, or OpenAI's 404."""
        name = request.path_params.get("model", "")
        if name in self.model_names:
            return JSONResponse(openai_chat.model_object(name))
        return openai_chat.error_response(
            ApiError(404, ErrorKind.MODEL_NOT_FOUND, f"The model '{name}' does not exist")
        )

    async def not_found(self, request: Request) -> Response:
        """Any other path under /api/v1/: OpenAI's 404, so SDK callers see a clear NotFoundError."""
        return openai_chat.error_response(
            ApiError(404, ErrorKind.NOT_FOUND, f"Invalid URL ({request.method} {request.url.path})")
        )

    async def close(self) -> None:
        """Close the upstream clients (their connection pools), when the app shuts down."""
        await self.upstreams.close()


def create_app(
    settings: Settings,
    pipeline: Pipeline | None = None,
    environ: Mapping[str, str] | None = None,
    credential: Any = None,
) -> ChatApp:
    """The app's handlers: ``UPSTREAMS`` when set (a bad value raises SettingsError), else the single
    upstream. ``environ``: where the keys UPSTREAMS names are read (default: the process
    environment); ``credential``: an azure-identity async credential for Entra ID (default:
    DefaultAzureCredential)."""
    if not settings.upstream_configured:
        log.warning("no upstream configured: set UPSTREAMS, OPENAI_API_KEY, OPENAI_BASE_URL or AZURE_OPENAI_ENDPOINT")
    pipeline = pipeline if pipeline is not None else Pipeline.from_settings(settings)
    upstreams = Upstreams.from_settings(settings, environ, credential=credential)
    if upstreams.pooled:
        log.info(
            "upstream pool: %s",
            ", ".join(f"{e.name} (priority {e.priority}, weight {e.weight:g})" for e in upstreams.pool.entries),
        )
    return ChatApp(settings, pipeline, upstreams)
