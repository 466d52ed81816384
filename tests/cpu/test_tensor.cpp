#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "tessera/dlpack.h"
#include "tessera/error.h"
#include "tessera/tensor.h"

namespace tessera {
namespace {

TEST(DType, NamesAndSizes) {
  EXPECT_STREQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_STREQ(dtype_name(DType::kFP8E4M3), "fp8_e4m3");
  EXPECT_STREQ(dtype_name(DType::kInt4x2), "int4x2");
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP32), 4u);
  EXPECT_EQ(dtype_size(DType::kFP8E5M2), 1u);
  EXPECT_EQ(dtype_size(DType::kInt8), 1u);
  EXPECT_EQ(dtype_size(DType::kUInt8), 1u);
  EXPECT_EQ(dtype_size(DType::kInt32), 4u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  EXPECT_EQ(dtype_size(DType::kInt4x2), 1u);
}

TEST(TensorView, ContiguousShapeStrides) {
  float data[24];
  const TensorView t = TensorView::contiguous(data, DType::kFP32, {2, 3, 4}, TensorView::kHostDevice);
  EXPECT_EQ(t.rank, 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.shape_str(), "[2, 3, 4]");
  TensorView s = t;
  s.strides[1] = 8;  // a view with padded rows
  EXPECT_FALSE(s.is_contiguous());
}

TEST(TensorView, RankLimit) {
  EXPECT_THROW(TensorView::contiguous(nullptr, DType::kFP32, {1, 1, 1, 1, 1, 1, 1}), Error);
}

DLTensor make_dl(void* data, DLDataType dt, int64_t* shape, int64_t* strides, int ndim, DLDeviceType dev) {
  DLTensor t{};
  t.data = data;
  t.device = DLDevice{dev, 0};
  t.ndim = ndim;
  t.dtype = dt;
  t.shape = shape;
  t.strides = strides;
  t.byte_offset = 0;
  return t;
}

TEST(DLPack, ConvertsDtypeShapeStridesDevice) {
  std::vector<uint16_t> buf(64);
  int64_t shape[2] = {4, 8};
  int64_t strides[2] = {16, 1};
  DLTensor dl = make_dl(buf.data(), DLDataType{kDLBfloat, 16, 1}, shape, strides, 2, kDLCPU);
  dl.byte_offset = 4;
  const TensorView v = from_dlpack(dl, "x");
  EXPECT_EQ(v.dtype, DType::kBF16);
  EXPECT_EQ(v.rank, 2);
  EXPECT_EQ(v.shape[1], 8);
  EXPECT_EQ(v.strides[0], 16);
  EXPECT_EQ(v.device, TensorView::kHostDevice);
  EXPECT_EQ(v.data, reinterpret_cast<char*>(buf.data()) + 4);
  EXPECT_FALSE(v.is_contiguous());

  DLTensor cuda = make_dl(buf.data(), DLDataType{kDLInt, 32, 1}, shape, nullptr, 2, kDLCUDA);
  cuda.device.device_id = 3;
  const TensorView c = from_dlpack(cuda, "ids");
  EXPECT_EQ(c.dtype, DType::kInt32);
  EXPECT_EQ(c.device, 3);
  EXPECT_EQ(c.strides[0], 8);  // no strides: contiguous
  EXPECT_TRUE(c.is_contiguous());
}

TEST(DLPack, RejectsUnsupportedDtypeAndDevice) {
  int64_t shape[1] = {4};
  double buf[4];
  DLTensor dl = make_dl(buf, DLDataType{kDLFloat, 64, 1}, shape, nullptr, 1, kDLCPU);
  try {
    from_dlpack(dl, "logits");
    FAIL() << "fp64 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'logits'"), std::string::npos) << e.what();
  }
  DLTensor vec = make_dl(buf, DLDataType{kDLFloat, 32, 4}, shape, nullptr, 1, kDLCPU);
  EXPECT_THROW(from_dlpack(vec, "x"), Error);
  DLTensor other = make_dl(buf, DLDataType{kDLFloat, 32, 1}, shape, nullptr, 1, kDLVulkan);
  EXPECT_THROW(from_dlpack(other, "x"), Error);
}

// What no kernel can be handed safely is refused by name at the conversion (found in review): negative sizes (a
// [-2, -3] view counted as 6 elements, a [-1] workspace as SIZE_MAX bytes), a byte_offset that breaks element
// alignment, element counts or extents past 64-bit indexing (a wrapped count read as empty skipped the checks), a
// shape pointer missing, a negative CUDA device id.
TEST(DLPack, RejectsNegativeSizesMisalignmentOverflowAndMissingShape) {
  std::vector<int32_t> buf(64);
  const auto rejected = [](DLTensor dl, const char* says) {
    try {
      from_dlpack(dl, "ids");
      ADD_FAILURE() << "accepted; expected: " << says;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'ids'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(says), std::string::npos) << msg;
    }
  };
  int64_t negative[2] = {-2, -3};
  rejected(make_dl(buf.data(), DLDataType{kDLInt, 32, 1}, negative, nullptr, 2, kDLCPU), "negative size");
  int64_t minus_one[1] = {-1};
  rejected(make_dl(buf.data(), DLDataType{kDLUInt, 8, 1}, minus_one, nullptr, 1, kDLCUDA), "negative size");
  int64_t shape[2] = {4, 8};
  DLTensor shifted = make_dl(buf.data(), DLDataType{kDLInt, 32, 1}, shape, nullptr, 2, kDLCUDA);
  shifted.byte_offset = 2;
  rejected(shifted, "4-byte aligned");
  shifted.byte_offset = 8;  // whole elements: fine
  EXPECT_NO_THROW(from_dlpack(shifted, "ids"));
  int64_t huge[2] = {int64_t{1} << 56, 256};
  rejected(make_dl(buf.data(), DLDataType{kDLFloat, 32, 1}, huge, nullptr, 2, kDLCUDA), "too large");
  int64_t strides[2] = {int64_t{1} << 61, 1};
  rejected(make_dl(buf.data(), DLDataType{kDLInt, 32, 1}, shape, strides, 2, kDLCUDA), "too large");
  int64_t empty[3] = {0, int64_t{1} << 40, int64_t{1} << 40};  // no element: any extent of the others is fine
  EXPECT_NO_THROW(from_dlpack(make_dl(buf.data(), DLDataType{kDLInt, 32, 1}, empty, nullptr, 3, kDLCUDA), "ids"));
  rejected(make_dl(buf.data(), DLDataType{kDLInt, 32, 1}, nullptr, nullptr, 2, kDLCUDA), "no shape");
  DLTensor bad_device = make_dl(buf.data(), DLDataType{kDLInt, 32, 1}, shape, nullptr, 2, kDLCUDA);
  bad_device.device.device_id = -1;
  rejected(bad_device, "negative CUDA device id");
}

}  // namespace
}  // namespace tessera
