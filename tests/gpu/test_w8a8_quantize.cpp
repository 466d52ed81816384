// quantize_per_block on the GPU (tessera/w8a8.h) against tessera::reference::quantize_int8_blocks on the float values
// of x (bf16 / fp16 converted exactly): codes, scales, zero points and code sums must be equal bit for bit.
//
// Every case: x of rows with different scales (log-uniform over e^±3), some rows of one sign, three input columns 20x
// larger (one when K < 1024), an all-zero block, a constant block and a -0; row padding of strided x filled with
// NaN (must not be read); codes with padded rows and parameter planes with spare rows, every output byte poisoned
// before the call and the padding checked untouched after. Each case runs twice, poisoned with 0x5A and then 0xA5
// bytes: every int8 value is a valid code, so an unwritten code could match its reference once, never twice.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/w8a8_reference.h"
#include "tessera/error.h"
#include "tessera/w8a8.h"

namespace tessera::linear {
namespace {

using test::DeviceBuffer;

struct Case {
  int64_t m = 1, k = 128;
  int64_t block = 32;  // 0: K (per token)
  DType dtype = DType::kBF16;
  bool symmetric = false;
  bool sums = true;
  int64_t x_pad = 0;      // extra elements per x row, NaN
  int64_t x_offset = 0;   // elements of NaN before x (x not 16-byte aligned unless 16-byte multiple)
  int64_t codes_pad = 0;  // extra codes per row (a multiple of 16)
  int64_t ld_pad = 0;     // spare rows of the parameter planes (a multiple of 4)
  bool huge = false;      // a few blocks spanning ±3e38 (bf16 / fp32): hi − lo overflows, s = inf, inv = 0
  int64_t block_size() const { return block ? block : k; }
};

std::string describe(const Case& c) {
  std::string s = "M=" + std::to_string(c.m) + " K=" + std::to_string(c.k) +
                  " block=" + (c.block ? std::to_string(c.block) : "K") + " x=" + dtype_name(c.dtype) +
                  (c.symmetric ? " symmetric" : " asymmetric") + (c.sums ? " sums" : "");
  if (c.x_pad || c.x_offset) s += " x_pad=" + std::to_string(c.x_pad) + " x_offset=" + std::to_string(c.x_offset);
  if (c.codes_pad || c.ld_pad) s += " codes_pad=" + std::to_string(c.codes_pad) + " ld_pad=" + std::to_string(c.ld_pad);
  return s + (c.huge ? " huge" : "");
}

// ---- host data ------------------------------------------------------------------------------------------------------

std::size_t elem_size(DType d) { return d == DType::kFP32 ? 4 : 2; }

// v stored as `dtype` at `raw`; returns the value stored.
float store(DType dtype, float v, uint8_t* raw) {
  if (dtype == DType::kFP32) {
    std::memcpy(raw, &v, 4);
    return v;
  }
  const uint16_t b = dtype == DType::kBF16 ? host::f32_to_bf16(v) : host::f32_to_fp16(v);
  std::memcpy(raw, &b, 2);
  return dtype == DType::kBF16 ? host::bf16_to_f32(b) : host::fp16_to_f32(b);
}

struct Host {
  Case c;
  int64_t ldx = 0, ldc = 0, ld = 0, blocks = 0;
  std::vector<uint8_t> x_raw;  // x_offset + M · ldx elements of the dtype
  std::vector<float> x;        // [M][K], the stored values
  reference::Int8Blocks ref;
  std::vector<int32_t> ref_sums;
};

void set_reference(Host& h) {
  if (h.c.m == 0) return;
  h.ref = reference::quantize_int8_blocks(h.x, h.c.m, h.c.k, h.c.block_size(), h.c.symmetric);
  h.ref_sums = reference::block_code_sums(h.ref);
}

Host make_host(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Host h;
  h.c = c;
  const int64_t m = c.m, k = c.k, block = c.block_size();
  h.ldx = k + c.x_pad;
  h.ldc = k + c.codes_pad;
  h.ld = int8_block_param_ld(m) + c.ld_pad;
  h.blocks = k / block;
  const std::size_t es = elem_size(c.dtype);
  h.x_raw.resize(static_cast<std::size_t>(c.x_offset + m * h.ldx) * es);
  for (std::size_t i = 0; i < h.x_raw.size() / es; ++i) store(c.dtype, NAN, &h.x_raw[i * es]);
  h.x.resize(static_cast<std::size_t>(m * k));
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  std::vector<float> v(static_cast<std::size_t>(m * k));
  for (int64_t r = 0; r < m; ++r) {
    const float row_scale = std::exp(6.f * unit(rng) - 3.f);
    const int kind = static_cast<int>(rng() % 5);  // 0-2 both signs, 3 positive, 4 negative
    for (int64_t j = 0; j < k; ++j) {
      float e = normal(rng) * row_scale;
      if (kind == 3) e = std::fabs(e) + 0.05f * row_scale;
      if (kind == 4) e = -std::fabs(e);
      v[r * k + j] = e;
    }
  }
  if (m > 0) {
    for (int i = 0; i < (k >= 1024 ? 3 : 1); ++i) {  // outlier input columns
      const int64_t col = static_cast<int64_t>(rng() % k);
      for (int64_t r = 0; r < m; ++r) v[r * k + col] *= 20.f;
    }
    const int64_t zero_row = static_cast<int64_t>(rng() % m), zero_blk = static_cast<int64_t>(rng() % h.blocks);
    for (int64_t j = 0; j < block; ++j) v[zero_row * k + zero_blk * block + j] = 0.f;
    const int64_t const_row = static_cast<int64_t>(rng() % m), const_blk = static_cast<int64_t>(rng() % h.blocks);
    if (const_row != zero_row || const_blk != zero_blk)
      for (int64_t j = 0; j < block; ++j) v[const_row * k + const_blk * block + j] = 0.375f;
    v[static_cast<std::size_t>(rng() % (m * k))] = -0.f;
    if (c.huge)
      for (int i = 0; i < 3; ++i) {
        const int64_t at = static_cast<int64_t>(rng() % (m * h.blocks));
        const int64_t r = at / h.blocks, b = at % h.blocks;
        v[r * k + b * block] = 3e38f;
        v[r * k + b * block + block - 1] = -3e38f;
      }
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < k; ++j)
      h.x[r * k + j] =
          store(c.dtype, v[r * k + j], &h.x_raw[static_cast<std::size_t>(c.x_offset + r * h.ldx + j) * es]);
  set_reference(h);
  return h;
}

// ---- device side ----------------------------------------------------------------------------------------------------

struct Device {
  DeviceBuffer<uint8_t> x, codes;
  DeviceBuffer<float> scale, zero, sums;
  TensorView xv;
  Int8BlockTensor out;

  explicit Device(const Host& h)
      : x(h.x_raw),
        codes(static_cast<std::size_t>(h.c.m * h.ldc)),
        scale(static_cast<std::size_t>(h.blocks * h.ld)),
        zero(h.c.symmetric ? 0 : static_cast<std::size_t>(h.blocks * h.ld)),
        sums(h.c.sums ? static_cast<std::size_t>(h.blocks * h.ld) : 0) {
    const Case& c = h.c;
    xv = test::strided(x.get() + c.x_offset * elem_size(c.dtype), c.dtype, {c.m, c.k}, {h.ldx, 1});
    out.block = c.block_size();
    out.codes = test::strided(codes.get(), DType::kInt8, {c.m, c.k}, {h.ldc, 1});
    out.scale = test::strided(scale.get(), DType::kFP32, {h.blocks, c.m}, {h.ld, 1});
    if (!c.symmetric) out.zero = test::strided(zero.get(), DType::kFP32, {h.blocks, c.m}, {h.ld, 1});
    if (c.sums) out.sums = test::strided(sums.get(), DType::kFP32, {h.blocks, c.m}, {h.ld, 1});
  }
  void poison(uint8_t byte) {
    codes.poison(byte);
    scale.poison(byte);
    zero.poison(byte);
    sums.poison(byte);
  }
  void launch(cudaStream_t stream) const { quantize_per_block(xv, out, stream); }
};

struct Result {
  std::vector<uint8_t> codes;
  std::vector<float> scale, zero, sums;
};

Result download(const Device& d) {
  return {d.codes.download(), d.scale.download(), d.zero.download(), d.sums.download()};
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Every output equal to the reference, every padding byte still `poison`.
void expect_matches(const Host& h, const Result& got, uint8_t poison, const std::string& what = "") {
  const Case& c = h.c;
  const uint32_t poison_word = 0x01010101u * poison;
  int64_t bad_codes = 0, bad_pad = 0, bad_params = 0;
  ASSERT_EQ(got.codes.size(), static_cast<std::size_t>(c.m * h.ldc));
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t j = 0; j < h.ldc; ++j) {
      const uint8_t b = got.codes[r * h.ldc + j];
      if (j >= c.k) {
        bad_pad += b != poison;
        continue;
      }
      const int8_t want = h.ref.codes[r * c.k + j];
      if (static_cast<int8_t>(b) != want && bad_codes++ < 3)
        ADD_FAILURE() << what << "code [" << r << ", " << j << "] = " << int{static_cast<int8_t>(b)} << ", reference "
                      << int{want} << " (x = " << h.x[r * c.k + j] << ")";
    }
  const auto check_plane = [&](const std::vector<float>& plane, const char* name, auto want_of) {
    ASSERT_EQ(plane.size(), static_cast<std::size_t>(h.blocks * h.ld)) << name;
    for (int64_t b = 0; b < h.blocks; ++b)
      for (int64_t r = 0; r < h.ld; ++r) {
        const float v = plane[b * h.ld + r];
        if (r >= c.m) {
          bad_pad += bits(v) != poison_word;
          continue;
        }
        const float want = want_of(r * h.blocks + b);
        if (bits(v) != bits(want) && bad_params++ < 3)
          ADD_FAILURE() << what << name << " (row " << r << ", block " << b << ") = " << v << ", reference " << want;
      }
  };
  check_plane(got.scale, "scale", [&](int64_t p) { return h.ref.scale[p]; });
  if (!c.symmetric) check_plane(got.zero, "zero", [&](int64_t p) { return static_cast<float>(h.ref.zero[p]); });
  if (c.sums) check_plane(got.sums, "sums", [&](int64_t p) { return static_cast<float>(h.ref_sums[p]); });
  EXPECT_EQ(bad_codes, 0) << what << "codes differ from the reference";
  EXPECT_EQ(bad_params, 0) << what << "parameters differ from the reference";
  EXPECT_EQ(bad_pad, 0) << what << "padding bytes of codes or parameter planes written";
}

// Poison, run, wait, check; twice with complementary poisons.
void run_and_check(const Host& h, Device& d, cudaStream_t stream) {
  for (uint8_t poison : {uint8_t{0x5A}, uint8_t{0xA5}}) {
    d.poison(poison);
    d.launch(stream);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_matches(h, download(d), poison, "poison " + std::to_string(poison) + ": ");
  }
}

void check_case(const Case& c, cudaStream_t stream) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
  const Host h = make_host(c, seed);
  Device d(h);
  run_and_check(h, d, stream);
}

class W8A8QuantizeGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

const DType kDtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};

// ---- the grid -------------------------------------------------------------------------------------------------------

// Every dtype, block (32, 64, 128, K where it divides K) and mode over M 1 .. 1000 and K 128, 192, 4096; strides,
// sums and padding cycle over the cases.
TEST_F(W8A8QuantizeGpu, ShapeGrid) {
  test::Stream stream;
  int i = 0;
  for (int64_t k : {int64_t{128}, int64_t{192}, int64_t{4096}})
    for (int64_t block : {int64_t{32}, int64_t{64}, int64_t{128}, int64_t{0}}) {
      if (block && (k % block != 0 || block == k)) continue;
      for (int64_t m : {int64_t{1}, int64_t{3}, int64_t{17}, int64_t{130}, int64_t{1000}})
        for (DType dtype : kDtypes)
          for (bool symmetric : {false, true}) {
            Case c;
            c.m = m;
            c.k = k;
            c.block = block;
            c.dtype = dtype;
            c.symmetric = symmetric;
            c.sums = i % 3 != 2;
            if (i % 4 == 1) c.x_pad = 16 / static_cast<int64_t>(elem_size(dtype));  // strided, still 16-byte rows
            if (i % 5 == 2) c.codes_pad = 16 * (1 + i % 2);
            if (i % 7 == 3) c.ld_pad = 4;
            check_case(c, stream.get());
            ++i;
          }
    }
}

// Per token over row lengths around the kernels' boundaries: 1 chunk, a partial last chunk, one warp per row
// (32 chunks), the CTA-per-row kernel (33+ chunks), K 16384, and rows longer than a CTA holds (read twice).
TEST_F(W8A8QuantizeGpu, PerTokenRowLengths) {
  test::Stream stream;
  int i = 0;
  for (int64_t k : {int64_t{16}, int64_t{48}, int64_t{496}, int64_t{512}, int64_t{1024}, int64_t{1040}, int64_t{2064},
                    int64_t{16384}})
    for (DType dtype : kDtypes)
      for (int64_t m : {int64_t{1}, int64_t{7}, int64_t{33}}) {
        Case c;
        c.m = m;
        c.k = k;
        c.block = 0;
        c.dtype = dtype;
        c.symmetric = i % 2 == 1;
        c.sums = i % 5 != 4;
        check_case(c, stream.get());
        ++i;
      }
  // Longer than kRowMaxThreads × 2 chunks of 64 bytes: 16-bit K > 65536, fp32 K > 32768.
  for (DType dtype : kDtypes)
    for (bool symmetric : {false, true}) {
      Case c;
      c.m = 3;
      c.k = dtype == DType::kFP32 ? 40976 : 98320;
      c.block = 0;
      c.dtype = dtype;
      c.symmetric = symmetric;
      check_case(c, stream.get());
    }
  // K 16384 per token over more rows (the per-token shape class).
  for (DType dtype : kDtypes) {
    Case c;
    c.m = 130;
    c.k = 16384;
    c.block = 0;
    c.dtype = dtype;
    check_case(c, stream.get());
  }
}

// Column tiles that do not divide evenly (66 blocks of 32, 33 of 64) and many blocks per row.
TEST_F(W8A8QuantizeGpu, RaggedColumnTiles) {
  test::Stream stream;
  for (DType dtype : kDtypes)
    for (int64_t block : {int64_t{32}, int64_t{64}})
      for (int64_t m : {int64_t{1}, int64_t{9}, int64_t{257}}) {
        Case c;
        c.m = m;
        c.k = 2112;
        c.block = block;
        c.dtype = dtype;
        c.symmetric = m == 9;
        check_case(c, stream.get());
      }
}

// x whose rows are not 16-byte aligned (the element-load path) or that starts at an odd offset, with padded codes.
TEST_F(W8A8QuantizeGpu, UnalignedAndStridedX) {
  test::Stream stream;
  int i = 0;
  for (DType dtype : kDtypes)
    for (int64_t block : {int64_t{32}, int64_t{128}, int64_t{0}})
      for (int64_t k : {int64_t{256}, int64_t{4096}}) {
        Case c;
        c.m = 19;
        c.k = k;
        c.block = block;
        c.dtype = dtype;
        c.symmetric = i % 2 == 0;
        c.x_pad = i % 3 == 0 ? 1 : 3;  // odd row stride: no 16-byte rows
        c.x_offset = i % 2;            // and an odd start every other case
        c.codes_pad = 16;
        c.ld_pad = 8;
        check_case(c, stream.get());
        // Aligned rows at an offset start: only the first row's address breaks the 16-byte path.
        c.x_pad = 0;
        c.x_offset = 1;
        check_case(c, stream.get());
        ++i;
      }
}

// Blocks spanning ±3e38: hi − lo overflows to inf, s = inf, inv = 0, every code the zero point (the reference's
// arithmetic, kept bit for bit).
TEST_F(W8A8QuantizeGpu, OverflowingRange) {
  test::Stream stream;
  for (DType dtype : {DType::kBF16, DType::kFP32})
    for (int64_t block : {int64_t{32}, int64_t{0}})
      for (bool symmetric : {false, true}) {
        Case c;
        c.m = 40;
        c.k = 4096;
        c.block = block;
        c.dtype = dtype;
        c.symmetric = symmetric;
        c.huge = true;
        check_case(c, stream.get());
      }
}

// ---- graphs, determinism, M = 0, device checks ----------------------------------------------------------------------

TEST_F(W8A8QuantizeGpu, CudaGraphCaptureAndReplay) {
  test::Stream stream;
  Case blockwise;  // groups kernel, strided x, padded codes
  blockwise.m = 130;
  blockwise.k = 4096;
  blockwise.block = 128;
  blockwise.x_pad = 8;
  blockwise.codes_pad = 16;
  Case per_token;  // rows kernel, fp32 x, symmetric
  per_token.m = 17;
  per_token.k = 16384;
  per_token.block = 0;
  per_token.dtype = DType::kFP32;
  per_token.symmetric = true;
  for (const Case& c : {blockwise, per_token}) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    Host h = make_host(c, seed);
    Device d(h);
    const test::CapturedGraph graph(stream.get(), [&] { d.launch(stream.get()); });
    for (int replay = 0; replay < 3; ++replay) {
      // New x contents in the same buffer.
      const uint64_t data_seed = test::fresh_seed();
      SCOPED_TRACE("replay " + std::to_string(replay) + " " + test::seed_note(data_seed));
      h = make_host(c, data_seed);
      d.x.upload(h.x_raw);
      const uint8_t poison = replay % 2 ? 0xA5 : 0x5A;
      d.poison(poison);
      graph.replay(stream.get());
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      expect_matches(h, download(d), poison);
    }
  }
}

TEST_F(W8A8QuantizeGpu, Deterministic) {
  test::Stream stream;
  Case a;  // M = K = 4096 bf16, block 128
  a.m = 4096;
  a.k = 4096;
  a.block = 128;
  Case b;  // per token, fp16, K 16384
  b.m = 64;
  b.k = 16384;
  b.block = 0;
  b.dtype = DType::kFP16;
  for (const Case& c : {a, b}) {
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    d.poison(0x5A);
    d.launch(stream.get());
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    const Result first = download(d);
    expect_matches(h, first, 0x5A);
    for (int again = 0; again < 2; ++again) {
      d.poison(0x5A);
      d.launch(stream.get());
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      const Result r = download(d);
      EXPECT_TRUE(r.codes == first.codes) << "codes of run " << again + 2;
      EXPECT_EQ(0, std::memcmp(r.scale.data(), first.scale.data(), r.scale.size() * 4)) << "scale of run " << again + 2;
      EXPECT_EQ(0, std::memcmp(r.zero.data(), first.zero.data(), r.zero.size() * 4)) << "zero of run " << again + 2;
      EXPECT_EQ(0, std::memcmp(r.sums.data(), first.sums.data(), r.sums.size() * 4)) << "sums of run " << again + 2;
    }
  }
}

// M = 0: accepted, nothing launched (a capture records no node), nothing written.
TEST_F(W8A8QuantizeGpu, EmptyXLaunchesNothing) {
  test::Stream stream;
  for (int64_t block : {int64_t{64}, int64_t{0}}) {
    Case c;
    c.m = 1;
    c.k = 4096;
    c.block = block;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    d.poison(0x5A);
    const int64_t blocks = c.k / c.block_size();
    const TensorView x0 = test::strided(d.x.get(), c.dtype, {0, c.k}, {c.k, 1});
    Int8BlockTensor out0 = d.out;
    out0.codes = test::strided(d.codes.get(), DType::kInt8, {0, c.k}, {c.k, 1});
    for (TensorView* p : {&out0.scale, &out0.zero, &out0.sums})
      *p = test::strided(p->data, DType::kFP32, {blocks, 0}, {0, 1});
    const std::size_t nodes = test::captured_node_count(stream.get(), [&] {
      try {
        quantize_per_block(x0, out0, stream.get());
      } catch (const Error& e) {
        ADD_FAILURE() << "M = 0 rejected: " << e.what();
      }
    });
    EXPECT_EQ(nodes, 0u) << "M = 0 launched work";
    EXPECT_NO_THROW(quantize_per_block(x0, out0, stream.get()));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    for (uint8_t b : d.codes.download()) ASSERT_EQ(b, 0x5A);
    for (float v : d.scale.download()) ASSERT_EQ(bits(v), 0x5A5A5A5Au);
  }
}

// The device rules the CPU tests cannot reach: pageable host memory labelled as device memory, a pointer of no
// allocation. The error names the argument and nothing is written.
TEST_F(W8A8QuantizeGpu, DeviceChecksNameTheArgument) {
  Case c;
  c.m = 5;
  c.k = 256;
  c.block = 64;
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
  const Host h = make_host(c, seed);
  Device d(h);
  std::vector<uint8_t> host_memory(1 << 16);
  void* host_ptr = host_memory.data() + (256 - reinterpret_cast<std::uintptr_t>(host_memory.data()) % 256) % 256;
  const auto expect_rejected = [&](const char* what, const char* arg, TensorView Int8BlockTensor::*field) {
    SCOPED_TRACE(what);
    TensorView x = d.xv;
    Int8BlockTensor out = d.out;
    (field ? out.*field : x).data = host_ptr;
    d.poison(0x5A);
    try {
      quantize_per_block(x, out, nullptr);
      ADD_FAILURE() << "accepted; expected an error naming '" << arg << "'";
    } catch (const Error& e) {
      const std::string msg = e.what(), head = std::string("tessera::linear::quantize_per_block: '") + arg + "'";
      EXPECT_NE(msg.find(head), std::string::npos) << "expected \"" << head << "\" in: " << msg;
    }
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
    for (uint8_t b : d.codes.download()) ASSERT_EQ(b, 0x5A) << "codes written";
    for (float v : d.scale.download()) ASSERT_EQ(bits(v), 0x5A5A5A5Au) << "scale written";
  };
  expect_rejected("x in host memory", "x", nullptr);
  expect_rejected("codes in host memory", "out.codes", &Int8BlockTensor::codes);
  expect_rejected("scale in host memory", "out.scale", &Int8BlockTensor::scale);
  expect_rejected("zero in host memory", "out.zero", &Int8BlockTensor::zero);
  expect_rejected("sums in host memory", "out.sums", &Int8BlockTensor::sums);
  // The unmutated call runs.
  run_and_check(h, d, nullptr);
}

}  // namespace
}  // namespace tessera::linear
