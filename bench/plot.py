#!/usr/bin/env python3
"""Charts of a tessera-bench run (and a bench/compare.py run): PNGs, one pair per op family.

    python3 bench/plot.py --bench-json bench.json [--compare-json compare.json] --out DIR

  DIR/<family>_ratio.png    per case, peer µs / tessera µs for each peer (> 1: tessera is faster), log scale, the
                            1.0 line marked: tessera-bench's own peers (the cuBLASLt loops) from --bench-json, the
                            Python peers (torch, FlashInfer, ...) from --compare-json (measured in one process; with
                            --with-bench their ratios divide by tessera-bench's time)
  DIR/<family>_ceiling.png  per case, tessera's % of the measured ceiling: the read stream for decode, the
                            device-to-device copy for the MoE routing ops and append_kv, the cuBLASLt loop of the same
                            case for the grouped GEMM (its rate, the only measured compute ceiling tessera-bench has)

Needs matplotlib (the GPU image has it); without it the script says so and exits 0 having written nothing.
Families: gate (fused_gate), permute, unpermute (unpermute_reduce), gemm (grouped_gemm_*), decode, append_kv.
"""

import argparse
import json
import os
import sys

FAMILY_OF_OP = {
    "fused_gate": "gate",
    "permute": "permute",
    "unpermute_reduce": "unpermute",
    "grouped_gemm_fp8": "gemm",
    "grouped_gemm_fp8_masked": "gemm",
    "grouped_gemm_bf16": "gemm",
    "grouped_gemm_bf16_masked": "gemm",
    "decode": "decode",
    "append_kv": "append_kv",
}
TITLES = dict(gate="fused_gate", permute="permute", unpermute="unpermute_reduce", gemm="grouped GEMM",
              decode="attention decode", append_kv="append_kv")
CPP_PEERS = {"cublaslt_fp8_loop": "cuBLASLt loop", "cublaslt_bf16_loop": "cuBLASLt loop"}


def label_of(op, case):
    """The y-axis label of a row: the case name, with the layout for the masked GEMM ops."""
    return case + ("  [masked]" if op.endswith("_masked") else "")


def bench_ratios(bench):
    """family -> {row label -> {peer -> ratio}} from tessera-bench's peer rows (tessera_over_peer inverted)."""
    out = {}
    for r in bench.get("rows", []):
        fam = FAMILY_OF_OP.get(r["op"])
        if fam is None:
            continue
        for p in r.get("peers") or []:
            t = p.get("tessera_over_peer")
            if t:
                out.setdefault(fam, {}).setdefault(label_of(r["op"], r["case"]), {})[CPP_PEERS.get(p["op"], p["op"])] \
                    = 1.0 / t
    return out


def compare_ratios(compare, skip_labels):
    """family -> {row label -> {peer -> ratio}} from bench/compare.py's JSON: graph ratios (eager where a peer has no
    graph time). Peers in skip_labels (tessera-bench's own, already taken from its JSON) are left out."""
    out = {}
    for r in compare.get("rows", []):
        fam = FAMILY_OF_OP.get(r["op"])
        if fam is None:
            continue
        for label, p in (r.get("peers") or {}).items():
            if label in skip_labels:
                continue
            ratios = p.get("peer_over_tessera") or {}
            v = ratios.get("graph") or ratios.get("eager")
            if v:
                out.setdefault(fam, {}).setdefault(label_of(r["op"], r["case"]), {})[label] = v
    return out


def ceilings(bench):
    """family -> [(row label, percent, what)] of tessera's rows in tessera-bench's JSON."""
    out = {}
    for r in bench.get("rows", []):
        fam = FAMILY_OF_OP.get(r["op"])
        if fam is None or r.get("us") is None:
            continue
        if fam == "gemm":
            peers = [p for p in r.get("peers") or [] if p.get("tessera_over_peer")]
            if not peers:
                continue
            pct, what = 100.0 / peers[0]["tessera_over_peer"], "% of the cuBLASLt loop's rate (same case)"
        elif fam == "decode":
            pct, what = r.get("pct_read_bw"), "% of the read-stream bandwidth"
        else:
            pct, what = r.get("pct_copy_bw"), "% of the copy bandwidth (read + write)"
        if pct is not None:
            out.setdefault(fam, []).append((label_of(r["op"], r["case"]), pct, what))
    return out


def merge_ratio_tables(*tables):
    out = {}
    for t in tables:
        for fam, rows in t.items():
            for label, peers in rows.items():
                out.setdefault(fam, {}).setdefault(label, {}).update(peers)
    return out


def _height(n_rows):
    return max(2.6, 0.34 * n_rows + 1.6)


def _plain_log_ticks(ax, lo, hi):
    """Log-axis ticks at 1-2-5 steps written as plain numbers (0.5, 1, 2, 5, ...), not 5x10^-1."""
    from matplotlib.ticker import FixedLocator, NullLocator
    steps = (1, 1.5, 2, 3, 5, 7) if hi / lo < 30 else (1, 2, 5)
    ticks = [m * 10.0 ** e for e in range(-3, 4) for m in steps if lo <= m * 10.0 ** e <= hi]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:g}" for t in ticks])


_TEXT_BOX = dict(facecolor="white", edgecolor="none", pad=0.6, alpha=0.8)


def plot_ratios(plt, fam, rows, path, device, part=""):
    """Horizontal grouped bars, one group per case, one bar per peer; log x axis; the 1.0 line marked."""
    labels = list(rows)
    peers = []
    for r in rows.values():
        peers += [p for p in r if p not in peers]
    n, k = len(labels), len(peers)
    fig, ax = plt.subplots(figsize=(11, _height(n * max(1.0, 0.55 * k))))
    slot = 0.8 / k
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    values = [v for r in rows.values() for v in r.values()]
    lo, hi = max(min(values + [1.0]) / 1.6, 1e-3), max(values + [1.0]) * 2.2
    for j, peer in enumerate(peers):
        ys, xs = [], []
        for i, label in enumerate(labels):
            v = rows[label].get(peer)
            if v:
                ys.append(i - 0.4 + slot * (j + 0.5))
                xs.append(v)
        ax.barh(ys, xs, height=slot * 0.9, color=colors[j % len(colors)], label=peer)
        for y, v in zip(ys, xs):
            ax.text(v * 1.04, y, f"{v:.2f}", va="center", ha="left", fontsize=7, bbox=_TEXT_BOX)
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    _plain_log_ticks(ax, lo, hi)
    ax.axvline(1.0, color="black", linewidth=1.2, linestyle="--", label="1.0: parity", zorder=0)
    ax.set_yticks(range(n))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)  # first case on top
    ax.set_xlabel("peer µs / tessera µs (log scale; > 1: tessera is faster)")
    ax.set_title(f"{TITLES.get(fam, fam)}: tessera vs peers, same-run ratios{part}" +
                 (f"\n{device}" if device else ""), fontsize=10)
    ax.grid(axis="x", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def plot_ceiling(plt, fam, rows, path, device, part=""):
    """Horizontal bars of tessera's % of the measured ceiling per case; the 100 % line marked."""
    labels = [r[0] for r in rows]
    pcts = [r[1] for r in rows]
    what = rows[0][2]
    n = len(rows)
    part = part or ""
    fig, ax = plt.subplots(figsize=(11, _height(n)))
    colors = ["#2a7ab9" if p <= 100 else "#d08a1e" for p in pcts]
    ax.barh(range(n), pcts, height=0.7, color=colors)
    for i, p in enumerate(pcts):
        ax.text(p + 1, i, f"{p:.1f}", va="center", ha="left", fontsize=7, bbox=_TEXT_BOX)
    top = max(110.0, max(pcts) * 1.12)
    ax.set_xlim(0, top)
    ax.axvline(100.0, color="black", linewidth=1.2, linestyle="--", label="100 %: the ceiling", zorder=0)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_yticks(range(n))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel(f"tessera, {what}")
    ax.set_title(f"{TITLES.get(fam, fam)}: % of the measured ceiling{part}" + (f"\n{device}" if device else ""),
                 fontsize=10)
    ax.grid(axis="x", alpha=0.25)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def _parts(items, size):
    """[(suffix, chunk)]: one chunk (suffix '') or several of at most `size` items (suffixes _1, _2, ...)."""
    items = list(items)
    if len(items) <= size:
        return [("", items)]
    n = -(-len(items) // size)
    step = -(-len(items) // n)
    return [(f"_{i + 1}", items[i * step:(i + 1) * step]) for i in range(n)]


def _part_title(part):
    return f" (part {part[1:]})" if part else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--bench-json", required=True, metavar="PATH", help="tessera-bench --json output")
    ap.add_argument("--compare-json", metavar="PATH", help="bench/compare.py --json output (optional)")
    ap.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs (created)")
    ap.add_argument("--max-cases", type=int, default=24, help="cases per ratio chart (twice that per ceiling chart); "
                    "a family with more is split into _1, _2, ... charts")
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"bench/plot.py: matplotlib is not importable ({type(e).__name__}: {e}); no charts written",
              file=sys.stderr)
        return 0
    with open(args.bench_json) as f:
        bench = json.load(f)
    compare = None
    if args.compare_json:
        with open(args.compare_json) as f:
            compare = json.load(f)
    device = (bench.get("device") or {}).get("name")
    cpp = bench_ratios(bench)
    py = compare_ratios(compare, skip_labels={"cuBLASLt"}) if compare else {}
    ratios = merge_ratio_tables(cpp, py)
    # cases in tessera-bench's order (then any that only the compare run has)
    order = {}
    for r in (bench.get("rows") or []) + ((compare or {}).get("rows") or []):
        order.setdefault(label_of(r["op"], r["case"]), len(order))
    ceil = ceilings(bench)
    os.makedirs(args.out, exist_ok=True)
    written = []
    for fam in TITLES:
        if ratios.get(fam):
            labels = sorted(ratios[fam], key=lambda x: order.get(x, len(order)))
            for part, chunk in _parts(labels, args.max_cases):
                path = os.path.join(args.out, f"{fam}_ratio{part}.png")
                plot_ratios(plt, fam, {x: ratios[fam][x] for x in chunk}, path, device, _part_title(part))
                written.append(path)
        if ceil.get(fam):
            for part, chunk in _parts(ceil[fam], 2 * args.max_cases):
                path = os.path.join(args.out, f"{fam}_ceiling{part}.png")
                plot_ceiling(plt, fam, chunk, path, device, _part_title(part))
                written.append(path)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print("bench/plot.py: no rows with ratios or ceilings in the input; nothing written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
