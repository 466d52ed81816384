// Host side of the W8A8 weight: the per-(output channel, block) int8 quantizer, with the same fp32 steps as
// quantize_per_block (and tessera::reference::quantize_int8_blocks), and the block-major parameter planes the GEMM
// loads by TMA (tessera/w8a8.h).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/validate.h"
#include "linear/w8a8/check.h"
#include "tessera/w8a8.h"

namespace tessera::linear {
namespace {

using ::tessera::detail::ArgCheck;

// The result of one fp32 operation, stored before the next step reads it: the volatile store keeps the compiler from
// contracting a product and a following sum into one fma (-ffp-contract), which would round once where the device
// rounds twice.
float rounded(float v) {
  volatile float r = v;
  return r;
}

struct Params {
  float scale, inv, zero, y_min, y_max;
};

// lo = min(block ∪ {0}), hi = max(block ∪ {0}); the steps of quantize_per_block in its order.
Params block_params(float lo, float hi, bool symmetric) {
  Params p;
  float s = symmetric ? rounded(std::max(hi, -lo) / 127.0f) : rounded(rounded(hi - lo) / 255.0f);
  if (!(s > 0.0f)) s = 1.0f;
  p.scale = s;
  p.inv = rounded(1.0f / s);
  p.zero = 0.0f;
  float q_min = -127.0f;
  if (!symmetric) {
    // fmax / fmin as on the device: a NaN (0 · inf when 1 / s overflowed) takes the bound.
    p.zero = std::fmin(std::fmax(std::rint(rounded(-128.0f - rounded(lo * p.inv))), -128.0f), 127.0f);
    q_min = -128.0f;
  }
  // Clamping y to [qmin − z, 127 − z] before rint equals clamping rint(y) + z after it (integer bounds).
  p.y_min = q_min - p.zero;
  p.y_max = 127.0f - p.zero;
  return p;
}

}  // namespace

W8A8HostWeight prepack_w8a8(const float* w, int64_t n, int64_t k, int64_t block, bool symmetric) {
  const ArgCheck check("tessera::linear::prepack_w8a8");
  if (w == nullptr) check.fail("w", "is null");
  if (n <= 0) check.fail("n", "must be positive, got " + std::to_string(n));
  if (k <= 0 || k % 16 != 0 || k > (int64_t{1} << 30))
    check.fail("k", "must be a positive multiple of 16 up to 2^30, got " + std::to_string(k));
  w8a8::check_block(check, "block", block, k);
  // |Σ codes| <= 128 · block must be exact in the fp32 sums.
  if (block > (int64_t{1} << 17))
    check.fail("block", "must be at most 131072 (fp32 sums of codes exact), got " + std::to_string(block));
  for (int64_t i = 0; i < n * k; ++i)
    if (!std::isfinite(w[i]))
      check.fail("w", "must be finite, got " + std::to_string(w[i]) + " at [" + std::to_string(i / k) + ", " +
                          std::to_string(i % k) + "]");

  W8A8HostWeight q;
  q.n = n;
  q.k = k;
  q.block = block;
  q.ld = int8_block_param_ld(n);
  q.symmetric = symmetric;
  const int64_t blocks = k / block;
  const auto planes = static_cast<std::size_t>(blocks * q.ld);
  q.codes.resize(static_cast<std::size_t>(n * k));
  q.scale.assign(planes, 0.0f);
  if (!symmetric) q.zero.assign(planes, 0.0f);
  q.sums.assign(planes, 0.0f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = w + r * k + b * block;
      int8_t* codes = &q.codes[static_cast<std::size_t>(r * k + b * block)];
      float lo = 0.0f, hi = 0.0f;
      for (int64_t j = 0; j < block; ++j) lo = std::min(lo, v[j]), hi = std::max(hi, v[j]);
      const Params p = block_params(lo, hi, symmetric);
      const int zero = static_cast<int>(p.zero);
      int64_t sum = 0;
      for (int64_t j = 0; j < block; ++j) {
        const float y = std::fmin(std::fmax(rounded(v[j] * p.inv), p.y_min), p.y_max);
        const int code = static_cast<int>(std::rint(y)) + zero;
        codes[j] = static_cast<int8_t>(code);
        sum += code;
      }
      const auto at = static_cast<std::size_t>(b * q.ld + r);
      q.scale[at] = p.scale;
      if (!symmetric) q.zero[at] = p.zero;
      q.sums[at] = static_cast<float>(sum);
    }
  return q;
}

}  // namespace tessera::linear
