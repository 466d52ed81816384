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
};

struct StageRing {
  uint64_t* full;   // [stages]
  uint64_t* empty;  // [stages]
  int stages;

  // One thread, before the CTA barrier that publishes the ring.
  __device__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) const {
    for (int s = 0; s < stages; ++s) {
      ptx::mbarrier_init(&full[s], full_arrivals);
      ptx::mbarrier_init(&empty[s], empty_arrivals);
    }
    ptx::fence_mbarrier_init();
  }

  __device__ __forceinline__ void producer_acquire(const PipelineState& st) const {
    ptx::mbarrier_wait_parity(&empty[st.stage], st.phase ^ 1u);
  }
  __device__ __forceinline__ void consumer_wait(const PipelineState& st) const {
    ptx::mbarrier_wait_parity(&full[st.stage], st.phase);
  }
  __device__ __forceinline__ void consumer_release(const PipelineState& st) const {
    ptx::mbarrier_arrive(&empty[st.stage]);
  }
};

}  // namespace tessera::pipeline
