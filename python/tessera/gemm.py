"""tessera.gemm — grouped GEMM for MoE experts: fp8 e4m3 (per-tensor or block-wise scales) or bf16 in, bf16 out.

G independent products ``Y_g = X_g @ W_g^T`` in one launch (C++: include/tessera/grouped_gemm.h). Two layouts:

* contiguous: x [M, K], offsets int32 [G+1]; group g owns rows offsets[g]:offsets[g+1] of x and of the output
  y [M, N]. This is what tessera.moe.permute produces (x_perm, expert_offsets).
* masked: x [G, max_m, K], masked_m int32 [G]; group g owns rows 0:masked_m[g] of x[g] and y[g] ([G, max_m, N]).

w is [G, N, K] (one nn.Linear weight per expert). Output rows that belong to no group are not written (with
``out=None`` they hold whatever torch.empty left there). Group sizes are read on the device only: offsets are
clamped to [0, M] (a decreasing pair is an empty group), masked_m to [0, max_m].

Like tessera.moe, every op accepts torch tensors (or ``__dlpack__`` producers), runs asynchronously on the
current CUDA stream of x's device, never synchronizes, can be captured in a CUDA graph, and raises ValueError
naming the op and the argument for invalid arguments (the output tensor is called 'y' in messages from the C++
validation). fp8 tensors must be torch.float8_e4m3fn. Every op also takes workspace= and stream= (see
grouped_gemm_fp8).
"""

from . import _C
from ._dlpack import (E4M3, FALLBACK, FP8_DTYPES, as_tensor, cuda_device_of, fast_entry, launch, stream_arg,
                      torch_module, torch_ops)
from .moe import _choice, _int, _rank

__all__ = [
    "gemm_fp8",
    "grouped_gemm_bf16",
    "grouped_gemm_bf16_masked",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_masked",
    "grouped_gemm_workspace_bytes",
]

SCALE_MODES = ("per_tensor", "blockwise")
BLOCK = _C.grouped_gemm_block  # 128: the K (and N) block of one block-wise scale; N and K granularity for fp8
MAX_GROUPS = _C.grouped_gemm_max_groups


def grouped_gemm_workspace_bytes(num_groups, n, k):
    """Bytes of device workspace a grouped GEMM with these G, N, K needs (allocated by the op when not given)."""
    op = "tessera.grouped_gemm_workspace_bytes"
    return _C.grouped_gemm_workspace_bytes(_int(op, "num_groups", num_groups), _int(op, "n", n), _int(op, "k", k))


def _fp8(torch, op, arg, t):
    # The operator reads uint8 as e4m3 bytes (the DLPack path's convention), so the torch layer insists on the
    # real dtype: an e5m2 or a plain uint8 tensor would otherwise be reinterpreted silently.
    if E4M3 is None or t.dtype != E4M3:
        raise ValueError(f"{op}: '{arg}' must be torch.float8_e4m3fn, got {t.dtype}")


def _not_fp8(torch, op, arg, t):
    # The C++ message would name the fp8 dtype too; this one says what the op takes.
    if t.element_size() == 1 and t.is_floating_point():
        raise ValueError(f"{op}: '{arg}' must be torch.bfloat16, got {t.dtype}")


def _run(op, masked, rows_arg, x, w, group_rows, out, workspace, stream, fp8, call):
    """Shared argument handling; launches call(ops, x, w, group_rows, y, workspace), returns y.
    Each check runs its slow path (with the message) only when the fast test fails: this is every eager call."""
    torch = torch_module()
    ops = torch_ops()
    x = as_tensor(x, op, "x")
    w = as_tensor(w, op, "w")
    group_rows = as_tensor(group_rows, op, rows_arg)
    if workspace is not None:
        workspace = as_tensor(workspace, op, "workspace")
    if not x.is_cuda:
        cuda_device_of(x, op, "x")
    if fp8:
        if x.dtype != E4M3 or w.dtype != E4M3:
            _fp8(torch, op, "x", x)
            _fp8(torch, op, "w", w)
    elif x.dtype in FP8_DTYPES or w.dtype in FP8_DTYPES:
        _not_fp8(torch, op, "x", x)
        _not_fp8(torch, op, "w", w)
    if x.dim() != (3 if masked else 2):
        _rank(op, "x", x, 3, "[G, max_m, K]") if masked else _rank(op, "x", x, 2, "[M, K]")
    if w.dim() != 3:
        _rank(op, "w", w, 3, "[G, N, K]")
    if out is not None:
        out = as_tensor(out, op, "out")
        if out.dtype in FP8_DTYPES:
            _not_fp8(torch, op, "out", out)

    def run():
        y = out
        if y is None:
            y = torch.empty((*x.shape[:-1], w.shape[1]), dtype=torch.bfloat16, device=x.device)
        call(ops, x, w, group_rows, y, workspace)
        return y

    return run() if stream is None else launch(stream_arg(op, stream, x.device), run)


def _fp8_op(op, masked, rows_arg, x, w, group_rows, x_scale, w_scale, scale_mode, out, expected_m, workspace,
            stream):
    entry = fast_entry(stream)
    if entry is not None and type(expected_m) is int and expected_m >= 0 and type(scale_mode) is str and \
            scale_mode in SCALE_MODES:
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++ (checks, y allocated there, launch)
            return entry.grouped_gemm_eager(x, w, group_rows, x_scale, w_scale, out, workspace, masked, True,
                                            scale_mode, expected_m)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _fp8_checked(op, masked, rows_arg, x, w, group_rows, x_scale, w_scale, scale_mode, out, expected_m,
                        workspace, stream)


def _fp8_checked(op, masked, rows_arg, x, w, group_rows, x_scale, w_scale, scale_mode, out, expected_m, workspace,
                 stream):
    """The FP8 grouped GEMMs' checked path (a closure here would cost its cells on the fast path's every call)."""
    if scale_mode not in SCALE_MODES or type(expected_m) is not int or expected_m < 0:
        _choice(op, "scale_mode", scale_mode, SCALE_MODES)
        expected_m = _int(op, "expected_m", expected_m, 0)
    x_scale = as_tensor(x_scale, op, "x_scale")
    w_scale = as_tensor(w_scale, op, "w_scale")
    fn_name = "grouped_gemm_fp8_masked" if masked else "grouped_gemm_fp8"

    def call(ops, x, w, group_rows, y, workspace):
        getattr(ops, fn_name)(x, w, group_rows, x_scale, w_scale, y, workspace, scale_mode, expected_m)

    return _run(op, masked, rows_arg, x, w, group_rows, out, workspace, stream, True, call)


def _bf16_op(op, masked, rows_arg, x, w, group_rows, out, expected_m, workspace, stream):
    entry = fast_entry(stream)
    if entry is not None and type(expected_m) is int and expected_m >= 0:
        try:  # the eager fast path (_dlpack.fast_entry)
            return entry.grouped_gemm_eager(x, w, group_rows, None, None, out, workspace, masked, False,
                                            "per_tensor", expected_m)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _bf16_checked(op, masked, rows_arg, x, w, group_rows, out, expected_m, workspace, stream)


def _bf16_checked(op, masked, rows_arg, x, w, group_rows, out, expected_m, workspace, stream):
    """The bf16 grouped GEMMs' checked path."""
    if type(expected_m) is not int or expected_m < 0:
        expected_m = _int(op, "expected_m", expected_m, 0)
    fn_name = "grouped_gemm_bf16_masked" if masked else "grouped_gemm_bf16"

    def call(ops, x, w, group_rows, y, workspace):
        getattr(ops, fn_name)(x, w, group_rows, y, workspace, expected_m)

    return _run(op, masked, rows_arg, x, w, group_rows, out, workspace, stream, False, call)


def grouped_gemm_fp8(x, w, offsets, x_scale, w_scale, *, scale_mode="per_tensor", out=None, expected_m=0,
                     workspace=None, stream=None):
    """FP8 e4m3 grouped GEMM, contiguous layout: y[r] = x[r] @ w[g]^T (scaled) for r in offsets[g]:offsets[g+1].

    x        [M, K] float8_e4m3fn; unit stride along K, rows 16-byte aligned (e.g. tessera.permute's x_perm).
    w        [G, N, K] float8_e4m3fn; unit stride along K. N and K multiples of 128; 1 <= G <= 1024.
    offsets  int32 [G+1] on the device (e.g. permute's expert_offsets); read on the device only.
    scale_mode='per_tensor': x_scale fp32 [1], w_scale fp32 [G]; y = x_scale * w_scale[g] * (x @ w[g]^T).
    scale_mode='blockwise' (DeepSeek-V3): x_scale fp32 [M, K/128], one per row and 128 columns (permute's
        scales with quant='fp8_blockwise'); w_scale fp32 [G, N/128, K/128], one per 128x128 weight block
        (a checkpoint's weight_scale_inv). Scales may have any strides.
    out      bf16 [M, N] (unit stride along N) to write into; default torch.empty. Rows outside every group
             are not written.
    expected_m  deprecated and ignored (validated: an int >= 0): the kernel chooses each group's tile shape on
                the device from its row count (docs/ops/grouped_gemm.md).
    workspace   device tensor of at least grouped_gemm_workspace_bytes(G, N, K) bytes, or None (allocated when
                needed; the size is 0 today). stream: None (the current stream), a torch.cuda.Stream or an int.
    Returns y (bf16 [M, N], fp32 accumulation).
    """
    return _fp8_op("tessera.grouped_gemm_fp8", False, "offsets", x, w, offsets, x_scale, w_scale, scale_mode, out,
                   expected_m, workspace, stream)


def gemm_fp8(x, w, x_scale, w_scale, *, scale_mode="per_tensor", out=None, workspace=None, stream=None):
    """Dense FP8 e4m3 GEMM, y = x @ w^T (scaled): the grouped GEMM with one group (C++: tessera::gemm::gemm_fp8).

    x [M, K], w [N, K] float8_e4m3fn, rules as grouped_gemm_fp8's x and one group of its w.
    scale_mode='per_tensor': x_scale fp32 [1], w_scale fp32 [1].
    scale_mode='blockwise' (DeepSeek-V3 checkpoints): x_scale fp32 [M, K/128], w_scale fp32 [N/128, K/128]
        (weight_scale_inv), any strides.
    The group's offsets {0, M} are made on the device (no host synchronization; capturable in a CUDA graph).
    Returns y (bf16 [M, N], fp32 accumulation). Torch tensors only.
    """
    op = "tessera.gemm_fp8"
    torch = torch_module()
    if torch is None or not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: takes torch tensors (the DLPack path has grouped_gemm_fp8 with one group)")
    _choice(op, "scale_mode", scale_mode, SCALE_MODES)
    _rank(op, "x", x, 2, "[M, K]")
    _rank(op, "w", w, 2, "[N, K]")
    if scale_mode == "blockwise":
        _rank(op, "w_scale", w_scale, 2, "[N/128, K/128]")
        w_scale = w_scale.unsqueeze(0)
    else:
        if w_scale.numel() != 1:
            raise ValueError(f"{op}: 'w_scale' must hold one value (per_tensor), got shape {list(w_scale.shape)}")
        w_scale = w_scale.reshape(1)
    # The one group's offsets {0, M}, made on the stream the GEMM runs on (made on the current stream, a stream=
    # GEMM could read them before they were written, and their block could be reused while it still read them).
    stream = stream_arg(op, stream, x.device)
    if stream is None:  # (no stream context at all then: torch.compile traces this path)
        offsets = torch.arange(2, device=x.device, dtype=torch.int32) * x.shape[0]
    else:
        with torch.cuda.stream(stream):
            offsets = torch.arange(2, device=x.device, dtype=torch.int32) * x.shape[0]
    return _fp8_op(op, False, "offsets", x, w.unsqueeze(0), offsets, x_scale, w_scale, scale_mode, out, 0, workspace,
                   stream)


def grouped_gemm_fp8_masked(x, w, masked_m, x_scale, w_scale, *, scale_mode="per_tensor", out=None, expected_m=0,
                            workspace=None, stream=None):
    """FP8 e4m3 grouped GEMM, masked layout: y[g, r] = x[g, r] @ w[g]^T (scaled) for r < masked_m[g].

    x        [G, max_m, K] float8_e4m3fn; w [G, N, K] float8_e4m3fn; masked_m int32 [G] on the device.
    Scales as in grouped_gemm_fp8, except block-wise x_scale is [G, max_m, K/128].
    out      bf16 [G, max_m, N]; rows r >= masked_m[g] are not written.
    expected_m  deprecated and ignored, as in grouped_gemm_fp8.
    Returns y (bf16 [G, max_m, N]).
    """
    return _fp8_op("tessera.grouped_gemm_fp8_masked", True, "masked_m", x, w, masked_m, x_scale, w_scale,
                   scale_mode, out, expected_m, workspace, stream)


def grouped_gemm_bf16(x, w, offsets, *, out=None, expected_m=0, workspace=None, stream=None):
    """bf16 grouped GEMM, contiguous layout: y[r] = x[r] @ w[g]^T for r in offsets[g]:offsets[g+1].

    x [M, K] bf16, w [G, N, K] bf16 (unit stride along K, rows 16-byte aligned), offsets int32 [G+1] on the
    device. N a multiple of 128, K a multiple of 64. fp32 accumulation. out bf16 [M, N]; rows outside every
    group are not written. Returns y.
    """
    return _bf16_op("tessera.grouped_gemm_bf16", False, "offsets", x, w, offsets, out, expected_m, workspace,
                    stream)


def grouped_gemm_bf16_masked(x, w, masked_m, *, out=None, expected_m=0, workspace=None, stream=None):
    """bf16 grouped GEMM, masked layout: y[g, r] = x[g, r] @ w[g]^T for r < masked_m[g].

    x [G, max_m, K] bf16, w [G, N, K] bf16, masked_m int32 [G] on the device; out bf16 [G, max_m, N], rows
    r >= masked_m[g] are not written. Returns y.
    """
    return _bf16_op("tessera.grouped_gemm_bf16_masked", True, "masked_m", x, w, masked_m, out, expected_m,
                    workspace, stream)
