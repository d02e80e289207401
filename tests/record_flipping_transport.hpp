// A transport that damages one record in transit: the engine's control records and verdicts,
// the lossless collectives' call records and verdicts (docs/reliability.md, row 4b).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "ciera/transport.hpp"

namespace ciera::testing {

// Flips the bits `bit` of byte `at` of what the `nth` (from 0) fixed-size allgather of `bytes`
// per rank delivers to this rank (`at` counts from the start of rank 0's part). Everything else
// passes through.
class RecordFlippingTransport final : public Transport {
 public:
  RecordFlippingTransport(std::shared_ptr<Transport> inner, size_t bytes, int nth, size_t at,
                          std::byte bit)
      : inner_(std::move(inner)), bytes_(bytes), nth_(nth), at_(at), bit_(bit) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view name() const override { return "record-flipping"; }
  void allgather(const void* in, size_t bytes, void* out) override {
    inner_->allgather(in, bytes, out);
    if (bytes == bytes_ && calls_++ == nth_) static_cast<std::byte*>(out)[at_] ^= bit_;
  }
  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    inner_->allgatherv(in, out, counts, displs);
  }
  void alltoallv(const void* in, std::span<const uint64_t> send_counts,
                 std::span<const uint64_t> send_displs, void* out,
                 std::span<const uint64_t> recv_counts,
                 std::span<const uint64_t> recv_displs) override {
    inner_->alltoallv(in, send_counts, send_displs, out, recv_counts, recv_displs);
  }
  void barrier() override { inner_->barrier(); }
  void set_timeout(std::chrono::milliseconds t) override { inner_->set_timeout(t); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }

 private:
  std::shared_ptr<Transport> inner_;
  size_t bytes_;
  int nth_;
  size_t at_;
  std::byte bit_;
  int calls_ = 0;
};

}  // namespace ciera::testing
