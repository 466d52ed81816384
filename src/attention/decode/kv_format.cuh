// Decode: what each KV-cache format looks like to one thread of the decode kernel, and how it becomes tensor-core
// operands.
//
// The kernel feeds mma.m16n8k16 straight from per-thread staging: a thread copies exactly the bytes its own
// fragments need (no other thread reads them), so the copies need no barrier and no shared-memory transpose.
// That works because the order of D inside a dot product is free:
//   S = Q·Kᵀ: lane (r, c) supplies key rows r and r+8 (the n index) and, for each k-step, 4 of the D values.
//     It takes the 16-byte chunks c, c+4, c+8, ... of each key row, so one copy instruction of the warp reads
//     whole 64-byte row segments; the query fragment is built from the same D positions (k_dim below).
//   O = P·V: lane (r, c) supplies value rows 2c, 2c+1, 2c+8, 2c+9 (the k index, fixed by P's layout) at the
//     D positions of n index r: chunks r, r+8, ... of each value row (v_dim below); the output is written back
//     through the same map.
// Within a 32-bit word of int4 codes the dequantizer emits elements in the order 0,4,1,5,2,6,3,7 (one lop3 per
// pair); the maps include that order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "tessera/attention.h"

namespace tessera::attention::detail {

template <KVFormat kFormat, int kHeadDim, bool kNativeFP16>
struct KVTraits {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");
  static constexpr KVFormat kFmt = kFormat;
  static constexpr int kD = kHeadDim;
  static constexpr bool kNative = kFormat == KVFormat::kNative;
  static constexpr bool kFP8 = kFormat == KVFormat::kFP8;
  static constexpr bool kInt4 = kFormat == KVFormat::kInt4 || kFormat == KVFormat::kInt4Group32;
  static constexpr bool kPairs = kFormat == KVFormat::kInt8 || kInt4;  // fp16 (scale, offset) per row or group
  static constexpr bool kGrouped = kFormat == KVFormat::kInt4Group32;
  // Tensor-core input type: the cache's own type for kNative, fp16 for every quantized format (codes and fp8
  // values are exact in fp16, and its 10-bit mantissa keeps dequantized values closer than bf16 would).
  static constexpr bool kMmaFP16 = kNative ? kNativeFP16 : true;
  static constexpr int kElemBits = kNative ? 16 : (kInt4 ? 4 : 8);
  static constexpr int kRowBytes = kD * kElemBits / 8;

  // Key rows: each lane holds D/4 values of each of its 2 rows, in chunks of kKChunk bytes.
  static constexpr int kKBytes = kRowBytes / 4;
  static constexpr int kKChunk = kKBytes < 16 ? kKBytes : 16;
  static constexpr int kKChunks = kKBytes / kKChunk;
  static constexpr int kKChunkElems = kKChunk * 8 / kElemBits;
  // Value rows: each lane holds D/8 values of each of its 4 rows.
  static constexpr int kVBytes = kRowBytes / 8;
  static constexpr int kVChunk = kVBytes < 16 ? kVBytes : 16;
  static constexpr int kVChunks = kVBytes / kVChunk;
  static constexpr int kVChunkElems = kVChunk * 8 / kElemBits;
  // (scale, offset) words per row a lane needs: one per row, or one per chunk (a chunk never spans two groups).
  static constexpr int kKPairs = !kPairs ? 0 : (kGrouped ? kKChunks : 1);
  static constexpr int kVPairs = !kPairs ? 0 : (kGrouped ? kVChunks : 1);
  static_assert(!kGrouped || (kKChunkElems <= kInt4GroupSize && kVChunkElems <= kInt4GroupSize),
                "a chunk must lie inside one scale group");

  // Per-lane staging bytes of one 16-token tile, and their offsets (slot-major, lane-minor: slot s of size z
  // sits at off_s * 32 + lane * z, so a warp's 32 reads of one slot are contiguous).
  static constexpr int kKDataOff = 0;
  static constexpr int kVDataOff = kKDataOff + 2 * kKBytes;
  static constexpr int kKPairOff = kVDataOff + 4 * kVBytes;
  static constexpr int kVPairOff = kKPairOff + 2 * kKPairs * 4;
  static constexpr int kLaneBytes = kVPairOff + 4 * kVPairs * 4;
  static constexpr int kStageBytes = 32 * kLaneBytes;  // per warp
};

// Position within a chunk of the i-th value the dequantizer emits.
template <class T>
__device__ __forceinline__ constexpr int emit_order(int i) {
  if constexpr (T::kInt4) return (i & ~7) + ((i & 1) ? ((i & 7) >> 1) + 4 : (i & 7) >> 1);
  return i;
}

// D index of the e-th key value lane column c holds (e in [0, D/4)).
template <class T>
__device__ __forceinline__ int k_dim(int c, int e) {
  const int j = e / T::kKChunkElems, w = e % T::kKChunkElems;
  return (c + 4 * j) * T::kKChunkElems + emit_order<T>(w);
}

// D index of the f-th value column lane row r holds (f in [0, D/8)); also the output column of PV n-tile f, n = r.
template <class T>
__device__ __forceinline__ int v_dim(int r, int f) {
  const int j = f / T::kVChunkElems, w = f % T::kVChunkElems;
  return (r + 8 * j) * T::kVChunkElems + emit_order<T>(w);
}

__device__ __forceinline__ uint32_t fp16_bits2(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 as_half2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Dequantizes one chunk (kWords 32-bit words of codes) into pairs of the tensor-core type, in emit order.
// pair = (fp16 scale in the low half, fp16 offset in the high half), used by integer formats only.
template <class T, int kWords>
__device__ __forceinline__ void dequant_words(const uint32_t (&w)[kWords], uint32_t pair,
                                              uint32_t (&out)[kWords * 32 / T::kElemBits / 2]) {
  if constexpr (T::kNative) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) out[i] = w[i];
  } else if constexpr (T::kFP8) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      uint32_t lo, hi;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"(static_cast<uint16_t>(w[i] & 0xffffu)));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"(static_cast<uint16_t>(w[i] >> 16)));
      out[2 * i] = lo;
      out[2 * i + 1] = hi;
    }
  } else {
    // Codes become exact fp16 integers through the 1024 + code bit pattern, then code * scale + offset in one
    // fp16 fma (a single rounding).
    const __half2 magic = __half2half2(__ushort_as_half(0x6400));
    const __half2 scale = as_half2(__byte_perm(pair, 0, 0x1010));
    const __half2 offset = as_half2(__byte_perm(pair, 0, 0x3232));
#pragma unroll
    for (int i = 0; i < kWords; ++i) {
      if constexpr (T::kInt4) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const uint32_t x = ((w[i] >> (4 * p)) & 0x000f000fu) | 0x64006400u;
          out[4 * i + p] = fp16_bits2(__hfma2(__hsub2(as_half2(x), magic), scale, offset));
        }
      } else {
        const uint32_t x0 = __byte_perm(w[i], 0x64u, 0x4140);
        const uint32_t x1 = __byte_perm(w[i], 0x64u, 0x4342);
        out[2 * i] = fp16_bits2(__hfma2(__hsub2(as_half2(x0), magic), scale, offset));
        out[2 * i + 1] = fp16_bits2(__hfma2(__hsub2(as_half2(x1), magic), scale, offset));
      }
    }
  }
}

}  // namespace tessera::attention::detail
