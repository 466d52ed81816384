#include "common/device_info.h"

#include <cuda_runtime_api.h>

#include <array>
#include <string>
#include <mutex>

#include "common/check.h"

namespace tessera::detail {

const DeviceInfo& current_device_info() {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceInfo, kMaxDevices> cache{};
  static std::array<bool, kMaxDevices> filled{};
  static std::mutex mutex;

  int dev = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) throw Error("tessera: device ordinal " + std::to_string(dev) + " unsupported");
  std::lock_guard<std::mutex> lock(mutex);
  if (!filled[dev]) {
    DeviceInfo& info = cache[dev];
    info.ordinal = dev;
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, dev));
    filled[dev] = true;
  }
  return cache[dev];
}

}  // namespace tessera::detail
