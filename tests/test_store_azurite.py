"""The store's contract (tests/store_contract.py) on a real Azurite (state/store_azure.py)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from collections.abc import Awaitable, Callable

import pytest
from servers import Azurite
from store_contract import CHECKS

from chatstream.errors import StoreUnavailable
from chatstream.state.store import LIMITS_TABLE
from chatstream.state.store_account import Account
from chatstream.state.store_azure import AzureStore

_prefix = itertools.count()


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_the_contract(check, azurite):
    async def run():
        store = AzureStore(Account(azurite.connection_string))
        try:
            await check(store, f"c{next(_prefix)}x{id(store) % 10000}")
        finally:
            await store.close()

    asyncio.run(run())


async def _row_replaced(store: AzureStore) -> tuple[Callable[[], Awaitable[object]], Callable[[], Awaitable[None]]]:
    """A replace under the row's ETag, and what shows that it landed."""
    etag = await store.insert(LIMITS_TABLE, {"PartitionKey": "p", "RowKey": "r", "n": 1})

    async def landed() -> None:
        row = await store.get(LIMITS_TABLE, "p", "r")
        assert row is not None and row["n"] == 2  # it landed once the store went on

    return lambda: store.replace(LIMITS_TABLE, {"PartitionKey": "p", "RowKey": "r", "n": 2}, etag=etag), landed


async def _block_appended(store: AzureStore) -> tuple[Callable[[], Awaitable[object]], Callable[[], Awaitable[None]]]:
    """An append at the blob's position, and what shows that it landed once."""
    await store.append_create("once/log")

    async def landed() -> None:
        assert await store.read("once/log") == b"abc"  # landed once
        assert store.calls["append"] == 1

    return lambda: store.append("once/log", b"abc", at=0), landed


@pytest.mark.parametrize("write", [_row_replaced, _block_appended], ids=["replace", "append"])
def test_a_conditional_write_whose_answer_is_lost_is_not_sent_again(write):
    """The store stopped (SIGSTOP) under a write conditioned on an ETag or an append position: the
    write times out (unavailable: it may have landed) and is not sent again (store_azure.py).
    Resent, the copy's 412 said "someone else wrote" of our own landed write, and a counter
    exchange gave back twice what it held (the frozen-store churn test, CI on 2026-12-03); an
    append's copy would fail its position, or land twice."""
    azurite = Azurite()

    async def run() -> None:
        store = AzureStore(Account(azurite.connection_string))
        try:
            send, landed = await write(store)
            loop = asyncio.get_running_loop()
            os.kill(azurite.node_pid, signal.SIGSTOP)
            # Past the call's bound (CALL_TIMEOUT): a try is cut by that alone (a late answer within it is
            # waited for: test_store_rest), and nothing is sent after it.
            loop.call_later(2.5, os.kill, azurite.node_pid, signal.SIGCONT)
            with pytest.raises(StoreUnavailable):
                await send()
            await asyncio.sleep(2.5)
            await landed()
        finally:
            os.kill(azurite.node_pid, signal.SIGCONT)
            await store.close()

    try:
        asyncio.run(run())
    finally:
        azurite.stop()
