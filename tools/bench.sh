#!/usr/bin/env bash
# Build tessera-bench and run the benchmark suite on the GPU, every case checked against the reference before it
# is timed. Arguments go to tessera-bench (e.g. --op fused_gate --json out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_PYTHON=OFF
cmake --build "$build" -j "$jobs" --target tessera-bench
"$build/bench/tessera-bench" --check "$@"
