#!/usr/bin/env python3
"""Compares --json runs of two builds (tools/ab.sh): the median over the runs of each build, per case.

    python3 bench/ab_compare.py --base 'out/json/base-*.json' --new 'out/json/new-*.json' [--key graph_us]

Reads tessera-bench's rows (op, case) and bench/host_overhead.py's (op, outputs; --key paired_above_launches_us or
host_us). Prints a Markdown table: op, case, base µs, new µs, new − base, new / base (< 1: the new build is faster),
and each side's values run by run (few runs) or its spread, max / min (more than four), so a difference can be read
against the run-to-run noise of that row; and, where the rows carry it (tessera-bench with NVML), each side's median
SM clock in MHz, so that a difference can be read against the clocks the two builds ran at.
"""

import argparse
import glob
import json
import math
import statistics
import sys


def load_rows(path):
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):  # a wrapper object: its list of rows
        data = next((v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)), [])
    return {(r["op"], r.get("case", r.get("outputs"))): r for r in data
            if isinstance(r, dict) and "op" in r and ("case" in r or "outputs" in r)}


def per_case(paths, key):
    values = {}
    for path in paths:
        for k, row in load_rows(path).items():
            v = row.get(key)
            # Times are positive; a difference (host_overhead's paired figure) may be at or below zero.
            if isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 or not key.endswith("us") or
                                                                     key.startswith("paired")):
                values.setdefault(k, []).append(float(v))
    return values


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="glob of the base build's --json files")
    ap.add_argument("--new", required=True, help="glob of the new build's --json files")
    ap.add_argument("--key", default="graph_us", help="row field to compare (default graph_us; stream_us, us)")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    base_paths, new_paths = sorted(glob.glob(args.base)), sorted(glob.glob(args.new))
    if not base_paths or not new_paths:
        print(f"ab_compare: no files for {args.base if not base_paths else args.new}", file=sys.stderr)
        return 2
    base, new = per_case(base_paths, args.key), per_case(new_paths, args.key)
    mhz_key = "stream_sm_mhz" if args.key.startswith("stream") else "sm_mhz"  # the clock of the mode compared
    base_mhz, new_mhz = per_case(base_paths, mhz_key), per_case(new_paths, mhz_key)
    clocks = bool(base_mhz or new_mhz)
    if args.title:
        print(f"A/B: {args.title}\n")
    print(f"{len(base_paths)} base and {len(new_paths)} new runs; median {args.key} per case\n")
    few = max(len(base_paths), len(new_paths)) <= 4
    side = "runs" if few else "spread"
    mhz_head, mhz_rule = (" MHz base / new |", "---|") if clocks else ("", "")
    print(f"| op | case | base µs | new µs | new − base | new / base | {side} base | {side} new |{mhz_head}")
    print("|---|---|---|---|---|---|---|---|" + mhz_rule)

    def mhz(table, k):
        return f"{statistics.median(table[k]):.0f}" if k in table else "-"

    def runs(v):
        if few:
            return " / ".join(f"{x:.2f}" for x in v)
        return f"{max(v) / min(v):.3f}" if min(v) > 0 else ""

    for k in base:
        if k not in new:
            continue
        b, n = statistics.median(base[k]), statistics.median(new[k])
        ratio = f"{n / b:.3f}" if b > 0 and n > 0 else ""
        cell = f" {mhz(base_mhz, k)} / {mhz(new_mhz, k)} |" if clocks else ""
        print(f"| {k[0]} | {k[1]} | {b:.2f} | {n:.2f} | {n - b:+.2f} | {ratio} | {runs(base[k])} | {runs(new[k])} |"
              + cell)
    only = sorted(set(base) ^ set(new))
    if only:
        print(f"\ncases in one build only: {', '.join(f'{op} {case}' for op, case in only)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
