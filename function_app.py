"""The function app: its routes, each handed to chatstream/app.py's handler (built once from the
settings). A request's way through chatstream/: docs/maintainers.md, "Layout"."""

import azure.functions as func
from azurefunctions.extensions.http.fastapi import Request, Response

from chatstream import memory, telemetry
from chatstream.app import create_app
from chatstream.pages import Page
from chatstream.pipeline import Pipeline
from chatstream.settings import Settings

settings = Settings.from_env()  # a bad value stops the app here, with a message naming the setting
telemetry.configure()  # Application Insights export, only when APPLICATIONINSIGHTS_CONNECTION_STRING is set

# Steps around the model call, for every endpoint (see chatstream/pipeline.py). The settings switch
# on the built-in ones: SYSTEM_PROMPT, MAX_PROMPT_CHARS, BLOCKED_TERMS. Add your own here, e.g.
#   @pipeline.before
#   def tag(call): call.params["user"] = "web"
pipeline = Pipeline.from_settings(settings)
chat_app = create_app(settings, pipeline)
playground_page = Page("playground", settings)  # on locally, off in Azure unless PLAYGROUND_ENABLED
console_page = Page("console", settings)  # the same rule, with CONSOLE_ENABLED

app = func.FunctionApp(http_auth_level=func.AuthLevel.FUNCTION)


@app.route(route="chat", methods=["POST"])
async def chat(req: Request) -> Response:
    """POST /api/chat: stream a chat completion as server-sent events (docs/api.md)."""
    return await chat_app.chat(req)


@app.route(route="v1/chat/completions", methods=["POST"])
async def chat_completions(req: Request) -> Response:
    """POST /api/v1/chat/completions: the OpenAI wire format, for OpenAI SDKs (docs/openai.md)."""
    return await chat_app.chat_completions(req)


@app.route(route="v1/responses", methods=["POST"])
async def responses(req: Request) -> Response:
    """POST /api/v1/responses: OpenAI's Responses API, streamed or not (docs/openai.md, "Responses")."""
    return await chat_app.responses(req)


@app.route(route="v1/responses/{response_id}", methods=["GET", "DELETE"])
async def response(req: Request) -> Response:
    """GET /api/v1/responses/{id} (also ?stream=true&starting_after=N) and DELETE: relayed upstream."""
    return await chat_app.response_follow_ups(req, "delete" if req.method == "DELETE" else "retrieve")


@app.route(route="v1/responses/{response_id}/cancel", methods=["POST"])
async def cancel_response(req: Request) -> Response:
    """POST /api/v1/responses/{id}/cancel: cancel a background response upstream."""
    return await chat_app.response_follow_ups(req, "cancel")


@app.route(route="v1/responses/{response_id}/input_items", methods=["GET"])
async def response_input_items(req: Request) -> Response:
    """GET /api/v1/responses/{id}/input_items: the response's input items, from the upstream."""
    return await chat_app.response_follow_ups(req, "input_items")


@app.route(route="v1/models", methods=["GET"])
async def models(req: Request) -> Response:
    """GET /api/v1/models: the models a caller may name."""
    return await chat_app.models(req)


@app.route(route="v1/models/{model}", methods=["GET"])
async def model(req: Request) -> Response:
    """GET /api/v1/models/{model}: one model, or OpenAI's 404."""
    return await chat_app.model(req)


@app.route(route="streams/{stream_id}", methods=["GET"])
async def resume_stream(req: Request) -> Response:
    """GET /api/streams/{id} (Last-Event-ID: N): a resumable stream's events after N, then live
    (RESUMABLE_STREAMS=on; docs/resumable.md)."""
    return await chat_app.resume_stream(req)


@app.route(route="streams/{stream_id}/cancel", methods=["POST"])
async def cancel_stream(req: Request) -> Response:
    """POST /api/streams/{id}/cancel: stop a resumable stream (its upstream closed within a second)."""
    return await chat_app.cancel_stream(req)


@app.route(route="_pool", methods=["GET"])
async def pool_state(req: Request) -> Response:
    """GET /api/_pool: the upstream pool's state per entry (UPSTREAMS, docs/pool.md); never a key.
    Function-key protected in Azure, like every route here."""
    return await chat_app.pool_state(req)


@app.route(route="v1/{*rest}")
async def not_found(req: Request) -> Response:
    """Every other path under /api/v1/: a 404 in OpenAI's error shape."""
    return await chat_app.not_found(req)


@app.route(route="playground/{file?}", methods=["GET"], auth_level=func.AuthLevel.ANONYMOUS)
async def playground(req: Request) -> Response:
    """GET /api/playground: a browser page for trying the API (docs/playground.md); 404 when disabled.
    The page needs no key; every API call it makes does."""
    return playground_page(req.path_params.get("file"), req.url.path)


@app.route(route="console/{file?}", methods=["GET"], auth_level=func.AuthLevel.ANONYMOUS)
async def console(req: Request) -> Response:
    """GET /api/console: the operators' page on the admin API below (docs/console.md); 404 when
    disabled. The page needs no key; every admin call it makes needs the master key in Azure."""
    return console_page(req.path_params.get("file"), req.url.path)


# The admin API for callers, teams, prices and usage (docs/callers.md): /api/manage/... (the
# Functions host refuses any route template that starts with "admin", even under the "api" prefix).
# AuthLevel.ADMIN: in Azure only the host's master key opens it; the local hosts (func start,
# tools/devhost) check no key. Needs the app's storage (AzureWebJobsStorage); without it these
# routes answer 503 naming the setting, and the rest of the app runs as before.
@app.route(route="manage/callers", methods=["GET", "POST"], auth_level=func.AuthLevel.ADMIN)
async def manage_callers(req: Request) -> Response:
    """GET /api/manage/callers lists the callers; POST creates one and answers its key, this once."""
    return await chat_app.manage.collection(req, "callers")


@app.route(route="manage/callers/{name}", methods=["GET", "PATCH", "DELETE"], auth_level=func.AuthLevel.ADMIN)
async def manage_caller(req: Request) -> Response:
    """GET, PATCH or DELETE /api/manage/callers/{name}: one caller (never its key)."""
    return await chat_app.manage.item(req, "callers")


@app.route(route="manage/callers/{name}/rotate", methods=["POST"], auth_level=func.AuthLevel.ADMIN)
async def manage_rotate(req: Request) -> Response:
    """POST /api/manage/callers/{name}/rotate: a new key (answered this once); the old one stops working."""
    return await chat_app.manage.rotate(req)


@app.route(route="manage/teams", methods=["GET", "POST"], auth_level=func.AuthLevel.ADMIN)
async def manage_teams(req: Request) -> Response:
    """GET /api/manage/teams lists the teams; POST creates one (limits and budgets over its callers)."""
    return await chat_app.manage.collection(req, "teams")


@app.route(route="manage/teams/{name}", methods=["GET", "PATCH", "DELETE"], auth_level=func.AuthLevel.ADMIN)
async def manage_team(req: Request) -> Response:
    """GET, PATCH or DELETE /api/manage/teams/{name}: one team (a team with callers is not deleted)."""
    return await chat_app.manage.item(req, "teams")


@app.route(route="manage/prices", methods=["GET"], auth_level=func.AuthLevel.ADMIN)
async def manage_prices(req: Request) -> Response:
    """GET /api/manage/prices: every model's price (USD per million tokens)."""
    return await chat_app.manage.collection(req, "prices")


@app.route(route="manage/prices/{*model}", methods=["GET", "PUT", "DELETE"], auth_level=func.AuthLevel.ADMIN)
async def manage_price(req: Request) -> Response:
    """GET, PUT or DELETE /api/manage/prices/{model}: one model's price (input, cached input, output)."""
    return await chat_app.manage.item(req, "prices")


@app.route(route="manage/usage", methods=["GET"], auth_level=func.AuthLevel.ADMIN)
async def manage_usage(req: Request) -> Response:
    """GET /api/manage/usage?caller=&team=&model=&from=&to= (YYYY-MM-DD; default: the 30 days up to
    today, at most 366): tokens, requests and cost by caller, team, model and UTC day (CSV with
    Accept: text/csv or ?format=csv)."""
    return await chat_app.manage.usage(req)


memory.started()  # the last line: what start-up made is kept out of the garbage collector's walks
