// tessera — one MoE layer (public): gate → permute (+ quantize) → grouped GEMM (w13) → SiLU·mul (+ quantize)
// → grouped GEMM (w2) → weighted reduce, as one call.
//
//   routing:   ids, weights = fused_gate(router_logits, correction_bias, config.gate)       (tessera/moe.h)
//   per copy (t, j) of token t routed to expert e = ids[t, j] (shared experts are ids E .. E+s-1):
//     h   = Q1(x[t]) · W13[e]ᵀ                         [2I]  (bf16; rows 0..I-1 of W13[e] are the gate
//                                                                projection w1, rows I..2I-1 the up projection w3)
//     a   = Q2(silu(h[0:I]) * h[I:2I])                 [I]   silu(g) = g / (1 + exp(-g)), fp32 math (exp by the
//                                                                fast exponential, within a few ulp)
//     o   = a · W2[e]ᵀ                                 [H]   (bf16)
//   y[t] = Σ_j weights[t, j] · o(t, j)  (+ residual[t])      fp32 sum in slot order, one bf16 rounding
// Q1 / Q2 follow the weight format: kFP8Blockwise quantizes each row per 128 columns to e4m3 with
// scale = max(amax, 1e-10) / 448 (the DeepSeek-V3 1×128 activation blocks); kFP8PerTensor divides by the static
// activation scales a13_scale / a2_scale (the input_scale tensors of per-tensor FP8 checkpoints) and saturates;
// kBF16 rounds to bf16. The fp32 scale is amax times the fp32 1/448. v / scale is computed as v times a reciprocal:
// an approximate one for the block scales, the correctly rounded fp32 1 / scale for the static scales; either is
// within an ulp of the quotient, so a code can differ from the exact quotient's only where v / scale lies within
// that of an e4m3 rounding boundary. Weights are used as stored: W = codes × scale (block-wise: one scale per 128×128 block,
// the checkpoints' weight_scale_inv; per-tensor: one scale per expert).
//
// plan / run: moe_layer_plan takes the model constants and the largest token count and returns the workspace
// size; moe_layer takes that workspace, never allocates, never synchronizes with the host and can be captured in
// a CUDA graph. The token count may change between graph replays through `num_tokens` (int32 [1] on the device,
// clamped to [0, x rows]): tokens at or past it are not routed and their y rows are written as zero (or residual).
// Expert group sizes are read on the device only. See docs/ops/moe_layer.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "tessera/moe.h"
#include "tessera/tensor.h"

namespace tessera::moe {

enum class WeightFormat : int {
  kFP8Blockwise = 0,  // e4m3 codes, fp32 scale per 128×128 block; activations per (row, 128 columns)
  kFP8PerTensor = 1,  // e4m3 codes, fp32 scale per expert; static fp32 activation scales
  kBF16 = 2,          // bf16 weights and activations
};

// "fp8_blockwise", "fp8_per_tensor", "bf16" (the names the Python layer takes), "?" for a value outside the enum.
const char* weight_format_name(WeightFormat format);

struct MoeLayerConfig {
  int64_t hidden = 0;        // H: multiple of 128
  int64_t intermediate = 0;  // I: per-expert intermediate size, multiple of 128
  int num_experts = 0;       // E routed experts, 1..kGateMaxExperts
  // The gate. gate.num_shared_experts = s appends s shared experts that every token visits with weight
  // gate.shared_expert_weight: they are experts E .. E+s-1 of w13 / w2 (DeepSeek-V3: s = 1).
  GateParams gate;
  WeightFormat format = WeightFormat::kFP8Blockwise;
};

struct MoeLayerPlan {
  MoeLayerConfig config;
  int64_t max_tokens = 0;
  std::size_t workspace_bytes = 0;
};

// Validates the constants (every rule of the config, before any device query) and sizes the workspace for up to
// max_tokens tokens.
MoeLayerPlan moe_layer_plan(const MoeLayerConfig& config, int64_t max_tokens);

// Weights of G = E + s experts, unit stride along the last dimension, other strides multiples of 16 bytes.
struct MoeLayerWeights {
  TensorView w13;  // [G, 2I, H] fp8 e4m3 | bf16
  TensorView w2;   // [G, H, I]  fp8 e4m3 | bf16
  // kFP8Blockwise: fp32 [G, 2I/128, H/128] and [G, H/128, I/128] (any non-negative strides); kFP8PerTensor: fp32 [G] each.
  std::optional<TensorView> w13_scale;
  std::optional<TensorView> w2_scale;
  // kFP8PerTensor only: fp32 [1] on the device, the activation scales of the two GEMMs' inputs.
  std::optional<TensorView> a13_scale;
  std::optional<TensorView> a2_scale;
};

struct MoeLayerInputs {
  TensorView x;                               // [T, H] bf16, unit inner stride, rows 16-byte aligned
  TensorView router_logits;                   // [T, E] fp32 | bf16 | fp16 (fused_gate's rules)
  std::optional<TensorView> correction_bias;  // [E] fp32 | bf16 | fp16, the gate's selection bias
  std::optional<TensorView> residual;         // [T, H] bf16, added to y
  std::optional<TensorView> num_tokens;       // int32 [1] on the device: tokens routed this call (see above)
};

// y [T, H] bf16 with T <= plan.max_tokens; y may not overlap any input or the workspace.
void moe_layer(const MoeLayerPlan& plan, const MoeLayerInputs& inputs, const MoeLayerWeights& weights,
               const TensorView& y, const Workspace& workspace, cudaStream_t stream);

}  // namespace tessera::moe
