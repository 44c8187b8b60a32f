"""In-process unit tests: no servers. ``async def`` tests run on a fresh asyncio loop of their own,
one that skips idle waits in modules marked ``skips_idle_time`` (tests/idle_clock.py)."""

from __future__ import annotations

import asyncio
import inspect

import idle_clock  # before chatstream is imported (tests/idle_clock.py)
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in inspect.signature(pyfuncitem.obj).parameters}
        marker = pyfuncitem.get_closest_marker("skips_idle_time")  # (False) on a test: it waits on real I/O
        skipping = marker is not None and (marker.args or (True,))[0]
        with asyncio.Runner(loop_factory=idle_clock.IdleSkippingLoop if skipping else None) as runner:
            runner.run(pyfuncitem.obj(**args))
        return True
    return None
