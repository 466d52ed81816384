// Decode kernel shape: head tile, pipeline depth, resident CTAs per SM. Plain constexpr C++ so that the host-side
// split choice (api.cpp) and the kernel (kernel.cuh) read the same numbers.
#pragma once

#include "tessera/attention.h"

namespace tessera::attention::detail {

inline constexpr int kDecodeWarps = 4;
inline constexpr int kDecodeThreads = 32 * kDecodeWarps;
// Bits per cached element: 16 (bf16/fp16), 8 (fp8, the int8 formats), 4 (the int4 formats).
constexpr int decode_elem_bits(KVFormat format) {
  return format == KVFormat::kNative ? 16
         : (format == KVFormat::kFP8 || format == KVFormat::kInt8 || format == KVFormat::kInt8KChannel) ? 8
                                                                                                          : 4;
}

// Tokens one warp takes per pipeline step (one TMA box of key rows and one of value rows, one barrier wait, one
// softmax update): 32 where a row is at most 128 bytes (8-bit rows of D <= 128, every 4-bit row, 16-bit rows of
// D = 64), so that the per-step work (copy issue, waits, max reduction) is spread over two mma tiles; 16 for wider
// rows, whose 32-row stages would not leave two stages per warp in shared memory.
constexpr int decode_stage_rows(KVFormat format, int head_dim) {
  return head_dim * decode_elem_bits(format) / 8 <= 128 ? 32 : 16;
}

// Query heads of one KV head go to the tensor cores' N: n-tiles of 8 heads, one or two per CTA.
constexpr int decode_n_tiles(int group) { return group > 8 ? 2 : 1; }
constexpr int decode_head_tiles(int group) { return (group + 8 * decode_n_tiles(group) - 1) / (8 * decode_n_tiles(group)); }

// Whether a decode grid is launched as a programmatic dependent of the stream's previous kernel (common/pdl.h, v16 in
// docs/perf/decode.md): only grids of at most one CTA per SM. Their CTAs then do their set-up while the previous
// kernel finishes (H200, back-to-back calls in a graph: hq8kv1 B 1 and B 8, Llama-3-8B B 1, 0.3-0.7 us a call).
// Larger grids, early-resident beside the previous kernel's CTAs, ran slower (hq8kv1 B 32 8- and 4-bit rows +7 to
// +23 %; most likely cause: several of their CTAs stacked on one SM while others stayed free), and grids of one wave
// or more gained nothing measurable.
constexpr bool decode_launch_programmatic(long long grid, int num_sms) { return grid <= num_sms; }

// Length-balanced splits (v18, docs/perf/decode.md), where DecodeParams::balance_splits asks for them: with
// kDecodeBalanceMinBatch..kDecodeBalanceMaxBatch sequences and a split count S >= 2, S is a budget, not a
// per-sequence count: the grid's B·S splits (per KV head and head tile) go to the sequences by their device lengths.
// Every decode CTA reads all B lengths and computes the same plan (kernel.cuh, decode_plan; each sequence's split 0
// leaves (first slot, splits) in the workspace for the merge): equal lengths are split as without it (ceil(stages /
// S) stages a split; at least 4); a skewed batch gives its long sequences more (a Zipf batch of 64 at S = 2 ran its
// longest sequence on 2 CTAs of 4096 tokens each). Not balanced: one sequence; more than kDecodeBalanceMaxBatch (every CTA would read
// all lengths); one split (no workspace and no merge kernel to spend). Off by default: on equal lengths the plan
// and the merge's table cost 2-14 % (v18d).
inline constexpr int kDecodeBalanceMinBatch = 2;
inline constexpr int kDecodeBalanceMaxBatch = 512;
constexpr bool decode_balanced(long long batch, int splits) {
  return batch >= kDecodeBalanceMinBatch && batch <= kDecodeBalanceMaxBatch && splits >= 2;
}
// The most splits one sequence gets in a balanced plan (and so what the merge covers): the budget S, or 32 where that
// is more (a long sequence among short ones), never above kDecodeMaxSplits.
constexpr int decode_max_seq_splits(int splits) {
  return splits > 32 ? (splits < kDecodeMaxSplits ? splits : kDecodeMaxSplits) : 32;
}

// ---- the balanced plan's arithmetic (kernel.cuh, decode_plan; host and device, so that the CPU tests check it) ----
// A sequence's length as the kernel uses it: the device value clamped to [0, capacity].
constexpr int decode_clamped_len(int raw, long long capacity) {
  return raw < 0 ? 0 : (raw > capacity ? static_cast<int>(capacity) : raw);
}
// lo_i from lim_i: lim - window without wrapping (lim may be negative (S > L), window up to the capacity < 2^31).
constexpr int decode_lo(int lim, int window) { return window > 0 && lim > window ? lim - window : 0; }
// Stages of 2^rows_log2 tokens a sequence of length len reads: from its first attended key's stage to len (query
// token i of num_new attends to keys [lo_i, lim_i), lim_i = len - num_new + 1 + i, lo_i = max(0, lim_i - window)).
constexpr int decode_num_tiles(int len, int num_new, int window, int rows_log2) {
  const int lo = decode_lo(len - num_new + 1, window);
  const int tile_base = (lo >> rows_log2) << rows_log2;
  return len > lo ? static_cast<int>((static_cast<long long>(len) - tile_base + (1 << rows_log2) - 1) >> rows_log2)
                  : 0;
}
// The first stages-per-split of a plan over `total` stages (longest: the most of one sequence) and `budget` = B·S
// splits: the stages over the budget, at least what keeps every sequence within max_seq_splits, at least one stage
// per warp. 32-bit result: a stage count is below 2^27.
constexpr int decode_plan_first_chunk(long long total, int longest, int budget, int max_seq_splits) {
  int chunk = static_cast<int>((total + budget - 1) / budget);
  const int by_cap = (longest + max_seq_splits - 1) / max_seq_splits;
  chunk = chunk > by_cap ? chunk : by_cap;
  return chunk > kDecodeWarps ? chunk : kDecodeWarps;
}
// A sequence's splits at `chunk` stages each: at least one (an empty sequence writes o = 0 and lse = -inf); tiles < 0
// marks no sequence (0 splits).
constexpr int decode_plan_splits(int tiles, int chunk) {
  return tiles < 0 ? 0 : (tiles > chunk ? (tiles + chunk - 1) / chunk : 1);
}
// The next chunk when the splits' count exceeds the budget: scaled by count / budget, and at least one more.
constexpr int decode_plan_next_chunk(int chunk, int count, int budget) {
  const int scaled = static_cast<int>(static_cast<long long>(chunk) * count / budget);
  return scaled > chunk ? scaled : chunk + 1;
}

inline constexpr int kDecodeSmemAlign = 1024;  // the 128-byte TMA swizzle repeats every 1024 bytes
inline constexpr int kDecodeConstBytes = 16;   // shared constants: one uint4

struct DecodeConfig {
  int stage_bytes;   // one warp's staging for one stage: key and value rows, and the stage's scale pairs
  int q_bytes;       // query fragments (a multiple of kDecodeSmemAlign)
  int bar_off;       // mbarriers (one per warp and stage), after the staging or the merge area
  int const_off;     // kDecodeConstBytes of constants after the barriers (the value-centring mma operand)
  int stages;        // tiles in flight per warp (ring depth)
  int ctas_per_sm;   // the occupancy the stages are sized for (and the split heuristic counts)
  int smem_bytes;    // dynamic shared memory per CTA
};

constexpr DecodeConfig decode_config(KVFormat format, int head_dim, int n_tiles) {
  const int bits = decode_elem_bits(format);
  const bool pairs = format == KVFormat::kInt8 || format == KVFormat::kInt8KChannel || bits == 4;
  const bool key_channel = kv_key_per_channel(format);
  const int groups = format == KVFormat::kInt4Group32 ? head_dim / kInt4GroupSize : 1;
  DecodeConfig c{};
  // Per warp and stage: key rows and value rows of head_dim * bits / 8 bytes, and their scale pairs (per-channel
  // keys: the block's 2·D fp16 scales and offsets, then the value rows' pairs).
  const int rows = decode_stage_rows(format, head_dim);
  c.stage_bytes = 2 * rows * (head_dim * bits / 8) +
                  (!pairs ? 0 : key_channel ? 4 * head_dim + rows * 4 : 2 * rows * 4 * groups);
  c.q_bytes = n_tiles * (head_dim / 16) * 32 * 8;
  const int merge_bytes = kDecodeWarps * 8 * n_tiles * (head_dim + 2) * 4;
  // Besides the ring: the alignment slack of the dynamic base, the mbarriers (8 stages at most), the constants.
  const int fixed = c.q_bytes + kDecodeSmemAlign + kDecodeWarps * 8 * 8 + kDecodeConstBytes;
  // Narrower rows leave room for more CTAs: 2 (16-bit), 3 (8-bit), 4 (4-bit) per SM, as far as the registers
  // allow (the O accumulators take n_tiles * head_dim / 4 of them, about 80 more for the rest).
  // (16-bit rows at 3 per SM with 2 stages measured 7-10 % slower at B >= 64 than 2 per SM with 3 stages.)
  int ctas = bits == 16 ? 2 : (bits == 8 ? 3 : 4);
  // Per-channel keys hold the stage's scaled query fragments in registers too (n_tiles * head_dim / 8). Their
  // stages carry 4·D bytes of block scales: at 4 CTAs per SM the 4-bit rows get two stages per warp, the 8-bit rows
  // at 3 CTAs two as well. Measured (H200, same-run A/B): 8-bit rows run 4-6 % faster at B >= 256 with three stages
  // at 2 CTAs per SM; 4-bit rows 4-17 % slower with three stages at 3 CTAs than with two at 4 (docs/perf/decode.md,
  // v11).
  const int regs = 80 + n_tiles * head_dim / 4 + (key_channel ? n_tiles * head_dim / 8 : 0);
  const int min_stages = key_channel && bits == 8 ? 3 : 2;
  const int by_regs = 65536 / (kDecodeThreads * regs);
  if (ctas > by_regs) ctas = by_regs < 1 ? 1 : by_regs;
  constexpr int kSmemPerSm = 228 * 1024, kReservedPerCta = 1024, kMaxPerCta = 227 * 1024;
  for (;; --ctas) {
    int budget = kSmemPerSm / ctas - kReservedPerCta;
    if (budget > kMaxPerCta) budget = kMaxPerCta;
    int stages = (budget - fixed) / (kDecodeWarps * c.stage_bytes);
    if (stages > 8) stages = 8;
    if (stages >= min_stages || ctas == 1) {
      c.stages = stages < 2 ? 2 : stages;
      c.ctas_per_sm = ctas;
      break;
    }
  }
  const int staging = kDecodeWarps * c.stages * c.stage_bytes;
  c.bar_off = c.q_bytes + (staging > merge_bytes ? staging : merge_bytes);
  c.const_off = c.bar_off + kDecodeWarps * c.stages * 8;
  c.smem_bytes = kDecodeSmemAlign + c.const_off + kDecodeConstBytes;
  return c;
}

}  // namespace tessera::attention::detail
