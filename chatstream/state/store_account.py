"""What the azure SDKs do for the store (store_azure.py sends every request itself, the creation of
a table or the container included): read the settings' account (``Account``) and sign each request.

Nothing is signed by hand: with an account key (a connection string; Azurite) requests carry an
account SAS for rows (or blobs) only, made by the SDKs' own ``generate_account_sas`` and renewed well
before it expires; with a SAS in the connection string, that SAS as it is; with an identity, an
OAuth token of azure-identity's credential (``get_token``, kept until near its expiry), which
raises ``NoToken`` when it gives none. With an identity the storage SDKs never load (with a key,
their SAS helpers and connection-string readers do)."""

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

# azure-core logs every request of its pipeline (azure-identity's, for a token) at INFO: noise.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)

SAS_LIFETIME = timedelta(hours=2)
RENEW_BEFORE = timedelta(minutes=30)  # and a start 5 minutes back: other clocks may be behind
TOKEN_SCOPE = "https://storage.azure.com/.default"  # Blob and Table alike (x-ms-version 2019-02-02 on)


class NoToken(Exception):
    """The identity gave no token (azure-identity's failure, whatever it raised: its ``__cause__``)."""


class Bearer:
    """An OAuth token of the app's identity, kept until 5 minutes before it expires."""

    def __init__(self, credential: Any):
        self._credential = credential
        self._token: str | None = None
        self._expires = 0.0
        self._lock = asyncio.Lock()

    async def sign(self) -> tuple[str, Mapping[str, str]]:
        """What signs a request: no query, its headers."""
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

    def refused(self) -> None:
        """The service refused the token (401, 403): ask for a new one next time."""
        self._token = None


class Sas:
    """A SAS token made by ``make`` (an SDK helper, from the account key: ``start``, ``expiry``; or
    the connection string's own SAS) and renewed when a quarter of its life is left, or after the
    service refused it."""

    def __init__(self, make: Callable[[datetime, datetime], str]):
        self._make = make
        self._token: tuple[str, datetime] | None = None  # and when to renew it

    async def sign(self) -> tuple[str, Mapping[str, str]]:
        """What signs a request: its query, no headers."""
        now = datetime.now(UTC)
        if self._token is None or now >= self._token[1]:
            sas = self._make(now - timedelta(minutes=5), now + SAS_LIFETIME)
            self._token = (sas, now + SAS_LIFETIME - RENEW_BEFORE)
        return self._token[0], {}

    def refused(self) -> None:
        self._token = None


Signer = Bearer | Sas


def _table_sas(key: AzureNamedKeyCredential) -> Sas:
    """The account SAS for rows, one for every table and the account's ``$batch`` (where a table's own
    SAS is refused: Azurite); container-level too, which a query of a table's rows wants on Azurite,
    and creating a table."""
    # Imported here: only an account key needs them (azure-data-tables, and azure-storage-blob below,
    # which brings requests and cryptography: ~15 MB resident that an identity's instance never loads).
    from azure.data.tables import AccountSasPermissions, ResourceTypes, generate_account_sas

    rows = AccountSasPermissions(read=True, add=True, create=True, update=True, delete=True)
    return Sas(
        lambda start, expiry: generate_account_sas(
            key, ResourceTypes(container=True, object=True), rows, expiry, start=start
        )
    )


def _blob_sas(account: str, key: str) -> Sas:
    """The account SAS for blobs, and for creating the container."""
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    blobs = AccountSasPermissions(read=True, add=True, create=True, write=True, delete=True)
    return Sas(
        lambda start, expiry: generate_account_sas(
            account, key, ResourceTypes(container=True, object=True), blobs, expiry, start
        )
    )


class Account:
    """The storage account the settings name: each service's URL and what signs its requests."""

    def __init__(self, config: StorageConfig):
        self._credential: Any = None
        tables: Signer
        blobs: Signer
        if config.connection_string is None:
            from azure.identity.aio import DefaultAzureCredential, ManagedIdentityCredential

            if (config.credential or "").lower() == "managedidentity":
                self._credential = ManagedIdentityCredential(client_id=config.client_id)
            else:
                self._credential = DefaultAzureCredential()
            table_url, blob_url = config.table_url, config.blob_url
            tables = blobs = Bearer(self._credential)
        else:
            # The SDKs' clients read the connection string (they make no request): its one key or
            # SAS (the table client's credential) serves both services, at each one's URL.
            from azure.data.tables import TableServiceClient
            from azure.storage.blob import BlobServiceClient

            try:
                table_client = TableServiceClient.from_connection_string(config.connection_string)
                blob_client = BlobServiceClient.from_connection_string(config.connection_string)
            except ValueError:  # its message is the SDK's; ours names the setting, never a value
                raise StoreConfigError(
                    f"{CONNECTION}: the connection string has no AccountKey or a SharedAccessSignature, names "
                    "no account or endpoint for the tables and the blobs, or is malformed"
                ) from None
            key = table_client.credential
            if isinstance(key, AzureNamedKeyCredential):
                tables, blobs = _table_sas(key), _blob_sas(key.named_key.name, key.named_key.key)
            elif isinstance(key, AzureSasCredential):
                signature = key.signature
                tables = blobs = Sas(lambda start, expiry: signature)
            else:
                raise StoreConfigError(
                    f"{CONNECTION}: the connection string has no AccountKey or a SharedAccessSignature"
                )
            table_url, blob_url = table_client.url, urlsplit(blob_client.url)._replace(query="").geturl()
        self.table_url, self.blob_url = (table_url or "").rstrip("/"), (blob_url or "").rstrip("/")
        self._tables, self._blobs = tables, blobs

    def target(self, table: str | None, path: str) -> tuple[Signer, str]:
        """What signs a request and its URL: ``path`` in the table service, or in the container when
        ``table`` is None."""
        if table is None:
            if not self.blob_url:
                raise StoreConfigError(f"{CONNECTION}__blobServiceUri: not set")
            return self._blobs, f"{self.blob_url}/{STREAMS_CONTAINER}/{path}"
        if not self.table_url:
            raise StoreConfigError(f"{CONNECTION}__tableServiceUri: not set")
        return self._tables, f"{self.table_url}/{path}"

    def describe(self) -> str:
        """Where the store is, for a log line (a URL without a key or a SAS)."""
        where = self.table_url or self.blob_url
        return f"{where} (identity-based)" if self._credential is not None else where

    async def close(self) -> None:
        if self._credential is not None:
            await self._credential.close()
            self._credential = None
