// The content checksum of a frame (docs/format.md, "Integrity"): the shard's bytes are cut into
// chunks of kChecksumChunkBytes, each chunk is hashed with XXH3-64 (seed 0), and the checksum is
// XXH3-64 (seed 0) of the chunk digests as little-endian u64s, in order. Chunks hash
// independently, so a GPU computes them in parallel; the CPU computes them in one streaming pass
// through the plane kernels' copy of xxHash (PlaneKernels::checksum_update).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/bytes.hpp"
#include "format/planes.hpp"

namespace ciera::format {

// 16 KiB: 2048 independent chunks in a 16M-value BF16 shard for a GPU, and one finalisation per
// 16 KiB (about 2% of the hashing) on the CPU.
inline constexpr uint64_t kChecksumChunkBytes = 16384;

// Equals the checksum above of the concatenated updates, however they are split.
class ContentChecksum {
 public:
  explicit ContentChecksum(const PlaneKernels& k = kernels()) : kernels_(&k) {
    k.checksum_reset(chunk_);
    k.checksum_reset(digests_);
  }
  void update(const void* data, size_t bytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (bytes > 0) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(bytes, kChecksumChunkBytes - filled_));
      kernels_->checksum_update(chunk_, p, take);
      filled_ += take;
      p += take;
      bytes -= take;
      if (filled_ == kChecksumChunkBytes) close_chunk();
    }
  }
  // Call once, after the last update.
  uint64_t digest() {
    if (filled_ > 0) close_chunk();
    return kernels_->checksum_digest(digests_);
  }

 private:
  void close_chunk() {
    uint8_t digest[8];
    store_le64(digest, kernels_->checksum_digest(chunk_));
    kernels_->checksum_update(digests_, digest, sizeof digest);
    kernels_->checksum_reset(chunk_);
    filled_ = 0;
  }

  const PlaneKernels* kernels_;
  ChecksumState chunk_;
  ChecksumState digests_;
  uint64_t filled_ = 0;
};

}  // namespace ciera::format
