#include "ciera/memory.hpp"

#include <cstring>

#include "common/huge_pages.hpp"

namespace ciera {
namespace {

class HostMemoryOps final : public MemoryOps {
 public:
  std::byte* allocate(size_t bytes) const override {
    std::byte* data = HugePageAllocator<std::byte>().allocate(bytes);
    // Zeroed as the std::vector it replaces was; this also faults the pages in at setup rather
    // than in the first gather.
    std::memset(data, 0, bytes);
    return data;
  }
  void free(std::byte* data, size_t bytes) const noexcept override {
    if (data != nullptr) HugePageAllocator<std::byte>().deallocate(data, bytes);
  }
  void copy(std::byte* dst, const std::byte* src, size_t bytes) const override {
    if (bytes != 0) std::memcpy(dst, src, bytes);
  }
  void move(std::byte* dst, const std::byte* src, size_t bytes) const override {
    if (bytes != 0) std::memmove(dst, src, bytes);
  }
};

}  // namespace

const MemoryOps& host_memory_ops() {
  static const HostMemoryOps ops;
  return ops;
}

}  // namespace ciera
