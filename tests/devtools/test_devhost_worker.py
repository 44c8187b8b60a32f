"""The local host's worker processes (tools/devhost/worker.py, worker_process.py): the function runs
in a process of its own reached over gRPC, FUNCTIONS_WORKER_PROCESS_COUNT of them share the
requests, a worker that dies is reported and replaced while the host keeps serving, and nothing
outlives the host."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
from servers import ROOT, App, run_devhost

from tools.devhost.forward import Forwarder
from tools.devhost.proxy import UNPAIRED_GRACE, Host
from tools.devhost.routes import routes_from_metadata
from tools.devhost.worker import WorkerPool

PROBE = ROOT / "tests" / "apps" / "probe"


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    app_dir = tmp_path_factory.mktemp("probe-workers")
    shutil.copy(PROBE / "function_app.py", app_dir)
    return app_dir


@pytest.fixture(scope="module")
def two(probe_dir):
    server = App({"FUNCTIONS_WORKER_PROCESS_COUNT": "2"}, app_dir=probe_dir)
    yield server
    server.stop()


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [x.decode() for x in f.read().split(b"\0") if x]


def workers(app: App) -> list[dict]:
    return httpx.get(app.url + "/_devhost/stats", timeout=10).json()["workers"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_the_function_runs_in_a_worker_process_started_like_the_functions_host_does(probe_dir):
    app = App({}, app_dir=probe_dir)
    try:
        (worker,) = children(app.proc.pid)
        args = cmdline(worker)
        assert args[1:3] == ["-m", "tools.devhost.worker_process"]
        for flag in ("--host", "--port", "--workerId", "--requestId", "--grpcMaxMessageLength"):
            assert flag in args, args
        assert args[args.index("--host") + 1] == "127.0.0.1"
        seen = httpx.get(app.url + "/api/pid", timeout=10).json()
        assert seen == {"pid": worker, "ppid": app.proc.pid}
        (figures,) = workers(app)
        assert figures["pid"] == worker and figures["tasks"] > 0 and figures["rss_kb"] > 10_000
        stats = httpx.get(app.url + "/_devhost/stats", timeout=10).json()  # sums of one reading
        (again,) = stats["workers"]
        assert stats["rss_kb"] == stats["host"]["rss_kb"] + again["rss_kb"]
        assert stats["tasks"] == stats["host"]["tasks"] + again["tasks"]
    finally:
        app.stop()


def test_worker_process_count_starts_that_many_and_spreads_the_requests(two):
    pids = {w["pid"] for w in workers(two)}
    assert len(pids) == 2 and set(children(two.proc.pid)) == pids
    with httpx.Client(timeout=10) as client:
        served = [client.get(two.url + "/api/pid").json()["pid"] for _ in range(8)]
    assert set(served) == pids, served
    assert min(served.count(p) for p in pids) >= 3, served  # one after the other: they alternate


def test_concurrent_streams_go_to_the_least_busy_worker(two, tmp_path):
    with httpx.Client(timeout=10) as client, contextlib.ExitStack() as streams:
        readers = []  # held: a line iterator that is dropped closes its response
        for i in range(4):
            r = streams.enter_context(
                client.stream("GET", two.url + "/api/ticks", params={"marker": str(tmp_path / f"m{i}")})
            )
            readers.append(r.iter_lines())
            assert next(readers[-1]) == "tick 0"
        busy = {w["pid"]: w["in_flight"] for w in workers(two)}
        assert sorted(busy.values()) == [2, 2], busy


def test_the_request_and_its_invocation_reach_the_same_worker(two):
    with httpx.Client(timeout=10) as client:
        for _ in range(6):
            r = client.post(two.url + "/api/echo/x", content=b"body")
            assert r.status_code == 200 and r.json()["body"] == "body"


def test_a_worker_that_dies_is_reported_and_restarted_and_its_streams_end(probe_dir, tmp_path):
    app = App({"FUNCTIONS_WORKER_PROCESS_COUNT": "2"}, app_dir=probe_dir)
    try:
        with httpx.Client(timeout=10) as client:
            with client.stream("GET", app.url + "/api/ticks", params={"marker": str(tmp_path / "m")}) as r:
                lines = r.iter_lines()
                assert next(lines) == "tick 0"
                (victim,) = [w["pid"] for w in workers(app) if w["in_flight"] == 1]
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(httpx.HTTPError):  # the stream is cut, not ended cleanly
                    for _ in lines:
                        assert time.monotonic() - killed < 5, "the caller's stream did not end"
                assert time.monotonic() - killed < 5
            app.wait_log(rf"worker \d \(pid {victim}\) exited \(killed by SIGKILL\)[^\n]*restarting it")
            # The other worker keeps serving meanwhile, and a new one takes the dead one's place.
            assert client.get(app.url + "/api/pid").status_code == 200
            wait_for(
                lambda: len(workers(app)) == 2 and victim not in {w["pid"] for w in workers(app)},
                30,
                "the restarted worker",
            )
            app.wait_log(r"worker \d \(pid \d+\) restarted; serving")
            served = {client.get(app.url + "/api/pid").json()["pid"] for _ in range(6)}
            assert served == set(children(app.proc.pid)) and victim not in served
    finally:
        app.stop()


def test_with_every_worker_gone_requests_wait_for_the_restart(probe_dir):
    app = App({}, app_dir=probe_dir)
    try:
        (victim,) = children(app.proc.pid)
        os.kill(victim, signal.SIGKILL)
        r = httpx.get(app.url + "/api/pid", timeout=30)  # sent while no worker is ready
        assert r.status_code == 200 and r.json()["pid"] != victim
    finally:
        app.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_host_leaves_no_worker_behind(probe_dir, tmp_path, sig):
    app = App({"FUNCTIONS_WORKER_PROCESS_COUNT": "2", "ASPNETCORE_SHUTDOWNTIMEOUTSECONDS": "1"}, app_dir=probe_dir)
    pids = children(app.proc.pid)
    assert len(pids) == 2
    client = httpx.Client(timeout=10)
    try:
        with client.stream("GET", app.url + "/api/ticks", params={"marker": str(tmp_path / "m")}) as r:
            assert next(r.iter_lines()) == "tick 0"
            sent = time.monotonic()
            app.proc.send_signal(sig)
            app.proc.wait(timeout=10)
            took = time.monotonic() - sent
    except httpx.HTTPError:
        took = time.monotonic() - sent
    finally:
        client.close()
        app.stop()
    assert took < 1 + 2.0, f"the host took {took:.2f} s to stop (its shutdown timeout: 1 s)"
    wait_for(lambda: not any(alive(p) for p in pids), 2.0, "the workers to exit")


def test_a_host_killed_outright_takes_its_workers_with_it(probe_dir):
    app = App({"FUNCTIONS_WORKER_PROCESS_COUNT": "2"}, app_dir=probe_dir)
    pids = children(app.proc.pid)
    app.proc.kill()
    app.proc.wait(5)
    wait_for(lambda: not any(alive(p) for p in pids), 2.0, "the workers to exit after SIGKILL of the host")


@pytest.mark.parametrize("value", ["0", "11", "two", "1.5"])
def test_bad_worker_process_count_is_a_clear_error(value, tmp_path):
    result = run_devhost({"FUNCTIONS_WORKER_PROCESS_COUNT": value})
    assert result.returncode == 2
    assert "FUNCTIONS_WORKER_PROCESS_COUNT must be a whole number from 1 to 10" in result.stderr
    assert "listening" not in result.stdout


def test_worker_process_count_from_local_settings(probe_dir, tmp_path):
    shutil.copy(probe_dir / "function_app.py", tmp_path)
    (tmp_path / "local.settings.json").write_text(json.dumps({"Values": {"FUNCTIONS_WORKER_PROCESS_COUNT": "3"}}))
    app = App({}, app_dir=tmp_path)
    try:
        assert len({w["pid"] for w in workers(app)}) == 3
    finally:
        app.stop()


def test_an_invocation_whose_request_never_reaches_the_worker_is_cancelled_not_left_waiting(
    probe_dir, tmp_path, caplog
):
    """The worker's HTTP server resets the host's connection once the invocation has gone out (a
    keep-alive connection it closed, a server going down): the caller gets 502, and the invocation,
    whose request never arrives (the runtime waits for it without a bound), is cancelled by the host
    within UNPAIRED_GRACE: the worker answers Cancelled and holds no task for it. A request that did
    arrive is not cancelled: its function runs on."""

    async def run() -> None:
        pool = WorkerPool(probe_dir, 1)
        await pool.start()
        try:
            host = Host(pool, routes_from_metadata(pool.metadata, "api"))
            (worker,) = pool.workers
            assert worker is not None and worker.forwarder is not None
            transport = httpx.ASGITransport(app=host, client=("127.0.0.1", 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7071") as client:
                assert (await client.get("/api/echo/warm")).status_code == 200
                idle = (await worker.status())["tasks"]
                direct = worker.forwarder
                # The worker's HTTP server as it goes down: it takes connections and closes them unread.
                dying = await asyncio.start_server(_close_unread, "127.0.0.1", 0)
                worker.forwarder = Forwarder("127.0.0.1", dying.sockets[0].getsockname()[1])
                with caplog.at_level(logging.INFO, logger="devhost"):
                    failed = [(await client.get(f"/api/echo/{i}")).status_code for i in range(3)]
                    assert failed == [502] * 3
                    dying.close()
                    deadline = time.monotonic() + UNPAIRED_GRACE + 10
                    while (await worker.status())["tasks"] > idle and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
                    assert (await worker.status())["tasks"] <= idle, "the invocations still wait in the worker"
                cancelled = [r for r in caplog.records if "cancelled: the host cancelled" in r.getMessage()]
                assert len(cancelled) == 3, [r.getMessage() for r in caplog.records]
                # A request that reached the worker is never cancelled: its caller hangs up before the
                # function answers, and the function still runs to its end, as in Azure.
                worker.forwarder = direct
                marker = tmp_path / "slow-done"
                slow = asyncio.ensure_future(client.get("/api/slow", params={"seconds": "2", "marker": str(marker)}))
                await asyncio.sleep(0.5)
                slow.cancel()
                deadline = time.monotonic() + UNPAIRED_GRACE + 10
                while not marker.exists() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert marker.exists(), "the function whose request arrived was cancelled"
                assert len([r for r in caplog.records if "cancelled: the host" in r.getMessage()]) == 3
        finally:
            await pool.stop()

    asyncio.run(run())


async def _close_unread(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()
