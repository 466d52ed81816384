// Dense FP8 GEMM through the grouped GEMM with one group: the offsets {0, M} are written into the workspace by a
// one-thread kernel on the same stream, then the grouped kernel runs. Every argument is checked (under this op's name)
// before either launch.
#include <cuda_runtime.h>

#include <string>

#include "common/check.h"
#include "common/device_info.h"
#include "common/validate.h"
#include "gemm/grouped/problem.h"
#include "tessera/grouped_gemm.h"

namespace tessera::gemm {
namespace {

constexpr std::size_t kOffsetsBytes = 16;  // int32 {0, M}, padded to keep what follows 16-byte aligned

__global__ void write_one_group_offsets(int32_t* offsets, int32_t m) {
  offsets[0] = 0;
  offsets[1] = m;
}

// `t` [a, b] as [1, a, b].
TensorView with_unit_group(const TensorView& t) {
  TensorView v = t;
  v.rank = 3;
  v.shape[0] = 1;
  v.shape[1] = t.shape[0];
  v.shape[2] = t.shape[1];
  v.strides[0] = t.shape[0] * t.strides[0];
  v.strides[1] = t.strides[0];
  v.strides[2] = t.strides[1];
  return v;
}

}  // namespace

std::size_t gemm_fp8_workspace_bytes(int64_t n, int64_t k) {
  return kOffsetsBytes + grouped_gemm_workspace_bytes(1, n, k);
}

void gemm_fp8(const TensorView& x, const TensorView& w, const FP8Scales& scales, const TensorView& y,
              const Workspace& workspace, cudaStream_t stream) {
  constexpr const char* kOp = "tessera::gemm::gemm_fp8";
  const ::tessera::detail::ArgCheck check(kOp);
  check.rank(x, "x", 2);
  check.rank(w, "w", 2);
  FP8Scales grouped = scales;
  if (scales.mode == ScaleMode::kBlockwise) {
    check.rank(scales.w_scale, "scales.w_scale", 2);
    grouped.w_scale = with_unit_group(scales.w_scale);
  }
  const std::size_t need = gemm_fp8_workspace_bytes(w.shape[0], w.shape[1]);
  check.workspace(workspace, need, " (gemm_fp8_workspace_bytes)");
  const int device = x.device;
  // The workspace is written (the one group's offsets) while every operand is read: it may share memory with none
  // of them; its device is checked after the operands' own checks (a raw pointer asked of the driver).
  const TensorView ws = ::tessera::detail::workspace_view(workspace, need, device);
  check.no_overlap(ws, "workspace", x, "x");
  check.no_overlap(ws, "workspace", w, "w");
  check.no_overlap(ws, "workspace", scales.x_scale, "scales.x_scale");
  check.no_overlap(ws, "workspace", scales.w_scale, "scales.w_scale");
  TensorView offsets = TensorView::contiguous(workspace.data, DType::kInt32, {2}, device);
  offsets.device_verified = true;  // the workspace, checked below under its own name
  const Workspace rest = ::tessera::detail::workspace_part(workspace, kOffsetsBytes, workspace.bytes - kOffsetsBytes);
  const detail::GroupedProblem problem =
      detail::check_grouped_gemm(kOp, detail::Operand::kFP8, detail::Layout::kContiguous, x, with_unit_group(w),
                                 offsets, grouped, y, rest, GroupedGemmOptions{});
  check.on_current_device(ws, "workspace");
  if (problem.rows == 0) return;
  ::tessera::detail::require_hopper(kOp);
  write_one_group_offsets<<<1, 1, 0, stream>>>(static_cast<int32_t*>(workspace.data), static_cast<int32_t>(x.shape[0]));
  TESSERA_CHECK_LAUNCH();
  detail::launch_grouped_gemm(problem, stream);
}

}  // namespace tessera::gemm
