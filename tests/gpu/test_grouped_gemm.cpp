// Grouped GEMM on the GPU against the float64 reference (src/reference/gemm_reference.h).
//
// Every case: fresh random inputs (fp8 from quantized normals with some raw encodings mixed in: subnormals, ±448;
// bf16 normals; scales log-uniform in [1e-2, 1]), padding of strided operands filled with NaN (must not be read),
// y poisoned with 0xFFFF (NaN) before the call. Checked: relative Frobenius error <= 1e-2 over the rows the groups
// own, every element |y - ref| <= 1e-2 * rms(ref) + 2^-7 * |ref| (bf16 output rounding is at most 2^-8 relative),
// no NaN, and every other element of the y buffer (rows of no group, rows past masked_m, padding) still poisoned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_util.h"
#include "common/host_numeric.h"
#include "gemm/grouped/config.h"
#include "gemm/grouped/problem.h"
#include "reference/gemm_reference.h"
#include "tessera/error.h"
#include "tessera/grouped_gemm.h"

namespace tessera::gemm {
namespace {

using test::DeviceBuffer;

enum class Kind { kFP8PerTensor, kFP8Blockwise, kBF16 };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kFP8PerTensor: return "fp8/per-tensor";
    case Kind::kFP8Blockwise: return "fp8/blockwise";
    case Kind::kBF16: return "bf16";
  }
  return "";
}

constexpr uint16_t kPoison = 0xFFFF;  // DeviceBuffer::poison()'s 0xFF bytes: a bf16 NaN

struct GemmCase {
  Kind kind = Kind::kFP8Blockwise;
  bool masked = false;
  int G = 1;
  int64_t n = 128, k = 128;
  // Rows of each group: contiguous, offsets are their prefix sums after `lead` rows of no group, and `tail` rows
  // of no group follow; masked, they are masked_m, and max_m is `rows` if given, else max(sizes) + max_m_extra.
  std::vector<int64_t> sizes;
  int64_t lead = 0, tail = 0, max_m_extra = 0;
  // Instead of sizes: offsets / masked_m as given (any values) with `rows` rows (M or max_m).
  std::vector<int32_t> raw_group_rows;
  int64_t rows = 0;
  // Extra elements per row of x, w and y, and (masked) extra rows between groups of x and y.
  int64_t x_pad = 0, w_pad = 0, y_pad = 0, group_pad_rows = 0;
  bool row_major_x_scale = false;  // blockwise x_scale row-major; default column-major, as moe::permute emits it
  bool transposed_w_scale = false;  // blockwise: w_scale [G][kb][nb] in memory; per-tensor: w_scale stride 2
  int64_t expected_m = 0;
};

bool is_fp8(const GemmCase& c) { return c.kind != Kind::kBF16; }

// f(c) for each kind × layout, c a GemmCase with those two fields set.
template <typename F>
void for_each_kind_and_layout(F&& f) {
  for (Kind kind : {Kind::kFP8Blockwise, Kind::kFP8PerTensor, Kind::kBF16})
    for (bool masked : {false, true}) {
      GemmCase c;
      c.kind = kind;
      c.masked = masked;
      f(c);
    }
}

std::string describe(const GemmCase& c) {
  std::string s = std::string(kind_name(c.kind)) + (c.masked ? " masked" : " contiguous") + " G=" +
                  std::to_string(c.G) + " N=" + std::to_string(c.n) + " K=" + std::to_string(c.k);
  if (!c.raw_group_rows.empty()) s += " raw group rows, rows=" + std::to_string(c.rows);
  if (c.x_pad || c.w_pad || c.y_pad || c.group_pad_rows)
    s += " pads x/w/y/group=" + std::to_string(c.x_pad) + "/" + std::to_string(c.w_pad) + "/" +
         std::to_string(c.y_pad) + "/" + std::to_string(c.group_pad_rows);
  if (c.expected_m) s += " expected_m=" + std::to_string(c.expected_m);
  int64_t total = 0;
  for (int64_t v : c.sizes) total += v;
  if (!c.sizes.empty()) s += " rows in groups=" + std::to_string(total);
  return s;
}

// ---- random inputs -----------------------------------------------------------------------------------------

uint8_t nearest_e4m3(float v) {
  static const std::vector<float> magnitudes = [] {  // e4m3 0x00..0x7E, increasing
    std::vector<float> m;
    for (int b = 0; b < 0x7F; ++b) m.push_back(host::e4m3_to_f32(static_cast<uint8_t>(b)));
    return m;
  }();
  const float a = std::min(std::fabs(v), 448.0f);
  auto b = static_cast<int>(std::lower_bound(magnitudes.begin(), magnitudes.end(), a) - magnitudes.begin());
  if (b > 0 && (b == static_cast<int>(magnitudes.size()) || a - magnitudes[b - 1] < magnitudes[b] - a)) --b;
  return static_cast<uint8_t>((v < 0 ? 0x80 : 0) | b);
}

// Fills large buffers fast: values come from 4096-entry tables drawn from the target distributions, picked with a
// splitmix64 stream (12 bits per pick).
class Filler {
 public:
  explicit Filler(uint64_t seed) : state_(seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t i = 0; i < kTable; ++i) {
      if (i % 16 == 0) {  // any finite encoding: subnormals, zeros, ±448
        uint8_t b;
        do b = static_cast<uint8_t>(rng()); while ((b & 0x7F) == 0x7F);
        fp8_[i] = b;
      } else {
        fp8_[i] = nearest_e4m3(2.0f * normal(rng));
      }
      bf16_[i] = host::f32_to_bf16(normal(rng));
    }
  }
  void fp8(uint8_t* p, int64_t n) { fill(p, n, fp8_); }
  void bf16(uint16_t* p, int64_t n) { fill(p, n, bf16_); }
  // Log-uniform in [1e-2, 1].
  float scale() { return static_cast<float>(std::exp(std::log(1e-2) * static_cast<double>(next() >> 11) * 0x1p-53)); }

 private:
  static constexpr std::size_t kTable = 4096;
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  template <typename T, typename Table>
  void fill(T* p, int64_t n, const Table& table) {
    int64_t i = 0;
    while (i < n) {
      uint64_t r = next();
      for (int j = 0; j < 5 && i < n; ++j, r >>= 12) p[i++] = table[r & (kTable - 1)];
    }
  }
  uint64_t state_;
  uint8_t fp8_[kTable];
  uint16_t bf16_[kTable];
};

// One case's host data: what the GPU gets and what the reference reads.
struct Host {
  GemmCase c;
  reference::GroupedGemmShape shape;
  std::vector<uint8_t> x8, w8;     // fp8 kinds
  std::vector<uint16_t> x16, w16;  // bf16
  std::vector<int32_t> group_rows;
  reference::GroupedGemmScales scales;  // fp8 kinds
  int64_t y_row_stride = 0, y_group_stride = 0, y_size = 0;
  int64_t x_size() const { return is_fp8(c) ? static_cast<int64_t>(x8.size()) : static_cast<int64_t>(x16.size()); }
};

Host make_host(const GemmCase& c, uint64_t seed) {
  Host h;
  h.c = c;
  const bool fp8 = is_fp8(c);
  const int G = c.G;
  const int64_t N = c.n, K = c.k;
  int64_t rows = c.rows;
  if (!c.raw_group_rows.empty()) {
    h.group_rows = c.raw_group_rows;
  } else if (c.masked) {
    int64_t largest = 0;
    for (int64_t s : c.sizes) {
      h.group_rows.push_back(static_cast<int32_t>(s));
      largest = std::max(largest, s);
    }
    if (rows <= 0) rows = largest + c.max_m_extra;
  } else {
    h.group_rows.push_back(static_cast<int32_t>(c.lead));
    for (int64_t s : c.sizes) h.group_rows.push_back(static_cast<int32_t>(h.group_rows.back() + s));
    rows = h.group_rows.back() + c.tail;
  }

  reference::GroupedGemmShape& s = h.shape;
  s.masked = c.masked;
  s.num_groups = G;
  s.rows = rows;
  s.n = N;
  s.k = K;
  s.x_row_stride = K + c.x_pad;
  s.x_group_stride = c.masked ? (rows + c.group_pad_rows) * s.x_row_stride : 0;
  s.w_row_stride = K + c.w_pad;
  s.w_group_stride = N * s.w_row_stride;
  h.y_row_stride = N + c.y_pad;
  h.y_group_stride = c.masked ? (rows + c.group_pad_rows) * h.y_row_stride : 0;
  h.y_size = c.masked ? G * h.y_group_stride : rows * h.y_row_stride;

  // Operands: NaN everywhere (padding must not be read), then random values in every row.
  Filler f(seed);
  const int64_t x_size = c.masked ? G * s.x_group_stride : rows * s.x_row_stride;
  const int64_t x_groups = c.masked ? G : 1;
  const int64_t w_size = G * s.w_group_stride;
  if (fp8) {
    h.x8.assign(x_size, 0x7F);
    h.w8.assign(w_size, 0x7F);
    for (int64_t g = 0; g < x_groups; ++g)
      for (int64_t r = 0; r < rows; ++r) f.fp8(&h.x8[g * s.x_group_stride + r * s.x_row_stride], K);
    for (int64_t r = 0; r < G * N; ++r) f.fp8(&h.w8[r * s.w_row_stride], K);
  } else {
    h.x16.assign(x_size, 0x7FC0);
    h.w16.assign(w_size, 0x7FC0);
    for (int64_t g = 0; g < x_groups; ++g)
      for (int64_t r = 0; r < rows; ++r) f.bf16(&h.x16[g * s.x_group_stride + r * s.x_row_stride], K);
    for (int64_t r = 0; r < G * N; ++r) f.bf16(&h.w16[r * s.w_row_stride], K);
  }

  reference::GroupedGemmScales& sc = h.scales;
  if (c.kind == Kind::kFP8PerTensor) {
    sc.mode = ScaleMode::kPerTensor;
    sc.x_scale = {f.scale()};
    sc.ws_group_stride = c.transposed_w_scale ? 2 : 1;
    sc.w_scale.assign(G * sc.ws_group_stride, NAN);
    for (int g = 0; g < G; ++g) sc.w_scale[g * sc.ws_group_stride] = f.scale();
  } else if (c.kind == Kind::kFP8Blockwise) {
    sc.mode = ScaleMode::kBlockwise;
    const int64_t KB = K / kGroupedGemmBlock, NB = N / kGroupedGemmBlock;
    if (c.row_major_x_scale) {
      sc.xs_row_stride = KB;
      sc.xs_k_stride = 1;
    } else {
      sc.xs_row_stride = 1;
      sc.xs_k_stride = rows;
    }
    sc.xs_group_stride = c.masked ? rows * KB : 0;
    sc.x_scale.resize((c.masked ? G : 1) * rows * KB);
    for (float& v : sc.x_scale) v = f.scale();
    sc.ws_group_stride = NB * KB;
    sc.ws_n_stride = c.transposed_w_scale ? 1 : KB;
    sc.ws_k_stride = c.transposed_w_scale ? NB : 1;
    sc.w_scale.resize(G * NB * KB);
    for (float& v : sc.w_scale) v = f.scale();
  }
  return h;
}

reference::GroupedGemmRef reference_of(const Host& h) {
  if (is_fp8(h.c)) return reference::grouped_gemm_fp8(h.x8, h.w8, h.group_rows, h.scales, h.shape);
  return reference::grouped_gemm_bf16(h.x16, h.w16, h.group_rows, h.shape);
}

// ---- device side -------------------------------------------------------------------------------------------

using test::current_device;
using test::strided;

// Blocking like DeviceBuffer::upload: a pageable cudaMemcpy may return before its DMA has landed, and the legacy
// stream does not order the tests' non-blocking streams.
template <typename T>
void copy_in(const DeviceBuffer<uint8_t>& dst, const std::vector<T>& src) {
  ASSERT_EQ(dst.size(), src.size() * sizeof(T));
  if (src.empty()) return;
  TESSERA_CUDA_CHECK(cudaMemcpy(dst.get(), src.data(), dst.size(), cudaMemcpyHostToDevice));
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
}

struct Device {
  DeviceBuffer<uint8_t> x, w;
  DeviceBuffer<int32_t> rows;
  DeviceBuffer<float> xs, ws;
  DeviceBuffer<uint16_t> y;

  explicit Device(const Host& h)
      : x(h.x_size() * (is_fp8(h.c) ? 1 : 2)),
        w((is_fp8(h.c) ? h.w8.size() : h.w16.size() * 2)),
        rows(h.group_rows.size()),
        xs(h.scales.x_scale.size()),
        ws(h.scales.w_scale.size()),
        y(h.y_size) {
    upload(h);
  }
  // New contents of the same sizes (a CUDA graph replays on the same buffers).
  void upload(const Host& h) {
    if (is_fp8(h.c)) {
      copy_in(x, h.x8);
      copy_in(w, h.w8);
    } else {
      copy_in(x, h.x16);
      copy_in(w, h.w16);
    }
    ASSERT_EQ(rows.size(), h.group_rows.size());
    rows.upload(h.group_rows);
    ASSERT_EQ(xs.size(), h.scales.x_scale.size());
    ASSERT_EQ(ws.size(), h.scales.w_scale.size());
    xs.upload(h.scales.x_scale);
    ws.upload(h.scales.w_scale);
  }
};

struct Views {
  TensorView x, w, rows, y;
  FP8Scales scales;
};

Views views_of(const Host& h, const Device& d) {
  const GemmCase& c = h.c;
  const reference::GroupedGemmShape& s = h.shape;
  const DType in = is_fp8(c) ? DType::kFP8E4M3 : DType::kBF16;
  const int64_t G = c.G, R = s.rows, N = s.n, K = s.k;
  Views v;
  if (c.masked) {
    v.x = strided(d.x.get(), in, {G, R, K}, {s.x_group_stride, s.x_row_stride, 1});
    v.y = strided(d.y.get(), DType::kBF16, {G, R, N}, {h.y_group_stride, h.y_row_stride, 1});
  } else {
    v.x = strided(d.x.get(), in, {R, K}, {s.x_row_stride, 1});
    v.y = strided(d.y.get(), DType::kBF16, {R, N}, {h.y_row_stride, 1});
  }
  v.w = strided(d.w.get(), in, {G, N, K}, {s.w_group_stride, s.w_row_stride, 1});
  v.rows = strided(d.rows.get(), DType::kInt32, {static_cast<int64_t>(h.group_rows.size())}, {1});
  const reference::GroupedGemmScales& sc = h.scales;
  if (c.kind == Kind::kFP8PerTensor) {
    v.scales.mode = ScaleMode::kPerTensor;
    v.scales.x_scale = strided(d.xs.get(), DType::kFP32, {1}, {1});
    v.scales.w_scale = strided(d.ws.get(), DType::kFP32, {G}, {sc.ws_group_stride});
  } else if (c.kind == Kind::kFP8Blockwise) {
    const int64_t KB = K / kGroupedGemmBlock, NB = N / kGroupedGemmBlock;
    v.scales.mode = ScaleMode::kBlockwise;
    v.scales.x_scale = c.masked ? strided(d.xs.get(), DType::kFP32, {G, R, KB},
                                          {sc.xs_group_stride, sc.xs_row_stride, sc.xs_k_stride})
                                : strided(d.xs.get(), DType::kFP32, {R, KB}, {sc.xs_row_stride, sc.xs_k_stride});
    v.scales.w_scale =
        strided(d.ws.get(), DType::kFP32, {G, NB, KB}, {sc.ws_group_stride, sc.ws_n_stride, sc.ws_k_stride});
  }
  return v;
}

void launch(const GemmCase& c, const Views& v, cudaStream_t stream, int64_t expected_m) {
  GroupedGemmOptions options;
  options.expected_m = expected_m;
  const Workspace ws{};  // grouped_gemm_workspace_bytes is 0
  if (is_fp8(c)) {
    if (c.masked) grouped_gemm_fp8_masked(v.x, v.w, v.rows, v.scales, v.y, ws, stream, options);
    else grouped_gemm_fp8(v.x, v.w, v.rows, v.scales, v.y, ws, stream, options);
  } else {
    if (c.masked) grouped_gemm_bf16_masked(v.x, v.w, v.rows, v.y, ws, stream, options);
    else grouped_gemm_bf16(v.x, v.w, v.rows, v.y, ws, stream, options);
  }
}

// Poison y, run, wait, download.
std::vector<uint16_t> run(const Host& h, Device& d, cudaStream_t stream = nullptr, int64_t expected_m = -1) {
  EXPECT_EQ(grouped_gemm_workspace_bytes(h.c.G, h.c.n, h.c.k), 0u);
  d.y.poison();
  launch(h.c, views_of(h, d), stream, expected_m >= 0 ? expected_m : h.c.expected_m);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return d.y.download();
}

void expect_matches(const Host& h, const reference::GroupedGemmRef& ref, const std::vector<uint16_t>& y,
                    const std::string& what = "") {
  const reference::GroupedGemmCheck r =
      reference::check_grouped_gemm(ref, y, h.y_row_stride, h.y_group_stride, kPoison);
  EXPECT_TRUE(r.ok) << what << r.message;
}

// Generates, runs and checks one case.
// One case on fresh data, checked against the reference; with hints, once per expected_m value (each must give
// the reference's result).
void check_case(const GemmCase& c, std::initializer_list<int64_t> hints = {-1}) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
  const Host h = make_host(c, seed);
  const reference::GroupedGemmRef ref = reference_of(h);
  Device d(h);
  for (int64_t hint : hints)
    expect_matches(h, ref, run(h, d, nullptr, hint), hint < 0 ? "" : "expected_m " + std::to_string(hint) + ": ");
}

// Group sizes in [0, cap], with the ragged ones every grid point should see (empty, one row, non-multiples of 16,
// the cap) at random positions. G = 1 gets one non-empty group.
std::vector<int64_t> random_sizes(int G, int64_t cap, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> size(0, cap);
  std::vector<int64_t> sizes(G);
  for (auto& s : sizes) s = size(rng);
  if (G == 1) {
    sizes[0] = std::max<int64_t>(1, sizes[0]);
    return sizes;
  }
  const int64_t special[] = {0, 1, 17, cap, 15, 33, 0, 127};
  std::vector<int> order(G);
  for (int g = 0; g < G; ++g) order[g] = g;
  std::shuffle(order.begin(), order.end(), rng);
  for (int i = 0; i < std::min(G, 8); ++i) sizes[order[i]] = std::min(special[i], cap);
  return sizes;
}

// Rows per group such that the reference stays well under a second on 16 cores and the buffers stay small.
int64_t size_cap(int G, int64_t n, int64_t k) {
  const double macs = 1.5e9;
  int64_t cap = static_cast<int64_t>(2.0 * macs / (static_cast<double>(G) * n * k));
  cap = std::min<int64_t>(cap, (int64_t{64} << 20) / (G * std::max(n, k)));
  return std::clamp<int64_t>(cap, 2, 2048);
}

class GroupedGemmGpu : public ::testing::Test {
 protected:
  void SetUp() override { TESSERA_REQUIRE_GPU(); }
};

// ---- the grid ----------------------------------------------------------------------------------------------

TEST_F(GroupedGemmGpu, ShapeGrid) {
  struct Variant {
    Kind kind;
    bool masked;
  };
  const Variant variants[] = {{Kind::kFP8PerTensor, false}, {Kind::kFP8Blockwise, false}, {Kind::kFP8PerTensor, true},
                              {Kind::kFP8Blockwise, true},  {Kind::kBF16, false},         {Kind::kBF16, true}};
  const int64_t dims[] = {128, 256, 384, 512, 1024};
  const uint64_t shape_seed = test::fresh_seed();  // group sizes / offsets; each case's data has its own seed
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  int idx = 0;
  for (int G : {1, 8, 32, 128, 256})
    for (const Variant& v : variants) {
      GemmCase c;
      c.kind = v.kind;
      c.masked = v.masked;
      c.G = G;
      int ni = idx % 5, ki = (idx / 5 + idx) % 5;
      while (int64_t{G} * dims[ni] * dims[ki] > (int64_t{32} << 20)) (dims[ni] >= dims[ki] ? ni : ki)--;
      c.n = dims[ni];
      c.k = dims[ki];
      c.sizes = random_sizes(G, size_cap(G, c.n, c.k), rng);
      if (c.masked) {
        // max_m past the largest group by 0 or 5 rows, and one group exactly at max_m.
        c.rows = *std::max_element(c.sizes.begin(), c.sizes.end()) + (idx % 3 == 0 ? 0 : 5);
        if (G > 1) c.sizes[rng() % G] = c.rows;
      } else {
        c.lead = idx % 2 ? 0 : 3;  // rows of no group before and after the groups
        c.tail = idx % 3 ? 7 : 0;
      }
      c.row_major_x_scale = idx % 2;
      c.transposed_w_scale = (idx / 2) % 2;
      ++idx;
      check_case(c);
    }
}

TEST_F(GroupedGemmGpu, RaggedGroups) {
  for_each_kind_and_layout([&](GemmCase c) {
    c.G = 9;
    c.n = 256;
    c.k = 512;
    c.sizes = {0, 1, 15, 16, 17, 127, 129, 600, 2048};
    c.lead = 5;
    c.tail = 11;
    c.max_m_extra = 3;
    check_case(c);
  });
}

TEST_F(GroupedGemmGpu, EdgeShapes) {
  for_each_kind_and_layout([&](GemmCase c) {
    // One group of one row.
    c.sizes = {1};
    check_case(c);
    // Every group empty: nothing may be written.
    c.G = 6;
    c.n = 384;
    c.k = 256;
    c.sizes = {0, 0, 0, 0, 0, 0};
    c.tail = 40;
    c.max_m_extra = 40;
    check_case(c);
    // max_m 1 / M 1 over many groups.
    c.G = 64;
    c.sizes.assign(64, 0);
    c.tail = 0;
    c.max_m_extra = 0;
    for (int g = 0; g < 64; g += 3) c.sizes[g] = 1;
    check_case(c);
  });
  // bf16 K that is a multiple of 64 but not of 128.
  for (int64_t k : {64, 192, 320})
    for (bool masked : {false, true}) {
      GemmCase c;
      c.kind = Kind::kBF16;
      c.masked = masked;
      c.G = 5;
      c.n = 256;
      c.k = k;
      c.sizes = {33, 0, 128, 1, 70};
      check_case(c);
    }
}

TEST_F(GroupedGemmGpu, NoRowsIsANoOp) {
  // M = 0 / max_m = 0 with null x and y: validated, nothing launched.
  GemmCase c;
  c.G = 4;
  c.n = 128;
  c.k = 256;
  for (Kind kind : {Kind::kFP8Blockwise, Kind::kFP8PerTensor, Kind::kBF16})
    for (bool masked : {false, true}) {
      c.kind = kind;
      c.masked = masked;
      c.sizes.assign(4, 0);
      const Host h = make_host(c, test::fresh_seed());
      ASSERT_EQ(h.shape.rows, 0);
      Device d(h);
      EXPECT_NO_THROW(run(h, d));
    }
}

// ---- tile sizes, strides, clamping --------------------------------------------------------------------------

// Every tile shape in one launch: group sizes at and around each height's boundary (0, 1, 8, 9, ... 129, 300), so
// that the device's per-group choice runs the consumer instantiations side by side: 8 × 128, 32 × 128 and
// 128 × 256 (N 512), or 64 × 128 for the large groups (N 384); K of 2 and 8 k-blocks, so that the last stage of a
// 3- or 2-k-block-per-stage tile runs past K (zero-filled boxes).
TEST_F(GroupedGemmGpu, MixedGroupSizesRunEveryTileShapeInOneLaunch) {
  const std::vector<int64_t> boundary = {0, 1, 7, 8, 9, 16, 17, 32, 33, 63, 64, 65, 127, 128, 129, 300};
  const uint64_t shape_seed = test::fresh_seed();
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  for (Kind kind : {Kind::kFP8Blockwise, Kind::kFP8PerTensor, Kind::kBF16})
    for (bool masked : {false, true})
      for (int64_t n : {384, 512})
        for (int64_t k : {256, 1024}) {
          GemmCase c;
          c.kind = kind;
          c.masked = masked;
          c.n = n;
          c.k = k;
          c.sizes = boundary;
          std::shuffle(c.sizes.begin(), c.sizes.end(), rng);
          c.G = static_cast<int>(c.sizes.size());
          c.lead = 2;
          c.tail = 9;
          c.max_m_extra = 4;
          check_case(c, {0, 1, 100000});  // expected_m is accepted and ignored: every value gives the same result
        }
}

// Decode launches (every group at most 8 rows) whose 128-wide tiles would fill at most half of the CTAs run 64-wide
// tiles with the two consumer warpgroups splitting K (config.h: split_decode_tiles): every kind and layout, K of
// 1, 5, 6, 7 and 9 k-blocks (stages of four: the last stage's real k-blocks end inside warpgroup 0's half, at its
// end, or inside warpgroup 1's half; the rest is TMA's zero fill), N an odd number of 64-wide tiles' pairs. Each launch's choice is asserted from the rule with the device's CTA count, so the shapes
// keep testing the split path if the rule moves.
TEST_F(GroupedGemmGpu, DecodeLaunchesSplitTheirTiles) {
  int sms = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, test::current_device()));
  const uint64_t shape_seed = test::fresh_seed();
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  struct Shape {
    int G;
    int64_t n, k;
  };
  for (const Shape sh : {Shape{4, 1024, 1152}, Shape{3, 640, 640}, Shape{1, 128, 128}, Shape{12, 384, 896},
                         Shape{2, 256, 768}})
    for_each_kind_and_layout([&](GemmCase c) {
      c.G = sh.G;
      c.n = sh.n;
      c.k = is_fp8(c) ? sh.k : sh.k / 2;  // the same k-blocks (128 bytes of K) for bf16
      // 1 to 8 rows a group (every group has tiles, so the tile count is the shape's), one group of 8 and, where
      // there are many groups, one empty.
      std::uniform_int_distribution<int64_t> rows(1, 8);
      c.sizes.assign(c.G, 0);
      int64_t tiles = 0, total = 0;
      for (int64_t& r : c.sizes) r = rows(rng);
      c.sizes[0] = 8;
      if (c.G > 9) c.sizes[1 + rng() % (c.G - 1)] = 0;
      std::shuffle(c.sizes.begin(), c.sizes.end(), rng);
      for (int64_t r : c.sizes) tiles += (r + 7) / 8 * (c.n / 128), total += r;
      c.lead = c.masked ? 0 : 3;
      c.max_m_extra = 2;
      // The CTAs the launcher gives the launch: its tile bound, at most one per SM. Rows: max_m (masked, the
      // largest group of 8 + max_m_extra) or M (contiguous).
      const int64_t launch_rows = c.masked ? 8 + c.max_m_extra : c.lead + total;
      const int64_t ctas =
          std::min<int64_t>(tessera::gemm::detail::grid_tile_bound(c.masked, launch_rows, c.G, c.n), sms);
      EXPECT_TRUE(tessera::gemm::detail::split_decode_tiles(tiles, ctas))
          << describe(c) << ": " << tiles << " tiles on " << ctas << " CTAs";
      check_case(c);
    });
}

// Skewed routing: one large group among many empty or tiny ones. 700-1100 rows at N 1024 run as a few 128 x 256
// tiles; 130-250 rows at N 512 make so few of them that the launch takes 64 x 128 tiles for the large group
// (config.h: large_block_m).
TEST_F(GroupedGemmGpu, OneLargeGroupAmongTinyOnes) {
  const uint64_t shape_seed = test::fresh_seed();
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  struct Skew {
    int G;
    int64_t n, big_lo, big_span;
  };
  for (const Skew sk : {Skew{64, 1024, 700, 400}, Skew{32, 512, 130, 120}})
    for_each_kind_and_layout([&](GemmCase c) {
      c.G = sk.G;
      c.n = sk.n;
      c.k = 512;
      c.sizes.assign(c.G, 0);
      c.sizes[std::uniform_int_distribution<int>(0, c.G - 1)(rng)] =
          sk.big_lo + static_cast<int64_t>(rng() % sk.big_span);
      for (int i = 0; i < 6; ++i) c.sizes[rng() % c.G] += 1 + static_cast<int64_t>(rng() % 5);
      c.tail = 3;
      check_case(c);
    });
}

// Large groups in 128 × 256 tiles with every kind of last m-tile: 48 groups of 33-450 rows at N 512 make 128-row
// tiles the launch's choice (about 240 of them against ~870 64-row ones, 2 waves against 7 on 132 SMs: config.h,
// large_block_m; the other tests' large groups mostly run as 64 × 128 tiles), and the sizes include every remainder
// boundary (rows % 128 of 0, 1, 64, 65) and groups of 33-64 rows, a single mostly empty tile.
TEST_F(GroupedGemmGpu, TallGroupsWithEveryRemainder) {
  const std::vector<int64_t> boundary = {33, 64, 65, 100, 128, 129, 150, 192, 193, 255, 256, 257, 320, 321, 448};
  const uint64_t shape_seed = test::fresh_seed();
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  for_each_kind_and_layout([&](GemmCase c) {
    c.n = 512;
    c.k = 256;
    c.sizes = boundary;
    while (c.sizes.size() < 48) c.sizes.push_back(129 + static_cast<int64_t>(rng() % 320));
    std::shuffle(c.sizes.begin(), c.sizes.end(), rng);
    c.G = static_cast<int>(c.sizes.size());
    c.tail = 5;
    c.max_m_extra = 3;
    check_case(c);
  });
}

// K of 128, 384 and 640 (fp8: 1, 3 and 5 k-blocks of 128 bytes; bf16: 2, 6 and 10) under groups of 0-300 rows: the
// decode (8-row), 32-row and 64-row tiles take two or three k-blocks per stage, so a tile's last stage is partly past
// K (zeros) and a tile starts at any stage of the ring. (The 128 × 256 tiles, one k-block per stage, need more tiles
// than a wave to be chosen at all: config.h, large_block_m; TallGroupsWithEveryRemainder and the layer's
// FusedActivationOnEveryTileShape reach them.) Every kind and layout.
TEST_F(GroupedGemmGpu, OddKBlockCounts) {
  const uint64_t shape_seed = test::fresh_seed();
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  for (int64_t k : {128, 384, 640})
    for_each_kind_and_layout([&](GemmCase c) {
      c.n = 512;
      c.k = k;
      c.sizes = {129, 1, 256, 40, 7, 300, 0, 20, 64 + static_cast<int64_t>(rng() % 200)};
      std::shuffle(c.sizes.begin(), c.sizes.end(), rng);
      c.G = static_cast<int>(c.sizes.size());
      c.tail = 3;
      c.max_m_extra = 2;
      check_case(c);
    });
}

// The most groups a launch takes (kGroupedGemmMaxGroups): the tile table then leaves room for a ring of only three
// stages (config.h: select_stages), the shallowest the three block-wise scale warps allow (kernel.cuh: kScaleWarps).
// Decode-like group sizes (0-9 rows, every tile height of 8 and 32) and a few 40-300-row groups, every kind and layout.
TEST_F(GroupedGemmGpu, MostGroupsRunOnTheShallowestRing) {
  ASSERT_EQ(tessera::gemm::detail::select_stages(tessera::gemm::kGroupedGemmMaxGroups), 3);
  const uint64_t shape_seed = test::fresh_seed();
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  for_each_kind_and_layout([&](GemmCase c) {
    c.G = tessera::gemm::kGroupedGemmMaxGroups;
    c.n = 128;
    c.k = 384;
    c.sizes.assign(c.G, 0);
    for (int64_t& r : c.sizes) r = static_cast<int64_t>(rng() % 10);
    for (int i = 0; i < 4; ++i) c.sizes[rng() % c.G] = 40 + static_cast<int64_t>(rng() % 260);
    c.tail = 2;
    check_case(c);
  });
}

TEST_F(GroupedGemmGpu, StridedOperands) {
  for (Kind kind : {Kind::kFP8Blockwise, Kind::kFP8PerTensor, Kind::kBF16})
    for (bool masked : {false, true})
      for (int variant = 0; variant < 2; ++variant) {
        GemmCase c;
        c.kind = kind;
        c.masked = masked;
        c.G = 7;
        c.n = 384;
        c.k = 256;
        c.sizes = {40, 0, 1, 97, 16, 200, 3};
        c.lead = 1;
        c.tail = 2;
        c.max_m_extra = 2;
        const int64_t elems_16b = is_fp8(c) ? 16 : 8;  // 16 bytes of x / w elements
        c.x_pad = (variant ? 3 : 1) * elems_16b;       // x row stride > K
        c.w_pad = variant ? elems_16b : 0;
        c.y_pad = variant ? 24 : 8;                    // y row stride > N, multiples of 8 elements
        c.group_pad_rows = variant ? 3 : 1;
        c.row_major_x_scale = variant;
        c.transposed_w_scale = !variant;
        check_case(c);
      }
}

// Offsets are clamped to [0, M] and a decreasing pair is an empty group; masked_m to [0, max_m]. Groups whose
// clamped ranges overlap each write their rows, and either result may land.
TEST_F(GroupedGemmGpu, OutOfRangeAndNonMonotoneGroupRows) {
  const int32_t M = 300;
  const std::vector<std::vector<int32_t>> offsets = {
      {-20, 40, 30, 100, 100, 400, 250, 260, -7},                       // negative, decreasing, past M, overlapping
      {M, M, M, M, M},                                                  // every group empty
      {M + 5, 200, 100, 50, 0},                                         // decreasing throughout
      {INT32_MIN, INT32_MAX, INT32_MIN, INT32_MAX, 17, 16, 15, M, M - 1},  // extremes
  };
  for (Kind kind : {Kind::kFP8Blockwise, Kind::kFP8PerTensor, Kind::kBF16})
    for (const auto& o : offsets) {
      GemmCase c;
      c.kind = kind;
      c.G = static_cast<int>(o.size()) - 1;
      c.n = 256;
      c.k = 256;
      c.raw_group_rows = o;
      c.rows = M;
      check_case(c);
    }
  // Random offsets over [-M, 2M].
  const uint64_t shape_seed = test::fresh_seed();  // group sizes / offsets; each case's data has its own seed
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  for (Kind kind : {Kind::kFP8Blockwise, Kind::kBF16}) {
    GemmCase c;
    c.kind = kind;
    c.G = 32;
    c.n = 128;
    c.k = 384;
    c.rows = M;
    for (int g = 0; g <= c.G; ++g) c.raw_group_rows.push_back(static_cast<int32_t>(rng() % (3 * M)) - M);
    check_case(c);
  }
  // masked_m out of [0, max_m].
  for (Kind kind : {Kind::kFP8Blockwise, Kind::kFP8PerTensor, Kind::kBF16}) {
    GemmCase c;
    c.kind = kind;
    c.masked = true;
    c.G = 8;
    c.n = 256;
    c.k = 512;
    c.rows = 70;  // max_m
    c.raw_group_rows = {-1, INT32_MAX, INT32_MIN, 71, 0, 70, 5, 33};
    check_case(c);
  }
}

// ---- graphs, determinism -----------------------------------------------------------------------------------

// gemm_fp8 (dense) is the one-group grouped GEMM: bitwise the same y as grouped_gemm_fp8 with offsets {0, M}, which
// the reference checks; both scale modes, M not a multiple of any tile, strided x and y, in a CUDA graph too.
TEST_F(GroupedGemmGpu, DenseFp8IsTheOneGroupProduct) {
  for (const Kind kind : {Kind::kFP8PerTensor, Kind::kFP8Blockwise}) {
    GemmCase c;
    c.kind = kind;
    c.G = 1;
    c.n = 384;
    c.k = 512;
    c.sizes = {333};
    c.x_pad = 16;
    c.y_pad = 8;
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    const std::vector<uint16_t> grouped = run(h, d);
    expect_matches(h, reference_of(h), grouped, "grouped: ");
    const Views v = views_of(h, d);
    TensorView w2 = v.w;  // [1, N, K] -> [N, K]
    w2.rank = 2;
    w2.shape[0] = v.w.shape[1];
    w2.shape[1] = v.w.shape[2];
    w2.strides[0] = v.w.strides[1];
    w2.strides[1] = v.w.strides[2];
    FP8Scales scales = v.scales;
    if (kind == Kind::kFP8PerTensor) {
      scales.w_scale.shape[0] = 1;
    } else {
      TensorView ws2 = v.scales.w_scale;
      ws2.rank = 2;
      ws2.shape[0] = v.scales.w_scale.shape[1];
      ws2.shape[1] = v.scales.w_scale.shape[2];
      ws2.strides[0] = v.scales.w_scale.strides[1];
      ws2.strides[1] = v.scales.w_scale.strides[2];
      scales.w_scale = ws2;
    }
    DeviceBuffer<unsigned char> ws(gemm_fp8_workspace_bytes(c.n, c.k));
    ws.poison();
    test::Stream stream;
    d.y.poison();
    gemm_fp8(v.x, w2, scales, v.y, Workspace{ws.get(), ws.size()}, stream.get());
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    EXPECT_EQ(d.y.download(), grouped) << "eager";
    d.y.poison();
    const test::CapturedGraph graph(stream.get(), [&] {
      gemm_fp8(v.x, w2, scales, v.y, Workspace{ws.get(), ws.size()}, stream.get());
    });
    graph.replay(stream.get());
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    EXPECT_EQ(d.y.download(), grouped) << "graph";
    // The workspace is checked before anything runs.
    EXPECT_THROW(gemm_fp8(v.x, w2, scales, v.y, Workspace{ws.get(), 8}, stream.get()), Error);
  }
}

TEST_F(GroupedGemmGpu, CudaGraphCapture) {
  // Captured once; replayed on new group sizes, rows and scales uploaded into the same buffers.
  cudaStream_t stream;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const uint64_t shape_seed = test::fresh_seed();  // group sizes / offsets; each case's data has its own seed
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  for (bool masked : {false, true}) {
    GemmCase c;
    c.kind = masked ? Kind::kBF16 : Kind::kFP8Blockwise;
    c.masked = masked;
    c.G = 8;
    c.n = 256;
    c.k = 512;
    c.rows = masked ? 160 : 1024;
    const auto group_rows = [&] {
      std::vector<int32_t> v;
      if (masked) {
        for (int g = 0; g < c.G; ++g) v.push_back(static_cast<int32_t>(rng() % (c.rows + 1)));
      } else {
        v.push_back(static_cast<int32_t>(rng() % 16));
        for (int g = 0; g < c.G; ++g)
          v.push_back(static_cast<int32_t>(std::min<int64_t>(v.back() + static_cast<int64_t>(rng() % 200), c.rows)));
      }
      return v;
    };
    c.raw_group_rows = group_rows();
    Host h = make_host(c, test::fresh_seed());
    Device d(h);
    cudaGraph_t graph;
    TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    launch(c, views_of(h, d), stream, 0);
    TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    TESSERA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      c.raw_group_rows = group_rows();
      const uint64_t seed = test::fresh_seed();
      SCOPED_TRACE(describe(c) + " replay " + std::to_string(replay) + " " + test::seed_note(seed));
      h = make_host(c, seed);
      d.upload(h);
      d.y.poison();
      TESSERA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
      expect_matches(h, reference_of(h), d.y.download());
    }
    TESSERA_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TESSERA_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  TESSERA_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_F(GroupedGemmGpu, Deterministic) {
  cudaStream_t stream;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const uint64_t shape_seed = test::fresh_seed();  // group sizes / offsets; each case's data has its own seed
  SCOPED_TRACE("shape " + test::seed_note(shape_seed));
  std::mt19937_64 rng(shape_seed);
  for_each_kind_and_layout([&](GemmCase c) {
    c.G = 8;
    c.n = 1024;
    c.k = 1024;
    c.sizes = random_sizes(8, 512, rng);
    const uint64_t seed = test::fresh_seed();
    SCOPED_TRACE(describe(c) + " " + test::seed_note(seed));
    const Host h = make_host(c, seed);
    Device d(h);
    const std::vector<uint16_t> first = run(h, d, stream);
    expect_matches(h, reference_of(h), first);
    for (int again = 0; again < 2; ++again) {
      const std::vector<uint16_t> y = run(h, d, stream);
      ASSERT_EQ(y.size(), first.size());
      EXPECT_EQ(0, std::memcmp(y.data(), first.data(), y.size() * sizeof(uint16_t))) << "run " << again + 2;
    }
  });
  TESSERA_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---- arguments the device checks reject --------------------------------------------------------------------

TEST_F(GroupedGemmGpu, HostPointersAndWrongDeviceRejectedBeforeLaunch) {
  for (Kind kind : {Kind::kFP8Blockwise, Kind::kFP8PerTensor, Kind::kBF16})
    for (bool masked : {false, true}) {
      GemmCase c;
      c.kind = kind;
      c.masked = masked;
      c.G = 3;
      c.n = 128;
      c.k = 256;
      c.sizes = {5, 0, 9};
      const Host h = make_host(c, test::fresh_seed());
      Device d(h);
      const Views good = views_of(h, d);
      std::vector<uint8_t> host_memory(1 << 20);
      void* host_ptr = host_memory.data() + (256 - reinterpret_cast<std::uintptr_t>(host_memory.data()) % 256) % 256;
      const char* rows_name = masked ? "masked_m" : "offsets";
      struct Swap {
        const char* arg;
        TensorView Views::*view;  // nullptr: a scale
        bool x_scale;
      };
      std::vector<Swap> swaps = {{"x", &Views::x, false}, {"w", &Views::w, false}, {rows_name, &Views::rows, false},
                                 {"y", &Views::y, false}};
      if (is_fp8(c)) {
        swaps.push_back({"x_scale", nullptr, true});
        swaps.push_back({"w_scale", nullptr, false});
      }
      const auto expect_rejected = [&](const Views& v, const char* arg, const char* what) {
        SCOPED_TRACE(describe(c) + ": " + what + " '" + arg + "'");
        d.y.poison();
        try {
          launch(c, v, nullptr, 0);
          ADD_FAILURE() << "accepted";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find(std::string("'") + arg + "'"), std::string::npos) << e.what();
        }
        TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
        for (uint16_t v16 : d.y.download()) ASSERT_EQ(v16, kPoison);
      };
      for (const Swap& s : swaps) {
        Views v = good;
        TensorView& t = s.view ? v.*(s.view) : (s.x_scale ? v.scales.x_scale : v.scales.w_scale);
        t.data = host_ptr;  // host memory labelled as the current device
        expect_rejected(v, s.arg, "host pointer for");
        v = good;
        TensorView& u = s.view ? v.*(s.view) : (s.x_scale ? v.scales.x_scale : v.scales.w_scale);
        u.device = current_device() + 1;
        expect_rejected(v, s.arg, "wrong device for");
      }
    }
}

// ---- the problem the launcher gets -------------------------------------------------------------------------

TEST_F(GroupedGemmGpu, CheckedProblemDescribesTheCall) {
  const int dev = current_device();
  DeviceBuffer<uint8_t> x(1 << 20), w(1 << 22), y(1 << 20);
  DeviceBuffer<int32_t> rows(16);
  DeviceBuffer<float> xs(4096), ws(4096);
  const auto view = [&](void* data, DType dtype, std::initializer_list<int64_t> shape,
                        std::initializer_list<int64_t> strides) {
    TensorView t = strided(data, dtype, shape, strides);
    t.device = dev;
    return t;
  };
  using detail::Layout;
  using detail::Operand;
  using detail::Scaling;
  {
    // Contiguous fp8, blockwise, padded rows, column-major x_scale, transposed w_scale.
    FP8Scales sc;
    sc.mode = ScaleMode::kBlockwise;
    sc.x_scale = view(xs.get(), DType::kFP32, {100, 2}, {1, 100});
    sc.w_scale = view(ws.get(), DType::kFP32, {8, 2, 2}, {4, 1, 2});
    const detail::GroupedProblem p = detail::check_grouped_gemm(
        "grouped_gemm_fp8", Operand::kFP8, Layout::kContiguous, view(x.get(), DType::kFP8E4M3, {100, 256}, {272, 1}),
        view(w.get(), DType::kFP8E4M3, {8, 256, 256}, {256 * 272, 272, 1}),
        view(rows.get(), DType::kInt32, {9}, {1}), sc, view(y.get(), DType::kBF16, {100, 256}, {264, 1}), {}, {});
    EXPECT_EQ(p.operand, Operand::kFP8);
    EXPECT_EQ(p.layout, Layout::kContiguous);
    EXPECT_EQ(p.scaling, Scaling::kBlockwise);
    EXPECT_EQ(p.num_groups, 8);
    EXPECT_EQ(p.rows, 100);
    EXPECT_EQ(p.n, 256);
    EXPECT_EQ(p.k, 256);
    EXPECT_EQ(p.x, x.get());
    EXPECT_EQ(p.x_row_stride, 272);
    EXPECT_EQ(p.x_group_stride, 0);
    EXPECT_EQ(p.w, w.get());
    EXPECT_EQ(p.w_row_stride, 272);
    EXPECT_EQ(p.w_group_stride, 256 * 272);
    EXPECT_EQ(p.group_rows, rows.get());
    EXPECT_EQ(p.y, y.get());
    EXPECT_EQ(p.y_row_stride, 264);
    EXPECT_EQ(p.y_group_stride, 0);
    EXPECT_EQ(p.x_scale, xs.get());
    EXPECT_EQ(p.xs_row_stride, 1);
    EXPECT_EQ(p.xs_k_stride, 100);
    EXPECT_EQ(p.xs_group_stride, 0);
    EXPECT_EQ(p.w_scale, ws.get());
    EXPECT_EQ(p.ws_group_stride, 4);
    EXPECT_EQ(p.ws_n_stride, 1);
    EXPECT_EQ(p.ws_k_stride, 2);
  }
  {
    // Masked bf16, G = 1, max_m = 1: strides of the size-1 dims are arbitrary and come back normalized.
    GroupedGemmOptions o;
    const detail::GroupedProblem p = detail::check_grouped_gemm(
        "grouped_gemm_bf16_masked", Operand::kBF16, Layout::kMasked,
        view(x.get(), DType::kBF16, {1, 1, 128}, {3, 5, 1}), view(w.get(), DType::kBF16, {1, 128, 128}, {7, 128, 1}),
        view(rows.get(), DType::kInt32, {1}, {1}), std::nullopt, view(y.get(), DType::kBF16, {1, 1, 128}, {-1, 0, 1}),
        {}, o);
    EXPECT_EQ(p.operand, Operand::kBF16);
    EXPECT_EQ(p.layout, Layout::kMasked);
    EXPECT_EQ(p.scaling, Scaling::kNone);
    EXPECT_EQ(p.rows, 1);
    EXPECT_EQ(p.x_row_stride, 128);
    EXPECT_EQ(p.x_group_stride, 128);
    EXPECT_EQ(p.w_row_stride, 128);
    EXPECT_EQ(p.w_group_stride, 128 * 128);
    EXPECT_EQ(p.y_row_stride, 128);
    EXPECT_EQ(p.y_group_stride, 128);
    EXPECT_EQ(p.x_scale, nullptr);
    EXPECT_EQ(p.w_scale, nullptr);
  }
  {
    // Masked fp8 per-tensor with a strided w_scale and an explicit hint.
    FP8Scales sc;
    sc.mode = ScaleMode::kPerTensor;
    sc.x_scale = view(xs.get(), DType::kFP32, {}, {});
    sc.w_scale = view(ws.get(), DType::kFP32, {4}, {2});
    GroupedGemmOptions o;
    o.expected_m = 77;
    const detail::GroupedProblem p = detail::check_grouped_gemm(
        "grouped_gemm_fp8_masked", Operand::kFP8, Layout::kMasked,
        view(x.get(), DType::kFP8E4M3, {4, 50, 128}, {50 * 144, 144, 1}),
        view(w.get(), DType::kFP8E4M3, {4, 256, 128}, {256 * 128, 128, 1}), view(rows.get(), DType::kInt32, {4}, {1}),
        sc, view(y.get(), DType::kBF16, {4, 50, 256}, {52 * 256, 256, 1}), {}, o);
    EXPECT_EQ(p.scaling, Scaling::kPerTensor);
    EXPECT_EQ(p.rows, 50);
    EXPECT_EQ(p.x_row_stride, 144);
    EXPECT_EQ(p.x_group_stride, 50 * 144);
    EXPECT_EQ(p.y_row_stride, 256);
    EXPECT_EQ(p.y_group_stride, 52 * 256);
    EXPECT_EQ(p.ws_group_stride, 2);
    EXPECT_EQ(p.xs_row_stride, 0);
    EXPECT_EQ(p.ws_n_stride, 0);
  }
}

}  // namespace
}  // namespace tessera::gemm
