// Internal: a validated decode / append call, in the form the launchers consume.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "attention/check_util.h"
#include "tessera/attention.h"
#include "tessera/tensor.h"

namespace tessera::attention::detail {

// Where the cache rows are. Strides are in bytes for data and in fp16 elements for scales.
struct CacheDesc {
  KVFormat format = KVFormat::kNative;
  bool fp16 = false;          // kNative: true = fp16 rows, false = bf16 rows
  int num_kv_heads = 0;       // HKV
  int head_dim = 0;           // D
  int row_bytes = 0;          // bytes of one (token, head) row of data
  int num_scale_groups = 0;   // NG for integer formats, 0 otherwise
  bool paged = false;
  int page_size = 0;          // paged: power of two in [16, 256]; contiguous: 0
  int log2_page_size = 0;
  int64_t num_pages = 0;      // paged: pages in k/v; contiguous: B
  int64_t capacity = 0;       // tokens one sequence can hold (T_max, or max_pages * page_size)

  const uint8_t* k = nullptr;  // decode reads, append writes (cast away const in append)
  const uint8_t* v = nullptr;
  int64_t stride_outer = 0;    // bytes between sequences (contiguous) or pages (paged)
  int64_t stride_token = 0;    // bytes between tokens (slots)
  int64_t stride_head = 0;     // bytes between KV heads

  const uint16_t* k_scale = nullptr;  // fp16 pairs; integer formats only
  const uint16_t* v_scale = nullptr;
  int64_t scale_stride_outer = 0;     // fp16 elements
  int64_t scale_stride_token = 0;
  int64_t scale_stride_head = 0;

  // Per-channel key formats (kv_key_per_channel(format)): k_scale holds [outer, block, head, 2·D] fp16 (scales,
  // then offsets) with these strides (fp16 elements); the strides above then describe v_scale only.
  bool k_channel = false;  // = kv_key_per_channel(format), read by no kernel: to go with the next GPU pass (it moves
                           // the kernels' parameter offsets)
  int64_t kc_stride_outer = 0;
  int64_t kc_stride_block = 0;
  int64_t kc_stride_head = 0;
  // Their 16-bit key residual [B, kKeyResidualRows, HKV, D] (append_kv only; null for decode), strides in elements.
  const void* k_residual = nullptr;  // in the dtype of the new rows (AppendProblem::fp16)
  int64_t res_stride_b = 0, res_stride_slot = 0, res_stride_head = 0;

  const float* k_fp8_scale = nullptr;  // kFP8: [1] or [HKV]
  const float* v_fp8_scale = nullptr;
  bool fp8_per_head = false;

  const int32_t* block_table = nullptr;  // paged only
  int64_t block_table_stride = 0;        // elements between rows of the block table
  int max_pages = 0;
};

struct DecodeProblem {
  CacheDesc cache;
  int batch = 0;            // B
  int num_q_heads = 0;      // HQ
  int num_new = 1;          // S: new query tokens per sequence (q [B, S, HQ, D]; 1 for q [B, HQ, D])
  bool fp16 = false;        // q/o dtype: fp16 (true) or bf16
  const void* q = nullptr;
  int64_t q_stride_b = 0, q_stride_s = 0, q_stride_h = 0;  // elements
  void* o = nullptr;
  int64_t o_stride_b = 0, o_stride_s = 0, o_stride_h = 0;  // elements
  float* lse = nullptr;                                    // optional
  int64_t lse_stride_b = 0, lse_stride_s = 0, lse_stride_h = 0;
  const int32_t* seqlens = nullptr;
  float softmax_scale = 0.0f;  // resolved (never 0)
  float softcap = 0.0f;
  int window = 0;
  int num_splits = 1;          // resolved
  bool balanced = false;       // params.balance_splits where decode_balanced (config.h) allows it
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

struct AppendProblem {
  CacheDesc cache;
  int batch = 0;
  int num_new = 0;             // S
  bool fp16 = false;           // dtype of k_new / v_new
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t new_stride_b = 0, new_stride_s = 0, new_stride_h = 0;  // elements, shared by k_new and v_new
  int64_t vnew_stride_b = 0, vnew_stride_s = 0, vnew_stride_h = 0;
  const int32_t* positions = nullptr;
};

// Validation (check.cpp). Each throws tessera::Error naming `op` and the argument, before any launch.
// The cache description is shared: decode requires q's dtype for kNative caches, append requires new rows' dtype.
CacheDesc check_cache(const char* op, const KVCache& cache, int64_t batch, int64_t head_dim, DType native_dtype);
// The cache's tensors, by name, as they are present (for the overlap rules), and their device check.
std::vector<Named> cache_tensors(const KVCache& cache);
void check_cache_devices(const ArgCheck& check, const KVCache& cache);
DecodeProblem check_decode(const char* op, const TensorView& q, const KVCache& cache, const TensorView& seqlens,
                           const TensorView& o, const std::optional<TensorView>& lse, const Workspace& workspace,
                           const DecodeParams& params);
// The workspace query: q, cache and params rules only (no device pointers needed), the same split resolution.
std::size_t check_decode_workspace(const char* op, const TensorView& q, const KVCache& cache,
                                   const DecodeParams& params);
AppendProblem check_append(const char* op, const TensorView& k_new, const TensorView& v_new,
                           const TensorView& positions, const KVCache& cache);

// Split selection (config.h) and workspace size: pure functions of shapes, params and the SM count.
// group_size: query rows per KV head (S * G).
int select_num_splits(int64_t batch, int64_t num_kv_heads, int64_t group_size, int64_t capacity, int num_sms,
                      KVFormat format, int64_t head_dim);

// The split workspace (none for one split): fp32 partial outputs [rows, D] and their log2-sum-exps [rows], rows =
// B · splits · S · HQ, laid out as kernel.cuh's DecodeArgs::ws_o says; a balanced plan (config.h) adds one int32 pair
// per sequence (its first slot and split count, for the merge) at decode_workspace_plan_offset.
std::size_t decode_workspace_bytes_for(int64_t batch, int64_t num_new, int64_t num_q_heads, int64_t head_dim,
                                       int num_splits, bool balanced);
inline int64_t decode_workspace_plan_offset(int64_t rows, int64_t head_dim) {
  return (rows * (head_dim + 1) * static_cast<int64_t>(sizeof(float)) + 15) / 16 * 16;
}

void launch_decode(const DecodeProblem& problem, cudaStream_t stream);
void launch_append(const AppendProblem& problem, cudaStream_t stream);

}  // namespace tessera::attention::detail
