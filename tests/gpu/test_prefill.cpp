// Prefill (include/tessera/attention.h: prefill, prefill_varlen) on the GPU against the float64 reference
// (prefill_reference) on the same rounded inputs, through the public entry points and their validation.
//
// Inputs: fresh normals rounded to the 16-bit type, in separate tensors or one fused qkv buffer, packed or as a plain
// batch; o (optionally with padded rows) and lse (optionally transposed) poisoned with NaN; the checks of
// prefill_test_util.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "gpu/prefill_test_util.h"
#include "common/host_numeric.h"
#include "reference/attention_reference.h"
#include "tessera/attention.h"

namespace tessera::attention {
namespace {

using prefilltest::Check;
using prefilltest::compare_outputs;
using prefilltest::round16;
using prefilltest::widen16;
using reference::PrefillRef;
using reference::PrefillRefParams;
using reference::PrefillShape;
using test::strided;

struct PrefillCase {
  int D = 128, HQ = 8, HKV = 2;
  bool fp16 = false;
  std::vector<int32_t> sq, sk;
  PrefillRefParams params;
  int pack_gqa = -1;        // PrefillParams::pack_gqa
  bool batched = false;     // the plain [B, S, H, D] form (every sq equal, every sk equal)
  bool fused_qkv = false;   // q, k, v as head ranges of one [tokens, HQ + 2 HKV, D] buffer (sq == sk per sequence)
  bool strided_out = false; // o rows padded by 8 elements per head, lse transposed ([HQ][tokens] in memory)
  std::string describe() const {
    std::string s = "D=" + std::to_string(D) + " HQ=" + std::to_string(HQ) + " HKV=" + std::to_string(HKV) +
                    (fp16 ? " fp16" : " bf16") + (params.causal ? " causal" : "") +
                    (params.window ? " window=" + std::to_string(params.window) : "") +
                    (params.softcap > 0 ? " softcap=" + std::to_string(params.softcap) : "") +
                    " pack_gqa=" + std::to_string(pack_gqa) + (batched ? " batched" : " packed") +
                    (fused_qkv ? " fused-qkv" : "") + (strided_out ? " strided-out" : "") + " (sq,sk)=";
    for (size_t b = 0; b < sq.size(); ++b) s += "(" + std::to_string(sq[b]) + "," + std::to_string(sk[b]) + ")";
    return s;
  }
};


// Device tensors of one case: inputs uploaded in the case's layout, outputs poisoned, views of all of them.
struct PrefillRun {
  PrefillCase c;
  std::vector<int32_t> cu_q = {0}, cu_k = {0};
  int64_t total_q = 0, total_k = 0;
  std::vector<double> qd, kd, vd;  // packed [tokens][heads][D], the values the device sees
  test::DeviceBuffer<uint16_t> qkv_dev, q_dev, k_dev, v_dev, o_dev;
  test::DeviceBuffer<float> lse_dev;
  test::DeviceBuffer<int32_t> cuq_dev, cuk_dev;
  int64_t o_head = 0, o_token = 0, lse_head = 0, lse_token = 0;  // output strides (elements)
  int64_t o_elems = 0, lse_elems = 0;  // what the views span; the buffers hold kGuard more, never to be written
  int max_seqlen_bound = 0;            // > 0: the max_seqlen_q passed instead of the largest sq
  static constexpr int64_t kGuard = 4096;

  PrefillRun(const PrefillCase& cs, uint64_t seed) : c(cs) {
    const int B = static_cast<int>(c.sq.size());
    for (int b = 0; b < B; ++b) {
      cu_q.push_back(cu_q.back() + c.sq[b]);
      cu_k.push_back(cu_k.back() + c.sk[b]);
    }
    total_q = cu_q.back();
    total_k = cu_k.back();
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto fill = [&](int64_t count, float sigma, std::vector<uint16_t>& bits, std::vector<double>& vals) {
      bits.resize(count);
      vals.resize(count);
      for (int64_t i = 0; i < count; ++i) {
        bits[i] = round16(sigma * n(rng), c.fp16);
        vals[i] = widen16(bits[i], c.fp16);
      }
    };
    std::vector<uint16_t> qb, kb, vb;
    fill(total_q * c.HQ * c.D, 1.0f, qb, qd);
    fill(total_k * c.HKV * c.D, 1.5f, kb, kd);
    fill(total_k * c.HKV * c.D, 1.0f, vb, vd);
    if (c.fused_qkv) {
      const int64_t heads = c.HQ + 2 * c.HKV;
      std::vector<uint16_t> all(std::max<int64_t>(total_q * heads * c.D, 1));
      for (int64_t t = 0; t < total_q; ++t) {
        uint16_t* row = all.data() + t * heads * c.D;
        std::memcpy(row, qb.data() + t * c.HQ * c.D, sizeof(uint16_t) * c.HQ * c.D);
        std::memcpy(row + c.HQ * c.D, kb.data() + t * c.HKV * c.D, sizeof(uint16_t) * c.HKV * c.D);
        std::memcpy(row + (c.HQ + c.HKV) * c.D, vb.data() + t * c.HKV * c.D, sizeof(uint16_t) * c.HKV * c.D);
      }
      qkv_dev = test::DeviceBuffer<uint16_t>(all);
    } else {
      // At least 8 elements each, so that empty batches still have valid, aligned pointers.
      qb.resize(std::max<size_t>(qb.size(), 8));
      kb.resize(std::max<size_t>(kb.size(), 8));
      vb.resize(std::max<size_t>(vb.size(), 8));
      q_dev = test::DeviceBuffer<uint16_t>(qb);
      k_dev = test::DeviceBuffer<uint16_t>(kb);
      v_dev = test::DeviceBuffer<uint16_t>(vb);
    }
    o_head = c.strided_out ? c.D + 8 : c.D;
    o_token = o_head * c.HQ;
    lse_head = c.strided_out ? std::max<int64_t>(total_q, 1) : 1;
    lse_token = c.strided_out ? 1 : c.HQ;
    o_elems = total_q * o_token;
    lse_elems = total_q * c.HQ;
    o_dev = test::DeviceBuffer<uint16_t>(o_elems + kGuard);
    lse_dev = test::DeviceBuffer<float>(lse_elems + kGuard);
    cuq_dev = test::DeviceBuffer<int32_t>(cu_q);
    cuk_dev = test::DeviceBuffer<int32_t>(cu_k);
    o_dev.poison();
    lse_dev.poison();
  }

  // Views of rows x heads x D starting at `base` with the token stride `tok` (packed, or [B, S, ...] batched).
  TensorView rows(void* base, DType dt, int64_t tokens, int heads, int64_t tok, int64_t head) const {
    if (!c.batched) return strided(base, dt, {tokens, heads, c.D}, {tok, head, 1});
    const int64_t B = static_cast<int64_t>(c.sq.size()), S = B > 0 ? tokens / B : 0;
    return strided(base, dt, {B, S, heads, c.D}, {S * tok, tok, head, 1});
  }
  TensorView q_view() const {
    const DType dt = c.fp16 ? DType::kFP16 : DType::kBF16;
    if (c.fused_qkv) return rows(qkv_dev.get(), dt, total_q, c.HQ, int64_t{c.HQ + 2 * c.HKV} * c.D, c.D);
    return rows(q_dev.get(), dt, total_q, c.HQ, int64_t{c.HQ} * c.D, c.D);
  }
  TensorView kv_view(bool is_v) const {
    const DType dt = c.fp16 ? DType::kFP16 : DType::kBF16;
    if (c.fused_qkv)
      return rows(qkv_dev.get() + (c.HQ + (is_v ? c.HKV : 0)) * c.D, dt, total_k, c.HKV,
                  int64_t{c.HQ + 2 * c.HKV} * c.D, c.D);
    return rows(is_v ? v_dev.get() : k_dev.get(), dt, total_k, c.HKV, int64_t{c.HKV} * c.D, c.D);
  }
  TensorView o_view() const {
    return rows(o_dev.get(), c.fp16 ? DType::kFP16 : DType::kBF16, total_q, c.HQ, o_token, o_head);
  }
  TensorView lse_view() const {
    if (!c.batched) return strided(lse_dev.get(), DType::kFP32, {total_q, c.HQ}, {lse_token, lse_head});
    const int64_t B = static_cast<int64_t>(c.sq.size()), S = B > 0 ? total_q / B : 0;
    return strided(lse_dev.get(), DType::kFP32, {B, S, c.HQ}, {S * lse_token, lse_token, lse_head});
  }
  PrefillParams params() const {
    PrefillParams p;
    p.softmax_scale = c.params.softmax_scale;
    p.softcap = c.params.softcap;
    p.window = c.params.window;
    p.causal = c.params.causal;
    p.pack_gqa = c.pack_gqa;
    return p;
  }
  int max_seqlen_q() const {
    if (max_seqlen_bound > 0) return max_seqlen_bound;
    return c.sq.empty() ? 0 : *std::max_element(c.sq.begin(), c.sq.end());
  }
  // The guard elements past the views still hold the poison (0xFF bytes).
  bool guards_intact() const {
    const std::vector<uint16_t> o = o_dev.download();
    const std::vector<float> lse = lse_dev.download();
    for (int64_t i = o_elems; i < o_elems + kGuard; ++i)
      if (o[i] != 0xFFFF) return false;
    for (int64_t i = lse_elems; i < lse_elems + kGuard; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &lse[i], 4);
      if (bits != 0xFFFFFFFFu) return false;
    }
    return true;
  }

  void launch(cudaStream_t stream) const {
    if (c.batched)
      prefill(q_view(), kv_view(false), kv_view(true), o_view(), lse_view(), params(), stream);
    else
      prefill_varlen(q_view(), kv_view(false), kv_view(true), strided(cuq_dev.get(), DType::kInt32,
                     {static_cast<int64_t>(cu_q.size())}, {1}), strided(cuk_dev.get(), DType::kInt32,
                     {static_cast<int64_t>(cu_k.size())}, {1}), max_seqlen_q(), o_view(), lse_view(), params(),
                     stream);
  }

  // Compares the outputs on the device with the reference.
  Check compare() const {
    const int B = static_cast<int>(c.sq.size());
    const PrefillRef ref =
        reference::prefill_reference(qd, kd, vd, cu_q, cu_k, PrefillShape{B, c.HQ, c.HKV, c.D}, c.params);
    Check r = compare_outputs(o_dev.download(), o_token, o_head, lse_dev.download(), lse_token, lse_head, ref,
                              total_q, c.HQ, c.D, c.fp16);
    if (!guards_intact()) r.fail("an output was written past its view");
    return r;
  }
};

// Runs the op on fresh inputs and compares with the reference.
Check run_case(const PrefillCase& c, uint64_t seed) {
  PrefillRun run(c, seed);
  run.launch(nullptr);
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  return run.compare();
}

// Runs c on a fresh seed (printed on failure) and expects it to match the reference.
void expect_matches_reference(const PrefillCase& c) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
  const Check r = run_case(c, seed);
  EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
}

// The same with one head per tile and with the KV head's query heads sharing it (pack_gqa 0 and 1).
void expect_matches_reference_packed_and_not(PrefillCase c) {
  for (int pack : {0, 1}) {
    c.pack_gqa = pack;
    expect_matches_reference(c);
  }
}

class PrefillGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

// Lengths around every tile edge (64-row consumer halves, 128-row query tiles, 64- and 128-key tiles), Sq < Sk and
// Sq = Sk, empty sequences inside the batch, every head dim and both 16-bit types, with and without the causal mask.
TEST_F(PrefillGpu, LengthsHeadDimsAndMasks) {
  const std::vector<int32_t> sq = {1, 63, 64, 0, 65, 130, 200, 7}, sk = {1, 63, 100, 5, 65, 300, 200, 0};
  for (int D : {64, 128, 256})
    for (bool fp16 : {false, true})
      for (bool causal : {false, true}) {
        PrefillCase c;
        c.D = D;
        c.fp16 = fp16;
        c.HQ = 8;
        c.HKV = 2;
        c.sq = sq;
        c.sk = sk;
        c.params.causal = causal;
        expect_matches_reference(c);
      }
}

// GQA ratios 1, 4, 5, 8, 16; windows and softcap; a long sequence with many key tiles.
TEST_F(PrefillGpu, GroupsWindowsSoftcap) {
  struct G {
    int HQ, HKV, D;
    int window;
    float softcap;
    bool causal;
  };
  const G grid[] = {{4, 4, 128, 0, 0.0f, true},   {16, 4, 64, 37, 0.0f, true},  {5, 1, 128, 0, 5.0f, false},
                    {16, 2, 256, 100, 0.0f, false}, {16, 1, 128, 1, 0.0f, true}, {8, 8, 64, 0, 30.0f, true},
                    {32, 1, 64, 0, 0.0f, true}};
  for (const G& g : grid) {
    PrefillCase c;
    c.D = g.D;
    c.HQ = g.HQ;
    c.HKV = g.HKV;
    c.sq = {300, 17, 129};
    c.sk = {1000, 17, 700};
    c.params.causal = g.causal;
    c.params.window = g.window;
    c.params.softcap = g.softcap;
    expect_matches_reference_packed_and_not(c);
  }
}

// Query-head groups of 64 to 128 on one KV head (a packed tile holds 2 or 1 tokens of each; at G 96, 32 of its 128
// rows are unused), packed and not, short sequences (every packed tile crosses the causal diagonal).
TEST_F(PrefillGpu, LargeGroupsPacked) {
  struct G {
    int HQ, D;
    bool causal;
    int window;
  };
  const G grid[] = {{64, 64, true, 0}, {96, 256, true, 7}, {128, 128, false, 0}, {128, 64, true, 0}};
  for (const G& g : grid) {
    PrefillCase c;
    c.D = g.D;
    c.HQ = g.HQ;
    c.HKV = 1;
    c.sq = {40, 3, 0, 9};
    c.sk = {300, 3, 5, 9};
    c.params.causal = g.causal;
    c.params.window = g.window;
    expect_matches_reference_packed_and_not(c);
  }
}

// One configuration drawn from the seed (for the stress step: every seed a different shape): 1-4 sequences of 0-300
// queries over as many or more keys, any head dim, dtype, GQA ratio of {1, 2, 4, 5, 8}, causal or not, a window or a
// softcap now and then, GQA packing chosen, off or on.
TEST_F(PrefillGpu, RandomConfiguration) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  auto below = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  PrefillCase c;
  c.D = 64 << below(3);
  c.fp16 = below(2) == 1;
  const int groups[] = {1, 2, 4, 5, 8};
  c.HKV = 1 + below(3);
  c.HQ = c.HKV * groups[below(5)];
  c.params.causal = below(3) != 0;
  c.params.window = below(4) == 0 ? 1 + below(200) : 0;
  c.params.softcap = below(5) == 0 ? 10.0f : 0.0f;
  c.pack_gqa = below(3) - 1;
  const int B = 1 + below(4);
  for (int b = 0; b < B; ++b) {
    const int sq = below(6) == 0 ? 0 : below(301);
    c.sq.push_back(sq);
    c.sk.push_back(c.params.causal ? sq + below(200) : below(401));
  }
  SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
  const Check r = run_case(c, seed);
  EXPECT_TRUE(r.ok) << r.message << " (error " << r.error << ")";
}

// The plain batch ([B, S, H, D]), q / k / v as head ranges of one fused buffer, padded o rows and a transposed lse.
TEST_F(PrefillGpu, BatchedFusedAndStridedLayouts) {
  struct L {
    int D, S_q, S_k;
    bool batched, fused, strided_out, causal;
  };
  const L grid[] = {{64, 77, 77, true, true, false, true},    {128, 1, 1, true, false, true, false},
                    {128, 50, 300, true, false, false, true}, {256, 130, 130, true, true, true, true},
                    {128, 200, 200, false, true, true, true}, {64, 0, 40, true, false, false, false}};
  for (const L& l : grid) {
    PrefillCase c;
    c.D = l.D;
    c.HQ = 8;
    c.HKV = 2;
    c.sq = {l.S_q, l.S_q, l.S_q};
    c.sk = {l.S_k, l.S_k, l.S_k};
    c.batched = l.batched;
    c.fused_qkv = l.fused;
    c.strided_out = l.strided_out;
    c.params.causal = l.causal;
    expect_matches_reference(c);
  }
}

// One capture of prefill_varlen, replayed with new sequence lengths (the same totals, a max_seqlen_q bound) each
// time; every replay matches the reference of its lengths. Two runs of one problem are bitwise equal.
TEST_F(PrefillGpu, GraphReplayWithNewLengthsAndDeterminism) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed ^ 0x51ed270b27e5c3a1ull);
  PrefillCase c;
  c.D = 128;
  c.HQ = 8;
  c.HKV = 2;
  c.sq = {100, 100, 100, 100};
  c.sk = {150, 150, 150, 150};
  c.params.causal = true;
  SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
  PrefillRun run(c, seed);
  run.max_seqlen_bound = 400;
  test::Stream stream;
  test::CapturedGraph graph(stream.get(), [&] { run.launch(stream.get()); });
  for (int round = 0; round < 4; ++round) {
    // Random cut points of 400 queries and 600 keys into 4 sequences, sq <= sk each (causal).
    std::vector<int32_t> sq(4), sk(4);
    int left_q = 400, left_k = 600;
    for (int b = 0; b < 3; ++b) {
      sq[b] = static_cast<int>(rng() % static_cast<uint64_t>(left_q + 1));
      left_q -= sq[b];
      const int extra = static_cast<int>(rng() % static_cast<uint64_t>(std::max(left_k - sq[b] - left_q, 0) + 1));
      sk[b] = sq[b] + extra;
      left_k -= sk[b];
    }
    sq[3] = left_q;
    sk[3] = left_k;
    run.c.sq = sq;
    run.c.sk = sk;
    run.cu_q = {0};
    run.cu_k = {0};
    for (int b = 0; b < 4; ++b) {
      run.cu_q.push_back(run.cu_q.back() + sq[b]);
      run.cu_k.push_back(run.cu_k.back() + sk[b]);
    }
    run.cuq_dev.upload(run.cu_q);
    run.cuk_dev.upload(run.cu_k);
    run.o_dev.poison();
    run.lse_dev.poison();
    graph.replay(stream.get());
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    const Check r = run.compare();
    EXPECT_TRUE(r.ok) << "round " << round << ": " << r.message << " (error " << r.error << ")";
    if (round == 3) {
      const std::vector<uint16_t> first = run.o_dev.download();
      const std::vector<float> first_lse = run.lse_dev.download();
      run.o_dev.poison();
      graph.replay(stream.get());
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      EXPECT_TRUE(run.o_dev.download() == first) << "a second run of the same problem differs";
      const std::vector<float> again = run.lse_dev.download();
      EXPECT_EQ(std::memcmp(again.data(), first_lse.data(), again.size() * 4), 0) << "lse differs between runs";
    }
  }
}

// Device lengths that break the contract (past the totals, decreasing, negative) compute garbage but never write
// outside o and lse (the guards behind them stay poisoned) nor read outside q, k and v (compute-sanitizer).
TEST_F(PrefillGpu, WrongDeviceLengthsStayInBounds) {
  const uint64_t seed = test::fresh_seed();
  PrefillCase c;
  c.D = 64;
  c.HQ = 4;
  c.HKV = 2;
  c.sq = {100, 100, 56};
  c.sk = {100, 100, 56};
  c.params.causal = true;
  SCOPED_TRACE(c.describe() + " " + test::seed_note(seed));
  // One run over wrong device offsets: every write stays inside the outputs (their guards intact).
  const auto stays_in_bounds = [](PrefillRun& run, const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k) {
    run.cuq_dev.upload(cu_q);
    run.cuk_dev.upload(cu_k);
    run.o_dev.poison();
    run.lse_dev.poison();
    run.launch(nullptr);
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(run.guards_intact()) << "cu_seqlens_q " << cu_q[0] << "," << cu_q[1] << "," << cu_q[2] << ","
                                     << cu_q[3] << ", cu_seqlens_k " << cu_k[0] << "," << cu_k[1] << "," << cu_k[2]
                                     << "," << cu_k[3];
  };
  PrefillRun run(c, seed);
  run.max_seqlen_bound = 1000;
  for (const auto& cu : std::vector<std::vector<int32_t>>{
           {0, 200, 700, 900}, {0, 250, 100, 256}, {-300, 0, 128, 256}, {0, 100, 200, 1 << 30}})
    stays_in_bounds(run, cu, cu);
  // Decreasing key offsets under a causal sliding window: a negative key count once indexed shared memory below
  // the V tile (found in review); now such a sequence has no keys.
  c.params.window = 16;
  PrefillRun windowed(c, seed);
  windowed.max_seqlen_bound = 1000;
  for (const auto& cu_k : std::vector<std::vector<int32_t>>{{0, -100000, 100, 256}, {0, 100, 50, 256}, {200, 0, 0, 0}})
    stays_in_bounds(windowed, {0, 100, 200, 256}, cu_k);
}

}  // namespace
}  // namespace tessera::attention
