"""/proc readers: CPU seconds and resident memory of a process and its descendants, machine load.

CPU: utime+stime of every live process in the tree, plus cutime+cstime (children that exited and
were waited for), from /proc/PID/stat; so a difference of two readings includes child processes,
even ones that ended in between. Memory: VmRSS (now) and VmHWM (the process's own peak) from
/proc/PID/status, in bytes, summed over the tree.
"""

from __future__ import annotations

import os
import threading
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("latin-1")
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'. fields[0] is the state (field 3).
    return raw[raw.rfind(")") + 2 :].split()


def descendants(pid: int) -> list[int]:
    """``pid`` and every live descendant (a scan of /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_seconds(pids: list[int], children: bool = True) -> float:
    """utime+stime (+cutime+cstime with ``children``) summed over ``pids``, in seconds.
    ``children=False`` is a process's own CPU (all its threads), without its reaped children."""
    ticks = 0
    end = 15 if children else 13
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:  # fields[11:15] = utime stime cutime cstime (stat fields 14-17)
            ticks += sum(int(x) for x in fields[11:end])
    return ticks / CLK_TCK


def cpu_groups(root: int, split: bool) -> dict[str, float]:
    """CPU seconds of the tree under ``root`` ("server"); with ``split``, also the root's own
    ("host") and its descendants' ("worker": the local host's worker processes)."""
    tree = descendants(root)
    out = {"server": cpu_seconds(tree)}
    if split:
        out["host"] = cpu_seconds([root], children=False)
        out["worker"] = cpu_seconds([p for p in tree if p != root])
    return out


def tree_cpu_seconds(pid: int) -> float:
    return cpu_seconds(descendants(pid))


def _status_kb(pid: int, keys: tuple[bytes, ...]) -> dict[bytes, int]:
    found = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                for k in keys:
                    if line.startswith(k):
                        found[k] = int(line.split()[1])
    except OSError:
        pass
    return found


def rss_bytes(pids: list[int]) -> int:
    return sum(_status_kb(p, (b"VmRSS:",)).get(b"VmRSS:", 0) for p in pids) * 1024


def hwm_bytes(pids: list[int]) -> int:
    return sum(_status_kb(p, (b"VmHWM:",)).get(b"VmHWM:", 0) for p in pids) * 1024


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    vals = [int(x) for x in parts[:8]]  # user nice system idle iowait irq softirq steal
    idle = vals[3] + vals[4]
    return (sum(vals) - idle) / CLK_TCK, sum(vals) / CLK_TCK


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


class RssSampler(threading.Thread):
    """Samples the summed VmRSS of each named process tree every ``interval`` seconds, from start()
    to stop(); ``peak(name, t0, t1)`` is the largest sample taken between two perf_counter times."""

    def __init__(self, roots: dict[str, int], interval: float = 0.025, refresh: float = 1.0):
        super().__init__(daemon=True, name="rss-sampler")
        self.roots = roots
        self.interval = interval
        self.refresh = refresh
        self.samples: dict[str, list[tuple[float, int]]] = {name: [] for name in roots}
        self._stop = threading.Event()
        self._trees = {name: [pid] for name, pid in roots.items()}

    def run(self) -> None:
        last_refresh = 0.0
        while not self._stop.is_set():
            now = time.perf_counter()
            if now - last_refresh > self.refresh:
                self._trees = {name: descendants(pid) for name, pid in self.roots.items()}
                last_refresh = now
            for name, pids in self._trees.items():
                self.samples[name].append((now, rss_bytes(pids)))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self.join(2)

    def peak(self, name: str, t0: float, t1: float) -> int:
        vals = [v for t, v in self.samples.get(name, ()) if t0 <= t <= t1]
        return max(vals) if vals else 0
