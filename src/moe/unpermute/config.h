// unpermute_reduce: the pure choice of column slices (tested on the CPU).
#pragma once

#include <cstdint>

namespace tessera::moe::detail {

// 8-element vectors per column slice (one block per token and slice) for T tokens of `vectors` vectors on `sms` SMs:
// whole rows when the tokens alone give every SM ~4 blocks, else rows cut into slices of a multiple of 32 vectors
// (a warp's worth) until about 4 blocks per SM exist. One block walking a decode step's whole row took 18 us for
// DeepSeek-V3's 9 rows of 7168 (H200, docs/perf/moe_layer.md): each of its threads waited out 14 round trips to
// memory in turn (7 vectors, each two batches of loads).
constexpr int64_t unpermute_slice_vectors(int64_t tokens, int64_t vectors, int sms) {
  const int64_t want_blocks = 4 * static_cast<int64_t>(sms);
  if (vectors < 1) return 1;
  if (tokens <= 0 || tokens >= want_blocks || vectors <= 32) return vectors;
  const int64_t slices = (want_blocks + tokens - 1) / tokens;
  int64_t per = (vectors + slices - 1) / slices;
  per = (per + 31) / 32 * 32;
  return per < vectors ? per : vectors;
}

}  // namespace tessera::moe::detail
