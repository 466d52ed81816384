#include "reference/moe_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "common/host_numeric.h"
#include "reference/format.h"
#include "tessera/error.h"

namespace tessera::reference {

namespace {

using detail::fmt;
using detail::hex16;
using detail::hex8;

// Collects failures while a check scans everything: keeps the first message and counts the rest.
class Failures {
 public:
  explicit Failures(const char* what_counted) : what_(what_counted) {}

  // Records one failure; `msg` is built only for the first one.
  template <typename MakeMsg>
  void add(MakeMsg&& make_msg) {
    if (count_++ == 0) first_ = make_msg();
  }
  int64_t count() const { return count_; }

  CheckResult result(const std::string& summary, double error, int64_t compared) const {
    CheckResult r;
    r.error = error;
    r.compared = compared;
    r.ok = count_ == 0;
    if (r.ok) {
      r.message = summary;
    } else {
      std::ostringstream s;
      s << first_ << " [" << count_ << " bad " << what_ << " in total; " << summary << "]";
      r.message = s.str();
    }
    return r;
  }

 private:
  const char* what_;
  int64_t count_ = 0;
  std::string first_;
};

void require(bool cond, const char* fn, const std::string& what) {
  if (!cond) throw Error(std::string("tessera::reference::") + fn + ": " + what);
}

double x_value(uint16_t bits, DType dtype) {
  return dtype == DType::kBF16 ? host::bf16_to_f32(bits) : host::fp16_to_f32(bits);
}

int64_t rows_to_check(const PermuteIndexRef& ref, int64_t num_rows) {
  const int64_t used = ref.offsets.empty() ? 0 : ref.offsets.back();
  return num_rows < 0 ? used : std::min(num_rows, used);
}

}  // namespace

// ------------------------------------------------------------------------------------------------------------
CheckResult check_fused_gate(const GateRef& ref, const float* weights, const int32_t* ids, int64_t num_tokens,
                             int num_experts, const moe::GateParams& p, double id_tie_eps, double weight_rtol) {
  const int E = num_experts, k = p.topk, s = p.num_shared_experts, width = k + s;
  require(static_cast<int64_t>(ref.ids.size()) == num_tokens * width &&
              static_cast<int64_t>(ref.scores.size()) == num_tokens * E &&
              static_cast<int64_t>(ref.tie_margin.size()) == num_tokens,
          "check_fused_gate", "reference sizes do not match num_tokens / num_experts / params");

  Failures fail("rows");
  int64_t compared = 0;
  double max_rel = 0.0;
  std::vector<double> expected(k);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* id = ids + t * width;
    const float* w = weights + t * width;
    const double* score = &ref.scores[t * E];
    const auto where = [&](int j) { return "row " + std::to_string(t) + " slot " + std::to_string(j); };

    // Routed ids: in range and distinct.
    bool ids_valid = true;
    for (int j = 0; j < k && ids_valid; ++j) {
      if (id[j] < 0 || id[j] >= E) {
        fail.add([&] { return where(j) + ": id " + std::to_string(id[j]) + " out of range [0, " + std::to_string(E) + ")"; });
        ids_valid = false;
      }
      for (int i = 0; i < j && ids_valid; ++i)
        if (id[i] == id[j]) {
          fail.add([&] { return where(j) + ": id " + std::to_string(id[j]) + " repeats slot " + std::to_string(i); });
          ids_valid = false;
        }
    }
    if (!ids_valid) continue;

    // Shared slots.
    bool shared_ok = true;
    for (int j = 0; j < s && shared_ok; ++j) {
      if (id[k + j] != E + j || !(w[k + j] == p.shared_expert_weight)) {
        fail.add([&] {
          return where(k + j) + " (shared): got id " + std::to_string(id[k + j]) + " weight " + fmt(w[k + j]) +
                 ", expected id " + std::to_string(E + j) + " weight " + fmt(p.shared_expert_weight);
        });
        shared_ok = false;
      }
    }
    if (!shared_ok) continue;

    // Ids against the reference where the decision is not within rounding.
    if (ref.tie_margin[t] >= id_tie_eps) {
      ++compared;
      const int32_t* rid = &ref.ids[t * width];
      int bad = -1;
      for (int j = 0; j < k && bad < 0; ++j)
        if (id[j] != rid[j]) bad = j;
      if (bad >= 0) {
        fail.add([&] {
          std::string got, exp;
          for (int j = 0; j < k; ++j) {
            got += (j ? "," : "") + std::to_string(id[j]);
            exp += (j ? "," : "") + std::to_string(rid[j]);
          }
          return where(bad) + ": ids [" + got + "], expected [" + exp + "] (tie margin " + fmt(ref.tie_margin[t]) + ")";
        });
        continue;
      }
    }

    // Weights of the chosen ids.
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += score[id[j]];
    for (int j = 0; j < k; ++j) {
      double r = score[id[j]];
      if (p.renormalize) r /= sum;
      expected[j] = r * static_cast<double>(p.routed_scaling_factor);
    }
    for (int j = 0; j < k; ++j) {
      const double r = expected[j], g = w[j];
      bool bad;
      if (std::isnan(r)) {
        bad = !std::isnan(g);
      } else if (std::isnan(g)) {
        bad = true;
      } else {
        const double diff = std::fabs(g - r);
        // The tiny absolute floor only absorbs fp32 underflow of scores that are ~0 anyway.
        bad = !(diff <= weight_rtol * std::fabs(r) + 1e-30);
        if (r != 0.0) max_rel = std::max(max_rel, diff / std::fabs(r));
      }
      if (bad) {
        fail.add([&] {
          return where(j) + " (expert " + std::to_string(id[j]) + "): weight " + fmt(g) + ", expected " + fmt(r) +
                 " (rtol " + fmt(weight_rtol) + ")";
        });
        break;
      }
    }
  }
  const std::string summary = "ids compared on " + std::to_string(compared) + "/" + std::to_string(num_tokens) +
                              " rows (tie margin >= " + fmt(id_tie_eps) + "), max weight rel err " + fmt(max_rel);
  return fail.result(summary, max_rel, compared);
}

// ------------------------------------------------------------------------------------------------------------
CheckResult check_permute_index(const PermuteIndexRef& ref, const int32_t* offsets, const int32_t* counts,
                                const int32_t* row_index, const int32_t* row_token, int64_t num_tokens, int topk,
                                int num_experts) {
  const int E = num_experts;
  require(static_cast<int>(ref.offsets.size()) == E + 1 && static_cast<int>(ref.counts.size()) == E &&
              static_cast<int64_t>(ref.row_index.size()) == num_tokens * topk &&
              static_cast<int64_t>(ref.row_token.size()) == ref.offsets[E],
          "check_permute_index", "reference sizes do not match num_tokens / topk / num_experts");
  Failures fail("elements");
  int64_t checked = 0;
  const auto cmp = [&](const char* name, const int32_t* got, const std::vector<int32_t>& exp, auto&& label) {
    for (size_t i = 0; i < exp.size(); ++i, ++checked)
      if (got[i] != exp[i])
        fail.add([&] {
          return std::string(name) + label(static_cast<int64_t>(i)) + " = " + std::to_string(got[i]) + ", expected " +
                 std::to_string(exp[i]);
        });
  };
  const auto flat = [](int64_t i) { return "[" + std::to_string(i) + "]"; };
  cmp("expert_offsets", offsets, ref.offsets, flat);
  cmp("expert_counts", counts, ref.counts, flat);
  cmp("row_index", row_index, ref.row_index, [topk](int64_t i) {
    return "[t=" + std::to_string(i / topk) + ", j=" + std::to_string(i % topk) + "]";
  });
  if (row_token) cmp("row_token", row_token, ref.row_token, flat);
  const std::string summary = std::to_string(checked) + " index elements checked for equality" +
                              (row_token ? "" : " (row_token not given)");
  return fail.result(summary, static_cast<double>(fail.count()), checked);
}

// ------------------------------------------------------------------------------------------------------------
CheckResult check_permute_rows(const PermuteIndexRef& ref, const uint16_t* x, const uint16_t* x_perm,
                               int64_t num_tokens, int64_t hidden, int64_t num_rows) {
  const int64_t rows = rows_to_check(ref, num_rows);
  Failures fail("elements");
  int64_t checked = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t t = ref.row_token[r];
    require(t >= -1 && t < num_tokens, "check_permute_rows", "reference row_token out of range");
    const uint16_t* got = x_perm + r * hidden;
    const uint16_t* src = t >= 0 ? x + t * hidden : nullptr;
    for (int64_t h = 0; h < hidden; ++h, ++checked) {
      const bool bad = src ? got[h] != src[h] : (got[h] & 0x7FFF) != 0;
      if (bad)
        fail.add([&] {
          return "x_perm[" + std::to_string(r) + ", " + std::to_string(h) + "] = " + hex16(got[h]) +
                 (src ? ", expected x[" + std::to_string(t) + ", " + std::to_string(h) + "] = " + hex16(src[h])
                      : std::string(", expected 0 (pad row)"));
        });
    }
  }
  std::string summary = std::to_string(rows) + " rows checked bitwise";
  if (rows < (ref.offsets.empty() ? 0 : ref.offsets.back()))
    summary += " (first " + std::to_string(rows) + " of " + std::to_string(ref.offsets.back()) + " rows checked)";
  return fail.result(summary, static_cast<double>(fail.count()), checked);
}

// ------------------------------------------------------------------------------------------------------------
CheckResult check_permute_fp8(const PermuteIndexRef& ref, const uint16_t* x, DType x_dtype, const uint8_t* x_perm,
                              moe::PermuteQuant quant, const float* scales, int64_t scale_row_stride,
                              int64_t scale_block_stride, float input_scale, int64_t num_tokens, int64_t hidden,
                              int64_t num_rows) {
  const bool blockwise = quant == moe::PermuteQuant::kFP8Blockwise;
  require(blockwise || quant == moe::PermuteQuant::kFP8PerTensor, "check_permute_fp8", "quant must be an fp8 mode");
  require(x_dtype == DType::kBF16 || x_dtype == DType::kFP16, "check_permute_fp8", "x_dtype must be bf16 or fp16");
  require(!blockwise || scales != nullptr, "check_permute_fp8", "kFP8Blockwise needs scales");
  const int64_t rows = rows_to_check(ref, num_rows);
  const int64_t block = moe::kFP8BlockCols, num_blocks = (hidden + block - 1) / block;

  Failures fail("elements");
  int64_t checked = 0;
  double err2 = 0.0, ref2 = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t t = ref.row_token[r];
    require(t >= -1 && t < num_tokens, "check_permute_fp8", "reference row_token out of range");
    const uint8_t* q = x_perm + r * hidden;
    if (t < 0) {
      for (int64_t h = 0; h < hidden; ++h, ++checked)
        if ((q[h] & 0x7F) != 0)
          fail.add([&] {
            return "x_perm[" + std::to_string(r) + ", " + std::to_string(h) + "] = " + hex8(q[h]) +
                   ", expected 0 (pad row)";
          });
      continue;
    }
    const uint16_t* xr = x + t * hidden;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t h0 = b * block, h1 = std::min(hidden, h0 + block);
      double scale = input_scale;
      if (blockwise) {
        double amax = 0.0;
        for (int64_t h = h0; h < h1; ++h) {
          const double v = x_value(xr[h], x_dtype);
          if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
        }
        const double expected = fp8_block_scale(amax);
        scale = scales[r * scale_row_stride + b * scale_block_stride];
        ++checked;
        if (!(std::fabs(scale - expected) <= 1e-6 * expected)) {
          fail.add([&] {
            return "scales[row " + std::to_string(r) + ", block " + std::to_string(b) + "] = " + fmt(scale) +
                   ", expected " + fmt(expected) + " (amax " + fmt(amax) + " of x[" + std::to_string(t) + ", " +
                   std::to_string(h0) + ":" + std::to_string(h1) + "])";
          });
          continue;  // the elements of this block cannot be judged against a wrong scale
        }
      }
      for (int64_t h = h0; h < h1; ++h) {
        const double xv = x_value(xr[h], x_dtype);
        if (!std::isfinite(xv)) continue;
        ++checked;
        double v = xv / scale;
        if (!blockwise) v = std::clamp(v, -448.0, 448.0);
        const double qv = host::e4m3_to_f32(q[h]);
        const double tol = host::e4m3_half_ulp(v) * 1.001 + 1e-12;
        const double diff = std::fabs(qv - v);  // in units of the scale
        if (!(diff <= tol)) {
          fail.add([&] {
            return "x_perm[" + std::to_string(r) + ", " + std::to_string(h) + "] = " + hex8(q[h]) + " (" + fmt(qv) +
                   " * scale " + fmt(scale) + " = " + fmt(qv * scale) + "), x[" + std::to_string(t) + ", " +
                   std::to_string(h) + "] = " + fmt(xv) + " (x/scale " + fmt(v) + ", allowed error " + fmt(tol) +
                   ")";
          });
        } else {
          err2 += (qv - v) * (qv - v) * scale * scale;
          ref2 += v * v * scale * scale;
        }
      }
    }
  }
  const double rel = ref2 > 0.0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  std::string summary = std::to_string(rows) + " rows checked to half an e4m3 ulp, relative Frobenius error " + fmt(rel);
  if (rows < (ref.offsets.empty() ? 0 : ref.offsets.back()))
    summary += " (first " + std::to_string(rows) + " of " + std::to_string(ref.offsets.back()) + " rows checked)";
  return fail.result(summary, rel, checked);
}

// ------------------------------------------------------------------------------------------------------------
CheckResult check_close(const std::vector<double>& ref, const std::vector<double>& got, double rtol) {
  require(ref.size() == got.size(), "check_close",
          "sizes differ: ref " + std::to_string(ref.size()) + ", got " + std::to_string(got.size()));
  Failures nan_fail("NaN elements");
  double err2 = 0.0, ref2 = 0.0, worst = -1.0;
  int64_t worst_i = -1, checked = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i])) continue;
    ++checked;
    if (std::isnan(got[i])) {
      nan_fail.add([&] { return "element " + std::to_string(i) + " is NaN, expected " + fmt(ref[i]); });
      continue;
    }
    const double d = got[i] - ref[i];
    err2 += d * d;
    ref2 += ref[i] * ref[i];
    if (std::fabs(d) > worst) {
      worst = std::fabs(d);
      worst_i = static_cast<int64_t>(i);
    }
  }
  const double err = ref2 > 0.0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  std::string summary = std::string(ref2 > 0.0 ? "relative" : "absolute (reference all zero)") +
                        " Frobenius error " + fmt(err) + (err <= rtol ? " <= rtol " : " > rtol ") + fmt(rtol);
  if (worst_i >= 0)
    summary += "; largest |diff| " + fmt(worst) + " at element " + std::to_string(worst_i) + ": got " +
               fmt(got[worst_i]) + ", expected " + fmt(ref[worst_i]);
  CheckResult r = nan_fail.result(summary, err, checked);
  if (r.ok && !(err <= rtol)) {
    r.ok = false;
    r.message = summary;
  }
  return r;
}

}  // namespace tessera::reference
