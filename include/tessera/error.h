// tessera — error model (public).
//
// Every failure the library can detect is reported by throwing tessera::Error. The message names the op, the
// argument, what was expected and what was given, e.g.
//   tessera::moe::fused_gate: 'bias' must have 256 elements (num_experts), got 128
// The library never calls exit() and never prints and carries on.
#pragma once

#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace tessera
