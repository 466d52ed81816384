// PTX wrappers: asynchronous copies into shared memory that complete on an mbarrier
// (PTX ISA: "cp.async.bulk.tensor", "cp.async", "cp.async.mbarrier.arrive").
#pragma once

#include <cstdint>

#include "ptx/smem.cuh"

namespace tessera::ptx {

// Issue-side prefetch of a tensor map (a __grid_constant__ kernel parameter) into the descriptor cache.
__device__ __forceinline__ void prefetch_tensormap(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}

// 3-D tile load global → shared through a tensor map; coordinates in elements, innermost first. Elements
// outside the tensor are filled with zeros and still count toward the barrier's transaction bytes.
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const void* tensor_map, uint64_t* bar, int32_t c0,
                                            int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(smem_u32(smem_dst)),
      "l"(tensor_map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// 4-byte asynchronous copy global → shared; when `valid` is false nothing is read and zeros are written.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem_dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

// Arrive on `bar` once every cp.async this thread issued before has landed. The arrival is not added to the
// barrier's expected count: the barrier must be initialized with it included.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

}  // namespace tessera::ptx
