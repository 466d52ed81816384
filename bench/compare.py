#!/usr/bin/env python3
"""tessera vs PyTorch peers on the MoE routing ops, in one process on one GPU.

    PYTHONPATH=build/python python bench/compare.py [--json results.json] [--ops gate,permute,unpermute]

Cases
  gate       DeepSeek-V3 (E=256, 8 groups, 4 kept, top-8, sigmoid + fp32 bias, top-2-sum, renormalize, x2.5),
             fp32 logits, T in {1, 16, 128, 1024, 4096, 65536}
  permute    T=4096, k=8, H=7168 bf16, E=256: quant none and fp8_blockwise
  unpermute  T=4096, k=8, H=7168 bf16, E=256

Peers (same output contract as tessera: sorted top-k ids int32 + fp32 weights; expert-grouped rows + offsets +
row index; fp8 e4m3 + per-128-column scales; bf16 weighted sum with fp32 accumulation)
  gate       the usual torch biased_grouped_topk (sigmoid, +bias, group top-2 sum, top groups, masked_fill, topk,
             gather, renorm, scale): eager, eager captured in a CUDA graph, torch.compile (default mode)
  permute    stable argsort of the flattened ids + index_select (+ a torch blockwise fp8 quantization)
  unpermute  gather + weighted sum (fp32) and index_add_ (fp32)

Timing: CUDA events around `calls` back-to-back calls, after warmup; median over reps; per-call microseconds.
"graph" modes capture `calls` calls into one CUDA graph and time its replays. Small cases use calls=20, so launch
overhead (eager) or graph launch cost is amortized the same way for everyone. Inputs are reused across calls (hot
L2 where they fit). Speedup = peer time / tessera time of the same mode (eager peers and torch.compile against
tessera eager, graph against graph); > 1 means tessera is faster.

A missing tessera (or a tessera op that fails) is reported in its row; the other rows still run.
"""

import argparse
import json
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
    ap.add_argument("--ops", default="gate,permute,unpermute", help="comma list of gate,permute,unpermute")
    ap.add_argument("--gate-tokens", default="1,16,128,1024,4096,65536",
                    help="comma list of T for the gate cases")
    ap.add_argument("--tokens", type=int, default=4096, help="T of the permute / unpermute cases")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions (median)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
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
    rows = []
    for op in ops:
        if op not in builders:
            ap.error(f"unknown op {op!r}")
        try:
            rows.extend(builders[op](args))
        except Exception as e:  # noqa: BLE001 - a broken op must not hide the others
            r = Row(op, "-")
            r.errors.append(f"{type(e).__name__}: {e}")
            r.notes.append(traceback.format_exc().strip().splitlines()[-1])
            rows.append(r)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header, rows=[r.as_dict() for r in rows]), f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
