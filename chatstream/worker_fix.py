"""Workarounds for two faults of the Python worker that runs the app (``azure-functions-runtime``,
what Azure runs for Python 3.13, with the ``azurefunctions-extensions-http-fastapi`` extension for
HTTP streaming), applied when the app is built (``app.create_app``), inside that worker only.

1. A memory leak (``apply``).

The leak: ``azure_functions_runtime/http_v2.py``, class ``HttpCoordinator`` (the singleton
``http_coordinator``). Every HTTP-streaming invocation adds an ``AsyncContextReference`` (two
``asyncio.Event``s and six fields) to ``HttpCoordinator._context_references``, keyed by its
invocation id, in ``set_http_request`` / ``get_http_request_async``; ``_pop_http_request`` and
``_pop_http_response`` clear the entry's request and response, but nothing ever deletes the entry.
Measured through the local host: each worker grows ~2.1 KB per request, without bound
(docs/reliability.md has the report for the runtime's maintainers).

The workaround deletes an invocation's entry once the worker's HTTP server has taken the function's
response (``await_http_response_async`` returned it), and changes nothing else. Nothing reads the
entry after that: ``invocation_request`` (``handle_event.py``) calls ``set_http_response`` once and
returns without awaiting, so by the time the HTTP server's handler wakes up and takes the response,
the invocation is over. It is applied only inside that worker (the module is loaded), only to the
versions read and measured here (``CHECKED``), and only when the class still has the shape it was
written for; otherwise it logs why it was not applied.

2. A path with a line feed never reaches the function (``route_any_path``). The extension's
``WebApp.route`` (``azurefunctions/extensions/http/fastapi/web.py``) registers the worker's one HTTP
route as ``/{path:path}``, whose regular expression (Starlette's path convertor, ``.*``) does not
match a line feed: a request whose URL has ``%0A`` (``GET /api/v1/responses/resp_a%0D%0Ab``) gets
FastAPI's own ``{"detail": "Not Found"}``, and the invocation the host started for it waits for its
request forever. That route is made to match any path (``re.DOTALL``), so such a request reaches
its function, which answers it (400 for a malformed id, OpenAI's 404 for an unknown path)."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

log = logging.getLogger("chatstream")

RUNTIME = "azure_functions_runtime"
EXTENSION = "azurefunctions.extensions.http.fastapi"
ANY_PATH = "/{path:path}"
# The versions whose HttpCoordinator was read and found leaking (1.3.0 is the newest released when
# this was written). A newer version is left alone, with a warning: check whether it still leaks.
CHECKED = ((1, 0, 0), (1, 3, 0))
_MARK = "_chatstream_deletes_entries"


def _version(text: str) -> tuple[int, int, int] | None:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def apply(modules: dict[str, Any] | None = None) -> bool:
    """Install both workarounds in the running worker; True when the leak's is in place (now or
    before)."""
    modules = sys.modules if modules is None else modules
    http_v2 = modules.get(f"{RUNTIME}.http_v2")
    if http_v2 is None:
        return False  # not running in that worker (unit tests, another host): nothing to fix
    route_any_path(modules)
    version_module = modules.get(f"{RUNTIME}.version")
    text = str(getattr(version_module, "VERSION", ""))
    version = _version(text)
    if version is None or not CHECKED[0] <= version <= CHECKED[1]:
        log.warning(
            "%s %s: the workaround for its HttpCoordinator memory leak is written for versions %s to %s; "
            "not applied (check whether this version still leaks: docs/reliability.md)",
            RUNTIME,
            text or "(unknown version)",
            ".".join(map(str, CHECKED[0])),
            ".".join(map(str, CHECKED[1])),
        )
        return False
    coordinator = getattr(http_v2, "HttpCoordinator", None)
    original = getattr(coordinator, "await_http_response_async", None)
    if getattr(original, _MARK, False):
        return True
    references = getattr(getattr(http_v2, "http_coordinator", None), "_context_references", None)
    if coordinator is None or original is None or not isinstance(references, dict):
        log.warning("%s %s: HttpCoordinator is not as expected; the leak's workaround is not applied", RUNTIME, text)
        return False

    async def await_http_response_async(self, invoc_id):
        response = await original(self, invoc_id)
        self._context_references.pop(invoc_id, None)  # the runtime's code never deletes it
        return response

    setattr(await_http_response_async, _MARK, True)
    coordinator.await_http_response_async = await_http_response_async
    return True


def route_any_path(modules: dict[str, Any]) -> bool:
    """Make the worker's HTTP route match every path (2. above); True when it does (now or before)."""
    web_app = getattr(modules.get(f"{EXTENSION}.web"), "WebApp", None)
    original = getattr(web_app, "route", None)
    if web_app is None or original is None:
        return False  # not the FastAPI extension: nothing of this applies
    if getattr(original, _MARK, False):
        return True

    def route(self, func):
        registered = original(self, func)
        for each in getattr(getattr(getattr(self, "web_app", None), "router", None), "routes", ()):
            if getattr(each, "path", None) == ANY_PATH and isinstance(getattr(each, "path_regex", None), re.Pattern):
                each.path_regex = re.compile(each.path_regex.pattern, each.path_regex.flags | re.DOTALL)
        return registered

    setattr(route, _MARK, True)
    web_app.route = route
    return True
