// The W8A8 references (issue 19): the per-(row, block) int8 quantizer and the int8 × int8 product with per-block
// scales and zero points. The expanded integer form (what a kernel computes from the tensor-core dot and block sums)
// must equal the direct form exactly; the quantizer must round every value to its nearest code and keep 0 exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "common/gpu_util.h"
#include "reference/w8a8_reference.h"

namespace tessera::reference {
namespace {

// Activations as models produce them: Gaussian rows with a few outlier columns (20x), one row of one sign, one row of
// zeros, one constant row.
std::vector<float> activations(std::mt19937_64& rng, int64_t rows, int64_t k) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(static_cast<std::size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k; ++c) {
      float v = normal(rng) * (c % 53 == 7 ? 20.f : 1.f);
      if (r % 4 == 1) v = std::fabs(v) + 0.1f;  // one sign
      if (r % 4 == 2 && r == 2) v = 0.f;        // all zeros
      if (r % 4 == 3 && r == 3) v = -2.5f;      // constant
      x[r * k + c] = v;
    }
  return x;
}

TEST(W8A8Reference, QuantizerRoundsToTheNearestCodeAndKeepsZeroExact) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t rows = 9, k = 384;
  const std::vector<float> x = activations(rng, rows, k);
  for (bool symmetric : {false, true})
    for (int64_t block : {int64_t{32}, int64_t{64}, int64_t{128}, k}) {
      SCOPED_TRACE(std::string(symmetric ? "symmetric" : "asymmetric") + " block " + std::to_string(block));
      const Int8Blocks q = quantize_int8_blocks(x, rows, k, block, symmetric);
      ASSERT_EQ(q.codes.size(), static_cast<std::size_t>(rows * k));
      ASSERT_EQ(q.scale.size(), static_cast<std::size_t>(rows * (k / block)));
      int64_t bad = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < k; ++c) {
          const int64_t p = r * (k / block) + c / block;
          const double s = q.scale[p];
          const int code = q.codes[r * k + c];
          ASSERT_GT(s, 0.0);
          if (symmetric) {
            EXPECT_EQ(q.zero[p], 0);
            EXPECT_GE(code, -127);
          }
          // Half a step anywhere; a whole step where the top end was clamped (the zero point's rounding).
          const bool clamped = code == 127 || code == -128;
          const double err = std::fabs(x[r * k + c] - q.value(r, c));
          if (err > s * ((clamped ? 1.0 : 0.5) + 1e-6) && bad++ < 5)
            ADD_FAILURE() << "x[" << r << ", " << c << "] = " << x[r * k + c] << " -> code " << code << ", zero "
                          << q.zero[p] << ", scale " << s << ": error " << err;
          if (x[r * k + c] == 0.f) EXPECT_EQ(q.value(r, c), 0.0) << "0 must stay exact";
        }
      EXPECT_EQ(bad, 0);
      // The asymmetric codes span the range: every block's extreme values reach the ends of int8 (unless the block is
      // all zeros).
      if (!symmetric) {
        const int8_t* row1 = &q.codes[1 * k];  // one-sign row: its minimum (> 0) is not 0, so 0 is the low end
        EXPECT_EQ(*std::max_element(row1, row1 + block), 127);
      }
    }
}

TEST(W8A8Reference, QuantizerFollowsTheStatedFp32Steps) {
  // A block worked out by hand: lo = -1, hi = 3 -> s = 4 / 255, inv = 63.75, z = rint(-128 + 63.75) = -64;
  // x = -1 -> -64 - 64 = -128, x = 0 -> z, x = 1 -> 64 - 64 = 0, x = 3 -> rint(191.25) - 64 = 127.
  const std::vector<float> x = {-1.f, 0.f, 1.f, 3.f};
  const Int8Blocks q = quantize_int8_blocks(x, 1, 4, 4, false);
  const float s = 4.f / 255.f;
  EXPECT_EQ(q.scale[0], s);
  const float inv = 1.f / s;
  EXPECT_EQ(q.zero[0], static_cast<int32_t>(std::rint(-128.f - (-1.f) * inv)));
  EXPECT_EQ(q.codes[0], -128);
  EXPECT_EQ(q.codes[1], q.zero[0]);
  EXPECT_EQ(q.codes[2], static_cast<int8_t>(std::rint(1.f * inv) + q.zero[0]));
  EXPECT_EQ(q.codes[3], 127);
  // Symmetric: s = 3 / 127.
  const Int8Blocks y = quantize_int8_blocks(x, 1, 4, 4, true);
  EXPECT_EQ(y.scale[0], 3.f / 127.f);
  EXPECT_EQ(y.codes[3], 127);
  EXPECT_EQ(y.codes[0], static_cast<int8_t>(std::rint(-1.f * (1.f / (3.f / 127.f)))));
  // A block of zeros: scale 1, every code its zero point.
  const Int8Blocks z = quantize_int8_blocks({0.f, 0.f}, 1, 2, 2, false);
  EXPECT_EQ(z.scale[0], 1.f);
  EXPECT_EQ(z.codes[0], z.zero[0]);
  EXPECT_EQ(z.value(0, 1), 0.0);
}

TEST(W8A8Reference, ExpandedFormEqualsTheDirectSumsExactly) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> code(-128, 127);
  for (int64_t block : {int64_t{32}, int64_t{128}, int64_t{256}}) {
    const int64_t m = 5, n = 7, k = 2 * block;
    Int8Blocks a, b;
    for (Int8Blocks* q : {&a, &b}) {
      q->rows = q == &a ? m : n;
      q->k = k;
      q->block = block;
      q->codes.resize(static_cast<std::size_t>(q->rows * k));
      for (auto& c : q->codes) c = static_cast<int8_t>(code(rng));
      q->scale.assign(static_cast<std::size_t>(q->rows * 2), 0.5f);
      q->zero.resize(q->scale.size());
      for (auto& z : q->zero) z = code(rng);
    }
    // The extremes: every code -128 against zero 127 (the largest |code - zero| products), in one row of each.
    std::fill(a.codes.begin(), a.codes.begin() + k, int8_t{-128});
    std::fill(b.codes.begin(), b.codes.begin() + k, int8_t{-128});
    a.zero[0] = a.zero[1] = 127;
    b.zero[0] = b.zero[1] = 127;
    EXPECT_EQ(w8a8_block_dots_expanded(a, b), w8a8_block_dots(a, b)) << "block " << block;
  }
}

TEST(W8A8Reference, ProductIsThatOfTheDequantizedOperands) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t m = 6, n = 10, k = 256;
  const std::vector<float> x = activations(rng, m, k), w = activations(rng, n, k);
  const std::vector<double> bias = {0.5, -1, 2, 0, 0, 1, 1, -3, 0.25, 7};
  for (int64_t block : {int64_t{64}, k}) {
    const Int8Blocks a = quantize_int8_blocks(x, m, k, block, false);
    const Int8Blocks b = quantize_int8_blocks(w, n, k, block, true);
    const std::vector<double> c = w8a8_reference(a, b, bias);
    double worst = 0, err2 = 0, norm2 = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = bias[j], exact = bias[j];
        for (int64_t t = 0; t < k; ++t) {
          want += a.value(i, t) * b.value(j, t);
          exact += static_cast<double>(x[i * k + t]) * w[j * k + t];
        }
        worst = std::max(worst, std::fabs(c[i * n + j] - want) / (1.0 + std::fabs(want)));
        err2 += (c[i * n + j] - exact) * (c[i * n + j] - exact);
        norm2 += exact * exact;
      }
    EXPECT_LT(worst, 1e-12) << "block " << block;
    // Against the unquantized operands: two 8-bit quantizations, each within half a step of 2^-8 of its block's
    // range (outlier columns make some steps coarse); measured 1.5e-3 to 5.0e-3 over eight seeds.
    EXPECT_LT(std::sqrt(err2 / norm2), 1e-2) << "block " << block;
  }
}

TEST(W8A8Reference, BadShapesAreRejected) {
  EXPECT_THROW(quantize_int8_blocks(std::vector<float>(96), 1, 96, 64, false), std::invalid_argument);
  EXPECT_THROW(quantize_int8_blocks(std::vector<float>(10), 1, 64, 64, false), std::invalid_argument);
  Int8Blocks a, b;
  a.k = 64;
  a.block = 32;
  b.k = 64;
  b.block = 64;
  EXPECT_THROW(w8a8_block_dots(a, b), std::invalid_argument);
}

}  // namespace
}  // namespace tessera::reference
