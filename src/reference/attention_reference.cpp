#include "reference/attention_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/host_numeric.h"
#include "reference/dot.h"
#include "reference/format.h"
#include "reference/parallel.h"
#include "tessera/error.h"

namespace tessera::reference {

namespace {

using attention::KVFormat;
using detail::fmt;

void require(bool cond, const char* fn, const std::string& what) {
  if (!cond) throw Error(std::string("tessera::reference::") + fn + ": " + what);
}

using detail::num_workers;
using detail::parallel;

void check_format(const char* fn, KVFormat format, int head_dim, DType native_dtype) {
  require(head_dim > 0, fn, "head_dim must be > 0, got " + std::to_string(head_dim));
  switch (format) {
    case KVFormat::kNative:
      require(native_dtype == DType::kBF16 || native_dtype == DType::kFP16, fn, "native_dtype must be bf16 or fp16");
      break;
    case KVFormat::kFP8:
    case KVFormat::kInt8:
    case KVFormat::kInt8KChannel: break;
    case KVFormat::kInt4:
    case KVFormat::kInt4KChannel: require(head_dim % 2 == 0, fn, "int4 rows need an even head_dim"); break;
    case KVFormat::kInt4Group32:
      require(head_dim % attention::kInt4GroupSize == 0, fn, "kInt4Group32 needs head_dim a multiple of 32");
      break;
    default: require(false, fn, "unknown KV format " + std::to_string(static_cast<int>(format)));
  }
}

// One group of an integer format: codes (one byte per element) and the fp16 pair, as attention.h defines them.
void quantize_group(const float* x, int n, int levels, uint8_t* codes, uint16_t* pair) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::fmin(lo, x[i]);
    hi = std::fmax(hi, x[i]);
  }
  const uint16_t scale_bits = fp16_rne_sat((hi - lo) / static_cast<float>(levels));
  const uint16_t offset_bits = fp16_rne_sat(lo);
  pair[0] = scale_bits;
  pair[1] = offset_bits;
  const float scale = host::fp16_to_f32(scale_bits), offset = host::fp16_to_f32(offset_bits);
  const float top = static_cast<float>(levels);
  for (int i = 0; i < n; ++i) {
    float c = 0.0f;
    if (scale != 0.0f) {
      const float diff = x[i] - offset;  // fp32 subtraction, then fp32 division, then round half to even
      c = std::rint(diff / scale);
      if (!(c >= 0.0f)) c = 0.0f;  // NaN too
      if (c > top) c = top;
    }
    codes[i] = static_cast<uint8_t>(c);
  }
}

// The code of element i of an integer row: a byte (int8), or a nibble (int4: element 2j low, 2j + 1 high in byte j).
int row_code(const uint8_t* data, int i, bool int4) { return int4 ? (data[i / 2] >> (4 * (i % 2))) & 0xF : data[i]; }

// The value-row format of a per-channel format (its values are plain per-row rows); other formats unchanged.
KVFormat value_row_format(KVFormat format) {
  switch (format) {
    case KVFormat::kInt8KChannel: return KVFormat::kInt8;
    case KVFormat::kInt4KChannel: return KVFormat::kInt4;
    default: return format;
  }
}

double native_value(const uint8_t* data, int i, DType dtype) {
  const uint16_t bits = static_cast<uint16_t>(data[2 * i] | (data[2 * i + 1] << 8));
  return dtype == DType::kFP16 ? host::fp16_to_f32(bits) : host::bf16_to_f32(bits);
}

}  // namespace

// ---- number formats ------------------------------------------------------------------------------------------

uint16_t fp16_rne_sat(float x) {
  const uint16_t h = host::f32_to_fp16(x);
  if ((h & 0x7FFF) == 0x7C00) return static_cast<uint16_t>((h & 0x8000) | 0x7BFF);  // ±inf -> ±65504
  return h;
}

uint8_t e4m3_rne_sat(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7E;  // max finite; everything above rounds to it under saturation
  if (a < 0x1p-6f) {                     // subnormal: multiples of 2^-9 (8 · 2^-9 is the smallest normal: bits 0x08)
    const float q = std::nearbyint(std::ldexp(a, 9));
    return sign | static_cast<uint8_t>(q);
  }
  int e;
  std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1): unbiased exponent e - 1
  int exp_biased = e - 1 + 7;
  float q = std::nearbyint(std::ldexp(a, 3 - (e - 1)));  // in [8, 16]
  if (q == 16.0f) {
    q = 8.0f;
    ++exp_biased;
  }
  const uint8_t bits = static_cast<uint8_t>((exp_biased << 3) | (static_cast<int>(q) - 8));
  if ((bits & 0x7F) > 0x7E) return sign | 0x7E;
  return sign | bits;
}

// ---- KV cache rows -------------------------------------------------------------------------------------------

int kv_row_bytes(KVFormat format, int head_dim) {
  switch (format) {
    case KVFormat::kNative: return 2 * head_dim;
    case KVFormat::kFP8:
    case KVFormat::kInt8:
    case KVFormat::kInt8KChannel: return head_dim;
    case KVFormat::kInt4:
    case KVFormat::kInt4Group32:
    case KVFormat::kInt4KChannel: return head_dim / 2;
  }
  return 0;
}

int kv_num_scale_groups(KVFormat format, int head_dim) {
  switch (format) {
    case KVFormat::kInt8:
    case KVFormat::kInt4:
    case KVFormat::kInt8KChannel:  // the values' per-row pair; the keys' scales are per channel (k_scale)
    case KVFormat::kInt4KChannel: return 1;
    case KVFormat::kInt4Group32: return head_dim / attention::kInt4GroupSize;
    default: return 0;
  }
}

int kv_levels(KVFormat format) {
  switch (format) {
    case KVFormat::kInt8:
    case KVFormat::kInt8KChannel: return 255;
    case KVFormat::kInt4:
    case KVFormat::kInt4Group32:
    case KVFormat::kInt4KChannel: return 15;
    default: return 0;
  }
}

void quantize_kv_row(KVFormat format, const float* x, int D, DType native_dtype, float fp8_scale, uint8_t* data,
                     uint16_t* pairs) {
  switch (value_row_format(format)) {
    case KVFormat::kNative:
      for (int i = 0; i < D; ++i) {
        const uint16_t b = native_dtype == DType::kFP16 ? host::f32_to_fp16(x[i]) : host::f32_to_bf16(x[i]);
        data[2 * i] = static_cast<uint8_t>(b & 0xFF);
        data[2 * i + 1] = static_cast<uint8_t>(b >> 8);
      }
      return;
    case KVFormat::kFP8:
      for (int i = 0; i < D; ++i) data[i] = e4m3_rne_sat(x[i] / fp8_scale);  // fp32 division, then RNE
      return;
    case KVFormat::kInt8: quantize_group(x, D, 255, data, pairs); return;
    case KVFormat::kInt4:
    case KVFormat::kInt4Group32: {
      uint8_t small[1024];  // one code per element; longer rows (not a decode head size) use the heap
      std::vector<uint8_t> big;
      uint8_t* c = small;
      if (D > 1024) {
        big.resize(D);
        c = big.data();
      }
      const int group = format == KVFormat::kInt4Group32 ? attention::kInt4GroupSize : D;
      for (int g = 0; g * group < D; ++g) quantize_group(x + g * group, group, 15, c + g * group, pairs + 2 * g);
      for (int j = 0; j < D / 2; ++j) data[j] = static_cast<uint8_t>(c[2 * j] | (c[2 * j + 1] << 4));
      return;
    }
    default: require(false, "quantize_kv_row", "unknown KV format " + std::to_string(static_cast<int>(format)));
  }
}

void dequantize_kv_row(KVFormat format, const uint8_t* data, const uint16_t* pairs, int D, DType native_dtype,
                       float fp8_scale, double* out) {
  switch (value_row_format(format)) {
    case KVFormat::kNative:
      for (int i = 0; i < D; ++i) out[i] = native_value(data, i, native_dtype);
      return;
    case KVFormat::kFP8:
      for (int i = 0; i < D; ++i) out[i] = static_cast<double>(host::e4m3_to_f32(data[i])) * fp8_scale;
      return;
    case KVFormat::kInt8: {
      const double scale = host::fp16_to_f32(pairs[0]), offset = host::fp16_to_f32(pairs[1]);
      for (int i = 0; i < D; ++i) out[i] = data[i] * scale + offset;
      return;
    }
    case KVFormat::kInt4:
    case KVFormat::kInt4Group32: {
      const int group = format == KVFormat::kInt4Group32 ? attention::kInt4GroupSize : D;
      for (int i = 0; i < D; ++i) {
        const int g = i / group;
        const double scale = host::fp16_to_f32(pairs[2 * g]), offset = host::fp16_to_f32(pairs[2 * g + 1]);
        out[i] = row_code(data, i, true) * scale + offset;
      }
      return;
    }
    default: require(false, "dequantize_kv_row", "unknown KV format " + std::to_string(static_cast<int>(format)));
  }
}

// ---- per-channel keys ----------------------------------------------------------------------------------------

namespace {

// Called once per block or row by the test fixtures: the messages are built only on failure.
void check_key_block(const char* fn, KVFormat format, int n, int head_dim) {
  if (!kv_key_per_channel(format))
    require(false, fn, "format must be kInt8KChannel or kInt4KChannel, got " + std::to_string(static_cast<int>(format)));
  if (head_dim <= 0 || (format == KVFormat::kInt4KChannel && head_dim % 2 != 0))
    require(false, fn, "head_dim must be > 0 (and even for int4 rows), got " + std::to_string(head_dim));
  if (n < 1 || n > attention::kKeyBlock)
    require(false, fn, "a key block holds 1 to " + std::to_string(attention::kKeyBlock) + " rows, got " +
                           std::to_string(n));
}

}  // namespace

void quantize_key_block(KVFormat format, const float* x, int n, int D, uint8_t* codes, uint16_t* params) {
  check_key_block("quantize_key_block", format, n, D);
  const bool int4 = format == KVFormat::kInt4KChannel;
  const int row_bytes = kv_row_bytes(format, D);
  float column[attention::kKeyBlock];
  uint8_t column_codes[attention::kKeyBlock];
  uint16_t pair[2];
  // The row rule (quantize_group) applied to each channel's column of n values: the same fp32 operations.
  for (int d = 0; d < D; ++d) {
    for (int r = 0; r < n; ++r) column[r] = x[int64_t{r} * D + d];
    quantize_group(column, n, kv_levels(format), column_codes, pair);
    params[d] = pair[0];
    params[D + d] = pair[1];
    for (int r = 0; r < n; ++r) {
      uint8_t* row = codes + int64_t{r} * row_bytes;
      if (!int4) {
        row[d] = column_codes[r];
      } else if (d % 2 == 0) {
        row[d / 2] = column_codes[r];  // low nibble; the odd channel after it fills the high one
      } else {
        row[d / 2] = static_cast<uint8_t>(row[d / 2] | (column_codes[r] << 4));
      }
    }
  }
}

void dequantize_key_row(KVFormat format, const uint8_t* codes, const uint16_t* params, int D, double* out) {
  check_key_block("dequantize_key_row", format, 1, D);
  const bool int4 = format == KVFormat::kInt4KChannel;
  for (int d = 0; d < D; ++d) {
    const double scale = host::fp16_to_f32(params[d]), offset = host::fp16_to_f32(params[D + d]);
    out[d] = row_code(codes, d, int4) * scale + offset;
  }
}

QuantizedKV quantize_kv(KVFormat format, const float* x, int64_t rows, int head_dim, DType native_dtype,
                        const std::vector<float>& fp8_scales) {
  const char* fn = "quantize_kv";
  check_format(fn, format, head_dim, native_dtype);
  require(rows >= 0, fn, "rows must be >= 0");
  if (format == KVFormat::kFP8) require(!fp8_scales.empty(), fn, "kFP8 needs fp8_scales (1 or HKV values)");
  QuantizedKV q;
  q.format = format;
  q.native_dtype = native_dtype;
  q.rows = rows;
  q.head_dim = head_dim;
  q.row_bytes = kv_row_bytes(format, head_dim);
  q.num_groups = kv_num_scale_groups(format, head_dim);
  if (format == KVFormat::kFP8) q.fp8_scales = fp8_scales;
  q.data.assign(static_cast<size_t>(rows) * q.row_bytes, 0);
  q.pairs.assign(static_cast<size_t>(rows) * 2 * q.num_groups, 0);
  const int threads = num_workers(0, static_cast<double>(rows) * head_dim * 8, rows);
  parallel(threads, [&](int t) {
    const int64_t first = rows * t / threads, last = rows * (t + 1) / threads;
    for (int64_t r = first; r < last; ++r)
      quantize_kv_row(format, x + r * head_dim, head_dim, native_dtype, q.fp8_scale(r),
                      q.data.data() + r * q.row_bytes, q.pairs.data() + r * 2 * q.num_groups);
  });
  return q;
}

std::vector<double> dequantize_kv(const QuantizedKV& q) {
  const char* fn = "dequantize_kv";
  check_format(fn, q.format, q.head_dim, q.native_dtype);
  require(static_cast<int64_t>(q.data.size()) == q.rows * q.row_bytes, fn, "data does not hold rows · row_bytes");
  require(static_cast<int64_t>(q.pairs.size()) == q.rows * 2 * q.num_groups, fn, "pairs does not hold rows · 2 · NG");
  std::vector<double> out(static_cast<size_t>(q.rows) * q.head_dim);
  const int threads = num_workers(0, static_cast<double>(q.rows) * q.head_dim * 4, q.rows);
  parallel(threads, [&](int t) {
    const int64_t first = q.rows * t / threads, last = q.rows * (t + 1) / threads;
    for (int64_t r = first; r < last; ++r)
      dequantize_kv_row(q.format, q.row_data(r), q.row_pairs(r), q.head_dim, q.native_dtype, q.fp8_scale(r),
                        out.data() + r * q.head_dim);
  });
  return out;
}

// ---- decode --------------------------------------------------------------------------------------------------

namespace {

using detail::dot;  // reference/dot.h

// Softmax attention of query rows over key ranges, in float64, shared by decode and prefill: the G = HQ / HKV query
// heads of KV head kvh in query row r ([rows][HQ][D] in q) attend to the key rows key_base[r] + t, t in
// [begin[r], end[r]), of k and v ([..][HKV][D]). o [rows][HQ][D] and lse [rows][HQ] (natural log) are written for
// rows with keys; the caller fills the others (zero / -inf). The work is split over (row, KV head) items, interleaved
// over the threads (ranges vary by row); results do not depend on the thread count.
void attend_rows(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                 const std::vector<int64_t>& key_base, const std::vector<int64_t>& begin,
                 const std::vector<int64_t>& end, int64_t HQ, int64_t HKV, int64_t D, double scale, double softcap,
                 int num_threads, std::vector<double>& o, std::vector<double>& lse) {
  const int64_t rows = static_cast<int64_t>(begin.size()), G = HQ / HKV;
  double work = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    work += static_cast<double>(std::max<int64_t>(0, end[r] - begin[r])) * HQ * D * 4;
  const int64_t items = rows * HKV;  // (query row, KV head): its G query heads share the K and V rows
  const int threads = num_workers(num_threads, work, items);
  parallel(threads, [&](int th) {
    std::vector<double> p;  // [G][n]: logits, then probabilities
    for (int64_t item = th; item < items; item += threads) {
      const int64_t r = item / HKV, kvh = item % HKV;
      const int64_t t0 = begin[r], t1 = end[r], n = t1 - t0;
      if (n <= 0) continue;
      p.resize(G * n);
      const double* qr = &q[(r * HQ + kvh * G) * D];
      for (int64_t t = t0; t < t1; ++t) {
        const double* kt = &k[((key_base[r] + t) * HKV + kvh) * D];
        for (int64_t g = 0; g < G; ++g) {
          double x = scale * dot(qr + g * D, kt, static_cast<int>(D));
          if (softcap > 0.0) x = softcap * std::tanh(x / softcap);
          p[g * n + (t - t0)] = x;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        double* pg = &p[g * n];
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, pg[i]);
        double sum = 0.0;
        for (int64_t i = 0; i < n; ++i) {
          pg[i] = std::exp(pg[i] - m);
          sum += pg[i];
        }
        lse[r * HQ + kvh * G + g] = m + std::log(sum);
        for (int64_t i = 0; i < n; ++i) pg[i] /= sum;
      }
      for (int64_t t = t0; t < t1; ++t) {
        const double* vt = &v[((key_base[r] + t) * HKV + kvh) * D];
        for (int64_t g = 0; g < G; ++g) {
          const double w = p[g * n + (t - t0)];
          double* og = &o[(r * HQ + kvh * G + g) * D];
          for (int64_t d = 0; d < D; ++d) og[d] += w * vt[d];
        }
      }
    }
  });
}

double resolved_scale(float softmax_scale, int64_t head_dim) {
  return softmax_scale != 0.0f ? static_cast<double>(softmax_scale) : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

}  // namespace

DecodeRef decode_reference(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                           const std::vector<int32_t>& seqlens, const DecodeShape& s,
                           const attention::DecodeParams& params, int num_threads) {
  const char* fn = "decode_reference";
  require(s.batch >= 0 && s.num_kv_heads > 0 && s.num_q_heads > 0 && s.head_dim > 0 && s.capacity >= 0, fn,
          "batch and capacity must be >= 0, the head counts and head_dim > 0");
  require(s.num_q_heads % s.num_kv_heads == 0, fn, "num_q_heads must be a multiple of num_kv_heads");
  require(s.num_new >= 1, fn, "num_new must be >= 1");
  const int64_t B = s.batch, HQ = s.num_q_heads, HKV = s.num_kv_heads, D = s.head_dim, T = s.capacity;
  const int64_t S = s.num_new;
  require(static_cast<int64_t>(q.size()) == B * S * HQ * D, fn,
          "q must hold B·S·HQ·D = " + std::to_string(B * S * HQ * D) + " values, got " + std::to_string(q.size()));
  require(static_cast<int64_t>(k.size()) == B * T * HKV * D && k.size() == v.size(), fn,
          "k and v must hold B·T_cap·HKV·D = " + std::to_string(B * T * HKV * D) + " values, got " +
              std::to_string(k.size()) + " and " + std::to_string(v.size()));
  require(static_cast<int64_t>(seqlens.size()) == B, fn, "seqlens must hold B values");

  DecodeRef ref;
  ref.shape = s;
  ref.begin.resize(B * S);
  ref.end.resize(B * S);
  std::vector<int64_t> key_base(B * S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t lim = std::clamp<int64_t>(seqlens[b], 0, T) - S + 1 + i;  // causal: keys before lim
      ref.end[b * S + i] = std::max<int64_t>(0, lim);
      ref.begin[b * S + i] = params.window > 0 ? std::max<int64_t>(0, lim - params.window) : 0;
      key_base[b * S + i] = b * T;
    }
  ref.o.assign(B * S * HQ * D, 0.0);
  ref.lse.assign(B * S * HQ, -std::numeric_limits<double>::infinity());
  attend_rows(q, k, v, key_base, ref.begin, ref.end, HQ, HKV, D, resolved_scale(params.softmax_scale, D),
              params.softcap, num_threads, ref.o, ref.lse);
  return ref;
}

// ---- prefill -------------------------------------------------------------------------------------------------

PrefillRef prefill_reference(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                             const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& cu_seqlens_k,
                             const PrefillShape& s, const PrefillRefParams& params, int num_threads) {
  const char* fn = "prefill_reference";
  require(s.batch >= 0 && s.num_kv_heads > 0 && s.num_q_heads > 0 && s.head_dim > 0, fn,
          "batch must be >= 0, the head counts and head_dim > 0");
  require(s.num_q_heads % s.num_kv_heads == 0, fn, "num_q_heads must be a multiple of num_kv_heads");
  require(params.window >= 0 && params.softcap >= 0.0f, fn, "window and softcap must be >= 0");
  const int64_t B = s.batch, HQ = s.num_q_heads, HKV = s.num_kv_heads, D = s.head_dim;
  const auto check_cu = [&](const std::vector<int32_t>& cu, const char* name) {
    require(static_cast<int64_t>(cu.size()) == B + 1, fn, std::string(name) + " must hold B + 1 values");
    require(cu[0] == 0, fn, std::string(name) + " must start at 0");
    for (int64_t b = 0; b < B; ++b)
      require(cu[b + 1] >= cu[b], fn, std::string(name) + " must not decrease (at " + std::to_string(b) + ")");
    return static_cast<int64_t>(cu[B]);
  };
  const int64_t total_q = check_cu(cu_seqlens_q, "cu_seqlens_q"), total_k = check_cu(cu_seqlens_k, "cu_seqlens_k");
  require(static_cast<int64_t>(q.size()) == total_q * HQ * D, fn,
          "q must hold total_q·HQ·D = " + std::to_string(total_q * HQ * D) + " values, got " +
              std::to_string(q.size()));
  require(static_cast<int64_t>(k.size()) == total_k * HKV * D && k.size() == v.size(), fn,
          "k and v must hold total_k·HKV·D = " + std::to_string(total_k * HKV * D) + " values, got " +
              std::to_string(k.size()) + " and " + std::to_string(v.size()));

  PrefillRef ref;
  ref.shape = s;
  ref.total_q = total_q;
  ref.begin.resize(total_q);
  ref.end.resize(total_q);
  std::vector<int64_t> key_base(total_q);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t sq = cu_seqlens_q[b + 1] - cu_seqlens_q[b], sk = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    for (int64_t i = 0; i < sq; ++i) {
      const int64_t r = cu_seqlens_q[b] + i, pos = sk - sq + i;  // bottom-right aligned
      const int64_t hi = params.causal ? std::clamp<int64_t>(pos + 1, 0, sk) : sk;
      const int64_t lo = params.window > 0 ? std::clamp<int64_t>(pos + 1 - params.window, 0, sk) : 0;
      ref.begin[r] = lo;
      ref.end[r] = std::max(lo, hi);
      key_base[r] = cu_seqlens_k[b];
    }
  }
  ref.o.assign(total_q * HQ * D, 0.0);
  ref.lse.assign(total_q * HQ, -std::numeric_limits<double>::infinity());
  attend_rows(q, k, v, key_base, ref.begin, ref.end, HQ, HKV, D, resolved_scale(params.softmax_scale, D),
              params.softcap, num_threads, ref.o, ref.lse);
  return ref;
}

DecodeCheck check_decode_output(const DecodeRef& ref, const uint16_t* o, DType o_dtype, int64_t o_stride_b,
                                int64_t o_stride_h, const float* lse, int64_t lse_stride_b, int64_t lse_stride_h,
                                const DecodeTolerance& tol) {
  const char* fn = "check_decode_output";
  require(o_dtype == DType::kBF16 || o_dtype == DType::kFP16, fn, "o_dtype must be bf16 or fp16");
  const DecodeShape& s = ref.shape;
  const int64_t B = int64_t{s.batch} * s.num_new, HQ = s.num_q_heads, D = s.head_dim;  // B: query tokens b·S + i
  require(static_cast<int64_t>(ref.o.size()) == B * HQ * D && static_cast<int64_t>(ref.lse.size()) == B * HQ, fn,
          "the reference's o / lse do not match its shape");
  require(o != nullptr || B * HQ == 0, fn, "o is null");
  const auto value = [&](uint16_t bits) {
    return o_dtype == DType::kFP16 ? static_cast<double>(host::fp16_to_f32(bits))
                                   : static_cast<double>(host::bf16_to_f32(bits));
  };

  DecodeCheck r;
  std::string first;
  int64_t failures = 0;
  const auto fail = [&](auto&& make_msg) {
    if (failures++ == 0) first = make_msg();
  };
  const auto where = [](int64_t b, int64_t h) { return "(b " + std::to_string(b) + ", h " + std::to_string(h) + ")"; };

  double err2 = 0.0, ref2 = 0.0;
  int64_t worst_b = -1, worst_h = -1, rows_over = 0;
  for (int64_t b = 0; b < B; ++b) {
    const bool empty = ref.end[b] <= ref.begin[b];
    for (int64_t h = 0; h < HQ; ++h) {
      const uint16_t* orow = o + b * o_stride_b + h * o_stride_h;
      const double* rrow = &ref.o[(b * HQ + h) * D];
      double row_err2 = 0.0, row_ref2 = 0.0;
      bool row_bad = false;  // one failure reported per row
      for (int64_t d = 0; d < D; ++d) {
        const double got = value(orow[d]);
        r.compared++;
        if (!std::isfinite(got)) {
          r.nonfinite++;
          if (!row_bad)
            fail([&] { return "o" + where(b, h) + " element " + std::to_string(d) + " is " + fmt(got) +
                              ", expected " + fmt(rrow[d]); });
          row_bad = true;
          continue;
        }
        if (empty) {
          if (got != 0.0 && !row_bad) {
            r.empty_rows_bad++;
            row_bad = true;
            fail([&] {
              return "o" + where(b, h) + " has no keys but element " + std::to_string(d) + " is " + fmt(got);
            });
          }
          continue;
        }
        const double diff = got - rrow[d];
        row_err2 += diff * diff;
        row_ref2 += rrow[d] * rrow[d];
      }
      if (!empty) {
        err2 += row_err2;
        ref2 += row_ref2;
        const double row_err = row_ref2 > 0.0 ? std::sqrt(row_err2 / row_ref2) : std::sqrt(row_err2);
        if (row_err > r.worst_row_error) {
          r.worst_row_error = row_err;
          worst_b = b;
          worst_h = h;
        }
        if (tol.row_rtol > 0.0 && row_err > tol.row_rtol) {
          rows_over++;
          fail([&] {
            return "o" + where(b, h) + " relative error " + fmt(row_err) + " > row_rtol " + fmt(tol.row_rtol);
          });
        }
      }
      if (lse) {
        const double got = lse[b * lse_stride_b + h * lse_stride_h];
        if (empty) {
          if (!(std::isinf(got) && got < 0)) {
            if (!row_bad) r.empty_rows_bad++;
            fail([&] { return "lse" + where(b, h) + " has no keys but is " + fmt(got) + ", expected -inf"; });
          }
        } else if (!std::isfinite(got)) {
          r.nonfinite++;
          fail([&] { return "lse" + where(b, h) + " is " + fmt(got) + ", expected " + fmt(ref.lse[b * HQ + h]); });
        } else {
          const double want = ref.lse[b * HQ + h], e = std::fabs(got - want);
          const double bound = std::max(tol.lse_atol, tol.lse_rtol * std::fabs(want));
          r.lse_max_error = std::max(r.lse_max_error, e);
          if (!(e <= bound))
            fail([&] { return "lse" + where(b, h) + " is " + fmt(got) + ", expected " + fmt(want) + " (|diff| > " +
                              fmt(bound) + " = max(lse_atol " + fmt(tol.lse_atol) + ", lse_rtol " +
                              fmt(tol.lse_rtol) + " · |expected|))"; });
        }
      }
    }
  }
  r.error = ref2 > 0.0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  std::string summary = "o relative Frobenius error " + fmt(r.error) + (r.error <= tol.o_rtol ? " <= " : " > ") +
                        "o_rtol " + fmt(tol.o_rtol);
  if (worst_b >= 0) summary += "; worst row" + where(worst_b, worst_h) + " " + fmt(r.worst_row_error);
  if (rows_over) summary += "; " + std::to_string(rows_over) + " rows over row_rtol";
  if (lse) summary += "; lse max |diff| " + fmt(r.lse_max_error);
  if (r.nonfinite) summary += "; " + std::to_string(r.nonfinite) + " non-finite values";
  if (r.empty_rows_bad) summary += "; " + std::to_string(r.empty_rows_bad) + " rows without keys not zero / -inf";
  r.ok = failures == 0 && r.error <= tol.o_rtol;
  r.message = failures ? first + " [" + std::to_string(failures) + " failures; " + summary + "]" : summary;
  return r;
}

DecodeCheck check_decode_output(const DecodeRef& ref, const std::vector<uint16_t>& o, DType o_dtype,
                                const std::vector<float>& lse, const DecodeTolerance& tol) {
  const DecodeShape& s = ref.shape;
  const int64_t B = int64_t{s.batch} * s.num_new, HQ = s.num_q_heads, D = s.head_dim;
  require(static_cast<int64_t>(o.size()) == B * HQ * D, "check_decode_output", "o must hold B·S·HQ·D values");
  require(lse.empty() || static_cast<int64_t>(lse.size()) == B * HQ, "check_decode_output",
          "lse must be empty or hold B·S·HQ values");
  return check_decode_output(ref, o.data(), o_dtype, HQ * D, D, lse.empty() ? nullptr : lse.data(), HQ, 1, tol);
}

}  // namespace tessera::reference
