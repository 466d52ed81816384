// Internal: builds the W8A8 kernel's tensor maps and arguments and launches one instantiation (included by the two
// launch translation units, one per form, so that their kernels compile in parallel).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/check.h"
#include "common/occupancy.h"
#include "common/tensor_map.h"
#include "linear/w8a8/kernel.cuh"
#include "linear/w8a8/problem.h"

namespace tessera::linear::w8a8 {

// Planes of one operand's parameters: [blocks][ld / 4][16 bytes], a box of `rows` / 4 rows × kBps blocks.
inline PlaneMaps make_plane_maps(const Operand& op, int64_t blocks, int rows, int bps) {
  using ::tessera::detail::L2Promotion;
  PlaneMaps pm{};
  const float* planes[3] = {op.scale, op.zero, op.sums};
  const int64_t dims[3] = {16, op.ld_params / 4, blocks};
  const int64_t strides[2] = {16, op.ld_params * 4};
  const int box[3] = {16, rows / 4, bps};
  for (int p = 0; p < 3; ++p)
    if (planes[p] != nullptr)
      pm.plane[p] = ::tessera::detail::make_tensor_map_u8(planes[p], 3, dims, strides, box, 0, L2Promotion::k128B);
  return pm;
}

inline Args make_args(const Problem& pb) {
  const Shape& s = pb.shape;
  Args a{};
  a.m = s.m;
  a.n = s.n;
  a.k = s.k;
  a.k_blocks = static_cast<int>((s.k + kKBlock - 1) / kKBlock);
  a.splits = pb.config.splits;
  a.stages = pb.config.stages;
  a.a_scale = pb.a.scale;
  a.a_zero = pb.a.zero;
  a.a_sums = pb.a.sums;
  a.w_scale = pb.w.scale;
  a.w_zero = pb.w.zero;
  a.w_sums = pb.w.sums;
  a.has_za = pb.a.zero != nullptr;
  a.has_zb = pb.w.zero != nullptr;
  a.y = pb.y;
  a.ldy = pb.ldy;
  a.out_type = pb.out_type;
  {
    const int64_t esize = pb.out_type == 2 ? 4 : pb.out_type == 3 ? 1 : 2, align = pb.out_type == 3 ? 8 : 16;
    a.y_vec = reinterpret_cast<std::uintptr_t>(pb.y) % align == 0 && (pb.ldy * esize) % align == 0;
  }
  a.bias = pb.bias;
  a.clamp_min = pb.clamp_min;
  a.clamp_max = pb.clamp_max;
  a.out_scale = pb.out_scale;
  a.partial = pb.config.splits > 1 ? pb.workspace : nullptr;
  return a;
}

template <int kBN, int kBlock>
void launch_kernel(const Problem& pb, cudaStream_t stream) {
  using ::tessera::detail::L2Promotion;
  using ::tessera::detail::TmaElement;
  const Shape& s = pb.shape;
  const Config& c = pb.config;
  const StageBytes sb = stage_bytes(s, kBN);
  Maps maps{};
  // A one-row operand may have any row stride (it is never used), but TMA wants every stride a multiple of 16.
  auto row_stride = [&](int64_t rows, int64_t ld) { return rows == 1 ? (s.k + 15) / 16 * 16 : ld; };
  const int64_t ldw = row_stride(s.n, pb.w.ld_codes), lda = row_stride(s.m, pb.a.ld_codes);
  maps.w = ::tessera::detail::make_tensor_map_sw128(pb.w.codes, TmaElement::kU8, s.k, s.n, 1, ldw, s.n * ldw, kRows);
  maps.x = ::tessera::detail::make_tensor_map_sw128(pb.a.codes, TmaElement::kU8, s.k, s.m, 1, lda, s.m * lda, kBN);
  Args a = make_args(pb);
  a.stage_bytes = static_cast<uint32_t>(sb.total);
  a.w_bytes = static_cast<uint32_t>(sb.w);
  a.x_bytes = static_cast<uint32_t>(sb.x);
  uint32_t tx = static_cast<uint32_t>(sb.w + sb.x);
  if constexpr (kBlock != 0) {
    const int64_t blocks = s.k / kBlock;
    maps.ap = make_plane_maps(pb.a, blocks, kBN, sb.blocks);
    maps.wp = make_plane_maps(pb.w, blocks, kRows, sb.blocks);
    const int a_planes = 1 + (a.has_za ? 1 : 0) + (a.has_zb ? 1 : 0);
    tx += static_cast<uint32_t>(a_planes * sb.blocks * (kBN + kRows) * 4);
  }
  a.tx_bytes = tx;
  auto kernel = w8a8_gemm_kernel<kBN, kBlock>;
  const int smem = static_cast<int>(smem_bytes(s, c));
  ::tessera::detail::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads, smem);
  const dim3 grid(static_cast<unsigned>(c.m_tiles), static_cast<unsigned>(c.n_tiles), static_cast<unsigned>(c.splits));
  kernel<<<grid, kThreads, smem, stream>>>(maps, a);
  TESSERA_CHECK_LAUNCH();
  if (c.splits > 1) {
    const int blocks = ::tessera::detail::elementwise_grid(s.m * s.n);
    w8a8_reduce_partials<kBlock != 0><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
    TESSERA_CHECK_LAUNCH();
  }
}

}  // namespace tessera::linear::w8a8
