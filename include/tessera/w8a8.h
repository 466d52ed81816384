// tessera — W8A8: int8 activations quantized on the fly × int8 weights, int32 tensor-core products (public).
//
// Both operands are int8 codes with fp32 scales and integer zero points per (row, block of K columns), the block the
// same for both: 32, 64, 128, or K (one block per row: per token for x, per output channel for W):
//
//   x[m, k] ≈ sA[m, i] · (Aq[m, k] − zA[m, i]),   w[n, k] ≈ sB[n, i] · (Bq[n, k] − zB[n, i]),   i = k / block
//   y[m, n] = clamp( Σ_i sA[m, i] · sB[n, i] · D[m, n, i] + bias[n], clamp_min, clamp_max )
//   D[m, n, i] = Σ_{k in block i} (Aq − zA)(Bq − zB) = Σ Aq·Bq − zB·ΣAq − zA·ΣBq + block·zA·zB   (exact integers)
//
// Σ Aq·Bq runs on the int8 tensor cores with int32 accumulation; ΣAq per (row, block) comes from quantize_per_block,
// ΣBq per (weight row, block) from prepack_w8a8; each block's D is formed in int32 and then scaled in fp32
// (block-wise), or D over all of K in int32/int64 and scaled once (block = K). docs/ops/w8a8.md states the exact math.
//
// Two launches per layer: quantize_per_block(x) then gemm_w8a8. Both run asynchronously on the given stream, never
// synchronize the host, never allocate (workspace sized by gemm_w8a8_workspace_bytes) and can be captured in a CUDA
// graph. Arguments are validated before anything is launched; a violation throws tessera::Error naming the argument.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "tessera/tensor.h"

namespace tessera::linear {

// int8 codes of a [rows, K] matrix with their per-(row, block) parameters, in device memory. The parameters are
// block-major (all rows of block 0, then block 1, ...) so that the GEMM loads a tile's parameters of one block with one
// TMA copy (DeepGEMM stores its activation scales the same way), and all fp32: the zero points and code sums are exact
// small integers (|Σ| <= 128·K, exact in fp32 for K <= 131072), kept as floats because the GEMM's per-block promotion
// works in fp32 (an int32 → fp32 conversion per element would cost more than the promotion itself).
//   codes int8 [rows, K]: unit stride along K, row stride >= K and a multiple of 16 elements, 16-byte aligned
//   scale fp32 view [K / block, rows] with row stride ld: element (row r, block i) at i·ld + r; ld >= rows and a
//         multiple of 4 (16 bytes); the memory must hold (K / block)·ld floats: the GEMM's TMA copies of the
//         block-wise parameters read each block's rows up to ld (the values past `rows` are never used)
//   zero  fp32 like scale, integer values in [−128, 127]; data == nullptr: symmetric (all zero points 0)
//   sums  fp32 like scale: Σ codes over each (row, block); data == nullptr when not needed (the GEMM needs ΣAq only
//         when the weight has zero points, ΣBq only when the activations have them)
// The three parameter views share ld (their dim-0 stride).
struct Int8BlockTensor {
  TensorView codes, scale, zero, sums;
  int64_t block = 0;  // 32, 64, 128 or K
};

// The parameter row stride (ld) for `rows` rows: rows rounded up to a multiple of 4.
inline int64_t int8_block_param_ld(int64_t rows) { return (rows + 3) / 4 * 4; }

// Quantizes x [M, K] (bf16 / fp16 / fp32, unit stride along K) per (row, block) into `out` (whose views the caller
// allocates; out.zero and out.sums may be null):
//   asymmetric (out.zero given): lo = min(block ∪ {0}), hi = max(block ∪ {0}), s = (hi − lo) / 255, inv = 1 / s,
//     z = clamp(rint(−128 − lo·inv), −128, 127), q = clamp(rint(x·inv) + z, −128, 127);
//   symmetric (out.zero null): s = max|x| / 127, inv = 1 / s, q = clamp(rint(x·inv), −127, 127).
// Each step is one fp32 operation rounded to nearest even (no fused multiply-add); a block whose range is 0 gets
// s = 1. The codes equal those of tessera::reference::quantize_int8_blocks bit for bit. K must be a multiple of 16 and
// of block; non-finite x gives unspecified codes and scales (no error is raised on the device).
void quantize_per_block(const TensorView& x, const Int8BlockTensor& out, cudaStream_t stream);

// A weight [N, K] quantized per (output channel, block), on the host: what prepack_w8a8 returns and what a device
// W8A8 weight holds (codes row-major, no rearrangement: TMA reads them as they are).
struct W8A8HostWeight {
  int64_t n = 0, k = 0, block = 0;
  int64_t ld = 0;  // int8_block_param_ld(n)
  bool symmetric = true;
  std::vector<int8_t> codes;  // [N][K]
  std::vector<float> scale;   // [K / block][ld], rows n..ld-1 of each block 0
  std::vector<float> zero;    // like scale (empty when symmetric)
  std::vector<float> sums;    // like scale: Σ codes
};

// Quantizes a float weight w [N][K] (row-major) with the same rule as quantize_per_block and precomputes ΣBq.
W8A8HostWeight prepack_w8a8(const float* w, int64_t n, int64_t k, int64_t block, bool symmetric);

struct W8A8Epilogue {
  TensorView bias;  // fp32 [N], or data == nullptr
  float clamp_min = -std::numeric_limits<float>::infinity();
  float clamp_max = std::numeric_limits<float>::infinity();
  // int8 y only (requantized output for the next W8A8 layer): y = clamp(rint(v · out_scale), −128, 127), v after bias
  // and clamp.
  float out_scale = 1.0f;
};

// Device workspace (16-byte aligned, any contents) a call with up to max_m rows needs; 0 when none.
std::size_t gemm_w8a8_workspace_bytes(int64_t max_m, int64_t n, int64_t k, int64_t block);

// y [M, N] (bf16, fp16, fp32, or int8 with out_scale; unit stride along N) = epilogue(x · wᵀ) from the quantized
// activations `a` ([M, K]) and weights `w` ([N, K], same K and block). M may be 0 (nothing launched).
void gemm_w8a8(const Int8BlockTensor& a, const Int8BlockTensor& w, const TensorView& y, const W8A8Epilogue& epilogue,
               const Workspace& workspace, cudaStream_t stream);

}  // namespace tessera::linear
