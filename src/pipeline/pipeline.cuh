// A ring of shared-memory stages between one producer and several consumers, synchronized by mbarriers.
//
//   full[s]   the producer's data for stage s has landed (TMA transaction bytes plus any plain arrivals)
//   empty[s]  every consumer is done with stage s (one arrival per consumer warp)
//
// Producer and consumers walk the stages in the same order with their own PipelineState; a wrap flips the
// phase. The producer waits on empty with the opposite parity, so the first pass over the ring does not block.
#pragma once

#include <cstdint>

#include "ptx/mbarrier.cuh"

namespace tessera::pipeline {

struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
  }

  // The state of the index-th use of a ring of `stages` stages, for loops that address tiles by number.
  __device__ __forceinline__ static PipelineState at(int index, int stages) {
    return {index % stages, static_cast<uint32_t>((index / stages) & 1)};
  }
};

struct StageRing {
  uint64_t* full;   // [stages]
  uint64_t* empty;  // [stages]
  int stages;

  // One thread, before the CTA barrier that publishes the ring.
  __device__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) const {
    init_barriers(full_arrivals, empty_arrivals);
    ptx::fence_mbarrier_init();
  }
  // The barriers alone, for a kernel that initializes several rings and then fences once (fence_mbarrier_init).
  __device__ void init_barriers(uint32_t full_arrivals, uint32_t empty_arrivals) const {
    for (int s = 0; s < stages; ++s) {
      ptx::mbarrier_init(&full[s], full_arrivals);
      ptx::mbarrier_init(&empty[s], empty_arrivals);
    }
  }

  __device__ __forceinline__ uint64_t* full_barrier(const PipelineState& st) const { return &full[st.stage]; }

  __device__ __forceinline__ void producer_acquire(const PipelineState& st) const {
    ptx::mbarrier_wait_parity(&empty[st.stage], st.phase ^ 1u);
  }
  // The same for a producer thread that may wait long beside busy warps: it sleeps in try_wait instead of polling.
  __device__ __forceinline__ void producer_acquire_suspend(const PipelineState& st) const {
    ptx::mbarrier_wait_parity_suspend(&empty[st.stage], st.phase ^ 1u);
  }
  __device__ __forceinline__ void consumer_wait(const PipelineState& st) const {
    ptx::mbarrier_wait_parity(&full[st.stage], st.phase);
  }
  __device__ __forceinline__ void consumer_release(const PipelineState& st) const {
    ptx::mbarrier_arrive(&empty[st.stage]);
  }
  // One arrival per warp, for a ring whose empty barriers count consumer warps: every lane's reads of the stage have
  // completed (their values are in registers, or the wgmma that read it has been waited for); __syncwarp orders them
  // before the elected lane's arrival.
  __device__ __forceinline__ void consumer_release_warp(const PipelineState& st) const {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) ptx::mbarrier_arrive(&empty[st.stage]);
  }
};

}  // namespace tessera::pipeline
