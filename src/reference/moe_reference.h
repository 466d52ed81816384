// CPU float64 references for the MoE routing ops. Inputs are the exact values the GPU sees, widened to double.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/moe.h"

namespace tessera::reference {

struct GateRef {
  std::vector<double> weights;   // [T, topk + num_shared]
  std::vector<int32_t> ids;      // [T, topk + num_shared]
  std::vector<double> scores;    // [T, E]: the unbiased scores (sigmoid or softmax)
  // [T]: the smallest non-zero gap between two values compared at a decision that shapes the ids (the group
  // cut, the expert cut, the order of the chosen experts); +inf if there is none. Exact ties (gap 0) are
  // decided by index and do not count.
  std::vector<double> tie_margin;
};

// logits: [T, E] row-major; bias: [E] or empty.
GateRef fused_gate(const std::vector<double>& logits, int64_t num_tokens, int num_experts,
                   const std::vector<double>& bias, const moe::GateParams& params);

struct PermuteIndexRef {
  std::vector<int32_t> offsets;    // [E+1]
  std::vector<int32_t> counts;     // [E]
  std::vector<int32_t> row_index;  // [T, k]
  std::vector<int32_t> row_token;  // [offsets[E]]
};

PermuteIndexRef permute_index(const std::vector<int64_t>& ids, int64_t num_tokens, int topk, int num_experts,
                              int pad_multiple);

// The fp32 block scale of one row block for kFP8Blockwise: max(amax, eps) / 448.
double fp8_block_scale(double amax);

// out[t] = routed_scale * sum_j weights[t,j] * y[row_index[t,j]] + residual[t] (residual may be empty).
std::vector<double> unpermute_reduce(const std::vector<double>& y, const std::vector<int32_t>& row_index,
                                     const std::vector<double>& weights, const std::vector<double>& residual,
                                     int64_t num_tokens, int topk, int64_t hidden, double routed_scale);

}  // namespace tessera::reference
