"""tessera's ops as PyTorch custom operators (torch.ops.tessera.*): the one place that defines them.

Each entry of OPS is an op's schema and its fake implementation. The schema marks every tensor the op writes
(``Tensor(a!)``); every op returns nothing, so the fake (meta) implementation has no shape to compute: the torch
layer (tessera.moe, tessera.gemm, tessera.attention, tessera.linear, tessera.conv, tessera.w8a8, tessera.moe_layer)
allocates the outputs, and torch.compile traces that allocation like any other torch code. The CUDA implementations
live in tessera._torch_C (python/src/torch_ops.cpp), which takes at::Tensor directly and runs on PyTorch's current
CUDA stream.

Two ways in, one kernel: traced code (torch.compile) calls torch.ops.tessera.<op>; eager calls go to
tessera._torch_C.<op>, the same C++ function bound directly, because the dispatcher's boxed call from Python costs
several microseconds of host time per call for ops with a dozen arguments (docs/python.md has the measurements).

A family added later adds its schemas here and its kernels to torch_ops.cpp; nothing else registers ops. An argument
added to an existing op goes last, with a default (k_residual of the decode ops), so that callers of
torch.ops.tessera.<op> written before it keep working.

This module imports torch; tessera imports it only when torch is installed.
"""

import torch

__all__ = ["OPS", "ops", "eager", "available", "load_error"]

NAMESPACE = "tessera"

OPS = {
    "fused_gate": (
        "fused_gate(Tensor logits, Tensor? bias, Tensor(a!) weights, Tensor(b!) ids, int topk, int num_groups, "
        "int topk_groups, str scoring, str group_score, bool renormalize, float routed_scaling_factor, "
        "int num_shared_experts, float shared_expert_weight) -> ()"),
    "permute": (
        "permute(Tensor x, Tensor ids, Tensor? input_scale, Tensor(a!) x_perm, Tensor(b!)? scales, "
        "Tensor(c!) expert_offsets, Tensor(d!) expert_counts, Tensor(e!) row_index, Tensor(f!)? row_token, "
        "Tensor(g!)? workspace, int num_experts, int pad_multiple, str quant) -> ()"),
    "unpermute_reduce": (
        "unpermute_reduce(Tensor y_perm, Tensor row_index, Tensor weights, Tensor? residual, Tensor(a!) out, "
        "float routed_scale) -> ()"),
    "grouped_gemm_fp8": (
        "grouped_gemm_fp8(Tensor x, Tensor w, Tensor offsets, Tensor x_scale, Tensor w_scale, Tensor(a!) y, "
        "Tensor(b!)? workspace, str scale_mode, int expected_m) -> ()"),
    "grouped_gemm_fp8_masked": (
        "grouped_gemm_fp8_masked(Tensor x, Tensor w, Tensor masked_m, Tensor x_scale, Tensor w_scale, "
        "Tensor(a!) y, Tensor(b!)? workspace, str scale_mode, int expected_m) -> ()"),
    "grouped_gemm_bf16": (
        "grouped_gemm_bf16(Tensor x, Tensor w, Tensor offsets, Tensor(a!) y, Tensor(b!)? workspace, "
        "int expected_m) -> ()"),
    "grouped_gemm_bf16_masked": (
        "grouped_gemm_bf16_masked(Tensor x, Tensor w, Tensor masked_m, Tensor(a!) y, Tensor(b!)? workspace, "
        "int expected_m) -> ()"),
    "attention_decode": (
        "attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor? block_table, Tensor cache_seqlens, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!)? workspace, "
        "str format, float softmax_scale, float softcap, int window, int num_splits, "
        "Tensor? k_residual=None, bool balance_splits=False) -> ()"),
    # k_scale / v_scale are written for the integer formats (one scale pair per appended row); for fp8 they are the
    # cache's static scales and only read. A schema cannot depend on `format`, so under torch.compile they are
    # treated as written either way (functionalization copies them back unchanged).
    "append_kv": (
        "append_kv(Tensor k_new, Tensor v_new, Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor(c!)? k_scale, Tensor(d!)? v_scale, Tensor? block_table, str format, "
        "Tensor(e!)? k_residual=None) -> ()"),
    "attention_prefill": (
        "attention_prefill(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, float softmax_scale, "
        "float softcap, int window, bool causal) -> ()"),
    "attention_prefill_varlen": (
        "attention_prefill_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, Tensor(a!) out, Tensor(b!)? lse, float softmax_scale, float softcap, int window, "
        "bool causal) -> ()"),
    "attention_prefill_with_cache": (
        "attention_prefill_with_cache(Tensor q, Tensor cu_seqlens_q, int max_seqlen_q, Tensor k_cache, "
        "Tensor v_cache, Tensor? k_scale, Tensor? v_scale, Tensor? block_table, Tensor cache_seqlens, "
        "Tensor(a!) out, Tensor(b!)? lse, str format, float softmax_scale, float softcap, int window, bool causal, "
        "Tensor? k_residual=None) -> ()"),
    "linear": (
        "linear(Tensor x, Tensor codes, Tensor params, Tensor? k_perm, Tensor? bias, Tensor(a!) y, "
        "Tensor(b!)? workspace, int n, int k, int bits, int block, str zero_mode, float clamp_min, "
        "float clamp_max) -> ()"),
    # The parameter planes are [K / block, ld] (ld >= the codes' rows, a multiple of 4); the kernels narrow them to
    # their first `rows` columns (tessera.w8a8).
    "w8a8_quantize": (
        "w8a8_quantize(Tensor x, Tensor(a!) codes, Tensor(b!) scale, Tensor(c!)? zero, Tensor(d!)? sums, "
        "int block) -> ()"),
    "gemm_w8a8": (
        "gemm_w8a8(Tensor a_codes, Tensor a_scale, Tensor? a_zero, Tensor? a_sums, Tensor w_codes, Tensor w_scale, "
        "Tensor? w_zero, Tensor? w_sums, Tensor? bias, Tensor(a!) y, Tensor(b!)? workspace, int block, "
        "float clamp_min, float clamp_max, float out_scale) -> ()"),
    # x and y contiguous in the layouts named ('NHWC' | 'NCHW'): tessera.conv passes a channels_last tensor as its
    # NHWC view. The weight is a prepacked linear weight [Co, Kh*Kw*Ci_g] (n = Co, k = Kh*Kw*Ci_g) with kh, kw.
    "conv2d": (
        "conv2d(Tensor x, Tensor codes, Tensor params, Tensor? bias, Tensor(a!) y, Tensor(b!)? workspace, int n, "
        "int k, int bits, int block, str zero_mode, int kh, int kw, int stride_h, int stride_w, int pad_h, "
        "int pad_w, int dil_h, int dil_w, int groups, str x_layout, str y_layout, float clamp_min, "
        "float clamp_max) -> ()"),
    # The whole MoE layer (tessera.moe_layer): the config as its constants (MoeLayerConfig's fields, the enums by
    # name) and max_tokens, from which the kernel rebuilds the plan; the weights as their six tensors (scales None
    # where the format has none). num_tokens (int32 [1]) is read on the device only.
    "moe_layer": (
        "moe_layer(Tensor x, Tensor router_logits, Tensor? correction_bias, Tensor? residual, Tensor? num_tokens, "
        "Tensor w13, Tensor w2, Tensor? w13_scale, Tensor? w2_scale, Tensor? a13_scale, Tensor? a2_scale, "
        "Tensor(a!) y, Tensor(b!)? workspace, int hidden, int intermediate, int num_experts, int topk, "
        "int num_groups, int topk_groups, str scoring, str group_score, bool renormalize, "
        "float routed_scaling_factor, int num_shared_experts, float shared_expert_weight, str format, "
        "int max_tokens) -> ()"),
}


def _fake(*args, **kwargs):
    # Every op only writes tensors its caller allocated: under fake tensors there is nothing to produce.
    return None


_LIB = None
load_error = None
eager = None  # tessera._torch_C: the same kernels, bound directly (no dispatcher) for eager calls


def _register():
    global _LIB, load_error, eager
    lib = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in OPS.items():
        lib.define(schema)
        torch.library.register_fake(f"{NAMESPACE}::{name}", _fake, lib=lib)
    _LIB = lib
    try:
        from . import _torch_C  # registers the CUDA kernels with the dispatcher
    except ImportError as e:
        if "_torch_C" in str(e) and "No module named" in str(e):
            load_error = ("tessera was built without its PyTorch operators (tessera._torch_C): rebuild with torch "
                          "installed in the Python that CMake finds")
        else:  # pragma: no cover - depends on the installation
            load_error = f"tessera: tessera._torch_C could not be loaded ({e}); rebuild against this torch"
        return
    eager = _torch_C


_register()

ops = torch.ops.tessera


def available():
    """True when the CUDA implementations are loaded (the schemas always are)."""
    return load_error is None
