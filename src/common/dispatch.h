// Internal: runtime value -> compile-time type/constant dispatch. Unsupported values throw tessera::Error; the
// launch path validates first, so these throws are a second line of defence, not the user-facing message.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "tessera/error.h"
#include "tessera/tensor.h"

// Calls __VA_ARGS__ with `T` bound to the element type of a 16-bit or 32-bit float dtype.
#define TESSERA_DISPATCH_FLOAT(dtype, T, ...)                                                     \
  [&] {                                                                                           \
    switch (dtype) {                                                                              \
      case ::tessera::DType::kFP32: { using T = float; return __VA_ARGS__(); }                    \
      case ::tessera::DType::kBF16: { using T = __nv_bfloat16; return __VA_ARGS__(); }            \
      case ::tessera::DType::kFP16: { using T = __half; return __VA_ARGS__(); }                   \
      default:                                                                                    \
        throw ::tessera::Error(std::string("tessera: no kernel for dtype ") +                      \
                               ::tessera::dtype_name(dtype));                                     \
    }                                                                                             \
  }()

// Calls __VA_ARGS__ with `T` bound to the element type of a 16-bit float dtype.
#define TESSERA_DISPATCH_HALF(dtype, T, ...)                                                      \
  [&] {                                                                                           \
    switch (dtype) {                                                                              \
      case ::tessera::DType::kBF16: { using T = __nv_bfloat16; return __VA_ARGS__(); }            \
      case ::tessera::DType::kFP16: { using T = __half; return __VA_ARGS__(); }                   \
      default:                                                                                    \
        throw ::tessera::Error(std::string("tessera: no kernel for dtype ") +                      \
                               ::tessera::dtype_name(dtype));                                     \
    }                                                                                             \
  }()
