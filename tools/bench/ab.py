"""Paired A/B figures from one interleaved run (tools/bench/run.py with --variant): for each level,
each wave of path B is paired with the wave of path A of the same round (they ran next to each
other, so the machine's drift hits both), and the pairs' ratios are summarised: median, and the
lowest and highest pair, and a 95% bootstrap interval of the median (``ci``: the pairs resampled;
a change is shown when that interval excludes 1.0). Per wave: CPU per stream (host + worker), the worker's alone, and the added
TTFD p50 and p99 over the direct path's wave of the same round; the other load during the two waves.

    tools/bench/.venv/bin/python tools/bench/ab.py OUT/results.json A B [--md]

A and B are path names (app, base, floor, a --variant name). At 1 stream the trials are pooled (one
stream per wave says little): B's added TTFD p50 and A's, over all trials and probes, and a 95%
bootstrap interval of their difference.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from report import _follower, _other_cores, pct  # noqa: E402 - after sys.path names the repository


def _ttfd(w: dict, q: float) -> float | None:
    v = [r["ttfd_ms"] for r in w["records"] if r["ttfd_ms"] is not None and r["error"] is None]
    return pct(v, q)


def per_wave(w: dict, direct: dict | None) -> dict:
    n = len(w["records"])
    cpu = w["cpu_s"]
    out = {
        "cpu_stream_ms": cpu.get("server", 0.0) / n * 1000 if n and "server" in cpu else None,
        "worker_stream_ms": cpu.get("worker", 0.0) / n * 1000 if n and "worker" in cpu else None,
        "other": _other_cores(w),
        "ok": sum(r["ok"] for r in w["records"]),
        "n": n,
    }
    for q in (50, 99):
        own, base = _ttfd(w, q), _ttfd(direct, q) if direct else None
        out[f"added_p{q}"] = None if own is None or base is None else own - base
    return out


def pairs(results: dict, a: str, b: str) -> dict:
    waves = [w for w in results["waves"] if not w["probe"] and w["n"] > 1 and not w.get("short")]
    by = {}
    for w in waves:
        by.setdefault((w["n"], w["wave"], w["path"]), w)
    out: dict = {}
    for (n, r, path), w in sorted(by.items()):
        if path != a or (n, r, b) not in by:
            continue
        direct = by.get((n, r, "direct"))
        out.setdefault(n, []).append((per_wave(w, direct), per_wave(by[(n, r, b)], direct)))
    return out


BOOTSTRAP = 2000  # resamples for the 95% intervals (seeded: the same results give the same interval)


def ci(values: list[float], statistic=lambda v: pct(v, 50)) -> tuple[float, float]:
    """A 95% bootstrap interval of ``statistic`` (the median) over ``values``."""
    rng = random.Random(34)
    stats = sorted(statistic(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP))
    return stats[int(0.025 * BOOTSTRAP)], stats[int(0.975 * BOOTSTRAP) - 1]


def _ratios(rows, key):
    vals = [y[key] / x[key] for x, y in rows if x[key] and y[key] is not None and x[key] > 0]
    return (pct(vals, 50), min(vals), max(vals), len(vals), *ci(vals)) if vals else None


def single(results: dict, a: str, b: str) -> dict | None:
    """1 stream: added TTFD p50 of each path (trials and probes pooled) against direct's."""

    def sel(p):
        return [
            r["ttfd_ms"]
            for w in results["waves"]
            if w["n"] == 1 and w["path"] == p and w["phase"] in ("c1", "c1probe")
            for r in w["records"]
            if r["ttfd_ms"] is not None
        ]

    d, x, y = sel("direct"), sel(a), sel(b)
    if not (d and x and y):
        return None
    out = {q: (pct(x, q) - pct(d, q), pct(y, q) - pct(d, q)) for q in (50, 99)}
    rng = random.Random(34)
    diffs = sorted(pct(rng.choices(y, k=len(y)), 50) - pct(rng.choices(x, k=len(x)), 50) for _ in range(BOOTSTRAP))
    out["ci"] = (diffs[int(0.025 * BOOTSTRAP)], diffs[int(0.975 * BOOTSTRAP) - 1])
    return out


def followers(results: dict, a: str, b: str) -> dict:
    """Readers on another instance (paths served like resume): each path's reader lag p50/p99 per
    level, every full wave's followed streams pooled (10-delta waves apart)."""
    out: dict = {}
    for short in (False, True):
        for n in sorted({w["n"] for w in results["waves"] if not w["probe"]}):
            row = {}
            for p in (a, b):
                recs = [
                    r
                    for w in results["waves"]
                    if w["path"] == p and w["n"] == n and not w["probe"] and bool(w.get("short")) == short
                    for r in w["records"]
                ]
                f = _follower(recs)
                if f and f["lag_n"]:
                    row[p] = f
            if len(row) == 2:
                out[(n, short)] = row
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--md", action="store_true", help="a Markdown table")
    args = p.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    rows = pairs(results, args.a, args.b)
    print(
        f"B = {args.b} against A = {args.a}: ratio B/A per pair of waves of the same round "
        f"(median, its 95% interval, [lowest–highest] over the pairs)"
    )
    if args.md:
        print()
        print(
            "| streams | pairs | CPU per stream (host + worker) | worker CPU per stream | added TTFD p50 | "
            "added TTFD p99 | A: CPU / p50 / p99 (medians) | other load (cores, median) |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for n, rs in sorted(rows.items()):
        cells = []
        for key in ("cpu_stream_ms", "worker_stream_ms", "added_p50", "added_p99"):
            r = _ratios(rs, key)
            cells.append("–" if r is None else f"{r[0]:.2f}× ({r[4]:.2f}–{r[5]:.2f}) [{r[1]:.2f}–{r[2]:.2f}]")
        med = lambda key, rs=rs: pct([x[key] for x, _ in rs if x[key] is not None], 50)  # noqa: E731 - a one-line helper
        other = pct([v for x, y in rs for v in (x["other"], y["other"]) if v is not None], 50)
        a_cells = f"{med('cpu_stream_ms') or 0:.2f} ms / {med('added_p50') or 0:.0f} / {med('added_p99') or 0:.0f} ms"
        other_cell = "–" if other is None else f"{other:.2f}"
        if args.md:
            print(f"| {n:,} | {len(rs)} | " + " | ".join(cells) + f" | {a_cells} | {other_cell} |")
        else:
            print(
                f"{n:>6} streams, {len(rs)} pairs: CPU/stream {cells[0]}, worker {cells[1]}, added p50 {cells[2]}, "
                f"p99 {cells[3]}; A: {a_cells}; other load {other_cell}"
            )
    for (n, short), row in followers(results, args.a, args.b).items():
        fa, fb = row[args.a], row[args.b]
        print(
            f"{n:>6} streams{' (10-delta)' if short else ''}: reader elsewhere, lag p50 / p99 "
            f"{args.a} {fa['lag'][50]:.0f} / {fa['lag'][99]:.0f} ms, {args.b} {fb['lag'][50]:.0f} / "
            f"{fb['lag'][99]:.0f} ms ({fa['lag_n']} / {fb['lag_n']} deltas; errors {fa['errors'] or 'none'} / "
            f"{fb['errors'] or 'none'})"
        )
    s = single(results, args.a, args.b)
    if s:
        print(
            f"1 stream (pooled): added TTFD p50 {args.a} {s[50][0]:+.2f} ms, {args.b} {s[50][1]:+.2f} ms; "
            f"p99 {s[99][0]:+.2f} / {s[99][1]:+.2f} ms; B − A p50 {s[50][1] - s[50][0]:+.2f} ms "
            f"(95% interval {s['ci'][0]:+.2f} to {s['ci'][1]:+.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
