// The base of the tests' transports that damage, count or intercept one kind of call: every call
// goes to `inner` unless a subclass overrides it (and passes it on through this class's). The
// batched calls (allgatherv_many, start_alltoallv) keep Transport's defaults, which come back
// through allgatherv and alltoallv, so an override of those sees every exchange.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <utility>

#include "ciera/transport.hpp"

namespace ciera::testing {

class ForwardingTransport : public Transport {
 public:
  explicit ForwardingTransport(std::shared_ptr<Transport> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view name() const override { return inner_->name(); }
  void allgather(const void* in, size_t bytes, void* out) override {
    inner_->allgather(in, bytes, out);
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

 protected:
  Transport& inner() const { return *inner_; }

 private:
  std::shared_ptr<Transport> inner_;
};

}  // namespace ciera::testing
