// The MoE layer's CPU reference (reference/moe_layer_reference.h): the two roundings it models (e4m3 with
// saturation, bf16) against the bit-level host conversions, a layer small enough to compute by hand, the routing
// rules (dropped copies, residual), the activation quantization rules (block-wise scales stay in their 128-column
// block, per-tensor scales saturate), and that the result does not depend on the thread count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/moe_layer_reference.h"
#include "reference/moe_reference.h"

namespace tessera::reference {
namespace {

using moe::WeightFormat;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The finite non-negative e4m3 values in increasing order: codes 0x00 .. 0x7E (0x7F is NaN).
std::vector<double> e4m3_positive_values() {
  std::vector<double> v;
  for (int c = 0; c <= 0x7E; ++c) v.push_back(host::e4m3_to_f32(static_cast<uint8_t>(c)));
  return v;
}

// Bitwise equality of two doubles (tells -0 from 0; NaN equals NaN).
bool same_bits(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// ---------------------------------------------------------------------------------------------------------------
// Roundings

TEST(MoeLayerReference, RoundE4m3KeepsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    const float v = host::e4m3_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(v)) continue;
    EXPECT_TRUE(same_bits(round_e4m3(v), v)) << "code 0x" << std::hex << c << " value " << v << " -> " << round_e4m3(v);
  }
}

TEST(MoeLayerReference, RoundE4m3TiesGoToTheEvenCode) {
  const std::vector<double> v = e4m3_positive_values();
  for (std::size_t c = 0; c + 1 < v.size(); ++c) {
    const double lo = v[c], hi = v[c + 1];
    const double mid = 0.5 * (lo + hi);          // exact in double
    const double even = (c % 2 == 0) ? lo : hi;  // the code's last bit is the mantissa's last bit
    SCOPED_TRACE("between codes " + std::to_string(c) + " (" + std::to_string(lo) + ") and " + std::to_string(c + 1) +
                 " (" + std::to_string(hi) + ")");
    EXPECT_EQ(round_e4m3(mid), even);
    EXPECT_EQ(round_e4m3(-mid), -even);
    EXPECT_EQ(round_e4m3(std::nextafter(mid, 0.0)), lo);
    EXPECT_EQ(round_e4m3(std::nextafter(mid, kInf)), hi);
    EXPECT_EQ(round_e4m3(-std::nextafter(mid, kInf)), -hi);
    EXPECT_EQ(round_e4m3(lo + 0.25 * (hi - lo)), lo);
    EXPECT_EQ(round_e4m3(lo + 0.75 * (hi - lo)), hi);
  }
}

TEST(MoeLayerReference, RoundE4m3SaturatesAndFlushesTinyValues) {
  // Past the largest finite value (448 = 0x7E), including what plain RNE would send to 480 or NaN.
  for (double big : {448.0, std::nextafter(448.0, kInf), 460.0, 464.0, 470.0, 480.0, 1e4, 1e300, kInf}) {
    EXPECT_EQ(round_e4m3(big), 448.0) << big;
    EXPECT_EQ(round_e4m3(-big), -448.0) << -big;
  }
  EXPECT_TRUE(std::isnan(round_e4m3(std::numeric_limits<double>::quiet_NaN())));
  // Subnormals: spacing 2^-9; half of the smallest one is a tie that goes to the even code 0.
  const double sub = std::ldexp(1.0, -9);
  EXPECT_EQ(round_e4m3(sub), sub);
  EXPECT_TRUE(same_bits(round_e4m3(0.5 * sub), 0.0));
  EXPECT_TRUE(same_bits(round_e4m3(-0.5 * sub), -0.0));
  EXPECT_EQ(round_e4m3(std::nextafter(0.5 * sub, 1.0)), sub);
  EXPECT_EQ(round_e4m3(1.5 * sub), 2 * sub);  // tie between codes 1 and 2
  EXPECT_EQ(round_e4m3(2.5 * sub), 2 * sub);  // tie between codes 2 and 3
  for (double tiny : {1e-30, 1e-300, 4.9e-324}) {
    EXPECT_TRUE(same_bits(round_e4m3(tiny), 0.0)) << tiny;
    EXPECT_TRUE(same_bits(round_e4m3(-tiny), -0.0)) << -tiny;
  }
  EXPECT_TRUE(same_bits(round_e4m3(-0.0), -0.0));
}

TEST(MoeLayerReference, RoundBf16MatchesTheBitConversionOnFloats) {
  // On a float input the fp32 → bf16 bit conversion is exact RNE: every bf16 value maps to itself, and random
  // floats of every exponent (subnormals and overflow included) agree.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = host::bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(v)) continue;
    ASSERT_TRUE(same_bits(round_bf16(v), v)) << "bf16 0x" << std::hex << h;
  }
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  int64_t checked = 0;
  for (int i = 0; i < 1000000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    if (i % 4 == 0) bits = (bits & 0xFFFF0000u) | 0x8000u;  // a tie
    const float f = host::bits_f32(bits);
    if (std::isnan(f)) continue;
    const double want = host::bf16_to_f32(host::f32_to_bf16(f));
    ASSERT_TRUE(same_bits(round_bf16(f), want)) << "float bits 0x" << std::hex << bits;
    ++checked;
  }
  EXPECT_GT(checked, 900000);
}

TEST(MoeLayerReference, RoundBf16OnDoublesTiesAndOverflow) {
  // A double just past a tie: rounding to fp32 first would land on the tie and then on the even neighbour (1).
  EXPECT_EQ(round_bf16(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30)), 1.0 + std::ldexp(1.0, -7));
  EXPECT_EQ(round_bf16(1.0 + std::ldexp(1.0, -8) - std::ldexp(1.0, -40)), 1.0);
  EXPECT_EQ(round_bf16(1.0 + std::ldexp(1.0, -8)), 1.0);                            // tie, even below
  EXPECT_EQ(round_bf16(1.0 + 3 * std::ldexp(1.0, -8)), 1.0 + std::ldexp(1.0, -6));  // tie, even above
  EXPECT_EQ(round_bf16(-(1.0 + 3 * std::ldexp(1.0, -8))), -(1.0 + std::ldexp(1.0, -6)));
  EXPECT_EQ(round_bf16(0.7310585786300049), 0.73046875);  // silu(1): 187.15 / 256
  // Overflow: the largest finite bf16 is (2 - 2^-7) 2^127; half an ulp past it is a tie that rounds to inf.
  const double max = std::ldexp(255.0, 120), half_ulp = std::ldexp(1.0, 119);
  EXPECT_EQ(round_bf16(max), max);
  EXPECT_EQ(round_bf16(max + half_ulp * 0.99), max);
  EXPECT_EQ(round_bf16(max + half_ulp), kInf);
  EXPECT_EQ(round_bf16(-max - half_ulp), -kInf);
  EXPECT_EQ(round_bf16(1e300), kInf);
  EXPECT_EQ(round_bf16(kInf), kInf);
  EXPECT_TRUE(std::isnan(round_bf16(std::numeric_limits<double>::quiet_NaN())));
  // Subnormals: spacing 2^-133, ties to even; far below, a signed zero.
  const double sub = std::ldexp(1.0, -133);
  EXPECT_EQ(round_bf16(sub), sub);
  EXPECT_TRUE(same_bits(round_bf16(0.5 * sub), 0.0));
  EXPECT_EQ(round_bf16(std::nextafter(0.5 * sub, 1.0)), sub);
  EXPECT_EQ(round_bf16(1.5 * sub), 2 * sub);
  EXPECT_TRUE(same_bits(round_bf16(-1e-300), -0.0));
  // Random doubles against an independent rounding: the nearest of the two bf16 neighbours found by bit stepping.
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  std::uniform_int_distribution<int> expo(-140, 127);
  for (int i = 0; i < 200000; ++i) {
    const double v = std::ldexp(mant(rng), expo(rng));
    // bf16 neighbours: truncate the fp32 image toward zero (exact when float(v) <= v), then step.
    float f = static_cast<float>(v);
    if (static_cast<double>(f) > v) f = std::nextafter(f, 0.0f);
    const uint16_t lo_bits = static_cast<uint16_t>(host::f32_bits(f) >> 16);
    // Above the largest finite bf16 the next step is 2^128, which rounds on to inf.
    const double lo = host::bf16_to_f32(lo_bits),
                 hi = lo_bits == 0x7F7F ? std::ldexp(1.0, 128) : host::bf16_to_f32(static_cast<uint16_t>(lo_bits + 1));
    const double d_lo = v - lo, d_hi = hi - v;
    double want = d_lo < d_hi ? lo : d_hi < d_lo ? hi : ((lo_bits & 1) ? hi : lo);
    if (want == std::ldexp(1.0, 128)) want = kInf;
    ASSERT_EQ(round_bf16(v), want) << "v = " << v;
    ASSERT_EQ(round_bf16(-v), -want) << "v = " << -v;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The layer

struct Layer {
  MoeLayerRefProblem p;
  MoeLayerRefInputs in;
};

// A layer of random values as models hold them: x bf16 ~ N(0, 1); weights ~ N(0, 1/K) on the format's grid (fp8
// codes times a power-of-two scale, or bf16), so that h ~ N(0, 1); distinct experts per token; fp32 routing weights.
Layer random_layer(std::mt19937_64& rng, WeightFormat format, int64_t T, int64_t H, int64_t I, int G, int slots,
                   bool residual) {
  Layer L;
  L.p = {T, H, I, G, slots, format};
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto on_grid = [&](double v) {
    return format == WeightFormat::kBF16 ? round_bf16(v) : round_e4m3(v * 256.0) / 256.0;
  };
  L.in.x.resize(T * H);
  for (double& v : L.in.x) v = round_bf16(normal(rng));
  L.in.w13.resize(G * 2 * I * H);
  for (double& v : L.in.w13) v = on_grid(normal(rng) / std::sqrt(static_cast<double>(H)));
  L.in.w2.resize(G * H * I);
  for (double& v : L.in.w2) v = on_grid(normal(rng) / std::sqrt(static_cast<double>(I)));
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  std::vector<int32_t> experts(G);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int j = 0; j < slots; ++j) {
      L.in.ids.push_back(experts[j % G]);
      L.in.weights.push_back(weight(rng));
    }
  }
  // Per-tensor activation scales as calibration would set them, from the largest values seen: |x| <= 8 and
  // |silu(g)·u| <= 32 are not saturated (saturation has its own test).
  L.in.a13_scale = 8.0 / 448.0;
  L.in.a2_scale = 32.0 / 448.0;
  if (residual) {
    L.in.residual.resize(T * H);
    for (double& v : L.in.residual) v = round_bf16(normal(rng));
  }
  return L;
}

double rel_frobenius(const std::vector<double>& got, const std::vector<double>& want) {
  double e2 = 0.0, r2 = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    e2 += (got[i] - want[i]) * (got[i] - want[i]);
    r2 += want[i] * want[i];
  }
  return std::sqrt(e2 / r2);
}

// Every element equal bit for bit; reports the first difference.
void expect_bitwise_equal(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i], b[i])) {
      ADD_FAILURE() << what << " differs at " << i << ": " << a[i] << " vs " << b[i];
      return;
    }
}

// Two experts with h = [x, x] (identity gate and up projections), so a = Q2(silu(x)·x); expert 0 has w2 = 2·Id
// and expert 1 w2 = -Id. With weights 0.5 and 0.25: y = 0.5·2a - 0.25a = 0.75a, mag = 1.25|a|.
TEST(MoeLayerReference, HandComputedBf16Layer) {
  const int64_t T = 3, H = 128, I = 128;
  Layer L;
  L.p = {T, H, I, 2, 2, WeightFormat::kBF16};
  L.in.w13.assign(2 * 2 * I * H, 0.0);
  L.in.w2.assign(2 * H * I, 0.0);
  for (int e = 0; e < 2; ++e)
    for (int64_t i = 0; i < I; ++i) {
      L.in.w13[(e * 2 * I + i) * H + i] = 1.0;
      L.in.w13[(e * 2 * I + I + i) * H + i] = 1.0;
      L.in.w2[(e * H + i) * I + i] = e == 0 ? 2.0 : -1.0;
    }
  const double xs[] = {0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 4.0, -8.0, 0.1015625, -30.0, 3.140625};
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) L.in.x.push_back(xs[(t * 5 + c) % 11] * (t == 2 ? -1.0 : 1.0));
  for (int64_t t = 0; t < T; ++t) {
    // Token 1 lists its experts the other way round: the slot order changes nothing here.
    L.in.ids.insert(L.in.ids.end(), {t == 1 ? 1 : 0, t == 1 ? 0 : 1});
    L.in.weights.insert(L.in.weights.end(), {t == 1 ? 0.25 : 0.5, t == 1 ? 0.5 : 0.25});
  }
  const MoeLayerRef model = moe_layer(L.p, L.in, MoeLayerRefMode::kModelStorage);
  const MoeLayerRef exact = moe_layer(L.p, L.in, MoeLayerRefMode::kExact);
  ASSERT_EQ(model.y.size(), static_cast<std::size_t>(T * H));
  ASSERT_EQ(model.mag.size(), static_cast<std::size_t>(T * H));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      const double x = L.in.x[t * H + c];
      const double act = silu(x) * x;
      const double a = round_bf16(act);
      SCOPED_TRACE("t " + std::to_string(t) + " col " + std::to_string(c) + " x " + std::to_string(x));
      EXPECT_DOUBLE_EQ(model.y[t * H + c], 0.75 * a);
      EXPECT_DOUBLE_EQ(model.mag[t * H + c], 1.25 * std::fabs(a));
      EXPECT_NEAR(exact.y[t * H + c], 0.75 * act, 1e-14 * std::fabs(act));
      EXPECT_NEAR(exact.mag[t * H + c], 1.25 * std::fabs(act), 1e-14 * std::fabs(act));
    }
  // By hand: silu(1) = 0.7310586 -> bf16 0.73046875; 2·silu(2) = 3.5231883 -> 3.515625; silu(-1)·(-1) = 0.2689414 ->
  // 0.26953125 (x at column c of token 0 is xs[c % 11]).
  EXPECT_EQ(model.y[1], 0.75 * 0.73046875);
  EXPECT_EQ(model.y[3], 0.75 * 3.515625);
  EXPECT_EQ(model.y[2], 0.75 * 0.26953125);
  EXPECT_EQ(model.y[0], 0.0);
}

// Rows 0..I-1 of w13 are the gate projection and rows I..2I-1 the up projection: with gate = Id and up = 3·Id,
// a = silu(x)·3x, which the swapped order (silu(3x)·x) does not give for any x here.
TEST(MoeLayerReference, GateRowsComeFirstInW13) {
  const int64_t H = 128, I = 128;
  Layer L;
  L.p = {1, H, I, 1, 1, WeightFormat::kBF16};
  L.in.w13.assign(2 * I * H, 0.0);
  L.in.w2.assign(H * I, 0.0);
  for (int64_t i = 0; i < I; ++i) {
    L.in.w13[i * H + i] = 1.0;
    L.in.w13[(I + i) * H + i] = 3.0;
    L.in.w2[i * I + i] = 1.0;
  }
  for (int64_t c = 0; c < H; ++c)
    L.in.x.push_back(round_bf16(0.25 + 0.03125 * static_cast<double>(c % 64) - (c >= 64 ? 3.0 : 0.0)));
  L.in.ids = {0};
  L.in.weights = {1.0};
  const MoeLayerRef exact = moe_layer(L.p, L.in, MoeLayerRefMode::kExact);
  for (int64_t c = 0; c < H; ++c) {
    const double x = L.in.x[c];
    const double want = silu(x) * 3.0 * x, swapped = silu(3.0 * x) * x;
    ASSERT_GT(std::fabs(want - swapped), 1e-3 * std::fabs(want)) << "column " << c << " cannot tell the orders apart";
    EXPECT_NEAR(exact.y[c], want, 1e-14 * std::fabs(want)) << "column " << c;
  }
}

TEST(MoeLayerReference, DroppedIdsContributeNothing) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  for (WeightFormat f : {WeightFormat::kFP8Blockwise, WeightFormat::kFP8PerTensor, WeightFormat::kBF16}) {
    SCOPED_TRACE(moe::weight_format_name(f));
    const int G = 4, slots = 4;
    const int64_t T = 6, H = 256, I = 128;
    Layer full = random_layer(rng, f, T, H, I, G, slots, /*residual=*/true);
    // Drop slots 1 and 3 of every token (ids -1, G, G + 7, INT32_MIN, with non-zero weights), and every slot of the
    // last token; the reference with the kept slots only must be equal bit for bit.
    const int32_t dropped_ids[] = {-1, G, G + 7, std::numeric_limits<int32_t>::min()};
    Layer kept = full;
    kept.p.slots = 2;
    kept.in.ids.clear();
    kept.in.weights.clear();
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < slots; ++j) {
        const int64_t k = t * slots + j;
        if (j % 2 == 1 || t == T - 1) {
          full.in.ids[k] = dropped_ids[(t + j) % 4];
          full.in.weights[k] = 0.75;
        }
        if (j % 2 == 0) {
          kept.in.ids.push_back(t == T - 1 ? -1 : full.in.ids[k]);
          kept.in.weights.push_back(full.in.weights[k]);
        }
      }
    for (MoeLayerRefMode mode : {MoeLayerRefMode::kModelStorage, MoeLayerRefMode::kExact}) {
      const MoeLayerRef a = moe_layer(full.p, full.in, mode), b = moe_layer(kept.p, kept.in, mode);
      expect_bitwise_equal(a.y, b.y, "y");
      expect_bitwise_equal(a.mag, b.mag, "mag");
      // The token with every copy dropped: y is its residual, mag 0.
      for (int64_t c = 0; c < H; ++c) {
        EXPECT_EQ(a.y[(T - 1) * H + c], full.in.residual[(T - 1) * H + c]);
        EXPECT_EQ(a.mag[(T - 1) * H + c], 0.0);
      }
      // And the other tokens do get something from their kept copies.
      EXPECT_GT(std::fabs(a.y[0] - full.in.residual[0]), 0.0);
    }
  }
}

TEST(MoeLayerReference, ResidualIsAddedAndLeftOutOfMag) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  Layer with = random_layer(rng, WeightFormat::kFP8Blockwise, 5, 256, 256, 3, 2, /*residual=*/true);
  Layer without = with;
  without.in.residual.clear();
  for (MoeLayerRefMode mode : {MoeLayerRefMode::kModelStorage, MoeLayerRefMode::kExact}) {
    const MoeLayerRef a = moe_layer(with.p, with.in, mode), b = moe_layer(without.p, without.in, mode);
    int64_t changed = 0;
    for (std::size_t i = 0; i < a.y.size(); ++i) {
      ASSERT_EQ(a.y[i], b.y[i] + with.in.residual[i]) << i;
      changed += a.y[i] != b.y[i];
    }
    EXPECT_GT(changed, static_cast<int64_t>(a.y.size()) / 2);
    expect_bitwise_equal(a.mag, b.mag, "mag");
  }
}

// Quantizing the activations costs what fp8 (3 fraction bits, twice) or bf16 (7 bits) suggest, never nothing; and in
// exact mode mag bounds |y - residual| (triangle inequality).
TEST(MoeLayerReference, ExactAndModelStorageDifferByTheQuantizationError) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    WeightFormat f;
    double lo, hi;
  };
  // One rounding to e4m3 (3 fraction bits) costs a relative RMS of 2^-3/sqrt(12) · 0.74 ≈ 2.7% (0.74: RMS of 1/m over
  // the mantissa m); x's error reaches g and u, silu·u's own rounding adds another: about 4.5% in y over 300 seeds
  // (3.9% .. 5.0%). bf16 (7 bits): 0.17% per rounding of h (g and u), a and o: about 0.35% (0.32% .. 0.38%).
  for (const Case& c : {Case{WeightFormat::kFP8Blockwise, 2.5e-2, 6.5e-2},
                        Case{WeightFormat::kFP8PerTensor, 2.5e-2, 6.5e-2}, Case{WeightFormat::kBF16, 1.5e-3, 6e-3}}) {
    SCOPED_TRACE(moe::weight_format_name(c.f));
    const Layer L = random_layer(rng, c.f, 16, 512, 256, 5, 3, /*residual=*/false);
    const MoeLayerRef model = moe_layer(L.p, L.in, MoeLayerRefMode::kModelStorage);
    const MoeLayerRef exact = moe_layer(L.p, L.in, MoeLayerRefMode::kExact);
    const double err = rel_frobenius(model.y, exact.y);
    std::printf("[          ] %s: relative Frobenius difference model storage vs exact %.3e\n",
                moe::weight_format_name(c.f), err);
    EXPECT_GT(err, c.lo);
    EXPECT_LT(err, c.hi);
    for (std::size_t i = 0; i < exact.y.size(); ++i) ASSERT_LE(std::fabs(exact.y[i]), exact.mag[i] * (1 + 1e-12)) << i;
    // The two magnitudes differ by the quantization of a only.
    EXPECT_LT(rel_frobenius(model.mag, exact.mag), c.hi);
  }
}

// One huge element (2^24) in block 0 of a row makes that block's scale 2^24/448: the block's other values (|x| <= 2)
// fall below half the smallest e4m3 subnormal and become 0, while the other blocks keep their own scales and their
// exact values. The layer reads x through selectors: gate and up rows i pick column k(i) (h = [xq_k, xq_k]), and
// w2 = Id, so y_i = Q2(silu(xq_k)·xq_k). Readouts of block 0 sit in the first 128-block of I, the others in the
// second, so that their Q2 scales are separate too.
TEST(MoeLayerReference, BlockwiseScaleDistortsOnlyItsOwnBlock) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int64_t H = 512, I = 256;
  Layer L;
  L.p = {2, H, I, 1, 1, WeightFormat::kFP8Blockwise};
  std::uniform_real_distribution<double> mag(0.5, 2.0);
  std::vector<double> row(H);
  for (double& v : row) v = round_bf16(mag(rng) * (rng() % 2 ? 1.0 : -1.0));
  L.in.x = row;
  row[0] = std::ldexp(1.0, 24);
  L.in.x.insert(L.in.x.end(), row.begin(), row.end());  // token 1: the same row with the huge element
  const auto column = [&](int64_t i) { return i < 128 ? 1 + i % 127 : 128 + 3 * (i - 128); };
  L.in.w13.assign(2 * I * H, 0.0);
  L.in.w2.assign(H * I, 0.0);
  for (int64_t i = 0; i < I; ++i) {
    L.in.w13[i * H + column(i)] = 1.0;
    L.in.w13[(I + i) * H + column(i)] = 1.0;
    L.in.w2[i * I + i] = 1.0;
  }
  L.in.ids = {0, 0};
  L.in.weights = {1.0, 1.0};
  const MoeLayerRef r = moe_layer(L.p, L.in, MoeLayerRefMode::kModelStorage);
  for (int64_t n = 0; n < H; ++n) {
    const double plain = r.y[n], huge = r.y[H + n];
    SCOPED_TRACE("output " + std::to_string(n));
    if (n >= I) {
      EXPECT_EQ(plain, 0.0);
      EXPECT_EQ(huge, 0.0);
      continue;
    }
    const double x = row[column(n)];
    const double want = silu(x) * x;  // within e4m3 (x, amplified by up to 2.5, then a) and bf16 roundings
    EXPECT_NEAR(plain, want, 0.3 * std::fabs(want)) << "x " << x;
    if (n < 128)
      EXPECT_EQ(huge, 0.0) << "x " << x << " in the huge element's block";
    else
      EXPECT_TRUE(same_bits(huge, plain))
          << "x " << x << " outside the huge element's block: " << huge << " vs " << plain;
  }
}

// kFP8PerTensor: x / a13_scale and silu·u / a2_scale saturate at ±448 codes. With a13_scale = 2^-4, |x| >= 28
// becomes ±28; the gate row reads sign(x)·x so that g = |xq| and act = silu(|xq|)·xq ≈ ±784 saturates Q2 (a2_scale
// 1) to ±448. Smaller values go through unsaturated (x = 1: act 0.731 -> 0.75).
TEST(MoeLayerReference, PerTensorScalesSaturate) {
  const int64_t H = 128, I = 128;
  Layer L;
  L.p = {1, H, I, 1, 1, WeightFormat::kFP8PerTensor};
  L.in.a13_scale = 0.0625;
  L.in.a2_scale = 1.0;
  const double xs[] = {1.0, 100.0, -1000.0, 28.0, -30.0, 20.0, 0.5, -3.0, 65536.0, 0.0};
  for (int64_t c = 0; c < H; ++c) L.in.x.push_back(xs[c % 10]);
  L.in.w13.assign(2 * I * H, 0.0);
  L.in.w2.assign(H * I, 0.0);
  for (int64_t i = 0; i < I; ++i) {
    L.in.w13[i * H + i] = L.in.x[i] < 0 ? -1.0 : 1.0;
    L.in.w13[(I + i) * H + i] = 1.0;
    L.in.w2[i * I + i] = 1.0;
  }
  L.in.ids = {0};
  L.in.weights = {0.5};
  const MoeLayerRef r = moe_layer(L.p, L.in, MoeLayerRefMode::kModelStorage);
  for (int64_t n = 0; n < H; ++n) {
    const double x = L.in.x[n];
    const double xq = round_e4m3(x / 0.0625) * 0.0625;
    const double act = silu(std::fabs(xq)) * xq;
    const double want = 0.5 * round_bf16(round_e4m3(act));
    SCOPED_TRACE("x " + std::to_string(x));
    EXPECT_EQ(r.y[n], want);
    if (std::fabs(x) >= 28.0) EXPECT_EQ(r.y[n], std::copysign(0.5 * 448.0, x));
  }
  EXPECT_EQ(r.y[0], 0.5 * 0.75);   // x = 1
  EXPECT_EQ(r.y[5], 0.5 * 384.0);  // x = 20 (code 320): act just under 400, the midpoint of 384 and 416
}

TEST(MoeLayerReference, ResultsDoNotDependOnTheThreadCount) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  for (WeightFormat f : {WeightFormat::kFP8Blockwise, WeightFormat::kFP8PerTensor, WeightFormat::kBF16}) {
    SCOPED_TRACE(moe::weight_format_name(f));
    Layer L = random_layer(rng, f, 37, 256, 128, 9, 3, /*residual=*/true);
    L.in.ids[4] = -1;
    for (MoeLayerRefMode mode : {MoeLayerRefMode::kModelStorage, MoeLayerRefMode::kExact}) {
      const MoeLayerRef one = moe_layer(L.p, L.in, mode, 1);
      for (int threads : {4, 0}) {
        const MoeLayerRef many = moe_layer(L.p, L.in, mode, threads);
        expect_bitwise_equal(one.y, many.y, "y with " + std::to_string(threads) + " threads");
        expect_bitwise_equal(one.mag, many.mag, "mag with " + std::to_string(threads) + " threads");
      }
    }
  }
}

// The given-h path (the GPU tests feed the GPU's own h): the model's own h given back reproduces the model bit for
// bit; a changed h of one copy changes only that copy's token, by exactly what the model computes from it.
// y after one token's input was changed: that token's row moved by more than min_rel (relative Frobenius), every other
// row kept its bits. Rows of `hidden` values.
void expect_only_token_moved(const std::vector<double>& before, const std::vector<double>& after, int64_t hidden,
                             int64_t token, double min_rel) {
  ASSERT_EQ(before.size(), after.size());
  for (int64_t t = 0; t * hidden < static_cast<int64_t>(before.size()); ++t) {
    const std::vector<double> a(before.begin() + t * hidden, before.begin() + (t + 1) * hidden);
    const std::vector<double> b(after.begin() + t * hidden, after.begin() + (t + 1) * hidden);
    if (t == token)
      EXPECT_GT(rel_frobenius(b, a), min_rel) << "token " << t << " must follow its changed input";
    else
      expect_bitwise_equal(a, b, "token " + std::to_string(t));
  }
}

TEST(MoeLayerReference, GivenHReplacesTheFirstGemm) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  for (WeightFormat f : {WeightFormat::kFP8Blockwise, WeightFormat::kFP8PerTensor, WeightFormat::kBF16}) {
    SCOPED_TRACE(moe::weight_format_name(f));
    Layer L = random_layer(rng, f, 5, 256, 128, 4, 3, /*residual=*/true);
    L.in.ids[4] = -1;  // a dropped copy: its h is kept as zeros and never read
    L.in.keep_h = true;
    const MoeLayerRef model = moe_layer(L.p, L.in, MoeLayerRefMode::kModelStorage);
    ASSERT_EQ(model.h.size(), static_cast<std::size_t>(5 * 3 * 2 * 128));
    for (int64_t i = 0; i < 2 * 128; ++i) ASSERT_EQ(model.h[4 * 2 * 128 + i], 0.0);
    for (double v : model.h) ASSERT_EQ(v, round_bf16(v)) << "the model's h is stored as bf16";
    Layer given = L;
    given.in.h = model.h;
    const MoeLayerRef same = moe_layer(given.p, given.in, MoeLayerRefMode::kModelStorage);
    expect_bitwise_equal(model.y, same.y, "y from the model's own h");
    expect_bitwise_equal(model.h, same.h, "h kept");
    // Copy (t 2, slot 1): its gate half scaled by 4 (exact in bf16). Other tokens keep their bits.
    given.in.h = model.h;
    const int64_t copy = 2 * 3 + 1;
    for (int64_t i = 0; i < 128; ++i) given.in.h[copy * 256 + i] *= 4.0;
    const MoeLayerRef moved = moe_layer(given.p, given.in, MoeLayerRefMode::kModelStorage);
    expect_only_token_moved(model.y, moved.y, 256, 2, 1e-2);
  }
}

// The activation each copy's second GEMM reads, derived by hand from the model's h (Q2 of moe_layer.h): silu(g)·u,
// then e4m3 codes times the block scale (block-wise: fp8_block_scale of the block's amax), the static scale, or bf16.
std::vector<double> activation_from_h(const Layer& L, const std::vector<double>& h) {
  const int64_t I = L.p.intermediate, copies = L.p.tokens * L.p.slots;
  std::vector<double> a(static_cast<std::size_t>(copies * I));
  for (int64_t c = 0; c < copies; ++c) {
    const double* hc = &h[c * 2 * I];
    double* ac = &a[c * I];
    for (int64_t i = 0; i < I; ++i) ac[i] = hc[i] / (1.0 + std::exp(-hc[i])) * hc[I + i];
    for (int64_t b0 = 0; b0 < I; b0 += 128) {
      double amax = 0.0;
      for (int64_t i = b0; i < b0 + 128; ++i) amax = std::max(amax, std::fabs(ac[i]));
      for (int64_t i = b0; i < b0 + 128; ++i) {
        if (L.p.format == WeightFormat::kBF16) {
          ac[i] = round_bf16(ac[i]);
        } else {
          const double s = L.p.format == WeightFormat::kFP8Blockwise ? fp8_block_scale(amax) : L.in.a2_scale;
          ac[i] = round_e4m3(ac[i] / s) * s;
        }
      }
    }
  }
  return a;
}

TEST(MoeLayerReference, GivenActivationReplacesTheFirstTwoSteps) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  for (WeightFormat f : {WeightFormat::kFP8Blockwise, WeightFormat::kFP8PerTensor, WeightFormat::kBF16}) {
    SCOPED_TRACE(moe::weight_format_name(f));
    Layer L = random_layer(rng, f, 5, 256, 256, 4, 3, /*residual=*/true);
    L.in.ids[4] = -1;  // a dropped copy: its activation is never read
    L.in.keep_h = true;
    const MoeLayerRef model = moe_layer(L.p, L.in, MoeLayerRefMode::kModelStorage);
    Layer given = L;
    given.in.keep_h = false;
    given.in.act = activation_from_h(L, model.h);
    for (int64_t i = 0; i < 256; ++i) given.in.act[4 * 256 + i] = std::nan("");
    // Neither x nor w13 is read: poisoned, the result keeps its bits.
    for (double& v : given.in.x) v = std::nan("");
    for (double& v : given.in.w13) v = std::nan("");
    const MoeLayerRef same = moe_layer(given.p, given.in, MoeLayerRefMode::kModelStorage);
    expect_bitwise_equal(model.y, same.y, "y from the model's own activation");
    expect_bitwise_equal(model.mag, same.mag, "mag from the model's own activation");
    // Copy (t 3, slot 0): its activation doubled. Other tokens keep their bits.
    const int64_t copy = 3 * 3 + 0;
    for (int64_t i = 0; i < 256; ++i) given.in.act[copy * 256 + i] *= 2.0;
    const MoeLayerRef moved = moe_layer(given.p, given.in, MoeLayerRefMode::kModelStorage);
    expect_only_token_moved(model.y, moved.y, 256, 3, 1e-3);
  }
}

TEST(MoeLayerReference, RejectsInconsistentSizes) {
  std::mt19937_64 rng(1);
  const Layer good = random_layer(rng, WeightFormat::kFP8PerTensor, 2, 128, 128, 2, 2, /*residual=*/true);
  EXPECT_NO_THROW(moe_layer(good.p, good.in, MoeLayerRefMode::kModelStorage));
  const auto expect_rejected = [&](const char* what, auto&& edit) {
    Layer bad = good;
    edit(bad);
    EXPECT_THROW(moe_layer(bad.p, bad.in, MoeLayerRefMode::kModelStorage), std::invalid_argument) << what;
  };
  expect_rejected("x too short", [](Layer& l) { l.in.x.pop_back(); });
  expect_rejected("ids too long", [](Layer& l) { l.in.ids.push_back(0); });
  expect_rejected("weights too short", [](Layer& l) { l.in.weights.pop_back(); });
  expect_rejected("w13 too short", [](Layer& l) { l.in.w13.pop_back(); });
  expect_rejected("w2 too long", [](Layer& l) { l.in.w2.push_back(0.0); });
  expect_rejected("residual too short", [](Layer& l) { l.in.residual.pop_back(); });
  expect_rejected("hidden not a multiple of 128", [](Layer& l) { l.p.hidden = 64; });
  expect_rejected("intermediate 0", [](Layer& l) { l.p.intermediate = 0; });
  expect_rejected("tokens < 0", [](Layer& l) { l.p.tokens = -1; });
  expect_rejected("num_experts 0", [](Layer& l) { l.p.num_experts = 0; });
  expect_rejected("slots < 0", [](Layer& l) { l.p.slots = -1; });
  expect_rejected("a13_scale 0", [](Layer& l) { l.in.a13_scale = 0.0; });
  expect_rejected("a2_scale NaN", [](Layer& l) { l.in.a2_scale = std::nan(""); });
  expect_rejected("unknown format", [](Layer& l) { l.p.format = static_cast<WeightFormat>(7); });
  expect_rejected("h too short", [](Layer& l) { l.in.h.assign(2 * 2 * 2 * 128 - 1, 0.0); });
  expect_rejected("act too long", [](Layer& l) { l.in.act.assign(2 * 2 * 128 + 1, 0.0); });
  expect_rejected("act with h", [](Layer& l) {
    l.in.act.assign(2 * 2 * 128, 0.0);
    l.in.h.assign(2 * 2 * 2 * 128, 0.0);
  });
  expect_rejected("act with keep_h", [](Layer& l) {
    l.in.act.assign(2 * 2 * 128, 0.0);
    l.in.keep_h = true;
  });
  {
    Layer exact_act = good;
    exact_act.in.act.assign(2 * 2 * 128, 0.0);
    EXPECT_NO_THROW(moe_layer(exact_act.p, exact_act.in, MoeLayerRefMode::kModelStorage));
    EXPECT_THROW(moe_layer(exact_act.p, exact_act.in, MoeLayerRefMode::kExact), std::invalid_argument)
        << "act in kExact";
  }
  {
    Layer exact_h = good;
    exact_h.in.h.assign(2 * 2 * 2 * 128, 0.0);
    EXPECT_NO_THROW(moe_layer(exact_h.p, exact_h.in, MoeLayerRefMode::kModelStorage));
    EXPECT_THROW(moe_layer(exact_h.p, exact_h.in, MoeLayerRefMode::kExact), std::invalid_argument) << "h in kExact";
  }
  // No tokens: empty results.
  MoeLayerRefProblem empty = good.p;
  empty.tokens = 0;
  MoeLayerRefInputs none = good.in;
  none.x.clear();
  none.ids.clear();
  none.weights.clear();
  none.residual.clear();
  const MoeLayerRef r = moe_layer(empty, none, MoeLayerRefMode::kExact);
  EXPECT_TRUE(r.y.empty());
  EXPECT_TRUE(r.mag.empty());
}

}  // namespace
}  // namespace tessera::reference
