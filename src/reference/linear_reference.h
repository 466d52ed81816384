// CPU float64 reference of the weight-only quantized linear layer (issue 18; docs/perf/linear.md): the values of the
// canonical quantized weight (linear/weight_formats.h) and y = x · wᵀ over them.
#pragma once

#include <cstdint>
#include <vector>

#include "linear/weight_formats.h"

namespace tessera::reference {

// w[n][j] = code · scale + offset in float64, [N][K] in the weight's column order (k_perm applied to x, not here).
std::vector<double> dequantize_weight(const linear::detail::QuantizedWeight& w);

// y[m][n] = Σ_j x[m][k_perm[j]] · w[n][j] (k_perm empty: the identity); x [M][K] in the original column order.
std::vector<double> linear_reference(const std::vector<double>& x, int64_t m, const linear::detail::QuantizedWeight& w);

}  // namespace tessera::reference
