"""The ``Store`` (store.py) on the Function App's own storage account, through the azure SDKs
(azure-data-tables, azure-storage-blob; Azurite locally): what they raise is mapped here, once, into
the store's errors (``_mapped``), as httpx maps its transport's exceptions.

The clients are made on first use; a table (or the container) is created the first time it is used
when it does not exist yet and the identity may create it (infra/ makes them in Azure, and scopes the
app identity's roles to them). Each client retries a failed call once, quickly, inside the call's
bound. Every answer's ``Date`` tells the store's clock (``StoreClock``).

The calls every request makes (a row's get, insert, replace, merge, upsert, delete; a query; a
batch; an append blob's create, appends and reads; a whole blob's put and get) go through plain
aiohttp requests instead (store_rest.py): 3 to 6 times less CPU per call than the SDK's pipeline
of policies and header models (0.22 to 0.39 ms a call instead of 0.8 to 1.9 ms; a batch of ten
0.85 ms instead of 4.4 to 5.1 ms: tools/bench/store_calls.py on Azurite); a resumable stream's
CPU is 0.68 to 0.79 times what it was (the bench's resume path at 100 streams). Creating a table
or the container, a blob's size and delete stay on the SDK, as does everything when the
settings give no key or identity to make a token with (a connection string with a SAS)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import aiohttp
from azure.core import MatchConditions
from azure.core.credentials import AzureNamedKeyCredential
from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
)
from azure.data.tables import EdmType, EntityProperty, TableTransactionError, UpdateMode
from azure.data.tables.aio import TableClient, TableServiceClient
from azure.storage.blob import BlobType
from azure.storage.blob.aio import BlobServiceClient, ContainerClient

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
from .store_rest import GONE, NoRestAccess, Rest, odata_filter, status_error

log = logging.getLogger("chatstream")
# azure-core logs every storage request and response at INFO: a line per counter exchange is noise.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)

_CLIENT_OPTIONS: dict[str, Any] = {
    "retry_total": 1,
    "retry_backoff_factor": 0.1,
    "connection_timeout": 1.5,
    "read_timeout": 1.5,
    # No proxy settings read from the environment on every call (a quarter of the SDK's CPU per call
    # here); a Function App reaches its storage account directly.
    "use_env_settings": False,
}
# A conditional write (an insert, a write under an ETag or an append position, a transaction) is
# sent once: the SDK's retry after a timeout resends a request whose first try may have landed, and
# the retry's 409/412 would then say "someone else wrote" of our own write (a counter exchange read
# that way gave back capacity it had already given back). The caller decides after a timeout, by
# reading (counters.py, journal.py); unconditional writes and reads keep the one retry.
_ONCE: dict[str, Any] = {"retry_total": 0}

T = TypeVar("T")


class _Sdk(enum.Enum):
    SDK = 0


SDK: Final = _Sdk.SDK  # what ``AzureStore._by_rest`` answers when the SDK must make the call


@contextlib.asynccontextmanager
async def _mapped(timeout: float, what: str = "call", clock: StoreClock | None = None) -> AsyncIterator[None]:
    """One store call within ``timeout`` seconds; whatever the SDK (or the network) raises becomes
    the store's own error (an outage is noted on ``clock``). The message never carries a URL (it
    may hold a SAS)."""
    started = asyncio.get_running_loop().time()
    try:
        async with _errors(timeout, what):
            yield
    except StoreUnavailable:
        if clock is not None:
            clock.failed()
        raise
    except StoreError:
        if clock is not None:  # an answer all the same (404, 409, 412)
            clock.took(asyncio.get_running_loop().time() - started)
        raise
    if clock is not None:
        clock.took(asyncio.get_running_loop().time() - started)


@contextlib.asynccontextmanager
async def _errors(timeout: float, what: str) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(timeout):
            yield
    except StoreError:
        raise
    except TimeoutError:
        raise StoreTimeout(f"the store did not answer in time ({what})") from None
    except ResourceExistsError:
        raise AlreadyExists("it exists") from None
    except ResourceModifiedError:
        raise Modified("a condition failed") from None
    except ResourceNotFoundError as exc:
        if _gone(exc):  # the table or container itself: re-created on the next call (AzureStore._observe)
            raise StoreUnavailable(f"the store lost its {_gone(exc)} (re-created on the next call)") from None
        raise NotFound("not found") from None
    except TableTransactionError as exc:  # a batch: which operation failed
        raise with_index(status_error(exc.status_code), exc.index) from None
    except HttpResponseError as exc:
        raise status_error(exc.status_code) from None
    except (AzureError, OSError, aiohttp.ClientError) as exc:
        raise StoreUnavailable(f"the store did not answer ({type(exc).__name__})") from None


def _gone(exc: ResourceNotFoundError) -> str | None:
    """``table`` or ``container`` when the call failed because that is not there (deleted under us)."""
    code = getattr(exc, "error_code", None) or (getattr(exc.response, "headers", None) or {}).get("x-ms-error-code")
    return GONE.get(str(code))


def _to_store(entity: Mapping[str, Any]) -> dict[str, Any]:
    """Our values as the SDK writes them: every int as Int64 (the SDK would pick Int32 for small
    ones and refuse large ones), the rest as they are."""
    return {
        k: EntityProperty(v, EdmType.INT64) if type(v) is int and k not in ("PartitionKey", "RowKey") else v
        for k, v in clean(entity).items()
    }


def _cleaned(op: Op) -> Op:
    return Op(op.kind, clean(op.entity), op.etag)


def _from_store(entity: Any) -> Row:
    values = {k: (v.value if isinstance(v, EntityProperty) else v) for k, v in entity.items()}
    return Row.of(values, entity.metadata.get("etag", ""))


def _condition(etag: str | None) -> dict[str, Any]:
    if etag is None:
        return {"match_condition": MatchConditions.Unconditionally}
    return {"etag": etag, "match_condition": MatchConditions.IfNotModified}


def _sent_once_if(etag: str | None) -> dict[str, Any]:
    """``_condition``, and a write under an ETag sent once (``_ONCE``)."""
    return _condition(etag) if etag is None else {**_condition(etag), **_ONCE}


def _sdk_operations(ops: Sequence[Op]) -> list[Any]:
    """A batch's operations as the SDK's ``submit_transaction`` takes them."""
    operations: list[Any] = []
    for op in ops:
        if op.kind == "insert":
            operations.append(("create", _to_store(op.entity)))
        elif op.kind == "upsert":
            operations.append(("upsert", _to_store(op.entity), {"mode": UpdateMode.REPLACE}))
        elif op.kind == "delete":
            keys = {"PartitionKey": op.entity["PartitionKey"], "RowKey": op.entity["RowKey"]}
            operations.append(("delete", keys, _condition(op.etag) if op.etag else {}))
        else:
            mode = UpdateMode.REPLACE if op.kind == "replace" else UpdateMode.MERGE
            operations.append(("update", _to_store(op.entity), {"mode": mode, **_condition(op.etag)}))
    return operations


def _odata(where: Where) -> tuple[str, dict[str, Any]]:
    parts: list[str] = []
    parameters: dict[str, Any] = {}
    if where.partition is not None:
        parts.append("PartitionKey eq @pk")
        parameters["pk"] = where.partition
    if where.rows_from is not None:
        parts.append("RowKey ge @lo")
        parameters["lo"] = where.rows_from
    if where.rows_to is not None:
        parts.append("RowKey lt @hi")
        parameters["hi"] = where.rows_to
    for op, conditions in (("eq", where.equal), ("lt", where.less), ("ge", where.at_least)):
        for i, (name, value) in enumerate(conditions.items()):
            if not name.isidentifier():
                raise ValueError(f"not a property name: {name!r}")
            key = f"{op}{i}"
            parts.append(f"{name} {op} @{key}")
            parameters[key] = value
    return " and ".join(parts) or "PartitionKey ne ''", parameters


class AzureStore:
    """The store on an Azure Storage account (module docstring)."""

    def __init__(self, config: StorageConfig, clock: StoreClock | None = None):
        self.config = config
        self.clock = clock or StoreClock()
        self.calls: dict[str, int] = {}
        self._credential = None
        self._tables: TableServiceClient | None = None
        self._blobs: BlobServiceClient | None = None
        self._ready: dict[str, asyncio.Future] = {}
        self._rest: Rest | None = None
        self._sdk_only = False  # no REST access with these settings: everything through the SDK

    def describe(self) -> str:
        return self.config.describe()

    def rest_off(self) -> None:
        """Every call through the SDK from now on (tests and tools/bench/store_calls.py compare)."""
        self._sdk_only = True

    def uses_rest(self) -> bool:
        """Whether the hot calls go through the REST path (store_rest.py) with these settings."""
        return not self._sdk_only

    # --- clients ------------------------------------------------------------------------------

    def _observe(self, response: Any) -> None:
        """Every answer of the SDK: ``_observe_headers``."""
        self._observe_headers(response.http_response.headers)

    def _observe_headers(self, headers: Mapping[str, str]) -> None:
        """Every answer: the store's clock, from its Date header."""
        seconds = http_date_seconds(headers.get("Date"))
        if seconds is not None:
            self.clock.observe(seconds)
        if headers.get("x-ms-error-code") in GONE:  # deleted under us: create it again on the next use
            self._ready.clear()

    def _options(self) -> dict[str, Any]:
        return {**_CLIENT_OPTIONS, "raw_response_hook": self._observe}

    def _identity(self):
        if self._credential is None:
            from azure.identity.aio import DefaultAzureCredential, ManagedIdentityCredential

            if (self.config.credential or "").lower() == "managedidentity":
                self._credential = ManagedIdentityCredential(client_id=self.config.client_id)
            else:
                self._credential = DefaultAzureCredential()
        return self._credential

    def _table_service(self) -> TableServiceClient:
        if self._tables is None:
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
        if self._blobs is None:
            if self.config.connection_string is not None:
                self._blobs = BlobServiceClient.from_connection_string(self.config.connection_string, **self._options())
            elif self.config.blob_url is not None:
                self._blobs = BlobServiceClient(self.config.blob_url, credential=self._identity(), **self._options())
            else:
                raise StoreConfigError(f"{CONNECTION}__blobServiceUri: not set")
        return self._blobs

    def _cheap(self) -> Rest | None:
        """The REST path (store_rest.py), or None when these settings allow only the SDK's."""
        if self._sdk_only:
            return None
        if self._rest is None:
            keyed = self.config.connection_string is not None  # an account key (or none at all: a SAS)
            tables = self._table_service() if keyed or self.config.table_url else None
            blobs = self._blob_service() if keyed or self.config.blob_url else None
            table_key = tables.credential if keyed and tables is not None else None
            blob_key = getattr(blobs.credential, "account_key", None) if keyed and blobs is not None else None
            self._rest = Rest(
                table_url=tables.url if tables is not None else None,
                blob_url=blobs.url if blobs is not None else None,
                container=STREAMS_CONTAINER,
                blob_version=blobs.api_version if blobs is not None else "",
                table_key=table_key if isinstance(table_key, AzureNamedKeyCredential) else None,
                blob_key=(str(blobs.account_name), blob_key) if blobs is not None and blob_key else None,
                identity=None if keyed else self._identity(),
                observe=self._observe_headers,
            )
        return self._rest

    def _no_rest(self, exc: NoRestAccess) -> None:
        log.warning("shared state: the store is reached through the SDK only: %s", exc)
        self._sdk_only = True

    async def _by_rest(self, call: Callable[[Rest], Awaitable[T]]) -> T | _Sdk:
        """``call`` on the REST path, or ``SDK`` when the SDK must make it: these settings allow only
        the SDK's (found out here, once: from then on every call goes that way)."""
        if (rest := self._cheap()) is not None:
            try:
                return await call(rest)
            except NoRestAccess as exc:
                self._no_rest(exc)
        return SDK

    def _table(self, name: str) -> TableClient:
        """A table's SDK client (the caller has awaited ``_table_ready``)."""
        return self._table_service().get_table_client(name)

    async def _table_ready(self, name: str) -> None:
        await self._once(f"table:{name}", lambda: self._table_service().create_table(name))

    def _container(self) -> ContainerClient:
        """The container's SDK client (the caller has awaited ``_container_ready``)."""
        return self._blob_service().get_container_client(STREAMS_CONTAINER)

    async def _container_ready(self) -> None:
        await self._once("container", lambda: self._container().create_container())

    async def _once(self, key: str, create) -> None:
        """Create a table or the container once per process; concurrent first users wait for the
        one attempt. A failure is not remembered: the next use tries again."""
        ready = self._ready.get(key)
        if ready is not None and ready.done() and not ready.cancelled() and ready.exception() is None:
            return
        if ready is None:
            ready = self._ready[key] = asyncio.ensure_future(self._create(create))
            ready.add_done_callback(lambda f: f.exception() and self._ready.pop(key, None))
        await asyncio.shield(ready)

    @staticmethod
    async def _create(create) -> None:
        try:
            async with _errors(CALL_TIMEOUT, "create"):
                await create()
        except AlreadyExists:
            pass
        except StoreUnavailable as exc:
            if "HTTP 403" in str(exc):  # may not create: infra/ made it (roles are scoped to it)
                return
            raise

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

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
        self._count("get")
        try:
            async with _mapped(timeout, "get", self.clock):
                await self._table_ready(table)
                if (answer := await self._by_rest(lambda rest: rest.get(table, partition, row, select))) is not SDK:
                    return answer
                client = self._table(table)
                keys = ["PartitionKey", "RowKey"]
                found = await client.get_entity(partition, row, select=[*keys, *select] if select else None)
        except NotFound:
            return None
        return _from_store(found)

    async def insert(self, table: str, entity: Mapping[str, Any], *, timeout: float = CALL_TIMEOUT) -> str:
        values = clean(entity)
        self._count("insert")
        async with _mapped(timeout, "insert", self.clock):
            await self._table_ready(table)
            if (answer := await self._by_rest(lambda rest: rest.insert(table, values))) is not SDK:
                return answer
            client = self._table(table)
            answer = await client.create_entity(_to_store(values), **_ONCE)
        return answer["etag"]

    async def replace(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> str:
        return await self._update(table, entity, etag, UpdateMode.REPLACE, timeout)

    async def merge(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> str:
        return await self._update(table, entity, etag, UpdateMode.MERGE, timeout)

    async def _update(
        self, table: str, entity: Mapping[str, Any], etag: str | None, mode: UpdateMode, timeout: float
    ) -> str:
        values = clean(entity)
        self._count("replace" if mode == UpdateMode.REPLACE else "merge")
        async with _mapped(timeout, "update", self.clock):
            await self._table_ready(table)
            if (
                answer := await self._by_rest(
                    lambda rest: rest.update(table, values, etag, merge=mode == UpdateMode.MERGE)
                )
            ) is not SDK:
                return answer
            client = self._table(table)
            answer = await client.update_entity(_to_store(values), mode=mode, **_sent_once_if(etag))
        return answer["etag"]

    async def upsert(self, table: str, entity: Mapping[str, Any], *, timeout: float = CALL_TIMEOUT) -> str:
        values = clean(entity)
        self._count("upsert")
        async with _mapped(timeout, "upsert", self.clock):
            await self._table_ready(table)
            if (answer := await self._by_rest(lambda rest: rest.upsert(table, values))) is not SDK:
                return answer
            client = self._table(table)
            answer = await client.upsert_entity(_to_store(values), mode=UpdateMode.REPLACE)
        return answer["etag"]

    async def delete(
        self, table: str, partition: str, row: str, *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> None:
        check_key("PartitionKey", partition)
        check_key("RowKey", row)
        self._count("delete")
        async with _mapped(timeout, "delete", self.clock):
            await self._table_ready(table)
            if (answer := await self._by_rest(lambda rest: rest.delete(table, partition, row, etag))) is not SDK:
                return answer  # quiet on a missing row
            client = self._table(table)
            await client.delete_entity(partition, row, **_sent_once_if(etag))  # quiet on a missing row

    async def query(self, table: str, where: Where, *, timeout: float = CALL_TIMEOUT) -> list[Row]:
        query, parameters = _odata(where)
        self._count("query")
        rows: list[Row] = []
        async with _mapped(timeout, "query", self.clock):
            await self._table_ready(table)
            if (
                answer := await self._by_rest(
                    lambda rest: rest.query(table, odata_filter(query, parameters), where.select, where.limit)
                )
            ) is not SDK:
                return answer
            client = self._table(table)
            page = min(1000, where.limit) if where.limit else 1000
            found = client.query_entities(
                query,
                parameters=parameters,
                select=["PartitionKey", "RowKey", *where.select] if where.select is not None else None,
                results_per_page=page,
            )
            async for entity in found:
                rows.append(_from_store(entity))
                if where.limit is not None and len(rows) >= where.limit:
                    break
        return rows

    async def batch(self, table: str, ops: Sequence[Op], *, timeout: float = CALL_TIMEOUT) -> list[str | None]:
        check_batch(ops)
        self._count("batch")
        async with _mapped(timeout, "batch", self.clock):
            await self._table_ready(table)
            cleaned = [op if op.kind == "delete" else _cleaned(op) for op in ops]
            if (answer := await self._by_rest(lambda rest: rest.batch(table, cleaned))) is not SDK:
                return answer
            client = self._table(table)
            answers = await client.submit_transaction(_sdk_operations(ops), **_ONCE)
        return [answer.get("etag") for answer in answers]

    # --- blobs --------------------------------------------------------------------------------

    async def append_create(self, name: str, *, timeout: float = CALL_TIMEOUT) -> None:
        self._count("append_create")
        try:
            async with _mapped(timeout, "append_create", self.clock):
                await self._container_ready()
                if (answer := await self._by_rest(lambda rest: rest.append_create(name))) is not SDK:
                    return answer
                container = self._container()
                # If-None-Match: a create that timed out here and lands late must not empty the blob.
                await container.get_blob_client(name).create_append_blob(
                    match_condition=MatchConditions.IfMissing, **_ONCE
                )
        except Modified:
            raise AlreadyExists("the blob exists") from None

    async def append(self, name: str, data: bytes, *, at: int, timeout: float = CALL_TIMEOUT) -> int:
        self._count("append")
        async with _mapped(timeout, "append", self.clock):
            await self._container_ready()
            if await self._by_rest(lambda rest: rest.append(name, data, at)) is not SDK:
                return at + len(data)  # the append position condition held: the blob is now this long
            container = self._container()
            await container.get_blob_client(name).append_block(data, appendpos_condition=at, **_ONCE)
        return at + len(data)

    async def read(self, name: str, offset: int = 0, *, timeout: float = CALL_TIMEOUT) -> bytes:
        self._count("read")
        try:
            async with _mapped(timeout, "read", self.clock):
                await self._container_ready()
                if (answer := await self._by_rest(lambda rest: rest.read(name, offset))) is not SDK:
                    return answer
                container = self._container()
                download = await container.get_blob_client(name).download_blob(offset=offset)
                return await download.readall()
        except NotFound:  # no blob, or nothing past offset (Azure; Azurite answers empty)
            return b""

    async def size(self, name: str, *, timeout: float = CALL_TIMEOUT) -> int | None:
        self._count("size")
        try:
            async with _mapped(timeout, "size", self.clock):
                await self._container_ready()
                container = self._container()
                return (await container.get_blob_client(name).get_blob_properties()).size
        except NotFound:
            return None

    async def put(self, name: str, data: bytes, *, etag: str | None = None, timeout: float = CALL_TIMEOUT) -> str:
        self._count("put")
        if etag == NEW:
            condition: dict[str, Any] = {"match_condition": MatchConditions.IfMissing, **_ONCE}
            headers = {"If-None-Match": "*"}
        elif etag is not None:
            condition = {"etag": etag, "match_condition": MatchConditions.IfNotModified, **_ONCE}
            headers = {"If-Match": etag}
        else:
            condition = headers = {}
        try:
            async with _mapped(timeout, "put", self.clock):
                await self._container_ready()
                if (answer := await self._by_rest(lambda rest: rest.put(name, data, headers))) is not SDK:
                    return answer  # sent once under a condition
                container = self._container()
                answer = await container.get_blob_client(name).upload_blob(
                    data, blob_type=BlobType.BLOCKBLOB, overwrite=True, **condition
                )
        except (AlreadyExists, NotFound):
            raise Modified("the blob changed") from None
        return answer["etag"]

    async def get_blob(self, name: str, *, timeout: float = CALL_TIMEOUT) -> tuple[bytes, str] | None:
        self._count("get_blob")
        try:
            async with _mapped(timeout, "get_blob", self.clock):
                await self._container_ready()
                if (answer := await self._by_rest(lambda rest: rest.get_blob(name))) is not SDK:
                    return answer
                container = self._container()
                download = await container.get_blob_client(name).download_blob()
                data = await download.readall()
        except NotFound:
            return None
        return data, download.properties.etag

    async def delete_blob(self, name: str, *, timeout: float = CALL_TIMEOUT) -> None:
        self._count("delete_blob")
        with contextlib.suppress(NotFound):
            async with _mapped(timeout, "delete_blob", self.clock):
                await self._container_ready()
                await self._container().delete_blob(name)

    async def close(self) -> None:
        if self._rest is not None:
            await self._rest.close()
            self._rest = None
        for client in (self._tables, self._blobs, self._credential):
            if client is not None:
                await client.close()
        self._tables = self._blobs = self._credential = None
        self._ready.clear()
