"""POST /api/chat end to end: the real runtime behind the local host, the scripted upstream behind
the app, bytes over HTTP."""

from __future__ import annotations

import json
import re
import time

import pytest
from chat import chat, prompt

from tools.fakeupstream.scenarios import AFTER_FINISH_EXTRA, NORMAL_DELTAS, TEXTS


@pytest.mark.parametrize("scenario", ["normal", "split_utf8", "azure_filters"])
def test_text_arrives_exactly(app, scenario):
    result = chat(app.chat_url, prompt(scenario))
    assert result.status == 200
    assert result.text == TEXTS[scenario]
    assert all(result.deltas), "empty deltas are skipped"
    assert result.terminal_events() == ["done"]
    assert result.last[0] == "done"


def test_newlines_emoji_and_cjk_survive(app):
    text = chat(app.chat_url, prompt("normal")).text
    assert "\n\n" in text and "🙂🚀" in text and "日本語のテキスト" in text


def test_stream_headers(app):
    result = chat(app.chat_url, prompt("normal"))
    assert result.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert result.headers["cache-control"] == "no-store"
    assert result.headers["x-accel-buffering"] == "no"
    assert "content-length" not in result.headers


def test_done_event_carries_usage_model_and_id(app):
    result = chat(app.chat_url, prompt("normal"))
    event, data = result.last
    assert event == "done"
    assert data["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert data["id"].startswith("chatcmpl-")
    assert data["model"]


def test_deltas_arrive_as_generated_not_bunched(app, upstream):
    # The slow scenario spreads its deltas over ~2 s; a buffering relay would deliver them together.
    # Each delta is judged against the moment the upstream sent it (an upstream delayed by a loaded
    # machine sends late, then catches up: that bunching is not the relay's).
    body = prompt("slow", f"as generated {time.time_ns()}")
    sent = time.time()
    result = chat(app.chat_url, body)
    times = [t for t, e, _ in result.events if e == "message"]
    assert result.text == TEXTS["slow"]
    assert len(times) >= 8
    assert times[0] < 1.5, f"first delta after {times[0]:.2f}s"
    assert times[-1] - times[0] > 1.2, f"deltas bunched: {times}"
    [(_, record)] = upstream.calls_for(body["prompt"])
    generated = [at - sent for at in record["content_sent_at"]]
    assert len(generated) == len(times), (generated, times)
    delays = [arrived - made for arrived, made in zip(times, generated, strict=True)]
    assert max(delays) < 0.5, f"a delta held back: {delays}"


def test_nothing_after_finish_reason_is_forwarded(app):
    result = chat(app.chat_url, prompt("after_finish"))
    assert result.text == TEXTS["after_finish"]
    assert AFTER_FINISH_EXTRA not in result.text
    assert result.terminal_events() == ["done"]
    assert result.last[1]["usage"] is not None, "the usage chunk after the finish is still read"


@pytest.mark.parametrize("scenario,reason", [("length", "length"), ("content_filter", "content_filter")])
def test_other_finish_reasons(app, scenario, reason):
    result = chat(app.chat_url, prompt(scenario))
    assert result.text == TEXTS[scenario]
    assert result.last == ("done", result.last[1])
    assert result.last[1]["finish_reason"] == reason


def test_upstream_asked_to_stream_with_usage_and_got_the_prompt(app, upstream):
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "[scenario:normal] Bonjour, ça va? 🙂"},
        ],
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 50,
        "seed": 7,
        "stop": ["END"],
    }
    assert chat(app.chat_url, body).status == 200
    sent = upstream.requests(last=1)[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["json"]["stream"] is True
    assert sent["json"]["stream_options"] == {"include_usage": True}
    assert sent["json"]["messages"] == body["messages"]
    assert sent["json"]["model"] == "gpt-test"
    for key in ("temperature", "top_p", "max_tokens", "seed", "stop"):
        assert sent["json"][key] == body[key]
    assert sent["headers"]["authorization"].startswith("Bearer ")


def test_prompt_becomes_one_user_message_and_model_is_passed(app, upstream):
    assert chat(app.chat_url, {"prompt": "[scenario:echo] hi there", "model": "my-model"}).status == 200
    sent = upstream.requests(last=1)[-1]["json"]
    assert sent["messages"] == [{"role": "user", "content": "[scenario:echo] hi there"}]
    assert sent["model"] == "my-model"


BAD_BODIES = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({}, None),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "hi", "top_p": -0.1}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"prompt": "hi", "stop": 3}, "stop"),
    ({"prompt": "hi", "stream": False}, "stream"),
    ({"prompt": 42}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name"),
    ({"messages": [{"role": "system", "content": "only a system message"}]}, "messages"),
    ([{"prompt": "hi"}], None),
]


@pytest.mark.parametrize("body,param", BAD_BODIES)
def test_invalid_requests_get_400_and_never_reach_upstream(app, upstream, body, param):
    before = upstream.count()
    result = chat(app.chat_url, body)
    assert result.status == 400, result.raw
    error = result.body["error"]
    assert error["type"] == "invalid_request"
    assert error["message"]
    assert error.get("param") == param
    assert upstream.count() == before


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"",
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": NaN}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_malformed_bodies_get_400(app, upstream, content):
    before = upstream.count()
    result = chat(app.chat_url, content=content)
    assert result.status == 400, result.raw
    assert result.body["error"]["type"] == "invalid_request"
    assert upstream.count() == before


def test_wrong_content_type_is_415(app):
    result = chat(app.chat_url, content=json.dumps({"prompt": "hi"}).encode(), headers={"content-type": "text/plain"})
    assert result.status == 415
    assert result.body["error"]["type"] == "unsupported_media_type"


def test_one_log_line_per_request(app):
    result = chat(app.chat_url, prompt("normal", "log me"))
    request_id = re.escape(result.headers["x-request-id"])  # this request's line, not another test's
    line = app.wait_log(r'\{"event": "chat_stream", "endpoint": "chat"[^\n]*"request_id": "' + request_id + r'"\}', 20)
    record = json.loads(line.group(0))
    assert record["deltas"] == len(NORMAL_DELTAS)
    assert record["model"] == "gpt-test"
    assert record["finish_reason"] == "stop"
    assert record["ttfd_ms"] is not None and record["duration_ms"] >= record["ttfd_ms"]
    assert record["usage"]["total_tokens"] > 0
    assert record["disconnected"] is False
