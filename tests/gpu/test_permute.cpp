// permute and unpermute_reduce on the GPU against the float64 references.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "reference/moe_checks.h"
#include "reference/moe_reference.h"
#include "tessera/error.h"
#include "tessera/moe.h"

namespace tessera::moe {
namespace {

using test::DeviceBuffer;

enum class IdPattern { kRandom, kSkewed, kWithDropped };

struct PermuteCase {
  int64_t T;
  int64_t H;
  int k;
  int E;
  int pad;
  PermuteQuant quant;
  DType x_dtype;
  DType id_dtype;
  IdPattern ids;
  std::optional<int64_t> active = std::nullopt;  // num_tokens on the device
  int64_t x_perm_offset = 0;  // x_perm starts this many bytes into its allocation (the bytes before stay poisoned)
};

std::string describe(const PermuteCase& c) {
  return "T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " k=" + std::to_string(c.k) +
         " E=" + std::to_string(c.E) + " pad=" + std::to_string(c.pad) + " quant=" +
         std::to_string(static_cast<int>(c.quant)) + " x=" + dtype_name(c.x_dtype) + " ids=" +
         dtype_name(c.id_dtype) + " pattern=" + std::to_string(static_cast<int>(c.ids)) +
         (c.active ? " active=" + std::to_string(*c.active) : "") +
         (c.x_perm_offset ? " x_perm at +" + std::to_string(c.x_perm_offset) + " B" : "");
}

std::vector<int64_t> make_ids(const PermuteCase& c, std::mt19937_64& rng) {
  std::vector<int64_t> ids(c.T * c.k);
  std::uniform_int_distribution<int> expert(0, c.E - 1);
  for (int64_t t = 0; t < c.T; ++t)
    for (int j = 0; j < c.k; ++j) {
      int64_t e = expert(rng);
      if (c.ids == IdPattern::kSkewed) e = (rng() % 4 == 0) ? e : e % 3;  // most copies to experts 0..2
      if (c.ids == IdPattern::kWithDropped && rng() % 5 == 0) e = (rng() % 2) ? -1 : c.E + 3;
      ids[t * c.k + j] = e;
    }
  return ids;
}

struct PermuteResult {
  reference::PermuteIndexRef ref;
  std::vector<uint16_t> x;
  std::vector<uint8_t> x_perm;
  std::vector<float> scales;
  std::vector<int32_t> offsets, counts, row_index, row_token;
  int64_t num_blocks = 0;
  float input_scale = 1.0f;
};

PermuteResult run_permute(const PermuteCase& c, uint64_t seed, cudaStream_t stream = nullptr) {
  std::mt19937_64 rng(seed);
  PermuteResult r;
  const std::vector<int64_t> ids = make_ids(c, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  r.x.resize(c.T * c.H);
  for (int64_t i = 0; i < c.T * c.H; ++i) {
    float v = normal(rng) * ((i % 97 == 0) ? 300.0f : 1.0f);  // a few outliers: block scales differ
    r.x[i] = c.x_dtype == DType::kBF16 ? host::f32_to_bf16(v) : host::f32_to_fp16(v);
  }
  // With a device-side count, tokens at or past it are dropped: the reference sees their ids as -1.
  const int64_t routed = c.active ? std::clamp<int64_t>(*c.active, 0, c.T) : c.T;
  std::vector<int64_t> ref_ids = ids;
  for (int64_t i = routed * c.k; i < c.T * c.k; ++i) ref_ids[i] = -1;
  PermuteParams p;
  p.num_experts = c.E;
  p.pad_multiple = c.pad;
  p.quant = c.quant;
  const int64_t rows = permute_capacity_rows(c.T, c.k, p);
  r.num_blocks = (c.H + 127) / 128;
  const bool fp8 = c.quant != PermuteQuant::kNone;
  DeviceBuffer<uint16_t> x(r.x);
  DeviceBuffer<uint8_t> ids_dev(c.T * c.k * dtype_size(c.id_dtype));
  {
    std::vector<uint8_t> raw(ids_dev.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (c.id_dtype == DType::kInt32) {
        const int32_t v = static_cast<int32_t>(ids[i]);
        std::memcpy(&raw[i * 4], &v, 4);
      } else {
        std::memcpy(&raw[i * 8], &ids[i], 8);
      }
    }
    ids_dev.upload(raw);
  }
  DeviceBuffer<uint8_t> x_perm(rows * c.H * (fp8 ? 1 : 2) + c.x_perm_offset);
  DeviceBuffer<float> scales(rows * r.num_blocks);
  DeviceBuffer<int32_t> offsets(c.E + 1), counts(c.E), row_index(c.T * c.k), row_token(rows);
  DeviceBuffer<uint8_t> workspace(permute_workspace_bytes(c.T, c.k, p));
  DeviceBuffer<float> input_scale(1);
  DeviceBuffer<int32_t> count(1);
  if (c.active) count.upload({static_cast<int32_t>(*c.active)});
  r.input_scale = 0.01f;  // 4.48 maps to 448: outliers saturate
  input_scale.upload({r.input_scale});
  x_perm.poison();
  scales.poison();
  offsets.poison();
  counts.poison();
  row_index.poison();
  row_token.poison();
  workspace.poison(0x5A);  // any contents must do

  PermuteOutputs out;
  out.x_perm = x_perm.view(fp8 ? DType::kFP8E4M3 : c.x_dtype, {rows, c.H});
  out.x_perm.data = static_cast<uint8_t*>(out.x_perm.data) + c.x_perm_offset;
  // Blockwise scales go out column-major ([blocks, rows] transposed), the layout a TMA-fed GEMM reads.
  if (c.quant == PermuteQuant::kFP8Blockwise) {
    TensorView s = scales.view(DType::kFP32, {rows, r.num_blocks});
    s.strides[0] = 1;
    s.strides[1] = rows;
    out.scales = s;
  }
  out.expert_offsets = offsets.view(DType::kInt32, {c.E + 1});
  out.expert_counts = counts.view(DType::kInt32, {c.E});
  out.row_index = row_index.view(DType::kInt32, {c.T, c.k});
  out.row_token = row_token.view(DType::kInt32, {rows});
  std::optional<TensorView> scale_in;
  if (c.quant == PermuteQuant::kFP8PerTensor) scale_in = input_scale.view(DType::kFP32, {1});
  permute(x.view(c.x_dtype, {c.T, c.H}), ids_dev.view(c.id_dtype, {c.T, c.k}), scale_in, out,
          Workspace{workspace.get(), workspace.size()}, p, stream,
          c.active ? std::optional(count.view(DType::kInt32, {1})) : std::nullopt);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  r.ref = reference::permute_index(ref_ids, c.T, c.k, c.E, c.pad);
  r.x_perm = x_perm.download();
  for (int64_t i = 0; i < c.x_perm_offset; ++i)
    EXPECT_EQ(r.x_perm[i], 0xFF) << "byte " << i << " before x_perm was written";
  r.x_perm.erase(r.x_perm.begin(), r.x_perm.begin() + c.x_perm_offset);
  r.scales = scales.download();
  r.offsets = offsets.download();
  r.counts = counts.download();
  r.row_index = row_index.download();
  r.row_token = row_token.download();
  return r;
}

void check_permute(const PermuteCase& c, const PermuteResult& r, uint64_t seed) {
  SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
  const auto idx = reference::check_permute_index(r.ref, r.offsets.data(), r.counts.data(), r.row_index.data(),
                                                  r.row_token.data(), c.T, c.k, c.E);
  ASSERT_TRUE(idx.ok) << idx.message;
  if (r.row_token.empty()) return;  // no rows at all (T = 0, no padding)
  if (c.quant == PermuteQuant::kNone) {
    std::vector<uint16_t> rows16(r.x_perm.size() / 2);
    std::memcpy(rows16.data(), r.x_perm.data(), r.x_perm.size());
    const auto rows = reference::check_permute_rows(r.ref, r.x.data(), rows16.data(), c.T, c.H);
    EXPECT_TRUE(rows.ok) << rows.message;
  } else {
    const int64_t capacity = static_cast<int64_t>(r.row_token.size());
    const auto q = reference::check_permute_fp8(r.ref, r.x.data(), c.x_dtype, r.x_perm.data(), c.quant,
                                                r.scales.data(), 1, capacity, r.input_scale, c.T, c.H);
    EXPECT_TRUE(q.ok) << q.message;
  }
}

class PermuteGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

TEST_F(PermuteGpu, ShapeGrid) {
  const PermuteQuant quants[3] = {PermuteQuant::kNone, PermuteQuant::kFP8Blockwise, PermuteQuant::kFP8PerTensor};
  int n = 0;
  for (int64_t T : {0, 1, 3, 129, 1000})
    for (int E : {1, 8, 256, 1024})
      for (int k : {1, 2, 8, 32})
        for (int64_t H : {8, 136, 512}) {
          if (k > 8 && E < 256 && T > 3) continue;  // keep the grid small
          const int pads[3] = {1, 4, 128};
          const PermuteCase c{T, H, k, E, pads[(n / 3) % 3], quants[n % 3],
                              (n % 2) ? DType::kBF16 : DType::kFP16, (n % 4 < 2) ? DType::kInt32 : DType::kInt64,
                              static_cast<IdPattern>(n % 3)};
          ++n;
          const uint64_t seed = test::fresh_seed();
          check_permute(c, run_permute(c, seed), seed);
        }
}

TEST_F(PermuteGpu, EveryQuantPadAndPattern) {
  for (PermuteQuant q : {PermuteQuant::kNone, PermuteQuant::kFP8Blockwise, PermuteQuant::kFP8PerTensor})
    for (int pad : {1, 16, 128})
      for (IdPattern ids : {IdPattern::kRandom, IdPattern::kSkewed, IdPattern::kWithDropped})
        for (DType xd : {DType::kBF16, DType::kFP16}) {
          const PermuteCase c{300, 7168, 8, 256, pad, q, xd, DType::kInt32, ids};
          const uint64_t seed = test::fresh_seed();
          check_permute(c, run_permute(c, seed), seed);
        }
}

// fp8 x_perm needs only 8-byte alignment (each lane's store is 8 codes): a view 8 bytes into its allocation, with
// rows of a multiple of 16 bytes, must take 8-byte stores (16-byte ones were a misaligned-address fault), through
// the single-pass (T·k <= 256) and the three-pass paths.
TEST_F(PermuteGpu, Fp8OutputEightBytesIntoItsAllocation) {
  for (PermuteQuant quant : {PermuteQuant::kFP8PerTensor, PermuteQuant::kFP8Blockwise})
    for (int64_t H : {int64_t{128}, int64_t{384}})
      for (int64_t T : {int64_t{1}, int64_t{37}, int64_t{300}}) {
        PermuteCase c{T, H, 2, 8, 1, quant, DType::kBF16, DType::kInt32, IdPattern::kRandom};
        c.x_perm_offset = 8;
        const uint64_t seed = test::fresh_seed();
        check_permute(c, run_permute(c, seed), seed);
      }
}

// A device-side token count (CUDA graphs replayed with fewer tokens): copies of the tokens at or past it are dropped
// exactly as ids outside [0, E) are: -1 in row_index, no rows, not counted; counts past T clamp to T, below 0 to 0.
TEST_F(PermuteGpu, DeviceTokenCountDropsLaterTokens) {
  int n = 0;
  for (int64_t active : {0, 1, 57, 299, 300, 1000, -3})
    for (PermuteQuant q : {PermuteQuant::kNone, PermuteQuant::kFP8Blockwise, PermuteQuant::kFP8PerTensor}) {
      PermuteCase c{300, 512, 4, 64, (n % 2) ? 8 : 1, q, DType::kBF16, DType::kInt32, IdPattern::kWithDropped};
      c.active = active;
      ++n;
      const uint64_t seed = test::fresh_seed();
      check_permute(c, run_permute(c, seed), seed);
    }
  // The same over a single pass (T·k <= 256: one launch that counts and scans itself), int32 and int64 ids, padding.
  for (int64_t active : {0, 1, 17, 31, 32, 90, -1})
    for (PermuteQuant q : {PermuteQuant::kNone, PermuteQuant::kFP8Blockwise, PermuteQuant::kFP8PerTensor}) {
      PermuteCase c{32, 7168, 8, 256, (n % 2) ? 16 : 1, q, DType::kBF16, (n % 4 < 2) ? DType::kInt64 : DType::kInt32,
                    IdPattern::kWithDropped};
      c.active = active;
      ++n;
      const uint64_t seed = test::fresh_seed();
      check_permute(c, run_permute(c, seed), seed);
    }
}

TEST_F(PermuteGpu, DeepSeekShapeAndDeterminism) {
  const PermuteCase c{4096, 7168, 8, 256, 1, PermuteQuant::kFP8Blockwise, DType::kBF16, DType::kInt32,
                      IdPattern::kRandom};
  const uint64_t seed = test::fresh_seed();
  const PermuteResult a = run_permute(c, seed);
  check_permute(c, a, seed);
  const PermuteResult b = run_permute(c, seed);
  EXPECT_EQ(a.x_perm, b.x_perm);
  EXPECT_EQ(a.row_index, b.row_index);
  EXPECT_EQ(0, std::memcmp(a.scales.data(), b.scales.data(), a.scales.size() * 4));
}

// The whole op captured once, replayed on fresh ids and rows in the same buffers: three passes (T·k 1200) or one
// (T·k 144).
void permute_graph_replays(int64_t T) {
  const int64_t H = 256;
  const int k = 6, E = 64;
  PermuteParams p;
  p.num_experts = E;
  p.pad_multiple = 8;
  const int64_t rows = permute_capacity_rows(T, k, p);
  DeviceBuffer<uint16_t> x(T * H);
  DeviceBuffer<int32_t> ids(T * k), offsets(E + 1), counts(E), row_index(T * k), row_token(rows);
  DeviceBuffer<uint16_t> x_perm(rows * H);
  DeviceBuffer<uint8_t> ws(permute_workspace_bytes(T, k, p));
  PermuteOutputs out;
  out.x_perm = x_perm.view(DType::kBF16, {rows, H});
  out.expert_offsets = offsets.view(DType::kInt32, {E + 1});
  out.expert_counts = counts.view(DType::kInt32, {E});
  out.row_index = row_index.view(DType::kInt32, {T, k});
  out.row_token = row_token.view(DType::kInt32, {rows});
  cudaStream_t stream;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  permute(x.view(DType::kBF16, {T, H}), ids.view(DType::kInt32, {T, k}), std::nullopt, out,
          Workspace{ws.get(), ws.size()}, p, stream);
  TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  TESSERA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("T=" + std::to_string(T) + " " + test::seed_note(seed));
  std::mt19937_64 rng(seed);
  for (int replay = 0; replay < 3; ++replay) {
    std::vector<int64_t> ids64(T * k);
    std::vector<int32_t> ids32(T * k);
    for (int64_t i = 0; i < T * k; ++i) ids32[i] = static_cast<int32_t>(ids64[i] = rng() % E);
    std::vector<uint16_t> xh(T * H);
    for (auto& v : xh) v = host::f32_to_bf16(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 64.0f);
    ids.upload(ids32);
    x.upload(xh);
    x_perm.poison();
    row_index.poison();
    TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto ref = reference::permute_index(ids64, T, k, E, p.pad_multiple);
    const auto o = offsets.download(), c = counts.download(), ri = row_index.download(), rt = row_token.download();
    const auto idx = reference::check_permute_index(ref, o.data(), c.data(), ri.data(), rt.data(), T, k, E);
    EXPECT_TRUE(idx.ok) << idx.message;
    const auto xp = x_perm.download();
    const auto rr = reference::check_permute_rows(ref, xh.data(), xp.data(), T, H);
    EXPECT_TRUE(rr.ok) << rr.message;
  }
  TESSERA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TESSERA_CUDA_CHECK(cudaGraphDestroy(graph));
  TESSERA_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_F(PermuteGpu, CudaGraphCapture) {
  for (int64_t T : {200, 24}) permute_graph_replays(T);
}

TEST_F(PermuteGpu, HostPointerRejectedBeforeLaunch) {
  const int64_t T = 8, H = 64;
  const int k = 2, E = 4;
  PermuteParams p;
  p.num_experts = E;
  std::vector<uint16_t> host_x(T * H, 1);
  DeviceBuffer<int32_t> ids(std::vector<int32_t>(T * k, 1)), offsets(E + 1), counts(E), row_index(T * k);
  DeviceBuffer<uint16_t> x_perm(T * k * H);
  DeviceBuffer<uint8_t> ws(permute_workspace_bytes(T, k, p));
  offsets.poison();
  PermuteOutputs out;
  out.x_perm = x_perm.view(DType::kBF16, {T * k, H});
  out.expert_offsets = offsets.view(DType::kInt32, {E + 1});
  out.expert_counts = counts.view(DType::kInt32, {E});
  out.row_index = row_index.view(DType::kInt32, {T, k});
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  try {
    permute(TensorView::contiguous(host_x.data(), DType::kBF16, {T, H}, device), ids.view(DType::kInt32, {T, k}),
            std::nullopt, out, Workspace{ws.get(), ws.size()}, p, nullptr);
    ADD_FAILURE() << "host x accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'x'"), std::string::npos) << e.what();
  }
  for (int32_t v : offsets.download()) EXPECT_EQ(v, -1);
}

// ---- unpermute_reduce ----------------------------------------------------------------------------------------

TEST_F(PermuteGpu, UnpermuteHostPointerAndWrongDeviceRejectedBeforeLaunch) {
  const int64_t T = 4, H = 64;
  const int k = 2;
  std::vector<uint16_t> host_y(T * k * H, 1);
  DeviceBuffer<uint16_t> y(T * k * H), out(T * H);
  DeviceBuffer<int32_t> rows(std::vector<int32_t>(T * k, 0));
  DeviceBuffer<float> w(std::vector<float>(T * k, 1.0f));
  out.poison();
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  auto expect_named = [&](const TensorView& yv, const char* arg) {
    try {
      unpermute_reduce(yv, rows.view(DType::kInt32, {T, k}), w.view(DType::kFP32, {T, k}), std::nullopt,
                       out.view(DType::kBF16, {T, H}), 1.0f, nullptr);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + arg + "'"), std::string::npos) << e.what();
    }
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
    for (uint16_t v : out.download()) ASSERT_EQ(v, 0xFFFF);
  };
  expect_named(TensorView::contiguous(host_y.data(), DType::kBF16, {T * k, H}, device), "y_perm");
  expect_named(TensorView::contiguous(y.get(), DType::kBF16, {T * k, H}, device + 1), "y_perm");
}

void check_unpermute(int64_t T, int k, int64_t H, DType dtype, bool with_residual, uint64_t seed,
                     cudaStream_t stream = nullptr) {
  SCOPED_TRACE("T=" + std::to_string(T) + " k=" + std::to_string(k) + " H=" + std::to_string(H) + " " +
               dtype_name(dtype) + (with_residual ? " residual" : "") + " " + test::seed_note(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t R = T * k + 5;
  auto enc = [&](float v) { return dtype == DType::kBF16 ? host::f32_to_bf16(v) : host::f32_to_fp16(v); };
  auto dec = [&](uint16_t h) { return dtype == DType::kBF16 ? host::bf16_to_f32(h) : host::fp16_to_f32(h); };
  std::vector<uint16_t> y(R * H), res(T * H);
  std::vector<double> yd(R * H), resd;
  for (int64_t i = 0; i < R * H; ++i) yd[i] = dec(y[i] = enc(normal(rng)));
  if (with_residual) {
    resd.resize(T * H);
    for (int64_t i = 0; i < T * H; ++i) resd[i] = dec(res[i] = enc(normal(rng)));
  }
  // A permutation of rows, with some copies dropped.
  std::vector<int32_t> rows(R);
  for (int64_t i = 0; i < R; ++i) rows[i] = static_cast<int32_t>(i);
  std::shuffle(rows.begin(), rows.end(), rng);
  std::vector<int32_t> row_index(T * k);
  std::vector<float> w(T * k);
  std::vector<double> wd(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    row_index[i] = (rng() % 9 == 0) ? -1 : rows[i];
    wd[i] = w[i] = std::abs(normal(rng)) / k;
  }
  // Indices past y_perm's rows (device data the host cannot check) are skipped as -1 is: the device sees them, the
  // reference -1.
  std::vector<int32_t> device_index = row_index;
  for (int64_t i = 0; i < T * k; ++i)
    if (row_index[i] >= 0 && rng() % 13 == 0) {
      device_index[i] = (rng() % 2) ? static_cast<int32_t>(R) : INT32_MAX;
      row_index[i] = -1;
    }
  const float scale = 2.5f;
  DeviceBuffer<uint16_t> y_dev(y), res_dev(res), out(T * H);
  DeviceBuffer<int32_t> ri_dev(device_index);
  DeviceBuffer<float> w_dev(w);
  out.poison();
  std::optional<TensorView> rv;
  if (with_residual) rv = res_dev.view(dtype, {T, H});
  unpermute_reduce(y_dev.view(dtype, {R, H}), ri_dev.view(DType::kInt32, {T, k}), w_dev.view(DType::kFP32, {T, k}),
                   rv, out.view(dtype, {T, H}), scale, stream);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto got16 = out.download();
  std::vector<double> got(T * H);
  for (int64_t i = 0; i < T * H; ++i) got[i] = dec(got16[i]);
  const auto ref = reference::unpermute_reduce(yd, row_index, wd, resd, T, k, H, scale);
  // Output rounding dominates: bf16 keeps 8 bits (2^-9 relative), fp16 11 bits (2^-12).
  const double tol = dtype == DType::kBF16 ? 1e-2 : 2e-3;
  const auto r = reference::check_close(ref, got, tol);
  EXPECT_TRUE(r.ok) << r.message;
}

TEST_F(PermuteGpu, UnpermuteReduceGrid) {
  for (int64_t T : {0, 1, 37, 1000})
    for (int k : {1, 6, 8, 32})
      for (int64_t H : {8, 264, 2048})
        for (DType dtype : {DType::kBF16, DType::kFP16})
          check_unpermute(T, k, H, dtype, (T + k) % 2 == 0, test::fresh_seed());
  check_unpermute(4096, 8, 7168, DType::kBF16, true, test::fresh_seed());
  // Decode-sized T over a wide row: each token's row cut into column slices (the last one partial at H 7176).
  for (int64_t T : {1, 3, 17})
    for (int64_t H : {7168, 7176}) check_unpermute(T, 9, H, DType::kBF16, T != 3, test::fresh_seed());
}

TEST_F(PermuteGpu, UnpermuteInCudaGraph) {
  cudaStream_t stream;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The whole call, validation included, runs inside the capture.
  const int64_t T = 64, H = 512;
  const int k = 8;
  DeviceBuffer<uint16_t> y(T * k * H), out(T * H);
  DeviceBuffer<int32_t> ri(T * k);
  DeviceBuffer<float> w(T * k);
  cudaGraph_t graph;
  TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  unpermute_reduce(y.view(DType::kBF16, {T * k, H}), ri.view(DType::kInt32, {T, k}), w.view(DType::kFP32, {T, k}),
                   std::nullopt, out.view(DType::kBF16, {T, H}), 1.0f, stream);
  TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  TESSERA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(test::seed_note(seed));
  std::mt19937_64 rng(seed);
  std::vector<int32_t> rows(T * k);
  std::vector<float> wh(T * k);
  std::vector<uint16_t> yh(T * k * H);
  std::vector<double> yd(T * k * H), wd(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    rows[i] = static_cast<int32_t>((i * 7919) % (T * k));
    wd[i] = wh[i] = static_cast<float>(rng() % 100) / 100.0f;
  }
  for (int64_t i = 0; i < T * k * H; ++i) yd[i] = host::bf16_to_f32(yh[i] = host::f32_to_bf16(static_cast<float>(rng() % 64) / 8 - 4));
  y.upload(yh);
  ri.upload(rows);
  w.upload(wh);
  out.poison();
  TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto got16 = out.download();
  std::vector<double> got(T * H);
  for (int64_t i = 0; i < T * H; ++i) got[i] = host::bf16_to_f32(got16[i]);
  const auto r = reference::check_close(reference::unpermute_reduce(yd, rows, wd, {}, T, k, H, 1.0), got, 1e-2);
  EXPECT_TRUE(r.ok) << r.message;
  TESSERA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TESSERA_CUDA_CHECK(cudaGraphDestroy(graph));
  TESSERA_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace tessera::moe
