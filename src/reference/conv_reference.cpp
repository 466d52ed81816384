#include "reference/conv_reference.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "reference/linear_reference.h"
#include "reference/parallel.h"

namespace tessera::reference {
namespace {

using detail::num_workers;
using detail::parallel;

// Output rows per unit of work: enough to amortize a thread's setup, few enough that the im2col block of a row
// block stays in cache (32 rows · K doubles: 590 KB at K = 2304).
constexpr int64_t kRowBlock = 32;

[[noreturn]] void fail(const std::string& fn, const std::string& what) {
  throw std::invalid_argument(fn + ": " + what);
}

std::string str(int64_t v) { return std::to_string(v); }

void check_operands(const std::string& fn, const std::vector<float>& x, const Conv2dParams& p,
                    const linear::QuantizedWeight& w, const std::vector<double>& bias, double clamp_min,
                    double clamp_max) {
  check_conv2d_params(p);
  const int64_t x_elems = p.n * p.h * p.w * p.ci;
  if (x.size() != static_cast<std::size_t>(x_elems))
    fail(fn, "'x' must hold n·h·w·ci = " + str(x_elems) + " values (NHWC), got " + str(x.size()));
  const int64_t k = p.reduction();
  if (w.n != p.co || w.k != k)
    fail(fn, "'w' must be [co, kh·kw·ci/groups] = [" + str(p.co) + ", " + str(k) + "], got [" + str(w.n) + ", " +
                 str(w.k) + "]");
  if (w.bits != 4 && w.bits != 8) fail(fn, "'w.bits' must be 4 or 8, got " + str(w.bits));
  if (w.block <= 0 || k % w.block != 0) fail(fn, "'w.block' must divide K = " + str(k) + ", got " + str(w.block));
  if (!w.k_perm.empty()) fail(fn, "'w.k_perm' must be empty: a conv weight's reduction order is fixed as (kh, kw, ci)");
  if (w.codes.size() != static_cast<std::size_t>(w.n * k))
    fail(fn, "'w.codes' must hold co·K = " + str(w.n * k) + " codes, got " + str(w.codes.size()));
  const int levels = (1 << w.bits) - 1;
  for (std::size_t i = 0; i < w.codes.size(); ++i)
    if (w.codes[i] > levels)
      fail(fn, "'w.codes'[" + str(static_cast<int64_t>(i)) + "] = " + str(w.codes[i]) + " exceeds " + str(levels) +
                   " (" + str(w.bits) + "-bit codes)");
  const std::size_t params = static_cast<std::size_t>(w.n * (k / w.block));
  if (w.scale.size() != params) fail(fn, "'w.scale' must hold co·K/block = " + str(params) + " values");
  // The values come from offset in both modes (in kZeroPoint mode it holds −zero · scale), as in the linear layer.
  if (w.offset.size() != params)
    fail(fn, "'w.offset' must hold co·K/block = " + str(params) + " values (−zero·scale in kZeroPoint mode)");
  if (w.zero_mode == linear::ZeroMode::kZeroPoint && w.zero.size() != params)
    fail(fn, "'w.zero' must hold co·K/block = " + str(params) + " values in kZeroPoint mode");
  if (!bias.empty() && bias.size() != static_cast<std::size_t>(p.co))
    fail(fn, "'bias' must be empty or hold co = " + str(p.co) + " values, got " + str(bias.size()));
  if (!(clamp_min <= clamp_max)) fail(fn, "'clamp_min' must be <= 'clamp_max' (and neither NaN)");
}

// Bias, then the clamp; a NaN sum stays NaN.
double finish(double acc, const std::vector<double>& bias, int64_t co, double clamp_min, double clamp_max) {
  double v = bias.empty() ? acc : acc + bias[co];
  if (v < clamp_min) v = clamp_min;
  if (v > clamp_max) v = clamp_max;
  return v;
}

// Rows [row0, row1) of the im2col matrix into out, [row1 − row0][groups][K].
void im2col_rows(const float* x, const Conv2dParams& p, int64_t row0, int64_t row1, double* out) {
  const int64_t ho = p.out_h(), wo = p.out_w(), cig = p.ci_per_group(), k = p.reduction();
  for (int64_t row = row0; row < row1; ++row) {
    const int64_t ow = row % wo, oh = (row / wo) % ho, n = row / (wo * ho);
    for (int64_t g = 0; g < p.groups; ++g) {
      double* dst = out + ((row - row0) * p.groups + g) * k;
      for (int64_t i = 0; i < p.kh; ++i) {
        const int64_t ih = oh * p.stride_h - p.pad_h + i * p.dil_h;
        for (int64_t j = 0; j < p.kw; ++j, dst += cig) {
          const int64_t iw = ow * p.stride_w - p.pad_w + j * p.dil_w;
          if (ih < 0 || ih >= p.h || iw < 0 || iw >= p.w) {
            std::fill(dst, dst + cig, 0.0);
            continue;
          }
          const float* src = x + ((n * p.h + ih) * p.w + iw) * p.ci + g * cig;
          for (int64_t c = 0; c < cig; ++c) dst[c] = src[c];
        }
      }
    }
  }
}

}  // namespace

int64_t conv_output_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil) {
  if (stride < 1) fail("conv_output_size", "stride must be >= 1, got " + str(stride));
  const int64_t num = in + 2 * pad - dil * (k - 1) - 1;
  // C++ division truncates toward zero; the formula floors (stride 2, numerator −1: out 0, not 1).
  const int64_t q = num >= 0 ? num / stride : -((-num + stride - 1) / stride);
  return q + 1;
}

int64_t Conv2dParams::out_h() const { return conv_output_size(h, kh, stride_h, pad_h, dil_h); }
int64_t Conv2dParams::out_w() const { return conv_output_size(w, kw, stride_w, pad_w, dil_w); }

void check_conv2d_params(const Conv2dParams& p) {
  const std::string fn = "conv2d";
  const struct {
    const char* name;
    int64_t value;
  } positive[] = {{"n", p.n},
                  {"h", p.h},
                  {"w", p.w},
                  {"ci", p.ci},
                  {"co", p.co},
                  {"kh", p.kh},
                  {"kw", p.kw},
                  {"stride_h", p.stride_h},
                  {"stride_w", p.stride_w},
                  {"dil_h", p.dil_h},
                  {"dil_w", p.dil_w},
                  {"groups", p.groups}};
  for (const auto& f : positive)
    if (f.value < 1) fail(fn, "'" + std::string(f.name) + "' must be >= 1, got " + str(f.value));
  if (p.pad_h < 0 || p.pad_w < 0)
    fail(fn, "padding must be >= 0, got pad_h " + str(p.pad_h) + ", pad_w " + str(p.pad_w));
  if (p.ci % p.groups != 0) fail(fn, "'ci' (" + str(p.ci) + ") must be divisible by 'groups' (" + str(p.groups) + ")");
  if (p.co % p.groups != 0) fail(fn, "'co' (" + str(p.co) + ") must be divisible by 'groups' (" + str(p.groups) + ")");
  const int64_t ho = p.out_h(), wo = p.out_w();
  if (ho < 1 || wo < 1)
    fail(fn, "the output would be " + str(ho) + " × " + str(wo) + ": the dilated kernel (" +
                 str(p.dil_h * (p.kh - 1) + 1) + " × " + str(p.dil_w * (p.kw - 1) + 1) +
                 ") must fit in the padded input (" + str(p.h + 2 * p.pad_h) + " × " + str(p.w + 2 * p.pad_w) + ")");
}

std::vector<float> nchw_to_nhwc(const std::vector<float>& x, int64_t n, int64_t c, int64_t h, int64_t w) {
  if (n < 0 || c < 0 || h < 0 || w < 0 || x.size() != static_cast<std::size_t>(n * c * h * w))
    fail("nchw_to_nhwc", "'x' must hold n·c·h·w values (sizes >= 0), got " + str(x.size()));
  std::vector<float> y(x.size());
  for (int64_t b = 0; b < n; ++b)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t i = 0; i < h; ++i)
        for (int64_t j = 0; j < w; ++j) y[((b * h + i) * w + j) * c + ch] = x[((b * c + ch) * h + i) * w + j];
  return y;
}

std::vector<float> nhwc_to_nchw(const std::vector<float>& x, int64_t n, int64_t h, int64_t w, int64_t c) {
  if (n < 0 || c < 0 || h < 0 || w < 0 || x.size() != static_cast<std::size_t>(n * c * h * w))
    fail("nhwc_to_nchw", "'x' must hold n·h·w·c values (sizes >= 0), got " + str(x.size()));
  std::vector<float> y(x.size());
  for (int64_t b = 0; b < n; ++b)
    for (int64_t i = 0; i < h; ++i)
      for (int64_t j = 0; j < w; ++j)
        for (int64_t ch = 0; ch < c; ++ch) y[((b * c + ch) * h + i) * w + j] = x[((b * h + i) * w + j) * c + ch];
  return y;
}

std::vector<double> im2col_nhwc(const std::vector<float>& x, const Conv2dParams& p) {
  check_conv2d_params(p);
  if (x.size() != static_cast<std::size_t>(p.n * p.h * p.w * p.ci))
    fail("im2col_nhwc", "'x' must hold n·h·w·ci = " + str(p.n * p.h * p.w * p.ci) + " values, got " + str(x.size()));
  const int64_t rows = p.pixels(), width = p.groups * p.reduction();
  std::vector<double> out(static_cast<std::size_t>(rows * width));
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int threads = num_workers(0, static_cast<double>(rows * width), blocks);
  parallel(threads, [&](int t) {
    for (int64_t b = blocks * t / threads; b < blocks * (t + 1) / threads; ++b) {
      const int64_t r0 = b * kRowBlock;
      im2col_rows(x.data(), p, r0, std::min(rows, r0 + kRowBlock), out.data() + r0 * width);
    }
  });
  return out;
}

std::vector<double> conv2d_reference(const std::vector<float>& x, const Conv2dParams& p,
                                     const linear::QuantizedWeight& w, const std::vector<double>& bias,
                                     double clamp_min, double clamp_max, int num_threads) {
  check_operands("conv2d_reference", x, p, w, bias, clamp_min, clamp_max);
  const std::vector<double> wd = dequantize_weight(w);  // [co][K]
  const int64_t rows = p.pixels(), k = p.reduction(), cog = p.co_per_group();
  std::vector<double> y(static_cast<std::size_t>(rows * p.co));
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int threads = num_workers(num_threads, static_cast<double>(rows * p.co * k), blocks);
  parallel(threads, [&](int t) {
    std::vector<double> col(static_cast<std::size_t>(kRowBlock * p.groups * k));
    for (int64_t b = blocks * t / threads; b < blocks * (t + 1) / threads; ++b) {
      const int64_t r0 = b * kRowBlock, r1 = std::min(rows, r0 + kRowBlock);
      im2col_rows(x.data(), p, r0, r1, col.data());
      for (int64_t row = r0; row < r1; ++row)
        for (int64_t co = 0; co < p.co; ++co) {
          const double* a = &col[((row - r0) * p.groups + co / cog) * k];
          const double* wr = &wd[co * k];
          double acc = 0.0;
          for (int64_t r = 0; r < k; ++r) acc += a[r] * wr[r];
          y[row * p.co + co] = finish(acc, bias, co, clamp_min, clamp_max);
        }
    }
  });
  return y;
}

std::vector<double> conv2d_direct(const std::vector<float>& x, const Conv2dParams& p, const linear::QuantizedWeight& w,
                                  const std::vector<double>& bias, double clamp_min, double clamp_max,
                                  int num_threads) {
  check_operands("conv2d_direct", x, p, w, bias, clamp_min, clamp_max);
  const std::vector<double> wd = dequantize_weight(w);
  const int64_t ho = p.out_h(), wo = p.out_w(), k = p.reduction(), cig = p.ci_per_group(), cog = p.co_per_group();
  std::vector<double> y(static_cast<std::size_t>(p.n * ho * wo * p.co));
  const int64_t items = p.n * ho;  // one output row of one image each
  const int threads = num_workers(num_threads, static_cast<double>(items * wo * p.co * k), items);
  parallel(threads, [&](int t) {
    for (int64_t item = items * t / threads; item < items * (t + 1) / threads; ++item) {
      const int64_t n = item / ho, oh = item % ho;
      for (int64_t ow = 0; ow < wo; ++ow)
        for (int64_t co = 0; co < p.co; ++co) {
          const int64_t g = co / cog;
          double acc = 0.0;
          for (int64_t i = 0; i < p.kh; ++i) {
            const int64_t ih = oh * p.stride_h - p.pad_h + i * p.dil_h;
            if (ih < 0 || ih >= p.h) continue;
            for (int64_t j = 0; j < p.kw; ++j) {
              const int64_t iw = ow * p.stride_w - p.pad_w + j * p.dil_w;
              if (iw < 0 || iw >= p.w) continue;
              const float* xs = &x[((n * p.h + ih) * p.w + iw) * p.ci + g * cig];
              const double* ws = &wd[co * k + (i * p.kw + j) * cig];
              for (int64_t c = 0; c < cig; ++c) acc += static_cast<double>(xs[c]) * ws[c];
            }
          }
          y[((n * ho + oh) * wo + ow) * p.co + co] = finish(acc, bias, co, clamp_min, clamp_max);
        }
    }
  });
  return y;
}

}  // namespace tessera::reference
