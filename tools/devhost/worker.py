"""Drives azure-functions-runtime in this process, the way the Functions host drives a worker over
gRPC: WorkerInitRequest (indexes function_app.py and, with streaming enabled, starts the worker's
own HTTP server), FunctionsMetadataRequest, FunctionLoadRequest per function, then one
InvocationRequest per HTTP request."""
from __future__ import annotations

import asyncio
import logging
import sys
import types
import uuid
from pathlib import Path

from . import protos


class WorkerError(Exception):
    """The runtime answered a request with a failure status."""


class Worker:
    def __init__(self, app_dir: Path, host: str = "127.0.0.1"):
        self.app_dir = app_dir
        self.host = host
        self.pb = protos.load()
        self.http_uri: str | None = None
        self.metadata: list = []
        self._server_tasks: set[asyncio.Task] = set()

    def _message(self, **content):
        request = self.pb.StreamingMessage(request_id=str(uuid.uuid4()), **content)
        return types.SimpleNamespace(request=request, properties={"host": self.host, "protos": self.pb})

    @staticmethod
    def _check(response, what: str):
        if response.result.status != response.result.Success:
            exc = response.result.exception
            raise WorkerError(f"{what} failed: {exc.message}\n{exc.stack_trace}".rstrip())
        return response

    async def init(self) -> None:
        """WorkerInitRequest: index function_app.py and start the worker's HTTP server."""
        import azure_functions_runtime as runtime

        # The real worker runs with the app folder as cwd and first on sys.path.
        app = str(self.app_dir)
        if app not in sys.path:
            sys.path.insert(0, app)
        before = asyncio.all_tasks()
        init = await runtime.worker_init_request(self._message(
            worker_init_request=self.pb.WorkerInitRequest(
                host_version="4.1040.0", function_app_directory=app, worker_directory=app)))
        # worker_init_request starts the worker's HTTP server as a task on this loop; keep hold of
        # it so that stopping the host stops that server too.
        self._server_tasks = asyncio.all_tasks() - before
        self._check(init, "WorkerInitRequest (indexing function_app.py)")
        self.http_uri = init.capabilities.get("HttpUri")

    async def load(self) -> None:
        """FunctionsMetadataRequest and a FunctionLoadRequest per function; wait for the server."""
        import azure_functions_runtime as runtime

        app = str(self.app_dir)
        meta = self._check(await runtime.functions_metadata_request(self._message(
            functions_metadata_request=self.pb.FunctionsMetadataRequest(function_app_directory=app))),
            "FunctionsMetadataRequest")
        self.metadata = list(meta.function_metadata_results)
        for fn in self.metadata:
            self._check(await runtime.function_load_request(self._message(
                function_load_request=self.pb.FunctionLoadRequest(function_id=fn.function_id, metadata=fn))),
                f"FunctionLoadRequest({fn.name})")
        if self.metadata and not self.http_uri:
            raise WorkerError(
                "the worker did not start its HTTP server: HTTP streaming is not enabled "
                "(function_app.py must import azurefunctions.extensions.http.fastapi)")
        if self.http_uri:
            await self._wait_listening(self.http_uri)

    async def _wait_listening(self, uri: str, timeout: float = 15.0) -> None:
        host, port = uri.rsplit("//", 1)[1].rsplit(":", 1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                _, writer = await asyncio.open_connection(host, int(port))
                writer.close()
                return
            except OSError:
                if loop.time() > deadline:
                    raise WorkerError(f"the worker's HTTP server at {uri} did not start") from None
                await asyncio.sleep(0.02)

    async def invoke(self, invocation_id: str, function_id: str, trigger_param: str, *, method: str,
                     url: str, headers: dict[str, str], query: dict[str, str], params: dict[str, str]):
        """Send the InvocationRequest that matches a forwarded HTTP request; returns the response."""
        import azure_functions_runtime as runtime

        pb = self.pb
        http = pb.RpcHttp(method=method, url=url, headers=headers, query=query, params=params,
                          body=pb.TypedData(bytes=b""))
        request = pb.InvocationRequest(
            invocation_id=invocation_id, function_id=function_id,
            input_data=[pb.ParameterBinding(name=trigger_param, data=pb.TypedData(http=http))])
        return await runtime.invocation_request(self._message(invocation_request=request))

    async def stop(self) -> None:
        # Cancelling the worker's uvicorn makes it log a CancelledError traceback; it is ours.
        logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
        for task in self._server_tasks:
            task.cancel()
        await asyncio.gather(*self._server_tasks, return_exceptions=True)
