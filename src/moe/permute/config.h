// permute: the pure choice of chunking and the workspace layout, shared by the workspace query and the launch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tessera::moe::detail {

inline constexpr int kPermuteMaxExperts = 1024;
inline constexpr int kPermuteMaxTopk = 32;
inline constexpr int kPermuteMaxChunkEntries = 320;  // max(32, E/4) rounded up to whole tokens, k <= 32
// At most this many copies (T·k) go through one launch instead of three: every block of the scatter pass then counts,
// scans and ranks all of them itself (a few hundred ids and E <= 1024 experts: less work than a launch costs).
inline constexpr int kPermuteSinglePassEntries = 256;
static_assert(kPermuteSinglePassEntries <= kPermuteMaxChunkEntries, "a single pass ranks its copies as one chunk");

struct PermuteProblem {
  int64_t num_tokens;
  int topk;
  int num_experts;
  int pad_multiple;
};

struct PermuteConfig {
  bool single_pass;       // one launch, one chunk of every token (T·k <= kPermuteSinglePassEntries)
  int tokens_per_chunk;   // the unit of stable ranking: one block of each pass handles one chunk
  int64_t num_chunks;
  int64_t capacity_rows;
  // Workspace layout (byte offsets, each 16-byte aligned).
  std::size_t counter_offset;  // uint32: blocks of the scan pass that have finished
  std::size_t totals_offset;   // int32 [E]
  std::size_t ids_offset;      // int32 [T*k]: ids with the dropped ones as -1
  std::size_t hist_offset;     // int32 [num_chunks, E]: per-chunk counts, then their exclusive prefix per expert
  std::size_t workspace_bytes;
};

inline std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }

inline PermuteConfig select_permute_config(const PermuteProblem& p) {
  PermuteConfig c{};
  // Enough entries per chunk that the per-chunk histogram (E ints) stays small next to the chunk itself.
  const int target_entries = p.num_experts / 4 > 32 ? p.num_experts / 4 : 32;
  c.single_pass = p.num_tokens * p.topk <= kPermuteSinglePassEntries;
  c.tokens_per_chunk = c.single_pass ? static_cast<int>(p.num_tokens > 1 ? p.num_tokens : 1)
                                     : (target_entries + p.topk - 1) / p.topk;
  c.num_chunks = (p.num_tokens + c.tokens_per_chunk - 1) / c.tokens_per_chunk;
  c.capacity_rows = p.num_tokens * p.topk + (p.pad_multiple > 1 ? int64_t{p.num_experts} * (p.pad_multiple - 1) : 0);
  std::size_t off = 0;
  c.counter_offset = off;
  off += 16;
  c.totals_offset = off;
  off += align16(sizeof(int32_t) * p.num_experts);
  c.ids_offset = off;
  off += align16(sizeof(int32_t) * static_cast<std::size_t>(p.num_tokens * p.topk));
  c.hist_offset = off;
  off += align16(sizeof(int32_t) * static_cast<std::size_t>(c.num_chunks) * p.num_experts);
  c.workspace_bytes = off;
  return c;
}

}  // namespace tessera::moe::detail
