"""`make serve`'s script with only `UPSTREAMS` configured, in the environment or in
local.settings.json: it starts no scripted upstream of its own, and the app answers from the
upstream that `UPSTREAMS` names (a scripted one that the test starts)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
from servers import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _upstreams(upstream) -> str:
    return json.dumps([{"name": "only", "base_url": upstream.base_url}])


def _serve_and_ask(script: Path, env: dict[str, str], upstream) -> list[str]:
    """Run ``script`` until the app listens, ask /api/chat a unique prompt, check that ``upstream``
    received it, stop with Ctrl+C; the script's output lines."""
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AZURE_OPENAI_")) and k != "UPSTREAMS"},
        **env,
        "PORT": str(port),
    }
    proc = subprocess.Popen(
        ["bash", str(script)],
        cwd=script.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            output.append(line)
            if "devhost listening" in line or not line:
                break
        assert any("devhost listening" in line for line in output), output
        prompt = f"[scenario:echo] serve {uuid.uuid4().hex[:8]}"
        r = httpx.post(f"http://127.0.0.1:{port}/api/chat", json={"prompt": prompt}, timeout=20)
        assert r.status_code == 200 and "event: done" in r.text, r.text
        received = [m["content"] for req in upstream.requests(last=20) for m in (req["json"] or {}).get("messages", [])]
        assert prompt in received, "the answer did not come from the upstream UPSTREAMS names"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=15)
    return output


def test_upstreams_in_the_environment_counts_as_configured(upstream):
    output = _serve_and_ask(ROOT / "tools" / "scripts" / "serve", {"UPSTREAMS": _upstreams(upstream)}, upstream)
    assert not any("No upstream configured" in line for line in output), output


def test_upstreams_in_local_settings_counts_as_configured(upstream, tmp_path):
    """The script serves the folder two levels above it, so it runs from a copy of the project made
    of links, with a local.settings.json of its own."""
    for name in ("chatstream", "function_app.py", "host.json", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "tools" / "scripts").mkdir(parents=True)
    for name in os.listdir(ROOT / "tools"):
        if name != "scripts":
            (tmp_path / "tools" / name).symlink_to(ROOT / "tools" / name)
    script = tmp_path / "tools" / "scripts" / "serve"
    script.symlink_to(ROOT / "tools" / "scripts" / "serve")
    (tmp_path / "local.settings.json").write_text(
        json.dumps(
            {"IsEncrypted": False, "Values": {"FUNCTIONS_WORKER_RUNTIME": "python", "UPSTREAMS": _upstreams(upstream)}}
        )
    )
    output = _serve_and_ask(script, {}, upstream)
    assert not any("No upstream configured" in line for line in output), output
