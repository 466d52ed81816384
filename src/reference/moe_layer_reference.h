// CPU float64 reference of the whole MoE layer (tessera/moe_layer.h) for a given routing.
//
// The routing (ids, weights) is an input: tests take it from the GPU's fused_gate (itself checked against
// reference::fused_gate), so that the layer's check does not depend on near-ties of the gate.
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/moe_layer.h"

namespace tessera::reference {

struct MoeLayerRefProblem {
  int64_t tokens = 0;        // T
  int64_t hidden = 0;        // H (multiple of 128)
  int64_t intermediate = 0;  // I (multiple of 128)
  int num_experts = 0;       // G = routed + shared experts (rows of w13 / w2)
  int slots = 0;             // ids / weights per token (topk + shared)
  moe::WeightFormat format = moe::WeightFormat::kFP8Blockwise;
};

struct MoeLayerRefInputs {
  std::vector<double> x;         // [T, H]: the bf16 values x holds
  std::vector<int32_t> ids;      // [T, slots]: ids outside [0, G) are dropped copies
  std::vector<double> weights;   // [T, slots]: the routing weights (fp32 values)
  std::vector<double> w13;       // [G, 2I, H]: dequantized weights (codes × scales, exactly)
  std::vector<double> w2;        // [G, H, I]
  double a13_scale = 1.0;        // kFP8PerTensor: the static activation scales
  double a2_scale = 1.0;
  std::vector<double> residual;  // [T, H] or empty
  // [T, slots, 2I] or empty: h of each copy (t, j) as the GPU stored it (its bf16 values; rows of dropped copies
  // unused). When given, kModelStorage takes h from here instead of computing it, so everything after the first GEMM
  // is modeled from the GPU's own h. Why the tests need this: the activation's quantization is a step function, and
  // an h that differs from the float64 h by one bf16 ulp (the FP8 tensor cores' accumulation decides which) moves
  // e4m3 codes by a whole step (2^-4 to 2^-3 of the value) with a probability of a few percent, which puts the layer
  // output ~1-3 % away from a model that derives h itself, by chance, not by a defect (measured on an H200).
  std::vector<double> h;
  // [T, slots, I] or empty: the second GEMM's input of each copy (t, j) as the GPU stored it (e4m3 codes times their
  // scales, or the bf16 values; rows of dropped copies unused). When given, kModelStorage takes it as is and neither
  // computes nor reads h: the second GEMM and the reduce are modeled from the GPU's own activation. The same reason
  // as for h, one step later: an activation within a few fp32 ulps of an e4m3 rounding boundary (the GPU computes
  // silu in fp32 with __expf) may round either way, and with one token whose activation holds an outlier a single
  // such code moved y by 1.9 % (one of ~10^4 stress runs, session 25). The tests check the activation step itself
  // against the GPU's h with a rule that accepts either side of a boundary.
  std::vector<double> act;
  bool keep_h = false;  // fill MoeLayerRef::h (the model's own h, or the given one); not with act
};

enum class MoeLayerRefMode {
  // What the GPU computes, with every stored rounding modeled: x quantized as permute does (fp8 block-wise /
  // per-tensor codes, or bf16 as is), h rounded to bf16, silu(g)·u quantized as the layer does (fp8 codes with
  // their scales, or bf16), each expert output rounded to bf16; sums in float64. The GPU output's remaining
  // error is fp32 accumulation and the last bf16 rounding, plus the rare fp8 code that lands on the other side
  // of a rounding boundary because h or an activation differs in its last fp32 bit.
  kModelStorage = 0,
  // The layer on the same weights without any activation quantization or intermediate rounding (float64
  // throughout): the error a user sees from quantizing activations.
  kExact = 1,
};

struct MoeLayerRef {
  std::vector<double> y;    // [T, H] (before the final bf16 rounding)
  std::vector<double> mag;  // [T, H]: Σ_j |weight| · Σ_i |a_i| |w2_i| — what accumulation errors scale with
  std::vector<double> h;    // [T, slots, 2I] when in.keep_h: h of each routed copy (zeros for dropped copies)
};

MoeLayerRef moe_layer(const MoeLayerRefProblem& problem, const MoeLayerRefInputs& in, MoeLayerRefMode mode,
                      int num_threads = 0);

// e4m3 round to nearest even with saturation to ±448 (the GPU's cvt .satfinite): the fp8 value as a double.
double round_e4m3(double v);
// bf16 round to nearest even, as a double.
double round_bf16(double v);

}  // namespace tessera::reference
