#include "harness.h"

#include <algorithm>
#include <cmath>

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
  if (bytes) TESSERA_CUDA_CHECK(cudaMemcpy(ptr_, src, bytes, cudaMemcpyHostToDevice));
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

}  // namespace tessera::bench
