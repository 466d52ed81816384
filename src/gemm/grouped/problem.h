// Internal: a validated grouped-GEMM call, in the form the launcher consumes.
#pragma once

#include <cstdint>
#include <optional>

#include "tessera/grouped_gemm.h"
#include "tessera/tensor.h"

namespace tessera::gemm::detail {

enum class Operand : int { kFP8 = 0, kBF16 = 1 };
enum class Layout : int { kContiguous = 0, kMasked = 1 };
enum class Scaling : int { kNone = 0, kPerTensor = 1, kBlockwise = 2 };

// Strides are in elements of the tensor they describe. For the contiguous layout the *_group_stride of x, y and
// x_scale are 0 (rows are global); for the masked layout rows are local to the group.
struct GroupedProblem {
  Operand operand = Operand::kFP8;
  Layout layout = Layout::kContiguous;
  Scaling scaling = Scaling::kNone;
  int num_groups = 0;       // G
  int64_t rows = 0;         // contiguous: M (rows of x and y); masked: max_m
  int64_t n = 0;
  int64_t k = 0;

  const void* x = nullptr;
  int64_t x_row_stride = 0, x_group_stride = 0;
  const void* w = nullptr;
  int64_t w_row_stride = 0, w_group_stride = 0;
  const int32_t* group_rows = nullptr;  // contiguous: offsets [G+1]; masked: masked_m [G]
  void* y = nullptr;
  int64_t y_row_stride = 0, y_group_stride = 0;

  // kPerTensor: x_scale [1], w_scale [G] (strides unused but w_scale_group_stride = its stride).
  // kBlockwise: x_scale[row, kb] at row * xs_row_stride + kb * xs_k_stride (+ g * xs_group_stride if masked);
  //             w_scale[g, nb, kb] at g * ws_group_stride + nb * ws_n_stride + kb * ws_k_stride.
  const float* x_scale = nullptr;
  int64_t xs_row_stride = 0, xs_k_stride = 0, xs_group_stride = 0;
  const float* w_scale = nullptr;
  int64_t ws_group_stride = 0, ws_n_stride = 0, ws_k_stride = 0;

  // The MoE layer's fused activation (set by the layer after check_grouped_gemm; the public op never sets it): w holds
  // N = 2I rows, the gate rows [0, I) then the up rows [I, 2I); instead of y the kernel writes
  // act[r, i] = Q(silu(h[r, i]) · h[r, I + i]) with h as y would have been (bf16-rounded), Q of the operands' type:
  // the e4m3 code of v / *act_scale (fp8) or bf16. Contiguous layout, bf16 or per-tensor fp8 only (their tiles keep
  // weights in wgmma's M side, where a thread holds a gate row and its up row: kernel.cuh). y is not written.
  void* act = nullptr;
  int64_t act_row_stride = 0;  // elements
  const float* act_scale = nullptr;  // fp8: [1]
};

// Validates a call and describes it; throws tessera::Error naming `op` and the argument on any violation,
// before anything is launched. `masked_or_offsets` is offsets (contiguous) or masked_m (masked); scales is
// empty for bf16.
GroupedProblem check_grouped_gemm(const char* op, Operand operand, Layout layout, const TensorView& x,
                                  const TensorView& w, const TensorView& masked_or_offsets,
                                  const std::optional<FP8Scales>& scales, const TensorView& y,
                                  const Workspace& workspace, const GroupedGemmOptions& options);

// Launches the kernel for a checked problem (no further validation).
void launch_grouped_gemm(const GroupedProblem& problem, cudaStream_t stream);

}  // namespace tessera::gemm::detail
