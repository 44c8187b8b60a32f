#!/usr/bin/env bash
# py-spy against the app's serving process (devhost) during 100-stream waves; writes a flamegraph SVG
# and a top-functions text to bench/out/ (see bench/profile.py). Needs root (ptrace), like py-spy.
#   bench/profile.sh [--target app|litellm] [--streams 100] [--seconds 20] [--rate 100]
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH_SCRIPT=bench/profile.py exec bench/run.sh "$@"
