// Internal: a validated weight-only linear call, as the launcher takes it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/validate.h"
#include "linear/config.h"
#include "tessera/linear.h"

namespace tessera::linear::detail {

// An implicit-GEMM conv2d run by the linear kernel (src/conv/, docs/ops/conv.md): x is NHWC [n, h, w, c] of the
// compute dtype, fetched by TMA im2col copies; the GEMM's rows are the n·ho·wo output pixels, its columns the Co
// output channels (CTA tiles of 128 inside one group), its K = kh·kw·ci_g in (kh, kw, ci) order.
struct ConvGeometry {
  bool enabled = false;
  int64_t n = 0, h = 0, w = 0, c = 0, ho = 0, wo = 0, ci_g = 0, co_g = 0;
  int kh = 1, kw = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dil_h = 1, dil_w = 1;
};

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
  bool x_prepared = false;    // x already holds the compute dtype (a conv's prepared input; x_dtype still sets y's)
  ConvGeometry conv;
  bool prepare_x() const { return !x_prepared && (k_perm != nullptr || x_dtype == DType::kFP32); }
};

// The weight's constants and arrays (linear requires K % 8 == 0, x's rows being 16-byte vectors; a conv weight may
// have any K), with or without the arrays' device checks; returns the compute dtype. Throws naming the argument.
DType check_weight(const ::tessera::detail::ArgCheck& check, const LinearWeight& w, bool k_multiple_of_8,
                   bool device_checks);
void check_weight_on_device(const ::tessera::detail::ArgCheck& check, const LinearWeight& w);
// Bias (y's dtype, [n]) and clamp bounds.
void check_epilogue(const ::tessera::detail::ArgCheck& check, const LinearEpilogue& epilogue, DType y_dtype, int64_t n,
                    bool device_checks);
// log2(block), or 31 for one block per output channel.
int block_shift_of(const LinearWeight& w);

// Workspace bytes of one call: x prepared in the compute type (act-order or fp32 x), then the split partials.
std::size_t prepared_x_bytes(const LinearShape& shape, bool prepare);
std::size_t call_workspace_bytes(const LinearShape& shape, const LinearConfig& config, bool prepare);

void launch_linear(const LinearProblem& problem, cudaStream_t stream);

}  // namespace tessera::linear::detail
