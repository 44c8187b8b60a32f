"""The store's calls as plain REST requests of the Table and Blob services, on one aiohttp session:
the wire format (rows, queries, batches, blob headers) and the signing of each request. The Store
itself (bounds, the store's clock, its errors) is store_azure.py.

Nothing is signed by hand: with an account key (a connection string; Azurite) requests carry SAS
tokens made by the SDKs' own helpers (``generate_table_sas``, ``generate_container_sas``; for a
batch, which is the account's ``$batch``, ``generate_account_sas`` for rows only), renewed well
before they expire; with a SAS in the connection string, that SAS as it is; with an identity, an
OAuth token of azure-identity's credential (``get_token``, kept until near its expiry).

Rows go as the SDK writes them, so that rows written by earlier versions (through the SDK) and by
this read the same (tests/test_store_rest.py): every int an ``Edm.Int64`` (a string with its
``@odata.type``), a float an ``Edm.Double``, bools and strings as JSON; they come back as the SDK
reads them (``row_of``). An answer that is not a success raises ``Refused`` with its status and
error code, an identity without a token ``NoToken``; store_azure's ``store_error`` maps them (and
what aiohttp raises) into the store's errors."""

from __future__ import annotations

import asyncio
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

from .store import CONNECTION, Op, Row, StoreConfigError, Where

SAS_LIFETIME = timedelta(hours=2)
RENEW_BEFORE = timedelta(minutes=30)  # and a start 5 minutes back: other clocks may be behind
TOKEN_SCOPE = "https://storage.azure.com/.default"  # Blob and Table alike (x-ms-version 2019-02-02 on)
TABLE_VERSION = "2019-02-02"
BLOB_VERSION = "2023-11-03"
# Each try: a connection in 1.5 s, each read 1.5 s (the SDK clients' bounds before).
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=1.5, sock_read=1.5)
_TABLE_HEADERS = {
    "x-ms-version": TABLE_VERSION,
    "DataServiceVersion": "3.0",
    "MaxDataServiceVersion": "3.0;NetFx",
    "Accept": "application/json;odata=minimalmetadata",
}
_JSON = {**_TABLE_HEADERS, "Content-Type": "application/json"}


class NoToken(Exception):
    """The identity gave no token (azure-identity's failure, whatever it raised: its ``__cause__``)."""


class Refused(Exception):
    """The service answered with an error: its HTTP ``status``, its ``x-ms-error-code`` and, for a
    batch, which operation failed (``index``)."""

    def __init__(self, status: int, code: str | None, index: int | None = None):
        super().__init__(f"HTTP {status} {code or ''}".strip())
        self.status, self.code, self.index = status, code, index


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
    """A property as our rows hold it: Int64 (sent as a string) an int, Double a float; strings,
    bools and Int32 are JSON's own (the app writes no other type)."""
    if edm == "Edm.Int64":
        return int(value)
    if edm == "Edm.Double":
        return float(value)
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


def _literal(value: Any) -> str:
    """A value in an OData filter, as the SDK's query_entities writes it for the types rows hold."""
    if value is True or value is False:
        return str(value).lower()
    if isinstance(value, float):
        return str(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 32 else f"{value}L"
    return "'" + str(value).replace("'", "''") + "'"


def odata_filter(where: Where) -> str:
    """The OData ``$filter`` of a query (every partition when it names none)."""
    parts: list[str] = []
    for name, op, value in (
        ("PartitionKey", "eq", where.partition),
        ("RowKey", "ge", where.rows_from),
        ("RowKey", "lt", where.rows_to),
    ):
        if value is not None:
            parts.append(f"{name} {op} {_literal(value)}")
    for op, conditions in (("eq", where.equal), ("lt", where.less), ("ge", where.at_least)):
        for name, value in conditions.items():
            if not name.isidentifier():
                raise ValueError(f"not a property name: {name!r}")
            parts.append(f"{name} {op} {_literal(value)}")
    return " and ".join(parts) or "PartitionKey ne ''"


def _failed_index(error: Mapping[str, Any]) -> int:
    """Which operation failed: the message starts with its index ("1:The specified entity..."), as
    the SDK reads it (TableTransactionError); 0 when it does not say."""
    message = error.get("message")
    text = str(message.get("value", "") if isinstance(message, Mapping) else message or "")
    head = text.split(":", 1)[0]
    return int(head) if head.isdigit() else 0


def _entity_path(table: str, partition: str, row: str) -> str:
    # As the SDK's _prepare_key: a quote doubled inside the key's quotes, then URL-encoded.
    pk, rk = (quote(key.replace("'", "''"), safe="") for key in (partition, row))
    return f"{table}(PartitionKey='{pk}',RowKey='{rk}')"


def _check(answer: aiohttp.ClientResponse) -> None:
    if answer.status >= 300:
        raise Refused(answer.status, answer.headers.get("x-ms-error-code"))


def _etag(answer: aiohttp.ClientResponse) -> str:
    _check(answer)
    return answer.headers.get("ETag", "")


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
                    except Exception as exc:  # whatever azure-identity raises: no token
                        raise NoToken(type(exc).__name__) from exc
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

    @classmethod
    def given(cls, sas: str) -> _Sas:
        """The SAS of the settings, for every name."""
        return cls(lambda name, start, expiry: sas)

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


def _table_sas(key: AzureNamedKeyCredential) -> tuple[_Sas, _Sas]:
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

    return _Sas(table), _Sas(batch)


def _blob_sas(account: str, account_key: str) -> _Sas:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    def container(name: str, start: datetime, expiry: datetime) -> str:
        permission = ContainerSasPermissions(read=True, add=True, create=True, write=True, delete=True)
        return generate_container_sas(
            account, name, account_key=account_key, permission=permission, start=start, expiry=expiry
        )

    return _Sas(container)


class Rest:
    """The store's calls (module docstring) on one aiohttp session, uncapped: no connection limit
    (aiohttp's default of 100 would queue calls behind each other) and no proxy settings read per
    request (trust_env off). Each service is reached with what the settings give: an account key
    (``table_key``, ``blob_key``), a SAS (``table_sas``, ``blob_sas``) or an identity
    (``identity``, an azure-identity credential).

    ``observe`` sees every answer's headers (the store's clock)."""

    def __init__(
        self,
        *,
        table_url: str | None,
        blob_url: str | None,
        container: str,
        observe: Callable[[Mapping[str, str]], None],
        table_key: AzureNamedKeyCredential | None = None,
        blob_key: tuple[str, str] | None = None,
        table_sas: str | None = None,
        blob_sas: str | None = None,
        identity: Any = None,
    ):
        self._table_url = (table_url or "").rstrip("/")
        self._blob_url = (blob_url or "").rstrip("/")
        self._container_url = f"{self._blob_url}/{container}"
        self._container = container
        self._observe = observe
        self._session: aiohttp.ClientSession | None = None
        self._bearer = _Bearer(identity) if identity is not None else None
        self._tables: tuple[_Sas, _Sas] | None = None  # a table's SAS, the account's for $batch
        if table_key is not None:
            self._tables = _table_sas(table_key)
        elif table_sas:
            self._tables = (_Sas.given(table_sas), _Sas.given(table_sas))
        self._blobs: _Sas | None = None
        if blob_key is not None:
            self._blobs = _blob_sas(*blob_key)
        elif blob_sas:
            self._blobs = _Sas.given(blob_sas)
        for url, signed, setting in (
            (self._table_url, self._tables, "an AccountKey or a SharedAccessSignature for the tables"),
            (self._blob_url, self._blobs, "an AccountKey or a SharedAccessSignature for the blobs"),
        ):
            if url and signed is None and self._bearer is None:
                raise StoreConfigError(f"{CONNECTION}: the connection string has no {setting}")

    # --- rows ---------------------------------------------------------------------------------

    async def get(self, table: str, partition: str, row: str, select: Sequence[str] | None) -> Row:
        query = f"$select={','.join(['PartitionKey', 'RowKey', *select])}" if select else ""
        async with self._table("GET", table, _entity_path(table, partition, row), query, again=True) as answer:
            _check(answer)
            return row_of(json.loads(await answer.read()), answer.headers.get("ETag", ""))

    async def insert(self, table: str, entity: Mapping[str, Any]) -> str:
        headers = {**_JSON, "Prefer": "return-no-content"}
        async with self._table("POST", table, table, "", headers, entity_json(entity)) as answer:
            return _etag(answer)

    async def update(self, table: str, entity: Mapping[str, Any], etag: str | None, merge: bool) -> str:
        """Replace (or merge into) a row that must be there: under ``etag``, or any (If-Match: *)."""
        path = _entity_path(table, entity["PartitionKey"], entity["RowKey"])
        headers = {**_JSON, "If-Match": etag or "*"}
        method = "MERGE" if merge else "PUT"
        async with self._table(method, table, path, "", headers, entity_json(entity), again=etag is None) as answer:
            return _etag(answer)

    async def upsert(self, table: str, entity: Mapping[str, Any]) -> str:
        """Insert or replace (a PUT without If-Match)."""
        path = _entity_path(table, entity["PartitionKey"], entity["RowKey"])
        async with self._table("PUT", table, path, "", _JSON, entity_json(entity), again=True) as answer:
            return _etag(answer)

    async def delete(self, table: str, partition: str, row: str, etag: str | None) -> None:
        headers = {**_TABLE_HEADERS, "If-Match": etag or "*"}
        path = _entity_path(table, partition, row)
        async with self._table("DELETE", table, path, "", headers, again=etag is None) as answer:
            _check(answer)

    async def query(self, table: str, where: Where) -> list[Row]:
        """The rows ``where`` answers, page by page (a continuation after each), at most its limit."""
        limit = where.limit
        page = min(1000, limit) if limit else 1000
        query = f"$filter={quote(odata_filter(where), safe='')}&$top={page}"
        if where.select is not None:
            query += f"&$select={','.join(['PartitionKey', 'RowKey', *where.select])}"
        rows: list[Row] = []
        going = ""
        while True:
            async with self._table("GET", table, f"{table}()", query + going, again=True) as answer:
                _check(answer)
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
        library makes it but the SDK's pipeline). Sent once; all or nothing: a refusal names the
        failing operation (``Refused.index``)."""
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
            if answer.status >= 300:  # the whole batch refused
                raise Refused(answer.status, answer.headers.get("x-ms-error-code"), 0)
            answers = _batch_answers(answer.headers.get("Content-Type", ""), await answer.read())
        failed = next((found for found in answers if found[0] >= 300), None)
        if failed is None and len(answers) == len(ops):
            return [etag for _, etag, _ in answers]
        status, _, error = failed or (0, None, {})
        raise Refused(status, str(error.get("code", "")) or None, _failed_index(error))

    # --- blobs --------------------------------------------------------------------------------

    async def append_create(self, name: str) -> None:
        """A new empty append blob, only if none is there (If-None-Match: *): a create that timed
        out and lands late must not empty the blob."""
        headers = {"x-ms-blob-type": "AppendBlob", "If-None-Match": "*"}
        async with self._blob("PUT", name, "", headers, b"") as answer:
            _check(answer)

    async def append(self, name: str, data: bytes, at: int) -> None:
        """``data`` at the end of an append blob that is ``at`` bytes long (412 when it is not)."""
        headers = {"x-ms-blob-condition-appendpos": str(at)}
        async with self._blob("PUT", name, "comp=appendblock", headers, data) as answer:
            _check(answer)

    async def read(self, name: str, offset: int) -> bytes:
        """The bytes from ``offset`` (416 when there are none there: Azure; Azurite answers empty)."""
        async with self._blob("GET", name, "", {"x-ms-range": f"bytes={offset}-"}, again=True) as answer:
            _check(answer)
            return await answer.read()

    async def size(self, name: str) -> int:
        async with self._blob("HEAD", name, "", {}, again=True) as answer:
            _check(answer)
            return int(answer.headers.get("Content-Length", "0"))

    async def put(self, name: str, data: bytes, condition: Mapping[str, str]) -> str:
        """A block blob's whole content, under ``condition`` (If-Match / If-None-Match headers)."""
        headers = {"x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream", **condition}
        async with self._blob("PUT", name, "", headers, data, again=not condition) as answer:
            return _etag(answer)

    async def get_blob(self, name: str) -> tuple[bytes, str]:
        async with self._blob("GET", name, "", {}, again=True) as answer:
            _check(answer)
            return await answer.read(), answer.headers.get("ETag", "")

    async def delete_blob(self, name: str) -> None:
        async with self._blob("DELETE", name, "", {}, again=True) as answer:
            _check(answer)

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
        sas, name = None, "$batch" if account else table
        if self._tables is not None:
            sas = self._tables[1] if account else self._tables[0]
            query = f"{query}&{sas.token(name)}" if query else sas.token(name)
        elif self._bearer is not None:
            headers = {**headers, **await self._bearer.headers()}
        url = f"{self._table_url}/{path}?{query}" if query else f"{self._table_url}/{path}"
        async with self._send(method, url, headers, body, again) as response:
            if response.status == 403 and sas is not None:
                sas.refused(name)
            yield response

    @contextlib.asynccontextmanager
    async def _blob(
        self, method: str, name: str, query: str, headers: Mapping[str, str], body: bytes | None = None, *, again=False
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        if not self._blob_url:
            raise StoreConfigError(f"{CONNECTION}__blobServiceUri: not set")
        headers = {**headers, "x-ms-version": BLOB_VERSION}
        if self._blobs is not None:
            sas = self._blobs.token(self._container)
            query = f"{query}&{sas}" if query else sas
        elif self._bearer is not None:
            headers.update(await self._bearer.headers())
        url = f"{self._container_url}/{name}?{query}" if query else f"{self._container_url}/{name}"
        async with self._send(method, url, headers, body, again) as response:
            if response.status == 403 and self._blobs is not None:
                self._blobs.refused(self._container)
            yield response

    @contextlib.asynccontextmanager
    async def _send(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None, again: bool
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request; ``again``: sent a second time after a lost connection or a 5xx (a read or
        an unconditional write). A conditional write (an insert, a write under an ETag or an append
        position, a batch) is sent once: a copy sent after a timeout whose first try landed would
        get a 409/412 that says "someone else wrote" of our own write (a counter exchange read that
        way gave back capacity it had already given back). The caller decides after a timeout, by
        reading (counters.py, journal.py)."""
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
