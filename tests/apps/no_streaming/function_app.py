"""Uses FastAPI's Request without importing azurefunctions.extensions.http.fastapi, so HTTP
streaming is not enabled: the worker must refuse to load it, as it does under `func start`."""

import azure.functions as func
from fastapi import Request
from fastapi.responses import StreamingResponse

app = func.FunctionApp(http_auth_level=func.AuthLevel.ANONYMOUS)


@app.route(route="chat", methods=["POST"])
async def chat(req: Request) -> StreamingResponse:
    return StreamingResponse(iter([b"never"]))
