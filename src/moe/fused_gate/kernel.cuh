// fused_gate device code: one warp per token, the E experts spread over the 32 lanes (kV contiguous experts per
// lane, so a lower lane always holds lower expert ids and "lowest lane wins" is "lowest index wins").
//
// Ranking works on 32-bit order keys (common/numeric.cuh), so a warp-wide argmax is one redux.sync plus one
// ballot. Each lane caches its best two remaining experts; a lane rescans its slice only when it wins a third
// time, which keeps a top-k round at a handful of instructions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/numeric.cuh"
#include "ptx/ldst.cuh"

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
  bool vector_loads;
  int smem_floats_per_warp;
};

constexpr unsigned kFullMask = 0xFFFFFFFFu;

// Loads the kV logits of this lane as floats; experts past E read as -inf.
template <typename T, int kV>
__device__ __forceinline__ void load_logits(const T* row, int lane, int num_experts, bool vector_loads,
                                            float (&x)[kV]) {
  const int first = lane * kV;
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

// Best two keys of a lane (ties: the lower local index first), skipping those not after (after_key, after_idx)
// in rank order when `only_after` is set.
template <int kV>
struct LaneTop2 {
  uint32_t key1 = kNoCandidate, key2 = kNoCandidate;
  int idx1 = 0, idx2 = 0;

  __device__ __forceinline__ void scan(const uint32_t (&keys)[kV], bool only_after, uint32_t after_key,
                                       int after_idx) {
    key1 = key2 = kNoCandidate;
    idx1 = idx2 = 0;
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      uint32_t k = keys[i];
      if (only_after && !(k < after_key || (k == after_key && i > after_idx))) k = kNoCandidate;
      if (k > key1) {
        key2 = key1;
        idx2 = idx1;
        key1 = k;
        idx1 = i;
      } else if (k > key2) {
        key2 = k;
        idx2 = i;
      }
    }
  }
};

template <typename T, int kV>
__global__ void __launch_bounds__(256) fused_gate_kernel(const GateKernelParams p) {
  extern __shared__ __align__(16) float smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float* scores_smem = smem + warp * p.smem_floats_per_warp;  // [32 * kV]
  const int E = p.num_experts;
  const int first = lane * kV;

  float bias[kV];
#pragma unroll
  for (int i = 0; i < kV; ++i)
    bias[i] = (p.bias != nullptr && first + i < E) ? load_bias(p.bias, p.bias_dtype, first + i) : 0.0f;

  const int64_t warp_stride = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  int64_t token = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + warp;
  const T* logits = static_cast<const T*>(p.logits);

  float x_next[kV];
  if (token < p.num_tokens) load_logits<T, kV>(logits + token * p.row_stride, lane, E, p.vector_loads, x_next);

  for (; token < p.num_tokens; token += warp_stride) {
    float score[kV];
#pragma unroll
    for (int i = 0; i < kV; ++i) score[i] = x_next[i];
    // Prefetch the next token's row while this one is ranked.
    if (token + warp_stride < p.num_tokens)
      load_logits<T, kV>(logits + (token + warp_stride) * p.row_stride, lane, E, p.vector_loads, x_next);

    // ---- scores (fp32 whatever the input dtype) ----
    if (p.softmax) {
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < kV; ++i) m = fmaxf(m, score[i]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        score[i] = first + i < E ? __expf(score[i] - m) : 0.0f;
        sum += score[i];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
      const float inv = 1.0f / sum;
#pragma unroll
      for (int i = 0; i < kV; ++i) score[i] *= inv;
    } else {
#pragma unroll
      for (int i = 0; i < kV; ++i) score[i] = __fdividef(1.0f, 1.0f + __expf(-score[i]));
    }

    uint32_t keys[kV];
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      keys[i] = first + i < E ? order_key(score[i] + bias[i]) : kNoCandidate;
      scores_smem[first + i] = score[i];
    }

    LaneTop2<kV> top;
    top.scan(keys, false, 0, 0);
    bool lane_excluded = false;

    // ---- group stage ----
    if (p.num_groups > 1) {
      if (p.lanes_per_group > 0) {
        // Groups are lane-aligned: merge the lanes' best two inside each group with butterfly shuffles.
        uint32_t g1 = top.key1, g2 = top.key2;
        for (int o = 1; o < p.lanes_per_group; o <<= 1) {
          const uint32_t o1 = __shfl_xor_sync(kFullMask, g1, o);
          const uint32_t o2 = __shfl_xor_sync(kFullMask, g2, o);
          g2 = max(min(g1, o1), max(g2, o2));
          g1 = max(g1, o1);
        }
        const uint32_t group_key = p.top2_sum ? order_key(key_value(g1) + key_value(g2)) : g1;
        // Lane g takes group g's score; lanes past the last group offer nothing.
        uint32_t gk = __shfl_sync(kFullMask, group_key, (lane * p.lanes_per_group) & 31);
        if (lane >= p.num_groups) gk = kNoCandidate;
        uint32_t kept = 0;
        for (int r = 0; r < p.topk_groups; ++r) {
          const uint32_t best = __reduce_max_sync(kFullMask, gk);
          const int winner = __ffs(__ballot_sync(kFullMask, gk == best)) - 1;
          kept |= 1u << winner;
          if (lane == winner) gk = kNoCandidate;
        }
        lane_excluded = ((kept >> (lane / p.lanes_per_group)) & 1u) == 0;
      } else {
        // Groups cut across lanes: rank them through shared memory. Lane l owns a contiguous run of groups so
        // that the lowest winning lane is also the lowest group index.
        uint32_t* key_smem = reinterpret_cast<uint32_t*>(scores_smem + 32 * kV);
        uint32_t* group_smem = key_smem + 32 * kV;
        uint8_t* kept_smem = reinterpret_cast<uint8_t*>(group_smem + p.num_groups);
#pragma unroll
        for (int i = 0; i < kV; ++i) key_smem[first + i] = keys[i];
        __syncwarp();
        const int groups_per_lane = (p.num_groups + 31) / 32;
        const int g_begin = lane * groups_per_lane;
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
          const uint32_t best = __reduce_max_sync(kFullMask, best_key);
          const int winner = __ffs(__ballot_sync(kFullMask, best_key == best)) - 1;
          if (lane == winner) {
            group_smem[best_g] = kNoCandidate;
            kept_smem[best_g] = 1;
          }
          __syncwarp();
        }
#pragma unroll
        for (int i = 0; i < kV; ++i)
          if (first + i < E && !kept_smem[(first + i) / p.group_size]) keys[i] = kNoCandidate;
        top.scan(keys, false, 0, 0);
        __syncwarp();
      }
    }
    if (lane_excluded) top.key1 = top.key2 = kNoCandidate;

    // ---- top-k experts, one warp-wide argmax per round ----
    bool have_second = true;
    int my_id = -1;
    for (int r = 0; r < p.topk; ++r) {
      const uint32_t best = __reduce_max_sync(kFullMask, top.key1);
      const int winner = __ffs(__ballot_sync(kFullMask, top.key1 == best)) - 1;
      const int id = __shfl_sync(kFullMask, first + top.idx1, winner);
      if (lane == r) my_id = id;
      if (lane == winner) {
        if (have_second) {
          top.key1 = top.key2;
          top.idx1 = top.idx2;
          have_second = false;
        } else {
          top.scan(keys, true, top.key1, top.idx1);
          have_second = true;
        }
      }
    }

    // ---- weights ----
    __syncwarp();
    float w = (lane < p.topk) ? scores_smem[my_id] : 0.0f;
    if (p.renormalize) {
      float sum = w;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
      w = w / sum;
    }
    w *= p.scaling;
    const int width = p.topk + p.num_shared;
    float* w_row = p.weights + token * width;
    int32_t* id_row = p.ids + token * width;
    if (lane < p.topk) {
      w_row[lane] = w;
      id_row[lane] = my_id;
    }
    for (int j = lane; j < p.num_shared; j += 32) {
      w_row[p.topk + j] = p.shared_weight;
      id_row[p.topk + j] = E + j;
    }
    __syncwarp();
  }
}

}  // namespace tessera::moe::detail
