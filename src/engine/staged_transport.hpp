// The transport as a device engine hands it to its peers: payload memory only. The engine's own
// records (configuration agreement, stream epochs, control records, verdicts) are host structs;
// with a backend whose payload memory is not host memory (a GPU's), this wrapper copies each one
// into a payload buffer, gathers it there and copies the result back, so that a device transport
// (NCCL) never needs to tell host pointers from device pointers. The records are small (a few
// KiB per round), so the two copies cost microseconds.
//
// The engine's calls say which is which: allgather and allgatherv carry host records (control
// records, verdicts, epochs; the agreement's descriptions), allgatherv_many carries payloads
// (envelopes, or shards gathered straight into the output).
#pragma once

#include <algorithm>
#include <span>
#include <string_view>

#include "ciera/transport.hpp"
#include "engine/memory_ops.hpp"

namespace ciera {

class StagedTransport final : public Transport {
 public:
  StagedTransport(Transport& inner, const MemoryOps& memory)
      : inner_(inner), memory_(memory), in_(memory), out_(memory) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view name() const override { return inner_.name(); }

  // Host records: staged through payload memory.
  void allgather(const void* in, size_t bytes, void* out) override {
    const size_t total = bytes * static_cast<size_t>(inner_.size());
    in_.reserve(bytes);
    out_.reserve(total);
    memory_.copy(in_.data(), static_cast<const std::byte*>(in), bytes);
    inner_.allgather(in_.data(), bytes, out_.data());
    memory_.copy(static_cast<std::byte*>(out), out_.data(), total);
  }
  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    uint64_t total = 0;
    for (size_t r = 0; r < counts.size(); ++r) total = std::max(total, displs[r] + counts[r]);
    const uint64_t mine = counts[static_cast<size_t>(inner_.rank())];
    in_.reserve(mine);
    out_.reserve(total);
    memory_.copy(in_.data(), static_cast<const std::byte*>(in), mine);
    inner_.allgatherv(in_.data(), out_.data(), counts, displs);
    memory_.copy(static_cast<std::byte*>(out), out_.data(), total);
  }
  // Envelopes and shards: already payload memory.
  void allgatherv_many(std::span<const AllgathervCall> calls,
                       const std::function<void(size_t)>& done) override {
    inner_.allgatherv_many(calls, done);
  }
  void barrier() override { inner_.barrier(); }
  void set_timeout(std::chrono::milliseconds timeout) override { inner_.set_timeout(timeout); }
  std::chrono::milliseconds timeout() const override { return inner_.timeout(); }

 private:
  Transport& inner_;
  const MemoryOps& memory_;
  PayloadBuffer in_, out_;  // grown to the largest record, then reused
};

}  // namespace ciera
