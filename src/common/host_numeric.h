// Host-only conversions between fp32 and the narrow float formats, bit-exact with the GPU's round-to-nearest-even
// conversions. Used by the references, the tests and the benchmark to make inputs and read outputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tessera::host {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // keep it a quiet NaN
  u += 0x7FFF + ((u >> 16) & 1);                                        // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}
inline uint16_t f32_to_fp16(float f) {
  // Exact for every value: scale into the half grid, round with the FPU (nearest even), rebuild the bits.
  if (std::isnan(f)) return 0x7E00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  float a = std::fabs(f);
  if (a == 0.0f) return sign;
  if (a >= 65520.0f) return sign | 0x7C00;  // rounds to inf
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp_half = e - 1 + 15;
  if (exp_half <= 0) {  // subnormal: multiples of 2^-24
    const float q = std::nearbyint(std::ldexp(a, 24));
    return sign | static_cast<uint16_t>(q);  // q == 1024 becomes the smallest normal, which is right
  }
  float q = std::nearbyint(std::ldexp(a, 10 - (e - 1)));  // in [1024, 2048]
  if (q == 2048.0f) { q = 1024.0f; ++exp_half; }
  if (exp_half >= 31) return sign | 0x7C00;
  return sign | static_cast<uint16_t>(exp_half << 10) | static_cast<uint16_t>(static_cast<uint32_t>(q) - 1024);
}

// fp8 e4m3 (OCP "fn": no infinities, 0x7F / 0xFF are NaN, max 448).
inline float e4m3_to_f32(uint8_t b) {
  const uint32_t sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  float v;
  if (exp == 15 && man == 7) return NAN;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);
  else v = std::ldexp(static_cast<float>(man | 8), static_cast<int>(exp) - 10);
  return sign ? -v : v;
}
// Half a unit in the last place of e4m3 at magnitude |v| (|v| <= 448): the largest error of a correct rounding.
inline double e4m3_half_ulp(double v) {
  const double a = std::fabs(v);
  if (a < std::ldexp(1.0, -6)) return std::ldexp(1.0, -10);  // subnormal spacing 2^-9
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 1 - 3 - 1);
}

}  // namespace tessera::host
