// Internal: number formatting shared by the reference checks' messages.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace tessera::reference::detail {

// Shortest round-trippable-enough decimal for a check message ("%.9g").
inline std::string fmt(double v) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

inline std::string hex16(uint16_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%04x", v);
  return buf;
}

inline std::string hex8(uint8_t v) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02x", v);
  return buf;
}

}  // namespace tessera::reference::detail
