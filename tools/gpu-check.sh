#!/usr/bin/env bash
# The GPU-machine pass: build with all cores, C++ tests, pytest (in-tree and pip-installed), compute-sanitizer
# memcheck + racecheck over a reduced subset, the benchmark and the PyTorch comparison. Full logs go to OUTDIR;
# a short summary is printed last.
#   tools/gpu-check.sh OUTDIR [STEP...]    steps: build test pytest pip sanitize bench compare (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu-check.sh OUTDIR [STEP...]}
shift
steps=${*:-build test pytest pip sanitize bench compare}
mkdir -p "$out"
build=${BUILD_DIR:-build}
jobs=$(nproc)
summary=()

run_step() {  # name, command...
  local name=$1 start rc
  shift
  start=$(date +%s)
  echo "== $name: $*" >&2
  "$@" >"$out/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-10s %-8s %4ss  %s' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAIL:$rc")" "$(( $(date +%s) - start ))" "$out/$name.log")")
  return $rc
}
has() { [[ " $steps " == *" $1 "* ]]; }

# Sanitizer subset: every kernel and code path, small shapes.
subset='FusedGateGpu.StridedRows:FusedGateGpu.ExactTiesGoToTheLowerIndex:FusedGateGpu.NaNAndInfinity:FusedGateGpu.CudaGraphCaptureAndReplay:PermuteGpu.ShapeGrid:PermuteGpu.CudaGraphCapture:PermuteGpu.UnpermuteInCudaGraph:*HostPointer*:GroupedGemmGpu.RaggedGroups:GroupedGemmGpu.EdgeShapes:GroupedGemmGpu.ExpectedMHintsChooseTilesNotResults:GroupedGemmGpu.StridedOperands:GroupedGemmGpu.OutOfRangeAndNonMonotoneGroupRows:GroupedGemmGpu.CudaGraphCapture:DecodeGpu.Grid:DecodeGpu.SplitCounts:DecodeGpu.SoftcapWindowAndScale:DecodeGpu.CudaGraphReplaysWithNewLengths:AppendKvGpu.*'

if has build; then
  run_step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}
  run_step build cmake --build "$build" -j "$jobs"
fi
has test && run_step ctest ctest --test-dir "$build" --output-on-failure -j 4
has pytest && run_step pytest env PYTHONPATH="$build/python" python3 -m pytest -q tests/python -p no:cacheprovider
if has pip; then
  run_step pip_install python3 -m pip install --no-build-isolation --no-deps --target /tmp/tessera_pip . &&
    run_step pip_import env PYTHONPATH=/tmp/tessera_pip python3 -m pytest -q tests/python -p no:cacheprovider -k "import or version"
fi
if has sanitize; then
  run_step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/tessera_gpu_tests" --gtest_filter="$subset"
  run_step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/tessera_gpu_tests" --gtest_filter="$subset"
  run_step synccheck compute-sanitizer --tool synccheck --error-exitcode 1 "$build/tests/tessera_gpu_tests" --gtest_filter="$subset"
  for tool in memcheck racecheck synccheck; do
    run_step "ptx_$tool" compute-sanitizer --tool $tool --error-exitcode 1 "$build/tests/tessera_ptx_tests"
  done
fi
has bench && run_step bench "$build/bench/tessera-bench" --check --json "$out/bench.json" ${BENCH_ARGS:-}
has compare && run_step compare env PYTHONPATH="$build/python" PYTHONUNBUFFERED=1 python3 bench/compare.py --json "$out/compare.json" ${COMPARE_ARGS:-}

for f in bench compare; do
  [ -f "$out/$f.log" ] && { echo; echo "---- $f (tail)"; tail -n 45 "$out/$f.log"; }
done
for f in ctest pytest memcheck racecheck synccheck; do
  [ -f "$out/$f.log" ] && { echo; echo "---- $f (tail)"; tail -n 6 "$out/$f.log"; }
done
echo
echo "==== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
printf '%s\n' "${summary[@]}"
