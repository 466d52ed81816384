// Weight-only linear launcher: the optional x preparation, the tensor maps, the kernel, the split reduction.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/check.h"
#include "common/occupancy.h"
#include "common/tensor_map.h"
#include "linear/gemm_kernel.cuh"
#include "linear/problem.h"
#include "tessera/error.h"

namespace tessera::linear::detail {
namespace {

using ::tessera::detail::elementwise_grid;
using ::tessera::detail::L2Promotion;

// The im2col map of a conv's NHWC x: filter bases from (−pad, −pad) to the last output pixel's, every `stride`-th.
CUtensorMap conv_x_map(const ConvGeometry& g, const void* x, int pixels) {
  ::tessera::detail::Im2colBox box;
  box.n = g.n;
  box.h = g.h;
  box.w = g.w;
  box.c = g.c;
  box.lower_h = -g.pad_h;
  box.lower_w = -g.pad_w;
  box.upper_h = g.pad_h - g.dil_h * (g.kh - 1);
  box.upper_w = g.pad_w - g.dil_w * (g.kw - 1);
  box.stride_h = g.stride_h;
  box.stride_w = g.stride_w;
  box.pixels = pixels;
  return ::tessera::detail::make_tensor_map_im2col(x, box);
}

template <class T, int kBits, int kBN>
void launch_bn(const LinearProblem& pb, const T* x, int64_t ldx, const GemmArgs& args, cudaStream_t stream) {
  const LinearShape& s = pb.shape;
  const LinearConfig& c = pb.config;
  const StageBytes sb = stage_bytes(kBN, kBits, s.block, s.k);
  const int64_t stripes = (s.n + 15) / 16, tile_k = kBits == 4 ? 64 : 32, tiles = (s.k + tile_k - 1) / tile_k;
  // Codes [stripes][tiles][512 bytes] as bytes in 256-byte halves (a box row is at most 256 elements); parameters
  // [stripes][blocks][64 bytes]; x [M][K] of 16-bit values, K-major boxes of 64 columns (128-byte swizzle).
  const int64_t code_dims[4] = {256, 2, tiles, stripes};
  const int64_t code_strides[3] = {256, 512, tiles * 512};
  const int code_box[4] = {256, 2, sb.kblocks * sb.tiles_per_kblock, kGemmStripes};
  const CUtensorMap codes_map =
      ::tessera::detail::make_tensor_map_u8(pb.codes, 4, code_dims, code_strides, code_box, 0, L2Promotion::k128B);
  const int64_t param_dims[3] = {64, pb.num_blocks, stripes};
  const int64_t param_strides[2] = {64, pb.num_blocks * 64};
  const int param_box[3] = {64, sb.blocks, kGemmStripes};
  const CUtensorMap params_map =
      ::tessera::detail::make_tensor_map_u8(pb.params, 3, param_dims, param_strides, param_box, 0, L2Promotion::k128B);
  const CUtensorMap x_map = pb.conv.enabled
                                ? conv_x_map(pb.conv, x, kBN)
                                : ::tessera::detail::make_tensor_map_sw128(x, ::tessera::detail::TmaElement::kBF16, s.k,
                                                                           s.m, 1, ldx, s.m * ldx, kBN);
  GemmArgs a = args;
  a.tiles_per_kblock = sb.tiles_per_kblock;
  a.stage_blocks = sb.blocks;
  a.x_bytes = static_cast<uint32_t>(sb.x);
  a.code_bytes = static_cast<uint32_t>(sb.codes);
  a.stage_bytes = static_cast<uint32_t>(sb.total);
  a.tx_bytes = static_cast<uint32_t>(sb.x + sb.codes + sb.params);
  // The 96- and 192-token tiles exist for the implicit-GEMM conv only (LinearShape::wave_tiles); the plain kernels keep
  // the power-of-two set.
  constexpr bool kWaveTile = kBN == 96 || kBN == 192;
  using Kernel = void (*)(CUtensorMap, CUtensorMap, CUtensorMap, GemmArgs, ConvArgs);
  Kernel kernel = nullptr;
  if (pb.conv.enabled) {
    if constexpr (kBN >= 64) kernel = linear_gemm_kernel<T, kBits, kBN, true>;
  } else if constexpr (!kWaveTile) {
    kernel = linear_gemm_kernel<T, kBits, kBN>;
  }
  if (kernel == nullptr)
    throw Error("tessera: internal error: no linear kernel for a " + std::to_string(kBN) + "-token tile");
  const int smem = static_cast<int>(gemm_smem_bytes(s, c));
  // Raises the kernel's dynamic shared-memory limit (once per size).
  ::tessera::detail::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), gemm_threads(kBN), smem);
  const dim3 grid(static_cast<unsigned>(c.n_tiles), static_cast<unsigned>(c.m_tiles), static_cast<unsigned>(c.splits));
  ConvArgs conv{};
  if (pb.conv.enabled) {
    const ConvGeometry& g = pb.conv;
    conv.chunks = static_cast<int>(g.ci_g / kKBlock);
    conv.kw = g.kw;
    conv.dil_h = g.dil_h;
    conv.dil_w = g.dil_w;
    conv.c = static_cast<int>(g.c);
    conv.ho = static_cast<int>(g.ho);
    conv.wo = static_cast<int>(g.wo);
    conv.stride_h = g.stride_h;
    conv.stride_w = g.stride_w;
    conv.pad_h = g.pad_h;
    conv.pad_w = g.pad_w;
    conv.ci_g = static_cast<int>(g.ci_g);
    conv.co_g = static_cast<int>(g.co_g);
  }
  kernel<<<grid, gemm_threads(kBN), smem, stream>>>(codes_map, params_map, x_map, a, conv);
  TESSERA_CHECK_LAUNCH();
}

template <class T, int kBits>
void launch_bits(const LinearProblem& pb, const T* x, int64_t ldx, const GemmArgs& a, cudaStream_t stream) {
  switch (pb.config.bn) {
    case 8:
      return launch_bn<T, kBits, 8>(pb, x, ldx, a, stream);
    case 16:
      return launch_bn<T, kBits, 16>(pb, x, ldx, a, stream);
    case 32:
      return launch_bn<T, kBits, 32>(pb, x, ldx, a, stream);
    case 64:
      return launch_bn<T, kBits, 64>(pb, x, ldx, a, stream);
    case 96:
      return launch_bn<T, kBits, 96>(pb, x, ldx, a, stream);
    case 128:
      return launch_bn<T, kBits, 128>(pb, x, ldx, a, stream);
    case 192:
      return launch_bn<T, kBits, 192>(pb, x, ldx, a, stream);
    default:
      return launch_bn<T, kBits, 256>(pb, x, ldx, a, stream);
  }
}

template <class T>
void launch_typed(const LinearProblem& pb, cudaStream_t stream) {
  const LinearShape& s = pb.shape;
  const LinearConfig& c = pb.config;
  const T* x = static_cast<const T*>(pb.x);
  int64_t ldx = pb.ldx;
  auto* ws = static_cast<unsigned char*>(pb.workspace);
  if (pb.prepare_x()) {
    T* xw = reinterpret_cast<T*>(ws);
    const int grid = elementwise_grid(s.m * s.k);
    if (pb.x_dtype == DType::kFP32)
      prepare_x<T, float><<<grid, 256, 0, stream>>>(static_cast<const float*>(pb.x), pb.ldx, pb.k_perm, xw, s.m, s.k);
    else
      prepare_x<T, T><<<grid, 256, 0, stream>>>(x, pb.ldx, pb.k_perm, xw, s.m, s.k);
    TESSERA_CHECK_LAUNCH();
    x = xw;
    ldx = s.k;
    ws += prepared_x_bytes(s, true);
  }
  GemmArgs a{};
  a.m = s.m;
  a.n = s.n;
  a.k = s.k;
  a.y = pb.y;
  a.ldy = pb.ldy;
  a.bias = pb.bias;
  a.clamp_min = pb.clamp_min;
  a.clamp_max = pb.clamp_max;
  a.partial = c.splits > 1 ? reinterpret_cast<float*>(ws) : nullptr;
  a.k_blocks = static_cast<int>((s.k + kKBlock - 1) / kKBlock);
  a.splits = c.splits;
  a.stages = c.stages;
  a.block_shift = pb.block_shift;
  a.zero_point = pb.zero_point;
  a.y_f32 = pb.x_dtype == DType::kFP32;

  if (s.bits == 4)
    launch_bits<T, 4>(pb, x, ldx, a, stream);
  else
    launch_bits<T, 8>(pb, x, ldx, a, stream);
  if (c.splits > 1) {
    reduce_partials<T><<<elementwise_grid(s.m * s.n), 256, 0, stream>>>(a);
    TESSERA_CHECK_LAUNCH();
  }
}

}  // namespace

std::size_t prepared_x_bytes(const LinearShape& s, bool prepare) {
  return prepare ? (static_cast<std::size_t>(s.m * s.k) * 2 + 255) / 256 * 256 : 0;
}

std::size_t call_workspace_bytes(const LinearShape& s, const LinearConfig& c, bool prepare) {
  return prepared_x_bytes(s, prepare) + partial_bytes(s, c);
}

void launch_linear(const LinearProblem& pb, cudaStream_t stream) {
  if (pb.compute == DType::kFP16)
    launch_typed<__half>(pb, stream);
  else
    launch_typed<__nv_bfloat16>(pb, stream);
}

}  // namespace tessera::linear::detail
