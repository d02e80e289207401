// The small, NCCL-shaped collective interface the compressed allgather engine runs on. A new
// transport is a new implementation of this class (src/comm/<name>/).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "ciera/error.hpp"

namespace ciera {

// A collective failed: a peer is dead or stalled past the timeout, the transport reported an
// error, or peers disagree. Raised on every rank that observes it.
class CommError : public Error {
 public:
  using Error::Error;
};

// Collectives among size() ranks. Every rank makes the same calls in the same order. One thread
// at a time may use a Transport object.
class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view name() const = 0;

  // Every rank contributes `bytes` bytes from `in`; `out` receives size() * bytes, rank-major.
  // In place: `in` may be this rank's own slot of `out`.
  virtual void allgather(const void* in, size_t bytes, void* out) = 0;

  // Rank r contributes counts[r] bytes, placed at out + displs[r] (all ranks pass the same
  // counts and displs). `in` holds counts[rank()] bytes and may be this rank's slot of `out`.
  virtual void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                          std::span<const uint64_t> displs) = 0;

  // Several independent allgathervs, all in flight at once (the engine batches gathers this
  // way). The default runs them one after another.
  struct AllgathervCall {
    const void* in;
    void* out;
    std::span<const uint64_t> counts;
    std::span<const uint64_t> displs;
  };
  virtual void allgatherv_many(std::span<const AllgathervCall> calls) {
    for (const AllgathervCall& c : calls) allgatherv(c.in, c.out, c.counts, c.displs);
  }

  virtual void barrier() = 0;

  // Longest a collective waits for its peers before it throws CommError; zero waits forever.
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
};

}  // namespace ciera
