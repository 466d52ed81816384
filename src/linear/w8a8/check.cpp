#include "linear/w8a8/check.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace tessera::linear::w8a8 {

using ::tessera::detail::ArgCheck;

void check_block(const ArgCheck& check, const char* arg, int64_t block, int64_t k) {
  if (k <= 0 || k % 16 != 0) check.fail(arg, "needs K a positive multiple of 16, got K = " + std::to_string(k));
  if (block != 32 && block != 64 && block != 128 && block != k)
    check.fail(arg, "must be 32, 64, 128 or K (" + std::to_string(k) + "), got " + std::to_string(block));
  if (k % block != 0) check.fail(arg, "must divide K (" + std::to_string(k) + "), got " + std::to_string(block));
}

namespace {

// A parameter plane [K / block, rows] with row stride ld; `scale` is t.scale's name, whose ld the others share.
void check_plane(const ArgCheck& check, const TensorView& p, const std::string& arg, int64_t blocks, int64_t rows,
                 const char* rows_what, const TensorView& scale_view, const std::string& scale) {
  const char* a = arg.c_str();
  check.dtype(p, a, {DType::kFP32});
  check.rank(p, a, 2);
  check.dim(p, a, 0, blocks, "K / block");
  check.dim(p, a, 1, rows, rows_what);
  check.unit_inner_stride(p, a);
  const int64_t ld = p.strides[0];
  if (ld < rows || ld % 4 != 0)
    check.fail(a, "must have a row stride (ld) >= " + std::string(rows_what) + " (" + std::to_string(rows) +
                      ") and a multiple of 4, got " + std::to_string(ld));
  if (&p != &scale_view && ld != scale_view.strides[0])
    check.fail(a, "must have the row stride (ld) of '" + scale + "' (" + std::to_string(scale_view.strides[0]) +
                      "), got " + std::to_string(ld));
  check.aligned(p, a, 16);
}

}  // namespace

int64_t check_int8_blocks(const ArgCheck& check, const Int8BlockTensor& t, const std::string& name, int64_t rows,
                          const char* rows_what, int64_t k, bool need_sums) {
  const std::string codes = name + ".codes", scale = name + ".scale", zero = name + ".zero", sums = name + ".sums";
  check.dtype(t.codes, codes.c_str(), {DType::kInt8});
  check.rank(t.codes, codes.c_str(), 2);
  if (rows < 0) {
    rows = t.codes.shape[0];
    if (rows < 0) check.fail(codes.c_str(), "must have >= 0 rows, got shape " + t.codes.shape_str());
  }
  check.dim(t.codes, codes.c_str(), 0, rows, rows_what);
  check.dim(t.codes, codes.c_str(), 1, k, "K");
  check.unit_inner_stride(t.codes, codes.c_str());
  if (rows > 1 && (t.codes.strides[0] < k || t.codes.strides[0] % 16 != 0))
    check.fail(codes.c_str(), "must have a row stride >= K (" + std::to_string(k) + ") and a multiple of 16, got " +
                                  std::to_string(t.codes.strides[0]));
  check.aligned(t.codes, codes.c_str(), 16);

  const int64_t blocks = t.block > 0 ? k / t.block : 0;
  check_plane(check, t.scale, scale, blocks, rows, rows_what, t.scale, scale);
  if (t.zero.data != nullptr) check_plane(check, t.zero, zero, blocks, rows, rows_what, t.scale, scale);
  if (need_sums && t.sums.data == nullptr)
    check.fail(sums.c_str(), "is required: the other operand has zero points (its correction needs Σ codes)");
  if (t.sums.data != nullptr) {
    check_plane(check, t.sums, sums, blocks, rows, rows_what, t.scale, scale);
    if (t.block > (int64_t{1} << 17))
      check.fail(sums.c_str(),
                 "needs block <= 131072 (fp32 sums of codes exact), got block = " + std::to_string(t.block));
  }
  return rows;
}

void ArgViews::add(const TensorView& view, std::string arg, bool output) {
  // A library bug, not a bad call: the capacity covers the ops' largest list (gemm_w8a8's ten views; its workspace
  // is checked apart).
  if (size_ == entries_.size()) throw std::logic_error("tessera: ArgViews holds at most 10 views");
  entries_[size_++] = Entry{&view, std::move(arg), output};
}

void ArgViews::add_blocks(const Int8BlockTensor& t, const std::string& name, bool output) {
  add(t.codes, name + ".codes", output);
  add(t.scale, name + ".scale", output);
  if (t.zero.data != nullptr) add(t.zero, name + ".zero", output);
  if (t.sums.data != nullptr) add(t.sums, name + ".sums", output);
}

void check_disjoint(const ArgCheck& check, const ArgViews& views) {
  for (const ArgViews::Entry* out = views.begin(); out != views.end(); ++out) {
    if (!out->output) continue;
    for (const ArgViews::Entry& in : views)
      if (!in.output) check.no_overlap(*in.view, in.arg.c_str(), *out->view, out->arg.c_str());
    for (const ArgViews::Entry* prev = views.begin(); prev != out; ++prev)
      if (prev->output) check.no_overlap(*prev->view, prev->arg.c_str(), *out->view, out->arg.c_str());
  }
}

void check_on_device(const ArgCheck& check, const ArgViews& views) {
  // on_current_device rejects these two before it asks the driver anything.
  for (const ArgViews::Entry& e : views)
    if (e.view->numel() > 0 && (e.view->data == nullptr || e.view->device == TensorView::kHostDevice))
      check.on_current_device(*e.view, e.arg.c_str());
  for (const ArgViews::Entry& e : views) check.on_current_device(*e.view, e.arg.c_str());
}

}  // namespace tessera::linear::w8a8
