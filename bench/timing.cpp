#include "timing.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace tessera::bench {

namespace {

// A fixed set of CUDA events, destroyed on every path.
class Events {
 public:
  explicit Events(int n) {
    events_.reserve(n);
    for (int i = 0; i < n; ++i) {
      cudaEvent_t e;
      TESSERA_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
  }
  ~Events() {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t operator[](int i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

// Event pairs (2i, 2i+1) -> microseconds each, divided by `calls`.
ModeTiming summarize(const Events& ev, int samples, int calls) {
  std::vector<double> us(samples);
  for (int i = 0; i < samples; ++i) {
    float ms = 0;
    TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = 1e3 * ms / calls;
  }
  ModeTiming t;
  t.ok = true;
  t.samples = samples;
  t.calls_per_sample = calls;
  t.min_us = *std::min_element(us.begin(), us.end());
  t.max_us = *std::max_element(us.begin(), us.end());
  t.median_us = median(std::move(us));
  return t;
}

class GraphGuard {
 public:
  ~GraphGuard() {
    if (exec) (void)cudaGraphExecDestroy(exec);
    if (graph) (void)cudaGraphDestroy(graph);
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  if (v.size() % 2) return v[mid];
  const double hi = v[mid];
  return 0.5 * (hi + *std::max_element(v.begin(), v.begin() + mid));
}

ModeTiming time_stream(CaseInstance& c, cudaStream_t stream, int reps, int warmup) {
  reps = std::max(reps, 1);
  const int sets = c.num_sets();
  for (int i = 0; i < warmup; ++i) c.run(stream, i % sets);
  Events ev(2 * reps);
  for (int i = 0; i < reps; ++i) {
    TESSERA_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream));
    c.run(stream, i % sets);
    TESSERA_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return summarize(ev, reps, 1);
}

double time_host_calls(const std::function<void(int)>& one, cudaStream_t stream, int calls, int reps) {
  for (int i = 0; i < 5; ++i) one(i);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> samples;
  for (int r = 0; r < std::max(reps, 1); ++r) {
    // 20 ms of GPU time: longer than any loop here, and the loop's launches (calls × at most ~10) stay under the
    // driver's queue of pending launches, past which a launch would wait for the GPU.
    launch_spin(20'000'000, stream);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) one(i);
    const auto t1 = std::chrono::steady_clock::now();
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  return median(samples);
}

double time_host(CaseInstance* c, cudaStream_t stream, int calls, int reps) {
  const int sets = c ? c->num_sets() : 1;
  return time_host_calls(
      [&](int i) {
        if (c) c->run(stream, i % sets);
        else launch_spin(0, stream);
      },
      stream, calls, reps);
}

ModeTiming time_graph(CaseInstance& c, cudaStream_t stream, int calls, int replays, int warmup) {
  replays = std::max(replays, 1);
  calls = std::max(calls, 1);
  const int sets = c.num_sets();
  GraphGuard g;
  TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    for (int i = 0; i < calls; ++i) c.run(stream, i % sets);
  } catch (...) {
    // Leave the stream out of capture mode, whatever broke it; the original error is the one to report.
    cudaGraph_t broken = nullptr;
    (void)cudaStreamEndCapture(stream, &broken);
    if (broken) (void)cudaGraphDestroy(broken);
    (void)cudaGetLastError();
    throw;
  }
  TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &g.graph));
  TESSERA_CUDA_CHECK(cudaGraphInstantiate(&g.exec, g.graph, 0));
  TESSERA_CUDA_CHECK(cudaGraphUpload(g.exec, stream));
  for (int i = 0; i < std::max(warmup, 1); ++i) TESSERA_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
  Events ev(2 * replays);
  for (int i = 0; i < replays; ++i) {
    TESSERA_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream));
    TESSERA_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
    TESSERA_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return summarize(ev, replays, calls);
}

int graph_calls_for(double est_call_us, int num_sets) {
  constexpr double kTargetUs = 2000.0;
  constexpr int kMaxCalls = 256;
  int calls = est_call_us > 0 ? static_cast<int>(std::ceil(kTargetUs / est_call_us)) : 64;
  calls = std::clamp(calls, 1, kMaxCalls);
  num_sets = std::max(num_sets, 1);
  calls = (calls + num_sets - 1) / num_sets * num_sets;  // num_sets <= 64, so this stays <= 256
  return calls;
}

namespace {

// A buffer of 1 GiB, or 512 MiB where that does not fit.
void allocate_ceiling_buffer(DeviceBuffer& buf) {
  std::size_t bytes = std::size_t(1) << 30;
  try {
    buf.allocate(bytes);
  } catch (const Error&) {
    buf.release();
    buf.allocate(bytes >> 1);
  }
}

// `reps` timed passes of `pass` after untimed ones that keep the GPU busy for ~20 ms (an idle GPU's clocks ramp up
// over milliseconds: after two warm-up passes a 1 GiB read measured 3.9 TB/s, 12 % below its steady rate on an
// H200); bytes moved per pass = `moved`.
template <typename Pass>
StreamCeiling time_ceiling(cudaStream_t stream, int reps, double buffer_bytes, double moved, Pass&& pass) {
  reps = std::max(reps, 3);
  constexpr double kWarmupBytes = 80e9;  // ~20 ms at 4 TB/s
  const int warmup = std::max(2, static_cast<int>(kWarmupBytes / moved));
  for (int i = 0; i < warmup; ++i) pass();
  Events ev(2 * reps);
  for (int i = 0; i < reps; ++i) {
    TESSERA_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream));
    pass();
    TESSERA_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  const ModeTiming t = summarize(ev, reps, 1);
  StreamCeiling c;
  c.buffer_bytes = buffer_bytes;
  c.median_us = t.median_us;
  c.bytes_per_s = moved / (t.median_us * 1e-6);
  return c;
}

}  // namespace

StreamCeiling measure_copy_bandwidth(cudaStream_t stream, int reps) {
  DeviceBuffer src, dst;
  allocate_ceiling_buffer(src);
  dst.allocate(src.bytes());
  src.fill_async(0x3C, stream);
  const std::size_t bytes = src.bytes();
  return time_ceiling(stream, reps, static_cast<double>(bytes), 2.0 * static_cast<double>(bytes), [&] {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream));
  });
}

StreamCeiling measure_read_bandwidth(cudaStream_t stream, int num_sms, int reps) {
  DeviceBuffer data, sink(sizeof(uint32_t));
  allocate_ceiling_buffer(data);
  data.fill_async(0x3C, stream);  // every XOR of the kernel cancels: the sink is never written
  const std::size_t bytes = data.bytes();
  return time_ceiling(stream, reps, static_cast<double>(bytes), static_cast<double>(bytes), [&] {
    launch_read_stream(data.get(), bytes, sink.as<uint32_t>(), num_sms, stream);
  });
}

}  // namespace tessera::bench
