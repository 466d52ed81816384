// CPU float64 references of the int4 / int8-weight conv2d (issue 19; docs/perf/conv.md). The conv weight
// [Co, Kh, Kw, Ci / groups] is read as a weight-only linear weight (tessera::linear::QuantizedWeight) with N = Co rows
// over the reduction index r = (kh · Kw + kw) · Ci_g + ci, K = Kh · Kw · Ci_g: codes in (kh, kw, ci) order, blocks
// of scale + offset (or zero point) along r, values by the linear layer's rule (reference::dequantize_weight). Group
// g owns output channels [g · Co_g, (g + 1) · Co_g) and input channels [g · Ci_g, (g + 1) · Ci_g).
//
// Two independent computations of the same output, so that each checks the other: conv2d_reference goes through
// im2col (the implicit GEMM the kernel runs), conv2d_direct is the plain seven-loop convolution.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "tessera/linear.h"

namespace tessera::reference {

// Sizes of one conv2d. Input NHWC [n, h, w, ci]; output NHWC [n, out_h(), out_w(), co]; symmetric padding.
struct Conv2dParams {
  int64_t n = 1, h = 1, w = 1, ci = 1, co = 1, kh = 1, kw = 1;
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dil_h = 1, dil_w = 1, groups = 1;

  // PyTorch's / cuDNN's rule: the windows whose dilated extent dil · (k − 1) + 1 lies inside the padded input,
  // out = floor((in + 2 · pad − dil · (k − 1) − 1) / stride) + 1 (a floor, also for a negative numerator: such a
  // size is < 1 and rejected by check_conv2d_params).
  int64_t out_h() const;
  int64_t out_w() const;
  int64_t ci_per_group() const { return ci / groups; }
  int64_t co_per_group() const { return co / groups; }
  int64_t reduction() const { return kh * kw * (ci / groups); }  // K of the implicit GEMM
  int64_t pixels() const { return n * out_h() * out_w(); }       // its rows: one per output pixel
};

// floor((in + 2 · pad − dil · (k − 1) − 1) / stride) + 1, for any sign of the numerator; std::invalid_argument when
// stride < 1 (out_h() and out_w() too).
int64_t conv_output_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil);

// Throws std::invalid_argument naming the rule: every size, kernel extent, stride, dilation and the group count
// positive; padding >= 0; ci and co divisible by groups; an output of at least 1 × 1.
void check_conv2d_params(const Conv2dParams& p);

// Layout changes of a float tensor (the op takes NCHW by transforming it, docs/perf/conv.md). The sizes are given in
// the source layout's order; the result holds the same values, reordered. Throws std::invalid_argument when x does
// not hold n · c · h · w values.
std::vector<float> nchw_to_nhwc(const std::vector<float>& x, int64_t n, int64_t c, int64_t h, int64_t w);
std::vector<float> nhwc_to_nchw(const std::vector<float>& x, int64_t n, int64_t h, int64_t w, int64_t c);

// The implicit GEMM's operand, materialized: [P, groups, K] in float64 with P = n · out_h · out_w, row
// (n · Ho + oh) · Wo + ow (the kernel's pixel order, also the output's), and element (row, g, r) with
// r = (kh · Kw + kw) · Ci_g + ci equal to x[n, oh · stride_h − pad_h + kh · dil_h, ow · stride_w − pad_w + kw · dil_w,
// g · Ci_g + ci], or 0 where that position lies in the padding.
std::vector<double> im2col_nhwc(const std::vector<float>& x, const Conv2dParams& p);

// y [n, Ho, Wo, Co] = clamp(Σ_r im2col(x)[row, g, r] · w[co, r] + bias[co], clamp_min, clamp_max) with g = co / Co_g:
// the conv as the kernel computes it (one GEMM per group over the dequantized weight), in float64 and row blocks
// (the im2col rows are formed per block, never all at once). x: NHWC floats; w: N = co, K = p.reduction(), bits 4 or
// 8, any block dividing K, no k_perm (a conv weight has no act-order permutation); bias empty or co values.
// num_threads 0: one per hardware thread (fewer for small problems); the result does not depend on it.
// Throws std::invalid_argument on any inconsistency (message names the argument).
std::vector<double> conv2d_reference(const std::vector<float>& x, const Conv2dParams& p,
                                     const linear::QuantizedWeight& w, const std::vector<double>& bias = {},
                                     double clamp_min = -std::numeric_limits<double>::infinity(),
                                     double clamp_max = std::numeric_limits<double>::infinity(), int num_threads = 0);

// The same output by the direct definition (loops over n, oh, ow, co, kh, kw, ci, skipping padded taps), sharing
// nothing with conv2d_reference but the dequantized weight and the argument checks: the cross-check.
std::vector<double> conv2d_direct(const std::vector<float>& x, const Conv2dParams& p, const linear::QuantizedWeight& w,
                                  const std::vector<double>& bias = {},
                                  double clamp_min = -std::numeric_limits<double>::infinity(),
                                  double clamp_max = std::numeric_limits<double>::infinity(), int num_threads = 0);

}  // namespace tessera::reference
