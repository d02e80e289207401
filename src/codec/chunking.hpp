// How a shard is cut into blocks (docs/format.md, "Blocks and the bitmap") and, for cache-friendly
// passes, into chunks of whole blocks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "format/planes.hpp"

namespace ciera {

struct BlockGrid {
  // Chunks hold whole blocks and about this many values: small enough that a chunk's values,
  // exponents and planes stay in L1/L2 between the split, detection and checksum steps.
  static constexpr uint32_t kTargetChunkValues = 1024;
  static_assert(kTargetChunkValues <= format::kMaxChunkValues);

  BlockGrid(uint64_t n, uint32_t b)
      : num_values(n),
        block_values(b),
        blocks((n + b - 1) / b),
        chunk_values(b * std::max<uint32_t>(1, kTargetChunkValues / b)) {}

  uint64_t block_first(uint64_t block) const { return block * block_values; }
  size_t block_length(uint64_t block) const {
    return static_cast<size_t>(std::min<uint64_t>(block_values, num_values - block_first(block)));
  }
  uint64_t block_of(uint64_t value) const { return value / block_values; }

  uint64_t num_values;
  uint32_t block_values;
  uint64_t blocks;
  uint32_t chunk_values;
};

}  // namespace ciera
