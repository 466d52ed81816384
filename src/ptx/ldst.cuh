// PTX wrappers: global loads and stores with explicit cache behaviour (PTX ISA: "Data Movement and Conversion
// Instructions: ld, st"). Thread scope: each call is per thread.
#pragma once

#include <cstdint>

namespace tessera::ptx {

// Read-only streaming load that does not allocate in L1: data read once per kernel (logits, token rows).
__device__ __forceinline__ uint4 ld_global_nc_na_v4(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// Plain 16-byte store.
__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_global_v2(void* ptr, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(ptr), "r"(v.x), "r"(v.y) : "memory");
}

}  // namespace tessera::ptx
