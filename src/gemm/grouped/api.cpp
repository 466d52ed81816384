// Public entry points of the grouped GEMM: validate, then launch when there is work.
#include "common/device_info.h"
#include "gemm/grouped/problem.h"
#include "tessera/grouped_gemm.h"

namespace tessera::gemm {
namespace {

void run(const char* op, detail::Operand operand, detail::Layout layout, const TensorView& x, const TensorView& w,
         const TensorView& group_rows, const std::optional<FP8Scales>& scales, const TensorView& y,
         const Workspace& workspace, cudaStream_t stream, const GroupedGemmOptions& options) {
  const detail::GroupedProblem problem =
      detail::check_grouped_gemm(op, operand, layout, x, w, group_rows, scales, y, workspace, options);
  if (problem.rows == 0) return;  // no row can belong to a group
  tessera::detail::require_hopper(op);
  detail::launch_grouped_gemm(problem, stream);
}

}  // namespace

void grouped_gemm_fp8(const TensorView& x, const TensorView& w, const TensorView& offsets, const FP8Scales& scales,
                      const TensorView& y, const Workspace& workspace, cudaStream_t stream,
                      const GroupedGemmOptions& options) {
  run("tessera::gemm::grouped_gemm_fp8", detail::Operand::kFP8, detail::Layout::kContiguous, x, w, offsets, scales, y,
      workspace, stream, options);
}

void grouped_gemm_fp8_masked(const TensorView& x, const TensorView& w, const TensorView& masked_m,
                             const FP8Scales& scales, const TensorView& y, const Workspace& workspace,
                             cudaStream_t stream, const GroupedGemmOptions& options) {
  run("tessera::gemm::grouped_gemm_fp8_masked", detail::Operand::kFP8, detail::Layout::kMasked, x, w, masked_m, scales,
      y, workspace, stream, options);
}

void grouped_gemm_bf16(const TensorView& x, const TensorView& w, const TensorView& offsets, const TensorView& y,
                       const Workspace& workspace, cudaStream_t stream, const GroupedGemmOptions& options) {
  run("tessera::gemm::grouped_gemm_bf16", detail::Operand::kBF16, detail::Layout::kContiguous, x, w, offsets,
      std::nullopt, y, workspace, stream, options);
}

void grouped_gemm_bf16_masked(const TensorView& x, const TensorView& w, const TensorView& masked_m, const TensorView& y,
                              const Workspace& workspace, cudaStream_t stream, const GroupedGemmOptions& options) {
  run("tessera::gemm::grouped_gemm_bf16_masked", detail::Operand::kBF16, detail::Layout::kMasked, x, w, masked_m,
      std::nullopt, y, workspace, stream, options);
}

}  // namespace tessera::gemm
