"""How many concurrent streams one Flex Consumption instance holds, what that costs, and the same
load on LiteLLM containers: recomputed from the benchmark figures of record.

    python tools/bench/scaling.py [docs/benchmarks.md | tools/bench/out/summary.json] [--write [docs/scaling.md]]

The input is, by default, the generated section of docs/benchmarks.md (what `make bench` last
wrote, committed with the code), so docs/scaling.md can be recomputed on any checkout and
tests/test_infra.py can check that it was. A summary.json from a run (tools/bench/out/, not
committed) works too; its unrounded figures may move the last digit of a table cell.

Only the section of docs/scaling.md between the scaling markers is rewritten (with --write); the
reasoning around it is prose. Every input is measured by `make bench` except the ones named in
ASSUMED and PRICES below, which come from the cited pages or are stated assumptions.

The model (docs/scaling.md explains it):
  * Flex Consumption runs one Python worker process per instance: FUNCTIONS_WORKER_PROCESS_COUNT is
    not valid on that plan (Functions app settings reference, "Flex Consumption plan deprecations").
    One worker runs one event loop, so it uses at most one core, whatever the instance size.
  * CPU: a stream costs R ms (per request) + T × D ms (per delta, T deltas) of CPU in the worker, and
    the host's share on top. N streams of S seconds keep N × (R + T·D) / S ms of CPU busy per second.
    An instance holds N while the worker's share stays under UTILIZATION × 1 core and the worker's
    plus the host's stays under UTILIZATION × its vCPU.
  * Memory: the idle processes plus N × memory per stream stay under the instance's memory.
  * Burst: streams arriving together queue their per-request CPU on the one worker: B streams add
    about B × R ms to the last one's time to first delta.
  * Cost: Flex Consumption bills on-demand instances per GB-second of instance memory while they
    execute, plus executions; an instance full of streams is billed as one. The default instance
    size is the one with the lowest cost per typical stream.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from report import LABEL  # noqa: E402  (the row labels docs/benchmarks.md is written with)

START = "<!-- scaling:table:start -->"
END = "<!-- scaling:table:end -->"
BENCH_START = "<!-- bench:side-by-side:start -->"
BENCH_END = "<!-- bench:side-by-side:end -->"

# Flex Consumption instance sizes: memory (MB) → vCPU. Source: Microsoft Learn, "Azure Functions Flex
# Consumption plan hosting", instance memory table (MicrosoftDocs/azure-docs, articles/azure-functions/
# flex-consumption-plan.md, commit 809ed6c "Clarifying Flex Consumption quotas"). 512 MB (0.25 vCPU)
# is left out: the real Functions host's own memory was not measured, and there it would matter.
INSTANCES = {2048: 1.0, 4096: 2.0}
WORKERS_PER_INSTANCE = 1  # Flex Consumption: FUNCTIONS_WORKER_PROCESS_COUNT is "not valid" there
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


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def load(path: Path) -> dict:
    """A summary (the subset this script reads) from a summary.json or from docs/benchmarks.md."""
    text = path.read_text(encoding="utf-8")
    return json.loads(text) if path.suffix == ".json" else summary_from_benchmarks(text)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _pair(cell: str) -> dict | None:
    m = re.fullmatch(r"\(?([\d.]+) / ([\d.]+)\)?", cell)
    return {"per_request_ms": float(m.group(1)), "per_delta_ms": float(m.group(2))} if m else None


def summary_from_benchmarks(text: str) -> dict:
    """The figures scaling needs, read back from the section `make bench` writes in
    docs/benchmarks.md (tools/bench/report.py, ``scaling_inputs``): run date and commit, the CPU split
    per request and per delta, and the peak memory of each path at each concurrency."""
    if BENCH_START not in text or BENCH_END not in text:
        raise SystemExit("docs/benchmarks.md has no generated side-by-side section (run `make bench`)")
    section = text[text.index(BENCH_START) : text.index(BENCH_END)]
    path_of = {label: path for path, label in LABEL.items()}
    meta = re.search(
        r"^(\d{4}-\d\d-\d\d \d\d:\d\d UTC) · .*?app commit `([0-9a-f]+)(?:\+local-changes)?`", section, re.M
    )
    if not meta:
        raise SystemExit("docs/benchmarks.md: no run date and app commit in the side-by-side section")
    summary: dict = {"meta": {"date": meta.group(1), "commit": meta.group(2)}, "rows": {}, "cpu_split": {}}
    heading = re.search(r"^### CPU per request and per delta \((\d+) concurrent streams\)$", section, re.M)
    table, levels = None, []
    for line in section.splitlines():
        if line.startswith("### "):
            table = (
                "split"
                if heading and line == heading.group(0)
                else "memory"
                if line.startswith("### Peak memory")
                else None
            )
            continue
        if not line.startswith("| ") or line.startswith("|---"):
            continue
        cells = _cells(line)
        if table == "memory" and cells[0] == "path":  # | path | 1 streams | 10 streams | ... |
            levels = [int(c.split()[0].replace(",", "")) for c in cells[1:]]
        elif table == "memory" and cells[0] in path_of:
            for level, cell in zip(levels, cells[1:]):
                rss = re.fullmatch(r"(\d+) MB", cell)
                if rss:
                    summary["rows"].setdefault(level, {})[path_of[cells[0]]] = {"peak_rss_mb": float(rss.group(1))}
        elif table == "split" and cells[0] in path_of:
            groups = {g: _pair(c) for g, c in zip(("host", "worker", "server"), cells[1:4])}
            entry = {"level": int(heading.group(1)), **{g: v for g, v in groups.items() if v}}
            summary["cpu_split"][path_of[cells[0]]] = entry
    return summary


def figures(summary: dict) -> dict:
    """The measured inputs: CPU per request / per delta (ms) of the one-worker app (as Flex runs it)
    and of the floor, the app's memory, LiteLLM's CPU."""
    split = summary.get("cpu_split") or {}
    rows = {int(k): v for k, v in summary["rows"].items()}
    out: dict = {"split_level": None}
    app = split.get("app") or {}
    if "worker" in app:
        out["split_level"] = app["level"]
        out["worker"] = app["worker"]
        out["host"] = app.get("host")
    ll = split.get("litellm") or {}
    if "server" in ll:
        out["litellm"] = ll["server"]
    floor = split.get("floor") or {}
    if "worker" in floor and "host" in floor:  # the bare relay of the same run (docs/benchmarks.md, "The floor")
        out["floor_worker"], out["floor_host"] = floor["worker"], floor["host"]
    levels = sorted(rows)
    pts = [(lv, rows[lv]["app"]["peak_rss_mb"]) for lv in levels if "app" in rows[lv]]
    if len(pts) >= 2:
        (l0, m0), (l1, m1) = pts[0], pts[-1]
        out["app_rss_idle_mb"] = m0
        out["app_mb_per_stream"] = max(0.0, (m1 - m0) / (l1 - l0))
        out["app_big_level"] = l1
    return out


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def per_stream_cpu_ms(cpu: dict, deltas: int) -> float:
    return cpu["per_request_ms"] + deltas * cpu["per_delta_ms"]


def capacity(cpu_ms_per_s: float, vcpu: float, utilization: float) -> int:
    """Streams whose CPU fits in the given share of ``vcpu`` cores."""
    return int(utilization * vcpu * 1000 / cpu_ms_per_s)


def instance_capacity(
    worker: dict, with_host: dict, deltas: int, seconds: float, vcpu: float, workers: int, a=ASSUMED
) -> dict:
    """Streams one instance holds by CPU: each worker is one event loop (at most one core), and the
    workers and the host together share the instance's vCPU."""
    by_worker = workers * capacity(per_stream_cpu_ms(worker, deltas) / seconds, min(1.0, vcpu), a["utilization"])
    by_instance = capacity(per_stream_cpu_ms(with_host, deltas) / seconds, vcpu, a["utilization"])
    return {"worker": by_worker, "instance": by_instance, "cpu": min(by_worker, by_instance)}


def cost_per_million(mem_mb: int, per_instance: int, seconds: float, prices=PRICES) -> float:
    """$ per million streams of ``seconds`` each, instances kept full, on demand."""
    return 1e6 * seconds * (mem_mb / 1024) / per_instance * prices["flex_gb_s"] + prices["flex_per_million_executions"]


def table(summary: dict, a=ASSUMED, prices=PRICES) -> tuple[str, dict]:
    f = figures(summary)
    if "worker" not in f:
        raise SystemExit(
            "the benchmark figures have no CPU split for the app (run `make bench`, which "
            "includes the short-stream waves)"
        )
    worker, host = f["worker"], f.get("host")
    with_host = {k: worker[k] + (host[k] if host else 0.0) for k in ("per_request_ms", "per_delta_ms")}
    mb_stream = f.get("app_mb_per_stream", 0.0)
    idle_mb = f.get("app_rss_idle_mb", 150.0)
    meta = summary["meta"]
    L = []
    L.append(
        f"Inputs, measured by `make bench` at {f['split_level']} concurrent streams "
        f"({meta['date']}, app commit `{meta['commit']}`; read from docs/benchmarks.md), one worker "
        f"process: worker {worker['per_request_ms']:.2f} ms CPU per request + {worker['per_delta_ms']:.3f} ms "
        f"per delta; the local host (Python, standing in for the Functions host) "
        + (f"{host['per_request_ms']:.2f} ms + {host['per_delta_ms']:.3f} ms" if host else "not measured")
        + f"; memory {mb_stream * 1024:.0f} kB per open stream (host and worker, from the peak RSS at "
        f"{f.get('app_big_level', 0):,} streams), {idle_mb:.0f} MB for the idle processes. "
        f"Assumed: CPU kept under {a['utilization']:.0%} busy, memory under {a['memory_headroom']:.0%} of the "
        f"instance. Flex Consumption runs {WORKERS_PER_INSTANCE} Python worker per instance."
    )
    L.append("")
    L.append(
        "| instance | stream | CPU per stream (worker / + host) | by the worker's one core | "
        "by the instance's vCPU (worker + host) | by memory | streams per instance | "
        "$ per million streams | burst within +100 ms TTFD |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    held: dict = {}
    for mem, vcpu in INSTANCES.items():
        for name, (deltas, seconds) in STREAMS.items():
            cap = instance_capacity(worker, with_host, deltas, seconds, vcpu, WORKERS_PER_INSTANCE, a)
            n_mem = int((a["memory_headroom"] * mem - idle_mb) / mb_stream) if mb_stream else 10**6
            holds = max(1, min(cap["cpu"], n_mem))
            per_million = cost_per_million(mem, holds, seconds, prices)
            burst = int(a["ttfd_budget_ms"] / worker["per_request_ms"])
            held[(mem, name)] = {"streams": holds, "per_million": per_million}
            L.append(
                f"| {mem:,} MB, {vcpu:g} vCPU, {WORKERS_PER_INSTANCE} worker | {name}: {deltas} deltas in "
                f"{seconds:g} s | {per_stream_cpu_ms(worker, deltas):.0f} / "
                f"{per_stream_cpu_ms(with_host, deltas):.0f} ms | {cap['worker']:,} | {cap['instance']:,} | "
                f"{n_mem:,} | **{holds:,}** | ${per_million:,.2f} | {burst} |"
            )
    L.append("")

    # The defaults: the instance size whose typical stream costs least (the smaller one on a tie),
    # holding as many streams as CPU and memory allow with the host counted.
    default_mem = min(INSTANCES, key=lambda m: (round(held[(m, "typical")]["per_million"], 6), m))
    per_instance = held[(default_mem, "typical")]["streams"]
    others = [m for m in INSTANCES if m != default_mem]
    defaults = {"instanceMemoryMB": default_mem, "httpPerInstanceConcurrency": per_instance}
    cheaper = "; ".join(
        f"{m:,} MB instances hold {held[(m, 'typical')]['streams']} typical streams at "
        f"{held[(m, 'typical')]['per_million'] / held[(default_mem, 'typical')]['per_million'] - 1:+.0%} per stream"
        for m in others
    )
    L.append(
        f"Defaults that follow (set in `infra/main.bicep`): `instanceMemoryMB` {default_mem}, the size whose "
        f"typical stream costs least, and `httpPerInstanceConcurrency` {per_instance} (typical streams, host "
        f"counted). For traffic of mostly short streams use {held[(default_mem, 'short')]['streams']}; "
        f"{cheaper}."
    )
    if "floor_worker" in f:
        fw, fh = f["floor_worker"], f["floor_host"]
        deltas, seconds = STREAMS["typical"]
        f_with_host = {k: fw[k] + fh[k] for k in with_host}
        fcap = instance_capacity(fw, f_with_host, deltas, seconds, INSTANCES[default_mem], WORKERS_PER_INSTANCE, a)
        L.append("")
        L.append(
            f'The floor, a bare relay on the same host and runtime in the same run (docs/benchmarks.md, "The '
            f'floor"): worker {fw["per_request_ms"]:.2f} ms + {fw["per_delta_ms"]:.3f} ms per delta, host '
            f"{fh['per_request_ms']:.2f} ms + {fh['per_delta_ms']:.3f} ms. A typical stream would cost its worker "
            f"{per_stream_cpu_ms(fw, deltas):.0f} ms ({per_stream_cpu_ms(f_with_host, deltas):.0f} ms with the "
            f"host) against this app's {per_stream_cpu_ms(worker, deltas):.0f} "
            f"({per_stream_cpu_ms(with_host, deltas):.0f}) ms, and a {default_mem:,} MB instance would hold "
            f"{fcap['cpu']} typical streams instead of {per_instance}: what no function on this runtime gets past."
        )
    L.append("")

    # Instances and cost, typical streams.
    deltas, seconds = STREAMS["typical"]
    gb = default_mem / 1024
    L.append(
        f"Instances and cost for typical streams ({deltas} deltas in {seconds:g} s) at "
        f"`httpPerInstanceConcurrency` {per_instance} on {default_mem:,} MB instances, on demand; next to "
        f"LiteLLM containers ({a['litellm_container_vcpu']:g} vCPU, {a['litellm_container_gib']:g} GiB, one "
        f"process each) sized the same way from LiteLLM's measured CPU. Prices: "
        f"${prices['flex_gb_s']:.6f} per GB-s and ${prices['flex_per_million_executions']:.2f} per million "
        f"executions (Flex Consumption); ${prices['aca_vcpu_s']:.6f} per vCPU-s, ${prices['aca_gib_s']:.6f} "
        f"per GiB-s and ${prices['aca_per_million_requests']:.2f} per million requests (Container Apps); "
        f"sources below."
    )
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
            ll_cost = (
                cont
                * 3600
                * (
                    a["litellm_container_vcpu"] * prices["aca_vcpu_s"]
                    + a["litellm_container_gib"] * prices["aca_gib_s"]
                )
                + execs_per_hour * prices["aca_per_million_requests"] / 1e6
            )
            ll_cells = f"{cont:,} | ${ll_cost:,.2f}"
        else:
            ll_cells = "– | –"
        L.append(f"| {n:,} concurrent streams | {inst:,} | ${app_cost:,.2f} | {ll_cells} |")
    per_million = cost_per_million(default_mem, per_instance, seconds, prices)
    if ll_per:
        ll_million = (
            1e6
            * seconds
            / ll_per
            * (a["litellm_container_vcpu"] * prices["aca_vcpu_s"] + a["litellm_container_gib"] * prices["aca_gib_s"])
            + prices["aca_per_million_requests"]
        )
        ll_m = f"{ll_per:,} streams per container | ${ll_million:,.2f}"
    else:
        ll_m = "– | –"
    L.append(
        f"| per million streams (instances kept full) | {per_instance} streams per instance | "
        f"${per_million:,.2f} | {ll_m} |"
    )
    L.append("")
    L.append(f"<!-- scaling:defaults {json.dumps(defaults, sort_keys=True)} -->")
    return "\n".join(L), defaults


# ---------------------------------------------------------------------------------------------
# docs/scaling.md
# ---------------------------------------------------------------------------------------------


def write(doc: Path, section: str) -> None:
    text = doc.read_text(encoding="utf-8") if doc.exists() else f"# Scaling\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{START}\n{END}\n"
    text = text[: text.index(START)] + f"{START}\n{section}\n{END}" + text[text.index(END) + len(END) :]
    doc.write_text(text, encoding="utf-8")


def section_in(text: str) -> str:
    """The generated section of docs/scaling.md, between the markers."""
    return text[text.index(START) + len(START) : text.index(END)].strip("\n")


def defaults_in(doc: Path) -> dict:
    """The defaults block of docs/scaling.md (what tests/test_infra.py compares infra/ with)."""
    return defaults_from_text(doc.read_text(encoding="utf-8"))


def defaults_from_text(text: str) -> dict:
    marker = "<!-- scaling:defaults "
    i = text.index(marker) + len(marker)
    return json.loads(text[i : text.index(" -->", i)])


def write_infra(bicep: Path, defaults: dict) -> None:
    """Set the defaults of infra/main.bicep's parameters of the same names (what tests/test_infra.py
    checks against docs/scaling.md), and their azd defaults in main.parameters.json beside it."""
    text = bicep.read_text(encoding="utf-8")
    for name, value in defaults.items():
        text, n = re.subn(rf"^(param {name} int = )\d+$", rf"\g<1>{value}", text, flags=re.M)
        if n != 1:
            raise SystemExit(f"{bicep}: no single `param {name} int = ...` line to set")
    bicep.write_text(text, encoding="utf-8")
    parameters = bicep.with_name("main.parameters.json")
    if parameters.exists():
        text = parameters.read_text(encoding="utf-8")
        for name, value in defaults.items():
            # "name": {"value": "${AZD_NAME=60}"}: the default after "=" (main.bicep's, test_infra checks)
            text, n = re.subn(
                rf'("{name}": \{{\s*"value": "\$\{{\w+=)\d+(\}}")', rf"\g<1>{value}\g<2>", text, flags=re.M
            )
            if n > 1:
                raise SystemExit(f"{parameters}: {name} mapped more than once")
        parameters.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "source",
        nargs="?",
        default=str(ROOT / "docs" / "benchmarks.md"),
        help="docs/benchmarks.md (default: the figures of record) or a run's summary.json",
    )
    p.add_argument(
        "--write",
        nargs="?",
        const=str(ROOT / "docs" / "scaling.md"),
        default=None,
        help="rewrite the generated section of this file (default docs/scaling.md)",
    )
    p.add_argument(
        "--infra",
        nargs="?",
        const=str(ROOT / "infra" / "main.bicep"),
        default=None,
        help="also set the defaults in this Bicep file (default infra/main.bicep)",
    )
    args = p.parse_args(argv)
    section, defaults = table(load(Path(args.source)))
    if args.write:
        write(Path(args.write), section)
        print(f"wrote the scaling section of {args.write}", file=sys.stderr)
    if args.infra:
        write_infra(Path(args.infra), defaults)
        print(f"set {', '.join(f'{k} {v}' for k, v in sorted(defaults.items()))} in {args.infra}", file=sys.stderr)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
