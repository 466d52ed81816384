#!/usr/bin/env python3
"""Peers of tessera-bench's prefill rows (issue 17), timed in one process: torch SDPA with the cuDNN and the flash
backends (enable_gqa), plus a cuBLAS bf16 GEMM (torch.matmul 8192³) as the measured tensor-core ceiling. Until the
prefill op is in tessera's Python layer (and in bench/compare.py), this script gives the peer columns of
docs/perf/prefill.md; tessera's own rows come from `tessera-bench --op prefill` in the same GPU session.

Shapes and FLOP counts are tessera-bench's (bench/prefill_cases.cpp): q/k/v bf16 normals, Sq = Sk, causal counted
as the pairs on or below the diagonal. The zipf case runs one SDPA call per sequence (what a user without a varlen
kernel does). Graph-mode medians (bench/peers/common.py: calls captured into one CUDA graph, median of replays).

    python3 bench/prefill_peers.py [--json PATH]
"""

import argparse
import json
import sys

from peers import common as C


def zipf_lengths():
    harmonic = sum(1.0 / r for r in range(1, 33))
    lengths = [int(65536.0 / (r * harmonic)) for r in range(1, 33)]
    lengths[0] += 65536 - sum(lengths)
    return lengths  # the order does not matter to a per-sequence loop


CASES = [  # name, HQ, HKV, D, causal, lengths
    ("hq32kv8/B1/S16384/causal", 32, 8, 128, True, [16384]),
    ("hq32kv8/B1/S4096/causal", 32, 8, 128, True, [4096]),
    ("hq32kv8/B8/S2048", 32, 8, 128, False, [2048] * 8),
    ("hq16kv2_d64/B4/S8192/causal", 16, 2, 64, True, [8192] * 4),
    ("hq16kv2_d256/B4/S8192/causal", 16, 2, 256, True, [8192] * 4),
    ("hq32kv8/zipf32/T65536/causal", 32, 8, 128, True, zipf_lengths()),
]


def flops(hq, d, causal, lengths):
    pairs = sum(0.5 * n * (n + 1) if causal else float(n) * n for n in lengths)
    return 4.0 * hq * d * pairs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows as JSON")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch = C.torch
    if torch is None or not torch.cuda.is_available():
        print("prefill_peers: needs torch with a CUDA device", file=sys.stderr)
        return 2
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(a)
    t = C.time_graph(lambda: torch.matmul(a, b, out=out), 5, args.reps, 3)
    ceiling = 2.0 * 8192 ** 3 / (t * 1e-6) / 1e12
    print(f"cuBLAS bf16 8192^3: {t:.1f} us, {ceiling:.0f} TFLOP/s (the measured ceiling)")
    rows.append({"case": "gemm_bf16_8192", "peer": "cublas", "us": t, "tflops": ceiling})
    del a, b, out

    print(f"{'case':34s} {'peer':6s} {'us':>10s} {'TFLOP/s':>8s} {'% ceil':>7s}")
    for name, hq, hkv, d, causal, lengths in CASES:
        fl = flops(hq, d, causal, lengths)
        seqs = [(torch.randn(1, hq, n, d, dtype=torch.bfloat16, device="cuda"),
                 torch.randn(1, hkv, n, d, dtype=torch.bfloat16, device="cuda"),
                 torch.randn(1, hkv, n, d, dtype=torch.bfloat16, device="cuda")) for n in lengths]
        if len(set(lengths)) == 1 and len(lengths) > 1:  # equal lengths: one batched call
            seqs = [tuple(torch.cat(x, dim=0) for x in zip(*seqs))]
        for peer, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def call():
                with sdpa_kernel(backend):
                    for q, k, v in seqs:
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            us, err = C.measure(call, "graph", 2, args.reps, 2)
            if us is None:
                print(f"{name:34s} {peer:6s} {'-':>10s}  ({err})")
                rows.append({"case": name, "peer": peer, "error": err})
                continue
            tf = fl / (us * 1e-6) / 1e12
            print(f"{name:34s} {peer:6s} {us:10.1f} {tf:8.0f} {100 * tf / ceiling:6.1f}%")
            rows.append({"case": name, "peer": peer, "us": us, "tflops": tf})
        del seqs
        C.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
