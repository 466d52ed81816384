// The weight-only quantized linear layer on the GPU (tessera/linear.h) against the float64 reference
// (src/reference/linear_reference.h) over the weight as the kernel sees it: unpack(prepack(w)), i.e. the parameters
// rounded to the compute dtype.
//
// Every case: a float weight with rows of different distributions (Gaussian, heavy-tailed, skewed, uniform, all
// positive) and magnitudes, input channels 20x larger (three, one when K < 1024) and one output row 4x larger,
// quantized by quantize_weight (or, for kOffset, codes / scales / random offsets built by hand), prepacked, uploaded;
// x normal with a few larger columns, row padding of strided x filled with NaN (must not be read); y poisoned with
// 0xFF bytes (NaN) before the call, its row padding checked untouched after; the workspace poisoned (any contents).
// Clamp bounds are exact in y's dtype (a clamped element then carries no rounding).
//
// Tolerances. The kernel rounds each dequantized weight once to the compute dtype (linear/dequant.cuh; bf16 int8
// through fp32, whose offset − 32768·scale is itself rounded in fp32: about 2^-10 of a scale), fp32 x once to the
// compute dtype, accumulates in fp32 and rounds y to its dtype. With unit roundoff u (bf16 2^-8, fp16 2^-11) a
// rounding costs about u/sqrt(3) relative rms (bf16: ~2.3e-3 for weight plus output rounding); the checks are
//   ||y − ref||_F / ||x · wᵀ + bias||_F <= 5e-3 (bf16 compute: the number) or 2e-3 (fp16 compute), for
//       16-bit and fp32 x alike (fp32 x against the reference on x rounded to the compute dtype, as documented: a
//       stress run found M 1, N 136 fp32-x act-order draws at 5.4e-3 against the unrounded x); the denominator is the
//       product before the clamp (the clamp cannot add error, but a narrow one keeps mostly the elements whose sums
//       cancelled, and their error is relative to the terms);
//   every element |y − ref| <= 1.5 (u_c Σ|x|(|w| + scale) + u_x Σ|x||w| + K 2^-22 Σ|x||w|) + 1.01 u_y |ref|,
//       the worst case of those roundings (u_c: the weight's, u_x: x's, 0 for 16-bit x, u_y: y's; K 2^-22: fp32
//       accumulation, with margin), so that a wrong element cannot hide in a large norm.
// An emulation of that arithmetic over this file's cases (about 5000 draws) stayed below 0.73 of the Frobenius
// tolerance and 0.47 of the element bound.
//
// Large cases compare a subset of x's rows (every token-tile boundary, the last rows, random ones) to keep the
// O(M·N·K) reference cheap; every element of y is checked to be finite.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "linear/config.h"
#include "linear/problem.h"
#include "reference/linear_reference.h"
#include "reference/parallel.h"
#include "tessera/error.h"
#include "tessera/linear.h"

namespace tessera::linear {
namespace {

using test::DeviceBuffer;

enum class Clamp { kNone, kRelu, kRelu6, kRange };
const char* clamp_name(Clamp c) {
  switch (c) {
    case Clamp::kNone:
      return "";
    case Clamp::kRelu:
      return " relu";
    case Clamp::kRelu6:
      return " relu6";
    case Clamp::kRange:
      return " clamp[min,max]";
  }
  return "";
}

struct Case {
  int64_t m = 1, n = 40, k = 96;
  int bits = 4;
  int64_t block = 32;  // 0: one block per output channel (K)
  ZeroMode mode = ZeroMode::kZeroPoint;
  bool hand_built = false;  // kOffset: codes, scales and random offsets built directly (not quantize_weight)
  DType x_dtype = DType::kBF16;
  DType compute = DType::kBF16;  // x_dtype unless x is fp32
  bool bias = false;
  Clamp clamp = Clamp::kNone;
  bool act_order = false;
  int64_t x_pad = 0, y_pad = 0;  // extra elements per row, multiples of 8
  bool x_one_sign = false;       // x > 0 everywhere (activations after ReLU / SiLU-like gates are mostly positive)
  int64_t block_size() const { return block ? block : k; }
};

std::string describe(const Case& c) {
  std::string s = "M=" + std::to_string(c.m) + " N=" + std::to_string(c.n) + " K=" + std::to_string(c.k) + " int" +
                  std::to_string(c.bits) + " block=" + (c.block ? std::to_string(c.block) : "per-channel") + " " +
                  (c.mode == ZeroMode::kZeroPoint ? "zero-point"
                   : c.hand_built                 ? "offset(hand-built)"
                                                  : "offset") +
                  " x=" + dtype_name(c.x_dtype) + " compute=" + dtype_name(c.compute) + (c.bias ? " bias" : "") +
                  clamp_name(c.clamp) + (c.act_order ? " act-order" : "") + (c.x_one_sign ? " x>0" : "");
  if (c.x_pad || c.y_pad) s += " pad x/y=" + std::to_string(c.x_pad) + "/" + std::to_string(c.y_pad);
  return s;
}

// ---- host data -------------------------------------------------------------------------------------------------

uint16_t to_bits16(float v, DType dtype) { return dtype == DType::kBF16 ? host::f32_to_bf16(v) : host::f32_to_fp16(v); }
double from_bits16(uint16_t v, DType dtype) {
  return dtype == DType::kBF16 ? host::bf16_to_f32(v) : host::fp16_to_f32(v);
}
double round_to_dtype(float v, DType dtype) {
  return dtype == DType::kFP32 ? v : from_bits16(to_bits16(v, dtype), dtype);
}
double unit_roundoff(DType dtype) { return dtype == DType::kBF16 ? 0x1p-8 : dtype == DType::kFP16 ? 0x1p-11 : 0x1p-24; }

// v stored as `dtype` at `raw`; *exact gets the value stored.
void store(DType dtype, float v, uint8_t* raw, double* exact) {
  if (dtype == DType::kFP32) {
    std::memcpy(raw, &v, 4);
    *exact = v;
  } else {
    const uint16_t b = to_bits16(v, dtype);
    std::memcpy(raw, &b, 2);
    *exact = from_bits16(b, dtype);
  }
}

// W [N, K]: see the file comment. Values come from 4096-entry tables of the five distributions, picked by a
// splitmix64 stream (12 bits a pick), so that the 8-16M-element weights of the large shapes are quick to make.
std::vector<float> random_float_weight(std::mt19937_64& rng, int64_t n, int64_t k) {
  constexpr int kTable = 4096, kKinds = 5;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> table(kTable * kKinds);
  for (int i = 0; i < kTable; ++i) {
    table[0 * kTable + i] = normal(rng);                                 // Gaussian
    table[1 * kTable + i] = normal(rng) * std::exp(0.7f * normal(rng));  // heavy tails
    table[2 * kTable + i] = std::exp(0.8f * normal(rng)) - 1.0f;         // skewed
    table[3 * kTable + i] = 2.0f * unit(rng) - 1.0f;                     // uniform
    table[4 * kTable + i] = 1.0f + 0.5f * std::fabs(normal(rng));        // all positive, away from 0
  }
  uint64_t state = rng();
  std::vector<float> w(static_cast<size_t>(n * k));
  const float base = 1.0f / std::sqrt(static_cast<float>(k));
  for (int64_t r = 0; r < n; ++r) {
    const float row_scale = base * std::exp(3.0f * unit(rng) - 1.5f);
    const float* t = &table[(rng() % kKinds) * kTable];
    for (int64_t c = 0; c < k;) {
      uint64_t z = (state += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      for (int j = 0; j < 5 && c < k; ++j, ++c, z >>= 12) w[r * k + c] = t[z & (kTable - 1)] * row_scale;
    }
  }
  for (int i = 0; i < (k >= 1024 ? 3 : 1); ++i) {  // outlier input channels (one when K is small: it dominates)
    const int64_t c = static_cast<int64_t>(rng() % k);
    for (int64_t r = 0; r < n; ++r) w[r * k + c] *= 20.0f;
  }
  constexpr float kOutlierRow = 4.0f;
  const int64_t row = static_cast<int64_t>(rng() % n);  // an outlier output channel
  for (int64_t c = 0; c < k; ++c) w[row * k + c] *= kOutlierRow;
  return w;
}

// kOffset weight built directly: codes skewed toward 0 in some rows, uniform in others, the extremes present;
// scales log-uniform; random offsets (not a block's minimum as quantize_weight makes them).
QuantizedWeight hand_built_weight(std::mt19937_64& rng, int64_t n, int64_t k, int bits, int64_t block) {
  QuantizedWeight w;
  w.n = n;
  w.k = k;
  w.bits = bits;
  w.block = block;
  w.zero_mode = ZeroMode::kOffset;
  const int levels = (1 << bits) - 1;
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  w.codes.resize(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const double u = unit(rng);
      const double f = r % 3 == 0 ? u * u * u : u;
      w.codes[r * k + c] = static_cast<uint8_t>(std::min<int>(levels, static_cast<int>(f * (levels + 1))));
    }
  w.codes.front() = static_cast<uint8_t>(levels);
  w.codes.back() = 0;
  const int64_t blocks = k / block;
  w.scale.resize(static_cast<size_t>(n * blocks));
  w.offset.resize(w.scale.size());
  const double base = 2.0 / (levels * std::sqrt(static_cast<double>(k)));
  for (size_t i = 0; i < w.scale.size(); ++i) {
    w.scale[i] = static_cast<float>(base * std::exp(2.0 * unit(rng) - 1.0));
    // Around minus the mean code (1/4 of the range for the cubed rows, 1/2 for the others), ± 30 % of the range:
    // weights of both signs, so that y is not one common mode (Σ x times the row's mean) whose cancellations would
    // make the relative error a ratio of two small sums.
    const double mean_code = (static_cast<int64_t>(i) / blocks) % 3 == 0 ? 0.25 : 0.5;
    w.offset[i] = static_cast<float>(-w.scale[i] * levels * (mean_code + 0.6 * unit(rng) - 0.3));
  }
  return w;
}

struct Host {
  Case c;
  PackedWeight packed;
  QuantizedWeight ref_w;          // unpack(packed): what the kernel computes with
  std::vector<uint8_t> x_raw;     // [M][ldx] of x's dtype, padding NaN
  std::vector<double> x;          // [M][K], the stored values
  std::vector<uint8_t> bias_raw;  // [N] of y's dtype
  std::vector<double> bias;
  float clamp_min = -INFINITY, clamp_max = INFINITY;
  int64_t ldx = 0, ldy = 0;
  size_t x_elem() const { return dtype_size(c.x_dtype); }
};

Host make_host(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Host h;
  h.c = c;
  const int64_t block = c.block_size();
  QuantizedWeight q;
  if (c.hand_built) {
    q = hand_built_weight(rng, c.n, c.k, c.bits, block);
  } else {
    const std::vector<float> w = random_float_weight(rng, c.n, c.k);
    q = quantize_weight(w.data(), c.n, c.k, c.bits, block, c.mode);
  }
  if (c.act_order) {  // GPTQ act-order: column j of the quantized weight is column k_perm[j] of W
    q.k_perm.resize(static_cast<size_t>(c.k));
    std::iota(q.k_perm.begin(), q.k_perm.end(), 0);
    std::shuffle(q.k_perm.begin(), q.k_perm.end(), rng);
  }
  h.packed = prepack(q, c.compute);
  h.ref_w = unpack(h.packed);

  h.ldx = c.k + c.x_pad;
  h.ldy = c.n + c.y_pad;
  const size_t es = h.x_elem();
  h.x_raw.assign(static_cast<size_t>(c.m * h.ldx) * es, 0);
  const float nan = NAN;
  double unused = 0;
  for (int64_t i = 0; i < c.m * h.ldx; ++i) store(c.x_dtype, nan, &h.x_raw[i * es], &unused);
  h.x.resize(static_cast<size_t>(c.m * c.k));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t j = 0; j < c.k; ++j) {
      float v = normal(rng) * (j % 37 == 5 ? 4.0f : 1.0f);
      if (c.x_one_sign) v = 0.25f + std::fabs(v);
      store(c.x_dtype, v, &h.x_raw[(r * h.ldx + j) * es], &h.x[r * c.k + j]);
    }
  if (c.bias) {
    h.bias_raw.resize(static_cast<size_t>(c.n) * es);
    h.bias.resize(static_cast<size_t>(c.n));
    for (int64_t j = 0; j < c.n; ++j) store(c.x_dtype, 0.7f * normal(rng), &h.bias_raw[j * es], &h.bias[j]);
  }
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  switch (c.clamp) {
    case Clamp::kNone:
      break;
    case Clamp::kRelu:
      h.clamp_min = 0.0f;
      break;
    case Clamp::kRelu6:
      h.clamp_min = 0.0f;
      h.clamp_max = 6.0f;
      break;
    case Clamp::kRange:  // bounds exact in y's dtype, so that clamped elements carry no rounding
      h.clamp_min = static_cast<float>(round_to_dtype(-0.25f - unit(rng), c.x_dtype));
      h.clamp_max = static_cast<float>(round_to_dtype(0.25f + 2.0f * unit(rng), c.x_dtype));
      break;
  }
  return h;
}

// ---- reference -------------------------------------------------------------------------------------------------

struct Expected {
  std::vector<int64_t> rows;  // rows of x compared
  std::vector<double> ref;    // [rows][N]
  double product_norm = 0;    // Frobenius norm of x · wᵀ + bias over the rows, before the clamp
  std::vector<double> bound;  // [rows][N], per element
};

// Rows compared: all, or when M·N·K is large, every token-tile boundary, the last rows and random ones.
std::vector<int64_t> rows_to_check(const Case& c, std::mt19937_64& rng) {
  const int64_t budget = int64_t{1} << 26;  // multiply-adds of the single-threaded reference
  const int64_t affordable = std::max<int64_t>(1, budget / (c.n * c.k));
  std::vector<int64_t> rows;
  if (c.m <= affordable) {
    rows.resize(static_cast<size_t>(c.m));
    std::iota(rows.begin(), rows.end(), 0);
    return rows;
  }
  for (int64_t r : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{15}, int64_t{16}, int64_t{31}, int64_t{32},
                    int64_t{63}, int64_t{64}, c.m - 2, c.m - 1})
    if (r >= 0 && r < c.m) rows.push_back(r);
  while (static_cast<int64_t>(rows.size()) < affordable) rows.push_back(static_cast<int64_t>(rng() % c.m));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

Expected expected_of(const Host& h, uint64_t seed) {
  const Case& c = h.c;
  std::mt19937_64 rng(seed ^ 0xC0FFEEull);
  Expected e;
  e.rows = rows_to_check(c, rng);
  const int64_t R = static_cast<int64_t>(e.rows.size()), N = c.n, K = c.k;
  std::vector<double> xs(static_cast<size_t>(R * K));
  for (int64_t i = 0; i < R; ++i) std::copy_n(&h.x[e.rows[i] * K], K, &xs[i * K]);
  // fp32 x is documented to be rounded once to the compute dtype: the reference takes x so rounded (the Frobenius
  // tolerance then covers the same roundings as for 16-bit x; y is fp32, one rounding fewer).
  if (c.x_dtype == DType::kFP32)
    for (double& v : xs) v = round_to_dtype(static_cast<float>(v), c.compute);
  // The reference on one thread while the others sum the magnitudes the bound needs.
  std::vector<double> acc;
  std::thread ref_thread([&] { acc = reference::linear_reference(xs, R, h.ref_w); });
  const std::vector<double> wd = reference::dequantize_weight(h.ref_w);
  const int64_t blocks = K / h.ref_w.block;
  std::vector<double> mag(static_cast<size_t>(R * N)), scl(static_cast<size_t>(R * N));  // Σ|x||w|, Σ|x|·scale
  const int threads = reference::detail::num_workers(0, static_cast<double>(R * N * K), R * N);
  reference::detail::parallel(threads, [&](int t) {
    std::vector<double> xa(static_cast<size_t>(K));
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t j = 0; j < K; ++j) xa[j] = std::fabs(xs[i * K + (h.ref_w.k_perm.empty() ? j : h.ref_w.k_perm[j])]);
      for (int64_t n = t; n < N; n += threads) {
        double s = 0, sc = 0;
        const double* wr = &wd[n * K];
        for (int64_t j = 0; j < K; ++j) {
          s += xa[j] * std::fabs(wr[j]);
          sc += xa[j] * std::fabs(static_cast<double>(h.ref_w.scale[n * blocks + j / h.ref_w.block]));
        }
        mag[i * N + n] = s;
        scl[i * N + n] = sc;
      }
    }
  });
  ref_thread.join();
  const double u_c = unit_roundoff(c.compute), u_y = unit_roundoff(c.x_dtype);
  const double u_x = c.x_dtype == DType::kFP32 ? u_c : 0.0;
  const double u_acc = static_cast<double>(K) * 0x1p-22;
  e.ref.resize(static_cast<size_t>(R * N));
  e.bound.resize(e.ref.size());
  for (int64_t i = 0; i < R * N; ++i) {
    const int64_t n = i % N;
    double v = acc[i] + (c.bias ? h.bias[n] : 0.0);
    e.product_norm += v * v;
    v = std::min<double>(std::max<double>(v, h.clamp_min), h.clamp_max);
    e.ref[i] = v;
    const double b = c.bias ? std::fabs(h.bias[n]) : 0.0;
    e.bound[i] =
        1.5 * (u_c * (mag[i] + scl[i]) + u_x * mag[i] + u_acc * mag[i] + 0x1p-22 * b) + 1.01 * u_y * std::fabs(v);
  }
  e.product_norm = std::sqrt(e.product_norm);
  return e;
}

double tolerance(DType compute) { return compute == DType::kBF16 ? 5e-3 : 2e-3; }

// ---- device side -----------------------------------------------------------------------------------------------

struct Device {
  DeviceBuffer<uint8_t> codes, x, y, bias, ws;
  DeviceBuffer<uint16_t> params;
  DeviceBuffer<int32_t> k_perm;
  LinearWeight w;
  TensorView xv, yv;
  LinearEpilogue epilogue;
  Workspace workspace;
  size_t y_bytes = 0;

  // Workspace sized by linear_workspace_bytes(ws_max_m) (the call's M when 0).
  explicit Device(const Host& h, int64_t ws_max_m = 0)
      : codes(h.packed.codes),
        x(h.x_raw),
        y(static_cast<size_t>(h.c.m * h.ldy) * h.x_elem()),
        bias(h.bias_raw),
        params(h.packed.params),
        k_perm(h.packed.k_perm) {
    const PackedWeight& p = h.packed;
    const int dev = test::current_device();
    w.codes = TensorView::contiguous(codes.get(), DType::kUInt8, {p.padded_n(), p.padded_k() * p.bits / 8}, dev);
    w.params = TensorView::contiguous(params.get(), p.compute_dtype, {p.padded_n(), p.num_blocks(), 2}, dev);
    if (!p.k_perm.empty()) w.k_perm = TensorView::contiguous(k_perm.get(), DType::kInt32, {p.k}, dev);
    w.n = p.n;
    w.k = p.k;
    w.bits = p.bits;
    w.block = p.block;
    w.zero_mode = p.zero_mode;
    xv = test::strided(x.get(), h.c.x_dtype, {h.c.m, h.c.k}, {h.ldx, 1});
    yv = test::strided(y.get(), h.c.x_dtype, {h.c.m, h.c.n}, {h.ldy, 1});
    y_bytes = y.size();
    if (h.c.bias) epilogue.bias = TensorView::contiguous(bias.get(), h.c.x_dtype, {h.c.n}, dev);
    epilogue.clamp_min = h.clamp_min;
    epilogue.clamp_max = h.clamp_max;
    const size_t bytes = linear_workspace_bytes(ws_max_m > 0 ? ws_max_m : h.c.m, w, h.c.x_dtype);
    if (bytes > 0) {
      ws = DeviceBuffer<uint8_t>(bytes);
      ws.poison();
      workspace = Workspace{ws.get(), bytes};
    }
  }
  void launch(cudaStream_t stream) const { linear(xv, w, yv, epilogue, workspace, stream); }
  // Poison y, run, wait, download y's bytes.
  std::vector<uint8_t> run(cudaStream_t stream) {
    y.poison();
    launch(stream);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    return y.download();
  }
};

double y_value(const Host& h, const std::vector<uint8_t>& y, int64_t r, int64_t n) {
  const size_t at = static_cast<size_t>(r * h.ldy + n) * h.x_elem();
  if (h.c.x_dtype == DType::kFP32) {
    float v;
    std::memcpy(&v, &y[at], 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, &y[at], 2);
  return from_bits16(b, h.c.x_dtype);
}

// Every element of y finite, y's row padding still poisoned, the compared rows within the tolerances.
void expect_matches(const Host& h, const Expected& e, const std::vector<uint8_t>& y, const std::string& what = "") {
  const Case& c = h.c;
  const size_t es = h.x_elem();
  ASSERT_EQ(y.size(), static_cast<size_t>(c.m * h.ldy) * es);
  int64_t not_finite = 0, pad_written = 0;
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t n = 0; n < c.n; ++n)
      if (!std::isfinite(y_value(h, y, r, n)) && not_finite++ < 3)
        ADD_FAILURE() << what << "y[" << r << ", " << n << "] = " << y_value(h, y, r, n);
    for (size_t b = static_cast<size_t>(r * h.ldy + c.n) * es; b < static_cast<size_t>((r + 1) * h.ldy) * es; ++b)
      pad_written += y[b] != 0xFF;
  }
  EXPECT_EQ(not_finite, 0) << what << "elements of y not finite (unwritten: still NaN poison)";
  EXPECT_EQ(pad_written, 0) << what << "bytes of y's row padding written";
  double err2 = 0, worst = 0;
  int64_t over = 0;
  const int64_t R = static_cast<int64_t>(e.rows.size());
  for (int64_t i = 0; i < R; ++i)
    for (int64_t n = 0; n < c.n; ++n) {
      const double want = e.ref[i * c.n + n], got = y_value(h, y, e.rows[i], n), d = std::fabs(got - want);
      if (!std::isfinite(got)) continue;  // counted above
      err2 += d * d;
      const double bound = e.bound[i * c.n + n];
      worst = std::max(worst, bound > 0 ? d / bound : (d > 0 ? INFINITY : 0.0));
      if (d > bound && over++ < 3)
        ADD_FAILURE() << what << "y[" << e.rows[i] << ", " << n << "] = " << got << ", reference " << want
                      << ", |error| " << d << " > bound " << bound;
    }
  EXPECT_EQ(over, 0) << what << "elements past their bound (worst error / bound " << worst << ")";
  const double rel = e.product_norm > 0 ? std::sqrt(err2) / e.product_norm : std::sqrt(err2);
  EXPECT_LE(rel, tolerance(c.compute)) << what << "relative Frobenius error over " << R << " rows";
}

// Generates, runs and checks one case on fresh data.
void check_case(const Case& c, cudaStream_t stream = nullptr) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
  const Host h = make_host(c, seed);
  Device d(h);
  const std::vector<uint8_t> y = d.run(stream);
  expect_matches(h, expected_of(h, seed), y);
}

class LinearGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

// ---- the grid --------------------------------------------------------------------------------------------------

struct Shape {
  int64_t n, k;
};

// x dtype and compute dtype: bf16, fp16, fp32 → bf16, fp32 → fp16.
void set_dtypes(Case& c, int which) {
  const DType x[4] = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP32};
  const DType compute[4] = {DType::kBF16, DType::kFP16, DType::kBF16, DType::kFP16};
  c.x_dtype = x[which % 4];
  c.compute = compute[which % 4];
}
// Weight format: 0 zero-point (quantize_weight), 1 offset (quantize_weight), 2 offset (hand-built).
void set_format(Case& c, int which) {
  c.mode = which % 3 == 0 ? ZeroMode::kZeroPoint : ZeroMode::kOffset;
  c.hand_built = which % 3 == 2;
}
// Block 32, 64, 128 or per-channel; one that does not divide K falls back to 32 or per-channel.
void set_block(Case& c, int which) {
  const int64_t blocks[4] = {32, 64, 128, 0};
  c.block = blocks[which % 4];
  if (c.block && c.k % c.block != 0) c.block = which % 2 ? 0 : 32;
  if (c.block && c.k % c.block != 0) c.block = 0;
}

// Every M of the grid on every shape, each case a different combination of the other parameters
// (bits × dtypes × format cycle together; blocks, bias, clamps, act-order and padding on cycles of other lengths).
std::vector<Case> shape_grid_cases() {
  const int64_t ms[] = {1, 2, 3, 5, 8, 13, 16, 17, 33, 64, 100, 257};
  const Shape shapes[] = {{4096, 4096}, {40, 96}, {4160, 2048}, {136, 4096}, {1000, 512}};
  std::vector<Case> cases;
  for (const Shape& s : shapes)
    for (int64_t m : ms) {
      if (s.n == 4096 && s.k == 4096 && m > 16) continue;
      const int i = static_cast<int>(cases.size());
      Case c;
      c.m = m;
      c.n = s.n;
      c.k = s.k;
      set_dtypes(c, i % 4);
      c.bits = (i / 4) % 2 ? 8 : 4;
      set_format(c, i % 3);
      set_block(c, (i / 8) % 4);
      c.bias = (i % 5) % 2 == 1;
      c.clamp = static_cast<Clamp>((i % 7) % 4);
      c.act_order = i % 11 < 4;
      if (i % 13 % 3 == 1) {
        c.x_pad = 8 * (1 + i % 2);
        c.y_pad = 8 * (1 + i % 3);
      }
      cases.push_back(c);
    }
  return cases;
}

// Every weight format with every dtype pair, at a split-K size (M 3, N 136: two row tiles over K 4096), a small
// GEMM-like one (M 40, N 40: a half-filled last stripe) and N not a multiple of 8 (docs/ops/linear.md: N any).
std::vector<Case> every_format_cases() {
  struct Small {
    int64_t m, n, k;
  };
  std::vector<Case> cases;
  for (const Small& s : {Small{3, 136, 4096}, Small{40, 40, 512}, Small{7, 37, 256}})
    for (int bits : {4, 8})
      for (int block = 0; block < 4; ++block)
        for (int format = 0; format < 3; ++format)
          for (int dtypes = 0; dtypes < 4; ++dtypes) {
            Case c;
            c.m = s.m;
            c.n = s.n;
            c.k = s.k;
            c.bits = bits;
            set_block(c, block);
            set_format(c, format);
            set_dtypes(c, dtypes);
            c.bias = (block + format) % 2 == 0;
            cases.push_back(c);
          }
  return cases;
}

// Act-order (GPTQ desc_act): the quantized weight's columns are a random permutation of W's, x's columns are taken
// through k_perm by the op. 16-bit and fp32 x (both prepare x), both bit widths, a split-K and a GEMM-like shape.
std::vector<Case> act_order_cases() {
  std::vector<Case> cases;
  for (int dtypes = 0; dtypes < 4; ++dtypes)
    for (int bits : {4, 8})
      for (const Shape& s : {Shape{136, 4096}, Shape{1000, 512}})
        for (int64_t m : {int64_t{1}, int64_t{17}, int64_t{64}}) {
          Case c;
          c.m = m;
          c.n = s.n;
          c.k = s.k;
          c.bits = bits;
          c.block = 128;
          c.mode = ZeroMode::kZeroPoint;
          set_dtypes(c, dtypes);
          c.act_order = true;
          c.bias = m == 17;
          cases.push_back(c);
        }
  return cases;
}

// Each clamp on values that reach it (y's spread is several units), with and without bias.
std::vector<Case> bias_and_clamp_cases() {
  std::vector<Case> cases;
  for (Clamp clamp : {Clamp::kNone, Clamp::kRelu, Clamp::kRelu6, Clamp::kRange})
    for (bool bias : {false, true})
      for (int dtypes = 0; dtypes < 4; ++dtypes) {
        Case c;
        c.m = 33;
        c.n = 136;
        c.k = 512;
        c.bits = 4;
        c.block = 64;
        c.mode = ZeroMode::kOffset;
        c.bias = bias;
        c.clamp = clamp;
        set_dtypes(c, dtypes);
        cases.push_back(c);
      }
  return cases;
}

// x of one sign over long parameter blocks (per output channel, K 16384, and 128): Σ x grows with K, so any
// accumulation that carries the codes' magic offset (magic·Σx) across a whole block loses the product's low bits.
std::vector<Case> one_sign_x_cases() {
  std::vector<Case> cases;
  for (int64_t block : {int64_t{0}, int64_t{128}})
    for (int bits : {4, 8})
      for (int dtypes = 0; dtypes < 4; ++dtypes)
        for (int64_t m : {int64_t{1}, int64_t{16}, int64_t{40}}) {
          Case c;
          c.m = m;
          c.n = 136;
          c.k = 16384;
          c.bits = bits;
          c.block = block;
          set_format(c, dtypes + static_cast<int>(m));
          set_dtypes(c, dtypes);
          c.x_one_sign = true;
          cases.push_back(c);
        }
  return cases;
}

TEST_F(LinearGpu, OneSignXOverLongBlocks) {
  for (const Case& c : one_sign_x_cases()) check_case(c);
}

TEST_F(LinearGpu, ShapeGrid) {
  for (const Case& c : shape_grid_cases()) check_case(c);
}

TEST_F(LinearGpu, EveryFormatAndDtype) {
  for (const Case& c : every_format_cases()) check_case(c);
}

TEST_F(LinearGpu, ActOrder) {
  for (const Case& c : act_order_cases()) check_case(c);
}

TEST_F(LinearGpu, BiasAndClamps) {
  for (const Case& c : bias_and_clamp_cases()) check_case(c);
}

// ---- workspace -------------------------------------------------------------------------------------------------

// linear_workspace_bytes(max_m) covers what every call with M <= max_m needs (the configuration changes with M; a
// graph replays with fewer rows), and calls with fewer rows run correctly in that workspace.
TEST_F(LinearGpu, WorkspaceForMaxMServesEverySmallerM) {
  int sms = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, test::current_device()));
  const Shape shapes[] = {{136, 4096}, {96, 14336}, {4096, 4096}, {40, 96}, {1000, 512}, {4160, 2048}};
  const int64_t max_ms[] = {1, 16, 100, 257, 300, 1000, 1300, 2048, 4096};
  for (const Shape& s : shapes)
    for (int bits : {4, 8})
      for (int64_t block : {int64_t{32}, s.k})
        for (DType x_dtype : {DType::kBF16, DType::kFP32}) {
          SCOPED_TRACE("N=" + std::to_string(s.n) + " K=" + std::to_string(s.k) + " int" + std::to_string(bits) +
                       " block=" + std::to_string(block) + " x=" + dtype_name(x_dtype));
          // A weight of this shape in device memory (contents irrelevant here).
          const int64_t np = (s.n + 15) / 16 * 16, kp = (s.k + tile_k(bits) - 1) / tile_k(bits) * tile_k(bits);
          const int64_t nb = block == s.k ? 1 : kp / block;
          DeviceBuffer<uint8_t> codes(static_cast<size_t>(np * kp * bits / 8));
          DeviceBuffer<uint16_t> params(static_cast<size_t>(np * nb * 2));
          LinearWeight w;
          const int dev = test::current_device();
          w.codes = TensorView::contiguous(codes.get(), DType::kUInt8, {np, kp * bits / 8}, dev);
          w.params = TensorView::contiguous(params.get(), DType::kBF16, {np, nb, 2}, dev);
          w.n = s.n;
          w.k = s.k;
          w.bits = bits;
          w.block = block;
          w.zero_mode = ZeroMode::kOffset;
          EXPECT_EQ(linear_workspace_bytes(0, w, x_dtype), 0u);
          detail::LinearShape shape;
          shape.n = s.n;
          shape.k = s.k;
          shape.bits = bits;
          shape.block = w.block;
          shape.num_sms = sms;
          size_t need = 0;  // the most any M so far needs
          int64_t need_m = 0;
          int64_t m = 0;
          for (int64_t max_m : max_ms) {
            for (++m; m <= max_m; ++m) {
              shape.m = m;
              const size_t bytes =
                  detail::call_workspace_bytes(shape, detail::select_config(shape), x_dtype == DType::kFP32);
              if (bytes > need) need = bytes, need_m = m;
            }
            m = max_m;
            EXPECT_GE(linear_workspace_bytes(max_m, w, x_dtype), need)
                << "linear_workspace_bytes(" << max_m << ") is less than M = " << need_m << " needs";
          }
        }
  // Calls with fewer rows in a workspace sized for 257.
  for (int64_t m : {int64_t{1}, int64_t{5}, int64_t{64}, int64_t{257}}) {
    Case c;
    c.m = m;
    c.n = 136;
    c.k = 4096;
    c.bits = 4;
    c.block = 128;
    c.x_dtype = DType::kFP32;
    c.compute = DType::kBF16;
    c.act_order = m == 5;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " workspace for M 257 " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h, 257);
    expect_matches(h, expected_of(h, seed), d.run(nullptr));
  }
}

// ---- graphs, determinism, M = 0 --------------------------------------------------------------------------------

TEST_F(LinearGpu, CudaGraphCapture) {
  test::Stream stream;
  Case split;  // few CTAs over a long K (split-K), fp32 x and act-order: x preparation, the product, the reduction
  split.m = 3;
  split.n = 136;
  split.k = 4096;
  split.bits = 4;
  split.block = 128;
  split.x_dtype = DType::kFP32;
  split.compute = DType::kBF16;
  split.act_order = true;
  split.bias = true;
  Case gemm;  // many rows, int8 fp16
  gemm.m = 100;
  gemm.n = 1000;
  gemm.k = 512;
  gemm.bits = 8;
  gemm.block = 64;
  gemm.mode = ZeroMode::kOffset;
  gemm.x_dtype = DType::kFP16;
  gemm.compute = DType::kFP16;
  gemm.clamp = Clamp::kRelu;
  for (const Case& c : {split, gemm}) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    Host h = make_host(c, seed);
    Device d(h);
    const test::CapturedGraph graph(stream.get(), [&] { d.launch(stream.get()); });
    for (int replay = 0; replay < 3; ++replay) {
      // New x (and bias) contents in the same buffers; the weight stays.
      const uint64_t data_seed = test::fresh_seed();
      SCOPED_TRACE("replay " + std::to_string(replay) + " " + test::seed_note(data_seed));
      const Host fresh = make_host(c, data_seed);
      h.x_raw = fresh.x_raw;
      h.x = fresh.x;
      h.bias_raw = fresh.bias_raw;
      h.bias = fresh.bias;
      d.x.upload(h.x_raw);
      if (c.bias) d.bias.upload(h.bias_raw);
      d.y.poison();
      graph.replay(stream.get());
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      expect_matches(h, expected_of(h, data_seed), d.y.download());
    }
  }
}

TEST_F(LinearGpu, Deterministic) {
  test::Stream stream;
  Case a;  // split-K
  a.m = 5;
  a.n = 136;
  a.k = 4096;
  a.bits = 4;
  a.block = 32;
  a.mode = ZeroMode::kOffset;
  a.hand_built = true;
  Case b;  // many rows, fp32 x
  b.m = 257;
  b.n = 1000;
  b.k = 512;
  b.bits = 8;
  b.block = 0;
  b.x_dtype = DType::kFP32;
  b.compute = DType::kFP16;
  b.bias = true;
  Case g;  // Llama-like, one token
  g.m = 1;
  g.n = 4096;
  g.k = 4096;
  g.bits = 4;
  g.block = 128;
  for (const Case& c : {a, b, g}) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    const std::vector<uint8_t> first = d.run(stream.get());
    expect_matches(h, expected_of(h, seed), first);
    for (int again = 0; again < 2; ++again) {
      const std::vector<uint8_t> y = d.run(stream.get());
      ASSERT_EQ(y.size(), first.size());
      EXPECT_EQ(0, std::memcmp(y.data(), first.data(), y.size())) << "run " << again + 2;
    }
  }
}

// M = 0: accepted, nothing launched (a capture records no node), y untouched.
TEST_F(LinearGpu, EmptyXLaunchesNothing) {
  test::Stream stream;
  for (DType x_dtype : {DType::kBF16, DType::kFP32}) {
    Case c;
    c.m = 1;
    c.n = 136;
    c.k = 4096;
    c.x_dtype = x_dtype;
    c.act_order = true;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    d.y.poison();
    const TensorView x0 = test::strided(d.x.get(), x_dtype, {0, c.k}, {c.k, 1});
    const TensorView y0 = test::strided(d.y.get(), x_dtype, {0, c.n}, {c.n, 1});
    EXPECT_EQ(linear_workspace_bytes(0, d.w, x_dtype), 0u);
    const std::size_t nodes = test::captured_node_count(stream.get(), [&] {
      try {
        linear(x0, d.w, y0, d.epilogue, Workspace{}, stream.get());
      } catch (const Error& e) {
        ADD_FAILURE() << "M = 0 rejected: " << e.what();
      }
    });
    EXPECT_EQ(nodes, 0u) << "M = 0 launched work";
    EXPECT_NO_THROW(linear(x0, d.w, y0, d.epilogue, Workspace{}, stream.get()));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    for (uint8_t b : d.y.download()) ASSERT_EQ(b, 0xFF);
  }
}

// ---- alignment ----------------------------------------------------------------------------------------------------

// The smallest alignments docs/ops/linear.md allows: 16-bit x at a 16-byte (not 128 or 256) offset with a row stride
// of K + 8, codes and parameters 16-byte aligned, y and bias 4 bytes off any larger alignment with y's row
// stride N + 8.
TEST_F(LinearGpu, DocumentedSmallestAlignmentsRun) {
  for (int bits : {4, 8})
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      Case c;
      c.m = 17;
      c.n = 136;
      c.k = 512;
      c.bits = bits;
      c.block = bits == 4 ? 32 : 64;
      c.x_dtype = dtype;
      c.compute = dtype;
      c.bias = true;
      c.x_pad = 8;
      c.y_pad = 8;
      const uint64_t seed = test::fresh_seed();
      SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
      const Host h = make_host(c, seed);
      Device d(h);  // aligned copies; the views below point at offset ones
      const auto offset_copy = [](const void* src, size_t bytes, size_t offset, DeviceBuffer<uint8_t>& buf) {
        buf = DeviceBuffer<uint8_t>(bytes + 256);
        TESSERA_CUDA_CHECK(cudaMemcpy(buf.get() + offset, src, bytes, cudaMemcpyHostToDevice));
        TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
        return static_cast<void*>(buf.get() + offset);
      };
      DeviceBuffer<uint8_t> x_buf, codes_buf, params_buf, bias_buf, y_buf;
      LinearWeight w = d.w;
      w.codes.data = offset_copy(h.packed.codes.data(), h.packed.codes.size(), 16, codes_buf);
      w.params.data = offset_copy(h.packed.params.data(), h.packed.params.size() * 2, 16, params_buf);
      const TensorView x =
          test::strided(offset_copy(h.x_raw.data(), h.x_raw.size(), 16, x_buf), dtype, {c.m, c.k}, {h.ldx, 1});
      LinearEpilogue ep = d.epilogue;
      ep.bias.data = offset_copy(h.bias_raw.data(), h.bias_raw.size(), 4, bias_buf);
      y_buf = DeviceBuffer<uint8_t>(d.y_bytes + 256);
      y_buf.poison();
      const TensorView y = test::strided(y_buf.get() + 4, dtype, {c.m, c.n}, {h.ldy, 1});
      linear(x, w, y, ep, d.workspace, nullptr);
      TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint8_t> all = y_buf.download();
      for (size_t b = 0; b < 4; ++b) EXPECT_EQ(all[b], 0xFF) << "byte " << b << " before y written";
      for (size_t b = 4 + d.y_bytes; b < all.size(); ++b) ASSERT_EQ(all[b], 0xFF) << "byte " << b << " after y written";
      expect_matches(h, expected_of(h, seed), std::vector<uint8_t>(all.begin() + 4, all.begin() + 4 + d.y_bytes));
    }
}

// ---- bad arguments ---------------------------------------------------------------------------------------------

// Each call breaks one rule: tessera::Error naming the argument ("tessera::linear::linear: '<arg>' ..."), thrown
// before anything is launched (y still poisoned).
TEST_F(LinearGpu, BadArgumentsNameTheArgumentAndLeaveYUntouched) {
  const int dev = test::current_device();
  for (DType x_dtype : {DType::kBF16, DType::kFP32}) {
    Case c;  // int4, N 40 (3 stripes, padded), K 96 (two int4 tiles, one padded block), block 32, bias
    c.m = 5;
    c.n = 40;
    c.k = 96;
    c.bits = 4;
    c.block = 32;
    c.x_dtype = x_dtype;
    c.compute = DType::kBF16;
    c.bias = true;
    c.act_order = true;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    // Spare device memory for the wrong-shaped stand-ins (every one fits).
    DeviceBuffer<uint8_t> spare(1 << 20);
    DeviceBuffer<uint8_t> x_big((static_cast<size_t>(c.m) * 512 + 64) * 4);
    std::vector<uint8_t> host_memory(1 << 16);
    void* host_ptr = host_memory.data() + (256 - reinterpret_cast<std::uintptr_t>(host_memory.data()) % 256) % 256;
    const DType y_dtype = x_dtype;
    struct Args {
      TensorView x, y;
      LinearWeight w;
      LinearEpilogue ep;
      Workspace ws;
    };
    const Args good{d.xv, d.yv, d.w, d.epilogue, d.workspace};
    const auto expect_rejected = [&](const std::string& what, const char* arg, const std::function<void(Args&)>& f) {
      SCOPED_TRACE(what);
      Args a = good;
      f(a);
      d.y.poison();
      try {
        linear(a.x, a.w, a.y, a.ep, a.ws, nullptr);
        ADD_FAILURE() << "accepted; expected an error naming '" << arg << "'";
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_EQ(msg.find("tessera::linear::linear: "), 0u) << msg;
        EXPECT_NE(msg.find(std::string("'") + arg + "'"), std::string::npos) << "expected '" << arg << "' in: " << msg;
      }
      TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
      int64_t touched = 0;
      for (uint8_t b : d.y.download()) touched += b != 0xFF;
      EXPECT_EQ(touched, 0) << "bytes of y written";
    };
    // The unmutated call runs.
    {
      d.y.poison();
      EXPECT_NO_THROW(linear(good.x, good.w, good.y, good.ep, good.ws, nullptr));
      TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
    }
    const int64_t M = c.m, N = c.n, K = c.k, np = 48, kp = 128;
    // x
    if (x_dtype == DType::kBF16)
      expect_rejected("x fp16, weight prepacked for bf16", "x", [&](Args& a) { a.x.dtype = DType::kFP16; });
    expect_rejected("x int8", "x", [&](Args& a) { a.x.dtype = DType::kInt8; });
    expect_rejected("x K + 8 columns", "x", [&](Args& a) {
      a.x = test::strided(x_big.get(), x_dtype, {M, K + 8}, {K + 8, 1});
    });
    expect_rejected("x K − 8 columns", "x", [&](Args& a) {
      a.x = test::strided(x_big.get(), x_dtype, {M, K - 8}, {K - 8, 1});
    });
    expect_rejected("x rank 3", "x", [&](Args& a) {
      a.x = test::strided(x_big.get(), x_dtype, {1, M, K}, {M * K, K, 1});
    });
    expect_rejected("x column stride 2", "x", [&](Args& a) {
      a.x = test::strided(x_big.get(), x_dtype, {M, K}, {2 * K, 2});
    });
    expect_rejected("x in host memory", "x", [&](Args& a) { a.x.data = host_ptr; });
    // w.codes: the unpacked [N, K] bytes, the unpadded packed shape, the wrong dtype, host memory.
    expect_rejected("codes unpacked [N, K] uint8", "w.codes", [&](Args& a) {
      a.w.codes = TensorView::contiguous(spare.get(), DType::kUInt8, {N, K}, dev);
    });
    expect_rejected("codes [N, K / 2] (not padded to the layout)", "w.codes", [&](Args& a) {
      a.w.codes = TensorView::contiguous(spare.get(), DType::kUInt8, {N, K / 2}, dev);
    });
    expect_rejected("codes int32", "w.codes", [&](Args& a) {
      a.w.codes = TensorView::contiguous(spare.get(), DType::kInt32, {np, kp / 8}, dev);
    });
    expect_rejected("codes rank 1", "w.codes", [&](Args& a) {
      a.w.codes = TensorView::contiguous(spare.get(), DType::kUInt8, {np * kp / 2}, dev);
    });
    expect_rejected("codes in host memory", "w.codes", [&](Args& a) { a.w.codes.data = host_ptr; });
    expect_rejected("codes 8-byte aligned only", "w.codes",
                    [&](Args& a) { a.w.codes.data = static_cast<uint8_t*>(spare.get()) + 8; });
    // w.params
    expect_rejected("params 8-byte aligned only (read by TMA: 16)", "w.params",
                    [&](Args& a) { a.w.params.data = static_cast<uint8_t*>(spare.get()) + 8; });
    expect_rejected("params fp32", "w.params", [&](Args& a) {
      a.w.params = TensorView::contiguous(spare.get(), DType::kFP32, {np, 4, 2}, dev);
    });
    expect_rejected("params [N, blocks, 2] (rows not padded)", "w.params", [&](Args& a) {
      a.w.params = TensorView::contiguous(spare.get(), DType::kBF16, {N, 4, 2}, dev);
    });
    expect_rejected("params [Np, K / block, 2] (no padded block)", "w.params", [&](Args& a) {
      a.w.params = TensorView::contiguous(spare.get(), DType::kBF16, {np, 3, 2}, dev);
    });
    expect_rejected("params [Np, blocks] (rank 2)", "w.params", [&](Args& a) {
      a.w.params = TensorView::contiguous(spare.get(), DType::kBF16, {np, 8}, dev);
    });
    // w.k_perm
    expect_rejected("k_perm K − 8", "w.k_perm",
                    [&](Args& a) { a.w.k_perm = TensorView::contiguous(spare.get(), DType::kInt32, {K - 8}, dev); });
    expect_rejected("k_perm int64", "w.k_perm",
                    [&](Args& a) { a.w.k_perm = TensorView::contiguous(spare.get(), DType::kInt64, {K}, dev); });
    // The weight's constants.
    expect_rejected("bits 5", "w.bits", [&](Args& a) { a.w.bits = 5; });
    expect_rejected("bits 8 (codes packed for 4)", "w.codes", [&](Args& a) { a.w.bits = 8; });
    expect_rejected("N 0", "w.n", [&](Args& a) { a.w.n = 0; });
    expect_rejected("N 48 (codes padded to 48 rows: accepted; y has 40 columns)", "y", [&](Args& a) { a.w.n = 48; });
    expect_rejected("K 100 (not a multiple of 8)", "w.k", [&](Args& a) { a.w.k = 100; });
    expect_rejected("block 48", "w.block", [&](Args& a) { a.w.block = 48; });
    expect_rejected("block 64 (does not divide K 96)", "w.block", [&](Args& a) { a.w.block = 64; });
    expect_rejected("block 0", "w.block", [&](Args& a) { a.w.block = 0; });
    expect_rejected("zero_mode 3", "w.zero_mode", [&](Args& a) { a.w.zero_mode = static_cast<ZeroMode>(3); });
    // y
    expect_rejected("y [M, N + 8]", "y", [&](Args& a) {
      a.y = test::strided(spare.get(), y_dtype, {M, N + 8}, {N + 8, 1});
    });
    expect_rejected("y [M + 1, N]", "y", [&](Args& a) {
      a.y = test::strided(spare.get(), y_dtype, {M + 1, N}, {N, 1});
    });
    expect_rejected("y of another dtype", "y",
                    [&](Args& a) { a.y.dtype = x_dtype == DType::kFP32 ? DType::kBF16 : DType::kFP32; });
    expect_rejected("y column stride 2", "y", [&](Args& a) {
      a.y = test::strided(spare.get(), y_dtype, {M, N}, {2 * N, 2});
    });
    expect_rejected("y in host memory", "y", [&](Args& a) { a.y.data = host_ptr; });
    expect_rejected("y overlapping x", "y", [&](Args& a) { a.y = test::strided(d.x.get(), y_dtype, {M, N}, {N, 1}); });
    // epilogue
    expect_rejected("bias N − 8", "epilogue.bias",
                    [&](Args& a) { a.ep.bias = TensorView::contiguous(spare.get(), y_dtype, {N - 8}, dev); });
    expect_rejected("bias [1, N]", "epilogue.bias", [&](Args& a) {
      a.ep.bias = TensorView::contiguous(spare.get(), y_dtype, {1, N}, dev);
    });
    expect_rejected("bias of another dtype", "epilogue.bias", [&](Args& a) {
      a.ep.bias = TensorView::contiguous(spare.get(), x_dtype == DType::kFP32 ? DType::kBF16 : DType::kFP32, {N}, dev);
    });
    expect_rejected("clamp_min > clamp_max", "epilogue.clamp_min", [&](Args& a) {
      a.ep.clamp_min = 1.0f;
      a.ep.clamp_max = 0.5f;
    });
    expect_rejected("clamp_min NaN", "epilogue.clamp_min", [&](Args& a) { a.ep.clamp_min = NAN; });
    // workspace
    // What this call needs (linear_workspace_bytes(M) may be more: it covers every M up to M).
    int sms = 0;
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    detail::LinearShape shape;
    shape.m = M;
    shape.n = N;
    shape.k = K;
    shape.bits = c.bits;
    shape.block = c.block_size();
    shape.num_sms = sms;
    const size_t need = detail::call_workspace_bytes(shape, detail::select_config(shape), true);
    ASSERT_GT(need, 0u);
    ASSERT_GE(d.workspace.bytes, need);
    expect_rejected("workspace one byte short", "workspace", [&](Args& a) { a.ws.bytes = need - 1; });
    expect_rejected("workspace missing", "workspace", [&](Args& a) { a.ws = Workspace{}; });
    expect_rejected("workspace null with its size", "workspace", [&](Args& a) { a.ws.data = nullptr; });
    expect_rejected("workspace in host memory", "workspace", [&](Args& a) { a.ws.data = host_ptr; });
    // Written while x is read and y written: overlapping either is named (the second of the pair).
    // y and the workspace carved from one buffer of their own, so that y is the first argument the workspace meets.
    DeviceBuffer<uint8_t> y_and_ws(need + d.y_bytes + 256);
    expect_rejected("workspace overlapping y", "y", [&](Args& a) {
      a.y = test::strided(y_and_ws.get(), y_dtype, {M, N}, {N, 1});
      a.ws.data = y_and_ws.get();
    });
    expect_rejected("workspace overlapping x", "x", [&](Args& a) { a.ws.data = d.x.get(); });
  }
  // 16-byte alignment of 16-bit x the kernel reads directly (no act-order, 16-bit x): start and row stride.
  {
    Case c;
    c.m = 4;
    c.n = 40;
    c.k = 96;
    c.x_pad = 8;
    const Host h = make_host(c, test::fresh_seed());
    Device d(h);
    const auto rejected = [&](const TensorView& x, const char* what) {
      SCOPED_TRACE(what);
      d.y.poison();
      try {
        linear(x, d.w, d.yv, d.epilogue, d.workspace, nullptr);
        ADD_FAILURE() << "accepted";
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()).find("tessera::linear::linear: 'x'"), 0u) << e.what();
      }
      TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
      for (uint8_t b : d.y.download()) ASSERT_EQ(b, 0xFF);
    };
    rejected(test::strided(static_cast<uint16_t*>(static_cast<void*>(d.x.get())) + 1, DType::kBF16, {4, 96}, {104, 1}),
             "x start 2 bytes past 16-byte alignment");
    rejected(test::strided(d.x.get(), DType::kBF16, {4, 96}, {100, 1}), "x row stride 100 (200 bytes)");
  }
}

}  // namespace
}  // namespace tessera::linear
