#!/usr/bin/env bash
# Reruns the randomized GPU tests over many seeds: one process per test binary, --gtest_repeat=NUM_SEEDS, with
# TESSERA_SEED=BASE so that repeat i runs with seed BASE + i (tests/common/gpu_util.h, "seeds"). Every failed test
# prints "[   SEED   ] Suite.Name TESSERA_SEED=S  rerun: ..."; this script lists those, then a last line
#   stress: N seeds, F failures
# and exits 1 when F > 0 (a crash or timeout counts as a failure).
#
#   tools/stress.sh BUILD_DIR [NUM_SEEDS=200] [GTEST_FILTER]
#     BUILD_DIR     the CMake build directory (BUILD_DIR/tests/tessera_gpu_tests, tessera_ptx_tests)
#     GTEST_FILTER  default: the fast randomized tests below, plus all of tessera_ptx_tests; a filter given here
#                   applies to both binaries
#   env: STRESS_BASE_SEED (default: random), STRESS_LOG (default: BUILD_DIR/stress.log),
#        STRESS_TIMEOUT seconds per binary (default 1200)
#
# Reproduce a failure: TESSERA_SEED=S BUILD_DIR/tests/tessera_gpu_tests --gtest_filter=Suite.Name
#
# The default filter aims at 200 seeds in under 5 minutes on an H200 (estimated ~1.1 s per seed, mostly host-side
# data generation and float64 references; the last lines print the measured time per seed): the CUDA-graph replays
# of every family (where an upload not ordered with the stream shows, issue 14), append_kv, the fused-gate ties,
# near-ties and NaN/inf cases, and the small grouped-GEMM edge shapes. The large grids (DecodeGpu.Grid,
# SpeculativeTokens, GroupedGemmGpu.ShapeGrid, PermuteGpu.ShapeGrid, ...) spend seconds per run in the references and
# run once per ctest; pass a filter to stress them with fewer seeds.
set -uo pipefail

build=${1:?usage: tools/stress.sh BUILD_DIR [NUM_SEEDS] [GTEST_FILTER]}
num_seeds=${2:-200}
default_tests=(
  'AppendKvGpu.*'
  'DecodeGpu.CudaGraphReplaysWithNewLengths'
  'FusedGateGpu.CudaGraphCaptureAndReplay'
  'FusedGateGpu.ExactTiesGoToTheLowerIndex'
  'FusedGateGpu.NearTies'
  'FusedGateGpu.NaNAndInfinity'
  'PermuteGpu.CudaGraphCapture'
  'PermuteGpu.UnpermuteInCudaGraph'
  'GroupedGemmGpu.CudaGraphCapture'
  'GroupedGemmGpu.EdgeShapes'
)
default_filter=$(IFS=:; echo "${default_tests[*]}")
filter=${3:-}
base=${STRESS_BASE_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
log=${STRESS_LOG:-$build/stress.log}
limit=${STRESS_TIMEOUT:-1200}

if ! [[ "$num_seeds" =~ ^[1-9][0-9]*$ ]]; then
  echo "stress: NUM_SEEDS must be a positive integer, got '$num_seeds'" >&2
  exit 2
fi
if ! [[ "$base" =~ ^[0-9]+$ ]]; then
  echo "stress: STRESS_BASE_SEED must be a decimal integer, got '$base'" >&2
  exit 2
fi

# binary and filter pairs
runs=()
if [ -z "$filter" ]; then
  runs+=("$build/tests/tessera_gpu_tests" "$default_filter" "$build/tests/tessera_ptx_tests" '*')
else
  runs+=("$build/tests/tessera_gpu_tests" "$filter" "$build/tests/tessera_ptx_tests" "$filter")
fi

: >"$log"
failures=0
start=$(date +%s)
echo "stress: $num_seeds seeds from TESSERA_SEED=$base (repeat i runs with $base + i); log $log"
for ((r = 0; r < ${#runs[@]}; r += 2)); do
  bin=${runs[r]} f=${runs[r + 1]}
  if [ ! -x "$bin" ]; then
    echo "stress: missing $bin (build the tests first)" >&2
    failures=$((failures + 1))
    continue
  fi
  part=$(mktemp)
  t0=$(date +%s)
  TESSERA_SEED=$base timeout "$limit" "$bin" --gtest_repeat="$num_seeds" --gtest_filter="$f" \
    --gtest_color=no >"$part" 2>&1
  rc=$?
  cat "$part" >>"$log"
  name=$(basename "$bin")
  # One line per failed test run: "[   SEED   ] Suite.Name TESSERA_SEED=S  rerun: ..."
  n=$(grep -c '^\[   SEED   \] [^ ]* TESSERA_SEED=' "$part")
  grep '^\[   SEED   \] [^ ]* TESSERA_SEED=' "$part" | sed "s/^\[   SEED   \] /FAIL $name /"
  failures=$((failures + n))
  done_iterations=$(grep -c '^\[==========\] .* ran\.' "$part")
  if [ "$done_iterations" -lt "$num_seeds" ] || { [ "$rc" -ne 0 ] && [ "$n" -eq 0 ]; }; then
    # Crashed, hung or failed outside a test: name the last test that started and the seed of its iteration.
    last_test=$(grep '^\[ RUN      \]' "$part" | tail -n 1 | sed 's/^\[ RUN      \] //')
    last_seed=$(grep -o 'run seed [0-9]*' "$part" | tail -n 1 | sed 's/run seed //')
    why=$([ "$rc" -eq 124 ] && echo "timed out after ${limit}s" || echo "exited with $rc")
    echo "FAIL $name ${last_test:-<no test started>} TESSERA_SEED=${last_seed:-$base}: $why"
    failures=$((failures + 1))
  fi
  ran=$(grep -c '^\[       OK \]' "$part")
  skipped=$(grep -c '^\[  SKIPPED \] .*(' "$part")
  echo "stress: $name: $ran test runs passed, $skipped skipped, $n failed, $(($(date +%s) - t0))s"
  rm -f "$part"
done
elapsed=$(($(date +%s) - start))
echo "stress: ${elapsed}s in all, $(awk -v e="$elapsed" -v n="$num_seeds" 'BEGIN { printf "%.2f", e / n }')s per seed"
echo "stress: $num_seeds seeds, $failures failures"
[ "$failures" -eq 0 ]
