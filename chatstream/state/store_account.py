"""Where the store is and what signs its requests (``Account``), as the Functions host itself reads
the settings (``from_env``). Nothing is signed by hand: the azure SDKs read the connection string and
make the SAS or the identity's token; store_azure.py sends every request itself.

- ``AzureWebJobsStorage``: a connection string (Azurite's, ``UseDevelopmentStorage=true``, or an
  account key's or a SAS's). An account key signs with an account SAS made from it (azure-storage-blob's
  generate_account_sas) for both services, at every level of them (a table's own SAS is refused on
  the account's ``$batch``, and a query of rows wants the container level on Azurite), made again
  when a quarter of its life is left; a SAS as it is.
- identity-based: ``AzureWebJobsStorage__tableServiceUri`` / ``__blobServiceUri`` (or
  ``__accountName``, from which both are made), with ``__credential=managedidentity`` and
  ``__clientId`` for a user-assigned identity (what infra/ deploys); without ``__credential``,
  azure-identity's DefaultAzureCredential (a developer's ``az login``). Its OAuth token signs (no
  token: StoreUnavailable, whatever azure-identity raised as its ``__cause__``), made again 5 minutes
  before it expires; the storage SDKs never load.

What signs is kept until it is to be made again or the service refused it (``refused``). Settings it
cannot use raise SettingsError (naming the setting, never a value), before any call."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..errors import StoreUnavailable
from ..settings import SettingsError
from .store import STREAMS_CONTAINER

if TYPE_CHECKING:
    from azure.core.credentials import AzureNamedKeyCredential

# azure-core logs every request of its pipeline (azure-identity's, for a token) at INFO: noise.
logging.getLogger("azure.core.pipeline.policies.http_logging_policy").setLevel(logging.WARNING)

SAS_LIFETIME = timedelta(hours=2)
RENEW_BEFORE = timedelta(minutes=30)  # and a start 5 minutes back: other clocks may be behind
CONNECTION = "AzureWebJobsStorage"  # the setting, and the prefix of the identity-based ones
UNUSABLE = f"invalid app settings: {CONNECTION}"  # what a SettingsError of the storage's says first
TOKEN_SCOPE = "https://storage.azure.com/.default"  # Blob and Table alike (x-ms-version 2019-02-02 on)


class Account:
    """The storage account the settings name (module docstring)."""

    def __init__(
        self,
        connection_string: str | None = None,
        *,
        table_url: str | None = None,
        blob_url: str | None = None,
        credential: Any = None,  # azure-identity's; None: DefaultAzureCredential (without a connection string)
    ):
        self.credential = credential
        self._key: AzureNamedKeyCredential | None = None
        self._token = ""  # what signs: a SAS (the connection string's, or made from its key) or a token
        self._renew = 0.0  # when to make it again (seconds since 1970; a SAS as it is: never)
        self._lock = asyncio.Lock()
        if connection_string is None:
            if credential is None:
                from azure.identity.aio import DefaultAzureCredential

                self.credential = DefaultAzureCredential()
        else:
            # The SDKs' clients read the connection string (they make no request): its one key or
            # SAS (the table client's credential; it refuses a string with neither) serves both
            # services, at each one's URL.
            from azure.core.credentials import AzureNamedKeyCredential
            from azure.data.tables import TableServiceClient
            from azure.storage.blob import BlobServiceClient

            try:
                table_client = TableServiceClient.from_connection_string(connection_string)
                blob_client = BlobServiceClient.from_connection_string(connection_string)
            except ValueError:  # its message is the SDK's; ours names the setting, never a value
                raise SettingsError(
                    f"{UNUSABLE}: the connection string has no AccountKey or a SharedAccessSignature, names "
                    "no account or endpoint for the tables and the blobs, or is malformed"
                ) from None
            key = table_client.credential
            if isinstance(key, AzureNamedKeyCredential):
                self._key = key
            elif key is not None:
                self._token, self._renew = key.signature, math.inf
            table_url, blob_url = table_client.url, urlsplit(blob_client.url)._replace(query="").geturl()
        self.table_url, self.blob_url = (table_url or "").rstrip("/"), (blob_url or "").rstrip("/")

    async def sign(self, url: str, headers: Mapping[str, str]) -> tuple[str, Mapping[str, str]]:
        """A request's URL and headers, signed."""
        if time.time() >= self._renew:
            async with self._lock:
                if time.time() >= self._renew:
                    self._token, self._renew = await self._make()
        if self.credential is None:
            return f"{url}{'&' if '?' in url else '?'}{self._token}", headers
        # x-ms-date: the services want one on every request not signed by a SAS.
        date = email.utils.formatdate(usegmt=True)
        return url, {**headers, "Authorization": f"Bearer {self._token}", "x-ms-date": date}

    def refused(self) -> None:
        """The service refused what signed (401, 403): a new one next time."""
        self._renew = 0.0

    async def _make(self) -> tuple[str, float]:
        if self.credential is not None:
            try:
                token = await self.credential.get_token(TOKEN_SCOPE)
            except Exception as exc:  # whatever azure-identity raises: no token
                raise StoreUnavailable(f"no token for the store ({type(exc).__name__})") from exc
            return token.token, token.expires_on - 300.0
        if self._key is None:
            return self._token, math.inf
        # Imported here: only an account key needs it (azure-storage-blob brings requests and
        # cryptography: ~15 MB resident that an identity's instance never loads).
        from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

        rights = AccountSasPermissions(read=True, write=True, delete=True, add=True, create=True, update=True)
        now = datetime.now(UTC)
        start, expiry = now - timedelta(minutes=5), now + SAS_LIFETIME
        resources = ResourceTypes(container=True, object=True)
        sas = generate_account_sas(*self._key.named_key, resources, rights, expiry, start, services="bt")
        return sas, (expiry - RENEW_BEFORE).timestamp()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Account | None:
        """The account the settings name; None when none is set."""

        def get(suffix: str = "") -> str | None:
            return (environ.get(CONNECTION + suffix) or "").strip() or None

        if get():
            return cls(get())
        account = get("__accountName")
        table = get("__tableServiceUri") or (f"https://{account}.table.core.windows.net" if account else None)
        blob = get("__blobServiceUri") or (f"https://{account}.blob.core.windows.net" if account else None)
        if table is None and blob is None:
            return None
        for name, url in (("__tableServiceUri", table), ("__blobServiceUri", blob)):
            if url is not None and not url.startswith("https://"):
                raise SettingsError(f"{UNUSABLE}{name}: must be an https:// URL")
        if table is None or blob is None:  # the app keeps its state in both
            raise SettingsError(f"{UNUSABLE}__{'table' if table is None else 'blob'}ServiceUri: not set")
        credential = None
        if (get("__credential") or "").lower() == "managedidentity":
            from azure.identity.aio import ManagedIdentityCredential

            credential = ManagedIdentityCredential(client_id=get("__clientId"))
        return cls(table_url=table, blob_url=blob, credential=credential)

    def url(self, table: str | None, path: str) -> str:
        """``path`` in the table service, or in the container when ``table`` is None."""
        if table is None:
            return f"{self.blob_url}/{STREAMS_CONTAINER}/{path}"
        return f"{self.table_url}/{path}"

    def describe(self) -> str:
        """Where the store is, for a log line (a URL without a key or a SAS)."""
        return f"{self.table_url} (identity-based)" if self.credential is not None else self.table_url

    async def close(self) -> None:
        if self.credential is not None:
            await self.credential.close()
            self.credential = None
