// W8A8 activation quantizer: x [M, K] (bf16 / fp16 / fp32) to int8 codes with a scale, a zero point and the code sum
// per (row, block of K columns) in the block-major fp32 parameter planes of tessera/w8a8.h, in one pass over x. The
// arithmetic is that of tessera::reference::quantize_int8_blocks step for step (docs/perf/w8a8.md): each fp32
// operation an IEEE one rounded to nearest even, none fused, so codes, scales and zero points match it bit for bit.
//
// Decomposition. A thread owns chunks of 64 bytes of x (32 16-bit or 16 fp32 values: two or one 16-column segments,
// read by 16-byte loads) and keeps them in registers from the range reduction to the codes:
//   quantize_groups_kernel  blocks of 32 / 64 / 128 columns, and whole rows of at most 32 chunks: a block belongs to
//                           G = 1..32 consecutive lanes of a warp, which reduce its range and its code sum by xor
//                           shuffles. CTAs of 256 threads tile [rows] x [the lanes of a row].
//   quantize_rows_kernel    one block per row (per token) over longer rows: a CTA per row, each thread holding up to
//                           kRowChunks chunks, the range and the sum reduced through shared memory. Rows longer than
//                           the CTA can hold are read twice (the second read mostly from L2).
// Codes leave as 16-byte stores; the parameters from a block's first lane through shared memory, so that a block's
// consecutive rows are stored together (groups kernel), or from thread 0 (rows kernel).
//
// Rounding without the conversion unit: for |y| < 2^22, y + 1.5·2^23 rounded to nearest even holds rint(y) in its
// low mantissa bits, so the code's byte is the low byte of bits(y + 1.5·2^23) + z. Clamping y to [qmin − z, 127 − z]
// before the rounding equals clamping rint(y) + z afterwards (rint is monotone and the bounds are integers), and
// y = rn(v · inv) is monotone in v, so a block whose extreme values need no clamp needs none anywhere: the clamps run
// only for the (rare) warps holding such a block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "common/device_info.h"
#include "common/validate.h"
#include "linear/w8a8/check.h"
#include "tessera/w8a8.h"

namespace tessera::linear {
namespace {

using ::tessera::detail::ArgCheck;

constexpr int kChunkBytes = 64;
constexpr int kChunkWords = kChunkBytes / 4;
template <class T>
constexpr int kChunkElems = kChunkBytes / static_cast<int>(sizeof(T));
template <class T>
constexpr int kChunkSegs = kChunkElems<T> / 16;  // 16-column segments per chunk: 2 (16-bit x) or 1 (fp32 x)
constexpr int kGroupThreads = 256;
constexpr int kRowChunks = 2;  // chunks a rows-kernel thread holds: 128 bytes of x in flight per thread
constexpr int kRowMaxThreads = 1024;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 · 2^23
constexpr uint32_t kFullMask = 0xFFFFFFFFu;

struct QuantizeArgs {
  const void* x;
  int64_t ldx;
  int8_t* codes;
  int64_t ldc;
  float* scale;  // the parameter planes: (row r, block i) at i · ld_params + r
  float* zero;   // null: symmetric
  float* sums;   // null: not wanted
  int64_t ld_params;
  int64_t m;
  int block, num_blocks;
  int segs_per_block;  // block / 16
  int group_shift;     // groups kernel: log2(lanes per block)
};

// The parameters of a groups-kernel CTA's tile of blocks × rows (at most one block per thread).
struct alignas(16) GroupSmem {
  float scale[kGroupThreads], zero[kGroupThreads], sum[kGroupThreads];
};

struct Chunk {
  uint32_t w[kChunkWords];
};

// The first `segs` segments of a chunk starting at `src`; the others 0 (0 is in every block's range already).
template <class T, bool kVec>
__device__ __forceinline__ void load_chunk(const T* src, int segs, Chunk& c) {
  constexpr int kSegWords = kChunkWords / kChunkSegs<T>;
#pragma unroll
  for (int s = 0; s < kChunkSegs<T>; ++s) {
    if constexpr (kVec) {
#pragma unroll
      for (int i = 0; i < kSegWords / 4; ++i) {
        const uint4 v = s < segs ? __ldg(reinterpret_cast<const uint4*>(src + s * 16) + i) : make_uint4(0u, 0u, 0u, 0u);
        c.w[s * kSegWords + 4 * i] = v.x;
        c.w[s * kSegWords + 4 * i + 1] = v.y;
        c.w[s * kSegWords + 4 * i + 2] = v.z;
        c.w[s * kSegWords + 4 * i + 3] = v.w;
      }
    } else {
      // x not 16-byte aligned: element loads, the same chunk layout.
#pragma unroll
      for (int i = 0; i < kSegWords; ++i) {
        uint32_t w = 0;
        if (s < segs) {
          if constexpr (sizeof(T) == 4) {
            w = __ldg(reinterpret_cast<const uint32_t*>(src) + s * 16 + i);
          } else {
            const auto* h = reinterpret_cast<const uint16_t*>(src) + s * 16 + 2 * i;
            w = static_cast<uint32_t>(__ldg(h)) | static_cast<uint32_t>(__ldg(h + 1)) << 16;
          }
        }
        c.w[s * kSegWords + i] = w;
      }
    }
  }
}

// Element e of a chunk as fp32 (exact).
template <class T>
__device__ __forceinline__ float chunk_value(const Chunk& c, int e) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(c.w[e]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w = c.w[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xFFFF0000u) : (w << 16));
  } else {
    const uint32_t w = c.w[e >> 1];
    return __half2float(__ushort_as_half(static_cast<unsigned short>((e & 1) ? (w >> 16) : (w & 0xFFFFu))));
  }
}

// lo = min(lo, chunk), hi = max(hi, chunk). 16-bit values are compared in pairs (exact), then widened.
template <class T>
__device__ __forceinline__ void chunk_range(const Chunk& c, float& lo, float& hi) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < kChunkWords; ++i) {
      lo = fminf(lo, __uint_as_float(c.w[i]));
      hi = fmaxf(hi, __uint_as_float(c.w[i]));
    }
  } else {
    using T2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;
    T2 mn, mx;
    {
      const uint32_t w0 = c.w[0];
      mn = *reinterpret_cast<const T2*>(&w0);
      mx = mn;
    }
#pragma unroll
    for (int i = 1; i < kChunkWords; ++i) {
      const uint32_t w = c.w[i];
      mn = __hmin2(mn, *reinterpret_cast<const T2*>(&w));
      mx = __hmax2(mx, *reinterpret_cast<const T2*>(&w));
    }
    lo = fminf(lo, fminf(static_cast<float>(mn.x), static_cast<float>(mn.y)));
    hi = fmaxf(hi, fmaxf(static_cast<float>(mx.x), static_cast<float>(mx.y)));
  }
}

struct BlockParams {
  float scale, inv;
  float y_min, y_max;  // clamp bounds of rn(v · inv): qmin − z and 127 − z
  int zero;
  bool clamp;  // some value of the block needs the clamp
};

// lo = min(block ∪ {0}), hi = max(block ∪ {0}); the reference's steps, in its order.
__device__ __forceinline__ BlockParams block_params(float lo, float hi, bool symmetric) {
  BlockParams p;
  // max|x| = max(hi, −lo) because the range holds 0.
  float s = symmetric ? __fdiv_rn(fmaxf(hi, -lo), 127.0f) : __fdiv_rn(__fsub_rn(hi, lo), 255.0f);
  if (!(s > 0.0f)) s = 1.0f;
  p.scale = s;
  p.inv = __frcp_rn(s);  // correctly rounded, as 1.f / s
  float z = 0.0f, q_min = -127.0f;
  if (!symmetric) {
    z = fminf(fmaxf(rintf(__fsub_rn(-128.0f, __fmul_rn(lo, p.inv))), -128.0f), 127.0f);
    q_min = -128.0f;
  }
  p.zero = static_cast<int>(z);
  p.y_min = q_min - z;
  p.y_max = 127.0f - z;
  // The block's extreme codes come from its extreme values (a NaN or inf here, from an overflowing 1 / s, also
  // takes the clamped path).
  const float r_lo = rintf(__fmul_rn(lo, p.inv)), r_hi = rintf(__fmul_rn(hi, p.inv));
  p.clamp = !(r_lo >= p.y_min && r_hi <= p.y_max);
  return p;
}

// Codes of a chunk, four to a word (element 4i + j in byte j of word i).
template <class T, bool kClamp>
__device__ __forceinline__ void quantize_chunk(const Chunk& c, const BlockParams& p,
                                               uint32_t (&out)[kChunkElems<T> / 4]) {
#pragma unroll
  for (int i = 0; i < kChunkElems<T> / 4; ++i) {
    int b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float y = __fmul_rn(chunk_value<T>(c, 4 * i + j), p.inv);
      if constexpr (kClamp) y = fminf(fmaxf(y, p.y_min), p.y_max);
      b[j] = __float_as_int(__fadd_rn(y, kRoundMagic)) + p.zero;
    }
    out[i] = __byte_perm(__byte_perm(b[0], b[1], 0x0040), __byte_perm(b[2], b[3], 0x0040), 0x5410);
  }
}

// Stores the first `segs` segments' codes; returns their sum.
template <class T>
__device__ __forceinline__ int store_codes(const uint32_t (&out)[kChunkElems<T> / 4], int segs, int8_t* dst) {
  int sum = 0;
#pragma unroll
  for (int s = 0; s < kChunkSegs<T>; ++s)
    if (s < segs) {
      *reinterpret_cast<uint4*>(dst + 16 * s) = make_uint4(out[4 * s], out[4 * s + 1], out[4 * s + 2], out[4 * s + 3]);
#pragma unroll
      for (int i = 0; i < 4; ++i) sum = __dp4a(static_cast<int>(out[4 * s + i]), 0x01010101, sum);
    }
  return sum;
}

// Blocks held by G = 2^group_shift consecutive lanes: blockDim.x lanes along a row (a power of two up to 32, a
// multiple of G) × blockDim.y rows, so that a warp reads up to 2 KB of one row. Every loop bound is uniform over the
// CTA, so whole warps reach the shuffles and every thread the barriers; lanes past the last row or column carry
// zeros and write nothing. The parameters go through shared memory: the planes are block-major, and a block's
// consecutive rows leave as one run of stores instead of one scattered 4-byte store per block.
template <class T, bool kVec>
__global__ void __launch_bounds__(kGroupThreads) quantize_groups_kernel(const QuantizeArgs a) {
  constexpr int kSegs = kChunkSegs<T>;
  __shared__ GroupSmem sm;
  const int shift = a.group_shift, lanes = 1 << shift;
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int bx = static_cast<int>(blockDim.x), by = static_cast<int>(blockDim.y);
  const int tid = ty * bx + tx;
  const int g = tx & (lanes - 1);
  const int row_slots = a.num_blocks << shift;
  // Parameter stores: thread tid takes (block tid / by, row tid % by) of the CTA's tile.
  const int out_blk = tid / by, out_row = tid - out_blk * by;
  const bool out_thread = out_blk < (bx >> shift);
  for (int slot0 = blockIdx.x * bx; slot0 < row_slots; slot0 += gridDim.x * bx) {
    const int slot = slot0 + tx;
    const int blk = slot >> shift;
    const int seg0 = g * kSegs;
    const int col_segs = slot < row_slots ? min(max(a.segs_per_block - seg0, 0), kSegs) : 0;
    const int col = blk * a.block + seg0 * 16;
    for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * by; row0 < a.m;
         row0 += static_cast<int64_t>(gridDim.y) * by) {
      const int64_t row = row0 + ty;
      const int segs = row < a.m ? col_segs : 0;
      Chunk c;
      load_chunk<T, kVec>(static_cast<const T*>(a.x) + (segs > 0 ? row * a.ldx + col : 0), segs, c);
      float lo = 0.0f, hi = 0.0f;
      chunk_range<T>(c, lo, hi);
      for (int off = lanes >> 1; off > 0; off >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(kFullMask, lo, off));
        hi = fmaxf(hi, __shfl_xor_sync(kFullMask, hi, off));
      }
      const BlockParams p = block_params(lo, hi, a.zero == nullptr);
      uint32_t out[kChunkElems<T> / 4];
      if (__any_sync(kFullMask, segs > 0 && p.clamp))
        quantize_chunk<T, true>(c, p, out);
      else
        quantize_chunk<T, false>(c, p, out);
      int sum = store_codes<T>(out, segs, a.codes + (segs > 0 ? row * a.ldc + col : 0));
      if (a.sums != nullptr)
        for (int off = lanes >> 1; off > 0; off >>= 1) sum += __shfl_xor_sync(kFullMask, sum, off);
      if (g == 0) {
        const int at = (tx >> shift) * by + ty;
        sm.scale[at] = p.scale;
        sm.zero[at] = static_cast<float>(p.zero);
        sm.sum[at] = static_cast<float>(sum);
      }
      __syncthreads();
      if (out_thread) {
        const int64_t r = row0 + out_row;
        const int b = (slot0 >> shift) + out_blk;
        if (r < a.m && b < a.num_blocks) {
          const int64_t at = b * a.ld_params + r;
          const int from = out_blk * by + out_row;
          a.scale[at] = sm.scale[from];
          if (a.zero != nullptr) a.zero[at] = sm.zero[from];
          if (a.sums != nullptr) a.sums[at] = sm.sum[from];
        }
      }
      __syncthreads();  // the tile is read before the next rows overwrite it
    }
  }
}

struct alignas(16) RowSmem {
  float lo[32], hi[32];
  int sum[32];
};

__device__ __forceinline__ float warp_min(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fminf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// One block per row (block = K): a CTA per row, thread t holding chunks t, t + blockDim.x, ... of each pass of
// blockDim.x · kRowChunks chunks. blockDim.x is a multiple of 32.
template <class T, bool kVec>
__global__ void __launch_bounds__(kRowMaxThreads) quantize_rows_kernel(const QuantizeArgs a) {
  constexpr int kSegs = kChunkSegs<T>;
  __shared__ RowSmem sm;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int num_warps = static_cast<int>(blockDim.x) >> 5;
  const int segs_per_row = a.segs_per_block;
  const int chunks = (segs_per_row + kSegs - 1) / kSegs;
  const int per_pass = static_cast<int>(blockDim.x) * kRowChunks;
  const int passes = (chunks + per_pass - 1) / per_pass;
  for (int64_t row = blockIdx.x; row < a.m; row += gridDim.x) {
    const T* xr = static_cast<const T*>(a.x) + row * a.ldx;
    int8_t* cr = a.codes + row * a.ldc;
    Chunk c[kRowChunks];
    const auto chunk_of = [&](int pass, int i) { return (pass * kRowChunks + i) * static_cast<int>(blockDim.x) + tid; };
    const auto segs_of = [&](int chunk) { return min(max(segs_per_row - chunk * kSegs, 0), kSegs); };
    float lo = 0.0f, hi = 0.0f;
    for (int pass = 0; pass < passes; ++pass)
#pragma unroll
      for (int i = 0; i < kRowChunks; ++i) {
        const int chunk = chunk_of(pass, i), segs = segs_of(chunk);
        load_chunk<T, kVec>(xr + (segs > 0 ? chunk * kSegs * 16 : 0), segs, c[i]);
        chunk_range<T>(c[i], lo, hi);
      }
    lo = warp_min(lo);
    hi = warp_max(hi);
    if (lane == 0) sm.lo[warp] = lo, sm.hi[warp] = hi;
    __syncthreads();
    lo = warp_min(lane < num_warps ? sm.lo[lane] : 0.0f);
    hi = warp_max(lane < num_warps ? sm.hi[lane] : 0.0f);
    const BlockParams p = block_params(lo, hi, a.zero == nullptr);
    int sum = 0;
    for (int pass = 0; pass < passes; ++pass)
#pragma unroll
      for (int i = 0; i < kRowChunks; ++i) {
        const int chunk = chunk_of(pass, i), segs = segs_of(chunk);
        if (passes > 1) load_chunk<T, kVec>(xr + (segs > 0 ? chunk * kSegs * 16 : 0), segs, c[i]);
        uint32_t out[kChunkElems<T> / 4];
        if (p.clamp)
          quantize_chunk<T, true>(c[i], p, out);
        else
          quantize_chunk<T, false>(c[i], p, out);
        sum += store_codes<T>(out, segs, cr + (segs > 0 ? chunk * kSegs * 16 : 0));
      }
    if (a.sums != nullptr) {
      sum = warp_sum(sum);
      if (lane == 0) sm.sum[warp] = sum;
    }
    // Also orders this row's reads of sm.lo / sm.hi before the next row's writes.
    __syncthreads();
    if (warp == 0) {
      if (a.sums != nullptr) sum = warp_sum(lane < num_warps ? sm.sum[lane] : 0);
      if (lane == 0) {
        a.scale[row] = p.scale;  // block 0 of the planes
        if (a.zero != nullptr) a.zero[row] = static_cast<float>(p.zero);
        if (a.sums != nullptr) a.sums[row] = static_cast<float>(sum);
      }
    }
  }
}

int ceil_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

template <class T, bool kVec>
void launch_quantize(QuantizeArgs a, cudaStream_t stream) {
  constexpr int kSegs = kChunkSegs<T>;
  const int chunks_per_block = (a.segs_per_block + kSegs - 1) / kSegs;
  if (chunks_per_block > 32) {  // only block = K reaches here: a CTA per row
    const int threads =
        std::clamp((((chunks_per_block + kRowChunks - 1) / kRowChunks) + 31) / 32 * 32, 32, kRowMaxThreads);
    const int64_t grid = std::min<int64_t>(a.m, 0x7FFFFFFF);
    quantize_rows_kernel<T, kVec><<<static_cast<unsigned>(grid), threads, 0, stream>>>(a);
    TESSERA_CHECK_LAUNCH();
    return;
  }
  const int lanes = ceil_pow2(chunks_per_block);
  a.group_shift = 0;
  while ((1 << a.group_shift) < lanes) ++a.group_shift;
  // Up to a warp along a row (whole groups), the rest of the CTA along rows.
  const int row_slots = a.num_blocks * lanes;
  const int bx = std::min(ceil_pow2(row_slots), 32);
  const int by = kGroupThreads / bx;
  const int64_t gx = (row_slots + bx - 1) / bx;
  const int64_t gy = std::min<int64_t>((a.m + by - 1) / by, 65535);
  quantize_groups_kernel<T, kVec>
      <<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(bx, by), 0, stream>>>(a);
  TESSERA_CHECK_LAUNCH();
}

template <class T>
void launch_typed(const QuantizeArgs& a, cudaStream_t stream) {
  // 16-byte loads need every row start 16-byte aligned.
  const bool vec = reinterpret_cast<std::uintptr_t>(a.x) % 16 == 0 &&
                   (a.m <= 1 || (a.ldx * static_cast<int64_t>(sizeof(T))) % 16 == 0);
  if (vec)
    launch_quantize<T, true>(a, stream);
  else
    launch_quantize<T, false>(a, stream);
}

}  // namespace

void quantize_per_block(const TensorView& x, const Int8BlockTensor& out, cudaStream_t stream) {
  const ArgCheck check("tessera::linear::quantize_per_block");
  // Every shape, stride and overlap rule first, the device checks last: a bad call is named as such before any
  // question to the driver.
  check.dtype(x, "x", {DType::kBF16, DType::kFP16, DType::kFP32});
  check.rank(x, "x", 2);
  check.unit_inner_stride(x, "x");
  const int64_t m = x.shape[0], k = x.shape[1];
  if (m < 0) check.fail("x", "must have M >= 0 rows, got shape " + x.shape_str());
  constexpr int64_t kMaxK = int64_t{1} << 30;  // int column offsets in the kernels
  if (k <= 0 || k % 16 != 0 || k > kMaxK)
    check.fail("x", "must have K (dim 1) a positive multiple of 16 up to 2^30, got shape " + x.shape_str());
  if (x.strides[0] < 0) check.fail("x", "must have a non-negative row stride, got " + std::to_string(x.strides[0]));
  check.aligned(x, "x", static_cast<int>(dtype_size(x.dtype)));
  const int64_t block = out.block;
  w8a8::check_block(check, "out.block", block, k);
  w8a8::check_int8_blocks(check, out, "out", m, "M", k, /*need_sums=*/false);
  w8a8::ArgViews views;
  views.add(x, "x", /*output=*/false);
  views.add_blocks(out, "out", /*output=*/true);
  w8a8::check_disjoint(check, views);
  w8a8::check_on_device(check, views);
  if (m == 0) return;
  ::tessera::detail::require_hopper(check.op());

  QuantizeArgs a{};
  a.x = x.data;
  a.ldx = x.strides[0];
  a.codes = static_cast<int8_t*>(out.codes.data);
  a.ldc = out.codes.strides[0];
  a.scale = static_cast<float*>(out.scale.data);
  a.zero = static_cast<float*>(out.zero.data);
  a.sums = static_cast<float*>(out.sums.data);
  a.ld_params = out.scale.strides[0];
  a.m = m;
  a.block = static_cast<int>(block);
  a.num_blocks = static_cast<int>(k / block);
  a.segs_per_block = static_cast<int>(block / 16);
  switch (x.dtype) {
    case DType::kBF16:
      return launch_typed<__nv_bfloat16>(a, stream);
    case DType::kFP16:
      return launch_typed<__half>(a, stream);
    default:
      return launch_typed<float>(a, stream);
  }
}

}  // namespace tessera::linear
