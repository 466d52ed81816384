"""tessera.conv — conv2d with int4 / int8 weights: bf16 / fp16 / fp32 activations, NCHW or channels_last.

    y[n, co, oh, ow] = clamp(sum_{kh, kw, ci} x[n, g*Ci_g + ci, oh*stride_h - pad_h + kh*dil_h,
                                                ow*stride_w - pad_w + kw*dil_w] * W[co, ci, kh, kw] + bias[co], lo, hi)

with g = co // Co_g (groups), zero padding, as torch.nn.functional.conv2d computes it (C++: include/tessera/conv.h).
The weight is a weight-only linear weight (tessera.linear): W permuted to [Co, Kh, Kw, Ci_g] and flattened to
[Co, K], K = Kh*Kw*Ci_g, held as 4- or 8-bit codes with one (scale, offset) or (scale, zero) pair per output channel
and block of ``block`` columns of that reduction index (32, 64, 128, or K: one block per output channel), prepacked
in the linear layer's layout. A ``ConvWeight`` is that ``PackedLinearWeight`` plus the kernel's Kh, Kw; the group
count is a call parameter.

* Offline, on the host (CPU only): ``quantize_weight(conv.weight, bits=4, block=64)`` quantizes and prepacks a
  PyTorch conv weight [Co, Ci_g, Kh, Kw] (or a NumPy array) into a ConvWeight, which ``.cuda()`` moves to the GPU.
  ``dequantize`` goes back to [Co, Ci_g, Kh, Kw] (tests, checks).
* On the device: ``conv2d(x, weight, bias, stride, padding, dilation, groups, activation=..., clamp=...)`` takes x
  [N, C, H, W] as torch.nn.functional.conv2d does. A channels_last x is read in place as NHWC and gives a
  channels_last y; a contiguous x is read as NCHW and gives a contiguous y (``out=`` picks y's format itself). The
  library picks one of three paths (``conv2d_path`` names it): 'linear' (1x1, stride 1, no padding, one group),
  'implicit_gemm' (the linear layer's tensor-core kernel fed by TMA im2col copies: Ci_g a multiple of 64, ...),
  'direct' (everything else: depthwise, small groups, the first RGB layer).

    import tessera
    w = tessera.conv.quantize_weight(layer.weight, bits=4, block=64).cuda()
    x = x.to(memory_format=torch.channels_last)
    y = tessera.conv.conv2d(x, w, layer.bias, stride=1, padding=1, activation="relu")   # channels_last y

Like the other families, ``conv2d`` accepts torch tensors (or ``__dlpack__`` producers), runs asynchronously on the
current CUDA stream of x's device (or on ``stream=``), never synchronizes, allocates y with torch unless ``out=`` is
given and its workspace (through torch's caching allocator, inside the operator) unless ``workspace=`` is given, can
be captured in a CUDA graph and traced by torch.compile(fullgraph=True) (it is torch.ops.tessera.conv2d underneath),
and raises ValueError naming the op and the argument for invalid arguments (messages from the C++ validation name
the C++ API's fields), RuntimeError for CUDA or device errors.
"""

import dataclasses

from . import _C
from . import linear as _linear
from ._dlpack import (FALLBACK, as_optional_tensor, as_tensor, cuda_device, cuda_device_of, fast_entry, launch,
                      stream_arg, to_capsule, torch_module, torch_ops)
from .attention import _on_device
from .linear import ACTIVATIONS, ZERO_MODES, PackedLinearWeight
from .moe import _choice, _int, _rank

__all__ = [
    "ACTIVATIONS",
    "PATHS",
    "ZERO_MODES",
    "ConvWeight",
    "conv2d",
    "conv2d_path",
    "dequantize",
    "output_size",
    "quantize_weight",
    "workspace_bytes",
]

PATHS = ("linear", "implicit_gemm", "direct")  # tessera::conv::ConvPath's names, in its order
BLOCKS = _linear.BLOCKS  # or K: one block per output channel
_INF = float("inf")
_NHWC, _NCHW = "NHWC", "NCHW"


@dataclasses.dataclass(eq=False)
class ConvWeight:
    """A conv weight in the kernels' layout (C++ tessera::conv::ConvWeight), made by ``quantize_weight``.

    packed  the PackedLinearWeight of W permuted to [Co, Kh, Kw, Ci_g] and flattened to [Co, K], K = Kh*Kw*Ci_g:
            n = Co, k = K, reduction index r = (kh*Kw + kw)*Ci_g + ci; no act-order permutation (k_perm None).
    kh, kw  the kernel's height and width.

    The group count is not part of the weight: conv2d's ``groups`` gives Ci = groups*Ci_g input channels, and
    Co_g = Co / groups outputs per group. ``.to(device)`` / ``.cuda()`` / ``.cpu()`` return a copy on that device.
    """

    packed: object
    kh: int
    kw: int

    @property
    def out_channels(self):
        return self.packed.n

    @property
    def in_channels_per_group(self):
        return self.packed.k // (self.kh * self.kw)

    @property
    def kernel_size(self):
        return (self.kh, self.kw)

    @property
    def compute_dtype(self):
        return self.packed.params.dtype

    @property
    def device(self):
        return self.packed.codes.device

    def to(self, device=None, non_blocking=False):
        """This weight on `device` (torch.device, str or index); the same object's tensors where they are there."""
        return dataclasses.replace(self, packed=self.packed.to(device, non_blocking=non_blocking))

    def cuda(self, device=None, non_blocking=False):
        return self.to(cuda_device(device), non_blocking=non_blocking)

    def cpu(self):
        return self.to("cpu")

    def __repr__(self):
        p = self.packed
        return (f"ConvWeight(out_channels={p.n}, in_channels_per_group={self.in_channels_per_group}, "
                f"kernel_size=({self.kh}, {self.kw}), bits={p.bits}, block={p.block}, zero_mode={p.zero_mode!r}, "
                f"compute_dtype={p.params.dtype}, device={p.codes.device})")


# ---- host steps ----------------------------------------------------------------------------------------------------


def quantize_weight(w, bits=4, block=64, zero_mode="offset", compute_dtype=None):
    """Round-to-nearest quantization of a float conv weight w [Co, Ci_g, Kh, Kw] (an nn.Conv2d weight, any float
    dtype, on any device, or a NumPy array) into a ConvWeight on the host (move it with .cuda()).

    W is permuted to [Co, Kh, Kw, Ci_g], flattened to [Co, K] with K = Kh*Kw*Ci_g, quantized with
    tessera.linear.quantize's rule per output channel and block of `block` consecutive columns of that reduction
    index, and prepacked (tessera.linear.prepack).
    bits           4 or 8.
    block          32, 64 or 128 dividing K, or None (K: one block per output channel). The default 64 divides K
                   whenever Ci_g is a multiple of 64 (the implicit-GEMM path's condition); a depthwise or an RGB
                   layer (K = 9, 27, ...) takes None.
    zero_mode      'offset' (W = q*scale + offset) or 'zero_point' (W = (q - zero)*scale).
    compute_dtype  torch.bfloat16 (default) or torch.float16: the 16-bit type the kernels compute in, which must be
                   x's dtype (or the type fp32 x is rounded to).
    """
    op = "tessera.conv.quantize_weight"
    torch = torch_module()
    _choice(op, "zero_mode", zero_mode, ZERO_MODES)
    bits = _linear._bits(op, bits)
    _linear._compute_dtype_name(op, torch.bfloat16 if compute_dtype is None else compute_dtype)
    w = _linear._float_array(op, "w", w, torch.float32)
    if w.dim() != 4 or w.numel() == 0:
        raise ValueError(f"{op}: 'w' must have rank 4 [Co, Ci_g, Kh, Kw] with every dim > 0, got shape "
                         f"{list(w.shape)}")
    co, ci_g, kh, kw = w.shape
    k = kh * kw * ci_g
    block = k if block is None else _int(op, "block", block)
    if block != k and block not in BLOCKS:
        raise ValueError(f"{op}: 'block' must be 32, 64, 128 or None (one block per output channel), got {block}")
    if k % block != 0:
        fits = [b for b in BLOCKS if k % b == 0]
        hint = f" (of 32, 64, 128: {', '.join(map(str, fits))})" if fits else " (none of 32, 64, 128 does: use None)"
        raise ValueError(f"{op}: 'block' must divide K = Kh·Kw·Ci_g = {kh}·{kw}·{ci_g} = {k}{hint}, got {block}")
    flat = w.permute(0, 2, 3, 1).reshape(co, k).contiguous()
    q = _linear._quantized(_C.linear_quantize(to_capsule(flat), bits, block, zero_mode))
    packed = _linear.prepack(q, compute_dtype=compute_dtype)
    return ConvWeight(packed=packed, kh=int(kh), kw=int(kw))


def dequantize(weight, dtype=None):
    """The float weight W [Co, Ci_g, Kh, Kw] (PyTorch's conv layout) a ConvWeight stands for, so that
    conv2d(x, weight) ~= torch.nn.functional.conv2d(x, W); computed in float64 from the stored values (the
    parameters as rounded to the compute dtype: tessera.linear.dequantize) and returned as `dtype` (default
    float32), on the host. A torch function for tests and checks."""
    op = "tessera.conv.dequantize"
    torch = torch_module()
    p, kh, kw, ci_g = _checked_weight(op, weight)
    flat = _linear.dequantize(p, torch.float64)
    w = flat.view(p.n, kh, kw, ci_g).permute(0, 3, 1, 2).contiguous()
    return w.to(torch.float32 if dtype is None else dtype)


def output_size(in_size, k, stride=1, padding=0, dilation=1):
    """floor((in_size + 2*padding - dilation*(k - 1) - 1) / stride) + 1: one spatial dim of conv2d's output
    (PyTorch's rule; a floor for a negative numerator too, so a result below 1 means no output). k, stride and
    dilation >= 1, padding >= 0."""
    op = "tessera.conv.output_size"
    return int(_C.conv2d_output_size(_int(op, "in_size", in_size), _int(op, "k", k, 1), _int(op, "stride", stride, 1),
                                     _int(op, "padding", padding, 0), _int(op, "dilation", dilation, 1)))


# ---- argument checks shared by the device functions -----------------------------------------------------------------


def _checked_weight(op, weight):
    """(packed, kh, kw, Ci_g) of a ConvWeight, checked for what the C++ op cannot see (its K, kh and kw)."""
    if not isinstance(weight, ConvWeight):
        raise ValueError(f"{op}: 'weight' must be a tessera.conv.ConvWeight (tessera.conv.quantize_weight(...)"
                         f".cuda()), got {type(weight).__name__}")
    p = weight.packed
    if not isinstance(p, PackedLinearWeight):
        raise ValueError(f"{op}: 'weight.packed' must be a tessera.linear.PackedLinearWeight, got {type(p).__name__}")
    _choice(op, "zero_mode", p.zero_mode, ZERO_MODES)
    kh = _bounded(op, "weight.kh", _int(op, "weight.kh", weight.kh), 1)
    kw = _bounded(op, "weight.kw", _int(op, "weight.kw", weight.kw), 1)
    _int(op, "weight.packed.n", p.n, 1)
    k = _int(op, "weight.packed.k", p.k, 1)
    if k % (kh * kw) != 0:
        raise ValueError(f"{op}: 'weight' must have K = Kh·Kw·Ci_g, a multiple of Kh·Kw = {kh}·{kw}, got K = {k}")
    if p.k_perm is not None:
        raise ValueError(f"{op}: 'weight' must not have an act-order permutation (packed.k_perm): a conv weight's "
                         f"columns follow the reduction index (kh*Kw + kw)*Ci_g + ci")
    return p, kh, kw, k // (kh * kw)


# The op's bound on each geometry value (tessera::conv::kConvMaxParam), the same on every path: the C++ checks and the
# eager entry refuse larger values before their shape arithmetic; the checked path here must too (it allocates y
# from the output size first).
_MAX_PARAM = _C.conv_max_param


def _bounded(op, arg, v, minimum):
    if v < minimum:
        raise ValueError(f"{op}: '{arg}' must be >= {minimum}, got {v}")
    if v > _MAX_PARAM:
        raise ValueError(f"{op}: '{arg}' must be <= {_MAX_PARAM}, got {v}")
    return v


def _pair(op, arg, value, minimum):
    """An int or a pair of ints, each in [minimum, _MAX_PARAM], as (h, w)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{op}: '{arg}' must be an int or a pair of ints, got {value!r}")
        h, w = _int(op, arg, value[0]), _int(op, arg, value[1])
    else:
        h = w = _int(op, arg, value)
    return _bounded(op, arg, h, minimum), _bounded(op, arg, w, minimum)


def _geometry(op, kh, kw, stride, padding, dilation, groups):
    """(stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups), checked; padding may be 'valid' (0) or 'same'
    (stride 1 and an odd dilated kernel extent along each axis: tessera pads symmetrically)."""
    sh, sw = _pair(op, "stride", stride, 1)
    dh, dw = _pair(op, "dilation", dilation, 1)
    if isinstance(padding, str):
        if padding == "valid":
            ph = pw = 0
        elif padding == "same":
            if (sh, sw) != (1, 1):
                raise ValueError(f"{op}: 'padding' 'same' needs stride 1, got stride {stride!r}")
            eh, ew = dh * (kh - 1), dw * (kw - 1)
            if eh % 2 or ew % 2:
                raise ValueError(f"{op}: 'padding' 'same' needs dilation·(k - 1) even along both axes (tessera pads "
                                 f"symmetrically), got {eh} and {ew}")
            ph, pw = eh // 2, ew // 2
        else:
            raise ValueError(f"{op}: 'padding' must be an int, a pair of ints, 'valid' or 'same', got {padding!r}")
    else:
        ph, pw = _pair(op, "padding", padding, 0)
    return sh, sw, ph, pw, dh, dw, _bounded(op, "groups", _int(op, "groups", groups), 1)


def _channels_last(t):
    """The memory-format rule for a 4-D [N, C, H, W] tensor (the C++ eager entry has the same): held NHWC when it
    is channels_last-contiguous and, where it is standard-contiguous too (a size-1 dim), its channel stride is 1."""
    torch = torch_module()
    return t.is_contiguous(memory_format=torch.channels_last) and (not t.is_contiguous() or t.stride(1) == 1)


def _output_shape(op, x, co, k, kh, kw, geometry):
    """[N, Co, Ho, Wo] of conv2d over x [N, C, H, W], after the checks that need x's shape (the C++ eager entry
    makes the same ones, with the same messages)."""
    sh, sw, ph, pw, dh, dw, groups = geometry
    _rank(op, "x", x, 4, "[N, C, H, W]")
    batch, c, h, w = x.shape
    if c % groups != 0:
        raise ValueError(f"{op}: 'groups' must divide x's channels C = {c}, got {groups}")
    if co % groups != 0:
        raise ValueError(f"{op}: 'groups' must divide the weight's output channels Co = {co}, got {groups}")
    if (c // groups) * kh * kw != k:
        ci_g = k // (kh * kw)
        raise ValueError(f"{op}: 'x' must have C = groups·Ci_g = {groups}·{ci_g} = {groups * ci_g} channels (the "
                         f"weight's Ci_g = K / (Kh·Kw) = {k} / {kh * kw}), got shape {list(x.shape)}")
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if ho < 1 or wo < 1:
        raise ValueError(f"{op}: 'x' [H, W] = [{h}, {w}] with padding [{ph}, {pw}] is smaller than the dilated kernel "
                         f"[{dh * (kh - 1) + 1}, {dw * (kw - 1) + 1}] (no output pixel)")
    return [batch, co, ho, wo]


def _out_layout(op, out, shape):
    """y's layout from out= (checked against the output's shape): channels_last NHWC, contiguous NCHW."""
    if list(out.shape) != shape:
        raise ValueError(f"{op}: 'out' must be [N, Co, Ho, Wo] = {shape}, got shape {list(out.shape)}")
    if _channels_last(out):
        return _NHWC
    if not out.is_contiguous():
        raise ValueError(f"{op}: 'out' must be contiguous or channels_last-contiguous, got strides "
                         f"{list(out.stride())}")
    return _NCHW


def _query_args(op, x, weight, stride, padding, dilation, groups, out):
    """The arguments tessera._C's path and workspace queries take after the weight's tensors: the input's
    [N, H, W], the weight's constants, the geometry, the layouts and x's dtype name."""
    torch = torch_module()
    p, kh, kw, _ = _checked_weight(op, weight)
    geometry = _geometry(op, kh, kw, stride, padding, dilation, groups)
    x = as_tensor(x, op, "x")
    shape = _output_shape(op, x, p.n, p.k, kh, kw, geometry)
    x_layout = _NHWC if _channels_last(x) else _NCHW
    y_layout = x_layout if out is None else _out_layout(op, as_tensor(out, op, "out"), shape)
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    if x.dtype not in names:
        raise ValueError(f"{op}: 'x' must be torch.bfloat16, torch.float16 or torch.float32, got {x.dtype}")
    name = names[x.dtype]
    return ((x.shape[0], x.shape[2], x.shape[3]), (p.n, p.k, p.bits, p.block, p.zero_mode, kh, kw) + geometry +
            (x_layout, y_layout, name))


# ---- the device op -------------------------------------------------------------------------------------------------


def conv2d_path(x, weight, stride=1, padding=0, dilation=1, groups=1, *, out=None):
    """The path conv2d takes with these arguments: 'linear' (a 1x1 conv run as tessera.linear over the pixels),
    'implicit_gemm' (the tensor-core kernel over TMA im2col copies) or 'direct' (one CUDA-core thread per output).
    x (a tensor of the call's shape, dtype and memory format; any device, meta included) and the rest as conv2d's,
    checked as conv2d checks them; the weight on the host or the GPU. The choice depends on the GPU's SM count (the
    tensor-core grid's limits): it is asked on the weight's device (a host weight: the current device)."""
    op = "tessera.conv2d_path"
    torch = torch_module()
    nhw, rest = _query_args(op, x, weight, stride, padding, dilation, groups, out)
    codes, params = weight.packed.codes, weight.packed.params

    def query():
        return _C.conv2d_path(*nhw, to_capsule(codes), to_capsule(params), *rest)

    return str(_on_device(torch, codes.device, query) if codes.device.type == "cuda" else query())


def workspace_bytes(x, weight, stride=1, padding=0, dilation=1, groups=1, *, out=None):
    """Bytes of device workspace conv2d needs with these arguments (x: a tensor of the call's shape, dtype and
    memory format; out: the out= tensor, or None), 0 when none. conv2d allocates it when not given; pass
    workspace= of this size (and out=) to capture with no allocation at all. The size never depends on x's values;
    it is asked on the weight's device (a host weight: the current device), whose SM count it depends on."""
    op = "tessera.conv.workspace_bytes"
    torch = torch_module()
    nhw, rest = _query_args(op, x, weight, stride, padding, dilation, groups, out)
    codes, params = weight.packed.codes, weight.packed.params

    def query():
        return _C.conv2d_workspace_bytes(*nhw, to_capsule(codes), to_capsule(params), *rest)

    device = codes.device
    return int(_on_device(torch, device, query) if device.type == "cuda" else query())


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None, clamp=None, out=None,
           workspace=None, stream=None):
    """y = clamp(conv2d(x, W) + bias) with W the ConvWeight `weight` (on x's device), as
    torch.nn.functional.conv2d(x, W, bias, stride, padding, dilation, groups) followed by the clamp.

    x           [N, C, H, W] bf16 | fp16 | fp32 (C = groups*Ci_g): 16-bit x must be the weight's compute dtype; fp32
                x is rounded to it once and y is fp32. Read in its memory format: channels_last as NHWC (in place),
                contiguous as NCHW (any other strides: a contiguous copy first).
    bias        [Co] of y's dtype, or None.
    stride, dilation  int or (h, w) pair, >= 1.
    padding     int or (h, w) pair >= 0 (symmetric zero padding), 'valid' (0) or 'same' (stride 1, dilation*(k - 1)
                even along both axes).
    groups      divides C and Co; Ci_g = C / groups must be the weight's.
    activation  None | 'relu' (clamp to [0, inf)) | 'relu6' ([0, 6]).
    clamp       (min, max) or None; either end may be None. With an activation, the intersection of both ranges.
    out         y [N, Co, Ho, Wo] of x's dtype to write into, contiguous (y written NCHW) or channels_last (NHWC);
                default: torch.empty in x's memory format.
    workspace   a contiguous device tensor of at least workspace_bytes(...) bytes, or None (the operator allocates
                it through torch's caching allocator on the stream it runs on).
    stream      None (the current stream), a torch.cuda.Stream or a raw cudaStream_t int.
    Returns y [N, Co, Ho, Wo] of x's dtype, Ho = floor((H + 2*pad_h - dil_h*(Kh - 1) - 1) / stride_h) + 1 (W
    alike), channels_last when it was written NHWC.
    """
    op = "tessera.conv2d"
    lo, hi = (-_INF, _INF) if activation is None and clamp is None else _linear._bounds(op, activation, clamp)
    p, kh, kw, _ = _checked_weight(op, weight)
    geometry = _geometry(op, kh, kw, stride, padding, dilation, groups)
    entry = fast_entry(stream)
    if entry is not None:
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++ (checks x and out, allocates y, launches)
            return entry.conv2d_eager(x, p.codes, p.params, bias, out, workspace, p.n, p.k, p.bits, p.block,
                                      p.zero_mode, kh, kw, *geometry, lo, hi)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _conv2d_checked(op, x, p, kh, kw, geometry, bias, lo, hi, out, workspace, stream)


def _conv2d_checked(op, x, p, kh, kw, geometry, bias, lo, hi, out, workspace, stream):
    """conv2d's checked path: the arguments checked here, then torch_ops()' operator (the registered one under
    torch.compile or a dispatch mode)."""
    torch = torch_module()
    ops = torch_ops()
    x = as_tensor(x, op, "x")
    bias = as_optional_tensor(bias, op, "bias")
    workspace = as_optional_tensor(workspace, op, "workspace")
    if not (x.is_cuda or x.is_meta):
        cuda_device_of(x, op, "x")
    shape = _output_shape(op, x, p.n, p.k, kh, kw, geometry)
    x_layout = _NHWC if _channels_last(x) else _NCHW
    if out is not None:
        out = as_tensor(out, op, "out")
        y_layout = _out_layout(op, out, shape)
    else:
        y_layout = x_layout

    def run():
        # The operator sees x and y contiguous in their layouts: a channels_last tensor as its NHWC view.
        x_store = x.permute(0, 2, 3, 1) if x_layout == _NHWC else x.contiguous()
        batch, co, ho, wo = shape
        if out is not None:
            y_store = out.permute(0, 2, 3, 1) if y_layout == _NHWC else out
        else:
            y_shape = (batch, ho, wo, co) if y_layout == _NHWC else (batch, co, ho, wo)
            y_store = torch.empty(y_shape, dtype=x.dtype, device=x.device)
        ops.conv2d(x_store, p.codes, p.params, bias, y_store, workspace, p.n, p.k, p.bits, p.block, p.zero_mode, kh,
                   kw, *geometry, x_layout, y_layout, lo, hi)
        if out is not None:
            return out
        return y_store.permute(0, 3, 1, 2) if y_layout == _NHWC else y_store

    return run() if stream is None else launch(stream_arg(op, stream, x.device), run)
