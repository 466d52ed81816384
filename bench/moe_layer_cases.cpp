// tessera-bench cases for the whole MoE layer (tessera/moe_layer.h): gate → permute (+ quantize) → grouped GEMM (w13)
// → SiLU·mul (+ quantize) → grouped GEMM (w2) → weighted reduce, as one call.
//
//   moe_layer  y [T, H] bf16 = moe::moe_layer(x [T, H] bf16, router_logits [T, E] fp32 (+ correction bias [E] fp32),
//              the weights of G = E + s experts); the plan (moe_layer_plan, max_tokens = T), the workspace and y are
//              made in setup, so the timed call allocates nothing.
// No C++ peer: tessera has no public standalone SiLU·mul op to compose the layer from its public ops in C++. The
// composed layer (tessera's gate / permute / grouped GEMMs / unpermute_reduce with the activation in torch), torch
// eager and torch.compile run in bench/peers/moe_layer.py (bench/compare.py --ops moe_layer) on these case names.
//
// Case names: <model>/T<tokens>/<format>
//   model   dsv3     DeepSeek-V3: E 256 + 1 shared expert (G 257), top-8 among the 4 best of 8 groups (top-2 sum),
//                    sigmoid scores, correction bias, renormalized, routed scale 2.5; H 7168, I 2048
//                    (fp8 weights: 11.3 GB)
//           qwen3    Qwen3-235B-A22B: E 128, top-8, softmax, renormalized; H 4096, I 1536
//           mixtral  Mixtral-8x7B: E 8, top-2, softmax, renormalized; H 4096, I 14336
//   T       1, 16, 128, 512, 4096, 16384
//   format  fp8_blockwise (every model), fp8_per_tensor (qwen3, mixtral), bf16 (qwen3 at T 1, 128, 4096)
// Headline (the main job, few and fast): dsv3/T{1,128,4096}/fp8_blockwise, qwen3/T{16,4096}/fp8_blockwise,
// mixtral/T512/fp8_per_tensor. --all: every case (33).
//
// The floor. Bytes = the weights (codes + scales) of the experts the routing activates + x + logits (+ bias) + y
// written: the distinct expert ids of the gate's output, read back once in setup (outside the timed region); until a
// case's setup has run, its registry entry holds the upper bound min(E, T·k) + s experts (--list shows that), then
// the exact bytes (the report and the JSON read the entry after the run). The table's "% read BW" is then the time
// against the read floor (bytes over the measured read ceiling): the bound for T <= 128 (at T 1 DeepSeek-V3 reads
// 9 experts, 396 MB). FLOPs = 2 · T·(k + s) · (2I·H + H·I) (the two GEMMs over every routed copy): the table's
// TFLOP/s, against the dense FP8 (bf16) GEMM ceiling for the larger T (bench/compare.py --ops moe_layer prints the
// bound of each row and its % of that ceiling).
//
// Inputs, generated on the GPU (device_random.h) except the router logits:
//   weights  one set per case (they exceed twice the L2 by far: every case's activated weights are >= 150 MB).
//            fp8: e4m3 codes from gen::fill_e4m3 (random sign and mantissa, magnitudes roughly uniform in (0, 448],
//            RMS 280.4), scales 2^U(c - 1, c + 1) with c = -log2(280.4 · sqrt(K)) (K = H for w13, I for w2), one per
//            128×128 block (fp8_blockwise: w13_scale [G, 2I/128, H/128], w2_scale [G, H/128, I/128]) or per expert
//            (fp8_per_tensor: [G]): each weight row has RMS ~1/sqrt(K), so h = x·W13ᵀ and the expert outputs stay O(1)
//            (DeepSeek-V3 w13 scales ~2^-14.5 here; a checkpoint's weight_scale_inv is larger, ~1e-4..1e-3, with codes
//            of smaller RMS: the products are alike). bf16: N(0, 1/K).
//   x        bf16 N(0, 1) times 2^U(-1, 1) per token (the magnitudes of RMS-normed activations), in rotating sets
//            (rotating_sets over the bytes one call reads; 1 for every case here).
//   fp8_per_tensor's static activation scales: a13 = amax(x of set 0) / 448 (a calibrated input_scale), a2 = 32 / 448
//            (|silu(g)·u| of these inputs, h ~ N(0, 1.35²), rarely exceeds 32; past it the layer saturates, as the
//            reference does).
//   router logits [T, E] fp32 (+ DeepSeek-V3's correction bias [E]): made on the host from integers (exact in fp32,
//            the same values bit for bit as bench/peers/moe_layer.py's router_inputs), so that both benchmarks route
//            the same case the same way, and one set for all rotating sets (the same routing in every call). From
//            the splitmix64 stream of seed 0x40E1A7E5 (Rng(seed).next() in order, bench/harness.h):
//              draws 0 .. E-1        p[e] = (sum of the four 16-bit fields of d) - 2^17    per-expert popularity
//              draws E .. 2E-1       r[e] = d: the max(1, E/32) experts with the largest r are hot (ties: lower e)
//              draws 2E .. 3E-1      bias[e] = ((d >> 48) - 2^15) · 2^-20                  in [-1/32, 1/32)
//              draw 3E + t·E + e     n[t][e] = (sum of the four 16-bit fields of d) - 2^17
//              logit[t][e] = (7 · n[t][e] + 2 · (p[e] + 2^17 · hot[e])) · 2^-18
//            i.e. N(0, 1.01²) noise (Irwin-Hall, |n| <= 3.5) plus a per-expert bias N(0, 0.29²) plus 1.0 on the hot
//            experts (8 of DeepSeek-V3's 256, 4 of Qwen3's 128, 1 of Mixtral's 8), routed through the layer's own
//            gate: the load is skewed as a trained gate's is (simulated in float64: a hot expert gets ~5× the mean
//            rows with DeepSeek-V3's and Qwen3's gates, ~2.3× with Mixtral's; DeepSeek-V3 at T 4096: every expert
//            active, the largest group ~1060 rows against a mean of 128). A token's logits depend on its index only,
//            so a shorter T routes the first T tokens of a longer one.
//
// --check: y is poisoned (NaN) and set 0 runs; every row of y must be finite (all downloaded), and the rows of a token
// sample are compared with reference::moe_layer (float64, kModelStorage: every stored rounding of the GPU modeled),
// given the routing of a separate fused_gate call on the same logits (setup's, the same deterministic kernel), x's
// bf16 values and the dequantized weights (codes × scales, downloaded) of only the experts the sampled tokens use.
// The reference runs once per such expert on the sampled tokens routed to it (G = 1, one slot) on worker threads, and
// y is the float64 sum of those parts (the layer is a sum over copies; sums in float64 either way), so only one
// expert's float64 weights (352 MB for DeepSeek-V3, 1.4 GB for Mixtral) is held per thread.
// The sample: the first and the last token, then tokens in a seeded random order, each taken when the experts it adds
// keep the dequantized weights within kCheckWeights elements and its copies the reference's multiply-adds within
// kCheckMacs per pass, up to kCheckMaxTokens tokens (a DeepSeek-V3 token uses 9 experts of 44M weights each; the
// headline cases sample about: DeepSeek-V3 1 / 4 / 4 tokens over 9 / 27 / 27 experts, Qwen3 12 and 19 tokens over 63
// experts, Mixtral 8 tokens over 6 experts; the message states the sample). It favours tokens whose experts are
// already in the sample, i.e. the hot ones: the large groups.
// Pass: relative Frobenius error of the sampled rows <= 1e-2 (bf16) / 3e-2 (fp8: see frobenius_tol) and every element
// |y - ref| <= 2^-5 · mag + 2^-7 · |ref| (mag: Σ_j |weight| Σ_i |a_i| |w2_i|, the reference's; 2^-5: the grouped GEMM's
// fp8 accumulation bound 2^-6 of reference/gemm_reference.h, doubled for the second rounding of the activations an fp32
// difference in h can flip; 2^-7: the final bf16 rounding, twice). The message adds the error against kExact (the same
// weights, activations not quantized nor rounded): the quantization error a user sees, for information.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/host_numeric.h"
#include "device_random.h"
#include "harness.h"
#include "moe/layer/problem.h"
#include "reference/moe_layer_reference.h"
#include "tessera/moe.h"
#include "tessera/moe_layer.h"

namespace tessera::bench {
namespace {

using moe::WeightFormat;

constexpr const char* kOp = "moe_layer";
// The same layer with the activation forced into the first GEMM's epilogue (moe::detail::ActivationPlacement::kFused;
// bf16 and per-tensor fp8 only), beside moe_layer's own choice under the same case names: both placements measured in
// one run (docs/perf/moe_layer.md, session 26), and --check holds the fused path to the float64 model.
constexpr const char* kFusedOp = "moe_layer_fused_act";
constexpr int64_t kBlock = 128;  // fp8 block-wise scale blocks (and the H / I granularity)

constexpr uint64_t kRouterSeed = 0x40E1A7E5ull;  // bench/peers/moe_layer.py's ROUTER_SEED
constexpr double kE4m3FillRms = 280.4;           // RMS of gen::fill_e4m3's values (its exponent law)
constexpr float kA2Amax = 32.0f;                 // fp8_per_tensor: a2_scale = kA2Amax / 448

// --check
constexpr int64_t kCheckMaxTokens = 64;
constexpr double kCheckWeights = 1.2e9;  // expert weights dequantized to float64 for the reference (elements)
constexpr double kCheckMacs = 3.0e9;     // multiply-adds of one reference pass over the sampled copies
// The relative Frobenius bound of tests/gpu/test_moe_layer.cpp: bf16 1e-2; fp8 3e-2, the FP8 tensor cores' ~14-bit
// accumulation propagated through the layer (that file derives it).
double frobenius_tol(WeightFormat f) { return f == WeightFormat::kBF16 ? 1e-2 : 3e-2; }
constexpr double kAccTol = 0x1p-5;
constexpr double kRelTol = 0x1p-7;
constexpr uint64_t kSampleSeed = 0x5A3D1Eull;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, v);
  return buf;
}

// ============================================================================================================
// models and problems
struct ModelSpec {
  std::string name;
  int64_t hidden = 0, intermediate = 0;
  int num_experts = 0;
  moe::GateParams gate;
  bool correction_bias = false;
};

ModelSpec dsv3() {
  ModelSpec m;
  m.name = "dsv3";
  m.hidden = 7168;
  m.intermediate = 2048;
  m.num_experts = 256;
  m.gate.topk = 8;
  m.gate.num_groups = 8;
  m.gate.topk_groups = 4;
  m.gate.scoring = moe::Scoring::kSigmoid;
  m.gate.group_score = moe::GroupScore::kTop2Sum;
  m.gate.renormalize = true;
  m.gate.routed_scaling_factor = 2.5f;
  m.gate.num_shared_experts = 1;
  m.gate.shared_expert_weight = 1.0f;
  m.correction_bias = true;
  return m;
}

ModelSpec softmax_model(const std::string& name, int64_t hidden, int64_t intermediate, int experts, int topk) {
  ModelSpec m;
  m.name = name;
  m.hidden = hidden;
  m.intermediate = intermediate;
  m.num_experts = experts;
  m.gate.topk = topk;
  m.gate.scoring = moe::Scoring::kSoftmax;
  m.gate.renormalize = true;
  return m;
}

struct Problem {
  ModelSpec m;
  WeightFormat format = WeightFormat::kFP8Blockwise;
  int64_t tokens = 0;

  int64_t h() const { return m.hidden; }
  int64_t i() const { return m.intermediate; }
  int experts() const { return m.num_experts; }
  int shared() const { return m.gate.num_shared_experts; }
  int groups() const { return experts() + shared(); }  // G: rows of w13 / w2
  int slots() const { return m.gate.topk + shared(); }
  bool fp8() const { return format != WeightFormat::kBF16; }
  std::size_t elt() const { return fp8() ? 1 : 2; }
  // Scales of one expert's w13 / w2.
  int64_t w13_scales() const {
    return format == WeightFormat::kFP8Blockwise ? (2 * i() / kBlock) * (h() / kBlock) : fp8() ? 1 : 0;
  }
  int64_t w2_scales() const {
    return format == WeightFormat::kFP8Blockwise ? (h() / kBlock) * (i() / kBlock) : fp8() ? 1 : 0;
  }
  // Weight elements of one expert (w13 + w2) and the bytes one call reads of it.
  double expert_weights() const { return 3.0 * static_cast<double>(h()) * i(); }
  double expert_bytes() const {
    return expert_weights() * static_cast<double>(elt()) + 4.0 * static_cast<double>(w13_scales() + w2_scales());
  }
  double activation_bytes() const {
    const double th = static_cast<double>(tokens) * h();
    return 2.0 * th + 2.0 * th + 4.0 * static_cast<double>(tokens) * experts()  // x, y, logits
           + (m.correction_bias ? 4.0 * experts() : 0.0) + (format == WeightFormat::kFP8PerTensor ? 8.0 : 0.0);
  }
  // Bytes one call must move with `activated` experts activated (see the header comment).
  double bytes(int activated) const { return activated * expert_bytes() + activation_bytes(); }
  // The most experts a call can activate: every routed one a copy can reach, plus the shared ones.
  int activated_upper_bound() const {
    return static_cast<int>(std::min<int64_t>(experts(), tokens * m.gate.topk)) + shared();
  }
  double flops() const { return 2.0 * static_cast<double>(tokens) * slots() * expert_weights(); }
  std::string family() const { return m.name + "/" + moe::weight_format_name(format); }
  std::string name() const { return m.name + "/T" + std::to_string(tokens) + "/" + moe::weight_format_name(format); }
};

// ============================================================================================================
// router inputs (the header comment defines them; bench/peers/moe_layer.py's router_inputs makes the same values)
int64_t lanes_sum(uint64_t d) {
  return static_cast<int64_t>((d & 0xFFFF) + ((d >> 16) & 0xFFFF) + ((d >> 32) & 0xFFFF) + (d >> 48));
}

struct RouterInputs {
  std::vector<float> logits;  // [T, E]
  std::vector<float> bias;    // [E]
  std::vector<int> hot;       // the hot experts
};

RouterInputs router_inputs(int64_t tokens, int experts, uint64_t seed) {
  constexpr int64_t kHalf = int64_t{1} << 17;
  Rng rng(seed);
  RouterInputs out;
  std::vector<int64_t> pop(experts);
  std::vector<uint64_t> rank(experts);
  for (int e = 0; e < experts; ++e) pop[e] = lanes_sum(rng.next()) - kHalf;
  for (int e = 0; e < experts; ++e) rank[e] = rng.next();
  out.bias.resize(experts);
  for (int e = 0; e < experts; ++e)
    out.bias[e] = static_cast<float>(static_cast<int64_t>(rng.next() >> 48) - (int64_t{1} << 15)) * 0x1.0p-20f;
  std::vector<int> order(experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rank[a] > rank[b]; });
  out.hot.assign(order.begin(), order.begin() + std::max(1, experts / 32));
  for (int e : out.hot) pop[e] += kHalf;
  out.logits.resize(static_cast<std::size_t>(tokens) * experts);
  for (int64_t t = 0; t < tokens; ++t)
    for (int e = 0; e < experts; ++e) {
      const int64_t n = lanes_sum(rng.next()) - kHalf;
      out.logits[t * experts + e] = static_cast<float>(7 * n + 2 * pop[e]) * 0x1.0p-18f;  // |.| < 11 · 2^17: exact
    }
  return out;
}

// ============================================================================================================
// --check helpers
const std::array<double, 256>& e4m3_table() {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = host::e4m3_to_f32(static_cast<uint8_t>(b));
    return t;
  }();
  return table;
}

// One expert's weights as stored on the device (set by the format) and the sampled tokens routed to it.
struct ExpertSample {
  int expert = 0;
  std::vector<uint8_t> w13_8, w2_8;     // fp8 codes
  std::vector<uint16_t> w13_16, w2_16;  // bf16
  std::vector<float> w13_s, w2_s;       // the expert's scales (block-wise [rows/128][cols/128], per-tensor [1])
  std::vector<int64_t> rows;            // indices into the token sample
  std::vector<double> weights;          // their gate weights for this expert
};

// W [rows, cols] of one expert in float64: codes × scales, exactly (bf16: its values).
std::vector<double> dequantize(WeightFormat format, const std::vector<uint8_t>& codes,
                               const std::vector<uint16_t>& bf16, const std::vector<float>& scales, int64_t rows,
                               int64_t cols) {
  std::vector<double> w(static_cast<std::size_t>(rows * cols));
  if (format == WeightFormat::kBF16) {
    for (std::size_t k = 0; k < w.size(); ++k) w[k] = host::bf16_to_f32(bf16[k]);
    return w;
  }
  const std::array<double, 256>& lut = e4m3_table();
  if (format == WeightFormat::kFP8PerTensor) {
    const double s = scales[0];
    for (std::size_t k = 0; k < w.size(); ++k) w[k] = lut[codes[k]] * s;
    return w;
  }
  const int64_t col_blocks = cols / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales.data() + (r / kBlock) * col_blocks;
    const uint8_t* c = codes.data() + r * cols;
    double* out = w.data() + r * cols;
    for (int64_t j = 0; j < cols; ++j) out[j] = lut[c[j]] * srow[j / kBlock];
  }
  return w;
}

struct TokenSample {
  std::vector<int64_t> tokens;  // sorted
  std::vector<int> experts;     // the experts they use, ascending
  int64_t copies = 0;
};

// The check's tokens (the header comment states the rule). ids: [T, slots] from the gate; ids outside [0, G) would be
// dropped copies (the gate makes none).
TokenSample sample_tokens(const std::vector<int32_t>& ids, int64_t tokens, int slots, int groups,
                          double weights_per_expert, double macs_per_copy) {
  std::vector<int64_t> order;
  order.push_back(0);
  if (tokens > 1) order.push_back(tokens - 1);
  {
    std::vector<int64_t> rest;
    for (int64_t t = 1; t + 1 < tokens; ++t) rest.push_back(t);
    Rng rng(kSampleSeed);
    for (std::size_t k = rest.size(); k > 1; --k)  // Fisher-Yates
      std::swap(rest[k - 1], rest[static_cast<std::size_t>(rng.next() % k)]);
    order.insert(order.end(), rest.begin(), rest.end());
  }
  TokenSample s;
  std::vector<char> used(groups, 0);
  int num_used = 0;
  for (std::size_t k = 0; k < order.size() && static_cast<int64_t>(s.tokens.size()) < kCheckMaxTokens; ++k) {
    const int64_t t = order[k];
    int fresh = 0, copies = 0;
    for (int j = 0; j < slots; ++j) {
      const int32_t e = ids[t * slots + j];
      if (e < 0 || e >= groups) continue;
      ++copies;
      if (!used[e]) ++fresh;  // a token's ids are distinct
    }
    const bool forced = k < 2;  // the first and the last token
    if (!forced && ((num_used + fresh) * weights_per_expert > kCheckWeights ||
                    static_cast<double>(s.copies + copies) * macs_per_copy > kCheckMacs))
      continue;
    for (int j = 0; j < slots; ++j) {
      const int32_t e = ids[t * slots + j];
      if (e >= 0 && e < groups && !used[e]) used[e] = 1, ++num_used;
    }
    s.tokens.push_back(t);
    s.copies += copies;
  }
  std::sort(s.tokens.begin(), s.tokens.end());
  for (int e = 0; e < groups; ++e)
    if (used[e]) s.experts.push_back(e);
  return s;
}

// ============================================================================================================
// the case
enum Salt : uint64_t { kW13 = 1, kW2, kW13Scale, kW2Scale, kX };

class MoeLayerCase final : public CaseInstance {
 public:
  MoeLayerCase(const DeviceContext& ctx, const Problem& p,
               moe::detail::ActivationPlacement placement = moe::detail::ActivationPlacement::kAuto)
      : p_(p), device_(ctx.device), placement_(placement) {
    const int64_t T = p.tokens, H = p.h();
    const int E = p.experts();
    cudaStream_t stream = ctx.stream;
    moe::MoeLayerConfig config;
    config.hidden = H;
    config.intermediate = p.i();
    config.num_experts = E;
    config.gate = p.m.gate;
    config.format = p.format;
    plan_ = moe::moe_layer_plan(config, T);  // validates the constants before anything is allocated

    make_weights(stream);
    const RouterInputs router = router_inputs(T, E, kRouterSeed);
    logits_ = upload_new(router.logits);
    if (p.m.correction_bias) bias_ = upload_new(router.bias);
    route(stream);

    sets_ = rotating_sets(ctx, activated_ * p.expert_bytes() + 2.0 * T * H + 4.0 * T * E);
    gen::FloatDist xd;
    xd.kind = gen::FloatDist::kNormal;
    xd.stddev = 1.0f;
    xd.row = H;
    xd.log2_mag_lo = -1.0f;
    xd.log2_mag_hi = 1.0f;
    for (int s = 0; s < sets_; ++s) {
      x_.emplace_back(static_cast<std::size_t>(T * H * 2));
      gen::fill_float(x_.back().get(), DType::kBF16, T * H, gen::sub_seed(case_seed(kOp, p.name(), s), kX), xd, stream);
    }
    if (p.format == WeightFormat::kFP8PerTensor) {  // static activation scales: a13 calibrated on set 0's x
      DeviceBuffer amax(sizeof(float));
      gen::amax16(x_[0].as<const uint16_t>(), DType::kBF16, T * H, amax.as<float>(), stream);
      a13_host_ = amax.download<float>(1, stream)[0] / 448.0f;
      a2_host_ = kA2Amax / 448.0f;
      a13_ = upload_new(std::vector<float>{a13_host_});
      a2_ = upload_new(std::vector<float>{a2_host_});
      weights_.a13_scale = TensorView::contiguous(a13_.get(), DType::kFP32, {1}, device_);
      weights_.a2_scale = TensorView::contiguous(a2_.get(), DType::kFP32, {1}, device_);
    }
    y_.allocate(static_cast<std::size_t>(T * H * 2));
    y_view_ = TensorView::contiguous(y_.get(), DType::kBF16, {T, H}, device_);
    workspace_.allocate(plan_.workspace_bytes);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  int num_sets() const override { return sets_; }
  int activated_experts() const { return activated_; }

  void run(cudaStream_t stream, int set) override {
    const Workspace ws{workspace_.get(), plan_.workspace_bytes};
    if (placement_ == moe::detail::ActivationPlacement::kAuto)
      moe::moe_layer(plan_, inputs(set), weights_, y_view_, ws, stream);
    else
      moe::detail::moe_layer_marked(plan_, inputs(set), weights_, y_view_, ws, stream, nullptr, moe::detail::kLayerSteps,
                                    placement_);
  }

  CheckResult check(cudaStream_t stream) override;
  std::string host_detail(cudaStream_t stream,
                          const std::function<double(const std::function<void(int)>&)>& time_calls) override;

 private:
  void make_weights(cudaStream_t stream);
  void route(cudaStream_t stream);
  ExpertSample download_expert(int e, cudaStream_t stream) const;
  std::string step_breakdown(cudaStream_t stream);
  moe::MoeLayerInputs inputs(int set) const {
    moe::MoeLayerInputs in;
    in.x = TensorView::contiguous(x_[set].get(), DType::kBF16, {p_.tokens, p_.h()}, device_);
    in.router_logits = TensorView::contiguous(logits_.get(), DType::kFP32, {p_.tokens, p_.experts()}, device_);
    if (p_.m.correction_bias)
      in.correction_bias = TensorView::contiguous(bias_.get(), DType::kFP32, {p_.experts()}, device_);
    return in;
  }

  Problem p_;
  int device_;
  moe::detail::ActivationPlacement placement_;
  int sets_ = 1;
  moe::MoeLayerPlan plan_;
  DeviceBuffer w13_, w2_, w13_scale_, w2_scale_, a13_, a2_;
  moe::MoeLayerWeights weights_;
  float a13_host_ = 1.0f, a2_host_ = 1.0f;
  DeviceBuffer logits_, bias_;
  std::vector<DeviceBuffer> x_;
  DeviceBuffer y_, workspace_;
  TensorView y_view_;
  // The routing of set 0's logits (setup's fused_gate): [T, slots].
  std::vector<int32_t> host_ids_;
  std::vector<float> host_weights_;
  std::vector<int64_t> rows_per_expert_;  // [G]
  int activated_ = 0;
};

void MoeLayerCase::make_weights(cudaStream_t stream) {
  const int64_t H = p_.h(), I = p_.i();
  const int G = p_.groups();
  const uint64_t seed = case_seed(kOp, p_.family(), 0);  // the same weights for every T of a model and format
  const int64_t n13 = int64_t{G} * 2 * I * H, n2 = int64_t{G} * H * I;
  w13_.allocate(static_cast<std::size_t>(n13) * p_.elt());
  w2_.allocate(static_cast<std::size_t>(n2) * p_.elt());
  const DType wtype = p_.fp8() ? DType::kFP8E4M3 : DType::kBF16;
  if (p_.fp8()) {
    gen::fill_e4m3(w13_.as<uint8_t>(), n13, gen::sub_seed(seed, kW13), stream);
    gen::fill_e4m3(w2_.as<uint8_t>(), n2, gen::sub_seed(seed, kW2), stream);
    const float c13 = static_cast<float>(-std::log2(kE4m3FillRms * std::sqrt(static_cast<double>(H))));
    const float c2 = static_cast<float>(-std::log2(kE4m3FillRms * std::sqrt(static_cast<double>(I))));
    const int64_t s13 = G * p_.w13_scales(), s2 = G * p_.w2_scales();
    w13_scale_.allocate(static_cast<std::size_t>(s13) * 4);
    w2_scale_.allocate(static_cast<std::size_t>(s2) * 4);
    gen::fill_exp2(w13_scale_.as<float>(), s13, gen::sub_seed(seed, kW13Scale), c13 - 1.0f, c13 + 1.0f, stream);
    gen::fill_exp2(w2_scale_.as<float>(), s2, gen::sub_seed(seed, kW2Scale), c2 - 1.0f, c2 + 1.0f, stream);
    if (p_.format == WeightFormat::kFP8Blockwise) {
      weights_.w13_scale =
          TensorView::contiguous(w13_scale_.get(), DType::kFP32, {G, 2 * I / kBlock, H / kBlock}, device_);
      weights_.w2_scale = TensorView::contiguous(w2_scale_.get(), DType::kFP32, {G, H / kBlock, I / kBlock}, device_);
    } else {
      weights_.w13_scale = TensorView::contiguous(w13_scale_.get(), DType::kFP32, {G}, device_);
      weights_.w2_scale = TensorView::contiguous(w2_scale_.get(), DType::kFP32, {G}, device_);
    }
  } else {
    gen::FloatDist d;
    d.kind = gen::FloatDist::kNormal;
    d.stddev = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
    gen::fill_float(w13_.get(), DType::kBF16, n13, gen::sub_seed(seed, kW13), d, stream);
    d.stddev = static_cast<float>(1.0 / std::sqrt(static_cast<double>(I)));
    gen::fill_float(w2_.get(), DType::kBF16, n2, gen::sub_seed(seed, kW2), d, stream);
  }
  weights_.w13 = TensorView::contiguous(w13_.get(), wtype, {G, 2 * I, H}, device_);
  weights_.w2 = TensorView::contiguous(w2_.get(), wtype, {G, H, I}, device_);
}

// The layer's gate on the logits, once, outside the timed region: the activated experts (the floor) and --check's
// routing.
void MoeLayerCase::route(cudaStream_t stream) {
  const int64_t T = p_.tokens;
  const int E = p_.experts(), G = p_.groups(), S = p_.slots();
  DeviceBuffer w(static_cast<std::size_t>(T * S * 4)), ids(static_cast<std::size_t>(T * S * 4));
  std::optional<TensorView> bias;
  if (p_.m.correction_bias) bias = TensorView::contiguous(bias_.get(), DType::kFP32, {E}, device_);
  moe::fused_gate(TensorView::contiguous(logits_.get(), DType::kFP32, {T, E}, device_), bias,
                  TensorView::contiguous(w.get(), DType::kFP32, {T, S}, device_),
                  TensorView::contiguous(ids.get(), DType::kInt32, {T, S}, device_), p_.m.gate, stream);
  host_weights_ = w.download<float>(static_cast<std::size_t>(T * S), stream);
  host_ids_ = ids.download<int32_t>(static_cast<std::size_t>(T * S), stream);
  rows_per_expert_.assign(G, 0);
  for (const int32_t e : host_ids_) {
    if (e < 0 || e >= G)
      throw Error("tessera-bench: moe_layer " + p_.name() + ": the gate returned expert id " + std::to_string(e));
    ++rows_per_expert_[e];
  }
  activated_ = static_cast<int>(
      std::count_if(rows_per_expert_.begin(), rows_per_expert_.end(), [](int64_t r) { return r > 0; }));
}

ExpertSample MoeLayerCase::download_expert(int e, cudaStream_t stream) const {
  const int64_t H = p_.h(), I = p_.i(), n13 = 2 * I * H, n2 = H * I;
  ExpertSample x;
  x.expert = e;
  if (p_.fp8()) {
    x.w13_8 = download_range<uint8_t>(w13_, e * n13, n13, stream);
    x.w2_8 = download_range<uint8_t>(w2_, e * n2, n2, stream);
    x.w13_s = download_range<float>(w13_scale_, e * p_.w13_scales(), p_.w13_scales(), stream);
    x.w2_s = download_range<float>(w2_scale_, e * p_.w2_scales(), p_.w2_scales(), stream);
  } else {
    x.w13_16 = download_range<uint16_t>(w13_, e * n13, n13, stream);
    x.w2_16 = download_range<uint16_t>(w2_, e * n2, n2, stream);
  }
  return x;
}

CheckResult MoeLayerCase::check(cudaStream_t stream) {
  const int64_t T = p_.tokens, H = p_.h(), I = p_.i();
  const int G = p_.groups(), S = p_.slots();
  y_.fill_async(0xFF, stream);  // bf16 NaN
  run(stream, 0);

  // Every row written and finite.
  const std::vector<uint16_t> y = y_.download<uint16_t>(static_cast<std::size_t>(T * H), stream);
  int64_t non_finite = 0, first_bad = -1;
  for (int64_t k = 0; k < T * H; ++k)
    if (!std::isfinite(host::bf16_to_f32(y[k]))) {
      if (first_bad < 0) first_bad = k;
      ++non_finite;
    }

  // The sample, its x rows, and per used expert its weights and the sampled tokens routed to it.
  const TokenSample sample =
      sample_tokens(host_ids_, T, S, G, p_.expert_weights(), p_.expert_weights() /* multiply-adds per copy */);
  const int64_t n = static_cast<int64_t>(sample.tokens.size());
  const std::vector<uint16_t> x16 = download_rows<uint16_t>(x_[0], H, sample.tokens, stream);
  std::vector<ExpertSample> experts;
  std::vector<int> slot_of(G, -1);
  for (int e : sample.experts) {
    slot_of[e] = static_cast<int>(experts.size());
    experts.push_back(download_expert(e, stream));
  }
  for (int64_t i = 0; i < n; ++i)
    for (int j = 0; j < S; ++j) {
      const int64_t k = sample.tokens[i] * S + j;
      ExpertSample& ex = experts[slot_of[host_ids_[k]]];
      ex.rows.push_back(i);
      ex.weights.push_back(host_weights_[k]);
    }

  // The reference per expert (G = 1, one slot) on worker threads; y, mag and the kExact y are sums over experts.
  struct Part {
    std::vector<double> y, mag, exact;  // [rows of the expert][H]
  };
  std::vector<Part> parts(experts.size());
  const double work = 2.0 * static_cast<double>(sample.copies) * p_.expert_weights() +
                      static_cast<double>(experts.size()) * p_.expert_weights();
  parallel_for(static_cast<int64_t>(experts.size()), work, [&](int64_t k) {
    ExpertSample& ex = experts[k];
    const int64_t m = static_cast<int64_t>(ex.rows.size());
    reference::MoeLayerRefProblem rp;
    rp.tokens = m;
    rp.hidden = H;
    rp.intermediate = I;
    rp.num_experts = 1;
    rp.slots = 1;
    rp.format = p_.format;
    reference::MoeLayerRefInputs in;
    in.x.resize(static_cast<std::size_t>(m * H));
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < H; ++c) in.x[r * H + c] = host::bf16_to_f32(x16[ex.rows[r] * H + c]);
    in.ids.assign(static_cast<std::size_t>(m), 0);
    in.weights = ex.weights;
    in.w13 = dequantize(p_.format, ex.w13_8, ex.w13_16, ex.w13_s, 2 * I, H);
    in.w2 = dequantize(p_.format, ex.w2_8, ex.w2_16, ex.w2_s, H, I);
    // the codes are no longer needed
    std::vector<uint8_t>().swap(ex.w13_8);
    std::vector<uint8_t>().swap(ex.w2_8);
    std::vector<uint16_t>().swap(ex.w13_16);
    std::vector<uint16_t>().swap(ex.w2_16);
    in.a13_scale = a13_host_;
    in.a2_scale = a2_host_;
    reference::MoeLayerRef model = reference::moe_layer(rp, in, reference::MoeLayerRefMode::kModelStorage, 1);
    reference::MoeLayerRef exact = reference::moe_layer(rp, in, reference::MoeLayerRefMode::kExact, 1);
    parts[k].y = std::move(model.y);
    parts[k].mag = std::move(model.mag);
    parts[k].exact = std::move(exact.y);
  });
  std::vector<double> ref(static_cast<std::size_t>(n * H), 0.0), mag(ref.size(), 0.0), exact(ref.size(), 0.0);
  for (std::size_t k = 0; k < experts.size(); ++k) {
    const ExpertSample& ex = experts[k];
    for (std::size_t r = 0; r < ex.rows.size(); ++r)
      for (int64_t c = 0; c < H; ++c) {
        const std::size_t dst = static_cast<std::size_t>(ex.rows[r] * H + c), src = r * H + c;
        ref[dst] += parts[k].y[src];
        mag[dst] += parts[k].mag[src];
        exact[dst] += parts[k].exact[src];
      }
  }

  // Compare the sampled rows.
  ErrorSum model_err, exact_err;
  int64_t out_of_bound = 0;
  double worst = 0.0;  // the largest |y - ref| / bound
  std::string first_oob;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < H; ++c) {
      const std::size_t k = static_cast<std::size_t>(i * H + c);
      const double got = host::bf16_to_f32(y[sample.tokens[i] * H + c]);
      model_err.add(got, ref[k]);
      exact_err.add(got, exact[k]);
      if (!std::isfinite(got)) continue;
      const double bound = kAccTol * mag[k] + kRelTol * std::fabs(ref[k]);
      const double ratio = bound > 0 ? std::fabs(got - ref[k]) / bound : (got == ref[k] ? 0.0 : INFINITY);
      worst = std::max(worst, ratio);
      if (ratio > 1.0 && out_of_bound++ == 0)
        first_oob = "token " + std::to_string(sample.tokens[i]) + " column " + std::to_string(c) + ": got " +
                    fmt("%.6g", got) + ", reference " + fmt("%.6g", ref[k]) + ", mag " + fmt("%.4g", mag[k]);
    }
  const double rel = model_err.ref2 > 0 ? std::sqrt(model_err.err2 / model_err.ref2) : std::sqrt(model_err.err2);
  const double rel_exact = exact_err.ref2 > 0 ? std::sqrt(exact_err.err2 / exact_err.ref2) : NAN;

  int64_t largest = 0;
  for (int64_t r : rows_per_expert_) largest = std::max(largest, r);
  const std::string routing = "routing: " + std::to_string(activated_) + " of " + std::to_string(G) +
                              " experts active, the largest group " + std::to_string(largest) + " rows (mean " +
                              fmt("%.1f", static_cast<double>(T) * S / std::max(activated_, 1)) + ")";
  const std::string what =
      std::to_string(n) + " of " + std::to_string(T) + " tokens (the first and the last, then tokens in a seeded " +
      "random order within the budgets: " + std::to_string(sample.experts.size()) + " experts dequantized, " +
      std::to_string(sample.copies) + " copies) x all " + std::to_string(H) + " columns";

  CheckResult r;
  r.compared = model_err.compared;
  r.error = rel;
  r.ok = non_finite == 0 && model_err.non_finite == 0 && model_err.compared > 0 && rel <= frobenius_tol(p_.format) &&
         out_of_bound == 0;
  r.message = routing + "; " + what + ": relative Frobenius error " + fmt("%.3g", rel) +
              " (<= " + fmt("%.0e", frobenius_tol(p_.format)) + ")";
  if (out_of_bound == 0)
    r.message += ", every element within 2^-5 mag + 2^-7 |ref| (worst " + fmt("%.2f", worst) + " of it)";
  else
    r.message += ", " + std::to_string(out_of_bound) + " elements past 2^-5 mag + 2^-7 |ref| (first: " + first_oob +
                 "; worst " + fmt("%.3g", worst) + "x the bound)";
  if (non_finite)
    r.message += "; " + std::to_string(non_finite) + " non-finite elements of y (first: token " +
                 std::to_string(first_bad / H) + " column " + std::to_string(first_bad % H) + ")";
  else
    r.message += "; all " + std::to_string(T) + " rows of y finite";
  r.message += "; info: against kExact (activations not quantized) " + fmt("%.3g", rel_exact);
  r.message += "; " + step_breakdown(stream);
  return r;
}

// The layer's own code path with an event after each step (moe::detail::moe_layer_marked), on set 0, stream mode:
// kBreakdownRuns calls queued back to back after one warm-up (one synchronization at the end, so the GPU does not wait
// for the host between calls), the mean µs of each step, and the share of the four steps around the GEMMs (issue
// target: <= 10 % of the layer). Host work between two steps can still show as a gap where a call is shorter than
// its own host time (T 1).
std::string MoeLayerCase::step_breakdown(cudaStream_t stream) {
  constexpr int kBreakdownRuns = 20;
  struct Events {
    std::vector<cudaEvent_t> e;
    explicit Events(std::size_t n) : e(n, nullptr) {
      for (cudaEvent_t& x : e) TESSERA_CUDA_CHECK(cudaEventCreate(&x));
    }
    ~Events() {
      for (cudaEvent_t x : e)
        if (x) cudaEventDestroy(x);
    }
  } marks(7 * (kBreakdownRuns + 1));
  const moe::MoeLayerInputs in = inputs(0);
  const Workspace ws{workspace_.get(), plan_.workspace_bytes};
  for (int run = 0; run <= kBreakdownRuns; ++run)
    moe::detail::moe_layer_marked(plan_, in, weights_, y_view_, ws, stream, &marks.e[7 * run], moe::detail::kLayerSteps,
                                  placement_);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  double sum[6] = {};
  for (int run = 1; run <= kBreakdownRuns; ++run)
    for (int i = 0; i < 6; ++i) {
      float ms = 0;
      TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, marks.e[7 * run + i], marks.e[7 * run + i + 1]));
      sum[i] += ms * 1000.0 / kBreakdownRuns;
    }
  const double total = sum[0] + sum[1] + sum[2] + sum[3] + sum[4] + sum[5];
  const double glue = sum[0] + sum[1] + sum[3] + sum[5];
  // A fused call (moe_layer_fused_act, or moe_layer's own choice) runs the activation inside the first GEMM: its
  // "SiLU·mul" step is empty and its time is in "GEMM w13".
  return "steps (stream, mean of " + std::to_string(kBreakdownRuns) + " µs): gate " + fmt("%.1f", sum[0]) +
         ", permute " + fmt("%.1f", sum[1]) + ", GEMM w13 " + fmt("%.1f", sum[2]) + ", SiLU·mul " +
         fmt("%.1f", sum[3]) + ", GEMM w2 " + fmt("%.1f", sum[4]) + ", reduce " + fmt("%.1f", sum[5]) +
         "; gate + permute + SiLU·mul + reduce " + fmt("%.1f", 100.0 * glue / total) + " % of " + fmt("%.1f", total);
}

// --host: the layer's host time split by step. The same call stopped after step s (moe_layer_marked's last_step; 0 is
// the checks alone, no launch) is timed for s = 0 … 6; each step's share is the difference of consecutive times.
std::string MoeLayerCase::host_detail(cudaStream_t stream,
                                      const std::function<double(const std::function<void(int)>&)>& time_calls) {
  const Workspace ws{workspace_.get(), plan_.workspace_bytes};
  double upto[moe::detail::kLayerSteps + 1];
  for (int s = 0; s <= moe::detail::kLayerSteps; ++s)
    upto[s] = time_calls([&](int i) {
      moe::detail::moe_layer_marked(plan_, inputs(i % sets_), weights_, y_view_, ws, stream, nullptr, s,
                                    placement_);
    });
  // The checks again with every view labelled device memory (device_verified, as the torch layer labels its
  // tensors): the difference is the driver's pointer queries.
  moe::MoeLayerWeights wv = weights_;
  for (TensorView* t : {&wv.w13, &wv.w2}) t->device_verified = true;
  for (std::optional<TensorView>* t : {&wv.w13_scale, &wv.w2_scale, &wv.a13_scale, &wv.a2_scale})
    if (*t) (*t)->device_verified = true;
  TensorView yv = y_view_;
  yv.device_verified = true;
  const double verified = time_calls([&](int i) {
    moe::MoeLayerInputs in = inputs(i % sets_);
    in.x.device_verified = in.router_logits.device_verified = true;
    if (in.correction_bias) in.correction_bias->device_verified = true;
    moe::detail::moe_layer_marked(plan_, in, wv, yv, ws, stream, nullptr, 0);
  });
  static const char* const kNames[] = {"gate", "permute", "GEMM w13", "SiLU·mul", "GEMM w2", "reduce"};
  std::string out = "host us by step: checks " + fmt("%.2f", upto[0]);
  for (int s = 1; s <= moe::detail::kLayerSteps; ++s)
    out += ", " + std::string(kNames[s - 1]) + " " + fmt("%.2f", upto[s] - upto[s - 1]);
  return out + " (whole call " + fmt("%.2f", upto[moe::detail::kLayerSteps]) + "); checks with device-verified views " +
         fmt("%.2f", verified);
}

// ============================================================================================================
// registration
// A case's registry entry, once setup knows its activated experts: the exact bytes (harness.h: the report and the
// JSON read the CaseSpec after the run).
void set_registered_bytes(const std::string& op, const std::string& name, double bytes) {
  for (CaseSpec& c : case_registry())
    if (c.op == op && c.name == name) c.bytes = bytes;
}

void add_moe_layer_cases(std::vector<CaseSpec>& cases) {
  const ModelSpec deepseek = dsv3();
  const ModelSpec qwen3 = softmax_model("qwen3", 4096, 1536, 128, 8);
  const ModelSpec mixtral = softmax_model("mixtral", 4096, 14336, 8, 2);
  const std::vector<int64_t> all_tokens = {1, 16, 128, 512, 4096, 16384};
  struct Family {
    ModelSpec m;
    WeightFormat format;
    std::vector<int64_t> tokens;
    std::vector<int64_t> headline;  // the tokens of the default suite
  };
  const std::vector<Family> families = {
      {deepseek, WeightFormat::kFP8Blockwise, all_tokens, {1, 128, 4096}},
      {qwen3, WeightFormat::kFP8Blockwise, all_tokens, {16, 4096}},
      {qwen3, WeightFormat::kFP8PerTensor, all_tokens, {}},
      {qwen3, WeightFormat::kBF16, {1, 128, 4096}, {}},
      {mixtral, WeightFormat::kFP8Blockwise, all_tokens, {}},
      {mixtral, WeightFormat::kFP8PerTensor, all_tokens, {512}},
  };
  for (const Family& f : families)
    for (int64_t T : f.tokens) {
      const Problem p{f.m, f.format, T};
      const auto add = [&](const char* op, moe::detail::ActivationPlacement placement, bool headline) {
        CaseSpec c;
        c.op = op;
        c.name = p.name();
        c.headline = headline;
        c.bytes = p.bytes(p.activated_upper_bound());  // until setup has routed the tokens
        c.flops = p.flops();
        c.setup = [p, op, placement](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
          auto inst = std::make_unique<MoeLayerCase>(ctx, p, placement);
          set_registered_bytes(op, p.name(), p.bytes(inst->activated_experts()));
          return inst;
        };
        cases.push_back(std::move(c));
      };
      add(kOp, moe::detail::ActivationPlacement::kAuto,
          std::find(f.headline.begin(), f.headline.end(), T) != f.headline.end());
      if (f.format != WeightFormat::kFP8Blockwise) add(kFusedOp, moe::detail::ActivationPlacement::kFused, false);
    }
}

}  // namespace

TESSERA_BENCH_CASES(add_moe_layer_cases);

}  // namespace tessera::bench
