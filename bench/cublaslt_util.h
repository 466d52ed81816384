// tessera-bench: the cuBLASLt pieces the peer cases share (error check, RAII handles, layouts, the workspace size).
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

}  // namespace tessera::bench
