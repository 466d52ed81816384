// CPU references: the float64 dot product they share.
#pragma once

#include <cstdint>

namespace tessera::reference::detail {

// Σ term(i) for i in [0, n) over four interleaved partial sums (four independent chains: one accumulator makes the
// loop latency-bound), combined as (s0 + s1) + (s2 + s3): a fixed order, so a result never depends on the caller.
template <typename Term>
double chain_sum(int64_t n, Term term) {
  double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += term(i);
    s1 += term(i + 1);
    s2 += term(i + 2);
    s3 += term(i + 3);
  }
  for (; i < n; ++i) s0 += term(i);
  return (s0 + s1) + (s2 + s3);
}

// Σ a[i]·b[i] in chain_sum's order.
inline double dot(const double* a, const double* b, int64_t n) {
  return chain_sum(n, [&](int64_t i) { return a[i] * b[i]; });
}

}  // namespace tessera::reference::detail
