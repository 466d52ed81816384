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
  struct Shape {
    int bm, halves;
    bool split;
  };
  for (const Shape t : {Shape{8, 1, false}, Shape{8, 1, true}, Shape{32, 1, false}, Shape{64, 1, false},
                        Shape{128, 2, false}}) {
    EXPECT_EQ(tile_halves(t.bm), t.halves);
    const int width = tile_width(t.halves, t.split);
    const int per_stage = kblocks_per_stage(t.bm, width);
    EXPECT_GE(per_stage, 1) << t.bm << " " << width;
    EXPECT_LE(per_stage, kMaxKBlocksPerStage);
    EXPECT_LE(per_stage * kblock_bytes(t.bm, width), kStageBytes) << t.bm << " " << width;
    // Every operand tile starts 1024-byte aligned (the 128-byte swizzle atom) within the stage.
    EXPECT_EQ(kblock_bytes(t.bm, width) % 1024, 0);
    EXPECT_EQ(width * kTileKBytes % 1024, 0);
    // The block-wise scale products of the stage: [slot][kMaxBlockM] for one k-block, [k-block][block_m] for more
    // (the scale warps' lanes cover block_m × k-blocks pairs, at most 128).
    if (per_stage == 1) {
      EXPECT_LE(t.halves * kMaxBlockM, kStageScaleFloats);
    } else {
      EXPECT_EQ(t.halves, 1);
      EXPECT_LE(per_stage * t.bm, kMaxBlockM) << t.bm;
      EXPECT_LE(per_stage * t.bm, kStageScaleFloats);
    }
    // A split tile's two warpgroups take half of each stage's k-blocks.
    if (t.split) EXPECT_EQ(per_stage % 2, 0);
  }
  EXPECT_EQ(kStageBytes % 1024, 0);
  // Decode tiles (8 token rows, 128 weights) carry three k-blocks per stage: 48 KiB of weights per stage; split
  // ones (64 weights) four, two per warpgroup.
  EXPECT_EQ(kblocks_per_stage(8, 128), 3);
  EXPECT_EQ(kblocks_per_stage(8, 64), 4);
  EXPECT_EQ(kblocks_per_stage(128, 256), 1);
}

TEST(GroupedGemmConfig, DecodeLaunchesSplitTilesOnlyWhereTheyFillAtMostHalfTheCtas) {
  const int ctas = 132;
  EXPECT_EQ(tile_width(1, false), 128);
  EXPECT_EQ(tile_width(2, false), 256);
  EXPECT_EQ(tile_width(1, true), 64);
  // Mixtral's down projection at T 1: 2 × 32 = 64 tiles on 132 CTAs: split (128 tiles, one wave; measured 0.80×).
  EXPECT_TRUE(split_decode_tiles(64, ctas));
  EXPECT_TRUE(split_decode_tiles(66, ctas));
  EXPECT_TRUE(split_decode_tiles(1, ctas));
  // More tiles than half the CTAs: not split (DeepSeek-V3 gate_up at T 1, 288 tiles, measured no gain; Qwen3's 192).
  EXPECT_FALSE(split_decode_tiles(67, ctas));
  EXPECT_FALSE(split_decode_tiles(192, ctas));
  EXPECT_FALSE(split_decode_tiles(288, ctas));
  EXPECT_FALSE(split_decode_tiles(132 * 40, ctas));
  EXPECT_FALSE(split_decode_tiles(0, ctas));
  EXPECT_FALSE(split_decode_tiles(10, 0));
  // A launch limited to few CTAs (its tile bound): one tile per CTA stays.
  EXPECT_FALSE(split_decode_tiles(16, 16));
  // The launcher's grid bound counts 64-wide n-tiles: contiguous (M / 8 + G) m-tiles, masked G · ceil(max_m / 8).
  EXPECT_EQ(grid_tile_bound(false, 9, 9, 4096), (2 + 9) * 64);
  EXPECT_EQ(grid_tile_bound(true, 10, 3, 640), 3 * 2 * 10);
  EXPECT_EQ(grid_tile_bound(false, 0, 0, 128), 0);
  // Only 8-row tiles split.
  EXPECT_TRUE(tile_shape(1, 128, true).split);
  EXPECT_TRUE(tile_shape(8, 128, true).split);
  EXPECT_FALSE(tile_shape(9, 128, true).split);
  EXPECT_FALSE(tile_shape(1, 128, false).split);
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
