// Prefill: argument validation and the PrefillProblem the launcher consumes. Every rule runs before any device
// query; the device checks come last so that machines without a GPU can test the others.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/check_util.h"
#include "attention/prefill/problem.h"

namespace tessera::attention::detail {

namespace {

constexpr int64_t kMaxRows = INT32_MAX;      // token indices are int32 on the device
constexpr int64_t kMaxGridDim = 65535;       // heads and sequences are grid dims y and z

// q, k, v: [rows, heads, D] (packed) or [B, rows, heads, D] (batch) of one dtype, rows as whole 16-byte vectors
// (TMA), strides within the map's limit.
void check_rows(const ArgCheck& check, const TensorView& t, const char* arg, int rank, const char* what) {
  if (t.rank != rank) check.fail(arg, "must have rank " + str(rank) + " (" + what + "), got rank " + str(t.rank));
  check_layout(check, t, arg, true, kVectorBytes, kVectorBytes);
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  for (int d = 0; d < rank - 1; ++d)
    if (t.strides[d] * elem >= kMaxTmaStrideBytes)
      check.fail(arg, "must have strides below 2^40 bytes, got " + str(t.strides[d]) + " in dim " + str(d));
  if (t.shape[rank - 3] > kMaxRows)
    check.fail(arg, "must have at most 2^31 - 1 rows, got " + str(t.shape[rank - 3]));
}

// q [total_q, HQ, D] (rank 3) or [B, Sq, HQ, D] (rank 4) of a 16-bit type: its rows, heads and head dim.
struct QShape {
  int64_t rows, heads, dim;
};
QShape check_q(const ArgCheck& check, const TensorView& q, int rank) {
  const int t0 = rank - 3;
  check.dtype(q, "q", {DType::kBF16, DType::kFP16});
  check_rows(check, q, "q", rank, rank == 3 ? "[total_q, HQ, D]" : "[B, Sq, HQ, D]");
  const QShape s{q.shape[t0], q.shape[t0 + 1], q.shape[t0 + 2]};
  if (!supported_head_dim(s.dim))
    check.fail("q", "must have head dim D (dim " + str(t0 + 2) + ") of 64, 128 or 256, got " + str(s.dim));
  if (s.heads < 1 || s.heads > kMaxGridDim)
    check.fail("q", "must have 1 to 65535 heads (dim " + str(t0 + 1) + "), got " + str(s.heads));
  return s;
}

// cu_seqlens_q int32 [B + 1] and the host bound max_seqlen_q: B.
int64_t check_cu_seqlens_q(const ArgCheck& check, const TensorView& cu_q_in, int64_t max_seqlen_q) {
  const int64_t entries = cu_q_in.rank == 1 ? cu_q_in.shape[0] : -1;
  if (entries < 1) check.fail("cu_seqlens_q", "must be int32 [B + 1] with B >= 0, got shape " + cu_q_in.shape_str());
  check_lengths(check, normalized(cu_q_in), "cu_seqlens_q", entries, "[B + 1]");
  const int64_t B = entries - 1;
  if (B > kMaxGridDim) check.fail("cu_seqlens_q", "must describe at most 65535 sequences, got " + str(B));
  if (max_seqlen_q < 0) check.fail("max_seqlen_q", "must be >= 0, got " + str(max_seqlen_q));
  return B;
}

// o like q ([total_q, HQ, D] packed or [B, Sq, HQ, D]), lse fp32 [total_q, HQ] or [B, Sq, HQ]; normalized copies out.
void check_outputs(const ArgCheck& check, const TensorView& q, const TensorView& o_in,
                   const std::optional<TensorView>& lse_in, bool packed, int64_t B, int64_t rows_q, int64_t HQ,
                   int64_t D, TensorView& o, std::optional<TensorView>& lse) {
  o = normalized(o_in);
  check.same_dtype(q, "q", o, "o");
  if (packed)
    check_shape(check, o, "o", {rows_q, HQ, D}, "[total_q, HQ, D] (the shape of q)");
  else
    check_shape(check, o, "o", {B, rows_q, HQ, D}, "[B, Sq, HQ, D] (the shape of q)");
  check_layout(check, o, "o", true, 4, 4);  // written as pairs of 16-bit values
  check.no_self_overlap(o, "o");
  if (lse_in) {
    lse = normalized(*lse_in);
    check.dtype(*lse, "lse", {DType::kFP32});
    if (packed)
      check_shape(check, *lse, "lse", {rows_q, HQ}, "[total_q, HQ]");
    else
      check_shape(check, *lse, "lse", {B, rows_q, HQ}, "[B, Sq, HQ]");
    check_layout(check, *lse, "lse", false, 0, 4);
    check.no_self_overlap(*lse, "lse");
  }
}

void check_params(const ArgCheck& check, const PrefillParams& params, int64_t group) {
  // The kernel keeps the row max of the raw logits and scales it: a negative scale would pick the minimum.
  if (!std::isfinite(params.softmax_scale) || params.softmax_scale < 0.0f)
    check.fail("params.softmax_scale", "must be finite and >= 0 (0 selects 1/sqrt(D)), got " +
                                           std::to_string(params.softmax_scale));
  check_softcap_window(check, params.softcap, params.window);
  if (params.pack_gqa < -1 || params.pack_gqa > 1)
    check.fail("params.pack_gqa", "must be -1 (chosen), 0 or 1, got " + str(params.pack_gqa));
  if (params.pack_gqa == 1 && group > kPrefillMaxPackedGroup)
    check.fail("params.pack_gqa", "= 1 needs HQ / HKV <= " + str(kPrefillMaxPackedGroup) + ", got " + str(group));
}

// The rules every form ends with: outputs apart from the inputs and each other, params, then the devices.
void check_memory_params_devices(const ArgCheck& check, const std::vector<Named>& inputs, const TensorView& o_in,
                                 const std::optional<TensorView>& lse_in, const PrefillParams& params,
                                 int64_t group) {
  std::vector<Named> outputs = {{&o_in, "o"}};
  if (lse_in) outputs.push_back({&*lse_in, "lse"});
  check_outputs_apart(check, inputs, outputs);
  check_params(check, params, group);
  // Device checks last: everything above runs without a GPU.
  for (const Named& t : inputs) check.on_current_device(*t.t, t.name);
  for (const Named& t : outputs) check.on_current_device(*t.t, t.name);
}

// A view's data and its (token, head, batch) strides in elements (t0: the token dim; batch stride only if t0 > 0).
template <typename T>
void take(const TensorView& t, int t0, T*& data, int64_t& stride_token, int64_t& stride_head, int64_t& stride_batch) {
  data = static_cast<T*>(t.data);
  stride_token = t.strides[t0];
  stride_head = t.strides[t0 + 1];
  if (t0 > 0) stride_batch = t.strides[0];
}

// The fields every form shares: heads, dims, dtype, q / o / lse, resolved params.
void fill_common(PrefillProblem& p, const TensorView& q, const TensorView& o, const std::optional<TensorView>& lse,
                 int t0, int64_t B, int64_t HQ, int64_t HKV, int64_t D, const PrefillParams& params) {
  p.batch = static_cast<int>(B);
  p.num_q_heads = static_cast<int>(HQ);
  p.num_kv_heads = static_cast<int>(HKV);
  p.head_dim = static_cast<int>(D);
  p.fp16 = q.dtype == DType::kFP16;
  take(q, t0, p.q, p.q_stride_token, p.q_stride_head, p.q_stride_batch);
  take(o, t0, p.o, p.o_stride_token, p.o_stride_head, p.o_stride_batch);
  if (lse) take(*lse, t0, p.lse, p.lse_stride_token, p.lse_stride_head, p.lse_stride_batch);
  p.softmax_scale = params.softmax_scale != 0.0f ? params.softmax_scale
                                                 : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  p.softcap = params.softcap;
  p.window = params.window;
  p.causal = params.causal;
  p.pack_gqa = params.pack_gqa;
}

}  // namespace

PrefillProblem check_prefill(const char* op, const TensorView& q_in, const TensorView& k_in, const TensorView& v_in,
                             const std::optional<TensorView>& cu_q_in, const std::optional<TensorView>& cu_k_in,
                             int64_t max_seqlen_q, const TensorView& o_in, const std::optional<TensorView>& lse_in,
                             const PrefillParams& params) {
  const ArgCheck check(op);
  const bool packed = cu_q_in.has_value() || cu_k_in.has_value();
  if (packed && !cu_q_in) check.fail("cu_seqlens_q", "must be given with cu_seqlens_k");
  if (packed && !cu_k_in) check.fail("cu_seqlens_k", "must be given with cu_seqlens_q");
  const int rank = packed ? 3 : 4, t0 = rank - 3;  // t0: the token dim
  const TensorView q = normalized(q_in), k = normalized(k_in), v = normalized(v_in);

  // ---- q, k, v
  const QShape qs = check_q(check, q, rank);
  const int64_t rows_q = qs.rows, HQ = qs.heads, D = qs.dim;
  check.same_dtype(q, "q", k, "k");
  check_rows(check, k, "k", rank, packed ? "[total_k, HKV, D]" : "[B, Sk, HKV, D]");
  const int64_t rows_k = k.shape[t0], HKV = k.shape[t0 + 1];
  if (k.shape[t0 + 2] != D)
    check.fail("k", "must have the head dim of q (" + str(D) + "), got " + str(k.shape[t0 + 2]));
  if (HKV < 1 || HQ % HKV != 0)
    check.fail("k", "must have a number of heads (dim " + str(t0 + 1) + ") that divides q's " + str(HQ) + ", got " +
                        str(HKV));
  check.same_dtype(q, "q", v, "v");
  int64_t B = 0;
  if (packed) {
    check_shape(check, v, "v", {rows_k, HKV, D}, "[total_k, HKV, D] (the shape of k)");
  } else {
    B = q.shape[0];
    if (k.shape[0] != B) check.fail("k", "must have q's batch size " + str(B) + " (dim 0), got " + str(k.shape[0]));
    check_shape(check, v, "v", {B, rows_k, HKV, D}, "[B, Sk, HKV, D] (the shape of k)");
  }
  check_rows(check, v, "v", rank, packed ? "[total_k, HKV, D]" : "[B, Sk, HKV, D]");

  // ---- lengths
  TensorView cu_q{}, cu_k{};
  if (packed) {
    cu_q = normalized(*cu_q_in);
    cu_k = normalized(*cu_k_in);
    B = check_cu_seqlens_q(check, *cu_q_in, max_seqlen_q);
    check_lengths(check, cu_k, "cu_seqlens_k", B + 1, "[B + 1]");
  } else {
    if (B > kMaxGridDim) check.fail("q", "must have a batch of at most 65535 sequences, got " + str(B));
    if (params.causal && rows_q > rows_k)
      check.fail("q", "must have Sq <= Sk when causal (bottom-right aligned: early queries would see no key), got "
                      "Sq " + str(rows_q) + " > Sk " + str(rows_k));
  }

  // ---- outputs
  TensorView o;
  std::optional<TensorView> lse;
  check_outputs(check, q, o_in, lse_in, packed, B, rows_q, HQ, D, o, lse);
  std::vector<Named> inputs = {{&q_in, "q"}, {&k_in, "k"}, {&v_in, "v"}};
  if (packed) {
    inputs.push_back({&*cu_q_in, "cu_seqlens_q"});
    inputs.push_back({&*cu_k_in, "cu_seqlens_k"});
  }
  check_memory_params_devices(check, inputs, o_in, lse_in, params, HQ / HKV);

  PrefillProblem p;
  fill_common(p, q, o, lse, t0, B, HQ, HKV, D, params);
  take(k, t0, p.k, p.k_stride_token, p.k_stride_head, p.k_stride_batch);
  take(v, t0, p.v, p.v_stride_token, p.v_stride_head, p.v_stride_batch);
  if (packed) {
    p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.data);
    p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.data);
  }
  p.total_q = rows_q;
  p.total_k = rows_k;
  // No sequence has more queries than q has rows; the plain batch has exactly Sq.
  p.max_seqlen_q = static_cast<int>(packed && max_seqlen_q < rows_q ? max_seqlen_q : rows_q);
  return p;
}

PrefillProblem check_prefill_cache(const char* op, const TensorView& q_in, const TensorView& cu_q_in,
                                   int64_t max_seqlen_q, const KVCache& cache, const TensorView& seqlens_in,
                                   const TensorView& o_in, const std::optional<TensorView>& lse_in,
                                   const PrefillParams& params) {
  const ArgCheck check(op);
  const TensorView q = normalized(q_in);

  // ---- q, lengths
  const QShape qs = check_q(check, q, 3);
  const int64_t rows_q = qs.rows, HQ = qs.heads, D = qs.dim;
  const TensorView cu_q = normalized(cu_q_in);
  const int64_t B = check_cu_seqlens_q(check, cu_q_in, max_seqlen_q);

  // ---- the cache (decode's rules), then what prefill reads of it
  const CacheDesc c = check_cache(op, cache, B, D, q.dtype);
  const int64_t HKV = c.num_kv_heads;
  if (HQ % HKV != 0)
    check.fail("q", "must have a number of heads (dim 1, " + str(HQ) + ") that is a multiple of the cache's KV "
                    "heads (" + str(HKV) + ", cache.k dim 2)");
  if (c.capacity > kMaxRows) check.fail("cache.k", "must hold at most 2^31 - 1 tokens per sequence");
  // The kernel's tensor maps span the cache: a contiguous cache of T_max 0 has nothing to map (a paged one has at
  // least one page and one block-table column: decode's rules). Only where something would be launched: a batch of
  // no sequences or no queries returns before any launch.
  if (!c.paged && c.capacity == 0 && B > 0 && rows_q > 0)
    check.fail("cache.k", "must hold at least one token per sequence (T_max, dim 1) for prefill, got shape " +
                              cache.k.shape_str());
  const TensorView seqlens = normalized(seqlens_in);
  check_lengths(check, seqlens, "cache_seqlens", B);

  // ---- outputs, memory, params
  TensorView o;
  std::optional<TensorView> lse;
  check_outputs(check, q, o_in, lse_in, true, B, rows_q, HQ, D, o, lse);
  std::vector<Named> inputs = cache_tensors(cache);
  inputs.push_back({&q_in, "q"});
  inputs.push_back({&cu_q_in, "cu_seqlens_q"});
  inputs.push_back({&seqlens_in, "cache_seqlens"});
  check_memory_params_devices(check, inputs, o_in, lse_in, params, HQ / HKV);

  PrefillProblem p;
  fill_common(p, q, o, lse, 0, B, HQ, HKV, D, params);
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.data);
  p.cache_seqlens = static_cast<const int32_t*>(seqlens.data);
  p.cache = c;
  p.total_q = rows_q;
  p.total_k = c.capacity;
  p.max_seqlen_q = static_cast<int>(max_seqlen_q < rows_q ? max_seqlen_q : rows_q);
  return p;
}

}  // namespace tessera::attention::detail
