// Internal: a validated weight-only linear call, as the launcher takes it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "linear/config.h"
#include "tessera/linear.h"

namespace tessera::linear::detail {

struct LinearProblem {
  LinearShape shape;
  LinearConfig config;
  DType compute = DType::kBF16;  // the params' type; x is it or fp32
  DType x_dtype = DType::kBF16;
  const void* x = nullptr;
  int64_t ldx = 0;
  const uint8_t* codes = nullptr;
  const uint16_t* params = nullptr;
  const int32_t* k_perm = nullptr;
  int64_t num_blocks = 0;
  int block_shift = 0;
  bool zero_point = false;
  void* y = nullptr;
  int64_t ldy = 0;
  const void* bias = nullptr;
  float clamp_min = 0, clamp_max = 0;
  void* workspace = nullptr;  // prepared x (when x_prepared_bytes > 0), then the partials
  bool prepare_x() const { return k_perm != nullptr || x_dtype == DType::kFP32; }
};

// Workspace bytes of one call: x prepared in the compute type (act-order or fp32 x), then the split partials.
std::size_t prepared_x_bytes(const LinearShape& shape, bool prepare);
std::size_t call_workspace_bytes(const LinearShape& shape, const LinearConfig& config, bool prepare);

void launch_linear(const LinearProblem& problem, cudaStream_t stream);

}  // namespace tessera::linear::detail
