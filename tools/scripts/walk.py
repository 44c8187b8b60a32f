"""Follow one request through chatstream/ as a reader would, and count the modules it enters.

    .venv/bin/python tools/scripts/walk.py [chat|openai|responses] [--keyed] [--resumable] [--trace]

The request is served in-process by the app's own handler (create_app) against the scripted
upstream (started here), streamed to its end. Every function of chatstream/ it runs is placed under
the function it was first called from, so each is read once, where a reader following the calls
meets it; the walk reads that tree depth first. A *move* is a step from one module to another, into
a function or back out of it; a move into a module entered before is a *return*. Prints the modules
in the order first entered, the moves and the returns (``--trace``: every move). ``--keyed``:
with ``CALLER_KEYS=required`` and a caller with a token budget; ``--resumable``: with
``RESUMABLE_STREAMS=on``; both on a real Azurite started here."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from chatstream.state.callers import CallerSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PACKAGE = str(ROOT / "chatstream") + "/"
BODIES = {
    "chat": ("/api/chat", {"prompt": "[scenario:echo] hi"}),
    "openai": (
        "/api/v1/chat/completions",
        {"model": "gpt-test", "stream": True, "messages": [{"role": "user", "content": "[scenario:echo] hi"}]},
    ),
    "responses": ("/api/v1/responses", {"model": "gpt-test", "stream": True, "input": "[scenario:echo] hi"}),
}


class Walk:
    """Records, for every function of chatstream/ the request calls, the function it was first called
    from (the caller on the stack; for the first step of a task, the function last running), and
    reads the resulting tree depth first."""

    def __init__(self) -> None:
        self.children: dict[object, list[object]] = {None: []}
        self.module: dict[object, str] = {}
        self.stack: list[tuple[object, object | None]] = []  # (frame, its code if in chatstream/)
        self.last: object | None = None  # the chatstream function that ran last

    def profile(self, frame, event, arg) -> None:
        # A coroutine or generator resumed is a "call", suspended a "return": each task step runs to its
        # next suspension before another starts, so the frames nest. Frames already running when the
        # walk began return without a call: those are ignored.
        if event == "return":
            if self.stack and self.stack[-1][0] is frame:
                self.stack.pop()
            return
        if event != "call":
            return
        code = frame.f_code
        mine = code if code.co_filename.startswith(PACKAGE) else None
        if mine is not None and mine not in self.module:
            self.module[mine] = code.co_filename[len(PACKAGE) :]
            caller = next((c for _, c in reversed(self.stack) if c is not None), self.last)
            self.children.setdefault(caller, []).append(mine)
            self.children[mine] = []
        if mine is not None:
            self.last = mine
        self.stack.append((frame, mine))

    def read(self) -> tuple[list[str], list[tuple[str, str, bool]]]:
        """The modules in the order first entered, and every move between modules of a depth-first
        reading: into each function from its caller, and back."""
        visited: list[str] = []
        moves: list[tuple[str, str, bool]] = []

        def move(a: str | None, b: str) -> None:
            if a is not None and a != b:
                moves.append((a, b, b in visited))
            if b not in visited:
                visited.append(b)

        def visit(code: object, here: str | None) -> None:
            module = self.module[code]
            move(here, module)
            for child in self.children.get(code, []):
                visit(child, module)
                move(self.module[child], module) if self.module[child] != module else None

        for top in self.children[None]:
            visit(top, None)
        return visited, moves


async def serve(
    kind: str, upstream_url: str, store: str | None = None, keyed: bool = False, resumable: bool = False
) -> Walk:
    import httpx
    from starlette.applications import Starlette
    from starlette.routing import Route

    from chatstream.app import create_app
    from chatstream.settings import Settings

    environ = {
        "OPENAI_BASE_URL": upstream_url,
        "OPENAI_API_KEY": "sk-walk",
        "OPENAI_MODEL": "gpt-test",
        "UPSTREAM_MAX_RETRIES": "0",
    }
    if store is not None:
        environ["AzureWebJobsStorage"] = store
    if keyed:
        environ["CALLER_KEYS"] = "required"
    if resumable:
        environ["RESUMABLE_STREAMS"] = "on"
    app = create_app(Settings.from_env(environ), environ=environ)
    handlers = {"chat": app.chat, "openai": app.chat_completions, "responses": app.responses}
    path, body = BODIES[kind]
    headers = {}
    if keyed:
        assert app.state is not None
        _, key = await app.state.registry.create(
            CallerSpec(name="walk", token_budget=10_000_000, budget_period="month")
        )
        headers = {"Authorization": f"Bearer {key}"}

    async def handler(request):
        return await handlers[kind](request)

    api = Starlette(routes=[Route(path, handler, methods=["POST"])])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(api), base_url="http://walk", headers=headers) as client:
        await client.post(path, json=body)  # warm-up: imports, clients, connections
        walk = Walk()
        sys.setprofile(walk.profile)
        try:
            async with client.stream("POST", path, json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
        finally:
            sys.setprofile(None)
    return walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", nargs="?", default="openai", choices=sorted(BODIES))
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--keyed", action="store_true")
    parser.add_argument("--resumable", action="store_true")
    args = parser.parse_args()
    from servers import Azurite, Upstream

    upstream = Upstream()
    azurite = Azurite() if args.keyed or args.resumable else None
    try:
        store = azurite.connection_string if azurite is not None else None
        walk = asyncio.run(serve(args.kind, upstream.base_url, store, args.keyed, args.resumable))
    finally:
        upstream.stop()
        if azurite is not None:
            azurite.stop()
    visited, moves = walk.read()
    returns = sum(1 for *_, back in moves if back)
    if args.trace:
        for a, b, back in moves:
            print(f"  {a} -> {b}{'  (return)' if back else ''}")
    print(
        json.dumps(
            {"request": args.kind, "modules": len(visited), "moves": len(moves), "returns": returns, "order": visited}
        )
    )


if __name__ == "__main__":
    main()
