"""tessera.w8a8 — W8A8 linear layers: int8 activations quantized on the fly × int8 weights, int32 tensor-core
products.

Both operands are int8 codes with an fp32 scale and an integer zero point per (row, block of ``block`` columns of K),
the block the same for both: 32, 64, 128, or K (one block per row: per token for x, per output channel for W)
(C++: include/tessera/w8a8.h):

    x[m, k] ~= sA[m, i] * (Aq[m, k] - zA[m, i]),    W[n, k] ~= sB[n, i] * (Bq[n, k] - zB[n, i]),    i = k // block
    y[m, n]  = clamp(sum_i sA[m, i] * sB[n, i] * sum_{k in block i} (Aq - zA)(Bq - zB) + bias[n])

Three steps, two of them launches:

* Offline, on the host (no GPU needed): ``prepack_w8a8(w)`` quantizes a float weight [N, K] into an ``Int8Blocks``
  (symmetric by default) with the code sums the GEMM needs; ``.cuda()`` / ``.to(device)`` moves it.
* Per call: ``quantize_per_block(x)`` quantizes the activations into an ``Int8Blocks`` (asymmetric by default), then
  ``gemm_w8a8(a, w, bias)`` multiplies. ``linear_w8a8(x, w, bias)`` does both.

    import tessera
    w = tessera.w8a8.prepack_w8a8(layer.weight, block=128).cuda()
    y = tessera.w8a8.linear_w8a8(x, w, bias=layer.bias.float(), activation="relu")

Like the other families, the device functions take torch tensors, run asynchronously on the current CUDA stream of
the operands' device (or on ``stream=``), never synchronize, allocate their outputs with torch unless ``out=`` is given
and the GEMM's workspace (through torch's caching allocator, inside the operator) unless ``workspace=`` is given, can
be captured in a CUDA graph and traced by torch.compile(fullgraph=True) (they are torch.ops.tessera.w8a8_quantize
and torch.ops.tessera.gemm_w8a8 underneath), and raise ValueError naming the op and the argument for invalid
arguments (messages from the C++ validation name the C++ API's fields: 'out.scale', 'a.codes', 'epilogue.bias',
...), RuntimeError for CUDA or device errors.
"""

import functools
import math
import typing

from . import _C
from ._dlpack import (FALLBACK, as_optional_tensor, as_tensor, cuda_device, cuda_device_of, fast_entry, launch,
                      stream_arg, to_capsule, torch_module, torch_ops)
from .attention import _float, _on_device
from .linear import _bounds, _float_array
from .moe import _int, _rank

__all__ = [
    "ACTIVATIONS",
    "BLOCKS",
    "Int8Blocks",
    "dequantize",
    "empty_blocks",
    "gemm_w8a8",
    "linear_w8a8",
    "param_ld",
    "prepack_w8a8",
    "quantize_per_block",
    "workspace_bytes",
]

ACTIVATIONS = (None, "relu", "relu6")
BLOCKS = (32, 64, 128)  # or K: one block per row
_INF = math.inf


def param_ld(rows):
    """The row stride (ld) of the parameter planes this module allocates for `rows` rows: rows rounded up to a
    multiple of 4 (16 bytes, what the GEMM's TMA loads need), and 4 for no rows (a [K/block, 0] tensor has no stride
    the C++ checks would accept). prepack_w8a8's planes have it too (C++ int8_block_param_ld)."""
    return (max(rows, 1) + 3) // 4 * 4


class Int8Blocks(typing.NamedTuple):
    """int8 codes of a [rows, K] matrix with their per-(row, block) parameters (C++ tessera::linear::Int8BlockTensor):
    what quantize_per_block returns for the activations and prepack_w8a8 for a weight.

    codes  int8 [rows, K], unit stride along K, rows 16-byte aligned.
    scale  float32 [K // block, ld]: the parameter planes are block-major, element (row r, block i) at [i, r]; ld
           (their row stride) is rows rounded up to a multiple of 4, and only the first `rows` columns are
           meaningful: the others are padding (zero in prepack_w8a8's planes, left as allocated by
           quantize_per_block; the GEMM never lets them reach a stored output). ``scale[:, :rows].T`` is the
           [rows, K // block] matrix of scales.
    zero   float32 like scale, integers in [-128, 127], or None (symmetric: every zero point 0).
    sums   float32 like scale, the sum of each (row, block)'s codes (an exact integer), or None. The GEMM needs the
           activations' sums when the weight has zero points, and the weight's when the activations have them.
    block  32, 64, 128 or K.

    The three planes share ld. ``.to(device)`` / ``.cuda()`` / ``.cpu()`` return a copy on that device.
    """

    codes: typing.Any
    scale: typing.Any
    zero: typing.Any
    sums: typing.Any
    block: int

    @property
    def rows(self):
        return self.codes.shape[0]

    @property
    def k(self):
        return self.codes.shape[1]

    @property
    def num_blocks(self):
        return self.scale.shape[0]

    @property
    def ld(self):
        return self.scale.stride(0)

    @property
    def symmetric(self):
        return self.zero is None

    @property
    def device(self):
        return self.codes.device

    def to(self, device=None, non_blocking=False):
        """These blocks on `device` (torch.device, str or index); the same tensors where they are there already."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Int8Blocks(move(self.codes), move(self.scale), move(self.zero), move(self.sums), self.block)

    def cuda(self, device=None, non_blocking=False):
        return self.to(cuda_device(device), non_blocking=non_blocking)

    def cpu(self):
        return self.to("cpu")

    def __repr__(self):
        return (f"Int8Blocks(rows={self.codes.shape[0]}, k={self.codes.shape[1]}, block={self.block}, "
                f"symmetric={self.zero is None}, sums={self.sums is not None}, device={self.codes.device})")


# ---- shared checks -------------------------------------------------------------------------------------------------


def _block(op, block, k):
    """block (None: K) checked against K: 32, 64, 128 or K, dividing K."""
    if block is None:
        return k
    block = _int(op, "block", block)
    if block != k and block not in BLOCKS:
        raise ValueError(f"{op}: 'block' must be 32, 64, 128 or K ({k}), got {block}")
    if k % block:
        raise ValueError(f"{op}: 'block' must divide K ({k}), got {block}")
    return block


def _blocks_arg(op, arg, t):
    if not isinstance(t, Int8Blocks):
        raise ValueError(f"{op}: '{arg}' must be a tessera.w8a8.Int8Blocks (quantize_per_block, or "
                         f"prepack_w8a8(...).cuda() for a weight), got {type(t).__name__}")
    return t


_OUT_NAMES = None  # {torch dtype: its name for the operators}, made on first use (torch is imported lazily)


def _out_kind(op, torch, out_dtype, out_scale, out, default):
    """(y dtype, its name for the operator, out_scale as the operator takes it). out_dtype None: out's dtype, else
    `default`. An int8 y needs out_scale (y = clamp(rint(v * out_scale), -128, 127)); a float y takes none."""
    global _OUT_NAMES
    names = _OUT_NAMES
    if names is None:
        names = _OUT_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                              torch.int8: "int8"}
    if out_scale is None and out_dtype is None:  # the common case: y's dtype from out, or the default
        dtype = out.dtype if out is not None else default
        name = names.get(dtype)
        if name is not None and name != "int8":  # a float y: no further rule applies
            return dtype, name, 1.0
    dtype = out_dtype if out_dtype is not None else (out.dtype if out is not None else default)
    if dtype not in names:
        raise ValueError(f"{op}: 'out_dtype' must be torch.bfloat16, torch.float16, torch.float32 or torch.int8, "
                         f"got {dtype!r}")
    if out is not None and out.dtype != dtype:
        raise ValueError(f"{op}: 'out' must be {dtype} (out_dtype), got {out.dtype}")
    if dtype == torch.int8:
        if out_scale is None:
            raise ValueError(f"{op}: 'out_scale' is required for an int8 output (y = clamp(rint(v * out_scale), "
                             f"-128, 127))")
        scale = _float(op, "out_scale", out_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{op}: 'out_scale' must be positive and finite, got {scale}")
        return dtype, names[dtype], scale
    if out_scale is not None:
        raise ValueError(f"{op}: 'out_scale' applies to an int8 output only, got {out_scale!r} with {dtype}")
    return dtype, names[dtype], 1.0


def _epilogue(op, activation, clamp):
    return (-_INF, _INF) if activation is None and clamp is None else _bounds(op, activation, clamp)


# ---- host step -----------------------------------------------------------------------------------------------------


def _view(buf, torch, dtype, shape):
    """A bytearray from tessera._C as a tensor of `shape` (sharing its memory), or None."""
    return None if buf is None else torch.frombuffer(buf, dtype=dtype).view(shape)


def prepack_w8a8(w, block=128, symmetric=True):
    """A float weight w [N, K] (an nn.Linear weight; any float dtype, on any device: computed in fp32 on the host)
    quantized per (output channel, block) with quantize_per_block's rule, its code sums precomputed: an Int8Blocks
    of CPU tensors (planes [K // block, ld], ld = N rounded up to 4, padding zero). Move it with .cuda().

    block      32, 64, 128, or None / K (one block per output channel); it must be the activations' block.
    symmetric  True (default): zero points 0, codes in [-127, 127]; False: zero points, codes in [-128, 127].
    Rules (checked, ValueError): w rank 2 and finite; K a positive multiple of 16; block 32, 64, 128 or K dividing K.
    """
    op = "tessera.prepack_w8a8"
    torch = torch_module()
    w = _float_array(op, "w", w, torch.float32)
    if w.dim() != 2:
        raise ValueError(f"{op}: 'w' must have rank 2 [N, K], got shape {list(w.shape)}")
    block = w.shape[1] if block is None else _int(op, "block", block)
    d = _C.prepack_w8a8(to_capsule(w), block, bool(symmetric))
    n, k, block, ld = d["n"], d["k"], d["block"], d["ld"]
    planes = (k // block, ld)
    return Int8Blocks(_view(d["codes"], torch, torch.int8, (n, k)), _view(d["scale"], torch, torch.float32, planes),
                      _view(d["zero"], torch, torch.float32, planes), _view(d["sums"], torch, torch.float32, planes),
                      block)


def dequantize(blocks, dtype=None):
    """The [rows, K] matrix an Int8Blocks stands for, scale * (codes - zero), computed in float64 from the stored values
    and returned as `dtype` (default float32), on the host. A torch function for tests and checks."""
    op = "tessera.w8a8.dequantize"
    torch = torch_module()
    _blocks_arg(op, "blocks", blocks)
    codes = blocks.codes.detach().cpu().double()
    rows = codes.shape[0]

    def per_element(plane):  # [K // block, ld] -> [rows, K]
        return plane.detach().cpu().double()[:, :rows].t().repeat_interleave(blocks.block, dim=1)

    v = codes if blocks.zero is None else codes - per_element(blocks.zero)
    return (v * per_element(blocks.scale)).to(torch.float32 if dtype is None else dtype)


# ---- the device ops --------------------------------------------------------------------------------------------------


def empty_blocks(rows, k, block=128, *, symmetric=False, sums=True, device=None):
    """An Int8Blocks of uninitialized tensors for `rows` rows of K columns (planes [K // block, param_ld(rows)]), to
    pass as quantize_per_block's out= (or linear_w8a8's a_out=): with out=, nothing is allocated. device: default the
    current CUDA device."""
    op = "tessera.w8a8.empty_blocks"
    torch = torch_module()
    rows = _int(op, "rows", rows, 0)
    k = _int(op, "k", k, 1)
    block = _block(op, block, k)
    device = cuda_device(device)
    planes = (k // block, param_ld(rows))

    def plane():
        return torch.empty(planes, dtype=torch.float32, device=device)

    return Int8Blocks(torch.empty((rows, k), dtype=torch.int8, device=device), plane(),
                      None if symmetric else plane(), plane() if sums else None, block)


def quantize_per_block(x, block=128, symmetric=False, *, sums=True, out=None, stream=None):
    """x [..., K] (bf16 | fp16 | fp32 on the GPU, unit stride along K, K a multiple of 16) quantized per (row, block
    of `block` columns) into int8 codes and parameter planes: an Int8Blocks with rows = the product of x's leading
    dims (taken as a view where x's strides allow).

    block      32, 64, 128, or None / K (one block per row: per token).
    symmetric  False (default): lo = min(block, 0), hi = max(block, 0), scale = (hi - lo) / 255, zero point
               z = clamp(rint(-128 - lo / scale), -128, 127), codes q = clamp(rint(x / scale) + z, -128, 127);
               True: scale = max|x| / 127, q = clamp(rint(x / scale), -127, 127), zero None. Every step is one fp32
               operation rounded to nearest even, the division by the scale a multiplication by its fp32 reciprocal
               (include/tessera/w8a8.h states the rule op by op); a block of zeros gets scale 1.
    sums       True (default): also the code sums (what a GEMM with a zero-point weight needs); False: sums None.
    out        an Int8Blocks of preallocated tensors to write into (empty_blocks(rows, K, block, ...)); its zero and
               sums must be present exactly when symmetric is False and sums is True. Nothing is allocated then.
    stream     None (the current stream), a torch.cuda.Stream or a raw cudaStream_t int.
    The planes' padding columns (rows..ld-1) are left as allocated. Returns the Int8Blocks.
    """
    # The eager fast path (_dlpack.fast_entry): one crossing into C++, which checks out= or allocates. It takes -1 for
    # "one block per row", so a block it could misread (not a positive int) goes to the checked path, which names it.
    entry = fast_entry(stream)
    if entry is not None and (out is None or type(out) is Int8Blocks) and \
            (block is None or (type(block) is int and block > 0)):
        try:
            res = entry.w8a8_quantize_eager(x, -1 if block is None else block, bool(symmetric), bool(sums), out)
            return out if res is None else Int8Blocks(*res)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _quantize_per_block_checked(x, block, symmetric, sums, out, stream)


def _quantize_per_block_checked(x, block, symmetric, sums, out, stream):
    """quantize_per_block's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.quantize_per_block"
    torch = torch_module()
    ops = torch_ops()
    x = as_tensor(x, op, "x")
    if not (x.is_cuda or x.is_meta):  # meta tensors: the operator's fake implementation
        cuda_device_of(x, op, "x")
    if x.dim() < 1:
        raise ValueError(f"{op}: 'x' must be [..., K], got a scalar")
    k = x.shape[-1]
    if k <= 0 or k % 16:
        raise ValueError(f"{op}: 'x' must have K (its last dim) a positive multiple of 16, got shape {list(x.shape)}")
    block = _block(op, block, k)
    symmetric, sums = bool(symmetric), bool(sums)
    if out is not None:
        _blocks_arg(op, "out", out)
        if out.block != block:
            raise ValueError(f"{op}: 'out' must have block {block}, got {out.block}")
        if (out.zero is None) != symmetric:
            raise ValueError(f"{op}: 'out' must {'not ' if symmetric else ''}hold zero points "
                             f"(symmetric={symmetric})")
        if (out.sums is not None) != sums:
            raise ValueError(f"{op}: 'out' must {'' if sums else 'not '}hold sums (sums={sums})")

    def run():
        x2 = x.reshape(-1, k)
        res = out
        if res is None:
            m = x2.shape[0]
            planes = (k // block, param_ld(m))

            def plane():
                return torch.empty(planes, dtype=torch.float32, device=x.device)

            res = Int8Blocks(torch.empty((m, k), dtype=torch.int8, device=x.device), plane(),
                             None if symmetric else plane(), plane() if sums else None, block)
        ops.w8a8_quantize(x2, res.codes, res.scale, res.zero, res.sums, block)
        return res

    return run() if stream is None else launch(stream_arg(op, stream, x.device), run)


def gemm_w8a8(a, w, bias=None, *, activation=None, clamp=None, out_dtype=None, out_scale=None, out=None,
              workspace=None, stream=None):
    """y [M, N] = clamp(dequantize(a) @ dequantize(w).T + bias) from the quantized activations `a` (quantize_per_block:
    [M, K]) and weight `w` (prepack_w8a8(...).cuda(): [N, K]), on the same GPU, with the same block.

    Each block's products are exact int32 sums on the int8 tensor cores, corrected for the zero points in integers
    and scaled in fp32 (include/tessera/w8a8.h); a has to carry sums when w has zero points, and w when a has them.
    bias        float32 [N] on the GPU, or None.
    activation  None | 'relu' (clamp to [0, inf)) | 'relu6' ([0, 6]).
    clamp       (min, max) or None; either end may be None. With an activation, the intersection of both ranges.
    out_dtype   torch.bfloat16 (default), torch.float16, torch.float32, or torch.int8: y = clamp(rint(v * out_scale),
                -128, 127) with v after bias and clamp (the next W8A8 layer's codes, out_scale its inverse scale).
                None with out= given: out's dtype.
    out_scale   a positive float for an int8 y; None otherwise.
    out         y [M, N] to write into (unit stride along N), default torch.empty.
    workspace   a contiguous device tensor of at least workspace_bytes(M, w) bytes, or None (the operator allocates it
                through torch's caching allocator on the stream it runs on when the call needs one).
    stream      None (the current stream), a torch.cuda.Stream or a raw cudaStream_t int.
    Returns y.
    """
    op = "tessera.gemm_w8a8"
    if type(a) is Int8Blocks and type(w) is Int8Blocks:
        entry = fast_entry(stream)
        if entry is not None:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            if activation is None and clamp is None and out_dtype is None and out_scale is None:
                lo, hi, scale, dtype_name = -_INF, _INF, 1.0, ""  # "": y of out's float dtype, else bfloat16
            else:
                torch = torch_module()
                lo, hi = _epilogue(op, activation, clamp)
                out = as_optional_tensor(out, op, "out")
                _, dtype_name, scale = _out_kind(op, torch, out_dtype, out_scale, out, torch.bfloat16)
            try:  # a and w cross as the tuples they are (C++ unpacks them and compares their blocks)
                return entry.gemm_w8a8_eager(a, w, bias, out, workspace, lo, hi, scale, dtype_name)
            except TypeError as e:
                if FALLBACK not in str(e):
                    raise
    lo, hi = _epilogue(op, activation, clamp)
    return _gemm_w8a8_checked(a, w, bias, lo, hi, out_dtype, out_scale, out, workspace, stream)


def _gemm_w8a8_checked(a, w, bias, lo, hi, out_dtype, out_scale, out, workspace, stream):
    """gemm_w8a8's checked path: the arguments checked here, then torch_ops()' gemm_w8a8 (the registered operator
    under torch.compile or a dispatch mode)."""
    op = "tessera.gemm_w8a8"
    torch = torch_module()
    _blocks_arg(op, "a", a)
    _blocks_arg(op, "w", w)
    if a.block != w.block:
        raise ValueError(f"{op}: 'w' must have a's block ({a.block}), got block {w.block}")
    out = as_optional_tensor(out, op, "out")
    dtype, _, scale = _out_kind(op, torch, out_dtype, out_scale, out, torch.bfloat16)
    ops = torch_ops()
    bias = as_optional_tensor(bias, op, "bias")
    workspace = as_optional_tensor(workspace, op, "workspace")
    if not (a.codes.is_cuda or a.codes.is_meta):
        cuda_device_of(a.codes, op, "a.codes")
    if a.codes.dim() != 2 or w.codes.dim() != 2:
        _rank(op, "a.codes", a.codes, 2, "[M, K]")
        _rank(op, "w.codes", w.codes, 2, "[N, K]")
    m, n = a.codes.shape[0], w.codes.shape[0]
    if out is not None and tuple(out.shape) != (m, n):
        raise ValueError(f"{op}: 'out' must be [M, N] = {[m, n]}, got shape {list(out.shape)}")

    def run():
        y = out if out is not None else torch.empty((m, n), dtype=dtype, device=a.codes.device)
        ops.gemm_w8a8(a.codes, a.scale, a.zero, a.sums, w.codes, w.scale, w.zero, w.sums, bias, y, workspace, a.block,
                      lo, hi, scale)
        return y

    return run() if stream is None else launch(stream_arg(op, stream, a.codes.device), run)


def linear_w8a8(x, w, bias=None, *, symmetric=False, activation=None, clamp=None, out_dtype=None, out_scale=None,
                out=None, a_out=None, workspace=None, stream=None):
    """y [..., N] = gemm_w8a8(quantize_per_block(x, w.block, symmetric), w, bias, ...): a W8A8 linear layer in two
    launches, x [..., K] bf16 | fp16 | fp32 on the GPU and w an Int8Blocks weight there (prepack_w8a8(...).cuda()).

    symmetric  the activations' quantization (False, default: with zero points); their code sums are computed only
               when w has zero points.
    out_dtype  y's dtype: default x's (or out's); torch.int8 with out_scale as in gemm_w8a8.
    out        y [..., N] (x's leading dims) to write into, viewable as [M, N]; default torch.empty.
    a_out      an Int8Blocks for x's quantization (empty_blocks(M, K, w.block, symmetric=..., sums=w.zero is not
               None)): with out= and workspace= too, nothing is allocated at all. Default: allocated per call.
    bias, activation, clamp, out_scale, workspace, stream: as gemm_w8a8's.
    Returns y.
    """
    op = "tessera.linear_w8a8"
    _blocks_arg(op, "w", w)
    x = as_tensor(x, op, "x")
    out = as_optional_tensor(out, op, "out")
    k, n = w.codes.shape[1], w.codes.shape[0]
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: 'x' must be [..., K] with K = {k}, got shape {list(x.shape)}")
    lead = tuple(x.shape[:-1])
    y2 = None
    if out is not None:
        if tuple(out.shape) != lead + (n,):
            raise ValueError(f"{op}: 'out' must be [..., N] = {list(lead + (n,))}, got shape {list(out.shape)}")
        try:
            y2 = out if out.dim() == 2 else out.view(-1, n)
        except RuntimeError:
            raise ValueError(f"{op}: 'out' must be viewable as [M, N] (M = the product of x's leading dims), "
                             f"got strides {list(out.stride())}") from None
    elif out_dtype is None:
        out_dtype = x.dtype
    # The GEMM's own arguments are checked before the quantizer launches (what only the GEMM's C++ checks can tell,
    # it tells after the quantizer ran, into a_out or a fresh tensor).
    _epilogue(op, activation, clamp)
    _out_kind(op, torch_module(), out_dtype, out_scale, y2, None)
    if w.codes.device != x.device:
        raise ValueError(f"{op}: 'w' must be on x's device ({x.device}), got {w.codes.device} "
                         f"(prepack_w8a8(...).to(device))")
    bias = as_optional_tensor(bias, op, "bias")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != torch_module().float32
                             or bias.device != x.device):
        raise ValueError(f"{op}: 'bias' must be float32 [N] = [{n}] on x's device ({x.device}), got "
                         f"{bias.dtype} {list(bias.shape)} on {bias.device}")
    sums = w.zero is not None
    if a_out is not None:
        _blocks_arg(op, "a_out", a_out)
        if sums and a_out.sums is None:
            raise ValueError(f"{op}: 'a_out' must hold sums: the weight has zero points")
        sums = a_out.sums is not None
    a = quantize_per_block(x, w.block, symmetric, sums=sums, out=a_out, stream=stream)
    y = gemm_w8a8(a, w, bias, activation=activation, clamp=clamp, out_dtype=out_dtype, out_scale=out_scale, out=y2,
                  workspace=workspace, stream=stream)
    return out if out is not None else y.view(lead + (n,))


@functools.lru_cache(maxsize=256)
def _workspace_query(device_index, max_m, n, k, block):
    return int(_C.gemm_w8a8_workspace_bytes(max_m, n, k, block))


def workspace_bytes(max_m, w):
    """Bytes of device workspace gemm_w8a8 (and linear_w8a8) needs for up to max_m rows of activations with the weight
    `w` (an Int8Blocks; on the GPU, the size depends on its SM count), 0 when none. The operator allocates it when not
    given; pass workspace= of this size (and out=) to capture with no allocation. The size never depends on the
    values, so one workspace serves every call and replay up to max_m rows. Answers are cached per (device, max_m,
    N, K, block)."""
    op = "tessera.w8a8.workspace_bytes"
    torch = torch_module()
    _blocks_arg(op, "w", w)
    max_m = _int(op, "max_m", max_m, 0)
    n, k = w.codes.shape[0], w.codes.shape[1]
    device = w.codes.device
    if device.type != "cuda":  # the current device's answer, not cached: it may change
        return int(_C.gemm_w8a8_workspace_bytes(max_m, n, k, w.block))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _on_device(torch, device, lambda: _workspace_query(index, max_m, n, k, w.block))
