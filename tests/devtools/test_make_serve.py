"""`make serve`'s script on a machine with nothing configured: it starts the scripted upstream and
the app on the local host, the README's curl line gets a streamed answer, and Ctrl+C stops both."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from servers import ROOT

from tools.fakeupstream.scenarios import echo_text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_with_nothing_configured_answers_the_readme_curl():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AZURE_OPENAI_"))}
    env["PORT"] = str(port)
    proc = subprocess.Popen(
        ["bash", str(ROOT / "tools" / "scripts" / "serve")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        output = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            output.append(line)
            if "devhost listening" in line:
                break
        assert any("No upstream configured" in line for line in output), output
        assert not any("Azurite" in line for line in output), "the plain first run starts no store"
        assert f"Playground: http://localhost:{port}/api/playground\n" in output, output
        assert httpx.get(f"http://127.0.0.1:{port}/api/playground").status_code == 200
        assert f"Console: http://localhost:{port}/api/console\n" in output, output
        assert httpx.get(f"http://127.0.0.1:{port}/api/console").status_code == 200
        # curl -N -X POST localhost:PORT/api/chat -d '{"prompt":"hi"}' (form content type, as curl sends)
        r = httpx.post(
            f"http://127.0.0.1:{port}/api/chat",
            content=b'{"prompt":"hi"}',
            headers={"content-type": "application/x-www-form-urlencoded"},
            timeout=20,
        )
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        deltas = [line[6:] for line in r.text.splitlines() if line.startswith('data: {"delta"')]
        assert "".join(json.loads(d)["delta"] for d in deltas) == echo_text("hi")
        assert "event: done" in r.text
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl+C goes to the whole foreground group
        proc.wait(timeout=15)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the whole group (app and scripted upstream) is gone
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("make serve left processes running after Ctrl+C")
    with socket.socket() as s:  # and the app's port is free again
        s.bind(("127.0.0.1", port))


def _serve(env: dict, port: int) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        ["bash", str(ROOT / "tools" / "scripts" / "serve")],
        cwd=ROOT,
        env={**env, "PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        output.append(line)
        if "devhost listening" in line or not line:
            break
    return proc, output


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_serve_with_caller_keys_starts_azurite_and_callers_survive_a_restart(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AZURE_OPENAI_", "AzureWebJobsStorage"))}
    env.update(CALLER_KEYS="required", AZURITE_LOCATION=str(tmp_path / "store"))
    port = _free_port()
    proc, output = _serve(env, port)
    try:
        assert any("CALLER_KEYS=required needs the app's storage" in line for line in output), output
        created = httpx.post(f"http://127.0.0.1:{port}/api/manage/callers", json={"name": "survivor"}, timeout=30)
        assert created.status_code == 201, created.text
        key = created.json()["key"]
    finally:
        _stop(proc)
    assert any((tmp_path / "store").iterdir()), "the store keeps its data on disk"
    proc, output = _serve(env, port)
    try:
        answer = httpx.post(
            f"http://127.0.0.1:{port}/api/v1/chat/completions",
            headers={"api-key": key},
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 200, "the caller made before the restart is still there"
    finally:
        _stop(proc)


def _needs_store(cwd, **settings) -> tuple[int, str]:
    """The script's own `needs_store` (the function, cut out of tools/scripts/serve), run in ``cwd``
    with ``settings`` as the environment's: its exit code (0: start Azurite) and the reason it prints."""
    script = (ROOT / "tools" / "scripts" / "serve").read_text(encoding="utf-8")
    function = re.search(r"^needs_store\(\) \{\n.*?^\}\n", script, re.M | re.S)
    assert function, "tools/scripts/serve has no needs_store function"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("AzureWebJobsStorage", "CALLER_KEYS", "RESUMABLE_"))
    }
    env.update(settings, PY=sys.executable, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        ["bash", "-c", function.group(0) + "needs_store"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    return run.returncode, run.stdout.strip()


@pytest.mark.parametrize("value", ["on", "ON", "true", "True", "1", "yes", "off", "false", "0", "no", "No"])
def test_serve_starts_the_store_for_every_spelling_the_app_turns_on(tmp_path, value):
    """RESUMABLE_STREAMS means the same to make serve as to the app: on/true/1/yes (any case) start
    Azurite, off/false/0/no do not, as the app's Settings read them."""
    from chatstream.settings import Settings

    on = Settings.from_env({"RESUMABLE_STREAMS": value}).resumable_streams
    assert on == (value.lower() in ("on", "true", "1", "yes")), value
    code, why = _needs_store(tmp_path, RESUMABLE_STREAMS=value)
    assert (code == 0) == on, (value, code, why)
    assert why == (f"RESUMABLE_STREAMS={value}" if on else ""), why


def test_serve_starts_no_store_for_a_setting_the_app_refuses(tmp_path):
    from chatstream.settings import Settings, SettingsError

    with pytest.raises(SettingsError, match="RESUMABLE_STREAMS"):
        Settings.from_env({"RESUMABLE_STREAMS": "maybe"})
    assert _needs_store(tmp_path, RESUMABLE_STREAMS="maybe")[0] == 1
    assert _needs_store(tmp_path, RESUMABLE_STREAMS="on", AzureWebJobsStorage="UseDevelopmentStorage=true")[0] == 1


def test_the_second_instance_hint_pastes_as_one_command():
    """The hint `make serve` prints when it starts Azurite, pasted into a shell as printed, gives the
    second instance the whole connection string (unquoted, its ';' ended the command there)."""
    (line,) = [
        line for line in (ROOT / "tools" / "scripts" / "serve").read_text().splitlines() if "A second instance" in line
    ]
    connection = "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a+b/c==;BlobEndpoint=http://127.0.0.1:1/d;"
    printed = subprocess.run(
        ["bash", "-c", f'storage="AzureWebJobsStorage={connection}"\n{line.strip()}'],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    hint = printed.split(": ", 1)[1].strip()
    assert hint.endswith(" make serve"), hint
    pasted = subprocess.run(
        ["bash", "-c", hint.removesuffix("make serve") + "bash -c 'echo \"$PORT $AzureWebJobsStorage\"'"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert pasted.stdout.strip() == f"7072 {connection}", (hint, pasted.stdout, pasted.stderr)
