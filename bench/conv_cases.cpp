// tessera-bench cases for the int4 / int8-weight conv2d (tessera/conv.h, issue 19).
//
//   conv2d   y [N, Ho, Wo, Co] = conv2d(x, dequant(W)), x bf16 NHWC (one case NCHW), y bf16 NHWC, W [Co, Kh, Kw, Ci_g]
//            as a prepacked weight-only linear weight over K = Kh·Kw·Ci_g (codes + (scale, zero point) pairs in bf16,
//            kZeroPoint: w = (q − zero)·scale), no bias, no clamp, dilation 1
// The peer (cuDNN bf16 channels-last through torch.nn.functional.conv2d) is measured in the same run by
// bench/compare.py --ops conv (bench/peers/conv.py), on these case names.
//
// Case names: <geometry>/<x layout>/<format>/<path>
//   geometry  B<n>_C<ci>_<h>x<w>_<kh>x<kw>[_s<stride>][_p<pad>][_g<groups>]_Co<co>
//     1  B1_C256_56x56_3x3_p1_Co256            K 2304   (the four, ResNet layers)
//     2  B8_C512_28x28_3x3_p1_Co512            K 4608
//     3  B32_C64_112x112_3x3_s2_p1_Co128       K 576
//     4  B16_C1024_14x14_1x1_Co1024            K 1024
//     dw B8_C384_28x28_3x3_p1_g384_Co384       K 9     depthwise
//     stem B8_C3_224x224_7x7_s2_p3_Co64        K 147   the first (RGB) layer
//   x layout  nhwc, or nchw (x read as [N, Ci, H, W]: the op's transform into the workspace is part of the time)
//   format    int4_g128_zp / int8_g128_zp: int4 / int8 codes, a (scale, zero point) pair per 128 values of K; g64
//             where 128 does not divide K (case 3); channel: one pair per output channel (block = K: dw, stem)
//   path      tessera::conv::conv_path_name of the path the header's rules give (1×1 stride 1 unpadded: linear;
//             Ci_g % 64 == 0: the implicit GEMM; else direct); setup asks the op (conv2d_path) and fails the row if it
//             disagrees, so a name never states a path that did not run
// The default suite (headline): cases 1-4 int4 and case 2 int8, NHWC. --all adds int8 for cases 1, 3, 4, case 1 int4
// with NCHW x, and the depthwise and stem convs in int4 and int8.
//
// FLOPs = 2·P·Co·K (P = N·Ho·Wo output pixels, K = Kh·Kw·Ci/groups). Bytes = x (2·N·H·W·Ci) + y written (2·P·Co) +
// the prepacked codes (Np·Kp·bits/8, rows padded to 16 and K to the 64 (int4) / 32 (int8) tile) + the pairs (4 bytes
// per block and padded row): the table's "% read BW" and TFLOP/s; bench/compare.py --ops conv relates the TFLOP/s to a
// bf16 GEMM ceiling measured in the same run.
//
// Inputs, in rotating sets (codes, pairs and x together; rotating_sets):
//   codes  uniform random bytes (every byte is a valid pair of int4 codes or an int8 code)
//   pairs  scale ~ U(0.001, 0.02) rounded to bf16, zero point uniform over the integers [0, 2^bits), both in bf16,
//          interleaved (scale, zero) as the layout stores them
//   x      bf16 U(−1, 1)
// Generated on the GPU straight into the prepacked layout (device_random.h) when the layout has no padding (K a
// multiple of the tile, Co of 16: cases 1-4). The depthwise and stem weights (K = 9, 147: padded columns, which the
// layout requires to be zero) are small: they are drawn on the host with the same distributions as a canonical
// linear::QuantizedWeight and laid out by linear::prepack.
//
// --check: y is poisoned (NaN), set 0 runs, and the output pixel rows (rows of y as [P, Co]) of a sample are compared,
// every output channel of each, with a float64 convolution computed here: im2col of the downloaded x (only the images
// that hold sampled rows are downloaded; padding reads 0) times the weight downloaded from the device layout and
// unpacked by the library's own inverse (linear::unpack), valued by reference::dequantize_weight (the rule
// reference::conv2d_reference reads the weight with). The sample: every row when P·Co·K <= 4e8 multiply-adds (the
// depthwise case) or P <= 64; else
//   - rows 0, 1, P − 2, P − 1;
//   - both sides of every 256-pixel tile boundary (rows 256·t − 1 and 256·t);
//   - the first and the last pixel of every image (the padded corners, and where a tile crosses images);
//   - then, within the 4e8 budget (at least 64 rows in all), both sides of the other 64-pixel boundaries (those of
//     64 / 128 / 192-pixel tiles; a random subset of them when they do not all fit, leaving room for 16 random rows),
//     and random rows up to the budget.
// The sampled outputs must be finite and within 5e-3 relative Frobenius error of the reference (bf16, as
// bench/linear_cases.cpp).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/host_numeric.h"
#include "device_random.h"
#include "harness.h"
#include "reference/conv_reference.h"
#include "reference/linear_reference.h"
#include "tessera/conv.h"
#include "tessera/linear.h"

namespace tessera::bench {
namespace {

using conv::ConvPath;
using conv::Layout;
using linear::ZeroMode;

constexpr double kTolerance = 5e-3;   // relative Frobenius error of y (bf16)
constexpr double kCheckMacs = 4.0e8;  // multiply-adds of the sampled reference
constexpr int64_t kMinCheckRows = 64;
constexpr int64_t kRandomRows = 16;  // random rows in every sample
constexpr int64_t kTile = 256;       // pixel tiles whose boundaries are always compared
constexpr int64_t kSubTile = 64;     // smaller tiles whose boundaries fill the budget
constexpr int64_t kRowsPerTask = 8;  // sampled rows per reference task
constexpr int64_t kStripe = 16;      // rows of W per stripe of the prepacked layout
constexpr uint64_t kSampleSeed = 0xC0417ull;

// ============================================================================================================
// problems
struct Geometry {
  int64_t n = 1, ci = 1, h = 1, w = 1, co = 1, kh = 1, kw = 1;
  int64_t stride = 1, pad = 0, groups = 1;

  reference::Conv2dParams ref() const {
    reference::Conv2dParams p;
    p.n = n, p.h = h, p.w = w, p.ci = ci, p.co = co, p.kh = kh, p.kw = kw;
    p.stride_h = p.stride_w = stride;
    p.pad_h = p.pad_w = pad;
    p.groups = groups;
    return p;
  }
  int64_t ci_g() const { return ci / groups; }
  int64_t co_g() const { return co / groups; }
  int64_t k() const { return kh * kw * ci_g(); }
  int64_t ho() const { return ref().out_h(); }
  int64_t wo() const { return ref().out_w(); }
  int64_t pixels() const { return ref().pixels(); }
  std::string name() const {
    std::string s = "B" + std::to_string(n) + "_C" + std::to_string(ci) + "_" + std::to_string(h) + "x" +
                    std::to_string(w) + "_" + std::to_string(kh) + "x" + std::to_string(kw);
    if (stride != 1) s += "_s" + std::to_string(stride);
    if (pad != 0) s += "_p" + std::to_string(pad);
    if (groups != 1) s += "_g" + std::to_string(groups);
    return s + "_Co" + std::to_string(co);
  }
};

struct Format {
  int bits = 4;
  int64_t block = 128;  // 0: one block per output channel (block = K)
  std::string name() const {
    return "int" + std::to_string(bits) + (block == 0 ? std::string("_channel") : "_g" + std::to_string(block)) + "_zp";
  }
};

// The path tessera/conv.h's rules give (what the case name states; setup compares it with conv2d_path).
ConvPath expected_path(const Geometry& g) {
  if (g.kh == 1 && g.kw == 1 && g.stride == 1 && g.pad == 0 && g.groups == 1 && g.ci % 8 == 0) return ConvPath::kLinear;
  const int64_t extent_h = g.kh - 1, extent_w = g.kw - 1;  // dil · (k − 1), dilation 1
  if (g.ci_g() % 64 == 0 && (g.groups == 1 || g.co_g() % 128 == 0) && g.pad <= 127 && g.stride <= 8 &&
      extent_h <= 255 && extent_w <= 255 && extent_h - g.pad <= 128 && extent_w - g.pad <= 128 &&
      g.pixels() < (int64_t{1} << 24))
    return ConvPath::kImplicitGemm;
  return ConvPath::kDirect;
}

struct Problem {
  Geometry g;
  Format format;
  Layout x_layout = Layout::kNHWC;

  int bits() const { return format.bits; }
  int64_t k() const { return g.k(); }
  int64_t block() const { return format.block == 0 ? k() : format.block; }
  // The prepacked layout (tessera/linear.h): rows padded to 16, K to the tile.
  int64_t padded_n() const { return (g.co + kStripe - 1) / kStripe * kStripe; }
  int64_t padded_k() const {
    return (k() + linear::tile_k(bits()) - 1) / linear::tile_k(bits()) * linear::tile_k(bits());
  }
  int64_t num_blocks() const { return block() == k() ? 1 : padded_k() / block(); }
  bool padded() const { return padded_n() != g.co || padded_k() != k(); }
  int64_t code_bytes() const { return padded_n() * padded_k() * bits() / 8; }
  int64_t pairs() const { return padded_n() * num_blocks(); }  // (scale, zero) pairs
  int64_t x_elems() const { return g.n * g.h * g.w * g.ci; }
  int64_t y_elems() const { return g.pixels() * g.co; }
  // Inputs one call reads (the rotation's unit) and bytes it moves.
  double input_bytes() const { return static_cast<double>(code_bytes()) + 4.0 * pairs() + 2.0 * x_elems(); }
  double bytes() const { return input_bytes() + 2.0 * y_elems(); }
  double flops() const { return 2.0 * g.pixels() * g.co * k(); }
  ConvPath path() const { return expected_path(g); }
  std::string name() const {
    return g.name() + (x_layout == Layout::kNCHW ? "/nchw/" : "/nhwc/") + format.name() + "/" +
           conv::conv_path_name(path());
  }
  conv::Conv2dParams params() const {
    conv::Conv2dParams p;
    p.stride_h = p.stride_w = g.stride;
    p.pad_h = p.pad_w = g.pad;
    p.groups = g.groups;
    p.x_layout = x_layout;
    p.y_layout = Layout::kNHWC;
    return p;
  }
};

// ============================================================================================================
// inputs in the prepacked layout
enum Salt : uint64_t { kCodes = 1, kScales, kZeros, kX, kHostWeight };

struct ConvInputs {
  DeviceBuffer codes, params, x;
};

// Codes and pairs generated on the GPU (a layout without padding: every byte and pair is a real weight's).
void make_weight_on_device(const Problem& p, uint64_t seed, ConvInputs& in, cudaStream_t stream) {
  in.codes.allocate(p.code_bytes());  // a multiple of 4 bytes: 16 rows × Kp·bits/8 per stripe
  gen::fill_int(in.codes.as<int32_t>(), p.code_bytes() / 4, gen::sub_seed(seed, kCodes), INT32_MIN, INT32_MAX, stream);

  const int64_t pairs = p.pairs();
  DeviceBuffer scale(pairs * 2), zero(pairs * 2);
  gen::FloatDist sd;
  sd.lo = 0.001f;
  sd.hi = 0.02f;
  gen::fill_float(scale.get(), DType::kBF16, pairs, gen::sub_seed(seed, kScales), sd, stream);
  // Integer zero points in bf16: random int32 indices in [0, 2^bits), widened to int64 (the high words zeroed),
  // gather the bf16 values of a table of the integers 0 .. 2^bits − 1 (exact in bf16).
  const int levels = 1 << p.bits();
  std::vector<uint16_t> table(levels);
  for (int z = 0; z < levels; ++z) table[z] = host::f32_to_bf16(static_cast<float>(z));
  DeviceBuffer zero_table = upload_new(table);
  DeviceBuffer index32(pairs * 4), index64(pairs * 8);
  gen::fill_int(index32.as<int32_t>(), pairs, gen::sub_seed(seed, kZeros), 0, levels, stream);
  index64.fill_async(0, stream);
  TESSERA_CUDA_CHECK(cudaMemcpy2DAsync(index64.get(), 8, index32.get(), 4, 4, static_cast<std::size_t>(pairs),
                                       cudaMemcpyDeviceToDevice, stream));
  gen::gather_rows(zero_table.get(), 2, index64.as<const int64_t>(), pairs, zero.get(), stream);
  in.params.allocate(pairs * 4);
  gen::interleave_pairs(in.params.as<uint16_t>(), scale.as<const uint16_t>(), zero.as<const uint16_t>(), pairs, stream);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));  // the temporaries go out of scope
}

// A small padded weight: the canonical form drawn on the host (same distributions), laid out by linear::prepack.
void make_weight_on_host(const Problem& p, uint64_t seed, ConvInputs& in) {
  linear::QuantizedWeight q;
  q.n = p.g.co;
  q.k = p.k();
  q.bits = p.bits();
  q.block = p.block();
  q.zero_mode = ZeroMode::kZeroPoint;
  const int levels = 1 << p.bits();
  const int64_t params = q.n * (q.k / q.block);
  Rng rng(gen::sub_seed(seed, kHostWeight));
  q.codes.resize(static_cast<std::size_t>(q.n * q.k));
  for (uint8_t& c : q.codes) c = static_cast<uint8_t>(rng.below(levels));
  q.scale.resize(static_cast<std::size_t>(params));
  q.offset.resize(q.scale.size());
  q.zero.resize(q.scale.size());
  for (std::size_t i = 0; i < q.scale.size(); ++i) {
    q.scale[i] = host::bf16_to_f32(host::f32_to_bf16(static_cast<float>(rng.uniform(0.001, 0.02))));
    q.zero[i] = static_cast<uint8_t>(rng.below(levels));
    q.offset[i] = -static_cast<float>(q.zero[i]) * q.scale[i];
  }
  const linear::PackedWeight pw = linear::prepack(q, DType::kBF16);
  if (static_cast<int64_t>(pw.codes.size()) != p.code_bytes() ||
      static_cast<int64_t>(pw.params.size()) != 2 * p.pairs())
    throw Error("tessera-bench: conv2d " + p.name() + ": prepack's layout sizes differ from the case's byte count");
  in.codes = upload_new(pw.codes);
  in.params = upload_new(pw.params);
}

ConvInputs make_inputs(const Problem& p, uint64_t seed, cudaStream_t stream) {
  ConvInputs in;
  if (p.padded())
    make_weight_on_host(p, seed, in);
  else
    make_weight_on_device(p, seed, in, stream);
  in.x.allocate(p.x_elems() * 2);
  gen::fill_float(in.x.get(), DType::kBF16, p.x_elems(), gen::sub_seed(seed, kX), {}, stream);
  return in;
}

// ============================================================================================================
// --check sampling: output pixel rows (the header comment states the rule)
struct RowSample {
  std::vector<int64_t> rows;  // sorted, distinct
  std::string what;
};

RowSample sample_pixel_rows(const Problem& p) {
  const int64_t P = p.g.pixels(), plane = p.g.ho() * p.g.wo();
  const double macs_per_row = static_cast<double>(p.g.co) * p.k();
  const int64_t budget = std::max<int64_t>(kMinCheckRows, static_cast<int64_t>(kCheckMacs / macs_per_row));
  RowSample s;
  if (P <= budget) {
    s.rows.resize(P);
    for (int64_t i = 0; i < P; ++i) s.rows[i] = i;
    s.what = "all " + std::to_string(P) + " output pixels";
    return s;
  }
  std::set<int64_t> picked;
  auto add = [&](int64_t r) {
    if (r >= 0 && r < P) picked.insert(r);
  };
  for (int64_t r : {int64_t{0}, int64_t{1}, P - 2, P - 1}) add(r);
  int64_t tile_edges = 0;
  for (int64_t b = kTile; b < P; b += kTile, ++tile_edges) add(b - 1), add(b);
  for (int64_t img = 0; img < p.g.n; ++img) add(img * plane), add((img + 1) * plane - 1);

  // The other 64-pixel boundaries, all of them or a random subset, leaving room for the random rows.
  std::vector<int64_t> sub_edges;
  for (int64_t b = kSubTile; b < P; b += kSubTile)
    if (b % kTile != 0) sub_edges.push_back(b);
  Rng rng(kSampleSeed);
  for (std::size_t i = sub_edges.size(); i > 1; --i)  // Fisher-Yates
    std::swap(sub_edges[i - 1], sub_edges[static_cast<std::size_t>(rng.next() % i)]);
  int64_t sub_taken = 0;
  for (int64_t b : sub_edges) {
    if (static_cast<int64_t>(picked.size()) + 2 + kRandomRows > budget) break;
    add(b - 1), add(b);
    ++sub_taken;
  }
  const int64_t fixed = static_cast<int64_t>(picked.size());
  const int64_t target = std::min(P, std::max(fixed + kRandomRows, budget));
  while (static_cast<int64_t>(picked.size()) < target) picked.insert(static_cast<int64_t>(rng.next() % P));
  s.rows.assign(picked.begin(), picked.end());
  s.what = std::to_string(s.rows.size()) + " of " + std::to_string(P) +
           " output pixels (first 2, last 2, both sides of " + std::to_string(tile_edges) +
           " 256-pixel tile boundaries, first and last pixel of each of " + std::to_string(p.g.n) + " image(s), " +
           std::to_string(sub_taken) + " of " + std::to_string(sub_edges.size()) + " other 64-pixel boundaries, " +
           std::to_string(target - fixed) + " random)";
  return s;
}

// The float64 conv of the sampled output pixel rows against tessera's y: y [R][Co] bf16 (row i of y is pixel
// rows[i]); x: the images that hold them, image slot[n] of x being image n, stored in p's x layout; w: the
// dequantized weight [Co][K]. Every output channel of every sampled row, on parallel_for's threads.
ErrorSum compare_rows(const Problem& p, const std::vector<int64_t>& rows, const std::vector<uint16_t>& y,
                      const std::vector<uint16_t>& x, const std::vector<int64_t>& slot, const std::vector<double>& w) {
  const Geometry& g = p.g;
  const int64_t K = p.k(), Co = g.co, Ci = g.ci, Ci_g = g.ci_g(), Co_g = g.co_g();
  const int64_t H = g.h, W = g.w, Wo = g.wo(), plane = g.ho() * Wo, image = H * W * Ci;
  const int64_t R = static_cast<int64_t>(rows.size());
  const bool nchw = p.x_layout == Layout::kNCHW;
  const int64_t tasks = (R + kRowsPerTask - 1) / kRowsPerTask;
  return parallel_error_sum(tasks, static_cast<double>(R) * Co * K, [&](int64_t t, ErrorSum& sum) {
    std::vector<double> col(static_cast<std::size_t>(K));
    for (int64_t i = t * kRowsPerTask; i < std::min(R, (t + 1) * kRowsPerTask); ++i) {
      const int64_t row = rows[i], img = row / plane, oh = row % plane / Wo, ow = row % Wo;
      const uint16_t* xi = x.data() + slot[img] * image;
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        // im2col of this pixel for group grp: col[(kh·Kw + kw)·Ci_g + ci], 0 in the padding
        for (int64_t kh = 0; kh < g.kh; ++kh)
          for (int64_t kw = 0; kw < g.kw; ++kw) {
            const int64_t ih = oh * g.stride - g.pad + kh, iw = ow * g.stride - g.pad + kw;
            const bool inside = ih >= 0 && ih < H && iw >= 0 && iw < W;
            double* dst = col.data() + (kh * g.kw + kw) * Ci_g;
            for (int64_t c = 0; c < Ci_g; ++c) {
              const int64_t ch = grp * Ci_g + c;
              dst[c] =
                  !inside ? 0.0 : host::bf16_to_f32(nchw ? xi[(ch * H + ih) * W + iw] : xi[(ih * W + iw) * Ci + ch]);
            }
          }
        for (int64_t co = grp * Co_g; co < (grp + 1) * Co_g; ++co) {
          const double* wr = w.data() + co * K;
          double acc = 0.0;
          for (int64_t r = 0; r < K; ++r) acc += col[r] * wr[r];
          sum.add(host::bf16_to_f32(y[i * Co + co]), acc);
        }
      }
    }
  });
}

// ============================================================================================================
// tessera
class ConvCase final : public CaseInstance {
 public:
  ConvCase(const DeviceContext& ctx, const std::string& op, const Problem& p) : p_(p), device_(ctx.device) {
    const std::string name = p.name();
    sets_ = rotating_sets(ctx, p.input_bytes());
    const Geometry& g = p.g;
    for (int s = 0; s < sets_; ++s) {
      Set set;
      set.in = make_inputs(p, case_seed(op, name, s), ctx.stream);
      linear::LinearWeight& lw = set.w.w;
      lw.codes = TensorView::contiguous(set.in.codes.get(), DType::kUInt8, {p.padded_n(), p.padded_k() * p.bits() / 8},
                                        device_);
      lw.params = TensorView::contiguous(set.in.params.get(), DType::kBF16, {p.padded_n(), p.num_blocks(), 2}, device_);
      lw.n = g.co;
      lw.k = p.k();
      lw.bits = p.bits();
      lw.block = p.block();
      lw.zero_mode = ZeroMode::kZeroPoint;
      set.w.kh = g.kh;
      set.w.kw = g.kw;
      set.x = p.x_layout == Layout::kNCHW
                  ? TensorView::contiguous(set.in.x.get(), DType::kBF16, {g.n, g.ci, g.h, g.w}, device_)
                  : TensorView::contiguous(set.in.x.get(), DType::kBF16, {g.n, g.h, g.w, g.ci}, device_);
      sets_data_.push_back(std::move(set));
    }
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    params_ = p.params();
    const conv::ConvWeight& w0 = sets_data_[0].w;
    path_ = conv::conv2d_path(g.n, g.h, g.w, w0, params_, DType::kBF16);
    if (path_ != p.path())
      throw Error(std::string("tessera-bench: conv2d takes the ") + conv::conv_path_name(path_) +
                  " path on this case, its name says " + conv::conv_path_name(p.path()) +
                  " (bench/conv_cases.cpp's expected_path no longer matches the op's rules)");
    y_.allocate(p.y_elems() * 2);
    y_view_ = TensorView::contiguous(y_.get(), DType::kBF16, {g.n, g.ho(), g.wo(), g.co}, device_);
    workspace_bytes_ = conv::conv2d_workspace_bytes(g.n, g.h, g.w, w0, params_, DType::kBF16);
    workspace_.allocate(workspace_bytes_);
  }

  int num_sets() const override { return sets_; }

  void run(cudaStream_t stream, int set) override {
    const Set& s = sets_data_[set];
    conv::conv2d(s.x, s.w, y_view_, params_, linear::LinearEpilogue{}, Workspace{workspace_.get(), workspace_bytes_},
                 stream);
  }

  CheckResult check(cudaStream_t stream) override {
    y_.fill_async(0xFF, stream);  // bf16 NaN
    run(stream, 0);
    const Geometry& g = p_.g;
    const int64_t K = p_.k(), Co = g.co, plane = g.ho() * g.wo(), image = g.h * g.w * g.ci;
    const RowSample sample = sample_pixel_rows(p_);
    const std::vector<int64_t>& rows = sample.rows;
    const Set& set = sets_data_[0];

    // y's sampled rows; x's images that hold them (NHWC or NCHW, as stored); the whole weight (small), unpacked.
    const std::vector<uint16_t> y = download_rows<uint16_t>(y_, Co, rows, stream);
    std::vector<int64_t> slot(static_cast<std::size_t>(g.n), -1);
    std::vector<int64_t> images;
    for (int64_t r : rows)
      if (slot[r / plane] < 0) slot[r / plane] = static_cast<int64_t>(images.size()), images.push_back(r / plane);
    std::vector<uint16_t> x(images.size() * static_cast<std::size_t>(image));
    for (std::size_t i = 0; i < images.size(); ++i) {
      const std::vector<uint16_t> part = download_range<uint16_t>(set.in.x, images[i] * image, image, stream);
      std::copy(part.begin(), part.end(), x.begin() + static_cast<std::ptrdiff_t>(i * image));
    }
    linear::PackedWeight pw;
    pw.n = Co;
    pw.k = K;
    pw.bits = p_.bits();
    pw.block = p_.block();
    pw.zero_mode = ZeroMode::kZeroPoint;
    pw.compute_dtype = DType::kBF16;
    pw.codes = set.in.codes.download<uint8_t>(p_.code_bytes(), stream);
    pw.params = set.in.params.download<uint16_t>(2 * p_.pairs(), stream);
    const std::vector<double> w = reference::dequantize_weight(linear::unpack(pw));  // [Co][K]

    const ErrorSum total = compare_rows(p_, rows, y, x, slot, w);
    const std::string what = sample.what + " x all " + std::to_string(Co) +
                             " output channels, weights unpacked from the device layout, path " +
                             conv::conv_path_name(path_);
    return total.result(what, kTolerance);
  }

 private:
  struct Set {
    ConvInputs in;
    conv::ConvWeight w;
    TensorView x;
  };
  Problem p_;
  int device_;
  int sets_ = 1;
  std::vector<Set> sets_data_;
  conv::Conv2dParams params_;
  ConvPath path_ = ConvPath::kDirect;
  DeviceBuffer y_, workspace_;
  TensorView y_view_;
  std::size_t workspace_bytes_ = 0;
};

// ============================================================================================================
// registration
constexpr const char* kOp = "conv2d";

void add_conv_cases(std::vector<CaseSpec>& cases) {
  Geometry c1{1, 256, 56, 56, 256, 3, 3, 1, 1, 1};
  Geometry c2{8, 512, 28, 28, 512, 3, 3, 1, 1, 1};
  Geometry c3{32, 64, 112, 112, 128, 3, 3, 2, 1, 1};
  Geometry c4{16, 1024, 14, 14, 1024, 1, 1, 1, 0, 1};
  Geometry dw{8, 384, 28, 28, 384, 3, 3, 1, 1, 384};
  Geometry stem{8, 3, 224, 224, 64, 7, 7, 2, 3, 1};

  // Blocks of 128 where 128 divides K, else of 64 (case 3: K = 576).
  auto grouped = [](const Geometry& g, int bits) {
    const int64_t block = g.k() % 128 == 0 ? 128 : 64;
    if (g.k() % block != 0) throw Error("tessera-bench: conv2d " + g.name() + ": K is not a multiple of 64");
    return Format{bits, block};
  };
  const Format int4_channel{4, 0}, int8_channel{8, 0};

  // In table order: per geometry its formats; headline marks the default suite.
  struct Entry {
    Problem p;
    bool headline;
  };
  const std::vector<Entry> grid = {
      {{c1, grouped(c1, 4), Layout::kNHWC}, true},  {{c1, grouped(c1, 8), Layout::kNHWC}, false},
      {{c1, grouped(c1, 4), Layout::kNCHW}, false}, {{c2, grouped(c2, 4), Layout::kNHWC}, true},
      {{c2, grouped(c2, 8), Layout::kNHWC}, true},  {{c3, grouped(c3, 4), Layout::kNHWC}, true},
      {{c3, grouped(c3, 8), Layout::kNHWC}, false}, {{c4, grouped(c4, 4), Layout::kNHWC}, true},
      {{c4, grouped(c4, 8), Layout::kNHWC}, false}, {{dw, int4_channel, Layout::kNHWC}, false},
      {{dw, int8_channel, Layout::kNHWC}, false},   {{stem, int4_channel, Layout::kNHWC}, false},
      {{stem, int8_channel, Layout::kNHWC}, false},
  };

  for (const Entry& e : grid) {
    const Problem p = e.p;
    CaseSpec c;
    c.op = kOp;
    c.name = p.name();
    c.headline = e.headline;
    c.bytes = p.bytes();
    c.flops = p.flops();
    c.setup = [p](const DeviceContext& ctx) -> std::unique_ptr<CaseInstance> {
      return std::make_unique<ConvCase>(ctx, kOp, p);
    };
    cases.push_back(std::move(c));
  }
}

}  // namespace

TESSERA_BENCH_CASES(add_conv_cases);

}  // namespace tessera::bench
