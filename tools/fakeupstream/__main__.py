"""python -m tools.fakeupstream [--port 0] [--scenario echo] [--first-token-ms 100 --interval-ms 20 --deltas 40]
[--delta-chars 0] [--no-responses]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys

import uvicorn

from .keepalive import protocol
from .scenarios import NAMES, Cadence
from .server import create_app

HOST = "127.0.0.1"


class _Server(uvicorn.Server):
    """Prints the ready line once the listening socket is served."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            port = sockets[0].getsockname()[1]
            print(f"fakeupstream listening on http://{HOST}:{port}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.fakeupstream", description="Scripted OpenAI-compatible server.")
    p.add_argument("--host", default=HOST, help="only 127.0.0.1 is accepted")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    p.add_argument("--scenario", default="echo", choices=NAMES, help="default scenario (default: echo)")
    p.add_argument("--first-token-ms", type=float, default=100, help="cadence: first content delta after")
    p.add_argument("--interval-ms", type=float, default=20, help="cadence: between deltas")
    p.add_argument("--deltas", type=int, default=40, help="cadence: number of content deltas")
    p.add_argument("--delta-chars", type=int, default=0, help="cadence: each delta this many characters (0: words)")
    p.add_argument("--max-records", type=int, default=10_000, help="requests/streams kept for /_scripted/")
    p.add_argument(
        "--no-responses",
        action="store_true",
        help="answer /v1/responses with 404, like a server without the Responses API",
    )
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if args.host != HOST:
        p.error(f"refusing to bind {args.host!r}: fakeupstream binds {HOST} only")

    # Streams still open at shutdown are cancelled after 0.3 s: that is expected, not worth a traceback.
    logging.getLogger("uvicorn.error").addFilter(
        lambda r: not (r.exc_info and isinstance(r.exc_info[1], asyncio.CancelledError))
    )
    app = create_app(
        args.scenario,
        Cadence(args.first_token_ms, args.interval_ms, args.deltas, args.delta_chars),
        args.max_records,
        responses=not args.no_responses,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, args.port))
    except OSError as e:
        p.error(f"cannot bind {HOST}:{args.port}: {e}")
    config = uvicorn.Config(
        app,
        http=protocol(app.stale),  # uvicorn's own, and /_scripted/stale
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        backlog=4096,
        timeout_graceful_shutdown=0.3,
    )
    with contextlib.suppress(KeyboardInterrupt):
        _Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
