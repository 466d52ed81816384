#include "common/validate.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <sstream>

#include "common/check.h"

namespace tessera::detail {

void ArgCheck::fail(const char* arg, const std::string& what) const {
  throw Error(std::string(op_) + ": '" + arg + "' " + what);
}

void ArgCheck::dtype(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) const {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) != allowed.end()) return;
  std::string list;
  for (DType d : allowed) list += (list.empty() ? "" : " | ") + std::string(dtype_name(d));
  fail(arg, "must have dtype " + list + ", got " + dtype_name(t.dtype));
}

void ArgCheck::rank(const TensorView& t, const char* arg, int expected) const {
  if (t.rank != expected)
    fail(arg, "must have rank " + std::to_string(expected) + ", got rank " + std::to_string(t.rank) + " " +
                  t.shape_str());
}

void ArgCheck::dim(const TensorView& t, const char* arg, int d, int64_t expected, const char* what) const {
  if (t.shape[d] != expected)
    fail(arg, "must have size " + std::to_string(expected) + " (" + what + ") in dim " + std::to_string(d) +
                  ", got shape " + t.shape_str());
}

void ArgCheck::contiguous(const TensorView& t, const char* arg) const {
  if (!t.is_contiguous()) fail(arg, "must be contiguous, got shape " + t.shape_str() + " with other strides");
}

void ArgCheck::contiguous_matrix(const TensorView& t, const char* arg, std::initializer_list<DType> dtypes,
                                 int64_t rows, const char* rows_what, int64_t cols, const char* cols_what) const {
  dtype(t, arg, dtypes);
  rank(t, arg, 2);
  dim(t, arg, 0, rows, rows_what);
  dim(t, arg, 1, cols, cols_what);
  contiguous(t, arg);
}

void ArgCheck::unit_inner_stride(const TensorView& t, const char* arg) const {
  if (t.rank > 0 && t.shape[t.rank - 1] > 1 && t.strides[t.rank - 1] != 1)
    fail(arg, "must have unit stride in its last dim, got stride " + std::to_string(t.strides[t.rank - 1]));
}

void ArgCheck::aligned(const TensorView& t, const char* arg, int bytes) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(t.data);
  if (t.numel() == 0) return;
  if (addr % bytes != 0)
    fail(arg, "must start at a " + std::to_string(bytes) + "-byte aligned address");
  if (t.rank >= 2 && t.shape[0] > 1 &&
      (t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype))) % bytes != 0)
    fail(arg, "must have rows " + std::to_string(bytes) + "-byte aligned, got row stride " +
                  std::to_string(t.strides[0]) + " elements of " + dtype_name(t.dtype));
}

void ArgCheck::device_count(const TensorView& t, const char* arg) const {
  dtype(t, arg, {DType::kInt32});
  if (t.numel() != 1) fail(arg, "must have 1 element, got shape " + t.shape_str());
  aligned(t, arg, 4);
}

ByteDims byte_dims(const TensorView& t) {
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  ByteDims dims = {{1, elem}};
  for (int d = 0; d < t.rank; ++d)
    if (t.shape[d] > 1) dims.emplace_back(t.strides[d] * elem, t.shape[d]);
  return dims;
}

bool injective(ByteDims dims) {
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // largest byte offset the dims so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return false;  // also catches a zero stride, sorted first
    span += stride * (size - 1);
  }
  return true;
}

namespace {
// The usual layout, decided without allocating: each dim's stride (elements) beyond the reach of the dims inside it,
// in the view's own order (row-major, padded rows included). Sufficient for no shared element; false sends the view
// to the exact test, which sorts its dims.
bool nested_strides(const TensorView& t) {
  int64_t reach = 0;
  for (int d = t.rank - 1; d >= 0; --d) {
    if (t.shape[d] <= 1) continue;
    int64_t span = 0;
    if (t.strides[d] <= reach || __builtin_mul_overflow(t.strides[d], t.shape[d] - 1, &span) ||
        __builtin_add_overflow(reach, span, &reach))
      return false;
  }
  return true;
}
}  // namespace

void ArgCheck::no_self_overlap(const TensorView& t, const char* arg) const {
  if (t.numel() == 0 || nested_strides(t) || injective(byte_dims(t))) return;
  std::string strides = "[";
  for (int d = 0; d < t.rank; ++d) strides += (d ? ", " : "") + std::to_string(t.strides[d]);
  fail(arg, "must not have elements that share memory (output), got shape " + t.shape_str() + " with strides " +
                strides + "]");
}

void ArgCheck::workspace(const Workspace& ws, std::size_t need, const char* sizing) const {
  if (workspace_fits(ws, need)) return;
  if (ws.data == nullptr || ws.bytes < need)
    fail("workspace", "must hold " + std::to_string(need) + " bytes" + sizing + ", got " + std::to_string(ws.bytes));
  if (reinterpret_cast<std::uintptr_t>(ws.data) % 16 != 0) fail("workspace", "must be 16-byte aligned");
}

void ArgCheck::on_current_device(const TensorView& t, const char* arg) const {
  if (t.numel() == 0) return;
  if (t.data == nullptr) fail(arg, "is a null pointer");
  // Host memory is an argument error whatever the machine: said before asking CUDA anything (with no driver,
  // that question is itself a CUDA error).
  if (t.device == TensorView::kHostDevice) fail(arg, "must be in device memory, got a host pointer");
  const int current = current_device();
  if (t.device != current)
    fail(arg, "must be on the current CUDA device " + std::to_string(current) + ", got " +
                  (t.device == TensorView::kHostDevice ? std::string("host memory")
                                                       : "device " + std::to_string(t.device)));
  if (t.device_verified) return;
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, t.data);
  if (err == cudaErrorInvalidValue) {  // a pointer the runtime does not know: the argument's fault
    (void)cudaGetLastError();
    fail(arg, "is not a pointer CUDA knows (" + std::string(cudaGetErrorName(err)) + ")");
  }
  // Anything else (a sticky error of an earlier kernel, a lost device) is the machine's: CudaError.
  if (err != cudaSuccess) TESSERA_CUDA_CHECK(err);
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    fail(arg, "must be in device memory, got a host pointer");
  if (attr.device != current)
    fail(arg, "must be on the current CUDA device " + std::to_string(current) + ", got memory of device " +
                  std::to_string(attr.device));
}

void ArgCheck::in_range(int64_t value, const char* arg, int64_t lo, int64_t hi) const {
  if (value < lo || value > hi)
    fail(arg, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(value));
}

void ArgCheck::same_dtype(const TensorView& a, const char* arg_a, const TensorView& b, const char* arg_b) const {
  if (a.dtype != b.dtype)
    fail(arg_b, std::string("must have the dtype of '") + arg_a + "' (" + dtype_name(a.dtype) + "), got " +
                    dtype_name(b.dtype));
}

namespace {
// [first byte, one past the last byte] a view can touch. A negative stride reaches below the base (a view from a
// DLPack producer may have one): the lowest and the highest element offsets are summed per dimension by sign.
std::pair<std::uintptr_t, std::uintptr_t> byte_span(const TensorView& t) {
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  int64_t low = 0, high = 0;
  for (int d = 0; d < t.rank; ++d) {
    const int64_t reach = (t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? low : high) += reach;
  }
  const auto esize = static_cast<int64_t>(dtype_size(t.dtype));
  return {base + static_cast<std::uintptr_t>(low * esize), base + static_cast<std::uintptr_t>((high + 1) * esize)};
}
}  // namespace

void ArgCheck::no_overlap(const TensorView& a, const char* arg_a, const TensorView& b, const char* arg_b) const {
  if (a.numel() == 0 || b.numel() == 0) return;
  const auto [a0, a1] = byte_span(a);
  const auto [b0, b1] = byte_span(b);
  if (a0 < b1 && b0 < a1) fail(arg_b, std::string("must not overlap '") + arg_a + "' in memory");
}

TensorView workspace_view(const Workspace& ws, std::size_t bytes, int device) {
  TensorView v = TensorView::contiguous(ws.data, DType::kUInt8, {static_cast<int64_t>(bytes)},
                                        ws.device_verified ? ws.device : device);
  v.device_verified = ws.device_verified;
  return v;
}

Workspace workspace_part(const Workspace& ws, std::size_t offset, std::size_t bytes) {
  Workspace part = ws;
  part.data = static_cast<unsigned char*>(ws.data) + offset;
  part.bytes = bytes;
  return part;
}

}  // namespace tessera::detail
