"""The app's parts wired together once, for function_app.py (and any other app declaring its own
pipeline): ``create_app(settings, pipeline)`` gives the handler behind each route."""
from __future__ import annotations

import logging

import openai
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from . import api_openai
from .api_chat import ChatApi
from .api_openai import OpenAIChatApi
from .api_responses import ResponseFollowUps, ResponsesApi, ResponsesClient
from .endpoint import ERROR_HEADERS, Endpoint
from .errors import ApiError
from .pipeline import Pipeline
from .settings import Settings
from .upstream import make_client

log = logging.getLogger("chatstream")


class ChatApp:
    """The handlers behind the routes of function_app.py."""

    def __init__(self, settings: Settings, pipeline: Pipeline, client: openai.AsyncOpenAI):
        self.settings = settings
        self.pipeline = pipeline
        self.client = client
        self.chat = Endpoint(ChatApi(), settings, client, pipeline)
        self.chat_completions = Endpoint(OpenAIChatApi(), settings, client, pipeline)
        # The Responses API: Azure's v1 paths, and a 501 from an upstream without the API (api_responses.py).
        responses_client = ResponsesClient(client, azure=settings.upstream_kind == "azure")
        self.responses = Endpoint(ResponsesApi(), settings, responses_client, pipeline)
        self.response_follow_ups = ResponseFollowUps(settings, responses_client, pipeline)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.settings.allowed_models or (self.settings.default_model,)

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
        response = api_openai.error_response(ApiError(404, type, message))
        response.headers.update(ERROR_HEADERS)
        return response


def create_app(settings: Settings, pipeline: Pipeline | None = None,
               client: openai.AsyncOpenAI | None = None) -> ChatApp:
    if not settings.upstream_configured:
        log.warning("no upstream configured: set OPENAI_API_KEY, OPENAI_BASE_URL or AZURE_OPENAI_ENDPOINT")
    pipeline = pipeline if pipeline is not None else Pipeline.from_settings(settings)
    return ChatApp(settings, pipeline, client or make_client(settings))
