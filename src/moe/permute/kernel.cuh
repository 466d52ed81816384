// permute device code, three passes over chunks of tokens (a one-digit stable counting sort):
//   1. count:   per-chunk expert histogram; ids copied to int32 with the dropped ones as -1
//   2. scan:    one block per expert turns its column of chunk counts into an exclusive prefix; the last block
//               to finish lays out the (padded) expert segments
//   3. scatter: each chunk ranks its copies stably (match.any within a warp, in token order), then copies and
//               optionally quantizes every token row once into its k destinations, and zeroes the pad rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "common/numeric.cuh"
#include "moe/permute/config.h"
#include "ptx/ldst.cuh"
#include "tessera/moe.h"

namespace tessera::moe::detail {

enum class QuantMode : int { kNone = 0, kFP8Blockwise = 1, kFP8PerTensor = 2 };

struct PermuteKernelParams {
  const void* x;
  int64_t x_row_stride;  // elements
  const void* ids;       // [T, k] int32 or int64
  const float* input_scale;
  void* x_perm;
  float* scales;
  int64_t scale_stride_row, scale_stride_block;
  int32_t* offsets;    // [E+1]
  int32_t* counts;     // [E]
  int32_t* row_index;  // [T, k]
  int32_t* row_token;  // [rows] or nullptr
  unsigned int* counter;
  int32_t* totals;
  int32_t* ids32;
  int32_t* hist;
  int64_t num_tokens;
  int64_t hidden;
  int topk;
  int num_experts;
  int pad_multiple;
  int tokens_per_chunk;
  int64_t num_chunks;
};

constexpr int kScanThreads = 256;
constexpr int kScatterThreads = 256;

template <typename IdT>
__global__ void __launch_bounds__(128) permute_count_kernel(const PermuteKernelParams p) {
  __shared__ int hist[kPermuteMaxExperts];
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) hist[e] = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.counter = 0;  // the scan pass counts finished blocks from zero
  __syncthreads();
  const int64_t chunk_entries = static_cast<int64_t>(p.tokens_per_chunk) * p.topk;
  const int64_t begin = blockIdx.x * chunk_entries;
  const int64_t end = min(begin + chunk_entries, p.num_tokens * p.topk);
  const IdT* ids = static_cast<const IdT*>(p.ids);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const IdT e = ids[i];
    const bool valid = e >= 0 && e < p.num_experts;
    p.ids32[i] = valid ? static_cast<int32_t>(e) : -1;
    if (valid) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  int32_t* out = p.hist + blockIdx.x * static_cast<int64_t>(p.num_experts);
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) out[e] = hist[e];
}

__global__ void __launch_bounds__(kScanThreads) permute_scan_kernel(const PermuteKernelParams p) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ bool is_last;
  const int e = blockIdx.x;
  const int64_t C = p.num_chunks;
  const int64_t per_thread = (C + kScanThreads - 1) / kScanThreads;
  const int64_t c0 = threadIdx.x * per_thread;
  const int64_t c1 = min(c0 + per_thread, C);
  int sum = 0;
  for (int64_t c = c0; c < c1; ++c) sum += p.hist[c * p.num_experts + e];
  int prefix = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(sum, prefix, total);
  for (int64_t c = c0; c < c1; ++c) {
    const int v = p.hist[c * p.num_experts + e];
    p.hist[c * p.num_experts + e] = prefix;
    prefix += v;
  }
  if (threadIdx.x == 0) p.totals[e] = total;
  // Publish this expert's total, then count this block as done; the last block sees every total.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(p.counter, 1u) == static_cast<unsigned>(p.num_experts - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int e_per_thread = (p.num_experts + kScanThreads - 1) / kScanThreads;
  const int e0 = threadIdx.x * e_per_thread;
  const int e1 = min(e0 + e_per_thread, p.num_experts);
  int padded_sum = 0;
  for (int i = e0; i < e1; ++i) {
    const int count = __ldcg(p.totals + i);
    padded_sum += (count + p.pad_multiple - 1) / p.pad_multiple * p.pad_multiple;
  }
  __syncthreads();  // scan_storage is reused
  int start = 0, grand = 0;
  Scan(scan_storage).ExclusiveSum(padded_sum, start, grand);
  for (int i = e0; i < e1; ++i) {
    const int count = __ldcg(p.totals + i);
    p.offsets[i] = start;
    p.counts[i] = count;
    start += (count + p.pad_multiple - 1) / p.pad_multiple * p.pad_multiple;
  }
  if (threadIdx.x == 0) p.offsets[p.num_experts] = grand;
}

// One 16-byte vector (8 elements) of a row, quantized or not, stored to one destination row.
template <typename Elem, QuantMode kQuant>
__device__ __forceinline__ void store_vector(const PermuteKernelParams& p, int64_t row, int64_t vec,
                                             const uint4& raw, const float (&q)[8]) {
  if constexpr (kQuant == QuantMode::kNone) {
    ptx::st_global_v4(static_cast<Elem*>(p.x_perm) + row * p.hidden + vec * 8, raw);
  } else {
    ptx::st_global_v2(static_cast<uint8_t*>(p.x_perm) + row * p.hidden + vec * 8, tessera::detail::pack_fp8x8_e4m3(q));
  }
}

// One (token, 128-column block) work item of a half-warp: lane `sub` owns columns [8 sub, 8 sub + 8).
struct CopyItem {
  bool active;  // the item exists
  bool in_row;  // this lane's 8 columns exist
  int t_local;
  int64_t blk;
  int64_t vec;
  uint4 raw;
};

template <typename Elem, QuantMode kQuant>
__global__ void __launch_bounds__(kScatterThreads) permute_scatter_kernel(const PermuteKernelParams p) {
  __shared__ int base[kPermuteMaxExperts];
  __shared__ int rows[kPermuteMaxChunkEntries];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t chunk = blockIdx.x;
  const bool first_slice = blockIdx.y == 0;  // the slice that writes the index outputs
  const int64_t t0 = chunk * p.tokens_per_chunk;
  const int num_chunk_tokens =
      static_cast<int>(p.num_tokens - t0 < p.tokens_per_chunk ? p.num_tokens - t0 : p.tokens_per_chunk);
  const int n = num_chunk_tokens * p.topk;
  const int64_t entry0 = t0 * p.topk;

  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
    base[e] = p.offsets[e] + p.hist[chunk * p.num_experts + e];
  __syncthreads();

  // Stable ranks: warp 0 walks the chunk's copies in token order, 32 at a time; copies of one expert inside a
  // step are ordered by lane, and the lowest of them advances the expert's running row afterwards. Every column
  // slice of the chunk computes the same rows; the first one publishes them.
  if (warp == 0) {
    for (int i0 = 0; i0 < n; i0 += 32) {
      const int i = i0 + lane;
      const int e = i < n ? p.ids32[entry0 + i] : -1;
      const unsigned peers = __match_any_sync(0xFFFFFFFFu, e);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      const int row = e >= 0 ? base[e] + rank : -1;
      __syncwarp();
      if (e >= 0 && rank == 0) base[e] += __popc(peers);
      __syncwarp();
      if (i < n) {
        rows[i] = row;
        if (first_slice) {
          p.row_index[entry0 + i] = row;
          if (row >= 0 && p.row_token != nullptr) p.row_token[row] = static_cast<int32_t>(t0 + i / p.topk);
        }
      }
    }
  }
  __syncthreads();

  // This block's column slice: 128-column blocks [blk_begin, blk_end) of every row.
  const int64_t num_vec = p.hidden / 8;
  const int64_t blocks_per_row = (num_vec + 15) / 16;
  const int64_t blocks_per_slice = (blocks_per_row + gridDim.y - 1) / gridDim.y;
  const int64_t blk_begin = blockIdx.y * blocks_per_slice;
  const int64_t blk_left = blocks_per_row - blk_begin;
  const int64_t blk_count = blk_left <= 0 ? 0 : (blk_left < blocks_per_slice ? blk_left : blocks_per_slice);

  // Copy: a half-warp per (token, 128-column block), 8 elements per lane, so a block's amax is a 16-lane
  // reduction; each thread keeps two items in flight. The loop bound is warp-uniform (the shuffles need the
  // whole warp).
  const int64_t work = num_chunk_tokens * blk_count;
  const int sub = lane & 15;
  float tensor_inv = 1.0f;
  if constexpr (kQuant == QuantMode::kFP8PerTensor) tensor_inv = 1.0f / __ldg(p.input_scale);
  const Elem* x = static_cast<const Elem*>(p.x);
  constexpr int kItems = 2;
  constexpr int kItemsPerWarpStep = 2 * kItems;
  for (int64_t w0 = kItemsPerWarpStep * warp; w0 < work; w0 += kItemsPerWarpStep * (kScatterThreads / 32)) {
    CopyItem item[kItems];
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int64_t w = w0 + 2 * u + (lane >> 4);
      CopyItem& it = item[u];
      it.active = w < work;
      it.t_local = it.active ? static_cast<int>(w / blk_count) : 0;
      it.blk = it.active ? blk_begin + w % blk_count : 0;
      it.vec = it.blk * 16 + sub;
      it.in_row = it.active && it.vec < num_vec;
      it.raw = it.in_row ? ptx::ld_global_nc_na_v4(x + (t0 + it.t_local) * p.x_row_stride + it.vec * 8)
                         : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const CopyItem& it = item[u];
      float q[8];
      float block_scale = 0.0f;
      if constexpr (kQuant != QuantMode::kNone) {
        const Elem* vals = reinterpret_cast<const Elem*>(&it.raw);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          q[i] = tessera::detail::to_float(vals[i]);
          amax = fmaxf(amax, fabsf(q[i]));
        }
        float inv = tensor_inv;
        if constexpr (kQuant == QuantMode::kFP8Blockwise) {
#pragma unroll
          for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
          const float clamped = fmaxf(amax, ::tessera::moe::kFP8BlockScaleEps);
          block_scale = clamped / tessera::detail::kFP8E4M3Max;
          inv = tessera::detail::kFP8E4M3Max / clamped;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] *= inv;
      }
      if (!it.active) continue;
      for (int j = 0; j < p.topk; ++j) {
        const int row = rows[it.t_local * p.topk + j];
        if (row < 0) continue;
        if (it.in_row) store_vector<Elem, kQuant>(p, row, it.vec, it.raw, q);
        if constexpr (kQuant == QuantMode::kFP8Blockwise)
          if (sub == 0) p.scales[row * p.scale_stride_row + it.blk * p.scale_stride_block] = block_scale;
      }
    }
  }

  // Pad rows of the experts this chunk owns, in this block's column slice: zero data (and scale), no token.
  if (p.pad_multiple > 1) {
    const int64_t vec_begin = blk_begin * 16;
    const int64_t vec_end = (blk_begin + blk_count) * 16 < num_vec ? (blk_begin + blk_count) * 16 : num_vec;
    const int64_t slice_vecs = vec_end - vec_begin;
    for (int64_t e = chunk; e < p.num_experts; e += p.num_chunks) {
      const int64_t pad_begin = p.offsets[e] + p.counts[e];
      const int64_t pad_end = p.offsets[e + 1];
      if (first_slice)
        for (int64_t row = pad_begin + threadIdx.x; row < pad_end; row += blockDim.x) {
          if (p.row_token != nullptr) p.row_token[row] = -1;
        }
      if (slice_vecs <= 0) continue;
      const int64_t pad_items = (pad_end - pad_begin) * slice_vecs;
      for (int64_t i = threadIdx.x; i < pad_items; i += blockDim.x) {
        const int64_t row = pad_begin + i / slice_vecs;
        const int64_t vec = vec_begin + i % slice_vecs;
        const float zero[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        store_vector<Elem, kQuant>(p, row, vec, make_uint4(0, 0, 0, 0), zero);
        if constexpr (kQuant == QuantMode::kFP8Blockwise)
          if (vec % 16 == 0) p.scales[row * p.scale_stride_row + (vec / 16) * p.scale_stride_block] = 0.0f;
      }
    }
  }
}

}  // namespace tessera::moe::detail
