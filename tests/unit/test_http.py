"""chatstream/http.py: reading a body (the content type, the body size limit (413 as soon as it is known) and strict
JSON, on a Starlette request fed from memory."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from chatstream.errors import ApiError, ClientGone
from chatstream.http import parse_json_body, read_body, require_json_content_type


def request(pieces: list[bytes], headers: dict[str, str] | None = None, disconnect: bool = False):
    """A request whose body arrives in ``pieces``; ``received`` counts the ASGI messages read."""
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    if disconnect:
        messages[-1]["more_body"] = True
        messages.append({"type": "http.disconnect"})
    received = []

    async def receive():
        message = messages[len(received)]
        received.append(message)
        return message

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/chat",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    return Request(scope, receive), received


# ------------------------------------------------------------------------------ content type


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "",
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/x-www-form-urlencoded",
        "application/merge-patch+json",
        " application/json ;charset=UTF-8",
    ],
)
def test_json_content_types_are_accepted(content_type):
    require_json_content_type(content_type)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "multipart/form-data; boundary=x", "application/xml", "text/json", "application/jsonx", "json"],
)
def test_other_content_types_are_415(content_type):
    with pytest.raises(ApiError) as info:
        require_json_content_type(content_type)
    assert (info.value.status, info.value.type) == (415, "unsupported_media_type")


# ------------------------------------------------------------------------------------- size


async def test_body_in_pieces_is_joined():
    req, _ = request([b'{"a":', b"", b" 1}"])
    assert await read_body(req, 100) == b'{"a": 1}'


async def test_body_exactly_at_the_limit_is_read():
    req, _ = request([b"x" * 5, b"x" * 5], {"content-length": "10"})
    assert await read_body(req, 10) == b"x" * 10


async def test_content_length_over_the_limit_is_413_before_reading_anything():
    req, received = request([b"x" * 11], {"content-length": "11"})
    with pytest.raises(ApiError) as info:
        await read_body(req, 10)
    assert (info.value.status, info.value.type) == (413, "request_too_large")
    assert info.value.message == "the body exceeds 10 bytes"
    assert received == []


async def test_a_body_longer_than_announced_is_413_as_soon_as_it_passes_the_limit():
    req, received = request([b"x" * 6, b"x" * 6, b"x" * 6], {"content-length": "5"})
    with pytest.raises(ApiError) as info:
        await read_body(req, 10)
    assert info.value.status == 413
    assert len(received) == 2, "the rest of the body is not read"


@pytest.mark.parametrize("length", [None, "abc", "-1", ""])
async def test_without_a_usable_content_length_the_stream_is_counted(length):
    headers = {} if length is None else {"content-length": length}
    req, received = request([b"x" * 8, b"x" * 8, b"x" * 8], headers)
    with pytest.raises(ApiError) as info:
        await read_body(req, 10)
    assert info.value.status == 413 and len(received) == 2


async def test_a_caller_hanging_up_while_sending_is_client_gone():
    req, _ = request([b'{"a":'], disconnect=True)
    with pytest.raises(ClientGone):
        await read_body(req, 100)


# ------------------------------------------------------------------------------ strict JSON


def test_plain_json():
    assert parse_json_body('{"a": [1, 2.5, "é", null, true]}'.encode()) == {"a": [1, 2.5, "é", None, True]}


@pytest.mark.parametrize("raw", [b"NaN", b'{"t": NaN}', b'{"t": Infinity}', b'{"t": -Infinity}', b"[1, NaN]"])
def test_nan_and_infinity_are_400(raw):
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    assert (info.value.status, info.value.type) == (400, "invalid_request")
    assert "is not valid JSON" in info.value.message


@pytest.mark.parametrize("raw", [b'{"t": 1e999}', b'{"t": -1e999}', b"[1E400]", b'{"t": 123456789e400}'])
def test_numbers_that_overflow_are_400(raw):
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and "out of range" in info.value.message


def test_an_out_of_range_message_is_bounded():
    with pytest.raises(ApiError) as info:
        parse_json_body(b'{"t": ' + b"9" * 500 + b"e999}")
    assert len(info.value.message) < 150


def test_big_but_finite_numbers_and_tiny_ones_are_fine():
    assert parse_json_body(b"[1e308, 1e-999, -0.0]") == [1e308, 0.0, -0.0]


def test_an_integer_with_too_many_digits_is_400():
    with pytest.raises(ApiError) as info:  # Python's int-from-string limit (4300 digits)
        parse_json_body(b"[" + b"9" * 5000 + b"]")
    assert info.value.status == 400


@pytest.mark.parametrize("raw", [b"", b"  ", b"{", b"{'a': 1}", b'{"a": 1,}', b"\xef\xbb\xbf{}", b'{"a":1} x'])
def test_not_json_is_400(raw):
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and info.value.message.startswith("the body is not valid JSON")


@pytest.mark.parametrize("raw", [b'{"a": "\xff"}', b'{"a": "\xed\xa0\x80"}', b"\xc3"])
def test_not_utf8_is_400(raw):
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    assert info.value.message == "the body is not valid UTF-8"


@pytest.mark.parametrize(
    "raw", [rb'{"a": "\ud800"}', rb'{"a": ["x", {"b": "y\udfff"}]}', rb'{"\udc00": 1}', rb'["\ude00\ud83d"]']
)
def test_lone_surrogate_escapes_are_400(raw):
    with pytest.raises(ApiError) as info:
        parse_json_body(raw)
    assert info.value.message == "the body contains an unpaired UTF-16 surrogate escape"


def test_a_surrogate_pair_is_one_character():
    assert parse_json_body(rb'{"a": "\ud83d\ude00"}') == {"a": "😀"}


def test_moderate_nesting_is_fine():
    expected: list = []
    for _ in range(99):
        expected = [expected]
    assert parse_json_body(b"[" * 100 + b"]" * 100) == expected


@pytest.mark.parametrize("depth", [20_000, 200_000])
def test_very_deep_nesting_is_400(depth):
    with pytest.raises(ApiError) as info:
        parse_json_body(b"[" * depth + b"]" * depth)
    assert (info.value.status, info.value.message) == (400, "the body is nested too deeply")


@pytest.mark.parametrize("opening, closing", [(b"[", b"]"), (b'{"a":', b"}")])
def test_nesting_between_the_python_and_the_c_limit_is_not_a_500(opening, closing):
    depth = 2000
    escaped = False
    try:
        parse_json_body(opening * depth + b"1" + closing * depth)
    except ApiError as error:  # refusing it is fine, as a 400
        assert error.status == 400
    except RecursionError:  # not raised from here: its 1000-frame traceback takes pytest seconds to render
        escaped = True
    assert not escaped, "RecursionError escaped parse_json_body"


# --- EventStreamResponse: the body written by the response's own task --------------------------


def _scope() -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "GET", "headers": []}


async def test_the_head_and_the_first_event_go_out_in_the_response_task_itself():
    """No task of its own for the body: by the first time the response's task yields to the loop,
    the head and the first event are written; the disconnect listener is the started task."""
    import asyncio

    from chatstream.http import EventStreamResponse

    sent, closed = [], []
    gate = asyncio.Event()

    async def body():
        try:
            yield b"data: 1\n\n"
            await gate.wait()
            yield b"data: 2\n\n"
        finally:
            closed.append("body")

    async def on_close():
        closed.append("on_close")

    async def receive():
        await asyncio.Event().wait()  # never a disconnect

    async def send(message):
        sent.append(message)

    response = EventStreamResponse(body(), asyncio.get_running_loop().time() + 60, on_close)
    task = asyncio.ensure_future(response(_scope(), receive, send))
    await asyncio.sleep(0)  # one turn: the task ran up to its first real wait
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b"data: 1\n\n"
    gate.set()
    await task
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert closed == ["body", "on_close"]


async def test_a_caller_gone_while_the_body_waits_closes_it_and_a_write_error_is_raised_as_itself():
    import asyncio

    from chatstream.http import EventStreamResponse

    closed = []
    gone = asyncio.Event()

    async def body():
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # parked: only the caller's disconnect ends this
            yield b"never"
        finally:
            closed.append("body")

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    async def on_close():
        closed.append("on_close")

    response = EventStreamResponse(body(), asyncio.get_running_loop().time() + 60, on_close)
    task = asyncio.ensure_future(response(_scope(), receive, send))
    await asyncio.sleep(0.01)
    gone.set()
    await asyncio.wait_for(task, 2)
    assert closed == ["body", "on_close"]

    async def failing_send(message):
        if message["type"] == "http.response.body":
            raise OSError("reset")

    async def one():
        yield b"data: 1\n\n"

    with pytest.raises(OSError):
        await EventStreamResponse(one(), asyncio.get_running_loop().time() + 60)(_scope(), receive, failing_send)


async def test_a_body_that_closes_itself_skips_on_close_only_once_written_whole():
    """``closed_by_body``: after a body written to its end, ``on_close`` is not awaited (the body
    closed what it closes); a body the caller cut short, or a response never served, still gets it."""
    import asyncio

    from chatstream.http import EventStreamResponse

    closed = []

    async def on_close():
        closed.append("on_close")

    async def whole():
        yield b"data: 1\n\n"

    async def parked():
        yield b"data: 1\n\n"
        await asyncio.Event().wait()

    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    at = asyncio.get_running_loop().time() + 60
    await EventStreamResponse(whole(), at, on_close, closed_by_body=True)(_scope(), receive, send)
    assert closed == []
    cut = asyncio.ensure_future(
        EventStreamResponse(parked(), at, on_close, closed_by_body=True)(_scope(), receive, send)
    )
    await asyncio.sleep(0.01)
    gone.set()
    await asyncio.wait_for(cut, 2)
    assert closed == ["on_close"]
    await EventStreamResponse(whole(), at, on_close, closed_by_body=True).close()  # never served
    assert closed == ["on_close", "on_close"]


def test_nesting_is_bounded_at_the_limit_whatever_else_the_text_holds():
    """The depth walk is skipped only where the text has too few brackets to nest too deeply:
    exactly MAX_DEPTH levels pass, one more is a 400, with or without brackets inside strings."""
    from chatstream.http import MAX_DEPTH

    def nested(levels: int, padding: bytes = b"") -> bytes:
        return b"[" * (levels - 1) + b"{" + padding + b'"a": 1}' + b"]" * (levels - 1)

    for padding in (b"", b'"s": "[[[{{{", '):
        assert parse_json_body(nested(MAX_DEPTH, padding))
        with pytest.raises(ApiError) as info:
            parse_json_body(nested(MAX_DEPTH + 1, padding))
        assert info.value.message == f"the body is nested deeper than {MAX_DEPTH} levels"


def test_escapes_that_pair_or_are_not_surrogates_pass():
    assert parse_json_body(rb'{"a": "\ud83d\ude00 \u00e9 \\ud800"}') == {"a": "\U0001f600 é \\ud800"}
