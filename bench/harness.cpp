#include "harness.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <set>

#include "device_random.h"
#include "reference/format.h"
#include "reference/parallel.h"

namespace tessera::bench {

std::vector<CaseSpec>& case_registry() {
  static std::vector<CaseSpec> cases;
  return cases;
}

int rotating_sets(const DeviceContext& ctx, double bytes_per_set) {
  if (bytes_per_set <= 0) return 1;
  const double need = 2.0 * static_cast<double>(ctx.l2_bytes);
  const double sets = std::floor(need / bytes_per_set) + 1.0;  // sets * bytes_per_set > 2 * L2
  return static_cast<int>(std::clamp(sets, 1.0, 64.0));
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    release();
    ptr_ = o.ptr_, bytes_ = o.bytes_;
    o.ptr_ = nullptr, o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::allocate(std::size_t bytes) {
  release();
  if (bytes == 0) return;
  TESSERA_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  bytes_ = bytes;
}

void DeviceBuffer::release() noexcept {
  if (ptr_) (void)cudaFree(ptr_);  // a destructor must not throw; a failing free shows up at the next call
  ptr_ = nullptr;
  bytes_ = 0;
}

void DeviceBuffer::fill_async(int byte, cudaStream_t stream) const {
  if (bytes_) TESSERA_CUDA_CHECK(cudaMemsetAsync(ptr_, byte, bytes_, stream));
}

void DeviceBuffer::copy_in(const void* src, std::size_t bytes) {
  if (bytes > bytes_) throw Error("tessera-bench: upload of " + std::to_string(bytes) + " bytes into a buffer of " +
                                  std::to_string(bytes_));
  if (!bytes) return;
  // cudaMemcpy from pageable memory may return before its DMA lands, and the cases' streams do not wait for the
  // legacy stream: wait for it, so that a kernel on any stream sees the data.
  TESSERA_CUDA_CHECK(cudaMemcpy(ptr_, src, bytes, cudaMemcpyHostToDevice));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void DeviceBuffer::copy_out(void* dst, std::size_t bytes, cudaStream_t stream) const {
  if (bytes > bytes_) throw Error("tessera-bench: download of " + std::to_string(bytes) + " bytes from a buffer of " +
                                  std::to_string(bytes_));
  if (!bytes) return;
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, ptr_, bytes, cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

uint64_t case_seed(const std::string& op, const std::string& name, int set) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const std::string* s : {&op, &name})
    for (unsigned char c : *s + '/') {
      h ^= c;
      h *= 0x100000001B3ull;
    }
  return h ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(set + 1));
}

void download_rows_bytes(const DeviceBuffer& b, int64_t row_bytes, const std::vector<int64_t>& rows, void* dst,
                         cudaStream_t stream) {
  if (rows.empty() || row_bytes <= 0) return;
  for (int64_t r : rows)
    if (r < 0 || static_cast<std::size_t>((r + 1) * row_bytes) > b.bytes())
      throw Error("tessera-bench: row " + std::to_string(r) + " past the end of a buffer");
  const std::size_t bytes = rows.size() * static_cast<std::size_t>(row_bytes);
  DeviceBuffer index(rows.size() * sizeof(int64_t)), staged(bytes);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(index.get(), rows.data(), rows.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                     stream));
  gen::gather_rows(b.get(), row_bytes, index.as<const int64_t>(), static_cast<int64_t>(rows.size()), staged.get(),
                   stream);
  TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, staged.get(), bytes, cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::vector<int64_t> sample_indices(int64_t n, int64_t count, int64_t edge, uint64_t seed) {
  std::vector<int64_t> out;
  if (n <= 0) return out;
  if (n <= count) {
    out.resize(n);
    for (int64_t i = 0; i < n; ++i) out[i] = i;
    return out;
  }
  std::set<int64_t> s;
  for (int64_t i = 0; i < std::min(edge, n); ++i) {
    s.insert(i);
    s.insert(n - 1 - i);
  }
  Rng rng(seed);
  while (static_cast<int64_t>(s.size()) < count) s.insert(static_cast<int64_t>(rng.next() % static_cast<uint64_t>(n)));
  return {s.begin(), s.end()};
}

void parallel_for(int64_t items, double work, const std::function<void(int64_t)>& fn) {
  if (items <= 0) return;
  const int threads = reference::detail::num_workers(0, work, items);
  std::exception_ptr error;
  std::mutex mu;
  reference::detail::parallel(threads, [&](int t) {
    try {
      for (int64_t i = t; i < items; i += threads) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

std::string describe_sample(const std::vector<int64_t>& picked, int64_t total, const std::string& what) {
  if (static_cast<int64_t>(picked.size()) == total) return "all " + std::to_string(total) + " " + what;
  return std::to_string(picked.size()) + " of " + std::to_string(total) + " " + what + " (first 2, last 2, random)";
}

CheckResult ErrorSum::result(const std::string& what, double tolerance) const {
  CheckResult r;
  r.compared = compared;
  r.error = non_finite ? NAN : std::sqrt(err2 / std::max(ref2, 1e-300));
  r.ok = non_finite == 0 && compared > 0 && r.error <= tolerance;
  r.message = what + ": relative Frobenius error " + reference::detail::fmt(r.error) + " (bound " +
              reference::detail::fmt(tolerance) + ")" +
              (non_finite ? ", " + std::to_string(non_finite) + " non-finite outputs" : "");
  return r;
}

ErrorSum parallel_error_sum(int64_t items, double work, const std::function<void(int64_t, ErrorSum&)>& fn) {
  std::vector<ErrorSum> sums(static_cast<std::size_t>(items));
  parallel_for(items, work, [&](int64_t i) { fn(i, sums[static_cast<std::size_t>(i)]); });
  ErrorSum total;
  for (const ErrorSum& e : sums) total.add(e);
  return total;
}

CheckResult merge_checks(const std::vector<CheckResult>& parts, const std::vector<std::string>& labels,
                         const std::string& summary) {
  CheckResult r;
  std::string failures;
  int failed = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const CheckResult& p = parts[i];
    r.compared += p.compared;
    if (std::isnan(p.error) || p.error > r.error) r.error = p.error;
    if (!p.ok) {
      r.ok = false;
      if (++failed <= 3) failures += (failures.empty() ? "" : "; ") + labels[i] + ": " + p.message;
    }
  }
  r.message = r.ok ? summary
                   : std::to_string(failed) + " of " + std::to_string(parts.size()) + " parts failed: " + failures +
                         (failed > 3 ? "; ..." : "") + " [" + summary + "]";
  return r;
}

}  // namespace tessera::bench
