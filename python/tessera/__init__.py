"""tessera — CUDA kernels for MoE routing and whole MoE layers, grouped expert GEMMs, attention prefill and decode,
weight-only quantized linear layers and conv2d, and W8A8 (int8 x int8) linear layers, callable from PyTorch.

    import tessera
    weights, ids = tessera.fused_gate(logits, bias, topk=8, num_groups=8, topk_groups=4,
                                      renormalize=True, routed_scaling_factor=2.5)
    p = tessera.permute(x, ids, num_experts=256, quant="fp8_blockwise")
    y_perm = tessera.grouped_gemm_fp8(p.x_perm, w, p.expert_offsets, p.scales, w_scale, scale_mode="blockwise")
    y = tessera.unpermute_reduce(y_perm, p.row_index, weights)

    tessera.append_kv(k_new, v_new, positions, k_cache, v_cache, format="int8", k_scale=ks, v_scale=vs)
    o = tessera.attention_decode(q, k_cache, v_cache, seqlens, format="int8", k_scale=ks, v_scale=vs)
    o = tessera.prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=True)

    packed = tessera.linear.prepack(tessera.linear.quantize(w, bits=4, block=128)).cuda()
    y = tessera.linear.linear(x, packed, bias, activation="relu")

    wc = tessera.conv.quantize_weight(layer.weight, bits=4, block=64).cuda()     # an nn.Conv2d's weight
    y = tessera.conv2d(x, wc, layer.bias, stride=1, padding=1, activation="relu")  # NCHW or channels_last x

    w8 = tessera.prepack_w8a8(w, block=128).cuda()
    y = tessera.linear_w8a8(x, w8, bias, activation="relu")   # quantize_per_block(x) + gemm_w8a8(a, w8, bias)

    cfg = tessera.MoeLayerConfig(hidden=7168, intermediate=2048, num_experts=256, topk=8, num_groups=8,
                                 topk_groups=4, renormalize=True, routed_scaling_factor=2.5, num_shared_experts=1)
    plan = tessera.moe_layer.plan(cfg, max_tokens=4096)         # validates; sizes the workspace
    y = tessera.moe_layer.moe_layer(x, router_logits, layer_weights, plan, correction_bias=bias)   # the whole layer

The ops live in tessera.moe, tessera.gemm, tessera.attention, tessera.linear, tessera.conv, tessera.w8a8 and
tessera.moe_layer; those of the first three, tessera.conv's conv2d and tessera.w8a8's are re-exported here
(tessera.linear's and tessera.moe_layer's ops keep their module's name: tessera.linear.linear,
tessera.moe_layer.moe_layer; tessera.moe_layer's config, plan and weight classes are re-exported).
They take torch tensors (or any DLPack producer), run on the current CUDA stream (or stream=), take out= (and
workspace=) to write into preallocated memory, raise ValueError for invalid arguments and RuntimeError for
CUDA/device errors.
Each is a PyTorch custom operator underneath (torch.ops.tessera.*, defined in tessera._torch_ops), so
torch.compile(fullgraph=True) traces them and CUDA graphs capture them.

Where torch is installed, importing tessera imports it and registers the operators; where it is not, tessera still
imports, and tessera.dlpack serves DLPack callers (CuPy, JAX) with no torch at all.
"""

try:
    from . import _C
except ImportError as _e:  # pragma: no cover - depends on the build
    raise ImportError(
        "tessera: the compiled extension tessera._C could not be imported "
        f"({_e}). Build it with `cmake -S . -B build && cmake --build build` and set "
        "PYTHONPATH=build/python, or `pip install --no-build-isolation .`") from _e

try:
    import torch as _torch  # noqa: F401  (optional: the operators need it, tessera.dlpack does not)
except ImportError:
    _torch = None
if _torch is not None:
    from . import _dlpack, _torch_ops  # registers torch.ops.tessera.*

    _dlpack.bind_ops(_torch_ops)

from . import attention, conv, dlpack, gemm, linear, moe, moe_layer, w8a8
from .attention import (
    append_kv,
    attention_decode,
    decode_workspace_size,
    dequantize_kv,
    prefill,
    prefill_varlen,
    prefill_with_cache,
)
from .conv import ConvWeight, conv2d
from .gemm import (
    gemm_fp8,
    grouped_gemm_bf16,
    grouped_gemm_bf16_masked,
    grouped_gemm_fp8,
    grouped_gemm_fp8_masked,
    grouped_gemm_workspace_bytes,
)
from .linear import PackedLinearWeight, QuantizedLinearWeight
from .moe import (
    PermuteResult,
    fused_gate,
    permute,
    permute_capacity_rows,
    permute_workspace_bytes,
    unpermute_reduce,
)
from .moe_layer import MoeLayerConfig, MoeLayerPlan, MoeLayerWeights
from .w8a8 import Int8Blocks, gemm_w8a8, linear_w8a8, prepack_w8a8, quantize_per_block

version = _C.version
__version__ = _C.version

__all__ = [
    "ConvWeight",
    "Int8Blocks",
    "MoeLayerConfig",
    "MoeLayerPlan",
    "MoeLayerWeights",
    "PackedLinearWeight",
    "PermuteResult",
    "QuantizedLinearWeight",
    "append_kv",
    "attention",
    "attention_decode",
    "conv",
    "conv2d",
    "decode_workspace_size",
    "dequantize_kv",
    "dlpack",
    "fused_gate",
    "gemm",
    "gemm_w8a8",
    "grouped_gemm_bf16",
    "grouped_gemm_bf16_masked",
    "gemm_fp8",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_masked",
    "grouped_gemm_workspace_bytes",
    "linear",
    "linear_w8a8",
    "moe",
    "moe_layer",
    "permute",
    "permute_capacity_rows",
    "permute_workspace_bytes",
    "prefill",
    "prefill_varlen",
    "prefill_with_cache",
    "prepack_w8a8",
    "quantize_per_block",
    "unpermute_reduce",
    "version",
    "w8a8",
]
