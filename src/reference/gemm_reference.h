// CPU float64 reference of the grouped GEMM (tessera/grouped_gemm.h), and the check of a GPU output against it.
// Inputs are the exact bits the GPU reads (fp8 e4m3 bytes or bf16 bits, fp32 scales) in host copies of the device
// buffers, addressed with the same element strides; products and sums are exact-input float64.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/moe_checks.h"
#include "tessera/grouped_gemm.h"

namespace tessera::reference {

// Shape and element strides of x and w.
//   contiguous: x(row, k) = x[row * x_row_stride + k], rows global in [0, rows = M);
//   masked:     x(g, row, k) = x[g * x_group_stride + row * x_row_stride + k], row in [0, rows = max_m);
//   w(g, n, k) = w[g * w_group_stride + n * w_row_stride + k].
struct GroupedGemmShape {
  bool masked = false;
  int num_groups = 0;
  int64_t rows = 0;  // contiguous: M; masked: max_m
  int64_t n = 0;
  int64_t k = 0;
  int64_t x_row_stride = 0, x_group_stride = 0;
  int64_t w_row_stride = 0, w_group_stride = 0;
};

// fp8 scales, gemm::ScaleMode semantics, fp32 values with element strides:
//   kPerTensor: x_scale[0]; w_scale[g * ws_group_stride].
//   kBlockwise: x_scale[(masked ? g * xs_group_stride : 0) + row * xs_row_stride + kb * xs_k_stride];
//               w_scale[g * ws_group_stride + nb * ws_n_stride + kb * ws_k_stride], kb = k / 128, nb = n / 128.
struct GroupedGemmScales {
  gemm::ScaleMode mode = gemm::ScaleMode::kPerTensor;
  std::vector<float> x_scale;
  int64_t xs_row_stride = 0, xs_k_stride = 0, xs_group_stride = 0;
  std::vector<float> w_scale;
  int64_t ws_group_stride = 0, ws_n_stride = 0, ws_k_stride = 0;
};

// The rows of each group after the device's clamping: contiguous [clamp(offsets[g]), max(that, clamp(offsets[g+1])))
// with clamp to [0, M]; masked [0, clamp(masked_m[g], 0, max_m)). Ranges of different groups may overlap when
// offsets are not monotone; each then writes its own result and either may land.
struct GroupRows {
  std::vector<int64_t> begin, end;  // [G], rows local to the group for the masked layout
};
GroupRows clamp_group_rows(const std::vector<int32_t>& group_rows, const GroupedGemmShape& shape);

// Output rows are numbered as y's: contiguous row r is r; masked row r of group g is g * max_m + r.
struct GroupedGemmRef {
  GroupedGemmShape shape;
  GroupRows groups;
  // Group g's result for its rows: y[value_offset[g] + (r - groups.begin[g]) * n + col].
  std::vector<int64_t> value_offset;
  std::vector<double> y;
  // Same indexing: the element's sum of |scaled products|, Σ_kb |scale_kb| Σ_k |x w| (what accumulation errors
  // scale with).
  std::vector<double> mag;

  int64_t output_rows() const { return shape.masked ? shape.num_groups * shape.rows : shape.rows; }
  // The output row of group g's row r (local to the group for the masked layout, global otherwise).
  int64_t output_row(int g, int64_t r) const { return shape.masked ? g * shape.rows + r : r; }
  int64_t rows_written() const;  // sum of the group ranges (rows in overlapping ranges count once per group)
};

// group_rows: offsets [G+1] (contiguous) or masked_m [G]. num_threads 0: one per hardware thread (fewer for small
// problems). Results do not depend on the thread count.
GroupedGemmRef grouped_gemm_fp8(const std::vector<uint8_t>& x, const std::vector<uint8_t>& w,
                                const std::vector<int32_t>& group_rows, const GroupedGemmScales& scales,
                                const GroupedGemmShape& shape, int num_threads = 0);
GroupedGemmRef grouped_gemm_bf16(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w,
                                 const std::vector<int32_t>& group_rows, const GroupedGemmShape& shape,
                                 int num_threads = 0);

// Tolerances: relative Frobenius error over the written elements <= frobenius, and every written element
// |y - ref| <= acc * mag + rel * |ref|, where mag is the element's sum of |scaled products| (see
// GroupedGemmRef::mag): it scales with the element's own inputs and scales, so small groups and rows are held to
// the same relative bound as large ones.
//   acc: the tensor cores' accumulation. fp8 wgmma adds a k-block's products with a reduced-precision
//        accumulator (DeepSeek-V3 report: about 14 bits kept); tests/gpu/test_ptx.cu measures up to 2^-10.4 of
//        the magnitude over one 128-wide k-block of random e4m3 bytes on an H200, and the grid tests have seen
//        2^-7.4 over two k-blocks (K = 256). 2^-6 of the magnitude; bf16 (fp32 accumulation) is far inside.
//   rel: the bf16 output rounding (2^-8 relative at most), twice.
struct GemmTolerance {
  double frobenius = 1e-2;
  double acc = 0x1p-6;
  double rel = 0x1p-7;
};

struct GroupedGemmCheck : CheckResult {  // error = relative Frobenius error; compared = written elements
  double max_abs_error = 0.0;
  double ref_rms = 0.0;          // over all written elements (for the summary)
  int64_t nan_count = 0;         // written elements that are not finite where the reference is
  int64_t out_of_bound = 0;      // finite written elements past the elementwise bound
  int64_t poison_touched = 0;    // elements no group writes that no longer hold the poison
};

// y: host copy of the whole bf16 output buffer (bits). Output row r (numbered as in GroupedGemmRef) column c is at
// contiguous r * y_row_stride + c; masked (g, r) at g * y_group_stride + r * y_row_stride + c. Every element of
// the buffer that no group writes (rows outside the groups, rows past masked_m, padding between rows or groups)
// must still hold `poison`. An element in the rows of several groups (non-monotone offsets) may match any of them.
GroupedGemmCheck check_grouped_gemm(const GroupedGemmRef& ref, const std::vector<uint16_t>& y, int64_t y_row_stride,
                                    int64_t y_group_stride, uint16_t poison, const GemmTolerance& tol = {});

}  // namespace tessera::reference
