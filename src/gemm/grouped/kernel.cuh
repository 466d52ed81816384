// Grouped GEMM kernel: persistent, warp-specialized, TMA → shared-memory ring → wgmma, Yᵀ tiles.
//
// Threads 0..255 are two consumer warpgroups, threads 256..383 the producer warpgroup:
//   producer warp 0 (one lane): TMA loads of the weight tile [tile width (128 or 256) n × 128 B of K] and the
//     token tile [block_m rows × 128 B of K] of every k-block into the stage ring;
//   producer warp 1 (block-wise scales only): the k-block's products weight-block scale × token scale into the
//     same stage, arriving on the stage's full barrier;
//   consumer warpgroup c: its kWgRows (64 or 128) weight rows of the tile, as one or two m64 blocks:
//     D[64 n × block_m tokens] = W[.., K] · X[tile, K]ᵀ with wgmma (weights in wgmma's M, tokens in its N).
//     fp8: every k-block of every m64 block goes to a fresh accumulator that is then added (with the block-wise
//     scale products) into an fp32 total (promotion); bf16: one accumulator over all of K.
//   epilogue: scale, round to bf16, store pairs of adjacent weights of one token (4 bytes) straight from the
//     accumulators after one shuffle, masked to the group's rows.
//
// Tiles: for group g, ceil(rows_g / block_m) m-tiles × N / tile width n-tiles, numbered group by group, n-tile
// major and m-tile fastest (CTAs running at the same time share weight tiles through L2). CTA b takes tiles b,
// b + grid, ... Token tiles are read through one tensor map over all of X: a tile that runs past its group's
// end reads the next group's rows (or zeros past the tensor), and those rows are never stored.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "gemm/grouped/config.h"
#include "pipeline/pipeline.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace tessera::gemm::detail {

// Registers per thread after setmaxnreg. A CTA keeps the registers it was launched with (the __launch_bounds__
// cap, 65536 / 384 rounded down to 8 = 168 per thread): what the producer gives back is all the consumers can
// take, or their setmaxnreg.inc waits forever.
inline constexpr int kProducerRegs = 56;
inline constexpr int kConsumerRegs = 224;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= (65536 / kThreads / 8 * 8) * kThreads,
              "setmaxnreg budget exceeds the registers of the CTA");

struct KernelParams {
  int num_groups;
  int masked;       // Layout::kMasked
  int scaling;      // Scaling
  int stages;
  int64_t rows;     // contiguous: M; masked: max_m
  int n_tiles;      // N / 128
  int k_blocks;     // K / (128 bytes)
  const int32_t* group_rows;
  __nv_bfloat16* y;
  int64_t y_row_stride, y_group_stride;
  const float* x_scale;
  int64_t xs_row_stride, xs_k_stride, xs_group_stride;
  const float* w_scale;
  int64_t ws_group_stride, ws_n_stride, ws_k_stride;
};

// Where tile t lives.
struct TileCoord {
  int group;
  int m0;        // first row of the tile within the group
  int n0;        // first weight row (output column)
  int rows;      // rows of the tile that belong to the group (1..block_m)
  int64_t row0;  // contiguous: global row of the group's first row; masked: 0
};

// The per-group counts and their prefix are 64-bit: with non-monotone offsets the groups may overlap and their
// tiles add up to more than M / block_m + G (up to G × M / block_m × N / tile width), which must never wrap.
// Tile numbers themselves are int: total() saturates at 2^30 (so that t + gridDim cannot overflow either). Real
// problems stay far below it (M / 8 × N / 128 < 2^30 up to millions of rows of K bytes each); only overlapping
// groups can reach it, and tiles past it are then not computed (those rows' values are unspecified anyway).
// Nothing wraps, so nothing is addressed outside the tensors.
template <int kBlockM, int kTileWidth>
struct TileTable {
  const int64_t* prefix;  // [G + 1] tiles before group g
  const int* start;       // [G]
  const int* rows;        // [G]
  int num_groups;
  int n_tiles;

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
    const int local = static_cast<int>(t - prefix[g]);  // 0 <= local <= t
    const int m_tiles = (rows[g] + kBlockM - 1) / kBlockM;
    const int n_tile = local / m_tiles;
    const int m_tile = local - n_tile * m_tiles;
    TileCoord c;
    c.group = g;
    c.m0 = m_tile * kBlockM;
    c.n0 = n_tile * kTileWidth;
    c.rows = min(kBlockM, rows[g] - c.m0);
    c.row0 = start[g];
    return c;
  }
};

// Exclusive prefix sum of the per-group tile counts into table.prefix, by all kThreads threads.
template <int kBlockM>
__device__ void build_tile_table(const KernelParams& p, int64_t* prefix, int* start, int* rows, int64_t* scratch) {
  constexpr int kPer = (kGroupedGemmMaxGroups + kThreads - 1) / kThreads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t counts[kPer];
  int64_t sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int g = tid * kPer + i;
    int64_t c = 0;
    if (g < p.num_groups) {
      int64_t s, r;
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
      c = (r + kBlockM - 1) / kBlockM * p.n_tiles;
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

template <bool kFP8, int kBlockM, int kWgRows>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w,
                        const __grid_constant__ KernelParams p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mma = ptx::Wgmma<kBlockM>;
  constexpr int kRegs = Mma::kRegs;
  constexpr int kTileWidth = 2 * kWgRows;            // weight rows per tile
  constexpr int kHalves = kWgRows / 64;              // m64 wgmma blocks per consumer warpgroup
  constexpr int kElemBytes = kFP8 ? 1 : 2;
  constexpr int kKElems = kTileKBytes / kElemBytes;  // K elements per k-block
  constexpr int kKSteps = 4;                         // wgmma per k-block: k32 fp8 / k16 bf16, 32 bytes each

  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const SmemLayout L = SmemLayout::make(kBlockM, kTileWidth, p.stages, p.num_groups);
  uint8_t* smem_w = base;                                        // [stages][tile width][128 B]
  uint8_t* smem_x = base + p.stages * L.stage_w_bytes;           // [stages][block_m][128 B]
  uint8_t* smem_scales = base + L.operands_bytes;                // [stages][2 weight blocks][block_m] fp32
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_scales + L.scales_bytes);
  int64_t* scratch = reinterpret_cast<int64_t*>(bars + 2 * p.stages);  // [kThreads / 32]
  int64_t* t_prefix = scratch + kThreads / 32;                          // [G + 1]
  int* t_start = reinterpret_cast<int*>(t_prefix + p.num_groups + 1);
  int* t_rows = t_start + p.num_groups;

  const pipeline::StageRing ring{bars, bars + p.stages, p.stages};
  const bool blockwise = p.scaling == static_cast<int>(Scaling::kBlockwise);

  build_tile_table<kBlockM>(p, t_prefix, t_start, t_rows, scratch);
  // full: the TMA thread (+ the 32 scale lanes). empty: one arrival per consumer warp, or per consumer thread
  // when the consumers read the stage's scales with ordinary loads (an arrival releases only its own thread's
  // accesses; wgmma reads of the operand tiles need none).
  if (threadIdx.x == 0) ring.init(blockwise ? 1 + 32 : 1, blockwise ? 256 : 8);
  __syncthreads();

  const TileTable<kBlockM, kTileWidth> tiles{t_prefix, t_start, t_rows, p.num_groups, p.n_tiles};
  const int total_tiles = tiles.total();
  const int wg = threadIdx.x / 128;

  if (wg == 2) {
    // ------------------------------------------------------------------ producer warpgroup
    ptx::setmaxnreg_dec<kProducerRegs>();
    const int warp = (threadIdx.x / 32) & 3, lane = threadIdx.x & 31;
    if (warp == 0 && lane == 0) {
      ptx::prefetch_tensormap(&tmap_x);
      ptx::prefetch_tensormap(&tmap_w);
      const uint32_t stage_bytes = static_cast<uint32_t>(L.stage_w_bytes + L.stage_x_bytes);
      pipeline::PipelineState st;
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        const TileCoord c = tiles.at(t);
        const int x_row = static_cast<int>(c.row0) + c.m0;
        const int x_grp = p.masked ? c.group : 0;
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          ring.producer_acquire(st);
          uint64_t* full = &ring.full[st.stage];
          ptx::mbarrier_arrive_expect_tx(full, stage_bytes);
          ptx::tma_load_3d(smem_w + st.stage * L.stage_w_bytes, &tmap_w, full, kb * kKElems, c.n0, c.group);
          ptx::tma_load_3d(smem_x + st.stage * L.stage_x_bytes, &tmap_x, full, kb * kKElems, x_row, x_grp);
          st.advance(p.stages);
        }
      }
    } else if (kFP8 && warp == 1 && blockwise) {
      // Block-wise scales of each k-block into its stage, as the products ws[nb] · xs[row] for each consumer
      // warpgroup's 128-row weight block ([slot][block_m] fp32), so that the promotion is one FMA per element.
      // Plain loads, stores and a release arrival per lane; the loads of the next k-block are issued before
      // waiting for its stage, so their latency hides behind the ring.
      constexpr int kSlots = kTileWidth / kGroupedGemmBlock;
      constexpr int kPerLane = kBlockM / 32 > 0 ? kBlockM / 32 : 1;
      float x_next[kPerLane], w_next[kSlots];
      auto load = [&](const TileCoord& c, int kb) {
        // Rows of x_scale that exist: contiguous rows < M (global), masked rows < max_m (in the group).
        const int64_t row_limit = p.masked ? p.rows : p.rows - c.row0;
        const float* xs = p.x_scale + (p.masked ? c.group * p.xs_group_stride : c.row0 * p.xs_row_stride) +
                          kb * p.xs_k_stride;
        const float* ws = p.w_scale + c.group * p.ws_group_stride + (c.n0 / kGroupedGemmBlock) * p.ws_n_stride +
                          kb * p.ws_k_stride;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int64_t r = c.m0 + lane + 32 * i;
          x_next[i] = (lane + 32 * i < kBlockM && r < row_limit) ? __ldg(xs + r * p.xs_row_stride) : 0.0f;
        }
#pragma unroll
        for (int sl = 0; sl < kSlots; ++sl) w_next[sl] = __ldg(ws + sl * p.ws_n_stride);
      };
      int t = blockIdx.x, kb = 0;
      TileCoord c{};
      if (t < total_tiles) {
        c = tiles.at(t);
        load(c, 0);
      }
      pipeline::PipelineState st;
      while (t < total_tiles) {
        float x_cur[kPerLane], w_cur[kSlots];
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) x_cur[i] = x_next[i];
#pragma unroll
        for (int sl = 0; sl < kSlots; ++sl) w_cur[sl] = w_next[sl];
        if (++kb == p.k_blocks) {
          kb = 0;
          t += gridDim.x;
          if (t < total_tiles) c = tiles.at(t);
        }
        if (t < total_tiles) load(c, kb);
        ring.producer_acquire(st);
        float* dst = reinterpret_cast<float*>(smem_scales + st.stage * L.stage_scale_bytes);
#pragma unroll
        for (int sl = 0; sl < kSlots; ++sl)
#pragma unroll
          for (int i = 0; i < kPerLane; ++i)
            if (lane + 32 * i < kBlockM) dst[sl * kBlockM + lane + 32 * i] = w_cur[sl] * x_cur[i];
        ptx::mbarrier_arrive(&ring.full[st.stage]);
        st.advance(p.stages);
      }
    }
  } else {
    // ------------------------------------------------------------------ consumer warpgroups
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const int col_pair = 2 * (lane & 3);  // accumulator columns 8j + col_pair + {0, 1}
    const int ws_slot = kWgRows == 128 ? wg : 0;
    pipeline::PipelineState st;

    // One k-block of m64 block h of this warpgroup: 4 wgmma of 32 bytes of K each, one commit group.
    auto issue = [&](float(&acc)[kRegs], int stage, int h, bool accumulate) {
      const uint64_t desc_a = ptx::wgmma_desc_k_major_sw128(smem_w + stage * L.stage_w_bytes +
                                                            (wg * kWgRows + h * 64) * kTileKBytes);
      const uint64_t desc_b = ptx::wgmma_desc_k_major_sw128(smem_x + stage * L.stage_x_bytes);
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
        const int scale_d = (accumulate || s > 0) ? 1 : 0;
        if constexpr (kFP8) Mma::mma_e4m3(acc, desc_a + 2 * s, desc_b + 2 * s, scale_d);
        else Mma::mma_bf16(acc, desc_a + 2 * s, desc_b + 2 * s, scale_d);
      }
    };
    auto release = [&](const pipeline::PipelineState& done) {
      if (blockwise) {
        ring.consumer_release(done);
      } else {
        __syncwarp();
        if (lane == 0) ring.consumer_release(done);
      }
    };

    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const TileCoord c = tiles.at(t);
      float total[kHalves][kRegs];
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int i = 0; i < kRegs; ++i) total[h][i] = 0.0f;

      if constexpr (kFP8) {
        // Every k-block of every m64 block goes to a fresh fp8 accumulator that is promoted into the fp32
        // total: total += part (per-tensor) or total += ws · xs[col] · part (block-wise). The promotion reads
        // the accumulator, and ptxas serializes wgmma left in flight across such reads, so each batch
        // completes first; the two consumer warpgroups interleave over the promotions instead.
        float part[kRegs];
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          ring.consumer_wait(st);
          const float* sc = reinterpret_cast<const float*>(smem_scales + st.stage * L.stage_scale_bytes);
#pragma unroll
          for (int h = 0; h < kHalves; ++h) {
            ptx::wgmma_fence();
            issue(part, st.stage, h, false);
            ptx::wgmma_commit_group();
            ptx::wgmma_wait_group<0>();
            ptx::wgmma_fence_registers(part);
            if (blockwise) {
              const float* prod = sc + ws_slot * kBlockM;
              float2 s01[kBlockM / 8];
#pragma unroll
              for (int j = 0; j < kBlockM / 8; ++j) s01[j] = *reinterpret_cast<const float2*>(prod + 8 * j + col_pair);
              if (h + 1 == kHalves) release(st);
#pragma unroll
              for (int j = 0; j < kBlockM / 8; ++j) {
                total[h][4 * j + 0] = fmaf(part[4 * j + 0], s01[j].x, total[h][4 * j + 0]);
                total[h][4 * j + 1] = fmaf(part[4 * j + 1], s01[j].y, total[h][4 * j + 1]);
                total[h][4 * j + 2] = fmaf(part[4 * j + 2], s01[j].x, total[h][4 * j + 2]);
                total[h][4 * j + 3] = fmaf(part[4 * j + 3], s01[j].y, total[h][4 * j + 3]);
              }
            } else {
              if (h + 1 == kHalves) release(st);
#pragma unroll
              for (int i = 0; i < kRegs; ++i) total[h][i] += part[i];
            }
          }
          st.advance(p.stages);
        }
      } else {
        // bf16: one fp32 accumulator over all of K; the k-block's batch stays in flight while the next stage is
        // awaited, and a stage is released once the batch after it is issued and it has completed.
        pipeline::PipelineState prev = st;
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          ring.consumer_wait(st);
          ptx::wgmma_fence();
#pragma unroll
          for (int h = 0; h < kHalves; ++h) issue(total[h], st.stage, h, kb > 0);
          ptx::wgmma_commit_group();
          ptx::wgmma_wait_group<1>();
          if (kb > 0) release(prev);
          prev = st;
          st.advance(p.stages);
        }
        ptx::wgmma_wait_group<0>();
#pragma unroll
        for (int h = 0; h < kHalves; ++h) ptx::wgmma_fence_registers(total[h]);
        release(prev);
      }

      // ---- epilogue: scale, bf16, 4-byte stores straight from the accumulators. Lanes l and l^4 hold weight
      // rows r and r^1 of the same token columns; one shuffle gives each a pair of adjacent weights of one
      // token (even row: token c, odd row: token c+1).
      float factor = 1.0f;
      if (p.scaling == static_cast<int>(Scaling::kPerTensor)) {
        factor = p.x_scale[0] * p.w_scale[c.group * p.ws_group_stride];
      }
      const bool odd = (lane >> 2) & 1;
      __nv_bfloat16* y_tile = p.y + (p.masked ? c.group * p.y_group_stride : int64_t{0}) +
                              (c.row0 + c.m0) * p.y_row_stride + c.n0 + wg * kWgRows;
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int j = 0; j < kBlockM / 8; ++j) {
#pragma unroll
          for (int half8 = 0; half8 < 2; ++half8) {
            const float v0 = total[h][4 * j + 2 * half8] * factor;      // (row r, token c)
            const float v1 = total[h][4 * j + 2 * half8 + 1] * factor;  // (row r, token c + 1)
            const float other = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
            const int row = h * 64 + warp * 16 + (lane >> 2) + 8 * half8 - (odd ? 1 : 0);  // even row of the pair
            const int token = 8 * j + col_pair + (odd ? 1 : 0);
            if (token < c.rows) {
              const __nv_bfloat162 pair = odd ? __floats2bfloat162_rn(other, v1) : __floats2bfloat162_rn(v0, other);
              *reinterpret_cast<__nv_bfloat162*>(y_tile + token * p.y_row_stride + row) = pair;
            }
          }
        }
      }
    }
  }
#endif
}

}  // namespace tessera::gemm::detail
