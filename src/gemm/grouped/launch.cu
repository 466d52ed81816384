// Grouped GEMM launcher: tensor maps, tile configuration, persistent grid.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/check.h"
#include "common/device_info.h"
#include "common/occupancy.h"
#include "common/tensor_map.h"
#include "gemm/grouped/config.h"
#include "gemm/grouped/kernel.cuh"
#include "gemm/grouped/problem.h"

namespace tessera::gemm::detail {
namespace {

template <bool kFP8, int kBlockM, int kWgRows>
void launch_config(const GroupedProblem& pb, const GroupedGemmConfig& cfg, cudaStream_t stream) {
  constexpr int kTileWidth = 2 * kWgRows;
  auto kernel = grouped_gemm_kernel<kFP8, kBlockM, kWgRows>;
  // Also raises the kernel's dynamic shared-memory limit (once per device and size).
  const int per_sm = ::tessera::detail::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads,
                                                               cfg.smem_bytes);

  const bool masked = pb.layout == Layout::kMasked;
  // Token rows: contiguous [1][M][K]; masked [G][max_m][K] (TMA clips each group at max_m).
  using ::tessera::detail::make_tensor_map_sw128;
  static_assert(kTileKBytes == 128, "stages are one 128-byte swizzle row of K");
  const auto elem = kFP8 ? ::tessera::detail::TmaElement::kU8 : ::tessera::detail::TmaElement::kBF16;
  const CUtensorMap tmap_x =
      make_tensor_map_sw128(pb.x, elem, pb.k, pb.rows, masked ? pb.num_groups : 1, pb.x_row_stride,
                            masked ? pb.x_group_stride : pb.rows * pb.x_row_stride, kBlockM);
  const CUtensorMap tmap_w = make_tensor_map_sw128(pb.w, elem, pb.k, pb.n, pb.num_groups, pb.w_row_stride,
                                                   pb.w_group_stride, kTileWidth);

  KernelParams kp{};
  kp.num_groups = pb.num_groups;
  kp.masked = masked ? 1 : 0;
  kp.scaling = static_cast<int>(pb.scaling);
  kp.stages = cfg.stages;
  kp.rows = pb.rows;
  kp.n_tiles = static_cast<int>(pb.n / kTileWidth);
  kp.k_blocks = static_cast<int>(pb.k * (kFP8 ? 1 : 2) / kTileKBytes);
  kp.group_rows = pb.group_rows;
  kp.y = static_cast<__nv_bfloat16*>(pb.y);
  kp.y_row_stride = pb.y_row_stride;
  kp.y_group_stride = pb.y_group_stride;
  kp.x_scale = pb.x_scale;
  kp.xs_row_stride = pb.xs_row_stride;
  kp.xs_k_stride = pb.xs_k_stride;
  kp.xs_group_stride = pb.xs_group_stride;
  kp.w_scale = pb.w_scale;
  kp.ws_group_stride = pb.ws_group_stride;
  kp.ws_n_stride = pb.ws_n_stride;
  kp.ws_k_stride = pb.ws_k_stride;

  // Grid size only: with monotone offsets tiles number at most (rows / block_m + G) × n_tiles (contiguous) or
  // G × ceil(max_m / block_m) × n_tiles (masked); overlapping groups just give each CTA more tiles.
  const int64_t m_tiles_bound = masked ? pb.num_groups * ((pb.rows + kBlockM - 1) / kBlockM)
                                       : (pb.rows + kBlockM - 1) / kBlockM + pb.num_groups;
  const int64_t tiles_bound = m_tiles_bound * kp.n_tiles;
  const int grid = static_cast<int>(std::min<int64_t>(tiles_bound, int64_t{per_sm} * ::tessera::detail::current_device_info().num_sms));
  kernel<<<grid, kThreads, cfg.smem_bytes, stream>>>(tmap_x, tmap_w, kp);
  TESSERA_CHECK_LAUNCH();
}

template <bool kFP8>
void launch_operand(const GroupedProblem& pb, cudaStream_t stream) {
  const GroupedGemmConfig cfg = select_config(pb.expected_m, pb.n, pb.num_groups);
  if (cfg.tile_width == 256) {
    if (cfg.block_m == 64) return launch_config<kFP8, 64, 128>(pb, cfg, stream);
    return launch_config<kFP8, 128, 128>(pb, cfg, stream);
  }
  switch (cfg.block_m) {
    case 8: return launch_config<kFP8, 8, 64>(pb, cfg, stream);
    case 16: return launch_config<kFP8, 16, 64>(pb, cfg, stream);
    case 32: return launch_config<kFP8, 32, 64>(pb, cfg, stream);
    case 64: return launch_config<kFP8, 64, 64>(pb, cfg, stream);
    default: return launch_config<kFP8, 128, 64>(pb, cfg, stream);
  }
}

}  // namespace

void launch_grouped_gemm(const GroupedProblem& problem, cudaStream_t stream) {
  if (problem.operand == Operand::kFP8) {
    launch_operand<true>(problem, stream);
  } else {
    launch_operand<false>(problem, stream);
  }
}

}  // namespace tessera::gemm::detail
