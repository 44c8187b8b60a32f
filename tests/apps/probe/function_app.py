"""A small app for testing the local host itself (not deployed anywhere)."""

import asyncio
import os
import signal
import time
from pathlib import Path

import azure.functions as func
from azurefunctions.extensions.http.fastapi import JSONResponse, Request, StreamingResponse

app = func.FunctionApp(http_auth_level=func.AuthLevel.ANONYMOUS)


@app.route(route="env/{name}", methods=["GET"])
async def env(req: Request) -> JSONResponse:
    name = req.path_params["name"]
    return JSONResponse({"name": name, "value": os.environ.get(name)})


@app.route(route="echo/{*rest}", methods=["GET", "POST"])
async def echo(req: Request) -> JSONResponse:
    return JSONResponse(
        {
            "method": req.method,
            "path": req.url.path,
            "rest": req.path_params.get("rest"),
            "query": dict(req.query_params),
            "body": (await req.body()).decode(),
            "invocation_id": req.headers.get("x-ms-invocation-id"),
        }
    )


@app.route(route="ticks", methods=["GET"])
async def ticks(req: Request) -> StreamingResponse:
    """One line every 100 ms (``n`` of them, default 600) until the caller leaves; writes a marker
    file when cleanup runs."""
    marker = Path(req.query_params["marker"])
    count = int(req.query_params.get("n", "600"))

    async def lines():
        try:
            for i in range(count):
                yield f"tick {i}\n".encode()
                await asyncio.sleep(0.1)
        finally:
            marker.write_text("closed")

    return StreamingResponse(lines(), media_type="text/plain")


@app.route(route="slow", methods=["GET"])
async def slow(req: Request) -> JSONResponse:
    """Answers after ``seconds``, then writes ``marker``: whether the function ran to its end."""
    await asyncio.sleep(float(req.query_params["seconds"]))
    Path(req.query_params["marker"]).write_text("done")
    return JSONResponse({"slept": req.query_params["seconds"]})


@app.route(route="boom", methods=["GET"])
async def boom(req: Request) -> JSONResponse:
    raise RuntimeError("boom")


@app.route(route="pid", methods=["GET"])
async def pid(req: Request) -> JSONResponse:
    """Which process ran the function (the local host runs it in a worker process)."""
    return JSONResponse({"pid": os.getpid(), "ppid": os.getppid()})


@app.route(route="watch_sigterm", methods=["GET"])
async def watch_sigterm(req: Request) -> JSONResponse:
    """Chain a SIGTERM handler in front of the one in place (the runtime's, while its HTTP server
    serves): it writes the time it ran to ``marker``, then hands the signal on."""
    marker = Path(req.query_params["marker"])
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        marker.write_text(str(time.time()))
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, handler)
    return JSONResponse({"previous": getattr(previous, "__qualname__", repr(previous))})
