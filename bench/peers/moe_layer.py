"""The whole MoE layer (tessera.moe_layer.moe_layer) against the same layer composed of tessera's ops with torch glue,
a torch eager layer and torch.compile of it.

Cases: tessera-bench's (bench/moe_layer_cases.cpp): '<model>/T<tokens>/<format>' for the op 'moe_layer':
  model   dsv3     DeepSeek-V3: E 256 + 1 shared expert, top-8 among the 4 best of 8 groups (top-2 sum), sigmoid,
                   correction bias, renormalized, routed scale 2.5; H 7168, I 2048
          qwen3    Qwen3-235B-A22B: E 128, top-8, softmax, renormalized; H 4096, I 1536
          mixtral  Mixtral-8x7B: E 8, top-2, softmax, renormalized; H 4096, I 14336
  T       1, 16, 128, 512, 4096, 16384
  format  fp8_blockwise (all), fp8_per_tensor (qwen3, mixtral), bf16 (qwen3 at T 1, 128, 4096)
A merged run (--with-bench / --bench-json) takes tessera-bench's cases (its headline six by default: dsv3 T 1, 128,
4096 fp8_blockwise; qwen3 T 16, 4096 fp8_blockwise; mixtral T 512 fp8_per_tensor). A standalone run measures those
six, or every case with --all, or the cases --moe-layer-cases names (substrings, among all of them).

Inputs (made here on the GPU, one set: the weights alone are far over twice the L2 in every case):
  router logits [T, E] fp32 (+ DeepSeek-V3's correction bias [E]): router_inputs, the same values bit for bit as
          tessera-bench's (bench/moe_layer_cases.cpp states the draws): N(0, 1.01^2) noise plus a per-expert
          N(0, 0.29^2) bias plus 1.0 on max(1, E/32) hot experts (~5x the mean rows on a hot expert of DeepSeek-V3
          and Qwen3, ~2.3x on Mixtral's), so that the two benchmarks route a case alike.
  x       bf16 N(0, 1) times 2^U(-1, 1) per token.
  weights fp8: uniform random e4m3 bytes (NaN codes moved to the next value down; RMS 107.2) with scales 2^U(c - 1,
          c + 1), c = -log2(107.2 sqrt(K)); fp8_blockwise: one scale per 128x128 block that is the same along K for
          a block row (w13_scale [G, 2I/128, H/128] = s[G, 2I/128] broadcast), so that torch's per-channel weight
          scales express the same weights exactly; fp8_per_tensor: one per expert, a13 = amax(x) / 448, a2 = 32 / 448.
          bf16: N(0, 1/K). Made once per (model, format), kept for its cases.

Rows (labels in the table; every implementation's y is checked against tessera's: "err" = ||y - y_tessera||_F /
||y_tessera||_F over all rows, so that a wrong peer shows):
  tessera   tessera.moe_layer.moe_layer(x, logits, weights, plan(cfg, T), correction_bias=..., out=y, workspace=ws),
            y and the workspace preallocated (tessera-bench's µs in a merged run; this process's in the "py µs" column).
  ops+glue  the same layer from tessera's public ops, with the activation in torch: tessera.fused_gate ->
            tessera.permute (quant 'fp8_blockwise' / 'fp8_per_tensor' / none) -> tessera.grouped_gemm_fp8 (bf16)
            -> torch silu(g) * u (fp32) + torch quantization (fp8_blockwise: per row and 128 columns, amax / 448;
            fp8_per_tensor: / a2, saturated; bf16: rounded) -> tessera.grouped_gemm_fp8 (bf16) ->
            tessera.unpermute_reduce; outputs and workspaces preallocated. The same math as the layer: err ~1e-3.
  torch     a torch eager layer: the gate in torch ops (sigmoid / softmax, correction bias, group top-2 sums,
            topk, renormalize, routed scale, shared expert slot), a stable argsort by expert, index_select, then
            fp8: torch._scaled_grouped_mm for both GEMMs with row-wise scales, i.e. a per-token activation scale and
            per-channel weight scales: for fp8_blockwise a different, cheaper activation quantization than DeepSeek's
            1x128 blocks (err a few 1e-2 from that alone); for fp8_per_tensor the static a13 / a2 as row scales (the
            same quantization as tessera's); bf16: torch._grouped_mm; silu(g) * u in fp32; the weighted sum with
            index_add_ in fp32. The "torch quant" column names the activation quantization torch ran.
  compile   torch.compile(mode="default", dynamic=False) of that torch layer; compile time excluded (its first
            calls precede the timing); skipped with the reason in the notes when compilation fails.
--moe-layer-peers chooses them (default composed,torch); --compile (or 'compile' in that list) adds the compile row,
opt-in as the gate's is: its compilation takes ~20-60 s a case.

"% floor": the bound of the row and tessera's % of it. Bytes = the weights of the experts the routing activates +
x + logits + y (tessera-bench's count in a merged run; here the distinct ids of tessera's gate), FLOPs = 2 T (k + s)
(2I H + H I). The row is read-bound when bytes / read ceiling >= FLOPs / GEMM ceiling, else compute-bound. Read
ceiling: tessera-bench's measured read bandwidth (merged), else the copy bandwidth measured here ("copy"). GEMM
ceiling: measured in this process on 8192^3 (fp8: torch._scaled_mm with per-tensor scales, use_fast_accum=False;
bf16: torch.matmul), the ceiling rows; where not measured, the declared dense peaks --moe-layer-fp8-peak (1979
TFLOP/s) and --moe-layer-bf16-peak (989 TFLOP/s), H100 / H200 SXM. "% read" and "% ceil" give both figures.
"""

import math
import re

from . import common as C
from .common import Case, Row

OP = "moe_layer"
CEILING_OP = "torch_gemm_ceiling"  # this script's ceiling rows (tessera-bench has none)
# bench/compare.py registers these with bench/peers/merge.py: the tessera-bench ops this family parses, the --op list
# of `--ops moe_layer`, the labels of C++ peers (none), the table's title.
MERGED_OPS = (OP,)
BENCH_OPS = [OP]
CPP_PEER_LABELS = {}
TITLE = "MoE layer (gate, permute, grouped GEMMs, SiLU·mul, reduce)"
PEERS = ("composed", "torch", "compile")
DEFAULT_PEERS = ("composed", "torch")  # compile: with --compile (as the gate's), or named in --moe-layer-peers
LABELS = {"composed": "ops+glue", "torch": "torch", "compile": "compile"}

FP8_PEAK_TFLOPS = 1979.0  # dense fp8 tensor-core peak, H100 / H200 SXM
BF16_PEAK_TFLOPS = 989.0
CEILING_DIM = 8192
CPU_CEILING_DIM = 256  # TESSERA_COMPARE_DEVICE=cpu smoke tests

ROUTER_SEED = 0x40E1A7E5  # bench/moe_layer_cases.cpp's kRouterSeed
BLOCK = 128
FP8_MAX = 448.0
A2_AMAX = 32.0  # fp8_per_tensor: a2_scale = A2_AMAX / 448 (tessera-bench's kA2Amax)
CODE_RMS = 107.2  # RMS of uniform random e4m3 bytes (NaN codes moved one down)

MODELS = {
    "dsv3": dict(hidden=7168, intermediate=2048, num_experts=256, topk=8, num_groups=8, topk_groups=4,
                 scoring="sigmoid", group_score="top2_sum", renormalize=True, routed_scaling_factor=2.5,
                 num_shared_experts=1, shared_expert_weight=1.0, correction_bias=True),
    "qwen3": dict(hidden=4096, intermediate=1536, num_experts=128, topk=8, num_groups=1, topk_groups=1,
                  scoring="softmax", group_score="top2_sum", renormalize=True, routed_scaling_factor=1.0,
                  num_shared_experts=0, shared_expert_weight=1.0, correction_bias=False),
    "mixtral": dict(hidden=4096, intermediate=14336, num_experts=8, topk=2, num_groups=1, topk_groups=1,
                    scoring="softmax", group_score="top2_sum", renormalize=True, routed_scaling_factor=1.0,
                    num_shared_experts=0, shared_expert_weight=1.0, correction_bias=False),
}
TOKENS = (1, 16, 128, 512, 4096, 16384)
# bench/moe_layer_cases.cpp's families, in its order: (model, format, tokens, headline tokens)
FAMILIES = [
    ("dsv3", "fp8_blockwise", TOKENS, (1, 128, 4096)),
    ("qwen3", "fp8_blockwise", TOKENS, (16, 4096)),
    ("qwen3", "fp8_per_tensor", TOKENS, ()),
    ("qwen3", "bf16", (1, 128, 4096), ()),
    ("mixtral", "fp8_blockwise", TOKENS, ()),
    ("mixtral", "fp8_per_tensor", TOKENS, (512,)),
]
GATE_KEYS = ("topk", "num_groups", "topk_groups", "scoring", "group_score", "renormalize", "routed_scaling_factor",
             "num_shared_experts", "shared_expert_weight")

_NAME = re.compile(r"^(dsv3|qwen3|mixtral)/T(\d+)/(fp8_blockwise|fp8_per_tensor|bf16)$")


def registry(headline_only=False):
    """tessera-bench's moe_layer cases in its order (every one, or its headline six)."""
    return [(OP, f"{m}/T{t}/{f}") for m, f, tokens, head in FAMILIES for t in tokens
            if not headline_only or t in head]


def parse(op, name):
    if op == CEILING_OP:
        mt = re.match(r"^ceiling/(fp8|bf16)_M(\d+)_N(\d+)_K(\d+)$", name)
        return dict(kind="ceiling", dtype=mt.group(1), m=int(mt.group(2)), n=int(mt.group(3)),
                    k=int(mt.group(4))) if mt else None
    mt = _NAME.match(name)
    if op != OP or not mt:
        return None
    spec = dict(MODELS[mt.group(1)], kind="layer", model=mt.group(1), T=int(mt.group(2)), format=mt.group(3))
    spec["G"] = spec["num_experts"] + spec["num_shared_experts"]
    spec["slots"] = spec["topk"] + spec["num_shared_experts"]
    return spec


def expert_bytes(s):
    h, i = s["hidden"], s["intermediate"]
    if s["format"] == "bf16":
        return 6.0 * h * i
    scales = (2 * i // BLOCK) * (h // BLOCK) + (h // BLOCK) * (i // BLOCK) if s["format"] == "fp8_blockwise" else 2
    return 3.0 * h * i + 4.0 * scales


def nbytes(s, activated=None):
    """Bytes one call must move (tessera-bench's rule): the activated experts' weights + x + y + logits (+ bias,
    + the two static scales). activated=None: the upper bound min(E, T k) + s."""
    if s["kind"] == "ceiling":
        elt = 1 if s["dtype"] == "fp8" else 2
        return elt * (s["m"] * s["k"] + s["n"] * s["k"]) + 2.0 * s["m"] * s["n"]
    T, h, E = s["T"], s["hidden"], s["num_experts"]
    if activated is None:
        activated = min(E, T * s["topk"]) + s["num_shared_experts"]
    return (activated * expert_bytes(s) + 4.0 * T * h + 4.0 * T * E + (4.0 * E if s["correction_bias"] else 0.0)
            + (8.0 if s["format"] == "fp8_per_tensor" else 0.0))


def flops(s):
    if s["kind"] == "ceiling":
        return 2.0 * s["m"] * s["n"] * s["k"]
    return 2.0 * s["T"] * s["slots"] * 3.0 * s["hidden"] * s["intermediate"]


def keep(case, args):
    """--moe-layer-cases: substrings of the case name (any matches)."""
    subs = [c for c in getattr(args, "moe_layer_cases", "").split(",") if c]
    return not subs or any(x in case.name for x in subs)


def cases_from_args(args):
    """Standalone runs: tessera-bench's headline cases; every case with --all or when --moe-layer-cases is given."""
    every = getattr(args, "all", False) or bool(getattr(args, "moe_layer_cases", ""))
    return [c for c in (Case(op, name, parse(op, name)) for op, name in registry(not every)) if keep(c, args)]


def _peers(args):
    peers = {p for p in getattr(args, "moe_layer_peers", ",".join(DEFAULT_PEERS)).split(",") if p}
    if getattr(args, "compile", False):
        peers.add("compile")
    return peers


# ---- router inputs (bench/moe_layer_cases.cpp's router_inputs, bit for bit) ---------------------------------------

_GOLDEN, _M1, _M2, _MASK = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, (1 << 64) - 1


def _draws(seed, count):
    """Rng(seed).next() for the first `count` draws (bench/harness.h's splitmix64: draw i hashes seed + (i+1) golden),
    as a numpy uint64 array, or a list of ints without numpy."""
    try:
        import numpy as np
    except ImportError:
        rng = C.SplitMix64(seed)
        return [rng.next() for _ in range(count)]
    with np.errstate(over="ignore"):
        z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(seed & _MASK)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        return z ^ (z >> np.uint64(31))


def _lanes(d):
    """The sum of the four 16-bit fields of each draw, minus 2^17 (Irwin-Hall), as int64 / int."""
    if isinstance(d, list):
        return [(v & 0xFFFF) + ((v >> 16) & 0xFFFF) + ((v >> 32) & 0xFFFF) + (v >> 48) - (1 << 17) for v in d]
    import numpy as np
    f = np.uint64(0xFFFF)
    s = (d & f) + ((d >> np.uint64(16)) & f) + ((d >> np.uint64(32)) & f) + (d >> np.uint64(48))
    return s.astype(np.int64) - (1 << 17)


def router_inputs(tokens, experts, seed=ROUTER_SEED):
    """(logits [T, E] fp32, correction bias [E] fp32, hot experts) on the device: logit = (7 n + 2 (p[e] + 2^17
    hot[e])) 2^-18, bias = ((d >> 48) - 2^15) 2^-20 (bench/moe_layer_cases.cpp's header comment). Integers below
    2^24 times powers of two: exact in fp32."""
    torch = C.torch
    E = experts
    d = _draws(seed, 3 * E + tokens * E)
    pop = [int(v) for v in _lanes(d[:E])]
    rank = [int(v) for v in d[E:2 * E]]
    bias = [(int(v) >> 48) - (1 << 15) for v in d[2 * E:3 * E]]
    hot = sorted(range(E), key=lambda e: -rank[e])[:max(1, E // 32)]  # stable: ties keep the lower index first
    for e in hot:
        pop[e] += 1 << 17
    noise = _lanes(d[3 * E:])
    pop_t = torch.tensor(pop, dtype=torch.int64)
    if isinstance(noise, list):
        n = torch.tensor(noise, dtype=torch.int64).view(tokens, E)
    else:
        n = torch.from_numpy(noise).view(tokens, E)
    logits = ((7 * n + 2 * pop_t[None, :]).to(torch.float32) * 2.0 ** -18).to(C.DEVICE)
    bias_t = (torch.tensor(bias, dtype=torch.int64).to(torch.float32) * 2.0 ** -20).to(C.DEVICE)
    return logits, bias_t, sorted(hot)


# ---- inputs ---------------------------------------------------------------------------------------------------------


def _ml():
    """(tessera.moe_layer, None) or (None, why not)."""
    if C.tessera is None:
        return None, C.TESSERA_IMPORT_ERROR
    ml = getattr(C.tessera, "moe_layer", None)
    if ml is None or not hasattr(ml, "moe_layer"):
        try:
            import importlib
            ml = importlib.import_module("tessera.moe_layer")
        except Exception as e:  # noqa: BLE001
            return None, f"tessera.moe_layer not importable ({C.short(e)})"
    return ml, None


def _random_e4m3(shape, g):
    torch = C.torch
    b = torch.randint(0, 256, shape, dtype=torch.uint8, device=C.DEVICE, generator=g)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)  # 0x7F / 0xFF are NaN: the next value down (448)
    return b.view(C.fp8_dtype())


def _exp2(shape, g, lo, hi):
    torch = C.torch
    return torch.exp2(torch.empty(shape, device=C.DEVICE).uniform_(lo, hi, generator=g))


class Weights:
    """One (model, format)'s weights in tessera's layout, and torch's per-channel scales of the same weights."""

    def __init__(self, s, seed):
        torch = C.torch
        g = C.generator(seed)
        G, h, i, fmt = s["G"], s["hidden"], s["intermediate"], s["format"]
        self.format = fmt
        self.sb13 = self.sb2 = None  # torch._scaled_grouped_mm's scale_b: [G, 2I], [G, H]
        self.w13_scale = self.w2_scale = None
        if fmt == "bf16":
            self.w13 = torch.empty((G, 2 * i, h), dtype=torch.bfloat16, device=C.DEVICE)
            self.w2 = torch.empty((G, h, i), dtype=torch.bfloat16, device=C.DEVICE)
            for e in range(G):  # per expert: bounded fp32 temporaries
                self.w13[e] = (torch.randn((2 * i, h), device=C.DEVICE, generator=g) / math.sqrt(h)).bfloat16()
                self.w2[e] = (torch.randn((h, i), device=C.DEVICE, generator=g) / math.sqrt(i)).bfloat16()
            return
        self.w13 = torch.empty((G, 2 * i, h), dtype=C.fp8_dtype(), device=C.DEVICE)
        self.w2 = torch.empty((G, h, i), dtype=C.fp8_dtype(), device=C.DEVICE)
        for e in range(G):
            self.w13[e] = _random_e4m3((2 * i, h), g)
            self.w2[e] = _random_e4m3((h, i), g)
        c13, c2 = -math.log2(CODE_RMS * math.sqrt(h)), -math.log2(CODE_RMS * math.sqrt(i))
        if fmt == "fp8_blockwise":
            s13 = _exp2((G, 2 * i // BLOCK), g, c13 - 1, c13 + 1)
            s2 = _exp2((G, h // BLOCK), g, c2 - 1, c2 + 1)
            self.w13_scale = s13[:, :, None].expand(G, 2 * i // BLOCK, h // BLOCK).contiguous()
            self.w2_scale = s2[:, :, None].expand(G, h // BLOCK, i // BLOCK).contiguous()
            self.sb13 = s13.repeat_interleave(BLOCK, dim=1).contiguous()
            self.sb2 = s2.repeat_interleave(BLOCK, dim=1).contiguous()
        else:
            self.w13_scale = _exp2((G,), g, c13 - 1, c13 + 1)
            self.w2_scale = _exp2((G,), g, c2 - 1, c2 + 1)
            self.sb13 = self.w13_scale[:, None].expand(G, 2 * i).contiguous()
            self.sb2 = self.w2_scale[:, None].expand(G, h).contiguous()


# ---- the torch layer ------------------------------------------------------------------------------------------------


def torch_gate(logits, bias, s):
    """The gate in torch ops: (weights fp32 [T, k + s], ids int64 [T, k + s])."""
    torch = C.torch
    T, E = logits.shape
    scores = logits.float().sigmoid() if s["scoring"] == "sigmoid" else logits.float().softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    ng = s["num_groups"]
    if ng > 1:
        grouped = choice.view(T, ng, E // ng)
        if s["group_score"] == "top2_sum":
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_score = grouped.amax(dim=-1)
        kept = group_score.topk(s["topk_groups"], dim=-1).indices
        mask = torch.zeros((T, ng), dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask[:, :, None].expand(T, ng, E // ng).reshape(T, E), float("-inf"))
    ids = choice.topk(s["topk"], dim=-1).indices
    w = scores.gather(1, ids)
    if s["renormalize"]:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w * s["routed_scaling_factor"]
    ns = s["num_shared_experts"]
    if ns:
        shared = torch.arange(E, E + ns, device=logits.device).expand(T, ns)
        ids = torch.cat([ids, shared], dim=1)
        w = torch.cat([w, torch.full((T, ns), s["shared_expert_weight"], device=logits.device)], dim=1)
    return w, ids


def _rowwise_fp8(a):
    """Per-row e4m3 quantization: (codes [R, K], scales fp32 [R]), scale = max(amax, 1e-10) / 448."""
    scale = a.abs().amax(dim=-1).float().clamp(min=1e-10) / FP8_MAX
    return (a.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(C.fp8_dtype()), scale


def _static_fp8(a, scale):
    """Per-tensor e4m3 quantization with a static scale (fp32 [1]), saturated: (codes, scale broadcast to [R])."""
    q = (a.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(C.fp8_dtype())
    return q, scale.expand(a.shape[0]).contiguous()


def torch_layer(x, logits, bias, w13, w2, sb13, sb2, a13, a2, *, s):
    """The torch eager layer (module docstring). fp8 weights: torch._scaled_grouped_mm with row-wise scales sb13 [G,
    2I], sb2 [G, H]; activations per token (a13 None) or with the static scales a13 / a2; bf16: torch._grouped_mm."""
    torch = C.torch
    F = torch.nn.functional
    T, S, G, I = x.shape[0], s["slots"], s["G"], s["intermediate"]
    w, ids = torch_gate(logits, bias, s)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // S
    xs = x.index_select(0, token)
    counts = torch.zeros(G, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    w13_t, w2_t = w13.transpose(-2, -1), w2.transpose(-2, -1)  # [G, K, N], K-major, as the grouped kernels take
    if sb13 is None:
        h = torch._grouped_mm(xs, w13_t, offs=offs, out_dtype=torch.bfloat16)
        act = (F.silu(h[:, :I].float()) * h[:, I:].float()).to(torch.bfloat16)
        o = torch._grouped_mm(act, w2_t, offs=offs, out_dtype=torch.bfloat16)
    else:
        q1, sa1 = _rowwise_fp8(xs) if a13 is None else _static_fp8(xs, a13)
        h = torch._scaled_grouped_mm(q1, w13_t, sa1, sb13, offs=offs, out_dtype=torch.bfloat16)
        act = F.silu(h[:, :I].float()) * h[:, I:].float()
        q2, sa2 = _rowwise_fp8(act) if a2 is None else _static_fp8(act, a2)
        o = torch._scaled_grouped_mm(q2, w2_t, sa2, sb2, offs=offs, out_dtype=torch.bfloat16)
    weight = w.reshape(-1).index_select(0, order)
    y = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
    y.index_add_(0, token, o.float() * weight[:, None])
    return y.to(torch.bfloat16)


def _blockwise_fp8(a):
    """Per (row, 128 columns) e4m3 quantization, as the layer's Q2: (codes [R, K], scales fp32 [R, K/128])."""
    R, K = a.shape
    blocks = a.view(R, K // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(C.fp8_dtype())
    return q.view(R, K), scale


# ---- rows ---------------------------------------------------------------------------------------------------------


def rows(cases, args):
    """Cases grouped by (model, format): the weights are made once per group; then the GEMM ceiling rows of the
    dtypes that ran."""
    groups = {}
    for case in cases:
        if case.spec is None or case.spec.get("kind") != "layer" or not keep(case, args):
            continue
        groups.setdefault((case.spec["model"], case.spec["format"]), []).append(case)
    if not groups:
        return []
    out = C.guarded_rows(list(groups.values()), lambda group, gi: _group_rows(group, args, 8100 + 100 * gi))
    dims = CEILING_DIM if C.ON_GPU else CPU_CEILING_DIM
    dtypes = sorted({"bf16" if f == "bf16" else "fp8" for _, f in groups})
    ceilings = [Case(CEILING_OP, n, parse(CEILING_OP, n))
                for n in (f"ceiling/{d}_M{dims}_N{dims}_K{dims}" for d in dtypes)]
    out += C.guarded_rows([[c] for c in ceilings], lambda group, gi: [_ceiling_row(group[0], args, 8000 + gi)])
    return out


def _group_rows(group, args, seed):
    s0 = group[0].spec
    if s0["format"] != "bf16" and C.fp8_dtype() is None:
        raise RuntimeError("this torch has no float8_e4m3fn")
    weights = Weights(s0, seed)
    out = []
    try:
        for k, case in enumerate(group):
            try:
                out.append(_case_row(case, weights, args, seed + 1 + k))
            except Exception as e:  # noqa: BLE001 - one case's failure must not hide the group's others
                r = Row(case.op, case.name, nbytes(case.spec), flops(case.spec))
                r.errors.append(f"setup: {C.short(e)}")
                out.append(r)
                C.sync_quietly()
            C.empty_cache()
    finally:
        del weights
        C.empty_cache()
    return out


def _case_row(case, wt, args, seed):
    torch = C.torch
    s = case.spec
    T, H, I, E, G, S, fmt = (s[key] for key in ("T", "hidden", "intermediate", "num_experts", "G", "slots", "format"))
    fp8 = fmt != "bf16"
    row = Row(case.op, case.name, nbytes(s), flops(s))
    row.torch_quant = {"fp8_blockwise": "row-wise", "fp8_per_tensor": "per-tensor", "bf16": "bf16"}[fmt]
    row.notes.append({"fp8_blockwise": "torch: fp8 row-wise scales (per-token activations, per-channel weights), "
                                       "cheaper than the layer's 1x128 / 128x128 blocks",
                      "fp8_per_tensor": "torch: fp8 with the static a13 / a2 as row scales (the layer's quantization)",
                      "bf16": "torch: bf16 torch._grouped_mm"}[fmt])
    g = C.generator(seed)
    logits, bias_all, hot = router_inputs(T, E)
    bias = bias_all if s["correction_bias"] else None
    mag = torch.exp2(torch.empty((T, 1), device=C.DEVICE).uniform_(-1.0, 1.0, generator=g))
    x = (torch.randn((T, H), device=C.DEVICE, generator=g) * mag).bfloat16()
    a13 = a2 = None
    if fmt == "fp8_per_tensor":
        a13 = (x.abs().amax().float() / FP8_MAX).reshape(1)
        a2 = torch.full((1,), A2_AMAX / FP8_MAX, dtype=torch.float32, device=C.DEVICE)
    gate_kw = {key: s[key] for key in GATE_KEYS}
    est_us = max(nbytes(s) / 3.0e12, flops(s) / 800e12) * 1e6
    calls = C.calls_for(est_us)
    peers = _peers(args)
    row.notes.append(f"hot experts {hot}" if len(hot) <= 8 else f"{len(hot)} hot experts")

    # tessera
    ml, why = _ml()
    y_ref = None
    if ml is None:
        row.errors.append(f"tessera: {why}")
    else:
        cfg = ml.MoeLayerConfig(H, I, E, format=fmt, **gate_kw)
        lw = ml.MoeLayerWeights(wt.w13, wt.w2, wt.w13_scale, wt.w2_scale, a13, a2)
        y_t = torch.empty((T, H), dtype=torch.bfloat16, device=C.DEVICE)
        state = {}

        def make_fn():
            p = ml.plan(cfg, T)
            ws = torch.empty((max(p.workspace_bytes, 1),), dtype=torch.uint8, device=C.DEVICE)
            state["ws_bytes"] = p.workspace_bytes
            return lambda: ml.moe_layer(x, logits, lw, p, correction_bias=bias, out=y_t, workspace=ws)

        fn = C.run_tessera_fn(row, make_fn, calls, args)
        if fn is not None:
            y_t.fill_(float("nan"))
            fn()
            y_ref = y_t.clone()
            bad = int((~torch.isfinite(y_ref)).sum().item())
            if bad:
                row.errors.append(f"tessera: {bad} non-finite elements of y")
            row.notes.append(f"tessera: workspace {state['ws_bytes'] / 2**20:.0f} MiB")
        del fn, y_t  # the workspace goes with fn
    # the routing's activated experts (tessera's gate, else torch's): the standalone bytes
    try:
        if C.tessera is not None:
            _, ids = C.tessera.fused_gate(logits, bias, **gate_kw)
        else:
            _, ids = torch_gate(logits, bias, s)
        activated = int(torch.unique(ids.long()).numel())
        row.bytes = nbytes(s, activated)
        row.notes.append(f"routing: {activated} of {G} experts active")
    except Exception as e:  # noqa: BLE001
        row.notes.append(f"activated experts not counted ({C.short(e)}): bytes = the upper bound")

    def check(label, y):
        if y_ref is None or y is None:
            return
        err = C.rel_error(y, y_ref)
        row.rel_err[label] = err

    if "composed" in peers and C.tessera is not None:
        try:
            _composed_peer(row, s, wt, x, logits, bias, a13, a2, calls, args, check)
        except Exception as e:  # noqa: BLE001
            row.errors.append(f"{LABELS['composed']}: {C.short(e)}")
            C.sync_quietly()
        C.empty_cache()
    if ("torch" in peers or "compile" in peers):
        why_not = None
        if fp8 and not hasattr(torch, "_scaled_grouped_mm"):
            why_not = f"torch {torch.__version__} has no torch._scaled_grouped_mm"
        elif not fp8 and not hasattr(torch, "_grouped_mm"):
            why_not = f"torch {torch.__version__} has no torch._grouped_mm"
        if why_not:
            row.notes.append(f"torch / compile: skipped ({why_not})")
        else:
            _torch_peers(row, s, wt, x, logits, bias, a13, a2, calls, args, peers, check)
    return row


def _composed_peer(row, s, wt, x, logits, bias, a13, a2, calls, args, check):
    """tessera.fused_gate -> permute -> grouped GEMM -> torch SiLU·mul + quantization -> grouped GEMM ->
    unpermute_reduce, every output preallocated."""
    torch = C.torch
    t = C.tessera
    F = torch.nn.functional
    label = LABELS["composed"]
    T, H, I, G, S, fmt = (s[key] for key in ("T", "hidden", "intermediate", "G", "slots", "format"))
    quant = None if fmt == "bf16" else fmt
    dev = C.DEVICE
    gw = torch.empty((T, S), dtype=torch.float32, device=dev)
    gi = torch.empty((T, S), dtype=torch.int32, device=dev)
    rows_cap = t.permute_capacity_rows(T, S, G, quant=quant)
    perm = t.PermuteResult(
        torch.empty((rows_cap, H), dtype=torch.bfloat16 if quant is None else C.fp8_dtype(), device=dev),
        torch.empty((rows_cap, H // BLOCK), dtype=torch.float32, device=dev) if fmt == "fp8_blockwise" else None,
        torch.empty((G + 1,), dtype=torch.int32, device=dev), torch.empty((G,), dtype=torch.int32, device=dev),
        torch.empty((T, S), dtype=torch.int32, device=dev), None)
    perm_ws = torch.empty((max(t.permute_workspace_bytes(T, S, G, quant=quant), 1),), dtype=torch.uint8, device=dev)
    h = torch.empty((rows_cap, 2 * I), dtype=torch.bfloat16, device=dev)
    o = torch.empty((rows_cap, H), dtype=torch.bfloat16, device=dev)
    y = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
    gate_kw = {key: s[key] for key in GATE_KEYS}
    mode = "blockwise" if fmt == "fp8_blockwise" else "per_tensor"

    def fn():
        t.fused_gate(logits, bias, **gate_kw, out=(gw, gi))
        t.permute(x, gi, G, quant=quant, input_scale=a13, with_row_token=False, out=perm, workspace=perm_ws)
        if quant is None:
            t.grouped_gemm_bf16(perm.x_perm, wt.w13, perm.expert_offsets, out=h)
            act = (F.silu(h[:, :I].float()) * h[:, I:].float()).to(torch.bfloat16)
            t.grouped_gemm_bf16(act, wt.w2, perm.expert_offsets, out=o)
        else:
            xs1 = perm.scales if fmt == "fp8_blockwise" else a13
            t.grouped_gemm_fp8(perm.x_perm, wt.w13, perm.expert_offsets, xs1, wt.w13_scale, scale_mode=mode, out=h)
            act = F.silu(h[:, :I].float()) * h[:, I:].float()
            if fmt == "fp8_blockwise":
                q2, s2 = _blockwise_fp8(act)
            else:
                q2, s2 = (act / a2).clamp(-FP8_MAX, FP8_MAX).to(C.fp8_dtype()), a2
            t.grouped_gemm_fp8(q2, wt.w2, perm.expert_offsets, s2, wt.w2_scale, scale_mode=mode, out=o)
        t.unpermute_reduce(o, perm.row_index, gw, out=y)
        return y

    if C.run_peer_fn(row, label, fn, calls, args):
        y.fill_(float("nan"))
        fn()
        check(label, y)


def _torch_peers(row, s, wt, x, logits, bias, a13, a2, calls, args, peers, check):
    torch = C.torch
    fmt = s["format"]
    blockwise = fmt == "fp8_blockwise"
    # fp8_blockwise: torch quantizes activations per token (a13 / a2 None), fp8_per_tensor with the static scales
    a13_t, a2_t = (None, None) if blockwise else (a13, a2)

    def layer(x_, logits_, bias_, w13, w2, sb13, sb2, a13_, a2_):
        return torch_layer(x_, logits_, bias_, w13, w2, sb13, sb2, a13_, a2_, s=s)

    operands = (x, logits, bias, wt.w13, wt.w2, wt.sb13, wt.sb2, a13_t, a2_t)
    if "torch" in peers:
        label = LABELS["torch"]
        if C.run_peer_fn(row, label, lambda: layer(*operands), calls, args):
            check(label, layer(*operands))
        C.empty_cache()
    if "compile" in peers:
        label = LABELS["compile"]
        try:
            compiled = torch.compile(layer, mode="default", dynamic=False)
        except Exception as e:  # noqa: BLE001
            row.notes.append(f"{label}: skipped, torch.compile failed ({C.short(e)})")
            return
        # the first calls compile (outside the timing: run_peer_fn's first call, then the warm-up)
        try:
            compiled(*operands)
            C.sync()
        except Exception as e:  # noqa: BLE001
            C.sync_quietly()
            row.notes.append(f"{label}: skipped, torch.compile failed ({C.short(e)})")
            return
        if C.run_peer_fn(row, label, lambda: compiled(*operands), calls, args):
            check(label, compiled(*operands))
        del compiled
        C.empty_cache()


def _ceiling_row(case, args, seed):
    torch = C.torch
    s = case.spec
    row = Row(case.op, case.name, nbytes(s), flops(s))
    g = C.generator(seed)
    m, n, k = s["m"], s["n"], s["k"]
    calls = C.calls_for(flops(s) / 900e12 * 1e6)
    if s["dtype"] == "bf16":
        a = torch.empty((m, k), device=C.DEVICE).uniform_(-1.0, 1.0, generator=g).bfloat16()
        b = torch.empty((n, k), device=C.DEVICE).uniform_(-1.0, 1.0, generator=g).bfloat16()
        y = torch.empty((m, n), dtype=torch.bfloat16, device=C.DEVICE)
        C.run_peer_fn(row, "torch", lambda: torch.matmul(a, b.t(), out=y), calls, args)
        row.notes.append("torch.matmul bf16")
        return row
    if not hasattr(torch, "_scaled_mm") or C.fp8_dtype() is None:
        row.errors.append(f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn")
        return row
    a, b = _random_e4m3((m, k), g), _random_e4m3((n, k), g)
    one = torch.ones((), dtype=torch.float32, device=C.DEVICE)
    C.run_peer_fn(row, "torch", lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16,
                                                          use_fast_accum=False), calls, args)
    row.notes.append("torch._scaled_mm fp8 e4m3, per-tensor scales, use_fast_accum=False")
    return row


# ---- table --------------------------------------------------------------------------------------------------------


def _ceilings(rows, args):
    """{"fp8" | "bf16": (TFLOP/s, how)}: the measured ceiling rows, else the declared peaks."""
    out = {"fp8": (getattr(args, "moe_layer_fp8_peak", FP8_PEAK_TFLOPS), "declared peak"),
           "bf16": (getattr(args, "moe_layer_bf16_peak", BF16_PEAK_TFLOPS), "declared peak")}
    for r in rows:
        if r.op != CEILING_OP:
            continue
        _, us, _ = r.headline("torch")
        dtype = "bf16" if "/bf16_" in r.case else "fp8"
        if us:
            out[dtype] = (r.flops / (us * 1e-6) / 1e12, f"measured, {r.case.split('/', 1)[1]}")
    return out


def _read_bps(rows, copy_bps):
    """tessera-bench's read ceiling (from any merged row's GB/s and % read BW), else the copy bandwidth here."""
    for r in rows:
        b = r.bench or {}
        if b.get("gbps") and b.get("pct_read_bw"):
            return b["gbps"] * 1e9 * 100.0 / b["pct_read_bw"], "read"
    return copy_bps, "copy"


def print_family(rows, copy_bps=None, args=None):
    """The MoE layer table: per case tessera's µs (tessera-bench's when merged, and this process's), the bound and
    tessera's % of it, % of the read ceiling and of the GEMM ceiling, TFLOP/s, then per peer its µs, peer / tessera
    and its error against tessera's y; the torch layer's activation quantization."""
    if not rows:
        return
    merged = any(r.bench is not None for r in rows)
    ceilings = _ceilings(rows, args)
    read_bps, read_label = _read_bps(rows, copy_bps)
    body_rows = [r for r in rows if r.op != CEILING_OP]
    for r in body_rows:
        err = (r.bench or {}).get("check_error")
        if err is not None and "tessera" not in r.rel_err:
            r.rel_err["tessera"] = err
    labels = C.peer_labels(body_rows)
    head = ["case"] + C.tessera_head(merged) + ["bound", "% floor", "% read", "% ceil", "TFLOP/s"]
    for label in labels:
        head += [f"{label} µs", "x", "err"]
    head += ["torch quant", "check err"]
    body = []
    eager_marks = False
    for r in body_rows:
        cells = [r.case] + C.tessera_cells(r, merged)
        t = r.tessera_us("graph") or r.tessera_us("eager")
        ceiling = ceilings["bf16" if r.case.endswith("/bf16") else "fp8"][0]
        pct_read = None
        if t and r.bytes:
            if r.bench is not None and read_label == "read" and r.bench.get("pct_read_bw") is not None:
                pct_read = r.bench["pct_read_bw"]
            elif read_bps:
                pct_read = 100.0 * r.bytes / (t * 1e-6) / read_bps
        tf = r.tflops()
        pct_ceil = 100.0 * tf / ceiling if (tf and ceiling) else None
        read_s = r.bytes / read_bps if read_bps else 0.0
        compute_s = r.flops / (ceiling * 1e12) if ceiling else 0.0
        bound = "-" if not (read_s or compute_s) else ("compute" if compute_s > read_s else read_label)
        floor = pct_ceil if bound == "compute" else pct_read
        cells += [bound, C.fmt_num(floor, ".1f"), C.fmt_num(pct_read, ".1f"), C.fmt_num(pct_ceil, ".1f"),
                  C.fmt_num(tf, ".1f")]
        for label in labels:
            if label not in r.peers:
                cells += ["", "", ""]
                continue
            mode, us, ratio = r.headline(label)
            mark = "e" if mode == "eager" else ""
            eager_marks |= bool(mark)
            cells += [C.fmt_us(us) + mark, C.fmt_ratio(ratio), C.fmt_err(r.rel_err.get(label))]
        cells += [getattr(r, "torch_quant", "-"), C.fmt_err(r.rel_err.get("tessera"))]
        body.append(cells)
    print(f"== {TITLE}")
    lines = ["bound: read (tessera-bench's read ceiling" + ("" if read_label == "read" else "; here: the copy "
             "bandwidth, 'copy'") + ") or compute; % floor: tessera's % of that bound; % ceil: TFLOP/s against "
             "the GEMM ceiling, " + ", ".join(f"{d} {v:.0f} TFLOP/s ({how})" for d, (v, how) in ceilings.items())]
    lines.append("err: ||y_peer - y_tessera||_F / ||y_tessera||_F; check err: tessera-bench --check's error against "
                 "the float64 reference (merged runs with --bench-args=--check)")
    if not merged:
        lines.append("tessera µs: this process's (tessera.moe_layer.moe_layer); a merged run (--with-bench / "
                     "--bench-json) shows tessera-bench's beside it")
    print("\n".join(lines))
    C.print_aligned(head, body, text_cols=(0, head.index("bound"), len(head) - 2))
    for r in rows:
        if r.op == CEILING_OP:
            mode, us, _ = r.headline("torch")
            print(f"  ceiling [{r.case}] {C.fmt_us(us)} µs" + (f" = {r.flops / (us * 1e-6) / 1e12:.0f} TFLOP/s" if us
                                                               else "") + (f" ({'; '.join(r.notes)})" if r.notes
                                                                           else ""))
            for e in r.errors:
                print(f"  error [{r.case}] {e}")
    notes = ("ops+glue = tessera.fused_gate, permute, grouped_gemm_fp8 / _bf16 with the SiLU·mul and the activation "
             "quantization in torch, unpermute_reduce; torch = the torch eager layer (bench/peers/moe_layer.py); "
             "compile = torch.compile of it (compile time excluded)")
    print(f"  note  {notes}")
    C.print_row_notes(body_rows, eager_marks, key=lambda r, text: (r.case, text), tag=lambda r: r.case,
                      dedup_errors=True)
