// The content checksum of a frame (docs/format.md, "Header"): streaming XXH3-64 with seed 0 of
// the shard's bytes, through the plane kernels' copy of xxHash (PlaneKernels::checksum_update).
#pragma once

#include <cstddef>
#include <cstdint>

#include "format/planes.hpp"

namespace ciera::format {

// Equals XXH3_64bits over the concatenated updates.
class ContentChecksum {
 public:
  explicit ContentChecksum(const PlaneKernels& k = kernels()) : kernels_(&k) {
    k.checksum_reset(state_);
  }
  void update(const void* data, size_t bytes) {
    kernels_->checksum_update(state_, static_cast<const uint8_t*>(data), bytes);
  }
  uint64_t digest() const { return kernels_->checksum_digest(state_); }

 private:
  const PlaneKernels* kernels_;
  ChecksumState state_;
};

}  // namespace ciera::format
