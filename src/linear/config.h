// Internal: the weight-only linear layer's problem and its pure configuration choice (no CUDA calls), so that CPU
// tests can ask what a shape runs with.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::linear::detail {

// The kernel's shape (gemm_kernel.cuh): 128 weight rows (8 stripes of 16) per CTA and a producer warpgroup;
// 64 columns of K per k-block. wgmma tiles have two consumer warpgroups (64 rows each); mma.sync tiles four (two
// warps per stripe, each taking every other k-block of a stage: their consumers are latency-bound, more warps hide
// it).
inline constexpr int kGemmRows = 128;
inline constexpr int kGemmStripes = kGemmRows / 16;
inline constexpr int kKBlock = 64;
inline constexpr int kMaxStages = 16;
inline constexpr int kMaxSplits = 16;
// Token tiles up to this many rows use warp-level mma.sync instead of wgmma (gemm_kernel.cuh).
inline constexpr int kMmaSyncMaxBN = 32;
constexpr int consumer_warpgroups(int bn) { return bn <= kMmaSyncMaxBN ? 4 : 2; }
constexpr int gemm_threads(int bn) { return (consumer_warpgroups(bn) + 1) * 128; }
// Dynamic shared memory: 1 KB of barriers, then the ring; one CTA per SM (measured on an H200: two CTAs with half the
// ring each were 20-25 % slower at M 1 and 16).
inline constexpr int kGemmSmemBudget = 226 * 1024;
// Token tiles run along grid.y (at most 65535) and are at most 256 rows: the rows one launch can take.
inline constexpr int64_t kMaxGridY = 65535;
inline constexpr int64_t kMaxLinearM = kMaxGridY * 256;
// Largest K: the kernels address x's columns and the parameter blocks with 32-bit ints (a TMA coordinate past 2^31
// wrapped and read as zeros); the W8A8 GEMM has the same bound.
inline constexpr int64_t kMaxLinearK = int64_t{1} << 30;

struct LinearShape {
  int64_t m = 0, n = 0, k = 0;  // k: the real K (columns of x)
  int bits = 4;
  int64_t block = 128;  // 32, 64, 128, or k (one block per output channel)
  int num_sms = 132;
  int min_bn = 8;  // the smallest token tile allowed (a conv's implicit GEMM runs on the wgmma tiles only: 64)
  // Also the 96- and 192-token tiles (a conv's pixel counts: a grid of whole waves more often). The linear layer keeps
  // the power-of-two set it was measured with.
  bool wave_tiles = false;
};

// k-blocks per ring stage: small token tiles carry several, so that a stage is a few KB of codes (fewer barrier
// round trips and TMA issues per byte); kBN 128 / 256 tiles carry one.
constexpr int kblocks_per_stage(int bn) { return bn <= 32 ? 4 : bn < 128 ? 2 : 1; }

// One ring stage: kblocks_per_stage x tiles (kBN rows × 128 bytes each, 128-byte swizzle), the 8 stripes' codes of
// those k-blocks, their parameter pairs (every block the stage's columns touch).
struct StageBytes {
  int x = 0, codes = 0, params = 0, total = 0;
  int kblocks = 1, tiles_per_kblock = 1, blocks = 1;
};
StageBytes stage_bytes(int bn, int bits, int64_t block, int64_t k);

// The wgmma tiles' epilogue stages a [bn tokens][kGemmRows + 4] fp32 tile in the ring (gemm_kernel.cuh).
constexpr int epilogue_tile_bytes(int bn) { return bn > kMmaSyncMaxBN ? bn * (kGemmRows + 4) * 4 : 0; }

struct LinearConfig {
  int bn = 8;      // token rows per CTA (wgmma N): 8, 16, 32, 64, 128 or 256 (also 96 and 192: wave_tiles)
  int splits = 1;  // K ranges across CTAs; > 1: fp32 partials in the workspace, reduced by a second kernel
  int stages = 2;  // ring depth
  int64_t n_tiles = 0, m_tiles = 0;  // grid (x, y); grid z = splits
  double predicted_us = 0;           // the model's estimate (for tests and notes)
};

// The cheapest configuration by a bandwidth / tensor-core / issue model of the kernel (docs/perf/linear.md); m > 0.
LinearConfig select_config(const LinearShape& shape);

// Bytes of the fp32 partial sums a configuration writes (0 when splits == 1).
std::size_t partial_bytes(const LinearShape& shape, const LinearConfig& config);
// An upper bound of partial_bytes over every M <= max_m (select_config keeps a split grid within two waves:
// splits · M <= 2 · num_sms · 256 / n_tiles).
std::size_t max_partial_bytes(int64_t max_m, int64_t n, int num_sms);

// Dynamic shared memory of the kernel under a configuration.
std::size_t gemm_smem_bytes(const LinearShape& shape, const LinearConfig& config);

}  // namespace tessera::linear::detail
