// CPU validation tests' helpers: host memory standing in for device memory, and the two outcomes such a test looks
// for: an error naming the op and the argument, or a call that got past every rule as far as the device checks.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tessera/error.h"

namespace tessera::test {

// Host memory standing in for device memory: 256-byte aligned, filled with a known byte.
class HostBuffer {
 public:
  explicit HostBuffer(std::size_t bytes, uint8_t fill = 0) : fill_(fill), raw_(bytes + 256, fill) {}
  uint8_t* data() {
    const auto addr = reinterpret_cast<std::uintptr_t>(raw_.data());
    return raw_.data() + (256 - addr % 256) % 256;
  }
  bool untouched() const {
    for (uint8_t v : raw_)
      if (v != fill_) return false;
    return true;
  }

 private:
  uint8_t fill_;
  std::vector<uint8_t> raw_;
};

// Whether `msg` is the error of the first device check, which a call on host buffers meets once every argument rule
// has passed: without a GPU, cudaGetDevice's CUDA error; with one, the host pointer.
inline bool is_device_check_error(const std::string& msg) {
  const bool no_gpu = msg.find("CUDA error") != std::string::npos && msg.find("cudaGetDevice") != std::string::npos;
  const bool host_pointer =
      msg.find("host pointer") != std::string::npos || msg.find("not a pointer CUDA knows") != std::string::npos;
  return no_gpu || host_pointer;
}

// `call` throws tessera::Error whose message names `op` and then `arg` ("<op>: '<arg>' ..."), and says every string
// of `says`.
inline void expect_error(const std::function<void()>& call, const std::string& op, const std::string& arg,
                         const std::vector<std::string>& says = {}) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming '" << arg << "'";
  } catch (const Error& e) {
    const std::string msg = e.what(), head = op + ": '" + arg + "'";
    EXPECT_NE(msg.find(head), std::string::npos) << "expected \"" << head << "\" in: " << msg;
    for (const std::string& s : says)
      EXPECT_NE(msg.find(s), std::string::npos) << "expected \"" << s << "\" in: " << msg;
  }
}

}  // namespace tessera::test
