"""The upstream SSE framing (chatstream.upstream.SSEFramer): any split of the bytes, LF, CRLF or CR
line ends, multi-byte text, comments and multi-line data give the same events."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from chatstream.sse import SSEFramer

payloads = st.lists(st.dictionaries(st.sampled_from(["content", "role", "x"]), st.text(max_size=12), max_size=3),
                    min_size=0, max_size=6)


def encode(events: list[dict], eol: bytes, comments: bool) -> bytes:
    out = b""
    for i, event in enumerate(events):
        if comments:
            out += b": keep-alive" + eol + eol
        text = json.dumps(event, ensure_ascii=False)
        if i % 3 == 2:  # some events as multi-line data (valid SSE; joined with LF)
            out += b"event: message" + eol + b"data:" + text[:1].encode() + eol
            out += b"data: " + text[1:].encode() + eol + eol
        else:
            out += b"data: " + text.encode() + eol + eol
    return out + b"data: [DONE]" + eol + eol + b"data: {\"after\": \"done\"}" + eol + eol


@settings(max_examples=1500, deadline=None)
@given(events=payloads, eol=st.sampled_from([b"\n", b"\r\n", b"\r"]), comments=st.booleans(), data=st.data())
def test_any_split_gives_the_same_events(events, eol, comments, data):
    raw = encode(events, eol, comments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
    framer = SSEFramer()
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
    framer = SSEFramer()
    assert framer.feed(b'data: {"a":1}\r') == []
    assert framer.feed(b"") == []
    assert framer.feed(b'\ndata: {"b":2}\r\n\r\n') == [b'{"a":1}\n{"b":2}']


def test_crlf_split_between_pieces_is_one_line_end():
    framer = SSEFramer()
    assert framer.feed(b'data: {"a":1}\r') == []
    assert framer.feed(b'\ndata: {"b":2}\r\n\r\n') == [b'{"a":1}\n{"b":2}']
