// fused_gate on the GPU against the float64 reference: configuration grid, dtypes, strides, exact ties,
// near-ties, NaN / inf, CUDA-graph capture, determinism, device-level argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gate_inputs.h"
#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/moe_checks.h"
#include "reference/moe_reference.h"
#include "tessera/error.h"
#include "tessera/moe.h"

namespace tessera::moe {
namespace {

using test::DeviceBuffer;
using namespace gate_test;  // NOLINT(google-build-using-namespace): the grid and value kinds the GPU tests share

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
// scores: a bias steers the selection to experts ~100 below the row's best logit (scores 0 in fp32) or ~86 below
// half the row (subnormal scores, whose sum's reciprocal overflowed to inf).
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
