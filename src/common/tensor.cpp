#include <string>

#include "tessera/error.h"
#include "tessera/tensor.h"

namespace tessera {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kFP8E5M2: return "fp8_e5m2";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kInt4x2: return "int4x2";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16: return 2;
    case DType::kFP32:
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kInt4x2: return 1;
  }
  return 0;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape, int device) {
  if (shape.size() > static_cast<std::size_t>(kMaxRank))
    throw Error("tessera::TensorView::contiguous: rank " + std::to_string(shape.size()) + " exceeds " +
                std::to_string(kMaxRank));
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.rank = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) t.shape[d++] = s;
  int64_t stride = 1;
  for (d = t.rank - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::size_t TensorView::nbytes_min() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (int d = 0; d < rank; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

}  // namespace tessera
