// The engine's payload buffers (envelope send and receive areas), owned through the MemoryOps of
// the engine's codec backend (include/ciera/memory.hpp, include/ciera/backend.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ciera/memory.hpp"

namespace ciera {

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
