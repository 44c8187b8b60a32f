"""Store calls per resumable stream in a benchmark run, from Azurite's access log (run.py writes it
to OUT/azurite-access.log): each request naming a stream of the run (its blob, its record or slot
rows, its reader's row in an inbox) is that stream's; the rest (heartbeats, inbox queries, sweeps)
is shared and divided by the streams. Streams with a reader on another instance are apart. Inserts
(``table post``: the record's, a reader's slot) name their row in the body only: they are counted
as shared (one record insert a stream, one slot insert a reader); so are the warm-up's streams.

    tools/bench/.venv/bin/python tools/bench/store_ops.py OUT [--path resume]"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.parse
from collections import Counter
from pathlib import Path

_LINE = re.compile(r'"(\w+) (\S+) HTTP/[\d.]+" (\d+)')
_ID_LENGTH = 30  # chatstream/state/streamlog/format.py


def kind(method: str, url: str) -> str:
    """A short name of the call: blob read/append/create, table get/upsert/merge/insert/delete/query."""
    path = urllib.parse.unquote(url.split("?", 1)[0])
    query = url.split("?", 1)[1] if "?" in url else ""
    if "/chatstream-streams/" in path:
        if method == "GET":
            return "blob read"
        if "comp=appendblock" in query:
            return "blob append"
        return f"blob {method.lower()}"
    if "(" not in path:
        return "table query" if method == "GET" else f"table {method.lower()}"
    return {"GET": "table get", "PUT": "table upsert", "MERGE": "table merge", "PATCH": "table merge"}.get(
        method, f"table {method.lower()}"
    )


def count(log: Path, results: dict, path: str) -> dict:
    recs = [r for w in results["waves"] if w["path"] == path for r in w["records"] if r.get("stream_id")]
    followed = {r["stream_id"] for r in recs if r.get("follower")}
    ids = {r["stream_id"] for r in recs}
    per: dict[str, Counter] = {sid: Counter() for sid in ids}
    shared, other = Counter(), Counter()
    for line in log.read_text(errors="replace").splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        method, url = m.group(1), m.group(2)
        k = kind(method, url)
        plain = urllib.parse.unquote(url.split("?", 1)[0])
        found = next((w for i in range(len(plain)) if (w := plain[i : i + _ID_LENGTH]) in ids), None)
        if found is not None:
            per[found][k] += 1
        elif "chatstream-streams" in url or "chatstreamStreams" in url:
            shared[k] += 1
        else:
            other[k] += 1

    def summary(group: set[str]) -> dict:
        if not group:
            return {"streams": 0}
        total = Counter()
        for sid in group:
            total.update(per[sid])
        return {
            "streams": len(group),
            "ops_per_stream": round(sum(total.values()) / len(group), 2),
            "by_kind": {k: round(v / len(group), 2) for k, v in total.most_common()},
        }

    return {
        "unfollowed": summary(ids - followed),
        "followed": summary(followed),
        "shared_per_stream": round(sum(shared.values()) / max(1, len(ids)), 2),
        "shared_by_kind": dict(shared.most_common()),
        "other": dict(other.most_common()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("out", help="the run's output folder (results.json, azurite-access.log)")
    p.add_argument("--path", default="resume", help="the benchmark path whose streams are counted")
    args = p.parse_args(argv)
    out = Path(args.out)
    results = json.loads((out / "results.json").read_text())
    print(json.dumps(count(out / "azurite-access.log", results, args.path), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
