"""In-process unit tests: no servers. ``async def`` tests run on a fresh asyncio loop of their own."""

from __future__ import annotations

import asyncio
import inspect

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in inspect.signature(pyfuncitem.obj).parameters}
        asyncio.run(pyfuncitem.obj(**args))
        return True
    return None


@pytest.fixture
def quick_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Charges wait 20 ms, not the app's 200 ms, to share a transaction (state/ledger.py)."""
    monkeypatch.setattr("chatstream.state.ledger.FLUSH_SECONDS", 0.02)
