// tessera-bench: inputs generated on the GPU, and small device-side helpers for --check.
//
// Every generator is counter-based: element i of a fill is a pure function of (seed, i) (a splitmix64 hash), so the
// values do not depend on the launch shape, and a case's set s is the same in every run (seed = case_seed(op, name,
// s) mixed with a per-tensor salt). Nothing generated is ever all zeros; the float fills never produce an exact 0.
// The reference side never regenerates these values: --check downloads set 0's inputs (or the sampled part of them).
// All launches are asynchronous on `stream`; every call checks its launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "tessera/attention.h"
#include "tessera/tensor.h"

namespace tessera::bench::gen {

// A seed for one tensor of a set: the set's seed mixed with a salt naming the tensor.
uint64_t sub_seed(uint64_t seed, uint64_t salt);

// Floats of dtype kFP32, kBF16 or kFP16 (rounded to nearest even from fp32).
struct FloatDist {
  enum Kind { kUniform, kNormal } kind = kUniform;
  float lo = -1.0f, hi = 1.0f;  // kUniform: on a 65536-point grid of [lo, hi) offset by half a step
  float stddev = 1.0f;          // kNormal: mean 0, Irwin-Hall of four uniforms (bounded by 3.46 stddev)
  // > 0: consecutive runs of `row` elements share a magnitude 2^U(log2_mag_lo, log2_mag_hi) that multiplies the
  // value (row / block maxima then vary the way activations do).
  int64_t row = 0;
  float log2_mag_lo = 0.0f, log2_mag_hi = 0.0f;
};
void fill_float(void* dst, DType dtype, int64_t count, uint64_t seed, const FloatDist& dist, cudaStream_t stream);

// fp8 e4m3 bytes, finite and never zero: random sign and mantissa, exponent field 15 - d with P(d) = 2^-(d+1)
// (d <= 12), i.e. magnitudes roughly uniform in (0, 448], as in a tensor quantized with its amax mapped to 448.
void fill_e4m3(uint8_t* dst, int64_t count, uint64_t seed, cudaStream_t stream);

// Positive fp32 scales 2^U(log2_lo, log2_hi).
void fill_exp2(float* dst, int64_t count, uint64_t seed, float log2_lo, float log2_hi, cudaStream_t stream);

// int32 uniform in [lo, hi).
void fill_int(int32_t* dst, int64_t count, uint64_t seed, int32_t lo, int32_t hi, cudaStream_t stream);

// Routing ids [tokens, topk]: topk distinct experts of [0, num_experts) per token, uniform over ordered choices.
void fill_topk_ids(int32_t* ids, int64_t tokens, int topk, int num_experts, uint64_t seed, cudaStream_t stream);

// A KV cache of `batch` sequences x `capacity` tokens x HKV heads, every row quantized to `format` by the cache
// format's rule (attention.h): bf16 values m_h·N(0, 1) with m_h = head_mag[h] (Irwin-Hall, |N| < 3.47);
// kNative: the bf16 bits; kFP8: e4m3(x / fp8_scale[h]), saturated; kInt8 / kInt4 / kInt4Group32: per group,
// scale = fp16((max - min) / levels), offset = fp16(min), codes = rint((x - offset) / scale) clamped.
// data: [rows][row_bytes], pairs: [rows][2·NG] fp16 (nullptr for kNative / kFP8). Rows are laid out contiguous
// ([B, T, HKV, ...]) when page_size == 0, else paged ([num_pages, page_size, HKV, ...]) with logical page
// (b, p) at physical page block_table[b · capacity / page_size + p] (block_table: a device pointer).
// Per-channel key formats (kInt8KChannel / kInt4KChannel): with keys = false the tensor is the values, quantized
// per row as kInt8 / kInt4; with keys = true the keys, quantized per channel over each block of kKeyBlock = 32
// tokens (every block full: lo / hi over its 32 rows, the same fp16 scale / offset and code rule), the codes in
// the data rows and the blocks' pairs in `pairs` laid out [B, capacity / 32, HKV, 2·D] (paged: [num_pages,
// page_size / 32, HKV, 2·D]), the scale of channel d at d and its offset at D + d. capacity (and page_size) must
// then be multiples of 32.
struct KVCacheFill {
  attention::KVFormat format = attention::KVFormat::kNative;
  int64_t batch = 0, capacity = 0;
  int hkv = 1, head_dim = 128;
  int page_size = 0;
  const int32_t* block_table = nullptr;
  std::vector<float> head_mag;   // [HKV]
  std::vector<float> fp8_scale;  // [HKV], kFP8 only
  bool keys = false;             // per-channel key formats: the keys (block pairs), else the values (row pairs)
};
void fill_kv_cache(const KVCacheFill& fill, void* data, uint16_t* pairs, uint64_t seed, cudaStream_t stream);

// dst[i] = src row rows[i] (row_bytes bytes each); rows: a device array of n row numbers. For --check downloads
// of scattered rows.
void gather_rows(const void* src, int64_t row_bytes, const int64_t* rows, int64_t n, void* dst, cudaStream_t stream);

// The largest |x| over count 16-bit floats (kBF16 / kFP16), into *amax (a device float, overwritten).
void amax16(const uint16_t* x, DType dtype, int64_t count, float* amax, cudaStream_t stream);

// Interleaves two arrays of `count` 16-bit values into (a, b) pairs, dst[2i] = a[i], dst[2i + 1] = b[i]: the
// prepacked (scale, offset or zero) pairs of a weight-only linear / conv weight.
void interleave_pairs(uint16_t* dst, const uint16_t* a, const uint16_t* b, int64_t count, cudaStream_t stream);

}  // namespace tessera::bench::gen
