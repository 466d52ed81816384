// Unit tests of the PTX wrappers (src/ptx) and the stage ring (src/pipeline), each on its own small kernel:
//   - TMA 3-D tile loads with the 128-byte swizzle, completing on an mbarrier, with out-of-bounds rows;
//   - wgmma m64nNk32 e4m3 and m64nNk16 bf16 on TMA-loaded tiles, against a float64 product, which checks the
//     shared-memory descriptors, the K advance inside a swizzled row and the accumulator layout;
//   - a producer/consumer ring over many phases (the parity bookkeeping of PipelineState and StageRing).
// Skipped without a GPU, and the wgmma/TMA tests without compute capability 9.0.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <random>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "common/tensor_map.h"
#include "pipeline/pipeline.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace {

using tessera::test::DeviceBuffer;

bool is_sm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
}

#define REQUIRE_SM90()                                                     \
  do {                                                                     \
    TESSERA_REQUIRE_GPU();                                                 \
    if (!is_sm90()) GTEST_SKIP() << "needs compute capability 9.0 (sm_90a)"; \
  } while (0)

constexpr int kRowBytes = 128;

// One mbarrier with one arrival (the thread that issues the TMA loads), published to the block.
__device__ void init_load_barrier(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0) {
    tessera::ptx::mbarrier_init(bar, 1);
    tessera::ptx::fence_mbarrier_init();
  }
  __syncthreads();
#endif
}

// ---------------------------------------------------------------------------------------------------------
// TMA: one [rows × 128 B] box at (c0, c1, c2) into 1024-byte aligned shared memory, copied out unchanged.
__global__ void tma_box_kernel(const __grid_constant__ CUtensorMap map, int rows, int c0, int c1, int c2,
                               uint8_t* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ uint8_t raw[];
  uint8_t* tile = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  __shared__ uint64_t bar;
  init_load_barrier(&bar);
  if (threadIdx.x == 0) {
    tessera::ptx::mbarrier_arrive_expect_tx(&bar, rows * kRowBytes);
    tessera::ptx::tma_load_3d(tile, &map, &bar, c0, c1, c2);
  }
  tessera::ptx::mbarrier_wait_parity(&bar, 0);
  for (int i = threadIdx.x; i < rows * kRowBytes; i += blockDim.x) out[i] = tile[i];
#endif
}

TEST(Ptx, TmaSwizzledBoxWithOutOfBoundsRows) {
  REQUIRE_SM90();
  const uint64_t seed = tessera::test::fresh_seed();
  SCOPED_TRACE(tessera::test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int dim0 = 384, dim1 = 100, dim2 = 3, rows = 64;
  const int64_t stride1 = 512, stride2 = stride1 * dim1;  // padded rows
  std::vector<uint8_t> host(static_cast<size_t>(stride2 * dim2));
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  DeviceBuffer<uint8_t> src(host);
  const CUtensorMap map = tessera::detail::make_tensor_map_sw128(src.get(), tessera::detail::TmaElement::kU8, dim0,
                                                                 dim1, dim2, stride1, stride2, rows);
  DeviceBuffer<uint8_t> out(rows * kRowBytes);
  // Rows 60..123 of group 2 at K offset 256: rows from 100 on are past the tensor.
  const int c0 = 256, c1 = 60, c2 = 2;
  out.poison();
  tma_box_kernel<<<1, 128, rows * kRowBytes + 1024>>>(map, rows, c0, c1, c2, out.get());
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = out.download();
  for (int r = 0; r < rows; ++r) {
    for (int chunk = 0; chunk < 8; ++chunk) {
      for (int b = 0; b < 16; ++b) {
        // 128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8).
        const uint8_t v = got[r * kRowBytes + ((chunk ^ (r & 7)) * 16) + b];
        const int row = c1 + r;
        const uint8_t want =
            row < dim1 ? host[static_cast<size_t>(c2 * stride2 + row * stride1 + c0 + chunk * 16 + b)] : 0;
        ASSERT_EQ(v, want) << "row " << r << " chunk " << chunk << " byte " << b;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// wgmma: D[64 × N] = A[64 × K] · B[N × K]ᵀ over K = 128 bytes (one swizzled row: 4 instructions), both tiles
// loaded by TMA, then D written out row-major from the documented accumulator layout. kReps > 1 adds the same
// product kReps times into one accumulator (4 · kReps instructions in one batch): a proxy (the same products again,
// so correlated) for the fp8 accumulator's error over kReps k-blocks, what promoting less often than every 128 of K
// would cost (docs/perf/grouped_gemm.md, v9).
template <int N, bool kFP8, int kReps = 1>
__global__ void wgmma_tile_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                  float* d_out) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t raw[];
  uint8_t* a = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  uint8_t* b = a + 64 * kRowBytes;
  __shared__ uint64_t bar;
  init_load_barrier(&bar);
  if (threadIdx.x == 0) {
    tessera::ptx::mbarrier_arrive_expect_tx(&bar, (64 + N) * kRowBytes);
    tessera::ptx::tma_load_3d(a, &map_a, &bar, 0, 0, 0);
    tessera::ptx::tma_load_3d(b, &map_b, &bar, 0, 0, 0);
  }
  tessera::ptx::mbarrier_wait_parity(&bar, 0);
  using Mma = tessera::ptx::Wgmma<N>;
  float d[Mma::kRegs];
  const uint64_t da = tessera::ptx::wgmma_desc_k_major_sw128(a), db = tessera::ptx::wgmma_desc_k_major_sw128(b);
  tessera::ptx::wgmma_fence();
#pragma unroll
  for (int r = 0; r < kReps; ++r) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      if constexpr (kFP8) Mma::mma_e4m3(d, da + 2 * s, db + 2 * s, r > 0 || s > 0);
      else Mma::mma_bf16(d, da + 2 * s, db + 2 * s, r > 0 || s > 0);
    }
  }
  tessera::ptx::wgmma_commit_group();
  tessera::ptx::wgmma_wait_group<0>();
  tessera::ptx::wgmma_fence_registers(d);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int row = 16 * warp + lane / 4, col = 8 * j + 2 * (lane % 4);
    d_out[row * N + col] = d[4 * j];
    d_out[row * N + col + 1] = d[4 * j + 1];
    d_out[(row + 8) * N + col] = d[4 * j + 2];
    d_out[(row + 8) * N + col + 1] = d[4 * j + 3];
  }
#endif
}

template <int N, bool kFP8, int kReps = 1>
void check_wgmma_tile() {
  const uint64_t seed = tessera::test::fresh_seed();
  SCOPED_TRACE(tessera::test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int elem = kFP8 ? 1 : 2, k = kRowBytes / elem;
  std::vector<uint8_t> a(64 * kRowBytes), b(N * kRowBytes);
  std::vector<double> av(64 * k), bv(N * k);
  auto fill = [&](std::vector<uint8_t>& bytes, std::vector<double>& vals) {
    std::normal_distribution<float> nd;
    for (size_t i = 0; i < vals.size(); ++i) {
      if (kFP8) {
        uint8_t q;
        do q = static_cast<uint8_t>(rng()); while ((q & 0x7F) == 0x7F);  // no NaN
        bytes[i] = q;
        vals[i] = tessera::host::e4m3_to_f32(q);
      } else {
        const uint16_t h = tessera::host::f32_to_bf16(nd(rng));
        std::memcpy(&bytes[2 * i], &h, 2);
        vals[i] = tessera::host::bf16_to_f32(h);
      }
    }
  };
  fill(a, av);
  fill(b, bv);
  DeviceBuffer<uint8_t> da(a), db(b);
  DeviceBuffer<float> dd(64 * N);
  dd.poison();
  const auto el = kFP8 ? tessera::detail::TmaElement::kU8 : tessera::detail::TmaElement::kBF16;
  const CUtensorMap ma = tessera::detail::make_tensor_map_sw128(da.get(), el, k, 64, 1, k, 64 * k, 64);
  const CUtensorMap mb = tessera::detail::make_tensor_map_sw128(db.get(), el, k, N, 1, k, N * k, N);
  wgmma_tile_kernel<N, kFP8, kReps><<<1, 128, (64 + N) * kRowBytes + 1024>>>(ma, mb, dd.get());
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> d = dd.download();
  // bf16: fp32 accumulation of exact products. fp8: the tensor cores add a k-block's products with a
  // reduced-precision accumulator (about 2^-13 of the magnitude on an H200; the reason the kernels promote every
  // 128 of K into fp32), so the bound is 2^-9 of the sum of |products|. A layout or descriptor error is off by
  // the size of the result itself.
  const double tol = kFP8 ? 0x1p-9 : 1e-6;
  double worst = 0;
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < N; ++j) {
      double ref = 0, mag = 0;
      for (int kk = 0; kk < k; ++kk) {
        ref += av[i * k + kk] * bv[j * k + kk];
        mag += std::fabs(av[i * k + kk] * bv[j * k + kk]);
      }
      ref *= kReps;
      mag *= kReps;
      ASSERT_NEAR(d[i * N + j], ref, tol * mag + 1e-6) << "D[" << i << "][" << j << "]";
      worst = std::max(worst, std::fabs(d[i * N + j] - ref) / std::max(mag, 1e-30));
    }
  }
  std::printf("[ wgmma   ] %s N=%d, %d k-block(s): largest |D - ref| / sum|products| = %.3g (2^%.1f)\n",
              kFP8 ? "e4m3" : "bf16", N, kReps, worst, worst > 0 ? std::log2(worst) : -999.0);
}

TEST(Ptx, WgmmaE4M3N8) { REQUIRE_SM90(); check_wgmma_tile<8, true>(); }
TEST(Ptx, WgmmaE4M3N16) { REQUIRE_SM90(); check_wgmma_tile<16, true>(); }
TEST(Ptx, WgmmaE4M3N128) { REQUIRE_SM90(); check_wgmma_tile<128, true>(); }
TEST(Ptx, WgmmaE4M3N128TwoKBlocks) { REQUIRE_SM90(); check_wgmma_tile<128, true, 2>(); }
TEST(Ptx, WgmmaBF16N32) { REQUIRE_SM90(); check_wgmma_tile<32, false>(); }
TEST(Ptx, WgmmaBF16N64) { REQUIRE_SM90(); check_wgmma_tile<64, false>(); }

// ---------------------------------------------------------------------------------------------------------
// Stage ring: warp 0 produces `items` chunks of 32 ints through a 3-stage ring (each lane stores one int and
// arrives on full[s]); warps 1 and 2 both consume every chunk and release the stage.
// Each consumer writes a checksum per item; wrapping many times checks the phase parity bookkeeping.
__global__ void ring_kernel(const int* src, int items, long long* sums) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kStages = 3;
  __shared__ uint64_t bars[2 * kStages];
  __shared__ int data[kStages][32];
  const tessera::pipeline::StageRing ring{bars, bars + kStages, kStages};
  if (threadIdx.x == 0) ring.init(32, 64);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  tessera::pipeline::PipelineState st;
  if (warp == 0) {
    for (int it = 0; it < items; ++it) {
      const int v = src[it * 32 + lane];
      ring.producer_acquire(st);
      data[st.stage][lane] = v;
      tessera::ptx::mbarrier_arrive(&ring.full[st.stage]);  // release: the store above is visible to the waiters
      st.advance(kStages);
    }
  } else {
    for (int it = 0; it < items; ++it) {
      ring.consumer_wait(st);
      long long v = data[st.stage][lane] * static_cast<long long>(lane + 1);
      for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
      ring.consumer_release(st);  // every reading thread arrives: an arrival releases its own reads only
      if (lane == 0) sums[(warp - 1) * items + it] = v;
      st.advance(kStages);
    }
  }
#endif
}

TEST(Pipeline, RingOverManyPhases) {
  REQUIRE_SM90();
  const uint64_t seed = tessera::test::fresh_seed();
  SCOPED_TRACE(tessera::test::seed_note(seed));
  std::mt19937_64 rng(seed);
  const int items = 1000;
  std::vector<int> src(items * 32);
  for (auto& v : src) v = static_cast<int>(rng() % 100000);
  DeviceBuffer<int> dsrc(src);
  DeviceBuffer<long long> dsums(2 * items);
  dsums.poison();
  ring_kernel<<<1, 96>>>(dsrc.get(), items, dsums.get());
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<long long> sums = dsums.download();
  for (int c = 0; c < 2; ++c) {
    for (int it = 0; it < items; ++it) {
      long long want = 0;
      for (int l = 0; l < 32; ++l) want += static_cast<long long>(src[it * 32 + l]) * (l + 1);
      ASSERT_EQ(sums[c * items + it], want) << "consumer " << c << " item " << it;
    }
  }
}

}  // namespace
