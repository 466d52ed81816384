// Grouped GEMM kernel: persistent, warp-specialized, TMA → shared-memory ring → wgmma, Yᵀ tiles.
//
// Threads 0..255 are two consumer warpgroups, threads 256..383 the producer warpgroup:
//   producer warp 0 (one lane): TMA loads of the weight tile [tile width (128 or 256) n × 128 B of K] and the
//     token tile [block_m rows × 128 B of K] of every k-block into the stage ring, 1 to 3 k-blocks per stage
//     (config.h: kblocks_per_stage);
//   producer warps 1-3 (block-wise scales only): the stage's products weight-block scale × token scale into the
//     same stage, arriving on the stage's full barrier, each warp every third stage;
//   consumer warpgroup c: its 64 or 128 weight rows of the tile, as one or two m64 blocks:
//     D[64 n × block_m tokens] = W[.., K] · X[tile, K]ᵀ with wgmma (weights in wgmma's M, tokens in its N).
//     fp8: every k-block of every m64 block goes to a fresh accumulator that is then added (with the block-wise
//     scale products) into an fp32 total (promotion); bf16: one accumulator over all of K.
//   epilogue: scale, round to bf16, store pairs of adjacent weights of one token (4 bytes) straight from the
//     accumulators after one shuffle, masked to the group's rows.
//
// Tiles: every group has its own tile shape (block_m token rows × 128 or 256 weight rows), chosen by each CTA from
// the group sizes in device memory (build_tile_table, config.h: tile_shape, large_block_m); the consumers run
// the matching instantiation of consume_tile. Group g has ceil(rows_g / block_m) m-tiles × N / width n-tiles,
// numbered group by group, n-tile major and m-tile fastest (CTAs running at the same time share weight tiles
// through L2). CTA b takes tiles b, b + grid, ... Token tiles are read through tensor maps over all of X: a tile
// that runs past its group's end reads the next group's rows (or zeros past the tensor), never stored.
#pragma once



#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/numeric.cuh"
#include "gemm/grouped/config.h"
#include "pipeline/pipeline.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace tessera::gemm::detail {
#ifdef TESSERA_GG_TRACE
// A timeline of the fp8 mainloop, for measurement builds only (-DTESSERA_GG_TRACE=K0, docs/perf/grouped_gemm.md,
// "An in-kernel timeline"): thread 0 of each consumer warpgroup of CTA 0 records clock64() at 7 points of k-blocks
// K0 .. K0 + 23 of the first 128-row tile it runs in the launch, and prints them once per process.
__device__ unsigned long long g_trace[2][24][7];
__device__ int g_trace_done;
#endif

// Registers per thread after setmaxnreg. A CTA keeps the registers it was launched with (the __launch_bounds__
// cap, 65536 / 384 rounded down to 8 = 168 per thread): what the producer gives back is all the consumers can
// take, or their setmaxnreg.inc waits forever.
inline constexpr int kProducerRegs = 56;
inline constexpr int kConsumerRegs = 224;
// Producer warps that write the block-wise scale products (warps 1..kScaleWarps of the producer warpgroup). Warp w
// waits on stage g's empty barrier knowing only that stage g - kScaleWarps - stages was released; its one-bit
// parity wait cannot be satisfied by an older phase only while stages >= kScaleWarps, so every ring must be that deep.
inline constexpr int kScaleWarps = 3;
// The named barrier of the two consumer warpgroups (256 threads) around a split tile's exchange (0 is __syncthreads).
inline constexpr int kSplitExchangeBarrier = 1;
static_assert(select_stages(kGroupedGemmMaxGroups) >= kScaleWarps, "the shallowest ring is shallower than kScaleWarps");
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= (65536 / kThreads / 8 * 8) * kThreads,
              "setmaxnreg budget exceeds the registers of the CTA");

struct KernelParams {
  int num_groups;
  int masked;       // Layout::kMasked
  int scaling;      // Scaling
  int stages;
  int64_t rows;     // contiguous: M; masked: max_m
  int64_t n;        // N (a multiple of 128)
  int k_blocks;     // K / (128 bytes)
  const int32_t* group_rows;
  __nv_bfloat16* y;
  int64_t y_row_stride, y_group_stride;
  const float* x_scale;
  int64_t xs_row_stride, xs_k_stride, xs_group_stride;
  const float* w_scale;
  int64_t ws_group_stride, ws_n_stride, ws_k_stride;
  // The MoE layer's fused activation (GroupedProblem::act; contiguous layout, weights in wgmma's M side only): the
  // weight maps interleave gate and up rows (launch.cu) and the epilogue writes act = Q(silu(gate) · up) instead of y.
  void* act;  // nullptr: not fused; else [rows][n / 2], e4m3 codes of act / *act_scale (fp8 operands) or bf16
  int64_t act_row_stride;
  const float* act_scale;
};

// Where tile t lives, and its shape (its group's).
struct TileCoord {
  int group;
  int m0;        // first row of the tile within the group
  int n0;        // first weight row (output column)
  int rows;      // rows of the tile that belong to the group (1..block_m)
  int64_t row0;  // contiguous: global row of the group's first row; masked: 0
  int block_m;   // token rows of the tile
  int halves;    // m64 weight blocks per consumer warpgroup (tile width 128 · halves)
  bool split;    // 64 weights wide, the two warpgroups splitting K (config.h: split_decode_tiles)
  __device__ __forceinline__ int width() const { return tile_width(halves, split); }
};

// The per-group counts and their prefix are 64-bit: with non-monotone offsets the groups may overlap and their
// tiles add up to more than M / 8 + G (up to G × M / 8 × N / 128), which must never wrap. Tile numbers
// themselves are int: total() saturates at 2^30 (so that t + gridDim cannot overflow either). Real problems stay
// far below it; only overlapping groups can reach it, and tiles past it are then not computed (those rows' values
// are unspecified anyway). Nothing wraps, so nothing is addressed outside the tensors.
struct TileTable {
  const int64_t* prefix;  // [G + 1] tiles before group g
  const int* start;       // [G]
  const int* rows;        // [G]
  const int* shape;       // [G] block_m | halves << 8 | split << 12
  int num_groups;
  int64_t n;

  __device__ __forceinline__ int total() const {
    return static_cast<int>(min(prefix[num_groups], int64_t{1} << 30));
  }

  __device__ __forceinline__ TileCoord at(int t) const {
    int lo = 0, hi = num_groups - 1;  // last g with prefix[g] <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (prefix[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int g = lo;
    TileCoord c;
    c.group = g;
    c.block_m = shape[g] & 0xFF;
    c.halves = (shape[g] >> 8) & 0xF;
    c.split = (shape[g] >> 12) != 0;
    const int local = static_cast<int>(t - prefix[g]);  // 0 <= local <= t
    const int m_tiles = (rows[g] + c.block_m - 1) / c.block_m;
    const int n_tile = local / m_tiles;
    const int m_tile = local - n_tile * m_tiles;
    c.m0 = m_tile * c.block_m;
    c.n0 = n_tile * c.width();
    c.rows = min(c.block_m, rows[g] - c.m0);
    c.row0 = start[g];
    return c;
  }
};

// Sum over the CTA of one int64 per thread (scratch: one slot per warp). Every thread gets the sum.
__device__ __forceinline__ int64_t cta_sum(int64_t v, int64_t* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int64_t sum = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) sum += scratch[w];
  __syncthreads();
  return sum;
}

// The tile table, by all kThreads threads: each group's clamped rows, its tile shape (tile_shape, with the height of
// groups above 32 rows chosen once for the launch by large_block_m, and a decode launch's 8-row tiles split or not by
// split_decode_tiles), its tile count, and their exclusive prefix sum. Every CTA computes the same table from the
// same group sizes.
__device__ void build_tile_table(const KernelParams& p, int64_t* prefix, int* start, int* rows, int* shape,
                                 int64_t* scratch) {
  constexpr int kPer = (kGroupedGemmMaxGroups + kThreads - 1) / kThreads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t r_[kPer];
  int64_t big128 = 0, big64 = 0, above8 = 0, tiles8 = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int g = tid * kPer + i;
    int64_t r = 0;
    if (g < p.num_groups) {
      int64_t s;
      if (p.masked) {
        s = 0;
        r = min(max(int64_t{p.group_rows[g]}, int64_t{0}), p.rows);
      } else {
        s = min(max(int64_t{p.group_rows[g]}, int64_t{0}), p.rows);
        const int64_t e = min(max(int64_t{p.group_rows[g + 1]}, s), p.rows);
        r = e - s;
      }
      start[g] = static_cast<int>(s);
      rows[g] = static_cast<int>(r);
      if (r > 32) {
        big128 += (r + 127) / 128 * (p.n / 256);
        big64 += (r + 63) / 64 * (p.n / 128);
      }
      if (r > 8) above8 += 1;
      else tiles8 += (r + 7) / 8 * (p.n / 128);
    }
    r_[i] = r;
  }
  const int large = large_block_m(cta_sum(big128, scratch), cta_sum(big64, scratch), gridDim.x, p.n);
  const bool decode_launch = cta_sum(above8, scratch) == 0;
  const bool split = decode_launch && split_decode_tiles(cta_sum(tiles8, scratch), gridDim.x);

  int64_t counts[kPer];
  int64_t sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int g = tid * kPer + i;
    int64_t c = 0;
    if (g < p.num_groups) {
      const TileShape ts = tile_shape(r_[i], large, split);
      shape[g] = ts.block_m | (ts.halves << 8) | (ts.split ? 1 << 12 : 0);
      c = (r_[i] + ts.block_m - 1) / ts.block_m * (p.n / tile_width(ts.halves, ts.split));
    }
    counts[i] = c;
    sum += c;
  }
  int64_t incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (tid == 0) {
    int64_t acc = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      const int64_t v = scratch[w];
      scratch[w] = acc;
      acc += v;
    }
    prefix[p.num_groups] = acc;
  }
  __syncthreads();
  int64_t run = scratch[warp] + incl - sum;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int g = tid * kPer + i;
    if (g < p.num_groups) prefix[g] = run;
    run += counts[i];
  }
}

// What the consumer warpgroups share.
struct ConsumerCtx {
  uint8_t* operands;     // [stages][kStageBytes]
  const float* scales;   // [stages][kStageScaleFloats]
  float* exchange;       // [4][128]: a split tile's second-warpgroup sums
  pipeline::StageRing ring;
};

// How a tile's work is split between the two consumer warpgroups and into wgmma "pieces". Both operands sit in the
// stage as K-major rows of 128 bytes, [weights][tokens]; only which of them is wgmma's A (M side) differs:
//   weights in M (kTokensInM false: bf16, per-tensor fp8, and the 8- and 32-row tiles of block-wise fp8):
//     warpgroup c takes weight rows 64c·halves.. as `halves` m64 pieces × all block_m tokens (N = block_m): a
//     decode-sized group wastes no tensor-core work.
//   tokens in M (kTokensInM true: the 64- and 128-row tiles of block-wise fp8), as DeepGEMM does. 128 × 256:
//     warpgroup c takes weights 128c..128c+127 (one scale block) × all 128 tokens as two m64n128 pieces, tokens
//     0-63 and 64-127, sharing their B operand; 64 × 128: all 64 tokens × weights 64c..64c+63 (m64n64). A thread's
//     accumulator then holds 2 token rows, so the block-wise promotion needs 2 scale products per piece and k-block
//     (read while the batch runs) instead of 32 after it. The shared-memory bytes per flop are the same either way.
//   split K (kSplitK: the 8 × 64 tiles of a decode launch, weights in M): both warpgroups take all 64 weight rows ×
//     8 tokens, warpgroup c the k-blocks 2c, 2c + 1 of each four-k-block stage; warpgroup 1 hands its sums to
//     warpgroup 0 through shared memory at the end of the tile (a fixed order: deterministic), which stores.
template <int kBlockM, int kHalves, bool kTokensInM_, bool kSplitK_ = false>
struct TileSplit {
  static constexpr bool kTokensInM = kTokensInM_;
  static constexpr bool kSplitK = kSplitK_;
  static_assert(!kTokensInM || (kBlockM >= 64 && kHalves == kBlockM / 64), "tokens in M: 64 × 128 or 128 × 256");
  static_assert(!kSplitK || (kBlockM == 8 && kHalves == 1 && !kTokensInM), "split K: 8 × 64 tiles, weights in M");
  static constexpr int kWidth = tile_width(kHalves, kSplitK);  // weight rows of the tile
  static constexpr int kPieces = kTokensInM ? kBlockM / 64 : kHalves;
  static constexpr int kN = kTokensInM ? 64 * kHalves : kBlockM;  // wgmma N
  // Byte offsets in a k-block's operands of piece p's A (M side) and B (N side) rows; weights first, then tokens.
  __device__ static int a_row(int wg, int p) {
    return kTokensInM ? kHalves * 128 + 64 * p : kSplitK ? 0 : (wg * kHalves + p) * 64;
  }
  __device__ static int b_row(int wg, int p) { return kTokensInM ? 64 * kHalves * wg : kWidth; }
  // Tokens in M: the first token (tile row) of piece p.
  __device__ static int tok_row(int p) { return 64 * p; }
  // The 128-weight scale block (slot of the block-wise products) of this warpgroup's pieces.
  __device__ static int ws_slot(int wg) { return kHalves == 2 ? wg : 0; }
};

// One tile of shape (kBlockM, kHalves) by a consumer warpgroup: the mainloop over K through the ring, then the
// epilogue. Stage st holds k-blocks kb0 .. kb0 + kblocks_per_stage - 1 of the tile, each as [weights][tokens].
template <bool kFP8, int kBlockM, int kHalves, bool kTokensInM_ = false, bool kSplitK = false, bool kFused = false>
__device__ __forceinline__ void consume_tile(const KernelParams& p, const ConsumerCtx& x, const TileCoord& c,
                                             pipeline::PipelineState& st) {
  using Split = TileSplit<kBlockM, kHalves, kTokensInM_, kSplitK>;
  constexpr bool kTokensInM = Split::kTokensInM;
  constexpr int kPieces = Split::kPieces;
  using Mma = ptx::Wgmma<Split::kN>;
  constexpr int kRegs = Mma::kRegs;
  constexpr int kKSteps = 4;  // wgmma per k-block: k32 fp8 / k16 bf16, 32 bytes each
  constexpr int kPerStage = kblocks_per_stage(kBlockM, Split::kWidth);
  constexpr int kSub = kblock_bytes(kBlockM, Split::kWidth);
  // The k-blocks of each stage this warpgroup takes: all, or (split K) its half of them.
  static_assert(!kSplitK || kPerStage % 2 == 0, "split K: an even number of k-blocks per stage");
  constexpr int kMine = kSplitK ? kPerStage / 2 : kPerStage;
  const int lane = threadIdx.x & 31, wg = threadIdx.x / 128, warp = (threadIdx.x >> 5) & 3;
  const bool blockwise = p.scaling == static_cast<int>(Scaling::kBlockwise);
  const int col_pair = 2 * (lane & 3);        // accumulator columns 8j + col_pair + {0, 1}
  const int row_lo = warp * 16 + (lane >> 2);  // accumulator rows row_lo (registers 4j, 4j+1) and row_lo + 8

  // One k-block of piece h of this warpgroup: 4 wgmma of 32 bytes of K each.
  auto issue = [&](float(&acc)[kRegs], const uint8_t* sub, int h, bool accumulate) {
    const uint64_t desc_a = ptx::wgmma_desc_k_major_sw128(sub + Split::a_row(wg, h) * kTileKBytes);
    const uint64_t desc_b = ptx::wgmma_desc_k_major_sw128(sub + Split::b_row(wg, h) * kTileKBytes);
#pragma unroll
    for (int s = 0; s < kKSteps; ++s) {
      const int scale_d = (accumulate || s > 0) ? 1 : 0;
      if constexpr (kFP8) Mma::mma_e4m3(acc, desc_a + 2 * s, desc_b + 2 * s, scale_d);
      else Mma::mma_bf16(acc, desc_a + 2 * s, desc_b + 2 * s, scale_d);
    }
  };
  auto release = [&](const pipeline::PipelineState& done) {
    if (blockwise) {
      x.ring.consumer_release(done);
    } else {
      __syncwarp();
      if (lane == 0) x.ring.consumer_release(done);
    }
  };

  float total[kPieces][kRegs];
#pragma unroll
  for (int h = 0; h < kPieces; ++h)
#pragma unroll
    for (int i = 0; i < kRegs; ++i) total[h][i] = 0.0f;

  if constexpr (kFP8) {
    // Every k-block of every piece goes to a fresh fp8 accumulator that is promoted into the fp32 total:
    // total += part (per-tensor) or total += ws · xs · part (block-wise). The promotion reads the
    // accumulator, and ptxas serializes wgmma left in flight across such reads, so each batch completes first;
    // the two consumer warpgroups interleave over the promotions instead.
    float part[kRegs];
#ifdef TESSERA_GG_TRACE
    const bool tr = kBlockM == 128 && blockIdx.x == 0 && (threadIdx.x & 127) == 0 &&
                    *reinterpret_cast<volatile int*>(&g_trace_done) == 0;
    // Point i of k-block kb: 0 stage full, 1 + 3h piece h committed, 2 + 3h its batch complete, 3 + 3h promoted.
#define TESSERA_GG_STAMP(kb, i)                                                       \
  do {                                                                                \
    const int k_ = (kb) - (TESSERA_GG_TRACE);                                         \
    if (tr && k_ >= 0 && k_ < 24) g_trace[wg][k_][i] = clock64();                    \
  } while (0)
#define TESSERA_GG_STAMP_PROMOTED(kb, h)   \
  do {                                     \
    ptx::wgmma_fence_registers(total[h]);  \
    TESSERA_GG_STAMP(kb, 3 + 3 * (h));     \
  } while (0)
#else
#define TESSERA_GG_STAMP(kb, i) \
  do {                          \
  } while (0)
#define TESSERA_GG_STAMP_PROMOTED(kb, h) \
  do {                                   \
  } while (0)
#endif
    for (int kb0 = 0; kb0 < p.k_blocks; kb0 += kPerStage) {
      x.ring.consumer_wait(st);
      TESSERA_GG_STAMP(kb0, 0);
#pragma unroll
      for (int i = 0; i < kMine; ++i) {
        const int j = (kSplitK ? wg * kMine : 0) + i;  // k-block of the stage
        const uint8_t* sub = x.operands + st.stage * kStageBytes + j * kSub;
        const bool last_kb = i + 1 == kMine;
        // The stage's products (config.h, kStageScaleFloats): [slot][kMaxBlockM] or [k-block][block_m].
        const float* prod = x.scales + st.stage * kStageScaleFloats +
                            (kPerStage == 1 ? Split::ws_slot(wg) * kMaxBlockM : j * kBlockM);
#pragma unroll
        for (int h = 0; h < kPieces; ++h) {
          ptx::wgmma_fence();
          issue(part, sub, h, false);
          ptx::wgmma_commit_group();
          // Tokens in M: the thread's two products are read while the batch runs.
          float s_lo = 0.0f, s_hi = 0.0f;
          if (kTokensInM && blockwise) {
            s_lo = ptx::ld_shared_f32(prod + Split::tok_row(h) + row_lo);
            s_hi = ptx::ld_shared_f32(prod + Split::tok_row(h) + row_lo + 8);
          }
          TESSERA_GG_STAMP(kb0, 1 + 3 * h);
          ptx::wgmma_wait_group<0>();
          ptx::wgmma_fence_registers(part);
          TESSERA_GG_STAMP(kb0, 2 + 3 * h);
          if (blockwise) {
            // All products first, then the stage is released (this thread's last read of it), then the FMAs.
            if constexpr (kTokensInM) {
              if (last_kb && h + 1 == kPieces) release(st);
#pragma unroll
              for (int q = 0; q < kRegs / 4; ++q) {
                total[h][4 * q + 0] = fmaf(part[4 * q + 0], s_lo, total[h][4 * q + 0]);
                total[h][4 * q + 1] = fmaf(part[4 * q + 1], s_lo, total[h][4 * q + 1]);
                total[h][4 * q + 2] = fmaf(part[4 * q + 2], s_hi, total[h][4 * q + 2]);
                total[h][4 * q + 3] = fmaf(part[4 * q + 3], s_hi, total[h][4 * q + 3]);
              }
            } else {
              float2 s01[kBlockM / 8];
#pragma unroll
              for (int q = 0; q < kBlockM / 8; ++q) s01[q] = ptx::ld_shared_v2_f32(prod + 8 * q + col_pair);
              if (last_kb && h + 1 == kPieces) release(st);
#pragma unroll
              for (int q = 0; q < kBlockM / 8; ++q) {
                total[h][4 * q + 0] = fmaf(part[4 * q + 0], s01[q].x, total[h][4 * q + 0]);
                total[h][4 * q + 1] = fmaf(part[4 * q + 1], s01[q].y, total[h][4 * q + 1]);
                total[h][4 * q + 2] = fmaf(part[4 * q + 2], s01[q].x, total[h][4 * q + 2]);
                total[h][4 * q + 3] = fmaf(part[4 * q + 3], s01[q].y, total[h][4 * q + 3]);
              }
            }
          } else {
            if (last_kb && h + 1 == kPieces) release(st);
#pragma unroll
            for (int i = 0; i < kRegs; ++i) total[h][i] += part[i];
          }
          TESSERA_GG_STAMP_PROMOTED(kb0, h);
        }
      }
      st.advance(p.stages);
    }
#ifdef TESSERA_GG_TRACE
    if (tr) {  // cycles since warpgroup 0's first recorded stage
      __threadfence();
      const unsigned long long t0 = *reinterpret_cast<volatile unsigned long long*>(&g_trace[0][0][0]);
      for (int k = 0; k < 24; ++k) {
        const unsigned long long* e = g_trace[wg][k];
        printf("trace scaling %d kb %3d wg %d | full %7lld commit0 %7lld done0 %7lld promoted0 %7lld commit1 %7lld "
               "done1 %7lld promoted1 %7lld\n",
               p.scaling, k + TESSERA_GG_TRACE, wg, (long long)(e[0] - t0), (long long)(e[1] - t0),
               (long long)(e[2] - t0), (long long)(e[3] - t0), (long long)(e[4] - t0), (long long)(e[5] - t0),
               (long long)(e[6] - t0));
      }
      if (wg == 1) g_trace_done = 1;
    }
#endif
#undef TESSERA_GG_STAMP
#undef TESSERA_GG_STAMP_PROMOTED
  } else {
    // bf16: one fp32 accumulator over all of K; a stage's batch stays in flight while the next stage is awaited,
    // and a stage is released once the batch after it is issued and it has completed.
    pipeline::PipelineState prev = st;
    for (int kb0 = 0; kb0 < p.k_blocks; kb0 += kPerStage) {
      x.ring.consumer_wait(st);
      ptx::wgmma_fence();
#pragma unroll
      for (int i = 0; i < kMine; ++i) {
        const uint8_t* sub = x.operands + st.stage * kStageBytes + ((kSplitK ? wg * kMine : 0) + i) * kSub;
#pragma unroll
        for (int h = 0; h < kPieces; ++h) issue(total[h], sub, h, kb0 + i > 0);
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<1>();
      if (kb0 > 0) release(prev);
      prev = st;
      st.advance(p.stages);
    }
    ptx::wgmma_wait_group<0>();
#pragma unroll
    for (int h = 0; h < kPieces; ++h) ptx::wgmma_fence_registers(total[h]);
    release(prev);
  }

  // ---- split K: warpgroup 1's sums added to warpgroup 0's (same accumulator layout: thread t of either holds the
  // same outputs), always in this order; warpgroup 0 stores the tile. The second barrier keeps the exchange buffer
  // until warpgroup 0 has read it.
  if constexpr (kSplitK) {
    static_assert(kPieces == 1 && kRegs * 128 * 4 <= 128 * 4 * 4, "the exchange buffer holds one m64n8 accumulator");
    const int t = threadIdx.x & 127;
    if (wg == 1) {
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::st_shared_f32(x.exchange + i * 128 + t, total[0][i]);
    }
    ptx::named_barrier_sync(kSplitExchangeBarrier, 256);
    if (wg == 0) {
#pragma unroll
      for (int i = 0; i < kRegs; ++i) total[0][i] += ptx::ld_shared_f32(x.exchange + i * 128 + t);
    }
    ptx::named_barrier_sync(kSplitExchangeBarrier, 256);
    if (wg == 1) return;
  }

  // ---- epilogue: scale, bf16, 4-byte stores of two adjacent outputs of one token straight from the accumulators.
  float factor = 1.0f;
  if (p.scaling == static_cast<int>(Scaling::kPerTensor)) factor = p.x_scale[0] * p.w_scale[c.group * p.ws_group_stride];
  __nv_bfloat16* y_tile = p.y + (p.masked ? c.group * p.y_group_stride : int64_t{0}) +
                          (c.row0 + c.m0) * p.y_row_stride + c.n0;
  if constexpr (kTokensInM) {
    // Registers 4q + {0, 1}: token tok_row(h) + row_lo, weights 8q + col_pair + {0, 1} of the warpgroup's columns;
    // 4q + {2, 3}: the token 8 rows below.
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      __nv_bfloat16* y_piece = y_tile + Split::b_row(wg, h);
#pragma unroll
      for (int half8 = 0; half8 < 2; ++half8) {
        const int token = Split::tok_row(h) + row_lo + 8 * half8;
        if (token < c.rows) {
#pragma unroll
          for (int q = 0; q < kRegs / 4; ++q) {
            const __nv_bfloat162 pair = __floats2bfloat162_rn(total[h][4 * q + 2 * half8] * factor,
                                                              total[h][4 * q + 2 * half8 + 1] * factor);
            *reinterpret_cast<__nv_bfloat162*>(y_piece + token * p.y_row_stride + 8 * q + col_pair) = pair;
          }
        }
      }
    }
  } else if constexpr (kFused) {
    // The fused activation. The weight maps put gate rows in tile rows 16c..16c+7 and the matching up rows in
    // 16c+8..16c+15 (launch.cu), so a thread's registers 4q, 4q+1 (row row_lo: a gate row) and 4q+2, 4q+3 (row
    // row_lo + 8: its up row) hold both halves of act column 8c + lane/4 for tokens 8q + col_pair and + 1. h is
    // rounded to bf16 as the separate first GEMM stores it and silu_mul is the activation step's, so act gets the
    // same bits either way. The 8 lanes sharing lane & 3 hold 8 adjacent columns of the same two tokens; 8 shuffles
    // gather them, and lanes 0-3 store the first token's 8 codes (8 bytes, or 16 in bf16), lanes 4-7 the second's.
    const float inv = kFP8 ? 1.0f / __ldg(p.act_scale) : 1.0f;
    constexpr int kActBytes = kFP8 ? 1 : 2;
    const auto round_bf16 = [](float v) { return __bfloat162float(__float2bfloat16_rn(v)); };
    uint8_t* act_tile = static_cast<uint8_t*>(p.act) +
                        ((c.row0 + c.m0) * p.act_row_stride + c.n0 / 2) * kActBytes;
    const int pick = lane >> 2;  // 0: store token 8q + col_pair, 1: the next token, else nothing
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
      const int col = (Split::a_row(wg, h) + warp * 16) / 2;  // the warp's first act column of the tile
#pragma unroll
      for (int q = 0; q < kBlockM / 8; ++q) {
        const float v0 = ::tessera::detail::silu_mul(round_bf16(total[h][4 * q] * factor),
                                                     round_bf16(total[h][4 * q + 2] * factor));
        const float v1 = ::tessera::detail::silu_mul(round_bf16(total[h][4 * q + 1] * factor),
                                                     round_bf16(total[h][4 * q + 3] * factor));
        const int token = 8 * q + col_pair + pick;
        const bool store = pick < 2 && token < c.rows;
        uint8_t* dst = act_tile + (token * p.act_row_stride + col) * kActBytes;
        if constexpr (kFP8) {
          // Low byte: the first token's code, high byte: the second's.
          const uint32_t mine = __nv_cvt_float2_to_fp8x2(make_float2(v0 * inv, v1 * inv), __NV_SATFINITE, __NV_E4M3);
          uint32_t w[2] = {0u, 0u};
#pragma unroll
          for (int src = 0; src < 8; ++src) {
            const uint32_t o = __shfl_sync(0xffffffffu, mine, (lane & 3) + 4 * src);
            w[src >> 2] |= ((pick == 1 ? o >> 8 : o) & 0xFFu) << (8 * (src & 3));
          }
          if (store) *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
        } else {
          // Low half: the first token's bf16, high half: the second's.
          const uint32_t mine = ::tessera::detail::pack2<false>(v0, v1);
          uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
          for (int src = 0; src < 8; ++src) {
            const uint32_t o = __shfl_sync(0xffffffffu, mine, (lane & 3) + 4 * src);
            w[src >> 1] |= ((pick == 1 ? o >> 16 : o) & 0xFFFFu) << (16 * (src & 1));
          }
          if (store) *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
  } else {
    // Lanes l and l^4 hold weight rows r and r^1 of the same token columns; one shuffle gives each a pair of
    // adjacent weights of one token (even row: token c, odd row: token c+1).
    const bool odd = (lane >> 2) & 1;
#pragma unroll
    for (int h = 0; h < kPieces; ++h) {
#pragma unroll
      for (int q = 0; q < kBlockM / 8; ++q) {
#pragma unroll
        for (int half8 = 0; half8 < 2; ++half8) {
          const float v0 = total[h][4 * q + 2 * half8] * factor;      // (row r, token c)
          const float v1 = total[h][4 * q + 2 * half8 + 1] * factor;  // (row r, token c + 1)
          const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
          const int row = Split::a_row(wg, h) + row_lo + 8 * half8 - (odd ? 1 : 0);  // even row of the pair
          const int token = 8 * q + col_pair + (odd ? 1 : 0);
          if (token < c.rows) {
            const __nv_bfloat162 pair = odd ? __floats2bfloat162_rn(other, v1) : __floats2bfloat162_rn(v0, other);
            *reinterpret_cast<__nv_bfloat162*>(y_tile + token * p.y_row_stride + row) = pair;
          }
        }
      }
    }
  }
}

// kFused: the MoE layer's fused activation (KernelParams::act set; its own instantiation, so that the plain GEMM's
// code is not touched by the epilogue's).
template <bool kFP8, bool kFused>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_x8, const __grid_constant__ CUtensorMap tmap_x64,
                        const __grid_constant__ CUtensorMap tmap_x128, const __grid_constant__ CUtensorMap tmap_w,
                        const __grid_constant__ CUtensorMap tmap_w256, const __grid_constant__ CUtensorMap tmap_w64,
                        const __grid_constant__ KernelParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kElemBytes = kFP8 ? 1 : 2;
  constexpr int kKElems = kTileKBytes / kElemBytes;  // K elements per k-block

  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const SmemLayout L = SmemLayout::make(p.stages, p.num_groups);
  uint8_t* operands = base;                                        // [stages][kStageBytes]
  float* scales = reinterpret_cast<float*>(base + L.operands_bytes);  // [stages][kStageScaleFloats]
  float* exchange = reinterpret_cast<float*>(base + L.operands_bytes + L.scales_bytes);
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + L.operands_bytes + L.scales_bytes + L.exchange_bytes);
  int64_t* scratch = reinterpret_cast<int64_t*>(bars + 2 * p.stages);  // [2 × kThreads / 32]
  int64_t* t_prefix = scratch + 2 * (kThreads / 32);                    // [G + 1]
  int* t_start = reinterpret_cast<int*>(t_prefix + p.num_groups + 1);
  int* t_rows = t_start + p.num_groups;
  int* t_shape = t_rows + p.num_groups;

  const pipeline::StageRing ring{bars, bars + p.stages, p.stages};
  const bool blockwise = p.scaling == static_cast<int>(Scaling::kBlockwise);

  build_tile_table(p, t_prefix, t_start, t_rows, t_shape, scratch);
  // full: the TMA thread (+ the 32 scale lanes). empty: one arrival per consumer warp, or per consumer thread
  // when the consumers read the stage's scales with ordinary loads (an arrival releases only its own thread's
  // accesses; wgmma reads of the operand tiles need none).
  if (threadIdx.x == 0) ring.init(blockwise ? 1 + 32 : 1, blockwise ? 256 : 8);
  __syncthreads();

  const TileTable tiles{t_prefix, t_start, t_rows, t_shape, p.num_groups, p.n};
  const int total_tiles = tiles.total();
  const int wg = threadIdx.x / 128;

  if (wg == 2) {
    // ------------------------------------------------------------------ producer warpgroup
    ptx::setmaxnreg_dec<kProducerRegs>();
    const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    if (warp == 0 && lane == 0) {
      ptx::prefetch_tensormap(&tmap_x8);
      ptx::prefetch_tensormap(&tmap_x64);
      ptx::prefetch_tensormap(&tmap_w);
      ptx::prefetch_tensormap(&tmap_x128);
      ptx::prefetch_tensormap(&tmap_w256);
      ptx::prefetch_tensormap(&tmap_w64);
      pipeline::PipelineState st;
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        const TileCoord c = tiles.at(t);
        const int x_row = static_cast<int>(c.row0) + c.m0;
        const int x_grp = p.masked ? c.group : 0;
        const int width = c.width();
        const int per_stage = kblocks_per_stage(c.block_m, width);
        const int sub_bytes = kblock_bytes(c.block_m, width);
        const int w_bytes = width * kTileKBytes;
        // One box per operand and k-block, except 32-row token tiles (four boxes of 8 rows; a 32-row map would be
        // a seventh tensor map for the least common shape): tokens in boxes of 8, 64 or 128 rows, weights of 64,
        // 128 or 256 rows.
        const CUtensorMap* x_map = c.block_m == 128 ? &tmap_x128 : c.block_m == 64 ? &tmap_x64 : &tmap_x8;
        const int x_box_rows = c.block_m >= 64 ? c.block_m : 8;
        const CUtensorMap* w_map = c.split ? &tmap_w64 : c.halves == 2 ? &tmap_w256 : &tmap_w;
        for (int kb0 = 0; kb0 < p.k_blocks; kb0 += per_stage) {
          ring.producer_acquire(st);
          uint64_t* full = &ring.full[st.stage];
          // A stage always carries per_stage k-blocks: past K (the last stage of a tile) the boxes lie outside the
          // tensor and TMA fills them with zeros (and counts their bytes), so the consumers run a fixed number of
          // wgmma per stage: a data-dependent count would make ptxas serialize the bf16 wgmma pipeline.
          ptx::mbarrier_arrive_expect_tx(full, static_cast<uint32_t>(per_stage * sub_bytes));
          for (int j = 0; j < per_stage; ++j) {
            uint8_t* sub = operands + st.stage * kStageBytes + j * sub_bytes;
            const int k0 = (kb0 + j) * kKElems;
            // Fused: a 5-D map [G][I/8 chunks][gate, up][8 rows][K bytes]; a tile's rows n0.. are chunks n0/16..
            if constexpr (kFused)
              ptx::tma_load_5d(sub, w_map, full, (kb0 + j) * kTileKBytes, 0, 0, c.n0 / 16, c.group);
            else
              ptx::tma_load_3d(sub, w_map, full, k0, c.n0, c.group);
            for (int r = 0; r < c.block_m; r += x_box_rows)
              ptx::tma_load_3d(sub + w_bytes + r * kTileKBytes, x_map, full, k0, x_row + r, x_grp);
          }
          st.advance(p.stages);
        }
      }
    } else if (kFP8 && warp >= 1 && warp <= kScaleWarps && blockwise) {
      // Block-wise scales of each stage's k-blocks, as the products ws[nb] · xs[row] for each consumer
      // warpgroup's 128-row weight block ([k-block][slot][kMaxBlockM] fp32), so that the promotion is one FMA per
      // element. The next stage's loads are issued before this one waits for its slot. A one-k-block stage
      // (the compute-bound 128-row tiles, where the ring is shallow and every cycle of this warp between a release
      // and its arrival shows): lane l takes rows l + 32i and loads both weight-block scales itself. A stage of
      // 2 or 3 k-blocks (decode tiles): the lanes cover its (k-block, row) pairs (block_m × k-blocks ≤ 128) and
      // lanes 0.. one weight scale each, shuffled to the lanes that use it: one load round trip per stage, not one
      // per k-block.
      constexpr int kPerLane = kMaxBlockM / 32;
      float x_next[kPerLane], w_next[2] = {0.0f, 0.0f};
      auto load = [&](const TileCoord& c, int kb0) {
        const int per_stage = kblocks_per_stage(c.block_m, c.width());
        const int n_kb = min(per_stage, p.k_blocks - kb0);
        const int shift = per_stage == 1 ? 7 : __ffs(c.block_m) - 1;  // pair -> (k-block, row); block_m: 2^k
        // Rows of x_scale that exist: contiguous rows < M (global), masked rows < max_m (in the group).
        const int64_t row_limit = p.masked ? p.rows : p.rows - c.row0;
        const float* xs = p.x_scale + (p.masked ? c.group * p.xs_group_stride : c.row0 * p.xs_row_stride) +
                          kb0 * p.xs_k_stride;
        const float* ws = p.w_scale + c.group * p.ws_group_stride + (c.n0 / kGroupedGemmBlock) * p.ws_n_stride +
                          kb0 * p.ws_k_stride;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int pair = lane + 32 * i, j = pair >> shift, row = pair & (c.block_m - 1);
          const int64_t r = c.m0 + row;
          x_next[i] = (j < n_kb && pair - (j << shift) < c.block_m && r < row_limit)
                          ? __ldg(xs + r * p.xs_row_stride + j * p.xs_k_stride)
                          : 0.0f;
        }
        if (per_stage == 1) {
          w_next[0] = __ldg(ws);
          w_next[1] = c.halves == 2 ? __ldg(ws + p.ws_n_stride) : 0.0f;
        } else {
          const int j = lane / c.halves, sl = lane - j * c.halves;
          w_next[0] = j < n_kb ? __ldg(ws + sl * p.ws_n_stride + j * p.ws_k_stride) : 0.0f;
        }
      };
      // The stages of this CTA in order: tile t, its k-blocks kb0, kb0 + per_stage, ... Warp w (1..kScaleWarps)
      // takes stages w - 1, w - 1 + kScaleWarps, ...: one warp's loads are in flight while the others fill their
      // stages, kScaleWarps stages ahead of its own next one (a single warp, one stage ahead, was bound by the
      // global-load latency: the consumers found block-wise stages not yet full 30 times more often than
      // per-tensor ones; docs/perf/grouped_gemm.md, v7).
      int t = blockIdx.x, kb0 = 0;
      TileCoord c{};
      if (t < total_tiles) c = tiles.at(t);
      pipeline::PipelineState st;
      auto next_stage = [&]() {
        kb0 += kblocks_per_stage(c.block_m, c.width());
        if (kb0 >= p.k_blocks) {
          kb0 = 0;
          t += gridDim.x;
          if (t < total_tiles) c = tiles.at(t);
        }
        st.advance(p.stages);
      };
      for (int i = 1; i < warp && t < total_tiles; ++i) next_stage();
      if (t < total_tiles) load(c, kb0);
      while (t < total_tiles) {
        float x_cur[kPerLane];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) x_cur[i] = x_next[i];
        const float w0 = w_next[0], w1 = w_next[1];
        const int block_m = c.block_m, halves = c.halves;
        const int per_stage = kblocks_per_stage(block_m, c.width());
        const pipeline::PipelineState mine = st;
#pragma unroll 1
        for (int i = 0; i < kScaleWarps && t < total_tiles; ++i) next_stage();
        if (t < total_tiles) load(c, kb0);
        ring.producer_acquire(mine);
        float* dst = scales + mine.stage * kStageScaleFloats;
        if (per_stage == 1) {
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) {
            const int row = lane + 32 * i;
            if (row < block_m) {
              ptx::st_shared_f32(dst + row, w0 * x_cur[i]);
              if (halves == 2) ptx::st_shared_f32(dst + kMaxBlockM + row, w1 * x_cur[i]);
            }
          }
        } else {
          // A multi-k-block stage's products are [k-block][block_m] (halves is 1 for every such tile): pair
          // j · block_m + row is product (k-block j, row).
          const int shift = __ffs(block_m) - 1;
#pragma unroll
          for (int i = 0; i < kPerLane; ++i) {
            const int pair = lane + 32 * i, j = pair >> shift;
            const float w = __shfl_sync(0xffffffffu, w0, j & 31);
            if (j < per_stage) ptx::st_shared_f32(dst + pair, w * x_cur[i]);
          }
        }
        ptx::mbarrier_arrive(&ring.full[mine.stage]);
      }
    }
  } else {
    // ------------------------------------------------------------------ consumer warpgroups
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const ConsumerCtx ctx{operands, scales, exchange, ring};
    pipeline::PipelineState st;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = tiles.at(t);
      // Block-wise fp8 runs its 64- and 128-row tiles with tokens in wgmma's M side (TileSplit), every other
      // mode with weights in M: measured on an H200 (docs/perf/grouped_gemm.md, v7), tokens in M made block-wise
      // 2-6 % faster and per-tensor / bf16 3-18 % slower.
      // The fourth template argument is kFP8, not true: the bf16 kernel never runs tokens in M, so it does not
      // instantiate those tiles.
      const bool tokens_in_m = kFP8 && !kFused && blockwise;
      switch (c.block_m) {
        case 8:
          if (c.split) consume_tile<kFP8, 8, 1, false, true, kFused>(p, ctx, c, st);
          else consume_tile<kFP8, 8, 1, false, false, kFused>(p, ctx, c, st);
          break;
        case 32: consume_tile<kFP8, 32, 1, false, false, kFused>(p, ctx, c, st); break;
        case 64:
          if (tokens_in_m) consume_tile<kFP8, 64, 1, kFP8 && !kFused>(p, ctx, c, st);
          else consume_tile<kFP8, 64, 1, false, false, kFused>(p, ctx, c, st);
          break;
        default:
          if (tokens_in_m) consume_tile<kFP8, 128, 2, kFP8 && !kFused>(p, ctx, c, st);
          else consume_tile<kFP8, 128, 2, false, false, kFused>(p, ctx, c, st);
          break;
      }
    }
  }
#endif
}

}  // namespace tessera::gemm::detail
