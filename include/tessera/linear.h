// tessera — weight-only quantized linear layer (public).
//
//   y[m, n] = clamp( Σ_k x[m, k] · w[n, k] + bias[n], clamp_min, clamp_max )
//
// with W [N, K] held as int4 or int8 codes q and per-block parameters along K (blocks of 32, 64 or 128 columns, or one
// block per output channel), in one of the two conventions checkpoints use:
//   kOffset     w = q · scale + offset        (the seed's / MNN's form; offset any float)
//   kZeroPoint  w = (q − zero) · scale        (GPTQ / AWQ; zero an integer in [0, 2^bits); symmetric: zero = 8 / 128)
// Codes are unsigned (0..15 for int4, 0..255 for int8).
//
// Two steps:
//   1. prepack (offline, host): QuantizedWeight (one code per byte, fp32 parameters; built by the caller or by the
//      GPTQ / AWQ importers below) → PackedWeight, the kernels' layout (docs/ops/linear.md, byte by byte). The
//      parameters are stored in the 16-bit type the kernel computes in (compute_dtype, bf16 or fp16), which must be
//      x's type (or, for fp32 x, the type x is rounded to).
//   2. linear (device): any M, one op; a pure select_config picks the token tile, the split of K and the ring depth.
//
// x: [M, K] bf16 / fp16 / fp32, unit stride along K, row stride a multiple of 8 elements, 16-byte aligned.
//   16-bit x must be compute_dtype; fp32 x is rounded to compute_dtype on the way into the tensor cores (one
//   rounding: relative error at most 2^-8 for bf16, 2^-11 for fp16) and y is fp32.
// y: [M, N], x's dtype (fp32 x → fp32 y), unit stride along N (any row stride, any N).
// The products run on the tensor cores in compute_dtype with fp32 accumulation: w rounded once to compute_dtype from
// q, scale, offset; or, for int4 weights at small M (token tiles <= 32), the exact codes multiplied and each block's
// scale and offset applied to the fp32 sums (no rounding of w). docs/ops/linear.md states both.
//
// The op runs asynchronously on the given stream, never synchronizes the host, never allocates (workspace sized by
// linear_workspace_bytes), and can be captured in a CUDA graph. Arguments are validated before anything is launched;
// a violation throws tessera::Error naming the op and the argument. See docs/ops/linear.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "tessera/tensor.h"

namespace tessera::linear {

enum class ZeroMode : int {
  kOffset = 0,     // w = q · scale + offset
  kZeroPoint = 1,  // w = (q − zero) · scale, zero an integer
};

// The canonical host form: one code per byte, W's columns possibly permuted (GPTQ act-order).
//   w[n][j] = codes[n][j] · scale[n][j / block] + offset[n][j / block]      (kOffset)
//   w[n][j] = (codes[n][j] − zero[n][j / block]) · scale[n][j / block]        (kZeroPoint; offset = −zero · scale)
// Column j is column k_perm[j] of the original W (empty: the identity): y = x[:, k_perm] · wᵀ, applied by the op.
struct QuantizedWeight {
  int64_t n = 0, k = 0;
  int bits = 4;       // 4 or 8
  int64_t block = 0;  // 32, 64, 128, or K (one block per output channel)
  ZeroMode zero_mode = ZeroMode::kOffset;
  std::vector<uint8_t> codes;        // [N][K]
  std::vector<float> scale, offset;  // [N][K / block]; offset is −zero · scale in kZeroPoint mode
  std::vector<uint8_t> zero;         // [N][K / block], kZeroPoint only
  std::vector<int32_t> k_perm;       // [K] or empty
};

// GPTQ (AutoGPTQ layout), w = (q − z) · s:
//   qweight int32 [K · bits / 32, N]: k = r · (32 / bits) + j in bits [bits · j, bits · (j + 1)) of row r;
//   qzeros  int32 [K / group, N · bits / 32]: n = c · (32 / bits) + j in bits [bits · j, ...) of column c;
//   scales  fp16 bits [K / group, N]; g_idx int32 [K] (null: k / group).
// zero_stored_minus_one: v1 checkpoints store z − 1 (symmetric 4-bit: 7 for z = 8); false: z itself (v2).
// An act-order g_idx is sorted into contiguous groups (stable in k) and recorded in k_perm; each group must own
// exactly `group` columns.
QuantizedWeight import_gptq(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales, const int32_t* g_idx,
                            int64_t k, int64_t n, int bits, int64_t group, bool zero_stored_minus_one);

// AWQ (AutoAWQ GEMM layout), 4-bit, w = (q − z) · s:
//   qweight int32 [K, N / 8]: nibble i of column c holds n = 8c + {0, 2, 4, 6, 1, 3, 5, 7}[i];
//   qzeros  int32 [K / group, N / 8], the same order; scales fp16 bits [K / group, N].
QuantizedWeight import_awq(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales, int64_t k, int64_t n,
                           int64_t group);

// Round-to-nearest quantization of a float weight w [N][K] (row-major) into the canonical form: per block, kOffset
// takes offset = min, scale = (max − min) / (2^bits − 1); kZeroPoint first widens [min, max] to hold 0 (as GPTQ's
// quantizer does), then scale = (max − min) / (2^bits − 1), zero = clamp(round(−min / scale)); codes =
// clamp(round(...)). A block of equal values gets scale 0 (kOffset); an all-zero block gets scale 1, zero 0
// (kZeroPoint).
QuantizedWeight quantize_weight(const float* w, int64_t n, int64_t k, int bits, int64_t block, ZeroMode zero_mode);

// ---- The kernels' layout ---------------------------------------------------------------------------------------
// Columns are padded to Kp = K rounded up to kTileK(bits) (64 for int4, 32 for int8) and rows to Np = N rounded up
// to 16; padded weights are 0. Byte-exact description: docs/ops/linear.md.
//   codes  uint8 [Np, Kp · bits / 8]: 16-row stripes, each a sequence of Kp / kTileK tiles of 512 bytes: 32 lanes ×
//          16 bytes, lane l's bytes holding its mma.m16n8k16 A-fragment codes for the tile's 16-column steps.
//   params compute_dtype [Np, num_blocks, 2]: per 16-row stripe and block, 16 (scale, p) pairs, rows in the order
//          0, 8, 1, 9, ..., 7, 15; p = offset (kOffset) or zero (kZeroPoint). num_blocks = Kp / block, or 1 per
//          output channel (block = K). Both arrays are read by TMA: contiguous, 16-byte aligned.
inline constexpr int64_t tile_k(int bits) { return bits == 4 ? 64 : 32; }

struct PackedWeight {
  int64_t n = 0, k = 0;
  int bits = 4;
  int64_t block = 0;
  ZeroMode zero_mode = ZeroMode::kOffset;
  DType compute_dtype = DType::kBF16;
  std::vector<uint8_t> codes;    // see above
  std::vector<uint16_t> params;  // compute_dtype bits
  std::vector<int32_t> k_perm;   // [K] or empty
  int64_t padded_n() const { return (n + 15) / 16 * 16; }
  int64_t padded_k() const { return (k + tile_k(bits) - 1) / tile_k(bits) * tile_k(bits); }
  int64_t num_blocks() const { return block == k ? 1 : padded_k() / block; }
};

// compute_dtype kBF16 or kFP16. Throws tessera::Error naming the argument on an inconsistent QuantizedWeight.
PackedWeight prepack(const QuantizedWeight& w, DType compute_dtype);

// The inverse of prepack (tests, checks): codes, parameters rounded to compute_dtype, k_perm.
QuantizedWeight unpack(const PackedWeight& p);

// A prepacked weight in device memory: views of PackedWeight's three arrays plus its constants.
struct LinearWeight {
  TensorView codes;   // uint8 [Np, Kp · bits / 8]
  TensorView params;  // compute_dtype [Np, num_blocks, 2]
  TensorView k_perm;  // int32 [K], or data == nullptr
  int64_t n = 0, k = 0;
  int bits = 4;
  int64_t block = 0;
  ZeroMode zero_mode = ZeroMode::kOffset;
};

struct LinearEpilogue {
  TensorView bias;  // [N] of y's dtype, or data == nullptr
  float clamp_min = -std::numeric_limits<float>::infinity();
  float clamp_max = std::numeric_limits<float>::infinity();  // relu: [0, inf); relu6: [0, 6]
};

using Workspace = tessera::Workspace;

// Device workspace (any contents, 16-byte aligned) a call with up to max_m rows of x needs; 0 when none.
std::size_t linear_workspace_bytes(int64_t max_m, const LinearWeight& w, DType x_dtype);

// y = epilogue(x · wᵀ). M = x.shape[0] may be 0 (nothing launched).
void linear(const TensorView& x, const LinearWeight& w, const TensorView& y, const LinearEpilogue& epilogue,
            const Workspace& workspace, cudaStream_t stream);

}  // namespace tessera::linear
