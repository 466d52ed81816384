// tessera-bench: the SM clock, board power and clock-limit reasons while a case is timed, read through NVML.
//
// The compute-bound cases of an H200 run at the board's power cap: the SM clock falls as the tensor cores heat up, so
// the same kernel reads up to ~20 % apart between a short run on a cool GPU and a sustained one
// (docs/perf/grouped_gemm.md, "Clocks and power"). A time is comparable with a peer's only at a known clock; each row
// therefore carries the clock and power of its graph-mode timing. NVML is the driver's libnvidia-ml.so.1, opened at
// run time: where it is missing (a machine without the driver) the bench runs as before and these columns read "-".
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tessera::bench {

struct ClockReading {
  double sm_mhz = NAN;     // median of the samples of the SM clock
  double min_mhz = NAN;    // lowest sample
  double power_w = NAN;    // mean of the board power samples (NVML's own averaging window, ~1 s on Hopper)
  uint64_t reasons = 0;    // OR of the clock-limit reasons seen (NVML bitmask); see reason_names
  int samples = 0;
  bool ok() const { return samples > 0; }
};

// "power cap", "thermal", ... for the bits of ClockReading::reasons that say why the clock was held down (idle and
// application-clock bits left out).
std::string reason_names(uint64_t reasons);

class ClockSampler {
 public:
  // cuda_device: the CUDA ordinal; matched to NVML's device by PCI bus id.
  explicit ClockSampler(int cuda_device);
  ~ClockSampler();
  ClockSampler(const ClockSampler&) = delete;
  ClockSampler& operator=(const ClockSampler&) = delete;

  bool available() const { return device_ != nullptr; }
  const std::string& unavailable_reason() const { return why_; }

  // Samples every ~1 ms on a thread of its own from start() until stop(); stop() returns what it saw.
  void start();
  ClockReading stop();

 private:
  void run();

  void* lib_ = nullptr;
  void* device_ = nullptr;  // nvmlDevice_t
  std::string why_;
  // NVML entry points (nvmlReturn_t is an int; 0 is success).
  int (*get_clock_)(void*, int, unsigned*) = nullptr;
  int (*get_power_)(void*, unsigned*) = nullptr;
  int (*get_reasons_)(void*, unsigned long long*) = nullptr;
  int (*shutdown_)() = nullptr;

  std::thread thread_;
  std::atomic<bool> running_{false};
  std::mutex mu_;
  std::vector<double> mhz_, watts_;
  uint64_t reasons_ = 0;
};

}  // namespace tessera::bench
