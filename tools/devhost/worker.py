"""The host's side of its worker processes, as the Functions host runs the Python worker: a gRPC
server; each worker started as a process of its own (tools/devhost/worker_process.py) that connects
back and opens FunctionRpc.EventStream; then WorkerInitRequest (indexes function_app.py and starts
the worker's HTTP server), FunctionsMetadataRequest, FunctionLoadRequest per function, and one
InvocationRequest per HTTP request, while proxy.py forwards the HTTP request itself to that same
worker's HTTP server.

``FUNCTIONS_WORKER_PROCESS_COUNT`` workers (1-10) run side by side; each HTTP request goes to the
ready worker with the fewest requests in flight (round-robin among equals). A worker that exits is
logged, its in-flight invocations fail (their callers see the response end), and it is restarted
while the others keep serving.

Stopping, as on Azure (tools/devhost/README.md, "Stopping"): ``terminate()`` sends every worker
SIGTERM at once, as the platform's container stop does (the Functions host itself sends a Python
worker nothing: it declares no ``HandlesWorkerTerminateMessage``); the workers keep serving the
requests they have. ``stop()``, once the host's own requests are over, kills what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import grpc

from . import protos, rpc
from .forward import Forwarder

log = logging.getLogger("devhost")

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # where `python -m tools.devhost.worker_process` resolves
HOST_VERSION = "4.1040.0"
START_TIMEOUT = 90.0  # process start, imports, indexing, the worker's HTTP server (2 workers on a busy 2-core box)
# A worker still running when the host is done with its requests gets this long, then SIGKILL (the
# Functions host kills a Python worker as soon as its own shutdown is over: Process.Kill).
STOP_GRACE = 0.5
WAIT_FOR_WORKER = 15.0  # a request arriving while no worker is ready (all restarting) waits this long
STATUS_TIMEOUT = 2.0
RESTART_DELAYS = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # after exits in quick succession (crash loop)
STABLE_AFTER = 30.0  # a worker that ran this long resets the crash-loop backoff


class WorkerError(Exception):
    """A worker failed to start, or the runtime answered a request with a failure status."""


class WorkerGone(WorkerError):
    """The worker process exited (or its stream ended) before it answered."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "its gRPC stream ended"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class RpcServer:
    """The host's gRPC server on 127.0.0.1: each worker's EventStream is handed to the
    WorkerProcess that started it (matched by the worker id of its StartStream message)."""

    def __init__(self, pb):
        self.pb = pb
        self.port = 0
        self._expected: dict[str, WorkerProcess] = {}
        self._server = None

    async def start(self) -> None:
        pb = self.pb
        handler = grpc.method_handlers_generic_handler(
            rpc.service_name(pb),
            {
                "EventStream": grpc.stream_stream_rpc_method_handler(
                    self._event_stream,
                    request_deserializer=pb.StreamingMessage.FromString,
                    response_serializer=pb.StreamingMessage.SerializeToString,
                )
            },
        )
        self._server = grpc.aio.server(options=rpc.options())
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    def expect(self, worker: WorkerProcess) -> None:
        self._expected[worker.worker_id] = worker

    def forget(self, worker: WorkerProcess) -> None:
        self._expected.pop(worker.worker_id, None)

    async def _event_stream(self, request_iterator, context) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("content") != "start_stream":
            log.warning("a gRPC stream that does not start with StartStream was dropped")
            return
        worker = self._expected.pop(first.start_stream.worker_id, None)
        if worker is None:
            log.warning("a worker with an unknown id (%s) connected; dropped", first.start_stream.worker_id)
            return
        await worker.attach(context)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)


class WorkerProcess:
    """One worker process: its start and handshake, its stream, its invocations, its end."""

    _ids = itertools.count(1)

    def __init__(self, slot: int, app_dir: Path, server: RpcServer, *, loop: str = "asyncio", verbose: bool = False):
        self.slot = slot
        self.app_dir = app_dir
        self.server = server
        self.pb = server.pb
        self.loop_choice = loop
        self.verbose = verbose
        self.worker_id = str(uuid.uuid4())
        self.request_id = str(uuid.uuid4())
        self.proc: asyncio.subprocess.Process | None = None
        self.http_uri: str | None = None
        self.metadata: list = []
        self.forwarder: Forwarder | None = None
        self.ready = False
        self.in_flight = 0  # HTTP requests on this worker right now (kept by proxy.py)
        self.started_at = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._pending: dict[str, asyncio.Future] = {}
        self._connected = self._loop.create_future()
        self._outbox: rpc.Outbox | None = None
        self._stream_task: asyncio.Task | None = None
        self.exited: asyncio.Future = self._loop.create_future()  # result: the exit code
        self._stopping = False
        self._terminated = False  # SIGTERM sent (terminate): stop() does not send it again

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def name(self) -> str:
        return f"worker {self.slot + 1} (pid {self.pid})"

    # -- start

    async def start(self, timeout: float = START_TIMEOUT) -> None:  # noqa: ASYNC109 - a bound on the whole start, applied inside
        """Start the process and take it through init, metadata and load; raises WorkerError."""
        try:
            async with asyncio.timeout(timeout):
                await self._spawn()
                await self._handshake()
        except TimeoutError:
            await self.stop()
            raise WorkerError(f"{self.name} did not start within {timeout:g} s") from None
        except BaseException:
            await self.stop()
            raise
        self.ready = True

    async def _spawn(self) -> None:
        self.server.expect(self)
        args = [
            sys.executable,
            "-m",
            "tools.devhost.worker_process",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.server.port),
            "--workerId",
            self.worker_id,
            "--requestId",
            self.request_id,
            "--grpcMaxMessageLength",
            str(rpc.GRPC_MAX_MESSAGE),
            "--hostPid",
            str(os.getpid()),
            "--loop",
            self.loop_choice,
            *(["--verbose"] if self.verbose else []),
        ]
        # stdout joins the host's stderr: the host's stdout carries only its own "listening" line.
        self.proc = await asyncio.create_subprocess_exec(
            *args, cwd=PACKAGE_ROOT, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno()
        )
        self._watch_task = asyncio.ensure_future(self._watch_process())
        done, _ = await asyncio.wait({self._connected, self.exited}, return_when=asyncio.FIRST_COMPLETED)
        if self._connected not in done:
            raise WorkerError(f"{self.name} exited before connecting ({_describe_exit(self.exited.result())})")

    async def _handshake(self) -> None:
        pb = self.pb
        app = str(self.app_dir)
        init = (
            await self.request(
                worker_init_request=pb.WorkerInitRequest(
                    host_version=HOST_VERSION, function_app_directory=app, worker_directory=app
                )
            )
        ).worker_init_response
        self._check(init, "WorkerInitRequest (indexing function_app.py)")
        self.http_uri = init.capabilities.get("HttpUri")
        meta = (
            await self.request(functions_metadata_request=pb.FunctionsMetadataRequest(function_app_directory=app))
        ).function_metadata_response
        self._check(meta, "FunctionsMetadataRequest")
        self.metadata = list(meta.function_metadata_results)
        for fn in self.metadata:
            loaded = (
                await self.request(
                    function_load_request=pb.FunctionLoadRequest(function_id=fn.function_id, metadata=fn)
                )
            ).function_load_response
            self._check(loaded, f"FunctionLoadRequest({fn.name})")
        if self.metadata and not self.http_uri:
            raise WorkerError(
                "the worker did not start its HTTP server: HTTP streaming is not enabled "
                "(function_app.py must import azurefunctions.extensions.http.fastapi)"
            )
        if self.http_uri:
            uri = urlsplit(self.http_uri)
            self.forwarder = Forwarder(uri.hostname, uri.port)

    @staticmethod
    def _check(response, what: str):
        if response.result.status != response.result.Success:
            exc = response.result.exception
            raise WorkerError(f"{what} failed: {exc.message}\n{exc.stack_trace}".rstrip())
        return response

    # -- the stream (runs inside the gRPC server's handler for this worker)

    async def attach(self, context) -> None:
        self._outbox = rpc.Outbox(context.write)
        self._outbox.start()
        self._stream_task = asyncio.current_task()
        if not self._connected.done():
            self._connected.set_result(None)
        eof = grpc.aio.EOF
        try:
            while True:
                message = await context.read()
                if message is eof:
                    break
                self._on_message(message)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            self._outbox.close()
            self._fail_pending(WorkerGone(f"{self.name}: {_describe_exit(self._exit_code())}"))
            if not self._stopping and self.proc is not None and self.proc.returncode is None:
                # A worker without its stream is of no use: end it (the watcher reports the exit).
                log.error("%s: its gRPC stream ended; stopping it", self.name)
                self._kill()

    def _on_message(self, message) -> None:
        if message.WhichOneof("content") == "invocation_response":
            response = message.invocation_response
            future = self._pending.pop(response.invocation_id, None)
        else:
            response = message
            future = self._pending.pop(message.request_id, None)
        if future is not None and not future.done():
            future.set_result(response)

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    # -- requests

    def _send(self, key: str, message) -> asyncio.Future:
        if self._outbox is None or self.exited.done():
            raise WorkerGone(f"{self.name} is not running")
        future = self._loop.create_future()
        self._pending[key] = future
        self._outbox.put(message)
        return future

    async def request(self, **content):
        """Send one message; its response (our worker answers with the same request_id)."""
        request_id = str(uuid.uuid4())
        future = self._send(request_id, self.pb.StreamingMessage(request_id=request_id, **content))
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)

    def invoke(
        self,
        invocation_id: str,
        function_id: str,
        trigger_param: str,
        *,
        method: str,
        url: str,
        headers: dict[str, str],
        query: dict[str, str],
        params: dict[str, str],
    ) -> asyncio.Future:
        """Queue the InvocationRequest that matches a forwarded HTTP request, at once (not in a task
        step later: the gRPC hop is the slower of the two); the future gives the InvocationResponse
        (for a streamed response: once the function has returned it), or WorkerGone."""
        pb = self.pb
        http = pb.RpcHttp(
            method=method, url=url, headers=headers, query=query, params=params, body=pb.TypedData(bytes=b"")
        )
        request = pb.InvocationRequest(
            invocation_id=invocation_id,
            function_id=function_id,
            input_data=[pb.ParameterBinding(name=trigger_param, data=pb.TypedData(http=http))],
        )
        try:
            return self._send(invocation_id, pb.StreamingMessage(request_id=invocation_id, invocation_request=request))
        except WorkerGone as exc:
            future = self._loop.create_future()
            future.set_exception(exc)
            return future

    def cancel(self, invocation_id: str) -> None:
        """InvocationCancel for an invocation still pending (its worker answers ``Cancelled`` when it
        still waits for its HTTP request; worker_process.py)."""
        future = self._pending.get(invocation_id)
        if future is None or future.done() or self._outbox is None or self.exited.done():
            return
        pb = self.pb
        self._outbox.put(pb.StreamingMessage(invocation_cancel=pb.InvocationCancel(invocation_id=invocation_id)))

    async def status(self) -> dict:
        response = await asyncio.wait_for(
            self.request(worker_status_request=self.pb.WorkerStatusRequest()), STATUS_TIMEOUT
        )
        return dict(response.worker_status_response.devhost_figures)

    # -- the end

    def _exit_code(self) -> int | None:
        return self.proc.returncode if self.proc else None

    async def _watch_process(self) -> None:
        code = await self.proc.wait()
        self.ready = False
        self.server.forget(self)
        if self.forwarder is not None:
            self.forwarder.close()
        self._fail_pending(WorkerGone(f"{self.name}: {_describe_exit(code)}"))
        if self._stream_task is not None and not self._stream_task.done():
            self._stream_task.cancel()
        if not self.exited.done():
            self.exited.set_result(code)

    def _kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM now; the worker takes no new request from the host, and its exit is expected."""
        self._stopping = True
        self.ready = False
        self.server.forget(self)
        if not self._terminated:
            self._terminated = True
            self._kill(signal.SIGTERM)

    async def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM (unless ``terminate`` sent it), then SIGKILL after ``grace``; returns once the
        process is gone."""
        self._stopping = True
        self.ready = False
        self.server.forget(self)
        if self.proc is None:
            return
        if self.proc.returncode is None:
            if not self._terminated:
                self._kill(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), grace)
            except TimeoutError:
                self._kill(signal.SIGKILL)
        await asyncio.shield(self.exited)


class WorkerPool:
    """``count`` worker processes behind one host; see the module docstring."""

    def __init__(self, app_dir: Path, count: int = 1, *, loop: str = "asyncio", verbose: bool = False):
        self.app_dir = app_dir
        self.count = count
        self.loop_choice = loop
        self.verbose = verbose
        self.pb = protos.load()
        self.server = RpcServer(self.pb)
        self.workers: list[WorkerProcess | None] = [None] * count
        self.metadata: list = []
        self.restarts = 0
        self._stopping = False
        self._ready = asyncio.Event()
        self._rr = 0
        self._tasks: set[asyncio.Task] = set()
        self._crashes: list[int] = [0] * count

    def _new(self, slot: int) -> WorkerProcess:
        return WorkerProcess(slot, self.app_dir, self.server, loop=self.loop_choice, verbose=self.verbose)

    async def start(self) -> None:
        """The gRPC server, then every worker (concurrently); raises WorkerError if any fails."""
        await self.server.start()
        workers = [self._new(slot) for slot in range(self.count)]
        results = await asyncio.gather(*(w.start() for w in workers), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
            for r in failed:
                if not isinstance(r, WorkerError):
                    raise r
            raise failed[0]
        self.metadata = workers[0].metadata
        ids = [(fn.name, fn.function_id) for fn in self.metadata]
        for w in workers[1:]:
            if [(fn.name, fn.function_id) for fn in w.metadata] != ids:
                await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
                raise WorkerError(f"{w.name} indexed different functions than worker 1")
        for w in workers:
            self._adopt(w)
        log.info(
            "%d worker process%s ready: %s",
            self.count,
            "" if self.count == 1 else "es",
            ", ".join(f"pid {w.pid} ({w.http_uri})" for w in workers),
        )

    def _adopt(self, worker: WorkerProcess) -> None:
        self.workers[worker.slot] = worker
        worker.exited.add_done_callback(lambda _: self._on_exit(worker))
        self._ready.set()

    def _spawn_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_exit(self, worker: WorkerProcess) -> None:
        if self._stopping or worker._stopping:
            return
        lived = time.monotonic() - worker.started_at
        self._crashes[worker.slot] = 0 if lived > STABLE_AFTER else self._crashes[worker.slot] + 1
        log.error(
            "%s exited (%s) after %.1f s; the requests it was serving have ended; restarting it",
            worker.name,
            _describe_exit(worker.exited.result()),
            lived,
        )
        if not any(w is not None and w.ready for w in self.workers):
            self._ready.clear()
        self._spawn_task(self._restart(worker.slot))

    async def _restart(self, slot: int) -> None:
        while not self._stopping:
            # The first restart is immediate; a worker that keeps exiting soon after starting waits longer each time.
            delay = RESTART_DELAYS[min(max(self._crashes[slot] - 1, 0), len(RESTART_DELAYS) - 1)]
            if delay:
                log.warning(
                    "worker %d: waiting %.1f s before restarting it (it exited again soon after starting)",
                    slot + 1,
                    delay,
                )
                await asyncio.sleep(delay)
            if self._stopping:
                return
            worker = self._new(slot)
            self.workers[slot] = worker
            try:
                await worker.start()
            except WorkerError as exc:
                self._crashes[slot] += 1
                log.error("worker %d failed to restart: %s", slot + 1, exc)
                continue
            if self._stopping:
                await worker.stop()
                return
            self.restarts += 1
            self._adopt(worker)
            log.info("%s restarted; serving", worker.name)
            return

    # -- serving

    def ready_workers(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w is not None and w.ready]

    def pick(self) -> WorkerProcess | None:
        """The ready worker with the fewest requests in flight; round-robin among equals."""
        ready = self.ready_workers()
        if not ready:
            return None
        if len(ready) == 1:
            return ready[0]
        least = min(w.in_flight for w in ready)
        tied = [w for w in ready if w.in_flight == least]
        self._rr += 1
        return tied[self._rr % len(tied)]

    async def acquire(self, timeout: float = WAIT_FOR_WORKER) -> WorkerProcess | None:  # noqa: ASYNC109 - a wait bound, applied inside
        """A ready worker, waiting up to ``timeout`` while none is (a restart in progress)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            worker = self.pick()
            remaining = deadline - loop.time()
            if worker is not None or self._stopping or remaining <= 0:
                return worker
            self._ready.clear()  # set again by the next worker that becomes ready
            try:
                await asyncio.wait_for(self._ready.wait(), remaining)
            except TimeoutError:
                return self.pick()

    async def stats(self) -> dict:
        """The host's and every worker's figures, and their sums (tasks, open_fds, rss_kb)."""
        host = rpc.process_figures()
        ready = self.ready_workers()
        answers = await asyncio.gather(*(w.status() for w in ready), return_exceptions=True)
        workers = []
        for w, answer in zip(ready, answers):
            figures = answer if isinstance(answer, dict) else {"pid": w.pid, "error": repr(answer)}
            figures.update(slot=w.slot + 1, in_flight=w.in_flight, http_uri=w.http_uri)
            workers.append(figures)
        total = lambda key: host[key] + sum(w.get(key, 0) for w in workers)  # noqa: E731 - a one-line helper, read where it is used
        forwarders = [w.forwarder for w in ready if w.forwarder is not None]
        return {
            "tasks": total("tasks"),
            "open_fds": total("open_fds"),
            "rss_kb": total("rss_kb"),
            "host": host,
            "workers": workers,
            "worker_restarts": self.restarts,
            "idle_worker_connections": sum(len(f._idle) for f in forwarders),
            "worker_connections_opened": sum(f.opened for f in forwarders),
        }

    # -- the end

    def terminate(self) -> None:
        """SIGTERM to every worker process at once, and no restart from here on."""
        self._stopping = True
        self._ready.set()  # wake requests waiting for a worker: there will be none
        for task in list(self._tasks):
            task.cancel()
        for w in self.workers:
            if w is not None:
                w.terminate()

    async def stop(self) -> None:
        """Every worker gone (SIGTERM unless terminate() sent it, SIGKILL after STOP_GRACE), then the
        gRPC server."""
        self._stopping = True
        self._ready.set()  # wake requests waiting for a worker: there will be none
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(w.stop() for w in self.workers if w is not None), *self._tasks, return_exceptions=True)
        await self.server.stop()
