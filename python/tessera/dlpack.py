"""tessera.dlpack — the ops for callers without PyTorch (CuPy, JAX, NumPy-on-device ...), through DLPack.

Every function here is the extension's raw entry point (tessera._C): it takes any object with ``__dlpack__`` (or a
DLPack capsule) for each tensor, None for an absent optional tensor, preallocated outputs (nothing is allocated),
the options as plain values, and the stream as a raw ``cudaStream_t`` int (0: the legacy default stream). Objects
are asked for their capsule with no stream argument, i.e. under the producer's default-stream contract: pass the
stream your arrays were produced on (for CuPy, ``cupy.cuda.get_current_stream().ptr``) and make sure that work is
ordered before it. Argument errors raise ValueError, CUDA and device errors RuntimeError, as in the torch layer.
fp8 e4m3 operands may be uint8 arrays of the e4m3 bytes. The weight-only linear layer's host steps (linear_quantize,
linear_import_gptq, linear_import_awq, linear_prepack, linear_unpack) and W8A8's prepack_w8a8 take host arrays and
return a dict whose arrays are bytearrays (numpy.frombuffer views them); tessera.linear and tessera.w8a8 wrap them for
torch.

    import cupy as cp, tessera.dlpack as td
    logits = cp.random.randn(16, 256, dtype=cp.float32)
    weights = cp.empty((16, 8), cp.float32); ids = cp.empty((16, 8), cp.int32)
    td.fused_gate(logits, None, weights, ids, topk=8, num_groups=8, topk_groups=4, scoring="sigmoid",
                  group_score="top2_sum", renormalize=True, routed_scaling_factor=2.5, num_shared_experts=0,
                  shared_expert_weight=1.0, stream=cp.cuda.get_current_stream().ptr)

Argument lists: ``help(tessera.dlpack.<op>)``. This module does not import torch.
"""

from ._C import (
    append_kv,
    attention_decode,
    attention_prefill,
    attention_prefill_varlen,
    attention_prefill_with_cache,
    conv2d,
    conv2d_output_size,
    conv2d_path,
    conv2d_workspace_bytes,
    conv_path_name,
    decode_workspace_bytes,
    fused_gate,
    gemm_w8a8,
    gemm_w8a8_workspace_bytes,
    grouped_gemm_bf16,
    grouped_gemm_bf16_masked,
    grouped_gemm_fp8,
    grouped_gemm_fp8_masked,
    grouped_gemm_workspace_bytes,
    linear,
    linear_import_awq,
    linear_import_gptq,
    linear_prepack,
    linear_quantize,
    linear_unpack,
    linear_workspace_bytes,
    moe_layer,
    moe_layer_plan,
    permute,
    permute_capacity_rows,
    permute_workspace_bytes,
    prepack_w8a8,
    unpermute_reduce,
    w8a8_quantize,
)

__all__ = [
    "append_kv",
    "attention_decode",
    "attention_prefill",
    "attention_prefill_varlen",
    "attention_prefill_with_cache",
    "conv2d",
    "conv2d_output_size",
    "conv2d_path",
    "conv2d_workspace_bytes",
    "conv_path_name",
    "decode_workspace_bytes",
    "fused_gate",
    "gemm_w8a8",
    "gemm_w8a8_workspace_bytes",
    "grouped_gemm_bf16",
    "grouped_gemm_bf16_masked",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_masked",
    "grouped_gemm_workspace_bytes",
    "linear",
    "linear_import_awq",
    "linear_import_gptq",
    "linear_prepack",
    "linear_quantize",
    "linear_unpack",
    "linear_workspace_bytes",
    "moe_layer",
    "moe_layer_plan",
    "permute",
    "permute_capacity_rows",
    "permute_workspace_bytes",
    "prepack_w8a8",
    "unpermute_reduce",
    "w8a8_quantize",
]
