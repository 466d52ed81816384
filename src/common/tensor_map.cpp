#include "common/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>

#include "common/check.h"
#include "common/map_cache.h"
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

// Everything a map is encoded from. cuTensorMapEncodeTiled is a pure function of these (it reads no device or
// context state), so a map encoded once can serve every later call with equal arguments.
struct MapKey {
  CUtensorMapDataType type;
  int rank;
  void* data;
  cuuint64_t dims[5];
  cuuint64_t strides[4];
  cuuint32_t box[5];
  CUtensorMapSwizzle swizzle;
  L2Promotion promotion;

  bool operator==(const MapKey& o) const {
    if (type != o.type || rank != o.rank || data != o.data || swizzle != o.swizzle || promotion != o.promotion)
      return false;
    for (int i = 0; i < rank; ++i)
      if (dims[i] != o.dims[i] || box[i] != o.box[i] || (i > 0 && strides[i - 1] != o.strides[i - 1])) return false;
    return true;
  }

  // Over the fields operator== compares (the ones past rank are zero in every key encode builds).
  uint64_t hash() const {
    uint64_t h = hash_mix(static_cast<uint64_t>(type) * 131 + static_cast<uint64_t>(rank),
                          reinterpret_cast<uintptr_t>(data));
    h = hash_mix(h, static_cast<uint64_t>(swizzle) * 1024 + static_cast<uint64_t>(promotion));
    for (int i = 0; i < rank; ++i) h = hash_mix(h, dims[i] ^ (static_cast<uint64_t>(box[i]) << 48) ^
                                                       (i > 0 ? strides[i - 1] << 20 : 0));
    return hash_finish(h);
  }
};

// The maps this thread encoded: an op called again on the same tensors (every decode step of an engine reads the
// same cache; every layer of a model its own) skips the driver call, which costs more host time than the rest of the
// launch path (docs/perf/host_overhead.md). Per thread, so no lock. 2,048 entries (~0.55 MiB, allocated on the first
// encode) hold a step of a large MoE model: DeepSeek-V3's 58 MoE layers bring ~12 maps each, x and w of the two
// grouped GEMMs at three box sizes (map_cache.h).
using MapMemo = SetAssociativeCache<MapKey, CUtensorMap, 128, 16>;

CUtensorMap encode_uncached(const MapKey& k) {
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapL2promotion promotion = k.promotion == L2Promotion::k256B   ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                           : k.promotion == L2Promotion::k128B ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                                               : CU_TENSOR_MAP_L2_PROMOTION_NONE;
  CUtensorMap map;
  const CUresult r = tensor_map_encoder()(&map, k.type, static_cast<cuuint32_t>(k.rank), k.data, k.dims, k.strides,
                                          k.box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, k.swizzle, promotion,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error("tessera: cuTensorMapEncodeTiled rejected the tensor map (CUresult " +
                std::to_string(static_cast<int>(r)) + ")");
  }
  return map;
}

CUtensorMap encode(CUtensorMapDataType type, int rank, void* data, const cuuint64_t* dims, const cuuint64_t* strides,
                   const cuuint32_t* box, CUtensorMapSwizzle swizzle, L2Promotion promotion) {
  MapKey key{};
  key.type = type;
  key.rank = rank;
  key.data = data;
  for (int i = 0; i < rank; ++i) {
    key.dims[i] = dims[i];
    key.box[i] = box[i];
    if (i > 0) key.strides[i - 1] = strides[i - 1];
  }
  key.swizzle = swizzle;
  key.promotion = promotion;
  thread_local MapMemo memo;
  const uint64_t hash = key.hash();
  if (const CUtensorMap* hit = memo.find(key, hash)) return *hit;
  const CUtensorMap map = encode_uncached(key);  // throws on a rejected map: nothing is remembered
  memo.insert(key, hash, map);
  return map;
}

}  // namespace

namespace {

CUtensorMap tensor_map_sw128(int rank, const void* data, TmaElement element, int64_t dim0, int64_t dim1, int64_t dim2,
                             int64_t dim3, int64_t stride1, int64_t stride2, int64_t stride3, int box_rows,
                             int box_planes) {
  constexpr int64_t kBoxBytes = 128;  // one swizzle row
  const int64_t elem = element == TmaElement::kU8 ? 1 : 2;
  const CUtensorMapDataType type =
      element == TmaElement::kU8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(dim0), static_cast<cuuint64_t>(dim1),
                              static_cast<cuuint64_t>(dim2), static_cast<cuuint64_t>(dim3)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(stride1 * elem), static_cast<cuuint64_t>(stride2 * elem),
                                 static_cast<cuuint64_t>(stride3 * elem)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(kBoxBytes / elem), static_cast<cuuint32_t>(box_rows),
                              static_cast<cuuint32_t>(box_planes), 1};
  return encode(type, rank, const_cast<void*>(data), dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                L2Promotion::k256B);
}

}  // namespace

CUtensorMap make_tensor_map_sw128(const void* data, TmaElement element, int64_t dim0, int64_t dim1, int64_t dim2,
                                  int64_t stride1, int64_t stride2, int box_rows) {
  return tensor_map_sw128(3, data, element, dim0, dim1, dim2, 1, stride1, stride2, stride2, box_rows, 1);
}

CUtensorMap make_tensor_map_sw128(const void* data, TmaElement element, int64_t dim0, int64_t dim1, int64_t dim2,
                                  int64_t dim3, int64_t stride1, int64_t stride2, int64_t stride3, int box_rows,
                                  int box_planes) {
  return tensor_map_sw128(4, data, element, dim0, dim1, dim2, dim3, stride1, stride2, stride3, box_rows, box_planes);
}

CUtensorMap make_tensor_map_im2col(const void* data, const Im2colBox& b) {
  static const PFN_cuTensorMapEncodeIm2col_v12000 encoder = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    TESSERA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeIm2col", &ptr, 12000, cudaEnableDefault,
                                                        &status));
    if (status != cudaDriverEntryPointSuccess || ptr == nullptr)
      throw CudaError("tessera: the CUDA driver does not provide cuTensorMapEncodeIm2col");
    return reinterpret_cast<PFN_cuTensorMapEncodeIm2col_v12000>(ptr);
  }();
  constexpr cuuint64_t kElem = 2;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(b.c), static_cast<cuuint64_t>(b.w),
                              static_cast<cuuint64_t>(b.h), static_cast<cuuint64_t>(b.n)};
  const cuuint64_t strides[3] = {dims[0] * kElem, dims[0] * dims[1] * kElem, dims[0] * dims[1] * dims[2] * kElem};
  // Corners innermost first, as the dimensions: {W, H}.
  const int lower[2] = {b.lower_w, b.lower_h}, upper[2] = {b.upper_w, b.upper_h};
  const cuuint32_t elem_strides[4] = {1, static_cast<cuuint32_t>(b.stride_w), static_cast<cuuint32_t>(b.stride_h), 1};
  CUtensorMap map;
  const CUresult r = encoder(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(data), dims, strides, lower,
                             upper, 64, static_cast<cuuint32_t>(b.pixels), elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("tessera: cuTensorMapEncodeIm2col rejected the tensor map (CUresult " +
                std::to_string(static_cast<int>(r)) + ")");
  return map;
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
