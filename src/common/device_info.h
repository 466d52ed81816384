// Internal: per-device properties, read once per device and cached (the launch path must stay cheap).
#pragma once

namespace tessera::detail {

struct DeviceInfo {
  int ordinal = 0;
  int num_sms = 0;
  int cc_major = 0;  // compute capability
  int cc_minor = 0;
};

// Properties of the current device. Thread-safe. Throws CudaError when there is no usable device.
const DeviceInfo& current_device_info();

// Every op calls this after validating its arguments and before its first launch: the kernels are built for sm_90a
// only. Throws CudaError "<op>: needs an sm_90 (Hopper) GPU, found sm_XY" on any other device.
void require_hopper(const char* op);

}  // namespace tessera::detail
