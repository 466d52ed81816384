// prefill_with_cache (include/tessera/attention.h) on the GPU: chunked prefill over the decode KV cache in every
// format, contiguous and paged (pages in random order, page sizes 16 to 256), against the float64 reference on the
// cache's (dequantized) values.
//
// Each sequence's queries are its last Sq positions of L = min(cache_seqlens, capacity) cached keys. Cache slots
// that hold no key are left as 0xFF bytes (NaN in bf16 / fp16): they must never reach the output, although the
// kernel's last key tile covers some of them. Outputs poisoned; the checks of prefill_test_util.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "gpu/kv_cache_test_util.h"
#include "gpu/prefill_test_util.h"
#include "reference/attention_reference.h"
#include "tessera/attention.h"

namespace tessera::attention {
namespace {

using kvtest::CacheGeom;
using kvtest::DeviceCache;
using kvtest::HostCache;
using prefilltest::Check;
using prefilltest::round16;
using prefilltest::widen16;
using test::strided;

struct CacheCase {
  kvtest::Fmt fmt = kvtest::kFormats[0];
  int D = 128, HQ = 8, HKV = 2, page_size = 0;  // page_size 0: contiguous
  int64_t capacity = 512;
  std::vector<int32_t> sq, seqlens;  // queries per sequence; cache_seqlens (may exceed the capacity)
  reference::PrefillRefParams params;
  int pack_gqa = -1;      // PrefillParams::pack_gqa
  bool outliers = false;  // keys with 3 of D channels 20x larger (what LLM keys look like; docs/perf/decode.md)
  bool corrupt_table = false;  // paged: block-table entries outside [0, num_pages) (-7, num_pages + 100, INT32_MAX)
  // With a window: the slots of keys below every query's window are never written (0xFF bytes, NaN in every format:
  // 16-bit and fp8 codes, or fp16 scales), as an engine that drops them leaves them; per-channel keys keep their
  // 32-token blocks that reach into the window.
  bool drop_outside_window = false;
  std::string describe() const {
    std::string s = std::string(fmt.name) + (fmt.dtype == DType::kFP16 ? " q=fp16" : " q=bf16") +
                    (outliers ? " outlier-keys" : "") + " D=" + std::to_string(D) + " HQ=" + std::to_string(HQ) +
                    " HKV=" + std::to_string(HKV) + " cap=" + std::to_string(capacity) +
                    (page_size ? " paged/" + std::to_string(page_size) : std::string(" contiguous")) +
                    (params.causal ? " causal" : "") +
                    (params.window ? " window=" + std::to_string(params.window) : "") +
                    (params.softcap > 0 ? " softcap" : "") + (drop_outside_window ? " dropped-below-window" : "") +
                    " pack_gqa=" + std::to_string(pack_gqa) +
                    " (sq,L)=";
    for (size_t b = 0; b < sq.size(); ++b) s += "(" + std::to_string(sq[b]) + "," + std::to_string(seqlens[b]) + ")";
    return s;
  }
};

// error_unquantized (optional): o's relative Frobenius error against the reference on the unquantized K / V.
// o_out / lse_out (optional): the op's outputs as downloaded.
Check run_cache_case(const CacheCase& c, uint64_t seed, double* error_unquantized = nullptr,
                     std::vector<uint16_t>* o_out = nullptr, std::vector<float>* lse_out = nullptr) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int B = static_cast<int>(c.sq.size());
  const bool fp16 = c.fmt.dtype == DType::kFP16;
  CacheGeom g;
  g.fmt = c.fmt;
  g.B = B;
  g.HKV = c.HKV;
  g.D = c.D;
  g.paged = c.page_size > 0;
  g.page_size = c.page_size;
  g.capacity = c.capacity;
  g.row_pad = 32;
  g.finish();
  HostCache host(g, rng, false, 0xFF);
  // Keys and values of the L cached positions of every sequence ([b][t][h][D], rounded to the 16-bit type), then
  // the cache written from them as append_kv would (per-channel keys a 32-token block at a time), and the values
  // the kernel sees (the dequantized cache) packed for the reference.
  std::vector<int32_t> cu_q = {0}, cu_k = {0};
  for (int b = 0; b < B; ++b) {
    const int32_t L = std::min<int64_t>(c.seqlens[b], c.capacity);
    cu_q.push_back(cu_q.back() + c.sq[b]);
    cu_k.push_back(cu_k.back() + L);
  }
  const int64_t total_q = cu_q.back(), total_k = cu_k.back();
  std::vector<float> kx(total_k * c.HKV * c.D), vx(kx.size());
  for (size_t i = 0; i < kx.size(); ++i) {
    const int d = static_cast<int>(i % c.D);
    const bool big = c.outliers && (d == 5 || d == 37 || d == c.D - 7);
    kx[i] = kvtest::round_to(c.fmt.dtype, (big ? 30.0f : 1.5f) * normal(rng));
    vx[i] = kvtest::round_to(c.fmt.dtype, normal(rng));
  }
  kvtest::set_fp8_scales(host, kx, vx);
  const auto at = [&](int b, int64_t t, int h) { return ((cu_k[b] + t) * c.HKV + h) * c.D; };
  // Keys below drop[b] (below the first query's window, so every query's) are left unwritten when asked.
  std::vector<int64_t> drop(B, 0);
  if (c.drop_outside_window && c.params.window > 0)
    for (int b = 0; b < B; ++b)
      drop[b] = std::max<int64_t>(0, (cu_k[b + 1] - cu_k[b]) - c.sq[b] - c.params.window + 1);
  // Whether key t of sequence b was written (its value: t >= drop; a per-channel key: its block reaches drop).
  const auto key_written = [&](int b, int64_t t) {
    if (!g.k_channel) return t >= drop[b];
    const int64_t t0 = t / kKeyBlock * kKeyBlock;
    return std::min<int64_t>(t0 + kKeyBlock, cu_k[b + 1] - cu_k[b]) > drop[b];
  };
  for (int b = 0; b < B; ++b) {
    const int64_t L = cu_k[b + 1] - cu_k[b];
    for (int h = 0; h < c.HKV; ++h) {
      for (int64_t t = drop[b]; t < L; ++t) host.put(true, b, t, h, &vx[at(b, t, h)]);
      if (!g.k_channel) {
        for (int64_t t = drop[b]; t < L; ++t) host.put(false, b, t, h, &kx[at(b, t, h)]);
        continue;
      }
      std::vector<float> block(static_cast<size_t>(kKeyBlock) * c.D);
      for (int64_t t0 = 0; t0 < L; t0 += kKeyBlock) {
        const int n = static_cast<int>(std::min<int64_t>(kKeyBlock, L - t0));
        if (!key_written(b, t0)) continue;
        for (int r = 0; r < n; ++r) std::copy_n(&kx[at(b, t0 + r, h)], c.D, &block[static_cast<size_t>(r) * c.D]);
        host.put_key_block(b, t0, h, block.data(), n);
      }
    }
  }
  std::vector<double> kd(kx.size()), vd(vx.size());
  for (int b = 0; b < B; ++b)
    for (int64_t t = 0; t < cu_k[b + 1] - cu_k[b]; ++t)
      for (int h = 0; h < c.HKV; ++h) {
        // Unwritten slots (NaN) are outside every query's window: the reference never weighs them; zeros keep its
        // inputs finite.
        if (key_written(b, t)) host.get(false, b, t, h, &kd[at(b, t, h)]);
        if (t >= drop[b]) host.get(true, b, t, h, &vd[at(b, t, h)]);
      }
  DeviceCache dev(host);
  if (c.corrupt_table) {
    std::vector<int32_t> bad = host.table;
    const int32_t wrong[] = {-7, static_cast<int32_t>(g.num_outer) + 100, INT32_MAX};
    for (size_t i = 0; i < bad.size(); i += 2) bad[i] = wrong[(i / 2) % 3];
    dev.table.upload(bad);
  }
  std::vector<uint16_t> qb(std::max<int64_t>(total_q * c.HQ * c.D, 8));
  std::vector<double> qd(total_q * c.HQ * c.D);
  for (size_t i = 0; i < qd.size(); ++i) {
    qb[i] = round16(normal(rng), fp16);
    qd[i] = widen16(qb[i], fp16);
  }
  const DType dt = fp16 ? DType::kFP16 : DType::kBF16;
  test::DeviceBuffer<uint16_t> q_dev(qb), o_dev(qb.size());
  test::DeviceBuffer<float> lse_dev(std::max<int64_t>(total_q * c.HQ, 1));
  test::DeviceBuffer<int32_t> cuq_dev(cu_q), len_dev(c.seqlens);
  o_dev.poison();
  lse_dev.poison();
  PrefillParams p;
  p.causal = c.params.causal;
  p.pack_gqa = c.pack_gqa;
  p.window = c.params.window;
  p.softcap = c.params.softcap;
  p.softmax_scale = c.params.softmax_scale;
  const int max_sq = B > 0 ? *std::max_element(c.sq.begin(), c.sq.end()) : 0;
  prefill_with_cache(strided(q_dev.get(), dt, {total_q, c.HQ, c.D}, {int64_t{c.HQ} * c.D, c.D, 1}),
                     strided(cuq_dev.get(), DType::kInt32, {B + 1}, {1}), max_sq, dev.view,
                     strided(len_dev.get(), DType::kInt32, {B}, {1}),
                     strided(o_dev.get(), dt, {total_q, c.HQ, c.D}, {int64_t{c.HQ} * c.D, c.D, 1}),
                     strided(lse_dev.get(), DType::kFP32, {total_q, c.HQ}, {c.HQ, 1}), p, nullptr);
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  const reference::PrefillRef ref = reference::prefill_reference(
      qd, kd, vd, cu_q, cu_k, reference::PrefillShape{B, c.HQ, c.HKV, c.D}, c.params);
  const std::vector<uint16_t> o = o_dev.download();
  const std::vector<float> lse = lse_dev.download();
  if (o_out != nullptr) *o_out = o;
  if (lse_out != nullptr) *lse_out = lse;
  if (error_unquantized != nullptr) {
    const std::vector<double> kxd(kx.begin(), kx.end()), vxd(vx.begin(), vx.end());
    const reference::PrefillRef exact = reference::prefill_reference(
        qd, kxd, vxd, cu_q, cu_k, reference::PrefillShape{B, c.HQ, c.HKV, c.D}, c.params);
    double e2 = 0.0, r2 = 0.0;
    for (int64_t t = 0; t < total_q; ++t)
      for (int64_t i = 0; i < int64_t{c.HQ} * c.D; ++i) {
        const double want = exact.o[t * c.HQ * c.D + i], got = widen16(o[t * c.HQ * c.D + i], fp16);
        e2 += (got - want) * (got - want);
        r2 += want * want;
      }
    *error_unquantized = r2 > 0.0 ? std::sqrt(e2 / r2) : 0.0;
  }
  return prefilltest::compare_outputs(o, int64_t{c.HQ} * c.D, c.D, lse, c.HQ, 1, ref, total_q, c.HQ, c.D, fp16);
}

// Runs c on a fresh seed (printed on failure) and expects it to match the reference.
void expect_matches_reference(const CacheCase& c) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
  const Check r = run_cache_case(c, seed);
  EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
}

class PrefillCacheGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

// Contiguous and paged caches of both 16-bit types, every head dim, causal and not: chunks of new queries over
// cached prefixes, a whole prompt (Sq = L), a decode-like single query, an empty chunk, a length past the capacity.
TEST_F(PrefillCacheGpu, NativeContiguousAndPaged) {
  const int pages[] = {0, 16, 64, 256};
  for (int D : {64, 128, 256})
    for (int pi = 0; pi < 4; ++pi)
      for (bool causal : {true, false}) {
        CacheCase c;
        c.fmt = kvtest::kFormats[(D + pi) % 2];  // native bf16 / fp16
        c.D = D;
        c.page_size = pages[pi];
        c.capacity = 512;
        c.sq = {37, 1, 130, 0, 200};
        c.seqlens = {300, 1, 130, 50, 600};  // 600: past the capacity, L = 512
        c.params.causal = causal;
        expect_matches_reference(c);
      }
}

// Every decode cache format (fp8 per tensor and per head, int8, int4, int4/32, the per-channel key formats) and head
// dim, contiguous and paged, against the dequantized cache: the kernel's fp16 dequantization and fp16 tensor-core
// path stay within the bf16 path's tolerance of those values.
TEST_F(PrefillCacheGpu, EveryQuantizedFormat) {
  int i = 0;
  for (const kvtest::Fmt& fmt : kvtest::kDecodeFormats) {
    if (kvtest::is_native(fmt)) continue;
    for (int D : {64, 128, 256}) {
      CacheCase c;
      c.fmt = fmt;
      c.fmt.dtype = i % 2 ? DType::kFP16 : DType::kBF16;  // q's dtype: bf16 q runs converted to fp16
      c.D = D;
      const int pages[] = {0, 32, 64, 256};
      c.page_size = pages[i % 4];
      c.capacity = 512;
      c.sq = {37, 1, 130, 0, 200};
      c.seqlens = {300, 1, 130, 50, 600};
      c.params.causal = i % 3 != 2;
      c.params.softcap = i % 5 == 4 ? 30.0f : 0.0f;
      ++i;
      expect_matches_reference(c);
    }
  }
}

// 128 query heads on one KV head over quantized caches (a packed tile holds one token of each head), packed and not.
TEST_F(PrefillCacheGpu, LargeGroupsPacked) {
  for (const int fi : {2, 4, 8})  // fp8 per tensor, int8, int4 per-channel keys
    for (int pack : {0, 1}) {
      CacheCase c;
      c.fmt = kvtest::kDecodeFormats[fi];
      c.D = 128;
      c.HQ = 128;
      c.HKV = 1;
      c.page_size = 64;
      c.capacity = 256;
      c.sq = {5, 33};
      c.seqlens = {200, 100};
      c.params.causal = true;
      c.pack_gqa = pack;
      expect_matches_reference(c);
    }
}

// The error table of docs/perf/prefill.md: every format at D 128 on Gaussian keys and on keys with outlier channels,
// o against the reference on the dequantized cache (checked, <= 5e-3) and on the unquantized K / V (printed: the
// format's own error, which prefill adds nothing to).
TEST_F(PrefillCacheGpu, ErrorTableAgainstUnquantizedValues) {
  for (bool outliers : {false, true})
    for (const kvtest::Fmt& fmt : kvtest::kDecodeFormats) {
      CacheCase c;
      c.fmt = fmt;
      c.D = 128;
      c.HQ = 8;
      c.HKV = 2;
      c.page_size = 64;
      c.capacity = 1024;
      c.sq = {256, 64};
      c.seqlens = {1000, 700};
      c.params.causal = true;
      c.outliers = outliers;
      const uint64_t seed = test::fresh_seed();
      SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
      double unquantized = 0.0;
      const Check r = run_cache_case(c, seed, &unquantized);
      EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
      std::printf("[ ERRTABLE ] %-14s %-9s vs dequantized %.2e  vs unquantized %.2e\n", fmt.name,
                  outliers ? "outliers" : "gaussian", r.error, unquantized);
    }
}

// A block table whose entries point outside the cache (device values are not validated): the op reads nothing
// outside the cache's tensors (compute-sanitizer; the subset runs this test) and completes, and such a page reads as
// zeros (TMA's fill past the tensor; no scale is read for it), so every output stays finite; the values themselves
// are meaningless and not compared.
TEST_F(PrefillCacheGpu, CorruptBlockTableStaysInBounds) {
  for (const kvtest::Fmt& fmt : {kvtest::kDecodeFormats[0], kvtest::kDecodeFormats[4], kvtest::kDecodeFormats[6],
                                 kvtest::kDecodeFormats[8]}) {  // native, int8, int4/32, int4 per-channel keys
    CacheCase c;
    c.fmt = fmt;
    c.D = 128;
    c.page_size = 32;
    c.capacity = 256;
    c.sq = {40, 100};
    c.seqlens = {200, 256};
    c.params.causal = true;
    c.corrupt_table = true;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
    std::vector<uint16_t> o;
    std::vector<float> lse;
    (void)run_cache_case(c, seed, nullptr, &o, &lse);  // completes (a fault would fail the synchronize inside)
    const bool fp16 = c.fmt.dtype == DType::kFP16;
    int64_t bad = 0;
    for (uint16_t x : o) bad += !std::isfinite(widen16(x, fp16));
    for (float x : lse) bad += std::isnan(x) || x == INFINITY;
    EXPECT_EQ(bad, 0) << "outputs that are NaN or infinite (lse: NaN or +inf)";
  }
}

// A window over keys an engine dropped: the slots below every query's window are never written (NaN in every format),
// the first key tile starts below the window (lo_key not on a tile boundary), contiguous and paged, every decode
// format. Without the first tile's V rows zeroed, 0 · NaN reaches o.
TEST_F(PrefillCacheGpu, WindowOverDroppedKeys) {
  for (const kvtest::Fmt& fmt : kvtest::kDecodeFormats)
    for (int page : {0, 32}) {
      CacheCase c;
      c.fmt = fmt;
      c.D = 128;
      c.HQ = 8;
      c.HKV = 2;
      c.page_size = page;
      c.capacity = 512;
      c.params.causal = true;
      c.params.window = 40;
      c.drop_outside_window = true;
      c.sq = {100, 37};
      c.seqlens = {300, 451};  // keys below 161 and 375 unwritten
      const uint64_t seed = test::fresh_seed();
      SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
      const Check r = run_cache_case(c, seed);
      EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
    }
}

// GQA ratios, windows and softcap over a paged cache; and a random configuration per seed (the stress step).
TEST_F(PrefillCacheGpu, GroupsWindowsSoftcapAndRandomConfiguration) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed ^ 0x2545f4914f6cdd1dull);
  auto below = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  for (int round = 0; round < 4; ++round) {
    CacheCase c;
    c.fmt = kvtest::kDecodeFormats[below(9)];
    c.D = 64 << below(3);
    const int groups[] = {1, 4, 5, 8, 16};
    c.HKV = 1 + below(2);
    c.HQ = c.HKV * groups[below(5)];
    const int pages[] = {0, 16, 32, 64, 128, 256};
    c.page_size = pages[below(6)];
    if (kvtest::is_key_channel(c.fmt) && c.page_size == 16) c.page_size = 32;  // their 32-token key blocks
    c.capacity = c.page_size ? int64_t{c.page_size} * (1 + below(600 / c.page_size + 1)) : 1 + below(700);
    if (kvtest::is_key_channel(c.fmt)) c.capacity = (c.capacity + 31) / 32 * 32;
    const int B = 1 + below(3);
    c.params.causal = below(3) != 0;
    c.params.window = below(3) == 0 ? 1 + below(300) : 0;
    c.drop_outside_window = c.params.window > 0;
    c.params.softcap = below(4) == 0 ? 20.0f : 0.0f;
    c.pack_gqa = below(3) - 1;
    for (int b = 0; b < B; ++b) {
      const int L = below(static_cast<int>(c.capacity) + 20);
      c.seqlens.push_back(L);
      const int Lc = std::min<int>(L, static_cast<int>(c.capacity));
      c.sq.push_back(c.params.causal ? below(Lc + 1) : below(200));
    }
    const uint64_t case_seed = test::fresh_seed();
    SCOPED_TRACE(c.describe() + " " + test::seed_note(case_seed));
    const Check r = run_cache_case(c, case_seed);
    EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
  }
}

}  // namespace
}  // namespace tessera::attention
