"""How the parts of a stream log reach the store: every call bounded in time, a store failure
turned into ``StoreUnavailable`` (an answer such as 404/409/412 passes through for the caller to
handle), best-effort calls that only log; and ``StreamStore``, the stream log as its parts see it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from azure.core.exceptions import AzureError, HttpResponseError
from azure.data.tables.aio import TableClient
from azure.storage.blob.aio import ContainerClient

from ..legacy_store import CALL_TIMEOUT, StoreUnavailable
from .config import ResumeConfig
from .format import EncodeError

log = logging.getLogger("chatstream")
T = TypeVar("T")


class StreamStore(Protocol):
    """A stream log (``StreamLog``) as its parts see it: its settings, its store calls (through the
    log's own two methods, so that whatever wraps them sees every call) and its tasks (none started
    after close)."""

    config: ResumeConfig
    instance: str
    encode_error: EncodeError
    _closed: bool
    fast_writers: int  # producers here writing fast now (someone elsewhere follows them)
    remote_readers: int  # readers here following a stream stored by another instance
    bulk: asyncio.Semaphore  # held by each background write and remote poll (ResumeConfig.bulk_calls)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None: ...

    async def _call_table(self, op: Callable[[TableClient], Awaitable[T]], limit: float = CALL_TIMEOUT) -> T: ...

    async def _call_blob(self, op: Callable[[ContainerClient], Awaitable[T]]) -> T: ...

    async def _read_range(self, stream_id: str, offset: int) -> bytes: ...


def unavailable(exc: BaseException) -> bool:
    """A store failure (vs an answer such as 404/409/412 the caller handles)."""
    status = exc.status_code if isinstance(exc, HttpResponseError) else None
    if status is not None:
        return status >= 500 or status in (401, 403, 408, 429)
    return True


async def bounded(call: Awaitable[T], limit: float = CALL_TIMEOUT) -> T:
    """One store call within ``limit`` seconds; store failures become StoreUnavailable."""
    try:
        async with asyncio.timeout(limit):
            return await call
    except TimeoutError:
        raise StoreUnavailable("the store did not answer in time") from None
    except (AzureError, OSError) as exc:
        if unavailable(exc):
            status = getattr(exc, "status_code", None)
            raise StoreUnavailable(
                f"the store failed ({type(exc).__name__}{f', HTTP {status}' if status else ''})"
            ) from None
        raise


async def quietly(call: Callable[[], Awaitable[Any]]) -> None:
    try:
        await call()
    except Exception as exc:  # noqa: BLE001 - best effort: a row left behind expires and is swept
        log.debug("resumable streams: %s", exc)
