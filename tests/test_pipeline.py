"""The pipeline around the model call, through the local host: built-in steps switched on by
settings, and custom steps declared in a function_app.py (tests/apps/pipeline)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from chat import chat, prompt
from helpers import app_env
from servers import ROOT, App

from chatstream.guard import redact_whole
from tools.fakeupstream.scenarios import TEXTS

TERMS = ["reply.\n\nIt", "🚀 and 👍", "テキスト、中文", "café", "語のテ", "ñandú"]
SYSTEM = "You are terse. Réponds en français si on te parle français."


@pytest.fixture(scope="module")
def results_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline") / "results.jsonl"


@pytest.fixture(scope="module")
def piped(upstream, results_file):
    app = App(
        app_env(
            upstream,
            SYSTEM_PROMPT=SYSTEM,
            MAX_PROMPT_CHARS="300",
            BLOCKED_TERMS=",".join(TERMS),
            PIPELINE_RESULTS=str(results_file),
        ),
        app_dir=ROOT / "tests" / "apps" / "pipeline",
    )
    yield app
    app.stop()


def openai_stream_text(app, scenario: str) -> tuple[str, list[dict]]:
    chunks = []
    with httpx.Client(timeout=20) as client:
        with client.stream(
            "POST",
            app.url + "/api/v1/chat/completions",
            json={
                "model": "gpt-test",
                "stream": True,
                "messages": [{"role": "user", "content": f"[scenario:{scenario}] hi"}],
            },
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
    return text, chunks


@pytest.mark.parametrize("scenario", ["normal", "split_utf8"])
def test_blocked_terms_are_redacted_whatever_the_chunking(piped, scenario):
    expected = redact_whole(TEXTS[scenario], TERMS)
    assert expected != TEXTS[scenario] and "[redacted]" in expected
    result = chat(piped.chat_url, prompt(scenario))
    assert result.text == expected
    assert result.last[0] == "done"
    text, _ = openai_stream_text(piped, scenario)
    assert text == expected


def test_redaction_in_a_non_streamed_completion(piped):
    r = httpx.post(
        piped.url + "/api/v1/chat/completions",
        timeout=20,
        json={"model": "gpt-test", "messages": [{"role": "user", "content": "[scenario:normal] hi"}]},
    )
    assert r.json()["choices"][0]["message"]["content"] == redact_whole(TEXTS["normal"], TERMS)


def test_system_prompt_is_prepended(piped, upstream):
    chat(
        piped.chat_url,
        {
            "messages": [
                {"role": "system", "content": "Caller's own system message."},
                {"role": "user", "content": "[scenario:echo] hi"},
            ]
        },
    )
    sent = upstream.requests(last=1)[-1]["json"]["messages"]
    assert sent[0] == {"role": "system", "content": SYSTEM}
    assert sent[1] == {"role": "system", "content": "Caller's own system message."}


def test_long_prompt_is_413_before_any_upstream_call(piped, upstream):
    before = upstream.count()
    result = chat(piped.chat_url, {"prompt": "x" * 301})
    assert result.status == 413
    assert result.body["error"]["type"] == "prompt_too_long"
    assert upstream.count() == before
    assert chat(piped.chat_url, {"prompt": "[scenario:echo] " + "x" * 250}).status == 200


def test_rejection_by_a_before_step(piped, upstream):
    before = upstream.count()
    result = chat(piped.chat_url, {"prompt": "[reject] please"})
    assert result.status == 422
    assert result.body["error"] == {
        "type": "policy",
        "message": "this request is refused by policy",
        "retryable": False,
    }
    assert upstream.count() == before


def test_failing_before_step_is_a_500_naming_it(piped):
    result = chat(piped.chat_url, {"prompt": "[explode-before] hi"})
    assert result.status == 500
    assert result.body["error"]["type"] == "pipeline_error"
    assert "refuse_marked_requests" in result.body["error"]["message"]
    piped.wait_log(r"pipeline before-step refuse_marked_requests failed")


def test_failing_text_step_ends_the_stream_with_an_error_event(piped, upstream):
    result = chat(piped.chat_url, prompt("echo", "one two three bomb four"))
    assert result.status == 200
    assert result.text.startswith("You said:") and "bomb" not in result.text
    assert result.terminal_events() == ["error"]
    assert result.last[1]["error"]["type"] == "pipeline_error"
    assert "BombFilter" in result.last[1]["error"]["message"]
    piped.wait_log(r"pipeline text step BombFilter failed")


def test_moderation_hook_stops_the_stream_and_the_upstream(piped, upstream):
    result = chat(piped.chat_url, prompt("slow"))
    assert result.terminal_events() == ["error"]
    error = result.last[1]["error"]
    assert error["type"] == "content_filter"
    assert "'every two' is not allowed" in error["message"]
    assert result.text and "every two" not in result.text, "the text that failed the check was not sent"
    record = upstream.wait_stream_end("slow")
    assert record["outcome"] == "client_disconnected", "the upstream was closed before it finished"


def test_after_step_sees_the_result_without_delaying_the_caller(piped, results_file):
    started = time.monotonic()
    result = chat(piped.chat_url, prompt("normal", "after-step check"))
    caller_done = time.monotonic() - started
    assert caller_done < 2.0, f"the caller waited {caller_done:.2f}s (the after-step takes 3 s)"
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        lines = results_file.read_text().splitlines() if results_file.exists() else []
        records = [json.loads(line) for line in lines]
        found = [r for r in records if r["texts"].get("0") == result.text and r["endpoint"] == "chat"]
        if found:
            break
        time.sleep(0.05)
    assert found, "the after-step never recorded the stream"
    recorded = found[-1]
    assert recorded["texts"] == {"0": redact_whole(TEXTS["normal"], TERMS)}
    assert recorded["finish_reason"] == "stop"
    assert recorded["usage"]["total_tokens"] > 0
    assert recorded["disconnected"] is False and recorded["status"] == 200
    assert recorded["ttfd_ms"] is not None


def test_a_before_step_turning_streaming_off_on_api_chat_is_a_json_error(piped):
    """Latent bug (core reshape): this reached a NotImplementedError, a plain-text 500 with no log line."""
    result = chat(piped.chat_url, {"prompt": "[stream-off] hi"})
    assert result.status == 500
    assert result.body["error"]["type"] == "pipeline_error"
    assert "streaming off" in result.body["error"]["message"]
    piped.wait_log(r'"status": 500[^\n]*"error": "pipeline_error"')


def test_a_before_step_adding_an_unknown_parameter_to_a_non_streamed_call_is_a_json_error(piped, upstream):
    """Latent bug (core reshape): the SDK's create() raised a TypeError nothing caught. Now the parameter
    reaches the upstream like any other, and the upstream's 400 comes back in OpenAI's shape."""
    r = httpx.post(
        piped.url + "/api/v1/chat/completions",
        timeout=20,
        json={"messages": [{"role": "user", "content": "[add-param] [scenario:normal] hi"}]},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "bogus_param"
    assert upstream.requests(last=1)[0]["json"]["bogus_param"] == 1
    piped.wait_log(r'"endpoint": "openai"[^\n]*"status": 400[^\n]*"error": "invalid_request"')
