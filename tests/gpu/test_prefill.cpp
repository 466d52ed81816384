// The prefill kernel (src/attention/prefill, version 1: packed variable-length bf16 / fp16 K and V) on the GPU
// against the float64 reference (prefill_reference) on the same rounded inputs. The public op and its validation
// come later (docs/perf/prefill.md); these tests drive the internal launcher with valid problems.
//
// Inputs: fresh normals rounded to the 16-bit type; o and lse poisoned with NaN. Checked: relative Frobenius error of
// o over the rows with keys <= 5e-3 (bf16 rounding of P and of o alone is ~2e-3), no such row worse than 2e-2,
// lse within 1e-2, rows without keys exactly 0 with lse -inf, every output finite.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attention/prefill/problem.h"
#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/attention_reference.h"

namespace tessera::attention {
namespace {

using reference::PrefillRef;
using reference::PrefillRefParams;
using reference::PrefillShape;

struct PrefillCase {
  int D = 128, HQ = 8, HKV = 2;
  bool fp16 = false;
  std::vector<int32_t> sq, sk;
  PrefillRefParams params;
  std::string describe() const {
    std::string s = "D=" + std::to_string(D) + " HQ=" + std::to_string(HQ) + " HKV=" + std::to_string(HKV) +
                    (fp16 ? " fp16" : " bf16") + (params.causal ? " causal" : "") +
                    (params.window ? " window=" + std::to_string(params.window) : "") +
                    (params.softcap > 0 ? " softcap=" + std::to_string(params.softcap) : "") + " (sq,sk)=";
    for (size_t b = 0; b < sq.size(); ++b) s += "(" + std::to_string(sq[b]) + "," + std::to_string(sk[b]) + ")";
    return s;
  }
};

struct Check {
  bool ok = true;
  std::string message;
  double error = 0.0;
};

// Runs the kernel on fresh inputs and compares with the reference.
Check run_case(const PrefillCase& c, uint64_t seed) {
  const int B = static_cast<int>(c.sq.size());
  std::vector<int32_t> cu_q = {0}, cu_k = {0};
  for (int b = 0; b < B; ++b) {
    cu_q.push_back(cu_q.back() + c.sq[b]);
    cu_k.push_back(cu_k.back() + c.sk[b]);
  }
  const int64_t total_q = cu_q.back(), total_k = cu_k.back();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const DType dt = c.fp16 ? DType::kFP16 : DType::kBF16;
  auto fill = [&](int64_t count, float sigma, std::vector<uint16_t>& bits, std::vector<double>& vals) {
    bits.resize(count);
    vals.resize(count);
    for (int64_t i = 0; i < count; ++i) {
      const float x = sigma * n(rng);
      bits[i] = c.fp16 ? host::f32_to_fp16(x) : host::f32_to_bf16(x);
      vals[i] = c.fp16 ? host::fp16_to_f32(bits[i]) : host::bf16_to_f32(bits[i]);
    }
  };
  std::vector<uint16_t> qb, kb, vb;
  std::vector<double> qd, kd, vd;
  fill(total_q * c.HQ * c.D, 1.0f, qb, qd);
  fill(total_k * c.HKV * c.D, 1.5f, kb, kd);
  fill(total_k * c.HKV * c.D, 1.0f, vb, vd);

  // At least one element each, so that empty batches still have valid pointers.
  test::DeviceBuffer<uint16_t> q_dev(std::max<size_t>(qb.size(), 1)), k_dev(std::max<size_t>(kb.size(), 8)),
      v_dev(std::max<size_t>(vb.size(), 8)), o_dev(std::max<size_t>(qb.size(), 1));
  test::DeviceBuffer<float> lse_dev(std::max<int64_t>(total_q * c.HQ, 1));
  test::DeviceBuffer<int32_t> cuq_dev(cu_q), cuk_dev(cu_k);
  if (!qb.empty()) q_dev.upload(qb);
  if (!kb.empty()) {  // then at least D >= 64 elements: the buffers have exactly these sizes
    k_dev.upload(kb);
    v_dev.upload(vb);
  }
  o_dev.poison();
  lse_dev.poison();

  detail::PrefillProblem pb;
  pb.batch = B;
  pb.num_q_heads = c.HQ;
  pb.num_kv_heads = c.HKV;
  pb.head_dim = c.D;
  pb.fp16 = c.fp16;
  pb.q = q_dev.get();
  pb.q_stride_token = int64_t{c.HQ} * c.D;
  pb.q_stride_head = c.D;
  pb.k = k_dev.get();
  pb.v = v_dev.get();
  pb.k_stride_token = pb.v_stride_token = int64_t{c.HKV} * c.D;
  pb.k_stride_head = pb.v_stride_head = c.D;
  pb.o = o_dev.get();
  pb.o_stride_token = int64_t{c.HQ} * c.D;
  pb.o_stride_head = c.D;
  pb.lse = lse_dev.get();
  pb.lse_stride_token = c.HQ;
  pb.lse_stride_head = 1;
  pb.cu_seqlens_q = cuq_dev.get();
  pb.cu_seqlens_k = cuk_dev.get();
  pb.total_q = total_q;
  pb.total_k = total_k;
  pb.max_seqlen_q = B > 0 ? *std::max_element(c.sq.begin(), c.sq.end()) : 0;
  pb.softmax_scale = c.params.softmax_scale != 0.0f ? c.params.softmax_scale : 1.0f / std::sqrt(float(c.D));
  pb.softcap = c.params.softcap;
  pb.window = c.params.window;
  pb.causal = c.params.causal;
  detail::launch_prefill(pb, nullptr);
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> o = o_dev.download();
  const std::vector<float> lse = lse_dev.download();

  const PrefillRef ref =
      reference::prefill_reference(qd, kd, vd, cu_q, cu_k, PrefillShape{B, c.HQ, c.HKV, c.D}, c.params);
  Check r;
  double err2 = 0.0, ref2 = 0.0;
  auto fail = [&](const std::string& m) {
    if (r.ok) r.message = m;
    r.ok = false;
  };
  for (int64_t t = 0; t < total_q; ++t) {
    const bool empty = ref.end[t] <= ref.begin[t];
    for (int h = 0; h < c.HQ; ++h) {
      const int64_t row = t * c.HQ + h;
      double row_err2 = 0.0, row_ref2 = 0.0;
      for (int d = 0; d < c.D; ++d) {
        const uint16_t bits = o[row * c.D + d];
        const double got = c.fp16 ? host::fp16_to_f32(bits) : host::bf16_to_f32(bits);
        const double want = ref.o[row * c.D + d];
        if (!std::isfinite(got)) {
          fail("o(token " + std::to_string(t) + ", head " + std::to_string(h) + ", " + std::to_string(d) +
               ") is not finite");
          continue;
        }
        if (empty && got != 0.0)
          fail("o(token " + std::to_string(t) + ", head " + std::to_string(h) + ") has no keys but is not 0");
        row_err2 += (got - want) * (got - want);
        row_ref2 += want * want;
      }
      if (empty) {
        if (!(std::isinf(lse[row]) && lse[row] < 0))
          fail("lse(token " + std::to_string(t) + ", head " + std::to_string(h) + ") has no keys but is " +
               std::to_string(lse[row]));
        continue;
      }
      err2 += row_err2;
      ref2 += row_ref2;
      const double row_err = std::sqrt(row_err2 / std::max(row_ref2, 1e-30));
      if (row_err > 2e-2)
        fail("row (token " + std::to_string(t) + ", head " + std::to_string(h) + ") relative error " +
             std::to_string(row_err));
      if (!(std::fabs(lse[row] - ref.lse[row]) <= 1e-2))
        fail("lse(token " + std::to_string(t) + ", head " + std::to_string(h) + ") = " + std::to_string(lse[row]) +
             ", expected " + std::to_string(ref.lse[row]));
    }
  }
  r.error = ref2 > 0.0 ? std::sqrt(err2 / ref2) : 0.0;
  if (r.error > 5e-3) fail("relative Frobenius error " + std::to_string(r.error) + " > 5e-3");
  return r;
}

class PrefillGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

// Lengths around every tile edge (64-row consumer halves, 128-row query tiles, 64- and 128-key tiles), Sq < Sk and
// Sq = Sk, empty sequences inside the batch, every head dim and both 16-bit types, with and without the causal mask.
TEST_F(PrefillGpu, LengthsHeadDimsAndMasks) {
  const std::vector<int32_t> sq = {1, 63, 64, 0, 65, 130, 200, 7}, sk = {1, 63, 100, 5, 65, 300, 200, 0};
  for (int D : {64, 128, 256})
    for (bool fp16 : {false, true})
      for (bool causal : {false, true}) {
        PrefillCase c;
        c.D = D;
        c.fp16 = fp16;
        c.HQ = 8;
        c.HKV = 2;
        c.sq = sq;
        c.sk = sk;
        c.params.causal = causal;
        const uint64_t seed = test::fresh_seed();
        SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
        const Check r = run_case(c, seed);
        EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
      }
}

// GQA ratios 1, 4, 5, 8, 16; windows and softcap; a long sequence with many key tiles.
TEST_F(PrefillGpu, GroupsWindowsSoftcap) {
  struct G {
    int HQ, HKV, D;
    int window;
    float softcap;
    bool causal;
  };
  const G grid[] = {{4, 4, 128, 0, 0.0f, true},   {16, 4, 64, 37, 0.0f, true},  {5, 1, 128, 0, 5.0f, false},
                    {16, 2, 256, 100, 0.0f, false}, {16, 1, 128, 1, 0.0f, true}, {8, 8, 64, 0, 30.0f, true}};
  for (const G& g : grid) {
    PrefillCase c;
    c.D = g.D;
    c.HQ = g.HQ;
    c.HKV = g.HKV;
    c.sq = {300, 17, 129};
    c.sk = {1000, 17, 700};
    c.params.causal = g.causal;
    c.params.window = g.window;
    c.params.softcap = g.softcap;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
    const Check r = run_case(c, seed);
    EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
  }
}

// One configuration drawn from the seed (for the stress step: every seed a different shape): 1-4 sequences of 0-300
// queries over as many or more keys, any head dim, dtype, GQA ratio of {1, 2, 4, 5, 8}, causal or not, a window or a
// softcap now and then.
TEST_F(PrefillGpu, RandomConfiguration) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  auto below = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  PrefillCase c;
  c.D = 64 << below(3);
  c.fp16 = below(2) == 1;
  const int groups[] = {1, 2, 4, 5, 8};
  c.HKV = 1 + below(3);
  c.HQ = c.HKV * groups[below(5)];
  c.params.causal = below(3) != 0;
  c.params.window = below(4) == 0 ? 1 + below(200) : 0;
  c.params.softcap = below(5) == 0 ? 10.0f : 0.0f;
  const int B = 1 + below(4);
  for (int b = 0; b < B; ++b) {
    const int sq = below(6) == 0 ? 0 : below(301);
    c.sq.push_back(sq);
    c.sk.push_back(c.params.causal ? sq + below(200) : below(401));
  }
  SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
  const Check r = run_case(c, seed);
  EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
}

}  // namespace
}  // namespace tessera::attention
