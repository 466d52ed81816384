// Internal: resident blocks per SM of a kernel, asked of the runtime once per (kernel, block size, shared memory,
// device) and cached, so that sizing a persistent grid costs nothing on the launch path. Raises the kernel's
// dynamic shared-memory limit first when it needs more than 48 KiB.
#pragma once

#include <cstdint>

namespace tessera::detail {

int resident_blocks_per_sm(const void* kernel, int threads, int dynamic_smem_bytes);

// Blocks of 256 threads for a grid-stride loop over `total` elements: one element a thread, at most 8 blocks per SM
// of the current device.
int elementwise_grid(int64_t total);

}  // namespace tessera::detail
