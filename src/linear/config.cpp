#include "linear/config.h"

#include <algorithm>
#include <cmath>

namespace tessera::linear::detail {
namespace {

// Model constants (H200, docs/perf/linear.md): DRAM read bandwidth and the most one SM streams (a ring of up to 16
// stages keeps ~60 KB in flight), dense bf16 wgmma and conversion rates per SM, the latency of filling a CTA's ring,
// the launch of the split reduction.
constexpr double kDramBytesPerUs = 4.48e6;
constexpr double kSmShareCap = 1.3;
constexpr double kWgmmaFlopsPerUsPerSm = 6.0e6;
constexpr double kL2Weight = 0.25;  // x re-reads come from L2
constexpr double kRampUs = 1.5;
// The consumers' cost of one 64-column k-block of the CTA's 128 rows (conversion, fragments, barriers), measured on an
// H200 at M 1 with the session-15 scale-before kernel (docs/perf/linear.md): ~0.33 µs int4, ~0.47 µs int8. The wgmma
// tiles pay it on top of the products (measured not overlapped, session 16), the mma.sync tiles the larger of the two.
constexpr double kKBlockUsInt4 = 0.33, kKBlockUsInt8 = 0.47;
constexpr double kReduceLaunchUs = 1.5;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

StageBytes stage_bytes(int bn, int bits, int64_t block, int64_t k) {
  StageBytes s;
  s.kblocks = kblocks_per_stage(bn);
  s.tiles_per_kblock = bits == 4 ? 1 : 2;
  const int64_t cols = static_cast<int64_t>(s.kblocks) * kKBlock;
  s.blocks = (block == k || block >= cols) ? 1 : static_cast<int>(cols / block);
  s.x = s.kblocks * bn * 128;
  s.codes = kGemmStripes * s.kblocks * s.tiles_per_kblock * 512;
  s.params = kGemmStripes * s.blocks * 64;
  s.total = (s.x + s.codes + s.params + 1023) / 1024 * 1024;
  return s;
}

std::size_t partial_bytes(const LinearShape& s, const LinearConfig& c) {
  return c.splits > 1 ? static_cast<std::size_t>(c.splits) * static_cast<std::size_t>(s.m) *
                            static_cast<std::size_t>(s.n) * sizeof(float)
                      : 0;
}

std::size_t max_partial_bytes(int64_t max_m, int64_t n, int num_sms) {
  const int64_t n_tiles = ceil_div(n, kGemmRows);
  const int64_t rows = std::min<int64_t>(kMaxSplits * max_m, 2 * num_sms * 256 / n_tiles + 256);
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(n) * sizeof(float);
}

std::size_t gemm_smem_bytes(const LinearShape& s, const LinearConfig& c) {
  return 1024 + static_cast<std::size_t>(c.stages) * stage_bytes(c.bn, s.bits, s.block, s.k).total;
}

LinearConfig select_config(const LinearShape& s) {
  const int64_t k_blocks = ceil_div(s.k, kKBlock), n_tiles = ceil_div(s.n, kGemmRows);
  const double sm_bytes_per_us = kDramBytesPerUs / s.num_sms;
  LinearConfig best;
  best.predicted_us = INFINITY;
  const bool fits_grid = ceil_div(s.m, 256) <= kMaxGridY;
  for (int bn : {8, 16, 32, 64, 96, 128, 192, 256}) {
    if (bn < s.min_bn || ((bn == 96 || bn == 192) && !s.wave_tiles)) continue;
    if (bn > std::max(8, s.min_bn) && s.m <= bn / 2) continue;  // a smaller tile covers M
    LinearConfig c;
    c.bn = bn;
    c.n_tiles = n_tiles;
    c.m_tiles = ceil_div(s.m, bn);
    // The grid's y dimension: where a 256-row tile fits it, smaller tiles that do not are no candidates. Where none
    // fits (M > kMaxLinearM) the choice keeps its m_tiles > kMaxGridY, which callers refuse (linear: the M rule;
    // conv: that path).
    if (fits_grid && c.m_tiles > kMaxGridY) continue;
    const StageBytes sb = stage_bytes(bn, s.bits, s.block, s.k);
    c.stages = static_cast<int>(std::min<int64_t>(kMaxStages, (kGemmSmemBudget - 1024) / sb.total));
    c.stages = std::max(c.stages, static_cast<int>(ceil_div(epilogue_tile_bytes(bn), sb.total)));
    // Splits own whole stages, at least two each.
    const int64_t k_stages = ceil_div(k_blocks, kblocks_per_stage(bn));
    const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, k_stages / 2));
    for (int64_t splits = 1; splits <= max_splits; ++splits) {
      const int64_t ctas = n_tiles * c.m_tiles * splits, waves = ceil_div(ctas, s.num_sms);
      // A split grid stays within two waves: this bounds the partials (linear_workspace_bytes relies on it).
      if (splits > 1 && ctas > 2 * s.num_sms) break;
      const double cols = static_cast<double>(k_blocks) * kKBlock / splits;
      const double code_bytes = kGemmRows * cols * (s.bits / 8.0) * 1.0625;  // + the block parameters
      const double x_bytes = std::min<int64_t>(bn, s.m) * cols * 2.0;
      // An SM streams at most kSmShareCap times its share; the GPU at most all of it.
      const double cta_bytes = code_bytes + kL2Weight * x_bytes;
      const double mem =
          std::max(cta_bytes / (kSmShareCap * sm_bytes_per_us),
                   static_cast<double>(std::min(ctas, static_cast<int64_t>(s.num_sms))) * cta_bytes / kDramBytesPerUs);
      // mma.sync tiles (bn <= kMmaSyncMaxBN) run at about a third of the wgmma rate.
      const double mma = 2.0 * kGemmRows * cols * bn / kWgmmaFlopsPerUsPerSm * (bn <= kMmaSyncMaxBN ? 3.0 : 1.0);
      const double dequant = (cols / kKBlock) * (s.bits == 4 ? kKBlockUsInt4 : kKBlockUsInt8);
      // wgmma tiles pay the conversion on top of the products (measured: per k-block, 128-token tiles cost ~2/3 of
      // 256-token ones, not 1/2), so larger tiles amortize it; the mma.sync tiles are bound by the slower of the two.
      const double compute = bn <= kMmaSyncMaxBN ? std::max(mma, dequant) : mma + dequant;
      double us = static_cast<double>(waves) * (std::max(mem, compute) + kRampUs);
      if (splits > 1)
        us += kReduceLaunchUs + 2.0 * splits * static_cast<double>(s.m) * s.n * 4.0 / (3.0 * kDramBytesPerUs);
      // Ties (within 2 %) keep the earlier candidate: fewer splits, smaller tiles.
      if (us < best.predicted_us * 0.98) {
        c.splits = static_cast<int>(splits);
        c.predicted_us = us;
        best = c;
      }
    }
  }
  return best;
}

}  // namespace tessera::linear::detail
