// The MoE layer's activation step: silu(gate) * up over the first GEMM's bf16 output, quantized for the second
// GEMM (fp8 with 1×128 block scales, fp8 with a static per-tensor scale, or bf16).
//
// Memory-bound: per row it reads 2I bf16 and writes I codes (+ I/128 scales). Each thread owns 8 consecutive
// columns (one 16-byte load of gate values, one of up values), so the 16 lanes of a half warp cover one 128-column
// block: its amax is a 4-step shuffle, and the half warp stores the block's 128 codes as one contiguous run.
#include <cuda_bf16.h>

#include <cstdint>

#include "common/check.h"
#include "common/device_info.h"
#include "common/numeric.cuh"
#include "moe/layer/problem.h"
#include "ptx/ldst.cuh"
#include "ptx/math.cuh"

namespace tessera::moe::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kLanesPerBlock = 16;  // 16 lanes × 8 columns = one 128-column scale block

template <WeightFormat kFormat>
__global__ void __launch_bounds__(kThreads) silu_mul_quant_kernel(const ActivationArgs a) {
  const int64_t rows_in_use = *a.rows_end;
  const int64_t rows = rows_in_use < 0 ? 0 : (rows_in_use < a.capacity ? rows_in_use : a.capacity);
  const int64_t vecs_per_row = a.intermediate / 8;  // a multiple of 16
  const int64_t items = rows * vecs_per_row;
  float inv = 1.0f;
  if constexpr (kFormat == WeightFormat::kFP8PerTensor) inv = 1.0f / __ldg(a.static_scale);
  const int lane = threadIdx.x & 31;
  // The loop bound is warp-uniform (the amax shuffles need every lane of the half warp).
  const int64_t warp_first = (static_cast<int64_t>(blockIdx.x) * kThreads + (threadIdx.x & ~31));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = warp_first; base < items; base += stride) {
    const int64_t item = base + lane;
    const bool active = item < items;
    const int64_t row = active ? item / vecs_per_row : 0;
    const int64_t vec = active ? item - row * vecs_per_row : 0;
    const auto* src = static_cast<const __nv_bfloat16*>(a.h) + row * 2 * a.intermediate + vec * 8;
    uint4 graw = make_uint4(0, 0, 0, 0), uraw = make_uint4(0, 0, 0, 0);
    if (active) {
      graw = ptx::ld_global_nc_na_v4(src);
      uraw = ptx::ld_global_nc_na_v4(src + a.intermediate);
    }
    const auto* g = reinterpret_cast<const __nv_bfloat16*>(&graw);
    const auto* u = reinterpret_cast<const __nv_bfloat16*>(&uraw);
    float v[8];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float gf = __bfloat162float(g[i]);
      v[i] = tessera::detail::silu_mul(gf, __bfloat162float(u[i]));
      amax = fmaxf(amax, fabsf(v[i]));
    }
    if constexpr (kFormat == WeightFormat::kBF16) {
      uint4 out;
      out.x = tessera::detail::pack2<false>(v[0], v[1]);
      out.y = tessera::detail::pack2<false>(v[2], v[3]);
      out.z = tessera::detail::pack2<false>(v[4], v[5]);
      out.w = tessera::detail::pack2<false>(v[6], v[7]);
      if (active) ptx::st_global_v4(static_cast<__nv_bfloat16*>(a.act) + row * a.intermediate + vec * 8, out);
    } else {
      float scale = 0.0f;
      if constexpr (kFormat == WeightFormat::kFP8Blockwise) {
#pragma unroll
        for (int o = kLanesPerBlock / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        scale = tessera::detail::fp8_block_scale(amax, kFP8BlockScaleEps);
        inv = ptx::rcp_approx_ftz(scale);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] *= inv;
      if (active) {
        ptx::st_global_v2(static_cast<uint8_t*>(a.act) + row * a.intermediate + vec * 8,
                          tessera::detail::pack_fp8x8_e4m3(v));
        if constexpr (kFormat == WeightFormat::kFP8Blockwise)
          if (vec % kLanesPerBlock == 0) a.act_scales[row * (a.intermediate / 128) + vec / kLanesPerBlock] = scale;
      }
    }
  }
}

}  // namespace

void launch_activation(const ActivationArgs& args, cudaStream_t stream) {
  // A persistent grid: enough resident warps to keep ~64 KB of loads in flight per SM; blocks past the rows in use
  // (read on the device) exit at once.
  const int64_t items = args.capacity * (args.intermediate / 8);
  const int64_t max_blocks = static_cast<int64_t>(tessera::detail::current_device_info().num_sms) * 8;
  const int64_t needed = (items + kThreads - 1) / kThreads;
  const auto grid = static_cast<unsigned>(needed < max_blocks ? needed : max_blocks);
  if (grid == 0) return;
  switch (args.format) {
    case WeightFormat::kFP8Blockwise:
      silu_mul_quant_kernel<WeightFormat::kFP8Blockwise><<<grid, kThreads, 0, stream>>>(args);
      break;
    case WeightFormat::kFP8PerTensor:
      silu_mul_quant_kernel<WeightFormat::kFP8PerTensor><<<grid, kThreads, 0, stream>>>(args);
      break;
    case WeightFormat::kBF16:
      silu_mul_quant_kernel<WeightFormat::kBF16><<<grid, kThreads, 0, stream>>>(args);
      break;
  }
  TESSERA_CHECK_LAUNCH();
}

}  // namespace tessera::moe::detail
