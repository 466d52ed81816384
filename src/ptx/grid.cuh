// PTX helpers for grid-level ordering and timing: programmatic dependent launch (PTX ISA "griddepcontrol"; the host
// side is common/pdl.h) and the global nanosecond timer.
#pragma once

#include <cstdint>

namespace tessera::ptx {

// Lets the stream's next kernel, where it was launched as a programmatic dependent, be scheduled once every CTA of
// this grid has executed this (or exited). It orders nothing: the dependent still waits (grid_dependency_wait) for
// this grid's completion before touching its results.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Waits until the grids this one depends on programmatically have completed and their memory operations are
// visible; returns at once for a plain launch.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// %globaltimer: nanoseconds, common to all SMs, updated coarsely (every 32 ns to 1 us depending on the GPU).
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace tessera::ptx
