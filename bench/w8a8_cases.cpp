// tessera-bench cases for W8A8 (tessera/w8a8.h, issue 19): the activation quantizer, the int8 × int8 GEMM, the two
// together, and their peers.
//
//   w8a8_quantize        quantize_per_block(x) of a bf16 x [M, K], asymmetric (codes + scale + zero point planes; no
//                        code sums: a GEMM with symmetric weights does not read ΣAq), the way the GEMM cases use it
//   memcpy_d2d           peer rows of w8a8_quantize (same case names): one cudaMemcpyAsync device-to-device of half
//                        the quantizer's bytes, i.e. the same bytes read + written
//   gemm_w8a8            y [M, N] bf16 = gemm_w8a8(a, w): asymmetric activations (zero points), symmetric weights with
//                        their code sums ΣBq, no bias, no clamp
//   cublaslt_int8_gemm   peer rows of gemm_w8a8: C int32 [M, N] = A int8 [M, K] · B int8 [N, K]ᵀ, one cublasLtMatmul
//                        (CUBLAS_COMPUTE_32I, int32 alpha / beta, TN, the heuristic's first algorithm, 32 MiB
//                        workspace): what torch._int_mm runs. No scales: it is the bare int32 product that W8A8 adds
//                        its promotion and epilogue to
//   linear_w8a8          the layer: quantize_per_block(x) then gemm_w8a8 (two launches), from bf16 x to bf16 y
//   cublaslt_bf16_gemm   peer rows of linear_w8a8: y = x · Wᵀ in bf16 (dense bf16 W [N, K]), as
//                        bench/linear_cases.cpp's cublaslt_bf16_linear: fp32 accumulation, bf16 out, TN, the
//                        heuristic's first algorithm
//
// Case names
//   w8a8_quantize   M<m>_K<k>/<g128 | per_token>/bf16      M×K ∈ {4096×4096 g128 and per_token, 16×4096 g128,
//                                                          1×16384 per_token}, all in the default suite
//   gemm_w8a8       <shape>/N<n>_K<k>/M<m>/<format>        format per_channel (block = K: per token × per output
//                   channel) or g128 / g64 / g32 (block-wise); shapes square (N = K = 4096, or 8192) and
//                   llama3_8b_gate_up (N 14336, K 4096)
//     per_channel   square 4096: M 4096, 2048; square 8192: M 8192 (--all); gate_up: M 1, 16, 64, 256
//     g128          square 4096: M 4096; gate_up: M 16
//     g64, g32      square 4096: M 4096 (--all)
//   linear_w8a8     the same names: square 4096 M 4096 and gate_up M 16, per_channel (default) and g128 (--all)
// Every shape has N and K multiples of 16, so cuBLASLt's int8 rule (N and K multiples of 4 for the IMMA kernels on
// CUBLASLT_ORDER_COL operands) holds; a shape it still refuses reads "n/a" with the reason in the notes.
//
// Bytes (each input read once, each output written once): quantize: x (2·M·K) + codes (M·K) + 2 planes
// (4·M·K/block each); gemm: a's codes + scale and zero planes, w's codes + scale and sum planes, y (2·M·N): at M <= 16
// the weight stream is > 99 % of it, so the table's "% read BW" is the weight read against the read ceiling; linear:
// both launches' traffic (the codes and planes of x written by the first and read by the second). FLOPs = 2·M·N·K
// integer multiply-adds: the TFLOP/s column is TOPS, to be read against the dense int8 peak (1979 TOPS on H100 / H200
// SXM; bench/compare.py --ops w8a8 prints the %). Peer rows: the memcpy the quantizer's bytes; cuBLASLt int8 A + B +
// C (int32: 4·M·N); cuBLASLt bf16 2·(M·K + N·K + M·N).
//
// Inputs, generated on the GPU in rotating sets (rotating_sets; never zeros):
//   x   bf16 N(0, 1) times a magnitude 2^U(−2, 2) per 128 consecutive elements (activation channel groups differ)
//   W   bf16 U(−1, 1) times a magnitude 2^U(−1, 1) per output channel
// The GEMM's operands are those quantized on the GPU in setup by tessera's quantize_per_block (x asymmetric, W
// symmetric with its code sums, the layouts gemm_w8a8 reads): no host prepack, nothing large on the host. The peers'
// int8 operands are uniform random bytes.
//
// --check
//   w8a8_quantize   codes poisoned, set 0 quantized; for 16 rows (all when M <= 16; else the first two, the last two,
//                   random ones) the codes, scales and zero points must equal reference::quantize_int8_blocks of the
//                   downloaded x rows bit for bit
//   gemm_w8a8       y poisoned (NaN), set 0 runs; the sampled rows' codes and parameters of a, and those of sampled
//                   output channels of w (all when rows·N·K <= 4e8 multiply-adds, else the first two, the last two
//                   and random ones within that budget) are downloaded into reference::Int8Blocks; y must be finite
//                   and within 4e-3 relative Frobenius error of reference::w8a8_reference (float64 of the dequantized
//                   operands); the sampled channels' code sums must equal the sums of their codes
//   linear_w8a8     both: the quantized x of set 0 against the reference quantizer, and y against w8a8_reference
//   memcpy_d2d      the copy equals its source; cublaslt_int8_gemm: the sampled int32 outputs equal the exact integer
//                   products; cublaslt_bf16_gemm: float64 dot products of the bf16 operands, 4e-3
#include <cublasLt.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/host_numeric.h"
#include "cublaslt_util.h"
#include "device_random.h"
#include "harness.h"
#include "reference/format.h"
#include "reference/w8a8_reference.h"
#include "tessera/w8a8.h"

namespace tessera::bench {
namespace {

using linear::Int8BlockTensor;
using reference::Int8Blocks;

constexpr double kTolerance = 4e-3;        // relative Frobenius error of bf16 y
constexpr int64_t kCheckRows = 16;         // rows of x (and y) --check compares
constexpr double kCheckMacs = 4.0e8;       // multiply-adds of the sampled reference
constexpr int64_t kChannelsPerTask = 256;  // output channels per reference task
constexpr int64_t kMagnitudeRun = 128;     // elements of x sharing one random magnitude
// Any byte is a valid int8 code, so the poison of the codes is one too: an unwritten code passes only where the
// reference code happens to equal it, which an unwritten row or block of a sample never does throughout.
constexpr int kCodePoison = 0xA5;

enum Salt : uint64_t { kX = 1, kW, kCodesA, kCodesB, kCopy };

gen::FloatDist activation_dist() {
  gen::FloatDist d;
  d.kind = gen::FloatDist::kNormal;
  d.row = kMagnitudeRun;
  d.log2_mag_lo = -2.0f;
  d.log2_mag_hi = 2.0f;
  return d;
}

gen::FloatDist weight_dist(int64_t k) {
  gen::FloatDist d;
  d.row = k;
  d.log2_mag_lo = -1.0f;
  d.log2_mag_hi = 1.0f;
  return d;
}

// ============================================================================================================
// problems
struct WeightShape {
  std::string name;  // "llama3_8b_gate_up"
  int64_t n = 0, k = 0;
};

// Bytes of the parameter planes a kernel touches: `planes` fp32 values per (row, block); the ld padding is not read.
double plane_bytes(int planes, int64_t rows, int64_t k, int64_t block) {
  return 4.0 * planes * static_cast<double>(rows) * static_cast<double>(k / block);
}

struct QuantProblem {
  int64_t m = 0, k = 0;
  int64_t block_size = 0;  // 0: one block per row (per token)
  int64_t block() const { return block_size ? block_size : k; }
  double input_bytes() const { return 2.0 * m * k; }
  double bytes() const { return input_bytes() + static_cast<double>(m) * k + plane_bytes(2, m, k, block()); }
  std::string name() const {
    return "M" + std::to_string(m) + "_K" + std::to_string(k) + "/" +
           (block_size ? "g" + std::to_string(block_size) : std::string("per_token")) + "/bf16";
  }
};

struct GemmProblem {
  WeightShape shape;
  int64_t m = 0;
  int64_t block_size = 0;  // 0: one block per row (per token × per output channel)
  int64_t n() const { return shape.n; }
  int64_t k() const { return shape.k; }
  int64_t block() const { return block_size ? block_size : shape.k; }
  // a: codes + scale + zero; w: codes + scale + sums.
  double a_bytes() const { return static_cast<double>(m) * k() + plane_bytes(2, m, k(), block()); }
  double w_bytes() const { return static_cast<double>(n()) * k() + plane_bytes(2, n(), k(), block()); }
  double gemm_input_bytes() const { return a_bytes() + w_bytes(); }
  double gemm_bytes() const { return gemm_input_bytes() + 2.0 * m * n(); }
  // The layer: x in, a written by the quantizer and read by the GEMM, w, y out.
  double linear_input_bytes() const { return 2.0 * m * k() + w_bytes(); }
  double linear_bytes() const { return linear_input_bytes() + 2.0 * a_bytes() + 2.0 * m * n(); }
  double flops() const { return 2.0 * m * n() * k(); }
  std::string name() const {
    return shape.name + "/N" + std::to_string(n()) + "_K" + std::to_string(k()) + "/M" + std::to_string(m) + "/" +
           (block_size ? "g" + std::to_string(block_size) : std::string("per_channel"));
  }
};

// ============================================================================================================
// device operands
// The parameter planes are [K / block, ld] with (row r, block i) at i·ld + r (tessera/w8a8.h).
TensorView plane_view(void* data, int64_t blocks, int64_t rows, int64_t ld, int device) {
  TensorView t;
  t.data = data;
  t.dtype = DType::kFP32;
  t.rank = 2;
  t.shape[0] = blocks;
  t.shape[1] = rows;
  t.strides[0] = ld;
  t.strides[1] = 1;
  t.device = device;
  return t;
}

// A quantized [rows, K] matrix on the device: codes and the block-major planes (zero / sums only where allocated).
struct Int8Operand {
  DeviceBuffer codes, scale, zero, sums;
  int64_t rows = 0, k = 0, block = 0, ld = 0;

  void allocate(int64_t rows_, int64_t k_, int64_t block_, bool with_zero, bool with_sums) {
    rows = rows_, k = k_, block = block_, ld = linear::int8_block_param_ld(rows_);
    codes.allocate(static_cast<std::size_t>(rows * k));
    const std::size_t plane = static_cast<std::size_t>(blocks() * ld) * sizeof(float);
    scale.allocate(plane);
    if (with_zero) zero.allocate(plane);
    if (with_sums) sums.allocate(plane);
  }
  int64_t blocks() const { return k / block; }
  Int8BlockTensor view(int device) const {
    Int8BlockTensor t;
    t.codes = TensorView::contiguous(codes.get(), DType::kInt8, {rows, k}, device);
    t.scale = plane_view(scale.get(), blocks(), rows, ld, device);
    if (zero.get()) t.zero = plane_view(zero.get(), blocks(), rows, ld, device);
    if (sums.get()) t.sums = plane_view(sums.get(), blocks(), rows, ld, device);
    t.block = block;
    return t;
  }
  // Codes + planes poisoned (the planes with NaN), for a check's run.
  void poison(cudaStream_t stream) const {
    codes.fill_async(kCodePoison, stream);
    for (const DeviceBuffer* p : {&scale, &zero, &sums}) p->fill_async(0xFF, stream);
  }
};

// Rows `rows` of a device operand as a reference::Int8Blocks (codes gathered by row; the planes downloaded whole,
// a few MB at most), and the sampled rows' code sums plane ([rows][blocks]; empty when the operand has none).
struct SampledOperand {
  Int8Blocks q;
  std::vector<float> sums;
  int64_t non_integer_zero = 0;  // zero points that are not integers in [−128, 127] (then stored as 0)
};

SampledOperand download_operand(const Int8Operand& op, const std::vector<int64_t>& rows, cudaStream_t stream) {
  SampledOperand s;
  const int64_t R = static_cast<int64_t>(rows.size()), B = op.blocks();
  s.q.rows = R;
  s.q.k = op.k;
  s.q.block = op.block;
  s.q.codes = download_rows<int8_t>(op.codes, op.k, rows, stream);
  s.q.scale.resize(static_cast<std::size_t>(R * B));
  s.q.zero.assign(static_cast<std::size_t>(R * B), 0);
  const std::size_t plane = static_cast<std::size_t>(B * op.ld);
  const std::vector<float> scale = download_range<float>(op.scale, 0, plane, stream);
  const auto plane_or_none = [&](const DeviceBuffer& b) {
    return b.get() ? download_range<float>(b, 0, plane, stream) : std::vector<float>{};
  };
  const std::vector<float> zero = plane_or_none(op.zero), sums = plane_or_none(op.sums);
  if (!sums.empty()) s.sums.resize(static_cast<std::size_t>(R * B));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < B; ++i) {
      const std::size_t from = static_cast<std::size_t>(i * op.ld + rows[r]), to = static_cast<std::size_t>(r * B + i);
      s.q.scale[to] = scale[from];
      if (!zero.empty()) {
        const float z = zero[from];
        if (z == std::rint(z) && z >= -128.f && z <= 127.f)
          s.q.zero[to] = static_cast<int32_t>(z);
        else
          ++s.non_integer_zero;
      }
      if (!sums.empty()) s.sums[to] = sums[from];
    }
  return s;
}

// ============================================================================================================
// --check helpers
std::vector<int64_t> check_rows(int64_t m, uint64_t seed) { return sample_indices(m, kCheckRows, 2, seed); }

// Output channels within the reference budget for `rows` rows: all, or the first two, the last two and random ones.
std::vector<int64_t> check_channels(int64_t n, int64_t rows, int64_t k, uint64_t seed) {
  const int64_t budget = static_cast<int64_t>(kCheckMacs / (static_cast<double>(rows) * static_cast<double>(k)));
  return sample_indices(n, std::max<int64_t>(budget, 4), 2, seed);
}

std::vector<float> bf16_rows_as_float(const DeviceBuffer& b, int64_t k, const std::vector<int64_t>& rows,
                                      cudaStream_t stream) {
  const std::vector<uint16_t> raw = download_rows<uint16_t>(b, k, rows, stream);
  std::vector<float> out(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) out[i] = host::bf16_to_f32(raw[i]);
  return out;
}

// Device quantization of sampled rows against reference::quantize_int8_blocks of their x: codes, scales (bits) and
// zero points must be equal. error = mismatching values / compared values.
CheckResult compare_quantized(const SampledOperand& got, const std::vector<float>& x, const std::vector<int64_t>& rows,
                              bool symmetric, const std::string& what) {
  const Int8Blocks& g = got.q;
  const Int8Blocks want = reference::quantize_int8_blocks(x, g.rows, g.k, g.block, symmetric);
  const int64_t B = g.blocks();
  int64_t bad_codes = 0, bad_scales = 0, bad_zeros = got.non_integer_zero;
  std::string first;
  for (int64_t r = 0; r < g.rows; ++r)
    for (int64_t c = 0; c < g.k; ++c)
      if (g.codes[r * g.k + c] != want.codes[r * g.k + c] && bad_codes++ == 0)
        first = "row " + std::to_string(rows[r]) + " column " + std::to_string(c) + ": code " +
                std::to_string(g.codes[r * g.k + c]) + ", reference " + std::to_string(want.codes[r * g.k + c]);
  for (int64_t p = 0; p < g.rows * B; ++p) {
    if (host::f32_bits(g.scale[p]) != host::f32_bits(want.scale[p]) && bad_scales++ == 0 && first.empty())
      first = "row " + std::to_string(rows[p / B]) + " block " + std::to_string(p % B) + ": scale " +
              reference::detail::fmt(g.scale[p]) + ", reference " + reference::detail::fmt(want.scale[p]);
    if (g.zero[p] != want.zero[p]) ++bad_zeros;
  }
  CheckResult res;
  res.compared = g.rows * (g.k + 2 * B);
  const int64_t bad = bad_codes + bad_scales + bad_zeros;
  res.error = static_cast<double>(bad) / static_cast<double>(std::max<int64_t>(res.compared, 1));
  res.ok = bad == 0 && res.compared > 0;
  res.message = what + (res.ok ? ": codes, scales and zero points bit-exact with reference::quantize_int8_blocks"
                               : ": " + std::to_string(bad_codes) + " codes, " + std::to_string(bad_scales) +
                                     " scales, " + std::to_string(bad_zeros) +
                                     " zero points differ from reference::quantize_int8_blocks" +
                                     (first.empty() ? "" : " (first: " + first + ")"));
  return res;
}

// Rows [c0, c1) of a sampled operand.
Int8Blocks slice_rows(const Int8Blocks& q, int64_t c0, int64_t c1) {
  const int64_t B = q.blocks();
  Int8Blocks s;
  s.rows = c1 - c0;
  s.k = q.k;
  s.block = q.block;
  s.codes.assign(q.codes.begin() + c0 * q.k, q.codes.begin() + c1 * q.k);
  s.scale.assign(q.scale.begin() + c0 * B, q.scale.begin() + c1 * B);
  s.zero.assign(q.zero.begin() + c0 * B, q.zero.begin() + c1 * B);
  return s;
}

// y (bf16 [R][N], the sampled rows) at the sampled channels against reference::w8a8_reference(a, w), where w holds
// the sampled channels' rows; and the channels' code sums (when w has them) against the sums of their codes.
CheckResult check_gemm_sample(const SampledOperand& a, const SampledOperand& w, const std::vector<uint16_t>& y,
                              int64_t n, const std::vector<int64_t>& channels, const std::string& what) {
  const int64_t R = a.q.rows, C = w.q.rows, B = w.q.blocks();
  const int64_t chunks = (C + kChannelsPerTask - 1) / kChannelsPerTask;
  const double work = static_cast<double>(R) * C * a.q.k;
  const ErrorSum total = parallel_error_sum(chunks, work, [&](int64_t t, ErrorSum& sum) {
    const int64_t c0 = t * kChannelsPerTask, c1 = std::min(C, c0 + kChannelsPerTask);
    const std::vector<double> ref = reference::w8a8_reference(a.q, slice_rows(w.q, c0, c1));  // [R][c1 − c0]
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = c0; c < c1; ++c)
        sum.add(host::bf16_to_f32(y[i * n + channels[c]]), ref[i * (c1 - c0) + (c - c0)]);
  });
  CheckResult res = total.result(what, kTolerance);
  int64_t bad_sums = w.non_integer_zero + a.non_integer_zero;
  if (!w.sums.empty()) {
    const std::vector<int32_t> want = reference::block_code_sums(w.q);
    for (int64_t p = 0; p < C * B; ++p) bad_sums += w.sums[p] != static_cast<float>(want[p]);
  }
  if (bad_sums) {
    res.ok = false;
    res.message += "; " + std::to_string(bad_sums) +
                   " weight code sums (or zero points) of the sampled channels disagree with their codes: the "
                   "operands quantize_per_block prepared in setup are inconsistent";
  }
  return res;
}

// ============================================================================================================
// tessera: w8a8_quantize
class QuantizeCase final : public CaseInstance {
 public:
  QuantizeCase(const DeviceContext& ctx, const std::string& op, const QuantProblem& p) : p_(p), device_(ctx.device) {
    sets_ = rotating_sets(ctx, p.input_bytes());
    for (int s = 0; s < sets_; ++s) {
      x_.emplace_back(static_cast<std::size_t>(p.m * p.k * 2));
      gen::fill_float(x_.back().get(), DType::kBF16, p.m * p.k, gen::sub_seed(case_seed(op, p.name(), s), kX),
                      activation_dist(), ctx.stream);
    }
    out_.allocate(p.m, p.k, p.block(), /*with_zero=*/true, /*with_sums=*/false);
    out_view_ = out_.view(device_);
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    linear::quantize_per_block(TensorView::contiguous(x_[set].get(), DType::kBF16, {p_.m, p_.k}, device_), out_view_,
                               stream);
  }

  CheckResult check(cudaStream_t stream) override {
    out_.poison(stream);
    run(stream, 0);
    const std::vector<int64_t> rows = check_rows(p_.m, 0x0A7Bull);
    const SampledOperand got = download_operand(out_, rows, stream);
    return compare_quantized(got, bf16_rows_as_float(x_[0], p_.k, rows, stream), rows, /*symmetric=*/false,
                             describe_sample(rows, p_.m, "rows"));
  }

 private:
  QuantProblem p_;
  int device_;
  int sets_ = 1;
  std::vector<DeviceBuffer> x_;
  Int8Operand out_;
  Int8BlockTensor out_view_;
};

// ============================================================================================================
// tessera: gemm_w8a8 and linear_w8a8 (quantize + GEMM)
class GemmCase final : public CaseInstance {
 public:
  // with_quantize: the layer (linear_w8a8): each call quantizes its set's x into a shared operand first.
  GemmCase(const DeviceContext& ctx, const std::string& op, const GemmProblem& p, bool with_quantize)
      : p_(p), device_(ctx.device), with_quantize_(with_quantize) {
    const int64_t M = p.m, N = p.n(), K = p.k(), block = p.block();
    sets_ = rotating_sets(ctx, with_quantize ? p.linear_input_bytes() : p.gemm_input_bytes());
    DeviceBuffer w_bf16(static_cast<std::size_t>(N * K * 2)), x_tmp;
    if (!with_quantize) x_tmp.allocate(static_cast<std::size_t>(M * K * 2));
    if (with_quantize) a_shared_.allocate(M, K, block, /*with_zero=*/true, /*with_sums=*/false);
    for (int s = 0; s < sets_; ++s) {
      const uint64_t seed = case_seed(op, p.name(), s);
      Set set;
      set.w.allocate(N, K, block, /*with_zero=*/false, /*with_sums=*/true);
      gen::fill_float(w_bf16.get(), DType::kBF16, N * K, gen::sub_seed(seed, kW), weight_dist(K), ctx.stream);
      linear::quantize_per_block(TensorView::contiguous(w_bf16.get(), DType::kBF16, {N, K}, device_),
                                 set.w.view(device_), ctx.stream);
      if (with_quantize) {
        set.x.allocate(static_cast<std::size_t>(M * K * 2));
        gen::fill_float(set.x.get(), DType::kBF16, M * K, gen::sub_seed(seed, kX), activation_dist(), ctx.stream);
      } else {
        set.a.allocate(M, K, block, /*with_zero=*/true, /*with_sums=*/false);
        gen::fill_float(x_tmp.get(), DType::kBF16, M * K, gen::sub_seed(seed, kX), activation_dist(), ctx.stream);
        linear::quantize_per_block(TensorView::contiguous(x_tmp.get(), DType::kBF16, {M, K}, device_),
                                   set.a.view(device_), ctx.stream);
      }
      sets_data_.push_back(std::move(set));
    }
    for (Set& set : sets_data_) {
      set.wv = set.w.view(device_);
      set.av = with_quantize ? a_shared_.view(device_) : set.a.view(device_);
      if (with_quantize) set.xv = TensorView::contiguous(set.x.get(), DType::kBF16, {M, K}, device_);
    }
    y_.allocate(static_cast<std::size_t>(M * N * 2));
    y_view_ = TensorView::contiguous(y_.get(), DType::kBF16, {M, N}, device_);
    workspace_bytes_ = linear::gemm_w8a8_workspace_bytes(M, N, K, block);
    workspace_.allocate(workspace_bytes_);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));  // the bf16 temporaries go out of scope
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    if (with_quantize_) linear::quantize_per_block(s.xv, s.av, stream);
    linear::gemm_w8a8(s.av, s.wv, y_view_, linear::W8A8Epilogue{}, Workspace{workspace_.get(), workspace_bytes_},
                      stream);
  }

  CheckResult check(cudaStream_t stream) override {
    y_.fill_async(0xFF, stream);  // bf16 NaN
    if (with_quantize_) a_shared_.poison(stream);
    run(stream, 0);
    const Set& set = sets_data_[0];
    const int64_t N = p_.n(), K = p_.k();
    const std::vector<int64_t> rows = check_rows(p_.m, 0x11EA5ull);
    const std::vector<int64_t> channels = check_channels(N, static_cast<int64_t>(rows.size()), K, 0xC015ull);
    const std::vector<uint16_t> y = download_rows<uint16_t>(y_, N, rows, stream);
    const SampledOperand a = download_operand(with_quantize_ ? a_shared_ : set.a, rows, stream);
    const SampledOperand w = download_operand(set.w, channels, stream);
    const std::string what =
        describe_sample(rows, p_.m, "rows") + " x " + describe_sample(channels, N, "output channels");
    const CheckResult gemm = check_gemm_sample(a, w, y, N, channels, what);
    if (!with_quantize_) return gemm;
    const CheckResult quant = compare_quantized(a, bf16_rows_as_float(set.x, K, rows, stream), rows,
                                                /*symmetric=*/false, describe_sample(rows, p_.m, "rows of x"));
    return merge_checks({quant, gemm}, {"quantize_per_block", "gemm_w8a8"},
                        quant.message + "; y: " + gemm.message);
  }

 private:
  struct Set {
    Int8Operand a, w;  // a: gemm_w8a8 only
    DeviceBuffer x;    // bf16 x: linear_w8a8 only
    Int8BlockTensor av, wv;
    TensorView xv;
  };
  GemmProblem p_;
  int device_;
  bool with_quantize_;
  int sets_ = 1;
  std::vector<Set> sets_data_;
  Int8Operand a_shared_;  // linear_w8a8: the quantizer's output, the GEMM's input
  DeviceBuffer y_, workspace_;
  TensorView y_view_;
  std::size_t workspace_bytes_ = 0;
};

// ============================================================================================================
// peer: memcpy_d2d of the quantizer's bytes (half read, half written)
class MemcpyCase final : public CaseInstance {
 public:
  MemcpyCase(const DeviceContext& ctx, const std::string& op, const std::string& name, double bytes)
      : half_((static_cast<std::size_t>(bytes / 2) + 15) / 16 * 16) {
    sets_ = rotating_sets(ctx, static_cast<double>(half_));
    for (int s = 0; s < sets_; ++s) {
      src_.emplace_back(half_);
      gen::fill_int(src_.back().as<int32_t>(), static_cast<int64_t>(half_ / 4),
                    gen::sub_seed(case_seed(op, name, s), kCopy), INT32_MIN, INT32_MAX, ctx.stream);
    }
    dst_.allocate(half_);
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst_.get(), src_[set].get(), half_, cudaMemcpyDeviceToDevice, stream));
  }

  CheckResult check(cudaStream_t stream) override {
    dst_.fill_async(0xFF, stream);
    run(stream, 0);
    const std::vector<uint8_t> got = dst_.download<uint8_t>(half_, stream);
    const std::vector<uint8_t> want = src_[0].download<uint8_t>(half_, stream);
    CheckResult r;
    r.compared = static_cast<int64_t>(half_);
    r.ok = std::memcmp(got.data(), want.data(), half_) == 0;
    r.error = r.ok ? 0.0 : 1.0;
    r.message = std::to_string(half_) + " bytes copied, " + (r.ok ? "equal to" : "NOT equal to") + " the source";
    return r;
  }

 private:
  std::size_t half_;
  int sets_ = 1;
  std::vector<DeviceBuffer> src_;
  DeviceBuffer dst_;
};

// ============================================================================================================
// cuBLASLt peers. Both compute yᵀ [N, M] = W [N, K] · xᵀ in column-major terms: A = W stored K x N (ld K, = row-major
// [N, K]) with transa = T; B = x stored K x M (ld K) with transb = N; D = y stored N x M (ld N, = row-major [M, N]).
struct DenseShape {
  int64_t m = 0, n = 0, k = 0;
  int elem_bytes = 1;  // of A and B
  int out_bytes = 4;   // of D
  double input_bytes() const { return elem_bytes * (static_cast<double>(n) * k + static_cast<double>(m) * k); }
  double bytes() const { return input_bytes() + static_cast<double>(out_bytes) * m * n; }
  double flops() const { return 2.0 * m * n * k; }
  std::string dims() const {
    return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k);
  }
};

// int8 × int8 → int32 (CUBLAS_COMPUTE_32I) or bf16 × bf16 → bf16 (CUBLAS_COMPUTE_32F).
class CublasLtCase final : public CaseInstance {
 public:
  CublasLtCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const DenseShape& sh,
               bool int8)
      : sh_(sh), int8_(int8) {
    // cuBLASLt's IMMA kernels on CUBLASLT_ORDER_COL operands: leading dimensions and the m, k of the problem (here
    // N and K) multiples of 4, 4-byte aligned pointers (cudaMalloc gives 256).
    if (int8 && (sh.n % 4 != 0 || sh.k % 4 != 0))
      throw Unsupported("cuBLASLt int8 (IMMA, TN, column order) needs N and K multiples of 4, got " + sh.dims());
    const cudaDataType_t in = int8 ? CUDA_R_8I : CUDA_R_16BF, out = int8 ? CUDA_R_32I : CUDA_R_16BF;
    create_tn_matmul(handle_, desc_, int8 ? CUBLAS_COMPUTE_32I : CUBLAS_COMPUTE_32F, int8 ? CUDA_R_32I : CUDA_R_32F);
    a_ = make_layout(in, sh.k, sh.n, sh.k);
    b_ = make_layout(in, sh.k, sh.m, sh.k);
    d_ = make_layout(out, sh.n, sh.m, sh.n);
    if (!first_heuristic_algo(handle_, desc_, a_, b_, d_, algo_))
      throw Unsupported(std::string("cuBLASLt has no ") + (int8 ? "int8 (COMPUTE_32I)" : "bf16") +
                        " algorithm for " + sh.dims());

    sets_ = rotating_sets(ctx, sh.input_bytes());
    for (int s = 0; s < sets_; ++s) {
      const uint64_t seed = case_seed(op, name, s);
      Set set;
      set.w.allocate(padded(sh.n * sh.k * sh.elem_bytes));
      set.x.allocate(padded(sh.m * sh.k * sh.elem_bytes));
      if (int8) {
        gen::fill_int(set.w.as<int32_t>(), static_cast<int64_t>(set.w.bytes() / 4), gen::sub_seed(seed, kCodesB),
                      INT32_MIN, INT32_MAX, ctx.stream);
        gen::fill_int(set.x.as<int32_t>(), static_cast<int64_t>(set.x.bytes() / 4), gen::sub_seed(seed, kCodesA),
                      INT32_MIN, INT32_MAX, ctx.stream);
      } else {
        gen::fill_float(set.w.get(), DType::kBF16, sh.n * sh.k, gen::sub_seed(seed, kW), weight_dist(sh.k),
                        ctx.stream);
        gen::fill_float(set.x.get(), DType::kBF16, sh.m * sh.k, gen::sub_seed(seed, kX), activation_dist(),
                        ctx.stream);
      }
      sets_data_.push_back(std::move(set));
    }
    y_.allocate(static_cast<std::size_t>(sh.m * sh.n * sh.out_bytes));
    workspace_.allocate(kLtWorkspaceBytes);
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    const int32_t alpha_i = 1, beta_i = 0;
    const float alpha_f = 1.0f, beta_f = 0.0f;
    const void* alpha = int8_ ? static_cast<const void*>(&alpha_i) : static_cast<const void*>(&alpha_f);
    const void* beta = int8_ ? static_cast<const void*>(&beta_i) : static_cast<const void*>(&beta_f);
    BENCH_CUBLAS_CHECK(cublasLtMatmul(handle_.get(), desc_.get(), alpha, s.w.get(), a_.get(), s.x.get(), b_.get(),
                                       beta, y_.get(), d_.get(), y_.get(), d_.get(), &algo_, workspace_.get(),
                                       kLtWorkspaceBytes, stream));
  }

  CheckResult check(cudaStream_t stream) override {
    y_.fill_async(0xFF, stream);
    run(stream, 0);
    const int64_t K = sh_.k, N = sh_.n;
    const std::vector<int64_t> rows = check_rows(sh_.m, 0x11EA5ull);
    const int64_t R = static_cast<int64_t>(rows.size());
    const std::vector<int64_t> cols = check_channels(N, R, K, 0xC015ull);
    const int64_t C = static_cast<int64_t>(cols.size());
    const Set& set = sets_data_[0];
    const std::string what = describe_sample(rows, sh_.m, "rows") + " x " + describe_sample(cols, N, "output channels");
    if (int8_) {
      const std::vector<int32_t> y = download_rows<int32_t>(y_, N, rows, stream);
      const std::vector<int8_t> x = download_rows<int8_t>(set.x, K, rows, stream);
      const std::vector<int8_t> w = download_rows<int8_t>(set.w, K, cols, stream);
      std::vector<int64_t> bad(R, 0), worst(R, 0);
      parallel_for(R, static_cast<double>(R) * C * K, [&](int64_t i) {
        for (int64_t c = 0; c < C; ++c) {
          int64_t acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += int64_t{x[i * K + k]} * w[c * K + k];
          const int64_t diff = std::llabs(acc - y[i * N + cols[c]]);
          bad[i] += diff != 0;
          worst[i] = std::max(worst[i], diff);
        }
      });
      CheckResult r;
      r.compared = R * C;
      int64_t mismatches = 0;
      for (int64_t i = 0; i < R; ++i) mismatches += bad[i], r.error = std::max(r.error, static_cast<double>(worst[i]));
      r.ok = mismatches == 0;
      r.message = what + ": int32 outputs " +
                  (r.ok ? std::string("equal to the exact integer products")
                        : std::to_string(mismatches) + " differ from the exact integer products (largest difference " +
                              reference::detail::fmt(r.error) + ")");
      return r;
    }
    const std::vector<uint16_t> y = download_rows<uint16_t>(y_, N, rows, stream);
    const std::vector<float> x = bf16_rows_as_float(set.x, K, rows, stream);
    const std::vector<float> w = bf16_rows_as_float(set.w, K, cols, stream);
    const ErrorSum total = parallel_error_sum(R, static_cast<double>(R) * C * K, [&](int64_t i, ErrorSum& sum) {
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[i * K + k]) * w[c * K + k];
        sum.add(host::bf16_to_f32(y[i * N + cols[c]]), acc);
      }
    });
    return total.result(what + ", dense bf16 W", kTolerance);
  }

 private:
  static std::size_t padded(int64_t bytes) { return (static_cast<std::size_t>(bytes) + 15) / 16 * 16; }
  struct Set {
    DeviceBuffer w, x;
  };
  DenseShape sh_;
  bool int8_;
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
constexpr const char* kQuantOp = "w8a8_quantize";
constexpr const char* kCopyPeer = "memcpy_d2d";
constexpr const char* kGemmOp = "gemm_w8a8";
constexpr const char* kInt8Peer = "cublaslt_int8_gemm";
constexpr const char* kLinearOp = "linear_w8a8";
constexpr const char* kBf16Peer = "cublaslt_bf16_gemm";

void add_w8a8_cases(std::vector<CaseSpec>& cases) {
  const auto add = [&](CaseSpec c) { cases.push_back(std::move(c)); };
  const auto peer_spec = [](const char* op, const std::string& name, bool headline, double bytes, double flops,
                            const char* of) {
    CaseSpec c;
    c.op = op;
    c.name = name;
    c.headline = headline;
    c.bytes = bytes;
    c.flops = flops;
    c.peer_of = {of};
    return c;
  };

  // w8a8_quantize, each with its memcpy of the same bytes
  for (const QuantProblem& p : {QuantProblem{4096, 4096, 128}, QuantProblem{4096, 4096, 0}, QuantProblem{16, 4096, 128},
                                QuantProblem{1, 16384, 0}}) {
    CaseSpec c;
    c.op = kQuantOp;
    c.name = p.name();
    c.headline = true;
    c.bytes = p.bytes();
    c.setup = [p](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<QuantizeCase>(ctx, kQuantOp, p);
    };
    add(c);
    CaseSpec peer = peer_spec(kCopyPeer, c.name, c.headline, c.bytes, 0.0, kQuantOp);
    const std::string name = c.name;
    const double bytes = c.bytes;
    peer.setup = [name, bytes](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<MemcpyCase>(ctx, kCopyPeer, name, bytes);
    };
    add(peer);
  }

  const WeightShape square4096{"square", 4096, 4096}, square8192{"square", 8192, 8192},
      gate_up{"llama3_8b_gate_up", 14336, 4096};
  struct Row {
    WeightShape shape;
    int64_t m;
    int64_t block;  // 0: per_channel
    bool headline;
  };
  const std::vector<Row> gemm_rows = {
      {square4096, 4096, 0, true},   {square4096, 2048, 0, true}, {square8192, 8192, 0, false},
      {gate_up, 1, 0, true},         {gate_up, 16, 0, true},      {gate_up, 64, 0, true},
      {gate_up, 256, 0, true},       {square4096, 4096, 128, true}, {gate_up, 16, 128, true},
      {square4096, 4096, 64, false}, {square4096, 4096, 32, false},
  };
  const std::vector<Row> linear_rows = {
      {square4096, 4096, 0, true},
      {gate_up, 16, 0, true},
      {square4096, 4096, 128, false},
      {gate_up, 16, 128, false},
  };

  // gemm_w8a8 with the cuBLASLt int8 product, linear_w8a8 with the cuBLASLt bf16 GEMM
  for (const bool layer : {false, true}) {
    for (const Row& row : layer ? linear_rows : gemm_rows) {
      const GemmProblem p{row.shape, row.m, row.block};
      if (p.n() % 16 != 0 || p.k() % 128 != 0)
        throw Error("tessera-bench: W8A8 shapes must have N % 16 == 0 and K % 128 == 0");
      const char* op = layer ? kLinearOp : kGemmOp;
      CaseSpec c;
      c.op = op;
      c.name = p.name();
      c.headline = row.headline;
      c.bytes = layer ? p.linear_bytes() : p.gemm_bytes();
      c.flops = p.flops();
      c.setup = [p, op, layer](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
        return std::make_unique<GemmCase>(ctx, op, p, layer);
      };
      add(c);

      const DenseShape dense{p.m, p.n(), p.k(), layer ? 2 : 1, layer ? 2 : 4};
      const char* peer_op = layer ? kBf16Peer : kInt8Peer;
      CaseSpec peer = peer_spec(peer_op, c.name, c.headline, dense.bytes(), dense.flops(), op);
      const std::string name = c.name;
      peer.setup = [dense, name, peer_op, layer](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
        return std::make_unique<CublasLtCase>(ctx, peer_op, name, dense, /*int8=*/!layer);
      };
      add(peer);
    }
  }
}

}  // namespace

TESSERA_BENCH_CASES(add_w8a8_cases);

}  // namespace tessera::bench
