// Tile-shape selection of the grouped GEMM (a pure function of the problem; see src/gemm/grouped/config.h).
#include <gtest/gtest.h>

#include "gemm/grouped/config.h"

namespace {

using namespace tessera::gemm::detail;

TEST(GroupedGemmConfig, BlockMFollowsExpectedRows) {
  EXPECT_EQ(select_block_m(0), 8);
  EXPECT_EQ(select_block_m(1), 8);
  EXPECT_EQ(select_block_m(8), 8);
  EXPECT_EQ(select_block_m(9), 16);
  EXPECT_EQ(select_block_m(16), 16);
  EXPECT_EQ(select_block_m(17), 32);
  EXPECT_EQ(select_block_m(32), 32);
  EXPECT_EQ(select_block_m(33), 64);
  EXPECT_EQ(select_block_m(64), 64);
  EXPECT_EQ(select_block_m(65), 128);
  EXPECT_EQ(select_block_m(1 << 20), 128);
}

TEST(GroupedGemmConfig, WideTilesOnlyForLargeTilesAndWhenNAllows) {
  EXPECT_EQ(select_tile_width(8, 4096), 128);
  EXPECT_EQ(select_tile_width(16, 4096), 128);
  EXPECT_EQ(select_tile_width(32, 4096), 128);
  EXPECT_EQ(select_tile_width(64, 4096), 256);
  EXPECT_EQ(select_tile_width(128, 7168), 256);
  EXPECT_EQ(select_tile_width(128, 384), 128);  // 384 is not a multiple of 256
  EXPECT_EQ(select_tile_width(128, 128), 128);
}

TEST(GroupedGemmConfig, EveryConfigFitsSharedMemoryWithAtLeastTwoStages) {
  for (int64_t m : {1, 16, 24, 48, 100, 4096}) {
    for (int64_t n : {128, 256, 384, 7168}) {
      for (int g : {1, 2, 32, 256, 1024}) {
        const GroupedGemmConfig c = select_config(m, n, g);
        EXPECT_GE(c.stages, 2) << m << " " << n << " " << g;
        EXPECT_LE(c.stages, kMaxStages);
        EXPECT_LE(c.smem_bytes, kSmemLimit) << m << " " << n << " " << g;
        EXPECT_EQ(c.smem_bytes, SmemLayout::make(c.block_m, c.tile_width, c.stages, g).total_bytes);
        // The deepest ring that fits: one more stage would not.
        if (c.stages < kMaxStages) {
          EXPECT_GT(SmemLayout::make(c.block_m, c.tile_width, c.stages + 1, g).total_bytes, kSmemLimit);
        }
      }
    }
  }
}

TEST(GroupedGemmConfig, DecodeShapesGetDeepRings) {
  // DeepSeek-V3 gate_up decode: 8 rows per group, 32 groups.
  const GroupedGemmConfig c = select_config(8, 4096, 32);
  EXPECT_EQ(c.block_m, 8);
  EXPECT_EQ(c.tile_width, 128);
  EXPECT_GE(c.stages, 10);  // >= 160 KiB of weights in flight per SM
}

TEST(GroupedGemmConfig, LayoutTilesAre1024ByteAligned) {
  // The 128-byte swizzle needs every operand tile at a multiple of 1024 bytes from the aligned base.
  for (int bm : {8, 16, 32, 64, 128}) {
    for (int w : {128, 256}) {
      const SmemLayout l = SmemLayout::make(bm, w, 3, 8);
      EXPECT_EQ(l.stage_w_bytes % 1024, 0);
      EXPECT_EQ(l.stage_x_bytes % 1024, 0);
      EXPECT_EQ(l.scales_bytes % 8, 0);  // barriers follow the scales
    }
  }
}

}  // namespace
