// Test helpers: device buffers, GPU presence, random inputs, poisoning.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <cstring>
#include <random>
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
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), count_(o.count_) { o.ptr_ = nullptr; o.count_ = 0; }

  T* get() const { return ptr_; }
  std::size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    if (count_) TESSERA_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
  }
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
  T* ptr_ = nullptr;
  std::size_t count_ = 0;
};

// A fresh seed per call, so that every run sees new inputs; printed by the test on failure.
inline uint64_t fresh_seed() {
  static std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

}  // namespace tessera::test
