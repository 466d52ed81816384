// The conv2d references (issue 19; docs/perf/conv.md): the im2col form (what the implicit-GEMM kernel computes) and
// the direct seven-loop convolution must agree over a grid of geometries, groups, weight formats, bias and clamp; a
// 1×1 conv must be the linear layer on the NHWC rows; a grouped conv must be its groups' independent convs; the
// weight's reduction order must be (kh, kw, ci) (checked against the test's own float convolution); a few tiny cases
// hold hand-computed numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/gpu_util.h"
#include "reference/conv_reference.h"
#include "reference/linear_reference.h"
#include "tessera/linear.h"

namespace tessera::reference {
namespace {

using linear::QuantizedWeight;
using linear::ZeroMode;

std::vector<float> normal_values(std::mt19937_64& rng, int64_t count) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(static_cast<std::size_t>(count));
  for (float& e : v) e = normal(rng);
  return v;
}

std::string describe(const Conv2dParams& p) {
  return "n " + std::to_string(p.n) + " h×w " + std::to_string(p.h) + "×" + std::to_string(p.w) + " ci " +
         std::to_string(p.ci) + " co " + std::to_string(p.co) + " k " + std::to_string(p.kh) + "×" +
         std::to_string(p.kw) + " stride " + std::to_string(p.stride_h) + "," + std::to_string(p.stride_w) + " pad " +
         std::to_string(p.pad_h) + "," + std::to_string(p.pad_w) + " dil " + std::to_string(p.dil_h) + "," +
         std::to_string(p.dil_w) + " groups " + std::to_string(p.groups);
}

// A weight written out by hand in the kOffset form (w = code · scale + offset), one parameter pair per block.
QuantizedWeight offset_weight(int64_t n, int64_t k, int bits, int64_t block, std::vector<uint8_t> codes,
                              std::vector<float> scale, std::vector<float> offset) {
  QuantizedWeight w;
  w.n = n;
  w.k = k;
  w.bits = bits;
  w.block = block;
  w.zero_mode = ZeroMode::kOffset;
  w.codes = std::move(codes);
  w.scale = std::move(scale);
  w.offset = std::move(offset);
  return w;
}

// The same in the kZeroPoint form (w = (code − zero) · scale), with offset = −zero · scale as the canonical form keeps.
QuantizedWeight zero_point_weight(int64_t n, int64_t k, int bits, int64_t block, std::vector<uint8_t> codes,
                                  std::vector<float> scale, std::vector<uint8_t> zero) {
  QuantizedWeight w = offset_weight(n, k, bits, block, std::move(codes), scale, {});
  w.zero_mode = ZeroMode::kZeroPoint;
  w.zero = std::move(zero);
  for (std::size_t i = 0; i < w.scale.size(); ++i) w.offset.push_back(-static_cast<float>(w.zero[i]) * w.scale[i]);
  return w;
}

// Rows [row0, row0 + rows) of a weight (a group's output channels), with their codes and block parameters.
QuantizedWeight weight_rows(const QuantizedWeight& w, int64_t row0, int64_t rows) {
  const int64_t blocks = w.k / w.block;
  QuantizedWeight s = w;
  s.n = rows;
  s.codes.assign(w.codes.begin() + row0 * w.k, w.codes.begin() + (row0 + rows) * w.k);
  s.scale.assign(w.scale.begin() + row0 * blocks, w.scale.begin() + (row0 + rows) * blocks);
  s.offset.assign(w.offset.begin() + row0 * blocks, w.offset.begin() + (row0 + rows) * blocks);
  if (!w.zero.empty()) s.zero.assign(w.zero.begin() + row0 * blocks, w.zero.begin() + (row0 + rows) * blocks);
  return s;
}

// Element by element |got − want| <= tol · (|want| + rms(want)): relative, without failing on outputs that cancel to
// near 0. The first few mismatches are named.
void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double sq = 0;
  for (double v : want) sq += v * v;
  const double rms = want.empty() ? 0.0 : std::sqrt(sq / static_cast<double>(want.size()));
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(want[i]);
    if (!both_nan && !(std::fabs(got[i] - want[i]) <= tol * (std::fabs(want[i]) + rms)) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", expected " << want[i];
  }
  EXPECT_EQ(bad, 0) << what;
}

// Expects fn to throw std::invalid_argument whose message contains `needle`.
void expect_invalid(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning \"" << needle << "\"";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" does not mention \"" << needle << "\"";
  }
}

TEST(ConvReference, OutputSizeFollowsTheFormula) {
  struct Case {
    int64_t in, k, stride, pad, dil, out;
  };
  // Worked out by hand from floor((in + 2·pad − dil·(k − 1) − 1) / stride) + 1.
  const Case cases[] = {{5, 3, 1, 0, 1, 3},    {5, 3, 1, 1, 1, 5},   {5, 3, 2, 1, 1, 3},   {6, 3, 2, 0, 1, 2},
                        {112, 3, 2, 1, 1, 56}, {56, 3, 1, 1, 1, 56}, {14, 1, 1, 0, 1, 14}, {7, 3, 1, 0, 3, 1},
                        {9, 3, 1, 2, 2, 9},    {1, 1, 3, 0, 1, 1},   {4, 5, 1, 0, 1, 0},   {1, 3, 2, 0, 1, 0},
                        {2, 3, 2, 0, 1, 0},    {1, 3, 1, 1, 1, 1},   {10, 4, 3, 2, 2, 3},  {224, 7, 2, 3, 1, 112}};
  for (const Case& c : cases)
    EXPECT_EQ(conv_output_size(c.in, c.k, c.stride, c.pad, c.dil), c.out)
        << "in " << c.in << " k " << c.k << " stride " << c.stride << " pad " << c.pad << " dil " << c.dil;
  // Against a count of the window positions o >= 0 whose dilated extent lies inside the padded input.
  for (int64_t in = 1; in <= 12; ++in)
    for (int64_t k = 1; k <= 5; ++k)
      for (int64_t stride = 1; stride <= 4; ++stride)
        for (int64_t pad = 0; pad <= 3; ++pad)
          for (int64_t dil = 1; dil <= 3; ++dil) {
            int64_t count = 0;
            while (count * stride + dil * (k - 1) <= in + 2 * pad - 1) ++count;
            EXPECT_EQ(std::max<int64_t>(conv_output_size(in, k, stride, pad, dil), 0), count)
                << "in " << in << " k " << k << " stride " << stride << " pad " << pad << " dil " << dil;
          }
  const Conv2dParams p{2, 7, 10, 4, 4, 3, 4, 2, 3, 1, 2, 1, 2, 1};
  EXPECT_EQ(p.out_h(), 4);  // floor((7 + 2 − 2 − 1) / 2) + 1
  EXPECT_EQ(p.out_w(), 3);  // floor((10 + 4 − 6 − 1) / 3) + 1
  EXPECT_EQ(p.reduction(), 3 * 4 * 4);
  EXPECT_EQ(p.pixels(), 2 * 4 * 3);
}

TEST(ConvReference, HandComputedCases) {
  using Fn = std::vector<double> (*)(const std::vector<float>&, const Conv2dParams&, const QuantizedWeight&,
                                     const std::vector<double>&, double, double, int);
  const double inf = std::numeric_limits<double>::infinity();
  for (Fn fn : {&conv2d_reference, &conv2d_direct}) {
    SCOPED_TRACE(fn == &conv2d_reference ? "conv2d_reference" : "conv2d_direct");
    const std::vector<float> x9 = {1, 2, 3, 4, 5, 6, 7, 8, 9};  // a 3×3 image, one channel
    {
      // 2×2 kernel w = {1, 0, −1, 2} (int8 codes 3, 2, 1, 4; scale 1, offset −2), no padding: a 2×2 output.
      const Conv2dParams p{1, 3, 3, 1, 1, 2, 2, 1, 1, 0, 0, 1, 1, 1};
      const QuantizedWeight w = offset_weight(1, 4, 8, 4, {3, 2, 1, 4}, {1.f}, {-2.f});
      EXPECT_EQ(fn(x9, p, w, {}, -inf, inf, 0), (std::vector<double>{7, 9, 13, 15}));
    }
    {
      // 3×3 box filter (int4 codes 1, scale 1), padding 1, stride 2: the sums of the four 2×2 corners.
      const Conv2dParams p{1, 3, 3, 1, 1, 3, 3, 2, 2, 1, 1, 1, 1, 1};
      const QuantizedWeight w = offset_weight(1, 9, 4, 9, std::vector<uint8_t>(9, 1), {1.f}, {0.f});
      EXPECT_EQ(fn(x9, p, w, {}, -inf, inf, 0), (std::vector<double>{12, 16, 24, 28}));
    }
    {
      // 2×2 kernel w = {1, 2, 3, 4} dilated by 2 over x[i][j] = 10 i + j (5×5): y[a][b] = 100 a + 10 b + 152.
      std::vector<float> x(25);
      for (int i = 0; i < 5; ++i)
        for (int j = 0; j < 5; ++j) x[i * 5 + j] = static_cast<float>(10 * i + j);
      const Conv2dParams p{1, 5, 5, 1, 1, 2, 2, 1, 1, 0, 0, 2, 2, 1};
      const QuantizedWeight w = offset_weight(1, 4, 8, 4, {1, 2, 3, 4}, {1.f}, {0.f});
      EXPECT_EQ(fn(x, p, w, {}, -inf, inf, 0), (std::vector<double>{152, 162, 172, 252, 262, 272, 352, 362, 372}));
    }
    {
      // Two groups of a 1×1 conv on one pixel (x = 1, 2 | 3, 4): w0 = {1, −1}, w1 = {2, 0.5}: y = {−1, 8}; bias
      // {0.5, −10} gives {−0.5, −2}; the clamp [−1, 5] then {−0.5, −1}; the clamp alone {−1, 5}.
      const Conv2dParams p{1, 1, 1, 4, 2, 1, 1, 1, 1, 0, 0, 1, 1, 2};
      const QuantizedWeight w = offset_weight(2, 2, 4, 2, {3, 1, 4, 1}, {1.f, 0.5f}, {-2.f, 0.f});
      const std::vector<float> x = {1, 2, 3, 4};
      EXPECT_EQ(fn(x, p, w, {}, -inf, inf, 0), (std::vector<double>{-1, 8}));
      EXPECT_EQ(fn(x, p, w, {0.5, -10}, -inf, inf, 0), (std::vector<double>{-0.5, -2}));
      EXPECT_EQ(fn(x, p, w, {0.5, -10}, -1, 5, 0), (std::vector<double>{-0.5, -1}));
      EXPECT_EQ(fn(x, p, w, {}, -1, 5, 0), (std::vector<double>{-1, 5}));
    }
    {
      // The reduction order (kh, kw, ci): a 1×2 kernel over two channels, r = kw · 2 + ci, against the pixels
      // (1, 2) and (3, 4). int4 zero point 8, blocks of two with scales 0.25 and 0.5: codes 9, 7, 8, 10 are
      // w = {0.25, −0.25, 0, 1}, so y = 0.25 − 0.5 + 0 + 4 = 3.75.
      const Conv2dParams p{1, 1, 2, 2, 1, 1, 2, 1, 1, 0, 0, 1, 1, 1};
      const QuantizedWeight w = zero_point_weight(1, 4, 4, 2, {9, 7, 8, 10}, {0.25f, 0.5f}, {8, 8});
      EXPECT_EQ(fn({1, 2, 3, 4}, p, w, {}, -inf, inf, 0), (std::vector<double>{3.75}));
    }
  }
}

TEST(ConvReference, Im2colRowOrderAndPadding) {
  // x 2×2 (1, 2 / 3, 4), 2×2 kernel, padding 1: a 3×3 output, row (oh, ow) = (x[oh−1][ow−1], x[oh−1][ow],
  // x[oh][ow−1], x[oh][ow]) with 0 outside.
  const Conv2dParams p{1, 2, 2, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1};
  const std::vector<double> col = im2col_nhwc({1, 2, 3, 4}, p);
  const std::vector<double> want = {0, 0, 0, 1, 0, 0, 1, 2, 0, 0, 2, 0, 0, 1, 0, 3, 1, 2,
                                    3, 4, 2, 0, 4, 0, 0, 3, 0, 0, 3, 4, 0, 0, 4, 0, 0, 0};
  EXPECT_EQ(col, want);
  // Groups are the middle index: [P, groups, K]. Two pixels of four channels, a 1×2 kernel, two groups: group 0
  // takes channels 0-1 of both pixels, group 1 channels 2-3.
  const Conv2dParams q{1, 1, 2, 4, 2, 1, 2, 1, 1, 0, 0, 1, 1, 2};
  EXPECT_EQ(im2col_nhwc({1, 2, 3, 4, 5, 6, 7, 8}, q), (std::vector<double>{1, 2, 5, 6, 3, 4, 7, 8}));
  // Row order over images: the second image's rows follow the first's.
  const Conv2dParams r{2, 1, 2, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1};
  EXPECT_EQ(im2col_nhwc({1, 2, 3, 4}, r), (std::vector<double>{1, 2, 3, 4}));
}

TEST(ConvReference, DirectAndIm2colAgreeOverAGrid) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  struct Hw {
    int64_t h, w;
  };
  struct Geometry {
    int64_t stride_h, stride_w, pad_h, pad_w, dil_h, dil_w;
  };
  struct Channels {
    int64_t ci, co, groups;
  };
  const Hw spatial[] = {{1, 1}, {3, 5}, {7, 7}, {13, 9}, {6, 8}};
  const Hw kernels[] = {{1, 1}, {3, 3}, {1, 3}, {5, 3}, {2, 2}};
  const Geometry geometries[] = {{1, 1, 0, 0, 1, 1}, {1, 1, 1, 1, 1, 1}, {2, 2, 1, 1, 1, 1}, {1, 2, 2, 0, 1, 1},
                                 {3, 1, 1, 2, 2, 1}, {2, 2, 0, 0, 2, 2}, {1, 1, 3, 3, 3, 2}};
  // Plain, K a multiple of 32 (several blocks), two groups, depthwise, three groups with two outputs per input.
  const Channels channels[] = {{3, 5, 1}, {32, 3, 1}, {8, 4, 2}, {6, 6, 6}, {12, 9, 3}};
  int64_t cases = 0, index = 0;
  for (const Hw& s : spatial)
    for (const Hw& k : kernels)
      for (const Geometry& g : geometries)
        for (const Channels& c : channels) {
          const Conv2dParams p{2,          s.h,        s.w,     c.ci,    c.co,    k.h,     k.w,
                               g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dil_h, g.dil_w, c.groups};
          if (p.out_h() < 1 || p.out_w() < 1) continue;
          const int64_t idx = index++;
          const int bits = idx % 4 < 2 ? 4 : 8;
          const ZeroMode mode = idx % 2 == 0 ? ZeroMode::kOffset : ZeroMode::kZeroPoint;
          const int64_t kr = p.reduction();
          // Blocks of 32 where they divide K (alternating with one block per output channel), else per channel.
          const int64_t block = kr % 32 == 0 && idx % 3 != 0 ? 32 : kr;
          const std::vector<float> wf = normal_values(rng, p.co * kr);
          const QuantizedWeight w = linear::quantize_weight(wf.data(), p.co, kr, bits, block, mode);
          const std::vector<float> x = normal_values(rng, p.n * p.h * p.w * p.ci);
          std::vector<double> bias;
          double lo = -std::numeric_limits<double>::infinity(), hi = std::numeric_limits<double>::infinity();
          if (idx % 3 != 0) {
            for (int64_t o = 0; o < p.co; ++o) bias.push_back(0.25 * static_cast<double>(o) - 0.5);
          }
          if (idx % 3 == 2) lo = -0.5, hi = 0.75;  // clamps a good share of outputs at both ends
          const std::string what =
              describe(p) + " int" + std::to_string(bits) + (mode == ZeroMode::kOffset ? " offset" : " zero point") +
              " block " + std::to_string(block) + (bias.empty() ? "" : " bias") + (idx % 3 == 2 ? " clamp" : "");
          const std::vector<double> ref = conv2d_reference(x, p, w, bias, lo, hi);
          const std::vector<double> direct = conv2d_direct(x, p, w, bias, lo, hi);
          ASSERT_EQ(ref.size(), static_cast<std::size_t>(p.n * p.out_h() * p.out_w() * p.co)) << what;
          expect_close(ref, direct, 1e-12, what);
          if (HasFailure()) return;
          ++cases;
        }
  EXPECT_EQ(cases, 745);  // the combinations with an output of at least 1 × 1, all run
}

TEST(ConvReference, OneByOneIsTheLinearLayer) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t n = 2, h = 5, w = 7, ci = 96, co = 10;
  const std::vector<float> x = normal_values(rng, n * h * w * ci);
  const std::vector<float> wf = normal_values(rng, co * ci);
  for (int bits : {4, 8})
    for (ZeroMode mode : {ZeroMode::kOffset, ZeroMode::kZeroPoint}) {
      SCOPED_TRACE("int" + std::to_string(bits) + (mode == ZeroMode::kOffset ? " offset" : " zero point"));
      const QuantizedWeight q = linear::quantize_weight(wf.data(), co, ci, bits, 32, mode);
      // Stride 1: the NHWC input is the linear layer's x [n·h·w, ci] as it lies in memory.
      const Conv2dParams p{n, h, w, ci, co, 1, 1, 1, 1, 0, 0, 1, 1, 1};
      const std::vector<double> rows(x.begin(), x.end());
      expect_close(conv2d_reference(x, p, q), linear_reference(rows, n * h * w, q), 1e-12, "1×1 stride 1");
      // Stride 2: the linear layer over the even pixels, in the output's row order.
      const Conv2dParams s{n, h, w, ci, co, 1, 1, 2, 2, 0, 0, 1, 1, 1};
      std::vector<double> sub;
      for (int64_t b = 0; b < n; ++b)
        for (int64_t i = 0; i < h; i += 2)
          for (int64_t j = 0; j < w; j += 2)
            for (int64_t c = 0; c < ci; ++c) sub.push_back(x[((b * h + i) * w + j) * ci + c]);
      ASSERT_EQ(s.pixels(), n * 3 * 4);
      expect_close(conv2d_reference(x, s, q), linear_reference(sub, s.pixels(), q), 1e-12, "1×1 stride 2");
      // Padding 1: the border pixels see only padding, so they hold the clamped bias; the interior is the linear layer.
      const Conv2dParams pad{n, h, w, ci, co, 1, 1, 1, 1, 1, 1, 1, 1, 1};
      std::vector<double> bias;
      for (int64_t o = 0; o < co; ++o) bias.push_back(static_cast<double>(o) - 4.5);
      const std::vector<double> y = conv2d_reference(x, pad, q, bias, -3.0, 3.0);
      const std::vector<double> lin = linear_reference(rows, n * h * w, q);
      for (int64_t b = 0; b < n; ++b)
        for (int64_t i = 0; i < h + 2; ++i)
          for (int64_t j = 0; j < w + 2; ++j)
            for (int64_t o = 0; o < co; ++o) {
              const bool border = i == 0 || j == 0 || i == h + 1 || j == w + 1;
              const double inner = border ? 0.0 : lin[((b * h + i - 1) * w + j - 1) * co + o];
              const double want = std::min(3.0, std::max(-3.0, inner + bias[o]));
              const double got = y[((b * (h + 2) + i) * (w + 2) + j) * co + o];
              ASSERT_NEAR(got, want, 1e-12 * (1.0 + std::fabs(want))) << "pixel " << b << "," << i << "," << j;
            }
    }
}

TEST(ConvReference, GroupsAreIndependentConvs) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  struct Channels {
    int64_t ci, co, groups;
  };
  // Two and three groups, depthwise, and depthwise with two outputs per channel.
  for (const Channels& c : {Channels{8, 6, 2}, Channels{9, 6, 3}, Channels{5, 5, 5}, Channels{4, 8, 4}}) {
    const Conv2dParams p{2, 5, 7, c.ci, c.co, 3, 3, 1, 2, 1, 1, 1, 1, c.groups};
    SCOPED_TRACE(describe(p));
    const int64_t cig = p.ci_per_group(), cog = p.co_per_group(), kr = p.reduction();
    const std::vector<float> x = normal_values(rng, p.n * p.h * p.w * p.ci);
    const std::vector<float> wf = normal_values(rng, p.co * kr);
    const QuantizedWeight w = linear::quantize_weight(wf.data(), p.co, kr, 4, kr, ZeroMode::kZeroPoint);
    std::vector<double> bias;
    for (int64_t o = 0; o < p.co; ++o) bias.push_back(0.1 * static_cast<double>(o));
    const std::vector<double> full = conv2d_reference(x, p, w, bias);
    const int64_t pixels = p.pixels();
    for (int64_t g = 0; g < p.groups; ++g) {
      // The group's channels of x, its rows of w, its biases, as a conv of its own.
      std::vector<float> xg;
      for (int64_t px = 0; px < p.n * p.h * p.w; ++px)
        for (int64_t ch = 0; ch < cig; ++ch) xg.push_back(x[px * p.ci + g * cig + ch]);
      Conv2dParams pg = p;
      pg.ci = cig;
      pg.co = cog;
      pg.groups = 1;
      const std::vector<double> bg(bias.begin() + g * cog, bias.begin() + (g + 1) * cog);
      const std::vector<double> yg = conv2d_direct(xg, pg, weight_rows(w, g * cog, cog), bg);
      std::vector<double> slice;
      for (int64_t px = 0; px < pixels; ++px)
        for (int64_t o = 0; o < cog; ++o) slice.push_back(full[px * p.co + g * cog + o]);
      expect_close(slice, yg, 1e-12, "group " + std::to_string(g));
    }
  }
}

// The reduction order the op defines is (kh, kw, ci): a float weight [co][kh][kw][ci_g] quantized row by row
// (linear::quantize_weight over K = kh·kw·ci_g) must give the conv of that float weight within the quantization error;
// the same values read in (ci, kh, kw) order must not.
TEST(ConvReference, QuantizedWeightFollowsTheKhKwCiOrder) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const Conv2dParams p{2, 9, 8, 16, 6, 3, 3, 1, 1, 1, 1, 1, 1, 1};
  const int64_t kr = p.reduction(), ho = p.out_h(), wo = p.out_w();
  const std::vector<float> x = normal_values(rng, p.n * p.h * p.w * p.ci);
  const std::vector<float> wf = normal_values(rng, p.co * kr);  // [co][kh][kw][ci]
  // The test's own float convolution over the 4-D weight.
  std::vector<double> exact(static_cast<std::size_t>(p.pixels() * p.co), 0.0);
  for (int64_t b = 0; b < p.n; ++b)
    for (int64_t oh = 0; oh < ho; ++oh)
      for (int64_t ow = 0; ow < wo; ++ow)
        for (int64_t o = 0; o < p.co; ++o) {
          double acc = 0;
          for (int64_t i = 0; i < p.kh; ++i)
            for (int64_t j = 0; j < p.kw; ++j)
              for (int64_t c = 0; c < p.ci; ++c) {
                const int64_t ih = oh - 1 + i, iw = ow - 1 + j;
                if (ih < 0 || ih >= p.h || iw < 0 || iw >= p.w) continue;
                acc += static_cast<double>(x[((b * p.h + ih) * p.w + iw) * p.ci + c]) *
                       wf[((o * p.kh + i) * p.kw + j) * p.ci + c];
              }
          exact[((b * ho + oh) * wo + ow) * p.co + o] = acc;
        }
  auto rel_error = [&](const std::vector<double>& y) {
    double e2 = 0, n2 = 0;
    for (std::size_t i = 0; i < y.size(); ++i) e2 += (y[i] - exact[i]) * (y[i] - exact[i]), n2 += exact[i] * exact[i];
    return std::sqrt(e2 / n2);
  };
  // The same weight laid out in (ci, kh, kw) order: what a reader of the wrong convention would quantize.
  std::vector<float> transposed(wf.size());
  for (int64_t o = 0; o < p.co; ++o)
    for (int64_t i = 0; i < p.kh; ++i)
      for (int64_t j = 0; j < p.kw; ++j)
        for (int64_t c = 0; c < p.ci; ++c)
          transposed[((o * p.ci + c) * p.kh + i) * p.kw + j] = wf[((o * p.kh + i) * p.kw + j) * p.ci + c];
  for (int bits : {4, 8})
    for (int64_t block : {int64_t{48}, kr})
      for (ZeroMode mode : {ZeroMode::kOffset, ZeroMode::kZeroPoint}) {
        SCOPED_TRACE("int" + std::to_string(bits) + " block " + std::to_string(block) +
                     (mode == ZeroMode::kOffset ? " offset" : " zero point"));
        const QuantizedWeight q = linear::quantize_weight(wf.data(), p.co, kr, bits, block, mode);
        // Rounding to the nearest code errs by range / (2^bits − 1) / sqrt(12) in rms, a Gaussian block's range being
        // 4.5-5.5 σ: about 0.1 (int4) and 0.006 (int8) relative. Measured over 200 seeds: up to 0.12 and 0.007; the
        // wrong order at least 1.3.
        EXPECT_LT(rel_error(conv2d_reference(x, p, q)), bits == 4 ? 0.2 : 0.012);
        const QuantizedWeight t = linear::quantize_weight(transposed.data(), p.co, kr, bits, block, mode);
        EXPECT_GT(rel_error(conv2d_reference(x, p, t)), 0.5) << "the wrong order must show";
      }
}

TEST(ConvReference, ResultDoesNotDependOnTheThreadCount) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const Conv2dParams p{3, 11, 9, 24, 12, 3, 3, 1, 1, 1, 1, 1, 1, 2};
  const int64_t kr = p.reduction();
  const std::vector<float> x = normal_values(rng, p.n * p.h * p.w * p.ci);
  const std::vector<float> wf = normal_values(rng, p.co * kr);
  const QuantizedWeight w = linear::quantize_weight(wf.data(), p.co, kr, 8, 36, ZeroMode::kOffset);
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> one = conv2d_reference(x, p, w, {}, -inf, inf, 1);
  EXPECT_EQ(conv2d_reference(x, p, w, {}, -inf, inf, 5), one);
  const std::vector<double> direct_one = conv2d_direct(x, p, w, {}, -inf, inf, 1);
  EXPECT_EQ(conv2d_direct(x, p, w, {}, -inf, inf, 7), direct_one);
  expect_close(one, direct_one, 1e-12, "reference vs direct");
}

TEST(ConvReference, NchwNhwcRoundTrip) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t n = 2, c = 5, h = 3, w = 7;
  const std::vector<float> nchw = normal_values(rng, n * c * h * w);
  const std::vector<float> nhwc = nchw_to_nhwc(nchw, n, c, h, w);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t i = 0; i < h; ++i)
        for (int64_t j = 0; j < w; ++j)
          ASSERT_EQ(nhwc[((b * h + i) * w + j) * c + ch], nchw[((b * c + ch) * h + i) * w + j]);
  EXPECT_EQ(nhwc_to_nchw(nhwc, n, h, w, c), nchw);
  // Sizes are read in the source's order: a 1×2×1×3 NCHW tensor (two channels of a 1×3 row) interleaves.
  EXPECT_EQ(nchw_to_nhwc({1, 2, 3, 4, 5, 6}, 1, 2, 1, 3), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(nhwc_to_nchw({1, 4, 2, 5, 3, 6}, 1, 1, 3, 2), (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

TEST(ConvReference, BadArgumentsAreRejected) {
  const Conv2dParams good{1, 5, 5, 4, 6, 3, 3, 1, 1, 1, 1, 1, 1, 2};
  EXPECT_NO_THROW(check_conv2d_params(good));
  auto with = [&](const std::function<void(Conv2dParams&)>& edit) {
    Conv2dParams p = good;
    edit(p);
    return p;
  };
  const std::vector<std::pair<std::function<void(Conv2dParams&)>, std::string>> rules = {
      {[](Conv2dParams& p) { p.n = 0; }, "'n' must be >= 1"},
      {[](Conv2dParams& p) { p.h = -1; }, "'h' must be >= 1"},
      {[](Conv2dParams& p) { p.ci = 0; }, "'ci' must be >= 1"},
      {[](Conv2dParams& p) { p.co = 0; }, "'co' must be >= 1"},
      {[](Conv2dParams& p) { p.kw = 0; }, "'kw' must be >= 1"},
      {[](Conv2dParams& p) { p.stride_h = 0; }, "'stride_h' must be >= 1"},
      {[](Conv2dParams& p) { p.dil_w = 0; }, "'dil_w' must be >= 1"},
      {[](Conv2dParams& p) { p.groups = 0; }, "'groups' must be >= 1"},
      {[](Conv2dParams& p) { p.pad_w = -1; }, "padding must be >= 0"},
      {[](Conv2dParams& p) { p.groups = 3; }, "'ci' (4) must be divisible by 'groups' (3)"},
      {[](Conv2dParams& p) { p.co = 5; }, "'co' (5) must be divisible by 'groups' (2)"},
      {[](Conv2dParams& p) { p.pad_h = 0, p.h = 2; }, "must fit in the padded input"},
      {[](Conv2dParams& p) { p.pad_w = 0, p.dil_w = 3; }, "the output would be 5 × -1"},
  };
  for (const auto& rule : rules) expect_invalid([&] { check_conv2d_params(with(rule.first)); }, rule.second);
  expect_invalid([] { conv_output_size(5, 3, 0, 0, 1); }, "stride must be >= 1");

  // The operands of both references, against a consistent set.
  const int64_t kr = good.reduction();
  const std::vector<float> wf(static_cast<std::size_t>(good.co * kr), 0.5f);
  const QuantizedWeight w = linear::quantize_weight(wf.data(), good.co, kr, 4, kr, ZeroMode::kZeroPoint);
  const std::vector<float> x(static_cast<std::size_t>(good.n * good.h * good.w * good.ci), 1.f);
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_NO_THROW(conv2d_reference(x, good, w));
  auto bad_weight = [&](const std::function<void(QuantizedWeight&)>& edit, const std::string& needle) {
    QuantizedWeight q = w;
    edit(q);
    expect_invalid([&] { conv2d_reference(x, good, q); }, needle);
    expect_invalid([&] { conv2d_direct(x, good, q); }, needle);
  };
  bad_weight([](QuantizedWeight& q) { q.n = 5; }, "'w' must be [co, kh·kw·ci/groups] = [6, 18]");
  bad_weight([](QuantizedWeight& q) { q.k = 36; }, "'w' must be [co, kh·kw·ci/groups]");
  bad_weight([](QuantizedWeight& q) { q.bits = 2; }, "'w.bits' must be 4 or 8");
  bad_weight([](QuantizedWeight& q) { q.block = 4; }, "'w.block' must divide K = 18");
  bad_weight([](QuantizedWeight& q) { q.k_perm.assign(18, 0); }, "'w.k_perm' must be empty");
  bad_weight([](QuantizedWeight& q) { q.codes.pop_back(); }, "'w.codes' must hold co·K = 108");
  bad_weight([](QuantizedWeight& q) { q.codes[7] = 16; }, "'w.codes'[7] = 16 exceeds 15");
  bad_weight([](QuantizedWeight& q) { q.scale.push_back(1.f); }, "'w.scale' must hold");
  bad_weight([](QuantizedWeight& q) { q.offset.clear(); }, "'w.offset' must hold");
  bad_weight([](QuantizedWeight& q) { q.zero.clear(); }, "'w.zero' must hold");
  expect_invalid([&] { conv2d_reference(std::vector<float>(x.size() - 1), good, w); }, "'x' must hold n·h·w·ci = 100");
  expect_invalid([&] { conv2d_direct(x, good, w, {1.0, 2.0}); }, "'bias' must be empty or hold co = 6 values, got 2");
  expect_invalid([&] { conv2d_reference(x, good, w, {}, 1.0, -1.0); }, "'clamp_min' must be <= 'clamp_max'");
  expect_invalid([&] { conv2d_reference(x, good, w, {}, std::nan(""), inf); }, "'clamp_min' must be <= 'clamp_max'");
  expect_invalid([&] { conv2d_reference(x, with([](Conv2dParams& p) { p.groups = 3; }), w); }, "divisible");
  expect_invalid([&] { im2col_nhwc(std::vector<float>(3), good); }, "'x' must hold n·h·w·ci = 100");
  expect_invalid([] { nchw_to_nhwc(std::vector<float>(5), 1, 2, 1, 3); }, "'x' must hold n·c·h·w values");
  expect_invalid([] { nhwc_to_nchw(std::vector<float>(7), 1, 2, 1, 3); }, "'x' must hold n·h·w·c values");
}

}  // namespace
}  // namespace tessera::reference
