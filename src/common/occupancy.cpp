#include "common/occupancy.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "common/check.h"
#include "common/device_info.h"

namespace tessera::detail {

namespace {
struct Entry {
  const void* kernel;
  int threads, smem, device, blocks;
};
}  // namespace

int resident_blocks_per_sm(const void* kernel, int threads, int smem) {
  static std::mutex mutex;
  static std::vector<Entry> cache;
  const int device = current_device();
  std::lock_guard<std::mutex> lock(mutex);
  for (const Entry& e : cache)
    if (e.kernel == kernel && e.threads == threads && e.smem == smem && e.device == device) return e.blocks;
  // The limit is raised to the device's opt-in maximum, not to `smem`: a later call with a smaller size must
  // not lower it under a size already cached as launchable.
  if (smem > 48 * 1024) {
    int optin = 0;
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  }
  int blocks = 0;
  TESSERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
  if (blocks < 1) blocks = 1;
  cache.push_back({kernel, threads, smem, device, blocks});
  return blocks;
}

int elementwise_grid(int64_t total) {
  const int64_t blocks = (total + 255) / 256;
  return static_cast<int>(std::min<int64_t>(blocks, int64_t{8} * current_device_info().num_sms));
}

}  // namespace tessera::detail
