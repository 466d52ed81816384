// Shared by the prefill GPU tests: the comparison of o and lse with the float64 reference.
//
// Checked: relative Frobenius error of o over the rows with keys <= 5e-3 (bf16 rounding of P and of o alone is
// ~2e-3), no such row worse than 2e-2, lse within 1e-2 + 1e-3 |lse| (logits round with their magnitude: the
// quantized caches' keys enter the tensor cores as fp16, ~5e-4 relative, which reaches ~1e-2 at logits near 40),
// rows without keys exactly 0 with lse -inf, every output finite.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/host_numeric.h"
#include "reference/attention_reference.h"

namespace tessera::attention::prefilltest {

struct Check {
  bool ok = true;
  std::string message;  // the first failure
  double error = 0.0;   // relative Frobenius error of o over the rows with keys
  void fail(const std::string& m) {
    if (ok) message = m;
    ok = false;
  }
};

inline uint16_t round16(float x, bool fp16) { return fp16 ? host::f32_to_fp16(x) : host::f32_to_bf16(x); }
inline double widen16(uint16_t bits, bool fp16) { return fp16 ? host::fp16_to_f32(bits) : host::bf16_to_f32(bits); }

// o: 16-bit values, token t head h element d at t * o_token + h * o_head + d; lse at t * lse_token + h * lse_head.
inline Check compare_outputs(const std::vector<uint16_t>& o, int64_t o_token, int64_t o_head,
                             const std::vector<float>& lse, int64_t lse_token, int64_t lse_head,
                             const reference::PrefillRef& ref, int64_t total_q, int HQ, int D, bool fp16) {
  Check r;
  double err2 = 0.0, ref2 = 0.0;
  for (int64_t t = 0; t < total_q; ++t) {
    const bool empty = ref.end[t] <= ref.begin[t];
    for (int h = 0; h < HQ; ++h) {
      const int64_t row = t * HQ + h;
      const std::string where = "(token " + std::to_string(t) + ", head " + std::to_string(h) + ")";
      double row_err2 = 0.0, row_ref2 = 0.0;
      for (int d = 0; d < D; ++d) {
        const double got = widen16(o[t * o_token + h * o_head + d], fp16);
        const double want = ref.o[row * D + d];
        if (!std::isfinite(got)) {
          r.fail("o" + where + "[" + std::to_string(d) + "] is not finite");
          continue;
        }
        if (empty && got != 0.0) r.fail("o" + where + " has no keys but is not 0");
        row_err2 += (got - want) * (got - want);
        row_ref2 += want * want;
      }
      const float l = lse[t * lse_token + h * lse_head];
      if (empty) {
        if (!(std::isinf(l) && l < 0)) r.fail("lse" + where + " has no keys but is " + std::to_string(l));
        continue;
      }
      err2 += row_err2;
      ref2 += row_ref2;
      const double row_err = std::sqrt(row_err2 / std::max(row_ref2, 1e-30));
      if (row_err > 2e-2) r.fail("row " + where + " relative error " + std::to_string(row_err));
      if (!(std::fabs(l - ref.lse[row]) <= 1e-2 + 1e-3 * std::fabs(ref.lse[row])))
        r.fail("lse" + where + " = " + std::to_string(l) + ", expected " + std::to_string(ref.lse[row]));
    }
  }
  r.error = ref2 > 0.0 ? std::sqrt(err2 / ref2) : 0.0;
  if (r.error > 5e-3) r.fail("relative Frobenius error " + std::to_string(r.error) + " > 5e-3");
  return r;
}

}  // namespace tessera::attention::prefilltest
