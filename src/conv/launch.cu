// conv2d launcher: x rewritten as NHWC in the compute dtype where needed, then the linear layer's kernel (plain, or
// with TMA im2col copies) or the direct kernel, then y transposed to NCHW where asked (docs/ops/conv.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/check.h"
#include "common/numeric.cuh"
#include "common/occupancy.h"
#include "conv/problem.h"
#include "linear/config.h"
#include "linear/layout.h"

namespace tessera::conv::detail {
namespace {

using ::tessera::detail::elementwise_grid;
using ::tessera::detail::from_float;
using ::tessera::detail::to_float;

template <class T>
__device__ __forceinline__ float param_value(uint16_t bits);
template <>
__device__ __forceinline__ float param_value<__nv_bfloat16>(uint16_t bits) {
  return __bfloat162float(__ushort_as_bfloat16(bits));
}
template <>
__device__ __forceinline__ float param_value<__half>(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// dst[b][c][r] = Dst(src[b][r][c]) through 32 × 32 tiles of shared memory (coalesced on both sides): NCHW x → NHWC
// (rows = C, cols = H·W) and NHWC y → NCHW (rows = Ho·Wo, cols = Co).
template <class Src, class Dst>
__global__ void transpose_batched(const Src* __restrict__ src, Dst* __restrict__ dst, int64_t batch, int64_t rows,
                                  int64_t cols) {
  __shared__ float tile[32][33];
  const int64_t row_tiles = (rows + 31) / 32, col_tiles = (cols + 31) / 32;
  for (int64_t t = blockIdx.x; t < batch * row_tiles * col_tiles; t += gridDim.x) {
    const int64_t b = t / (row_tiles * col_tiles), rt = (t / col_tiles) % row_tiles, ct = t % col_tiles;
    const int64_t r0 = rt * 32, c0 = ct * 32;
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
      const int64_t r = r0 + j, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[j][threadIdx.x] = to_float(src[(b * rows + r) * cols + c]);
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += blockDim.y) {
      const int64_t c = c0 + j, r = r0 + threadIdx.x;
      if (r < rows && c < cols) dst[(b * cols + c) * rows + r] = from_float<Dst>(tile[threadIdx.x][j]);
    }
    __syncthreads();
  }
}

template <class Src, class Dst>
void launch_transpose(const Src* src, Dst* dst, int64_t batch, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t tiles = batch * ((rows + 31) / 32) * ((cols + 31) / 32);
  const int grid = static_cast<int>(std::min<int64_t>(tiles, int64_t{1} << 20));
  transpose_batched<Src, Dst><<<grid, dim3(32, 8), 0, stream>>>(src, dst, batch, rows, cols);
  TESSERA_CHECK_LAUNCH();
}

template <class Src, class Dst>
__global__ void convert(const Src* __restrict__ src, Dst* __restrict__ dst, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = from_float<Dst>(to_float(src[i]));
}

struct DirectArgs {
  linear::detail::ConvGeometry g;
  const void* x;  // NHWC, compute dtype
  const uint8_t* codes;
  const uint16_t* params;
  int64_t co, kp, num_blocks, block;
  int bits;
  bool zero_point;
  void* y;  // NHWC, Y
  const void* bias;
  float clamp_min, clamp_max;
};

// Weight (co, r) exactly as the prepacked layout holds it: q·s + o or (q − z)·s in fp32 from the stored 16-bit
// parameters.
template <class T>
__device__ __forceinline__ float dequant_weight(const DirectArgs& a, const linear::detail::FragmentLayout& layout,
                                                int64_t co, int64_t r) {
  const int64_t at = linear::detail::param_index(co, r / a.block, a.num_blocks);
  const float s = param_value<T>(a.params[at]), p = param_value<T>(a.params[at + 1]);
  const float q = static_cast<float>(layout.get_code(a.codes, a.kp, co, r));
  return a.zero_point ? (q - p) * s : fmaf(q, s, p);
}

// Σ over the window of output pixel `pix` of x (NHWC, already offset to the group's first channel) times weight(r),
// padded taps skipped; fp32. I: the index type, int32_t where every index of the call fits (fits_int32), else
// int64_t (64-bit division costs several times more).
template <class I, class T, class Weight>
__device__ __forceinline__ float window_sum(const linear::detail::ConvGeometry& g, const T* xg, I pix, Weight weight) {
  const I wo = static_cast<I>(g.wo), ho = static_cast<I>(g.ho), h = static_cast<I>(g.h), w = static_cast<I>(g.w);
  const I ow = pix % wo, oh = (pix / wo) % ho, img = pix / (wo * ho);
  const T* const xb = xg + static_cast<int64_t>(img) * h * w * static_cast<I>(g.c);
  float acc = 0.f;
  for (int ky = 0; ky < g.kh; ++ky) {
    const I ih = oh * g.stride_h - g.pad_h + static_cast<I>(ky) * g.dil_h;
    if (ih < 0 || ih >= h) continue;
    for (int kx = 0; kx < g.kw; ++kx) {
      const I iw = ow * g.stride_w - g.pad_w + static_cast<I>(kx) * g.dil_w;
      if (iw < 0 || iw >= w) continue;
      const T* const xp = xb + (ih * w + iw) * static_cast<I>(g.c);
      const I r0 = (static_cast<I>(ky) * g.kw + kx) * static_cast<I>(g.ci_g);
      for (I ci = 0; ci < static_cast<I>(g.ci_g); ++ci) acc = fmaf(to_float(xp[ci]), weight(r0 + ci), acc);
    }
  }
  return acc;
}

template <class Y>
__device__ __forceinline__ void store_direct(const DirectArgs& a, int64_t pix, int64_t co, float acc) {
  if (a.bias != nullptr) acc += to_float(static_cast<const Y*>(a.bias)[co]);
  static_cast<Y*>(a.y)[pix * a.co + co] = from_float<Y>(fminf(fmaxf(acc, a.clamp_min), a.clamp_max));
}

// One thread per output element (pixel, co), co fastest (a warp's x reads are one pixel's channels), each weight
// decoded from the prepacked layout (linear/layout.h) where it is used: the fallback for K beyond the staged kernel's.
template <class T, class Y>
__global__ void conv_direct(const DirectArgs a) {
  const linear::detail::FragmentLayout layout(a.bits);
  const int64_t total = a.g.n * a.g.ho * a.g.wo * a.co;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t co = i % a.co, pix = i / a.co;
    const T* const xg = static_cast<const T*>(a.x) + (co / a.g.co_g) * a.g.ci_g;
    store_direct<Y>(a, pix, co,
                    window_sum<int64_t>(a.g, xg, pix, [&](int64_t r) { return dequant_weight<T>(a, layout, co, r); }));
  }
}

// The direct kernel with the weights staged: a CTA owns `chunk` output channels (any groups: each thread finds its
// own) and a block of output pixels; it dequantizes its channels' weights once into shared memory as fp32 [K][chunk]
// (channel fastest: a warp reads one word per channel, no bank conflicts), then each thread sums its channel over
// pixels reading x from global memory: one address for a warp when groups = 1 (a broadcast), consecutive channels for
// depthwise. Used when K · chunk fits 48 KB; the same arithmetic as conv_direct.
constexpr int kDirectThreads = 256;
constexpr int kStagedSmemFloats = 12288;

template <class T, class Y, class I>
__global__ void __launch_bounds__(kDirectThreads)
    conv_direct_staged(const DirectArgs a, int chunk, int pixels_per_cta) {
  extern __shared__ float wsm[];  // [K][chunk]
  const int64_t K = static_cast<int64_t>(a.g.kh) * a.g.kw * a.g.ci_g;
  const int64_t co0 = static_cast<int64_t>(blockIdx.x) * chunk;
  {
    const linear::detail::FragmentLayout layout(a.bits);
    for (int64_t idx = threadIdx.x; idx < K * chunk; idx += kDirectThreads) {
      const int64_t r = idx / chunk, co = co0 + idx % chunk;
      wsm[idx] = co < a.co ? dequant_weight<T>(a, layout, co, r) : 0.f;
    }
  }
  __syncthreads();
  const int c = threadIdx.x % chunk, lanes = kDirectThreads / chunk;  // pixel lanes
  const int64_t co = co0 + c;
  if (threadIdx.x >= lanes * chunk || co >= a.co) return;
  const int64_t P = a.g.n * a.g.ho * a.g.wo;
  const T* const xg = static_cast<const T*>(a.x) + (co / a.g.co_g) * a.g.ci_g;
  const float* const wc = wsm + c;
  for (int64_t p0 = static_cast<int64_t>(blockIdx.y) * pixels_per_cta; p0 < P;
       p0 += static_cast<int64_t>(gridDim.y) * pixels_per_cta)
    for (int64_t pix = p0 + threadIdx.x / chunk; pix < min(P, p0 + pixels_per_cta); pix += lanes)
      store_direct<Y>(a, pix, co, window_sum<I>(a.g, xg, static_cast<I>(pix), [&](I r) { return wc[r * chunk]; }));
}

// The staged kernel's channel chunk: the largest power of two <= 64 (and <= the next power of two of Co) whose
// [K][chunk] fp32 weights fit 48 KB; 0 when even one channel's do not (the plain kernel then runs).
int staged_chunk(int64_t k, int64_t co) {
  int chunk = 64;
  while (chunk > 1 && (chunk / 2 >= co || k * chunk > kStagedSmemFloats)) chunk /= 2;
  return k * chunk <= kStagedSmemFloats ? chunk : 0;
}

template <class T, class Y>
void launch_direct(const DirectArgs& a, const ConvShape& s, cudaStream_t stream) {
  const int chunk = staged_chunk(s.k(), s.co);
  if (chunk == 0) {
    conv_direct<T, Y><<<elementwise_grid(s.pixels() * s.co), kDirectThreads, 0, stream>>>(a);
    TESSERA_CHECK_LAUNCH();
    return;
  }
  // A block of pixels per CTA: 16 per pixel lane (so that the staged weights serve a few thousand outputs).
  const int lanes = kDirectThreads / chunk, pixels_per_cta = 16 * lanes;
  const int64_t pixel_blocks = (s.pixels() + pixels_per_cta - 1) / pixels_per_cta;
  const dim3 grid(static_cast<unsigned>((s.co + chunk - 1) / chunk),
                  static_cast<unsigned>(std::min<int64_t>(pixel_blocks, 65535)));
  const size_t smem = static_cast<size_t>(s.k()) * chunk * sizeof(float);
  // 32-bit indices when every index of the call fits: x's and y's elements, and the window positions.
  constexpr int64_t kI32 = int64_t{1} << 31;
  const bool fits_int32 = s.n * s.h * s.w * s.ci < kI32 && s.pixels() * s.co < kI32 &&
                          s.ho * s.p.stride_h + s.p.dil_h * s.kh < kI32 &&
                          s.wo * s.p.stride_w + s.p.dil_w * s.kw < kI32 && s.k() * chunk < kI32;
  if (fits_int32)
    conv_direct_staged<T, Y, int32_t><<<grid, kDirectThreads, smem, stream>>>(a, chunk, pixels_per_cta);
  else
    conv_direct_staged<T, Y, int64_t><<<grid, kDirectThreads, smem, stream>>>(a, chunk, pixels_per_cta);
  TESSERA_CHECK_LAUNCH();
}

// The conv's geometry as the linear kernel's producer and the direct kernels read it.
linear::detail::ConvGeometry geometry_of(const ConvShape& s) {
  linear::detail::ConvGeometry g;
  g.enabled = true;
  g.n = s.n;
  g.h = s.h;
  g.w = s.w;
  g.c = s.ci;
  g.ho = s.ho;
  g.wo = s.wo;
  g.ci_g = s.ci_g();
  g.co_g = s.co_g();
  g.kh = static_cast<int>(s.kh);
  g.kw = static_cast<int>(s.kw);
  g.stride_h = static_cast<int>(s.p.stride_h);
  g.stride_w = static_cast<int>(s.p.stride_w);
  g.pad_h = static_cast<int>(s.p.pad_h);
  g.pad_w = static_cast<int>(s.p.pad_w);
  g.dil_h = static_cast<int>(s.p.dil_h);
  g.dil_w = static_cast<int>(s.p.dil_w);
  return g;
}

template <class T>
void launch_typed(const ConvProblem& pb, cudaStream_t stream) {
  const ConvShape& s = pb.shape;
  const WorkspaceLayout wl = workspace_layout(s, pb.path);
  auto* ws = static_cast<unsigned char*>(pb.workspace);
  const bool y_f32 = s.x_dtype == DType::kFP32;
  // x as NHWC in the compute dtype.
  const T* x = static_cast<const T*>(pb.x);
  if (needs_x_rewrite(s)) {
    T* xw = reinterpret_cast<T*>(ws);
    if (s.p.x_layout == Layout::kNCHW) {
      if (s.x_dtype == DType::kFP32)
        launch_transpose(static_cast<const float*>(pb.x), xw, s.n, s.ci, s.h * s.w, stream);
      else
        launch_transpose(static_cast<const T*>(pb.x), xw, s.n, s.ci, s.h * s.w, stream);
    } else {
      const int64_t total = s.n * s.h * s.w * s.ci;
      convert<float, T><<<elementwise_grid(total), 256, 0, stream>>>(static_cast<const float*>(pb.x), xw, total);
      TESSERA_CHECK_LAUNCH();
    }
    x = xw;
  }
  // y as NHWC: the caller's tensor, or the staging area before the transpose.
  void* const y_nhwc = s.p.y_layout == Layout::kNCHW ? static_cast<void*>(ws + wl.x_bytes) : pb.y;
  if (pb.path == ConvPath::kDirect) {
    DirectArgs a{};
    a.g = geometry_of(s);
    a.x = x;
    a.codes = pb.codes;
    a.params = pb.params;
    a.co = s.co;
    a.kp = (s.k() + linear::tile_k(s.bits) - 1) / linear::tile_k(s.bits) * linear::tile_k(s.bits);
    a.num_blocks = pb.num_blocks;
    a.block = s.block;
    a.bits = s.bits;
    a.zero_point = pb.zero_point;
    a.y = y_nhwc;
    a.bias = pb.bias;
    a.clamp_min = pb.clamp_min;
    a.clamp_max = pb.clamp_max;
    if (y_f32)
      launch_direct<T, float>(a, s, stream);
    else
      launch_direct<T, T>(a, s, stream);
  } else {
    linear::detail::LinearProblem lp;
    lp.shape = gemm_shape(s, pb.path);
    lp.config = linear::detail::select_config(lp.shape);
    lp.compute = pb.compute;
    lp.x_dtype = s.x_dtype;  // fp32 x: fp32 y
    lp.x = x;
    lp.ldx = s.ci;
    lp.x_prepared = true;
    lp.codes = pb.codes;
    lp.params = pb.params;
    lp.num_blocks = pb.num_blocks;
    lp.block_shift = pb.block_shift;
    lp.zero_point = pb.zero_point;
    lp.y = y_nhwc;
    lp.ldy = s.co;
    lp.bias = pb.bias;
    lp.clamp_min = pb.clamp_min;
    lp.clamp_max = pb.clamp_max;
    lp.workspace = ws + wl.x_bytes + wl.y_bytes;
    if (pb.path == ConvPath::kImplicitGemm) lp.conv = geometry_of(s);
    linear::detail::launch_linear(lp, stream);
  }
  if (s.p.y_layout == Layout::kNCHW) {
    if (y_f32)
      launch_transpose(static_cast<const float*>(y_nhwc), static_cast<float*>(pb.y), s.n, s.ho * s.wo, s.co, stream);
    else
      launch_transpose(static_cast<const T*>(y_nhwc), static_cast<T*>(pb.y), s.n, s.ho * s.wo, s.co, stream);
  }
}

}  // namespace

void launch_conv(const ConvProblem& pb, cudaStream_t stream) {
  if (pb.compute == DType::kFP16)
    launch_typed<__half>(pb, stream);
  else
    launch_typed<__nv_bfloat16>(pb, stream);
}

}  // namespace tessera::conv::detail
