"""The ``Store`` (store.py) on the Function App's own storage account (Azurite locally): every data
call is a plain REST request of the Table or Blob service on one aiohttp session, built, sent and
read in that call's own method here; the azure SDKs only read the connection string and sign
(store_account.py). Plain requests: the SDKs' pipeline of policies took three to five times their
CPU a call (tools/bench/store_calls.py on Azurite; the figures are in git log c5c2cf4).

Rows go as the SDK writes them, so that rows written by earlier versions (through the SDK) and by
this read the same (tests/test_store_rest.py): every int an ``Edm.Int64`` (a string with its
``@odata.type``), a float an ``Edm.Double``, bools and strings as JSON; they come back as the SDK
reads them (``row_of``). Every answer's ``Date`` sets the store's clock (``StoreClock``), and what
fails becomes the store's own error in one place (``store_error``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp.helpers import parse_http_date

from ..errors import AlreadyExists, Modified, NotFound, StoreError, StoreTimeout, StoreUnavailable
from .store import (
    CALL_TIMEOUT,
    NEW,
    Op,
    Row,
    StoreClock,
    Where,
    check_batch,
    check_key,
    compact_json,
)
from .store_account import Account

# Each try: a connection in 1.5 s; its answer within the call's own bound (a per-read bound cut
# a busy store's 2-10 s answers at 1.5 s whatever the caller's patience: tests/test_store_rest.py).
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=1.5, sock_read=None)
_TABLE = {
    "x-ms-version": "2019-02-02",
    "DataServiceVersion": "3.0",
    "MaxDataServiceVersion": "3.0;NetFx",
    "Accept": "application/json;odata=minimalmetadata",
}
_JSON = {**_TABLE, "Content-Type": "application/json"}
_BLOB = {"x-ms-version": "2023-11-03"}
# The error codes of a table or the container itself not there (deleted under us), and which it is.
GONE = {"TableNotFound": "table", "ContainerNotFound": "container"}
_STATUS_LINE = re.compile(rb"^HTTP/1\.\d (\d{3}).*$", re.M)


class ErrorAnswer(Exception):
    """The service answered with an error: its HTTP ``status``, its ``x-ms-error-code`` and, for a
    batch, which operation failed (``index``)."""

    def __init__(self, status: int, code: str | None, index: int | None = None):
        super().__init__(f"HTTP {status} {code or ''}".strip())
        self.status, self.code, self.index = status, code, index


def store_error(exc: BaseException, what: str = "call") -> StoreError | None:
    """The store's error for what a call (``what``) raised; None when it is not the store's (a bug
    of ours, raised as it is). The message never carries a URL (it may hold a SAS)."""
    if isinstance(exc, TimeoutError):
        return StoreTimeout(f"the store did not answer in time ({what})")
    if isinstance(exc, StoreError):  # the account's: no token for the store
        return exc
    if isinstance(exc, (OSError, aiohttp.ClientError)):
        return StoreUnavailable(f"the store did not answer ({type(exc).__name__})")
    if not isinstance(exc, ErrorAnswer):
        return None
    status, code, index = exc.status, exc.code, exc.index
    if status == 404 and code in GONE:  # still, once made (being deleted in Azure; not ours to make)
        return StoreUnavailable(f"the store's {GONE[code]} is not there")
    if status in (404, 416):  # 416: nothing in the range asked for (past a blob's end)
        error: StoreError = NotFound("not found")
    elif status == 409:
        error = AlreadyExists("it exists")
    elif status == 412:
        error = Modified("a condition failed")
    else:
        error = StoreUnavailable(f"the store failed (HTTP {status})")
    error.index = index
    return error


# --- the wire format ---------------------------------------------------------------------------


def entity_json(entity: Mapping[str, Any]) -> bytes:
    """An ``Op``'s entity as the SDK sends it (module docstring), without its None values (the store
    keeps no nulls)."""
    body: dict[str, Any] = {}
    for name, value in entity.items():
        kind = type(value)
        if kind is int and name != "PartitionKey" and name != "RowKey":
            body[name], body[name + "@odata.type"] = str(value), "Edm.Int64"
        elif value is not None:
            body[name] = value  # a str or a bool as it is (Op's check lets nothing else through)
            if kind is float:
                body[name + "@odata.type"] = "Edm.Double"
    return compact_json(body).encode()


def row_of(body: Mapping[str, Any], etag: str) -> Row:
    """An entity of the service's JSON (minimal metadata) as the SDK reads it (module docstring), no
    Timestamp: Int64 (a string) an int, Double a float, the rest JSON's own."""
    values: dict[str, Any] = {}
    for name, value in body.items():
        if name.startswith("odata.") or name.endswith("@odata.type") or name == "Timestamp":
            continue
        edm = body.get(name + "@odata.type")
        values[name] = int(value) if edm == "Edm.Int64" else float(value) if edm == "Edm.Double" else value
    return Row.of(values, body.get("odata.etag") or etag)


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
    for op, conditions in (("eq", where.equal), ("lt", where.less)):
        for name, value in conditions.items():
            if not name.isidentifier():
                raise ValueError(f"not a property name: {name!r}")
            parts.append(f"{name} {op} {_literal(value)}")
    return " and ".join(parts) or "PartitionKey ne ''"


def _entity_path(table: str, partition: str, row: str) -> str:
    # As the SDK's _prepare_key: a quote doubled inside the key's quotes, then URL-encoded.
    pk, rk = (quote(key.replace("'", "''"), safe="") for key in (partition, row))
    return f"{table}(PartitionKey='{pk}',RowKey='{rk}')"


def _request(table: str, op: Op) -> tuple[str, str, dict[str, str]]:
    """An operation's method, path and own headers, alone or in a batch: a replace, a merge or a
    delete only if the row is there (under ``op.etag``, or any version: If-Match: *)."""
    if op.kind == "insert":
        return "POST", table, {"Prefer": "return-no-content"}
    path = _entity_path(table, op.entity["PartitionKey"], op.entity["RowKey"])
    if op.kind == "upsert":
        return "PUT", path, {}
    return {"delete": "DELETE", "replace": "PUT", "merge": "MERGE"}[op.kind], path, {"If-Match": op.etag or "*"}


def _batch_answer(count: int, data: bytes) -> None:
    """Read the answer of a $batch of ``count`` operations: its HTTP answers' status lines, in order
    (the only lines that start with ``HTTP/1.``: the rest is boundaries, headers and JSON bodies). A
    failed operation raises ``ErrorAnswer`` with its index (the odata.error's message starts with it,
    "1:The specified entity...", as the SDK reads it; 0 when it does not say), and so does an answer
    short of operations. Its line ends read as LF (the service writes CRLF, a proxy might not)."""
    data = data.replace(b"\r\n", b"\n")
    statuses = list(_STATUS_LINE.finditer(data))
    for status in statuses:
        if int(status[1]) >= 300:
            body = data[status.end() :].partition(b"\n\n")[2].partition(b"\n--")[0]  # to the next boundary
            error: Any = {}
            with contextlib.suppress(ValueError):  # no body, or not JSON
                error = json.loads(body).get("odata.error") or {}
            message = error.get("message")
            head = str(message.get("value", "") if isinstance(message, Mapping) else message or "").split(":", 1)[0]
            raise ErrorAnswer(int(status[1]), str(error.get("code", "")) or None, int(head) if head.isdigit() else 0)
    if len(statuses) != count:
        raise ErrorAnswer(0, None, 0)


class AzureStore:
    """The store on ``account``'s storage (module docstring), on one aiohttp session with no
    connection limit (aiohttp's default of 100 would queue calls behind each other)."""

    def __init__(self, account: Account, clock: StoreClock | None = None):
        self.account = account
        self.clock = clock or StoreClock()
        self.calls: dict[str, int] = {}  # requests of each op (tests count them)
        self._session: aiohttp.ClientSession | None = None
        self._first: dict[str | None, asyncio.Future] = {}  # each one's first call, done once it is answered
        self._date: tuple[str | None, float | None] = (None, None)  # the last Date answered, as read

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
        path = _entity_path(table, partition, row)
        if select:
            path += f"?$select={','.join(['PartitionKey', 'RowKey', *select])}"
        try:
            headers, body = await self._call("get", timeout, table, "GET", path, again=True)
        except NotFound:
            return None
        return row_of(json.loads(body), headers.get("ETag", ""))

    async def insert(self, table: str, entity: Mapping[str, Any], *, timeout: float = CALL_TIMEOUT) -> str:
        return await self._write(table, Op("insert", entity), timeout)

    async def replace(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> str:
        return await self._write(table, Op("replace", entity, etag), timeout)

    async def merge(
        self, table: str, entity: Mapping[str, Any], *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> str:
        return await self._write(table, Op("merge", entity, etag), timeout)

    async def upsert(self, table: str, entity: Mapping[str, Any], *, timeout: float = CALL_TIMEOUT) -> str:
        return await self._write(table, Op("upsert", entity), timeout)

    async def delete(
        self, table: str, partition: str, row: str, *, etag: str | None = None, timeout: float = CALL_TIMEOUT
    ) -> None:
        with contextlib.suppress(NotFound):  # quiet on a missing row
            await self._write(table, Op("delete", {"PartitionKey": partition, "RowKey": row}, etag), timeout)

    async def _write(self, table: str, op: Op, timeout: float, batch: bool = False) -> str:
        """``op`` as a request of its own (of a ``batch``: sent once, as a batch is)."""
        method, path, own = _request(table, op)
        body = None if op.kind == "delete" else entity_json(op.entity)
        headers = {**(_TABLE if body is None else _JSON), **own}
        again = not batch and op.kind != "insert" and op.etag is None  # no condition (``_send``)
        name = "batch" if batch else op.kind
        answered, _ = await self._call(name, timeout, table, method, path, headers, body, again=again)
        return answered.get("ETag", "")

    async def query(self, table: str, where: Where, *, timeout: float = CALL_TIMEOUT) -> list[Row]:
        """The rows ``where`` answers, page by page, all within ``timeout``."""
        limit = where.limit
        path = f"{table}()?$filter={quote(odata_filter(where), safe='')}&$top={min(1000, limit) if limit else 1000}"
        if where.select is not None:
            path += f"&$select={','.join(['PartitionKey', 'RowKey', *where.select])}"
        rows: list[Row] = []
        going = ""
        loop = asyncio.get_running_loop()
        ends = loop.time() + timeout
        while True:
            headers, body = await self._call("query", ends - loop.time(), table, "GET", path + going, again=True)
            for entity in json.loads(body).get("value") or []:
                rows.append(row_of(entity, ""))
                if limit is not None and len(rows) >= limit:
                    return rows
            after = headers.get("x-ms-continuation-NextPartitionKey")
            if not after:
                return rows
            going = f"&NextPartitionKey={quote(after, safe='')}"
            if row_after := headers.get("x-ms-continuation-NextRowKey"):
                going += f"&NextRowKey={quote(row_after, safe='')}"

    async def batch(self, table: str, ops: Sequence[Op], *, timeout: float = CALL_TIMEOUT) -> None:
        """An entity-group transaction (``store.check_batch``): one multipart/mixed POST of
        the operations as the SDK sends them (the Table service's $batch format, written here: no
        library makes it but the SDK's pipeline). Sent once; all or nothing: a refusal names the
        failing operation (the error's ``index``). One operation goes as its own request: the
        multipart cost a ledger row's write a fifth more CPU (tools/bench/store_calls.py)."""
        check_batch(ops)
        if len(ops) == 1:
            try:
                await self._write(table, ops[0], timeout, batch=True)
                return
            except (NotFound, AlreadyExists, Modified) as exc:
                exc.index = 0
                raise
        url = self.account.table_url
        batch, changeset = f"batch_{uuid.uuid4()}", f"changeset_{uuid.uuid4()}"
        parts = [f"--{batch}\r\nContent-Type: multipart/mixed; boundary={changeset}\r\n\r\n".encode()]
        for op in ops:
            method, path, own = _request(table, op)
            headers = "".join(f"{name}: {value}\r\n" for name, value in own.items())
            body = b"" if op.kind == "delete" else entity_json(op.entity)
            parts.append(
                f"--{changeset}\r\nContent-Type: application/http\r\nContent-Transfer-Encoding: binary\r\n\r\n"
                f"{method} {url}/{path} HTTP/1.1\r\n{headers}Content-Type: application/json\r\n"
                "Accept: application/json;odata=minimalmetadata\r\nDataServiceVersion: 3.0\r\n\r\n".encode()
                + body
                + b"\r\n"
            )
        parts.append(f"--{changeset}--\r\n--{batch}--\r\n".encode())
        headers = {**_TABLE, "Content-Type": f"multipart/mixed; boundary={batch}"}
        await self._call("batch", timeout, table, "POST", "$batch", headers, b"".join(parts), batch_of=len(ops))

    # --- blobs --------------------------------------------------------------------------------

    async def append_create(self, name: str, *, timeout: float = CALL_TIMEOUT) -> None:
        """A new empty append blob, only if none is there (If-None-Match: *): a create that timed
        out and lands late must not empty the blob."""
        headers = {**_BLOB, "x-ms-blob-type": "AppendBlob", "If-None-Match": "*"}
        try:
            await self._call("append_create", timeout, None, "PUT", name, headers, b"")
        except Modified:  # If-None-Match: * (Azure answers 409, Azurite 412)
            raise AlreadyExists("the blob exists") from None

    async def append(self, name: str, data: bytes, *, at: int, timeout: float = CALL_TIMEOUT) -> int:
        headers = {**_BLOB, "x-ms-blob-condition-appendpos": str(at)}
        await self._call("append", timeout, None, "PUT", f"{name}?comp=appendblock", headers, data)
        return at + len(data)  # the append position condition held: the blob is now this long

    async def read(self, name: str, offset: int = 0, *, timeout: float = CALL_TIMEOUT) -> bytes:
        headers = {**_BLOB, "x-ms-range": f"bytes={offset}-"}
        try:
            return (await self._call("read", timeout, None, "GET", name, headers, again=True))[1]
        except NotFound:  # no blob, or nothing past offset (416: Azure; Azurite answers empty)
            return b""

    async def put(self, name: str, data: bytes, *, etag: str | None = None, timeout: float = CALL_TIMEOUT) -> str:
        condition = {"If-None-Match": "*"} if etag == NEW else {"If-Match": etag} if etag is not None else {}
        headers = {**_BLOB, "x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream", **condition}
        try:
            answered, _ = await self._call("put", timeout, None, "PUT", name, headers, data, again=not condition)
        except (AlreadyExists, NotFound):
            raise Modified("the blob changed") from None
        return answered.get("ETag", "")

    async def get_blob(self, name: str, *, timeout: float = CALL_TIMEOUT) -> tuple[bytes, str] | None:
        try:
            headers, body = await self._call("get_blob", timeout, None, "GET", name, _BLOB, again=True)
        except NotFound:
            return None
        return body, headers.get("ETag", "")

    async def delete_blob(self, name: str, *, timeout: float = CALL_TIMEOUT) -> None:
        with contextlib.suppress(NotFound):
            await self._call("delete_blob", timeout, None, "DELETE", name, _BLOB, again=True)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.account.close()
        self._first.clear()

    # --- one call -----------------------------------------------------------------------------

    async def _call(
        self,
        op: str,
        timeout: float,
        table: str | None,
        method: str,
        path: str,
        headers: Mapping[str, str] = _TABLE,
        body: bytes | None = None,
        *,
        again: bool = False,
        batch_of: int = 0,
    ) -> tuple[Mapping[str, str], bytes]:
        """One request ``op`` of ``table``'s (of the container's when None; ``path`` in it, with its
        query) within ``timeout`` seconds: its success's headers and body (a $batch's of
        ``batch_of`` operations read by ``_batch_answer``), or the store's error (``store_error``;
        an outage noted on the clock). A call that finds its table or container missing makes it and
        goes once more: the service did nothing. The first call on each in this process goes alone:
        the calls that come meanwhile wait for it (a burst of first calls on one not made yet would
        all be refused, all make it, then all be sent again)."""
        self.calls[op] = self.calls.get(op, 0) + 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = None
        try:
            async with asyncio.timeout(timeout):
                gate = self._first.get(table)
                if gate is None:
                    first = self._first[table] = loop.create_future()
                elif not gate.done():
                    await asyncio.shield(gate)
                url = self.account.url(table, path)
                try:
                    result = await self._send(url, method, headers, body, again, batch_of)
                except ErrorAnswer as exc:
                    if exc.status != 404 or exc.code not in GONE:
                        raise
                    await self._create(table)
                    result = await self._send(url, method, headers, body, again, batch_of)
        except Exception as exc:  # store_error says which are the store's; the rest raise as they are
            error = store_error(exc, op)
            if error is None:
                raise
            if isinstance(error, StoreUnavailable):
                self.clock.failed()
            else:  # an answer all the same (404, 409, 412)
                self.clock.took(loop.time() - started)
            raise error from None
        finally:
            if first is not None:  # however it ended: the calls that wait go on
                first.set_result(None)
        self.clock.took(loop.time() - started)
        return result

    async def _send(
        self, url: str, method: str, headers: Mapping[str, str], body: bytes | None, again: bool, batch_of: int = 0
    ) -> tuple[Mapping[str, str], bytes]:
        """One request to ``url``, signed (store_account.py); ``again``: sent a second time after a
        lost connection or a 5xx (a read or an unconditional write). A conditional write (an insert,
        a write under an ETag or an append position, a batch) is sent once: a copy sent after a
        timeout whose first try landed would get a 409/412 that says "someone else wrote" of our own
        write (a counter exchange read that way gave back capacity it had already given back). The
        caller decides after a timeout, by reading (counters.py, journal.py). An error answer raises
        ``ErrorAnswer``."""
        url, headers = await self.account.sign(url, headers)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30), timeout=_TIMEOUT
            )
        response: aiohttp.ClientResponse | None = None
        if again:
            with contextlib.suppress(aiohttp.ClientConnectionError):
                response = await self._session.request(method, url, headers=headers, data=body)
            if response is not None and response.status >= 500:
                self._observe(response.headers)
                response.release()
                response = None
            if response is None:
                await asyncio.sleep(0.1)
        if response is None:
            response = await self._session.request(method, url, headers=headers, data=body)
        try:
            self._observe(response.headers)
            if response.status >= 300:
                if response.status in (401, 403):  # a token refused: a new one next time
                    self.account.refused()
                raise ErrorAnswer(response.status, response.headers.get("x-ms-error-code"))
            data = await response.read()
            if batch_of:  # its table may be gone: read here, so that ``_call`` makes it
                _batch_answer(batch_of, data)
            return response.headers, data
        finally:
            response.release()

    async def _create(self, table: str | None) -> None:
        """Make ``table``, or the container when None: one there (409) is made, and one this
        identity may not make (403) is infra/'s to make."""
        if table is None:
            url = self.account.url(None, "").rstrip("/") + "?restype=container"
            method, headers, body = "PUT", _BLOB, b""
        else:
            url, method = self.account.url(table, "Tables"), "POST"
            headers, body = {**_JSON, "Prefer": "return-no-content"}, json.dumps({"TableName": table}).encode()
        try:
            await self._send(url, method, headers, body, again=True)
        except ErrorAnswer as exc:
            if exc.status not in (403, 409):
                raise

    def _observe(self, headers: Mapping[str, str]) -> None:
        """Every answer: the store's clock, from its Date header (GMT; none, or garbage: nothing),
        read once a second (its Date again: the same time)."""
        date = headers.get("Date")
        if date != self._date[0]:
            when = parse_http_date(date)
            self._date = (date, when.timestamp() if when is not None else None)
        if self._date[1] is not None:
            self.clock.observe(self._date[1])
