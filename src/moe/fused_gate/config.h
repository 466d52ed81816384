// fused_gate: the problem description and the pure choice of kernel configuration.
#pragma once

#include <cstdint>

namespace tessera::moe::detail {

struct GateProblem {
  int64_t num_tokens;
  int num_experts;
  int num_groups;
  int elem_bytes;          // logits element size
  bool rows_16b_aligned;   // logits base and row stride are 16-byte aligned
};

struct GateConfig {
  int values_per_lane;     // experts each lane holds: 1, 2, 4, 8 or 16 (32 lanes cover E)
  int lanes_per_group;     // > 0: groups are lane-aligned (shuffle path); 0: groups go through shared memory
  int warps_per_block;
  bool vector_loads;       // each lane loads its experts with one or more aligned vector loads
  int smem_bytes_per_warp; // dynamic shared memory per warp
};

// Experts per lane: the smallest power of two with 32 * v >= E.
inline int gate_values_per_lane(int num_experts) {
  int v = 1;
  while (32 * v < num_experts) v *= 2;
  return v;
}

inline GateConfig select_gate_config(const GateProblem& p) {
  GateConfig c{};
  c.values_per_lane = gate_values_per_lane(p.num_experts);
  c.warps_per_block = 8;
  const int group_size = p.num_experts / p.num_groups;
  c.lanes_per_group = 0;
  if (p.num_groups == 1) {
    c.lanes_per_group = 32;  // unused: no group stage
  } else if (p.num_groups <= 32 && group_size % c.values_per_lane == 0) {
    const int lanes = group_size / c.values_per_lane;
    if ((lanes & (lanes - 1)) == 0) c.lanes_per_group = lanes;
  }
  // Vector loads need each lane's slice (v * elem_bytes) to sit at a multiple of the vector width.
  const int slice_bytes = c.values_per_lane * p.elem_bytes;
  const bool slice_ok = slice_bytes >= 16 ? p.rows_16b_aligned : false;
  c.vector_loads = slice_ok;
  // Scores for the final gather; the shared-memory group path also keeps the keys, the group keys and flags.
  const int slots = 32 * c.values_per_lane;
  c.smem_bytes_per_warp = slots * 4;
  if (c.lanes_per_group == 0) c.smem_bytes_per_warp += slots * 4 + p.num_groups * 4 + ((p.num_groups + 15) / 16) * 16;
  return c;
}

}  // namespace tessera::moe::detail
