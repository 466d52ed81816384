// Public entry points of the weight-only linear layer: validate every argument, choose the configuration, launch.
#include <algorithm>
#include <cmath>
#include <string>

#include "common/device_info.h"
#include "common/validate.h"
#include "linear/problem.h"
#include "linear/weight_formats.h"
#include "tessera/linear.h"

namespace tessera::linear {
namespace detail {

using ::tessera::detail::ArgCheck;

namespace {
int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
}  // namespace

DType check_weight(const ArgCheck& check, const LinearWeight& w, bool k_multiple_of_8, bool device_checks) {
  if (w.bits != 4 && w.bits != 8) check.fail("w.bits", "must be 4 or 8, got " + std::to_string(w.bits));
  if (w.n <= 0) check.fail("w.n", "must be positive, got " + std::to_string(w.n));
  if (k_multiple_of_8 && (w.k <= 0 || w.k % 8 != 0))
    check.fail("w.k", "must be a positive multiple of 8, got " + std::to_string(w.k));
  if (w.k <= 0) check.fail("w.k", "must be positive, got " + std::to_string(w.k));
  if (w.k > kMaxLinearK)
    check.fail("w.k", "must be <= 2^30 (the kernels' 32-bit column coordinates), got " + std::to_string(w.k));
  detail::check_bits_and_block(check, w.bits, w.k, w.block);
  if (w.zero_mode != ZeroMode::kOffset && w.zero_mode != ZeroMode::kZeroPoint)
    check.fail("w.zero_mode", "must be kOffset or kZeroPoint");
  const int64_t np = round_up(w.n, 16), kp = round_up(w.k, tile_k(w.bits));
  const int64_t nb = w.block == w.k ? 1 : kp / w.block;
  check.dtype(w.codes, "w.codes", {DType::kUInt8, DType::kInt4x2});
  check.rank(w.codes, "w.codes", 2);
  if (w.codes.shape[0] != np || w.codes.shape[1] != kp * w.bits / 8)
    check.fail("w.codes", "must be the prepacked [" + std::to_string(np) + ", " + std::to_string(kp * w.bits / 8) +
                              "] bytes of an N = " + std::to_string(w.n) + ", K = " + std::to_string(w.k) + " int" +
                              std::to_string(w.bits) + " weight (tessera::linear::prepack), got " +
                              w.codes.shape_str());
  check.contiguous(w.codes, "w.codes");
  check.aligned(w.codes, "w.codes", 16);
  if (device_checks) check.on_current_device(w.codes, "w.codes");
  check.dtype(w.params, "w.params", {DType::kBF16, DType::kFP16});
  check.rank(w.params, "w.params", 3);
  if (w.params.shape[0] != np || w.params.shape[1] != nb || w.params.shape[2] != 2)
    check.fail("w.params", "must be the prepacked [" + std::to_string(np) + ", " + std::to_string(nb) +
                               ", 2] (scale, offset or zero) pairs, got " + w.params.shape_str());
  check.contiguous(w.params, "w.params");
  // Loaded by TMA: the base must be 16-byte aligned (rows may be a single 4-byte block).
  if (reinterpret_cast<std::uintptr_t>(w.params.data) % 16 != 0)
    check.fail("w.params", "must start at a 16-byte aligned address");
  if (device_checks) check.on_current_device(w.params, "w.params");
  if (w.k_perm.data != nullptr) {
    check.dtype(w.k_perm, "w.k_perm", {DType::kInt32});
    check.rank(w.k_perm, "w.k_perm", 1);
    check.dim(w.k_perm, "w.k_perm", 0, w.k, "K");
    check.contiguous(w.k_perm, "w.k_perm");
    if (device_checks) check.on_current_device(w.k_perm, "w.k_perm");
  }
  return w.params.dtype;
}

void check_weight_on_device(const ArgCheck& check, const LinearWeight& w) {
  check.on_current_device(w.codes, "w.codes");
  check.on_current_device(w.params, "w.params");
  if (w.k_perm.data != nullptr) check.on_current_device(w.k_perm, "w.k_perm");
}

void check_epilogue(const ArgCheck& check, const LinearEpilogue& epilogue, DType y_dtype, int64_t n,
                    bool device_checks) {
  if (epilogue.bias.data != nullptr) {
    check.dtype(epilogue.bias, "epilogue.bias", {y_dtype});
    check.rank(epilogue.bias, "epilogue.bias", 1);
    check.dim(epilogue.bias, "epilogue.bias", 0, n, "N");
    check.contiguous(epilogue.bias, "epilogue.bias");
    if (device_checks) check.on_current_device(epilogue.bias, "epilogue.bias");
  }
  if (std::isnan(epilogue.clamp_min) || std::isnan(epilogue.clamp_max) || epilogue.clamp_min > epilogue.clamp_max)
    check.fail("epilogue.clamp_min", "must be <= clamp_max (neither NaN), got [" + std::to_string(epilogue.clamp_min) +
                                         ", " + std::to_string(epilogue.clamp_max) + "]");
}

int block_shift_of(const LinearWeight& w) { return w.block == w.k ? 31 : (w.block == 32 ? 5 : w.block == 64 ? 6 : 7); }

}  // namespace detail

using detail::check_weight;
using ::tessera::detail::ArgCheck;

std::size_t linear_workspace_bytes(int64_t max_m, const LinearWeight& w, DType x_dtype) {
  const ArgCheck check("tessera::linear::linear_workspace_bytes");
  check_weight(check, w, true, true);
  if (max_m < 0) check.fail("max_m", "must be >= 0, got " + std::to_string(max_m));
  const bool prepare = w.k_perm.data != nullptr || x_dtype == DType::kFP32;
  detail::LinearShape s;
  s.n = w.n;
  s.k = w.k;
  s.bits = w.bits;
  s.block = w.block;
  s.num_sms = ::tessera::detail::current_device_info().num_sms;
  if (max_m == 0) return 0;
  s.m = max_m;
  return detail::prepared_x_bytes(s, prepare) + detail::max_partial_bytes(max_m, w.n, s.num_sms);
}

void linear(const TensorView& x, const LinearWeight& w, const TensorView& y, const LinearEpilogue& epilogue,
            const Workspace& workspace, cudaStream_t stream) {
  const ArgCheck check("tessera::linear::linear");
  const DType compute = check_weight(check, w, true, true);
  check.dtype(x, "x", {DType::kBF16, DType::kFP16, DType::kFP32});
  if (x.dtype != DType::kFP32 && x.dtype != compute)
    check.fail("x", std::string("must be ") + dtype_name(compute) + " (the weight's compute dtype) or fp32, got " +
                        dtype_name(x.dtype));
  check.rank(x, "x", 2);
  check.dim(x, "x", 1, w.k, "K");
  check.unit_inner_stride(x, "x");
  const bool prepare = w.k_perm.data != nullptr || x.dtype == DType::kFP32;
  // The kernel stages x by 16-byte copies; a prepared copy (act-order, fp32 x) is dense anyway.
  if (!prepare) check.aligned(x, "x", 16);
  const int64_t m = x.shape[0];
  if (m > 1 && x.strides[0] < w.k)
    check.fail("x", "must have row stride >= K (" + std::to_string(w.k) + "), got " + std::to_string(x.strides[0]));
  // Token tiles run along the grid's y dimension: 65535 tiles of the largest (256 rows).
  if (m > detail::kMaxLinearM)
    check.fail("x", "must have M <= " + std::to_string(detail::kMaxLinearM) + " rows, got " + std::to_string(m));
  check.on_current_device(x, "x");
  check.dtype(y, "y", {x.dtype});
  check.rank(y, "y", 2);
  check.dim(y, "y", 0, m, "M");
  check.dim(y, "y", 1, w.n, "N");
  check.unit_inner_stride(y, "y");
  check.no_self_overlap(y, "y");
  check.on_current_device(y, "y");
  check.no_overlap(y, "y", x, "x");
  check.no_overlap(y, "y", w.codes, "w.codes");
  check.no_overlap(y, "y", w.params, "w.params");
  if (w.k_perm.data != nullptr) check.no_overlap(y, "y", w.k_perm, "w.k_perm");
  detail::check_epilogue(check, epilogue, y.dtype, w.n, true);
  // The epilogue reads the bias while other CTAs write y.
  if (epilogue.bias.data != nullptr) check.no_overlap(y, "y", epilogue.bias, "epilogue.bias");
  detail::LinearProblem pb;
  pb.shape.m = m;
  pb.shape.n = w.n;
  pb.shape.k = w.k;
  pb.shape.bits = w.bits;
  pb.shape.block = w.block;
  pb.shape.num_sms = ::tessera::detail::current_device_info().num_sms;
  if (m == 0) return;
  pb.config = detail::select_config(pb.shape);
  const std::size_t need = detail::call_workspace_bytes(pb.shape, pb.config, prepare);
  if (need > 0) {
    check.workspace(workspace, need, [&] { return " for M = " + std::to_string(m) + " (linear_workspace_bytes)"; });
    // Written (the prepared x, the split partials) while x, the weight and the bias are read and y is written: it
    // may share memory with none of them, and must be device memory of this GPU (a raw pointer: asked of the driver;
    // an adapter's label trusted).
    const TensorView ws = ::tessera::detail::workspace_view(workspace, need, x.device);
    check.no_overlap(ws, "workspace", x, "x");
    check.no_overlap(ws, "workspace", y, "y");
    check.no_overlap(ws, "workspace", w.codes, "w.codes");
    check.no_overlap(ws, "workspace", w.params, "w.params");
    if (w.k_perm.data != nullptr) check.no_overlap(ws, "workspace", w.k_perm, "w.k_perm");
    if (epilogue.bias.data != nullptr) check.no_overlap(ws, "workspace", epilogue.bias, "epilogue.bias");
    check.on_current_device(ws, "workspace");
  }
  ::tessera::detail::require_hopper(check.op());
  pb.compute = compute;
  pb.x_dtype = x.dtype;
  pb.x = x.data;
  // One row's stride is never used, but a tensor map wants a multiple of 16 bytes: that of a dense row.
  pb.ldx = m > 1 ? x.strides[0] : (w.k + 7) / 8 * 8;
  pb.codes = static_cast<const uint8_t*>(w.codes.data);
  pb.params = static_cast<const uint16_t*>(w.params.data);
  pb.k_perm = static_cast<const int32_t*>(w.k_perm.data);
  pb.num_blocks = w.params.shape[1];
  pb.block_shift = detail::block_shift_of(w);
  pb.zero_point = w.zero_mode == ZeroMode::kZeroPoint;
  pb.y = y.data;
  pb.ldy = y.strides[0];
  pb.bias = epilogue.bias.data;
  pb.clamp_min = epilogue.clamp_min;
  pb.clamp_max = epilogue.clamp_max;
  pb.workspace = workspace.data;
  detail::launch_linear(pb, stream);
}

}  // namespace tessera::linear
