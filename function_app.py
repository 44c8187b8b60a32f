"""Routes and wiring only. The logic lives in chatstream/: settings.py (app settings),
contract.py (the request), upstream.py (the OpenAI client), relay.py (chunks → events),
sse.py (events → bytes), endpoint.py (HTTP: status rule, streaming response)."""
import logging

import azure.functions as func
from azurefunctions.extensions.http.fastapi import Request, Response

from chatstream.endpoint import ChatEndpoint
from chatstream.settings import Settings
from chatstream.upstream import make_client

settings = Settings.from_env()  # a bad value stops the app here, with a message naming the setting
if not settings.upstream_configured:
    logging.getLogger("chatstream").warning(
        "no upstream configured: set OPENAI_API_KEY (and optionally OPENAI_BASE_URL)")
chat_endpoint = ChatEndpoint(settings, make_client(settings))

app = func.FunctionApp(http_auth_level=func.AuthLevel.FUNCTION)


@app.route(route="chat", methods=["POST"])
async def chat(req: Request) -> Response:
    """POST /api/chat: stream a chat completion as server-sent events (docs/api.md)."""
    return await chat_endpoint(req)
