// The MoE layer on the CPU: the plan's rules and workspace layout (pure), and every validation rule of the run (the
// error names the op and the argument, before any launch). Host buffers stand in for device memory (device 0); a
// call that passes every rule stops at the first device check (see common/validation_util.h).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "common/validation_util.h"
#include "moe/layer/problem.h"
#include "tessera/error.h"
#include "tessera/moe_layer.h"

namespace tessera::moe {
namespace {

using test::expect_error;
using test::HostBuffer;

// DeepSeek-V3's routing on a small layer: E 16 in 4 groups keep 2, top-4, one shared expert; H 256, I 128.
MoeLayerConfig small_config(WeightFormat f = WeightFormat::kFP8Blockwise) {
  MoeLayerConfig c;
  c.hidden = 256;
  c.intermediate = 128;
  c.num_experts = 16;
  c.format = f;
  c.gate.topk = 4;
  c.gate.num_groups = 4;
  c.gate.topk_groups = 2;
  c.gate.num_shared_experts = 1;
  return c;
}

constexpr const char* kPlan = "tessera::moe::moe_layer_plan";
constexpr const char* kRun = "tessera::moe::moe_layer";

TEST(MoeLayerPlan, EveryConstantRule) {
  struct PlanRule {
    const char* name;
    const char* arg;
    std::function<void(MoeLayerConfig&, int64_t&)> mutate;
  };
  const PlanRule rules[] = {
      {"hidden not a multiple of 128", "hidden", [](MoeLayerConfig& c, int64_t&) { c.hidden = 200; }},
      {"hidden 0", "hidden", [](MoeLayerConfig& c, int64_t&) { c.hidden = 0; }},
      {"intermediate 64", "intermediate", [](MoeLayerConfig& c, int64_t&) { c.intermediate = 64; }},
      {"no experts", "num_experts", [](MoeLayerConfig& c, int64_t&) { c.num_experts = 0; }},
      {"600 experts", "num_experts", [](MoeLayerConfig& c, int64_t&) { c.num_experts = 600; }},
      {"groups do not divide", "num_groups", [](MoeLayerConfig& c, int64_t&) { c.gate.num_groups = 3; }},
      {"topk past the kept groups", "topk", [](MoeLayerConfig& c, int64_t&) { c.gate.topk = 9; }},
      {"33 slots", "topk + num_shared_experts",
       [](MoeLayerConfig& c, int64_t&) {
         c.gate.num_groups = 1;
         c.gate.topk_groups = 1;
         c.gate.topk = 16;
         c.gate.num_shared_experts = 17;
       }},
      {"bad format", "format", [](MoeLayerConfig& c, int64_t&) { c.format = static_cast<WeightFormat>(7); }},
      {"negative max_tokens", "max_tokens", [](MoeLayerConfig&, int64_t& t) { t = -1; }},
      {"rows past int32", "max_tokens", [](MoeLayerConfig&, int64_t& t) { t = int64_t{1} << 29; }},
  };
  for (const PlanRule& r : rules) {
    SCOPED_TRACE(r.name);
    MoeLayerConfig c = small_config();
    int64_t t = 64;
    r.mutate(c, t);
    expect_error([&] { moe_layer_plan(c, t); }, kPlan, r.arg);
  }
  EXPECT_NO_THROW(moe_layer_plan(small_config(), 0));
}

TEST(MoeLayerPlan, WorkspaceRegionsFollowTheLifetimes) {
  for (WeightFormat f : {WeightFormat::kFP8Blockwise, WeightFormat::kFP8PerTensor, WeightFormat::kBF16}) {
    const MoeLayerConfig c = small_config(f);
    const int64_t T = 100;
    const detail::LayerLayout l = detail::layer_layout(c, T);
    const int64_t R = T * 5;  // 4 routed + 1 shared
    EXPECT_EQ(l.capacity, R);
    EXPECT_EQ(l.experts, 17);
    const std::size_t code = f == WeightFormat::kBF16 ? 2 : 1;
    // x_perm and the activation share region A; h and y_perm share region B, after region A.
    EXPECT_EQ(l.x_perm, l.act);
    EXPECT_EQ(l.h, l.y_perm);
    EXPECT_GE(l.h, l.x_perm + R * 256 * code);
    EXPECT_GE(l.h, l.act + R * 128 * code);
    if (f == WeightFormat::kFP8Blockwise) {
      EXPECT_GE(l.x_scales, l.x_perm + R * 256);
      EXPECT_GE(l.h, l.x_scales + R * 2 * 4);
      EXPECT_GE(l.h, l.act_scales + R * 1 * 4);
    }
    EXPECT_GE(l.total, l.h + std::max<std::size_t>(R * 2 * 128 * 2, R * 256 * 2));
    // The fused first GEMM's activation (bf16, per-tensor fp8): after y_perm in region B, inside the workspace, never
    // over x_perm (which that GEMM reads while it writes the activation); block-wise has none.
    if (f == WeightFormat::kFP8Blockwise) {
      EXPECT_EQ(l.act_fused, 0u);
    } else {
      EXPECT_EQ(l.act_fused % 256, 0u);
      EXPECT_GE(l.act_fused, l.y_perm + R * 256 * 2);
      EXPECT_GE(l.act_fused, l.x_perm + R * 256 * code);
      EXPECT_LE(l.act_fused + R * 128 * code, l.total);
    }
    for (std::size_t off : {l.gate_weights, l.gate_ids, l.row_index, l.offsets, l.counts, l.permute_ws, l.x_perm,
                            l.x_scales, l.act, l.act_scales, l.h, l.gemm_ws})
      EXPECT_EQ(off % 256, 0u);
    // The regions that live through the whole call end before region A begins, in order, without overlap.
    const std::size_t routing = T * 5 * 4;
    EXPECT_GE(l.gate_ids, l.gate_weights + routing);
    EXPECT_GE(l.row_index, l.gate_ids + routing);
    EXPECT_GE(l.offsets, l.row_index + routing);
    EXPECT_GE(l.counts, l.offsets + 4 * 18);
    EXPECT_GE(l.permute_ws, l.counts + 4 * 17);
    EXPECT_GE(l.gemm_ws, l.permute_ws + l.permute_ws_bytes);
    EXPECT_GE(l.x_perm, l.gemm_ws + l.gemm_ws_bytes);
    EXPECT_EQ(moe_layer_plan(c, T).workspace_bytes, l.total);
    // Monotone in the token count (a plan for more tokens serves fewer).
    EXPECT_GE(detail::layer_layout(c, T + 1).total, l.total);
  }
}

// ---- run ---------------------------------------------------------------------------------------------------------

constexpr int64_t kT = 8, kH = 256, kI = 128, kE = 16, kG = 17;

struct Buffers {
  HostBuffer x{kT * kH * 2, 1}, logits{kT * kE * 4, 0}, bias{kE * 4, 0}, residual{kT * kH * 2, 0}, y{kT * kH * 2, 0xAB},
      w13{kG * 2 * kI * kH * 2, 0}, w2{kG * kH * kI * 2, 0}, w13s{kG * 4 * 4, 0}, w2s{kG * 2 * 4, 0}, a13{16, 0},
      a2{16, 0}, count{16, 0}, ws{8 << 20, 0};
};

struct Args {
  MoeLayerPlan plan;
  MoeLayerInputs in;
  MoeLayerWeights w;
  TensorView y;
  Workspace ws;
};

Args make_args(Buffers& b, WeightFormat f = WeightFormat::kFP8Blockwise) {
  Args a;
  a.plan = moe_layer_plan(small_config(f), kT);
  a.in.x = TensorView::contiguous(b.x.data(), DType::kBF16, {kT, kH}, 0);
  a.in.router_logits = TensorView::contiguous(b.logits.data(), DType::kFP32, {kT, kE}, 0);
  a.in.correction_bias = TensorView::contiguous(b.bias.data(), DType::kFP32, {kE}, 0);
  a.in.residual = TensorView::contiguous(b.residual.data(), DType::kBF16, {kT, kH}, 0);
  a.in.num_tokens = TensorView::contiguous(b.count.data(), DType::kInt32, {1}, 0);
  const DType wt = f == WeightFormat::kBF16 ? DType::kBF16 : DType::kFP8E4M3;
  a.w.w13 = TensorView::contiguous(b.w13.data(), wt, {kG, 2 * kI, kH}, 0);
  a.w.w2 = TensorView::contiguous(b.w2.data(), wt, {kG, kH, kI}, 0);
  if (f == WeightFormat::kFP8Blockwise) {
    a.w.w13_scale = TensorView::contiguous(b.w13s.data(), DType::kFP32, {kG, 2, 2}, 0);
    a.w.w2_scale = TensorView::contiguous(b.w2s.data(), DType::kFP32, {kG, 2, 1}, 0);
  } else if (f == WeightFormat::kFP8PerTensor) {
    a.w.w13_scale = TensorView::contiguous(b.w13s.data(), DType::kFP32, {kG}, 0);
    a.w.w2_scale = TensorView::contiguous(b.w2s.data(), DType::kFP32, {kG}, 0);
    a.w.a13_scale = TensorView::contiguous(b.a13.data(), DType::kFP32, {1}, 0);
    a.w.a2_scale = TensorView::contiguous(b.a2.data(), DType::kFP32, {1}, 0);
  }
  a.y = TensorView::contiguous(b.y.data(), DType::kBF16, {kT, kH}, 0);
  a.ws = Workspace{b.ws.data(), a.plan.workspace_bytes};
  return a;
}

void call(const Args& a) { moe_layer(a.plan, a.in, a.w, a.y, a.ws, nullptr); }

TEST(MoeLayerValidation, AcceptedArgumentsReachTheDeviceChecks) {
  for (WeightFormat f : {WeightFormat::kFP8Blockwise, WeightFormat::kFP8PerTensor, WeightFormat::kBF16}) {
    Buffers b;
    ASSERT_LE(moe_layer_plan(small_config(f), kT).workspace_bytes, std::size_t{8} << 20);
    const Args a = make_args(b, f);
    try {
      call(a);
      ADD_FAILURE() << "host buffers were accepted as device memory";
    } catch (const Error& e) {
      EXPECT_TRUE(test::is_device_check_error(e.what())) << e.what();
    }
    EXPECT_TRUE(b.y.untouched());
  }
}

struct Rule {
  const char* name;
  const char* arg;
  std::function<void(Args&)> mutate;
  WeightFormat format = WeightFormat::kFP8Blockwise;
};

TEST(MoeLayerValidation, EveryRuleNamesItsArgument) {
  const Rule rules[] = {
      {"x fp16", "x", [](Args& a) { a.in.x.dtype = DType::kFP16; }},
      {"x hidden", "x", [](Args& a) { a.in.x.shape[1] = 128; }},
      {"more tokens than planned", "x",
       [](Args& a) {
         a.in.x.shape[0] = kT + 1;
         a.in.router_logits.shape[0] = kT + 1;
       }},
      {"x misaligned", "x", [](Args& a) { a.in.x.data = static_cast<char*>(a.in.x.data) + 2; }},
      {"x inner stride", "x", [](Args& a) { a.in.x.strides[1] = 2; }},
      {"logits experts", "router_logits", [](Args& a) { a.in.router_logits.shape[1] = 8; }},
      {"logits tokens", "router_logits", [](Args& a) { a.in.router_logits.shape[0] = kT - 1; }},
      {"logits int8", "router_logits", [](Args& a) { a.in.router_logits.dtype = DType::kInt8; }},
      {"bias length", "correction_bias", [](Args& a) { a.in.correction_bias->shape[0] = 8; }},
      {"residual tokens", "residual", [](Args& a) { a.in.residual->shape[0] = 4; }},
      {"residual fp32", "residual", [](Args& a) { a.in.residual->dtype = DType::kFP32; }},
      {"num_tokens int64", "num_tokens", [](Args& a) { a.in.num_tokens->dtype = DType::kInt64; }},
      {"num_tokens two elements", "num_tokens", [](Args& a) { a.in.num_tokens->shape[0] = 2; }},
      {"y tokens", "y", [](Args& a) { a.y.shape[0] = kT - 1; }},
      {"y fp16", "y", [](Args& a) { a.y.dtype = DType::kFP16; }},
      {"y rows share memory", "y", [](Args& a) { a.y.strides[0] = 0; }},
      {"w13 bf16 in an fp8 plan", "w13", [](Args& a) { a.w.w13.dtype = DType::kBF16; }},
      {"w13 experts without the shared one", "w13", [](Args& a) { a.w.w13.shape[0] = kE; }},
      {"w13 rows = I", "w13", [](Args& a) { a.w.w13.shape[1] = kI; }},
      {"w2 transposed", "w2",
       [](Args& a) {
         a.w.w2.shape[1] = kI;
         a.w.w2.shape[2] = kH;
       }},
      {"w13_scale missing", "w13_scale", [](Args& a) { a.w.w13_scale.reset(); }},
      {"w13_scale per-tensor in a block-wise plan", "w13_scale",
       [](Args& a) { a.w.w13_scale = TensorView::contiguous(a.w.w13_scale->data, DType::kFP32, {kG}, 0); }},
      {"w2_scale blocks", "w2_scale", [](Args& a) { a.w.w2_scale->shape[2] = 2; }},
      {"activation scale in a block-wise plan", "a13_scale", [](Args& a) { a.w.a13_scale = a.w.w13_scale; }},
      {"a2_scale missing", "a2_scale", [](Args& a) { a.w.a2_scale.reset(); }, WeightFormat::kFP8PerTensor},
      {"w13_scale in a bf16 plan", "w13_scale",
       [](Args& a) { a.w.w13_scale = TensorView::contiguous(a.w.w2.data, DType::kFP32, {kG}, 0); },
       WeightFormat::kBF16},
      {"workspace one byte short", "workspace", [](Args& a) { a.ws.bytes -= 1; }},
      {"workspace misaligned", "workspace", [](Args& a) { a.ws.data = static_cast<char*>(a.ws.data) + 8; }},
      {"y is the residual", "y", [](Args& a) { a.in.residual->data = a.y.data; }},
      {"y inside the workspace", "workspace", [](Args& a) { a.y.data = a.ws.data; }},
      {"w13 stride not 16-byte aligned (the GEMM's rule)", "w",
       [](Args& a) {
         a.w.w13.strides[1] = kH + 8;
         a.w.w13.strides[0] = 2 * kI * (kH + 8);
       }},
  };
  for (const Rule& r : rules) {
    SCOPED_TRACE(r.name);
    Buffers b;
    Args a = make_args(b, r.format);
    r.mutate(a);
    const char* op = std::string(r.arg) == "w" ? "tessera::moe::moe_layer (first GEMM" : kRun;
    if (std::string(r.arg) == "w") {
      try {
        call(a);
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
        EXPECT_FALSE(test::is_device_check_error(e.what())) << e.what();
      }
    } else {
      expect_error([&] { call(a); }, op, r.arg);
    }
    EXPECT_TRUE(b.y.untouched());
  }
}

}  // namespace
}  // namespace tessera::moe
