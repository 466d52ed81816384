// Internal: the weights-in-registers dequantization stage of the weight-only linear layer. One lane's codes of one
// 16-column step (linear/layout.h) become its four A-fragment registers (mma.m16n8k16, and the RS operand of wgmma,
// whose per-warp A layout is the same) in the compute type T, from the (scale, p) pairs of its rows g and g + 8.
//
// Exactness: the code reaches the 16-bit type exactly through a magic exponent (int4: fp16 1024 / 64, bf16 128;
// int8: fp16 1024), the zero point is subtracted exactly (magic + zero is an exact integer), and one fma with the
// scale and offset rounds once: w = rn((q − zero) · scale + offset). bf16 int8 has no exact magic (bf16 holds
// integers to 256 only): it goes through fp32 (1 + q / 32768 by a byte permute, one fp32 fma, one rounding to bf16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/bit_ops.cuh"

namespace tessera::linear::detail {

template <class T>
struct Half2Of;
template <>
struct Half2Of<__half> {
  using Type = __half2;
};
template <>
struct Half2Of<__nv_bfloat16> {
  using Type = __nv_bfloat162;
};

template <class T2>
__device__ __forceinline__ T2 as_pair(uint32_t u) {
  return *reinterpret_cast<T2*>(&u);
}
template <class T2>
__device__ __forceinline__ uint32_t pair_bits(T2 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
// Both halves v (exactly representable values only: the callers pass small integers).
template <class T2>
__device__ __forceinline__ T2 broadcast_pair(float v) {
  if constexpr (std::is_same_v<T2, __half2>)
    return __float2half2_rn(v);
  else
    return __float2bfloat162_rn(v);
}

// One lane's constants for one block: rows g ("lo") and g + 8 ("hi").
template <class T, int kBits>
struct DequantParams {
  using T2 = typename Half2Of<T>::Type;
  static constexpr bool kFloatPath = kBits == 8 && sizeof(T) == 2 && !std::is_same_v<T, __half>;
  // Packed path: w = (code_magic − sub) · scale + off.
  T2 scale_lo, scale_hi, sub_lo, sub_hi, off_lo, off_hi;
  // fp32 path (bf16 int8): w = f · scale32 + off32 with f = 1 + q / 32768.
  float scale32_lo, scale32_hi, off32_lo, off32_hi;

  // pair.x = (scale, p) of row g, pair.y of row g + 8; p is the offset (kOffset) or the zero (zero_point).
  __device__ __forceinline__ void load(uint2 pair, bool zero_point) {
    if constexpr (kFloatPath) {
      const T2 lo = as_pair<T2>(pair.x), hi = as_pair<T2>(pair.y);
      constexpr float kUnit = 32768.f;
      scale32_lo = kUnit * __low2float(lo);
      scale32_hi = kUnit * __low2float(hi);
      // offset − 32768·scale, or −(zero + 32768)·scale: the code's 1 + q/32768 carries the 32768.
      off32_lo = zero_point ? -(__high2float(lo) + kUnit) * __low2float(lo) : __high2float(lo) - scale32_lo;
      off32_hi = zero_point ? -(__high2float(hi) + kUnit) * __low2float(hi) : __high2float(hi) - scale32_hi;
    } else {
      const T2 lo = as_pair<T2>(pair.x), hi = as_pair<T2>(pair.y);
      scale_lo = low2(lo);
      scale_hi = low2(hi);
      const T2 p_lo = high2(lo), p_hi = high2(hi);
      // Row g's registers use magic_lo, row g + 8's magic_hi (dequant_step).
      const T2 magic_lo = as_pair<T2>(magic_lo_bits()), magic_hi = as_pair<T2>(magic_hi_bits());
      const T2 zero2 = as_pair<T2>(0u);
      sub_lo = zero_point ? __hadd2(magic_lo, p_lo) : magic_lo;
      sub_hi = zero_point ? __hadd2(magic_hi, p_hi) : magic_hi;
      off_lo = zero_point ? zero2 : p_lo;
      off_hi = zero_point ? zero2 : p_hi;
    }
  }

  static constexpr bool kFP16 = std::is_same_v<T, __half>;
  // int4 fp16: row g's nibbles sit in bits 0-3 of each half (1024 + q), row g + 8's in bits 4-7 (64 + q);
  // bf16 (int4) and int8: one magic for both rows.
  static __device__ __forceinline__ constexpr uint32_t magic_lo_bits() { return kFP16 ? 0x64006400u : 0x43004300u; }
  static __device__ __forceinline__ constexpr uint32_t magic_hi_bits() {
    return kFP16 ? (kBits == 4 ? 0x54005400u : 0x64006400u) : 0x43004300u;
  }

 private:
  static __device__ __forceinline__ T2 low2(T2 v) {
    if constexpr (kFP16)
      return __low2half2(v);
    else
      return __low2bfloat162(v);
  }
  static __device__ __forceinline__ T2 high2(T2 v) {
    if constexpr (kFP16)
      return __high2half2(v);
    else
      return __high2bfloat162(v);
  }
};

template <class T2>
__device__ __forceinline__ uint32_t scale_pair(uint32_t code_magic, T2 sub, T2 scale, T2 off) {
  return pair_bits(__hfma2(__hsub2(as_pair<T2>(code_magic), sub), scale, off));
}

__device__ __forceinline__ uint32_t bf16x2_from_floats(float lo, float hi) {
  return pair_bits(__floats2bfloat162_rn(lo, hi));
}

// int8 bf16 helper: byte j of w as the float 1 + q / 32768 (bytes, low first: 0x00, q, 0x80, 0x3f).
template <int kByte>
__device__ __forceinline__ float unit_float(uint32_t w) {
  return __uint_as_float(__byte_perm(w, 0x3f800000u, 0x7604u | (kByte << 4)));
}

// int4 codes on a magic exponent, exactly: the A registers of one 16-column step hold magic + q (rows g: kMagicLo, rows
// g + 8: kMagicHi; fp16 keeps row g + 8's nibbles at bits 4-7 on 64, whose unit is 1/16). The scale-before form
// (dequant_step) scales them in registers; the scale-after form (the mma.sync consumers of gemm_kernel.cuh) centres
// them (one add: q − z, exact) and applies the block parameters to the sums: Σ w·x = s·Σ (q − z)·x + c·Σ x.
template <class T>
struct Int4Codes {
  static constexpr bool kFP16 = std::is_same_v<T, __half>;
  static constexpr float kMagicLo = kFP16 ? 1024.f : 128.f;
  static constexpr float kMagicHi = kFP16 ? 64.f : 128.f;
  static constexpr uint32_t kOnes = kFP16 ? 0x3c003c00u : 0x3f803f80u;  // a pair of 1.0: the A operand of Σ x

  static __device__ __forceinline__ void step(uint32_t w, uint32_t (&a)[4]) {
    using ::tessera::detail::and_or;
    if constexpr (kFP16) {
      const uint32_t w8 = w >> 8;
      a[0] = and_or<0x000f000fu>(w, 0x64006400u);
      a[1] = and_or<0x00f000f0u>(w, 0x54005400u);
      a[2] = and_or<0x000f000fu>(w8, 0x64006400u);
      a[3] = and_or<0x00f000f0u>(w8, 0x54005400u);
    } else {
      a[0] = and_or<0x000f000fu>(w, 0x43004300u);
      a[1] = and_or<0x000f000fu>(w >> 4, 0x43004300u);
      a[2] = and_or<0x000f000fu>(w >> 8, 0x43004300u);
      a[3] = and_or<0x000f000fu>(w >> 12, 0x43004300u);
    }
  }
};

// The four A registers of one 16-column step from its codes: int4 one 32-bit word (`w0`), int8 two (`w0`, `w1`).
template <class T, int kBits>
__device__ __forceinline__ void dequant_step(uint32_t w0, uint32_t w1, const DequantParams<T, kBits>& p,
                                             uint32_t (&a)[4]) {
  using T2 = typename Half2Of<T>::Type;
  constexpr bool kFP16 = std::is_same_v<T, __half>;
  if constexpr (kBits == 4) {
    Int4Codes<T>::step(w0, a);
    a[0] = scale_pair<T2>(a[0], p.sub_lo, p.scale_lo, p.off_lo);
    a[1] = scale_pair<T2>(a[1], p.sub_hi, p.scale_hi, p.off_hi);
    a[2] = scale_pair<T2>(a[2], p.sub_lo, p.scale_lo, p.off_lo);
    a[3] = scale_pair<T2>(a[3], p.sub_hi, p.scale_hi, p.off_hi);
  } else if constexpr (kFP16) {
    // Bytes v0..v3 in w0, v4..v7 in w1; each pair next to 0x64 makes 1024 + q.
    a[0] = scale_pair<T2>(__byte_perm(w0, 0x64u, 0x4140), p.sub_lo, p.scale_lo, p.off_lo);
    a[1] = scale_pair<T2>(__byte_perm(w0, 0x64u, 0x4342), p.sub_hi, p.scale_hi, p.off_hi);
    a[2] = scale_pair<T2>(__byte_perm(w1, 0x64u, 0x4140), p.sub_lo, p.scale_lo, p.off_lo);
    a[3] = scale_pair<T2>(__byte_perm(w1, 0x64u, 0x4342), p.sub_hi, p.scale_hi, p.off_hi);
  } else {
    a[0] = bf16x2_from_floats(fmaf(unit_float<0>(w0), p.scale32_lo, p.off32_lo),
                              fmaf(unit_float<1>(w0), p.scale32_lo, p.off32_lo));
    a[1] = bf16x2_from_floats(fmaf(unit_float<2>(w0), p.scale32_hi, p.off32_hi),
                              fmaf(unit_float<3>(w0), p.scale32_hi, p.off32_hi));
    a[2] = bf16x2_from_floats(fmaf(unit_float<0>(w1), p.scale32_lo, p.off32_lo),
                              fmaf(unit_float<1>(w1), p.scale32_lo, p.off32_lo));
    a[3] = bf16x2_from_floats(fmaf(unit_float<2>(w1), p.scale32_hi, p.off32_hi),
                              fmaf(unit_float<3>(w1), p.scale32_hi, p.off32_hi));
  }
}

}  // namespace tessera::linear::detail
