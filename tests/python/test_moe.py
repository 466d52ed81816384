"""Python tests for tessera.moe: fused_gate, permute, unpermute_reduce.

GPU tests compare against torch references computed in float64 on fresh random inputs and are skipped when torch
or a CUDA device is missing. The tests at the top run everywhere (no torch, no GPU needed).
"""

import math
import re
from pathlib import Path

import pytest

import tessera
from _host_capsule import DL_FLOAT, DL_INT, HostCapsule

try:
    import torch
except ImportError:  # the no-GPU tests still run
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device")

REPO = Path(__file__).resolve().parents[2]

# ================================================================================================================
# Tests without a GPU (and without torch)
# ================================================================================================================


def test_version():
    assert isinstance(tessera.version, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+", tessera.version), tessera.version
    assert tessera.__version__ == tessera.version
    pyproject = REPO / "pyproject.toml"
    if pyproject.exists():
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
        assert m and m.group(1) == tessera.version


def test_top_level_reexports():
    for name in ("fused_gate", "permute", "unpermute_reduce", "permute_capacity_rows",
                 "permute_workspace_bytes", "PermuteResult"):
        assert getattr(tessera, name) is getattr(tessera.moe, name)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(scoring="bogus"), "scoring"),
    (dict(scoring=None), "scoring"),
    (dict(group_score="top3_sum"), "group_score"),
])
def test_bad_option_strings_raise_value_error(kwargs, arg):
    # Option strings are checked before any tensor is looked at (and before torch is imported).
    with pytest.raises(ValueError, match=f"'{arg}'"):
        tessera.fused_gate(object(), topk=8, **kwargs)


def test_bad_quant_raises_value_error():
    with pytest.raises(ValueError, match="'quant'"):
        tessera.permute(object(), object(), 8, quant="int4")
    with pytest.raises(ValueError, match="'quant'"):
        tessera.permute_capacity_rows(16, 2, 8, quant="fp4")


def test_capacity_rows():
    assert tessera.permute_capacity_rows(10, 2, 4) == 20
    assert tessera.permute_capacity_rows(10, 2, 4, pad_multiple=8) == 20 + 4 * 7
    assert tessera.permute_capacity_rows(0, 8, 256, pad_multiple=128, quant="fp8_blockwise") == 256 * 127
    assert tessera.permute_workspace_bytes(4096, 8, 256) >= 0
    with pytest.raises(ValueError, match="num_experts"):
        tessera._C.permute_capacity_rows(16, 2, 0)
    # The op's upper limits, as ValueError (the binding's 32-bit ints gave pybind's TypeError past 2^31).
    for query in (tessera.permute_capacity_rows, tessera.permute_workspace_bytes):
        for kwargs, arg in ((dict(pad_multiple=2 ** 31), "pad_multiple"), (dict(pad_multiple=70000), "pad_multiple")):
            with pytest.raises(ValueError, match=f"'{arg}' must be in"):
                query(16, 2, 8, **kwargs)
        with pytest.raises(ValueError, match="'num_experts' must be in"):
            query(16, 2, 2 ** 31)
        with pytest.raises(ValueError, match="'topk' must be in"):
            query(16, 2 ** 31, 8)


def test_binding_rejects_non_capsules():
    with pytest.raises(TypeError, match="'logits'"):
        tessera._C.fused_gate(object(), None, None, None, 8, 1, 1, "sigmoid", "top2_sum", False, 1.0, 0, 1.0, 0)


def _gate_c(logits, weights, ids):
    tessera._C.fused_gate(logits.capsule, None, weights.capsule, ids.capsule, 8, 1, 1, "sigmoid", "top2_sum",
                          False, 1.0, 0, 1.0, 0)


def test_binding_unsupported_dtype_names_argument():
    logits = HostCapsule((4, 64), DL_FLOAT, 64)  # float64: not a tessera dtype
    weights = HostCapsule((4, 8), DL_FLOAT, 32)
    ids = HostCapsule((4, 8), DL_INT, 32)
    with pytest.raises(ValueError, match="'logits'"):
        _gate_c(logits, weights, ids)
    logits = HostCapsule((4, 64), DL_INT, 32)  # int32: a tessera dtype the gate does not take
    with pytest.raises(ValueError, match="'logits'"):
        _gate_c(logits, weights, ids)


def test_binding_host_memory_is_value_error():
    # Host tensors are rejected by the C++ validation (or by the CUDA runtime when there is no GPU): ValueError.
    logits = HostCapsule((4, 64), DL_FLOAT, 32)
    weights = HostCapsule((4, 8), DL_FLOAT, 32)
    ids = HostCapsule((4, 8), DL_INT, 32)
    with pytest.raises(ValueError):
        _gate_c(logits, weights, ids)


# ================================================================================================================
# Gate
# ================================================================================================================

TIE_EPS = 1e-6  # rows whose float64 reference has a decision gap below this are not compared id for id

GATE_CASES = {
    # DeepSeek-V3: 256 experts, 8 groups, 4 kept groups, top-8, sigmoid + bias, top-2-sum group score.
    "deepseek_v3": dict(E=256, topk=8, num_groups=8, topk_groups=4, scoring="sigmoid", group_score="top2_sum",
                        renormalize=True, routed_scaling_factor=2.5, bias=True),
    # Qwen3-MoE: 128 experts, top-8 softmax, renormalized.
    "qwen3": dict(E=128, topk=8, scoring="softmax", renormalize=True),
    # Mixtral: 8 experts, top-2 of a softmax, renormalized (= softmax over the two chosen logits).
    "mixtral": dict(E=8, topk=2, scoring="softmax", renormalize=True),
    # An odd expert count, no groups, no renormalization, sigmoid without bias.
    "odd_e160": dict(E=160, topk=6, scoring="sigmoid"),
    # DeepSeek-V2 style: softmax, max group score, 3 of 8 groups, scale 16, two shared-expert slots.
    "deepseek_v2_shared": dict(E=160, topk=6, num_groups=8, topk_groups=3, scoring="softmax", group_score="max",
                               routed_scaling_factor=16.0, num_shared_experts=2, shared_expert_weight=1.0),
    # DeepSeek-V3 plus one shared-expert slot with weight 2.5.
    "deepseek_v3_shared": dict(E=256, topk=8, num_groups=8, topk_groups=4, scoring="sigmoid",
                               group_score="top2_sum", renormalize=True, routed_scaling_factor=2.5, bias=True,
                               num_shared_experts=1, shared_expert_weight=2.5),
}


def _gate_kwargs(case):
    kw = dict(case)
    kw.pop("E")
    kw.pop("bias", None)
    return kw


def _nonzero_gap(hi, lo):
    """hi - lo, with exact ties (including -inf vs -inf) counted as no gap (+inf)."""
    gap = hi - lo
    return torch.where(hi == lo, torch.full_like(gap, math.inf), gap)


def gate_reference(logits, bias, *, topk, num_groups=1, topk_groups=1, scoring="sigmoid", group_score="top2_sum",
                   renormalize=False, routed_scaling_factor=1.0, num_shared_experts=0, shared_expert_weight=1.0):
    """float64 reference. Returns (weights [T, k+s], ids int64 [T, k+s], scores [T, E], tie margin [T])."""
    x = logits.double()
    T, E = x.shape
    if scoring == "sigmoid":
        scores = torch.sigmoid(x)
    else:
        m = torch.nan_to_num(x, nan=-math.inf).amax(dim=-1, keepdim=True)
        e = torch.exp(x - m)
        scores = e / e.sum(dim=-1, keepdim=True)
    choice = scores + bias.double() if bias is not None else scores.clone()
    choice = torch.where(torch.isnan(choice), torch.full_like(choice, -math.inf), choice)
    margin = torch.full((T,), math.inf, dtype=torch.float64, device=x.device)

    if num_groups > 1:
        gsize = E // num_groups
        grouped = choice.view(T, num_groups, gsize)
        if group_score == "top2_sum":
            gscore = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            gscore = grouped.amax(dim=-1)
        g_sorted, g_order = torch.sort(gscore, dim=-1, descending=True, stable=True)
        if topk_groups < num_groups:
            margin = torch.minimum(margin, _nonzero_gap(g_sorted[:, topk_groups - 1], g_sorted[:, topk_groups]))
        kept = torch.zeros((T, num_groups), dtype=torch.bool, device=x.device)
        kept.scatter_(1, g_order[:, :topk_groups], True)
        masked = choice.masked_fill(~kept.repeat_interleave(gsize, dim=1), -math.inf)
    else:
        masked = choice
    c_sorted, order = torch.sort(masked, dim=-1, descending=True, stable=True)
    for i in range(min(topk, E - 1)):
        margin = torch.minimum(margin, _nonzero_gap(c_sorted[:, i], c_sorted[:, i + 1]))

    ids = order[:, :topk]
    weights = _routed_weights(scores, ids, renormalize, routed_scaling_factor)
    if num_shared_experts:
        shared_ids = torch.arange(E, E + num_shared_experts, device=x.device).expand(T, -1)
        ids = torch.cat([ids, shared_ids], dim=1)
        weights = torch.cat([weights, torch.full((T, num_shared_experts), float(shared_expert_weight),
                                                 dtype=torch.float64, device=x.device)], dim=1)
    return weights, ids, scores, margin


def _routed_weights(scores, ids, renormalize, scale):
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * scale


def check_gate(weights, ids, logits, bias, case):
    E = case["E"]
    kw = _gate_kwargs(case)
    k, s = kw["topk"], kw.get("num_shared_experts", 0)
    T = logits.shape[0]
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == (T, k + s) and ids.shape == (T, k + s)

    ref_w, ref_ids, scores, margin = gate_reference(logits, bias, **kw)
    ids64 = ids.long()

    # Shared slots: ids E..E+s-1, exact weight.
    if s:
        assert torch.equal(ids64[:, k:], ref_ids[:, k:])
        assert torch.equal(weights[:, k:], torch.full_like(weights[:, k:], float(kw["shared_expert_weight"])))

    routed = ids64[:, :k]
    assert bool(((routed >= 0) & (routed < E)).all()), "ids out of [0, E)"
    srt = routed.sort(dim=1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), "an expert chosen twice in a row"
    ng, tg = kw.get("num_groups", 1), kw.get("topk_groups", 1)
    if ng > 1:
        used = torch.zeros((T, ng), device=ids.device).scatter_(1, routed // (E // ng), 1.0).sum(dim=1)
        assert bool((used <= tg).all()), "experts taken from more than topk_groups groups"

    # ids: exact (order included) on rows without a near tie in the float64 reference.
    clear = margin >= TIE_EPS
    assert clear.float().mean().item() > 0.9, "too many near-tie rows: the comparison would be vacuous"
    bad = (routed != ref_ids[:, :k]).any(dim=1) & clear
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        pytest.fail(f"{int(bad.sum())} rows with wrong ids; row {row}: got {routed[row].tolist()}, "
                    f"expected {ref_ids[row, :k].tolist()} (margin {margin[row].item():.3g})")

    # weights: the reference weights of the ids tessera chose, on every row.
    expect = _routed_weights(scores, routed, kw.get("renormalize", False), kw.get("routed_scaling_factor", 1.0))
    torch.testing.assert_close(weights[:, :k].double(), expect, rtol=1e-5, atol=1e-7)


def make_gate_inputs(T, case, dtype=torch.float32 if torch else None, bias_dtype=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E = case["E"]
    logits = (torch.randn((T, E), device="cuda", generator=g) * 2.0).to(dtype)
    bias = None
    if case.get("bias"):
        bias = (torch.randn((E,), device="cuda", generator=g) * 0.1).to(bias_dtype or torch.float32)
    return logits, bias


@gpu
@pytest.mark.parametrize("name", list(GATE_CASES))
@pytest.mark.parametrize("T", [1, 33, 4096])
def test_gate_matches_reference(name, T):
    case = GATE_CASES[name]
    logits, bias = make_gate_inputs(T, case, seed=T)
    weights, ids = tessera.fused_gate(logits, bias, **_gate_kwargs(case))
    torch.cuda.synchronize()
    check_gate(weights, ids, logits, bias, case)


@gpu
@pytest.mark.parametrize("name,dtype,bias_dtype", [
    ("deepseek_v3", "bfloat16", "bfloat16"),
    ("deepseek_v3", "float16", "float32"),
    ("qwen3", "bfloat16", None),
    ("mixtral", "float16", None),
])
def test_gate_half_precision_logits(name, dtype, bias_dtype):
    case = GATE_CASES[name]
    logits, bias = make_gate_inputs(2048, case, dtype=getattr(torch, dtype),
                                    bias_dtype=getattr(torch, bias_dtype) if bias_dtype else None, seed=7)
    weights, ids = tessera.fused_gate(logits, bias, **_gate_kwargs(case))
    torch.cuda.synchronize()
    check_gate(weights, ids, logits, bias, case)


@gpu
def test_gate_strided_logits_and_out():
    case = GATE_CASES["deepseek_v3"]
    T, E = 777, case["E"]
    wide, bias = make_gate_inputs(T, dict(case, E=E + 64), seed=3)
    logits = wide[:, :E]  # row stride E + 64, unit stride along E
    bias = bias[:E].contiguous()
    k = case["topk"]
    out = (torch.full((T, k), -1.0, device="cuda"), torch.full((T, k), -1, dtype=torch.int32, device="cuda"))
    weights, ids = tessera.fused_gate(logits, bias, out=out, **_gate_kwargs(case))
    assert weights is out[0] and ids is out[1]
    torch.cuda.synchronize()
    check_gate(weights, ids, logits, bias, case)


class _Producer:
    """A minimal non-torch DLPack producer (delegates to a torch tensor)."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, stream=None, **kwargs):
        return self._t.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


@gpu
def test_gate_accepts_requires_grad_and_other_dlpack_producers():
    case = GATE_CASES["deepseek_v3"]
    logits, bias = make_gate_inputs(300, case, seed=5)
    w0, i0 = tessera.fused_gate(logits, bias, **_gate_kwargs(case))
    w1, i1 = tessera.fused_gate(logits.clone().requires_grad_(True), bias, **_gate_kwargs(case))
    w2, i2 = tessera.fused_gate(_Producer(logits), _Producer(bias), **_gate_kwargs(case))
    torch.cuda.synchronize()
    assert torch.equal(i0, i1) and torch.equal(w0, w1)
    assert torch.equal(i0, i2) and torch.equal(w0, w2)
    check_gate(w0, i0, logits, bias, case)


@gpu
def test_gate_on_a_side_stream():
    case = GATE_CASES["qwen3"]
    logits, bias = make_gate_inputs(1024, case, seed=6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        weights, ids = tessera.fused_gate(logits, bias, **_gate_kwargs(case))
    side.synchronize()
    check_gate(weights, ids, logits, bias, case)


@gpu
@pytest.mark.parametrize("name", ["odd_e160", "deepseek_v3"])
def test_gate_nan_ranks_last(name):
    case = GATE_CASES[name]
    T, E = 512, case["E"]
    logits, bias = make_gate_inputs(T, case, seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    nan_mask = torch.rand((T, E), device="cuda", generator=g) < 0.03
    logits = logits.masked_fill(nan_mask, math.nan)
    weights, ids = tessera.fused_gate(logits, bias, **_gate_kwargs(case))
    torch.cuda.synchronize()
    chosen_nan = nan_mask.gather(1, ids.long()[:, :case["topk"]])
    assert not bool(chosen_nan.any()), "a NaN expert was chosen while finite ones were left"
    check_gate(weights, ids, logits, bias, case)


@gpu
def test_gate_bad_dtype_names_argument():
    case = GATE_CASES["deepseek_v3"]
    logits, bias = make_gate_inputs(16, case)
    with pytest.raises(ValueError, match="'logits'"):
        tessera.fused_gate(logits.double(), bias, **_gate_kwargs(case))
    with pytest.raises(ValueError, match="'logits'"):
        tessera.fused_gate(logits.to(torch.int32), bias, **_gate_kwargs(case))
    with pytest.raises(ValueError, match="'bias'"):
        tessera.fused_gate(logits, bias.to(torch.int32), **_gate_kwargs(case))
    with pytest.raises(ValueError, match="'bias'"):
        tessera.fused_gate(logits, bias[:100], **_gate_kwargs(case))
    with pytest.raises(ValueError, match="'topk'"):
        tessera.fused_gate(logits, bias, **dict(_gate_kwargs(case), topk=33))
    with pytest.raises(ValueError, match="'logits'"):
        tessera.fused_gate(logits.cpu(), bias, **_gate_kwargs(case))


@gpu
def test_gate_cuda_graph_capture():
    case = GATE_CASES["deepseek_v3"]
    kw = _gate_kwargs(case)
    T = 256
    static_logits, bias = make_gate_inputs(T, case, seed=21)

    # Warm up on a side stream, as torch.cuda.graph expects.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tessera.fused_gate(static_logits, bias, **kw)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_weights, g_ids = tessera.fused_gate(static_logits, bias, **kw)

    for trial in range(3):
        fresh, _ = make_gate_inputs(T, case, seed=100 + trial)
        static_logits.copy_(fresh)
        graph.replay()
        e_weights, e_ids = tessera.fused_gate(static_logits, bias, **kw)
        torch.cuda.synchronize()
        assert torch.equal(g_ids, e_ids)
        assert torch.equal(g_weights, e_weights)
        check_gate(g_weights, g_ids, static_logits, bias, case)


# ================================================================================================================
# Permute
# ================================================================================================================


def permute_reference(ids, E, pad_multiple):
    """(counts [E], offsets [E+1], row_index [T, k], row_token [offsets[E]], src copy of each sorted row)."""
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(flat[valid], minlength=E)
    padded = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
    offsets = torch.zeros(E + 1, dtype=torch.long, device=ids.device)
    offsets[1:] = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    n = int(valid.sum())
    src = order[:n]
    expert = key[src]
    rows = offsets[expert] + torch.arange(n, device=ids.device) - starts[expert]
    row_index = torch.full((T * k,), -1, dtype=torch.long, device=ids.device)
    row_index[src] = rows
    total = int(offsets[E])
    row_token = torch.full((total,), -1, dtype=torch.long, device=ids.device)
    row_token[rows] = src // k
    return counts, offsets, row_index.view(T, k), row_token, rows, src // k


def random_ids(T, E, k, dtype=torch.int32 if torch else None, drop_fraction=0.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand((T, E), device="cuda", generator=g).argsort(dim=1)[:, :k]
    if drop_fraction:
        drop = torch.rand((T, k), device="cuda", generator=g) < drop_fraction
        bad = torch.where(torch.rand((T, k), device="cuda", generator=g) < 0.5, -1, E)  # -1 or E: both dropped
        ids = torch.where(drop, bad, ids)
    return ids.to(dtype).contiguous()


E4M3_MAX = 448.0


def assert_fp8_close(q, target):
    """q: the fp8 values (as any float dtype); target: the exact value in q units (x / scale).

    e4m3 has 3 mantissa bits: rounding error <= 2^-4 relative for normals, <= 2^-10 absolute for subnormals.
    """
    qd = q.double()
    tol = target.abs() * 2.0**-4 + 2.0**-10
    err = (qd - target).abs()
    assert bool((err <= tol * (1 + 1e-5)).all()), f"fp8 error too large: max excess {(err - tol).max().item():.3g}"
    assert bool((qd.abs() <= E4M3_MAX).all())


PERMUTE_CASES = [
    # T, H, E, k, pad, quant, ids dtype, x dtype, drop fraction
    (1, 256, 8, 2, 1, None, "int32", "bfloat16", 0.0),
    (4096, 1024, 64, 8, 1, None, "int32", "bfloat16", 0.0),
    (1000, 7168, 256, 8, 16, None, "int64", "bfloat16", 0.0),
    (777, 512, 32, 4, 8, None, "int32", "float16", 0.1),
    (333, 512, 32, 4, 8, "fp8_blockwise", "int32", "bfloat16", 0.0),
    (300, 200, 16, 2, 1, "fp8_blockwise", "int64", "bfloat16", 0.05),  # H not a multiple of 128
    (513, 7168, 256, 8, 128, "fp8_blockwise", "int32", "bfloat16", 0.0),
    (128, 1024, 8, 2, 4, "fp8_per_tensor", "int32", "float16", 0.0),
]


@gpu
@pytest.mark.parametrize("T,H,E,k,pad,quant,ids_dtype,x_dtype,drop", PERMUTE_CASES)
def test_permute_matches_reference(T, H, E, k, pad, quant, ids_dtype, x_dtype, drop):
    g = torch.Generator(device="cuda").manual_seed(T * 31 + H)
    x = torch.randn((T, H), device="cuda", generator=g).to(getattr(torch, x_dtype))
    ids = random_ids(T, E, k, dtype=getattr(torch, ids_dtype), drop_fraction=drop, seed=T + E)
    input_scale = None
    if quant == "fp8_per_tensor":
        # Half the range needed: the largest values saturate.
        input_scale = (x.float().abs().amax() / E4M3_MAX / 2).reshape(1)

    res = tessera.permute(x, ids, E, pad_multiple=pad, quant=quant, input_scale=input_scale)
    torch.cuda.synchronize()
    assert isinstance(res, tessera.PermuteResult)

    counts, offsets, row_index, row_token, rows, tokens = permute_reference(ids, E, pad)
    capacity = tessera.permute_capacity_rows(T, k, E, pad_multiple=pad, quant=quant)
    assert capacity == T * k + (E * (pad - 1) if pad > 1 else 0)
    assert res.x_perm.shape == (capacity, H)
    assert res.expert_counts.dtype == torch.int32 and res.expert_offsets.dtype == torch.int32
    assert torch.equal(res.expert_counts.long(), counts)
    assert torch.equal(res.expert_offsets.long(), offsets)
    assert torch.equal(res.row_index.long(), row_index)
    total = int(offsets[E])
    assert res.row_token.shape == (capacity,)
    assert torch.equal(res.row_token[:total].long(), row_token)

    pad_rows = (row_token == -1).nonzero().flatten()
    if quant is None:
        assert res.x_perm.dtype == x.dtype and res.scales is None
        assert torch.equal(res.x_perm[rows], x[tokens])
        assert bool((res.x_perm[pad_rows] == 0).all())
        return

    assert res.x_perm.dtype == torch.float8_e4m3fn
    bits = res.x_perm.view(torch.uint8)  # index through uint8: fp8 indexing kernels are not everywhere
    assert bool((bits[pad_rows] == 0).all()), "pad rows must be zero"
    q = bits[rows].view(torch.float8_e4m3fn).float()
    xr = x[tokens].double()
    if quant == "fp8_blockwise":
        nb = (H + 127) // 128
        assert res.scales is not None and res.scales.shape == (capacity, nb) and res.scales.dtype == torch.float32
        padded = torch.zeros((xr.shape[0], nb * 128), dtype=torch.float64, device="cuda")
        padded[:, :H] = xr
        amax = padded.view(-1, nb, 128).abs().amax(dim=-1)
        scale_ref = amax.clamp(min=1e-10) / E4M3_MAX
        s = res.scales[rows].double()
        torch.testing.assert_close(s, scale_ref, rtol=2e-6, atol=0)
        s_full = s.repeat_interleave(128, dim=1)[:, :H]
        assert_fp8_close(q, xr / s_full)
    else:
        assert res.scales is None
        target = (xr / input_scale.double()).clamp(-E4M3_MAX, E4M3_MAX)
        assert_fp8_close(q, target)
        assert bool((q.abs() == E4M3_MAX).any()), "the test meant some values to saturate"


@gpu
def test_permute_without_row_token():
    T, H, E, k = 64, 256, 16, 4
    x = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
    ids = random_ids(T, E, k, seed=5)
    res = tessera.permute(x, ids, E, with_row_token=False)
    torch.cuda.synchronize()
    assert res.row_token is None
    _, offsets, row_index, _, rows, tokens = permute_reference(ids, E, 1)
    assert torch.equal(res.row_index.long(), row_index)
    assert torch.equal(res.x_perm[rows], x[tokens])


@gpu
def test_permute_bad_dtype_names_argument():
    x = torch.randn((16, 256), device="cuda")
    ids = random_ids(16, 8, 2)
    with pytest.raises(ValueError, match="'x'"):
        tessera.permute(x, ids, 8)  # fp32 x
    with pytest.raises(ValueError, match="'ids'"):
        tessera.permute(x.bfloat16(), ids.to(torch.int16), 8)
    with pytest.raises(ValueError, match="'input_scale'"):
        tessera.permute(x.bfloat16(), ids, 8, quant="fp8_per_tensor")
    # The op's limits are named before its outputs are allocated (a huge pad_multiple once asked for the memory and
    # failed as a CUDA out-of-memory error; found in review), on the eager and the checked path alike.
    for kwargs, arg, experts in ((dict(pad_multiple=70000), "pad_multiple", 512), (dict(), "num_experts", 2000)):
        for extra in (dict(), dict(stream=torch.cuda.current_stream())):  # the eager path, then the checked one
            with pytest.raises(ValueError, match=f"'{arg}' must be in \\[1, "):
                tessera.permute(x.bfloat16(), ids, experts, **kwargs, **extra)


@gpu
def test_permute_cuda_graph_capture():
    T, H, E, k = 512, 1024, 32, 4
    x = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
    ids = random_ids(T, E, k, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tessera.permute(x, ids, E, pad_multiple=8, quant="fp8_blockwise")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_res = tessera.permute(x, ids, E, pad_multiple=8, quant="fp8_blockwise")
    for trial in range(2):
        ids.copy_(random_ids(T, E, k, seed=50 + trial))
        x.copy_(torch.randn_like(x))
        graph.replay()
        e_res = tessera.permute(x, ids, E, pad_multiple=8, quant="fp8_blockwise")
        torch.cuda.synchronize()
        total = int(e_res.expert_offsets[-1])
        for name in ("expert_offsets", "expert_counts", "row_index"):
            assert torch.equal(getattr(g_res, name), getattr(e_res, name)), name
        assert torch.equal(g_res.row_token[:total], e_res.row_token[:total])
        assert torch.equal(g_res.x_perm[:total].view(torch.uint8), e_res.x_perm[:total].view(torch.uint8))
        assert torch.equal(g_res.scales[:total], e_res.scales[:total])


# ================================================================================================================
# Unpermute-reduce
# ================================================================================================================


def unpermute_reference(y_perm, row_index, weights, residual, routed_scale):
    T, k = row_index.shape
    y = y_perm.double()
    out = torch.zeros((T, y.shape[1]), dtype=torch.float64, device=y.device)
    for j in range(k):
        r = row_index[:, j].long()
        valid = (r >= 0).unsqueeze(1)
        contrib = y[r.clamp(min=0)] * weights[:, j:j + 1].double()
        out += torch.where(valid, contrib, torch.zeros_like(contrib))
    out *= routed_scale
    if residual is not None:
        out += residual.double()
    return out


UNPERMUTE_CASES = [
    # T, H, E, k, pad, dtype, residual, routed_scale, drop fraction
    (1, 256, 8, 2, 1, "bfloat16", False, 1.0, 0.0),
    (1024, 7168, 256, 8, 1, "bfloat16", False, 2.5, 0.0),
    (4096, 2048, 64, 8, 16, "bfloat16", True, 1.0, 0.0),
    (777, 512, 32, 4, 8, "float16", True, 0.5, 0.1),
    (300, 200, 16, 2, 1, "bfloat16", False, 1.0, 0.3),
]


@gpu
@pytest.mark.parametrize("T,H,E,k,pad,dtype,with_residual,routed_scale,drop", UNPERMUTE_CASES)
def test_unpermute_reduce_matches_reference(T, H, E, k, pad, dtype, with_residual, routed_scale, drop):
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(T + H + k)
    ids = random_ids(T, E, k, drop_fraction=drop, seed=T * 7 + E)
    _, offsets, row_index, _, _, _ = permute_reference(ids, E, pad)
    rows = max(1, int(offsets[E]))
    y_perm = torch.randn((rows, H), device="cuda", generator=g).to(dt)
    weights = torch.rand((T, k), device="cuda", generator=g)
    residual = torch.randn((T, H), device="cuda", generator=g).to(dt) if with_residual else None
    row_index = row_index.to(torch.int32).contiguous()

    out = tessera.unpermute_reduce(y_perm, row_index, weights, residual, routed_scale)
    torch.cuda.synchronize()
    assert out.shape == (T, H) and out.dtype == dt
    ref = unpermute_reference(y_perm, row_index, weights, residual, routed_scale)
    rel = ((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    assert rel < 1e-2, f"relative Frobenius error {rel:.3g}"
    if residual is None:
        empty = (row_index < 0).all(dim=1)
        assert bool((out[empty] == 0).all()), "tokens with every copy dropped must be zero"

    # out= writes into the given tensor.
    buf = torch.empty_like(out)
    got = tessera.unpermute_reduce(y_perm, row_index, weights, residual, routed_scale, out=buf)
    torch.cuda.synchronize()
    assert got is buf
    torch.testing.assert_close(buf, out, rtol=0, atol=0)


@gpu
def test_unpermute_after_permute_roundtrip():
    # unpermute(permute(x)) with weights summing to 1 gives back x (up to bf16 rounding).
    T, H, E, k = 1000, 1024, 64, 8
    x = torch.randn((T, H), device="cuda", dtype=torch.bfloat16)
    ids = random_ids(T, E, k, seed=9)
    w = torch.rand((T, k), device="cuda")
    w = w / w.sum(dim=1, keepdim=True)
    res = tessera.permute(x, ids, E, pad_multiple=8)
    out = tessera.unpermute_reduce(res.x_perm, res.row_index, w)
    torch.cuda.synchronize()
    rel = ((out.double() - x.double()).norm() / x.double().norm()).item()
    assert rel < 1e-2


@gpu
def test_unpermute_bad_dtype_names_argument():
    T, H, k = 16, 256, 2
    y = torch.randn((T * k, H), device="cuda")
    row_index = torch.arange(T * k, device="cuda", dtype=torch.int32).view(T, k)
    w = torch.rand((T, k), device="cuda")
    with pytest.raises(ValueError, match="'y_perm'"):
        tessera.unpermute_reduce(y, row_index, w)  # fp32 y_perm
    with pytest.raises(ValueError, match="'row_index'"):
        tessera.unpermute_reduce(y.bfloat16(), row_index.long(), w)
    with pytest.raises(ValueError, match="'weights'"):
        tessera.unpermute_reduce(y.bfloat16(), row_index, w.bfloat16())


@gpu
def test_unpermute_cuda_graph_capture():
    T, H, E, k = 256, 1024, 32, 4
    ids = random_ids(T, E, k, seed=4)
    _, offsets, row_index, _, _, _ = permute_reference(ids, E, 1)
    row_index = row_index.to(torch.int32).contiguous()
    y = torch.randn((int(offsets[E]), H), device="cuda", dtype=torch.bfloat16)
    w = torch.rand((T, k), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tessera.unpermute_reduce(y, row_index, w, None, 2.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = tessera.unpermute_reduce(y, row_index, w, None, 2.0)
    y.copy_(torch.randn_like(y))
    graph.replay()
    e_out = tessera.unpermute_reduce(y, row_index, w, None, 2.0)
    torch.cuda.synchronize()
    torch.testing.assert_close(g_out, e_out, rtol=0, atol=0)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_meta_tensors_take_both_paths_alike():
    np = pytest.importorskip("numpy")
    # Meta tensors (shapes only) reach the ops' fake implementations on the eager entry and on the checked path (a
    # numpy bias takes it) alike; the checked path refused them before. No GPU needed.
    logits = torch.empty(4, 16, device="meta")
    for bias in (None, np.zeros(16, np.float32)):
        w, ids = tessera.fused_gate(logits, bias, topk=2)
        assert w.shape == (4, 2) and ids.shape == (4, 2) and w.is_meta and ids.is_meta
