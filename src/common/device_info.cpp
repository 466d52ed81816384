#include "common/device_info.h"

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <mutex>
#include <string>

#include "common/check.h"

namespace tessera::detail {

namespace {

struct CallState {
  int depth = 0;     // open OpCallScopes on this thread
  int device = -1;   // the current device, once asked within the open call; -1: not asked yet
};
thread_local CallState call_state;

}  // namespace

OpCallScope::OpCallScope() noexcept { ++call_state.depth; }

OpCallScope::~OpCallScope() {
  CallState& s = call_state;
  if (--s.depth == 0) s.device = -1;
}

int remembered_call_device() { return call_state.device; }

int current_device() {
  CallState& s = call_state;
  if (s.device >= 0) return s.device;
  int dev = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&dev));
  if (s.depth > 0) s.device = dev;
  return dev;
}

const DeviceInfo& current_device_info() {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceInfo, kMaxDevices> cache{};
  static std::array<std::atomic<bool>, kMaxDevices> filled{};
  static std::mutex mutex;

  const int dev = current_device();
  if (dev < 0 || dev >= kMaxDevices)
    throw CudaError("tessera: device ordinal " + std::to_string(dev) + " unsupported");
  // Filled once per device under the lock; read without it afterwards (the release store publishes the fields).
  if (filled[dev].load(std::memory_order_acquire)) return cache[dev];
  std::lock_guard<std::mutex> lock(mutex);
  if (!filled[dev].load(std::memory_order_relaxed)) {
    DeviceInfo& info = cache[dev];
    info.ordinal = dev;
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, dev));
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, dev));
    filled[dev].store(true, std::memory_order_release);
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
