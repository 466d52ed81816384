// permute device code, three passes over chunks of tokens (a one-digit stable counting sort):
//   1. count:   per-chunk expert histogram; ids copied to int32 with the dropped ones as -1
//   2. scan:    one block per expert turns its column of chunk counts into an exclusive prefix; the last block
//               to finish lays out the (padded) expert segments
//   3. scatter: each chunk ranks its copies stably (match.any within a warp, in token order), then copies and
//               optionally quantizes every token row once into its k destinations, and zeroes the pad rows.
// Few copies (single_pass: T·k <= kPermuteSinglePassEntries, one chunk) take only the third launch: each of its
// blocks (the column slices of the one chunk) does passes 1 and 2 itself in shared memory, with the same results.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "common/numeric.cuh"
#include "moe/permute/config.h"
#include "ptx/ldst.cuh"
#include "ptx/math.cuh"
#include "tessera/moe.h"

namespace tessera::moe::detail {

enum class QuantMode : int { kNone = 0, kFP8Blockwise = 1, kFP8PerTensor = 2 };

struct PermuteKernelParams {
  const void* x;
  int64_t x_row_stride;  // elements
  const void* ids;       // [T, k] int32 or int64
  const float* input_scale;
  const int32_t* active_tokens;  // [1] or nullptr: copies of tokens at or past it are dropped
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
  int single_pass;  // 1: the scatter launch counts and scans itself (one chunk); ids read as given
  int ids_are_64;   // ids are int64 (read directly only in a single pass)
};

constexpr int kScanThreads = 256;
constexpr int kScatterThreads = 256;

// Pass 1 over the entries [begin, end) by one block: each id as int32 into ids_out[i - begin], -1 where the copy is
// dropped (an id outside [0, E), or a token at or past the device-side count), the others counted into hist (shared).
template <typename ReadId>
__device__ __forceinline__ void count_entries(const PermuteKernelParams& p, int64_t begin, int64_t end,
                                              ReadId read_id, int32_t* ids_out, int* hist) {
  int64_t routed_end = end;
  if (p.active_tokens != nullptr) {
    const int64_t n = *p.active_tokens;
    routed_end = min(end, (n < 0 ? 0 : n) * p.topk);
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int64_t e = read_id(i);
    const bool valid = e >= 0 && e < p.num_experts && i < routed_end;
    ids_out[i - begin] = valid ? static_cast<int32_t>(e) : -1;
    if (valid) atomicAdd(&hist[e], 1);
  }
}

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
  count_entries(p, begin, end, [&](int64_t i) { return static_cast<int64_t>(ids[i]); }, p.ids32 + begin, hist);
  __syncthreads();
  int32_t* out = p.hist + blockIdx.x * static_cast<int64_t>(p.num_experts);
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) out[e] = hist[e];
}

// The expert segments' layout from each expert's row count (count_of(e)), by one block of kThreads threads, each
// owning a contiguous run of experts: the exclusive prefix of the counts padded to pad_multiple. `publish` writes
// expert_offsets [E + 1] and expert_counts; `starts` (or null) receives each segment's start and, at [E], the total.
// Used by the scan pass's last block and by every block of a single pass.
template <int kThreads, typename CountOf>
__device__ __forceinline__ void lay_out_segments(const PermuteKernelParams& p, CountOf count_of, bool publish,
                                                 int* starts,
                                                 typename cub::BlockScan<int, kThreads>::TempStorage& storage) {
  const int E = p.num_experts;
  const int per_thread = (E + kThreads - 1) / kThreads;
  const int e0 = min(static_cast<int>(threadIdx.x) * per_thread, E);
  const int e1 = min(e0 + per_thread, E);
  const auto padded = [&](int count) { return (count + p.pad_multiple - 1) / p.pad_multiple * p.pad_multiple; };
  int run = 0;
  for (int e = e0; e < e1; ++e) run += padded(count_of(e));
  int start = 0, total = 0;
  cub::BlockScan<int, kThreads>(storage).ExclusiveSum(run, start, total);
  for (int e = e0; e < e1; ++e) {
    const int count = count_of(e);
    if (starts != nullptr) starts[e] = start;
    if (publish) {
      p.offsets[e] = start;
      p.counts[e] = count;
    }
    start += padded(count);
  }
  if (threadIdx.x == 0) {
    if (starts != nullptr) starts[E] = total;
    if (publish) p.offsets[E] = total;
  }
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
  __syncthreads();  // scan_storage is reused
  lay_out_segments<kScanThreads>(p, [&](int i) { return __ldcg(p.totals + i); }, true, nullptr, scan_storage);
}

// Copy work: an item is one (token, 128-column block), shared by a group of lanes so that each destination store
// instruction of the group covers 128 or 256 contiguous bytes. Unquantized: 16 lanes, lane s owns source vector
// s (8 columns, 16 bytes). Quantized: 8 lanes, lane s owns source vectors 2s and 2s + 1 (16 columns, whose 16 fp8
// bytes are adjacent in the destination: one 16-byte store); a block's amax is then an 8-lane reduction.
template <QuantMode kQuant>
inline constexpr int kLanesPerItem = kQuant == QuantMode::kNone ? 16 : 8;

// One (token, 128-column block) item of a lane group: this lane's source vectors.
struct CopyItem {
  bool active, has0, has1;
  int t_local;
  int64_t blk, vec0;
  uint4 raw[2];
};

template <typename Elem, QuantMode kQuant>
__device__ __forceinline__ void store_columns(const PermuteKernelParams& p, int64_t row, int64_t vec0, bool has0,
                                              bool has1, bool fp8_16b_rows, const uint4 (&raw)[2],
                                              const float (&q)[16]) {
  if constexpr (kQuant == QuantMode::kNone) {
    if (has0) ptx::st_global_v4(static_cast<Elem*>(p.x_perm) + row * p.hidden + vec0 * 8, raw[0]);
  } else {
    uint8_t* dst = static_cast<uint8_t*>(p.x_perm) + row * p.hidden + vec0 * 8;
    const float(&lo)[8] = *reinterpret_cast<const float(*)[8]>(&q[0]);
    const float(&hi)[8] = *reinterpret_cast<const float(*)[8]>(&q[8]);
    const uint2 a = tessera::detail::pack_fp8x8_e4m3(lo);
    if (has1 && fp8_16b_rows) {
      const uint2 b = tessera::detail::pack_fp8x8_e4m3(hi);
      ptx::st_global_v4(dst, make_uint4(a.x, a.y, b.x, b.y));
    } else {
      if (has0) ptx::st_global_v2(dst, a);
      if (has1) ptx::st_global_v2(dst + 8, tessera::detail::pack_fp8x8_e4m3(hi));
    }
  }
}

// Passes 1 and 2 of a single pass, done by one block in shared memory: the copies' ids (dropped ones -1) into
// chunk_ids, each expert's count into counts and its segment start into seg_start and base (the running row the
// ranking advances); the first column slice also writes expert_offsets and expert_counts.
__device__ __forceinline__ void single_pass_layout(const PermuteKernelParams& p, int n, int* chunk_ids, int* base,
                                                   int* seg_start, int* counts) {
  using Scan = cub::BlockScan<int, kScatterThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int E = p.num_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  count_entries(
      p, 0, n,
      [&](int64_t i) {
        return p.ids_are_64 ? static_cast<const int64_t*>(p.ids)[i] : int64_t{static_cast<const int32_t*>(p.ids)[i]};
      },
      chunk_ids, counts);
  __syncthreads();
  lay_out_segments<kScatterThreads>(p, [&](int e) { return counts[e]; }, blockIdx.y == 0, seg_start, scan_storage);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) base[e] = seg_start[e];  // the running row the ranking advances
  __syncthreads();
}

template <typename Elem, QuantMode kQuant>
__global__ void __launch_bounds__(kScatterThreads, 4) permute_scatter_kernel(const PermuteKernelParams p) {
  __shared__ int base[kPermuteMaxExperts];
  __shared__ int rows[kPermuteMaxChunkEntries];
  __shared__ int chunk_ids[kPermuteMaxChunkEntries];
  // A single pass's segment layout (the multi-pass launch reads it from expert_offsets / expert_counts).
  __shared__ int seg_start[kPermuteMaxExperts + 1];
  __shared__ int seg_count[kPermuteMaxExperts];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t chunk = blockIdx.x;
  const bool first_slice = blockIdx.y == 0;  // the slice that writes the index outputs
  const int64_t t0 = chunk * p.tokens_per_chunk;
  const int num_chunk_tokens =
      static_cast<int>(p.num_tokens - t0 < p.tokens_per_chunk ? p.num_tokens - t0 : p.tokens_per_chunk);
  const int n = num_chunk_tokens * p.topk;
  const int64_t entry0 = t0 * p.topk;

  if (p.single_pass) {
    single_pass_layout(p, n, chunk_ids, base, seg_start, seg_count);
  } else {
    for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x)
      base[e] = p.offsets[e] + p.hist[chunk * p.num_experts + e];
    for (int i = threadIdx.x; i < n; i += blockDim.x) chunk_ids[i] = p.ids32[entry0 + i];
    __syncthreads();
  }

  // Stable ranks: warp 0 walks the chunk's copies in token order, 32 at a time; copies of one expert inside a
  // step are ordered by lane, and the lowest of them advances the expert's running row afterwards. Every column
  // slice of the chunk computes the same rows; the first one publishes them.
  if (warp == 0) {
    for (int i0 = 0; i0 < n; i0 += 32) {
      const int i = i0 + lane;
      const int e = i < n ? chunk_ids[i] : -1;
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

  // Tokens at or past the device-side count have no copies: their rows are not even read.
  int64_t copy_tokens = num_chunk_tokens;
  if (p.active_tokens != nullptr) {
    const int64_t left = *p.active_tokens - t0;
    copy_tokens = left <= 0 ? 0 : (left < copy_tokens ? left : copy_tokens);
  }
  const int64_t work = copy_tokens * blk_count;
  constexpr int kItemLanes = kLanesPerItem<kQuant>;
  const int sub = lane % kItemLanes;
  const int group = lane / kItemLanes;
  constexpr int kItemsPerWarpStep = 32 / kItemLanes;
  // 16-byte fp8 stores need every row start 16-byte aligned: the rows (contiguous, H bytes each) and the base (the
  // host checks 8 bytes for fp8 x_perm: a view 8 bytes into an allocation takes the 8-byte stores).
  const bool fp8_16b_rows = p.hidden % 16 == 0 && reinterpret_cast<uintptr_t>(p.x_perm) % 16 == 0;
  float tensor_inv = 1.0f;
  if constexpr (kQuant == QuantMode::kFP8PerTensor) tensor_inv = 1.0f / __ldg(p.input_scale);
  const Elem* x = static_cast<const Elem*>(p.x);
  // Where item w's vectors come from (w past the work: nothing).
  auto locate = [&](int64_t w, CopyItem& it) {
    it.active = w < work;
    it.t_local = it.active ? static_cast<int>(w / blk_count) : 0;
    it.blk = it.active ? blk_begin + w % blk_count : 0;
    it.vec0 = it.blk * 16 + (kQuant == QuantMode::kNone ? sub : 2 * sub);
    it.has0 = it.active && it.vec0 < num_vec;
    it.has1 = kQuant != QuantMode::kNone && it.active && it.vec0 + 1 < num_vec;
    const Elem* src = x + (t0 + it.t_local) * p.x_row_stride;
    it.raw[0] = it.has0 ? ptx::ld_global_nc_na_v4(src + it.vec0 * 8) : make_uint4(0, 0, 0, 0);
    it.raw[1] = it.has1 ? ptx::ld_global_nc_na_v4(src + (it.vec0 + 1) * 8) : make_uint4(0, 0, 0, 0);
  };
  constexpr int64_t kWarpStride = kItemsPerWarpStep * (kScatterThreads / 32);
  // The next item's loads are issued before this item's stores, so each thread keeps a load in flight while it
  // stores. Measured (docs/perf): faster for bf16 and per-tensor fp8, slower for blockwise fp8, whose extra
  // registers for the amax then spill.
  constexpr bool kPrefetch = kQuant != QuantMode::kFP8Blockwise;
  CopyItem next;
  if constexpr (kPrefetch) locate(kItemsPerWarpStep * warp + group, next);
  // The loop bound is warp-uniform: the amax shuffles need the whole warp.
  for (int64_t w0 = kItemsPerWarpStep * warp; w0 < work; w0 += kWarpStride) {
    CopyItem it;
    if constexpr (kPrefetch) {
      it = next;
      locate(w0 + kWarpStride + group, next);
    } else {
      locate(w0 + group, it);
    }
    float q[16];
    float block_scale = 0.0f;
    if constexpr (kQuant != QuantMode::kNone) {
      const Elem* vals = reinterpret_cast<const Elem*>(&it.raw[0]);
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        q[i] = tessera::detail::to_float(vals[i]);
        amax = fmaxf(amax, fabsf(q[i]));
      }
      float inv = tensor_inv;
      if constexpr (kQuant == QuantMode::kFP8Blockwise) {
#pragma unroll
        for (int o = kItemLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        block_scale = tessera::detail::fp8_block_scale(amax, ::tessera::moe::kFP8BlockScaleEps);
        inv = ptx::rcp_approx_ftz(block_scale);
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) q[i] *= inv;
    }
    if (!it.active) continue;
    // Unrolled so that the destination rows are read from shared memory together, not one store at a time.
#pragma unroll 4
    for (int j = 0; j < p.topk; ++j) {
      const int row = rows[it.t_local * p.topk + j];
      if (row < 0) continue;
      store_columns<Elem, kQuant>(p, row, it.vec0, it.has0, it.has1, fp8_16b_rows, it.raw, q);
      if constexpr (kQuant == QuantMode::kFP8Blockwise)
        if (sub == 0) p.scales[row * p.scale_stride_row + it.blk * p.scale_stride_block] = block_scale;
    }
  }

  // Pad rows of the experts this chunk owns, in this block's column slice: zero data (and scale), no token.
  if (p.pad_multiple > 1) {
    const int64_t vec_begin = blk_begin * 16;
    const int64_t vec_end = (blk_begin + blk_count) * 16 < num_vec ? (blk_begin + blk_count) * 16 : num_vec;
    const int64_t slice_vecs = vec_end - vec_begin;
    for (int64_t e = chunk; e < p.num_experts; e += p.num_chunks) {
      const int64_t pad_begin = p.single_pass ? seg_start[e] + seg_count[e] : p.offsets[e] + p.counts[e];
      const int64_t pad_end = p.single_pass ? seg_start[e + 1] : p.offsets[e + 1];
      if (first_slice)
        for (int64_t row = pad_begin + threadIdx.x; row < pad_end; row += blockDim.x) {
          if (p.row_token != nullptr) p.row_token[row] = -1;
        }
      if (slice_vecs <= 0) continue;
      const int64_t pad_items = (pad_end - pad_begin) * slice_vecs;
      const int64_t elem_bytes = kQuant == QuantMode::kNone ? 2 : 1;
      for (int64_t i = threadIdx.x; i < pad_items; i += blockDim.x) {
        const int64_t row = pad_begin + i / slice_vecs;
        const int64_t vec = vec_begin + i % slice_vecs;
        char* dst = static_cast<char*>(p.x_perm) + (row * p.hidden + vec * 8) * elem_bytes;
        if constexpr (kQuant == QuantMode::kNone) ptx::st_global_v4(dst, make_uint4(0, 0, 0, 0));
        else ptx::st_global_v2(dst, make_uint2(0, 0));
        if constexpr (kQuant == QuantMode::kFP8Blockwise)
          if (vec % 16 == 0) p.scales[row * p.scale_stride_row + (vec / 16) * p.scale_stride_block] = 0.0f;
      }
    }
  }
}

}  // namespace tessera::moe::detail
