// CPU references of the W8A8 layer (issue 19; docs/perf/w8a8.md): the int8 quantizer per (row, block of K columns)
// in an exact fp32 operation order that a kernel reproduces bit for bit, and the int8 × int8 product with per-block
// scales and integer zero points, both directly and in the expanded integer form a kernel computes from block sums.
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::reference {

// A [rows, K] matrix quantized per (row, block of `block` columns): value = scale · (code − zero).
struct Int8Blocks {
  int64_t rows = 0, k = 0, block = 0;  // block divides K; block == K: one block per row (per token / per channel)
  std::vector<int8_t> codes;           // [rows][K]
  std::vector<float> scale;            // [rows][K / block]
  std::vector<int32_t> zero;           // [rows][K / block], in [-128, 127]; all 0 when symmetric
  int64_t blocks() const { return block > 0 ? k / block : 0; }
  double value(int64_t r, int64_t c) const;
};

// x [rows][K] (the float values of bf16 / fp16 / fp32 x), per (row, block):
//   asymmetric: lo = min(block ∪ {0}), hi = max(block ∪ {0}), s = (hi − lo) / 255, inv = 1 / s,
//               z = clamp(rint(−128 − lo · inv), −128, 127), q = clamp(rint(x · inv) + z, −128, 127);
//   symmetric:  z = 0, s = max|x| / 127, inv = 1 / s, q = clamp(rint(x · inv), −127, 127).
// Every operation is one IEEE fp32 operation rounded to nearest even (no fused multiply-add, products rounded before
// the next step), so that a kernel doing the same operations gets the same codes; a block whose range is 0 gets s = 1.
// 0 is always representable: q(0) = z, value 0.
// Throws std::invalid_argument when block does not divide K or a size is not positive.
Int8Blocks quantize_int8_blocks(const std::vector<float>& x, int64_t rows, int64_t k, int64_t block, bool symmetric);

// Σ code over each (row, block), [rows][blocks]: the sums the expanded product needs (exact in int32 for K < 2^24).
std::vector<int32_t> block_code_sums(const Int8Blocks& q);

// The inner sums D[m][n][i] = Σ_{k ∈ G_i} (Aq[m,k] − zA[m,i]) · (Bq[n,k] − zB[n,i]), directly, [M][N][blocks].
// a [M, K] and b [N, K] must have the same K and block.
std::vector<int64_t> w8a8_block_dots(const Int8Blocks& a, const Int8Blocks& b);

// The same sums in the expanded form a kernel computes: Σ Aq·Bq (the int8 tensor-core product) − zB·ΣAq − zA·ΣBq +
// |G|·zA·zB, with ΣAq from the activation quantizer and ΣBq precomputed per weight block.
std::vector<int64_t> w8a8_block_dots_expanded(const Int8Blocks& a, const Int8Blocks& b);

// C[m][n] = Σ_i sA[m,i] · sB[n,i] · D[m][n][i] in float64 (+ bias[n] when bias is not empty): the product of the
// dequantized operands.
std::vector<double> w8a8_reference(const Int8Blocks& a, const Int8Blocks& b, const std::vector<double>& bias = {});

}  // namespace tessera::reference
