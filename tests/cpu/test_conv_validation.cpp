// conv2d on the CPU: the output-size rule against the reference's, the path rules (pure), and every validation rule
// of the public entry points (the error names the op and the argument, before any launch).
//
// Validation runs before any device query, so host buffers stand in for device memory (device 0). A call that got
// past every rule fails at the device checks: without a GPU on cudaGetDevice, with one on the host pointer; the
// Accepted test checks that the unmutated arguments get exactly that far, so each rule test fails for its rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/validation_util.h"
#include "conv/problem.h"
#include "reference/conv_reference.h"
#include "tessera/conv.h"
#include "tessera/error.h"

namespace tessera::conv {
namespace {

using test::expect_error;
using test::HostBuffer;

TEST(ConvOutputSize, MatchesTheReferenceRule) {
  int checked = 0;
  for (int64_t in = 1; in <= 12; ++in)
    for (int64_t k = 1; k <= 5; ++k)
      for (int64_t stride = 1; stride <= 3; ++stride)
        for (int64_t pad = 0; pad <= 3; ++pad)
          for (int64_t dil = 1; dil <= 3; ++dil) {
            EXPECT_EQ(conv2d_output_size(in, k, stride, pad, dil), reference::conv_output_size(in, k, stride, pad, dil))
                << in << " " << k << " " << stride << " " << pad << " " << dil;
            ++checked;
          }
  EXPECT_GT(checked, 2000);
  EXPECT_EQ(conv2d_output_size(1, 3, 2, 0, 1), 0);  // numerator −2: floor(−1) + 1, not 1
}

detail::ConvShape shape(int64_t n, int64_t hw, int64_t ci, int64_t co, int64_t k, int64_t stride, int64_t pad,
                        int64_t groups = 1) {
  detail::ConvShape s;
  s.n = n;
  s.h = s.w = hw;
  s.ci = ci;
  s.co = co;
  s.kh = s.kw = k;
  s.p.stride_h = s.p.stride_w = stride;
  s.p.pad_h = s.p.pad_w = pad;
  s.p.groups = groups;
  s.ho = conv2d_output_size(hw, k, stride, pad, 1);
  s.wo = s.ho;
  s.bits = 4;
  s.block = s.k() % 128 == 0 ? 128 : s.k();
  return s;
}

TEST(ConvPathRules, TheIssueCasesAndTheFallbacks) {
  using detail::choose_path;
  EXPECT_EQ(choose_path(shape(1, 56, 256, 256, 3, 1, 1)), ConvPath::kImplicitGemm);
  EXPECT_EQ(choose_path(shape(8, 28, 512, 512, 3, 1, 1)), ConvPath::kImplicitGemm);
  EXPECT_EQ(choose_path(shape(32, 112, 64, 128, 3, 2, 1)), ConvPath::kImplicitGemm);
  EXPECT_EQ(choose_path(shape(16, 14, 1024, 1024, 1, 1, 0)), ConvPath::kLinear);
  EXPECT_EQ(choose_path(shape(1, 14, 64, 64, 1, 2, 0)), ConvPath::kImplicitGemm);   // strided 1×1
  EXPECT_EQ(choose_path(shape(1, 14, 64, 64, 1, 1, 1)), ConvPath::kImplicitGemm);   // padded 1×1
  EXPECT_EQ(choose_path(shape(8, 224, 3, 64, 7, 2, 3)), ConvPath::kDirect);         // RGB stem, Ci 3
  EXPECT_EQ(choose_path(shape(8, 28, 384, 384, 3, 1, 1, 384)), ConvPath::kDirect);  // depthwise
  EXPECT_EQ(choose_path(shape(1, 10, 128, 128, 3, 1, 1, 2)), ConvPath::kDirect);    // Co_g 64: tiles straddle groups
  EXPECT_EQ(choose_path(shape(1, 10, 128, 256, 3, 1, 1, 2)), ConvPath::kImplicitGemm);
  EXPECT_EQ(choose_path(shape(1, 20, 96, 128, 3, 1, 1)), ConvPath::kDirect);  // Ci_g 96: not whole 64-channel k-blocks
  EXPECT_EQ(choose_path(shape(1, 3, 64, 128, 3, 1, 0)), ConvPath::kDirect);   // one output row: empty im2col box
  EXPECT_EQ(choose_path(shape(1, 20, 64, 128, 3, 9, 1)), ConvPath::kDirect);  // stride 9 > the TMA's 8
  EXPECT_EQ(choose_path(shape(1, 300, 64, 128, 3, 1, 128)), ConvPath::kDirect);  // padding 128 > 127
  detail::ConvShape dil = shape(1, 300, 64, 128, 3, 1, 1);
  dil.p.dil_h = 128;  // dil·(k − 1) = 256 > 255
  dil.ho = conv2d_output_size(300, 3, 1, 1, 128);
  EXPECT_EQ(choose_path(dil), ConvPath::kDirect);
  // The implicit GEMM runs on the wgmma tiles only (≥ 64 pixels), the workspace holds its split partials.
  const detail::ConvShape small = shape(1, 4, 512, 128, 3, 1, 1);
  const linear::detail::LinearShape g = detail::gemm_shape(small, ConvPath::kImplicitGemm);
  EXPECT_GE(linear::detail::select_config(g).bn, 64);
  EXPECT_EQ(detail::workspace_layout(small, ConvPath::kImplicitGemm).partial_bytes % 256, 0u);
}

TEST(ConvWorkspace, RegionsFollowTheLayouts) {
  detail::ConvShape s = shape(2, 10, 64, 128, 3, 1, 1);
  EXPECT_EQ(detail::workspace_layout(s, ConvPath::kImplicitGemm).x_bytes, 0u);
  s.p.x_layout = Layout::kNCHW;
  EXPECT_EQ(detail::workspace_layout(s, ConvPath::kImplicitGemm).x_bytes, (2u * 10 * 10 * 64 * 2 + 255) / 256 * 256);
  s.p.y_layout = Layout::kNCHW;
  EXPECT_EQ(detail::workspace_layout(s, ConvPath::kDirect).y_bytes, (2u * 10 * 10 * 128 * 2 + 255) / 256 * 256);
  s.x_dtype = DType::kFP32;
  EXPECT_EQ(detail::workspace_layout(s, ConvPath::kDirect).y_bytes, (2u * 10 * 10 * 128 * 4 + 255) / 256 * 256);
}

// ---- validation ------------------------------------------------------------------------------------------------

constexpr const char* kOp = "tessera::conv::conv2d";
// x [2, 9, 9, 64] bf16 NHWC, a 3×3 int4 weight (Co 128, K 576, blocks of 64), y [2, 9, 9, 128].
constexpr int64_t kN = 2, kH = 9, kW = 9, kCi = 64, kCo = 128, kK = 576, kBlocks = kK / 64;

struct Buffers {
  HostBuffer x{64 * 1024, 1}, y{256 * 1024, 0xAB}, codes{128 * 1024, 0}, params{64 * 1024, 0}, bias{4096, 0},
      ws{1 << 20, 0};
};

struct Args {
  TensorView x, y;
  ConvWeight weight;
  Conv2dParams params;
  linear::LinearEpilogue epilogue;
  Workspace workspace;
};

Args make_args(Buffers& b) {
  Args a;
  a.x = TensorView::contiguous(b.x.data(), DType::kBF16, {kN, kH, kW, kCi}, 0);
  a.y = TensorView::contiguous(b.y.data(), DType::kBF16, {kN, kH, kW, kCo}, 0);
  a.weight.w.codes = TensorView::contiguous(b.codes.data(), DType::kUInt8, {kCo, kK / 2}, 0);
  a.weight.w.params = TensorView::contiguous(b.params.data(), DType::kBF16, {kCo, kBlocks, 2}, 0);
  a.weight.w.n = kCo;
  a.weight.w.k = kK;
  a.weight.w.bits = 4;
  a.weight.w.block = 64;
  a.weight.w.zero_mode = linear::ZeroMode::kZeroPoint;
  a.weight.kh = a.weight.kw = 3;
  a.params.pad_h = a.params.pad_w = 1;
  a.epilogue.bias = TensorView::contiguous(b.bias.data(), DType::kBF16, {kCo}, 0);
  a.workspace = Workspace{b.ws.data(), 1 << 20};
  return a;
}

void call(const Args& a) { conv2d(a.x, a.weight, a.y, a.params, a.epilogue, a.workspace, nullptr); }

TEST(ConvValidation, AcceptedArgumentsReachTheDeviceChecks) {
  Buffers b;
  const Args a = make_args(b);
  try {
    call(a);
    ADD_FAILURE() << "host buffers were accepted as device memory";
  } catch (const Error& e) {
    EXPECT_TRUE(test::is_device_check_error(e.what())) << e.what();
  }
  EXPECT_TRUE(b.y.untouched());
}

struct Rule {
  const char* name;
  const char* arg;
  std::function<void(Args&)> mutate;
};

TEST(ConvValidation, EveryRuleNamesItsArgument) {
  const Rule rules[] = {
      {"x rank 3", "x", [](Args& a) { a.x.rank = 3; }},
      {"x int8", "x", [](Args& a) { a.x.dtype = DType::kInt8; }},
      {"x fp16 against a bf16 weight", "x", [](Args& a) { a.x.dtype = DType::kFP16; }},
      {"x channels", "x", [](Args& a) { a.x.shape[3] = 32; }},
      {"x not contiguous", "x", [](Args& a) { a.x.strides[0] += 64; }},
      {"x misaligned", "x", [](Args& a) { a.x.data = static_cast<char*>(a.x.data) + 2; }},
      {"output empty", "x", [](Args& a) { a.params.pad_h = a.params.pad_w = 0, a.x.shape[1] = 2; }},
      {"stride 0", "params.stride_w", [](Args& a) { a.params.stride_w = 0; }},
      {"dilation 2^62 (would wrap the extent)", "params.dil_h", [](Args& a) { a.params.dil_h = int64_t{1} << 62; }},
      {"padding 2^31", "params.pad_w", [](Args& a) { a.params.pad_w = int64_t{1} << 31; }},
      {"kernel 2^32 x 2^32 (would wrap Kh·Kw)", "weight.kh",
       [](Args& a) { a.weight.kh = a.weight.kw = int64_t{1} << 32; }},
      {"negative padding", "params.pad_h", [](Args& a) { a.params.pad_h = -1; }},
      {"dilation 0", "params.dil_h", [](Args& a) { a.params.dil_h = 0; }},
      {"groups 0", "params.groups", [](Args& a) { a.params.groups = 0; }},
      {"groups not dividing Co", "params.groups", [](Args& a) { a.params.groups = 3; }},
      {"bad layout", "params.x_layout", [](Args& a) { a.params.x_layout = static_cast<Layout>(7); }},
      {"kernel 0", "weight.kh", [](Args& a) { a.weight.kh = 0; }},
      {"K not Kh·Kw·Ci_g", "w.k", [](Args& a) { a.weight.kh = 5; }},
      {"k_perm", "w.k_perm",
       [](Args& a) { a.weight.w.k_perm = TensorView::contiguous(a.weight.w.codes.data, DType::kInt32, {kK}, 0); }},
      {"bits 3", "w.bits", [](Args& a) { a.weight.w.bits = 3; }},
      {"block 96", "w.block", [](Args& a) { a.weight.w.block = 96; }},
      {"codes shape", "w.codes", [](Args& a) { a.weight.w.codes.shape[1] = 100; }},
      {"params shape", "w.params", [](Args& a) { a.weight.w.params.shape[1] = 3; }},
      {"y dtype", "y", [](Args& a) { a.y.dtype = DType::kFP16; }},
      {"y Ho", "y", [](Args& a) { a.y.shape[1] = 8; }},
      {"y Co", "y", [](Args& a) { a.y.shape[3] = 64; }},
      {"y NCHW shape read as NHWC", "y", [](Args& a) { a.params.y_layout = Layout::kNCHW; }},
      {"y overlaps x", "x", [](Args& a) { a.y.data = a.x.data; }},
      {"bias length", "epilogue.bias", [](Args& a) { a.epilogue.bias.shape[0] = 64; }},
      {"bias dtype", "epilogue.bias", [](Args& a) { a.epilogue.bias.dtype = DType::kFP32; }},
      {"clamp NaN", "epilogue.clamp_min", [](Args& a) { a.epilogue.clamp_max = NAN; }},
      {"clamp reversed", "epilogue.clamp_min", [](Args& a) { a.epilogue.clamp_min = 2, a.epilogue.clamp_max = 1; }},
  };
  for (const Rule& r : rules) {
    SCOPED_TRACE(r.name);
    Buffers b;
    Args a = make_args(b);
    r.mutate(a);
    expect_error([&] { call(a); }, kOp, r.arg);
    EXPECT_TRUE(b.y.untouched());
  }
}

// K past 2^30 is refused by the weight rules linear and conv share (before the conv's own K = Kh·Kw·Ci_g rule, which
// names the same argument: the message tells them apart).
TEST(ConvValidation, WeightKPastTwoToThe30IsRefused) {
  Buffers b;
  Args a = make_args(b);
  a.weight.w.k = (int64_t{1} << 30) + 64;
  expect_error([&] { call(a); }, kOp, "w.k", {"2^30"});
  EXPECT_TRUE(b.y.untouched());
}

TEST(ConvValidation, QueriesCheckTheSameRules) {
  Buffers b;
  Args a = make_args(b);
  a.params.groups = 3;
  expect_error([&] { conv2d_workspace_bytes(kN, kH, kW, a.weight, a.params, DType::kBF16); },
               "tessera::conv::conv2d_workspace_bytes", "params.groups");
  expect_error([&] { conv2d_path(kN, kH, kW, a.weight, a.params, DType::kBF16); }, "tessera::conv::conv2d_path",
               "params.groups");
}

}  // namespace
}  // namespace tessera::conv
