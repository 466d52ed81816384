// Decode: what each KV-cache format looks like to one thread of the decode kernel, and how it becomes tensor-core
// operands.
//
// The kernel computes S^T = K Q^T and O^T = V^T P^T with mma.m16n8k16: 16 cached tokens are M of the first
// product and K of the second, the query heads of one KV head are N (8 per n-tile). A tile's key and value rows
// arrive by TMA as swizzled row blocks in shared memory (k_smem / v_smem below); each lane then reads exactly the
// bytes of its own fragments with plain shared loads. That works because the order of D inside a dot product is
// free, and the order of D along O^T's rows only decides where the output is written:
//   S^T: lane (r, c) supplies key rows r and r+8 (the M index) and, for each k-step, 4 of the D values: the
//     kKChunks consecutive chunks from chunk kKChunks * c of each key row; the query fragments are built from the
//     same D positions (k_dim below).
//   O^T: lane (r, c) supplies value rows 2c, 2c+1, 2c+8, 2c+9 (the K index, fixed by P^T's layout) at the D
//     positions of M rows r and r+8: chunks r, r+8, ... of each value row (o_dim below).
// With the swizzles below, the warp's shared loads of one chunk are free of bank conflicts for 128-byte swizzle
// rows (16-bit rows, 8-bit rows of D >= 128, 4-bit rows of D = 256); rows of 32 or 64 bytes take two wavefronts
// for the value loads.
// Within a 32-bit word of int4 key codes the decoder emits elements in the order 0,4,1,5,2,6,3,7 (one shift and one
// lop3 per pair); k_dim includes that order. Value pairs pair two tokens at one D position, in D order.
//
// Row-wise integer scales are not applied per element: a code c goes to the tensor cores as the fp16 value
// bias + c (a bit pattern, exact), and the kernel applies scale and offset per token (kFold below):
//   S[t][h] = s_t (Σ_d q_hd (bias + c_td)) + (o_t - bias s_t) Σ_d q_hd
//   O[h][d] = Σ_t fp16(P_ht s_t) ((bias + c_td) - (bias + m)) + Σ_t P_ht (o_t + m s_t)
// with m the centre (8 or 128; the second term of the first sum is a constant-A mma, see kVCentreEven).
// Group-wise scales (kInt4Group32) change along D inside one dot product, so those codes are dequantized in
// registers (code * scale + offset in one fp16 fma).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/decode/config.h"
#include "tessera/attention.h"

#include "attention/kv_bits.cuh"

namespace tessera::attention::detail {

template <KVFormat kFormat, int kHeadDim, bool kNativeFP16>
struct KVTraits {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");
  static constexpr KVFormat kFmt = kFormat;
  static constexpr int kD = kHeadDim;
  static constexpr bool kNative = kFormat == KVFormat::kNative;
  static constexpr bool kFP8 = kFormat == KVFormat::kFP8;
  static constexpr bool kInt4 =
      kFormat == KVFormat::kInt4 || kFormat == KVFormat::kInt4Group32 || kFormat == KVFormat::kInt4KChannel;
  // fp16 (scale, offset) per row or group (of the values, and of the keys unless kKChannel)
  static constexpr bool kPairs = kFormat == KVFormat::kInt8 || kFormat == KVFormat::kInt8KChannel || kInt4;
  static constexpr bool kGrouped = kFormat == KVFormat::kInt4Group32;
  static constexpr bool kFold = kPairs && !kGrouped;  // row-wise scales applied per token, not per element
  // Per-channel key scales over 32-token blocks: folded into the query per stage (kc_params below); the values
  // keep row-wise pairs (kFold).
  static constexpr bool kKChannel = kv_key_per_channel(kFormat);
  static constexpr bool kKeyRowFold = kFold && !kKChannel;
  // fp16 value of code 0 as the folded formats feed it (in units of the code; int4 odd D positions carry a unit
  // of 16, see int4_pattern). Keys: 1024 + c. Values go in as 1024 + u c too, but are centred (u (c - 8),
  // c - 128) inside the tensor cores: before each 16-token value mma the kernel issues one with the constant
  // A = -(1024 + u · centre) (kVCentreEven / kVCentreOdd: fp16x2 for O^T's even / odd D rows), so no common bias
  // builds up in O^T, where it would cancel against the offsets only after hundreds of truncating fp32 adds.
  static constexpr float kCodeBias = 1024.0f;
  static constexpr float kVCodeBias = kInt4 ? -8.0f : -128.0f;  // minus the centre, in code units
  // fp16x2 bit patterns of -(1024 + u · centre): u = 1 (even rows, and every int8 row), u = 16 (odd int4 rows).
  static constexpr uint32_t kVCentreEven = kInt4 ? 0xe408e408u : 0xe480e480u;  // -1032 / -1152
  static constexpr uint32_t kVCentreOdd = 0xe480e480u;                        // -(1024 + 16 · 8) / -1152
  static constexpr bool kOddUnit = kFold && kInt4;  // odd D positions reach the tensor cores as 16 * code
  // Tensor-core input type: the cache's own type for kNative, fp16 for every quantized format (codes and fp8
  // values are exact in fp16, and its 10-bit mantissa keeps dequantized values closer than bf16 would).
  static constexpr bool kMmaFP16 = kNative ? kNativeFP16 : true;
  static constexpr int kElemBits = decode_elem_bits(kFormat);
  static constexpr int kRowBytes = kD * kElemBits / 8;
  static constexpr int kGroups = kGrouped ? kD / kInt4GroupSize : 1;  // scale pairs per row

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
  static_assert(!kGrouped || (kKChunkElems <= kInt4GroupSize && kVChunkElems <= kInt4GroupSize),
                "a chunk must lie inside one scale group");

  // One warp's staging of one stage of kRows tokens (kHalves mma tiles of 16): the key block, then the value block
  // (kTileBytes each, TMA boxes); the stage's scale pairs live in a ring of their own (kPairBytes per stage): kRows
  // key rows then kRows value rows of kGroups 4-byte pairs, row t at pair_pos(t).
  static constexpr int kRows = decode_stage_rows(kFormat, kHeadDim);
  static constexpr int kHalves = kRows / 16;
  static constexpr int kSwizzle = kRowBytes < 128 ? kRowBytes : 128;  // TMA swizzle span = the box's inner bytes
  static constexpr int kParts = kRowBytes / kSwizzle;                  // swizzle rows per cache row
  static_assert(kParts == 1 || kRows == 16, "32-row stages hold rows of one swizzle span");
  static constexpr int kTileBytes = kRows * kRowBytes;
  static constexpr int kDataBytes = 2 * kTileBytes;
  static constexpr int kPairRowBytes = 4 * kGroups;
  // The stage's key part of the pair ring: kRows row pairs, or (kKChannel) the block's D scales then D offsets.
  static constexpr int kKeyPairBytes = !kPairs ? 0 : kKChannel ? 4 * kD : kRows * kPairRowBytes;
  static constexpr int kPairBytes = kPairs ? kKeyPairBytes + kRows * kPairRowBytes : 0;
  static_assert(!kKChannel || kRows <= kKeyBlock, "a stage lies inside one key block");
  static constexpr int kStageBytes = kDataBytes + kPairBytes;
  static_assert(kTileBytes % (8 * kSwizzle) == 0, "each block must start on its swizzle pattern's repeat");
};

// TMA's swizzle of a byte offset inside a block that starts on the pattern's repeat (8 swizzle rows): the 16-byte
// chunk index (bits 4..) is XORed with the swizzle row index mod kSwizzle / 16 (bits 7..).
template <class T>
__device__ __forceinline__ constexpr int swizzled(int lin) {
  return lin ^ (((lin >> 7) & (T::kSwizzle / 16 - 1)) << 4);
}

// Shared-memory offset of byte `byte` of key row `row` in a key block: rows of kParts swizzle rows each
// (the box (kSwizzle, kParts, 1, 16, 1) of the key tensor map).
template <class T>
__device__ __forceinline__ constexpr int k_smem(int row, int byte) {
  return swizzled<T>(row * T::kRowBytes + byte);
}

// The same for a value block, stored part-major: kRows rows of part 0, then of part 1, ... (the box (kSwizzle,
// kRows, kParts, 1, 1) of the value tensor map), so that the value rows 2c of one load fall on distinct swizzle
// phases. (Rows of several parts come in 16-row stages only; a 32-row stage of 16-token pages arrives as two boxes
// of 16 rows, which is the same layout for rows of one part.)
template <class T>
__device__ __forceinline__ constexpr int v_smem(int row, int byte) {
  return swizzled<T>((byte / T::kSwizzle) * T::kRows * T::kSwizzle + row * T::kSwizzle + byte % T::kSwizzle);
}

// Row order of the shared scale pairs: within each 16-row half, rows t and t+8 side by side, so that the lane
// holding tokens r and r+8 of an S^T tile reads both with one 8-byte load.
__device__ __forceinline__ constexpr int pair_pos(int t) { return (t & 16) + 2 * (t & 7) + ((t >> 3) & 1); }

// Position within a key chunk of the i-th value the key decoder emits.
template <class T>
__device__ __forceinline__ constexpr int k_emit_order(int i) {
  if constexpr (T::kInt4) return (i & ~7) + ((i & 1) ? ((i & 7) >> 1) + 4 : (i & 7) >> 1);
  return i;
}

// D index of the e-th key value lane column c holds (e in [0, D/4)): chunk kKChunks * c + j of the row.
template <class T>
__device__ __forceinline__ int k_dim(int c, int e) {
  const int j = e / T::kKChunkElems, w = e % T::kKChunkElems;
  return (T::kKChunks * c + j) * T::kKChunkElems + k_emit_order<T>(w);
}

// D index of element w of value chunk j of lane row r; O^T m-tile F = j * (kVChunkElems / 2) + i holds elements
// 2i (row r) and 2i + 1 (row r + 8).
template <class T>
__device__ __forceinline__ int o_dim(int r, int j, int w) {
  return (r + 8 * j) * T::kVChunkElems + w;
}

// int4 pair p of a word (bits 4p..4p+3 of each 16-bit half) as fp16 bit patterns 1024 + u_p * code, where
// u_p = 1 for the low nibble of a byte (p even) and 16 for the high one: one lop3 per pair, one shift per two
// pairs (x8 = x >> 8 serves p = 2, 3). Exact in fp16; the kernel divides u out of the dot products (the query's
// odd D positions are pre-scaled by 1/16, O^T's odd rows are scaled back at the end).
template <int p>
__device__ __forceinline__ uint32_t int4_pattern(uint32_t x, uint32_t x8) {
  return and_or<(p & 1) ? 0x00f000f0u : 0x000f000fu>(p < 2 ? x : x8, 0x64006400u);
}
inline constexpr float kInt4OddUnit = 16.0f;

// int4 pair p of word x as code * scale + offset (one hsub2, one fp16 fma); scale16 = scale / 16 for odd p.
template <int p>
__device__ __forceinline__ uint32_t int4_dequant(uint32_t x, uint32_t x8, __half2 scale, __half2 scale16,
                                                 __half2 offset) {
  const __half2 magic = __half2half2(__ushort_as_half(0x6400));
  const __half2 uc = __hsub2(as_half2(int4_pattern<p>(x, x8)), magic);  // u_p * code, exact
  return fp16_bits2(__hfma2(uc, (p & 1) ? scale16 : scale, offset));
}

// Per-channel keys: the block's scales (sx, sy) and offsets (wx, wy) at the D positions of a k-step ks of lane
// column c, as fp16x2 in the order of the B fragment's two registers (x: k_dim(c, 4ks), k_dim(c, 4ks + 1); y: + 2,
// + 3). `params` is the stage's key part of the pair ring: D fp16 scales in channel order, then D offsets. Lane
// column c covers the channels [c·D/4, (c+1)·D/4); int8 keys take them in order (one 8-byte load per k-step), int4
// keys in the decoder's emit order (0, 4, 1, 5, 2, 6, 3, 7 within each 8 channels: one 16-byte load per two
// k-steps, then byte permutes).
template <class T>
struct KcParams {
  static constexpr int kSteps = T::kInt4 ? 2 : 1;  // k-steps served by one load
  uint32_t s[2 * kSteps], w[2 * kSteps];
  __device__ __forceinline__ KcParams(const uint8_t* params, int c, int ks0) {
    const int at = 2 * (c * (T::kD / 4) + 4 * ks0);  // bytes
    if constexpr (T::kInt4) {
      const uint4 a = *reinterpret_cast<const uint4*>(params + at);
      const uint4 b = *reinterpret_cast<const uint4*>(params + 2 * T::kD + at);
      s[0] = a.x; s[1] = a.y; s[2] = a.z; s[3] = a.w;
      w[0] = b.x; w[1] = b.y; w[2] = b.z; w[3] = b.w;
    } else {
      const uint2 a = *reinterpret_cast<const uint2*>(params + at);
      const uint2 b = *reinterpret_cast<const uint2*>(params + 2 * T::kD + at);
      s[0] = a.x; s[1] = a.y;
      w[0] = b.x; w[1] = b.y;
    }
  }
  // k-step ks0 + i.
  __device__ __forceinline__ void get(int i, uint32_t& sx, uint32_t& sy, uint32_t& wx, uint32_t& wy) const {
    if constexpr (T::kInt4) {  // words: channels (0, 1), (2, 3), (4, 5), (6, 7) of the group; i = 1: (2, 6), (3, 7)
      sx = __byte_perm(s[i], s[i + 2], 0x5410);
      sy = __byte_perm(s[i], s[i + 2], 0x7632);
      wx = __byte_perm(w[i], w[i + 2], 0x5410);
      wy = __byte_perm(w[i], w[i + 2], 0x7632);
    } else {
      sx = s[0]; sy = s[1];
      wx = w[0]; wy = w[1];
    }
  }
};

// Key chunk (kWords words of one row) → pairs of tensor-core values in k emit order. pair = (fp16 scale low,
// fp16 offset high), used by the group-wise format only.
template <class T, int kWords>
__device__ __forceinline__ void decode_k(const uint32_t (&w)[kWords], uint32_t pair,
                                         uint32_t (&out)[kWords * 16 / T::kElemBits]) {
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (T::kNative) {
      out[i] = w[i];
    } else if constexpr (T::kFP8) {
      out[2 * i] = e4m3x2_to_f16x2(w[i] & 0xffffu);
      out[2 * i + 1] = e4m3x2_to_f16x2(w[i] >> 16);
    } else if constexpr (T::kFold && !T::kInt4) {  // int8: 1024 + code
      out[2 * i] = __byte_perm(w[i], 0x64u, 0x4140);
      out[2 * i + 1] = __byte_perm(w[i], 0x64u, 0x4342);
    } else if constexpr (T::kFold) {  // int4 per row: 1024 + u * code
      const uint32_t x8 = w[i] >> 8;
      out[4 * i + 0] = int4_pattern<0>(w[i], x8);
      out[4 * i + 1] = int4_pattern<1>(w[i], x8);
      out[4 * i + 2] = int4_pattern<2>(w[i], x8);
      out[4 * i + 3] = int4_pattern<3>(w[i], x8);
    } else {  // int4 groups: dequantized
      const __half2 scale = as_half2(__byte_perm(pair, 0, 0x1010));
      const __half2 scale16 = __hmul2(scale, __float2half2_rn(1.0f / kInt4OddUnit));
      const __half2 offset = as_half2(__byte_perm(pair, 0, 0x3232));
      const uint32_t x8 = w[i] >> 8;
      out[4 * i + 0] = int4_dequant<0>(w[i], x8, scale, scale16, offset);
      out[4 * i + 1] = int4_dequant<1>(w[i], x8, scale, scale16, offset);
      out[4 * i + 2] = int4_dequant<2>(w[i], x8, scale, scale16, offset);
      out[4 * i + 3] = int4_dequant<3>(w[i], x8, scale, scale16, offset);
    }
  }
}

// Value chunks of two token rows t0, t1 (kWords words each) → pairs (t0's value, t1's value) at each D position of
// the chunk, in D order: the A operand of O^T = V^T P^T. pair0 / pair1 = (scale, offset) of t0 / t1 (group-wise
// format only).
template <class T, int kWords>
__device__ __forceinline__ void decode_v(const uint32_t (&w0)[kWords], const uint32_t (&w1)[kWords], uint32_t pair0,
                                         uint32_t pair1, uint32_t (&out)[kWords * 32 / T::kElemBits]) {
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (T::kNative) {
      out[2 * i] = __byte_perm(w0[i], w1[i], 0x5410);
      out[2 * i + 1] = __byte_perm(w0[i], w1[i], 0x7632);
    } else if constexpr (T::kFP8) {
      const uint32_t x = __byte_perm(w0[i], w1[i], 0x5140), y = __byte_perm(w0[i], w1[i], 0x7362);
      out[4 * i + 0] = e4m3x2_to_f16x2(x & 0xffffu);
      out[4 * i + 1] = e4m3x2_to_f16x2(x >> 16);
      out[4 * i + 2] = e4m3x2_to_f16x2(y & 0xffffu);
      out[4 * i + 3] = e4m3x2_to_f16x2(y >> 16);
    } else if constexpr (!T::kInt4) {  // int8 (folded): 1024 + code (centred by the kernel's kVCentre mma)
      // Interleave the two rows' bytes ([t0 c0, t1 c0, t0 c1, t1 c1], then c2, c3), then put the 0x64 exponent byte
      // above each code: three byte permutes per two pairs.
      const uint32_t lo = __byte_perm(w0[i], w1[i], 0x5140), hi = __byte_perm(w0[i], w1[i], 0x7362);
      out[4 * i + 0] = __byte_perm(lo, 0x64646464u, 0x4140);
      out[4 * i + 1] = __byte_perm(lo, 0x64646464u, 0x4342);
      out[4 * i + 2] = __byte_perm(hi, 0x64646464u, 0x4140);
      out[4 * i + 3] = __byte_perm(hi, 0x64646464u, 0x4342);
    } else {
      // x: elements 0..3 of t0 (low half) and t1 (high half); y: elements 4..7. Pair p of x is element p.
      const uint32_t x = __byte_perm(w0[i], w1[i], 0x5410), y = __byte_perm(w0[i], w1[i], 0x7632);
      const uint32_t x8 = x >> 8, y8 = y >> 8;
      if constexpr (T::kFold) {  // 1024 + u * code (centred by the kernel's kVCentre mma)
        out[8 * i + 0] = int4_pattern<0>(x, x8);
        out[8 * i + 1] = int4_pattern<1>(x, x8);
        out[8 * i + 2] = int4_pattern<2>(x, x8);
        out[8 * i + 3] = int4_pattern<3>(x, x8);
        out[8 * i + 4] = int4_pattern<0>(y, y8);
        out[8 * i + 5] = int4_pattern<1>(y, y8);
        out[8 * i + 6] = int4_pattern<2>(y, y8);
        out[8 * i + 7] = int4_pattern<3>(y, y8);
      } else {
        const __half2 scale = as_half2(__byte_perm(pair0, pair1, 0x5410));
        const __half2 scale16 = __hmul2(scale, __float2half2_rn(1.0f / kInt4OddUnit));
        const __half2 offset = as_half2(__byte_perm(pair0, pair1, 0x7632));
        out[8 * i + 0] = int4_dequant<0>(x, x8, scale, scale16, offset);
        out[8 * i + 1] = int4_dequant<1>(x, x8, scale, scale16, offset);
        out[8 * i + 2] = int4_dequant<2>(x, x8, scale, scale16, offset);
        out[8 * i + 3] = int4_dequant<3>(x, x8, scale, scale16, offset);
        out[8 * i + 4] = int4_dequant<0>(y, y8, scale, scale16, offset);
        out[8 * i + 5] = int4_dequant<1>(y, y8, scale, scale16, offset);
        out[8 * i + 6] = int4_dequant<2>(y, y8, scale, scale16, offset);
        out[8 * i + 7] = int4_dequant<3>(y, y8, scale, scale16, offset);
      }
    }
  }
}

}  // namespace tessera::attention::detail
