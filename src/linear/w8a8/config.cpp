#include "linear/w8a8/config.h"

#include <algorithm>
#include <cmath>

namespace tessera::linear::w8a8 {
namespace {

// Model constants (H200, docs/perf/w8a8.md): the int8 tensor cores do 4096 MACs per SM per cycle (1979 TOPS dense at
// 1.83 GHz on 132 SMs); operand bytes that other running CTAs also read come from L2 at ~40 B per cycle per SM, weight
// bytes read by this CTA alone stream from DRAM at the rate this kernel's TMA ring measured (~22.5 GB/s per SM, 12.3 B
// per cycle: M 1, N 14336, K 4096 in 25 µs, and no faster with split K); a k-block costs ~64 cycles of barrier and
// issue overhead besides; each wave of CTAs a fixed ~2 µs (launch, the first TMA round trip) plus its epilogue, ~0.029
// µs per token row of the tile (fits of K = 128 runs: 2.2 / 5.7 / 9.4 µs a wave at 8 / 128 / 256 rows); the split
// reduction ~2 µs plus its traffic.
constexpr double kCyclesPerUs = 1830.0;
constexpr double kMacsPerCycle = 4096.0;
constexpr double kSharedBytesPerCycle = 40.0, kStreamBytesPerCycle = 12.3;
constexpr double kKBlockOverheadCycles = 64.0;
constexpr double kWaveFixedUs = 2.0, kWaveUsPerTokenRow = 0.029;
constexpr double kReduceUs = 2.0, kReduceBytesPerUs = 3.0e6;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

StageBytes stage_bytes(const Shape& s, int bn) {
  StageBytes b;
  b.kblocks = kblocks_per_stage(bn, s.blockwise());
  b.w = b.kblocks * kRows * kKBlock;
  b.x = b.kblocks * bn * kKBlock;
  b.blocks = s.blockwise() ? static_cast<int>(b.kblocks * kKBlock / s.block) : 0;
  b.token_plane = plane_slot_bytes(b.blocks, bn);
  b.weight_plane = plane_slot_bytes(b.blocks, kRows);
  b.params = 3 * (b.token_plane + b.weight_plane);
  b.total = (b.w + b.x + b.params + 1023) / 1024 * 1024;
  return b;
}

std::size_t smem_bytes(const Shape& s, const Config& c) {
  // The epilogue reuses the ring for a [bn][kRows + 4] fp32 tile.
  const std::size_t ring = static_cast<std::size_t>(c.stages) * static_cast<std::size_t>(stage_bytes(s, c.bn).total);
  const std::size_t tile = static_cast<std::size_t>(c.bn) * (kRows + 4) * 4;
  return kHeaderBytes + std::max(ring, tile);
}

std::size_t partial_bytes(const Shape& s, const Config& c) {
  return c.splits > 1
             ? static_cast<std::size_t>(c.splits) * static_cast<std::size_t>(s.m) * static_cast<std::size_t>(s.n) * 4
             : 0;
}

std::size_t max_partial_bytes(int64_t max_m, int64_t n, int num_sms) {
  // select_config splits only grids smaller than the SM count (n_tiles · m_tiles < num_sms), so m_tiles · 256 bounds
  // the rows, and at most kMaxSplits of them.
  const int64_t n_tiles = ceil_div(n, kRows);
  const int64_t rows = std::min<int64_t>(max_m, (num_sms / std::max<int64_t>(n_tiles, 1) + 1) * 256);
  return static_cast<std::size_t>(kMaxSplits) * static_cast<std::size_t>(rows) * static_cast<std::size_t>(n) * 4;
}

Config select_config(const Shape& s) {
  const int64_t k_blocks = ceil_div(s.k, kKBlock), n_tiles = ceil_div(s.n, kRows);
  Config best;
  double best_us = INFINITY;
  for (const int bn : {8, 32, 64, 128, 256}) {
    if (s.blockwise() && bn > kMaxBlockwiseBN) continue;
    const int64_t m_tiles = ceil_div(s.m, bn), tiles = n_tiles * m_tiles;
    const StageBytes sb = stage_bytes(s, bn);
    const int stages = static_cast<int>(std::min<int64_t>(kMaxStages, (kSmemBudget - kHeaderBytes) / sb.total));
    if (stages < 2) continue;
    // A weight tile is read by the m_tiles CTAs of its column (running together: token tiles are the grid's fastest
    // dimension), once from DRAM; x tiles are shared by every running n-tile.
    const double share = static_cast<double>(std::min<int64_t>(m_tiles, s.num_sms));
    const double w_bytes = static_cast<double>(kRows) * kKBlock, x_bytes = static_cast<double>(bn) * kKBlock;
    const double load_cycles = w_bytes / share / kStreamBytesPerCycle +
                               w_bytes * (1.0 - 1.0 / share) / kSharedBytesPerCycle + x_bytes / kSharedBytesPerCycle;
    const double kblock_cycles =
        std::max(static_cast<double>(kRows) * bn * kKBlock / kMacsPerCycle, load_cycles) + kKBlockOverheadCycles;
    const int max_splits = static_cast<int>(std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, k_blocks / 4)));
    for (int splits = 1; splits <= max_splits; ++splits) {
      if (splits > 1 && tiles >= s.num_sms) break;
      const int64_t waves = ceil_div(tiles * splits, s.num_sms);
      const double us =
          waves * (ceil_div(k_blocks, splits) * kblock_cycles / kCyclesPerUs + kWaveFixedUs + kWaveUsPerTokenRow * bn) +
          (splits > 1 ? kReduceUs + 8.0 * splits * s.m * s.n / kReduceBytesPerUs : 0.0);
      if (us < best_us * 0.999) {
        best_us = us;
        best.bn = bn;
        best.splits = splits;
        best.stages = stages;
        best.n_tiles = n_tiles;
        best.m_tiles = m_tiles;
      }
    }
  }
  return best;
}

}  // namespace tessera::linear::w8a8
