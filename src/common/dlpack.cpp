#include "tessera/dlpack.h"

#include <cstdint>
#include <string>

#include "tessera/error.h"

namespace tessera {

namespace {

[[noreturn]] void fail(const char* arg, const std::string& what) {
  throw Error(std::string("tessera::from_dlpack: '") + arg + "' " + what);
}

DType dtype_from_dl(DLDataType t, const char* arg) {
  if (t.lanes != 1) fail(arg, "must have 1 lane per element, got " + std::to_string(t.lanes));
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 32) return DType::kFP32;
      if (t.bits == 16) return DType::kFP16;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::kBF16;
      break;
    case kDLInt:
      if (t.bits == 8) return DType::kInt8;
      if (t.bits == 32) return DType::kInt32;
      if (t.bits == 64) return DType::kInt64;
      break;
    case kDLUInt:
      if (t.bits == 8) return DType::kUInt8;
      break;
    default:
      break;
  }
#if defined(DLPACK_MAJOR_VERSION) && (DLPACK_MAJOR_VERSION > 1 || DLPACK_MINOR_VERSION >= 1)
  // DLPack 1.1 added fp8 codes; older headers (Debian's 0.6) do not know them.
  if (t.code == kDLFloat8_e4m3fn && t.bits == 8) return DType::kFP8E4M3;
  if (t.code == kDLFloat8_e5m2 && t.bits == 8) return DType::kFP8E5M2;
#endif
  fail(arg, "has a DLPack dtype tessera does not support (code " + std::to_string(t.code) + ", bits " +
                std::to_string(t.bits) + ")");
}

}  // namespace

TensorView from_dlpack(const DLTensor& t, const char* arg) {
  TensorView v;
  if (t.ndim < 0 || t.ndim > TensorView::kMaxRank)
    fail(arg, "must have rank <= " + std::to_string(TensorView::kMaxRank) + ", got " + std::to_string(t.ndim));
  switch (t.device.device_type) {
    case kDLCUDA:
    case kDLCUDAManaged:
      v.device = t.device.device_id;
      break;
    case kDLCPU:
    case kDLCUDAHost:
      v.device = TensorView::kHostDevice;
      break;
    default:
      fail(arg, "must be a CUDA or CPU tensor, got DLPack device type " + std::to_string(t.device.device_type));
  }
  if (t.device.device_id < 0 && (t.device.device_type == kDLCUDA || t.device.device_type == kDLCUDAManaged))
    fail(arg, "has a negative CUDA device id " + std::to_string(t.device.device_id));
  v.dtype = dtype_from_dl(t.dtype, arg);
  v.rank = t.ndim;
  if (v.rank > 0 && t.shape == nullptr) fail(arg, "has rank " + std::to_string(v.rank) + " but no shape");
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  // Every element read at its own alignment (a byte_offset that breaks it would fault in a kernel).
  const auto esize = static_cast<std::uintptr_t>(dtype_size(v.dtype));
  if (reinterpret_cast<std::uintptr_t>(v.data) % esize != 0)
    fail(arg, "must start at a " + std::to_string(esize) + "-byte aligned address (data + byte_offset), got byte_offset " +
                  std::to_string(t.byte_offset));
  // Sizes >= 0, and the element count and every dim's reach within int64 (a wrapped count would read as empty or
  // small and skip the checks that guard the memory).
  constexpr int64_t kLimit = int64_t{1} << 62;
  bool empty = false;
  for (int d = 0; d < v.rank; ++d) {
    if (t.shape[d] < 0) fail(arg, "has a negative size " + std::to_string(t.shape[d]) + " in dim " + std::to_string(d));
    empty = empty || t.shape[d] == 0;
  }
  int64_t stride = 1, count = 1, reach = 0;
  for (int d = v.rank - 1; d >= 0; --d) {
    const int64_t n = t.shape[d];
    v.shape[d] = n;
    v.strides[d] = t.strides ? t.strides[d] : stride;
    if (v.strides[d] == INT64_MIN) fail(arg, "has a stride of INT64_MIN in dim " + std::to_string(d));
    const int64_t step = v.strides[d] < 0 ? -v.strides[d] : v.strides[d];
    // (A view without elements touches no memory: its other dims may be anything.)
    if (!empty && (count > kLimit / n || (n > 1 && step > (kLimit - reach) / (n - 1))))
      fail(arg, "is too large: its element count or extent overflows 64-bit indexing");
    count = empty ? 0 : count * n;
    reach += !empty && n > 1 ? step * (n - 1) : 0;
    // The compact stride of the next dim out: the product so far (saturated, which only an empty view can reach).
    stride = n != 0 && stride > kLimit / n ? kLimit : stride * n;
  }
  return v;
}

}  // namespace tessera
