// tessera-bench: counter-based input generators on the GPU and the --check helpers (device_random.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/check.h"
#include "device_random.h"

namespace tessera::bench::gen {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHeads = 32;  // KV heads a cache fill takes by value

// splitmix64's finalizer over (seed, counter): element `i` of a fill is hash(seed, i).
__host__ __device__ inline uint64_t hash(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// [0, 1) from the top 24 bits.
__device__ inline float unit(uint64_t h) { return static_cast<float>(h >> 40) * 0x1.0p-24f; }

// Roughly N(0, 1): Irwin-Hall of the four 16-bit lanes of h, each taken at the centre of its step, scaled to unit
// variance; the sum of the lanes is an integer, so the value is never exactly 0.
__device__ inline float normal(uint64_t h) {
  const float s = static_cast<float>((h & 0xFFFF) + ((h >> 16) & 0xFFFF) + ((h >> 32) & 0xFFFF) + (h >> 48));
  return ((s + 2.5f) * 0x1.0p-16f - 2.0f) * 1.7320508f;
}

__device__ inline float exp2_uniform(uint64_t h, float lo, float hi) { return exp2f(lo + (hi - lo) * unit(h)); }

int blocks_for(int64_t n) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 20))); }

// ---- floats ----------------------------------------------------------------------------------------------------
template <typename T>
__device__ inline T from_float(float v);
template <>
__device__ inline float from_float<float>(float v) { return v; }
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ inline __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__global__ void __launch_bounds__(kThreads) fill_float_kernel(T* dst, int64_t count, uint64_t seed, FloatDist d) {
  const uint64_t mag_seed = hash(seed, 0xA5A5A5A5ull);
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < count; i += int64_t{gridDim.x} * kThreads) {
    const uint64_t h = hash(seed, static_cast<uint64_t>(i));
    float v = d.kind == FloatDist::kNormal
                  ? d.stddev * normal(h)
                  : d.lo + (d.hi - d.lo) * ((static_cast<float>(h & 0xFFFF) + 0.5f) * 0x1.0p-16f);
    if (d.row > 0) v *= exp2_uniform(hash(mag_seed, static_cast<uint64_t>(i / d.row)), d.log2_mag_lo, d.log2_mag_hi);
    dst[i] = from_float<T>(v);
  }
}

// ---- fp8, scales, integers ---------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) fill_e4m3_kernel(uint8_t* dst, int64_t count, uint64_t seed) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < count; i += int64_t{gridDim.x} * kThreads) {
    const uint32_t b = static_cast<uint32_t>(hash(seed, static_cast<uint64_t>(i)) & 0xFFFF);
    const uint32_t drop = static_cast<uint32_t>(__ffs((b >> 4) | 0x1000u) - 1);  // trailing zeros, <= 12
    uint32_t v = ((b & 1u) << 7) | ((15u - drop) << 3) | ((b >> 1) & 7u);
    if ((v & 0x7Fu) == 0x7Fu) --v;  // 0x7F / 0xFF are NaN: take 448 instead
    dst[i] = static_cast<uint8_t>(v);
  }
}

__global__ void __launch_bounds__(kThreads) fill_exp2_kernel(float* dst, int64_t count, uint64_t seed, float lo,
                                                             float hi) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < count; i += int64_t{gridDim.x} * kThreads)
    dst[i] = exp2_uniform(hash(seed, static_cast<uint64_t>(i)), lo, hi);
}

__global__ void __launch_bounds__(kThreads) fill_int_kernel(int32_t* dst, int64_t count, uint64_t seed, int32_t lo,
                                                            uint32_t range) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < count; i += int64_t{gridDim.x} * kThreads)
    dst[i] = lo + static_cast<int32_t>(hash(seed, static_cast<uint64_t>(i)) % range);
}

// One thread per token: rejection sampling of distinct experts (topk <= 32 << num_experts in practice, so a retry
// is rare); draw a of token t uses counter t·2^20 + a.
__global__ void __launch_bounds__(kThreads) fill_topk_kernel(int32_t* ids, int64_t tokens, int topk, int num_experts,
                                                             uint64_t seed) {
  const int64_t t = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (t >= tokens) return;
  int32_t chosen[32];
  uint64_t attempt = 0;
  for (int j = 0; j < topk; ++j) {
    int32_t e;
    bool dup;
    do {
      e = static_cast<int32_t>(hash(seed, (static_cast<uint64_t>(t) << 20) + attempt++) %
                               static_cast<uint64_t>(num_experts));
      dup = false;
      for (int i = 0; i < j; ++i) dup |= chosen[i] == e;
    } while (dup);
    chosen[j] = e;
    ids[t * topk + j] = e;
  }
}

// ---- KV cache ----------------------------------------------------------------------------------------------------
struct KVParams {
  attention::KVFormat format;
  int64_t batch, capacity;
  int hkv, d, page_size, chunk, row_bytes, num_pairs;  // num_pairs: 2·NG fp16 per row (2·D per key block)
  const int32_t* table;
  uint64_t seed;
  float mag[kMaxHeads];
  float fp8_scale[kMaxHeads];
};

// fp16 round to nearest even, ±inf saturated to ±65504 (reference::fp16_rne_sat).
__device__ inline uint16_t fp16_sat_bits(float x) {
  uint16_t h = __half_as_ushort(__float2half_rn(x));
  if ((h & 0x7FFF) == 0x7C00) h = static_cast<uint16_t>((h & 0x8000) | 0x7BFF);
  return h;
}

// Element i of logical row `row` ((b·T + t)·HKV + h) of a cache fill: bf16 m_h·N(0, 1), as a float.
__device__ inline float kv_value(const KVParams& p, int64_t row, int i, float mag) {
  return __bfloat162float(__float2bfloat16_rn(mag * normal(hash(p.seed, static_cast<uint64_t>(row * p.d + i)))));
}

// Physical row of token t of sequence b in the contiguous or paged layout (times HKV: add the head).
__device__ inline int64_t kv_token_row(const KVParams& p, int64_t b, int64_t t) {
  if (p.page_size <= 0) return b * p.capacity + t;
  const int64_t page = p.table[b * (p.capacity / p.page_size) + t / p.page_size];
  return page * p.page_size + t % p.page_size;
}

// The (scale, offset) bits of the range [lo, hi] and the code of x under them (attention.h's integer rule).
struct IntRange {
  uint16_t scale_bits, offset_bits;
  float scale, offset, levels;
  __device__ IntRange(float lo, float hi, float lv) : levels(lv) {
    scale_bits = fp16_sat_bits((hi - lo) / levels);
    offset_bits = fp16_sat_bits(lo);
    scale = __half2float(__ushort_as_half(scale_bits));
    offset = __half2float(__ushort_as_half(offset_bits));
  }
  __device__ uint32_t code(float x) const {
    float q = 0.0f;
    if (scale != 0.0f) {
      q = rintf((x - offset) / scale);
      if (!(q >= 0.0f)) q = 0.0f;
      q = fminf(q, levels);
    }
    return static_cast<uint32_t>(q);
  }
};

// Keys of a per-channel format: one thread per (sequence, 32-token block, head, channel pair 2c, 2c + 1), two passes
// over the block's 32 rows (lo / hi per channel, then the codes; the values regenerated in each).
__global__ void __launch_bounds__(kThreads) fill_key_blocks_kernel(const KVParams p, uint8_t* data, uint16_t* pairs) {
  const int64_t pairs_per_row = p.d / 2, blocks = p.capacity / attention::kKeyBlock;
  const int64_t idx = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (idx >= p.batch * blocks * p.hkv * pairs_per_row) return;
  const int c = static_cast<int>(idx % pairs_per_row);
  const int h = static_cast<int>(idx / pairs_per_row % p.hkv);
  const int64_t j = idx / (pairs_per_row * p.hkv) % blocks, b = idx / (pairs_per_row * p.hkv * blocks);
  const float mag = p.mag[h];
  const int d0 = 2 * c, d1 = 2 * c + 1;
  const int64_t t0 = j * attention::kKeyBlock;
  float lo0 = INFINITY, hi0 = -INFINITY, lo1 = INFINITY, hi1 = -INFINITY;
  for (int r = 0; r < attention::kKeyBlock; ++r) {
    const int64_t row = ((b * p.capacity + t0 + r) * p.hkv + h);
    const float x0 = kv_value(p, row, d0, mag), x1 = kv_value(p, row, d1, mag);
    lo0 = fminf(lo0, x0), hi0 = fmaxf(hi0, x0), lo1 = fminf(lo1, x1), hi1 = fmaxf(hi1, x1);
  }
  const float levels = p.format == attention::KVFormat::kInt8KChannel ? 255.0f : 15.0f;
  const IntRange r0(lo0, hi0, levels), r1(lo1, hi1, levels);
  // The block's pairs: [outer, slots / 32, HKV, 2·D]; a block never straddles a page (page_size % 32 == 0).
  const int64_t first = kv_token_row(p, b, t0);  // the block's first token row: outer · slots + 32·(block in outer)
  uint16_t* pr = pairs + (first / attention::kKeyBlock * p.hkv + h) * p.num_pairs;
  pr[d0] = r0.scale_bits, pr[d1] = r1.scale_bits;
  pr[p.d + d0] = r0.offset_bits, pr[p.d + d1] = r1.offset_bits;
  const bool int8 = p.format == attention::KVFormat::kInt8KChannel;
  for (int r = 0; r < attention::kKeyBlock; ++r) {
    const int64_t row = ((b * p.capacity + t0 + r) * p.hkv + h);
    uint8_t* out = data + ((first + r) * p.hkv + h) * p.row_bytes;
    const uint32_t q0 = r0.code(kv_value(p, row, d0, mag)), q1 = r1.code(kv_value(p, row, d1, mag));
    if (int8) {
      out[d0] = static_cast<uint8_t>(q0);
      out[d1] = static_cast<uint8_t>(q1);
    } else {
      out[c] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

// One thread per (row, chunk): a chunk is a scale group of the integer formats, 32 elements otherwise. The values
// are regenerated in each pass (min/max, then codes) rather than held in registers.
__global__ void __launch_bounds__(kThreads) fill_kv_kernel(const KVParams p, uint8_t* data, uint16_t* pairs) {
  const int chunks = p.d / p.chunk;
  const int64_t idx = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (idx >= p.batch * p.capacity * p.hkv * chunks) return;
  const int64_t row = idx / chunks;  // logical (b·T + t)·HKV + h
  const int c = static_cast<int>(idx % chunks), h = static_cast<int>(row % p.hkv);
  const int64_t tok = row / p.hkv, t = tok % p.capacity, b = tok / p.capacity;
  const int64_t phys = kv_token_row(p, b, t) * p.hkv + h;
  const float mag = p.mag[h];
  const int i0 = c * p.chunk;
  const auto value = [&](int i) { return kv_value(p, row, i, mag); };
  uint8_t* out = data + phys * p.row_bytes;
  switch (p.format) {
    case attention::KVFormat::kNative: {
      uint16_t* o = reinterpret_cast<uint16_t*>(out);
      for (int i = i0; i < i0 + p.chunk; ++i) o[i] = __bfloat16_as_ushort(__float2bfloat16_rn(value(i)));
      return;
    }
    case attention::KVFormat::kFP8:
      for (int i = i0; i < i0 + p.chunk; ++i)
        out[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(value(i) / p.fp8_scale[h], __NV_SATFINITE, __NV_E4M3));
      return;
    default: break;
  }
  // kInt8 and the values of kInt8KChannel: 255 levels; the int4 formats: 15.
  const bool int4 = p.format != attention::KVFormat::kInt8 && p.format != attention::KVFormat::kInt8KChannel;
  const float levels = int4 ? 15.0f : 255.0f;
  float lo = value(i0), hi = lo;
  for (int i = i0 + 1; i < i0 + p.chunk; ++i) {
    const float x = value(i);
    lo = fminf(lo, x);
    hi = fmaxf(hi, x);
  }
  const IntRange range(lo, hi, levels);
  uint16_t* pr = pairs + phys * p.num_pairs + 2 * c;
  pr[0] = range.scale_bits;
  pr[1] = range.offset_bits;
  const auto code = [&](int i) { return range.code(value(i)); };
  if (!int4) {
    for (int i = i0; i < i0 + p.chunk; ++i) out[i] = static_cast<uint8_t>(code(i));
  } else {
    for (int i = i0; i < i0 + p.chunk; i += 2) out[i / 2] = static_cast<uint8_t>(code(i) | (code(i + 1) << 4));
  }
}

// ---- --check helpers ---------------------------------------------------------------------------------------------
// Elem: uint4 when the rows and both bases are 16-byte aligned, else bytes.
template <typename Elem>
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const Elem* src, int64_t row_elems,
                                                               const int64_t* rows, int64_t n, Elem* dst) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const Elem* s = src + rows[r] * row_elems;
    Elem* d = dst + r * row_elems;
    for (int64_t j = threadIdx.x; j < row_elems; j += kThreads) d[j] = s[j];
  }
}

__global__ void __launch_bounds__(kThreads) amax16_kernel(const uint16_t* x, bool bf16, int64_t count, float* amax) {
  float m = 0.0f;
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < count; i += int64_t{gridDim.x} * kThreads) {
    const float v = bf16 ? __bfloat162float(__ushort_as_bfloat16(x[i])) : __half2float(__ushort_as_half(x[i]));
    if (isfinite(v)) m = fmaxf(m, fabsf(v));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  // Non-negative floats order as their bit patterns.
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

void check_launch() { TESSERA_CUDA_CHECK(cudaGetLastError()); }

}  // namespace

uint64_t sub_seed(uint64_t seed, uint64_t salt) { return hash(seed, salt ^ 0x5EED5EED00000000ull); }

void fill_float(void* dst, DType dtype, int64_t count, uint64_t seed, const FloatDist& dist, cudaStream_t stream) {
  if (count <= 0) return;
  const int blocks = blocks_for(count);
  switch (dtype) {
    case DType::kFP32:
      fill_float_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<float*>(dst), count, seed, dist);
      break;
    case DType::kBF16:
      fill_float_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), count, seed, dist);
      break;
    case DType::kFP16:
      fill_float_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<__half*>(dst), count, seed, dist);
      break;
    default: throw Error(std::string("tessera-bench: fill_float: unsupported dtype ") + dtype_name(dtype));
  }
  check_launch();
}

void fill_e4m3(uint8_t* dst, int64_t count, uint64_t seed, cudaStream_t stream) {
  if (count <= 0) return;
  fill_e4m3_kernel<<<blocks_for(count), kThreads, 0, stream>>>(dst, count, seed);
  check_launch();
}

void fill_exp2(float* dst, int64_t count, uint64_t seed, float log2_lo, float log2_hi, cudaStream_t stream) {
  if (count <= 0) return;
  fill_exp2_kernel<<<blocks_for(count), kThreads, 0, stream>>>(dst, count, seed, log2_lo, log2_hi);
  check_launch();
}

void fill_int(int32_t* dst, int64_t count, uint64_t seed, int32_t lo, int32_t hi, cudaStream_t stream) {
  if (count <= 0) return;
  if (hi <= lo) throw Error("tessera-bench: fill_int: empty range");
  fill_int_kernel<<<blocks_for(count), kThreads, 0, stream>>>(dst, count, seed, lo,
                                                              static_cast<uint32_t>(int64_t{hi} - lo));
  check_launch();
}

void fill_topk_ids(int32_t* ids, int64_t tokens, int topk, int num_experts, uint64_t seed, cudaStream_t stream) {
  if (topk < 1 || topk > 32 || topk > num_experts)
    throw Error("tessera-bench: fill_topk_ids: need 1 <= topk <= min(32, num_experts), got topk " +
                std::to_string(topk) + ", " + std::to_string(num_experts) + " experts");
  if (tokens <= 0) return;
  fill_topk_kernel<<<static_cast<int>((tokens + kThreads - 1) / kThreads), kThreads, 0, stream>>>(ids, tokens, topk,
                                                                                                num_experts, seed);
  check_launch();
}

void fill_kv_cache(const KVCacheFill& f, void* data, uint16_t* pairs, uint64_t seed, cudaStream_t stream) {
  using attention::KVFormat;
  if (f.hkv < 1 || f.hkv > kMaxHeads || static_cast<int>(f.head_mag.size()) != f.hkv)
    throw Error("tessera-bench: fill_kv_cache: need 1..32 KV heads and one magnitude per head");
  if (f.format == KVFormat::kFP8 && static_cast<int>(f.fp8_scale.size()) != f.hkv)
    throw Error("tessera-bench: fill_kv_cache: kFP8 needs one scale per KV head");
  if (f.page_size > 0 && (f.capacity % f.page_size != 0 || f.block_table == nullptr))
    throw Error("tessera-bench: fill_kv_cache: paged caches need capacity % page_size == 0 and a block table");
  KVParams p{};
  p.format = f.format;
  p.batch = f.batch;
  p.capacity = f.capacity;
  p.hkv = f.hkv;
  p.d = f.head_dim;
  p.page_size = f.page_size;
  p.table = f.block_table;
  p.seed = seed;
  const bool channel = f.format == KVFormat::kInt8KChannel || f.format == KVFormat::kInt4KChannel;
  const bool grouped = f.format == KVFormat::kInt4Group32;
  const bool whole_row = f.format == KVFormat::kInt8 || f.format == KVFormat::kInt4 || channel;
  p.chunk = grouped ? attention::kInt4GroupSize : whole_row ? f.head_dim : (f.head_dim % 32 == 0 ? 32 : f.head_dim);
  const bool byte_codes = f.format == KVFormat::kInt8 || f.format == KVFormat::kInt8KChannel ||
                          f.format == KVFormat::kNative || f.format == KVFormat::kFP8;
  if (f.head_dim % p.chunk != 0 || (!byte_codes && p.chunk % 2 != 0) || (channel && f.head_dim % 2 != 0))
    throw Error("tessera-bench: fill_kv_cache: head_dim " + std::to_string(f.head_dim) + " does not fit the format");
  if (channel && f.keys &&
      (f.capacity % attention::kKeyBlock != 0 || (f.page_size > 0 && f.page_size % attention::kKeyBlock != 0)))
    throw Error("tessera-bench: fill_kv_cache: per-channel keys need capacity and page_size multiples of 32");
  const int ng = grouped ? f.head_dim / attention::kInt4GroupSize : whole_row ? 1 : 0;
  p.num_pairs = channel && f.keys ? 2 * f.head_dim : 2 * ng;
  p.row_bytes = f.format == KVFormat::kNative ? 2 * f.head_dim
                : (f.format == KVFormat::kFP8 || f.format == KVFormat::kInt8 || f.format == KVFormat::kInt8KChannel)
                    ? f.head_dim
                    : f.head_dim / 2;
  for (int h = 0; h < f.hkv; ++h) {
    p.mag[h] = f.head_mag[h];
    p.fp8_scale[h] = f.format == KVFormat::kFP8 ? f.fp8_scale[h] : 1.0f;
  }
  if (channel && f.keys) {
    const int64_t threads = f.batch * (f.capacity / attention::kKeyBlock) * f.hkv * (f.head_dim / 2);
    if (threads <= 0) return;
    fill_key_blocks_kernel<<<static_cast<int>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        p, static_cast<uint8_t*>(data), pairs);
    check_launch();
    return;
  }
  const int64_t threads = f.batch * f.capacity * f.hkv * (f.head_dim / p.chunk);
  if (threads <= 0) return;
  fill_kv_kernel<<<static_cast<int>((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      p, static_cast<uint8_t*>(data), pairs);
  check_launch();
}

void gather_rows(const void* src, int64_t row_bytes, const int64_t* rows, int64_t n, void* dst, cudaStream_t stream) {
  if (n <= 0 || row_bytes <= 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(n, 65535));
  const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (wide)
    gather_rows_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint4*>(src), row_bytes / 16, rows, n,
                                                        static_cast<uint4*>(dst));
  else
    gather_rows_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint8_t*>(src), row_bytes, rows, n,
                                                        static_cast<uint8_t*>(dst));
  check_launch();
}

void amax16(const uint16_t* x, DType dtype, int64_t count, float* amax, cudaStream_t stream) {
  TESSERA_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (count <= 0) return;
  amax16_kernel<<<std::min(blocks_for(count), 4096), kThreads, 0, stream>>>(x, dtype == DType::kBF16, count, amax);
  check_launch();
}

void interleave_pairs(uint16_t* dst, const uint16_t* a, const uint16_t* b, int64_t count, cudaStream_t stream) {
  TESSERA_CUDA_CHECK(
      cudaMemcpy2DAsync(dst, 4, a, 2, 2, static_cast<std::size_t>(count), cudaMemcpyDeviceToDevice, stream));
  TESSERA_CUDA_CHECK(
      cudaMemcpy2DAsync(dst + 1, 4, b, 2, 2, static_cast<std::size_t>(count), cudaMemcpyDeviceToDevice, stream));
}

}  // namespace tessera::bench::gen
