#!/usr/bin/env bash
# py-spy against the app's serving process (devhost) during 100-stream waves; writes a flamegraph SVG
# and a top-functions text to tools/bench/out/ (see tools/bench/profile.py). Needs root (ptrace), like py-spy.
#   tools/bench/profile.sh [--target app|litellm] [--streams 100] [--seconds 20] [--rate 100]
set -euo pipefail
cd "$(dirname "$0")/../.."
BENCH_SCRIPT=tools/bench/profile.py exec tools/bench/run.sh "$@"
