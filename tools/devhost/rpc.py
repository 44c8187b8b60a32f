"""What the host and its worker processes share about the gRPC channel between them: the
FunctionRpc.EventStream method (from worker.proto, compiled by protos.py), channel options, a
single writer per stream, and the /proc figures each process reports for /_devhost/stats.

No generated gRPC stubs: the one method is registered and called through grpcio's generic
handlers, with the message classes' own (de)serializers."""

from __future__ import annotations

import asyncio
import logging
import os
from types import ModuleType

import grpc

# What the Functions host passes as --grpcMaxMessageLength (int.MaxValue): no practical limit.
GRPC_MAX_MESSAGE = 2**31 - 1
SERVICE = "FunctionRpc"

log = logging.getLogger("devhost")


def service_name(pb: ModuleType) -> str:
    """``devhost.FunctionRpc``: the service as declared in worker.proto."""
    return pb.DESCRIPTOR.services_by_name[SERVICE].full_name


def method_path(pb: ModuleType) -> str:
    return f"/{service_name(pb)}/EventStream"


def options(max_message: int = GRPC_MAX_MESSAGE) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message),
        ("grpc.max_receive_message_length", max_message),
        # Only loopback: no keep-alive pings, no proxies (a proxy setting of the shell must not
        # route 127.0.0.1 anywhere else).
        ("grpc.enable_http_proxy", 0),
    ]


class Outbox:
    """One writer per stream: gRPC allows one outstanding write on a call, while responses are
    produced by many concurrent tasks. Messages go out in the order they were queued."""

    def __init__(self, write):
        self._write = write  # call.write or context.write
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def put(self, message) -> None:
        self._queue.put_nowait(message)

    async def _run(self) -> None:
        queue, write = self._queue, self._write
        try:
            while True:
                await write(await queue.get())
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, asyncio.InvalidStateError, RuntimeError) as exc:
            # The stream is over (the other side left); the reader sees that too and cleans up.
            log.debug("gRPC stream writer stopped: %r", exc)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


def process_figures() -> dict[str, int]:
    """This process: asyncio tasks, open file descriptors, resident memory (kB)."""
    rss = 0
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1])
                    break
    except OSError:
        pass
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:
        tasks = 0
    return {"pid": os.getpid(), "tasks": tasks, "open_fds": len(os.listdir("/proc/self/fd")), "rss_kb": rss}
