"""Shared by the unit tests of the stream core: an ``Upstream`` over a function that opens a stream."""

from __future__ import annotations


class Opener:
    """``stream.Upstream`` for the core's tests: ``open`` awaits ``open_stream()`` (an in-memory stream)."""

    def __init__(self, open_stream):
        self.open_stream = open_stream

    async def open(self, path, params, protocol, limits, record):
        return await self.open_stream()
