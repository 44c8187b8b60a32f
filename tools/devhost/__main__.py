"""Local Functions host for machines without Core Tools: ``python -m tools.devhost [--port 7071] [APP_DIR]``.

Loads function_app.py through the real Python worker (azure-functions-runtime) in worker processes
of its own (FUNCTIONS_WORKER_PROCESS_COUNT, default 1) driven over gRPC like the Functions host
does, serves every HTTP function under host.json's route prefix on 127.0.0.1, and stops on Ctrl+C
or SIGTERM as the Functions host does on Azure: no new connection, the requests in flight get up to
ASPNETCORE_SHUTDOWNTIMEOUTSECONDS (5 s) and the workers SIGTERM at once, then what is left is cut.
A dev tool: excluded from deployment by .funcignore.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import uvicorn

from . import config, logs
from .front import protocol_class
from .proxy import Host
from .routes import routes_from_metadata
from .worker import WorkerError, WorkerPool

log = logging.getLogger("devhost")


class _FrontServer(uvicorn.Server):
    # The host owns signal handling (see serve()); uvicorn must not install its own handlers.
    @contextlib.contextmanager
    def capture_signals(self):
        yield


_configure_logging = logs.configure


async def serve(
    app_dir: Path,
    host: str,
    port: int,
    verbose: bool,
    workers: int = 1,
    loop_choice: str = "asyncio",
    front: config.FrontSettings = config.FrontSettings(),
    shutdown_timeout: float = config.DEFAULT_SHUTDOWN_TIMEOUT,
) -> int:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    server: _FrontServer | None = None
    pool = WorkerPool(app_dir, workers, loop=loop_choice, verbose=verbose)
    pool_stop: asyncio.Future | None = None

    def stop_pool() -> asyncio.Future:
        nonlocal pool_stop
        if pool_stop is None:
            pool_stop = asyncio.ensure_future(pool.stop())
        return pool_stop

    def on_signal(signum: int) -> None:
        if stopping.is_set():  # a second Ctrl+C: leave now
            os._exit(130)
        stopping.set()
        if server is None:  # still starting: nothing is served yet
            log.info("%s received, stopping", signal.Signals(signum).name)
            stop_pool()
            return
        # As the Functions host on Azure (README.md, "Stopping"): the front server stops listening at
        # once and lets the requests in flight run for the shutdown timeout, then cuts what is left
        # (uvicorn's graceful shutdown, timeout_graceful_shutdown below); the workers get SIGTERM now,
        # as the platform's container stop sends it, and are killed once the front server is done.
        log.info(
            "%s received: no new connections; requests in flight: %d, cut after %g s (%s); workers: SIGTERM",
            signal.Signals(signum).name,
            app.in_flight if app is not None else 0,
            shutdown_timeout,
            config.SHUTDOWN_TIMEOUT,
        )
        server.should_exit = True
        pool.terminate()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    app: Host | None = None
    starting = asyncio.ensure_future(pool.start())
    interrupted = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({starting, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    interrupted.cancel()
    if not starting.done():  # stopped while the workers were starting
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await stop_pool()
        return 0
    try:
        starting.result()
    except WorkerError as exc:
        log.error("The function app failed to load.\n%s", exc)
        await stop_pool()
        return 1

    prefix = config.route_prefix(app_dir)
    routes = routes_from_metadata(pool.metadata, prefix)
    app = Host(pool, routes, front.cors)
    logs.quiet_cut_requests()  # the shutdown timeout's cut is logged by the host, once per request
    # The front server's limits live in its protocol (front.py); ws="none": WebSocket upgrades are
    # declined and answered as plain HTTP requests.
    server = _FrontServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            server_header=False,
            date_header=False,
            lifespan="off",
            timeout_graceful_shutdown=shutdown_timeout,
            http=protocol_class(front),
            ws="none",
            timeout_keep_alive=front.keepalive_timeout,
        )
    )

    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():  # noqa: ASYNC110 - uvicorn says started by a flag, not an event
        await asyncio.sleep(0.01)
    if serving.done():
        await stop_pool()
        return 1
    bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
    for route in routes:
        methods = ",".join(sorted(route.methods)) or "ANY"
        print(
            f"  {route.name}: [{methods}] http://{host}:{bound}/{prefix + '/' if prefix else ''}{route.template}",
            file=sys.stderr,
        )
    if front.cors.any_origin or front.cors.origins:
        print(f"  CORS: browser pages from {front.cors.describe()} may call this host", file=sys.stderr)
    print(f"devhost listening on http://{host}:{bound}", flush=True)
    try:
        await serving
    finally:
        await app.aclose()
        await stop_pool()
    return 0


def _loop_factory(choice: str):
    """The host's loop (the workers get the same choice). uvloop (from uvicorn[standard]) cut
    about 1 ms off a single request's time to first delta here, but cost 50% more CPU per delta at
    1,000 concurrent streams (docs/benchmarks.md), so asyncio's own loop is the default."""
    if choice == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.devhost", description=__doc__.split("\n\n")[0])
    parser.add_argument("app_dir", nargs="?", default=".", help="folder holding function_app.py (default: .)")
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("PORT") or 7071),
        help="port on 127.0.0.1 (default: $PORT or 7071; 0 picks a free one)",
    )
    parser.add_argument("--verbose", action="store_true", help="also show the runtime's own logs")
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="event loop: asyncio's own (the default, as the Azure worker), or uvloop",
    )
    parser.add_argument(
        "--cors",
        metavar="ORIGINS",
        help="browser origins allowed to call the host besides its own, comma-separated, * for "
        "any (like func start --cors; default: $CORS_ALLOWED_ORIGINS, else "
        "local.settings.json Host.CORS, else none)",
    )
    limits = parser.add_argument_group("limits of the front server (environment variable in brackets)")
    limits.add_argument(
        "--max-header-bytes",
        type=int,
        metavar="N",
        help="largest request line + headers, else 431 [DEVHOST_MAX_HEADER_BYTES] (65536)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        metavar="S",
        help="seconds for a request's headers, else 408 [DEVHOST_HEADER_TIMEOUT_SECONDS] (10)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        metavar="S",
        help="seconds for its body after the headers, else 408 [DEVHOST_BODY_TIMEOUT_SECONDS] (15)",
    )
    limits.add_argument(
        "--keepalive-timeout",
        type=float,
        metavar="S",
        help="idle seconds before a connection is closed [DEVHOST_KEEPALIVE_TIMEOUT_SECONDS] (15)",
    )
    args = parser.parse_args(argv)
    app_dir = Path(args.app_dir).resolve()
    _configure_logging(args.verbose)
    if not (app_dir / "function_app.py").exists():
        log.error("no function_app.py in %s", app_dir)
        return 2
    try:
        applied = config.apply_local_settings(app_dir)  # so Values may hold these settings too
        front = config.front_settings(
            max_header_bytes=args.max_header_bytes,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            keepalive_timeout=args.keepalive_timeout,
        )
        front = config.with_cors(front, app_dir, args.cors)
        config.route_prefix(app_dir)
        workers = config.worker_process_count()
        shutdown_timeout = config.shutdown_timeout()
    except config.ConfigError as exc:
        log.error("%s", exc)
        return 2
    if applied:
        log.info("local.settings.json: applied %s", ", ".join(sorted(applied)))
    os.chdir(app_dir)
    try:
        return asyncio.run(
            serve(app_dir, "127.0.0.1", args.port, args.verbose, workers, args.loop, front, shutdown_timeout),
            loop_factory=_loop_factory(args.loop),
        )
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
