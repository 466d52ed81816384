// Internal: the W8A8 GEMM's shape, its pure configuration choice and its shared-memory plan (no CUDA calls), so that
// CPU tests can ask what a shape runs with.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::linear::w8a8 {

// The kernel (kernel.cuh): 128 weight rows per CTA (two consumer warpgroups of 64, wgmma's M), kBN token rows (wgmma's
// N), one producer warpgroup; K in k-blocks of 128 int8 columns (one 128-byte swizzled row).
inline constexpr int kRows = 128;
inline constexpr int kKBlock = 128;
inline constexpr int kMaxStages = 8;
inline constexpr int kMaxSplits = 16;
inline constexpr int kThreads = 384;
inline constexpr int kSmemBudget = 226 * 1024;
// Shared memory before the ring: the barriers (first 1 KB), then the epilogue's per-row parameters of one block per
// row (three planes of up to 256 tokens and three of 128 weight rows, fp32), loaded once per CTA.
inline constexpr int kMaxBN = 256;
inline constexpr int kHeaderBytes = 1024 + 5 * 1024;
static_assert(1024 + 3 * (kMaxBN + kRows) * 4 <= kHeaderBytes, "the epilogue parameters overflow the header");
// Per-block promotion keeps two int32 accumulator sets and an fp32 total: token tiles up to 128 rows.
inline constexpr int kMaxBlockwiseBN = 128;
// One block per row (per token / per channel) accumulates all of K in int32: |Σ Aq·Bq| <= 128² · K < 2^31.
inline constexpr int64_t kMaxPerChannelK = 131071;
// Limits of the GEMM's 32-bit coordinates and grid (api.cpp checks them): K in k-blocks counted in int, N in
// grid.y tiles of kRows, M in int token-row coordinates of whole tiles (the largest tile is 256 rows).
inline constexpr int64_t kMaxK = int64_t{1} << 30;
inline constexpr int64_t kMaxN = int64_t{65535} * kRows;
inline constexpr int64_t kMaxM = (int64_t{1} << 31) - 1 - 256;

struct Shape {
  int64_t m = 0, n = 0, k = 0;
  int64_t block = 0;  // 32, 64, 128, or k
  int num_sms = 132;
  bool blockwise() const { return block != k; }
};

// k-blocks per ring stage: small token tiles (read-bound) carry two, so a stage is ~32 KB of weights; so does every
// block-wise tile (an even number of parameter blocks per stage: kernel.cuh alternates two accumulator sets).
constexpr int kblocks_per_stage(int bn, bool blockwise) { return (bn <= 32 || blockwise) ? 2 : 1; }

// One ring stage: the weight tile (kblocks × 128 rows × 128 B), the token tile (kblocks × bn × 128 B), and for the
// block-wise form the parameters of the stage's blocks: per block three token planes (scale, zero, sums: bn floats
// each) and three weight planes (128 floats each).
// Each plane starts on a 128-byte boundary (TMA's shared-memory destination alignment): a slot of `blocks` blocks of
// `rows` fp32 parameters (the kernel's PlaneSlots and stage_bytes both take it from here).
constexpr int plane_slot_bytes(int blocks, int rows) { return (blocks * rows * 4 + 127) / 128 * 128; }

struct StageBytes {
  int w = 0, x = 0, params = 0, total = 0;
  int token_plane = 0, weight_plane = 0;  // bytes of one plane slot
  int kblocks = 1, blocks = 0;  // blocks: parameter blocks per stage (0: one block per row, no parameters staged)
};
StageBytes stage_bytes(const Shape& shape, int bn);

struct Config {
  int bn = 8;      // token rows per CTA: 8, 32, 64, 128 or 256
  int splits = 1;  // K ranges across CTAs; > 1: 32-bit partials in the workspace, reduced by a second kernel
  int stages = 2;
  int64_t n_tiles = 0, m_tiles = 0;  // grid (m_tiles, n_tiles, splits): token tiles fastest
};

// m > 0; the shape must be valid (api.cpp checks first).
Config select_config(const Shape& shape);

std::size_t smem_bytes(const Shape& shape, const Config& config);
std::size_t partial_bytes(const Shape& shape, const Config& config);
// An upper bound of partial_bytes over every M <= max_m.
std::size_t max_partial_bytes(int64_t max_m, int64_t n, int num_sms);

}  // namespace tessera::linear::w8a8
