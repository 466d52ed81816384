// Internal: argument validation for launch.cu files. Each check throws tessera::Error whose message names the
// op, the argument, what was expected and what was given, before anything is launched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/device_info.h"
#include "tessera/error.h"
#include "tessera/tensor.h"

namespace tessera::detail {

class ArgCheck {
 public:
  explicit ArgCheck(const char* op) : op_(op) {}

  [[noreturn]] void fail(const char* arg, const std::string& what) const;

  void dtype(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) const;
  void rank(const TensorView& t, const char* arg, int expected) const;
  // t.shape[dim] == expected; `what` names the quantity in the message ("num_experts").
  void dim(const TensorView& t, const char* arg, int dim, int64_t expected, const char* what) const;
  void contiguous(const TensorView& t, const char* arg) const;
  // A contiguous [rows, cols] tensor of one of `dtypes` (the common shape of index and weight tensors).
  void contiguous_matrix(const TensorView& t, const char* arg, std::initializer_list<DType> dtypes, int64_t rows,
                         const char* rows_what, int64_t cols, const char* cols_what) const;
  void unit_inner_stride(const TensorView& t, const char* arg) const;
  // Data pointer and every row start (stride of dim 0) aligned to `bytes`.
  void aligned(const TensorView& t, const char* arg, int bytes) const;
  // Device memory on the current device (skipped for empty tensors).
  void on_current_device(const TensorView& t, const char* arg) const;
  void in_range(int64_t value, const char* arg, int64_t lo, int64_t hi) const;
  // A count read on the device (a token count for graph replays): int32, one element, 4-byte aligned.
  void device_count(const TensorView& t, const char* arg) const;
  // Distinct elements of an output do not share memory (two threads would race on one address): injective(byte_dims).
  void no_self_overlap(const TensorView& t, const char* arg) const;
  // The caller's workspace holds `need` bytes (> 0) and is 16-byte aligned; `sizing` follows "must hold N bytes" in the
  // message and names the size query (" for M = 5 (linear_workspace_bytes)").
  void workspace(const Workspace& ws, std::size_t need, const char* sizing) const;
  // The same, with the sizing part of the message built by sizing() only when the check fails (no string is built
  // on the launch path).
  template <typename Sizing, typename = std::enable_if_t<std::is_invocable_v<Sizing&>>>
  void workspace(const Workspace& ws, std::size_t need, Sizing&& sizing) const {
    if (!workspace_fits(ws, need)) workspace(ws, need, std::string(sizing()).c_str());
  }
  // What workspace() accepts: at least `need` bytes, 16-byte aligned.
  static bool workspace_fits(const Workspace& ws, std::size_t need) {
    return ws.data != nullptr && ws.bytes >= need && reinterpret_cast<std::uintptr_t>(ws.data) % 16 == 0;
  }
  void same_dtype(const TensorView& a, const char* arg_a, const TensorView& b, const char* arg_b) const;
  // Two tensors must not overlap in memory (outputs vs inputs).
  void no_overlap(const TensorView& a, const char* arg_a, const TensorView& b, const char* arg_b) const;

  const char* op() const { return op_; }

 private:
  const char* op_;
  // An op's checks live as long as its call: the device is asked of the runtime once per call (device_info.h).
  OpCallScope call_;
};

using ByteDims = std::vector<std::pair<int64_t, int64_t>>;  // (stride in bytes, size)

// The bytes a view touches, as dims: the element itself is an innermost dim of unit stride.
ByteDims byte_dims(const TensorView& t);

// Distinct indices address distinct bytes: sorted by stride, each stride reaches past everything the smaller ones
// span. Sufficient, not necessary; every dense, padded or interleaved layout satisfies it (a negative or zero stride
// fails it).
bool injective(ByteDims dims);

// The first `bytes` bytes of a caller's workspace as a byte view, for the overlap and device checks: labelled with the
// device its adapter vouched for (Workspace::device_verified: on_current_device then asks the driver nothing), else
// with `device` (the op's) and left to the driver's answer.
TensorView workspace_view(const Workspace& ws, std::size_t bytes, int device);

// Bytes [offset, offset + bytes) of a workspace, for an op that hands parts of its own to the ops it calls: with the
// same label (an adapter's vouching covers every part of the memory it vouched for).
Workspace workspace_part(const Workspace& ws, std::size_t offset, std::size_t bytes);

}  // namespace tessera::detail
