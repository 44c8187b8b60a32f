"""The store's hot calls as plain REST requests (aiohttp), beside the SDK's clients (store_azure.py).

A call through the azure SDKs costs 0.8 to 1.9 ms of CPU here (azure-core's pipeline of policies
and header models), a query 1.1 to 1.3 ms, a batch of one 1.8 to 2.3 ms, of ten 4.4 to 5.1 ms; the
same request through one aiohttp session 0.22 to 0.39 ms, a query 0.3 ms, a batch of one 0.45 to
0.55 ms, of ten 0.85 ms (tools/bench/store_calls.py on Azurite, 300 calls of each).
So the calls every request makes go this way: a row's get, insert, replace, merge, upsert and
delete, a query (a producing instance reads its inbox up to 10 times a second), a batch, an
append blob's create, appends and reads from an offset, a whole blob's put and get. A blob's size
and delete, and creating a table or the container stay on the SDK.

Nothing is signed by hand. With an account key (a connection string; Azurite) requests carry SAS
tokens made by the SDKs' own helpers (``generate_table_sas``, ``generate_container_sas``; for a
batch, which is the account's ``$batch``, ``generate_account_sas`` for rows only), renewed well
before they expire; with an identity, an OAuth token of the same credential the SDK clients
use (``get_token``, kept until near its expiry). When neither is possible (a connection string
without a key) ``NoRestAccess`` says so before anything is sent, and the store uses the SDK.

Rows go as the SDK writes them (store_azure's ``_to_store``): every int an ``Edm.Int64`` (a string
with its ``@odata.type``), a float an ``Edm.Double``, bools and strings as JSON; they come back as
the SDK reads them (``row_of``), so a row written one way reads the same the other way
(tests/test_store_rest.py). What the service answers is mapped here, once, into the store's errors;
what aiohttp raises, by store_azure's ``_mapped`` around every call."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email
import email.policy
import email.utils
import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import aiohttp
from azure.core.credentials import AzureNamedKeyCredential
from azure.data.tables import (
    AccountSasPermissions,
    ResourceTypes,
    TableSasPermissions,
    generate_account_sas,
    generate_table_sas,
)
from azure.storage.blob import ContainerSasPermissions, generate_container_sas

from ..errors import AlreadyExists, Modified, NotFound, StoreError, StoreUnavailable
from .store import CONNECTION, Op, Row, StoreConfigError, with_index

SAS_LIFETIME = timedelta(hours=2)
RENEW_BEFORE = timedelta(minutes=30)  # and a start 5 minutes back: other clocks may be behind
TOKEN_SCOPE = "https://storage.azure.com/.default"  # Blob and Table alike (x-ms-version 2019-02-02 on)
TABLE_VERSION = "2019-02-02"
# The SDK's own per-try bounds (store_azure's _CLIENT_OPTIONS): a connection in 1.5 s, each read 1.5 s.
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=1.5, sock_read=1.5)
# The error codes of a table or the container itself not there (deleted under us), and which it is.
GONE = {"TableNotFound": "table", "ContainerNotFound": "container"}
_TABLE_HEADERS = {
    "x-ms-version": TABLE_VERSION,
    "DataServiceVersion": "3.0",
    "MaxDataServiceVersion": "3.0;NetFx",
    "Accept": "application/json;odata=minimalmetadata",
}
_JSON = {**_TABLE_HEADERS, "Content-Type": "application/json"}


class NoRestAccess(StoreUnavailable):
    """No token can be made for these settings: use the SDK. Raised before anything is sent."""


class Gone(StoreUnavailable):
    """The table or the container itself is not there (deleted under us): made again on next use."""


def status_error(status: int | None) -> StoreError:
    """The store's error for an answer's HTTP status (None: the SDK's error had none)."""
    if status in (404, 416):  # 416: nothing in the range asked for (past a blob's end)
        return NotFound("not found")
    if status == 409:
        return AlreadyExists("it exists")
    if status == 412:
        return Modified("a condition failed")
    return StoreUnavailable(f"the store failed (HTTP {status})")


def entity_json(entity: Mapping[str, Any]) -> bytes:
    """A checked entity (``store.clean``) as the SDK sends it (module docstring)."""
    body: dict[str, Any] = {}
    for name, value in entity.items():
        kind = type(value)
        if kind is int and name not in ("PartitionKey", "RowKey"):
            body[name] = str(value)
            body[name + "@odata.type"] = "Edm.Int64"
        elif kind is float:
            body[name] = value
            body[name + "@odata.type"] = "Edm.Double"
        else:  # str, bool (check_entity lets nothing else through)
            body[name] = value
    return json.dumps(body, separators=(",", ":")).encode()


def _typed(value: Any, edm: str | None) -> Any:
    """A property as the SDK reads it (its _convert_to_entity), as our rows hold it."""
    if edm is None or edm in ("Edm.String", "Edm.Int32", "Edm.Boolean"):
        return value
    if edm == "Edm.Int64":
        return int(value)
    if edm == "Edm.Double":
        return float(value)
    if edm == "Edm.Binary":
        return base64.b64decode(value)
    if edm == "Edm.Guid":
        return uuid.UUID(value)
    if edm == "Edm.DateTime":
        return datetime.fromisoformat(value)
    return value


def row_of(body: Mapping[str, Any], etag: str) -> Row:
    """An entity of the service's JSON (minimal metadata) as the store's Row; no Timestamp, as the SDK."""
    types = {k[:-11]: v for k, v in body.items() if k.endswith("@odata.type")}
    values = {
        k: _typed(v, types.get(k))
        for k, v in body.items()
        if not k.startswith("odata.") and not k.endswith("@odata.type") and k != "Timestamp"
    }
    return Row.of(values, body.get("odata.etag") or etag)


def _batch_answers(content_type: str, data: bytes) -> list[tuple[int, str | None, dict]]:
    """A $batch answer's operations, in order: (status, ETag, the odata.error of a failed one)."""
    message = email.message_from_bytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + data, policy=email.policy.compat32
    )
    answers: list[tuple[int, str | None, dict]] = []
    for part in message.walk():
        if part.get_content_type() != "application/http":
            continue
        payload = part.get_payload(decode=True)
        text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else str(part.get_payload())
        head, _, body = text.replace("\r\n", "\n").partition("\n\n")
        lines = head.split("\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        headers = {k.strip().lower(): v.strip() for k, v in fields.items()}
        error: dict = {}
        if status >= 300 and body.strip():
            with contextlib.suppress(ValueError):
                error = json.loads(body).get("odata.error") or {}
        answers.append((status, headers.get("etag"), error))
    return answers


def odata_filter(query: str, parameters: Mapping[str, Any]) -> str:
    """``query`` with its ``@name`` parameters written in, as the SDK's query_entities writes them
    (its _parameter_filter_substitution, for the types our rows hold)."""
    words = query.split(" ")
    for i, word in enumerate(words):
        if word.startswith("@"):
            value = parameters[word[1:]]
            if value is True or value is False:
                words[i] = str(value).lower()
            elif isinstance(value, float):
                words[i] = str(value)
            elif isinstance(value, int):
                words[i] = str(value) if value.bit_length() <= 32 else f"{value}L"
            else:
                words[i] = "'" + str(value).replace("'", "''") + "'"
    return " ".join(words)


def _failed_index(error: Mapping[str, Any]) -> int:
    """Which operation failed: the message starts with its index ("1:The specified entity..."), as
    the SDK reads it (TableTransactionError); 0 when it does not say."""
    message = error.get("message")
    text = str(message.get("value", "") if isinstance(message, Mapping) else message or "")
    head = text.split(":", 1)[0]
    return int(head) if head.isdigit() else 0


def _missing(answer: aiohttp.ClientResponse, statuses: tuple[int, ...] = (404,)) -> bool:
    """The row or blob asked for is not there (not the table or the container itself: ``GONE``)."""
    return answer.status in statuses and answer.headers.get("x-ms-error-code") not in GONE


def _entity_path(table: str, partition: str, row: str) -> str:
    # As the SDK's _prepare_key: a quote doubled inside the key's quotes, then URL-encoded.
    pk, rk = (quote(key.replace("'", "''"), safe="") for key in (partition, row))
    return f"{table}(PartitionKey='{pk}',RowKey='{rk}')"


class _Bearer:
    """An OAuth token of the app's identity, kept until 5 minutes before it expires."""

    def __init__(self, credential: Any):
        self._credential = credential
        self._token: str | None = None
        self._expires = 0.0
        self._lock = asyncio.Lock()

    async def headers(self) -> dict[str, str]:
        now = datetime.now(UTC).timestamp()
        if self._token is None or now >= self._expires - 300:
            async with self._lock:
                if self._token is None or datetime.now(UTC).timestamp() >= self._expires - 300:
                    try:
                        token = await self._credential.get_token(TOKEN_SCOPE)
                    except Exception as exc:  # noqa: BLE001 - azure-identity's failures: no answer for us
                        raise StoreUnavailable(f"no token for the store ({type(exc).__name__})") from None
                    self._token, self._expires = token.token, float(token.expires_on)
        # x-ms-date: the services want one on every request not signed by a SAS.
        return {"Authorization": f"Bearer {self._token}", "x-ms-date": email.utils.formatdate(usegmt=True)}

    def refused(self) -> None:
        """The service refused the token (401, 403): ask for a new one next time."""
        self._token = None


class _Sas:
    """SAS tokens by name (a table's, the container's), made by ``make`` (an SDK helper) and
    renewed when a quarter of their life is left, or after the service refused one."""

    def __init__(self, make: Callable[[str, datetime, datetime], str]):
        self._make = make
        self._tokens: dict[str, tuple[str, datetime]] = {}

    def token(self, name: str) -> str:
        now = datetime.now(UTC)
        found = self._tokens.get(name)
        if found is not None and now < found[1]:
            return found[0]
        sas = self._make(name, now - timedelta(minutes=5), now + SAS_LIFETIME)
        self._tokens[name] = (sas, now + SAS_LIFETIME - RENEW_BEFORE)
        return sas

    def refused(self, name: str) -> None:
        self._tokens.pop(name, None)


class Rest:
    """The hot calls (module docstring) on one aiohttp session, uncapped: no connection limit
    (aiohttp's default of 100 would queue calls behind each other) and no proxy settings read per
    request (trust_env off, as the SDK clients' use_env_settings=False).

    ``observe`` sees every answer's headers (the store's clock, a table or container gone)."""

    def __init__(
        self,
        *,
        table_url: str | None,
        blob_url: str | None,
        container: str,
        blob_version: str,
        table_key: AzureNamedKeyCredential | None,
        blob_key: tuple[str, str] | None,
        identity: Any,
        observe: Callable[[Mapping[str, str]], None],
    ):
        self._table_url = (table_url or "").rstrip("/")
        self._blob_url = (blob_url or "").rstrip("/")
        self._container_url = f"{self._blob_url}/{container}"
        self._container = container
        self._blob_version = blob_version
        self._observe = observe
        self._session: aiohttp.ClientSession | None = None
        self._table_sas = self._blob_sas = self._batch_sas = None
        self._bearer = _Bearer(identity) if identity is not None else None
        if table_key is not None:
            key = table_key

            def table_sas(name: str, start: datetime, expiry: datetime) -> str:
                permission = TableSasPermissions(read=True, add=True, update=True, delete=True)
                return generate_table_sas(key, name, permission=permission, start=start, expiry=expiry)

            def batch_sas(name: str, start: datetime, expiry: datetime) -> str:
                # $batch is the account's, not a table's: a table's SAS is refused there (Azurite).
                permission = AccountSasPermissions(read=True, add=True, update=True, delete=True)
                kinds = ResourceTypes(object=True)  # rows only
                return generate_account_sas(key, kinds, permission, start=start, expiry=expiry)

            self._table_sas = _Sas(table_sas)
            self._batch_sas = _Sas(batch_sas)
        if blob_key is not None:
            account, account_key = blob_key

            def blob_sas(name: str, start: datetime, expiry: datetime) -> str:
                permission = ContainerSasPermissions(read=True, add=True, create=True, write=True)
                return generate_container_sas(
                    account, name, account_key=account_key, permission=permission, start=start, expiry=expiry
                )

            self._blob_sas = _Sas(blob_sas)

    # --- rows ---------------------------------------------------------------------------------

    async def get(self, table: str, partition: str, row: str, select: Sequence[str] | None) -> Row | None:
        query = f"$select={','.join(['PartitionKey', 'RowKey', *select])}" if select else ""
        async with self._table("GET", table, _entity_path(table, partition, row), query, again=True) as answer:
            if _missing(answer):
                return None
            self._check(answer)
            return row_of(json.loads(await answer.read()), answer.headers.get("ETag", ""))

    async def insert(self, table: str, entity: Mapping[str, Any]) -> str:
        headers = {**_JSON, "Prefer": "return-no-content"}
        async with self._table("POST", table, table, "", headers, entity_json(entity)) as answer:
            return self._etag(answer)

    async def update(self, table: str, entity: Mapping[str, Any], etag: str | None, merge: bool) -> str:
        """Replace (or merge into) a row that must be there: under ``etag``, or any (If-Match: *)."""
        path = _entity_path(table, entity["PartitionKey"], entity["RowKey"])
        headers = {**_JSON, "If-Match": etag or "*"}
        method = "MERGE" if merge else "PUT"
        async with self._table(method, table, path, "", headers, entity_json(entity), again=etag is None) as answer:
            return self._etag(answer)

    async def upsert(self, table: str, entity: Mapping[str, Any]) -> str:
        """Insert or replace (a PUT without If-Match)."""
        path = _entity_path(table, entity["PartitionKey"], entity["RowKey"])
        async with self._table("PUT", table, path, "", _JSON, entity_json(entity), again=True) as answer:
            return self._etag(answer)

    async def delete(self, table: str, partition: str, row: str, etag: str | None) -> None:
        """Quiet when the row is not there (as the SDK's delete_entity)."""
        headers = {**_TABLE_HEADERS, "If-Match": etag or "*"}
        path = _entity_path(table, partition, row)
        async with self._table("DELETE", table, path, "", headers, again=etag is None) as answer:
            if _missing(answer):
                return
            self._check(answer)

    async def query(self, table: str, where: str, select: Sequence[str] | None, limit: int | None) -> list[Row]:
        """The rows ``where`` (an OData filter: ``odata_filter``) answers, page by page (a
        continuation after each), at most ``limit``."""
        page = min(1000, limit) if limit else 1000
        query = f"$filter={quote(where, safe='')}&$top={page}"
        if select is not None:
            query += f"&$select={','.join(['PartitionKey', 'RowKey', *select])}"
        rows: list[Row] = []
        going = ""
        while True:
            async with self._table("GET", table, f"{table}()", query + going, again=True) as answer:
                self._check(answer)
                found = json.loads(await answer.read()).get("value") or []
                after = answer.headers.get("x-ms-continuation-NextPartitionKey")
                row_after = answer.headers.get("x-ms-continuation-NextRowKey")
            for entity in found:
                rows.append(row_of(entity, ""))
                if limit is not None and len(rows) >= limit:
                    return rows
            if not after:
                return rows
            going = f"&NextPartitionKey={quote(after, safe='')}"
            if row_after:
                going += f"&NextRowKey={quote(row_after, safe='')}"

    async def batch(self, table: str, ops: Sequence[Op]) -> list[str | None]:
        """An entity-group transaction (checked: store.check_batch): one multipart/mixed POST of
        the operations as the SDK sends them (the Table service's $batch format, written here: no
        library makes it but the SDK's pipeline). Sent once; all or nothing: the failing
        operation's error with its ``index``."""
        batch, changeset = f"batch_{uuid.uuid4()}", f"changeset_{uuid.uuid4()}"
        parts = [f"--{batch}\r\nContent-Type: multipart/mixed; boundary={changeset}\r\n\r\n".encode()]
        for op in ops:
            keys = _entity_path(table, op.entity["PartitionKey"], op.entity["RowKey"])
            if op.kind == "insert":
                line, headers = f"POST {self._table_url}/{table}", "Prefer: return-no-content\r\n"
            elif op.kind == "upsert":
                line, headers = f"PUT {self._table_url}/{keys}", ""
            else:
                method = {"delete": "DELETE", "replace": "PUT", "merge": "MERGE"}[op.kind]
                line, headers = f"{method} {self._table_url}/{keys}", f"If-Match: {op.etag or '*'}\r\n"
            body = b"" if op.kind == "delete" else entity_json(op.entity)
            parts.append(
                f"--{changeset}\r\nContent-Type: application/http\r\nContent-Transfer-Encoding: binary\r\n\r\n"
                f"{line} HTTP/1.1\r\n{headers}Content-Type: application/json\r\n"
                "Accept: application/json;odata=minimalmetadata\r\nDataServiceVersion: 3.0\r\n\r\n".encode()
                + body
                + b"\r\n"
            )
        parts.append(f"--{changeset}--\r\n--{batch}--\r\n".encode())
        headers = {**_TABLE_HEADERS, "Content-Type": f"multipart/mixed; boundary={batch}"}
        async with self._table("POST", table, "$batch", "", headers, b"".join(parts), account=True) as answer:
            if answer.status >= 300 and answer.headers.get("x-ms-error-code") not in GONE:
                raise with_index(status_error(answer.status), 0)  # the whole batch refused
            self._check(answer)
            content_type = answer.headers.get("Content-Type", "")
            answers = _batch_answers(content_type, await answer.read())
        failed = next((found for found in answers if found[0] >= 300), None)
        if failed is None and len(answers) == len(ops):
            return [etag for _, etag, _ in answers]
        status, _, error = failed or (0, None, {})
        code = str(error.get("code", ""))
        if code in GONE:
            self._observe({"x-ms-error-code": code})
            raise Gone(f"the store lost its {GONE[code]} (re-created on the next call)")
        raise with_index(status_error(status), _failed_index(error))

    # --- blobs --------------------------------------------------------------------------------

    async def append_create(self, name: str) -> None:
        """A new empty append blob; AlreadyExists when one is there (If-None-Match: *)."""
        headers = {"x-ms-blob-type": "AppendBlob", "If-None-Match": "*"}
        async with self._blob("PUT", name, "", headers, b"") as answer:
            if answer.status in (409, 412):
                raise AlreadyExists("the blob exists")
            self._check(answer)

    async def append(self, name: str, data: bytes, at: int) -> None:
        """``data`` at the end of an append blob that is ``at`` bytes long (Modified when it is not)."""
        headers = {"x-ms-blob-condition-appendpos": str(at)}
        async with self._blob("PUT", name, "comp=appendblock", headers, data) as answer:
            self._check(answer)

    async def read(self, name: str, offset: int) -> bytes:
        """The bytes from ``offset``: b"" when there are none there or no blob yet."""
        async with self._blob("GET", name, "", {"x-ms-range": f"bytes={offset}-"}, again=True) as answer:
            if answer.status in (200, 206):
                return await answer.read()
            if _missing(answer, (404, 416)):  # 416: nothing past ``offset``
                return b""
            self._check(answer)
            return b""

    async def put(self, name: str, data: bytes, condition: Mapping[str, str]) -> str:
        """A block blob's whole content, under ``condition`` (If-Match / If-None-Match headers)."""
        headers = {"x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream", **condition}
        async with self._blob("PUT", name, "", headers, data, again=not condition) as answer:
            return self._etag(answer)

    async def get_blob(self, name: str) -> tuple[bytes, str] | None:
        async with self._blob("GET", name, "", {}, again=True) as answer:
            if _missing(answer):
                return None
            self._check(answer)
            return await answer.read(), answer.headers.get("ETag", "")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- requests -----------------------------------------------------------------------------

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30), timeout=_TIMEOUT
            )
        return self._session

    @contextlib.asynccontextmanager
    async def _table(
        self,
        method: str,
        table: str,
        path: str,
        query: str,
        headers: Mapping[str, str] = _TABLE_HEADERS,
        body: bytes | None = None,
        *,
        again: bool = False,
        account: bool = False,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        if not self._table_url:
            raise StoreConfigError(f"{CONNECTION}__tableServiceUri: not set")
        if self._table_sas is not None and self._batch_sas is not None:
            sas = self._batch_sas.token("$batch") if account else self._table_sas.token(table)
            query = f"{query}&{sas}" if query else sas
            sent = headers
        elif self._bearer is not None:
            sent = {**headers, **await self._bearer.headers()}
        else:
            raise NoRestAccess("no account key or identity for the tables")
        url = f"{self._table_url}/{path}?{query}" if query else f"{self._table_url}/{path}"
        async with self._send(method, url, sent, body, again) as response:
            if response.status == 403 and self._table_sas is not None and self._batch_sas is not None:
                (self._batch_sas if account else self._table_sas).refused("$batch" if account else table)
            yield response

    @contextlib.asynccontextmanager
    async def _blob(
        self, method: str, name: str, query: str, headers: Mapping[str, str], body: bytes | None = None, *, again=False
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        if not self._blob_url:
            raise StoreConfigError(f"{CONNECTION}__blobServiceUri: not set")
        if self._blob_sas is not None:
            sas = self._blob_sas.token(self._container)
            query = f"{query}&{sas}" if query else sas
            sent = {**headers, "x-ms-version": self._blob_version}
        elif self._bearer is not None:
            sent = {**headers, "x-ms-version": self._blob_version, **await self._bearer.headers()}
        else:
            raise NoRestAccess("no account key or identity for the blobs")
        url = f"{self._container_url}/{name}?{query}" if query else f"{self._container_url}/{name}"
        async with self._send(method, url, sent, body, again) as response:
            if response.status == 403 and self._blob_sas is not None:
                self._blob_sas.refused(self._container)
            yield response

    @contextlib.asynccontextmanager
    async def _send(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None, again: bool
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request; ``again``: sent a second time after a lost connection or a 5xx (a read or
        an unconditional write; a conditional one is sent once: store_azure's ``_ONCE``)."""
        session = self._open()
        response: aiohttp.ClientResponse | None = None
        if again:
            with contextlib.suppress(aiohttp.ClientConnectionError):
                response = await session.request(method, url, headers=headers, data=body)
            if response is not None and response.status >= 500:
                self._observe(response.headers)
                response.release()
                response = None
            if response is None:
                await asyncio.sleep(0.1)
        if response is None:
            response = await session.request(method, url, headers=headers, data=body)
        try:
            self._observe(response.headers)
            if response.status in (401, 403) and self._bearer is not None:
                self._bearer.refused()
            yield response
        finally:
            response.release()

    @staticmethod
    def _check(answer: aiohttp.ClientResponse) -> None:
        if answer.status < 300:
            return
        gone = GONE.get(answer.headers.get("x-ms-error-code", ""))
        if answer.status == 404 and gone:
            raise Gone(f"the store lost its {gone} (re-created on the next call)")
        raise status_error(answer.status)

    @classmethod
    def _etag(cls, answer: aiohttp.ClientResponse) -> str:
        cls._check(answer)
        return answer.headers.get("ETag", "")
