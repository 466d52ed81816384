// Internal: a validated W8A8 GEMM call, as the launcher takes it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "linear/w8a8/config.h"

namespace tessera::linear::w8a8 {

struct Operand {
  const int8_t* codes = nullptr;
  int64_t ld_codes = 0;  // elements (bytes) between rows
  const float *scale = nullptr, *zero = nullptr, *sums = nullptr;
  int64_t ld_params = 0;  // floats between blocks of the parameter planes
};

struct Problem {
  Shape shape;
  Config config;
  Operand a, w;
  void* y = nullptr;
  int64_t ldy = 0;
  int out_type = 0;  // kernel.cuh OutType
  const float* bias = nullptr;
  float clamp_min = 0, clamp_max = 0, out_scale = 1;
  void* workspace = nullptr;  // the split partials
};

void launch(const Problem& problem, cudaStream_t stream);

// The kernels of one form (launch.cu: one block per row; launch_blockwise.cu: per-block promotion).
void launch_per_row(const Problem& problem, cudaStream_t stream);
void launch_blockwise(const Problem& problem, cudaStream_t stream);

}  // namespace tessera::linear::w8a8
