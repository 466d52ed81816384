// Verification of MoE routing outputs (already copied to the host) against the float64 references of
// moe_reference.h. Shared by the GPU tests and the benchmark's --check.
//
// Every check scans all of its input and returns a CheckResult: ok, a message that names the first failure
// (row / element, got vs expected) and how many rows or elements failed, and an error measure (documented per
// function). Inconsistent arguments (sizes that do not match the reference) throw tessera::Error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reference/moe_reference.h"
#include "tessera/moe.h"
#include "tessera/tensor.h"

namespace tessera::reference {

struct CheckResult {
  bool ok = true;
  std::string message;  // on failure: what failed and where; on success: a one-line summary
  double error = 0.0;   // the check's error measure (see each function)
  int64_t compared = 0; // check_fused_gate: rows whose ids were compared with the reference; else elements checked
};

// fused_gate outputs: weights / ids [num_tokens, topk + num_shared_experts], row-major.
//  - routed slots: ids in [0, E) and distinct within the row; shared slots: id E + j, weight shared_expert_weight.
//  - weights are compared with the reference computed from ref.scores for the ids the GPU chose (renormalized
//    over those ids if params.renormalize, times routed_scaling_factor), |got - ref| <= weight_rtol * |ref|.
//    NaN is accepted exactly where that reference is NaN.
//  - ids equal ref.ids (same order) on the rows whose ref.tie_margin >= id_tie_eps; closer rows are decided by
//    rounding and only their weights are checked. `compared` = rows whose ids were compared.
// error = the largest relative weight error.
CheckResult check_fused_gate(const GateRef& ref, const float* weights, const int32_t* ids, int64_t num_tokens,
                             int num_experts, const moe::GateParams& params, double id_tie_eps = 1e-6,
                             double weight_rtol = 1e-5);

// permute index outputs, exact: offsets [E+1], counts [E], row_index [T, k], and row_token (nullable) for rows
// [0, offsets[E]). error = number of mismatching elements.
CheckResult check_permute_index(const PermuteIndexRef& ref, const int32_t* offsets, const int32_t* counts,
                                const int32_t* row_index, const int32_t* row_token, int64_t num_tokens, int topk,
                                int num_experts);

// permute x_perm without quantization (16-bit elements, bf16 or fp16 bits). x: [T, H] contiguous; x_perm: rows of
// H contiguous elements. Row r < offsets[E] must equal x[ref.row_token[r]] bitwise; pad rows (token -1) must be
// zero (+0 or -0). num_rows: how many leading rows of x_perm the host copy holds (-1: all of [0, offsets[E]));
// rows past it are not checked. error = number of mismatching elements.
CheckResult check_permute_rows(const PermuteIndexRef& ref, const uint16_t* x, const uint16_t* x_perm,
                               int64_t num_tokens, int64_t hidden, int64_t num_rows = -1);

// permute x_perm quantized to fp8 e4m3 (bytes). x: [T, H] contiguous bf16 or fp16 bits (x_dtype).
//  kFP8Blockwise: scales[row * scale_row_stride + block * scale_block_stride] (fp32) must equal
//    fp8_block_scale(amax of x over that row block of 128 columns) within 1e-6 relative; input_scale unused.
//  kFP8PerTensor: scales unused (may be null); input_scale is the fp32 scale the GPU divided by.
// Every element: |q * scale - x| <= (e4m3_half_ulp(x / scale) * 1.001 + 1e-12) * scale, using the GPU's scale
// (per-tensor: x / scale clamped to +-448 first). Pad rows: q == 0 (+0 or -0). Elements of x that are not finite
// are skipped. num_rows as in check_permute_rows. error = relative Frobenius error of the dequantized rows vs x
// (per-tensor: vs x clamped to the representable range).
CheckResult check_permute_fp8(const PermuteIndexRef& ref, const uint16_t* x, DType x_dtype, const uint8_t* x_perm,
                              moe::PermuteQuant quant, const float* scales, int64_t scale_row_stride,
                              int64_t scale_block_stride, float input_scale, int64_t num_tokens, int64_t hidden,
                              int64_t num_rows = -1);

// Relative Frobenius error ||got - ref|| / ||ref|| (absolute ||got - ref|| when ref is all zero) <= rtol.
// Fails on a NaN in got where ref is finite; elements where ref is not finite are skipped. error = that error.
CheckResult check_close(const std::vector<double>& ref, const std::vector<double>& got, double rtol);

}  // namespace tessera::reference
