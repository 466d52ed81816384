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

// tanh(x) = 1 - 2 / (2^(2x log2 e) + 1) on the special function unit: absolute error about 2e-7 (ex2.approx's relative
// 2^-22 on the power, rcp.approx's 1 ulp), saturating to +-1 where the power overflows or underflows. The CUDA
// tanhf costs a branch and a dozen instructions more; tanh.approx.f32 is faster but only good to about 5e-4.
__device__ __forceinline__ float tanh_ex2(float x) {
  const float t = ex2_approx_ftz(x * 2.8853900817779268f);  // 2 log2(e)
  return 1.0f - 2.0f * rcp_approx_ftz(t + 1.0f);
}

}  // namespace tessera::ptx
