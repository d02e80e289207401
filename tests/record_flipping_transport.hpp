// A transport that damages one record in transit: the engine's control records and verdicts,
// the lossless collectives' call records and verdicts (docs/reliability.md, row 4b).
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>
#include <utility>

#include "forwarding_transport.hpp"

namespace ciera::testing {

// Flips the bits `bit` of byte `at` of what the `nth` (from 0) fixed-size allgather of `bytes`
// per rank delivers to this rank (`at` counts from the start of rank 0's part). Everything else
// passes through.
class RecordFlippingTransport final : public ForwardingTransport {
 public:
  RecordFlippingTransport(std::shared_ptr<Transport> inner, size_t bytes, int nth, size_t at,
                          std::byte bit)
      : ForwardingTransport(std::move(inner)), bytes_(bytes), nth_(nth), at_(at), bit_(bit) {}
  std::string_view name() const override { return "record-flipping"; }
  void allgather(const void* in, size_t bytes, void* out) override {
    ForwardingTransport::allgather(in, bytes, out);
    if (bytes == bytes_ && calls_++ == nth_) static_cast<std::byte*>(out)[at_] ^= bit_;
  }

 private:
  size_t bytes_;
  int nth_;
  size_t at_;
  std::byte bit_;
  int calls_ = 0;
};

}  // namespace ciera::testing
