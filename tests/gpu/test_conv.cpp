// conv2d on the GPU (tessera/conv.h) against the float64 reference (src/reference/conv_reference.h) over the weight as
// the kernels see it, unpack(prepack(w)) (parameters rounded to the compute dtype), on every path: the linear layer
// (1×1), the implicit GEMM (TMA im2col copies into the linear layer's tensor-core kernel) and the direct kernel.
//
// Every case: a float weight [Co, Kh, Kw, Ci_g] with rows of different scales, one output channel 4x larger and one
// input channel 20x larger at every tap, quantized by quantize_weight, prepacked and uploaded; x normal with every
// 37th channel 4x larger, stored in its dtype and layout; y poisoned (0xFF bytes: NaN) before the call, the workspace
// poisoned too (any contents). The geometries cover odd planes, stride / padding / dilation per axis with h ≠ w
// values (the im2col map's corner and offset order), output tiles that end mid-row and mid-image, pixel counts that
// are no multiple of any tile, Co tails, groups, depthwise, zero points and offsets, bias and clamps, NCHW in and out,
// fp32 x, split K, and the path each geometry must take.
//
// Tolerances, as tests/gpu/test_linear.cpp argues them: the tensor-core paths round each weight once to the compute
// dtype (unit roundoff u_c), fp32 x once to it, accumulate in fp32 and round y once; the direct path uses the exact
// dequantized weight. Checks:
//   ||y − ref||_F / ||conv + bias||_F <= 5e-3 (bf16 compute) or 2e-3 (fp16), the norm taken before the clamp;
//   every element |y − ref| <= 1.5 (u_c Σ|x|(|w| + scale) + K 2^-22 Σ|x||w|) + 1.01 u_y |ref|, the worst case of
//   those roundings, from the im2col matrix of the reference itself (a wrong tap or tile cannot hide in a norm).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/conv_reference.h"
#include "reference/linear_reference.h"
#include "reference/parallel.h"
#include "tessera/conv.h"
#include "tessera/error.h"

namespace tessera::conv {
namespace {

using linear::QuantizedWeight;
using linear::ZeroMode;
using test::DeviceBuffer;

struct Case {
  int64_t n = 1, h = 8, w = 8, ci = 64, co = 128, kh = 3, kw = 3;
  int64_t stride_h = 1, stride_w = 1, pad_h = 1, pad_w = 1, dil_h = 1, dil_w = 1, groups = 1;
  int bits = 4;
  int64_t block = 64;  // 0: one block per output channel
  ZeroMode mode = ZeroMode::kZeroPoint;
  DType x_dtype = DType::kBF16, compute = DType::kBF16;
  Layout x_layout = Layout::kNHWC, y_layout = Layout::kNHWC;
  bool bias = false;
  float clamp_min = -INFINITY, clamp_max = INFINITY;
  ConvPath path = ConvPath::kImplicitGemm;  // the path the rules must pick

  int64_t ci_g() const { return ci / groups; }
  int64_t k() const { return kh * kw * ci_g(); }
  int64_t ho() const { return conv2d_output_size(h, kh, stride_h, pad_h, dil_h); }
  int64_t wo() const { return conv2d_output_size(w, kw, stride_w, pad_w, dil_w); }
  Conv2dParams params() const {
    Conv2dParams p;
    p.stride_h = stride_h;
    p.stride_w = stride_w;
    p.pad_h = pad_h;
    p.pad_w = pad_w;
    p.dil_h = dil_h;
    p.dil_w = dil_w;
    p.groups = groups;
    p.x_layout = x_layout;
    p.y_layout = y_layout;
    return p;
  }
  reference::Conv2dParams ref_params() const {
    reference::Conv2dParams p;
    p.n = n;
    p.h = h;
    p.w = w;
    p.ci = ci;
    p.co = co;
    p.kh = kh;
    p.kw = kw;
    p.stride_h = stride_h;
    p.stride_w = stride_w;
    p.pad_h = pad_h;
    p.pad_w = pad_w;
    p.dil_h = dil_h;
    p.dil_w = dil_w;
    p.groups = groups;
    return p;
  }
};

std::string describe(const Case& c) {
  std::string s = "N" + std::to_string(c.n) + " " + std::to_string(c.h) + "x" + std::to_string(c.w) + " Ci" +
                  std::to_string(c.ci) + " Co" + std::to_string(c.co) + " k" + std::to_string(c.kh) + "x" +
                  std::to_string(c.kw) + " s" + std::to_string(c.stride_h) + "," + std::to_string(c.stride_w) + " p" +
                  std::to_string(c.pad_h) + "," + std::to_string(c.pad_w) + " d" + std::to_string(c.dil_h) + "," +
                  std::to_string(c.dil_w) + " g" + std::to_string(c.groups) + " int" + std::to_string(c.bits) +
                  " block=" + (c.block ? std::to_string(c.block) : "channel") +
                  (c.mode == ZeroMode::kZeroPoint ? " zp" : " offset") + " x=" + dtype_name(c.x_dtype) +
                  " compute=" + dtype_name(c.compute) + (c.x_layout == Layout::kNCHW ? " x-nchw" : "") +
                  (c.y_layout == Layout::kNCHW ? " y-nchw" : "") + (c.bias ? " bias" : "");
  if (std::isfinite(c.clamp_min) || std::isfinite(c.clamp_max))
    s += " clamp[" + std::to_string(c.clamp_min) + "," + std::to_string(c.clamp_max) + "]";
  return s + " path=" + conv_path_name(c.path);
}

double unit_roundoff(DType d) { return d == DType::kBF16 ? 0x1p-8 : d == DType::kFP16 ? 0x1p-11 : 0x1p-24; }
double tolerance(DType compute) { return compute == DType::kBF16 ? 5e-3 : 2e-3; }

// v stored as dtype at raw; returns the value stored.
double store(DType dtype, float v, uint8_t* raw) {
  if (dtype == DType::kFP32) {
    std::memcpy(raw, &v, 4);
    return v;
  }
  const uint16_t b = dtype == DType::kBF16 ? host::f32_to_bf16(v) : host::f32_to_fp16(v);
  std::memcpy(raw, &b, 2);
  return dtype == DType::kBF16 ? host::bf16_to_f32(b) : host::fp16_to_f32(b);
}
double load(DType dtype, const uint8_t* raw) {
  if (dtype == DType::kFP32) {
    float v;
    std::memcpy(&v, raw, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, raw, 2);
  return dtype == DType::kBF16 ? host::bf16_to_f32(b) : host::fp16_to_f32(b);
}
double round_to(double v, DType dtype) {
  uint8_t raw[4];
  return dtype == DType::kFP32 ? static_cast<float>(v) : store(dtype, static_cast<float>(v), raw);
}

struct Host {
  Case c;
  linear::PackedWeight packed;
  QuantizedWeight ref_w;
  std::vector<uint8_t> x_raw;  // in c.x_layout
  std::vector<float> x_nhwc;   // the stored values, NHWC, rounded to the compute dtype (as every path does)
  std::vector<uint8_t> bias_raw;
  std::vector<double> bias;
};

Host make_host(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Host h;
  h.c = c;
  const int64_t K = c.k(), block = c.block ? c.block : K;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> wf(static_cast<size_t>(c.co * K));
  const int64_t outlier_ci = static_cast<int64_t>(rng() % c.ci_g()), outlier_co = static_cast<int64_t>(rng() % c.co);
  for (int64_t o = 0; o < c.co; ++o) {
    const float row = std::exp(2.0f * unit(rng) - 1.0f) / std::sqrt(static_cast<float>(K)) * (o == outlier_co ? 4 : 1);
    for (int64_t r = 0; r < K; ++r) wf[o * K + r] = normal(rng) * row * (r % c.ci_g() == outlier_ci ? 20.0f : 1.0f);
  }
  const QuantizedWeight q = linear::quantize_weight(wf.data(), c.co, K, c.bits, block, c.mode);
  h.packed = linear::prepack(q, c.compute);
  h.ref_w = linear::unpack(h.packed);

  const size_t es = dtype_size(c.x_dtype);
  const int64_t numel = c.n * c.h * c.w * c.ci;
  h.x_raw.resize(static_cast<size_t>(numel) * es);
  h.x_nhwc.resize(static_cast<size_t>(numel));
  for (int64_t b = 0; b < c.n; ++b)
    for (int64_t y = 0; y < c.h; ++y)
      for (int64_t x = 0; x < c.w; ++x)
        for (int64_t ch = 0; ch < c.ci; ++ch) {
          const float v = normal(rng) * (ch % 37 == 5 ? 4.0f : 1.0f);
          const int64_t nhwc = ((b * c.h + y) * c.w + x) * c.ci + ch;
          const int64_t at = c.x_layout == Layout::kNHWC ? nhwc : ((b * c.ci + ch) * c.h + y) * c.w + x;
          const double stored = store(c.x_dtype, v, &h.x_raw[static_cast<size_t>(at) * es]);
          h.x_nhwc[nhwc] = static_cast<float>(round_to(stored, c.compute));
        }
  if (c.bias) {
    h.bias_raw.resize(static_cast<size_t>(c.co) * es);
    for (int64_t o = 0; o < c.co; ++o) h.bias.push_back(store(c.x_dtype, 0.7f * normal(rng), &h.bias_raw[o * es]));
  }
  return h;
}

struct Expected {
  std::vector<double> ref, bound;  // NHWC [P, Co]
  double product_norm = 0;
};

Expected expected_of(const Host& h) {
  const Case& c = h.c;
  const reference::Conv2dParams rp = c.ref_params();
  Expected e;
  const std::vector<double> acc = reference::conv2d_reference(h.x_nhwc, rp, h.ref_w, h.bias);
  // Σ|x||w| and Σ|x|·scale per output element, from the im2col matrix.
  const std::vector<double> cols = reference::im2col_nhwc(h.x_nhwc, rp);
  const std::vector<double> wd = reference::dequantize_weight(h.ref_w);
  const int64_t P = rp.pixels(), Co = c.co, K = c.k(), G = c.groups, co_g = Co / G;
  const int64_t blocks = K / h.ref_w.block;
  std::vector<double> mag(static_cast<size_t>(P * Co)), scl(mag.size());
  const int threads = reference::detail::num_workers(0, static_cast<double>(P * Co * K), P);
  reference::detail::parallel(threads, [&](int t) {
    for (int64_t p = t; p < P; p += threads)
      for (int64_t o = 0; o < Co; ++o) {
        const double* xr = &cols[(p * G + o / co_g) * K];
        double s = 0, sc = 0;
        for (int64_t r = 0; r < K; ++r) {
          const double xa = std::fabs(xr[r]);
          s += xa * std::fabs(wd[o * K + r]);
          sc += xa * std::fabs(static_cast<double>(h.ref_w.scale[o * blocks + r / h.ref_w.block]));
        }
        mag[p * Co + o] = s;
        scl[p * Co + o] = sc;
      }
  });
  const bool direct = c.path == ConvPath::kDirect;
  const double u_c = direct ? 0x1p-22 : unit_roundoff(c.compute), u_y = unit_roundoff(c.x_dtype);
  const double u_acc = static_cast<double>(K) * 0x1p-22;
  e.ref.resize(acc.size());
  e.bound.resize(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) {
    double v = acc[i];
    e.product_norm += v * v;
    v = std::min<double>(std::max<double>(v, c.clamp_min), c.clamp_max);
    e.ref[i] = v;
    const double b = c.bias ? std::fabs(h.bias[i % Co]) : 0.0;
    e.bound[i] = 1.5 * (u_c * (mag[i] + scl[i]) + u_acc * mag[i] + 0x1p-22 * b) + 1.01 * u_y * std::fabs(v);
  }
  e.product_norm = std::sqrt(e.product_norm);
  return e;
}

struct Device {
  DeviceBuffer<uint8_t> codes, x, y, bias, ws;
  DeviceBuffer<uint16_t> params;
  ConvWeight weight;
  TensorView xv, yv;
  linear::LinearEpilogue epilogue;
  Workspace workspace;
  Conv2dParams params_;

  explicit Device(const Host& h)
      : codes(h.packed.codes),
        x(h.x_raw),
        y(static_cast<size_t>(h.c.n * h.c.ho() * h.c.wo() * h.c.co) * dtype_size(h.c.x_dtype)),
        bias(h.bias_raw),
        params(h.packed.params) {
    const Case& c = h.c;
    const linear::PackedWeight& p = h.packed;
    const int dev = test::current_device();
    weight.w.codes = TensorView::contiguous(codes.get(), DType::kUInt8, {p.padded_n(), p.padded_k() * p.bits / 8}, dev);
    weight.w.params = TensorView::contiguous(params.get(), p.compute_dtype, {p.padded_n(), p.num_blocks(), 2}, dev);
    weight.w.n = p.n;
    weight.w.k = p.k;
    weight.w.bits = p.bits;
    weight.w.block = p.block;
    weight.w.zero_mode = p.zero_mode;
    weight.kh = c.kh;
    weight.kw = c.kw;
    xv = c.x_layout == Layout::kNHWC ? TensorView::contiguous(x.get(), c.x_dtype, {c.n, c.h, c.w, c.ci}, dev)
                                     : TensorView::contiguous(x.get(), c.x_dtype, {c.n, c.ci, c.h, c.w}, dev);
    yv = c.y_layout == Layout::kNHWC ? TensorView::contiguous(y.get(), c.x_dtype, {c.n, c.ho(), c.wo(), c.co}, dev)
                                     : TensorView::contiguous(y.get(), c.x_dtype, {c.n, c.co, c.ho(), c.wo()}, dev);
    if (c.bias) epilogue.bias = TensorView::contiguous(bias.get(), c.x_dtype, {c.co}, dev);
    epilogue.clamp_min = c.clamp_min;
    epilogue.clamp_max = c.clamp_max;
    params_ = c.params();
    const size_t bytes = conv2d_workspace_bytes(c.n, c.h, c.w, weight, params_, c.x_dtype);
    if (bytes > 0) {
      ws = DeviceBuffer<uint8_t>(bytes);
      ws.poison();
      workspace = Workspace{ws.get(), bytes};
    }
  }
  void launch(cudaStream_t stream) const { conv2d(xv, weight, yv, params_, epilogue, workspace, stream); }
  std::vector<uint8_t> run(cudaStream_t stream) {
    y.poison();
    launch(stream);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    return y.download();
  }
};

void expect_matches(const Host& h, const Expected& e, const std::vector<uint8_t>& y) {
  const Case& c = h.c;
  const int64_t Ho = c.ho(), Wo = c.wo(), Co = c.co, P = c.n * Ho * Wo;
  const size_t es = dtype_size(c.x_dtype);
  double err2 = 0;
  int64_t bad = 0, nonfinite = 0;
  for (int64_t p = 0; p < P; ++p)
    for (int64_t o = 0; o < Co; ++o) {
      const int64_t b = p / (Ho * Wo), rem = p % (Ho * Wo);
      const int64_t at = c.y_layout == Layout::kNHWC ? p * Co + o : (b * Co + o) * Ho * Wo + rem;
      const double v = load(c.x_dtype, &y[static_cast<size_t>(at) * es]);
      const double r = e.ref[p * Co + o];
      if (!std::isfinite(v)) {
        if (nonfinite++ < 5) ADD_FAILURE() << "y at pixel " << p << " channel " << o << " is " << v;
        continue;
      }
      err2 += (v - r) * (v - r);
      if (std::fabs(v - r) > e.bound[p * Co + o] && bad++ < 5)
        ADD_FAILURE() << "pixel " << p << " (image " << b << ", row " << rem / Wo << ", col " << rem % Wo
                      << ") channel " << o << ": " << v << ", expected " << r << " ± " << e.bound[p * Co + o];
    }
  EXPECT_EQ(nonfinite, 0);
  EXPECT_EQ(bad, 0) << "elements beyond their bound";
  const double rel = std::sqrt(err2) / std::max(e.product_norm, 1e-30);
  EXPECT_LE(rel, tolerance(c.compute)) << "relative Frobenius error";
}

class ConvGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    TESSERA_REQUIRE_GPU();
    TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  void check(const Case& c) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    ASSERT_EQ(conv2d_path(c.n, c.h, c.w, d.weight, d.params_, c.x_dtype), c.path) << "path";
    const Expected e = expected_of(h);
    expect_matches(h, e, d.run(stream_));
  }
  cudaStream_t stream_ = nullptr;
};

Case base(int64_t n, int64_t h, int64_t w, int64_t ci, int64_t co, int64_t k) {
  Case c;
  c.n = n;
  c.h = h;
  c.w = w;
  c.ci = ci;
  c.co = co;
  c.kh = c.kw = k;
  c.pad_h = c.pad_w = k / 2;
  return c;
}

TEST_F(ConvGpu, ImplicitGemmGeometries) {
  std::vector<Case> cases;
  {  // odd plane, 3×3 same padding, two images: tiles cross rows and images
    Case c = base(2, 9, 11, 64, 128, 3);
    cases.push_back(c);
  }
  {  // asymmetric everything: kh ≠ kw, pad, stride and dilation differ per axis; Co tail; int8 offset, fp16, bias, relu
    Case c = base(1, 13, 10, 128, 200, 3);
    c.kw = 5;
    c.pad_h = 1;
    c.pad_w = 2;
    c.stride_h = 2;
    c.stride_w = 1;
    c.dil_h = 1;
    c.dil_w = 2;
    c.bits = 8;
    c.block = 128;
    c.mode = ZeroMode::kOffset;
    c.x_dtype = c.compute = DType::kFP16;
    c.bias = true;
    c.clamp_min = 0.0f;
    cases.push_back(c);
  }
  {  // two groups (Ci_g 64, Co_g 128), stride 2, per-channel int4, NCHW in and out
    Case c = base(2, 15, 15, 128, 256, 3);
    c.groups = 2;
    c.stride_h = c.stride_w = 2;
    c.block = 0;
    c.x_layout = c.y_layout = Layout::kNCHW;
    cases.push_back(c);
  }
  {  // fp32 x (fp32 y), strided 1×1 (the implicit GEMM, not the linear path), int8 zero points, blocks of 32
    Case c = base(2, 9, 7, 64, 64, 1);
    c.stride_h = c.stride_w = 2;
    c.bits = 8;
    c.block = 32;
    c.x_dtype = DType::kFP32;
    cases.push_back(c);
  }
  {  // many tiles: P 3136 (several 64..256-pixel tiles per image), clamp range, bias
    Case c = base(4, 28, 28, 128, 256, 3);
    c.bias = true;
    c.clamp_min = -0.75f;
    c.clamp_max = 1.5f;
    cases.push_back(c);
  }
  {  // stride 2 over an even plane with K 576 (9 k-blocks: past-K copies in the last stage of 2-k-block tiles)
    Case c = base(2, 30, 30, 64, 128, 3);
    c.stride_h = c.stride_w = 2;
    cases.push_back(c);
  }
  {  // dilation 2 with padding 2, int8
    Case c = base(1, 16, 16, 64, 128, 3);
    c.dil_h = c.dil_w = 2;
    c.pad_h = c.pad_w = 2;
    c.bits = 8;
    cases.push_back(c);
  }
  {  // P 969 (no multiple of any tile), fp16 offset
    Case c = base(3, 17, 19, 64, 128, 3);
    c.mode = ZeroMode::kOffset;
    c.x_dtype = c.compute = DType::kFP16;
    cases.push_back(c);
  }
  {  // valid conv (no padding), 1×1 with padding 1 (border pixels are the bias alone)
    Case c = base(2, 8, 8, 64, 128, 3);
    c.pad_h = c.pad_w = 0;
    cases.push_back(c);
    Case d = base(2, 6, 5, 64, 128, 1);
    d.pad_h = d.pad_w = 1;
    d.bias = true;
    cases.push_back(d);
  }
  {  // small P, long K (4608): split K with fp32 partials
    Case c = base(1, 4, 4, 512, 128, 3);
    cases.push_back(c);
  }
  {  // 5×5 with padding 2 and stride 3, Ci 192 (three 64-channel chunks per tap; K 4800: blocks of 64)
    Case c = base(1, 23, 20, 192, 128, 5);
    c.stride_h = c.stride_w = 3;
    cases.push_back(c);
  }
  for (const Case& c : cases) check(c);
}

TEST_F(ConvGpu, LinearPath) {
  Case c = base(2, 7, 9, 64, 96, 1);
  c.path = ConvPath::kLinear;
  check(c);
  Case d = c;  // NCHW in and out, fp16, int8, per channel
  d.x_layout = d.y_layout = Layout::kNCHW;
  d.x_dtype = d.compute = DType::kFP16;
  d.bits = 8;
  d.block = 0;
  d.bias = true;
  check(d);
  Case f = c;  // fp32 x
  f.x_dtype = DType::kFP32;
  check(f);
}

TEST_F(ConvGpu, DirectPath) {
  std::vector<Case> cases;
  {  // depthwise 3×3, K 9, per channel, int8
    Case c = base(2, 9, 9, 32, 32, 3);
    c.groups = 32;
    c.bits = 8;
    c.block = 0;
    c.path = ConvPath::kDirect;
    cases.push_back(c);
  }
  {  // RGB stem: Ci 3, 7×7 stride 2 pad 3, K 147, int4 per channel, fp16, NCHW in and out, bias, relu6
    Case c = base(2, 23, 21, 3, 16, 7);
    c.stride_h = c.stride_w = 2;
    c.block = 0;
    c.x_dtype = c.compute = DType::kFP16;
    c.x_layout = c.y_layout = Layout::kNCHW;
    c.bias = true;
    c.clamp_min = 0.0f;
    c.clamp_max = 6.0f;
    c.path = ConvPath::kDirect;
    cases.push_back(c);
  }
  {  // 4 groups of 8 channels, dilation 2, offsets, per channel (K 72)
    Case c = base(1, 12, 10, 32, 32, 3);
    c.groups = 4;
    c.dil_h = c.dil_w = 2;
    c.pad_h = c.pad_w = 2;
    c.mode = ZeroMode::kOffset;
    c.block = 0;
    c.path = ConvPath::kDirect;
    cases.push_back(c);
  }
  {  // Ci 64 but a 1-row output (the im2col bounding box would be empty): direct
    Case c = base(1, 3, 9, 64, 128, 3);
    c.pad_h = c.pad_w = 0;
    c.path = ConvPath::kDirect;
    cases.push_back(c);
  }
  {  // fp32 x, Ci 16 (K 144, blocks of 48 are not allowed: per channel), int8 zero points, stride 2
    Case c = base(2, 11, 13, 16, 24, 3);
    c.stride_h = c.stride_w = 2;
    c.bits = 8;
    c.block = 0;
    c.x_dtype = DType::kFP32;
    c.path = ConvPath::kDirect;
    cases.push_back(c);
  }
  {  // K 12600 (Ci 1400, 3×3): the staged weights would not fit shared memory, the plain direct kernel runs
    Case c = base(1, 5, 4, 1400, 8, 3);
    c.block = 0;
    c.bias = true;
    c.path = ConvPath::kDirect;
    cases.push_back(c);
  }
  {  // groups 2 with Co_g 64 (< 128: a tile would straddle groups), Ci_g 64, block 64
    Case c = base(1, 10, 10, 128, 128, 3);
    c.groups = 2;
    c.path = ConvPath::kDirect;
    cases.push_back(c);
  }
  for (const Case& c : cases) check(c);
}

// Randomized geometries over the rules: each draw's path is whatever the rules pick for it (asked, not assumed).
TEST_F(ConvGpu, RandomGeometries) {
  std::mt19937_64 rng(test::fresh_seed());
  for (int i = 0; i < 12; ++i) {
    Case c;
    c.n = 1 + static_cast<int64_t>(rng() % 3);
    c.h = 2 + static_cast<int64_t>(rng() % 18);
    c.w = 2 + static_cast<int64_t>(rng() % 18);
    c.kh = 1 + static_cast<int64_t>(rng() % 4);
    c.kw = 1 + static_cast<int64_t>(rng() % 4);
    c.stride_h = 1 + static_cast<int64_t>(rng() % 3);
    c.stride_w = 1 + static_cast<int64_t>(rng() % 3);
    c.dil_h = 1 + static_cast<int64_t>(rng() % 2);
    c.dil_w = 1 + static_cast<int64_t>(rng() % 2);
    c.pad_h = static_cast<int64_t>(rng() % (c.kh + 1));
    c.pad_w = static_cast<int64_t>(rng() % (c.kw + 1));
    const int64_t ext_h = c.dil_h * (c.kh - 1) + 1, ext_w = c.dil_w * (c.kw - 1) + 1;
    c.h = std::max(c.h, ext_h - 2 * c.pad_h);
    c.w = std::max(c.w, ext_w - 2 * c.pad_w);
    c.ci = (rng() % 2) ? 64 : 128;
    c.co = 64 + static_cast<int64_t>(rng() % 4) * 48;
    c.bits = (rng() % 2) ? 4 : 8;
    c.block = 0;
    for (int64_t b : {128, 64, 32})
      if (c.k() % b == 0 && rng() % 2) {
        c.block = b;
        break;
      }
    c.mode = (rng() % 2) ? ZeroMode::kZeroPoint : ZeroMode::kOffset;
    if (rng() % 3 == 0) c.x_dtype = c.compute = DType::kFP16;
    if (rng() % 4 == 0) c.x_layout = Layout::kNCHW;
    if (rng() % 4 == 0) c.y_layout = Layout::kNCHW;
    c.bias = rng() % 2;
    const Host probe = make_host(c, 1);
    Device d(probe);
    c.path = conv2d_path(c.n, c.h, c.w, d.weight, d.params_, c.x_dtype);
    check(c);
  }
}

TEST_F(ConvGpu, CudaGraphAndDeterminism) {
  for (ConvPath path : {ConvPath::kImplicitGemm, ConvPath::kDirect}) {
    Case c = base(2, 14, 14, 64, 128, 3);
    c.bias = true;
    if (path == ConvPath::kDirect) c.groups = 64, c.co = 64, c.block = 0;
    c.path = path;
    c.y_layout = Layout::kNCHW;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    const std::vector<uint8_t> eager = d.run(stream_);
    expect_matches(h, expected_of(h), eager);
    EXPECT_EQ(d.run(stream_), eager) << "a second eager run differs";
    d.y.poison();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    d.launch(stream_);
    TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    TESSERA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 2; ++r) {
      d.y.poison();
      TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      EXPECT_EQ(d.y.download(), eager) << "graph replay " << r;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// Rules that need the device (the workspace is sized from the SM count) and the errors a user meets first.
TEST_F(ConvGpu, WorkspaceAndArguments) {
  Case c = base(1, 8, 8, 64, 128, 3);
  c.x_layout = Layout::kNCHW;
  const Host h = make_host(c, test::fresh_seed());
  Device d(h);
  ASSERT_GT(d.workspace.bytes, 0u);
  Workspace small{d.workspace.data, d.workspace.bytes - 1};
  try {
    conv2d(d.xv, d.weight, d.yv, d.params_, d.epilogue, small, stream_);
    ADD_FAILURE() << "a short workspace was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
  }
  // The workspace is written: it may not overlap y (or any other argument).
  DeviceBuffer<uint8_t> shared(d.y.size() + d.workspace.bytes);
  const TensorView y_in_ws = TensorView::contiguous(shared.get(), d.yv.dtype, {c.n, c.ho(), c.wo(), c.co}, d.yv.device);
  try {
    conv2d(d.xv, d.weight, y_in_ws, d.params_, d.epilogue, Workspace{shared.get(), d.workspace.bytes}, stream_);
    ADD_FAILURE() << "a workspace overlapping y was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
  }
  // A workspace in host memory is named before any launch (it is written by every path).
  {
    std::vector<uint8_t> host_memory(d.workspace.bytes + 256);
    void* host_ptr = host_memory.data() + (256 - reinterpret_cast<std::uintptr_t>(host_memory.data()) % 256) % 256;
    try {
      conv2d(d.xv, d.weight, d.yv, d.params_, d.epilogue, Workspace{host_ptr, d.workspace.bytes}, stream_);
      ADD_FAILURE() << "a workspace in host memory was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'workspace' must be in device memory"), std::string::npos) << e.what();
    }
  }
  Conv2dParams p = d.params_;
  p.groups = 3;
  try {
    conv2d(d.xv, d.weight, d.yv, p, d.epilogue, d.workspace, stream_);
    ADD_FAILURE() << "groups 3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("groups"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera::conv
