// The MoE layer: plan (constants → workspace layout) and run (validate everything, then six launches:
// gate, permute (+ quantize), grouped GEMM w13, activation (+ quantize), grouped GEMM w2, weighted reduce).
#include <algorithm>
#include <string>
#include <utility>

#include "common/check.h"
#include "common/device_info.h"
#include "common/validate.h"
#include "gemm/grouped/problem.h"
#include "moe/fused_gate/check.h"
#include "moe/launch.h"
#include "moe/layer/problem.h"
#include "moe/permute/config.h"
#include "tessera/grouped_gemm.h"
#include "tessera/moe_layer.h"

namespace tessera::moe {
namespace {

using tessera::detail::ArgCheck;

constexpr std::size_t kAlign = 256;
// The steps launched without their own checks (moe/launch.h) rely on these: the layer's expert and slot limits are
// within permute's, and unpermute_reduce takes up to 32 slots.
static_assert(gemm::kGroupedGemmMaxGroups <= detail::kPermuteMaxExperts, "permute must take every expert");
static_assert(detail::kPermuteMaxTopk <= 32, "unpermute_reduce takes at most 32 slots");
std::size_t round_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

void check_config(const ArgCheck& check, const MoeLayerConfig& c, int64_t max_tokens) {
  check.in_range(c.hidden, "hidden", 128, int64_t{1} << 20);
  if (c.hidden % 128 != 0) check.fail("hidden", "must be a multiple of 128, got " + std::to_string(c.hidden));
  check.in_range(c.intermediate, "intermediate", 128, int64_t{1} << 20);
  if (c.intermediate % 128 != 0)
    check.fail("intermediate", "must be a multiple of 128, got " + std::to_string(c.intermediate));
  check.in_range(c.num_experts, "num_experts", 1, kGateMaxExperts);
  detail::check_gate_params(check, c.num_experts, c.gate);
  const int64_t slots = int64_t{c.gate.topk} + c.gate.num_shared_experts;
  check.in_range(slots, "topk + num_shared_experts", 1, detail::kPermuteMaxTopk);
  const int64_t experts = int64_t{c.num_experts} + c.gate.num_shared_experts;
  check.in_range(experts, "num_experts + num_shared_experts", 1, gemm::kGroupedGemmMaxGroups);
  if (c.format != WeightFormat::kFP8Blockwise && c.format != WeightFormat::kFP8PerTensor &&
      c.format != WeightFormat::kBF16)
    check.fail("format", "is not a WeightFormat value");
  if (max_tokens < 0) check.fail("max_tokens", "must be >= 0, got " + std::to_string(max_tokens));
  // Permuted rows are indexed by int32 (the permute's row index, the GEMMs' offsets).
  if (max_tokens > INT32_MAX / slots)
    check.fail("max_tokens", "gives " + std::to_string(max_tokens) + " x " + std::to_string(slots) +
                                 " permuted rows; at most 2^31 - 1 are addressable");
}

}  // namespace

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kFP8Blockwise:
      return "fp8_blockwise";
    case WeightFormat::kFP8PerTensor:
      return "fp8_per_tensor";
    case WeightFormat::kBF16:
      return "bf16";
  }
  return "?";
}

namespace detail {

LayerLayout layer_layout(const MoeLayerConfig& c, int64_t max_tokens) {
  LayerLayout l;
  l.slots = c.gate.topk + c.gate.num_shared_experts;
  l.experts = c.num_experts + c.gate.num_shared_experts;
  l.capacity = max_tokens * l.slots;
  const auto cap = static_cast<std::size_t>(l.capacity);
  const auto H = static_cast<std::size_t>(c.hidden), I = static_cast<std::size_t>(c.intermediate);
  const bool fp8 = c.format != WeightFormat::kBF16;
  const bool blockwise = c.format == WeightFormat::kFP8Blockwise;
  const std::size_t code_bytes = fp8 ? 1 : 2;
  std::size_t off = 0;
  auto take = [&off](std::size_t bytes) {
    const std::size_t at = off;
    off += round_up(bytes);
    return at;
  };
  const auto routing = static_cast<std::size_t>(max_tokens) * l.slots * 4;
  l.gate_weights = take(routing);
  l.gate_ids = take(routing);
  l.row_index = take(routing);
  l.offsets = take(4 * (static_cast<std::size_t>(l.experts) + 1));
  l.counts = take(4 * static_cast<std::size_t>(l.experts));
  // The permute's workspace grows with the token count, so the largest covers every smaller call.
  l.permute_ws_bytes = detail::select_permute_config(PermuteProblem{max_tokens, l.slots, l.experts, 1}).workspace_bytes;
  l.permute_ws = take(l.permute_ws_bytes);
  l.gemm_ws_bytes = std::max(gemm::grouped_gemm_workspace_bytes(l.experts, 2 * c.intermediate, c.hidden),
                             gemm::grouped_gemm_workspace_bytes(l.experts, c.hidden, c.intermediate));
  l.gemm_ws = take(l.gemm_ws_bytes);
  // Region A: x_perm (+ scales), later the activation (+ scales).
  const std::size_t a_begin = off;
  const std::size_t x_bytes = round_up(cap * H * code_bytes);
  const std::size_t xs_bytes = blockwise ? round_up(cap * (H / 128) * 4) : 0;
  const std::size_t act_bytes = round_up(cap * I * code_bytes);
  const std::size_t as_bytes = blockwise ? round_up(cap * (I / 128) * 4) : 0;
  l.x_perm = a_begin;
  l.x_scales = a_begin + x_bytes;
  l.act = a_begin;
  l.act_scales = a_begin + act_bytes;
  off = a_begin + std::max(x_bytes + xs_bytes, act_bytes + as_bytes);
  // Region B: h, later y_perm. Where the first GEMM's epilogue computes the activation (bf16, per-tensor fp8), no h
  // is stored and the activation goes after y_perm instead (region A still holds x_perm while that GEMM writes it).
  const std::size_t b_begin = off;
  l.h = b_begin;
  l.y_perm = b_begin;
  const std::size_t y_bytes = round_up(cap * H * 2);
  l.act_fused = blockwise ? 0 : b_begin + y_bytes;
  off = b_begin + std::max(round_up(cap * 2 * I * 2), y_bytes + (blockwise ? 0 : act_bytes));
  l.total = off;
  return l;
}

}  // namespace detail

MoeLayerPlan moe_layer_plan(const MoeLayerConfig& config, int64_t max_tokens) {
  const ArgCheck check("tessera::moe::moe_layer_plan");
  check_config(check, config, max_tokens);
  MoeLayerPlan plan;
  plan.config = config;
  plan.max_tokens = max_tokens;
  plan.workspace_bytes = detail::layer_layout(config, max_tokens).total;
  return plan;
}

namespace {

// A view of the workspace at `offset`, shaped as given (contiguous), labelled as device memory (the workspace was
// checked once).
TensorView ws_view(const Workspace& ws, std::size_t offset, DType dtype, std::initializer_list<int64_t> shape,
                   int device) {
  TensorView v = TensorView::contiguous(static_cast<char*>(ws.data) + offset, dtype, shape, device);
  v.device_verified = true;
  return v;
}

TensorView verified(TensorView v) {
  v.device_verified = true;
  return v;
}

void check_weights(const ArgCheck& check, const MoeLayerConfig& c, const MoeLayerWeights& w) {
  const int64_t G = int64_t{c.num_experts} + c.gate.num_shared_experts;
  const int64_t H = c.hidden, I = c.intermediate;
  const bool fp8 = c.format != WeightFormat::kBF16;
  // The message's format note, built only when a check fails.
  const auto fmt = [&c] { return std::string(" (format ") + weight_format_name(c.format) + ")"; };
  const DType wt = fp8 ? DType::kFP8E4M3 : DType::kBF16;
  if (w.w13.dtype != wt)
    check.fail("w13", std::string("must be ") + dtype_name(wt) + fmt() + ", got " + dtype_name(w.w13.dtype));
  if (w.w2.dtype != wt)
    check.fail("w2", std::string("must be ") + dtype_name(wt) + fmt() + ", got " + dtype_name(w.w2.dtype));
  check.rank(w.w13, "w13", 3);
  check.dim(w.w13, "w13", 0, G, "num_experts + num_shared_experts");
  check.dim(w.w13, "w13", 1, 2 * I, "2 * intermediate");
  check.dim(w.w13, "w13", 2, H, "hidden");
  check.rank(w.w2, "w2", 3);
  check.dim(w.w2, "w2", 0, G, "num_experts + num_shared_experts");
  check.dim(w.w2, "w2", 1, H, "hidden");
  check.dim(w.w2, "w2", 2, I, "intermediate");
  auto scale_3d = [&](const std::optional<TensorView>& s, const char* arg, int64_t n, int64_t k) {
    if (!s) check.fail(arg, "is required" + fmt());
    check.dtype(*s, arg, {DType::kFP32});
    check.rank(*s, arg, 3);
    check.dim(*s, arg, 0, G, "num_experts + num_shared_experts");
    check.dim(*s, arg, 1, n / 128, "rows / 128");
    check.dim(*s, arg, 2, k / 128, "columns / 128");
  };
  auto scale_1d = [&](const std::optional<TensorView>& s, const char* arg, int64_t n, const char* what) {
    if (!s) check.fail(arg, "is required" + fmt());
    check.dtype(*s, arg, {DType::kFP32});
    check.rank(*s, arg, 1);
    check.dim(*s, arg, 0, n, what);
  };
  auto absent = [&](const std::optional<TensorView>& s, const char* arg) {
    if (s) check.fail(arg, "must be absent" + fmt());
  };
  switch (c.format) {
    case WeightFormat::kFP8Blockwise:
      scale_3d(w.w13_scale, "w13_scale", 2 * I, H);
      scale_3d(w.w2_scale, "w2_scale", H, I);
      absent(w.a13_scale, "a13_scale");
      absent(w.a2_scale, "a2_scale");
      break;
    case WeightFormat::kFP8PerTensor:
      scale_1d(w.w13_scale, "w13_scale", G, "num_experts + num_shared_experts");
      scale_1d(w.w2_scale, "w2_scale", G, "num_experts + num_shared_experts");
      scale_1d(w.a13_scale, "a13_scale", 1, "one");
      scale_1d(w.a2_scale, "a2_scale", 1, "one");
      break;
    case WeightFormat::kBF16:
      absent(w.w13_scale, "w13_scale");
      absent(w.w2_scale, "w2_scale");
      absent(w.a13_scale, "a13_scale");
      absent(w.a2_scale, "a2_scale");
      break;
  }
}

// The two GEMMs' own rules (strides, alignment), checked before anything is launched; the op name says which
// layer argument plays which GEMM operand.
gemm::detail::GroupedProblem check_gemm(const char* op, bool fp8, const TensorView& x, const TensorView& w,
                                        const TensorView& offsets, const std::optional<gemm::FP8Scales>& scales,
                                        const TensorView& y, const Workspace& ws) {
  return gemm::detail::check_grouped_gemm(op, fp8 ? gemm::detail::Operand::kFP8 : gemm::detail::Operand::kBF16,
                                          gemm::detail::Layout::kContiguous, x, w, offsets, scales, y, ws, {});
}

}  // namespace

void moe_layer(const MoeLayerPlan& plan, const MoeLayerInputs& in, const MoeLayerWeights& weights, const TensorView& y,
               const Workspace& workspace, cudaStream_t stream) {
  detail::moe_layer_marked(plan, in, weights, y, workspace, stream, nullptr);
}

namespace detail {

void moe_layer_marked(const MoeLayerPlan& plan, const MoeLayerInputs& in, const MoeLayerWeights& weights,
                      const TensorView& y, const Workspace& workspace, cudaStream_t stream, const cudaEvent_t* marks,
                      int last_step, ActivationPlacement placement) {
  // mark(i) records the event after step i; it returns true where the caller asked to stop after that step.
  auto mark = [&](int i) {
    if (marks != nullptr) TESSERA_CUDA_CHECK(cudaEventRecord(marks[i], stream));
    return i >= last_step;
  };
  const ArgCheck check("tessera::moe::moe_layer");
  const MoeLayerConfig& c = plan.config;
  check_config(check, c, plan.max_tokens);
  const detail::LayerLayout L = detail::layer_layout(c, plan.max_tokens);
  const int64_t H = c.hidden, I = c.intermediate;
  const int G = L.experts, S = L.slots;
  const bool fp8 = c.format != WeightFormat::kBF16;
  const bool blockwise = c.format == WeightFormat::kFP8Blockwise;

  // Tokens and routing inputs.
  check.dtype(in.x, "x", {DType::kBF16});
  check.rank(in.x, "x", 2);
  const int64_t T = in.x.shape[0];
  check.dim(in.x, "x", 1, H, "hidden");
  if (T > plan.max_tokens)
    check.fail("x", "has " + std::to_string(T) + " tokens, more than the plan's max_tokens " +
                        std::to_string(plan.max_tokens));
  check.unit_inner_stride(in.x, "x");
  if (T > 1 && in.x.strides[0] < H) check.fail("x", "must have row stride >= hidden");
  check.aligned(in.x, "x", 16);
  check.dtype(in.router_logits, "router_logits", {DType::kFP32, DType::kBF16, DType::kFP16});
  check.rank(in.router_logits, "router_logits", 2);
  check.dim(in.router_logits, "router_logits", 1, c.num_experts, "num_experts");
  const int64_t logits_tokens = detail::check_gate_inputs(check, in.router_logits, in.correction_bias, c.gate,
                                                          "router_logits", "correction_bias");
  if (logits_tokens != T) check.dim(in.router_logits, "router_logits", 0, T, "tokens of x");
  if (in.residual) {
    check.dtype(*in.residual, "residual", {DType::kBF16});
    check.rank(*in.residual, "residual", 2);
    check.dim(*in.residual, "residual", 0, T, "tokens of x");
    check.dim(*in.residual, "residual", 1, H, "hidden");
    check.unit_inner_stride(*in.residual, "residual");
    check.aligned(*in.residual, "residual", 16);
  }
  if (in.num_tokens) check.device_count(*in.num_tokens, "num_tokens");
  check.dtype(y, "y", {DType::kBF16});
  check.rank(y, "y", 2);
  check.dim(y, "y", 0, T, "tokens of x");
  check.dim(y, "y", 1, H, "hidden");
  check.unit_inner_stride(y, "y");
  check.aligned(y, "y", 16);
  check.no_self_overlap(y, "y");
  check_weights(check, c, weights);
  check.workspace(workspace, L.total,
                  [&] { return " (moe_layer_plan for max_tokens " + std::to_string(plan.max_tokens) + ")"; });
  const TensorView ws_all = tessera::detail::workspace_view(workspace, L.total, in.x.device);
  // y and the workspace are written: neither may overlap anything the call reads or the other.
  const std::pair<const TensorView*, const char*> inputs[] = {
      {&in.x, "x"}, {&in.router_logits, "router_logits"}, {&weights.w13, "w13"}, {&weights.w2, "w2"}};
  for (const auto& [t, name] : inputs) {
    check.no_overlap(*t, name, y, "y");
    check.no_overlap(*t, name, ws_all, "workspace");
  }
  const std::pair<const std::optional<TensorView>*, const char*> optional_inputs[] = {
      {&in.correction_bias, "correction_bias"}, {&in.residual, "residual"},      {&in.num_tokens, "num_tokens"},
      {&weights.w13_scale, "w13_scale"},        {&weights.w2_scale, "w2_scale"}, {&weights.a13_scale, "a13_scale"},
      {&weights.a2_scale, "a2_scale"}};
  for (const auto& [t, name] : optional_inputs)
    if (*t) {
      check.no_overlap(**t, name, y, "y");
      check.no_overlap(**t, name, ws_all, "workspace");
    }
  check.no_overlap(y, "y", ws_all, "workspace");

  const int dev = in.x.device;
  // Internal views (the workspace's regions, sized for this call's T), and the GEMMs' own rules.
  const int64_t R = T * S;  // permuted rows this call can produce
  const TensorView gate_w = ws_view(workspace, L.gate_weights, DType::kFP32, {T, S}, dev);
  const TensorView gate_ids = ws_view(workspace, L.gate_ids, DType::kInt32, {T, S}, dev);
  const TensorView row_index = ws_view(workspace, L.row_index, DType::kInt32, {T, S}, dev);
  const TensorView offsets = ws_view(workspace, L.offsets, DType::kInt32, {G + 1}, dev);
  const TensorView counts = ws_view(workspace, L.counts, DType::kInt32, {G}, dev);
  const DType code = fp8 ? DType::kFP8E4M3 : DType::kBF16;
  const TensorView x_perm = ws_view(workspace, L.x_perm, code, {R, H}, dev);
  const TensorView x_scales = ws_view(workspace, L.x_scales, DType::kFP32, {R, H / 128}, dev);
  const TensorView h = ws_view(workspace, L.h, DType::kBF16, {R, 2 * I}, dev);
  // The activation in the first GEMM's epilogue where the format allows it (problem.h: GroupedProblem::act).
  const bool fused = !blockwise && (placement == ActivationPlacement::kFused ||
                                    (placement == ActivationPlacement::kAuto && kFusedActivationByDefault &&
                                     T >= kFuseMinTokens));
  const TensorView act = ws_view(workspace, fused ? L.act_fused : L.act, code, {R, I}, dev);
  const TensorView act_scales = ws_view(workspace, L.act_scales, DType::kFP32, {R, I / 128}, dev);
  const TensorView y_perm = ws_view(workspace, L.y_perm, DType::kBF16, {R, H}, dev);
  const Workspace gemm_ws = tessera::detail::workspace_part(workspace, L.gemm_ws, L.gemm_ws_bytes);
  const Workspace permute_ws = tessera::detail::workspace_part(workspace, L.permute_ws, L.permute_ws_bytes);

  std::optional<gemm::FP8Scales> s1, s2;
  if (blockwise) {
    s1 = gemm::FP8Scales{gemm::ScaleMode::kBlockwise, x_scales, verified(*weights.w13_scale)};
    s2 = gemm::FP8Scales{gemm::ScaleMode::kBlockwise, act_scales, verified(*weights.w2_scale)};
  } else if (fp8) {
    s1 = gemm::FP8Scales{gemm::ScaleMode::kPerTensor, verified(*weights.a13_scale), verified(*weights.w13_scale)};
    s2 = gemm::FP8Scales{gemm::ScaleMode::kPerTensor, verified(*weights.a2_scale), verified(*weights.w2_scale)};
  }
  gemm::detail::GroupedProblem gemm1 =
      check_gemm("tessera::moe::moe_layer (first GEMM: w = w13, w_scale = w13_scale, x_scale = a13_scale)", fp8, x_perm,
                 verified(weights.w13), offsets, s1, h, gemm_ws);
  const gemm::detail::GroupedProblem gemm2 =
      check_gemm("tessera::moe::moe_layer (second GEMM: w = w2, w_scale = w2_scale, x_scale = a2_scale)", fp8, act,
                 verified(weights.w2), offsets, s2, y_perm, gemm_ws);
  if (fused) {
    gemm1.act = act.data;
    gemm1.act_row_stride = I;
    gemm1.act_scale = fp8 ? static_cast<const float*>(weights.a2_scale->data) : nullptr;
  }
  // Device checks last (after every shape rule), once per tensor.
  check.on_current_device(in.x, "x");
  check.on_current_device(in.router_logits, "router_logits");
  check.on_current_device(y, "y");
  check.on_current_device(weights.w13, "w13");
  check.on_current_device(weights.w2, "w2");
  for (const auto& [t, name] : optional_inputs)
    if (*t) check.on_current_device(**t, name);
  check.on_current_device(ws_all, "workspace");

  if (T == 0) return;
  tessera::detail::require_hopper("tessera::moe::moe_layer");

  if (mark(0)) return;
  // 1. routing
  GateParams gp = c.gate;
  launch_fused_gate(in.router_logits, in.correction_bias, gate_w, gate_ids, gp, stream);
  if (mark(1)) return;
  // 2. permute (+ quantize)
  PermuteParams pp;
  pp.num_experts = G;
  pp.pad_multiple = 1;
  pp.quant = blockwise ? PermuteQuant::kFP8Blockwise : fp8 ? PermuteQuant::kFP8PerTensor : PermuteQuant::kNone;
  PermuteOutputs po;
  po.x_perm = x_perm;
  if (blockwise) po.scales = x_scales;
  po.expert_offsets = offsets;
  po.expert_counts = counts;
  po.row_index = row_index;
  const std::optional<TensorView> a13 =
      c.format == WeightFormat::kFP8PerTensor ? weights.a13_scale : std::nullopt;
  launch_permute(in.x, gate_ids, a13, po, permute_ws, pp, stream, in.num_tokens);
  if (mark(2)) return;
  // 3. h = x_perm · w13ᵀ (fused: act = Q(silu(gate) · up) of it, h not stored)
  gemm::detail::launch_grouped_gemm(gemm1, stream);
  if (mark(3)) return;
  // 4. act = Q(silu(gate) · up) over the rows in use (offsets[G], read on the device); done by step 3 where fused
  if (!fused) {
    detail::ActivationArgs aa{};
    aa.h = h.data;
    aa.act = act.data;
    aa.act_scales = blockwise ? static_cast<float*>(act_scales.data) : nullptr;
    aa.static_scale =
        c.format == WeightFormat::kFP8PerTensor ? static_cast<const float*>(weights.a2_scale->data) : nullptr;
    aa.rows_end = static_cast<const int32_t*>(offsets.data) + G;
    aa.capacity = R;
    aa.intermediate = I;
    aa.format = c.format;
    detail::launch_activation(aa, stream);
  }
  if (mark(4)) return;
  // 5. y_perm = act · w2ᵀ
  gemm::detail::launch_grouped_gemm(gemm2, stream);
  if (mark(5)) return;
  // 6. y = Σ_j weight · y_perm (+ residual)
  launch_unpermute_reduce(y_perm, row_index, gate_w, in.residual, y, 1.0f, stream);
  mark(6);
}

}  // namespace detail

}  // namespace tessera::moe
