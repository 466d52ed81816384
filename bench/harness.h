// tessera-bench: the case registry and the helpers cases are built from.
//
// An op family adds its cases from its own .cpp file (listed in bench/CMakeLists.txt):
//
//   static void add_my_cases(std::vector<tessera::bench::CaseSpec>& cases) { cases.push_back({...}); }
//   TESSERA_BENCH_CASES(add_my_cases);
//
// A CaseSpec is plain data plus a setup function; nothing touches the GPU until setup runs, so --list works
// anywhere. setup allocates the device buffers and fills the inputs with fresh random data on the GPU
// (device_random.h: never zeros, fixed seed per case and set) in num_sets rotating copies (see rotating_sets), and
// returns the CaseInstance that runs and checks the op. Host-side inputs are for small structure only (group sizes,
// sequence lengths, block tables); --check downloads what its reference needs of set 0.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/check.h"
#include "reference/moe_checks.h"

namespace tessera::bench {

using reference::CheckResult;

// What setup knows about the device.
struct DeviceContext {
  int device = 0;
  int64_t l2_bytes = 0;
  int num_sms = 0;
  cudaStream_t stream = nullptr;  // where setup enqueues its fills (the harness syncs the device after setup)
};

class CaseInstance {
 public:
  virtual ~CaseInstance() = default;
  // Rotating input sets; run(stream, set) takes set in [0, num_sets()).
  virtual int num_sets() const = 0;
  // One call of the op on input set `set`. Asynchronous, capturable, no allocation.
  virtual void run(cudaStream_t stream, int set) = 0;
  // Poisons the outputs, runs set 0, copies the outputs to the host and compares them with the CPU reference
  // computed from set 0's inputs (downloaded). May restrict the reference to a sample of the problem that covers
  // every kind of group / tile / sequence; the message says which.
  virtual CheckResult check(cudaStream_t stream) = 0;
  // --host: where a call's host time goes, for ops that chain steps (one line; empty where there is nothing to add).
  // time_calls(f) times f as time_host times run(): the stream held busy, the median µs per call.
  virtual std::string host_detail(cudaStream_t stream,
                                  const std::function<double(const std::function<void(int)>&)>& time_calls) {
    (void)stream;
    (void)time_calls;
    return {};
  }
};

struct CaseSpec {
  std::string op;    // "fused_gate"
  std::string name;  // "dsv3/T4096/fp32"
  double bytes = 0;  // bytes one call must move: each input read once, each output written once
  double flops = 0;  // 0 if the op has no meaningful flop count
  std::function<std::unique_ptr<CaseInstance>(const DeviceContext&)> setup;
  // For a peer row (another implementation of the same computation, e.g. a cuBLASLt loop): the tessera ops whose
  // rows with the same case name it is compared with. The report prints tessera µs / peer µs on those rows.
  std::vector<std::string> peer_of;
  // Part of the default (representative) suite: every op, the rows docs/perf/*.md reports. --all runs every case.
  bool headline = false;
};

// Thrown by a peer's setup when the peer library does not support the case (for example cuBLASLt's block-scaled
// fp8 with some group size): the row reads "n/a" and does not fail the run.
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// All registered cases, in registration order (families in link order).
std::vector<CaseSpec>& case_registry();

struct CaseRegistrar {
  explicit CaseRegistrar(void (*add)(std::vector<CaseSpec>&)) { add(case_registry()); }
};

#define TESSERA_BENCH_CASES_CAT2(a, b) a##b
#define TESSERA_BENCH_CASES_CAT(a, b) TESSERA_BENCH_CASES_CAT2(a, b)
#define TESSERA_BENCH_CASES(fn) \
  static const ::tessera::bench::CaseRegistrar TESSERA_BENCH_CASES_CAT(tessera_bench_registrar_, __LINE__)(fn)

// How many rotating input sets make the inputs of the rotation exceed twice the L2 (1 if one set already does),
// capped at 64. bytes_per_set: the inputs one call reads.
int rotating_sets(const DeviceContext& ctx, double bytes_per_set);

// ---- device memory ---------------------------------------------------------------------------------------
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) { allocate(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;

  void allocate(std::size_t bytes);
  void release() noexcept;
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

  // Synchronous copies of a whole host vector to/from the start of the buffer.
  template <typename T>
  void upload(const std::vector<T>& host) {
    copy_in(host.data(), host.size() * sizeof(T));
  }
  template <typename T>
  std::vector<T> download(std::size_t count, cudaStream_t stream) const {
    std::vector<T> host(count);
    copy_out(host.data(), count * sizeof(T), stream);
    return host;
  }
  // Fills with `byte` on the stream (NaN poison for floats: 0xFF).
  void fill_async(int byte, cudaStream_t stream) const;

 private:
  void copy_in(const void* src, std::size_t bytes);
  void copy_out(void* dst, std::size_t bytes, cudaStream_t stream) const;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// count elements of T from element `first` of a device buffer (synchronous on `stream`).
template <typename T>
std::vector<T> download_range(const DeviceBuffer& b, std::size_t first, std::size_t count, cudaStream_t stream) {
  if ((first + count) * sizeof(T) > b.bytes()) throw Error("tessera-bench: download past the end of a buffer");
  std::vector<T> host(count);
  if (!count) return host;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(host.data(), b.as<const T>() + first, count * sizeof(T), cudaMemcpyDeviceToHost,
                                     stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

void download_rows_bytes(const DeviceBuffer& b, int64_t row_bytes, const std::vector<int64_t>& rows, void* dst,
                         cudaStream_t stream);
// Rows `rows` (row_elems elements of T each) of a device buffer, gathered on the GPU and copied to the host in
// that order: [rows.size()][row_elems].
template <typename T>
std::vector<T> download_rows(const DeviceBuffer& b, int64_t row_elems, const std::vector<int64_t>& rows,
                             cudaStream_t stream) {
  std::vector<T> host(rows.size() * row_elems);
  download_rows_bytes(b, row_elems * static_cast<int64_t>(sizeof(T)), rows, host.data(), stream);
  return host;
}

// A new device buffer holding a copy of `host` (synchronous).
template <typename T>
DeviceBuffer upload_new(const std::vector<T>& host) {
  DeviceBuffer b(host.size() * sizeof(T));
  b.upload(host);
  return b;
}

// ---- host random data ------------------------------------------------------------------------------------
// splitmix64: fast, and good enough for benchmark inputs.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Roughly standard normal (Irwin-Hall of 4 uniforms), bounded by +-3.46.
  double normal() { return (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508075688772; }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

// A stable seed from the case's identity (FNV-1a), mixed with the set index.
uint64_t case_seed(const std::string& op, const std::string& name, int set);

// ---- --check sampling ------------------------------------------------------------------------------------------
// Indices of [0, n) a check covers, sorted and distinct: all of them when n <= count, else `edge` from each end
// plus random ones (from `seed`) up to `count` in all.
std::vector<int64_t> sample_indices(int64_t n, int64_t count, int64_t edge, uint64_t seed);

// What a check compared of `total` items (`what`: "rows") from sample_indices(..., edge 2, ...): "all 16 rows" or
// "16 of 4096 rows (first 2, last 2, random)".
std::string describe_sample(const std::vector<int64_t>& picked, int64_t total, const std::string& what);

// fn(i) for i in [0, items) on the reference's worker threads (interleaved; results must not depend on the order).
void parallel_for(int64_t items, double work, const std::function<void(int64_t)>& fn);

// ||got − ref||² and ||ref||² accumulated over compared elements, and the non-finite outputs counted.
struct ErrorSum {
  double err2 = 0, ref2 = 0;
  int64_t non_finite = 0, compared = 0;
  void add(double got, double ref) {
    ++compared;
    if (!std::isfinite(got)) {
      ++non_finite;
      return;
    }
    err2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
  }
  void add(const ErrorSum& o) { err2 += o.err2, ref2 += o.ref2, non_finite += o.non_finite, compared += o.compared; }
  // ok: something compared, every output finite, and the relative Frobenius error within `tolerance`.
  CheckResult result(const std::string& what, double tolerance) const;
};

// The ErrorSum of fn(i, sum) over i in [0, items), each item adding into a sum of its own on parallel_for's threads.
ErrorSum parallel_error_sum(int64_t items, double work, const std::function<void(int64_t, ErrorSum&)>& fn);

// Several partial checks as one: ok if all are, error the largest, compared the sum; the message is `summary`
// when all passed, else the failing parts' messages prefixed by their labels.
CheckResult merge_checks(const std::vector<CheckResult>& parts, const std::vector<std::string>& labels,
                         const std::string& summary);

}  // namespace tessera::bench
