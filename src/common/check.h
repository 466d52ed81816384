// Internal: CUDA error checks. Every CUDA runtime call in tessera goes through TESSERA_CUDA_CHECK.
#pragma once

#include <cuda_runtime_api.h>

#include "tessera/error.h"

namespace tessera::detail {
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
}  // namespace tessera::detail

#define TESSERA_CUDA_CHECK(expr)                                                      \
  do {                                                                                \
    const cudaError_t tessera_err_ = (expr);                                          \
    if (tessera_err_ != cudaSuccess)                                                  \
      ::tessera::detail::throw_cuda_error(tessera_err_, #expr, __FILE__, __LINE__);   \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, not at the next sync.
#define TESSERA_CHECK_LAUNCH() TESSERA_CUDA_CHECK(cudaGetLastError())
