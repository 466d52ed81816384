// tessera-bench cases for the weight-only quantized linear layer (tessera/linear.h, issue 18), and their cuBLASLt
// bf16 peer.
//
//   linear                y [M, N] = x [M, K] · dequant(W)ᵀ, x / y bf16, W prepacked (codes + (scale, p) pairs in
//                         bf16), no bias, no clamp
//   cublaslt_bf16_linear  peer rows (same case names as the linear rows): y = x · Wᵀ with a dense bf16 W [N, K],
//                         one cublasLtMatmul (TN, fp32 accumulation, bf16 out, the heuristic's first algorithm, 32 MiB
//                         workspace). The same computation for every weight format of a (shape, M), so each format's
//                         row has its own peer row (the C++ report pairs rows by exact case name).
//                         One more row of this op, "ceiling/M8192_N8192_K8192" (peer of nothing), is the measured
//                         bf16 GEMM ceiling: bench/peers/linear.py divides the compute-bound rows' TFLOP/s by it.
//
// Case names: <shape>/N<n>_K<k>/M<m>/<format>
//   shapes   llama3_8b_gate_up N14336 K4096, llama3_8b_down N4096 K14336, llama3_8b_attn N4096 K4096 (Llama-3-8B),
//            dsv3_like N7168 K2048
//   formats  int4_g128     int4, a (scale, offset) pair per 128 columns, w = q·scale + offset   (the headline)
//            int8_g128     int8, the same blocks and convention
//            int4_channel  int4, one pair per output channel (block = K)
//            int4_g128_zp  int4 g128 with GPTQ / AWQ zero points, w = (q − zero)·scale
//   M        1, 4, 16, 64, 256, 2048, 8192
// --all: int4_g128 on every shape and M; int8_g128 on llama3_8b_gate_up at every M and on the other shapes at M 1 and
// 2048; int4_channel on llama3_8b_gate_up at M 1, 16, 64, 2048 and on the other shapes at M 1; int4_g128_zp on
// llama3_8b_gate_up at M 1, 16, 2048. The default suite (headline): llama3_8b_gate_up int4_g128 at M 1, 16, 64,
// 256, 2048 and int8_g128 at M 1, each with its cuBLASLt row, and the ceiling row.
//
// Bytes = codes (N·K·bits/8) + pairs (4 bytes per block and output channel) + x (2·M·K) + y written (2·M·N): the
// table's "% read BW" is that against the measured read ceiling (the bound for M < 256). FLOPs = 2·M·N·K (M ≥ 256 is
// compute-bound: compare TFLOP/s with the ceiling row, or read bench/compare.py --ops linear's "% ceil", which does).
// Peer rows: bytes = the bf16 W (2·N·K) + x + y.
//
// Inputs, generated on the GPU straight into the prepacked layout (device_random.h; no host prepack, nothing large
// on the host), in rotating sets (codes, pairs and x together; rotating_sets):
//   codes  uniform random bytes (every byte is a valid pair of int4 codes or an int8 code)
//   pairs  scale ~ U(0.001, 0.02) rounded to bf16; offset ~ U(−0.1, 0.1) (kOffset), or a zero point uniform over the
//          integers [0, 2^bits) (kZeroPoint), both in bf16, interleaved (scale, p) as the layout stores them
//   x      bf16 U(−1, 1);   the peer's W: bf16 U(−1, 1)
// The shapes are aligned (N a multiple of 16, K of 128), so the layout has no padded rows or columns.
//
// --check (linear): y is poisoned, set 0 runs, and the float64 reference (reference::linear_reference) is computed
// for a sample: rows of x: all when M <= 16, else 16 (the first two, the last two, random ones); output channels:
// whole 16-row stripes of the layout, all of them when rows·N·K <= 4e8 multiply-adds, else the first, the last and
// random ones within that budget. The sampled stripes' codes and pairs are downloaded, assembled into a
// tessera::linear::PackedWeight (16 rows per stripe) and unpacked on the host (tessera::linear::unpack), so the
// check reads the layout through the library's own inverse; the y elements of the sampled rows × channels must be
// finite and within 5e-3 relative Frobenius error of the reference. The cuBLASLt rows: the same row sample against
// sampled output channels of the dense W (float64 dot products), the same bound.
#include <cublasLt.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/host_numeric.h"
#include "cublaslt_util.h"
#include "device_random.h"
#include "harness.h"
#include "reference/format.h"
#include "reference/linear_reference.h"
#include "tessera/linear.h"

namespace tessera::bench {
namespace {

using linear::ZeroMode;

constexpr double kTolerance = 5e-3;       // relative Frobenius error of y (bf16)
constexpr int64_t kCheckRows = 16;        // rows of x (and y) --check compares
constexpr double kCheckMacs = 4.0e8;      // multiply-adds of the sampled reference
constexpr int64_t kStripe = 16;           // rows of W per stripe of the prepacked layout
constexpr int64_t kStripesPerChunk = 16;  // stripes per reference task (one unpack + linear_reference each)

// ============================================================================================================
// shapes and formats
struct WeightShape {
  std::string model;  // "llama3_8b_gate_up"
  int64_t n = 0, k = 0;
};

struct Format {
  std::string name;  // "int4_g128"
  int bits = 4;
  int64_t block = 128;  // 0: one block per output channel (block = K)
  ZeroMode zero_mode = ZeroMode::kOffset;
};

struct Problem {
  WeightShape shape;
  Format format;
  int64_t m = 0;

  int64_t n() const { return shape.n; }
  int64_t k() const { return shape.k; }
  int bits() const { return format.bits; }
  int64_t block() const { return format.block == 0 ? shape.k : format.block; }
  int64_t num_blocks() const { return k() / block(); }
  int64_t code_bytes() const { return n() * k() * bits() / 8; }  // [Np, Kp·bits/8], aligned shapes: Np = N, Kp = K
  int64_t pairs() const { return n() * num_blocks(); }           // (scale, p) pairs
  int64_t stripes() const { return n() / kStripe; }
  int64_t stripe_code_bytes() const { return kStripe * k() * bits() / 8; }
  int64_t stripe_param_elems() const { return kStripe * num_blocks() * 2; }
  // Inputs one call reads (the rotation's unit) and bytes it moves.
  double input_bytes() const { return static_cast<double>(code_bytes()) + 4.0 * pairs() + 2.0 * m * k(); }
  double bytes() const { return input_bytes() + 2.0 * m * n(); }
  double flops() const { return 2.0 * m * n() * k(); }
  std::string name() const {
    return shape.model + "/N" + std::to_string(n()) + "_K" + std::to_string(k()) + "/M" + std::to_string(m) + "/" +
           format.name;
  }
};

// ============================================================================================================
// inputs in the prepacked layout, on the GPU
enum Salt : uint64_t { kCodes = 1, kScales, kSecond, kX, kW };

struct LinearInputs {
  DeviceBuffer codes, params, x;
};

LinearInputs make_inputs(const Problem& p, uint64_t seed, cudaStream_t stream) {
  LinearInputs in;
  in.codes.allocate(p.code_bytes());  // a multiple of 4 bytes: 16 rows × K·bits/8 per stripe
  gen::fill_int(in.codes.as<int32_t>(), p.code_bytes() / 4, gen::sub_seed(seed, kCodes), INT32_MIN, INT32_MAX, stream);

  const int64_t pairs = p.pairs();
  DeviceBuffer scale(pairs * 2), second(pairs * 2);
  gen::FloatDist sd;
  sd.lo = 0.001f;
  sd.hi = 0.02f;
  gen::fill_float(scale.get(), DType::kBF16, pairs, gen::sub_seed(seed, kScales), sd, stream);
  DeviceBuffer zero_index, zero_table;
  if (p.format.zero_mode == ZeroMode::kOffset) {
    gen::FloatDist od;
    od.lo = -0.1f;
    od.hi = 0.1f;
    gen::fill_float(second.get(), DType::kBF16, pairs, gen::sub_seed(seed, kSecond), od, stream);
  } else {
    // Integer zero points in bf16: random int32 indices in [0, 2^bits), widened to int64 (the high words zeroed),
    // gather the bf16 values of a table of the integers 0 .. 2^bits − 1 (exact in bf16).
    const int levels = 1 << p.bits();
    std::vector<uint16_t> table(levels);
    for (int z = 0; z < levels; ++z) table[z] = host::f32_to_bf16(static_cast<float>(z));
    zero_table = upload_new(table);
    DeviceBuffer index32(pairs * 4);
    zero_index.allocate(pairs * 8);
    gen::fill_int(index32.as<int32_t>(), pairs, gen::sub_seed(seed, kSecond), 0, levels, stream);
    zero_index.fill_async(0, stream);
    TESSERA_CUDA_CHECK(cudaMemcpy2DAsync(zero_index.get(), 8, index32.get(), 4, 4, static_cast<std::size_t>(pairs),
                                         cudaMemcpyDeviceToDevice, stream));
    gen::gather_rows(zero_table.get(), 2, zero_index.as<const int64_t>(), pairs, second.get(), stream);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));  // index32 is freed at the end of this scope
  }
  in.params.allocate(pairs * 4);
  gen::interleave_pairs(in.params.as<uint16_t>(), scale.as<const uint16_t>(), second.as<const uint16_t>(), pairs, stream);

  in.x.allocate(p.m * p.k() * 2);
  gen::fill_float(in.x.get(), DType::kBF16, p.m * p.k(), gen::sub_seed(seed, kX), {}, stream);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));  // the temporaries go out of scope
  return in;
}

// ============================================================================================================
// --check helpers
// Rows of x the check compares: all when M <= kCheckRows, else the first two, the last two and random ones.
std::vector<int64_t> check_rows(int64_t m, uint64_t seed) { return sample_indices(m, kCheckRows, 2, seed); }

std::vector<double> bf16_to_double(const std::vector<uint16_t>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = host::bf16_to_f32(v[i]);
  return out;
}

// ============================================================================================================
// tessera
class LinearCase final : public CaseInstance {
 public:
  LinearCase(const DeviceContext& ctx, const std::string& op, const Problem& p) : p_(p), device_(ctx.device) {
    const std::string name = p.name();
    sets_ = rotating_sets(ctx, p.input_bytes());
    for (int s = 0; s < sets_; ++s) {
      Set set;
      set.in = make_inputs(p, case_seed(op, name, s), ctx.stream);
      set.w.codes = TensorView::contiguous(set.in.codes.get(), DType::kUInt8, {p.n(), p.k() * p.bits() / 8}, device_);
      set.w.params = TensorView::contiguous(set.in.params.get(), DType::kBF16, {p.n(), p.num_blocks(), 2}, device_);
      set.w.n = p.n();
      set.w.k = p.k();
      set.w.bits = p.bits();
      set.w.block = p.block();
      set.w.zero_mode = p.format.zero_mode;
      set.x = TensorView::contiguous(set.in.x.get(), DType::kBF16, {p.m, p.k()}, device_);
      sets_data_.push_back(std::move(set));
    }
    y_.allocate(p.m * p.n() * 2);
    y_view_ = TensorView::contiguous(y_.get(), DType::kBF16, {p.m, p.n()}, device_);
    workspace_bytes_ = linear::linear_workspace_bytes(p.m, sets_data_[0].w, DType::kBF16);
    workspace_.allocate(workspace_bytes_);
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    linear::linear(s.x, s.w, y_view_, linear::LinearEpilogue{}, Workspace{workspace_.get(), workspace_bytes_}, stream);
  }

  CheckResult check(cudaStream_t stream) override {
    y_.fill_async(0xFF, stream);  // bf16 NaN
    run(stream, 0);
    const int64_t K = p_.k(), N = p_.n(), S = p_.stripes();
    const std::vector<int64_t> rows = check_rows(p_.m, 0x11EA5ull);
    const int64_t R = static_cast<int64_t>(rows.size());
    const int64_t budget = static_cast<int64_t>(kCheckMacs / (static_cast<double>(R) * kStripe * K));
    const std::vector<int64_t> stripes = sample_indices(S, std::max<int64_t>(budget, 2), 1, 0x57121Eull);
    const int64_t SC = static_cast<int64_t>(stripes.size());

    const Set& set = sets_data_[0];
    const std::vector<uint16_t> y = download_rows<uint16_t>(y_, N, rows, stream);
    const std::vector<double> x = bf16_to_double(download_rows<uint16_t>(set.in.x, K, rows, stream));
    const std::vector<uint8_t> codes = download_rows<uint8_t>(set.in.codes, p_.stripe_code_bytes(), stripes, stream);
    const std::vector<uint16_t> params =
        download_rows<uint16_t>(set.in.params, p_.stripe_param_elems(), stripes, stream);

    // Per chunk of sampled stripes: a PackedWeight of those stripes (16 rows each), unpacked by the library's
    // inverse, and the float64 reference of the sampled rows against its channels.
    const int64_t chunks = (SC + kStripesPerChunk - 1) / kStripesPerChunk;
    const double work = static_cast<double>(R) * SC * kStripe * K;
    const ErrorSum total = parallel_error_sum(chunks, work, [&](int64_t c, ErrorSum& sum) {
      const int64_t s0 = c * kStripesPerChunk, s1 = std::min(SC, s0 + kStripesPerChunk);
      linear::PackedWeight pw;
      pw.n = (s1 - s0) * kStripe;
      pw.k = K;
      pw.bits = p_.bits();
      pw.block = p_.block();
      pw.zero_mode = p_.format.zero_mode;
      pw.compute_dtype = DType::kBF16;
      pw.codes.assign(codes.begin() + s0 * p_.stripe_code_bytes(), codes.begin() + s1 * p_.stripe_code_bytes());
      pw.params.assign(params.begin() + s0 * p_.stripe_param_elems(), params.begin() + s1 * p_.stripe_param_elems());
      const linear::QuantizedWeight w = linear::unpack(pw);
      const std::vector<double> ref = reference::linear_reference(x, R, w);  // [R][pw.n]
      for (int64_t i = 0; i < R; ++i)
        for (int64_t s = s0; s < s1; ++s)
          for (int64_t j = 0; j < kStripe; ++j) {
            const int64_t local = (s - s0) * kStripe + j, channel = stripes[s] * kStripe + j;
            sum.add(host::bf16_to_f32(y[i * N + channel]), ref[i * pw.n + local]);
          }
    });
    const std::string channels = SC == S ? "all " + std::to_string(N) + " output channels"
                                         : std::to_string(SC * kStripe) + " of " + std::to_string(N) +
                                               " output channels (" + std::to_string(SC) +
                                               " 16-row stripes: first, last, random)";
    const std::string what =
        describe_sample(rows, p_.m, "rows") + " x " + channels + ", weights unpacked from the device layout";
    return total.result(what, kTolerance);
  }

 private:
  struct Set {
    LinearInputs in;
    linear::LinearWeight w;
    TensorView x;
  };
  Problem p_;
  int device_;
  int sets_ = 1;
  std::vector<Set> sets_data_;
  DeviceBuffer y_, workspace_;
  TensorView y_view_;
  std::size_t workspace_bytes_ = 0;
};

// ============================================================================================================
// cuBLASLt bf16 peer: y = x · Wᵀ as, column-major, yᵀ [N, M] = W [N, K] · xᵀ: A = W stored K x N (ld K, = row-major
// [N, K]) with transa = T; B = x stored K x M (ld K) with transb = N; D = y stored N x M (ld N, = row-major [M, N]).

struct DenseShape {
  int64_t m = 0, n = 0, k = 0;
  double input_bytes() const { return 2.0 * (static_cast<double>(n) * k + static_cast<double>(m) * k); }
  double bytes() const { return input_bytes() + 2.0 * m * n; }
  double flops() const { return 2.0 * m * n * k; }
};

class CublasLtLinearCase final : public CaseInstance {
 public:
  CublasLtLinearCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const DenseShape& sh)
      : sh_(sh) {
    sets_ = rotating_sets(ctx, sh.input_bytes());
    for (int s = 0; s < sets_; ++s) {
      const uint64_t seed = case_seed(op, name, s);
      Set set;
      set.w.allocate(sh.n * sh.k * 2);
      set.x.allocate(sh.m * sh.k * 2);
      gen::fill_float(set.w.get(), DType::kBF16, sh.n * sh.k, gen::sub_seed(seed, kW), {}, ctx.stream);
      gen::fill_float(set.x.get(), DType::kBF16, sh.m * sh.k, gen::sub_seed(seed, kX), {}, ctx.stream);
      sets_data_.push_back(std::move(set));
    }
    y_.allocate(sh.m * sh.n * 2);
    workspace_.allocate(kLtWorkspaceBytes);

    create_tn_matmul(handle_, desc_);
    a_ = make_layout(CUDA_R_16BF, sh.k, sh.n, sh.k);
    b_ = make_layout(CUDA_R_16BF, sh.k, sh.m, sh.k);
    d_ = make_layout(CUDA_R_16BF, sh.n, sh.m, sh.n);

    if (!first_heuristic_algo(handle_, desc_, a_, b_, d_, algo_))
      throw Unsupported("cuBLASLt has no bf16 algorithm for M=" + std::to_string(sh.m) + " N=" + std::to_string(sh.n) +
                        " K=" + std::to_string(sh.k));
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    const float alpha = 1.0f, beta = 0.0f;
    BENCH_CUBLAS_CHECK(cublasLtMatmul(handle_.get(), desc_.get(), &alpha, s.w.get(), a_.get(), s.x.get(), b_.get(),
                                       &beta, y_.get(), d_.get(), y_.get(), d_.get(), &algo_, workspace_.get(),
                                       kLtWorkspaceBytes, stream));
  }

  CheckResult check(cudaStream_t stream) override {
    y_.fill_async(0xFF, stream);
    run(stream, 0);
    const int64_t K = sh_.k, N = sh_.n;
    const std::vector<int64_t> rows = check_rows(sh_.m, 0x11EA5ull);
    const int64_t R = static_cast<int64_t>(rows.size());
    const int64_t budget = static_cast<int64_t>(kCheckMacs / (static_cast<double>(R) * K));
    const std::vector<int64_t> cols = sample_indices(N, std::max<int64_t>(budget, 2), 2, 0xC015ull);
    const int64_t C = static_cast<int64_t>(cols.size());
    const Set& set = sets_data_[0];
    const std::vector<uint16_t> y = download_rows<uint16_t>(y_, N, rows, stream);
    const std::vector<double> x = bf16_to_double(download_rows<uint16_t>(set.x, K, rows, stream));
    const std::vector<double> w = bf16_to_double(download_rows<uint16_t>(set.w, K, cols, stream));
    const ErrorSum total = parallel_error_sum(R, static_cast<double>(R) * C * K, [&](int64_t i, ErrorSum& sum) {
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += x[i * K + k] * w[c * K + k];
        sum.add(host::bf16_to_f32(y[i * N + cols[c]]), acc);
      }
    });
    const std::string what =
        describe_sample(rows, sh_.m, "rows") + " x " + describe_sample(cols, N, "output channels") + ", dense bf16 W";
    return total.result(what, kTolerance);
  }

 private:
  struct Set {
    DeviceBuffer w, x;
  };
  DenseShape sh_;
  int sets_ = 1;
  std::vector<Set> sets_data_;
  DeviceBuffer y_, workspace_;
  LtHandle handle_;
  LtMatmulDesc desc_;
  LtLayout a_, b_, d_;
  cublasLtMatmulAlgo_t algo_{};
};

// ============================================================================================================
// registration
constexpr const char* kOp = "linear";
constexpr const char* kPeerOp = "cublaslt_bf16_linear";

void add_linear_cases(std::vector<CaseSpec>& cases) {
  const WeightShape gate_up{"llama3_8b_gate_up", 14336, 4096}, down{"llama3_8b_down", 4096, 14336},
      attn{"llama3_8b_attn", 4096, 4096}, dsv3{"dsv3_like", 7168, 2048};
  const Format int4_g128{"int4_g128", 4, 128, ZeroMode::kOffset}, int8_g128{"int8_g128", 8, 128, ZeroMode::kOffset},
      int4_channel{"int4_channel", 4, 0, ZeroMode::kOffset}, int4_g128_zp{"int4_g128_zp", 4, 128, ZeroMode::kZeroPoint};
  const std::vector<int64_t> every_m = {1, 4, 16, 64, 256, 2048, 8192};

  // (shape, format, M values), in table order: per shape, its formats.
  struct Grid {
    WeightShape shape;
    Format format;
    std::vector<int64_t> ms;
  };
  const std::vector<Grid> grid = {
      {gate_up, int4_g128, every_m},
      {gate_up, int8_g128, every_m},
      {gate_up, int4_channel, {1, 16, 64, 2048}},
      {gate_up, int4_g128_zp, {1, 16, 2048}},
      {down, int4_g128, every_m},
      {down, int8_g128, {1, 2048}},
      {down, int4_channel, {1}},
      {attn, int4_g128, every_m},
      {attn, int8_g128, {1, 2048}},
      {attn, int4_channel, {1}},
      {dsv3, int4_g128, every_m},
      {dsv3, int8_g128, {1, 2048}},
      {dsv3, int4_channel, {1}},
  };
  // The default suite: the rows of issue 18's targets at the headline shape, each with its peer row.
  const std::set<std::string> headline = {
      "llama3_8b_gate_up/N14336_K4096/M1/int4_g128",    "llama3_8b_gate_up/N14336_K4096/M16/int4_g128",
      "llama3_8b_gate_up/N14336_K4096/M64/int4_g128",   "llama3_8b_gate_up/N14336_K4096/M256/int4_g128",
      "llama3_8b_gate_up/N14336_K4096/M2048/int4_g128", "llama3_8b_gate_up/N14336_K4096/M1/int8_g128",
  };

  for (const Grid& g : grid) {
    if (g.shape.n % kStripe != 0 || g.shape.k % 128 != 0)
      throw Error("tessera-bench: linear shapes must have N % 16 == 0 and K % 128 == 0 (no padded layout here)");
    for (int64_t m : g.ms) {
      const Problem p{g.shape, g.format, m};
      CaseSpec c;
      c.op = kOp;
      c.name = p.name();
      c.headline = headline.count(c.name) > 0;
      c.bytes = p.bytes();
      c.flops = p.flops();
      c.setup = [p](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
        return std::make_unique<LinearCase>(ctx, kOp, p);
      };
      const bool head = c.headline;
      const std::string name = c.name;
      cases.push_back(std::move(c));

      const DenseShape dense{m, g.shape.n, g.shape.k};
      CaseSpec peer;
      peer.op = kPeerOp;
      peer.name = name;
      peer.headline = head;
      peer.bytes = dense.bytes();
      peer.flops = dense.flops();
      peer.peer_of = {kOp};
      peer.setup = [dense, name](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
        return std::make_unique<CublasLtLinearCase>(ctx, kPeerOp, name, dense);
      };
      cases.push_back(std::move(peer));
    }
  }

  // The measured bf16 GEMM ceiling (no peer_of: a row of its own).
  const DenseShape ceiling{8192, 8192, 8192};
  CaseSpec c;
  c.op = kPeerOp;
  c.name = "ceiling/M8192_N8192_K8192";
  c.headline = true;
  c.bytes = ceiling.bytes();
  c.flops = ceiling.flops();
  const std::string name = c.name;
  c.setup = [ceiling, name](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
    return std::make_unique<CublasLtLinearCase>(ctx, kPeerOp, name, ceiling);
  };
  cases.push_back(std::move(c));
}

}  // namespace

TESSERA_BENCH_CASES(add_linear_cases);

}  // namespace tessera::bench
