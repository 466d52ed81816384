// fused_gate device code. A token is ranked by a segment of kLanes lanes (32: a warp, 16: half a warp, so that
// one warp ranks two tokens and shares every warp-wide step between them). Each lane holds kV contiguous experts,
// so a lower lane always holds lower expert ids and "lowest lane wins" is "lowest index wins".
//
// Ranking works on 32-bit order keys (common/numeric.cuh): a segment-wide argmax is a redux.sync plus a ballot.
// Each lane caches its best three remaining experts and rescans its slice only on its third win (LaneTop3).
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "common/numeric.cuh"
#include "moe/fused_gate/config.h"
#include "ptx/ldst.cuh"
#include "ptx/math.cuh"

namespace tessera::moe::detail {

using tessera::detail::key_value;
using tessera::detail::kNoCandidate;
using tessera::detail::order_key;
using tessera::detail::to_float;

struct GateKernelParams {
  const void* logits;
  int64_t row_stride;  // elements
  const void* bias;    // nullptr: no bias
  int bias_dtype;      // 0 fp32, 1 bf16, 2 fp16
  float* weights;
  int32_t* ids;
  int64_t num_tokens;
  int num_experts;
  int num_groups;
  int group_size;
  int topk_groups;
  int topk;
  int num_shared;
  float shared_weight;
  float scaling;
  bool renormalize;
  bool softmax;
  bool top2_sum;
  int lanes_per_group;  // 0: shared-memory group path
  int lanes_per_group_log2;
  int values_per_lane_log2;
  bool compact;  // lane-aligned groups keep at most half the experts: rank only theirs, kV/2 per lane
  bool vector_loads;
  int smem_floats_per_token;  // shared memory per token slot
};

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kGateThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;
// Below this logit sigmoid(x) and e^x agree to within fp32 rounding (relative difference e^x < 2^-28).
constexpr float kSigmoidAsExp = -20.0f;
// DeepSeek-V3's sigmoid score, as the selection ranks it and the weights use it.
__device__ __forceinline__ float sigmoid_score(float x) {
  return ptx::rcp_approx_ftz(1.0f + ptx::ex2_approx_ftz(-kLog2e * x));
}

// Loads the kV logits of this lane as floats; experts past E (and inactive segments) read as -inf.
template <typename T, int kV>
__device__ __forceinline__ void load_logits(const T* row, int first, int num_experts, bool vector_loads,
                                            bool active, float (&x)[kV]) {
  if (!active) {
#pragma unroll
    for (int i = 0; i < kV; ++i) x[i] = -INFINITY;
    return;
  }
  if constexpr ((kV * sizeof(T)) % 16 == 0) {
    if (vector_loads && first + kV <= num_experts) {
      constexpr int kChunks = kV * sizeof(T) / 16;
      constexpr int kPerChunk = 16 / sizeof(T);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const uint4 raw = ptx::ld_global_nc_na_v4(row + first + c * kPerChunk);
        const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < kPerChunk; ++i) x[c * kPerChunk + i] = to_float(vals[i]);
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < kV; ++i) x[i] = first + i < num_experts ? to_float(row[first + i]) : -INFINITY;
}

__device__ __forceinline__ float load_bias(const void* bias, int dtype, int e) {
  switch (dtype) {
    case 1: return to_float(static_cast<const __nv_bfloat16*>(bias)[e]);
    case 2: return to_float(static_cast<const __half*>(bias)[e]);
    default: return static_cast<const float*>(bias)[e];
  }
}

// Segment-wide operations. kLanes == 32: the whole warp; kLanes == 16: each half-warp separately (all 32 lanes
// must call). redux.sync has a single warp-wide result, so a half-warp max is two reductions with the other half
// contributing 0 (below every key).
template <int kLanes>
__device__ __forceinline__ uint32_t segment_max(uint32_t v, int seg) {
  if constexpr (kLanes == 32) {
    return __reduce_max_sync(kFullMask, v);
  } else {
    static_assert(kLanes == 16, "segments are a warp or half a warp");
    const uint32_t lo = __reduce_max_sync(kFullMask, seg == 0 ? v : 0u);
    const uint32_t hi = __reduce_max_sync(kFullMask, seg == 1 ? v : 0u);
    return seg == 0 ? lo : hi;
  }
}
// The lowest lane (within the segment) whose predicate holds.
template <int kLanes>
__device__ __forceinline__ int segment_first(bool pred, int seg) {
  const unsigned ballot = __ballot_sync(kFullMask, pred);
  const unsigned mine = kLanes == 32 ? ballot : (ballot >> (seg * kLanes)) & ((1u << kLanes) - 1u);
  return __ffs(mine) - 1;
}
template <int kLanes>
__device__ __forceinline__ float segment_sum(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
template <int kLanes>
__device__ __forceinline__ float segment_fmax(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// The best three keys of a lane among its N candidates (ties: lower local index first). `scan` optionally skips
// every key that does not come after (after_key, after_idx) in rank order, i.e. the ones already selected.
// `cached` counts the leading entries known to be exact: a win pops one; a win with one known entry left rescans.
template <int N>
struct LaneTop3 {
  uint32_t key[3];
  int idx[3];
  int cached;

  __device__ __forceinline__ void scan(const uint32_t (&keys)[N], bool only_after, uint32_t after_key,
                                       int after_idx) {
    key[0] = key[1] = key[2] = kNoCandidate;
    idx[0] = idx[1] = idx[2] = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      uint32_t k = keys[i];
      if (only_after && !(k < after_key || (k == after_key && i > after_idx))) k = kNoCandidate;
      // Branch-free insertion into the sorted three; strict > keeps the earlier index first on ties.
      const bool c0 = k > key[0], c1 = k > key[1], c2 = k > key[2];
      key[2] = c1 ? key[1] : (c2 ? k : key[2]);
      idx[2] = c1 ? idx[1] : (c2 ? i : idx[2]);
      key[1] = c0 ? key[0] : (c1 ? k : key[1]);
      idx[1] = c0 ? idx[0] : (c1 ? i : idx[1]);
      key[0] = c0 ? k : key[0];
      idx[0] = c0 ? i : idx[0];
    }
    cached = 3;
  }

  // The lane's best was just selected: move to the next one.
  __device__ __forceinline__ void pop(const uint32_t (&keys)[N]) {
    if (cached > 1) {
      key[0] = key[1]; idx[0] = idx[1];
      key[1] = key[2]; idx[1] = idx[2];
      key[2] = kNoCandidate;
      --cached;
    } else {
      scan(keys, true, key[0], idx[0]);
    }
  }
};

// The best two keys of a lane, values only (for group scores).
template <int N>
__device__ __forceinline__ void lane_top2_values(const uint32_t (&keys)[N], uint32_t& first, uint32_t& second) {
  first = second = kNoCandidate;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    second = max(second, min(first, keys[i]));
    first = max(first, keys[i]);
  }
}

// topk rounds of a segment-wide argmax over the lanes' cached bests; the winner records the id of its best (its
// expert `first_id + idx`) in id_smem[round] and moves on to its next best.
template <int N, int kLanes>
__device__ __forceinline__ void select_topk(LaneTop3<N>& top, const uint32_t (&keys)[N], int first_id, int topk,
                                            int seg, int tl, int* id_smem) {
  for (int r = 0; r < topk; ++r) {
    const uint32_t best = segment_max<kLanes>(top.key[0], seg);
    const int winner = segment_first<kLanes>(top.key[0] == best, seg);
    if (tl == winner) {
      id_smem[r] = first_id + top.idx[0];
      top.pop(keys);
    }
  }
}

// ---- per-token building blocks shared by the kernels ----------------------------------------------------------

__device__ __forceinline__ uint32_t word_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint32_t word_bits(uint32_t v) { return v; }

// A lane's kV contiguous 4-byte values (scores or keys) into shared memory at [first, first + kV), in 16-byte
// stores where kV allows.
template <typename Word, int kV>
__device__ __forceinline__ void store_slice(Word* dst, int first, const Word (&v)[kV]) {
  static_assert(sizeof(Word) == 4, "4-byte words");
  if constexpr (kV % 4 == 0) {
#pragma unroll
    for (int i = 0; i < kV; i += 4)
      *reinterpret_cast<uint4*>(dst + first + i) =
          make_uint4(word_bits(v[i]), word_bits(v[i + 1]), word_bits(v[i + 2]), word_bits(v[i + 3]));
  } else {
#pragma unroll
    for (int i = 0; i < kV; ++i) dst[first + i] = v[i];
  }
}

// Scores (fp32 whatever the input dtype) and order keys of this lane's kV experts. scores_smem (indexed by expert)
// keeps the scores for write_token's weights. Inactive segments get no candidates.
template <int kV, int kLanes>
__device__ __forceinline__ void token_scores_and_keys(const GateKernelParams& p, float (&score)[kV],
                                                      const float (&bias)[kV], int first, bool active,
                                                      float* scores_smem, uint32_t (&keys)[kV]) {
  const int E = p.num_experts;
  if (p.softmax) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kV; ++i) m = fmaxf(m, score[i]);
    m = segment_fmax<kLanes>(m);
    float sum = 0.0f;
    const float m_log2e = m * kLog2e;
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      score[i] = first + i < E ? ptx::ex2_approx_ftz(fmaf(score[i], kLog2e, -m_log2e)) : 0.0f;
      sum += score[i];
    }
    const float inv = 1.0f / segment_sum<kLanes>(sum);
#pragma unroll
    for (int i = 0; i < kV; ++i) score[i] *= inv;
  } else {
#pragma unroll
    for (int i = 0; i < kV; ++i) score[i] = sigmoid_score(score[i]);
  }
  store_slice(scores_smem, first, score);
#pragma unroll
  for (int i = 0; i < kV; ++i) keys[i] = (active && first + i < E) ? order_key(score[i] + bias[i]) : kNoCandidate;
}

// Lane-aligned groups: every lane of group g ends with g's score key (top-2 sum or max), merged by butterflies.
template <int kV>
__device__ __forceinline__ uint32_t lane_aligned_group_key(const GateKernelParams& p, const uint32_t (&keys)[kV]) {
  uint32_t g1, g2;
  lane_top2_values(keys, g1, g2);
  for (int o = 1; o < p.lanes_per_group; o <<= 1) {
    const uint32_t o1 = __shfl_xor_sync(kFullMask, g1, o);
    const uint32_t o2 = __shfl_xor_sync(kFullMask, g2, o);
    g2 = max(min(g1, o1), max(g2, o2));
    g1 = max(g1, o1);
  }
  return p.top2_sum ? order_key(key_value(g1) + key_value(g2)) : g1;
}

// topk_groups rounds of a segment-wide argmax over the group keys held by segment lanes 0..G-1; returns the kept
// groups as a bit mask (bit g: group g).
template <int kLanes>
__device__ __forceinline__ uint32_t select_groups(uint32_t gk, int topk_groups, int seg, int tl) {
  uint32_t kept = 0;
  for (int r = 0; r < topk_groups; ++r) {
    const uint32_t best = segment_max<kLanes>(gk, seg);
    const int winner = segment_first<kLanes>(gk == best, seg);
    kept |= 1u << winner;
    if (tl == winner) gk = kNoCandidate;
  }
  return kept;
}

// The kept groups' keys, concatenated in group order, N per lane starting at candidate c0 (N divides the group
// size, so a lane's candidates share one group). Returns the expert id of the lane's first candidate.
template <int N>
__device__ __forceinline__ int gather_kept(const GateKernelParams& p, const uint32_t* key_smem, uint32_t kept,
                                           int c0, uint32_t (&ckeys)[N]) {
  const int group_size_log2 = p.lanes_per_group_log2 + p.values_per_lane_log2;
  const bool has = c0 < (p.topk_groups << group_size_log2);
  int cand_first = 0;
  if (has) {
    // The n-th kept group: drop the n lowest set bits (n < topk_groups, a few steps).
    uint32_t rest = kept;
    for (int n = c0 >> group_size_log2; n > 0; --n) rest &= rest - 1;
    const int g = __ffs(rest) - 1;
    cand_first = (g << group_size_log2) + (c0 & ((1 << group_size_log2) - 1));
  }
#pragma unroll
  for (int i = 0; i < N; ++i) ckeys[i] = has ? key_smem[cand_first + i] : kNoCandidate;
  return cand_first;
}

// Weights and ids of one token from the ids picked per round (id_smem) and the scores (scores_smem); `row` is the
// token's logits (read again only where a chosen score underflowed, see below).
template <typename T, int kLanes>
__device__ __forceinline__ void write_token(const GateKernelParams& p, int64_t token, bool active, int tl,
                                            const int* id_smem, const float* scores_smem, const T* row) {
  const int my_id = tl < p.topk ? id_smem[tl] : -1;
  const bool routed = tl < p.topk && active;
  float w = routed ? scores_smem[my_id] : 0.0f;
  if (p.renormalize) {
    float sum = segment_sum<kLanes>(w);
    // A chosen score that underflowed from a finite logit (a sigmoid below about -88 flushes to 0; a softmax score
    // 87 or more below the row's best, which a selection bias can choose, is 0 or subnormal) weighs 0 or a few bits,
    // and where all of them did, 0 / 0 (NaN) or 1 / (a subnormal sum) (inf). The renormalized softmax is exactly the
    // softmax of the chosen logits; the renormalized sigmoid is too where the largest chosen logit is below -20
    // (sigmoid(x) = e^x to within fp32 rounding there). So a segment with such a score takes its chosen logits again
    // (from global memory: L2 still holds the row) and weighs them so. The vote makes the branch warp-uniform (its
    // shuffles need every lane; a warp may rank two tokens); only a segment with an underflowed score changes path,
    // so every other row keeps its bits and pays one vote. (w < FLT_MIN: 0 or subnormal; NaN compares false.)
    if (__any_sync(kFullMask, routed && w < FLT_MIN)) {
      const float x = routed ? to_float(row[my_id]) : -INFINITY;
      const bool flushed = routed && w < FLT_MIN && x > -INFINITY;
      const float m = segment_fmax<kLanes>(x);
      const bool any_flushed = segment_fmax<kLanes>(flushed ? 1.0f : 0.0f) > 0.0f;
      const float e = routed ? ptx::ex2_approx_ftz((x - m) * kLog2e) : 0.0f;
      const float e_sum = segment_sum<kLanes>(e);
      if (any_flushed && (p.softmax || m < kSigmoidAsExp)) w = e, sum = e_sum;
    }
    // One correctly rounded reciprocal, then a product: w / sum within an ulp, without a division per lane.
    w *= 1.0f / sum;
  }
  w *= p.scaling;
  if (!active) return;
  const int width = p.topk + p.num_shared;
  float* w_row = p.weights + token * width;
  int32_t* id_row = p.ids + token * width;
  if (tl < p.topk) {
    w_row[tl] = w;
    id_row[tl] = my_id;
  }
  for (int j = tl; j < p.num_shared; j += kLanes) {
    w_row[p.topk + j] = p.shared_weight;
    id_row[p.topk + j] = p.num_experts + j;
  }
}

template <int kV>
__device__ __forceinline__ void load_bias_slice(const GateKernelParams& p, int first, float (&bias)[kV]) {
#pragma unroll
  for (int i = 0; i < kV; ++i)
    bias[i] = (p.bias != nullptr && first + i < p.num_experts) ? load_bias(p.bias, p.bias_dtype, first + i) : 0.0f;
}

// ---- the general kernel: a segment of kLanes lanes per token -----------------------------------------------

template <typename T, int kV, int kLanes>
__global__ void __launch_bounds__(kGateThreads) fused_gate_kernel(const GateKernelParams p) {
  constexpr int kSegs = 32 / kLanes;
  extern __shared__ __align__(16) float smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int seg = lane / kLanes;
  const int tl = lane % kLanes;  // lane within the token's segment
  const int seg_base = seg * kLanes;
  float* slot = smem + (warp * kSegs + seg) * p.smem_floats_per_token;
  int* id_smem = reinterpret_cast<int*>(slot);  // [kGateIdSlots]: the id picked in round r
  float* scores_smem = slot + kGateIdSlots;     // [kLanes * kV]
  uint32_t* key_smem = reinterpret_cast<uint32_t*>(scores_smem + kLanes * kV);  // [kLanes * kV] where used
  const int E = p.num_experts;
  const int first = tl * kV;

  float bias[kV];
  load_bias_slice(p, first, bias);

  constexpr int kWarps = kGateThreads / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * kSegs;
  int64_t base = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kSegs;  // first token of this warp
  const T* logits = static_cast<const T*>(p.logits);

  float x_next[kV];
  load_logits<T, kV>(logits + (base + seg) * p.row_stride, first, E, p.vector_loads, base + seg < p.num_tokens,
                     x_next);

  // The loop bound is warp-uniform: both segments take part in every shuffle even when one has no token.
  for (; base < p.num_tokens; base += stride) {
    const int64_t token = base + seg;
    const bool active = token < p.num_tokens;
    float score[kV];
#pragma unroll
    for (int i = 0; i < kV; ++i) score[i] = x_next[i];
    // Prefetch the next row while this one is ranked.
    load_logits<T, kV>(logits + (token + stride) * p.row_stride, first, E, p.vector_loads,
                       token + stride < p.num_tokens, x_next);

    uint32_t keys[kV];
    token_scores_and_keys<kV, kLanes>(p, score, bias, first, active, scores_smem, keys);

    if (p.num_groups > 1 && p.lanes_per_group > 0) {
      const uint32_t group_key = lane_aligned_group_key(p, keys);
      // Segment lane g takes group g's score; lanes past the last group offer nothing.
      uint32_t gk = __shfl_sync(kFullMask, group_key, seg_base + ((tl << p.lanes_per_group_log2) & (kLanes - 1)));
      if (tl >= p.num_groups) gk = kNoCandidate;
      const uint32_t kept = select_groups<kLanes>(gk, p.topk_groups, seg, tl);
      bool compacted = false;
      if constexpr (kV >= 2 && kV <= 8) {  // 16 experts per lane: registers would cost more than it saves
        if (p.compact) {
          // At most half the experts survive: gather the kept groups' keys (in group order, so lane order is still
          // expert order) over the segment, kV/2 per lane, and rank only those.
          constexpr int kHalf = kV / 2;
          store_slice(key_smem, first, keys);
          __syncwarp();
          uint32_t ckeys[kHalf];
          const int cand_first = gather_kept(p, key_smem, kept, tl * kHalf, ckeys);
          LaneTop3<kHalf> top;
          top.scan(ckeys, false, 0, 0);
          select_topk<kHalf, kLanes>(top, ckeys, cand_first, p.topk, seg, tl, id_smem);
          compacted = true;
        }
      }
      if (!compacted) {
        LaneTop3<kV> top;
        top.scan(keys, false, 0, 0);
        if (((kept >> (tl >> p.lanes_per_group_log2)) & 1u) == 0) top.key[0] = top.key[1] = top.key[2] = kNoCandidate;
        select_topk<kV, kLanes>(top, keys, first, p.topk, seg, tl, id_smem);
      }
    } else {
      if (p.num_groups > 1) {
        // Groups cut across lanes: rank them through shared memory. Lane tl owns a contiguous run of groups so
        // that the lowest winning lane is also the lowest group index.
        uint32_t* group_smem = key_smem + kLanes * kV;
        uint8_t* kept_smem = reinterpret_cast<uint8_t*>(group_smem + p.num_groups);
        store_slice(key_smem, first, keys);
        __syncwarp();
        const int groups_per_lane = (p.num_groups + kLanes - 1) / kLanes;
        const int g_begin = tl * groups_per_lane;
        const int g_end = min(g_begin + groups_per_lane, p.num_groups);
        for (int g = g_begin; g < g_end; ++g) {
          uint32_t a = kNoCandidate, b = kNoCandidate;
          for (int e = g * p.group_size; e < (g + 1) * p.group_size; ++e) {
            const uint32_t k = key_smem[e];
            b = max(b, min(a, k));
            a = max(a, k);
          }
          group_smem[g] = p.top2_sum ? order_key(key_value(a) + key_value(b)) : a;
          kept_smem[g] = 0;
        }
        __syncwarp();
        for (int r = 0; r < p.topk_groups; ++r) {
          uint32_t best_key = kNoCandidate;
          int best_g = 0;
          for (int g = g_begin; g < g_end; ++g) {
            const uint32_t k = group_smem[g];
            if (k > best_key) {
              best_key = k;
              best_g = g;
            }
          }
          const uint32_t best = segment_max<kLanes>(best_key, seg);
          const int winner = segment_first<kLanes>(best_key == best, seg);
          if (tl == winner) {
            group_smem[best_g] = kNoCandidate;
            kept_smem[best_g] = 1;
          }
          __syncwarp();
        }
#pragma unroll
        for (int i = 0; i < kV; ++i)
          if (first + i < E && !kept_smem[(first + i) / p.group_size]) keys[i] = kNoCandidate;
        __syncwarp();
      }
      LaneTop3<kV> top;
      top.scan(keys, false, 0, 0);
      select_topk<kV, kLanes>(top, keys, first, p.topk, seg, tl, id_smem);
    }

    __syncwarp();
    write_token<T, kLanes>(p, token, active, tl, id_smem, scores_smem, logits + token * p.row_stride);
    __syncwarp();
  }
}

// ---- the paired kernel: lane-aligned groups keeping at most half the experts, topk <= 16 ------------------
// Each token's scores, keys and group scores use the whole warp (kV experts per lane); then the warp ranks two
// tokens at once, half a warp each: group selection over the two tokens' group keys, and the top-k rounds over
// each token's kept experts gathered kV per lane (16 lanes x kV covers E/2). Every warp-wide step of the
// ranking serves two tokens.
template <typename T, int kV>
__global__ void __launch_bounds__(kGateThreads, 4) fused_gate_pair_kernel(const GateKernelParams p) {
  extern __shared__ __align__(16) float smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int half = lane >> 4;  // which token of the pair this lane ranks
  const int hl = lane & 15;
  const int E = p.num_experts;
  const int first = lane * kV;
  // Two token slots per warp: [ids 32][scores 32 kV][keys 32 kV] each; then the bias of the block.
  float* slots[2] = {smem + (warp * 2) * p.smem_floats_per_token, smem + (warp * 2 + 1) * p.smem_floats_per_token};
  // The bias lives in shared memory rather than registers: it keeps the kernel at 4 blocks per SM.
  float* bias_smem = smem + (kGateThreads / 32) * 2 * p.smem_floats_per_token;
  for (int e = threadIdx.x; e < 32 * kV; e += kGateThreads)
    bias_smem[e] = (p.bias != nullptr && e < E) ? load_bias(p.bias, p.bias_dtype, e) : 0.0f;
  __syncthreads();

  constexpr int kWarps = kGateThreads / 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * 2;
  int64_t base = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * 2;
  const T* logits = static_cast<const T*>(p.logits);

  float x_next[2][kV];
#pragma unroll
  for (int u = 0; u < 2; ++u)
    load_logits<T, kV>(logits + (base + u) * p.row_stride, first, E, p.vector_loads, base + u < p.num_tokens,
                       x_next[u]);

  for (; base < p.num_tokens; base += stride) {
    uint32_t group_key[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const bool active = base + u < p.num_tokens;
      float score[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) score[i] = x_next[u][i];
      load_logits<T, kV>(logits + (base + u + stride) * p.row_stride, first, E, p.vector_loads,
                         base + u + stride < p.num_tokens, x_next[u]);
      float* scores_smem = slots[u] + kGateIdSlots;
      uint32_t* key_smem = reinterpret_cast<uint32_t*>(scores_smem + 32 * kV);
      float bias[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) bias[i] = bias_smem[first + i];
      uint32_t keys[kV];
      token_scores_and_keys<kV, 32>(p, score, bias, first, active, scores_smem, keys);
      store_slice(key_smem, first, keys);
      group_key[u] = lane_aligned_group_key(p, keys);
    }
    // Half h, lane g takes token h's group g score (G <= 16).
    const int src = (hl << p.lanes_per_group_log2) & 31;
    const uint32_t gk0 = __shfl_sync(kFullMask, group_key[0], src);
    const uint32_t gk1 = __shfl_sync(kFullMask, group_key[1], src);
    uint32_t gk = half ? gk1 : gk0;
    if (hl >= p.num_groups) gk = kNoCandidate;
    const uint32_t kept = select_groups<16>(gk, p.topk_groups, half, hl);
    __syncwarp();

    float* slot = half ? slots[1] : slots[0];
    int* id_smem = reinterpret_cast<int*>(slot);
    float* scores_smem = slot + kGateIdSlots;
    const uint32_t* key_smem = reinterpret_cast<const uint32_t*>(scores_smem + 32 * kV);
    uint32_t ckeys[kV];
    const int cand_first = gather_kept(p, key_smem, kept, hl * kV, ckeys);
    LaneTop3<kV> top;
    top.scan(ckeys, false, 0, 0);
    select_topk<kV, 16>(top, ckeys, cand_first, p.topk, half, hl, id_smem);
    __syncwarp();
    const int64_t token = base + half;
    write_token<T, 16>(p, token, token < p.num_tokens, hl, id_smem, scores_smem, logits + token * p.row_stride);
    __syncwarp();
  }
}

}  // namespace tessera::moe::detail
