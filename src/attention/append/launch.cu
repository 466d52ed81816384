// append_kv: quantizes new K/V rows into the cache format and writes them, with their scales, at the given
// positions. One launch per call:
//  - row warps: one warp per (sequence, new token, KV head, K or V) row; each lane owns D/32 consecutive elements.
//    The per-channel key formats (kInt8KChannel, kInt4KChannel) run only their value rows this way.
//  - key-block CTAs (per-channel key formats only, after the row CTAs in the grid): one CTA per (sequence, KV head,
//    32-token key block touched by the new rows). It gathers the block's rows (earlier ones from k_residual, new
//    ones from k_new), quantizes each channel over them, rewrites every row's codes and the block's scales, and the
//    CTA of the first touched block also refreshes k_residual.
// The arithmetic follows attention.h's definition step by step (fp32, correctly rounded division) so that the
// host reference reproduces every code bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode/problem.h"
#include "common/check.h"
#include "ptx/grid.cuh"

namespace tessera::attention::detail {
namespace {

constexpr int kAppendWarps = 4;
constexpr int kAppendThreads = 32 * kAppendWarps;

__device__ __forceinline__ float load_elem(const void* p, int64_t at, bool fp16) {
  return fp16 ? __half2float(static_cast<const __half*>(p)[at])
              : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[at]);
}

__device__ __forceinline__ float bits_to_float(uint32_t bits, bool fp16) {
  return fp16 ? __half2float(__ushort_as_half(static_cast<unsigned short>(bits))) : __uint_as_float(bits << 16);
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// fp16 round-to-nearest-even, saturated to the largest finite value.
__device__ __forceinline__ __half fp16_sat(float x) { return __float2half_rn(fminf(fmaxf(x, -65504.0f), 65504.0f)); }

// attention.h's integer rule, shared by the row warps and the per-channel key blocks: a group spanning [lo, hi]
// gets scale = fp16((hi - lo) / levels) and offset = fp16(lo) ...
__device__ __forceinline__ void group_pair(float lo, float hi, float levels, __half& scale_h, __half& offset_h) {
  scale_h = fp16_sat(__fdiv_rn(__fsub_rn(hi, lo), levels));
  offset_h = fp16_sat(lo);
}
// ... and x the code clamp(rint((x - offset) / scale), 0, levels) (0 where scale is 0), scale and offset the floats
// of those fp16 values.
__device__ __forceinline__ uint32_t group_code(float x, float offset, float scale, float levels) {
  const float qf = scale == 0.0f ? 0.0f : rintf(__fdiv_rn(__fsub_rn(x, offset), scale));
  return static_cast<uint32_t>(fminf(fmaxf(qf, 0.0f), levels));
}

// Key blocks one (sequence, head) may touch with S new rows: at most floor((31 + S - 1) / 32) + 1.
__host__ __device__ constexpr int64_t key_blocks_per_head(int64_t num_new) { return (num_new + 30) / kKeyBlock + 1; }

// The split of the grid: row CTAs first, then (per-channel key formats) B · HKV · key_blocks_per_head key CTAs.
struct AppendGrid {
  int64_t row_ctas = 0;
  int64_t key_blocks_per_head = 0;
};

// One row of k or v: quantized by warp-wide reductions and written with its scales. Values of the per-channel key
// formats take this path too (as kInt8 / kInt4 rows).
template <int kHeadDim, bool kKeyChannel>
__device__ __forceinline__ void append_row(const AppendProblem& p, int b, int i, int kvh, bool is_v, int lane) {
  constexpr int kPer = kHeadDim / 32;  // elements per lane
  const CacheDesc& cd = p.cache;

  // Destination: skipped (nothing written) outside the capacity or on an invalid page.
  const int64_t pos = static_cast<int64_t>(p.positions[b]) + i;
  if (pos < 0 || pos >= cd.capacity) return;
  int64_t outer = b, slot = pos;
  if (cd.paged) {
    const int32_t page = cd.block_table[b * cd.block_table_stride + (pos >> cd.log2_page_size)];
    if (page < 0 || page >= cd.num_pages) return;
    outer = page;
    slot = pos & (cd.page_size - 1);
  }
  uint8_t* dst = const_cast<uint8_t*>(is_v ? cd.v : cd.k) + outer * cd.stride_outer + slot * cd.stride_token +
                 kvh * cd.stride_head;

  const void* src = is_v ? p.v_new : p.k_new;
  const int64_t src_base = is_v ? b * p.vnew_stride_b + i * p.vnew_stride_s + kvh * p.vnew_stride_h
                                : b * p.new_stride_b + i * p.new_stride_s + kvh * p.new_stride_h;
  float x[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) x[e] = load_elem(src, src_base + lane * kPer + e, p.fp16);

  switch (cd.format) {
    case KVFormat::kNative: {
      uint16_t* d = reinterpret_cast<uint16_t*>(dst) + lane * kPer;
      const uint16_t* s = static_cast<const uint16_t*>(src) + src_base + lane * kPer;
#pragma unroll
      for (int e = 0; e < kPer; ++e) d[e] = s[e];  // bit copy, same dtype
      return;
    }
    case KVFormat::kFP8: {
      const float* scales = is_v ? cd.v_fp8_scale : cd.k_fp8_scale;
      const float s = scales[cd.fp8_per_head ? kvh : 0];
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        dst[lane * kPer + e] = __nv_cvt_float_to_fp8(__fdiv_rn(x[e], s), __NV_SATFINITE, __NV_E4M3);
      return;
    }
    default: break;
  }

  // Integer formats: min / max over the group (the whole row, or 32 elements = 32 / kPer lanes).
  const bool grouped = cd.format == KVFormat::kInt4Group32;
  const bool int4 = kKeyChannel ? cd.format == KVFormat::kInt4KChannel : cd.format != KVFormat::kInt8;
  const int group_lanes = grouped ? kInt4GroupSize / kPer : 32;
  float lo = x[0], hi = x[0];
#pragma unroll
  for (int e = 1; e < kPer; ++e) {
    lo = fminf(lo, x[e]);
    hi = fmaxf(hi, x[e]);
  }
  for (int off = 1; off < group_lanes; off <<= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
  }
  const float levels = int4 ? 15.0f : 255.0f;
  __half scale_h, offset_h;
  group_pair(lo, hi, levels, scale_h, offset_h);
  const float scale = __half2float(scale_h), offset = __half2float(offset_h);
  uint32_t code[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) code[e] = group_code(x[e], offset, scale, levels);
  if (int4) {
#pragma unroll
    for (int e = 0; e < kPer; e += 2) dst[(lane * kPer + e) / 2] = static_cast<uint8_t>(code[e] | (code[e + 1] << 4));
  } else {
#pragma unroll
    for (int e = 0; e < kPer; ++e) dst[lane * kPer + e] = static_cast<uint8_t>(code[e]);
  }
  if (lane % group_lanes == 0) {
    const int group = grouped ? lane / group_lanes : 0;
    uint16_t* sc = const_cast<uint16_t*>(is_v ? cd.v_scale : cd.k_scale) + outer * cd.scale_stride_outer +
                   slot * cd.scale_stride_token + kvh * cd.scale_stride_head + 2 * group;
    const uint32_t pair = static_cast<uint32_t>(__half_as_ushort(scale_h)) |
                          (static_cast<uint32_t>(__half_as_ushort(offset_h)) << 16);
    *reinterpret_cast<uint32_t*>(sc) = pair;
  }
}

template <int kHeadDim>
struct alignas(16) KeyBlockSmem {
  uint16_t x[kKeyBlock][kHeadDim];  // the block's rows, 16-bit keys as given (k_residual and k_new share a dtype)
  float scale[kHeadDim];            // per channel, the floats of the fp16 values written
  float offset[kHeadDim];
};

// One key block of one (sequence, KV head) of a per-channel key format; the whole CTA (kAppendThreads threads).
// Block j = j0 + k of the new rows' blocks j0 = pos / 32 .. j1 = (pos + S - 1) / 32 holds the rows [32j, e),
// e = min(32j + 32, pos + S, capacity): rows before pos are read from k_residual (slot t % 64), the rest from k_new.
template <int kHeadDim, bool kInt4>
__device__ __forceinline__ void append_key_block(const AppendProblem& p, int key_cta, int blocks_per_head) {
  constexpr int D = kHeadDim;
  constexpr int kResidualMask = kKeyResidualRows - 1;
  static_assert((kKeyResidualRows & kResidualMask) == 0, "the residual slot is t % 64");
  __shared__ KeyBlockSmem<kHeadDim> sm;
  const CacheDesc& cd = p.cache;
  const int tid = threadIdx.x;

  // 32-bit index arithmetic (the grid is below 2^31 CTAs): 64-bit divisions cost ~a hundred instructions each.
  const int k = key_cta % blocks_per_head;
  key_cta /= blocks_per_head;
  const int kvh = key_cta % cd.num_kv_heads;
  const int b = key_cta / cd.num_kv_heads;

  const int64_t pos = p.positions[b];
  const int64_t end = pos + p.num_new;  // one past the last new row
  const int64_t j1 = (end - 1) >> 5;    // floor division (pos may be negative)
  const int64_t j = (pos >> 5) + k;
  if (j > j1) return;  // this (sequence, head) touches fewer blocks: the whole CTA leaves

  // The block exists when it starts in [0, capacity) and (paged) its page is valid. A page holds whole blocks
  // (page_size is a multiple of 32).
  const int64_t first = j * kKeyBlock;
  int64_t outer = b, slot0 = first;
  bool exists = first >= 0 && first < cd.capacity;
  if (exists && cd.paged) {
    const int32_t page = cd.block_table[b * cd.block_table_stride + (first >> cd.log2_page_size)];
    exists = page >= 0 && page < cd.num_pages;
    outer = page;
    slot0 = first & (cd.page_size - 1);
  }
  const int64_t stop = min64(min64(first + kKeyBlock, end), cd.capacity);
  const int n = exists ? static_cast<int>(stop - first) : 0;  // 1..32 when it exists

  const uint16_t* k_new = static_cast<const uint16_t*>(p.k_new);
  uint16_t* residual = static_cast<uint16_t*>(const_cast<void*>(cd.k_residual));
  const uint16_t* k_new_bh = k_new + b * p.new_stride_b + kvh * p.new_stride_h;
  uint16_t* residual_bh = residual + b * cd.res_stride_b + kvh * cd.res_stride_head;

  // ---- gather the block's rows. Only the first touched block has rows before pos: those come from k_residual
  // as 16-byte vectors (its rows are 16-byte aligned), all of a thread's loads issued before any is stored, so that
  // the CTA waits for memory once (was: one element per thread and step; H200, B 128, one new token per sequence:
  // 19.97 -> 14.52 us for int8_kchannel); the new rows from k_new element by element (any 2-byte alignment).
  const int n_old = static_cast<int>(min64(max64(pos - first, 0), n));  // rows [first, first + n_old) < pos
  {
    constexpr int kVecPerRow = D / 8;
    constexpr int kMaxVec = kKeyBlock * kVecPerRow / kAppendThreads;  // 8 per thread at D 256
    static_assert(kKeyBlock * kVecPerRow % kAppendThreads == 0, "the block's vectors spread evenly");
    uint4 v[kMaxVec];
#pragma unroll
    for (int i = 0; i < kMaxVec; ++i) {
      const int e = tid + i * kAppendThreads, r = e / kVecPerRow;
      if (r < n_old)
        v[i] = *reinterpret_cast<const uint4*>(residual_bh + ((first + r) & kResidualMask) * cd.res_stride_slot +
                                               8 * (e % kVecPerRow));
    }
#pragma unroll
    for (int i = 0; i < kMaxVec; ++i) {
      const int e = tid + i * kAppendThreads, r = e / kVecPerRow;
      if (r < n_old) *reinterpret_cast<uint4*>(&sm.x[r][8 * (e % kVecPerRow)]) = v[i];
    }
  }
#pragma unroll 4
  for (int e = n_old * D + tid; e < n * D; e += kAppendThreads) {
    const int r = e / D, d = e % D;
    sm.x[r][d] = k_new_bh[(first + r - pos) * p.new_stride_s + d];
  }
  // Every residual row this CTA reads has been read before it writes any: a long S rewrites slots the first block
  // still needs. No other CTA reads the residual of (b, kvh).
  __syncthreads();

  // ---- k_residual: the new rows in [0, capacity) of the last two blocks written (the capacity ends the rows
  // written), by the first block's CTA (which may not exist itself).
  if (k == 0) {
    const int64_t hi = min64(end, cd.capacity);
    const int64_t lo = max64(max64(pos, (((hi - 1) >> 5) - 1) * kKeyBlock), 0);
    const int64_t count = hi > lo ? (hi - lo) * D : 0;  // at most 64 rows
    for (int64_t e = tid; e < count; e += kAppendThreads) {
      const int64_t t = lo + e / D;
      const int d = static_cast<int>(e % D);
      residual_bh[(t & kResidualMask) * cd.res_stride_slot + d] = k_new_bh[(t - pos) * p.new_stride_s + d];
    }
  }
  if (n == 0) return;

  // ---- per channel: min / max over the rows in order, the fp16 scale and offset (group_pair).
  constexpr bool int4 = kInt4;
  constexpr float levels = int4 ? 15.0f : 255.0f;
  const bool fp16 = p.fp16;
  uint16_t* params = const_cast<uint16_t*>(cd.k_scale) + outer * cd.kc_stride_outer +
                     (slot0 / kKeyBlock) * cd.kc_stride_block + kvh * cd.kc_stride_head;
  for (int d = tid; d < D; d += kAppendThreads) {
    float lo = bits_to_float(sm.x[0][d], fp16), hi = lo;
    for (int r = 1; r < n; ++r) {
      const float x = bits_to_float(sm.x[r][d], fp16);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    __half scale_h, offset_h;
    group_pair(lo, hi, levels, scale_h, offset_h);
    params[d] = __half_as_ushort(scale_h);
    params[D + d] = __half_as_ushort(offset_h);
    sm.scale[d] = __half2float(scale_h);
    sm.offset[d] = __half2float(offset_h);
  }
  __syncthreads();

  // ---- codes of every row of the block, one 32-bit word (4 int8 or 8 int4 codes) per thread and step.
  constexpr int channels_per_word = int4 ? 8 : 4;
  constexpr int words_per_row = D / channels_per_word;
  uint8_t* rows = const_cast<uint8_t*>(cd.k) + outer * cd.stride_outer + slot0 * cd.stride_token +
                  kvh * cd.stride_head;
  for (int e = tid; e < n * words_per_row; e += kAppendThreads) {
    const int r = e / words_per_row, c0 = (e % words_per_row) * channels_per_word;
    uint32_t word = 0;
#pragma unroll
    for (int h = 0; h < channels_per_word; h += 4) {  // 4 channels at a time: vector loads from shared memory
      const uint2 xv = *reinterpret_cast<const uint2*>(&sm.x[r][c0 + h]);
      const float4 sv = *reinterpret_cast<const float4*>(&sm.scale[c0 + h]);
      const float4 ov = *reinterpret_cast<const float4*>(&sm.offset[c0 + h]);
      const float xs[4] = {bits_to_float(xv.x & 0xFFFFu, fp16), bits_to_float(xv.x >> 16, fp16),
                           bits_to_float(xv.y & 0xFFFFu, fp16), bits_to_float(xv.y >> 16, fp16)};
      const float ss[4] = {sv.x, sv.y, sv.z, sv.w}, os[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) word |= group_code(xs[q], os[q], ss[q], levels) << (int4 ? 4 * (h + q) : 8 * q);
    }
    *reinterpret_cast<uint32_t*>(rows + r * cd.stride_token + (int4 ? c0 / 2 : c0)) = word;
  }
}

template <int kHeadDim, bool kKeyChannel>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const AppendProblem p, const AppendGrid grid) {
  // A decode launched next on the stream (a programmatic dependent, common/pdl.h) may start its set-up now; it waits
  // for this grid's completion before it reads the cache or the lengths.
  ptx::launch_dependents();
  if constexpr (kKeyChannel) {
    if (blockIdx.x >= grid.row_ctas) {
      const int key_cta = static_cast<int>(blockIdx.x - grid.row_ctas);
      if (p.cache.format == KVFormat::kInt4KChannel)
        append_key_block<kHeadDim, true>(p, key_cta, static_cast<int>(grid.key_blocks_per_head));
      else
        append_key_block<kHeadDim, false>(p, key_cta, static_cast<int>(grid.key_blocks_per_head));
      return;
    }
  }
  const CacheDesc& cd = p.cache;
  const int lane = threadIdx.x % 32;
  int64_t row = static_cast<int64_t>(blockIdx.x) * kAppendWarps + threadIdx.x / 32;
  // Rows (b, i, kvh, K|V), K|V fastest; per-channel key formats: value rows (b, i, kvh) only.
  const int64_t rows = static_cast<int64_t>(p.batch) * p.num_new * cd.num_kv_heads * (kKeyChannel ? 1 : 2);
  if (row >= rows) return;
  bool is_v = true;
  if constexpr (!kKeyChannel) {
    is_v = row & 1;
    row >>= 1;
  }
  const int kvh = static_cast<int>(row % cd.num_kv_heads);
  row /= cd.num_kv_heads;
  const int i = static_cast<int>(row % p.num_new);
  const int b = static_cast<int>(row / p.num_new);
  append_row<kHeadDim, kKeyChannel>(p, b, i, kvh, is_v, lane);
}

template <int kHeadDim>
void launch_for_head_dim(const AppendProblem& p, bool key_channel, int grid_ctas, const AppendGrid& grid,
                         cudaStream_t stream) {
  if (key_channel)
    append_kernel<kHeadDim, true><<<grid_ctas, kAppendThreads, 0, stream>>>(p, grid);
  else
    append_kernel<kHeadDim, false><<<grid_ctas, kAppendThreads, 0, stream>>>(p, grid);
}

}  // namespace

void launch_append(const AppendProblem& p, cudaStream_t stream) {
  const bool key_channel = kv_key_per_channel(p.cache.format);
  const int64_t rows = static_cast<int64_t>(p.batch) * p.num_new * p.cache.num_kv_heads * (key_channel ? 1 : 2);
  AppendGrid grid;
  grid.row_ctas = (rows + kAppendWarps - 1) / kAppendWarps;
  int64_t ctas = grid.row_ctas;
  if (key_channel) {
    grid.key_blocks_per_head = key_blocks_per_head(p.num_new);
    ctas += static_cast<int64_t>(p.batch) * p.cache.num_kv_heads * grid.key_blocks_per_head;
  }
  if (ctas > INT32_MAX)
    throw Error("tessera::attention::append_kv: too many blocks to launch (" + std::to_string(ctas) + " for " +
                std::to_string(rows) + " rows)");
  const int grid_ctas = static_cast<int>(ctas);
  switch (p.cache.head_dim) {
    case 64: launch_for_head_dim<64>(p, key_channel, grid_ctas, grid, stream); break;
    case 128: launch_for_head_dim<128>(p, key_channel, grid_ctas, grid, stream); break;
    case 256: launch_for_head_dim<256>(p, key_channel, grid_ctas, grid, stream); break;
    default: throw Error("tessera::attention::append_kv: no kernel for head_dim " + std::to_string(p.cache.head_dim));
  }
  TESSERA_CHECK_LAUNCH();
}

}  // namespace tessera::attention::detail
