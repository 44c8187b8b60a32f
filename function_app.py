"""Routes and wiring only. The logic lives in chatstream/: settings.py (app settings), contract.py
and openai_contract.py (the two request contracts), upstream.py (the OpenAI / Azure OpenAI client),
pipeline.py (steps around the call), relay.py (chunks → events), sse.py (events → bytes),
endpoint.py (HTTP: status rule, streaming response)."""
import logging

import azure.functions as func
from azurefunctions.extensions.http.fastapi import JSONResponse, Request, Response

from chatstream import telemetry
from chatstream.endpoint import ChatEndpoint, OpenAIEndpoint
from chatstream.pipeline import Pipeline
from chatstream.playground_page import Playground
from chatstream.settings import Settings
from chatstream.upstream import make_client

settings = Settings.from_env()  # a bad value stops the app here, with a message naming the setting
telemetry.configure()  # Application Insights export, only when APPLICATIONINSIGHTS_CONNECTION_STRING is set
if not settings.upstream_configured:
    logging.getLogger("chatstream").warning(
        "no upstream configured: set OPENAI_API_KEY, OPENAI_BASE_URL or AZURE_OPENAI_ENDPOINT")
client = make_client(settings)

# Steps around the model call, for both endpoints (see chatstream/pipeline.py). The settings switch
# on the built-in ones: SYSTEM_PROMPT, MAX_PROMPT_CHARS, BLOCKED_TERMS. Add your own here, e.g.
#   @pipeline.before
#   def tag(call): call.params["user"] = "web"
pipeline = Pipeline.from_settings(settings)

chat_endpoint = ChatEndpoint(settings, client, pipeline)
openai_endpoint = OpenAIEndpoint(settings, client, pipeline)
playground_page = Playground.from_settings(settings)  # on locally, off in Azure unless PLAYGROUND_ENABLED

app = func.FunctionApp(http_auth_level=func.AuthLevel.FUNCTION)


@app.route(route="chat", methods=["POST"])
async def chat(req: Request) -> Response:
    """POST /api/chat: stream a chat completion as server-sent events (docs/api.md)."""
    return await chat_endpoint(req)


@app.route(route="v1/chat/completions", methods=["POST"])
async def chat_completions(req: Request) -> Response:
    """POST /api/v1/chat/completions: the OpenAI wire format, for OpenAI SDKs (docs/openai.md)."""
    return await openai_endpoint(req)


@app.route(route="v1/models", methods=["GET"])
async def models(req: Request) -> JSONResponse:
    """GET /api/v1/models: the models a caller may name."""
    names = settings.allowed_models or (settings.default_model,)
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "chatstream"} for name in names]})


@app.route(route="playground/{file?}", methods=["GET"], auth_level=func.AuthLevel.ANONYMOUS)
async def playground(req: Request) -> Response:
    """GET /api/playground: a browser page for trying the API (docs/playground.md); 404 when disabled.
    The page needs no key; every API call it makes does."""
    return playground_page(req.path_params.get("file"), req.url.path)
