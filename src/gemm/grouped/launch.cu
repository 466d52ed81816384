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

template <bool kFP8>
void launch_operand(const GroupedProblem& pb, cudaStream_t stream) {
  auto kernel = pb.act != nullptr ? grouped_gemm_kernel<kFP8, true> : grouped_gemm_kernel<kFP8, false>;
  const int stages = select_stages(pb.num_groups);
  const int smem = SmemLayout::make(stages, pb.num_groups).total_bytes;
  // Also raises the kernel's dynamic shared-memory limit (once per device and size).
  const int per_sm =
      ::tessera::detail::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads, smem);

  const bool masked = pb.layout == Layout::kMasked;
  // Token rows: contiguous [1][M][K]; masked [G][max_m][K] (TMA clips each group at max_m), in boxes of 8, 64 and
  // 128 rows; weights [G][N][K] in boxes of 64, 128 and 256 rows (kernel.cuh: which tile loads which).
  using ::tessera::detail::make_tensor_map_sw128;
  static_assert(kTileKBytes == 128, "k-blocks are one 128-byte swizzle row of K");
  const auto elem = kFP8 ? ::tessera::detail::TmaElement::kU8 : ::tessera::detail::TmaElement::kBF16;
  const int64_t x_groups = masked ? pb.num_groups : 1;
  const int64_t x_group_stride = masked ? pb.x_group_stride : pb.rows * pb.x_row_stride;
  const CUtensorMap tmap_x8 =
      make_tensor_map_sw128(pb.x, elem, pb.k, pb.rows, x_groups, pb.x_row_stride, x_group_stride, 8);
  const CUtensorMap tmap_x64 =
      make_tensor_map_sw128(pb.x, elem, pb.k, pb.rows, x_groups, pb.x_row_stride, x_group_stride, 64);
  const CUtensorMap tmap_x128 =
      make_tensor_map_sw128(pb.x, elem, pb.k, pb.rows, x_groups, pb.x_row_stride, x_group_stride, 128);
  // Weight boxes of 128 rows, 256 (the 128 × 256 tiles, which exist only where N is a multiple of 256) and 64 (a
  // decode launch's split tiles, config.h: split_decode_tiles). The fused activation's (problem.h) have the same
  // heights, each box [rows / 16 chunks][gate, up][8 rows][128 bytes of K] of a 5-D byte map over w viewed as
  // [G][I / 8][2][8][K], so that tile rows 16c..16c+7 are gate rows and rows 16c+8.. the up rows of the same columns.
  const bool fused = pb.act != nullptr;
  if (fused && (masked || pb.scaling == Scaling::kBlockwise || pb.n % 256 != 0))
    throw Error("tessera: internal: the fused activation takes the contiguous layout, bf16 or per-tensor fp8, and N a "
                "multiple of 256");
  const auto weight_map = [&](int rows) {
    if (!fused)
      return make_tensor_map_sw128(pb.w, elem, pb.k, pb.n, pb.num_groups, pb.w_row_stride, pb.w_group_stride, rows);
    const int64_t eb = kFP8 ? 1 : 2, half = pb.n / 2;
    const int64_t dims[5] = {pb.k * eb, 8, 2, half / 8, pb.num_groups};
    const int64_t strides[4] = {pb.w_row_stride * eb, half * pb.w_row_stride * eb, 8 * pb.w_row_stride * eb,
                                pb.w_group_stride * eb};
    const int box[5] = {kTileKBytes, 8, 2, rows / 16, 1};
    return ::tessera::detail::make_tensor_map_u8(pb.w, 5, dims, strides, box, 128,
                                                 ::tessera::detail::L2Promotion::k256B);
  };
  const CUtensorMap tmap_w = weight_map(kWeightBox);
  const CUtensorMap tmap_w256 = pb.n % 256 != 0 ? tmap_w : weight_map(256);
  const CUtensorMap tmap_w64 = weight_map(64);

  KernelParams kp{};
  kp.num_groups = pb.num_groups;
  kp.masked = masked ? 1 : 0;
  kp.scaling = static_cast<int>(pb.scaling);
  kp.stages = stages;
  kp.rows = pb.rows;
  kp.n = pb.n;
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
  kp.act = pb.act;
  kp.act_row_stride = pb.act_row_stride;
  kp.act_scale = pb.act_scale;

  // Grid size only (config.h: grid_tile_bound; the tile shapes are chosen on the device).
  const int64_t slots = int64_t{per_sm} * ::tessera::detail::current_device_info().num_sms;
  const int grid =
      static_cast<int>(std::min<int64_t>(grid_tile_bound(masked, pb.rows, pb.num_groups, pb.n), slots));
  kernel<<<grid, kThreads, smem, stream>>>(tmap_x8, tmap_x64, tmap_x128, tmap_w, tmap_w256, tmap_w64, kp);
  TESSERA_CHECK_LAUNCH();
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
