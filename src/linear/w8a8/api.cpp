// Public entry point of the W8A8 GEMM: validate every argument, choose the configuration, launch.
#include <cmath>
#include <cstdint>
#include <string>

#include "common/device_info.h"
#include "common/validate.h"
#include "linear/w8a8/check.h"
#include "linear/w8a8/problem.h"
#include "tessera/w8a8.h"

namespace tessera::linear {

using ::tessera::detail::ArgCheck;

std::size_t gemm_w8a8_workspace_bytes(int64_t max_m, int64_t n, int64_t k, int64_t block) {
  const ArgCheck check("tessera::linear::gemm_w8a8_workspace_bytes");
  if (max_m < 0) check.fail("max_m", "must be >= 0, got " + std::to_string(max_m));
  if (n <= 0) check.fail("n", "must be positive, got " + std::to_string(n));
  w8a8::check_block(check, "block", block, k);
  if (max_m == 0) return 0;
  return w8a8::max_partial_bytes(max_m, n, ::tessera::detail::current_device_info().num_sms);
}

void gemm_w8a8(const Int8BlockTensor& a, const Int8BlockTensor& w, const TensorView& y, const W8A8Epilogue& epilogue,
               const Workspace& workspace, cudaStream_t stream) {
  const ArgCheck check("tessera::linear::gemm_w8a8");
  // Every shape, stride and overlap rule first, the device checks last: a bad call is named as such before any
  // question to the driver.
  if (a.block != w.block)
    check.fail("w.block", "must equal a.block (" + std::to_string(a.block) + "), got " + std::to_string(w.block));
  check.rank(w.codes, "w.codes", 2);
  const int64_t k = w.codes.shape[1];
  w8a8::check_block(check, "w.block", w.block, k);
  if (w.block == k && k > w8a8::kMaxPerChannelK)
    check.fail("w.block", "one block per row accumulates all of K in int32: K must be <= " +
                              std::to_string(w8a8::kMaxPerChannelK) + ", got " + std::to_string(k));
  // The kernel's 32-bit coordinates and grid: K in int k-block counts, N in the grid's y dimension (tiles of kRows
  // weight rows), M in int TMA row coordinates of whole token tiles.
  if (k > w8a8::kMaxK)
    check.fail("w.codes", "must have K <= " + std::to_string(w8a8::kMaxK) + ", got " + std::to_string(k));
  const int64_t n = w8a8::check_int8_blocks(check, w, "w", -1, "N", k, a.zero.data != nullptr);
  if (n <= 0) check.fail("w.codes", "must have N > 0 rows");
  if (n > w8a8::kMaxN)
    check.fail("w.codes", "must have N <= " + std::to_string(w8a8::kMaxN) + " rows (65535 tiles of " +
                              std::to_string(w8a8::kRows) + "), got " + std::to_string(n));
  const int64_t m = w8a8::check_int8_blocks(check, a, "a", -1, "M", k, w.zero.data != nullptr);
  if (m > w8a8::kMaxM)
    check.fail("a.codes", "must have M <= " + std::to_string(w8a8::kMaxM) + " rows, got " + std::to_string(m));
  check.dtype(y, "y", {DType::kBF16, DType::kFP16, DType::kFP32, DType::kInt8});
  check.rank(y, "y", 2);
  check.dim(y, "y", 0, m, "M");
  check.dim(y, "y", 1, n, "N");
  check.unit_inner_stride(y, "y");
  check.no_self_overlap(y, "y");
  check.aligned(y, "y", static_cast<int>(dtype_size(y.dtype)));
  const bool has_bias = epilogue.bias.data != nullptr;
  if (has_bias) {
    check.dtype(epilogue.bias, "epilogue.bias", {DType::kFP32});
    check.rank(epilogue.bias, "epilogue.bias", 1);
    check.dim(epilogue.bias, "epilogue.bias", 0, n, "N");
    check.contiguous(epilogue.bias, "epilogue.bias");
    check.aligned(epilogue.bias, "epilogue.bias", 4);
  }
  w8a8::ArgViews views;
  views.add_blocks(w, "w", /*output=*/false);
  views.add_blocks(a, "a", /*output=*/false);
  views.add(y, "y", /*output=*/true);
  if (has_bias) views.add(epilogue.bias, "epilogue.bias", /*output=*/false);
  w8a8::check_disjoint(check, views);
  if (std::isnan(epilogue.clamp_min) || std::isnan(epilogue.clamp_max) || epilogue.clamp_min > epilogue.clamp_max)
    check.fail("epilogue.clamp_min", "must be <= clamp_max (neither NaN), got [" + std::to_string(epilogue.clamp_min) +
                                         ", " + std::to_string(epilogue.clamp_max) + "]");
  if (y.dtype == DType::kInt8 && !(std::isfinite(epilogue.out_scale) && epilogue.out_scale > 0))
    check.fail("epilogue.out_scale",
               "must be positive and finite for int8 y, got " + std::to_string(epilogue.out_scale));
  w8a8::check_on_device(check, views);
  if (m == 0) return;
  w8a8::Problem pb;
  pb.shape.m = m;
  pb.shape.n = n;
  pb.shape.k = k;
  pb.shape.block = w.block;
  pb.shape.num_sms = ::tessera::detail::current_device_info().num_sms;
  pb.config = w8a8::select_config(pb.shape);
  const std::size_t need = w8a8::partial_bytes(pb.shape, pb.config);
  if (need > 0) {
    check.workspace(workspace, need, [&] { return " for M = " + std::to_string(m) + " (gemm_w8a8_workspace_bytes)"; });
    // The split partials are written there while the inputs are read: it must be device memory apart from them all.
    const TensorView ws = ::tessera::detail::workspace_view(workspace, need, y.device);
    // Only its own pairs (the others were checked against each other above), in check_disjoint's order: the inputs,
    // then the outputs.
    for (const bool outputs : {false, true})
      for (const w8a8::ArgViews::Entry& e : views)
        if (e.output == outputs) check.no_overlap(*e.view, e.arg.c_str(), ws, "workspace");
    check.on_current_device(ws, "workspace");
  }
  ::tessera::detail::require_hopper(check.op());
  auto operand = [](const Int8BlockTensor& t) {
    w8a8::Operand o;
    o.codes = static_cast<const int8_t*>(t.codes.data);
    o.ld_codes = t.codes.strides[0];
    o.scale = static_cast<const float*>(t.scale.data);
    o.zero = static_cast<const float*>(t.zero.data);
    o.sums = static_cast<const float*>(t.sums.data);
    o.ld_params = t.scale.strides[0];
    return o;
  };
  pb.a = operand(a);
  pb.w = operand(w);
  // A sums plane enters only through the other operand's zero points (ΣA · zB, ΣB · zA): one given without them is
  // not read at all, as the split-K epilogue already did not (a NaN there multiplied by a zero point of 0 was NaN).
  if (pb.w.zero == nullptr) pb.a.sums = nullptr;
  if (pb.a.zero == nullptr) pb.w.sums = nullptr;
  pb.y = y.data;
  pb.ldy = y.strides[0];
  pb.out_type = y.dtype == DType::kBF16 ? 0 : y.dtype == DType::kFP16 ? 1 : y.dtype == DType::kFP32 ? 2 : 3;
  pb.bias = static_cast<const float*>(epilogue.bias.data);
  pb.clamp_min = epilogue.clamp_min;
  pb.clamp_max = epilogue.clamp_max;
  pb.out_scale = epilogue.out_scale;
  pb.workspace = workspace.data;
  w8a8::launch(pb, stream);
}

}  // namespace tessera::linear
