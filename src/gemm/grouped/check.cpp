// Grouped GEMM: argument validation and the GroupedProblem the launcher consumes. Every rule runs before any
// device query; the device checks come last so that machines without a GPU can test the others.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/validate.h"
#include "gemm/grouped/problem.h"
#include "tessera/grouped_gemm.h"

namespace tessera::gemm {

std::size_t grouped_gemm_workspace_bytes(int64_t /*num_groups*/, int64_t /*n*/, int64_t /*k*/) { return 0; }

namespace detail {
namespace {

using tessera::detail::ArgCheck;

constexpr int64_t kTmaAlignBytes = 16;                   // global address and stride granularity of TMA
constexpr int64_t kTmaMaxStrideBytes = int64_t{1} << 40;  // cuTensorMapEncodeTiled's stride limit
constexpr int64_t kMaxRows = INT32_MAX;                   // row indices are int32 on the device

std::string str(int64_t v) { return std::to_string(v); }

std::string shape_str(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  for (int64_t d : dims) s += (s.size() > 1 ? ", " : "") + str(d);
  return s + "]";
}

// A TMA-read operand or a 16-byte-stored output: data 16-byte aligned; every dim but the last that has more than one
// element has a positive stride, a multiple of 16 bytes, below TMA's limit. (Strides of dims of size <= 1 are never
// used to address memory; the problem gets a normalized value for them.)
void check_tma_layout(const ArgCheck& check, const TensorView& t, const char* arg) {
  if (t.numel() == 0) return;
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  if (reinterpret_cast<std::uintptr_t>(t.data) % kTmaAlignBytes != 0)
    check.fail(arg, "must start at a 16-byte aligned address (TMA)");
  for (int d = 0; d + 1 < t.rank; ++d) {
    if (t.shape[d] <= 1) continue;
    const int64_t s = t.strides[d];
    if (s <= 0)
      check.fail(arg, "must have a positive stride in dim " + str(d) + " (size " + str(t.shape[d]) + "), got " +
                          str(s));
    if (s >= kTmaMaxStrideBytes / elem)
      check.fail(arg, "must have strides below 2^40 bytes (TMA), got " + str(s) + " in dim " + str(d));
    if ((s * elem) % kTmaAlignBytes != 0)
      check.fail(arg, "must have a stride in dim " + str(d) + " that is a multiple of 16 bytes (" +
                          str(kTmaAlignBytes / elem) + " elements of " + dtype_name(t.dtype) + "), got " + str(s));
  }
}

// Scales are read with 4-byte loads at any (non-negative) strides.
void check_scale_layout(const ArgCheck& check, const TensorView& t, const char* arg) {
  check.dtype(t, arg, {DType::kFP32});
  for (int d = 0; d < t.rank; ++d)
    if (t.shape[d] > 1 && t.strides[d] < 0)
      check.fail(arg, "must have non-negative strides, got " + str(t.strides[d]) + " in dim " + str(d));
  if (t.numel() > 0 && reinterpret_cast<std::uintptr_t>(t.data) % 4 != 0)
    check.fail(arg, "must start at a 4-byte aligned address (fp32)");
}

void check_scale_shape(const ArgCheck& check, const TensorView& t, const char* arg, const char* what,
                       std::initializer_list<int64_t> expected) {
  bool ok = t.rank == static_cast<int>(expected.size());
  int d = 0;
  for (int64_t e : expected) ok = ok && t.shape[d++] == e;
  if (!ok)
    check.fail(arg, std::string("must have shape ") + what + " = " + shape_str(expected) + " (kBlockwise), got " +
                        t.shape_str());
}

// The stride used to address dim `d`; a dim of size <= 1 gets `fallback` (a valid TMA stride) instead.
int64_t stride_or(const TensorView& t, int d, int64_t fallback) { return t.shape[d] > 1 ? t.strides[d] : fallback; }

}  // namespace

GroupedProblem check_grouped_gemm(const char* op, Operand operand, Layout layout, const TensorView& x,
                                  const TensorView& w, const TensorView& group_rows,
                                  const std::optional<FP8Scales>& scales, const TensorView& y,
                                  const Workspace& workspace, const GroupedGemmOptions& options) {
  const ArgCheck check(op);
  const bool fp8 = operand == Operand::kFP8;
  const bool masked = layout == Layout::kMasked;
  const char* rows_arg = masked ? "masked_m" : "offsets";
  if (fp8 != scales.has_value())
    check.fail("scales", fp8 ? "are required for fp8 inputs" : "apply only to fp8 inputs");
  const DType in = fp8 ? DType::kFP8E4M3 : DType::kBF16;
  // K granularity: one 128-byte TMA row per k-block (128 fp8 or 64 bf16 elements).
  const int64_t k_multiple = fp8 ? kGroupedGemmBlock : kGroupedGemmBlock / 2;

  // w [G, N, K] defines G, N and K.
  check.dtype(w, "w", {in});
  check.rank(w, "w", 3);
  const int64_t G = w.shape[0], N = w.shape[1], K = w.shape[2];
  if (G < 1 || G > kGroupedGemmMaxGroups)
    check.fail("w", "must have 1 to " + str(kGroupedGemmMaxGroups) +
                        " groups in dim 0 (kGroupedGemmMaxGroups), got shape " + w.shape_str());
  if (N <= 0 || N % kGroupedGemmBlock != 0)
    check.fail("w", "must have N (dim 1) a positive multiple of " + str(kGroupedGemmBlock) + ", got shape " +
                        w.shape_str());
  if (K <= 0 || K % k_multiple != 0)
    check.fail("w", "must have K (dim 2) a positive multiple of " + str(k_multiple) + " for " + dtype_name(in) +
                        " inputs, got shape " + w.shape_str());

  // x: contiguous [M, K], masked [G, max_m, K].
  check.dtype(x, "x", {in});
  check.rank(x, "x", masked ? 3 : 2);
  if (masked) check.dim(x, "x", 0, G, "num_groups, w.shape[0]");
  const int64_t rows = x.shape[masked ? 1 : 0];
  if (rows < 0 || rows > kMaxRows)
    check.fail("x", "must have 0 to " + str(kMaxRows) + " rows (" + (masked ? "max_m" : "M") +
                        "; row indices are int32), got shape " + x.shape_str());
  check.dim(x, "x", x.rank - 1, K, "K, w.shape[2]");

  // y: contiguous [M, N], masked [G, max_m, N].
  check.dtype(y, "y", {DType::kBF16});
  check.rank(y, "y", masked ? 3 : 2);
  if (masked) check.dim(y, "y", 0, G, "num_groups, w.shape[0]");
  check.dim(y, "y", masked ? 1 : 0, rows, masked ? "max_m, x.shape[1]" : "M, x.shape[0]");
  check.dim(y, "y", y.rank - 1, N, "N, w.shape[1]");

  // offsets int32 [G+1] or masked_m int32 [G].
  check.dtype(group_rows, rows_arg, {DType::kInt32});
  check.rank(group_rows, rows_arg, 1);
  check.dim(group_rows, rows_arg, 0, masked ? G : G + 1, masked ? "num_groups" : "num_groups + 1");
  check.contiguous(group_rows, rows_arg);

  // Memory layout: unit stride along K (x, w) and N (y); TMA-compatible outer strides; y writable.
  check.unit_inner_stride(x, "x");
  check.unit_inner_stride(w, "w");
  check.unit_inner_stride(y, "y");
  check_tma_layout(check, x, "x");
  check_tma_layout(check, w, "w");
  check_tma_layout(check, y, "y");
  check.no_self_overlap(y, "y");

  // Scales (fp8 only).
  Scaling scaling = Scaling::kNone;
  const TensorView* x_scale = nullptr;
  const TensorView* w_scale = nullptr;
  if (fp8) {
    x_scale = &scales->x_scale;
    w_scale = &scales->w_scale;
    check_scale_layout(check, *x_scale, "x_scale");
    check_scale_layout(check, *w_scale, "w_scale");
    const int64_t kb = K / kGroupedGemmBlock, nb = N / kGroupedGemmBlock;
    switch (scales->mode) {
      case ScaleMode::kPerTensor:
        scaling = Scaling::kPerTensor;
        if (x_scale->numel() != 1)
          check.fail("x_scale", "must have 1 element (kPerTensor: shape [1] or []), got shape " + x_scale->shape_str());
        if (w_scale->rank != 1 || w_scale->shape[0] != G)
          check.fail("w_scale",
                     "must have shape [G] = " + shape_str({G}) + " (kPerTensor), got " + w_scale->shape_str());
        break;
      case ScaleMode::kBlockwise:
        scaling = Scaling::kBlockwise;
        if (masked) check_scale_shape(check, *x_scale, "x_scale", "[G, max_m, K/128]", {G, rows, kb});
        else check_scale_shape(check, *x_scale, "x_scale", "[M, K/128]", {rows, kb});
        check_scale_shape(check, *w_scale, "w_scale", "[G, N/128, K/128]", {G, nb, kb});
        break;
      default:
        check.fail("scales.mode", "must be ScaleMode::kPerTensor or ScaleMode::kBlockwise, got " +
                                      str(static_cast<int>(scales->mode)));
    }
  }

  if (options.expected_m < 0)
    check.fail("options.expected_m", "must be >= 0 (it is ignored: tile shapes come from the group sizes), got " + str(options.expected_m));

  const std::size_t workspace_needed = grouped_gemm_workspace_bytes(G, N, K);
  if (workspace.bytes < workspace_needed)
    check.fail("workspace", "must have at least " + std::to_string(workspace_needed) +
                                " bytes (grouped_gemm_workspace_bytes), got " + std::to_string(workspace.bytes));
  if (workspace_needed > 0 && reinterpret_cast<std::uintptr_t>(workspace.data) % 16 != 0)
    check.fail("workspace", "must be 16-byte aligned");

  // The output overlaps no input.
  check.no_overlap(x, "x", y, "y");
  check.no_overlap(w, "w", y, "y");
  check.no_overlap(group_rows, rows_arg, y, "y");
  if (fp8) {
    check.no_overlap(*x_scale, "x_scale", y, "y");
    check.no_overlap(*w_scale, "w_scale", y, "y");
  }

  // Device checks last: everything above runs without a GPU.
  check.on_current_device(x, "x");
  check.on_current_device(w, "w");
  check.on_current_device(group_rows, rows_arg);
  check.on_current_device(y, "y");
  if (fp8) {
    check.on_current_device(*x_scale, "x_scale");
    check.on_current_device(*w_scale, "w_scale");
  }
  if (workspace_needed > 0) {
    const TensorView ws = ::tessera::detail::workspace_view(workspace, workspace_needed, w.device);
    check.on_current_device(ws, "workspace");
  }

  GroupedProblem p;
  p.operand = operand;
  p.layout = layout;
  p.scaling = scaling;
  p.num_groups = static_cast<int>(G);
  p.rows = rows;
  p.n = N;
  p.k = K;

  const int64_t rows_or_1 = std::max<int64_t>(rows, 1);
  p.x = x.data;
  p.w = w.data;
  p.y = y.data;
  if (masked) {
    p.x_row_stride = stride_or(x, 1, K);
    p.x_group_stride = stride_or(x, 0, rows_or_1 * p.x_row_stride);
    p.y_row_stride = stride_or(y, 1, N);
    p.y_group_stride = stride_or(y, 0, rows_or_1 * p.y_row_stride);
  } else {
    p.x_row_stride = stride_or(x, 0, K);
    p.y_row_stride = stride_or(y, 0, N);
  }
  p.w_row_stride = stride_or(w, 1, K);
  p.w_group_stride = stride_or(w, 0, N * p.w_row_stride);
  p.group_rows = static_cast<const int32_t*>(group_rows.data);

  if (fp8) {
    p.x_scale = static_cast<const float*>(x_scale->data);
    p.w_scale = static_cast<const float*>(w_scale->data);
    if (scaling == Scaling::kPerTensor) {
      p.ws_group_stride = w_scale->strides[0];
    } else if (masked) {
      p.xs_group_stride = x_scale->strides[0];
      p.xs_row_stride = x_scale->strides[1];
      p.xs_k_stride = x_scale->strides[2];
    } else {
      p.xs_row_stride = x_scale->strides[0];
      p.xs_k_stride = x_scale->strides[1];
    }
    if (scaling == Scaling::kBlockwise) {
      p.ws_group_stride = w_scale->strides[0];
      p.ws_n_stride = w_scale->strides[1];
      p.ws_k_stride = w_scale->strides[2];
    }
  }
  return p;
}

}  // namespace detail
}  // namespace tessera::gemm
