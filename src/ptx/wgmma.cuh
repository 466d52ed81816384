// PTX wrappers: warpgroup matrix multiply-accumulate (wgmma, sm_90a only) and its shared-memory descriptors
// (PTX ISA: "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions").
//
// Every call is warpgroup-collective: the 4 warps of an aligned warpgroup execute it together.
// Operands here are K-major tiles stored by TMA with the 128-byte swizzle: rows of 128 bytes, 8-row (1024-byte)
// swizzle atoms, tile base 1024-byte aligned. The accumulator of m64nN is N/2 fp32 registers per thread; for
// thread t of the warpgroup (warp w = t/32, lane l), register 4j+{0,1} holds row 16w + l/4, columns
// 8j + 2(l%4) + {0,1}, and register 4j+{2,3} the same columns of row 16w + l/4 + 8.
#pragma once

#include <cstdint>

#include "ptx/smem.cuh"

namespace tessera::ptx {

// Descriptor of a K-major operand tile with 128-byte swizzle starting at `tile` (1024-byte aligned).
// Adding (bytes >> 4) to the descriptor moves its start along K inside the 128-byte rows.
__device__ __forceinline__ uint64_t wgmma_desc_k_major_sw128(const void* tile) {
  const uint32_t addr = smem_u32(tile);
  uint64_t desc = (addr & 0x3FFFFu) >> 4;      // start address, bits 0-13
  desc |= uint64_t{1} << 16;                   // leading-dimension offset: unused for swizzled K-major
  desc |= uint64_t{1024 >> 4} << 32;           // stride between 8-row groups: one swizzle atom
  desc |= uint64_t{1} << 62;                   // layout: 128-byte swizzle
  return desc;
}

// Descriptor of an MN-major B operand with 128-byte swizzle (wgmma with imm-trans-b = 1, 16-bit types): rows of 128
// bytes hold 64 consecutive N elements of one K index, swizzled in 8-row (1024-byte) atoms as TMA stores them.
// `tile` (1024-byte aligned) is the first K row of the operand; `n_block_bytes` the distance between the tiles of
// consecutive 64-element N blocks (leading-dimension offset); 8-row K groups are 1024 bytes apart (stride offset).
// Adding 1024·(k_rows / 8) >> 4 moves the start along K.
__device__ __forceinline__ uint64_t wgmma_desc_mn_major_sw128(const void* tile, uint32_t n_block_bytes) {
  const uint32_t addr = smem_u32(tile);
  uint64_t desc = (addr & 0x3FFFFu) >> 4;
  desc |= uint64_t{(n_block_bytes >> 4) & 0x3FFFu} << 16;
  desc |= uint64_t{1024 >> 4} << 32;
  desc |= uint64_t{1} << 62;
  return desc;
}

// Orders this warpgroup's earlier register and shared-memory accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most N committed wgmma groups of this warpgroup are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across an asynchronous wgmma.
template <int R>
__device__ __forceinline__ void wgmma_fence_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void wgmma_fence_registers(int32_t (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
// The same for A-fragment registers (RS form): once the batch that read them is known complete, so that NVVM does not
// reuse them while it is in flight (ptxas does its own analysis and may serialize the batch instead).
template <int S, int R>
__device__ __forceinline__ void wgmma_fence_registers(uint32_t (&a)[S][R]) {
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[s][i])::"memory");
}

// m64nNk32 e4m3 × e4m3 → fp32 and m64nNk16 bf16 / fp16 → fp32, both operands K-major from shared memory:
//   Wgmma<N>::mma_e4m3 / mma_bf16 / mma_f16(d, desc_a, desc_b, scale_d)   d = A·Bᵀ + (scale_d ? d : 0)
// and m64nNk16 with A from registers and B MN-major in shared memory (attention's P·V):
//   Wgmma<N>::mma_bf16_rs_tb / mma_f16_rs_tb(d, a, desc_b, scale_d)    a: the warp's m16n8k16 A fragment
// and the same with B K-major (the weight-only linear layer: dequantized weights in A, tokens in B):
//   Wgmma<N>::mma_bf16_rs / mma_f16_rs(d, a, desc_b, scale_d)
// and m64nNk32 s8 × s8 → int32 (W8A8), both operands K-major from shared memory, d int32 (same register layout):
//   Wgmma<N>::mma_s8(d, desc_a, desc_b, scale_d)
#include "ptx/wgmma_mma.inc"

}  // namespace tessera::ptx
