"""chatstream/state/store.py against a real Azurite: settings, clients, tables made on first use."""

from __future__ import annotations

import asyncio
import time

import pytest

from chatstream.state.legacy_store import (
    CALLERS_TABLE,
    StorageConfig,
    Store,
    StoreConfigError,
    StoreUnavailable,
    store_from_env,
)


def test_no_storage_setting_means_no_store():
    assert store_from_env({}) is None
    assert store_from_env({"AzureWebJobsStorage": "  "}) is None


def test_identity_based_settings_make_service_urls():
    config = StorageConfig.from_env(
        {
            "AzureWebJobsStorage__accountName": "acct",
            "AzureWebJobsStorage__credential": "managedidentity",
            "AzureWebJobsStorage__clientId": "id-1",
        }
    )
    assert config.table_url == "https://acct.table.core.windows.net"
    assert config.blob_url == "https://acct.blob.core.windows.net"
    assert (config.credential, config.client_id) == ("managedidentity", "id-1")
    explicit = StorageConfig.from_env({"AzureWebJobsStorage__tableServiceUri": "https://t.example/"})
    assert explicit.table_url == "https://t.example/" and explicit.blob_url is None


def test_a_plain_http_service_uri_is_refused_naming_the_setting():
    with pytest.raises(StoreConfigError, match="AzureWebJobsStorage__blobServiceUri"):
        StorageConfig.from_env({"AzureWebJobsStorage__blobServiceUri": "http://x.example"})


def test_describe_never_shows_the_key():
    config = StorageConfig(connection_string="DefaultEndpointsProtocol=https;AccountName=a;AccountKey=SECRETKEY==;")
    assert "SECRETKEY" not in config.describe() and "a" in config.describe()


async def test_tables_and_the_container_are_made_on_first_use(azurite):
    store = Store(StorageConfig(connection_string=azurite.connection_string))
    try:
        tables = await asyncio.gather(*(store.table(CALLERS_TABLE) for _ in range(5)))
        await tables[0].upsert_entity({"PartitionKey": "p", "RowKey": "r", "n": 1})
        assert (await tables[1].get_entity("p", "r"))["n"] == 1
        container = await store.container()
        await container.upload_blob("b", b"x", overwrite=True)
        assert await (await container.download_blob("b")).readall() == b"x"
    finally:
        await store.close()


async def test_a_store_that_does_not_answer_fails_within_two_seconds():
    # A port nothing listens on: the connection is refused at once; retried once, then given up.
    store = Store(
        StorageConfig(
            connection_string="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            "AccountKey=a2V5;TableEndpoint=http://127.0.0.1:9/devstoreaccount1;"
        )
    )
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable):
            await store.table(CALLERS_TABLE)
    finally:
        await store.close()
    assert time.monotonic() - started < 2.0
