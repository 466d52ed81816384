#!/usr/bin/env python3
"""tessera vs PyTorch peers on the MoE routing ops and the grouped expert GEMM, in one process on one GPU.

    PYTHONPATH=build/python python bench/compare.py [--json results.json] [--ops gate,permute,unpermute,gemm]
    PYTHONPATH=build/python python bench/compare.py --ops gemm [--gemm-cases dsv3,qwen3] [--gemm-kinds fp8_tensor]

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

import torch

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
    text = (0, 1, 5)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells):
        return " | ".join(c.ljust(w) if i in text else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(head))
    print("-+-".join("-" * w for w in widths))
    for cells in body:
        print(line(cells))
    print("\nTFLOP/s from the graph times; tessera/peer = tessera graph µs / peer graph µs (< 1: tessera is faster);"
          "\nrel err = ||y - ref||_F / ||ref||_F against a float64 GPU reference computed from the dequantized inputs")
    for r in rows:
        for note in dict.fromkeys(r.notes):
            print(f"  note  [{r.case} | {r.layout}] {note}")
        for err in r.errors:
            print(f"  error [{r.case} | {r.layout}] {err}")


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
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells):
        return " | ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(head))
    print("-+-".join("-" * w for w in widths))
    for cells in body:
        print(line(cells))
    print("\n(x) = peer µs / tessera µs of the same mode (compile vs tessera eager); > 1: tessera is faster")
    for r in rows:
        for note in r.notes:
            print(f"  note  [{r.case} | {r.peer}] {note}")
        for err in r.errors:
            print(f"  error [{r.case} | {r.peer}] {err}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--ops", default="gate,permute,unpermute,gemm", help="comma list of gate,permute,unpermute,gemm")
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
    args = ap.parse_args(argv)
    args.gate_tokens = [int(t) for t in args.gate_tokens.split(",") if t]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]

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
    print()

    builders = dict(gate=gate_rows, permute=permute_rows, unpermute=unpermute_rows)
    for op in ops:
        if op not in builders and op != "gemm":
            ap.error(f"unknown op {op!r}")
    rows, g_rows = [], []
    for op in ops:
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header, rows=[r.as_dict() for r in rows], gemm_rows=[r.as_dict() for r in g_rows]), f,
                      indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
