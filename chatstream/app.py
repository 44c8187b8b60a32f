"""The app's parts wired together once, for function_app.py (and any other app declaring its own
pipeline): ``create_app(settings, pipeline)`` gives the handler behind each route."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import openai
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import api_openai
from .api_chat import ChatApi
from .api_openai import OpenAIChatApi
from .api_responses import ResponseFollowUps, ResponsesApi, ResponsesClient
from .endpoint import Endpoint
from .errors import ApiError
from .failover import Upstreams
from .pipeline import Pipeline
from .settings import Settings

log = logging.getLogger("chatstream")


class ChatApp:
    """The handlers behind the routes of function_app.py."""

    def __init__(self, settings: Settings, pipeline: Pipeline, client: Upstreams | openai.AsyncOpenAI):
        """``client``: the app's upstreams (failover.Upstreams), or one SDK client."""
        self.settings = settings
        self.pipeline = pipeline
        self.upstreams = client if isinstance(client, Upstreams) else Upstreams.single(settings, client)
        client = self.upstreams  # every endpoint shares the one pool
        self.chat = Endpoint(ChatApi(), settings, client, pipeline)
        self.chat_completions = Endpoint(OpenAIChatApi(), settings, client, pipeline)
        # The Responses API: Azure's v1 paths, and a 501 from an upstream without the API (api_responses.py);
        # per pool entry, sharing the pool's health. A follow-up about a stored response asks each
        # entry in turn (only the one that made the response knows its id).
        responses = client.map_clients(lambda entry, sdk: ResponsesClient(sdk, azure=entry.kind == "azure"))
        self.responses = Endpoint(ResponsesApi(), settings, responses, pipeline)
        self.response_follow_ups = ResponseFollowUps(settings, responses.each_entry(), pipeline)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.settings.allowed_models or self.upstreams.model_names() or (self.settings.default_model,)

    async def pool_state(self, request: Request) -> Response:
        """GET /api/_pool: each upstream entry's state and counters (never a key)."""
        return JSONResponse(self.upstreams.state(), headers={"Cache-Control": "no-store"})

    async def models(self, request: Request) -> Response:
        """GET /api/v1/models: the models a caller may name."""
        return JSONResponse(api_openai.models_list(self.model_names))

    async def model(self, request: Request) -> Response:
        """GET /api/v1/models/{model}: one of them, or OpenAI's 404."""
        name = request.path_params.get("model", "")
        if name in self.model_names:
            return JSONResponse(api_openai.model_object(name))
        return self.not_found_error(f"The model '{name}' does not exist", "model_not_found")

    async def not_found(self, request: Request) -> Response:
        """Any other path under /api/v1/: OpenAI's 404, so SDK callers see a clear NotFoundError."""
        return self.not_found_error(f"Invalid URL ({request.method} {request.url.path})", "not_found")

    def not_found_error(self, message: str, type: str) -> Response:
        return api_openai.error_response(ApiError(404, type, message))


def create_app(settings: Settings, pipeline: Pipeline | None = None,
               client: openai.AsyncOpenAI | None = None, environ: Mapping[str, str] | None = None) -> ChatApp:
    """The app's handlers. With ``UPSTREAMS`` set, its pool with one client per entry (a bad value
    raises SettingsError); else the single upstream, ``client`` or one made from the settings."""
    if not settings.upstream_configured:
        log.warning("no upstream configured: set UPSTREAMS, OPENAI_API_KEY, OPENAI_BASE_URL or AZURE_OPENAI_ENDPOINT")
    pipeline = pipeline if pipeline is not None else Pipeline.from_settings(settings)
    upstreams = Upstreams.from_settings(settings, os.environ if environ is None else environ, client=client)
    if upstreams.pooled:
        log.info("upstream pool: %s", ", ".join(f"{e.name} (priority {e.priority}, weight {e.weight:g})"
                                                for e in upstreams.pool.entries))
    return ChatApp(settings, pipeline, upstreams)
