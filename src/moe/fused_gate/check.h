// fused_gate's argument rules, shared with the MoE layer (which validates its gate before launching anything).
#pragma once

#include <cstdint>
#include <optional>

#include "common/validate.h"
#include "tessera/moe.h"

namespace tessera::moe::detail {

// The gate's parameters for E experts (every GateParams rule).
void check_gate_params(const tessera::detail::ArgCheck& check, int64_t E, const GateParams& p);
// logits (dtype, rank, strides), bias and the parameters; returns the token count (logits.shape[0]). The errors
// name the arguments as given (the MoE layer calls them router_logits and correction_bias).
int64_t check_gate_inputs(const tessera::detail::ArgCheck& check, const TensorView& logits,
                          const std::optional<TensorView>& bias, const GateParams& p, const char* logits_arg = "logits",
                          const char* bias_arg = "bias");

}  // namespace tessera::moe::detail
