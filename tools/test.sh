#!/usr/bin/env bash
# Configure, build every target (library, tests, benchmark, Python module) and run the test suite.
# GPU tests skip where no GPU is visible. Extra arguments go to the CMake configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"
