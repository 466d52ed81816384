// CPU references: the float64 dot product they share.
#pragma once

#include <cstdint>

namespace tessera::reference::detail {

// Σ a[i]·b[i] over four interleaved partial sums (four independent chains: one accumulator makes the loop
// latency-bound), combined as (s0 + s1) + (s2 + s3): a fixed order, so a result never depends on the caller.
inline double dot(const double* a, const double* b, int64_t n) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

}  // namespace tessera::reference::detail
