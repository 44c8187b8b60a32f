"""What the azure SDKs do for the store (store_azure.py sends every data call itself): read the
settings' account (``Account``), sign each request, and create a table or the container when a call
finds it missing.

Nothing is signed by hand: with an account key (a connection string; Azurite) requests carry SAS
tokens made by the SDKs' own helpers (``generate_table_sas``, ``generate_container_sas``; for a
batch, which is the account's ``$batch``, ``generate_account_sas`` for rows only), renewed well
before they expire; with a SAS in the connection string, that SAS as it is; with an identity, an
OAuth token of azure-identity's credential (``get_token``, kept until near its expiry), which
raises ``NoToken`` when it gives none. The SDKs' async clients load only to create (an instance
whose tables and container are there never loads them), and with an identity the SDKs themselves
too (with a key, the SAS helpers need them)."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential

from .store import CONNECTION, STREAMS_CONTAINER, StorageConfig, StoreConfigError

# azure-core logs every storage request and response at INFO: noise.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)

SAS_LIFETIME = timedelta(hours=2)
RENEW_BEFORE = timedelta(minutes=30)  # and a start 5 minutes back: other clocks may be behind
TOKEN_SCOPE = "https://storage.azure.com/.default"  # Blob and Table alike (x-ms-version 2019-02-02 on)
# The SDK clients (creating a table or the container): one quick retry; no proxy settings read from
# the environment on every call (a Function App reaches its storage account directly).
_CLIENT_OPTIONS: dict[str, Any] = {
    "retry_total": 1,
    "retry_backoff_factor": 0.1,
    "connection_timeout": 1.5,
    "read_timeout": 1.5,
    "use_env_settings": False,
}
_NO_HEADERS: Mapping[str, str] = {}


class NoToken(Exception):
    """The identity gave no token (azure-identity's failure, whatever it raised: its ``__cause__``)."""


class Bearer:
    """An OAuth token of the app's identity, kept until 5 minutes before it expires."""

    def __init__(self, credential: Any):
        self._credential = credential
        self._token: str | None = None
        self._expires = 0.0
        self._lock = asyncio.Lock()

    async def sign(self, name: str) -> tuple[str, Mapping[str, str]]:
        """What signs a request (for any ``name``): no query, its headers."""
        if self._token is None or time.time() >= self._expires - 300:
            async with self._lock:
                if self._token is None or time.time() >= self._expires - 300:
                    try:
                        token = await self._credential.get_token(TOKEN_SCOPE)
                    except Exception as exc:  # whatever azure-identity raises: no token
                        raise NoToken(type(exc).__name__) from exc
                    self._token, self._expires = token.token, float(token.expires_on)
        # x-ms-date: the services want one on every request not signed by a SAS.
        return "", {"Authorization": f"Bearer {self._token}", "x-ms-date": email.utils.formatdate(usegmt=True)}

    def refused(self, name: str) -> None:
        """The service refused the token (401, 403): ask for a new one next time."""
        self._token = None


class Sas:
    """SAS tokens by name (a table's, the container's), made by ``make`` (an SDK helper) and
    renewed when a quarter of their life is left, or after the service refused one."""

    def __init__(self, make: Callable[[str, datetime, datetime], str]):
        self._make = make
        self._tokens: dict[str, tuple[str, datetime]] = {}

    @classmethod
    def given(cls, sas: str) -> Sas:
        """The SAS of the settings, for every name."""
        return cls(lambda name, start, expiry: sas)

    async def sign(self, name: str) -> tuple[str, Mapping[str, str]]:
        """What signs a request for ``name``: its query, no headers."""
        now = datetime.now(UTC)
        found = self._tokens.get(name)
        if found is not None and now < found[1]:
            return found[0], _NO_HEADERS
        sas = self._make(name, now - timedelta(minutes=5), now + SAS_LIFETIME)
        self._tokens[name] = (sas, now + SAS_LIFETIME - RENEW_BEFORE)
        return sas, _NO_HEADERS

    def refused(self, name: str) -> None:
        self._tokens.pop(name, None)


Signer = Bearer | Sas


def _table_sas(key: AzureNamedKeyCredential) -> tuple[Sas, Sas]:
    """A table's SAS and the account's for ``$batch`` (a table's is refused there: Azurite)."""
    # Imported here: only an account key needs them (azure-data-tables, and azure-storage-blob below,
    # which brings requests and cryptography: ~15 MB resident that an identity's instance never loads).
    from azure.data.tables import (
        AccountSasPermissions,
        ResourceTypes,
        TableSasPermissions,
        generate_account_sas,
        generate_table_sas,
    )

    def table(name: str, start: datetime, expiry: datetime) -> str:
        permission = TableSasPermissions(read=True, add=True, update=True, delete=True)
        return generate_table_sas(key, name, permission=permission, start=start, expiry=expiry)

    def batch(name: str, start: datetime, expiry: datetime) -> str:
        permission = AccountSasPermissions(read=True, add=True, update=True, delete=True)
        return generate_account_sas(key, ResourceTypes(object=True), permission, start=start, expiry=expiry)

    return Sas(table), Sas(batch)


def _blob_sas(account: str, account_key: str) -> Sas:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    def container(name: str, start: datetime, expiry: datetime) -> str:
        permission = ContainerSasPermissions(read=True, add=True, create=True, write=True, delete=True)
        return generate_container_sas(
            account, name, account_key=account_key, permission=permission, start=start, expiry=expiry
        )

    return Sas(container)


class Account:
    """The storage account the settings name: each service's URL and what signs its requests, as the
    settings allow: with a connection string, its account key or its SAS (as the SDK reads the
    string); otherwise the app's identity. ``observe`` sees the headers of the SDK's answers (the
    store's clock)."""

    def __init__(self, config: StorageConfig, observe: Callable[[Mapping[str, str]], None]):
        self.config = config
        self._observe = observe
        self._clients: dict[str, Any] = {}  # the SDKs' async clients, by service ("table", "blob")
        self._credential: Any = None
        tables: Signer | None
        blobs: Signer | None
        if config.connection_string is None:
            from azure.identity.aio import DefaultAzureCredential, ManagedIdentityCredential

            if (config.credential or "").lower() == "managedidentity":
                self._credential = ManagedIdentityCredential(client_id=config.client_id)
            else:
                self._credential = DefaultAzureCredential()
            table_url, blob_url = config.table_url, config.blob_url
            tables = batch = blobs = Bearer(self._credential)
        else:
            # The SDKs' sync clients read the connection string as their async ones would (the async
            # modules load only to create: module docstring); they make no request.
            from azure.data.tables import TableServiceClient
            from azure.storage.blob import BlobServiceClient

            try:
                table_client = TableServiceClient.from_connection_string(config.connection_string)
            except ValueError:  # its message is the SDK's; ours names the setting, never a value
                raise StoreConfigError(
                    f"{CONNECTION}: the connection string has no AccountKey or a SharedAccessSignature for the "
                    "tables, or is malformed"
                ) from None
            blob_client = BlobServiceClient.from_connection_string(config.connection_string)
            table_key, blob_key = table_client.credential, getattr(blob_client.credential, "account_key", None)
            parts = urlsplit(blob_client.url)
            table_url, blob_url = table_client.url, parts._replace(query="").geturl()
            tables = batch = Sas.given(table_key.signature) if isinstance(table_key, AzureSasCredential) else None
            if isinstance(table_key, AzureNamedKeyCredential):
                tables, batch = _table_sas(table_key)
            blobs = _blob_sas(str(blob_client.account_name), blob_key) if blob_key else None
            blobs = blobs or (Sas.given(parts.query) if parts.query else None)
        self.table_url, self.blob_url = (table_url or "").rstrip("/"), (blob_url or "").rstrip("/")
        for url, signer, service in ((self.table_url, tables, "tables"), (self.blob_url, blobs, "blobs")):
            if url and signer is None:
                setting = f"an AccountKey or a SharedAccessSignature for the {service}"
                raise StoreConfigError(f"{CONNECTION}: the connection string has no {setting}")
        self._tables, self._batch, self._blobs = tables, batch, blobs

    def target(self, table: str | None, path: str) -> tuple[Signer, str, str]:
        """Where a request goes and what signs it: ``path`` in the table service (``$batch``: the
        account's, signed for rows only), or in the container when ``table`` is None; the signer,
        the name it signs for, the URL."""
        if table is None:
            if not self.blob_url or self._blobs is None:
                raise StoreConfigError(f"{CONNECTION}__blobServiceUri: not set")
            return self._blobs, STREAMS_CONTAINER, f"{self.blob_url}/{STREAMS_CONTAINER}/{path}"
        if not self.table_url or self._tables is None or self._batch is None:
            raise StoreConfigError(f"{CONNECTION}__tableServiceUri: not set")
        if path == "$batch":
            return self._batch, path, f"{self.table_url}/$batch"
        return self._tables, table, f"{self.table_url}/{path}"

    async def create(self, table: str | None) -> None:
        """Create ``table``, or the container when None, with the SDK's client: one there (409) is
        made, and one this identity may not create (403) is infra/'s to make."""
        from azure.core.exceptions import HttpResponseError

        try:
            if table is None:
                await self._client("blob").get_container_client(STREAMS_CONTAINER).create_container()
            else:
                await self._client("table").create_table(table)
        except HttpResponseError as exc:
            if exc.status_code not in (403, 409):
                raise

    def _client(self, service: str) -> Any:
        client = self._clients.get(service)
        if client is None:
            Client: Any  # each SDK's async client loads only when that service needs one made
            if service == "table":
                from azure.data.tables.aio import TableServiceClient as Client
            else:
                from azure.storage.blob.aio import BlobServiceClient as Client
            url = self.config.table_url if service == "table" else self.config.blob_url
            hook = {"raw_response_hook": lambda response: self._observe(response.http_response.headers)}
            if self.config.connection_string is not None:
                client = Client.from_connection_string(self.config.connection_string, **_CLIENT_OPTIONS, **hook)
            elif url is not None:
                client = Client(url, credential=self._credential, **_CLIENT_OPTIONS, **hook)
            else:
                raise StoreConfigError(f"{CONNECTION}__{service}ServiceUri: not set")
            self._clients[service] = client
        return client

    async def close(self) -> None:
        for client in (*self._clients.values(), self._credential):
            if client is not None:
                await client.close()
        self._clients.clear()
        self._credential = None
