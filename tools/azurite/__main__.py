"""Run Azurite (the local Azure Storage emulator, pinned in tools/azurite/package-lock.json) on free
ports and print what the app needs to use it: ``python -m tools.azurite [--location DIR | --in-memory]``.

Prints one line ``azurite listening on http://127.0.0.1:<table port>``, then one line
``AzureWebJobsStorage=<connection string>``, and stays in the foreground until SIGTERM or Ctrl+C,
which stop Azurite too. ``npm ci`` must have run (``make azurite``). With ``AZURITE_ACCESS_LOG=FILE``
its access log (one line a request) goes to FILE (the benchmark counts store calls from it). In
memory, its blob garbage collection runs once a day, not every 10 minutes (gc_interval.js says why)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
BINARY = HERE / "node_modules" / ".bin" / "azurite"
# The emulator's one account and its published key (the same in every Azurite): not a secret.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_LISTENING = re.compile(r"Azurite (Blob|Queue|Table) service is successfully listening at (http://\S+)")


def connection_string(urls: dict[str, str]) -> str:
    """The connection string for Azurite's services at ``urls`` (``Blob``/``Queue``/``Table`` → base URL)."""
    parts = ["DefaultEndpointsProtocol=http", f"AccountName={ACCOUNT}", f"AccountKey={ACCOUNT_KEY}"]
    parts += [f"{kind}Endpoint={url.rstrip('/')}/{ACCOUNT}" for kind, url in sorted(urls.items())]
    return ";".join(parts) + ";"


def start(
    location: Path | None, timeout: float = 30.0, access_log: Path | None = None
) -> tuple[subprocess.Popen, dict[str, str]]:
    """Start Azurite on free loopback ports; the process and its service URLs once all three listen.
    Its access log lines go to ``access_log`` when given (else nowhere)."""
    if not BINARY.exists():
        raise SystemExit(f"Azurite is not installed: run `make azurite` (npm ci in {HERE})")
    args = [
        str(BINARY),
        "--skipApiVersionCheck",
        "--disableTelemetry",
        "--loose",
        "--blobHost",
        "127.0.0.1",
        "--queueHost",
        "127.0.0.1",
        "--tableHost",
        "127.0.0.1",
        "--blobPort",
        "0",
        "--queuePort",
        "0",
        "--tablePort",
        "0",
    ]
    env = dict(os.environ)
    if location is None:
        args.append("--inMemoryPersistence")
        # Its blob garbage collection once a day, not every 10 minutes (gc_interval.js says why).
        preload = f'--require "{HERE / "gc_interval.js"}"'
        env["NODE_OPTIONS"] = f"{env.get('NODE_OPTIONS', '')} {preload}".strip()
    else:
        location.mkdir(parents=True, exist_ok=True)
        args += ["--location", str(location)]
    # Its own process group: a Ctrl+C at the terminal reaches us, and we stop it in order.
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env=env,
    )
    urls: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        sink = open(access_log, "a", buffering=1) if access_log is not None else None
        for line in proc.stdout:
            found = _LISTENING.search(line)
            if sink is not None and line.startswith("127.0.0.1 - "):
                sink.write(line)
            if found:
                urls[found.group(1)] = found.group(2)
                if len(urls) == 3:
                    ready.set()
            elif "error" in line.lower() or "exception" in line.lower():
                print(f"azurite: {line.rstrip()}", file=sys.stderr, flush=True)
        ready.set()  # it exited

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or len(urls) < 3:
        proc.kill()
        raise SystemExit("Azurite did not start (see the lines above)")
    return proc, urls


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.azurite", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--location", type=Path, help="keep its data in this folder (default: .azurite/)")
    where.add_argument("--in-memory", action="store_true", help="keep nothing on disk (tests)")
    args = parser.parse_args()
    location = None if args.in_memory else (args.location or Path(".azurite"))
    access_log = os.environ.get("AZURITE_ACCESS_LOG")
    proc, urls = start(location, access_log=Path(access_log) if access_log else None)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"azurite listening on {urls['Table']}", flush=True)
    print(f"AzureWebJobsStorage={connection_string(urls)}", flush=True)
    while not stop.is_set() and proc.poll() is None:
        stop.wait(0.5)
    if proc.poll() is None:
        proc.terminate()  # Azurite closes its three services in about 3 s
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    sys.exit(0 if stop.is_set() else 1)


if __name__ == "__main__":
    main()
