"""Grouped expert GEMM peers: torch._scaled_grouped_mm (fp8) and torch._grouped_mm (bf16).

Cases: tessera-bench's (bench/gemm_cases.cpp): '<shape>/m<rows>[/tensor|/block]' (and '/M<rows>' for the skewed
shapes, '/T<tokens>' for the routed ones) for the ops grouped_gemm_fp8 (per-tensor or DeepSeek-V3 block-wise 1x128 /
128x128 scales), grouped_gemm_bf16 and their _masked layouts (decode shapes: max_m = 4 x rows for the uniform ones,
T for dsv3_decode_routed). tessera-bench's own peer, a cuBLASLt loop over
the groups, joins these rows in a merged run.

The routed shapes (dsv3_gate_up_routed/T4096, dsv3_decode_routed/T64) take their group sizes from tessera's own
DeepSeek-V3 gate (tessera.fused_gate, on the GPU) on the biased logits of bench/routing_rows.h, built here bit for
bit (routed_logits): the same kernel on the same inputs as tessera-bench's setup, so the same sizes. They are
computed when a case of such a shape first runs (once per process); listing and parsing the cases needs no GPU.

With --gemm-peers torch,flashinfer the bf16 rows also run flashinfer.SegmentGEMMWrapper (CUTLASS grouped GEMM;
opt-in, its JIT build takes minutes). FlashInfer 0.7.2's grouped fp8 GEMMs (group_gemm_fp8_nt_groupwise,
group_deepgemm_fp8_nt_groupwise) are Blackwell-only: no fp8 FlashInfer peer on Hopper.

torch._scaled_grouped_mm takes row-wise scales (scale_a [M], scale_b [G, N]; mat_b = w.transpose(-2, -1); offs =
int32 cumulative ends [G]; bf16 out; use_fast_accum per --fast-accum), on the contiguous layout; it is the peer of
tessera's masked rows too. Block-wise scales have no torch grouped equivalent: torch runs the same GEMM with
row-wise scales (those of the first K block). Errors: relative Frobenius error of each output against a float64
GPU reference from the dequantized inputs (of torch's own scales for the block-wise rows), on the timed data.
"""

import math
import time

from . import common as C
from .common import Case, Row

KINDS = ("fp8_tensor", "fp8_block", "bf16")
OPS = ("grouped_gemm_fp8", "grouped_gemm_fp8_masked", "grouped_gemm_bf16", "grouped_gemm_bf16_masked")
_SUFFIX = {"fp8_tensor": "/tensor", "fp8_block": "/block", "bf16": ""}


def zipf_rows(groups, total, empty, s, seed):
    """bench/gemm_cases.cpp's zipf_rows: `empty` random groups get no rows, the others (in random order)
    total * r^-s / H rows for rank r, rounded down, the remainder to the largest."""
    rng = C.SplitMix64(seed)
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


# bench/gemm_cases.cpp's skew_one_big: 256 groups, all empty but these (group: rows).
SKEW_ONE_BIG = {37: 1000, 5: 3, 64: 1, 128: 12, 200: 6, 255: 2}

# bench/routing_rows.h: the seed of the routed shapes' logits and tessera's DeepSeek-V3 gate on them.
ROUTED_SEED = 0xD5E3
ROUTED_EXPERTS = 256
ROUTED_GATE = dict(topk=8, num_groups=8, topk_groups=4, scoring="sigmoid", group_score="top2_sum", renormalize=True,
                   routed_scaling_factor=2.5)


def routed_logits(tokens, experts, seed):
    """bench/routing_rows.h's biased_logits as Python ints in units of 2^-17 (logits, [T*E] row-major) and 2^-19
    (bias, [E]), from the splitmix64 stream of `seed`: popularity p[e] = (d >> 48) - 2^15 (draws 0..E-1); bias[e] =
    ((d >> 48) - 2^15) 2^-19 (draws E..2E-1); noise n = the sum of the four 16-bit fields of d - 2^17 (draw
    2E + t E + e); logit = (5 n + 2 p[e]) 2^-17. All below 2^24 in magnitude: exact in float32."""
    rng = C.SplitMix64(seed)
    pop = [(rng.next() >> 48) - (1 << 15) for _ in range(experts)]
    bias = [(rng.next() >> 48) - (1 << 15) for _ in range(experts)]
    logits = []
    for _ in range(tokens):
        for e in range(experts):
            d = rng.next()
            n = (d & 0xFFFF) + ((d >> 16) & 0xFFFF) + ((d >> 32) & 0xFFFF) + (d >> 48) - (1 << 17)
            logits.append(5 * n + 2 * pop[e])
    return logits, bias


_ROUTED_ROWS = {}


def routed_rows(tokens, seed=ROUTED_SEED):
    """Rows per expert [E] of tessera.fused_gate (ROUTED_GATE) on routed_logits(tokens): on the GPU, once per
    process."""
    key = (tokens, seed)
    if key not in _ROUTED_ROWS:
        torch = C.torch
        if C.tessera is None:
            raise RuntimeError(f"the routed shapes need tessera's gate: {C.TESSERA_IMPORT_ERROR}")
        E = ROUTED_EXPERTS
        li, bi = routed_logits(tokens, E, seed)
        logits = (torch.tensor(li, dtype=torch.int64).to(torch.float32) * 2.0 ** -17).view(tokens, E).to(C.DEVICE)
        bias = (torch.tensor(bi, dtype=torch.int64).to(torch.float32) * 2.0 ** -19).to(C.DEVICE)
        _, ids = C.tessera.fused_gate(logits, bias, **ROUTED_GATE)
        ids = ids.flatten().long()
        if ids.numel() != tokens * ROUTED_GATE["topk"] or bool(((ids < 0) | (ids >= E)).any()):
            raise RuntimeError("the routed shapes' gate returned ids out of range")
        _ROUTED_ROWS[key] = [int(c) for c in torch.bincount(ids, minlength=E).tolist()]
    return _ROUTED_ROWS[key]


def shape_rows(shape):
    """The shape's rows per group; for a routed shape, tessera's gate's (needs the GPU), kept in the shape."""
    if shape["rows"] is None:
        shape["rows"] = routed_rows(shape["tokens"])
    return shape["rows"]


def shapes():
    """The shapes of bench/gemm_cases.cpp: name, rows per group (None for a routed shape until shape_rows), N, K,
    max_m of the masked variant (0: none); routed shapes also tokens."""
    def uniform(name, groups, m, n, k, decode):
        return dict(name=f"{name}/m{m}", rows=[m] * groups, n=n, k=k, max_m=4 * m if decode else 0)

    def routed(name, tokens, n, k, masked):
        return dict(name=f"{name}/T{tokens}", rows=None, tokens=tokens, n=n, k=k, max_m=tokens if masked else 0)

    out = [
        uniform("dsv3_gate_up", 32, 8, 4096, 7168, True),
        uniform("dsv3_gate_up", 32, 128, 4096, 7168, False),
        uniform("dsv3_gate_up", 32, 1024, 4096, 7168, False),
        uniform("dsv3_down", 32, 1024, 7168, 2048, False),
        uniform("qwen3_gate_up", 128, 256, 1536, 2048, False),
        uniform("qwen3_down_decode", 128, 4, 2048, 768, True),
        uniform("dense", 1, 8192, 8192, 8192, False),
    ]
    skewed = zipf_rows(128, 32768, 16, 1.1, 0x5EED)
    out.append(dict(name=f"skewed_zipf/M{sum(skewed)}", rows=skewed, n=1536, k=2048, max_m=0))
    big = [0] * 256
    for g, r in SKEW_ONE_BIG.items():
        big[g] = r
    out.append(dict(name=f"skew_one_big/M{sum(big)}", rows=big, n=2048, k=7168, max_m=0))
    out.append(routed("dsv3_gate_up_routed", 4096, 4096, 7168, False))
    out.append(routed("dsv3_decode_routed", 64, 4096, 7168, True))
    return out


def registry():
    names = []
    for sh in shapes():
        for kind in KINDS:
            base = "grouped_gemm_bf16" if kind == "bf16" else "grouped_gemm_fp8"
            names.append((base, sh["name"] + _SUFFIX[kind]))
            if sh["max_m"]:
                names.append((base + "_masked", sh["name"] + _SUFFIX[kind]))
    return names


def parse(op, name):
    if op not in OPS:
        return None
    fp8 = op.startswith("grouped_gemm_fp8")
    for sh in shapes():
        for kind in (("fp8_tensor", "fp8_block") if fp8 else ("bf16",)):
            if name == sh["name"] + _SUFFIX[kind]:
                layout = "masked" if op.endswith("_masked") else "contiguous"
                if layout == "masked" and not sh["max_m"]:
                    return None
                return dict(shape=sh, kind=kind, layout=layout)
    return None


def _random_fp8(shape, gen):
    # Quantized-looking e4m3: a normal distribution with its 4.7-sigma tail at the format's 448, all finite.
    return (C.torch.randn(shape, device=C.DEVICE, generator=gen) * 96.0).clamp_(-448.0, 448.0).to(C.fp8_dtype())


def _random_scales(shape, gen, lo, hi):
    return C.torch.exp2(C.torch.empty(shape, device=C.DEVICE).uniform_(lo, hi, generator=gen)).float()


class GemmData:
    """One set of inputs for a shape and kind, in tessera's layouts (and the masked copies for decode shapes)."""

    def __init__(self, shape, kind, seed, masked):
        torch = C.torch
        g = C.generator(seed)
        rows, n, k = shape["rows"], shape["n"], shape["k"]
        self.kind, self.rows, self.n, self.k = kind, rows, n, k
        self.groups, self.m = len(rows), sum(rows)
        self.max_m = shape["max_m"] if masked else 0
        self.starts = [0]
        for r in rows:
            self.starts.append(self.starts[-1] + r)
        self.offsets = torch.tensor(self.starts, dtype=torch.int32, device=C.DEVICE)  # tessera: [G+1] from 0
        self.offs_end = self.offsets[1:].contiguous()  # torch: [G] cumulative ends
        fp8 = kind != "bf16"
        if fp8:
            self.x = _random_fp8((self.m, k), g)
            self.w = torch.empty((self.groups, n, k), dtype=C.fp8_dtype(), device=C.DEVICE)
            for e in range(self.groups):  # per group: bounded float32 temporaries
                self.w[e] = _random_fp8((n, k), g)
        else:
            self.x = torch.empty((self.m, k), device=C.DEVICE).uniform_(-1.0, 1.0, generator=g).bfloat16()
            self.w = torch.empty((self.groups, n, k), dtype=torch.bfloat16, device=C.DEVICE)
            for e in range(self.groups):
                self.w[e] = torch.empty((n, k), device=C.DEVICE).uniform_(-1.0, 1.0, generator=g).bfloat16()
        self.scale_mode = {"fp8_tensor": "per_tensor", "fp8_block": "blockwise"}.get(kind)
        if kind == "fp8_tensor":
            self.xs = _random_scales((1,), g, -9.0, -7.0)
            self.ws = _random_scales((self.groups,), g, -11.0, -9.0)
            self.sa = self.xs.expand(self.m).contiguous()
            self.sb = self.ws[:, None].expand(self.groups, n).contiguous()
        elif kind == "fp8_block":
            self.xs = _random_scales((self.m, k // 128), g, -10.0, -6.0)
            self.ws = _random_scales((self.groups, n // 128, k // 128), g, -12.0, -8.0)
            self.sa = self.xs[:, 0].contiguous()
            self.sb = self.ws[:, :, 0].repeat_interleave(128, dim=1).contiguous()
        if self.max_m:
            # Masked layout: group e's rows are the first rows[e] of x_masked[e]; the rest are filled too (unused).
            mm = self.max_m
            self.masked_m = torch.tensor(rows, dtype=torch.int32, device=C.DEVICE)
            if fp8:
                self.x_masked = _random_fp8((self.groups, mm, k), g)
            else:
                self.x_masked = torch.empty((self.groups, mm, k), device=C.DEVICE).uniform_(-1, 1, generator=g).bfloat16()
            if kind == "fp8_block":
                self.xs_masked = _random_scales((self.groups, mm, k // 128), g, -10.0, -6.0)
            for e, r in enumerate(rows):
                s = self.starts[e]
                self.x_masked[e, :r] = self.x[s:s + r]
                if kind == "fp8_block":
                    self.xs_masked[e, :r] = self.xs[s:s + r]

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
    """outputs: name -> (rows_of(e) -> tensor [rows[e], N], uses torch scales). Returns name -> error."""
    acc = {name: [0.0, 0.0] for name in outputs}
    for e, r in enumerate(data.rows):
        if r == 0:
            continue
        refs = {}
        for name, (rows_of, torch_scales) in outputs.items():
            if torch_scales not in refs:
                refs[torch_scales] = data.reference(e, torch_scales)
            ref = refs[torch_scales]
            acc[name][0] += (rows_of(e).double() - ref).pow(2).sum().item()
            acc[name][1] += ref.pow(2).sum().item()
    return {name: (math.sqrt(a / b) if b > 0 else None) for name, (a, b) in acc.items()}


def rows(cases, args):
    """Cases grouped by (shape, kind): the inputs and the torch peer are shared by the contiguous and masked rows."""
    groups = {}
    for case in cases:
        groups.setdefault((case.spec["shape"]["name"], case.spec["kind"]), []).append(case)
    return C.guarded_rows(list(groups.values()), lambda group, si: group_rows(group, args, 1000 + si))


def group_rows(group, args, seed):
    torch = C.torch
    shape, kind = group[0].spec["shape"], group[0].spec["kind"]
    shape_rows(shape)  # a routed shape's sizes: tessera's gate, now that a case of it runs
    flops = 2.0 * sum(shape["rows"]) * shape["n"] * shape["k"]
    elt = 2 if kind == "bf16" else 1
    nbytes = (sum(1 for r in shape["rows"] if r) * shape["n"] * shape["k"] * elt
              + sum(shape["rows"]) * (shape["k"] * elt + shape["n"] * 2))
    calls = C.calls_for(max(flops / 600e12, nbytes / 3e12) * 1e6)
    rows = {c.spec["layout"]: Row(c.op, c.name, nbytes, flops) for c in group}
    masked = "masked" in rows
    if kind != "bf16" and C.fp8_dtype() is None:
        raise RuntimeError("this torch has no float8_e4m3fn")
    d = GemmData(shape, kind, seed, masked)
    y_c = torch.empty((d.m, d.n), dtype=torch.bfloat16, device=C.DEVICE)
    y_m = torch.empty((d.groups, d.max_m, d.n), dtype=torch.bfloat16, device=C.DEVICE) if masked else None

    def tessera_fn(layout):
        t = C.tessera
        if kind == "bf16":
            if layout == "contiguous":
                return lambda: t.grouped_gemm_bf16(d.x, d.w, d.offsets, out=y_c)
            return lambda: t.grouped_gemm_bf16_masked(d.x_masked, d.w, d.masked_m, out=y_m)
        if layout == "contiguous":
            return lambda: t.grouped_gemm_fp8(d.x, d.w, d.offsets, d.xs, d.ws, scale_mode=d.scale_mode, out=y_c)
        xs = d.xs_masked if kind == "fp8_block" else d.xs
        return lambda: t.grouped_gemm_fp8_masked(d.x_masked, d.w, d.masked_m, xs, d.ws, scale_mode=d.scale_mode,
                                                 out=y_m)

    outputs = {}  # name -> (group e -> its rows of the output, uses torch's scales)
    for layout, r in rows.items():
        if C.run_tessera_fn(r, lambda layout=layout: tessera_fn(layout), calls, args) is None:
            continue
        if layout == "contiguous":
            y_c.fill_(float("nan"))
            tessera_fn(layout)()
            kept = y_c.clone()
            outputs[layout] = ((lambda e, kept=kept: kept[d.starts[e]:d.starts[e + 1]]), False)
        else:
            y_m.fill_(float("nan"))
            tessera_fn(layout)()
            kept = y_m.clone()
            outputs[layout] = ((lambda e, kept=kept: kept[e, :d.rows[e]]), False)

    # The torch peer, on the contiguous layout (it is the masked rows' peer too).
    label = "torch"
    peer_fn, peer_err = None, None
    use_torch = "torch" in args.gemm_peers.split(",")
    if not use_torch:
        pass
    elif kind == "bf16" and not hasattr(torch, "_grouped_mm"):
        peer_err = f"peer unavailable: torch {torch.__version__} has no torch._grouped_mm"
    elif kind != "bf16" and not hasattr(torch, "_scaled_grouped_mm"):
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
            C.sync()
            outputs["peer"] = ((lambda e: y_p[d.starts[e]:d.starts[e + 1]]), kind == "fp8_block")
        except Exception as e:  # noqa: BLE001
            peer_err = f"peer unavailable: {C.short(e)}"
            peer_fn = None
            C.sync_quietly()
    times, errs = (C.timed(peer_fn, calls, args) if peer_fn is not None else ({}, []))
    for r in rows.values():
        if use_torch:
            r.add_peer(label, times, errs)
        if peer_err:
            r.errors.append(f"{label}: {peer_err}")
    if kind == "bf16" and "flashinfer" in args.gemm_peers.split(","):
        _flashinfer_segment_gemm(d, rows, outputs, calls, args)

    try:
        errs = rel_fro_errors(d, outputs)
        for layout, r in rows.items():
            r.rel_err["tessera"] = errs.get(layout)
            r.rel_err[label] = errs.get("peer")
            if errs.get("flashinfer") is not None:
                r.notes.append(f"FI segment: rel err {errs['flashinfer']:.1e} vs the float64 reference")
    except Exception as e:  # noqa: BLE001
        for r in rows.values():
            r.notes.append(f"error check failed: {C.short(e)}")
    for r in rows.values():
        if not use_torch:
            continue
        if r.rel_err.get(label) is not None:
            r.notes.append(f"{label}: rel err {r.rel_err[label]:.1e} vs the float64 reference")
        if kind == "fp8_block":
            r.notes.append("torch has no block-wise grouped fp8 GEMM: it runs row-wise scales (those of the first K "
                           "block); its error is against the float64 reference of those scales")
        if kind != "bf16":
            label_name = "torch._scaled_grouped_mm" + (" use_fast_accum=True" if args.fast_accum else "")
        else:
            label_name = "torch._grouped_mm"
        r.notes.append(f"torch = {label_name}, contiguous layout")
    return list(rows.values())


def _flashinfer_segment_gemm(d, rows, outputs, calls, args):
    """flashinfer.SegmentGEMMWrapper (CUTLASS grouped GEMM, its SM90 kernels on Hopper) on tessera's bf16 contiguous
    layout: x [M, K], w [G, N, K] (weight_column_major=True), seg_indptr int64 [G+1]. Opt-in (--gemm-peers): its
    JIT build is a CUTLASS grouped GEMM, minutes rather than seconds. The peer of the masked rows too."""
    fi, _ = C.optional_module("flashinfer")
    if fi is None:  # named once under the tables
        return
    torch = C.torch
    label = "FI segment"
    try:
        seg = fi.SegmentGEMMWrapper(torch.empty((128 << 20,), dtype=torch.int8, device=C.DEVICE))
        indptr = d.offsets.to(torch.int64)
        y_f = torch.empty((d.m, d.n), dtype=torch.bfloat16, device=C.DEVICE)
        fn = lambda: seg.run(d.x, d.w, d.groups, True, out=y_f, seg_indptr=indptr)  # noqa: E731
        t0 = time.perf_counter()
        fn()
        C.sync()
        if not _FI_BUILT.get("segment"):
            _FI_BUILT["segment"] = True
            C.NOTES.append(f"flashinfer: SegmentGEMMWrapper's first call took {time.perf_counter() - t0:.1f} s "
                           "(its JIT build)")
        outputs["flashinfer"] = ((lambda e: y_f[d.starts[e]:d.starts[e + 1]]), False)
    except Exception as e:  # noqa: BLE001
        C.sync_quietly()
        for r in rows.values():
            r.peers[label] = {}
            r.errors.append(f"{label}: unavailable ({C.short(e)})")
        return
    times, errs = C.timed(fn, calls, args)
    for r in rows.values():
        r.add_peer(label, times, errs, ["FI segment = flashinfer.SegmentGEMMWrapper, contiguous layout"])


_FI_BUILT = {}


def cases_from_args(args):
    """Standalone runs: the registry filtered by --gemm-cases (substrings) and --gemm-kinds."""
    kinds = [k for k in args.gemm_kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown --gemm-kinds item {k!r} (expected {', '.join(KINDS)})")
    return [c for c in (Case(op, name, parse(op, name)) for op, name in registry()) if keep(c, args)]


def keep(case, args):
    """Whether --gemm-cases / --gemm-kinds keep a case (also applied to a merged tessera-bench run)."""
    subs = [c for c in args.gemm_cases.split(",") if c]
    kinds = [k for k in args.gemm_kinds.split(",") if k]
    return (not subs or any(s in case.name for s in subs)) and case.spec["kind"] in kinds
