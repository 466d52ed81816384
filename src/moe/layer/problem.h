// The MoE layer (tessera/moe_layer.h): the workspace layout shared by the plan and the run, and the activation
// step's launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "tessera/moe_layer.h"

namespace tessera::moe::detail {

// Byte offsets into the layer's workspace (each 256-byte aligned), for up to max_tokens tokens.
// Lifetimes: routing and row_index live through the whole call; x_perm lives from permute to the first GEMM and
// a (the activation) from the activation step to the second, so they share region A; h (the first GEMM's output)
// lives to the activation step and y_perm from the second GEMM to the reduce, so they share region B. Where the
// activation is fused into the first GEMM (bf16, per-tensor fp8), it is written while x_perm is read, so it goes
// after y_perm in region B (act_fused), which h (not stored then) leaves free.
struct LayerLayout {
  int slots = 0;                 // ids per token: topk + shared experts
  int experts = 0;               // G = routed + shared
  int64_t capacity = 0;          // rows of the permuted buffers: max_tokens * slots
  std::size_t gate_weights = 0;  // fp32 [max_tokens, slots]
  std::size_t gate_ids = 0;      // int32 [max_tokens, slots]
  std::size_t row_index = 0;     // int32 [max_tokens, slots]
  std::size_t offsets = 0;       // int32 [G + 1]
  std::size_t counts = 0;        // int32 [G]
  std::size_t permute_ws = 0;    // permute's own workspace
  std::size_t permute_ws_bytes = 0;
  std::size_t x_perm = 0;      // region A: fp8 | bf16 [capacity, H]
  std::size_t x_scales = 0;    //           fp32 [capacity, H/128] (block-wise)
  std::size_t act = 0;         //           fp8 | bf16 [capacity, I] (after x_perm is dead)
  std::size_t act_scales = 0;  //           fp32 [capacity, I/128] (block-wise)
  std::size_t h = 0;           // region B: bf16 [capacity, 2I]
  std::size_t y_perm = 0;      //           bf16 [capacity, H] (after h is dead)
  std::size_t act_fused = 0;   //           fp8 | bf16 [capacity, I] after y_perm: the activation the first GEMM's
                               //           epilogue writes (bf16 and per-tensor fp8: no h then); 0 for block-wise
  std::size_t gemm_ws = 0;     // the grouped GEMMs' workspace (shared: they run one after the other)
  std::size_t gemm_ws_bytes = 0;
  std::size_t total = 0;
};

// Pure: the layout for a validated config.
LayerLayout layer_layout(const MoeLayerConfig& config, int64_t max_tokens);

// The activation step: a[r, i] = Q(silu(h[r, i]) * h[r, I + i]) for the rows r < min(*rows_end, capacity).
struct ActivationArgs {
  const void* h;              // bf16 [capacity, 2I], row stride 2I
  void* act;                  // fp8 | bf16 [capacity, I], row stride I
  float* act_scales;          // block-wise: fp32 [capacity, I/128] row-major; else nullptr
  const float* static_scale;  // per-tensor: fp32 [1]; else nullptr
  const int32_t* rows_end;    // int32 [1] on the device: the permuted rows in use (offsets[G])
  int64_t capacity;
  int64_t intermediate;
  WeightFormat format;
};
void launch_activation(const ActivationArgs& args, cudaStream_t stream);

// moe_layer itself, with an event recorded on the stream before the first step and after each of the six (marks[0]
// .. marks[6]: gate, permute, first GEMM, activation, second GEMM, reduce) when marks is not null: the benchmark's
// per-step breakdown of the very code path users call. moe_layer passes null and runs every step. A last_step below
// 6 returns after that step (the marks up to it recorded) and leaves y unwritten (last_step 0: the checks only, no
// launch; the benchmark's --host split of the layer's host time): with last_step 3 the workspace
// holds the first GEMM's h (and the routing, row_index) of this call, which the tests read to check the rest of the
// layer from the GPU's own h (with the activation as its own step: placement kSeparate; where bf16 and per-tensor fp8
// compute it in the first GEMM's epilogue, step 4 launches nothing and no h is stored). The activation's bits are
// the same either way.
constexpr int kLayerSteps = 6;
// Where the activation runs for bf16 and per-tensor fp8 (block-wise always runs it as its own step): kAuto is
// moe_layer's choice, the others force one way (tests, benchmarks).
enum class ActivationPlacement { kAuto, kFused, kSeparate };
// kAuto's rule: fused from kFuseMinTokens rows of x on (x's rows, the size a graph is captured at, not
// the device-side token count). Measured on an H200 (docs/perf/moe_layer.md, session 26): fused, T 4096 layers
// 2.5-5 % faster and T 128 ones 0.2-1.1 %, but T 1 ones 1.3-4.3 % slower (the first GEMM's weight stream through the
// interleaving 5-D tensor map is slower than through the plain one, by more than the saved launch).
constexpr int64_t kFuseMinTokens = 64;
// On since session 27, after MoeLayerGpu.FusedActivationOnEveryTileShape (which forces the fused epilogue onto the
// 128 × 256 tiles and onto split decode tiles) passed on an H200 with the rest of the layer tests and their stress.
constexpr bool kFusedActivationByDefault = true;
void moe_layer_marked(const MoeLayerPlan& plan, const MoeLayerInputs& inputs, const MoeLayerWeights& weights,
                      const TensorView& y, const Workspace& workspace, cudaStream_t stream, const cudaEvent_t* marks,
                      int last_step = kLayerSteps,
                      ActivationPlacement placement = ActivationPlacement::kAuto);

}  // namespace tessera::moe::detail
