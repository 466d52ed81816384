// The GPTQ / AWQ importers (linear/weight_formats.h) and the float64 linear reference. Each test quantizes a float
// weight itself, packs it as the checkpoint format lays it out (written here from the format's description, not from
// the importer), imports it, and compares the imported weight's values with the test's own dequantization exactly,
// and y = x · wᵀ over the original column order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "linear/weight_formats.h"
#include "reference/linear_reference.h"
#include "tessera/error.h"

namespace tessera::linear::detail {
namespace {

// A float weight quantized asymmetrically per (n, group of columns), group membership by g_idx: q in [0, 2^bits),
// z integer, s fp16: w ≈ (q − z) · s. Columns are in the original order.
struct Quantized {
  int64_t n = 0, k = 0, group = 0;
  int bits = 4;
  std::vector<int32_t> g_idx;   // [K]
  std::vector<uint8_t> q;       // [N][K]
  std::vector<uint8_t> z;       // [G][N]
  std::vector<uint16_t> s;      // [G][N] fp16 bits
  double value(int64_t row, int64_t col) const {
    const int64_t g = g_idx[col];
    return (static_cast<double>(q[row * k + col]) - z[g * n + row]) * host::fp16_to_f32(s[g * n + row]);
  }
};

// W with outlier columns (every 17th column 8x larger), as real layers have them.
Quantized quantize(std::mt19937_64& rng, int64_t n, int64_t k, int bits, int64_t group, std::vector<int32_t> g_idx) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Quantized out;
  out.n = n, out.k = k, out.group = group, out.bits = bits, out.g_idx = std::move(g_idx);
  const int64_t groups = k / group;
  const int qmax = (1 << bits) - 1;
  std::vector<float> w(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < n * k; ++i) w[i] = normal(rng) * ((i % k) % 17 == 0 ? 8.0f : 1.0f);
  out.q.resize(w.size());
  out.z.resize(static_cast<size_t>(groups * n));
  out.s.resize(out.z.size());
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < n; ++r) {
      float lo = 0.0f, hi = 0.0f;
      for (int64_t c = 0; c < k; ++c)
        if (out.g_idx[c] == g) lo = std::min(lo, w[r * k + c]), hi = std::max(hi, w[r * k + c]);
      const uint16_t sb = host::f32_to_fp16(std::max((hi - lo) / qmax, 1e-3f));
      const float s = host::fp16_to_f32(sb);
      const int z = std::clamp(static_cast<int>(std::lround(-lo / s)), 0, qmax);
      out.s[g * n + r] = sb;
      out.z[g * n + r] = static_cast<uint8_t>(z);
      for (int64_t c = 0; c < k; ++c)
        if (out.g_idx[c] == g)
          out.q[r * k + c] = static_cast<uint8_t>(std::clamp(static_cast<int>(std::lround(w[r * k + c] / s)) + z, 0, qmax));
    }
  return out;
}

std::vector<int32_t> groups_in_order(int64_t k, int64_t group) {
  std::vector<int32_t> g(static_cast<size_t>(k));
  for (int64_t c = 0; c < k; ++c) g[c] = static_cast<int32_t>(c / group);
  return g;
}

// GPTQ packing: qweight [K·bits/32, N] with k = r·per + j at bits [bits·j, ...); qzeros [G, N·bits/32] along N;
// v1 stores z − 1 (wrapping in the field).
struct Gptq {
  std::vector<int32_t> qweight, qzeros;
};
Gptq pack_gptq(const Quantized& m, bool minus_one) {
  const int per = 32 / m.bits;
  const uint32_t mask = (1u << m.bits) - 1u;
  Gptq p;
  p.qweight.assign(static_cast<size_t>(m.k / per * m.n), 0);
  for (int64_t c = 0; c < m.k; ++c)
    for (int64_t r = 0; r < m.n; ++r) {
      uint32_t& word = reinterpret_cast<uint32_t&>(p.qweight[(c / per) * m.n + r]);
      word |= (static_cast<uint32_t>(m.q[r * m.k + c]) & mask) << (m.bits * (c % per));
    }
  const int64_t groups = m.k / m.group;
  p.qzeros.assign(static_cast<size_t>(groups * (m.n / per)), 0);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < m.n; ++r) {
      const uint32_t stored = (static_cast<uint32_t>(m.z[g * m.n + r]) - (minus_one ? 1u : 0u)) & mask;
      reinterpret_cast<uint32_t&>(p.qzeros[g * (m.n / per) + r / per]) |= stored << (m.bits * (r % per));
    }
  return p;
}

// Every imported value equals the test's own dequantization (column j of the import is original column k_perm[j]),
// and the reference y matches x · wᵀ summed in the original order.
void expect_same_weight(const QuantizedWeight& w, const Quantized& m, uint64_t seed) {
  ASSERT_EQ(w.n, m.n);
  ASSERT_EQ(w.k, m.k);
  const std::vector<double> wd = reference::dequantize_weight(w);
  int64_t wrong = 0;
  for (int64_t r = 0; r < m.n; ++r)
    for (int64_t j = 0; j < m.k; ++j) {
      const int64_t col = w.k_perm.empty() ? j : w.k_perm[j];
      wrong += wd[r * m.k + j] != m.value(r, col);
    }
  EXPECT_EQ(wrong, 0) << "imported values that differ from the checkpoint's";
  std::mt19937_64 rng(seed ^ 0x51ull);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t rows = 3;
  std::vector<double> x(static_cast<size_t>(rows * m.k));
  for (double& v : x) v = normal(rng);
  const std::vector<double> y = reference::linear_reference(x, rows, w);
  double err = 0.0, ref = 0.0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t r = 0; r < m.n; ++r) {
      double want = 0.0;
      for (int64_t c = 0; c < m.k; ++c) want += x[i * m.k + c] * m.value(r, c);
      err = std::max(err, std::fabs(y[i * m.n + r] - want));
      ref = std::max(ref, std::fabs(want));
    }
  EXPECT_LE(err, 1e-9 * ref) << "y = x · wᵀ over the imported weight";
}

TEST(WeightFormats, GptqFourAndEightBitBothZeroConventions) {
  for (int bits : {4, 8})
    for (bool minus_one : {true, false})
      for (int64_t group : {32, 128}) {
        const uint64_t seed = test::fresh_seed();
        SCOPED_TRACE("bits=" + std::to_string(bits) + " v1=" + std::to_string(minus_one) + " group=" +
                     std::to_string(group) + " " + test::seed_note(seed));
        std::mt19937_64 rng(seed);
        const int64_t n = 24, k = 256;
        const Quantized m = quantize(rng, n, k, bits, group, groups_in_order(k, group));
        const Gptq p = pack_gptq(m, minus_one);
        const QuantizedWeight w = import_gptq(p.qweight.data(), p.qzeros.data(), m.s.data(), m.g_idx.data(), k, n,
                                              bits, group, minus_one);
        EXPECT_TRUE(w.k_perm.empty());  // g_idx in order
        expect_same_weight(w, m, seed);
        // No g_idx: k / group.
        const QuantizedWeight w2 =
            import_gptq(p.qweight.data(), p.qzeros.data(), m.s.data(), nullptr, k, n, bits, group, minus_one);
        expect_same_weight(w2, m, seed);
      }
}

// Act-order: columns assigned to groups in a shuffled order (each group `group` columns); the import makes the
// groups contiguous and records the permutation.
TEST(WeightFormats, GptqActOrder) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t n = 16, k = 256, group = 64;
  std::vector<int32_t> g_idx = groups_in_order(k, group);
  std::shuffle(g_idx.begin(), g_idx.end(), rng);
  const Quantized m = quantize(rng, n, k, 4, group, g_idx);
  const Gptq p = pack_gptq(m, true);
  const QuantizedWeight w =
      import_gptq(p.qweight.data(), p.qzeros.data(), m.s.data(), g_idx.data(), k, n, 4, group, true);
  ASSERT_EQ(static_cast<int64_t>(w.k_perm.size()), k);
  for (int64_t j = 0; j < k; ++j) EXPECT_EQ(g_idx[w.k_perm[j]], j / group) << "column " << j;
  expect_same_weight(w, m, seed);
}

TEST(WeightFormats, Awq) {
  constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  for (int64_t group : {64, 128}) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE("group=" + std::to_string(group) + " " + test::seed_note(seed));
    std::mt19937_64 rng(seed);
    const int64_t n = 32, k = 256;
    const Quantized m = quantize(rng, n, k, 4, group, groups_in_order(k, group));
    std::vector<int32_t> qweight(static_cast<size_t>(k * n / 8), 0), qzeros(static_cast<size_t>(k / group * n / 8), 0);
    for (int64_t c = 0; c < k; ++c)
      for (int64_t col = 0; col < n / 8; ++col)
        for (int i = 0; i < 8; ++i) {
          const int64_t r = 8 * col + kOrder[i];
          reinterpret_cast<uint32_t&>(qweight[c * (n / 8) + col]) |= static_cast<uint32_t>(m.q[r * k + c]) << (4 * i);
          if (c % group == 0)
            reinterpret_cast<uint32_t&>(qzeros[(c / group) * (n / 8) + col]) |=
                static_cast<uint32_t>(m.z[(c / group) * n + r]) << (4 * i);
        }
    const QuantizedWeight w = import_awq(qweight.data(), qzeros.data(), m.s.data(), k, n, group);
    expect_same_weight(w, m, seed);
  }
}

TEST(WeightFormats, BadArgumentsNameTheArgument) {
  std::vector<int32_t> words(4096, 0);
  std::vector<uint16_t> scales(4096, 0x3c00);
  std::vector<int32_t> g_idx(64, 0);  // every column in group 0: groups of the wrong size
  const auto expect = [](const std::function<void()>& f, const std::string& arg) {
    try {
      f();
      ADD_FAILURE() << "no error for " << arg;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(arg), std::string::npos) << e.what();
    }
  };
  expect([&] { import_gptq(words.data(), words.data(), scales.data(), nullptr, 64, 16, 3, 32, true); }, "bits");
  expect([&] { import_gptq(words.data(), words.data(), scales.data(), nullptr, 64, 16, 4, 48, true); }, "group");
  expect([&] { import_gptq(words.data(), words.data(), scales.data(), nullptr, 64, 12, 4, 32, true); }, "qzeros");
  expect([&] { import_gptq(words.data(), words.data(), scales.data(), g_idx.data(), 64, 16, 4, 32, true); },
         "g_idx");
  g_idx[5] = 7;  // outside [0, 2)
  expect([&] { import_gptq(words.data(), words.data(), scales.data(), g_idx.data(), 64, 16, 4, 32, true); },
         "g_idx");
  expect([&] { import_gptq(nullptr, words.data(), scales.data(), nullptr, 64, 16, 4, 32, true); }, "qweight");
  expect([&] { import_awq(words.data(), words.data(), scales.data(), 64, 20, 32); }, "qzeros");
  expect([&] { import_awq(words.data(), words.data(), scales.data(), 64, 16, 0); }, "group");
}

}  // namespace
}  // namespace tessera::linear::detail
