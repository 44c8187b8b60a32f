"""A stream's events kept in memory on its producer's instance (``KeptEvents``): what its writer
stores and what readers on that instance are served, who are woken on every change."""

from __future__ import annotations

import asyncio


class KeptEvents:
    """The numbered events of one stream, in memory: ``events[i]`` has id i + 1. ``end``: the
    final event is kept (the route's or our error); ``lost``: it is our error (stored as ``: lost``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.events: list[bytes] = []
        self.size = 0
        self.end = False
        self.lost = False
        self.waiters: list[asyncio.Future] = []  # readers here waiting for a change
        self._loop = loop

    def wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def changed(self) -> None:
        waiter = self._loop.create_future()
        self.waiters.append(waiter)
        await waiter
