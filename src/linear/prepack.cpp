// Host side of the weight-only linear layer: round-to-nearest quantization into the canonical form, and the
// canonical form <-> the kernels' prepacked layout (tessera/linear.h, docs/ops/linear.md; linear/layout.h holds the
// mapping the kernel reads).
#include <algorithm>
#include <cmath>
#include <string>

#include "common/host_numeric.h"
#include "common/validate.h"
#include "linear/layout.h"
#include "linear/weight_formats.h"
#include "tessera/linear.h"

namespace tessera::linear {
namespace {

using ::tessera::detail::ArgCheck;

uint16_t to_bits(float v, DType dtype) { return dtype == DType::kBF16 ? host::f32_to_bf16(v) : host::f32_to_fp16(v); }
float from_bits(uint16_t v, DType dtype) { return dtype == DType::kBF16 ? host::bf16_to_f32(v) : host::fp16_to_f32(v); }

// The rules every canonical weight must satisfy before it is packed.
void check_quantized(const ArgCheck& check, const QuantizedWeight& w) {
  if (w.bits != 4 && w.bits != 8) check.fail("w.bits", "must be 4 or 8, got " + std::to_string(w.bits));
  if (w.n <= 0 || w.k <= 0)
    check.fail("w", "must have N > 0 and K > 0, got N " + std::to_string(w.n) + ", K " + std::to_string(w.k));
  detail::check_bits_and_block(check, w.bits, w.k, w.block);
  const auto n_codes = static_cast<size_t>(w.n * w.k);
  const auto n_params = static_cast<size_t>(w.n * (w.k / w.block));
  if (w.codes.size() != n_codes)
    check.fail("w.codes",
               "must hold N·K = " + std::to_string(n_codes) + " codes, got " + std::to_string(w.codes.size()));
  const int levels = (1 << w.bits) - 1;
  for (size_t i = 0; i < n_codes; ++i)
    if (w.codes[i] > levels)
      check.fail("w.codes", "[" + std::to_string(i) + "] = " + std::to_string(w.codes[i]) + " exceeds " +
                                std::to_string(levels) + " (" + std::to_string(w.bits) + "-bit codes, one per byte)");
  if (w.scale.size() != n_params)
    check.fail("w.scale",
               "must hold N·K/block = " + std::to_string(n_params) + " values, got " + std::to_string(w.scale.size()));
  if (w.zero_mode == ZeroMode::kZeroPoint) {
    if (w.zero.size() != n_params)
      check.fail("w.zero", "must hold N·K/block = " + std::to_string(n_params) + " values in kZeroPoint mode, got " +
                               std::to_string(w.zero.size()));
    for (size_t i = 0; i < n_params; ++i)
      if (w.zero[i] > levels) check.fail("w.zero", "[" + std::to_string(i) + "] exceeds " + std::to_string(levels));
  } else if (w.zero_mode == ZeroMode::kOffset) {
    if (w.offset.size() != n_params)
      check.fail("w.offset", "must hold N·K/block = " + std::to_string(n_params) + " values, got " +
                                 std::to_string(w.offset.size()));
  } else {
    check.fail("w.zero_mode", "must be kOffset or kZeroPoint");
  }
  if (!w.k_perm.empty()) {
    if (w.k_perm.size() != static_cast<size_t>(w.k))
      check.fail("w.k_perm", "must be empty or hold K = " + std::to_string(w.k) + " indices");
    std::vector<char> seen(static_cast<size_t>(w.k), 0);
    for (int32_t c : w.k_perm) {
      if (c < 0 || c >= w.k || seen[c]) check.fail("w.k_perm", "must be a permutation of [0, K)");
      seen[c] = 1;
    }
  }
}

}  // namespace

QuantizedWeight quantize_weight(const float* w, int64_t n, int64_t k, int bits, int64_t block, ZeroMode zero_mode) {
  const ArgCheck check("tessera::linear::quantize_weight");
  if (w == nullptr) check.fail("w", "is null");
  QuantizedWeight q;
  q.n = n;
  q.k = k;
  q.bits = bits;
  q.block = block;
  q.zero_mode = zero_mode;
  if (n <= 0 || k <= 0 || block <= 0 || k % block != 0)
    check.fail("block", "must divide K = " + std::to_string(k) + " (N, K > 0), got " + std::to_string(block));
  if (bits != 4 && bits != 8) check.fail("bits", "must be 4 or 8, got " + std::to_string(bits));
  const int64_t blocks = k / block;
  const float levels = static_cast<float>((1 << bits) - 1);
  q.codes.resize(static_cast<size_t>(n * k));
  q.scale.resize(static_cast<size_t>(n * blocks));
  q.offset.resize(q.scale.size());
  if (zero_mode == ZeroMode::kZeroPoint) q.zero.resize(q.scale.size());
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = w + r * k + b * block;
      float lo = v[0], hi = v[0];
      for (int64_t j = 1; j < block; ++j) lo = std::min(lo, v[j]), hi = std::max(hi, v[j]);
      const size_t p = static_cast<size_t>(r * blocks + b);
      uint8_t* codes = &q.codes[static_cast<size_t>(r * k + b * block)];
      if (zero_mode == ZeroMode::kOffset) {
        const float scale = (hi - lo) / levels;
        q.scale[p] = scale;
        q.offset[p] = lo;
        for (int64_t j = 0; j < block; ++j)
          codes[j] = scale > 0.f ? static_cast<uint8_t>(std::clamp(std::rint((v[j] - lo) / scale), 0.f, levels)) : 0;
      } else {
        // The range always holds 0, as GPTQ's quantizer does, so that the zero point is a code.
        lo = std::min(lo, 0.f);
        hi = std::max(hi, 0.f);
        float scale = (hi - lo) / levels;
        if (!(scale > 0.f)) scale = 1.f;
        const float zero = std::clamp(std::rint(-lo / scale), 0.f, levels);
        q.scale[p] = scale;
        q.zero[p] = static_cast<uint8_t>(zero);
        q.offset[p] = -zero * scale;
        for (int64_t j = 0; j < block; ++j)
          codes[j] = static_cast<uint8_t>(std::clamp(std::rint(v[j] / scale) + zero, 0.f, levels));
      }
    }
  return q;
}

PackedWeight prepack(const QuantizedWeight& w, DType compute_dtype) {
  const ArgCheck check("tessera::linear::prepack");
  if (compute_dtype != DType::kBF16 && compute_dtype != DType::kFP16)
    check.fail("compute_dtype", std::string("must be bf16 or fp16, got ") + dtype_name(compute_dtype));
  check_quantized(check, w);
  PackedWeight p;
  p.n = w.n;
  p.k = w.k;
  p.bits = w.bits;
  p.block = w.block;
  p.zero_mode = w.zero_mode;
  p.compute_dtype = compute_dtype;
  p.k_perm = w.k_perm;
  const int64_t np = p.padded_n(), kp = p.padded_k(), nb = p.num_blocks(), blocks = w.k / w.block;
  const detail::FragmentLayout layout(w.bits);
  p.codes.assign(static_cast<size_t>(np * kp * w.bits / 8), 0);
  p.params.assign(static_cast<size_t>(np * nb * 2), 0);  // padded rows and blocks: scale 0, p 0 -> weight 0
  for (int64_t r = 0; r < w.n; ++r)
    for (int64_t c = 0; c < w.k; ++c) layout.put_code(p.codes.data(), kp, r, c, w.codes[r * w.k + c]);
  for (int64_t r = 0; r < w.n; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const size_t src = static_cast<size_t>(r * blocks + b);
      const size_t dst = static_cast<size_t>(detail::param_index(r, b, nb));
      p.params[dst] = to_bits(w.scale[src], compute_dtype);
      p.params[dst + 1] = w.zero_mode == ZeroMode::kZeroPoint ? to_bits(static_cast<float>(w.zero[src]), compute_dtype)
                                                              : to_bits(w.offset[src], compute_dtype);
    }
  return p;
}

QuantizedWeight unpack(const PackedWeight& p) {
  const ArgCheck check("tessera::linear::unpack");
  if (p.bits != 4 && p.bits != 8) check.fail("p.bits", "must be 4 or 8");
  if (p.n <= 0 || p.k <= 0 || p.block <= 0 || p.k % p.block != 0) check.fail("p", "has an invalid N, K or block");
  const int64_t np = p.padded_n(), kp = p.padded_k(), nb = p.num_blocks(), blocks = p.k / p.block;
  if (p.codes.size() != static_cast<size_t>(np * kp * p.bits / 8) ||
      p.params.size() != static_cast<size_t>(np * nb * 2))
    check.fail("p", "arrays do not match its N, K, bits and block");
  QuantizedWeight w;
  w.n = p.n;
  w.k = p.k;
  w.bits = p.bits;
  w.block = p.block;
  w.zero_mode = p.zero_mode;
  w.k_perm = p.k_perm;
  const detail::FragmentLayout layout(p.bits);
  w.codes.resize(static_cast<size_t>(p.n * p.k));
  for (int64_t r = 0; r < p.n; ++r)
    for (int64_t c = 0; c < p.k; ++c) w.codes[r * p.k + c] = layout.get_code(p.codes.data(), kp, r, c);
  w.scale.resize(static_cast<size_t>(p.n * blocks));
  w.offset.resize(w.scale.size());
  if (p.zero_mode == ZeroMode::kZeroPoint) w.zero.resize(w.scale.size());
  for (int64_t r = 0; r < p.n; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const size_t dst = static_cast<size_t>(r * blocks + b);
      const size_t src = static_cast<size_t>(detail::param_index(r, b, nb));
      const float scale = from_bits(p.params[src], p.compute_dtype);
      const float second = from_bits(p.params[src + 1], p.compute_dtype);
      w.scale[dst] = scale;
      if (p.zero_mode == ZeroMode::kZeroPoint) {
        w.zero[dst] = static_cast<uint8_t>(second);
        w.offset[dst] = -second * scale;
      } else {
        w.offset[dst] = second;
      }
    }
  return w;
}

}  // namespace tessera::linear
