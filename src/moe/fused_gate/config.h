// fused_gate: the problem description and the pure choice of kernel configuration.
#pragma once

#include <cstdint>

namespace tessera::moe::detail {

// Shared memory of one token slot starts with the ids selected in each round, then the scores, then the arrays of
// the shared-memory group path.
inline constexpr int kGateIdSlots = 32;

struct GateProblem {
  int64_t num_tokens;
  int num_experts;
  int num_groups;
  int elem_bytes;          // logits element size
  bool rows_16b_aligned;   // logits base and row stride are 16-byte aligned
};

struct GateConfig {
  int lanes_per_token;     // 16 (two tokens per warp) or 32
  int values_per_lane;     // experts each lane holds: 1, 2, 4, 8 or 16
  int lanes_per_group;     // > 0: groups are lane-aligned (shuffle path); 0: groups go through shared memory
  bool compact;            // lane-aligned groups keeping at most half the experts: rank the kept ones only
  bool paired;             // compact, G <= 16, topk <= 16: rank two tokens per warp (fused_gate_pair_kernel)
  bool vector_loads;       // each lane loads its experts with aligned 16-byte loads
  int smem_bytes_per_token; // dynamic shared memory per token slot (16-byte multiple)
};

inline int next_pow2(int n) {
  int v = 1;
  while (v < n) v *= 2;
  return v;
}

inline GateConfig select_gate_config(const GateProblem& p, int topk, int topk_groups) {
  GateConfig c{};
  // Half a warp per token shares every warp-wide step between two tokens (topk <= 16: a lane holds one selected
  // id). It pays off only where per-token overhead dominates and registers stay low: E <= 128 (8 experts per
  // lane) and enough tokens that throughput, not the latency of one token, sets the time (docs/perf).
  c.lanes_per_token = (p.num_experts <= 128 && topk <= 16 && p.num_tokens >= 16384) ? 16 : 32;
  c.values_per_lane = next_pow2((p.num_experts + c.lanes_per_token - 1) / c.lanes_per_token);
  const int group_size = p.num_experts / p.num_groups;
  c.lanes_per_group = 0;
  if (p.num_groups == 1) {
    c.lanes_per_group = c.lanes_per_token;  // unused: no group stage
  } else if (p.num_groups <= c.lanes_per_token && group_size % c.values_per_lane == 0) {
    const int lanes = group_size / c.values_per_lane;
    if ((lanes & (lanes - 1)) == 0) c.lanes_per_group = lanes;
  }
  c.compact = p.num_groups > 1 && c.lanes_per_group > 0 && c.values_per_lane >= 2 && c.values_per_lane <= 8 &&
              2 * topk_groups <= p.num_groups;
  // Pairs cut instructions per token but lengthen one warp's critical path (two tokens' scores before any
  // ranking): worth it only when throughput sets the time (measured: slower at T <= 1024, equal at 4096).
  c.paired = c.compact && c.lanes_per_token == 32 && p.num_groups <= 16 && topk <= 16 && p.num_tokens >= 4096;
  // Vector loads need each lane's slice (v * elem_bytes) to be a whole number of aligned 16-byte vectors.
  c.vector_loads = c.values_per_lane * p.elem_bytes >= 16 && p.rows_16b_aligned;
  // The selected ids and the scores for the final gather; the shared-memory group path also keeps the keys, the
  // group keys and flags.
  const int slots = c.lanes_per_token * c.values_per_lane;
  c.smem_bytes_per_token = kGateIdSlots * 4 + slots * 4;
  if (c.compact) c.smem_bytes_per_token += slots * 4;  // the keys, gathered from there
  if (c.lanes_per_group == 0) c.smem_bytes_per_token += slots * 4 + p.num_groups * 4 + (p.num_groups + 15) / 16 * 16;
  return c;
}

}  // namespace tessera::moe::detail
