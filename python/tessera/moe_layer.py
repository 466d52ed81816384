"""tessera.moe_layer — one whole MoE layer in one call: gate → permute (+ quantize) → grouped GEMM (w13) → SiLU·mul
(+ quantize) → grouped GEMM (w2) → weighted reduce (C++: include/tessera/moe_layer.h).

    ids, weights = fused_gate(router_logits, correction_bias, config's gate constants)       (tessera.fused_gate)
    for each copy (t, j) of token t routed to expert e = ids[t, j] (shared experts are ids E .. E+s-1):
        h = Q1(x[t]) · W13[e]ᵀ                [2I]  rounded to bf16; rows 0..I-1 of W13[e] are the gate projection
                                                    (w1 / gate_proj), rows I..2I-1 the up projection (w3 / up_proj)
        a = Q2(silu(h[:I]) * h[I:])           [I]   fp32 math
        o = a · W2[e]ᵀ                        [H]   rounded to bf16
    y[t] = Σ_j weights[t, j] · o(t, j) (+ residual[t])   fp32 sum in slot order, one bf16 rounding

Q1 / Q2 follow the weight format: 'fp8_blockwise' quantizes each row per 128 columns to e4m3 with scale
max(amax, 1e-10) / 448 (DeepSeek-V3's 1×128 activation blocks), 'fp8_per_tensor' divides by the static activation
scales a13_scale / a2_scale and saturates, 'bf16' rounds to bf16 (the divisions are products with an fp32
reciprocal, within an ulp of the quotient: tessera/moe_layer.h). Weights are used as stored: W = codes × scale (one
fp32 scale per 128×128 block for 'fp8_blockwise', the checkpoints' weight_scale_inv; one per expert and matrix for
'fp8_per_tensor').

* Once per model: ``cfg = MoeLayerConfig(hidden, intermediate, num_experts, topk=..., ...)`` and
  ``p = plan(cfg, max_tokens)`` (validates the constants: ValueError naming the field; sizes the workspace).
* Once per layer, offline: ``load_checkpoint(tensors, layer_prefix=..., style=..., ...)`` packs a checkpoint's
  per-expert tensors (DeepSeek-V3, Qwen3-MoE or Mixtral names; bf16, block-wise or per-tensor fp8) into a
  ``MoeLayerWeights``, or ``quantize_weights(w13, w2, format)`` quantizes float weights already stacked.
* Per call: ``y = moe_layer(x, router_logits, weights, p)``.

    import tessera, torch
    from tessera import moe_layer as ml
    cfg = ml.MoeLayerConfig(hidden=7168, intermediate=2048, num_experts=256, topk=8, num_groups=8, topk_groups=4,
                            renormalize=True, routed_scaling_factor=2.5, num_shared_experts=1)
    p = ml.plan(cfg, max_tokens=4096)
    weights, gate, bias = ml.load_checkpoint(tensors, layer_prefix="model.layers.3", style="deepseek_v3",
                                             num_experts=256, format="fp8_blockwise")
    weights, gate, bias = weights.cuda(), gate.cuda().float(), bias.cuda()
    y = ml.moe_layer(x, torch.nn.functional.linear(x.float(), gate), weights, p, correction_bias=bias)

Like the other families, ``moe_layer`` takes torch tensors (or ``__dlpack__`` producers), runs asynchronously on the
current CUDA stream of x's device (or on ``stream=``), never synchronizes, allocates y with torch unless ``out=`` is
given and its workspace (through torch's caching allocator, inside the operator) unless ``workspace=`` is given (pass
both, and ``num_tokens=``, to capture it in a CUDA graph and replay it for other token counts), can be traced by
torch.compile(fullgraph=True) (it is torch.ops.tessera.moe_layer underneath), and raises ValueError naming the op
and the argument for invalid arguments (messages from the C++ validation name the C++ API's fields), RuntimeError for
CUDA or device errors. The host steps (quantize_weights, dequantize_weights, load_checkpoint) are torch code that
runs on the device their inputs are on.
"""

import collections.abc
import dataclasses
import functools

from . import _C, _dlpack
from ._dlpack import (E4M3, FALLBACK, FP8_DTYPES, as_optional_tensor, as_tensor, cuda_device, cuda_device_of, fast_entry,
                      launch, stream_arg, torch_module, torch_ops)
from .moe import GROUP_SCORES, SCORINGS, _choice, _int, _rank

__all__ = [
    "FORMATS",
    "STYLES",
    "MoeLayerConfig",
    "MoeLayerPlan",
    "MoeLayerWeights",
    "dequantize_weights",
    "load_checkpoint",
    "moe_layer",
    "plan",
    "quantize_weights",
]

FORMATS = ("fp8_blockwise", "fp8_per_tensor", "bf16")  # tessera::moe::WeightFormat's names, in its order
STYLES = ("deepseek_v3", "qwen3_moe", "mixtral")  # the checkpoint naming load_checkpoint reads
BLOCK = 128  # the block-wise format's weight blocks are BLOCK × BLOCK, its activation blocks 1 × BLOCK
FP8_MAX = 448.0  # the largest finite e4m3 value: scale = amax / FP8_MAX


@dataclasses.dataclass(frozen=True)
class MoeLayerConfig:
    """The layer's constants (C++ tessera::moe::MoeLayerConfig): the shapes, the gate (tessera.fused_gate's
    parameters) and the weight format. Checked by ``plan`` (the C++ moe_layer_plan), not here.

    hidden                 H, a multiple of 128.
    intermediate           I, each expert's intermediate size, a multiple of 128.
    num_experts            E routed experts, 1..512.
    topk, num_groups, topk_groups, scoring ('sigmoid' | 'softmax'), group_score ('top2_sum' | 'max'), renormalize,
    routed_scaling_factor  the gate, as tessera.fused_gate takes them.
    num_shared_experts     s experts every token visits with weight shared_expert_weight: experts E .. E+s-1 of the
                           weights (DeepSeek-V3: 1).
    format                 'fp8_blockwise' | 'fp8_per_tensor' | 'bf16'.
    """

    hidden: int
    intermediate: int
    num_experts: int
    topk: int = 8
    num_groups: int = 1
    topk_groups: int = 1
    scoring: str = "sigmoid"
    group_score: str = "top2_sum"
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    shared_expert_weight: float = 1.0
    format: str = "fp8_blockwise"

    @property
    def num_weight_experts(self):
        """G = num_experts + num_shared_experts: the experts the weights hold."""
        return self.num_experts + self.num_shared_experts


@dataclasses.dataclass(frozen=True)
class MoeLayerPlan:
    """What ``plan`` returns (C++ tessera::moe::MoeLayerPlan): the config, the largest token count a call may take,
    and the bytes of device workspace a call needs (pass ``workspace=`` of at least this many bytes, or let the
    operator allocate it)."""

    config: MoeLayerConfig
    max_tokens: int
    workspace_bytes: int

    @functools.cached_property
    def _eager_plan(self):
        """moe_layer's eager plan (tessera._torch_C.MoeLayerEagerPlan: the config's fields and max_tokens, checked and
        planned in C++), built the first time the eager path runs and kept (both classes are frozen); None where
        config is not a MoeLayerConfig, C++ refuses a field (the checked path then names it) or the operators are
        not built."""
        c = self.config
        if type(c) is not MoeLayerConfig or _dlpack._eager is None:  # _eager: bound when tessera was imported
            return None
        try:
            return _dlpack._eager.MoeLayerEagerPlan(
                c.hidden, c.intermediate, c.num_experts, c.topk, c.num_groups, c.topk_groups, c.scoring,
                c.group_score, c.renormalize, c.routed_scaling_factor, c.num_shared_experts, c.shared_expert_weight,
                c.format, self.max_tokens)
        except (TypeError, ValueError, OverflowError):
            return None

    def __getstate__(self):
        # Copies and pickles carry the fields only: the eager plan is a C++ object (not picklable), rebuilt on use.
        state = dict(self.__dict__)
        state.pop("_eager_plan", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)


@dataclasses.dataclass(eq=False)
class MoeLayerWeights:
    """The weights of G = E + s experts in the layer's layout (C++ tessera::moe::MoeLayerWeights), torch tensors:

    w13        [G, 2I, H]: float8_e4m3fn codes ('fp8_*') or bf16; rows 0..I-1 of each expert the gate projection,
               rows I..2I-1 the up projection.
    w2         [G, H, I]: the down projection, as w13.
    w13_scale  fp32 [G, 2I/128, H/128] ('fp8_blockwise', one scale per 128×128 block) or [G] ('fp8_per_tensor'),
    w2_scale   fp32 [G, H/128, I/128] or [G]; None for 'bf16'. W = codes × scale.
    a13_scale  fp32 [1] ('fp8_per_tensor' only): the static scale of the activations the w13 GEMM reads,
    a2_scale   fp32 [1]: that of the w2 GEMM's (the checkpoints' input_scale). None otherwise.

    ``.to(device)`` / ``.cuda()`` / ``.cpu()`` return a copy on that device.
    """

    w13: object
    w2: object
    w13_scale: object = None
    w2_scale: object = None
    a13_scale: object = None
    a2_scale: object = None

    @property
    def num_weight_experts(self):
        return self.w13.shape[0]

    @property
    def hidden(self):
        return self.w13.shape[2]

    @property
    def intermediate(self):
        return self.w2.shape[2]

    @property
    def device(self):
        return self.w13.device

    def to(self, device=None, non_blocking=False):
        """These weights on `device` (torch.device, str or index); the same tensors where they are there."""
        move = (lambda t: None if t is None else t.to(device, non_blocking=non_blocking))
        return MoeLayerWeights(*(move(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def cuda(self, device=None, non_blocking=False):
        return self.to(cuda_device(device), non_blocking=non_blocking)

    def cpu(self):
        return self.to("cpu")

    def __repr__(self):
        kind = self.w13.dtype if self.w13_scale is None else f"{self.w13.dtype} scales {list(self.w13_scale.shape)}"
        return (f"MoeLayerWeights(experts={self.w13.shape[0]}, hidden={self.w13.shape[2]}, "
                f"intermediate={self.w2.shape[2]}, {kind}, device={self.w13.device})")


# ---- the plan ------------------------------------------------------------------------------------------------------


def _constants(op, config):
    """The config's fields in the operator's order, each of the type its schema takes (TypeError for a non-int
    count, ValueError for an unknown name)."""
    if not isinstance(config, MoeLayerConfig):
        raise ValueError(f"{op}: 'config' must be a tessera.moe_layer.MoeLayerConfig, got {type(config).__name__}")
    c = config
    return (_int(op, "hidden", c.hidden), _int(op, "intermediate", c.intermediate),
            _int(op, "num_experts", c.num_experts), _int(op, "topk", c.topk), _int(op, "num_groups", c.num_groups),
            _int(op, "topk_groups", c.topk_groups), _choice(op, "scoring", c.scoring, SCORINGS),
            _choice(op, "group_score", c.group_score, GROUP_SCORES), bool(c.renormalize),
            _float(op, "routed_scaling_factor", c.routed_scaling_factor),
            _int(op, "num_shared_experts", c.num_shared_experts),
            _float(op, "shared_expert_weight", c.shared_expert_weight), _choice(op, "format", c.format, FORMATS))


def _float(op, arg, value):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: '{arg}' must be a float, got {type(value).__name__}") from None


def plan(config, max_tokens):
    """The plan of a layer with these constants for calls of up to `max_tokens` tokens: the C++ moe_layer_plan
    checks every rule of the config (H and I multiples of 128, 1 <= E <= 512, the gate's rules: topk 1..32 and no more
    than the experts of the kept groups, num_groups dividing E, 1 <= topk_groups <= num_groups, ...) and raises
    ValueError naming the field, then sizes the workspace (a pure function of the constants: no device is needed)."""
    op = "tessera.moe_layer.plan"
    constants = _constants(op, config)
    max_tokens = _int(op, "max_tokens", max_tokens, 0)
    return MoeLayerPlan(config, max_tokens, int(_C.moe_layer_plan(*constants, max_tokens)))


# ---- weights: quantize, dequantize ---------------------------------------------------------------------------------


def _shapes(op, w13, w2):
    """(G, I, H) of w13 [G, 2I, H] and w2 [G, H, I], checked against each other."""
    _rank(op, "w13", w13, 3, "[G, 2I, H]")
    _rank(op, "w2", w2, 3, "[G, H, I]")
    g, two_i, h = w13.shape
    if two_i % 2 or g == 0 or two_i == 0 or h == 0:
        raise ValueError(f"{op}: 'w13' must be [G, 2I, H] with G, I, H > 0, got shape {list(w13.shape)}")
    if tuple(w2.shape) != (g, h, two_i // 2):
        raise ValueError(f"{op}: 'w2' must be [G, H, I] = {[g, h, two_i // 2]} (w13 is [G, 2I, H] = "
                         f"{list(w13.shape)}), got shape {list(w2.shape)}")
    return g, two_i // 2, h


def _float_weight(op, arg, w):
    w = as_tensor(w, op, arg)
    if not w.is_floating_point() or w.dtype in FP8_DTYPES:
        raise ValueError(f"{op}: '{arg}' must be a float tensor (float32, bfloat16, float16, ...), got {w.dtype}")
    return w


def _blockwise(w):
    """(e4m3 codes, fp32 scales [rows/128, cols/128]) of one float matrix [rows, cols] (multiples of 128): each
    128×128 block's scale is amax / 448 (1 for an all-zero block), its codes w / scale rounded to nearest e4m3."""
    torch = torch_module()
    rows, cols = w.shape
    blocks = w.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return codes.reshape(rows, cols), scale


def _per_tensor(w):
    """(e4m3 codes, fp32 scale []) of one float matrix: scale amax / 448 (1 for an all-zero matrix)."""
    torch = torch_module()
    wf = w.float()
    amax = wf.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3), scale


def _activation_scale(op, arg, value, device):
    """A static activation scale as the layer takes it: fp32 [1] on `device` (a number or a one-element tensor)."""
    torch = torch_module()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor([float(value)], dtype=torch.float32, device=device)
    t = as_tensor(value, op, arg)
    if t.numel() != 1 or not t.is_floating_point() or t.dtype in FP8_DTYPES:
        raise ValueError(f"{op}: '{arg}' must be a float tensor of one element (fp32 [1]), got {t.dtype} of shape "
                         f"{list(t.shape)}")
    return t.detach().reshape(1).to(device=device, dtype=torch.float32)


def _check_blocks(op, what, i, h):
    if h % BLOCK or i % BLOCK:
        raise ValueError(f"{op}: {what} needs H and I multiples of {BLOCK} (128×128 weight blocks), got H = {h}, "
                         f"I = {i}")


def quantize_weights(w13, w2, format, *, a13_scale=None, a2_scale=None):
    """The layer's weights in `format` from float weights w13 [G, 2I, H] and w2 [G, H, I] (float32 / bfloat16 /
    float16, any device; gate rows [0, I) and up rows [I, 2I) of each expert's w13). The result is on w13's device.

    'fp8_blockwise'   per 128×128 block (H and I multiples of 128): scale = amax / 448 (1 for an all-zero block),
                      codes = e4m3(w / scale) rounded to nearest; scales fp32 [G, 2I/128, H/128] and
                      [G, H/128, I/128].
    'fp8_per_tensor'  one scale per expert and matrix (amax / 448), scales fp32 [G]; the activations' static scales
                      a13_scale and a2_scale (fp32 [1] tensors or numbers, e.g. a calibration's amax / 448) are
                      required: ValueError without them.
    'bf16'            w13 and w2 cast to bfloat16.
    Experts are quantized one at a time (the float32 copy of one expert at most is held).
    """
    op = "tessera.moe_layer.quantize_weights"
    torch = torch_module()
    _choice(op, "format", format, FORMATS)
    w13 = _float_weight(op, "w13", w13)
    w2 = _float_weight(op, "w2", w2)
    g, i, h = _shapes(op, w13, w2)
    device = w13.device
    if format != "fp8_per_tensor" and (a13_scale is not None or a2_scale is not None):
        raise ValueError(f"{op}: 'a13_scale' and 'a2_scale' are only taken with format 'fp8_per_tensor' (static "
                         f"activation scales), got format {format!r}")
    if format == "bf16":
        return MoeLayerWeights(w13.to(device=device, dtype=torch.bfloat16).contiguous(),
                               w2.to(device=device, dtype=torch.bfloat16).contiguous())
    if format == "fp8_per_tensor":
        for arg, value in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
            if value is None:
                raise ValueError(f"{op}: '{arg}' is required with format 'fp8_per_tensor' (the static activation "
                                 f"scale, fp32 [1]): the layer does not compute activation scales at run time")
        a13 = _activation_scale(op, "a13_scale", a13_scale, device)
        a2 = _activation_scale(op, "a2_scale", a2_scale, device)
        q13 = torch.empty((g, 2 * i, h), dtype=E4M3, device=device)
        q2 = torch.empty((g, h, i), dtype=E4M3, device=device)
        s13 = torch.empty((g,), dtype=torch.float32, device=device)
        s2 = torch.empty((g,), dtype=torch.float32, device=device)
        for e in range(g):
            q13[e], s13[e] = _per_tensor(w13[e].to(device))
            q2[e], s2[e] = _per_tensor(w2[e].to(device))
        return MoeLayerWeights(q13, q2, s13, s2, a13, a2)
    _check_blocks(op, "format 'fp8_blockwise'", i, h)
    q13 = torch.empty((g, 2 * i, h), dtype=E4M3, device=device)
    q2 = torch.empty((g, h, i), dtype=E4M3, device=device)
    s13 = torch.empty((g, 2 * i // BLOCK, h // BLOCK), dtype=torch.float32, device=device)
    s2 = torch.empty((g, h // BLOCK, i // BLOCK), dtype=torch.float32, device=device)
    for e in range(g):
        q13[e], s13[e] = _blockwise(w13[e].to(device))
        q2[e], s2[e] = _blockwise(w2[e].to(device))
    return MoeLayerWeights(q13, q2, s13, s2)


def _expand(scale, rows, cols):
    """A block-scale grid [ceil(rows/128), ceil(cols/128)] as one value per element [rows, cols]."""
    return scale.repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]


def _checked_scales(op, weights, format):
    """weights' (w13, w2, w13_scale, w2_scale) as torch tensors, with the scales the format needs checked."""
    if not isinstance(weights, MoeLayerWeights):
        raise ValueError(f"{op}: 'weights' must be a tessera.moe_layer.MoeLayerWeights, got {type(weights).__name__}")
    w13, w2 = as_tensor(weights.w13, op, "w13"), as_tensor(weights.w2, op, "w2")
    g, i, h = _shapes(op, w13, w2)
    if format == "bf16":
        return w13, w2, None, None
    want = {"fp8_blockwise": ((g, -(-2 * i // BLOCK), -(-h // BLOCK)), (g, -(-h // BLOCK), -(-i // BLOCK))),
            "fp8_per_tensor": ((g,), (g,))}[format]
    scales = []
    for arg, shape in zip(("w13_scale", "w2_scale"), want):
        s = getattr(weights, arg)
        if s is None:
            raise ValueError(f"{op}: 'weights.{arg}' is required with format {format!r}")
        s = as_tensor(s, op, arg)
        if tuple(s.shape) != shape:
            raise ValueError(f"{op}: 'weights.{arg}' must be {list(shape)} with format {format!r}, got shape "
                             f"{list(s.shape)}")
        scales.append(s)
    for arg, t in (("w13", w13), ("w2", w2)):
        if t.dtype not in (E4M3, torch_module().uint8):
            raise ValueError(f"{op}: 'weights.{arg}' must be torch.float8_e4m3fn with format {format!r}, got {t.dtype}")
    return (w13, w2, *scales)


def dequantize_weights(weights, format, dtype=None):
    """(w13 [G, 2I, H], w2 [G, H, I]): the weights `weights` stands for in `format`, W = codes × scale computed in
    float64 (exact) and returned as `dtype` (default float32: one rounding), on the weights' device. 'bf16' weights
    are converted as they are. A torch function for tests and checks (it holds two float64 experts at a time)."""
    op = "tessera.moe_layer.dequantize_weights"
    torch = torch_module()
    _choice(op, "format", format, FORMATS)
    dtype = torch.float32 if dtype is None else dtype
    w13, w2, s13, s2 = _checked_scales(op, weights, format)
    if format == "bf16":
        return w13.to(dtype), w2.to(dtype)
    outs = []
    for w, s in ((w13, s13), (w2, s2)):
        out = torch.empty(tuple(w.shape), dtype=dtype, device=w.device)
        codes = w.view(E4M3) if w.dtype == torch.uint8 else w
        for e in range(w.shape[0]):
            c = codes[e].to(torch.float64)
            se = s[e].to(device=w.device, dtype=torch.float64)
            out[e] = c * (se if format == "fp8_per_tensor" else _expand(se, *c.shape))
        outs.append(out)
    return tuple(outs)


# ---- checkpoints ---------------------------------------------------------------------------------------------------

_FLOAT, _FP8_BLOCK, _FP8_TENSOR = "float", "fp8 block-wise", "fp8 per-tensor"


class _Matrix:
    """One projection of a checkpoint as stored: a float weight, e4m3 codes with block-wise scales (weight_scale_inv
    [ceil(out/128), ceil(in/128)]), or e4m3 codes with one scale (weight_scale), with its input_scale if any."""

    def __init__(self, kind, w, scale=None, input_scale=None, name=""):
        self.kind, self.w, self.scale, self.input_scale, self.name = kind, w, scale, input_scale, name

    @property
    def shape(self):
        return tuple(self.w.shape)

    def part(self, dim, index, parts):
        """The index-th of `parts` equal slices along dim (0: output rows, 1: input columns)."""
        n = self.w.shape[dim] // parts
        w = self.w.narrow(dim, index * n, n)
        scale = self.scale
        if self.kind == _FP8_BLOCK:
            scale = scale.narrow(dim, index * n // BLOCK, n // BLOCK)
        return _Matrix(self.kind, w, scale, self.input_scale, f"{self.name}[part {index} of {parts}]")

    def dequantized(self, dtype):
        """The float weight this matrix stands for (codes × scale in float64, then `dtype`)."""
        torch = torch_module()
        if self.kind == _FLOAT:
            return self.w.to(dtype)
        w = self.w.to(torch.float64)
        s = self.scale.to(device=w.device, dtype=torch.float64)
        return (w * (_expand(s, *w.shape) if self.kind == _FP8_BLOCK else s)).to(dtype)


def _tensor(op, tensors, name):
    try:
        t = tensors[name]
    except KeyError:
        raise ValueError(f"{op}: the checkpoint has no tensor '{name}'") from None
    return as_tensor(t, op, name)


def _scalar(op, tensors, name):
    t = _tensor(op, tensors, name)
    if t.numel() != 1 or not t.is_floating_point():
        raise ValueError(f"{op}: '{name}' must be a float scalar (one element), got {t.dtype} of shape "
                         f"{list(t.shape)}")
    return t.reshape(())


def _read(op, tensors, base):
    """The _Matrix stored as `base`.weight (+ .weight_scale_inv | .weight_scale, .input_scale)."""
    torch = torch_module()
    w = _tensor(op, tensors, base + ".weight")
    if w.dim() != 2:
        raise ValueError(f"{op}: '{base}.weight' must have rank 2 [out, in], got shape {list(w.shape)}")
    if w.dtype in FP8_DTYPES or w.dtype == torch.uint8:
        if w.dtype != E4M3:
            raise ValueError(f"{op}: '{base}.weight' must be torch.float8_e4m3fn when quantized, got {w.dtype}")
        input_scale = _scalar(op, tensors, base + ".input_scale") if base + ".input_scale" in tensors else None
        if base + ".weight_scale_inv" in tensors:
            scale = _tensor(op, tensors, base + ".weight_scale_inv")
            want = [-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)]
            if list(scale.shape) != want or not scale.is_floating_point():
                raise ValueError(f"{op}: '{base}.weight_scale_inv' must be float {want} (one scale per 128×128 block "
                                 f"of the weight {list(w.shape)}), got {scale.dtype} of shape {list(scale.shape)}")
            return _Matrix(_FP8_BLOCK, w, scale.float(), input_scale, base)
        if base + ".weight_scale" in tensors:
            return _Matrix(_FP8_TENSOR, w, _scalar(op, tensors, base + ".weight_scale").float(), input_scale, base)
        raise ValueError(f"{op}: '{base}.weight' is fp8 but the checkpoint has neither '{base}.weight_scale_inv' "
                         f"(block-wise) nor '{base}.weight_scale' (per-tensor)")
    if not w.is_floating_point():
        raise ValueError(f"{op}: '{base}.weight' must be a float or float8_e4m3fn tensor, got {w.dtype}")
    return _Matrix(_FLOAT, w, name=base)


def _names(style, prefix):
    """(expert base name pattern with {e}, shared experts' base name or None, gate weight, correction bias or None);
    each base name pattern gives the (gate, up, down) projections."""
    if style == "mixtral":
        moe = f"{prefix}block_sparse_moe"
        return (f"{moe}.experts.{{e}}.", ("w1", "w3", "w2"), None, f"{moe}.gate.weight", None)
    mlp = f"{prefix}mlp"
    shared = f"{mlp}.shared_experts." if style == "deepseek_v3" else None
    bias = f"{mlp}.gate.e_score_correction_bias" if style == "deepseek_v3" else None
    return (f"{mlp}.experts.{{e}}.", ("gate_proj", "up_proj", "down_proj"), shared, f"{mlp}.gate.weight", bias)


class _Packer:
    """Fills the layer's weight tensors expert by expert from checkpoint matrices, converting each to `format`."""

    def __init__(self, op, format, g, i, h, device, a13_scale, a2_scale):
        torch = torch_module()
        self.op, self.format, self.i, self.h, self.device = op, format, i, h, device
        dtype = torch.bfloat16 if format == "bf16" else E4M3
        self.w13 = torch.empty((g, 2 * i, h), dtype=dtype, device=device)
        self.w2 = torch.empty((g, h, i), dtype=dtype, device=device)
        self.s13 = self.s2 = None
        if format == "fp8_blockwise":
            self.s13 = torch.empty((g, 2 * i // BLOCK, h // BLOCK), dtype=torch.float32, device=device)
            self.s2 = torch.empty((g, h // BLOCK, i // BLOCK), dtype=torch.float32, device=device)
        elif format == "fp8_per_tensor":
            self.s13 = torch.empty((g,), dtype=torch.float32, device=device)
            self.s2 = torch.empty((g,), dtype=torch.float32, device=device)
        self.given = {"a13_scale": a13_scale, "a2_scale": a2_scale}
        # The checkpoint's input_scale values of the projections each GEMM reads (None where one has none).
        self.inputs = {"a13_scale": [], "a2_scale": []}

    def add(self, e, gate, up, down):
        torch = torch_module()
        i, h = self.i, self.h
        for m, shape in ((gate, (i, h)), (up, (i, h)), (down, (h, i))):
            if m.shape != shape:
                raise ValueError(f"{self.op}: '{m.name}.weight' must be {list(shape)} (expert 0's [I, H] = "
                                 f"{[i, h]}), got shape {list(m.shape)}")
        for m, arg in ((gate, "a13_scale"), (up, "a13_scale"), (down, "a2_scale")):
            s = m.input_scale
            self.inputs[arg].append(None if s is None else s.to(device=self.device, dtype=torch.float32))
        if self.format == "bf16":
            self.w13[e, :i] = gate.dequantized(torch.float64) if gate.kind != _FLOAT else gate.w
            self.w13[e, i:] = up.dequantized(torch.float64) if up.kind != _FLOAT else up.w
            self.w2[e] = down.dequantized(torch.float64) if down.kind != _FLOAT else down.w
        elif self.format == "fp8_blockwise":
            if gate.kind == up.kind == _FP8_BLOCK:  # kept as stored: no requantization
                self.w13[e, :i], self.w13[e, i:] = gate.w, up.w
                self.s13[e, :i // BLOCK], self.s13[e, i // BLOCK:] = gate.scale, up.scale
            else:
                self.w13[e], self.s13[e] = _blockwise(torch.cat([gate.dequantized(torch.float32),
                                                                 up.dequantized(torch.float32)]).to(self.device))
            if down.kind == _FP8_BLOCK:
                self.w2[e], self.s2[e] = down.w, down.scale
            else:
                self.w2[e], self.s2[e] = _blockwise(down.dequantized(torch.float32).to(self.device))
        else:
            if gate.kind == up.kind == _FP8_TENSOR:
                # One scale per expert for w13: the larger of w1's and w3's; the other matrix is requantized to it
                # (codes × its scale / the larger, rounded to nearest e4m3; the matrix that has it is kept as is).
                s = torch.maximum(gate.scale, up.scale).to(self.device)
                for m, rows in ((gate, slice(0, i)), (up, slice(i, 2 * i))):
                    ratio = m.scale.to(self.device) / s  # 1 (exact) for the matrix whose scale is the larger
                    self.w13[e, rows] = (m.w.to(self.device).float() * ratio).to(E4M3)
                self.s13[e] = s
            else:
                self.w13[e], self.s13[e] = _per_tensor(torch.cat([gate.dequantized(torch.float32),
                                                                  up.dequantized(torch.float32)]).to(self.device))
            if down.kind == _FP8_TENSOR:
                self.w2[e], self.s2[e] = down.w, down.scale
            else:
                self.w2[e], self.s2[e] = _per_tensor(down.dequantized(torch.float32).to(self.device))

    def weights(self):
        if self.format != "fp8_per_tensor":
            return MoeLayerWeights(self.w13, self.w2, self.s13, self.s2)
        scales = []
        for arg in ("a13_scale", "a2_scale"):
            found = self.inputs[arg]
            if self.given[arg] is not None:
                scales.append(_activation_scale(self.op, arg, self.given[arg], self.device))
            elif found and all(s is not None for s in found):
                scales.append(torch_module().stack(found).amax().reshape(1))
            else:
                raise ValueError(f"{self.op}: '{arg}' is required with format 'fp8_per_tensor': the checkpoint does "
                                 f"not hold an input_scale for every expert projection the GEMM reads (the static "
                                 f"activation scale)")
        return MoeLayerWeights(self.w13, self.w2, self.s13, self.s2, *scales)


def load_checkpoint(tensors, *, layer_prefix, style, num_experts, format, num_shared_experts=None, dtype=None,
                    a13_scale=None, a2_scale=None):
    """One layer's MoE weights packed from a checkpoint's per-expert tensors: (MoeLayerWeights in `format`, the
    router's gate weight [E, H], the gate's correction bias [E] or None).

    tensors        a Mapping name → tensor (what safetensors.torch.load_file returns, or a merged dict of shards).
    layer_prefix   the layer's name prefix, e.g. 'model.layers.3' (a trailing '.' is optional).
    style          the checkpoint's naming:
                   'deepseek_v3'  {p}.mlp.experts.{e}.{gate,up,down}_proj.weight, shared experts
                                  {p}.mlp.shared_experts.{gate,up,down}_proj.weight, gate {p}.mlp.gate.weight and
                                  {p}.mlp.gate.e_score_correction_bias (None when absent);
                   'qwen3_moe'    the same expert and gate names, no shared experts, no correction bias;
                   'mixtral'      {p}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight (gate, up, down), gate
                                  {p}.block_sparse_moe.gate.weight.
    num_experts    E, the routed experts read (0..E-1).
    format         the layer's weight format: 'fp8_blockwise', 'fp8_per_tensor' or 'bf16'.
    num_shared_experts  s ('deepseek_v3' only). The checkpoint holds the shared experts as one MLP of intermediate
                   size I_s; the layer takes them as s experts of size I (routed with weight shared_expert_weight,
                   normally 1): the rows of gate_proj / up_proj and the columns of down_proj are split into s
                   slices, which is the same function since SiLU·mul acts per intermediate channel. None: I_s / I when
                   the checkpoint has shared experts (ValueError unless I divides I_s; DeepSeek-V3: I_s = I, s = 1),
                   else 0. 0 leaves them out (the caller runs them elsewhere).
    dtype          the dtype of the returned gate weight and bias (None: as stored).
    a13_scale, a2_scale  the static activation scales for 'fp8_per_tensor' (fp32 [1] tensors or numbers); when
                   None they are read from the checkpoint: the largest input_scale of the gate / up projections
                   (a13_scale) and of the down projections (a2_scale) over all experts, and a checkpoint without them
                   (bf16, block-wise fp8) needs them passed: ValueError otherwise.

    Each projection is stored as a float weight, fp8 e4m3 with block-wise scales ('.weight_scale_inv', fp32
    [ceil(out/128), ceil(in/128)]: DeepSeek-V3, Qwen3 FP8) or fp8 e4m3 with one scale ('.weight_scale', and
    '.input_scale': Mixtral FP8 releases), and converted to `format`:
    * block-wise fp8 → 'fp8_blockwise': the codes and scales are kept as they are (no requantization);
    * per-tensor fp8 → 'fp8_per_tensor': w2 is kept; w13 has one scale per expert, so w1 and w3 are requantized to
      the larger of their two weight_scale values (the one that has it keeps its codes; the other's codes are
      rescaled and rounded to nearest e4m3 once);
    * fp8 → 'bf16': dequantized (codes × scales in float64, then torch's cast to bf16, which goes through float32:
      within a bf16 ulp of the single rounding of the exact product);
    * anything else: dequantized to float and quantized with quantize_weights' rule.
    The packed weights are on the device of the checkpoint's tensors (move them with .cuda()); w13 holds gate rows
    [0, I) and up rows [I, 2I); the shared experts are experts E .. E+s-1.
    """
    op = "tessera.moe_layer.load_checkpoint"
    torch_module()  # ImportError with the reason when torch is missing
    if not isinstance(tensors, collections.abc.Mapping):
        raise ValueError(f"{op}: 'tensors' must be a Mapping of names to tensors (e.g. safetensors.torch.load_file's "
                         f"dict), got {type(tensors).__name__}")
    if not isinstance(layer_prefix, str):
        raise ValueError(f"{op}: 'layer_prefix' must be a str such as 'model.layers.3', got "
                         f"{type(layer_prefix).__name__}")
    _choice(op, "style", style, STYLES)
    _choice(op, "format", format, FORMATS)
    num_experts = _int(op, "num_experts", num_experts, 1)
    if num_shared_experts is not None:
        num_shared_experts = _int(op, "num_shared_experts", num_shared_experts, 0)
    if format != "fp8_per_tensor" and (a13_scale is not None or a2_scale is not None):
        raise ValueError(f"{op}: 'a13_scale' and 'a2_scale' are only taken with format 'fp8_per_tensor', got format "
                         f"{format!r}")
    prefix = layer_prefix if layer_prefix == "" or layer_prefix.endswith(".") else layer_prefix + "."
    expert, projections, shared, gate_name, bias_name = _names(style, prefix)

    def matrices(base):
        return [_read(op, tensors, base + p) for p in projections]

    first = matrices(expert.format(e=0))
    i, h = first[0].shape
    device = first[0].w.device

    # Shared experts: one MLP of intermediate size I_s, taken as I_s / I experts of size I.
    shared_mats = None
    if shared is None:
        if num_shared_experts:
            raise ValueError(f"{op}: 'num_shared_experts' must be 0 or None for style {style!r} (it has no shared "
                             f"experts), got {num_shared_experts}")
        num_shared_experts = 0
    elif num_shared_experts != 0 and shared + projections[0] + ".weight" in tensors:
        shared_mats = matrices(shared)
        i_s = shared_mats[0].shape[0]
        if i_s % i:
            raise ValueError(f"{op}: the shared experts' intermediate size ({i_s}, '{shared}{projections[0]}.weight' "
                             f"rows) must be a multiple of the routed experts' I = {i}")
        if num_shared_experts is None:
            num_shared_experts = i_s // i
        elif num_shared_experts * i != i_s:
            raise ValueError(f"{op}: 'num_shared_experts' must be I_s / I = {i_s} / {i} = {i_s // i} (the checkpoint's "
                             f"shared experts as experts of size I), got {num_shared_experts}")
        if num_shared_experts > 1 and any(m.kind == _FP8_BLOCK for m in shared_mats) and i % BLOCK:
            raise ValueError(f"{op}: splitting block-wise fp8 shared experts into {num_shared_experts} experts needs "
                             f"I a multiple of {BLOCK}, got I = {i}")
    elif num_shared_experts:
        raise ValueError(f"{op}: 'num_shared_experts' is {num_shared_experts} but the checkpoint has no tensor "
                         f"'{shared}{projections[0]}.weight'")
    else:
        num_shared_experts = 0

    if format == "fp8_blockwise":
        _check_blocks(op, "format 'fp8_blockwise'", i, h)
    g = num_experts + num_shared_experts
    packer = _Packer(op, format, g, i, h, device, a13_scale, a2_scale)
    for e in range(num_experts):
        packer.add(e, *(first if e == 0 else matrices(expert.format(e=e))))
    for k in range(num_shared_experts):
        sg, su, sd = shared_mats
        packer.add(num_experts + k, sg.part(0, k, num_shared_experts), su.part(0, k, num_shared_experts),
                   sd.part(1, k, num_shared_experts))

    gate = _tensor(op, tensors, gate_name)
    if tuple(gate.shape) != (num_experts, h):
        raise ValueError(f"{op}: '{gate_name}' must be [E, H] = {[num_experts, h]}, got shape {list(gate.shape)}")
    bias = None
    if bias_name is not None and bias_name in tensors:
        bias = _tensor(op, tensors, bias_name)
        if tuple(bias.shape) != (num_experts,):
            raise ValueError(f"{op}: '{bias_name}' must be [E] = [{num_experts}], got shape {list(bias.shape)}")
    if dtype is not None:
        gate = gate.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return packer.weights(), gate, bias


# ---- the device op -------------------------------------------------------------------------------------------------


def _checked_plan(op, plan):
    if not isinstance(plan, MoeLayerPlan):
        raise ValueError(f"{op}: 'plan' must be a tessera.moe_layer.MoeLayerPlan (tessera.moe_layer.plan(config, "
                         f"max_tokens)), got {type(plan).__name__}")
    if not isinstance(plan.config, MoeLayerConfig):
        raise ValueError(f"{op}: 'plan.config' must be a tessera.moe_layer.MoeLayerConfig, got "
                         f"{type(plan.config).__name__}")


def moe_layer(x, router_logits, weights, plan, *, correction_bias=None, residual=None, num_tokens=None, out=None,
              workspace=None, stream=None):
    """y [T, H] bf16: the MoE layer of the module docstring over tokens x with the router's logits, on x's device.

    x                [T, H] bf16, unit inner stride, T <= plan.max_tokens (T = 0 gives an empty y).
    router_logits    [T, E] fp32 | bf16 | fp16 (tessera.fused_gate's rules: unit stride along E).
    weights          a MoeLayerWeights in plan.config.format, on x's device (G = E + s experts).
    plan             what tessera.moe_layer.plan(config, max_tokens) returned.
    correction_bias  [E] fp32 | bf16 | fp16 or None: the gate's selection bias (DeepSeek-V3's
                     e_score_correction_bias).
    residual         [T, H] bf16 or None: added to y.
    num_tokens       None (all T tokens), or an int32 [1] tensor on the device: the tokens routed this call, clamped
                     to [0, T], read on the device only, so that a CUDA graph captured with T = max rows replays
                     for any count; rows at or past it are written as zero (or as residual).
    out              y to write into ([T, H] bf16); default: torch.empty.
    workspace        a contiguous device tensor of at least plan.workspace_bytes bytes, or None (the operator
                     allocates it through torch's caching allocator on the stream it runs on). Pass out= and
                     workspace= to capture with no allocation at all.
    stream           None (the current stream), a torch.cuda.Stream or a raw cudaStream_t int.
    Returns y.
    """
    entry = fast_entry(stream)  # first: under torch.compile it is None, and Dynamo never sees the cached property
    if entry is not None and type(plan) is MoeLayerPlan and type(weights) is MoeLayerWeights:
        eager_plan = plan._eager_plan
        if eager_plan is not None:
            # The eager fast path (_dlpack.fast_entry): one crossing into C++, which checks x and out, allocates y
            # and launches on the plan built once (its constants checked then).
            w = weights
            try:
                return entry.moe_layer_eager(eager_plan, x, router_logits, correction_bias, residual, num_tokens,
                                             w.w13, w.w2, w.w13_scale, w.w2_scale, w.a13_scale, w.a2_scale, out,
                                             workspace)
            except TypeError as e:
                if FALLBACK not in str(e):
                    raise
    return _moe_layer_checked(x, router_logits, weights, plan, correction_bias, residual, num_tokens, out, workspace,
                              stream)


def _moe_layer_checked(x, router_logits, weights, plan, correction_bias, residual, num_tokens, out, workspace, stream):
    """moe_layer's checked path: the arguments checked here, then torch_ops()' moe_layer (the registered operator
    under torch.compile or a dispatch mode)."""
    op = "tessera.moe_layer"
    _checked_plan(op, plan)
    if not isinstance(weights, MoeLayerWeights):
        raise ValueError(f"{op}: 'weights' must be a tessera.moe_layer.MoeLayerWeights, got {type(weights).__name__}")
    w = weights
    torch = torch_module()
    ops = torch_ops()
    constants = _constants(op, plan.config) + (_int(op, "plan.max_tokens", plan.max_tokens, 0),)
    x = as_tensor(x, op, "x")
    router_logits = as_tensor(router_logits, op, "router_logits")
    correction_bias = as_optional_tensor(correction_bias, op, "correction_bias")
    residual = as_optional_tensor(residual, op, "residual")
    num_tokens = as_optional_tensor(num_tokens, op, "num_tokens")
    workspace = as_optional_tensor(workspace, op, "workspace")
    given = ((w.w13, "w13"), (w.w2, "w2"), (w.w13_scale, "w13_scale"), (w.w2_scale, "w2_scale"),
             (w.a13_scale, "a13_scale"), (w.a2_scale, "a2_scale"))
    tensors = [as_optional_tensor(t, op, name) for t, name in given]
    if not (x.is_cuda or x.is_meta):
        cuda_device_of(x, op, "x")
    _rank(op, "x", x, 2, "[T, H]")
    shape = [x.shape[0], x.shape[1]]
    if out is not None:
        out = as_tensor(out, op, "out")
        if list(out.shape) != shape:
            raise ValueError(f"{op}: 'out' must be [T, H] = {shape} (x's shape), got shape {list(out.shape)}")

    def run():
        y = out if out is not None else torch.empty(shape, dtype=torch.bfloat16, device=x.device)
        ops.moe_layer(x, router_logits, correction_bias, residual, num_tokens, *tensors, y, workspace, *constants)
        return y

    return run() if stream is None else launch(stream_arg(op, stream, x.device), run)
