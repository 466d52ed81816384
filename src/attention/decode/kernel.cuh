// Decode kernel (split-K flash-decoding over a low-precision KV cache), sm_80+ mma.sync path.
//
// One CTA = (sequence b, KV head, split of the sequence, tile of up to 16 query heads of that KV head). Its 4 warps
// take the split's 16-token tiles round-robin; each warp keeps its own online-softmax state over its tiles:
//   S (16 heads × 16 tokens) = Q · Kᵀ on tensor cores, P = exp2(S - m), O += P · V.
// Keys and values travel by cp.async into per-lane staging (see kv_format.cuh: each lane copies exactly the
// bytes of its own fragments), a ring of kStages tiles per warp, so there is no barrier in the main loop.
// At the end the 4 warps merge through shared memory; with one split the CTA writes o (and lse), otherwise a
// normalized partial O and its log2-sum-exp go to the workspace for the merge kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/decode/kv_format.cuh"
#include "attention/decode/problem.h"
#include "ptx/cp_async.cuh"
#include "ptx/math.cuh"
#include "ptx/mma.cuh"
#include "ptx/smem.cuh"

namespace tessera::attention::detail {

inline constexpr int kDecodeWarps = 4;
inline constexpr int kDecodeThreads = 32 * kDecodeWarps;
inline constexpr int kTileTokens = 16;  // tokens one warp handles per step (one PV k-step)
inline constexpr int kHeadTile = 16;    // query heads per CTA (the mma M)
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.69314718055994531f;

struct DecodeArgs {
  CacheDesc cache;
  const void* q = nullptr;
  int64_t q_stride_b = 0, q_stride_h = 0;
  void* o = nullptr;
  int64_t o_stride_b = 0, o_stride_h = 0;
  float* lse = nullptr;
  int64_t lse_stride_b = 0, lse_stride_h = 0;
  const int32_t* seqlens = nullptr;
  bool q_fp16 = false;  // q and o dtype: fp16 or bf16
  int num_q_heads = 0;
  int group = 0;       // query heads per KV head
  int head_tiles = 0;  // ceil(group / kHeadTile)
  int num_splits = 1;
  float qk_scale = 0;  // softmax_scale (× the fp8 key scale is applied per head in the kernel)
  float softcap = 0;
  int window = 0;
  float* ws_o = nullptr;    // [B, HQ, splits, D] fp32, normalized partial outputs
  float* ws_lse = nullptr;  // [B, HQ, splits] fp32, log2 domain
};

template <class T>
struct DecodeSmem {
  // Stages per warp: as many tiles in flight as fit in ~96 KiB per CTA, so that two CTAs share an SM (the split
  // heuristic counts two per SM; three at 72 KiB measured no faster).
  static constexpr int kStagesRaw = (96 * 1024) / (kDecodeWarps * T::kStageBytes);
  static constexpr int kStages = kStagesRaw < 2 ? 2 : (kStagesRaw > 8 ? 8 : kStagesRaw);
  static constexpr int kQBytes = (T::kD / 16) * 32 * 16;  // query fragments: [k-step][lane] uint4
  static constexpr int kStagingBytes = kDecodeWarps * kStages * T::kStageBytes;
  // The end-of-CTA merge reuses the staging area: O [warp][16][D] plus (m, l) [warp][16].
  static constexpr int kMergeBytes = kDecodeWarps * kHeadTile * (T::kD + 2) * 4;
  static constexpr int kBytes = kQBytes + (kStagingBytes > kMergeBytes ? kStagingBytes : kMergeBytes);
};

template <bool kFP16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kFP16) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

template <int kBytes>
__device__ __forceinline__ void lds_words(const uint8_t* p, uint32_t (&w)[kBytes / 4]) {
  if constexpr (kBytes == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x; w[1] = v.y;
  } else {
    static_assert(kBytes == 4, "chunks are 4, 8 or 16 bytes");
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

// Where one 16-token tile of (b, kv head) lives: byte offset of its first row and the scale-row offset, or
// page_ok = false when the block table names no valid page (the tile's tokens are then masked out).
struct TileSource {
  int64_t data = 0;   // bytes
  int64_t scale = 0;  // fp16 elements
  bool page_ok = true;
};

// The block-table entry of the tile at tok0 (0 for the contiguous layout). Loaded a tile ahead of its use, so the
// lookup's latency hides behind a tile of work.
__device__ __forceinline__ int32_t tile_page(const CacheDesc& cd, int b, int64_t tok0) {
  return cd.paged ? __ldg(cd.block_table + b * cd.block_table_stride + (tok0 >> cd.log2_page_size)) : 0;
}

__device__ __forceinline__ TileSource tile_source(const CacheDesc& cd, int b, int kvh, int64_t tok0, int32_t page) {
  TileSource s;
  int64_t outer, slot;
  if (cd.paged) {
    s.page_ok = page >= 0 && page < cd.num_pages;
    outer = s.page_ok ? page : 0;
    slot = tok0 & (cd.page_size - 1);
  } else {
    outer = b;
    slot = tok0;
  }
  s.data = outer * cd.stride_outer + slot * cd.stride_token + kvh * cd.stride_head;
  s.scale = outer * cd.scale_stride_outer + slot * cd.scale_stride_token + kvh * cd.scale_stride_head;
  return s;
}

template <class T>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const DecodeArgs a) {
  using Smem = DecodeSmem<T>;
  constexpr int kD = T::kD;
  constexpr int kStages = Smem::kStages;
  constexpr bool kF16 = T::kMmaFP16;
  constexpr int kKSteps = kD / 16;
  constexpr int kNTiles = kD / 8;  // PV n-tiles of 8 output columns
  extern __shared__ __align__(16) uint8_t smem[];
  uint4* q_frag = reinterpret_cast<uint4*>(smem);
  uint8_t* staging = smem + Smem::kQBytes;

  const CacheDesc& cd = a.cache;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
  int idx = blockIdx.x;
  const int ht = idx % a.head_tiles;
  idx /= a.head_tiles;
  const int split = idx % a.num_splits;
  idx /= a.num_splits;
  const int kvh = idx % cd.num_kv_heads;
  const int b = idx / cd.num_kv_heads;

  // Keys [lo, len) of this sequence, in 16-aligned tiles counted from tile_base; this split owns a contiguous run.
  int64_t len = a.seqlens[b];
  len = len < 0 ? 0 : (len > cd.capacity ? cd.capacity : len);
  const int64_t lo = (a.window > 0 && len > a.window) ? len - a.window : 0;
  const int64_t tile_base = lo & ~int64_t{kTileTokens - 1};
  const int64_t num_tiles = len > lo ? (len - tile_base + kTileTokens - 1) / kTileTokens : 0;
  const int64_t per_split = (num_tiles + a.num_splits - 1) / a.num_splits;
  const int64_t first_tile = split * per_split;
  int64_t split_tiles = num_tiles - first_tile;
  split_tiles = split_tiles < 0 ? 0 : (split_tiles > per_split ? per_split : split_tiles);
  const int my_tiles =
      split_tiles > warp ? static_cast<int>((split_tiles - warp + kDecodeWarps - 1) / kDecodeWarps) : 0;

  float k_scale = 1.0f, v_scale = 1.0f;
  if constexpr (T::kFP8) {
    k_scale = cd.k_fp8_scale[cd.fp8_per_head ? kvh : 0];
    v_scale = cd.v_fp8_scale[cd.fp8_per_head ? kvh : 0];
  }

  // Query fragments of this head tile: [k-step][lane] = A registers, D in the order of k_dim, in the
  // tensor-core type. Quantized formats run in fp16: q is saturated to its range.
  for (int e = threadIdx.x; e < kKSteps * 32; e += kDecodeThreads) {
    const int ks = e / 32, ln = e % 32, rr = ln / 4, cc = ln % 4;
    float v[2][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // A rows rr and rr + 8
      const int j = ht * kHeadTile + rr + 8 * half;
#pragma unroll
      for (int i = 0; i < 4; ++i) v[half][i] = 0.0f;
      if (j < a.group) {
        const int64_t base = b * a.q_stride_b + static_cast<int64_t>(kvh * a.group + j) * a.q_stride_h;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t at = base + k_dim<T>(cc, 4 * ks + i);
          float x = a.q_fp16 ? __half2float(static_cast<const __half*>(a.q)[at])
                             : __bfloat162float(static_cast<const __nv_bfloat16*>(a.q)[at]);
          if constexpr (!T::kNative) x = fminf(fmaxf(x, -65504.0f), 65504.0f);
          v[half][i] = x;
        }
      }
    }
    uint4 f;
    f.x = pack2<kF16>(v[0][0], v[0][1]);
    f.y = pack2<kF16>(v[1][0], v[1][1]);
    f.z = pack2<kF16>(v[0][2], v[0][3]);
    f.w = pack2<kF16>(v[1][2], v[1][3]);
    q_frag[e] = f;
  }
  __syncthreads();

  // ---- per-warp pipeline over this warp's tiles -------------------------------------------------------------
  uint8_t* my_staging = staging + warp * kStages * T::kStageBytes;
  const uint8_t* kbase = cd.k;
  const uint8_t* vbase = cd.v;
  // Token of a tile's row n (n = row within the 16-token tile).
  auto tile_tok0 = [&](int i) -> int64_t {
    return tile_base + (first_tile + warp + static_cast<int64_t>(kDecodeWarps) * i) * kTileTokens;
  };
  uint32_t page_ok_bits = 0;  // bit s: the tile in stage s has a valid page

  auto issue = [&](int i, int32_t page) {
    const int stage = i % kStages;
    const int64_t tok0 = tile_tok0(i);
    const TileSource src = tile_source(cd, b, kvh, tok0, page);
    page_ok_bits = (page_ok_bits & ~(1u << stage)) | (src.page_ok ? 1u << stage : 0u);
    uint8_t* st = my_staging + stage * T::kStageBytes;
#pragma unroll
    for (int n = 0; n < 2; ++n) {  // key rows r and r + 8
      const int row = r + 8 * n;
      const int64_t t = tok0 + row;
      const bool ok = src.page_ok && t >= lo && t < len;
      const uint8_t* g = kbase + src.data + row * cd.stride_token;
#pragma unroll
      for (int j = 0; j < T::kKChunks; ++j) {
        const int slot = n * T::kKChunks + j;
        ptx::cp_async_zfill<T::kKChunk>(ptx::smem_u32(st + T::kKDataOff * 32 + slot * T::kKChunk * 32 + lane * T::kKChunk),
                                        ok ? g + (c + 4 * j) * T::kKChunk : kbase, ok ? T::kKChunk : 0);
      }
      if constexpr (T::kPairs) {
        const uint16_t* gs = cd.k_scale + src.scale + row * cd.scale_stride_token;
#pragma unroll
        for (int j = 0; j < T::kKPairs; ++j) {
          const int group = T::kGrouped ? (c + 4 * j) * T::kKChunkElems / kInt4GroupSize : 0;
          const int slot = n * T::kKPairs + j;
          ptx::cp_async_zfill<4>(ptx::smem_u32(st + T::kKPairOff * 32 + slot * 128 + lane * 4),
                                 ok ? gs + 2 * group : cd.k_scale, ok ? 4 : 0);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // value rows 2c, 2c+1, 2c+8, 2c+9
      const int row = 2 * c + (u & 1) + 8 * (u >> 1);
      const int64_t t = tok0 + row;
      const bool ok = src.page_ok && t >= lo && t < len;
      const uint8_t* g = vbase + src.data + row * cd.stride_token;
#pragma unroll
      for (int j = 0; j < T::kVChunks; ++j) {
        const int slot = u * T::kVChunks + j;
        ptx::cp_async_zfill<T::kVChunk>(ptx::smem_u32(st + T::kVDataOff * 32 + slot * T::kVChunk * 32 + lane * T::kVChunk),
                                        ok ? g + (r + 8 * j) * T::kVChunk : vbase, ok ? T::kVChunk : 0);
      }
      if constexpr (T::kPairs) {
        const uint16_t* gs = cd.v_scale + src.scale + row * cd.scale_stride_token;
#pragma unroll
        for (int j = 0; j < T::kVPairs; ++j) {
          const int group = T::kGrouped ? (r + 8 * j) * T::kVChunkElems / kInt4GroupSize : 0;
          const int slot = u * T::kVPairs + j;
          ptx::cp_async_zfill<4>(ptx::smem_u32(st + T::kVPairOff * 32 + slot * 128 + lane * 4),
                                 ok ? gs + 2 * group : cd.v_scale, ok ? 4 : 0);
        }
      }
    }
  };

  float o_acc[kNTiles][4];
#pragma unroll
  for (int f = 0; f < kNTiles; ++f) o_acc[f][0] = o_acc[f][1] = o_acc[f][2] = o_acc[f][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // rows r, r + 8 (log2 domain)
  float l_run[2] = {0.0f, 0.0f};            // this lane's part of the row sums
  const float qk_scale = a.qk_scale * k_scale;
  const float softcap = a.softcap;

#pragma unroll 1
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < my_tiles) issue(i, tile_page(cd, b, tile_tok0(i)));
    ptx::cp_async_commit();
  }
  int32_t next_page = kStages - 1 < my_tiles ? tile_page(cd, b, tile_tok0(kStages - 1)) : 0;

#pragma unroll 1
  for (int i = 0; i < my_tiles; ++i) {
    if (i + kStages - 1 < my_tiles) {
      issue(i + kStages - 1, next_page);
      if (i + kStages < my_tiles) next_page = tile_page(cd, b, tile_tok0(i + kStages));
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<kStages - 1>();
    const int stage = i % kStages;
    const uint8_t* st = my_staging + stage * T::kStageBytes;
    const bool page_ok = (page_ok_bits >> stage) & 1u;
    const int64_t tok0 = tile_tok0(i);

    // S = Q Kᵀ for key rows r (n-tile 0) and r + 8 (n-tile 1); even and odd k-steps accumulate apart (sx) so that
    // four independent mma chains hide each other's latency.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float sx[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int j = 0; j < T::kKChunks; ++j) {
      uint32_t kf[2][T::kKChunkElems / 2];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        uint32_t w[T::kKChunk / 4];
        lds_words<T::kKChunk>(st + T::kKDataOff * 32 + (n * T::kKChunks + j) * T::kKChunk * 32 + lane * T::kKChunk, w);
        uint32_t pair = 0;
        if constexpr (T::kPairs)
          pair = *reinterpret_cast<const uint32_t*>(st + T::kKPairOff * 32 +
                                                    (n * T::kKPairs + (T::kGrouped ? j : 0)) * 128 + lane * 4);
        dequant_words<T, T::kKChunk / 4>(w, pair, kf[n]);
      }
#pragma unroll
      for (int sub = 0; sub < T::kKChunkElems / 4; ++sub) {
        const int ks = j * (T::kKChunkElems / 4) + sub;
        const uint4 qa = q_frag[ks * 32 + lane];
        const uint32_t qreg[4] = {qa.x, qa.y, qa.z, qa.w};
        float(&acc)[2][4] = (ks & 1) ? sx : s;
        ptx::mma_m16n8k16<kF16>(acc[0], qreg, kf[0][2 * sub], kf[0][2 * sub + 1]);
        ptx::mma_m16n8k16<kF16>(acc[1], qreg, kf[1][2 * sub], kf[1][2 * sub + 1]);
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int k = 0; k < 4; ++k) s[n][k] += sx[n][k];

    // Online softmax. s[n][k] is head row r (k < 2) or r + 8, key token tok0 + 8n + 2c + (k & 1).
    float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t t = tok0 + 8 * n + 2 * c + (k & 1);
        float x = s[n][k] * qk_scale;
        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
        x = (page_ok && t >= lo && t < len) ? x * kLog2e : -INFINITY;
        s[n][k] = x;
        row_max[k >> 1] = fmaxf(row_max[k >> 1], x);
      }
    }
    float alpha[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
      const float m_new = fmaxf(m_run[h], row_max[h]);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;  // an all-masked row so far stays at zero weight
      alpha[h] = ptx::ex2_approx_ftz(m_run[h] - base[h]);
      m_run[h] = m_new;
    }
    float p[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int k = 0; k < 4; ++k) p[n][k] = ptx::ex2_approx_ftz(s[n][k] - base[k >> 1]);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      l_run[h] = l_run[h] * alpha[h] + p[0][2 * h] + p[0][2 * h + 1] + p[1][2 * h] + p[1][2 * h + 1];
    // alpha is exactly 1 while a row's max stands still (the common case after the first tiles): skip the
    // D/2 multiplies per lane unless some row of the warp moved.
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f))
#pragma unroll
    for (int f = 0; f < kNTiles; ++f) {
      o_acc[f][0] *= alpha[0];
      o_acc[f][1] *= alpha[0];
      o_acc[f][2] *= alpha[1];
      o_acc[f][3] *= alpha[1];
    }
    const uint32_t pa[4] = {pack2<kF16>(p[0][0], p[0][1]), pack2<kF16>(p[0][2], p[0][3]),
                            pack2<kF16>(p[1][0], p[1][1]), pack2<kF16>(p[1][2], p[1][3])};

    // O += P V. Value row u of this lane: 2c, 2c+1, 2c+8, 2c+9 (the B fragment's k rows).
#pragma unroll
    for (int j = 0; j < T::kVChunks; ++j) {
      uint32_t vf[4][T::kVChunkElems / 2];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        uint32_t w[T::kVChunk / 4];
        lds_words<T::kVChunk>(st + T::kVDataOff * 32 + (u * T::kVChunks + j) * T::kVChunk * 32 + lane * T::kVChunk, w);
        uint32_t pair = 0;
        if constexpr (T::kPairs)
          pair = *reinterpret_cast<const uint32_t*>(st + T::kVPairOff * 32 +
                                                    (u * T::kVPairs + (T::kGrouped ? j : 0)) * 128 + lane * 4);
        dequant_words<T, T::kVChunk / 4>(w, pair, vf[u]);
      }
#pragma unroll
      for (int i2 = 0; i2 < T::kVChunkElems / 2; ++i2) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int f = j * T::kVChunkElems + 2 * i2 + hi;
          const uint32_t sel = hi ? 0x7632u : 0x5410u;
          ptx::mma_m16n8k16<kF16>(o_acc[f], pa, __byte_perm(vf[0][i2], vf[1][i2], sel),
                                  __byte_perm(vf[2][i2], vf[3][i2], sel));
        }
      }
    }
  }
  ptx::cp_async_wait<0>();

  // ---- merge the 4 warps ------------------------------------------------------------------------------------
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  __syncthreads();  // every warp is done with its staging (the merge area overlaps it)
  float* m_o = reinterpret_cast<float*>(staging);                   // [warp][16][D]
  float* m_ml = m_o + kDecodeWarps * kHeadTile * kD;                // [warp][16][2]: (m, l)
  {
    float* ow = m_o + warp * kHeadTile * kD;
#pragma unroll
    for (int f = 0; f < kNTiles; ++f) {
      const int d0 = v_dim<T>(2 * c, f), d1 = v_dim<T>(2 * c + 1, f);
      ow[r * kD + d0] = o_acc[f][0];
      ow[r * kD + d1] = o_acc[f][1];
      ow[(r + 8) * kD + d0] = o_acc[f][2];
      ow[(r + 8) * kD + d1] = o_acc[f][3];
    }
    if (c == 0) {
      float* ml = m_ml + warp * kHeadTile * 2;
      ml[r * 2] = m_run[0];
      ml[r * 2 + 1] = l_run[0];
      ml[(r + 8) * 2] = m_run[1];
      ml[(r + 8) * 2 + 1] = l_run[1];
    }
  }
  __syncthreads();

  const bool final_out = a.num_splits == 1;
  for (int e = threadIdx.x; e < kHeadTile * kD; e += kDecodeThreads) {
    const int row = e / kD, d = e % kD;
    const int j = ht * kHeadTile + row;
    if (j >= a.group) continue;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m_all = fmaxf(m_all, m_ml[(w * kHeadTile + row) * 2]);
    float l_all = 0.0f, o_all = 0.0f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float wm = m_ml[(w * kHeadTile + row) * 2];
        const float sc = ptx::ex2_approx_ftz(wm - m_all);  // -inf → 0
        l_all += m_ml[(w * kHeadTile + row) * 2 + 1] * sc;
        o_all += m_o[(w * kHeadTile + row) * kD + d] * sc;
      }
    }
    const bool any = l_all > 0.0f;
    const float out = any ? o_all / l_all * v_scale : 0.0f;
    const float lse2 = any ? m_all + __log2f(l_all) : -INFINITY;  // log2 domain
    const int h = kvh * a.group + j;
    if (final_out) {
      const int64_t at = b * a.o_stride_b + h * a.o_stride_h + d;
      if (a.q_fp16)
        static_cast<__half*>(a.o)[at] = __float2half_rn(out);
      else
        static_cast<__nv_bfloat16*>(a.o)[at] = __float2bfloat16_rn(out);
      if (a.lse != nullptr && d == 0)
        a.lse[b * a.lse_stride_b + h * a.lse_stride_h] = any ? lse2 * kLn2 : -INFINITY;
    } else {
      const int64_t row_idx = (static_cast<int64_t>(b) * a.num_q_heads + h) * a.num_splits + split;
      a.ws_o[row_idx * kD + d] = out;
      if (d == 0) a.ws_lse[row_idx] = lse2;
    }
  }
}

}  // namespace tessera::attention::detail
