// What the two Python modules (tessera._C and tessera._torch_C) share: the option strings, parsed in one place (each
// parser returns the C++ enum or throws tessera::Error naming the op and the argument), the GEMM options, the MoE
// layer's config, the W8A8 operands' views and the translation of tessera's exceptions. Include after pybind11
// (translate_errors uses the Python C API).
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "tessera/attention.h"
#include "tessera/conv.h"
#include "tessera/error.h"
#include "tessera/grouped_gemm.h"
#include "tessera/linear.h"
#include "tessera/moe.h"
#include "tessera/moe_layer.h"
#include "tessera/tensor.h"
#include "tessera/w8a8.h"

namespace tessera::python {

[[noreturn]] inline void fail(const char* op, const char* arg, const std::string& what) {
  throw Error(std::string(op) + ": '" + arg + "' " + what);
}

template <typename E>
struct Choice {
  const char* name;
  E value;
};

// The value named s among `choices`, else Error "'arg' must be 'a', 'b' or 'c', got 's'" (`lead` first in the
// list, e.g. "None" for an argument the torch layer maps from None).
template <typename E, std::size_t N>
E parse_choice(std::string_view s, const char* op, const char* arg, const Choice<E> (&choices)[N],
               const char* lead = nullptr) {
  for (const Choice<E>& c : choices)
    if (s == c.name) return c.value;
  std::string names = lead != nullptr ? std::string(lead) : std::string();
  for (std::size_t i = 0; i < N; ++i) {
    if (!names.empty()) names += i + 1 == N ? " or " : ", ";
    names += std::string("'") + choices[i].name + "'";
  }
  fail(op, arg, "must be " + names + ", got '" + std::string(s) + "'");
}

inline moe::Scoring parse_scoring(std::string_view s, const char* op) {
  static constexpr Choice<moe::Scoring> kChoices[] = {{"sigmoid", moe::Scoring::kSigmoid},
                                                      {"softmax", moe::Scoring::kSoftmax}};
  return parse_choice(s, op, "scoring", kChoices);
}

inline moe::GroupScore parse_group_score(std::string_view s, const char* op) {
  static constexpr Choice<moe::GroupScore> kChoices[] = {{"top2_sum", moe::GroupScore::kTop2Sum},
                                                         {"max", moe::GroupScore::kMax}};
  return parse_choice(s, op, "group_score", kChoices);
}

inline moe::PermuteQuant parse_quant(std::string_view s, const char* op) {
  static constexpr Choice<moe::PermuteQuant> kChoices[] = {{"none", moe::PermuteQuant::kNone},
                                                           {"fp8_blockwise", moe::PermuteQuant::kFP8Blockwise},
                                                           {"fp8_per_tensor", moe::PermuteQuant::kFP8PerTensor}};
  return parse_choice(s, op, "quant", kChoices, "None");
}

inline gemm::ScaleMode parse_scale_mode(std::string_view s, const char* op) {
  static constexpr Choice<gemm::ScaleMode> kChoices[] = {{"per_tensor", gemm::ScaleMode::kPerTensor},
                                                         {"blockwise", gemm::ScaleMode::kBlockwise}};
  return parse_choice(s, op, "scale_mode", kChoices);
}

inline linear::ZeroMode parse_zero_mode(std::string_view s, const char* op) {
  static constexpr Choice<linear::ZeroMode> kChoices[] = {{"offset", linear::ZeroMode::kOffset},
                                                          {"zero_point", linear::ZeroMode::kZeroPoint}};
  return parse_choice(s, op, "zero_mode", kChoices);
}

// A schema / Python int that the C++ API holds as int: out-of-range values are argument errors, never wrapped.
inline int int32_arg(int64_t v, const char* op, const char* arg) {
  if (v < INT32_MIN || v > INT32_MAX) fail(op, arg, "must fit in 32 bits, got " + std::to_string(v));
  return static_cast<int>(v);
}

// The MoE layer's weight format by name, in moe::WeightFormat's order; the names are moe::weight_format_name's (one
// table for both directions).
inline moe::WeightFormat parse_weight_format(std::string_view s, const char* op) {
  using moe::WeightFormat;
  static const Choice<WeightFormat> kChoices[] = {
      {moe::weight_format_name(WeightFormat::kFP8Blockwise), WeightFormat::kFP8Blockwise},
      {moe::weight_format_name(WeightFormat::kFP8PerTensor), WeightFormat::kFP8PerTensor},
      {moe::weight_format_name(WeightFormat::kBF16), WeightFormat::kBF16}};
  return parse_choice(s, op, "format", kChoices);
}

// The MoE layer's constants as both modules receive them (tessera.moe_layer.MoeLayerConfig's fields, in its order):
// the names parsed first, then the ints narrowed; the rules on the values are moe_layer_plan's.
inline moe::MoeLayerConfig moe_layer_config(const char* op, int64_t hidden, int64_t intermediate, int64_t num_experts,
                                            int64_t topk, int64_t num_groups, int64_t topk_groups,
                                            std::string_view scoring, std::string_view group_score, bool renormalize,
                                            double routed_scaling_factor, int64_t num_shared_experts,
                                            double shared_expert_weight, std::string_view format) {
  moe::MoeLayerConfig c;
  c.gate.scoring = parse_scoring(scoring, op);
  c.gate.group_score = parse_group_score(group_score, op);
  c.format = parse_weight_format(format, op);
  c.hidden = hidden;
  c.intermediate = intermediate;
  c.num_experts = int32_arg(num_experts, op, "num_experts");
  c.gate.topk = int32_arg(topk, op, "topk");
  c.gate.num_groups = int32_arg(num_groups, op, "num_groups");
  c.gate.topk_groups = int32_arg(topk_groups, op, "topk_groups");
  c.gate.renormalize = renormalize;
  c.gate.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  c.gate.num_shared_experts = int32_arg(num_shared_experts, op, "num_shared_experts");
  c.gate.shared_expert_weight = static_cast<float>(shared_expert_weight);
  return c;
}

// conv2d's geometry and layouts ('NHWC' | 'NCHW') as both modules receive them.
inline conv::Layout parse_layout(std::string_view s, const char* op, const char* arg) {
  static constexpr Choice<conv::Layout> kChoices[] = {{"NHWC", conv::Layout::kNHWC}, {"NCHW", conv::Layout::kNCHW}};
  return parse_choice(s, op, arg, kChoices);
}

inline conv::Conv2dParams conv2d_params(const char* op, int64_t stride_h, int64_t stride_w, int64_t pad_h,
                                        int64_t pad_w, int64_t dil_h, int64_t dil_w, int64_t groups,
                                        std::string_view x_layout, std::string_view y_layout) {
  conv::Conv2dParams p;
  p.stride_h = stride_h;
  p.stride_w = stride_w;
  p.pad_h = pad_h;
  p.pad_w = pad_w;
  p.dil_h = dil_h;
  p.dil_w = dil_w;
  p.groups = groups;
  p.x_layout = parse_layout(x_layout, op, "x_layout");
  p.y_layout = parse_layout(y_layout, op, "y_layout");
  return p;
}

inline attention::KVFormat parse_kv_format(std::string_view s, const char* op) {
  static constexpr Choice<attention::KVFormat> kChoices[] = {
      {"native", attention::KVFormat::kNative}, {"fp8", attention::KVFormat::kFP8},
      {"int8", attention::KVFormat::kInt8},     {"int4", attention::KVFormat::kInt4},
      {"int4_group32", attention::KVFormat::kInt4Group32},
      {"int8_kchannel", attention::KVFormat::kInt8KChannel},
      {"int4_kchannel", attention::KVFormat::kInt4KChannel}};
  return parse_choice(s, op, "format", kChoices);
}

// Prefill's params as both modules take them (softmax_scale 0: 1/sqrt(D)); pack_gqa stays chosen (-1).
inline attention::PrefillParams prefill_params(float softmax_scale, float softcap, int window, bool causal) {
  attention::PrefillParams params;
  params.softmax_scale = softmax_scale;
  params.softcap = softcap;
  params.window = window;
  params.causal = causal;
  return params;
}

// The grouped GEMM's options from the bindings' expected_m (deprecated and ignored by the GEMM, still passed on).
inline gemm::GroupedGemmOptions gemm_options(int64_t expected_m) {
  gemm::GroupedGemmOptions options;
  options.expected_m = expected_m;
  return options;
}

// A W8A8 parameter plane as the torch layer allocates it, [K / block, ld] with ld >= rows (a multiple of 4), narrowed
// to the [K / block, rows] view linear::Int8BlockTensor holds (rows: the codes' rows). A plane already
// [K / block, rows] (a strided view) passes unchanged; one of another rank, or beside codes of another rank
// (rows < 0), is left to the op's validation, which names it.
inline TensorView narrow_plane(TensorView v, int64_t rows, const char* op, const char* arg) {
  if (v.rank != 2 || rows < 0) return v;
  if (v.shape[1] < rows)
    fail(op, arg,
         "must be [K / block, ld] with ld >= rows (" + std::to_string(rows) + ", the codes' rows), got shape " +
             v.shape_str());
  v.shape[1] = rows;
  return v;
}

// One quantized W8A8 operand from its four tensors (zero and sums optional) and the block, its planes narrowed. Each
// module passes its tensor types and its converters: view_of(t, op, arg) -> TensorView and optional_view_of(t, op,
// arg) -> std::optional<TensorView> (nullopt: not given). `prefix` starts the argument names ("a_" -> "a_codes").
template <typename T, typename OptionalT, typename ViewOf, typename OptionalViewOf>
linear::Int8BlockTensor int8_blocks_of(const char* op, const std::string& prefix, const T& codes, const T& scale,
                                       const OptionalT& zero, const OptionalT& sums, int64_t block, ViewOf view_of,
                                       OptionalViewOf optional_view_of) {
  const std::string codes_arg = prefix + "codes", scale_arg = prefix + "scale", zero_arg = prefix + "zero",
                    sums_arg = prefix + "sums";
  linear::Int8BlockTensor t;
  t.codes = view_of(codes, op, codes_arg.c_str());
  const int64_t rows = t.codes.rank == 2 ? t.codes.shape[0] : -1;
  t.scale = narrow_plane(view_of(scale, op, scale_arg.c_str()), rows, op, scale_arg.c_str());
  if (const std::optional<TensorView> v = optional_view_of(zero, op, zero_arg.c_str()))
    t.zero = narrow_plane(*v, rows, op, zero_arg.c_str());
  if (const std::optional<TensorView> v = optional_view_of(sums, op, sums_arg.c_str()))
    t.sums = narrow_plane(*v, rows, op, sums_arg.c_str());
  t.block = block;
  return t;
}

// The MoE layer's tensors as the op takes them, through each module's converters (as int8_blocks_of):
// view_of, optional_view_of, and fp8_view_of for the fp8 formats' weights (float8_e4m3fn or their uint8 bytes).
template <typename T, typename OptionalT, typename ViewOf, typename OptionalViewOf, typename Fp8ViewOf>
void moe_layer_views(const char* op, moe::WeightFormat format, const T& x, const T& router_logits,
                     const OptionalT& correction_bias, const OptionalT& residual, const OptionalT& num_tokens,
                     const T& w13, const T& w2, const OptionalT& w13_scale, const OptionalT& w2_scale,
                     const OptionalT& a13_scale, const OptionalT& a2_scale, ViewOf view_of,
                     OptionalViewOf optional_view_of, Fp8ViewOf fp8_view_of, moe::MoeLayerInputs& in,
                     moe::MoeLayerWeights& w) {
  in.x = view_of(x, op, "x");
  in.router_logits = view_of(router_logits, op, "router_logits");
  in.correction_bias = optional_view_of(correction_bias, op, "correction_bias");
  in.residual = optional_view_of(residual, op, "residual");
  in.num_tokens = optional_view_of(num_tokens, op, "num_tokens");
  const bool fp8 = format != moe::WeightFormat::kBF16;
  w.w13 = fp8 ? fp8_view_of(w13, op, "w13") : view_of(w13, op, "w13");
  w.w2 = fp8 ? fp8_view_of(w2, op, "w2") : view_of(w2, op, "w2");
  w.w13_scale = optional_view_of(w13_scale, op, "w13_scale");
  w.w2_scale = optional_view_of(w2_scale, op, "w2_scale");
  w.a13_scale = optional_view_of(a13_scale, op, "a13_scale");
  w.a2_scale = optional_view_of(a2_scale, op, "a2_scale");
}

// The exception translator of both modules: tessera::CudaError (CUDA or device failure) -> RuntimeError, any other
// tessera::Error (an argument error) -> ValueError, with tessera's message. Include after pybind11.
inline void translate_errors(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const CudaError& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (const Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  }
}

}  // namespace tessera::python
