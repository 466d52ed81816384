// tessera — conv2d with int4 / int8 weights (public).
//
//   y[n, oh, ow, co] = clamp( Σ_{kh, kw, ci} x[n, oh·stride_h − pad_h + kh·dil_h, ow·stride_w − pad_w + kw·dil_w,
//                                               g·Ci_g + ci] · w[co, kh, kw, ci] + bias[co], clamp_min, clamp_max )
//
// with g = co / Co_g (groups: Ci_g = Ci / groups input and Co_g = Co / groups output channels per group) and the
// positions outside the input reading 0 (zero padding). The weight [Co, Kh, Kw, Ci_g] is a weight-only linear weight
// (tessera/linear.h) with N = Co rows over the reduction index r = (kh·Kw + kw)·Ci_g + ci, K = Kh·Kw·Ci_g: the same
// codes, per-block parameters (blocks of 32 / 64 / 128 along r, or one per output channel), conventions (kOffset
// w = q·scale + offset, kZeroPoint w = (q − zero)·scale) and prepack. A PyTorch weight [Co, Ci_g, Kh, Kw] becomes it
// by permuting to [Co, Kh, Kw, Ci_g] and flattening to [Co, K] before quantize_weight / prepack (python: tessera.conv).
// No act-order permutation (w.k_perm must be null).
//
// x: [N, H, W, Ci] (Layout::kNHWC, channels last) or [N, Ci, H, W] (kNCHW), bf16 / fp16 (the weight's compute dtype)
//    or fp32, contiguous in its layout. NCHW and fp32 inputs are first rewritten as NHWC in the compute dtype in the
//    workspace (one pass over x; fp32 rounded once to the compute dtype, as tessera::linear does).
// y: [N, Ho, Wo, Co] or [N, Co, Ho, Wo], x's dtype (fp32 x → fp32 y), contiguous; NCHW y is written NHWC into the
//    workspace and transposed (one more pass). Ho = floor((H + 2·pad_h − dil_h·(Kh − 1) − 1) / stride_h) + 1, W alike.
//
// Three paths; the op picks one (conv2d_path says which) and the result is the same computation:
//   kLinear       1×1, stride 1, no padding, groups 1, Ci % 8 == 0 (N·H·W < 2^31, ≤ 65535 row tiles):
//                 tessera::linear on x as [N·H·W, Ci] rows.
//   kImplicitGemm the linear layer's tensor-core kernel with x fetched by TMA im2col copies (the im2col matrix is
//                 never formed): Ci_g % 64 == 0, groups 1 or Co_g % 128 == 0, Ho ≥ 2 and Wo ≥ 2 (the copies' bounding
//                 box must not be empty), pad ≤ 127, stride ≤ 8, dil·(k − 1) ≤ 255 and dil·(k − 1) − pad ≤ 128 per
//                 axis, N·Ho·Wo < 2^24 in ≤ 65535 pixel tiles.
//   kDirect       everything else (depthwise, small groups, Ci not a multiple of 64, the first RGB layer): a CTA per
//                 (up to 64 output channels, block of output pixels) with those channels' dequantized weights staged
//                 in shared memory as fp32 (K > 12288: decoded per use instead), fp32 sums over exact weights; correct
//                 on every geometry, not tuned.
// Sizes: kernel, stride, padding, dilation and groups at most 2^20; N, H, W, Ci below 2^30. The tensor-core paths
// read NHWC 16-bit x straight from the caller's tensor by TMA: its base must then be 16-byte aligned (checked).
// The tile limits depend on the device's SM count (the tile choice does), so conv2d_path and conv2d_workspace_bytes
// read the current device.
// The tensor-core paths round each weight once to the compute dtype and accumulate in fp32 (docs/ops/linear.md).
//
// Runs asynchronously on the stream, never synchronizes the host, never allocates (workspace sized by
// conv2d_workspace_bytes), graph-capturable, deterministic. Arguments are validated before anything is launched; a
// violation throws tessera::Error naming the argument. See docs/ops/conv.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tessera/linear.h"
#include "tessera/tensor.h"

namespace tessera::conv {

enum class Layout : int { kNHWC = 0, kNCHW = 1 };

// Kernel size, stride, padding, dilation and groups are each at most this (conv2d's argument rule).
inline constexpr int64_t kConvMaxParam = int64_t{1} << 20;

struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;  // symmetric zero padding
  int64_t dil_h = 1, dil_w = 1;
  int64_t groups = 1;
  Layout x_layout = Layout::kNHWC, y_layout = Layout::kNHWC;
};

// The prepacked weight (linear::prepack of the [Co, Kh·Kw·Ci_g] codes) and the kernel's spatial size.
struct ConvWeight {
  linear::LinearWeight w;  // w.n = Co, w.k = Kh·Kw·Ci_g (any K > 0), w.k_perm null
  int64_t kh = 1, kw = 1;
};

enum class ConvPath : int { kLinear = 0, kImplicitGemm = 1, kDirect = 2 };
const char* conv_path_name(ConvPath path);

// floor((in + 2·pad − dil·(k − 1) − 1) / stride) + 1 (PyTorch's rule; a floor for negative numerators too); 0 for
// stride < 1 (which conv2d rejects).
int64_t conv2d_output_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil);

// The path a call with input [n, h, w, Ci] of x_dtype takes. Validates the weight (its arrays' shapes, dtypes and
// alignment) and the geometry as conv2d does; x and y themselves are not seen. N = 0 is allowed (conv2d then launches
// nothing).
ConvPath conv2d_path(int64_t n, int64_t h, int64_t w, const ConvWeight& weight, const Conv2dParams& params,
                     DType x_dtype);

// Device workspace (16-byte aligned, any contents) of a call with input [n, h, w, Ci] of x_dtype; 0 when none.
std::size_t conv2d_workspace_bytes(int64_t n, int64_t h, int64_t w, const ConvWeight& weight,
                                   const Conv2dParams& params, DType x_dtype);

// y = epilogue(conv2d(x, w)). Bias [Co] of y's dtype; clamp as tessera::linear (relu [0, inf), relu6 [0, 6]).
void conv2d(const TensorView& x, const ConvWeight& weight, const TensorView& y, const Conv2dParams& params,
            const linear::LinearEpilogue& epilogue, const Workspace& workspace, cudaStream_t stream);

}  // namespace tessera::conv
