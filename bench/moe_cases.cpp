// tessera-bench cases for the MoE routing ops: fused_gate, permute, unpermute_reduce.
//
// Inputs are generated on the GPU (device_random.h): logits N(0, 1.5²); activations uniform in (-1, 1) times a
// per-row magnitude 2^U(-2, 2); routing ids with k distinct experts per token. unpermute_reduce's row_index is
// permute's for those ids, computed on the host from the downloaded ids (T·k integers).
//
// --check (the message states the sample):
//   fused_gate        every token up to kCheckTokens; past that the first and last kCheckEdge tokens and random ones,
//                     kCheckTokens in all; the reference runs on worker threads over chunks of them
//   permute           the index outputs (offsets, counts, row_index, row_token) in full; x_perm (and its scales) on
//                     every expert group's first and last row plus random rows, kCheckRows in all
//   unpermute_reduce  every token up to kCheckReduceTokens, else the first and last kCheckReduceEdge and random
//                     ones, kCheckReduceTokens in all
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "common/host_numeric.h"
#include "device_random.h"
#include "harness.h"
#include "reference/format.h"
#include "reference/moe_checks.h"
#include "reference/moe_reference.h"
#include "tessera/moe.h"

namespace tessera::bench {
namespace {

constexpr int64_t kCheckTokens = 4096;        // fused_gate tokens the reference covers
constexpr int64_t kCheckEdge = 256;           // leading and trailing tokens always in a sample
constexpr int64_t kCheckRows = 2048;          // permute: x_perm rows compared (group ends included)
constexpr int64_t kCheckReduceTokens = 512;   // unpermute_reduce tokens the reference covers
constexpr int64_t kCheckReduceEdge = 64;      // of them, leading and trailing
constexpr int64_t kGateChunk = 256;           // fused_gate tokens per reference work item
constexpr int64_t kPermuteChunk = 256;        // permute x_perm rows per check work item
constexpr int64_t kReduceChunk = 32;          // unpermute_reduce tokens per reference work item

// Salts of the tensors of one set (gen::sub_seed).
enum Salt : uint64_t { kLogits = 1, kBias, kX, kIds, kY, kWeights, kResidual };

std::string sample_note(int64_t checked, int64_t total, const char* what, int64_t edge) {
  if (checked >= total) return "";
  return " (reference on " + std::to_string(checked) + " of " + std::to_string(total) + " " + what + ": the first and last " +
         std::to_string(edge) + " and random ones)";
}

double from16(uint16_t bits, DType dtype) {
  return dtype == DType::kBF16 ? host::bf16_to_f32(bits) : host::fp16_to_f32(bits);
}

// Activations: uniform in (-1, 1) times a per-row magnitude 2^U(-2, 2) (row / block maxima vary).
gen::FloatDist activation_rows(int64_t cols) {
  gen::FloatDist d;
  d.row = cols;
  d.log2_mag_lo = -2.0f;
  d.log2_mag_hi = 2.0f;
  return d;
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
      const uint64_t seed = case_seed(op, name, s);
      gen::FloatDist logits;
      logits.kind = gen::FloatDist::kNormal;
      logits.stddev = 1.5f;
      logits_.emplace_back(logit_bytes);
      gen::fill_float(logits_.back().get(), dtype, tokens * E, gen::sub_seed(seed, kLogits), logits, ctx.stream);
      if (cfg.bias) {
        gen::FloatDist bias;
        bias.lo = -0.1f;
        bias.hi = 0.1f;
        bias_.emplace_back(bias_bytes);
        gen::fill_float(bias_.back().get(), DType::kFP32, E, gen::sub_seed(seed, kBias), bias, ctx.stream);
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
    const std::vector<int64_t> tokens = sample_indices(tokens_, kCheckTokens, kCheckEdge, 0x6A7Eull);
    const int64_t n = static_cast<int64_t>(tokens.size());
    const auto w = download_rows<float>(weights_, width, tokens, stream);
    const auto ids = download_rows<int32_t>(ids_, width, tokens, stream);
    std::vector<double> logits(n * E), bias;
    if (dtype_ == DType::kFP32) {
      const auto l = download_rows<float>(logits_[0], E, tokens, stream);
      std::copy(l.begin(), l.end(), logits.begin());
    } else {
      const auto l = download_rows<uint16_t>(logits_[0], E, tokens, stream);
      for (int64_t i = 0; i < n * E; ++i) logits[i] = from16(l[i], dtype_);
    }
    if (cfg_.bias) {
      const auto b = bias_[0].download<float>(E, stream);
      bias.assign(b.begin(), b.end());
    }
    // Tokens are independent: the reference and its check run per chunk on worker threads.
    const int64_t chunks = (n + kGateChunk - 1) / kGateChunk;
    std::vector<CheckResult> parts(chunks);
    std::vector<std::string> labels(chunks);
    parallel_for(chunks, static_cast<double>(n) * E * 64, [&](int64_t c) {
      const int64_t t0 = c * kGateChunk, m = std::min(kGateChunk, n - t0);
      const std::vector<double> l(logits.begin() + t0 * E, logits.begin() + (t0 + m) * E);
      const reference::GateRef ref = reference::fused_gate(l, m, E, bias, params_);
      parts[c] = reference::check_fused_gate(ref, w.data() + t0 * width, ids.data() + t0 * width, m, E, params_);
      labels[c] = "tokens " + std::to_string(tokens[t0]) + ".." + std::to_string(tokens[t0 + m - 1]) +
                  " (sampled rows " + std::to_string(t0) + ".." + std::to_string(t0 + m - 1) + ")";
    });
    int64_t id_rows = 0;
    for (const CheckResult& p : parts) id_rows += p.compared;
    return merge_checks(parts, labels,
                        std::to_string(n) + " tokens: weights within 1e-5, ids equal on " + std::to_string(id_rows) +
                            " rows without a near tie" + sample_note(n, tokens_, "tokens", kCheckEdge));
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
    // Headline: DeepSeek-V3 at decode (T 1), small and large prefill, bf16 logits, and the widest gate (Kimi K2).
    const std::string model = cfg.name;
    c.headline = (model == "dsv3" && (T == 1 || (T == 4096 && dtype == DType::kFP32) || T == 65536)) ||
                 (model == "kimik2" && T == 65536);
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
    DeviceBuffer amax(sizeof(float));
    for (int s = 0; s < sets_; ++s) {
      const uint64_t seed = case_seed(op, name, s);
      x_.emplace_back(x_bytes);
      gen::fill_float(x_.back().get(), sh.dtype, T * H, gen::sub_seed(seed, kX), activation_rows(H), ctx.stream);
      ids_.emplace_back(ids_bytes);
      gen::fill_topk_ids(ids_.back().as<int32_t>(), T, sh.topk, sh.num_experts, gen::sub_seed(seed, kIds), ctx.stream);
      if (sh.quant == moe::PermuteQuant::kFP8PerTensor) {  // a calibrated scale: amax maps to 448
        gen::amax16(x_.back().as<const uint16_t>(), sh.dtype, T * H, amax.as<float>(), ctx.stream);
        const float input_scale = amax.download<float>(1, ctx.stream)[0] / 448.0f;
        input_scale_.emplace_back(4);
        input_scale_.back().upload(std::vector<float>{input_scale});
        if (s == 0) host_input_scale_ = input_scale;
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

    const std::vector<int32_t> ids32 = ids_[0].download<int32_t>(T * k, stream);
    const std::vector<int64_t> ids(ids32.begin(), ids32.end());
    const reference::PermuteIndexRef ref = reference::permute_index(ids, T, k, E, sh_.pad_multiple);
    CheckResult index = reference::check_permute_index(ref, offsets.data(), counts.data(), row_index.data(),
                                                       row_token.data(), T, k, E);
    // x_perm on a sample of rows: every expert group's first and last row, then random ones up to kCheckRows.
    // The reference is re-indexed to the sample: row i of it is sampled row rows[i], its tokens compact.
    const int64_t used = ref.offsets[E];
    std::vector<int64_t> rows;
    for (int e = 0; e < E; ++e)
      if (ref.offsets[e + 1] > ref.offsets[e]) {
        rows.push_back(ref.offsets[e]);
        rows.push_back(ref.offsets[e + 1] - 1);
      }
    {
      std::vector<int64_t> extra = sample_indices(used, std::max<int64_t>(0, kCheckRows - static_cast<int64_t>(rows.size())), 0, 0x9E6Dull);
      rows.insert(rows.end(), extra.begin(), extra.end());
      std::sort(rows.begin(), rows.end());
      rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    }
    const int64_t n = static_cast<int64_t>(rows.size());
    reference::PermuteIndexRef sampled;
    sampled.offsets = {0, static_cast<int32_t>(n)};
    std::vector<int64_t> tokens;  // x rows the sample reads, in order of first use
    for (int64_t r : rows) {
      const int32_t t = ref.row_token[r];
      sampled.row_token.push_back(t < 0 ? -1 : static_cast<int32_t>(tokens.size()));
      if (t >= 0) tokens.push_back(t);
    }
    const std::vector<uint16_t> x = download_rows<uint16_t>(x_[0], H, tokens, stream);
    const int64_t nt = static_cast<int64_t>(tokens.size()), nb = sh_.num_blocks();
    std::vector<uint16_t> x_perm16;
    std::vector<uint8_t> x_perm8;
    std::vector<float> scales;
    if (!sh_.fp8()) x_perm16 = download_rows<uint16_t>(x_perm_, H, rows, stream);
    else x_perm8 = download_rows<uint8_t>(x_perm_, H, rows, stream);
    if (sh_.quant == moe::PermuteQuant::kFP8Blockwise) scales = download_rows<float>(scales_, nb, rows, stream);
    // Chunks of sampled rows on worker threads, each against its slice of the re-indexed reference.
    const int64_t chunks = (n + kPermuteChunk - 1) / kPermuteChunk;
    std::vector<CheckResult> parts(chunks);
    std::vector<std::string> labels(chunks);
    parallel_for(chunks, static_cast<double>(n) * H * 20, [&](int64_t c) {
      const int64_t r0 = c * kPermuteChunk, m = std::min(kPermuteChunk, n - r0);
      reference::PermuteIndexRef part;
      part.offsets = {0, static_cast<int32_t>(m)};
      part.row_token.assign(sampled.row_token.begin() + r0, sampled.row_token.begin() + r0 + m);
      if (!sh_.fp8())
        parts[c] = reference::check_permute_rows(part, x.data(), x_perm16.data() + r0 * H, nt, H);
      else
        parts[c] = reference::check_permute_fp8(part, x.data(), sh_.dtype, x_perm8.data() + r0 * H, sh_.quant,
                                                scales.empty() ? nullptr : scales.data() + r0 * nb, nb, 1,
                                                host_input_scale_, nt, H);
      labels[c] = "x_perm rows " + std::to_string(rows[r0]) + ".." + std::to_string(rows[r0 + m - 1]) +
                  " ('x_perm[i]': sampled row " + std::to_string(r0) + " + i)";
    });
    double worst = 0;
    for (const CheckResult& p : parts) worst = std::max(worst, p.error);
    std::string summary = std::to_string(n) + " rows ";
    summary += !sh_.fp8() ? "equal to their tokens' x rows bitwise"
                          : std::string("within half an e4m3 step of x / scale") +
                                (sh_.quant == moe::PermuteQuant::kFP8Blockwise ? ", block scales within 1e-6" : "") +
                                ", worst relative Frobenius error " + reference::detail::fmt(worst);
    if (n < used)
      summary += " (" + std::to_string(n) + " of " + std::to_string(used) +
                 " rows: every expert group's first and last row and random ones)";
    CheckResult data = merge_checks(parts, labels, summary);
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
  float host_input_scale_ = 1.0f;  // set 0
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
    c.headline = T == 4096 || T == 16384;  // every quantization at T 4096, and the largest
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
    DeviceBuffer ids(idx_bytes);
    for (int s = 0; s < sets_; ++s) {
      const uint64_t seed = case_seed(op, name, s);
      y_.emplace_back(y_bytes);
      gen::fill_float(y_.back().get(), sh.dtype, R * H, gen::sub_seed(seed, kY), activation_rows(H), ctx.stream);
      // row_index as permute would produce it for k distinct random experts per token (host: T·k integers).
      gen::fill_topk_ids(ids.as<int32_t>(), T, sh.topk, sh.num_experts, gen::sub_seed(seed, kIds), ctx.stream);
      const std::vector<int32_t> ids32 = ids.download<int32_t>(T * k, ctx.stream);
      const std::vector<int64_t> ids64(ids32.begin(), ids32.end());
      std::vector<int32_t> row_index = reference::permute_index(ids64, T, sh.topk, sh.num_experts, 1).row_index;
      row_index_.push_back(upload_new(row_index));
      gen::FloatDist w;
      w.lo = 0.02f;
      w.hi = 0.4f;
      weights_.emplace_back(idx_bytes);
      gen::fill_float(weights_.back().get(), DType::kFP32, T * k, gen::sub_seed(seed, kWeights), w, ctx.stream);
      if (sh.residual) {
        residual_.emplace_back(res_bytes);
        gen::fill_float(residual_.back().get(), sh.dtype, T * H, gen::sub_seed(seed, kResidual), activation_rows(H),
                        ctx.stream);
      }
      if (s == 0) host_row_index_ = std::move(row_index);
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
    const std::vector<int64_t> tokens = sample_indices(sh_.tokens, kCheckReduceTokens, kCheckReduceEdge, 0x5ED0ull);
    const int64_t n = static_cast<int64_t>(tokens.size());
    const auto out = download_rows<uint16_t>(out_, H, tokens, stream);
    const auto all_weights = weights_[0].download<float>(sh_.tokens * k, stream);

    // The reference on the sampled tokens: the y rows they use gathered in token order (token i's from
    // first_row[i]), then chunks of tokens on worker threads, each against its own compact y.
    std::vector<int64_t> y_rows, first_row(n + 1, 0);
    for (int64_t i = 0; i < n; ++i) {
      for (int j = 0; j < k; ++j)
        if (const int32_t row = host_row_index_[tokens[i] * k + j]; row >= 0) y_rows.push_back(row);
      first_row[i + 1] = static_cast<int64_t>(y_rows.size());
    }
    const auto y16 = download_rows<uint16_t>(y_[0], H, y_rows, stream);
    std::vector<uint16_t> r16;
    if (sh_.residual) r16 = download_rows<uint16_t>(residual_[0], H, tokens, stream);
    const int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
    std::vector<CheckResult> parts(chunks);
    std::vector<std::string> labels(chunks);
    parallel_for(chunks, static_cast<double>(n) * k * H * 8, [&](int64_t c) {
      const int64_t i0 = c * kReduceChunk, m = std::min(kReduceChunk, n - i0), y0 = first_row[i0];
      std::vector<double> y((first_row[i0 + m] - y0) * H), weights(m * k), residual, got(m * H);
      for (size_t e = 0; e < y.size(); ++e) y[e] = from16(y16[y0 * H + e], sh_.dtype);
      std::vector<int32_t> row_index(m * k, -1);
      for (int64_t i = 0; i < m; ++i) {
        int64_t next = first_row[i0 + i] - y0;
        for (int j = 0; j < k; ++j) {
          weights[i * k + j] = all_weights[tokens[i0 + i] * k + j];
          if (host_row_index_[tokens[i0 + i] * k + j] >= 0) row_index[i * k + j] = static_cast<int32_t>(next++);
        }
      }
      if (sh_.residual) {
        residual.resize(m * H);
        for (int64_t e = 0; e < m * H; ++e) residual[e] = from16(r16[i0 * H + e], sh_.dtype);
      }
      for (int64_t e = 0; e < m * H; ++e) got[e] = from16(out[i0 * H + e], sh_.dtype);
      const std::vector<double> ref =
          reference::unpermute_reduce(y, row_index, weights, residual, m, k, H, sh_.routed_scale);
      parts[c] = reference::check_close(ref, got, 1e-2);  // bf16 output rounding: ~2^-9 relative per element
      labels[c] = "tokens " + std::to_string(tokens[i0]) + ".." + std::to_string(tokens[i0 + m - 1]);
    });
    double worst = 0;
    for (const CheckResult& p : parts) worst = std::max(worst, p.error);
    CheckResult r = merge_checks(parts, labels,
                                 std::to_string(n) + " tokens, relative Frobenius error within 1e-2 per chunk of " +
                                     std::to_string(kReduceChunk) + " tokens, worst " + reference::detail::fmt(worst));
    r.message += sample_note(n, sh_.tokens, "tokens", kCheckReduceEdge);
    return r;
  }

 private:
  UnpermuteShape sh_;
  int device_;
  int sets_ = 1;
  std::vector<DeviceBuffer> y_, row_index_, weights_, residual_;
  DeviceBuffer out_;
  std::vector<int32_t> host_row_index_;  // set 0
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
    c.headline = T == 4096;
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
