#!/usr/bin/env bash
# Reruns the randomized GPU tests over many seeds. Seed s = BASE + i for i in [0, NUM_SEEDS): the test binaries run
# with TESSERA_SEED=<first seed of a chunk> --gtest_repeat=<chunk length>, and gtest repeat j of that process runs
# with seed TESSERA_SEED + j (tests/common/gpu_util.h, "seeds"), so one process covers a chunk of seeds and a crash
# loses only its chunk. Every failed test prints "[   SEED   ] Suite.Name TESSERA_SEED=S  rerun: ..."; this script
# lists those as FAIL lines, each with its first failure message under it ("  why ..."), then a last line
#   stress: N seeds, F failures
# and exits 1 when F > 0 (a crash, a timeout or a missing binary counts as a failure).
#
#   tools/stress.sh BUILD_DIR [NUM_SEEDS=200] [GTEST_FILTER]
#     BUILD_DIR     the CMake build directory (BUILD_DIR/tests/tessera_gpu_tests and tessera_ptx_tests)
#     GTEST_FILTER  default: the fast randomized tests below, plus all of tessera_ptx_tests; a filter given here
#                   applies to both binaries
#   env: STRESS_BASE_SEED   first seed (default: random)
#        STRESS_CHUNK       seeds per process (default 25)
#        STRESS_MAX_SECONDS start no new chunk after this many seconds (default: none); N then counts the seeds run
#        STRESS_TIMEOUT     seconds per process (default 600)
#        STRESS_JOBS        chunks run at once, each its own process (default 1). The tests' time is mostly host-side
#                           data generation and references: on the 16-core H200 machine 4 processes of the linear
#                           tests side by side each took ~10.5 s a seed (session 16), about what one such seed takes
#                           alone in ctest, so the seeds per minute grow with the jobs
#        STRESS_LOG         the full gtest output (default: BUILD_DIR/stress.log)
#
# Reproduce a failure: TESSERA_SEED=S BUILD_DIR/tests/tessera_gpu_tests --gtest_filter=Suite.Name
#
# The default filter aims at 200 seeds in about 5 minutes on an H200 (1.0-1.5 s per seed measured without the
# AppendKvChannelGpu tests, which add an estimated 0.35 s; mostly host-side data generation and references; the last
# lines print the measured time per seed): the CUDA-graph replays of every family (where an upload not ordered with the
# stream shows, issue 14), append_kv, the fused-gate ties, near-ties and NaN/inf cases, and the small grouped-GEMM edge
# shapes, and one prefill configuration drawn from each seed. The per-channel key formats' append_kv tests
# (AppendKvChannelGpu: sequences of appends with rejects, a long prompt, rows past the capacity, graph replays) each run
# a few configurations drawn from the seed, printed as "[   CASE   ] Suite.Name <configuration> seed=...
# TESSERA_SEED=..." lines; their *AllConfigs twins run every configuration once per ctest and are not in the list. The
# large grids (DecodeGpu.Grid, SpeculativeTokens, GroupedGemmGpu.ShapeGrid, PermuteGpu.ShapeGrid,
# AppendKvChannelGpu.*AllConfigs, LinearGpu.OneSignXOverLongBlocks, ...) spend seconds per run in the references and
# run once per ctest; pass a filter to stress them with fewer seeds. One seed of this list took 17.7 s alone in one
# process on an H200 in session 22 with LinearGpu.OneSignXOverLongBlocks (5.0 s; since taken out), so ~12.7 s now
# (slowest: the gate's far-negative logits 2.5 s, the MoE layer's four tests 5 s); 10 processes side by side took ~25 s
# a seed each, so give a chunk of C seeds a STRESS_TIMEOUT well above 25·C s.
set -uo pipefail

build=${1:?usage: tools/stress.sh BUILD_DIR [NUM_SEEDS] [GTEST_FILTER]}
num_seeds=${2:-200}
default_tests=(
  'AppendKvGpu.*'
  'AppendKvChannelGpu.SequencesOfAppendsMatchTheHostModel'
  'AppendKvChannelGpu.LongPromptThenDecode'
  'AppendKvChannelGpu.RowsPastTheCapacityThenReject'
  'AppendKvChannelGpu.CudaGraphReplaysWithNewPositionsAndInputs'
  'DecodeGpu.CudaGraphReplaysWithNewLengths'
  'DecodeGpu.BackToBackCallsShareOneWorkspace'
  'DecodeGpu.SkewedBatchesSplitByLength'
  'PrefillGpu.RandomConfiguration'
  'PrefillGpu.GraphReplayWithNewLengthsAndDeterminism'
  'PrefillCacheGpu.GroupsWindowsSoftcapAndRandomConfiguration'
  'FusedGateGpu.CudaGraphCaptureAndReplay'
  'FusedGateGpu.ExactTiesGoToTheLowerIndex'
  'FusedGateGpu.NearTies'
  'FusedGateGpu.NaNAndInfinity'
  'PermuteGpu.CudaGraphCapture'
  'PermuteGpu.UnpermuteInCudaGraph'
  'GroupedGemmGpu.CudaGraphCapture'
  'GroupedGemmGpu.EdgeShapes'
  'GroupedGemmGpu.DecodeLaunchesSplitTheirTiles'
  'GroupedGemmGpu.OddKBlockCounts'
  'FusedGateGpu.FarNegativeLogits'
  'LinearGpu.BiasAndClamps'
  'LinearGpu.CudaGraphCapture'
  'LinearGpu.DocumentedSmallestAlignmentsRun'
  'W8A8GemmGpu.EpilogueAndTypes'
  'W8A8GemmGpu.SplitK'
  'W8A8GemmGpu.CudaGraphReplay'
  'W8A8GemmGpu.ExtremeZeroPointsGiveExactIntegers'
  'W8A8QuantizeGpu.RaggedColumnTiles'
  'W8A8QuantizeGpu.UnalignedAndStridedX'
  'W8A8QuantizeGpu.OverflowingRange'
  'W8A8QuantizeGpu.CudaGraphCaptureAndReplay'
  'GroupedGemmGpu.DenseFp8IsTheOneGroupProduct'
  'ConvGpu.RandomGeometries'
  'ConvGpu.CudaGraphAndDeterminism'
  'MoeLayerGpu.EveryFormatAndGate'
  'MoeLayerGpu.RoutingExtremes'
  'MoeLayerGpu.DeviceTokenCount'
  'MoeLayerGpu.CudaGraphReplaysWithNewTokensAndRouting'
)
default_filter=$(IFS=:; echo "${default_tests[*]}")
filter=${3:-}
base=${STRESS_BASE_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
chunk=${STRESS_CHUNK:-25}
max_seconds=${STRESS_MAX_SECONDS:-0}
limit=${STRESS_TIMEOUT:-600}
log=${STRESS_LOG:-$build/stress.log}

jobs=${STRESS_JOBS:-1}
for v in num_seeds chunk jobs; do
  if ! [[ "${!v}" =~ ^[1-9][0-9]*$ ]]; then
    echo "stress: $v must be a positive integer, got '${!v}'" >&2
    exit 2
  fi
done
for v in base max_seconds limit; do
  if ! [[ "${!v}" =~ ^[0-9]+$ ]]; then
    echo "stress: $v must be a non-negative decimal integer, got '${!v}'" >&2
    exit 2
  fi
done

# (binary, filter) pairs
if [ -z "$filter" ]; then
  runs=("$build/tests/tessera_gpu_tests" "$default_filter" "$build/tests/tessera_ptx_tests" '*')
else
  runs=("$build/tests/tessera_gpu_tests" "$filter" "$build/tests/tessera_ptx_tests" "$filter")
fi
for ((r = 0; r < ${#runs[@]}; r += 2)); do
  if [ ! -x "${runs[r]}" ]; then
    echo "stress: missing ${runs[r]} (build the tests first)"
    echo "stress: 0 seeds, 1 failures"
    exit 1
  fi
done

: >"$log"
failures=0 passed=0 skipped=0 seeds_run=0
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One chunk: every (binary, filter) pair over seeds first .. first + n - 1. Writes "<failures> <passed> <skipped>" to
# $work/<first>.sum, the FAIL lines to $work/<first>.fail and the gtest output to $work/<first>.log.
run_chunk() {
  local first=$1 n_chunk=$2 seed=$(($1 + base)) f_total=0 p_total=0 s_total=0 r bin f name part rc n completed
  : >"$work/$first.fail"
  : >"$work/$first.log"
  for ((r = 0; r < ${#runs[@]}; r += 2)); do
    bin=${runs[r]} f=${runs[r + 1]} name=$(basename "${runs[r]}")
    part="$work/$first.$r.part"
    TESSERA_SEED=$seed timeout "$limit" "$bin" --gtest_repeat="$n_chunk" --gtest_filter="$f" --gtest_color=no \
      >"$part" 2>&1
    rc=$?
    cat "$part" >>"$work/$first.log"
    # One line per failed test run: "[   SEED   ] Suite.Name TESSERA_SEED=S  rerun: ..."
    n=$(grep -c '^\[   SEED   \] [^ ]* TESSERA_SEED=' "$part")
    grep '^\[   SEED   \] [^ ]* TESSERA_SEED=' "$part" | sed "s/^\[   SEED   \] /FAIL $name /" >>"$work/$first.fail"
    # Under each, the first failure message of that run (3 lines after gtest's "file:line: Failure", a scoped trace
    # included, gtest's own "Value of / Actual / Expected / Which is" lines skipped: an EXPECT_TRUE(r.ok) << message
    # then shows the message), indented on the lines below the "why" line, so that the summary says what failed even
    # where the full log cannot be kept.
    awk '/^\[ RUN      \] / { test = $4; msg = ""; take = 0; next }
         /: Failure$/ { if (msg == "") take = 3; next }
         take > 0 { if ($0 !~ /^(Google Test trace:|Value of: |  Actual: |Expected: |  Which is: )/) {
                      msg = msg "\n      " $0; take-- }; next }
         /^\[  FAILED  \] [^ ]+ \(/ { if (msg != "") print "  why " test ":" msg; msg = ""; next }' "$part" \
      >>"$work/$first.fail"
    f_total=$((f_total + n))
    completed=$(grep -c '^\[==========\] .* ran\.' "$part")
    if [ "$completed" -lt "$n_chunk" ] || { [ "$rc" -ne 0 ] && [ "$n" -eq 0 ]; }; then
      # Crashed, hung or failed outside a test: the last test that started and the seed of its repeat.
      local last_test last_seed why
      last_test=$(grep '^\[ RUN      \]' "$part" | tail -n 1 | sed 's/^\[ RUN      \] //')
      last_seed=$(grep -o 'run seed [0-9]*' "$part" | tail -n 1 | sed 's/run seed //')
      why=$([ "$rc" -eq 124 ] && echo "timed out after ${limit}s" || echo "exited with $rc")
      echo "FAIL $name ${last_test:-<no test started>} TESSERA_SEED=${last_seed:-$seed}: $why" \
           "after $completed of $n_chunk repeats" >>"$work/$first.fail"
      f_total=$((f_total + 1))
    fi
    p_total=$((p_total + $(grep -c '^\[       OK \]' "$part")))
    s_total=$((s_total + $(grep -c '^\[  SKIPPED \] .*(' "$part")))
    rm -f "$part"
  done
  echo "$f_total $p_total $s_total" >"$work/$first.sum"
}

echo "stress: $num_seeds seeds from $base (seed s runs with TESSERA_SEED=s), $chunk per process, $jobs at once;" \
     "log $log"
for ((wave = 0; wave < num_seeds; wave += chunk * jobs)); do
  if [ "$max_seconds" -gt 0 ] && [ $(($(date +%s) - start)) -ge "$max_seconds" ]; then
    echo "stress: stopped after $seeds_run seeds: STRESS_MAX_SECONDS=$max_seconds reached"
    break
  fi
  firsts=()
  for ((first = wave; first < num_seeds && first < wave + chunk * jobs; first += chunk)); do
    n_chunk=$((num_seeds - first < chunk ? num_seeds - first : chunk))
    run_chunk "$first" "$n_chunk" &
    firsts+=("$first:$n_chunk")
  done
  wait
  for fc in "${firsts[@]}"; do
    first=${fc%%:*} n_chunk=${fc##*:}
    cat "$work/$first.log" >>"$log"
    cat "$work/$first.fail"
    # A chunk whose subshell died before its summary counts as one failure.
    f_n=1 p_n=0 s_n=0
    [ -s "$work/$first.sum" ] && read -r f_n p_n s_n <"$work/$first.sum"
    [ -s "$work/$first.sum" ] || echo "FAIL chunk from TESSERA_SEED=$((base + first)): no summary (the chunk's shell died)"
    failures=$((failures + f_n)) passed=$((passed + p_n)) skipped=$((skipped + s_n))
    seeds_run=$((seeds_run + n_chunk))
    echo "stress: seeds $((base + first))..$((base + first + n_chunk - 1)) done, $failures failures so far," \
         "$(($(date +%s) - start))s"
  done
done
elapsed=$(($(date +%s) - start))
echo "stress: $passed test runs passed, $skipped skipped; ${elapsed}s in all," \
     "$(awk -v e="$elapsed" -v n="$seeds_run" 'BEGIN { printf "%.2f", n ? e / n : 0 }')s per seed"
echo "stress: $seeds_run seeds, $failures failures"
[ "$failures" -eq 0 ]
