// tessera — non-owning tensor views and element types (public).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace tessera {

// Element types. kInt4x2 is one byte holding two signed 4-bit values (low nibble = even element); shapes and
// strides of a kInt4x2 view count bytes, not nibbles.
enum class DType : uint8_t {
  kBF16,
  kFP16,
  kFP32,
  kFP8E4M3,
  kFP8E5M2,
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
  kInt4x2,
};

const char* dtype_name(DType dtype);
// Storage size of one element, in bytes (kInt4x2: 1).
std::size_t dtype_size(DType dtype);

// A non-owning view of a strided tensor. Strides count elements. device is the CUDA device ordinal, or
// kHostDevice for host memory.
struct TensorView {
  static constexpr int kMaxRank = 6;
  static constexpr int kHostDevice = -1;

  void* data = nullptr;
  DType dtype = DType::kFP32;
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};
  int device = kHostDevice;
  // Set by an adapter whose framework guarantees that `data` is device memory of `device` (the PyTorch operators:
  // a CUDA tensor's storage). The validation then trusts the label instead of asking the driver about the pointer
  // (cudaPointerGetAttributes, ~0.3 us a tensor on the launch path). Leave false for raw pointers.
  bool device_verified = false;

  // A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               int device = 0);

  int64_t numel() const;
  int64_t size(int dim) const { return shape[dim < 0 ? dim + rank : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + rank : dim]; }
  bool is_contiguous() const;
  std::size_t nbytes_min() const;  // bytes spanned by a contiguous tensor of this shape
  std::string shape_str() const;   // "[4096, 7168]"
};

// Device scratch memory an op needs, sized by the op's *_workspace_bytes query and owned by the caller.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
  // As TensorView::device_verified: set by an adapter whose framework guarantees that `data` is device memory of
  // `device` (the PyTorch operators: a CUDA tensor's storage), so that the ops trust the label instead of asking the
  // driver about the pointer. Leave false (and device -1) for raw pointers; set both or neither (verified with device
  // -1 reads as host memory and is refused).
  bool device_verified = false;
  int device = -1;
};

}  // namespace tessera
