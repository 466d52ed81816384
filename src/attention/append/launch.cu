// append_kv: quantizes new K/V rows into the cache format and writes them, with their scales, at the given
// positions. One warp per (sequence, new token, KV head, K or V) row; each lane owns D/32 consecutive elements.
// The arithmetic follows attention.h's definition step by step (fp32, correctly rounded division) so that the
// host reference reproduces every code bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode/problem.h"
#include "common/check.h"

namespace tessera::attention::detail {
namespace {

constexpr int kAppendWarps = 4;

__device__ __forceinline__ float load_elem(const void* p, int64_t at, bool fp16) {
  return fp16 ? __half2float(static_cast<const __half*>(p)[at])
              : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[at]);
}

// fp16 round-to-nearest-even, saturated to the largest finite value.
__device__ __forceinline__ __half fp16_sat(float x) { return __float2half_rn(fminf(fmaxf(x, -65504.0f), 65504.0f)); }

template <int kHeadDim>
__global__ void __launch_bounds__(32 * kAppendWarps) append_kernel(const AppendProblem p) {
  constexpr int kPer = kHeadDim / 32;  // elements per lane
  const CacheDesc& cd = p.cache;
  const int lane = threadIdx.x % 32;
  int64_t row = static_cast<int64_t>(blockIdx.x) * kAppendWarps + threadIdx.x / 32;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.num_new * cd.num_kv_heads * 2;
  if (row >= rows) return;
  const bool is_v = row & 1;
  row >>= 1;
  const int kvh = static_cast<int>(row % cd.num_kv_heads);
  row /= cd.num_kv_heads;
  const int i = static_cast<int>(row % p.num_new);
  const int b = static_cast<int>(row / p.num_new);

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
  const bool int4 = cd.format != KVFormat::kInt8;
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
  const __half scale_h = fp16_sat(__fdiv_rn(__fsub_rn(hi, lo), levels));
  const __half offset_h = fp16_sat(lo);
  const float scale = __half2float(scale_h), offset = __half2float(offset_h);
  uint32_t code[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const float qf = scale == 0.0f ? 0.0f : rintf(__fdiv_rn(__fsub_rn(x[e], offset), scale));
    code[e] = static_cast<uint32_t>(fminf(fmaxf(qf, 0.0f), levels));
  }
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

}  // namespace

void launch_append(const AppendProblem& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.num_new * p.cache.num_kv_heads * 2;
  const int64_t blocks = (rows + kAppendWarps - 1) / kAppendWarps;
  if (blocks > INT32_MAX) throw Error("tessera::attention::append_kv: too many rows (" + std::to_string(rows) + ")");
  const int grid = static_cast<int>(blocks);
  switch (p.cache.head_dim) {
    case 64: append_kernel<64><<<grid, 32 * kAppendWarps, 0, stream>>>(p); break;
    case 128: append_kernel<128><<<grid, 32 * kAppendWarps, 0, stream>>>(p); break;
    case 256: append_kernel<256><<<grid, 32 * kAppendWarps, 0, stream>>>(p); break;
    default: throw Error("tessera::attention::append_kv: no kernel for head_dim " + std::to_string(p.cache.head_dim));
  }
  TESSERA_CHECK_LAUNCH();
}

}  // namespace tessera::attention::detail
