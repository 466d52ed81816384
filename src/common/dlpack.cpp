#include "tessera/dlpack.h"

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
  v.dtype = dtype_from_dl(t.dtype, arg);
  v.rank = t.ndim;
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = t.shape[d];
    v.strides[d] = t.strides ? t.strides[d] : stride;
    stride *= t.shape[d];
  }
  return v;
}

}  // namespace tessera
