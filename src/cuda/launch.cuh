// What the device codec's .cu files share: error checks, device allocations and the launcher that
// runs a step function over [0, n) as one kernel (codec/device_decode.hpp, device_encode.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "ciera/error.hpp"

namespace ciera::cuda::detail {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

template <typename F>
__global__ void each_index(uint64_t n, F f) {
  const uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i < n) f(i);
}

// launch(n, f): f(i) for every i in [0, n), one kernel on `stream`.
struct Launch {
  cudaStream_t stream;
  template <typename F>
  void operator()(uint64_t n, F f) const {
    if (n == 0) return;
    constexpr unsigned kThreads = 256;
    const unsigned threads = n < kThreads ? static_cast<unsigned>(n) : kThreads;
    const uint64_t blocks = (n + threads - 1) / threads;
    each_index<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(n, f);
    check_cuda(cudaGetLastError(), "codec step launch");
  }
};

// One device allocation, freed with its owner.
struct DeviceMemory {
  void* p = nullptr;
  explicit DeviceMemory(size_t bytes) { check_cuda(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc"); }
  ~DeviceMemory() { cudaFree(p); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

}  // namespace ciera::cuda::detail
