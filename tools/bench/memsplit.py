"""What a keyed instance holds in memory that an unkeyed one does not, piece by piece. A script, not a
test:

    .venv/bin/python tools/bench/memsplit.py

Each setup runs in a fresh process: the app imported unkeyed, then what a keyed instance adds, one
step at a time in the order it loads it, each step's resident memory (RSS, of it anonymous and file
pages, from /proc/self/smaps_rollup) printed as the difference from the step before, in MB:

* key: the store on a connection string with an account key (Azurite's, as the bench and tests);
* identity: on a storage account through an identity (what infra/ deploys), App Insights off;
* identity + App Insights: the same with the Azure Monitor exporter loaded first (as deployed): it
  loads azure-identity, msal, requests and cryptography for every instance, keyed or not.

The store's REST client is made (nothing is sent: nothing listens), the tokenizer built and one
prompt counted. ``coldstart.py --served`` measures the whole served worker.

Measured 2026-12-05 (issue #44's target: keyed instance memory <= +50 MB over unkeyed, or say why),
keyed over unkeyed: +34.8 MB in all three setups (+50.9 with an account key before 20625f2):

* o200k_base's tables, 33.6 MB (anonymous; 34.2 before the build's freed C heap was given back,
  tokens.py): every keyed request counts its prompt to reserve tokens, so a keyed instance needs
  them from its first request; building them lazily would only move the 34 MB (and the 45 ms)
  onto that request. Only a count without the real tokenizer (an estimate) would remove them, and
  budgets would no longer be exact: not done.
* the tokenizer's extension module, 1.2 MB (mostly file pages).
* the store's SDKs are no longer in it: since 20625f2 they load when the AzureStore is made, at
  start-up, keyed or not, so an unkeyed app with AzureWebJobsStorage (always set in Azure) holds
  them too (the "store" step is +0.1). With a key, 15.5 MB: azure-data-tables and
  azure-storage-blob, used only to read the connection string and sign account SASs; the blob
  package's import alone is ~15.7 MB, of it requests (~5 MB, its RequestsTransport) and
  cryptography (~6.6 MB, its client-side encryption), neither used but imported by the package's
  own ``__init__``, which any import from it runs: no import of ours avoids them. With an
  identity, 14.8 MB (azure-identity, which signs every request). The key's part could go by
  reading the connection string and signing the SAS in the app (both documented formats): a
  second implementation of what the SDKs do, for 15 MB; not done."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools.bench.coldstart import AZURITE, KEEP, UPSTREAM, fresh  # noqa: E402 - after sys.path names the repository

MONITOR = "from azure.monitor.opentelemetry import configure_azure_monitor"
STORE = (
    "from chatstream.state.store_account import Account; from chatstream.state.store_azure import AzureStore; "
    "AzureStore(Account.from_env(os.environ))"
)
IDENTITY = {
    "AzureWebJobsStorage__tableServiceUri": "https://example.table.core.windows.net/",
    "AzureWebJobsStorage__blobServiceUri": "https://example.blob.core.windows.net/",
    "AzureWebJobsStorage__credential": "managedidentity",
}
# name: (settings, steps as (label, code))
SETUPS: dict[str, tuple[dict[str, str], list[tuple[str, str]]]] = {
    "key": ({"AzureWebJobsStorage": AZURITE}, []),
    "identity": (IDENTITY, []),
    "identity + App Insights": (IDENTITY, [("Azure Monitor exporter (unkeyed too)", MONITOR)]),
}
STEPS = [
    ("the store (its SDKs, REST client)", STORE),
    ("tokenizer extension", "from chatstream import tokens; tokens._bindings()"),
    ("o200k_base built, one count", "tokens.count_text('gpt-4o', 'How long is a piece of string?')"),
]

PROBE = r"""
import json, os, sys, time
def roll():
    with open("/proc/self/smaps_rollup") as f:
        d = {k: int(v.split()[0]) for k, _, v in (l.partition(":") for l in f) if v.strip().endswith("kB")}
    return d["Rss"], d["Anonymous"]
out = []
for label, code in json.loads(sys.argv[1]):
    exec(code)
    if "tokens" in globals():
        time.sleep(0.3)  # the page drop after a build (tokens.py) is done
    out.append((label, *roll()))
print(json.dumps(out))
"""


def main() -> None:
    for name, (settings, extra) in SETUPS.items():
        env = {k: v for k, v in os.environ.items() if k in KEEP}
        env.update(UPSTREAM)
        env.update(settings)
        steps = [("the app, unkeyed (the whole process)", "import function_app"), *extra, *STEPS]
        rows = fresh(sys.executable, PROBE, [json.dumps(steps)], env, ROOT, name)
        print(f"\n{name}\n\n| step | RSS MB | anonymous | file pages |\n|---|---|---|---|")
        previous = (0, 0)
        for label, rss, anon in rows:
            d_rss, d_anon = (rss - previous[0]) / 1024, (anon - previous[1]) / 1024
            print(f"| {label} | {d_rss:+.1f} | {d_anon:+.1f} | {d_rss - d_anon:+.1f} |")
            previous = (rss, anon)
        keyed = (rows[-1][1] - rows[len(extra)][1]) / 1024
        print(f"| keyed over unkeyed | {keyed:+.1f} | | |")


if __name__ == "__main__":
    main()
