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
    assert memory._malloc_trim() is not None  # glibc, as on Azure's Linux images


def test_answers_that_add_up_to_the_threshold_share_one_trim_after_the_delay():
    async def run():
        trim = Counting()
        trimmer = Trimmer(trim, after=1000, delay=0.05)
        trimmer.released(600)
        assert trim.calls == 0 and trimmer.pending == 600  # not enough yet
        trimmer.released(600)  # 1,200: one trim, 50 ms later
        trimmer.released(5000)  # ends meanwhile: the same trim
        await asyncio.sleep(0.01)
        assert trim.calls == 0
        await asyncio.sleep(0.1)
        assert trim.calls == 1 and trimmer.pending == 0
        trimmer.released(1000)  # the next big one: its own trim
        await asyncio.sleep(0.1)
        assert trim.calls == 2

    asyncio.run(run())


def test_without_malloc_trim_nothing_is_done():
    trimmer = Trimmer(None, after=1)
    trimmer.released(10**9)
    trimmer.trim()
    assert trimmer.trims == 0


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
    body = {"id": "x", "choices": [{"message": {"content": "é" * chars}}]}
    return http.JsonAnswer(body, asyncio.get_running_loop().time() + give_up_in, headers={"x-request-id": "r"})


def test_a_big_answer_goes_out_in_slices_with_its_length_then_is_released(monkeypatch):
    released: list[int] = []
    monkeypatch.setattr(memory, "released", released.append)

    async def run():
        response = answer(200_000)
        server = Server()
        await response(SCOPE, server.receive, server.send)
        return response, server.messages

    response, messages = asyncio.run(run())
    start, *pieces, end = messages
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert int(headers[b"content-length"]) == len(response.body)
    assert all(len(p["body"]) <= http.SLICE_BYTES and p["more_body"] for p in pieces)
    assert len(pieces) == -(-len(response.body) // http.SLICE_BYTES)
    assert end == {"type": "http.response.body", "body": b"", "more_body": False}
    assert json.loads(b"".join(p["body"] for p in pieces))["choices"][0]["message"]["content"] == "é" * 200_000
    assert released == [len(response.body)]


def test_a_small_answer_is_one_write():
    async def run():
        server = Server()
        await answer(10)(SCOPE, server.receive, server.send)
        return server.messages

    start, body = asyncio.run(run())
    assert body["type"] == "http.response.body" and not body.get("more_body")


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
    assert released == [len(response.body)]


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
