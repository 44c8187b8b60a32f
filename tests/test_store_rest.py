"""The store's REST path (chatstream/state/store_azure.py) on a real Azurite: the rows it writes are
the rows the azure SDK writes (typed as it types them, so rows that earlier versions wrote through
the SDK read the same), keys with quotes and escapes reach the same row, the service's answers are
the store's errors, a table or the container not there is made, every answer sets the clock, a
connection string with a SAS signs with it, batches and queries across pages answer what they
should."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from azure.core.exceptions import ResourceNotFoundError
from azure.data.tables import EdmType, EntityProperty, TableServiceClient
from memory_store import matches
from servers import Azurite
from store_proxy import StoreProxy

from chatstream.errors import AlreadyExists, Modified, NotFound, StoreTimeout
from chatstream.settings import SettingsError
from chatstream.state.store import (
    LIMITS_TABLE,
    NEW,
    STREAMS_TABLE,
    Op,
    StoreClock,
    Where,
)
from chatstream.state.store_account import Account
from chatstream.state.store_azure import AzureStore

T = LIMITS_TABLE
_prefix = itertools.count()
# What the app's rows hold: counts, pico-dollars past 2**31 (and past 2**53), negative amounts,
# fractions, flags, text (and text that looks like a number).
VALUES = {
    "n": 7,
    "zero": 0,
    "neg": -5,
    "pico": 123_456_789_012_345,
    "max": 2**63 - 1,
    "min": -(2**63),
    "past31": 2**31,
    "x": 1.5,
    "whole": 2.0,
    "tiny": 1e-300,
    "negx": -0.1,
    "ok": True,
    "no": False,
    "s": "é🙂 \"quoted\" 'single'",
    "digits": "12345",
    "empty": "",
}


def _run(azurite: Azurite, body: Callable[[AzureStore, str], Awaitable[None]]) -> None:
    async def run() -> None:
        store = AzureStore(Account(azurite.connection_string))
        try:
            await body(store, f"r{next(_prefix)}x{os.getpid()}")
        finally:
            await store.close()

    asyncio.run(run())


def _sdk_write(azurite: Azurite, entity: dict[str, Any]) -> None:
    """A row as earlier versions wrote it through the SDK: every int an Int64."""
    keys = ("PartitionKey", "RowKey")
    typed = {k: EntityProperty(v, EdmType.INT64) if type(v) is int and k not in keys else v for k, v in entity.items()}
    with TableServiceClient.from_connection_string(azurite.connection_string) as service:
        service.get_table_client(T).upsert_entity(typed)


def _sdk_etag(azurite: Azurite, partition: str, row: str) -> str | None:
    """The row's ETag as the SDK reads it (None: it is not there)."""
    with TableServiceClient.from_connection_string(azurite.connection_string) as service:
        try:
            return service.get_table_client(T).get_entity(partition, row).metadata["etag"]
        except ResourceNotFoundError:
            return None


def _stored(azurite: Azurite, partition: str, row: str) -> dict:
    """A row as the service keeps it: each property's value and its EDM type (the SDK's raw read)."""
    with TableServiceClient.from_connection_string(azurite.connection_string) as service:
        entity = service.get_table_client(T).get_entity(partition, row)
    return {
        k: (v.value, str(v.edm_type)) if hasattr(v, "edm_type") else (v, type(v).__name__) for k, v in entity.items()
    }


def test_rows_are_the_rows_the_sdk_writes_and_reads(azurite):
    async def body(store: AzureStore, p: str) -> None:
        row = {"PartitionKey": p, **VALUES}
        await store.insert(T, {**row, "RowKey": "by-rest"})
        await store.upsert(T, {**row, "RowKey": "up-rest"})
        _sdk_write(azurite, {**row, "RowKey": "by-sdk"})
        for key in ("by-rest", "up-rest", "by-sdk"):
            got = await store.get(T, p, key)
            assert got is not None
            want = {"PartitionKey": p, "RowKey": key, **VALUES}
            assert dict(got) == want
            assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
            assert got.etag == _sdk_etag(azurite, p, key)
            assert _stored(azurite, p, key) == {**_stored(azurite, p, "by-sdk"), "RowKey": (key, "str")}
        picked = await store.get(T, p, "by-sdk", select=["pico", "x"])
        assert dict(picked or {}) == {"PartitionKey": p, "RowKey": "by-sdk", "pico": VALUES["pico"], "x": 1.5}

    _run(azurite, body)


def test_keys_with_quotes_and_escapes_reach_the_same_row(azurite):
    async def body(store: AzureStore, p: str) -> None:
        for key in ("it's", "a%20b", "c|d e", "(x,y)", "ü"):
            etag = await store.insert(T, {"PartitionKey": p, "RowKey": key, "n": 1})
            assert _sdk_etag(azurite, p, key) == etag
            etag = await store.merge(T, {"PartitionKey": p, "RowKey": key, "m": 2}, etag=etag)
            assert dict(await store.get(T, p, key) or {}) == {"PartitionKey": p, "RowKey": key, "n": 1, "m": 2}
            await store.delete(T, p, key, etag=etag)
            assert _sdk_etag(azurite, p, key) is None

    _run(azurite, body)


def test_the_services_answers_are_the_stores_errors(azurite):
    async def body(store: AzureStore, p: str) -> None:
        etag = await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})
        with pytest.raises(AlreadyExists):  # 409
            await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 2})
        newer = await store.replace(T, {"PartitionKey": p, "RowKey": "a", "n": 2}, etag=etag)
        for write in (store.replace, store.merge):
            with pytest.raises(Modified):  # 412, under an ETag the replace made stale
                await write(T, {"PartitionKey": p, "RowKey": "a", "n": 3}, etag=etag)
            with pytest.raises(NotFound):  # 404: replace and merge want the row there
                await write(T, {"PartitionKey": p, "RowKey": "none", "n": 3})
        with pytest.raises(Modified):
            await store.delete(T, p, "a", etag=etag)
        await store.delete(T, p, "none")  # quiet
        await store.delete(T, p, "none", etag=newer)
        assert await store.get(T, p, "none") is None
        assert (await store.get(T, p, "a") or {}).get("n") == 2

        blob = f"{p}/log"
        with pytest.raises(NotFound):  # 404: no blob to append to
            await store.append(blob, b"x", at=0)
        await store.append_create(blob)
        with pytest.raises(AlreadyExists):  # If-None-Match: *
            await store.append_create(blob)
        assert await store.append(blob, b"abc", at=0) == 3
        with pytest.raises(Modified):  # 412: the append position
            await store.append(blob, b"d", at=0)
        assert await store.read(blob, 1) == b"bc"
        assert await store.read(blob, 3) == b"" and await store.read(f"{p}/none") == b""

        put = await store.put(f"{p}/j", b"one", etag=NEW)
        with pytest.raises(Modified):
            await store.put(f"{p}/j", b"two", etag=NEW)
        assert await store.get_blob(f"{p}/j") == (b"one", put)
        again = await store.put(f"{p}/j", b"two", etag=put)
        with pytest.raises(Modified):
            await store.put(f"{p}/j", b"three", etag=put)
        assert await store.get_blob(f"{p}/j") == (b"two", again)
        assert await store.put(f"{p}/j", b"four") != again
        assert await store.get_blob(f"{p}/none") is None

    _run(azurite, body)


def test_a_table_or_the_container_not_there_is_made_and_the_call_goes_on(azurite):
    """Each kind of call that finds its table or the container missing (never made, or deleted
    under the store) makes it and goes on: reads answer nothing, writes land once."""
    from azure.storage.blob import BlobServiceClient

    from chatstream.state.store import STREAMS_CONTAINER

    def delete_container() -> None:
        with BlobServiceClient.from_connection_string(azurite.connection_string) as service:
            container = service.get_container_client(STREAMS_CONTAINER)
            if container.exists():
                container.delete_container()
            assert not container.exists()

    def container_made() -> bool:
        with BlobServiceClient.from_connection_string(azurite.connection_string) as service:
            return service.get_container_client(STREAMS_CONTAINER).exists()

    async def body(store: AzureStore, p: str) -> None:
        n = next(_prefix)
        assert await store.get(f"gone{n}a", p, "a") is None
        assert await store.query(f"gone{n}b", Where(partition=p)) == []
        await store.batch(f"gone{n}c", [Op("insert", {"PartitionKey": p, "RowKey": "a", "n": 1})])
        assert await store.get(f"gone{n}c", p, "a") is not None
        await store.delete(f"gone{n}d", p, "a")
        table = f"gone{n}e"
        await store.insert(table, {"PartitionKey": p, "RowKey": "a", "n": 1})
        with TableServiceClient.from_connection_string(azurite.connection_string) as service:
            service.delete_table(table)
        await store.insert(table, {"PartitionKey": p, "RowKey": "a", "n": 2})  # made again
        assert (await store.get(table, p, "a") or {}).get("n") == 2

        for call in (
            lambda: store.read(f"{p}/none"),
            lambda: store.get_blob(f"{p}/none"),
            lambda: store.delete_blob(f"{p}/none"),
        ):
            delete_container()
            assert not await call()
            assert container_made()
        delete_container()
        await store.append_create(f"{p}/log")
        assert await store.append(f"{p}/log", b"abc", at=0) == 3
        delete_container()
        await store.put(f"{p}/j", b"one", etag=NEW)
        assert await store.get_blob(f"{p}/j") is not None

    _run(azurite, body)


def test_every_answer_sets_the_clock(azurite):
    async def body(store: AzureStore, p: str) -> None:
        await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})  # the table made
        await store.append_create(f"{p}/c")
        for call in (
            lambda: store.get(T, p, "a"),
            lambda: store.merge(T, {"PartitionKey": p, "RowKey": "a", "n": 2}),
            lambda: store.append(f"{p}/c", b"x", at=0),
            lambda: store.read(f"{p}/c"),
        ):
            store.clock = StoreClock(wall=lambda: time.time() + 3600)  # this machine an hour ahead
            assert store.clock.now() - time.time() > 3000
            await call()
            assert store.clock.observed and abs(store.clock.now() - time.time()) < 3

        store.clock = StoreClock(wall=lambda: time.time() + 3600)
        with pytest.raises(AlreadyExists):  # an error is an answer too
            await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})
        assert abs(store.clock.now() - time.time()) < 3

    _run(azurite, body)


def test_a_busy_stores_late_answer_is_waited_for_as_long_as_the_calls_bound(azurite):
    """A store answering 2.5 s late (a busy one: Azurite on a loaded machine took 2-10 s) is answered
    within a call's own bound: a read (sent again after a lost connection) and an insert (sent once).
    Before, each try was cut at 1.5 s whatever the bound (the streams' producers then took a busy
    store for a failed one). With the default bound it is a timeout, as it was."""

    async def run() -> None:
        proxy = await StoreProxy(azurite.connection_string).start()
        store = AzureStore(Account(proxy.connection_string))
        loop = asyncio.get_running_loop()
        p = f"r{next(_prefix)}x{os.getpid()}"
        try:
            await store.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})
            proxy.set_mode("slow", 2.5)
            started = loop.time()
            row = await store.get(T, p, "a", timeout=10.0)
            assert row is not None and row["n"] == 1 and loop.time() - started >= 2.5
            await store.insert(T, {"PartitionKey": p, "RowKey": "b", "n": 2}, timeout=10.0)
            started = loop.time()
            with pytest.raises(StoreTimeout):
                await store.get(T, p, "b")
            assert loop.time() - started < 2.5
            proxy.set_mode("forward")
            row = await store.get(T, p, "b")
            assert row is not None and row["n"] == 2
        finally:
            await store.close()
            await proxy.close()

    asyncio.run(run())


def test_a_connection_string_with_a_sas_instead_of_a_key_signs_with_it(azurite):
    """Account SAS tokens in the connection string (no key to make tokens with): every call carries
    that SAS; a connection string with neither a key nor a SAS is refused, naming the setting."""
    from datetime import UTC, datetime, timedelta

    from azure.core.credentials import AzureNamedKeyCredential
    from azure.data.tables import ResourceTypes as TableResources
    from azure.data.tables import generate_account_sas as table_account_sas
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    fields = dict(part.split("=", 1) for part in azurite.connection_string.split(";") if "=" in part)
    account, key = fields["AccountName"], fields["AccountKey"]  # the emulator's published key
    expiry = datetime.now(UTC) + timedelta(hours=1)
    every = AccountSasPermissions(read=True, write=True, delete=True, list=True, add=True, create=True)
    blob_sas = generate_account_sas(
        account, key, ResourceTypes(service=True, container=True, object=True), every, expiry
    )
    table_sas = table_account_sas(
        AzureNamedKeyCredential(account, key),
        resource_types=TableResources(service=True, container=True, object=True),
        permission="raudwl",
        expiry=expiry,
    )
    endpoints = f"BlobEndpoint={fields['BlobEndpoint']};TableEndpoint={fields['TableEndpoint']}"
    tables, blobs = (f"{endpoints};SharedAccessSignature={sas}" for sas in (table_sas, blob_sas))

    async def run() -> None:
        p = f"sas{os.getpid()}"
        store = AzureStore(Account(tables))
        try:
            etag = await store.insert(T, {"PartitionKey": p, "RowKey": "a", "pico": 2**40})
            assert (await store.get(T, p, "a") or {}).get("pico") == 2**40
            await store.replace(T, {"PartitionKey": p, "RowKey": "a", "n": 2}, etag=etag)
            await store.batch(T, [Op("insert", {"PartitionKey": p, "RowKey": "b", "n": 3})])
            assert [r["RowKey"] for r in await store.query(T, Where(partition=p))] == ["a", "b"]
        finally:
            await store.close()
        store = AzureStore(Account(blobs))
        try:
            await store.append_create(f"{p}/b")
            assert await store.append(f"{p}/b", b"xy", at=0) == 2
            assert await store.read(f"{p}/b") == b"xy"
            await store.delete_blob(f"{p}/b")
            assert await store.get_blob(f"{p}/b") is None
        finally:
            await store.close()
        with pytest.raises(SettingsError, match="AzureWebJobsStorage: .*AccountKey or a SharedAccessSignature"):
            AzureStore(Account(endpoints))  # before any call

    asyncio.run(run())


def test_streams_rows_round_trip_on_the_streams_table(azurite):
    """The record of a resumable stream: inserted, merged at its end, read back typed."""

    async def body(store: AzureStore, p: str) -> None:
        etag = await store.insert(STREAMS_TABLE, {"PartitionKey": p, "RowKey": "~", "state": "open", "bytes": 0})
        await store.merge(STREAMS_TABLE, {"PartitionKey": p, "RowKey": "~", "state": "done", "bytes": 2**33}, etag=etag)
        assert dict(await store.get(STREAMS_TABLE, p, "~") or {}) == {
            "PartitionKey": p,
            "RowKey": "~",
            "state": "done",
            "bytes": 2**33,
        }

    _run(azurite, body)


def test_a_batch_writes_the_rows_the_sdk_writes(azurite):
    async def body(store: AzureStore, p: str) -> None:
        await store.insert(T, {"PartitionKey": p, "RowKey": "old", "n": 1})
        await store.batch(
            T,
            [
                Op("insert", {"PartitionKey": p, "RowKey": "a", **VALUES, "none": None}),
                Op("upsert", {"PartitionKey": p, "RowKey": "b", **VALUES}),
                Op("merge", {"PartitionKey": p, "RowKey": "old", "pico": 2**40}),
            ],
        )
        assert (await store.get(T, p, "old") or {}).get("pico") == 2**40
        await store.batch(T, [Op("delete", {"PartitionKey": p, "RowKey": "old"})])
        assert await store.get(T, p, "old") is None
        _sdk_write(azurite, {"PartitionKey": f"{p}sdk", "RowKey": "a", **VALUES})
        for key in ("a", "b"):
            assert _stored(azurite, p, key) == {
                **_stored(azurite, f"{p}sdk", "a"),
                "PartitionKey": (p, "str"),
                "RowKey": (key, "str"),
            }
            assert dict(await store.get(T, p, key) or {}) == {"PartitionKey": p, "RowKey": key, **VALUES}

    _run(azurite, body)


def test_queries_answer_the_rows_their_conditions_name_across_pages(azurite):
    async def body(store: AzureStore, p: str) -> None:
        rows: list[dict[str, Any]] = []
        for start in range(0, 1100, 100):  # past a page of 1,000: a continuation
            made = [
                {"PartitionKey": p, "RowKey": f"r{i:05}", "pico": 2**40 + i, "x": i / 4, "ok": i % 2 == 0}
                for i in range(start, start + 100)
            ]
            await store.batch(T, [Op("insert", row) for row in made])
            rows += made
        rows.append({"PartitionKey": p, "RowKey": "s'q", "s": "it's", "n": 1})
        await store.insert(T, rows[-1])
        for where in (
            Where(partition=p),
            Where(partition=p, limit=1050),
            Where(partition=p, rows_from="r00990", rows_to="r01010", select=("pico",)),
            Where(partition=p, equal={"ok": True}, less={"pico": 2**40 + 1000}),
            Where(partition=p, less={"x": 2.5}),
            Where(partition=p, equal={"s": "it's"}),
            Where(partition=p, less={"n": 2}),
        ):
            want = [row for row in rows if matches(where, row)][: where.limit]
            if where.select is not None:
                keep = ("PartitionKey", "RowKey", *where.select)
                want = [{k: v for k, v in row.items() if k in keep} for row in want]
            got = await store.query(T, where)
            assert [dict(r) for r in got] == want
            assert got and all(r.etag for r in got)

    _run(azurite, body)


def test_a_burst_of_first_calls_on_a_table_not_made_yet_makes_it_once(azurite):
    """The first call on a table goes alone (store_azure.py): twenty inserts at once on a table not
    made yet make it once, each row lands once."""

    async def body(store: AzureStore, p: str) -> None:
        made: list[str | None] = []
        real = store._create

        async def counted(table: str | None) -> None:
            made.append(table)
            await real(table)

        store._create = counted  # type: ignore[method-assign]
        table = f"burst{next(_prefix)}"
        await asyncio.gather(*(store.insert(table, {"PartitionKey": p, "RowKey": f"r{i}"}) for i in range(20)))
        assert made == [table]
        assert len(await store.query(table, Where(partition=p))) == 20

    _run(azurite, body)


def test_the_sdks_clients_do_not_load_even_to_make_what_is_missing(azurite):
    """The store makes a missing table or container with a request of its own: it never imports the
    SDKs' async clients (~2 MB resident): store_azure.py."""
    import subprocess
    import sys

    probe = f"""
import asyncio, sys
from chatstream.state.store_account import Account
from chatstream.state.store_azure import AzureStore
loaded = lambda: [m in sys.modules for m in ("azure.data.tables.aio", "azure.storage.blob.aio")]
async def main():
    store = AzureStore(Account({azurite.connection_string!r}))
    await store.get({T!r}, "p", "r")
    await store.read("none/log")
    print(loaded())
    await store.get("made{os.getpid()}x{next(_prefix)}", "p", "r")
    print(loaded())
    await store.close()
asyncio.run(main())
"""

    async def made(store: AzureStore, p: str) -> None:
        await store.insert(T, {"PartitionKey": p, "RowKey": "a"})
        await store.append_create(f"{p}/log")

    _run(azurite, made)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[False, False]", "[False, False]"]
