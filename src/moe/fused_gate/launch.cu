// fused_gate: validation, configuration and launch.
#include <cmath>
#include <string>

#include "common/check.h"
#include "common/device_info.h"
#include "common/dispatch.h"
#include "common/occupancy.h"
#include "common/validate.h"
#include "moe/fused_gate/check.h"
#include "moe/fused_gate/config.h"
#include "moe/fused_gate/kernel.cuh"
#include "moe/launch.h"
#include "tessera/moe.h"

namespace tessera::moe {

namespace {

using detail::GateConfig;
using detail::GateKernelParams;

template <typename Kernel>
void launch_persistent(Kernel kernel, int tokens_per_block, int extra_smem, const GateKernelParams& kp,
                       const GateConfig& cfg, int num_sms, cudaStream_t stream) {
  const int threads = detail::kGateThreads;
  const int smem = cfg.smem_bytes_per_token * tokens_per_block + extra_smem;
  const int blocks_per_sm =
      tessera::detail::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), threads, smem);
  // A persistent grid: at most one wave of resident blocks, each warp striding over the tokens.
  const int64_t needed = (kp.num_tokens + tokens_per_block - 1) / tokens_per_block;
  const int64_t resident = static_cast<int64_t>(num_sms) * blocks_per_sm;
  const int grid = static_cast<int>(needed < resident ? needed : resident);
  kernel<<<grid, threads, smem, stream>>>(kp);
  TESSERA_CHECK_LAUNCH();
}

template <typename T, int kV, int kLanes>
void launch_gate(const GateKernelParams& kp, const GateConfig& cfg, int num_sms, cudaStream_t stream) {
  launch_persistent(detail::fused_gate_kernel<T, kV, kLanes>, detail::kGateThreads / kLanes, 0, kp, cfg, num_sms,
                    stream);
}

template <typename T, int kV>
void launch_gate_pair(const GateKernelParams& kp, const GateConfig& cfg, int num_sms, cudaStream_t stream) {
  // The pair kernel also keeps the bias (32 kV floats) in shared memory.
  launch_persistent(detail::fused_gate_pair_kernel<T, kV>, detail::kGateThreads / 16, 32 * kV * 4, kp, cfg, num_sms,
                    stream);
}

// The kernel shapes select_gate_config can return (16 lanes only for E <= 128; pairs only for kV 2..8).
template <typename T>
void launch_gate_shape(const GateKernelParams& kp, const GateConfig& cfg, int num_sms, cudaStream_t stream) {
  const int v = cfg.values_per_lane;
  if (cfg.paired) {
    switch (v) {
      case 2: return launch_gate_pair<T, 2>(kp, cfg, num_sms, stream);
      case 4: return launch_gate_pair<T, 4>(kp, cfg, num_sms, stream);
      case 8: return launch_gate_pair<T, 8>(kp, cfg, num_sms, stream);
      default: break;
    }
  } else if (cfg.lanes_per_token == 16) {
    switch (v) {
      case 1: return launch_gate<T, 1, 16>(kp, cfg, num_sms, stream);
      case 2: return launch_gate<T, 2, 16>(kp, cfg, num_sms, stream);
      case 4: return launch_gate<T, 4, 16>(kp, cfg, num_sms, stream);
      case 8: return launch_gate<T, 8, 16>(kp, cfg, num_sms, stream);
      default: break;
    }
  } else {
    switch (v) {
      case 1: return launch_gate<T, 1, 32>(kp, cfg, num_sms, stream);
      case 2: return launch_gate<T, 2, 32>(kp, cfg, num_sms, stream);
      case 4: return launch_gate<T, 4, 32>(kp, cfg, num_sms, stream);
      case 8: return launch_gate<T, 8, 32>(kp, cfg, num_sms, stream);
      case 16: return launch_gate<T, 16, 32>(kp, cfg, num_sms, stream);
      default: break;
    }
  }
  throw Error("tessera::moe::fused_gate: no kernel for " + std::to_string(v) + " experts per lane and " +
              std::to_string(cfg.lanes_per_token) + " lanes per token");
}

}  // namespace

namespace detail {

int64_t check_gate_inputs(const tessera::detail::ArgCheck& check, const TensorView& logits,
                          const std::optional<TensorView>& bias, const GateParams& p, const char* logits_arg,
                          const char* bias_arg) {
  check.dtype(logits, logits_arg, {DType::kFP32, DType::kBF16, DType::kFP16});
  check.rank(logits, logits_arg, 2);
  const int64_t T = logits.shape[0];
  const int64_t E = logits.shape[1];
  check_gate_params(check, E, p);
  check.unit_inner_stride(logits, logits_arg);
  // Vector loads are used only where the rows allow them, but every load needs an element-aligned address.
  check.aligned(logits, logits_arg, static_cast<int>(dtype_size(logits.dtype)));
  if (T > 1 && logits.strides[0] < E)
    check.fail(logits_arg, "must have row stride >= num_experts (" + std::to_string(E) + "), got " +
                               std::to_string(logits.strides[0]));
  if (bias) {
    check.dtype(*bias, bias_arg, {DType::kFP32, DType::kBF16, DType::kFP16});
    check.rank(*bias, bias_arg, 1);
    check.dim(*bias, bias_arg, 0, E, "num_experts");
    check.contiguous(*bias, bias_arg);
    check.aligned(*bias, bias_arg, static_cast<int>(dtype_size(bias->dtype)));
  }
  return T;
}

void check_gate_params(const tessera::detail::ArgCheck& check, int64_t E, const GateParams& p) {
  check.in_range(E, "logits.shape[1] (num_experts)", 1, kGateMaxExperts);
  check.in_range(p.num_groups, "num_groups", 1, E);
  if (E % p.num_groups != 0)
    check.fail("num_groups", "must divide num_experts (" + std::to_string(E) + "), got " + std::to_string(p.num_groups));
  const int64_t group_size = E / p.num_groups;
  check.in_range(p.topk_groups, "topk_groups", 1, p.num_groups);
  if (p.num_groups > 1 && p.group_score == GroupScore::kTop2Sum && group_size < 2)
    check.fail("num_groups", "leaves " + std::to_string(group_size) +
                                 " expert per group; group_score top2_sum needs at least 2");
  check.in_range(p.topk, "topk", 1, kGateMaxTopk);
  if (p.topk > p.topk_groups * group_size)
    check.fail("topk", "must be <= the experts of the kept groups (topk_groups * E / num_groups = " +
                           std::to_string(p.topk_groups * group_size) + "), got " + std::to_string(p.topk));
  check.in_range(p.num_shared_experts, "num_shared_experts", 0, 1 << 20);
  if (p.scoring != Scoring::kSigmoid && p.scoring != Scoring::kSoftmax) check.fail("scoring", "is not a Scoring value");
  if (p.group_score != GroupScore::kTop2Sum && p.group_score != GroupScore::kMax)
    check.fail("group_score", "is not a GroupScore value");
  // A non-finite factor would make every routing weight (and the layer's y) inf or NaN without an error.
  if (!std::isfinite(p.routed_scaling_factor))
    check.fail("routed_scaling_factor", "must be finite, got " + std::to_string(p.routed_scaling_factor));
  if (!std::isfinite(p.shared_expert_weight))
    check.fail("shared_expert_weight", "must be finite, got " + std::to_string(p.shared_expert_weight));
}

}  // namespace detail

void fused_gate(const TensorView& logits, const std::optional<TensorView>& bias, const TensorView& weights,
                const TensorView& ids, const GateParams& p, cudaStream_t stream) {
  const tessera::detail::ArgCheck check("tessera::moe::fused_gate");
  const int64_t T = detail::check_gate_inputs(check, logits, bias, p);
  const int width = p.topk + p.num_shared_experts;
  check.contiguous_matrix(weights, "weights", {DType::kFP32}, T, "num_tokens", width, "topk + num_shared_experts");
  check.contiguous_matrix(ids, "ids", {DType::kInt32}, T, "num_tokens", width, "topk + num_shared_experts");
  check.no_overlap(logits, "logits", weights, "weights");
  check.no_overlap(logits, "logits", ids, "ids");
  check.no_overlap(weights, "weights", ids, "ids");
  check.on_current_device(logits, "logits");
  if (bias) check.on_current_device(*bias, "bias");
  check.on_current_device(weights, "weights");
  check.on_current_device(ids, "ids");
  if (T == 0) return;
  tessera::detail::require_hopper("tessera::moe::fused_gate");
  detail::launch_fused_gate(logits, bias, weights, ids, p, stream);
}

namespace detail {

void launch_fused_gate(const TensorView& logits, const std::optional<TensorView>& bias, const TensorView& weights,
                       const TensorView& ids, const GateParams& p, cudaStream_t stream) {
  const int64_t T = logits.shape[0];
  const int64_t E = logits.shape[1];
  const int64_t group_size = E / p.num_groups;
  const int elem_bytes = static_cast<int>(dtype_size(logits.dtype));
  const auto base = reinterpret_cast<std::uintptr_t>(logits.data);
  const bool aligned = base % 16 == 0 && (T == 1 || (logits.strides[0] * elem_bytes) % 16 == 0);
  const GateConfig cfg = detail::select_gate_config(
      detail::GateProblem{T, static_cast<int>(E), p.num_groups, elem_bytes, aligned}, p.topk, p.topk_groups);

  GateKernelParams kp{};
  kp.logits = logits.data;
  kp.row_stride = T > 1 ? logits.strides[0] : E;
  kp.bias = bias ? bias->data : nullptr;
  kp.bias_dtype = !bias ? 0 : bias->dtype == DType::kBF16 ? 1 : bias->dtype == DType::kFP16 ? 2 : 0;
  kp.weights = static_cast<float*>(weights.data);
  kp.ids = static_cast<int32_t*>(ids.data);
  kp.num_tokens = T;
  kp.num_experts = static_cast<int>(E);
  kp.num_groups = p.num_groups;
  kp.group_size = static_cast<int>(group_size);
  kp.topk_groups = p.topk_groups;
  kp.topk = p.topk;
  kp.num_shared = p.num_shared_experts;
  kp.shared_weight = p.shared_expert_weight;
  kp.scaling = p.routed_scaling_factor;
  kp.renormalize = p.renormalize;
  kp.softmax = p.scoring == Scoring::kSoftmax;
  kp.top2_sum = p.group_score == GroupScore::kTop2Sum;
  kp.lanes_per_group = cfg.lanes_per_group;
  kp.compact = cfg.compact;
  kp.values_per_lane_log2 = 0;
  while ((1 << kp.values_per_lane_log2) < cfg.values_per_lane) ++kp.values_per_lane_log2;
  kp.lanes_per_group_log2 = 0;
  while ((1 << kp.lanes_per_group_log2) < cfg.lanes_per_group) ++kp.lanes_per_group_log2;
  kp.vector_loads = cfg.vector_loads;
  kp.smem_floats_per_token = cfg.smem_bytes_per_token / 4;

  const int num_sms = tessera::detail::current_device_info().num_sms;
  TESSERA_DISPATCH_FLOAT(logits.dtype, Elem, [&] { launch_gate_shape<Elem>(kp, cfg, num_sms, stream); });
}

}  // namespace detail

}  // namespace tessera::moe
