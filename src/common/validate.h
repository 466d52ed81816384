// Internal: argument validation for launch.cu files. Each check throws tessera::Error whose message names the
// op, the argument, what was expected and what was given, before anything is launched.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

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
  void same_dtype(const TensorView& a, const char* arg_a, const TensorView& b, const char* arg_b) const;
  // Two tensors must not overlap in memory (outputs vs inputs).
  void no_overlap(const TensorView& a, const char* arg_a, const TensorView& b, const char* arg_b) const;

  const char* op() const { return op_; }

 private:
  const char* op_;
  mutable int current_device_ = -1;  // asked once per check object (one op call), not once per tensor
};

}  // namespace tessera::detail
