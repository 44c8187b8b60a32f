"""The ``Store`` (store.py) on the Function App's own storage account (Azurite locally).

Every data call is a plain REST request on the app's one aiohttp session (store_rest.py): 0.22 to
0.39 ms of CPU a call, where the azure SDKs' pipeline of policies and header models took 0.8 to
1.9 ms (a query 0.3 ms instead of 1.1 to 1.3; a batch of ten 0.85 ms instead of 4.4 to 5.1:
tools/bench/store_calls.py on Azurite, 300 calls of each); a resumable stream's CPU went to 0.68 to
0.79 times what it was with the SDK (the bench's resume path at 100 streams). The SDKs do only what
a request cannot do by itself: read the connection string, create a table or the container (when a
call finds it missing, then the call goes once more: a first run on Azurite, or one deleted under
us; infra/ makes them in Azure and scopes the app identity's roles to them), and sign (a SAS made
from the account key, or the connection string's own SAS; a token of azure-identity's credential).
Their clients load only then (``azure.data.tables.aio``, ``azure.storage.blob.aio``), and with an
identity the SDKs themselves too: an instance whose tables and container are there never loads them
(with a key, the SAS helpers need them).

Every call is bounded (``timeout``), and every answer's ``Date`` tells the store's clock
(``StoreClock``). What fails becomes the store's own error in one place, ``store_error``: the
service's refusals (``Refused``, and the SDK's errors when it creates), aiohttp's and the
network's errors, a timeout, as httpx maps its transport's exceptions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
from azure.core.exceptions import AzureError, ClientAuthenticationError, HttpResponseError

from ..errors import AlreadyExists, Modified, NotFound, StoreError, StoreTimeout, StoreUnavailable
from .store import (
    CALL_TIMEOUT,
    CONNECTION,
    NEW,
    STREAMS_CONTAINER,
    Op,
    Row,
    StorageConfig,
    StoreClock,
    StoreConfigError,
    Where,
    check_batch,
    check_key,
    clean,
    http_date_seconds,
    with_index,
)
from .store_rest import NoToken, Refused, Rest

if TYPE_CHECKING:
    from azure.data.tables.aio import TableServiceClient
    from azure.storage.blob.aio import BlobServiceClient

# azure-core logs every storage request and response at INFO: noise.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)

# The SDK clients (creating a table or the container): one quick retry; no proxy settings read from
# the environment on every call (a Function App reaches its storage account directly).
_CLIENT_OPTIONS: dict[str, Any] = {
    "retry_total": 1,
    "retry_backoff_factor": 0.1,
    "connection_timeout": 1.5,
    "read_timeout": 1.5,
    "use_env_settings": False,
}
# The error codes of a table or the container itself not there (deleted under us), and which it is.
GONE = {"TableNotFound": "table", "ContainerNotFound": "container"}

T = TypeVar("T")


class Gone(StoreUnavailable):
    """The table or the container itself is still not there once made (being deleted in Azure, or
    this identity may not create it)."""


def store_error(exc: BaseException, what: str = "call") -> StoreError | None:
    """The store's error for what a call (``what``) raised; None when it is not the store's (a bug
    of ours, raised as it is). The message never carries a URL (it may hold a SAS)."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, TimeoutError):
        return StoreTimeout(f"the store did not answer in time ({what})")
    if isinstance(exc, (NoToken, ClientAuthenticationError)):  # never a NotFound of the row asked for
        return StoreUnavailable(f"no token for the store ({exc if isinstance(exc, NoToken) else type(exc).__name__})")
    if isinstance(exc, Refused):
        status, code, index = exc.status, exc.code, exc.index
    elif isinstance(exc, HttpResponseError) and exc.status_code is not None:
        status, code, index = exc.status_code, getattr(exc, "error_code", None), None
    elif isinstance(exc, (AzureError, OSError, aiohttp.ClientError)):
        return StoreUnavailable(f"the store did not answer ({type(exc).__name__})")
    else:
        return None
    if status == 404 and code in GONE:
        return Gone(f"the store's {GONE[code]} is not there")
    if status in (404, 416):  # 416: nothing in the range asked for (past a blob's end)
        error: StoreError = NotFound("not found")
    elif status == 409:
        error = AlreadyExists("it exists")
    elif status == 412:
        error = Modified("a condition failed")
    else:
        error = StoreUnavailable(f"the store failed (HTTP {status})")
    return with_index(error, index) if index is not None else error


class AzureStore:
    """The store on an Azure Storage account (module docstring)."""

    def __init__(self, config: StorageConfig, clock: StoreClock | None = None):
        self.config = config
        self.clock = clock or StoreClock()
        self.calls: dict[str, int] = {}
        self._credential = None
        self._tables: TableServiceClient | None = None
        self._blobs: BlobServiceClient | None = None
        self._making: dict[str, asyncio.Future] = {}
        self._made: dict[str, float] = {}  # when each was last made (the loop's clock)
        self._first: dict[str, asyncio.Future] = {}  # each one's first call, done once it is answered
        self._rest: Rest | None = None

    def describe(self) -> str:
        return self.config.describe()

    # --- one call -----------------------------------------------------------------------------

    async def _call(
        self,
        op: str,
        timeout: float,
        missing: tuple[str, Callable[[], Awaitable[Any]]],
        call: Callable[[Rest], Awaitable[T]],
    ) -> T:
        """One store call within ``timeout`` seconds: what it raises becomes the store's error
        (``store_error``), an outage is noted on the clock. A call that finds its table or container
        ``missing`` (its key and what makes it) makes it and goes once more: the service did nothing.
        The first call on each in this process goes alone: the calls that come meanwhile wait for it
        (a burst of first calls on one not made yet would all be refused, then all sent again)."""
        self.calls[op] = self.calls.get(op, 0) + 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        key, create = missing
        first = None
        try:
            async with asyncio.timeout(timeout):
                rest = self._rest_client()
                gate = self._first.get(key)
                if gate is None:
                    first = self._first[key] = loop.create_future()
                elif not gate.done():
                    await asyncio.shield(gate)
                try:
                    answer = await call(rest)
                except Refused as exc:
                    if exc.status != 404 or exc.code not in GONE:
                        raise
                    await self._make(key, create, asked=started)
                    answer = await call(rest)
        except Exception as exc:  # store_error says which are the store's; the rest raise as they are
            error = store_error(exc, op)
            if error is None:
                raise
            if isinstance(error, StoreUnavailable):
                self.clock.failed()
            else:  # an answer all the same (404, 409, 412)
                self.clock.took(loop.time() - started)
            if error is exc:
                raise
            raise error from None
        finally:
            if first is not None:  # however it ended: the calls that wait go on
                first.set_result(None)
        self.clock.took(loop.time() - started)
        return answer

    def _table_call(self, op: str, table: str, timeout: float, call: Callable[[Rest], Awaitable[T]]) -> Awaitable[T]:
        return self._call(op, timeout, (f"table:{table}", lambda: self._table_service().create_table(table)), call)

    def _blob_call(self, op: str, timeout: float, call: Callable[[Rest], Awaitable[T]]) -> Awaitable[T]:
        return self._call(op, timeout, ("container", self._container_create), call)

    # --- clients ------------------------------------------------------------------------------

    def _observe(self, headers: Mapping[str, str]) -> None:
        """Every answer: the store's clock, from its Date header."""
        seconds = http_date_seconds(headers.get("Date"))
        if seconds is not None:
            self.clock.observe(seconds)

    def _identity(self):
        if self._credential is None:
            from azure.identity.aio import DefaultAzureCredential, ManagedIdentityCredential

            if (self.config.credential or "").lower() == "managedidentity":
                self._credential = ManagedIdentityCredential(client_id=self.config.client_id)
            else:
                self._credential = DefaultAzureCredential()
        return self._credential

    def _options(self) -> dict[str, Any]:
        return {**_CLIENT_OPTIONS, "raw_response_hook": lambda response: self._observe(response.http_response.headers)}

    def _table_service(self) -> TableServiceClient:
        """The tables SDK's client, to create a table (module docstring)."""
        if self._tables is None:
            from azure.data.tables.aio import TableServiceClient

            if self.config.connection_string is not None:
                self._tables = TableServiceClient.from_connection_string(
                    self.config.connection_string, **self._options()
                )
            elif self.config.table_url is not None:
                self._tables = TableServiceClient(self.config.table_url, credential=self._identity(), **self._options())
            else:
                raise StoreConfigError(f"{CONNECTION}__tableServiceUri: not set")
        return self._tables

    def _blob_service(self) -> BlobServiceClient:
        """The blob SDK's client, to create the container (module docstring)."""
        if self._blobs is None:
            from azure.storage.blob.aio import BlobServiceClient

            if self.config.connection_string is not None:
                self._blobs = BlobServiceClient.from_connection_string(self.config.connection_string, **self._options())
            elif self.config.blob_url is not None:
                self._blobs = BlobServiceClient(self.config.blob_url, credential=self._identity(), **self._options())
            else:
                raise StoreConfigError(f"{CONNECTION}__blobServiceUri: not set")
        return self._blobs

    async def _container_create(self) -> None:
        await self._blob_service().get_container_client(STREAMS_CONTAINER).create_container()

    def _rest_client(self) -> Rest:
        """The REST client, signed as the settings allow: with a connection string, its account key
        or its SAS (as the SDK reads the string); otherwise the app's identity."""
        if self._rest is None:
            if self.config.connection_string is None:
                self._rest = Rest(
                    table_url=self.config.table_url,
                    blob_url=self.config.blob_url,
                    container=STREAMS_CONTAINER,
                    observe=self._observe,
                    identity=self._identity(),
                )
                return self._rest
            # The SDKs' sync clients read the connection string as their async ones would (the
            # async modules load only to create: module docstring); they make no request.
            from azure.data.tables import TableServiceClient as Tables
            from azure.storage.blob import BlobServiceClient as Blobs

            try:
                tables = Tables.from_connection_string(self.config.connection_string)
            except ValueError:  # its message is the SDK's; ours names the setting, never a value
                raise StoreConfigError(
                    f"{CONNECTION}: the connection string has no AccountKey or a SharedAccessSignature for the "
                    "tables, or is malformed"
                ) from None
            blobs = Blobs.from_connection_string(self.config.connection_string)
            table_key, blob_key = tables.credential, getattr(blobs.credential, "account_key", None)
            blob_url = urlsplit(blobs.url)
            self._rest = Rest(
                table_url=tables.url,
                blob_url=blob_url._replace(query="").geturl(),
                container=STREAMS_CONTAINER,
                observe=self._observe,
                table_key=table_key if isinstance(table_key, AzureNamedKeyCredential) else None,
                table_sas=table_key.signature if isinstance(table_key, AzureSasCredential) else None,
                blob_key=(str(blobs.account_name), blob_key) if blob_key else None,
                blob_sas=blob_url.query or None,
            )
        return self._rest

    async def _make(self, key: str, create: Callable[[], Awaitable[Any]], asked: float) -> None:
        """Create a table or the container: callers that find it missing meanwhile wait for the one
        attempt, and one whose call was ``asked`` before an attempt succeeded goes on without another
        (a burst of first calls makes it once); a later one tries again (409: it is there)."""
        if self._made.get(key, -1.0) > asked:
            return
        making = self._making.get(key)
        if making is None or making.done():
            making = self._making[key] = asyncio.ensure_future(self._create(key, create))
            making.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, whoever waits
        await asyncio.shield(making)

    async def _create(self, key: str, create: Callable[[], Awaitable[Any]]) -> None:
        async with asyncio.timeout(CALL_TIMEOUT):
            try:
                await create()
            except HttpResponseError as exc:
                # 409: it is there; 403: this identity may not create it (infra/ made it).
                if exc.status_code not in (403, 409):
                    raise
        self._made[key] = asyncio.get_running_loop().time()

    # --- tables -------------------------------------------------------------------------------

    async def get(
        self,
        table: str,
        partition: str,
        row: str,
        *,
        select: Sequence[str] | None = None,
        timeout: float = CALL_TIMEOUT,
    ) -> Row | None:
        check_key("PartitionKey", partition)
        check_key("RowKey", row)
        try:
            return await self._table_call("get", table, timeout, lambda rest: rest.get(table, partition, row, select))
        except NotFound:
            return None

    async def insert(self, table: str, entity: Mapping[str, Any], *, timeout: float = CALL_TIMEOUT) -> str:
        values = clean(entity)
        return await self._table_call("insert", table, timeout, lambda rest: rest.insert(table, values))

    async def replace(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> str:
        values = clean(entity)
        return await self._table_call("replace", table, timeout, lambda rest: rest.update(table, values, etag, False))

    async def merge(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> str:
        values = clean(entity)
        return await self._table_call("merge", table, timeout, lambda rest: rest.update(table, values, etag, True))

    async def upsert(self, table: str, entity: Mapping[str, Any], *, timeout: float = CALL_TIMEOUT) -> str:
        values = clean(entity)
        return await self._table_call("upsert", table, timeout, lambda rest: rest.upsert(table, values))

    async def delete(
        self, table: str, partition: str, row: str, *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> None:
        check_key("PartitionKey", partition)
        check_key("RowKey", row)
        with contextlib.suppress(NotFound):  # quiet on a missing row
            await self._table_call("delete", table, timeout, lambda rest: rest.delete(table, partition, row, etag))

    async def query(self, table: str, where: Where, *, timeout: float = CALL_TIMEOUT) -> list[Row]:
        return await self._table_call("query", table, timeout, lambda rest: rest.query(table, where))

    async def batch(self, table: str, ops: Sequence[Op], *, timeout: float = CALL_TIMEOUT) -> list[str | None]:
        check_batch(ops)
        cleaned = [op if op.kind == "delete" else Op(op.kind, clean(op.entity), op.etag) for op in ops]
        return await self._table_call("batch", table, timeout, lambda rest: rest.batch(table, cleaned))

    # --- blobs --------------------------------------------------------------------------------

    async def append_create(self, name: str, *, timeout: float = CALL_TIMEOUT) -> None:
        try:
            await self._blob_call("append_create", timeout, lambda rest: rest.append_create(name))
        except Modified:  # If-None-Match: * (Azure answers 409, Azurite 412)
            raise AlreadyExists("the blob exists") from None

    async def append(self, name: str, data: bytes, *, at: int, timeout: float = CALL_TIMEOUT) -> int:
        await self._blob_call("append", timeout, lambda rest: rest.append(name, data, at))
        return at + len(data)  # the append position condition held: the blob is now this long

    async def read(self, name: str, offset: int = 0, *, timeout: float = CALL_TIMEOUT) -> bytes:
        try:
            return await self._blob_call("read", timeout, lambda rest: rest.read(name, offset))
        except NotFound:  # no blob, or nothing past offset
            return b""

    async def size(self, name: str, *, timeout: float = CALL_TIMEOUT) -> int | None:
        try:
            return await self._blob_call("size", timeout, lambda rest: rest.size(name))
        except NotFound:
            return None

    async def put(self, name: str, data: bytes, *, etag: str | None = None, timeout: float = CALL_TIMEOUT) -> str:
        condition = {"If-None-Match": "*"} if etag == NEW else {"If-Match": etag} if etag is not None else {}
        try:
            return await self._blob_call("put", timeout, lambda rest: rest.put(name, data, condition))
        except (AlreadyExists, NotFound):
            raise Modified("the blob changed") from None

    async def get_blob(self, name: str, *, timeout: float = CALL_TIMEOUT) -> tuple[bytes, str] | None:
        try:
            return await self._blob_call("get_blob", timeout, lambda rest: rest.get_blob(name))
        except NotFound:
            return None

    async def delete_blob(self, name: str, *, timeout: float = CALL_TIMEOUT) -> None:
        with contextlib.suppress(NotFound):
            await self._blob_call("delete_blob", timeout, lambda rest: rest.delete_blob(name))

    async def close(self) -> None:
        if self._rest is not None:
            await self._rest.close()
            self._rest = None
        for client in (self._tables, self._blobs, self._credential):
            if client is not None:
                await client.close()
        self._tables = self._blobs = self._credential = None
        self._making.clear()
        self._made.clear()
        self._first.clear()
