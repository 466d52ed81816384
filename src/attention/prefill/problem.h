// Internal: a prefill call in the form the launcher consumes (the public op, its validation and its workspace query
// follow; docs/perf/prefill.md). Packed variable-length q [total_q, HQ, D], k and v [total_k, HKV, D], bf16 or fp16.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

void launch_prefill(const PrefillProblem& problem, cudaStream_t stream);

}  // namespace tessera::attention::detail
