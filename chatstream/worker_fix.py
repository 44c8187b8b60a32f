"""A workaround for a memory leak of the Python worker that runs the app (``azure-functions-runtime``,
what Azure runs for Python 3.13), applied when the app is built (``app.create_app``).

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
written for; otherwise it logs why it was not applied."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

log = logging.getLogger("chatstream")

RUNTIME = "azure_functions_runtime"
# The versions whose HttpCoordinator was read and found leaking (1.3.0 is the newest released when
# this was written). A newer version is left alone, with a warning: check whether it still leaks.
CHECKED = ((1, 0, 0), (1, 3, 0))
_MARK = "_chatstream_deletes_entries"


def _version(text: str) -> tuple[int, int, int] | None:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def apply(modules: dict[str, Any] | None = None) -> bool:
    """Install the workaround in the running worker; True when it is in place (now or before)."""
    modules = sys.modules if modules is None else modules
    http_v2 = modules.get(f"{RUNTIME}.http_v2")
    if http_v2 is None:
        return False  # not running in that worker (unit tests, another host): nothing to fix
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
