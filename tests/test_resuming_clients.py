"""SDKs that reconnect by themselves (issue #30 part 4, docs/resumable.md): unchanged SDKs (openai-python
sync and async, openai-node, the Vercel AI SDK) with one line at construction (clients/python's
transports, clients/js/chatstream-fetch.mjs) read a resumable answer whose connection is cut
mid-stream (tests/cut_proxy.py, once or twice) exactly: the upstream's whole text, one finish, one
usage, and the upstream asked once. Without that line each of them fails. Also: a resume answered
503 (the store paused, the resume on another instance) is retried after its Retry-After; a reconnect
that never gets through gives up after the bound with the SDK's connection error. The app is real
(tools/devhost, RESUMABLE_STREAMS=on, a real Azurite); the splice itself: tests/unit/test_resuming_splice.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from chatstream_client import AsyncResumingTransport, Backoff, ResumingTransport
from cut_proxy import CutProxy

from tools.fakeupstream.scenarios import TEXTS

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ROOT / "tests" / "clients"
SCENARIO = "slow_normal"  # 10 deltas 150 ms apart, multi-line, emoji, CJK: long enough to be cut twice
WHOLE = TEXTS[SCENARIO]
POST = b"POST /api/v1/chat/completions "
RESUME = b"GET /api/streams/"
FIRST_CUT = 900  # bytes of the answer: its headers, a first event or two, and a piece of the next
SECOND_CUT = 600  # of the first resume: its headers, an event, a piece of the next


def new_prompt() -> str:
    return f"[scenario:{SCENARIO}] {uuid.uuid4()}"


def arm(cut: CutProxy, drops: int) -> None:
    if drops >= 1:
        cut.cut(POST, FIRST_CUT)
    if drops == 2:
        cut.cut(RESUME, SECOND_CUT)


def assert_exact(cut: CutProxy, upstream, prompt: str, text: str, finishes: list, usages: int, drops: int) -> None:
    assert text == WHOLE
    assert finishes == ["stop"] and usages == 1  # one final event: one finish, one usage
    assert len(upstream.calls_for(prompt)) == 1  # resumed, not asked again
    assert len(cut.cut_at) == drops and cut.pending_cuts() == 0  # the cuts did happen
    assert cut.requests.count(b"POST /api/v1/chat/completions HTTP/1.1") == 1


# --- openai-python --------------------------------------------------------------------------------


def openai_python(base_url: str, transport: httpx.BaseTransport | None) -> openai.OpenAI:
    http_client = httpx.Client(transport=transport) if transport is not None else None
    return openai.OpenAI(base_url=base_url + "/api/v1", api_key="unused", max_retries=0, http_client=http_client)


def read_sync(client: openai.OpenAI, prompt: str, on_chunk=None) -> tuple[str, list, int]:
    text, finishes, usages = "", [], 0
    stream = client.chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        stream_options={"include_usage": True},
    )
    for k, chunk in enumerate(stream):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
        usages += chunk.usage is not None
        if on_chunk:
            on_chunk(k)
    return text, finishes, usages


def test_without_the_transport_openai_python_loses_the_answer(cut, upstream):
    prompt = new_prompt()
    arm(cut, 1)
    text = ""
    with pytest.raises(openai.APIConnectionError):
        for chunk in openai_python(cut.url, None).chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": prompt}], stream=True
        ):
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    assert text and WHOLE.startswith(text) and text != WHOLE


@pytest.mark.parametrize("drops", [1, 2])
def test_openai_python_sync_reads_the_whole_answer_through_cuts(cut, upstream, drops):
    prompt = new_prompt()
    arm(cut, drops)
    with openai_python(cut.url, ResumingTransport()) as client:
        text, finishes, usages = read_sync(client, prompt)
    assert_exact(cut, upstream, prompt, text, finishes, usages, drops)
    assert sum(line.startswith(RESUME) for line in cut.requests) == drops


@pytest.mark.parametrize("drops", [1, 2])
def test_openai_python_async_reads_the_whole_answer_through_cuts(cut, upstream, drops):
    prompt = new_prompt()
    arm(cut, drops)

    async def read() -> tuple[str, list, int]:
        text, finishes, usages = "", [], 0
        http_client = httpx.AsyncClient(transport=AsyncResumingTransport())
        async with openai.AsyncOpenAI(
            base_url=cut.url + "/api/v1", api_key="unused", max_retries=0, http_client=http_client
        ) as client:
            stream = await client.chat.completions.create(
                model="gpt-test",
                messages=[{"role": "user", "content": prompt}],
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    if choice.finish_reason:
                        finishes.append(choice.finish_reason)
                usages += chunk.usage is not None
        return text, finishes, usages

    text, finishes, usages = asyncio.run(read())
    assert_exact(cut, upstream, prompt, text, finishes, usages, drops)


def test_the_chat_route_through_httpx_with_the_transport(cut, upstream):
    """/api/chat (its own events: delta, then ``event: done``) through a plain httpx client."""
    prompt = new_prompt()
    cut.cut(b"POST /api/chat ", 400)
    with (
        httpx.Client(transport=ResumingTransport(), timeout=30) as client,
        client.stream("POST", cut.url + "/api/chat", json={"prompt": prompt}) as response,
    ):
        body = response.read().decode()
    events = [block for block in body.split("\n\n") if block.startswith("id: ")]
    deltas = [json.loads(e.split("data: ", 1)[1])["delta"] for e in events if "event: " not in e]
    assert "".join(deltas) == WHOLE
    assert [int(e.split("\n")[0][4:]) for e in events] == list(range(1, len(events) + 1))  # no gap, none twice
    assert sum("event: done" in e for e in events) == 1 and "event: done" in events[-1]
    assert len(upstream.calls_for(prompt)) == 1 and len(cut.cut_at) == 1


def test_a_resume_answered_503_is_retried_after_its_retry_after(cut, upstream, azurite, start_app):
    """The resume goes to another instance (a load balancer's choice; here ``streams_url``), and the
    store is paused: that instance cannot open the stream and answers 503 stream_store_unavailable
    with Retry-After: 1. The transport waits for it, tries again once the store is back, and the
    answer is exact."""
    other = start_app(AzureWebJobsStorage=azurite.connection_string, RESUMABLE_STREAMS="on")
    watch = CutProxy(urlsplit(other.url).port)  # no cuts: it records the other instance's answers
    prompt = new_prompt()
    arm(cut, 1)
    transport = ResumingTransport(streams_url=watch.url + "/api/streams/{id}")
    paused = threading.Event()
    stop_watching = threading.Event()

    def pause(k: int) -> None:
        if k == 1:  # the stream's record is written by now; its first events went out
            os.kill(azurite.node_pid, signal.SIGSTOP)
            paused.set()

    def resume_the_store_after_a_503() -> None:
        while not stop_watching.wait(0.01):
            if any(b" 503 " in line for _, line in watch.responses):
                os.kill(azurite.node_pid, signal.SIGCONT)
                return

    watcher = threading.Thread(target=resume_the_store_after_a_503, daemon=True)
    watcher.start()
    try:
        with openai_python(cut.url, transport) as client:
            text, finishes, usages = read_sync(client, prompt, on_chunk=pause)
    finally:
        stop_watching.set()
        os.kill(azurite.node_pid, signal.SIGCONT)
        watch.close()
    assert paused.is_set()
    assert_exact(cut, upstream, prompt, text, finishes, usages, 1)
    statuses = [(at, line.split()[1]) for at, line in watch.responses]
    assert [s for _, s in statuses] == [b"503", b"200"], statuses
    assert statuses[1][0] - statuses[0][0] >= 1.0  # its Retry-After: 1 (the backoff alone: 0.5 s)


def test_giving_up_after_the_bound_raises_the_sdks_connection_error(cut, upstream):
    """Every reconnect is refused: after the bound (here 3 reconnects: 0.25 + 0.5 + 1 s of waits) the
    SDK raises its connection error, as it does without the transport, with the text so far."""
    prompt = new_prompt()
    arm(cut, 1)
    backoff = Backoff(max_attempts=3)
    text_so_far = []

    def refuse_from_now(k: int) -> None:
        if k == 0:  # the answer's connection is open: every new one is reset from now on
            cut.refuse(60)

    with openai_python(cut.url, ResumingTransport(backoff=backoff)) as client, pytest.raises(openai.APIConnectionError):
        stream = client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": prompt}], stream=True
        )
        for k, chunk in enumerate(stream):
            text_so_far.append((chunk.choices[0].delta.content or "") if chunk.choices else "")
            refuse_from_now(k)
    gave_up_after = time.time() - cut.cut_at[0]
    cut.refuse(0)
    text = "".join(text_so_far)
    assert text and WHOLE.startswith(text) and text != WHOLE
    assert cut.refused == 3  # three reconnects, no more
    assert 1.7 <= gave_up_after < 10, gave_up_after  # its waits: 0.25 + 0.5 + 1 s
    assert len(upstream.calls_for(prompt)) == 1


# --- openai-node and the AI SDK ---------------------------------------------------------------------


def npm_ci(folder: Path, marker: str) -> None:
    if not (folder / "node_modules" / marker).is_dir():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=folder, check=True, timeout=300
        )


@pytest.fixture(scope="module")
def openai_node() -> Path:
    """openai (npm, tests/clients/openai, pinned by its package-lock.json): one streamed completion."""
    npm_ci(CLIENTS / "openai", "openai")
    return CLIENTS / "openai" / "stream.mjs"


@pytest.fixture(scope="module")
def ai_sdk() -> Path:
    """The Vercel AI SDK (tests/clients/aisdk): one streamText call on chat completions."""
    npm_ci(CLIENTS / "aisdk", "ai")
    return CLIENTS / "aisdk" / "stream.mjs"


def run_node(script: Path, base_url: str, prompt: str, **options) -> dict:
    run = subprocess.run(
        ["node", str(script), base_url + "/api/v1", prompt, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.strip(), run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["log"] = run.stderr
    return result


@pytest.mark.parametrize("drops", [0, 1, 2])
def test_openai_node_reads_the_whole_answer_through_cuts(cut, upstream, openai_node, drops):
    prompt = new_prompt()
    arm(cut, drops)
    result = run_node(openai_node, cut.url, prompt)
    assert result["ok"], result
    assert_exact(cut, upstream, prompt, result["text"], result["finishes"], result["usages"], drops)


def test_without_the_wrapper_openai_node_loses_the_answer(cut, upstream, openai_node):
    prompt = new_prompt()
    arm(cut, 1)
    result = run_node(openai_node, cut.url, prompt, plain=True)
    assert not result["ok"] and result["text"] != WHOLE and WHOLE.startswith(result["text"]), result


def test_openai_node_gives_up_after_the_bound(cut, upstream, openai_node):
    prompt = new_prompt()
    arm(cut, 1)

    def refuse_once_the_answer_is_open() -> None:
        wait_for(lambda: cut.requests)
        cut.refuse(60)

    threading.Thread(target=refuse_once_the_answer_is_open, daemon=True).start()
    try:
        result = run_node(openai_node, cut.url, prompt, maxAttempts=3)
    finally:
        cut.refuse(0)
    assert not result["ok"] and WHOLE.startswith(result["text"]) and result["text"] != WHOLE, result
    assert "terminated" in (result["message"] + str(result["cause"])), result
    assert cut.refused == 3 and "giving up: 3 reconnects failed" in result["log"], result


@pytest.mark.parametrize("drops", [0, 1, 2])
def test_the_ai_sdk_reads_the_whole_answer_through_cuts(cut, upstream, ai_sdk, drops):
    prompt = new_prompt()
    arm(cut, drops)
    result = run_node(ai_sdk, cut.url, prompt)
    assert result["ok"], result
    assert result["text"] == WHOLE
    assert result["finishes"] == ["stop"]  # one finish part
    assert len(upstream.calls_for(prompt)) == 1
    assert len(cut.cut_at) == drops and cut.pending_cuts() == 0


def test_without_the_wrapper_the_ai_sdk_loses_the_answer(cut, upstream, ai_sdk):
    prompt = new_prompt()
    arm(cut, 1)
    result = run_node(ai_sdk, cut.url, prompt, plain=True)
    assert not result["ok"] and result["text"] != WHOLE and WHOLE.startswith(result["text"]), result


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
