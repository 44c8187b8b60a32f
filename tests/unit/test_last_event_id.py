"""chatstream/resumable.py: the Last-Event-ID a resume continues after, read from the header or the
query (the stream log gets an event id, never the request)."""

from __future__ import annotations

import pytest

from chatstream.errors import ApiError
from chatstream.resumable import last_event_id


@pytest.mark.parametrize(
    "header,query,expected",
    [
        (None, None, None),
        ("", None, None),
        (" ", "7", 7),
        ("0", None, 0),
        ("12", None, 12),
        (" 12 ", None, 12),
        (None, "5", 5),
        ("3", "9", 3),
        ("999999999999999", None, 999999999999999),
    ],
)
def test_last_event_id_accepted(header, query, expected):
    assert last_event_id(header, query) == expected


@pytest.mark.parametrize(
    "value", ["-1", "abc", "1e3", "1.5", "+3", "0x10", "1000000000000000", "9" * 40, "١٢", "1 2", "1\n2"]
)
def test_last_event_id_refused(value):
    with pytest.raises(ApiError):
        last_event_id(value, None)
    with pytest.raises(ApiError):
        last_event_id(None, value)


def test_a_bad_last_event_id_is_a_400():
    with pytest.raises(ApiError) as refused:
        last_event_id("x")
    assert refused.value.status == 400 and refused.value.type == "invalid_request"
