// Internal: a prefill call in the form the launcher consumes (the public op, its validation and its workspace query
// follow; docs/perf/prefill.md). Packed variable-length q [total_q, HQ, D], k and v [total_k, HKV, D], bf16 or fp16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "tessera/tensor.h"

namespace tessera::attention::detail {

struct PrefillProblem {
  int batch = 0;         // B
  int num_q_heads = 0;   // HQ, a multiple of HKV
  int num_kv_heads = 0;  // HKV
  int head_dim = 0;      // 64, 128 or 256
  bool fp16 = false;     // q, k, v and o: fp16 (true) or bf16
  // Strides in elements; the last dim of every tensor is unit-stride, rows 16-byte aligned.
  const void* q = nullptr;
  int64_t q_stride_token = 0, q_stride_head = 0;
  const void* k = nullptr;
  int64_t k_stride_token = 0, k_stride_head = 0;
  const void* v = nullptr;
  int64_t v_stride_token = 0, v_stride_head = 0;
  void* o = nullptr;
  int64_t o_stride_token = 0, o_stride_head = 0;
  float* lse = nullptr;  // optional [total_q, HQ] (natural log)
  int64_t lse_stride_token = 0, lse_stride_head = 0;
  const int32_t* cu_seqlens_q = nullptr;  // [B + 1] on the device
  const int32_t* cu_seqlens_k = nullptr;
  int64_t total_q = 0, total_k = 0;  // rows of q and of k / v (the tensors' extents: TMA reads nothing past them)
  int max_seqlen_q = 0;              // host bound on every sequence's Sq: sizes the grid only
  float softmax_scale = 0.0f;        // resolved (never 0)
  float softcap = 0.0f;
  int window = 0;
  bool causal = false;
};

// The parameters of a prefill call (to become the public PrefillParams with the op).
struct PrefillParams {
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(D)
  float softcap = 0.0f;        // > 0: logits become softcap · tanh(s / softcap)
  int window = 0;              // > 0: a query attends to the keys j with p - j < window only
  bool causal = false;         // bottom-right aligned: query i of Sq attends to keys j <= Sk - Sq + i
};

// Validation (check.cpp): every rule on shapes, dtypes, layouts, memory overlap and params, then the devices; throws
// tessera::Error naming `op` and the argument. q [total_q, HQ, D], k and v [total_k, HKV, D] bf16|fp16 (one dtype),
// unit stride along D, other strides multiples of 16 bytes, 16-byte aligned; D in {64, 128, 256}; HQ a multiple of
// HKV. cu_seqlens_q / cu_seqlens_k int32 [B + 1], contiguous (device values are not read). max_seqlen_q >= 0: the
// host's bound on every sequence's query count (rows past it are not computed). o like q (strides multiples of 4
// bytes); lse fp32 [total_q, HQ] (any strides) or none.
PrefillProblem check_prefill(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, int64_t max_seqlen_q,
                             const TensorView& o, const std::optional<TensorView>& lse, const PrefillParams& params);

void launch_prefill(const PrefillProblem& problem, cudaStream_t stream);

}  // namespace tessera::attention::detail
