// Internal: the launches of fused_gate, permute and unpermute_reduce without their argument checks, for a caller that
// has established every rule of the op already (the MoE layer checks its own arguments once and builds the rest
// from its workspace, so the steps' checks would only repeat it on every call). Each public entry is its checks
// followed by the same call, so both run one code path. The current device must be a Hopper GPU (require_hopper was
// called).
#pragma once

#include <cuda_runtime_api.h>

#include <optional>

#include "tessera/moe.h"

namespace tessera::moe::detail {

// logits.shape[0] > 0.
void launch_fused_gate(const TensorView& logits, const std::optional<TensorView>& bias, const TensorView& weights,
                       const TensorView& ids, const GateParams& p, cudaStream_t stream);

// Any token count (0 clears the offsets and counts).
void launch_permute(const TensorView& x, const TensorView& ids, const std::optional<TensorView>& input_scale,
                    const PermuteOutputs& out, const Workspace& workspace, const PermuteParams& p,
                    cudaStream_t stream, const std::optional<TensorView>& num_tokens);

// row_index.shape[0] > 0 and y_perm.shape[1] > 0.
void launch_unpermute_reduce(const TensorView& y_perm, const TensorView& row_index, const TensorView& weights,
                             const std::optional<TensorView>& residual, const TensorView& out, float routed_scale,
                             cudaStream_t stream);

}  // namespace tessera::moe::detail
