// How the engine touches payload memory: every byte of a shard, an envelope or a gathered output
// that the engine moves goes through MemoryOps, so that a device backend (CUDA: device buffers,
// copies ordered on a stream) plugs in here without the scheduler changing (house rule 14).
// The host implementation is what the engine uses today.
//
// Memory spaces. "Payload memory" is the space of the caller's input and output buffers and of
// the engine's envelope buffers: host memory for the host implementation, device memory for a
// device one. Control records, verdicts and the engine's bookkeeping stay in host memory and
// never go through here. All sizes are in bytes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ciera {

class MemoryOps {
 public:
  virtual ~MemoryOps() = default;

  // `bytes` of payload memory, aligned to a 64-byte cache line at least (the codec streams
  // large sign-mantissa planes with aligned non-temporal stores; docs/format.md, "Padding") and
  // filled with zeros. Never returns null for bytes > 0; throws std::bad_alloc.
  virtual std::byte* allocate(size_t bytes) const = 0;
  // Releases what allocate(bytes) returned; null is ignored.
  virtual void free(std::byte* data, size_t bytes) const noexcept = 0;

  // Copies `bytes` from `src` to `dst`; the ranges must not overlap. Each side is payload memory
  // or host memory (a device implementation tells them apart, as cudaMemcpyDefault does).
  // Complete when the call returns (a device implementation synchronises its stream). Either
  // pointer may be null when bytes is 0.
  virtual void copy(std::byte* dst, const std::byte* src, size_t bytes) const = 0;
  // As copy, within payload memory, but the ranges may overlap (packing an envelope slides
  // payloads towards its start; a gather's own shards may overlap their slot of the output).
  virtual void move(std::byte* dst, const std::byte* src, size_t bytes) const = 0;
};

// Host memory: cache-line aligned, huge-page advised above 2 MiB (common/huge_pages.hpp),
// memcpy / memmove / memset. Stateless and thread-safe; lives as long as the program.
const MemoryOps& host_memory_ops();

// One payload buffer owned through a MemoryOps (an envelope send or receive area). Its contents
// are scratch: reserve() does not keep them.
class PayloadBuffer {
 public:
  explicit PayloadBuffer(const MemoryOps& memory) : memory_(&memory) {}
  ~PayloadBuffer() { memory_->free(data_, capacity_); }
  PayloadBuffer(PayloadBuffer&& other) noexcept
      : memory_(other.memory_), data_(other.data_), size_(other.size_), capacity_(other.capacity_) {
    other.data_ = nullptr;
    other.size_ = other.capacity_ = 0;
  }
  PayloadBuffer(const PayloadBuffer&) = delete;
  PayloadBuffer& operator=(const PayloadBuffer&) = delete;
  PayloadBuffer& operator=(PayloadBuffer&&) = delete;

  // Makes the buffer `bytes` long, allocating anew (zero-filled) only when it must grow, so
  // that steady-state gathers never allocate.
  void reserve(size_t bytes) {
    if (bytes > capacity_) {
      std::byte* fresh = memory_->allocate(bytes);
      memory_->free(data_, capacity_);
      data_ = fresh;
      capacity_ = bytes;
    }
    size_ = bytes;
  }

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const MemoryOps* memory_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

}  // namespace ciera
