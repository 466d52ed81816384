// Bit-level pieces shared by the attention kernels that turn KV-cache codes into fp16 tensor-core operands
// (decode's kv_format.cuh, prefill's kv_transform.cuh).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "common/bit_ops.cuh"

namespace tessera::attention::detail {

__device__ __forceinline__ uint32_t fp16_bits2(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ __half2 as_half2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

using ::tessera::detail::and_or;

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x16) {
  uint32_t out;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(static_cast<uint16_t>(x16)));
  return out;
}

}  // namespace tessera::attention::detail
