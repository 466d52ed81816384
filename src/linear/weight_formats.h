// Internal (issue 18, step 1; docs/perf/linear.md): the canonical host form of a weight-only quantized matrix, and
// the importers of GPTQ / AWQ checkpoint tensors into it. The kernels' prepacked layout will be built from this form;
// the float64 reference (reference/linear_reference.h) defines its values.
#pragma once

#include "tessera/linear.h"

namespace tessera::linear::detail {

// The canonical form and the importers are public (tessera/linear.h); the names stay here for the library's code.
using ::tessera::linear::import_awq;
using ::tessera::linear::import_gptq;
using ::tessera::linear::QuantizedWeight;

}  // namespace tessera::linear::detail
