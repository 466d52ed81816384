// tessera — MoE routing (public): the fused grouped top-k gate, token permute and unpermute-reduce.
//
// All ops run asynchronously on the given stream, never synchronize the host, never allocate, and can be
// captured in a CUDA graph. Arguments are validated before anything is launched; a violation throws
// tessera::Error naming the op and the argument. See docs/ops/moe.md for the full semantics.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "tessera/tensor.h"

namespace tessera::moe {

// ------------------------------------------------------------------------------------------------------------
// fused_gate: DeepSeek-V3 style biased grouped top-k.
//   scores = sigmoid(logits) | softmax(logits over E)       (fp32 math whatever the input dtype)
//   choice = scores + bias                                   (bias optional)
//   group_score[g] = sum of the 2 largest choice in group g  (kTop2Sum) | max choice in group g (kMax)
//   keep the topk_groups best groups; ids = topk best choice among kept experts, by descending choice
//   weights = scores[ids]; if renormalize: weights /= sum(weights); weights *= routed_scaling_factor
//   then num_shared_experts slots: ids E..E+s-1 with weight shared_expert_weight.
// Ties: the lower index wins (groups and experts). A NaN choice ranks as -inf; its weight stays NaN.
enum class Scoring : int { kSigmoid = 0, kSoftmax = 1 };
enum class GroupScore : int { kTop2Sum = 0, kMax = 1 };

struct GateParams {
  int topk = 8;                        // 1..32, <= experts in the kept groups
  int num_groups = 1;                  // divides E; 1 = plain top-k
  int topk_groups = 1;                 // 1..num_groups
  Scoring scoring = Scoring::kSigmoid;
  GroupScore group_score = GroupScore::kTop2Sum;
  bool renormalize = false;
  float routed_scaling_factor = 1.0f;
  int num_shared_experts = 0;          // slots appended to each row
  float shared_expert_weight = 1.0f;
};

inline constexpr int kGateMaxExperts = 512;
inline constexpr int kGateMaxTopk = 32;

// logits  [T, E] fp32 | bf16 | fp16, unit stride along E (row stride free); E <= 512
// bias    [E] fp32 | bf16 | fp16 (contiguous) or none
// weights [T, topk + num_shared_experts] fp32, contiguous   (output)
// ids     [T, topk + num_shared_experts] int32, contiguous  (output)
void fused_gate(const TensorView& logits, const std::optional<TensorView>& bias, const TensorView& weights,
                const TensorView& ids, const GateParams& params, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------------------
// permute: copies of the token rows grouped by expert (expert 0 first, stable in token order within an expert),
// optionally quantized to fp8 e4m3, optionally with every expert segment padded to a multiple of pad_multiple
// rows (pad rows are zero and map to no token). Ids outside [0, E) are dropped.
enum class PermuteQuant : int {
  kNone = 0,          // x_perm has x's dtype
  kFP8Blockwise = 1,  // x_perm fp8 e4m3, one fp32 scale per row per 128 columns: x ~= q * scale
  kFP8PerTensor = 2,  // x_perm fp8 e4m3 = saturate(x / input_scale)
};

inline constexpr int kFP8BlockCols = 128;
inline constexpr float kFP8BlockScaleEps = 1e-10f;  // scale = max(amax, eps) / 448

struct PermuteParams {
  int num_experts = 0;  // E >= 1
  int pad_multiple = 1;  // >= 1
  PermuteQuant quant = PermuteQuant::kNone;
};

struct PermuteOutputs {
  TensorView x_perm;                   // [capacity_rows, H]: bf16/fp16 (kNone) or fp8 e4m3
  std::optional<TensorView> scales;    // kFP8Blockwise: fp32 [capacity_rows, ceil(H/128)], any strides
  TensorView expert_offsets;           // int32 [E+1]: segment e is rows [offsets[e], offsets[e+1])
  TensorView expert_counts;            // int32 [E]: real (unpadded) rows of expert e
  TensorView row_index;                // int32 [T, k]: row of copy (t, j) in x_perm, -1 if dropped
  std::optional<TensorView> row_token; // int32 [capacity_rows]: token of each row, -1 for pad rows
};

using Workspace = tessera::Workspace;

// Rows x_perm (and scales, row_token) must have: T*k, plus E*(pad_multiple-1) when padding.
// Rows at or past offsets[E] are not written.
int64_t permute_capacity_rows(int64_t num_tokens, int topk, const PermuteParams& params);
// Device workspace the call needs (any contents; 16-byte aligned).
std::size_t permute_workspace_bytes(int64_t num_tokens, int topk, const PermuteParams& params);

// x [T, H] bf16 | fp16 (H % 8 == 0, rows 16-byte aligned); ids [T, k] int32 | int64 contiguous;
// input_scale: fp32 [1] on the device, required for kFP8PerTensor only.
// num_tokens: optional int32 [1] on the device; copies of tokens at or past its value are dropped (row_index -1),
// so that a CUDA graph captured for T rows can replay with fewer (read on the device only).
void permute(const TensorView& x, const TensorView& ids, const std::optional<TensorView>& input_scale,
             const PermuteOutputs& out, const Workspace& workspace, const PermuteParams& params,
             cudaStream_t stream, const std::optional<TensorView>& num_tokens = std::nullopt);

// ------------------------------------------------------------------------------------------------------------
// unpermute_reduce: out[t] = routed_scale * sum_j weights[t, j] * y_perm[row_index[t, j]]  (+ residual[t])
// Copies with row_index -1 are skipped. fp32 accumulation.
// y_perm [R, H] bf16 | fp16; row_index [T, k] int32; weights [T, k] fp32; residual [T, H] same dtype as out
// or none; out [T, H] bf16 | fp16 (same dtype as y_perm). H % 8 == 0, rows 16-byte aligned.
void unpermute_reduce(const TensorView& y_perm, const TensorView& row_index, const TensorView& weights,
                      const std::optional<TensorView>& residual, const TensorView& out, float routed_scale,
                      cudaStream_t stream);

}  // namespace tessera::moe
