// Internal: validation of Int8BlockTensor arguments, shared by quantize_per_block (its output) and gemm_w8a8 (its
// operands). The layout rules ask the driver nothing; the device checks come last (check_on_device), so that a bad
// call is named as such even on a machine without a GPU.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/validate.h"
#include "tessera/w8a8.h"

namespace tessera::linear::w8a8 {

// The block is 32, 64, 128 or K; K a positive multiple of 16 and of the block.
void check_block(const ::tessera::detail::ArgCheck& check, const char* arg, int64_t block, int64_t k);

// The layout of t over `rows` rows (rows < 0: codes' dim 0, which must then be >= 0; `rows_what` names them in
// messages: "M", "N") and K columns, t.block already checked (check_block):
//   codes  int8 [rows, K], unit inner stride, 16-byte aligned, rows (when more than one) >= K apart and 16-byte
//          aligned: an output's rows must not overlap, and TMA reads an input's rows at 16-byte strides;
//   scale  fp32 [K / block, rows], unit inner stride, row stride ld >= rows and a multiple of 4, 16-byte aligned;
//   zero, sums  (when given) like scale, with scale's ld; sums required when `need_sums`, and only for
//          block <= 131072 (|Σ codes| <= 128 · block exact in fp32).
// `name` prefixes the argument names ("a" → "a.codes", "a.scale", ...). Returns rows.
int64_t check_int8_blocks(const ::tessera::detail::ArgCheck& check, const Int8BlockTensor& t, const std::string& name,
                          int64_t rows, const char* rows_what, int64_t k, bool need_sums);

// An op's tensor arguments with their names, in the order their errors are looked for; fixed capacity, so that the
// launch path does not allocate.
class ArgViews {
 public:
  struct Entry {
    const TensorView* view = nullptr;
    std::string arg;
    bool output = false;
  };

  void add(const TensorView& view, std::string arg, bool output);
  // t's codes and scale, and its zero and sums where given (data != nullptr), as `name`.codes, ...
  void add_blocks(const Int8BlockTensor& t, const std::string& name, bool output);

  const Entry* begin() const { return entries_.data(); }
  const Entry* end() const { return entries_.data() + size_; }

 private:
  std::array<Entry, 10> entries_;
  std::size_t size_ = 0;
};

// Every output overlaps no input and no output before it; the error names the output.
void check_disjoint(const ::tessera::detail::ArgCheck& check, const ArgViews& views);

// Every view in device memory of the current device. Null and host pointers of all the views are named before the
// first question to the driver (which, on a machine without a GPU, has no answer but a CUDA error).
void check_on_device(const ::tessera::detail::ArgCheck& check, const ArgViews& views);

}  // namespace tessera::linear::w8a8
