// PTX wrappers: shared-memory mbarriers (PTX ISA: "Parallel Synchronization and Communication Instructions:
// mbarrier"). A barrier completes a phase when its pending arrivals reach zero and its expected transaction
// bytes (TMA, expect_tx) have all landed; waiters test the parity of the phase they wait for.
#pragma once

#include <cstdint>

#include "ptx/smem.cuh"

namespace tessera::ptx {

// One thread initializes; make it visible with fence_mbarrier_init() and a CTA barrier before any use.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}

// Makes initialized barriers visible to the asynchronous proxy (TMA completes transactions through it).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive (release: this thread's earlier memory accesses are visible to threads that observe the phase).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Arrive and add `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

// True once the phase with parity `parity` has completed (acquire).
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
  while (!mbarrier_try_wait_parity(bar, parity)) {
  }
}

// The same wait for a thread that may wait long and shares its scheduler with busy warps (a TMA producer): each
// try_wait may suspend the thread up to `suspend_ns` until the phase completes, instead of returning at once, so the
// loop does not take issue slots from the warps that do the work (measured on prefill, docs/perf/prefill.md v4).
__device__ __forceinline__ void mbarrier_wait_parity_suspend(uint64_t* bar, uint32_t parity,
                                                             uint32_t suspend_ns = 1000000) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2, %3;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity), "r"(suspend_ns)
        : "memory");
  } while (done == 0);
}

}  // namespace tessera::ptx
