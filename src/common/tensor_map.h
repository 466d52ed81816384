// Internal: TMA tensor maps (CUtensorMap) built on the host through the driver entry point, without linking
// libcuda. Pass the map to a kernel by value as a __grid_constant__ parameter.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace tessera::detail {

enum class TmaElement : int { kU8 = 0, kBF16 = 1 };

// How far the L2 widens each TMA request (CUtensorMapL2promotion). 256 bytes suits tiles that neighbouring CTAs
// re-read soon (GEMM operands); a one-pass stream reads at its full rate only with 128 bytes or less (measured on an
// H200: a 16-row box of 256-byte rows, 256 CTAs, 4.02 TB/s with 256-byte promotion against 4.44 TB/s with 128,
// equal to a plain 16-byte-load stream; docs/perf/decode.md, v9).
enum class L2Promotion : int { kNone = 0, k128B = 128, k256B = 256 };

// A 3-D tiled map over a [dim2][dim1][dim0] tensor (dim0 contiguous; strides in elements) whose box is
// [1][box_rows][128 bytes], loaded with the 128-byte swizzle (the layout wgmma's K-major descriptors read).
// Elements outside the tensor read as zeros. Throws tessera::Error when the driver rejects it.
CUtensorMap make_tensor_map_sw128(const void* data, TmaElement element, int64_t dim0, int64_t dim1, int64_t dim2,
                                  int64_t stride1, int64_t stride2, int box_rows);
// The same over a [dim3][dim2][dim1][dim0] tensor, box [1][box_planes][box_rows][128 bytes] (a batch of such
// tensors; box_planes > 1 lands box_planes blocks of box_rows rows one after the other).
CUtensorMap make_tensor_map_sw128(const void* data, TmaElement element, int64_t dim0, int64_t dim1, int64_t dim2,
                                  int64_t dim3, int64_t stride1, int64_t stride2, int64_t stride3, int box_rows,
                                  int box_planes = 1);

// A tiled map of rank 1..5 over bytes: dims[i] and box[i] innermost first, strides_bytes[i - 1] the stride of
// dim i >= 1 (multiples of 16, in any order), swizzle_bytes 0 (none), 32, 64 or 128 (box[0] must not exceed it). Elements
// outside the tensor read as zeros. Throws tessera::Error when the driver rejects it.
CUtensorMap make_tensor_map_u8(const void* data, int rank, const int64_t* dims, const int64_t* strides_bytes,
                               const int* box, int swizzle_bytes, L2Promotion promotion);

// An im2col map (PTX ISA 5.5.4) over a contiguous NHWC tensor [n][h][w][c] of 16-bit elements, for copies of
// `pixels` filter bases × 64 channels (one 128-byte swizzled row each): bounding box corners relative to (0, 0) and
// to (h − 1, w − 1) (a conv's (−pad, −pad) and (pad − dil·(k − 1), ...)), traversal strides the conv's strides.
// Throws tessera::Error when the driver rejects it.
struct Im2colBox {
  int64_t n = 1, h = 1, w = 1, c = 64;
  int lower_h = 0, lower_w = 0, upper_h = 0, upper_w = 0;
  int stride_h = 1, stride_w = 1;
  int pixels = 64;
};
CUtensorMap make_tensor_map_im2col(const void* data, const Im2colBox& box);

}  // namespace tessera::detail
