"""(Being replaced by store.py and its backends; kept while the state layer moves over.) The storage every
instance of the app shares: the Function App's own storage account (``AzureWebJobsStorage``), its tables
and one blob container. Locally that is Azurite (tools/azurite/), started by ``make serve`` and ``make test``.

How the account is reached, as the Functions host itself reads the same settings:

- ``AzureWebJobsStorage``: a connection string (Azurite's, ``UseDevelopmentStorage=true``, or an
  account key's); or
- identity-based: ``AzureWebJobsStorage__tableServiceUri`` / ``__blobServiceUri`` (or
  ``__accountName``, from which both are made), with ``__credential=managedidentity`` and
  ``__clientId`` for a user-assigned identity (what infra/ deploys); without ``__credential``,
  azure-identity's DefaultAzureCredential (a developer's ``az login``).

Every call the request path makes here is bounded (``CALL_TIMEOUT``) and retried at most once, so
that a slow or absent store fails a request within two seconds instead of holding it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
from azure.core.exceptions import AzureError, HttpResponseError, ResourceExistsError
from azure.data.tables.aio import TableClient, TableServiceClient
from azure.storage.blob import ContainerSasPermissions, generate_container_sas
from azure.storage.blob.aio import BlobServiceClient, ContainerClient

# The tables and the container the app keeps its state in (infra/ creates them and scopes the app
# identity's roles to them; on Azurite the app creates them).
CALLERS_TABLE = "chatstreamCallers"
LIMITS_TABLE = "chatstreamLimits"
USAGE_TABLE = "chatstreamUsage"
RESPONSES_TABLE = "chatstreamResponses"
STREAMS_TABLE = "chatstreamStreams"
STREAMS_CONTAINER = "chatstream-streams"

CONNECTION = "AzureWebJobsStorage"
# A request waits this long at most for one store call (one retry included), then fails closed.
CALL_TIMEOUT = 1.8
_CLIENT_OPTIONS: dict[str, Any] = {
    "retry_total": 1,
    "retry_backoff_factor": 0.1,
    "connection_timeout": 1.5,
    "read_timeout": 1.5,
    # No proxy settings read from the environment on every call (a quarter of the SDK's CPU per call
    # here); a Function App reaches its storage account directly.
    "use_env_settings": False,
}


class StoreUnavailable(Exception):
    """The store did not answer in time, or answered with a server error or an authorization
    failure: whatever needed it fails closed. The message never carries a secret."""


class NoSasAccess(StoreUnavailable):
    """A SAS cannot be made with this identity (no role at the account that allows a user delegation
    key): the cheap read path is not available, the SDK's is."""


class StoreConfigError(Exception):
    """The storage settings cannot be used (the message names the setting, never a value)."""


@dataclass(frozen=True)
class StorageConfig:
    connection_string: str | None = None
    table_url: str | None = None
    blob_url: str | None = None
    credential: str | None = None  # ``managedidentity``, or None for DefaultAzureCredential
    client_id: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> StorageConfig | None:
        """The storage the settings name; None when none is set."""

        def get(suffix: str = "") -> str | None:
            return (environ.get(CONNECTION + suffix) or "").strip() or None

        if get():
            return cls(connection_string=get())
        account = get("__accountName")
        table = get("__tableServiceUri") or (f"https://{account}.table.core.windows.net" if account else None)
        blob = get("__blobServiceUri") or (f"https://{account}.blob.core.windows.net" if account else None)
        if table is None and blob is None:
            return None
        for name, url in (("__tableServiceUri", table), ("__blobServiceUri", blob)):
            if url is not None and not url.startswith("https://"):
                raise StoreConfigError(f"{CONNECTION}{name}: must be an https:// URL")
        return cls(table_url=table, blob_url=blob, credential=get("__credential"), client_id=get("__clientId"))

    def describe(self) -> str:
        """Where the store is, for a log line (never a key)."""
        if self.connection_string is not None:
            fields = dict(p.split("=", 1) for p in self.connection_string.split(";") if "=" in p)
            if fields.get("UseDevelopmentStorage", "").lower() == "true":
                return "the storage emulator on its default ports"
            return fields.get("TableEndpoint") or f"account {fields.get('AccountName', '?')}"
        return f"{self.table_url or self.blob_url} (identity-based)"


class Store:
    """Clients for the app's tables and container, made on first use; a table (or the container)
    is created the first time it is used when it does not exist yet and the identity may create it."""

    def __init__(self, config: StorageConfig):
        self.config = config
        self._credential = None
        self._tables: TableServiceClient | None = None
        self._blobs: BlobServiceClient | None = None
        self._ready: dict[str, asyncio.Future] = {}
        self._reads: BlobReads | None = None

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
                    self.config.connection_string, **_CLIENT_OPTIONS
                )
            elif self.config.table_url is not None:
                self._tables = TableServiceClient(self.config.table_url, credential=self._identity(), **_CLIENT_OPTIONS)
            else:
                raise StoreConfigError(f"{CONNECTION}__tableServiceUri: not set")
        return self._tables

    def _blob_service(self) -> BlobServiceClient:
        if self._blobs is None:
            if self.config.connection_string is not None:
                self._blobs = BlobServiceClient.from_connection_string(self.config.connection_string, **_CLIENT_OPTIONS)
            elif self.config.blob_url is not None:
                self._blobs = BlobServiceClient(self.config.blob_url, credential=self._identity(), **_CLIENT_OPTIONS)
            else:
                raise StoreConfigError(f"{CONNECTION}__blobServiceUri: not set")
        return self._blobs

    async def table(self, name: str) -> TableClient:
        """The client of table ``name``, created in the account if missing."""
        client = self._table_service().get_table_client(name)
        await self._once(f"table:{name}", lambda: self._table_service().create_table(name))
        return client

    async def container(self, name: str = STREAMS_CONTAINER) -> ContainerClient:
        client = self._blob_service().get_container_client(name)
        await self._once(f"container:{name}", client.create_container)
        return client

    async def blob_reads(self, name: str = STREAMS_CONTAINER) -> BlobReads:
        """The cheap reader of the container's blobs (``BlobReads``), made once."""
        container = await self.container(name)
        if self._reads is None:
            self._reads = BlobReads(self._blob_service(), container, CALL_TIMEOUT)
        return self._reads

    async def _once(self, key: str, create) -> None:
        """Create a table or container once per process; concurrent first users wait for the one
        attempt. A failure is not remembered: the next use tries again."""
        ready = self._ready.get(key)
        if ready is None:
            ready = self._ready[key] = asyncio.ensure_future(_create(create))
            ready.add_done_callback(lambda f: f.exception() and self._ready.pop(key, None))
        await asyncio.shield(ready)

    async def close(self) -> None:
        if self._reads is not None:
            await self._reads.close()
            self._reads = None
        for client in (self._tables, self._blobs, self._credential):
            if client is not None:
                await client.close()
        self._tables = self._blobs = self._credential = None
        self._ready.clear()


async def _create(create) -> None:
    try:
        async with asyncio.timeout(CALL_TIMEOUT):
            await create()
    except ResourceExistsError:
        pass
    except HttpResponseError as exc:
        if exc.status_code == 403:  # may not create: infra/ made it (roles are scoped to it)
            return
        raise StoreUnavailable(f"the store refused to create a table or container (HTTP {exc.status_code})") from None
    except (AzureError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(f"the store did not answer ({type(exc).__name__})") from None


def store_from_env(environ: Mapping[str, str]) -> Store | None:
    config = StorageConfig.from_env(environ)
    return Store(config) if config is not None else None


# -- reading a growing blob cheaply ------------------------------------------------------------
#
# Reading a growing blob from an offset, cheaply: a reader of a resumable stream produced on another
# instance polls the stream's blob 10 to 30 times a second. Through the Azure SDK one such read costs
# about 2.3 ms of CPU (its pipeline of policies and header models); a plain aiohttp GET with a SAS
# costs about 0.6 ms (figures in docs/resumable.md), so a worker follows four times as many streams.
#
# The SAS is made by the SDK's own helper, never by hand: read-only, for the one container, from the
# account key of a connection string, or from a user delegation key when the app signs in with its
# identity (the Storage Blob Data roles infra/ grants allow asking for one). It is renewed well before
# it expires. Everything else (writes, tables) stays on the SDK.

SAS_LIFETIME = timedelta(hours=2)
RENEW_BEFORE = timedelta(minutes=30)  # and a start 5 minutes back: other clocks may be behind


class BlobReads:
    """``await reads.read(name, offset)``: the bytes of blob ``name`` from ``offset`` (b"" when it
    has none there, or does not exist yet). StoreUnavailable on anything else, or after ``timeout``."""

    def __init__(self, service: BlobServiceClient, container: ContainerClient, timeout: float):
        self._service = service
        self._container = container
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._sas: str | None = None
        self._renew_at = datetime.min.replace(tzinfo=UTC)
        self._renewing: asyncio.Lock | None = None

    async def read(self, name: str, offset: int) -> bytes:
        sas = await self._current_sas()
        url = f"{self._container.url}/{name}?{sas}"
        headers = {"x-ms-range": f"bytes={offset}-", "x-ms-version": self._service.api_version}
        try:
            async with self._open().get(url, headers=headers) as response:
                if response.status in (200, 206):
                    return await response.read()
                if response.status in (404, 416):  # not there yet; nothing past offset
                    return b""
                if response.status == 403:
                    self._renew_at = datetime.min.replace(tzinfo=UTC)  # a SAS refused: make a new one
                raise StoreUnavailable(f"the store failed (HTTP {response.status})")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise StoreUnavailable(f"the store did not answer ({type(exc).__name__})") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection cap (aiohttp's default of 100 would queue reads behind each other) and
            # no proxy settings read per request (trust_env off), as the SDK's use_env_settings.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(total=self._timeout),
            )
        return self._session

    async def _current_sas(self) -> str:
        if self._sas is not None and datetime.now(UTC) < self._renew_at:
            return self._sas
        if self._renewing is None:
            self._renewing = asyncio.Lock()
        async with self._renewing:
            now = datetime.now(UTC)
            if self._sas is None or now >= self._renew_at:
                self._sas = await self._make_sas(now)
                self._renew_at = now + SAS_LIFETIME - RENEW_BEFORE
        return self._sas

    async def _make_sas(self, now: datetime) -> str:
        start, expiry = now - timedelta(minutes=5), now + SAS_LIFETIME
        permission = ContainerSasPermissions(read=True)
        account, container = self._container.account_name, self._container.container_name
        assert account is not None
        key = getattr(self._service.credential, "account_key", None)
        try:
            if key is not None:
                return generate_container_sas(
                    account, container, account_key=key, permission=permission, start=start, expiry=expiry
                )
            delegation = await asyncio.wait_for(self._service.get_user_delegation_key(start, expiry), self._timeout)
            return generate_container_sas(
                account, container, user_delegation_key=delegation, permission=permission, start=start, expiry=expiry
            )
        except StoreUnavailable:
            raise
        except HttpResponseError as exc:
            if exc.status_code == 403:  # the identity may not ask for a user delegation key
                raise NoSasAccess("no user delegation key for the stream container (HTTP 403)") from None
            raise StoreUnavailable(f"no read access to the stream container (HTTP {exc.status_code})") from None
        except Exception as exc:  # noqa: BLE001 - any failure to get a key: the store is unavailable to us
            raise StoreUnavailable(f"no read access to the stream container ({type(exc).__name__})") from None
