"""tessera.linear — the weight-only quantized linear layer: int4 / int8 weights, bf16 / fp16 / fp32 activations.

    y[..., n] = clamp(sum_k x[..., k] * W[n, k] + bias[n], lo, hi)

W [N, K] is held as 4- or 8-bit unsigned codes q with one pair of parameters per output channel and block of
``block`` columns along K (32, 64, 128, or K: one block per output channel), in either convention checkpoints use
(C++: include/tessera/linear.h; docs/ops/linear.md):

    zero_mode='offset'      W = q * scale + offset       (MNN's form; offset any float)
    zero_mode='zero_point'  W = (q - zero) * scale       (GPTQ / AWQ; zero an integer code)

Two steps:

* Offline, on the host (CPU only, no GPU needed): a canonical ``QuantizedLinearWeight`` from a float weight
  (``quantize``) or from a checkpoint's packed tensors (``import_gptq``, ``import_awq``), then ``prepack`` into the
  kernels' layout, a ``PackedLinearWeight``, which ``.cuda()`` / ``.to(device)`` moves to the GPU. ``unpack`` and
  ``dequantize`` go back (tests, checks). These take torch tensors or NumPy arrays (on any device: they are copied
  to the host) and return CPU torch tensors.
* On the device: ``linear(x, packed, bias=None, activation=None, clamp=None)``, one op for every M (the library
  picks the weight-streaming GEMV / split-K path or the tensor-core GEMM).

    import tessera
    q = tessera.linear.quantize(layer.weight, bits=4, block=128)          # or import_gptq / import_awq
    packed = tessera.linear.prepack(q, compute_dtype=torch.bfloat16).cuda()
    y = tessera.linear.linear(x, packed, bias=layer.bias, activation="relu")

Like the other families, ``linear`` accepts torch tensors (or ``__dlpack__`` producers), runs asynchronously on the
current CUDA stream of x's device (or on ``stream=``), never synchronizes, allocates y with torch unless ``out=`` is
given and its workspace (through torch's caching allocator, inside the operator) unless ``workspace=`` is given, can
be captured in a CUDA graph and traced by torch.compile(fullgraph=True) (it is torch.ops.tessera.linear underneath),
and raises ValueError naming the op and the argument for invalid arguments (messages from the C++ validation name
the C++ API's fields: 'w.codes', 'p', ...), RuntimeError for CUDA or device errors.
"""

import dataclasses
import math

from . import _C
from ._dlpack import (FALLBACK, as_optional_tensor, as_tensor, cuda_device, cuda_device_of, fast_entry, launch,
                      stream_arg, to_capsule, torch_module, torch_ops)
from .attention import _float, _on_device
from .moe import _choice, _int

__all__ = [
    "ACTIVATIONS",
    "ZERO_MODES",
    "PackedLinearWeight",
    "QuantizedLinearWeight",
    "dequantize",
    "import_awq",
    "import_gptq",
    "linear",
    "prepack",
    "quantize",
    "unpack",
    "workspace_bytes",
]

ZERO_MODES = ("offset", "zero_point")
ACTIVATIONS = (None, "relu", "relu6")
BLOCKS = (32, 64, 128)  # or K: one block per output channel
_INF = math.inf


def tile_k(bits):
    """Columns of one packed tile: K is padded to a multiple of it (64 for int4, 32 for int8)."""
    return 64 if bits == 4 else 32


# ---- the two forms -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class QuantizedLinearWeight:
    """The canonical host form (C++ tessera::linear::QuantizedWeight): one code per byte, W's columns possibly
    permuted (GPTQ act-order).

    codes   uint8 [N, K], 0 .. 2^bits - 1.
    scale   float32 [N, K // block].
    offset  float32 [N, K // block] (zero_point mode: -zero * scale; may be None there).
    zero    uint8 [N, K // block] in zero_point mode, else None.
    k_perm  int32 [K] or None (the identity): column j of this form is column k_perm[j] of W, so
            y = x[:, k_perm] @ w.T (the op applies it).
    n, k, bits (4 | 8), block (32 | 64 | 128 | K), zero_mode ('offset' | 'zero_point').

    w[n, j] = codes[n, j] * scale[n, j // block] + offset[n, j // block]        (offset)
    w[n, j] = (codes[n, j] - zero[n, j // block]) * scale[n, j // block]        (zero_point)
    """

    codes: object
    scale: object
    offset: object
    zero: object
    k_perm: object
    n: int
    k: int
    bits: int
    block: int
    zero_mode: str

    def __repr__(self):
        return (f"QuantizedLinearWeight(n={self.n}, k={self.k}, bits={self.bits}, block={self.block}, "
                f"zero_mode={self.zero_mode!r}, act_order={self.k_perm is not None})")


@dataclasses.dataclass(eq=False)
class PackedLinearWeight:
    """A weight in the kernels' layout (C++ tessera::linear::PackedWeight / LinearWeight), made by ``prepack``.

    codes   uint8 [Np, Kp * bits / 8]: Np = N rounded up to 16, Kp = K rounded up to 64 (int4) or 32 (int8);
            16-row stripes of 512-byte tiles, each lane's mma fragment codes (docs/ops/linear.md, byte by byte).
    params  compute_dtype [Np, num_blocks, 2]: (scale, offset) or (scale, zero) pairs per 16-row stripe and block,
            rows in the order 0, 8, 1, 9, ..., 7, 15; num_blocks = Kp / block, or 1 (block = K).
    k_perm  int32 [K] or None.
    n, k, bits, block, zero_mode as in QuantizedLinearWeight; compute_dtype is params' dtype (bf16 | fp16): the
    16-bit type the kernels compute in, which must be x's dtype (fp32 x is rounded to it).

    ``.to(device)`` / ``.cuda()`` / ``.cpu()`` return a copy on that device (the constants shared).
    """

    codes: object
    params: object
    k_perm: object
    n: int
    k: int
    bits: int
    block: int
    zero_mode: str

    @property
    def compute_dtype(self):
        return self.params.dtype

    @property
    def device(self):
        return self.codes.device

    @property
    def padded_n(self):
        return (self.n + 15) // 16 * 16

    @property
    def padded_k(self):
        t = tile_k(self.bits)
        return (self.k + t - 1) // t * t

    @property
    def num_blocks(self):
        return 1 if self.block == self.k else self.padded_k // self.block

    def to(self, device=None, non_blocking=False):
        """This weight on `device` (torch.device, str or index); the same object's tensors where they are there."""
        move = (lambda t: None if t is None else t.to(device, non_blocking=non_blocking))
        return dataclasses.replace(self, codes=move(self.codes), params=move(self.params), k_perm=move(self.k_perm))

    def cuda(self, device=None, non_blocking=False):
        return self.to(cuda_device(device), non_blocking=non_blocking)

    def cpu(self):
        return self.to("cpu")

    def __repr__(self):
        return (f"PackedLinearWeight(n={self.n}, k={self.k}, bits={self.bits}, block={self.block}, "
                f"zero_mode={self.zero_mode!r}, compute_dtype={self.params.dtype}, device={self.codes.device}, "
                f"act_order={self.k_perm is not None})")


# ---- host arrays ---------------------------------------------------------------------------------------------------


def _host(obj, op, arg):
    """obj (a torch tensor, a NumPy array, or a __dlpack__ producer) as a CPU torch tensor (detached)."""
    torch = torch_module()
    if isinstance(obj, torch.Tensor):
        t = obj
    elif hasattr(obj, "__array_interface__") or isinstance(obj, (list, tuple)):  # NumPy (read-only ones too)
        t = torch.as_tensor(obj)
    elif hasattr(obj, "__dlpack__"):
        t = torch.from_dlpack(obj)
    else:
        raise TypeError(f"{op}: '{arg}' must be a torch.Tensor, a NumPy array or an object with __dlpack__, "
                        f"got {type(obj).__name__}")
    return t.detach().cpu()


def _float_array(op, arg, obj, dtype, finite=False):
    t = _host(obj, op, arg)
    if not t.is_floating_point():
        raise ValueError(f"{op}: '{arg}' must be a floating-point tensor, got {t.dtype}")
    t = t.to(dtype).contiguous()
    if finite:
        bad = ~torch_module().isfinite(t)
        if bool(bad.any()):
            first = [int(i) for i in bad.nonzero()[0]]
            raise ValueError(f"{op}: '{arg}' must be finite in {dtype} (values past its range round to inf), got "
                             f"{int(bad.sum())} inf / NaN values, the first at index {first}")
    return t


def _integer_host(op, arg, obj, what="an integer tensor"):
    """obj as a host tensor, which must hold integers."""
    torch = torch_module()
    t = _host(obj, op, arg)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{op}: '{arg}' must be {what}, got {t.dtype}")
    return t


def _int32_array(op, arg, obj):
    """Integer tensors as int32; 32-bit words held in wider types (uint32 values in int64) keep their bits."""
    torch = torch_module()
    t = _integer_host(op, arg, obj, "an integer tensor (int32 words)")
    if t.dtype != torch.int32:
        if t.element_size() == 4:
            t = t.view(torch.int32)  # uint32
        else:
            t = t.to(torch.int64)
            if t.numel() and (int(t.min()) < -2**31 or int(t.max()) >= 2**32):
                raise ValueError(f"{op}: '{arg}' holds values outside 32 bits")
            t = torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    return t.contiguous()


def _byte_array(op, arg, obj, hi=255):
    """Codes or zero points as uint8, checked to lie in [0, hi] when converted from another integer type."""
    torch = torch_module()
    t = _integer_host(op, arg, obj)
    if t.dtype != torch.uint8:
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > hi):
            raise ValueError(f"{op}: '{arg}' must hold values in [0, {hi}], got [{int(t.min())}, {int(t.max())}]")
        t = t.to(torch.uint8)
    return t.contiguous()


def _index_array(op, arg, obj):
    torch = torch_module()
    t = _integer_host(op, arg, obj)
    if t.dtype != torch.int32:
        if t.numel() and (int(t.min()) < -2**31 or int(t.max()) >= 2**31):
            raise ValueError(f"{op}: '{arg}' holds values outside int32")
        t = t.to(torch.int32)
    return t.contiguous()


def _view(buf, dtype, shape):
    """A bytearray from tessera._C as a tensor of `shape` (sharing its memory), or None."""
    if buf is None:
        return None
    return torch_module().frombuffer(buf, dtype=dtype).view(shape)


def _quantized(d):
    torch = torch_module()
    n, k, block = d["n"], d["k"], d["block"]
    nb = k // block
    return QuantizedLinearWeight(
        codes=_view(d["codes"], torch.uint8, (n, k)), scale=_view(d["scale"], torch.float32, (n, nb)),
        offset=_view(d["offset"], torch.float32, (n, nb)), zero=_view(d["zero"], torch.uint8, (n, nb)),
        k_perm=_view(d["k_perm"], torch.int32, (k,)), n=n, k=k, bits=d["bits"], block=block,
        zero_mode=d["zero_mode"])


def _compute_dtype_name(op, dtype):
    torch = torch_module()
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise ValueError(f"{op}: 'compute_dtype' must be torch.bfloat16 or torch.float16, got {dtype!r}")
    return names[dtype]


def _x_dtype_name(op, dtype):
    torch = torch_module()
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    if dtype not in names:
        raise ValueError(f"{op}: 'x_dtype' must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    return names[dtype]


def _bits(op, bits):
    bits = _int(op, "bits", bits)
    if bits not in (4, 8):
        raise ValueError(f"{op}: 'bits' must be 4 or 8, got {bits}")
    return bits


# ---- host steps ----------------------------------------------------------------------------------------------------


def quantize(w, bits=4, block=128, zero_mode="offset"):
    """Round-to-nearest quantization of a float weight w [N, K] (an nn.Linear weight) into the canonical form.

    Per output channel and block of `block` columns (32, 64, 128, or None / K for one block per channel):
    'offset' takes offset = min, scale = (max - min) / (2^bits - 1); 'zero_point' widens the range to hold 0 and
    takes zero = round(-min / scale) (GPTQ's rule). w may be any float dtype (computed in fp32), on any device.
    Returns a QuantizedLinearWeight (CPU tensors).
    """
    op = "tessera.linear.quantize"
    _choice(op, "zero_mode", zero_mode, ZERO_MODES)
    bits = _bits(op, bits)
    w = _float_array(op, "w", w, torch_module().float32)
    if w.dim() != 2:
        raise ValueError(f"{op}: 'w' must have rank 2 [N, K], got shape {list(w.shape)}")
    block = w.shape[1] if block is None else _int(op, "block", block)
    return _quantized(_C.linear_quantize(to_capsule(w), bits, block, zero_mode))


def import_gptq(qweight, qzeros, scales, g_idx=None, bits=4, group=128, zero_stored_minus_one=True):
    """A GPTQ checkpoint's tensors (AutoGPTQ layout, w = (q - z) * s) as the canonical form.

    qweight  int32 [K * bits / 32, N]: column k = r * (32 / bits) + j in bits [bits*j, bits*(j+1)) of row r.
    qzeros   int32 [K / group, N * bits / 32]: output n = c * (32 / bits) + j in bits [bits*j, ...) of column c.
    scales   float16 [K / group, N] (other float dtypes are rounded to float16, the format's type).
    g_idx    int32 [K] (each column's group) or None (k // group). An act-order g_idx is sorted into contiguous
             groups (stable in k) and kept as k_perm; every group must own exactly `group` columns.
    group    columns per group; None or -1: K (one group per output channel).
    zero_stored_minus_one  True for v1 checkpoints (qzeros hold z - 1: 7 for the symmetric 4-bit z = 8), False for
             v2 ones (z itself).
    Integer tensors of other dtypes are taken as int32 words (uint32 values in int64 keep their bits). Returns a
    QuantizedLinearWeight in 'zero_point' mode (CPU tensors).
    """
    op = "tessera.linear.import_gptq"
    bits = _bits(op, bits)
    torch = torch_module()
    qweight = _int32_array(op, "qweight", qweight)
    qzeros = _int32_array(op, "qzeros", qzeros)
    scales = _float_array(op, "scales", scales, torch.float16, finite=True)
    g_idx = None if g_idx is None else _index_array(op, "g_idx", g_idx)
    if group is None or (not isinstance(group, bool) and group == -1):
        group = qweight.shape[0] * (32 // bits) if qweight.dim() == 2 else 0
    group = _int(op, "group", group)
    d = _C.linear_import_gptq(to_capsule(qweight), to_capsule(qzeros), to_capsule(scales), to_capsule(g_idx), bits,
                              group, bool(zero_stored_minus_one))
    return _quantized(d)


def import_awq(qweight, qzeros, scales, group=128):
    """An AWQ checkpoint's tensors (AutoAWQ GEMM layout, 4-bit, w = (q - z) * s) as the canonical form.

    qweight  int32 [K, N / 8]: nibble i (bits 4i..4i+3) of column c holds output n = 8c + [0, 2, 4, 6, 1, 3, 5, 7][i].
    qzeros   int32 [K / group, N / 8], the same order.
    scales   float16 [K / group, N] (other float dtypes are rounded to float16).
    group    columns per group; None or -1: K.
    Returns a QuantizedLinearWeight in 'zero_point' mode (CPU tensors).
    """
    op = "tessera.linear.import_awq"
    torch = torch_module()
    qweight = _int32_array(op, "qweight", qweight)
    qzeros = _int32_array(op, "qzeros", qzeros)
    scales = _float_array(op, "scales", scales, torch.float16, finite=True)
    if group is None or (not isinstance(group, bool) and group == -1):
        group = qweight.shape[0] if qweight.dim() == 2 else 0
    group = _int(op, "group", group)
    return _quantized(_C.linear_import_awq(to_capsule(qweight), to_capsule(qzeros), to_capsule(scales), group))


def prepack(weight, compute_dtype=None):
    """The canonical form in the kernels' layout: a PackedLinearWeight on the host (move it with .cuda()).

    weight         a QuantizedLinearWeight (from quantize, import_gptq, import_awq, or built by hand: its tensors
                   are converted to the documented dtypes, on the host).
    compute_dtype  torch.bfloat16 (default) or torch.float16: the type the kernels compute in and the parameters
                   are stored in (rounded once); it must be x's dtype, or the type fp32 x is rounded to.
    Rules (checked, ValueError): bits 4 or 8; K > 0 (tessera.linear.linear itself needs K % 8 == 0; a conv weight
    may have any K); block 32, 64, 128 or K dividing K; codes below
    2^bits; k_perm a permutation of [0, K).
    """
    op = "tessera.linear.prepack"
    torch = torch_module()
    if not isinstance(weight, QuantizedLinearWeight):
        raise ValueError(f"{op}: 'weight' must be a tessera.linear.QuantizedLinearWeight (from quantize, "
                         f"import_gptq or import_awq), got {type(weight).__name__}")
    name = _compute_dtype_name(op, torch.bfloat16 if compute_dtype is None else compute_dtype)
    _choice(op, "zero_mode", weight.zero_mode, ZERO_MODES)
    codes = _byte_array(op, "codes", weight.codes)
    scale = _float_array(op, "scale", weight.scale, torch.float32)
    offset = None if weight.offset is None else _float_array(op, "offset", weight.offset, torch.float32)
    zero = None if weight.zero is None else _byte_array(op, "zero", weight.zero)
    k_perm = None if weight.k_perm is None else _index_array(op, "k_perm", weight.k_perm)
    if codes.dim() != 2 or tuple(codes.shape) != (weight.n, weight.k):
        raise ValueError(f"{op}: 'codes' must be [N, K] = [{weight.n}, {weight.k}], got shape {list(codes.shape)}")
    d = _C.linear_prepack(to_capsule(codes), to_capsule(scale), to_capsule(offset), to_capsule(zero),
                          to_capsule(k_perm), _int(op, "bits", weight.bits), _int(op, "block", weight.block),
                          weight.zero_mode, name)
    dtype = torch.bfloat16 if d["compute_dtype"] == "bfloat16" else torch.float16
    np_, kp, nb = d["padded_n"], d["padded_k"], d["num_blocks"]
    return PackedLinearWeight(
        codes=_view(d["codes"], torch.uint8, (np_, kp * d["bits"] // 8)),
        params=_view(d["params"], dtype, (np_, nb, 2)), k_perm=_view(d["k_perm"], torch.int32, (d["k"],)), n=d["n"], k=d["k"], bits=d["bits"], block=d["block"],
        zero_mode=d["zero_mode"])


def unpack(packed):
    """The inverse of prepack: a QuantizedLinearWeight (CPU tensors) with the parameters rounded to the compute
    dtype, as the kernels read them. packed may be on any device."""
    op = "tessera.linear.unpack"
    if not isinstance(packed, PackedLinearWeight):
        raise ValueError(f"{op}: 'packed' must be a tessera.linear.PackedLinearWeight, got {type(packed).__name__}")
    torch = torch_module()
    codes = _byte_array(op, "codes", packed.codes)
    params = _host(packed.params, op, "params").contiguous()
    k_perm = None if packed.k_perm is None else _index_array(op, "k_perm", packed.k_perm)
    if params.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: 'params' must be torch.bfloat16 or torch.float16, got {params.dtype}")
    d = _C.linear_unpack(to_capsule(codes), to_capsule(params), to_capsule(k_perm), _int(op, "n", packed.n),
                         _int(op, "k", packed.k), _int(op, "bits", packed.bits), _int(op, "block", packed.block),
                         packed.zero_mode)
    return _quantized(d)


def dequantize(weight, dtype=None):
    """The float weight W [N, K] a QuantizedLinearWeight or PackedLinearWeight stands for, in W's original column
    order (k_perm undone), so that linear(x, packed) ~= x @ W.T; computed in float64 from the stored values (a
    packed weight's parameters as rounded to its compute dtype) and returned as `dtype` (default float32), on
    the host. A torch function for tests and checks."""
    op = "tessera.linear.dequantize"
    torch = torch_module()
    if isinstance(weight, PackedLinearWeight):
        weight = unpack(weight)
    elif not isinstance(weight, QuantizedLinearWeight):
        raise ValueError(f"{op}: 'weight' must be a QuantizedLinearWeight or a PackedLinearWeight, "
                         f"got {type(weight).__name__}")
    block = weight.block
    codes = _host(weight.codes, op, "codes").double()
    scale = _host(weight.scale, op, "scale").double().repeat_interleave(block, dim=1)
    if weight.zero_mode == "zero_point":
        zero = _host(weight.zero, op, "zero").double().repeat_interleave(block, dim=1)
        w = (codes - zero) * scale
    else:
        w = codes * scale + _host(weight.offset, op, "offset").double().repeat_interleave(block, dim=1)
    if weight.k_perm is not None:
        original = torch.empty_like(w)
        original[:, _host(weight.k_perm, op, "k_perm").long()] = w
        w = original
    return w.to(torch.float32 if dtype is None else dtype)


# ---- the device op -------------------------------------------------------------------------------------------------


def _bounds(op, activation, clamp):
    """(clamp_min, clamp_max) of the epilogue: the activation's range, narrowed by clamp=(lo, hi)."""
    lo, hi = -_INF, _INF
    if activation is not None:
        if activation == "relu":
            lo = 0.0
        elif activation == "relu6":
            lo, hi = 0.0, 6.0
        else:
            raise ValueError(f"{op}: 'activation' must be None, 'relu' or 'relu6', got {activation!r}")
    if clamp is not None:
        if not isinstance(clamp, (tuple, list)) or len(clamp) != 2:
            raise ValueError(f"{op}: 'clamp' must be a (min, max) pair (None for an open end), got {clamp!r}")
        c_lo = -_INF if clamp[0] is None else _float(op, "clamp", clamp[0])
        c_hi = _INF if clamp[1] is None else _float(op, "clamp", clamp[1])
        if math.isnan(c_lo) or math.isnan(c_hi):
            raise ValueError(f"{op}: 'clamp' must not hold NaN, got {clamp!r}")
        lo, hi = max(lo, c_lo), min(hi, c_hi)
    if not lo <= hi:
        raise ValueError(f"{op}: 'clamp' must give min <= max, got [{lo}, {hi}]")
    return lo, hi


def workspace_bytes(max_m, weight, x_dtype=None):
    """Bytes of device workspace linear needs for up to max_m rows of x of x_dtype (default: the weight's compute
    dtype) with this PackedLinearWeight (on the GPU: the size depends on its SM count), 0 when none. linear
    allocates it when not given; pass workspace= of this size (and out=) to capture with no allocation at all. The
    size never depends on x's values, so one workspace serves every call and replay up to max_m rows. The query
    walks every M up to max_m (about half a microsecond each): ask once, not per call."""
    op = "tessera.linear.workspace_bytes"
    torch = torch_module()
    if not isinstance(weight, PackedLinearWeight):
        raise ValueError(f"{op}: 'weight' must be a tessera.linear.PackedLinearWeight, got {type(weight).__name__}")
    max_m = _int(op, "max_m", max_m, 0)
    name = _x_dtype_name(op, weight.params.dtype if x_dtype is None else x_dtype)

    def query():
        return _C.linear_workspace_bytes(max_m, to_capsule(weight.codes), to_capsule(weight.params),
                                         to_capsule(weight.k_perm), weight.n, weight.k, weight.bits, weight.block,
                                         weight.zero_mode, name)

    device = weight.codes.device
    return int(_on_device(torch, device, query) if device.type == "cuda" else query())


def linear(x, weight, bias=None, *, activation=None, clamp=None, out=None, workspace=None, stream=None):
    """y = clamp(x @ W.T + bias) with W the PackedLinearWeight `weight` (on x's device).

    x           [..., K] bf16 | fp16 | fp32: 16-bit x must be the weight's compute dtype; fp32 x is rounded to it on
                the way into the tensor cores (one rounding, relative 2^-9 for bf16, 2^-12 for fp16) and y is fp32.
                The leading dims are flattened to M rows (a view where x's strides allow); the rows of that
                [M, K] view need unit stride along K, a row stride that is a multiple of 8 elements, 16-byte
                alignment. M may be 0.
    bias        [N] of y's dtype, or None.
    activation  None | 'relu' (clamp to [0, inf)) | 'relu6' ([0, 6]).
    clamp       (min, max) or None; either end may be None. With an activation, the intersection of both ranges.
    out         y [..., N] (x's leading dims) of x's dtype to write into, viewable as [M, N] with a row stride that
                is a multiple of 8 elements; default torch.empty.
    workspace   a contiguous device tensor of at least workspace_bytes(M, weight, x.dtype) bytes, or None (the
                operator allocates it through torch's caching allocator on the stream it runs on).
    stream      None (the current stream), a torch.cuda.Stream or a raw cudaStream_t int.
    Products on the tensor cores in the compute dtype (w rounded once from q, scale, offset), fp32 accumulation.
    Returns y [..., N] of x's dtype.
    """
    lo, hi = (-_INF, _INF) if activation is None and clamp is None else _bounds("tessera.linear", activation, clamp)
    if type(weight) is PackedLinearWeight:
        entry = fast_entry(stream)
        if entry is not None:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            try:
                return entry.linear_eager(x, weight.codes, weight.params, weight.k_perm, bias, out, workspace,
                                          weight.n, weight.k, weight.bits, weight.block, weight.zero_mode, lo, hi)
            except TypeError as e:
                if FALLBACK not in str(e):
                    raise
    return _linear_checked(x, weight, bias, lo, hi, out, workspace, stream)


def _linear_checked(x, weight, bias, lo, hi, out, workspace, stream):
    """linear's checked path: the arguments checked here, then torch_ops()' linear (the registered operator under
    torch.compile or a dispatch mode)."""
    op = "tessera.linear"
    if not isinstance(weight, PackedLinearWeight):
        raise ValueError(f"{op}: 'weight' must be a tessera.linear.PackedLinearWeight (tessera.linear.prepack(...)"
                         f".cuda()), got {type(weight).__name__}")
    _choice(op, "zero_mode", weight.zero_mode, ZERO_MODES)
    torch = torch_module()
    ops = torch_ops()
    x = as_tensor(x, op, "x")
    bias = as_optional_tensor(bias, op, "bias")
    workspace = as_optional_tensor(workspace, op, "workspace")
    if not x.is_cuda:
        cuda_device_of(x, op, "x")
    n, k = _int(op, "weight.n", weight.n, 1), _int(op, "weight.k", weight.k, 1)  # as the eager entry checks them
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: 'x' must be [..., K] with K = {k}, got shape {list(x.shape)}")
    lead = tuple(x.shape[:-1])
    if out is not None:
        out = as_tensor(out, op, "out")
        if tuple(out.shape) != lead + (n,):
            raise ValueError(f"{op}: 'out' must be [..., N] = {list(lead + (n,))}, got shape {list(out.shape)}")

    def run():
        x2 = x.reshape(-1, k)
        if out is None:
            y2 = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        else:
            try:
                y2 = out if out.dim() == 2 else out.view(-1, n)
            except RuntimeError:  # the eager entry's message, for the same out
                raise ValueError(f"{op}: 'out' must be viewable as [M, N] (M = the product of x's leading dims), "
                                 f"got strides {list(out.stride())}") from None
        ops.linear(x2, weight.codes, weight.params, weight.k_perm, bias, y2, workspace, n, k, weight.bits,
                   weight.block, weight.zero_mode, lo, hi)
        return y2.view(lead + (n,)) if out is None else out

    return run() if stream is None else launch(stream_arg(op, stream, x.device), run)
