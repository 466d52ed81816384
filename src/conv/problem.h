// Internal: a validated conv2d call (tessera/conv.h) as the launcher takes it, and the pure rules that choose its path
// and size its workspace (CPU-testable).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "linear/problem.h"
#include "tessera/conv.h"

namespace tessera::conv::detail {

// Sizes of one call, after validation.
struct ConvShape {
  int64_t n = 1, h = 1, w = 1, ci = 1, co = 1, kh = 1, kw = 1, ho = 1, wo = 1;
  Conv2dParams p;
  int bits = 4;
  int64_t block = 0;  // the weight's block (K: per output channel)
  DType x_dtype = DType::kBF16;
  int num_sms = 132;
  int64_t ci_g() const { return ci / p.groups; }
  int64_t co_g() const { return co / p.groups; }
  int64_t k() const { return kh * kw * ci_g(); }
  int64_t pixels() const { return n * ho * wo; }
};

// The implicit-GEMM path's limits (TMA im2col: corners in [−128, 127] and taps in [0, 255] for a 4-D map, traversal
// stride ≤ 8; a non-empty bounding box, so ≥ 2 output rows and columns; grid rows ≤ 65535 tiles).
bool implicit_gemm_fits(const ConvShape& s);
ConvPath choose_path(const ConvShape& s);

// The GEMM shape and configuration of the tensor-core paths (m = pixels, or N·H·W for kLinear).
linear::detail::LinearShape gemm_shape(const ConvShape& s, ConvPath path);

// Workspace: [x rewritten as NHWC compute dtype][y staged NHWC][the GEMM's split partials], each 256-byte aligned.
struct WorkspaceLayout {
  std::size_t x_bytes = 0, y_bytes = 0, partial_bytes = 0;
  std::size_t total() const { return x_bytes + y_bytes + partial_bytes; }
};
bool needs_x_rewrite(const ConvShape& s);
WorkspaceLayout workspace_layout(const ConvShape& s, ConvPath path);

struct ConvProblem {
  ConvShape shape;
  ConvPath path = ConvPath::kDirect;
  DType compute = DType::kBF16;
  const void* x = nullptr;
  const uint8_t* codes = nullptr;
  const uint16_t* params = nullptr;
  int64_t num_blocks = 1;
  int block_shift = 31;
  bool zero_point = false;
  void* y = nullptr;
  const void* bias = nullptr;
  float clamp_min = 0, clamp_max = 0;
  void* workspace = nullptr;
};

void launch_conv(const ConvProblem& problem, cudaStream_t stream);

}  // namespace tessera::conv::detail
