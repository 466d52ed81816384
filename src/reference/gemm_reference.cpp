#include "reference/gemm_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "common/host_numeric.h"
#include "reference/format.h"
#include "reference/parallel.h"
#include "tessera/error.h"

namespace tessera::reference {

namespace {

using detail::fmt;
using detail::hex16;

constexpr int64_t kScaleBlock = gemm::kGroupedGemmBlock;
constexpr int kRowBlock = 4;  // rows computed together: each weight element loaded once feeds 4 accumulators

void require(bool cond, const char* fn, const std::string& what) {
  if (!cond) throw Error(std::string("tessera::reference::") + fn + ": " + what);
}

// One past the largest element offset of a strided tensor (0 if it is empty). Strides must be >= 0.
int64_t extent(std::initializer_list<std::pair<int64_t, int64_t>> size_stride) {
  int64_t last = 0;
  for (const auto& [size, stride] : size_stride) {
    if (size <= 0) return 0;
    last += (size - 1) * stride;
  }
  return last + 1;
}

using detail::num_workers;
using detail::parallel;

// A run of up to kRowBlock consecutive rows of one group.
struct RowBlock {
  int group;
  int64_t row;  // first row, local to the group (masked) or global (contiguous)
  int count;
};

template <typename Elem, typename Decode>
GroupedGemmRef compute(const char* fn, const std::vector<Elem>& x, const std::vector<Elem>& w,
                       const std::vector<int32_t>& group_rows, const GroupedGemmScales* scales,
                       const GroupedGemmShape& s, int num_threads, Decode decode) {
  const int G = s.num_groups;
  const int64_t N = s.n, K = s.k;
  require(G >= 1, fn, "num_groups must be >= 1");
  require(s.rows >= 0 && N >= 0 && K >= 0, fn, "rows, n and k must be >= 0");
  require(s.x_row_stride >= 0 && s.x_group_stride >= 0 && s.w_row_stride >= 0 && s.w_group_stride >= 0, fn,
          "strides must be >= 0");
  const int64_t x_extent = s.masked ? extent({{G, s.x_group_stride}, {s.rows, s.x_row_stride}, {K, 1}})
                                    : extent({{s.rows, s.x_row_stride}, {K, 1}});
  require(static_cast<int64_t>(x.size()) >= x_extent, fn,
          "x holds " + std::to_string(x.size()) + " elements, its shape and strides span " + std::to_string(x_extent));
  const int64_t w_extent = extent({{G, s.w_group_stride}, {N, s.w_row_stride}, {K, 1}});
  require(static_cast<int64_t>(w.size()) >= w_extent, fn,
          "w holds " + std::to_string(w.size()) + " elements, its shape and strides span " + std::to_string(w_extent));

  const bool blockwise = scales && scales->mode == gemm::ScaleMode::kBlockwise;
  const int64_t num_kb = (K + kScaleBlock - 1) / kScaleBlock, num_nb = (N + kScaleBlock - 1) / kScaleBlock;
  if (scales) {
    const GroupedGemmScales& sc = *scales;
    require(sc.xs_row_stride >= 0 && sc.xs_k_stride >= 0 && sc.xs_group_stride >= 0 && sc.ws_group_stride >= 0 &&
                sc.ws_n_stride >= 0 && sc.ws_k_stride >= 0,
            fn, "scale strides must be >= 0");
    int64_t xs_extent = 1, ws_extent = extent({{G, sc.ws_group_stride}});
    if (blockwise) {
      xs_extent = s.masked ? extent({{G, sc.xs_group_stride}, {s.rows, sc.xs_row_stride}, {num_kb, sc.xs_k_stride}})
                           : extent({{s.rows, sc.xs_row_stride}, {num_kb, sc.xs_k_stride}});
      ws_extent = extent({{G, sc.ws_group_stride}, {num_nb, sc.ws_n_stride}, {num_kb, sc.ws_k_stride}});
    } else {
      require(sc.mode == gemm::ScaleMode::kPerTensor, fn, "unknown scale mode");
    }
    require(static_cast<int64_t>(sc.x_scale.size()) >= xs_extent, fn, "x_scale is smaller than its shape and strides");
    require(static_cast<int64_t>(sc.w_scale.size()) >= ws_extent, fn, "w_scale is smaller than its shape and strides");
  }

  GroupedGemmRef ref;
  ref.shape = s;
  ref.groups = clamp_group_rows(group_rows, s);
  ref.value_offset.resize(G);
  int64_t values = 0;
  std::vector<RowBlock> blocks;
  for (int g = 0; g < G; ++g) {
    ref.value_offset[g] = values;
    const int64_t b = ref.groups.begin[g], e = ref.groups.end[g];
    values += (e - b) * N;
    for (int64_t r = b; r < e; r += kRowBlock)
      blocks.push_back({g, r, static_cast<int>(std::min<int64_t>(kRowBlock, e - r))});
  }
  ref.y.assign(values, 0.0);
  ref.mag.assign(values, 0.0);
  if (blocks.empty() || N == 0) return ref;

  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  const int threads = num_workers(num_threads, static_cast<double>(num_blocks) * kRowBlock * N * K, num_blocks);
  parallel(threads, [&](int t) {
    // Contiguous runs of blocks, so that each thread decodes few weight matrices.
    const int64_t first = num_blocks * t / threads, last = num_blocks * (t + 1) / threads;
    std::vector<float> wg(N * K);                 // W_g decoded; fp8 and bf16 values are exact in float
    std::vector<double> xr(kRowBlock * K, 0.0);   // the block's rows, zero past `count`
    std::vector<double> xs(kRowBlock * num_kb, 0.0);
    int cached = -1;
    for (int64_t bi = first; bi < last; ++bi) {
      const RowBlock& blk = blocks[bi];
      const int g = blk.group;
      if (g != cached) {
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k) wg[n * K + k] = decode(w[g * s.w_group_stride + n * s.w_row_stride + k]);
        cached = g;
      }
      std::fill(xr.begin(), xr.end(), 0.0);
      for (int i = 0; i < blk.count; ++i) {
        const int64_t row = blk.row + i;
        const int64_t base = (s.masked ? g * s.x_group_stride : 0) + row * s.x_row_stride;
        for (int64_t k = 0; k < K; ++k) xr[i * K + k] = decode(x[base + k]);
        if (blockwise)
          for (int64_t kb = 0; kb < num_kb; ++kb)
            xs[i * num_kb + kb] = scales->x_scale[(s.masked ? g * scales->xs_group_stride : 0) +
                                                  row * scales->xs_row_stride + kb * scales->xs_k_stride];
      }
      double factor = 1.0;
      if (scales && !blockwise)
        factor = static_cast<double>(scales->x_scale[0]) * scales->w_scale[g * scales->ws_group_stride];
      const int64_t k_step = blockwise ? kScaleBlock : std::max<int64_t>(K, 1);
      double* out = &ref.y[ref.value_offset[g] + (blk.row - ref.groups.begin[g]) * N];
      for (int64_t n = 0; n < N; ++n) {
        const float* wn = &wg[n * K];
        double acc[kRowBlock] = {}, acc_abs[kRowBlock] = {};
        for (int64_t k0 = 0; k0 < K; k0 += k_step) {
          const int64_t k1 = std::min(K, k0 + k_step);
          double part[kRowBlock] = {}, part_abs[kRowBlock] = {};
          for (int64_t k = k0; k < k1; ++k) {
            const double wv = wn[k];
            for (int i = 0; i < kRowBlock; ++i) {
              const double p = xr[i * K + k] * wv;
              part[i] += p;
              part_abs[i] += std::fabs(p);
            }
          }
          if (blockwise) {
            const int64_t kb = k0 / kScaleBlock;
            const double ws = scales->w_scale[g * scales->ws_group_stride + (n / kScaleBlock) * scales->ws_n_stride +
                                              kb * scales->ws_k_stride];
            for (int i = 0; i < kRowBlock; ++i) {
              const double sc = xs[i * num_kb + kb] * ws;
              acc[i] += part[i] * sc;
              acc_abs[i] += part_abs[i] * std::fabs(sc);
            }
          } else {
            for (int i = 0; i < kRowBlock; ++i) {
              acc[i] += part[i];
              acc_abs[i] += part_abs[i];
            }
          }
        }
        double* out_abs = &ref.mag[ref.value_offset[g] + (blk.row - ref.groups.begin[g]) * N];
        for (int i = 0; i < blk.count; ++i) {
          out[i * N + n] = acc[i] * factor;
          out_abs[i * N + n] = acc_abs[i] * std::fabs(factor);
        }
      }
    }
  });
  return ref;
}

}  // namespace

GroupRows clamp_group_rows(const std::vector<int32_t>& group_rows, const GroupedGemmShape& s) {
  const int G = s.num_groups;
  require(static_cast<int64_t>(group_rows.size()) == (s.masked ? G : G + 1), "clamp_group_rows",
          std::string(s.masked ? "masked_m must have num_groups" : "offsets must have num_groups + 1") +
              " elements, got " + std::to_string(group_rows.size()));
  GroupRows r;
  r.begin.resize(G);
  r.end.resize(G);
  for (int g = 0; g < G; ++g) {
    if (s.masked) {
      r.begin[g] = 0;
      r.end[g] = std::clamp<int64_t>(group_rows[g], 0, s.rows);
    } else {
      r.begin[g] = std::clamp<int64_t>(group_rows[g], 0, s.rows);
      r.end[g] = std::max(r.begin[g], std::clamp<int64_t>(group_rows[g + 1], 0, s.rows));
    }
  }
  return r;
}

int64_t GroupedGemmRef::rows_written() const {
  int64_t rows = 0;
  for (std::size_t g = 0; g < groups.begin.size(); ++g) rows += groups.end[g] - groups.begin[g];
  return rows;
}

GroupedGemmRef grouped_gemm_fp8(const std::vector<uint8_t>& x, const std::vector<uint8_t>& w,
                                const std::vector<int32_t>& group_rows, const GroupedGemmScales& scales,
                                const GroupedGemmShape& shape, int num_threads) {
  return compute("grouped_gemm_fp8", x, w, group_rows, &scales, shape, num_threads,
                 [](uint8_t b) { return host::e4m3_to_f32(b); });
}

GroupedGemmRef grouped_gemm_bf16(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w,
                                 const std::vector<int32_t>& group_rows, const GroupedGemmShape& shape,
                                 int num_threads) {
  return compute("grouped_gemm_bf16", x, w, group_rows, nullptr, shape, num_threads,
                 [](uint16_t h) { return host::bf16_to_f32(h); });
}

// ------------------------------------------------------------------------------------------------------------
namespace {

// What one thread of the check found.
struct Tally {
  double err2 = 0.0, ref2 = 0.0, max_abs = 0.0;
  int64_t compared = 0, nan = 0, out_of_bound = 0, poison = 0;
  std::string first_failure;  // the first in its range
  int64_t first_index = -1;   // where, for choosing the earliest over all threads

  // Records a failure at y[index]; the message is built only for the first (a broken kernel fails millions).
  template <typename MakeMsg>
  void fail(int64_t index, MakeMsg&& make_msg) {
    if (first_index < 0) {
      first_index = index;
      first_failure = make_msg();
    }
  }
};

}  // namespace

GroupedGemmCheck check_grouped_gemm(const GroupedGemmRef& ref, const std::vector<uint16_t>& y, int64_t y_row_stride,
                                    int64_t y_group_stride, uint16_t poison, const GemmTolerance& tol) {
  const char* fn = "check_grouped_gemm";
  const GroupedGemmShape& s = ref.shape;
  const int G = s.num_groups;
  const int64_t N = s.n, out_rows = ref.output_rows();
  require(y_row_stride >= 0 && y_group_stride >= 0, fn, "y strides must be >= 0");
  require(static_cast<int>(ref.groups.begin.size()) == G && static_cast<int>(ref.value_offset.size()) == G, fn,
          "the reference does not match its shape");
  const auto pos = [&](int64_t out_row) {
    return s.masked ? (out_row / s.rows) * y_group_stride + (out_row % s.rows) * y_row_stride
                    : out_row * y_row_stride;
  };

  // Owners of each output row (CSR): one group, or several where non-monotone offsets overlap.
  std::vector<int64_t> owner_start(out_rows + 1, 0);
  for (int g = 0; g < G; ++g)
    for (int64_t r = ref.groups.begin[g]; r < ref.groups.end[g]; ++r) ++owner_start[ref.output_row(g, r) + 1];
  for (int64_t r = 0; r < out_rows; ++r) owner_start[r + 1] += owner_start[r];
  std::vector<int32_t> owners(owner_start[out_rows]);
  {
    std::vector<int64_t> next(owner_start.begin(), owner_start.end() - 1);
    for (int g = 0; g < G; ++g)
      for (int64_t r = ref.groups.begin[g]; r < ref.groups.end[g]; ++r) owners[next[ref.output_row(g, r)]++] = g;
  }

  // Elements some group writes; everything else must hold the poison.
  std::vector<uint8_t> written(y.size(), 0);
  for (int64_t r = 0; r < out_rows; ++r) {
    if (owner_start[r] == owner_start[r + 1] || N == 0) continue;
    const int64_t p = pos(r);
    require(p + N <= static_cast<int64_t>(y.size()), fn,
            "output row " + std::to_string(r) + " lies past the end of y (" + std::to_string(y.size()) + " elements)");
    std::fill(written.begin() + p, written.begin() + p + N, 1);
  }

  double ref2 = 0.0;
  for (double v : ref.y)
    if (std::isfinite(v)) ref2 += v * v;
  const double rms = ref.y.empty() ? 0.0 : std::sqrt(ref2 / static_cast<double>(ref.y.size()));

  const int64_t buffer = static_cast<int64_t>(y.size());
  const int threads = num_workers(0, 50.0 * static_cast<double>(buffer + out_rows * N), std::max<int64_t>(out_rows, 1));
  std::vector<Tally> tallies(threads);
  parallel(threads, [&](int t) {
    Tally& tl = tallies[t];
    std::vector<const double*> cand;  // the reference row of each group that owns the row
    const int64_t r0 = out_rows * t / threads, r1 = out_rows * (t + 1) / threads;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o0 = owner_start[r], o1 = owner_start[r + 1];
      if (o0 == o1) continue;
      const int64_t local = s.masked ? r % s.rows : r;
      cand.clear();
      for (int64_t o = o0; o < o1; ++o) {
        const int g = owners[o];
        cand.push_back(&ref.y[ref.value_offset[g] + (local - ref.groups.begin[g]) * N]);
      }
      const uint16_t* got_row = &y[pos(r)];
      for (int64_t c = 0; c < N; ++c) {
        const double got = host::bf16_to_f32(got_row[c]);
        // The candidate the GPU wrote (one unless groups overlap): the closest of those within their own bound,
        // else the closest. (Overlapping groups race: any one of their results may land, and each candidate has
        // its own bound, so the closest candidate is not always the one whose bound holds.)
        int64_t best_o = -1;
        bool best_in = false;
        double best = 0.0, best_diff = 0.0;
        for (int64_t o = 0; o < o1 - o0; ++o) {
          const double d = std::fabs(got - cand[o][c]);
          const bool in = d <= tol.acc * ref.mag[(cand[o] - ref.y.data()) + c] + tol.rel * std::fabs(cand[o][c]);
          if (best_o < 0 || (in && !best_in) || (in == best_in && d < best_diff)) {
            best_o = o;
            best_in = in;
            best = cand[o][c];
            best_diff = d;
          }
        }
        const int best_g = owners[o0 + best_o];
        if (!std::isfinite(best)) continue;
        ++tl.compared;
        const auto where = [&] {
          std::string at = s.masked ? "y[g=" + std::to_string(r / s.rows) + ", row " + std::to_string(r % s.rows)
                                    : "y[row " + std::to_string(r);
          return at + ", col " + std::to_string(c) + "] = " + fmt(got) + " (" + hex16(got_row[c]) + "), expected " +
                 fmt(best) + " (group " + std::to_string(best_g) + (o1 - o0 > 1 ? ", one of overlapping groups" : "") +
                 ")";
        };
        if (!std::isfinite(got)) {
          ++tl.nan;
          tl.fail(pos(r) + c, where);
          continue;
        }
        const double diff = got - best;
        tl.err2 += diff * diff;
        tl.ref2 += best * best;
        tl.max_abs = std::max(tl.max_abs, std::fabs(diff));
        const double mag = ref.mag[(cand[best_o] - ref.y.data()) + c];
        const double bound = tol.acc * mag + tol.rel * std::fabs(best);
        if (!(std::fabs(diff) <= bound)) {
          ++tl.out_of_bound;
          tl.fail(pos(r) + c, [&] { return where() + ": |diff| " + fmt(std::fabs(diff)) + " > bound " + fmt(bound); });
        }
      }
    }
    const int64_t b0 = buffer * t / threads, b1 = buffer * (t + 1) / threads;
    for (int64_t i = b0; i < b1; ++i)
      if (!written[i] && y[i] != poison) {
        ++tl.poison;
        tl.fail(i, [&] {
          return "y buffer element " + std::to_string(i) + " = " + hex16(y[i]) +
                 ", which no group writes, lost its poison " + hex16(poison);
        });
      }
  });

  GroupedGemmCheck out;
  double err2 = 0.0, cmp_ref2 = 0.0;
  const Tally* first = nullptr;
  for (const Tally& tl : tallies) {
    err2 += tl.err2;
    cmp_ref2 += tl.ref2;
    out.max_abs_error = std::max(out.max_abs_error, tl.max_abs);
    out.compared += tl.compared;
    out.nan_count += tl.nan;
    out.out_of_bound += tl.out_of_bound;
    out.poison_touched += tl.poison;
    if (tl.first_index >= 0 && (!first || tl.first_index < first->first_index)) first = &tl;
  }
  out.ref_rms = rms;
  out.error = cmp_ref2 > 0.0 ? std::sqrt(err2 / cmp_ref2) : std::sqrt(err2);
  const bool frob_ok = out.error <= tol.frobenius;
  std::string summary = std::to_string(out.compared) + " elements in " + std::to_string(ref.rows_written()) +
                        " group rows: " + (cmp_ref2 > 0.0 ? "relative" : "absolute (reference all zero)") +
                        " Frobenius error " + fmt(out.error) + (frob_ok ? " <= " : " > ") + fmt(tol.frobenius) +
                        ", max |diff| " + fmt(out.max_abs_error) + ", ref rms " + fmt(rms) + "; " +
                        std::to_string(out.nan_count) + " non-finite, " + std::to_string(out.out_of_bound) +
                        " past |diff| <= " + fmt(tol.acc) + "*sum|products| + " +
                        fmt(tol.rel) + "*|ref|, " +
                        std::to_string(out.poison_touched) + " unowned elements lost the poison";
  out.ok = frob_ok && !first;
  out.message = first ? first->first_failure + " [" + summary + "]" : summary;
  return out;
}

}  // namespace tessera::reference
