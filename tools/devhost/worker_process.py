"""A worker process of the local host, started by it the way the Functions host starts the Python
worker:

    python -m tools.devhost.worker_process --host 127.0.0.1 --port PORT --workerId ID --requestId ID
        --grpcMaxMessageLength BYTES [--hostPid PID] [--loop asyncio|uvloop] [--verbose]

It connects to the host's gRPC server, opens FunctionRpc.EventStream, introduces itself
(StartStream with its worker id) and then answers every message with azure-functions-runtime's
handlers, on its own event loop:

* WorkerInitRequest: index function_app.py; with HTTP streaming the runtime starts the worker's
  own HTTP server (uvicorn, on this loop) and returns its address in the ``HttpUri`` capability.
  The response goes back once that server accepts connections.
* FunctionsMetadataRequest, FunctionLoadRequest: the indexed functions.
* InvocationRequest: one per HTTP request; the request itself reaches the worker's HTTP server
  with the same ``x-ms-invocation-id``, and the runtime pairs the two.
* InvocationCancel (devhost only: Azure's Python worker declares no ``HandlesInvocationCancelMessage``
  and the Functions host sends it none): the host gave up on an invocation whose HTTP request never
  reached this worker (the forward failed, the caller left); one still waiting for that request
  (the runtime waits without a bound) is answered ``Cancelled``, and a request that comes late gets
  an error. One whose request arrived runs on, as in Azure.
* WorkerStatusRequest: answered with this process's tasks, descriptors and memory (devhost's
  /_devhost/stats).

It exits when the host ends the stream or sends WorkerTerminate (within a second), and, on Linux,
as soon as the host process dies. SIGTERM is handled as by Azure's Python worker, which installs no
handler of its own: the runtime's HTTP server (uvicorn, serving on this process's main thread)
catches it, stops accepting connections, waits for the requests in flight without a limit of its
own, then raises SIGTERM again, so that the process ends by it; before that server runs, SIGTERM
ends the process at once. An app may chain a handler of its own in front of uvicorn's (the app's
drain does: chatstream/lifecycle.py). SIGINT is ignored: Ctrl+C in a terminal reaches the whole
process group, and the host decides how its workers stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import types
from pathlib import Path

import grpc

from . import logs, protos, rpc

log = logging.getLogger("devhost.worker")

CONNECT_TIMEOUT = 30.0  # the host's gRPC server is up before the worker starts; this is a backstop
LISTEN_TIMEOUT = 15.0  # the worker's HTTP server accepting connections after WorkerInitRequest
EXIT_BACKSTOP = 1.0  # seconds from the decision to stop to a forced exit
MAX_PAIRED = 10_000  # invocation ids whose request arrived, kept at most


def _die_with_parent(host_pid: int | None) -> None:
    """Linux: get SIGKILL when the host dies, however it dies (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if host_pid and os.getppid() != host_pid:  # the host died before prctl took effect
        os._exit(1)


class Dispatcher:
    """One EventStream to the host; each message is handled in a task of its own."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.pb = protos.load()
        self.loop = asyncio.get_running_loop()
        self.server_tasks: set[asyncio.Task] = set()
        self.tasks: set[asyncio.Task] = set()
        self.invocations: dict[str, asyncio.Task] = {}  # running, by invocation id
        self.paired: dict[str, None] = {}  # invocations whose HTTP request reached the runtime (oldest first)
        self.cancelled: set[str] = set()  # ...and those the host cancelled while unpaired
        self.call = None
        self.outbox: rpc.Outbox | None = None
        self.handlers = {
            "worker_init_request": (self._init, "worker_init_response"),
            "functions_metadata_request": (self._runtime("functions_metadata_request"), "function_metadata_response"),
            "function_load_request": (self._runtime("function_load_request"), "function_load_response"),
            "invocation_request": (self._invoke, "invocation_response"),
            "function_environment_reload_request": (
                self._runtime("function_environment_reload_request"),
                "function_environment_reload_response",
            ),
            "worker_status_request": (self._status, "worker_status_response"),
        }

    # -- the stream

    async def run(self) -> int:
        a = self.args
        channel = grpc.aio.insecure_channel(f"{a.host}:{a.port}", options=rpc.options(a.grpcMaxMessageLength))
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT)
            except TimeoutError:
                log.error("cannot reach the host's gRPC server at %s:%s", a.host, a.port)
                return 1
            self.call = channel.stream_stream(
                rpc.method_path(self.pb),
                request_serializer=self.pb.StreamingMessage.SerializeToString,
                response_deserializer=self.pb.StreamingMessage.FromString,
            )()
            self.outbox = rpc.Outbox(self.call.write)
            self.outbox.start()
            self.outbox.put(
                self.pb.StreamingMessage(request_id=a.requestId, start_stream=self.pb.StartStream(worker_id=a.workerId))
            )
            await self._read()
            return 0
        finally:
            await self._shutdown(channel)

    async def _read(self) -> None:
        eof = grpc.aio.EOF
        handlers = self.handlers
        while True:
            try:
                message = await self.call.read()
            except grpc.RpcError:  # the host went away
                return
            if message is eof:
                return
            kind = message.WhichOneof("content")
            if kind == "worker_terminate":
                return
            if kind == "invocation_cancel":
                self._cancel(message.invocation_cancel.invocation_id)
                continue
            handler = handlers.get(kind)
            if handler is None:
                log.warning("ignoring a %s message from the host", kind)
                continue
            task = self.loop.create_task(self._dispatch(message, *handler))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _dispatch(self, message, handler, response_field: str) -> None:
        try:
            response = await handler(message)
        except Exception as exc:  # a bug of ours or the runtime's: answer with a failure, never hang the host
            log.exception("handling %s failed", message.WhichOneof("content"))
            response = self._failure(response_field, message, exc)
        self.outbox.put(self.pb.StreamingMessage(request_id=message.request_id, **{response_field: response}))

    def _failure(self, response_field: str, message, exc: Exception):
        pb = self.pb
        result = pb.StatusResult(
            status=pb.StatusResult.Failure, exception=pb.RpcException(message=f"{type(exc).__name__}: {exc}")
        )
        response_type = type(getattr(pb.StreamingMessage(), response_field))
        if response_field == "invocation_response":
            return response_type(invocation_id=message.invocation_request.invocation_id, result=result)
        if response_field == "function_load_response":
            return response_type(function_id=message.function_load_request.function_id, result=result)
        if "result" in response_type.DESCRIPTOR.fields_by_name:
            return response_type(result=result)
        return response_type()

    def _request(self, message):
        """What the runtime's handlers take: ``.request`` (the message) and ``.properties``."""
        return types.SimpleNamespace(request=message, properties={"host": self.args.host, "protos": self.pb})

    # -- handlers

    def _runtime(self, name: str):
        async def handle(message):
            import azure_functions_runtime as runtime

            return await getattr(runtime, name)(self._request(message))

        return handle

    async def _invoke(self, message):
        """The runtime's invocation_request; Cancelled when the host cancelled it unpaired (``_cancel``)."""
        import azure_functions_runtime as runtime
        from azure_functions_runtime.http_v2 import http_coordinator

        invocation_id = message.invocation_request.invocation_id
        task = asyncio.current_task()
        assert task is not None
        self.invocations[invocation_id] = task
        try:
            return await runtime.invocation_request(self._request(message))
        except asyncio.CancelledError:
            if invocation_id not in self.cancelled:
                raise
            task.uncancel()
            gone = ConnectionAbortedError("the host cancelled this invocation: its HTTP request never arrived")
            with contextlib.suppress(KeyError):  # a request that comes late gets this, as a failed invocation's
                http_coordinator.set_http_response(invocation_id, gone)
            pb = self.pb
            return pb.InvocationResponse(
                invocation_id=invocation_id,
                result=pb.StatusResult(status=pb.StatusResult.Cancelled, exception=pb.RpcException(message=str(gone))),
            )
        finally:
            del self.invocations[invocation_id]
            self.paired.pop(invocation_id, None)
            self.cancelled.discard(invocation_id)

    def _cancel(self, invocation_id: str) -> None:
        """The host's InvocationCancel: ends the invocation if it still waits for its HTTP request."""
        task = self.invocations.get(invocation_id)
        if task is None or invocation_id in self.paired:
            return
        self.cancelled.add(invocation_id)
        task.cancel()

    def _watch_pairing(self) -> None:
        """Note each HTTP request the runtime pairs with its invocation (``set_http_request``, where the
        runtime's HTTP server hands it over): ``_cancel`` leaves those alone."""
        from azure_functions_runtime.http_v2 import http_coordinator

        pair = http_coordinator.set_http_request

        def set_http_request(invoc_id, http_request):
            # (also a request ahead of its InvocationRequest; one whose invocation was cancelled
            # comes late at most once: MAX_PAIRED bounds what such ones leave)
            self.paired[invoc_id] = None
            while len(self.paired) > MAX_PAIRED:
                del self.paired[next(iter(self.paired))]
            pair(invoc_id, http_request)

        http_coordinator.set_http_request = set_http_request

    async def _init(self, message):
        import azure_functions_runtime as runtime

        self._watch_pairing()

        app = message.worker_init_request.function_app_directory
        if app:
            # The Python worker runs with the app folder as cwd and first on sys.path.
            os.chdir(app)
            if app not in sys.path:
                sys.path.insert(0, app)
        before = asyncio.all_tasks()
        response = await runtime.worker_init_request(self._request(message))
        # worker_init_request starts the worker's HTTP server as a task on this loop; hold on to
        # it, so that stopping stops that server too.
        self.server_tasks = asyncio.all_tasks() - before - self.tasks
        uri = response.capabilities.get("HttpUri")
        if response.result.status == response.result.Success and uri:
            try:
                await self._wait_listening(uri)
            except TimeoutError:
                response.result.status = response.result.Failure
                response.result.exception.message = f"the worker's HTTP server at {uri} did not start"
        # The worker's uvicorn has reset logging (its dictConfig): put ours back.
        logs.configure(self.args.verbose, worker=True)
        return response

    async def _wait_listening(self, uri: str) -> None:
        host, port = uri.rsplit("//", 1)[1].rsplit(":", 1)
        deadline = self.loop.time() + LISTEN_TIMEOUT
        while True:
            if any(t.done() for t in self.server_tasks):
                raise TimeoutError  # the server task ended: it will never listen
            try:
                _, writer = await asyncio.open_connection(host, int(port))
                writer.close()
                return
            except OSError:
                if self.loop.time() > deadline:
                    raise TimeoutError from None
                await asyncio.sleep(0.01)

    async def _status(self, message):
        return self.pb.WorkerStatusResponse(devhost_figures=rpc.process_figures())

    # -- stopping

    async def _shutdown(self, channel) -> None:
        # Whatever hangs below, the process leaves within EXIT_BACKSTOP.
        timer = threading.Timer(EXIT_BACKSTOP, os._exit, (0,))
        timer.daemon = True
        timer.start()
        # Cancelling the worker's uvicorn makes it log a CancelledError traceback; it is ours.
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
        pending = [*self.server_tasks, *self.tasks]
        for task in pending:
            task.cancel()
        if self.outbox is not None:
            self.outbox.close()
        if pending:
            await asyncio.wait(pending, timeout=EXIT_BACKSTOP / 2)
        if self.call is not None:
            self.call.cancel()
        await channel.close(grace=None)


def _signals_as_on_azure() -> None:
    """The worker's HTTP server is a uvicorn.Server, which catches SIGINT and SIGTERM while it
    serves. SIGTERM it keeps, as in Azure's worker (see the module docstring); SIGINT stays ignored,
    or a Ctrl+C would stop that server alone and leave a worker that cannot take requests."""
    import uvicorn.server

    uvicorn.server.HANDLED_SIGNALS = (signal.SIGTERM,)


def _quiet_uvicorn_start() -> None:
    """The worker's HTTP server is uvicorn with its default logging config, which logs four INFO
    lines whenever it starts; start it at WARNING instead (the config's dict, edited in place, is
    what uvicorn.Config uses by default)."""
    from uvicorn.config import LOGGING_CONFIG

    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        LOGGING_CONFIG.get("loggers", {}).get(name, {})["level"] = "WARNING"


def _loop_factory(choice: str):
    if choice == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def parse_args(argv=None) -> argparse.Namespace:
    # The Functions host's argument names (camelCase) for the ones it passes; the rest are ours.
    p = argparse.ArgumentParser(prog="python -m tools.devhost.worker_process", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workerId", required=True)
    p.add_argument("--requestId", required=True)
    p.add_argument("--grpcMaxMessageLength", type=int, default=rpc.GRPC_MAX_MESSAGE)
    p.add_argument("--hostPid", type=int, default=None, help="exit when this process is gone (Linux)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    p.add_argument("--verbose", action="store_true")
    args, _unknown = p.parse_known_args(argv)  # the Functions host may pass more; none matter here
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    _die_with_parent(args.hostPid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logs.configure(args.verbose, worker=True)
    _signals_as_on_azure()
    if not args.verbose:
        _quiet_uvicorn_start()
    root = str(Path(__file__).resolve().parents[2])  # tools/devhost's package root stays importable
    if root not in sys.path:
        sys.path.insert(1, root)

    async def run() -> int:
        return await Dispatcher(args).run()

    try:
        return asyncio.run(run(), loop_factory=_loop_factory(args.loop))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
