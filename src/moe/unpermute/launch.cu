// unpermute_reduce: validation and launch.
#include <string>

#include "common/device_info.h"
#include "common/check.h"
#include "common/dispatch.h"
#include "common/validate.h"
#include "moe/launch.h"
#include "moe/unpermute/kernel.cuh"
#include "tessera/moe.h"

namespace tessera::moe {

void unpermute_reduce(const TensorView& y_perm, const TensorView& row_index, const TensorView& weights,
                      const std::optional<TensorView>& residual, const TensorView& out, float routed_scale,
                      cudaStream_t stream) {
  const tessera::detail::ArgCheck check("tessera::moe::unpermute_reduce");
  check.dtype(y_perm, "y_perm", {DType::kBF16, DType::kFP16});
  check.rank(y_perm, "y_perm", 2);
  check.unit_inner_stride(y_perm, "y_perm");
  const int64_t H = y_perm.shape[1];
  if (H % 8 != 0) check.fail("y_perm", "must have a hidden size divisible by 8 (16-byte rows), got " + std::to_string(H));
  check.aligned(y_perm, "y_perm", 16);
  check.dtype(row_index, "row_index", {DType::kInt32});
  check.rank(row_index, "row_index", 2);
  check.contiguous(row_index, "row_index");
  const int64_t T = row_index.shape[0];
  const int64_t k = row_index.shape[1];
  check.in_range(k, "row_index.shape[1] (topk)", 1, 32);
  check.contiguous_matrix(weights, "weights", {DType::kFP32}, T, "num_tokens of row_index", k, "topk of row_index");
  check.same_dtype(y_perm, "y_perm", out, "out");
  check.rank(out, "out", 2);
  check.dim(out, "out", 0, T, "num_tokens of row_index");
  check.dim(out, "out", 1, H, "hidden size of y_perm");
  check.unit_inner_stride(out, "out");
  check.no_self_overlap(out, "out");  // rows that share memory would race
  check.aligned(out, "out", 16);
  if (residual) {
    check.same_dtype(y_perm, "y_perm", *residual, "residual");
    check.rank(*residual, "residual", 2);
    check.dim(*residual, "residual", 0, T, "num_tokens of row_index");
    check.dim(*residual, "residual", 1, H, "hidden size of y_perm");
    check.unit_inner_stride(*residual, "residual");
    check.aligned(*residual, "residual", 16);
  }
  check.no_overlap(y_perm, "y_perm", out, "out");
  check.on_current_device(y_perm, "y_perm");
  check.on_current_device(row_index, "row_index");
  check.on_current_device(weights, "weights");
  if (residual) check.on_current_device(*residual, "residual");
  check.on_current_device(out, "out");
  if (T == 0 || H == 0) return;
  tessera::detail::require_hopper("tessera::moe::unpermute_reduce");
  detail::launch_unpermute_reduce(y_perm, row_index, weights, residual, out, routed_scale, stream);
}

namespace detail {

void launch_unpermute_reduce(const TensorView& y_perm, const TensorView& row_index, const TensorView& weights,
                             const std::optional<TensorView>& residual, const TensorView& out, float routed_scale,
                             cudaStream_t stream) {
  const int64_t H = y_perm.shape[1];
  const int64_t T = row_index.shape[0];
  const int64_t k = row_index.shape[1];
  detail::UnpermuteKernelParams kp{};
  kp.y = y_perm.data;
  kp.y_row_stride = y_perm.shape[0] > 1 ? y_perm.strides[0] : H;
  kp.y_rows = y_perm.shape[0];
  kp.row_index = static_cast<const int32_t*>(row_index.data);
  kp.weights = static_cast<const float*>(weights.data);
  kp.residual = residual ? residual->data : nullptr;
  kp.residual_row_stride = residual && T > 1 ? residual->strides[0] : H;
  kp.out = out.data;
  kp.out_row_stride = T > 1 ? out.strides[0] : H;
  kp.hidden = H;
  kp.slice_vectors =
      detail::unpermute_slice_vectors(T, H / 8, tessera::detail::current_device_info().num_sms);
  kp.topk = static_cast<int>(k);
  kp.routed_scale = routed_scale;
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>((H / 8 + kp.slice_vectors - 1) / kp.slice_vectors));
  TESSERA_DISPATCH_HALF(y_perm.dtype, Elem, [&] {
    detail::unpermute_reduce_kernel<Elem><<<grid, detail::kUnpermuteThreads, 0, stream>>>(kp);
    TESSERA_CHECK_LAUNCH();
  });
}

}  // namespace detail

}  // namespace tessera::moe
