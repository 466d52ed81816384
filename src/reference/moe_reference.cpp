#include "reference/moe_reference.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>

#include "tessera/error.h"

namespace tessera::reference {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The distance between two ranked values; 0 for an exact tie (including -inf vs -inf).
double gap(double hi, double lo) { return hi == lo ? 0.0 : hi - lo; }

void note_gap(double& margin, double hi, double lo) {
  const double g = gap(hi, lo);
  if (g > 0.0) margin = std::min(margin, g);
}

// Ties. Two values that are exactly equal here are decided by index, as the kernel decides its ties, only where they
// are equal for the same reason in every precision: the same inputs (`same(a, b)`: equal logits and biases, or for
// groups equal members). Equal here from different inputs (bf16 biases 2.25 + 1.921875 and 2.15625 + 2.015625, each
// plus the same tiny scores: an H200 run) the kernel's fp32 sums need not be: the row's margin is then 0.
template <typename Same>
void note_pair(double& margin, const std::vector<double>& v, int a, int b, const Same& same) {
  if (gap(v[a], v[b]) > 0.0)
    note_gap(margin, v[a], v[b]);
  else if (!same(a, b))
    margin = 0.0;
}

// The cut between ranks n - 1 and n of v[order[...]] (sorted descending): its gap, or where the two are tied, the
// whole tied run (it must tie for the same inputs) and the gaps on both sides of it: the kernel ranks rounded keys,
// which can merge a value a hair away into the run, and the lowest index of the merged run then wins (an H200 run:
// bf16 biases 1.8125 on experts 365, 449 and 206, the last 6e-10 lower in float64; the fp32 keys tie all three and
// 206 took the eighth slot).
template <typename Same>
void note_cut(double& margin, const std::vector<double>& v, const std::vector<int>& order, int n, const Same& same) {
  const int size = static_cast<int>(order.size());
  if (n <= 0 || n >= size) return;
  if (gap(v[order[n - 1]], v[order[n]]) > 0.0) {
    note_gap(margin, v[order[n - 1]], v[order[n]]);
    return;
  }
  int a = n - 1, b = n;
  while (a > 0 && gap(v[order[a - 1]], v[order[a]]) == 0.0) --a;
  while (b + 1 < size && gap(v[order[b]], v[order[b + 1]]) == 0.0) ++b;
  for (int i = a; i < b; ++i)
    if (!same(order[i], order[i + 1])) {
      margin = 0.0;
      return;
    }
  if (a > 0) note_gap(margin, v[order[a - 1]], v[order[a]]);
  if (b + 1 < size) note_gap(margin, v[order[b]], v[order[b + 1]]);
}

// Indices sorted by value descending, ties by index ascending.
std::vector<int> ranked(const std::vector<double>& v, const std::vector<int>& candidates) {
  std::vector<int> order = candidates;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
  return order;
}

}  // namespace

GateRef fused_gate(const std::vector<double>& logits, int64_t num_tokens, int num_experts,
                   const std::vector<double>& bias, const moe::GateParams& p) {
  const int E = num_experts, G = p.num_groups, k = p.topk, s = p.num_shared_experts;
  if (G <= 0 || E % G != 0 || k < 1 || p.topk_groups < 1 || p.topk_groups > G)
    throw Error("tessera::reference::fused_gate: invalid parameters");
  const int group_size = E / G, width = k + s;
  GateRef r;
  r.weights.assign(num_tokens * width, 0.0);
  r.ids.assign(num_tokens * width, -1);
  r.scores.assign(num_tokens * E, 0.0);
  r.tie_margin.assign(num_tokens, kInf);

  std::vector<double> score(E), choice(E), group_score(G);
  std::vector<std::array<int, 2>> top_members(G);  // each group's best two experts (ties: the lower index first)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const double* x = &logits[t * E];
    if (p.scoring == moe::Scoring::kSigmoid) {
      for (int e = 0; e < E; ++e) score[e] = 1.0 / (1.0 + std::exp(-x[e]));
    } else {
      double m = NAN;  // fmax skips NaN: the max of the non-NaN logits
      for (int e = 0; e < E; ++e) m = std::fmax(m, x[e]);
      double sum = 0.0;
      for (int e = 0; e < E; ++e) sum += (score[e] = std::exp(x[e] - m));
      for (int e = 0; e < E; ++e) score[e] /= sum;
    }
    for (int e = 0; e < E; ++e) {
      const double c = score[e] + (bias.empty() ? 0.0 : bias[e]);
      choice[e] = std::isnan(c) ? -kInf : c;  // a NaN ranks as -inf
      r.scores[t * E + e] = score[e];
    }

    double& margin = r.tie_margin[t];
    // Equal choices the kernel's fp32 keys tie too (so that it also decides them by index): the same inputs (equal
    // logits, NaN counting as equal to NaN, and equal biases); both -inf (a NaN choice ranks as -inf); or equal
    // biases with both scores below 2^-26 of the bias, which the fp32 sum score + bias absorbs whole (its half ulp
    // is at least 2^-25 of the bias).
    const auto bias_of = [&](int e) { return bias.empty() ? 0.0 : bias[e]; };
    const auto absorbed = [&](int e) { return std::fabs(score[e]) < std::ldexp(std::fabs(bias_of(e)), -26); };
    const auto same_expert = [&](int a, int b) {
      if (choice[a] == -kInf && choice[b] == -kInf) return true;
      if (bias_of(a) != bias_of(b)) return false;
      if (x[a] == x[b] || (std::isnan(x[a]) && std::isnan(x[b]))) return true;
      return absorbed(a) && absorbed(b);
    };
    std::vector<int> candidates;
    if (G == 1) {
      candidates.resize(E);
      std::iota(candidates.begin(), candidates.end(), 0);
    } else {
      const bool top2 = p.group_score == moe::GroupScore::kTop2Sum;
      std::vector<int> members(group_size);
      for (int g = 0; g < G; ++g) {
        std::iota(members.begin(), members.end(), g * group_size);
        const std::vector<int> best = ranked(choice, members);
        top_members[g] = {best[0], best[group_size > 1 ? 1 : 0]};
        const double gs = top2 ? choice[top_members[g][0]] + choice[top_members[g][1]] : choice[best[0]];
        group_score[g] = std::isnan(gs) ? -kInf : gs;
      }
      // Groups: both -inf; the same members' inputs; or, top-2 sums of members whose scores fp32 absorbs (their
      // keys are their biases exactly), equal fp32 sums of those biases, as the kernel adds them.
      const auto same_group = [&](int a, int b) {
        if (group_score[a] == -kInf && group_score[b] == -kInf) return true;
        const auto& ma = top_members[a];
        const auto& mb = top_members[b];
        if (same_expert(ma[0], mb[0]) && (!top2 || same_expert(ma[1], mb[1]))) return true;
        if (!top2 || !(absorbed(ma[0]) && absorbed(ma[1]) && absorbed(mb[0]) && absorbed(mb[1]))) return false;
        const auto f = [&](int e) { return static_cast<float>(bias_of(e)); };
        return f(ma[0]) + f(ma[1]) == f(mb[0]) + f(mb[1]);
      };
      std::vector<int> all_groups(G);
      std::iota(all_groups.begin(), all_groups.end(), 0);
      const std::vector<int> order = ranked(group_score, all_groups);
      note_cut(margin, group_score, order, p.topk_groups, same_group);
      std::vector<int> kept(order.begin(), order.begin() + p.topk_groups);
      std::sort(kept.begin(), kept.end());
      for (int g : kept)
        for (int e = g * group_size; e < (g + 1) * group_size; ++e) candidates.push_back(e);
    }
    if (k > static_cast<int>(candidates.size()))
      throw Error("tessera::reference::fused_gate: topk exceeds the experts of the kept groups");
    const std::vector<int> order = ranked(choice, candidates);
    // The order of the k chosen (each neighbouring pair) and the cut after them.
    for (int i = 0; i + 1 < k && i + 1 < static_cast<int>(order.size()); ++i)
      note_pair(margin, choice, order[i], order[i + 1], same_expert);
    note_cut(margin, choice, order, k, same_expert);

    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += score[order[j]];
    for (int j = 0; j < k; ++j) {
      double w = score[order[j]];
      if (p.renormalize) w /= sum;
      r.weights[t * width + j] = w * p.routed_scaling_factor;
      r.ids[t * width + j] = order[j];
    }
    for (int j = 0; j < s; ++j) {
      r.weights[t * width + k + j] = p.shared_expert_weight;
      r.ids[t * width + k + j] = E + j;
    }
  }
  return r;
}

PermuteIndexRef permute_index(const std::vector<int64_t>& ids, int64_t num_tokens, int topk, int num_experts,
                              int pad_multiple) {
  PermuteIndexRef r;
  const int E = num_experts;
  r.counts.assign(E, 0);
  for (int64_t i = 0; i < num_tokens * topk; ++i)
    if (ids[i] >= 0 && ids[i] < E) ++r.counts[ids[i]];
  r.offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    const int padded = (r.counts[e] + pad_multiple - 1) / pad_multiple * pad_multiple;
    r.offsets[e + 1] = r.offsets[e] + padded;
  }
  r.row_token.assign(r.offsets[E], -1);
  r.row_index.assign(num_tokens * topk, -1);
  std::vector<int32_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int j = 0; j < topk; ++j) {
      const int64_t e = ids[t * topk + j];
      if (e < 0 || e >= E) continue;
      const int32_t row = next[e]++;
      r.row_index[t * topk + j] = row;
      r.row_token[row] = static_cast<int32_t>(t);
    }
  return r;
}

double fp8_block_scale(double amax) {
  return std::max(amax, static_cast<double>(moe::kFP8BlockScaleEps)) / 448.0;
}

std::vector<double> unpermute_reduce(const std::vector<double>& y, const std::vector<int32_t>& row_index,
                                     const std::vector<double>& weights, const std::vector<double>& residual,
                                     int64_t num_tokens, int topk, int64_t hidden, double routed_scale) {
  std::vector<double> out(num_tokens * hidden, 0.0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    double* o = &out[t * hidden];
    for (int j = 0; j < topk; ++j) {
      const int32_t row = row_index[t * topk + j];
      if (row < 0) continue;
      const double w = weights[t * topk + j];
      for (int64_t h = 0; h < hidden; ++h) o[h] += w * y[row * hidden + h];
    }
    for (int64_t h = 0; h < hidden; ++h) {
      o[h] *= routed_scale;
      if (!residual.empty()) o[h] += residual[t * hidden + h];
    }
  }
  return out;
}

}  // namespace tessera::reference
