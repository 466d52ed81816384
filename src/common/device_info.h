// Internal: per-device properties, read once per device and cached (the launch path must stay cheap).
#pragma once

namespace tessera::detail {

struct DeviceInfo {
  int ordinal = 0;
  int num_sms = 0;
};

// Properties of the current device. Thread-safe.
const DeviceInfo& current_device_info();

}  // namespace tessera::detail
