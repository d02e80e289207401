// The CUDA codec backend (include/ciera/cuda.hpp, codec_backend): payloads in one GPU's memory,
// coded there by ShardEncoder / ShardDecoder (encoder.cu, decoder.cu), for the engine of
// include/ciera/engine.hpp.
//
// Streams. The engine calls the backend from its worker threads and its communication thread,
// each call complete when it returns (backend.hpp). Each such thread works on its own non-blocking
// stream of the device (launch.cuh, thread_stream): coders and copies enqueue there and wait for it,
// so work of different threads overlaps on the device (one thread encoding a shard while another
// decodes a peer's) and nothing is ordered behind the caller's default stream.
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>

#include "ciera/backend.hpp"
#include "ciera/cuda.hpp"
#include "ciera/error.hpp"
#include "codec/device_decode.hpp"
#include "common/bytes.hpp"
#include "launch.cuh"

namespace ciera::cuda {
namespace {

using detail::check_cuda;
using detail::thread_stream;

// Makes `device` current for a scope and restores the caller's current device after: the
// backend is called on the caller's threads too (engine set-up, set_policy, the staged records
// at construction), and a library must not move a training thread to another GPU.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    restore_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

class DeviceMemory final : public MemoryOps {
 public:
  explicit DeviceMemory(int device) : device_(device) {}

  std::byte* allocate(size_t bytes) const override {
    if (bytes == 0) return nullptr;
    DeviceGuard on(device_);
    cudaStream_t s = thread_stream();
    void* p = nullptr;
    // Stream-ordered, as all of this backend's memory (src/cuda/launch.cuh says why: never wait
    // for the whole device). Aligned to 256 bytes at least, beyond the 64 MemoryOps promises.
    // Only running out of memory is bad_alloc; any other failure is the CUDA error it is.
    const cudaError_t allocated = cudaMallocAsync(&p, bytes, s);
    if (allocated == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the error state of the failed call
      throw std::bad_alloc();
    }
    check_cuda(allocated, "cudaMallocAsync");
    const cudaError_t zeroed = cudaMemsetAsync(p, 0, bytes, s);
    const cudaError_t synced = zeroed == cudaSuccess ? cudaStreamSynchronize(s) : cudaSuccess;
    if (zeroed != cudaSuccess || synced != cudaSuccess) {
      cudaFreeAsync(p, s);  // back to the pool (after the memset, if it was enqueued): no leak
      check_cuda(zeroed, "cudaMemsetAsync");
      check_cuda(synced, "cudaStreamSynchronize");
    }
    return static_cast<std::byte*>(p);
  }
  void free(std::byte* data, size_t) const noexcept override {
    if (data == nullptr) return;
    // Every use of `data` is complete: each call of this backend waits for its own work.
    try {
      DeviceGuard on(device_);
      cudaFreeAsync(data, thread_stream());
    } catch (...) {
    }
  }
  void copy(std::byte* dst, const std::byte* src, size_t bytes) const override {
    if (bytes == 0) return;
    DeviceGuard on(device_);
    cudaStream_t s = thread_stream();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync");
    check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }
  void move(std::byte* dst, const std::byte* src, size_t bytes) const override {
    if (bytes == 0 || dst == src) return;
    if (!ranges_overlap(dst, bytes, src, bytes)) return copy(dst, src, bytes);
    // cudaMemcpy leaves overlapping ranges undefined: bounce through scratch (two device
    // copies at device bandwidth; only packing an envelope slides payloads this way).
    DeviceGuard on(device_);
    cudaStream_t s = thread_stream();
    void* tmp = nullptr;
    check_cuda(cudaMallocAsync(&tmp, bytes, s), "cudaMallocAsync (move scratch)");  // from the pool
    // The scratch goes back to the pool whether or not the copies could be enqueued.
    cudaError_t copied = cudaMemcpyAsync(tmp, src, bytes, cudaMemcpyDeviceToDevice, s);
    if (copied == cudaSuccess) copied = cudaMemcpyAsync(dst, tmp, bytes, cudaMemcpyDeviceToDevice, s);
    const cudaError_t freed = cudaFreeAsync(tmp, s);
    check_cuda(copied, "cudaMemcpyAsync");
    check_cuda(freed, "cudaFreeAsync");
    check_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }

 private:
  int device_;
};

class Encoder final : public PayloadEncoder {
 public:
  // Made with `device` current (Backend::make_encoder): the coder allocates its memory there.
  Encoder(int device, const CodecConfig& config, uint64_t n, StreamIdentity id)
      : device_(device), cache_bytes_(codec_cache_bytes(config, n, /*sender=*/true)) {
    coder_.emplace(config, n, id);
    check_cuda(cudaMallocAsync(&length_, sizeof *length_, thread_stream()), "cudaMallocAsync");
    if (const cudaError_t e = cudaStreamSynchronize(thread_stream()); e != cudaSuccess) {
      // ~Encoder does not run for a constructor that throws: give the word back here.
      cudaFreeAsync(length_, thread_stream());
      check_cuda(e, "cudaStreamSynchronize");
    }
  }
  // On its device, whichever thread's current device is: the coder's frees are stream-ordered
  // on that device; the length word is freed once the last frame (which writes it) is done.
  ~Encoder() override {
    try {
      DeviceGuard on(device_);
      try {
        coder_->payload_bytes();  // waits for the last frame, if any
      } catch (...) {
        // The wait failed: the context is broken (cudaEventSynchronize reports only sticky
        // errors), so nothing of that frame runs any more. Free all the same, on this device.
      }
      coder_.reset();
      cudaFreeAsync(length_, thread_stream());
    } catch (...) {
    }
  }
  uint64_t encode(const std::byte* shard, uint64_t, std::byte* payload) override {
    DeviceGuard on(device_);
    coder_->encode(shard, payload, length_, thread_stream());
    return coder_->payload_bytes();  // waits for this frame
  }
  void request_key_frame() override { coder_->request_key_frame(); }
  uint32_t epoch() const override { return coder_->epoch(); }
  size_t max_payload_bytes() const override { return coder_->max_payload_bytes(); }
  size_t cache_bytes() const override { return cache_bytes_; }

 private:
  int device_;
  size_t cache_bytes_;
  std::optional<ShardEncoder> coder_;  // optional: destroyed on its device (~Encoder)
  uint64_t* length_ = nullptr;         // device memory: the encoder writes the length there
};

class Decoder final : public PayloadDecoder {
 public:
  // Made with `device` current (Backend::make_decoder).
  Decoder(int device, const CodecConfig& config, uint64_t n, StreamIdentity id) : device_(device) {
    coder_.emplace(config, n, id);
  }
  ~Decoder() override {
    try {
      DeviceGuard on(device_);
      coder_.reset();  // waits for its last work, then frees on its device
    } catch (...) {
    }
  }
  void decode(const std::byte* payload, uint64_t payload_bytes, std::byte* shard,
              uint64_t) override {
    DeviceGuard on(device_);
    coder_->decode(payload, payload_bytes, shard, thread_stream());
    coder_->check();  // waits; throws FormatError for a refused frame
  }
  void request_resync() override {
    DeviceGuard on(device_);
    coder_->request_resync(thread_stream());
  }
  uint32_t epoch() const override {
    DeviceGuard on(device_);
    return coder_->epoch();
  }
  size_t cache_bytes() const override { return coder_->cache_bytes(); }

 private:
  int device_;
  std::optional<ShardDecoder> coder_;  // optional: destroyed on its device (~Decoder)
};

class Fence final : public InputFence {
 public:
  Fence(int device, cudaStream_t stream) : device_(device) {
    DeviceGuard on(device);
    // Blocking sync: the wait may be long (the caller's compute) and must not spin a core.
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming | cudaEventBlockingSync),
          "cudaEventCreate");
    const cudaError_t recorded = cudaEventRecord(event_, stream);
    if (recorded != cudaSuccess) {
      (void)cudaGetLastError();  // a bad handle is not sticky: clear it for later launch checks
      cudaEventDestroy(event_);
      // A handle that is not a stream, or a stream of another device (event and stream must share
      // a device): the caller's mistake. Anything else (a broken context) is the CUDA error it is.
      if (recorded == cudaErrorInvalidResourceHandle || recorded == cudaErrorInvalidValue) {
        throw std::invalid_argument("start: stream " +
                                    std::to_string(reinterpret_cast<uintptr_t>(stream)) +
                                    " is not a CUDA stream of device " + std::to_string(device) +
                                    " (" + cudaGetErrorString(recorded) + ")");
      }
      check_cuda(recorded, "cudaEventRecord (the input fence on the caller's stream)");
    }
  }
  ~Fence() override { cudaEventDestroy(event_); }
  void wait() override {
    std::call_once(once_, [&] {
      DeviceGuard on(device_);
      check_cuda(cudaEventSynchronize(event_), "waiting for the input's stream");
    });
  }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
  std::once_flag once_;
};

class Backend final : public CodecBackend {
 public:
  explicit Backend(int device) : device_(device), name_("cuda:" + std::to_string(device)), memory_(device) {}
  std::string_view name() const override { return name_; }
  const MemoryOps& memory() const override { return memory_; }
  bool host_memory() const override { return false; }
  std::unique_ptr<PayloadEncoder> make_encoder(const CodecConfig& c, uint64_t n,
                                               StreamIdentity id) const override {
    DeviceGuard on(device_);
    return std::make_unique<Encoder>(device_, c, n, id);
  }
  std::unique_ptr<PayloadDecoder> make_decoder(const CodecConfig& c, uint64_t n,
                                               StreamIdentity id) const override {
    DeviceGuard on(device_);
    return std::make_unique<Decoder>(device_, c, n, id);
  }
  // Stream 0 is CUDA's default stream (torch's default stream reports 0), not "no stream": a
  // CUDA caller always has one, and input produced there must be waited for too.
  std::unique_ptr<InputFence> fence(uintptr_t stream) const override {
    return std::make_unique<Fence>(
        device_, stream == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(stream));
  }

 private:
  int device_;
  std::string name_;
  DeviceMemory memory_;
};

}  // namespace

std::shared_ptr<const CodecBackend> codec_backend(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || device < 0 || device >= count) {
    throw ConfigError("CUDA codec backend: no device " + std::to_string(device) + " (" +
                      (e != cudaSuccess ? std::string(cudaGetErrorString(e))
                                        : std::to_string(count) + " devices") + ")");
  }
  std::string why;
  DeviceGuard on(device);
  if (!device_available(&why)) throw ConfigError("CUDA codec backend: " + why);
  // The default memory pool gives freed memory back to the driver at every synchronisation
  // unless told to keep it; the engine allocates (move scratch) and frees in steady state.
  cudaMemPool_t pool = nullptr;
  check_cuda(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool");
  uint64_t keep = UINT64_MAX;
  check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "cudaMemPoolSetAttribute");
  // Pinned words for the coders, before any collective: cudaMallocHost may wait for the device
  // (launch.cuh), which a peer's kernel on this GPU could hold up.
  detail::PinnedBlock::reserve(sizeof(uint64_t), 256);                  // encoders' lengths
  detail::PinnedBlock::reserve(sizeof(codec::device::DecodePlan), 256);  // decoders' verdicts
  return std::make_shared<const Backend>(device);
}

}  // namespace ciera::cuda
