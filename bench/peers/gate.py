"""fused_gate peers: the usual torch biased grouped top-k (eager, CUDA graph, torch.compile) and FlashInfer's
fused_topk_deepseek where it computes the same thing.

Cases: tessera-bench's (bench/moe_cases.cpp) '<config>/T<tokens>/<dtype>': logits 1.5 N(0, 1), bias U(-0.1, 0.1) fp32.
FlashInfer's kernel always takes sigmoid scores, adds the bias, renormalizes and scales, and its argument check wants
real grouping (topk_group * n_group >= topk, <= 32 experts a group, <= 128 in the kept groups): it serves dsv3 (8
groups, 4 kept) only; not kimik2 (one group of 384), the softmax configs nor odd160 (no renormalization). It wants the
bias in the logits' dtype (a bf16 copy for bf16 logits) and writes weights in that dtype; tessera writes fp32.
"""

import re
import time

from . import common as C
from .common import Case, Row

OP = "fused_gate"

# name: (E, groups, kept groups, topk, scoring, renormalize, scale, bias) -- bench/moe_cases.cpp's kGateConfigs
CONFIGS = {
    "dsv3": (256, 8, 4, 8, "sigmoid", True, 2.5, True),
    "dsv2lite": (64, 1, 1, 6, "softmax", False, 1.0, False),
    "qwen3": (128, 1, 1, 8, "softmax", True, 1.0, False),
    "kimik2": (384, 1, 1, 8, "sigmoid", True, 2.827, True),
    "mixtral": (8, 1, 1, 2, "softmax", True, 1.0, False),
    "odd160": (160, 1, 1, 6, "sigmoid", False, 1.0, True),
}
_NAME = re.compile(r"^(\w+)/T(\d+)/(fp32|bf16|fp16)$")


def registry():
    """The fused_gate cases of tessera-bench, in its order."""
    names = []
    for cfg in CONFIGS:
        tokens = (1, 16, 128, 1024, 4096, 65536) if cfg == "dsv3" else (128, 4096, 65536)
        names += [f"{cfg}/T{t}/fp32" for t in tokens]
        if cfg == "dsv3":
            names += [f"dsv3/T{t}/bf16" for t in (4096, 65536)]
    return [(OP, n) for n in names]


def parse(op, name):
    m = _NAME.match(name)
    if op != OP or not m or m.group(1) not in CONFIGS:
        return None
    E, G, TG, k, scoring, renorm, scale, bias = CONFIGS[m.group(1)]
    return dict(config=m.group(1), T=int(m.group(2)), dtype=m.group(3), E=E, G=G, TG=TG, k=k, scoring=scoring,
                renorm=renorm, scale=scale, bias=bias)


def torch_gate(logits, bias, s):
    """The torch formulation serving stacks use (sigmoid | softmax, +bias, group top-2 sum, top groups, masked
    top-k, gather, renormalize, scale). Returns (weights fp32 [T, k], ids int32 [T, k])."""
    torch = C.torch
    scores = logits.float().sigmoid() if s["scoring"] == "sigmoid" else logits.float().softmax(dim=-1)
    choice = scores + bias.unsqueeze(0) if bias is not None else scores
    T, E = choice.shape
    if s["G"] > 1:
        group_scores = choice.view(T, s["G"], -1).topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(s["TG"], dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(T, s["G"], E // s["G"]).reshape(T, E)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = choice.topk(s["k"], dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if s["renorm"]:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * s["scale"], ids.to(torch.int32)


def flashinfer_serves(s):
    """Why FlashInfer's fused_topk_deepseek cannot run this config, or None if it can."""
    if s["scoring"] != "sigmoid" or not s["bias"]:
        return "flashinfer fused_topk_deepseek: sigmoid scores with a bias only"
    if not s["renorm"]:
        return "flashinfer fused_topk_deepseek: always renormalizes (this config does not)"
    # flashinfer 0.7.2's argument check: topk_group <= n_group, topk_group * n_group >= topk, topk <= 8; with
    # n_group > 1: E / n_group <= 32 and E / n_group * topk_group <= 128. One group (kimik2) cannot pass the first
    # two, nor can all groups kept (E = 384 > 128).
    E, G, TG, k = s["E"], s["G"], s["TG"], s["k"]
    if not (TG <= G and TG * G >= k and k <= 8 and G > 1 and E % G == 0 and E // G <= 32 and E // G * TG <= 128):
        return (f"flashinfer fused_topk_deepseek: its argument check refuses E={E}, n_group={G}, topk_group={TG}, "
                f"topk={k}")
    return None


def rows(cases, args):
    return C.guarded_rows([[case] for case in cases], lambda group, _: [case_row(group[0], args)])


def case_row(case, args):
    torch = C.torch
    s = case.spec
    T, E, k = s["T"], s["E"], s["k"]
    dt = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)[s["dtype"]]
    nbytes = T * E * dt.itemsize + (E * 4 if s["bias"] else 0) + T * k * 8
    row = Row(case.op, case.name, nbytes)
    sets = C.rotating_sets(T * E * dt.itemsize + (E * 4 if s["bias"] else 0))
    g = C.generator(1000 + T)
    logits = [(torch.randn((T, E), device=C.DEVICE, generator=g) * 1.5).to(dt) for _ in range(sets)]
    bias = [(torch.rand((E,), device=C.DEVICE, generator=g) * 0.2 - 0.1) if s["bias"] else None
            for _ in range(sets)]
    calls = C.calls_for(T * E * dt.itemsize / 3e12 * 1e6 + 3.0, sets, most=64)
    if sets > 1:
        row.notes.append(f"{sets} rotating input sets (L2)")

    # tessera
    w_out = torch.empty((T, k), dtype=torch.float32, device=C.DEVICE)
    i_out = torch.empty((T, k), dtype=torch.int32, device=C.DEVICE)

    def tessera_call(st):
        return lambda: C.tessera.fused_gate(
            logits[st], bias[st], topk=k, num_groups=s["G"], topk_groups=s["TG"], scoring=s["scoring"],
            group_score="top2_sum", renormalize=s["renorm"], routed_scaling_factor=s["scale"], out=(w_out, i_out))

    ran = C.run_tessera_fn(row, lambda: C.rotating([tessera_call(st) for st in range(sets)]), calls, args)
    t_ids = None
    if ran is not None:
        tessera_call(0)()
        t_ids = i_out.clone()

    # torch eager / graph
    peer = [lambda st=st: torch_gate(logits[st], bias[st], s) for st in range(sets)]
    C.run_peer_fn(row, "torch", C.rotating(peer), calls, args)
    if t_ids is not None:
        _agreement(row, "torch", t_ids, torch_gate(logits[0], bias[0], s)[1])

    # torch.compile (default mode): compiles on its first call, 10-40 s a shape
    if args.compile:
        try:
            compiled = torch.compile(lambda lg, b: torch_gate(lg, b, s), mode="default", dynamic=False)
            C.run_peer_fn(row, "torch.compile",
                          C.rotating([lambda st=st: compiled(logits[st], bias[st]) for st in range(sets)]), calls, args)
        except Exception as e:  # noqa: BLE001
            row.errors.append(f"torch.compile: {C.short(e)}")
            C.sync_quietly()

    # FlashInfer
    if not args.no_flashinfer:
        _flashinfer_peer(row, s, logits, bias, calls, args, t_ids)
    return row


def _agreement(row, label, t_ids, p_ids):
    same = (t_ids.sort(dim=1).values == p_ids.sort(dim=1).values).all(dim=1).float().mean().item()
    row.notes.append(f"{label}: expert id sets equal to tessera's on {100 * same:.2f}% of tokens")


def _flashinfer_peer(row, s, logits, bias, calls, args, t_ids):
    why = flashinfer_serves(s)
    if why:
        row.notes.append(why)
        return
    fi, _ = C.optional_module("flashinfer")
    if fi is None:  # named once under the tables
        return
    torch = C.torch
    try:
        from flashinfer.fused_moe import fused_topk_deepseek
    except Exception as e:  # noqa: BLE001
        row.notes.append(f"flashinfer: no fused_moe.fused_topk_deepseek in {getattr(fi, '__version__', '?')} "
                         f"({C.short(e)})")
        return
    T, k = s["T"], s["k"]
    dt = logits[0].dtype
    fi_bias = [b.to(dt).contiguous() for b in bias]  # the kernel wants the bias in the logits' dtype
    values = torch.empty((T, k), dtype=dt, device=C.DEVICE)
    ids = torch.empty((T, k), dtype=torch.int32, device=C.DEVICE)

    def call(st):
        return lambda: fused_topk_deepseek(logits[st], fi_bias[st], s["G"], s["TG"], k, s["scale"], values, ids)

    t0 = time.perf_counter()
    ok = C.run_peer_fn(row, "flashinfer", C.rotating([call(st) for st in range(len(logits))]), calls, args)
    if not ok:
        return
    if not _FI_BUILT.get("gate"):
        _FI_BUILT["gate"] = True
        C.NOTES.append(f"flashinfer: fused_topk_deepseek's first use (its JIT build, then the timing of "
                       f"{row.case}) took {time.perf_counter() - t0:.1f} s")
    if dt != torch.float32:
        row.notes.append("flashinfer: bias cast to the logits' dtype, weights written in it (tessera: fp32)")
    if t_ids is not None:
        call(0)()
        C.sync()
        _agreement(row, "flashinfer", t_ids, ids)


_FI_BUILT = {}


def cases_from_args(args):
    """Standalone runs: the registry, filtered by --gate-tokens (comma list of T; empty: all)."""
    tokens = {int(t) for t in args.gate_tokens.split(",") if t.strip()}
    out = []
    for op, name in registry():
        s = parse(op, name)
        if not tokens or s["T"] in tokens:
            out.append(Case(op, name, s))
    return out
