// The weight-only linear layer's host side (tessera/linear.h): prepack / unpack, the kernels' byte layout, round-to-
// nearest quantization, prepack's validation, and the pure configuration choice (linear/config.h).
//
// The layout checks do not use linear/layout.h's FragmentLayout: they follow the documented description
// (docs/ops/linear.md, layout.h's header comment) with a computation of their own, in the other direction (from a
// lane's bytes to the weight element they hold) and on elements whose byte offsets were worked out by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "linear/config.h"
#include "reference/linear_reference.h"
#include "tessera/error.h"
#include "tessera/linear.h"

namespace tessera::linear {
namespace {

const char* mode_name(ZeroMode m) { return m == ZeroMode::kOffset ? "kOffset" : "kZeroPoint"; }

uint16_t to_bits(float v, DType dtype) { return dtype == DType::kBF16 ? host::f32_to_bf16(v) : host::f32_to_fp16(v); }
float from_bits(uint16_t v, DType dtype) { return dtype == DType::kBF16 ? host::bf16_to_f32(v) : host::fp16_to_f32(v); }
float round_to(float v, DType dtype) { return from_bits(to_bits(v, dtype), dtype); }

// A random canonical weight: codes over the whole range (the extremes included), scales log-uniform in [1e-3, 10],
// offsets of either sign, zero points over [0, 2^bits), optionally a random column permutation.
QuantizedWeight random_weight(std::mt19937_64& rng, int64_t n, int64_t k, int bits, int64_t block, ZeroMode mode,
                              bool permuted) {
  QuantizedWeight w;
  w.n = n;
  w.k = k;
  w.bits = bits;
  w.block = block;
  w.zero_mode = mode;
  const int levels = (1 << bits) - 1;
  std::uniform_int_distribution<int> code(0, levels);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  w.codes.resize(static_cast<size_t>(n * k));
  for (uint8_t& q : w.codes) q = static_cast<uint8_t>(code(rng));
  w.codes[0] = static_cast<uint8_t>(levels);
  w.codes[w.codes.size() - 1] = 0;
  const size_t params = static_cast<size_t>(n * (k / block));
  w.scale.resize(params);
  w.offset.resize(params);
  if (mode == ZeroMode::kZeroPoint) w.zero.resize(params);
  for (size_t i = 0; i < params; ++i) {
    w.scale[i] = static_cast<float>(std::exp(std::log(1e-3) + unit(rng) * (std::log(10.0) - std::log(1e-3))));
    if (mode == ZeroMode::kZeroPoint) {
      w.zero[i] = static_cast<uint8_t>(code(rng));
      w.offset[i] = -static_cast<float>(w.zero[i]) * w.scale[i];
    } else {
      w.offset[i] = static_cast<float>((unit(rng) * 2.0 - 1.5) * levels) * w.scale[i];
    }
  }
  if (permuted) {
    w.k_perm.resize(static_cast<size_t>(k));
    std::iota(w.k_perm.begin(), w.k_perm.end(), 0);
    std::shuffle(w.k_perm.begin(), w.k_perm.end(), rng);
  }
  return w;
}

// ---- the documented layout, computed independently -------------------------------------------------------------
//
// From the description (docs/ops/linear.md, linear/layout.h's header): a (16-row stripe s, T-column tile j) is 512
// bytes at (s · Kp / T + j) · 512 (T = 64 int4, 32 int8), lane l = 4g + t owning bytes [16 l, 16 l + 16). Step i's
// fragment value v (mma.m16n8k16's A registers a0..a3, two values each: a0 row g, a1 row g + 8, a2 row g, a3 row
// g + 8) is row 16 s + g + 8 · ((v / 2) % 2) and column
//   j · T + 16 i + 2 t + {0, 1, 0, 1, 8, 9, 8, 9}[v].
// int4: step i is the little-endian 32-bit word at bytes 16 l + 4 i, value v in nibble {0, 4, 1, 5, 2, 6, 3, 7}[v].
// int8: step i is bytes 16 l + 8 i .. + 8, value v in byte 16 l + 8 i + v.
struct Element {
  int64_t row, col;
};
int64_t doc_tile_k(int bits) { return bits == 4 ? 64 : 32; }
int doc_value_row_half(int v) { return (v / 2) % 2; }  // 0: row g, 1: row g + 8
int doc_value_column(int v) {
  static const int kColumn[8] = {0, 1, 0, 1, 8, 9, 8, 9};
  return kColumn[v];
}
int doc_nibble(int v) {
  static const int kNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  return kNibble[v];
}
Element doc_element(int bits, int64_t stripe, int64_t tile, int lane, int step, int v) {
  const int g = lane / 4, t = lane % 4;
  return {stripe * 16 + g + 8 * doc_value_row_half(v),
          tile * doc_tile_k(bits) + 16 * step + 2 * t + doc_value_column(v)};
}
// The code the layout stores for (stripe, tile, lane, step, v).
int doc_read(const std::vector<uint8_t>& codes, int bits, int64_t tiles, int64_t stripe, int64_t tile, int lane,
             int step, int v) {
  const int64_t base = ((stripe * tiles + tile) * 32 + lane) * 16;
  if (bits == 8) return codes[base + 8 * step + v];
  const int64_t b = base + 4 * step;
  const uint32_t word = static_cast<uint32_t>(codes[b]) | static_cast<uint32_t>(codes[b + 1]) << 8 |
                        static_cast<uint32_t>(codes[b + 2]) << 16 | static_cast<uint32_t>(codes[b + 3]) << 24;
  return static_cast<int>((word >> (4 * doc_nibble(v))) & 0xF);
}
// Parameter pairs: per stripe and block, 16 pairs with rows in the order 0, 8, 1, 9, ..., 7, 15.
int doc_param_row(int pos) { return pos % 2 == 0 ? pos / 2 : 8 + pos / 2; }

// Every byte of the packed codes and every parameter pair, walked from the layout's side: each (lane, step, value)
// holds the code of the element the description names, 0 in the padding; each pair holds its row's parameters in
// compute_dtype, 0 for padded rows and blocks.
void expect_documented_layout(const QuantizedWeight& w, const PackedWeight& p) {
  const int64_t tk = doc_tile_k(w.bits), kp = (w.k + tk - 1) / tk * tk, np = (w.n + 15) / 16 * 16;
  const int64_t tiles = kp / tk, steps = tk / 16;
  ASSERT_EQ(p.codes.size(), static_cast<size_t>(np * kp * w.bits / 8));
  int64_t wrong = 0, checked = 0;
  for (int64_t s = 0; s < np / 16; ++s)
    for (int64_t tile = 0; tile < tiles; ++tile)
      for (int lane = 0; lane < 32; ++lane)
        for (int step = 0; step < steps; ++step)
          for (int v = 0; v < 8; ++v) {
            const Element e = doc_element(w.bits, s, tile, lane, step, v);
            const int want = e.row < w.n && e.col < w.k ? w.codes[e.row * w.k + e.col] : 0;
            const int got = doc_read(p.codes, w.bits, tiles, s, tile, lane, step, v);
            if (got != want && wrong++ < 5)
              ADD_FAILURE() << "stripe " << s << " tile " << tile << " lane " << lane << " step " << step << " value "
                            << v << " (row " << e.row << ", column " << e.col << "): code " << got << ", expected "
                            << want;
            ++checked;
          }
  EXPECT_EQ(wrong, 0);
  // Each stored code slot was visited once: the walk covers the whole array.
  EXPECT_EQ(checked * w.bits / 8, static_cast<int64_t>(p.codes.size()));

  const bool per_channel = w.block == w.k;
  const int64_t nb = per_channel ? 1 : kp / w.block, blocks = w.k / w.block;
  ASSERT_EQ(p.params.size(), static_cast<size_t>(np * nb * 2));
  wrong = 0;
  for (int64_t s = 0; s < np / 16; ++s)
    for (int64_t b = 0; b < nb; ++b)
      for (int pos = 0; pos < 16; ++pos) {
        const int64_t row = s * 16 + doc_param_row(pos), at = ((s * nb + b) * 16 + pos) * 2;
        uint16_t scale = 0, second = 0;
        if (row < w.n && b < blocks) {
          const int64_t i = row * blocks + b;
          scale = to_bits(w.scale[i], p.compute_dtype);
          second = to_bits(w.zero_mode == ZeroMode::kZeroPoint ? static_cast<float>(w.zero[i]) : w.offset[i],
                           p.compute_dtype);
        }
        if ((p.params[at] != scale || p.params[at + 1] != second) && wrong++ < 5)
          ADD_FAILURE() << "params of stripe " << s << " block " << b << " position " << pos << " (row " << row
                        << "): " << p.params[at] << ", " << p.params[at + 1] << ", expected " << scale << ", "
                        << second;
      }
  EXPECT_EQ(wrong, 0);
}

// unpack(prepack(w)) is w with its parameters rounded to compute_dtype.
void expect_round_trip(const QuantizedWeight& w, DType dtype) {
  const PackedWeight p = prepack(w, dtype);
  EXPECT_EQ(p.n, w.n);
  EXPECT_EQ(p.k, w.k);
  EXPECT_EQ(p.bits, w.bits);
  EXPECT_EQ(p.block, w.block);
  EXPECT_EQ(p.zero_mode, w.zero_mode);
  EXPECT_EQ(p.compute_dtype, dtype);
  EXPECT_EQ(p.k_perm, w.k_perm);
  const int64_t tk = doc_tile_k(w.bits);
  EXPECT_EQ(p.padded_n(), (w.n + 15) / 16 * 16);
  EXPECT_EQ(p.padded_k(), (w.k + tk - 1) / tk * tk);
  EXPECT_EQ(p.num_blocks(), w.block == w.k ? 1 : p.padded_k() / w.block);
  expect_documented_layout(w, p);

  const QuantizedWeight u = unpack(p);
  EXPECT_EQ(u.n, w.n);
  EXPECT_EQ(u.k, w.k);
  EXPECT_EQ(u.bits, w.bits);
  EXPECT_EQ(u.block, w.block);
  EXPECT_EQ(u.zero_mode, w.zero_mode);
  EXPECT_EQ(u.k_perm, w.k_perm);
  EXPECT_TRUE(u.codes == w.codes) << "codes differ after the round trip";
  ASSERT_EQ(u.scale.size(), w.scale.size());
  ASSERT_EQ(u.offset.size(), w.offset.size());
  int64_t wrong = 0;
  for (size_t i = 0; i < w.scale.size(); ++i) {
    const float scale = round_to(w.scale[i], dtype);
    float offset = round_to(w.offset[i], dtype);
    if (w.zero_mode == ZeroMode::kZeroPoint) {
      ASSERT_EQ(u.zero.size(), w.zero.size());
      if (u.zero[i] != w.zero[i] && wrong++ < 5) ADD_FAILURE() << "zero[" << i << "]";
      offset = -static_cast<float>(w.zero[i]) * scale;
    }
    if ((u.scale[i] != scale || u.offset[i] != offset) && wrong++ < 5)
      ADD_FAILURE() << "parameters " << i << ": (" << u.scale[i] << ", " << u.offset[i] << "), expected (" << scale
                    << ", " << offset << ")";
  }
  EXPECT_EQ(wrong, 0);
}

struct RoundTripShape {
  int64_t n, k, block;  // block 0: per output channel (K)
};

TEST(LinearPrepack, RoundTripEveryFormat) {
  // N not a multiple of 16 (partial last stripe), K not a multiple of the int4 tile (64), blocks past K (int4, block
  // 32, K 96: Kp 128 holds a fourth, padded block), per-channel with K not a multiple of any tile, and K not a
  // multiple of 8 (conv weights: a depthwise 3×3 has K 9, an RGB 7×7 stem K 147; tessera::linear itself needs K % 8).
  const RoundTripShape shapes[] = {{40, 96, 32}, {24, 160, 32},  {8, 32, 32},    {40, 192, 64}, {24, 64, 64},
                                   {40, 384, 128}, {56, 128, 128}, {40, 96, 0},  {40, 40, 0},   {16, 256, 0},
                                   {1, 8, 0},      {17, 32, 32},   {24, 9, 0},   {64, 147, 0},  {5, 27, 0}};
  for (int bits : {4, 8})
    for (DType dtype : {DType::kBF16, DType::kFP16})
      for (ZeroMode mode : {ZeroMode::kOffset, ZeroMode::kZeroPoint})
        for (const RoundTripShape& s : shapes) {
          const int64_t block = s.block ? s.block : s.k;
          const bool permuted = (s.n + bits) % 3 == 0;
          const uint64_t seed = test::fresh_seed();
          SCOPED_TRACE("bits=" + std::to_string(bits) + " " + dtype_name(dtype) + " " + mode_name(mode) +
                       " N=" + std::to_string(s.n) + " K=" + std::to_string(s.k) +
                       " block=" + (s.block ? std::to_string(block) : "per-channel") + (permuted ? " k_perm" : "") +
                       " " + test::seed_note(seed));
          std::mt19937_64 rng(seed);
          expect_round_trip(random_weight(rng, s.n, s.k, bits, block, mode, permuted), dtype);
        }
}

// Byte offsets worked out by hand from the description, for a weight whose codes are all 0 but one.
struct HandPicked {
  int bits;
  int64_t row, col, byte;
  int shift;  // of the nibble (int4)
};

TEST(LinearPrepack, HandPickedCodePositions) {
  // N 40, K 96. int4: Kp 128 (two tiles of 64, runs of 16 columns per lane), 48 × 64 bytes; int8: Kp 96 (three
  // tiles of 32, runs of 8), 48 × 96 bytes.
  const HandPicked cases[] = {
      {4, 0, 0, 0, 0},       // lane 0, step 0, v0: nibble 0
      {4, 0, 1, 2, 0},       // v1: nibble 4 = byte 2, low
      {4, 8, 0, 0, 4},       // row g + 8: v2, nibble 1 = byte 0, high
      {4, 0, 2, 16, 0},      // column 2: lane 1 (t 1), v0
      {4, 9, 3, 82, 4},      // lane 5 (g 1, t 1: byte 80), v3: nibble 5 = byte 2, high
      {4, 13, 25, 327, 4},   // lane 20 (g 5, t 0: 320), step 1, v7 (row g + 8, column 9): nibble 7 = byte 4 + 3, high
      {4, 17, 70, 1648, 0},  // stripe 1, tile 1 (byte 1536), lane 7 (g 1, t 3: 112), step 0, v0
      {4, 5, 95, 887, 0},    // tile 1 (512), lane 23 (368), step 1, v5: nibble 6 = byte 4 + 3
      {4, 39, 50, 2524, 0},  // stripe 2 (2048), lane 29 (464), step 3 (byte 12), v0
      {8, 0, 0, 0, 0},      {8, 8, 1, 3, 0},  // v3
      {8, 0, 4, 32, 0},                       // lane 2, v0
      {8, 20, 45, 2341, 0},                   // stripe 1 tile 1 (2048), lane 18 (288), step 0, v5
      {8, 15, 31, 511, 0},                    // lane 31, step 1 (8), v7
      {8, 39, 95, 4605, 0},                   // stripe 2 tile 2 (4096), lane 31 (496), step 1, v5
      {8, 10, 6, 178, 0},                     // lane 11 (176), v2
  };
  for (const HandPicked& c : cases) {
    SCOPED_TRACE("bits=" + std::to_string(c.bits) + " row " + std::to_string(c.row) + " column " +
                 std::to_string(c.col));
    QuantizedWeight w;
    w.n = 40;
    w.k = 96;
    w.bits = c.bits;
    w.block = 32;
    w.codes.assign(40 * 96, 0);
    w.scale.assign(40 * 3, 1.0f);
    w.offset.assign(40 * 3, 0.0f);
    const uint8_t code = c.bits == 4 ? 0xB : 0xA7;
    w.codes[c.row * 96 + c.col] = code;
    const PackedWeight p = prepack(w, DType::kBF16);
    ASSERT_EQ(p.codes.size(), static_cast<size_t>(c.bits == 4 ? 48 * 64 : 48 * 96));
    for (size_t i = 0; i < p.codes.size(); ++i) {
      const uint8_t want = static_cast<int64_t>(i) == c.byte ? static_cast<uint8_t>(code << c.shift) : 0;
      EXPECT_EQ(p.codes[i], want) << "byte " << i;
    }
  }
}

TEST(LinearPrepack, HandPickedParameterPositions) {
  struct Case {
    int bits;
    int64_t row, block_index, element;
  };
  // N 40, K 96, block 32: int4 has 4 blocks per stripe (Kp 128), int8 3.
  const Case cases[] = {
      {4, 0, 0, 0},    {4, 8, 0, 2},    {4, 1, 0, 4},
      {4, 15, 0, 30},  {4, 17, 2, 196},  // stripe 1, block 2, position 2: ((1 · 4 + 2) · 16 + 2) · 2
      {4, 39, 2, 348},                   // stripe 2, block 2, row 7 at position 14
      {8, 17, 2, 164},                   // ((1 · 3 + 2) · 16 + 2) · 2
      {8, 32, 1, 224},                   // ((2 · 3 + 1) · 16 + 0) · 2
  };
  for (ZeroMode mode : {ZeroMode::kOffset, ZeroMode::kZeroPoint})
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(mode_name(mode)) + " bits=" + std::to_string(c.bits) + " row " + std::to_string(c.row) +
                   " block " + std::to_string(c.block_index));
      QuantizedWeight w;
      w.n = 40;
      w.k = 96;
      w.bits = c.bits;
      w.block = 32;
      w.zero_mode = mode;
      w.codes.assign(40 * 96, 0);
      w.scale.assign(40 * 3, 0.0f);
      w.offset.assign(40 * 3, 0.0f);
      if (mode == ZeroMode::kZeroPoint) w.zero.assign(40 * 3, 0);
      const int64_t i = c.row * 3 + c.block_index;
      w.scale[i] = 3.0f;
      if (mode == ZeroMode::kZeroPoint) {
        w.zero[i] = 7;
        w.offset[i] = -21.0f;
      } else {
        w.offset[i] = -5.5f;
      }
      for (DType dtype : {DType::kBF16, DType::kFP16}) {
        const PackedWeight p = prepack(w, dtype);
        ASSERT_EQ(p.params.size(), static_cast<size_t>(48 * (c.bits == 4 ? 4 : 3) * 2));
        const uint16_t second = to_bits(mode == ZeroMode::kZeroPoint ? 7.0f : -5.5f, dtype);
        for (size_t e = 0; e < p.params.size(); ++e) {
          const uint16_t want = static_cast<int64_t>(e) == c.element       ? to_bits(3.0f, dtype)
                                : static_cast<int64_t>(e) == c.element + 1 ? second
                                                                           : 0;
          EXPECT_EQ(p.params[e], want) << dtype_name(dtype) << " element " << e;
        }
      }
    }
}

// ---- quantize_weight -------------------------------------------------------------------------------------------

// W [N, K] with rows of different distributions and magnitudes (Gaussian, heavy-tailed, skewed, uniform, all
// positive), a few input channels 20x larger, one block of equal values and one of zeros.
std::vector<float> random_float_weight(std::mt19937_64& rng, int64_t n, int64_t k) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(n * k));
  std::vector<int64_t> outliers;
  for (int i = 0; i < 3; ++i) outliers.push_back(static_cast<int64_t>(rng() % k));
  for (int64_t r = 0; r < n; ++r) {
    const float row_scale = std::exp(-4.0f + 5.0f * unit(rng));
    for (int64_t c = 0; c < k; ++c) {
      float v = 0.0f;
      switch (r % 5) {
        case 0:
          v = normal(rng);
          break;
        case 1:
          v = normal(rng) * std::exp(normal(rng));
          break;  // heavy tails
        case 2:
          v = std::exp(0.8f * normal(rng)) - 1.0f;
          break;  // skewed
        case 3:
          v = 2.0f * unit(rng) - 1.0f;
          break;  // uniform
        default:
          v = 3.0f + std::fabs(normal(rng));
          break;  // all positive, away from 0
      }
      w[r * k + c] = v * row_scale;
    }
  }
  for (int64_t c : outliers)
    for (int64_t r = 0; r < n; ++r) w[r * k + c] *= 20.0f;
  for (int64_t c = 0; c < std::min<int64_t>(k, 32); ++c) {
    w[0 * k + c] = 0.75f;  // equal values (row 0's first block: every block size >= 32)
    if (n > 1) w[1 * k + c] = 0.0f;
  }
  return w;
}

TEST(LinearQuantize, ErrorAtMostHalfAScale) {
  const int64_t n = 20, k = 256;
  for (int bits : {4, 8})
    for (int64_t block : {int64_t{32}, int64_t{64}, int64_t{128}, k})
      for (ZeroMode mode : {ZeroMode::kOffset, ZeroMode::kZeroPoint}) {
        const uint64_t seed = test::fresh_seed();
        SCOPED_TRACE("bits=" + std::to_string(bits) + " block=" + std::to_string(block) + " " + mode_name(mode) + " " +
                     test::seed_note(seed));
        std::mt19937_64 rng(seed);
        const std::vector<float> w = random_float_weight(rng, n, k);
        const QuantizedWeight q = quantize_weight(w.data(), n, k, bits, block, mode);
        EXPECT_EQ(q.n, n);
        EXPECT_EQ(q.k, k);
        EXPECT_EQ(q.bits, bits);
        EXPECT_EQ(q.block, block);
        EXPECT_EQ(q.zero_mode, mode);
        EXPECT_TRUE(q.k_perm.empty());
        const int64_t blocks = k / block;
        const int levels = (1 << bits) - 1;
        ASSERT_EQ(q.codes.size(), static_cast<size_t>(n * k));
        ASSERT_EQ(q.scale.size(), static_cast<size_t>(n * blocks));
        ASSERT_EQ(q.offset.size(), q.scale.size());
        if (mode == ZeroMode::kZeroPoint) {
          ASSERT_EQ(q.zero.size(), q.scale.size());
        }
        for (uint8_t c : q.codes) ASSERT_LE(c, levels);
        // The canonical form is valid input for prepack.
        EXPECT_NO_THROW(prepack(q, DType::kBF16));
        const std::vector<double> deq = reference::dequantize_weight(q);
        int64_t wrong = 0;
        for (int64_t r = 0; r < n; ++r)
          for (int64_t b = 0; b < blocks; ++b) {
            const size_t p = static_cast<size_t>(r * blocks + b);
            const double scale = q.scale[p];
            ASSERT_GE(scale, 0.0);
            double lo = w[r * k + b * block], hi = lo;
            for (int64_t j = 0; j < block; ++j) {
              lo = std::min<double>(lo, w[r * k + b * block + j]);
              hi = std::max<double>(hi, w[r * k + b * block + j]);
            }
            if (mode == ZeroMode::kOffset) {
              // Documented: offset = min, scale = (max − min) / (2^bits − 1).
              EXPECT_EQ(q.offset[p], static_cast<float>(lo)) << "row " << r << " block " << b;
              EXPECT_NEAR(scale, (hi - lo) / levels, 1e-6 * (hi - lo)) << "row " << r << " block " << b;
            } else {
              ASSERT_LE(q.zero[p], levels);
              EXPECT_GT(scale, 0.0);
              EXPECT_EQ(q.offset[p], -static_cast<float>(q.zero[p]) * q.scale[p]);
            }
            for (int64_t j = 0; j < block; ++j) {
              const int64_t i = r * k + b * block + j;
              const double err = std::fabs(static_cast<double>(w[i]) - deq[i]);
              // Half a step, plus float rounding in the quantizer's own arithmetic.
              const double bound = 0.5 * scale * (1.0 + 1e-5) + 1e-6 * std::max(std::fabs(lo), std::fabs(hi));
              if (mode == ZeroMode::kZeroPoint) {
                // offset = −zero · scale, rounded to float.
                const double exact = (static_cast<double>(q.codes[i]) - q.zero[p]) * scale;
                ASSERT_NEAR(deq[i], exact, 1e-6 * (std::fabs(exact) + q.zero[p] * scale));
              }
              if (err > bound && wrong++ < 5)
                ADD_FAILURE() << "row " << r << " column " << b * block + j << ": w " << w[i] << ", dequantized "
                              << deq[i] << ", scale " << scale;
            }
          }
        EXPECT_EQ(wrong, 0);
        // With blocks of 32, row 0's first block (equal values) is exact in kOffset (scale 0, offset the value), and
        // row 1's (zeros) in both modes.
        if (block == 32) {
          if (mode == ZeroMode::kOffset) {
            EXPECT_EQ(q.scale[0], 0.0f);
            for (int64_t j = 0; j < 32; ++j) EXPECT_EQ(deq[j], 0.75);
          }
          for (int64_t j = 0; j < 32; ++j) EXPECT_EQ(deq[k + j], 0.0);
        }
      }
}

// ---- validation --------------------------------------------------------------------------------------------------

// Runs `call`, which must throw tessera::Error whose message starts with "<op>: '<arg>'" (common/validate.cpp).
void expect_error(const std::function<void()>& call, const std::string& op, const std::string& arg) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming '" << arg << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    const std::string head = op + ": '" + arg + "'";
    EXPECT_EQ(msg.find(head), 0u) << "expected \"" << head << "\" at the start of: " << msg;
  }
}

constexpr const char* kPrepack = "tessera::linear::prepack";

// A valid weight (N 40, K 96, block 32) and one rule broken at a time.
TEST(LinearPrepack, ValidationNamesTheArgument) {
  std::mt19937_64 rng(test::fresh_seed());
  const QuantizedWeight good4 = random_weight(rng, 40, 96, 4, 32, ZeroMode::kOffset, true);
  const QuantizedWeight good8z = random_weight(rng, 40, 96, 8, 32, ZeroMode::kZeroPoint, true);
  ASSERT_NO_THROW(prepack(good4, DType::kBF16));
  ASSERT_NO_THROW(prepack(good4, DType::kFP16));
  ASSERT_NO_THROW(prepack(good8z, DType::kBF16));
  struct Case {
    const char* what;
    const char* arg;
    std::function<void(QuantizedWeight&)> mutate;
    bool zero_point = false;
    DType dtype = DType::kBF16;
  };
  const std::vector<Case> cases = {
      {"bits 5", "w.bits", [](QuantizedWeight& w) { w.bits = 5; }},
      {"bits 0", "w.bits", [](QuantizedWeight& w) { w.bits = 0; }},
      {"block 48", "w.block", [](QuantizedWeight& w) { w.block = 48; }},
      {"block 16", "w.block", [](QuantizedWeight& w) { w.block = 16; }},
      {"block 64 does not divide K 96", "w.block",
       [](QuantizedWeight& w) {
         w.block = 64;
         w.scale.resize(40);
         w.offset.resize(40);
       }},
      {"block 128 > K", "w.block",
       [](QuantizedWeight& w) {
         w.block = 128;
         w.scale.resize(0);
         w.offset.resize(0);
       }},
      {"int4 code 16", "w.codes", [](QuantizedWeight& w) { w.codes[123] = 16; }},
      {"int4 code 255", "w.codes", [](QuantizedWeight& w) { w.codes.back() = 255; }},
      {"codes short", "w.codes", [](QuantizedWeight& w) { w.codes.pop_back(); }},
      {"codes packed two per byte", "w.codes", [](QuantizedWeight& w) { w.codes.resize(40 * 96 / 2); }},
      {"scale short", "w.scale", [](QuantizedWeight& w) { w.scale.pop_back(); }},
      {"scale per tensor", "w.scale", [](QuantizedWeight& w) { w.scale.assign(1, 1.0f); }},
      {"offset long", "w.offset", [](QuantizedWeight& w) { w.offset.push_back(0.0f); }},
      {"k_perm short", "w.k_perm", [](QuantizedWeight& w) { w.k_perm.pop_back(); }},
      {"k_perm repeats a column", "w.k_perm", [](QuantizedWeight& w) { w.k_perm[5] = w.k_perm[6]; }},
      {"k_perm out of range", "w.k_perm", [](QuantizedWeight& w) { w.k_perm[7] = 96; }},
      {"k_perm negative", "w.k_perm", [](QuantizedWeight& w) { w.k_perm[0] = -1; }},
      {"zero_mode 7", "w.zero_mode", [](QuantizedWeight& w) { w.zero_mode = static_cast<ZeroMode>(7); }},
      {"compute_dtype fp32", "compute_dtype", [](QuantizedWeight&) {}, false, DType::kFP32},
      {"compute_dtype fp8", "compute_dtype", [](QuantizedWeight&) {}, false, DType::kFP8E4M3},
      {"int8 zero-point: zero missing", "w.zero", [](QuantizedWeight& w) { w.zero.clear(); }, true},
      {"int8 zero-point: zero short", "w.zero", [](QuantizedWeight& w) { w.zero.pop_back(); }, true},
      {"int8 zero-point: k_perm duplicate", "w.k_perm", [](QuantizedWeight& w) { w.k_perm[1] = w.k_perm[0]; }, true},
      {"int8 zero-point: codes short", "w.codes", [](QuantizedWeight& w) { w.codes.resize(96); }, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    QuantizedWeight w = c.zero_point ? good8z : good4;
    c.mutate(w);
    expect_error([&] { prepack(w, c.dtype); }, kPrepack, c.arg);
  }
  // An int4 zero point of 16 is not a code.
  QuantizedWeight z4 = random_weight(rng, 40, 96, 4, 32, ZeroMode::kZeroPoint, false);
  ASSERT_NO_THROW(prepack(z4, DType::kFP16));
  z4.zero[3] = 16;
  expect_error([&] { prepack(z4, DType::kFP16); }, kPrepack, "w.zero");
  // N 0.
  QuantizedWeight empty = good4;
  empty.n = 0;
  empty.codes.clear();
  empty.scale.clear();
  empty.offset.clear();
  expect_error([&] { prepack(empty, DType::kBF16); }, kPrepack, "w");
}

TEST(LinearQuantize, ValidationNamesTheArgument) {
  const std::vector<float> w(40 * 96, 1.0f);
  const char* op = "tessera::linear::quantize_weight";
  expect_error([&] { quantize_weight(w.data(), 40, 96, 5, 32, ZeroMode::kOffset); }, op, "bits");
  expect_error([&] { quantize_weight(w.data(), 40, 96, 4, 64, ZeroMode::kOffset); }, op, "block");
  expect_error([&] { quantize_weight(w.data(), 40, 96, 4, 0, ZeroMode::kZeroPoint); }, op, "block");
  expect_error([&] { quantize_weight(nullptr, 40, 96, 4, 32, ZeroMode::kOffset); }, op, "w");
}

// ---- select_config ---------------------------------------------------------------------------------------------

TEST(LinearSelectConfig, ValidAndDeterministicOverTheShapeGrid) {
  using detail::LinearConfig;
  using detail::LinearShape;
  const int64_t ms[] = {1,  2,  3,  4,   5,   7,   8,   9,   12,  15,  16,  17,   24,   31,   32,   33,  48,
                        63, 64, 65, 100, 127, 128, 129, 200, 256, 257, 512, 1000, 1024, 2048, 4096, 8192};
  const int64_t dims[] = {4096, 14336, 7168, 2048, 96, 4160};
  int64_t checked = 0;
  for (int sms : {132, 78})
    for (int bits : {4, 8})
      for (int64_t n : dims)
        for (int64_t k : dims)
          for (int64_t block : {int64_t{32}, int64_t{128}, k}) {
            if (k % block != 0) continue;
            for (int64_t m : ms) {
              LinearShape s;
              s.m = m;
              s.n = n;
              s.k = k;
              s.bits = bits;
              s.block = block;
              s.num_sms = sms;
              const LinearConfig c = detail::select_config(s);
              SCOPED_TRACE("M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k) +
                           " bits=" + std::to_string(bits) + " block=" + std::to_string(block) +
                           " SMs=" + std::to_string(sms) + ": bn " + std::to_string(c.bn) + " splits " +
                           std::to_string(c.splits) + " stages " + std::to_string(c.stages) + " grid " +
                           std::to_string(c.n_tiles) + " x " + std::to_string(c.m_tiles));
              EXPECT_TRUE(c.bn == 8 || c.bn == 16 || c.bn == 32 || c.bn == 64 || c.bn == 128 || c.bn == 256);
              EXPECT_GE(c.splits, 1);
              EXPECT_GE(c.stages, 2);  // a ring: one stage loading while one is consumed
              EXPECT_LE(c.stages, detail::kMaxStages);
              // The grid covers the output, with no CTA past it.
              EXPECT_GE(c.n_tiles * detail::kGemmRows, n);
              EXPECT_LT((c.n_tiles - 1) * detail::kGemmRows, n);
              EXPECT_GE(c.m_tiles * c.bn, m);
              EXPECT_LT((c.m_tiles - 1) * c.bn, m);
              // Every split gets at least one k-block.
              EXPECT_LE(c.splits, (k + detail::kKBlock - 1) / detail::kKBlock);
              // Shared memory within the kernel's budget, and Hopper's 227 KB per block in any case.
              EXPECT_LE(detail::gemm_smem_bytes(s, c), static_cast<size_t>(detail::kGemmSmemBudget));
              // The staged epilogue's tile fits in the ring.
              EXPECT_GE(detail::gemm_smem_bytes(s, c) - 1024,
                        static_cast<size_t>(detail::epilogue_tile_bytes(c.bn)));
              EXPECT_LE(detail::gemm_smem_bytes(s, c), 227u * 1024u);
              EXPECT_TRUE(std::isfinite(c.predicted_us));
              EXPECT_GT(c.predicted_us, 0.0);
              EXPECT_EQ(detail::partial_bytes(s, c),
                        c.splits > 1 ? static_cast<size_t>(c.splits) * static_cast<size_t>(m * n) * sizeof(float)
                                     : size_t{0});
              // Pure: the same shape gives the same choice.
              const LinearConfig again = detail::select_config(s);
              EXPECT_EQ(again.bn, c.bn);
              EXPECT_EQ(again.splits, c.splits);
              EXPECT_EQ(again.stages, c.stages);
              EXPECT_EQ(again.n_tiles, c.n_tiles);
              EXPECT_EQ(again.m_tiles, c.m_tiles);
              EXPECT_EQ(again.predicted_us, c.predicted_us);
              ++checked;
              if (::testing::Test::HasFailure()) return;  // one shape's failures are enough to read
            }
          }
  EXPECT_GT(checked, 2 * 2 * 6 * 6 * static_cast<int64_t>(std::size(ms)));
}

// Token tiles run along grid.y (<= 65535): at M where small tiles would need more, only tiles that fit are chosen;
// past 65535 tiles of 256 rows nothing fits and the choice says so (m_tiles > 65535), which linear's M rule and
// conv's path choice refuse.
TEST(LinearSelectConfig, TokenTilesFitTheGrid) {
  for (const bool wave_tiles : {false, true})
    for (const int64_t m : {int64_t{65535} * 8 + 1, int64_t{65535} * 64 + 1, int64_t{65535} * 128 + 7,
                            detail::kMaxLinearM, detail::kMaxLinearM + 1}) {
      detail::LinearShape s;
      s.m = m;
      s.n = 4096;
      s.k = 4096;
      s.min_bn = wave_tiles ? 64 : 8;
      s.wave_tiles = wave_tiles;
      const detail::LinearConfig c = detail::select_config(s);
      SCOPED_TRACE("M=" + std::to_string(m) + " bn " + std::to_string(c.bn));
      EXPECT_GE(c.m_tiles * c.bn, m);
      if (m <= detail::kMaxLinearM) EXPECT_LE(c.m_tiles, detail::kMaxGridY);
      else EXPECT_GT(c.m_tiles, detail::kMaxGridY);
    }
}

TEST(LinearSelectConfig, Llama8BMlpUpAtOneToken) {
  detail::LinearShape s;
  s.m = 1;
  s.n = 14336;
  s.k = 4096;
  s.bits = 4;
  s.block = 128;
  s.num_sms = 132;
  const detail::LinearConfig c = detail::select_config(s);
  EXPECT_TRUE(std::isfinite(c.predicted_us));
  EXPECT_GT(c.predicted_us, 0.0);
  EXPECT_EQ(c.bn, 8);  // the smallest token tile: a larger one would only stream rows that do not exist
  EXPECT_EQ(c.m_tiles, 1);
}

}  // namespace
}  // namespace tessera::linear
