"""Figures of the side-by-side benchmark: tools/bench/out/results.json → summary → docs/benchmarks.md
(only the section between the side-by-side markers) and docs/benchmarks.png.

    tools/bench/.venv/bin/python tools/bench/report.py [tools/bench/out/results.json]    # redo the docs from a run
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

START = "<!-- bench:side-by-side:start -->"
END = "<!-- bench:side-by-side:end -->"
PATHS = ("direct", "app", "litellm")
LABEL = {"direct": "direct upstream", "app": "this app (devhost)", "litellm": "LiteLLM proxy"}
MB = 1024 * 1024

# The targets (docs/benchmarks.md explains them): ms, ratio, MB.
T_ADDED_P50_MS = 3.0
T_ADDED_P99_MS = 15.0
T_RATIO = 0.5
T_RSS_MB = 300.0
T_LEVEL = 1000


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
    upreq = [(r["up_received"] - r["sent_wall"]) * 1000 for r in recs
             if r.get("up_received") is not None and r.get("sent_wall") is not None]
    full_waves = [w for w in waves if not w["probe"]]
    deltas = sum(len(r["d"]) for r in full)
    cpu = lambda key: sum(w["cpu_s"].get(key, 0.0) for w in full_waves)  # noqa: E731
    wall = sum(w["wall_s"] * w["client_procs"] for w in full_waves)
    busy = sum(w["machine_busy_s"] for w in full_waves)
    ours = sum(sum(w["cpu_s"].values()) + w["client_cpu_s"] for w in full_waves)
    span = sum(w["t1"] - w["t0"] for w in full_waves)  # the interval the machine reading covers
    errors = Counter(r["error"] for r in full if not r["ok"])
    return {
        "streams": len(full), "completed": len(ok_full), "errors": sum(errors.values()),
        "error_kinds": dict(errors.most_common()), "probes": len(recs) - len(full),
        "deltas": deltas, "expected_deltas": expected * len(full),
        "ttfd_n": len(ttfd),
        "ttfd": {q: pct(ttfd, q) for q in (50, 95, 99)}, "ttfd_max": max(ttfd) if ttfd else None,
        "gap": {q: pct(gaps, q) for q in (50, 99)},
        "delta_latency": {q: pct(lat, q) for q in (50, 95, 99)},
        "upstream_request_ms": {q: pct(upreq, q) for q in (50, 99)},
        "cpu_per_1k": cpu("server") / deltas * 1000 if deltas and any("server" in w["cpu_s"] for w in full_waves) else None,
        "upstream_cpu_per_1k": cpu("upstream") / deltas * 1000 if deltas else None,
        "client_cpu_per_1k": sum(w["client_cpu_s"] for w in full_waves) / deltas * 1000 if deltas else None,
        "client_util": sum(w["client_cpu_s"] for w in full_waves) / wall if wall else None,
        "other_load_cores": max(0.0, (busy - ours) / span) if span else None,
        "peak_open": max((_peak_concurrency(w["records"]) for w in full_waves), default=0),
        "wall_s": max((w["wall_s"] for w in full_waves), default=None),
        "waves": len(full_waves),
        "late_start_ms_p99": pct([r["late_ms"] for r in full], 99),
        "connect_ms_p99": pct([r["connect_ms"] for r in full if r.get("connect_ms") is not None], 99),
    }


def summarize(results: dict) -> dict:
    cfg = results["config"]
    first_s, interval_s, expected = cfg["first_token_ms"] / 1000, cfg["interval_ms"] / 1000, cfg["deltas"]
    waves = results["waves"]
    paths = [p for p in PATHS if p in cfg["paths"]]
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
            owner = {"direct": "upstream", "app": "app", "litellm": "litellm"}[path]
            s["peak_rss_mb"] = max(w["peak_rss"].get(owner, 0) for w in sel) / MB
            rows[level][path] = s
        base = rows[level].get("direct")
        for path, s in rows[level].items():
            s["added_ttfd"] = {q: _sub(s["ttfd"][q], base["ttfd"][q]) if base else None for q in (50, 95, 99)}
            s["added_delta"] = {q: _sub(s["delta_latency"][q], base["delta_latency"][q]) if base else None
                                for q in (50, 95, 99)}
    client = {}
    for engine in ("raw", "httpx"):
        sel = [w for w in waves if w["phase"] == f"client-{engine}"]
        if sel:
            client[engine] = _stats(sel, first_s, interval_s, expected)
    summary = {"meta": results["meta"], "config": cfg, "wall_s": results["wall_s"], "levels": levels,
               "paths": paths, "rows": rows, "client_check": client, "hwm_mb": {k: v / MB for k, v in results.get("hwm", {}).items()},
               "started": results.get("started"), "finished": results.get("finished")}
    summary["targets"] = targets(summary)
    return summary


def targets(s: dict) -> list[dict]:
    """Each target: what it asks, what was measured, met or not (None: not measured in this run)."""
    out = []
    rows = s["rows"]
    c1 = rows.get(1, {})
    app, ll = c1.get("app"), c1.get("litellm")

    def add(key, what, measured, met, level=None):
        out.append({"key": key, "target": what, "measured": measured, "met": met, "level": level})

    if app:
        for q, limit in ((50, T_ADDED_P50_MS), (99, T_ADDED_P99_MS)):
            v = app["added_ttfd"][q]
            add(f"ttfd_p{q}", f"added TTFD p{q} ≤ {limit:g} ms over direct (1 stream)",
                _ms(v), None if v is None else v <= limit, 1)
        if ll:
            for q in (50, 99):
                a, b = app["added_ttfd"][q], ll["added_ttfd"][q]
                met = None if a is None or b is None else a <= T_RATIO * b
                add(f"ttfd_p{q}_vs_litellm", f"added TTFD p{q} ≤ ½ LiteLLM's (1 stream)",
                    f"{_ms(a)} vs {_ms(b)}" + (f" ({a / b:.2f}×)" if a is not None and b else ""), met, 1)
    big = rows.get(T_LEVEL, {}).get("app")
    if big:
        met = big["errors"] == 0 and big["completed"] == big["streams"]
        add("level_errors", f"{T_LEVEL} concurrent streams on one worker, no errors",
            f"{big['completed']}/{big['streams']} completed, {big['errors']} errors, "
            f"peak {big['peak_open']} open at once", met, T_LEVEL)
        add("level_rss", f"peak memory under {T_RSS_MB:g} MB at {T_LEVEL} streams",
            f"{big['peak_rss_mb']:.0f} MB", big["peak_rss_mb"] < T_RSS_MB, T_LEVEL)
    for level, r in rows.items():
        a, b = r.get("app"), r.get("litellm")
        if a and b and a["cpu_per_1k"] is not None and b["cpu_per_1k"]:
            add(f"cpu_{level}", f"CPU per delta ≤ ½ LiteLLM's ({level} stream{'s' if level > 1 else ''})",
                f"{a['cpu_per_1k']:.3f} vs {b['cpu_per_1k']:.3f} s/1k deltas ({a['cpu_per_1k'] / b['cpu_per_1k']:.2f}×)",
                a["cpu_per_1k"] <= T_RATIO * b["cpu_per_1k"], level)
    return out


# ------------------------------------------------------------------------------ formatting

def _ms(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f} ms"


def _n(v, fmt="{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _met(v) -> str:
    return "–" if v is None else ("✅ yes" if v else "❌ no")


def _row_targets(s: dict, level: int, ttfd: bool = False) -> str:
    """The targets judged on one row: the TTFD ones (latency table) or the others (concurrency table)."""
    mine = [t for t in s["targets"] if t["level"] == level and t["key"].startswith("ttfd") == ttfd]
    if not mine:
        return "–"
    short = {"ttfd_p50": "TTFD p50", "ttfd_p99": "TTFD p99", "ttfd_p50_vs_litellm": "p50 ≤ ½ LiteLLM",
             "ttfd_p99_vs_litellm": "p99 ≤ ½ LiteLLM", "level_errors": "no errors", "level_rss": "RSS < 300 MB"}
    parts = []
    for t in mine:
        name = short.get(t["key"], "CPU ≤ ½ LiteLLM" if t["key"].startswith("cpu_") else t["key"])
        parts.append(("✅ " if t["met"] else "❌ " if t["met"] is not None else "– ") + name)
    return "<br>".join(parts)


def machine_line(s: dict) -> str:
    m = s["meta"]
    av, bv = m.get("app_venv", {}), m.get("bench_venv", {})
    return (f"{s['meta']['date']} · {m['cores']} cores, {m['cpu_model']} (Linux {m['kernel']}) · "
            f"Python {av.get('python')} · app commit `{m['commit']}` · "
            f"app: openai {av.get('openai')}, uvicorn {av.get('uvicorn')}, azure-functions-runtime "
            f"{av.get('azure-functions-runtime')} · LiteLLM {bv.get('litellm')} (openai {bv.get('openai')}, "
            f"uvicorn {bv.get('uvicorn')})")


def markdown(s: dict, img: str = "benchmarks.png") -> str:
    cfg, rows, levels, paths = s["config"], s["rows"], s["levels"], s["paths"]
    L = []
    L.append("## Side-by-side: direct upstream vs this app vs LiteLLM")
    L.append("")
    L.append("_Generated by `make bench` (tools/bench/run.py); do not edit this section by hand._  ")
    L.append(f"{machine_line(s)}  ")
    m = s["meta"]
    other = [r[p]["other_load_cores"] for r in rows.values() for p in r if r[p].get("other_load_cores") is not None]
    L.append(f"Upstream: scripted (`fakeupstream`, scenario `cadence`): first delta after {cfg['first_token_ms']:g} ms, "
             f"then one every {cfg['interval_ms']:g} ms, {cfg['deltas']} deltas. All three paths in one run, "
             f"round-robin per trial/wave; {s['wall_s'] / 60:.1f} min of measurement"
             + (", in a private network namespace (loopback only)" if m.get("netns") else "")
             + (f"; other load on the machine during the waves: up to {max(other):.2f} cores" if other else "") + ".")
    if m.get("app_local_settings"):
        L.append(f"Note: the app also took {', '.join(m['app_local_settings'])} from local.settings.json.")
    L.append("")
    L.append(f"![side-by-side benchmark]({img})")
    L.append("")

    L.append("### Targets")
    L.append("")
    L.append("| target | measured (this app) | target met? |")
    L.append("|---|---|---|")
    for t in s["targets"]:
        L.append(f"| {t['target']} | {t['measured']} | {_met(t['met'])} |")
    L.append("")

    if 1 in rows:
        c1 = rows[1]
        L.append("### One stream at a time: latency")
        L.append("")
        n = {p: c1[p]["ttfd_n"] for p in c1}
        L.append(f"Time to first delta (TTFD) = request bytes sent → first content delta parsed, client-side. "
                 f"Samples per path: {', '.join(f'{p} {n[p]}' for p in n)} ({cfg['trials']} full streams + "
                 f"{cfg['probes']} first-delta probes each). \"Added\" = the path's percentile minus the direct "
                 f"path's. Per-delta latency = when the upstream was due to send delta k → parsed by the client "
                 f"(all {cfg['deltas']} deltas of every full stream).")
        L.append("")
        L.append("| path | TTFD p50 / p95 / p99 | added TTFD p50 / p95 / p99 | request reaches upstream p50 / p99 | "
                 "per-delta latency p50 / p99 | added delay per delta p50 / p99 | inter-delta gap p50 / p99 | target met? |")
        L.append("|---|---|---|---|---|---|---|---|")
        for p in paths:
            r = c1.get(p)
            if not r:
                continue
            t, a, u, d, ad, g = r["ttfd"], r["added_ttfd"], r["upstream_request_ms"], r["delta_latency"], r["added_delta"], r["gap"]
            added = "–" if p == "direct" else f"{_n(a[50], '{:+.2f}')} / {_n(a[95], '{:+.2f}')} / {_n(a[99], '{:+.2f}')} ms"
            addd = "–" if p == "direct" else f"{_n(ad[50], '{:+.2f}')} / {_n(ad[99], '{:+.2f}')} ms"
            tm = "–" if p != "app" else _row_targets(s, 1, ttfd=True)
            L.append(f"| {LABEL[p]} | {_n(t[50], '{:.2f}')} / {_n(t[95], '{:.2f}')} / {_n(t[99], '{:.2f}')} ms | {added} | "
                     f"{_n(u[50], '{:.2f}')} / {_n(u[99], '{:.2f}')} ms | {_n(d[50], '{:.2f}')} / {_n(d[99], '{:.2f}')} ms | "
                     f"{addd} | {_n(g[50], '{:.2f}')} / {_n(g[99], '{:.2f}')} ms | {tm} |")
        L.append("")

    L.append("### Concurrency")
    L.append("")
    L.append(f"Each wave opens N streams over {cfg['stagger_ms']:g} ms per stream (at most {cfg['max_ramp']:g} s), "
             f"one fresh TCP connection each, from {cfg['client_procs']} load-generator processes "
             f"(raw asyncio sockets, {cfg.get('loadgen_loop', '?')} loop); waves per path: "
             + ", ".join(f"{k} streams × {v}" for k, v in cfg["waves"].items() if int(k) in levels)
             + ". CPU = utime+stime of the serving process and its children (for the app: the devhost process, "
               "which holds the host and the runtime worker) per 1,000 deltas delivered; the upstream's CPU is "
               "never included (its own figure is in the direct row, in brackets). Peak RSS = largest VmRSS "
               "sampled every 25 ms during the waves.")
    L.append("")
    L.append("| streams | path | completed | errors | peak open | TTFD p50 / p99 | added TTFD p50 / p99 | "
             "inter-delta gap p50 / p99 | CPU s per 1k deltas | peak RSS | target met? |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        for p in paths:
            r = rows.get(level, {}).get(p)
            if not r:
                continue
            t, a, g = r["ttfd"], r["added_ttfd"], r["gap"]
            added = "–" if p == "direct" else f"{_n(a[50], '{:+.1f}')} / {_n(a[99], '{:+.1f}')} ms"
            cpu = (f"({_n(r['upstream_cpu_per_1k'], '{:.3f}')} upstream)" if p == "direct"
                   else _n(r["cpu_per_1k"], "{:.3f}"))
            rss = f"({r['peak_rss_mb']:.0f} MB upstream)" if p == "direct" else f"{r['peak_rss_mb']:.0f} MB"
            errs = str(r["errors"]) + (f" ({', '.join(f'{k}: {v}' for k, v in r['error_kinds'].items())})" if r["errors"] else "")
            tm = _row_targets(s, level) if p == "app" else "–"
            L.append(f"| {level:,} | {LABEL[p]} | {r['completed']}/{r['streams']} | {errs} | {r['peak_open']} | "
                     f"{_n(t[50])} / {_n(t[99])} ms | {added} | {_n(g[50])} / {_n(g[99])} ms | {cpu} | {rss} | {tm} |")
    L.append("")

    cc = s.get("client_check") or {}
    if cc:
        lvl = max(levels)
        L.append("### The load client itself (direct path)")
        L.append("")
        L.append(f"The same {lvl:,}-stream wave against the upstream directly, with httpx (`AsyncClient`, pool limits "
                 f"above the wave size) and with the raw-socket client used for every figure above. Client CPU is both "
                 f"processes together; utilisation is per process (1.0 = one core busy).")
        L.append("")
        L.append("| client | completed | TTFD p50 / p99 | inter-delta gap p50 / p99 | client CPU s per 1k deltas | client utilisation |")
        L.append("|---|---|---|---|---|---|")
        for engine, label in (("raw", "raw asyncio sockets"), ("httpx", "httpx")):
            r = cc.get(engine)
            if r:
                L.append(f"| {label} | {r['completed']}/{r['streams']} | {_n(r['ttfd'][50])} / {_n(r['ttfd'][99])} ms | "
                         f"{_n(r['gap'][50])} / {_n(r['gap'][99])} ms | {_n(r['client_cpu_per_1k'], '{:.3f}')} | "
                         f"{_n(r['client_util'], '{:.2f}')} |")
        L.append("")
    L.append("Client load during the waves (raw client, utilisation per process, 1.0 = one core): "
             + "; ".join(f"{level:,} stream{'s' if level > 1 else ''}: " + ", ".join(
                 f"{p} {_n(rows[level][p]['client_util'], '{:.2f}')}" for p in paths if p in rows[level])
                 for level in levels) + ".")
    L.append("")
    L.append("How to read this, and the caveats: [tools/bench/README.md](../tools/bench/README.md).")
    return "\n".join(L)


def write_markdown(s: dict, doc: Path, png: Path | None = None) -> None:
    import os
    img = os.path.relpath(png, doc.parent) if png else "benchmarks.png"
    section = f"{START}\n{markdown(s, img)}\n{END}"
    if doc.exists():
        text = doc.read_text(encoding="utf-8")
        if START in text and END in text and text.index(START) < text.index(END):
            text = text[:text.index(START)] + section + text[text.index(END) + len(END):]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
    else:
        text = "# Benchmarks\n\nEach section is written by its own benchmark script; see tools/bench/README.md.\n\n" + section + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")


def write_plot(s: dict, png: Path, doc: Path | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    colors = {"direct": "#7f7f7f", "app": "#1f77b4", "litellm": "#d62728"}
    rows, levels, paths = s["rows"], s["levels"], s["paths"]
    proxies = [p for p in paths if p != "direct"]
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    c1 = rows.get(1, {})

    def bars(ax, key, qs, title, ylabel, limits=None):
        width = 0.8 / max(1, len(proxies))
        for i, p in enumerate(proxies):
            if p not in c1:
                continue
            vals = [c1[p][key][q] or 0 for q in qs]
            xs = [j + (i - (len(proxies) - 1) / 2) * width for j in range(len(qs))]
            b = ax.bar(xs, vals, width, label=LABEL[p], color=colors[p])
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

    bars(axes[0, 0], "added_ttfd", (50, 95, 99), "Added time to first delta vs direct (1 stream)", "ms",
         {50: T_ADDED_P50_MS, 99: T_ADDED_P99_MS})
    bars(axes[0, 1], "added_delta", (50, 95, 99), "Added delay per delta vs direct (1 stream)", "ms")

    ax = axes[0, 2]  # inter-delta gaps at 1 stream, p50 and p99 (every gap is in results.json)
    labels = [p for p in paths if p in c1]
    data = [(c1[p]["gap"][50], c1[p]["gap"][99]) for p in labels]
    for i, (p, (g50, g99)) in enumerate(zip(labels, data)):
        ax.bar([i - 0.2], [g50 or 0], 0.4, color=colors[p], alpha=0.5, label="p50 (light)" if i == 0 else None)
        ax.bar([i + 0.2], [g99 or 0], 0.4, color=colors[p], label="p99 (dark)" if i == 0 else None)
        ax.text(i - 0.2, (g50 or 0), f"{g50:.1f}" if g50 else "", ha="center", va="bottom", fontsize=8)
        ax.text(i + 0.2, (g99 or 0), f"{g99:.1f}" if g99 else "", ha="center", va="bottom", fontsize=8)
    ax.axhline(s["config"]["interval_ms"], color="green", ls="--", lw=1, label="upstream cadence")
    ax.set_xticks(range(len(labels)), [f"{LABEL[p]}\np50 | p99" for p in labels], fontsize=8)
    ax.set_title("Inter-delta gap at the client (1 stream)", fontsize=10)
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)

    def by_level(ax, fn, title, ylabel, log=True, include=paths, hline=None):
        for p in include:
            xs = [lv for lv in levels if p in rows.get(lv, {})]
            ys = [fn(rows[lv][p]) for lv in xs]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=colors[p], label=LABEL[p])
        ax.set_xscale("log")
        if log:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.set_xticks(levels, [f"{lv:,}" for lv in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if hline:
            ax.axhline(hline[0], color="green", ls="--", lw=1, label=hline[1])
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)

    ax = axes[1, 0]
    for p in paths:
        xs = [lv for lv in levels if p in rows.get(lv, {})]
        for q, style in ((50, "o-"), (99, "s--")):
            ys = [rows[lv][p]["ttfd"][q] for lv in xs]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=colors[p], label=f"{LABEL[p]} p{q}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xticks(levels, [f"{lv:,}" for lv in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("ms")
    ax.set_title("Time to first delta vs concurrency (p50 solid, p99 dashed)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)

    by_level(axes[1, 1], lambda r: r["cpu_per_1k"], "CPU seconds of the serving process per 1,000 deltas",
             "CPU s / 1k deltas", log=False, include=proxies)
    axes[1, 1].set_ylim(bottom=0)
    by_level(axes[1, 2], lambda r: r["peak_rss_mb"], "Peak RSS of the serving process", "MB", log=False,
             include=proxies, hline=(T_RSS_MB, f"target < {T_RSS_MB:g} MB"))
    axes[1, 2].set_ylim(bottom=0)

    fig.suptitle("Streaming chat: direct upstream vs this app (devhost, real Python worker) vs LiteLLM proxy\n"
                 + machine_line(s).replace("`", ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def console_table(s: dict) -> str:
    lines = [machine_line(s).replace("`", ""), ""]
    lines.append(f"{'streams':>7} {'path':8} {'done':>11} {'err':>4} {'open':>5} {'TTFD p50':>9} {'p99':>9} "
                 f"{'+p50':>8} {'+p99':>8} {'gap p99':>8} {'CPU/1k':>7} {'RSS MB':>7}")
    for level in s["levels"]:
        for p in s["paths"]:
            r = s["rows"].get(level, {}).get(p)
            if not r:
                continue
            a = r["added_ttfd"]
            lines.append(f"{level:>7} {p:8} {r['completed']:>5}/{r['streams']:<5} {r['errors']:>4} {r['peak_open']:>5} "
                         f"{_n(r['ttfd'][50]):>9} {_n(r['ttfd'][99]):>9} {_n(a[50], '{:+.1f}'):>8} {_n(a[99], '{:+.1f}'):>8} "
                         f"{_n(r['gap'][99]):>8} {_n(r['cpu_per_1k'] if p != 'direct' else r['upstream_cpu_per_1k'], '{:.3f}'):>7} "
                         f"{r['peak_rss_mb']:>7.0f}")
    lines.append("")
    for t in s["targets"]:
        lines.append(f"  [{'MET' if t['met'] else 'NOT MET' if t['met'] is not None else '?'}] {t['target']}: {t['measured']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    here = Path(__file__).resolve().parent
    src = Path(argv[0]) if argv else here / "out" / "results.json"
    doc = Path(argv[1]) if len(argv) > 1 else here.parents[1] / "docs" / "benchmarks.md"
    png = Path(argv[2]) if len(argv) > 2 else here.parents[1] / "docs" / "benchmarks.png"
    summary = summarize(json.loads(src.read_text()))
    write_markdown(summary, doc, png)
    write_plot(summary, png, doc)
    print(console_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
