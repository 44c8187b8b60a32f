"""chatstream/sse.py: writing our events (``event`` of chatstream/http.py's ``dumps``, ``numbered``,
``KEEP_ALIVE``), reading ours (``split``, ``event_id``, ``comment_text``) and reading the
upstream's (``Parser``: any split of the bytes, LF, CRLF or CR line ends, multi-byte text, comments
and multi-line data give the same events)."""

from __future__ import annotations

import json

from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from chatstream import sse
from chatstream.http import dumps
from chatstream.sse import KEEP_ALIVE, Parser

payloads = st.lists(
    st.dictionaries(st.sampled_from(["content", "role", "x"]), st.text(max_size=12), max_size=3), min_size=0, max_size=6
)


def encode(events: list[dict], eol: bytes, comments: bool) -> bytes:
    out = b""
    for i, payload in enumerate(events):
        if comments:
            out += b": keep-alive" + eol + eol
        text = json.dumps(payload, ensure_ascii=False)
        if i % 3 == 2:  # some events as multi-line data (valid SSE; joined with LF)
            out += b"event: message" + eol + b"data:" + text[:1].encode() + eol
            out += b"data: " + text[1:].encode() + eol + eol
        else:
            out += b"data: " + text.encode() + eol + eol
    return out + b"data: [DONE]" + eol + eol + b'data: {"after": "done"}' + eol + eol


@settings(max_examples=examples(150), deadline=None)
@given(events=payloads, eol=st.sampled_from([b"\n", b"\r\n", b"\r"]), comments=st.booleans(), data=st.data())
def test_any_split_gives_the_same_events(events, eol, comments, data):
    raw = encode(events, eol, comments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
    framer = Parser()
    out = []
    for piece in pieces:
        if not framer.done:
            out += framer.feed(piece)
    got = [json.loads(p) for p in out]
    expected = [e for e in events]
    # multi-line events come back with an LF inside the JSON text: still the same object
    assert got == expected
    assert framer.done


def test_an_empty_piece_between_cr_and_lf_changes_nothing():
    framer = Parser()
    assert framer.feed(b'data: {"a":1}\r') == []
    assert framer.feed(b"") == []
    assert framer.feed(b'\ndata: {"b":2}\r\n\r\n') == [b'{"a":1}\n{"b":2}']


def test_crlf_split_between_pieces_is_one_line_end():
    framer = Parser()
    assert framer.feed(b'data: {"a":1}\r') == []
    assert framer.feed(b'\ndata: {"b":2}\r\n\r\n') == [b'{"a":1}\n{"b":2}']


def test_an_empty_piece_and_a_piece_without_a_line_end_give_nothing():
    framer = Parser()
    assert framer.feed(b"") == []
    assert framer.feed(b'data: {"a":') == []
    assert framer.feed(b"1}\n") == []  # the event ends only at the blank line
    assert framer.feed(b"\n") == [b'{"a":1}']


def test_data_without_a_space_after_the_colon_and_other_fields():
    framer = Parser()
    assert framer.feed(b'id: 7\nevent: x\nretry: 5\ndata:{"a":1}\n\n: comment\n\n') == [b'{"a":1}']


def test_nothing_after_done_and_done_is_remembered():
    framer = Parser()
    assert framer.feed(b'data: {"a":1}\n\ndata: [DONE]\n\ndata: {"b":2}\n\n') == [b'{"a":1}']
    assert framer.done


# ------------------------------------------------------------------------------------- writing


def test_dumps_is_compact_raw_utf8():
    assert dumps({"a": "é中😀", "b": [1, None, True]}) == '{"a":"é中😀","b":[1,null,true]}'.encode()


def test_dumps_escapes_a_lone_surrogate_instead_of_failing():
    out = dumps({"delta": "a\ud800b"})
    assert out == b'{"delta":"a\\ud800b"}'
    assert json.loads(out) == {"delta": "a\ud800b"}


def test_dumps_with_a_lone_surrogate_escapes_the_rest_too():
    # The fallback is plain ASCII JSON: still valid, the other characters \u-escaped.
    out = dumps({"delta": "é\udfff"})
    out.decode("ascii")
    assert json.loads(out) == {"delta": "é\udfff"}


def test_event_without_a_name():
    assert sse.event(dumps({"delta": "hi"})) == b'data: {"delta":"hi"}\n\n'


def test_event_with_a_name():
    assert sse.event(dumps({"finish_reason": "stop"}), b"done") == b'event: done\ndata: {"finish_reason":"stop"}\n\n'


def test_an_event_is_one_data_line_whatever_the_text():
    # JSON escapes line ends, so a text with LF, CR or CRLF never splits the data line.
    out = sse.event(dumps({"delta": "a\nb\rc\r\n\u2028"}))
    assert out.count(b"\n") == 2 and b"\r" not in out
    framer = Parser()
    assert [json.loads(p) for p in framer.feed(out)] == [{"delta": "a\nb\rc\r\n\u2028"}]


def test_keep_alive_is_a_comment():
    assert KEEP_ALIVE == b": keep-alive\n\n"
    assert Parser().feed(KEEP_ALIVE) == []


def test_our_numbered_events_and_comments_split_back():
    stream = sse.numbered(7, sse.event(b"{}", b"done")) + sse.comment(b"epoch 2 7") + sse.KEEP_ALIVE
    parts, rest = sse.split(stream + b"id: 8\ndata: ")
    assert rest == b"id: 8\ndata: " and len(parts) == 3
    assert [sse.event_id(p) for p in parts] == [7, None, None]
    assert [sse.comment_text(p) for p in parts] == [None, b"epoch 2 7", b"keep-alive"]
    assert [sse.is_comment(p) for p in parts] == [False, True, True]
    assert sse.join(parts) == stream
