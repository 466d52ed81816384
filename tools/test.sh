#!/usr/bin/env bash
# Configure, build every target (library, tests, benchmark, Python module) and run the test suite, then say how
# many tests ran, passed and were skipped (and why: GPU tests skip where no GPU is visible).
# Extra arguments go to the CMake configure step. Uses build/ (BUILD_DIR overrides); tools/bench.sh never does.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build" -j "$jobs"
rm -f "$build/ctest.xml" "$build/pytest.xml"
rc=0
ctest --test-dir "$build" --output-on-failure -j "$jobs" --output-junit "$PWD/$build/ctest.xml" || rc=$?
ctest --test-dir "$build" -N -L gpu | sed -n 's/^ *Test *#[0-9]*: //p' >"$build/gpu_tests.txt" || true
python3 tools/test_summary.py "$build/ctest.xml" "$build/pytest.xml" "$build/gpu_tests.txt" || true
exit $rc
