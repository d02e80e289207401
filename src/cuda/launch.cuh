// What the device codec's .cu files share: error checks, device allocations and the launcher that
// runs a step function over [0, n) as one kernel (codec/device_decode.hpp, device_encode.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

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
    // An earlier call on this thread may have left a non-sticky status (cudaErrorNotReady from a
    // query): clear it, so that the check below reports this launch only.
    (void)cudaGetLastError();
    each_index<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(n, f);
    check_cuda(cudaGetLastError(), "codec step launch");
  }
};

// Nothing here waits for the whole device. cudaFree, cudaFreeHost and cudaDeviceSynchronize
// do, and a thread waiting for the whole device waits for every kernel on it, a collective's
// too: ranks that share one GPU from threads of one process (the tests, the benchmark) would
// deadlock, one waiting in cudaFree for a peer's NCCL kernel that waits for it. So memory is
// allocated and freed in stream order (cudaMallocAsync / cudaFreeAsync), set-up copies run on
// a stream and wait for that stream only, and pinned memory comes from a pool that is never
// given back.

// This thread's non-blocking stream on the current device: for allocations, set-up copies, and
// (backend.cu) everything the engine asks of the CUDA backend from this thread. Made on first use,
// destroyed when the thread ends.
inline cudaStream_t thread_stream() {
  struct Streams {
    std::map<int, cudaStream_t> by_device;
    ~Streams() {
      for (auto& [d, s] : by_device) cudaStreamDestroy(s);
    }
  };
  thread_local Streams streams;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  auto it = streams.by_device.find(device);
  if (it != streams.by_device.end()) return it->second;
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  streams.by_device.emplace(device, s);
  return s;
}

// One device allocation on the current device, freed with its owner (in stream order: the owner
// must have waited for its last use).
struct DeviceMemory {
  void* p = nullptr;
  explicit DeviceMemory(size_t bytes) {
    check_cuda(cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, thread_stream()), "cudaMallocAsync");
  }
  // No throw from here: a destructor that threw would end the process. thread_stream() throws
  // where a sticky error broke the context, and then any stream will do (the free fails too).
  ~DeviceMemory() {
    cudaStream_t stream = cudaStreamPerThread;
    try {
      stream = thread_stream();
    } catch (...) {
    }
    cudaFreeAsync(p, stream);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// A pinned host block of `bytes` from a process-wide pool that grows and is never given back
// (cudaFreeHost would wait for the whole device); released blocks are reused. Blocks are
// whole powers of two of at least 4 KiB, carved 16 at a time from one cudaMallocHost.
class PinnedBlock {
 public:
  explicit PinnedBlock(size_t bytes) : size_class_(size_class(bytes)) {
    std::lock_guard lock(mutex());
    auto& free = free_lists()[size_class_];
    if (free.empty()) grow(free, size_class_, 16);
    p_ = free.back();
    free.pop_back();
  }
  ~PinnedBlock() {
    std::lock_guard lock(mutex());
    free_lists()[size_class_].push_back(p_);
  }
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

  // Makes sure `count` blocks of `bytes` are free now (allocating before any collective runs).
  static void reserve(size_t bytes, size_t count) {
    std::lock_guard lock(mutex());
    const size_t size = size_class(bytes);
    auto& free = free_lists()[size];
    if (free.size() < count) grow(free, size, count - free.size());
  }

 private:
  static size_t size_class(size_t bytes) {
    size_t size = 4096;
    while (size < bytes) size *= 2;
    return size;
  }
  static void grow(std::vector<void*>& free, size_t size, size_t count) {
    void* chunk = nullptr;
    check_cuda(cudaMallocHost(&chunk, size * count), "cudaMallocHost");
    for (size_t i = 0; i < count; ++i) free.push_back(static_cast<char*>(chunk) + i * size);
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<size_t, std::vector<void*>>& free_lists() {
    static std::map<size_t, std::vector<void*>> lists;
    return lists;
  }
  size_t size_class_;
  void* p_ = nullptr;
};

}  // namespace ciera::cuda::detail
