// tessera — error model (public).
//
// Every failure the library can detect is reported by throwing tessera::Error. The message names the op, the
// argument, what was expected and what was given, e.g.
//   tessera::moe::fused_gate: 'bias' must have 256 elements (num_experts), got 128
// The library never calls exit() and never prints and carries on.
//
// Two kinds, so that callers can tell a bad call from a bad machine:
//   tessera::Error      an argument does not meet the op's contract (the call itself is wrong);
//   tessera::CudaError  (derives from Error) the CUDA runtime failed, or the device cannot run the op (no driver,
//                       no device, not an sm_90 GPU). The Python layer raises ValueError for the first and
//                       RuntimeError for the second.
#pragma once

#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

class CudaError : public Error {
 public:
  explicit CudaError(const std::string& what) : Error(what) {}
};

}  // namespace tessera
