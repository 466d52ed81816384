// PTX wrappers: tensor-map (TMA) copies into shared memory that complete on an mbarrier
// (PTX ISA: "cp.async.bulk.tensor", "prefetch.tensormap").
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

// 4-D tile load, as tma_load_3d.
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const void* tensor_map, uint64_t* bar, int32_t c0,
                                            int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_u32(smem_dst)),
      "l"(tensor_map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// 5-D tile load, as tma_load_3d.
__device__ __forceinline__ void tma_load_5d(void* smem_dst, const void* tensor_map, uint64_t* bar, int32_t c0,
                                            int32_t c1, int32_t c2, int32_t c3, int32_t c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, "
      "%7}], [%2];\n" ::"r"(smem_u32(smem_dst)),
      "l"(tensor_map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// 4-D im2col load (PTX ISA 5.5.4 "im2col mode"; the map from make_tensor_map_im2col over NHWC x): {c, w, h, n} is
// the first filter base of the copy (c: the first channel; w, h: a position inside the map's bounding box; n: the
// image), {off_w, off_h} the filter tap added to every base. The copy walks Pixels-per-Column bases in W, H, N
// order within the bounding box (with the map's traversal strides) and lands Channels-per-Pixel channels of each
// base + tap as one row; positions outside the tensor read as zeros and still count toward the transaction bytes.
__device__ __forceinline__ void tma_load_4d_im2col(void* smem_dst, const void* tensor_map, uint64_t* bar, int32_t c,
                                                   int32_t w, int32_t h, int32_t n, uint16_t off_w, uint16_t off_h) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], [%2], {%7, %8};\n" ::"r"(smem_u32(smem_dst)),
      "l"(tensor_map), "r"(smem_u32(bar)), "r"(c), "r"(w), "r"(h), "r"(n), "h"(off_w), "h"(off_h)
      : "memory");
}

}  // namespace tessera::ptx
