// PTX helpers shared by the shared-memory wrappers: address conversion, named barriers, register reallocation.
#pragma once

#include <cstdint>

namespace tessera::ptx {

// 32-bit shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Loads and stores in the shared state space. A pointer that went through integer arithmetic (the kernels align
// their dynamic shared-memory base) is generic to the compiler, whose loads through it are generic loads (LD, a
// longer latency than LDS): these keep the state space explicit.
__device__ __forceinline__ float ld_shared_f32(const float* ptr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(smem_u32(ptr)) : "memory");
  return v;
}
__device__ __forceinline__ float2 ld_shared_v2_f32(const float* ptr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(smem_u32(ptr)) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_f32(float* ptr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(smem_u32(ptr)), "f"(v) : "memory");
}

// 16-byte store to shared memory (ptr 16-byte aligned).
__device__ __forceinline__ void st_shared_v4(void* ptr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_u32(ptr)), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Makes this thread's shared-memory writes (generic proxy) visible to later asynchronous-proxy reads (wgmma operands,
// TMA stores) once the readers are ordered after it (a barrier).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrive at barrier `id` without waiting; the barrier completes when `threads` threads have arrived or synced.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Register reallocation between warpgroups (sm_90a). Takes effect only in kernels with a register cap at entry
// (__launch_bounds__(threads, 1)); every warp of the warpgroup must execute it.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace tessera::ptx
