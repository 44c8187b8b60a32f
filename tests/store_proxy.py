"""A TCP proxy in front of Azurite's table service, for tests of a store that stops answering and
comes back: ``forward`` passes bytes both ways; ``blackhole`` drops every open connection and accepts
new ones without ever answering (a store that hangs); ``slow`` answers, ``delay`` seconds late (a
busy store). Runs on the test's own event loop."""

from __future__ import annotations

import asyncio
import re


class StoreProxy:
    def __init__(self, connection_string: str):
        match = re.search(r"TableEndpoint=http://127\.0\.0\.1:(\d+)/", connection_string)
        assert match, "no table endpoint in the connection string"
        self.target_port = int(match.group(1))
        self.source = connection_string
        self.mode = "forward"
        self.delay = 0.0
        self.server: asyncio.Server | None = None
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> StoreProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def connection_string(self) -> str:
        """The connection string with its table endpoint through this proxy."""
        return re.sub(
            r"TableEndpoint=http://127\.0\.0\.1:\d+/", f"TableEndpoint=http://127.0.0.1:{self.port}/", self.source
        )

    def set_mode(self, mode: str, delay: float = 0.0) -> None:
        assert mode in ("forward", "blackhole", "slow")
        self.mode, self.delay = mode, delay
        for writer in list(self._writers):  # every open connection ends: the next call opens a new one
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self.mode == "blackhole":
            try:
                while await reader.read(65536):
                    pass  # read and never answer
            except (ConnectionError, OSError):
                pass
            finally:
                self._writers.discard(writer)
                writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.add(up_writer)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float = 0.0) -> None:
            try:
                while data := await src.read(65536):
                    await asyncio.sleep(delay)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(
            pump(reader, up_writer), pump(up_reader, writer, self.delay if self.mode == "slow" else 0.0)
        )
        self._writers.discard(writer)
        self._writers.discard(up_writer)

    async def close(self) -> None:
        self.set_mode("forward")
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
