// Decode: the top-level launcher (the cache maps, the kernel arguments, the format dispatch).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "attention/decode/kernel.cuh"
#include "attention/decode/problem.h"
#include "common/check.h"
#include "common/tensor_map.h"

namespace tessera::attention::detail {

template <KVFormat kFormat>
void launch_decode_format(const DecodeArgs& args, int grid, cudaStream_t stream);

namespace {

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

}  // namespace

void launch_decode(const DecodeProblem& pb, cudaStream_t stream) {
  DecodeArgs a;
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
  a.num_splits = pb.num_splits;
  a.qk_scale = pb.softmax_scale;
  a.softcap = pb.softcap;
  a.window = pb.window;
  if (pb.num_splits > 1) {  // the merge counters, then the partial outputs and their log-sum-exps
    const int64_t rows = static_cast<int64_t>(pb.batch) * pb.num_new * pb.num_q_heads * pb.num_splits;
    a.ws_count = static_cast<int*>(pb.workspace);
    a.ws_o = reinterpret_cast<float*>(static_cast<uint8_t*>(pb.workspace) + kDecodeCounterBytes);
    a.ws_lse = a.ws_o + rows * pb.cache.head_dim;
  }
  const int64_t grid64 = static_cast<int64_t>(pb.batch) * pb.cache.num_kv_heads * pb.num_splits * a.head_tiles;
  if (grid64 > INT32_MAX) throw Error("tessera::attention::decode: too many CTAs (" + std::to_string(grid64) + ")");
  const int grid = static_cast<int>(grid64);
  switch (pb.cache.format) {
    case KVFormat::kNative: launch_decode_format<KVFormat::kNative>(a, grid, stream); break;
    case KVFormat::kFP8: launch_decode_format<KVFormat::kFP8>(a, grid, stream); break;
    case KVFormat::kInt8: launch_decode_format<KVFormat::kInt8>(a, grid, stream); break;
    case KVFormat::kInt4: launch_decode_format<KVFormat::kInt4>(a, grid, stream); break;
    case KVFormat::kInt4Group32: launch_decode_format<KVFormat::kInt4Group32>(a, grid, stream); break;
    case KVFormat::kInt8KChannel: launch_decode_format<KVFormat::kInt8KChannel>(a, grid, stream); break;
    case KVFormat::kInt4KChannel: launch_decode_format<KVFormat::kInt4KChannel>(a, grid, stream); break;
  }
}

}  // namespace tessera::attention::detail
