#!/usr/bin/env python3
"""Host time per eager call of each tessera op from Python (what the CPU spends before the GPU sees the work).

    PYTHONPATH=build/python python3 bench/host_overhead.py [--calls 200] [--reps 7] [--json PATH]

Method: the stream is first held busy by torch.cuda._sleep (longer than the timed loop), then `calls` calls are
issued back to back and timed with the host clock; no call waits for the GPU, so the time per call is the host
cost alone (argument checks, allocation of outputs, the operator dispatch and the kernel launches). Median over
`reps` rounds. An op of n launches runs at most 480 / n calls a round: the driver queues ~1,000 pending launches,
and a launch past that waits for the sleeping GPU (a 200-call round of the MoE layer's 8 launches read 261 us a
call that way). "above" = the call minus n bare launches, timed in a round just before each of the op's rounds
(median of the per-round differences); "paired" = the median over every call of that call's time minus the n bare
launches issued right after it (each timed alone: a host that drifts between rounds moves both alike). Shapes are
small (the cost does not depend on them). Each op is measured with its outputs given (out=, workspace=: nothing
allocated) and, where it can allocate, without. For reference the same decode call through the DLPack entry point
(tessera.dlpack, one capsule per tensor) and a bare torch op (torch.add with out=) are measured in the same run.
"""

import argparse
import json
import statistics
import time

import torch
import torch.utils.dlpack

import tessera
import tessera.dlpack as td


def _busy(seconds):
    # ~1.7 GHz: cycles for `seconds` of GPU time on an H100/H200 (only needs to outlast the loop).
    torch.cuda._sleep(int(seconds * 2.0e9))


def _round_us(fn, calls):
    """One round: the stream held busy, `calls` calls timed with the host clock; us per call."""
    _busy(0.05)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def _bare_launch():
    torch.cuda._sleep(1)


def _paired_round(fn, launches, calls):
    """One round of pairs: the stream held busy, then `calls` times: one call of fn timed alone, then `launches` bare
    launches timed together; the differences (us), one per pair. Neighbouring pairs share the host's state, so a
    drift between rounds or passes moves both sides of each difference alike."""
    _busy(0.05)
    clock = time.perf_counter_ns
    diffs = []
    for _ in range(calls):
        t0 = clock()
        fn()
        t1 = clock()
        for _ in range(launches):
            _bare_launch()
        t2 = clock()
        diffs.append(((t1 - t0) - (t2 - t1)) / 1e3)
    torch.cuda.synchronize()
    return diffs


def host_us(fn, calls, reps, launches=None):
    """(median us per call, median us above its launches or None, paired us above its launches or None). With
    `launches`, each round of fn follows a round of as many bare launches (calls x launches), and "above" is the median
    over the rounds of fn's time minus `launches` bare launches of the round just before. "paired" is the median over
    every call of `reps` rounds of pairs (_paired_round: each call against the bare launches right after it): the
    rounds' figures moved by 2-4 us between passes of one call on the H200 machines here (a host shared with others),
    far more than the differences they were meant to show; a pair spans microseconds, not milliseconds."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples, above, pairs = [], [], []
    for _ in range(reps):
        if launches:  # at most 480 launches a round, as for the ops (the driver's queue, see the top)
            bare = _round_us(_bare_launch, min(calls * launches, 480)) * launches
        samples.append(_round_us(fn, calls))
        if launches:
            above.append(samples[-1] - bare)
            pairs += _paired_round(fn, launches, max(1, min(calls, 480 // (2 * launches))))
    if not launches:
        return statistics.median(samples), None, None
    return statistics.median(samples), statistics.median(above), statistics.median(pairs)


def cases():
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    T, E, H, N, k = 64, 256, 1024, 512, 8
    logits = torch.randn((T, E), device=dev, generator=g)
    bias = torch.randn((E,), device=dev, generator=g) * 0.1
    weights = torch.empty((T, k), device=dev)
    ids = torch.empty((T, k), dtype=torch.int32, device=dev)
    gate_kw = dict(topk=k, num_groups=8, topk_groups=4, renormalize=True, routed_scaling_factor=2.5)
    tessera.fused_gate(logits, bias, out=(weights, ids), **gate_kw)

    x = torch.randn((T, H), device=dev, generator=g).bfloat16()
    p = tessera.permute(x, ids, E, quant="fp8_blockwise")
    p_out = tessera.PermuteResult(*(t.clone() if t is not None else None for t in p))
    p_ws = torch.empty(max(1, tessera.permute_workspace_bytes(T, k, E, quant="fp8_blockwise")), dtype=torch.uint8,
                       device=dev)
    w = torch.randn((E, N, H), device=dev, generator=g).to(torch.float8_e4m3fn)
    w_scale = torch.rand((E, N // 128, H // 128), device=dev, generator=g) * 0.01
    y = tessera.grouped_gemm_fp8(p.x_perm, w, p.expert_offsets, p.scales, w_scale, scale_mode="blockwise")
    red = torch.empty((T, N), dtype=torch.bfloat16, device=dev)

    B, HQ, HKV, D, cap = 8, 32, 8, 128, 1024
    q = torch.randn((B, HQ, D), device=dev, generator=g).bfloat16()
    kc = torch.randint(0, 256, (B, cap, HKV, D), dtype=torch.uint8, device=dev, generator=g)
    vc = kc.clone()
    ks = (torch.rand((B, cap, HKV, 2), device=dev, generator=g) * 0.05).half()
    vs = ks.clone()
    lengths = torch.full((B,), 700, dtype=torch.int32, device=dev)
    kv = dict(format="int8", k_scale=ks, v_scale=vs)
    o = torch.empty_like(q)
    lse = torch.empty((B, HQ), device=dev)
    ws = torch.empty(max(1, tessera.decode_workspace_size(q, kc, vc, num_splits=4, **kv)), dtype=torch.uint8,
                     device=dev)
    k_new = torch.randn((B, 1, HKV, D), device=dev, generator=g).bfloat16()
    pos = lengths - 1
    o_dl = torch.empty_like(q)

    def decode_dlpack():
        td.attention_decode(q, kc, vc, ks, vs, None, lengths, o_dl, lse, ws, "int8", 0.0, 0.0, 0, 4,
                            torch.cuda.current_stream().cuda_stream)

    # A model's layers in turn: 48 caches shaped like the row above (each layer its own K, V and scales, as in an
    # engine), one decode call per layer. Every call brings tensor maps of another cache: the memo of encoded maps
    # must hold a whole cycle of layers to hit.
    layers = 48
    layer_caches = []
    for _ in range(layers):
        k_l = torch.randint(0, 256, (B, cap, HKV, D), dtype=torch.uint8, device=dev, generator=g)
        s_l = (torch.rand((B, cap, HKV, 2), device=dev, generator=g) * 0.05).half()
        layer_caches.append((k_l, k_l.clone(), s_l, s_l.clone()))
    turn = [0]

    def decode_next_layer():
        kc_l, vc_l, ks_l, vs_l = layer_caches[turn[0] % layers]
        turn[0] += 1
        tessera.attention_decode(q, kc_l, vc_l, lengths, format="int8", k_scale=ks_l, v_scale=vs_l, out=o, lse=lse,
                                 workspace=ws, num_splits=4)

    a = torch.randn((64,), device=dev)
    b = torch.empty_like(a)
    raw = torch.ops.tessera
    gate_args = (logits, bias, weights, ids, k, 8, 4, "sigmoid", "top2_sum", True, 2.5, 0, 1.0)
    dec_args = (q, kc, vc, ks, vs, None, lengths, o, lse, ws, "int8", 0.0, 0.0, 0, 4)
    rows = [
        ("torch.add (out=), for scale", "given", lambda: torch.add(a, a, out=b), 1),
        ("torch.empty((64,)), for scale", "-", lambda: torch.empty((64,), device=dev), None),
        ("torch.cuda._sleep(1): a bare launch, for scale", "-", lambda: torch.cuda._sleep(1), 1),
        ("torch.ops.tessera.fused_gate.default", "given", lambda: raw.fused_gate.default(*gate_args), 1),
        ("tessera._torch_C.fused_gate (direct)", "given", lambda: tessera._torch_C.fused_gate(*gate_args), 1),
        ("tessera._torch_C.attention_decode (direct)", "given",
         lambda: tessera._torch_C.attention_decode(*dec_args), 2),
        ("tessera._torch_C.permute (direct)", "given",
         lambda: tessera._torch_C.permute(x, ids, None, *p_out, p_ws, E, 1, "fp8_blockwise"), 3),
        ("tessera._torch_C.grouped_gemm_fp8 (direct)", "given",
         lambda: tessera._torch_C.grouped_gemm_fp8(p.x_perm, w, p.expert_offsets, p.scales, w_scale, y, None,
                                                   "blockwise", 0), 1),
        ("tessera._torch_C.unpermute_reduce (direct)", "given",
         lambda: tessera._torch_C.unpermute_reduce(y, p.row_index, weights, None, red, 1.0), 1),
        ("tessera._torch_C.append_kv (direct)", "given",
         lambda: tessera._torch_C.append_kv(k_new, k_new, pos, kc, vc, ks, vs, None, "int8"), 1),
        ("torch.ops.tessera.attention_decode.default", "given", lambda: raw.attention_decode.default(*dec_args), 2),
    ]
    caps = [torch.utils.dlpack.to_dlpack(t) for t in (logits, bias, weights, ids)]
    rows.append(("tessera._C.fused_gate, capsules made once", "given",
                 lambda: tessera._C.fused_gate(caps[0], caps[1], caps[2], caps[3], k, 8, 4, "sigmoid", "top2_sum",
                                               True, 2.5, 0, 1.0, 0), 1))
    try:
        import cupy

        ptr = q.data_ptr()
        rows.append(("cudaPointerGetAttributes (cupy), for scale", "-",
                     lambda: cupy.cuda.runtime.pointerGetAttributes(ptr), None))
        rows.append(("cudaGetDevice (cupy), for scale", "-", lambda: cupy.cuda.runtime.getDevice(), None))
    except ImportError:
        pass
    return rows + [
        ("fused_gate", "given", lambda: tessera.fused_gate(logits, bias, out=(weights, ids), **gate_kw), 1),
        ("fused_gate", "allocating", lambda: tessera.fused_gate(logits, bias, **gate_kw), 1),
        ("permute fp8_blockwise", "given",
         lambda: tessera.permute(x, ids, E, quant="fp8_blockwise", out=p_out, workspace=p_ws), 3),
        ("permute fp8_blockwise", "allocating", lambda: tessera.permute(x, ids, E, quant="fp8_blockwise"), 3),
        ("grouped_gemm_fp8 blockwise", "given",
         lambda: tessera.grouped_gemm_fp8(p.x_perm, w, p.expert_offsets, p.scales, w_scale, scale_mode="blockwise",
                                          out=y), 1),
        ("grouped_gemm_fp8 blockwise", "allocating",
         lambda: tessera.grouped_gemm_fp8(p.x_perm, w, p.expert_offsets, p.scales, w_scale,
                                          scale_mode="blockwise"), 1),
        ("unpermute_reduce", "given", lambda: tessera.unpermute_reduce(y, p.row_index, weights, out=red), 1),
        ("unpermute_reduce", "allocating", lambda: tessera.unpermute_reduce(y, p.row_index, weights), 1),
        ("attention_decode int8 (4 splits)", "given",
         lambda: tessera.attention_decode(q, kc, vc, lengths, out=o, lse=lse, workspace=ws, num_splits=4, **kv), 2),
        ("attention_decode int8 (4 splits)", "allocating",
         lambda: tessera.attention_decode(q, kc, vc, lengths, num_splits=4, **kv), 2),
        ("attention_decode int8, tessera.dlpack", "given", decode_dlpack, 2),
        ("attention_decode int8, 48 layers in turn", "given", decode_next_layer, 2),
        ("append_kv int8", "given", lambda: tessera.append_kv(k_new, k_new, pos, kc, vc, **kv), 1),
    ]


def later_ops():
    """Rows of the op families added after the closing table of docs/perf/host_overhead.md (prefill, the weight-only
    linear layer, W8A8, conv2d, the MoE layer), outputs and workspaces given. Each family is set up on its own: one
    whose setup fails is reported as such and the others still run."""
    dev = "cuda"
    g = torch.Generator(device="cpu").manual_seed(2)
    rows, failed = [], []
    # (label, outputs, fn, kernel launches per call: the configurations select_config picks for these shapes, e.g.
    # the linear layer at M 1 and gemm_w8a8 at M 16 split K four ways, a GEMM and a reduce; None: not counted)

    def family(name, make):
        try:
            rows.extend(make())
        except Exception as e:  # noqa: BLE001 - a measurement script: report and go on
            failed.append(f"{name}: {type(e).__name__}: {e}")

    def prefill():
        q = torch.randn((2, 128, 32, 128), generator=g).bfloat16().to(dev)
        k = torch.randn((2, 128, 8, 128), generator=g).bfloat16().to(dev)
        o = torch.empty_like(q)
        return [("prefill bf16 causal (B 2, S 128, GQA 4)", "given",
                 lambda: tessera.prefill(q, k, k, causal=True, out=o), 1)]

    def linear():
        tl = tessera.linear
        w = tl.prepack(tl.quantize(torch.randn((4096, 4096), generator=g) * 0.02, bits=4, block=128)).cuda()
        x = torch.randn((1, 4096), generator=g).bfloat16().to(dev)
        y = torch.empty((1, 4096), dtype=torch.bfloat16, device=dev)
        ws = torch.empty((max(1, tl.workspace_bytes(1, w)),), dtype=torch.uint8, device=dev)
        return [("linear int4 g128 (M 1, N = K = 4096)", "given", lambda: tl.linear(x, w, out=y, workspace=ws), 2)]

    def w8a8():
        tw = tessera.w8a8
        w = tw.prepack_w8a8(torch.randn((4096, 4096), generator=g) * 0.02, block=128).cuda()
        x = torch.randn((16, 4096), generator=g).bfloat16().to(dev)
        a = tw.quantize_per_block(x, 128)
        y = torch.empty((16, 4096), dtype=torch.bfloat16, device=dev)
        ws = torch.empty((max(1, tw.workspace_bytes(16, w)),), dtype=torch.uint8, device=dev)
        direct = (a, w, None, y, ws, float("-inf"), float("inf"), 1.0, "bfloat16")
        a_out = tw.quantize_per_block(x, 128)
        return [("quantize_per_block g128 (M 16)", "given", lambda: tw.quantize_per_block(x, 128, out=a_out), 1),
                ("quantize_per_block g128 (M 16)", "allocating", lambda: tw.quantize_per_block(x, 128), 1),
                ("gemm_w8a8 g128 (M 16, N = K = 4096)", "given", lambda: tw.gemm_w8a8(a, w, out=y, workspace=ws), 2),
                ("tessera._torch_C.gemm_w8a8_eager (direct)", "given",
                 lambda: tessera._torch_C.gemm_w8a8_eager(*direct), 2)]

    def conv():
        tc = tessera.conv
        w = tc.quantize_weight(torch.randn((256, 256, 3, 3), generator=g) * 0.02, bits=4, block=64).cuda()
        x = torch.randn((1, 256, 56, 56), generator=g).bfloat16().to(dev).contiguous(
            memory_format=torch.channels_last)
        y = torch.empty_like(x)
        ws = torch.empty((max(1, tc.workspace_bytes(x, w, padding=1, out=y)),), dtype=torch.uint8, device=dev)
        return [("conv2d int4 3x3 (B 1, C 256, 56^2)", "given",
                 lambda: tc.conv2d(x, w, padding=1, out=y, workspace=ws), None)]

    def moe_layer():
        ml = tessera.moe_layer
        cfg = ml.MoeLayerConfig(hidden=1024, intermediate=512, num_experts=64, topk=6, num_groups=1, topk_groups=1,
                                scoring="softmax", renormalize=True, format="fp8_blockwise")
        w = ml.quantize_weights(torch.randn((64, 1024, 1024), generator=g) * 0.02,
                                torch.randn((64, 1024, 512), generator=g) * 0.02, "fp8_blockwise").cuda()
        plan = ml.plan(cfg, 16)
        x = torch.randn((16, 1024), generator=g).bfloat16().to(dev)
        logits = torch.randn((16, 64), generator=g).to(dev)
        y = torch.empty_like(x)
        ws = torch.empty((max(16, plan.workspace_bytes),), dtype=torch.uint8, device=dev)
        return [("moe_layer fp8 block-wise (T 16)", "given",
                 lambda: ml.moe_layer(x, logits, w, plan, out=y, workspace=ws), 6)]

    for name, make in (("prefill", prefill), ("linear", linear), ("w8a8", w8a8), ("conv2d", conv),
                       ("moe_layer", moe_layer)):
        family(name, make)
    return rows, failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    later, failed = later_ops()
    # Each row: (label, outputs, fn, kernel launches per call or None). cases()' shapes fix them: permute's T 64 x k 8
    # = 512 copies take the three-pass path, decode's 4 splits the split kernel and the merge.
    for name, outputs, fn, launches in cases() + later:
        calls = args.calls if not launches else max(20, min(args.calls, 480 // launches))
        bare_row = name.startswith("torch.cuda._sleep")
        us, above, paired = host_us(fn, calls, args.reps, None if bare_row else launches)
        rows.append(dict(op=name, outputs=outputs, host_us=round(us, 2), launches=launches, calls=calls,
                         above_launches_us=None if above is None else round(above, 2),
                         paired_above_launches_us=None if paired is None else round(paired, 2)))
    gpu = torch.cuda.get_device_name()
    print(f"host time per eager call ({gpu}, torch {torch.__version__}, median of {args.reps} rounds of up to "
          f"{args.calls} calls, at most 480 launches a round; above = the call minus its launches as bare launches "
          f"timed in the round before each of its rounds; paired = the median over every call of the call minus the "
          f"bare launches issued right after it)")
    print(f"{'op':<44} {'outputs':<11} {'host us':>8} {'launches':>8} {'above':>7} {'paired':>7}")
    for r in rows:
        def cell(v):
            return "" if v is None else f"{v:.2f}"
        launches = "" if not r["launches"] else str(r["launches"])
        print(f"{r['op']:<44} {r['outputs']:<11} {r['host_us']:>8.2f} {launches:>8} {cell(r['above_launches_us']):>7} "
              f"{cell(r['paired_above_launches_us']):>7}")
    for f in failed:
        print(f"not measured (setup failed): {f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, rows=rows, setup_failed=failed), f, indent=1)


if __name__ == "__main__":
    main()
