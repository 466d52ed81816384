// Internal: per-device properties, read once per device and cached (the launch path must stay cheap).
#pragma once

namespace tessera::detail {

struct DeviceInfo {
  int ordinal = 0;
  int num_sms = 0;
  int cc_major = 0;  // compute capability
  int cc_minor = 0;
};

// The current CUDA device. Inside an op call (while an OpCallScope is open on this thread: every ArgCheck opens one)
// the runtime is asked once and the answer reused by every later question of the same call, nested ops included;
// outside one it is asked every time. An op never changes the current device, so the answer cannot go stale within
// a call (an op asked it several times a call: its checks, the device properties, the occupancy cache, and again in
// each step of the MoE layer; 0.04-0.05 us a question on the H200 machines, tessera-bench --host).
int current_device();

// The device this thread's open op call has remembered, or -1 (not asked yet, or no call open). For tests.
int remembered_call_device();

// Opens (or nests into) this thread's op call; the outermost scope's end forgets the device.
class OpCallScope {
 public:
  OpCallScope() noexcept;
  ~OpCallScope();
  OpCallScope(const OpCallScope&) = delete;
  OpCallScope& operator=(const OpCallScope&) = delete;
};

// Properties of the current device. Thread-safe. Throws CudaError when there is no usable device.
const DeviceInfo& current_device_info();

// Every op calls this after validating its arguments and before its first launch: the kernels are built for sm_90a
// only. Throws CudaError "<op>: needs an sm_90 (Hopper) GPU, found sm_XY" on any other device.
void require_hopper(const char* op);

}  // namespace tessera::detail
