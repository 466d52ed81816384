// Every validation rule of the MoE routing ops: the error names the op and the argument, and nothing is written.
// These rules are checked before any device query, so they run on machines without a GPU (host buffers stand in
// for device memory; a call that got past validation would fail on them, which the tests would also catch).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tessera/error.h"
#include "common/validate.h"
#include "moe/permute/config.h"
#include "moe/unpermute/config.h"
#include "tessera/moe.h"

namespace tessera::moe {
namespace {

void expect_error(const std::function<void()>& call, const std::string& op, const std::string& arg) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming " << arg;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(op), std::string::npos) << msg;
    EXPECT_NE(msg.find("'" + arg + "'"), std::string::npos) << "expected '" << arg << "' in: " << msg;
  }
}

constexpr uint32_t kPoison = 0xDEADBEEF;

struct GateBuffers {
  int64_t T = 4;
  int E = 256;
  int width = 8;
  std::vector<float> logits, bias;
  std::vector<uint32_t> weights, ids;
  GateBuffers(int64_t t, int e, int w) : T(t), E(e), width(w), logits(t * e, 0.5f), bias(e, 0.1f),
                                          weights(t * w, kPoison), ids(t * w, kPoison) {}
  TensorView logits_v() { return TensorView::contiguous(logits.data(), DType::kFP32, {T, E}, 0); }
  TensorView bias_v() { return TensorView::contiguous(bias.data(), DType::kFP32, {E}, 0); }
  TensorView weights_v() { return TensorView::contiguous(weights.data(), DType::kFP32, {T, width}, 0); }
  TensorView ids_v() { return TensorView::contiguous(ids.data(), DType::kInt32, {T, width}, 0); }
  bool untouched() const {
    for (uint32_t v : weights) if (v != kPoison) return false;
    for (uint32_t v : ids) if (v != kPoison) return false;
    return true;
  }
};

GateParams dsv3() {
  GateParams p;
  p.topk = 8;
  p.num_groups = 8;
  p.topk_groups = 4;
  p.renormalize = true;
  p.routed_scaling_factor = 2.5f;
  return p;
}

// A view with a negative stride reaches below its base: the overlap rule sees its whole span (a DLPack producer may
// hand such views to the C++ API; a residual walking its rows backwards could otherwise alias y unnoticed).
TEST(ArgCheckOverlap, NegativeStridesCoverTheWholeSpan) {
  const tessera::detail::ArgCheck check("tessera::test");
  std::vector<float> buf(128);
  TensorView backwards = TensorView::contiguous(buf.data() + 56, DType::kFP32, {8, 8}, 0);
  backwards.strides[0] = -8;  // rows 56.., 48.., ..., 0..: elements [0, 64)
  const TensorView first_row = TensorView::contiguous(buf.data(), DType::kFP32, {8}, 0);
  const TensorView past = TensorView::contiguous(buf.data() + 64, DType::kFP32, {64}, 0);
  expect_error([&] { check.no_overlap(backwards, "residual", first_row, "y"); }, "tessera::test", "y");
  expect_error([&] { check.no_overlap(first_row, "y", backwards, "residual"); }, "tessera::test", "residual");
  EXPECT_NO_THROW(check.no_overlap(backwards, "residual", past, "y"));
  TensorView reversed_cols = TensorView::contiguous(buf.data() + 71, DType::kFP32, {8}, 0);
  reversed_cols.strides[0] = -1;  // elements [64, 72)
  expect_error([&] { check.no_overlap(reversed_cols, "a", past, "b"); }, "tessera::test", "b");
  EXPECT_NO_THROW(check.no_overlap(reversed_cols, "a", first_row, "b"));
}

const char* kGate = "tessera::moe::fused_gate";

// A workspace an adapter labelled (the PyTorch operators: a CUDA tensor's storage) keeps its label in the view the
// checks use and in the parts an op hands on; a raw one takes the op's device and stays unverified (the driver is
// asked about it).
TEST(WorkspaceView, LabelsTravelWithTheWorkspaceAndItsParts) {
  alignas(16) unsigned char bytes[256];
  Workspace raw;
  raw.data = bytes;
  raw.bytes = sizeof(bytes);
  const TensorView rv = tessera::detail::workspace_view(raw, 128, 3);
  EXPECT_EQ(rv.device, 3);
  EXPECT_FALSE(rv.device_verified);
  EXPECT_EQ(rv.numel(), 128);
  EXPECT_EQ(rv.dtype, DType::kUInt8);
  EXPECT_EQ(rv.data, static_cast<void*>(bytes));
  Workspace labelled = raw;
  labelled.device_verified = true;
  labelled.device = 1;
  const TensorView lv = tessera::detail::workspace_view(labelled, 64, 3);
  EXPECT_EQ(lv.device, 1);  // the label, not the op's device: a workspace on another GPU is still named as such
  EXPECT_TRUE(lv.device_verified);
  const Workspace part = tessera::detail::workspace_part(labelled, 32, 96);
  EXPECT_EQ(part.data, static_cast<void*>(bytes + 32));
  EXPECT_EQ(part.bytes, 96u);
  EXPECT_TRUE(part.device_verified);
  EXPECT_EQ(part.device, 1);
  EXPECT_FALSE(tessera::detail::workspace_part(raw, 16, 16).device_verified);
}

TEST(FusedGateValidation, EachRuleNamesItsArgument) {
  struct Case {
    const char* name;
    std::function<void(GateBuffers&, GateParams&, TensorView&, std::optional<TensorView>&, TensorView&,
                       TensorView&)>
        mutate;
    const char* arg;
  };
  const std::vector<Case> cases = {
      {"logits dtype", [](auto&, auto&, auto& l, auto&, auto&, auto&) { l.dtype = DType::kInt32; }, "logits"},
      {"logits rank", [](auto&, auto&, auto& l, auto&, auto&, auto&) { l.rank = 3; l.shape[2] = 1; l.strides[2] = 1; }, "logits"},
      {"logits inner stride", [](auto&, auto&, auto& l, auto&, auto&, auto&) { l.strides[1] = 2; }, "logits"},
      {"logits misaligned", [](auto&, auto&, auto& l, auto&, auto&, auto&) { l.data = static_cast<char*>(l.data) + 2; }, "logits"},
      {"E too large", [](auto&, auto&, auto& l, auto&, auto&, auto&) { l.shape[1] = 640; l.strides[0] = 640; }, "logits.shape[1] (num_experts)"},
      {"groups do not divide E", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.num_groups = 7; }, "num_groups"},
      {"topk_groups > groups", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.topk_groups = 9; }, "topk_groups"},
      {"topk > 32", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.topk = 33; }, "topk"},
      {"topk > kept experts", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.topk_groups = 1; p.topk = 16; p.num_groups = 32; }, "topk"},
      {"top2 needs 2 per group", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.num_groups = 256; p.topk_groups = 8; }, "num_groups"},
      {"bias size", [](auto&, auto&, auto&, auto& b, auto&, auto&) { b->shape[0] = 128; }, "bias"},
      {"bias dtype", [](auto&, auto&, auto&, auto& b, auto&, auto&) { b->dtype = DType::kInt8; }, "bias"},
      {"weights dtype", [](auto&, auto&, auto&, auto&, auto& w, auto&) { w.dtype = DType::kBF16; }, "weights"},
      {"weights tokens", [](auto&, auto&, auto&, auto&, auto& w, auto&) { w.shape[0] = 3; }, "weights"},
      {"weights width", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.num_shared_experts = 1; }, "weights"},
      {"weights non-contiguous", [](auto&, auto&, auto&, auto&, auto& w, auto&) { w.strides[0] = 16; }, "weights"},
      {"ids dtype", [](auto&, auto&, auto&, auto&, auto&, auto& i) { i.dtype = DType::kInt64; }, "ids"},
      {"ids shape", [](auto&, auto&, auto&, auto&, auto&, auto& i) { i.shape[1] = 6; }, "ids"},
      {"outputs overlap", [](auto&, auto&, auto&, auto&, auto& w, auto& i) { i.data = w.data; }, "ids"},
      {"scaling inf", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.routed_scaling_factor = INFINITY; }, "routed_scaling_factor"},
      {"scaling NaN", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.routed_scaling_factor = NAN; }, "routed_scaling_factor"},
      {"shared weight inf", [](auto&, auto& p, auto&, auto&, auto&, auto&) { p.shared_expert_weight = -INFINITY; }, "shared_expert_weight"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    GateBuffers b(4, 256, 8);
    GateParams p = dsv3();
    TensorView logits = b.logits_v(), weights = b.weights_v(), ids = b.ids_v();
    std::optional<TensorView> bias = b.bias_v();
    c.mutate(b, p, logits, bias, weights, ids);
    expect_error([&] { fused_gate(logits, bias, weights, ids, p, nullptr); }, kGate, c.arg);
    EXPECT_TRUE(b.untouched());
  }
}

const char* kPermute = "tessera::moe::permute";

struct PermuteBuffers {
  int64_t T = 16, H = 256;
  int k = 4, E = 8;
  PermuteParams params;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<uint8_t> x_perm;
  std::vector<float> scales;
  std::vector<int32_t> offsets, counts, row_index, row_token;
  std::vector<uint8_t> workspace;
  PermuteBuffers() {
    params.num_experts = E;
    x.assign(T * H, 1);
    ids.assign(T * k, 1);
    const int64_t rows = permute_capacity_rows(T, k, params);
    x_perm.assign(rows * H * 2, 0xAB);
    scales.assign(rows * 2, 7.0f);
    offsets.assign(E + 1, -7);
    counts.assign(E, -7);
    row_index.assign(T * k, -7);
    row_token.assign(rows, -7);
    workspace.assign(permute_workspace_bytes(T, k, params) + 16, 0);
  }
  int64_t rows() const { return static_cast<int64_t>(row_token.size()); }
  bool untouched() const {
    for (uint8_t v : x_perm) if (v != 0xAB) return false;
    for (int32_t v : offsets) if (v != -7) return false;
    for (int32_t v : counts) if (v != -7) return false;
    for (int32_t v : row_index) if (v != -7) return false;
    for (int32_t v : row_token) if (v != -7) return false;
    return true;
  }
};

TEST(PermuteValidation, EachRuleNamesItsArgument) {
  struct Args {
    TensorView x, ids;
    std::optional<TensorView> input_scale;
    PermuteOutputs out;
    Workspace ws;
    PermuteParams params;
    std::optional<TensorView> num_tokens;
  };
  struct Case {
    const char* name;
    std::function<void(Args&)> mutate;
    const char* arg;
  };
  const std::vector<Case> cases = {
      {"x dtype", [](Args& a) { a.x.dtype = DType::kFP32; }, "x"},
      {"x hidden % 8", [](Args& a) { a.x.shape[1] = 250; }, "x"},
      {"ids dtype", [](Args& a) { a.ids.dtype = DType::kFP32; }, "ids"},
      {"ids tokens", [](Args& a) { a.ids.shape[0] = 15; }, "ids"},
      {"ids non-contiguous", [](Args& a) { a.ids.strides[0] = 8; }, "ids"},
      {"topk > 32", [](Args& a) { a.ids.shape[1] = 33; a.ids.strides[0] = 33; }, "ids.shape[1] (topk)"},
      {"num_experts", [](Args& a) { a.params.num_experts = 0; }, "num_experts"},
      {"pad_multiple", [](Args& a) { a.params.pad_multiple = 0; }, "pad_multiple"},
      {"x_perm rows", [](Args& a) { a.out.x_perm.shape[0] = 10; }, "x_perm"},
      {"x_perm dtype", [](Args& a) { a.out.x_perm.dtype = DType::kFP16; }, "x_perm"},
      {"x_perm fp8 needed", [](Args& a) { a.params.quant = PermuteQuant::kFP8Blockwise; }, "x_perm"},
      {"scales missing", [](Args& a) { a.params.quant = PermuteQuant::kFP8Blockwise; a.out.x_perm.dtype = DType::kFP8E4M3; a.out.scales.reset(); }, "scales"},
      {"input_scale missing", [](Args& a) { a.params.quant = PermuteQuant::kFP8PerTensor; a.out.x_perm.dtype = DType::kFP8E4M3; a.input_scale.reset(); }, "input_scale"},
      {"offsets size", [](Args& a) { a.out.expert_offsets.shape[0] = 8; }, "expert_offsets"},
      {"counts dtype", [](Args& a) { a.out.expert_counts.dtype = DType::kInt64; }, "expert_counts"},
      {"row_index shape", [](Args& a) { a.out.row_index.shape[1] = 3; }, "row_index"},
      {"row_token size", [](Args& a) { a.out.row_token->shape[0] = 3; }, "row_token"},
      {"workspace too small", [](Args& a) { a.ws.bytes = 16; }, "workspace"},
      {"x_perm overlaps x", [](Args& a) { a.out.x_perm.data = a.x.data; }, "x_perm"},
      {"num_tokens int64", [](Args& a) { a.num_tokens->dtype = DType::kInt64; }, "num_tokens"},
      {"num_tokens two elements", [](Args& a) { a.num_tokens->shape[0] = 2; }, "num_tokens"},
      {"num_tokens misaligned",
       [](Args& a) { a.num_tokens->data = static_cast<char*>(a.num_tokens->data) + 1; }, "num_tokens"},
      {"num_tokens inside the workspace", [](Args& a) { a.num_tokens->data = a.ws.data; }, "workspace"},
      {"num_tokens inside row_index", [](Args& a) { a.num_tokens->data = a.out.row_index.data; }, "row_index"},
      {"num_tokens inside row_token", [](Args& a) { a.num_tokens->data = a.out.row_token->data; }, "row_token"},
      // Every block reads ids while others write the outputs (a single pass: every column slice).
      {"ids are row_index", [](Args& a) { a.ids.data = a.out.row_index.data; }, "row_index"},
      {"ids inside expert_offsets", [](Args& a) { a.out.expert_offsets.data = a.ids.data; }, "expert_offsets"},
      {"ids inside x_perm", [](Args& a) { a.ids.data = a.out.x_perm.data; }, "x_perm"},
      {"ids inside the workspace", [](Args& a) { a.ids.data = a.ws.data; }, "workspace"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    PermuteBuffers b;
    const int64_t rows = b.rows();
    Args a;
    a.params = b.params;
    a.x = TensorView::contiguous(b.x.data(), DType::kBF16, {b.T, b.H}, 0);
    a.ids = TensorView::contiguous(b.ids.data(), DType::kInt32, {b.T, b.k}, 0);
    a.input_scale = TensorView::contiguous(b.scales.data(), DType::kFP32, {1}, 0);
    a.out.x_perm = TensorView::contiguous(b.x_perm.data(), DType::kBF16, {rows, b.H}, 0);
    a.out.scales = TensorView::contiguous(b.scales.data(), DType::kFP32, {rows, 2}, 0);
    a.out.expert_offsets = TensorView::contiguous(b.offsets.data(), DType::kInt32, {b.E + 1}, 0);
    a.out.expert_counts = TensorView::contiguous(b.counts.data(), DType::kInt32, {b.E}, 0);
    a.out.row_index = TensorView::contiguous(b.row_index.data(), DType::kInt32, {b.T, b.k}, 0);
    a.out.row_token = TensorView::contiguous(b.row_token.data(), DType::kInt32, {rows}, 0);
    a.ws = Workspace{b.workspace.data() + (16 - reinterpret_cast<uintptr_t>(b.workspace.data()) % 16) % 16,
                     b.workspace.size() - 16};
    std::vector<int32_t> count(4, 3);
    a.num_tokens = TensorView::contiguous(count.data(), DType::kInt32, {1}, 0);
    c.mutate(a);
    expect_error([&] { permute(a.x, a.ids, a.input_scale, a.out, a.ws, a.params, nullptr, a.num_tokens); }, kPermute,
                 c.arg);
    EXPECT_TRUE(b.untouched());
  }
}

TEST(PermuteValidation, CapacityAndWorkspaceQueries) {
  PermuteParams p;
  p.num_experts = 256;
  EXPECT_EQ(permute_capacity_rows(4096, 8, p), 4096 * 8);
  p.pad_multiple = 128;
  EXPECT_EQ(permute_capacity_rows(4096, 8, p), 4096 * 8 + 256 * 127);
  EXPECT_GT(permute_workspace_bytes(4096, 8, p), 4096u * 8 * 4);
  EXPECT_EQ(permute_workspace_bytes(4096, 8, p) % 16, 0u);
  expect_error([&] { permute_capacity_rows(16, 40, p); }, "permute_capacity_rows", "ids.shape[1] (topk)");
  p.num_experts = 5000;
  expect_error([&] { permute_workspace_bytes(16, 4, p); }, "permute_workspace_bytes", "num_experts");
}

// Few copies take one launch (the scatter pass counts and scans itself); the workspace a larger T was sized for
// always covers a smaller T's, whichever way each goes (the MoE layer plans for its largest T and runs smaller ones).
TEST(PermuteConfig, SinglePassForFewCopiesAndWorkspaceMonotone) {
  using detail::kPermuteSinglePassEntries;
  using detail::PermuteProblem;
  using detail::select_permute_config;
  for (int E : {1, 8, 64, 256, 1024})
    for (int k : {1, 2, 6, 8, 32}) {
      std::size_t previous = 0;
      for (int64_t T = 1; T <= 700; ++T) {
        const auto c = select_permute_config(PermuteProblem{T, k, E, 1});
        SCOPED_TRACE("E=" + std::to_string(E) + " k=" + std::to_string(k) + " T=" + std::to_string(T));
        EXPECT_EQ(c.single_pass, T * k <= kPermuteSinglePassEntries);
        if (c.single_pass) {
          EXPECT_EQ(c.num_chunks, 1);
          EXPECT_EQ(c.tokens_per_chunk, T);
        }
        // Every chunk's copies fit the scatter pass's shared arrays.
        EXPECT_LE(int64_t{c.tokens_per_chunk} * k, detail::kPermuteMaxChunkEntries);
        EXPECT_GE(c.num_chunks * c.tokens_per_chunk, T);
        EXPECT_GE(c.workspace_bytes, previous);
        previous = c.workspace_bytes;
      }
    }
}

// Column slices of unpermute_reduce: whole rows for many tokens, slices of whole warps (32 vectors) covering the row
// for few, and never fewer blocks than tokens.
TEST(UnpermuteConfig, SlicesCoverTheRowInWarpMultiples) {
  using detail::unpermute_slice_vectors;
  EXPECT_EQ(unpermute_slice_vectors(4096, 896, 132), 896);  // DeepSeek-V3 prefill: one block per token
  EXPECT_EQ(unpermute_slice_vectors(1, 896, 132), 32);      // decode, T 1: 28 blocks
  EXPECT_EQ(unpermute_slice_vectors(128, 896, 132), 192);   // 5 slices: 4 of 192 vectors, one of 128
  for (int64_t T : {1, 2, 3, 37, 100, 527, 528, 100000})
    for (int64_t V : {1, 2, 31, 32, 33, 256, 897, 7168}) {
      const int64_t per = unpermute_slice_vectors(T, V, 132);
      SCOPED_TRACE("T=" + std::to_string(T) + " V=" + std::to_string(V));
      ASSERT_GE(per, 1);
      ASSERT_LE(per, V);
      EXPECT_TRUE(per == V || per % 32 == 0);
      const int64_t slices = (V + per - 1) / per;
      EXPECT_LE(slices, 65535);  // grid.y
      if (T >= 4 * 132) EXPECT_EQ(slices, 1);
    }
}

const char* kUnpermute = "tessera::moe::unpermute_reduce";

TEST(UnpermuteValidation, EachRuleNamesItsArgument) {
  const int64_t T = 8, H = 64, R = 32;
  const int k = 4;
  struct Case {
    const char* name;
    std::function<void(TensorView&, TensorView&, TensorView&, std::optional<TensorView>&, TensorView&)> mutate;
    const char* arg;
  };
  const std::vector<Case> cases = {
      {"y dtype", [](auto& y, auto&, auto&, auto&, auto&) { y.dtype = DType::kFP32; }, "y_perm"},
      {"y hidden % 8", [](auto& y, auto&, auto&, auto&, auto&) { y.shape[1] = 60; }, "y_perm"},
      {"row_index dtype", [](auto&, auto& r, auto&, auto&, auto&) { r.dtype = DType::kInt64; }, "row_index"},
      {"weights shape", [](auto&, auto&, auto& w, auto&, auto&) { w.shape[1] = 3; }, "weights"},
      {"weights dtype", [](auto&, auto&, auto& w, auto&, auto&) { w.dtype = DType::kBF16; }, "weights"},
      {"out dtype", [](auto&, auto&, auto&, auto&, auto& o) { o.dtype = DType::kFP16; }, "out"},
      {"out shape", [](auto&, auto&, auto&, auto&, auto& o) { o.shape[0] = 7; }, "out"},
      {"residual shape", [](auto&, auto&, auto&, auto& res, auto&) { res->shape[1] = 32; }, "residual"},
      {"out overlaps y", [](auto& y, auto&, auto&, auto&, auto& o) { o.data = y.data; }, "out"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<uint16_t> y(R * H, 1), residual(T * H, 2), out(T * H, 0xABCD);
    std::vector<int32_t> rows(T * k, 0);
    std::vector<float> w(T * k, 1.0f);
    TensorView yv = TensorView::contiguous(y.data(), DType::kBF16, {R, H}, 0);
    TensorView rv = TensorView::contiguous(rows.data(), DType::kInt32, {T, k}, 0);
    TensorView wv = TensorView::contiguous(w.data(), DType::kFP32, {T, k}, 0);
    std::optional<TensorView> res = TensorView::contiguous(residual.data(), DType::kBF16, {T, H}, 0);
    TensorView ov = TensorView::contiguous(out.data(), DType::kBF16, {T, H}, 0);
    c.mutate(yv, rv, wv, res, ov);
    expect_error([&] { unpermute_reduce(yv, rv, wv, res, ov, 1.0f, nullptr); }, kUnpermute, c.arg);
    for (uint16_t v : out) ASSERT_EQ(v, 0xABCD);
  }
}

}  // namespace
}  // namespace tessera::moe
