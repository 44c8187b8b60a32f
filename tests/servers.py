"""Start the project's servers for real, as the user would, and talk HTTP to them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# The app's code for App(): this tree, or another checkout of the project
# (CHATSTREAM_APP_ROOT=/path/to/checkout: run a test of this tree against that code, e.g. to check
# that it fails on the code before a fix). The scripted upstream always comes from this tree.
APP_ROOT = Path(os.environ.get("CHATSTREAM_APP_ROOT") or ROOT).resolve()
READY = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class Served:
    """A server started as a subprocess; its stderr is kept in a file for log assertions."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 60.0):
        self.log_file = tempfile.NamedTemporaryFile(prefix="served-", suffix=".log", delete=False)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AZURE_OPENAI_"))}
        full_env.update({"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(cwd)})
        if cwd != ROOT:
            full_env["PYTHONDONTWRITEBYTECODE"] = "1"  # leave the other checkout as it is
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.stdout_lines: list[str] = []
        self.url = self._wait_ready(timeout)
        # Keep draining stdout (kept in stdout_lines) so the child never blocks on a full pipe.
        threading.Thread(target=lambda: self.stdout_lines.extend(self.proc.stdout), daemon=True).start()

    def _wait_ready(self, timeout: float) -> str:
        found: list[str] = []

        def read():
            for line in self.proc.stdout:
                m = READY.search(line)
                if m:
                    found.append(m.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            self.stop()
            raise RuntimeError(f"server did not start: {' '.join(self.proc.args)}\n{self.log()}")
        return found[0]

    def log(self) -> str:
        return Path(self.log_file.name).read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 5.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.log())
            if m or time.monotonic() > deadline:
                assert m, f"log never matched {pattern!r}:\n{self.log()[-3000:]}"
                return m
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Upstream(Served):
    """The scripted OpenAI-compatible server (tools/fakeupstream/)."""

    def __init__(self, *extra: str):
        super().__init__(["-m", "tools.fakeupstream", "--port", "0", *extra])
        # httpx keeps an idle connection 5 s by default, exactly uvicorn's keep-alive timeout: a control call
        # after ~5 s idle could reuse a connection the server was closing (CI: "Connection reset by peer").
        self.http = httpx.Client(base_url=self.url, timeout=10, limits=httpx.Limits(keepalive_expiry=1.0))

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def requests(self, last: int | None = None) -> list[dict]:
        """The recorded API requests, oldest first (only the ``last`` N when given)."""
        return self.http.get("/_scripted/requests", params={"last": last} if last else None).json()

    def count(self) -> int:
        """How many API requests the upstream has received so far (cheap, unlike requests())."""
        return self.http.get("/_scripted/count").json()["requests"]

    def streams(self) -> list[dict]:
        return self.http.get("/_scripted/streams").json()

    def calls_for(self, prompt: str) -> list[tuple[dict, dict | None]]:
        """The requests whose last message is ``prompt``, each with its stream record (None: none)."""
        streams = {s["request_id"]: s for s in self.streams()}
        return [
            (r, streams.get(r["id"]))
            for r in self.requests()
            if (r.get("json") or {}).get("messages", [{}])[-1].get("content") == prompt
        ]

    def clear(self) -> None:
        self.http.delete("/_scripted/requests").raise_for_status()

    def wait_stream_end(self, scenario: str, timeout: float = 5.0) -> dict:
        """The latest stream record of ``scenario`` once it has ended."""
        deadline = time.monotonic() + timeout
        while True:
            records = [s for s in self.streams() if s["scenario"] == scenario]
            if records and records[-1]["ended_at"] is not None:
                return records[-1]
            if time.monotonic() > deadline:
                raise AssertionError(f"no ended stream for {scenario!r}: {records}")
            time.sleep(0.02)


class App(Served):
    """function_app.py served through the local host (tools/devhost/) on the real runtime."""

    def __init__(self, env: dict[str, str], app_dir: Path = ROOT):
        root = APP_ROOT if app_dir == ROOT else ROOT
        super().__init__(
            ["-m", "tools.devhost", "--port", "0", str(root if app_dir == ROOT else app_dir)], env=env, cwd=root
        )

    @property
    def chat_url(self) -> str:
        return self.url + "/api/chat"


def run_devhost(
    env: dict[str, str] | None = None,
    app_dir: Path = ROOT,
    args: tuple[str, ...] = ("--port", "0"),
    timeout: float = 60,
) -> subprocess.CompletedProcess:
    """Run the local host with nothing in its environment but ``env`` (and a PATH and PYTHONPATH),
    to its exit: for the settings and apps that must stop it before it listens."""
    return subprocess.run(
        [sys.executable, "-m", "tools.devhost", *args, str(app_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **(env or {})},
    )


class Azurite(Served):
    """A real Azurite (tools/azurite/), in memory, on free ports: the store the callers and
    resumable-streams features share. ``connection_string`` is what the app takes as AzureWebJobsStorage."""

    def __init__(self):
        super().__init__(["-m", "tools.azurite", "--in-memory"])
        deadline = time.monotonic() + 10
        while not any(line.startswith("AzureWebJobsStorage=") for line in list(self.stdout_lines)):
            assert time.monotonic() < deadline and self.proc.poll() is None, f"no connection string:\n{self.log()}"
            time.sleep(0.02)
        line = next(line for line in self.stdout_lines if line.startswith("AzureWebJobsStorage="))
        self.connection_string = line.split("=", 1)[1].strip()

    @property
    def node_pid(self) -> int:
        """The Azurite process itself (the launcher's child): signal it to stop or resume the store."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(children[0])
