#include "gpu_clock.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <numeric>

namespace tessera::bench {
namespace {

// NVML's constants used here (nvml.h, which the CUDA toolkit does not ship on every install).
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;
constexpr uint64_t kReasonSwPowerCap = 0x4, kReasonHwSlowdown = 0x8, kReasonSwThermal = 0x20,
                   kReasonHwThermal = 0x40, kReasonHwPowerBrake = 0x80;

template <typename Fn>
Fn symbol(void* lib, const char* name) {
  return reinterpret_cast<Fn>(dlsym(lib, name));
}

}  // namespace

std::string reason_names(uint64_t r) {
  std::string out;
  const auto add = [&](uint64_t bit, const char* name) {
    if (r & bit) out += (out.empty() ? "" : "+") + std::string(name);
  };
  add(kReasonSwPowerCap, "power cap");
  add(kReasonHwPowerBrake, "power brake");
  add(kReasonSwThermal | kReasonHwThermal, "thermal");
  add(kReasonHwSlowdown, "hw slowdown");
  return out;
}

ClockSampler::ClockSampler(int cuda_device) {
  lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib_) {
    why_ = "libnvidia-ml.so.1 not found";
    return;
  }
  const auto init = symbol<int (*)()>(lib_, "nvmlInit_v2");
  const auto by_bus = symbol<int (*)(const char*, void**)>(lib_, "nvmlDeviceGetHandleByPciBusId_v2");
  get_clock_ = symbol<int (*)(void*, int, unsigned*)>(lib_, "nvmlDeviceGetClockInfo");
  get_power_ = symbol<int (*)(void*, unsigned*)>(lib_, "nvmlDeviceGetPowerUsage");
  get_reasons_ = symbol<int (*)(void*, unsigned long long*)>(lib_, "nvmlDeviceGetCurrentClocksEventReasons");
  if (!get_reasons_)  // the name before NVML 12.2
    get_reasons_ = symbol<int (*)(void*, unsigned long long*)>(lib_, "nvmlDeviceGetCurrentClocksThrottleReasons");
  shutdown_ = symbol<int (*)()>(lib_, "nvmlShutdown");
  if (!init || !by_bus || !get_clock_ || !shutdown_) {
    why_ = "NVML lacks an entry point";
    shutdown_ = nullptr;  // never initialized: nothing to shut down
    return;
  }
  if (init() != kNvmlSuccess) {
    why_ = "nvmlInit failed";
    shutdown_ = nullptr;  // nothing to shut down
    return;
  }
  char bus[32] = {};
  void* dev = nullptr;
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, cuda_device) != cudaSuccess || by_bus(bus, &dev) != kNvmlSuccess) {
    why_ = "no NVML device for CUDA device " + std::to_string(cuda_device);
    return;
  }
  device_ = dev;
}

ClockSampler::~ClockSampler() {
  if (running_) stop();
  if (shutdown_) shutdown_();
  if (lib_) dlclose(lib_);
}

void ClockSampler::start() {
  if (!available() || running_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    mhz_.clear();
    watts_.clear();
    reasons_ = 0;
  }
  running_ = true;
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    running_ = false;  // no thread: stop() has nothing to join
    throw;
  }
}

void ClockSampler::run() {
  while (running_) {
    unsigned mhz = 0, mw = 0;
    unsigned long long reasons = 0;
    const bool clock_ok = get_clock_(device_, kNvmlClockSm, &mhz) == kNvmlSuccess;
    const bool power_ok = get_power_ && get_power_(device_, &mw) == kNvmlSuccess;
    const bool reasons_ok = get_reasons_ && get_reasons_(device_, &reasons) == kNvmlSuccess;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (clock_ok) mhz_.push_back(mhz);
      if (power_ok) watts_.push_back(mw / 1000.0);
      if (reasons_ok) reasons_ |= reasons;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

ClockReading ClockSampler::stop() {
  ClockReading r;
  if (!running_) return r;
  running_ = false;
  thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  r.samples = static_cast<int>(mhz_.size());
  if (!mhz_.empty()) {
    std::vector<double> v = mhz_;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    r.sm_mhz = v[v.size() / 2];
    r.min_mhz = *std::min_element(mhz_.begin(), mhz_.end());
  }
  if (!watts_.empty()) r.power_w = std::accumulate(watts_.begin(), watts_.end(), 0.0) / watts_.size();
  r.reasons = reasons_;
  return r;
}

}  // namespace tessera::bench
