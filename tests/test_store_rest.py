"""The store's REST path (chatstream/state/store_rest.py) on a real Azurite: rows written by it read
the same through the SDK and back, typed as the SDK types them; the service's answers mapped to the
store's errors; conditional writes sent once; the clock from every answer's Date; the SDK when these
settings allow no REST access."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable

import pytest
from azure.data.tables import TableServiceClient
from servers import Azurite

from chatstream.errors import AlreadyExists, Modified, NotFound, StoreUnavailable
from chatstream.state.store import LIMITS_TABLE, NEW, STREAMS_TABLE, Op, StorageConfig, StoreClock, Where
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


def _run(azurite: Azurite, body: Callable[[AzureStore, AzureStore, str], Awaitable[None]]) -> None:
    async def run() -> None:
        rest = AzureStore(StorageConfig(connection_string=azurite.connection_string))
        sdk = AzureStore(StorageConfig(connection_string=azurite.connection_string))
        sdk.rest_off()
        try:
            await body(rest, sdk, f"r{next(_prefix)}x{os.getpid()}")
            assert rest.uses_rest() and not sdk.uses_rest()
        finally:
            await rest.close()
            await sdk.close()

    asyncio.run(run())


def _stored(azurite: Azurite, partition: str, row: str) -> dict:
    """A row as the service keeps it: each property's value and its EDM type (the SDK's raw read)."""
    with TableServiceClient.from_connection_string(azurite.connection_string) as service:
        entity = service.get_table_client(T).get_entity(partition, row)
    return {
        k: (v.value, str(v.edm_type)) if hasattr(v, "edm_type") else (v, type(v).__name__) for k, v in entity.items()
    }


def test_rows_written_by_either_path_are_the_same_rows_and_read_the_same(azurite):
    async def body(rest: AzureStore, sdk: AzureStore, p: str) -> None:
        row = {"PartitionKey": p, "RowKey": "k'quote", **VALUES}
        await rest.insert(T, {**row, "RowKey": "by-rest"})
        await sdk.insert(T, {**row, "RowKey": "by-sdk"})
        await rest.upsert(T, {**row, "RowKey": "up-rest"})
        await sdk.upsert(T, {**row, "RowKey": "up-sdk"})
        for reader in (rest, sdk):
            for key in ("by-rest", "by-sdk", "up-rest", "up-sdk"):
                got = await reader.get(T, p, key)
                assert got is not None
                want = {"PartitionKey": p, "RowKey": key, **VALUES}
                assert dict(got) == want
                assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
        assert (await rest.get(T, p, "by-sdk") or {}).etag == (await sdk.get(T, p, "by-sdk") or {}).etag
        assert _stored(azurite, p, "by-rest") == {**_stored(azurite, p, "by-sdk"), "RowKey": ("by-rest", "str")}
        picked = await rest.get(T, p, "by-sdk", select=["pico", "x"])
        assert dict(picked or {}) == {"PartitionKey": p, "RowKey": "by-sdk", "pico": VALUES["pico"], "x": 1.5}

    _run(azurite, body)


def test_keys_with_quotes_and_escapes_reach_the_same_row(azurite):
    async def body(rest: AzureStore, sdk: AzureStore, p: str) -> None:
        for key in ("it's", "a%20b", "c|d e", "(x,y)", "ü"):
            etag = await rest.insert(T, {"PartitionKey": p, "RowKey": key, "n": 1})
            found = await sdk.get(T, p, key)
            assert found is not None and found.etag == etag and found["RowKey"] == key
            etag = await sdk.merge(T, {"PartitionKey": p, "RowKey": key, "m": 2}, etag=etag)
            await rest.delete(T, p, key, etag=etag)
            assert await sdk.get(T, p, key) is None

    _run(azurite, body)


def test_the_services_answers_are_the_stores_errors(azurite):
    async def body(rest: AzureStore, sdk: AzureStore, p: str) -> None:
        etag = await rest.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})
        with pytest.raises(AlreadyExists):  # 409
            await rest.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 2})
        newer = await sdk.replace(T, {"PartitionKey": p, "RowKey": "a", "n": 2}, etag=etag)
        for write in (rest.replace, rest.merge):
            with pytest.raises(Modified):  # 412, under an ETag the SDK's write made stale
                await write(T, {"PartitionKey": p, "RowKey": "a", "n": 3}, etag=etag)
            with pytest.raises(NotFound):  # 404: replace and merge want the row there
                await write(T, {"PartitionKey": p, "RowKey": "none", "n": 3})
        with pytest.raises(Modified):
            await rest.delete(T, p, "a", etag=etag)
        await rest.delete(T, p, "none")  # quiet, as the SDK's
        await rest.delete(T, p, "none", etag=newer)
        assert await rest.get(T, p, "none") is None
        assert (await rest.get(T, p, "a") or {}).get("n") == 2

        blob = f"{p}/log"
        with pytest.raises(NotFound):  # 404: no blob to append to
            await rest.append(blob, b"x", at=0)
        await rest.append_create(blob)
        with pytest.raises(AlreadyExists):  # If-None-Match: *
            await rest.append_create(blob)
        assert await rest.append(blob, b"abc", at=0) == 3
        with pytest.raises(Modified):  # 412: the append position
            await rest.append(blob, b"d", at=0)
        assert await sdk.read(blob, 1) == b"bc" and await rest.read(blob, 1) == b"bc"
        assert await rest.read(blob, 3) == b"" and await rest.read(f"{p}/none") == b""

        put = await rest.put(f"{p}/j", b"one", etag=NEW)
        with pytest.raises(Modified):
            await rest.put(f"{p}/j", b"two", etag=NEW)
        assert await sdk.get_blob(f"{p}/j") == (b"one", put)
        again = await sdk.put(f"{p}/j", b"two", etag=put)
        with pytest.raises(Modified):
            await rest.put(f"{p}/j", b"three", etag=put)
        assert await rest.get_blob(f"{p}/j") == (b"two", again)
        assert await rest.put(f"{p}/j", b"four") != again
        assert await rest.get_blob(f"{p}/none") is None

    _run(azurite, body)


def test_a_table_deleted_under_the_store_is_made_again(azurite):
    async def body(rest: AzureStore, sdk: AzureStore, p: str) -> None:
        table = f"gone{next(_prefix)}"
        await rest.insert(table, {"PartitionKey": p, "RowKey": "a", "n": 1})
        with TableServiceClient.from_connection_string(azurite.connection_string) as service:
            service.delete_table(table)
        with pytest.raises(StoreUnavailable):
            await rest.insert(table, {"PartitionKey": p, "RowKey": "a", "n": 1})
        await rest.insert(table, {"PartitionKey": p, "RowKey": "a", "n": 1})  # re-created
        assert (await rest.get(table, p, "a") or {}).get("n") == 1

    _run(azurite, body)


def test_every_answer_sets_the_clock(azurite):
    async def body(rest: AzureStore, sdk: AzureStore, p: str) -> None:
        await rest.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})  # the table made (through the SDK)
        await rest.append_create(f"{p}/c")
        for call in (
            lambda: rest.get(T, p, "a"),
            lambda: rest.merge(T, {"PartitionKey": p, "RowKey": "a", "n": 2}),
            lambda: rest.append(f"{p}/c", b"x", at=0),
            lambda: rest.read(f"{p}/c"),
        ):
            rest.clock = StoreClock(wall=lambda: time.time() + 3600)  # this machine an hour ahead
            assert rest.clock.now() - time.time() > 3000
            await call()
            assert rest.clock.observed and abs(rest.clock.now() - time.time()) < 3

        rest.clock = StoreClock(wall=lambda: time.time() + 3600)
        with pytest.raises(AlreadyExists):  # an error is an answer too
            await rest.insert(T, {"PartitionKey": p, "RowKey": "a", "n": 1})
        assert abs(rest.clock.now() - time.time()) < 3

    _run(azurite, body)


def test_settings_without_an_account_key_use_the_sdk(azurite):
    """Connection strings with a SAS instead of a key: no token can be made here, the SDK's calls work."""
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
        store = AzureStore(StorageConfig(connection_string=tables))
        try:
            etag = await store.insert(T, {"PartitionKey": p, "RowKey": "a", "pico": 2**40})
            assert not store.uses_rest()
            assert (await store.get(T, p, "a") or {}).get("pico") == 2**40
            await store.replace(T, {"PartitionKey": p, "RowKey": "a", "n": 2}, etag=etag)
        finally:
            await store.close()
        store = AzureStore(StorageConfig(connection_string=blobs))
        try:
            await store.append_create(f"{p}/b")
            assert not store.uses_rest()
            assert await store.append(f"{p}/b", b"xy", at=0) == 2
            assert await store.read(f"{p}/b") == b"xy"
        finally:
            await store.close()

    asyncio.run(run())


def test_streams_rows_round_trip_on_the_streams_table(azurite):
    """The record of a resumable stream: inserted, merged at its end, read back typed."""

    async def body(rest: AzureStore, sdk: AzureStore, p: str) -> None:
        etag = await rest.insert(STREAMS_TABLE, {"PartitionKey": p, "RowKey": "~", "state": "open", "bytes": 0})
        await rest.merge(STREAMS_TABLE, {"PartitionKey": p, "RowKey": "~", "state": "done", "bytes": 2**33}, etag=etag)
        assert dict(await sdk.get(STREAMS_TABLE, p, "~") or {}) == {
            "PartitionKey": p,
            "RowKey": "~",
            "state": "done",
            "bytes": 2**33,
        }

    _run(azurite, body)


def test_a_batch_writes_the_same_rows_as_the_sdks_and_answers_their_etags(azurite):
    async def body(rest: AzureStore, sdk: AzureStore, p: str) -> None:
        for store, tag in ((rest, "rest"), (sdk, "sdk")):
            await store.insert(T, {"PartitionKey": f"{p}{tag}", "RowKey": "old", "n": 1})
            etags = await store.batch(
                T,
                [
                    Op("insert", {"PartitionKey": f"{p}{tag}", "RowKey": "a", **VALUES, "none": None}),
                    Op("upsert", {"PartitionKey": f"{p}{tag}", "RowKey": "b", **VALUES}),
                    Op("merge", {"PartitionKey": f"{p}{tag}", "RowKey": "old", "pico": 2**40}),
                ],
            )
            for key, etag in zip(("a", "b", "old"), etags, strict=True):
                assert etag and etag == (await sdk.get(T, f"{p}{tag}", key) or {}).etag
            assert await store.batch(T, [Op("delete", {"PartitionKey": f"{p}{tag}", "RowKey": "old"})]) == [None]
        for key in ("a", "b"):
            assert _stored(azurite, f"{p}rest", key) == {
                **_stored(azurite, f"{p}sdk", key),
                "PartitionKey": (f"{p}rest", "str"),
            }
            assert dict(await rest.get(T, f"{p}rest", key) or {}) == {
                "PartitionKey": f"{p}rest",
                "RowKey": key,
                **VALUES,
            }

    _run(azurite, body)


def test_queries_answer_the_same_rows_as_the_sdks_across_pages(azurite):
    async def body(rest: AzureStore, sdk: AzureStore, p: str) -> None:
        for start in range(0, 1100, 100):  # past a page of 1,000: a continuation
            ops = [
                Op("insert", {"PartitionKey": p, "RowKey": f"r{i:05}", "pico": 2**40 + i, "x": i / 4, "ok": i % 2 == 0})
                for i in range(start, start + 100)
            ]
            await rest.batch(T, ops)
        await rest.insert(T, {"PartitionKey": p, "RowKey": "s'q", "s": "it's", "n": 1})
        for where in (
            Where(partition=p),
            Where(partition=p, limit=1050),
            Where(partition=p, rows_from="r00990", rows_to="r01010", select=("pico",)),
            Where(partition=p, equal={"ok": True}, at_least={"pico": 2**40 + 1000}),
            Where(partition=p, less={"x": 2.5}),
            Where(partition=p, equal={"s": "it's"}),
            Where(partition=p, at_least={"n": 1}, less={"n": 2}),
        ):
            got, want = await rest.query(T, where), await sdk.query(T, where)
            assert [dict(r) for r in got] == [dict(r) for r in want] and [r.etag for r in got] == [r.etag for r in want]
            assert got and all(r.etag for r in got)
        assert len(await rest.query(T, Where(partition=p))) == 1101
        assert len(await rest.query(T, Where(partition=p, limit=1050))) == 1050

    _run(azurite, body)
