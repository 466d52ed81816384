#!/usr/bin/env python3
"""Decode time against the split count at small batches (issue 16, part 2: where the fixed cost goes).

    PYTHONPATH=build/python python3 bench/decode_split_sweep.py [--json PATH]

For hq8kv1 (HQ 8, HKV 1, D 128, T 8192, full lengths) at B in {1, 8, 32} and Llama-3-8B (HQ 32, HKV 8, T 4096) at
B 1, per format (bf16, int8, int4): CUDA-graph replays of 20 back-to-back decode calls, median over 15 replays, µs
per call, for the split counts 1, 2, 4, ..., 128 (capped by the capacity) and for the heuristic's own choice
(num_splits=0, printed as "auto"). The cache holds random codes and scales (the time does not depend on values).
"""

import argparse
import json

import torch

import tessera
from peers.common import time_graph  # compare.py's graph timing (bench/peers/common.py)


def make_cache(fmt, B, T, HKV, D, gen):
    dev = "cuda"
    if fmt == "native":
        k = torch.randn((B, T, HKV, D), device=dev, generator=gen).bfloat16()
        return dict(k=k, v=k.clone(), kw=dict(format="native"))
    row = D if fmt == "int8" else D // 2
    k = torch.randint(0, 256, (B, T, HKV, row), dtype=torch.uint8, device=dev, generator=gen)
    s = (torch.rand((B, T, HKV, 2), device=dev, generator=gen) * 0.05).half()
    return dict(k=k, v=k.clone(), kw=dict(format=fmt, k_scale=s, v_scale=s.clone()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(7)
    shapes = [("hq8kv1", B, 8, 1, 8192) for B in (1, 8, 32)] + [("llama3_8b", 1, 32, 8, 4096)]
    rows = []
    for name, B, HQ, HKV, T in shapes:
        D = 128
        for fmt in ("native", "int8", "int4"):
            c = make_cache(fmt, B, T, HKV, D, gen)
            q = torch.randn((B, HQ, D), device="cuda", generator=gen).bfloat16()
            lengths = torch.full((B,), T, dtype=torch.int32, device="cuda")
            o = torch.empty_like(q)
            res = {}
            for splits in [0, 1, 2, 4, 8, 16, 32, 64, 128]:
                if splits > T // 64:
                    continue
                nbytes = tessera.decode_workspace_size(q, c["k"], c["v"], num_splits=splits, **c["kw"])
                ws = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")

                def call(splits=splits, ws=ws):
                    tessera.attention_decode(q, c["k"], c["v"], lengths, num_splits=splits, out=o, workspace=ws,
                                             **c["kw"])

                try:
                    us = time_graph(call, calls=20, reps=15, warmup=2)
                    res["auto" if splits == 0 else str(splits)] = round(us, 2)
                except (ValueError, RuntimeError) as e:  # a split count the shape does not allow
                    print(f"  {name}/B{B}/{fmt} splits {splits}: {e}", flush=True)
            best = min((v, k) for k, v in res.items() if k != "auto")
            rows.append(dict(case=f"{name}/B{B}/T{T}/{fmt}", us=res, best=best[1]))
            print(f"{name}/B{B}/T{T}/{fmt:7s} auto {res['auto']:7.2f} us | best {best[0]:7.2f} us at {best[1]:>3s} "
                  f"splits | " + " ".join(f"{k}:{v}" for k, v in res.items() if k != "auto"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
