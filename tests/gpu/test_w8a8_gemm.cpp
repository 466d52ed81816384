// The W8A8 GEMM on the GPU (tessera/w8a8.h) against the float64 product of the dequantized operands
// (src/reference/w8a8_reference.h).
//
// Every case: x [M, K] normal with three columns 20x larger (one when K < 1024: the outlier channels of LLM
// activations) and, for some cases, all-positive rows (post-activation data, where the asymmetric zero point sits at
// −128); w [N, K] with rows of different scales and one row 4x larger; both quantized by the reference quantizer
// (symmetric or asymmetric per operand), parameters laid out block-major with ld > rows (padding filled with NaN, which
// must not reach y), uploaded; y poisoned with 0xFF bytes (NaN for floats) and its row padding checked untouched.
//
// Tolerances. The kernel forms each block's D from integers (exact but for one rounding with extreme zero points on
// both operands, docs/ops/w8a8.md), and the rest in fp32: per element, the scale product sA·sB (one rounding), the
// per-block fma into the total (one rounding of a partial sum), and for one block per row the int32 → fp32 conversion
// of Σ Aq·Bq and the two correction terms (one rounding each). With u = 2^-24, every element must satisfy (8u per
// element is a margin over those few roundings, not a worst case for the fp32 total over K / block blocks, which
// could reach (K / block)·u·mag; the grid's largest is 128 blocks)
//   |y − ref| <= 1.01·u_y·|ref| + 8u · mag,   mag = Σ_i |sA sB| (Σ |Aq||Bq| + |zB|Σ|Aq| + |zA|Σ|Bq| + G|zA zB|),
// (u_y: y's unit roundoff; int8 y: within one code of rint(ref · out_scale)), and the relative Frobenius error must be
// below 4e-3 (bf16 y), 5e-4 (fp16), 1e-5 (fp32): the output rounding's rms with margin.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "linear/w8a8/config.h"
#include "reference/parallel.h"
#include "reference/w8a8_reference.h"
#include "tessera/error.h"
#include "tessera/w8a8.h"

namespace tessera::linear {
namespace {

using reference::Int8Blocks;
using test::DeviceBuffer;

struct Case {
  int64_t m = 1, n = 128, k = 256;
  int64_t block = 128;  // 0: K
  bool asym_a = true, asym_w = false;
  DType y_dtype = DType::kBF16;
  bool bias = false, clamp = false, positive_x = false;
  int64_t ldy_pad = 0, ld_pad = 4;  // extra y columns; extra parameter rows (multiple of 4)
  // A sums plane the call does not need (a's without zero points on w, w's without them on a) given anyway, all NaN:
  // it must not be read.
  bool unused_sums_nan = false;
};

std::string describe(const Case& c) {
  return "M=" + std::to_string(c.m) + " N=" + std::to_string(c.n) + " K=" + std::to_string(c.k) +
         " block=" + (c.block == 0 ? std::string("K") : std::to_string(c.block)) + (c.asym_a ? " zA" : "") +
         (c.asym_w ? " zB" : "") + " y=" + dtype_name(c.y_dtype) + (c.bias ? " bias" : "") + (c.clamp ? " clamp" : "") +
         (c.positive_x ? " x>=0" : "") + (c.unused_sums_nan ? " unused-sums=NaN" : "");
}

struct Host {
  Int8Blocks a, w;
  std::vector<double> bias;
  std::vector<float> bias_f;
};

Host make_host(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t block = c.block == 0 ? c.k : c.block;
  std::vector<float> x(static_cast<std::size_t>(c.m * c.k)), w(static_cast<std::size_t>(c.n * c.k));
  std::vector<int64_t> outliers;
  for (int i = 0; i < (c.k < 1024 ? 1 : 3); ++i) outliers.push_back(static_cast<int64_t>(rng() % c.k));
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t j = 0; j < c.k; ++j) {
      float v = normal(rng);
      if (c.positive_x) v = std::fabs(v);
      if (std::find(outliers.begin(), outliers.end(), j) != outliers.end()) v *= 20.f;
      x[r * c.k + j] = v;
    }
  const int64_t big_row = static_cast<int64_t>(rng() % c.n);
  for (int64_t r = 0; r < c.n; ++r) {
    const float scale = 0.02f * (1.f + static_cast<float>(r % 7)) * (r == big_row ? 4.f : 1.f);
    for (int64_t j = 0; j < c.k; ++j) w[r * c.k + j] = scale * normal(rng) + (r % 5 == 0 ? 0.01f : 0.f);
  }
  Host h;
  h.a = reference::quantize_int8_blocks(x, c.m, c.k, block, !c.asym_a);
  h.w = reference::quantize_int8_blocks(w, c.n, c.k, block, !c.asym_w);
  if (c.bias) {
    for (int64_t n = 0; n < c.n; ++n) {
      h.bias_f.push_back(normal(rng));
      h.bias.push_back(h.bias_f.back());
    }
  }
  return h;
}

// Block-major [blocks][ld] planes of scale, zero (as floats) and code sums; padding rows NaN.
struct Planes {
  int64_t ld = 0;
  std::vector<float> scale, zero, sums;
};
Planes planes_of(const Int8Blocks& q, int64_t ld) {
  Planes p;
  p.ld = ld;
  const int64_t blocks = q.blocks();
  const std::vector<int32_t> sums = reference::block_code_sums(q);
  p.scale.assign(static_cast<std::size_t>(blocks * ld), NAN);
  p.zero = p.scale;
  p.sums = p.scale;
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t i = 0; i < blocks; ++i) {
      p.scale[i * ld + r] = q.scale[r * blocks + i];
      p.zero[i * ld + r] = static_cast<float>(q.zero[r * blocks + i]);
      p.sums[i * ld + r] = static_cast<float>(sums[r * blocks + i]);
    }
  return p;
}

// One operand in device memory.
struct DeviceOperand {
  DeviceBuffer<int8_t> codes;
  DeviceBuffer<float> scale, zero, sums;
  Int8BlockTensor view(int64_t rows, int64_t k, int64_t block, int64_t ld, bool with_zero, bool with_sums) const {
    const int dev = test::current_device();
    Int8BlockTensor t;
    t.block = block;
    t.codes = TensorView::contiguous(codes.get(), DType::kInt8, {rows, k}, dev);
    const int64_t blocks = k / block;
    t.scale = test::strided(scale.get(), DType::kFP32, {blocks, rows}, {ld, 1});
    if (with_zero) t.zero = test::strided(zero.get(), DType::kFP32, {blocks, rows}, {ld, 1});
    if (with_sums) t.sums = test::strided(sums.get(), DType::kFP32, {blocks, rows}, {ld, 1});
    return t;
  }
};
DeviceOperand upload(const Int8Blocks& q, const Planes& p) {
  DeviceOperand d;
  d.codes = DeviceBuffer<int8_t>(q.codes);
  d.scale = DeviceBuffer<float>(p.scale);
  d.zero = DeviceBuffer<float>(p.zero);
  d.sums = DeviceBuffer<float>(p.sums);
  return d;
}

std::size_t y_size(DType t) { return t == DType::kFP32 ? 4 : t == DType::kInt8 ? 1 : 2; }

double y_value(DType t, const std::vector<uint8_t>& y, std::size_t i) {
  switch (t) {
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, &y[i * 2], 2);
      return host::bf16_to_f32(v);
    }
    case DType::kFP16: {
      uint16_t v;
      std::memcpy(&v, &y[i * 2], 2);
      return host::fp16_to_f32(v);
    }
    case DType::kFP32: {
      float v;
      std::memcpy(&v, &y[i * 4], 4);
      return v;
    }
    default:
      return static_cast<int8_t>(y[i]);
  }
}

constexpr float kClampLo = -2.0f, kClampHi = 3.0f;
constexpr float kOutScale = 8.0f;

struct Problem {
  Case c;
  Host h;
  DeviceOperand a, w;
  DeviceBuffer<float> bias;
  DeviceBuffer<uint8_t> y;
  DeviceBuffer<unsigned char> ws;
  Int8BlockTensor av, wv;
  TensorView yv;
  W8A8Epilogue epi;

  Problem(const Case& cs, uint64_t seed) : Problem(cs, make_host(cs, seed)) {}
  Problem(const Case& cs, Host host) : c(cs), h(std::move(host)) {
    const int64_t block = c.block == 0 ? c.k : c.block;
    const int64_t lda = int8_block_param_ld(c.m) + c.ld_pad, ldw = int8_block_param_ld(c.n) + c.ld_pad;
    a = upload(h.a, planes_of(h.a, lda));
    w = upload(h.w, planes_of(h.w, ldw));
    av = a.view(c.m, c.k, block, lda, c.asym_a, c.asym_w);
    wv = w.view(c.n, c.k, block, ldw, c.asym_w, c.asym_a);
    if (c.unused_sums_nan) {
      const int64_t blocks = c.k / block;
      if (!c.asym_w) {
        a.sums = DeviceBuffer<float>(std::vector<float>(static_cast<std::size_t>(blocks * lda), NAN));
        av.sums = test::strided(a.sums.get(), DType::kFP32, {blocks, c.m}, {lda, 1});
      }
      if (!c.asym_a) {
        w.sums = DeviceBuffer<float>(std::vector<float>(static_cast<std::size_t>(blocks * ldw), NAN));
        wv.sums = test::strided(w.sums.get(), DType::kFP32, {blocks, c.n}, {ldw, 1});
      }
    }
    const int64_t ldy = c.n + c.ldy_pad;
    y = DeviceBuffer<uint8_t>(static_cast<std::size_t>(std::max<int64_t>(c.m, 1) * ldy) * y_size(c.y_dtype));
    yv = test::strided(y.get(), c.y_dtype, {c.m, c.n}, {ldy, 1});
    if (c.bias) {
      bias = DeviceBuffer<float>(h.bias_f);
      epi.bias = TensorView::contiguous(bias.get(), DType::kFP32, {c.n}, test::current_device());
    }
    if (c.clamp) {
      epi.clamp_min = kClampLo;
      epi.clamp_max = kClampHi;
    }
    epi.out_scale = kOutScale;
    const std::size_t bytes = gemm_w8a8_workspace_bytes(c.m, c.n, c.k, block);
    ws = DeviceBuffer<unsigned char>(std::max<std::size_t>(bytes, 16));
    ws.poison(0x7F);
  }
  void launch(cudaStream_t stream) { gemm_w8a8(av, wv, yv, epi, Workspace{ws.get(), ws.size()}, stream); }
  std::vector<uint8_t> run(cudaStream_t stream) {
    y.poison();
    launch(stream);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    return y.download();
  }
};

double tolerance(DType t) { return t == DType::kBF16 ? 4e-3 : t == DType::kFP16 ? 5e-4 : t == DType::kFP32 ? 1e-5 : 0; }
double unit_roundoff(DType t) {
  return t == DType::kBF16 ? 1.0 / 256 : t == DType::kFP16 ? 1.0 / 2048 : std::ldexp(1.0, -24);
}

void expect_matches(const Problem& r, const std::vector<uint8_t>& y) {
  const Case& c = r.c;
  const Int8Blocks &a = r.h.a, &w = r.h.w;
  const std::vector<double> ref = reference::w8a8_reference(a, w, r.h.bias);
  const int64_t blocks = a.blocks(), ldy = c.n + c.ldy_pad;
  // mag per element (see the header).
  std::vector<double> mag(static_cast<std::size_t>(c.m * c.n), 0.0);
  reference::detail::parallel(reference::detail::num_workers(0, static_cast<double>(c.m) * c.n * c.k, c.m), [&](int t) {
    const int workers = reference::detail::num_workers(0, static_cast<double>(c.m) * c.n * c.k, c.m);
    for (int64_t m = t; m < c.m; m += workers)
      for (int64_t n = 0; n < c.n; ++n) {
        double s = 0;
        for (int64_t i = 0; i < blocks; ++i) {
          double abs_dot = 0, abs_a = 0, abs_b = 0;
          for (int64_t k = i * a.block; k < (i + 1) * a.block; ++k) {
            const double qa = a.codes[m * c.k + k], qb = w.codes[n * c.k + k];
            abs_dot += std::fabs(qa * qb);
            abs_a += std::fabs(qa);
            abs_b += std::fabs(qb);
          }
          const double za = a.zero[m * blocks + i], zb = w.zero[n * blocks + i];
          s += std::fabs(static_cast<double>(a.scale[m * blocks + i]) * w.scale[n * blocks + i]) *
               (abs_dot + std::fabs(zb) * abs_a + std::fabs(za) * abs_b + a.block * std::fabs(za * zb));
        }
        mag[m * c.n + n] = s;
      }
  });
  const double u = std::ldexp(1.0, -24), uy = unit_roundoff(c.y_dtype);
  double err2 = 0, ref2 = 0, worst = 0;
  int over = 0;
  for (int64_t m = 0; m < c.m; ++m) {
    for (int64_t n = 0; n < c.n; ++n) {
      double want = ref[m * c.n + n];
      if (c.clamp) want = std::min<double>(std::max<double>(want, kClampLo), kClampHi);
      const double got = y_value(c.y_dtype, y, static_cast<std::size_t>(m * ldy + n));
      if (c.y_dtype == DType::kInt8) {
        const double code = std::min(127.0, std::max(-128.0, std::rint(want * kOutScale)));
        const double bound = 1.0;
        const double d = std::fabs(got - code);
        worst = std::max(worst, d);
        if (d > bound && over++ < 3)
          ADD_FAILURE() << "y[" << m << ", " << n << "] = " << got << ", expected code " << code;
        continue;
      }
      const double d = std::fabs(got - want);
      const double bound = 1.01 * uy * std::fabs(want) + 8 * u * mag[m * c.n + n] + 1e-30;
      worst = std::max(worst, d / bound);
      if (!(d <= bound) && over++ < 3)
        ADD_FAILURE() << "y[" << m << ", " << n << "] = " << got << ", reference " << want << ", |error| " << d
                      << " > bound " << bound;
      err2 += d * d;
      ref2 += want * want;
    }
    for (int64_t n = c.n; n < ldy; ++n)
      for (std::size_t b = 0; b < y_size(c.y_dtype); ++b)
        if (y[(m * ldy + n) * y_size(c.y_dtype) + b] != 0xFF && over++ < 3)
          ADD_FAILURE() << "y's row padding written at (" << m << ", " << n << ")";
  }
  EXPECT_EQ(over, 0) << "elements past their bound (worst " << worst << ")";
  if (c.y_dtype != DType::kInt8)
    EXPECT_LE(std::sqrt(err2 / std::max(ref2, 1e-300)), tolerance(c.y_dtype)) << "relative Frobenius error";
}

void check_case(const Case& c, cudaStream_t stream = nullptr) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
  Problem r(c, seed);
  expect_matches(r, r.run(stream));
}

class W8A8GemmGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

// Every block form and zero-point combination on small shapes (8-token tiles), with tails in M, N and K.
TEST_F(W8A8GemmGpu, ShapeGrid) {
  for (const int64_t block : {int64_t{0}, int64_t{32}, int64_t{64}, int64_t{128}})
    for (const int64_t m : {1, 7, 33, 100, 200, 300})
      for (const int zp : {0, 1, 2, 3}) {
        Case c;
        c.m = m;
        c.block = block;
        c.asym_a = zp & 1;
        c.asym_w = zp & 2;
        c.n = (m % 3 == 0) ? 136 : 300;
        c.k = block == 32 ? 416 : block == 64 ? 320 : 384;
        check_case(c);
      }
}

// Output types, bias, clamp, row-padded y, all-positive x (zero point at −128).
TEST_F(W8A8GemmGpu, EpilogueAndTypes) {
  for (const DType t : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kInt8})
    for (const int64_t block : {int64_t{0}, int64_t{128}}) {
      Case c;
      c.m = 45;
      c.n = 200;
      c.k = 512;
      c.block = block;
      c.y_dtype = t;
      c.bias = true;
      c.clamp = t != DType::kFP32;
      c.positive_x = true;
      c.asym_w = true;
      c.ldy_pad = 8;
      check_case(c);
    }
}

// Small M over a long K: the split-K configurations and their reduction (int32 partials for one block per row).
TEST_F(W8A8GemmGpu, SplitK) {
  for (const int64_t block : {int64_t{0}, int64_t{64}, int64_t{128}})
    for (const int64_t m : {1, 16}) {
      Case c;
      c.m = m;
      c.n = 256;
      c.k = 8192;
      c.block = block;
      c.asym_a = true;
      c.asym_w = m == 16;
      const w8a8::Shape s{m, c.n, c.k, block == 0 ? c.k : block, 132};
      SCOPED_TRACE("splits " + std::to_string(w8a8::select_config(s).splits));
      check_case(c);
    }
}

// Sums planes the call does not need, given anyway and all NaN, are never read: one block per row (the per-row
// epilogue, unsplit at K 512 (asserted) and split at K 8192) and block-wise, every zero-point combination that
// leaves one unused. The unsplit per-row epilogue read them (NaN · a zero point of 0 reached y).
TEST_F(W8A8GemmGpu, UnusedSumsAreNotRead) {
  for (const int64_t block : {int64_t{0}, int64_t{128}})
    for (const int64_t k : {int64_t{512}, int64_t{8192}})
      for (const int64_t m : {1, 16, 200})
        for (const int zp : {0, 1, 2}) {
          Case c;
          c.m = m;
          c.n = 256;
          c.k = k;
          c.block = block;
          c.asym_a = zp & 1;
          c.asym_w = zp & 2;
          c.unused_sums_nan = true;
          if (block == 0 && k == 512) {
            int sms = 0;
            TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, test::current_device()));
            const w8a8::Shape s{m, c.n, c.k, c.k, sms};
            EXPECT_EQ(w8a8::select_config(s).splits, 1) << "M " << m;
          }
          check_case(c);
        }
}

// A larger layer (64-token tiles).
TEST_F(W8A8GemmGpu, LargeLayer) {
  for (const int64_t block : {int64_t{0}, int64_t{128}}) {
    Case c;
    c.m = 700;
    c.n = 1024;
    c.k = 1024;
    c.block = block;
    check_case(c);
  }
}

// Several waves of 128-token tiles with tails in M and N (N 4200: a partial 128-row tile, 8-output stores throughout).
TEST_F(W8A8GemmGpu, ManyTiles) {
  for (const int64_t n : {int64_t{4200}, int64_t{4224}}) {
    Case c;
    c.m = 1100;
    c.n = n;
    c.k = 256;
    c.block = 0;
    c.asym_w = n == 4200;
    c.bias = true;
    check_case(c);
  }
}

// Each token tile select_config picks on the reference GPU (132 SMs): 32 rows with 8 splits (block-wise and per row),
// 256 rows, 128 rows block-wise (the most registers), 64 block-wise; every promotion variant (zA, zB, both, neither);
// a per-row K that is not a multiple of 128 with both zero points (the K·zA·zB term uses the real K).
// Block-wise promotion with extreme zero points on both operands: codes near −128 against zA = 127 and near 127
// against zB = −128, scales 1, two blocks of 128. Each block's D = Σ (Aq − zA)(Bq − zB) is an odd or even integer near
// −7.4e6 and y = D1 + D2 stays below 2^24 in magnitude, so fp32 holds it exactly and y must equal it exactly. (Adding
// the zero-point corrections to the −1.5·2^23 magic constant before the accumulator took partial sums past 2^24,
// where fp32 integers are even only: odd D came out one off.)
TEST_F(W8A8GemmGpu, ExtremeZeroPointsGiveExactIntegers) {
  Case c;
  c.m = 40;
  c.n = 128;
  c.k = 256;
  c.block = 128;
  c.asym_a = c.asym_w = true;
  c.y_dtype = DType::kFP32;
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
  Host h = make_host(c, seed);
  std::mt19937_64 rng(seed ^ 0x5EEDull);
  for (int8_t& q : h.a.codes) q = static_cast<int8_t>(-128 + static_cast<int>(rng() % 29));
  for (int8_t& q : h.w.codes) q = static_cast<int8_t>(127 - static_cast<int>(rng() % 29));
  std::fill(h.a.scale.begin(), h.a.scale.end(), 1.0f);
  std::fill(h.w.scale.begin(), h.w.scale.end(), 1.0f);
  std::fill(h.a.zero.begin(), h.a.zero.end(), 127);
  std::fill(h.w.zero.begin(), h.w.zero.end(), -128);
  Problem p(c, std::move(h));
  const std::vector<uint8_t> y = p.run(nullptr);
  int64_t wrong = 0;
  for (int64_t m = 0; m < c.m; ++m)
    for (int64_t n = 0; n < c.n; ++n) {
      int64_t d = 0;
      for (int64_t j = 0; j < c.k; ++j)
        d += (int64_t{p.h.a.codes[m * c.k + j]} - 127) * (int64_t{p.h.w.codes[n * c.k + j]} + 128);
      ASSERT_LT(std::llabs(d), int64_t{1} << 24);
      const double got = y_value(c.y_dtype, y, static_cast<std::size_t>(m * c.n + n));
      if (got != static_cast<double>(d) && wrong++ < 5)
        ADD_FAILURE() << "y[" << m << ", " << n << "] = " << got << ", exactly " << d;
    }
  EXPECT_EQ(wrong, 0);
}

TEST_F(W8A8GemmGpu, EveryTokenTile) {
  struct Shape {
    int64_t m, n, k, block;
    bool za, zb;
    int bn, splits;
  };
  const Shape shapes[] = {{300, 128, 4096, 32, true, true, 32, 8},    {300, 128, 4096, 64, false, true, 32, 8},
                          {300, 128, 4096, 128, true, false, 32, 8},  {300, 128, 4096, 0, true, true, 32, 8},
                          {3392, 640, 128, 0, true, false, 256, 1},   {1216, 896, 256, 32, true, true, 128, 1},
                          {1216, 896, 256, 32, false, false, 128, 1}, {700, 1024, 1024, 128, false, true, 64, 1},
                          {50, 200, 400, 0, true, true, 8, 1}};
  int sms = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, test::current_device()));
  for (const Shape& sh : shapes) {
    Case c;
    c.m = sh.m;
    c.n = sh.n;
    c.k = sh.k;
    c.block = sh.block;
    c.asym_a = sh.za;
    c.asym_w = sh.zb;
    const w8a8::Config cfg = w8a8::select_config(w8a8::Shape{c.m, c.n, c.k, sh.block == 0 ? c.k : sh.block, sms});
    SCOPED_TRACE("bn " + std::to_string(cfg.bn) + " splits " + std::to_string(cfg.splits));
    if (sms == 132) {
      EXPECT_EQ(cfg.bn, sh.bn);
      EXPECT_EQ(cfg.splits, sh.splits);
    }
    check_case(c);
  }
}

TEST_F(W8A8GemmGpu, CudaGraphReplay) {
  test::Stream stream;
  Case c;
  c.m = 40;
  c.n = 384;
  c.k = 2048;
  c.block = 64;
  c.asym_w = true;
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
  Problem r(c, seed);
  r.y.poison();
  const test::CapturedGraph graph(stream.get(), [&] { r.launch(stream.get()); });
  for (int replay = 0; replay < 2; ++replay) {
    r.y.poison();
    graph.replay(stream.get());
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    expect_matches(r, r.y.download());
  }
}

TEST_F(W8A8GemmGpu, Deterministic) {
  for (const int64_t block : {int64_t{0}, int64_t{32}}) {
    Case c;
    c.m = 3;
    c.n = 256;
    c.k = 4096;
    c.block = block;
    c.asym_w = true;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    Problem r(c, seed);
    const std::vector<uint8_t> y0 = r.run(nullptr), y1 = r.run(nullptr);
    EXPECT_EQ(y0, y1);
  }
}

// Argument errors are raised before anything is launched and leave y untouched.
TEST_F(W8A8GemmGpu, BadArgumentsWriteNothing) {
  Case c;
  c.m = 8;
  c.n = 128;
  c.k = 256;
  c.asym_w = true;
  const uint64_t seed = test::fresh_seed();
  Problem r(c, seed);
  r.y.poison();
  Int8BlockTensor a = r.av;
  a.sums = TensorView{};  // the weight has zero points: ΣAq is required
  EXPECT_THROW(gemm_w8a8(a, r.wv, r.yv, r.epi, Workspace{r.ws.get(), r.ws.size()}, nullptr), Error);
  Int8BlockTensor w = r.wv;
  w.block = 64;
  EXPECT_THROW(gemm_w8a8(r.av, w, r.yv, r.epi, Workspace{r.ws.get(), r.ws.size()}, nullptr), Error);
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  for (const uint8_t b : r.y.download()) ASSERT_EQ(b, 0xFF);
}

}  // namespace
}  // namespace tessera::linear
