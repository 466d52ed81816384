// The option strings of the Python entry points (tessera._C and tessera._torch_C), parsed in one place: each
// returns the C++ enum or throws tessera::Error naming the op and the argument.
#pragma once

#include <string>
#include <string_view>

#include "tessera/attention.h"
#include "tessera/error.h"
#include "tessera/grouped_gemm.h"
#include "tessera/moe.h"

namespace tessera::python {

[[noreturn]] inline void fail(const char* op, const char* arg, const std::string& what) {
  throw Error(std::string(op) + ": '" + arg + "' " + what);
}

inline moe::Scoring parse_scoring(std::string_view s, const char* op) {
  if (s == "sigmoid") return moe::Scoring::kSigmoid;
  if (s == "softmax") return moe::Scoring::kSoftmax;
  fail(op, "scoring", "must be 'sigmoid' or 'softmax', got '" + std::string(s) + "'");
}

inline moe::GroupScore parse_group_score(std::string_view s, const char* op) {
  if (s == "top2_sum") return moe::GroupScore::kTop2Sum;
  if (s == "max") return moe::GroupScore::kMax;
  fail(op, "group_score", "must be 'top2_sum' or 'max', got '" + std::string(s) + "'");
}

inline moe::PermuteQuant parse_quant(std::string_view s, const char* op) {
  if (s == "none") return moe::PermuteQuant::kNone;
  if (s == "fp8_blockwise") return moe::PermuteQuant::kFP8Blockwise;
  if (s == "fp8_per_tensor") return moe::PermuteQuant::kFP8PerTensor;
  fail(op, "quant", "must be None, 'none', 'fp8_blockwise' or 'fp8_per_tensor', got '" + std::string(s) + "'");
}

inline gemm::ScaleMode parse_scale_mode(std::string_view s, const char* op) {
  if (s == "per_tensor") return gemm::ScaleMode::kPerTensor;
  if (s == "blockwise") return gemm::ScaleMode::kBlockwise;
  fail(op, "scale_mode", "must be 'per_tensor' or 'blockwise', got '" + std::string(s) + "'");
}

inline attention::KVFormat parse_kv_format(std::string_view s, const char* op) {
  if (s == "native") return attention::KVFormat::kNative;
  if (s == "fp8") return attention::KVFormat::kFP8;
  if (s == "int8") return attention::KVFormat::kInt8;
  if (s == "int4") return attention::KVFormat::kInt4;
  if (s == "int4_group32") return attention::KVFormat::kInt4Group32;
  fail(op, "format", "must be 'native', 'fp8', 'int8', 'int4' or 'int4_group32', got '" + std::string(s) + "'");
}

}  // namespace tessera::python
