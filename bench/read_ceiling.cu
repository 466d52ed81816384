// The read-only stream behind tessera-bench's read ceiling (timing.h, measure_read_bandwidth): every 16-byte word of
// a buffer loaded once, streaming (evict-first), and nothing stored unless the data holds a value it never holds.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ptx/grid.cuh"
#include "timing.h"

namespace tessera::bench {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;  // a plain 16-byte stream saturates from 4 blocks of 256 threads per SM (H200)

__global__ void __launch_bounds__(kThreads) read_stream(const uint4* __restrict__ words, std::size_t count,
                                                        uint32_t never, uint32_t* __restrict__ sink) {
  const std::size_t stride = std::size_t{gridDim.x} * kThreads;
  std::size_t i = std::size_t{blockIdx.x} * kThreads + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < count; i += 4 * stride) {  // four loads in flight per thread
    const uint4 a = __ldcs(words + i), b = __ldcs(words + i + stride);
    const uint4 c = __ldcs(words + i + 2 * stride), d = __ldcs(words + i + 3 * stride);
    acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^ (d.x ^ d.y ^ d.z ^ d.w);
  }
  for (; i < count; i += stride) {
    const uint4 a = __ldcs(words + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == never) *sink = acc;  // keeps the loads; the buffer's fill makes every XOR 0
}

// One thread that waits `ns` nanoseconds of the GPU's global timer: holds the stream busy while the host times how
// long it takes to issue calls behind it (time_host).
__global__ void spin(uint64_t ns) {
  const uint64_t start = ptx::globaltimer();
  while (ptx::globaltimer() - start < ns) {
  }
}

}  // namespace

void launch_spin(uint64_t ns, cudaStream_t stream) {
  spin<<<1, 1, 0, stream>>>(ns);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

namespace {
// 1,024 bytes of kernel parameters: eight CUtensorMaps of 128 bytes, the size of the W8A8 GEMM's map argument (it
// holds room for every plane map whether the operands have zero points and sums or not).
struct KiloParams {
  unsigned char bytes[1024];
};
__global__ void take_params(KiloParams p) {
  if (p.bytes[threadIdx.x] == 0xAB && p.bytes[1023] == 0xCD) asm volatile("trap;");
}
}  // namespace

void launch_with_kilobyte_params(cudaStream_t stream) {
  KiloParams p{};
  take_params<<<1, 1, 0, stream>>>(p);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

void launch_read_stream(const void* data, std::size_t bytes, uint32_t* sink, int num_sms, cudaStream_t stream) {
  read_stream<<<num_sms * kBlocksPerSm, kThreads, 0, stream>>>(static_cast<const uint4*>(data), bytes / 16,
                                                              0xFFFFFFFFu, sink);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tessera::bench
