#!/usr/bin/env bash
# Build tessera-bench and run the benchmark suite on the GPU, every case checked against the CPU reference before it
# is timed (--check). By default the headline cases (every op, the rows of docs/perf/*.md: within two minutes on an
# H200, build excluded); --all runs every case (within six). Arguments go to tessera-bench (--all, --op, --case,
# --quick, --list, ...).
#
#   BUILD_DIR  build folder (default build-bench/: never tools/test.sh's build/)
#   BENCH_OUT  results (default bench-results/; OUT_DIR is read too): table.txt (stdout of the run), bench.json,
#              bench.csv, plots/
#   --plot DIR  (this script's own option) the PNG charts go to DIR instead of BENCH_OUT/plots
#   JOBS       build parallelism (default: all cores)
#
# Exit status: tessera-bench's (0 all good, 1 a check failed or a case threw, 2 bad usage or no usable device).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build-bench}
out=${BENCH_OUT:-${OUT_DIR:-bench-results}}
jobs=${JOBS:-$(nproc)}
plots=
args=()
while (($#)); do
  case $1 in
    --plot) plots=${2:?tools/bench.sh: --plot needs a folder}; shift 2 ;;
    --plot=*) plots=${1#--plot=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_PYTHON=OFF
cmake --build "$build" -j "$jobs" --target tessera-bench

mkdir -p "$out"
plots=${plots:-$out/plots}
rm -f "$out/bench.json" "$out/bench.csv" "$out/table.txt"  # never plot a previous run's results
start=$(date +%s)
set +e
"$build/bench/tessera-bench" --check --json "$out/bench.json" --csv "$out/bench.csv" ${args[@]+"${args[@]}"} | tee "$out/table.txt"
rc=${PIPESTATUS[0]}
set -e
elapsed=$(($(date +%s) - start))

if [[ -s "$out/bench.json" ]]; then
  if [[ ! -f bench/plot.py ]]; then
    echo "bench: plots skipped (bench/plot.py not found)"
  elif ! python3 -c "import matplotlib" 2>/dev/null; then
    echo "bench: plots skipped (python3 cannot import matplotlib)"
  elif python3 bench/plot.py --bench-json "$out/bench.json" --out "$plots"; then
    echo "bench: plots in $plots/"
  else
    echo "bench: plots failed (bench/plot.py exited non-zero); the table, JSON and CSV are complete"
  fi
  echo "bench: results in $out/ (table.txt, bench.json, bench.csv)"
fi
printf 'bench: run time %d:%02d (build excluded), exit status %d\n' $((elapsed / 60)) $((elapsed % 60)) "$rc"
exit "$rc"
