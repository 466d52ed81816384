// Attention decode and append_kv: argument validation, and the DecodeProblem / AppendProblem the launchers
// consume. Every rule runs before any device query; the device checks come last so that machines without a GPU
// can test the others. The split count is chosen after them, since it needs the SM count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "attention/check_util.h"
#include "attention/decode/config.h"
#include "attention/decode/problem.h"
#include "common/device_info.h"
#include "common/validate.h"

namespace tessera::attention {

const char* kv_format_name(KVFormat format) {
  switch (format) {
    case KVFormat::kNative: return "native";
    case KVFormat::kFP8: return "fp8";
    case KVFormat::kInt8: return "int8";
    case KVFormat::kInt4: return "int4";
    case KVFormat::kInt4Group32: return "int4_group32";
    case KVFormat::kInt8KChannel: return "int8_kchannel";
    case KVFormat::kInt4KChannel: return "int4_kchannel";
  }
  return "unknown";
}

namespace detail {
namespace {

using tessera::detail::ArgCheck;

constexpr int64_t kMaxPositions = int64_t{1} << 31;  // token positions are int32 on the device
constexpr int64_t kMaxInt = INT32_MAX;               // counts the problem structs hold as int
constexpr int64_t kMinPageSize = 16, kMaxPageSize = 256;
constexpr int64_t kMaxGroupSize = 256;       // query heads per KV head
constexpr int64_t kMinTokensPerSplit = 16;  // a split over fewer tokens costs more in merging than it saves

bool is_int4(KVFormat f) {
  return f == KVFormat::kInt4 || f == KVFormat::kInt4Group32 || f == KVFormat::kInt4KChannel;
}
bool is_integer(KVFormat f) { return f == KVFormat::kInt8 || f == KVFormat::kInt8KChannel || is_int4(f); }

// Per-channel key formats: k_scale holds (scale, offset) per channel over blocks of kKeyBlock slots, v_scale one
// pair per row as kInt8 / kInt4 do; the two have different shapes, so each gets its own strides.
void check_channel_scales(const ArgCheck& check, const TensorView& ksv, const TensorView& vsv, const KVCache& cache,
                          const TensorView& k, int64_t head_dim, CacheDesc& c) {
  const char* ks = "cache.k_scale";
  const char* vs = "cache.v_scale";
  check.dtype(ksv, ks, {DType::kFP16});
  check_shape(check, ksv, ks, {k.shape[0], k.shape[1] / kKeyBlock, k.shape[2], 2 * head_dim},
              "[dims 0..1 of cache.k with dim 1 / 32, HKV, 2 * D] (fp16 per-channel scales, then offsets, per "
              "32-token key block)");
  check_layout(check, ksv, ks, true, kVectorBytes, kVectorBytes);  // a block's 2·D values move as 16-byte vectors
  check.dtype(vsv, vs, {DType::kFP16});
  check_shape(check, vsv, vs, {k.shape[0], k.shape[1], k.shape[2], 2},
              "[dims 0..2 of cache.k, 2] (fp16 (scale, offset) pairs of the value rows)");
  check_layout(check, vsv, vs, true, 4, 4);  // pairs move as 4-byte words
  // Different shapes: no fused (interleaved) layout to allow, the extents must be apart.
  check.no_overlap(ksv, ks, vsv, vs);
  for (const Named& s : {Named{&ksv, ks}, Named{&vsv, vs}}) {
    check.no_overlap(cache.k, "cache.k", *s.t, s.name);
    check.no_overlap(cache.v, "cache.v", *s.t, s.name);
  }
  c.k_channel = true;
  c.num_scale_groups = 1;
  c.k_scale = static_cast<const uint16_t*>(ksv.data);
  c.v_scale = static_cast<const uint16_t*>(vsv.data);
  c.kc_stride_outer = ksv.strides[0];
  c.kc_stride_block = ksv.strides[1];
  c.kc_stride_head = ksv.strides[2];
  c.scale_stride_outer = vsv.strides[0];
  c.scale_stride_token = vsv.strides[1];
  c.scale_stride_head = vsv.strides[2];
}

void check_scales(const ArgCheck& check, const KVCache& cache, const TensorView& k, int64_t head_dim, CacheDesc& c) {
  const char* ks = "cache.k_scale";
  const char* vs = "cache.v_scale";
  const KVFormat format = cache.format;
  if (format == KVFormat::kNative) {
    if (cache.k_scale) check.fail(ks, "must be absent for kNative caches (rows are not quantized)");
    if (cache.v_scale) check.fail(vs, "must be absent for kNative caches (rows are not quantized)");
    return;
  }
  if (!cache.k_scale || !cache.v_scale)
    check.fail(cache.k_scale ? vs : ks, std::string("is required for ") + kv_format_name(format) + " caches");
  const TensorView ksv = normalized(*cache.k_scale), vsv = normalized(*cache.v_scale);
  const int64_t hkv = c.num_kv_heads;

  if (format == KVFormat::kFP8) {
    for (const Named& s : {Named{&ksv, ks}, Named{&vsv, vs}}) {
      check.dtype(*s.t, s.name, {DType::kFP32});
      check.rank(*s.t, s.name, 1);
      if (s.t->shape[0] != 1 && s.t->shape[0] != hkv)
        check.fail(s.name, "must have shape [1] (per tensor) or [HKV] = [" + str(hkv) + "] (per KV head), got " +
                               s.t->shape_str());
      check.contiguous(*s.t, s.name);
      check_layout(check, *s.t, s.name, true, 0, 4);
    }
    // One flag serves both: the kernels index k's and v's scales alike.
    if (vsv.shape[0] != ksv.shape[0])
      check.fail(vs, "must have the shape of 'cache.k_scale' " + ksv.shape_str() + " (both per tensor or both per "
                     "KV head), got " + vsv.shape_str());
    c.k_fp8_scale = static_cast<const float*>(ksv.data);
    c.v_fp8_scale = static_cast<const float*>(vsv.data);
    c.fp8_per_head = ksv.shape[0] != 1;
    // Read-only in both ops, so k's and v's scales may share memory; the data may not.
    for (const Named& s : {Named{&ksv, ks}, Named{&vsv, vs}}) {
      check.no_overlap(cache.k, "cache.k", *s.t, s.name);
      check.no_overlap(cache.v, "cache.v", *s.t, s.name);
    }
    return;
  }

  if (kv_key_per_channel(format)) {
    check_channel_scales(check, ksv, vsv, cache, k, head_dim, c);
    return;
  }

  const int64_t ng = format == KVFormat::kInt4Group32 ? head_dim / kInt4GroupSize : 1;
  // NG is 1, or D / 32 with D in {64, 128, 256}: literals, so that a passing check builds no string.
  const char* what = ng == 1   ? "[dims 0..2 of cache.k, 2 * NG] (fp16 (scale, offset) pairs, NG = 1)"
                     : ng == 2 ? "[dims 0..2 of cache.k, 2 * NG] (fp16 (scale, offset) pairs, NG = 2)"
                     : ng == 4 ? "[dims 0..2 of cache.k, 2 * NG] (fp16 (scale, offset) pairs, NG = 4)"
                               : "[dims 0..2 of cache.k, 2 * NG] (fp16 (scale, offset) pairs, NG = 8)";
  for (const Named& s : {Named{&ksv, ks}, Named{&vsv, vs}}) {
    check.dtype(*s.t, s.name, {DType::kFP16});
    check_shape(check, *s.t, s.name, {k.shape[0], k.shape[1], k.shape[2], 2 * ng}, what);
    check_layout(check, *s.t, s.name, true, 4, 4);  // pairs move as 4-byte words
  }
  for (int d = 0; d < 4; ++d)
    if (vsv.strides[d] != ksv.strides[d])
      check.fail(vs, "must have the strides of 'cache.k_scale' " + strides_str(ksv) +
                         " (one set of strides addresses both), got " + strides_str(vsv));
  if (!disjoint_twins(ksv, vsv)) check.fail(vs, "must not overlap 'cache.k_scale' in memory");
  for (const Named& s : {Named{&ksv, ks}, Named{&vsv, vs}}) {
    check.no_overlap(cache.k, "cache.k", *s.t, s.name);
    check.no_overlap(cache.v, "cache.v", *s.t, s.name);
  }
  c.num_scale_groups = static_cast<int>(ng);
  c.k_scale = static_cast<const uint16_t*>(ksv.data);
  c.v_scale = static_cast<const uint16_t*>(vsv.data);
  c.scale_stride_outer = ksv.strides[0];
  c.scale_stride_token = ksv.strides[1];
  c.scale_stride_head = ksv.strides[2];
}

}  // namespace

// The cache's tensors, by name, as they are present.
std::vector<Named> cache_tensors(const KVCache& cache) {
  std::vector<Named> v;
  v.reserve(8);  // these five and what the callers add (decode two, prefill three): one allocation
  v.push_back({&cache.k, "cache.k"});
  v.push_back({&cache.v, "cache.v"});
  if (cache.k_scale) v.push_back({&*cache.k_scale, "cache.k_scale"});
  if (cache.v_scale) v.push_back({&*cache.v_scale, "cache.v_scale"});
  if (cache.block_table) v.push_back({&*cache.block_table, "cache.block_table"});
  return v;
}

void check_cache_devices(const ArgCheck& check, const KVCache& cache) {
  for (const Named& t : cache_tensors(cache)) check.on_current_device(*t.t, t.name);
}

CacheDesc check_cache(const char* op, const KVCache& cache, int64_t batch, int64_t head_dim, DType native_dtype) {
  const ArgCheck check(op);
  const KVFormat format = cache.format;
  if (static_cast<int>(format) < 0 || static_cast<int>(format) > static_cast<int>(KVFormat::kInt4KChannel))
    check.fail("cache.format", "must be a KVFormat (0..6), got " + str(static_cast<int>(format)));
  if (!supported_head_dim(head_dim))  // the callers reject it first, naming their own argument
    check.fail("cache.k", "cannot hold head dim " + str(head_dim) + " (D must be 64, 128 or 256)");

  // ---- data: dtype, shape, layout
  const TensorView k = normalized(cache.k), v = normalized(cache.v);
  switch (format) {
    case KVFormat::kNative:
      check.dtype(k, "cache.k", {DType::kBF16, DType::kFP16});
      if (k.dtype != native_dtype)
        check.fail("cache.k", std::string("must have dtype ") + dtype_name(native_dtype) +
                                  " (kNative caches hold rows of the dtype of q / k_new), got " + dtype_name(k.dtype));
      break;
    case KVFormat::kFP8: check.dtype(k, "cache.k", {DType::kFP8E4M3}); break;
    case KVFormat::kInt8:
    case KVFormat::kInt8KChannel: check.dtype(k, "cache.k", {DType::kUInt8}); break;
    default: check.dtype(k, "cache.k", {DType::kUInt8, DType::kInt4x2}); break;
  }
  check.rank(k, "cache.k", 4);
  check_layout(check, k, "cache.k", true, kVectorBytes, kVectorBytes);
  const int64_t elem = static_cast<int64_t>(dtype_size(k.dtype));
  check.dim(k, "cache.k", 3, is_int4(format) ? head_dim / 2 : head_dim,
            is_int4(format) ? "D/2 bytes of 4-bit pairs" : "D, the head dim");
  const int64_t hkv = k.shape[2];
  if (hkv < 1 || hkv > kMaxInt)
    check.fail("cache.k", "must have 1 to " + str(kMaxInt) + " KV heads in dim 2, got shape " + k.shape_str());

  CacheDesc c;
  c.format = format;
  c.fp16 = format == KVFormat::kNative && k.dtype == DType::kFP16;
  c.num_kv_heads = static_cast<int>(hkv);
  c.head_dim = static_cast<int>(head_dim);
  c.row_bytes = static_cast<int>(k.shape[3] * elem);

  // ---- paged (block table given) or contiguous
  if (cache.block_table) {
    const char* arg = "cache.block_table";
    const TensorView bt = normalized(*cache.block_table);
    check.dtype(bt, arg, {DType::kInt32});
    check.rank(bt, arg, 2);
    check.dim(bt, arg, 0, batch, "B, one row of pages per sequence");
    check_layout(check, bt, arg, true, 0, 4);
    const int64_t max_pages = bt.shape[1];
    if (max_pages < 1) check.fail(arg, "must have at least one page per sequence (dim 1), got shape " + bt.shape_str());
    if (bt.strides[0] <= 0) check.fail(arg, "must have a positive row stride, got " + str(bt.strides[0]));
    const int64_t page_size = k.shape[1];
    if (page_size < kMinPageSize || page_size > kMaxPageSize || (page_size & (page_size - 1)) != 0)
      check.fail("cache.k", "must have a page size (dim 1; paged, as a block table is given) that is a power of two "
                            "in [16, 256], got shape " + k.shape_str());
    if (kv_key_per_channel(format) && page_size % kKeyBlock != 0)
      check.fail("cache.k", "must have a page size (dim 1) that is a multiple of 32: page_size " + str(page_size) +
                                " is below the 32-token key block of " + kv_format_name(format) + " caches");
    if (k.shape[0] < 1) check.fail("cache.k", "must have at least one page (dim 0), got shape " + k.shape_str());
    if (max_pages >= kMaxPositions / page_size)
      check.fail(arg, "must address fewer than 2^31 tokens per sequence (max_pages * page_size; positions are "
                      "int32), got " + str(max_pages) + " pages of " + str(page_size) + " tokens");
    c.paged = true;
    c.page_size = static_cast<int>(page_size);
    while ((1 << c.log2_page_size) < c.page_size) ++c.log2_page_size;
    c.num_pages = k.shape[0];
    c.capacity = max_pages * page_size;
    c.block_table = static_cast<const int32_t*>(bt.data);
    c.block_table_stride = bt.strides[0];
    c.max_pages = static_cast<int>(max_pages);
  } else {
    check.dim(k, "cache.k", 0, batch, "B, one sequence per row as no block table is given");
    if (k.shape[1] >= kMaxPositions)
      check.fail("cache.k", "must hold fewer than 2^31 tokens per sequence (T_max, dim 1; positions are int32), got "
                            "shape " + k.shape_str());
    if (kv_key_per_channel(format) && k.shape[1] % kKeyBlock != 0)
      check.fail("cache.k", "must have T_max (dim 1) a multiple of 32, the key block of " +
                                std::string(kv_format_name(format)) + " caches, got shape " + k.shape_str());
    c.num_pages = batch;
    c.capacity = k.shape[1];
  }

  // ---- v: k's twin
  check.same_dtype(k, "cache.k", v, "cache.v");
  check.rank(v, "cache.v", 4);
  for (int d = 0; d < 4; ++d)
    if (v.shape[d] != k.shape[d])
      check.fail("cache.v", "must have the shape of 'cache.k' " + k.shape_str() + ", got " + v.shape_str());
  for (int d = 0; d < 4; ++d)
    if (v.strides[d] != k.strides[d])
      check.fail("cache.v", "must have the strides of 'cache.k' " + strides_str(k) +
                                " (one set of strides addresses both), got " + strides_str(v));
  check_layout(check, v, "cache.v", true, kVectorBytes, kVectorBytes);
  if (!disjoint_twins(k, v)) check.fail("cache.v", "must not overlap 'cache.k' in memory");

  c.k = static_cast<const uint8_t*>(k.data);
  c.v = static_cast<const uint8_t*>(v.data);
  c.stride_outer = k.strides[0] * elem;
  c.stride_token = k.strides[1] * elem;
  c.stride_head = k.strides[2] * elem;
  // Decode reads the rows through TMA tensor maps: int32 coordinates, strides below 2^40 bytes.
  if (c.num_pages > kMaxInt)
    check.fail("cache.k", "must have at most " + str(kMaxInt) + " pages (dim 0; tile coordinates are int32), got "
                          "shape " + k.shape_str());
  for (int d = 0; d < 3; ++d)
    if (k.strides[d] * elem >= kMaxTmaStrideBytes)
      check.fail("cache.k", "must have strides below 2^40 bytes (the TMA limit), got " + str(k.strides[d]) +
                            " elements in dim " + str(d));

  // Only the per-channel formats have a residual. check_append checks it; decode never reads it, so there it is
  // ignored, whatever it holds (neither validated nor passed on).
  if (cache.k_residual && !kv_key_per_channel(format))
    check.fail("cache.k_residual", std::string("must be absent for ") + kv_format_name(format) +
                                       " caches (only the per-channel key formats keep one)");
  check_scales(check, cache, k, head_dim, c);
  return c;
}

namespace {

// What q, the cache and the params fix: everything the split count and the workspace size depend on.
struct DecodeShape {
  TensorView q;  // normalized
  int64_t batch = 0, num_new = 1, num_q_heads = 0, head_dim = 0;
  CacheDesc cache;
};

DecodeShape check_query_cache_params(const ArgCheck& check, const TensorView& q_in, const KVCache& cache,
                                     const DecodeParams& params) {
  DecodeShape s;
  // ---- q [B, HQ, D] or [B, S, HQ, D] defines B, S, HQ, D and the dtype
  const TensorView q = s.q = normalized(q_in);
  check.dtype(q, "q", {DType::kBF16, DType::kFP16});
  if (q.rank != 3 && q.rank != 4)
    check.fail("q", "must be [B, HQ, D] or [B, S, HQ, D] (S new tokens per sequence), got shape " + q.shape_str());
  check_layout(check, q, "q", true, kVectorBytes, kVectorBytes);
  const int hd = q.rank - 2;  // dim of HQ
  const int64_t B = s.batch = q.shape[0], HQ = s.num_q_heads = q.shape[hd], D = s.head_dim = q.shape[hd + 1];
  if (q.rank == 4) s.num_new = q.shape[1];
  if (!supported_head_dim(D))
    check.fail("q", "must have head dim D (dim " + str(hd + 1) + ") 64, 128 or 256, got shape " + q.shape_str());
  if (HQ < 1 || HQ > kMaxInt)
    check.fail("q", "must have 1 to " + str(kMaxInt) + " heads (HQ, dim " + str(hd) + "), got shape " + q.shape_str());
  if (s.num_new < 1 || s.num_new > kDecodeMaxNewTokens)
    check.fail("q", "must have 1 to " + str(kDecodeMaxNewTokens) + " new tokens per sequence (S, dim 1), got shape " +
                        q.shape_str());
  if (B > kMaxInt)
    check.fail("q", "must have at most " + str(kMaxInt) + " sequences (B, dim 0), got shape " + q.shape_str());

  s.cache = check_cache(check.op(), cache, B, D, q.dtype);
  const int64_t HKV = s.cache.num_kv_heads;
  if (HQ % HKV != 0)
    check.fail("q", "(dim " + str(hd) + "): HQ (" + str(HQ) + ") must be a multiple of the KV heads (" + str(HKV) +
                        ", cache.k.shape[2])");
  if (HQ / HKV > kMaxGroupSize)
    check.fail("q", "must have at most " + str(kMaxGroupSize) + " query heads per KV head, got HQ / HKV = " +
                        str(HQ) + " / " + str(HKV));

  // ---- params
  if (!std::isfinite(params.softmax_scale))
    check.fail("params.softmax_scale", "must be finite (0 selects 1/sqrt(D)), got " +
                                           std::to_string(params.softmax_scale));
  check_softcap_window(check, params.softcap, params.window);
  check.in_range(params.num_splits, "params.num_splits", 0, kDecodeMaxSplits);
  return s;
}

// The split count: `requested`, or (0) one chosen from the shapes and the SM count. Either way capped so that
// each split covers at least 16 tokens of capacity: more splits only add merging work. Only 0 queries the device.
int resolve_num_splits(const DecodeShape& s, int requested) {
  const int64_t useful = std::clamp<int64_t>(
      (s.cache.capacity + kMinTokensPerSplit - 1) / kMinTokensPerSplit, 1, kDecodeMaxSplits);
  int64_t splits = requested;
  if (splits == 0)  // no sequences: nothing to split, and no degenerate input for the heuristic
    splits = s.batch == 0 ? 1
                          : select_num_splits(s.batch, s.cache.num_kv_heads,
                                              s.num_new * (s.num_q_heads / s.cache.num_kv_heads),
                                              s.cache.capacity, tessera::detail::current_device_info().num_sms,
                                              s.cache.format, s.head_dim);
  return static_cast<int>(std::clamp<int64_t>(splits, 1, useful));
}

// Whether a call runs the balanced plan: asked for, and allowed for this batch and split count (config.h). The
// workspace query, its check and the launch all take it from here.
bool resolve_balanced(const DecodeParams& params, int64_t batch, int splits) {
  return params.balance_splits && decode_balanced(batch, splits);
}

}  // namespace

// For decode_workspace_bytes (to be declared in problem.h): the rules on q, the cache and the params, then the size
// for the split count check_decode will resolve. No device-pointer checks: only shapes, dtypes and layouts matter.
std::size_t check_decode_workspace(const char* op, const TensorView& q, const KVCache& cache,
                                   const DecodeParams& params) {
  const ArgCheck check(op);
  const DecodeShape s = check_query_cache_params(check, q, cache, params);
  const int splits = resolve_num_splits(s, params.num_splits);
  return decode_workspace_bytes_for(s.batch, s.num_new, s.num_q_heads, s.head_dim, splits,
                                    resolve_balanced(params, s.batch, splits));
}

DecodeProblem check_decode(const char* op, const TensorView& q_in, const KVCache& cache, const TensorView& seqlens_in,
                           const TensorView& o_in, const std::optional<TensorView>& lse_in, const Workspace& workspace,
                           const DecodeParams& params) {
  const ArgCheck check(op);
  const DecodeShape s = check_query_cache_params(check, q_in, cache, params);
  const TensorView& q = s.q;
  const CacheDesc& c = s.cache;
  const int64_t B = s.batch, S = s.num_new, HQ = s.num_q_heads, D = s.head_dim;
  const bool multi = q.rank == 4;

  const TensorView seqlens = normalized(seqlens_in);
  check_lengths(check, seqlens, "cache_seqlens", B);

  // ---- outputs
  const TensorView o = normalized(o_in);
  check.same_dtype(q, "q", o, "o");
  if (multi)
    check_shape(check, o, "o", {B, S, HQ, D}, "[B, S, HQ, D] (the shape of q)");
  else
    check_shape(check, o, "o", {B, HQ, D}, "[B, HQ, D] (the shape of q)");
  check_layout(check, o, "o", true, kVectorBytes, kVectorBytes);
  check.no_self_overlap(o, "o");
  std::optional<TensorView> lse;
  if (lse_in) {
    lse = normalized(*lse_in);
    check.dtype(*lse, "lse", {DType::kFP32});
    if (multi)
      check_shape(check, *lse, "lse", {B, S, HQ}, "[B, S, HQ]");
    else
      check_shape(check, *lse, "lse", {B, HQ}, "[B, HQ]");
    check_layout(check, *lse, "lse", false, 0, 4);
    check.no_self_overlap(*lse, "lse");
  }

  // ---- memory: outputs apart from the inputs and from each other
  std::vector<Named> inputs = cache_tensors(cache);
  inputs.push_back({&q_in, "q"});
  inputs.push_back({&seqlens_in, "cache_seqlens"});
  std::vector<Named> outputs = {{&o_in, "o"}};
  if (lse_in) outputs.push_back({&*lse_in, "lse"});
  check_outputs_apart(check, inputs, outputs);

  // ---- workspace: sized by the resolved split count; written, so apart from everything else too
  TensorView ws_view;
  const auto check_workspace = [&](int splits) {
    const bool balanced = resolve_balanced(params, B, splits);
    const std::size_t needed = decode_workspace_bytes_for(B, S, HQ, D, splits, balanced);
    if (workspace.bytes < needed)
      check.fail("workspace", "must have at least " + std::to_string(needed) + " bytes for " + str(splits) +
                                  (balanced ? " balanced" : "") +
                                  " splits (decode_workspace_bytes), got " + std::to_string(workspace.bytes));
    if (needed == 0) return needed;
    if (reinterpret_cast<std::uintptr_t>(workspace.data) % kVectorBytes != 0)
      check.fail("workspace", "must be 16-byte aligned");
    ws_view = ::tessera::detail::workspace_view(workspace, needed, q.device);
    // Only its own pairs: the outputs were checked against the inputs and each other above.
    for (const std::vector<Named>* list : {&inputs, &outputs})
      for (const Named& t : *list) check.no_overlap(*t.t, t.name, ws_view, "workspace");
    return needed;
  };
  // An explicit split count needs no device query: its workspace is checked with the other rules.
  int splits = 0;
  std::size_t ws_needed = 0;
  if (params.num_splits > 0) {
    splits = resolve_num_splits(s, params.num_splits);
    ws_needed = check_workspace(splits);
  }

  // ---- device checks last: everything above runs without a GPU
  for (const Named& t : inputs) check.on_current_device(*t.t, t.name);
  for (const Named& t : outputs) check.on_current_device(*t.t, t.name);
  if (splits == 0) {
    splits = resolve_num_splits(s, 0);
    ws_needed = check_workspace(splits);
  }
  if (ws_needed > 0) check.on_current_device(ws_view, "workspace");

  DecodeProblem p;
  p.cache = c;
  p.batch = static_cast<int>(B);
  p.num_q_heads = static_cast<int>(HQ);
  p.num_new = static_cast<int>(S);
  p.fp16 = q.dtype == DType::kFP16;
  const int hd = multi ? 2 : 1;  // dim of HQ in q and o (S is dim 1 of a 4-D q; 0 stride for a 3-D one)
  p.q = q.data;
  p.q_stride_b = q.strides[0];
  p.q_stride_s = multi ? q.strides[1] : 0;
  p.q_stride_h = q.strides[hd];
  p.o = o.data;
  p.o_stride_b = o.strides[0];
  p.o_stride_s = multi ? o.strides[1] : 0;
  p.o_stride_h = o.strides[hd];
  if (lse) {
    p.lse = static_cast<float*>(lse->data);
    p.lse_stride_b = lse->strides[0];
    p.lse_stride_s = multi ? lse->strides[1] : 0;
    p.lse_stride_h = lse->strides[hd];
  }
  p.seqlens = static_cast<const int32_t*>(seqlens.data);
  p.softmax_scale = params.softmax_scale != 0.0f ? params.softmax_scale
                                                 : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  p.softcap = params.softcap;
  p.window = params.window;
  p.num_splits = splits;
  p.balanced = resolve_balanced(params, B, splits);
  p.workspace = ws_needed > 0 ? workspace.data : nullptr;
  p.workspace_bytes = ws_needed;  // what the launch uses (the caller may have given more)
  return p;
}

AppendProblem check_append(const char* op, const TensorView& k_new_in, const TensorView& v_new_in,
                           const TensorView& positions_in, const KVCache& cache) {
  const ArgCheck check(op);

  // ---- new rows [B, S, HKV, D]: any non-negative strides but the last (read element by element)
  const TensorView k_new = normalized(k_new_in), v_new = normalized(v_new_in);
  check.dtype(k_new, "k_new", {DType::kBF16, DType::kFP16});
  check.rank(k_new, "k_new", 4);
  check_layout(check, k_new, "k_new", true, 0, 2);
  const int64_t B = k_new.shape[0], S = k_new.shape[1], D = k_new.shape[3];
  if (!supported_head_dim(D))
    check.fail("k_new", "must have head dim D (dim 3) 64, 128 or 256, got shape " + k_new.shape_str());
  if (B > kMaxInt || S > kMaxInt)
    check.fail("k_new", "must have at most " + str(kMaxInt) + " sequences (dim 0) and new tokens (dim 1), got shape " +
                            k_new.shape_str());
  check.same_dtype(k_new, "k_new", v_new, "v_new");
  check.rank(v_new, "v_new", 4);
  for (int d = 0; d < 4; ++d)
    if (v_new.shape[d] != k_new.shape[d])
      check.fail("v_new", "must have the shape of 'k_new' " + k_new.shape_str() + ", got " + v_new.shape_str());
  check_layout(check, v_new, "v_new", true, 0, 2);

  const TensorView positions = normalized(positions_in);
  check_lengths(check, positions, "positions", B);

  const CacheDesc c = check_cache(op, cache, B, D, k_new.dtype);
  check.dim(k_new, "k_new", 2, c.num_kv_heads, "HKV, cache.k.shape[2]");

  // ---- the per-channel formats' key residual: append_kv re-quantizes a block from it (read) and keeps the new
  // keys in it (written), so it is one more output
  std::optional<TensorView> residual;
  if (kv_key_per_channel(cache.format)) {
    const char* arg = "cache.k_residual";
    if (!cache.k_residual)
      check.fail(arg, std::string("is required by append_kv for ") + kv_format_name(cache.format) +
                          " caches (the 16-bit keys of the last two blocks written, [B, 64, HKV, D] in the dtype of k_new)");
    residual = normalized(*cache.k_residual);
    check.same_dtype(k_new, "k_new", *residual, arg);
    check_shape(check, *residual, arg, {B, kKeyResidualRows, c.num_kv_heads, D},
                "[B, 64, HKV, D] (B of k_new, the 16-bit keys of the last two blocks written)");
    check_layout(check, *residual, arg, true, kVectorBytes, kVectorBytes);  // rows move as 16-byte vectors
  }

  // ---- memory: the cache is the output here. Its rows must not alias each other (two writers would race),
  // nor any input. fp8 scales are inputs; check_cache kept them off the data.
  std::vector<Named> outputs = {{&cache.k, "cache.k"}, {&cache.v, "cache.v"}};
  if (is_integer(cache.format)) {
    outputs.push_back({&*cache.k_scale, "cache.k_scale"});
    outputs.push_back({&*cache.v_scale, "cache.v_scale"});
  }
  // check_cache kept the data and the scales apart; the residual is apart from all of them.
  if (residual) {
    for (const Named& t : outputs) check.no_overlap(*t.t, t.name, *cache.k_residual, "cache.k_residual");
    outputs.push_back({&*cache.k_residual, "cache.k_residual"});
  }
  for (const Named& t : outputs) check.no_self_overlap(normalized(*t.t), t.name);
  std::vector<Named> inputs = {{&k_new_in, "k_new"}, {&v_new_in, "v_new"}, {&positions_in, "positions"}};
  if (cache.block_table) inputs.push_back({&*cache.block_table, "cache.block_table"});
  for (const Named& out : outputs)
    for (const Named& in : inputs) check.no_overlap(*in.t, in.name, *out.t, out.name);

  // ---- device checks last
  check.on_current_device(k_new, "k_new");
  check.on_current_device(v_new, "v_new");
  check.on_current_device(positions, "positions");
  check_cache_devices(check, cache);
  if (residual) check.on_current_device(*residual, "cache.k_residual");

  AppendProblem p;
  p.cache = c;
  p.batch = static_cast<int>(B);
  p.num_new = static_cast<int>(S);
  p.fp16 = k_new.dtype == DType::kFP16;
  p.k_new = k_new.data;
  p.v_new = v_new.data;
  p.new_stride_b = k_new.strides[0];
  p.new_stride_s = k_new.strides[1];
  p.new_stride_h = k_new.strides[2];
  p.vnew_stride_b = v_new.strides[0];
  p.vnew_stride_s = v_new.strides[1];
  p.vnew_stride_h = v_new.strides[2];
  p.positions = static_cast<const int32_t*>(positions.data);
  if (residual) {
    p.cache.k_residual = residual->data;
    p.cache.res_stride_b = residual->strides[0];
    p.cache.res_stride_slot = residual->strides[1];
    p.cache.res_stride_head = residual->strides[2];
  }
  return p;
}

}  // namespace detail
}  // namespace tessera::attention
