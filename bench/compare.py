#!/usr/bin/env python3
"""tessera vs its peers (PyTorch, FlashInfer, flash-attn; cuBLASLt through tessera-bench) on one GPU.

    # tessera-bench and the Python peers together, one merged table (tessera-bench's headline cases; --all: all)
    PYTHONPATH=build/python python3 bench/compare.py --with-bench build-bench/bench/tessera-bench [--all] \
        [--json compare.json] [--save-bench-json bench.json]
    python3 bench/plot.py --bench-json bench.json --compare-json compare.json --out plots/
    # the Python peers alone, timing tessera through its Python API (every case of the chosen ops)
    PYTHONPATH=build/python python3 bench/compare.py [--json results.json] [--ops gate,permute,unpermute,gemm,decode]
    PYTHONPATH=build/python python3 bench/compare.py --ops gemm [--gemm-cases dsv3,qwen3] [--gemm-kinds fp8_tensor]
    PYTHONPATH=build/python python3 bench/compare.py --ops decode [--decode-cases llama3_8b] [--decode-formats int4]
    PYTHONPATH=build/python python3 bench/compare.py --ops linear [--linear-cases gate_up/N14336_K4096/M1/] \
        [--linear-peers torch,tinygemm]
    PYTHONPATH=build/python python3 bench/compare.py --ops w8a8 [--w8a8-cases /M16/,g128] [--w8a8-peak-tops 1979]
    python3 bench/compare.py --with-bench build-bench/bench/tessera-bench --ops conv [--all] [--conv-cases B8_C512]
    PYTHONPATH=build/python python3 bench/compare.py --with-bench build-bench/bench/tessera-bench --ops moe_layer \
        [--all] [--compile] [--moe-layer-cases dsv3/,/T4096/] [--moe-layer-peers composed,torch,compile]

Case names are tessera-bench's (bench/*_cases.cpp: 'dsv3/T4096/fp32', 'hq8kv1/B128/T8192/paged16/native', ...).
The peers of each family live in bench/peers/ (common.py: timing and tables; gate.py, permute.py, gemm.py,
decode.py, linear.py, w8a8.py, conv.py, moe_layer.py; merge.py: the tessera-bench join); their docstrings say exactly
what each peer runs.

Ratios are peer µs / tessera µs of the same timing mode, CUDA graphs where both have them (> 1: tessera is faster).
With --with-bench / --bench-json, tessera's µs is tessera-bench's and the µs measured here through tessera's
Python API is printed beside it as a cross-check. A peer that is not installed (FlashInfer, flash_attn) is skipped
and named in the notes; a tessera op that fails is reported in its row; the other rows still run.
"""

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers import common as C  # noqa: E402
from peers import conv, decode, fi_jit, gate, gemm, linear, merge, moe_layer, permute, w8a8  # noqa: E402

# The linear family's registration in the tessera-bench join (its tables live in peers/linear.py).
merge.FAMILIES.update({op: ("linear", linear) for op in linear.MERGED_OPS})
merge.BENCH_OPS["linear"] = list(linear.BENCH_OPS)
merge.CPP_PEER_LABELS.update(linear.CPP_PEER_LABELS)
merge.TITLES["linear"] = linear.TITLE
# W8A8 (peers/w8a8.py): quantize_per_block, gemm_w8a8 and the layer, with tessera-bench's memcpy / cuBLASLt peers.
merge.FAMILIES.update({op: ("w8a8", w8a8) for op in w8a8.MERGED_OPS})
merge.BENCH_OPS["w8a8"] = list(w8a8.BENCH_OPS)
merge.CPP_PEER_LABELS.update(w8a8.CPP_PEER_LABELS)
merge.TITLES["w8a8"] = w8a8.TITLE
# conv2d (peers/conv.py): tessera-bench's conv2d rows against cuDNN bf16 channels-last (no C++ peer).
merge.FAMILIES.update({op: ("conv", conv) for op in conv.MERGED_OPS})
merge.BENCH_OPS["conv"] = list(conv.BENCH_OPS)
merge.CPP_PEER_LABELS.update(conv.CPP_PEER_LABELS)
merge.TITLES["conv"] = conv.TITLE
# The MoE layer (peers/moe_layer.py): tessera-bench's moe_layer rows against tessera's ops composed with torch glue, a
# torch eager layer and torch.compile of it (no C++ peer).
merge.FAMILIES.update({op: ("moe_layer", moe_layer) for op in moe_layer.MERGED_OPS})
merge.BENCH_OPS["moe_layer"] = list(moe_layer.BENCH_OPS)
merge.CPP_PEER_LABELS.update(moe_layer.CPP_PEER_LABELS)
merge.TITLES["moe_layer"] = moe_layer.TITLE

OPS = ("gate", "permute", "unpermute", "gemm", "decode", "linear", "w8a8", "conv", "moe_layer")


def standalone_cases(args):
    """(family key -> [Case]) from the registries mirrored from tessera-bench, filtered by the options."""
    makers = dict(gate=lambda: gate.cases_from_args(args),
                  permute=lambda: permute.cases_from_args(args, permute.PERMUTE),
                  unpermute=lambda: permute.cases_from_args(args, permute.UNPERMUTE),
                  gemm=lambda: gemm.cases_from_args(args),
                  decode=lambda: decode.cases_from_args(args),
                  linear=lambda: linear.cases_from_args(args),
                  w8a8=lambda: w8a8.cases_from_args(args),
                  conv=lambda: conv.cases_from_args(args),
                  moe_layer=lambda: moe_layer.cases_from_args(args))
    return {op: makers[op]() for op in args.ops_list}


def run_families(cases_by_family, args):
    modules = dict(gate=gate, permute=permute, unpermute=permute, gemm=gemm, decode=decode, linear=linear, w8a8=w8a8,
                   conv=conv, moe_layer=moe_layer)
    results = {}
    for key, cases in cases_by_family.items():
        if not cases:
            continue
        print(f"[{key}] {len(cases)} case(s) ...", file=sys.stderr, flush=True)
        try:
            results[key] = modules[key].rows(cases, args)
        except Exception as e:  # noqa: BLE001 - a broken family must not hide the others
            r = C.Row(key, "-")
            r.errors += [C.short(e), traceback.format_exc().strip().splitlines()[-1]]
            results[key] = [r]
    return results


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--with-bench", metavar="TESSERA_BENCH", help="run this tessera-bench binary with --json first "
                    "and merge its rows (and its C++ peers) with the Python peers' on the same case names")
    ap.add_argument("--bench-json", metavar="PATH", help="merge an existing tessera-bench --json output instead of "
                    "running tessera-bench")
    ap.add_argument("--all", action="store_true", help="with --with-bench: every case, not tessera-bench's headline "
                    "subset (passed on as --all where tessera-bench has it); standalone moe_layer: every case, not "
                    "tessera-bench's headline six")
    ap.add_argument("--save-bench-json", metavar="PATH", help="with --with-bench: keep tessera-bench's --json output "
                    "there (for bench/plot.py --bench-json)")
    ap.add_argument("--bench-args", default="", help="more arguments for tessera-bench, with '=': --bench-args='--quick --case dsv3'")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--list", action="store_true", help="list the cases a standalone run would measure and exit")
    ap.add_argument("--ops", default=",".join(OPS), help="comma list of " + ",".join(OPS))
    ap.add_argument("--gate-tokens", default="", help="gate: only these T (comma list); default all")
    ap.add_argument("--tokens", type=int, default=0, help="permute / unpermute: only this T; default all")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions (median)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    ap.add_argument("--compile", action="store_true", help="gate, moe_layer: also torch.compile the torch peer "
                    "(10-60 s a case)")
    ap.add_argument("--no-compile", action="store_true", help=argparse.SUPPRESS)  # the old default; now the default
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer peers")
    ap.add_argument("--gemm-cases", default="", help="gemm: only shapes whose name contains one of these "
                    "comma-separated substrings (dsv3_gate_up/m8, qwen3, skewed, ...); default all")
    ap.add_argument("--gemm-kinds", default=",".join(gemm.KINDS), help="gemm: comma list of " + ",".join(gemm.KINDS))
    ap.add_argument("--gemm-peers", default="torch", help="gemm: comma list of torch,flashinfer (flashinfer: "
                    "SegmentGEMMWrapper on the bf16 cases; its first call JIT-builds CUTLASS grouped GEMMs, minutes)")
    ap.add_argument("--fast-accum", action="store_true",
                    help="gemm: torch._scaled_grouped_mm with use_fast_accum=True (default False)")
    ap.add_argument("--decode-cases", default="", help="decode: only cases whose name contains one of these "
                    "comma-separated substrings (hq8kv1/B128, llama3_8b, paged16, zipf, T131072, ...); default all")
    ap.add_argument("--decode-formats", default=",".join(decode.FORMATS),
                    help="decode: comma list of " + ",".join(decode.FORMATS) + " (a case runs those of its own)")
    ap.add_argument("--decode-peers", default=",".join(decode.DEFAULT_PEERS), help="decode: comma list of " +
                    ",".join(decode.PEERS) + " (default: all but flashinfer_cudnn)")
    ap.add_argument("--linear-cases", default="", help="linear: only cases whose name contains one of these "
                    "comma-separated substrings (gate_up, /M1/, int8_g128, ...); default all (the ceiling row stays)")
    ap.add_argument("--linear-peers", default=",".join(linear.PEERS), help="linear: comma list of " +
                    ",".join(linear.PEERS))
    ap.add_argument("--w8a8-cases", default="", help="w8a8: only cases whose name contains one of these "
                    "comma-separated substrings (M4096_K4096, /M16/, g128, per_channel, ...); default all")
    ap.add_argument("--w8a8-peers", default=",".join(w8a8.PEERS), help="w8a8: comma list of " + ",".join(w8a8.PEERS)
                    + " (torch: torch._int_mm, torch.matmul bf16, the quantizer in torch ops)")
    ap.add_argument("--w8a8-peak-tops", type=float, default=w8a8.PEAK_TOPS, help="w8a8: the dense int8 peak the "
                    "compute-bound rows' %% ceil divides by (default %(default)s: H100 / H200 SXM)")
    ap.add_argument("--conv-cases", default="", help="conv: only cases whose name contains one of these "
                    "comma-separated substrings (B8_C512, /int8_, nchw, direct, ...); default all")
    ap.add_argument("--conv-peers", default=",".join(conv.PEERS), help="conv: comma list of " + ",".join(conv.PEERS)
                    + " (cudnn: torch.nn.functional.conv2d bf16 channels-last, cudnn.benchmark on)")
    ap.add_argument("--moe-layer-cases", default="", help="moe_layer: only cases whose name contains one of these "
                    "comma-separated substrings (dsv3/, /T4096/, fp8_per_tensor, ...); a standalone run then picks "
                    "among every case (else tessera-bench's headline six)")
    ap.add_argument("--moe-layer-peers", default=",".join(moe_layer.DEFAULT_PEERS), help="moe_layer: comma list of "
                    + ",".join(moe_layer.PEERS) + " (composed: tessera's ops with torch glue; torch: the torch eager "
                    "layer; compile: torch.compile of it, ~20-60 s of compilation a case, also added by --compile); "
                    "default %(default)s")
    ap.add_argument("--moe-layer-fp8-peak", type=float, default=moe_layer.FP8_PEAK_TFLOPS, help="moe_layer: the dense "
                    "fp8 TFLOP/s %% ceil divides by where this run measured no fp8 ceiling (default %(default)s)")
    ap.add_argument("--moe-layer-bf16-peak", type=float, default=moe_layer.BF16_PEAK_TFLOPS, help="moe_layer: the "
                    "same for bf16 (default %(default)s)")
    args = ap.parse_args(argv)
    args.ops_list = [o.strip() for o in args.ops.split(",") if o.strip()]
    for op in args.ops_list:
        if op not in OPS:
            ap.error(f"unknown op {op!r} (expected {', '.join(OPS)})")
    for k in args.gemm_kinds.split(","):
        if k and k not in gemm.KINDS:
            ap.error(f"unknown --gemm-kinds item {k!r} (expected {', '.join(gemm.KINDS)})")
    for f in args.decode_formats.split(","):
        if f and f not in decode.FORMATS:
            ap.error(f"unknown --decode-formats item {f!r} (expected {', '.join(decode.FORMATS)})")
    for p in args.gemm_peers.split(","):
        if p and p not in ("torch", "flashinfer"):
            ap.error(f"unknown --gemm-peers item {p!r} (expected torch, flashinfer)")
    for p in args.decode_peers.split(","):
        if p and p not in decode.PEERS:
            ap.error(f"unknown --decode-peers item {p!r} (expected {', '.join(decode.PEERS)})")
    for p in args.linear_peers.split(","):
        if p and p not in linear.PEERS:
            ap.error(f"unknown --linear-peers item {p!r} (expected {', '.join(linear.PEERS)})")
    for p in args.w8a8_peers.split(","):
        if p and p not in w8a8.PEERS:
            ap.error(f"unknown --w8a8-peers item {p!r} (expected {', '.join(w8a8.PEERS)})")
    for p in args.conv_peers.split(","):
        if p and p not in conv.PEERS:
            ap.error(f"unknown --conv-peers item {p!r} (expected {', '.join(conv.PEERS)})")
    for p in args.moe_layer_peers.split(","):
        if p and p not in moe_layer.PEERS:
            ap.error(f"unknown --moe-layer-peers item {p!r} (expected {', '.join(moe_layer.PEERS)})")
    if args.moe_layer_fp8_peak <= 0 or args.moe_layer_bf16_peak <= 0:
        ap.error("--moe-layer-fp8-peak and --moe-layer-bf16-peak must be positive")
    if args.w8a8_peak_tops <= 0:
        ap.error("--w8a8-peak-tops must be positive")
    if args.with_bench and args.bench_json:
        ap.error("--with-bench and --bench-json exclude each other")
    return args


def header():
    h = dict(tool="bench/compare.py", device=None, torch=C.torch.__version__, cuda=C.torch.version.cuda,
             tessera=getattr(C.tessera, "version", None), tessera_error=C.TESSERA_IMPORT_ERROR, compare_device=C.DEVICE)
    if C.ON_GPU:
        h["device"] = C.torch.cuda.get_device_properties(C.torch.cuda.current_device()).name
        h["l2_bytes"] = C.l2_bytes()
    print(f"device: {h['device'] or C.DEVICE} | torch {h['torch']} (CUDA {h['cuda']}) | tessera "
          f"{h['tessera'] or 'unavailable'}")
    if C.TESSERA_IMPORT_ERROR:
        print(f"  {C.TESSERA_IMPORT_ERROR}")
    return h


def print_results(results, copy_bps, args=None):
    order = ("gate", "permute", "unpermute", "gemm", "decode", "linear", "w8a8", "conv", "moe_layer", "other")
    C.print_legend(any(r.bench is not None for rows in results.values() for r in rows))
    for key in order:
        if key == "linear" and key in results:
            linear.print_family(results[key], copy_bps)
        elif key == "w8a8" and key in results:
            w8a8.print_family(results[key], copy_bps, getattr(args, "w8a8_peak_tops", w8a8.PEAK_TOPS))
        elif key == "conv" and key in results:
            conv.print_family(results[key], copy_bps)
        elif key == "moe_layer" and key in results:
            moe_layer.print_family(results[key], copy_bps, args)
        elif key in results:
            metric = "tflops" if key == "gemm" else "gbps"
            C.print_family(merge.TITLES[key], results[key], copy_bps, metric)
    for note in C.NOTES:
        print(f"note: {note}")
    missing = [(name, why) for name, (mod, why) in C._OPTIONAL.items() if mod is None]
    for name, why in missing:
        print(f"peer skipped, not installed: {why}")
    present = [f"{name} {getattr(mod, '__version__', '?')}" for name, (mod, _) in C._OPTIONAL.items() if mod]
    if present:
        print(f"peer libraries: {', '.join(present)}")
    return missing


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        for key, cases in standalone_cases(args).items():
            for c in cases:
                print(f"{key:10s} {c.op:26s} {c.name}")
        return 0
    if C.torch is None:
        print(f"bench/compare.py: {C.TORCH_IMPORT_ERROR}", file=sys.stderr)
        return 2
    if C.ON_GPU and not C.torch.cuda.is_available():
        print("bench/compare.py: no CUDA device", file=sys.stderr)
        return 2

    bench = None
    args.graph_first = bool(args.with_bench or args.bench_json)  # merged tables show graph times only
    if args.with_bench or args.bench_json:
        if args.with_bench:
            try:
                bench = merge.run_bench(args.with_bench, args, all_ops=args.ops == ",".join(OPS))
            except RuntimeError as e:
                print(f"bench/compare.py: {e}", file=sys.stderr)
                return 2
        else:
            with open(args.bench_json) as f:
                bench = json.load(f)
    C.torch.manual_seed(0)
    h = header()
    copy_bps = None
    if bench is None:
        copy_bps, copy_bytes = C.copy_bandwidth()
        h["copy_bw_gbps"] = copy_bps and copy_bps / 1e9
        if copy_bps:
            print(f"copy bandwidth: {copy_bps / 1e9:.1f} GB/s (device-to-device copy of {copy_bytes >> 20} MiB, "
                  "read + write)")
        cases = standalone_cases(args)
    else:
        dev = bench.get("device", {})
        print(f"tessera-bench: {dev.get('name')}, copy {dev.get('copy_bw_gbps') or 0:.0f} GB/s, read "
              f"{dev.get('read_bw_gbps') or 0:.0f} GB/s, {len(bench.get('rows', []))} rows"
              + ("" if bench.get("has_headline_subset", True) else
                 " (this tessera-bench has no headline subset: every case of the chosen ops)"))
        cases = merge.cases_of(bench, args)
    print()
    note = fi_jit.prebuild(cases, args)
    if note:
        C.NOTES.append(note)
    results = run_families(cases, args)
    if bench is not None:
        results = merge.merge(bench, results, args.ops_list)
    missing = print_results(results, copy_bps, args)
    if args.json:
        doc = dict(h, rows=[r.as_dict() for key in results for r in results[key]],
                   peers_missing={name: why for name, why in missing}, notes=C.NOTES)
        if bench is not None:
            doc["bench"] = {k: bench.get(k) for k in ("device", "settings", "command", "exit_code")}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
