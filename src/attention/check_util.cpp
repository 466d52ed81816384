// Argument rules shared by the attention families' validation (decode, append_kv, prefill): check_util.h.
#include "attention/check_util.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace tessera::attention::detail {

std::string str(int64_t v) { return std::to_string(v); }

std::string strides_str(const TensorView& t) {
  std::string s = "[";
  for (int d = 0; d < t.rank; ++d) s += (d ? ", " : "") + str(t.strides[d]);
  return s + "]";
}

bool supported_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

TensorView normalized(TensorView t) {
  int64_t extent = 1;  // elements the inner dims reach
  for (int d = t.rank - 1; d >= 0; --d) {
    if (t.shape[d] <= 1) t.strides[d] = extent;
    else extent = std::max(extent, std::abs(t.strides[d]) * t.shape[d]);
  }
  return t;
}

void check_layout(const ArgCheck& check, const TensorView& t, const char* arg, bool unit_last, int64_t stride_bytes,
                  int64_t base_bytes) {
  for (int d = 0; d < t.rank; ++d)
    if (t.shape[d] < 0) check.fail(arg, "must have non-negative sizes, got shape " + t.shape_str());
  if (t.numel() == 0) return;
  if (unit_last) check.unit_inner_stride(t, arg);
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  for (int d = 0; d < t.rank; ++d) {
    if (t.strides[d] < 0)
      check.fail(arg, "must have non-negative strides, got " + str(t.strides[d]) + " in dim " + str(d));
    if (stride_bytes > 0 && !(unit_last && d == t.rank - 1) && (t.strides[d] * elem) % stride_bytes != 0)
      check.fail(arg, "must have a stride in dim " + str(d) + " that is a multiple of " + str(stride_bytes) +
                          " bytes (" + str(stride_bytes / elem) + " elements of " + dtype_name(t.dtype) + "), got " +
                          str(t.strides[d]));
  }
  if (reinterpret_cast<std::uintptr_t>(t.data) % base_bytes != 0)
    check.fail(arg, "must start at a " + str(base_bytes) + "-byte aligned address");
}

void check_shape(const ArgCheck& check, const TensorView& t, const char* arg, std::initializer_list<int64_t> expected,
                 const char* what) {
  if (t.rank != static_cast<int>(expected.size()))
    check.fail(arg, "must have rank " + str(static_cast<int64_t>(expected.size())) + " (shape " + std::string(what) + "), got rank " +
                        str(t.rank) + " " + t.shape_str());
  bool ok = true;
  const int64_t* want = expected.begin();
  for (int d = 0; d < t.rank; ++d) ok = ok && t.shape[d] == want[d];
  if (ok) return;
  std::string s = "[";
  for (std::size_t d = 0; d < expected.size(); ++d) s += (d ? ", " : "") + str(want[d]);
  check.fail(arg, "must have shape " + std::string(what) + " = " + s + "], got " + t.shape_str());
}

void check_lengths(const ArgCheck& check, const TensorView& t, const char* arg, int64_t batch, const char* what) {
  check.dtype(t, arg, {DType::kInt32});
  check_shape(check, t, arg, {batch}, what);
  check.contiguous(t, arg);
  check_layout(check, t, arg, true, 0, 4);
}

bool spans_overlap(const TensorView& a, const TensorView& b) {
  const auto span = [](const TensorView& t) {
    const auto base = reinterpret_cast<std::uintptr_t>(t.data);
    int64_t last = 0;
    for (int d = 0; d < t.rank; ++d) last += (t.shape[d] - 1) * t.strides[d];
    return std::make_pair(base, base + static_cast<std::uintptr_t>((last + 1) * dtype_size(t.dtype)));
  };
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

bool disjoint_twins(const TensorView& a, const TensorView& b) {
  if (!spans_overlap(a, b)) return true;
  const std::intptr_t delta = reinterpret_cast<std::intptr_t>(b.data) - reinterpret_cast<std::intptr_t>(a.data);
  ByteDims dims = byte_dims(a);
  dims.emplace_back(delta < 0 ? -static_cast<int64_t>(delta) : static_cast<int64_t>(delta), 2);
  return injective(dims);
}

void check_outputs_apart(const ArgCheck& check, const std::vector<Named>& inputs, const std::vector<Named>& outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (const Named& in : inputs) check.no_overlap(*in.t, in.name, *outputs[i].t, outputs[i].name);
    for (std::size_t j = 0; j < i; ++j) check.no_overlap(*outputs[j].t, outputs[j].name, *outputs[i].t, outputs[i].name);
  }
}

void check_softcap_window(const ArgCheck& check, float softcap, int window) {
  if (!std::isfinite(softcap) || softcap < 0.0f)
    check.fail("params.softcap", "must be finite and >= 0 (0 disables it), got " + std::to_string(softcap));
  if (window < 0) check.fail("params.window", "must be >= 0 (0 attends to every key), got " + str(window));
}

}  // namespace tessera::attention::detail
