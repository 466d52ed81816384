#include "common/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>

#include "common/check.h"
#include "tessera/error.h"

namespace tessera::detail {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    TESSERA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                                        &status));
    if (status != cudaDriverEntryPointSuccess || ptr == nullptr) {
      throw CudaError("tessera: the CUDA driver does not provide cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace

namespace {

CUtensorMap encode(CUtensorMapDataType type, int rank, void* data, const cuuint64_t* dims, const cuuint64_t* strides,
                   const cuuint32_t* box, CUtensorMapSwizzle swizzle, L2Promotion promotion) {
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = tensor_map_encoder()(&map, type, static_cast<cuuint32_t>(rank), data, dims, strides, box,
                                          elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                          promotion == L2Promotion::k256B   ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                          : promotion == L2Promotion::k128B ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                                            : CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error("tessera: cuTensorMapEncodeTiled rejected the tensor map (CUresult " +
                std::to_string(static_cast<int>(r)) + ")");
  }
  return map;
}

}  // namespace

CUtensorMap make_tensor_map_sw128(const void* data, TmaElement element, int64_t dim0, int64_t dim1, int64_t dim2,
                                  int64_t stride1, int64_t stride2, int box_rows) {
  constexpr int64_t kBoxBytes = 128;  // one swizzle row
  const int64_t elem = element == TmaElement::kU8 ? 1 : 2;
  const CUtensorMapDataType type =
      element == TmaElement::kU8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(dim0), static_cast<cuuint64_t>(dim1),
                              static_cast<cuuint64_t>(dim2)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(stride1 * elem), static_cast<cuuint64_t>(stride2 * elem)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kBoxBytes / elem), static_cast<cuuint32_t>(box_rows), 1};
  return encode(type, 3, const_cast<void*>(data), dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, L2Promotion::k256B);
}

CUtensorMap make_tensor_map_u8(const void* data, int rank, const int64_t* dims, const int64_t* strides_bytes,
                               const int* box, int swizzle_bytes, L2Promotion promotion) {
  if (rank < 1 || rank > 5) throw Error("tessera: a tensor map has rank 1 to 5, got " + std::to_string(rank));
  cuuint64_t d[5], s[4];
  cuuint32_t b[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = static_cast<cuuint64_t>(dims[i]);
    b[i] = static_cast<cuuint32_t>(box[i]);
    if (i > 0) s[i - 1] = static_cast<cuuint64_t>(strides_bytes[i - 1]);
  }
  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
  switch (swizzle_bytes) {
    case 0: break;
    case 32: swizzle = CU_TENSOR_MAP_SWIZZLE_32B; break;
    case 64: swizzle = CU_TENSOR_MAP_SWIZZLE_64B; break;
    case 128: swizzle = CU_TENSOR_MAP_SWIZZLE_128B; break;
    default: throw Error("tessera: tensor map swizzle must be 0, 32, 64 or 128 bytes, got " +
                         std::to_string(swizzle_bytes));
  }
  return encode(CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, const_cast<void*>(data), d, s, b, swizzle, promotion);
}

}  // namespace tessera::detail
