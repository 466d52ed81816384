// The fused gate's test inputs, shared by the GPU tests (tests/gpu/test_fused_gate.cpp) and the CPU test of the
// checker's tie margins (tests/cpu/test_gate_checker.cpp): the configuration grid and the value kinds.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/host_numeric.h"
#include "tessera/moe.h"
#include "tessera/tensor.h"

namespace tessera::moe::gate_test {

struct GateConfigCase {
  const char* name;
  int E;
  GateParams p;
  bool bias;
};

inline GateParams make(int k, int groups, int tg, Scoring s, GroupScore gs, bool renorm, float scale,
                       int shared = 0) {
  GateParams p;
  p.topk = k;
  p.num_groups = groups;
  p.topk_groups = tg;
  p.scoring = s;
  p.group_score = gs;
  p.renormalize = renorm;
  p.routed_scaling_factor = scale;
  p.num_shared_experts = shared;
  p.shared_expert_weight = 1.0f;
  return p;
}

inline constexpr auto kSig = Scoring::kSigmoid;
inline constexpr auto kSoft = Scoring::kSoftmax;
inline constexpr auto kTop2 = GroupScore::kTop2Sum;
inline constexpr auto kMax = GroupScore::kMax;

inline std::vector<GateConfigCase> config_grid() {
  return {
      {"dsv3", 256, make(8, 8, 4, kSig, kTop2, true, 2.5f), true},
      {"dsv2lite", 64, make(6, 1, 1, kSoft, kTop2, false, 1.0f), false},
      {"qwen3", 128, make(8, 1, 1, kSoft, kTop2, true, 1.0f), false},
      {"kimik2", 384, make(8, 1, 1, kSig, kTop2, true, 2.827f), true},
      {"mixtral", 8, make(2, 1, 1, kSoft, kTop2, true, 1.0f), false},
      {"odd160", 160, make(6, 1, 1, kSig, kTop2, false, 1.0f), true},
      {"dsv3_shared", 256, make(8, 8, 4, kSig, kTop2, true, 2.5f, 2), true},
      {"dsv2_groups_max", 160, make(6, 8, 3, kSoft, kMax, false, 16.0f), false},  // 20 per group: smem path
      {"e96_g4_top2", 96, make(6, 4, 2, kSig, kTop2, true, 1.0f), true},          // 6 lanes per group
      {"e256_g64_max", 256, make(8, 64, 8, kSig, kMax, true, 1.0f), true},        // 4 experts per group
      {"e512_g16", 512, make(8, 16, 4, kSig, kTop2, true, 2.0f), true},
      {"e500_g4", 500, make(10, 4, 2, kSoft, kTop2, true, 1.0f), true},
      {"e128_g4_softmax_bias", 128, make(4, 4, 2, kSoft, kTop2, false, 1.0f), true},
      {"e33", 33, make(5, 1, 1, kSig, kTop2, false, 1.0f), true},
      {"e1", 1, make(1, 1, 1, kSig, kTop2, true, 1.0f), false},
      {"k32", 64, make(32, 1, 1, kSig, kTop2, true, 1.0f), true},
      {"k_all_kept", 64, make(16, 8, 2, kSig, kTop2, false, 1.0f), true},  // k == experts of the kept groups
  };
}

enum class Values { kRandom, kCoarse, kNearTie, kSpecial, kFarNegative, kSteeredFarBelow };

// Host-side inputs: raw bits to upload plus the exact values as double.
struct GateInputs {
  std::vector<uint8_t> logits_raw, bias_raw;
  std::vector<double> logits, bias;
};

inline void encode(DType dtype, const std::vector<float>& v, std::vector<uint8_t>& raw, std::vector<double>& exact) {
  const std::size_t es = dtype_size(dtype);
  raw.resize(v.size() * es);
  exact.resize(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kFP32) {
      std::memcpy(&raw[i * 4], &v[i], 4);
      exact[i] = v[i];
    } else {
      const uint16_t h = dtype == DType::kBF16 ? host::f32_to_bf16(v[i]) : host::f32_to_fp16(v[i]);
      std::memcpy(&raw[i * 2], &h, 2);
      exact[i] = dtype == DType::kBF16 ? host::bf16_to_f32(h) : host::fp16_to_f32(h);
    }
  }
}

// logits laid out with `row_stride` elements per row (padding filled with garbage that must not be read).
inline GateInputs make_inputs(int64_t T, int E, int64_t row_stride, bool with_bias, DType dtype, Values kind,
                       std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> pick(0, 3);
  std::vector<float> l(T * row_stride, 1e30f), b(E, 0.0f);
  // Few distinct values, chosen so that no two different pairs have the same sum (top2 group scores) under
  // sigmoid or softmax: every tie is exact, none is near.
  const float coarse[4] = {-2.0f, 0.25f, 1.0f, 3.0f};
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      float& x = l[t * row_stride + e];
      switch (kind) {
        case Values::kCoarse: x = coarse[pick(rng)]; break;
        case Values::kSteeredFarBelow: {  // experts lifted to 0 below
          const float u = 2.0f * static_cast<float>(rng() % 1024) / 1023.0f - 1.0f;
          x = t % 2 == 0 ? -100.0f + 8.0f * u : -86.0f + 1.5f * u;
          break;
        }
        case Values::kFarNegative: {
          // Rows around -100 (every sigmoid underflows in fp32), -60 (tiny but normal) and -25, each row within
          // +-8 of its centre.
          const float centre[3] = {-100.0f, -60.0f, -25.0f};
          x = centre[t % 3] + 8.0f * (2.0f * static_cast<float>(rng() % 1024) / 1023.0f - 1.0f);
          break;
        }
        case Values::kNearTie:
          // Pairs of neighbours one or two ulps apart: ranks that only the last bits decide.
          x = (e % 2 == 1) ? std::nextafter(l[t * row_stride + e - 1], INFINITY) : normal(rng);
          break;
        default: x = normal(rng); break;
      }
    }
  if (kind == Values::kSpecial) {
    std::uniform_int_distribution<int> col(0, E - 1);
    const float special[4] = {NAN, INFINITY, -INFINITY, NAN};
    for (int64_t t = 0; t < T; ++t) {
      const int n = static_cast<int>(rng() % 4);
      for (int i = 0; i < n; ++i) l[t * row_stride + col(rng)] = special[pick(rng)];
      if (t % 7 == 3)
        for (int e = 0; e < E; ++e) l[t * row_stride + e] = NAN;  // a row of NaN only
    }
  }
  if (with_bias)
    for (;;) {
      for (int e = 0; e < E; ++e) b[e] = kind == Values::kCoarse ? 0.0f : 0.5f * normal(rng);
      if (kind != Values::kFarNegative && kind != Values::kSteeredFarBelow) break;
      // Far-negative and steered rows' keys are mostly their biases (the scores underflow or sit far below them):
      // two biases closer than the checkers' tie margin (1e-6) make all those rows near-ties, and a test that skips
      // near-ties compares too few (GateChecker.Fp32SelectionMatchesWhereTheMarginDecides failed so, 1 run in ~40:
      // odd160, far-negative fp32 rows, biases 2.02503395 and 2.02503324 among the top six: 0 of 2000 rows
      // compared). Drawn again until every two differ by 1e-5 or more.
      std::vector<float> sorted(b);
      std::sort(sorted.begin(), sorted.end());
      bool apart = true;
      for (int e = 1; e < E && apart; ++e) apart = sorted[e] - sorted[e - 1] >= 1e-5f;
      if (apart) break;
    }
  if (kind == Values::kSteeredFarBelow) {
    // The row's best logits (0) on experts of low bias, which the selection then passes over for experts far below
    // them. Even rows: one expert at 0 (the lowest bias), the others at -100 +- 8: their softmax scores are 0 in
    // fp32 (renormalized: 0 / 0 without the fallback). Odd rows: the experts below the median bias at 0, the others
    // at -86 +- 1.5: softmax scores of e^-86 / (E / 2), subnormal (renormalized: 1 / a subnormal sum = inf). Without
    // a bias: expert t % E, or the first half of the experts.
    std::vector<float> sorted(b);
    std::nth_element(sorted.begin(), sorted.begin() + E / 2, sorted.end());
    const float median = sorted[E / 2];
    const int lowest = static_cast<int>(std::min_element(b.begin(), b.end()) - b.begin());
    for (int64_t t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) {
        const bool hot = t % 2 == 0 ? e == (with_bias ? lowest : static_cast<int>(t % E))
                                    : (with_bias ? b[e] < median : e < (E + 1) / 2);
        if (hot) l[t * row_stride + e] = 0.0f;
      }
  }
  GateInputs in;
  std::vector<double> strided;
  encode(dtype, l, in.logits_raw, strided);
  in.logits.resize(T * E);
  for (int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) in.logits[t * E + e] = strided[t * row_stride + e];
  if (with_bias) encode(dtype, b, in.bias_raw, in.bias);
  return in;
}

}  // namespace tessera::moe::gate_test
