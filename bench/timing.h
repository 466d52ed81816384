// tessera-bench: timing with CUDA events, in two modes, and the bandwidth ceilings (copy, read).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "harness.h"

namespace tessera::bench {

struct ModeTiming {
  bool ok = false;
  double median_us = 0;  // per call
  double min_us = 0;
  double max_us = 0;
  int samples = 0;            // timed samples the median is taken over
  int calls_per_sample = 1;   // graph mode: calls captured in the graph
  std::string error;          // why the mode failed, when !ok
};

// "stream": `warmup` untimed calls, then `reps` calls with an event pair around each, rotating input sets.
// Includes each launch's gap on the stream, so small kernels read their launch latency here.
ModeTiming time_stream(CaseInstance& c, cudaStream_t stream, int reps, int warmup);

// "graph": `calls` calls (rotating sets) captured into one CUDA graph; `warmup` untimed replays, then `replays`
// timed replays; per-call time = replay time / calls, median over replays.
ModeTiming time_graph(CaseInstance& c, cudaStream_t stream, int calls, int replays, int warmup);

// Calls per graph: enough for a replay of ~2 ms (given an estimated call time; <= 0 if unknown), at most 256,
// a multiple of num_sets so every replay sees each set equally often.
int graph_calls_for(double est_call_us, int num_sets);

// A memory-bandwidth ceiling: one pass over a buffer of 1 GiB (512 MiB if that does not fit), median of `reps`.
struct StreamCeiling {
  double bytes_per_s = 0;   // bytes moved (read, plus written for a copy) / median time
  double buffer_bytes = 0;  // bytes of the buffer passed over
  double median_us = 0;
};
// Device-to-device cudaMemcpyAsync: read + write.
StreamCeiling measure_copy_bandwidth(cudaStream_t stream, int reps);
// Read only: 16-byte streaming loads over the whole buffer (read_ceiling.cu), nothing written. The ceiling of
// kernels that read far more than they write (decode over a KV cache, weight streams); on an H200 it runs 5-8 %
// above the copy's (read + write) rate.
StreamCeiling measure_read_bandwidth(cudaStream_t stream, int num_sms, int reps);
// The kernel of measure_read_bandwidth; `sink` is written only if the data holds a value it never holds.
void launch_read_stream(const void* data, std::size_t bytes, uint32_t* sink, int num_sms, cudaStream_t stream);

// Host time per call: the stream is held busy by a spin kernel (longer than the loop), then `calls` calls (rotating
// sets) are issued and timed with the host clock; no call can wait for the GPU, so this is the CPU's cost of one
// call (argument checks, configuration, tensor maps, launches) without Python. Median of `reps` rounds. With
// c == nullptr, a bare launch of an empty kernel is timed instead (the floor of one launch).
double time_host(CaseInstance* c, cudaStream_t stream, int calls, int reps);
// The same timing of any call sequence: one(i) is the i-th call.
double time_host_calls(const std::function<void(int)>& one, cudaStream_t stream, int calls, int reps);
// An empty launch of a kernel taking 1,024 bytes of parameters (read_ceiling.cu): a bare launch's cost at the
// parameter size of the ops whose kernels take several tensor maps.
void launch_with_kilobyte_params(cudaStream_t stream);
// A kernel of one thread that returns after `ns` nanoseconds of GPU time (read_ceiling.cu).
void launch_spin(uint64_t ns, cudaStream_t stream);

double median(std::vector<double> v);

}  // namespace tessera::bench
