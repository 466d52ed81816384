// Internal: the W8A8 GEMM kernel (docs/perf/w8a8.md). yᵀ = W · xᵀ: a CTA owns 128 weight rows (two consumer
// warpgroups of 64, wgmma's M) and kBN token rows (wgmma's N) over a range of K (one of `splits`). The producer
// warpgroup's first lane loads, per ring stage of 1-2 k-blocks of 128 int8 columns, the weight and token code tiles
// (K-major rows of 128 bytes, 128-byte swizzle: what wgmma .s8 reads from shared memory, so the codes need no
// rearrangement) and, for the block-wise form, the stage's per-block parameters of both operands (block-major planes
// of 16-byte rows). Consumers multiply with wgmma m64nNk32 .s32.s8.s8:
//   one block per row (kBlock 0): one int32 accumulator over all of K, the zero-point terms and scales in the epilogue;
//   block-wise (kBlock 32 / 64 / 128): each block goes to one of two int32 accumulator sets in turn; while block b's
//     wgmma run, block b − 1's set is promoted into the fp32 total: D = acc − zB·ΣAq − zA·(ΣBq − block·zB) is formed
//     in fp32 from integers (acc reinterpreted through the 1.5·2^23 magic, |acc| <= 2^21; exact unless both zero-point
//     corrections and the magic sum past 2^24: docs/ops/w8a8.md) and added as sA·sB·D.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "linear/w8a8/config.h"
#include "pipeline/pipeline.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace tessera::linear::w8a8 {

inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "setmaxnreg budget exceeds the register file");

enum class OutType : int { kBF16 = 0, kFP16 = 1, kFP32 = 2, kInt8 = 3 };

// Parameter planes of one operand: scale, zero, sums.
struct PlaneMaps {
  CUtensorMap plane[3];
};

struct Maps {
  CUtensorMap w, x;  // codes [N, K], [M, K]: box kRows / kBN rows × 128 bytes, 128-byte swizzle
  PlaneMaps wp, ap;  // block-wise only: [blocks][ld / 4][16 bytes], box kBlocksPerStage × rows / 4 × 16 bytes
};

struct Args {
  int64_t m, n, k;
  int k_blocks, splits, stages;
  uint32_t stage_bytes, w_bytes, x_bytes, tx_bytes;
  // Global parameter arrays (element (row, block) at block · ld + row): the per-row epilogue reads block 0.
  const float *a_scale, *a_zero, *a_sums, *w_scale, *w_zero, *w_sums;
  bool has_za, has_zb;  // activation / weight zero points present
  void* y;
  int64_t ldy;
  int out_type;  // OutType
  bool y_vec;    // y's base and row stride are 16-byte aligned (8 for int8): whole 8-output stores
  const float* bias;
  float clamp_min, clamp_max, out_scale;
  void* partial;  // [splits, m, n] of int32 (per row) or fp32 (block-wise) when splits > 1
};

// bias, clamp and the store in y's type.
__device__ __forceinline__ void store_y(const Args& a, int64_t m, int64_t n, float v) {
  if (a.bias != nullptr) v += a.bias[n];
  v = fminf(fmaxf(v, a.clamp_min), a.clamp_max);
  const int64_t at = m * a.ldy + n;
  switch (static_cast<OutType>(a.out_type)) {
    case OutType::kBF16:
      static_cast<__nv_bfloat16*>(a.y)[at] = __float2bfloat16_rn(v);
      break;
    case OutType::kFP16:
      static_cast<__half*>(a.y)[at] = __float2half_rn(v);
      break;
    case OutType::kFP32:
      static_cast<float*>(a.y)[at] = v;
      break;
    default:
      static_cast<int8_t*>(a.y)[at] = static_cast<int8_t>(fminf(fmaxf(rintf(v * a.out_scale), -128.f), 127.f));
      break;
  }
}

// Up to 8 consecutive outputs of row m from column n (count of them inside N): one 16-byte store (8 bytes for int8,
// two for fp32) when y's rows allow it, else one at a time.
__device__ __forceinline__ void store_y8(const Args& a, int64_t m, int64_t n, float (&v)[8], int count) {
  if (count < 8 || !a.y_vec) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < count) store_y(a, m, n + j, v[j]);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (a.bias != nullptr) v[j] += a.bias[n + j];
    v[j] = fminf(fmaxf(v[j], a.clamp_min), a.clamp_max);
  }
  const int64_t at = m * a.ldy + n;
  switch (static_cast<OutType>(a.out_type)) {
    case OutType::kBF16:
    case OutType::kFP16: {
      uint32_t p[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (a.out_type == static_cast<int>(OutType::kBF16)) {
          const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
          p[j] = *reinterpret_cast<const uint32_t*>(&b);
        } else {
          const __half2 b = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
          p[j] = *reinterpret_cast<const uint32_t*>(&b);
        }
      }
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.y) + at) = make_uint4(p[0], p[1], p[2], p[3]);
      break;
    }
    case OutType::kFP32:
      reinterpret_cast<float4*>(static_cast<float*>(a.y) + at)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(static_cast<float*>(a.y) + at)[1] = make_float4(v[4], v[5], v[6], v[7]);
      break;
    default: {
      uint32_t p[2] = {0u, 0u};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int q = static_cast<int>(fminf(fmaxf(rintf(v[j] * a.out_scale), -128.f), 127.f));
        p[j / 4] |= (static_cast<uint32_t>(q) & 0xFFu) << (8 * (j % 4));
      }
      *reinterpret_cast<uint2*>(static_cast<int8_t*>(a.y) + at) = make_uint2(p[0], p[1]);
      break;
    }
  }
}

// One block per row: y's value before bias from Σ Aq·Bq over all of K (acc, converted to fp32 by the caller):
// sA·sB·(acc − zA·ΣBq − zB·(ΣAq − K·zA)). fp32 rounds the large terms (relative 2^-24 each), far below the inputs'
// quantization error; docs/ops/w8a8.md.
__device__ __forceinline__ float per_row_value(const Args& a, int64_t m, int64_t n, float acc) {
  float d = acc;
  if (a.has_za) d = fmaf(-a.a_zero[m], a.w_sums[n], d);
  if (a.has_zb) d = fmaf(-a.w_zero[n], fmaf(-static_cast<float>(a.k), a.has_za ? a.a_zero[m] : 0.f, a.a_sums[m]), d);
  return a.a_scale[m] * a.w_scale[n] * d;
}

// What the block-wise mainloop needs of the kernel's state.
struct BlockwiseCtx {
  pipeline::StageRing ring;
  unsigned char* stages;
  int stage_begin, stage_end;
  int wg, row_in_tile, t;
};

// Stage s's parameter planes, in floats (config.h plane_slot_bytes): three token planes of kBps·kBN values, then three
// weight planes of kBps·kRows.
template <int kBN, int kBps>
struct PlaneSlots {
  static constexpr int kToken = plane_slot_bytes(kBps, kBN) / 4, kWeight = plane_slot_bytes(kBps, kRows) / 4;
};

// Block j of stage s, whose int32 sums are c, into the fp32 total: total += sA·sB·D with
// D = acc − zA·(ΣBq − block·zB) − zB·ΣAq formed from integers: acc read as the float 1.5·2^23 + acc through its bits
// (exact for |acc| < 2^22) minus 1.5·2^23, then each correction added to it, so that every partial sum stays below
// 2^23 in magnitude and D is exact (adding the corrections to −1.5·2^23 first went past 2^24 with extreme zero points
// on both operands: odd D one off; test ExtremeZeroPointsGiveExactIntegers). kZA / kZB: the activations / weights have zero
// points (compile-time: this is the kernel's hot loop, 4 to 6 operations an element).
template <int kBN, int kBlock, bool kZA, bool kZB, int kAcc>
__device__ __forceinline__ void promote_block(const Args& a, const BlockwiseCtx& x, float (&total)[kAcc],
                                              const int32_t (&c)[kAcc], const unsigned char* s, int j) {
  constexpr int kBps = kblocks_per_stage(kBN, true) * kKBlock / kBlock;
  using Slots = PlaneSlots<kBN, kBps>;
  constexpr float kMagic = 12582912.f;
  const float* const par = reinterpret_cast<const float*>(s + a.w_bytes + a.x_bytes);
  const float* const wpar = par + 3 * Slots::kToken;
  float sb[2], nzb[2] = {0.f, 0.f}, nsbq[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = x.row_in_tile + 8 * h;
    sb[h] = wpar[j * kRows + r];
    if constexpr (kZB) nzb[h] = -wpar[Slots::kWeight + j * kRows + r];
    // −(ΣBq − block·zB): the activation zero point's coefficient.
    if constexpr (kZA) nsbq[h] = -fmaf(static_cast<float>(kBlock), nzb[h], wpar[2 * Slots::kWeight + j * kRows + r]);
  }
#pragma unroll
  for (int q = 0; q < kBN / 8; ++q) {
    const int tok = 8 * q + 2 * x.t;
    const float2 sa = *reinterpret_cast<const float2*>(par + j * kBN + tok);
    float2 za = make_float2(0.f, 0.f), sq = make_float2(0.f, 0.f);
    if constexpr (kZA) za = *reinterpret_cast<const float2*>(par + Slots::kToken + j * kBN + tok);
    if constexpr (kZB) sq = *reinterpret_cast<const float2*>(par + 2 * Slots::kToken + j * kBN + tok);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e >> 1;
      // acc first (exact: |acc| < 2^22), then each correction: every partial sum stays below 2^23, so D is exact.
      float d = __int_as_float(c[4 * q + e] + 0x4B400000) - kMagic;
      if constexpr (kZB) d = fmaf(nzb[h], (e & 1) ? sq.y : sq.x, d);
      if constexpr (kZA) d = fmaf((e & 1) ? za.y : za.x, nsbq[h], d);
      total[4 * q + e] = fmaf(((e & 1) ? sa.y : sa.x) * sb[h], d, total[4 * q + e]);
    }
  }
}

// The block-wise mainloop, straight-line within a stage (kBps is even and known at compile time): block j into set
// j % 2, then block j − 1's set is promoted while block j's wgmma run. ptxas serializes every wgmma of a kernel whose
// accumulators are read while a batch may be pending across a loop back edge (C7514), so each stage drains its last
// set before the next stage's first batch.
template <int kBN, int kBlock, bool kZA, bool kZB, int kAcc>
__device__ __forceinline__ void blockwise_mainloop(const Args& a, const BlockwiseCtx& x, float (&total)[kAcc],
                                                   int32_t (&acc)[kAcc], int32_t (&acc1)[kAcc]) {
  using Mma = ptx::Wgmma<kBN>;
  constexpr int kBps = kblocks_per_stage(kBN, true) * kKBlock / kBlock;
  pipeline::PipelineState st;
  for (int si = x.stage_begin; si < x.stage_end; ++si) {
    x.ring.consumer_wait(st);
    const unsigned char* const s = x.stages + st.stage * a.stage_bytes;
    auto issue = [&](int j, int32_t(&c)[kAcc]) {
      const int col = j * kBlock, kb = col / kKBlock, byte = col % kKBlock;
      const uint64_t da = ptx::wgmma_desc_k_major_sw128(s + (kb * kRows + x.wg * 64) * kKBlock) + (byte >> 4);
      const uint64_t db = ptx::wgmma_desc_k_major_sw128(s + a.w_bytes + kb * kBN * kKBlock) + (byte >> 4);
      ptx::wgmma_fence();
#pragma unroll
      for (int step = 0; step < kBlock / 32; ++step) Mma::mma_s8(c, da + 2 * step, db + 2 * step, step > 0 ? 1 : 0);
      ptx::wgmma_commit_group();
    };
    issue(0, acc);
#pragma unroll
    for (int j = 1; j < kBps; ++j) {
      if (j % 2 == 1) {
        issue(j, acc1);
        ptx::wgmma_wait_group<1>();
        ptx::wgmma_fence_registers(acc);
        promote_block<kBN, kBlock, kZA, kZB>(a, x, total, acc, s, j - 1);
      } else {
        issue(j, acc);
        ptx::wgmma_wait_group<1>();
        ptx::wgmma_fence_registers(acc1);
        promote_block<kBN, kBlock, kZA, kZB>(a, x, total, acc1, s, j - 1);
      }
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_registers(acc1);
    promote_block<kBN, kBlock, kZA, kZB>(a, x, total, acc1, s, kBps - 1);
    x.ring.consumer_release_warp(st);
    st.advance(a.stages);
  }
}

template <int kBN, int kBlock>
__global__ void __launch_bounds__(kThreads, 1) w8a8_gemm_kernel(const __grid_constant__ Maps maps, const Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Mma = ptx::Wgmma<kBN>;
  constexpr int kAcc = Mma::kRegs;
  constexpr int kKbps = kblocks_per_stage(kBN, kBlock != 0);
  constexpr bool kBlockwise = kBlock != 0;
  constexpr int kBps = kBlockwise ? kKbps * kKBlock / kBlock : 0;  // parameter blocks per stage
  constexpr int kTokenPlane = PlaneSlots<kBN, kBps>::kToken, kWeightPlane = PlaneSlots<kBN, kBps>::kWeight;
  static_assert(!kBlockwise || kBN <= kMaxBlockwiseBN, "block-wise tiles hold two accumulator sets and a total");
  static_assert(!kBlockwise || kBps % 2 == 0, "block-wise stages alternate two accumulator sets");
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem);
  float* const eparams = reinterpret_cast<float*>(smem + 1024);  // [3][kBN] token planes, then [3][kRows] weights
  unsigned char* const stages = smem + kHeaderBytes;
  const pipeline::StageRing ring{bars, bars + kMaxStages, a.stages};

  // Token tiles fastest: the CTAs that share a weight tile run at the same time, so that it is read from DRAM once
  // even when the grid takes several waves (the weights of a decode-sized M exceed the L2).
  const int m_tile = blockIdx.x, n_tile = blockIdx.y, split = blockIdx.z;
  const int num_stages_k = (a.k_blocks + kKbps - 1) / kKbps;
  const int stage_begin = static_cast<int>(static_cast<int64_t>(split) * num_stages_k / a.splits);
  const int stage_end = static_cast<int>(static_cast<int64_t>(split + 1) * num_stages_k / a.splits);

  if (threadIdx.x == 0) ring.init(1, 8);  // full: the TMA lane; empty: one arrival per consumer warp
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 2) {
    // ---------------------------------------------------------------- producer warpgroup: one TMA lane
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x % 128 == 0) {
      ptx::prefetch_tensormap(&maps.w);
      ptx::prefetch_tensormap(&maps.x);
      pipeline::PipelineState st;
      for (int si = stage_begin; si < stage_end; ++si) {
        ring.producer_acquire(st);
        uint64_t* const full = ring.full_barrier(st);
        unsigned char* const s = stages + st.stage * a.stage_bytes;
        // Always kKbps k-blocks (past K they read zeros and still count), so the byte count is fixed.
        ptx::mbarrier_arrive_expect_tx(full, a.tx_bytes);
#pragma unroll
        for (int j = 0; j < kKbps; ++j) {
          const int k0 = (si * kKbps + j) * kKBlock;
          ptx::tma_load_3d(s + j * kRows * kKBlock, &maps.w, full, k0, n_tile * kRows, 0);
          ptx::tma_load_3d(s + a.w_bytes + j * kBN * kKBlock, &maps.x, full, k0, m_tile * kBN, 0);
        }
        if constexpr (kBlockwise) {
          // Planes [scale, zero, sums] of the tokens (kBN floats per block), then of the weights (kRows floats).
          float* const par = reinterpret_cast<float*>(s + a.w_bytes + a.x_bytes);
          const int blk0 = si * kBps;
          const bool a_has[3] = {true, a.has_za, a.has_zb}, w_has[3] = {true, a.has_zb, a.has_za};
#pragma unroll
          for (int p = 0; p < 3; ++p) {
            if (a_has[p]) ptx::tma_load_3d(par + p * kTokenPlane, &maps.ap.plane[p], full, 0, m_tile * kBN / 4, blk0);
            if (w_has[p])
              ptx::tma_load_3d(par + 3 * kTokenPlane + p * kWeightPlane, &maps.wp.plane[p], full, 0, n_tile * kRows / 4,
                               blk0);
          }
        }
        st.advance(a.stages);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumer warpgroups
  ptx::setmaxnreg_inc<kConsumerRegs>();
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if constexpr (!kBlockwise) {
    // The epilogue's per-row parameters into shared memory while the first stages load (read there after a barrier;
    // loaded inside the epilogue, each token pair's loads waited a full memory round trip: ~25 µs a tile, measured).
    // Rows past M or N read row 0 (their outputs are never stored); absent planes read as 0.
    if (a.splits == 1) {
      for (int i = threadIdx.x; i < 3 * (kBN + kRows); i += 256) {
        const bool token = i < 3 * kBN;
        const int plane = token ? i / kBN : (i - 3 * kBN) / kRows, r = token ? i % kBN : (i - 3 * kBN) % kRows;
        const int64_t row = token ? static_cast<int64_t>(m_tile) * kBN + r : static_cast<int64_t>(n_tile) * kRows + r;
        const float* src = token ? (plane == 0   ? a.a_scale
                                    : plane == 1 ? a.a_zero
                                                 : a.a_sums)
                                 : (plane == 0   ? a.w_scale
                                    : plane == 1 ? a.w_zero
                                                 : a.w_sums);
        const bool in = row < (token ? a.m : a.n) && src != nullptr;
        eparams[i] = in ? __ldg(src + row) : 0.f;
      }
    }
  }
  // The A (weight) and B (token) descriptors of k-block j of a stage, advanced by `byte` columns inside it.
  auto desc_a = [&](const unsigned char* s, int j, int byte) {
    return ptx::wgmma_desc_k_major_sw128(s + (j * kRows + wg * 64) * kKBlock) + (byte >> 4);
  };
  auto desc_b = [&](const unsigned char* s, int j, int byte) {
    return ptx::wgmma_desc_k_major_sw128(s + a.w_bytes + j * kBN * kKBlock) + (byte >> 4);
  };
  // Accumulator register 4q + e: weight row 16·warp + g (+8 for e >= 2) of the warpgroup, token 8q + 2t + (e & 1).
  const int row_in_tile = wg * 64 + warp * 16 + g;
  float total[kBlockwise ? kAcc : 1];
  int32_t acc[kAcc];

  if constexpr (!kBlockwise) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0;
    pipeline::PipelineState st, prev;
    for (int si = stage_begin; si < stage_end; ++si) {
      ring.consumer_wait(st);
      const unsigned char* const s = stages + st.stage * a.stage_bytes;
      ptx::wgmma_fence();
#pragma unroll
      for (int j = 0; j < kKbps; ++j)
#pragma unroll
        for (int step = 0; step < kKBlock / 32; ++step)
          Mma::mma_s8(acc, desc_a(s, j, 0) + 2 * step, desc_b(s, j, 0) + 2 * step, 1);
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<1>();
      if (si > stage_begin) ring.consumer_release_warp(prev);
      prev = st;
      st.advance(a.stages);
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_registers(acc);
    if (stage_end > stage_begin) ring.consumer_release_warp(prev);
  } else {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) total[i] = 0.f;
    int32_t acc1[kAcc];
    const BlockwiseCtx ctx{ring, stages, stage_begin, stage_end, wg, row_in_tile, t};
    if (a.has_za) {
      if (a.has_zb)
        blockwise_mainloop<kBN, kBlock, true, true>(a, ctx, total, acc, acc1);
      else
        blockwise_mainloop<kBN, kBlock, true, false>(a, ctx, total, acc, acc1);
    } else {
      if (a.has_zb)
        blockwise_mainloop<kBN, kBlock, false, true>(a, ctx, total, acc, acc1);
      else
        blockwise_mainloop<kBN, kBlock, false, false>(a, ctx, total, acc, acc1);
    }
  }

  // ------------------------------------------------------------------ epilogue
  // Each thread's values (the final pre-bias value, or the raw 32-bit partial of a split) go to a [kBN][kRows] tile in
  // the ring's shared memory (free once both warpgroups' wgmma have completed: every stage was consumed, no TMA is
  // pending), then every consumer thread stores 8 consecutive outputs of one token row at a time: coalesced rows and
  // a rolled loop (an unrolled per-register store epilogue was measured at twice the mainloop's time, most of it
  // instruction-cache stalls).
  constexpr int kLd = kRows + 4;  // row stride in floats: lanes t = 0..3 (tokens 2t) land in distinct banks
  static_assert(kBN * kLd * 4 <= kSmemBudget - kHeaderBytes, "the output tile must fit in the ring");
  uint32_t* const tile = reinterpret_cast<uint32_t*>(stages);
  ptx::named_barrier_sync(1, 256);
  {
    // One block per row: the parameters of this thread's two weight rows and of each token pair (shared memory).
    float sb[2] = {0.f, 0.f}, sbq[2] = {0.f, 0.f}, zb[2] = {0.f, 0.f};
    if constexpr (!kBlockwise) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* const w = eparams + 3 * kBN + row_in_tile + 8 * h;
        sb[h] = w[0];
        zb[h] = w[kRows];
        sbq[h] = w[2 * kRows];
      }
    }
#pragma unroll
    for (int q = 0; q < kBN / 8; ++q) {
      float sa[2] = {0.f, 0.f}, za[2] = {0.f, 0.f}, sq[2] = {0.f, 0.f};
      if constexpr (!kBlockwise) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float* const p = eparams + 8 * q + 2 * t + c;
          sa[c] = p[0];
          za[c] = p[kBN];
          // ΣAq − K·zA: the weight zero point's coefficient.
          sq[c] = fmaf(-static_cast<float>(a.k), za[c], p[2 * kBN]);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 4 * q + e, h = e >> 1, c = e & 1;
        uint32_t word;
        if constexpr (kBlockwise) {
          word = __float_as_uint(total[i]);
        } else if (a.splits > 1) {
          word = static_cast<uint32_t>(acc[i]);
        } else {
          const float d = fmaf(-zb[h], sq[c], fmaf(-za[c], sbq[h], static_cast<float>(acc[i])));
          word = __float_as_uint(sa[c] * sb[h] * d);
        }
        tile[(8 * q + 2 * t + c) * kLd + row_in_tile + 8 * h] = word;
      }
    }
  }
  ptx::named_barrier_sync(1, 256);
  const int64_t n0 = static_cast<int64_t>(n_tile) * kRows, m0 = static_cast<int64_t>(m_tile) * kBN;
  for (int idx = threadIdx.x; idx < kBN * (kRows / 8); idx += 256) {
    const int r = idx / (kRows / 8), c8 = (idx % (kRows / 8)) * 8;
    const int64_t m = m0 + r, n = n0 + c8;
    if (m >= a.m || n >= a.n) continue;
    const uint4 lo = *reinterpret_cast<const uint4*>(tile + r * kLd + c8);
    const uint4 hi = *reinterpret_cast<const uint4*>(tile + r * kLd + c8 + 4);
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const int count = static_cast<int>(min(int64_t{8}, a.n - n));
    if (a.splits > 1) {
      uint32_t* const dst = static_cast<uint32_t*>(a.partial) + (split * a.m + m) * a.n + n;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < count) dst[j] = w[j];
    } else {
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __uint_as_float(w[j]);
      store_y8(a, m, n, v, count);
    }
  }
#endif
}

// y = epilogue(Σ_split partial[split]) in split order; int32 partials (one block per row) are summed exactly.
template <bool kBlockwise>
__global__ void w8a8_reduce_partials(const Args a) {
  const int64_t total = a.m * a.n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i / a.n, n = i % a.n;
    if constexpr (kBlockwise) {
      float v = 0.f;
      for (int s = 0; s < a.splits; ++s) v += static_cast<const float*>(a.partial)[s * total + i];
      store_y(a, m, n, v);
    } else {
      int64_t v = 0;
      for (int s = 0; s < a.splits; ++s) v += static_cast<const int32_t*>(a.partial)[s * total + i];
      store_y(a, m, n, per_row_value(a, m, n, static_cast<float>(v)));
    }
  }
}

}  // namespace tessera::linear::w8a8
