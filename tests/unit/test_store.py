"""chatstream/state/store_account.py: where the store is (the settings, as the Functions host reads
them) and what signs its requests; and what the Azure backend does when nothing answers. The contract itself:
tests/store_contract.py."""

from __future__ import annotations

import time

import pytest

from chatstream.errors import StoreUnavailable
from chatstream.settings import SettingsError
from chatstream.state.store import CALLERS_TABLE
from chatstream.state.store_account import Account
from chatstream.state.store_azure import AzureStore


def test_no_storage_setting_means_no_store():
    assert Account.from_env({}) is None
    assert Account.from_env({"AzureWebJobsStorage": "  "}) is None


def test_identity_based_settings_make_service_urls(monkeypatch):
    import azure.identity.aio

    class ManagedIdentity:
        def __init__(self, client_id: str | None = None):
            self.client_id = client_id

    monkeypatch.setattr(azure.identity.aio, "ManagedIdentityCredential", ManagedIdentity)
    account = Account.from_env(
        {
            "AzureWebJobsStorage__accountName": "acct",
            "AzureWebJobsStorage__credential": "managedidentity",
            "AzureWebJobsStorage__clientId": "id-1",
        }
    )
    assert account is not None
    assert account.table_url == "https://acct.table.core.windows.net"
    assert account.blob_url == "https://acct.blob.core.windows.net"
    assert isinstance(account.credential, ManagedIdentity) and account.credential.client_id == "id-1"
    explicit = Account.from_env(
        {
            "AzureWebJobsStorage__tableServiceUri": "https://t.example/",
            "AzureWebJobsStorage__blobServiceUri": "https://b.x",
        }
    )
    assert explicit is not None and explicit.table_url == "https://t.example" and explicit.blob_url == "https://b.x"
    assert type(explicit.credential).__name__ == "DefaultAzureCredential"  # no __credential: a developer's


def test_a_service_uri_not_set_is_refused_at_start_up_naming_the_setting():
    """Before, the missing one was refused at its first call, as a bug of ours (a 500), not at start-up."""
    with pytest.raises(SettingsError, match="invalid app settings: AzureWebJobsStorage__blobServiceUri: not set"):
        Account.from_env({"AzureWebJobsStorage__tableServiceUri": "https://t.example/"})
    with pytest.raises(SettingsError, match="invalid app settings: AzureWebJobsStorage__tableServiceUri: not set"):
        Account.from_env({"AzureWebJobsStorage__blobServiceUri": "https://b.example/"})


def test_a_plain_http_service_uri_is_refused_naming_the_setting():
    with pytest.raises(SettingsError, match="invalid app settings: AzureWebJobsStorage__blobServiceUri"):
        Account.from_env({"AzureWebJobsStorage__blobServiceUri": "http://x.example"})


def test_describe_never_shows_the_key_or_the_sas():
    keyed = Account("DefaultEndpointsProtocol=https;AccountName=a;AccountKey=SECRETKEY==")
    assert "SECRETKEY" not in keyed.describe() and keyed.describe() == "https://a.table.core.windows.net"
    endpoints = "TableEndpoint=https://t.example/a;BlobEndpoint=https://b.example/a"
    signed = Account(f"{endpoints};SharedAccessSignature=sv=2019-02-02&sig=SECRET")
    assert signed.describe() == "https://t.example/a"


def test_a_connection_string_the_store_cannot_use_stops_the_start_up_naming_the_setting():
    from chatstream.settings import Settings, SettingsError
    from chatstream.state.shared import SharedState

    for value in ("TableEndpoint=https://t.example/a", "TableEndpoint=https://t.example/a;SharedAccessSignature=s"):
        with pytest.raises(SettingsError, match="invalid app settings: AzureWebJobsStorage: .*AccountKey") as info:
            SharedState.from_settings(Settings.from_env({}), {"AzureWebJobsStorage": value})
        assert "t.example" not in str(info.value)


async def test_a_store_that_does_not_answer_fails_within_two_seconds():
    # A port nothing listens on: the connection is refused at once; retried once, then given up.
    store = AzureStore(
        Account(
            "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            "AccountKey=a2V5;TableEndpoint=http://127.0.0.1:9/devstoreaccount1;"
        )
    )
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable):
            await store.get(CALLERS_TABLE, "p", "r")
    finally:
        await store.close()
    assert time.monotonic() - started < 2.0


async def test_an_identity_without_a_token_is_the_stores_outage_and_the_key_check_unavailable(monkeypatch):
    """No token (no managed identity, no az login): a call raises StoreUnavailable naming no more than
    the credential's error type, noted as an outage, and a key check answers Unavailable (a 503)."""
    import azure.identity.aio

    from chatstream.state.port import Unavailable
    from chatstream.state.registry import Registry

    class NoIdentity:
        async def get_token(self, *scopes: str) -> None:
            raise RuntimeError("SECRET detail of the identity endpoint")

        async def close(self) -> None:
            pass

    monkeypatch.setattr(azure.identity.aio, "DefaultAzureCredential", NoIdentity)
    store = AzureStore(Account(table_url="https://t.example", blob_url="https://b.example"))
    try:
        with pytest.raises(StoreUnavailable) as info:
            await store.get(CALLERS_TABLE, "p", "r")
        assert "SECRET" not in str(info.value) and "RuntimeError" in str(info.value)
        assert store.clock.quiet_for() < 1.0
        assert isinstance(await Registry(store).authenticate("csk-" + "a" * 43), Unavailable)
    finally:
        await store.close()


def test_what_a_call_raises_is_mapped_into_the_stores_errors_in_one_place():
    import aiohttp

    from chatstream.errors import AlreadyExists, Modified, NotFound, StoreTimeout
    from chatstream.state.store_azure import ErrorAnswer, store_error

    assert isinstance(store_error(ErrorAnswer(404, "ResourceNotFound")), NotFound)
    assert isinstance(store_error(ErrorAnswer(416, "InvalidRange")), NotFound)  # nothing past a blob's end
    gone = store_error(ErrorAnswer(404, "TableNotFound"))  # an outage (made again), not a row's NotFound
    assert type(gone) is StoreUnavailable and "table is not there" in str(gone)
    assert type(store_error(ErrorAnswer(404, "ContainerNotFound"))) is StoreUnavailable
    assert isinstance(store_error(ErrorAnswer(409, "EntityAlreadyExists")), AlreadyExists)
    failed = store_error(ErrorAnswer(412, "UpdateConditionNotSatisfied", index=3))
    assert isinstance(failed, Modified) and failed.index == 3  # type: ignore[attr-defined]
    assert isinstance(store_error(ErrorAnswer(503, "ServerBusy")), StoreUnavailable)
    assert isinstance(store_error(TimeoutError(), "get"), StoreTimeout)
    for foreign in (aiohttp.ClientConnectionError(), ConnectionResetError()):
        assert type(store_error(foreign)) is StoreUnavailable
    no_token = StoreUnavailable("no token for the store (E)")  # the account's: as it is, never a NotFound
    assert store_error(no_token) is no_token
    assert store_error(ValueError("a bug of ours")) is None


def test_an_entitys_none_values_are_neither_sent_nor_counted_against_the_limits():
    """The store keeps no nulls: entity_json leaves the None values out, and a write's check (``Op``,
    store.check_entity) does not count them, in a batch as alone."""
    import json

    from chatstream.state.store import Op
    from chatstream.state.store_azure import entity_json

    entity = {"PartitionKey": "p", "RowKey": "r", "n": 1, "gone": None, "s": "x", "f": 0.5, "b": True}
    assert json.loads(entity_json(entity)) == {
        "PartitionKey": "p", "RowKey": "r", "n": "1", "n@odata.type": "Edm.Int64", "s": "x",
        "f": 0.5, "f@odata.type": "Edm.Double", "b": True,
    }  # fmt: skip
    full = {"PartitionKey": "p", "RowKey": "r", **{f"p{i}": i for i in range(252)}, "x": None}
    Op("insert", full)  # 252 properties of our own and a None: within the limits
    with pytest.raises(ValueError, match="252"):
        Op("insert", {**full, "x": 1})


async def test_an_identitys_token_signs_until_near_its_expiry_or_a_refusal():
    """The identity's token (a header, with x-ms-date) is asked for again 5 minutes before it expires
    or after the service refused it; a credential that fails is the store's outage. A SAS goes on the query."""
    from azure.core.credentials import AccessToken

    class Credential:
        def __init__(self, lifetime: float):
            self.asked, self.lifetime = 0, lifetime

        async def get_token(self, *scopes: str) -> AccessToken:
            self.asked += 1
            if self.lifetime < 0:
                raise RuntimeError("no identity here")
            return AccessToken(f"t{self.asked}", int(time.time() + self.lifetime))

    lasting = Credential(3600)
    signer = Account(table_url="https://t.example", credential=lasting)
    url, headers = await signer.sign("https://t.example/x?q=1", {"Accept": "a"})
    assert url == "https://t.example/x?q=1" and headers["Authorization"] == "Bearer t1" and "x-ms-date" in headers
    assert headers["Accept"] == "a"
    assert (await signer.sign("u", {}))[1]["Authorization"] == "Bearer t1" and lasting.asked == 1
    signer.refused()
    assert (await signer.sign("u", {}))[1]["Authorization"] == "Bearer t2"
    expiring = Credential(200)  # within 5 minutes of its expiry: asked for every time
    signer = Account(table_url="https://t.example", credential=expiring)
    await signer.sign("u", {})
    await signer.sign("u", {})
    assert expiring.asked == 2
    with pytest.raises(StoreUnavailable, match="no token for the store \\(RuntimeError\\)"):
        await Account(table_url="https://t.example", credential=Credential(-1)).sign("u", {})
    endpoints = "TableEndpoint=https://t.example/a;BlobEndpoint=https://b.example/a"
    sas = Account(f"{endpoints};SharedAccessSignature=sv=1&sig=S")  # the connection string's own, on the query
    assert await sas.sign("https://b.example/c/x", {}) == ("https://b.example/c/x?sv=1&sig=S", {})
    assert (await sas.sign("https://b.example/c/x?comp=appendblock", {}))[0].endswith("?comp=appendblock&sv=1&sig=S")
