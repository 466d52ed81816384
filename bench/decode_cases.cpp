// tessera-bench cases for attention decode over a low-precision KV cache and for append_kv (tessera/attention.h).
//
//   decode     one query token (S<n> cases: n, causal) per sequence against its cached K and V: q / o bf16
//              [B, HQ, D] ([B, S, HQ, D]), D = 128, default
//              params (softmax_scale 1/sqrt(D), no softcap, no window, the library's split count)
//   append_kv  B = 128 sequences, S = 1 new token, HKV = 8, D = 128, capacity 4096, contiguous: quantize the new
//              bf16 K/V rows and write them at a random position per sequence
//
// Case names: <model>/B<batch>/T<capacity>[/paged<page size> | /zipf | /uniform][/S<new tokens>][/balanced]/<format>
//   hq8kv1      HQ 8, HKV 1 (the seed grid): B in {1, 8, 32, 64, 128, 256, 512}, T 8192, every format (B 1 and 8: the
//               small batches where fixed costs dominate, issue 16 part 2)
//   llama3_8b   HQ 32, HKV 8 (Llama-3-8B): B in {1, 16, 64}, T 4096, every format;
//               long context B 1, T 131072 (native, int4)
//   paged<P>    page size P in {16, 64}, every page of the batch in one pool in a random permutation (the block
//               table): hq8kv1 B 128 and llama3_8b B 16 / 64 (native, int8, int4)
//   zipf        lengths T / r for the ranks r = 1..B in a random order: hq8kv1 B 8, 64, 256 and llama3_8b B 16
//   uniform     lengths uniform in [1, T]: hq8kv1 B 64 and llama3_8b B 16               (both: native, int4)
//   balanced    DecodeParams::balance_splits: each zipf / uniform shape again, and hq8kv1 B 8 / 64 / 128 and
//               llama3_8b B 16 with equal lengths (native, int4)
//   S<n>        n new query tokens per sequence, causal (speculative decoding): llama3_8b B 16 / 64 S 4 and
//               hq8kv1 B 128 S 2 (native, int8, int4); compare.py has no peer row for them
// Unless named, every sequence holds T tokens. Formats (kv_format_name): native (bf16), fp8 (e4m3, fp32 scale per
// KV head), int8, int4, int4_group32, int8_kchannel, int4_kchannel (keys with per-channel pairs over 32-token
// blocks, values as int8 / int4). bench/compare.py --ops decode runs the same cases (and lengths), S<n> aside,
// against torch SDPA (cuDNN, flash) on the dense bf16 cache.
//
// Bytes of a decode call = what it reads and writes: for every attended token, the K and V rows of each KV head
// (row_bytes each) and their fp16 (scale, offset) pairs (4 bytes per group; the per-channel formats' keys: 4·D
// bytes per KV head and 32-token block attended, a partial last block whole), plus q, o, the lengths, the
// block-table entries used and the fp8 scales. append_kv: the new bf16 rows read, the codes and pairs written,
// the positions (and fp8 scales) read; the per-channel formats' keys: the new row into k_residual, the block's
// earlier rows read from it, its codes and its 4·D bytes of pairs rewritten (the mean over a uniform position in
// the block: 15.5 earlier rows). FLOPs (decode) = 4·HQ·D·ΣL (q·K and p·V), for scale only: decode is bound
// by the cache read, and the table's % copy BW is its headline.
//
// Inputs, generated on the GPU (device_random.h): bf16 values m·N(0, 1) (Irwin-Hall, bounded by 3.47·m) with
// m = 2^U(-1, 1) per KV head of K and of V, quantized there by the cache format's rule, written straight into the
// case's layout (paged: through the block table); fp8 scale per head 3.47·m / 448. q N(0, 1). The lengths, the
// per-head magnitudes and the block table (a random permutation of the pages) are host data. Sets rotate where one
// cache is smaller than twice the L2 (llama3_8b B 1 above all). The per-channel formats' keys: every 32-token block
// quantized whole (device_random.h), as append_kv leaves a full block.
//
// --check: decode against the float64 reference (reference/attention_reference.h) per (sequence, KV head) pair,
// on worker threads, over set 0's cache rows gathered on the GPU and downloaded. Which pairs: when the cache holds
// at most kCheckRows (token, head) rows per head, every sequence, with as many KV heads per sequence as the budget
// allows (sequence b takes heads b, b+1, ... mod HKV, so every head is covered across sequences); past that one
// head per sequence (b mod HKV) on a sample of sequences: the first, the last, the longest, the shortest, then
// random ones within the budget. The message says which. The per-channel keys dequantize through their block's
// pairs (reference::dequantize_key_row). append_kv: bit-exact against the reference quantizer applied to the
// downloaded new rows, and the rows either side of each written one must keep their poison; the per-channel
// formats' keys: every block the new rows touch equals reference::quantize_key_block over its rows (those before
// the first new one from the downloaded k_residual), the blocks either side keep their poison, and k_residual
// holds the new rows in their slots and is unchanged elsewhere.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/host_numeric.h"
#include "device_random.h"
#include "harness.h"
#include "reference/attention_reference.h"
#include "reference/format.h"
#include "tessera/attention.h"

namespace tessera::bench {
namespace {

using attention::KVFormat;

constexpr KVFormat kEveryFormat[] = {KVFormat::kNative,      KVFormat::kFP8,          KVFormat::kInt8,
                                     KVFormat::kInt4,        KVFormat::kInt4Group32,  KVFormat::kInt8KChannel,
                                     KVFormat::kInt4KChannel};
constexpr uint64_t kLengthSeed = 0xDEC0DE;  // the skewed lengths; bench/compare.py draws the same ones
constexpr float kNormalBound = 3.4641017f;  // |Rng::normal()| < 2·sqrt(3)
constexpr int64_t kCheckRows = int64_t{1} << 18;  // --check: (token, head) rows of K (and V) the reference reads

int row_bytes(KVFormat f, int d) { return reference::kv_row_bytes(f, d); }
// NG; 0: no pairs. The per-channel formats: 1, the values' pair (their keys' pairs are per block: key_pairs).
int scale_groups(KVFormat f, int d) { return reference::kv_num_scale_groups(f, d); }
bool per_channel(KVFormat f) { return reference::kv_key_per_channel(f); }
// fp16 elements of the keys' pairs per (token, head) row (2·NG), or per (32-token block, head) for the per-channel
// formats (2·D).
int key_pairs(KVFormat f, int d) { return per_channel(f) ? 2 * d : 2 * scale_groups(f, d); }
constexpr int64_t kBlock = attention::kKeyBlock;
DType data_dtype(KVFormat f) {
  return f == KVFormat::kNative ? DType::kBF16 : f == KVFormat::kFP8 ? DType::kFP8E4M3 : DType::kUInt8;
}
// Elements of the last dim of the data tensors: D, or D/2 bytes for the int4 formats.
int64_t data_last_dim(KVFormat f, int d) { return row_bytes(f, d) / static_cast<int64_t>(dtype_size(data_dtype(f))); }

// ============================================================================================================
// host data: per-head magnitudes of one tensor (K or V) of a set
struct HeadScales {
  std::vector<float> mag;        // [HKV]: m_h = 2^U(-1, 1)
  std::vector<float> fp8_scale;  // [HKV]: 3.47·m_h / 448
};
HeadScales head_scales(int hkv, uint64_t seed) {
  Rng rng(seed);
  HeadScales h;
  for (int i = 0; i < hkv; ++i) {
    h.mag.push_back(static_cast<float>(std::exp2(rng.uniform(-1.0, 1.0))));
    h.fp8_scale.push_back(h.mag.back() * kNormalBound / 448.0f);
  }
  return h;
}

// ============================================================================================================
// decode
enum class Lengths { kFull, kZipf, kUniform };

struct DecodeShape {
  std::string name;  // without the format: "llama3_8b/B16/T4096/paged16"
  int batch = 0, hq = 0, hkv = 0, d = 128;
  int num_new = 1;       // S: new query tokens per sequence (q [B, S, HQ, D] when > 1)
  int64_t capacity = 0;  // T: tokens per sequence in the cache
  int page_size = 0;     // 0: contiguous
  Lengths lengths = Lengths::kFull;
  bool balanced = false;  // DecodeParams::balance_splits (name suffix /balanced)

  bool paged() const { return page_size > 0; }
  int64_t pages_per_seq() const { return paged() ? capacity / page_size : 0; }
  int64_t rows() const { return batch * capacity * hkv; }  // (token, head) rows of K (or V)
};

// Tokens per sequence; bench/compare.py's decode_lengths draws the same. full: T; zipf: T / r for the ranks
// r = 1..B in a random order (one full sequence, one half, a third, ...); uniform: 1 + below(T).
std::vector<int32_t> decode_lengths(const DecodeShape& sh) {
  const int B = sh.batch;
  const int32_t T = static_cast<int32_t>(sh.capacity);
  std::vector<int32_t> out(B, T);
  Rng rng(kLengthSeed);
  if (sh.lengths == Lengths::kUniform) {
    for (int32_t& n : out) n = 1 + rng.below(T);
  } else if (sh.lengths == Lengths::kZipf) {
    std::vector<int> order(B);
    std::iota(order.begin(), order.end(), 0);
    for (int i = B - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
    for (int r = 0; r < B; ++r) out[order[r]] = std::max(1, T / (r + 1));
  }
  return out;
}

double decode_bytes(const DecodeShape& sh, KVFormat f, const std::vector<int32_t>& lengths) {
  // K and V rows with their per-row pairs; the per-channel formats' keys have none (their pairs are per block).
  const double per_token =
      sh.hkv * ((per_channel(f) ? 1.0 : 2.0) * 4.0 * scale_groups(f, sh.d) + 2.0 * row_bytes(f, sh.d));
  double tokens = 0, pages = 0, blocks = 0;
  for (int32_t n : lengths) {
    tokens += n;
    if (sh.paged()) pages += (n + sh.page_size - 1) / sh.page_size;
    blocks += (n + kBlock - 1) / kBlock;
  }
  return tokens * per_token + (per_channel(f) ? blocks * sh.hkv * 4.0 * sh.d : 0.0) +
         2.0 * (2.0 * sh.batch * sh.num_new * sh.hq * sh.d) + 4.0 * sh.batch + 4.0 * pages +
         (f == KVFormat::kFP8 ? 2.0 * 4.0 * sh.hkv : 0.0);
}

// The (sequence, KV head) pairs --check covers (see the header comment) and a description of them.
struct CheckPlan {
  std::vector<std::pair<int, int>> items;  // (b, h)
  std::string note;                        // empty: every pair
};
CheckPlan check_plan(const DecodeShape& sh, const std::vector<int32_t>& lengths) {
  CheckPlan plan;
  const int B = sh.batch, HKV = sh.hkv;
  const int64_t tokens = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  const int64_t heads = std::clamp<int64_t>(kCheckRows / std::max<int64_t>(tokens, 1), 1, HKV);
  if (heads * tokens <= kCheckRows) {
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < heads; ++j) plan.items.push_back({b, (b + j) % HKV});
    if (heads < HKV)
      plan.note = "every sequence, " + std::to_string(heads) + " of " + std::to_string(HKV) +
                  " KV heads each (heads b.. mod HKV)";
    return plan;
  }
  std::vector<int> seqs = {0, B - 1, static_cast<int>(std::max_element(lengths.begin(), lengths.end()) - lengths.begin()),
                           static_cast<int>(std::min_element(lengths.begin(), lengths.end()) - lengths.begin())};
  std::sort(seqs.begin(), seqs.end());
  seqs.erase(std::unique(seqs.begin(), seqs.end()), seqs.end());
  int64_t rows = 0;
  for (int b : seqs) rows += lengths[b];
  std::vector<int> order(B);
  std::iota(order.begin(), order.end(), 0);
  Rng rng(0xC4EC);
  for (int i = B - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  for (int b : order) {
    if (std::find(seqs.begin(), seqs.end(), b) != seqs.end() || rows + lengths[b] > kCheckRows) continue;
    seqs.push_back(b);
    rows += lengths[b];
  }
  std::sort(seqs.begin(), seqs.end());
  for (int b : seqs) plan.items.push_back({b, b % HKV});
  plan.note = std::to_string(seqs.size()) + " of " + std::to_string(B) +
              " sequences (first, last, longest, shortest, random), KV head b mod " + std::to_string(HKV);
  return plan;
}

class DecodeCase final : public CaseInstance {
 public:
  DecodeCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const DecodeShape& sh,
             KVFormat f)
      : sh_(sh), format_(f), device_(ctx.device), lengths_(decode_lengths(sh)), plan_(check_plan(sh, lengths_)) {
    const int64_t B = sh.batch, rows = sh.num_new * sh.hq, D = sh.d;  // rows: query rows per sequence (S·HQ)
    params_.balance_splits = sh.balanced;
    sets_ = rotating_sets(ctx, decode_bytes(sh, f, lengths_));
    seqlens_ = upload_new(lengths_);
    if (sh.paged()) {  // one pool of B·T/P pages, a random permutation of them as the block table
      Rng rng(case_seed(op, sh.name + "/block_table", 0));
      block_table_host_.resize(B * sh.pages_per_seq());
      std::iota(block_table_host_.begin(), block_table_host_.end(), 0);
      for (int64_t i = static_cast<int64_t>(block_table_host_.size()) - 1; i > 0; --i)
        std::swap(block_table_host_[i], block_table_host_[rng.next() % static_cast<uint64_t>(i + 1)]);
      block_table_ = upload_new(block_table_host_);
    }
    o_.allocate(B * rows * D * 2);

    const int rb = row_bytes(f, sh.d);
    // fp16 elements of pairs per tensor: per (token, head) row, or (keys of a per-channel format) per 32-token block.
    const int64_t k_pair_elems = (per_channel(f) ? sh.rows() / kBlock : sh.rows()) * key_pairs(f, sh.d);
    const int64_t v_pair_elems = sh.rows() * 2 * scale_groups(f, sh.d);
    for (int s = 0; s < sets_; ++s) {
      Rng rng(case_seed(op, name, s));
      const uint64_t k_seed = rng.next(), v_seed = rng.next(), q_seed = rng.next();
      Set set;
      for (auto [data, pairs, scale, seed, heads, pair_elems, keys] :
           {std::tuple{&set.k, &set.k_scale, &set.k_fp8, k_seed, &set.k_heads, k_pair_elems, true},
            std::tuple{&set.v, &set.v_scale, &set.v_fp8, v_seed, &set.v_heads, v_pair_elems, false}}) {
        *heads = head_scales(sh.hkv, seed);
        gen::KVCacheFill fill;
        fill.format = f;
        fill.batch = B;
        fill.capacity = sh.capacity;
        fill.hkv = sh.hkv;
        fill.head_dim = sh.d;
        fill.page_size = sh.page_size;
        fill.block_table = sh.paged() ? block_table_.as<const int32_t>() : nullptr;
        fill.head_mag = heads->mag;
        fill.keys = keys;
        if (f == KVFormat::kFP8) fill.fp8_scale = heads->fp8_scale;
        data->allocate(sh.rows() * rb);
        if (pair_elems) pairs->allocate(pair_elems * 2);
        gen::fill_kv_cache(fill, data->get(), pair_elems ? pairs->as<uint16_t>() : nullptr, gen::sub_seed(seed, 1),
                           ctx.stream);
        if (f == KVFormat::kFP8) *scale = upload_new(heads->fp8_scale);
      }
      set.q.allocate(B * rows * D * 2);
      gen::FloatDist q;
      q.kind = gen::FloatDist::kNormal;
      gen::fill_float(set.q.get(), DType::kBF16, B * rows * D, q_seed, q, ctx.stream);
      sets_data_.push_back(std::move(set));
    }
    for (Set& set : sets_data_) set.cache = cache_views(set);
    workspace_bytes_ = attention::decode_workspace_bytes(q_view(sets_data_[0]), sets_data_[0].cache, params_);
    workspace_.allocate(workspace_bytes_);  // cudaMalloc: 256-byte aligned
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    attention::decode(q_view(s), s.cache, TensorView::contiguous(seqlens_.get(), DType::kInt32, {sh_.batch}, device_),
                      qo_view(o_.get()), std::nullopt, Workspace{workspace_.get(), workspace_bytes_}, params_, stream);
  }

  CheckResult check(cudaStream_t stream) override {
    const int64_t HQ = sh_.hq, HKV = sh_.hkv, D = sh_.d, S = sh_.num_new, G = HQ / HKV;
    o_.fill_async(0xFF, stream);  // NaN
    run(stream, 0);
    const Set& set = sets_data_[0];
    const auto o = o_.download<uint16_t>(sh_.batch * S * HQ * D, stream);
    const auto q = set.q.download<uint16_t>(sh_.batch * S * HQ * D, stream);

    // The checked pairs' K and V rows (physical row numbers in the case's layout), gathered on the GPU; the
    // per-channel formats' key pairs per block (physical block rows), block j of pair i at first_block[i] + j.
    const size_t n = plan_.items.size();
    const bool channel = per_channel(format_);
    std::vector<int64_t> first(n + 1, 0), rows, first_block(n + 1, 0), blocks;
    for (size_t i = 0; i < n; ++i) {
      const auto [b, h] = plan_.items[i];
      for (int64_t t = 0; t < lengths_[b]; ++t) rows.push_back(physical_row(b, t, h));
      first[i + 1] = static_cast<int64_t>(rows.size());
      if (channel)  // the block's first token row / 32 = its block row (pages hold whole blocks)
        for (int64_t t = 0; t < lengths_[b]; t += kBlock)
          blocks.push_back(physical_row(b, t, h) / sh_.hkv / kBlock * sh_.hkv + h);
      first_block[i + 1] = static_cast<int64_t>(blocks.size());
    }
    const int rb = row_bytes(format_, sh_.d), np = 2 * scale_groups(format_, sh_.d), kp = key_pairs(format_, sh_.d);
    const auto k_data = download_rows<uint8_t>(set.k, rb, rows, stream);
    const auto v_data = download_rows<uint8_t>(set.v, rb, rows, stream);
    std::vector<uint16_t> k_pairs, v_pairs;
    if (np) {
      k_pairs = download_rows<uint16_t>(set.k_scale, kp, channel ? blocks : rows, stream);
      v_pairs = download_rows<uint16_t>(set.v_scale, np, rows, stream);
    }

    // Per pair: dequantize, the float64 reference of its G query heads (and S tokens), compare its o rows.
    std::vector<CheckResult> parts(n);
    std::vector<std::string> labels(n);
    parallel_for(static_cast<int64_t>(n), static_cast<double>(rows.size()) * G * D * 4 * S, [&](int64_t i) {
      const auto [b, h] = plan_.items[i];
      const int64_t len = lengths_[b], r0 = first[i];
      std::vector<double> k(len * D), v(len * D), qd(S * G * D);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t r = r0 + t;
        if (channel)
          reference::dequantize_key_row(format_, k_data.data() + r * rb,
                                        k_pairs.data() + (first_block[i] + t / kBlock) * kp, sh_.d, k.data() + t * D);
        else
          reference::dequantize_kv_row(format_, k_data.data() + r * rb, np ? k_pairs.data() + r * np : nullptr,
                                       sh_.d, DType::kBF16, set.k_heads.fp8_scale[h], k.data() + t * D);
        reference::dequantize_kv_row(format_, v_data.data() + r * rb, np ? v_pairs.data() + r * np : nullptr, sh_.d,
                                     DType::kBF16, set.v_heads.fp8_scale[h], v.data() + t * D);
      }
      for (int64_t si = 0; si < S; ++si)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d)
            qd[(si * G + g) * D + d] = host::bf16_to_f32(q[((b * S + si) * HQ + h * G + g) * D + d]);
      reference::DecodeShape rs;
      rs.batch = 1;
      rs.num_q_heads = static_cast<int>(G);
      rs.num_kv_heads = 1;
      rs.head_dim = sh_.d;
      rs.capacity = len;
      rs.num_new = sh_.num_new;
      const reference::DecodeRef ref =
          reference::decode_reference(qd, k, v, {static_cast<int32_t>(len)}, rs, params_, /*num_threads=*/1);
      // o[b, s, h·G + g, :]: tokens HQ·D apart, heads D apart.
      parts[i] = reference::check_decode_output(ref, o.data() + (b * S * HQ + h * G) * D, DType::kBF16, HQ * D, D,
                                                nullptr, 0, 0, {});
      labels[i] = "sequence " + std::to_string(b) + " KV head " + std::to_string(h);
    });
    double worst = 0;
    for (const CheckResult& p : parts) worst = std::max(worst, p.error);
    return merge_checks(parts, labels,
                        std::to_string(n) + " (sequence, KV head) pairs, " + std::to_string(rows.size()) +
                            " K/V rows: o within 5e-3 relative Frobenius per pair, worst " +
                            reference::detail::fmt(worst) + (plan_.note.empty() ? "" : " (" + plan_.note + ")"));
  }

 private:
  // Row of (sequence b, token t, KV head h) in the K / V buffers.
  int64_t physical_row(int64_t b, int64_t t, int64_t h) const {
    if (!sh_.paged()) return (b * sh_.capacity + t) * sh_.hkv + h;
    const int64_t page = block_table_host_[b * sh_.pages_per_seq() + t / sh_.page_size];
    return (page * sh_.page_size + t % sh_.page_size) * sh_.hkv + h;
  }

  struct Set {
    DeviceBuffer k, v, k_scale, v_scale, k_fp8, v_fp8, q;  // k_scale / v_scale: the pairs; *_fp8: kFP8's [HKV]
    HeadScales k_heads, v_heads;
    attention::KVCache cache;
  };

  // [B, T, HKV, last] or [B·T/P, P, HKV, last].
  TensorView cache_view(const DeviceBuffer& b, DType dtype, int64_t last) const {
    if (sh_.paged())
      return TensorView::contiguous(b.get(), dtype, {sh_.batch * sh_.pages_per_seq(), sh_.page_size, sh_.hkv, last},
                                    device_);
    return TensorView::contiguous(b.get(), dtype, {sh_.batch, sh_.capacity, sh_.hkv, last}, device_);
  }

  attention::KVCache cache_views(const Set& s) const {
    attention::KVCache c;
    c.format = format_;
    const int64_t last = data_last_dim(format_, sh_.d);
    c.k = cache_view(s.k, data_dtype(format_), last);
    c.v = cache_view(s.v, data_dtype(format_), last);
    if (per_channel(format_)) {  // key pairs per 32-token block: [B, T / 32, HKV, 2·D] or [pages, P / 32, HKV, 2·D]
      const int64_t outer = sh_.paged() ? sh_.batch * sh_.pages_per_seq() : sh_.batch;
      const int64_t slots = sh_.paged() ? sh_.page_size : sh_.capacity;
      c.k_scale = TensorView::contiguous(s.k_scale.get(), DType::kFP16,
                                         {outer, slots / kBlock, sh_.hkv, key_pairs(format_, sh_.d)}, device_);
      c.v_scale = cache_view(s.v_scale, DType::kFP16, 2);
    } else if (const int ng = scale_groups(format_, sh_.d)) {
      c.k_scale = cache_view(s.k_scale, DType::kFP16, 2 * ng);
      c.v_scale = cache_view(s.v_scale, DType::kFP16, 2 * ng);
    } else if (format_ == KVFormat::kFP8) {
      c.k_scale = TensorView::contiguous(s.k_fp8.get(), DType::kFP32, {sh_.hkv}, device_);
      c.v_scale = TensorView::contiguous(s.v_fp8.get(), DType::kFP32, {sh_.hkv}, device_);
    }
    if (sh_.paged())
      c.block_table = TensorView::contiguous(block_table_.get(), DType::kInt32, {sh_.batch, sh_.pages_per_seq()},
                                             device_);
    return c;
  }

  TensorView q_view(const Set& s) const { return qo_view(s.q.get()); }
  // q and o: [B, HQ, D], or [B, S, HQ, D] with several new tokens.
  TensorView qo_view(void* p) const {
    if (sh_.num_new > 1)
      return TensorView::contiguous(p, DType::kBF16, {sh_.batch, sh_.num_new, sh_.hq, sh_.d}, device_);
    return TensorView::contiguous(p, DType::kBF16, {sh_.batch, sh_.hq, sh_.d}, device_);
  }

  DecodeShape sh_;
  KVFormat format_;
  int device_;
  std::vector<int32_t> lengths_;
  attention::DecodeParams params_;
  int sets_ = 1;
  CheckPlan plan_;
  std::vector<Set> sets_data_;
  std::vector<int32_t> block_table_host_;
  DeviceBuffer seqlens_, block_table_, o_, workspace_;
  std::size_t workspace_bytes_ = 0;
};

// Headline decode rows (docs/perf/decode.md): the seed grid B 128 in every format, its largest batch, Llama-3-8B
// at B 1 and 64, long context, paged, skewed lengths and speculative decoding; the per-channel key formats beside
// int4 at B 128 / 512 and Llama-3-8B B 64; the seed grid's small batches (B 1, 8) where fixed costs dominate.
bool decode_headline(const std::string& name) {
  static const char* const kRows[] = {
      "hq8kv1/B128/T8192/native",       "hq8kv1/B128/T8192/fp8",         "hq8kv1/B128/T8192/int8",
      "hq8kv1/B128/T8192/int4",         "hq8kv1/B128/T8192/int4_group32", "hq8kv1/B512/T8192/native",
      "hq8kv1/B512/T8192/int4",         "llama3_8b/B1/T4096/native",      "llama3_8b/B64/T4096/native",
      "llama3_8b/B64/T4096/int8",       "llama3_8b/B64/T4096/int4",       "llama3_8b/B1/T131072/int4",
      "hq8kv1/B128/T8192/paged16/int4", "hq8kv1/B64/T8192/zipf/int4",     "llama3_8b/B16/T4096/S4/int4",
      "hq8kv1/B128/T8192/int8_kchannel", "hq8kv1/B128/T8192/int4_kchannel", "hq8kv1/B512/T8192/int4_kchannel",
      "llama3_8b/B64/T4096/int4_kchannel", "hq8kv1/B1/T8192/native",         "hq8kv1/B1/T8192/int4",
      "hq8kv1/B8/T8192/native",            "hq8kv1/B8/T8192/int8",           "hq8kv1/B8/T8192/int4",
  };
  return std::find(std::begin(kRows), std::end(kRows), name) != std::end(kRows);
}

void add_decode_shape_cases(std::vector<CaseSpec>& cases, const DecodeShape& sh, std::vector<KVFormat> formats) {
  const std::vector<int32_t> lengths = decode_lengths(sh);
  for (KVFormat f : formats) {
    CaseSpec c;
    c.op = "decode";
    c.name = sh.name + "/" + attention::kv_format_name(f);
    c.bytes = decode_bytes(sh, f, lengths);
    c.flops = 4.0 * sh.num_new * sh.hq * sh.d * std::accumulate(lengths.begin(), lengths.end(), 0.0);
    c.setup = [op = c.op, name = c.name, sh, f](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<DecodeCase>(ctx, op, name, sh, f);
    };
    c.headline = decode_headline(c.name);
    cases.push_back(std::move(c));
  }
}

void add_decode_cases(std::vector<CaseSpec>& cases) {
  const std::vector<KVFormat> every(std::begin(kEveryFormat), std::end(kEveryFormat));
  const std::vector<KVFormat> paged_formats = {KVFormat::kNative, KVFormat::kInt8, KVFormat::kInt4};
  const std::vector<KVFormat> bf16_int4 = {KVFormat::kNative, KVFormat::kInt4};
  const auto shape = [](const std::string& model, int B, int hq, int hkv, int64_t T, int page_size = 0,
                        Lengths lengths = Lengths::kFull, int num_new = 1) {
    DecodeShape sh;
    sh.name = model + "/B" + std::to_string(B) + "/T" + std::to_string(T);
    if (page_size) sh.name += "/paged" + std::to_string(page_size);
    if (lengths == Lengths::kZipf) sh.name += "/zipf";
    if (lengths == Lengths::kUniform) sh.name += "/uniform";
    if (num_new > 1) sh.name += "/S" + std::to_string(num_new);
    sh.batch = B, sh.hq = hq, sh.hkv = hkv, sh.capacity = T, sh.page_size = page_size, sh.lengths = lengths;
    sh.num_new = num_new;
    return sh;
  };
  for (int B : {1, 8, 32, 64, 128, 256, 512}) add_decode_shape_cases(cases, shape("hq8kv1", B, 8, 1, 8192), every);
  for (int B : {1, 16, 64}) add_decode_shape_cases(cases, shape("llama3_8b", B, 32, 8, 4096), every);
  add_decode_shape_cases(cases, shape("llama3_8b", 1, 32, 8, 131072), bf16_int4);
  for (int P : {16, 64}) {
    add_decode_shape_cases(cases, shape("hq8kv1", 128, 8, 1, 8192, P), paged_formats);
    for (int B : {16, 64}) add_decode_shape_cases(cases, shape("llama3_8b", B, 32, 8, 4096, P), paged_formats);
  }
  // Each skewed shape, and equal-length ones, also with balanced splits (DecodeParams::balance_splits): /balanced.
  std::vector<DecodeShape> balanced;
  for (Lengths l : {Lengths::kZipf, Lengths::kUniform}) {
    balanced.push_back(shape("hq8kv1", 64, 8, 1, 8192, 0, l));
    balanced.push_back(shape("llama3_8b", 16, 32, 8, 4096, 0, l));
  }
  for (int B : {8, 256}) balanced.push_back(shape("hq8kv1", B, 8, 1, 8192, 0, Lengths::kZipf));
  for (const DecodeShape& sh : balanced) add_decode_shape_cases(cases, sh, bf16_int4);
  for (int B : {8, 64, 128}) balanced.push_back(shape("hq8kv1", B, 8, 1, 8192));
  balanced.push_back(shape("llama3_8b", 16, 32, 8, 4096));
  for (DecodeShape sh : balanced) {
    sh.name += "/balanced";
    sh.balanced = true;
    add_decode_shape_cases(cases, sh, bf16_int4);
  }
  // Speculative decoding: S new tokens per sequence, causal among themselves (S·G = 16 query rows per KV head).
  for (int B : {16, 64})
    add_decode_shape_cases(cases, shape("llama3_8b", B, 32, 8, 4096, 0, Lengths::kFull, 4), paged_formats);
  add_decode_shape_cases(cases, shape("hq8kv1", 128, 8, 1, 8192, 0, Lengths::kFull, 2), paged_formats);
}

// ============================================================================================================
// append_kv
struct AppendShape {
  int batch = 128, num_new = 1, hkv = 8, d = 128;
  int64_t capacity = 4096;
  int64_t new_rows() const { return static_cast<int64_t>(batch) * num_new * hkv; }
};

// Per new (row, head): the bf16 row read, its codes and pairs written. The per-channel formats' keys instead: the
// row read and written into k_residual, the block's earlier rows read from it and their codes rewritten with the
// new row's, and the block's 2·D pairs; earlier rows: 15.5, the mean over a uniform position in the block (S = 1).
double append_bytes(const AppendShape& sh, KVFormat f) {
  const double rb = row_bytes(f, sh.d), row16 = 2.0 * sh.d;
  const double v_row = row16 + rb + 4.0 * scale_groups(f, sh.d);
  const double earlier = (kBlock - 1) / 2.0;
  const double k_row = per_channel(f) ? 2.0 * row16 + earlier * row16 + (earlier + 1.0) * rb + 4.0 * sh.d : v_row;
  return sh.new_rows() * (k_row + v_row) + 4.0 * sh.batch + (f == KVFormat::kFP8 ? 2.0 * 4.0 * sh.hkv : 0.0);
}

class AppendCase final : public CaseInstance {
 public:
  AppendCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const AppendShape& sh,
             KVFormat f)
      : sh_(sh), format_(f), device_(ctx.device) {
    const int64_t B = sh.batch, T = sh.capacity, HKV = sh.hkv;
    const int rb = row_bytes(f, sh.d), np = 2 * scale_groups(f, sh.d);
    sets_ = rotating_sets(ctx, append_bytes(sh, f));
    for (int s = 0; s < sets_; ++s) {
      Rng rng(case_seed(op, name, s));
      const uint64_t k_seed = rng.next(), v_seed = rng.next();
      std::vector<int32_t> positions(B);
      for (int32_t& p : positions) p = rng.below(static_cast<int>(T - sh.num_new + 1));
      Set set;
      // The new rows: bf16 m_h·N(0, 1) per KV head, [B, S, HKV, D] (a native "cache" of S tokens).
      for (auto [rows, fp8, seed, heads] : {std::tuple{&set.k_new, &set.k_fp8, k_seed, &set.k_heads},
                                            std::tuple{&set.v_new, &set.v_fp8, v_seed, &set.v_heads}}) {
        *heads = head_scales(sh.hkv, seed);
        gen::KVCacheFill fill;
        fill.format = KVFormat::kNative;
        fill.batch = B;
        fill.capacity = sh.num_new;
        fill.hkv = sh.hkv;
        fill.head_dim = sh.d;
        fill.head_mag = heads->mag;
        rows->allocate(sh.new_rows() * sh.d * 2);
        gen::fill_kv_cache(fill, rows->get(), nullptr, gen::sub_seed(seed, 1), ctx.stream);
        if (f == KVFormat::kFP8) *fp8 = upload_new(heads->fp8_scale);
      }
      set.positions = upload_new(positions);
      sets_data_.push_back(std::move(set));
      if (s == 0) positions_ = std::move(positions);
    }
    // The cache is output only (its previous contents do not matter to append_kv), but for the per-channel
    // formats' k_residual: the keys of the positions before the new ones in their block, read back. It holds bf16
    // m_h·N(0, 1) rows (fill_residual); the timed calls overwrite slots with their new rows, which keeps it valid.
    k_.allocate(B * T * HKV * rb);
    v_.allocate(B * T * HKV * rb);
    if (np) {
      k_pairs_.allocate((per_channel(f) ? B * T / kBlock * HKV : B * T * HKV) * key_pairs(f, sh.d) * 2);
      v_pairs_.allocate(B * T * HKV * np * 2);
    }
    if (per_channel(f)) {
      if (T % kBlock != 0) throw Error("tessera-bench: append_kv: per-channel keys need a capacity multiple of 32");
      residual_heads_ = head_scales(sh.hkv, case_seed(op, name + "/k_residual", 0));
      residual_seed_ = gen::sub_seed(case_seed(op, name + "/k_residual", 1), 1);
      residual_.allocate(B * attention::kKeyResidualRows * HKV * sh.d * 2);
      fill_residual(ctx.stream);
    }
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    const int64_t B = sh_.batch, T = sh_.capacity, HKV = sh_.hkv;
    attention::KVCache c;
    c.format = format_;
    const int64_t last = data_last_dim(format_, sh_.d);
    c.k = TensorView::contiguous(k_.get(), data_dtype(format_), {B, T, HKV, last}, device_);
    c.v = TensorView::contiguous(v_.get(), data_dtype(format_), {B, T, HKV, last}, device_);
    if (per_channel(format_)) {
      c.k_scale = TensorView::contiguous(k_pairs_.get(), DType::kFP16, {B, T / kBlock, HKV, key_pairs(format_, sh_.d)},
                                         device_);
      c.v_scale = TensorView::contiguous(v_pairs_.get(), DType::kFP16, {B, T, HKV, 2}, device_);
      c.k_residual = TensorView::contiguous(residual_.get(), DType::kBF16,
                                            {B, attention::kKeyResidualRows, HKV, sh_.d}, device_);
    } else if (const int ng = scale_groups(format_, sh_.d)) {
      c.k_scale = TensorView::contiguous(k_pairs_.get(), DType::kFP16, {B, T, HKV, 2 * ng}, device_);
      c.v_scale = TensorView::contiguous(v_pairs_.get(), DType::kFP16, {B, T, HKV, 2 * ng}, device_);
    } else if (format_ == KVFormat::kFP8) {
      c.k_scale = TensorView::contiguous(s.k_fp8.get(), DType::kFP32, {HKV}, device_);
      c.v_scale = TensorView::contiguous(s.v_fp8.get(), DType::kFP32, {HKV}, device_);
    }
    const std::initializer_list<int64_t> new_shape = {B, sh_.num_new, HKV, sh_.d};
    attention::append_kv(TensorView::contiguous(s.k_new.get(), DType::kBF16, new_shape, device_),
                         TensorView::contiguous(s.v_new.get(), DType::kBF16, new_shape, device_),
                         TensorView::contiguous(s.positions.get(), DType::kInt32, {B}, device_), c, stream);
  }

  // Set 0's rows must equal the reference quantizer's bytes exactly; the token rows either side of them (inside
  // the capacity) must keep the 0xFF poison. The per-channel formats' keys: check_key_blocks.
  CheckResult check(cudaStream_t stream) override {
    const int64_t T = sh_.capacity, HKV = sh_.hkv, S = sh_.num_new;
    const int rb = row_bytes(format_, sh_.d), np = 2 * scale_groups(format_, sh_.d);
    const bool channel = per_channel(format_);
    for (const DeviceBuffer* b : {&k_, &v_, &k_pairs_, &v_pairs_}) b->fill_async(0xFF, stream);
    std::vector<uint16_t> residual_before;
    if (channel) {  // the residual the timed calls left behind, replaced by its initial rows
      fill_residual(stream);
      residual_before = residual_.download<uint16_t>(residual_elems(), stream);
    }
    run(stream, 0);
    // What the cache must hold: the reference quantizer over set 0's new rows (downloaded).
    const Set& set = sets_data_[0];
    Expected expect_k = channel ? Expected{} : expected(set.k_new, set.k_heads, stream);
    Expected expect_v = expected(set.v_new, set.v_heads, stream);
    int64_t bad_rows = 0, bad_guard = 0, compared = 0;
    std::string first;
    if (channel) check_key_blocks(residual_before, stream, bad_rows, bad_guard, compared, first);
    const struct {
      const char* name;
      const DeviceBuffer& data;
      const DeviceBuffer& pairs;
      const Expected& expect;
    } tensors[] = {{"k", k_, k_pairs_, expect_k}, {"v", v_, v_pairs_, expect_v}};
    for (const auto& t : tensors) {
      if (channel && &t.data == &k_) continue;  // the per-channel keys: checked above
      for (int64_t b = 0; b < sh_.batch; ++b) {
        // Tokens [pos - 1, pos + S] of sequence b, clipped to the capacity: one contiguous range of rows.
        const int64_t pos = positions_[b], lo = std::max<int64_t>(pos - 1, 0), hi = std::min<int64_t>(pos + S + 1, T);
        const int64_t row0 = (b * T + lo) * HKV, rows = (hi - lo) * HKV;
        const auto data = download_range<uint8_t>(t.data, row0 * rb, rows * rb, stream);
        const auto pairs = download_range<uint8_t>(t.pairs, row0 * np * 2, rows * np * 2, stream);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t tok = lo + r / HKV, h = r % HKV;
          const uint8_t* got = data.data() + r * rb;
          const uint8_t* got_pairs = np ? pairs.data() + r * np * 2 : nullptr;
          if (tok < pos || tok >= pos + S) {  // a guard row: still poison
            const auto poison = [](uint8_t x) { return x == 0xFF; };
            const bool poisoned =
                std::all_of(got, got + rb, poison) && (!np || std::all_of(got_pairs, got_pairs + np * 2, poison));
            if (!poisoned) {
              if (first.empty())
                first = std::string(t.name) + " b " + std::to_string(b) + " token " + std::to_string(tok) +
                        " head " + std::to_string(h) + " written, but only token " + std::to_string(pos) +
                        " should be";
              ++bad_guard;
            }
            continue;
          }
          ++compared;
          const int64_t src = (b * S + (tok - pos)) * HKV + h;  // row of k_new / v_new
          const bool same = std::memcmp(got, t.expect.data.data() + src * rb, rb) == 0 &&
                            (!np || std::memcmp(got_pairs, t.expect.pairs.data() + src * np, np * 2) == 0);
          if (!same) {
            if (first.empty())
              first = std::string(t.name) + " b " + std::to_string(b) + " token " + std::to_string(tok) + " head " +
                      std::to_string(h) + " differs from the reference quantizer";
            ++bad_rows;
          }
        }
      }
    }
    CheckResult r;
    r.ok = bad_rows == 0 && bad_guard == 0;
    r.error = static_cast<double>(bad_rows + bad_guard);
    r.compared = compared;
    r.message = r.ok ? std::to_string(compared) + " rows bit-exact, their neighbours untouched"
                     : std::to_string(bad_rows) + " of " + std::to_string(compared) + " rows differ, " +
                           std::to_string(bad_guard) + " neighbour rows written; first: " + first;
    return r;
  }

 private:
  struct Set {
    DeviceBuffer k_new, v_new, positions, k_fp8, v_fp8;
    HeadScales k_heads, v_heads;
  };
  struct Expected {
    std::vector<uint8_t> data;    // [rows][row_bytes]
    std::vector<uint16_t> pairs;  // [rows][2·NG]
  };

  Expected expected(const DeviceBuffer& new_rows, const HeadScales& heads, cudaStream_t stream) const {
    const int64_t rows = sh_.new_rows();
    const int rb = row_bytes(format_, sh_.d), np = 2 * scale_groups(format_, sh_.d);
    const auto bits = new_rows.download<uint16_t>(rows * sh_.d, stream);
    Expected e;
    e.data.resize(rows * rb);
    e.pairs.resize(rows * np);
    std::vector<float> x(sh_.d);
    for (int64_t r = 0; r < rows; ++r) {  // row r: KV head r % HKV
      for (int i = 0; i < sh_.d; ++i) x[i] = host::bf16_to_f32(bits[r * sh_.d + i]);
      reference::quantize_kv_row(format_, x.data(), sh_.d, DType::kBF16,
                                 format_ == KVFormat::kFP8 ? heads.fp8_scale[r % sh_.hkv] : 1.0f,
                                 e.data.data() + r * rb, np ? e.pairs.data() + r * np : nullptr);
    }
    return e;
  }

  int64_t residual_elems() const {
    return static_cast<int64_t>(sh_.batch) * attention::kKeyResidualRows * sh_.hkv * sh_.d;
  }

  // k_residual [B, 64, HKV, D]: bf16 m_h·N(0, 1) rows (a native "cache" of 64 tokens), the same every time.
  void fill_residual(cudaStream_t stream) {
    gen::KVCacheFill fill;
    fill.format = KVFormat::kNative;
    fill.batch = sh_.batch;
    fill.capacity = attention::kKeyResidualRows;
    fill.hkv = sh_.hkv;
    fill.head_dim = sh_.d;
    fill.head_mag = residual_heads_.mag;
    gen::fill_kv_cache(fill, residual_.get(), nullptr, residual_seed_, stream);
  }

  // The per-channel formats' keys after set 0's call: every block j the new rows [pos, pos + S) touch holds
  // reference::quantize_key_block over its rows [32j, min(32j + 32, pos + S)), those before pos taken from
  // k_residual as it was (`before`), bit for bit (codes and 2·D pairs per head); the token rows just outside them
  // and the pairs of the blocks either side keep the poison; k_residual holds the new rows in slots (pos + i) % 64
  // and is unchanged elsewhere.
  void check_key_blocks(const std::vector<uint16_t>& before, cudaStream_t stream, int64_t& bad_rows,
                        int64_t& bad_guard, int64_t& compared, std::string& first) const {
    const int64_t T = sh_.capacity, HKV = sh_.hkv, S = sh_.num_new, D = sh_.d, R = attention::kKeyResidualRows;
    const int rb = row_bytes(format_, sh_.d), kp = key_pairs(format_, sh_.d);
    const int64_t blocks_per_seq = T / kBlock;
    const auto k_new = sets_data_[0].k_new.download<uint16_t>(sh_.new_rows() * D, stream);
    const auto after = residual_.download<uint16_t>(residual_elems(), stream);
    const auto poison = [](uint8_t x) { return x == 0xFF; };
    const auto note = [&](const std::string& what) {
      if (first.empty()) first = what;
    };
    std::vector<float> x(kBlock * D);
    std::vector<uint8_t> codes(kBlock * rb);
    std::vector<uint16_t> params(kp);
    for (int64_t b = 0; b < sh_.batch; ++b) {
      const int64_t pos = positions_[b], end = std::min(pos + S, T);
      const int64_t j0 = pos / kBlock, j1 = (end - 1) / kBlock;
      // Token rows [lo, hi): the written blocks' rows up to `end`, and the row either side.
      const int64_t lo = std::max<int64_t>(j0 * kBlock - 1, 0), hi = std::min(end + 1, T);
      const auto data = download_range<uint8_t>(k_, (b * T + lo) * HKV * rb, (hi - lo) * HKV * rb, stream);
      const int64_t p_lo = std::max<int64_t>(j0 - 1, 0), p_hi = std::min(j1 + 2, blocks_per_seq);
      const auto pairs =
          download_range<uint16_t>(k_pairs_, (b * blocks_per_seq + p_lo) * HKV * kp, (p_hi - p_lo) * HKV * kp, stream);
      const auto key_bits = [&](int64_t t, int64_t h) {  // the 16-bit key of position t, head h, before the call
        return t < pos ? &before[((b * R + t % R) * HKV + h) * D] : &k_new[((b * S + (t - pos)) * HKV + h) * D];
      };
      for (int64_t j = p_lo; j < p_hi; ++j) {
        for (int64_t h = 0; h < HKV; ++h) {
          const uint16_t* got = pairs.data() + ((j - p_lo) * HKV + h) * kp;
          const std::string where = "k b " + std::to_string(b) + " block " + std::to_string(j) + " head " +
                                    std::to_string(h);
          if (j < j0 || j > j1) {  // a neighbour block: its pairs untouched
            if (!std::all_of(got, got + kp, [](uint16_t v) { return v == 0xFFFF; })) {
              note(where + " pairs written, but only blocks " + std::to_string(j0) + ".." + std::to_string(j1) +
                   " should be");
              ++bad_guard;
            }
            continue;
          }
          const int64_t r0 = j * kBlock, n = std::min(r0 + kBlock, end) - r0;
          for (int64_t r = 0; r < n; ++r)
            for (int64_t i = 0; i < D; ++i) x[r * D + i] = host::bf16_to_f32(key_bits(r0 + r, h)[i]);
          reference::quantize_key_block(format_, x.data(), static_cast<int>(n), sh_.d, codes.data(), params.data());
          bool same = std::memcmp(got, params.data(), kp * 2) == 0;
          for (int64_t r = 0; r < n; ++r)
            same = same && std::memcmp(data.data() + ((r0 + r - lo) * HKV + h) * rb, codes.data() + r * rb, rb) == 0;
          compared += n;
          if (!same) {
            note(where + " differs from reference::quantize_key_block over its " + std::to_string(n) + " rows");
            ++bad_rows;
          }
        }
      }
      for (int64_t t : {j0 * kBlock - 1, end}) {  // the token rows either side: still poison
        if (t < lo || t >= hi) continue;
        const uint8_t* row = data.data() + (t - lo) * HKV * rb;
        if (!std::all_of(row, row + HKV * rb, poison)) {
          note("k b " + std::to_string(b) + " token " + std::to_string(t) + " written, outside blocks " +
               std::to_string(j0) + ".." + std::to_string(j1) + " up to token " + std::to_string(end - 1));
          ++bad_guard;
        }
      }
      for (int64_t slot = 0; slot < R; ++slot) {
        const int64_t i = ((slot - pos) % R + R) % R;  // the new row of this slot, if i < S
        const bool fresh = i < S && pos + i < T;
        for (int64_t h = 0; h < HKV; ++h) {
          const uint16_t* want = fresh ? &k_new[((b * S + i) * HKV + h) * D] : &before[((b * R + slot) * HKV + h) * D];
          if (std::memcmp(&after[((b * R + slot) * HKV + h) * D], want, D * 2) != 0) {
            note("k_residual b " + std::to_string(b) + " slot " + std::to_string(slot) + " head " +
                 std::to_string(h) + (fresh ? " does not hold the new row" : " changed, but no new row goes there"));
            ++bad_rows;
          }
        }
      }
    }
  }

  AppendShape sh_;
  KVFormat format_;
  int device_;
  int sets_ = 1;
  std::vector<Set> sets_data_;
  DeviceBuffer k_, v_, k_pairs_, v_pairs_, residual_;
  std::vector<int32_t> positions_;
  HeadScales residual_heads_;   // per-channel formats: k_residual's magnitudes per KV head
  uint64_t residual_seed_ = 0;  // and its seed
};

void add_append_cases(std::vector<CaseSpec>& cases) {
  const AppendShape sh;
  for (KVFormat f : kEveryFormat) {
    CaseSpec c;
    c.op = "append_kv";
    c.name = "B" + std::to_string(sh.batch) + "/S" + std::to_string(sh.num_new) + "/hkv" + std::to_string(sh.hkv) +
             "/D" + std::to_string(sh.d) + "/" + attention::kv_format_name(f);
    c.bytes = append_bytes(sh, f);
    c.flops = 0;
    c.setup = [op = c.op, name = c.name, sh, f](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<AppendCase>(ctx, op, name, sh, f);
    };
    c.headline = f == KVFormat::kNative || f == KVFormat::kInt4;
    cases.push_back(std::move(c));
  }
}

void add_attention_cases(std::vector<CaseSpec>& cases) {
  add_decode_cases(cases);
  add_append_cases(cases);
}

}  // namespace

TESSERA_BENCH_CASES(add_attention_cases);

}  // namespace tessera::bench
