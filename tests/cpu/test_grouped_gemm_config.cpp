// Tile-shape rules and shared-memory layout of the grouped GEMM (pure functions that the kernel also runs on the
// device; see src/gemm/grouped/config.h).
#include <gtest/gtest.h>

#include "gemm/grouped/config.h"

namespace {

using namespace tessera::gemm::detail;

TEST(GroupedGemmConfig, TileHeightFollowsTheGroupsRows) {
  EXPECT_EQ(tile_block_m(0, 128), 8);
  EXPECT_EQ(tile_block_m(1, 128), 8);
  EXPECT_EQ(tile_block_m(8, 128), 8);
  EXPECT_EQ(tile_block_m(9, 128), 32);
  EXPECT_EQ(tile_block_m(32, 128), 32);
  EXPECT_EQ(tile_block_m(33, 128), 128);
  EXPECT_EQ(tile_block_m(64, 128), 128);
  EXPECT_EQ(tile_block_m(64, 64), 64);
  EXPECT_EQ(tile_block_m(65, 128), 128);
  EXPECT_EQ(tile_block_m(1 << 20, 128), 128);
  EXPECT_EQ(tile_block_m(1000, 64), 64);  // the launch chose 64-row tiles for its large groups
}

TEST(GroupedGemmConfig, OnlyTallTilesAreWide) {
  EXPECT_EQ(tile_halves(8), 1);
  EXPECT_EQ(tile_halves(32), 1);
  EXPECT_EQ(tile_halves(64), 1);
  EXPECT_EQ(tile_halves(128), 2);
}

TEST(GroupedGemmConfig, LargeGroupsTakeShorterTilesOnlyWhenThatFinishesSooner) {
  const int ctas = 132;
  // DeepSeek-V3 gate_up, 32 groups of 1024 rows, N 4096: 4096 tiles of 128 x 256 fill 32 waves.
  EXPECT_EQ(large_block_m(32 * 8 * 16, 32 * 16 * 32, ctas, 4096), 128);
  // One group of 1000 rows (skewed routing), N 2048: 64 tiles of 128 x 256 on 64 CTAs still beat two waves of
  // 64 x 128 (measured, config.h).
  EXPECT_EQ(large_block_m(8 * 8, 16 * 16, ctas, 2048), 128);
  // One group of 256 rows, N 2048: 16 tiles against 64 of 64 x 128, one wave each.
  EXPECT_EQ(large_block_m(2 * 8, 4 * 16, ctas, 2048), 64);
  // 133 tiles: a second wave of one tile at 128 rows; 532 tiles of 64 x 128 take 5 waves of 0.6.
  EXPECT_EQ(large_block_m(133, 532, ctas, 4096), 128);
  // 264 tiles (exactly two waves) stay at 128.
  EXPECT_EQ(large_block_m(264, 1056, ctas, 4096), 128);
  EXPECT_EQ(large_block_m(0, 0, ctas, 4096), 128);  // no large group
  // N not a multiple of 256: no 256-wide tile, so 64 x 128.
  EXPECT_EQ(large_block_m(4096, 16384, ctas, 384), 64);
}

TEST(GroupedGemmConfig, EveryTileShapeFitsAStage) {
  for (int bm : {8, 32, 64, 128}) {
    {
      const int halves = tile_halves(bm);
      const int per_stage = kblocks_per_stage(bm, halves);
      EXPECT_GE(per_stage, 1) << bm << " " << halves;
      EXPECT_LE(per_stage, kMaxKBlocksPerStage);
      EXPECT_LE(per_stage * kblock_bytes(bm, halves), kStageBytes) << bm << " " << halves;
      // Every operand tile starts 1024-byte aligned (the 128-byte swizzle atom) within the stage.
      EXPECT_EQ(kblock_bytes(bm, halves) % 1024, 0);
      EXPECT_EQ(halves * 128 * kTileKBytes % 1024, 0);
      // The block-wise scale products of the stage: [k-block][slot][kMaxBlockM].
      EXPECT_LE(per_stage * halves * kMaxBlockM, kStageScaleFloats);
    }
  }
  EXPECT_EQ(kStageBytes % 1024, 0);
  // Decode tiles (8 token rows, 128 weights) carry three k-blocks per stage: 48 KiB of weights per stage.
  EXPECT_EQ(kblocks_per_stage(8, 1), 3);
  EXPECT_EQ(kblocks_per_stage(128, 2), 1);
}

TEST(GroupedGemmConfig, EveryGroupCountFitsSharedMemoryWithAtLeastTwoStages) {
  for (int g : {1, 2, 32, 256, 512, 800, 1024}) {
    const int stages = select_stages(g);
    EXPECT_GE(stages, 2) << g;
    EXPECT_LE(stages, kMaxStages);
    EXPECT_LE(SmemLayout::make(stages, g).total_bytes, kSmemLimit) << g;
    if (stages < kMaxStages) EXPECT_GT(SmemLayout::make(stages + 1, g).total_bytes, kSmemLimit) << g;
  }
  EXPECT_EQ(select_stages(256), kMaxStages);
  // The block-wise scale warps (three, kernel.cuh: kScaleWarps) need a ring of at least three stages at any G.
  EXPECT_GE(select_stages(tessera::gemm::kGroupedGemmMaxGroups), 3);
  const SmemLayout l = SmemLayout::make(4, 8);
  EXPECT_EQ(l.operands_bytes % 1024, 0);
  EXPECT_EQ(l.scales_bytes % 8, 0);  // barriers follow the scales
}

}  // namespace
