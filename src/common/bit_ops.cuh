// Internal: bit-level pieces shared by the kernels that turn integer codes into 16-bit tensor-core operands
// (attention's KV formats, the weight-only linear layer).
#pragma once

#include <cstdint>

namespace tessera::detail {

// (x & kMask) | bits as one lop3: with both constants as immediates the compiler emits two (a LOP3 takes one).
template <uint32_t kMask>
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t bits) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(out) : "r"(x), "n"(kMask), "r"(bits));
  return out;
}

}  // namespace tessera::detail
