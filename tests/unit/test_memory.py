"""chatstream/memory.py: big answers' memory goes back to the OS; and http.JsonAnswer, which tells it
when a non-streamed answer is over and writes a big one in pieces the server takes one at a time."""

from __future__ import annotations

import asyncio
import json

import pytest

from chatstream import http, memory
from chatstream.memory import Trimmer


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, pad: int) -> int:
        assert pad == 0
        self.calls += 1
        return 1


def test_this_c_library_has_malloc_trim():
    assert memory._trimmer._trim is not None  # glibc, as on Azure's Linux images


def test_answers_that_add_up_to_the_threshold_share_one_trim_after_the_delay():
    async def trimmed(trim: Counting, calls: int) -> None:  # bounded: a busy machine runs timers late
        for _ in range(500):
            if trim.calls >= calls:
                break
            await asyncio.sleep(0.01)
        assert trim.calls == calls

    async def run():
        trim = Counting()
        trimmer = Trimmer(trim, after=1000, delay=0.5)
        trimmer.released(600)
        assert trim.calls == 0 and trimmer.pending == 600  # not enough yet
        trimmer.released(600)  # 1,200: one trim, 0.5 s later
        trimmer.released(5000)  # ends meanwhile: the same trim
        await asyncio.sleep(0)
        assert trim.calls == 0
        await trimmed(trim, 1)
        assert trimmer.pending == 0
        await asyncio.sleep(0.6)
        assert trim.calls == 1  # one trim for the three
        trimmer.released(1000)  # the next big one: its own trim
        await trimmed(trim, 2)

    asyncio.run(run())


def test_without_malloc_trim_nothing_is_done():
    trimmer = Trimmer(None, after=1)
    trimmer.released(10**9)
    assert trimmer.pending == 0, "nothing is counted, so no trim is scheduled"
    trimmer.trim()  # a direct call does nothing either


class Server:
    """An ASGI server's side of one response: what was sent; each write waits ``pause`` (a full buffer)."""

    def __init__(self, pause: float = 0.0, hang_up_after: int | None = None):
        self.messages: list[dict] = []
        self.pause = pause
        self.hang_up_after = hang_up_after

    async def send(self, message: dict) -> None:
        if self.hang_up_after is not None and len(self.messages) >= self.hang_up_after:
            raise OSError("the caller hung up")
        await asyncio.sleep(self.pause)
        self.messages.append(message)

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {}


SCOPE = {"type": "http", "method": "POST", "path": "/", "headers": []}


def answer(chars: int, give_up_in: float = 60.0) -> http.JsonAnswer:
    body = {"id": "x", "choices": [{"message": {"content": "é" * chars}}]}  # made on the running loop
    return http.JsonAnswer(body, asyncio.get_running_loop().time() + give_up_in, headers={"x-request-id": "r"})


def written(response: http.JsonAnswer) -> tuple[dict, list[dict]]:
    async def run():
        server = Server()
        await response(SCOPE, server.receive, server.send)
        return server.messages

    start, *bodies = asyncio.run(run())
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    return dict(start["headers"]), bodies


BIG = {
    "id": "x",
    "choices": [
        {"index": 0, "message": {"content": 'é🙂"\n\u0001' * 40_000, "tool_calls": [{"arguments": "{}" * 50_000}]}},
        {"index": 1, "message": {"content": "short", "refusal": None}},
    ],
    "usage": {"total_tokens": 3},
}


def test_a_big_answer_is_the_json_jsonresponse_writes_in_slices_with_its_length_then_is_released(monkeypatch):
    released: list[int] = []
    monkeypatch.setattr(memory, "released", released.append)

    async def make():
        return http.JsonAnswer(BIG, asyncio.get_running_loop().time() + 60, headers={"x-request-id": "r"})

    response = asyncio.run(make())
    headers, bodies = written(response)
    whole = b"".join(m["body"] for m in bodies)
    assert whole == json.dumps(BIG, ensure_ascii=False, separators=(",", ":")).encode()  # byte for byte
    assert int(headers[b"content-length"]) == len(whole) == response.length
    assert headers[b"content-type"] == b"application/json" and headers[b"x-request-id"] == b"r"
    assert all(len(m["body"]) <= http.SLICE_BYTES for m in bodies) and len(bodies) > 5
    assert released == [len(whole)]


def test_a_small_answer_is_one_write():
    async def make():
        return http.JsonAnswer({"a": "b"}, asyncio.get_running_loop().time() + 60)

    _, bodies = written(asyncio.run(make()))
    assert bodies == [{"type": "http.response.body", "body": b'{"a":"b"}', "more_body": False}]


def test_lone_surrogates_are_escaped_and_nan_is_refused_as_jsonresponse_refuses_it():
    async def make(body):
        return http.JsonAnswer(body, asyncio.get_running_loop().time() + 60)

    body = {"short": "a\ud800", "long": "b\udc00" * 70_000}
    _, bodies = written(asyncio.run(make(body)))
    assert json.loads(b"".join(m["body"] for m in bodies)) == body
    with pytest.raises(ValueError):
        asyncio.run(make({"n": float("nan"), "long": "x" * 70_000}))


def test_an_answer_is_released_when_its_caller_hangs_up(monkeypatch):
    released: list[int] = []
    monkeypatch.setattr(memory, "released", released.append)

    async def run():
        response = answer(200_000)
        server = Server(hang_up_after=3)
        with pytest.raises(OSError):
            await response(SCOPE, server.receive, server.send)
        return response

    response = asyncio.run(run())
    assert released == [response.length]


def test_a_caller_who_stops_reading_holds_the_answer_until_the_total_limit_and_the_grace(monkeypatch):
    released: list[int] = []
    monkeypatch.setattr(memory, "released", released.append)
    monkeypatch.setattr(http, "WRITE_GRACE_SECONDS", 0.05)

    async def run():
        response = answer(200_000, give_up_in=0.05)
        server = Server(pause=3600)  # never takes a piece
        loop = asyncio.get_running_loop()
        started = loop.time()
        await response(SCOPE, server.receive, server.send)
        return loop.time() - started

    assert asyncio.run(run()) < 2
    assert len(released) == 1


def test_the_tokenizers_data_is_given_back_once_built():
    """The data an encoding is built from (compiled into bpe-openai's extension, ~32 MB for
    o200k_base) leaves the resident memory once the tokenizer is built; counting goes on exactly."""
    import subprocess
    import sys

    probe = (
        "import os; from chatstream import memory, tokens\n"
        "tokens.preload()\n"
        "assert tokens.count_text('gpt-4o', 'tiktoken is great!') == 6\n"
        "assert tokens.count_text('gpt-4', 'tiktoken is great!') == 6\n"
        "path = os.path.realpath(tokens._bindings().__file__)\n"
        "print(sum(m[1] - m[0] for m in memory._read_only_mappings(path)), "
        "sum(m[3] for m in memory._read_only_mappings(path)))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    mapped, resident_kb = (int(x) for x in done.stdout.split())
    assert mapped > 40 * 1024 * 1024  # the extension's read-only data, all three encodings' (~69 MB)
    # Of it, o200k_base's and cl100k_base's (~46 MB) were read to build them. What a count reads again
    # comes back with its readahead: 128 kB here, 2 MB once on a freshly installed extension (a clean
    # clone's CI run).
    assert resident_kb < 8 * 1024, resident_kb


def test_start_up_is_frozen_so_a_full_collection_walks_only_what_requests_made():
    """function_app.py ends with memory.started(): what start-up made (modules, settings, clients)
    is kept out of the garbage collector's walks; a full collection then walks only what came after
    (a fresh process: freezing pytest's own objects would change the other tests)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = "import gc, json, function_app\nprint(json.dumps([gc.get_freeze_count(), len(gc.get_objects()), gc.get_threshold()[:2]]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AZURE_OPENAI_", "UPSTREAMS"))}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    frozen, walked, young = json.loads(out.splitlines()[-1])
    assert frozen > 50_000, frozen  # ~130,000 on Python 3.13
    assert walked < 1_000, walked
    assert young == [10_000, 50]  # young collections every 10,000 allocations, middle ones every 50 young ones
