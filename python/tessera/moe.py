"""tessera.moe — MoE routing ops: the fused grouped top-k gate, token permute and unpermute-reduce.

Thin wrappers over the PyTorch operators torch.ops.tessera.* (python/tessera/_torch_ops.py; the C++ library,
include/tessera/moe.h). Every op

* accepts torch tensors, or any object with ``__dlpack__`` (converted zero-copy with torch.from_dlpack);
* runs asynchronously on the caller's current CUDA stream of the device of its first tensor argument (or on
  ``stream=``), never synchronizes, and can be captured in a CUDA graph and traced by torch.compile
  (fullgraph=True: no graph break);
* allocates its outputs with torch (``torch.empty``) on that device unless ``out=`` is given, and its workspace
  unless ``workspace=`` is given;
* raises ValueError (naming the op and the argument) for invalid arguments, and RuntimeError for CUDA or device
  errors (no driver, not an sm_90 GPU).
"""

import collections
import operator

from . import _C
from ._dlpack import (FALLBACK, as_optional_tensor, as_tensor, cuda_device_of, fast_entry, launch, stream_arg,
                      torch_module, torch_ops)

__all__ = [
    "PermuteResult",
    "fused_gate",
    "permute",
    "permute_capacity_rows",
    "permute_workspace_bytes",
    "unpermute_reduce",
]

SCORINGS = ("sigmoid", "softmax")
GROUP_SCORES = ("top2_sum", "max")
QUANTS = (None, "none", "fp8_blockwise", "fp8_per_tensor")
FP8_BLOCK_COLS = 128

PermuteResult = collections.namedtuple(
    "PermuteResult", ["x_perm", "scales", "expert_offsets", "expert_counts", "row_index", "row_token"])
_NO_OUT = (None,) * 6
PermuteResult.__doc__ = """Outputs of tessera.moe.permute.

x_perm          [capacity_rows, H]: x's dtype, or torch.float8_e4m3fn when quantized. Rows at or past
                expert_offsets[E] are not written (uninitialized); pad rows inside segments are zero.
scales          fp32 [capacity_rows, ceil(H/128)] for quant='fp8_blockwise' (x ~= x_perm * scale), else None.
expert_offsets  int32 [E+1]: expert e owns rows [offsets[e], offsets[e+1]).
expert_counts   int32 [E]: real (unpadded) rows of expert e.
row_index       int32 [T, k]: row of copy (t, j) in x_perm, -1 where the id was out of [0, E).
row_token       int32 [capacity_rows]: token of each row, -1 for pad rows; None if with_row_token=False.
"""


def _choice(op, arg, value, allowed):
    if not isinstance(value, str) or value not in allowed:
        names = " | ".join(repr(a) for a in allowed)
        raise ValueError(f"{op}: '{arg}' must be one of {names}, got {value!r}")
    return value


def _quant_name(op, quant):
    if quant is not None and (not isinstance(quant, str) or quant not in QUANTS):
        raise ValueError(
            f"{op}: 'quant' must be None, 'fp8_blockwise' or 'fp8_per_tensor', got {quant!r}")
    return "none" if quant is None else quant


def _int(op, arg, value, minimum=None):
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: '{arg}' must be an int, got {type(value).__name__}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{op}: '{arg}' must be >= {minimum}, got {v}")
    return v


def _rank(op, arg, t, rank, what):
    if t.dim() != rank:
        raise ValueError(f"{op}: '{arg}' must have rank {rank} {what}, got shape {list(t.shape)}")


# ----------------------------------------------------------------------------------------------------------------


def fused_gate(logits, bias=None, *, topk, num_groups=1, topk_groups=1, scoring="sigmoid",
               group_score="top2_sum", renormalize=False, routed_scaling_factor=1.0, num_shared_experts=0,
               shared_expert_weight=1.0, out=None, stream=None):
    """DeepSeek-V3 style biased grouped top-k gate.

    scores = sigmoid(logits) | softmax(logits over E); choice = scores + bias; experts are chosen among the
    topk_groups best groups (group score: sum of the 2 best choices, or the best) by descending choice;
    weights = scores[ids] (renormalized to sum 1 if renormalize) * routed_scaling_factor; then
    num_shared_experts slots with ids E..E+s-1 and weight shared_expert_weight. Ties: lower index wins; a NaN
    choice ranks as -inf.

    logits [T, E] fp32 | bf16 | fp16 (unit stride along E); bias [E] or None.
    Returns (weights fp32 [T, topk + s], ids int32 [T, topk + s]); out=(weights, ids) writes into those.
    stream: None (the current stream), a torch.cuda.Stream or a raw cudaStream_t int.
    """
    entry = fast_entry(stream)
    if entry is not None and (out is None or (type(out) in (tuple, list) and len(out) == 2)):
        w_out, ids_out = (None, None) if out is None else out
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            return entry.fused_gate_eager(logits, bias, w_out, ids_out, topk, num_groups, topk_groups, scoring,
                                          group_score, renormalize, routed_scaling_factor, num_shared_experts,
                                          shared_expert_weight)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _fused_gate_checked(logits, bias, topk, num_groups, topk_groups, scoring, group_score, renormalize,
                               routed_scaling_factor, num_shared_experts, shared_expert_weight, out, stream)


def _fused_gate_checked(logits, bias, topk, num_groups, topk_groups, scoring, group_score, renormalize,
                        routed_scaling_factor, num_shared_experts, shared_expert_weight, out, stream):
    """fused_gate's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.fused_gate"
    _choice(op, "scoring", scoring, SCORINGS)
    _choice(op, "group_score", group_score, GROUP_SCORES)
    topk = _int(op, "topk", topk, 1)
    num_groups = _int(op, "num_groups", num_groups)
    topk_groups = _int(op, "topk_groups", topk_groups)
    num_shared_experts = _int(op, "num_shared_experts", num_shared_experts, 0)

    torch = torch_module()
    ops = torch_ops()
    logits = as_tensor(logits, op, "logits")
    if bias is not None:
        bias = as_tensor(bias, op, "bias")
    device = cuda_device_of(logits, op, "logits")
    _rank(op, "logits", logits, 2, "[T, E]")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"{op}: 'out' must be a (weights, ids) pair, got {type(out).__name__}")
        out = (as_tensor(out[0], op, "weights"), as_tensor(out[1], op, "ids"))

    def run():
        if out is None:
            width = topk + num_shared_experts
            weights = torch.empty((logits.shape[0], width), dtype=torch.float32, device=device)
            ids = torch.empty((logits.shape[0], width), dtype=torch.int32, device=device)
        else:
            weights, ids = out
        ops.fused_gate(logits, bias, weights, ids, topk, num_groups, topk_groups, scoring, group_score,
                       bool(renormalize), float(routed_scaling_factor), num_shared_experts,
                       float(shared_expert_weight))
        return weights, ids

    return run() if stream is None else launch(stream_arg(op, stream, device), run)


def _permute_limits(op, num_experts, pad_multiple, topk, topk_name):
    """The op's upper limits (the C++ op's, here too for torch.compile and so that the host queries, whose binding
    takes 32-bit ints, say ValueError rather than pybind's TypeError past 2^31)."""
    for name, value, hi in (("num_experts", num_experts, 1024), ("pad_multiple", pad_multiple, 1 << 16),
                            (topk_name, topk, 32)):
        if value > hi:
            raise ValueError(f"{op}: '{name}' must be in [1, {hi}], got {value}")


def _permute_query(op, fn, num_tokens, topk, num_experts, pad_multiple, quant):
    q = _quant_name(op, quant)
    num_tokens, topk = _int(op, "num_tokens", num_tokens, 0), _int(op, "topk", topk, 1)
    num_experts, pad_multiple = _int(op, "num_experts", num_experts, 1), _int(op, "pad_multiple", pad_multiple, 1)
    _permute_limits(op, num_experts, pad_multiple, topk, "topk")
    return fn(num_tokens, topk, num_experts, pad_multiple, q)


def permute_capacity_rows(num_tokens, topk, num_experts, *, pad_multiple=1, quant=None):
    """Rows of permute's x_perm / scales / row_token: T*k, plus E*(pad_multiple-1) when padding."""
    return _permute_query("tessera.permute_capacity_rows", _C.permute_capacity_rows, num_tokens, topk,
                          num_experts, pad_multiple, quant)


def permute_workspace_bytes(num_tokens, topk, num_experts, *, pad_multiple=1, quant=None):
    """Bytes of device workspace permute needs (permute allocates it itself)."""
    return _permute_query("tessera.permute_workspace_bytes", _C.permute_workspace_bytes, num_tokens, topk,
                          num_experts, pad_multiple, quant)


def permute(x, ids, num_experts, *, pad_multiple=1, quant=None, input_scale=None, with_row_token=True, out=None,
            workspace=None, stream=None):
    """Copies of the token rows grouped by expert (expert 0 first, token order within an expert).

    x [T, H] bf16 | fp16 (H % 8 == 0, rows 16-byte aligned); ids [T, k] int32 | int64, contiguous; ids outside
    [0, E) are dropped. Each expert segment is padded to a multiple of pad_multiple rows (pad rows are zero).
    quant: None (x_perm has x's dtype), 'fp8_blockwise' (x_perm float8_e4m3fn plus fp32 scales, one per row
    per 128 columns) or 'fp8_per_tensor' (x_perm = saturate(x / input_scale), input_scale fp32 [1] on the
    device). Returns a PermuteResult.

    out        a PermuteResult of preallocated tensors to write into (shapes as documented on PermuteResult,
               rows = permute_capacity_rows(...); scales None unless 'fp8_blockwise', row_token may be None).
               Nothing is allocated then but the workspace.
    workspace  a contiguous device tensor of at least permute_workspace_bytes(...) bytes; allocated when None.
               Pass out= and workspace= to capture permute in a CUDA graph with no allocation.
    stream     None (the current stream), a torch.cuda.Stream or a raw cudaStream_t int.
    """
    entry = fast_entry(stream)
    if entry is not None and (out is None or type(out) is PermuteResult):
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            return PermuteResult(*entry.permute_eager(x, ids, num_experts, pad_multiple,
                                                   "none" if quant is None else quant, input_scale, with_row_token,
                                                   workspace, out is not None, *(out if out is not None else _NO_OUT)))
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _permute_checked(x, ids, num_experts, pad_multiple, quant, input_scale, with_row_token, out, workspace,
                            stream)


def _permute_checked(x, ids, num_experts, pad_multiple, quant, input_scale, with_row_token, out, workspace, stream):
    """permute's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.permute"
    q = _quant_name(op, quant)
    num_experts = _int(op, "num_experts", num_experts, 1)
    pad_multiple = _int(op, "pad_multiple", pad_multiple, 1)

    torch = torch_module()
    ops = torch_ops()
    x = as_tensor(x, op, "x")
    ids = as_tensor(ids, op, "ids")
    input_scale = as_optional_tensor(input_scale, op, "input_scale")
    workspace = as_optional_tensor(workspace, op, "workspace")
    if not x.is_cuda:
        cuda_device_of(x, op, "x")
    if x.dim() != 2 or ids.dim() != 2:
        _rank(op, "x", x, 2, "[T, H]")
        _rank(op, "ids", ids, 2, "[T, k]")
    num_tokens, hidden = x.shape
    topk = ids.shape[1]
    if topk < 1:
        raise ValueError(f"{op}: 'ids' must have at least one column, got shape {list(ids.shape)}")
    # The op's limits, before its outputs are allocated (a huge pad_multiple would ask for the memory first).
    _permute_limits(op, num_experts, pad_multiple, topk, "ids.shape[1] (topk)")
    if out is not None:
        if not isinstance(out, PermuteResult):
            raise ValueError(f"{op}: 'out' must be a tessera.PermuteResult of preallocated tensors, "
                             f"got {type(out).__name__}")
        for t in out:
            if t is not None and not isinstance(t, torch.Tensor):  # a DLPack producer among them: convert all
                out = PermuteResult(*(as_optional_tensor(t, op, name) for t, name in zip(out, PermuteResult._fields)))
                break
        if out.x_perm.dtype == getattr(torch, "float8_e5m2", None):
            raise ValueError(f"{op}: 'x_perm' must be torch.float8_e4m3fn when quantized, got {out.x_perm.dtype}")
    device = x.device

    def run():
        res = out
        if res is None:
            # permute_capacity_rows: every copy, plus the padding each segment may need.
            rows = num_tokens * topk + (num_experts * (pad_multiple - 1) if pad_multiple > 1 else 0)
            dtype = x.dtype if q == "none" else torch.float8_e4m3fn
            scales = None
            if q == "fp8_blockwise":
                blocks = (hidden + FP8_BLOCK_COLS - 1) // FP8_BLOCK_COLS
                scales = torch.empty((rows, blocks), dtype=torch.float32, device=device)
            res = PermuteResult(
                torch.empty((rows, hidden), dtype=dtype, device=device), scales,
                torch.empty((num_experts + 1,), dtype=torch.int32, device=device),
                torch.empty((num_experts,), dtype=torch.int32, device=device),
                torch.empty((num_tokens, topk), dtype=torch.int32, device=device),
                torch.empty((rows,), dtype=torch.int32, device=device) if with_row_token else None)
        ops.permute(x, ids, input_scale, res.x_perm, res.scales, res.expert_offsets, res.expert_counts,
                    res.row_index, res.row_token, workspace, num_experts, pad_multiple, q)
        return res

    return run() if stream is None else launch(stream_arg(op, stream, device), run)


def unpermute_reduce(y_perm, row_index, weights, residual=None, routed_scale=1.0, out=None, *, stream=None):
    """out[t] = routed_scale * sum_j weights[t, j] * y_perm[row_index[t, j]] (+ residual[t]).

    y_perm [R, H] bf16 | fp16; row_index [T, k] int32 (-1 = skip); weights [T, k] fp32; residual [T, H] of
    y_perm's dtype or None. fp32 accumulation. Returns out [T, H] of y_perm's dtype (or writes into `out`).
    stream: None (the current stream), a torch.cuda.Stream or a raw cudaStream_t int.
    """
    entry = fast_entry(stream)
    if entry is not None:
        try:  # the eager fast path (_dlpack.fast_entry): one crossing into C++
            return entry.unpermute_reduce_eager(y_perm, row_index, weights, residual, routed_scale, out)
        except TypeError as e:
            if FALLBACK not in str(e):
                raise
    return _unpermute_reduce_checked(y_perm, row_index, weights, residual, routed_scale, out, stream)


def _unpermute_reduce_checked(y_perm, row_index, weights, residual, routed_scale, out, stream):
    """unpermute_reduce's checked path: the arguments checked here, then torch_ops()' operator (the registered one
    under torch.compile or a dispatch mode)."""
    op = "tessera.unpermute_reduce"
    torch = torch_module()
    ops = torch_ops()
    y_perm = as_tensor(y_perm, op, "y_perm")
    row_index = as_tensor(row_index, op, "row_index")
    weights = as_tensor(weights, op, "weights")
    residual = as_optional_tensor(residual, op, "residual")
    if not y_perm.is_cuda:
        cuda_device_of(y_perm, op, "y_perm")
    if y_perm.dim() != 2 or row_index.dim() != 2:
        _rank(op, "y_perm", y_perm, 2, "[R, H]")
        _rank(op, "row_index", row_index, 2, "[T, k]")
    if out is not None:
        out = as_tensor(out, op, "out")

    def run():
        o = out
        if o is None:
            o = torch.empty((row_index.shape[0], y_perm.shape[1]), dtype=y_perm.dtype, device=y_perm.device)
        ops.unpermute_reduce(y_perm, row_index, weights, residual, o, float(routed_scale))
        return o

    return run() if stream is None else launch(stream_arg(op, stream, y_perm.device), run)
