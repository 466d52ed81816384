// Decode launcher template: one instantiation set per KV format, each in its own translation unit
// (launch_<format>.cu) so that the builds run in parallel.
#pragma once

#include <cuda_runtime.h>

#include "attention/decode/kernel.cuh"
#include "attention/decode/problem.h"
#include "common/check.h"
#include "common/occupancy.h"
#include "common/pdl.h"
#include "tessera/error.h"

#include <string>
#include <type_traits>

namespace tessera::attention::detail {

// One kernel instantiation: raise its shared-memory limit, launch (as a programmatic dependent of the stream's
// previous kernel where args.programmatic, config.h: kernel.cuh waits for it before its first global access), check.
template <KVFormat kFormat, int kHeadDim, bool kNativeFP16, int kNT, bool kBalanced>
void launch_decode_kernel(const DecodeArgs& args, int grid, cudaStream_t stream) {
  using T = KVTraits<kFormat, kHeadDim, kNativeFP16>;
  auto kernel = decode_kernel<T, kNT, kBalanced>;
  constexpr int kSmem = DecodeLayout<T, kNT>::kBytes;
  // Raises the dynamic shared-memory limit (once per device); the answer itself is not needed.
  (void)::tessera::detail::resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kDecodeThreads, kSmem);
  if (args.programmatic) {
    ::tessera::detail::launch_programmatic(kernel, dim3(grid), dim3(kDecodeThreads), kSmem, stream, args);
  } else {
    kernel<<<grid, kDecodeThreads, kSmem, stream>>>(args);
    TESSERA_CHECK_LAUNCH();
  }
}

// Dispatches head_dim, the n-tiles of query rows (1 for up to 8 rows per KV head, else 2), the 16-bit type for kNative
// and the split plan (classic or balanced, config.h) to the instantiations of one format.
template <KVFormat kFormat>
void launch_decode_format(const DecodeArgs& args, int grid, cudaStream_t stream) {
  const CacheDesc& cd = args.cache;
  auto by_dim = [&](auto native_fp16, auto n_tiles) {
    constexpr bool kF16 = decltype(native_fp16)::value;
    constexpr int kNT = decltype(n_tiles)::value;
    auto by_plan = [&](auto head_dim) {
      constexpr int kD = decltype(head_dim)::value;
      if (args.balanced) return launch_decode_kernel<kFormat, kD, kF16, kNT, true>(args, grid, stream);
      launch_decode_kernel<kFormat, kD, kF16, kNT, false>(args, grid, stream);
    };
    switch (cd.head_dim) {
      case 64: return by_plan(std::integral_constant<int, 64>{});
      case 128: return by_plan(std::integral_constant<int, 128>{});
      case 256: return by_plan(std::integral_constant<int, 256>{});
      default: throw Error("tessera::attention::decode: no kernel for head_dim " + std::to_string(cd.head_dim));
    }
  };
  auto by_tiles = [&](auto native_fp16) {
    if (decode_n_tiles(args.rows) == 2) return by_dim(native_fp16, std::integral_constant<int, 2>{});
    by_dim(native_fp16, std::integral_constant<int, 1>{});
  };
  if constexpr (kFormat == KVFormat::kNative) {
    if (cd.fp16) return by_tiles(std::true_type{});
  }
  by_tiles(std::false_type{});  // quantized formats always compute in fp16 (the flag selects kNative's type only)
}

}  // namespace tessera::attention::detail
