// CPU float64 reference of the MoE layer (moe_layer_reference.h). One token at a time: each thread owns a contiguous
// run of tokens and computes every value of a token in the same fixed order, so results do not depend on the thread
// count. Per-thread scratch only (one token's activations and one copy's h and a); nothing is cached across tokens.
#include "reference/moe_layer_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "reference/dot.h"
#include "reference/moe_reference.h"
#include "reference/parallel.h"

namespace tessera::reference {

namespace {

constexpr int64_t kQuantBlock = moe::kFP8BlockCols;  // kFP8Blockwise activations: one scale per (row, 128 columns)
constexpr double kE4m3Max = 448.0;
constexpr double kBf16Max = 0x1.fep+127;  // the largest finite bf16, (2 - 2^-7) · 2^127

void require(bool cond, const std::string& what) {
  if (!cond) throw std::invalid_argument("tessera::reference::moe_layer: " + what);
}

void require_size(const std::vector<double>& v, const char* name, int64_t expected, const char* shape) {
  require(static_cast<int64_t>(v.size()) == expected, std::string("'") + name + "' must have " +
                                                          std::to_string(expected) + " elements " + shape + ", got " +
                                                          std::to_string(v.size()));
}

using detail::dot;

// Σ a[i]·b[i] and Σ |a[i]|·|b[i]| (a_abs holds |a|), each in chain_sum's order (reference/dot.h).
void dot_and_magnitude(const double* a, const double* a_abs, const double* b, int64_t n, double& sum, double& mag) {
  sum = detail::chain_sum(n, [&](int64_t i) { return a[i] * b[i]; });
  mag = detail::chain_sum(n, [&](int64_t i) { return a_abs[i] * std::fabs(b[i]); });
}

// Q1 / Q2 of moe_layer.h in place on one activation row of n values: the values the next GEMM reads.
// fp8 formats: code × scale; kBF16: rounded to bf16 where the row is not bf16 already (x is, silu·u is not).
void quantize_row(double* v, int64_t n, moe::WeightFormat format, double tensor_scale, bool round_to_bf16) {
  switch (format) {
    case moe::WeightFormat::kFP8Blockwise:
      for (int64_t b0 = 0; b0 < n; b0 += kQuantBlock) {
        const int64_t b1 = std::min(n, b0 + kQuantBlock);
        double amax = 0.0;
        for (int64_t i = b0; i < b1; ++i) amax = std::fmax(amax, std::fabs(v[i]));  // fmax skips NaN, as fmaxf does
        const double s = fp8_block_scale(amax);
        for (int64_t i = b0; i < b1; ++i) v[i] = round_e4m3(v[i] / s) * s;
      }
      break;
    case moe::WeightFormat::kFP8PerTensor:
      for (int64_t i = 0; i < n; ++i) v[i] = round_e4m3(v[i] / tensor_scale) * tensor_scale;
      break;
    case moe::WeightFormat::kBF16:
      if (round_to_bf16)
        for (int64_t i = 0; i < n; ++i) v[i] = round_bf16(v[i]);
      break;
  }
}

}  // namespace

double round_e4m3(double v) {
  if (std::isnan(v)) return v;
  const double a = std::fabs(v);
  // .satfinite: everything at or past the largest finite value (infinities included) becomes ±448.
  if (a >= kE4m3Max) return std::copysign(kE4m3Max, v);
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  // The spacing of e4m3 values at a: 3 fraction bits for normals (>= 2^-6), 2^-9 for subnormals. Scaling by a power
  // of two is exact, so nearbyint (round to nearest even) is the only rounding; a result of 2^e is still exact.
  const int quantum_exp = a < 0.015625 ? -9 : e - 1 - 3;
  const double q = std::ldexp(std::nearbyint(std::ldexp(a, -quantum_exp)), quantum_exp);
  return std::copysign(q, v);
}

// Rounded on the double directly: host::f32_to_bf16(float(v)) would round twice (to fp32, then to bf16), which is
// wrong for a double just past a bf16 tie whose excess fp32 cannot hold (1 + 2^-8 + 2^-30 must give 1 + 2^-7).
double round_bf16(double v) {
  if (!std::isfinite(v)) return v;
  const double a = std::fabs(v);
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  // 7 fraction bits; below fp32's smallest normal 2^-126 the spacing stays 2^-133 (bf16 subnormals).
  const int quantum_exp = std::max(e - 1, -126) - 7;
  double q = std::ldexp(std::nearbyint(std::ldexp(a, -quantum_exp)), quantum_exp);
  if (q > kBf16Max) q = std::numeric_limits<double>::infinity();  // past max + half an ulp (the tie included)
  return std::copysign(q, v);
}

MoeLayerRef moe_layer(const MoeLayerRefProblem& p, const MoeLayerRefInputs& in, MoeLayerRefMode mode, int num_threads) {
  const int64_t T = p.tokens, H = p.hidden, I = p.intermediate;
  const int G = p.num_experts, slots = p.slots;
  require(mode == MoeLayerRefMode::kModelStorage || mode == MoeLayerRefMode::kExact, "unknown mode");
  require(p.format == moe::WeightFormat::kFP8Blockwise || p.format == moe::WeightFormat::kFP8PerTensor ||
              p.format == moe::WeightFormat::kBF16,
          "unknown weight format");
  require(T >= 0, "tokens must be >= 0, got " + std::to_string(T));
  require(H > 0 && H % kQuantBlock == 0, "hidden must be a positive multiple of 128, got " + std::to_string(H));
  require(I > 0 && I % kQuantBlock == 0, "intermediate must be a positive multiple of 128, got " + std::to_string(I));
  require(G >= 1, "num_experts must be >= 1, got " + std::to_string(G));
  require(slots >= 0, "slots must be >= 0, got " + std::to_string(slots));
  require_size(in.x, "x", T * H, "[tokens, hidden]");
  require(static_cast<int64_t>(in.ids.size()) == T * slots, "'ids' must have " + std::to_string(T * slots) +
                                                                " elements [tokens, slots], got " +
                                                                std::to_string(in.ids.size()));
  require_size(in.weights, "weights", T * slots, "[tokens, slots]");
  require_size(in.w13, "w13", G * 2 * I * H, "[num_experts, 2 * intermediate, hidden]");
  require_size(in.w2, "w2", G * H * I, "[num_experts, hidden, intermediate]");
  require(in.residual.empty() || static_cast<int64_t>(in.residual.size()) == T * H,
          "'residual' must be empty or have " + std::to_string(T * H) + " elements [tokens, hidden], got " +
              std::to_string(in.residual.size()));
  require(in.h.empty() || static_cast<int64_t>(in.h.size()) == T * slots * 2 * I,
          "'h' must be empty or have " + std::to_string(T * slots * 2 * I) +
              " elements [tokens, slots, 2 * intermediate], got " + std::to_string(in.h.size()));
  require(in.h.empty() || mode == MoeLayerRefMode::kModelStorage, "'h' is only taken in kModelStorage mode");
  require(in.act.empty() || static_cast<int64_t>(in.act.size()) == T * slots * I,
          "'act' must be empty or have " + std::to_string(T * slots * I) +
              " elements [tokens, slots, intermediate], got " + std::to_string(in.act.size()));
  require(in.act.empty() || mode == MoeLayerRefMode::kModelStorage, "'act' is only taken in kModelStorage mode");
  require(in.act.empty() || !in.keep_h, "'keep_h' needs h, which is not computed where 'act' is given");
  require(in.act.empty() || in.h.empty(), "'h' and 'act' are not taken together ('act' replaces what h gives)");
  if (p.format == moe::WeightFormat::kFP8PerTensor)
    require(std::isfinite(in.a13_scale) && in.a13_scale > 0.0 && std::isfinite(in.a2_scale) && in.a2_scale > 0.0,
            "kFP8PerTensor needs positive finite a13_scale and a2_scale, got " + std::to_string(in.a13_scale) +
                " and " + std::to_string(in.a2_scale));

  MoeLayerRef r;
  r.y.assign(T * H, 0.0);
  r.mag.assign(T * H, 0.0);
  if (in.keep_h) r.h.assign(T * slots * 2 * I, 0.0);
  if (T == 0) return r;

  const bool model = mode == MoeLayerRefMode::kModelStorage;
  const double work = static_cast<double>(T) * std::max(slots, 1) * 3.0 * static_cast<double>(I) * H;
  const int threads = detail::num_workers(num_threads, work, T);
  detail::parallel(threads, [&](int w) {
    const int64_t t0 = T * w / threads, t1 = T * (w + 1) / threads;
    std::vector<double> xq(H), h(2 * I), a(I), a_abs(I);
    for (int64_t t = t0; t < t1; ++t) {
      double* y = &r.y[t * H];
      double* mag = &r.mag[t * H];
      // Q1 depends on the token only: once for all its copies (not at all where h is given).
      if (in.h.empty() && in.act.empty()) {
        std::copy(in.x.begin() + t * H, in.x.begin() + (t + 1) * H, xq.begin());
        if (model) quantize_row(xq.data(), H, p.format, in.a13_scale, /*round_to_bf16=*/false);
      }
      for (int j = 0; j < slots; ++j) {
        const int32_t e = in.ids[t * slots + j];
        if (e < 0 || e >= G) continue;  // a dropped copy
        const double weight = in.weights[t * slots + j];
        const double* w13 = &in.w13[static_cast<int64_t>(e) * 2 * I * H];
        if (!in.act.empty()) {  // the GPU's activation, as stored
          std::copy_n(in.act.begin() + (t * slots + j) * I, I, a.begin());
        } else {
          if (in.h.empty()) {
            for (int64_t row = 0; row < 2 * I; ++row) {
              const double v = dot(xq.data(), w13 + row * H, H);
              h[row] = model ? round_bf16(v) : v;
            }
          } else {
            std::copy_n(in.h.begin() + (t * slots + j) * 2 * I, 2 * I, h.begin());
          }
          if (in.keep_h) std::copy(h.begin(), h.end(), r.h.begin() + (t * slots + j) * 2 * I);
          for (int64_t i = 0; i < I; ++i) {
            const double g = h[i], u = h[I + i];
            a[i] = g / (1.0 + std::exp(-g)) * u;
          }
          if (model) quantize_row(a.data(), I, p.format, in.a2_scale, /*round_to_bf16=*/true);
        }
        for (int64_t i = 0; i < I; ++i) a_abs[i] = std::fabs(a[i]);
        const double* w2 = &in.w2[static_cast<int64_t>(e) * H * I];
        const double weight_abs = std::fabs(weight);
        for (int64_t n = 0; n < H; ++n) {
          double o, m;
          dot_and_magnitude(a.data(), a_abs.data(), w2 + n * I, I, o, m);
          if (model) o = round_bf16(o);
          y[n] += weight * o;
          mag[n] += weight_abs * m;
        }
      }
      if (!in.residual.empty())
        for (int64_t n = 0; n < H; ++n) y[n] += in.residual[t * H + n];
    }
  });
  return r;
}

}  // namespace tessera::reference
