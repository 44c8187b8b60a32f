#!/usr/bin/env bash
# `make bench`: the side-by-side streaming benchmark (tools/bench/README.md). Arguments go to tools/bench/run.py
# (e.g. --quick for a smoke run). Needs .venv (make venv) and tools/bench/.venv (make bench creates both).
#
# As root it runs everything inside a fresh network namespace: only a private loopback exists there,
# so neither LiteLLM nor anything else can reach beyond 127.0.0.1, whatever its settings say.
# BENCH_NETNS=0 turns that off (then only the settings in tools/bench/litellm.yaml and run.py keep LiteLLM local).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=tools/bench/.venv/bin/python
SCRIPT="${BENCH_SCRIPT:-tools/bench/run.py}"   # tools/bench/profile.sh sets tools/bench/profile.py
if [ ! -x "$PY" ]; then echo "tools/bench/.venv is missing: run \`make bench\` (it creates it)" >&2; exit 2; fi
if [ ! -x .venv/bin/python ]; then echo ".venv is missing: run \`make venv\` first" >&2; exit 2; fi
if [ "${BENCH_NETNS:-1}" = 1 ] && [ "$(id -u)" = 0 ] && command -v unshare >/dev/null 2>&1 \
    && unshare -n true 2>/dev/null; then
  exec env BENCH_NETNS=1 unshare -n -- "$PY" "$SCRIPT" "$@"
fi
echo "bench: running without a private network namespace (needs root and unshare)" >&2
exec env BENCH_NETNS=0 "$PY" "$SCRIPT" "$@"
