// Shared by the decode and append_kv GPU tests: the KV formats under test, random values already rounded to the
// input dtype, the cache geometry (contiguous or paged, with padding), its host model (data and scale bytes, the
// quantization rule of attention.h) and its device copy.
//
// Per-channel key formats (kInt8KChannel, kInt4KChannel): keys are written a whole 32-slot block at a time
// (HostCache::put_key_block: codes of the block's rows and the block's per-channel scales in k_scale
// [outer, slots / 32, HKV, 2·D]); values row by row as kInt8 / kInt4 (put(true, ...)). The cache also has a key
// residual [B, 64, HKV, D] (16-bit, the dtype CacheGeom::residual_dtype), modelled in HostCache::res.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/attention_reference.h"
#include "tessera/attention.h"
#include "tessera/error.h"


namespace tessera::attention::kvtest {

using reference::DecodeCheck;
using reference::DecodeRef;
using reference::DecodeTolerance;
using test::DeviceBuffer;

// ---- formats and random values -------------------------------------------------------------------------------

struct Fmt {
  KVFormat format;
  DType dtype;  // kNative: the rows' dtype (and q's); otherwise q's default dtype
  bool per_head;  // kFP8: one scale per KV head
  const char* name;
};

inline constexpr Fmt kFormats[] = {
    {KVFormat::kNative, DType::kBF16, false, "native-bf16"}, {KVFormat::kNative, DType::kFP16, false, "native-fp16"},
    {KVFormat::kFP8, DType::kBF16, false, "fp8-tensor"},     {KVFormat::kFP8, DType::kBF16, true, "fp8-head"},
    {KVFormat::kInt8, DType::kBF16, false, "int8"},          {KVFormat::kInt4, DType::kBF16, false, "int4"},
    {KVFormat::kInt4Group32, DType::kBF16, false, "int4-group32"},
};

// The per-channel key formats: decode and append_kv take them; kept out of kFormats so that a test iterating over
// kFormats (the append_kv tests' row-wise model) does not meet a format whose keys are written per block.
inline constexpr Fmt kChannelFormats[] = {
    {KVFormat::kInt8KChannel, DType::kBF16, false, "int8-kchannel"},
    {KVFormat::kInt4KChannel, DType::kBF16, false, "int4-kchannel"},
};
// Every format decode reads: kFormats' seven (same indices), then the two per-channel ones (7, 8).
inline constexpr Fmt kDecodeFormats[] = {kFormats[0], kFormats[1], kFormats[2],        kFormats[3],       kFormats[4],
                                         kFormats[5], kFormats[6], kChannelFormats[0], kChannelFormats[1]};

inline bool is_native(const Fmt& f) { return f.format == KVFormat::kNative; }
inline bool is_key_channel(const Fmt& f) { return reference::kv_key_per_channel(f.format); }

inline float round_to(DType dt, float x) {
  return dt == DType::kFP16 ? host::fp16_to_f32(host::f32_to_fp16(x)) : host::bf16_to_f32(host::f32_to_bf16(x));
}
inline uint16_t bits_of(DType dt, float x) { return dt == DType::kFP16 ? host::f32_to_fp16(x) : host::f32_to_bf16(x); }

// Standard normals already rounded to bf16 / fp16, from 4096-entry tables picked by a splitmix64 stream: fast
// enough for tens of millions of values per test.
class Filler {
 public:
  explicit Filler(uint64_t seed) : state_(seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int i = 0; i < kTable; ++i) {
      bf16_[i] = round_to(DType::kBF16, normal(rng));
      fp16_[i] = round_to(DType::kFP16, normal(rng));
    }
  }
  void normals(float* p, int64_t n, DType dt) {
    const float* table = dt == DType::kFP16 ? fp16_ : bf16_;
    for (int64_t i = 0; i < n;) {
      uint64_t r = next();
      for (int j = 0; j < 5 && i < n; ++j, r >>= 12) p[i++] = table[r & (kTable - 1)];
    }
  }
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

 private:
  static constexpr int kTable = 4096;
  uint64_t state_;
  float bf16_[kTable], fp16_[kTable];
};

using test::current_device;
using test::strided;

// ---- the cache: geometry, host image, device copy -------------------------------------------------------------

struct CacheGeom {
  Fmt fmt;
  bool int4x2 = false;  // int4 data as kInt4x2 instead of kUInt8
  int B = 1, HKV = 1, D = 128;
  bool paged = false;
  int page_size = 0;
  int64_t capacity = 0;   // paged: a multiple of page_size
  int extra_pages = 3;    // paged: pages no sequence uses
  int64_t row_pad = 0;    // bytes after each head row (multiple of 16)
  int64_t scale_pad = 0;  // fp16 after each head's pairs (multiple of 2); the per-channel key scales get it
                          // rounded up to a multiple of 8 (their strides must be whole 16-byte vectors)
  int table_pad = 0;      // paged: block-table entries after each row's max_pages (never to be read)
  DType residual_dtype = DType::kBF16;  // per-channel formats: k_residual's dtype (append_kv: k_new's)
  int64_t residual_pad = 0;             // per-channel formats: elements after each residual head row (multiple of 8)

  // Derived by finish().
  int row_bytes = 0, NG = 0, max_pages = 0, table_stride = 0;
  int64_t num_outer = 0, slots = 0;  // B and capacity, or num_pages and page_size
  int64_t sh = 0, st = 0, so = 0;    // data strides, bytes
  int64_t ssh = 0, sst = 0, sso = 0; // scale strides, fp16 elements (per-channel formats: v_scale's)
  // Per-channel key formats only (k_channel): k_scale [num_outer, key_blocks, HKV, 2·D] strides (fp16 elements),
  // and the residual's [B, 64, HKV, D] strides (elements).
  bool k_channel = false;
  int64_t key_blocks = 0;              // slots / 32
  int64_t kch = 0, kcb = 0, kco = 0;   // head, block, outer
  int64_t rsh = 0, rss = 0, rsb = 0;   // head, slot, sequence

  void finish() {
    row_bytes = reference::kv_row_bytes(fmt.format, D);
    NG = reference::kv_num_scale_groups(fmt.format, D);
    k_channel = is_key_channel(fmt);
    if (paged) {
      max_pages = static_cast<int>(capacity / page_size);
      table_stride = max_pages + table_pad;
      num_outer = int64_t{B} * max_pages + extra_pages;
      slots = page_size;
    } else {
      num_outer = B;
      slots = capacity;
    }
    sh = row_bytes + row_pad;
    st = HKV * sh;
    ssh = 2 * NG + scale_pad;
    sst = HKV * ssh;
    so = slots * st;
    sso = slots * sst;
    if (k_channel) {
      if (slots % kKeyBlock != 0)
        ADD_FAILURE() << "test geometry: " << fmt.name << " needs a page size / capacity that is a multiple of 32, got "
                      << slots;
      key_blocks = slots / kKeyBlock;
      kch = 2 * D + (scale_pad + 7) / 8 * 8;
      kcb = HKV * kch;
      kco = key_blocks * kcb;
      rsh = D + residual_pad;
      rss = HKV * rsh;
      rsb = kKeyResidualRows * rss;
    }
  }
  DType data_dtype() const {
    switch (fmt.format) {
      case KVFormat::kNative: return fmt.dtype;
      case KVFormat::kFP8: return DType::kFP8E4M3;
      case KVFormat::kInt8:
      case KVFormat::kInt8KChannel: return DType::kUInt8;
      default: return int4x2 ? DType::kInt4x2 : DType::kUInt8;
    }
  }
  std::string describe() const {
    std::string s = std::string(fmt.name) + " D=" + std::to_string(D) + " HKV=" + std::to_string(HKV) +
                    " B=" + std::to_string(B) + " cap=" + std::to_string(capacity);
    s += paged ? " paged/" + std::to_string(page_size) : std::string(" contiguous");
    if (paged && table_pad) s += " table-pad " + std::to_string(table_pad);
    if (row_pad || scale_pad) s += " pads " + std::to_string(row_pad) + "B/" + std::to_string(scale_pad);
    if (int4x2) s += " int4x2";
    return s;
  }
};

// The bytes of the cache as they sit on the device, and where each (sequence, token, head) row is.
struct HostCache {
  CacheGeom g;
  std::vector<uint8_t> k, v;           // [num_outer][slots][HKV] rows of sh bytes
  std::vector<uint16_t> ks, vs;        // [num_outer][slots][HKV] of ssh fp16; empty without pairs
                                       // (per-channel formats: ks is [num_outer][key_blocks][HKV] of kch fp16)
  std::vector<float> kf, vf;           // kFP8 scales: [1] or [HKV]
  std::vector<int32_t> table;          // paged: [B][table_stride]; the padding names unused (garbage) pages
  std::vector<uint16_t> res;           // per-channel formats: k_residual [B][64][HKV] of rsh 16-bit keys

  // Data filled with `fill` (or random bytes when random_fill), pages shuffled.
  HostCache(const CacheGeom& geom, std::mt19937_64& rng, bool random_fill, uint8_t fill = 0xFF) : g(geom) {
    const int64_t rows = g.num_outer * g.slots * g.HKV;
    k.assign(rows * g.sh, fill);
    v.assign(rows * g.sh, fill);
    if (g.NG) {
      ks.assign(g.k_channel ? g.num_outer * g.kco : rows * g.ssh, static_cast<uint16_t>(fill * 0x101));
      vs.assign(rows * g.ssh, static_cast<uint16_t>(fill * 0x101));
    }
    if (g.k_channel) res.assign(int64_t{g.B} * g.rsb, static_cast<uint16_t>(fill * 0x101));
    if (random_fill) {
      for (auto& b : k) b = static_cast<uint8_t>(rng());
      for (auto& b : v) b = static_cast<uint8_t>(rng());
      for (auto& h : ks) h = static_cast<uint16_t>(rng());
      for (auto& h : vs) h = static_cast<uint16_t>(rng());
      for (auto& h : res) h = static_cast<uint16_t>(rng());
    }
    if (g.paged) {
      std::vector<int32_t> perm(g.num_outer);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      table.assign(int64_t{g.B} * g.table_stride, perm.back());
      for (int b = 0; b < g.B; ++b)
        std::copy(perm.begin() + int64_t{b} * g.max_pages, perm.begin() + int64_t{b + 1} * g.max_pages,
                  table.begin() + int64_t{b} * g.table_stride);
    }
  }
  // Where token t of sequence b lives: (outer, slot), or outer -1 if its page id is invalid.
  std::pair<int64_t, int64_t> locate(int b, int64_t t) const {
    if (!g.paged) return {b, t};
    const int32_t page = table[int64_t{b} * g.table_stride + t / g.page_size];
    if (page < 0 || page >= g.num_outer) return {-1, 0};
    return {page, t % g.page_size};
  }
  int64_t data_at(int64_t outer, int64_t slot, int h) const { return outer * g.so + slot * g.st + h * g.sh; }
  int64_t scale_at(int64_t outer, int64_t slot, int h) const { return outer * g.sso + slot * g.sst + h * g.ssh; }
  // Per-channel formats: the 2·D key scales of the block holding `slot`, and the residual row (b, slot r, h).
  int64_t key_scale_at(int64_t outer, int64_t slot, int h) const {
    return outer * g.kco + slot / kKeyBlock * g.kcb + h * g.kch;
  }
  int64_t residual_at(int b, int64_t r, int h) const { return b * g.rsb + r * g.rss + h * g.rsh; }
  float fp8_scale(bool is_v, int h) const {
    const std::vector<float>& s = is_v ? vf : kf;
    return s.size() == 1 ? s[0] : s[h];
  }
  // Quantizes row x (D floats) into the image at (b, t, h), as append_kv would. Per-channel formats: value rows
  // only (their keys go in by block: put_key_block).
  void put(bool is_v, int b, int64_t t, int h, const float* x) {
    if (g.k_channel && !is_v) {
      ADD_FAILURE() << "HostCache::put: keys of " << g.fmt.name << " are written by block (put_key_block)";
      return;
    }
    const auto [outer, slot] = locate(b, t);
    if (outer < 0) return;
    uint16_t* pairs = g.NG ? &(is_v ? vs : ks)[scale_at(outer, slot, h)] : nullptr;
    const float fp8 = g.fmt.format == KVFormat::kFP8 ? fp8_scale(is_v, h) : 1.0f;
    reference::quantize_kv_row(g.fmt.format, x, g.D, g.fmt.dtype, fp8, &(is_v ? v : k)[data_at(outer, slot, h)], pairs);
  }
  // Per-channel formats: quantizes the key rows x[0..n) ([n][D] floats, n in 1..32) of sequence b, tokens
  // [t0, t0 + n) with t0 a multiple of 32, head h, as one block (quantize_key_block): their codes and the block's
  // 2·D scales. The block's other rows are left as they are. Skipped on an invalid page.
  void put_key_block(int b, int64_t t0, int h, const float* x, int n) {
    if (!g.k_channel || t0 % kKeyBlock != 0 || n < 1 || n > kKeyBlock) {
      ADD_FAILURE() << "HostCache::put_key_block: " << g.fmt.name << " t0=" << t0 << " n=" << n;
      return;
    }
    const auto [outer, slot] = locate(b, t0);
    if (outer < 0) return;
    std::vector<uint8_t> codes(static_cast<size_t>(n) * g.row_bytes);
    reference::quantize_key_block(g.fmt.format, x, n, g.D, codes.data(), &ks[key_scale_at(outer, slot, h)]);
    for (int r = 0; r < n; ++r)  // the rows of a block are consecutive slots of one page
      std::copy(&codes[static_cast<size_t>(r) * g.row_bytes], &codes[static_cast<size_t>(r + 1) * g.row_bytes],
                &k[data_at(outer, slot + r, h)]);
  }
  // The dequantized row at (b, t, h).
  void get(bool is_v, int b, int64_t t, int h, double* out) const {
    const auto [outer, slot] = locate(b, t);
    if (g.k_channel && !is_v) {
      reference::dequantize_key_row(g.fmt.format, &k[data_at(outer, slot, h)], &ks[key_scale_at(outer, slot, h)],
                                    g.D, out);
      return;
    }
    const uint16_t* pairs = g.NG ? &(is_v ? vs : ks)[scale_at(outer, slot, h)] : nullptr;
    reference::dequantize_kv_row(g.fmt.format, &(is_v ? v : k)[data_at(outer, slot, h)], pairs, g.D, g.fmt.dtype,
                                 g.fmt.format == KVFormat::kFP8 ? fp8_scale(is_v, h) : 1.0f, out);
  }
};

struct DeviceCache {
  DeviceBuffer<uint8_t> k, v;
  DeviceBuffer<uint16_t> ks, vs;
  DeviceBuffer<float> kf, vf;
  DeviceBuffer<int32_t> table;
  DeviceBuffer<uint16_t> res;  // per-channel formats: k_residual
  KVCache view;

  explicit DeviceCache(const HostCache& h)
      : k(h.k), v(h.v), ks(h.ks), vs(h.vs), kf(h.kf), vf(h.vf), table(h.table), res(h.res) {
    const CacheGeom& g = h.g;
    const DType dt = g.data_dtype();
    const int64_t es = static_cast<int64_t>(dtype_size(dt));
    view.format = g.fmt.format;
    view.k = strided(k.get(), dt, {g.num_outer, g.slots, g.HKV, g.row_bytes / es},
                     {g.so / es, g.st / es, g.sh / es, 1});
    view.v = view.k;
    view.v.data = v.get();
    if (g.k_channel) {
      view.k_scale = strided(ks.get(), DType::kFP16, {g.num_outer, g.key_blocks, g.HKV, 2 * g.D}, {g.kco, g.kcb, g.kch, 1});
      view.v_scale = strided(vs.get(), DType::kFP16, {g.num_outer, g.slots, g.HKV, 2}, {g.sso, g.sst, g.ssh, 1});
      view.k_residual = strided(res.get(), g.residual_dtype, {g.B, kKeyResidualRows, g.HKV, g.D}, {g.rsb, g.rss, g.rsh, 1});
    } else if (g.NG) {
      view.k_scale = strided(ks.get(), DType::kFP16, {g.num_outer, g.slots, g.HKV, 2 * g.NG}, {g.sso, g.sst, g.ssh, 1});
      view.v_scale = *view.k_scale;
      view.v_scale->data = vs.get();
    } else if (g.fmt.format == KVFormat::kFP8) {
      view.k_scale = strided(kf.get(), DType::kFP32, {static_cast<int64_t>(h.kf.size())}, {1});
      view.v_scale = strided(vf.get(), DType::kFP32, {static_cast<int64_t>(h.vf.size())}, {1});
    }
    if (g.paged) view.block_table = strided(table.get(), DType::kInt32, {g.B, g.max_pages}, {g.table_stride, 1});
  }
  void upload(const HostCache& h) {
    k.upload(h.k);
    v.upload(h.v);
    ks.upload(h.ks);
    vs.upload(h.vs);
    table.upload(h.table);
    res.upload(h.res);
  }
};

// fp8 scales from the data's range: amax / 448 per head or over all heads (1 if all zero).
inline void set_fp8_scales(HostCache& c, const std::vector<float>& kx, const std::vector<float>& vx) {
  if (c.g.fmt.format != KVFormat::kFP8) return;
  const int HKV = c.g.HKV, D = c.g.D, n = c.g.fmt.per_head ? HKV : 1;
  for (int is_v = 0; is_v < 2; ++is_v) {
    const std::vector<float>& x = is_v ? vx : kx;
    std::vector<float> amax(n, 0.0f);
    for (size_t i = 0; i < x.size(); ++i) {
      const int h = static_cast<int>((i / D) % HKV) % n;
      amax[h] = std::max(amax[h], std::fabs(x[i]));
    }
    std::vector<float>& s = is_v ? c.vf : c.kf;
    s.resize(n);
    for (int h = 0; h < n; ++h) s[h] = amax[h] > 0 ? amax[h] / 448.0f : 1.0f;
  }
}

// ---- decode: one fixture per data set ---------------------------------------------------------------------------

}  // namespace tessera::attention::kvtest
