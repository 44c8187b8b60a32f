"""chatstream/worker_fix.py on the runtime's own HttpCoordinator: an invocation's entry is gone once
its response was taken, and the workaround applies only where it was checked."""

from __future__ import annotations

import asyncio
import logging
import types

import pytest
from fastapi import Request
from fastapi.responses import JSONResponse

from chatstream import worker_fix


@pytest.fixture
def runtime():
    """The installed runtime's http_v2 module, its coordinator's method restored after the test."""
    from azure_functions_runtime import http_v2, version

    original = http_v2.HttpCoordinator.await_http_response_async
    yield {"azure_functions_runtime.http_v2": http_v2, "azure_functions_runtime.version": version}
    http_v2.HttpCoordinator.await_http_response_async = original


async def one_invocation(coordinator, invocation_id: str) -> object:
    """What the worker does for one HTTP invocation: the HTTP server's handler hands the request over
    and waits for the response; the invocation takes the request and sets the response."""

    async def server_side():
        coordinator.set_http_request(invocation_id, "request")
        return await coordinator.await_http_response_async(invocation_id)

    async def invocation():
        assert await coordinator.get_http_request_async(invocation_id) == "request"
        coordinator.set_http_response(invocation_id, "response")

    response, _ = await asyncio.gather(server_side(), invocation())
    return response


async def test_the_runtime_as_installed_leaks_an_entry_per_invocation(runtime):
    coordinator = runtime["azure_functions_runtime.http_v2"].HttpCoordinator.__new__(
        runtime["azure_functions_runtime.http_v2"].HttpCoordinator
    )
    coordinator.__init__()
    assert await one_invocation(coordinator, "inv-1") == "response"
    assert list(coordinator._context_references) == ["inv-1"], "the leak the workaround is for"


async def test_with_the_workaround_the_entry_goes_once_the_response_is_taken(runtime):
    assert worker_fix.apply(runtime) is True
    assert worker_fix.apply(runtime) is True, "applying it twice changes nothing"
    http_v2 = runtime["azure_functions_runtime.http_v2"]
    coordinator = http_v2.HttpCoordinator.__new__(http_v2.HttpCoordinator)
    coordinator.__init__()
    for i in range(100):
        assert await one_invocation(coordinator, f"inv-{i}") == "response"
    assert coordinator._context_references == {}
    # A failed function: the exception is the response, taken the same way.
    error = ValueError("boom")

    async def failing():
        coordinator.set_http_request("inv-x", "request")
        waiting = asyncio.ensure_future(coordinator.await_http_response_async("inv-x"))
        await coordinator.get_http_request_async("inv-x")
        coordinator.set_http_response("inv-x", error)
        return await waiting

    assert await failing() is error and coordinator._context_references == {}


def test_not_applied_outside_the_worker_nor_to_unchecked_versions(runtime, caplog):
    assert worker_fix.apply({}) is False, "not in the worker: nothing to do"
    newer = {**runtime, "azure_functions_runtime.version": types.SimpleNamespace(VERSION="1.4.0")}
    with caplog.at_level(logging.WARNING, logger="chatstream"):
        assert worker_fix.apply(newer) is False
    assert "1.4.0" in caplog.text and "not applied" in caplog.text
    original = runtime["azure_functions_runtime.http_v2"].HttpCoordinator.await_http_response_async
    assert not getattr(original, worker_fix._MARK, False)
    odd = {**runtime, "azure_functions_runtime.http_v2": types.SimpleNamespace()}
    assert worker_fix.apply(odd) is False


def test_the_workers_http_route_matches_a_path_with_a_line_feed():
    """Issue #23 item 17: the FastAPI extension's one route, /{path:path}, did not match a line feed
    (FastAPI answered {"detail": "Not Found"} and the function never ran)."""
    from azurefunctions.extensions.http.fastapi import web
    from starlette.testclient import TestClient

    original = web.WebApp.route
    try:

        def serve() -> TestClient:
            app = web.WebApp()

            @app.route
            async def catch_all(request: Request):
                return JSONResponse({"path": request.scope["path"]})

            return TestClient(app.get_app())

        assert serve().get("/api/v1/x%0Ay").json() == {"detail": "Not Found"}, "the fault, as installed"
        assert worker_fix.route_any_path({"azurefunctions.extensions.http.fastapi.web": web}) is True
        assert worker_fix.route_any_path({"azurefunctions.extensions.http.fastapi.web": web}) is True
        assert serve().get("/api/v1/x%0Ay").json() == {"path": "/api/v1/x\ny"}
        assert serve().get("/api/v1/models").json() == {"path": "/api/v1/models"}
        assert worker_fix.route_any_path({}) is False
    finally:
        web.WebApp.route = original
