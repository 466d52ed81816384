// Decode: the top-level launcher (format dispatch) and the split-K merge kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "attention/decode/kernel.cuh"
#include "attention/decode/problem.h"
#include "common/check.h"
#include "common/device_info.h"
#include "common/pdl.h"
#include "common/tensor_map.h"
#include "ptx/grid.cuh"
#include "ptx/math.cuh"

namespace tessera::attention::detail {

template <KVFormat kFormat>
void launch_decode_format(const DecodeArgs& args, int grid, cudaStream_t stream);

namespace {

// The merge's threads: 8 slices of the splits × D/4 column quads (128, 256 or 512 threads); each thread holds
// kPer = 1, 4 or 16 splits' quads (the least that covers the split count: registers, and so the merge CTAs that fit
// beside the decode grid's last CTAs, grow with it).
constexpr int kMergeSlices = 8;

// One CTA per (sequence, new token, query head): o = Σ_s 2^(lse_s - M) O_s / Σ_s 2^(lse_s - M), M = max_s lse_s.
// Partial outputs of empty splits have lse -inf and weigh nothing; all empty gives o = 0 and lse = -inf.
// Every load is issued at once: thread (slice j, quad c) reads the log-sum-exps and the 4 columns of quad c of
// splits j, j + 8, ..., so the merge costs one L2 round trip whatever the split count (v14 in docs/perf/decode.md;
// a loop over the splits costs a round trip per few splits). Then the maximum and the weight total go through
// shared memory, and the 8 slices' sums are added there.
// Launched as a programmatic dependent of the decode kernel (common/pdl.h): its CTAs may start while the decode grid
// runs (once every decode CTA has started, or passed its own wait where the decode is programmatic too), and wait
// here until that grid has completed and its writes are visible.
template <int kD, int kPer>
__global__ void __launch_bounds__(kMergeSlices * kD / 4) decode_merge_kernel(const DecodeArgs a) {
  constexpr int kQuads = kD / 4;
  TESSERA_DECODE_MARK(1, 0);  // entry
  const int row = blockIdx.x;  // (b * S + i) * HQ + h
  const int bi = row / a.num_q_heads, h = row % a.num_q_heads;
  const int b = bi / a.num_new, i = bi % a.num_new;
  ptx::grid_dependency_wait();
  TESSERA_DECODE_MARK(1, 1);  // past the wait
  // The stream's next kernel (e.g. the next call's decode, a programmatic dependent) may be scheduled now, after the
  // wait (see the trigger in kernel.cuh); it waits for this grid's completion before touching the workspace or o.
  ptx::launch_dependents();
  // The sequence's splits: workspace slots first .. first + splits - 1 (kernel.cuh, DecodeArgs::ws_o); a balanced
  // plan's from the pair its split 0 wrote (v18c computed the plan here instead, before the wait, while the decode
  // ran: B·HQ merge CTAs each reading all lengths slowed the decode by 10-45 %). A balanced plan's sequence of one
  // split wrote o itself.
  int first = b * a.num_splits, splits = a.num_splits;
  if (a.balanced) {
    const int2 m = a.ws_plan[b];
    first = m.x;
    splits = m.y;
    if (splits <= 1) return;
  }
  __shared__ float slice_max[kMergeSlices], slice_total[kMergeSlices];
  __shared__ float4 slice_acc[kMergeSlices][kQuads];
  const int quad = threadIdx.x % kQuads, slice = threadIdx.x / kQuads;
  const int64_t base = static_cast<int64_t>(first) * a.num_new * a.num_q_heads +
                       static_cast<int64_t>(i * a.num_q_heads + h) * splits;  // split 0 of this row
  const float* lse = a.ws_lse + base;
  const float4* part = reinterpret_cast<const float4*>(a.ws_o + base * kD) + quad;
  float l[kPer];
  float4 v[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int s = slice + k * kMergeSlices;
    l[k] = s < splits ? lse[s] : -INFINITY;
    v[k] = s < splits ? part[static_cast<int64_t>(s) * kQuads] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  float m = l[0];
#pragma unroll
  for (int k = 1; k < kPer; ++k) m = fmaxf(m, l[k]);
  if (quad == 0) slice_max[slice] = m;
  __syncthreads();
  TESSERA_DECODE_MARK(1, 2);  // the partials loaded
  m = slice_max[0];
#pragma unroll
  for (int k = 1; k < kMergeSlices; ++k) m = fmaxf(m, slice_max[k]);
  float total = 0.0f;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (m != -INFINITY) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const float w = ptx::ex2_approx_ftz(l[k] - m);  // -inf (past the splits, or empty): 0
      total += w;
      if (w > 0.0f) {  // an underflowed split weighs nothing, whatever it holds
        acc.x = fmaf(w, v[k].x, acc.x);
        acc.y = fmaf(w, v[k].y, acc.y);
        acc.z = fmaf(w, v[k].z, acc.z);
        acc.w = fmaf(w, v[k].w, acc.w);
      }
    }
  }
  if (quad == 0) slice_total[slice] = total;
  slice_acc[slice][quad] = acc;
  __syncthreads();
  if (slice != 0) return;
  total = 0.0f;
#pragma unroll
  for (int k = 0; k < kMergeSlices; ++k) {
    total += slice_total[k];
    if (k > 0) {
      const float4 o = slice_acc[k][quad];
      acc.x += o.x;
      acc.y += o.y;
      acc.z += o.z;
      acc.w += o.w;
    }
  }
  const bool any = total > 0.0f;
  const float inv = any ? 1.0f / total : 0.0f, lse2 = any ? m + __log2f(total) : -INFINITY;
  const float out[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
#pragma unroll
  for (int k = 0; k < 4; ++k) store_output(a, b, i, h, 4 * quad + k, out[k], lse2, any);
  TESSERA_DECODE_MARK(1, 3);  // thread 0's outputs written
}

template <int kD, int kPer>
void launch_merge(const DecodeArgs& a, int64_t rows, cudaStream_t stream) {
  ::tessera::detail::launch_programmatic(decode_merge_kernel<kD, kPer>, dim3(static_cast<unsigned>(rows)),
                                         dim3(kMergeSlices * kD / 4), 0, stream, a);
}

// The key and value tensor maps (see DecodeArgs): boxes of whole rows, swizzled by min(rowB, 128), of the kernel's
// stage rows, or of one page where pages are shorter (16-token pages under 32-row stages: two boxes per stage).
void make_cache_maps(const CacheDesc& cd, int64_t batch, DecodeArgs& a) {
  if (cd.capacity == 0) return;  // nothing can be attended: the kernel issues no copy
  const int64_t w = cd.row_bytes < 128 ? cd.row_bytes : 128, parts = cd.row_bytes / w;
  const int64_t tokens = cd.paged ? cd.page_size : cd.capacity;  // of a sequence (contiguous) or a page
  const int64_t outer = cd.paged ? cd.num_pages : batch;
  const int stage_rows = decode_stage_rows(cd.format, cd.head_dim);
  const int rows = cd.paged && cd.page_size < stage_rows ? cd.page_size : stage_rows;
  const int64_t k_dims[5] = {w, parts, cd.num_kv_heads, tokens, outer};
  const int64_t k_strides[4] = {w, cd.stride_head, cd.stride_token, cd.stride_outer};
  const int k_box[5] = {static_cast<int>(w), static_cast<int>(parts), 1, rows, 1};
  const int64_t v_dims[5] = {w, tokens, parts, cd.num_kv_heads, outer};
  const int64_t v_strides[4] = {cd.stride_token, w, cd.stride_head, cd.stride_outer};
  const int v_box[5] = {static_cast<int>(w), rows, static_cast<int>(parts), 1, 1};
  // The cache is read once: 128-byte L2 promotion (256 bytes cost bf16 7 % at B = 128; none costs 64-byte int4 rows
  // of interleaved heads 20 %: docs/perf/decode.md, v9).
  using ::tessera::detail::L2Promotion;
  using ::tessera::detail::make_tensor_map_u8;
  a.k_map = make_tensor_map_u8(cd.k, 5, k_dims, k_strides, k_box, static_cast<int>(w), L2Promotion::k128B);
  a.v_map = make_tensor_map_u8(cd.v, 5, v_dims, v_strides, v_box, static_cast<int>(w), L2Promotion::k128B);
}

#ifdef TESSERA_DECODE_TRACE
unsigned long long* g_trace = nullptr;
int g_trace_ctas = 0, g_trace_slots = 0, g_trace_next = 0;
#endif

}  // namespace

#ifdef TESSERA_DECODE_TRACE
// Measurement builds: launch i (counted from this call) writes its events into slot i % slots of buf, each slot
// ctas · 2 · (kDecodeTraceEvents + kMergeTraceEvents) words (bench/decode_trace.cu); buf null turns it off.
void set_decode_trace(unsigned long long* buf, int ctas, int slots) {
  g_trace = buf;
  g_trace_ctas = ctas;
  g_trace_slots = slots;
  g_trace_next = 0;
}
#endif

void launch_decode(const DecodeProblem& pb, cudaStream_t stream) {
  DecodeArgs a{};  // zeroed: the tensor maps stay zero where make_cache_maps builds none (capacity 0)
  make_cache_maps(pb.cache, pb.batch, a);
  a.cache = pb.cache;
  a.q = pb.q;
  a.q_stride_b = pb.q_stride_b;
  a.q_stride_s = pb.q_stride_s;
  a.q_stride_h = pb.q_stride_h;
  a.o = pb.o;
  a.o_stride_b = pb.o_stride_b;
  a.o_stride_s = pb.o_stride_s;
  a.o_stride_h = pb.o_stride_h;
  a.lse = pb.lse;
  a.lse_stride_b = pb.lse_stride_b;
  a.lse_stride_s = pb.lse_stride_s;
  a.lse_stride_h = pb.lse_stride_h;
  a.seqlens = pb.seqlens;
  a.q_fp16 = pb.fp16;
  a.num_q_heads = pb.num_q_heads;
  a.group = pb.num_q_heads / pb.cache.num_kv_heads;
  a.num_new = pb.num_new;
  a.rows = a.group * pb.num_new;
  a.head_tiles = decode_head_tiles(a.rows);
  a.batch = pb.batch;
  a.num_splits = pb.num_splits;
  a.balanced = pb.balanced;
  a.max_seq_splits = a.balanced ? decode_max_seq_splits(pb.num_splits) : pb.num_splits;
  a.qk_scale = pb.softmax_scale;
  a.softcap = pb.softcap;
  // A window of at least the cache's capacity excludes nothing (every key is within it): 0, which also keeps the
  // kernel's int32 window arithmetic (lim - window) from wrapping for windows near INT32_MAX.
  a.window = pb.window >= pb.cache.capacity ? 0 : static_cast<int>(pb.window);
  if (pb.num_splits > 1) {
    const int64_t rows = static_cast<int64_t>(pb.batch) * pb.num_new * pb.num_q_heads * pb.num_splits;
    a.ws_o = static_cast<float*>(pb.workspace);
    a.ws_lse = a.ws_o + rows * pb.cache.head_dim;
    if (a.balanced)
      a.ws_plan = reinterpret_cast<int2*>(static_cast<uint8_t*>(pb.workspace) +
                                          decode_workspace_plan_offset(rows, pb.cache.head_dim));
  }
  const int64_t grid64 = static_cast<int64_t>(pb.batch) * pb.cache.num_kv_heads * pb.num_splits * a.head_tiles;
  if (grid64 > INT32_MAX) throw Error("tessera::attention::decode: too many CTAs (" + std::to_string(grid64) + ")");
  const int grid = static_cast<int>(grid64);
  a.programmatic = decode_launch_programmatic(grid64, ::tessera::detail::current_device_info().num_sms);
#ifdef TESSERA_DECODE_TRACE
  if (g_trace != nullptr) {
    const int slot = g_trace_next++ % g_trace_slots;
    a.trace = g_trace + int64_t{slot} * g_trace_ctas * 2 * (kDecodeTraceEvents + kMergeTraceEvents);
    a.trace_ctas = g_trace_ctas;
  }
#endif
  switch (pb.cache.format) {
    case KVFormat::kNative: launch_decode_format<KVFormat::kNative>(a, grid, stream); break;
    case KVFormat::kFP8: launch_decode_format<KVFormat::kFP8>(a, grid, stream); break;
    case KVFormat::kInt8: launch_decode_format<KVFormat::kInt8>(a, grid, stream); break;
    case KVFormat::kInt4: launch_decode_format<KVFormat::kInt4>(a, grid, stream); break;
    case KVFormat::kInt4Group32: launch_decode_format<KVFormat::kInt4Group32>(a, grid, stream); break;
    case KVFormat::kInt8KChannel: launch_decode_format<KVFormat::kInt8KChannel>(a, grid, stream); break;
    case KVFormat::kInt4KChannel: launch_decode_format<KVFormat::kInt4KChannel>(a, grid, stream); break;
  }
  if (pb.num_splits > 1) {
    const int64_t rows = int64_t{pb.batch} * pb.num_new * pb.num_q_heads;
    const auto by_dim = [&](auto per) {
      constexpr int kPer = decltype(per)::value;
      switch (pb.cache.head_dim) {
        case 64: return launch_merge<64, kPer>(a, rows, stream);
        case 128: return launch_merge<128, kPer>(a, rows, stream);
        default: return launch_merge<256, kPer>(a, rows, stream);
      }
    };
    static_assert(16 * kMergeSlices == kDecodeMaxSplits, "16 splits per merge thread cover every split count");
    if (a.max_seq_splits <= kMergeSlices)
      by_dim(std::integral_constant<int, 1>{});
    else if (a.max_seq_splits <= 4 * kMergeSlices)
      by_dim(std::integral_constant<int, 4>{});
    else
      by_dim(std::integral_constant<int, 16>{});
  }
}

}  // namespace tessera::attention::detail
