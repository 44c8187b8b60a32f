"""chatstream/record.py: the request's record, its one log line (which a caller's text must never
split or disguise) and the result the after-steps see."""

from __future__ import annotations

import json
import time

import pytest

from chatstream.errors import log_safe
from chatstream.record import StreamRecord, StreamResult

# Characters that start a new line for some log reader, or hide part of a line.
UNSAFE = [
    "\u0085",
    "\u2028",
    "\u2029",
    "\x9b",
    "\x7f",
    "\x80",
    "\x9f",
    "\u202a",
    "\u202b",
    "\u202c",
    "\u202d",
    "\u202e",
    "\u2066",
    "\u2067",
    "\u2068",
    "\u2069",
]


@pytest.mark.parametrize("char", UNSAFE)
def test_log_line_escapes_characters_that_split_or_hide_a_line(char):
    record = StreamRecord(endpoint="chat", model=f"evil{char}model")
    record.refused(400, f"x{char}y")
    line = record.log_line()
    assert char not in line
    assert len(line.splitlines()) == 1
    assert f"\\u{ord(char):04x}" in line
    assert json.loads(line)["model"] == f"evil{char}model", "the escapes are JSON escapes: the value reads back"


def test_log_line_json_escapes_c0_controls():
    record = StreamRecord(endpoint="chat", model="a\nb\rc\x1bd\x00")
    line = record.log_line()
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\x00" not in line
    assert json.loads(line)["model"] == "a\nb\rc\x1bd\x00"


def test_log_line_keeps_ordinary_unicode_raw():
    line = StreamRecord(endpoint="chat", model="modèle-中文-😀").log_line()
    assert "modèle-中文-😀" in line


def test_log_safe_on_its_own():
    assert log_safe("plain") == "plain"
    assert log_safe("a\u2028b\u202ec") == "a\\u2028b\\u202ec"


def test_log_line_fields():
    record = StreamRecord(endpoint="openai", model="m", started=time.perf_counter() - 1)
    record.first_delta_at = record.started + 0.25
    record.deltas, record.finish_reason, record.usage = 3, "stop", {"total_tokens": 9}
    entry = json.loads(record.log_line())
    assert list(entry) == [
        "event",
        "endpoint",
        "model",
        "status",
        "ttfd_ms",
        "duration_ms",
        "deltas",
        "finish_reason",
        "usage",
        "error",
        "disconnected",
        "upstream",
        "attempts",
        "request_id",
    ]
    assert entry["event"] == "chat_stream" and entry["endpoint"] == "openai" and entry["status"] == 200
    assert entry["ttfd_ms"] == 250.0 and entry["duration_ms"] >= 1000
    assert (entry["deltas"], entry["finish_reason"], entry["usage"]) == (3, "stop", {"total_tokens": 9})
    assert entry["error"] is None and entry["disconnected"] is False
    assert entry["upstream"] is None and entry["attempts"] == 0  # no upstream entry tried yet


def test_ttfd_is_none_until_the_first_delta():
    assert StreamRecord(endpoint="chat", model="m").ttfd_ms() is None


def test_refused():
    record = StreamRecord(endpoint="chat", model="m")
    record.refused(504, "upstream_timeout")
    assert (record.status, record.error) == (504, "upstream_timeout")


def test_texts_are_kept_only_when_asked():
    record = StreamRecord(endpoint="chat", model="m")
    record.keep_text(0, "a")
    assert record.texts is None and record.result().texts == {}
    record.texts = {}
    for index, text in ((0, "Hel"), (1, "x"), (0, ""), (0, "lo")):
        record.keep_text(index, text)
    assert record.texts == {0: ["Hel", "lo"], 1: ["x"]}


def test_result():
    record = StreamRecord(endpoint="chat", model="m", started=time.perf_counter() - 0.5)
    record.texts = {}
    record.keep_text(0, "Hello")
    record.keep_text(0, " world")
    record.keep_text(2, "other")
    record.first_delta_at = record.started + 0.1
    record.deltas, record.finish_reason, record.usage, record.disconnected = 2, "length", {"t": 1}, True
    record.refused(502, "upstream_disconnected")
    result = record.result()
    assert isinstance(result, StreamResult)
    assert result.texts == {0: "Hello world", 2: "other"} and result.text == "Hello world"
    assert (result.endpoint, result.model, result.finish_reason, result.usage) == ("chat", "m", "length", {"t": 1})
    assert (result.ttfd_ms, result.deltas, result.disconnected) == (100.0, 2, True)
    assert (result.error, result.status) == ("upstream_disconnected", 502)
    assert result.duration_ms >= 500
    with pytest.raises(AttributeError):
        result.status = 200  # frozen


def test_result_text_without_choice_zero():
    record = StreamRecord(endpoint="chat", model="m", texts={1: ["x"]})
    assert record.result().text == ""


def test_log_safe_escapes_raw_newlines_in_caller_text_that_is_not_json():
    """Some log lines carry a caller-chosen name as is (the pool's cooldown line names the model):
    a newline there must not start a forged line (review finding)."""
    from chatstream.errors import log_safe

    assert (
        log_safe("gpt\n2025-01-01 INFO chatstream: forged\r\x00")
        == "gpt\\u000a2025-01-01 INFO chatstream: forged\\u000d\\u0000"
    )


def test_no_upstream_key_in_a_log_line_message_or_traceback(caplog):
    """Issue #23 item 10: an upstream may quote its key in an error message that ends up in a log."""
    import logging

    from chatstream.errors import register_secret

    secret = "sk-unit-LOGGED-0123456789"
    register_secret(secret)
    assert log_safe(f"upstream said: Bearer {secret}") == "upstream said: Bearer [redacted]"
    log = logging.getLogger("chatstream")
    with caplog.at_level(logging.INFO, logger="chatstream"):
        log.warning("upstream error: %s", f"Authorization: Bearer {secret}")
        try:
            raise ValueError(f"quoted {secret}")
        except ValueError:
            log.exception("a failure")
    text = caplog.text + "".join(r.exc_text or "" for r in caplog.records)
    assert secret not in text and text.count("[redacted]") >= 2
    assert "ValueError: quoted [redacted]" in text


async def test_every_entra_id_token_is_registered_as_a_secret():
    from chatstream.errors import redact
    from chatstream.upstreams.clients import entra_token_provider

    class Credential:
        async def get_token(self, *scopes, **kwargs):
            from azure.core.credentials import AccessToken

            return AccessToken("eyJ0eXAiOiJKV1Qi.unit-entra-token", int(time.time()) + 3600)

        async def close(self):
            pass

    token = await entra_token_provider(Credential())()
    assert redact(f"Bearer {token}") == "Bearer [redacted]"


def test_text_parts_keep_the_text_and_join_short_pieces_as_they_come():
    from chatstream.record import JOIN_EVERY, SHARED_CHARS, TextParts

    pieces = [f"w{i} " for i in range(10 * JOIN_EVERY + 7)]
    long = "x" * SHARED_CHARS
    parts = TextParts()
    for i, piece in enumerate(pieces):
        parts.append(piece)
        if i == 100:
            parts.append(long)
    assert "".join(parts) == "".join(pieces[:101]) + long + "".join(pieces[101:])
    assert len(parts) < 12 + JOIN_EVERY  # one per run of JOIN_EVERY short pieces, and the last run
    assert any(p is long for p in parts)  # a long delta is kept as it came, not copied
    assert "".join(TextParts(["a", "b"])) == "ab"
