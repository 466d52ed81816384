// PTX wrappers: warp-level tensor-core products (PTX ISA: "Warp-level Matrix Multiply-Accumulate Instructions:
// mma", shape m16n8k16). Thread scope: the whole warp, converged.
//
// Fragment ownership for lane = 4 * r + c (r = lane / 4, c = lane % 4):
//   A (16x16, row): a0 = (r, 2c..2c+1), a1 = (r+8, 2c..), a2 = (r, 2c+8..), a3 = (r+8, 2c+8..)
//   B (16x8, col):  b0 = (k 2c..2c+1, n r), b1 = (k 2c+8..2c+9, n r)
//   C (16x8):       c0,c1 = (r, 2c..2c+1), c2,c3 = (r+8, 2c..2c+1)
// Each 32-bit register holds two 16-bit values, the lower-indexed one in the low half.
#pragma once

#include <cstdint>

namespace tessera::ptx {

template <bool kFP16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kFP16) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 matrices of 16-bit values from shared memory (PTX ISA: "ldmatrix"): lane i gives the address of row i % 8
// of matrix i / 8; lane 4r + c receives row r, columns 2c..2c+1 of matrix q in m[q]. Ordered with the surrounding
// memory operations (volatile, memory clobber), so it never moves above the barrier wait that publishes the data.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&m)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(m[0]), "=r"(m[1]), "=r"(m[2]), "=r"(m[3])
               : "r"(smem_addr)
               : "memory");
}

// Transposes an 8x8 matrix of 16-bit values held in the C/A fragment layout (lane 4r + c: row r, columns 2c..2c+1)
// so that lane 4r + c receives row r of the transpose (PTX ISA: "movmatrix", sm_75+).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

}  // namespace tessera::ptx
