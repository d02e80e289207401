// The small, NCCL-shaped collective interface the compressed allgather engine runs on. A new
// transport is a new implementation of this class (src/comm/<name>/).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
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
  // way). `done(i)`, if given, runs as soon as call i has completed, in call order, while later
  // calls may still be in flight (the engine decodes there). The default runs them one after
  // another.
  struct AllgathervCall {
    const void* in;
    void* out;
    std::span<const uint64_t> counts;
    std::span<const uint64_t> displs;
    // Concurrent transfers the transport may split this call into; 0: its own choice.
    int max_channels = 0;
  };
  virtual void allgatherv_many(std::span<const AllgathervCall> calls,
                               const std::function<void(size_t)>& done = {}) {
    for (size_t i = 0; i < calls.size(); ++i) {
      allgatherv(calls[i].in, calls[i].out, calls[i].counts, calls[i].displs);
      if (done) done(i);
    }
  }

  // Personalised exchange: this rank sends send_counts[p] bytes from in + send_displs[p] to each
  // rank p (itself included) and receives recv_counts[p] bytes from p at out + recv_displs[p].
  // recv_counts[p] must be what p sends here (callers agree on sizes first: the lossless
  // collectives of collectives.hpp exchange them in a record). Not in place: `in` and `out` do
  // not overlap. A transport without it throws CommError naming itself (the default).
  virtual void alltoallv(const void* in, std::span<const uint64_t> send_counts,
                         std::span<const uint64_t> send_displs, void* out,
                         std::span<const uint64_t> recv_counts,
                         std::span<const uint64_t> recv_displs) {
    (void)in, (void)send_counts, (void)send_displs, (void)out, (void)recv_counts, (void)recv_displs;
    throw CommError("the " + std::string(name()) + " transport has no alltoallv");
  }

  // An alltoallv started by start_alltoallv. finish() returns once it has completed on this
  // rank (its `out` written, its `in` free again) and throws what alltoallv would. Destroying
  // one that was not finished waits for it, up to the timeout, and swallows its error: only
  // error paths should.
  class PendingExchange {
   public:
    virtual ~PendingExchange() = default;
    virtual void finish() = 0;
    // Whether the exchange has completed on this rank, without waiting (a transport that moves
    // bytes only when called moves them on here); throws what finish() would. finish() must
    // still be called. The default, for exchanges that cannot tell, says false: a caller
    // polling it then waits for its own work instead, and finish() for the exchange.
    virtual bool test() { return false; }
  };

  // alltoallv, started: it may return while the bytes still move, so that an exchange can be in
  // flight while the caller makes other calls of this transport (the lossless collectives keep
  // the next round's exchange in flight behind the current one's, so that no link idles
  // between rounds). Until finish() returns, the caller leaves `in` and `out` alone. Every rank
  // starts and finishes its exchanges in the same order as its other calls, and finishes them
  // in the order started. The count and displacement spans need not outlive the call. The
  // default runs alltoallv at once and returns it finished.
  virtual std::unique_ptr<PendingExchange> start_alltoallv(
      const void* in, std::span<const uint64_t> send_counts, std::span<const uint64_t> send_displs,
      void* out, std::span<const uint64_t> recv_counts, std::span<const uint64_t> recv_displs) {
    alltoallv(in, send_counts, send_displs, out, recv_counts, recv_displs);
    struct Finished final : PendingExchange {
      void finish() override {}
      bool test() override { return true; }
    };
    return std::make_unique<Finished>();
  }

  virtual void barrier() = 0;

  // Why this transport must not be called from a thread of an engine's own while its caller may
  // call it too ("" if it may): an MPI below MPI_THREAD_MULTIPLE. An engine refuses such a
  // transport (ConfigError); lossless collectives, which call it from their caller's thread, do
  // not.
  virtual std::string threading_problem() const { return ""; }

  // Longest a collective waits for its peers before it throws CommError; zero waits forever, a
  // negative timeout is std::invalid_argument.
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;
  virtual std::chrono::milliseconds timeout() const = 0;

  // Who uses this transport, held for the user's life. An engine (CompressedAllgather) calls it
  // from its own thread whenever a gather is in flight, so it must be the only user: a second
  // engine, or lossless collectives called meanwhile, would interleave their calls with its own,
  // and a peer could pair one's exchange with the other's (wrong bytes, or an MPI fault). Lossless
  // collectives call it only from their caller's thread, one call at a time, so several may
  // share a transport (a coded one and its uncoded twin), but not with an engine. A User that
  // breaks this is a ConfigError naming who holds the transport. Direct calls are the caller's
  // to order. An engine sets the timeout to its own (EngineConfig::timeout); its User gives the
  // transport back with the timeout it had before.
  class User {
   public:
    // `exclusive`: an engine's use (alone); else a lossless collectives' (shared among them).
    User(Transport& transport, const char* who, bool exclusive) : transport_(transport) {
      std::lock_guard lock(transport.users_mutex_);
      if (transport.engine_ != nullptr || (exclusive && transport.shared_users_ > 0)) {
        throw ConfigError(std::string(who) + ": the transport is in use by " +
                          (transport.engine_ != nullptr ? "an engine" : "lossless collectives") +
                          " (an engine needs a transport of its own: make one for each)");
      }
      if (exclusive) {
        transport.engine_ = who;
        timeout_before_ = transport.timeout();
      } else {
        ++transport.shared_users_;
      }
      exclusive_ = exclusive;
    }
    ~User() {
      std::lock_guard lock(transport_.users_mutex_);
      if (exclusive_) {
        transport_.set_timeout(timeout_before_);
        transport_.engine_ = nullptr;
      } else {
        --transport_.shared_users_;
      }
    }
    User(const User&) = delete;
    User& operator=(const User&) = delete;

   private:
    Transport& transport_;
    bool exclusive_ = false;
    std::chrono::milliseconds timeout_before_{0};
  };

 private:
  std::mutex users_mutex_;
  const char* engine_ = nullptr;
  int shared_users_ = 0;
};

}  // namespace ciera
