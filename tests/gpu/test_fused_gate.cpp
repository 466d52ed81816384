// fused_gate on the GPU against the float64 reference: configuration grid, dtypes, strides, exact ties,
// near-ties, NaN / inf, CUDA-graph capture, determinism, device-level argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/moe_checks.h"
#include "reference/moe_reference.h"
#include "tessera/error.h"
#include "tessera/moe.h"

namespace tessera::moe {
namespace {

using test::DeviceBuffer;

struct GateConfigCase {
  const char* name;
  int E;
  GateParams p;
  bool bias;
};

GateParams make(int k, int groups, int tg, Scoring s, GroupScore gs, bool renorm, float scale, int shared = 0) {
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

const auto kSig = Scoring::kSigmoid;
const auto kSoft = Scoring::kSoftmax;
const auto kTop2 = GroupScore::kTop2Sum;
const auto kMax = GroupScore::kMax;

std::vector<GateConfigCase> config_grid() {
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

void encode(DType dtype, const std::vector<float>& v, std::vector<uint8_t>& raw, std::vector<double>& exact) {
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
GateInputs make_inputs(int64_t T, int E, int64_t row_stride, bool with_bias, DType dtype, Values kind,
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
        case Values::kSteeredFarBelow:  // -100 +- 8; one expert per row lifted to 0 below
          x = -100.0f + 8.0f * (2.0f * static_cast<float>(rng() % 1024) / 1023.0f - 1.0f);
          break;
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
    for (int e = 0; e < E; ++e) b[e] = kind == Values::kCoarse ? 0.0f : 0.5f * normal(rng);
  if (kind == Values::kSteeredFarBelow) {
    // Each row's best logit (0) on the expert of the lowest bias, which the selection then passes over for experts
    // ~100 below it: under softmax their scores underflow to 0 in fp32 (renormalized: 0 / 0 without the fallback).
    const int hot = with_bias ? static_cast<int>(std::min_element(b.begin(), b.end()) - b.begin()) : 0;
    for (int64_t t = 0; t < T; ++t) l[t * row_stride + (with_bias ? hot : static_cast<int>(t % E))] = 0.0f;
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

struct GateRun {
  std::vector<float> weights;
  std::vector<int32_t> ids;
};

GateRun run_gate(const GateInputs& in, int64_t T, int E, int64_t row_stride, DType dtype, const GateParams& p) {
  const int width = p.topk + p.num_shared_experts;
  DeviceBuffer<uint8_t> logits(in.logits_raw);
  DeviceBuffer<uint8_t> bias(in.bias_raw);
  DeviceBuffer<float> weights(T * width);
  DeviceBuffer<int32_t> ids(T * width);
  weights.poison();
  ids.poison();
  TensorView lv = logits.view(dtype, {T, E});
  lv.strides[0] = row_stride;
  std::optional<TensorView> bv;
  if (!in.bias_raw.empty()) bv = bias.view(dtype, {E});
  fused_gate(lv, bv, weights.view(DType::kFP32, {T, width}), ids.view(DType::kInt32, {T, width}), p, nullptr);
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  return {weights.download(), ids.download()};
}

void check_case(const GateConfigCase& c, int64_t T, DType dtype, Values kind, int64_t row_pad, uint64_t seed,
                int64_t* compared_rows = nullptr) {
  std::mt19937_64 rng(seed);
  const int64_t row_stride = c.E + row_pad;
  const GateInputs in = make_inputs(T, c.E, row_stride, c.bias, dtype, kind, rng);
  const GateRun got = run_gate(in, T, c.E, row_stride, dtype, c.p);
  const reference::GateRef ref = reference::fused_gate(in.logits, T, c.E, in.bias, c.p);
  const reference::CheckResult r =
      reference::check_fused_gate(ref, got.weights.data(), got.ids.data(), T, c.E, c.p);
  EXPECT_TRUE(r.ok) << c.name << " T=" << T << " dtype=" << dtype_name(dtype) << " " << test::seed_note(seed) << ": "
                    << r.message;
  if (compared_rows) *compared_rows += r.compared;
}

class FusedGateGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

TEST_F(FusedGateGpu, ConfigGridAllDtypes) {
  for (const GateConfigCase& c : config_grid())
    for (int64_t T : {0, 1, 5, 67, 1500})
      for (DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
        int64_t compared = 0;
        check_case(c, T, dtype, Values::kRandom, 0, test::fresh_seed(), &compared);
        // Random normal logits rarely come within 1e-6: most rows must have had their ids compared.
        if (T >= 67) EXPECT_GT(compared, T * 9 / 10) << c.name << " " << dtype_name(dtype);
      }
}

TEST_F(FusedGateGpu, StridedRows) {
  for (const GateConfigCase& c : config_grid())
    for (int64_t pad : {3, 8, 64}) check_case(c, 300, DType::kFP32, Values::kRandom, pad, test::fresh_seed());
  for (const GateConfigCase& c : config_grid()) check_case(c, 300, DType::kBF16, Values::kRandom, 8, test::fresh_seed());
}

TEST_F(FusedGateGpu, ExactTiesGoToTheLowerIndex) {
  for (const GateConfigCase& c : config_grid())
    for (DType dtype : {DType::kFP32, DType::kBF16}) {
      int64_t compared = 0;
      check_case(c, 500, dtype, Values::kCoarse, 0, test::fresh_seed(), &compared);
      EXPECT_EQ(compared, 500) << c.name << ": exact ties must be compared, not skipped";
    }
}

TEST_F(FusedGateGpu, NearTies) {
  for (const GateConfigCase& c : config_grid()) check_case(c, 500, DType::kFP32, Values::kNearTie, 0, test::fresh_seed());
}

TEST_F(FusedGateGpu, NaNAndInfinity) {
  for (const GateConfigCase& c : config_grid())
    for (DType dtype : {DType::kFP32, DType::kBF16}) check_case(c, 200, dtype, Values::kSpecial, 0, test::fresh_seed());
}

// Logits far below zero: with sigmoid scoring and renormalization the weights are the ratios of the selected
// sigmoids (the reference's, in float64), finite even where every selected sigmoid underflows in fp32 (their sum was
// 0: 0 · inf gave NaN weights, and a NaN row of y in the MoE layer). kSteeredFarBelow does the same to softmax
// scores: a bias steers the selection to experts ~100 below the row's best logit.
TEST_F(FusedGateGpu, FarNegativeLogits) {
  for (const GateConfigCase& c : config_grid())
    for (DType dtype : {DType::kFP32, DType::kBF16}) {
      check_case(c, 300, dtype, Values::kFarNegative, 0, test::fresh_seed());
      check_case(c, 300, dtype, Values::kSteeredFarBelow, 0, test::fresh_seed());
      // The two-tokens-per-warp kernels (LargeTokenCount's shapes): grouped configurations at T >= 4096, E <= 128
      // at large T; odd T leaves a last half warp without a token.
      if (c.p.num_groups > 1) check_case(c, 4097, dtype, Values::kFarNegative, 0, test::fresh_seed());
      if (c.E <= 128) check_case(c, 20001, dtype, Values::kFarNegative, 0, test::fresh_seed());
    }
}

TEST_F(FusedGateGpu, LargeTokenCount) {
  const GateConfigCase c = config_grid()[0];
  check_case(c, 70000, DType::kFP32, Values::kRandom, 0, test::fresh_seed());
  check_case(c, 70000, DType::kBF16, Values::kRandom, 0, test::fresh_seed());
  // T >= 4096 ranks two tokens per warp for lane-aligned groups keeping at most half the experts (dsv3,
  // k_all_kept, e128_g4); an odd T leaves the last pair without its second token.
  for (const GateConfigCase& grouped : config_grid())
    if (grouped.p.num_groups > 1)
      for (int64_t T : {4096, 4097}) {
        check_case(grouped, T, DType::kFP32, Values::kRandom, 0, test::fresh_seed());
        check_case(grouped, T, DType::kBF16, Values::kSpecial, 0, test::fresh_seed());
        check_case(grouped, T, DType::kFP32, Values::kCoarse, 0, test::fresh_seed());
      }
  // Large T with E <= 128 ranks two tokens per warp; an odd T leaves the last warp's second half without a token.
  for (const GateConfigCase& small : config_grid())
    if (small.E <= 128)
      for (int64_t T : {20000, 20001}) {
        check_case(small, T, DType::kFP32, Values::kRandom, 0, test::fresh_seed());
        check_case(small, T, DType::kBF16, Values::kSpecial, 0, test::fresh_seed());
      }
}

TEST_F(FusedGateGpu, CudaGraphCaptureAndReplay) {
  const GateConfigCase c = config_grid()[0];
  const int64_t T = 96;
  const int E = c.E, width = c.p.topk;
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  GateInputs in = make_inputs(T, E, E, true, DType::kFP32, Values::kRandom, rng);
  DeviceBuffer<uint8_t> logits(in.logits_raw), bias(in.bias_raw);
  DeviceBuffer<float> weights(T * width);
  DeviceBuffer<int32_t> ids(T * width);
  cudaStream_t stream;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fused_gate(logits.view(DType::kFP32, {T, E}), bias.view(DType::kFP32, {E}),
             weights.view(DType::kFP32, {T, width}), ids.view(DType::kInt32, {T, width}), c.p, stream);
  TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  TESSERA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    in = make_inputs(T, E, E, true, DType::kFP32, Values::kRandom, rng);  // new values, same buffers
    logits.upload(in.logits_raw);
    bias.upload(in.bias_raw);
    weights.poison();
    ids.poison();
    TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto w = weights.download();
    const auto i = ids.download();
    const auto ref = reference::fused_gate(in.logits, T, E, in.bias, c.p);
    const auto r = reference::check_fused_gate(ref, w.data(), i.data(), T, E, c.p);
    EXPECT_TRUE(r.ok) << "replay " << replay << ": " << r.message;
  }
  TESSERA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TESSERA_CUDA_CHECK(cudaGraphDestroy(graph));
  TESSERA_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_F(FusedGateGpu, Deterministic) {
  for (const GateConfigCase& c : config_grid()) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(test::seed_note(seed));
    std::mt19937_64 rng(seed);
    const int64_t T = 777;
    const GateInputs in = make_inputs(T, c.E, c.E, c.bias, DType::kFP32, Values::kRandom, rng);
    const GateRun a = run_gate(in, T, c.E, c.E, DType::kFP32, c.p);
    const GateRun b = run_gate(in, T, c.E, c.E, DType::kFP32, c.p);
    EXPECT_EQ(0, std::memcmp(a.weights.data(), b.weights.data(), a.weights.size() * 4)) << c.name;
    EXPECT_EQ(a.ids, b.ids) << c.name;
  }
}

TEST_F(FusedGateGpu, HostPointerAndWrongDeviceAreRejectedBeforeLaunch) {
  const int64_t T = 4;
  const int E = 64;
  GateParams p = make(4, 1, 1, kSig, kTop2, false, 1.0f);
  std::vector<float> host_logits(T * E, 0.5f);
  DeviceBuffer<float> logits(T * E), weights(T * 4);
  DeviceBuffer<int32_t> ids(T * 4);
  weights.poison();
  ids.poison();
  const auto w0 = weights.download();
  const auto i0 = ids.download();
  auto expect_named = [&](const TensorView& lv, const char* arg) {
    try {
      fused_gate(lv, std::nullopt, weights.view(DType::kFP32, {T, 4}), ids.view(DType::kInt32, {T, 4}), p, nullptr);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + arg + "'"), std::string::npos) << e.what();
    }
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(0, std::memcmp(weights.download().data(), w0.data(), w0.size() * 4));
    EXPECT_EQ(ids.download(), i0);
  };
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  expect_named(TensorView::contiguous(host_logits.data(), DType::kFP32, {T, E}, device), "logits");
  expect_named(TensorView::contiguous(host_logits.data(), DType::kFP32, {T, E}, TensorView::kHostDevice), "logits");
  expect_named(TensorView::contiguous(logits.get(), DType::kFP32, {T, E}, device + 1), "logits");
}

}  // namespace
}  // namespace tessera::moe
