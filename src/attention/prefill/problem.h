// Internal: a prefill call in the form the launcher consumes (docs/perf/prefill.md). Either packed variable-length
// q [total_q, HQ, D], k and v [total_k, HKV, D] with device cu_seqlens, or a plain batch q [B, Sq, HQ, D], k and v
// [B, Sk, HKV, D] (cu_seqlens null: every sequence has seqlen_q queries and seqlen_k keys); bf16 or fp16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "attention/decode/problem.h"
#include "tessera/attention.h"
#include "tessera/tensor.h"

namespace tessera::attention::detail {

struct PrefillProblem {
  int batch = 0;         // B
  int num_q_heads = 0;   // HQ, a multiple of HKV
  int num_kv_heads = 0;  // HKV
  int head_dim = 0;      // 64, 128 or 256
  bool fp16 = false;     // q, k, v and o: fp16 (true) or bf16
  // Strides in elements (batch strides: the plain batch only); the last dim of every tensor is unit-stride, rows
  // 16-byte aligned.
  const void* q = nullptr;
  int64_t q_stride_token = 0, q_stride_head = 0, q_stride_batch = 0;
  const void* k = nullptr;
  int64_t k_stride_token = 0, k_stride_head = 0, k_stride_batch = 0;
  const void* v = nullptr;
  int64_t v_stride_token = 0, v_stride_head = 0, v_stride_batch = 0;
  void* o = nullptr;
  int64_t o_stride_token = 0, o_stride_head = 0, o_stride_batch = 0;
  float* lse = nullptr;  // optional [total_q, HQ] or [B, Sq, HQ] (natural log)
  int64_t lse_stride_token = 0, lse_stride_head = 0, lse_stride_batch = 0;
  const int32_t* cu_seqlens_q = nullptr;  // [B + 1] on the device; both null: the plain batch
  const int32_t* cu_seqlens_k = nullptr;
  // Rows of q and of k / v per batch entry (the tensors' extents: TMA reads nothing past them): total_q and total_k
  // when packed, Sq and Sk for the plain batch.
  int64_t total_q = 0, total_k = 0;
  int max_seqlen_q = 0;              // host bound on every sequence's Sq: sizes the grid only
  // K/V from the decode cache (prefill_with_cache): cache_seqlens non-null, k / v and their strides unused.
  const int32_t* cache_seqlens = nullptr;  // [B] on the device
  CacheDesc cache;
  float softmax_scale = 0.0f;        // resolved (never 0)
  float softcap = 0.0f;
  int window = 0;
  bool causal = false;
  int pack_gqa = -1;                 // PrefillParams::pack_gqa
};

// GQA packing puts a KV head's query heads in one 128-row tile: at least one token of each.
inline constexpr int kPrefillMaxPackedGroup = 128;

// The tile's query rows: tokens × heads (kernel.cuh, PrefillArgs::q_tokens / q_heads). Packed when asked, or when
// chosen (-1) and it takes at least an eighth fewer tiles than one head per tile for sequences of max_seqlen_q
// queries (short queries; a long causal sequence packed would take as many tiles, each with more masked keys on the
// diagonal).
struct PrefillRows {
  int tokens = 128, heads = 1;
};
inline PrefillRows prefill_rows(const PrefillProblem& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t s = p.max_seqlen_q;
  if (p.pack_gqa == 0 || group < 2 || group > kPrefillMaxPackedGroup) return {};
  const int tokens = 128 / group;
  const int64_t packed_tiles = (s + tokens - 1) / tokens, head_tiles = group * ((s + 127) / 128);
  if (p.pack_gqa == 1 || 8 * packed_tiles <= 7 * head_tiles) return {tokens, group};
  return {};
}

// Validation (check.cpp): every rule of tessera::attention::prefill / prefill_varlen (include/tessera/attention.h) on
// shapes, dtypes, layouts, memory overlap and params, then the devices; throws tessera::Error naming `op` and the
// argument. cu_seqlens_q and cu_seqlens_k present: the packed form (rank-3 q, k, v, o, rank-2 lse); both absent:
// the plain batch (rank 4 and 3; max_seqlen_q is not read).
PrefillProblem check_prefill(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                             const std::optional<TensorView>& cu_seqlens_q,
                             const std::optional<TensorView>& cu_seqlens_k, int64_t max_seqlen_q, const TensorView& o,
                             const std::optional<TensorView>& lse, const PrefillParams& params);

// prefill_with_cache's rules: q, cu_seqlens_q, max_seqlen_q, o and lse as in the packed form; the cache by
// check_cache (decode's rules, q's dtype for kNative), cache_seqlens int32 [B].
PrefillProblem check_prefill_cache(const char* op, const TensorView& q, const TensorView& cu_seqlens_q,
                                   int64_t max_seqlen_q, const KVCache& cache, const TensorView& cache_seqlens,
                                   const TensorView& o, const std::optional<TensorView>& lse,
                                   const PrefillParams& params);

void launch_prefill(const PrefillProblem& problem, cudaStream_t stream);

}  // namespace tessera::attention::detail
