"""Logging of the host and of its worker processes: one stderr (the workers inherit the host's),
INFO for devhost and the app, the runtime's and the servers' own chatter only with --verbose."""

from __future__ import annotations

import asyncio
import logging
import sys

QUIET = (
    "azure_functions_worker",
    "azure_functions_runtime",
    "azure.functions",
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
    "httpx",
    "httpx2",
    "httpcore",
    "openai",
)


def configure(verbose: bool, worker: bool = False) -> None:
    """Idempotent; the worker calls it again after its uvicorn has reset logging."""
    who = "[worker %(process)d] " if worker else ""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"
    )
    quiet = logging.DEBUG if verbose else logging.WARNING
    # The runtime and the worker's uvicorn log every request at INFO; keep that for --verbose.
    for name in QUIET:
        logging.getLogger(name).setLevel(quiet)


class _NotCutRequests(logging.Filter):
    """uvicorn logs a traceback for every request task it cancels at the end of its graceful
    shutdown (the host's shutdown timeout); the host logs those requests itself (``Executed … (Cancelled
    …)``), so the tracebacks go."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def quiet_cut_requests() -> None:
    logging.getLogger("uvicorn.error").addFilter(_NotCutRequests())
