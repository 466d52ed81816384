// PTX wrappers: approximate transcendental math on the special function unit (PTX ISA: "Floating Point
// Instructions: ex2, rcp"). Thread scope: per thread. `.ftz` flushes subnormal inputs and results to zero, which
// spares the range fix-ups that the CUDA intrinsics wrap around the same instructions.
#pragma once

namespace tessera::ptx {

// 2^x, maximum relative error about 2^-22 (PTX ISA, ex2.approx).
__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1/x, maximum error about 1 ulp (PTX ISA, rcp.approx); rcp(inf) = 0.
__device__ __forceinline__ float rcp_approx_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace tessera::ptx
