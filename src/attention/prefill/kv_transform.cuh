// Prefill over a quantized KV cache: the producer warpgroup's conversion of one tile of cache codes (TMA-loaded rows,
// in tile order, into a staging buffer) into the fp16 K or V tile that the consumers' wgmma reads (64-column blocks
// of 128-byte rows, 128-byte swizzle).
//
// Values (attention.h, the cache layout): fp8 rows become their e4m3 values exactly (the fp32 scale per tensor or KV
// head is applied outside the GEMMs: on S for keys, on O for values); the integer formats become code · scale +
// offset, computed as one fp16 fma on the exact fp16 code (decode's rule for its group-wise format), with the
// (scale, offset) pair of the row (kInt8, kInt4, the values of the per-channel formats), of the row's 32-element
// group (kInt4Group32), or of the channel over the row's 32-token block (the keys of kInt8KChannel / kInt4KChannel).
// Rows past the sequence's keys become zeros (their cache slots may hold anything, NaN included).
//
// Everything that depends on the format is a template parameter of the conversion (one instance per format inside
// the one quantized kernel per head dim): the inner loop carries no format branch (docs/perf/prefill.md, v5).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "attention/kv_bits.cuh"
#include "ptx/smem.cuh"
#include "tessera/attention.h"

namespace tessera::attention::detail {

// What the transform reads besides the codes (the format is the kernel's template argument): the rows' size and the
// scales (fp16 elements; strides as CacheDesc's).
struct PrefillQuant {
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

// How the rows of a K or V tile are scaled: not in the tile (fp8: its scale goes on S or O), one (scale, offset)
// pair per row, one per 32-element group of a row, or one per channel over each 32-token block.
enum class QuantParams { kNone, kRow, kGroup32, kChannel };

template <KVFormat F>
struct QuantFormat {
  static constexpr bool kFP8 = F == KVFormat::kFP8;
  static constexpr bool kInt4 = F == KVFormat::kInt4 || F == KVFormat::kInt4Group32 || F == KVFormat::kInt4KChannel;
  static constexpr QuantParams kValues = kFP8                         ? QuantParams::kNone
                                         : F == KVFormat::kInt4Group32 ? QuantParams::kGroup32
                                                                       : QuantParams::kRow;
  static constexpr QuantParams kKeys =
      F == KVFormat::kInt8KChannel || F == KVFormat::kInt4KChannel ? QuantParams::kChannel : kValues;
};

// Byte j of word x (elements 2j in its low nibble, 2j + 1 in its high one) as the fp16 pair (1024 + c_lo, 64 + c_hi):
// the low nibble lands in the mantissa of 1024 (unit 1), the high nibble stays at bits 4-7 of the high half, the
// mantissa of 64 (unit 1/16).
template <int j>
__device__ __forceinline__ uint32_t int4_pair_bits(uint32_t x) {
  const uint32_t dup = __byte_perm(x, 0u, 0x4040 + 0x101 * j);  // byte j in bits 0-7 and 16-23
  return and_or<0x00f0000fu>(dup, 0x54006400u);
}

// The codes of elements [16u, 16u + 16) of one row: 16 bytes (8-bit codes) or 8 (4-bit).
template <KVFormat F>
struct RawCodes16 {
  uint32_t w[QuantFormat<F>::kInt4 ? 2 : 4];
};
template <KVFormat F>
__device__ __forceinline__ RawCodes16<F> load_codes16(const uint8_t* row, int u) {
  RawCodes16<F> c;
  if constexpr (QuantFormat<F>::kInt4) {
    const uint2 v = *reinterpret_cast<const uint2*>(row + 8 * u);
    c.w[0] = v.x, c.w[1] = v.y;
  } else {
    const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * u);
    c.w[0] = v.x, c.w[1] = v.y, c.w[2] = v.z, c.w[3] = v.w;
  }
  return c;
}

// Those 16 codes as 8 fp16 pairs in element order: fp8 codes as their e4m3 values, integer codes as the codes
// themselves (exact in fp16).
template <KVFormat F>
__device__ __forceinline__ void expand16(const RawCodes16<F>& c, uint32_t (&p)[8]) {
  if constexpr (QuantFormat<F>::kInt4) {
    const __half2 bias = __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x5400));  // (1024, 64)
    const uint32_t x[8] = {int4_pair_bits<0>(c.w[0]), int4_pair_bits<1>(c.w[0]), int4_pair_bits<2>(c.w[0]),
                           int4_pair_bits<3>(c.w[0]), int4_pair_bits<0>(c.w[1]), int4_pair_bits<1>(c.w[1]),
                           int4_pair_bits<2>(c.w[1]), int4_pair_bits<3>(c.w[1])};
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = fp16_bits2(__hsub2(as_half2(x[i]), bias));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (QuantFormat<F>::kFP8) {
        p[2 * i] = e4m3x2_to_f16x2(c.w[i] & 0xffffu);
        p[2 * i + 1] = e4m3x2_to_f16x2(c.w[i] >> 16);
      } else {  // bytes into the mantissa of 1024 (unit 1), then 1024 off
        const __half2 bias = __half2half2(__ushort_as_half(0x6400));
        p[2 * i] = fp16_bits2(__hsub2(as_half2(__byte_perm(c.w[i], 0x64u, 0x4140)), bias));
        p[2 * i + 1] = fp16_bits2(__hsub2(as_half2(__byte_perm(c.w[i], 0x64u, 0x4342)), bias));
      }
    }
  }
}

// Stores elements [16u, 16u + 16) of row r into the swizzled tile (64-column blocks of `block_bytes`); phase = r mod 8
// (passed apart so that a caller whose rows share it computes it once).
__device__ __forceinline__ void store16(uint8_t* tile, int block_bytes, int r, int phase, int u,
                                        const uint32_t (&w)[8]) {
  const int block = u / 4, unit = 2 * (u % 4);  // 16-byte units of the 128-byte row, before the swizzle
  uint8_t* row = tile + block * block_bytes + r * 128;
#pragma unroll
  for (int k = 0; k < 2; ++k)
    ptx::st_shared_v4(row + (((unit + k) ^ phase) * 16),
                      make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]));
}

}  // namespace tessera::attention::detail
