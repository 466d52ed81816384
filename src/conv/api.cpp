// Public entry points of conv2d: validate every argument, choose the path, size the workspace, launch.
#include <cstdint>
#include <string>

#include "common/device_info.h"
#include "common/validate.h"
#include "conv/problem.h"
#include "linear/config.h"
#include "tessera/conv.h"

namespace tessera::conv {
namespace detail {

namespace {
std::size_t align256(std::size_t b) { return (b + 255) / 256 * 256; }
}  // namespace

bool needs_x_rewrite(const ConvShape& s) { return s.p.x_layout == Layout::kNCHW || s.x_dtype == DType::kFP32; }

bool implicit_gemm_fits(const ConvShape& s) {
  const Conv2dParams& p = s.p;
  if (s.ci_g() % 64 != 0) return false;
  if (p.groups != 1 && s.co_g() % linear::detail::kGemmRows != 0) return false;
  if (s.ho < 2 || s.wo < 2) return false;
  if (p.stride_h > 8 || p.stride_w > 8 || p.pad_h > 127 || p.pad_w > 127) return false;
  const int64_t ext_h = p.dil_h * (s.kh - 1), ext_w = p.dil_w * (s.kw - 1);
  if (ext_h > 255 || ext_w > 255 || ext_h - p.pad_h > 128 || ext_w - p.pad_w > 128) return false;
  if (s.pixels() >= (int64_t{1} << 24) || s.n * s.h * s.w * s.ci * 2 >= (int64_t{1} << 40)) return false;
  return linear::detail::select_config(gemm_shape(s, ConvPath::kImplicitGemm)).m_tiles <= 65535;
}

ConvPath choose_path(const ConvShape& s) {
  const Conv2dParams& p = s.p;
  if (s.kh == 1 && s.kw == 1 && p.stride_h == 1 && p.stride_w == 1 && p.pad_h == 0 && p.pad_w == 0 && p.groups == 1 &&
      s.ci % 8 == 0 && s.n * s.h * s.w < (int64_t{1} << 31) &&
      linear::detail::select_config(gemm_shape(s, ConvPath::kLinear)).m_tiles <= 65535)
    return ConvPath::kLinear;
  return implicit_gemm_fits(s) ? ConvPath::kImplicitGemm : ConvPath::kDirect;
}

linear::detail::LinearShape gemm_shape(const ConvShape& s, ConvPath path) {
  linear::detail::LinearShape g;
  g.m = path == ConvPath::kLinear ? s.n * s.h * s.w : s.pixels();
  g.n = s.co;
  g.k = s.k();
  g.bits = s.bits;
  g.block = s.block;
  g.num_sms = s.num_sms;
  if (path == ConvPath::kImplicitGemm) {
    g.min_bn = 64;
    g.wave_tiles = true;
  }
  return g;
}

WorkspaceLayout workspace_layout(const ConvShape& s, ConvPath path) {
  WorkspaceLayout l;
  if (needs_x_rewrite(s)) l.x_bytes = align256(static_cast<std::size_t>(s.n * s.h * s.w * s.ci) * 2);
  if (s.p.y_layout == Layout::kNCHW)
    l.y_bytes = align256(static_cast<std::size_t>(s.pixels() * s.co) * (s.x_dtype == DType::kFP32 ? 4 : 2));
  if (path != ConvPath::kDirect) {
    const linear::detail::LinearShape g = gemm_shape(s, path);
    l.partial_bytes = align256(linear::detail::partial_bytes(g, linear::detail::select_config(g)));
  }
  return l;
}

}  // namespace detail

namespace {

using ::tessera::detail::ArgCheck;

// Everything but the tensors x and y: the weight, the geometry, the parameters. Returns the shape (path not chosen).
detail::ConvShape check_shape(const ArgCheck& check, int64_t n, int64_t h, int64_t w, const ConvWeight& weight,
                              const Conv2dParams& p, DType x_dtype, DType* compute) {
  *compute = linear::detail::check_weight(check, weight.w, false, false);
  if (weight.w.k_perm.data != nullptr)
    check.fail("w.k_perm", "must be null: a conv weight has no act-order permutation");
  // Every size and geometry value in [lo, 2^20] (2^30 for the input sizes below): the products formed from them
  // (taps, extents, pixel counts, workspace bytes) stay far inside int64, and the kernels' 32-bit fields hold them.
  constexpr int64_t kMaxParam = kConvMaxParam;
  check.in_range(weight.kh, "weight.kh", 1, kMaxParam);
  check.in_range(weight.kw, "weight.kw", 1, kMaxParam);
  check.in_range(p.stride_h, "params.stride_h", 1, kMaxParam);
  check.in_range(p.stride_w, "params.stride_w", 1, kMaxParam);
  check.in_range(p.pad_h, "params.pad_h", 0, kMaxParam);
  check.in_range(p.pad_w, "params.pad_w", 0, kMaxParam);
  check.in_range(p.dil_h, "params.dil_h", 1, kMaxParam);
  check.in_range(p.dil_w, "params.dil_w", 1, kMaxParam);
  check.in_range(p.groups, "params.groups", 1, kMaxParam);
  if (p.x_layout != Layout::kNHWC && p.x_layout != Layout::kNCHW)
    check.fail("params.x_layout", "must be kNHWC or kNCHW");
  if (p.y_layout != Layout::kNHWC && p.y_layout != Layout::kNCHW)
    check.fail("params.y_layout", "must be kNHWC or kNCHW");
  if (x_dtype != DType::kFP32 && x_dtype != *compute)
    check.fail("x", std::string("must be ") + dtype_name(*compute) + " (the weight's compute dtype) or fp32, got " +
                        dtype_name(x_dtype));
  if (n < 0 || h <= 0 || w <= 0)
    check.fail("x", "needs N >= 0 and H, W >= 1, got N " + std::to_string(n) + ", H " + std::to_string(h) + ", W " +
                        std::to_string(w));
  if (h > (int64_t{1} << 30) || w > (int64_t{1} << 30) || n > (int64_t{1} << 30))
    check.fail("x", "sizes must stay below 2^30");
  const int64_t taps = weight.kh * weight.kw;
  if (weight.w.k % taps != 0)
    check.fail("w.k", "must be Kh·Kw·Ci/groups, got " + std::to_string(weight.w.k) + " for a " +
                          std::to_string(weight.kh) + " x " + std::to_string(weight.kw) + " kernel");
  detail::ConvShape s;
  s.n = n;
  s.h = h;
  s.w = w;
  s.ci = weight.w.k / taps * p.groups;
  s.co = weight.w.n;
  s.kh = weight.kh;
  s.kw = weight.kw;
  s.p = p;
  s.bits = weight.w.bits;
  s.block = weight.w.block;
  s.x_dtype = x_dtype;
  if (s.co % p.groups != 0)
    check.fail("params.groups", std::to_string(p.groups) + " does not divide Co = " + std::to_string(s.co));
  s.ho = conv2d_output_size(h, weight.kh, p.stride_h, p.pad_h, p.dil_h);
  s.wo = conv2d_output_size(w, weight.kw, p.stride_w, p.pad_w, p.dil_w);
  if (s.ho < 1 || s.wo < 1)
    check.fail("x", "the output would be " + std::to_string(s.ho) + " x " + std::to_string(s.wo) + " for input " +
                        std::to_string(h) + " x " + std::to_string(w) + " (kernel, padding, dilation, stride)");
  if (s.ci > (int64_t{1} << 30)) check.fail("x", "needs fewer than 2^30 channels");
  // Element counts of x and y (the workspace's parts) below 2^56: no size computation can wrap.
  if (static_cast<double>(s.n) * s.h * s.w * s.ci >= 0x1p56 || static_cast<double>(s.pixels()) * s.co >= 0x1p56)
    check.fail("x", "is too large: x or y would hold 2^56 elements or more");
  return s;
}

// The device's SM count, after every argument rule (the path and the workspace depend on it).
detail::ConvShape with_device(detail::ConvShape s) {
  s.num_sms = ::tessera::detail::current_device_info().num_sms;
  return s;
}

// x's 4-D shape in its layout as (n, h, w, c).
void nhwc_of(const TensorView& t, Layout layout, int64_t* n, int64_t* h, int64_t* w, int64_t* c) {
  *n = t.shape[0];
  if (layout == Layout::kNHWC) {
    *h = t.shape[1];
    *w = t.shape[2];
    *c = t.shape[3];
  } else {
    *c = t.shape[1];
    *h = t.shape[2];
    *w = t.shape[3];
  }
}

}  // namespace

const char* conv_path_name(ConvPath path) {
  switch (path) {
    case ConvPath::kLinear:
      return "linear";
    case ConvPath::kImplicitGemm:
      return "implicit_gemm";
    case ConvPath::kDirect:
      return "direct";
  }
  return "unknown";
}

int64_t conv2d_output_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil) {
  if (stride <= 0) return 0;
  const int64_t num = in + 2 * pad - dil * (k - 1) - 1;
  const int64_t q = num >= 0 ? num / stride : -((-num + stride - 1) / stride);
  return q + 1;
}

ConvPath conv2d_path(int64_t n, int64_t h, int64_t w, const ConvWeight& weight, const Conv2dParams& params,
                     DType x_dtype) {
  const ArgCheck check("tessera::conv::conv2d_path");
  DType compute;
  return detail::choose_path(with_device(check_shape(check, n, h, w, weight, params, x_dtype, &compute)));
}

std::size_t conv2d_workspace_bytes(int64_t n, int64_t h, int64_t w, const ConvWeight& weight,
                                   const Conv2dParams& params, DType x_dtype) {
  const ArgCheck check("tessera::conv::conv2d_workspace_bytes");
  DType compute;
  const detail::ConvShape s = with_device(check_shape(check, n, h, w, weight, params, x_dtype, &compute));
  if (n == 0) return 0;
  return detail::workspace_layout(s, detail::choose_path(s)).total();
}

void conv2d(const TensorView& x, const ConvWeight& weight, const TensorView& y, const Conv2dParams& params,
            const linear::LinearEpilogue& epilogue, const Workspace& workspace, cudaStream_t stream) {
  const ArgCheck check("tessera::conv::conv2d");
  check.dtype(x, "x", {DType::kBF16, DType::kFP16, DType::kFP32});
  check.rank(x, "x", 4);
  int64_t n, h, w, c;
  nhwc_of(x, params.x_layout, &n, &h, &w, &c);
  DType compute;
  detail::ConvShape s = check_shape(check, n, h, w, weight, params, x.dtype, &compute);
  if (c != s.ci)
    check.fail("x", "has " + std::to_string(c) + " channels; the weight (K = " + std::to_string(weight.w.k) + " = " +
                        std::to_string(weight.kh) + "·" + std::to_string(weight.kw) + "·Ci/groups, groups " +
                        std::to_string(params.groups) + ") needs Ci = " + std::to_string(s.ci));
  check.contiguous(x, "x");
  check.aligned(x, "x", static_cast<int>(dtype_size(x.dtype)));
  check.dtype(y, "y", {x.dtype});
  check.rank(y, "y", 4);
  const bool y_nhwc = params.y_layout == Layout::kNHWC;
  check.dim(y, "y", 0, s.n, "N");
  check.dim(y, "y", y_nhwc ? 1 : 2, s.ho, "Ho");
  check.dim(y, "y", y_nhwc ? 2 : 3, s.wo, "Wo");
  check.dim(y, "y", y_nhwc ? 3 : 1, s.co, "Co");
  check.contiguous(y, "y");
  check.aligned(y, "y", static_cast<int>(dtype_size(y.dtype)));
  check.no_overlap(y, "y", x, "x");
  check.no_overlap(y, "y", weight.w.codes, "w.codes");
  check.no_overlap(y, "y", weight.w.params, "w.params");
  linear::detail::check_epilogue(check, epilogue, y.dtype, s.co, false);
  if (epilogue.bias.data != nullptr) check.no_overlap(y, "y", epilogue.bias, "epilogue.bias");
  // The tensor-core paths read NHWC 16-bit x by TMA straight from the caller's tensor (x's rows are whole 16-byte
  // vectors by the path rules): its base must be 16-byte aligned. Decided before the path (which needs the device)
  // by the strictest path's rule: only calls that could take one of them are held to it.
  const bool direct_only = s.ci % 8 != 0;
  if (!detail::needs_x_rewrite(s) && !direct_only && reinterpret_cast<std::uintptr_t>(x.data) % 16 != 0)
    check.fail("x", "must start at a 16-byte aligned address (it is read by TMA)");
  // Device checks last.
  linear::detail::check_weight_on_device(check, weight.w);
  check.on_current_device(x, "x");
  check.on_current_device(y, "y");
  if (epilogue.bias.data != nullptr) check.on_current_device(epilogue.bias, "epilogue.bias");
  s = with_device(s);
  const ConvPath path = detail::choose_path(s);
  if (s.n == 0) return;
  const std::size_t need = detail::workspace_layout(s, path).total();
  if (need > 0) {
    check.workspace(workspace, need, " (conv2d_workspace_bytes)");
    // The workspace is written (x rewritten, y staged, partials): it may overlap no argument.
    const TensorView ws = ::tessera::detail::workspace_view(workspace, need, x.device);
    check.no_overlap(ws, "workspace", x, "x");
    check.no_overlap(ws, "workspace", y, "y");
    check.no_overlap(ws, "workspace", weight.w.codes, "w.codes");
    check.no_overlap(ws, "workspace", weight.w.params, "w.params");
    if (epilogue.bias.data != nullptr) check.no_overlap(ws, "workspace", epilogue.bias, "epilogue.bias");
    // Device memory of this GPU (the workspace is written by every path): a raw pointer is asked of the driver, an
    // adapter's label trusted.
    check.on_current_device(ws, "workspace");
  }
  ::tessera::detail::require_hopper(check.op());
  detail::ConvProblem pb;
  pb.shape = s;
  pb.path = path;
  pb.compute = compute;
  pb.x = x.data;
  pb.codes = static_cast<const uint8_t*>(weight.w.codes.data);
  pb.params = static_cast<const uint16_t*>(weight.w.params.data);
  pb.num_blocks = weight.w.params.shape[1];
  pb.block_shift = linear::detail::block_shift_of(weight.w);
  pb.zero_point = weight.w.zero_mode == linear::ZeroMode::kZeroPoint;
  pb.y = y.data;
  pb.bias = epilogue.bias.data;
  pb.clamp_min = epilogue.clamp_min;
  pb.clamp_max = epilogue.clamp_max;
  pb.workspace = workspace.data;
  detail::launch_conv(pb, stream);
}

}  // namespace tessera::conv
