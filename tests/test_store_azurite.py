"""The store's contract (tests/store_contract.py) on a real Azurite, through the azure SDKs."""

from __future__ import annotations

import itertools

import pytest
from store_contract import CHECKS

from chatstream.state.store import StorageConfig
from chatstream.state.store_azure import AzureStore

_prefix = itertools.count()


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_the_contract(check, azurite):
    import asyncio

    async def run():
        store = AzureStore(StorageConfig(connection_string=azurite.connection_string))
        try:
            await check(store, f"c{next(_prefix)}x{id(store) % 10000}")
        finally:
            await store.close()

    asyncio.run(run())
