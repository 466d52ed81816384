#!/usr/bin/env python3
"""Compares tessera-bench --json runs of two builds (tools/ab.sh): the median over the runs of each build, per case.

    python3 bench/ab_compare.py --base 'out/json/base-*.json' --new 'out/json/new-*.json' [--key graph_us]

Prints a Markdown table: op, case, base µs, new µs, new / base (< 1: the new build is faster), and the spread
(max / min over the runs) of each side, so a difference can be read against the run-to-run noise of that row.
"""

import argparse
import glob
import json
import statistics
import sys


def load_rows(path):
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):  # a wrapper object: its list of rows
        data = next((v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)), [])
    return {(r["op"], r["case"]): r for r in data if isinstance(r, dict) and "op" in r and "case" in r}


def per_case(paths, key):
    values = {}
    for path in paths:
        for k, row in load_rows(path).items():
            v = row.get(key)
            if isinstance(v, (int, float)) and v > 0:
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
    if args.title:
        print(f"A/B: {args.title}\n")
    print(f"{len(base_paths)} base and {len(new_paths)} new runs; median {args.key} per case\n")
    print("| op | case | base µs | new µs | new / base | spread base | spread new |")
    print("|---|---|---|---|---|---|---|")
    for k in base:
        if k not in new:
            continue
        b, n = statistics.median(base[k]), statistics.median(new[k])
        spread = lambda v: max(v) / min(v)  # noqa: E731
        print(f"| {k[0]} | {k[1]} | {b:.2f} | {n:.2f} | {n / b:.3f} | {spread(base[k]):.3f} | "
              f"{spread(new[k]):.3f} |")
    only = sorted(set(base) ^ set(new))
    if only:
        print(f"\ncases in one build only: {', '.join(f'{op} {case}' for op, case in only)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
