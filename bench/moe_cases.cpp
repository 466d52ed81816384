// tessera-bench cases for the MoE routing ops: fused_gate, permute, unpermute_reduce.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "common/host_numeric.h"
#include "harness.h"
#include "reference/moe_checks.h"
#include "reference/moe_reference.h"
#include "tessera/moe.h"

namespace tessera::bench {
namespace {

// --check runs the CPU reference on at most this many tokens (the leading ones); the message says so.
constexpr int64_t kCheckTokens = 4096;

std::string reference_note(int64_t checked, int64_t total) {
  return checked < total ? " (reference on the first " + std::to_string(checked) + " of " + std::to_string(total) +
                               " tokens)"
                         : std::string();
}

// Random 16-bit float rows: uniform in (-1, 1) times a per-row magnitude 2^U(-2, 2), so row / block maxima vary
// the way activations do. Never zero (the grid is offset by half a step and stays above the bf16/fp16 minimum).
std::vector<uint16_t> random_rows(Rng& rng, int64_t rows, int64_t cols, DType dtype) {
  std::vector<uint16_t> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float step = static_cast<float>(std::exp2(rng.uniform(-2.0, 2.0)) / 32768.0);
    uint16_t* o = &out[r * cols];
    uint64_t bits = 0;
    for (int64_t c = 0; c < cols; ++c) {
      if ((c & 3) == 0) bits = rng.next();
      const float v = (static_cast<float>(bits & 0xFFFF) - 32767.5f) * step;
      bits >>= 16;
      o[c] = dtype == DType::kBF16 ? host::f32_to_bf16(v) : host::f32_to_fp16(v);
    }
  }
  return out;
}

double from16(uint16_t bits, DType dtype) {
  return dtype == DType::kBF16 ? host::bf16_to_f32(bits) : host::fp16_to_f32(bits);
}

// ids [T, k]: k distinct experts per token, uniform (a partial Fisher-Yates over a running permutation).
std::vector<int32_t> random_ids(Rng& rng, int64_t tokens, int topk, int num_experts) {
  std::vector<int32_t> perm(num_experts), ids(tokens * topk);
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int j = 0; j < topk; ++j) {
      std::swap(perm[j], perm[j + rng.below(num_experts - j)]);
      ids[t * topk + j] = perm[j];
    }
  return ids;
}

TensorView view(const DeviceBuffer& b, DType dtype, std::initializer_list<int64_t> shape, int device) {
  return TensorView::contiguous(b.get(), dtype, shape, device);
}

// ============================================================================================================
// fused_gate
struct GateConfig {
  const char* name;
  int num_experts, num_groups, topk_groups, topk;
  moe::Scoring scoring;
  bool renormalize;
  float scale;
  bool bias;
};

constexpr GateConfig kGateConfigs[] = {
    {"dsv3", 256, 8, 4, 8, moe::Scoring::kSigmoid, true, 2.5f, true},
    {"dsv2lite", 64, 1, 1, 6, moe::Scoring::kSoftmax, false, 1.0f, false},
    {"qwen3", 128, 1, 1, 8, moe::Scoring::kSoftmax, true, 1.0f, false},
    {"kimik2", 384, 1, 1, 8, moe::Scoring::kSigmoid, true, 2.827f, true},
    {"mixtral", 8, 1, 1, 2, moe::Scoring::kSoftmax, true, 1.0f, false},
    {"odd160", 160, 1, 1, 6, moe::Scoring::kSigmoid, false, 1.0f, true},
};

moe::GateParams gate_params(const GateConfig& c) {
  moe::GateParams p;
  p.topk = c.topk;
  p.num_groups = c.num_groups;
  p.topk_groups = c.topk_groups;
  p.scoring = c.scoring;
  p.group_score = moe::GroupScore::kTop2Sum;
  p.renormalize = c.renormalize;
  p.routed_scaling_factor = c.scale;
  return p;
}

class GateCase final : public CaseInstance {
 public:
  GateCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const GateConfig& cfg,
           int64_t tokens, DType dtype)
      : cfg_(cfg), params_(gate_params(cfg)), tokens_(tokens), dtype_(dtype), device_(ctx.device) {
    const int E = cfg.num_experts, width = params_.topk + params_.num_shared_experts;
    const std::size_t elt = dtype_size(dtype);
    const std::size_t logit_bytes = tokens * E * elt, bias_bytes = cfg.bias ? E * 4 : 0;
    sets_ = rotating_sets(ctx, static_cast<double>(logit_bytes + bias_bytes));
    for (int s = 0; s < sets_; ++s) {
      Rng rng(case_seed(op, name, s));
      std::vector<float> logits(tokens * E);
      for (float& v : logits) v = static_cast<float>(1.5 * rng.normal());
      logits_.emplace_back(logit_bytes);
      if (dtype == DType::kFP32) {
        logits_.back().upload(logits);
      } else {
        std::vector<uint16_t> bits(logits.size());
        for (size_t i = 0; i < bits.size(); ++i)
          bits[i] = dtype == DType::kBF16 ? host::f32_to_bf16(logits[i]) : host::f32_to_fp16(logits[i]);
        logits_.back().upload(bits);
        if (s == 0) {  // the reference sees the rounded values
          for (size_t i = 0; i < bits.size(); ++i) logits[i] = static_cast<float>(from16(bits[i], dtype));
        }
      }
      std::vector<float> bias;
      if (cfg.bias) {
        bias.resize(E);
        for (float& b : bias) b = static_cast<float>(rng.uniform(-0.1, 0.1));
        bias_.emplace_back(bias_bytes);
        bias_.back().upload(bias);
      }
      if (s == 0) {
        host_logits_ = std::move(logits);
        host_bias_ = std::move(bias);
      }
    }
    weights_.allocate(tokens * width * 4);
    ids_.allocate(tokens * width * 4);
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const int E = cfg_.num_experts, width = params_.topk + params_.num_shared_experts;
    std::optional<TensorView> bias;
    if (cfg_.bias) bias = view(bias_[set], DType::kFP32, {E}, device_);
    moe::fused_gate(view(logits_[set], dtype_, {tokens_, E}, device_), bias,
                    view(weights_, DType::kFP32, {tokens_, width}, device_),
                    view(ids_, DType::kInt32, {tokens_, width}, device_), params_, stream);
  }

  CheckResult check(cudaStream_t stream) override {
    const int E = cfg_.num_experts, width = params_.topk + params_.num_shared_experts;
    weights_.fill_async(0xFF, stream);  // NaN
    ids_.fill_async(0xFF, stream);      // -1
    run(stream, 0);
    const int64_t n = std::min(tokens_, kCheckTokens);
    const auto w = weights_.download<float>(n * width, stream);
    const auto ids = ids_.download<int32_t>(n * width, stream);
    const std::vector<double> logits(host_logits_.begin(), host_logits_.begin() + n * E);
    const std::vector<double> bias(host_bias_.begin(), host_bias_.end());
    const reference::GateRef ref = reference::fused_gate(logits, n, E, bias, params_);
    CheckResult r = reference::check_fused_gate(ref, w.data(), ids.data(), n, E, params_);
    r.message += reference_note(n, tokens_);
    return r;
  }

 private:
  GateConfig cfg_;
  moe::GateParams params_;
  int64_t tokens_;
  DType dtype_;
  int device_;
  int sets_ = 1;
  std::vector<DeviceBuffer> logits_, bias_;
  DeviceBuffer weights_, ids_;
  std::vector<float> host_logits_, host_bias_;  // set 0
};

void add_gate_cases(std::vector<CaseSpec>& cases) {
  const auto add = [&](const GateConfig& cfg, int64_t T, DType dtype) {
    const std::string op = "fused_gate";
    const std::string name = std::string(cfg.name) + "/T" + std::to_string(T) + "/" + dtype_name(dtype);
    const int width = cfg.topk;  // no shared-expert slots in these configs
    CaseSpec c;
    c.op = op;
    c.name = name;
    c.bytes = static_cast<double>(T) * cfg.num_experts * dtype_size(dtype) + (cfg.bias ? cfg.num_experts * 4.0 : 0.0) +
              static_cast<double>(T) * width * 8.0;
    c.flops = 0;
    c.setup = [=](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<GateCase>(ctx, op, name, cfg, T, dtype);
    };
    cases.push_back(std::move(c));
  };
  for (const GateConfig& cfg : kGateConfigs) {
    const bool dsv3 = std::string(cfg.name) == "dsv3";
    const std::vector<int64_t> tokens = dsv3 ? std::vector<int64_t>{1, 16, 128, 1024, 4096, 65536}
                                             : std::vector<int64_t>{128, 4096, 65536};
    for (int64_t T : tokens) add(cfg, T, DType::kFP32);
    if (dsv3)
      for (int64_t T : {4096, 65536}) add(cfg, T, DType::kBF16);
  }
}

// ============================================================================================================
// permute
const char* quant_name(moe::PermuteQuant q) {
  switch (q) {
    case moe::PermuteQuant::kNone: return "none";
    case moe::PermuteQuant::kFP8Blockwise: return "fp8block";
    case moe::PermuteQuant::kFP8PerTensor: return "fp8tensor";
  }
  return "?";
}

struct PermuteShape {
  int64_t tokens, hidden;
  int topk, num_experts;
  moe::PermuteQuant quant;
  DType dtype = DType::kBF16;
  int pad_multiple = 1;

  moe::PermuteParams params() const { return {num_experts, pad_multiple, quant}; }
  int64_t num_blocks() const { return (hidden + moe::kFP8BlockCols - 1) / moe::kFP8BlockCols; }
  bool fp8() const { return quant != moe::PermuteQuant::kNone; }
  std::size_t out_elt() const { return fp8() ? 1 : dtype_size(dtype); }
};

class PermuteCase final : public CaseInstance {
 public:
  PermuteCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const PermuteShape& sh)
      : sh_(sh), params_(sh.params()), device_(ctx.device) {
    const int64_t T = sh.tokens, H = sh.hidden, k = sh.topk, E = sh.num_experts;
    capacity_ = moe::permute_capacity_rows(T, sh.topk, params_);
    const std::size_t x_bytes = T * H * dtype_size(sh.dtype), ids_bytes = T * k * 4;
    sets_ = rotating_sets(ctx, static_cast<double>(x_bytes + ids_bytes));
    for (int s = 0; s < sets_; ++s) {
      Rng rng(case_seed(op, name, s));
      std::vector<uint16_t> x = random_rows(rng, T, H, sh.dtype);
      std::vector<int32_t> ids = random_ids(rng, T, sh.topk, sh.num_experts);
      x_.emplace_back(x_bytes);
      x_.back().upload(x);
      ids_.emplace_back(ids_bytes);
      ids_.back().upload(ids);
      float input_scale = 1.0f;
      if (sh.quant == moe::PermuteQuant::kFP8PerTensor) {  // a calibrated scale: amax maps to 448
        double amax = 0;
        for (uint16_t b : x) amax = std::max(amax, std::fabs(from16(b, sh.dtype)));
        input_scale = static_cast<float>(amax / 448.0);
        input_scale_.emplace_back(4);
        input_scale_.back().upload(std::vector<float>{input_scale});
      }
      if (s == 0) {
        host_x_ = std::move(x);
        host_ids_ = std::move(ids);
        host_input_scale_ = input_scale;
      }
    }
    x_perm_.allocate(capacity_ * H * sh.out_elt());
    if (sh.quant == moe::PermuteQuant::kFP8Blockwise) scales_.allocate(capacity_ * sh.num_blocks() * 4);
    offsets_.allocate((E + 1) * 4);
    counts_.allocate(E * 4);
    row_index_.allocate(T * k * 4);
    row_token_.allocate(capacity_ * 4);
    workspace_bytes_ = moe::permute_workspace_bytes(T, sh.topk, params_);
    workspace_.allocate(workspace_bytes_);  // cudaMalloc: 256-byte aligned

    out_.x_perm = view(x_perm_, sh.fp8() ? DType::kFP8E4M3 : sh.dtype, {capacity_, H}, device_);
    if (sh.quant == moe::PermuteQuant::kFP8Blockwise)
      out_.scales = view(scales_, DType::kFP32, {capacity_, sh.num_blocks()}, device_);
    out_.expert_offsets = view(offsets_, DType::kInt32, {E + 1}, device_);
    out_.expert_counts = view(counts_, DType::kInt32, {E}, device_);
    out_.row_index = view(row_index_, DType::kInt32, {T, k}, device_);
    out_.row_token = view(row_token_, DType::kInt32, {capacity_}, device_);
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    std::optional<TensorView> input_scale;
    if (sh_.quant == moe::PermuteQuant::kFP8PerTensor) input_scale = view(input_scale_[set], DType::kFP32, {1}, device_);
    moe::permute(view(x_[set], sh_.dtype, {sh_.tokens, sh_.hidden}, device_),
                 view(ids_[set], DType::kInt32, {sh_.tokens, sh_.topk}, device_), input_scale, out_,
                 moe::Workspace{workspace_.get(), workspace_bytes_}, params_, stream);
  }

  CheckResult check(cudaStream_t stream) override {
    const int64_t T = sh_.tokens, H = sh_.hidden;
    const int k = sh_.topk, E = sh_.num_experts;
    x_perm_.fill_async(0xFF, stream);  // NaN in bf16 / fp16 / e4m3
    scales_.fill_async(0xFF, stream);
    for (const DeviceBuffer* b : {&offsets_, &counts_, &row_index_, &row_token_}) b->fill_async(0x7F, stream);
    run(stream, 0);
    const auto offsets = offsets_.download<int32_t>(E + 1, stream);
    const auto counts = counts_.download<int32_t>(E, stream);
    const auto row_index = row_index_.download<int32_t>(T * k, stream);
    const auto row_token = row_token_.download<int32_t>(capacity_, stream);

    const std::vector<int64_t> ids(host_ids_.begin(), host_ids_.end());
    const reference::PermuteIndexRef ref = reference::permute_index(ids, T, k, E, sh_.pad_multiple);
    CheckResult index = reference::check_permute_index(ref, offsets.data(), counts.data(), row_index.data(),
                                                       row_token.data(), T, k, E);
    // The index is checked in full; x_perm on its first kCheckTokens * k rows.
    const int64_t used = ref.offsets[E], rows = std::min<int64_t>(used, kCheckTokens * k);
    CheckResult data;
    if (!sh_.fp8()) {
      const auto x_perm = x_perm_.download<uint16_t>(rows * H, stream);
      data = reference::check_permute_rows(ref, host_x_.data(), x_perm.data(), T, H, rows);
    } else {
      const auto x_perm = x_perm_.download<uint8_t>(rows * H, stream);
      std::vector<float> scales;
      if (sh_.quant == moe::PermuteQuant::kFP8Blockwise) scales = scales_.download<float>(rows * sh_.num_blocks(), stream);
      data = reference::check_permute_fp8(ref, host_x_.data(), sh_.dtype, x_perm.data(), sh_.quant, scales.data(),
                                          sh_.num_blocks(), 1, host_input_scale_, T, H, rows);
    }
    CheckResult r;
    r.ok = index.ok && data.ok;
    r.error = data.error;
    r.compared = index.compared + data.compared;
    r.message = "index: " + index.message + "; x_perm: " + data.message;
    return r;
  }

 private:
  PermuteShape sh_;
  moe::PermuteParams params_;
  int device_;
  int sets_ = 1;
  int64_t capacity_ = 0;
  std::size_t workspace_bytes_ = 0;
  std::vector<DeviceBuffer> x_, ids_, input_scale_;
  DeviceBuffer x_perm_, scales_, offsets_, counts_, row_index_, row_token_, workspace_;
  moe::PermuteOutputs out_;
  std::vector<uint16_t> host_x_;  // set 0
  std::vector<int32_t> host_ids_;
  float host_input_scale_ = 1.0f;
};

void add_permute_cases(std::vector<CaseSpec>& cases) {
  const auto add = [&](int64_t T, moe::PermuteQuant quant) {
    PermuteShape sh{T, 7168, 8, 256, quant};
    const std::string op = "permute";
    const std::string name = "T" + std::to_string(T) + "/k" + std::to_string(sh.topk) + "/E" +
                             std::to_string(sh.num_experts) + "/H" + std::to_string(sh.hidden) + "/" +
                             dtype_name(sh.dtype) + "/" + quant_name(quant);
    const double copies = static_cast<double>(T) * sh.topk;  // no padding: rows = T * k
    CaseSpec c;
    c.op = op;
    c.name = name;
    c.bytes = static_cast<double>(T) * sh.hidden * dtype_size(sh.dtype)  // x
              + copies * sh.hidden * sh.out_elt()                       // x_perm
              + (quant == moe::PermuteQuant::kFP8Blockwise ? copies * sh.num_blocks() * 4.0 : 0.0)
              + (quant == moe::PermuteQuant::kFP8PerTensor ? 4.0 : 0.0)  // input_scale
              + copies * 4.0                                            // ids
              + (2.0 * sh.num_experts + 1) * 4.0                        // offsets, counts
              + copies * 4.0 * 2;                                       // row_index, row_token
    c.flops = 0;
    c.setup = [=](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<PermuteCase>(ctx, op, name, sh);
    };
    cases.push_back(std::move(c));
  };
  for (moe::PermuteQuant q :
       {moe::PermuteQuant::kNone, moe::PermuteQuant::kFP8Blockwise, moe::PermuteQuant::kFP8PerTensor})
    add(4096, q);
  add(128, moe::PermuteQuant::kNone);
  add(16384, moe::PermuteQuant::kNone);
}

// ============================================================================================================
// unpermute_reduce
struct UnpermuteShape {
  int64_t tokens, hidden;
  int topk, num_experts;
  bool residual;
  DType dtype = DType::kBF16;
  float routed_scale = 1.0f;
  int64_t rows() const { return tokens * topk; }
};

class UnpermuteCase final : public CaseInstance {
 public:
  UnpermuteCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const UnpermuteShape& sh)
      : sh_(sh), device_(ctx.device) {
    const int64_t T = sh.tokens, H = sh.hidden, k = sh.topk, R = sh.rows();
    const std::size_t elt = dtype_size(sh.dtype);
    const std::size_t y_bytes = R * H * elt, idx_bytes = T * k * 4, res_bytes = sh.residual ? T * H * elt : 0;
    sets_ = rotating_sets(ctx, static_cast<double>(y_bytes + 2 * idx_bytes + res_bytes));
    for (int s = 0; s < sets_; ++s) {
      Rng rng(case_seed(op, name, s));
      std::vector<uint16_t> y = random_rows(rng, R, H, sh.dtype);
      // row_index as permute would produce it for k distinct random experts per token.
      const std::vector<int32_t> ids32 = random_ids(rng, T, sh.topk, sh.num_experts);
      const std::vector<int64_t> ids(ids32.begin(), ids32.end());
      std::vector<int32_t> row_index = reference::permute_index(ids, T, sh.topk, sh.num_experts, 1).row_index;
      std::vector<float> weights(T * k);
      for (float& w : weights) w = static_cast<float>(rng.uniform(0.02, 0.4));
      std::vector<uint16_t> residual;
      if (sh.residual) residual = random_rows(rng, T, H, sh.dtype);
      y_.emplace_back(y_bytes);
      y_.back().upload(y);
      row_index_.emplace_back(idx_bytes);
      row_index_.back().upload(row_index);
      weights_.emplace_back(idx_bytes);
      weights_.back().upload(weights);
      if (sh.residual) {
        residual_.emplace_back(res_bytes);
        residual_.back().upload(residual);
      }
      if (s == 0) {
        host_y_ = std::move(y);
        host_row_index_ = std::move(row_index);
        host_weights_ = std::move(weights);
        host_residual_ = std::move(residual);
      }
    }
    out_.allocate(T * H * elt);
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const int64_t T = sh_.tokens, H = sh_.hidden;
    std::optional<TensorView> residual;
    if (sh_.residual) residual = view(residual_[set], sh_.dtype, {T, H}, device_);
    moe::unpermute_reduce(view(y_[set], sh_.dtype, {sh_.rows(), H}, device_),
                          view(row_index_[set], DType::kInt32, {T, sh_.topk}, device_),
                          view(weights_[set], DType::kFP32, {T, sh_.topk}, device_), residual,
                          view(out_, sh_.dtype, {T, H}, device_), sh_.routed_scale, stream);
  }

  CheckResult check(cudaStream_t stream) override {
    const int64_t H = sh_.hidden;
    const int k = sh_.topk;
    out_.fill_async(0xFF, stream);  // NaN
    run(stream, 0);
    const int64_t n = std::min(sh_.tokens, kCheckTokens);
    const auto out = out_.download<uint16_t>(n * H, stream);

    // The reference on tokens [0, n): gather the rows they use into a compact y (row t * k + j).
    std::vector<double> y(n * k * H), weights(n * k), residual;
    std::vector<int32_t> row_index(n * k, -1);
    for (int64_t i = 0; i < n * k; ++i) {
      weights[i] = host_weights_[i];
      const int32_t row = host_row_index_[i];
      if (row < 0) continue;
      row_index[i] = static_cast<int32_t>(i);
      for (int64_t h = 0; h < H; ++h) y[i * H + h] = from16(host_y_[row * H + h], sh_.dtype);
    }
    if (sh_.residual) {
      residual.resize(n * H);
      for (int64_t i = 0; i < n * H; ++i) residual[i] = from16(host_residual_[i], sh_.dtype);
    }
    const std::vector<double> ref =
        reference::unpermute_reduce(y, row_index, weights, residual, n, k, H, sh_.routed_scale);
    std::vector<double> got(n * H);
    for (int64_t i = 0; i < n * H; ++i) got[i] = from16(out[i], sh_.dtype);
    CheckResult r = reference::check_close(ref, got, 1e-2);  // bf16 output rounding: ~2^-9 relative per element
    r.message += reference_note(n, sh_.tokens);
    return r;
  }

 private:
  UnpermuteShape sh_;
  int device_;
  int sets_ = 1;
  std::vector<DeviceBuffer> y_, row_index_, weights_, residual_;
  DeviceBuffer out_;
  std::vector<uint16_t> host_y_, host_residual_;  // set 0
  std::vector<int32_t> host_row_index_;
  std::vector<float> host_weights_;
};

void add_unpermute_cases(std::vector<CaseSpec>& cases) {
  const auto add = [&](int64_t T, bool residual) {
    UnpermuteShape sh{T, 7168, 8, 256, residual};
    const std::string op = "unpermute_reduce";
    const std::string name = "T" + std::to_string(T) + "/k" + std::to_string(sh.topk) + "/H" +
                             std::to_string(sh.hidden) + "/" + dtype_name(sh.dtype) + (residual ? "/residual" : "");
    const double elt = static_cast<double>(dtype_size(sh.dtype)), th = static_cast<double>(T) * sh.hidden;
    CaseSpec c;
    c.op = op;
    c.name = name;
    c.bytes = sh.topk * th * elt                          // y rows, each read once
              + static_cast<double>(T) * sh.topk * 8.0    // weights + row_index
              + (residual ? th * elt : 0.0) + th * elt;   // residual, out
    c.flops = 2.0 * sh.topk * th + (residual ? th : 0.0);  // the weighted sum (+ the residual add)
    c.setup = [=](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<UnpermuteCase>(ctx, op, name, sh);
    };
    cases.push_back(std::move(c));
  };
  add(4096, false);
  add(4096, true);
  add(128, false);
}

void add_moe_cases(std::vector<CaseSpec>& cases) {
  add_gate_cases(cases);
  add_permute_cases(cases);
  add_unpermute_cases(cases);
}

}  // namespace

TESSERA_BENCH_CASES(add_moe_cases);

}  // namespace tessera::bench
