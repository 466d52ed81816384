// unpermute_reduce device code: one block per (token, column slice); each thread owns 8-element (16-byte) slices of
// the row and gathers the k expert outputs for them, issuing all k loads before the fp32 accumulation so they
// overlap. Few tokens get several column slices each (unpermute_slice_vectors), so that a decode step's one row
// is gathered by many blocks at once instead of one block walking it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/numeric.cuh"
#include "moe/unpermute/config.h"
#include "ptx/ldst.cuh"

namespace tessera::moe::detail {

struct UnpermuteKernelParams {
  const void* y;  // [R, H]
  int64_t y_row_stride;
  int64_t y_rows;  // R: row indices outside [0, R) are skipped (device data the host cannot check)
  const int32_t* row_index;  // [T, k]
  const float* weights;      // [T, k]
  const void* residual;      // [T, H] or nullptr
  int64_t residual_row_stride;
  void* out;  // [T, H]
  int64_t out_row_stride;
  int64_t hidden;
  int64_t slice_vectors;  // 8-element vectors per column slice (blockIdx.y)
  int topk;
  float routed_scale;
};

constexpr int kUnpermuteThreads = 128;
constexpr int kUnpermuteBatch = 8;  // loads in flight per thread

template <typename Elem>
__global__ void __launch_bounds__(kUnpermuteThreads) unpermute_reduce_kernel(const UnpermuteKernelParams p) {
  using tessera::detail::to_float;
  __shared__ int32_t rows[32];
  __shared__ float weights[32];
  const int64_t t = blockIdx.x;
  if (threadIdx.x < p.topk) {
    const int32_t row = p.row_index[t * p.topk + threadIdx.x];
    rows[threadIdx.x] = row < p.y_rows ? row : -1;  // negative: skipped below too
    weights[threadIdx.x] = p.weights[t * p.topk + threadIdx.x];
  }
  __syncthreads();
  const Elem* y = static_cast<const Elem*>(p.y);
  const int64_t num_vec = p.hidden / 8;
  const int64_t vec_begin = blockIdx.y * p.slice_vectors;
  const int64_t vec_end = vec_begin + p.slice_vectors < num_vec ? vec_begin + p.slice_vectors : num_vec;
  for (int64_t v = vec_begin + threadIdx.x; v < vec_end; v += blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j0 = 0; j0 < p.topk; j0 += kUnpermuteBatch) {
      uint4 raw[kUnpermuteBatch];
#pragma unroll
      for (int b = 0; b < kUnpermuteBatch; ++b) {
        const int j = j0 + b;
        const int32_t row = j < p.topk ? rows[j] : -1;
        raw[b] = row >= 0 ? ptx::ld_global_nc_na_v4(y + row * p.y_row_stride + v * 8) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int b = 0; b < kUnpermuteBatch; ++b) {
        const int j = j0 + b;
        if (j >= p.topk || rows[j] < 0) continue;
        const float w = weights[j];
        const Elem* vals = reinterpret_cast<const Elem*>(&raw[b]);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, to_float(vals[i]), acc[i]);
      }
    }
    float res[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (p.residual != nullptr) {
      const uint4 r = ptx::ld_global_nc_na_v4(static_cast<const Elem*>(p.residual) + t * p.residual_row_stride + v * 8);
      const Elem* vals = reinterpret_cast<const Elem*>(&r);
#pragma unroll
      for (int i = 0; i < 8; ++i) res[i] = to_float(vals[i]);
    }
    uint4 packed;
    Elem* o = reinterpret_cast<Elem*>(&packed);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = tessera::detail::from_float<Elem>(fmaf(p.routed_scale, acc[i], res[i]));
    ptx::st_global_v4(static_cast<Elem*>(p.out) + t * p.out_row_stride + v * 8, packed);
  }
}

}  // namespace tessera::moe::detail
