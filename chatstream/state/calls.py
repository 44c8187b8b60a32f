"""Store calls on the request path: bounded in time, and one error for the caller when the store fails.

``bounded(coro)`` runs a whole store operation (the table's first-use creation included) within
``CALL_TIMEOUT``; an outage (no answer in time, a refused connection, a 5xx, throttling, an
authorization failure) becomes ``StoreDown``. The outcomes a caller of the store expects and handles
(404 not found, 409 exists, 412 modified, a transaction refused for one of those) pass through as
the SDK raised them. Nothing is remembered about a failure: the next call tries again, so the app
recovers by itself when the store returns."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from azure.core.exceptions import AzureError, HttpResponseError

from ..errors import ApiError
from .legacy_store import CALL_TIMEOUT, StoreUnavailable

T = TypeVar("T")

# What a store answering means (the operation's outcome, not an outage): handled by the caller.
_OUTCOMES = {404, 409, 412}


class StoreDown(StoreUnavailable):
    """The store did not answer usefully within the bound (the message names no secret)."""


def store_unavailable() -> ApiError:
    """What a caller sees when the store is slow or down: nothing was started, nothing charged."""
    return ApiError(
        503,
        "caller_store_unavailable",
        "the app's caller store did not answer in time; nothing was charged, try again",
        retryable=True,
        headers={"Retry-After": "2"},
    )


async def bounded(awaitable: Awaitable[T], limit: float = CALL_TIMEOUT) -> T:
    """Await one store operation within ``limit`` seconds; an outage raises ``StoreDown``."""
    try:
        async with asyncio.timeout(limit):
            return await awaitable
    except HttpResponseError as exc:
        if exc.status_code in _OUTCOMES:
            raise
        raise StoreDown(f"the store failed (HTTP {exc.status_code})") from None
    except StoreDown:
        raise
    except StoreUnavailable as exc:  # store.py's own (a table it could not create)
        raise StoreDown(str(exc)) from None
    except (AzureError, OSError, TimeoutError) as exc:
        raise StoreDown(f"the store did not answer ({type(exc).__name__})") from None
