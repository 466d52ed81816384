"""Python tests for tessera.moe_layer: the whole MoE layer (torch.ops.tessera.moe_layer, the plan, the weight steps
quantize_weights / dequantize_weights / load_checkpoint, and the raw entries in tessera._C).

Semantics (include/tessera/moe_layer.h): routing by tessera.fused_gate; per copy (t, j) of token t routed to expert
e, h = Q1(x[t]) · W13[e]ᵀ rounded to bf16, a = Q2(silu(h[:I]) · h[I:]) (fp32 math), o = a · W2[e]ᵀ rounded to bf16;
y[t] = Σ_j weight[t, j] · o(t, j) (+ residual[t]), one bf16 rounding. Q1 / Q2: e4m3 per (row, 128 columns) with
scale max(amax, 1e-10) / 448 ('fp8_blockwise'), e4m3 of v / static scale, saturated ('fp8_per_tensor'), bf16
('bf16'). Rows at or past num_tokens are zero (or the residual).

The tests at the top run without a GPU: the plan's validation (every rule of the config is a ValueError naming the
field, before any device query), quantize_weights / dequantize_weights (exact on weights built from e4m3 codes and
power-of-two scales, within one e4m3 rounding on random ones, the scale shapes and the all-zero block guard),
load_checkpoint for the DeepSeek-V3, Qwen3-MoE and Mixtral names from small synthetic checkpoints written with
safetensors (bf16, block-wise fp8 and per-tensor fp8; every conversion; the packed weights dequantized against the
float weights the checkpoint was made from), output shapes on meta tensors through both ways into the operator (the
C++ eager entry and the Python checked path), the schema, opcheck, make_fx, strict torch.export (Dynamo as
torch.compile(fullgraph=True) runs it) and the argument errors. The GPU tests compare the layer with a float64 torch
reference written here (routing from tessera.fused_gate on the same logits, every stored rounding of the header
modeled), split at the first GEMM as the C++ tests do (_check_layer): h from tessera's own ops against the model's h
(H_TOL), then y against the model fed that h (Y_TOL = 1e-2 for every format); a wrong expert, slot, block scale or
row is an O(1) error.
"""

import copy
import dataclasses
import inspect
import pickle

import pytest

import tessera
from _dispatch_record import recording_mode

from _optional import gpu, needs_torch, torch

try:
    import safetensors.torch as safetensors_torch
except ImportError:  # pragma: no cover - depends on the environment
    safetensors_torch = None

ml = tessera.moe_layer
needs_safetensors = pytest.mark.skipif(safetensors_torch is None or torch is None,
                                       reason="needs safetensors (pip install safetensors) and torch")
E4M3 = getattr(torch, "float8_e4m3fn", None) if torch is not None else None
# Relative Frobenius bounds of tests/gpu/test_moe_layer.cpp's error model, split at the first GEMM. H_TOL: the
# first GEMM's h against the float64 product (bf16: fp32 accumulation and the bf16 rounding, 1.1e-4 at most on an
# H200; fp8: the FP8 tensor cores' ~14-bit accumulator, 2.4e-2 at most, session 19). Y_TOL: y against the float64
# model fed tessera's own h (6.5e-3 at most). A model that derives h itself is not a stable yardstick for fp8: an h
# one bf16 ulp away moves an e4m3 activation code by a whole step now and then (up to ~4e-2 of y by chance).
H_TOL = {"bf16": 1e-2, "fp8_blockwise": 5e-2, "fp8_per_tensor": 5e-2}
Y_TOL = 1e-2


def _needs_kernels():
    from tessera import _torch_ops

    if not _torch_ops.available():
        pytest.skip(_torch_ops.load_error)


def _gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


# ================================================================================================================
# Without a GPU: exports, the config and the plan
# ================================================================================================================


def test_exports():
    assert "moe_layer" in tessera.__all__ and tessera.moe_layer is ml
    for name in ("MoeLayerConfig", "MoeLayerPlan", "MoeLayerWeights"):
        assert getattr(tessera, name) is getattr(ml, name) and name in tessera.__all__, name
    for name in ("plan", "quantize_weights", "dequantize_weights", "moe_layer", "load_checkpoint"):
        assert name in ml.__all__ and callable(getattr(ml, name)), name
    for name in ("moe_layer", "moe_layer_plan"):
        assert callable(getattr(tessera._C, name)) and getattr(tessera.dlpack, name) is getattr(tessera._C, name)
    assert ml.FORMATS == ("fp8_blockwise", "fp8_per_tensor", "bf16")
    assert tuple(tessera._C.moe_layer_formats) == ml.FORMATS
    assert ml.STYLES == ("deepseek_v3", "qwen3_moe", "mixtral")


def test_config_defaults_and_signatures():
    c = ml.MoeLayerConfig(hidden=256, intermediate=128, num_experts=8)
    assert (c.topk, c.num_groups, c.topk_groups, c.scoring, c.group_score, c.renormalize) == (8, 1, 1, "sigmoid",
                                                                                             "top2_sum", False)
    assert (c.routed_scaling_factor, c.num_shared_experts, c.shared_expert_weight, c.format) == (1.0, 0, 1.0,
                                                                                                "fp8_blockwise")
    assert dataclasses.replace(c, num_shared_experts=2).num_weight_experts == 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden = 512
    p = ml.MoeLayerPlan(c, 16, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 32
    assert [f.name for f in dataclasses.fields(ml.MoeLayerWeights)] == ["w13", "w2", "w13_scale", "w2_scale",
                                                                      "a13_scale", "a2_scale"]
    params = inspect.signature(ml.moe_layer).parameters
    assert list(params)[:4] == ["x", "router_logits", "weights", "plan"]
    for name in ("correction_bias", "residual", "num_tokens", "out", "workspace", "stream"):
        assert params[name].kind == params[name].KEYWORD_ONLY and params[name].default is None, name
    params = inspect.signature(ml.quantize_weights).parameters
    assert list(params) == ["w13", "w2", "format", "a13_scale", "a2_scale"]
    assert params["a13_scale"].kind == params["a13_scale"].KEYWORD_ONLY
    params = inspect.signature(ml.load_checkpoint).parameters
    assert list(params)[0] == "tensors"
    for name in ("layer_prefix", "style", "num_experts", "format", "num_shared_experts", "dtype", "a13_scale",
                 "a2_scale"):
        assert params[name].kind == params[name].KEYWORD_ONLY, name
    assert list(inspect.signature(ml.plan).parameters) == ["config", "max_tokens"]


def _config(**kw):
    base = dict(hidden=256, intermediate=256, num_experts=16, topk=4, num_groups=4, topk_groups=2)
    base.update(kw)
    return ml.MoeLayerConfig(**base)


# (field that breaks a rule of include/tessera/moe_layer.h / moe.h, the bad config): each must be refused by the
# C++ moe_layer_plan before it looks at a device, with a ValueError naming the field.
BAD_CONFIGS = [
    ("hidden", dict(hidden=200)),
    ("hidden", dict(hidden=0)),
    ("hidden", dict(hidden=-128)),
    ("intermediate", dict(intermediate=100)),
    ("intermediate", dict(intermediate=0)),
    ("num_experts", dict(num_experts=0, num_groups=1, topk_groups=1, topk=1)),
    ("num_experts", dict(num_experts=513, num_groups=1, topk_groups=1)),
    ("topk", dict(topk=0)),
    ("topk", dict(topk=33, num_experts=64, num_groups=1, topk_groups=1)),
    ("topk", dict(topk=9, num_experts=16, num_groups=4, topk_groups=2)),  # 8 experts in the 2 kept groups
    ("num_groups", dict(num_groups=3)),  # does not divide 16
    ("topk_groups", dict(topk_groups=0)),
    ("topk_groups", dict(topk_groups=5)),  # > num_groups = 4
    ("num_shared_experts", dict(num_shared_experts=-1)),
    ("routed_scaling_factor", dict(routed_scaling_factor=float("inf"))),
    ("routed_scaling_factor", dict(routed_scaling_factor=1e39)),  # finite in Python, inf as the C++ float
    ("shared_expert_weight", dict(shared_expert_weight=float("nan"), num_shared_experts=1)),
]


@pytest.mark.parametrize("field,bad", BAD_CONFIGS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_CONFIGS)])
def test_plan_refuses_each_bad_constant(field, bad):
    with pytest.raises(ValueError, match=f"'{field}'"):
        ml.plan(_config(**bad), 64)
    # The raw entry alike (the constants in MoeLayerConfig's order, then max_tokens).
    c = _config(**bad)
    with pytest.raises(ValueError, match=f"'{field}'"):
        tessera._C.moe_layer_plan(*(getattr(c, f.name) for f in dataclasses.fields(c)), 64)


def test_plan_names_and_types_are_checked_first():
    with pytest.raises(ValueError, match="tessera.moe_layer.plan: 'format'"):
        ml.plan(_config(format="fp8"), 16)
    with pytest.raises(ValueError, match="'scoring'"):
        ml.plan(_config(scoring="relu"), 16)
    with pytest.raises(ValueError, match="'group_score'"):
        ml.plan(_config(group_score="sum"), 16)
    with pytest.raises(ValueError, match="'max_tokens' must be >= 0"):
        ml.plan(_config(), -1)
    with pytest.raises(TypeError, match="'hidden' must be an int"):
        ml.plan(_config(hidden=256.0), 16)
    with pytest.raises(TypeError, match="'max_tokens' must be an int"):
        ml.plan(_config(), "16")
    with pytest.raises(ValueError, match="'config' must be a tessera.moe_layer.MoeLayerConfig"):
        ml.plan(dict(hidden=256), 16)
    # The raw entries parse the names (C++ messages) before anything else.
    args = [256, 256, 16, 4, 4, 2, "sigmoid", "top2_sum", False, 1.0, 0, 1.0, "fp8_blockwise", 16]
    for i, value, arg in ((12, "int4", "format"), (6, "tanh", "scoring"), (7, "top3_sum", "group_score")):
        bad = list(args)
        bad[i] = value
        with pytest.raises(ValueError, match=f"'{arg}' must be"):
            tessera._C.moe_layer_plan(*bad)
        with pytest.raises(ValueError, match=f"tessera.moe_layer: '{arg}' must be"):
            tessera._C.moe_layer(*([None] * 13), *bad[:13], 16, 0)
    with pytest.raises(ValueError, match="'num_experts' must fit in 32 bits"):
        tessera._C.moe_layer_plan(*args[:2], 2**33, *args[3:])
    # A constant moe_layer_plan refuses is reported before a tensor is read.
    bad = list(args)
    bad[0] = 100
    with pytest.raises(ValueError, match="hidden"):
        tessera._C.moe_layer(*([None] * 13), *bad[:13], 16, 0)


def _plan_or_skip(config, max_tokens):
    try:
        return ml.plan(config, max_tokens)
    except RuntimeError as e:  # a plan may ask the device (its SM count) once the constants are valid
        pytest.skip(f"moe_layer_plan needs a device here: {e}")


def test_plan_of_valid_constants():
    for cfg in (_config(), _config(format="bf16", num_shared_experts=1, scoring="softmax", group_score="max"),
                _config(num_experts=256, num_groups=8, topk_groups=4, topk=8, hidden=7168, intermediate=2048,
                        format="fp8_per_tensor"), _config(num_experts=1, num_groups=1, topk_groups=1, topk=1)):
        p = _plan_or_skip(cfg, 64)
        assert isinstance(p, ml.MoeLayerPlan) and p.config is cfg and p.max_tokens == 64
        assert isinstance(p.workspace_bytes, int) and p.workspace_bytes >= 0
        assert _plan_or_skip(cfg, 0).max_tokens == 0
        assert _plan_or_skip(cfg, 1024).workspace_bytes >= p.workspace_bytes


# ================================================================================================================
# Without a GPU: quantize_weights / dequantize_weights
# ================================================================================================================


def _exact_blockwise(seed, g, rows, cols):
    """(w float32 [g, rows, cols], codes, scales [g, rows/128, cols/128]): every 128x128 block e4m3 codes (one of
    them ±448, so the block's amax / 448 is its scale) times a power-of-two scale (an all-zero block in expert 0)."""
    gen = _gen(seed)
    codes = (torch.randn((g, rows, cols), generator=gen) * 100).clamp(-448, 448).to(E4M3)
    nb_r, nb_c = rows // 128, cols // 128
    for e in range(g):
        for i in range(nb_r):
            for j in range(nb_c):
                codes[e, i * 128 + (i + j) % 128, j * 128 + (e * 7 + j) % 128] = 448.0 * (-1) ** (i + j + e)
    exps = torch.randint(-12, -2, (g, nb_r, nb_c), generator=gen)
    scales = torch.pow(2.0, exps.double()).float()
    codes[0, :128, :128] = 0.0
    scales[0, 0, 0] = 1.0  # the guard: an all-zero block gets scale 1
    w = codes.float() * scales.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return w, codes, scales


def _exact_per_tensor(seed, g, rows, cols):
    gen = _gen(seed)
    codes = (torch.randn((g, rows, cols), generator=gen) * 100).clamp(-448, 448).to(E4M3)
    for e in range(g):
        codes[e, e % rows, (3 * e) % cols] = -448.0 if e % 2 else 448.0
    scales = torch.pow(2.0, torch.randint(-12, -2, (g,), generator=gen).double()).float()
    return codes.float() * scales[:, None, None], codes, scales


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def _same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


@needs_torch
def test_blockwise_quantize_is_exact_on_codes_times_power_of_two_scales(seed):
    w13, c13, s13 = _exact_blockwise(seed, 3, 512, 256)
    w2, c2, s2 = _exact_blockwise(seed + 1, 3, 256, 256)
    for dtype in (torch.float32, torch.bfloat16):  # every value is exact in bf16 too (4-bit significands)
        q = ml.quantize_weights(w13.to(dtype), w2.to(dtype), "fp8_blockwise")
        assert isinstance(q, ml.MoeLayerWeights) and q.a13_scale is None and q.a2_scale is None
        assert q.w13.dtype == E4M3 and q.w13_scale.dtype == torch.float32
        assert q.w13_scale.shape == (3, 4, 2) and q.w2_scale.shape == (3, 2, 2)
        assert _same(q.w13, c13) and _same(q.w2, c2)
        assert torch.equal(q.w13_scale, s13) and torch.equal(q.w2_scale, s2)
        d13, d2 = ml.dequantize_weights(q, "fp8_blockwise")
        assert d13.dtype == torch.float32 and torch.equal(d13, w13) and torch.equal(d2, w2)
        d13, d2 = ml.dequantize_weights(q, "fp8_blockwise", torch.float64)
        assert d13.dtype == torch.float64 and torch.equal(d13, w13.double())
    assert (q.num_weight_experts, q.hidden, q.intermediate) == (3, 256, 256)


@needs_torch
def test_per_tensor_quantize_is_exact_on_codes_times_power_of_two_scales(seed):
    w13, c13, s13 = _exact_per_tensor(seed, 4, 256, 128)
    w2, c2, s2 = _exact_per_tensor(seed + 1, 4, 128, 128)
    q = ml.quantize_weights(w13, w2, "fp8_per_tensor", a13_scale=0.02, a2_scale=torch.tensor(0.5))
    assert _same(q.w13, c13) and _same(q.w2, c2) and torch.equal(q.w13_scale, s13) and torch.equal(q.w2_scale, s2)
    assert q.w13_scale.shape == (4,) and q.w2_scale.shape == (4,)
    for got, want in ((q.a13_scale, 0.02), (q.a2_scale, 0.5)):
        assert got.shape == (1,) and got.dtype == torch.float32 and got.item() == pytest.approx(want)
    d13, d2 = ml.dequantize_weights(q, "fp8_per_tensor")
    assert torch.equal(d13, w13) and torch.equal(d2, w2)


def _random_weights(seed, g, i, h, dtype=None):
    """Float weights with uneven magnitudes: outlier columns and experts of different scales (float32 unless dtype
    is given; the default is not torch.float32 itself, which would need torch when this module is collected)."""
    dtype = torch.float32 if dtype is None else dtype
    gen = _gen(seed)
    w13 = torch.randn((g, 2 * i, h), generator=gen) * 0.05
    w13[:, :, ::37] *= 8.0
    w13 *= torch.rand((g, 1, 1), generator=gen) + 0.5
    w2 = torch.randn((g, h, i), generator=gen) * 0.05
    w2[:, ::29] *= 4.0
    return w13.to(dtype), w2.to(dtype)


def _within_one_rounding(got, want, scale):
    """|got - want| <= one e4m3 rounding of want / scale: 2^-4 relative (3-bit mantissa) or 2^-10 absolute
    (the subnormal spacing 2^-9 halved), in units of the scale; float32 slack."""
    err = (got.double() - want.double()).abs()
    bound = torch.maximum(want.double().abs() * 2.0**-4, scale.double() * 2.0**-10) * (1 + 1e-6)
    return bool((err <= bound).all())


@needs_torch
def test_quantize_random_weights_within_one_e4m3_rounding(seed):
    g, i, h = 3, 128, 384
    w13, w2 = _random_weights(seed, g, i, h)
    w13[1, :128, :128] = 0.0  # an all-zero block: scale 1, codes 0
    q = ml.quantize_weights(w13, w2, "fp8_blockwise")
    amax = w13.view(g, 2, 128, 3, 128).abs().amax(dim=(2, 4))
    assert torch.equal(q.w13_scale, torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)))
    assert q.w13_scale[1, 0, 0] == 1.0 and not q.w13[1, :128, :128].float().any()
    assert q.w13.float().abs().amax() == 448.0
    d13, d2 = ml.dequantize_weights(q, "fp8_blockwise")
    exp13 = q.w13_scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    exp2 = q.w2_scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert _within_one_rounding(d13, w13, exp13) and _within_one_rounding(d2, w2, exp2)
    p = ml.quantize_weights(w13, w2, "fp8_per_tensor", a13_scale=torch.tensor([0.01]), a2_scale=0.01)
    assert torch.equal(p.w2_scale, w2.abs().amax(dim=(1, 2)) / 448.0)
    d13, d2 = ml.dequantize_weights(p, "fp8_per_tensor")
    assert _within_one_rounding(d13, w13, p.w13_scale[:, None, None].expand_as(w13))
    assert _within_one_rounding(d2, w2, p.w2_scale[:, None, None].expand_as(w2))
    b = ml.quantize_weights(w13, w2, "bf16")
    assert b.w13.dtype == torch.bfloat16 and b.w13_scale is None and b.a13_scale is None
    assert torch.equal(b.w13, w13.bfloat16()) and torch.equal(b.w2, w2.bfloat16())
    d13, _ = ml.dequantize_weights(b, "bf16")
    assert torch.equal(d13, w13.bfloat16().float())
    # uint8 views of the codes dequantize alike (the DLPack form).
    u = dataclasses.replace(q, w13=q.w13.view(torch.uint8), w2=q.w2.view(torch.uint8))
    assert torch.equal(ml.dequantize_weights(u, "fp8_blockwise")[0], ml.dequantize_weights(q, "fp8_blockwise")[0])


@needs_torch
def test_weights_move_and_print(seed):
    q = ml.quantize_weights(*_random_weights(seed, 2, 128, 128), "fp8_per_tensor", a13_scale=1.0, a2_scale=1.0)
    m = q.to("meta")
    assert all(getattr(m, f.name).is_meta for f in dataclasses.fields(m))
    assert m.w13.dtype == E4M3 and m.w13_scale.shape == (2,) and q.cpu().w13 is q.w13
    assert "MoeLayerWeights(experts=2, hidden=128, intermediate=128" in repr(q)


@needs_torch
def test_weight_step_errors_name_the_argument(seed):
    w13, w2 = _random_weights(seed, 2, 128, 256)
    op = "tessera.moe_layer.quantize_weights"
    with pytest.raises(ValueError, match=f"{op}: 'format'"):
        ml.quantize_weights(w13, w2, "int4")
    with pytest.raises(ValueError, match=r"'w13' must have rank 3 \[G, 2I, H\]"):
        ml.quantize_weights(w13[0], w2, "bf16")
    with pytest.raises(ValueError, match=r"'w2' must be \[G, H, I\] = \[2, 256, 128\]"):
        ml.quantize_weights(w13, w2[:, :, :64], "bf16")
    with pytest.raises(ValueError, match=r"'w2' must be \[G, H, I\]"):
        ml.quantize_weights(w13, w2[:1], "bf16")
    with pytest.raises(ValueError, match="'w13' must be a float tensor"):
        ml.quantize_weights(w13.to(torch.int32), w2, "bf16")
    with pytest.raises(ValueError, match="'w2' must be a float tensor"):
        ml.quantize_weights(w13, w2.to(E4M3), "bf16")
    with pytest.raises(ValueError, match="H and I multiples of 128"):
        ml.quantize_weights(w13[:, :192, :64], w2[:, :64, :96], "fp8_blockwise")
    with pytest.raises(ValueError, match="'a13_scale' is required with format 'fp8_per_tensor'"):
        ml.quantize_weights(w13, w2, "fp8_per_tensor", a2_scale=1.0)
    with pytest.raises(ValueError, match="'a2_scale' is required"):
        ml.quantize_weights(w13, w2, "fp8_per_tensor", a13_scale=1.0)
    with pytest.raises(ValueError, match="only taken with format 'fp8_per_tensor'"):
        ml.quantize_weights(w13, w2, "fp8_blockwise", a13_scale=1.0)
    with pytest.raises(ValueError, match=r"'a13_scale' must be a float tensor of one element"):
        ml.quantize_weights(w13, w2, "fp8_per_tensor", a13_scale=torch.ones(2), a2_scale=1.0)
    with pytest.raises(TypeError, match="'w13'"):
        ml.quantize_weights(object(), w2, "bf16")
    q = ml.quantize_weights(w13, w2, "fp8_blockwise")
    op = "tessera.moe_layer.dequantize_weights"
    with pytest.raises(ValueError, match=f"{op}: 'weights.w13_scale' must be \\[2\\] with format 'fp8_per_tensor'"):
        ml.dequantize_weights(q, "fp8_per_tensor")
    with pytest.raises(ValueError, match="'weights.w2_scale' is required with format 'fp8_blockwise'"):
        ml.dequantize_weights(dataclasses.replace(q, w2_scale=None), "fp8_blockwise")
    with pytest.raises(ValueError, match="'weights.w13' must be torch.float8_e4m3fn"):
        ml.dequantize_weights(dataclasses.replace(q, w13=q.w13.float()), "fp8_blockwise")
    with pytest.raises(ValueError, match="'weights' must be a tessera.moe_layer.MoeLayerWeights"):
        ml.dequantize_weights((q.w13, q.w2), "fp8_blockwise")


# ================================================================================================================
# Without a GPU: load_checkpoint from synthetic safetensors checkpoints
# ================================================================================================================

PREFIX = "model.layers.3"
E_CK, H_CK, I_CK = 4, 256, 128  # experts, hidden, intermediate of the synthetic checkpoints


def _float_layer(seed, num_shared_i=0):
    """The float weights a synthetic checkpoint is made from: per expert (gate [I, H], up [I, H], down [H, I]) and,
    when num_shared_i > 0, a shared MLP of that intermediate size; the router gate [E, H] and bias [E]."""
    gen = _gen(seed)

    def mat(rows, cols):
        m = torch.randn((rows, cols), generator=gen) * 0.05
        m[:, ::41] *= 6.0
        return m

    experts = [(mat(I_CK, H_CK), mat(I_CK, H_CK), mat(H_CK, I_CK)) for _ in range(E_CK)]
    shared = (mat(num_shared_i, H_CK), mat(num_shared_i, H_CK), mat(H_CK, num_shared_i)) if num_shared_i else None
    return experts, shared, torch.randn((E_CK, H_CK), generator=gen), torch.randn((E_CK,), generator=gen) * 0.1


def _ck_blockwise(m):
    """The test's own block-wise e4m3 quantization of one matrix (as DeepSeek-V3's checkpoints hold it): codes and
    weight_scale_inv [ceil(r/128), ceil(c/128)]."""
    r, c = m.shape
    s = torch.empty((-(-r // 128), -(-c // 128)))
    q = torch.empty((r, c), dtype=E4M3)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = m[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s[i, j] = blk.abs().max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).clamp(-448, 448).to(E4M3)
    return q, s


def _ck_per_tensor(m):
    s = m.abs().max() / 448.0
    return (m / s).clamp(-448, 448).to(E4M3), s


def _deq(q, s):
    """What a stored fp8 matrix stands for, in float64."""
    s = s.double()
    if s.dim() == 2:
        s = s.repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
    return q.double() * s


def _store(tensors, base, m, kind, input_scale=None):
    """Adds matrix m under base as `kind`: 'bf16', 'block' (+ weight_scale_inv) or 'tensor' (+ weight_scale,
    input_scale). Returns the float64 values the checkpoint holds."""
    if kind == "bf16":
        tensors[base + ".weight"] = m.bfloat16()
        return m.bfloat16().double()
    if kind == "block":
        q, s = _ck_blockwise(m)
        tensors[base + ".weight"], tensors[base + ".weight_scale_inv"] = q, s
        return _deq(q, s)
    q, s = _ck_per_tensor(m)
    tensors[base + ".weight"], tensors[base + ".weight_scale"] = q, s.reshape(())
    tensors[base + ".input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    return _deq(q, s)


def _checkpoint(tmp_path, seed, style, kind, num_shared_i=0, name="model.safetensors"):
    """Writes a synthetic layer with safetensors and reads it back. Returns (tensors, the float64 values stored per
    expert [(gate, up, down)], the shared MLP's or None, router gate, bias, input scales {(e, proj): value})."""
    experts, shared, gate, bias = _float_layer(seed, num_shared_i)
    tensors, stored, inputs = {}, [], {}
    names = ("w1", "w3", "w2") if style == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    moe = f"{PREFIX}.block_sparse_moe" if style == "mixtral" else f"{PREFIX}.mlp"
    for e, mats in enumerate(experts):
        row = []
        for p, (n, m) in enumerate(zip(names, mats)):
            inputs[(e, p)] = 0.01 * (1 + (e * 3 + p) % 5)
            row.append(_store(tensors, f"{moe}.experts.{e}.{n}", m, kind, inputs[(e, p)]))
        stored.append(tuple(row))
    shared_stored = None
    if shared is not None:
        shared_stored = tuple(_store(tensors, f"{moe}.shared_experts.{n}", m, kind, 0.02)
                              for n, m in zip(names, shared))
    tensors[f"{moe}.gate.weight"] = gate.bfloat16()
    if style == "deepseek_v3":
        tensors[f"{moe}.gate.e_score_correction_bias"] = bias
    tensors["model.layers.2.mlp.gate.weight"] = torch.zeros(1)  # another layer's tensor, never read
    path = tmp_path / name
    safetensors_torch.save_file(tensors, str(path))
    return safetensors_torch.load_file(str(path)), stored, shared_stored, gate, bias, inputs


def _packed_float(stored, shared_stored, num_shared):
    """The float64 [G, 2I, H] and [G, H, I] the packed layer should stand for: experts in order, w13 = [gate; up],
    then the shared MLP split into num_shared experts of size I (rows of gate / up, columns of down)."""
    w13 = [torch.cat([g, u]) for g, u, _ in stored]
    w2 = [d for _, _, d in stored]
    for k in range(num_shared):
        g, u, d = shared_stored
        rows = slice(k * I_CK, (k + 1) * I_CK)
        w13.append(torch.cat([g[rows], u[rows]]))
        w2.append(d[:, rows])
    return torch.stack(w13), torch.stack(w2)


def _rel(got, want):
    d = (got.double() - want.double()).norm().item()
    ref = want.double().norm().item()
    return d / ref if ref > 0 else d


def _load(tensors, style, fmt, **kw):
    return ml.load_checkpoint(tensors, layer_prefix=PREFIX, style=style, num_experts=E_CK, format=fmt, **kw)


@needs_safetensors
@pytest.mark.parametrize("style", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_load_bf16_checkpoint_in_every_format(tmp_path, seed, style):
    shared_i = 2 * I_CK if style == "deepseek_v3" else 0  # a shared MLP of 2·I: two experts of size I
    tensors, stored, shared_stored, gate, bias, _ = _checkpoint(tmp_path, seed, style, "bf16", shared_i)
    s = 2 if style == "deepseek_v3" else 0
    want13, want2 = _packed_float(stored, shared_stored, s)
    experts, shared, _, _ = _float_layer(seed, shared_i)
    orig13, orig2 = _packed_float([tuple(m.double() for m in x) for x in experts],
                                  shared and tuple(m.double() for m in shared), s)

    w, g, b = _load(tensors, style, "bf16")
    assert w.w13.shape == (E_CK + s, 2 * I_CK, H_CK) and w.w2.shape == (E_CK + s, H_CK, I_CK)
    assert w.w13.dtype == torch.bfloat16 and w.w13_scale is None and w.a13_scale is None
    d13, d2 = ml.dequantize_weights(w, "bf16", torch.float64)
    assert torch.equal(d13, want13) and torch.equal(d2, want2)  # the stored bf16 values, in their places
    assert _rel(d13, orig13) < 4e-3 and _rel(d2, orig2) < 4e-3
    assert torch.equal(g, gate.bfloat16()) and g.shape == (E_CK, H_CK)
    if style == "deepseek_v3":
        assert torch.equal(b, bias)
    else:
        assert b is None
    g32, b32 = _load(tensors, style, "bf16", dtype=torch.float32)[1:]
    assert g32.dtype == torch.float32 and (b32 is None or b32.dtype == torch.float32)

    # fp8_blockwise: quantize_weights' rule on the stacked bf16 weights, bit for bit.
    w, _, _ = _load(tensors, style, "fp8_blockwise")
    q = ml.quantize_weights(want13.bfloat16(), want2.bfloat16(), "fp8_blockwise")
    assert _same(w.w13, q.w13) and _same(w.w2, q.w2)
    assert torch.equal(w.w13_scale, q.w13_scale) and torch.equal(w.w2_scale, q.w2_scale)
    d13, d2 = ml.dequantize_weights(w, "fp8_blockwise")
    assert _rel(d13, orig13) < 0.04 and _rel(d2, orig2) < 0.04

    # fp8_per_tensor needs the activation scales from the caller (a bf16 checkpoint has none).
    with pytest.raises(ValueError, match="'a13_scale' is required with format 'fp8_per_tensor'"):
        _load(tensors, style, "fp8_per_tensor")
    w, _, _ = _load(tensors, style, "fp8_per_tensor", a13_scale=0.03, a2_scale=torch.tensor([0.05]))
    assert w.w13_scale.shape == (E_CK + s,) and w.a13_scale.item() == pytest.approx(0.03)
    assert w.a2_scale.shape == (1,) and w.a2_scale.item() == pytest.approx(0.05)
    q = ml.quantize_weights(want13.bfloat16(), want2.bfloat16(), "fp8_per_tensor", a13_scale=0.03, a2_scale=0.05)
    assert _same(w.w13, q.w13) and torch.equal(w.w13_scale, q.w13_scale) and _same(w.w2, q.w2)
    d13, d2 = ml.dequantize_weights(w, "fp8_per_tensor")
    assert _rel(d13, orig13) < 0.05 and _rel(d2, orig2) < 0.05


@needs_safetensors
@pytest.mark.parametrize("style,shared_i", [("deepseek_v3", I_CK), ("deepseek_v3", 2 * I_CK), ("qwen3_moe", 0)])
def test_load_blockwise_fp8_checkpoint(tmp_path, seed, style, shared_i):
    tensors, stored, shared_stored, gate, bias, _ = _checkpoint(tmp_path, seed, style, "block", shared_i)
    s = shared_i // I_CK
    want13, want2 = _packed_float(stored, shared_stored, s)
    experts, shared, _, _ = _float_layer(seed, shared_i)
    orig13, orig2 = _packed_float([tuple(m.double() for m in x) for x in experts],
                                  shared and tuple(m.double() for m in shared), s)

    # Kept as stored: the checkpoint's codes and scales in their places, no requantization.
    w, g, b = _load(tensors, style, "fp8_blockwise")
    assert w.w13.dtype == E4M3 and w.w13_scale.shape == (E_CK + s, 2 * I_CK // 128, H_CK // 128)
    assert w.w2_scale.shape == (E_CK + s, H_CK // 128, I_CK // 128)
    mlp = f"{PREFIX}.mlp"
    for e in range(E_CK):
        base = f"{mlp}.experts.{e}"
        assert _same(w.w13[e, :I_CK], tensors[f"{base}.gate_proj.weight"])
        assert _same(w.w13[e, I_CK:], tensors[f"{base}.up_proj.weight"])
        assert _same(w.w2[e], tensors[f"{base}.down_proj.weight"])
        assert torch.equal(w.w13_scale[e], torch.cat([tensors[f"{base}.gate_proj.weight_scale_inv"],
                                                      tensors[f"{base}.up_proj.weight_scale_inv"]]))
        assert torch.equal(w.w2_scale[e], tensors[f"{base}.down_proj.weight_scale_inv"])
    d13, d2 = ml.dequantize_weights(w, "fp8_blockwise", torch.float64)
    assert torch.equal(d13, want13) and torch.equal(d2, want2)
    assert _rel(d13, orig13) < 0.04 and _rel(d2, orig2) < 0.04
    if style == "deepseek_v3":
        assert torch.equal(b, bias) and torch.equal(g, gate.bfloat16())
    else:
        assert b is None

    # To bf16: dequantized (codes × scales), rounded once.
    w, _, _ = _load(tensors, style, "bf16")
    assert torch.equal(w.w13, want13.bfloat16()) and torch.equal(w.w2, want2.bfloat16())

    # To per-tensor: dequantized and requantized with quantize_weights' rule.
    w, _, _ = _load(tensors, style, "fp8_per_tensor", a13_scale=0.1, a2_scale=0.1)
    q = ml.quantize_weights(want13.float(), want2.float(), "fp8_per_tensor", a13_scale=0.1, a2_scale=0.1)
    assert _same(w.w13, q.w13) and torch.equal(w.w2_scale, q.w2_scale)

    if style == "deepseek_v3":
        # num_shared_experts given: it must be I_s / I; 0 leaves the shared experts out.
        assert _load(tensors, style, "bf16", num_shared_experts=s)[0].w13.shape[0] == E_CK + s
        assert _load(tensors, style, "bf16", num_shared_experts=0)[0].w13.shape[0] == E_CK
        with pytest.raises(ValueError, match=f"'num_shared_experts' must be I_s / I = {shared_i} / {I_CK}"):
            _load(tensors, style, "bf16", num_shared_experts=s + 1)
    else:
        with pytest.raises(ValueError, match="'num_shared_experts' must be 0 or None for style 'qwen3_moe'"):
            _load(tensors, style, "bf16", num_shared_experts=1)


@needs_safetensors
def test_load_mixtral_per_tensor_fp8_checkpoint(tmp_path, seed):
    tensors, stored, _, gate, _, inputs = _checkpoint(tmp_path, seed, "mixtral", "tensor")
    moe = f"{PREFIX}.block_sparse_moe"
    experts, _, _, _ = _float_layer(seed)
    orig13, orig2 = _packed_float([tuple(m.double() for m in x) for x in experts], None, 0)

    w, g, b = _load(tensors, "mixtral", "fp8_per_tensor")
    assert b is None and torch.equal(g, gate.bfloat16())
    # The activation scales: the largest input_scale of w1 / w3 (a13) and of w2 (a2) over the experts.
    assert w.a13_scale.shape == (1,) and w.a13_scale.dtype == torch.float32
    assert w.a13_scale.item() == pytest.approx(max(v for (e, p), v in inputs.items() if p < 2))
    assert w.a2_scale.item() == pytest.approx(max(v for (e, p), v in inputs.items() if p == 2))
    for e in range(E_CK):
        base = f"{moe}.experts.{e}"
        s1, s3 = tensors[f"{base}.w1.weight_scale"], tensors[f"{base}.w3.weight_scale"]
        assert w.w13_scale[e] == torch.maximum(s1, s3)  # one scale per expert: the larger of the two
        assert _same(w.w2[e], tensors[f"{base}.w2.weight"]) and w.w2_scale[e] == tensors[f"{base}.w2.weight_scale"]
        # The matrix that has the larger scale keeps its codes; the other is rescaled, within one e4m3 rounding.
        keep, other = ((slice(0, I_CK), "w1"), (slice(I_CK, 2 * I_CK), "w3"))[::1 if s1 >= s3 else -1]
        assert _same(w.w13[e, keep[0]], tensors[f"{base}.{keep[1]}.weight"])
        rows = slice(0, I_CK) if other[1] == "w1" else slice(I_CK, 2 * I_CK)
        d = w.w13[e, rows].double() * w.w13_scale[e].double()
        ref = stored[e][0 if other[1] == "w1" else 1]
        assert _within_one_rounding(d, ref, w.w13_scale[e].expand(ref.shape))
    d13, d2 = ml.dequantize_weights(w, "fp8_per_tensor", torch.float64)
    assert _rel(d13, orig13) < 0.05 and _rel(d2, orig2) < 0.05
    # The caller's activation scales win over the checkpoint's.
    w2_, _, _ = _load(tensors, "mixtral", "fp8_per_tensor", a13_scale=0.5, a2_scale=0.25)
    assert w2_.a13_scale.item() == 0.5 and w2_.a2_scale.item() == 0.25

    # To bf16: the stored values, rounded once; to block-wise: quantize_weights' rule on them.
    want13, want2 = _packed_float(stored, None, 0)
    w, _, _ = _load(tensors, "mixtral", "bf16")
    assert torch.equal(w.w13, want13.bfloat16()) and torch.equal(w.w2, want2.bfloat16())
    w, _, _ = _load(tensors, "mixtral", "fp8_blockwise")
    q = ml.quantize_weights(want13.float(), want2.float(), "fp8_blockwise")
    assert _same(w.w13, q.w13) and torch.equal(w.w13_scale, q.w13_scale) and _same(w.w2, q.w2)


@needs_safetensors
def test_load_checkpoint_errors_name_the_tensor(tmp_path, seed):
    tensors, *_ = _checkpoint(tmp_path, seed, "deepseek_v3", "block", I_CK)
    op = "tessera.moe_layer.load_checkpoint"
    with pytest.raises(ValueError, match=f"{op}: the checkpoint has no tensor '{PREFIX}.mlp.experts.4.gate_proj"):
        ml.load_checkpoint(tensors, layer_prefix=PREFIX, style="deepseek_v3", num_experts=5, format="bf16")
    with pytest.raises(ValueError, match="no tensor 'model.layers.4.mlp.experts.0.gate_proj.weight'"):
        ml.load_checkpoint(tensors, layer_prefix="model.layers.4.", style="deepseek_v3", num_experts=4,
                           format="bf16")
    with pytest.raises(ValueError, match=f"no tensor '{PREFIX}.block_sparse_moe.experts.0.w1.weight'"):
        ml.load_checkpoint(tensors, layer_prefix=PREFIX, style="mixtral", num_experts=4, format="bf16")
    with pytest.raises(ValueError, match=rf"'{PREFIX}.mlp.gate.weight' must be \[E, H\] = \[3, 256\]"):
        ml.load_checkpoint(tensors, layer_prefix=PREFIX, style="deepseek_v3", num_experts=3, format="bf16")
    with pytest.raises(ValueError, match="'style'"):
        _load(tensors, "llama", "bf16")
    with pytest.raises(ValueError, match="'format'"):
        _load(tensors, "deepseek_v3", "fp8")
    with pytest.raises(ValueError, match="'tensors' must be a Mapping"):
        ml.load_checkpoint(list(tensors.items()), layer_prefix=PREFIX, style="deepseek_v3", num_experts=4,
                           format="bf16")
    with pytest.raises(ValueError, match="only taken with format 'fp8_per_tensor'"):
        _load(tensors, "deepseek_v3", "bf16", a13_scale=1.0)
    broken = dict(tensors)
    del broken[f"{PREFIX}.mlp.experts.2.up_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=f"'{PREFIX}.mlp.experts.2.up_proj.weight' is fp8 but the checkpoint has "
                                         "neither"):
        _load(broken, "deepseek_v3", "bf16")
    broken = dict(tensors)
    broken[f"{PREFIX}.mlp.experts.1.down_proj.weight_scale_inv"] = torch.ones(3, 3)
    with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv' must be float \[2, 1\]"):
        _load(broken, "deepseek_v3", "bf16")
    broken = dict(tensors)
    broken[f"{PREFIX}.mlp.experts.3.up_proj.weight"] = torch.zeros((I_CK, H_CK + 128), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"experts.3.up_proj.weight' must be \[128, 256\]"):
        _load(broken, "deepseek_v3", "bf16")
    broken = dict(tensors)
    broken[f"{PREFIX}.mlp.shared_experts.gate_proj.weight"] = torch.zeros((96, H_CK), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shared experts' intermediate size \\(96"):
        _load(broken, "deepseek_v3", "bf16")
    broken = {k: v for k, v in tensors.items() if "shared_experts" not in k}
    assert _load(broken, "deepseek_v3", "bf16")[0].w13.shape[0] == E_CK  # none in the checkpoint: none packed
    with pytest.raises(ValueError, match="'num_shared_experts' is 1 but the checkpoint has no tensor"):
        _load(broken, "deepseek_v3", "bf16", num_shared_experts=1)


# ================================================================================================================
# Without a GPU: the operator (schema, meta and fake tensors, tracing, argument errors)
# ================================================================================================================


@needs_torch
def test_schema_marks_what_it_writes():
    from tessera import _torch_ops

    assert "moe_layer" in _torch_ops.OPS
    schema = torch.ops.tessera.moe_layer.default._schema
    assert [a.name for a in schema.arguments] == [
        "x", "router_logits", "correction_bias", "residual", "num_tokens", "w13", "w2", "w13_scale", "w2_scale",
        "a13_scale", "a2_scale", "y", "workspace", "hidden", "intermediate", "num_experts", "topk", "num_groups",
        "topk_groups", "scoring", "group_score", "renormalize", "routed_scaling_factor", "num_shared_experts",
        "shared_expert_weight", "format", "max_tokens"]
    assert len(schema.returns) == 0
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"y", "workspace"}
    types = {a.name: str(a.type) for a in schema.arguments}
    assert types["num_tokens"] == types["workspace"] == types["a2_scale"] == "Optional[Tensor]"
    assert (types["hidden"], types["scoring"], types["renormalize"], types["routed_scaling_factor"],
            types["max_tokens"]) == ("int", "str", "bool", "float", "int")


@needs_torch
def test_cuda_kernel_and_direct_entry_are_registered():
    _needs_kernels()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("tessera::moe_layer", "CUDA")
    assert hasattr(tessera._torch_C, "moe_layer") and hasattr(tessera._torch_C, "moe_layer_eager")


@needs_torch
def test_eager_plan_is_built_once_per_plan_and_absent_where_cpp_refuses_the_config():
    """The eager path's C++ plan (constants checked and planned once): one object per plan, reused by every call;
    None for a config C++ refuses, so that the checked path names the argument."""
    _needs_kernels()
    plan, _ = _meta_layer("fp8_blockwise")
    ep = plan._eager_plan
    assert isinstance(ep, tessera._torch_C.MoeLayerEagerPlan) and plan._eager_plan is ep
    for field, value in (("hidden", 100), ("topk", 0), ("format", "int8")):
        bad = dataclasses.replace(plan, config=dataclasses.replace(plan.config, **{field: value}))
        assert bad._eager_plan is None, field
    # A plan that has run eagerly still copies and pickles (its fields only; the copy builds its own eager plan).
    for copied in (copy.copy(plan), copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        assert copied == plan and "_eager_plan" not in copied.__dict__
        assert isinstance(copied._eager_plan, tessera._torch_C.MoeLayerEagerPlan)


@needs_torch
def test_eager_calls_take_the_cpp_entry_not_the_checked_path(monkeypatch):
    """A valid call goes through moe_layer_eager (here routing meta tensors to the operator) and never falls back to
    the checked path (a fallback would hide a broken entry: the results are the same)."""
    _needs_kernels()

    def checked(*args, **kwargs):
        raise AssertionError("the checked path ran")

    monkeypatch.setattr(ml, "_moe_layer_checked", checked)
    plan, w = _meta_layer("fp8_blockwise")
    x = torch.empty((5, 256), dtype=torch.bfloat16, device="meta")
    with _operator_args_mode() as mode:
        y = ml.moe_layer(x, torch.empty((5, 16), device="meta"), w, plan)
    assert y.shape == (5, 256) and len(mode.calls) == 1


@pytest.fixture(params=["eager", "checked"])
def way(request, monkeypatch):
    """Each meta-tensor test runs through both ways into the operator: the C++ eager entry (tessera._torch_C
    .moe_layer_eager, which checks, allocates y and routes meta tensors to the operator) and the Python checked
    path (what torch.compile traces and stream= takes)."""
    if request.param == "checked":
        monkeypatch.setattr(ml, "fast_entry", lambda stream: None)
    return request.param


def _meta_layer(fmt, e=16, s=1, h=256, i=256, device="meta"):
    """(plan, weights) of meta (or fake) tensors shaped as the format has them; the plan made directly (a real one
    would ask moe_layer_plan, and its workspace size does not matter to the fake implementation)."""
    cfg = _config(num_experts=e, num_shared_experts=s, hidden=h, intermediate=i, format=fmt)
    g = e + s
    fp8 = fmt != "bf16"
    dt = E4M3 if fp8 else torch.bfloat16
    t = (lambda shape, dtype=torch.float32: torch.empty(shape, dtype=dtype, device=device))
    w = ml.MoeLayerWeights(t((g, 2 * i, h), dt), t((g, h, i), dt))
    if fmt == "fp8_blockwise":
        w.w13_scale, w.w2_scale = t((g, 2 * i // 128, h // 128)), t((g, h // 128, i // 128))
    elif fmt == "fp8_per_tensor":
        w.w13_scale, w.w2_scale, w.a13_scale, w.a2_scale = t((g,)), t((g,)), t((1,)), t((1,))
    return ml.MoeLayerPlan(cfg, 128, 0), w


def _operator_args_mode():
    """A dispatch mode that records the arguments of every torch.ops.tessera.moe_layer call reaching it."""
    return recording_mode(args_of="tessera.moe_layer.default")


@needs_torch
@pytest.mark.parametrize("fmt", ["fp8_blockwise", "fp8_per_tensor", "bf16"])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_meta_tensors_give_y_of_xs_shape(way, fmt, tokens):
    _needs_kernels()
    plan, w = _meta_layer(fmt)
    x = torch.empty((tokens, 256), dtype=torch.bfloat16, device="meta")
    logits = torch.empty((tokens, 16), device="meta")
    extra = dict(correction_bias=torch.empty((16,), device="meta"), residual=torch.empty_like(x),
                 num_tokens=torch.empty((1,), dtype=torch.int32, device="meta"))
    for kw in ({}, extra):
        with _operator_args_mode() as mode:
            y = ml.moe_layer(x, logits, w, plan, **kw)
        assert y.shape == (tokens, 256) and y.dtype == torch.bfloat16 and y.is_meta
        assert len(mode.calls) == 1
        args = mode.calls[0]
        assert args[11].shape == (tokens, 256) and args[12] is None  # y, and no workspace: the operator's own
        c = plan.config
        assert args[13:] == (256, 256, 16, c.topk, c.num_groups, c.topk_groups, "sigmoid", "top2_sum", False, 1.0, 1,
                             1.0, fmt, 128)
        assert (args[2] is None) == (not kw) and (args[4] is None) == (not kw)
    out = torch.empty((tokens, 256), dtype=torch.bfloat16, device="meta")
    ws = torch.empty((64,), dtype=torch.uint8, device="meta")
    with _operator_args_mode() as mode:
        assert ml.moe_layer(x, logits, w, plan, out=out, workspace=ws) is out
    assert mode.calls[0][11] is out and mode.calls[0][12] is ws


@needs_torch
def test_recording_mode_sees_the_operator():
    _needs_kernels()
    plan, w = _meta_layer("fp8_blockwise")
    x = torch.empty((9, 256), dtype=torch.bfloat16, device="meta")
    with recording_mode() as mode:
        y = ml.moe_layer(x, torch.empty((9, 16), device="meta"), w, plan)
    assert [c for c in mode.calls if c.startswith("tessera.")] == ["tessera.moe_layer.default"], mode.calls
    assert y.shape == (9, 256)


def _errors():
    """(exception, expected match, call) triples: each call breaks one rule the torch layer checks, before anything
    is allocated or launched."""
    plan, w = _meta_layer("fp8_blockwise")
    x = torch.empty((8, 256), dtype=torch.bfloat16, device="meta")
    logits = torch.empty((8, 16), device="meta")
    out_small = torch.empty((8, 128), dtype=torch.bfloat16, device="meta")
    op = "tessera.moe_layer"
    return [
        (ValueError, rf"{op}: 'x' must have rank 2 \[T, H\], got shape \[8, 256, 1\]",
         lambda: ml.moe_layer(x[..., None], logits, w, plan)),
        (ValueError, rf"{op}: 'x' must have rank 2", lambda: ml.moe_layer(x[0], logits, w, plan)),
        (ValueError, rf"{op}: 'out' must be \[T, H\] = \[8, 256\] \(x's shape\), got shape \[8, 128\]",
         lambda: ml.moe_layer(x, logits, w, plan, out=out_small)),
        (ValueError, f"{op}: 'plan' must be a tessera.moe_layer.MoeLayerPlan",
         lambda: ml.moe_layer(x, logits, w, plan.config)),
        (ValueError, f"{op}: 'plan.config' must be a tessera.moe_layer.MoeLayerConfig",
         lambda: ml.moe_layer(x, logits, w, ml.MoeLayerPlan(None, 8, 0))),
        (ValueError, f"{op}: 'weights' must be a tessera.moe_layer.MoeLayerWeights",
         lambda: ml.moe_layer(x, logits, (w.w13, w.w2), plan)),
        (ValueError, f"{op}: 'format'", lambda: ml.moe_layer(x, logits, w, dataclasses.replace(
            plan, config=dataclasses.replace(plan.config, format="int8")))),
        (ValueError, f"{op}: 'scoring'", lambda: ml.moe_layer(x, logits, w, dataclasses.replace(
            plan, config=dataclasses.replace(plan.config, scoring="tanh")))),
        (TypeError, f"{op}: 'topk' must be an int", lambda: ml.moe_layer(x, logits, w, dataclasses.replace(
            plan, config=dataclasses.replace(plan.config, topk=4.5)))),
        (TypeError, f"{op}: 'num_tokens' must be a torch.Tensor", lambda: ml.moe_layer(x, logits, w, plan,
                                                                                        num_tokens=5)),
    ]


@needs_torch
def test_argument_errors_without_a_gpu(way):
    _needs_kernels()
    for exc, match, call in _errors():
        with recording_mode() as mode:
            with pytest.raises(exc, match=match):
                call()
        assert "tessera.moe_layer.default" not in mode.calls, f"{match}: the operator was called"
        assert not [c for c in mode.calls if "empty" in c], f"{match}: allocated before the check"


@needs_torch
def test_host_tensors_are_refused_before_launch(way):
    _needs_kernels()
    plan, w = _meta_layer("bf16", device="cpu")
    x = torch.zeros((4, 256), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="tessera.moe_layer: 'x' must be a CUDA tensor"):
        ml.moe_layer(x, torch.zeros((4, 16)), w, plan)


@needs_torch
def test_opcheck_on_meta_tensors():
    _needs_kernels()
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck needs a newer torch")
    plan, w = _meta_layer("fp8_per_tensor", s=0)
    x = torch.empty((5, 256), dtype=torch.bfloat16, device="meta")
    y = torch.empty((5, 256), dtype=torch.bfloat16, device="meta")
    c = plan.config
    torch.library.opcheck(torch.ops.tessera.moe_layer.default,
                          (x, torch.empty((5, 16), device="meta"), None, x, None, w.w13, w.w2, w.w13_scale,
                           w.w2_scale, w.a13_scale, w.a2_scale, y, None, 256, 256, 16, c.topk, c.num_groups,
                           c.topk_groups, "softmax", "max", True, 2.5, 0, 1.0, "fp8_per_tensor", 128))


@needs_torch
def test_symbolic_tracing_sees_the_operator():
    # make_fx with dynamic shapes: the eager entry hands symbolic sizes to the checked path, which allocates with
    # torch.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    plan, _ = _meta_layer("fp8_blockwise")
    with FakeTensorMode(shape_env=ShapeEnv()):
        _, w = _meta_layer("fp8_blockwise", device="cuda")
        x = torch.empty((12, 256), dtype=torch.bfloat16, device="cuda")
        logits = torch.empty((12, 16), device="cuda")

    def fn(x, logits, w13, w2, s13, s2):
        return ml.moe_layer(x, logits, ml.MoeLayerWeights(w13, w2, s13, s2), plan)

    graph = make_fx(fn, tracing_mode="symbolic")(x, logits, w.w13, w.w2, w.w13_scale, w.w2_scale)
    traced = [str(n.target) for n in graph.graph.nodes if "tessera" in str(n.target)]
    assert traced == ["tessera.moe_layer.default"], traced


@needs_torch
def test_dynamo_traces_the_wrapper_whole():
    # Strict torch.export runs Dynamo as torch.compile(fullgraph=True) does (a graph break is an error) on fake CUDA
    # tensors: the checked path, the plan and the weights' dataclass trace without a GPU. The GPU test below
    # compiles and runs.
    _needs_kernels()
    from torch._subclasses.fake_tensor import FakeTensorMode

    plan, _ = _meta_layer("fp8_per_tensor")

    class Layer(torch.nn.Module):
        def forward(self, x, logits, bias, w13, w2, s13, s2, a13, a2):
            w = ml.MoeLayerWeights(w13, w2, s13, s2, a13, a2)
            return ml.moe_layer(x, logits, w, plan, correction_bias=bias, residual=x) * 2.0

    with FakeTensorMode():
        _, w = _meta_layer("fp8_per_tensor", device="cuda")
        args = (torch.empty((7, 256), dtype=torch.bfloat16, device="cuda"), torch.empty((7, 16), device="cuda"),
                torch.empty((16,), device="cuda"), w.w13, w.w2, w.w13_scale, w.w2_scale, w.a13_scale, w.a2_scale)
        program = torch.export.export(Layer(), args, strict=True)
    traced = [n for n in program.graph.nodes if "tessera" in str(n.target)]
    assert [str(n.target) for n in traced] == ["tessera.moe_layer.default"], traced
    output = next(n for n in program.graph.nodes if n.op == "output")
    val = output.args[0][0].meta["val"]
    assert tuple(val.shape) == (7, 256) and val.dtype == torch.bfloat16


# ================================================================================================================
# GPU: the layer against a float64 reference, num_tokens, residual, T = 0 / 1, compile, CUDA graphs, DLPack
# ================================================================================================================


def _q_act(v, fmt, scale=None):
    """The activation quantization of the header, as float64 values: v fp32 [rows, cols]."""
    if fmt == "bf16":
        return v.to(torch.bfloat16).double()
    if fmt == "fp8_per_tensor":
        return (v / scale).clamp(-448, 448).to(E4M3).double() * scale.double()
    rows, cols = v.shape
    blocks = v.reshape(rows, cols // 128, 128)
    s = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 448.0
    q = (blocks / s).clamp(-448, 448).to(E4M3).double() * s.double()
    return q.reshape(rows, cols)


def _gate_kwargs(cfg):
    return dict(topk=cfg.topk, num_groups=cfg.num_groups, topk_groups=cfg.topk_groups, scoring=cfg.scoring,
                group_score=cfg.group_score, renormalize=cfg.renormalize,
                routed_scaling_factor=cfg.routed_scaling_factor, num_shared_experts=cfg.num_shared_experts,
                shared_expert_weight=cfg.shared_expert_weight)


def _reference(x, logits, weights, cfg, bias=None, residual=None, n=None, h=None, with_h=False):
    """float64 y [T, H] of the layer with every stored rounding modeled (before y's own bf16 rounding). Routing:
    tessera.fused_gate on the same logits (checked against its own reference in test_moe.py).
    h          None: the model computes h itself; else [n, slots, 2I], h of each copy as tessera computed it (see
               _gpu_h): everything after the first GEMM is modeled from it.
    with_h     also return the model's h [n, slots, 2I] (zeros for dropped copies): (y, h)."""
    t_all, hidden = x.shape
    n = t_all if n is None else max(0, min(int(n), t_all))
    i = cfg.intermediate
    slots = cfg.topk + cfg.num_shared_experts
    y = torch.zeros((t_all, hidden), dtype=torch.float64, device=x.device)
    h_model = torch.zeros((n, slots, 2 * i), dtype=torch.float32, device=x.device)
    if n > 0:
        rw, ids = tessera.fused_gate(logits[:n], bias, **_gate_kwargs(cfg))
        w13, w2 = ml.dequantize_weights(weights, cfg.format, torch.float64)
        xq = _q_act(x[:n].float(), cfg.format, weights.a13_scale)
        for e in range(cfg.num_weight_experts):
            t, j = (ids == e).nonzero(as_tuple=True)
            if t.numel() == 0:
                continue
            hh = (xq[t] @ w13[e].T).to(torch.bfloat16).float() if h is None else h[t, j].float()
            h_model[t, j] = hh
            g, u = hh[:, :i], hh[:, i:]
            a = g / (1 + torch.exp(-g)) * u
            o = (_q_act(a, cfg.format, weights.a2_scale) @ w2[e].T).to(torch.bfloat16).double()
            y.index_add_(0, t, rw[t, j].double()[:, None] * o)
    if residual is not None:
        y += residual.double()
    return (y, h_model) if with_h else y


def _gpu_h(x, logits, weights, cfg, bias=None, n=None):
    """h [n, slots, 2I] of each copy (float32 of its bf16 values; zeros for dropped copies) as tessera's own ops
    compute it: fused_gate, permute with the layer's quantization, the grouped GEMM (the kernels the layer runs on
    the same inputs)."""
    t_all = x.shape[0]
    n = t_all if n is None else max(0, min(int(n), t_all))
    slots = cfg.topk + cfg.num_shared_experts
    h = torch.zeros((n, slots, 2 * cfg.intermediate), dtype=torch.float32, device=x.device)
    if n == 0:
        return h
    _, ids = tessera.fused_gate(logits[:n], bias, **_gate_kwargs(cfg))
    g = cfg.num_weight_experts
    if cfg.format == "fp8_blockwise":
        p = tessera.permute(x[:n], ids, g, quant="fp8_blockwise")
        hp = tessera.grouped_gemm_fp8(p.x_perm, weights.w13, p.expert_offsets, p.scales, weights.w13_scale,
                                      scale_mode="blockwise")
    elif cfg.format == "fp8_per_tensor":
        p = tessera.permute(x[:n], ids, g, quant="fp8_per_tensor", input_scale=weights.a13_scale)
        hp = tessera.grouped_gemm_fp8(p.x_perm, weights.w13, p.expert_offsets, weights.a13_scale, weights.w13_scale)
    else:
        p = tessera.permute(x[:n], ids, g)
        hp = tessera.grouped_gemm_bf16(p.x_perm, weights.w13, p.expert_offsets)
    rows = p.row_index.long()
    routed = rows >= 0
    h[routed] = hp[rows[routed]].float()
    return h


def _check_layer(y, x, logits, weights, cfg, bias=None, residual=None, n=None):
    """y's first n rows (all by default) against the float64 model, split at the first GEMM as in
    tests/gpu/test_moe_layer.cpp: h from tessera's own ops against the model's h (H_TOL), then y against the model
    fed that h (Y_TOL). Returns (h error, y error, y against the model deriving h itself)."""
    t_all = x.shape[0]
    k = t_all if n is None else max(0, min(int(n), t_all))
    if k == 0:
        return 0.0, 0.0, 0.0
    h_gpu = _gpu_h(x, logits, weights, cfg, bias, k)
    want, h_model = _reference(x, logits, weights, cfg, bias, residual, k, with_h=True)
    forced = _reference(x, logits, weights, cfg, bias, residual, k, h=h_gpu)
    eh, ey, em = _rel(h_gpu, h_model), _rel(y[:k], forced[:k]), _rel(y[:k], want[:k])
    assert eh <= H_TOL[cfg.format], f"the first GEMM's h against the float64 model: {eh:.3g} > {H_TOL[cfg.format]}"
    assert ey <= Y_TOL, (f"y against the float64 model fed tessera's own h: {ey:.3g} > {Y_TOL} (against the model "
                         f"deriving h itself: {em:.3g})")
    return eh, ey, em


def _layer(seed, fmt, e=16, s=1, h=256, i=256, **gate):
    """(config, weights on the GPU) with random float weights quantized to fmt."""
    cfg = _config(num_experts=e, num_shared_experts=s, hidden=h, intermediate=i, format=fmt, **gate)
    w13, w2 = _random_weights(seed, e + s, i, h)
    # Static activation scales as a calibration would give them: x ~ N(0, 1) (|x| < 5), and silu(g)·u of these
    # weights has a 99.9th percentile near 12 (the rare larger values saturate, in the reference too).
    scales = dict(a13_scale=5.0 / 448, a2_scale=16.0 / 448) if fmt == "fp8_per_tensor" else {}
    return cfg, ml.quantize_weights(w13, w2, fmt, **scales).cuda()


def _inputs(seed, t, cfg, residual=False):
    gen = _gen(seed, "cuda")
    x = torch.randn((t, cfg.hidden), device="cuda", generator=gen).bfloat16()
    logits = torch.randn((t, cfg.num_experts), device="cuda", generator=gen)
    bias = torch.randn((cfg.num_experts,), device="cuda", generator=gen) * 0.1
    res = torch.randn((t, cfg.hidden), device="cuda", generator=gen).bfloat16() if residual else None
    return x, logits, bias, res


def _poisoned(t, h):
    return torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")


# (id, format, experts, shared, gate constants): the three formats, grouped sigmoid with bias (DeepSeek-V3's gate),
# softmax top-k (Qwen3 / Mixtral's), shared experts with weight 1 and 0.5.
LAYERS = [
    pytest.param("fp8_blockwise", 16, 1, dict(topk=4, num_groups=4, topk_groups=2, renormalize=True,
                                              routed_scaling_factor=2.5), id="blockwise_grouped_shared"),
    pytest.param("fp8_blockwise", 8, 0, dict(topk=2, num_groups=1, topk_groups=1, scoring="softmax"),
                 id="blockwise_softmax"),
    pytest.param("fp8_per_tensor", 8, 0, dict(topk=2, num_groups=1, topk_groups=1, scoring="softmax",
                                              renormalize=True), id="per_tensor_softmax"),
    pytest.param("fp8_per_tensor", 16, 2, dict(topk=3, num_groups=2, topk_groups=1, group_score="max",
                                               shared_expert_weight=0.5), id="per_tensor_grouped_shared2"),
    pytest.param("bf16", 8, 1, dict(topk=2, num_groups=1, topk_groups=1), id="bf16_shared"),
    pytest.param("bf16", 16, 0, dict(topk=4, num_groups=4, topk_groups=2, renormalize=True), id="bf16_grouped"),
]


@gpu
@pytest.mark.parametrize("fmt,e,s,gate", LAYERS)
@pytest.mark.parametrize("tokens", [1, 7, 64, 133])
def test_matches_float64_reference(seed, fmt, e, s, gate, tokens):
    cfg, w = _layer(seed, fmt, e, s, **gate)
    plan = ml.plan(cfg, 256)
    x, logits, bias, _ = _inputs(seed + 1, tokens, cfg)
    out = _poisoned(tokens, cfg.hidden)
    y = ml.moe_layer(x, logits, w, plan, correction_bias=bias, out=out)
    torch.cuda.synchronize()
    assert y is out and not y.isnan().any()
    _check_layer(y, x, logits, w, cfg, bias)
    # Determinism: the same call again gives the same bits.
    assert torch.equal(ml.moe_layer(x, logits, w, plan, correction_bias=bias), y)


@gpu
@pytest.mark.parametrize("fmt,e,s,gate", LAYERS[::2])
def test_num_tokens_and_residual(seed, fmt, e, s, gate):
    cfg, w = _layer(seed, fmt, e, s, **gate)
    plan = ml.plan(cfg, 64)
    x, logits, bias, res = _inputs(seed + 1, 40, cfg, residual=True)
    for n in (17, 0, 40, 1000, -3):  # clamped to [0, 40]
        count = torch.tensor([n], dtype=torch.int32, device="cuda")
        for residual in (None, res):
            out = _poisoned(40, cfg.hidden)
            y = ml.moe_layer(x, logits, w, plan, correction_bias=bias, residual=residual, num_tokens=count, out=out)
            torch.cuda.synchronize()
            k = max(0, min(n, 40))
            rest = y[k:]
            assert torch.equal(rest, torch.zeros_like(rest) if residual is None else residual[k:]), n
            _check_layer(y, x, logits, w, cfg, bias, residual, n)
    # residual without num_tokens: every row routed, the residual added once.
    y = ml.moe_layer(x, logits, w, plan, correction_bias=bias, residual=res)
    _check_layer(y, x, logits, w, cfg, bias, res)


@gpu
@pytest.mark.parametrize("fmt", ["fp8_blockwise", "fp8_per_tensor", "bf16"])
def test_zero_and_one_token(seed, fmt):
    cfg, w = _layer(seed, fmt, 8, 1, topk=2, num_groups=1, topk_groups=1)
    plan = ml.plan(cfg, 16)
    x, logits, bias, res = _inputs(seed + 1, 1, cfg, residual=True)
    y = ml.moe_layer(x[:0], logits[:0], w, plan, correction_bias=bias)
    assert y.shape == (0, cfg.hidden) and y.dtype == torch.bfloat16
    y = ml.moe_layer(x, logits, w, plan, correction_bias=bias, residual=res, out=_poisoned(1, cfg.hidden))
    _check_layer(y, x, logits, w, cfg, bias, res)


@gpu
@pytest.mark.parametrize("fmt,e,s,gate", LAYERS[::2])
def test_compile_fullgraph_matches_eager(seed, fmt, e, s, gate):
    cfg, w = _layer(seed, fmt, e, s, **gate)
    plan = ml.plan(cfg, 128)
    x, logits, bias, res = _inputs(seed + 1, 50, cfg, residual=True)

    def layer(x, logits, bias, res):
        return ml.moe_layer(x, logits, w, plan, correction_bias=bias, residual=res) * 2.0

    eager = layer(x, logits, bias, res)
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(x, logits, bias, res)
    torch.cuda.synchronize()
    assert torch.equal(got, eager), "compiled moe_layer differs from eager"
    _check_layer(eager / 2.0, x, logits, w, cfg, bias, res)


@gpu
@pytest.mark.parametrize("fmt", ["fp8_blockwise", "fp8_per_tensor", "bf16"])
def test_cuda_graph_capture_and_replay_with_new_routing_and_token_count(seed, fmt):
    cfg, w = _layer(seed, fmt, 16, 1, topk=4, num_groups=4, topk_groups=2)
    rows = 48
    plan = ml.plan(cfg, rows)
    x, logits, bias, res = _inputs(seed + 1, rows, cfg, residual=True)
    out = torch.empty((rows, cfg.hidden), dtype=torch.bfloat16, device="cuda")
    ws = torch.empty((max(plan.workspace_bytes, 16),), dtype=torch.uint8, device="cuda")
    count = torch.tensor([rows], dtype=torch.int32, device="cuda")
    kw = dict(correction_bias=bias, residual=res, num_tokens=count, out=out, workspace=ws)
    ml.moe_layer(x, logits, w, plan, **kw)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ml.moe_layer(x, logits, w, plan, **kw)
    assert y is out
    for round_, n in enumerate((rows, 13, 1, 0, 30)):
        nx, nlogits, _, nres = _inputs(seed + 10 + round_, rows, cfg, residual=True)
        x.copy_(nx)
        logits.copy_(nlogits)  # new routing
        res.copy_(nres)
        count.fill_(n)  # a new token count
        out.fill_(float("nan"))
        graph.replay()
        want = ml.moe_layer(x, logits, w, plan, correction_bias=bias, residual=res,
                            num_tokens=torch.tensor([n], dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {round_} (num_tokens {n}) differs from eager"
        assert torch.equal(out[n:], res[n:])
        _check_layer(out, x, logits, w, cfg, bias, res, n)


@gpu
def test_workspace_and_stream_arguments(seed):
    cfg, w = _layer(seed, "fp8_blockwise", 8, 0, topk=2, num_groups=1, topk_groups=1)
    plan = ml.plan(cfg, 32)
    x, logits, bias, _ = _inputs(seed + 1, 32, cfg)
    want = ml.moe_layer(x, logits, w, plan, correction_bias=bias)
    ws = torch.empty((max(plan.workspace_bytes, 16),), dtype=torch.uint8, device="cuda")
    assert torch.equal(ml.moe_layer(x, logits, w, plan, correction_bias=bias, workspace=ws), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    y = ml.moe_layer(x, logits, w, plan, correction_bias=bias, stream=side)
    side.synchronize()
    assert torch.equal(y, want)
    if plan.workspace_bytes > 16:
        with pytest.raises(ValueError, match="workspace"):
            ml.moe_layer(x, logits, w, plan, workspace=torch.empty(16, dtype=torch.uint8, device="cuda"))


@gpu
def test_bad_arguments_are_value_errors(seed):
    cfg, w = _layer(seed, "fp8_blockwise", 8, 0, topk=2, num_groups=1, topk_groups=1)
    plan = ml.plan(cfg, 16)
    x, logits, bias, _ = _inputs(seed + 1, 16, cfg)
    with pytest.raises(ValueError, match="'x'"):  # fp16 x
        ml.moe_layer(x.half(), logits, w, plan)
    with pytest.raises(ValueError, match="x|max_tokens"):  # more tokens than the plan's max_tokens
        ml.moe_layer(torch.cat([x, x]), torch.cat([logits, logits]), w, plan)
    with pytest.raises(ValueError, match="router_logits|logits"):
        ml.moe_layer(x, logits[:, :4], w, plan)
    with pytest.raises(ValueError, match="w13_scale"):
        ml.moe_layer(x, logits, dataclasses.replace(w, w13_scale=None), plan)
    with pytest.raises(ValueError, match="w13"):  # the weights left on the host
        ml.moe_layer(x, logits, w.cpu(), plan)
    with pytest.raises(ValueError, match="'y'|'out'"):
        ml.moe_layer(x, logits, w, plan, out=torch.empty((16, 256), dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match="num_tokens"):
        ml.moe_layer(x, logits, w, plan, num_tokens=torch.tensor([3], dtype=torch.int64, device="cuda"))
    # Through the dispatcher (what torch.compile calls) the C++ validation's errors are ValueErrors too.
    c = plan.config
    y = torch.empty((16, 256), dtype=torch.bfloat16, device="cuda")
    args = [x, logits, bias, None, None, w.w13, w.w2, w.w13_scale, w.w2_scale, None, None, y, None, 256, 256, 8,
            c.topk, c.num_groups, c.topk_groups, c.scoring, c.group_score, c.renormalize, c.routed_scaling_factor,
            c.num_shared_experts, c.shared_expert_weight, c.format, 16]
    torch.ops.tessera.moe_layer(*args)
    for index, value, match in ((13, 200, "hidden"), (25, "fp8", "format"), (19, "tanh", "scoring"),
                                (16, 0, "topk"), (26, 8, "x|max_tokens")):
        bad = list(args)
        bad[index] = value
        with pytest.raises(ValueError, match=match):
            torch.ops.tessera.moe_layer(*bad)
    torch.cuda.synchronize()


@gpu
def test_raw_dlpack_entry_matches_the_torch_layer(seed):
    # tessera._C.moe_layer (DLPack capsules, the fp8 weights as uint8 views, preallocated y and workspace, the
    # stream as an int).
    from tessera._dlpack import to_capsule

    cfg, w = _layer(seed, "fp8_per_tensor", 8, 1, topk=2, num_groups=1, topk_groups=1)
    plan = ml.plan(cfg, 24)
    x, logits, bias, res = _inputs(seed + 1, 24, cfg, residual=True)
    count = torch.tensor([19], dtype=torch.int32, device="cuda")
    want = ml.moe_layer(x, logits, w, plan, correction_bias=bias, residual=res, num_tokens=count)
    y = _poisoned(24, cfg.hidden)
    constants = [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]
    need = tessera.dlpack.moe_layer_plan(*constants, 24)
    assert need == plan.workspace_bytes
    ws = torch.empty((max(need, 16),), dtype=torch.uint8, device="cuda")
    cap = (lambda t: None if t is None else to_capsule(t))
    tessera.dlpack.moe_layer(cap(x), cap(logits), cap(bias), cap(res), cap(count), cap(w.w13), cap(w.w2),
                             cap(w.w13_scale), cap(w.w2_scale), cap(w.a13_scale), cap(w.a2_scale), cap(y), cap(ws),
                             *constants, 24, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(y, want)
