// Internal (issue 18, step 1; docs/perf/linear.md): the canonical host form of a weight-only quantized matrix, and
// the importers of GPTQ / AWQ checkpoint tensors into it. The kernels' prepacked layout will be built from this form;
// the float64 reference (reference/linear_reference.h) defines its values.
#pragma once

#include "tessera/linear.h"

namespace tessera::detail {
class ArgCheck;
}

namespace tessera::linear::detail {

// The format rules prepack and the op share: bits 4 or 8 ("w.bits"); block 32, 64, 128 or K, dividing K ("w.block").
void check_bits_and_block(const ::tessera::detail::ArgCheck& check, int bits, int64_t k, int64_t block);

// The canonical form and the importers are public (tessera/linear.h); the names stay here for the library's code.
using ::tessera::linear::import_awq;
using ::tessera::linear::import_gptq;
using ::tessera::linear::QuantizedWeight;

}  // namespace tessera::linear::detail
