// Test helpers: device buffers, GPU presence, reproducible seeds (TESSERA_SEED), poisoning.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/check.h"
#include "tessera/tensor.h"

namespace tessera::test {

inline bool gpu_available() {
  static const bool available = [] {
    int n = 0;
    const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    (void)cudaGetLastError();
    return ok;
  }();
  return available;
}

#define TESSERA_REQUIRE_GPU() \
  if (!::tessera::test::gpu_available()) GTEST_SKIP() << "no CUDA device visible"

inline int current_device() {
  int d = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

// A view of device memory on the current device with explicit shape and strides (elements).
inline TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                          std::initializer_list<int64_t> strides) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = current_device();
  t.rank = static_cast<int>(shape.size());
  std::copy(shape.begin(), shape.end(), t.shape);
  std::copy(strides.begin(), strides.end(), t.strides);
  return t;
}

// An owning device allocation of `count` elements of T.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    if (count_ > 0) TESSERA_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), count_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (staged_) {
      cudaEventSynchronize(staged_);  // the staging buffer must outlive the copy that reads it
      cudaEventDestroy(staged_);
    }
    if (staging_) cudaFreeHost(staging_);
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(o.ptr_), count_(o.count_), staging_(o.staging_), staged_(o.staged_) {
    o.ptr_ = nullptr;
    o.count_ = 0;
    o.staging_ = nullptr;
    o.staged_ = nullptr;
  }
  // Takes o's allocation; o releases the one this held.
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    std::swap(staging_, o.staging_);
    std::swap(staged_, o.staged_);
    return *this;
  }

  T* get() const { return ptr_; }
  std::size_t size() const { return count_; }
  // Blocking upload: the contents have landed when this returns. A plain cudaMemcpy from pageable memory does not
  // promise that (it may return once the data is staged, with the DMA still queued on the legacy stream), and the
  // legacy stream does not order work on the tests' non-blocking streams: a kernel launched right after could read
  // the old contents (issue 14). Hence the device synchronize, as in poison(). Never call it while a stream is held
  // back on purpose (that stream would never drain); use upload_async there.
  void upload(const std::vector<T>& host) {
    if (count_ == 0) return;
    check_size(host.size());
    TESSERA_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  // Stream-ordered upload: lands after the work queued on `stream` before it and before the work queued after it
  // (a graph replay reading these contents). Goes through a pinned staging buffer, so neither the copy nor this
  // call waits for the stream; waits only for this buffer's previous upload_async to have read its staging.
  void upload_async(const std::vector<T>& host, cudaStream_t stream) {
    if (count_ == 0) return;
    check_size(host.size());
    if (!staging_) {
      TESSERA_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&staging_), count_ * sizeof(T)));
      TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    } else {
      TESSERA_CUDA_CHECK(cudaEventSynchronize(staged_));
    }
    std::memcpy(staging_, host.data(), count_ * sizeof(T));
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(ptr_, staging_, count_ * sizeof(T), cudaMemcpyHostToDevice, stream));
    TESSERA_CUDA_CHECK(cudaEventRecord(staged_, stream));
  }
  // Ordered after the legacy stream only: synchronize the stream that wrote the buffer first.
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_) TESSERA_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fill every byte with `byte` (0xFF: NaN for floats, -1 for ints) so that unwritten elements show.
  // Synchronizes, so that the poison cannot land after work queued later on a non-blocking stream.
  void poison(uint8_t byte = 0xFF) {
    if (count_) TESSERA_CUDA_CHECK(cudaMemset(ptr_, byte, count_ * sizeof(T)));
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  TensorView view(DType dtype, std::initializer_list<int64_t> shape) const {
    int device = 0;
    TESSERA_CUDA_CHECK(cudaGetDevice(&device));
    return TensorView::contiguous(ptr_, dtype, shape, device);
  }

 private:
  void check_size(std::size_t n) const {
    if (n != count_)
      throw std::invalid_argument("DeviceBuffer: upload of " + std::to_string(n) + " elements into " +
                                  std::to_string(count_));
  }

  T* ptr_ = nullptr;
  std::size_t count_ = 0;
  T* staging_ = nullptr;          // pinned, upload_async only
  cudaEvent_t staged_ = nullptr;  // recorded after the last upload_async's copy
};

// Holds `stream` at a host function until open() (or destruction): work queued on it afterwards waits, work on
// other streams does not. Shows whether an operation is ordered on a stream, without relying on timing. The
// host function gives up after 60 s so that a test that forgets to open cannot hang the run.
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream) : stream_(stream) {
    TESSERA_CUDA_CHECK(cudaLaunchHostFunc(stream_, &StreamGate::hold, this));
  }
  ~StreamGate() {
    open();
    cudaStreamSynchronize(stream_);  // the host function reads *this
  }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  void open() { open_.store(true, std::memory_order_release); }
  // True if the host function gave up before open(): something the test did waited for the held stream.
  bool gave_up() const { return gave_up_.load(std::memory_order_acquire); }

 private:
  static void CUDART_CB hold(void* self) {
    auto* gate = static_cast<StreamGate*>(self);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!gate->open_.load(std::memory_order_acquire)) {
      if (std::chrono::steady_clock::now() >= give_up) {
        gate->gave_up_.store(true, std::memory_order_release);
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  cudaStream_t stream_;
  std::atomic<bool> open_{false}, gave_up_{false};
};

// ---- seeds ---------------------------------------------------------------------------------------------------
// A non-blocking stream owned by the object.
class Stream {
 public:
  Stream() { TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Every randomized test takes its seeds from fresh_seed(), one call per data set. The run seed R is TESSERA_SEED
// (decimal or 0x-hex) when set, otherwise drawn from std::random_device once per process; gtest repeat iteration i
// runs with R + i. Call k (k = 0, 1, ... counted from the start of each test) of test Suite.Name returns
// mix(R + i, Suite.Name, k): a test's inputs depend only on its run seed and its own name, not on which tests ran
// before it or on --gtest_filter. So
//   TESSERA_SEED=R                                    reruns a whole run (iteration 0),
//   TESSERA_SEED=R+i --gtest_filter=Suite.Name        reruns one test of iteration i, every case as it was.
// When a test fails, a line "[   SEED   ] Suite.Name TESSERA_SEED=<R+i> ..." gives the exact command; the tests'
// own traces name the case and its data seed (the value fresh_seed returned).
// One capture of launch() on `stream` (thread-local mode), instantiated; graph and executable are released with
// the object. replay() launches it on a stream.
class CapturedGraph {
 public:
  template <typename Launch>
  CapturedGraph(cudaStream_t stream, Launch&& launch) {
    TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    launch();
    TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    TESSERA_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) (void)cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void replay(cudaStream_t stream) const { TESSERA_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Graph nodes a stream capture of launch() records: 0 when it enqueued no work. An exception from launch still ends
// the capture (a stream left capturing is unusable) and then propagates.
template <typename Launch>
std::size_t captured_node_count(cudaStream_t stream, Launch&& launch) {
  cudaGraph_t graph = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    launch();
  } catch (...) {
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph != nullptr) (void)cudaGraphDestroy(graph);
    throw;
  }
  TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  std::size_t nodes = 0;
  const cudaError_t err = cudaGraphGetNodes(graph, nullptr, &nodes);
  (void)cudaGraphDestroy(graph);
  TESSERA_CUDA_CHECK(err);
  return nodes;
}

namespace seed_detail {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}
// The seed of call `k` of test `test_name` in a run with run seed `run_seed`.
inline uint64_t derive(uint64_t run_seed, const std::string& test_name, uint64_t k) {
  return splitmix64(splitmix64(run_seed ^ splitmix64(fnv1a(test_name))) + k);
}

struct State {
  uint64_t base = 0;       // TESSERA_SEED, or random
  bool from_env = false;
  int iteration = 0;       // gtest repeat iteration
  std::string test;        // Suite.Name of the running test ("" outside tests)
  uint64_t calls = 0;      // fresh_seed() calls in the running test
  uint64_t run_seed() const { return base + static_cast<uint64_t>(iteration); }
};
inline State& state() {
  static State s = [] {
    State st;
    const char* env = std::getenv("TESSERA_SEED");
    if (env && *env) {
      char* end = nullptr;
      errno = 0;
      const bool hex = env[0] == '0' && (env[1] == 'x' || env[1] == 'X');
      st.base = std::strtoull(env, &end, hex ? 16 : 10);  // "012" is twelve, not octal
      if (errno != 0 || end == env || *end != '\0' || *env == '-') {
        std::fprintf(stderr, "TESSERA_SEED must be an unsigned 64-bit integer (decimal or 0x-hex), got '%s'\n", env);
        std::abort();
      }
      st.from_env = true;
    } else {
      std::random_device rd;
      st.base = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
    return st;
  }();
  return s;
}
inline std::string program_name() {
#if defined(__GLIBC__)
  return program_invocation_name;
#else
  return "<test binary>";
#endif
}

// Tracks the repeat iteration and the running test; names the seed of every failed test.
class Listener : public ::testing::EmptyTestEventListener {
 public:
  void OnTestIterationStart(const ::testing::UnitTest&, int iteration) override {
    state().iteration = iteration;
    std::printf("[   SEED   ] iteration %d: run seed %llu (%s)\n", iteration,
                static_cast<unsigned long long>(state().run_seed()),
                state().from_env ? "TESSERA_SEED + iteration" : "random, TESSERA_SEED unset");
    std::fflush(stdout);
  }
  void OnTestStart(const ::testing::TestInfo& t) override {
    state().test = std::string(t.test_suite_name()) + "." + t.name();
    state().calls = 0;
  }
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (t.result() && t.result()->Failed()) {
      const unsigned long long r = state().run_seed();
      std::printf("[   SEED   ] %s TESSERA_SEED=%llu  rerun: TESSERA_SEED=%llu %s --gtest_filter=%s\n",
                  state().test.c_str(), r, r, program_name().c_str(), state().test.c_str());
      std::fflush(stdout);
    }
    state().test.clear();
    state().calls = 0;
  }
};

// Registered before main (gtest_main) runs the tests; gtest owns and deletes the listener.
inline const bool kListenerRegistered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new Listener);
  return true;
}();

}  // namespace seed_detail

// The run seed of the current repeat iteration (TESSERA_SEED + iteration), for messages.
inline uint64_t run_seed() { return seed_detail::state().run_seed(); }

// The next data seed of the running test (see above): different for every call, reproducible from the run seed.
inline uint64_t fresh_seed() {
  (void)seed_detail::kListenerRegistered;
  seed_detail::State& s = seed_detail::state();
  return seed_detail::derive(s.run_seed(), s.test, s.calls++);
}

// "seed=<data seed> TESSERA_SEED=<run seed>", for SCOPED_TRACE and failure messages.
inline std::string seed_note(uint64_t seed) {
  return "seed=" + std::to_string(seed) + " TESSERA_SEED=" + std::to_string(run_seed());
}

}  // namespace tessera::test
