"""The C# console client (client_cs/), built with Mono's mcs and run with `mono`.

Two kinds of tests:
- against the real function app (`app` fixture) and the scripted upstream (`upstream`), choosing a
  scenario with a `[scenario:NAME]` marker in the prompt;
- against a tiny canned HTTP server in this file, which records request headers and bodies and
  answers with hand-written SSE bytes (CRLF, comments, multi-line data, error endings, ...).

The whole module is skipped when Mono cannot be installed on this machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLIENT_DIR = ROOT / "client_cs"
EXE = CLIENT_DIR / "bin" / "chat.exe"

# Building may have to apt-get install mono-devel first (minutes, once per machine); every
# client run below has its own short subprocess timeout, so nothing can hang for this long.
pytestmark = pytest.mark.timeout(900)

EXIT_OK, EXIT_STREAM_ERROR, EXIT_HTTP_ERROR, EXIT_CONNECT = 0, 1, 2, 3
EXIT_USAGE, EXIT_CANCELLED = 64, 130

STATS_LINES = [
    r"^stats: time to first delta: \d+ ms$",
    r"^stats: total time: \d+ ms$",
    r"^stats: deltas: \d+$",
    r"^stats: finish reason: \S+$",
    r"^stats: tokens: (unknown|prompt \d+, completion \d+, total \d+)$",
]


# ---------------------------------------------------------------------------------------------
# building and running the client


@pytest.fixture(scope="session")
def chat_exe() -> Path:
    """Builds client_cs/bin/chat.exe with mcs once per session (build.sh installs Mono if needed)."""
    env = dict(os.environ, CHAT_BUILD_WITH="mcs")
    try:
        proc = subprocess.run(
            ["bash", str(CLIENT_DIR / "build.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=840,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.skip("client_cs: building with mcs (and installing mono-devel) took too long")
    if shutil.which("mono") is None or shutil.which("mcs") is None:
        pytest.skip(
            "client_cs: Mono (mono-devel) is not installed and could not be installed "
            f"with apt-get:\n{proc.stdout}\n{proc.stderr}"
        )
    assert proc.returncode == 0, f"build.sh failed:\n{proc.stdout}\n{proc.stderr}"
    assert EXE.is_file()
    return EXE


def _client_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CHAT_URL", "FUNCTION_KEY", "CALLER_KEY")}
    env.update(extra or {})
    return env


def run_chat(
    exe: Path, *args: str, stdin: bytes | None = None, env: dict | None = None, timeout: float = 30
) -> subprocess.CompletedProcess:
    """Runs the client to completion; stdout/stderr are bytes. stdin is /dev/null unless given."""
    return subprocess.run(
        ["mono", str(exe), *args],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        env=_client_env(env),
        timeout=timeout,
    )


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------
# a canned SSE server, independent of the app


class CannedServer:
    """HTTP server on 127.0.0.1 that records each request and answers with `self.response`.

    `response` is (status, content_type, parts): parts is a list of bytes written one at a time
    with a flush (chunked transfer encoding), or the string "STALL" for "wait until the client
    hangs up". The time at which a stalled client hung up is put in `disconnects`.
    """

    def __init__(self):
        self.requests: list[dict] = []
        self.disconnects: list[float] = []
        self.response = (200, "text/event-stream; charset=utf-8", [b"event: done\ndata: {}\n\n"])
        # A resumable stream (see `resumable`): the POST's x-stream-id, the answers of the successive
        # GET streams/ID requests, and what was asked of streams/ID and streams/ID/cancel.
        self.stream_id: str | None = None
        self.resumes: list[tuple[int, str, list]] = []
        self.gets: list[dict] = []
        self.cancels: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                record = {
                    "path": self.path,
                    "headers": dict(self.headers.items()),
                    "at": time.monotonic(),
                    "lower_headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body,
                }
                if self.path.endswith("/cancel"):
                    server.cancels.append(record)
                    self._answer(202, "application/json", [b'{"cancelled": true}'])
                    return
                server.requests.append(dict(record, json=json.loads(body)))
                self._answer(*server.response, stream_id=server.stream_id)

            def do_GET(self):
                server.gets.append(
                    {
                        "path": self.path,
                        "at": time.monotonic(),
                        "lower_headers": {k.lower(): v for k, v in self.headers.items()},
                    }
                )
                if server.resumes:
                    self._answer(*server.resumes.pop(0))
                else:
                    self._answer(
                        404, "application/json", [b'{"error": {"type": "not_found", "message": "no such stream"}}']
                    )

            def _answer(self, status, ctype, parts, stream_id=None):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Transfer-Encoding", "chunked")
                if stream_id:
                    self.send_header("x-stream-id", stream_id)
                self.end_headers()
                try:
                    for part in parts:
                        if part == "STALL":
                            self._wait_for_hangup()
                            return
                        if part == "CUT":  # the connection drops: a reset, the chunked body unfinished
                            self.wfile.flush()
                            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                            self.connection.close()
                            self.close_connection = True
                            return
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        self.wfile.flush()
                        time.sleep(0.01)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    server.disconnects.append(time.monotonic())
                self.close_connection = True

            def _wait_for_hangup(self):
                sock = self.connection
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    readable, _, _ = select.select([sock], [], [], 0.02)
                    if readable:
                        try:
                            if sock.recv(1024) == b"":
                                break
                        except OSError:
                            break
                else:
                    return
                server.disconnects.append(time.monotonic())
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/api/chat"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, parts, status: int = 200, content_type: str = "text/event-stream; charset=utf-8"):
        self.requests.clear()
        self.disconnects.clear()
        self.gets.clear()
        self.cancels.clear()
        self.stream_id = None
        self.resumes = []
        self.response = (status, content_type, _encode(parts))

    def resumable(self, stream_id: str, parts, resumes=()):
        """The POST answers with x-stream-id and `parts`; the successive GET streams/ID with `resumes`
        (each a list of parts, or an int: that status), then 404."""
        self.answer(parts)
        self.stream_id = stream_id
        self.resumes = [
            (r, "application/json", [b'{"error": {"type": "x", "message": "unavailable"}}'])
            if isinstance(r, int)
            else (200, "text/event-stream; charset=utf-8", _encode(r))
            for r in resumes
        ]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _encode(parts) -> list:
    return [p.encode() if isinstance(p, str) and p not in ("STALL", "CUT") else p for p in parts]


@pytest.fixture(scope="module")
def canned():
    server = CannedServer()
    yield server
    server.close()


def delta(text: str) -> str:
    return "data: " + json.dumps({"delta": text}) + "\n\n"


DONE = (
    'event: done\ndata: {"finish_reason": "stop", "usage": {"prompt_tokens": 1, '
    '"completion_tokens": 2, "total_tokens": 3}, "model": "m1", "id": "r1"}\n\n'
)


# ---------------------------------------------------------------------------------------------
# arguments


def test_help_exits_0_and_explains_everything(chat_exe):
    proc = run_chat(chat_exe, "--help")
    assert proc.returncode == EXIT_OK
    text = proc.stdout.decode()
    for word in (
        "--url",
        "--key",
        "--system",
        "--model",
        "--stats",
        "CHAT_URL",
        "FUNCTION_KEY",
        "x-functions-key",
        "64",
        "130",
        "--allow-insecure-key",
        "--caller-key",
        "CALLER_KEY",
        "Authorization: Bearer KEY",
    ):
        assert word in text


@pytest.mark.parametrize(
    "args",
    [
        ["--bogus", "hi"],
        ["--url"],
        ["--url", "not a url", "hi"],
        [],  # no prompt words and an empty stdin
    ],
)
def test_bad_arguments_exit_64_with_usage_on_stderr(chat_exe, args):
    proc = run_chat(chat_exe, *args)
    assert proc.returncode == EXIT_USAGE
    assert proc.stdout == b""
    assert b"usage: chat" in proc.stderr


# ---------------------------------------------------------------------------------------------
# against the canned server: request shape and SSE parsing


def test_key_prompt_and_headers_are_sent(chat_exe, canned):
    canned.answer([delta("ok"), DONE])
    proc = run_chat(chat_exe, "--url", canned.url, "--key", "K-123", "hello", "big", "world")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"ok\n"
    [req] = canned.requests
    assert req["lower_headers"]["x-functions-key"] == "K-123"
    assert req["lower_headers"]["content-type"].startswith("application/json")
    assert req["json"] == {"prompt": "hello big world"}


def test_environment_defaults_for_url_and_key(chat_exe, canned):
    canned.answer([delta("ok"), DONE])
    proc = run_chat(chat_exe, "hi", env={"CHAT_URL": canned.url, "FUNCTION_KEY": "from-env"})
    assert proc.returncode == EXIT_OK, proc.stderr
    [req] = canned.requests
    assert req["lower_headers"]["x-functions-key"] == "from-env"


def test_no_key_no_header(chat_exe, canned):
    canned.answer([delta("ok"), DONE])
    proc = run_chat(chat_exe, "--url", canned.url, "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "x-functions-key" not in canned.requests[0]["lower_headers"]


def test_system_sends_messages_and_model(chat_exe, canned):
    canned.answer([delta("ok"), DONE])
    proc = run_chat(
        chat_exe, "--url", canned.url, "--system", 'Be terse / "exact" 🙂', "--model", "gpt-x", "What", "now?"
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    assert canned.requests[0]["json"] == {
        "messages": [{"role": "system", "content": 'Be terse / "exact" 🙂'}, {"role": "user", "content": "What now?"}],
        "model": "gpt-x",
    }


def test_prompt_from_stdin(chat_exe, canned):
    canned.answer([delta("ok"), DONE])
    proc = run_chat(chat_exe, "--url", canned.url, stdin="line 1\nzwei 🙂\n".encode())
    assert proc.returncode == EXIT_OK, proc.stderr
    assert canned.requests[0]["json"] == {"prompt": "line 1\nzwei 🙂"}


def test_crlf_comments_multiline_data_and_unknown_fields(chat_exe, canned):
    canned.answer(
        [
            ": keep-alive\r\n\r\n",
            'data: {"delta":\r\ndata:  "line 1\\n"}\r\n\r\n',  # two data lines joined with \n
            "id: 7\r\nretry: 1000\r\nfoo: bar\r\n",  # fields with no data: nothing
            "\r\n",
            'data:{"delta": "\\n\\nline 3 \\u00e9\\ud83d\\ude80"}\r\n',  # no space after the colon
            ": a comment inside an event\r\n\r\n",
            "event: future-thing\r\ndata: {}\r\n\r\n",  # unknown event types are ignored
            DONE.replace("\n", "\r\n"),
        ]
    )
    proc = run_chat(chat_exe, "--url", canned.url, "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == "line 1\n\n\nline 3 é🚀\n".encode()


def test_character_split_across_chunks(chat_exe, canned):
    raw = ("data: " + json.dumps({"delta": "🙂中é"}, ensure_ascii=False) + "\n\n").encode()
    canned.answer([raw[i : i + 1] for i in range(len(raw))] + [DONE])
    proc = run_chat(chat_exe, "--url", canned.url, "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == "🙂中é\n".encode()


def test_error_event_exits_1_with_message(chat_exe, canned):
    canned.answer(
        [
            delta("partial"),
            'event: error\ndata: {"error": {"type": "upstream_error", '
            '"message": "the model broke", "retryable": true}}\n\n',
        ]
    )
    proc = run_chat(chat_exe, "--url", canned.url, "hi")
    assert proc.returncode == EXIT_STREAM_ERROR
    assert proc.stdout == b"partial\n"
    assert b"the model broke" in proc.stderr


def test_stream_without_done_exits_1_and_says_so(chat_exe, canned):
    canned.answer([delta("partial"), 'event: done\ndata: {"finish_reason": "stop"}\n'])  # no blank line
    proc = run_chat(chat_exe, "--url", canned.url, "hi")
    assert proc.returncode == EXIT_STREAM_ERROR
    assert proc.stdout == b"partial\n"
    assert b"without a done or error event" in proc.stderr


def test_http_error_exits_2_with_status_and_message(chat_exe, canned):
    body = json.dumps({"error": {"type": "invalid_request", "message": "prompt is too long", "param": "prompt"}})
    canned.answer([body], status=400, content_type="application/json")
    proc = run_chat(chat_exe, "--url", canned.url, "hi")
    assert proc.returncode == EXIT_HTTP_ERROR
    assert proc.stdout == b""
    assert b"400" in proc.stderr and b"prompt is too long" in proc.stderr


def test_stats_on_stderr(chat_exe, canned):
    canned.answer([delta("a"), delta("b"), DONE])
    proc = run_chat(chat_exe, "--url", canned.url, "--stats", "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"ab\n"
    lines = proc.stderr.decode().splitlines()
    for pattern in STATS_LINES:
        assert any(re.match(pattern, line) for line in lines), (pattern, lines)
    assert "stats: deltas: 2" in lines
    assert "stats: finish reason: stop" in lines
    assert "stats: tokens: prompt 1, completion 2, total 3" in lines


def test_done_members_in_any_order_and_unknown_members(chat_exe, canned):
    canned.answer(
        [
            'data: {"extra": [1, {"a": null}], "delta": "x"}\n\n',
            'event: done\ndata: {"id": "r2", "future": {"b": [true]}, "usage": {"total_tokens": 9, '
            '"prompt_tokens": 4, "completion_tokens": 5}, "model": "m2", "finish_reason": "length"}\n\n',
        ]
    )
    proc = run_chat(chat_exe, "--url", canned.url, "--stats", "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"x\n"
    lines = proc.stderr.decode().splitlines()
    assert "stats: finish reason: length" in lines
    assert "stats: tokens: prompt 4, completion 5, total 9" in lines
    assert "stats: model: m2 (id r2)" in lines


# ---------------------------------------------------------------------------------------------
# resumable streams (RESUMABLE_STREAMS=on), against the canned server: a POST answered with
# x-stream-id and numbered events, dropped ("CUT": a reset in the middle of the chunked body), then
# GET /api/streams/ID answered as each test scripts it


SID = "s7Kq2_mZ-0bX9aR4tY1uVw"


def ev(n: int, text: str) -> str:
    return f"id: {n}\n" + delta(text)


def done_ev(n: int, finish: str = "stop") -> str:
    return f"id: {n}\n" + DONE.replace('"finish_reason": "stop"', f'"finish_reason": "{finish}"')


def test_resumable_drop_reconnects_with_last_event_id_and_prints_each_delta_once(chat_exe, canned):
    """Cut inside event 4: the client asks streams/ID with Last-Event-ID: 3 (the last whole event);
    the replay starts too early (from 2), and what was printed already is skipped by its id."""
    canned.resumable(
        SID,
        [ev(1, "a"), ev(2, "b"), ev(3, "c"), 'id: 4\ndata: {"delta": "d', "CUT"],
        resumes=[[ev(2, "b"), ev(3, "c"), ev(4, "d"), ev(5, "e"), done_ev(6)]],
    )
    proc = run_chat(chat_exe, "--url", canned.url, "--stats", "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"abcde\n"
    [get] = canned.gets
    assert get["path"] == f"/api/streams/{SID}"
    assert get["lower_headers"]["last-event-id"] == "3"
    err = proc.stderr.decode().splitlines()
    assert f"chat: resumable stream {SID}" in err
    assert any(
        re.match(
            r"^chat: connection lost after event 3: the connection broke .*; reconnecting in 0\.5 s "
            r"\(attempt 1 of 5\)$",
            line,
        )
        for line in err
    ), err
    assert f"stats: stream id: {SID} (last event 6)" in err
    assert "stats: reconnects: 1" in err and "stats: deltas: 5" in err and "stats: finish reason: stop" in err
    assert canned.cancels == []


@pytest.mark.parametrize("kind", ["stream_store_unavailable", "stream_moved"])
def test_a_reading_that_ends_is_a_lost_connection_not_the_end(chat_exe, canned, kind):
    """`stream_store_unavailable` (the app could not reach its store) and `stream_moved` (the instance
    stops; the stream goes on on another) end one reading of the stream, not the stream: the client asks
    again after the last event it printed."""
    unavailable = (
        "event: error\ndata: "
        + json.dumps({"error": {"type": kind, "message": "this reading ends", "retryable": True}})
        + "\n\n"
    )
    canned.resumable(SID, [ev(1, "a"), ev(2, "b"), unavailable], resumes=[[ev(3, "c"), done_ev(4)]])
    proc = run_chat(chat_exe, "--url", canned.url, "--stats", "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"abc\n"
    assert [g["lower_headers"]["last-event-id"] for g in canned.gets] == ["2"]
    assert f"({kind}); reconnecting in 0.5 s" in proc.stderr.decode()


def test_without_a_stream_id_a_drop_is_not_retried(chat_exe, canned):
    """No x-stream-id (RESUMABLE_STREAMS off): as before, a cut-off answer, exit 1, no GET."""
    canned.answer([ev(1, "a"), "CUT"])
    proc = run_chat(chat_exe, "--url", canned.url, "--stats", "hi")
    assert proc.returncode == EXIT_STREAM_ERROR
    assert proc.stdout == b"a\n"
    assert canned.gets == []
    assert "the connection broke before a done or error event" in proc.stderr.decode()
    assert "--resume" not in proc.stderr.decode() and "stats: stream id" not in proc.stderr.decode()


def test_reconnection_attempts_are_bounded_with_backoff(chat_exe, canned):
    """Every attempt fails (503, a refused body): --retries 2 gives up after two, 0.5 s and 1 s apart,
    exits 1 and says how to continue the stream."""
    canned.resumable(SID, [ev(1, "a"), ev(2, "b"), "CUT"], resumes=[503, [ev(2, "b"), "CUT"], [ev(3, "never")]])
    started = time.monotonic()
    proc = run_chat(chat_exe, "--url", canned.url, "--retries", "2", "--stats", "hi")
    assert proc.returncode == EXIT_STREAM_ERROR, proc.stderr
    assert proc.stdout == b"ab\n"
    err = proc.stderr.decode()
    assert len(canned.gets) == 2 and [g["lower_headers"]["last-event-id"] for g in canned.gets] == ["2", "2"]
    assert canned.gets[0]["at"] - started >= 0.5 and canned.gets[1]["at"] - canned.gets[0]["at"] >= 1.0
    assert (
        "reconnecting in 0.5 s (attempt 1 of 2)" in err
        and "reconnecting in 1.0 s (attempt 2 of 2)" in err
        and "reconnection failed after event 2: HTTP 503" in err
    )
    assert "(2 reconnection attempts failed)" in err
    assert f"To continue it: chat --resume {SID} --last-event-id 2" in err
    assert "stats: reconnects: 2" in err
    # Without --stats the attempts are silent; the end says the same.
    canned.resumable(SID, [ev(1, "a"), "CUT"], resumes=[503])
    proc = run_chat(chat_exe, "--url", canned.url, "--retries", "1", "hi")
    assert proc.returncode == EXIT_STREAM_ERROR and proc.stdout == b"a\n"
    assert "reconnecting" not in proc.stderr.decode() and f"--resume {SID} --last-event-id 1" in proc.stderr.decode()


def test_an_attempt_that_brings_events_starts_the_count_again(chat_exe, canned):
    """Four drops in one answer with --retries 1: each reconnection brings new events, so none of
    them counts against the next."""
    canned.resumable(
        SID,
        [ev(1, "a"), "CUT"],
        resumes=[
            [ev(2, "b"), "CUT"],
            [ev(3, "c"), 'id: 4\ndata: {"del', "CUT"],
            [ev(4, "d"), "CUT"],
            [ev(5, "e"), done_ev(6)],
        ],
    )
    proc = run_chat(chat_exe, "--url", canned.url, "--retries", "1", "--stats", "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"abcde\n"
    assert [g["lower_headers"]["last-event-id"] for g in canned.gets] == ["1", "2", "3", "4"]
    assert "stats: reconnects: 4" in proc.stderr.decode().splitlines()


def test_a_stream_that_is_gone_is_not_retried(chat_exe, canned):
    """404 on streams/ID (expired, or another caller's): no more attempts, exit 2."""
    canned.resumable(SID, [ev(1, "a"), "CUT"], resumes=[])
    proc = run_chat(chat_exe, "--url", canned.url, "hi")
    assert proc.returncode == EXIT_HTTP_ERROR, proc.stderr
    assert proc.stdout == b"a\n"
    assert len(canned.gets) == 1 and b"HTTP 404" in proc.stderr


def test_resume_by_id_from_the_start_or_after_an_event(chat_exe, canned):
    canned.resumable(SID, [], resumes=[[ev(1, "a"), ev(2, "b"), done_ev(3)], [ev(3, "c"), done_ev(4)]])
    proc = run_chat(chat_exe, "--url", canned.url, "--resume", SID)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"ab\n"
    proc = run_chat(chat_exe, "--url", canned.url, f"--resume={SID}", "--last-event-id", "2", "--stats")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"c\n"
    assert canned.requests == [], "no prompt was sent"
    assert [g["path"] for g in canned.gets] == [f"/api/streams/{SID}"] * 2
    assert "last-event-id" not in canned.gets[0]["lower_headers"]  # from the start
    assert canned.gets[1]["lower_headers"]["last-event-id"] == "2"
    assert f"stats: stream id: {SID} (last event 4)" in proc.stderr.decode().splitlines()
    # Unknown or expired: 404, exit 2, said so.
    proc = run_chat(chat_exe, "--url", canned.url, "--resume", SID)
    assert proc.returncode == EXIT_HTTP_ERROR and proc.stdout == b""
    assert b"HTTP 404" in proc.stderr and b"unknown or has expired" in proc.stderr


def test_resume_keeps_the_key_and_the_query_and_sends_the_key_only_as_before(chat_exe, canned):
    canned.resumable(SID, [], resumes=[[ev(1, "a"), done_ev(2)]])
    proc = run_chat(chat_exe, "--url", canned.url + "?code=Q1", "--key", "K-9", "--resume", SID)
    assert proc.returncode == EXIT_OK, proc.stderr
    [get] = canned.gets
    assert get["path"] == f"/api/streams/{SID}?code=Q1" and get["lower_headers"]["x-functions-key"] == "K-9"


@pytest.mark.parametrize(
    "args",
    [
        ["--resume", "../../etc", "hi"][:2],
        ["--resume", "short"],
        ["--resume", SID, "hi"],
        ["--resume", SID, "--system", "s"],
        ["--last-event-id", "3", "hi"],
        ["--resume", SID, "--last-event-id", "-1"],
        ["--resume", SID, "--last-event-id", "1e3"],
        ["--retries", "101", "hi"],
        ["--retries", "x", "hi"],
    ],
)
def test_bad_resume_arguments_exit_64(chat_exe, args):
    proc = run_chat(chat_exe, *args)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert b"usage: chat" in proc.stderr


def test_a_cancelled_end_exits_1_and_says_so(chat_exe, canned):
    """Cancelled by someone else (another client, or the app after nobody read it): not a normal end."""
    canned.resumable(SID, [ev(1, "a"), done_ev(2, finish="cancelled")])
    proc = run_chat(chat_exe, "--url", canned.url, "--stats", "hi")
    assert proc.returncode == EXIT_STREAM_ERROR
    assert proc.stdout == b"a\n"
    assert "stats: finish reason: cancelled" in proc.stderr.decode().splitlines()
    assert b"cancelled the stream before its end" in proc.stderr


@pytest.mark.parametrize("terminal", [False, True])
def test_sigint_cancels_a_resumable_stream(chat_exe, canned, terminal):
    """A hang-up no longer stops a resumable stream, so Ctrl+C sends POST streams/ID/cancel, then
    exits 130. Also under Mono without a terminal, where Console.CancelKeyPress never runs: once the
    stream is resumable, the client catches SIGINT itself (Mono.Posix's UnixSignal)."""
    canned.resumable(SID, [ev(1, "first"), "STALL"])
    with _interrupted_client(["mono", str(chat_exe), "--url", canned.url, "--stats", "hi"], terminal) as (proc, out):
        assert b"first" in _read_until_text(out)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        stderr = proc.stderr.read().decode()
    assert proc.returncode == EXIT_CANCELLED, stderr
    [cancel] = canned.cancels
    assert cancel["path"] == f"/api/streams/{SID}/cancel" and cancel["at"] - sent < 2
    assert "chat: cancelled" in stderr and "stats: finish reason: cancelled" in stderr
    assert "could not cancel" not in stderr
    assert wait_for(lambda: canned.disconnects, 2)


def test_closed_stdout_cancels_a_resumable_stream(chat_exe, canned):
    canned.resumable(SID, [ev(1, "first ")] + [ev(n, "more ") for n in range(2, 3000)] + ["STALL"])
    assert _close_stdout_after_first(chat_exe, canned.url, _client_env()) == 141
    assert [c["path"] for c in canned.cancels] == [f"/api/streams/{SID}/cancel"]


# ---------------------------------------------------------------------------------------------
# the function key never goes over plain HTTP to another machine


def own_address() -> str:
    """An address that is not a loopback address to the client's check (IPAddress.IsLoopback is false
    for 0.0.0.0) but that Linux connects to on this machine itself (as 127.0.0.1), so no packet ever
    leaves the loopback interface. Every test server listens on 127.0.0.1, and the port used is
    closed, so an attempt is refused at once: exit 3 means "it tried", exit 2 with the message "it
    did not"."""
    return "0.0.0.0"


def _connects_to_the_network(exe: Path, *args: str, env: dict | None = None) -> tuple[int, list[str]]:
    """Runs the client under strace; its exit code and every connect() to an IP address."""
    trace = Path(f"/tmp/chat-strace-{os.getpid()}-{time.monotonic_ns()}.txt")
    try:
        proc = subprocess.run(
            ["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace), "mono", str(exe), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=_client_env(env),
            timeout=30,
        )
        lines = trace.read_text(errors="replace").splitlines() if trace.exists() else []
    finally:
        trace.unlink(missing_ok=True)
    return proc.returncode, [line for line in lines if "AF_INET" in line]


def test_key_over_plain_http_to_another_host_is_refused_before_any_connection(chat_exe):
    address = own_address()
    url = f"http://{address}:{closed_port()}/api/chat"
    proc = run_chat(chat_exe, "--url", url, "--key", "K-SECRET-123", "hi")
    assert proc.returncode == EXIT_HTTP_ERROR, proc.stderr  # 2: refused, nothing sent
    err = proc.stderr.decode()
    assert "refusing to send the function key" in err and "--allow-insecure-key" in err and address in err
    assert "K-SECRET-123" not in err
    assert proc.stdout == b""
    # The key from the environment is protected the same way.
    proc = run_chat(chat_exe, "--url", url, "hi", env={"FUNCTION_KEY": "K-SECRET-123"})
    assert proc.returncode == EXIT_HTTP_ERROR and b"refusing to send the function key" in proc.stderr
    # With the flag it really tries (this machine refuses the connection: exit 3), and so it does
    # without a key (nothing to protect), or over https.
    proc = run_chat(chat_exe, "--url", url, "--key", "K-SECRET-123", "--allow-insecure-key", "hi")
    assert proc.returncode == EXIT_CONNECT, proc.stderr
    assert run_chat(chat_exe, "--url", url, "hi").returncode == EXIT_CONNECT
    https = f"https://{address}:{closed_port()}/api/chat"
    assert run_chat(chat_exe, "--url", https, "--key", "K", "hi").returncode == EXIT_CONNECT
    # A name that would need a DNS query is refused before the query too.
    proc = run_chat(chat_exe, "--url", "http://example.invalid/api/chat", "--key", "K", "hi")
    assert proc.returncode == EXIT_HTTP_ERROR and b"example.invalid" in proc.stderr, proc.stderr
    if shutil.which("strace"):
        code, connects = _connects_to_the_network(
            chat_exe, "--url", "http://example.invalid/api/chat", "--key", "K", "hi"
        )
        if code == EXIT_HTTP_ERROR:  # else strace could not trace here (ptrace not permitted)
            assert connects == [], connects


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "LocalHost"])
def test_key_goes_to_loopback_over_plain_http(chat_exe, canned, host):
    canned.answer([delta("ok"), DONE])
    url = canned.url.replace("127.0.0.1", host)
    proc = run_chat(chat_exe, "--url", url, "--key", "K-loop", "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert canned.requests[-1]["lower_headers"]["x-functions-key"] == "K-loop"


# ---------------------------------------------------------------------------------------------
# the caller key (CALLER_KEYS=required): Authorization: Bearer on every request, under the key rule


CALLER_KEY = "csk-" + "C" * 43  # the shape of the app's caller keys; the canned server takes any


def test_caller_key_goes_as_bearer_on_the_post_and_the_resumes_next_to_the_function_key(chat_exe, canned):
    canned.resumable(SID, [ev(1, "a"), "CUT"], resumes=[[ev(2, "b"), "CUT"], [ev(3, "c"), done_ev(4)]])
    proc = run_chat(chat_exe, "--url", canned.url, "--key", "K-1", "--caller-key", CALLER_KEY, "--stats", "hi")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == b"abc\n"
    sent = [canned.requests[0]["lower_headers"]] + [g["lower_headers"] for g in canned.gets]
    assert len(sent) == 3
    for headers in sent:
        assert headers["authorization"] == f"Bearer {CALLER_KEY}" and headers["x-functions-key"] == "K-1"
    assert CALLER_KEY.encode() not in proc.stderr
    # From the environment, alone, and for --resume too; no Authorization header without one.
    canned.resumable(SID, [], resumes=[[ev(1, "a"), done_ev(2)]])
    proc = run_chat(chat_exe, "--url", canned.url, "--resume", SID, env={"CALLER_KEY": CALLER_KEY})
    assert proc.returncode == EXIT_OK, proc.stderr
    [get] = canned.gets
    assert get["lower_headers"]["authorization"] == f"Bearer {CALLER_KEY}"
    assert "x-functions-key" not in get["lower_headers"]
    canned.answer([delta("ok"), DONE])
    assert run_chat(chat_exe, "--url", canned.url, "hi").returncode == EXIT_OK
    assert "authorization" not in canned.requests[0]["lower_headers"]


def test_caller_key_goes_on_the_cancel_call(chat_exe, canned):
    canned.resumable(SID, [ev(1, "first ")] + [ev(n, "more ") for n in range(2, 3000)] + ["STALL"])
    assert _close_stdout_after_first(chat_exe, canned.url, _client_env({"CALLER_KEY": CALLER_KEY})) == 141
    [cancel] = canned.cancels
    assert cancel["path"] == f"/api/streams/{SID}/cancel"
    assert cancel["lower_headers"]["authorization"] == f"Bearer {CALLER_KEY}"


def test_caller_key_over_plain_http_to_another_host_is_refused_with_nothing_sent(chat_exe):
    """As the function key (test_key_over_plain_http_to_another_host_...): exit 2 and the message, where an
    attempt would be exit 3; under strace no connect() at all; the key in no output, --stats or not."""
    url = f"http://{own_address()}:{closed_port()}/api/chat"
    for args, env, which in [
        (["--caller-key", CALLER_KEY], None, "the caller key"),
        ([], {"CALLER_KEY": CALLER_KEY}, "the caller key"),
        (["--caller-key", CALLER_KEY, "--key", "K-SECRET-123"], None, "the function key and the caller key"),
    ]:
        proc = run_chat(chat_exe, "--url", url, *args, "--stats", "hi", env=env)
        assert proc.returncode == EXIT_HTTP_ERROR, proc.stderr
        err = proc.stderr.decode()
        assert f"refusing to send {which} in clear text over http:// to {own_address()}" in err, err
        assert "--allow-insecure-key" in err
        assert CALLER_KEY not in err and "K-SECRET-123" not in err and proc.stdout == b""
    proc = run_chat(chat_exe, "--url", url, "--caller-key", CALLER_KEY, "--allow-insecure-key", "--stats", "hi")
    assert proc.returncode == EXIT_CONNECT, proc.stderr
    assert CALLER_KEY.encode() not in proc.stderr + proc.stdout
    if shutil.which("strace"):
        code, connects = _connects_to_the_network(
            chat_exe, "--url", "http://example.invalid/api/chat", "--caller-key", CALLER_KEY, "--stats", "hi"
        )
        if code == EXIT_HTTP_ERROR:  # else strace could not trace here (ptrace not permitted)
            assert connects == [], connects


@pytest.mark.parametrize("key", ["", "csk-with space", "csk-line\nX-Injected: 1", "csk-é"])
def test_a_caller_key_that_cannot_be_a_header_exits_64_without_showing_it(chat_exe, canned, key):
    canned.answer([delta("ok"), DONE])
    proc = run_chat(chat_exe, "--url", canned.url, "--caller-key", key, "hi")
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert b"--caller-key (or CALLER_KEY) must be" in proc.stderr
    if key:
        assert key.encode() not in proc.stderr
    assert canned.requests == []


def test_a_mistyped_option_does_not_echo_its_value(chat_exe):
    proc = run_chat(chat_exe, f"--caller-keys={CALLER_KEY}", "hi")
    assert proc.returncode == EXIT_USAGE
    assert b"unknown option: --caller-keys\n" in proc.stderr and CALLER_KEY.encode() not in proc.stderr


def test_connection_refused_exits_3(chat_exe):
    proc = run_chat(chat_exe, "--url", f"http://127.0.0.1:{closed_port()}/api/chat", "hi")
    assert proc.returncode == EXIT_CONNECT
    assert b"could not connect" in proc.stderr


def test_closed_stdout_aborts_the_request_and_exits_141(chat_exe, canned):
    canned.answer(
        [delta("first ")] + [delta("more ")] * 3000 + [DONE]
    )  # about 30 s of deltas: more than the test waits
    assert _close_stdout_after_first(chat_exe, canned.url, _client_env()) == 141
    assert wait_for(lambda: canned.disconnects, 2)


# ---------------------------------------------------------------------------------------------
# Ctrl+C. Mono installs its SIGINT handler (which runs Console.CancelKeyPress) only when stdin
# and stdout are both terminals. Without a terminal, SIGINT kills the process at once: the
# kernel then closes the socket, so the server still sees the client go away.


def _sigint_default() -> None:
    """Runs in each client child before exec: SIGINT back to its default action. Started in the
    background (`make test &`, nohup, some CI runners), the test process has SIGINT ignored, an
    ignored signal stays ignored across exec, and Mono would then never see the SIGINT these
    tests send. (subprocess's restore_signals resets SIGPIPE and SIGXFSZ only.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _interrupted_client(args: list[str], terminal: bool = False, env: dict | None = None):
    """The C# client started for a test that interrupts it: its stdout a terminal (a pty) or a
    pipe, SIGINT at its default action; yields the process and the descriptor its output is read
    from; killed at the end if it still runs."""
    master = None
    if terminal:
        master, slave = pty.openpty()
        proc = subprocess.Popen(
            args,
            stdin=slave,
            stdout=slave,
            stderr=subprocess.PIPE,
            env=env or _client_env(),
            preexec_fn=_sigint_default,
        )
        os.close(slave)
    else:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env or _client_env(),
            preexec_fn=_sigint_default,
        )
    try:
        yield proc, master if master is not None else proc.stdout.fileno()
    finally:
        if proc.poll() is None:
            proc.kill()
        if master is not None:
            os.close(master)


def _close_stdout_after_first(chat_exe, url: str, env: dict) -> int:
    """The client asked "hi" of ``url``, its stdout closed once the answer's first text is out (like
    `chat ... | head -c 5`): its exit code."""
    proc = subprocess.Popen(
        ["mono", str(chat_exe), "--url", url, "hi"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert _read_until_text(proc.stdout.fileno()).startswith(b"first")
        proc.stdout.close()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode


def _read_until_text(fd: int, timeout: float = 15) -> bytes:
    """Reads from fd until some reply text (not just terminal escape codes) has arrived."""
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([fd], [], [], 0.1)
        if readable:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed its end of the terminal
                chunk = b""
            if not chunk:
                break
            buf += chunk
            if re.sub(rb"\x1b(\[[0-9;?]*[A-Za-z]|[=>])", b"", buf).strip():
                return buf
    raise AssertionError(f"no reply text within {timeout} s: {buf!r}")


def test_sigint_without_terminal_kills_mono_and_server_sees_hangup(chat_exe, canned):
    canned.answer([delta("first"), "STALL"])
    with _interrupted_client(["mono", str(chat_exe), "--url", canned.url, "hi"]) as (proc, _):
        assert _read_until_text(proc.stdout.fileno()) == b"first"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGINT  # what Mono really does here (see client_cs/README.md)
    assert wait_for(lambda: canned.disconnects, 2)
    assert canned.disconnects[0] - sent < 2


def test_sigint_on_a_terminal_runs_the_handler_and_exits_130(chat_exe, canned):
    """With a terminal, CancelKeyPress runs: the request is aborted, stats printed, exit 130."""
    canned.answer([delta("first"), "STALL"])
    args = ["mono", str(chat_exe), "--url", canned.url, "--stats", "hi"]
    with _interrupted_client(args, terminal=True) as (proc, master):
        assert b"first" in _read_until_text(master)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        stderr = proc.stderr.read().decode()
    assert proc.returncode == EXIT_CANCELLED, stderr
    assert "chat: cancelled" in stderr
    assert "stats: finish reason: cancelled" in stderr
    assert wait_for(lambda: canned.disconnects, 2)
    assert canned.disconnects[0] - sent < 2


# ---------------------------------------------------------------------------------------------
# against the function app and the scripted upstream


def _texts():
    from tools.fakeupstream.scenarios import TEXTS

    return TEXTS


@pytest.mark.parametrize("scenario", ["normal", "split_utf8"])
def test_app_exact_text(chat_exe, app, scenario):
    proc = run_chat(chat_exe, "--url", app.chat_url, f"[scenario:{scenario}] go")
    assert proc.returncode == EXIT_OK, proc.stderr.decode()
    assert proc.stdout == (_texts()[scenario] + "\n").encode("utf-8")


def test_app_echo(chat_exe, app):
    from tools.fakeupstream.scenarios import echo_text

    prompt = '[scenario:echo] Grüße 🙂 "quoted" / slash'
    proc = run_chat(chat_exe, "--url", app.chat_url, prompt)
    assert proc.returncode == EXIT_OK, proc.stderr.decode()
    assert proc.stdout == (echo_text(prompt) + "\n").encode("utf-8")


def test_app_echo_with_system_message(chat_exe, app):
    from tools.fakeupstream.scenarios import echo_text

    prompt = "[scenario:echo] hello"
    proc = run_chat(chat_exe, "--url", app.chat_url, "--system", "be brief", prompt)
    assert proc.returncode == EXIT_OK, proc.stderr.decode()
    assert proc.stdout == (echo_text(prompt) + "\n").encode("utf-8")


def test_app_stats(chat_exe, app):
    proc = run_chat(chat_exe, "--url", app.chat_url, "--stats", "[scenario:slow] go")
    assert proc.returncode == EXIT_OK, proc.stderr.decode()
    lines = proc.stderr.decode().splitlines()
    for pattern in STATS_LINES:
        assert any(re.match(pattern, line) for line in lines), (pattern, lines)
    assert "stats: finish reason: stop" in lines
    assert "stats: deltas: 10" in lines


def test_app_error_midstream_exits_1(chat_exe, app):
    proc = run_chat(chat_exe, "--url", app.chat_url, "[scenario:error_midstream] go")
    assert proc.returncode == EXIT_STREAM_ERROR
    assert b"the stream ended with an error" in proc.stderr


def test_app_rate_limited_exits_2(chat_exe, app):
    # A model of its own: the app's single upstream cools a model down for its 429's Retry-After.
    proc = run_chat(chat_exe, "--url", app.chat_url, "--model", "gpt-cs-rate-limited", "[scenario:rate_limited] go")
    assert proc.returncode == EXIT_HTTP_ERROR
    assert proc.stdout == b""
    assert b"HTTP 429" in proc.stderr


def _wait_disconnected(upstream, scenario: str, timeout: float):
    def found():
        return [
            s for s in upstream.streams() if s.get("scenario") == scenario and s.get("outcome") == "client_disconnected"
        ]

    return wait_for(found, timeout)


@pytest.mark.parametrize("scenario", ["slow", "stall"])
def test_app_sigint_mid_stream_stops_upstream(chat_exe, app, upstream, scenario):
    upstream.clear()
    args = ["mono", str(chat_exe), "--url", app.chat_url, f"[scenario:{scenario}] go"]
    with _interrupted_client(args) as (proc, out):
        _read_until_text(out)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    # No terminal: Mono does not run CancelKeyPress and SIGINT ends the process at once.
    assert proc.returncode == -signal.SIGINT
    assert _wait_disconnected(upstream, scenario, 2), upstream.streams()


def test_app_sigint_on_a_terminal_exits_130_and_stops_upstream(chat_exe, app, upstream):
    upstream.clear()
    args = ["mono", str(chat_exe), "--url", app.chat_url, "[scenario:stall] go"]
    with _interrupted_client(args, terminal=True) as (proc, master):
        _read_until_text(master)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    assert proc.returncode == EXIT_CANCELLED
    assert _wait_disconnected(upstream, "stall", 2), upstream.streams()


# ---------------------------------------------------------------------------------------------
# resumable streams against the function app (RESUMABLE_STREAMS=on, on Azurite)


def _ran_to_its_end(upstream, prompt: str) -> None:
    """One upstream request for the prompt, not cut short by any of the client's drops or hang-ups."""
    calls = upstream.calls_for(prompt)
    assert len(calls) == 1, calls
    record = wait_for(
        lambda: [s for s in upstream.streams() if s["request_id"] == calls[0][0]["id"] and s["ended_at"] is not None], 5
    )
    assert record and record[0]["outcome"] == "completed", record


def _read_stream_id(stderr_fd: int, timeout: float = 15) -> str:
    """The id from the client's `chat: resumable stream ID` line (--stats), read from its stderr."""
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([stderr_fd], [], [], 0.1)[0]:
            chunk = os.read(stderr_fd, 4096)
            if not chunk:
                break
            buf += chunk
            m = re.search(rb"chat: resumable stream ([A-Za-z0-9_-]{30})\n", buf)
            if m:
                return m.group(1).decode()
    raise AssertionError(f"no stream id on stderr: {buf!r}")


@pytest.mark.parametrize("drops", [1, 3])
def test_app_resumable_drop_reconnects_and_prints_the_answer_once(chat_exe, cut, upstream, drops):
    """The proxy resets the client's connection mid-answer (and then its resumed ones): the client
    reconnects with Last-Event-ID by itself, says so with --stats, and prints exactly the text."""
    cut.cut(b"POST /api/chat ", 420)  # the headers and the first events of `slow`, and a piece of one
    for _ in range(drops - 1):
        cut.cut(b"GET /api/streams/", 260)
    prompt = f"[scenario:slow] drop {drops} {time.time_ns()}"
    proc = run_chat(chat_exe, "--url", cut.url + "/api/chat", "--stats", prompt)
    err = proc.stderr.decode()
    assert proc.returncode == EXIT_OK, err
    assert proc.stdout == (_texts()["slow"] + "\n").encode()
    assert len(cut.cut_at) == drops and cut.pending_cuts() == 0
    lines = err.splitlines()
    lost = [line for line in lines if re.match(r"^chat: (connection lost|reconnection failed) after event \d+: ", line)]
    assert len(lost) >= drops, lines
    reconnects = int(next(line for line in lines if line.startswith("stats: reconnects: ")).split()[-1])
    assert reconnects == len(lost) and "stats: finish reason: stop" in lines and "stats: deltas: 10" in lines
    _ran_to_its_end(upstream, prompt)


def test_app_resume_by_id_after_the_client_was_killed(chat_exe, resumable, upstream):
    """A client killed mid-answer (SIGKILL: nothing sent) leaves the stream going; `--resume ID`
    prints it whole, `--last-event-id N` only what came after event N."""
    prompt = f"[scenario:slow] killed {time.time_ns()}"
    proc = subprocess.Popen(
        ["mono", str(chat_exe), "--url", resumable.chat_url, "--stats", prompt],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_client_env(),
    )
    try:
        stream_id = _read_stream_id(proc.stderr.fileno())
        _read_until_text(proc.stdout.fileno())
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    whole = run_chat(chat_exe, "--url", resumable.chat_url, "--resume", stream_id)
    assert whole.returncode == EXIT_OK, whole.stderr
    assert whole.stdout == (_texts()["slow"] + "\n").encode()
    rest = run_chat(chat_exe, "--url", resumable.chat_url, "--resume", stream_id, "--last-event-id", "4", "--stats")
    assert rest.returncode == EXIT_OK, rest.stderr
    assert whole.stdout.endswith(rest.stdout) and 0 < len(rest.stdout) < len(whole.stdout)
    assert "stats: reconnects: 0" in rest.stderr.decode().splitlines()
    _ran_to_its_end(upstream, prompt)
    gone = run_chat(chat_exe, "--url", resumable.chat_url, "--resume", "A" * 22)
    assert gone.returncode == EXIT_HTTP_ERROR and b"HTTP 404" in gone.stderr, gone.stderr


@pytest.mark.parametrize("terminal", [False, True])
def test_app_sigint_cancels_a_resumable_stream_and_the_upstream_is_closed(chat_exe, resumable, upstream, terminal):
    """Ctrl+C: the client calls streams/ID/cancel (a hang-up alone would not stop the stream), the app
    closes the upstream within a second, the stream ends with finish_reason cancelled; exit 130. With
    a terminal through Console.CancelKeyPress, without one through Mono.Posix's UnixSignal."""
    prompt = f"[scenario:slow] interrupted {terminal} {time.time_ns()}"
    args = ["mono", str(chat_exe), "--url", resumable.chat_url, "--stats", prompt]
    with _interrupted_client(args, terminal) as (proc, out):
        stream_id = _read_stream_id(proc.stderr.fileno())
        _read_until_text(out)
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        stderr = proc.stderr.read().decode()
    assert proc.returncode == EXIT_CANCELLED, stderr
    assert "chat: cancelled" in stderr and "could not cancel" not in stderr
    [(request, _)] = upstream.calls_for(prompt)
    record = wait_for(
        lambda: [s for s in upstream.streams() if s["request_id"] == request["id"] and s["ended_at"] is not None], 5
    )
    assert record and record[0]["outcome"] == "client_disconnected", record
    assert record[0]["ended_at"] - sent < 1.5, record[0]["ended_at"] - sent  # within 1 s of the cancel call
    replay = run_chat(chat_exe, "--url", resumable.chat_url, "--resume", stream_id, "--stats")
    assert replay.returncode == EXIT_STREAM_ERROR, replay.stderr
    assert "stats: finish reason: cancelled" in replay.stderr.decode().splitlines()
    assert _texts()["slow"].encode().startswith(replay.stdout.rstrip(b"\n"))


# ---------------------------------------------------------------------------------------------
# caller keys against the function app (CALLER_KEYS=required, on Azurite; docs/callers.md)


def _callers_app(upstream, azurite, **extra: str):
    from helpers import app_env
    from servers import App

    return App(app_env(upstream, AzureWebJobsStorage=azurite.connection_string, CALLER_KEYS="required", **extra))


@pytest.fixture(scope="module")
def keyed(upstream, azurite):
    server = _callers_app(upstream, azurite)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_resumable(upstream, azurite):
    server = _callers_app(upstream, azurite, RESUMABLE_STREAMS="on")
    yield server
    server.stop()


def _new_caller_key(app) -> str:
    """A new caller's key, from the admin API, as an operator makes one."""
    import secrets

    import httpx

    response = httpx.post(app.url + "/api/manage/callers", json={"name": f"cs-{secrets.token_hex(4)}"}, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()["key"]


def test_app_with_caller_keys_streams_only_with_a_caller_key(chat_exe, keyed, upstream):
    key = _new_caller_key(keyed)
    proc = run_chat(chat_exe, "--url", keyed.chat_url, "--caller-key", key, "--stats", "[scenario:normal] go")
    assert proc.returncode == EXIT_OK, proc.stderr.decode()
    assert proc.stdout == (_texts()["normal"] + "\n").encode()
    assert "stats: finish reason: stop" in proc.stderr.decode().splitlines()
    assert key.encode() not in proc.stderr
    proc = run_chat(chat_exe, "--url", keyed.chat_url, "[scenario:echo] grüße", env={"CALLER_KEY": key})
    assert proc.returncode == EXIT_OK, proc.stderr.decode()
    before = upstream.count()
    # No key, an unknown one of the right shape, something else: 401, exit 2, and no upstream call.
    for args in ([], ["--caller-key", "csk-" + "x" * 43], ["--caller-key", "not-a-key"]):
        proc = run_chat(chat_exe, "--url", keyed.chat_url, *args, "--stats", "[scenario:normal] go")
        err = proc.stderr.decode()
        assert proc.returncode == EXIT_HTTP_ERROR, err
        assert proc.stdout == b""
        assert "chat: HTTP 401 Unauthorized: Incorrect API key provided" in err, err
        assert key not in err and "x" * 43 not in err
    assert upstream.count() == before
    # A function key is not a caller key (the local host checks none; the app wants the caller key).
    proc = run_chat(chat_exe, "--url", keyed.chat_url, "--key", key, "[scenario:normal] go")
    assert proc.returncode == EXIT_HTTP_ERROR and b"HTTP 401" in proc.stderr


@pytest.fixture
def keyed_cut(keyed_resumable):
    from urllib.parse import urlsplit

    from cut_proxy import CutProxy

    proxy = CutProxy(urlsplit(keyed_resumable.url).port)
    yield proxy
    proxy.close()


def test_app_with_caller_keys_resumes_a_dropped_stream_with_the_caller_key(
    chat_exe, keyed_resumable, keyed_cut, upstream
):
    """CALLER_KEYS=required and RESUMABLE_STREAMS=on: GET streams/ID wants the caller key of the POST. The
    proxy resets the answer twice; the client resumes with its key and prints exactly the text. The stream
    is its caller's: another caller's key gets 404, no key 401."""
    key = _new_caller_key(keyed_resumable)
    keyed_cut.cut(b"POST /api/chat ", 420)
    keyed_cut.cut(b"GET /api/streams/", 260)
    prompt = f"[scenario:slow] keyed drop {time.time_ns()}"
    proc = run_chat(chat_exe, "--url", keyed_cut.url + "/api/chat", "--caller-key", key, "--stats", prompt)
    err = proc.stderr.decode()
    assert proc.returncode == EXIT_OK, err
    assert proc.stdout == (_texts()["slow"] + "\n").encode()
    assert len(keyed_cut.cut_at) == 2 and keyed_cut.pending_cuts() == 0
    lines = err.splitlines()
    assert int(next(line for line in lines if line.startswith("stats: reconnects: ")).split()[-1]) >= 2
    assert "stats: finish reason: stop" in lines and key not in err
    _ran_to_its_end(upstream, prompt)
    stream_id = re.search(r"^stats: stream id: ([A-Za-z0-9_-]+) ", err, re.M).group(1)
    again = run_chat(chat_exe, "--url", keyed_resumable.chat_url, "--resume", stream_id, env={"CALLER_KEY": key})
    assert again.returncode == EXIT_OK and again.stdout == proc.stdout, again.stderr
    other = run_chat(
        chat_exe,
        "--url",
        keyed_resumable.chat_url,
        "--resume",
        stream_id,
        "--caller-key",
        _new_caller_key(keyed_resumable),
    )
    assert other.returncode == EXIT_HTTP_ERROR and b"HTTP 404" in other.stderr, other.stderr
    nobody = run_chat(chat_exe, "--url", keyed_resumable.chat_url, "--resume", stream_id)
    assert nobody.returncode == EXIT_HTTP_ERROR and b"HTTP 401" in nobody.stderr, nobody.stderr


def test_app_with_caller_keys_sigint_cancels_with_the_caller_key(chat_exe, keyed_resumable, upstream):
    """POST streams/ID/cancel wants the caller key too: without a terminal (Mono.Posix's UnixSignal) the
    client cancels the stream, and the upstream is closed."""
    key = _new_caller_key(keyed_resumable)
    prompt = f"[scenario:slow] keyed interrupted {time.time_ns()}"
    with _interrupted_client(
        ["mono", str(chat_exe), "--url", keyed_resumable.chat_url, "--stats", prompt],
        env=_client_env({"CALLER_KEY": key}),
    ) as (proc, _):
        _read_stream_id(proc.stderr.fileno())
        _read_until_text(proc.stdout.fileno())
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        stderr = proc.stderr.read().decode()
    assert proc.returncode == EXIT_CANCELLED, stderr
    assert "chat: cancelled" in stderr and "could not cancel" not in stderr and key not in stderr
    [(request, _)] = upstream.calls_for(prompt)
    record = wait_for(
        lambda: [s for s in upstream.streams() if s["request_id"] == request["id"] and s["ended_at"] is not None], 5
    )
    assert record and record[0]["outcome"] == "client_disconnected", record
    assert record[0]["ended_at"] - sent < 1.5, record[0]["ended_at"] - sent
