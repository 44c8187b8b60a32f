"""Side-by-side streaming benchmark: the scripted upstream reached directly, through this app
(devhost on the real Python worker, with one and with two worker processes) and through the LiteLLM
proxy, in one interleaved run.

    tools/bench/run.sh [--quick] [options]      (what `make bench` runs; see tools/bench/README.md)

Writes tools/bench/out/results.json (every stream), then the section of docs/benchmarks.md between the
side-by-side markers and docs/benchmarks.png (tools/bench/report.py). Every process it starts listens on
127.0.0.1 only, every loop is bounded, and everything it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(ROOT))

import procstat  # noqa: E402 - after sys.path names the repository
import report  # noqa: E402 - after sys.path names the repository

from tools.bench.coldstart import fresh  # noqa: E402  (stdlib only: safe in this venv)
from tools.fakeupstream.scenarios import TEXTS, cadence_text  # noqa: E402  (stdlib only: safe in this venv)

APP_PY = ROOT / ".venv" / "bin" / "python"
BENCH_PY = Path(sys.executable)
LITELLM_BIN = BENCH_PY.parent / "litellm"
HOST = "127.0.0.1"
READY = re.compile(r"listening on (http://127\.0\.0\.1:(\d+))")
# Every path the benchmark knows, in the order of its tables. DEFAULT_PATHS run by default (all of
# them), extra app variants with --variant (A/B).
PATHS = ("direct", "floor", "floor2", "app", "app2", "keys", "keyslim", "keyteam", "resume", "litellm")
DEFAULT_PATHS = PATHS
# FUNCTIONS_WORKER_PROCESS_COUNT of each devhost server (a server per path, except keyslim and keyteam: SERVER_OF).
APP_WORKERS = {"floor": 1, "floor2": 2, "app": 1, "app2": 2, "keys": 1, "resume": 1}
# The floor: tools/bench/floor/function_app.py, a bare aiohttp relay on the same host and runtime.
APP_DIRS = {"floor": BENCH / "floor", "floor2": BENCH / "floor"}
# Paths served by another path's server: the app with CALLER_KEYS=required serves the three caller
# paths, one caller without limits ("keys"), one with a tokens_per_minute limit ("keyslim") and one in
# a team with a spend budget, on priced models ("keyteam", issue #31).
SERVER_OF = {"keyslim": "keys", "keyteam": "keys"}
# Paths that need the shared store (Azurite, started by the benchmark).
STORE_PATHS = ("keys", "keyslim", "keyteam", "resume")
# Paths whose server wants caller keys (CALLER_KEYS=required), each with its own kind of caller.
CALLER_PATHS = ("keys", "keyslim", "keyteam")
# Paths run only at some levels by default (their targets are at 1 and 100 streams): --extra-levels.
EXTRA_PATHS = ("keys", "keyslim", "keyteam", "resume")
# The keyteam path's prices (USD per million tokens, docs/callers.md's example), set for both models the
# benchmark asks for (the 40-delta `cadence` and the 10-delta `normal`).
BENCH_PRICE = {"input": 0.15, "cached_input": 0.075, "output": 0.60}
# Paths with two worker processes: left out at 1 stream (one stream keeps one worker busy).
TWO_WORKERS = ("floor2", "app2")
MODEL = "cadence"  # the upstream plays the `cadence` scenario for this model name
LITELLM_ALIAS = "bench-model"  # tools/bench/litellm.yaml: bench-model -> openai/cadence
# Short streams (the upstream's `normal` scenario: 10 deltas) next to the 40-delta ones at the same
# concurrency tell the CPU per request from the CPU per delta.
SHORT = {"model": "normal", "litellm_model": "bench-short", "deltas": 10, "chars": len(TEXTS["normal"])}

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


KEEP_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM")


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """A minimal environment: nothing from the caller's shell (app settings, proxies, API keys,
    telemetry connection strings) reaches a server, only what the benchmark sets."""
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    env.update({"PYTHONUNBUFFERED": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    env.update(extra)
    return env


class Server:
    """A process we started; stdout+stderr go to a log file under tools/bench/out/."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], out: Path, cwd: Path = ROOT):
        self.name = name
        self.log_path = out / f"{name}.log"
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log_file
        )
        self.pid = self.proc.pid
        self.url: str | None = None

    def wait_ready_line(self, timeout: float) -> str:
        found: list[str] = []

        def read():
            for raw in self.proc.stdout:
                self.log_file.write(raw)
                m = READY.search(raw.decode(errors="replace"))
                if m and not found:
                    found.append(m.group(1))
                    break
            for raw in self.proc.stdout:  # keep draining so the child never blocks on a full pipe
                self.log_file.write(raw)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.05)
        if not found:
            raise RuntimeError(f"{self.name} did not start; log: {self.log_path}\n{self.tail()}")
        self.url = found[0]
        return self.url

    def wait_http(self, url: str, timeout: float) -> None:
        threading.Thread(target=lambda: [self.log_file.write(r) for r in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with _opener.open(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become ready at {url}; log: {self.log_path}\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        self.log_file.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log_file.close()


class Upstream(Server):
    def records(self) -> tuple[list[dict], list[dict]]:
        get = lambda p: json.loads(_opener.open(self.url + p, timeout=30).read())  # noqa: E731 - a one-line helper
        return get("/_scripted/requests"), get("/_scripted/streams")

    def clear(self) -> None:
        _opener.open(urllib.request.Request(self.url + "/_scripted/requests", method="DELETE"), timeout=30).read()


class LoadGen:
    """One load-generator process (tools/bench/loadgen.py --serve)."""

    def __init__(self, out: Path, index: int):
        self.proc = subprocess.Popen(
            [str(BENCH_PY), str(BENCH / "loadgen.py"), "--serve"],
            cwd=ROOT,
            env=_clean_env({}),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(out / f"loadgen{index}.log", "wb"),
        )
        hello = json.loads(self.proc.stdout.readline())
        self.pid = hello["pid"]
        self.loop = hello["loop"]

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a load generator died; see tools/bench/out/loadgen*.log")
        result = json.loads(line)
        if "fatal" in result:
            raise RuntimeError(f"load generator failed: {result['fatal']}")
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


# ------------------------------------------------------------------------------------ bench


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.servers: dict[str, Server] = {}
        self.loadgens: list[LoadGen] = []
        self.targets: dict[str, dict] = {}
        self.results: dict = {"phases": [], "waves": []}
        self.expected_chars = len(cadence_text(args.deltas))
        self.sampler: procstat.RssSampler | None = None
        self.serving_pid: dict[str, int | None] = {}
        # --variant NAME=SPEC: more app paths (one worker each), each from its own tree (A/B runs).
        self.variants: dict[str, dict] = {name: prepare_variant(name, spec, self.out) for name, spec in args.variants}
        self.app_workers = {**APP_WORKERS, **{name: 1 for name in self.variants}}
        self.app_dirs = {**APP_DIRS, **{name: v["dir"] for name, v in self.variants.items()}}
        # --like NAME=PATH: the variant is served as PATH is (its settings, store, callers, second instance).
        self.like: dict[str, str] = dict(args.like)

    # -- set-up

    def start(self) -> None:
        a = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        log("starting the scripted upstream")
        up = Upstream(
            "upstream",
            [
                str(APP_PY),
                "-m",
                "tools.fakeupstream",
                "--port",
                "0",
                "--scenario",
                "cadence",
                "--first-token-ms",
                str(a.first_token_ms),
                "--interval-ms",
                str(a.interval_ms),
                "--deltas",
                str(a.deltas),
                "--max-records",
                "20000",
            ],
            _clean_env({}),
            self.out,
        )
        self.servers["upstream"] = up
        up.wait_ready_line(60)
        base = up.url + "/v1"

        storage = None
        if any(self.kind_of(p) in STORE_PATHS for p in self.paths):
            log("starting Azurite (in memory) for the paths that need the shared store")
            (self.out / "azurite-access.log").unlink(missing_ok=True)  # its store calls (store_ops.py)
            self.servers["azurite"] = az = Azurite(
                "azurite",
                [str(APP_PY), "-m", "tools.azurite", "--in-memory"],
                _clean_env({"AZURITE_ACCESS_LOG": str(self.out / "azurite-access.log")}),
                self.out,
            )
            storage = az.wait_storage(60)

        env = {"OPENAI_BASE_URL": base, "OPENAI_API_KEY": "sk-bench-dummy", "OPENAI_MODEL": MODEL}
        wanted = {self.server_of(p) for p in self.paths}
        servers = [name for name in self.app_workers if name in wanted]
        for name in servers:
            n = self.app_workers[name]
            extra = {"FUNCTIONS_WORKER_PROCESS_COUNT": str(n)}
            kind = self.kind_of(name)
            if kind in STORE_PATHS:
                extra["AzureWebJobsStorage"] = storage
            if kind in CALLER_PATHS:
                extra["CALLER_KEYS"] = "required"
            if kind == "resume":
                extra["RESUMABLE_STREAMS"] = "on"
            where = self.app_dirs.get(name, ROOT)
            log(
                f"starting {name} (devhost on the real Python worker, {n} worker process{'es' if n > 1 else ''}"
                + (f", app from {where}" if where != ROOT else "")
                + ")"
            )
            self.servers[name] = Server(
                name,
                [
                    str(APP_PY),
                    "-m",
                    "tools.devhost",
                    "--port",
                    "0",
                    *os.environ.get("BENCH_DEVHOST_ARGS", "").split(),
                    str(where),
                ],
                _clean_env({**env, **extra}),
                self.out,
            )
            if kind == "resume":  # a second instance on the same store: the reader on another instance
                self.servers[f"{name}_b"] = Server(
                    f"{name}_b",
                    [str(APP_PY), "-m", "tools.devhost", "--port", "0", str(where)],
                    _clean_env({**env, **extra}),
                    self.out,
                )
        for name in [*servers, *(f"{s}_b" for s in servers if f"{s}_b" in self.servers)]:
            self.servers[name].wait_ready_line(120)

        key = "sk-bench-" + secrets.token_hex(16)
        if "litellm" in self.paths:
            port = _free_port()
            log(
                f"starting LiteLLM ({LITELLM_BIN.name} --config tools/bench/litellm.yaml --port {port} --num_workers 1)"
            )
            env = _clean_env(
                {
                    "BENCH_UPSTREAM_BASE": base,
                    "LITELLM_MASTER_KEY": key,
                    "LITELLM_LOG": "ERROR",
                    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                    "LITELLM_MODE": "PRODUCTION",
                    "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1",
                    "DISABLE_ADMIN_UI": "True",
                }
            )
            ll = Server(
                "litellm",
                [
                    str(LITELLM_BIN),
                    "--config",
                    str(BENCH / "litellm.yaml"),
                    "--port",
                    str(port),
                    "--host",
                    HOST,
                    "--num_workers",
                    "1",
                ],
                env,
                self.out,
                cwd=self.out,
            )
            self.servers["litellm"] = ll
            ll.url = f"http://{HOST}:{port}"
            ll.wait_http(ll.url + "/health/liveliness", 240)

        caller_keys = {}
        if "keys" in self.servers:  # three callers, as an operator makes them: without and with limits
            url = self.servers["keys"].url
            for path in ("keys", "keyslim", "keyteam"):
                caller_keys[path] = self._caller(url, path, path)
            log(
                f"made three callers on the keys app: one without limits, one with tokens_per_minute "
                f"{a.keys_tpm:,}, one in a team with spend_budget {a.team_spend:,} USD (total) on priced models"
            )
        for name, kind in self.like.items():  # a variant served like a caller path: its own caller
            if kind in CALLER_PATHS and name in self.servers:
                caller_keys[name] = self._caller(self.servers[name].url, kind, name)
                log(f"made the {kind} caller on variant {name}")

        hp = lambda u: u.split("//", 1)[1]  # noqa: E731 - a one-line helper
        self.targets = {
            "direct": {
                "kind": "openai",
                "path": "/v1/chat/completions",
                "model": MODEL,
                "url": base + "/chat/completions",
            },
            "litellm": {
                "kind": "openai",
                "path": "/v1/chat/completions",
                "model": LITELLM_ALIAS,
                "headers": {"Authorization": f"Bearer {key}"},
                "url": (self.servers["litellm"].url if "litellm" in self.servers else "http://x")
                + "/v1/chat/completions",
            },
        }
        for name in self.app_paths:
            server = self.servers.get(self.server_of(name))
            if server is None:
                continue
            self.targets[name] = {"kind": "app", "path": "/api/chat", "url": server.url + "/api/chat"}
            if name in caller_keys:
                self.targets[name]["headers"] = {"Authorization": f"Bearer {caller_keys[name]}"}
        for name in self.paths:
            if self.kind_of(name) != "resume" or f"{name}_b" not in self.servers:
                continue
            b = self.servers[f"{name}_b"]
            self.targets[name]["follow"] = {
                "host": HOST,
                "port": int(hp(b.url).split(":")[1]),
                "hostport": hp(b.url),
                "path": a.resume_path,
                "every": a.resume_follow_every,
            }
        for name, t in self.targets.items():
            server = (
                self.servers.get("upstream" if name == "direct" else self.server_of(name))
                if name in self.paths
                else None
            )
            if server is None:
                continue
            t["host"], port = HOST, int(hp(server.url).split(":")[1])
            t["port"], t["hostport"] = port, f"{HOST}:{port}"
        # The serving process whose CPU and memory count for each path (the upstream's never does).
        self.serving_pid = {
            name: self.servers[self.server_of(name)].pid if self.server_of(name) in self.servers else None
            for name in self.paths
        }
        self.serving_pid["direct"] = None
        roots = {"upstream": up.pid}
        roots.update({name: s.pid for name, s in self.servers.items() if name != "upstream"})
        log(f"starting {a.client_procs} load generator process(es)")
        self.loadgens = [LoadGen(self.out, i) for i in range(a.client_procs)]
        roots.update({f"client{i}": g.pid for i, g in enumerate(self.loadgens)})
        self.sampler = procstat.RssSampler(roots)
        self.sampler.start()

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (*PATHS, *self.variants) if p in self.args.paths)

    @property
    def app_paths(self) -> tuple[str, ...]:
        """The paths served by devhost (the floor, the app and its variants), in table order."""
        return tuple(p for p in self.paths if p in self.app_workers or p in SERVER_OF)

    def server_of(self, path: str) -> str:
        return SERVER_OF.get(path, path)

    def kind_of(self, path: str) -> str:
        """The path ``path`` is served as: itself, or for a variant what --like says (else ``app``)."""
        return self.like.get(path, path)

    def _caller(self, url: str, kind: str, name: str) -> str:
        """The caller of a caller path (keys, keyslim, keyteam) made on the server at ``url``; its key."""
        a = self.args
        if kind == "keys":
            return _create_caller(url, f"bench-nolimit-{name}", {})
        if kind == "keyslim":
            return _create_caller(url, f"bench-limited-{name}", {"tokens_per_minute": a.keys_tpm})
        for model in (MODEL, SHORT["model"]):
            _manage(url, "PUT", f"/prices/{model}", BENCH_PRICE)
        _manage(url, "POST", "/teams", {"name": f"bench-team-{name}", "spend_budget": a.team_spend})
        return _create_caller(url, f"bench-team-member-{name}", {"team": f"bench-team-{name}"})

    def levels_of(self, path: str) -> tuple[int, ...]:
        """The levels ``path`` runs at: every level, or --extra-levels for the caller/resume paths."""
        if self.kind_of(path) in EXTRA_PATHS:
            return tuple(lv for lv in self.args.levels if lv in self.args.extra_levels)
        return tuple(self.args.levels)

    def stop(self) -> None:
        if self.sampler:
            self.sampler.stop()
        for g in self.loadgens:
            g.stop()
        for name in sorted(self.servers, key=lambda n: n == "upstream"):  # the upstream last
            self.servers[name].stop()

    # -- one wave

    def wave(
        self,
        phase: str,
        path: str,
        n: int,
        ramp: float,
        *,
        probe: bool = False,
        engine: str = "raw",
        timeout: float = 60.0,
        settle: float = 0.05,
        record: bool = True,
        wave_no: int = 0,
        short: bool = False,
    ) -> dict:
        target = self.targets[path]
        expected, expected_chars = self.args.deltas, self.expected_chars
        if short:  # the 10-delta stream (SHORT)
            target = {**target, "model": SHORT["litellm_model"] if path == "litellm" else SHORT["model"]}
            expected, expected_chars = SHORT["deltas"], SHORT["chars"]
        gens = self.loadgens[:1] if n == 1 else self.loadgens
        items = [[i, f"bench {phase}-{path}-{wave_no}-{i}", ramp * i / n] for i in range(n)]
        cpu0 = self._cpu(path)
        ours0 = procstat.tree_cpu_seconds(os.getpid())  # this script, every server, the load generators
        busy0, total0 = procstat.machine_busy_seconds()
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        start_at = t0 + (0.15 if len(gens) > 1 else 0.0)  # lets every process start the ramp together
        for k, g in enumerate(gens):
            g.send(
                {
                    "target": target,
                    "items": items[k :: len(gens)],
                    "start_at": start_at,
                    "expected": expected,
                    "expected_chars": expected_chars,
                    "probe": probe,
                    "timeout": timeout,
                    "engine": engine,
                }
            )
        replies = [g.receive() for g in gens]
        t_done = time.perf_counter()
        time.sleep(settle)  # include the servers' clean-up of the last streams in the CPU reading
        t1 = time.perf_counter()
        cpu1 = self._cpu(path)
        busy1, total1 = procstat.machine_busy_seconds()
        ours1 = procstat.tree_cpu_seconds(os.getpid())
        load1 = os.getloadavg()[0]
        records = [r for reply in replies for r in reply["records"]]
        w = {
            "phase": phase,
            "path": path,
            "n": n,
            "ramp_s": ramp,
            "probe": probe,
            "engine": engine,
            "short": short,
            "expected": expected,
            "wave": wave_no,
            "t0": t0,
            "t_done": t_done,
            "t1": t1,
            "wall_s": t_done - start_at,
            "cpu_s": {name: cpu1[name] - cpu0[name] for name in cpu0},
            "client_cpu_s": sum(r["client_cpu_s"] for r in replies),
            "client_procs": len(gens),
            "machine_busy_s": busy1 - busy0,
            "machine_total_s": total1 - total0,
            # Other load: the machine's busy CPU less everything this benchmark runs, per second of the
            # wave; and /proc/loadavg's 1-minute figure (everything, ours included) before and after.
            "ours_cpu_s": ours1 - ours0,
            "loadavg1": [load0, load1],
            "peak_rss": {name: self.sampler.peak(name, t0, t1) for name in self.sampler.roots},
            "records": records,
        }
        if record:
            self.results["waves"].append(w)
        return w

    def _cpu(self, path: str) -> dict[str, float]:
        """CPU seconds so far: the upstream's tree, the serving tree ("server"), and for the app
        its host process ("host") and its worker processes ("worker") apart."""
        out = {"upstream": procstat.tree_cpu_seconds(self.servers["upstream"].pid)}
        if self.serving_pid.get(path):
            out.update(procstat.cpu_groups(self.serving_pid[path], split=path in self.app_paths))
        if "azurite" in self.servers:  # the store's CPU: counted apart, never in the app's
            out["store"] = procstat.tree_cpu_seconds(self.servers["azurite"].pid)
        if self.kind_of(path) == "resume" and f"{path}_b" in self.servers:  # the readers' instance, apart
            out["reader_instance"] = procstat.tree_cpu_seconds(self.servers[f"{path}_b"].pid)
        return out

    # -- phases

    def run(self) -> None:
        a = self.args
        self.results["started"] = datetime.now(UTC).isoformat(timespec="seconds")
        self.results["meta"] = metadata(self)
        started = time.perf_counter()

        self.results["quiet"] = self.wait_quiet(a.wait_quiet, a.quiet_cores)
        if a.cold_starts:
            log(f"cold start: `import function_app` against the three packages alone, {a.cold_starts} times each")
            self.results["cold_start"] = cold_start(a.cold_starts)
        log("warm-up (not measured)")
        for path in self.paths:
            for _ in range(3):
                w = self.wave("warmup", path, 1, 0, record=False)
                if not w["records"][0]["ok"]:
                    raise RuntimeError(
                        f"warm-up stream via {path} failed: {w['records'][0]['error']}; see tools/bench/out/*.log"
                    )
            self.wave("warmup", path, min(50, max(self.levels_of(path) or a.levels)), 0.05, record=False, settle=0.3)
        self._collect_upstream("warmup", keep=False)

        for level in a.levels:
            t_phase = time.perf_counter()
            here = tuple(p for p in self.paths if level in self.levels_of(p))
            if level == 1:
                # One stream at a time only ever keeps one worker busy: app2 (floor2) would repeat app (floor).
                single = tuple(p for p in here if p not in TWO_WORKERS)
                log(f"1 stream at a time: {a.trials} full streams per path ({', '.join(single)}), round-robin")
                for r in range(a.trials):
                    for path in _rotate(single, r):
                        self.wave("c1", path, 1, 0, wave_no=r, settle=a.gap)
                if a.probes:
                    log(f"1 stream at a time: {a.probes} first-delta probes per path (hang up after the first delta)")
                    for r in range(a.probes):
                        for path in _rotate(single, r):
                            self.wave("c1probe", path, 1, 0, probe=True, wave_no=r, settle=a.gap)
            else:
                waves = a.waves.get(level, 1)
                ramp = min(a.max_ramp, level * a.stagger_ms / 1000)
                log(f"{level} concurrent streams: {waves} wave(s) per path, opened over {ramp:.2f} s, round-robin")
                for r in range(waves):
                    for path in _rotate(here, r):
                        w = self.wave(
                            f"c{level}", path, level, ramp, wave_no=r, settle=a.settle, timeout=a.stream_timeout
                        )
                        ok = sum(x["ok"] for x in w["records"])
                        log(
                            f"  {path:8s} wave {r}: {ok}/{level} ok in {w['wall_s']:.1f} s"
                            f" (other load {_other(w):.2f} cores, loadavg {w['loadavg1'][1]:.2f})"
                        )
                if level == a.split_level and a.short_waves:
                    log(
                        f"{level} concurrent short streams ({SHORT['deltas']} deltas): {a.short_waves} wave(s) per "
                        f"path, for the CPU per request apart from the CPU per delta"
                    )
                    for r in range(a.short_waves):
                        for path in _rotate(here, r):
                            w = self.wave(
                                f"c{level}short",
                                path,
                                level,
                                ramp,
                                wave_no=r,
                                settle=a.settle,
                                timeout=a.stream_timeout,
                                short=True,
                            )
                            ok = sum(x["ok"] for x in w["records"])
                            log(f"  {path:8s} short wave {r}: {ok}/{level} ok in {w['wall_s']:.1f} s")
            self.results["phases"].append({"level": level, "wall_s": time.perf_counter() - t_phase})
            self._collect_upstream(f"c{level}")

        if a.client_check and "direct" in self.paths:
            level = max(a.levels)
            ramp = min(a.max_ramp, level * a.stagger_ms / 1000)
            log(f"client check: direct path, {level} streams, httpx engine vs raw sockets")
            for engine in ("httpx", "raw"):
                self.wave(
                    f"client-{engine}", "direct", level, ramp, engine=engine, settle=a.settle, timeout=a.stream_timeout
                )
            self._collect_upstream("client")

        self.results["hwm"] = {
            name: procstat.hwm_bytes(procstat.descendants(pid)) for name, pid in self.sampler.roots.items()
        }
        self.results["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
        self.results["wall_s"] = time.perf_counter() - started
        self.results["config"] = {k: v for k, v in vars(a).items() if k != "waves"} | {
            "waves": {str(k): v for k, v in a.waves.items()},
            "expected_chars": self.expected_chars,
            "loadgen_loop": self.loadgens[0].loop,
            "paths": list(self.paths),
            "variants": list(a.variants),
            "labels": {name: v["label"] for name, v in self.variants.items()},
            "owners": {p: self.server_of(p) for p in self.paths if p != "direct"} | {"direct": "upstream"},
            "path_levels": {p: list(self.levels_of(p)) for p in self.paths},
            "two_workers": [p for p in self.paths if self.app_workers.get(self.server_of(p)) == 2],
            "keys_tpm": a.keys_tpm,
            "team_spend": a.team_spend,
        }

    def other_load(self, seconds: float = 2.0) -> float:
        """Cores kept busy by processes that are not ours, averaged over ``seconds``."""

        def sample():  # this script's tree holds every process of the benchmark
            busy, _ = procstat.machine_busy_seconds()
            return busy, procstat.tree_cpu_seconds(os.getpid()), time.perf_counter()

        b0, m0, t0 = sample()
        time.sleep(seconds)
        b1, m1, t1 = sample()
        return max(0.0, ((b1 - b0) - (m1 - m0)) / (t1 - t0))

    def wait_quiet(self, limit_s: float, cores: float) -> dict:
        """Wait (at most ``limit_s``) until other processes use less than ``cores`` cores."""
        deadline = time.monotonic() + limit_s
        load = self.other_load()
        while load >= cores and time.monotonic() < deadline:
            log(f"the machine is busy with other work ({load:.2f} cores); waiting for it to calm down")
            load = self.other_load(5.0)
        if load >= cores:
            log(f"going ahead on a busy machine ({load:.2f} cores of other load): the figures will be noisier")
        return {"other_load_cores_at_start": load, "threshold": cores}

    def _collect_upstream(self, phase: str, keep: bool = True) -> None:
        """Line the streams up with the upstream's records (by the marker in the prompt)."""
        up = self.servers["upstream"]
        requests, streams = up.records()
        up.clear()
        if not keep:
            return
        started = {s["request_id"]: s["started_at"] for s in streams}
        by_marker = {}
        for req in requests:
            try:
                marker = req["json"]["messages"][-1]["content"]
            except (KeyError, IndexError, TypeError):
                continue
            by_marker[marker] = (req["received_at"], started.get(req["id"]))
        for w in self.results["waves"]:
            for rec in w["records"]:
                if rec["marker"] in by_marker and "up_received" not in rec:
                    rec["up_received"], rec["up_started"] = by_marker[rec["marker"]]


class Azurite(Server):
    """tools/azurite (in memory): prints its table URL, then ``AzureWebJobsStorage=...``."""

    def wait_storage(self, timeout: float) -> str:
        found: list[str] = []

        def read():
            for raw in self.proc.stdout:
                self.log_file.write(raw)
                line = raw.decode(errors="replace").strip()
                if line.startswith("AzureWebJobsStorage=") and not found:
                    found.append(line.split("=", 1)[1])

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.05)
        if not found:
            raise RuntimeError(
                f"Azurite did not start (`make azurite` installs it); log: {self.log_path}\n{self.tail()}"
            )
        return found[0]


def _manage(url: str, method: str, route: str, body: dict) -> dict:
    """One call of the admin API (/api/manage/...), as an operator makes it; its answer."""
    req = urllib.request.Request(
        url + "/api/manage" + route,
        data=json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with _opener.open(req, timeout=30) as r:
        return json.loads(r.read())


def _create_caller(url: str, name: str, fields: dict) -> str:
    """A caller made through the admin API (POST /api/manage/callers); its key."""
    return _manage(url, "POST", "/callers", {"name": name, **fields})["key"]


# Cold start (issue #34): a fresh process imports the app as the worker does, against one that imports only
# the three packages the app is built on (the Functions library, its FastAPI extension, the openai SDK).
COLD_IMPORTS = {
    "app": "import function_app",
    "packages": "import azure.functions, azurefunctions.extensions.http.fastapi, openai",
}
COLD_CODE = (
    "import json, resource, time\nt = time.perf_counter()\n{imports}\n"
    "print(json.dumps({{'s': time.perf_counter() - t, "
    "'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))"
)


def cold_start(times: int) -> dict:
    """Seconds and peak RSS (MB) of ``times`` fresh imports of each of COLD_IMPORTS, alternating, with the
    app's settings as the `app` path has them (no caller keys, no resumable streams)."""
    env = _clean_env({"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "sk-bench-dummy"})
    out: dict = {name: [] for name in COLD_IMPORTS}
    for _ in range(times):
        for name, imports in COLD_IMPORTS.items():
            out[name].append(fresh(APP_PY, COLD_CODE.format(imports=imports), [], env, ROOT, f"cold start ({name})"))
    return out


def prepare_variant(name: str, spec: str, out: Path) -> dict:
    """An app tree for an A/B path: ``git:REF`` (that commit of this repository, exported), ``patch:FILE``
    (HEAD, exported, with FILE applied), or a folder holding function_app.py. The host (tools/devhost) and
    the upstream stay this checkout's; the worker imports chatstream from the variant's folder."""
    if name in PATHS or not re.fullmatch(r"[a-z][a-z0-9_]{0,15}", name):
        raise SystemExit(f"--variant {name}=...: the name must be new, lower-case letters, digits, _")
    kind, _, arg = spec.partition(":")
    if kind in ("git", "patch"):
        where = out / "variants" / name
        subprocess.run(["rm", "-rf", str(where)], check=True)
        where.mkdir(parents=True)
        ref = arg if kind == "git" else "HEAD"
        commit = _git("rev-parse", "--short", ref)
        if not commit:
            raise SystemExit(f"--variant {name}: no commit {ref!r}")
        tar = subprocess.run(
            ["git", "archive", commit, "function_app.py", "host.json", "chatstream"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(where)], input=tar, check=True)
        label = f"variant {name}: {commit}"
        if kind == "patch":  # one or more patch files, joined with "+"
            for one in arg.split("+"):
                patch = Path(one).resolve()
                # Not as a part of this repository (out/ is inside it): there, git apply would skip
                # every path outside out/, silently, and the variant would be HEAD.
                alone = {**os.environ, "GIT_CEILING_DIRECTORIES": str(where.resolve().parent)}
                subprocess.run(["git", "apply", str(patch)], cwd=where, env=alone, check=True)
                label += f" + {patch.name}"
        return {"dir": where, "label": label, "spec": spec}
    folder = Path(spec).resolve()
    if not (folder / "function_app.py").exists():
        raise SystemExit(f"--variant {name}={spec}: git:REF, patch:FILE or a folder with function_app.py")
    return {"dir": folder, "label": f"variant {name}: {folder}", "spec": spec}


def _other(w: dict) -> float:
    """Cores kept busy during a wave by processes that are not the benchmark's."""
    span = w["t1"] - w["t0"]
    return max(0.0, (w["machine_busy_s"] - w["ours_cpu_s"]) / span) if span > 0 else 0.0


def _rotate(seq, r):
    r %= len(seq)
    return tuple(seq[r:]) + tuple(seq[:r])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _versions(python: Path, names: list[str]) -> dict:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {'python': sys.version.split()[0]}\n"
        f"for n in {names!r}:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: out[n] = None\n"
        "print(json.dumps(out))"
    )
    try:
        return json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60).stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def metadata(bench: Bench) -> dict:
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!tools/bench", ":!docs"))
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "cpu_model": procstat.cpu_model(),
        "kernel": platform.release(),
        "loadavg_before": os.getloadavg(),
        "commit": commit + ("+local-changes" if dirty else ""),
        "app_venv": _versions(
            APP_PY,
            [
                "openai",
                "uvicorn",
                "azure-functions-runtime",
                "azure-functions",
                "grpcio",
                "azurefunctions-extensions-http-fastapi",
                "fastapi",
                "starlette",
                "httpx",
                "httpx2",
                "uvloop",
            ],
        ),
        "bench_venv": _versions(BENCH_PY, ["litellm", "openai", "uvicorn", "fastapi", "aiohttp", "httpx", "uvloop"]),
        "netns": os.environ.get("BENCH_NETNS") == "1",
        "app_local_settings": _applied_local_settings(bench),
    }


def _applied_local_settings(bench: Bench) -> list[str]:
    """Names that devhost took from local.settings.json (the benchmark's environment has none)."""
    app = bench.servers.get("app")
    if app is None:
        return []
    m = re.search(r"local\.settings\.json: applied (.*)", app.tail(200_000))
    return [x.strip() for x in m.group(1).split(",")] if m else []


def _loopback_up() -> None:
    """Inside a fresh network namespace (tools/bench/run.sh) only `lo` exists, and it is down."""
    import fcntl
    import socket
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifr = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, ifr)[:18])[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 0x1))  # SIOCSIFFLAGS |= IFF_UP
    finally:
        s.close()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Side-by-side streaming benchmark (see tools/bench/README.md).")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny counts, levels 1 and 20")
    p.add_argument("--levels", default="1,10,100,300,1000", help="concurrency levels (default 1,10,100,300,1000)")
    p.add_argument("--trials", type=int, default=40, help="full streams per path at 1 stream (default 40)")
    p.add_argument(
        "--probes", type=int, default=160, help="extra first-delta probes per path at 1 stream (default 160)"
    )
    p.add_argument(
        "--waves", default="10:4,100:4,300:2,1000:1", help="waves per path per level (default 10:4,100:4,300:2,1000:1)"
    )
    p.add_argument(
        "--split-level",
        type=int,
        default=100,
        help="level of the short-stream waves that split CPU per request / per delta (default 100)",
    )
    p.add_argument("--short-waves", type=int, default=2, help="short-stream waves per path there (default 2)")
    p.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help=f"subset of {','.join(PATHS)} (default {','.join(DEFAULT_PATHS)}; `resume` needs "
        "RESUMABLE_STREAMS in the app); variants (--variant) are added to it",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        dest="variants",
        help="one more app path (1 worker) from another tree, in the same interleaved run: "
        "git:REF, patch:FILE[+FILE...] (HEAD with the files applied) or a folder; repeatable (A/B)",
    )
    p.add_argument(
        "--like",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help=f"serve variant NAME as PATH is served ({', '.join(STORE_PATHS)}): its settings, Azurite, its own "
        "caller of that kind, and for resume its own second instance; A/B of those paths (ab.py NAME PATH)",
    )
    p.add_argument(
        "--extra-levels",
        default="1,100",
        help="levels of the caller and resume paths (default 1,100: where their targets are)",
    )
    p.add_argument(
        "--keys-tpm",
        type=int,
        default=1_000_000_000,
        help="tokens_per_minute of the limited caller (default 1e9: never refuses)",
    )
    p.add_argument(
        "--team-spend",
        type=int,
        default=1_000_000,
        help="spend_budget (USD, budget_period total) of the keyteam caller's team (default 1e6: never refuses)",
    )
    p.add_argument(
        "--resume-path",
        default="/api/streams/{id}",
        help="the resume route on the second instance ({id}: the x-stream-id header)",
    )
    p.add_argument(
        "--resume-follow-every",
        type=int,
        default=10,
        help="one stream in this many gets a reader on the other instance (default 10)",
    )
    p.add_argument(
        "--cold-starts",
        type=int,
        default=7,
        help="fresh `import function_app` processes timed before the waves, and as many of its packages alone "
        "(default 7; 0: none)",
    )
    p.add_argument("--client-procs", type=int, default=2, help="load-generator processes (default 2)")
    p.add_argument("--stagger-ms", type=float, default=1.0, help="gap between stream starts (default 1 ms)")
    p.add_argument("--max-ramp", type=float, default=0.5, help="longest ramp to open a wave (default 0.5 s)")
    p.add_argument("--gap", type=float, default=0.05, help="pause after each single-stream trial (s)")
    p.add_argument("--settle", type=float, default=1.0, help="pause after each concurrent wave (s)")
    p.add_argument("--stream-timeout", type=float, default=120.0, help="per-stream limit in waves (s)")
    p.add_argument(
        "--no-client-check",
        dest="client_check",
        action="store_false",
        help="skip the httpx-vs-raw client check on the direct path",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=120.0,
        help="wait up to this long (s) for other load to drop before measuring (default 120)",
    )
    p.add_argument("--quiet-cores", type=float, default=0.3, help="other load (cores) counted as quiet (default 0.3)")
    p.add_argument("--first-token-ms", type=float, default=100)
    p.add_argument("--interval-ms", type=float, default=20)
    p.add_argument("--deltas", type=int, default=40)
    p.add_argument("--out", default=str(BENCH / "out"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--png", default=str(ROOT / "docs" / "benchmarks.png"))
    p.add_argument("--no-docs", dest="docs", action="store_false", help="results.json only")
    a = p.parse_args(argv)
    if a.quick:
        a.levels, a.trials, a.probes, a.waves = "1,20", 4, 6, "20:1"
        a.split_level, a.short_waves = 20, 1
        a.settle, a.wait_quiet = 0.3, 0.0
        a.cold_starts = min(a.cold_starts, 2)
        a.extra_levels = "1,20"
        if a.doc == str(ROOT / "docs" / "benchmarks.md"):  # a smoke run never overwrites the real figures
            a.doc, a.png = str(Path(a.out) / "benchmarks-quick.md"), str(Path(a.out) / "benchmarks-quick.png")
    a.levels = sorted({int(x) for x in str(a.levels).split(",") if x})
    a.waves = {int(k): int(v) for k, v in (x.split(":") for x in str(a.waves).split(",") if x)}
    a.variants = [tuple(v.split("=", 1)) for v in a.variants]
    if any(len(v) != 2 for v in a.variants):
        p.error("--variant NAME=SPEC")
    a.paths = tuple(x for x in a.paths.split(",") if x) + tuple(name for name, _ in a.variants)
    a.like = [tuple(v.split("=", 1)) for v in a.like]
    if any(len(v) != 2 or v[0] not in dict(a.variants) or v[1] not in STORE_PATHS for v in a.like):
        p.error(f"--like NAME=PATH: NAME a --variant, PATH one of {', '.join(STORE_PATHS)}")
    unknown = set(a.paths) - set(PATHS) - {name for name, _ in a.variants}
    if unknown:
        p.error(f"unknown paths: {', '.join(sorted(unknown))}")
    a.extra_levels = sorted({int(x) for x in str(a.extra_levels).split(",") if x})
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("BENCH_NETNS") == "1":
        _loopback_up()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # inherited by every server we start
    if not APP_PY.exists():
        log(f"{APP_PY} is missing: run `make venv` (or `make bench`) first")
        return 2
    bench = Bench(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        bench.start()
        bench.run()
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        bench.stop()
    out = Path(args.out)
    results_path = out / "results.json"
    results_path.write_text(json.dumps(bench.results, separators=(",", ":")))
    log(f"raw results: {results_path} ({bench.results['wall_s']:.0f} s of measurement)")
    summary = report.summarize(bench.results)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.docs:
        png2 = report.write_all(summary, Path(args.doc), Path(args.png))
        log(f"wrote {args.doc} (side-by-side section), {args.png} and {png2}")
    print(report.console_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
