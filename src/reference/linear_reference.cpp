#include "reference/linear_reference.h"

#include <cstddef>

namespace tessera::reference {

std::vector<double> dequantize_weight(const linear::detail::QuantizedWeight& w) {
  const int64_t blocks = w.k / w.block;
  std::vector<double> out(static_cast<std::size_t>(w.n * w.k));
  for (int64_t n = 0; n < w.n; ++n)
    for (int64_t j = 0; j < w.k; ++j) {
      const int64_t p = n * blocks + j / w.block;
      out[n * w.k + j] = static_cast<double>(w.codes[n * w.k + j]) * w.scale[p] + static_cast<double>(w.offset[p]);
    }
  return out;
}

std::vector<double> linear_reference(const std::vector<double>& x, int64_t m, const linear::detail::QuantizedWeight& w) {
  const std::vector<double> wd = dequantize_weight(w);
  std::vector<double> y(static_cast<std::size_t>(m * w.n), 0.0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t n = 0; n < w.n; ++n) {
      double acc = 0.0;
      for (int64_t j = 0; j < w.k; ++j) acc += x[r * w.k + (w.k_perm.empty() ? j : w.k_perm[j])] * wd[n * w.k + j];
      y[r * w.n + n] = acc;
    }
  return y;
}

}  // namespace tessera::reference
