// Payload memory and how bytes move in it (MemoryOps). A compressed allgather's payload bytes (the
// caller's shards and gathered output, the engine's envelopes) live in the memory of its codec
// backend (include/ciera/backend.hpp): host memory, or a GPU's. Every byte of it the engine or a
// transport moves goes through MemoryOps, so that a device backend (CUDA: device buffers, copies
// ordered on a stream) plugs in without the engine's scheduler changing (house rule 14).
//
// Control records, verdicts and the engine's bookkeeping stay in host memory and never go
// through here. All sizes are in bytes.
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
  // Every call is thread-safe: the engine copies from several worker threads at once.
};

// Host memory: cache-line aligned, huge-page advised above 2 MiB (common/huge_pages.hpp),
// memcpy / memmove / memset. Stateless and thread-safe; lives as long as the program.
const MemoryOps& host_memory_ops();

}  // namespace ciera
