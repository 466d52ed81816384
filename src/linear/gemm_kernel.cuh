// Internal: the weight-only linear layer's kernel (docs/perf/linear.md), one for every M.
//
// The product is transposed, yᵀ = W · xᵀ, because wgmma takes only its left operand from registers: a CTA owns 128
// weight rows (8 stripes of 16) and kBN token rows, over a range of K (one of `splits`). The last warpgroup is the
// producer: one lane loads, per stage of 1-4 64-column k-blocks, the 8 stripes' codes, their block parameters and the
// tokens' x tiles (K-major, 128-byte swizzle) by TMA into a ring. Token tiles up to kMmaSyncMaxBN have four consumer
// warpgroups (two warps per stripe) multiplying with mma.sync: int4 multiplies the exact centred codes and applies
// the block parameters to the fp32 sums (scale-after), int8 converts first. Larger tiles have two consumer
// warpgroups of 4 stripes (64 rows, wgmma's M): every warp converts its stripe's codes into A fragments in registers
// (linear/dequant.cuh) and issues wgmma m64 n{kBN} k16 with A from registers and x from shared memory, converting
// k-block kb + 1 while the wgmma of kb run (two fragment buffers; ptxas serializes the int4 batches regardless:
// docs/perf/linear.md, session 16); a stage is released once the wgmma that read its x tile have completed.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/numeric.cuh"
#include "linear/config.h"
#include "linear/dequant.cuh"
#include "pipeline/pipeline.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/mma.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace tessera::linear::detail {

using ::tessera::detail::from_float;
using ::tessera::detail::to_float;

// Registers per thread after setmaxnreg (the CTA launches with 65536 / 384 = 168 a thread): the producer lane needs
// few, the consumers hold up to 128 accumulators (kBN 256), two fragment buffers and the stage addresses.
inline constexpr int kProducerRegs = 40;
inline constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "setmaxnreg budget exceeds the register file");

struct GemmArgs {
  int64_t m, n, k;
  void* y;  // compute type or fp32 (y_f32), [m, ldy]
  int64_t ldy;
  const void* bias;  // y's type, [n], or null
  float clamp_min, clamp_max;
  float* partial;  // [splits, m, n] when splits > 1
  int k_blocks;    // 64-column k-blocks of Kp
  int splits, stages;
  int block_shift;                     // log2(block), or 31 for one block per row
  int tiles_per_kblock, stage_blocks;  // code tiles per k-block, parameter blocks per stage
  uint32_t stage_bytes, tx_bytes, x_bytes, code_bytes;
  bool zero_point, y_f32;
};

// Implicit-GEMM conv2d (kConv; x_map an im2col map over NHWC x, docs/ops/conv.md): k-block kb is the 64-channel
// chunk kb % chunks of filter tap kb / chunks = kh·kw_taps + kw.
struct ConvArgs {
  int chunks, kw, dil_h, dil_w, c;  // c: x's channels (a past-K copy reads channels >= c: zeros)
  int ho, wo, stride_h, stride_w, pad_h, pad_w, ci_g, co_g;
};

// The producer's x copy for k-block kb of a conv tile whose first output pixel is `pixel0` (tensor-map coordinates
// of the tile's first filter base and the tap's offsets; k-blocks past K read channels past x's: zeros).
struct ConvTileOrigin {
  int w, h, n, c;
};
__device__ __forceinline__ ConvTileOrigin conv_tile_origin(const ConvArgs& a, int64_t pixel0, int n_tile) {
  const int64_t plane = static_cast<int64_t>(a.ho) * a.wo;
  const int img = static_cast<int>(pixel0 / plane), rem = static_cast<int>(pixel0 % plane);
  const int oh = rem / a.wo, ow = rem % a.wo;
  const int group = n_tile * kGemmRows / a.co_g;
  return {ow * a.stride_w - a.pad_w, oh * a.stride_h - a.pad_h, img, group * a.ci_g};
}
__device__ __forceinline__ void conv_load_x(const ConvArgs& a, int k_blocks, const CUtensorMap* map,
                                            const ConvTileOrigin& o, int kb, void* dst, uint64_t* full) {
  if (kb >= k_blocks) {
    ptx::tma_load_4d_im2col(dst, map, full, a.c, o.w, o.h, o.n, 0, 0);
    return;
  }
  const int tap = kb / a.chunks, chunk = kb - tap * a.chunks;
  const int kh = tap / a.kw, kw = tap - kh * a.kw;
  ptx::tma_load_4d_im2col(dst, map, full, o.c + chunk * kKBlock, o.w, o.h, o.n, static_cast<uint16_t>(kw * a.dil_w),
                          static_cast<uint16_t>(kh * a.dil_h));
}

// y's value at (row, col) after bias and clamp, stored in y's type.
template <class T>
__device__ __forceinline__ void store_output(const GemmArgs& a, int64_t row, int64_t col, float v) {
  if (a.bias != nullptr)
    v += a.y_f32 ? static_cast<const float*>(a.bias)[col] : to_float(static_cast<const T*>(a.bias)[col]);
  v = fminf(fmaxf(v, a.clamp_min), a.clamp_max);
  if (a.y_f32)
    static_cast<float*>(a.y)[row * a.ldy + col] = v;
  else
    static_cast<T*>(a.y)[row * a.ldy + col] = from_float<T>(v);
}

// kConv: x_map is a conv's im2col map (wgmma tiles only, kBN >= 64; the plain linear kernels stay as they were).
// Up to 8 consecutive outputs of one row of y (count of them); one 16-byte store (two for fp32 y) when all 8 are
// there and their address allows it.
template <class T>
__device__ __forceinline__ void store_output8(const GemmArgs& a, int64_t row, int64_t col, float (&v)[8], int count) {
  const int64_t at = row * a.ldy + col;
  const std::uintptr_t addr =
      reinterpret_cast<std::uintptr_t>(a.y) + static_cast<std::uintptr_t>(at) * (a.y_f32 ? 4 : 2);
  if (count < 8 || addr % 16 != 0) {
#pragma unroll
    for (int q = 0; q < 8; ++q)
      if (q < count) store_output<T>(a, row, col + q, v[q]);
    return;
  }
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    if (a.bias != nullptr)
      v[q] += a.y_f32 ? static_cast<const float*>(a.bias)[col + q] : to_float(static_cast<const T*>(a.bias)[col + q]);
    v[q] = fminf(fmaxf(v[q], a.clamp_min), a.clamp_max);
  }
  if (a.y_f32) {
    float4* const dst = reinterpret_cast<float4*>(addr);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    constexpr bool kFP16 = std::is_same_v<T, __half>;
    *reinterpret_cast<uint4*>(addr) =
        make_uint4(::tessera::detail::pack2<kFP16>(v[0], v[1]), ::tessera::detail::pack2<kFP16>(v[2], v[3]),
                   ::tessera::detail::pack2<kFP16>(v[4], v[5]), ::tessera::detail::pack2<kFP16>(v[6], v[7]));
  }
}

template <class T, int kBits, int kBN, bool kConv = false>
__global__ void __launch_bounds__(gemm_threads(kBN), 1)
    linear_gemm_kernel(const __grid_constant__ CUtensorMap codes_map, const __grid_constant__ CUtensorMap params_map,
                       const __grid_constant__ CUtensorMap x_map, const GemmArgs a, const ConvArgs conv) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Mma = ptx::Wgmma<kBN>;
  constexpr int kKBlocks = kblocks_per_stage(kBN);
  // Token tiles up to kMmaSyncMaxBN multiply with warp-level mma.sync (each warp its own stripe, no wgmma
  // round trips: at small N a wgmma batch is latency-bound); larger ones with wgmma.
  constexpr bool kWarpMma = kBN <= kMmaSyncMaxBN;
  constexpr int kAcc = Mma::kRegs;
  constexpr bool kFP16 = std::is_same_v<T, __half>;
  extern __shared__ __align__(1024) unsigned char smem[];
  // Barriers first (2 · kMaxStages · 8 bytes), the stages from the next 1024-byte boundary.
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem);
  unsigned char* const stages = smem + 1024;
  const pipeline::StageRing ring{bars, bars + kMaxStages, a.stages};

  const int n_tile = blockIdx.x, m_tile = blockIdx.y, split = blockIdx.z;
  // Splits own whole stages (a stage's parameter box assumes it starts on a stage boundary).
  const int num_stages_k = (a.k_blocks + kKBlocks - 1) / kKBlocks;
  const int kb_begin = static_cast<int>(static_cast<int64_t>(split) * num_stages_k / a.splits) * kKBlocks;
  const int kb_end =
      min(a.k_blocks, static_cast<int>(static_cast<int64_t>(split + 1) * num_stages_k / a.splits) * kKBlocks);

  // full: the TMA lane's arrival plus the transaction bytes; empty: one arrival per consumer warp, after the warp's
  // reads of the stage (StageRing::consumer_release_warp).
  constexpr int kConsumerWGs = consumer_warpgroups(kBN), kConsumerThreads = kConsumerWGs * 128;
  if (threadIdx.x == 0) ring.init(1, kConsumerThreads / 32);
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == kConsumerWGs) {
    // ---------------------------------------------------------------- producer warpgroup: one TMA lane
    if constexpr (!kWarpMma) ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x % 128 == 0) {
      ptx::prefetch_tensormap(&codes_map);
      ptx::prefetch_tensormap(&params_map);
      ptx::prefetch_tensormap(&x_map);
      pipeline::PipelineState st;
      ConvTileOrigin origin{0, 0, 0, 0};
      if constexpr (kConv) origin = conv_tile_origin(conv, static_cast<int64_t>(m_tile) * kBN, n_tile);
      for (int kb0 = kb_begin; kb0 < kb_end; kb0 += kKBlocks) {
        ring.producer_acquire(st);
        uint64_t* const full = ring.full_barrier(st);
        unsigned char* const s = stages + st.stage * a.stage_bytes;
        // Always kKBlocks x boxes (past K they read zeros and still count), so the byte count is fixed.
        ptx::mbarrier_arrive_expect_tx(full, a.tx_bytes);
#pragma unroll
        for (int j = 0; j < kKBlocks; ++j) {
          if constexpr (kConv)
            conv_load_x(conv, a.k_blocks, &x_map, origin, kb0 + j, s + j * kBN * 128, full);
          else
            ptx::tma_load_3d(s + j * kBN * 128, &x_map, full, (kb0 + j) * kKBlock, m_tile * kBN, 0);
        }
        ptx::tma_load_4d(s + a.x_bytes, &codes_map, full, 0, 0, kb0 * a.tiles_per_kblock, n_tile * kGemmStripes);
        const int block0 = static_cast<int>((static_cast<uint32_t>(kb0) * kKBlock) >> a.block_shift);
        ptx::tma_load_3d(s + a.x_bytes + a.code_bytes, &params_map, full, 0, block0, n_tile * kGemmStripes);
        st.advance(a.stages);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumer warpgroups
  if constexpr (!kWarpMma) ptx::setmaxnreg_inc<kConsumerRegs>();
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4;
  // Of the CTA's 8 stripes; with four warpgroups, warpgroups 2 and 3 take the same stripes as 0 and 1 (half 1).
  const int stripe = (wg % 2) * 4 + warp, half = wg / 2;
  // Accumulator register 4j + e (wgmma m64nN, and mma.sync's n-tile j alike): weight row 16·warp + g (+8 for
  // e >= 2) of the warpgroup, token 8j + 2t + (e & 1).
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;

  // The A fragments of a k-block's four 16-column steps from the stage's codes and parameters.
  // k-block `kb`, the j-th of the stage at `s` that starts at k-block kb0.
  auto convert = [&](const unsigned char* s, int kb, int kb0, int j, uint32_t(&f)[4][4]) {
    const unsigned char* codes = s + a.x_bytes + ((stripe * kKBlocks + j) * a.tiles_per_kblock * 32 + lane) * 16;
    const unsigned char* params = s + a.x_bytes + a.code_bytes + (stripe * a.stage_blocks * 16 + 2 * g) * 4;
    const int block0 = static_cast<int>((static_cast<uint32_t>(kb0) * kKBlock) >> a.block_shift);
    // The parameter pair of the block holding column kb · 64 + 32h (h = 0, 1: the k-block's two halves).
    auto pair = [&](int h) {
      const int block = static_cast<int>((static_cast<uint32_t>(kb) * kKBlock + 32 * h) >> a.block_shift);
      return *reinterpret_cast<const uint2*>(params + (block - block0) * 64);
    };
    if constexpr (kBits == 4) {
      const uint4 c = *reinterpret_cast<const uint4*>(codes);
      DequantParams<T, kBits> p0, p1;
      p0.load(pair(0), a.zero_point);
      p1.load(pair(1), a.zero_point);
      dequant_step<T, kBits>(c.x, 0u, p0, f[0]);
      dequant_step<T, kBits>(c.y, 0u, p0, f[1]);
      dequant_step<T, kBits>(c.z, 0u, p1, f[2]);
      dequant_step<T, kBits>(c.w, 0u, p1, f[3]);
    } else {
      // int8: two 32-column tiles per k-block, each two steps (16 bytes a lane).
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 c = *reinterpret_cast<const uint4*>(codes + h * 512);
        DequantParams<T, kBits> p;
        p.load(pair(h), a.zero_point);
        dequant_step<T, kBits>(c.x, c.y, p, f[2 * h]);
        dequant_step<T, kBits>(c.z, c.w, p, f[2 * h + 1]);
      }
    }
  };
  pipeline::PipelineState st;
  if constexpr (kWarpMma) {
    // Each warp multiplies its 16 rows with every 8-token n-tile of the stage's x tiles (128-byte swizzled rows:
    // the 16-byte chunk c of row r sits at chunk c ^ (r % 8)); warpgroups 0-1 take the first half of each stage's
    // k-blocks, 2-3 the second. int4 multiplies the codes as they are and applies the block parameters to the sums
    // (scale-after, below); int8 converts the weights first (scale-before, as the wgmma tiles do).
    if constexpr (kBits == 4) {
      // Scale-after (linear/dequant.cuh Int4Codes): the A fragments are the centred codes q − z (zero point) or
      // q − 8 (offset), exact small integers (magic + q from one lop3, minus magic + z by one add); the products
      // accumulate per parameter block in `raw`, Σ x (an mma with A = 1) in `sx`, and each block is folded into acc
      // in fp32: acc += s·raw + c·sx with c = 0 (zero point) or o + 8·s (offset). No rounding of the weights to 16
      // bits. The codes are centred because the tensor cores' fp32 accumulation truncates: a sum that carried
      // magic·Σx (1024·Σx for fp16) lost ~2e-3 of y on one-sign x over per-channel blocks (the OneSignX test).
      static_assert(kKBlocks == 4, "two warps per stripe take two k-blocks each");
      // Zeroed here too: a half-1 warp with nothing in the first stage (K <= 128) folds before it opens a block.
      float raw[kAcc] = {}, sx[kAcc] = {};
      float s_lo = 0.f, c_lo = 0.f, s_hi = 0.f, c_hi = 0.f;
      using T2 = typename Half2Of<T>::Type;
      T2 nsub_lo = as_pair<T2>(0u), nsub_hi = as_pair<T2>(0u);  // −(magic + z) or −(magic + 8), both halves
      int open = -1;                                            // the parameter block raw / sx belong to
      const uint32_t ones[4] = {Int4Codes<T>::kOnes, Int4Codes<T>::kOnes, Int4Codes<T>::kOnes, Int4Codes<T>::kOnes};
      auto fold = [&]() {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          const bool hi = (i % 4) >= 2;
          acc[i] = fmaf(hi ? s_hi : s_lo, raw[i], acc[i]);
          acc[i] = fmaf(hi ? c_hi : c_lo, sx[i], acc[i]);
        }
      };
      // Offsets within a stage, fixed per warp: this warp's first k-block of the stage (k-block jj adds 512 bytes
      // of codes and kBN·128 of x), its lane's 16 code bytes, its rows' parameter pairs; ldmatrix: lane i gives token
      // row 8·nt + i % 8, 16-byte chunk 4h + i / 8 of the 128-byte row (swizzled: chunk c of row r sits at
      // c ^ (r % 8)), so that b[0..3] are the B fragments of steps 2h and 2h + 1.
      const int lrow = lane % 8, lchunk = lane / 8;
      const int code_off = a.x_bytes + ((stripe * kKBlocks + half * 2) * 32 + lane) * 16;
      const int par_off = a.x_bytes + a.code_bytes + (stripe * a.stage_blocks * 16 + 2 * g) * 4;
      const int x_off = half * 2 * kBN * 128 + lrow * 128;
      const int lx[2] = {((0 + lchunk) ^ lrow) << 4, ((4 + lchunk) ^ lrow) << 4};
      // A new parameter block can start every 32 columns (block 32), every k-block (64) or only with this warp's
      // part of a stage (128, and per output channel: never inside one).
      const int check_mask = a.block_shift >= 7 ? 3 : a.block_shift == 6 ? 1 : 0;
      for (int kb0 = kb_begin; kb0 < kb_end; kb0 += kKBlocks) {
        ring.consumer_wait(st);
        const unsigned char* const s = stages + st.stage * a.stage_bytes;
        const int kbw = kb0 + half * 2;  // this warp's first k-block of the stage
        const int nkb = min(2, kb_end - kbw);
        const int block0 = static_cast<int>((static_cast<uint32_t>(kb0) * kKBlock) >> a.block_shift);
#pragma unroll
        for (int hb = 0; hb < 4; ++hb) {  // 32-column halves of the warp's two k-blocks
          const int jj = hb / 2, h = hb % 2;
          if (jj >= nkb) break;
          if ((hb & check_mask) == 0) {
            const int block = static_cast<int>((static_cast<uint32_t>(kbw) * kKBlock + 32 * hb) >> a.block_shift);
            if (block != open) {
              if (open >= 0) fold();
#pragma unroll
              for (int i = 0; i < kAcc; ++i) raw[i] = sx[i] = 0.f;
              const uint2 pr = *reinterpret_cast<const uint2*>(s + par_off + (block - block0) * 64);
              const T2 lo = as_pair<T2>(pr.x), hi = as_pair<T2>(pr.y);
              s_lo = to_float(lo.x);
              s_hi = to_float(hi.x);
              // The centre: the integer zero point, or 8 for the offset form (w = (q − 8)·s + (o + 8·s)); magic + z
              // is exact in either type (fp16 holds integers to 2048, bf16 128 + z < 256).
              const float z_lo = a.zero_point ? to_float(lo.y) : 8.f, z_hi = a.zero_point ? to_float(hi.y) : 8.f;
              c_lo = a.zero_point ? 0.f : fmaf(8.f, s_lo, to_float(lo.y));
              c_hi = a.zero_point ? 0.f : fmaf(8.f, s_hi, to_float(hi.y));
              nsub_lo = broadcast_pair<T2>(-(Int4Codes<T>::kMagicLo + z_lo));
              nsub_hi = broadcast_pair<T2>(-(Int4Codes<T>::kMagicHi + z_hi));
              open = block;
            }
          }
          const uint2 w = *reinterpret_cast<const uint2*>(s + code_off + jj * 512 + h * 8);
          uint32_t f[2][4];
          Int4Codes<T>::step(w.x, f[0]);
          Int4Codes<T>::step(w.y, f[1]);
#pragma unroll
          for (int u = 0; u < 2; ++u)
#pragma unroll
            for (int r = 0; r < 4; ++r)
              f[u][r] = pair_bits(__hadd2(as_pair<T2>(f[u][r]), r % 2 == 0 ? nsub_lo : nsub_hi));
          const uint32_t xt = ptx::smem_u32(s + x_off + jj * kBN * 128) + lx[h];
#pragma unroll
          for (int nt = 0; nt < kBN / 8; ++nt) {
            uint32_t b[4];
            ptx::ldmatrix_x4(b, xt + nt * 1024);
            float(&r)[4] = *reinterpret_cast<float(*)[4]>(raw + 4 * nt);
            float(&x)[4] = *reinterpret_cast<float(*)[4]>(sx + 4 * nt);
            ptx::mma_m16n8k16<kFP16>(r, f[0], b[0], b[1]);
            ptx::mma_m16n8k16<kFP16>(r, f[1], b[2], b[3]);
            if (!a.zero_point) {  // the zero-point form has c = 0: no Σ x term
              ptx::mma_m16n8k16<kFP16>(x, ones, b[0], b[1]);
              ptx::mma_m16n8k16<kFP16>(x, ones, b[2], b[3]);
            }
          }
        }
        ring.consumer_release_warp(st);
        st.advance(a.stages);
        // raw and sx never span more than this warp's 128 columns of a stage (short fp32 sums; a block that goes on,
        // per output channel, keeps its parameters loaded).
        fold();
#pragma unroll
        for (int i = 0; i < kAcc; ++i) raw[i] = sx[i] = 0.f;
      }
    } else {
      const int t = lane % 4;
      for (int kb0 = kb_begin; kb0 < kb_end; kb0 += kKBlocks) {
        ring.consumer_wait(st);
        const unsigned char* const s = stages + st.stage * a.stage_bytes;
#pragma unroll
        for (int j = 0; j < kKBlocks; ++j) {
          if (kb0 + j >= kb_end) break;
          if (j / (kKBlocks / 2) != half) continue;  // the other warp of this stripe takes it
          uint32_t f[4][4];
          convert(s, kb0 + j, kb0, j, f);
          const unsigned char* const xt = s + j * kBN * 128;
#pragma unroll
          for (int step = 0; step < 4; ++step)
#pragma unroll
            for (int nt = 0; nt < kBN / 8; ++nt) {
              const unsigned char* const row = xt + (nt * 8 + g) * 128 + 4 * t;
              const uint32_t b0 = *reinterpret_cast<const uint32_t*>(row + (((2 * step) ^ g) * 16));
              const uint32_t b1 = *reinterpret_cast<const uint32_t*>(row + (((2 * step + 1) ^ g) * 16));
              ptx::mma_m16n8k16<kFP16>(*reinterpret_cast<float(*)[4]>(acc + 4 * nt), f[step], b0, b1);
            }
        }
        ring.consumer_release_warp(st);
        st.advance(a.stages);
      }
    }
    // The two halves of each stripe meet in shared memory (stage 0 of the ring: every stage has been consumed and
    // no TMA is pending once all consumers pass the first barrier); half 0 adds half 1's sums in a fixed order.
    float* const red = reinterpret_cast<float*>(stages) + ((wg % 2) * 128 + threadIdx.x % 128) * kAcc;
    ptx::named_barrier_sync(1, kConsumerThreads);
    if (half == 1)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) red[i] = acc[i];
    ptx::named_barrier_sync(1, kConsumerThreads);
    if (half == 1) return;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] += red[i];
  } else {
    auto issue = [&](const unsigned char* s, const uint32_t(&f)[4][4], bool accumulate) {
      const uint64_t desc = ptx::wgmma_desc_k_major_sw128(s);
      ptx::wgmma_fence();
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        const int scale_d = (accumulate || step > 0) ? 1 : 0;
        if constexpr (kFP16)
          Mma::mma_f16_rs(acc, f[step], desc + 2 * step, scale_d);
        else
          Mma::mma_bf16_rs(acc, f[step], desc + 2 * step, scale_d);
      }
      ptx::wgmma_commit_group();
    };

    // wgmma reads its A registers asynchronously: a buffer is pinned (ptx::wgmma_fence_registers) once the batch that
    // reads it is known complete (the pins act in NVVM; ptxas serializes the int4 batches on its own:
    // docs/perf/linear.md).
    auto pin = [](uint32_t(&f)[4][4]) { ptx::wgmma_fence_registers(f); };
    pipeline::PipelineState prev;
    // One k-block into fragment buffer `cur` (compile-time, so the buffers stay in registers); the stage is awaited
    // at its first k-block and the previous stage released once the batch before this one has completed.
    auto step = [&](int kb, uint32_t(&cur)[4][4], uint32_t(&other)[4][4]) {
      const int j = (kb - kb_begin) % kKBlocks, kb0 = kb - j;
      if (j == 0) ring.consumer_wait(st);
      const unsigned char* const s = stages + st.stage * a.stage_bytes;
      convert(s, kb, kb0, j, cur);
      issue(s + j * kBN * 128, cur, kb > kb_begin);
      ptx::wgmma_wait_group<1>();
      ptx::wgmma_fence_registers(acc);
      pin(other);
      if (j == 0 && kb > kb_begin) ring.consumer_release_warp(prev);
      if (j == kKBlocks - 1 || kb + 1 == kb_end) {
        prev = st;
        st.advance(a.stages);
      }
    };
    uint32_t frag[2][4][4];
    for (int kb = kb_begin; kb < kb_end; kb += 2) {
      step(kb, frag[0], frag[1]);
      if (kb + 1 < kb_end) step(kb + 1, frag[1], frag[0]);
    }
    ptx::wgmma_wait_group<0>();
    ptx::wgmma_fence_registers(acc);
    pin(frag[0]);
    pin(frag[1]);
    if (kb_end > kb_begin) ring.consumer_release_warp(prev);
  }

  const int t = lane % 4;
  // Split partials (fp32, reduced by reduce_partials) are stored register by register: measured faster for them than
  // the staged epilogue below (conv B1 C256 56² 3×3, bn 256, 5 splits: 18 µs against 42 µs staged, H200).
  if (kWarpMma || a.splits > 1) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int j = i / 4, e = i % 4;
      const int64_t n = static_cast<int64_t>(n_tile) * kGemmRows + stripe * 16 + g + (e >= 2 ? 8 : 0);
      const int64_t m = static_cast<int64_t>(m_tile) * kBN + 8 * j + 2 * t + (e & 1);
      if (m >= a.m || n >= a.n) continue;
      if (a.splits == 1)
        store_output<T>(a, m, n, acc[i]);
      else
        a.partial[(split * a.m + m) * a.n + n] = acc[i];
    }
  } else if constexpr (!kWarpMma) {
    // Without splits, the wgmma tiles' outputs go through shared memory (the ring, free once both warpgroups' wgmma
    // have completed: every stage was consumed, no TMA is pending) as a [kBN tokens][128 rows] fp32 tile, then every
    // consumer thread stores 8 consecutive outputs of one token row at a time (16-byte stores along y's rows; storing
    // each register where it lands in y wrote 4-byte pieces of 8 rows at once).
    constexpr int kLd = kGemmRows + 4;  // row stride in floats: lanes t = 0..3 (tokens 2t) land in distinct banks
    float* const tile = reinterpret_cast<float*>(stages);
    ptx::named_barrier_sync(1, kConsumerThreads);
    const int row0 = stripe * 16 + g;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int j = i / 4, e = i % 4;
      tile[(8 * j + 2 * t + (e & 1)) * kLd + row0 + 8 * (e >> 1)] = acc[i];
    }
    ptx::named_barrier_sync(1, kConsumerThreads);
    const int64_t n0 = static_cast<int64_t>(n_tile) * kGemmRows, m0 = static_cast<int64_t>(m_tile) * kBN;
    for (int idx = threadIdx.x; idx < kBN * (kGemmRows / 8); idx += kConsumerThreads) {
      const int r = idx / (kGemmRows / 8), c8 = (idx % (kGemmRows / 8)) * 8;
      const int64_t m = m0 + r, n = n0 + c8;
      if (m >= a.m || n >= a.n) continue;
      const float4 lo = *reinterpret_cast<const float4*>(tile + r * kLd + c8);
      const float4 hi = *reinterpret_cast<const float4*>(tile + r * kLd + c8 + 4);
      float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      store_output8<T>(a, m, n, v, static_cast<int>(min(int64_t{8}, a.n - n)));
    }
  }
#endif
}

// y = epilogue(Σ_split partial[split]) in split order.
template <class T>
__global__ void reduce_partials(const GemmArgs a) {
  const int64_t total = a.m * a.n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = 0.f;
    for (int s = 0; s < a.splits; ++s) v += a.partial[s * total + i];
    store_output<T>(a, i / a.n, i % a.n, v);
  }
}

// xw[m, j] = T(x[m, k_perm[j]]) (k_perm null: j): act-order's column permutation and fp32 x's rounding, one pass.
template <class T, class Src>
__global__ void prepare_x(const Src* __restrict__ x, int64_t ldx, const int32_t* __restrict__ k_perm,
                          T* __restrict__ xw, int64_t m, int64_t k) {
  const int64_t total = m * k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k, j = i % k;
    // k_perm is a permutation of [0, K) (prepack checks it); a corrupted one still reads inside the row.
    const int64_t src = k_perm != nullptr ? min(max(static_cast<int64_t>(k_perm[j]), int64_t{0}), k - 1) : j;
    xw[i] = from_float<T>(to_float(x[r * ldx + src]));
  }
}

}  // namespace tessera::linear::detail
