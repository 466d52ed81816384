// Internal: the prepacked layout of a weight-only quantized matrix (tessera/linear.h, docs/ops/linear.md), as prepack
// and unpack write and read it; the kernel reads the same bytes by TMA boxes (launch.cu) and fragment offsets
// (gemm_kernel.cuh).
//
// Rows go in 16-row stripes, columns in tiles of kTileK (64 int4 / 32 int8) columns; a (stripe, tile) is 512 bytes:
// lane l = 4g + t of a warp holds 16 bytes, its mma.m16n8k16 A-fragment codes for the tile's kTileK / 16 steps of 16
// columns (the same per-warp layout as wgmma's register A operand). Step i's fragment value v (mma.cuh: v0,v1 = a0,
// v2,v3 = a1, v4,v5 = a2, v6,v7 = a3) is row g (v0, v1, v4, v5) or g + 8 (v2, v3, v6, v7) of the stripe, column
//     k = tile · kTileK + 16i + 2t + {0, 1, 0, 1, 8, 9, 8, 9}[v]
// int4: step i is 32-bit word i, value v in nibble nibble_of(v) (bits 4·nibble), so that one lop3 with 0x000f000f
//       (or the word shifted) yields a register pair; int8: step i is bytes 8i..8i+7, value v in byte 8i + v.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace tessera::linear::detail {

// Nibble that holds fragment value v (int4): 0, 4, 1, 5, 2, 6, 3, 7 for v = 0..7; its inverse orders the nibbles of
// a word as values 0,2,4,6,1,3,5,7.
TESSERA_HD constexpr int nibble_of(int v) { return (v >> 1) + ((v & 1) << 2); }
// Index (in 16-bit elements) of the scale of row r, block b; the second parameter (offset or zero) follows it.
// Per 16-row stripe and block: 16 pairs, rows in the order 0, 8, 1, 9, ..., 7, 15, so that lane group g reads the
// pairs of rows g and g + 8 with one 8-byte load.
TESSERA_HD inline int64_t param_index(int64_t r, int64_t b, int64_t num_blocks) {
  const int64_t rr = r % 16;
  return (((r / 16) * num_blocks + b) * 16 + (rr % 8) * 2 + rr / 8) * 2;
}

struct FragmentLayout {
  int bits, tile_k;
  TESSERA_HD explicit FragmentLayout(int bits_) : bits(bits_), tile_k(bits_ == 4 ? 64 : 32) {}

  // Byte offset of (r, c) in a codes array with kp padded columns; for int4 also the shift of its nibble.
  TESSERA_HD int64_t byte_of(int64_t kp, int64_t r, int64_t c, int* shift) const {
    const int64_t tiles = kp / tile_k;
    const int64_t rr = r % 16, g = rr % 8, ck = c % tile_k, step = ck / 16, cc = ck % 16, t = (cc % 8) / 2;
    const int v = (cc >= 8 ? 4 : 0) + (rr >= 8 ? 2 : 0) + static_cast<int>(cc % 2);
    const int64_t base = (((r / 16) * tiles + c / tile_k) * 32 + 4 * g + t) * 16;
    if (bits == 8) {
      *shift = 0;
      return base + 8 * step + v;
    }
    const int nibble = nibble_of(v);
    *shift = 4 * (nibble % 2);
    return base + 4 * step + nibble / 2;
  }
  TESSERA_HD void put_code(uint8_t* codes, int64_t kp, int64_t r, int64_t c, uint8_t q) const {
    int shift = 0;
    const int64_t b = byte_of(kp, r, c, &shift);
    codes[b] = bits == 8 ? q : static_cast<uint8_t>((codes[b] & ~(0xF << shift)) | ((q & 0xF) << shift));
  }
  TESSERA_HD uint8_t get_code(const uint8_t* codes, int64_t kp, int64_t r, int64_t c) const {
    int shift = 0;
    const int64_t b = byte_of(kp, r, c, &shift);
    return bits == 8 ? codes[b] : static_cast<uint8_t>((codes[b] >> shift) & 0xF);
  }
};

}  // namespace tessera::linear::detail
