// tessera — grouped GEMM for MoE experts (public).
//
// G independent products Y_g = X_g · W_gᵀ in one launch. X holds every group's rows (the output of
// moe::permute); W holds one [N, K] weight matrix per group. Inputs are fp8 e4m3 (with per-tensor or
// DeepSeek-V3 block-wise scales) or bf16; the output is bf16.
//
// Two layouts:
//   contiguous: X [M, K]; group g owns rows [offsets[g], offsets[g+1]) (offsets int32 [G+1] on the device);
//               Y [M, N]. Rows of Y outside every group are not written.
//   masked:     X [G, max_m, K]; group g owns rows [0, masked_m[g]) of X[g] (masked_m int32 [G] on the
//               device); Y [G, max_m, N]; rows past masked_m[g] are not written.
// Group sizes are read on the device only: no host synchronization, capturable in a CUDA graph. Whatever the
// device values, nothing out of bounds is read or written: offsets are clamped to [0, M] and a decreasing
// pair is an empty group; masked_m is clamped to [0, max_m].
//
// All ops run asynchronously on the given stream, never allocate, and validate every argument before launching
// (tessera::Error names the op and the argument). See docs/ops/grouped_gemm.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "tessera/tensor.h"

namespace tessera::gemm {

enum class ScaleMode : int {
  // x_scale fp32 [1]; w_scale fp32 [G]:  Y_g = (x_scale * w_scale[g]) * X_g · W_gᵀ
  kPerTensor = 0,
  // DeepSeek-V3 format, 128-wide blocks along K:
  //   x_scale fp32 [M, K/128] (masked: [G, max_m, K/128]), any strides: one scale per row per 128 of K
  //     (the layout moe::permute emits);
  //   w_scale fp32 [G, N/128, K/128], any strides: one scale per 128×128 weight block
  //     (checkpoints' weight_scale_inv).
  //   Y[m, n] = Σ_kb x_scale[m, kb] * w_scale[g, n/128, kb] * Σ_{k in kb} X[m, k] W_g[n, k]
  kBlockwise = 1,
};

struct FP8Scales {
  ScaleMode mode = ScaleMode::kPerTensor;
  TensorView x_scale;
  TensorView w_scale;
};

// Block of K one scale covers in kBlockwise mode, and the granularity N and K must have.
inline constexpr int kGroupedGemmBlock = 128;
// Largest G one launch accepts.
inline constexpr int kGroupedGemmMaxGroups = 1024;

using Workspace = tessera::Workspace;

struct GroupedGemmOptions {
  // Deprecated and ignored (validated only: >= 0). Tile shapes are chosen on the device, per group, from each
  // group's row count (8, 16, 32, 64 or 128 token rows; 128 or 256 weight rows), so no hint is needed; the
  // field stays so that existing callers compile, and will be removed.
  int64_t expected_m = 0;
};

// Device workspace the call needs (any contents). The current kernels need none and return 0; callers should
// still query and pass it so that later versions can use it without an API change.
std::size_t grouped_gemm_workspace_bytes(int64_t num_groups, int64_t n, int64_t k);

// FP8 e4m3 × e4m3 → bf16, contiguous layout.
// x [M, K] fp8 e4m3, unit stride along K, row stride a multiple of 16 bytes, 16-byte aligned;
// w [G, N, K] fp8 e4m3, unit stride along K, other strides multiples of 16 bytes, 16-byte aligned;
// offsets int32 [G+1] contiguous; y [M, N] bf16, unit stride along N, row stride a multiple of 8 elements,
// 16-byte aligned. N and K multiples of 128, K > 0; 1 <= G <= kGroupedGemmMaxGroups.
void grouped_gemm_fp8(const TensorView& x, const TensorView& w, const TensorView& offsets, const FP8Scales& scales,
                      const TensorView& y, const Workspace& workspace, cudaStream_t stream,
                      const GroupedGemmOptions& options = {});

// FP8, masked layout: x [G, max_m, K], masked_m int32 [G], y [G, max_m, N]; other rules as above.
void grouped_gemm_fp8_masked(const TensorView& x, const TensorView& w, const TensorView& masked_m,
                             const FP8Scales& scales, const TensorView& y, const Workspace& workspace,
                             cudaStream_t stream, const GroupedGemmOptions& options = {});

// bf16 × bf16 → bf16 (fp32 accumulation), contiguous layout. x [M, K], w [G, N, K], y [M, N] bf16;
// N a multiple of 128, K a multiple of 64, K > 0; alignment rules as above.
void grouped_gemm_bf16(const TensorView& x, const TensorView& w, const TensorView& offsets, const TensorView& y,
                       const Workspace& workspace, cudaStream_t stream, const GroupedGemmOptions& options = {});

// bf16, masked layout.
void grouped_gemm_bf16_masked(const TensorView& x, const TensorView& w, const TensorView& masked_m,
                              const TensorView& y, const Workspace& workspace, cudaStream_t stream,
                              const GroupedGemmOptions& options = {});

// Dense FP8 GEMM (e4m3 × e4m3 → bf16): the grouped GEMM with one group, so that every 8-bit linear (W8A8 int8 in
// tessera/w8a8.h, FP8 here) is one call. x [M, K], w [N, K] (rules as grouped_gemm_fp8's x and one group of its w);
// scales: per-tensor x_scale [1], w_scale [1]; block-wise (DeepSeek-V3 checkpoints' 1×128 activation and 128×128
// weight blocks) x_scale [M, K/128], w_scale [N/128, K/128], any strides. y [M, N] bf16.
// The workspace (gemm_fp8_workspace_bytes, 16-byte aligned) holds the group's offsets, written on the device by the
// call (so the op stays graph-capturable and allocation-free).
std::size_t gemm_fp8_workspace_bytes(int64_t n, int64_t k);
void gemm_fp8(const TensorView& x, const TensorView& w, const FP8Scales& scales, const TensorView& y,
              const Workspace& workspace, cudaStream_t stream);

}  // namespace tessera::gemm
