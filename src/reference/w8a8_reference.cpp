#include "reference/w8a8_reference.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace tessera::reference {
namespace {

// One fp32 operation, rounded to float before anything else uses it (a volatile store keeps the compiler from fusing
// it with a following add into an fma on targets that have one).
float rounded(float v) {
  volatile float r = v;
  return r;
}

void check_shape(int64_t rows, int64_t k, int64_t block) {
  if (rows <= 0 || k <= 0 || block <= 0 || k % block != 0)
    throw std::invalid_argument("quantize_int8_blocks: rows and K must be positive and block must divide K (rows " +
                                std::to_string(rows) + ", K " + std::to_string(k) + ", block " + std::to_string(block) +
                                ")");
}

void check_pair(const Int8Blocks& a, const Int8Blocks& b) {
  if (a.k != b.k || a.block != b.block || a.block <= 0)
    throw std::invalid_argument("w8a8 reference: a and b need the same K and block");
}

}  // namespace

double Int8Blocks::value(int64_t r, int64_t c) const {
  const int64_t p = r * blocks() + c / block;
  return static_cast<double>(scale[p]) * (static_cast<double>(codes[r * k + c]) - zero[p]);
}

Int8Blocks quantize_int8_blocks(const std::vector<float>& x, int64_t rows, int64_t k, int64_t block, bool symmetric) {
  check_shape(rows, k, block);
  if (x.size() != static_cast<std::size_t>(rows * k))
    throw std::invalid_argument("quantize_int8_blocks: x must hold rows · K values");
  Int8Blocks q;
  q.rows = rows;
  q.k = k;
  q.block = block;
  const int64_t blocks = k / block;
  q.codes.resize(static_cast<std::size_t>(rows * k));
  q.scale.resize(static_cast<std::size_t>(rows * blocks));
  q.zero.assign(q.scale.size(), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = &x[r * k + b * block];
      int8_t* codes = &q.codes[r * k + b * block];
      const std::size_t p = static_cast<std::size_t>(r * blocks + b);
      if (symmetric) {
        float amax = 0.f;
        for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(v[j]));
        float s = rounded(amax / 127.f);
        if (!(s > 0.f)) s = 1.f;
        const float inv = rounded(1.f / s);
        q.scale[p] = s;
        for (int64_t j = 0; j < block; ++j)
          codes[j] = static_cast<int8_t>(std::clamp(std::rint(rounded(v[j] * inv)), -127.f, 127.f));
      } else {
        float lo = 0.f, hi = 0.f;
        for (int64_t j = 0; j < block; ++j) lo = std::min(lo, v[j]), hi = std::max(hi, v[j]);
        float s = rounded(rounded(hi - lo) / 255.f);
        if (!(s > 0.f)) s = 1.f;
        const float inv = rounded(1.f / s);
        const float z = std::clamp(std::rint(rounded(-128.f - rounded(lo * inv))), -128.f, 127.f);
        q.scale[p] = s;
        q.zero[p] = static_cast<int32_t>(z);
        for (int64_t j = 0; j < block; ++j)
          codes[j] = static_cast<int8_t>(std::clamp(rounded(std::rint(rounded(v[j] * inv)) + z), -128.f, 127.f));
      }
    }
  return q;
}

std::vector<int32_t> block_code_sums(const Int8Blocks& q) {
  const int64_t blocks = q.blocks();
  std::vector<int32_t> sums(static_cast<std::size_t>(q.rows * blocks), 0);
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.k; ++c) sums[r * blocks + c / q.block] += q.codes[r * q.k + c];
  return sums;
}

std::vector<int64_t> w8a8_block_dots(const Int8Blocks& a, const Int8Blocks& b) {
  check_pair(a, b);
  const int64_t blocks = a.blocks();
  std::vector<int64_t> d(static_cast<std::size_t>(a.rows * b.rows * blocks), 0);
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t n = 0; n < b.rows; ++n)
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t za = a.zero[m * blocks + i], zb = b.zero[n * blocks + i];
        int64_t acc = 0;
        for (int64_t c = i * a.block; c < (i + 1) * a.block; ++c)
          acc += (static_cast<int64_t>(a.codes[m * a.k + c]) - za) * (static_cast<int64_t>(b.codes[n * b.k + c]) - zb);
        d[(m * b.rows + n) * blocks + i] = acc;
      }
  return d;
}

std::vector<int64_t> w8a8_block_dots_expanded(const Int8Blocks& a, const Int8Blocks& b) {
  check_pair(a, b);
  const int64_t blocks = a.blocks();
  const std::vector<int32_t> sa = block_code_sums(a), sb = block_code_sums(b);
  std::vector<int64_t> d(static_cast<std::size_t>(a.rows * b.rows * blocks), 0);
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t n = 0; n < b.rows; ++n)
      for (int64_t i = 0; i < blocks; ++i) {
        int32_t dot = 0;  // what the int8 tensor cores accumulate (int32: |dot| <= 128·128·block)
        for (int64_t c = i * a.block; c < (i + 1) * a.block; ++c)
          dot += static_cast<int32_t>(a.codes[m * a.k + c]) * static_cast<int32_t>(b.codes[n * b.k + c]);
        const int64_t za = a.zero[m * blocks + i], zb = b.zero[n * blocks + i];
        d[(m * b.rows + n) * blocks + i] = dot - zb * sa[m * blocks + i] - za * sb[n * blocks + i] + a.block * za * zb;
      }
  return d;
}

std::vector<double> w8a8_reference(const Int8Blocks& a, const Int8Blocks& b, const std::vector<double>& bias) {
  const std::vector<int64_t> d = w8a8_block_dots(a, b);
  const int64_t blocks = a.blocks();
  if (!bias.empty() && bias.size() != static_cast<std::size_t>(b.rows))
    throw std::invalid_argument("w8a8_reference: bias must hold N values");
  std::vector<double> c(static_cast<std::size_t>(a.rows * b.rows), 0.0);
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t n = 0; n < b.rows; ++n) {
      double acc = bias.empty() ? 0.0 : bias[n];
      for (int64_t i = 0; i < blocks; ++i)
        acc += static_cast<double>(a.scale[m * blocks + i]) * b.scale[n * blocks + i] *
               static_cast<double>(d[(m * b.rows + n) * blocks + i]);
      c[m * b.rows + n] = acc;
    }
  return c;
}

}  // namespace tessera::reference
