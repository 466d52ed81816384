// tessera-bench cases for the grouped GEMM of MoE experts (tessera/grouped_gemm.h), and their cuBLASLt peers.
//
//   grouped_gemm_fp8          contiguous layout, e4m3 x e4m3 -> bf16; case names end in /tensor (per-tensor
//                             scales) or /block (DeepSeek-V3 block-wise scales: 1x128 on X, 128x128 on W)
//   grouped_gemm_fp8_masked   masked layout, decode shapes only: buffers of max_m rows per group (4 x rows for
//                             the uniform ones, T for dsv3_decode_routed), masked_m = rows
//   grouped_gemm_bf16(_masked) bf16 x bf16 -> bf16, same shapes
//   cublaslt_fp8_loop         peer of the two fp8 ops (same case names): one cublasLtMatmul per non-empty group,
//                             e4m3 in, bf16 out, fp32 compute, the same scale modes
//   cublaslt_bf16_loop        peer of the two bf16 ops
// The group sizes are host data here (the routed shapes' come from tessera's gate once, in setup, before timing),
// so the peer loop launches exactly the GEMMs that have rows; the loop is
// captured into the same CUDA graph tessera's calls are. X, W and the scales are generated on the GPU (make_inputs);
// --check compares a sample of rows and columns that covers every group (check_grouped).
//
// Shapes (groups x rows per group, N, K):
//   dsv3_gate_up       32 x {8, 128, 1024}, 4096, 7168      dsv3_down   32 x 1024, 7168, 2048
//   qwen3_gate_up     128 x 256, 1536, 2048                 qwen3_down_decode   128 x 4, 2048, 768
//   mixtral_down_decode  2 x 1, 4096, 14336                 dsv3_gate_up_t1   9 x 1, 4096, 7168
//   dense               1 x 8192, 8192, 8192 (the cuBLASLt row: the run's measured tensor ceiling)
//   skewed_zipf       128 groups, Zipf-like sizes with 16 empty groups, 32768 rows in all, 1536, 2048
//   skew_one_big      256 groups, 250 empty; group 37 has 1000 rows, five others 3, 1, 12, 6, 2 (M 1024), 2048, 7168
//   dsv3_gate_up_routed  T 4096 tokens routed by tessera's DeepSeek-V3 gate (E 256, top-8): 32768 rows over the
//                        256 experts (1 to 559 rows each), 4096, 7168
//   dsv3_decode_routed   the same gate on T 64 tokens (decode): 512 rows; 172 non-empty groups, 137 of them with
//                        1-4 rows, the largest 11; 4096, 7168; masked variants with max_m = T = 64 (a token picks an
//                        expert at most once)
// The routed shapes' group sizes (named by T: "/T4096") are the rows per expert of tessera's moe::fused_gate, run on
// the GPU in setup (once per process, routing_rows.h), on logits built from integers so that C++ and
// bench/peers/gemm.py have the same fp32 values bit for bit: from the splitmix64 stream of seed 0xD5E3, per token
// and expert an Irwin-Hall noise of std ~1.44 plus a per-expert popularity bias in [-0.5, 0.5) (the skew), the
// gate's correction bias in [-1/16, 1/16); routing_rows.h spells out the draws. Both sides run the same kernel on the
// same inputs, so they get the same sizes. Until setup has run the gate, a routed shape holds placeholder sizes
// (T·8 rows spread evenly): --list shows the bytes of that (every group non-empty, an upper bound); setup writes the
// exact bytes into the case's registry entry, which the report and the JSON read.
//
// FLOPs = 2 * sum(rows) * N * K. Bytes = weights of the non-empty groups + the X rows groups own + the Y rows
// they write + scales + group sizes. For the decode shapes the weights are > 99 % of the bytes, so "% copy BW"
// is the weight stream against the measured copy ceiling.
#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "common/host_numeric.h"
#include "cublaslt_util.h"
#include "device_random.h"
#include "harness.h"
#include "reference/gemm_reference.h"
#include "reference/moe_checks.h"
#include "routing_rows.h"
#include "tessera/grouped_gemm.h"

namespace tessera::bench {
namespace {

constexpr int64_t kBlock = gemm::kGroupedGemmBlock;  // 128: scale block along K (and N for the weights)

// ============================================================================================================
// shapes and variants
enum class Operand { kFP8, kBF16 };
enum class Scale { kNone, kPerTensor, kBlockwise };

struct Variant {
  Operand operand = Operand::kFP8;
  Scale scale = Scale::kPerTensor;
  bool masked = false;
  bool fp8() const { return operand == Operand::kFP8; }
};

struct GemmShape {
  std::string name;           // "dsv3_gate_up/m8"
  int groups = 0;
  int64_t n = 0, k = 0;
  std::vector<int32_t> rows;  // rows of each group
  int64_t max_m = 0;          // masked layout: rows per group in the buffers (0: no masked variant)
  int64_t routed_tokens = 0;  // > 0: rows are tessera's gate's on that many tokens (routing_rows.h), set in setup;
                              // until then a placeholder with the same total, every group non-empty
  uint64_t routed_seed = 0;

  int64_t total_rows() const { return std::accumulate(rows.begin(), rows.end(), int64_t{0}); }
  int nonempty() const {
    return static_cast<int>(std::count_if(rows.begin(), rows.end(), [](int32_t r) { return r > 0; }));
  }
  int64_t kb() const { return k / kBlock; }
  int64_t nb() const { return n / kBlock; }
  int64_t max_rows() const { return *std::max_element(rows.begin(), rows.end()); }
  // Rows of the X / Y buffers and where group g starts in them.
  int64_t buffer_rows(bool masked) const { return masked ? groups * max_m : total_rows(); }
  std::vector<int64_t> row_start(bool masked) const {
    std::vector<int64_t> start(groups);
    int64_t acc = 0;
    for (int g = 0; g < groups; ++g) {
      start[g] = masked ? g * max_m : acc;
      acc += rows[g];
    }
    return start;
  }
};

std::size_t elt(Operand o) { return o == Operand::kFP8 ? 1 : 2; }

// Bytes one call must move (see the header comment).
double gemm_bytes(const GemmShape& sh, const Variant& v) {
  const double m = static_cast<double>(sh.total_rows()), n = sh.n, k = sh.k, e = static_cast<double>(elt(v.operand));
  double bytes = sh.nonempty() * n * k * e + m * k * e + m * n * 2.0;
  if (v.scale == Scale::kPerTensor) bytes += 4.0 + 4.0 * sh.groups;
  if (v.scale == Scale::kBlockwise) bytes += m * sh.kb() * 4.0 + sh.nonempty() * sh.nb() * sh.kb() * 4.0;
  bytes += (v.masked ? sh.groups : sh.groups + 1) * 4.0;
  return bytes;
}
double gemm_flops(const GemmShape& sh) { return 2.0 * static_cast<double>(sh.total_rows()) * sh.n * sh.k; }

// Zipf-like group sizes: `empty` random groups get no rows, the others (in random order) get total * r^-s / H
// rows for rank r, rounded down, the remainder going to the largest ones.
std::vector<int32_t> zipf_rows(int groups, int64_t total, int empty, double s, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> order(groups);
  std::iota(order.begin(), order.end(), 0);
  for (int i = groups - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  const int ranked = groups - empty;
  std::vector<double> w(ranked);
  for (int r = 0; r < ranked; ++r) w[r] = std::pow(r + 1.0, -s);
  const double sum = std::accumulate(w.begin(), w.end(), 0.0);
  std::vector<int32_t> rows(groups, 0);
  int64_t used = 0;
  for (int r = 0; r < ranked; ++r) {
    rows[order[empty + r]] = static_cast<int32_t>(std::floor(total * w[r] / sum));
    used += rows[order[empty + r]];
  }
  for (int r = 0; used < total; r = (r + 1) % ranked, ++used) ++rows[order[empty + r]];
  return rows;
}

// ============================================================================================================
// inputs, generated on the GPU (device_random.h) in tessera's layouts: X / Y rows as shape.buffer_rows(masked)
// (rows that no group owns are filled too); fp8 e4m3 bytes with magnitudes roughly uniform in (0, 448], bf16
// uniform in (-1, 1). Scales: per-tensor xs [1] 2^U(-9, -7), ws [G] 2^U(-11, -9); block-wise xs [rows, K/128]
// 2^U(-10, -6), ws [G, N/128, K/128] 2^U(-12, -8), row-major: products of order 1.
struct DeviceInputs {
  DeviceBuffer x, w, xs, ws;
};

enum Salt : uint64_t { kX = 1, kW, kXs, kWs };

int64_t x_scale_count(const GemmShape& sh, const Variant& v) {
  return v.scale == Scale::kBlockwise ? sh.buffer_rows(v.masked) * sh.kb() : v.scale == Scale::kPerTensor ? 1 : 0;
}
int64_t w_scale_count(const GemmShape& sh, const Variant& v) {
  return v.scale == Scale::kBlockwise ? int64_t{sh.groups} * sh.nb() * sh.kb()
                                      : v.scale == Scale::kPerTensor ? sh.groups : 0;
}

DeviceInputs make_inputs(const GemmShape& sh, const Variant& v, uint64_t seed, cudaStream_t stream) {
  DeviceInputs d;
  const int64_t x_count = sh.buffer_rows(v.masked) * sh.k, w_count = int64_t{sh.groups} * sh.n * sh.k;
  d.x.allocate(x_count * elt(v.operand));
  d.w.allocate(w_count * elt(v.operand));
  if (v.fp8()) {
    gen::fill_e4m3(d.x.as<uint8_t>(), x_count, gen::sub_seed(seed, kX), stream);
    gen::fill_e4m3(d.w.as<uint8_t>(), w_count, gen::sub_seed(seed, kW), stream);
  } else {
    gen::fill_float(d.x.get(), DType::kBF16, x_count, gen::sub_seed(seed, kX), {}, stream);
    gen::fill_float(d.w.get(), DType::kBF16, w_count, gen::sub_seed(seed, kW), {}, stream);
  }
  if (v.scale != Scale::kNone) {
    const bool block = v.scale == Scale::kBlockwise;
    d.xs.allocate(x_scale_count(sh, v) * 4);
    d.ws.allocate(w_scale_count(sh, v) * 4);
    gen::fill_exp2(d.xs.as<float>(), x_scale_count(sh, v), gen::sub_seed(seed, kXs), block ? -10.0f : -9.0f,
                   block ? -6.0f : -7.0f, stream);
    gen::fill_exp2(d.ws.as<float>(), w_scale_count(sh, v), gen::sub_seed(seed, kWs), block ? -12.0f : -11.0f,
                   block ? -8.0f : -9.0f, stream);
  }
  return d;
}

std::size_t input_bytes(const GemmShape& sh, const Variant& v) {
  std::size_t b = (sh.buffer_rows(v.masked) + sh.groups * sh.n) * sh.k * elt(v.operand);
  if (v.scale == Scale::kBlockwise) b += (sh.buffer_rows(v.masked) + sh.groups * sh.nb()) * sh.kb() * 4;
  return b;
}

// ============================================================================================================
// --check: the float64 reference (reference/gemm_reference.h) on a sample that covers every group and both ends of
// every dimension, with set 0's inputs downloaded from the GPU:
//   columns  every 128-column block when N <= kCheckColBlocks·128, else the first and the last block and random
//            ones, kCheckColBlocks in all (the same blocks for every group; block-wise W scales follow them);
//   rows     every row when the problem within those columns is at most kCheckMacs multiply-adds, and always for the
//            masked layout (its rows past masked_m must keep the poison: the whole [G, max_m] buffer is compared);
//            else per non-empty group its first and last row and rows evenly spread between, as many as the budget
//            gives every group.
constexpr double kCheckMacs = 1.0e9;
constexpr int64_t kCheckColBlocks = 4;

// Rows of a group of m rows the check compares: `count` of them spread evenly, always the first and the last.
std::vector<int64_t> pick_rows(int64_t m, int64_t count) {
  std::vector<int64_t> out;
  if (m <= 0) return out;
  count = std::clamp<int64_t>(count, std::min<int64_t>(m, 2), m);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t r = count == 1 ? 0 : (j * (m - 1) + (count - 1) / 2) / (count - 1);
    if (out.empty() || out.back() != r) out.push_back(r);
  }
  return out;
}

// Checks y (bf16, tessera's layout for v.masked, poisoned with 0xFFFF before the run) against the reference
// computed from `in` (set 0, tessera's layouts).
CheckResult check_grouped(const GemmShape& sh, const Variant& v, const DeviceInputs& in, const DeviceBuffer& y,
                          cudaStream_t stream) {
  const int64_t N = sh.n, K = sh.k, KB = sh.kb(), NB = sh.nb();
  const int G = sh.groups;
  const std::vector<int64_t> nbs = sample_indices(NB, kCheckColBlocks, 1, 0xC01Bull);  // 128-column blocks
  const int64_t NBc = static_cast<int64_t>(nbs.size()), Nc = NBc * kBlock;
  const bool full = v.masked || static_cast<double>(sh.total_rows()) * Nc * K <= kCheckMacs;
  const int64_t per_group =
      full ? sh.max_rows()
           : std::max<int64_t>(2, static_cast<int64_t>(kCheckMacs / (static_cast<double>(Nc) * K * std::max(sh.nonempty(), 1))));
  const std::vector<int64_t> start = sh.row_start(v.masked);

  // The problem the reference solves: tessera's rows (full) or the picked rows, compact and contiguous; the
  // sampled columns only.
  reference::GroupedGemmShape rs;
  rs.masked = v.masked;
  rs.num_groups = G;
  rs.n = Nc;
  rs.k = K;
  rs.x_row_stride = K;
  rs.x_group_stride = v.masked ? sh.max_m * K : 0;
  rs.w_row_stride = K;
  rs.w_group_stride = Nc * K;
  std::vector<int64_t> rows;  // buffer rows of y (and x) the reference covers, in its row order
  std::vector<int32_t> group_rows(v.masked ? G : G + 1, 0);
  if (full) {
    rows.resize(sh.buffer_rows(v.masked));
    std::iota(rows.begin(), rows.end(), int64_t{0});
    if (v.masked) group_rows = sh.rows;
    else std::partial_sum(sh.rows.begin(), sh.rows.end(), group_rows.begin() + 1);
  } else {
    for (int g = 0; g < G; ++g) {
      for (int64_t r : pick_rows(sh.rows[g], per_group)) rows.push_back(start[g] + r);
      group_rows[g + 1] = static_cast<int32_t>(rows.size());
    }
  }
  rs.rows = v.masked ? sh.max_m : static_cast<int64_t>(rows.size());

  // Set 0's inputs: the x rows, the sampled columns of W (rows g·N + n), the matching scales.
  std::vector<int64_t> w_rows, ws_rows, y_cells;
  for (int g = 0; g < G; ++g)
    for (int64_t nb : nbs) {
      for (int64_t n = nb * kBlock; n < (nb + 1) * kBlock; ++n) w_rows.push_back(int64_t{g} * N + n);
      ws_rows.push_back(int64_t{g} * NB + nb);
    }
  for (int64_t r : rows)
    for (int64_t nb : nbs) y_cells.push_back(r * NB + nb);  // 128-element pieces of y: [rows][Nc]
  const std::vector<uint16_t> got = download_rows<uint16_t>(y, kBlock, y_cells, stream);

  // Tolerances: the reference's defaults, as in the GPU tests. The reference uses the exact inputs, so a correct
  // kernel (fp32 accumulation, fp8 partial sums promoted every k-block) is off by its bf16 output rounding
  // (~1e-3 relative Frobenius); a wrong scale, block or group shows up as errors of order 0.1-1.
  const reference::GemmTolerance tol;
  reference::GroupedGemmRef ref;
  if (v.fp8()) {
    const auto x = download_rows<uint8_t>(in.x, K, rows, stream);
    const auto w = download_rows<uint8_t>(in.w, K, w_rows, stream);
    reference::GroupedGemmScales sc;
    sc.mode = v.scale == Scale::kBlockwise ? gemm::ScaleMode::kBlockwise : gemm::ScaleMode::kPerTensor;
    if (v.scale == Scale::kBlockwise) {
      sc.x_scale = download_rows<float>(in.xs, KB, rows, stream);
      sc.w_scale = download_rows<float>(in.ws, KB, ws_rows, stream);
    } else {
      sc.x_scale = in.xs.download<float>(1, stream);
      sc.w_scale = in.ws.download<float>(G, stream);
    }
    sc.xs_row_stride = KB;
    sc.xs_k_stride = 1;
    sc.xs_group_stride = v.masked ? sh.max_m * KB : 0;
    sc.ws_group_stride = v.scale == Scale::kBlockwise ? NBc * KB : 1;
    sc.ws_n_stride = KB;
    sc.ws_k_stride = 1;
    ref = reference::grouped_gemm_fp8(x, w, group_rows, sc, rs);
  } else {
    const auto x = download_rows<uint16_t>(in.x, K, rows, stream);
    const auto w = download_rows<uint16_t>(in.w, K, w_rows, stream);
    ref = reference::grouped_gemm_bf16(x, w, group_rows, rs);
  }
  reference::GroupedGemmCheck c =
      reference::check_grouped_gemm(ref, got, Nc, v.masked ? sh.max_m * Nc : 0, uint16_t{0xFFFF}, tol);
  CheckResult res = c;
  std::string cols;
  for (int64_t nb : nbs) cols += (cols.empty() ? "" : ", ") + std::to_string(nb);
  if (NBc < NB)
    res.message += " (columns: 128-wide blocks {" + cols + "} of " + std::to_string(NB) + ")";
  if (!full)
    res.message += " (rows: " + std::to_string(rows.size()) + " of " + std::to_string(sh.total_rows()) + ", up to " +
                   std::to_string(per_group) + " per group, first and last included; 'row i' counts those rows)";
  return res;
}

// ============================================================================================================
// tessera
class GroupedGemmCase final : public CaseInstance {
 public:
  GroupedGemmCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const GemmShape& sh,
                  const Variant& v)
      : sh_(sh), v_(v), device_(ctx.device) {
    const int64_t rows = sh.buffer_rows(v.masked), N = sh.n, K = sh.k;
    sets_ = rotating_sets(ctx, static_cast<double>(input_bytes(sh, v)));
    for (int s = 0; s < sets_; ++s) {
      Set set;
      set.in = make_inputs(sh, v, case_seed(op, name, s), ctx.stream);
      sets_data_.push_back(std::move(set));
    }
    // Group sizes: offsets [G+1] (contiguous) or masked_m [G].
    std::vector<int32_t> group_rows;
    if (v.masked) {
      group_rows = sh.rows;
    } else {
      group_rows.assign(sh.groups + 1, 0);
      std::partial_sum(sh.rows.begin(), sh.rows.end(), group_rows.begin() + 1);
    }
    group_ = upload_new(group_rows);
    y_.allocate(rows * N * 2);
    workspace_bytes_ = gemm::grouped_gemm_workspace_bytes(sh.groups, N, K);
    workspace_.allocate(workspace_bytes_);

    const DType in = v.fp8() ? DType::kFP8E4M3 : DType::kBF16;
    for (Set& set : sets_data_) {
      set.views.w = TensorView::contiguous(set.in.w.get(), in, {sh.groups, N, K}, device_);
      if (v.masked) {
        set.views.x = TensorView::contiguous(set.in.x.get(), in, {sh.groups, sh.max_m, K}, device_);
        set.views.y = TensorView::contiguous(y_.get(), DType::kBF16, {sh.groups, sh.max_m, N}, device_);
        set.views.group = TensorView::contiguous(group_.get(), DType::kInt32, {sh.groups}, device_);
      } else {
        set.views.x = TensorView::contiguous(set.in.x.get(), in, {rows, K}, device_);
        set.views.y = TensorView::contiguous(y_.get(), DType::kBF16, {rows, N}, device_);
        set.views.group = TensorView::contiguous(group_.get(), DType::kInt32, {sh.groups + 1}, device_);
      }
      if (v.scale == Scale::kPerTensor) {
        set.views.scales.mode = gemm::ScaleMode::kPerTensor;
        set.views.scales.x_scale = TensorView::contiguous(set.in.xs.get(), DType::kFP32, {1}, device_);
        set.views.scales.w_scale = TensorView::contiguous(set.in.ws.get(), DType::kFP32, {sh.groups}, device_);
      } else if (v.scale == Scale::kBlockwise) {
        set.views.scales.mode = gemm::ScaleMode::kBlockwise;
        set.views.scales.x_scale =
            v.masked ? TensorView::contiguous(set.in.xs.get(), DType::kFP32, {sh.groups, sh.max_m, sh.kb()}, device_)
                     : TensorView::contiguous(set.in.xs.get(), DType::kFP32, {rows, sh.kb()}, device_);
        set.views.scales.w_scale =
            TensorView::contiguous(set.in.ws.get(), DType::kFP32, {sh.groups, sh.nb(), sh.kb()}, device_);
      }
    }
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Views& t = sets_data_[set].views;
    const gemm::Workspace ws{workspace_.get(), workspace_bytes_};
    if (v_.fp8()) {
      if (v_.masked) gemm::grouped_gemm_fp8_masked(t.x, t.w, t.group, t.scales, t.y, ws, stream);
      else gemm::grouped_gemm_fp8(t.x, t.w, t.group, t.scales, t.y, ws, stream);
    } else {
      if (v_.masked) gemm::grouped_gemm_bf16_masked(t.x, t.w, t.group, t.y, ws, stream);
      else gemm::grouped_gemm_bf16(t.x, t.w, t.group, t.y, ws, stream);
    }
  }

  CheckResult check(cudaStream_t stream) override {
    y_.fill_async(0xFF, stream);  // bf16 NaN
    run(stream, 0);
    return check_grouped(sh_, v_, sets_data_[0].in, y_, stream);
  }

 private:
  struct Views {
    TensorView x, w, group, y;
    gemm::FP8Scales scales;
  };
  struct Set {
    DeviceInputs in;
    Views views;
  };
  GemmShape sh_;
  Variant v_;
  int device_;
  int sets_ = 1;
  std::vector<Set> sets_data_;
  DeviceBuffer group_, y_, workspace_;
  std::size_t workspace_bytes_ = 0;
};

// ============================================================================================================
// cuBLASLt peer: Y_g = X_g · W_gᵀ as, column-major, Y_gᵀ [N, m] = W_g [N, K] · X_gᵀ [K, m], the "TN" form FP8
// requires: A = W_g stored K x N (ld K, = row-major [N, K]) with transa = T; B = X_g stored K x m (ld K, = row-major
// [m, K]) with transb = N; D stored N x m (ld N, = row-major Y_g [m, N]).
// Scales, per-tensor: A = w_scale[g], B = x_scale (SCALAR_32F, device pointers, set per call on the one matmul
// descriptor). Block-wise (cuBLAS >= 12.9, Hopper only): A BLK128x128_32F, B VEC128_32F, in the layouts PyTorch's
// _scaled_mm hands cuBLASLt for DeepSeek-style scales, re-laid out per group in setup:
//   A (128x128 blocks of W_g): kb fastest, N-block stride round_up(K/128, 4) (16-byte aligned rows);
//   B (1x128 blocks of X_g):   row fastest ("outer-dim-major"), K-block stride m_g.
// TODO(verify on the GPU): the B stride when m_g is not a multiple of 4 (skewed_zipf, skew_one_big and the routed
// shapes have such groups);
// --check on the cublaslt_fp8_loop rows tells whether these layouts are the ones cuBLASLt reads.
constexpr int64_t kScaleAlign = 64;                                 // floats: 256 bytes

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

class CublasLtLoopCase final : public CaseInstance {
 public:
  CublasLtLoopCase(const DeviceContext& ctx, const std::string& op, const std::string& name, const GemmShape& sh,
                   const Variant& v)
      : sh_(sh), v_{v.operand, v.scale, false} {
    const int64_t N = sh.n, K = sh.k, KB = sh.kb(), M = sh.total_rows();
    start_ = sh.row_start(false);
    // Each group's scales start 256-byte aligned (the alignment cuBLASLt's heuristic assumes for its operands):
    // per-tensor w_scale[g] in its own slot, block-wise the per-group blocks described above.
    xs_off_.assign(sh.groups, 0);
    ws_off_.assign(sh.groups, 0);
    int64_t xs_total = 0, ws_total = 0;
    ws_ld_ = round_up(KB, 4);
    for (int g = 0; g < sh.groups; ++g) {
      xs_off_[g] = xs_total;
      ws_off_[g] = ws_total;
      xs_total += round_up(KB * sh.rows[g], kScaleAlign);
      ws_total += round_up(v.scale == Scale::kBlockwise ? sh.nb() * ws_ld_ : 1, kScaleAlign);
    }
    sets_ = rotating_sets(ctx, static_cast<double>(input_bytes(sh, v_)));
    for (int s = 0; s < sets_; ++s) {
      // tessera's layouts on the GPU; the scales re-laid out for cuBLASLt on the host (at most a few MB). Set 0
      // keeps tessera's scale layout for --check.
      Set set;
      set.in = make_inputs(sh, v_, case_seed(op, name, s), ctx.stream);
      if (v.scale == Scale::kPerTensor) {
        const std::vector<float> g_ws = set.in.ws.download<float>(sh.groups, ctx.stream);
        std::vector<float> ws(ws_total, 1.0f);
        for (int g = 0; g < sh.groups; ++g) ws[ws_off_[g]] = g_ws[g];
        set.ws_lt = upload_new(ws);
      } else if (v.scale == Scale::kBlockwise) {
        const std::vector<float> t_xs = set.in.xs.download<float>(x_scale_count(sh, v_), ctx.stream);
        const std::vector<float> t_ws = set.in.ws.download<float>(w_scale_count(sh, v_), ctx.stream);
        std::vector<float> xs(std::max<int64_t>(xs_total, 1), 1.0f), ws(std::max<int64_t>(ws_total, 1), 1.0f);
        for (int g = 0; g < sh.groups; ++g) {
          const int64_t m = sh.rows[g];
          for (int64_t r = 0; r < m; ++r)
            for (int64_t b = 0; b < KB; ++b) xs[xs_off_[g] + b * m + r] = t_xs[(start_[g] + r) * KB + b];
          for (int64_t nb = 0; nb < sh.nb(); ++nb)
            for (int64_t b = 0; b < KB; ++b) ws[ws_off_[g] + nb * ws_ld_ + b] = t_ws[(g * sh.nb() + nb) * KB + b];
        }
        set.xs_lt = upload_new(xs);
        set.ws_lt = upload_new(ws);
        if (s > 0) set.in.xs.release(), set.in.ws.release();
      }
      sets_data_.push_back(std::move(set));
    }
    y_.allocate(M * N * 2);
    workspace_.allocate(kLtWorkspaceBytes);

    create_tn_matmul(handle_, desc_);
    if (v.scale == Scale::kBlockwise) {
      const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      set_attr(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, a_mode);
      set_attr(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, b_mode);
    }
    const cudaDataType_t in = v.fp8() ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    a_layout_ = make_layout(in, K, N, K);

    // One plan (B / D layouts + the heuristic's algorithm) per distinct group size.
    for (int g = 0; g < sh.groups; ++g) {
      const int64_t m = sh.rows[g];
      if (m == 0 || plans_.count(m)) continue;
      Plan plan;
      plan.b = make_layout(in, K, m, K);
      plan.d = make_layout(CUDA_R_16BF, N, m, N);
      set_scale_pointers(0, g);  // block scaling modes want the pointers set before the heuristic
      if (!first_heuristic_algo(handle_, desc_, a_layout_, plan.b, plan.d, plan.algo))
        throw Unsupported("cuBLASLt has no algorithm for this scale mode with N=" + std::to_string(N) +
                          " m=" + std::to_string(m) + " K=" + std::to_string(K));
      plans_.emplace(m, std::move(plan));
    }
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& d = sets_data_[set];
    const std::size_t e = elt(v_.operand);
    const float alpha = 1.0f, beta = 0.0f;
    for (int g = 0; g < sh_.groups; ++g) {
      const int64_t m = sh_.rows[g];
      if (m == 0) continue;
      const Plan& plan = plans_.at(m);
      set_scale_pointers(set, g);  // read by cublasLtMatmul at enqueue time (and baked into a captured graph)
      const char* w = d.in.w.as<const char>() + static_cast<std::size_t>(g) * sh_.n * sh_.k * e;
      const char* x = d.in.x.as<const char>() + static_cast<std::size_t>(start_[g]) * sh_.k * e;
      char* y = y_.as<char>() + static_cast<std::size_t>(start_[g]) * sh_.n * 2;
      BENCH_CUBLAS_CHECK(cublasLtMatmul(handle_.get(), desc_.get(), &alpha, w, a_layout_.get(), x, plan.b.get(), &beta,
                                        y, plan.d.get(), y, plan.d.get(), &plan.algo, workspace_.get(),
                                        kLtWorkspaceBytes, stream));
    }
  }

  CheckResult check(cudaStream_t stream) override {
    y_.fill_async(0xFF, stream);
    run(stream, 0);
    return check_grouped(sh_, v_, sets_data_[0].in, y_, stream);
  }

 private:
  struct Set {
    DeviceInputs in;           // tessera's layouts (the scales: set 0 only)
    DeviceBuffer xs_lt, ws_lt;  // the scales in cuBLASLt's layouts (per-tensor x_scale: in.xs)
  };
  struct Plan {
    LtLayout b, d;
    cublasLtMatmulAlgo_t algo{};
  };

  template <typename T>
  void set_attr(cublasLtMatmulDescAttributes_t attr, const T& value) {
    BENCH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_.get(), attr, &value, sizeof(value)));
  }
  void set_scale_pointers(int set, int g) {
    if (v_.scale == Scale::kNone) return;
    const Set& d = sets_data_[set];
    const float* a = d.ws_lt.as<const float>() + ws_off_[g];
    const float* b = v_.scale == Scale::kPerTensor ? d.in.xs.as<const float>() : d.xs_lt.as<const float>() + xs_off_[g];
    set_attr(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a);
    set_attr(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b);
  }

  GemmShape sh_;
  Variant v_;
  int sets_ = 1;
  std::vector<int64_t> start_, xs_off_, ws_off_;
  int64_t ws_ld_ = 0;
  std::vector<Set> sets_data_;
  DeviceBuffer y_, workspace_;
  LtHandle handle_;
  LtMatmulDesc desc_;
  LtLayout a_layout_;
  std::map<int64_t, Plan> plans_;
};

// ============================================================================================================
// registration
const char* scale_suffix(Scale s) {
  return s == Scale::kPerTensor ? "/tensor" : s == Scale::kBlockwise ? "/block" : "";
}

GemmShape uniform(const std::string& name, int groups, int64_t rows, int64_t n, int64_t k, bool decode) {
  GemmShape sh;
  sh.name = name + "/m" + std::to_string(rows);
  sh.groups = groups;
  sh.n = n;
  sh.k = k;
  sh.rows.assign(groups, static_cast<int32_t>(rows));
  sh.max_m = decode ? 4 * rows : 0;
  return sh;
}

// 256 groups, all empty but six: one of 1000 rows and five small ones (fixed sizes and places).
GemmShape skew_one_big() {
  GemmShape sh;
  sh.groups = 256;
  sh.n = 2048;
  sh.k = 7168;
  sh.rows.assign(sh.groups, 0);
  const std::pair<int, int32_t> placed[] = {{37, 1000}, {5, 3}, {64, 1}, {128, 12}, {200, 6}, {255, 2}};
  for (const auto& [g, r] : placed) sh.rows[g] = r;
  sh.name = "skew_one_big/M" + std::to_string(sh.total_rows());
  return sh;
}

constexpr uint64_t kRoutedSeed = 0xD5E3ull;  // routing_rows.h's logits; bench/peers/gemm.py uses the same

// Routed by tessera's DeepSeek-V3 gate on `tokens` tokens (routing_rows.h): E 256 groups, tokens·8 rows. The rows
// here are a placeholder until setup (see the header comment). masked: max_m = tokens, the most a group can get.
GemmShape routed(const std::string& name, int64_t tokens, int64_t n, int64_t k, bool masked) {
  GemmShape sh;
  sh.name = name + "/T" + std::to_string(tokens);
  sh.groups = routing::kExperts;
  sh.n = n;
  sh.k = k;
  sh.routed_tokens = tokens;
  sh.routed_seed = kRoutedSeed;
  const int64_t total = tokens * routing::kTopk;
  sh.rows.assign(sh.groups, static_cast<int32_t>(total / sh.groups));
  for (int64_t g = 0; g < total % sh.groups; ++g) ++sh.rows[g];
  sh.max_m = masked ? tokens : 0;
  return sh;
}

// A routed shape's registry entry, once setup knows its group sizes: the exact bytes (harness.h: the report and the
// JSON read the CaseSpec after the run).
void set_registered_bytes(const std::string& op, const std::string& name, double bytes) {
  for (CaseSpec& c : case_registry())
    if (c.op == op && c.name == name) c.bytes = bytes;
}

void add_gemm_cases(std::vector<CaseSpec>& cases) {
  std::vector<GemmShape> shapes = {
      uniform("dsv3_gate_up", 32, 8, 4096, 7168, true),
      uniform("dsv3_gate_up", 32, 128, 4096, 7168, false),
      uniform("dsv3_gate_up", 32, 1024, 4096, 7168, false),
      uniform("dsv3_down", 32, 1024, 7168, 2048, false),
      uniform("qwen3_gate_up", 128, 256, 1536, 2048, false),
      uniform("qwen3_down_decode", 128, 4, 2048, 768, true),
      // Mixtral-8x7B's down projection at T 1 (2 experts of one row): 64 tiles of 128 weights on 132 SMs, the
      // decode launch that 64-wide split tiles fill (config.h: split_decode_tiles).
      uniform("mixtral_down_decode", 2, 1, 4096, 14336, true),
      // DeepSeek-V3's gate_up at T 1 (8 routed experts and the shared one, one row each): 288 tiles of 128 weights.
      uniform("dsv3_gate_up_t1", 9, 1, 4096, 7168, true),
      // One dense 8192³ GEMM: its cuBLASLt row is the run's measured FP8 (and bf16) tensor ceiling, the figure the
      // compute-bound rows are quoted against (docs/perf/grouped_gemm.md, "Clocks and power").
      uniform("dense", 1, 8192, 8192, 8192, false),
  };
  GemmShape skewed;
  skewed.groups = 128;
  skewed.n = 1536;
  skewed.k = 2048;
  skewed.rows = zipf_rows(skewed.groups, 32768, 16, 1.1, 0x5EEDull);  // fixed: the same sizes in every run
  skewed.name = "skewed_zipf/M" + std::to_string(skewed.total_rows());
  shapes.push_back(skewed);
  shapes.push_back(skew_one_big());
  shapes.push_back(routed("dsv3_gate_up_routed", 4096, 4096, 7168, false));
  shapes.push_back(routed("dsv3_decode_routed", 64, 4096, 7168, true));

  // Headline rows (docs/perf/grouped_gemm.md): per shape, the op / scale pairs below, with the peer row of every
  // headline tessera row that has one.
  const auto headline = [](const std::string& op, const std::string& name) {
    static const std::vector<std::pair<std::string, std::string>> rows = {
        {"grouped_gemm_fp8", "dsv3_gate_up/m8/tensor"},       {"grouped_gemm_fp8_masked", "dsv3_gate_up/m8/tensor"},
        {"cublaslt_fp8_loop", "dsv3_gate_up/m8/tensor"},      {"grouped_gemm_fp8", "dsv3_gate_up/m8/block"},
        {"grouped_gemm_bf16_masked", "dsv3_gate_up/m8"},      {"grouped_gemm_fp8", "dsv3_gate_up/m1024/tensor"},
        {"cublaslt_fp8_loop", "dsv3_gate_up/m1024/tensor"},   {"grouped_gemm_fp8", "dsv3_gate_up/m1024/block"},
        {"grouped_gemm_bf16", "dsv3_gate_up/m1024"},          {"cublaslt_bf16_loop", "dsv3_gate_up/m1024"},
        {"grouped_gemm_fp8", "dsv3_down/m1024/tensor"},       {"grouped_gemm_fp8", "qwen3_gate_up/m256/tensor"},
        {"cublaslt_fp8_loop", "qwen3_gate_up/m256/tensor"},   {"grouped_gemm_fp8", "qwen3_down_decode/m4/tensor"},
        {"grouped_gemm_fp8_masked", "qwen3_down_decode/m4/block"}, {"cublaslt_fp8_loop", "qwen3_down_decode/m4/tensor"},
        {"grouped_gemm_fp8", "mixtral_down_decode/m1/tensor"}, {"grouped_gemm_fp8", "mixtral_down_decode/m1/block"},
        {"cublaslt_fp8_loop", "mixtral_down_decode/m1/tensor"},
        {"grouped_gemm_fp8", "skewed_zipf/M32768/tensor"},    {"cublaslt_fp8_loop", "skewed_zipf/M32768/tensor"},
        {"grouped_gemm_fp8", "skew_one_big/M1024/tensor"},    {"cublaslt_fp8_loop", "skew_one_big/M1024/tensor"},
        {"grouped_gemm_fp8", "dsv3_gate_up_routed/T4096/tensor"},
        {"cublaslt_fp8_loop", "dsv3_gate_up_routed/T4096/tensor"},
        {"grouped_gemm_fp8", "dsv3_gate_up_routed/T4096/block"},
        {"cublaslt_fp8_loop", "dsv3_gate_up_routed/T4096/block"},
        {"grouped_gemm_fp8", "dsv3_decode_routed/T64/tensor"},
        {"grouped_gemm_fp8_masked", "dsv3_decode_routed/T64/tensor"},
        {"cublaslt_fp8_loop", "dsv3_decode_routed/T64/tensor"},
        {"grouped_gemm_fp8", "dense/m8192/tensor"},           {"cublaslt_fp8_loop", "dense/m8192/tensor"},
    };
    return std::find(rows.begin(), rows.end(), std::pair{op, name}) != rows.end();
  };
  const auto add = [&](const std::string& op, const GemmShape& sh, const Variant& v, bool peer,
                       std::vector<std::string> peer_of) {
    CaseSpec c;
    c.op = op;
    c.name = sh.name + scale_suffix(v.scale);
    c.headline = headline(op, c.name);
    c.bytes = gemm_bytes(sh, v);
    c.flops = gemm_flops(sh);
    c.peer_of = std::move(peer_of);
    const std::string name = c.name;
    c.setup = [=](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      GemmShape s = sh;
      if (s.routed_tokens > 0) {  // the gate's group sizes replace the placeholder (computed once per process)
        s.rows = routing::routed_rows(ctx, s.routed_tokens, s.routed_seed);
        set_registered_bytes(op, name, gemm_bytes(s, v));
      }
      if (peer) return std::make_unique<CublasLtLoopCase>(ctx, op, name, s, v);
      return std::make_unique<GroupedGemmCase>(ctx, op, name, s, v);
    };
    cases.push_back(std::move(c));
  };
  // Per shape: tessera rows, then the peer row with the same case name, so the table shows them together.
  for (const GemmShape& sh : shapes) {
    const bool masked = sh.max_m > 0;
    for (Scale s : {Scale::kPerTensor, Scale::kBlockwise}) {
      add("grouped_gemm_fp8", sh, {Operand::kFP8, s, false}, false, {});
      if (masked) add("grouped_gemm_fp8_masked", sh, {Operand::kFP8, s, true}, false, {});
      add("cublaslt_fp8_loop", sh, {Operand::kFP8, s, false}, true, {"grouped_gemm_fp8", "grouped_gemm_fp8_masked"});
    }
    add("grouped_gemm_bf16", sh, {Operand::kBF16, Scale::kNone, false}, false, {});
    if (masked) add("grouped_gemm_bf16_masked", sh, {Operand::kBF16, Scale::kNone, true}, false, {});
    add("cublaslt_bf16_loop", sh, {Operand::kBF16, Scale::kNone, false}, true,
        {"grouped_gemm_bf16", "grouped_gemm_bf16_masked"});
  }
}

}  // namespace

TESSERA_BENCH_CASES(add_gemm_cases);

}  // namespace tessera::bench
