// Public entry points of attention decode and append_kv; the split-count choice and the workspace size.
#include <algorithm>
#include <cstdint>

#include "attention/decode/config.h"
#include "common/device_info.h"
#include "attention/decode/problem.h"
#include "tessera/attention.h"

namespace tessera::attention {
namespace detail {

// Split count from shapes only (the device lengths are unknown on the host). Each CTA costs its share of the capacity
// plus a fixed start-up. An SM runs its CTAs in rounds of the kernel's resident CTAs per SM (config.h). Over 8-bit and
// 4-bit rows, which are partly instruction-bound, the CTAs of a round run side by side: a round costs one CTA, plus
// part of a start-up for each further CTA in it. Over 16-bit rows one CTA already pulls an SM's share of DRAM
// bandwidth, so co-resident CTAs only share it: the SM's cost is the sum of its CTAs. The busiest SM (ceil(CTAs / SMs)
// CTAs) sets the time; a split run pays the merge. (Measured on an H200, bf16 B=128 T=8192 HQ8 HKV1: 126.8 µs at 1
// split (128 CTAs), 130.1 at 2 and 137.8 at 3; bf16 B=32: 39.9 at 4 splits, 42.7 at 6, where some SMs hold one CTA
// more. 8-bit rows keep the rounds model: one split per CTA slot is 6 % slower for fp8 at B=512.) Sequences shorter
// than the capacity only make the splits finish early.
int select_num_splits(int64_t batch, int64_t num_kv_heads, int64_t group_size, int64_t capacity, int num_sms,
                      KVFormat format, int64_t head_dim) {
  constexpr double kStartupTokens = 128.0;  // fixed cost of a CTA, in tokens of one KV head
  constexpr double kMergeTokens = 64.0;     // the merge launch and traffic, in the same unit
  // The merge's work per split (its reads of each split's partial rows, and the splits' epilogues). Fitted to a
  // split sweep at small batches (bench/decode_split_sweep.py, H200, T 8192 HQ 8 HKV 1): v12 charged 8, when the
  // merge kernel's time grew with the split count (B 1: 12.2 µs at 32 splits, 15.3-16.1 at 128); with v14's merge
  // B 1 runs best at 64-128 splits (9.4-9.9 µs, 10.5-10.8 at 32). docs/perf/decode.md, v12 and v15.
  // v15: 2 since the merge issues every load at once (v14: its time barely grows with the split count).
  constexpr double kMergeTokensPerSplit = 2.0;
  // CTAs that share an SM in one round of 8- or 4-bit rows overlap their reads but not all of their start-up: each
  // one past the first costs this much (fitted with the v14 sweep: hq8kv1 B 8 int4 13.5 µs at 16-32 splits, 17.4
  // at 64 with 4 CTAs per SM; B 32 int4 22.9 at 8 splits, 25.4 at 16).
  constexpr double kCoResidentTokens = 256.0;
  const int group = static_cast<int>(std::min<int64_t>(std::max<int64_t>(group_size, 1), 1 << 20));
  const int64_t head_tiles = decode_head_tiles(group);
  const int ctas_per_sm = decode_config(format, static_cast<int>(head_dim), decode_n_tiles(group)).ctas_per_sm;
  const bool bandwidth_bound = decode_elem_bits(format) == 16;
  const int64_t base = std::max<int64_t>(1, batch * num_kv_heads * head_tiles);
  const int64_t sms = std::max(num_sms, 1);
  // Each split keeps at least one stage per warp of capacity.
  const int64_t split_tokens = int64_t{kDecodeWarps} * decode_stage_rows(format, static_cast<int>(head_dim));
  const int64_t max_splits = std::max<int64_t>(
      1, std::min<int64_t>(kDecodeMaxSplits, (std::max<int64_t>(capacity, 1) + split_tokens - 1) / split_tokens));
  int best = 1;
  double best_cost = 0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    // Above 8, powers of two only: a split's tiles go round-robin to 4 warps, and counts like 18 or 26 leave the
    // warps of most CTAs unevenly loaded (Llama-3-8B B 1, int4: 13.4 µs at 18 splits, 13.05 at 32, 11.1 at 16).
    if (s > 8 && (s & (s - 1)) != 0) continue;
    const int64_t per_sm = (base * s + sms - 1) / sms;  // CTAs on the busiest SM
    const int64_t units = bandwidth_bound ? per_sm : (per_sm + ctas_per_sm - 1) / ctas_per_sm;
    const double cost = static_cast<double>(units) *
                            (static_cast<double>(capacity) / static_cast<double>(s) + kStartupTokens) +
                        static_cast<double>(per_sm - units) * kCoResidentTokens +
                        (s > 1 ? kMergeTokens + kMergeTokensPerSplit * static_cast<double>(s) : 0);
    if (s == 1 || cost < best_cost * 0.98) {  // more splits only for a clear gain
      best = static_cast<int>(s);
      best_cost = cost;
    }
  }
  return best;
}

std::size_t decode_workspace_bytes_for(int64_t batch, int64_t num_new, int64_t num_q_heads, int64_t head_dim,
                                       int num_splits, bool balanced) {
  if (num_splits <= 1) return 0;
  const int64_t rows = batch * num_new * num_q_heads * num_splits;
  const int64_t table = batch * 2 * static_cast<int64_t>(sizeof(int32_t));  // (first slot, splits) per sequence
  const int64_t bytes = balanced && decode_balanced(batch, num_splits)
                            ? decode_workspace_plan_offset(rows, head_dim) + table
                            : rows * (head_dim + 1) * static_cast<int64_t>(sizeof(float));
  return static_cast<std::size_t>((bytes + 255) / 256 * 256);
}

}  // namespace detail

std::size_t decode_workspace_bytes(const TensorView& q, const KVCache& cache, const DecodeParams& params) {
  return detail::check_decode_workspace("tessera::attention::decode_workspace_bytes", q, cache, params);
}

void decode(const TensorView& q, const KVCache& cache, const TensorView& cache_seqlens, const TensorView& o,
            const std::optional<TensorView>& lse, const Workspace& workspace, const DecodeParams& params,
            cudaStream_t stream) {
  const detail::DecodeProblem pb =
      detail::check_decode("tessera::attention::decode", q, cache, cache_seqlens, o, lse, workspace, params);
  if (pb.batch == 0 || pb.num_q_heads == 0) return;
  tessera::detail::require_hopper("tessera::attention::decode");
  detail::launch_decode(pb, stream);
}

void append_kv(const TensorView& k_new, const TensorView& v_new, const TensorView& positions, const KVCache& cache,
               cudaStream_t stream) {
  const detail::AppendProblem pb = detail::check_append("tessera::attention::append_kv", k_new, v_new, positions, cache);
  if (pb.batch == 0 || pb.num_new == 0) return;
  tessera::detail::require_hopper("tessera::attention::append_kv");
  detail::launch_append(pb, stream);
}

}  // namespace tessera::attention
