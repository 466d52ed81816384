#!/usr/bin/env bash
# The GPU-machine pass: build with all cores, C++ tests, pytest (in-tree and pip-installed), compute-sanitizer
# memcheck + racecheck over a reduced subset, the benchmark and the PyTorch comparison. Full logs go to OUTDIR;
# a short summary is printed last.
#   tools/gpu-check.sh OUTDIR [STEP...]
#   steps: build test pytest pip sanitize stress mainjob overhead compare (default: all)
#     stress    the randomized GPU tests over STRESS_SEEDS seeds (default 200, STRESS_JOBS processes at once, default 8:
#               200 seeds in 261 s on an H200 in session 18, twice that with 4),
#               failures with their seeds
#     mainjob   the README's main job, tools/bench.sh (its own build folder), timed without its build
#     overhead  host time per eager Python call of each op (bench/host_overhead.py)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu-check.sh OUTDIR [STEP...]}
shift
steps=${*:-build test pytest pip sanitize stress mainjob overhead compare}
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
subset='FusedGateGpu.StridedRows:FusedGateGpu.ExactTiesGoToTheLowerIndex:FusedGateGpu.NaNAndInfinity:FusedGateGpu.CudaGraphCaptureAndReplay:PermuteGpu.ShapeGrid:PermuteGpu.CudaGraphCapture:PermuteGpu.UnpermuteInCudaGraph:*HostPointer*:GroupedGemmGpu.RaggedGroups:GroupedGemmGpu.EdgeShapes:GroupedGemmGpu.MixedGroupSizesRunEveryTileShapeInOneLaunch:GroupedGemmGpu.OneLargeGroupAmongTinyOnes:GroupedGemmGpu.StridedOperands:GroupedGemmGpu.OutOfRangeAndNonMonotoneGroupRows:GroupedGemmGpu.CudaGraphCapture:GroupedGemmGpu.DecodeLaunchesSplitTheirTiles:GroupedGemmGpu.OddKBlockCounts:DecodeGpu.Grid:DecodeGpu.SplitCounts:DecodeGpu.SoftcapWindowAndScale:DecodeGpu.CudaGraphReplaysWithNewLengths:DecodeGpu.BackToBackCallsShareOneWorkspace:DecodeGpu.SkewedBatchesSplitByLength:AppendKvGpu.*:AppendKvChannelGpu.SequencesOfAppendsMatchTheHostModel:AppendKvChannelGpu.RowsPastTheCapacityThenReject:AppendKvChannelGpu.CudaGraphReplaysWithNewPositionsAndInputs:PrefillGpu.GroupsWindowsSoftcap:PrefillGpu.BatchedFusedAndStridedLayouts:PrefillGpu.WrongDeviceLengthsStayInBounds:PrefillCacheGpu.GroupsWindowsSoftcapAndRandomConfiguration:PrefillCacheGpu.CorruptBlockTableStaysInBounds:PrefillCacheGpu.WindowOverDroppedKeys:PermuteGpu.Fp8OutputEightBytesIntoItsAllocation:W8A8GemmGpu.UnusedSumsAreNotRead:FusedGateGpu.FarNegativeLogits:LinearGpu.CudaGraphCapture:LinearGpu.DocumentedSmallestAlignmentsRun:LinearGpu.BiasAndClamps:W8A8GemmGpu.EpilogueAndTypes:W8A8GemmGpu.SplitK:W8A8GemmGpu.CudaGraphReplay:W8A8QuantizeGpu.RaggedColumnTiles:W8A8QuantizeGpu.UnalignedAndStridedX:W8A8QuantizeGpu.CudaGraphCaptureAndReplay:GroupedGemmGpu.DenseFp8IsTheOneGroupProduct:ConvGpu.ImplicitGemmGeometries:ConvGpu.LinearPath:ConvGpu.DirectPath:ConvGpu.CudaGraphAndDeterminism:MoeLayerGpu.EveryFormatAndGate:MoeLayerGpu.DeviceTokenCount:MoeLayerGpu.CudaGraphReplaysWithNewTokensAndRouting'

if has build; then
  run_step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}
  run_step build cmake --build "$build" -j "$jobs"
fi
has test && run_step ctest ctest --test-dir "$build" --output-on-failure -j 4
has pytest && run_step pytest env PYTHONPATH="$build/python" python3 -m pytest -q tests/python -p no:cacheprovider
if has pip; then
  # A fresh virtual environment that sees the machine's Python packages (torch, scikit-build-core, pybind11: there
  # is no network). python3 there is itself a venv, so its site-packages are linked in with a .pth file.
  rm -rf /tmp/tessera_venv
  run_step pip_install bash -c "python3 -m venv /tmp/tessera_venv &&
    python3 -c 'import site; print(site.getsitepackages()[0])' >\$(/tmp/tessera_venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/machine.pth &&
    /tmp/tessera_venv/bin/pip install --no-build-isolation --no-deps -q . &&
    /tmp/tessera_venv/bin/pip show tessera-kernels" &&
    run_step pip_import bash -c "cd /tmp && /tmp/tessera_venv/bin/python -c 'import tessera, torch; from tessera import _torch_ops; assert _torch_ops.available(), _torch_ops.load_error; print(tessera.__version__)' &&
      cd '$PWD' && TESSERA_PYTHONPATH= /tmp/tessera_venv/bin/python -m pytest -q tests/python -p no:cacheprovider -k 'torch_ops or import or version or readme'"
fi
if has sanitize; then
  run_step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/tessera_gpu_tests" --gtest_filter="$subset"
  run_step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/tessera_gpu_tests" --gtest_filter="$subset"
  run_step synccheck compute-sanitizer --tool synccheck --error-exitcode 1 "$build/tests/tessera_gpu_tests" --gtest_filter="$subset"
  for tool in memcheck racecheck synccheck; do
    run_step "ptx_$tool" compute-sanitizer --tool $tool --error-exitcode 1 "$build/tests/tessera_ptx_tests"
  done
fi
has stress && run_step stress env STRESS_LOG="$out/stress_gtest.log" STRESS_JOBS="${STRESS_JOBS:-8}" \
  tools/stress.sh "$build" "${STRESS_SEEDS:-200}"
if has mainjob; then
  run_step mainjob env BENCH_OUT="$out/mainjob" tools/bench.sh ${BENCH_ARGS:-}
  cp "$out/mainjob/bench.json" "$out/bench.json" 2>/dev/null || true
fi
has overhead && run_step overhead env PYTHONPATH="$build/python" python3 bench/host_overhead.py --json "$out/overhead.json"
if has compare; then
  # FlashInfer, where its pack was carried (.fi/, made by ../shared/tools/pack-flashinfer.sh; docs/perf/peers.md).
  fi_path=
  if [ -f .fi/flashinfer-site.tar.xz ]; then
    mkdir -p /tmp/fi && tar xJf .fi/flashinfer-site.tar.xz -C /tmp/fi && fi_path=/tmp/fi:
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FLASHINFER_CUDA_ARCH_LIST=9.0a
  fi
  # The peers on the main job's cases, merged with its tessera-bench rows (or a run of its own without them).
  if [ -f "$out/bench.json" ]; then src=(--bench-json "$out/bench.json"); else src=(--with-bench "build-bench/bench/tessera-bench" --save-bench-json "$out/bench.json"); fi
  run_step compare env PYTHONPATH="$fi_path$build/python" PYTHONUNBUFFERED=1 python3 bench/compare.py "${src[@]}" \
    --json "$out/compare.json" ${COMPARE_ARGS:-}
  run_step plots env PYTHONPATH="$build/python" python3 bench/plot.py --bench-json "$out/bench.json" \
    --compare-json "$out/compare.json" --out "$out/plots"
fi

for f in mainjob compare overhead; do
  [ -f "$out/$f.log" ] && { echo; echo "---- $f (tail)"; tail -n 45 "$out/$f.log"; }
done
for f in ctest pytest pip_import memcheck racecheck synccheck stress; do
  [ -f "$out/$f.log" ] && { echo; echo "---- $f (tail)"; tail -n 6 "$out/$f.log"; }
done
echo
echo "==== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
printf '%s\n' "${summary[@]}"
