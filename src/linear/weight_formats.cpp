#include "linear/weight_formats.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "common/host_numeric.h"
#include "common/validate.h"

namespace tessera::linear {
namespace {

void check_common(const ::tessera::detail::ArgCheck& check, const void* qweight, const void* qzeros, const void* scales,
                  int64_t k, int64_t n, int bits, int64_t group, int64_t n_pack) {
  if (qweight == nullptr) check.fail("qweight", "is null");
  if (qzeros == nullptr) check.fail("qzeros", "is null");
  if (scales == nullptr) check.fail("scales", "is null");
  if (bits != 4 && bits != 8) check.fail("bits", "must be 4 or 8, got " + std::to_string(bits));
  if (k <= 0 || n <= 0)
    check.fail("qweight", "must describe K > 0 and N > 0, got K " + std::to_string(k) + ", N " + std::to_string(n));
  if (group <= 0 || k % group != 0)
    check.fail("group", "must divide K = " + std::to_string(k) + ", got " + std::to_string(group));
  if (n % n_pack != 0)
    check.fail("qzeros", "packs N along 32-bit words: N = " + std::to_string(n) + " must be a multiple of " +
                             std::to_string(n_pack));
}

// Field j (bits wide) of a 32-bit word.
inline uint32_t field(int32_t word, int j, int bits) {
  return (static_cast<uint32_t>(word) >> (bits * j)) & ((1u << bits) - 1u);
}

}  // namespace

QuantizedWeight import_gptq(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales, const int32_t* g_idx,
                            int64_t k, int64_t n, int bits, int64_t group, bool zero_stored_minus_one) {
  const ::tessera::detail::ArgCheck check("tessera::linear::import_gptq");
  const int per_word = bits == 8 ? 4 : 8;  // before check_common validates bits: 4 -> 8 per word, 8 -> 4
  check_common(check, qweight, qzeros, scales, k, n, bits, group, per_word);
  if (k % per_word != 0)
    check.fail("qweight", "packs K along 32-bit words: K = " + std::to_string(k) + " must be a multiple of " +
                              std::to_string(per_word));
  const int64_t groups = k / group;
  // The columns in group order: act-order g_idx sorted (stable), or the
  // identity.
  std::vector<int32_t> order(static_cast<size_t>(k));
  std::iota(order.begin(), order.end(), 0);
  std::vector<int64_t> group_of(static_cast<size_t>(k));
  bool identity = true;
  for (int64_t c = 0; c < k; ++c) {
    const int64_t g = g_idx != nullptr ? g_idx[c] : c / group;
    if (g < 0 || g >= groups)
      check.fail("g_idx", "[" + std::to_string(c) + "] = " + std::to_string(g) + " is outside [0, " +
                              std::to_string(groups) + ")");
    group_of[c] = g;
    identity = identity && g == c / group;
  }
  if (!identity) {
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return group_of[a] < group_of[b]; });
    for (int64_t j = 0; j < k; ++j)
      if (group_of[order[j]] != j / group)
        check.fail("g_idx", "must give every group exactly " + std::to_string(group) + " columns (group " +
                                std::to_string(j / group) + " does not)");
  }
  QuantizedWeight w;
  w.n = n;
  w.k = k;
  w.bits = bits;
  w.block = group;
  w.zero_mode = ZeroMode::kZeroPoint;
  w.codes.resize(static_cast<size_t>(n * k));
  w.scale.resize(static_cast<size_t>(n * groups));
  w.offset.resize(w.scale.size());
  w.zero.resize(w.scale.size());
  if (!identity) w.k_perm = order;
  const int64_t zero_cols = n / per_word;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < n; ++c) {
      const float s = host::fp16_to_f32(scales[g * n + c]);
      const uint32_t stored = field(qzeros[g * zero_cols + c / per_word], static_cast<int>(c % per_word), bits);
      const uint32_t z = zero_stored_minus_one ? (stored + 1u) & ((1u << bits) - 1u) : stored;
      w.scale[c * groups + g] = s;
      w.offset[c * groups + g] = -static_cast<float>(z) * s;  // exact: z < 256, s an fp16 value
      w.zero[c * groups + g] = static_cast<uint8_t>(z);
    }
  for (int64_t j = 0; j < k; ++j) {
    const int64_t src = order[j];
    for (int64_t c = 0; c < n; ++c)
      w.codes[c * k + j] =
          static_cast<uint8_t>(field(qweight[(src / per_word) * n + c], static_cast<int>(src % per_word), bits));
  }
  return w;
}

QuantizedWeight import_awq(const int32_t* qweight, const int32_t* qzeros, const uint16_t* scales, int64_t k, int64_t n,
                           int64_t group) {
  const ::tessera::detail::ArgCheck check("tessera::linear::import_awq");
  check_common(check, qweight, qzeros, scales, k, n, 4, group, 8);
  constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble i holds column 8c + kOrder[i]
  const int64_t groups = k / group, cols = n / 8;
  QuantizedWeight w;
  w.n = n;
  w.k = k;
  w.bits = 4;
  w.block = group;
  w.zero_mode = ZeroMode::kZeroPoint;
  w.codes.resize(static_cast<size_t>(n * k));
  w.scale.resize(static_cast<size_t>(n * groups));
  w.offset.resize(w.scale.size());
  w.zero.resize(w.scale.size());
  for (int64_t row = 0; row < k; ++row)
    for (int64_t c = 0; c < cols; ++c)
      for (int i = 0; i < 8; ++i)
        w.codes[(8 * c + kOrder[i]) * k + row] = static_cast<uint8_t>(field(qweight[row * cols + c], i, 4));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < cols; ++c)
      for (int i = 0; i < 8; ++i) {
        const int64_t col = 8 * c + kOrder[i];
        const float s = host::fp16_to_f32(scales[g * n + col]);
        w.scale[col * groups + g] = s;
        const uint32_t z = field(qzeros[g * cols + c], i, 4);
        w.offset[col * groups + g] = -static_cast<float>(z) * s;
        w.zero[col * groups + g] = static_cast<uint8_t>(z);
      }
  return w;
}

namespace detail {

void check_bits_and_block(const ::tessera::detail::ArgCheck& check, int bits, int64_t k, int64_t block) {
  if (bits != 4 && bits != 8) check.fail("w.bits", "must be 4 or 8, got " + std::to_string(bits));
  if (block != k && block != 32 && block != 64 && block != 128)
    check.fail("w.block", "must be 32, 64, 128 or K (per output channel), got " + std::to_string(block));
  if (block <= 0 || k % block != 0)
    check.fail("w.block", std::to_string(block) + " does not divide K = " + std::to_string(k));
}

}  // namespace detail
}  // namespace tessera::linear
