// The float64 references on cases small enough to work out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/host_numeric.h"
#include "reference/moe_reference.h"

namespace tessera::reference {
namespace {

double logit_of(double p) { return std::log(p / (1.0 - p)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(GateReference, PlainTopK) {
  moe::GateParams p;
  p.topk = 2;
  const GateRef r = fused_gate({0.0, 1.0, -1.0, 2.0}, 1, 4, {}, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 1}));
  EXPECT_DOUBLE_EQ(r.weights[0], sigmoid(2.0));
  EXPECT_DOUBLE_EQ(r.weights[1], sigmoid(1.0));
}

TEST(GateReference, GroupsExcludeTheBestExpertAndTiesGoToTheLowerIndex) {
  // Group sums of the top two: g0 0.9, g1 1.0, g2 1.05, g3 0.2 -> keep g2 and g1; expert 0 (0.9) is excluded.
  const std::vector<double> probs = {0.9, 0.0001, 0.5, 0.5, 0.6, 0.45, 0.1, 0.1};
  std::vector<double> logits;
  for (double q : probs) logits.push_back(logit_of(q));
  moe::GateParams p;
  p.topk = 3;
  p.num_groups = 4;
  p.topk_groups = 2;
  const GateRef r = fused_gate(logits, 1, 8, {}, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 2, 3}));  // 0.6, then the 0.5 tie in index order
}

TEST(GateReference, BiasSteersChoiceButNotWeights) {
  moe::GateParams p;
  p.topk = 1;
  const GateRef r = fused_gate({2.0, 0.0}, 1, 2, {0.0, 1.0}, p);
  EXPECT_EQ(r.ids[0], 1);                       // 0.5 + 1.0 beats 0.88
  EXPECT_DOUBLE_EQ(r.weights[0], sigmoid(0.0));  // the unbiased score
}

TEST(GateReference, MaxGroupScoreAndSoftmax) {
  moe::GateParams p;
  p.topk = 2;
  p.num_groups = 2;
  p.topk_groups = 1;
  p.group_score = moe::GroupScore::kMax;
  p.scoring = moe::Scoring::kSoftmax;
  const GateRef r = fused_gate({0.0, 3.0, 1.0, 1.0}, 1, 4, {}, p);  // group 0 holds the max
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  const double z = 1 + std::exp(3.0) + 2 * std::exp(1.0);
  EXPECT_NEAR(r.weights[0], std::exp(3.0) / z, 1e-15);
}

TEST(GateReference, AllEqualPicksLowestIndices) {
  moe::GateParams p;
  p.topk = 3;
  p.num_groups = 4;
  p.topk_groups = 2;
  const GateRef r = fused_gate(std::vector<double>(16, 0.25), 1, 16, {}, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(r.tie_margin[0], INFINITY);  // exact ties only
}

TEST(GateReference, NaNRanksAsMinusInfinity) {
  moe::GateParams p;
  p.topk = 2;
  const GateRef r = fused_gate({NAN, 0.0, 1.0}, 1, 3, {}, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  moe::GateParams q;
  q.topk = 3;
  const GateRef all = fused_gate({NAN, 1.0, NAN}, 1, 3, {}, q);
  EXPECT_EQ(all.ids, (std::vector<int32_t>{1, 0, 2}));
  EXPECT_TRUE(std::isnan(all.weights[1]));
}

TEST(GateReference, RenormalizeScaleAndSharedSlots) {
  moe::GateParams p;
  p.topk = 2;
  p.renormalize = true;
  p.routed_scaling_factor = 2.5f;
  p.num_shared_experts = 2;
  p.shared_expert_weight = 0.75f;
  const GateRef r = fused_gate({0.3, -0.2, 1.1, 0.0}, 1, 4, {}, p);
  ASSERT_EQ(r.ids.size(), 4u);
  EXPECT_NEAR(r.weights[0] + r.weights[1], 2.5, 1e-12);
  EXPECT_EQ(r.ids[2], 4);
  EXPECT_EQ(r.ids[3], 5);
  EXPECT_EQ(r.weights[3], 0.75);
}

TEST(GateReference, TieMarginSeesNearTies) {
  moe::GateParams p;
  p.topk = 1;
  const GateRef r = fused_gate({0.0, 1e-9}, 1, 2, {}, p);
  EXPECT_LT(r.tie_margin[0], 1e-6);
  EXPECT_EQ(r.ids[0], 1);
}

// An exact tie across the cut is decided by index, but a value a hair below the tied run decides too: rounded keys
// can merge it into the run (the case an H200 run found: three experts tied in fp32, one 6e-10 lower in float64).
TEST(GateReference, TieMarginSeesANearValuePastAnExactTieAtTheCut) {
  moe::GateParams p;
  p.topk = 2;
  const GateRef r = fused_gate({3.0, 1.0, 1.0, 1.0 - 1e-10, -2.0}, 1, 5, {}, p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_LT(r.tie_margin[0], 1e-6);
  // The same above the run: ranks 1 and 2 tied, rank 0 a hair higher.
  const GateRef above = fused_gate({1.0 + 1e-10, 1.0, 1.0, -2.0}, 1, 4, {}, p);
  EXPECT_LT(above.tie_margin[0], 1e-6);
  // Well-separated neighbours keep the row compared.
  const GateRef clear = fused_gate({3.0, 1.0, 1.0, 0.5}, 1, 4, {}, p);
  EXPECT_GT(clear.tie_margin[0], 1e-2);  // the scores (softmax by default) of 1.0 and 0.5 apart
  // Groups: a tie across the kept-group cut with a near group score after it.
  moe::GateParams g;
  g.topk = 1;
  g.num_groups = 3;
  g.topk_groups = 1;
  g.group_score = moe::GroupScore::kMax;
  const GateRef groups = fused_gate({1.0, 1.0, 1.0 - 1e-10}, 1, 3, {}, g);
  EXPECT_LT(groups.tie_margin[0], 1e-6);
}

// Equal in float64 from different inputs is not a tie the kernel must break by index: its fp32 sums may differ.
TEST(GateReference, TieMarginIsZeroWhereDifferentInputsGiveEqualValues) {
  moe::GateParams p;
  p.topk = 1;
  p.num_groups = 2;
  p.topk_groups = 1;
  p.scoring = moe::Scoring::kSigmoid;
  // Group 0: biases 2.25 and 1.921875; group 1: 2.15625 and 2.015625 (sums equal); every logit 0 (scores 0.5): the
  // group scores tie exactly from different inputs, which rounded otherwise need not tie.
  const std::vector<double> bias = {2.25, 1.921875, 2.15625, 2.015625};
  const GateRef r = fused_gate(std::vector<double>(4, 0.0), 1, 4, bias, p);
  EXPECT_EQ(r.tie_margin[0], 0.0);
  // Logits of -60: scores below 2^-26 of the biases, which fp32 keys absorb: the kernel adds the biases alone, and
  // their fp32 sums tie as the reference's do: decided by index, the row compared.
  const std::vector<double> far(4, -60.0);
  const GateRef absorbed = fused_gate(far, 1, 4, bias, p);
  EXPECT_EQ(absorbed.ids[0], 0);
  EXPECT_GT(absorbed.tie_margin[0], 0.1);
  // The same inputs in both groups: a tie decided by index, the row compared.
  const GateRef same = fused_gate(std::vector<double>(4, 0.0), 1, 4, {2.25, 1.921875, 2.25, 1.921875}, p);
  EXPECT_EQ(same.ids[0], 0);
  EXPECT_GT(same.tie_margin[0], 0.1);
  // Experts: equal choices from different logits and biases (sigmoid(-inf) + 1 = sigmoid(inf) + 0).
  moe::GateParams q;
  q.topk = 1;
  q.scoring = moe::Scoring::kSigmoid;
  const GateRef e = fused_gate({-INFINITY, INFINITY, -5.0}, 1, 3, {1.0, 0.0, 0.0}, q);
  EXPECT_EQ(e.ids[0], 0);
  EXPECT_EQ(e.tie_margin[0], 0.0);
}

TEST(PermuteReference, StableGroupsDropsAndPads) {
  // T=3, k=2; -1 and 9 are dropped (E = 4).
  const std::vector<int64_t> ids = {2, 0, 0, -1, 2, 9};
  const PermuteIndexRef r = permute_index(ids, 3, 2, 4, 4);
  EXPECT_EQ(r.counts, (std::vector<int32_t>{2, 0, 2, 0}));
  EXPECT_EQ(r.offsets, (std::vector<int32_t>{0, 4, 4, 8, 8}));
  EXPECT_EQ(r.row_index, (std::vector<int32_t>{4, 0, 1, -1, 5, -1}));
  EXPECT_EQ(r.row_token, (std::vector<int32_t>{0, 1, -1, -1, 0, 2, -1, -1}));
}

TEST(UnpermuteReference, WeightedSumPlusResidual) {
  const std::vector<double> y = {1, 2, 10, 20, 100, 200};  // 3 rows, H = 2
  const std::vector<double> out =
      unpermute_reduce(y, {2, 0, -1, 1}, {0.5, 0.25, 9.0, 1.0}, {1, 1, 0, 0}, 2, 2, 2, 2.0);
  EXPECT_EQ(out, (std::vector<double>{2 * (50 + 0.25) + 1, 2 * (100 + 0.5) + 1, 20, 40}));
}

TEST(HostNumeric, RoundTripsAndRounding) {
  EXPECT_EQ(host::f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(host::bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(host::f32_to_bf16(1.00390625f), 0x3F80);  // halfway, rounds to even
  EXPECT_EQ(host::f32_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(host::fp16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(host::fp16_to_f32(host::f32_to_fp16(65504.0f)), 65504.0f);
  EXPECT_EQ(host::fp16_to_f32(0x0001), std::ldexp(1.0f, -24));
  for (uint32_t h = 0; h < 0x7C00; ++h) ASSERT_EQ(host::f32_to_fp16(host::fp16_to_f32(h)), h);
  EXPECT_EQ(host::e4m3_to_f32(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(host::e4m3_to_f32(0x7F)));
  EXPECT_EQ(host::e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(host::e4m3_half_ulp(1.0), 1.0 / 16);
  EXPECT_EQ(host::e4m3_half_ulp(300.0), 16.0);
}

}  // namespace
}  // namespace tessera::reference
