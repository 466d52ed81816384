// tessera-bench: expert group sizes from tessera's own DeepSeek-V3 gate (moe::fused_gate, run on the GPU) on
// deterministic biased logits, for the grouped-GEMM shapes routed like a real MoE layer (bench/gemm_cases.cpp).
// bench/peers/gemm.py builds the same logits bit for bit and runs the same gate through tessera's Python API, so
// both benchmarks get the same group sizes for the same case names.
//
// The logits [T, E] and the gate's correction bias [E], fp32, from the splitmix64 stream of `seed` (the draws of
// Rng(seed).next() in order, bench/harness.h; peers.common.SplitMix64 in Python). Every value is an integer times a
// power of two, so the fp32 values are exact and identical in C++ and Python:
//   draws 0 .. E-1         p[e]    = (d >> 48) - 2^15                               per-expert popularity
//   draws E .. 2E-1        bias[e] = ((d >> 48) - 2^15) · 2^-19                     in [-1/16, 1/16)
//   draw 2E + t·E + e      n[t][e] = the sum of the four 16-bit fields of d - 2^17  (Irwin-Hall: roughly normal)
//   logit[t][e] = (5 · n[t][e] + 2 · p[e]) · 2^-17
// i.e. noise of standard deviation ~1.44 (bounded by ±5) plus a popularity bias in [-0.5, 0.5) that skews the
// routing: |5n + 2p| < 2^20. Each token's noise depends on its index only, so a shorter T routes the first T tokens
// of a longer one. Gate (DeepSeek-V3): E 256, top-8 among the 4 best of 8 groups (group score: top-2 sum), sigmoid
// scores, that bias, renormalized, routed scale 2.5. A token picks an expert at most once: rows per group <= T.
// Seed 0xD5E3 (the GEMM cases') gives, on an H200 and equal to the CPU reference gate: T 64, 172 non-empty groups,
// 137 of them with 1-4 rows, the largest 11; T 4096, all 256 non-empty, 1 to 559 rows (the mean is 128).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "tessera/error.h"
#include "tessera/moe.h"
#include "tessera/tensor.h"

namespace tessera::bench::routing {

inline constexpr int kExperts = 256;
inline constexpr int kTopk = 8;

inline moe::GateParams dsv3_gate_params() {
  moe::GateParams p;
  p.topk = kTopk;
  p.num_groups = 8;
  p.topk_groups = 4;
  p.scoring = moe::Scoring::kSigmoid;
  p.group_score = moe::GroupScore::kTop2Sum;
  p.renormalize = true;
  p.routed_scaling_factor = 2.5f;
  return p;
}

struct BiasedLogits {
  std::vector<float> logits;  // [T, E] row-major
  std::vector<float> bias;    // [E]: the gate's correction bias
};

// The logits and bias defined above.
inline BiasedLogits biased_logits(int64_t tokens, int experts, uint64_t seed) {
  Rng rng(seed);
  std::vector<int64_t> pop(experts);
  BiasedLogits out;
  out.bias.resize(experts);
  out.logits.resize(static_cast<std::size_t>(tokens) * experts);
  for (int e = 0; e < experts; ++e) pop[e] = static_cast<int64_t>(rng.next() >> 48) - (int64_t{1} << 15);
  for (int e = 0; e < experts; ++e)
    out.bias[e] = static_cast<float>(static_cast<int64_t>(rng.next() >> 48) - (int64_t{1} << 15)) * 0x1.0p-19f;
  for (int64_t t = 0; t < tokens; ++t)
    for (int e = 0; e < experts; ++e) {
      const uint64_t d = rng.next();
      const int64_t n = static_cast<int64_t>((d & 0xFFFF) + ((d >> 16) & 0xFFFF) + ((d >> 32) & 0xFFFF) + (d >> 48)) -
                        (int64_t{1} << 17);
      out.logits[t * experts + e] = static_cast<float>(5 * n + 2 * pop[e]) * 0x1.0p-17f;
    }
  return out;
}

// Rows per expert [E] of tessera's gate (dsv3_gate_params) on biased_logits(tokens, E, seed): the gate runs on the
// GPU on ctx.stream, its ids come back once; computed once per (tokens, seed) in a process (a shape's setup runs once
// per variant). Throws if an id is out of range.
inline const std::vector<int32_t>& routed_rows(const DeviceContext& ctx, int64_t tokens, uint64_t seed) {
  static std::map<std::pair<int64_t, uint64_t>, std::vector<int32_t>> cache;
  const auto key = std::make_pair(tokens, seed);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;

  const int E = kExperts, k = kTopk;
  const BiasedLogits in = biased_logits(tokens, E, seed);
  const DeviceBuffer logits = upload_new(in.logits), bias = upload_new(in.bias);
  DeviceBuffer weights(static_cast<std::size_t>(tokens) * k * 4), ids(static_cast<std::size_t>(tokens) * k * 4);
  moe::fused_gate(TensorView::contiguous(logits.get(), DType::kFP32, {tokens, E}, ctx.device),
                  TensorView::contiguous(bias.get(), DType::kFP32, {E}, ctx.device),
                  TensorView::contiguous(weights.get(), DType::kFP32, {tokens, k}, ctx.device),
                  TensorView::contiguous(ids.get(), DType::kInt32, {tokens, k}, ctx.device), dsv3_gate_params(),
                  ctx.stream);
  const std::vector<int32_t> host_ids = ids.download<int32_t>(static_cast<std::size_t>(tokens) * k, ctx.stream);
  std::vector<int32_t> rows(E, 0);
  for (const int32_t id : host_ids) {
    if (id < 0 || id >= E)
      throw Error("tessera-bench: the routed shapes' gate returned expert id " + std::to_string(id));
    ++rows[id];
  }
  return cache.emplace(key, std::move(rows)).first->second;
}

}  // namespace tessera::bench::routing
