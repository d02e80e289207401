// What the GPU tests share: skipping without a usable device (reported "Skipped", never passed)
// and device buffers filled from and read back to host vectors.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ciera/cuda.hpp"

#define SKIP_WITHOUT_DEVICE()                                      \
  do {                                                             \
    std::string why;                                               \
    if (!::ciera::cuda::device_available(&why)) GTEST_SKIP() << why; \
  } while (0)

namespace ciera::cuda::testing {

template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, (n_ == 0 ? 1 : n_) * sizeof(T)), cudaSuccess);
  }
  explicit DeviceVector(const std::vector<T>& host) : DeviceVector(host.size()) { put(host.data(), host.size()); }
  ~DeviceVector() { cudaFree(p_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;

  T* get() { return static_cast<T*>(p_); }
  void put(const void* host, size_t count) {
    if (count > 0) {
      EXPECT_EQ(cudaMemcpy(p_, host, count * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<T> host(size_t count) const {
    std::vector<T> v(count);
    if (count > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), p_, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }
  std::vector<T> host() const { return host(n_); }

 private:
  size_t n_;
  void* p_ = nullptr;
};

}  // namespace ciera::cuda::testing
