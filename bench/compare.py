#!/usr/bin/env python3
"""tessera vs PyTorch peers on the MoE routing ops, the grouped expert GEMM and attention decode, on one GPU.

    PYTHONPATH=build/python python bench/compare.py [--json results.json] [--ops gate,permute,unpermute,gemm,decode]
    PYTHONPATH=build/python python bench/compare.py --ops gemm [--gemm-cases dsv3,qwen3] [--gemm-kinds fp8_tensor]
    PYTHONPATH=build/python python bench/compare.py --ops decode [--decode-cases llama3_8b] [--decode-formats int4]

Cases
  gate       DeepSeek-V3 (E=256, 8 groups, 4 kept, top-8, sigmoid + fp32 bias, top-2-sum, renormalize, x2.5),
             fp32 logits, T in {1, 16, 128, 1024, 4096, 65536}
  permute    T=4096, k=8, H=7168 bf16, E=256: quant none and fp8_blockwise
  unpermute  T=4096, k=8, H=7168 bf16, E=256
  gemm       the shapes of tessera-bench (bench/gemm_cases.cpp): dsv3_gate_up G=32 x m {8, 128, 1024}, N=4096,
             K=7168; dsv3_down 32 x 1024, 7168, 2048; qwen3_gate_up 128 x 256, 1536, 2048; qwen3_down_decode
             128 x 4, 2048, 768; skewed_zipf 128 Zipf-like groups (16 empty), 32768 rows, 1536, 2048 (the same
             sizes as tessera-bench). Kinds fp8_tensor, fp8_block (DeepSeek-V3 1x128 / 128x128 scales), bf16;
             decode shapes also in tessera's masked layout (max_m = 4 x rows, expected_m = rows).
  decode     the cases of tessera-bench (bench/decode_cases.cpp, same names, lengths and byte counts), D=128, q/o
             bf16: hq8kv1 (HQ 8, HKV 1) B {32..512} T 8192 and llama3_8b (HQ 32, HKV 8) B {1, 16, 64} T 4096 in
             every KV format (native, fp8 per-head, int8, int4, int4_group32); llama3_8b B 1 T 131072 (native,
             int4); paged16 / paged64 (random page permutation) for hq8kv1 B 128 and llama3_8b B 16 / 64 (native,
             int8, int4); hq8kv1 B 64 with zipf / uniform lengths up to 8192 (native, int4). Values N(0, 1) bf16,
             quantized in torch by attention.h's rule; rotating input sets where a cache is under 2x the L2.

Peers (same output contract as tessera: sorted top-k ids int32 + fp32 weights; expert-grouped rows + offsets +
row index; fp8 e4m3 + per-128-column scales; bf16 weighted sum with fp32 accumulation)
  gate       the usual torch biased_grouped_topk (sigmoid, +bias, group top-2 sum, top groups, masked_fill, topk,
             gather, renorm, scale): eager, eager captured in a CUDA graph, torch.compile (default mode)
  permute    stable argsort of the flattened ids + index_select (+ a torch blockwise fp8 quantization)
  unpermute  gather + weighted sum (fp32) and index_add_ (fp32)
  gemm       torch._scaled_grouped_mm (fp8, row-wise scales scale_a [M], scale_b [G, N]; mat_b = w.transpose(-2, -1);
             offs = int32 cumulative ends [G]; bf16 out; use_fast_accum per --fast-accum) and torch._grouped_mm
             (bf16), on the contiguous layout; they are the peers of tessera's masked rows too. Block-wise scales
             have no torch grouped equivalent: torch runs the same GEMM with row-wise scales. Errors: relative
             Frobenius error of each output against a float64 GPU reference from the dequantized inputs (the
             reference of torch's own scales for the block-wise rows), on the timed data. The gemm table reports
             tessera/peer = tessera µs / peer µs (< 1: tessera is faster), unlike the speedups above.
  decode     on the dense bf16 cache of the same values, whatever tessera's format (torch has no quantized-KV
             decode): F.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION) and (FLASH_ATTENTION),
             K/V [B, HKV, L, D] contiguous, q either [B, HQ, 1, D] with enable_gqa=True or packed [B, HKV, G, D]
             (the faster that runs is kept, the notes say which); variable lengths: K/V cut to the longest
             sequence with a boolean key mask, or unmasked if the backend refuses masks (noted); and
             flash_attn.flash_attn_with_kvcache (if importable) on tessera's own bf16 cache layout with
             cache_seqlens (and the block table). Ratios are peer µs / tessera µs (> 1: tessera is faster); GB/s
             and % of the copy bandwidth (a 1 GiB device-to-device copy, read + write) count tessera's bytes.
             rel err: tessera's output against a float32 torch reference from the dequantized cache.

Timing: CUDA events around `calls` back-to-back calls, after warmup; median over reps; per-call microseconds.
"graph" modes capture `calls` calls into one CUDA graph and time its replays. Small cases use calls=20, so launch
overhead (eager) or graph launch cost is amortized the same way for everyone. Inputs are reused across calls (hot
L2 where they fit). Speedup = peer time / tessera time of the same mode (eager peers and torch.compile against
tessera eager, graph against graph); > 1 means tessera is faster.

A missing tessera (or a tessera op that fails) is reported in its row; the other rows still run.
"""

import argparse
import json
import math
import statistics
import sys
import traceback
import warnings

try:
    import torch
    TORCH_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - --help and --list-style use work without torch; main() reports it
    torch = None
    TORCH_IMPORT_ERROR = f"import torch failed: {type(e).__name__}: {e}"

try:
    import tessera
    TESSERA_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - report whatever went wrong, keep benchmarking the peers
    tessera = None
    TESSERA_IMPORT_ERROR = f"import tessera failed: {type(e).__name__}: {e}"

# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------


def time_eager(fn, calls, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def time_graph(fn, calls, reps, warmup):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    try:
        for _ in range(warmup):
            graph.replay()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(samples)
    finally:
        del graph
        torch.cuda.empty_cache()


def copy_bandwidth(reps=20):
    """The copy ceiling as tessera-bench measures it: a device-to-device copy of 1 GiB (512 MiB if that does not
    fit), (bytes read + bytes written) / median time. Returns (bytes per second, bytes of one copy)."""
    def copy_us(nbytes):
        src = torch.ones((nbytes,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return time_eager(lambda: dst.copy_(src), 1, reps, 3)

    for nbytes in (1 << 30, 1 << 29):
        try:
            us = copy_us(nbytes)
        except RuntimeError:  # out of memory
            continue
        finally:
            torch.cuda.empty_cache()
        return 2 * nbytes / (us * 1e-6), nbytes
    return None, 0


def measure(fn, mode, calls, reps, warmup):
    """(µs, None) or (None, error text)."""
    try:
        if mode == "graph":
            return time_graph(fn, calls, reps, warmup), None
        return time_eager(fn, calls, reps, warmup), None
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# ----------------------------------------------------------------------------------------------------------------
# torch peers
# ----------------------------------------------------------------------------------------------------------------


def torch_biased_grouped_topk(logits, bias, topk, num_groups, topk_groups, renormalize, scale):
    scores = logits.float().sigmoid()
    choice = scores + bias.unsqueeze(0)
    T, E = choice.shape
    group_scores = choice.view(T, num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
    group_idx = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)
    masked = choice.masked_fill(expert_mask == 0, float("-inf"))
    topk_ids = masked.topk(topk, dim=-1, sorted=True).indices
    weights = scores.gather(1, topk_ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scale, topk_ids.to(torch.int32)


def torch_permute(x, ids, num_experts):
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    x_perm = x.index_select(0, order // k)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = torch.cumsum(counts, 0)
    row_index = torch.empty(T * k, dtype=torch.int32, device=x.device)
    row_index[order] = torch.arange(T * k, dtype=torch.int32, device=x.device)
    return x_perm, offsets, counts, row_index.view(T, k), order // k


def torch_fp8_blockwise(x):
    R, H = x.shape
    blocks = x.float().view(R, H // 128, 128)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-10) / 448.0
    q = (blocks / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(R, H), scale


def torch_permute_fp8_blockwise(x, ids, num_experts):
    x_perm, offsets, counts, row_index, row_token = torch_permute(x, ids, num_experts)
    q, scale = torch_fp8_blockwise(x_perm)
    return q, scale, offsets, counts, row_index, row_token


def torch_unpermute_gather(y_perm, row_index, weights, routed_scale):
    T, k = row_index.shape
    rows = y_perm.index_select(0, row_index.reshape(-1)).view(T, k, -1)
    out = torch.einsum("tkh,tk->th", rows.float(), weights) * routed_scale
    return out.to(y_perm.dtype)


def torch_unpermute_index_add(y_perm, row_token, row_weight, num_tokens, routed_scale):
    out = torch.zeros((num_tokens, y_perm.shape[1]), dtype=torch.float32, device=y_perm.device)
    out.index_add_(0, row_token, y_perm.float() * row_weight.unsqueeze(1), alpha=routed_scale)
    return out.to(y_perm.dtype)


def try_compile(fn):
    try:
        return torch.compile(fn, mode="default", dynamic=False), None
    except Exception as e:  # noqa: BLE001
        return None, f"torch.compile: {type(e).__name__}: {e}"


# ----------------------------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------------------------

DSV3 = dict(E=256, topk=8, num_groups=8, topk_groups=4, renormalize=True, scale=2.5)


class Row:
    """One table row: a case, tessera's times, one peer's times, notes."""

    def __init__(self, case, peer):
        self.case, self.peer = case, peer
        self.tessera = {}  # mode -> µs | None
        self.peer_times = {}  # mode -> µs | None ("-" = not run)
        self.errors = []
        self.notes = []

    def as_dict(self):
        return dict(case=self.case, peer=self.peer, tessera_us=self.tessera, peer_us=self.peer_times,
                    speedup=self.speedups(), errors=self.errors, notes=self.notes)

    def speedups(self):
        out = {}
        for mode, t in self.peer_times.items():
            base = self.tessera.get("graph" if mode == "graph" else "eager")
            out[mode] = (t / base) if (t and base) else None
        return out


def run_tessera(row, modes, make_fn, calls, reps, warmup):
    if tessera is None:
        row.errors.append(f"tessera: {TESSERA_IMPORT_ERROR}")
        for m in modes:
            row.tessera[m] = None
        return
    try:
        fn = make_fn()
        fn()  # surface argument errors with a clear message before timing
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        row.errors.append(f"tessera: {type(e).__name__}: {e}")
        for m in modes:
            row.tessera[m] = None
        return
    for m in modes:
        t, err = measure(fn, m, calls, reps, warmup)
        row.tessera[m] = t
        if err:
            row.errors.append(f"tessera {m}: {err}")


def run_peer(row, mode, fn, calls, reps, warmup):
    t, err = measure(fn, "graph" if mode == "graph" else "eager", calls, reps, warmup)
    row.peer_times[mode] = t
    if err:
        row.errors.append(f"{row.peer} {mode}: {err}")


def gate_rows(args):
    rows = []
    E, k, G, tg, renorm, scale = (DSV3[n] for n in ("E", "topk", "num_groups", "topk_groups", "renormalize",
                                                   "scale"))
    for T in args.gate_tokens:
        calls = 20 if T <= 4096 else 5
        logits = torch.randn((T, E), device="cuda") * 2.0
        bias = torch.randn((E,), device="cuda") * 0.1
        row = Row(f"gate dsv3 T={T} fp32", "torch biased_grouped_topk")

        def make_tessera():
            out = (torch.empty((T, k), dtype=torch.float32, device="cuda"),
                   torch.empty((T, k), dtype=torch.int32, device="cuda"))

            def fn():
                return tessera.fused_gate(logits, bias, topk=k, num_groups=G, topk_groups=tg, scoring="sigmoid",
                                          group_score="top2_sum", renormalize=renorm, routed_scaling_factor=scale,
                                          out=out)
            return fn

        run_tessera(row, ("eager", "graph"), make_tessera, calls, args.reps, args.warmup)

        def peer():
            return torch_biased_grouped_topk(logits, bias, k, G, tg, renorm, scale)

        run_peer(row, "eager", peer, calls, args.reps, args.warmup)
        run_peer(row, "graph", peer, calls, args.reps, args.warmup)
        if args.no_compile:
            row.peer_times["compile"] = None
            row.notes.append("torch.compile skipped (--no-compile)")
        else:
            compiled, err = try_compile(peer)
            if compiled is not None:
                try:
                    compiled()  # compiles here; failures land in the except
                    torch.cuda.synchronize()
                    run_peer(row, "compile", compiled, calls, args.reps, args.warmup)
                except Exception as e:  # noqa: BLE001
                    err = f"torch.compile: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if err:
                row.peer_times["compile"] = None
                row.errors.append(err)

        # Agreement of the chosen expert sets (sorted ids) with the eager peer.
        if tessera is not None and row.tessera.get("eager") is not None:
            try:
                _, t_ids = tessera.fused_gate(logits, bias, topk=k, num_groups=G, topk_groups=tg,
                                              renormalize=renorm, routed_scaling_factor=scale)
                _, p_ids = peer()
                same = (t_ids.sort(dim=1).values == p_ids.sort(dim=1).values).all(dim=1).float().mean().item()
                row.notes.append(f"id sets equal to the peer's on {100 * same:.2f}% of rows")
            except Exception as e:  # noqa: BLE001
                row.notes.append(f"check failed: {type(e).__name__}: {e}")
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def routing_inputs(T, k, H, E, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((T, H), device="cuda", generator=g).to(torch.bfloat16)
    # Distinct experts per token, roughly uniform load.
    ids = torch.rand((T, E), device="cuda", generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    return x, ids


def permute_rows(args):
    rows = []
    T, k, H, E = args.tokens, 8, 7168, 256
    x, ids = routing_inputs(T, k, H, E)
    calls = 5
    for quant in (None, "fp8_blockwise"):
        label = "none" if quant is None else quant
        row = Row(f"permute T={T} k={k} H={H} bf16 {label}", "torch argsort+index_select" +
                  ("" if quant is None else "+fp8 quant"))

        def make_tessera(quant=quant):
            def fn():
                return tessera.permute(x, ids, E, quant=quant, with_row_token=True)
            return fn

        run_tessera(row, ("eager", "graph"), make_tessera, calls, args.reps, args.warmup)
        if quant is None:
            def peer():
                return torch_permute(x, ids, E)
        else:
            def peer():
                return torch_permute_fp8_blockwise(x, ids, E)
        run_peer(row, "eager", peer, calls, args.reps, args.warmup)
        run_peer(row, "graph", peer, calls, args.reps, args.warmup)

        if tessera is not None and row.tessera.get("eager") is not None:
            try:
                res = tessera.permute(x, ids, E, quant=quant)
                p = peer()
                p_offsets, p_row_index = (p[1], p[3]) if quant is None else (p[2], p[4])
                ok = torch.equal(res.expert_offsets, p_offsets) and torch.equal(res.row_index, p_row_index)
                row.notes.append("offsets/row_index equal to the peer's" if ok else "offsets/row_index DIFFER")
            except Exception as e:  # noqa: BLE001
                row.notes.append(f"check failed: {type(e).__name__}: {e}")
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def unpermute_rows(args):
    rows = []
    T, k, H, E = args.tokens, 8, 7168, 256
    x, ids = routing_inputs(T, k, H, E, seed=1)
    y_perm, _, _, row_index, row_token = torch_permute(x, ids, E)  # y_perm: the expert outputs, grouped
    del x
    weights = torch.rand((T, k), device="cuda")
    routed_scale = 2.5
    row_weight = torch.empty(T * k, device="cuda")
    row_weight[row_index.reshape(-1).long()] = weights.reshape(-1)
    calls = 5

    def make_tessera():
        out = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")

        def fn():
            return tessera.unpermute_reduce(y_perm, row_index, weights, None, routed_scale, out=out)
        return fn

    peers = [
        ("torch gather+weighted sum", lambda: torch_unpermute_gather(y_perm, row_index, weights, routed_scale)),
        ("torch index_add_", lambda: torch_unpermute_index_add(y_perm, row_token, row_weight, T, routed_scale)),
    ]
    tessera_times, tessera_errors = None, None
    for name, peer in peers:
        row = Row(f"unpermute T={T} k={k} H={H} bf16", name)
        if tessera_times is None:
            run_tessera(row, ("eager", "graph"), make_tessera, calls, args.reps, args.warmup)
            tessera_times, tessera_errors = dict(row.tessera), list(row.errors)
        else:
            row.tessera, row.errors = dict(tessera_times), list(tessera_errors)
        run_peer(row, "eager", peer, calls, args.reps, args.warmup)
        run_peer(row, "graph", peer, calls, args.reps, args.warmup)
        if tessera is not None and row.tessera.get("eager") is not None:
            try:
                got = tessera.unpermute_reduce(y_perm, row_index, weights, None, routed_scale).float()
                ref = peer().float()
                rel = ((got - ref).norm() / ref.norm()).item()
                row.notes.append(f"rel. Frobenius difference to the peer {rel:.2e}")
            except Exception as e:  # noqa: BLE001
                row.notes.append(f"check failed: {type(e).__name__}: {e}")
        rows.append(row)
    torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------------------------
# grouped GEMM: tessera.grouped_gemm_* vs torch._scaled_grouped_mm (fp8) / torch._grouped_mm (bf16)
# ----------------------------------------------------------------------------------------------------------------


class SplitMix64:
    """tessera-bench's Rng (bench/harness.h), so both benchmarks draw the same skewed group sizes."""

    MASK = (1 << 64) - 1

    def __init__(self, seed):
        self.state = seed & self.MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & self.MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self.MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self.MASK
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n


def zipf_rows(groups, total, empty, s, seed):
    """Zipf-like group sizes, the same as bench/gemm_cases.cpp's zipf_rows: `empty` random groups get no rows, the
    others (in random order) total * r^-s / H rows for rank r, rounded down, the remainder to the largest."""
    rng = SplitMix64(seed)
    order = list(range(groups))
    for i in range(groups - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    ranked = groups - empty
    w = [(r + 1.0) ** -s for r in range(ranked)]
    total_w = sum(w)
    rows = [0] * groups
    used = 0
    for r in range(ranked):
        rows[order[empty + r]] = int(math.floor(total * w[r] / total_w))
        used += rows[order[empty + r]]
    r = 0
    while used < total:
        rows[order[empty + r]] += 1
        used += 1
        r = (r + 1) % ranked
    return rows


def gemm_shapes():
    """The shapes of bench/gemm_cases.cpp: (name, rows per group, N, K, max_m of the masked variant or 0)."""
    def uniform(name, groups, m, n, k, decode):
        return dict(name=f"{name}/m{m}", rows=[m] * groups, n=n, k=k, max_m=4 * m if decode else 0)

    shapes = [
        uniform("dsv3_gate_up", 32, 8, 4096, 7168, True),
        uniform("dsv3_gate_up", 32, 128, 4096, 7168, False),
        uniform("dsv3_gate_up", 32, 1024, 4096, 7168, False),
        uniform("dsv3_down", 32, 1024, 7168, 2048, False),
        uniform("qwen3_gate_up", 128, 256, 1536, 2048, False),
        uniform("qwen3_down_decode", 128, 4, 2048, 768, True),
    ]
    skewed = zipf_rows(128, 32768, 16, 1.1, 0x5EED)
    shapes.append(dict(name=f"skewed_zipf/M{sum(skewed)}", rows=skewed, n=1536, k=2048, max_m=0))
    return shapes


GEMM_KINDS = ("fp8_tensor", "fp8_block", "bf16")


class GemmRow:
    """One table row: a tessera grouped GEMM (one layout) against one torch peer on the same shape."""

    def __init__(self, case, kind, layout, peer, flops):
        self.case, self.kind, self.layout, self.peer, self.flops = case, kind, layout, peer, flops
        self.tessera = {}  # mode -> µs | None
        self.peer_times = {}  # mode -> µs | None
        self.err_tessera = None  # relative Frobenius error vs the float64 reference
        self.err_peer = None
        self.errors = []
        self.notes = []

    def ratio(self, mode="graph"):
        t, p = self.tessera.get(mode), self.peer_times.get(mode)
        return t / p if (t and p) else None

    def as_dict(self):
        return dict(case=self.case, kind=self.kind, layout=self.layout, peer=self.peer, flops=self.flops,
                    tessera_us=self.tessera, peer_us=self.peer_times,
                    tessera_over_peer={m: self.ratio(m) for m in ("eager", "graph")},
                    rel_fro_error=dict(tessera=self.err_tessera, peer=self.err_peer), errors=self.errors,
                    notes=self.notes)


def _short(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _sync_quietly():
    """After a failed call: wait for the queue; a sticky device error shows up in the later rows, not here."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def _fp8_dtype():
    return getattr(torch, "float8_e4m3fn", None)


def _random_fp8(shape, gen):
    # Quantized-looking e4m3: a normal distribution with its 4.7-sigma tail at the format's 448, all finite.
    return (torch.randn(shape, device="cuda", generator=gen) * 96.0).clamp_(-448.0, 448.0).to(_fp8_dtype())


def _random_scales(shape, gen, lo, hi):
    return torch.exp2(torch.empty(shape, device="cuda").uniform_(lo, hi, generator=gen)).float()


class GemmData:
    """One set of inputs for a shape and kind, in tessera's layouts (and the masked copies for decode shapes)."""

    def __init__(self, shape, kind, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        rows, n, k = shape["rows"], shape["n"], shape["k"]
        self.kind, self.rows, self.n, self.k = kind, rows, n, k
        self.groups, self.m = len(rows), sum(rows)
        self.max_m = shape["max_m"]
        self.starts = [0]
        for r in rows:
            self.starts.append(self.starts[-1] + r)
        self.offsets = torch.tensor(self.starts, dtype=torch.int32, device="cuda")  # tessera: [G+1] from 0
        self.offs_end = self.offsets[1:].contiguous()  # torch: [G] cumulative ends
        fp8 = kind != "bf16"
        if fp8:
            self.x = _random_fp8((self.m, k), g)
            self.w = torch.empty((self.groups, n, k), dtype=_fp8_dtype(), device="cuda")
            for e in range(self.groups):  # per group: bounded float32 temporaries
                self.w[e] = _random_fp8((n, k), g)
        else:
            self.x = torch.empty((self.m, k), device="cuda").uniform_(-1.0, 1.0, generator=g).bfloat16()
            self.w = torch.empty((self.groups, n, k), dtype=torch.bfloat16, device="cuda")
            for e in range(self.groups):
                self.w[e] = torch.empty((n, k), device="cuda").uniform_(-1.0, 1.0, generator=g).bfloat16()
        self.scale_mode = {"fp8_tensor": "per_tensor", "fp8_block": "blockwise"}.get(kind)
        if kind == "fp8_tensor":
            self.xs = _random_scales((1,), g, -9.0, -7.0)
            self.ws = _random_scales((self.groups,), g, -11.0, -9.0)
        elif kind == "fp8_block":
            self.xs = _random_scales((self.m, k // 128), g, -10.0, -6.0)
            self.ws = _random_scales((self.groups, n // 128, k // 128), g, -12.0, -8.0)
        # torch._scaled_grouped_mm takes row-wise scales: scale_a [M], scale_b [G, N]. Per-tensor scales expand to
        # exactly that; block-wise ones have no torch grouped equivalent, so torch runs the same GEMM with the
        # scales of the first K block (row / 128-row-block granularity), against its own float64 reference.
        if kind == "fp8_tensor":
            self.sa = self.xs.expand(self.m).contiguous()
            self.sb = self.ws[:, None].expand(self.groups, n).contiguous()
        elif kind == "fp8_block":
            self.sa = self.xs[:, 0].contiguous()
            self.sb = self.ws[:, :, 0].repeat_interleave(128, dim=1).contiguous()
        # Masked layout: group e's rows are the first rows[e] of x_masked[e]; the rest are filled too (unused).
        if self.max_m:
            mm = self.max_m
            self.masked_m = torch.tensor(rows, dtype=torch.int32, device="cuda")
            if fp8:
                self.x_masked = _random_fp8((self.groups, mm, k), g)
            else:
                self.x_masked = torch.empty((self.groups, mm, k), device="cuda").uniform_(-1, 1, generator=g).bfloat16()
            if kind == "fp8_block":
                self.xs_masked = _random_scales((self.groups, mm, k // 128), g, -10.0, -6.0)
            for e, r in enumerate(rows):
                s = self.starts[e]
                self.x_masked[e, :r] = self.x[s:s + r]
                if kind == "fp8_block":
                    self.xs_masked[e, :r] = self.xs[s:s + r]

    # ---- reference (float64 on the GPU, from the dequantized values) -------------------------------------------
    def reference(self, e, torch_scales=False):
        """Group e's exact result [rows[e], N] in float64: tessera's scaling, or torch's row-wise one."""
        s, r = self.starts[e], self.rows[e]
        x = self.x[s:s + r].float().double()
        w = self.w[e].float().double()
        if self.kind == "bf16":
            return x @ w.T
        if torch_scales:
            return (x * self.sa[s:s + r, None].double()) @ (w * self.sb[e][:, None].double()).T
        if self.kind == "fp8_tensor":
            return (x @ w.T) * (self.xs[0].double() * self.ws[e].double())
        xd = x * self.xs[s:s + r].double().repeat_interleave(128, dim=1)
        wd = w * self.ws[e].double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
        return xd @ wd.T


def rel_fro_errors(data, outputs):
    """outputs: name -> (rows_of(e) -> tensor [rows[e], N] or None, uses torch scales). Returns name -> error."""
    acc = {name: [0.0, 0.0] for name in outputs}
    for e, r in enumerate(data.rows):
        if r == 0:
            continue
        refs = {}
        for name, (rows_of, torch_scales) in outputs.items():
            got = rows_of(e)
            if got is None:
                continue
            if torch_scales not in refs:
                refs[torch_scales] = data.reference(e, torch_scales)
            ref = refs[torch_scales]
            acc[name][0] += (got.double() - ref).pow(2).sum().item()
            acc[name][1] += ref.pow(2).sum().item()
    return {name: (math.sqrt(a / b) if b > 0 else None) for name, (a, b) in acc.items()}


def gemm_calls(flops, nbytes):
    """Calls per timed sample: ~1.5 ms of work by a rough estimate (600 TFLOP/s or 3 TB/s), 1..50."""
    est_us = max(flops / 600e12, nbytes / 3e12) * 1e6 + 5.0
    return max(1, min(50, int(math.ceil(1500.0 / est_us))))


def gemm_rows(args):
    has = dict(scaled=hasattr(torch, "_scaled_grouped_mm"), bf16=hasattr(torch, "_grouped_mm"))
    kinds = [k for k in args.gemm_kinds.split(",") if k]
    for k in kinds:
        if k not in GEMM_KINDS:
            raise ValueError(f"unknown --gemm-kinds item {k!r} (expected {', '.join(GEMM_KINDS)})")
    case_filter = [c for c in args.gemm_cases.split(",") if c]
    rows = []
    for si, shape in enumerate(gemm_shapes()):
        if case_filter and not any(c in shape["name"] for c in case_filter):
            continue
        for kind in kinds:
            rows.extend(gemm_case_rows(args, shape, kind, 1000 + si, has))
            torch.cuda.empty_cache()
    return rows


def gemm_case_rows(args, shape, kind, seed, has):
    """The rows of one shape and kind: tessera contiguous (and masked for decode shapes) against the torch peer."""
    flops = 2.0 * sum(shape["rows"]) * shape["n"] * shape["k"]
    elt = 2 if kind == "bf16" else 1
    nbytes = (sum(1 for r in shape["rows"] if r) * shape["n"] * shape["k"] * elt
              + sum(shape["rows"]) * (shape["k"] * elt + shape["n"] * 2))
    calls = gemm_calls(flops, nbytes)
    case = shape["name"] + {"fp8_tensor": "/tensor", "fp8_block": "/block", "bf16": ""}[kind]
    if kind == "bf16":
        peer_name = "torch._grouped_mm"
    else:
        peer_name = "torch._scaled_grouped_mm" + (" (row-wise scales)" if kind == "fp8_block" else "")
    layouts = ["contiguous"] + (["masked"] if shape["max_m"] else [])
    rows = [GemmRow(case, kind, layout, peer_name, flops) for layout in layouts]
    try:
        if kind != "bf16" and _fp8_dtype() is None:
            raise RuntimeError("this torch has no float8_e4m3fn")
        d = GemmData(shape, kind, seed)
    except Exception as e:  # noqa: BLE001
        for r in rows:
            r.errors.append(f"input setup: {_short(e)}")
        return rows
    y_c = torch.empty((d.m, d.n), dtype=torch.bfloat16, device="cuda")
    y_m = torch.empty((d.groups, d.max_m, d.n), dtype=torch.bfloat16, device="cuda") if d.max_m else None
    expected = max(shape["rows"])

    def tessera_fn(layout):
        if tessera is None:
            raise RuntimeError(TESSERA_IMPORT_ERROR)
        if kind == "bf16":
            if layout == "contiguous":
                return lambda: tessera.grouped_gemm_bf16(d.x, d.w, d.offsets, out=y_c)
            return lambda: tessera.grouped_gemm_bf16_masked(d.x_masked, d.w, d.masked_m, out=y_m,
                                                            expected_m=expected)
        if layout == "contiguous":
            return lambda: tessera.grouped_gemm_fp8(d.x, d.w, d.offsets, d.xs, d.ws, scale_mode=d.scale_mode, out=y_c)
        xs = d.xs_masked if kind == "fp8_block" else d.xs
        return lambda: tessera.grouped_gemm_fp8_masked(d.x_masked, d.w, d.masked_m, xs, d.ws,
                                                       scale_mode=d.scale_mode, out=y_m, expected_m=expected)

    # outputs for the error check: name -> (group e -> its rows of the output, uses torch's scales)
    outputs = {}
    for r in rows:
        try:
            fn = tessera_fn(r.layout)
            y_c.fill_(float("nan"))
            if y_m is not None:
                y_m.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            r.errors.append(f"tessera: {_short(e)}")
            _sync_quietly()
            continue
        # Keep this layout's output (the timed runs overwrite the buffer).
        if r.layout == "contiguous":
            kept = y_c.clone()
            outputs[r.layout] = ((lambda e, kept=kept: kept[d.starts[e]:d.starts[e + 1]]), False)
        else:
            kept = y_m.clone()
            outputs[r.layout] = ((lambda e, kept=kept: kept[e, :d.rows[e]]), False)
        for mode in ("eager", "graph"):
            t, err = measure(fn, mode, calls, args.reps, args.warmup)
            r.tessera[mode] = t
            if err:
                r.errors.append(f"tessera {mode}: {err}")

    # The torch peer, on the contiguous layout (it is the masked rows' peer too).
    peer_fn, peer_err = None, None
    if kind == "bf16" and not has["bf16"]:
        peer_err = f"peer unavailable: torch {torch.__version__} has no torch._grouped_mm"
    elif kind != "bf16" and not has["scaled"]:
        peer_err = f"peer unavailable: torch {torch.__version__} has no torch._scaled_grouped_mm"
    else:
        w_t = d.w.transpose(-2, -1)  # [G, K, N], K-major ("column-major"), as the grouped kernels require
        if kind == "bf16":
            peer_fn = lambda: torch._grouped_mm(d.x, w_t, offs=d.offs_end, out_dtype=torch.bfloat16)  # noqa: E731
        else:
            peer_fn = lambda: torch._scaled_grouped_mm(  # noqa: E731
                d.x, w_t, d.sa, d.sb, offs=d.offs_end, out_dtype=torch.bfloat16, use_fast_accum=args.fast_accum)
        try:
            y_p = peer_fn()
            torch.cuda.synchronize()
            outputs["peer"] = ((lambda e: y_p[d.starts[e]:d.starts[e + 1]]), kind == "fp8_block")
        except Exception as e:  # noqa: BLE001
            peer_err = f"peer unavailable: {_short(e)}"
            peer_fn = None
            _sync_quietly()
    peer_times = {}
    if peer_fn is not None:
        for mode in ("eager", "graph"):
            t, err = measure(peer_fn, mode, calls, args.reps, args.warmup)
            peer_times[mode] = t
            if err:
                for r in rows:
                    r.errors.append(f"peer {mode}: {err}")
    for r in rows:
        r.peer_times = dict(peer_times)
        if peer_err:
            r.errors.append(peer_err)

    # Accuracy, on this set of data.
    try:
        errs = rel_fro_errors(d, outputs)
        for r in rows:
            r.err_tessera = errs.get(r.layout)
            r.err_peer = errs.get("peer")
    except Exception as e:  # noqa: BLE001
        for r in rows:
            r.notes.append(f"error check failed: {_short(e)}")
    for r in rows:
        if kind == "fp8_block":
            r.notes.append("torch has no block-wise grouped fp8 GEMM: it runs row-wise scales (those of the first K "
                           "block); its error is against the float64 reference of those scales")
        if kind != "bf16" and args.fast_accum:
            r.notes.append("torch peer with use_fast_accum=True")
    return rows


def fmt_ratio(v):
    return "-" if v is None else f"{v:.2f}"


def fmt_err(v):
    return "-" if v is None else f"{v:.2e}"


def fmt_tflops(flops, us):
    return "-" if not us else f"{flops / (us * 1e-6) / 1e12:.1f}"


def print_gemm_table(rows):
    head = ["case", "layout", "tessera eager µs", "tessera graph µs", "tessera TFLOP/s", "peer", "peer eager µs",
            "peer graph µs", "peer TFLOP/s", "tessera/peer", "rel err tessera", "rel err peer"]
    body = []
    for r in rows:
        te, tg = r.tessera.get("eager"), r.tessera.get("graph")
        pe, pg = r.peer_times.get("eager"), r.peer_times.get("graph")
        body.append([r.case, r.layout, fmt_us(te), fmt_us(tg), fmt_tflops(r.flops, tg), r.peer, fmt_us(pe),
                     fmt_us(pg), fmt_tflops(r.flops, pg), fmt_ratio(r.ratio("graph")), fmt_err(r.err_tessera),
                     fmt_err(r.err_peer)])
    print_aligned(head, body, text_cols=(0, 1, 5))
    print("\nTFLOP/s from the graph times; tessera/peer = tessera graph µs / peer graph µs (< 1: tessera is faster);"
          "\nrel err = ||y - ref||_F / ||ref||_F against a float64 GPU reference computed from the dequantized inputs")
    for r in rows:
        for note in dict.fromkeys(r.notes):
            print(f"  note  [{r.case} | {r.layout}] {note}")
        for err in r.errors:
            print(f"  error [{r.case} | {r.layout}] {err}")


# ----------------------------------------------------------------------------------------------------------------
# attention decode: tessera.attention_decode over a low-precision KV cache vs torch SDPA (cuDNN and flash
# backends) and flash_attn.flash_attn_with_kvcache, both on the dense bf16 cache
# ----------------------------------------------------------------------------------------------------------------

DECODE_FORMATS = ("native", "fp8", "int8", "int4", "int4_group32")
DECODE_LENGTH_SEED = 0xDEC0DE  # skewed lengths: the same seed and generator as bench/decode_cases.cpp
DECODE_PEERS = (("cudnn", "cuDNN"), ("flash", "flash"), ("fa_kvcache", "fa_kvcache"))


def decode_shapes():
    """The decode cases of tessera-bench (bench/decode_cases.cpp): name, B, HQ, HKV, D, T (capacity per
    sequence), page_size (0: contiguous), lengths ("full": every sequence holds T tokens; "zipf"; "uniform") and
    the formats it runs."""
    every = DECODE_FORMATS
    shapes = []

    def add(name, B, hq, hkv, T, formats, page_size=0, lengths="full"):
        shapes.append(dict(name=name, B=B, HQ=hq, HKV=hkv, D=128, T=T, page_size=page_size, lengths=lengths,
                           formats=formats))

    for B in (32, 64, 128, 256, 512):
        add(f"hq8kv1/B{B}/T8192", B, 8, 1, 8192, every)
    for B in (1, 16, 64):
        add(f"llama3_8b/B{B}/T4096", B, 32, 8, 4096, every)
    add("llama3_8b/B1/T131072", 1, 32, 8, 131072, ("native", "int4"))
    for ps in (16, 64):
        add(f"hq8kv1/B128/T8192/paged{ps}", 128, 8, 1, 8192, ("native", "int8", "int4"), page_size=ps)
        for B in (16, 64):
            add(f"llama3_8b/B{B}/T4096/paged{ps}", B, 32, 8, 4096, ("native", "int8", "int4"), page_size=ps)
    for dist in ("zipf", "uniform"):
        add(f"hq8kv1/B64/T8192/{dist}", 64, 8, 1, 8192, ("native", "int4"), lengths=dist)
    return shapes


def decode_lengths(kind, batch, capacity, seed=DECODE_LENGTH_SEED):
    """Tokens per sequence, as bench/decode_cases.cpp draws them: full = capacity; zipf = capacity // rank for
    ranks 1..B in a random order (one full sequence, then 1/2, 1/3, ...); uniform = 1 + below(capacity)."""
    if kind == "full":
        return [capacity] * batch
    rng = SplitMix64(seed)
    if kind == "uniform":
        return [1 + rng.below(capacity) for _ in range(batch)]
    order = list(range(batch))
    for i in range(batch - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    lengths = [0] * batch
    for rank in range(batch):
        lengths[order[rank]] = max(1, capacity // (rank + 1))
    return lengths


def kv_row_bytes(fmt, d):
    return {"native": 2 * d, "fp8": d, "int8": d}.get(fmt, d // 2)


def kv_scale_groups(fmt, d):
    """NG: (scale, offset) pairs per (token, head) row; 0 for native and fp8."""
    return {"int8": 1, "int4": 1, "int4_group32": d // 32}.get(fmt, 0)


def decode_bytes(shape, fmt, lengths):
    """Bytes one decode call moves, as tessera-bench counts them: for every attended token the K and V rows of
    each KV head and their fp16 scale pairs, plus q, o, the lengths, the block-table entries used and the fp8
    scales."""
    B, HQ, HKV, D, ps = (shape[n] for n in ("B", "HQ", "HKV", "D", "page_size"))
    per_token = HKV * 2 * (kv_row_bytes(fmt, D) + 4 * kv_scale_groups(fmt, D))
    nbytes = sum(lengths) * per_token + 2 * (B * HQ * D * 2) + 4 * B
    if ps:
        nbytes += 4 * sum(-(-n // ps) for n in lengths)
    if fmt == "fp8":
        nbytes += 2 * 4 * HKV
    return nbytes


def _chunks(n, per_item, limit=1 << 26):
    """[b0, b1) ranges over a leading dim of n items of per_item elements: at most `limit` elements per range
    (at least one item), to bound the float32 temporaries."""
    step = max(1, limit // max(per_item, 1))
    return [(b, min(n, b + step)) for b in range(0, n, step)]


def quantize_kv(x, fmt, fp8_scale=None):
    """bf16 values [B, T, HKV, D] -> (codes, scales) in tessera's cache layout (include/tessera/attention.h).
    native: x itself, no scales. fp8: e4m3(x / scale[h]) (saturated), scales = fp8_scale fp32 [HKV]. int8, int4,
    int4_group32: per group lo = min, hi = max, scale = fp16((hi - lo) / levels), offset = fp16(lo),
    code = clamp(rint((x - offset) / scale), 0, levels) or 0 where scale == 0; int4 packs element 2j in the low
    nibble; scales are fp16 (scale, offset) pairs [B, T, HKV, 2 NG]."""
    if fmt == "native":
        return x, None
    B, D = x.shape[0], x.shape[-1]
    ranges = _chunks(B, x[0].numel())
    if fmt == "fp8":
        codes = torch.empty(x.shape, dtype=_fp8_dtype(), device=x.device)
        for b0, b1 in ranges:
            codes[b0:b1] = (x[b0:b1].float() / fp8_scale[:, None]).clamp_(-448.0, 448.0).to(_fp8_dtype())
        return codes, fp8_scale
    levels = 255 if fmt == "int8" else 15
    ng = kv_scale_groups(fmt, D)
    codes = torch.empty((*x.shape[:-1], kv_row_bytes(fmt, D)), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], 2 * ng), dtype=torch.float16, device=x.device)
    for b0, b1 in ranges:
        xf = x[b0:b1].float().unflatten(-1, (ng, D // ng))
        lo, hi = xf.amin(-1), xf.amax(-1)
        scale = ((hi - lo) / levels).clamp_(max=65504.0).half()
        offset = lo.clamp(-65504.0, 65504.0).half()
        s, o = scale.float().unsqueeze(-1), offset.float().unsqueeze(-1)
        c = torch.where(s > 0, ((xf - o) / s).round_().clamp_(0, levels), 0.0).to(torch.uint8).flatten(-2)
        if levels == 15:
            c = c[..., 0::2] | (c[..., 1::2] << 4)
        codes[b0:b1] = c
        scales[b0:b1] = torch.stack((scale, offset), -1).flatten(-2)
    return codes, scales


def dequantize_kv(codes, scales, fmt):
    """float32 values of a logical cache [b, T, HKV, D]: e4m3 * scale[h], or code * scale + offset per group."""
    if fmt == "native":
        return codes.float()
    if fmt == "fp8":
        return codes.float() * scales[:, None]
    c = codes if fmt == "int8" else torch.stack((codes & 15, codes >> 4), -1).flatten(-2)
    pairs = scales.float().unflatten(-1, (-1, 2))  # [..., NG, 2]
    return (c.float().unflatten(-1, (pairs.shape[-2], -1)) * pairs[..., 0:1] + pairs[..., 1:2]).flatten(-2)


def decode_reference(q, lengths, T, HKV, k_of, v_of):
    """float32 decode: o[b, h] = softmax_t(q[b, h] . K[b, t, h / G] / sqrt(D)) V[b, t, h / G] over t < L[b].
    k_of(b0, b1), v_of(b0, b1): float32 [b1 - b0, T, HKV, D] (the dequantized cache)."""
    B, HQ, D = q.shape
    out = torch.empty((B, HQ, D), dtype=torch.float32, device=q.device)
    for b0, b1 in _chunks(B, T * HKV * D):
        k, v = k_of(b0, b1), v_of(b0, b1)
        n = b1 - b0
        qg = q[b0:b1].float().view(n, HKV, HQ // HKV, D)
        s = torch.einsum("bhgd,bthd->bhgt", qg, k) / math.sqrt(D)
        past = torch.arange(T, device=q.device)[None, :] >= lengths[b0:b1, None].long()
        s.masked_fill_(past[:, None, None, :], float("-inf"))
        out[b0:b1] = torch.einsum("bhgt,bthd->bhgd", s.softmax(-1), v).reshape(n, HQ, D)
    return out


def rel_error(got, ref):
    """||got - ref||_F / ||ref||_F (NaN in got shows up as NaN)."""
    return ((got.float() - ref).norm() / ref.norm()).item()


class DecodeInputs:
    """A case's inputs in `sets` rotating copies: bf16 K and V values [B, T, HKV, D] (standard normal) and q
    [B, HQ, D]; the lengths int32 [B]; for paged cases a block table int32 [B, T / page_size] over a random
    permutation of all B * T / page_size pages (shared by the sets); fp8 scales per set: amax per KV head / 448."""

    def __init__(self, shape, sets, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        B, HQ, HKV, D, T = (shape[n] for n in ("B", "HQ", "HKV", "D", "T"))
        self.shape, self.sets = shape, sets
        self.lengths_list = decode_lengths(shape["lengths"], B, T)
        self.lengths = torch.tensor(self.lengths_list, dtype=torch.int32, device="cuda")
        self.max_len = max(self.lengths_list)
        self.q = [torch.randn((B, HQ, D), generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        self.kv = [tuple(torch.randn((B, T, HKV, D), generator=g, device="cuda", dtype=torch.bfloat16)
                         for _ in range(2)) for _ in range(sets)]
        self.fp8_scales = [tuple(x.abs().amax(dim=(0, 1, 3)).float() / 448.0 for x in kv) for kv in self.kv]
        self.block_table = None
        if shape["page_size"]:
            pages = T // shape["page_size"]
            perm = torch.randperm(B * pages, generator=g, device="cuda")
            self.block_table = perm.view(B, pages).to(torch.int32)

    def paged(self, x):
        """A logical [B, T, HKV, ...] tensor in the paged layout [num_pages, page_size, HKV, ...]."""
        if self.block_table is None:
            return x
        ps = self.shape["page_size"]
        raw = x.view(torch.uint8) if x.element_size() == 1 else x  # index_put has no fp8 kernels
        out = torch.empty((self.block_table.numel(), ps, *x.shape[2:]), dtype=raw.dtype, device=x.device)
        out[self.block_table.flatten().long()] = raw.reshape(-1, ps, *x.shape[2:])
        return out.view(x.dtype)

    def cache(self, fmt, s):
        """Set s in format fmt: dict(k, v, k_scale, v_scale) in tessera's layout (paged where the case is) and
        logical = ((k codes, k scales), (v codes, v scales)) in the contiguous layout, for the reference."""
        logical = tuple(quantize_kv(x, fmt, sc) for x, sc in zip(self.kv[s], self.fp8_scales[s]))
        (kq, ks), (vq, vs) = logical
        if fmt != "fp8" and ks is not None:
            ks, vs = self.paged(ks), self.paged(vs)
        return dict(k=self.paged(kq), v=self.paged(vq), k_scale=ks, v_scale=vs, logical=logical)

    def reference(self, logical, fmt):
        """The float32 reference output of set 0 for a logical cache in format fmt."""
        (kq, ks), (vq, vs) = logical

        def deq(codes, scales):
            return lambda b0, b1: dequantize_kv(codes[b0:b1], scales if fmt == "fp8" or scales is None
                                                else scales[b0:b1], fmt)
        return decode_reference(self.q[0], self.lengths, self.shape["T"], self.shape["HKV"], deq(kq, ks),
                                deq(vq, vs))


class DecodeRow:
    """One (case, format) row: tessera's times and error, and the peers' times, which are measured once per case on
    the dense bf16 cache and shared by its formats (as are case_notes / case_errors)."""

    def __init__(self, case, fmt, nbytes):
        self.case, self.fmt, self.bytes = case, fmt, nbytes
        self.tessera = {}  # mode -> µs | None
        self.peers = {}  # peer -> {mode -> µs | None}
        self.err = None  # relative Frobenius error vs the float32 reference of the dequantized cache
        self.errors, self.notes = [], []  # this row's
        self.case_errors, self.case_notes = [], []  # the case's (peers), the same list object in all its rows

    def gbps(self, mode):
        t = self.tessera.get(mode)
        return self.bytes / (t * 1e-6) / 1e9 if t else None

    def speedup(self, peer, mode):
        """peer µs / tessera µs of the same mode (> 1: tessera is faster)."""
        t, p = self.tessera.get(mode), self.peers.get(peer, {}).get(mode)
        return p / t if (t and p) else None

    def as_dict(self):
        peers = {p: dict(us=self.peers.get(p, {}), peer_over_tessera={m: self.speedup(p, m) for m in
                                                                      ("eager", "graph")}) for p, _ in DECODE_PEERS}
        return dict(case=self.case, format=self.fmt, bytes=self.bytes, tessera_us=self.tessera,
                    gbps={m: self.gbps(m) for m in ("eager", "graph")}, peers=peers, rel_fro_error=self.err,
                    errors=self.case_errors + self.errors, notes=self.case_notes + self.notes)


def rotating(fns):
    """One callable that runs fns[0], fns[1], ... in turn (input sets rotate across calls and graph captures)."""
    if len(fns) == 1:
        return fns[0]
    state = [0]

    def fn():
        f = fns[state[0] % len(fns)]
        state[0] += 1
        return f()
    return fn


def _l2_bytes(dev):
    return getattr(dev, "L2_cache_size", 0) or 50 << 20  # older torch: assume H100's 50 MiB


def decode_sets(nbytes, l2_bytes, cap=32):
    """Rotating sets whose inputs together exceed twice the L2 (tessera-bench's rule), at most cap."""
    return max(1, min(cap, int(2 * l2_bytes // max(nbytes, 1)) + 1))


def decode_calls(nbytes, sets):
    """Calls per timed sample: ~1.5 ms of work at a rough 3 TB/s, 1..50, then a multiple of the rotating sets."""
    calls = max(1, min(50, int(math.ceil(1500.0 / (nbytes / 3e12 * 1e6 + 5.0)))))
    return -(-calls // sets) * sets


def _timed(fn, calls, args):
    """{mode: µs | None} and the error texts of fn in eager and graph modes."""
    times, errors = {}, []
    for mode in ("eager", "graph"):
        t, err = measure(fn, mode, calls, args.reps, args.warmup)
        times[mode] = t
        if err:
            errors.append(f"{mode}: {err}")
    return times, errors


def _best(candidates):
    """The candidate with the lowest graph time (eager where it has none), or None."""
    ok = [c for c in candidates if c["times"].get("graph") or c["times"].get("eager")]
    return min(ok, key=lambda c: c["times"].get("graph") or c["times"]["eager"]) if ok else None


def _sdpa_peer(backend, label, data, dense, calls, args, ref):
    """Times torch SDPA on one backend. Two ways to run GQA are tried and the faster is kept: q [B, HQ, 1, D] with
    enable_gqa=True, and q packed as [B, HKV, G, D] (the G query heads of a KV head as its G query rows: the same
    result, each K/V head read once). Variable lengths: K/V padded to the longest sequence, with a boolean key
    mask; where the backend refuses the mask, unmasked on the padded length (timing only).
    Returns (times, notes, errors)."""
    F = torch.nn.functional
    from torch.nn.attention import sdpa_kernel

    B, HQ, D = data.q[0].shape
    HKV = data.shape["HKV"]
    variable = any(n != data.max_len for n in data.lengths_list)
    mask = None
    if variable:
        mask = (torch.arange(data.max_len, device="cuda")[None, :] < data.lengths[:, None].long())[:, None, None, :]

    def variant(form, s, m):
        q, (k4, v4) = data.q[s], dense[s]
        if form == "enable_gqa":
            return lambda: F.scaled_dot_product_attention(q.view(B, HQ, 1, D), k4, v4, attn_mask=m, enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q.view(B, HKV, HQ // HKV, D), k4, v4, attn_mask=m)

    candidates, notes = [], []
    for m in ([mask, None] if variable else [None]):
        for form in ("enable_gqa", "packed"):
            fns = [variant(form, s, m) for s in range(len(dense))]
            with sdpa_kernel(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SDPA warns once per refusing kernel; the note says it
                try:
                    y = fns[0]()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    notes.append(f"{label}: {form}{' with mask' if m is not None else ''} refused: {_short(e)}")
                    _sync_quietly()
                    continue
                err = rel_error(y.reshape(B, HQ, D), ref) if (m is not None or not variable) else None
                times, errors = _timed(rotating(fns), calls, args)
            candidates.append(dict(form=form, masked=m is not None, times=times, errors=errors, err=err))
        if candidates:
            break  # a masked run is preferred; unmasked only when no form takes the mask
    best = _best(candidates)
    if best is None:
        return {}, notes, [f"{label}: unavailable" + ("" if notes else " (no timing)")] + \
            [f"{label} {form['form']} {e}" for form in candidates for e in form["errors"]]
    how = "q [B, HQ, 1, D], enable_gqa=True" if best["form"] == "enable_gqa" else "q packed as [B, HKV, G, D]"
    tried = ", ".join(f"{c['form']} {fmt_us(c['times'].get('graph'))}" for c in candidates)
    notes.append(f"{label}: {how} (graph µs: {tried})")
    if variable:
        notes.append(f"{label}: K/V padded to the longest sequence ({data.max_len} tokens) " +
                     ("with a boolean key mask" if best["masked"] else
                      "WITHOUT a mask (refused): timing only, the output is not the decode result"))
    if best["err"] is not None:
        notes.append(f"{label}: rel err {best['err']:.2e} vs the float32 reference of the bf16 cache")
    return best["times"], notes, [f"{label} {e}" for e in best["errors"]]


def _fa_kvcache_peer(data, native, calls, args, ref):
    """flash_attn.flash_attn_with_kvcache on tessera's own bf16 cache (same layout, paged where the case is, the
    lengths as cache_seqlens). Returns (times, notes, errors)."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception as e:  # noqa: BLE001 - usually not installed: a note, not an error
        return {}, [f"fa_kvcache: flash_attn not importable ({_short(e)})"], []
    B, HQ, D = data.q[0].shape

    def call(s):
        q, c = data.q[s], native[s]
        return lambda: flash_attn_with_kvcache(q.view(B, 1, HQ, D), c["k"], c["v"], cache_seqlens=data.lengths,
                                               block_table=data.block_table)
    fns = [call(s) for s in range(len(native))]
    try:
        y = fns[0]()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        _sync_quietly()
        return {}, [], [f"fa_kvcache: unavailable ({_short(e)})"]
    times, errs = _timed(rotating(fns), calls, args)
    notes = [f"fa_kvcache: rel err {rel_error(y.reshape(B, HQ, D), ref):.2e} vs the float32 reference of the "
             "bf16 cache"]
    return times, notes, [f"fa_kvcache {e}" for e in errs]


def decode_rows(args, l2_bytes):
    formats = [f for f in args.decode_formats.split(",") if f]
    for f in formats:
        if f not in DECODE_FORMATS:
            raise ValueError(f"unknown --decode-formats item {f!r} (expected {', '.join(DECODE_FORMATS)})")
    case_filter = [c for c in args.decode_cases.split(",") if c]
    rows = []
    for si, shape in enumerate(decode_shapes()):
        if case_filter and not any(c in shape["name"] for c in case_filter):
            continue
        fmts = [f for f in shape["formats"] if f in formats]
        if fmts:
            rows.extend(decode_case_rows(args, shape, fmts, 2000 + si, l2_bytes))
            torch.cuda.empty_cache()
    return rows


def decode_case_rows(args, shape, fmts, seed, l2_bytes):
    """The rows of one case: tessera in each format, against the peers timed once on the dense bf16 cache."""
    lengths = decode_lengths(shape["lengths"], shape["B"], shape["T"])
    rows = [DecodeRow(shape["name"], f, decode_bytes(shape, f, lengths)) for f in fmts]
    sets = {f: decode_sets(decode_bytes(shape, f, lengths), l2_bytes) for f in ("native", *fmts)}
    try:
        data = DecodeInputs(shape, max(sets.values()), seed)
    except Exception as e:  # noqa: BLE001
        for r in rows:
            r.errors.append(f"input setup: {_short(e)}")
        _sync_quietly()
        return rows

    # Peers, on dense bf16 K/V; their reference is the native format's.
    n_peer = sets["native"]
    peer_calls = decode_calls(decode_bytes(shape, "native", lengths), n_peer)
    peer_times, peer_notes, peer_errors = {}, [], []
    try:
        native = [data.cache("native", s) for s in range(n_peer)]
        ref_native = data.reference(native[0]["logical"], "native")
        # SDPA layout [B, HKV, L, D], contiguous, cut to the longest sequence.
        dense = [tuple(x.transpose(1, 2)[:, :, :data.max_len].contiguous() for x in data.kv[s]) for s in range(n_peer)]
        for peer, label in DECODE_PEERS:
            if peer == "fa_kvcache":
                t, n, e = _fa_kvcache_peer(data, native, peer_calls, args, ref_native)
            else:
                from torch.nn.attention import SDPBackend
                backend = SDPBackend.CUDNN_ATTENTION if peer == "cudnn" else SDPBackend.FLASH_ATTENTION
                t, n, e = _sdpa_peer(backend, label, data, dense, peer_calls, args, ref_native)
            peer_times[peer] = t
            peer_notes += n
            peer_errors += e
        del dense, native
    except Exception as e:  # noqa: BLE001
        peer_errors.append(f"peers: {_short(e)}")
        _sync_quietly()
    if shape["page_size"]:
        peer_notes.append("SDPA peers read a dense contiguous cache (no paging); fa_kvcache gets the same block "
                          "table as tessera")

    for r in rows:
        r.peers = {p: dict(t) for p, t in peer_times.items()}
        r.case_notes, r.case_errors = peer_notes, peer_errors
        try:
            decode_tessera(args, data, r, sets[r.fmt])
        except Exception as e:  # noqa: BLE001
            r.errors.append(f"tessera: {_short(e)}")
            _sync_quietly()
        torch.cuda.empty_cache()
    return rows


def decode_tessera(args, data, row, n_sets):
    """Times tessera.attention_decode in row.fmt on n_sets rotating caches and measures its error on set 0."""
    if tessera is None:
        raise RuntimeError(TESSERA_IMPORT_ERROR)
    fmt = row.fmt
    caches = [data.cache(fmt, s) for s in range(n_sets)]
    q0 = data.q[0]
    out = torch.empty_like(q0)

    def kwargs(c):
        return dict(format=fmt, k_scale=c["k_scale"], v_scale=c["v_scale"], block_table=data.block_table)

    ws_bytes = tessera.decode_workspace_size(q0, caches[0]["k"], caches[0]["v"], **kwargs(caches[0]))
    workspace = torch.empty((ws_bytes,), dtype=torch.uint8, device="cuda") if ws_bytes else None

    def call(s):
        q, c = data.q[s], caches[s]
        return lambda: tessera.attention_decode(q, c["k"], c["v"], data.lengths, out=out, workspace=workspace,
                                                **kwargs(c))
    fns = [call(s) for s in range(n_sets)]
    out.fill_(float("nan"))
    fns[0]()
    torch.cuda.synchronize()
    row.err = rel_error(out, data.reference(caches[0]["logical"], fmt))
    if fmt == "fp8":
        row.notes.append("fp8: per-KV-head fp32 scales (amax / 448)")
    for c in caches:
        del c["logical"]  # the timed loop does not need them
    row.tessera, errs = _timed(rotating(fns), decode_calls(row.bytes, n_sets), args)
    row.errors += [f"tessera {e}" for e in errs]
    if n_sets > 1:
        row.notes.append(f"tessera: {n_sets} rotating input sets (L2)")


def print_decode_tables(rows, copy_bps):
    for mode in ("graph", "eager"):
        head = ["case", "format", "tessera µs", "GB/s", "% copy BW"]
        for _, label in DECODE_PEERS:
            head += [f"{label} µs", f"{label}/tessera"]
        head.append("rel err")
        body = []
        for r in rows:
            bw = r.gbps(mode)
            cells = [r.case, r.fmt, fmt_us(r.tessera.get(mode)), "-" if bw is None else f"{bw:.0f}",
                     "-" if bw is None or not copy_bps else f"{100 * bw * 1e9 / copy_bps:.1f}"]
            for peer, _ in DECODE_PEERS:
                cells += [fmt_us(r.peers.get(peer, {}).get(mode)), fmt_ratio(r.speedup(peer, mode))]
            body.append(cells + [fmt_err(r.err)])
        print(f"attention decode, {mode} mode")
        print_aligned(head, body, text_cols=(0, 1))
        print()
    print("GB/s = bytes read and written (K/V rows and scales of the attended tokens, q, o, lengths, block table) "
          "/ time;\n% copy BW against the device-to-device copy above; <peer>/tessera = peer µs / tessera µs of the "
          "same mode\n(> 1: tessera is faster); peers run the dense bf16 cache of the same values whatever tessera's "
          "format;\nrel err = ||o - ref||_F / ||ref||_F against a float32 torch reference from tessera's dequantized "
          "cache")
    for i, r in enumerate(rows):
        if i == 0 or rows[i - 1].case != r.case:
            for note in r.case_notes:
                print(f"  note  [{r.case}] {note}")
            for err in r.case_errors:
                print(f"  error [{r.case}] {err}")
        for note in r.notes:
            print(f"  note  [{r.case} | {r.fmt}] {note}")
        for err in r.errors:
            print(f"  error [{r.case} | {r.fmt}] {err}")
# ----------------------------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------------------------


def fmt_us(t):
    if t is None:
        return "n/a"
    return f"{t:.2f}" if t < 100 else f"{t:.1f}"


def fmt_x(t, base):
    if t is None or base is None:
        return ""
    return f" ({t / base:.2f}x)"


def print_aligned(head, body, text_cols):
    """A " | "-separated table: columns in text_cols left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells):
        return " | ".join(c.ljust(w) if i in text_cols else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(head))
    print("-+-".join("-" * w for w in widths))
    for cells in body:
        print(line(cells))


def print_table(rows):
    head = ["case", "peer", "tessera eager µs", "tessera graph µs", "peer eager µs (x)", "peer graph µs (x)",
            "peer compile µs (x)"]
    body = []
    for r in rows:
        te, tg = r.tessera.get("eager"), r.tessera.get("graph")
        cells = [r.case, r.peer, fmt_us(te), fmt_us(tg)]
        for mode, base in (("eager", te), ("graph", tg), ("compile", te)):
            if mode not in r.peer_times:
                cells.append("-")
            else:
                t = r.peer_times[mode]
                cells.append(fmt_us(t) + fmt_x(t, base))
        body.append(cells)
    print_aligned(head, body, text_cols=(0, 1))
    print("\n(x) = peer µs / tessera µs of the same mode (compile vs tessera eager); > 1: tessera is faster")
    for r in rows:
        for note in r.notes:
            print(f"  note  [{r.case} | {r.peer}] {note}")
        for err in r.errors:
            print(f"  error [{r.case} | {r.peer}] {err}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--ops", default="gate,permute,unpermute,gemm,decode",
                    help="comma list of gate,permute,unpermute,gemm,decode")
    ap.add_argument("--gate-tokens", default="1,16,128,1024,4096,65536",
                    help="comma list of T for the gate cases")
    ap.add_argument("--tokens", type=int, default=4096, help="T of the permute / unpermute cases")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions (median)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--gemm-cases", default="", help="gemm: only shapes whose name contains one of these "
                    "comma-separated substrings (dsv3_gate_up/m8, qwen3, skewed, ...); default all")
    ap.add_argument("--gemm-kinds", default=",".join(GEMM_KINDS), help="gemm: comma list of " + ",".join(GEMM_KINDS))
    ap.add_argument("--fast-accum", action="store_true",
                    help="gemm: torch._scaled_grouped_mm with use_fast_accum=True (default False)")
    ap.add_argument("--decode-cases", default="", help="decode: only cases whose name contains one of these "
                    "comma-separated substrings (hq8kv1/B128, llama3_8b, paged16, zipf, T131072, ...); default all")
    ap.add_argument("--decode-formats", default=",".join(DECODE_FORMATS),
                    help="decode: comma list of " + ",".join(DECODE_FORMATS) + " (a case runs those of its own)")
    args = ap.parse_args(argv)
    args.gate_tokens = [int(t) for t in args.gate_tokens.split(",") if t]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]

    builders = dict(gate=gate_rows, permute=permute_rows, unpermute=unpermute_rows)
    for op in ops:
        if op not in builders and op not in ("gemm", "decode"):
            ap.error(f"unknown op {op!r}")
    if torch is None:
        print(f"bench/compare.py: {TORCH_IMPORT_ERROR}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/compare.py: no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(torch.cuda.current_device())
    header = dict(device=dev.name, torch=torch.__version__, cuda=torch.version.cuda,
                  tessera=getattr(tessera, "version", None), tessera_error=TESSERA_IMPORT_ERROR)
    print(f"device: {dev.name} | torch {torch.__version__} (CUDA {torch.version.cuda}) | tessera "
          f"{header['tessera'] or 'unavailable'}")
    if TESSERA_IMPORT_ERROR:
        print(f"  {TESSERA_IMPORT_ERROR}")
    copy_bps = None
    if "decode" in ops:
        copy_bps, copy_bytes = copy_bandwidth()
        header.update(copy_bw_gbps=copy_bps and copy_bps / 1e9, l2_bytes=_l2_bytes(dev))
        if copy_bps:
            print(f"copy bandwidth: {copy_bps / 1e9:.1f} GB/s (device-to-device copy of {copy_bytes >> 20} MiB, "
                  "read + write)")
    print()

    rows, g_rows, d_rows = [], [], []
    for op in ops:
        if op == "decode":
            try:
                d_rows = decode_rows(args, _l2_bytes(dev))
            except Exception as e:  # noqa: BLE001
                r = DecodeRow("decode", "-", 0)
                r.errors += [f"{type(e).__name__}: {e}", traceback.format_exc().strip().splitlines()[-1]]
                d_rows = [r]
            continue
        if op == "gemm":
            try:
                g_rows = gemm_rows(args)
            except Exception as e:  # noqa: BLE001
                r = GemmRow("gemm", "-", "-", "-", 0.0)
                r.errors.append(f"{type(e).__name__}: {e}")
                r.notes.append(traceback.format_exc().strip().splitlines()[-1])
                g_rows = [r]
            continue
        try:
            rows.extend(builders[op](args))
        except Exception as e:  # noqa: BLE001 - a broken op must not hide the others
            r = Row(op, "-")
            r.errors.append(f"{type(e).__name__}: {e}")
            r.notes.append(traceback.format_exc().strip().splitlines()[-1])
            rows.append(r)
    if rows:
        print_table(rows)
    if g_rows:
        if rows:
            print()
        print_gemm_table(g_rows)
    if d_rows:
        if rows or g_rows:
            print()
        print_decode_tables(d_rows, copy_bps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header, rows=[r.as_dict() for r in rows], gemm_rows=[r.as_dict() for r in g_rows],
                           decode_rows=[r.as_dict() for r in d_rows]), f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
