// CPU references of attention decode and of the KV cache formats (tessera/attention.h), and the check of a GPU
// decode output against them.
//  - Quantization: bit-exact with append_kv (the same fp32 operations in the same order, see attention.h).
//  - Dequantization: to double, exactly (code · scale + offset, e4m3 · scale, native values).
//  - Decode: float64 over dense dequantized K/V, with the clamping, window and softcap semantics of attention.h.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/moe_checks.h"
#include "tessera/attention.h"
#include "tessera/tensor.h"

namespace tessera::reference {

// ---- number formats ------------------------------------------------------------------------------------------

// fp16 round-to-nearest-even of x, saturated to ±65504 (NaN stays NaN: 0x7E00).
uint16_t fp16_rne_sat(float x);
// fp8 e4m3 round-to-nearest-even of x, saturated to ±448 (infinities too); NaN becomes 0x7F.
uint8_t e4m3_rne_sat(float x);

// ---- KV cache rows -------------------------------------------------------------------------------------------

// Bytes of one (token, head) data row: kNative 2·D, kFP8 / kInt8 / kInt8KChannel D, kInt4 / kInt4Group32 /
// kInt4KChannel D/2.
int kv_row_bytes(attention::KVFormat format, int head_dim);
// (scale, offset) pairs per row, NG: 1 (kInt8, kInt4, and the per-channel formats' value rows), D/32
// (kInt4Group32), 0 (kNative, kFP8).
int kv_num_scale_groups(attention::KVFormat format, int head_dim);
// Largest code: 255 (kInt8, kInt8KChannel), 15 (kInt4, kInt4Group32, kInt4KChannel), 0 otherwise.
int kv_levels(attention::KVFormat format);
// Whether a format has per-channel keys (tessera/attention.h), for the reference's callers.
using attention::kv_key_per_channel;

// One row of D values x into `data` (kv_row_bytes bytes) and `pairs` (2·NG fp16 bits: scale of group g at 2g,
// offset at 2g + 1; untouched when NG = 0), as append_kv stores it. native_dtype (kBF16 / kFP16): the element type
// of kNative rows (x must be exactly representable in it: the bits are copied). fp8_scale: kFP8 only.
// kInt8KChannel / kInt4KChannel: a VALUE row (per-row pair, as kInt8 / kInt4); their keys use quantize_key_block.
void quantize_kv_row(attention::KVFormat format, const float* x, int head_dim, DType native_dtype, float fp8_scale,
                     uint8_t* data, uint16_t* pairs);
// The inverse, exact in double: code · double(scale) + double(offset); double(e4m3) · double(fp8_scale); native.
// kInt8KChannel / kInt4KChannel: a value row (keys: dequantize_key_row).
void dequantize_kv_row(attention::KVFormat format, const uint8_t* data, const uint16_t* pairs, int head_dim,
                       DType native_dtype, float fp8_scale, double* out);

// ---- per-channel keys (kInt8KChannel, kInt4KChannel) ---------------------------------------------------------

// Rows x[0..n) ([n][D] floats, n in 1..kKeyBlock) of one key block of a per-channel format into codes
// [n][kv_row_bytes(format, D)] and params [2·D] fp16 bits (scales of channels 0..D-1, then offsets), as
// append_kv writes a block whose first n rows exist: per channel d, the integer rule of attention.h over
// x[0..n)[d]. Throws tessera::Error for another format, n outside 1..kKeyBlock, D <= 0, or an odd D for int4.
void quantize_key_block(attention::KVFormat format, const float* x, int n, int head_dim, uint8_t* codes,
                        uint16_t* params);
// One row of such a block back to D doubles: code · double(scale[d]) + double(offset[d]).
void dequantize_key_row(attention::KVFormat format, const uint8_t* codes, const uint16_t* params, int head_dim,
                        double* out);

// Many rows, ordered so that the KV head varies fastest ([..., HKV, D]): row r uses fp8_scales[r % size] (size 1:
// per tensor; HKV: per head).
struct QuantizedKV {
  attention::KVFormat format = attention::KVFormat::kNative;
  DType native_dtype = DType::kBF16;
  int64_t rows = 0;
  int head_dim = 0;
  int row_bytes = 0;
  int num_groups = 0;             // NG
  std::vector<uint8_t> data;      // [rows][row_bytes]
  std::vector<uint16_t> pairs;    // [rows][2 · NG] fp16 bits
  std::vector<float> fp8_scales;  // kFP8: 1 or HKV values

  const uint8_t* row_data(int64_t r) const { return data.data() + r * row_bytes; }
  const uint16_t* row_pairs(int64_t r) const { return pairs.data() + r * 2 * num_groups; }
  float fp8_scale(int64_t r) const {
    return fp8_scales.empty() ? 1.0f : fp8_scales[static_cast<size_t>(r % static_cast<int64_t>(fp8_scales.size()))];
  }
};

// x: [rows][head_dim] floats. Throws tessera::Error on inconsistent arguments (kFP8 without scales, D not a
// multiple of 32 for kInt4Group32, odd D for int4, native_dtype not bf16/fp16). The per-channel formats quantize
// every row as a value row (quantize_kv_row); their key blocks go through quantize_key_block.
QuantizedKV quantize_kv(attention::KVFormat format, const float* x, int64_t rows, int head_dim,
                        DType native_dtype = DType::kBF16, const std::vector<float>& fp8_scales = {});
// [rows][head_dim] doubles.
std::vector<double> dequantize_kv(const QuantizedKV& q);

// ---- decode --------------------------------------------------------------------------------------------------

struct DecodeShape {
  int batch = 0;          // B
  int num_q_heads = 0;    // HQ, a multiple of HKV
  int num_kv_heads = 0;   // HKV
  int head_dim = 0;       // D (any positive value)
  int64_t capacity = 0;   // T_cap: tokens per sequence in k / v
  int num_new = 1;        // S: new query tokens per sequence (speculative decoding), causal among themselves
};

struct DecodeRef {
  DecodeShape shape;
  std::vector<int64_t> begin, end;  // [B·S]: the keys query token (b, i) attends to, [begin, end)
  std::vector<double> o;            // [B·S][HQ][D]; zero where end == begin
  std::vector<double> lse;          // [B·S][HQ], natural log; -inf where end == begin
};

// q [B][S][HQ][D]; k, v [B][T_cap][HKV][D] (rows past a sequence's length are not read); seqlens [B], clamped to
// [0, T_cap] (L). Token i of sequence b attends to keys [max(0, lim - window), max(0, lim)), lim = L - S + 1 + i
// (window 0: from 0). params as decode's: softmax_scale 0 = 1/sqrt(D), softcap > 0 caps the logits, window > 0
// keeps the last `window` keys; num_splits is ignored. num_threads 0: one per hardware thread (fewer for small problems);
// results do not depend on it.
DecodeRef decode_reference(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                           const std::vector<int32_t>& seqlens, const DecodeShape& shape,
                           const attention::DecodeParams& params, int num_threads = 0);

// ---- prefill (issue 17: the reference comes first; the op and its output check follow with the kernel) ----------

struct PrefillShape {
  int batch = 0;         // B sequences
  int num_q_heads = 0;   // HQ, a multiple of HKV
  int num_kv_heads = 0;  // HKV
  int head_dim = 0;      // D (any positive value)
};

struct PrefillRefParams {
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(D)
  float softcap = 0.0f;        // > 0: logits become softcap · tanh(s / softcap)
  int window = 0;              // > 0: a query attends to at most the last `window` keys up to its own position
  bool causal = false;
};

struct PrefillRef {
  PrefillShape shape;
  int64_t total_q = 0;
  std::vector<int64_t> begin, end;  // [total_q]: the keys query row r attends to, [begin, end) of its sequence
  std::vector<double> o;            // [total_q][HQ][D]; zero where end == begin
  std::vector<double> lse;          // [total_q][HQ], natural log; -inf where end == begin
};

// Variable-length prefill: q [total_q][HQ][D], k and v [total_k][HKV][D], packed by sequence; cu_seqlens_q and
// cu_seqlens_k [B + 1] (starting at 0, never decreasing) give each sequence's rows. Query i of a sequence with Sq
// queries and Sk keys sits at position p = Sk - Sq + i (bottom-right aligned, as FlashAttention does) and attends to
// its keys j with j <= p (causal; all j < Sk otherwise) and p - j < window (window > 0; FlashAttention's
// window_size_left is window - 1). No key (e.g. causal with p < 0): o = 0, lse = -inf. decode_reference is the case
// Sq = S new tokens per sequence, causal, Sk = its length (both go through one float64 core).
PrefillRef prefill_reference(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                             const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k,
                             const PrefillShape& shape, const PrefillRefParams& params, int num_threads = 0);

struct DecodeTolerance {
  double o_rtol = 5e-3;     // relative Frobenius error of o over the rows with keys
  double row_rtol = 0.0;    // > 0: also the relative error of each such row (B·HQ rows of D)
  double lse_atol = 1e-2;   // |lse - ref| per row with keys
  // > 0: a row's lse bound is max(lse_atol, lse_rtol · |ref|). The kernels round one operand of every logit to 16
  // bits (the scaled query q·σ of per-channel keys, dequantized keys), so a logit s carries an error of order
  // 2^-11 · |s|, which a fixed bound cannot follow where outlier channels make the logits large.
  double lse_rtol = 0.0;
};

struct DecodeCheck : CheckResult {  // error = relative Frobenius error of o; compared = elements of o checked
  double worst_row_error = 0.0;     // largest relative error of one (b, h) row with keys
  double lse_max_error = 0.0;       // largest |lse - ref| (rows with keys)
  int64_t nonfinite = 0;            // elements of o (or lse, rows with keys) that are NaN or infinite
  int64_t empty_rows_bad = 0;       // rows without keys whose o is not all zero or whose lse is not -inf
};

// o: host copy of the GPU output, bf16 or fp16 bits (o_dtype), o(b, h, d) = o[b · o_stride_b + h · o_stride_h + d]
// where b runs over the B·S query tokens b·S + i (S = 1: the sequences; S > 1: o_stride_b is the stride between
// consecutive tokens, e.g. HQ·D for a contiguous [B, S, HQ, D]); lse (nullable): fp32,
// lse(b, h) = lse[b · lse_stride_b + h · lse_stride_h], b as for o. Every row of o must be finite; rows
// without keys exactly zero (±0) with lse == -inf.
DecodeCheck check_decode_output(const DecodeRef& ref, const uint16_t* o, DType o_dtype, int64_t o_stride_b,
                                int64_t o_stride_h, const float* lse, int64_t lse_stride_b, int64_t lse_stride_h,
                                const DecodeTolerance& tol = {});
// Contiguous o [B][HQ][D] and lse [B][HQ] (lse may be empty: not checked).
DecodeCheck check_decode_output(const DecodeRef& ref, const std::vector<uint16_t>& o, DType o_dtype,
                                const std::vector<float>& lse, const DecodeTolerance& tol = {});

}  // namespace tessera::reference
