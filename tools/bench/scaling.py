"""How many concurrent streams one Flex Consumption instance holds, what that costs, and the same
load on LiteLLM containers: recomputed from a benchmark run (tools/bench/out/summary.json).

    python tools/bench/scaling.py [tools/bench/out/summary.json] [--write docs/scaling.md]

Only the section of docs/scaling.md between the scaling markers is rewritten (with --write); the
reasoning around it is prose. Every input is measured by `make bench` except the ones named in
ASSUMED and PRICES below, which come from the cited pages or are stated assumptions.

The model (docs/scaling.md explains it):
  * CPU: a stream costs R ms (per request) + T × D ms (per delta, T deltas) of CPU. N streams of
    duration S seconds keep N × (R + T·D) / S ms of CPU busy per second. An instance with C vCPU
    holds N while that stays under UTILIZATION × C × 1000 ms/s.
  * Memory: the idle processes plus N × memory per stream stay under the instance's memory.
  * Burst: streams arriving together on one worker queue their per-request CPU: B streams add about
    B × R ms to the last one's time to first delta.
  * Cost: Flex Consumption bills on-demand instances per GB-second of instance memory while they
    execute, plus executions; an instance full of streams is billed as one.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
START = "<!-- scaling:table:start -->"
END = "<!-- scaling:table:end -->"

# Flex Consumption instance sizes: memory (MB) → vCPU. Source: Microsoft Learn, "Azure Functions Flex
# Consumption plan hosting", instance memory table (MicrosoftDocs/azure-docs, articles/azure-functions/
# flex-consumption-plan.md, commit 809ed6c "Clarifying Flex Consumption quotas").
INSTANCES = {2048: 1.0, 4096: 2.0}
PLATFORM_BUFFER_MB = 272  # same page: extra memory the platform adds for itself, not billed

PRICES = {
    # Flex Consumption, on demand, East US: modal.com, "Azure Functions pricing: Consumption vs. Flex
    # Consumption" (2025-05-22), quoting the Azure Functions pricing page.
    "flex_gb_s": 0.000026,
    # Per million executions: the Azure Functions pricing page (azure.microsoft.com/pricing/details/
    # functions) lists it, but renders its figures with script, so it could not be read here: an
    # assumption to check (it is a small term next to GB-s either way).
    "flex_per_million_executions": 0.40,
    # Azure Container Apps, consumption plan, active usage: the Container Apps pricing page, likewise
    # not readable here; assumptions to check. Learn "Billing in Azure Container Apps" confirms the
    # meters (vCPU-seconds, GiB-seconds, requests) and the monthly free grants.
    "aca_vcpu_s": 0.000024,
    "aca_gib_s": 0.000003,
    "aca_per_million_requests": 0.40,
}

ASSUMED = {
    "utilization": 0.7,  # CPU kept busy at most (the rest absorbs bursts, GC, the platform)
    "ttfd_budget_ms": 100.0,  # added time to first delta the burst column is sized for
    "memory_headroom": 0.8,  # share of the instance memory the processes may use
    "litellm_container_vcpu": 1.0,  # one LiteLLM process (one uvicorn worker) per container, as measured
    "litellm_container_gib": 2.0,
}

STREAMS = {  # (deltas, seconds): one delta ≈ one output token
    "typical": (500, 500 / 50),  # 500 output tokens at 50 tokens/s
    "short": (50, 50 / 50),  # 50 output tokens at 50 tokens/s
}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def figures(summary: dict) -> dict:
    """The measured inputs: CPU per request / per delta (ms) and memory of the app and of LiteLLM."""
    split = summary.get("cpu_split") or {}
    rows = {int(k): v for k, v in summary["rows"].items()}
    out = {"split_level": None}
    app = split.get("app") or {}
    if "worker" in app:
        out["split_level"] = app["level"]
        out["worker"] = app["worker"]
        out["host"] = app.get("host")
    ll = split.get("litellm") or {}
    if "server" in ll:
        out["litellm"] = ll["server"]
    levels = sorted(rows)
    for path in ("app", "app2", "litellm"):
        pts = [(lv, rows[lv][path]["peak_rss_mb"]) for lv in levels if path in rows[lv]]
        if len(pts) >= 2:
            (l0, m0), (l1, m1) = pts[0], pts[-1]
            out[f"{path}_rss_idle_mb"] = m0
            out[f"{path}_mb_per_stream"] = max(0.0, (m1 - m0) / (l1 - l0))
    big = rows.get(max(levels), {}).get("app2")
    if big:
        out["app2_peak_mb"] = big["peak_rss_mb"]
        out["big_level"] = max(levels)
    return out


def per_stream_cpu_ms(cpu: dict, deltas: int) -> float:
    return cpu["per_request_ms"] + deltas * cpu["per_delta_ms"]


def capacity(cpu_ms_per_s: float, vcpu: float, utilization: float) -> int:
    """Streams whose CPU fits in the instance's share of its vCPU."""
    return int(utilization * vcpu * 1000 / cpu_ms_per_s)


def table(summary: dict, a=ASSUMED, prices=PRICES) -> tuple[str, dict]:
    f = figures(summary)
    if "worker" not in f:
        raise SystemExit("summary.json has no CPU split for the app (run `make bench`, which includes "
                         "the short-stream waves)")
    worker, host = f["worker"], f.get("host")
    with_host = {k: worker[k] + (host[k] if host else 0.0) for k in ("per_request_ms", "per_delta_ms")}
    mb_stream = max(f.get("app2_mb_per_stream", 0.0), f.get("app_mb_per_stream", 0.0))
    idle_mb = f.get("app_rss_idle_mb", 150.0)
    L = []
    L.append(f"Inputs, measured by `make bench` at {f['split_level']} concurrent streams "
             f"({summary['meta']['date']}, app commit `{summary['meta']['commit']}`): worker "
             f"{worker['per_request_ms']:.2f} ms CPU per request + {worker['per_delta_ms']:.3f} ms per delta; the "
             f"local host (Python, standing in for the Functions host) "
             + (f"{host['per_request_ms']:.2f} ms + {host['per_delta_ms']:.3f} ms" if host else "not measured")
             + f"; memory {mb_stream * 1024:.0f} kB per open stream (host and workers, from the peak RSS at "
               f"{f.get('big_level', '?'):,} streams), {idle_mb:.0f} MB for the idle processes. "
               f"Assumed: CPU kept under {a['utilization']:.0%} busy, memory under {a['memory_headroom']:.0%} of the "
               f"instance.")
    L.append("")
    L.append("| instance | stream | CPU per stream (worker / + host) | streams per instance by CPU: worker only / "
             "worker + host | by memory | burst within +100 ms TTFD (per worker) |")
    L.append("|---|---|---|---|---|---|")
    recommended = {}
    for mem, vcpu in INSTANCES.items():
        workers = max(1, math.ceil(vcpu))
        for name, (deltas, seconds) in STREAMS.items():
            w_ms = per_stream_cpu_ms(worker, deltas)
            h_ms = per_stream_cpu_ms(with_host, deltas)
            n_w = capacity(w_ms / seconds, vcpu, a["utilization"])
            n_h = capacity(h_ms / seconds, vcpu, a["utilization"])
            n_mem = int((a["memory_headroom"] * mem - idle_mb * workers) / mb_stream) if mb_stream else 10**6
            burst = int(a["ttfd_budget_ms"] / worker["per_request_ms"])
            L.append(f"| {mem:,} MB, {vcpu:g} vCPU, {workers} worker{'s' if workers > 1 else ''} | {name}: {deltas} deltas "
                     f"in {seconds:g} s | {w_ms:.0f} / {h_ms:.0f} ms | {n_w:,} / {n_h:,} | {n_mem:,} | {burst} |")
            recommended[(mem, name)] = {"cpu": n_h, "cpu_worker_only": n_w, "memory": n_mem, "workers": workers}
    L.append("")

    # The defaults: 2,048 MB, sized for the typical stream with the host counted (the conservative
    # figure), never above what memory allows.
    default_mem = 2048
    rec = recommended[(default_mem, "typical")]
    per_instance = max(1, min(rec["cpu"], rec["memory"]))
    defaults = {"instanceMemoryMB": default_mem, "httpPerInstanceConcurrency": per_instance,
                "FUNCTIONS_WORKER_PROCESS_COUNT": rec["workers"]}
    short = recommended[(default_mem, "short")]
    L.append(f"Defaults that follow (set in `infra/main.bicep`): `instanceMemoryMB` {default_mem}, "
             f"`httpPerInstanceConcurrency` {per_instance} (typical streams, host counted), "
             f"`FUNCTIONS_WORKER_PROCESS_COUNT` {rec['workers']} (one per vCPU). For traffic of mostly short "
             f"streams use {max(1, min(short['cpu'], short['memory']))}; on 4,096 MB instances "
             f"{max(1, min(recommended[(4096, 'typical')]['cpu'], recommended[(4096, 'typical')]['memory']))} with "
             f"`FUNCTIONS_WORKER_PROCESS_COUNT` 2.")
    L.append("")

    # Instances and cost, typical streams.
    deltas, seconds = STREAMS["typical"]
    gb = default_mem / 1024
    L.append(f"Instances and cost for typical streams ({deltas} deltas in {seconds:g} s) at "
             f"`httpPerInstanceConcurrency` {per_instance} on {default_mem:,} MB instances, on demand; next to "
             f"LiteLLM containers ({a['litellm_container_vcpu']:g} vCPU, {a['litellm_container_gib']:g} GiB, one "
             f"process each) sized the same way from LiteLLM's measured CPU. Prices: "
             f"${prices['flex_gb_s']:.6f} per GB-s and ${prices['flex_per_million_executions']:.2f} per million "
             f"executions (Flex Consumption); ${prices['aca_vcpu_s']:.6f} per vCPU-s, ${prices['aca_gib_s']:.6f} "
             f"per GiB-s and ${prices['aca_per_million_requests']:.2f} per million requests (Container Apps); free "
             f"grants left out; sources and caveats below.")
    L.append("")
    L.append("| load | this app: instances | this app: $ per hour | LiteLLM: containers | LiteLLM: $ per hour |")
    L.append("|---|---|---|---|---|")
    ll = f.get("litellm")
    ll_per = None
    if ll:
        ll_cpu = per_stream_cpu_ms(ll, deltas) / seconds
        ll_per = capacity(ll_cpu, a["litellm_container_vcpu"], a["utilization"])
    for n in (1000, 10000):
        inst = math.ceil(n / per_instance)
        execs_per_hour = n * 3600 / seconds
        app_cost = inst * gb * 3600 * prices["flex_gb_s"] + execs_per_hour * prices["flex_per_million_executions"] / 1e6
        if ll_per:
            cont = math.ceil(n / max(1, ll_per))
            ll_cost = cont * 3600 * (a["litellm_container_vcpu"] * prices["aca_vcpu_s"]
                                     + a["litellm_container_gib"] * prices["aca_gib_s"]) \
                + execs_per_hour * prices["aca_per_million_requests"] / 1e6
            ll_cells = f"{cont:,} | ${ll_cost:,.2f}"
        else:
            ll_cells = "– | –"
        L.append(f"| {n:,} concurrent streams | {inst:,} | ${app_cost:,.2f} | {ll_cells} |")
    per_million = 1e6 * seconds * gb / per_instance * prices["flex_gb_s"] + prices["flex_per_million_executions"]
    if ll_per:
        ll_million = 1e6 * seconds / ll_per * (a["litellm_container_vcpu"] * prices["aca_vcpu_s"]
                                               + a["litellm_container_gib"] * prices["aca_gib_s"]) \
            + prices["aca_per_million_requests"]
        ll_m = f"{ll_per:,} streams per container | ${ll_million:,.2f}"
    else:
        ll_m = "– | –"
    L.append(f"| per million streams (instances kept full) | {per_instance} streams per instance | "
             f"${per_million:,.2f} | {ll_m} |")
    L.append("")
    defaults_json = json.dumps(defaults, sort_keys=True)
    L.append(f"<!-- scaling:defaults {defaults_json} -->")
    return "\n".join(L), defaults


def write(doc: Path, section: str) -> None:
    text = doc.read_text(encoding="utf-8") if doc.exists() else f"# Scaling\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{START}\n{END}\n"
    text = text[:text.index(START)] + f"{START}\n{section}\n{END}" + text[text.index(END) + len(END):]
    doc.write_text(text, encoding="utf-8")


def defaults_in(doc: Path) -> dict:
    """The defaults block of docs/scaling.md (what tests/test_infra.py compares infra/ with)."""
    return defaults_from_text(doc.read_text(encoding="utf-8"))


def defaults_from_text(text: str) -> dict:
    marker = "<!-- scaling:defaults "
    i = text.index(marker) + len(marker)
    return json.loads(text[i:text.index(" -->", i)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary", nargs="?", default=str(HERE / "out" / "summary.json"))
    p.add_argument("--write", nargs="?", const=str(ROOT / "docs" / "scaling.md"), default=None,
                   help="rewrite the generated section of this file (default docs/scaling.md)")
    args = p.parse_args(argv)
    section, defaults = table(load(Path(args.summary)))
    if args.write:
        write(Path(args.write), section)
        print(f"wrote the scaling section of {args.write}", file=sys.stderr)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
