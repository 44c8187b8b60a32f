"""The resuming clients' splice (clients/python/chatstream_client/splice.py), and the transports
around it against a scripted in-process server (bodies cut at any byte, resumes answered by the
stream's log): whatever the cuts and the read sizes, the client reads the stream exactly once, whole
events only, nothing after the final event. The same properties for the JavaScript wrapper
(clients/js/chatstream-fetch.mjs) run under Node: tests/unit/chatstream_fetch.test.mjs."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from chatstream_client import AsyncResumingTransport, Backoff, ResumingTransport, Splice, streams_url_for
from helpers import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
ENDINGS = (b"\n", b"\r\n", b"\r")


# --- streams to cut ---------------------------------------------------------------------------


@st.composite
def streams(draw) -> tuple[list[bytes], list[int]]:
    """A resumable stream as the app writes it: (its events, the id of each, 0 for a comment). Ids
    1…n, the last event final; keep-alive comments between; any line ending, any UTF-8."""
    texts = draw(st.lists(st.text(min_size=0, max_size=12), min_size=0, max_size=8))
    final = draw(
        st.sampled_from([b"data: [DONE]", b'event: done\ndata: {"finish_reason":"stop"}', b'data: {"error":{"x":1}}'])
    )
    ending = draw(st.sampled_from(ENDINGS))
    events: list[bytes] = []
    ids: list[int] = []
    for text in texts:
        if draw(st.booleans()) and draw(st.booleans()):
            events.append(b": keep-alive" + ending + ending)
            ids.append(0)
        n = len([i for i in ids if i]) + 1
        payload = json.dumps({"delta": text}, ensure_ascii=False).encode()
        events.append(b"id: %d%sdata: %s%s%s" % (n, ending, payload, ending, ending))
        ids.append(n)
    n = len([i for i in ids if i]) + 1
    events.append(b"id: %d" % n + ending + final.replace(b"\n", ending) + ending + ending)
    ids.append(n)
    return events, ids


def after(events: list[bytes], ids: list[int], last: int | None) -> bytes:
    """What GET /streams/{id} answers for Last-Event-ID ``last``: the events after it (no comments)."""
    return b"".join(e for e, i in zip(events, ids) if i and i > (last or 0))


def pieces(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` in reads of the given sizes (cycled)."""
    out, at, k = [], 0, 0
    while at < len(data):
        size = sizes[k % len(sizes)] if sizes else len(data)
        out.append(data[at : at + size])
        at += size
        k += 1
    return out


def events_of(data: bytes) -> bytes:
    """A stream without its keep-alives (a resume replays the events only, not the comments), line
    ends as LF: a cut between the CR and the LF of a CRLF takes the LF, and the resume starts with the
    next event (the same events to any SSE parser; the app itself writes LF only, kept byte for byte)."""
    data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return data.replace(b": keep-alive\n\n", b"")


def event_ends(events: list[bytes]) -> set[int]:
    """Where an event ends (a CRLF's CR ends it too: the LF may come in the next read)."""
    ends, at = {0}, 0
    for e in events:
        at += len(e)
        ends.add(at)
        if e.endswith(b"\r\n"):
            ends.add(at - 1)
    return ends


# --- the splice alone -------------------------------------------------------------------------


@settings(max_examples=examples(300), deadline=None)
@given(streams(), st.lists(st.integers(1, 40), min_size=1, max_size=5))
def test_uncut_the_events_pass_unchanged_whole_events_only(stream, sizes):
    events, ids = stream
    numbered = [e for e, i in zip(events, ids) if i]
    splice = Splice()
    out = b""
    for piece in pieces(b"".join(events), sizes):
        out += splice.feed(piece)
        assert len(out) in event_ends(numbered)  # never part of an event
    assert out == b"".join(numbered)  # the keep-alives not passed on
    assert splice.final and splice.last_id == str(ids[-1])


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.lists(st.floats(0, 1), min_size=0, max_size=4), st.lists(st.integers(1, 64), min_size=1))
def test_cut_anywhere_any_number_of_times_the_stream_is_exact(stream, cuts, sizes):
    """Each body (the original, then each resume after the last id passed) is cut at a random byte;
    the last body is whole. What passes is the stream's events, byte for byte (a keep-alive the
    cut took is not replayed)."""
    events, ids = stream
    whole = b"".join(events)
    ends = event_ends([events_of(e) for e, i in zip(events, ids) if i])
    splice = Splice()
    out = b""
    body = whole
    for fraction in [*cuts, None]:
        if fraction is not None:
            body = body[: int(len(body) * fraction)]
        for piece in pieces(body, sizes):
            out += splice.feed(piece)
            assert len(events_of(out)) in ends
        if splice.final:
            break
        splice.body_ended()
        splice.resume()
        body = after(events, ids, int(splice.last_id) if splice.last_id else None)
    assert events_of(out) == events_of(whole)
    assert splice.final


@settings(max_examples=examples(200), deadline=None)
@given(streams(), st.integers(0, 10), st.lists(st.integers(1, 64), min_size=1))
def test_a_resume_that_replays_too_much_passes_no_event_twice(stream, back, sizes):
    events, ids = stream
    whole = b"".join(events)
    splice = Splice()
    out = b""
    for piece in pieces(whole[: len(whole) // 2], sizes):
        out += splice.feed(piece)
    splice.body_ended()
    last = int(splice.last_id or 0)
    for piece in pieces(after(events, ids, max(0, last - back)), sizes):  # from earlier than asked
        out += splice.feed(piece)
    assert events_of(out) == events_of(whole)


def test_nothing_passes_after_the_final_event():
    splice = Splice()
    assert splice.feed(b"id: 1\ndata: [DONE]\n\n") == b"id: 1\ndata: [DONE]\n\n"
    assert splice.final
    assert splice.feed(b"id: 2\ndata: {}\n\n") == b""


def test_an_error_event_without_an_id_is_held_and_ends_the_body():
    """stream_store_unavailable (docs/resumable.md): the app ends that reading with an error event
    without an id; the client asks again after the same id. It does not pass, unless giving up."""
    unavailable = b'data: {"error":{"code":"stream_store_unavailable"}}\n\n'
    splice = Splice()
    out = splice.feed(b"id: 3\ndata: {}\n\n" + unavailable + b"id: 9\ndata: {}\n\n")
    assert out == b"id: 3\ndata: {}\n\n"
    assert splice.held == unavailable and splice.body_over and not splice.final
    assert splice.last_id == "3"
    splice.body_ended()
    assert splice.take_held() == unavailable
    chat = b'event: error\ndata: {"error":{"type":"stream_store_unavailable"}}\n\n'
    splice = Splice()
    assert splice.feed(chat) == b""
    assert splice.held == chat


def test_a_crlf_split_between_two_reads_is_one_line_end():
    splice = Splice()
    assert splice.feed(b"id: 1\r\ndata: a\r\n\r") == b"id: 1\r\ndata: a\r\n\r"
    assert splice.feed(b"\nid: 2\r") == b"\n"  # the LF of the blank line's CRLF, not a blank line
    assert splice.feed(b"\ndata: [DONE]\r\n\r\n") == b"id: 2\r\ndata: [DONE]\r\n\r\n"
    assert splice.final


# --- the URL rule -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_url", "expected"),
    [
        ("http://h:7071/api/v1/chat/completions", "http://h:7071/api/streams/S"),
        ("http://h:7071/api/chat", "http://h:7071/api/streams/S"),
        ("https://h/v1/chat/completions?code=K&x=1", "https://h/streams/S?code=K"),
        ("https://h/gw/openai/chat/completions", "https://h/gw/openai/streams/S"),
        ("https://h/a/b/other", "https://h/a/b/streams/S"),
    ],
)
def test_the_streams_url_is_the_route_replaced(request_url, expected):
    assert str(streams_url_for(httpx.URL(request_url), "S")) == expected


def test_the_streams_url_can_be_given():
    url = httpx.URL("https://h/api/v1/chat/completions?code=K")
    assert str(streams_url_for(url, "S", "https://other/x/streams/{id}")) == "https://other/x/streams/S?code=K"
    assert str(streams_url_for(url, "S", lambda u, i: f"https://other/{i}")) == "https://other/S?code=K"


# --- the transports against a scripted server -------------------------------------------------


class Scripted:
    """An in-process server of one resumable stream: the POST's answer and each resume's answer are
    scripted (a status, or the log after Last-Event-ID cut at a fraction of its bytes); bodies come
    in reads of ``size`` bytes and a cut raises the error httpx raises for a reset connection."""

    def __init__(self, events: list[bytes], ids: list[int], answers: list, size: int = 7):
        self.events, self.ids, self.answers, self.size = events, ids, list(answers), size
        self.seen: list[httpx.Request] = []
        self.at: list[float] = []

    def answer(self, request: httpx.Request) -> tuple[int, dict, list[bytes], bool]:
        self.seen.append(request)
        self.at.append(time.monotonic())
        script = self.answers.pop(0) if self.answers else None
        if isinstance(script, tuple):  # (status, headers)
            return script[0], script[1], [b'{"error":{}}'], False
        if script == "refuse":
            raise httpx.ConnectError("refused")
        last = request.headers.get("last-event-id")
        body = after(self.events, self.ids, int(last) if last else None)
        if request.method == "POST":
            body = b"".join(self.events)
        cut = script is not None
        if cut:
            body = body[: int(len(body) * script)]
        headers = {"content-type": "text/event-stream", "x-stream-id": "S" * 30}
        return 200, headers, pieces(body, [self.size]), cut


class _Body(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes], cut: bool):
        self.parts, self.cut = parts, cut

    def __iter__(self):
        yield from self.parts
        if self.cut:
            raise httpx.ReadError("[Errno 104] Connection reset by peer")

    async def __aiter__(self):
        for part in self.parts:
            yield part
        if self.cut:
            raise httpx.ReadError("[Errno 104] Connection reset by peer")


class SyncServer(httpx.BaseTransport):
    def __init__(self, scripted: Scripted):
        self.scripted = scripted

    def handle_request(self, request):
        status, headers, parts, cut = self.scripted.answer(request)
        return httpx.Response(status, headers=headers, stream=_Body(parts, cut))


class AsyncServer(httpx.AsyncBaseTransport):
    def __init__(self, scripted: Scripted):
        self.scripted = scripted

    async def handle_async_request(self, request):
        status, headers, parts, cut = self.scripted.answer(request)
        return httpx.Response(status, headers=headers, stream=_Body(parts, cut))


FAST = Backoff(max_attempts=4, max_seconds=5, first_delay=0.001, max_delay=0.004)
URL = "http://app.test/api/v1/chat/completions?code=FK"
AUTH = {"Authorization": "Bearer csk-1", "api-key": "k2", "x-functions-key": "fk", "x-other": "no"}


def read_sync(scripted: Scripted, backoff: Backoff = FAST) -> bytes:
    with (
        httpx.Client(transport=ResumingTransport(SyncServer(scripted), backoff=backoff)) as client,
        client.stream("POST", URL, headers=AUTH, json={}) as response,
    ):
        return b"".join(response.iter_bytes())


async def read_async(scripted: Scripted, backoff: Backoff = FAST) -> bytes:
    async with (
        httpx.AsyncClient(transport=AsyncResumingTransport(AsyncServer(scripted), backoff=backoff)) as client,
        client.stream("POST", URL, headers=AUTH, json={}) as response,
    ):
        return b"".join([piece async for piece in response.aiter_bytes()])


@settings(max_examples=examples(100), deadline=None)
@given(streams(), st.lists(st.floats(0, 0.99), max_size=3), st.integers(1, 50), st.booleans())
def test_transports_read_the_stream_exactly_whatever_the_cuts(stream, cuts, size, use_async):
    events, ids = stream
    scripted = Scripted(events, ids, cuts, size)
    got = asyncio.run(read_async(scripted)) if use_async else read_sync(scripted)
    assert events_of(got) == events_of(b"".join(events))
    resumes = scripted.seen[1:]
    for request in resumes:
        assert request.method == "GET" and request.url.path == "/api/streams/" + "S" * 30
        assert request.url.params["code"] == "FK"
        assert {k: request.headers.get(k) for k in ("authorization", "api-key", "x-functions-key", "x-other")} == {
            "authorization": "Bearer csk-1",
            "api-key": "k2",
            "x-functions-key": "fk",
            "x-other": None,
        }


def test_a_resume_answered_503_is_tried_again_after_its_retry_after():
    events, ids = [b"id: 1\ndata: {}\n\n", b"id: 2\ndata: [DONE]\n\n"], [1, 2]
    scripted = Scripted(events, ids, [0.5, (503, {"retry-after-ms": "300"}), (429, {"retry-after": "0"}), None])
    assert read_sync(scripted) == b"".join(events)
    assert [r.headers.get("last-event-id") for r in scripted.seen[1:]] == ["1", "1", "1"]
    assert scripted.at[2] - scripted.at[1] >= 0.3


@pytest.mark.parametrize("status", [404, 400, 401])
def test_a_resume_answered_404_or_400_ends_with_the_cuts_error(status):
    events, ids = [b"id: 1\ndata: {}\n\n", b"id: 2\ndata: [DONE]\n\n"], [1, 2]
    scripted = Scripted(events, ids, [0.5, (status, {})])
    with pytest.raises(httpx.ReadError, match="reset") as raised:
        read_sync(scripted)
    assert f"answered {status}" in "".join(getattr(raised.value, "__notes__", []))
    assert len(scripted.seen) == 2


def test_giving_up_after_the_bound_raises_the_cuts_error():
    events, ids = [b"id: 1\ndata: {}\n\n", b"id: 2\ndata: [DONE]\n\n"], [1, 2]
    scripted = Scripted(events, ids, [0.5, "refuse", "refuse", "refuse", "refuse", None])
    with pytest.raises(httpx.ReadError):
        read_sync(scripted)
    assert len(scripted.seen) == 1 + FAST.max_attempts
    scripted = Scripted(events, ids, [0.5, (503, {"retry-after": "60"}), None])
    started = time.monotonic()
    with pytest.raises(httpx.ReadError, match="reset"):  # Retry-After past the bound: at once
        read_sync(scripted)
    assert time.monotonic() - started < 1 and len(scripted.seen) == 2


def test_the_time_bound_counts_from_the_cut():
    events, ids = [b"id: 1\ndata: {}\n\n", b"id: 2\ndata: [DONE]\n\n"], [1, 2]
    backoff = Backoff(max_attempts=100, max_seconds=0.5, first_delay=0.1, max_delay=0.1)
    scripted = Scripted(events, ids, [0.5, *["refuse"] * 100])
    started = time.monotonic()
    with pytest.raises(httpx.ReadError):
        read_sync(scripted, backoff)
    assert 0.4 <= time.monotonic() - started < 1.5
    assert 4 <= len(scripted.seen) - 1 <= 5


async def test_async_giving_up_raises_the_cuts_error():
    events, ids = [b"id: 1\ndata: {}\n\n", b"id: 2\ndata: [DONE]\n\n"], [1, 2]
    scripted = Scripted(events, ids, [0.5, *["refuse"] * 10])
    with pytest.raises(httpx.ReadError):
        await read_async(scripted)
    assert len(scripted.seen) == 1 + FAST.max_attempts


def test_answers_without_a_stream_id_pass_untouched():
    class Plain(httpx.BaseTransport):
        def handle_request(self, request):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body([b"data: x"], True))

    with (
        httpx.Client(transport=ResumingTransport(Plain(), backoff=FAST)) as client,
        client.stream("POST", URL) as response,
        pytest.raises(httpx.ReadError),
    ):
        response.read()


def test_the_openai_sdk_reads_a_stream_with_keep_alives_after_its_ids():
    """openai-python dispatches a comment-only event as one of empty data once it has seen an id,
    and fails on its JSON: a resume that waited for the stream (a takeover, a frozen store) sends
    keep-alives. Through the transport the SDK reads every chunk (the chaos soak's seed 4242)."""
    import openai

    def chunk(n: int, text: str) -> bytes:
        body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        body["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
        return b"id: %d\ndata: %s\n\n" % (n, json.dumps(body).encode())

    words = ["one ", "two ", "three ", "four"]
    events = [chunk(i + 1, w) for i, w in enumerate(words)] + [b"id: 5\ndata: [DONE]\n\n"]
    ids = [1, 2, 3, 4, 5]
    keep_alive = b": keep-alive\n\n"
    scripted = Scripted([events[0], keep_alive, *events[1:]], [1, 0, *ids[1:]], [0.6], size=9)
    resumed = scripted.answer

    def answer(request: httpx.Request):  # every resume waits: keep-alives first
        status, headers, parts, cut = resumed(request)
        return status, headers, ([keep_alive, keep_alive, *parts] if request.method == "GET" else parts), cut

    scripted.answer = answer
    http = httpx.Client(transport=ResumingTransport(SyncServer(scripted), backoff=FAST))
    client = openai.OpenAI(base_url="http://app.test/api/v1", api_key="csk-1", max_retries=0, http_client=http)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "".join(words)
    assert len(scripted.seen) == 2, "the POST was cut and resumed once"


# --- the JavaScript wrapper -------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_javascript_wrapper_has_the_same_properties():
    run = subprocess.run(
        ["node", "--test", str(ROOT / "tests/unit/chatstream_fetch.test.mjs")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
