// W8A8 on the CPU: every validation rule of the public W8A8 entry points (the error names the op and the argument,
// and nothing is written), and the host weight quantizer against the reference.
//
// Validation runs before any device query, so host buffers stand in for device memory (device 0). A call that got
// past every rule fails at the device checks: without a GPU on cudaGetDevice, with one on the host pointer. The
// Accepted* tests check that unmutated arguments get exactly that far, so each rule test fails for its rule. The one
// rule that needs the device (gemm_w8a8's workspace, sized by the SM count) is tested on a GPU only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/device_info.h"
#include "common/gpu_util.h"
#include "common/validation_util.h"
#include "linear/w8a8/config.h"
#include "reference/w8a8_reference.h"
#include "tessera/error.h"
#include "tessera/w8a8.h"

namespace tessera::linear {
namespace {

using test::expect_error;
using test::HostBuffer;

// A [rows, cols] view of host memory standing in for device 0's, with row stride ld.
TensorView view2(void* data, DType dtype, int64_t rows, int64_t cols, int64_t ld) {
  TensorView t = TensorView::contiguous(data, dtype, {rows, cols}, 0);
  t.strides[0] = ld;
  return t;
}

// ==== quantize_per_block and prepack_w8a8 ============================================================================
namespace quantize_validation {

constexpr const char* kQuantize = "tessera::linear::quantize_per_block";
constexpr const char* kPrepack = "tessera::linear::prepack_w8a8";

// x [5, 256] bf16 into codes with padded rows (272) and parameter planes [4, ld 8] (block 64, asymmetric, sums).
constexpr int64_t kM = 5, kK = 256, kBlock = 64, kBlocks = kK / kBlock, kLdc = 272, kLd = 8;

struct Buffers {
  // Large enough for every view below, including the wider stand-ins of the rule tests.
  HostBuffer x{64 * 1024, 1}, codes{16 * 1024, 0xAB}, scale{4096, 0xAB}, zero{4096, 0xAB}, sums{4096, 0xAB};
  bool outputs_untouched() const {
    return codes.untouched() && scale.untouched() && zero.untouched() && sums.untouched();
  }
};

struct Args {
  TensorView x;
  Int8BlockTensor out;
};

Args make_args(Buffers& b) {
  Args a;
  a.x = view2(b.x.data(), DType::kBF16, kM, kK, kK);
  a.out.block = kBlock;
  a.out.codes = view2(b.codes.data(), DType::kInt8, kM, kK, kLdc);
  a.out.scale = view2(b.scale.data(), DType::kFP32, kBlocks, kM, kLd);
  a.out.zero = view2(b.zero.data(), DType::kFP32, kBlocks, kM, kLd);
  a.out.sums = view2(b.sums.data(), DType::kFP32, kBlocks, kM, kLd);
  return a;
}

// Sets K (and the shapes that follow it) consistently, block unchanged.
void set_k(Args& a, int64_t k) {
  a.x.shape[1] = k;
  a.x.strides[0] = k;
  a.out.codes.shape[1] = k;
  a.out.codes.strides[0] = (k + 15) / 16 * 16;
  const int64_t blocks = a.out.block > 0 && k % a.out.block == 0 ? k / a.out.block : 1;
  for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->shape[0] = blocks;
}

struct RuleCase {
  const char* what;
  const char* arg;
  std::function<void(Args&, Buffers&)> mutate;
};

const std::vector<RuleCase>& quantize_rules() {
  static const std::vector<RuleCase> cases = {
      // x
      {"x int8", "x", [](Args& a, Buffers&) { a.x.dtype = DType::kInt8; }},
      {"x fp8", "x", [](Args& a, Buffers&) { a.x.dtype = DType::kFP8E4M3; }},
      {"x rank 3", "x",
       [](Args& a, Buffers& b) {
         a.x = TensorView::contiguous(b.x.data(), DType::kBF16, {1, kM, kK}, 0);
       }},
      {"x rank 1", "x", [](Args& a, Buffers& b) { a.x = TensorView::contiguous(b.x.data(), DType::kBF16, {kK}, 0); }},
      {"x column stride 2", "x", [](Args& a, Buffers&) { a.x.strides[1] = 2, a.x.strides[0] = 2 * kK; }},
      {"x at an odd address", "x", [](Args& a, Buffers& b) { a.x.data = b.x.data() + 1; }},
      {"x K 200 (not a multiple of 16)", "x", [](Args& a, Buffers&) { set_k(a, 200); }},
      {"x K 8", "x", [](Args& a, Buffers&) { set_k(a, 8); }},
      {"x K 0", "x", [](Args& a, Buffers&) { set_k(a, 0); }},
      {"x M -1", "x", [](Args& a, Buffers&) { a.x.shape[0] = -1; }},
      {"x negative row stride", "x", [](Args& a, Buffers&) { a.x.strides[0] = -kK; }},
      // block
      {"block 0", "out.block", [](Args& a, Buffers&) { a.out.block = 0; }},
      {"block 16", "out.block", [](Args& a, Buffers&) { a.out.block = 16; }},
      {"block 48", "out.block", [](Args& a, Buffers&) { a.out.block = 48; }},
      {"block 256 of K 512 (neither 32, 64, 128 nor K)", "out.block",
       [](Args& a, Buffers&) {
         set_k(a, 512);
         a.out.block = 256;
       }},
      {"block -64", "out.block", [](Args& a, Buffers&) { a.out.block = -64; }},
      {"block 64 does not divide K 208", "out.block", [](Args& a, Buffers&) { set_k(a, 208); }},
      {"block 128 does not divide K 192", "out.block",
       [](Args& a, Buffers&) {
         set_k(a, 192);
         a.out.block = 128;
       }},
      // codes
      {"codes uint8", "out.codes", [](Args& a, Buffers&) { a.out.codes.dtype = DType::kUInt8; }},
      {"codes fp8", "out.codes", [](Args& a, Buffers&) { a.out.codes.dtype = DType::kFP8E4M3; }},
      {"codes rank 1", "out.codes",
       [](Args& a, Buffers& b) { a.out.codes = TensorView::contiguous(b.codes.data(), DType::kInt8, {kM * kK}, 0); }},
      {"codes M - 1 rows", "out.codes", [](Args& a, Buffers&) { a.out.codes.shape[0] = kM - 1; }},
      {"codes M + 1 rows", "out.codes", [](Args& a, Buffers&) { a.out.codes.shape[0] = kM + 1; }},
      {"codes K + 16 columns", "out.codes", [](Args& a, Buffers&) { a.out.codes.shape[1] = kK + 16; }},
      {"codes column stride 2", "out.codes", [](Args& a, Buffers&) { a.out.codes.strides[1] = 2; }},
      {"codes row stride < K (rows overlap)", "out.codes", [](Args& a, Buffers&) { a.out.codes.strides[0] = 128; }},
      {"codes row stride 0", "out.codes", [](Args& a, Buffers&) { a.out.codes.strides[0] = 0; }},
      {"codes row stride K + 8 (not a multiple of 16)", "out.codes",
       [](Args& a, Buffers&) { a.out.codes.strides[0] = kK + 8; }},
      {"codes 8-byte aligned only", "out.codes", [](Args& a, Buffers& b) { a.out.codes.data = b.codes.data() + 8; }},
      {"codes 1-byte aligned only", "out.codes", [](Args& a, Buffers& b) { a.out.codes.data = b.codes.data() + 1; }},
      // scale
      {"scale int32", "out.scale", [](Args& a, Buffers&) { a.out.scale.dtype = DType::kInt32; }},
      {"scale bf16", "out.scale", [](Args& a, Buffers&) { a.out.scale.dtype = DType::kBF16; }},
      {"scale rank 1", "out.scale",
       [](Args& a, Buffers& b) {
         a.out.scale = TensorView::contiguous(b.scale.data(), DType::kFP32, {kBlocks * kLd}, 0);
       }},
      {"scale row-major [M, K / block] (not block-major)", "out.scale",
       [](Args& a, Buffers& b) { a.out.scale = view2(b.scale.data(), DType::kFP32, kM, kBlocks, kBlocks); }},
      {"scale K / block - 1 planes", "out.scale", [](Args& a, Buffers&) { a.out.scale.shape[0] = kBlocks - 1; }},
      {"scale M + 1 rows", "out.scale", [](Args& a, Buffers&) { a.out.scale.shape[1] = kM + 1; }},
      {"scale ld 4 < M", "out.scale",
       [](Args& a, Buffers&) {
         for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->strides[0] = 4;
       }},
      {"scale ld 6 (not a multiple of 4)", "out.scale",
       [](Args& a, Buffers&) {
         for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->strides[0] = 6;
       }},
      {"scale column stride 2", "out.scale", [](Args& a, Buffers&) { a.out.scale.strides[1] = 2; }},
      {"scale 4-byte aligned only", "out.scale", [](Args& a, Buffers& b) { a.out.scale.data = b.scale.data() + 4; }},
      {"scale null", "out.scale", [](Args& a, Buffers&) { a.out.scale.data = nullptr; }},
      // zero
      {"zero int32", "out.zero", [](Args& a, Buffers&) { a.out.zero.dtype = DType::kInt32; }},
      {"zero int8", "out.zero", [](Args& a, Buffers&) { a.out.zero.dtype = DType::kInt8; }},
      {"zero M - 1 rows", "out.zero", [](Args& a, Buffers&) { a.out.zero.shape[1] = kM - 1; }},
      {"zero one plane", "out.zero", [](Args& a, Buffers&) { a.out.zero.shape[0] = 1; }},
      {"zero ld 12 (scale's is 8)", "out.zero", [](Args& a, Buffers&) { a.out.zero.strides[0] = 12; }},
      {"zero 8-byte aligned only", "out.zero", [](Args& a, Buffers& b) { a.out.zero.data = b.zero.data() + 8; }},
      // sums
      {"sums int32", "out.sums", [](Args& a, Buffers&) { a.out.sums.dtype = DType::kInt32; }},
      {"sums rank 3", "out.sums",
       [](Args& a, Buffers& b) {
         a.out.sums = TensorView::contiguous(b.sums.data(), DType::kFP32, {kBlocks, kM, 1}, 0);
       }},
      {"sums M + 1 rows", "out.sums", [](Args& a, Buffers&) { a.out.sums.shape[1] = kM + 1; }},
      {"sums ld 16 (scale's is 8)", "out.sums", [](Args& a, Buffers&) { a.out.sums.strides[0] = 16; }},
      {"sums with block = K > 131072 (fp32 sums inexact)", "out.sums",
       [](Args& a, Buffers&) {
         set_k(a, 131072 + 16);
         a.out.block = 131072 + 16;
         set_k(a, 131072 + 16);
       }},
      // overlaps: no output may share memory with x or another output
      {"codes inside x", "out.codes", [](Args& a, Buffers& b) { a.out.codes.data = b.x.data() + 1024; }},
      {"x inside codes' row padding", "out.codes", [](Args& a, Buffers& b) { a.x.data = b.codes.data() + 256; }},
      {"scale inside x", "out.scale", [](Args& a, Buffers& b) { a.out.scale.data = b.x.data() + 512; }},
      {"scale inside codes", "out.scale", [](Args& a, Buffers& b) { a.out.scale.data = b.codes.data() + 512; }},
      {"zero inside x", "out.zero", [](Args& a, Buffers& b) { a.out.zero.data = b.x.data(); }},
      {"zero on scale", "out.zero", [](Args& a, Buffers& b) { a.out.zero.data = b.scale.data(); }},
      {"zero overlapping scale's second plane", "out.zero",
       [](Args& a, Buffers& b) { a.out.zero.data = b.scale.data() + 16; }},
      {"sums inside codes", "out.sums", [](Args& a, Buffers& b) { a.out.sums.data = b.codes.data() + 64; }},
      {"sums on zero", "out.sums", [](Args& a, Buffers& b) { a.out.sums.data = b.zero.data(); }},
      {"sums on scale, symmetric", "out.sums",
       [](Args& a, Buffers& b) {
         a.out.zero = TensorView{};
         a.out.sums.data = b.scale.data();
       }},
      // memory: host pointers (device = host) and null data are named before the driver is asked anything
      {"x in host memory", "x", [](Args& a, Buffers&) { a.x.device = TensorView::kHostDevice; }},
      {"x null", "x", [](Args& a, Buffers&) { a.x.data = nullptr; }},
      {"codes in host memory", "out.codes", [](Args& a, Buffers&) { a.out.codes.device = TensorView::kHostDevice; }},
      {"codes null", "out.codes", [](Args& a, Buffers&) { a.out.codes.data = nullptr; }},
      {"scale in host memory", "out.scale", [](Args& a, Buffers&) { a.out.scale.device = TensorView::kHostDevice; }},
      {"zero in host memory", "out.zero", [](Args& a, Buffers&) { a.out.zero.device = TensorView::kHostDevice; }},
      {"sums in host memory", "out.sums", [](Args& a, Buffers&) { a.out.sums.device = TensorView::kHostDevice; }},
  };
  return cases;
}

TEST(W8A8Validation, QuantizeEachRuleNamesItsArgument) {
  for (const RuleCase& c : quantize_rules())
    for (DType x_dtype : {DType::kBF16, DType::kFP32}) {
      SCOPED_TRACE(std::string(c.what) + " / x " + dtype_name(x_dtype));
      Buffers b;
      Args a = make_args(b);
      a.x.dtype = x_dtype;
      c.mutate(a, b);
      if (a.x.dtype == DType::kBF16 && x_dtype == DType::kFP32) a.x.dtype = x_dtype;
      expect_error([&] { quantize_per_block(a.x, a.out, nullptr); }, kQuantize, c.arg);
      EXPECT_TRUE(b.outputs_untouched()) << "an output was written";
    }
}

// The unmutated arguments, and variants the rules must accept, get as far as the device checks.
void expect_reaches_device_checks(const Args& a, const Buffers& b) {
  try {
    quantize_per_block(a.x, a.out, nullptr);
    ADD_FAILURE() << "host buffers accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(test::is_device_check_error(e.what())) << "stopped before the device checks: " << e.what();
  }
  EXPECT_TRUE(b.outputs_untouched());
}

TEST(W8A8Validation, QuantizeAcceptedArgumentsReachTheDeviceChecks) {
  struct Variant {
    const char* what;
    std::function<void(Args&, Buffers&)> mutate;
  };
  const std::vector<Variant> variants = {
      {"as made", [](Args&, Buffers&) {}},
      {"fp16 x", [](Args& a, Buffers&) { a.x.dtype = DType::kFP16; }},
      {"fp32 x", [](Args& a, Buffers&) { a.x.dtype = DType::kFP32; }},
      {"symmetric (no zero)", [](Args& a, Buffers&) { a.out.zero = TensorView{}; }},
      {"no sums", [](Args& a, Buffers&) { a.out.sums = TensorView{}; }},
      {"symmetric, no sums", [](Args& a, Buffers&) { a.out.zero = a.out.sums = TensorView{}; }},
      {"block 32",
       [](Args& a, Buffers&) {
         a.out.block = 32;
         for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->shape[0] = kK / 32;
       }},
      {"block 128",
       [](Args& a, Buffers&) {
         a.out.block = 128;
         for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->shape[0] = kK / 128;
       }},
      {"block = K (per token)",
       [](Args& a, Buffers&) {
         a.out.block = kK;
         for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->shape[0] = 1;
       }},
      {"K 48, block = K",
       [](Args& a, Buffers&) {
         a.out.block = 48;
         set_k(a, 48);
       }},
      {"x rows padded to an odd stride (no 16-byte rows)", [](Args& a, Buffers&) { a.x.strides[0] = kK + 3; }},
      {"x 2-byte aligned", [](Args& a, Buffers& b) { a.x.data = b.x.data() + 2; }},
      {"x broadcast row (stride 0)", [](Args& a, Buffers&) { a.x.strides[0] = 0; }},
      {"codes rows dense", [](Args& a, Buffers&) { a.out.codes.strides[0] = kK; }},
      {"one row, any codes stride",
       [](Args& a, Buffers&) {
         a.x.shape[0] = a.out.codes.shape[0] = 1;
         a.out.codes.strides[0] = 7;
         for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->shape[1] = 1;
       }},
      {"ld 12 (> M, a multiple of 4)",
       [](Args& a, Buffers&) {
         for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->strides[0] = 12;
       }},
      {"sums with block = K = 131072",
       [](Args& a, Buffers&) {
         a.x.shape[0] = a.out.codes.shape[0] = 1;
         a.out.block = 131072;
         set_k(a, 131072);
         for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) p->shape[1] = 1;
       }},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.what);
    // Buffers of their own, large enough for the widest variant (one row of 131072 bf16 values).
    Buffers b;
    HostBuffer wide_x(131072 * 2, 1), wide_codes(131072, 0xAB);
    Args a = make_args(b);
    v.mutate(a, b);
    if (a.x.shape[1] > 4096) {
      a.x.data = wide_x.data();
      a.out.codes.data = wide_codes.data();
    }
    expect_reaches_device_checks(a, b);
    EXPECT_TRUE(wide_codes.untouched());
  }
}

// M = 0: accepted without a device (every view is empty, nothing to ask the driver about) and nothing launched.
TEST(W8A8Validation, QuantizeEmptyXIsAcceptedWithoutADevice) {
  for (int64_t block : {int64_t{64}, kK}) {
    Buffers b;
    Args a = make_args(b);
    a.out.block = block;
    a.x.shape[0] = a.out.codes.shape[0] = 0;
    for (TensorView* p : {&a.out.scale, &a.out.zero, &a.out.sums}) {
      p->shape[0] = kK / block;
      p->shape[1] = 0;
      p->strides[0] = 0;  // int8_block_param_ld(0)
    }
    EXPECT_NO_THROW(quantize_per_block(a.x, a.out, nullptr)) << "block " << block;
    EXPECT_TRUE(b.outputs_untouched());
    // The rules still hold at M = 0.
    a.out.block = 48;
    expect_error([&] { quantize_per_block(a.x, a.out, nullptr); }, kQuantize, "out.block");
  }
}

// ---- prepack_w8a8 ---------------------------------------------------------------------------------------------------

// Weights as quantizers meet them: Gaussian rows of different scales, a few input channels 20x larger, one-sign rows,
// an all-zero block, a constant block, a block of one value and zeros, -0.
std::vector<float> weights(std::mt19937_64& rng, int64_t n, int64_t k) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<float> w(static_cast<std::size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) {
    const float row_scale = std::exp(6.f * unit(rng) - 3.f);
    for (int64_t c = 0; c < k; ++c) {
      float v = normal(rng) * row_scale;
      if (r % 5 == 1) v = std::fabs(v) + 0.01f * row_scale;
      if (r % 5 == 2) v = -std::fabs(v);
      w[r * k + c] = v;
    }
  }
  for (int i = 0; i < 3; ++i) {
    const int64_t c = static_cast<int64_t>(rng() % k);
    for (int64_t r = 0; r < n; ++r) w[r * k + c] *= 20.f;
  }
  const int64_t zero_row = static_cast<int64_t>(rng() % n), const_row = (zero_row + 1) % n;
  for (int64_t c = 0; c < 32; ++c) {
    w[zero_row * k + c] = 0.f;
    w[const_row * k + k - 32 + c] = -0.75f;
  }
  w[(n - 1) * k + 40] = -0.f;
  return w;
}

TEST(W8A8Validation, PrepackEqualsTheReferenceExactly) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  struct Shape {
    int64_t n, k;
  };
  for (const Shape s : {Shape{37, 384}, Shape{8, 4096}, Shape{3, 192}, Shape{1, 48}})
    for (int64_t block : {int64_t{32}, int64_t{64}, int64_t{128}, s.k})
      for (bool symmetric : {false, true}) {
        if (s.k % block != 0) continue;
        SCOPED_TRACE("N " + std::to_string(s.n) + " K " + std::to_string(s.k) + " block " + std::to_string(block) +
                     (symmetric ? " symmetric" : " asymmetric"));
        const std::vector<float> w = weights(rng, s.n, s.k);
        const W8A8HostWeight q = prepack_w8a8(w.data(), s.n, s.k, block, symmetric);
        const reference::Int8Blocks ref = reference::quantize_int8_blocks(w, s.n, s.k, block, symmetric);
        const std::vector<int32_t> ref_sums = reference::block_code_sums(ref);
        const int64_t blocks = s.k / block;
        EXPECT_EQ(q.n, s.n);
        EXPECT_EQ(q.k, s.k);
        EXPECT_EQ(q.block, block);
        EXPECT_EQ(q.symmetric, symmetric);
        ASSERT_EQ(q.ld, int8_block_param_ld(s.n));
        ASSERT_EQ(q.codes, ref.codes);
        ASSERT_EQ(q.scale.size(), static_cast<std::size_t>(blocks * q.ld));
        ASSERT_EQ(q.sums.size(), q.scale.size());
        ASSERT_EQ(q.zero.size(), symmetric ? 0u : q.scale.size());
        int64_t wrong = 0;
        for (int64_t r = 0; r < q.ld; ++r)
          for (int64_t b = 0; b < blocks; ++b) {
            const std::size_t at = static_cast<std::size_t>(b * q.ld + r);
            if (r >= s.n) {  // the padding rows of each plane hold 0
              wrong += q.scale[at] != 0.f || q.sums[at] != 0.f || (!symmetric && q.zero[at] != 0.f);
              continue;
            }
            const std::size_t p = static_cast<std::size_t>(r * blocks + b);
            uint32_t got_bits, want_bits;
            std::memcpy(&got_bits, &q.scale[at], 4);
            std::memcpy(&want_bits, &ref.scale[p], 4);
            const bool ok = got_bits == want_bits && q.sums[at] == static_cast<float>(ref_sums[p]) &&
                            (symmetric || q.zero[at] == static_cast<float>(ref.zero[p]));
            if (!ok && wrong++ < 3)
              ADD_FAILURE() << "row " << r << " block " << b << ": scale " << q.scale[at] << " / " << ref.scale[p]
                            << ", zero " << (symmetric ? 0.f : q.zero[at]) << " / " << ref.zero[p] << ", sum "
                            << q.sums[at] << " / " << ref_sums[p];
          }
        EXPECT_EQ(wrong, 0);
      }
}

// Blocks worked out by hand, including the ones whose codes reach the clamps.
TEST(W8A8Validation, PrepackHandPickedBlocks) {
  // lo = -1, hi = 3: s = 4 / 255, z = -64; -1 -> -128, 0 -> -64, 1 -> 0, 3 -> 127 (ΣBq = -65).
  std::vector<float> w(32, 0.f);
  w[0] = -1.f, w[2] = 1.f, w[3] = 3.f;
  const W8A8HostWeight q = prepack_w8a8(w.data(), 1, 32, 32, false);
  EXPECT_EQ(q.scale[0], 4.f / 255.f);
  EXPECT_EQ(q.zero[0], -64.f);
  EXPECT_EQ(q.codes[0], -128);
  EXPECT_EQ(q.codes[1], -64);
  EXPECT_EQ(q.codes[2], 0);
  EXPECT_EQ(q.codes[3], 127);
  EXPECT_EQ(q.sums[0], -128.f + 0.f + 127.f - 64.f * 29.f);
  EXPECT_EQ(q.sums[1], 0.f);  // padding rows 1..3 of the plane
  // All zeros: scale 1, codes = zero point = -128 (asymmetric) or 0 (symmetric).
  const std::vector<float> zeros(64, 0.f);
  const W8A8HostWeight za = prepack_w8a8(zeros.data(), 2, 32, 32, false);
  EXPECT_EQ(za.scale[0], 1.f);
  EXPECT_EQ(za.zero[0], -128.f);
  for (int8_t c : za.codes) EXPECT_EQ(c, -128);
  EXPECT_EQ(za.sums[1], -128.f * 32);
  const W8A8HostWeight zs = prepack_w8a8(zeros.data(), 2, 32, 32, true);
  EXPECT_EQ(zs.scale[0], 1.f);
  EXPECT_TRUE(zs.zero.empty());
  for (int8_t c : zs.codes) EXPECT_EQ(c, 0);
  // Symmetric: max|w| = 3 -> 127, -3 -> -127 (never -128).
  std::vector<float> s(32, 0.5f);
  s[5] = -3.f, s[6] = 3.f;
  const W8A8HostWeight qs = prepack_w8a8(s.data(), 1, 32, 32, true);
  EXPECT_EQ(qs.scale[0], 3.f / 127.f);
  EXPECT_EQ(qs.codes[5], -127);
  EXPECT_EQ(qs.codes[6], 127);
}

TEST(W8A8Validation, PrepackValidationNamesTheArgument) {
  const std::vector<float> w(40 * 256, 0.25f);
  EXPECT_NO_THROW(prepack_w8a8(w.data(), 40, 256, 64, false));
  expect_error([&] { prepack_w8a8(nullptr, 40, 256, 64, false); }, kPrepack, "w");
  expect_error([&] { prepack_w8a8(w.data(), 0, 256, 64, false); }, kPrepack, "n");
  expect_error([&] { prepack_w8a8(w.data(), -3, 256, 64, true); }, kPrepack, "n");
  expect_error([&] { prepack_w8a8(w.data(), 40, 0, 64, false); }, kPrepack, "k");
  expect_error([&] { prepack_w8a8(w.data(), 40, 200, 40, false); }, kPrepack, "k");  // not a multiple of 16
  expect_error([&] { prepack_w8a8(w.data(), 40, 256, 48, false); }, kPrepack, "block");
  expect_error([&] { prepack_w8a8(w.data(), 40, 256, 0, false); }, kPrepack, "block");
  expect_error([&] { prepack_w8a8(w.data(), 40, 256, 256 + 16, false); }, kPrepack, "block");
  expect_error([&] { prepack_w8a8(w.data(), 40, 192, 128, true); }, kPrepack, "block");  // does not divide K
  expect_error([&] { prepack_w8a8(w.data(), 40, 256, 16, true); }, kPrepack, "block");
  // Per channel beyond 131072 columns: fp32 ΣBq would no longer be exact.
  const std::vector<float> wide(131072 + 16, 1.f);
  EXPECT_NO_THROW(prepack_w8a8(wide.data(), 1, 131072, 131072, false));
  expect_error([&] { prepack_w8a8(wide.data(), 1, 131072 + 16, 131072 + 16, false); }, kPrepack, "block");
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> v = w;
    v[3 * 256 + 17] = bad;
    expect_error([&] { prepack_w8a8(v.data(), 40, 256, 64, false); }, kPrepack, "w");
  }
}

}  // namespace quantize_validation
// ==== end of quantize_per_block and prepack_w8a8 =====================================================================

// ==== gemm_w8a8 ======================================================================================================
namespace gemm_validation {

constexpr const char* kGemm = "tessera::linear::gemm_w8a8";

// a [5, 256] with padded code rows (272) and planes [4, ld 8]; w [40, 256] with dense code rows and planes [4, ld 40];
// block 64, both asymmetric with sums (each needs the other's); y bf16 [5, 40] with padded rows (48); bias fp32 [40].
constexpr int64_t kM = 5, kN = 40, kK = 256, kBlock = 64, kBlocks = kK / kBlock, kLdc = 272, kLdA = 8, kLdW = 40,
                  kLdy = 48;
constexpr std::size_t kPlaneBytes = 2048;  // each plane of an operand at this offset from the previous one

struct Buffers {
  // Large enough for every view below, including the wider stand-ins of the rule tests; a view moved into another
  // buffer (the overlap tests) stays within it.
  HostBuffer a_codes{16 * 1024, 1}, a_params{4 * kPlaneBytes, 2}, w_codes{16 * 1024, 3}, w_params{4 * kPlaneBytes, 4},
      y{8 * 1024, 0xAB}, bias{8 * 1024, 5};
  bool untouched() const {
    return a_codes.untouched() && a_params.untouched() && w_codes.untouched() && w_params.untouched() &&
           y.untouched() && bias.untouched();
  }
};

struct Args {
  Int8BlockTensor a, w;
  TensorView y;
  W8A8Epilogue epilogue;
  Workspace workspace;
};

void call(const Args& a) { gemm_w8a8(a.a, a.w, a.y, a.epilogue, a.workspace, nullptr); }

// Asymmetric blocks with sums: codes [rows, kK] with row stride ldc, the planes [kBlocks, rows] (ld) kPlaneBytes apart.
Int8BlockTensor blocks(uint8_t* codes, uint8_t* params, int64_t rows, int64_t ldc, int64_t ld) {
  Int8BlockTensor t;
  t.block = kBlock;
  t.codes = view2(codes, DType::kInt8, rows, kK, ldc);
  TensorView* planes[] = {&t.scale, &t.zero, &t.sums};
  for (int i = 0; i < 3; ++i) *planes[i] = view2(params + i * kPlaneBytes, DType::kFP32, kBlocks, rows, ld);
  return t;
}

Args make_args(Buffers& b) {
  Args a;
  a.a = blocks(b.a_codes.data(), b.a_params.data(), kM, kLdc, kLdA);
  a.w = blocks(b.w_codes.data(), b.w_params.data(), kN, kK, kLdW);
  a.y = view2(b.y.data(), DType::kBF16, kM, kN, kLdy);
  a.epilogue.bias = TensorView::contiguous(b.bias.data(), DType::kFP32, {kN}, 0);
  return a;
}

std::vector<TensorView*> planes(Int8BlockTensor& t) { return {&t.scale, &t.zero, &t.sums}; }

// K and the block set on both operands, with the plane counts and code row strides that follow.
void set_k(Args& a, int64_t k, int64_t block) {
  for (Int8BlockTensor* t : {&a.a, &a.w}) {
    t->block = block;
    t->codes.shape[1] = k;
    t->codes.strides[0] = (k + 15) / 16 * 16;
    for (TensorView* p : planes(*t)) p->shape[0] = block > 0 && k % block == 0 ? k / block : 1;
  }
}

// M (a's rows, y's rows) set consistently.
void set_m(Args& a, int64_t m) {
  a.a.codes.shape[0] = a.y.shape[0] = m;
  for (TensorView* p : planes(a.a)) p->shape[1] = m;
}

struct RuleCase {
  const char* what;
  const char* arg;
  std::function<void(Args&, Buffers&)> mutate;
  std::vector<std::string> says = {};
};

const std::vector<RuleCase>& gemm_rules() {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  static const std::vector<RuleCase> cases = {
      // block and K
      {"a block 128, w block 64", "w.block", [](Args& a, Buffers&) { a.a.block = 128; }, {"must equal a.block"}},
      {"block 48", "w.block", [](Args& a, Buffers&) { a.a.block = a.w.block = 48; }, {"32, 64, 128 or K"}},
      {"block 16", "w.block", [](Args& a, Buffers&) { set_k(a, kK, 16); }, {"32, 64, 128 or K"}},
      {"block 0", "w.block", [](Args& a, Buffers&) { a.a.block = a.w.block = 0; }, {"32, 64, 128 or K"}},
      {"block 256 of K 512 (neither 32, 64, 128 nor K)",
       "w.block",
       [](Args& a, Buffers&) { set_k(a, 512, 256); },
       {"32, 64, 128 or K"}},
      {"block 64 does not divide K 208", "w.block", [](Args& a, Buffers&) { set_k(a, 208, 64); }, {"divide K"}},
      {"K 200 (not a multiple of 16)", "w.block", [](Args& a, Buffers&) { set_k(a, 200, 200); }, {"multiple of 16"}},
      {"K 0", "w.block", [](Args& a, Buffers&) { set_k(a, 0, 64); }, {"multiple of 16"}},
      {"per channel, K 131072 > 131071", "w.block", [](Args& a, Buffers&) { set_k(a, 131072, 131072); }, {"<= 131071"}},
      // the kernel's 32-bit coordinates and grid
      {"K 2^30 + 128, block-wise", "w.codes", [](Args& a, Buffers&) { set_k(a, (int64_t{1} << 30) + 128, 128); },
       {"K <= 1073741824"}},
      {"N 65535 * 128 + 1 (grid.y)",
       "w.codes",
       [](Args& a, Buffers&) {
         const int64_t n = int64_t{65535} * 128 + 1;
         a.w.codes.shape[0] = a.y.shape[1] = n;
         for (TensorView* p : planes(a.w)) {
           p->shape[1] = n;
           p->strides[0] = (n + 3) / 4 * 4;
         }
       },
       {"N <= 8388480"}},
      {"M 2^31 - 256", "a.codes",
       [](Args& a, Buffers&) {
         const int64_t m = (int64_t{1} << 31) - 256;
         set_m(a, m);
         for (TensorView* p : planes(a.a)) p->strides[0] = m;
       },
       {"M <= 2147483391"}},
      // zero points need the other operand's sums
      {"w asymmetric, a without sums", "a.sums", [](Args& a, Buffers&) { a.a.sums = TensorView{}; }, {"required"}},
      {"a asymmetric, w without sums", "w.sums", [](Args& a, Buffers&) { a.w.sums = TensorView{}; }, {"required"}},
      // codes
      {"w codes uint8", "w.codes", [](Args& a, Buffers&) { a.w.codes.dtype = DType::kUInt8; }},
      {"w codes rank 1", "w.codes",
       [](Args& a, Buffers& b) { a.w.codes = TensorView::contiguous(b.w_codes.data(), DType::kInt8, {kN * kK}, 0); }},
      {"w codes without rows", "w.codes",
       [](Args& a, Buffers&) {
         a.w.codes.shape[0] = 0;
         for (TensorView* p : planes(a.w)) p->shape[1] = 0;
         a.y.shape[1] = 0;
       }},
      {"w codes row stride 128 < K", "w.codes", [](Args& a, Buffers&) { a.w.codes.strides[0] = 128; }, {">= K"}},
      {"w codes 8-byte aligned only", "w.codes", [](Args& a, Buffers& b) { a.w.codes.data = b.w_codes.data() + 8; }},
      {"a codes int32", "a.codes", [](Args& a, Buffers&) { a.a.codes.dtype = DType::kInt32; }},
      {"a codes K 240 (w's is 256)", "a.codes", [](Args& a, Buffers&) { a.a.codes.shape[1] = kK - 16; }},
      {"a codes column stride 2", "a.codes", [](Args& a, Buffers&) { a.a.codes.strides[1] = 2; }},
      {"a codes row stride 0", "a.codes", [](Args& a, Buffers&) { a.a.codes.strides[0] = 0; }, {">= K"}},
      {"a codes row stride K + 8 (not a multiple of 16)",
       "a.codes",
       [](Args& a, Buffers&) { a.a.codes.strides[0] = kK + 8; },
       {"multiple of 16"}},
      // planes
      {"a scale bf16", "a.scale", [](Args& a, Buffers&) { a.a.scale.dtype = DType::kBF16; }},
      {"a scale rank 1", "a.scale",
       [](Args& a, Buffers& b) {
         a.a.scale = TensorView::contiguous(b.a_params.data(), DType::kFP32, {kBlocks * kLdA}, 0);
       }},
      {"a scale row-major [M, K / block] (not block-major)", "a.scale",
       [](Args& a, Buffers& b) { a.a.scale = view2(b.a_params.data(), DType::kFP32, kM, kBlocks, kBlocks); }},
      {"a scale K / block - 1 planes", "a.scale", [](Args& a, Buffers&) { a.a.scale.shape[0] = kBlocks - 1; }},
      {"a scale M + 1 rows", "a.scale", [](Args& a, Buffers&) { a.a.scale.shape[1] = kM + 1; }},
      {"a planes ld 4 < M",
       "a.scale",
       [](Args& a, Buffers&) {
         for (TensorView* p : planes(a.a)) p->strides[0] = 4;
       },
       {">= M (5)"}},
      {"w planes ld 42 (not a multiple of 4)",
       "w.scale",
       [](Args& a, Buffers&) {
         for (TensorView* p : planes(a.w)) p->strides[0] = 42;
       },
       {"multiple of 4"}},
      {"a scale 4-byte aligned only", "a.scale", [](Args& a, Buffers& b) { a.a.scale.data = b.a_params.data() + 4; }},
      {"w scale column stride 2", "w.scale", [](Args& a, Buffers&) { a.w.scale.strides[1] = 2; }},
      {"w zero ld 44 (scale's is 40)",
       "w.zero",
       [](Args& a, Buffers&) { a.w.zero.strides[0] = 44; },
       {"row stride (ld) of 'w.scale'"}},
      {"w zero N - 1 rows", "w.zero", [](Args& a, Buffers&) { a.w.zero.shape[1] = kN - 1; }, {"(N)"}},
      {"a zero int8", "a.zero", [](Args& a, Buffers&) { a.a.zero.dtype = DType::kInt8; }},
      {"a sums one plane", "a.sums", [](Args& a, Buffers&) { a.a.sums.shape[0] = 1; }},
      {"w sums int32", "w.sums", [](Args& a, Buffers&) { a.w.sums.dtype = DType::kInt32; }},
      {"w sums ld 48 (scale's is 40)", "w.sums", [](Args& a, Buffers&) { a.w.sums.strides[0] = 48; }},
      // y
      {"y uint8", "y", [](Args& a, Buffers&) { a.y.dtype = DType::kUInt8; }},
      {"y fp8", "y", [](Args& a, Buffers&) { a.y.dtype = DType::kFP8E4M3; }},
      {"y rank 1", "y",
       [](Args& a, Buffers& b) { a.y = TensorView::contiguous(b.y.data(), DType::kBF16, {kM * kN}, 0); }},
      {"y M + 1 rows", "y", [](Args& a, Buffers&) { a.y.shape[0] = kM + 1; }},
      {"y N - 8 columns", "y", [](Args& a, Buffers&) { a.y.shape[1] = kN - 8; }},
      {"y column stride 2", "y", [](Args& a, Buffers&) { a.y.strides[1] = 2; }},
      {"y rows overlapping (stride N - 8)", "y", [](Args& a, Buffers&) { a.y.strides[0] = kN - 8; }, {"share memory"}},
      {"y rows all the same (stride 0)", "y", [](Args& a, Buffers&) { a.y.strides[0] = 0; }, {"share memory"}},
      {"y at an odd address", "y", [](Args& a, Buffers& b) { a.y.data = b.y.data() + 1; }, {"-byte aligned address"}},
      {"bias at an address not a multiple of 4",
       "epilogue.bias",
       [](Args& a, Buffers& b) { a.epilogue.bias.data = b.bias.data() + 2; },
       {"-byte aligned address"}},
      // y overlapping an input
      {"y inside a's codes", "y", [](Args& a, Buffers& b) { a.y.data = b.a_codes.data() + 512; }, {"'a.codes'"}},
      {"y on w's codes", "y", [](Args& a, Buffers& b) { a.y.data = b.w_codes.data(); }, {"'w.codes'"}},
      {"y on a's sums", "y", [](Args& a, Buffers&) { a.y.data = a.a.sums.data; }, {"'a.sums'"}},
      {"y overlapping w's zero points",
       "y",
       [](Args& a, Buffers&) { a.y.data = static_cast<uint8_t*>(a.w.zero.data) + 64; },
       {"'w.zero'"}},
      {"y on the bias", "y", [](Args& a, Buffers& b) { a.y.data = b.bias.data(); }, {"'epilogue.bias'"}},
      // epilogue
      {"bias bf16", "epilogue.bias", [](Args& a, Buffers&) { a.epilogue.bias.dtype = DType::kBF16; }},
      {"bias N + 8", "epilogue.bias", [](Args& a, Buffers&) { a.epilogue.bias.shape[0] = kN + 8; }},
      {"bias rank 2", "epilogue.bias",
       [](Args& a, Buffers& b) {
         a.epilogue.bias = TensorView::contiguous(b.bias.data(), DType::kFP32, {1, kN}, 0);
       }},
      {"bias stride 2", "epilogue.bias", [](Args& a, Buffers&) { a.epilogue.bias.strides[0] = 2; }},
      {"clamp_min > clamp_max", "epilogue.clamp_min",
       [](Args& a, Buffers&) { a.epilogue.clamp_min = 1.0f, a.epilogue.clamp_max = -1.0f; }},
      {"clamp_min NaN", "epilogue.clamp_min", [nan](Args& a, Buffers&) { a.epilogue.clamp_min = nan; }},
      {"clamp_max NaN", "epilogue.clamp_min", [nan](Args& a, Buffers&) { a.epilogue.clamp_max = nan; }},
      {"int8 y, out_scale 0", "epilogue.out_scale",
       [](Args& a, Buffers&) { a.y.dtype = DType::kInt8, a.epilogue.out_scale = 0.0f; }},
      {"int8 y, out_scale -1", "epilogue.out_scale",
       [](Args& a, Buffers&) { a.y.dtype = DType::kInt8, a.epilogue.out_scale = -1.0f; }},
      {"int8 y, out_scale inf", "epilogue.out_scale",
       [inf](Args& a, Buffers&) { a.y.dtype = DType::kInt8, a.epilogue.out_scale = inf; }},
      {"int8 y, out_scale NaN", "epilogue.out_scale",
       [nan](Args& a, Buffers&) { a.y.dtype = DType::kInt8, a.epilogue.out_scale = nan; }},
      // memory: host pointers (device = host) and null data are named before the driver is asked anything
      {"a codes null", "a.codes", [](Args& a, Buffers&) { a.a.codes.data = nullptr; }, {"null"}},
      {"w scale in host memory",
       "w.scale",
       [](Args& a, Buffers&) { a.w.scale.device = TensorView::kHostDevice; },
       {"host pointer"}},
      {"a sums in host memory",
       "a.sums",
       [](Args& a, Buffers&) { a.a.sums.device = TensorView::kHostDevice; },
       {"host pointer"}},
      {"y in host memory", "y", [](Args& a, Buffers&) { a.y.device = TensorView::kHostDevice; }, {"host pointer"}},
      {"y null", "y", [](Args& a, Buffers&) { a.y.data = nullptr; }, {"null"}},
      {"bias in host memory",
       "epilogue.bias",
       [](Args& a, Buffers&) { a.epilogue.bias.device = TensorView::kHostDevice; },
       {"host pointer"}},
  };
  return cases;
}

TEST(W8A8Validation, GemmEachRuleNamesItsArgument) {
  for (const RuleCase& c : gemm_rules()) {
    SCOPED_TRACE(c.what);
    Buffers b;
    Args a = make_args(b);
    c.mutate(a, b);
    expect_error([&] { call(a); }, kGemm, c.arg, c.says);
    EXPECT_TRUE(b.untouched()) << "a buffer was written";
  }
}

// The unmutated arguments, and variants the rules must accept, get as far as the device checks.
TEST(W8A8Validation, GemmAcceptedArgumentsReachTheDeviceChecks) {
  struct Variant {
    const char* what;
    std::function<void(Args&, Buffers&)> mutate;
  };
  const std::vector<Variant> variants = {
      {"as made", [](Args&, Buffers&) {}},
      {"symmetric a (w's sums then unused)", [](Args& a, Buffers&) { a.a.zero = TensorView{}; }},
      {"symmetric w (a's sums then unused)", [](Args& a, Buffers&) { a.w.zero = TensorView{}; }},
      {"both symmetric, no sums", [](Args& a, Buffers&) { a.a.zero = a.a.sums = a.w.zero = a.w.sums = TensorView{}; }},
      {"block 32", [](Args& a, Buffers&) { set_k(a, kK, 32); }},
      {"block 128", [](Args& a, Buffers&) { set_k(a, kK, 128); }},
      {"block = K (per channel)", [](Args& a, Buffers&) { set_k(a, kK, kK); }},
      {"K 48, block = K", [](Args& a, Buffers&) { set_k(a, 48, 48); }},
      {"fp16 y", [](Args& a, Buffers&) { a.y.dtype = DType::kFP16; }},
      {"fp32 y", [](Args& a, Buffers&) { a.y.dtype = DType::kFP32; }},
      {"int8 y, out_scale 0.5", [](Args& a, Buffers&) { a.y.dtype = DType::kInt8, a.epilogue.out_scale = 0.5f; }},
      {"y rows dense", [](Args& a, Buffers&) { a.y.strides[0] = kN; }},
      {"no bias", [](Args& a, Buffers&) { a.epilogue.bias = TensorView{}; }},
      {"clamp_min = clamp_max", [](Args& a, Buffers&) { a.epilogue.clamp_min = a.epilogue.clamp_max = 2.0f; }},
      {"fp32 y, out_scale 0 (int8 y only)",
       [](Args& a, Buffers&) { a.y.dtype = DType::kFP32, a.epilogue.out_scale = 0; }},
      {"a codes rows dense", [](Args& a, Buffers&) { a.a.codes.strides[0] = kK; }},
      {"one row of a, any codes stride",
       [](Args& a, Buffers&) {
         set_m(a, 1);
         a.a.codes.strides[0] = 7;
       }},
      {"planes ld 12 (> M, a multiple of 4)",
       [](Args& a, Buffers&) {
         for (TensorView* p : planes(a.a)) p->strides[0] = 12;
       }},
      {"M = 0 (w still asks the device)", [](Args& a, Buffers&) { set_m(a, 0); }},
      {"per channel, K 131056 (the largest)",
       [](Args& a, Buffers&) {
         set_k(a, 131056, 131056);
         set_m(a, 1);
         a.w.codes.shape[0] = a.y.shape[1] = a.epilogue.bias.shape[0] = 1;
         for (TensorView* p : planes(a.w)) p->shape[1] = 1;
       }},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.what);
    // Buffers of their own; the codes of the widest variant (one row of 131056 columns each) in wider ones.
    Buffers b;
    HostBuffer wide_a(131072, 1), wide_w(131072, 3);
    Args a = make_args(b);
    v.mutate(a, b);
    if (a.w.codes.shape[1] > kK) {
      a.a.codes.data = wide_a.data();
      a.w.codes.data = wide_w.data();
    }
    try {
      call(a);
      ADD_FAILURE() << "host buffers accepted";
    } catch (const Error& e) {
      EXPECT_TRUE(test::is_device_check_error(e.what())) << "stopped before the device checks: " << e.what();
    }
    EXPECT_TRUE(b.untouched() && wide_a.untouched() && wide_w.untouched()) << "a buffer was written";
  }
}

// The workspace rule needs the device's SM count (the split-K choice), so it runs on a GPU: the host buffers are
// labelled memory of the current device (device_verified: the driver is not asked about them), and the workspace
// errors stop the call before anything is launched. Without a GPU the call stops at the device checks.
TEST(W8A8Validation, GemmWorkspaceTooSmall) {
  // M 1, N 256, K 8192 per channel: two 128-row tiles of w, far fewer CTAs than SMs, so K is split (select_config).
  constexpr int64_t m = 1, n = 256, k = 8192;
  const int device = test::gpu_available() ? test::current_device() : 0;
  constexpr std::size_t kWorkspaceBytes = 64 * 1024;
  // y's buffer as large as the workspace: a workspace placed at y stays within it.
  HostBuffer a_codes(k, 1), w_codes(n * k, 2), params(4 * 1024, 3), y(kWorkspaceBytes, 0xAB),
      ws(kWorkspaceBytes, 0xCD);
  const auto on_device = [device](void* data, DType dtype, int64_t rows, int64_t cols, int64_t ld) {
    TensorView t = view2(data, dtype, rows, cols, ld);
    t.device = device;
    t.device_verified = true;
    return t;
  };
  Int8BlockTensor a, w;
  a.block = w.block = k;
  a.codes = on_device(a_codes.data(), DType::kInt8, m, k, k);
  a.scale = on_device(params.data(), DType::kFP32, 1, m, int8_block_param_ld(m));
  w.codes = on_device(w_codes.data(), DType::kInt8, n, k, k);
  w.scale = on_device(params.data() + 1024, DType::kFP32, 1, n, n);
  const TensorView yv = on_device(y.data(), DType::kBF16, m, n, n);
  const auto run = [&](const Workspace& workspace) { gemm_w8a8(a, w, yv, W8A8Epilogue{}, workspace, nullptr); };
  if (!test::gpu_available()) {
    try {
      run(Workspace{});
      ADD_FAILURE() << "no error without a GPU";
    } catch (const Error& e) {
      EXPECT_TRUE(test::is_device_check_error(e.what())) << "stopped before the device checks: " << e.what();
    }
    GTEST_SKIP() << "no CUDA device visible: the workspace rule needs the SM count";
  }
  w8a8::Shape shape;
  shape.m = m;
  shape.n = n;
  shape.k = k;
  shape.block = k;
  shape.num_sms = ::tessera::detail::current_device_info().num_sms;
  const std::size_t need = w8a8::partial_bytes(shape, w8a8::select_config(shape));
  // Without a split the call would launch on the host buffers: stop here instead.
  ASSERT_GT(need, 0u) << "this shape no longer splits K on " << shape.num_sms << " SMs";
  ASSERT_LE(need + 8, kWorkspaceBytes);
  EXPECT_GE(gemm_w8a8_workspace_bytes(m, n, k, k), need);
  expect_error([&] { run(Workspace{}); }, kGemm, "workspace", {"must hold " + std::to_string(need)});
  expect_error([&] { run(Workspace{ws.data(), need - 1}); }, kGemm, "workspace", {"got " + std::to_string(need - 1)});
  expect_error([&] { run(Workspace{ws.data() + 8, need}); }, kGemm, "workspace", {"16-byte aligned"});
  // The split partials are written there while everything else is read or written: no shared memory with any of it.
  expect_error([&] { run(Workspace{w_codes.data(), need}); }, kGemm, "workspace", {"must not overlap 'w.codes'"});
  expect_error([&] { run(Workspace{params.data() + 1024, need}); }, kGemm, "workspace", {"must not overlap 'w.scale'"});
  expect_error([&] { run(Workspace{y.data(), need}); }, kGemm, "workspace", {"must not overlap 'y'"});
  EXPECT_TRUE(y.untouched() && ws.untouched() && w_codes.untouched() && params.untouched()) << "a buffer was written";
}

}  // namespace gemm_validation
// ==== end of gemm_w8a8 ===============================================================================================

}  // namespace
}  // namespace tessera::linear
