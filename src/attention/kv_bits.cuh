// Bit-level pieces shared by the attention kernels that turn KV-cache codes into fp16 tensor-core operands
// (decode's kv_format.cuh, prefill's kv_transform.cuh).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace tessera::attention::detail {

__device__ __forceinline__ uint32_t fp16_bits2(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 as_half2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// (x & kMask) | bits as one lop3: with both constants as immediates the compiler emits two (a LOP3 takes one).
template <uint32_t kMask>
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t bits) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(out) : "r"(x), "n"(kMask), "r"(bits));
  return out;
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x16) {
  uint32_t out;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(static_cast<uint16_t>(x16)));
  return out;
}

}  // namespace tessera::attention::detail
