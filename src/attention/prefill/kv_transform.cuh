// Prefill over a quantized KV cache: the transform warps' conversion of one tile of cache codes (TMA-loaded rows of
// row_bytes bytes, in tile order, into a staging buffer) into the fp16 K or V tile that the consumers' wgmma reads
// (64-column blocks of 128-byte rows, 128-byte swizzle).
//
// Values (attention.h, the cache layout): fp8 rows become their e4m3 values exactly (the fp32 scale per tensor or KV
// head is applied outside the GEMMs: on S for keys, on O for values); the integer formats become code · scale +
// offset, computed as one fp16 fma on the exact fp16 code (decode's rule for its group-wise format), with the
// (scale, offset) pair of the row (kInt8, kInt4, the values of the per-channel formats), of the row's 32-element
// group (kInt4Group32), or of the channel over the row's 32-token block (the keys of kInt8KChannel / kInt4KChannel).
// Rows past the sequence's keys become zeros (their cache slots may hold anything, NaN included).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "attention/kv_bits.cuh"
#include "ptx/smem.cuh"
#include "tessera/attention.h"

namespace tessera::attention::detail {

// What the transform reads besides the codes: the format and its scales (fp16 elements; strides as CacheDesc's).
struct PrefillQuant {
  int format = 0;     // KVFormat
  int row_bytes = 0;  // bytes of one (token, head) row of codes
  const uint16_t* k_scale = nullptr;  // (scale, offset) pairs; per-channel formats: [outer, block, head, 2·D]
  const uint16_t* v_scale = nullptr;
  int64_t s_outer = 0, s_token = 0, s_head = 0;      // pairs: v_scale's, and k_scale's for the row-wise formats
  int64_t kc_outer = 0, kc_block = 0, kc_head = 0;   // per-channel keys
  const float* k_fp8 = nullptr;  // kFP8: [1] or [HKV]
  const float* v_fp8 = nullptr;
  bool fp8_per_head = false;
  int64_t num_outer = 0;  // pages (paged) or sequences: a block-table entry outside [0, num_outer) reads no scale
};

// 16 consecutive elements of one row as 8 fp16 pairs, in order.
struct Half16 {
  uint32_t w[8];
};

__device__ __forceinline__ Half16 zero16() {
  Half16 h;
#pragma unroll
  for (int i = 0; i < 8; ++i) h.w[i] = 0u;
  return h;
}

// Eight code bytes (two words) as fp16 pairs 1024 + c, in element order: one byte permute per pair.
__device__ __forceinline__ void int8_patterns(uint32_t lo, uint32_t hi, uint32_t (&out)[4]) {
  out[0] = __byte_perm(lo, 0x64u, 0x4140);
  out[1] = __byte_perm(lo, 0x64u, 0x4342);
  out[2] = __byte_perm(hi, 0x64u, 0x4140);
  out[3] = __byte_perm(hi, 0x64u, 0x4342);
}

// Byte j of word x (elements 2j in its low nibble, 2j + 1 in its high one) as fp16 pair (1024 + c_lo,
// 1024 + 16 c_hi): the low half keeps the low nibble, the high half the high nibble in place (16 times its code).
template <int j>
__device__ __forceinline__ uint32_t int4_pair_pattern(uint32_t x) {
  const uint32_t dup = __byte_perm(x, 0u, 0x4040 + 0x101 * j);  // byte j in bits 0-7 and 16-23
  return and_or<0x00f0000fu>(dup, 0x64006400u);
}

// Converts codes → fp16 for element block [16u, 16u + 16) of one row. `codes` points at the row's codes,
// `pair` at its (scale, offset) pairs (row-wise formats), `kc` at its block's 2·D channel parameters (per-channel
// keys), `channel_keys` selects the latter.
template <int kD>
__device__ __forceinline__ Half16 dequant16(int format, bool channel_keys, const uint8_t* codes, const uint16_t* pairs,
                                            const uint16_t* kc, int u) {
  Half16 h;
  const __half2 magic = __half2half2(__ushort_as_half(0x6400));
  const KVFormat f = static_cast<KVFormat>(format);
  if (f == KVFormat::kFP8) {
    const uint4 c = *reinterpret_cast<const uint4*>(codes + 16 * u);
    const uint32_t words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      h.w[2 * i] = e4m3x2_to_f16x2(words[i] & 0xffffu);
      h.w[2 * i + 1] = e4m3x2_to_f16x2(words[i] >> 16);
    }
    return h;
  }
  // (scale, offset) per pair of elements: row-wise pairs broadcast, channel parameters as loaded.
  __half2 s[8], o[8];
  if (channel_keys) {
    const uint4 s0 = *reinterpret_cast<const uint4*>(kc + 16 * u);
    const uint4 s1 = *reinterpret_cast<const uint4*>(kc + 16 * u + 8);
    const uint4 o0 = *reinterpret_cast<const uint4*>(kc + kD + 16 * u);
    const uint4 o1 = *reinterpret_cast<const uint4*>(kc + kD + 16 * u + 8);
    const uint32_t sw[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
    const uint32_t ow[8] = {o0.x, o0.y, o0.z, o0.w, o1.x, o1.y, o1.z, o1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s[i] = as_half2(sw[i]);
      o[i] = as_half2(ow[i]);
    }
  } else {
    const int group = f == KVFormat::kInt4Group32 ? u / 2 : 0;  // 32-element groups: two blocks of 16 each
    const uint32_t pr = *reinterpret_cast<const uint32_t*>(pairs + 2 * group);
    const __half2 sp = __low2half2(as_half2(pr)), op = __high2half2(as_half2(pr));
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      s[i] = sp;
      o[i] = op;
    }
  }
  const bool int4 = f == KVFormat::kInt4 || f == KVFormat::kInt4Group32 || f == KVFormat::kInt4KChannel;
  if (!int4) {
    const uint4 c = *reinterpret_cast<const uint4*>(codes + 16 * u);
    uint32_t p[8];
    int8_patterns(c.x, c.y, *reinterpret_cast<uint32_t(*)[4]>(p));
    int8_patterns(c.z, c.w, *reinterpret_cast<uint32_t(*)[4]>(p + 4));
#pragma unroll
    for (int i = 0; i < 8; ++i) h.w[i] = fp16_bits2(__hfma2(__hsub2(as_half2(p[i]), magic), s[i], o[i]));
    return h;
  }
  const uint2 c = *reinterpret_cast<const uint2*>(codes + 8 * u);
  const uint32_t p[8] = {int4_pair_pattern<0>(c.x), int4_pair_pattern<1>(c.x), int4_pair_pattern<2>(c.x),
                         int4_pair_pattern<3>(c.x), int4_pair_pattern<0>(c.y), int4_pair_pattern<1>(c.y),
                         int4_pair_pattern<2>(c.y), int4_pair_pattern<3>(c.y)};
  const __half2 unit = __halves2half2(__float2half(1.0f), __float2half(0.0625f));  // the high nibble is 16 c
#pragma unroll
  for (int i = 0; i < 8; ++i)
    h.w[i] = fp16_bits2(__hfma2(__hsub2(as_half2(p[i]), magic), __hmul2(s[i], unit), o[i]));
  return h;
}

// Stores elements [16u, 16u + 16) of row r into the swizzled tile (64-column blocks of `block_bytes`).
__device__ __forceinline__ void store16(uint8_t* tile, int block_bytes, int r, int u, const Half16& h) {
  const int block = u / 4, unit = 2 * (u % 4);  // 16-byte units of the 128-byte row, before the swizzle
  uint8_t* row = tile + block * block_bytes + r * 128;
#pragma unroll
  for (int k = 0; k < 2; ++k)
    ptx::st_shared_v4(row + (((unit + k) ^ (r & 7)) * 16),
                      make_uint4(h.w[4 * k], h.w[4 * k + 1], h.w[4 * k + 2], h.w[4 * k + 3]));
}

}  // namespace tessera::attention::detail
