// Attention decode and append_kv: every validation rule (the error names the op and the argument), over the seven
// cache formats and both layouts, and the CacheDesc the rules produce.
//
// Validation runs before any device query, so host buffers stand in for device memory (device 0). A call that
// got past every rule fails at the device checks: without a GPU on cudaGetDevice, with one on the host pointer.
// The Accepted* tests check that the unmutated arguments get exactly that far, so each rule test fails for its
// rule. check_decode / check_append are called directly: the public ops only add the launch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attention/decode/config.h"
#include "attention/decode/problem.h"
#include "attention/prefill/problem.h"
#include "common/gpu_util.h"
#include "common/validation_util.h"
#include "tessera/attention.h"
#include "tessera/error.h"

namespace tessera::attention::detail {
namespace {

const char* const kDecode = "tessera::attention::decode";
const char* const kAppend = "tessera::attention::append_kv";

using test::HostBuffer;

// Larger than any view below reaches, so that a view moved into another buffer (the overlap tests) never reaches a
// third one.
struct Buffers {
  static constexpr std::size_t kBytes = 1 << 20;
  HostBuffer q{kBytes}, o{kBytes}, lse{kBytes}, k{kBytes}, v{kBytes}, ks{kBytes}, vs{kBytes}, bt{kBytes},
      seqlens{kBytes}, ws{kBytes}, k_new{kBytes}, v_new{kBytes}, positions{kBytes}, res{kBytes};
};
Buffers& buffers() {
  static Buffers b;  // the checks never write: one set serves every case
  return b;
}

constexpr int64_t kB = 2, kHQ = 8, kHKV = 2, kD = 128, kT = 64, kPageSize = 16, kNumPages = 6, kMaxPages = 4, kS = 3;

const KVFormat kFormats[] = {KVFormat::kNative,      KVFormat::kFP8,          KVFormat::kInt8,
                             KVFormat::kInt4,        KVFormat::kInt4Group32,  KVFormat::kInt8KChannel,
                             KVFormat::kInt4KChannel};

bool is_int4(KVFormat f) {
  return f == KVFormat::kInt4 || f == KVFormat::kInt4Group32 || f == KVFormat::kInt4KChannel;
}
bool is_channel(KVFormat f) { return f == KVFormat::kInt8KChannel || f == KVFormat::kInt4KChannel; }
int64_t row_elems(KVFormat f) { return is_int4(f) ? kD / 2 : kD; }
int64_t num_groups(KVFormat f) { return f == KVFormat::kInt4Group32 ? kD / 32 : 1; }
// Paged caches of the per-channel formats need pages of whole 32-token key blocks: pages of one block and two pages
// per sequence, for the capacity of the others (64 tokens). (Their k_scale then has a block dim of size 1; the
// variants below take larger pages too.)
int64_t page_size_of(KVFormat f) { return is_channel(f) ? kKeyBlock : kPageSize; }
int64_t max_pages_of(KVFormat f) { return is_channel(f) ? 2 : kMaxPages; }

TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return TensorView::contiguous(data, dtype, shape, 0);
}
void* shift(void* p, int64_t bytes) { return static_cast<uint8_t*>(p) + bytes; }

// Dense views of k, v and (integer formats) their scales for d0 sequences or pages of d1 tokens, at the same
// addresses: k_scale [d0, d1, HKV, 2 * NG], or [d0, d1 / 32, HKV, 2 * D] for the per-channel formats.
void set_slots(KVCache& c, int64_t d0, int64_t d1) {
  const KVFormat f = c.format;
  c.k = view(c.k.data, c.k.dtype, {d0, d1, kHKV, row_elems(f)});
  c.v = view(c.v.data, c.v.dtype, {d0, d1, kHKV, row_elems(f)});
  if (f == KVFormat::kNative || f == KVFormat::kFP8) return;
  c.k_scale = is_channel(f) ? view(c.k_scale->data, DType::kFP16, {d0, d1 / kKeyBlock, kHKV, 2 * kD})
                            : view(c.k_scale->data, DType::kFP16, {d0, d1, kHKV, 2 * num_groups(f)});
  c.v_scale = view(c.v_scale->data, DType::kFP16, {d0, d1, kHKV, 2 * num_groups(f)});
}

KVCache make_cache(KVFormat f, bool paged) {
  Buffers& b = buffers();
  KVCache c;
  c.format = f;
  const DType dt = f == KVFormat::kNative ? DType::kBF16 : f == KVFormat::kFP8 ? DType::kFP8E4M3 : DType::kUInt8;
  c.k = view(b.k.data(), dt, {1});
  c.v = view(b.v.data(), dt, {1});
  if (f == KVFormat::kFP8) {
    c.k_scale = view(b.ks.data(), DType::kFP32, {kHKV});
    c.v_scale = view(b.vs.data(), DType::kFP32, {kHKV});
  } else if (f != KVFormat::kNative) {
    c.k_scale = view(b.ks.data(), DType::kFP16, {1});
    c.v_scale = view(b.vs.data(), DType::kFP16, {1});
  }
  set_slots(c, paged ? kNumPages : kB, paged ? page_size_of(f) : kT);
  if (paged) c.block_table = view(b.bt.data(), DType::kInt32, {kB, max_pages_of(f)});
  return c;
}

// A key residual [B, 64, HKV, D] of the given dtype (append_kv needs one for the per-channel formats).
TensorView make_residual(DType dt = DType::kBF16) {
  return view(buffers().res.data(), dt, {kB, kKeyResidualRows, kHKV, kD});
}

// Which formats and layouts a case applies to. A mask with no layout bit applies to both layouts.
// kIntegers: the formats with per-row (or per-group) pairs in both k_scale and v_scale; kChannel: per-channel keys.
enum : unsigned {
  kNat = 1u << 0, kF8 = 1u << 1, kI8 = 1u << 2, kI4 = 1u << 3, kI4G = 1u << 4, kI8C = 1u << 5, kI4C = 1u << 6,
  kContig = 1u << 7, kPaged = 1u << 8,
  kIntegers = kI8 | kI4 | kI4G, kChannel = kI8C | kI4C, kQuant = kF8 | kIntegers | kChannel, kAll = kNat | kQuant,
};
bool applies(unsigned mask, KVFormat f, bool paged) {
  const unsigned layouts = (mask & (kContig | kPaged)) ? mask : mask | kContig | kPaged;
  return (mask & (1u << static_cast<int>(f))) && (layouts & (paged ? kPaged : kContig));
}
std::string describe(KVFormat f, bool paged) {
  return std::string(kv_format_name(f)) + (paged ? " paged" : " contiguous");
}

int64_t elem(const KVCache& c) { return static_cast<int64_t>(dtype_size(c.k.dtype)); }
// Applies `m` to k and v alike (their shapes and strides must agree), or to both scales.
template <typename F> void both(KVCache& c, F m) { m(c.k); m(c.v); }
template <typename F> void both_scales(KVCache& c, F m) { m(*c.k_scale); m(*c.v_scale); }

// Runs `call`, which must throw naming `op` and `arg` first, with every string of `says` in the message.
void expect_error(const std::function<void()>& call, const char* op, const std::string& arg,
                  const std::vector<std::string>& says) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming '" << arg << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    const std::string head = std::string(op) + ": '" + arg + "'";
    EXPECT_EQ(msg.find(head), 0u) << "expected \"" << head << "\" at the start of: " << msg;
    for (const std::string& s : says) EXPECT_NE(msg.find(s), std::string::npos) << "expected \"" << s << "\" in: " << msg;
  }
}

// A call that got past every rule fails at the first device check. `may_pass`: the call touches no memory at all
// (every view empty), so there is nothing on a device to check.
void expect_reaches_device_checks(const std::function<void()>& call, bool may_pass = false) {
  try {
    call();
    if (!may_pass) ADD_FAILURE() << "host buffers accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(test::is_device_check_error(e.what())) << "stopped before the device checks: " << e.what();
  }
}

// ---- decode ---------------------------------------------------------------------------------------------------

struct DecodeArgs {
  TensorView q, seqlens, o;
  KVCache cache;
  std::optional<TensorView> lse;
  Workspace workspace;
  DecodeParams params;
};

DecodeArgs make_decode(KVFormat f, bool paged) {
  Buffers& b = buffers();
  DecodeArgs a;
  a.q = view(b.q.data(), DType::kBF16, {kB, kHQ, kD});
  a.o = view(b.o.data(), DType::kBF16, {kB, kHQ, kD});
  a.lse = view(b.lse.data(), DType::kFP32, {kB, kHQ});
  a.seqlens = view(b.seqlens.data(), DType::kInt32, {kB});
  a.cache = make_cache(f, paged);
  return a;
}

void call_decode(const DecodeArgs& a) {
  (void)check_decode(kDecode, a.q, a.cache, a.seqlens, a.o, a.lse, a.workspace, a.params);
}

// Explicit splits and exactly the workspace they need (after the cap at one split per 16 tokens of capacity).
void set_splits(DecodeArgs& a, int requested, int effective, int64_t missing_bytes = 0) {
  a.params.num_splits = requested;
  a.workspace.data = buffers().ws.data();
  a.workspace.bytes = decode_workspace_bytes_for(kB, 1, a.q.shape[1], kD, effective, false) - missing_bytes;
}

// q and o as [B, S, HQ, D] with S new tokens (o with its own count when given).
void set_new_tokens(DecodeArgs& a, int64_t s_q, int64_t s_o = -1) {
  a.q = view(a.q.data, a.q.dtype, {kB, s_q, kHQ, kD});
  a.o = view(a.o.data, a.o.dtype, {kB, s_o < 0 ? s_q : s_o, kHQ, kD});
}

struct DecodeCase {
  const char* name;
  unsigned applies;
  std::function<void(DecodeArgs&)> mutate;
  const char* arg;
  std::vector<std::string> says = {};
};

const std::vector<DecodeCase>& decode_cases() {
  static const std::vector<DecodeCase> all = {
      // ---- q
      {"q fp32", kAll, [](DecodeArgs& a) { a.q.dtype = DType::kFP32; }, "q", {"bf16 | fp16", "got fp32"}},
      {"q rank 2", kAll, [](DecodeArgs& a) { a.q = view(a.q.data, a.q.dtype, {kB, kHQ * kD}); }, "q",
       {"[B, HQ, D] or [B, S, HQ, D]", "[2, 1024]"}},
      {"q 9 new tokens", kAll, [](DecodeArgs& a) { set_new_tokens(a, 9); }, "q",
       {"1 to 8 new tokens", "S, dim 1", "[2, 9, 8, 128]"}},
      {"q 0 new tokens", kAll, [](DecodeArgs& a) { set_new_tokens(a, 0); }, "q", {"1 to 8 new tokens"}},
      {"4-D q, HQ not a multiple of HKV", kAll, [](DecodeArgs& a) { a.q = view(a.q.data, a.q.dtype, {kB, 2, 7, kD}); },
       "q", {"(dim 2): HQ (7)"}},
      {"4-D q, D 96", kAll, [](DecodeArgs& a) { a.q = view(a.q.data, a.q.dtype, {kB, 2, kHQ, 96}); }, "q",
       {"head dim D (dim 3)"}},
      {"3-D o under a 4-D q", kAll, [](DecodeArgs& a) { a.q = view(a.q.data, a.q.dtype, {kB, 2, kHQ, kD}); }, "o",
       {"[B, S, HQ, D]"}},
      {"4-D o, another S", kAll, [](DecodeArgs& a) { set_new_tokens(a, 2, 3); }, "o",
       {"[B, S, HQ, D]", "[2, 2, 8, 128]", "[2, 3, 8, 128]"}},
      {"[B, HQ] lse under a 4-D q", kAll, [](DecodeArgs& a) { set_new_tokens(a, 2); }, "lse", {"[B, S, HQ]"}},
      {"q D 96", kAll, [](DecodeArgs& a) { a.q.shape[2] = 96; }, "q", {"64, 128 or 256", "[2, 8, 96]"}},
      {"q D 32", kAll, [](DecodeArgs& a) { a.q.shape[2] = 32; }, "q", {"64, 128 or 256"}},
      {"q no heads", kAll, [](DecodeArgs& a) { a.q.shape[1] = 0; }, "q", {"heads"}},
      {"q negative B", kAll, [](DecodeArgs& a) { a.q.shape[0] = -1; }, "q", {"non-negative sizes"}},
      {"HQ not a multiple of HKV", kAll, [](DecodeArgs& a) { a.q.shape[1] = 7; }, "q",
       {"HQ (7) must be a multiple of the KV heads (2"}},
      {"257 query heads per KV head", kAll, [](DecodeArgs& a) { a.q.shape[1] = 2 * 257; }, "q", {"256"}},
      {"q D stride", kAll, [](DecodeArgs& a) { a.q.strides[2] = 2; }, "q", {"unit stride"}},
      {"q address", kAll, [](DecodeArgs& a) { a.q.data = shift(a.q.data, 2); }, "q", {"16-byte aligned"}},
      {"q batch stride", kAll, [](DecodeArgs& a) { a.q.strides[0] = kHQ * kD + 4; }, "q",
       {"dim 0", "multiple of 16 bytes (8 elements of bf16)", "got 1028"}},
      {"q head stride", kAll, [](DecodeArgs& a) { a.q.strides[1] = kD + 4; }, "q", {"dim 1", "16 bytes"}},
      {"q negative stride", kAll, [](DecodeArgs& a) { a.q.strides[1] = -kD; }, "q", {"non-negative"}},
      // ---- cache data
      {"format 7", kAll, [](DecodeArgs& a) { a.cache.format = static_cast<KVFormat>(7); }, "cache.format", {"7"}},
      {"k rank 3", kAll, [](DecodeArgs& a) { a.cache.k = view(a.cache.k.data, a.cache.k.dtype, {kB, kT, kD}); },
       "cache.k", {"rank 4"}},
      {"native cache fp16 under bf16 q", kNat,
       [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.dtype = DType::kFP16; }); }, "cache.k",
       {"must have dtype bf16", "got fp16"}},
      {"native cache bf16 under fp16 q", kNat,
       [](DecodeArgs& a) { a.q.dtype = a.o.dtype = DType::kFP16; }, "cache.k", {"must have dtype fp16", "got bf16"}},
      {"native cache fp32", kNat, [](DecodeArgs& a) { a.cache.k.dtype = DType::kFP32; }, "cache.k", {"bf16 | fp16"}},
      {"fp8 cache e5m2", kF8, [](DecodeArgs& a) { a.cache.k.dtype = DType::kFP8E5M2; }, "cache.k", {"fp8_e4m3"}},
      {"fp8 cache as uint8", kF8, [](DecodeArgs& a) { a.cache.k.dtype = DType::kUInt8; }, "cache.k", {"fp8_e4m3"}},
      {"int8 cache signed", kI8 | kI8C, [](DecodeArgs& a) { a.cache.k.dtype = DType::kInt8; }, "cache.k",
       {"must have dtype uint8,"}},
      {"int8 cache as int4x2", kI8 | kI8C, [](DecodeArgs& a) { a.cache.k.dtype = DType::kInt4x2; }, "cache.k", {"uint8"}},
      {"int4 cache bf16", kI4 | kI4G | kI4C, [](DecodeArgs& a) { a.cache.k.dtype = DType::kBF16; }, "cache.k",
       {"uint8 | int4x2"}},
      {"row of 2D", kAll, [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[3] *= 2; }); }, "cache.k",
       {"in dim 3"}},
      {"int4 row of D bytes", kI4 | kI4G | kI4C, [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[3] = kD; }); },
       "cache.k", {"size 64 (D/2 bytes"}},
      {"no KV heads", kAll, [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[2] = 0; }); }, "cache.k",
       {"KV heads"}},
      {"contiguous cache of 3 sequences", kAll | kContig,
       [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[0] = 3; }); }, "cache.k", {"size 2 (B"}},
      {"k last stride", kAll, [](DecodeArgs& a) { a.cache.k.strides[3] = 2; }, "cache.k", {"unit stride"}},
      {"k address", kAll, [](DecodeArgs& a) { a.cache.k.data = shift(a.cache.k.data, 8); }, "cache.k",
       {"16-byte aligned"}},
      {"k token stride", kAll, [](DecodeArgs& a) { a.cache.k.strides[1] += 8 / elem(a.cache); }, "cache.k",
       {"dim 1", "multiple of 16 bytes"}},
      {"k outer stride 2^40 bytes", kAll,  // v moved far away, so that the overlap rules pass
       [](DecodeArgs& a) {
         const int64_t stride = (int64_t{1} << 40) / elem(a.cache);
         both(a.cache, [stride](TensorView& t) { t.strides[0] = stride; });
         a.cache.v.data = shift(a.cache.k.data, int64_t{1} << 44);
       },
       "cache.k", {"strides below 2^40 bytes", "dim 0"}},
      {"k head stride", kAll, [](DecodeArgs& a) { a.cache.k.strides[2] += 8 / elem(a.cache); }, "cache.k",
       {"dim 2", "multiple of 16 bytes"}},
      {"k outer stride", kAll, [](DecodeArgs& a) { a.cache.k.strides[0] += 8 / elem(a.cache); }, "cache.k",
       {"dim 0", "multiple of 16 bytes"}},
      {"k negative stride", kAll, [](DecodeArgs& a) { a.cache.k.strides[0] *= -1; }, "cache.k", {"non-negative"}},
      {"v address", kAll, [](DecodeArgs& a) { a.cache.v.data = shift(a.cache.v.data, 8); }, "cache.v",
       {"16-byte aligned"}},
      {"v dtype", kAll, [](DecodeArgs& a) { a.cache.v.dtype = DType::kFP32; }, "cache.v", {"dtype of 'cache.k'"}},
      {"v shape", kAll, [](DecodeArgs& a) { a.cache.v.shape[1] /= 2; }, "cache.v", {"shape of 'cache.k'"}},
      {"v strides differ from k", kAll, [](DecodeArgs& a) { a.cache.v.strides[0] *= 2; }, "cache.v",
       {"strides of 'cache.k'", "one set of strides"}},
      {"v is k", kAll, [](DecodeArgs& a) { a.cache.v.data = a.cache.k.data; }, "cache.v", {"overlap 'cache.k'"}},
      {"v one row after k", kAll,
       [](DecodeArgs& a) { a.cache.v.data = shift(a.cache.k.data, a.cache.k.shape[3] * elem(a.cache)); }, "cache.v",
       {"overlap 'cache.k'"}},
      // ---- paged layout
      {"page size 24", kAll | kPaged, [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[1] = 24; }); },
       "cache.k", {"power of two", "[6, 24, 2"}},
      {"page size 8", kAll | kPaged, [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[1] = 8; }); },
       "cache.k", {"[16, 256]"}},
      {"page size 512", kAll | kPaged, [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[1] = 512; }); },
       "cache.k", {"[16, 256]"}},
      {"2^31 pages", kAll | kPaged,
       [](DecodeArgs& a) {
         both(a.cache, [](TensorView& t) { t.shape[0] = int64_t{1} << 31; });
         a.cache.v.data = shift(a.cache.k.data, int64_t{1} << 50);
       },
       "cache.k", {"at most 2147483647 pages"}},
      {"no pages", kAll | kPaged, [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[0] = 0; }); },
       "cache.k", {"at least one page"}},
      {"block table int64", kAll | kPaged, [](DecodeArgs& a) { a.cache.block_table->dtype = DType::kInt64; },
       "cache.block_table", {"int32"}},
      {"block table rank 1", kAll | kPaged,
       [](DecodeArgs& a) { a.cache.block_table = view(a.cache.block_table->data, DType::kInt32, {kB * kMaxPages}); },
       "cache.block_table", {"rank 2"}},
      {"block table of 3 sequences", kAll | kPaged, [](DecodeArgs& a) { a.cache.block_table->shape[0] = 3; },
       "cache.block_table", {"size 2 (B"}},
      {"block table of no pages", kAll | kPaged, [](DecodeArgs& a) { a.cache.block_table->shape[1] = 0; },
       "cache.block_table", {"at least one page per sequence"}},
      {"block table column stride", kAll | kPaged, [](DecodeArgs& a) { a.cache.block_table->strides[1] = 2; },
       "cache.block_table", {"unit stride"}},
      {"block table zero row stride", kAll | kPaged, [](DecodeArgs& a) { a.cache.block_table->strides[0] = 0; },
       "cache.block_table", {"positive row stride"}},
      {"block table address", kAll | kPaged,
       [](DecodeArgs& a) { a.cache.block_table->data = shift(a.cache.block_table->data, 2); }, "cache.block_table",
       {"4-byte"}},
      {"paged capacity 2^31", kAll | kPaged, [](DecodeArgs& a) { a.cache.block_table->shape[1] = int64_t{1} << 27; },
       "cache.block_table", {"2^31", "134217728 pages of "}},
      {"contiguous capacity 2^31", kAll | kContig,
       [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.shape[1] = int64_t{1} << 31; }); }, "cache.k",
       {"2^31"}},
      // ---- scales
      {"native with k_scale", kNat, [](DecodeArgs& a) { a.cache.k_scale = view(buffers().ks.data(), DType::kFP32, {1}); },
       "cache.k_scale", {"absent"}},
      {"native with v_scale", kNat, [](DecodeArgs& a) { a.cache.v_scale = view(buffers().vs.data(), DType::kFP32, {1}); },
       "cache.v_scale", {"absent"}},
      {"no k_scale", kQuant, [](DecodeArgs& a) { a.cache.k_scale.reset(); }, "cache.k_scale", {"is required"}},
      {"no v_scale", kQuant, [](DecodeArgs& a) { a.cache.v_scale.reset(); }, "cache.v_scale", {"is required"}},
      {"fp8 scale fp16", kF8, [](DecodeArgs& a) { a.cache.k_scale->dtype = DType::kFP16; }, "cache.k_scale",
       {"fp32"}},
      {"fp8 scale of 3", kF8, [](DecodeArgs& a) { a.cache.k_scale->shape[0] = 3; }, "cache.k_scale",
       {"[1] (per tensor) or [HKV] = [2] (per KV head), got [3]"}},
      {"fp8 scale rank 2", kF8,
       [](DecodeArgs& a) { a.cache.k_scale = view(a.cache.k_scale->data, DType::kFP32, {1, kHKV}); },
       "cache.k_scale", {"rank 1"}},
      {"fp8 scale strided", kF8, [](DecodeArgs& a) { a.cache.k_scale->strides[0] = 2; }, "cache.k_scale",
       {"contiguous"}},
      {"fp8 scale address", kF8, [](DecodeArgs& a) { a.cache.v_scale->data = shift(a.cache.v_scale->data, 2); },
       "cache.v_scale", {"4-byte"}},
      {"fp8 per-tensor k_scale, per-head v_scale", kF8, [](DecodeArgs& a) { a.cache.k_scale->shape[0] = 1; },
       "cache.v_scale", {"shape of 'cache.k_scale' [1]", "got [2]"}},
      {"fp8 scale inside k", kF8, [](DecodeArgs& a) { a.cache.k_scale->data = a.cache.k.data; }, "cache.k_scale",
       {"overlap 'cache.k'"}},
      {"int scale fp32", kIntegers | kChannel, [](DecodeArgs& a) { a.cache.k_scale->dtype = DType::kFP32; }, "cache.k_scale",
       {"fp16"}},
      {"int scale rank 3", kIntegers | kChannel,
       [](DecodeArgs& a) { a.cache.k_scale = view(a.cache.k_scale->data, DType::kFP16, {kB, kT, kHKV * 2}); },
       "cache.k_scale", {"rank 4"}},
      {"int scale with a pair too many", kIntegers,
       [](DecodeArgs& a) { both_scales(a.cache, [](TensorView& t) { t.shape[3] += 2; }); }, "cache.k_scale",
       {"2 * NG"}},
      {"int4 group32 scale with one pair", kI4G,
       [](DecodeArgs& a) { both_scales(a.cache, [](TensorView& t) { t.shape[3] = 2; }); }, "cache.k_scale",
       {"NG = 4", ", 8], got", ", 2]"}},
      {"int scale token dim", kIntegers, [](DecodeArgs& a) { a.cache.k_scale->shape[1] -= 1; }, "cache.k_scale",
       {"dims 0..2 of cache.k"}},
      {"int scale last stride", kIntegers, [](DecodeArgs& a) { a.cache.k_scale->strides[3] = 2; }, "cache.k_scale",
       {"unit stride"}},
      {"int scale odd head stride", kIntegers, [](DecodeArgs& a) { a.cache.k_scale->strides[2] += 1; },
       "cache.k_scale", {"dim 2", "multiple of 4 bytes (2 elements of fp16)"}},
      {"int scale address", kIntegers, [](DecodeArgs& a) { a.cache.k_scale->data = shift(a.cache.k_scale->data, 2); },
       "cache.k_scale", {"4-byte"}},
      {"int scale negative stride", kIntegers | kChannel, [](DecodeArgs& a) { a.cache.k_scale->strides[0] *= -1; },
       "cache.k_scale", {"non-negative"}},
      {"int v_scale strides differ", kIntegers, [](DecodeArgs& a) { a.cache.v_scale->strides[0] *= 2; },
       "cache.v_scale", {"strides of 'cache.k_scale'"}},
      {"int v_scale is k_scale", kIntegers | kChannel, [](DecodeArgs& a) { a.cache.v_scale->data = a.cache.k_scale->data; },
       "cache.v_scale", {"overlap 'cache.k_scale'"}},
      {"int k_scale inside v", kIntegers | kChannel, [](DecodeArgs& a) { a.cache.k_scale->data = a.cache.v.data; },
       "cache.k_scale", {"overlap 'cache.v'"}},
      // ---- per-channel key formats: whole key blocks, k_scale per block and channel, v_scale per row
      {"kchannel page size 16", kChannel | kPaged, [](DecodeArgs& a) { set_slots(a.cache, kNumPages, 16); },
       "cache.k", {"multiple of 32", "page_size 16 is below the 32-token key block of", "_kchannel caches"}},
      {"kchannel T_max 48", kChannel | kContig, [](DecodeArgs& a) { set_slots(a.cache, kB, 48); }, "cache.k",
       {"T_max (dim 1) a multiple of 32", "_kchannel caches", "[2, 48, 2, "}},
      {"kchannel k_scale per token", kChannel,
       [](DecodeArgs& a) { a.cache.k_scale = *a.cache.v_scale; a.cache.k_scale->data = buffers().ks.data(); },
       "cache.k_scale", {"dim 1 / 32", "2 * D", ", 256], got "}},
      {"kchannel k_scale of one block too few", kChannel, [](DecodeArgs& a) { a.cache.k_scale->shape[1] -= 1; },
       "cache.k_scale", {"dim 1 / 32"}},
      {"kchannel k_scale of D values", kChannel,
       [](DecodeArgs& a) { a.cache.k_scale = view(a.cache.k_scale->data, DType::kFP16, {a.cache.k.shape[0],
                                                  a.cache.k.shape[1] / 32, kHKV, kD}); },
       "cache.k_scale", {"2 * D", ", 256], got [", ", 128]"}},
      {"kchannel k_scale head stride of 2D + 2", kChannel | kContig,
       [](DecodeArgs& a) { a.cache.k_scale->strides[2] += 2; }, "cache.k_scale",
       {"dim 2", "multiple of 16 bytes (8 elements of fp16)", "got 258"}},
      // Pages of one block: the block dim has size 1, and its (normalized) stride reaches past the head rows.
      {"kchannel k_scale head stride of 2D + 2, pages of one block", kChannel | kPaged,
       [](DecodeArgs& a) { a.cache.k_scale->strides[2] += 2; }, "cache.k_scale",
       {"multiple of 16 bytes (8 elements of fp16)"}},
      {"kchannel k_scale block stride", kChannel | kContig, [](DecodeArgs& a) { a.cache.k_scale->strides[1] += 4; },
       "cache.k_scale", {"dim 1", "multiple of 16 bytes"}},
      {"kchannel k_scale 8-byte aligned", kChannel,
       [](DecodeArgs& a) { a.cache.k_scale->data = shift(a.cache.k_scale->data, 8); }, "cache.k_scale",
       {"16-byte aligned"}},
      {"kchannel k_scale last stride", kChannel, [](DecodeArgs& a) { a.cache.k_scale->strides[3] = 2; },
       "cache.k_scale", {"unit stride"}},
      {"kchannel v_scale fp32", kChannel, [](DecodeArgs& a) { a.cache.v_scale->dtype = DType::kFP32; },
       "cache.v_scale", {"fp16"}},
      {"kchannel v_scale per block", kChannel,
       [](DecodeArgs& a) { a.cache.v_scale = *a.cache.k_scale; a.cache.v_scale->data = buffers().vs.data(); },
       "cache.v_scale", {"[dims 0..2 of cache.k, 2]"}},
      {"kchannel v_scale odd head stride", kChannel, [](DecodeArgs& a) { a.cache.v_scale->strides[2] += 1; },
       "cache.v_scale", {"dim 2", "multiple of 4 bytes"}},
      {"kchannel v_scale address", kChannel,
       [](DecodeArgs& a) { a.cache.v_scale->data = shift(a.cache.v_scale->data, 2); }, "cache.v_scale", {"4-byte"}},
      {"kchannel v_scale inside k_scale", kChannel,
       [](DecodeArgs& a) { a.cache.v_scale->data = shift(a.cache.k_scale->data, 64); }, "cache.v_scale",
       {"overlap 'cache.k_scale'"}},
      {"kchannel v_scale inside k", kChannel, [](DecodeArgs& a) { a.cache.v_scale->data = a.cache.k.data; },
       "cache.v_scale", {"overlap 'cache.k'"}},
      {"k_residual under a per-row format", kAll & ~kChannel,
       [](DecodeArgs& a) { a.cache.k_residual = make_residual(); }, "cache.k_residual",
       {"must be absent for ", " caches"}},
      // ---- lengths
      {"seqlens int64", kAll, [](DecodeArgs& a) { a.seqlens.dtype = DType::kInt64; }, "cache_seqlens", {"int32"}},
      {"seqlens of 3", kAll, [](DecodeArgs& a) { a.seqlens.shape[0] = 3; }, "cache_seqlens", {"[B] = [2]"}},
      {"seqlens strided", kAll, [](DecodeArgs& a) { a.seqlens.strides[0] = 2; }, "cache_seqlens", {"contiguous"}},
      // ---- o
      {"o fp16", kAll, [](DecodeArgs& a) { a.o.dtype = DType::kFP16; }, "o", {"dtype of 'q' (bf16)"}},
      {"o rank 2", kAll, [](DecodeArgs& a) { a.o = view(a.o.data, a.o.dtype, {kB, kHQ * kD}); }, "o", {"rank 3"}},
      {"o heads", kAll, [](DecodeArgs& a) { a.o.shape[1] = 4; }, "o", {"[B, HQ, D]", "[2, 8, 128], got [2, 4, 128]"}},
      {"o D stride", kAll, [](DecodeArgs& a) { a.o.strides[2] = 2; }, "o", {"unit stride"}},
      {"o address", kAll, [](DecodeArgs& a) { a.o.data = shift(a.o.data, 4); }, "o", {"16-byte aligned"}},
      {"o row stride", kAll, [](DecodeArgs& a) { a.o.strides[1] = kD + 4; }, "o", {"8 elements of bf16"}},
      {"o heads share memory", kAll, [](DecodeArgs& a) { a.o.strides[1] = 0; }, "o", {"share memory"}},
      {"o is q", kAll, [](DecodeArgs& a) { a.o.data = a.q.data; }, "o", {"overlap 'q'"}},
      {"o inside k", kAll, [](DecodeArgs& a) { a.o.data = a.cache.k.data; }, "o", {"overlap 'cache.k'"}},
      {"o inside v", kAll, [](DecodeArgs& a) { a.o.data = a.cache.v.data; }, "o", {"overlap 'cache.v'"}},
      {"o inside v_scale", kQuant, [](DecodeArgs& a) { a.o.data = a.cache.v_scale->data; }, "o",
       {"overlap 'cache.v_scale'"}},
      {"o inside the block table", kAll | kPaged, [](DecodeArgs& a) { a.o.data = a.cache.block_table->data; }, "o",
       {"overlap 'cache.block_table'"}},
      {"o inside seqlens", kAll, [](DecodeArgs& a) { a.o.data = a.seqlens.data; }, "o", {"overlap 'cache_seqlens'"}},
      // ---- lse
      {"lse bf16", kAll, [](DecodeArgs& a) { a.lse->dtype = DType::kBF16; }, "lse", {"fp32"}},
      {"lse shape", kAll, [](DecodeArgs& a) { a.lse->shape[1] = 9; }, "lse", {"[B, HQ] = [2, 8], got [2, 9]"}},
      {"lse rank 3", kAll, [](DecodeArgs& a) { a.lse = view(a.lse->data, DType::kFP32, {kB, kHQ, 1}); }, "lse",
       {"rank 2"}},
      {"lse negative stride", kAll, [](DecodeArgs& a) { a.lse->strides[0] = -kHQ; }, "lse", {"non-negative"}},
      {"lse address", kAll, [](DecodeArgs& a) { a.lse->data = shift(a.lse->data, 2); }, "lse", {"4-byte"}},
      {"lse rows share memory", kAll, [](DecodeArgs& a) { a.lse->strides[0] = 0; }, "lse", {"share memory"}},
      {"lse inside o", kAll, [](DecodeArgs& a) { a.lse->data = a.o.data; }, "lse", {"overlap 'o'"}},
      {"lse inside q", kAll, [](DecodeArgs& a) { a.lse->data = a.q.data; }, "lse", {"overlap 'q'"}},
      // ---- params
      {"softmax_scale NaN", kAll, [](DecodeArgs& a) { a.params.softmax_scale = std::nanf(""); },
       "params.softmax_scale", {"finite"}},
      {"softmax_scale inf", kAll, [](DecodeArgs& a) { a.params.softmax_scale = INFINITY; }, "params.softmax_scale",
       {"finite"}},
      {"softcap negative", kAll, [](DecodeArgs& a) { a.params.softcap = -1.0f; }, "params.softcap", {">= 0"}},
      {"softcap inf", kAll, [](DecodeArgs& a) { a.params.softcap = INFINITY; }, "params.softcap", {"finite"}},
      {"window negative", kAll, [](DecodeArgs& a) { a.params.window = -1; }, "params.window", {"got -1"}},
      {"num_splits -1", kAll, [](DecodeArgs& a) { a.params.num_splits = -1; }, "params.num_splits",
       {"[0, 128]", "got -1"}},
      {"num_splits 129", kAll, [](DecodeArgs& a) { a.params.num_splits = 129; }, "params.num_splits",
       {"[0, 128]", "got 129"}},
      // ---- workspace (explicit splits: sized before any device query)
      {"workspace a byte short", kAll, [](DecodeArgs& a) { set_splits(a, 4, 4, 1); }, "workspace",
       {"bytes for 4 splits", "(decode_workspace_bytes)"}},
      {"workspace short after the split cap", kAll, [](DecodeArgs& a) { set_splits(a, 128, 4, 1); }, "workspace",
       {"bytes for 4 splits"}},
      {"workspace absent", kAll,
       [](DecodeArgs& a) {
         set_splits(a, 2, 2);
         a.workspace = {};
       },
       "workspace", {"got 0"}},
      {"workspace address", kAll,
       [](DecodeArgs& a) {
         set_splits(a, 4, 4);
         a.workspace.data = shift(a.workspace.data, 8);
       },
       "workspace", {"16-byte aligned"}},
      {"workspace inside o", kAll,
       [](DecodeArgs& a) {
         set_splits(a, 4, 4);
         a.workspace.data = a.o.data;
       },
       "workspace", {"overlap 'o'"}},
      {"workspace inside k", kAll,
       [](DecodeArgs& a) {
         set_splits(a, 4, 4);
         a.workspace.data = a.cache.k.data;
       },
       "workspace", {"overlap 'cache.k'"}},
  };
  return all;
}

TEST(DecodeValidation, EachRuleNamesItsArgument) {
  ASSERT_GT(decode_workspace_bytes_for(kB, 1, kHQ, kD, 4, false), 0u) << "the workspace cases need a non-empty workspace";
  int runs = 0;
  for (const DecodeCase& c : decode_cases())
    for (KVFormat f : kFormats)
      for (bool paged : {false, true}) {
        if (!applies(c.applies, f, paged)) continue;
        SCOPED_TRACE(std::string(c.name) + " / " + describe(f, paged));
        DecodeArgs a = make_decode(f, paged);
        c.mutate(a);
        ++runs;
        expect_error([&] { call_decode(a); }, kDecode, c.arg, c.says);
      }
  EXPECT_GT(runs, 700);
}

TEST(DecodeValidation, WorkspaceErrorGivesBothSizes) {
  DecodeArgs a = make_decode(KVFormat::kInt8, false);
  set_splits(a, 3, 3, 16);
  const std::size_t needed = decode_workspace_bytes_for(kB, 1, kHQ, kD, 3, false);
  expect_error([&] { call_decode(a); }, kDecode, "workspace",
               {"at least " + std::to_string(needed) + " bytes", "got " + std::to_string(needed - 16)});
}

// A balanced plan's workspace holds the merge's per-sequence table too: one sized without the flag is refused, with
// the flag named, before any launch; the size with the flag is accepted.
TEST(DecodeValidation, BalancedSplitsNeedTheirWorkspace) {
  DecodeArgs a = make_decode(KVFormat::kInt4, false);
  set_splits(a, 4, 4);  // exactly the classic plan's bytes
  a.params.balance_splits = true;
  const std::size_t needed = decode_workspace_bytes_for(kB, 1, kHQ, kD, 4, true);
  ASSERT_GT(needed, a.workspace.bytes);
  expect_error([&] { call_decode(a); }, kDecode, "workspace",
               {"at least " + std::to_string(needed) + " bytes for 4 balanced splits"});
  a.workspace.bytes = needed;
  EXPECT_EQ(decode_workspace_bytes(a.q, a.cache, a.params), needed);
}

struct Variant {
  const char* name;
  unsigned applies;
  std::function<void(DecodeArgs&)> mutate;
  bool may_pass = false;
};

TEST(DecodeValidation, AcceptedArgumentsReachTheDeviceChecks) {
  const std::vector<Variant> variants = {
      {"as made", kAll, [](DecodeArgs&) {}},
      {"explicit splits, exact workspace", kAll, [](DecodeArgs& a) { set_splits(a, 4, 4); }},
      {"128 splits capped to 4 (64 tokens of capacity)", kAll, [](DecodeArgs& a) { set_splits(a, 128, 4); }},
      {"one split, no workspace", kAll, [](DecodeArgs& a) { a.params.num_splits = 1; }},
      {"8 new tokens, 2 splits", kAll,
       [](DecodeArgs& a) {
         set_new_tokens(a, 8);
         a.lse = view(a.lse->data, DType::kFP32, {kB, 8, kHQ});
         a.params.num_splits = 2;
         a.workspace.data = buffers().ws.data();
         a.workspace.bytes = decode_workspace_bytes_for(kB, 8, kHQ, kD, 2, false);
       }},
      {"4-D q with one new token", kAll,
       [](DecodeArgs& a) {
         set_new_tokens(a, 1);
         a.lse = view(a.lse->data, DType::kFP32, {kB, 1, kHQ});
         a.params.num_splits = 1;
       }},
      {"fp16 q and o", kQuant, [](DecodeArgs& a) { a.q.dtype = a.o.dtype = DType::kFP16; }},
      {"fp16 native cache", kNat,
       [](DecodeArgs& a) {
         a.q.dtype = a.o.dtype = DType::kFP16;
         both(a.cache, [](TensorView& t) { t.dtype = DType::kFP16; });
       }},
      {"int4 as int4x2", kI4 | kI4G | kI4C, [](DecodeArgs& a) { both(a.cache, [](TensorView& t) { t.dtype = DType::kInt4x2; }); }},
      {"fp8 per-tensor scales", kF8,
       [](DecodeArgs& a) { both_scales(a.cache, [](TensorView& t) { t.shape[0] = 1; }); }},
      {"fp8 scales shared by k and v", kF8, [](DecodeArgs& a) { a.cache.v_scale = a.cache.k_scale; }},
      {"no sequences", kAll,
       [](DecodeArgs& a) {
         a.q.shape[0] = a.o.shape[0] = a.lse->shape[0] = a.seqlens.shape[0] = 0;
         if (a.cache.block_table) a.cache.block_table->shape[0] = 0;
         else both(a.cache, [](TensorView& t) { t.shape[0] = 0; });
         if (a.cache.k_scale && a.cache.format != KVFormat::kFP8 && !a.cache.block_table)
           both_scales(a.cache, [](TensorView& t) { t.shape[0] = 0; });
       },
       true},
      {"one sequence with odd strides on size-1 dims", kAll,
       [](DecodeArgs& a) {
         // Strides of dims of size 1 address nothing: any value is fine.
         a.q.shape[0] = a.o.shape[0] = a.lse->shape[0] = a.seqlens.shape[0] = 1;
         a.q.strides[0] = -3;
         a.o.strides[0] = 7;
         a.lse->strides[0] = -1;
         if (a.cache.block_table) {
           a.cache.block_table->shape[0] = 1;
           a.cache.block_table->strides[0] = 0;
         } else {
           both(a.cache, [](TensorView& t) { t.shape[0] = 1; t.strides[0] = 5; });
           if (a.cache.k_scale && a.cache.format != KVFormat::kFP8)
             both_scales(a.cache, [](TensorView& t) { t.shape[0] = 1; t.strides[0] = 3; });
         }
       }},
      {"one KV head, 8 query heads each", kAll,
       [](DecodeArgs& a) {
         both(a.cache, [](TensorView& t) { t.shape[2] = 1; });
         if (a.cache.format == KVFormat::kFP8) both_scales(a.cache, [](TensorView& t) { t.shape[0] = 1; });
         else if (a.cache.k_scale) both_scales(a.cache, [](TensorView& t) { t.shape[2] = 1; });
       }},
      {"256 query heads per KV head", kAll,
       [](DecodeArgs& a) {
         a.q = view(a.q.data, a.q.dtype, {kB, 256 * kHKV, kD});
         a.o = view(a.o.data, a.o.dtype, {kB, 256 * kHKV, kD});
         a.lse = view(a.lse->data, DType::kFP32, {kB, 256 * kHKV});
       }},
      {"no lse", kAll, [](DecodeArgs& a) { a.lse.reset(); }},
      {"lse transposed", kAll,
       [](DecodeArgs& a) {
         a.lse->strides[0] = 1;
         a.lse->strides[1] = kB;
       }},
      {"padded q and o rows, q heads broadcast", kAll,
       [](DecodeArgs& a) {
         a.q.strides[1] = 0;
         a.o.strides[1] = kD + 8;
         a.o.strides[0] = kHQ * (kD + 8) + 64;
       }},
      {"padded cache rows", kAll,
       [](DecodeArgs& a) {
         both(a.cache, [&](TensorView& t) {
           t.strides[2] = t.shape[3] + 32 / elem(a.cache);
           t.strides[1] = kHKV * t.strides[2];
           t.strides[0] = t.shape[1] * t.strides[1] + 16 / elem(a.cache);
         });
       }},
      {"k and v interleaved in one buffer", kAll,
       [](DecodeArgs& a) {
         // Contiguous: [B, T, 2, HKV, row]; paged: [num_pages, 2, page_size, HKV, row] (FlashInfer's layout).
         const bool paged = a.cache.block_table.has_value();
         const int64_t row = a.cache.k.shape[3], tokens = a.cache.k.shape[1];
         TensorView& k = a.cache.k;
         k.strides[2] = row;
         k.strides[1] = paged ? kHKV * row : 2 * kHKV * row;
         k.strides[0] = 2 * tokens * kHKV * row;
         a.cache.v = k;
         a.cache.v.data = shift(k.data, (paged ? tokens * kHKV * row : kHKV * row) * elem(a.cache));
       }},
      {"page size 256", kAll | kPaged, [](DecodeArgs& a) { set_slots(a.cache, 1, 256); }},
      {"page size 64", kAll | kPaged, [](DecodeArgs& a) { set_slots(a.cache, 3, 64); }},
      {"contiguous T_max 96", kAll | kContig, [](DecodeArgs& a) { set_slots(a.cache, kB, 96); }},
      {"kchannel scales with their own padded strides", kChannel,
       [](DecodeArgs& a) {
         TensorView& ks = *a.cache.k_scale;
         ks.strides[2] = 2 * kD + 8;
         ks.strides[1] = kHKV * ks.strides[2] + 16;
         ks.strides[0] = ks.shape[1] * ks.strides[1] + 8;
         TensorView& vs = *a.cache.v_scale;
         vs.strides[2] = 4;
         vs.strides[1] = kHKV * 4 + 2;
         vs.strides[0] = vs.shape[1] * vs.strides[1];
       }},
      {"kchannel k_scale and v_scale in one buffer", kChannel,
       [](DecodeArgs& a) { a.cache.v_scale->data = shift(a.cache.k_scale->data, a.cache.k_scale->numel() * 2); }},
      {"decode ignores k_residual (any shape or dtype)", kChannel,
       [](DecodeArgs& a) { a.cache.k_residual = view(a.cache.k.data, DType::kFP32, {3}); }},
      {"softcap, window, negative scale", kAll,
       [](DecodeArgs& a) {
         a.params.softcap = 30.0f;
         a.params.window = 100;
         a.params.softmax_scale = -0.5f;
       }},
  };
  int runs = 0;
  for (const Variant& v : variants)
    for (KVFormat f : kFormats)
      for (bool paged : {false, true}) {
        if (!applies(v.applies, f, paged)) continue;
        SCOPED_TRACE(std::string(v.name) + " / " + describe(f, paged));
        DecodeArgs a = make_decode(f, paged);
        v.mutate(a);
        ++runs;
        expect_reaches_device_checks([&] { call_decode(a); }, v.may_pass);
      }
  EXPECT_GT(runs, 150);
}

// ---- append_kv ------------------------------------------------------------------------------------------------

struct AppendArgs {
  TensorView k_new, v_new, positions;
  KVCache cache;
};

AppendArgs make_append(KVFormat f, bool paged) {
  Buffers& b = buffers();
  AppendArgs a;
  a.k_new = view(b.k_new.data(), DType::kBF16, {kB, kS, kHKV, kD});
  a.v_new = view(b.v_new.data(), DType::kBF16, {kB, kS, kHKV, kD});
  a.positions = view(b.positions.data(), DType::kInt32, {kB});
  a.cache = make_cache(f, paged);
  if (is_channel(f)) a.cache.k_residual = make_residual();
  return a;
}

void call_append(const AppendArgs& a) { (void)check_append(kAppend, a.k_new, a.v_new, a.positions, a.cache); }

struct AppendCase {
  const char* name;
  unsigned applies;
  std::function<void(AppendArgs&)> mutate;
  const char* arg;
  std::vector<std::string> says = {};
};

TEST(AppendValidation, EachRuleNamesItsArgument) {
  const std::vector<AppendCase> cases = {
      // ---- new rows
      {"k_new fp32", kAll, [](AppendArgs& a) { a.k_new.dtype = DType::kFP32; }, "k_new", {"bf16 | fp16"}},
      {"k_new rank 3", kAll, [](AppendArgs& a) { a.k_new = view(a.k_new.data, DType::kBF16, {kB, kS, kHKV * kD}); },
       "k_new", {"rank 4"}},
      {"k_new D 96", kAll, [](AppendArgs& a) { a.k_new.shape[3] = 96; }, "k_new", {"64, 128 or 256"}},
      {"k_new negative S", kAll, [](AppendArgs& a) { a.k_new.shape[1] = -1; }, "k_new", {"non-negative sizes"}},
      {"k_new last stride", kAll, [](AppendArgs& a) { a.k_new.strides[3] = 2; }, "k_new", {"unit stride"}},
      {"k_new negative stride", kAll, [](AppendArgs& a) { a.k_new.strides[1] = -kHKV * kD; }, "k_new",
       {"non-negative"}},
      {"k_new odd address", kAll, [](AppendArgs& a) { a.k_new.data = shift(a.k_new.data, 1); }, "k_new",
       {"2-byte aligned"}},
      {"v_new fp16", kAll, [](AppendArgs& a) { a.v_new.dtype = DType::kFP16; }, "v_new", {"dtype of 'k_new'"}},
      {"v_new shape", kAll, [](AppendArgs& a) { a.v_new.shape[1] = kS + 1; }, "v_new",
       {"shape of 'k_new' [2, 3, 2, 128], got [2, 4, 2, 128]"}},
      {"v_new last stride", kAll, [](AppendArgs& a) { a.v_new.strides[3] = 0; }, "v_new", {"unit stride"}},
      {"positions int64", kAll, [](AppendArgs& a) { a.positions.dtype = DType::kInt64; }, "positions", {"int32"}},
      {"positions of 3", kAll, [](AppendArgs& a) { a.positions.shape[0] = 3; }, "positions", {"[B] = [2]"}},
      {"positions strided", kAll, [](AppendArgs& a) { a.positions.strides[0] = 2; }, "positions", {"contiguous"}},
      // ---- agreement with the cache
      {"new rows of one KV head", kAll,
       [](AppendArgs& a) { a.k_new.shape[2] = a.v_new.shape[2] = 1; }, "k_new", {"size 2 (HKV"}},
      {"new rows of D 64", kAll, [](AppendArgs& a) { a.k_new.shape[3] = a.v_new.shape[3] = 64; }, "cache.k",
       {"in dim 3"}},
      {"new rows of 3 sequences, contiguous", kAll | kContig,
       [](AppendArgs& a) { a.k_new.shape[0] = a.v_new.shape[0] = a.positions.shape[0] = 3; }, "cache.k",
       {"size 3 (B"}},
      {"new rows of 3 sequences, paged", kAll | kPaged,
       [](AppendArgs& a) { a.k_new.shape[0] = a.v_new.shape[0] = a.positions.shape[0] = 3; }, "cache.block_table",
       {"size 3 (B"}},
      {"fp16 rows into a bf16 cache", kNat, [](AppendArgs& a) { a.k_new.dtype = a.v_new.dtype = DType::kFP16; },
       "cache.k", {"must have dtype fp16", "got bf16"}},
      // ---- the cache is the output
      {"cache tokens share memory", kAll,
       [](AppendArgs& a) { both(a.cache, [](TensorView& t) { t.strides[1] = 0; }); }, "cache.k", {"share memory"}},
      {"cache heads share memory", kAll,
       [](AppendArgs& a) { both(a.cache, [](TensorView& t) { t.strides[2] = 0; }); }, "cache.k", {"share memory"}},
      {"int scale tokens share memory", kIntegers,
       [](AppendArgs& a) { both_scales(a.cache, [](TensorView& t) { t.strides[1] = 0; }); }, "cache.k_scale",
       {"share memory"}},
      {"kchannel key blocks share memory", kChannel | kContig,  // paged: one block per page
       [](AppendArgs& a) { a.cache.k_scale->strides[1] = 0; }, "cache.k_scale", {"share memory"}},
      {"kchannel value tokens share memory", kChannel, [](AppendArgs& a) { a.cache.v_scale->strides[1] = 0; },
       "cache.v_scale", {"share memory"}},
      {"k inside k_new", kAll, [](AppendArgs& a) { a.k_new.data = a.cache.k.data; }, "cache.k", {"overlap 'k_new'"}},
      {"v inside v_new", kAll, [](AppendArgs& a) { a.v_new.data = a.cache.v.data; }, "cache.v", {"overlap 'v_new'"}},
      {"k_scale at positions", kIntegers | kChannel, [](AppendArgs& a) { a.positions.data = a.cache.k_scale->data; },
       "cache.k_scale", {"overlap 'positions'"}},
      {"v_scale inside v_new", kIntegers | kChannel, [](AppendArgs& a) { a.v_new.data = a.cache.v_scale->data; },
       "cache.v_scale", {"overlap 'v_new'"}},
      {"v at the block table", kAll | kPaged, [](AppendArgs& a) { a.cache.block_table->data = a.cache.v.data; },
       "cache.v", {"overlap 'cache.block_table'"}},
      {"fp8 scale inside v", kF8, [](AppendArgs& a) { a.cache.k_scale->data = a.cache.v.data; }, "cache.k_scale",
       {"overlap 'cache.v'"}},
      // ---- the key residual of the per-channel formats
      {"no k_residual", kChannel, [](AppendArgs& a) { a.cache.k_residual.reset(); }, "cache.k_residual",
       {"is required by append_kv for ", "_kchannel caches", "[B, 64, HKV, D]"}},
      {"k_residual under a per-row format", kAll & ~kChannel,
       [](AppendArgs& a) { a.cache.k_residual = make_residual(); }, "cache.k_residual",
       {"must be absent for ", " caches"}},
      {"k_residual fp16 under bf16 k_new", kChannel, [](AppendArgs& a) { a.cache.k_residual->dtype = DType::kFP16; },
       "cache.k_residual", {"dtype of 'k_new' (bf16), got fp16"}},
      {"k_residual fp32", kChannel,
       [](AppendArgs& a) { a.cache.k_residual->dtype = DType::kFP32; }, "cache.k_residual", {"dtype of 'k_new'"}},
      {"k_residual of 32 rows", kChannel, [](AppendArgs& a) { a.cache.k_residual->shape[1] = 32; },
       "cache.k_residual", {"[B, 64, HKV, D]", "[2, 64, 2, 128], got [2, 32, 2, 128]"}},
      {"k_residual of 3 sequences", kChannel, [](AppendArgs& a) { a.cache.k_residual->shape[0] = 3; },
       "cache.k_residual", {"[B, 64, HKV, D]"}},
      {"k_residual of one head", kChannel, [](AppendArgs& a) { a.cache.k_residual->shape[2] = 1; },
       "cache.k_residual", {"[B, 64, HKV, D]"}},
      {"k_residual rank 3", kChannel,
       [](AppendArgs& a) { a.cache.k_residual = view(buffers().res.data(), DType::kBF16, {kB, 64, kHKV * kD}); },
       "cache.k_residual", {"rank 4"}},
      {"k_residual D stride", kChannel, [](AppendArgs& a) { a.cache.k_residual->strides[3] = 2; },
       "cache.k_residual", {"unit stride"}},
      {"k_residual row stride", kChannel, [](AppendArgs& a) { a.cache.k_residual->strides[2] = kD + 4; },
       "cache.k_residual", {"dim 2", "multiple of 16 bytes (8 elements of bf16)"}},
      {"k_residual address", kChannel,
       [](AppendArgs& a) { a.cache.k_residual->data = shift(a.cache.k_residual->data, 8); }, "cache.k_residual",
       {"16-byte aligned"}},
      {"k_residual negative stride", kChannel, [](AppendArgs& a) { a.cache.k_residual->strides[0] *= -1; },
       "cache.k_residual", {"non-negative"}},
      {"k_residual slots share memory", kChannel, [](AppendArgs& a) { a.cache.k_residual->strides[1] = 0; },
       "cache.k_residual", {"share memory"}},
      {"k_residual inside k", kChannel, [](AppendArgs& a) { a.cache.k_residual->data = a.cache.k.data; },
       "cache.k_residual", {"overlap 'cache.k'"}},
      {"k_residual inside v", kChannel, [](AppendArgs& a) { a.cache.k_residual->data = a.cache.v.data; },
       "cache.k_residual", {"overlap 'cache.v'"}},
      {"k_residual inside k_scale", kChannel,
       [](AppendArgs& a) { a.cache.k_residual->data = a.cache.k_scale->data; }, "cache.k_residual",
       {"overlap 'cache.k_scale'"}},
      {"k_residual inside v_scale", kChannel,
       [](AppendArgs& a) { a.cache.k_residual->data = a.cache.v_scale->data; }, "cache.k_residual",
       {"overlap 'cache.v_scale'"}},
      {"k_residual at k_new", kChannel, [](AppendArgs& a) { a.k_new.data = a.cache.k_residual->data; },
       "cache.k_residual", {"overlap 'k_new'"}},
      {"k_residual at the block table", kChannel | kPaged,
       [](AppendArgs& a) { a.cache.block_table->data = a.cache.k_residual->data; }, "cache.k_residual",
       {"overlap 'cache.block_table'"}},
      {"kchannel page size 16", kChannel | kPaged, [](AppendArgs& a) { set_slots(a.cache, kNumPages, 16); },
       "cache.k", {"page_size 16 is below the 32-token key block of"}},
  };
  int runs = 0;
  for (const AppendCase& c : cases)
    for (KVFormat f : kFormats)
      for (bool paged : {false, true}) {
        if (!applies(c.applies, f, paged)) continue;
        SCOPED_TRACE(std::string(c.name) + " / " + describe(f, paged));
        AppendArgs a = make_append(f, paged);
        c.mutate(a);
        ++runs;
        expect_error([&] { call_append(a); }, kAppend, c.arg, c.says);
      }
  EXPECT_GT(runs, 200);
}

TEST(AppendValidation, AcceptedArgumentsReachTheDeviceChecks) {
  struct AppendVariant {
    const char* name;
    unsigned applies;
    std::function<void(AppendArgs&)> mutate;
  };
  const std::vector<AppendVariant> variants = {
      {"as made", kAll, [](AppendArgs&) {}},
      {"no new tokens", kAll, [](AppendArgs& a) { a.k_new.shape[1] = a.v_new.shape[1] = 0; }},
      {"fp16 rows", kQuant,
       [](AppendArgs& a) {
         a.k_new.dtype = a.v_new.dtype = DType::kFP16;
         if (a.cache.k_residual) a.cache.k_residual->dtype = DType::kFP16;  // the residual follows k_new
       }},
      {"fp16 rows into an fp16 cache", kNat,
       [](AppendArgs& a) {
         a.k_new.dtype = a.v_new.dtype = DType::kFP16;
         both(a.cache, [](TensorView& t) { t.dtype = DType::kFP16; });
       }},
      {"k_new and v_new slices of one fused qkv tensor", kAll,
       [](AppendArgs& a) {
         // [B, S, HQ + 2 HKV, D] storage with an odd padding: any non-negative strides will do for the new rows.
         const int64_t heads = kHQ + 2 * kHKV;
         a.k_new.strides[2] = kD;
         a.k_new.strides[1] = heads * kD + 3;
         a.k_new.strides[0] = kS * a.k_new.strides[1] + 5;
         a.v_new = a.k_new;
         a.v_new.data = shift(a.k_new.data, kHKV * kD * 2);
         a.k_new.data = shift(a.k_new.data, 2);  // 2-byte aligned only
       }},
      {"new rows broadcast over tokens", kAll, [](AppendArgs& a) { a.k_new.strides[1] = 0; }},
      {"k and v interleaved in one buffer", kAll | kPaged,
       [](AppendArgs& a) {
         const int64_t row = a.cache.k.shape[3];
         const int64_t page = a.cache.k.shape[1];
         a.cache.k.strides[0] = 2 * page * kHKV * row;
         a.cache.v = a.cache.k;
         a.cache.v.data = shift(a.cache.k.data, page * kHKV * row * elem(a.cache));
       }},
      {"fp8 scales shared by k and v", kF8, [](AppendArgs& a) { a.cache.v_scale = a.cache.k_scale; }},
      {"padded k_residual", kChannel,
       [](AppendArgs& a) {
         TensorView& r = *a.cache.k_residual;
         r.strides[2] = kD + 8;
         r.strides[1] = kHKV * r.strides[2] + 24;
         r.strides[0] = kKeyResidualRows * r.strides[1] + 8;
       }},
      {"k_residual of one sequence, odd batch stride", kChannel,
       [](AppendArgs& a) {
         a.k_new.shape[0] = a.v_new.shape[0] = a.positions.shape[0] = 1;
         if (a.cache.block_table) a.cache.block_table->shape[0] = 1;
         else set_slots(a.cache, 1, kT);
         a.cache.k_residual->shape[0] = 1;
         a.cache.k_residual->strides[0] = 3;  // a size-1 dim: never used
       }},
  };
  for (const AppendVariant& v : variants)
    for (KVFormat f : kFormats)
      for (bool paged : {false, true}) {
        if (!applies(v.applies, f, paged)) continue;
        SCOPED_TRACE(std::string(v.name) + " / " + describe(f, paged));
        AppendArgs a = make_append(f, paged);
        v.mutate(a);
        expect_reaches_device_checks([&] { call_append(a); });
      }
}

// ---- prefill (tessera::attention::prefill / prefill_varlen: the rules of both forms) -------------------------------

constexpr const char* kPrefill = "tessera::attention::prefill";
constexpr int64_t kTotalQ = 10, kTotalK = 12;

struct PrefillArgs {
  TensorView q, k, v, cu_q, cu_k, o;
  std::optional<TensorView> lse;
  int64_t max_seqlen_q = 7;
  PrefillParams params;
};

PrefillArgs make_prefill() {
  Buffers& b = buffers();
  PrefillArgs a;
  a.q = view(b.q.data(), DType::kBF16, {kTotalQ, kHQ, kD});
  a.k = view(b.k.data(), DType::kBF16, {kTotalK, kHKV, kD});
  a.v = view(b.v.data(), DType::kBF16, {kTotalK, kHKV, kD});
  a.cu_q = view(b.seqlens.data(), DType::kInt32, {kB + 1});
  a.cu_k = view(b.positions.data(), DType::kInt32, {kB + 1});
  a.o = view(b.o.data(), DType::kBF16, {kTotalQ, kHQ, kD});
  a.lse = view(b.lse.data(), DType::kFP32, {kTotalQ, kHQ});
  return a;
}

void call_prefill(const PrefillArgs& a) {
  (void)check_prefill(kPrefill, a.q, a.k, a.v, a.cu_q, a.cu_k, a.max_seqlen_q, a.o, a.lse, a.params);
}

TEST(PrefillValidation, ValidArgumentsReachTheDeviceChecks) {
  expect_reaches_device_checks([] { call_prefill(make_prefill()); });
  for (int64_t d : {64, 256}) {
    PrefillArgs a = make_prefill();
    a.q = view(a.q.data, DType::kFP16, {kTotalQ, kHQ, d});
    a.k = view(a.k.data, DType::kFP16, {kTotalK, 1, d});
    a.v = view(a.v.data, DType::kFP16, {kTotalK, 1, d});
    a.o = view(a.o.data, DType::kFP16, {kTotalQ, kHQ, d});
    a.lse.reset();
    a.params.causal = true;
    a.params.window = 5;
    a.params.softcap = 30.0f;
    expect_reaches_device_checks([&] { call_prefill(a); });
  }
}

TEST(PrefillValidation, EachRuleNamesItsArgument) {
  struct Case {
    const char* arg;
    std::vector<std::string> says;
    std::function<void(PrefillArgs&)> mutate;
  };
  const auto strided = [](TensorView t, std::initializer_list<int64_t> strides) {
    std::copy(strides.begin(), strides.end(), t.strides);
    return t;
  };
  const std::vector<Case> cases = {
      {"q", {"bf16"}, [](PrefillArgs& a) { a.q.dtype = DType::kFP32; }},
      {"q", {"rank 3"}, [](PrefillArgs& a) { a.q = view(a.q.data, DType::kBF16, {kTotalQ, kHQ * kD}); }},
      {"q", {"64, 128 or 256"}, [](PrefillArgs& a) { a.q = view(a.q.data, DType::kBF16, {kTotalQ, kHQ, 96}); }},
      {"q", {"multiple of 16 bytes"},
       [&](PrefillArgs& a) { a.q = strided(a.q, {kHQ * kD + 4, kD, 1}); }},
      {"q", {"16-byte aligned"}, [](PrefillArgs& a) { a.q.data = shift(a.q.data, 8); }},
      {"k", {"dtype of 'q'"}, [](PrefillArgs& a) { a.k.dtype = DType::kFP16; }},
      {"k", {"divides"}, [](PrefillArgs& a) { a.k = view(a.k.data, DType::kBF16, {kTotalK, 3, kD}); }},
      {"k", {"head dim of q"}, [](PrefillArgs& a) { a.k = view(a.k.data, DType::kBF16, {kTotalK, kHKV, 64}); }},
      {"v", {"the shape of k"}, [](PrefillArgs& a) { a.v = view(a.v.data, DType::kBF16, {kTotalK + 1, kHKV, kD}); }},
      {"v", {"dtype of 'q'"}, [](PrefillArgs& a) { a.v.dtype = DType::kFP16; }},
      {"cu_seqlens_q", {"[B + 1]"}, [](PrefillArgs& a) { a.cu_q = view(a.cu_q.data, DType::kInt32, {kB + 1, 1}); }},
      {"cu_seqlens_q", {"int32"}, [](PrefillArgs& a) { a.cu_q.dtype = DType::kFP32; }},
      {"cu_seqlens_k", {"[B + 1]"}, [](PrefillArgs& a) { a.cu_k = view(a.cu_k.data, DType::kInt32, {kB + 2}); }},
      {"cu_seqlens_k", {"contiguous"}, [&](PrefillArgs& a) { a.cu_k = strided(a.cu_k, {2}); }},
      {"max_seqlen_q", {">= 0"}, [](PrefillArgs& a) { a.max_seqlen_q = -1; }},
      {"o", {"dtype of 'q'"}, [](PrefillArgs& a) { a.o.dtype = DType::kFP16; }},
      {"o", {"[total_q, HQ, D]"}, [](PrefillArgs& a) { a.o = view(a.o.data, DType::kBF16, {kTotalQ - 1, kHQ, kD}); }},
      {"o", {"multiple of 4 bytes"}, [&](PrefillArgs& a) { a.o = strided(a.o, {kHQ * kD + 1, kD, 1}); }},
      {"o", {"overlap"}, [](PrefillArgs& a) { a.o.data = a.q.data; }},
      {"o", {"share memory"}, [&](PrefillArgs& a) { a.o = strided(a.o, {0, kD, 1}); }},
      {"lse", {"fp32"}, [](PrefillArgs& a) { a.lse->dtype = DType::kBF16; }},
      {"lse", {"[total_q, HQ]"}, [](PrefillArgs& a) { a.lse = view(a.lse->data, DType::kFP32, {kTotalQ, kHQ + 1}); }},
      {"lse", {"overlap"}, [](PrefillArgs& a) { a.lse->data = a.o.data; }},
      {"params.softmax_scale", {"finite"}, [](PrefillArgs& a) { a.params.softmax_scale = NAN; }},
      {"params.softmax_scale", {">= 0"}, [](PrefillArgs& a) { a.params.softmax_scale = -0.5f; }},
      {"params.softcap", {">= 0"}, [](PrefillArgs& a) { a.params.softcap = -1.0f; }},
      {"params.window", {">= 0"}, [](PrefillArgs& a) { a.params.window = -3; }},
      {"params.pack_gqa", {"-1 (chosen), 0 or 1"}, [](PrefillArgs& a) { a.params.pack_gqa = 2; }},
      {"params.pack_gqa", {"HQ / HKV <= 128", "256"},
       [](PrefillArgs& a) {  // 256 query heads on one KV head cannot share a 128-row tile
         a.q = view(a.q.data, DType::kBF16, {kTotalQ, 256, kD});
         a.o = view(a.o.data, DType::kBF16, {kTotalQ, 256, kD});
         a.lse = view(a.lse->data, DType::kFP32, {kTotalQ, 256});
         a.k = view(a.k.data, DType::kBF16, {kTotalK, 1, kD});
         a.v = view(a.v.data, DType::kBF16, {kTotalK, 1, kD});
         a.params.pack_gqa = 1;
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.arg) + ": " + c.says[0]);
    PrefillArgs a = make_prefill();
    c.mutate(a);
    expect_error([&] { call_prefill(a); }, kPrefill, c.arg, c.says);
  }
}

// The plain batch: q [B, Sq, HQ, D], k and v [B, Sk, HKV, D], no cu_seqlens.
TEST(PrefillValidation, BatchedFormRules) {
  Buffers& b = buffers();
  struct Batched {
    TensorView q, k, v, o;
    std::optional<TensorView> lse;
    std::optional<TensorView> cu_q, cu_k;
    PrefillParams params;
  };
  const auto make = [&] {
    Batched a;
    a.q = view(b.q.data(), DType::kBF16, {2, 5, kHQ, kD});
    a.k = view(b.k.data(), DType::kBF16, {2, 6, kHKV, kD});
    a.v = view(b.v.data(), DType::kBF16, {2, 6, kHKV, kD});
    a.o = view(b.o.data(), DType::kBF16, {2, 5, kHQ, kD});
    a.lse = view(b.lse.data(), DType::kFP32, {2, 5, kHQ});
    a.params.causal = true;
    return a;
  };
  const auto call = [](const Batched& a) {
    (void)check_prefill(kPrefill, a.q, a.k, a.v, a.cu_q, a.cu_k, 0, a.o, a.lse, a.params);
  };
  expect_reaches_device_checks([&] { call(make()); });
  struct Case {
    const char* arg;
    std::vector<std::string> says;
    std::function<void(Batched&)> mutate;
  };
  const std::vector<Case> cases = {
      {"q", {"rank 4", "[B, Sq, HQ, D]"}, [](Batched& a) { a.q = view(a.q.data, DType::kBF16, {10, kHQ, kD}); }},
      {"q", {"Sq <= Sk when causal", "Sq 7 > Sk 6"},
       [](Batched& a) {
         a.q = view(a.q.data, DType::kBF16, {2, 7, kHQ, kD});
         a.o = view(a.o.data, DType::kBF16, {2, 7, kHQ, kD});
         a.lse = view(a.lse->data, DType::kFP32, {2, 7, kHQ});
       }},
      {"k", {"batch size 2"}, [](Batched& a) { a.k = view(a.k.data, DType::kBF16, {1, 6, kHKV, kD}); }},
      {"v", {"[B, Sk, HKV, D]"}, [](Batched& a) { a.v = view(a.v.data, DType::kBF16, {2, 5, kHKV, kD}); }},
      {"o", {"[B, Sq, HQ, D]"}, [](Batched& a) { a.o = view(a.o.data, DType::kBF16, {2, 4, kHQ, kD}); }},
      {"lse", {"[B, Sq, HQ]"}, [](Batched& a) { a.lse = view(a.lse->data, DType::kFP32, {2, kHQ, 5}); }},
      {"cu_seqlens_k", {"must be given with cu_seqlens_q"},
       [&](Batched& a) { a.cu_q = view(b.seqlens.data(), DType::kInt32, {3}); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.arg) + ": " + c.says[0]);
    Batched a = make();
    c.mutate(a);
    expect_error([&] { call(a); }, kPrefill, c.arg, c.says);
  }
  // Not causal, Sq > Sk is allowed (every query sees every key).
  Batched a = make();
  a.params.causal = false;
  a.k = view(a.k.data, DType::kBF16, {2, 3, kHKV, kD});
  a.v = view(a.v.data, DType::kBF16, {2, 3, kHKV, kD});
  expect_reaches_device_checks([&] { call(a); });
}

// prefill_with_cache: q and cu_seqlens_q as in the packed form, the cache by decode's rules (every format, contiguous
// and paged), cache_seqlens int32 [B].
constexpr const char* kPrefillCache = "tessera::attention::prefill_with_cache";

struct PrefillCacheArgs {
  TensorView q, cu_q, seqlens, o;
  std::optional<TensorView> lse;
  KVCache cache;
  int64_t max_seqlen_q = 7;
  PrefillParams params;
};

PrefillCacheArgs make_prefill_cache(KVFormat f, bool paged) {
  Buffers& b = buffers();
  PrefillCacheArgs a;
  a.q = view(b.q.data(), DType::kBF16, {kTotalQ, kHQ, kD});
  a.cu_q = view(b.positions.data(), DType::kInt32, {kB + 1});
  a.seqlens = view(b.seqlens.data(), DType::kInt32, {kB});
  a.o = view(b.o.data(), DType::kBF16, {kTotalQ, kHQ, kD});
  a.lse = view(b.lse.data(), DType::kFP32, {kTotalQ, kHQ});
  a.cache = make_cache(f, paged);
  a.params.causal = true;
  return a;
}

void call_prefill_cache(const PrefillCacheArgs& a) {
  (void)check_prefill_cache(kPrefillCache, a.q, a.cu_q, a.max_seqlen_q, a.cache, a.seqlens, a.o, a.lse, a.params);
}

TEST(PrefillValidation, WithCacheEveryFormatReachesTheDeviceChecks) {
  for (KVFormat f : kFormats)
    for (bool paged : {false, true}) {
      SCOPED_TRACE(std::string(kv_format_name(f)) + (paged ? " paged" : " contiguous"));
      expect_reaches_device_checks([&] { call_prefill_cache(make_prefill_cache(f, paged)); });
    }
}

TEST(PrefillValidation, WithCacheRulesNameTheirArgument) {
  struct Case {
    const char* arg;
    std::vector<std::string> says;
    std::function<void(PrefillCacheArgs&)> mutate;
  };
  const std::vector<Case> cases = {
      {"q", {"rank 3"}, [](PrefillCacheArgs& a) { a.q = view(a.q.data, DType::kBF16, {1, kTotalQ, kHQ, kD}); }},
      {"q", {"multiple of the cache's KV heads"},
       [](PrefillCacheArgs& a) { a.q = view(a.q.data, DType::kBF16, {kTotalQ, 3, kD}); }},
      {"cu_seqlens_q", {"[B + 1]"},
       [](PrefillCacheArgs& a) { a.cu_q = view(a.cu_q.data, DType::kInt32, {kB + 1, 1}); }},
      {"max_seqlen_q", {">= 0"}, [](PrefillCacheArgs& a) { a.max_seqlen_q = -1; }},
      {"cache.k", {"dtype"}, [](PrefillCacheArgs& a) { a.cache.k.dtype = a.cache.v.dtype = DType::kFP16; }},
      {"cache_seqlens", {"int32"}, [](PrefillCacheArgs& a) { a.seqlens.dtype = DType::kFP32; }},
      {"cache_seqlens", {"[B]"},
       [](PrefillCacheArgs& a) { a.seqlens = view(a.seqlens.data, DType::kInt32, {kB + 1}); }},
      {"o", {"[total_q, HQ, D]"},
       [](PrefillCacheArgs& a) { a.o = view(a.o.data, DType::kBF16, {kTotalQ + 1, kHQ, kD}); }},
      {"o", {"overlap"}, [](PrefillCacheArgs& a) { a.o.data = a.cache.k.data; }},
      {"lse", {"[total_q, HQ]"},
       [](PrefillCacheArgs& a) { a.lse = view(a.lse->data, DType::kFP32, {kTotalQ, kHQ + 1}); }},
      {"params.softmax_scale", {">= 0"}, [](PrefillCacheArgs& a) { a.params.softmax_scale = -1.0f; }},
      {"params.window", {">= 0"}, [](PrefillCacheArgs& a) { a.params.window = -1; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.arg) + ": " + c.says[0]);
    PrefillCacheArgs a = make_prefill_cache(KVFormat::kNative, true);
    c.mutate(a);
    expect_error([&] { call_prefill_cache(a); }, kPrefillCache, c.arg, c.says);
  }
}

// A contiguous cache of T_max 0 is refused before any launch (the kernel's tensor maps would span nothing: the
// driver's encoder rejected it, unexplained), but only where there is something to compute: no sequences (B 0) or no
// queries still pass the checks and launch nothing. (A paged cache has at least one page and one block-table column:
// decode's rules.)
TEST(PrefillValidation, WithCacheOfNoTokensIsRefusedWhereItWouldLaunch) {
  for (KVFormat f : {KVFormat::kNative, KVFormat::kInt8}) {
    SCOPED_TRACE(kv_format_name(f));
    PrefillCacheArgs a = make_prefill_cache(f, false);
    set_slots(a.cache, kB, 0);
    expect_error([&] { call_prefill_cache(a); }, kPrefillCache, "cache.k", {"at least one token", "T_max"});
    // No sequences: cu_seqlens_q [1], cache_seqlens [0], a cache of 0 rows of 0 tokens.
    PrefillCacheArgs none = make_prefill_cache(f, false);
    set_slots(none.cache, 0, 0);
    none.cu_q = view(none.cu_q.data, DType::kInt32, {1});
    none.seqlens = view(none.seqlens.data, DType::kInt32, {0});
    expect_reaches_device_checks([&] { call_prefill_cache(none); });
  }
}

// With a GPU the checks complete: the problem the launcher gets (strides in elements, the resolved scale, the grid
// bound clamped to total_q).
TEST(PrefillValidation, ResolvedProblemOnTheDevice) {
  TESSERA_REQUIRE_GPU();
  test::DeviceBuffer<uint8_t> mem(std::size_t{8} << 20);
  const auto at = [&](int64_t mib) { return static_cast<void*>(mem.get() + (mib << 20)); };
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  const auto dview = [&](void* p, DType t, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(p, t, shape, device);
  };
  TensorView q = dview(at(0), DType::kFP16, {kTotalQ, kHQ, kD});
  q.strides[0] = kHQ * kD + 64;  // padded rows
  const TensorView k = dview(at(1), DType::kFP16, {kTotalK, kHKV, kD});
  const TensorView v = dview(at(2), DType::kFP16, {kTotalK, kHKV, kD});
  const TensorView cu_q = dview(at(3), DType::kInt32, {kB + 1});
  const TensorView cu_k = dview(at(4), DType::kInt32, {kB + 1});
  const TensorView o = dview(at(5), DType::kFP16, {kTotalQ, kHQ, kD});
  TensorView lse = dview(at(6), DType::kFP32, {kTotalQ, kHQ});
  lse.strides[0] = 1;  // [HQ][total_q] in memory
  lse.strides[1] = kTotalQ;
  PrefillParams params;
  params.causal = true;
  const PrefillProblem p = check_prefill(kPrefill, q, k, v, cu_q, cu_k, 1000, o, lse, params);
  EXPECT_EQ(p.batch, kB);
  EXPECT_EQ(p.num_q_heads, kHQ);
  EXPECT_EQ(p.num_kv_heads, kHKV);
  EXPECT_EQ(p.head_dim, kD);
  EXPECT_TRUE(p.fp16);
  EXPECT_EQ(p.q_stride_token, kHQ * kD + 64);
  EXPECT_EQ(p.q_stride_head, kD);
  EXPECT_EQ(p.k_stride_token, kHKV * kD);
  EXPECT_EQ(p.lse_stride_token, 1);
  EXPECT_EQ(p.lse_stride_head, kTotalQ);
  EXPECT_EQ(p.total_q, kTotalQ);
  EXPECT_EQ(p.total_k, kTotalK);
  EXPECT_EQ(p.max_seqlen_q, kTotalQ);
  EXPECT_FLOAT_EQ(p.softmax_scale, 1.0f / std::sqrt(128.0f));
  EXPECT_TRUE(p.causal);
  EXPECT_EQ(p.cu_seqlens_q, static_cast<const int32_t*>(cu_q.data));
}

// ---- what the rules produce -----------------------------------------------------------------------------------

CacheDesc cache_desc(const KVCache& c, DType native = DType::kBF16) { return check_cache(kDecode, c, kB, kD, native); }

// The split choice (api.cpp, v15 in docs/perf/decode.md) on the shapes of the split sweep (bench/decode_split_sweep.py,
// H200, 132 SMs, with v14's merge), where the measured best counts were: hq8kv1 B 1 64-128 splits, B 8 16-32 (bf16 16),
// B 32 8 (bf16 4-8), Llama-3-8B B 1 16; and at large batches the choices that the same-run A/B left unchanged.
TEST(DecodeSplits, SmallBatchesTakeTheSweepsCounts) {
  constexpr int kSms = 132;
  for (KVFormat f : {KVFormat::kNative, KVFormat::kInt8, KVFormat::kInt4}) {
    SCOPED_TRACE(kv_format_name(f));
    EXPECT_EQ(select_num_splits(1, 1, 8, 8192, kSms, f, 128), 64);
    EXPECT_EQ(select_num_splits(1, 8, 4, 4096, kSms, f, 128), 16);
    EXPECT_EQ(select_num_splits(8, 1, 8, 8192, kSms, f, 128), 16);
  }
  EXPECT_EQ(select_num_splits(32, 1, 8, 8192, kSms, KVFormat::kInt8, 128), 8);
  EXPECT_EQ(select_num_splits(32, 1, 8, 8192, kSms, KVFormat::kInt4, 128), 8);
  EXPECT_EQ(select_num_splits(32, 1, 8, 8192, kSms, KVFormat::kNative, 128), 4);
  EXPECT_EQ(select_num_splits(128, 1, 8, 8192, kSms, KVFormat::kNative, 128), 1);
  EXPECT_EQ(select_num_splits(128, 1, 8, 8192, kSms, KVFormat::kInt4, 128), 4);
  EXPECT_EQ(select_num_splits(512, 1, 8, 8192, kSms, KVFormat::kInt4, 128), 1);
}

// The split rules: balanced plans from kDecodeBalanceMinBatch to kDecodeBalanceMaxBatch sequences with S >= 2, a
// sequence's split cap, and the workspace: none for one split, else B·S·(S new)·HQ rows of D + 1 floats (and, balanced,
// a (first slot, splits) pair per sequence), a 256-byte multiple.
TEST(DecodeSplits, BalancedPlansAndTheirWorkspace) {
  EXPECT_EQ(decode_workspace_bytes_for(8, 1, 8, 128, 1, true), 0u);
  // B 5, S 3, HQ 8, D 64, 7 splits: balanced, so the pairs follow the rows (16-byte aligned); not asked: the rows only
  EXPECT_EQ(decode_workspace_bytes_for(5, 3, 8, 64, 7, true),
            static_cast<std::size_t>(((5 * 7 * 3 * 8 * 65 * 4 + 15) / 16 * 16 + 5 * 8 + 255) / 256 * 256));
  EXPECT_EQ(decode_workspace_bytes_for(5, 3, 8, 64, 7, false),
            static_cast<std::size_t>((5 * 7 * 3 * 8 * 65 * 4 + 255) / 256 * 256));
  const int64_t big = kDecodeBalanceMaxBatch + 1;  // asked, but classic: the rows only
  EXPECT_EQ(decode_workspace_bytes_for(big, 1, 8, 128, 2, true),
            static_cast<std::size_t>((big * 2 * 8 * 129 * 4 + 255) / 256 * 256));
  EXPECT_TRUE(decode_balanced(kDecodeBalanceMinBatch, 2) && decode_balanced(kDecodeBalanceMaxBatch, 128));
  EXPECT_FALSE(decode_balanced(1, 64) || decode_balanced(kDecodeBalanceMaxBatch + 1, 2) || decode_balanced(64, 1));
  EXPECT_GE(kDecodeBalanceMinBatch, 2);
  EXPECT_EQ(decode_max_seq_splits(2), 32);
  EXPECT_EQ(decode_max_seq_splits(64), 64);
  EXPECT_EQ(decode_max_seq_splits(kDecodeMaxSplits), kDecodeMaxSplits);
}

// The balanced plan as decode_plan (kernel.cuh) computes it from config.h's arithmetic, with its warp sums and scan
// as plain loops here: each sequence's split count.
std::vector<int> balanced_plan(const std::vector<int>& lengths, int64_t capacity, int splits, int num_new, int window,
                               int rows_log2) {
  const int batch = static_cast<int>(lengths.size());
  std::vector<int> tiles(batch), out(batch);
  long long total = 0;
  int longest = 0;
  for (int b = 0; b < batch; ++b) {
    tiles[b] = decode_num_tiles(decode_clamped_len(lengths[b], capacity), num_new, window, rows_log2);
    total += tiles[b];
    longest = std::max(longest, tiles[b]);
  }
  const int budget = batch * splits;
  int chunk = decode_plan_first_chunk(total, longest, budget, decode_max_seq_splits(splits));
  for (;;) {
    int count = 0;
    for (int b = 0; b < batch; ++b) count += out[b] = decode_plan_splits(tiles[b], chunk);
    if (count <= budget) break;
    chunk = decode_plan_next_chunk(chunk, count, budget);
  }
  return out;
}

// Every balanced plan fits the grid (at most B·S splits, so every split has a CTA), gives each sequence at least one
// split (its split 0 writes o or the merge's table) and at most max(S, 32) (what the merge covers), and splits equal
// lengths as the classic plan does: ceil(tiles / ceil(tiles / S)) non-empty splits where those hold 4 stages or more.
// Random batches (Zipf, one long among short, uniform, equal, lengths past the capacity or negative), split counts,
// new tokens, windows and stage sizes.
TEST(DecodeSplits, BalancedPlanFitsItsBudget) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  for (int run = 0; run < 20000; ++run) {
    const int batch = std::uniform_int_distribution<int>(kDecodeBalanceMinBatch, kDecodeBalanceMaxBatch)(rng);
    const int splits = std::uniform_int_distribution<int>(2, kDecodeMaxSplits)(rng);
    const int64_t capacity = int64_t{1} << std::uniform_int_distribution<int>(4, 20)(rng);
    const int num_new = std::uniform_int_distribution<int>(1, kDecodeMaxNewTokens)(rng);
    const int window = run % 3 == 0 ? std::uniform_int_distribution<int>(1, 5000)(rng) : 0;
    const int rows_log2 = run % 2 ? 4 : 5;
    const int kind = run % 5;
    std::vector<int> lengths(batch);
    for (int b = 0; b < batch; ++b) {
      const int cap = static_cast<int>(capacity);
      lengths[b] = kind == 0   ? cap / (b + 1)
                   : kind == 1 ? (b == 0 ? cap : std::uniform_int_distribution<int>(0, 40)(rng))
                   : kind == 2 ? std::uniform_int_distribution<int>(-5, cap + 100)(rng)
                               : cap;
    }
    const std::vector<int> plan = balanced_plan(lengths, capacity, splits, num_new, window, rows_log2);
    int count = 0;
    for (int b = 0; b < batch; ++b) {
      ASSERT_GE(plan[b], 1) << "run " << run << " b " << b;
      ASSERT_LE(plan[b], decode_max_seq_splits(splits)) << "run " << run << " b " << b;
      count += plan[b];
    }
    ASSERT_LE(count, batch * splits) << "run " << run << ": B " << batch << " S " << splits;
    if (kind >= 3) {  // equal lengths
      const int tiles = decode_num_tiles(decode_clamped_len(lengths[0], capacity), num_new, window, rows_log2);
      const int per_split = (tiles + splits - 1) / splits;
      if (tiles > 0 && per_split >= kDecodeWarps)
        ASSERT_EQ(plan[0], (tiles + per_split - 1) / per_split) << "run " << run << ": tiles " << tiles << " S " << splits;
    }
  }
}

// Above 8 splits only powers of two (a split's tiles go round-robin to 4 warps), never more than the capacity holds.
TEST(DecodeSplits, CountsAboveEightArePowersOfTwo) {
  for (KVFormat f : {KVFormat::kNative, KVFormat::kFP8, KVFormat::kInt8, KVFormat::kInt4, KVFormat::kInt4Group32,
                     KVFormat::kInt8KChannel, KVFormat::kInt4KChannel})
    for (int64_t batch : {1, 2, 3, 8, 17, 64, 300})
      for (int64_t hkv : {1, 8})
        for (int64_t cap : {64, 1000, 8192, 131072})
          for (int64_t d : {64, 128, 256}) {
            const int s = select_num_splits(batch, hkv, 8, cap, 132, f, d);
            EXPECT_GE(s, 1);
            EXPECT_LE(s, kDecodeMaxSplits);
            if (s > 8) EXPECT_EQ(s & (s - 1), 0) << kv_format_name(f) << " B " << batch << " T " << cap;
          }
}

TEST(DecodeCacheDesc, ContiguousNativeStridesInBytes) {
  const KVCache c = make_cache(KVFormat::kNative, false);
  const CacheDesc d = cache_desc(c);
  EXPECT_EQ(d.format, KVFormat::kNative);
  EXPECT_FALSE(d.fp16);
  EXPECT_FALSE(d.paged);
  EXPECT_EQ(d.num_kv_heads, kHKV);
  EXPECT_EQ(d.head_dim, kD);
  EXPECT_EQ(d.row_bytes, kD * 2);
  EXPECT_EQ(d.capacity, kT);
  EXPECT_EQ(d.num_pages, kB);
  EXPECT_EQ(d.page_size, 0);
  EXPECT_EQ(d.stride_head, kD * 2);
  EXPECT_EQ(d.stride_token, kHKV * kD * 2);
  EXPECT_EQ(d.stride_outer, kT * kHKV * kD * 2);
  EXPECT_EQ(d.k, c.k.data);
  EXPECT_EQ(d.v, c.v.data);
  EXPECT_EQ(d.num_scale_groups, 0);
  EXPECT_EQ(d.k_scale, nullptr);
  EXPECT_EQ(d.k_fp8_scale, nullptr);
  EXPECT_EQ(d.block_table, nullptr);

  KVCache h = c;
  both(h, [](TensorView& t) { t.dtype = DType::kFP16; });
  EXPECT_TRUE(cache_desc(h, DType::kFP16).fp16);
}

TEST(DecodeCacheDesc, PagedInt4Group32) {
  KVCache c = make_cache(KVFormat::kInt4Group32, true);
  c.block_table->strides[0] = kMaxPages + 4;  // a padded table
  const CacheDesc d = cache_desc(c);
  EXPECT_TRUE(d.paged);
  EXPECT_EQ(d.row_bytes, kD / 2);
  EXPECT_EQ(d.page_size, kPageSize);
  EXPECT_EQ(d.log2_page_size, 4);
  EXPECT_EQ(d.num_pages, kNumPages);
  EXPECT_EQ(d.max_pages, kMaxPages);
  EXPECT_EQ(d.capacity, kMaxPages * kPageSize);
  EXPECT_EQ(d.block_table, c.block_table->data);
  EXPECT_EQ(d.block_table_stride, kMaxPages + 4);
  EXPECT_EQ(d.stride_head, kD / 2);
  EXPECT_EQ(d.stride_token, kHKV * kD / 2);
  EXPECT_EQ(d.stride_outer, kPageSize * kHKV * kD / 2);
  EXPECT_EQ(d.num_scale_groups, kD / 32);
  EXPECT_EQ(d.k_scale, c.k_scale->data);
  EXPECT_EQ(d.v_scale, c.v_scale->data);
  // Scale strides count fp16 elements: 2 * NG = 8 per (token, head).
  EXPECT_EQ(d.scale_stride_head, 8);
  EXPECT_EQ(d.scale_stride_token, kHKV * 8);
  EXPECT_EQ(d.scale_stride_outer, kPageSize * kHKV * 8);
}

TEST(DecodeCacheDesc, PageSizesAndScaleModes) {
  for (int64_t page : {16, 32, 64, 128, 256}) {
    KVCache c = make_cache(KVFormat::kInt8, true);
    both(c, [&](TensorView& t) { t = view(t.data, t.dtype, {2, page, kHKV, kD}); });
    both_scales(c, [&](TensorView& t) { t = view(t.data, t.dtype, {2, page, kHKV, 2}); });
    const CacheDesc d = cache_desc(c);
    EXPECT_EQ(int64_t{1} << d.log2_page_size, page);
    EXPECT_EQ(d.capacity, kMaxPages * page);
    EXPECT_EQ(d.num_scale_groups, 1);
  }
  for (KVFormat f : {KVFormat::kInt8KChannel, KVFormat::kInt4KChannel})
    for (int64_t page : {32, 64, 128, 256}) {
      KVCache c = make_cache(f, true);
      set_slots(c, 2, page);
      const CacheDesc d = cache_desc(c);
      EXPECT_EQ(d.page_size, page);
      EXPECT_EQ(d.capacity, 2 * page);  // two pages per sequence
      EXPECT_EQ(d.kc_stride_outer, page / 32 * kHKV * 2 * kD);
      EXPECT_EQ(d.scale_stride_outer, page * kHKV * 2);
    }
  KVCache c = make_cache(KVFormat::kFP8, false);
  CacheDesc d = cache_desc(c);
  EXPECT_TRUE(d.fp8_per_head);
  EXPECT_EQ(d.k_fp8_scale, c.k_scale->data);
  EXPECT_EQ(d.v_fp8_scale, c.v_scale->data);
  EXPECT_EQ(d.k_scale, nullptr);
  both_scales(c, [](TensorView& t) { t.shape[0] = 1; });
  EXPECT_FALSE(cache_desc(c).fp8_per_head);
}

// Per-channel key formats: the key scales' strides (per block) apart from the value scales' (per token).
TEST(DecodeCacheDesc, ChannelFormatsDescribeBothScaleTensors) {
  for (KVFormat f : {KVFormat::kInt8KChannel, KVFormat::kInt4KChannel})
    for (bool paged : {false, true}) {
      SCOPED_TRACE(describe(f, paged));
      KVCache c = make_cache(f, paged);
      c.k_scale->strides[2] = 2 * kD + 8;  // padded head rows of the key scales
      c.k_scale->strides[1] = kHKV * (2 * kD + 8);
      c.k_scale->strides[0] = c.k_scale->shape[1] * c.k_scale->strides[1] + 64;
      c.v_scale->strides[2] = 6;
      c.v_scale->strides[1] = kHKV * 6;
      c.v_scale->strides[0] = c.v_scale->shape[1] * kHKV * 6;
      const CacheDesc d = cache_desc(c);
      EXPECT_TRUE(d.k_channel);
      EXPECT_EQ(d.num_scale_groups, 1);
      EXPECT_EQ(d.row_bytes, f == KVFormat::kInt4KChannel ? kD / 2 : kD);
      EXPECT_EQ(d.capacity, kT);
      EXPECT_EQ(d.k_scale, c.k_scale->data);
      EXPECT_EQ(d.v_scale, c.v_scale->data);
      EXPECT_EQ(d.kc_stride_head, 2 * kD + 8);
      EXPECT_EQ(d.kc_stride_block, kHKV * (2 * kD + 8));
      EXPECT_EQ(d.kc_stride_outer, c.k_scale->strides[0]);
      EXPECT_EQ(d.scale_stride_head, 6);
      EXPECT_EQ(d.scale_stride_token, kHKV * 6);
      EXPECT_EQ(d.scale_stride_outer, c.v_scale->strides[0]);
      EXPECT_EQ(d.k_residual, nullptr);  // decode's description: the residual is append_kv's
    }
  const CacheDesc row = cache_desc(make_cache(KVFormat::kInt8, false));
  EXPECT_FALSE(row.k_channel);
  EXPECT_EQ(row.kc_stride_head, 0);
}

TEST(DecodeCacheDesc, SizeOneDimsGetDenseStrides) {
  // One sequence whose batch stride is garbage (frameworks leave anything on size-1 dims): the launcher sees a
  // dense, 16-byte-multiple stride instead.
  KVCache c = make_cache(KVFormat::kFP8, false);
  both(c, [](TensorView& t) { t.shape[0] = 1; t.strides[0] = 3; });
  const CacheDesc d = check_cache(kDecode, c, 1, kD, DType::kBF16);
  EXPECT_EQ(d.stride_outer, kT * kHKV * kD);
  EXPECT_EQ(d.num_pages, 1);
}

TEST(DecodeValidation, FormatNames) {
  EXPECT_STREQ(kv_format_name(KVFormat::kNative), "native");
  EXPECT_STREQ(kv_format_name(KVFormat::kFP8), "fp8");
  EXPECT_STREQ(kv_format_name(KVFormat::kInt8), "int8");
  EXPECT_STREQ(kv_format_name(KVFormat::kInt4), "int4");
  EXPECT_STREQ(kv_format_name(KVFormat::kInt4Group32), "int4_group32");
  EXPECT_STREQ(kv_format_name(KVFormat::kInt8KChannel), "int8_kchannel");
  EXPECT_STREQ(kv_format_name(KVFormat::kInt4KChannel), "int4_kchannel");
  EXPECT_STREQ(kv_format_name(static_cast<KVFormat>(9)), "unknown");
}

// With a GPU the checks complete, and the resolved values (scale, split count, workspace) can be seen.
TEST(DecodeValidation, ResolvedProblemOnTheDevice) {
  TESSERA_REQUIRE_GPU();
  test::DeviceBuffer<uint8_t> mem(std::size_t{16} << 20);
  uint8_t* base = mem.get();
  const auto at = [&](int64_t mib) { return static_cast<void*>(base + (mib << 20)); };
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  const auto dview = [&](void* p, DType t, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(p, t, shape, device);
  };
  KVCache cache;
  cache.format = KVFormat::kInt8;
  cache.k = dview(at(0), DType::kUInt8, {kB, kT, kHKV, kD});
  cache.v = dview(at(1), DType::kUInt8, {kB, kT, kHKV, kD});
  cache.k_scale = dview(at(2), DType::kFP16, {kB, kT, kHKV, 2});
  cache.v_scale = dview(at(3), DType::kFP16, {kB, kT, kHKV, 2});
  const TensorView q = dview(at(4), DType::kFP16, {kB, kHQ, kD});
  const TensorView o = dview(at(5), DType::kFP16, {kB, kHQ, kD});
  const TensorView seqlens = dview(at(6), DType::kInt32, {kB});
  const Workspace ws{at(8), std::size_t{8} << 20};
  ASSERT_GE(ws.bytes, decode_workspace_bytes_for(kB, 1, kHQ, kD, kDecodeMaxSplits, true));

  DecodeParams params;
  params.num_splits = kDecodeMaxSplits;  // capped: 64 tokens of capacity make at most 4 useful splits
  DecodeProblem p = check_decode(kDecode, q, cache, seqlens, o, std::nullopt, ws, params);
  EXPECT_EQ(p.num_splits, 4);
  EXPECT_EQ(p.workspace_bytes, decode_workspace_bytes_for(kB, 1, kHQ, kD, 4, false));
  EXPECT_FLOAT_EQ(p.softmax_scale, 1.0f / std::sqrt(128.0f));
  EXPECT_TRUE(p.fp16);
  EXPECT_EQ(p.batch, kB);
  EXPECT_EQ(p.num_q_heads, kHQ);
  EXPECT_EQ(p.q_stride_b, kHQ * kD);
  EXPECT_EQ(p.q_stride_h, kD);
  EXPECT_EQ(p.lse, nullptr);
  EXPECT_EQ(p.cache.stride_token, kHKV * kD);
  EXPECT_EQ(p.num_new, 1);

  // Three new tokens per sequence: q [B, 3, HQ, D], o alike, lse [B, 3, HQ]; the workspace counts B · 3 rows.
  {
    const TensorView q3 = dview(at(4), DType::kFP16, {kB, 3, kHQ, kD});
    const TensorView o3 = dview(at(5), DType::kFP16, {kB, 3, kHQ, kD});
    const TensorView lse3 = dview(at(7), DType::kFP32, {kB, 3, kHQ});
    DecodeParams p3;
    p3.num_splits = 2;
    const DecodeProblem m = check_decode(kDecode, q3, cache, seqlens, o3, lse3, ws, p3);
    EXPECT_EQ(m.num_new, 3);
    EXPECT_EQ(m.q_stride_b, 3 * kHQ * kD);
    EXPECT_EQ(m.q_stride_s, kHQ * kD);
    EXPECT_EQ(m.q_stride_h, kD);
    EXPECT_EQ(m.o_stride_s, kHQ * kD);
    EXPECT_EQ(m.lse_stride_b, 3 * kHQ);
    EXPECT_EQ(m.lse_stride_s, kHQ);
    EXPECT_EQ(m.lse_stride_h, 1);
    EXPECT_EQ(m.workspace_bytes, decode_workspace_bytes_for(kB, 3, kHQ, kD, 2, false));
    EXPECT_EQ(decode_workspace_bytes(q3, cache, p3), m.workspace_bytes);
  }

  params.num_splits = 0;
  params.softmax_scale = 0.25f;
  p = check_decode(kDecode, q, cache, seqlens, o, std::nullopt, ws, params);
  EXPECT_GE(p.num_splits, 1);
  EXPECT_LE(p.num_splits, 4);
  EXPECT_EQ(p.softmax_scale, 0.25f);

  const TensorView k_new = dview(at(4), DType::kFP16, {kB, 1, kHKV, kD});
  const TensorView v_new = dview(at(5), DType::kFP16, {kB, 1, kHKV, kD});
  const AppendProblem a = check_append(kAppend, k_new, v_new, seqlens, cache);
  EXPECT_EQ(a.num_new, 1);
  EXPECT_EQ(a.new_stride_s, kHKV * kD);
  EXPECT_EQ(a.vnew_stride_h, kD);
  EXPECT_EQ(a.cache.num_scale_groups, 1);
  EXPECT_EQ(a.cache.k_residual, nullptr);

  // A per-channel cache: append_kv gets the residual's address, dtype and strides (elements).
  KVCache kc;
  kc.format = KVFormat::kInt4KChannel;
  kc.k = dview(at(9), DType::kUInt8, {kB, kT, kHKV, kD / 2});
  kc.v = dview(at(10), DType::kUInt8, {kB, kT, kHKV, kD / 2});
  kc.k_scale = dview(at(11), DType::kFP16, {kB, kT / kKeyBlock, kHKV, 2 * kD});
  kc.v_scale = dview(at(12), DType::kFP16, {kB, kT, kHKV, 2});
  kc.k_residual = test::strided(at(13), DType::kFP16, {kB, kKeyResidualRows, kHKV, kD},
                                {kKeyResidualRows * kHKV * (kD + 8), kHKV * (kD + 8), kD + 8, 1});
  const AppendProblem ac = check_append(kAppend, k_new, v_new, seqlens, kc);
  EXPECT_TRUE(ac.cache.k_channel);
  EXPECT_EQ(ac.cache.k_residual, kc.k_residual->data);
  EXPECT_EQ(ac.cache.res_stride_head, kD + 8);
  EXPECT_EQ(ac.cache.res_stride_slot, kHKV * (kD + 8));
  EXPECT_EQ(ac.cache.res_stride_b, kKeyResidualRows * kHKV * (kD + 8));
  EXPECT_EQ(ac.cache.kc_stride_block, kHKV * 2 * kD);
  EXPECT_EQ(ac.cache.scale_stride_token, kHKV * 2);
  // Decode reads no residual: its description has none, given or not.
  const DecodeProblem dc = check_decode(kDecode, q, kc, seqlens, o, std::nullopt, ws, params);
  EXPECT_EQ(dc.cache.k_residual, nullptr);
  EXPECT_TRUE(dc.cache.k_channel);
}

// GQA packing (prefill_rows): chosen for short queries of a group > 1, never for a long sequence or a group of one,
// on or off when asked; a packed tile holds 128 / G tokens of each of the G heads.
TEST(PrefillValidation, GqaPackingChoice) {
  const auto rows = [](int hq, int hkv, int max_sq, int pack) {
    PrefillProblem p;
    p.num_q_heads = hq;
    p.num_kv_heads = hkv;
    p.max_seqlen_q = max_sq;
    p.pack_gqa = pack;
    const PrefillRows r = prefill_rows(p);
    return std::to_string(r.tokens) + "x" + std::to_string(r.heads);
  };
  EXPECT_EQ(rows(32, 8, 64, -1), "32x4");     // 2 packed tiles against 4
  EXPECT_EQ(rows(32, 8, 1, -1), "32x4");
  EXPECT_EQ(rows(40, 8, 16, -1), "25x5");     // a group that does not divide 128: 125 rows
  EXPECT_EQ(rows(64, 1, 7, -1), "2x64");
  EXPECT_EQ(rows(32, 8, 4096, -1), "128x1");  // as many tiles either way
  EXPECT_EQ(rows(32, 8, 10000, -1), "128x1"); // 313 against 316: not an eighth fewer
  EXPECT_EQ(rows(32, 32, 16, -1), "128x1");   // no group
  EXPECT_EQ(rows(32, 8, 64, 0), "128x1");
  EXPECT_EQ(rows(32, 8, 4096, 1), "32x4");
  EXPECT_EQ(rows(256, 1, 16, 1), "128x1");    // a group above 128 cannot pack (1 is refused by the checks)
}

}  // namespace
}  // namespace tessera::attention::detail
