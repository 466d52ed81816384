// Internal: launching a kernel as a programmatic dependent (PDL) of the stream's previous kernel.
//
// With cudaLaunchAttributeProgrammaticStreamSerialization the kernel's CTAs may be scheduled before the previous
// kernel in the stream has completed: once every CTA of that kernel has executed `griddepcontrol.launch_dependents`,
// or as its CTAs exit where it never does. The dependent kernel must execute `griddepcontrol.wait` before its first
// access to global memory that the previous kernel may write or read (the wait returns once that kernel has
// completed and its writes are visible); what it does before the wait (shared-memory set-up, index arithmetic,
// tensor-map prefetches from its own parameters) overlaps the previous kernel's tail and the launch. Without the
// attribute the wait returns at once, so a kernel written this way is correct under both launches. In stream capture
// the attribute becomes a programmatic edge of the graph.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common/check.h"

namespace tessera::detail {

template <typename... Params, typename... Args>
void launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                         Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  TESSERA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace tessera::detail
