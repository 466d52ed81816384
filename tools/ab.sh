#!/usr/bin/env bash
# Same-run A/B of tessera-bench: the working tree against another revision, built side by side and run alternately
# on one GPU, so that both see the same machine state (the H200 machines here drift by several % between passes;
# docs/perf/grouped_gemm.md, v6). Two halves, because the GPU machine gets the working tree but not .git:
#
#   tools/ab.sh prepare REV                  here: REV's sources into .ab/base.tar (.ab/ is git-ignored);
#                                            carry `.ab` in the GPU call
#   tools/ab.sh build [LOGDIR]               GPU machine: builds both binaries only (run reuses them)
#   tools/ab.sh run OUTDIR [ROUNDS] [-- BENCH_ARGS...]
#                                            GPU machine: builds both tessera-bench binaries (in parallel), runs
#                                            them alternately ROUNDS times (default 3) with BENCH_ARGS (default
#                                            --all), writes OUTDIR/ab.md (median graph-mode µs per case, new / base)
#                                            and OUTDIR/ab-json.tar (every run's --json)
#   tools/ab.sh host OUTDIR [PASSES]         GPU machine: the same for the Python host time per eager call: builds
#                                            both trees' Python modules (tests and bench off), runs
#                                            bench/host_overhead.py (the working tree's script, for both) alternately
#                                            PASSES times (default 3), writes OUTDIR/ab.md (the paired figure, us
#                                            above each op's launches, per pass and median) and OUTDIR/ab-json.tar
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: tools/ab.sh prepare REV | build [LOGDIR] | run OUTDIR [ROUNDS] [-- BENCH_ARGS...] | host OUTDIR [PASSES]}
shift

case $cmd in
  prepare)
    rev=${1:?tools/ab.sh prepare: name a revision}
    mkdir -p .ab
    git archive --format=tar -o .ab/base.tar "$rev"
    git rev-parse "$rev" >.ab/base.rev
    echo "ab: $(cat .ab/base.rev) in .ab/base.tar ($(du -h .ab/base.tar | cut -f1)); carry .ab in the GPU call"
    ;;
  build | run | host)
    if [[ $cmd == build ]]; then
      out=${1:-/tmp/tessera-ab-logs}
    else
      out=${1:?tools/ab.sh $cmd: name an output folder}
      shift
    fi
    rounds=3
    if (($#)) && [[ $1 != -- ]]; then rounds=$1; shift; fi
    [[ ${1:-} == -- ]] && shift
    bench_args=("$@")
    ((${#bench_args[@]})) || bench_args=(--all)
    [[ -f .ab/base.tar ]] || { echo "ab: .ab/base.tar missing (tools/ab.sh prepare REV here, carry .ab)" >&2; exit 2; }
    mkdir -p "$out/json"
    jobs=$(nproc)
    half=$(((jobs + 1) / 2))
    base_src=/tmp/tessera-ab-base
    # The build folders: tessera-bench alone, or (host) the library and both Python modules.
    if [[ $cmd == host ]]; then
      sub=build-py new_build=build-ab-py options=(-DTESSERA_BUILD_BENCH=OFF -DTESSERA_BUILD_PYTHON=ON) target=all
    else
      sub=build new_build=build-ab options=(-DTESSERA_BUILD_PYTHON=OFF) target=tessera-bench
    fi
    build() {  # source dir, build dir, log
      cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_BUILD_TESTS=OFF "${options[@]}" \
        >"$3" 2>&1 && cmake --build "$2" -j "$half" --target "$target" >>"$3" 2>&1
    }
    # `build` alone (e.g. in the background while the GPU runs tests) makes both binaries; `run` builds them again,
    # which costs nothing where they are current (ninja; the base sources are unpacked again only for a new REV).
    if [[ "$(cat "$base_src/.ab-rev" 2>/dev/null)" != "$(cat .ab/base.rev 2>/dev/null)" ]]; then
      rm -rf "$base_src" && mkdir -p "$base_src" && tar -xf .ab/base.tar -C "$base_src"
      cp .ab/base.rev "$base_src/.ab-rev" 2>/dev/null || true
    fi
    build "$base_src" "$base_src/$sub" "$out/build-base.log" & base_pid=$!
    build . "$new_build" "$out/build-new.log" & new_pid=$!
    wait "$base_pid" || { echo "ab: base build failed ($out/build-base.log)" >&2; exit 1; }
    wait "$new_pid" || { echo "ab: new build failed ($out/build-new.log)" >&2; exit 1; }
    [[ $cmd == build ]] && exit 0
    if [[ $cmd == host ]]; then
      for ((r = 1; r <= rounds; ++r)); do
        PYTHONPATH="$base_src/$sub/python" python3 bench/host_overhead.py --json "$out/json/base-$r.json" \
          >"$out/base-$r.txt" 2>&1 || echo "ab: base pass $r exited non-zero ($out/base-$r.txt)" >&2
        PYTHONPATH="$new_build/python" python3 bench/host_overhead.py --json "$out/json/new-$r.json" \
          >"$out/new-$r.txt" 2>&1 || echo "ab: new pass $r exited non-zero ($out/new-$r.txt)" >&2
        echo "ab: pass $r of $rounds done" >&2
      done
      python3 bench/ab_compare.py --base "$out/json/base-*.json" --new "$out/json/new-*.json" \
        --key paired_above_launches_us \
        --title "host time per eager call, base $(cat .ab/base.rev 2>/dev/null || echo '?') vs the working tree" |
        tee "$out/ab.md"
      tar -cf "$out/ab-json.tar" -C "$out" json && rm -rf "$out/json"
      exit 0
    fi
    for ((r = 1; r <= rounds; ++r)); do
      "$base_src/build/bench/tessera-bench" "${bench_args[@]}" --json "$out/json/base-$r.json" >/dev/null 2>&1 ||
        echo "ab: base round $r exited non-zero" >&2
      build-ab/bench/tessera-bench "${bench_args[@]}" --json "$out/json/new-$r.json" >/dev/null 2>&1 ||
        echo "ab: new round $r exited non-zero" >&2
      echo "ab: round $r of $rounds done" >&2
    done
    gpu=$(nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader 2>/dev/null | head -1 || true)
    python3 bench/ab_compare.py --base "$out/json/base-*.json" --new "$out/json/new-*.json" \
      --title "base $(cat .ab/base.rev 2>/dev/null || echo '?') vs the working tree; $gpu; ${bench_args[*]}" | tee "$out/ab.md"
    tar -cf "$out/ab-json.tar" -C "$out" json && rm -rf "$out/json"
    ;;
  *)
    echo "ab: unknown command '$cmd' (prepare | run)" >&2
    exit 2
    ;;
esac
