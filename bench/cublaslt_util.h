// tessera-bench: the cuBLASLt pieces the peer cases share (error check, RAII handles, layouts, the workspace size,
// the heuristic's first algorithm).
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "tessera/error.h"

namespace tessera::bench {

[[noreturn]] inline void throw_cublas(cublasStatus_t st, const char* expr, const char* file, int line) {
  throw Error(std::string("tessera-bench: ") + expr + " failed: " + cublasLtGetStatusName(st) + " (" +
              cublasLtGetStatusString(st) + ") at " + file + ":" + std::to_string(line));
}
#define BENCH_CUBLAS_CHECK(expr)                                                                \
  do {                                                                                          \
    const cublasStatus_t bench_st_ = (expr);                                                    \
    if (bench_st_ != CUBLAS_STATUS_SUCCESS) throw_cublas(bench_st_, #expr, __FILE__, __LINE__); \
  } while (0)

template <typename T, auto Destroy>
struct LtDeleter {
  void operator()(T h) const noexcept { (void)Destroy(h); }
};
template <typename T, auto Destroy>
using LtPtr = std::unique_ptr<std::remove_pointer_t<T>, LtDeleter<T, Destroy>>;
using LtHandle = LtPtr<cublasLtHandle_t, cublasLtDestroy>;
using LtMatmulDesc = LtPtr<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using LtLayout = LtPtr<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using LtPreference = LtPtr<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

inline LtLayout make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t h = nullptr;
  BENCH_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&h, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  return LtLayout(h);
}

constexpr std::size_t kLtWorkspaceBytes = std::size_t(32) << 20;  // cuBLAS's recommendation for Hopper

// A cuBLASLt handle and a matmul descriptor in the "TN" form the peers use (A = the weight, transposed; B = the
// tokens): yᵀ = W · xᵀ in column-major terms. fp32 accumulation and scales by default; the int8 peers pass
// CUBLAS_COMPUTE_32I with CUDA_R_32I scales (int32 alpha / beta), the IMMA path cuBLASLt supports only in this "TN"
// form on row-major [rows, K] operands.
inline void create_tn_matmul(LtHandle& handle, LtMatmulDesc& desc, cublasComputeType_t compute = CUBLAS_COMPUTE_32F,
                             cudaDataType_t scale_type = CUDA_R_32F) {
  cublasLtHandle_t h = nullptr;
  BENCH_CUBLAS_CHECK(cublasLtCreate(&h));
  handle.reset(h);
  cublasLtMatmulDesc_t d = nullptr;
  BENCH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, compute, scale_type));
  desc.reset(d);
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  BENCH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  BENCH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
}

// A heuristic preference that allows kLtWorkspaceBytes of workspace.
inline LtPreference workspace_preference() {
  cublasLtMatmulPreference_t h = nullptr;
  BENCH_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&h));
  LtPreference pref(h);
  const uint64_t ws_bytes = kLtWorkspaceBytes;
  BENCH_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
  return pref;
}

// The heuristic's first algorithm for D = op(A)·op(B) with C = D and kLtWorkspaceBytes of workspace. Returns false
// when cuBLASLt has none for the problem (NOT_SUPPORTED, or no result), so that the caller can report the case as
// unsupported instead of failing; any other status throws.
inline bool first_heuristic_algo(const LtHandle& handle, const LtMatmulDesc& desc, const LtLayout& a, const LtLayout& b,
                                 const LtLayout& d, cublasLtMatmulAlgo_t& algo) {
  const LtPreference pref = workspace_preference();
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle.get(), desc.get(), a.get(), b.get(), d.get(),
                                                           d.get(), pref.get(), 1, &result, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && found == 0)) return false;
  BENCH_CUBLAS_CHECK(st);
  algo = result.algo;
  return true;
}

}  // namespace tessera::bench
