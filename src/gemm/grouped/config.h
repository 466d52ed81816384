// Internal: tile shape and pipeline depth of the grouped GEMM, a pure function of the problem (testable on CPU).
//
// The kernel computes Yᵀ tiles: weights (N) fill wgmma's M side, 64 or 128 rows per consumer warpgroup (128 or
// 256 per CTA), and tokens (M) fill wgmma's N side, block_m = 8..128 rows per tile, so a decode-sized group
// wastes no tensor core work on rows it does not have.
#pragma once

#include <cstdint>

#include "gemm/grouped/problem.h"

namespace tessera::gemm::detail {

inline constexpr int kTileKBytes = 128;       // K bytes per stage: one 128-byte swizzle row
inline constexpr int kThreads = 384;          // 2 consumer warpgroups + 1 producer warpgroup
inline constexpr int kMaxStages = 12;
inline constexpr int kSmemLimit = 232448;     // sm_90 opt-in dynamic shared memory per block

struct GroupedGemmConfig {
  int block_m = 0;     // token rows per tile: 8, 16, 32, 64 or 128
  int tile_width = 0;  // weight rows per tile: 128 or 256
  int stages = 0;   // pipeline depth
  int smem_bytes = 0;
};

// Shared memory of one CTA, laid out by the kernel in this order (see kernel.cuh).
struct SmemLayout {
  int stage_w_bytes, stage_x_bytes, stage_scale_bytes;
  int operands_bytes;  // stages × (w + x): 1024-byte aligned tiles first
  int scales_bytes;    // stages × stage_scale_bytes
  int barrier_bytes;   // 2 × stages × 8
  int table_bytes;     // scan scratch (one per warp) and (G + 1) tile prefix, int64; G starts and G rows, int32
  int total_bytes;     // + 1024 for aligning the dynamic base

  static constexpr SmemLayout make(int block_m, int tile_width, int stages, int num_groups) {
    SmemLayout l{};
    l.stage_w_bytes = tile_width * kTileKBytes;
    l.stage_x_bytes = block_m * kTileKBytes;
    l.stage_scale_bytes = 2 * block_m * 4;  // [2 weight blocks][block_m] products
    l.operands_bytes = stages * (l.stage_w_bytes + l.stage_x_bytes);
    l.scales_bytes = stages * l.stage_scale_bytes;
    l.barrier_bytes = 2 * stages * 8;
    l.table_bytes = (kThreads / 32 + num_groups + 1) * 8 + 2 * num_groups * 4;
    l.total_bytes = 1024 + l.operands_bytes + l.scales_bytes + l.barrier_bytes + l.table_bytes;
    return l;
  }
};

// Tile rows from the expected rows per group: the smallest of 8/16/32/64 that holds them, else 128.
constexpr int select_block_m(int64_t expected_m) {
  return expected_m <= 8 ? 8 : expected_m <= 16 ? 16 : expected_m <= 32 ? 32 : expected_m <= 64 ? 64 : 128;
}

// Weight rows per tile: 256 (each consumer warpgroup two m64 blocks) where tiles carry 64 or more token rows and
// N allows it, which cuts the operand bytes per flop by a quarter against 128; else 128. Decode-sized tiles
// are bound by the weight stream, where the width does not matter and more, smaller tiles balance better.
constexpr int select_tile_width(int block_m, int64_t n) { return block_m >= 64 && n % 256 == 0 ? 256 : 128; }

// Deepest pipeline that fits the shared memory limit (at least 2 stages; G <= kGroupedGemmMaxGroups always fits).
inline GroupedGemmConfig select_config(int64_t expected_m, int64_t n, int num_groups, int smem_limit = kSmemLimit) {
  GroupedGemmConfig c;
  c.block_m = select_block_m(expected_m);
  c.tile_width = select_tile_width(c.block_m, n);
  c.stages = 2;
  for (int s = kMaxStages; s >= 2; --s) {
    if (SmemLayout::make(c.block_m, c.tile_width, s, num_groups).total_bytes <= smem_limit) {
      c.stages = s;
      break;
    }
  }
  c.smem_bytes = SmemLayout::make(c.block_m, c.tile_width, c.stages, num_groups).total_bytes;
  return c;
}

}  // namespace tessera::gemm::detail
