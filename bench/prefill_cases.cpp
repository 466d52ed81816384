// tessera-bench cases for attention prefill (issue 17; the kernel is internal until the public op lands, so these
// rows call the launcher directly: docs/perf/prefill.md).
//
//   prefill  packed variable-length q [total, HQ, D], k and v [total, HKV, D] bf16, Sq = Sk per sequence, default
//            softmax scale, no window or softcap. The cases:
//              hq32kv8/B1/S16384/causal, hq32kv8/B1/S4096/causal, hq32kv8/B8/S2048 (non-causal)   (D 128)
//              hq16kv2_d64/B4/S8192/causal, hq16kv2_d256/B4/S8192/causal
//              hq32kv8/zipf32/T65536/causal: 32 sequences, lengths proportional to 1/rank, 65,536 tokens in all
//
// FLOPs = 4·HQ·D per attended (query, key) pair (causal: the pairs on or below the diagonal, "executed-useful").
// Bytes = q, k, v read once and o written once (the floor is the compute, docs/perf/prefill.md).
// Inputs: normals generated on the GPU (device_random.h). --check: the float64 reference (prefill_reference) for a
// sample of query rows (every head): the first and last row of the first and last sequence and random ones, each
// recomputed as a one-query problem over its sequence's keys up to its position (causal) or all of them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "tessera/attention.h"
#include "common/host_numeric.h"
#include "device_random.h"
#include "harness.h"
#include "reference/attention_reference.h"
#include "tessera/attention.h"

namespace tessera::bench {
namespace {

struct PrefillShape {
  std::string name;
  int hq = 32, hkv = 8, d = 128;
  bool causal = true;
  std::vector<int32_t> lengths;  // Sq = Sk per sequence
  int64_t total() const { return std::accumulate(lengths.begin(), lengths.end(), int64_t{0}); }
  double pairs() const {  // attended (query, key) pairs per head
    double p = 0;
    for (int32_t l : lengths) p += causal ? 0.5 * double(l) * (double(l) + 1) : double(l) * l;
    return p;
  }
  double bytes() const { return 2.0 * total() * d * (2.0 * hq + 2.0 * hkv); }
};

// One sampled query row of o (every head, bf16) against the reference's: the relative Frobenius error over the
// heads, the worst head's, and the non-finite count.
struct RowError {
  double error = 0.0, worst_head = 0.0;
  int64_t non_finite = 0;
};
RowError row_error(const std::vector<uint16_t>& o, const std::vector<double>& want, int64_t HQ, int64_t D) {
  RowError e;
  double err2 = 0, ref2 = 0;
  for (int64_t h = 0; h < HQ; ++h) {
    double re2 = 0, rr2 = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double got = host::bf16_to_f32(o[h * D + d]), w = want[h * D + d];
      if (!std::isfinite(got)) ++e.non_finite;
      re2 += (got - w) * (got - w);
      rr2 += w * w;
    }
    err2 += re2;
    ref2 += rr2;
    e.worst_head = std::max(e.worst_head, std::sqrt(re2 / std::max(rr2, 1e-30)));
  }
  e.error = std::sqrt(err2 / std::max(ref2, 1e-30));
  return e;
}

class PrefillCase final : public CaseInstance {
 public:
  PrefillCase(const DeviceContext& ctx, const std::string& op, const PrefillShape& sh)
      : sh_(sh), op_(op), device_(ctx.device) {
    const int64_t T = sh.total();
    std::vector<int32_t> cu = {0};
    for (int32_t l : sh.lengths) cu.push_back(cu.back() + l);
    cu_ = cu;
    cu_dev_ = upload_new(cu);
    max_seqlen_q_ = *std::max_element(sh.lengths.begin(), sh.lengths.end());
    sets_ = rotating_sets(ctx, sh.bytes());
    o_.allocate(T * sh.hq * sh.d * 2);
    for (int s = 0; s < sets_; ++s) {
      Rng rng(case_seed(op, sh.name, s));
      Set set;
      gen::FloatDist dist;
      dist.kind = gen::FloatDist::kNormal;
      for (auto [buf, heads] : {std::pair{&set.q, sh.hq}, std::pair{&set.k, sh.hkv}, std::pair{&set.v, sh.hkv}}) {
        buf->allocate(T * heads * sh.d * 2);
        gen::fill_float(buf->get(), DType::kBF16, T * heads * sh.d, rng.next(), dist, ctx.stream);
      }
      sets_data_.push_back(std::move(set));
    }
  }

  int num_sets() const override { return sets_; }

  // The public entry point, validation included (as a user calls it).
  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    const int64_t T = sh_.total(), B = static_cast<int64_t>(sh_.lengths.size());
    attention::PrefillParams params;
    params.causal = sh_.causal;
    const auto rows = [&](const DeviceBuffer& b, int64_t heads) {
      return TensorView::contiguous(b.get(), DType::kBF16, {T, heads, sh_.d}, device_);
    };
    const TensorView cu = TensorView::contiguous(cu_dev_.get(), DType::kInt32, {B + 1}, device_);
    attention::prefill_varlen(rows(s.q, sh_.hq), rows(s.k, sh_.hkv), rows(s.v, sh_.hkv), cu, cu, max_seqlen_q_,
                              rows(o_, sh_.hq), std::nullopt, params, stream);
  }

  CheckResult check(cudaStream_t stream) override {
    const int64_t HQ = sh_.hq, HKV = sh_.hkv, D = sh_.d;
    o_.fill_async(0xFF, stream);  // NaN
    run(stream, 0);
    const Set& set = sets_data_[0];
    // Sampled (sequence, query) rows: both ends of the first and last sequence, then random ones.
    std::vector<std::pair<int, int32_t>> rows;
    const int B = static_cast<int>(sh_.lengths.size());
    for (int b : {0, B - 1})
      for (int32_t i : {0, sh_.lengths[b] - 1}) rows.push_back({b, i});
    Rng rng(case_seed(op_, sh_.name + "/check", 0));
    while (rows.size() < 8) {
      const int b = rng.below(B);
      rows.push_back({b, static_cast<int32_t>(rng.next() % static_cast<uint64_t>(sh_.lengths[b]))});
    }
    const auto to_double = [](const std::vector<uint16_t>& bits) {
      std::vector<double> out(bits.size());
      for (size_t i = 0; i < bits.size(); ++i) out[i] = host::bf16_to_f32(bits[i]);
      return out;
    };
    std::vector<CheckResult> parts(rows.size());
    std::vector<std::string> labels(rows.size());
    for (size_t s = 0; s < rows.size(); ++s) {
      const auto [b, i] = rows[s];
      const int64_t token = cu_[b] + i, keys = sh_.causal ? i + 1 : sh_.lengths[b];
      const auto q = to_double(download_range<uint16_t>(set.q, token * HQ * D, HQ * D, stream));
      const auto k = to_double(download_range<uint16_t>(set.k, cu_[b] * HKV * D, keys * HKV * D, stream));
      const auto v = to_double(download_range<uint16_t>(set.v, cu_[b] * HKV * D, keys * HKV * D, stream));
      const auto o = download_range<uint16_t>(o_, token * HQ * D, HQ * D, stream);
      reference::PrefillRefParams p;
      p.causal = sh_.causal;
      const reference::PrefillRef ref = reference::prefill_reference(
          q, k, v, {0, 1}, {0, static_cast<int32_t>(keys)}, {1, sh_.hq, sh_.hkv, sh_.d}, p);
      const RowError e = row_error(o, ref.o, HQ, D);
      CheckResult& r = parts[s];
      r.compared = HQ * D;
      r.error = e.error;
      r.ok = e.non_finite == 0 && r.error <= 5e-3 && e.worst_head <= 2e-2;
      labels[s] = "sequence " + std::to_string(b) + " query " + std::to_string(i);
      if (!r.ok)
        r.message = std::to_string(e.non_finite) + " non-finite, relative error " + std::to_string(r.error) +
                    ", worst head " + std::to_string(e.worst_head);
    }
    return merge_checks(parts, labels,
                        std::to_string(rows.size()) + " sampled query rows (every head) within 5e-3 of float64");
  }

 private:
  struct Set {
    DeviceBuffer q, k, v;
  };

  PrefillShape sh_;
  std::string op_;
  std::vector<int32_t> cu_;
  int max_seqlen_q_ = 0;
  int device_ = 0;
  DeviceBuffer cu_dev_, o_;
  int sets_ = 1;
  std::vector<Set> sets_data_;
};

// Chunked prefill over a paged KV cache (prefill_with_cache): `batch` sequences, each of `cached` tokens plus `sq` new
// ones (already in the cache) on pages of its own, pages of `page` tokens in a shuffled order, causal.
struct PrefillCacheShape {
  std::string name;
  attention::KVFormat format = attention::KVFormat::kNative;
  int hq = 32, hkv = 8, d = 128, page = 64;
  int32_t cached = 30000, sq = 2048;
  int batch = 1;      // sequences, each sq new queries over `cached` keys on pages of its own
  int pack_gqa = -1;  // PrefillParams::pack_gqa
  int32_t length() const { return cached + sq; }
  int32_t pages() const { return (length() + page - 1) / page; }  // per sequence
  double pairs() const { return batch * (double(sq) * cached + 0.5 * double(sq) * (double(sq) + 1)); }
  int row_bytes() const { return reference::kv_row_bytes(format, d); }
  int64_t q_rows() const { return int64_t{batch} * sq; }
  double bytes() const { return 2.0 * 2.0 * q_rows() * hq * d + 2.0 * batch * double(length()) * hkv * row_bytes(); }
};

class PrefillCacheCase final : public CaseInstance {
 public:
  PrefillCacheCase(const DeviceContext& ctx, const std::string& op, const PrefillCacheShape& sh)
      : sh_(sh), op_(op), device_(ctx.device) {
    const int64_t P = int64_t{sh.batch} * sh.pages() + 3;  // a few pages no sequence uses
    std::vector<int32_t> order(P);
    std::iota(order.begin(), order.end(), 0);
    Rng rng(case_seed(op, sh.name + "/pages", 0));
    for (int64_t i = P - 1; i > 0; --i) std::swap(order[i], order[rng.below(static_cast<int>(i + 1))]);
    table_host_.assign(order.begin(), order.begin() + int64_t{sh.batch} * sh.pages());  // [batch, pages()]
    table_ = upload_new(table_host_);
    seqlens_ = upload_new(std::vector<int32_t>(sh.batch, sh.length()));
    std::vector<int32_t> cu(sh.batch + 1);
    for (int b = 0; b <= sh.batch; ++b) cu[b] = b * sh.sq;
    cu_ = upload_new(cu);
    num_pages_ = P;
    sets_ = rotating_sets(ctx, sh.bytes());
    o_.allocate(sh.q_rows() * sh.hq * sh.d * 2);
    gen::FloatDist dist;
    dist.kind = gen::FloatDist::kNormal;
    using attention::KVFormat;
    const bool native = sh.format == KVFormat::kNative, channel = attention::kv_key_per_channel(sh.format);
    const int ng = reference::kv_num_scale_groups(sh.format, sh.d);
    for (int s = 0; s < sets_; ++s) {
      Rng r(case_seed(op, sh.name, s));
      Set set;
      set.q.allocate(sh.q_rows() * sh.hq * sh.d * 2);
      gen::fill_float(set.q.get(), DType::kBF16, sh.q_rows() * sh.hq * sh.d, r.next(), dist, ctx.stream);
      for (int is_v = 0; is_v < 2; ++is_v) {
        DeviceBuffer& data = is_v ? set.v : set.k;
        const int64_t rows = P * sh.page * sh.hkv;
        if (native) {
          data.allocate(rows * sh.d * 2);
          gen::fill_float(data.get(), DType::kBF16, rows * sh.d, r.next(), dist, ctx.stream);
          continue;
        }
        // Quantized from N(0, 1) rows (fp8: scale 3.47 / 448, the normal bound), through the block table.
        gen::KVCacheFill fill;
        fill.format = sh.format;
        fill.batch = sh.batch;
        fill.capacity = int64_t{sh.pages()} * sh.page;
        fill.hkv = sh.hkv;
        fill.head_dim = sh.d;
        fill.page_size = sh.page;
        fill.block_table = table_.as<const int32_t>();
        fill.head_mag.assign(sh.hkv, 1.0f);
        fill.keys = !is_v;
        if (sh.format == KVFormat::kFP8) fill.fp8_scale.assign(sh.hkv, 3.4641017f / 448.0f);
        data.allocate(rows * sh.row_bytes());
        DeviceBuffer& pairs = is_v ? set.v_pairs : set.k_pairs;
        const int64_t pair_elems = (channel && !is_v) ? P * (sh.page / attention::kKeyBlock) * sh.hkv * 2 * sh.d
                                   : channel          ? rows * 2
                                                      : rows * 2 * ng;
        if (sh.format != KVFormat::kFP8) pairs.allocate(pair_elems * 2);
        gen::fill_kv_cache(fill, data.get(), sh.format != KVFormat::kFP8 ? pairs.as<uint16_t>() : nullptr, r.next(),
                           ctx.stream);
        if (sh.format == KVFormat::kFP8) (is_v ? set.v_fp8 : set.k_fp8) = upload_new(fill.fp8_scale);
      }
      sets_data_.push_back(std::move(set));
    }
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    const attention::KVCache cache = cache_view(s);
    attention::PrefillParams params;
    params.causal = true;
    params.pack_gqa = sh_.pack_gqa;
    attention::prefill_with_cache(
        TensorView::contiguous(s.q.get(), DType::kBF16, {sh_.q_rows(), sh_.hq, sh_.d}, device_),
        TensorView::contiguous(cu_.get(), DType::kInt32, {sh_.batch + 1}, device_), sh_.sq, cache,
        TensorView::contiguous(seqlens_.get(), DType::kInt32, {sh_.batch}, device_),
        TensorView::contiguous(o_.get(), DType::kBF16, {sh_.q_rows(), sh_.hq, sh_.d}, device_), std::nullopt, params,
        stream);
  }


  // Sampled query rows (the first sequence's first and last, two random ones of the last sequence) against float64
  // over the keys they attend to, gathered page by page through the block table.
  CheckResult check(cudaStream_t stream) override {
    const int64_t HQ = sh_.hq, HKV = sh_.hkv, D = sh_.d, row = HKV * D;
    o_.fill_async(0xFF, stream);  // NaN
    run(stream, 0);
    const Set& set = sets_data_[0];
    const int last_seq = sh_.batch - 1;
    Rng rng(case_seed(op_, sh_.name + "/check", 0));
    const std::vector<std::pair<int, int32_t>> rows = {{0, 0},
                                                        {0, sh_.sq - 1},
                                                        {last_seq, static_cast<int32_t>(rng.below(sh_.sq))},
                                                        {last_seq, static_cast<int32_t>(rng.below(sh_.sq))}};
    // The cache's values as the op must see them: the bf16 rows, or the rows dequantized by the reference rule.
    using attention::KVFormat;
    const bool native = sh_.format == KVFormat::kNative, channel = attention::kv_key_per_channel(sh_.format);
    const int rb = native ? 2 * sh_.d : sh_.row_bytes(), ng = reference::kv_num_scale_groups(sh_.format, sh_.d);
    const int vng = channel ? 1 : ng;
    std::vector<float> kf8(HKV, 1.0f), vf8(HKV, 1.0f);
    if (sh_.format == KVFormat::kFP8) {
      kf8 = download_range<float>(set.k_fp8, 0, HKV, stream);
      vf8 = download_range<float>(set.v_fp8, 0, HKV, stream);
    }
    // Keys [0, most) of sequence `seq`, dequantized, into k and v ([key][HKV][D]).
    const auto gather = [&](int seq, int32_t most, std::vector<double>& k, std::vector<double>& v) {
      k.assign(int64_t{most} * row, 0.0);
      v.assign(int64_t{most} * row, 0.0);
      for (int32_t p = 0; p * sh_.page < most; ++p) {
        const int64_t tokens = std::min<int64_t>(sh_.page, most - int64_t{p} * sh_.page);
        const int64_t page = table_host_[int64_t{seq} * sh_.pages() + p];
        const auto kb = download_range<uint8_t>(set.k, page * sh_.page * HKV * rb, tokens * HKV * rb, stream);
        const auto vb = download_range<uint8_t>(set.v, page * sh_.page * HKV * rb, tokens * HKV * rb, stream);
        std::vector<uint16_t> kp, vp;
        if (!native && sh_.format != KVFormat::kFP8) {
          kp = channel ? download_range<uint16_t>(set.k_pairs, page * (sh_.page / attention::kKeyBlock) * HKV * 2 * D,
                                                  (sh_.page / attention::kKeyBlock) * HKV * 2 * D, stream)
                       : download_range<uint16_t>(set.k_pairs, page * sh_.page * HKV * 2 * ng, tokens * HKV * 2 * ng,
                                                  stream);
          vp = download_range<uint16_t>(set.v_pairs, page * sh_.page * HKV * 2 * vng, tokens * HKV * 2 * vng, stream);
        }
        for (int64_t t = 0; t < tokens; ++t)
          for (int64_t hh = 0; hh < HKV; ++hh) {
            double* kd = &k[((int64_t{p} * sh_.page + t) * HKV + hh) * D];
            double* vd = &v[((int64_t{p} * sh_.page + t) * HKV + hh) * D];
            const uint8_t* kr = &kb[(t * HKV + hh) * rb];
            const uint8_t* vr = &vb[(t * HKV + hh) * rb];
            if (channel)
              reference::dequantize_key_row(sh_.format, kr, &kp[((t / attention::kKeyBlock) * HKV + hh) * 2 * D],
                                            sh_.d, kd);
            else
              reference::dequantize_kv_row(sh_.format, kr, kp.empty() ? nullptr : &kp[(t * HKV + hh) * 2 * ng],
                                           sh_.d, DType::kBF16, kf8[hh], kd);
            reference::dequantize_kv_row(sh_.format, vr, vp.empty() ? nullptr : &vp[(t * HKV + hh) * 2 * vng], sh_.d,
                                         DType::kBF16, vf8[hh], vd);
          }
      }
    };
    std::vector<CheckResult> parts(rows.size());
    std::vector<std::string> labels(rows.size());
    int gathered_seq = -1;
    std::vector<double> k, v;
    for (size_t s = 0; s < rows.size(); ++s) {
      const int seq = rows[s].first;
      const int32_t i = rows[s].second, keys = sh_.cached + i + 1;
      if (seq != gathered_seq) {  // every key of the sequence (its sampled rows attend to prefixes of them)
        gather(seq, sh_.length(), k, v);
        gathered_seq = seq;
      }
      const int64_t qrow = int64_t{seq} * sh_.sq + i;
      std::vector<double> q(HQ * D);
      const auto qb = download_range<uint16_t>(set.q, qrow * HQ * D, HQ * D, stream);
      for (int64_t j = 0; j < HQ * D; ++j) q[j] = host::bf16_to_f32(qb[j]);
      const std::vector<double> ks(k.begin(), k.begin() + int64_t{keys} * row);
      const std::vector<double> vs(v.begin(), v.begin() + int64_t{keys} * row);
      reference::PrefillRefParams p;
      p.causal = true;
      const reference::PrefillRef ref =
          reference::prefill_reference(q, ks, vs, {0, 1}, {0, keys}, {1, sh_.hq, sh_.hkv, sh_.d}, p);
      const auto o = download_range<uint16_t>(o_, qrow * HQ * D, HQ * D, stream);
      const RowError e = row_error(o, ref.o, HQ, D);
      CheckResult& r = parts[s];
      r.compared = HQ * D;
      r.error = e.error;
      r.ok = e.non_finite == 0 && r.error <= 5e-3;
      labels[s] = "sequence " + std::to_string(seq) + " query " + std::to_string(i);
      if (!r.ok) r.message = std::to_string(e.non_finite) + " non-finite, relative error " + std::to_string(r.error);
    }
    return merge_checks(parts, labels,
                        std::to_string(rows.size()) + " sampled query rows (every head) within 5e-3 of float64");
  }

 private:
  struct Set {
    DeviceBuffer q, k, v, k_pairs, v_pairs, k_fp8, v_fp8;
  };

  attention::KVCache cache_view(const Set& s) const {
    using attention::KVFormat;
    attention::KVCache cache;
    cache.format = sh_.format;
    const bool native = sh_.format == KVFormat::kNative;
    const DType dt = native ? DType::kBF16 : sh_.format == KVFormat::kFP8 ? DType::kFP8E4M3 : DType::kUInt8;
    const int64_t last = native ? sh_.d : sh_.row_bytes();
    cache.k = TensorView::contiguous(s.k.get(), dt, {num_pages_, sh_.page, sh_.hkv, last}, device_);
    cache.v = TensorView::contiguous(s.v.get(), dt, {num_pages_, sh_.page, sh_.hkv, last}, device_);
    if (sh_.format == KVFormat::kFP8) {
      cache.k_scale = TensorView::contiguous(s.k_fp8.get(), DType::kFP32, {sh_.hkv}, device_);
      cache.v_scale = TensorView::contiguous(s.v_fp8.get(), DType::kFP32, {sh_.hkv}, device_);
    } else if (!native) {
      const bool channel = attention::kv_key_per_channel(sh_.format);
      const int64_t ng = reference::kv_num_scale_groups(sh_.format, sh_.d), blocks = sh_.page / attention::kKeyBlock;
      const auto pairs = [&](const DeviceBuffer& b, int64_t rows, int64_t last) {
        return TensorView::contiguous(b.get(), DType::kFP16, {num_pages_, rows, sh_.hkv, last}, device_);
      };
      cache.k_scale = channel ? pairs(s.k_pairs, blocks, 2 * sh_.d) : pairs(s.k_pairs, sh_.page, 2 * ng);
      cache.v_scale = pairs(s.v_pairs, sh_.page, channel ? 2 : 2 * ng);
    }
    cache.block_table = TensorView::contiguous(table_.get(), DType::kInt32, {sh_.batch, sh_.pages()}, device_);
    return cache;
  }
  PrefillCacheShape sh_;
  std::string op_;
  int device_ = 0;
  int64_t num_pages_ = 0;
  std::vector<int32_t> table_host_;
  DeviceBuffer table_, seqlens_, cu_, o_;
  int sets_ = 1;
  std::vector<Set> sets_data_;
};

template <class T>
struct CaseTag {
  using type = T;
};

void add_prefill_cases(std::vector<CaseSpec>& cases) {
  const auto shape = [](std::string name, int hq, int hkv, int d, bool causal, std::vector<int32_t> lengths) {
    PrefillShape sh;
    sh.name = std::move(name) + (causal ? "/causal" : "");
    sh.hq = hq, sh.hkv = hkv, sh.d = d, sh.causal = causal, sh.lengths = std::move(lengths);
    return sh;
  };
  std::vector<PrefillShape> shapes = {
      shape("hq32kv8/B1/S16384", 32, 8, 128, true, {16384}),
      shape("hq32kv8/B1/S4096", 32, 8, 128, true, {4096}),
      shape("hq32kv8/B8/S2048", 32, 8, 128, false, std::vector<int32_t>(8, 2048)),
      shape("hq16kv2_d64/B4/S8192", 16, 2, 64, true, std::vector<int32_t>(4, 8192)),
      shape("hq16kv2_d256/B4/S8192", 16, 2, 256, true, std::vector<int32_t>(4, 8192)),
  };
  // 32 sequences, lengths proportional to 1/rank, 65,536 tokens in all (the rounding goes to the longest), in a
  // fixed shuffled order.
  {
    std::vector<int32_t> lengths(32);
    double harmonic = 0;
    for (int r = 1; r <= 32; ++r) harmonic += 1.0 / r;
    int64_t sum = 0;
    for (int r = 1; r <= 32; ++r) sum += lengths[r - 1] = static_cast<int32_t>(65536.0 / (r * harmonic));
    lengths[0] += static_cast<int32_t>(65536 - sum);
    Rng rng(0x5eed);
    for (int i = 31; i > 0; --i) std::swap(lengths[i], lengths[rng.below(i + 1)]);
    shapes.push_back(shape("hq32kv8/zipf32/T65536", 32, 8, 128, true, lengths));
  }
  // One case of instance type T over shape sh.
  const auto add = [&cases](auto tag, const auto& sh, bool headline) {
    using T = typename decltype(tag)::type;
    CaseSpec c;
    c.op = "prefill";
    c.name = sh.name;
    c.bytes = sh.bytes();
    c.flops = 4.0 * sh.hq * sh.d * sh.pairs();
    c.setup = [op = c.op, sh](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<T>(ctx, op, sh);
    };
    c.headline = headline;
    cases.push_back(std::move(c));
  };
  for (const PrefillShape& sh : shapes)
    add(CaseTag<PrefillCase>{}, sh,
        sh.name == "hq32kv8/B1/S16384/causal" || sh.name == "hq32kv8/B8/S2048" ||
            sh.name == "hq32kv8/zipf32/T65536/causal");
  for (attention::KVFormat f : {attention::KVFormat::kNative, attention::KVFormat::kFP8, attention::KVFormat::kInt8,
                                attention::KVFormat::kInt4, attention::KVFormat::kInt4KChannel}) {
    PrefillCacheShape sh;
    sh.format = f;
    sh.name = std::string("hq32kv8/chunked/L32048/paged64/") +
              (f == attention::KVFormat::kNative ? "bf16" : attention::kv_format_name(f)) + "/causal";
    add(CaseTag<PrefillCacheCase>{}, sh, false);
  }
  // Short chunks in a batch (16 sequences, 64 new tokens each over 4,096 cached): GQA packing puts a KV head's four
  // query heads in one tile (32 tokens each), half the tiles of one head per tile; the pack_gqa0 rows force the
  // latter, for the same-run comparison.
  for (attention::KVFormat f : {attention::KVFormat::kNative, attention::KVFormat::kInt8})
    for (int pack : {-1, 0}) {
      PrefillCacheShape sh;
      sh.format = f;
      sh.batch = 16;
      sh.cached = 4096;
      sh.sq = 64;
      sh.pack_gqa = pack;
      sh.name = std::string("hq32kv8/chunk64/B16/L4160/paged64/") +
                (f == attention::KVFormat::kNative ? "bf16" : attention::kv_format_name(f)) + "/causal" +
                (pack == 0 ? "/pack_gqa0" : "");
      add(CaseTag<PrefillCacheCase>{}, sh, false);
    }
}

TESSERA_BENCH_CASES(add_prefill_cases);

}  // namespace
}  // namespace tessera::bench
