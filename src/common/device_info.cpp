#include "common/device_info.h"

#include <cuda_runtime_api.h>

#include <array>
#include <mutex>
#include <string>

#include "common/check.h"

namespace tessera::detail {

const DeviceInfo& current_device_info() {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceInfo, kMaxDevices> cache{};
  static std::array<bool, kMaxDevices> filled{};
  static std::mutex mutex;

  int dev = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices)
    throw CudaError("tessera: device ordinal " + std::to_string(dev) + " unsupported");
  std::lock_guard<std::mutex> lock(mutex);
  if (!filled[dev]) {
    DeviceInfo& info = cache[dev];
    info.ordinal = dev;
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, dev));
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, dev));
    filled[dev] = true;
  }
  return cache[dev];
}

void require_hopper(const char* op) {
  const DeviceInfo& info = current_device_info();
  if (info.cc_major != 9 || info.cc_minor != 0)
    throw CudaError(std::string(op) + ": needs an sm_90 (Hopper) GPU, found sm_" + std::to_string(info.cc_major) +
                    std::to_string(info.cc_minor) + " (device " + std::to_string(info.ordinal) + ")");
}

}  // namespace tessera::detail
