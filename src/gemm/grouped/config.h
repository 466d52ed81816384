// Internal: tile shapes and shared-memory layout of the grouped GEMM, pure functions (testable on the CPU, and the
// tile-shape rules run on the device too).
//
// The kernel computes Yᵀ tiles: weights (N) fill wgmma's M side, 64 or 128 rows per consumer warpgroup (a tile
// 128 or 256 weight rows wide), and tokens (M) fill wgmma's N side, block_m = 8..128 rows per tile. Every group
// gets its own tile shape, chosen on the device from its row count (group sizes live in device memory; the host
// never reads them): a decode-sized group wastes no tensor-core work on rows it does not have, and a large group
// re-reads its weights as few times as possible.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "gemm/grouped/problem.h"


namespace tessera::gemm::detail {

inline constexpr int kTileKBytes = 128;     // K bytes per k-block: one 128-byte swizzle row
inline constexpr int kThreads = 384;        // 2 consumer warpgroups + 1 producer warpgroup
inline constexpr int kMaxBlockM = 128;      // token rows of the tallest tile
inline constexpr int kWeightBox = 128;      // weight rows of the common TMA box (64 and 256 serve split and wide tiles)
inline constexpr int kSmemLimit = 232448;   // sm_90 opt-in dynamic shared memory per block
// One ring stage holds the operands of 1 to 4 k-blocks, as many as fit: the widest tile (256 weight rows + 128
// token rows = 48 KiB) takes one k-block per stage, a decode tile (128 + 8 rows = 17 KiB) three, a split decode tile
// (64 + 8 rows = 9 KiB) four, two per warpgroup. So the ring keeps about the same bytes in flight whatever mix of
// tiles a launch runs.
inline constexpr int kStageBytes = 51 * 1024;
inline constexpr int kMaxKBlocksPerStage = 4;
// Block-wise scale products of a stage: [slot][kMaxBlockM] for a one-k-block stage (slot: the consumer warpgroup's
// 128-weight scale block), [k-block][block_m] for a stage of several (block_m × k-blocks ≤ 128 for every such tile).
inline constexpr int kStageScaleFloats = 3 * kMaxBlockM;
inline constexpr int kMaxStages = 4;

// The shape of the tiles of one group.
struct TileShape {
  int block_m;  // token rows: 8, 32, 64 or 128
  int halves;   // m64 weight blocks per consumer warpgroup: 1 (tile 128 weights wide) or 2 (256)
  bool split;   // 8-row tiles of a decode launch only: 64 weights wide, the two warpgroups splitting K (halves 1)
};

// The tile shapes the kernel has (one consume_tile instantiation each; more of them in one kernel made ptxas
// spill the consumers' accumulators): (8, 128), (8, 64 split), (32, 128), (64, 128) and (128, 256) token rows ×
// weight rows.

// Token rows of a group's tiles: 8 or 32 when they hold its rows, else `large` (128, or 64 where the launch needs
// more tiles). A 33..64-row group takes 128-row tiles: 64 × 128 tiles cost more than half a 128 × 256 one
// (measured: DeepSeek-V3 routed T 4096 bf16 18 % slower with them), the decode shapes never have such groups, and
// the launches that do are compute-heavy.
TESSERA_HD constexpr int tile_block_m(int64_t rows, int large) { return rows <= 8 ? 8 : rows <= 32 ? 32 : large; }

// 128-row tiles are 256 weight rows wide (two m64 blocks per warpgroup: a quarter fewer operand bytes per flop than
// 128); every other tile 128. Decode-sized tiles are bound by the weight stream, where the width does not matter and
// more, smaller tiles balance better.
TESSERA_HD constexpr int tile_halves(int block_m) { return block_m == 128 ? 2 : 1; }

// Weight rows of a tile (N columns of the output it covers).
TESSERA_HD constexpr int tile_width(int halves, bool split) { return split ? 64 : 128 * halves; }

TESSERA_HD constexpr TileShape tile_shape(int64_t rows, int large, bool split_decode = false) {
  const int bm = tile_block_m(rows, large);
  return TileShape{bm, tile_halves(bm), split_decode && bm == 8};
}

// Operand bytes of one k-block of a tile `width` weight rows wide, and how many k-blocks share a stage.
TESSERA_HD constexpr int kblock_bytes(int block_m, int width) { return (width + block_m) * kTileKBytes; }
TESSERA_HD constexpr int kblocks_per_stage(int block_m, int width) {
  const int k = kStageBytes / kblock_bytes(block_m, width);
  return k > kMaxKBlocksPerStage ? kMaxKBlocksPerStage : k;
}

// A decode launch (every group at most 8 rows, so every tile 8 × 128) is a weight stream, and one SM streams only a
// fraction of the machine's read bandwidth. Where its 128-wide tiles occupy at most half of the CTAs, 64-wide tiles
// with the two consumer warpgroups splitting each stage's k-blocks (twice the tiles, half the bytes each, still one
// wave) put twice the SMs to work. Measured on an H200 (docs/perf/grouped_gemm.md, v8): Mixtral's down projection at
// T 1 (64 tiles on 132 SMs) 0.80× the time with split tiles; DeepSeek-V3's gate_up at T 1 (288 tiles, a last wave
// of 24) 0.99-1.02×, Qwen3's (192 tiles) no gain in its layer either: once the tiles fill the machine, a thin last
// wave costs less than halving every tile. So: split only when the split tiles fit in one wave.
// The launcher's bound on a launch's tiles (the grid is this, at most the resident CTA slots; tile shapes are chosen
// on the device): with monotone offsets at most (rows / 8 + G) m-tiles (contiguous) or G × ceil(max_m / 8) (masked),
// each N / 64 n-tiles wide (the split decode tiles' width); overlapping groups just give each CTA more tiles.
TESSERA_HD constexpr int64_t grid_tile_bound(bool masked, int64_t rows, int64_t num_groups, int64_t n) {
  const int64_t m_tiles = masked ? num_groups * ((rows + 7) / 8) : (rows + 7) / 8 + num_groups;
  return m_tiles * (n / 64);
}

TESSERA_HD constexpr bool split_decode_tiles(int64_t tiles128, int64_t ctas) {
  return tiles128 > 0 && 2 * tiles128 <= ctas;
}

// The height of the tiles of groups with more than 32 rows, one choice per launch: 128 (256 wide: fewest operand
// bytes per flop) unless 64-row tiles (128 wide) finish sooner on `ctas` CTAs, which happens only when 128-row
// tiles fill at most ~60 % of the machine's CTA slots in their last wave against a full 64-row schedule (in practice:
// a few large groups of a few hundred rows, 128-row tiles filling a quarter of the CTAs or less);
// always 64 when N is not a multiple of 256. tiles128 / tiles64: the tiles of those groups in either shape. A
// 64 × 128 tile is counted as 0.6 of a 128 × 256 one although it does a quarter of the flops: measured on an H200
// with one 1,000-row group (N 2048, K 7168), 64 tiles of 128 × 256 on 64 SMs took 52 / 74 / 91 µs (fp8 per-tensor /
// block-wise / bf16), 256 tiles of 64 × 128 (two waves) 58 / 97 / 112 µs, i.e. 0.56-0.66 each.
TESSERA_HD constexpr int large_block_m(int64_t tiles128, int64_t tiles64, int64_t ctas, int64_t n) {
  if (n % 256 != 0) return 64;
  if (tiles128 == 0 || ctas <= 0) return 128;
  const int64_t waves128 = (tiles128 + ctas - 1) / ctas, waves64 = (tiles64 + ctas - 1) / ctas;
  return waves64 * 60 < waves128 * 100 ? 64 : 128;
}

// Shared memory of one CTA, laid out by the kernel in this order (see kernel.cuh).
struct SmemLayout {
  int operands_bytes;  // stages × kStageBytes, 1024-byte aligned
  int scales_bytes;    // stages × kStageScaleFloats fp32
  int exchange_bytes;  // a split tile's second-warpgroup partial sums: 128 threads × 4 fp32 (m64n8)
  int barrier_bytes;   // 2 × stages × 8
  int table_bytes;     // scan scratch (one slot per warp used, two reserved) and (G + 1) tile prefix, int64; G starts, rows and shapes, int32
  int total_bytes;     // + 1024 for aligning the dynamic base

  static constexpr SmemLayout make(int stages, int num_groups) {
    SmemLayout l{};
    l.operands_bytes = stages * kStageBytes;
    l.scales_bytes = stages * kStageScaleFloats * 4;
    l.exchange_bytes = 128 * 4 * 4;
    l.barrier_bytes = 2 * stages * 8;
    l.table_bytes = (2 * (kThreads / 32) + num_groups + 1) * 8 + 3 * num_groups * 4;
    l.total_bytes = 1024 + l.operands_bytes + l.scales_bytes + l.exchange_bytes + l.barrier_bytes + l.table_bytes;
    return l;
  }
};

// Deepest ring that fits the shared memory limit (kMaxStages up to ~700 groups, fewer for more; at least 2).
constexpr int select_stages(int num_groups, int smem_limit = kSmemLimit) {
  for (int s = kMaxStages; s > 2; --s)
    if (SmemLayout::make(s, num_groups).total_bytes <= smem_limit) return s;
  return 2;
}

}  // namespace tessera::gemm::detail

#undef TESSERA_HD
