// Internal (issue 18, step 1; docs/perf/linear.md): the canonical host form of a weight-only quantized matrix, and
// the importers of GPTQ / AWQ checkpoint tensors into it. The kernels' prepacked layout will be built from this form;
// the float64 reference (reference/linear_reference.h) defines its values.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::linear::detail {

// W [N, K] as codes and per-block parameters, one code per byte:
//   w[n][j] = codes[n][j] · scale[n][j / block] + offset[n][j / block]   (j: column of this form)
// Column j of this form is column k_perm[j] of the original W (GPTQ act-order groups made contiguous); x's columns
// are taken in the same order (y = x[:, k_perm] · wᵀ). k_perm empty: the identity.
struct QuantizedWeight {
  int64_t n = 0, k = 0;
  int bits = 4;       // 4 or 8: codes in [0, 2^bits)
  int64_t block = 0;  // columns per (scale, offset): the checkpoint's group, or K (per output channel)
  std::vector<uint8_t> codes;        // [N][K]
  std::vector<float> scale, offset;  // [N][K / block]
  std::vector<int32_t> k_perm;       // [K] or empty
};

// GPTQ (AutoGPTQ's layout), w = (q − z) · s:
//   qweight int32 [K · bits / 32, N]: k = r · (32 / bits) + j in bits [bits · j, bits · (j + 1)) of row r;
//   qzeros  int32 [G, N · bits / 32]: n = c · (32 / bits) + j in bits [bits · j, ...) of column c;
//   scales  fp16 bits [G, N]; g_idx int32 [K] (null: k / group): column k's group, G = K / group groups.
// zero_stored_minus_one: the v1 checkpoints' qzeros hold z − 1 (symmetric 4-bit: 7 for z = 8); false: z itself (v2).
// A g_idx out of order (act-order) is sorted into contiguous groups (stable in k) and recorded in k_perm; each group
// must own exactly `group` columns. Throws tessera::Error naming the argument.
QuantizedWeight import_gptq(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales,
                            const int32_t* g_idx, int64_t k, int64_t n, int bits, int64_t group,
                            bool zero_stored_minus_one);

// AWQ (AutoAWQ's GEMM layout), 4-bit, w = (q − z) · s:
//   qweight int32 [K, N / 8]: nibble i of column c holds n = 8c + {0, 2, 4, 6, 1, 3, 5, 7}[i];
//   qzeros  int32 [K / group, N / 8], the same order; scales fp16 bits [K / group, N].
QuantizedWeight import_awq(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales, int64_t k,
                           int64_t n, int64_t group);

}  // namespace tessera::linear::detail
