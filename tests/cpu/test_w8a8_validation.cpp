// W8A8 on the CPU: every validation rule of the public W8A8 entry points (the error names the op and the argument,
// and nothing is written), and the host weight quantizer against the reference.
//
// Validation runs before any device query, so host buffers stand in for device memory (device 0). A call that got
// past every rule fails at the device checks: without a GPU on cudaGetDevice, with one on the host pointer. The
// Accepted* tests check that unmutated arguments get exactly that far, so each rule test fails for its rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "reference/w8a8_reference.h"
#include "tessera/error.h"
#include "tessera/w8a8.h"

namespace tessera::linear {
namespace {

// ==== quantize_per_block and prepack_w8a8 ============================================================================
namespace quantize_validation {

constexpr const char* kQuantize = "tessera::linear::quantize_per_block";
constexpr const char* kPrepack = "tessera::linear::prepack_w8a8";

// The error of `call` names `op` and then the argument: "<op>: '<arg>' ...".
void expect_error(const std::function<void()>& call, const std::string& op, const std::string& arg) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming '" << arg << "'";
  } catch (const Error& e) {
    const std::string msg = e.what(), head = op + ": '" + arg + "'";
    EXPECT_NE(msg.find(head), std::string::npos) << "expected \"" << head << "\" in: " << msg;
  }
}

// Host memory standing in for device memory: 256-byte aligned, filled with a known byte.
class HostBuffer {
 public:
  HostBuffer(std::size_t bytes, uint8_t fill) : fill_(fill), raw_(bytes + 256, fill) {}
  uint8_t* data() {
    const auto addr = reinterpret_cast<std::uintptr_t>(raw_.data());
    return raw_.data() + (256 - addr % 256) % 256;
  }
  bool untouched() const {
    for (uint8_t v : raw_)
      if (v != fill_) return false;
    return true;
  }

 private:
  uint8_t fill_;
  std::vector<uint8_t> raw_;
};

// x [5, 256] bf16 into codes with padded rows (272) and parameter planes [4, ld 8] (block 64, asymmetric, sums).
constexpr int64_t kM = 5, kK = 256, kBlock = 64, kBlocks = kK / kBlock, kLdc = 272, kLd = 8;

struct Buffers {
  // Large enough for every view below, including the wider stand-ins of the rule tests.
  HostBuffer x{64 * 1024, 1}, codes{16 * 1024, 0xAB}, scale{4096, 0xAB}, zero{4096, 0xAB}, sums{4096, 0xAB};
  bool outputs_untouched() const {
    return codes.untouched() && scale.untouched() && zero.untouched() && sums.untouched();
  }
};

TensorView view2(void* data, DType dtype, int64_t rows, int64_t cols, int64_t ld) {
  TensorView t = TensorView::contiguous(data, dtype, {rows, cols}, 0);
  t.strides[0] = ld;
  return t;
}

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
    const std::string msg = e.what();
    const bool no_gpu = msg.find("CUDA error") != std::string::npos && msg.find("cudaGetDevice") != std::string::npos;
    const bool host_pointer = msg.find("host pointer") != std::string::npos;
    EXPECT_TRUE(no_gpu || host_pointer) << "stopped before the device checks: " << msg;
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

}  // namespace
}  // namespace tessera::linear
