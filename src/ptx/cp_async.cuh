// PTX wrappers: asynchronous global->shared copies (PTX ISA: "Data Movement and Conversion Instructions:
// cp.async", cp.async.commit_group, cp.async.wait_group). Thread scope: per thread; a wait covers only the calling
// thread's own copies, so a thread that reads back exactly what it copied needs no barrier.
#pragma once

#include <cstdint>

namespace tessera::ptx {

// Copies kBytes (4, 8 or 16) from global to shared; src_bytes < kBytes zero-fills the rest (0: nothing is read).
// 16-byte copies bypass L1 (.cg); smaller ones must go through it (.ca is the only form for 4 and 8 bytes).
template <int kBytes>
__device__ __forceinline__ void cp_async_zfill(uint32_t smem_addr, const void* gmem, int src_bytes) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(smem_addr), "l"(gmem), "n"(kBytes),
                 "r"(src_bytes)
                 : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most kPending of the calling thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(kPending >= 0 && kPending < 16, "cp.async.wait_group takes a small immediate");
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

}  // namespace tessera::ptx
