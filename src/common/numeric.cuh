// Device-side numeric helpers: element loads as fp32, order-preserving float keys, 16-bit pair and fp8 packing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace tessera::detail {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}

// An unsigned key whose integer order is the float order, with NaN ranked as -inf. Every key of a real value is
// >= order_key(-inf) = 0x007FFFFF, so 0 is free to mean "no candidate".
__device__ __forceinline__ uint32_t order_key(float v) {
  v = fmaxf(v, -INFINITY);  // fmaxf returns the non-NaN operand: NaN -> -inf
  const uint32_t u = __float_as_uint(v);
  return u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}
inline constexpr uint32_t kNoCandidate = 0;

// Two floats to one 32-bit register of two fp16 (kFP16) or bf16 values, round to nearest even; lo in the low half
// (the layout of an mma fragment register).
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

// Eight floats to eight saturated fp8 e4m3 bytes (round to nearest even).
__device__ __forceinline__ uint2 pack_fp8x8_e4m3(const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i], v[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// The MoE layer's activation of one element: silu(g) · u with an approximate exponential and division (2 ulp; a
// correctly rounded division has a slow path that is a function call, which in the fused epilogue made ptxas save
// registers to the stack). One definition for the activation step (moe/layer/launch.cu) and the first GEMM's fused
// epilogue (gemm/grouped/kernel.cuh), which must give the same bits.
__device__ __forceinline__ float silu_mul(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }

inline constexpr float kFP8E4M3Max = 448.0f;

// The scale of one fp8 e4m3 activation block (DeepSeek-V3's 1×128 blocks: moe::permute, the MoE layer's
// activation): max(amax, eps) / 448, as a product with the constant 1/448 (within an ulp of the quotient).
// Codes are then x · rcp_approx(scale): the approximate reciprocal is far inside half an e4m3 ulp.
__device__ __forceinline__ float fp8_block_scale(float amax, float eps) {
  return fmaxf(amax, eps) * (1.0f / kFP8E4M3Max);
}

}  // namespace tessera::detail
