"""Figures of the side-by-side benchmark: tools/bench/out/results.json → summary → docs/benchmarks.md
(only the section between the side-by-side markers), docs/benchmarks.png and
docs/benchmarks-concurrency.png.

    tools/bench/.venv/bin/python tools/bench/report.py [tools/bench/out/results.json]    # redo the docs from a run
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

START = "<!-- bench:side-by-side:start -->"
END = "<!-- bench:side-by-side:end -->"
PATHS = ("direct", "floor", "floor2", "app", "app2", "keys", "keyslim", "keyteam", "resume", "litellm")
APPS = ("app", "app2")  # judged against the targets
LABEL = {
    "direct": "direct upstream",
    "floor": "floor: bare relay, 1 worker",
    "floor2": "floor: bare relay, 2 workers",
    "app": "this app, 1 worker",
    "app2": "this app, 2 workers",
    "keys": "app + callers (no limits), 1 worker",
    "keyslim": "app + callers (tokens/min limit), 1 worker",
    "keyteam": "app + callers (team, money budget), 1 worker",
    "resume": "app + resumable streams, 1 worker",
    "litellm": "LiteLLM proxy",
}
# Whose RSS counts for each path (a server's name in the run); results.json's config has it for new runs.
OWNER = {
    "direct": "upstream",
    "floor": "floor",
    "floor2": "floor2",
    "app": "app",
    "app2": "app2",
    "keys": "keys",
    "keyslim": "keys",
    "keyteam": "keys",
    "resume": "resume",
    "litellm": "litellm",
}
MB = 1024 * 1024

# Issue #24: the app against the floor (a bare relay on the same host and runtime), in the same run.
R_CPU_STREAM = 1.2  # CPU per stream (host + worker), at 100 and 300 streams, ≤ this × the floor's
R_WORKER_DELTA = 1.2  # worker CPU per delta (the fit at 100 streams) ≤ this × the floor's
R_TTFD = 1.3  # added TTFD p50 and p99 at 100 and 300 streams ≤ this × the floor's; p99 at 1,000 (2 workers)
D_SINGLE_P50_MS = 1.5  # one stream: added TTFD p50 ≤ the floor's + this
RATIO_LEVELS = (100, 300)
# Issue #20 (callers, against the app without them): 1 stream p50 ≤ +2 ms, 100 streams p99 ≤ +10%.
D_KEYS_P50_MS = 2.0
R_KEYS_P99 = 1.1
# Issue #21 (resumable streams, against the app without them): CPU per delta ≤ +15%.
R_RESUME_DELTA = 1.15

# Issue #16's absolute targets (ms, MB, ms of CPU), still shown for reference.
T_ADDED_P50_MS = 3.0  # 1 stream, app
T_ADDED_P99_MS = 10.0  # 1 stream, app
T_LEVEL_P99_MS = {100: 100.0, 300: 400.0}  # added TTFD p99 at that concurrency, app (1 worker)
T_LEVEL = 1000  # with 2 worker processes (app2): all complete, added p99, memory
T_LEVEL_P99_MS_BIG = 2000.0
T_RSS_MB = 400.0
T_WORKER_REQUEST_MS = 1.5  # worker CPU per request at the split level (100 streams), app
T_WORKER_DELTA_MS = 0.08  # worker CPU per delta there


def label(p: str, s: dict | None = None) -> str:
    labels = ((s or {}).get("config") or {}).get("labels") or {}
    return labels.get(p) or LABEL.get(p, p)


def pct(values, q: float):
    """q-th percentile (0-100), linear interpolation between closest ranks; None when empty."""
    v = sorted(values)
    if not v:
        return None
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _sub(a, b):
    return None if a is None or b is None else a - b


def _peak_concurrency(records) -> int:
    events = []
    for r in records:
        if r.get("open") is not None and r.get("close") is not None:
            events += [(r["open"], 1), (r["close"], -1)]
    events.sort(key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def _delta_latencies(rec, first_s: float, interval_s: float) -> list[float]:
    """ms from when the upstream was due to send delta k (its stream start + schedule) to when the
    client parsed it. Needs the upstream's record of the stream (matched by marker)."""
    start, sent = rec.get("up_started"), rec.get("sent_wall")
    if start is None or sent is None:
        return []
    base = (sent - start - first_s) * 1000
    step = interval_s * 1000
    return [base + d - k * step for k, d in enumerate(rec["d"])]


def _stats(waves, first_s, interval_s, expected) -> dict:
    recs = [r for w in waves for r in w["records"]]
    full = [r for w in waves if not w["probe"] for r in w["records"]]
    ok_full = [r for r in full if r["ok"]]
    ttfd = [r["ttfd_ms"] for r in recs if r["ttfd_ms"] is not None and r["error"] is None]
    gaps = [b - a for r in ok_full for a, b in zip(r["d"], r["d"][1:])]
    lat = [x for r in ok_full for x in _delta_latencies(r, first_s, interval_s)]
    upreq = [
        (r["up_received"] - r["sent_wall"]) * 1000
        for r in recs
        if r.get("up_received") is not None and r.get("sent_wall") is not None
    ]
    full_waves = [w for w in waves if not w["probe"]]
    deltas = sum(len(r["d"]) for r in full)
    cpu = lambda key: sum(w["cpu_s"].get(key, 0.0) for w in full_waves)  # noqa: E731 - a one-line helper
    has = lambda key: any(key in w["cpu_s"] for w in full_waves)  # noqa: E731 - a one-line helper
    per_1k = lambda key: cpu(key) / deltas * 1000 if deltas and has(key) else None  # noqa: E731 - a one-line helper
    wall = sum(w["wall_s"] * w["client_procs"] for w in full_waves)
    others = [_other_cores(w) for w in waves]
    loads = [x for w in waves for x in w.get("loadavg1", ())]
    errors = Counter(r["error"] for r in full if not r["ok"])
    return {
        "streams": len(full),
        "completed": len(ok_full),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors.most_common()),
        "probes": len(recs) - len(full),
        "deltas": deltas,
        "expected_deltas": expected * len(full),
        "ttfd_n": len(ttfd),
        "ttfd": {q: pct(ttfd, q) for q in (50, 95, 99)},
        "ttfd_max": max(ttfd) if ttfd else None,
        "gap": {q: pct(gaps, q) for q in (50, 99)},
        "delta_latency": {q: pct(lat, q) for q in (50, 95, 99)},
        "upstream_request_ms": {q: pct(upreq, q) for q in (50, 99)},
        "cpu_per_1k": per_1k("server"),
        "cpu_host_per_1k": per_1k("host"),
        "cpu_worker_per_1k": per_1k("worker"),
        # CPU per stream (host + worker), ms: every full stream's share of the serving processes' CPU.
        "cpu_per_stream_ms": cpu("server") / len(full) * 1000 if full and has("server") else None,
        "cpu_worker_per_stream_ms": cpu("worker") / len(full) * 1000 if full and has("worker") else None,
        "store_cpu_per_1k": per_1k("store"),
        "reader_instance_cpu_per_1k": per_1k("reader_instance"),
        "upstream_cpu_per_1k": cpu("upstream") / deltas * 1000 if deltas else None,
        "client_cpu_per_1k": sum(w["client_cpu_s"] for w in full_waves) / deltas * 1000 if deltas else None,
        "client_util": sum(w["client_cpu_s"] for w in full_waves) / wall if wall else None,
        "other_load_cores": max(others) if others and None not in others else None,
        "other_load_median": pct(others, 50) if others and None not in others else None,
        "loadavg1": [min(loads), max(loads)] if loads else None,
        "follower": _follower(full),
        "peak_open": max((_peak_concurrency(w["records"]) for w in full_waves), default=0),
        "wall_s": max((w["wall_s"] for w in full_waves), default=None),
        "waves": len(full_waves),
        "late_start_ms_p99": pct([r["late_ms"] for r in full], 99),
        "connect_ms_p99": pct([r["connect_ms"] for r in full if r.get("connect_ms") is not None], 99),
    }


def _other_cores(w: dict) -> float | None:
    """Cores kept busy by other processes during a wave: the machine's busy CPU less everything the
    benchmark ran (this script's process tree), over the wave's span. Older runs had no total of
    their own: None."""
    span = w["t1"] - w["t0"]
    if "ours_cpu_s" not in w or span <= 0:
        return None
    return max(0.0, (w["machine_busy_s"] - w["ours_cpu_s"]) / span)


def _follower(records: list[dict]) -> dict | None:
    """Readers on another instance (the resume path): how far behind the writer's client each delta
    reached the reader (ms), over the deltas the writer got after the reader asked; and their errors."""
    followed = [r for r in records if r.get("follower")]
    if not followed:
        return None
    lags, errors = [], Counter()
    for r in followed:
        f = r["follower"]
        if f["error"]:
            errors[f["error"]] += 1
        sent = f.get("sent_ms")
        for _k, (w, rd) in enumerate(zip(r["d"], f["d"])):
            if sent is not None and w >= sent:
                lags.append(rd - w)
    return {
        "readers": len(followed),
        "errors": dict(errors.most_common()),
        "lag_n": len(lags),
        "lag": {q: pct(lags, q) for q in (50, 99)},
    }


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Least squares of c = R·n + D·d over (n streams, d deltas, c CPU s) per wave: (R, D) in
    seconds per request and per delta; None when the waves cannot tell them apart."""
    snn = sum(n * n for n, d, c in points)
    snd = sum(n * d for n, d, c in points)
    sdd = sum(d * d for n, d, c in points)
    snc = sum(n * c for n, d, c in points)
    sdc = sum(d * c for n, d, c in points)
    det = snn * sdd - snd * snd
    if not points or det <= 1e-9 * max(1.0, snn * sdd):
        return None
    return (snc * sdd - snd * sdc) / det, (snn * sdc - snd * snc) / det


def split_cpu(waves: list[dict], path: str, level: int) -> dict | None:
    """CPU per request and per delta (ms) of each process group at ``level`` streams, from that
    level's 40-delta waves and its 10-delta ("short") waves together."""
    sel = [w for w in waves if w["path"] == path and w["phase"] in (f"c{level}", f"c{level}short")]
    if not any(w.get("short") for w in sel) or not any(not w.get("short") for w in sel):
        return None
    out = {"level": level, "waves": len(sel)}
    for group in ("server", "host", "worker", "upstream"):
        pts = [
            (len(w["records"]), sum(len(r["d"]) for r in w["records"]), w["cpu_s"][group])
            for w in sel
            if group in w["cpu_s"]
        ]
        fit = _fit(pts) if len(pts) == len(sel) else None
        if fit:
            out[group] = {"per_request_ms": fit[0] * 1000, "per_delta_ms": fit[1] * 1000}
    return out


def summarize(results: dict) -> dict:
    cfg = results["config"]
    first_s, interval_s, expected = cfg["first_token_ms"] / 1000, cfg["interval_ms"] / 1000, cfg["deltas"]
    waves = results["waves"]
    paths = [p for p in (*PATHS, *(name for name, _ in cfg.get("variants", []))) if p in cfg["paths"]]
    owner = {**OWNER, **(cfg.get("owners") or {})}
    levels = cfg["levels"]
    rows: dict = {}
    for level in levels:
        phases = ("c1", "c1probe") if level == 1 else (f"c{level}",)
        rows[level] = {}
        for path in paths:
            sel = [w for w in waves if w["phase"] in phases and w["path"] == path]
            if not sel:
                continue
            s = _stats(sel, first_s, interval_s, expected)
            s["peak_rss_mb"] = max(w["peak_rss"].get(owner.get(path, path), 0) for w in sel) / MB
            rows[level][path] = s
        base = rows[level].get("direct")
        for s in rows[level].values():
            s["added_ttfd"] = {q: _sub(s["ttfd"][q], base["ttfd"][q]) if base else None for q in (50, 95, 99)}
            s["added_delta"] = {
                q: _sub(s["delta_latency"][q], base["delta_latency"][q]) if base else None for q in (50, 95, 99)
            }
    client = {}
    for engine in ("raw", "httpx"):
        sel = [w for w in waves if w["phase"] == f"client-{engine}"]
        if sel:
            client[engine] = _stats(sel, first_s, interval_s, expected)
    for level in levels:  # readers of the short (10-delta) streams too: "every stream length"
        sel = [w for w in waves if w["phase"] == f"c{level}short" and w["path"] == "resume"]
        if sel and "resume" in rows[level]:
            rows[level]["resume"]["follower_short"] = _follower([r for w in sel for r in w["records"]])
    split_level = cfg.get("split_level", 100)
    split = {p: r for p in paths if (r := split_cpu(waves, p, split_level))}
    summary = {
        "meta": results["meta"],
        "config": cfg,
        "wall_s": results["wall_s"],
        "levels": levels,
        "paths": paths,
        "rows": rows,
        "client_check": client,
        "cpu_split": split,
        "hwm_mb": {k: v / MB for k, v in results.get("hwm", {}).items()},
        "started": results.get("started"),
        "finished": results.get("finished"),
        "quiet": results.get("quiet"),
        "cold_start": {
            name: {
                "n": len(runs),
                "s": pct([x["s"] for x in runs], 50),
                "rss_mb": pct([x["rss_mb"] for x in runs], 50),
            }
            for name, runs in (results.get("cold_start") or {}).items()
            if runs
        },
    }
    summary["load"] = machine_load(waves)
    summary["targets34"] = targets34(summary)
    summary["targets"] = targets(summary)
    summary["other_targets"] = callers_targets(summary) + resume_targets(summary)
    summary["targets16"] = targets16(summary)
    summary["floor_targets16"] = (
        targets16(summary, "floor", "floor2" if "floor2" in paths else "floor") if "floor" in paths else []
    )
    return summary


def machine_load(waves: list[dict]) -> dict | None:
    """The machine's other load during the measured waves: cores busy with processes that are not the
    benchmark's (median, 90th percentile, largest), and /proc/loadavg's 1-minute figure (all processes)."""
    other = [x for w in waves if (x := _other_cores(w)) is not None]
    loads = [x for w in waves for x in w.get("loadavg1", ())]
    if not other:
        return None
    by_level: dict = {}
    for w in waves:
        x = _other_cores(w)
        if x is not None:
            by_level.setdefault(w["n"], []).append(x)
    return {
        "waves": len(other),
        "other_median": pct(other, 50),
        "other_p90": pct(other, 90),
        "other_max": max(other),
        "loadavg_min": min(loads) if loads else None,
        "loadavg_max": max(loads) if loads else None,
        "loadavg_median": pct(loads, 50) if loads else None,
        "by_level": {lv: {"median": pct(v, 50), "max": max(v)} for lv, v in sorted(by_level.items())},
    }


def load_line(s: dict) -> str:
    ld = s.get("load")
    if not ld:
        other = _other_load(s)
        return f"other load on the machine during the waves: up to {other:.2f} cores" if other is not None else ""
    return (
        f"other load on the machine during the waves (cores busy with processes not the benchmark's, "
        f"{ld['waves']} waves): median {ld['other_median']:.2f}, 90th percentile {ld['other_p90']:.2f}, "
        f"largest {ld['other_max']:.2f}; /proc/loadavg (1 min, everything) "
        f"{ld['loadavg_min']:.2f}–{ld['loadavg_max']:.2f}, median {ld['loadavg_median']:.2f}"
    )


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def targets(
    s: dict, app: str = "app", app2: str = "app2", floor: str = "floor", floor2: str = "floor2", peer: str = "litellm"
) -> list[dict]:
    """Issue #24's targets: the app against the floor in the same run. Each: what it asks, the app's
    figure, the floor's, their ratio (or difference), met or not (None: not measured), LiteLLM's figure."""
    rows, split = s["rows"], s.get("cpu_split") or {}
    out = []

    def add(key, what, level, path, a, f, limit, kind, fmt, peer_value=None):
        if kind == "ratio":
            rel = _ratio(a, f)
            met = None if rel is None else rel <= limit
            rel_text = "–" if rel is None else f"{rel:.2f}×"
        else:  # a difference
            rel = _sub(a, f)
            met = None if rel is None else rel <= limit
            rel_text = "–" if rel is None else f"{rel:+.2f} ms"
        out.append(
            {
                "key": key,
                "target": what,
                "level": level,
                "path": path,
                "app": a,
                "floor": f,
                "rel": rel,
                "rel_text": rel_text,
                "limit": limit,
                "met": met,
                "fmt": fmt,
                "peer": peer_value,
            }
        )

    def row(level, path):
        return rows.get(level, {}).get(path) or {}

    for level in RATIO_LEVELS:
        a, f, ll = row(level, app), row(level, floor), row(level, peer)
        add(
            f"cpu_stream_{level}",
            f"CPU per stream (host + worker), {level} streams, ≤ {R_CPU_STREAM:g}× the floor's",
            level,
            app,
            a.get("cpu_per_stream_ms"),
            f.get("cpu_per_stream_ms"),
            R_CPU_STREAM,
            "ratio",
            "{:.2f} ms",
            ll.get("cpu_per_stream_ms"),
        )
    sa, sf, sl = (split.get(p) or {} for p in (app, floor, peer))
    lvl = (sa or sf).get("level", 100)
    add(
        "worker_delta",
        f"worker CPU per delta ({lvl} streams, fit) ≤ {R_WORKER_DELTA:g}× the floor's",
        lvl,
        app,
        (sa.get("worker") or {}).get("per_delta_ms"),
        (sf.get("worker") or {}).get("per_delta_ms"),
        R_WORKER_DELTA,
        "ratio",
        "{:.3f} ms",
        (sl.get("server") or {}).get("per_delta_ms"),
    )
    for level in RATIO_LEVELS:
        a, f, ll = row(level, app), row(level, floor), row(level, peer)
        for q in (50, 99):
            add(
                f"ttfd_{level}_p{q}",
                f"{level} streams, 1 worker: added TTFD p{q} ≤ {R_TTFD:g}× the floor's",
                level,
                app,
                (a.get("added_ttfd") or {}).get(q),
                (f.get("added_ttfd") or {}).get(q),
                R_TTFD,
                "ratio",
                "{:.1f} ms",
                (ll.get("added_ttfd") or {}).get(q),
            )
    a, f, ll = row(1, app), row(1, floor), row(1, peer)
    add(
        "single_p50",
        f"1 stream: added TTFD p50 ≤ the floor's + {D_SINGLE_P50_MS:g} ms",
        1,
        app,
        (a.get("added_ttfd") or {}).get(50),
        (f.get("added_ttfd") or {}).get(50),
        D_SINGLE_P50_MS,
        "diff",
        "{:.2f} ms",
        (ll.get("added_ttfd") or {}).get(50),
    )
    big = T_LEVEL
    a, f, ll = row(big, app2), row(big, floor2) or row(big, floor), row(big, peer)
    if a:
        done = a["errors"] == 0 and a["completed"] == a["streams"]
        out.append(
            {
                "key": "big_complete",
                "target": f"{big:,} streams, 2 workers: all complete",
                "level": big,
                "path": app2,
                "app": f"{a['completed']}/{a['streams']}",
                "floor": f"{f['completed']}/{f['streams']}" if f else None,
                "rel": None,
                "rel_text": "–",
                "limit": None,
                "met": done,
                "fmt": "{}",
                "peer": f"{ll['completed']}/{ll['streams']}" if ll else None,
            }
        )
    add(
        "big_p99",
        f"{big:,} streams, 2 workers: added TTFD p99 ≤ {R_TTFD:g}× the floor's (2 workers)",
        big,
        app2,
        (a.get("added_ttfd") or {}).get(99),
        (f.get("added_ttfd") or {}).get(99),
        R_TTFD,
        "ratio",
        "{:.0f} ms",
        (ll.get("added_ttfd") or {}).get(99),
    )
    if a:
        out.append(
            {
                "key": "big_rss",
                "target": f"{big:,} streams, 2 workers: peak memory < {T_RSS_MB:g} MB",
                "level": big,
                "path": app2,
                "app": a["peak_rss_mb"],
                "floor": f.get("peak_rss_mb"),
                "rel": None,
                "rel_text": "–",
                "limit": T_RSS_MB,
                "met": a["peak_rss_mb"] < T_RSS_MB,
                "fmt": "{:.0f} MB",
                "peer": ll.get("peak_rss_mb"),
            }
        )
    return out


def callers_targets(s: dict) -> list[dict]:
    """Issue #20: the app with caller keys (a caller without limits, and one with a tokens/min limit)
    against the app without them, in the same run."""
    rows = s["rows"]
    out = []
    for path in ("keys", "keyslim"):
        a, base = rows.get(1, {}).get(path), rows.get(1, {}).get("app")
        if a and base:
            d = _sub(a["added_ttfd"][50], base["added_ttfd"][50])
            out.append(
                {
                    "key": f"{path}_p50",
                    "path": path,
                    "level": 1,
                    "target": f"{label(path, s)}: 1 stream, added TTFD p50 ≤ the app's + {D_KEYS_P50_MS:g} ms",
                    "measured": f"{_n(a['added_ttfd'][50], '{:+.2f}')} vs {_n(base['added_ttfd'][50], '{:+.2f}')} ms "
                    f"({_n(d, '{:+.2f}')} ms)",
                    "met": None if d is None else d <= D_KEYS_P50_MS,
                }
            )
        a, base = rows.get(100, {}).get(path), rows.get(100, {}).get("app")
        if a and base:
            r = _ratio(a["added_ttfd"][99], base["added_ttfd"][99])
            out.append(
                {
                    "key": f"{path}_p99",
                    "path": path,
                    "level": 100,
                    "target": f"{label(path, s)}: 100 streams, added TTFD p99 ≤ {R_KEYS_P99:g}× the app's",
                    "measured": f"{_n(a['added_ttfd'][99])} vs {_n(base['added_ttfd'][99])} ms "
                    f"({_n(r, '{:.2f}')}×; {a['completed']}/{a['streams']} completed)",
                    "met": None if r is None else (r <= R_KEYS_P99 and a["errors"] == 0),
                }
            )
    return out + team_targets(s)


def team_targets(s: dict, path: str = "keyteam", base: str = "keyslim") -> list[dict]:
    """Issue #31: the keyed path with a team and a money budget costs no more than the keyed path with
    a token limit (keyteam against keyslim, same app, same run). Its three rows whenever a caller path
    ran ("not measured" where the run lacks one of the two)."""
    rows, split = s["rows"], s.get("cpu_split") or {}
    if not any(p in (s.get("paths") or ()) for p in ("keys", "keyslim", path)):
        return []
    name = label(path, s)
    a, b = rows.get(1, {}).get(path) or {}, rows.get(1, {}).get(base) or {}
    d = _sub((a.get("added_ttfd") or {}).get(50), (b.get("added_ttfd") or {}).get(50))
    p50 = (
        f"{a['added_ttfd'][50]:+.2f} vs {b['added_ttfd'][50]:+.2f} ms ({d:+.2f} ms)" if d is not None else NOT_MEASURED
    )
    a, b = rows.get(100, {}).get(path) or {}, rows.get(100, {}).get(base) or {}
    r = _ratio((a.get("added_ttfd") or {}).get(99), (b.get("added_ttfd") or {}).get(99))
    p99 = (
        f"{a['added_ttfd'][99]:.1f} vs {b['added_ttfd'][99]:.1f} ms ({r:.2f}×; {a['completed']}/{a['streams']} completed)"
        if r is not None
        else NOT_MEASURED
    )
    wa, wb = ((split.get(p) or {}).get("worker") or {} for p in (path, base))
    dr = _sub(wa.get("per_request_ms"), wb.get("per_request_ms"))
    lvl = (split.get(path) or split.get(base) or {}).get("level", 100)
    req = (
        f"{wa['per_request_ms']:.2f} vs {wb['per_request_ms']:.2f} ms ({dr:+.2f} ms)"
        if dr is not None
        else NOT_MEASURED
    )
    return [
        {
            "key": f"{path}_p50",
            "path": path,
            "level": 1,
            "target": f"{name}: 1 stream, added TTFD p50 ≤ the token-limit caller's",
            "measured": p50,
            "met": None if d is None else d <= 0,
        },
        {
            "key": f"{path}_p99",
            "path": path,
            "level": 100,
            "target": f"{name}: 100 streams, added TTFD p99 ≤ the token-limit caller's",
            "measured": p99,
            "met": None if r is None else (r <= 1.0 and a["errors"] == 0),
        },
        {
            "key": f"{path}_request",
            "path": path,
            "level": lvl,
            "target": f"{name}: worker CPU per request ({lvl} streams, fit) ≤ the token-limit caller's",
            "measured": req,
            "met": None if dr is None else dr <= 0,
        },
    ]


NOT_MEASURED = "not measured"


def targets34(s: dict) -> list[dict]:
    """Issue #34's table, its rows as the issue lists them: each with what was measured (or "not
    measured" when the run lacks it), the target, and met or not (None: not measured)."""
    rows, split = s["rows"], s.get("cpu_split") or {}
    out = []

    def row(level, path):
        return rows.get(level, {}).get(path) or {}

    def add(key, what, measured, target, met):
        out.append({"key": key, "target": what, "measured": measured or NOT_MEASURED, "limit": target, "met": met})

    def added(level, path, q):
        return (row(level, path).get("added_ttfd") or {}).get(q)

    wk, wa = ((split.get(p) or {}).get("worker") or {} for p in ("keys", "app"))
    d = _sub(wk.get("per_request_ms"), wa.get("per_request_ms"))
    add(
        "keyed_request",
        "worker CPU per request, keyed (`CALLER_KEYS=required`)",
        d is not None
        and f"{wk['per_request_ms']:.2f} against {wa['per_request_ms']:.2f} ms without keys ({d:+.2f} ms)",
        "≤ +1 ms over the unkeyed path",
        None if d is None else d <= 1.0,
    )
    r = _ratio(added(100, "keys", 99), added(100, "app", 99))
    lim = _ratio(added(100, "keyslim", 99), added(100, "app", 99))
    add(
        "keyed_p99",
        "added first-delta p99 at 100 streams, keyed",
        r is not None
        and f"{r:.2f}× the unkeyed app ({_n(added(100, 'keys', 99))} against {_n(added(100, 'app', 99))} ms)"
        + (f"; {lim:.2f}× with a token limit" if lim is not None else ""),
        "≤ 1.1×",
        None if r is None else r <= 1.1,
    )
    d = _sub(added(1, "keyslim", 50), added(1, "app", 50))
    add(
        "keyed_limit_p50",
        "1 stream, keyed with a limit: added first-delta p50",
        d is not None
        and f"{d:+.2f} ms over the unkeyed app ({added(1, 'keyslim', 50):+.2f} against {added(1, 'app', 50):+.2f} ms)",
        "≤ +1 ms",
        None if d is None else d <= 1.0,
    )
    cr, ca = row(100, "resume").get("cpu_per_stream_ms"), row(100, "app").get("cpu_per_stream_ms")
    r = _ratio(cr, ca)
    add(
        "resume_cpu_stream",
        "CPU per 40-delta stream, resumable (host + worker)",
        r is not None and f"{cr:.1f} against {ca:.1f} ms ({(r - 1) * 100:+.0f}%; 100 streams)",
        "≤ +15%",
        None if r is None else r <= 1.15,
    )
    lags = {
        n: (f.get("lag") or {}).get(99)
        for n, f in (
            ("40-delta", row(100, "resume").get("follower")),
            ("10-delta", row(100, "resume").get("follower_short")),
        )
        if f
    }
    worst = max((v for v in lags.values() if v is not None), default=None)
    add(
        "reader_lag_p99",
        "reader on another instance: lag behind the producer's caller at 100 streams, p99",
        worst is not None and ", ".join(f"{_n(v, '{:,.0f}')} ms ({n} streams)" for n, v in lags.items()),
        "≤ 250 ms for every stream length",
        None if worst is None else worst <= 250,
    )
    rs = [
        _ratio(row(lv, "app").get("cpu_per_stream_ms"), row(lv, "floor").get("cpu_per_stream_ms")) for lv in (100, 300)
    ]
    add(
        "cpu_vs_floor",
        "CPU per stream against the bare relay, 100 and 300 streams",
        any(x is not None for x in rs) and " and ".join(_n(x, "{:.2f}×") for x in rs),
        "≤ 1.2×",
        None if None in rs else all(x <= 1.2 for x in rs),
    )
    rs = [_ratio(added(lv, "app", 99), added(lv, "floor", 99)) for lv in (100, 300)]
    rs.append(_ratio(added(T_LEVEL, "app2", 99), added(T_LEVEL, "floor2", 99) or added(T_LEVEL, "floor", 99)))
    add(
        "p99_vs_floor",
        "added first-delta p99 against the bare relay, 100 / 300 / 1,000 streams",
        any(x is not None for x in rs) and " / ".join(_n(x, "{:.2f}×") for x in rs),
        "≤ 1.3×",
        None if None in rs else all(x <= 1.3 for x in rs),
    )
    r = _ratio(added(100, "resume", 50), added(100, "app", 50))
    add(
        "resume_p50",
        "added first-delta p50 at 100 streams, resumable",
        r is not None
        and f"{r:.2f}× the app's ({_n(added(100, 'resume', 50), '{:+,.0f}')} against "
        f"{_n(added(100, 'app', 50), '{:+,.0f}')} ms)",
        "≤ 1.1×",
        None if r is None else r <= 1.1,
    )
    cs = s.get("cold_start") or {}
    app, pk = cs.get("app"), cs.get("packages")
    d = _sub((app or {}).get("s"), (pk or {}).get("s"))
    add(
        "cold_start",
        "cold start: `import function_app` on a quiet machine",
        d is not None
        and f"{app['s']:.2f} s and {app['rss_mb']:.0f} MB, against {pk['s']:.2f} s and {pk['rss_mb']:.0f} MB for "
        f"the three packages alone ({d:+.2f} s; median of {app['n']})",
        "≤ +0.3 s",
        None if d is None else d <= 0.3,
    )
    mk, ma = row(1, "keys").get("peak_rss_mb"), row(1, "app").get("peak_rss_mb")
    d = _sub(mk, ma)
    add(
        "keyed_memory",
        "memory of one keyed instance (host + worker)",
        d is not None and f"{mk:.0f} against {ma:.0f} MB unkeyed ({d:+.0f} MB; peak at 1 stream)",
        "≤ +50 MB",
        None if d is None else d <= 50,
    )
    return out


def resume_targets(s: dict) -> list[dict]:
    """Issue #21: the app with RESUMABLE_STREAMS=on against the app without it; readers on a second
    instance (their lag is reported, no limit is set)."""
    split, rows = s.get("cpu_split") or {}, s["rows"]
    r, base = (split.get("resume") or {}).get("server"), (split.get("app") or {}).get("server")
    out = []
    if r and base:
        ratio = _ratio(r["per_delta_ms"], base["per_delta_ms"])
        out.append(
            {
                "key": "resume_delta",
                "path": "resume",
                "level": split["resume"]["level"],
                "target": f"resumable streams: CPU per delta (host + worker, fit) ≤ {R_RESUME_DELTA:g}× the app's",
                "measured": f"{r['per_delta_ms']:.3f} vs {base['per_delta_ms']:.3f} ms ({_n(ratio, '{:.2f}')}×)",
                "met": None if ratio is None else ratio <= R_RESUME_DELTA,
            }
        )
    for level in sorted(rows):
        f = (rows[level].get("resume") or {}).get("follower")
        if f:
            errs = ", ".join(f"{k}: {v}" for k, v in f["errors"].items()) or "none"
            out.append(
                {
                    "key": f"resume_lag_{level}",
                    "path": "resume",
                    "level": level,
                    "target": f"resumable streams, {level} stream{'s' if level > 1 else ''}: a reader on another "
                    f"instance, lag behind the writer's client p50 / p99",
                    "measured": f"{_n(f['lag'][50])} / {_n(f['lag'][99])} ms over {f['lag_n']} deltas of "
                    f"{f['readers']} readers (errors: {errs})",
                    "met": None,
                }
            )
    return out


def targets16(s: dict, one: str = "app", two: str = "app2") -> list[dict]:
    """Each target: what it asks, what was measured, met or not (None: not measured in this run).
    ``one``/``two``: the paths judged as the app with one and with two worker processes (the floor
    is judged by the same rules with its one worker for both)."""
    out = []
    rows = s["rows"]

    def add(key, what, measured, met, level=None, path=one):
        out.append({"key": key, "target": what, "measured": measured, "met": met, "level": level, "path": path})

    app = rows.get(1, {}).get(one)
    if app:
        for q, limit in ((50, T_ADDED_P50_MS), (99, T_ADDED_P99_MS)):
            v = app["added_ttfd"][q]
            add(
                f"ttfd_p{q}",
                f"added TTFD p{q} ≤ {limit:g} ms over direct (1 stream)",
                _ms(v),
                None if v is None else v <= limit,
                1,
            )
    for level, limit in T_LEVEL_P99_MS.items():
        r = rows.get(level, {}).get(one)
        if r:
            v = r["added_ttfd"][99]
            ok = r["errors"] == 0 and v is not None and v <= limit
            add(
                f"level_p99_{level}",
                f"{level} concurrent streams (1 worker): added TTFD p99 ≤ {limit:g} ms",
                f"{_ms(v)} ({r['completed']}/{r['streams']} completed)",
                ok,
                level,
            )
    big = rows.get(T_LEVEL, {}).get(two)
    if big:
        add(
            "big_complete",
            f"{T_LEVEL:,} concurrent streams, 2 worker processes: all complete",
            f"{big['completed']}/{big['streams']} completed, {big['errors']} errors, peak {big['peak_open']} open at once",
            big["errors"] == 0 and big["completed"] == big["streams"],
            T_LEVEL,
            two,
        )
        v = big["added_ttfd"][99]
        add(
            "big_p99",
            f"{T_LEVEL:,} concurrent streams, 2 worker processes: added TTFD p99 ≤ {T_LEVEL_P99_MS_BIG / 1000:g} s",
            _ms(v, 0),
            None if v is None else v <= T_LEVEL_P99_MS_BIG,
            T_LEVEL,
            two,
        )
        add(
            "big_rss",
            f"{T_LEVEL:,} concurrent streams, 2 worker processes: peak memory of all the app's processes "
            f"< {T_RSS_MB:g} MB",
            f"{big['peak_rss_mb']:.0f} MB",
            big["peak_rss_mb"] < T_RSS_MB,
            T_LEVEL,
            two,
        )
    split = s.get("cpu_split", {}).get(one, {}).get("worker")
    if split:
        lvl = s["cpu_split"][one]["level"]
        v = split["per_request_ms"]
        add(
            "worker_request",
            f"worker CPU per request ≤ {T_WORKER_REQUEST_MS:g} ms ({lvl} streams)",
            f"{v:.2f} ms",
            v <= T_WORKER_REQUEST_MS,
            lvl,
        )
        v = split["per_delta_ms"]
        add(
            "worker_delta",
            f"worker CPU per delta ≤ {T_WORKER_DELTA_MS:g} ms ({lvl} streams)",
            f"{v:.3f} ms",
            v <= T_WORKER_DELTA_MS,
            lvl,
        )
    return out


# ------------------------------------------------------------------------------ formatting


def _ms(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f} ms"


def _n(v, fmt="{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _met(v) -> str:
    return "–" if v is None else ("✅ yes" if v else "❌ no")


def machine_line(s: dict) -> str:
    m = s["meta"]
    av, bv = m.get("app_venv", {}), m.get("bench_venv", {})
    return (
        f"{s['meta']['date']} · {m['cores']} cores, {m['cpu_model']} (Linux {m['kernel']}) · "
        f"Python {av.get('python')} · app commit `{m['commit']}` · "
        f"app: openai {av.get('openai')}, uvicorn {av.get('uvicorn')}, azure-functions-runtime "
        f"{av.get('azure-functions-runtime')}, grpcio {av.get('grpcio')} · LiteLLM {bv.get('litellm')} "
        f"(openai {bv.get('openai')}, uvicorn {bv.get('uvicorn')})"
    )


def _other_load(s: dict) -> float | None:
    other = [
        r[p]["other_load_cores"] for r in s["rows"].values() for p in r if r[p].get("other_load_cores") is not None
    ]
    return max(other) if other else None


REPRODUCE = """```bash
make bench                                  # every path, interleaved, about 25 min on 2 cores: rewrites this section
make bench BENCH_ARGS=--quick               # a smoke run (~3 min), tools/bench/out/ only
tools/bench/run.sh --paths direct,app,keys,keyslim,keyteam --levels 1,100 --no-docs --out tools/bench/out/keys
tools/bench/.venv/bin/python tools/bench/ab.py tools/bench/out/keys/results.json keyslim keyteam   # paired ratios
tools/bench/.venv/bin/python tools/bench/report.py tools/bench/out/results.json                     # redraw from a run
```"""


def markdown(s: dict, img: str = "benchmarks.png", img2: str = "benchmarks-concurrency.png") -> str:
    """The doc's section: what a reader needs, the app against the floor and LiteLLM. The rest of a
    run is in the console table (console_table) and tools/bench/out/summary.json."""
    cfg, m = s["config"], s["meta"]
    other = (s.get("load") or {}).get("other_p90", _other_load(s))
    L = ["## This round's figures", ""]
    L.append("_Generated by `make bench` (tools/bench/report.py from one run); do not edit this section by hand._  ")
    L.append(f"{machine_line(s)}  ")
    L.append(
        f"Upstream: scripted, first delta after {cfg['first_token_ms']:g} ms, then one every "
        f"{cfg['interval_ms']:g} ms, {cfg['deltas']} deltas. Every path in one run, round-robin; "
        f"{s['wall_s'] / 60:.1f} min of measurement"
        + (", loopback only" if m.get("netns") else "")
        + (f"; {load_line(s)}" if load_line(s) else "")
        + ". Definitions and caveats: [tools/bench/README.md](../tools/bench/README.md)."
    )
    if other is not None and other >= 0.3:
        L.append(
            f"**The machine was busy with other work during this run** (90th percentile {other:.2f} of its "
            f"{m['cores']} cores): every figure below is noisier than on a quiet machine."
        )
    if m.get("app_local_settings"):
        L.append(f"Note: the app also took {', '.join(m['app_local_settings'])} from local.settings.json.")
    L.append("")
    L.append("### Against the floor and LiteLLM (issue #24)")
    L.append("")
    L.append(
        'The floor: a bare aiohttp relay on the same host and runtime (tools/bench/README.md, "The floor"); '
        "at 1,000 streams the 2-worker app against the 2-worker floor. TTFD: time to the first delta; "
        "added: beyond the upstream's own."
    )
    L.append("")
    L.append("| target | this app | the floor | app ÷ floor (or app − floor) | met? | LiteLLM |")
    L.append("|---|---|---|---|---|---|")
    for t in s["targets"]:
        fmt = lambda v, t=t: "–" if v is None else (t["fmt"].format(v) if not isinstance(v, str) else v)  # noqa: E731 - a one-line helper
        L.append(
            f"| {t['target']} | {fmt(t['app'])} | {fmt(t['floor'])} | {t['rel_text']} | {_met(t['met'])} | "
            f"{fmt(t['peer'])} |"
        )
    L.append("")
    L.append(f"![side-by-side benchmark]({img})")
    L.append("")
    L.append(f"![time to first delta against concurrency]({img2})")
    L.append("")
    L += scaling_inputs(s)
    L.append("### How to reproduce")
    L.append("")
    L.append(REPRODUCE)
    L.append("")
    L.append(
        "The rest of a run (every path at every concurrency, the callers' and resumable streams' targets) "
        "is in report.py's console output and `tools/bench/out/summary.json`."
    )
    return "\n".join(L)


SCALING_PATHS = ("floor", "app", "litellm")  # what tools/bench/scaling.py reads back


def scaling_inputs(s: dict) -> list[str]:
    """The figures docs/scaling.md is computed from (tools/bench/scaling.py reads them back from the
    doc): CPU per request and per delta, and peak memory, of the floor, the app and LiteLLM."""
    cfg, L = s["config"], []
    split = {p: r for p, r in (s.get("cpu_split") or {}).items() if p in SCALING_PATHS}
    if split:
        lvl = next(iter(split.values()))["level"]
        L.append(f"### CPU per request and per delta ({lvl} concurrent streams)")
        L.append("")
        L.append(
            f"A least-squares fit of CPU = requests × per-request + deltas × per-delta over the {lvl}-stream "
            f"waves of {cfg['deltas']}-delta and of 10-delta streams, per process group; docs/scaling.md is "
            "computed from it and the peak memory below."
        )
        L.append("")
        L.append("| path | host: ms per request / per delta | worker: ms per request / per delta | total |")
        L.append("|---|---|---|---|")
        fmt = lambda g: "–" if not g else f"{g['per_request_ms']:.2f} / {g['per_delta_ms']:.3f}"  # noqa: E731 - a one-line helper
        for p in s["paths"]:
            if p in split:
                r = split[p]
                L.append(f"| {label(p, s)} | {fmt(r.get('host'))} | {fmt(r.get('worker'))} | {fmt(r.get('server'))} |")
        L.append("")
    levels = [lv for lv in s["levels"] if any(p in s["rows"].get(lv, {}) for p in SCALING_PATHS)]
    if levels:
        L.append("### Peak memory (every process of the path)")
        L.append("")
        L.append("| path | " + " | ".join(f"{lv:,} stream{'s' if lv != 1 else ''}" for lv in levels) + " |")
        L.append("|---|" + "---|" * len(levels))
        for p in s["paths"]:
            if p not in SCALING_PATHS:
                continue
            cells = [s["rows"].get(lv, {}).get(p) for lv in levels]
            if any(cells):
                L.append(
                    f"| {label(p, s)} | " + " | ".join(f"{r['peak_rss_mb']:.0f} MB" if r else "–" for r in cells) + " |"
                )
        L.append("")
    return L


def write_markdown(s: dict, doc: Path, png: Path | None = None, png2: Path | None = None) -> None:
    import os

    img = os.path.relpath(png, doc.parent) if png else "benchmarks.png"
    img2 = os.path.relpath(png2, doc.parent) if png2 else "benchmarks-concurrency.png"
    section = f"{START}\n{markdown(s, img, img2)}\n{END}"
    if doc.exists():
        text = doc.read_text(encoding="utf-8")
        if START in text and END in text and text.index(START) < text.index(END):
            text = text[: text.index(START)] + section + text[text.index(END) + len(END) :]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
    else:
        text = (
            "# Benchmarks\n\nEach section is written by its own benchmark script; see tools/bench/README.md.\n\n"
            + section
            + "\n"
        )
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")


_COLORS = {
    "direct": "#7f7f7f",
    "floor": "#9467bd",
    "floor2": "#c5b0d5",
    "app": "#1f77b4",
    "app2": "#2ca02c",
    "keys": "#ff7f0e",
    "keyslim": "#8c564b",
    "keyteam": "#bc8f8f",
    "resume": "#e377c2",
    "litellm": "#d62728",
}
_SPARE = ("#17becf", "#bcbd22", "#393b79", "#637939", "#843c39")


class _Colors(dict):
    def __missing__(self, key):  # variants: the next spare colour
        self[key] = _SPARE[len([k for k in self if k not in _COLORS]) % len(_SPARE)]
        return self[key]


COLORS = _Colors(_COLORS)


def _log_axes(ax, levels) -> None:
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xticks(levels, [f"{lv:,}" for lv in levels])
    ax.set_xlabel("concurrent streams")
    ax.grid(True, which="both", alpha=0.3)


def write_plot(s: dict, png: Path, doc: Path | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, levels, paths = s["rows"], s["levels"], s["paths"]
    proxies = [p for p in paths if p != "direct"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    c1 = rows.get(1, {})
    single = [p for p in proxies if p in c1]

    def bars(ax, key, qs, title, ylabel, limits=None):
        width = 0.8 / max(1, len(single))
        for i, p in enumerate(single):
            vals = [c1[p][key][q] or 0 for q in qs]
            xs = [j + (i - (len(single) - 1) / 2) * width for j in range(len(qs))]
            b = ax.bar(xs, vals, width, label=label(p, s), color=COLORS[p])
            ax.bar_label(b, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(qs)), [f"p{q}" for q in qs])
        for q, lim in (limits or {}).items():
            if q in qs:
                j = qs.index(q)
                ax.hlines(lim, j - 0.45, j + 0.45, colors="green", linestyles="--", label=f"target p{q} ≤ {lim:g} ms")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.axhline(0, color="black", lw=0.5)
        ax.legend(fontsize=8)

    bars(
        axes[0, 0],
        "added_ttfd",
        (50, 95, 99),
        "Added time to first delta vs direct (1 stream)",
        "ms",
        {50: T_ADDED_P50_MS, 99: T_ADDED_P99_MS},
    )
    bars(axes[0, 1], "added_delta", (50, 95, 99), "Added delay per delta vs direct (1 stream)", "ms")

    ax = axes[0, 2]  # inter-delta gaps at 1 stream, p50 and p99 (every gap is in results.json)
    labels = [p for p in paths if p in c1]
    for i, p in enumerate(labels):
        g50, g99 = c1[p]["gap"][50], c1[p]["gap"][99]
        ax.bar([i - 0.2], [g50 or 0], 0.4, color=COLORS[p], alpha=0.5, label="p50 (light)" if i == 0 else None)
        ax.bar([i + 0.2], [g99 or 0], 0.4, color=COLORS[p], label="p99 (dark)" if i == 0 else None)
        ax.text(i - 0.2, (g50 or 0), f"{g50:.1f}" if g50 else "", ha="center", va="bottom", fontsize=8)
        ax.text(i + 0.2, (g99 or 0), f"{g99:.1f}" if g99 else "", ha="center", va="bottom", fontsize=8)
    ax.axhline(s["config"]["interval_ms"], color="green", ls="--", lw=1, label="upstream cadence")
    ax.set_xticks(range(len(labels)), [f"{label(p, s)}\np50 | p99" for p in labels], fontsize=8)
    ax.set_title("Inter-delta gap at the client (1 stream)", fontsize=10)
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)

    ax = axes[1, 0]
    for p in paths:
        xs = [lv for lv in levels if p in rows.get(lv, {})]
        for q, style in ((50, "o-"), (99, "s--")):
            pts = [(x, rows[x][p]["ttfd"][q]) for x in xs if rows[x][p]["ttfd"][q] is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=COLORS[p], label=f"{label(p, s)} p{q}")
    _log_axes(ax, levels)
    ax.set_ylabel("ms")
    ax.set_title("Time to first delta vs concurrency (p50 solid, p99 dashed)", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[1, 1]  # CPU per 1k deltas: the app's host and worker stacked, LiteLLM beside them
    width = 0.8 / max(1, len(proxies))
    for i, p in enumerate(proxies):
        xs = [j + (i - (len(proxies) - 1) / 2) * width for j in range(len(levels))]
        r = [rows.get(lv, {}).get(p) for lv in levels]
        if (rows.get(levels[-1], {}).get(p) or rows.get(levels[0], {}).get(p) or {}).get("cpu_host_per_1k") is not None:
            host = [(x or {}).get("cpu_host_per_1k") or 0 for x in r]
            worker = [(x or {}).get("cpu_worker_per_1k") or 0 for x in r]
            ax.bar(xs, worker, width, color=COLORS[p], label=f"{label(p, s)}: worker (solid) + host (hatched)")
            ax.bar(xs, host, width, bottom=worker, color=COLORS[p], alpha=0.35, hatch="//")
        else:
            ax.bar(xs, [(x or {}).get("cpu_per_1k") or 0 for x in r], width, color=COLORS[p], label=label(p, s))
    ax.set_xticks(range(len(levels)), [f"{lv:,}" for lv in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("CPU s / 1k deltas")
    ax.set_title("CPU per 1,000 deltas (the app: worker processes + host)", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[1, 2]
    for p in proxies:
        pts = [(lv, rows[lv][p]["peak_rss_mb"]) for lv in levels if p in rows.get(lv, {})]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=COLORS[p], label=label(p, s))
    ax.set_xscale("log")
    ax.set_xticks(levels, [f"{lv:,}" for lv in levels])
    ax.axhline(T_RSS_MB, color="green", ls="--", lw=1, label=f"target < {T_RSS_MB:g} MB (2 workers, {T_LEVEL:,})")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("MB")
    ax.set_title("Peak RSS of the serving processes (all of them)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)

    fig.suptitle(
        "Streaming chat: direct upstream vs this app (devhost, real Python worker processes) vs LiteLLM proxy\n"
        + machine_line(s).replace("`", ""),
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def write_concurrency_plot(s: dict, png: Path) -> None:
    """TTFD p50 and p99 against concurrency, every path, with the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, levels, paths = s["rows"], s["levels"], s["paths"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    direct = {lv: rows[lv]["direct"]["ttfd"] for lv in levels if "direct" in rows.get(lv, {})}
    for ax, q in zip(axes, (50, 99)):
        for p in paths:
            pts = [(lv, rows[lv][p]["ttfd"][q]) for lv in levels if p in rows.get(lv, {}) and rows[lv][p]["ttfd"][q]]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=COLORS[p], label=label(p, s), lw=2)
                for x, y in pts:
                    ax.annotate(
                        f"{y:,.0f}" if y >= 10 else f"{y:.1f}",
                        (x, y),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                        color=COLORS[p],
                    )
        if q == 99:  # the targets are added p99 over direct: draw them at direct + limit
            marks = [
                (1, T_ADDED_P99_MS, "app"),
                *((lv, lim, "app") for lv, lim in T_LEVEL_P99_MS.items()),
                (T_LEVEL, T_LEVEL_P99_MS_BIG, "app2"),
            ]
        else:
            marks = [(1, T_ADDED_P50_MS, "app")]
        first = True
        for lv, lim, who in marks:
            if lv in direct and direct[lv][q] is not None:
                ax.plot(
                    [lv],
                    [direct[lv][q] + lim],
                    "v",
                    color=COLORS[who],
                    ms=10,
                    mfc="none",
                    mew=2,
                    label="target (direct + limit)" if first else None,
                )
                first = False
        _log_axes(ax, levels)
        ax.set_ylabel("ms (client-side, request sent → first content delta)")
        ax.set_title(f"Time to first delta p{q} against concurrent streams", fontsize=11)
        ax.legend(fontsize=8)
    fig.suptitle("Concurrency sweep · " + machine_line(s).replace("`", ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def console_table(s: dict) -> str:
    lines = [machine_line(s).replace("`", ""), ""]
    lines.append(
        f"{'streams':>7} {'path':8} {'done':>11} {'err':>4} {'open':>5} {'TTFD p50':>9} {'p99':>9} "
        f"{'+p50':>8} {'+p99':>8} {'gap p99':>8} {'host/1k':>7} {'wrkr/1k':>7} {'CPU/1k':>7} {'RSS MB':>7}"
    )
    for level in s["levels"]:
        for p in s["paths"]:
            r = s["rows"].get(level, {}).get(p)
            if not r:
                continue
            a = r["added_ttfd"]
            lines.append(
                f"{level:>7} {p:8} {r['completed']:>5}/{r['streams']:<5} {r['errors']:>4} {r['peak_open']:>5} "
                f"{_n(r['ttfd'][50]):>9} {_n(r['ttfd'][99]):>9} {_n(a[50], '{:+.1f}'):>8} {_n(a[99], '{:+.1f}'):>8} "
                f"{_n(r['gap'][99]):>8} {_n(r.get('cpu_host_per_1k'), '{:.3f}'):>7} "
                f"{_n(r.get('cpu_worker_per_1k'), '{:.3f}'):>7} "
                f"{_n(r['cpu_per_1k'] if p != 'direct' else r['upstream_cpu_per_1k'], '{:.3f}'):>7} "
                f"{r['peak_rss_mb']:>7.0f}"
            )
    lines.append("")
    for p, r in (s.get("cpu_split") or {}).items():
        parts = [
            f"{g} {r[g]['per_request_ms']:.2f} ms/request + {r[g]['per_delta_ms']:.3f} ms/delta"
            for g in ("host", "worker", "server", "upstream")
            if g in r
        ]
        lines.append(f"  CPU split at {r['level']} streams, {p}: " + "; ".join(parts))
    lines.append("")
    for t in s["targets"]:
        fmt = lambda v, t=t: "–" if v is None else (t["fmt"].format(v) if not isinstance(v, str) else v)  # noqa: E731 - a one-line helper
        lines.append(
            f"  [{'MET' if t['met'] else 'NOT MET' if t['met'] is not None else '?'}] {t['target']}: "
            f"app {fmt(t['app'])}, floor {fmt(t['floor'])} ({t['rel_text']}); LiteLLM {fmt(t['peer'])}"
        )
    for t in [*(s.get("other_targets") or ()), *(s.get("targets34") or ())]:
        lines.append(
            f"  [{'MET' if t['met'] else 'NOT MET' if t['met'] is not None else '-'}] {t['target']}: {t['measured']}"
        )
    for t in s.get("targets16") or ():
        lines.append(
            f"  [#16 {'MET' if t['met'] else 'NOT MET' if t['met'] is not None else '-'}] {t['target']}: {t['measured']}"
        )
    if s.get("load"):
        lines.append("  " + load_line(s))
    return "\n".join(lines)


def write_all(summary: dict, doc: Path, png: Path) -> Path:
    png2 = png.with_name(png.stem + "-concurrency" + png.suffix)
    write_markdown(summary, doc, png, png2)
    write_plot(summary, png, doc)
    write_concurrency_plot(summary, png2)
    return png2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    here = Path(__file__).resolve().parent
    src = Path(argv[0]) if argv else here / "out" / "results.json"
    doc = Path(argv[1]) if len(argv) > 1 else here.parents[1] / "docs" / "benchmarks.md"
    png = Path(argv[2]) if len(argv) > 2 else here.parents[1] / "docs" / "benchmarks.png"
    summary = summarize(json.loads(src.read_text()))
    (src.parent / "summary.json").write_text(json.dumps(summary, indent=1))
    write_all(summary, doc, png)
    print(console_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
