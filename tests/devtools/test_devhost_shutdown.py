"""The local host stops as the Functions host does on Azure (tools/devhost/README.md, "Stopping"):
on SIGTERM no new connection is taken, the requests in flight go on for the shutdown timeout
(ASPNETCORE_SHUTDOWNTIMEOUTSECONDS) and are cut then, the workers get SIGTERM at once and handle it
as Azure's Python worker does (the runtime's HTTP server catches it, lets its requests finish, and
the process ends by SIGTERM), and nothing is left running afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from servers import ROOT, App, run_devhost

PROBE = ROOT / "tests" / "apps" / "probe"


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    app_dir = tmp_path_factory.mktemp("probe-shutdown")
    shutil.copy(PROBE / "function_app.py", app_dir)
    return app_dir


class Ticks(threading.Thread):
    """GET /api/ticks in a thread: each line with its arrival time, and how the body ended."""

    def __init__(self, app: App, marker: Path, n: int = 600):
        super().__init__(daemon=True)
        self.url, self.params = app.url + "/api/ticks", {"marker": str(marker), "n": str(n)}
        self.lines: list[tuple[float, str]] = []
        self.ended: str | None = None  # "complete", or the error that ended it
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("GET", self.url, params=self.params, timeout=30) as r:
                for line in r.iter_lines():
                    self.lines.append((time.monotonic(), line))
                    self.first.set()
            self.ended = "complete"
        except httpx.HTTPError as exc:
            self.ended = type(exc).__name__
        self.first.set()


def worker_pid(app: App) -> int:
    return httpx.get(app.url + "/_devhost/stats", timeout=10).json()["workers"][0]["pid"]


def test_sigterm_refuses_new_connections_at_once_and_cuts_what_is_left_at_the_shutdown_timeout(probe_dir, tmp_path):
    app = App({"ASPNETCORE_SHUTDOWNTIMEOUTSECONDS": "2"}, app_dir=probe_dir)
    try:
        ticks = Ticks(app, tmp_path / "m")
        assert ticks.first.wait(10)
        sent = time.monotonic()
        app.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):
            httpx.get(app.url + "/api/pid", timeout=5)
        app.proc.wait(10)
        exited = time.monotonic() - sent
        ticks.join(5)
    finally:
        app.stop()
    after = [t - sent for t, _ in ticks.lines if t > sent]
    assert after and after[-1] > 1.5, f"the stream in flight went on after SIGTERM (last line at {after[-1:]} s)"
    assert ticks.ended == "RemoteProtocolError", "cut at the shutdown timeout: the body never ends"
    assert exited < 2 + 2.0, f"the host exited {exited:.1f} s after SIGTERM (timeout 2 s)"
    assert app.proc.returncode == 0
    assert "Cancelled (the host's shutdown timeout passed)" in app.log()


def test_a_request_that_ends_within_the_shutdown_timeout_ends_as_usual_and_the_host_leaves_then(probe_dir, tmp_path):
    app = App({"ASPNETCORE_SHUTDOWNTIMEOUTSECONDS": "20"}, app_dir=probe_dir)
    try:
        ticks = Ticks(app, tmp_path / "m", n=15)  # 1.5 s
        assert ticks.first.wait(10)
        sent = time.monotonic()
        app.proc.send_signal(signal.SIGTERM)
        app.proc.wait(15)
        exited = time.monotonic() - sent
        ticks.join(5)
    finally:
        app.stop()
    assert ticks.ended == "complete" and [line for _, line in ticks.lines][-1] == "tick 14"
    after = exited - (ticks.lines[-1][0] - sent)
    assert after < 2.5, f"the host left {after:.1f} s after its last request ended: it leaves once they are done"


def test_the_worker_gets_sigterm_at_once_and_handles_it_as_azures_worker(probe_dir, tmp_path):
    """SIGTERM reaches the worker while its requests still run; the runtime's HTTP server (uvicorn) is
    the handler in place, as in Azure's worker, so the app can chain one of its own in front."""
    marker = tmp_path / "sigterm"
    app = App({"ASPNETCORE_SHUTDOWNTIMEOUTSECONDS": "3"}, app_dir=probe_dir)
    try:
        watch = httpx.get(app.url + "/api/watch_sigterm", params={"marker": str(marker)}, timeout=10).json()
        assert watch["previous"] == "Server.handle_exit", "the runtime's uvicorn holds SIGTERM while it serves"
        ticks = Ticks(app, tmp_path / "m")
        assert ticks.first.wait(10)
        sent = time.time()
        app.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), "the worker got no SIGTERM"
        assert float(marker.read_text()) - sent < 1.0
        assert ticks.ended is None, "and its request in flight goes on"
        app.proc.wait(10)
    finally:
        app.stop()


def test_a_worker_sent_sigterm_alone_finishes_its_requests_then_ends_by_it_and_is_replaced(probe_dir, tmp_path):
    app = App({}, app_dir=probe_dir)
    try:
        victim = worker_pid(app)
        ticks = Ticks(app, tmp_path / "m", n=10)  # 1 s
        assert ticks.first.wait(10)
        os.kill(victim, signal.SIGTERM)
        ticks.join(10)
        assert ticks.ended == "complete" and len(ticks.lines) == 10, "the runtime let its request finish"
        app.wait_log(rf"worker 1 \(pid {victim}\) exited \(killed by SIGTERM\)[^\n]*restarting it", timeout=10)
        app.wait_log(r"worker 1 \(pid \d+\) restarted; serving", timeout=60)
        assert httpx.get(app.url + "/api/pid", timeout=10).json()["pid"] != victim
    finally:
        app.stop()


@pytest.mark.parametrize("value", ["-1", "2.5", "soon", "3601"])
def test_a_bad_shutdown_timeout_is_a_clear_error(value):
    result = run_devhost({"ASPNETCORE_SHUTDOWNTIMEOUTSECONDS": value})
    assert result.returncode == 2
    assert "ASPNETCORE_SHUTDOWNTIMEOUTSECONDS must be a whole number of seconds from 0 to 3600" in result.stderr
