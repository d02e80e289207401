// Ranks as threads of one process. Each collective is two rendezvous: ranks publish their input
// and wait for everyone, copy what they need, then wait again so no input is released early.
// A rendezvous that times out poisons the world, so every rank fails instead of hanging.
#include <condition_variable>
#include <initializer_list>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ciera/loopback.hpp"
#include "common/poll.hpp"

namespace ciera {

class LoopbackWorld {
 public:
  explicit LoopbackWorld(int n)
      : size(n), slots(static_cast<size_t>(n)), taken(static_cast<size_t>(n)) {}

  struct Slot {
    const void* in = nullptr;
    uint64_t bytes = 0;
    int op = 0;
  };

  // Blocks until all ranks arrive; throws CommError on timeout or if the world is poisoned.
  void rendezvous(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout,
                  const char* what) {
    if (poisoned) throw CommError(reason);
    const uint64_t my_generation = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      changed.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (generation == my_generation && !poisoned) {
      if (timeout.count() == 0) {
        changed.wait(lock);
      } else if (changed.wait_until(lock, deadline) == std::cv_status::timeout &&
                 generation == my_generation) {
        poisoned = true;
        reason = std::string("loopback ") + what + ": peers did not arrive within " +
                 std::to_string(timeout.count()) + " ms (a peer is dead or stalled)";
        changed.notify_all();
      }
    }
    if (generation == my_generation) throw CommError(reason);
  }

  const int size;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Slot> slots;
  // Ranks that have a transport now: a second one for the same rank would count as another
  // arrival at each rendezvous, and a rank missing from the world would pass unnoticed.
  std::vector<bool> taken;
  int arrived = 0;
  uint64_t generation = 0;
  bool poisoned = false;
  std::string reason;
};

namespace {

enum Op { kAllgather = 1, kAllgatherv = 2, kBarrier = 3, kAlltoallv = 4 };
const char* op_name(int op) {
  switch (op) {
    case kAllgather:
      return "allgather";
    case kAllgatherv:
      return "allgatherv";
    case kAlltoallv:
      return "alltoallv";
    default:
      return "barrier";
  }
}

// What a rank publishes for alltoallv: where its part for each peer is.
struct AlltoallvSend {
  const char* in;
  std::span<const uint64_t> counts, displs;
};

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<LoopbackWorld> world, int rank, const MemoryOps& memory)
      : world_(std::move(world)), rank_(rank), memory_(memory) {
    std::lock_guard lock(world_->mutex);
    if (world_->taken[rank_]) {
      throw ConfigError("loopback rank " + std::to_string(rank_) +
                        " already has a transport in this world (each rank takes one)");
    }
    world_->taken[rank_] = true;
  }
  ~LoopbackTransport() override {
    std::lock_guard lock(world_->mutex);
    world_->taken[rank_] = false;
  }
  LoopbackTransport(const LoopbackTransport&) = delete;
  LoopbackTransport& operator=(const LoopbackTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return world_->size; }
  std::string_view name() const override { return "loopback"; }

  void allgather(const void* in, size_t bytes, void* out) override {
    collective(kAllgather, in, bytes, [&](const std::vector<LoopbackWorld::Slot>& slots) {
      for (int r = 0; r < world_->size; ++r) {
        if (slots[r].bytes != bytes) {
          throw CommError("loopback allgather: rank " + std::to_string(r) + " contributed " +
                          std::to_string(slots[r].bytes) + " bytes, rank " +
                          std::to_string(rank_) + " " + std::to_string(bytes));
        }
        copy(static_cast<char*>(out) + r * bytes, slots[r].in, bytes);
      }
    });
  }

  // Counts and displacements name one entry per rank; shorter ones would be read past (here,
  // and by every peer that reads this rank's send counts).
  void check_per_rank(const char* call, std::initializer_list<size_t> lengths) const {
    for (const size_t n : lengths) {
      if (n != static_cast<size_t>(world_->size)) {
        throw ConfigError(std::string("loopback ") + call + ": counts and displacements need " +
                          std::to_string(world_->size) + " entries, one per rank, got " +
                          std::to_string(n));
      }
    }
  }

  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    check_per_rank("allgatherv", {counts.size(), displs.size()});
    collective(kAllgatherv, in, counts[rank_], [&](const std::vector<LoopbackWorld::Slot>& slots) {
      for (int r = 0; r < world_->size; ++r) {
        if (slots[r].bytes != counts[r]) {
          throw CommError("loopback allgatherv: rank " + std::to_string(r) + " contributed " +
                          std::to_string(slots[r].bytes) + " bytes but rank " +
                          std::to_string(rank_) + " expected " + std::to_string(counts[r]));
        }
        copy(static_cast<char*>(out) + displs[r], slots[r].in, counts[r]);
      }
    });
  }

  void alltoallv(const void* in, std::span<const uint64_t> send_counts,
                 std::span<const uint64_t> send_displs, void* out,
                 std::span<const uint64_t> recv_counts,
                 std::span<const uint64_t> recv_displs) override {
    check_per_rank("alltoallv", {send_counts.size(), send_displs.size(), recv_counts.size(),
                                 recv_displs.size()});
    const AlltoallvSend mine{static_cast<const char*>(in), send_counts, send_displs};
    collective(kAlltoallv, &mine, 0, [&](const std::vector<LoopbackWorld::Slot>& slots) {
      for (int r = 0; r < world_->size; ++r) {
        const auto& peer = *static_cast<const AlltoallvSend*>(slots[r].in);
        const uint64_t sent = peer.counts[rank_];
        if (sent != recv_counts[r]) {
          throw CommError("loopback alltoallv: rank " + std::to_string(r) + " sent " +
                          std::to_string(sent) + " bytes but rank " + std::to_string(rank_) +
                          " expected " + std::to_string(recv_counts[r]));
        }
        copy(static_cast<char*>(out) + recv_displs[r], peer.in + peer.displs[rank_], sent);
      }
    });
  }

  void barrier() override { collective(kBarrier, nullptr, 0, [](const auto&) {}); }

  void set_timeout(std::chrono::milliseconds timeout) override {
    timeout_ = checked_timeout(timeout, "loopback transport set_timeout");
  }
  std::chrono::milliseconds timeout() const override { return timeout_; }

 private:
  // A rank's own contribution may already sit in its slot of `out` (in place), or overlap it.
  void copy(char* dst, const void* src, uint64_t bytes) const {
    if (bytes != 0 && dst != src) {
      memory_.move(reinterpret_cast<std::byte*>(dst), static_cast<const std::byte*>(src), bytes);
    }
  }

  template <typename CopyOut>
  void collective(int op, const void* in, uint64_t bytes, CopyOut&& copy_out) {
    std::unique_lock lock(world_->mutex);
    world_->slots[rank_] = {in, bytes, op};
    world_->rendezvous(lock, timeout_, op_name(op));
    std::string error;
    for (int r = 0; r < world_->size; ++r) {
      if (world_->slots[r].op != op) {
        error = std::string("loopback: rank ") + std::to_string(r) + " called " +
                op_name(world_->slots[r].op) + " while rank " + std::to_string(rank_) +
                " called " + op_name(op);
      }
    }
    if (error.empty()) {
      // Copy outside the lock would race with slot reuse; these copies are small or tests.
      try {
        copy_out(world_->slots);
      } catch (const CommError& e) {
        error = e.what();
      }
    }
    world_->rendezvous(lock, timeout_, op_name(op));
    if (!error.empty()) throw CommError(error);
  }

  std::shared_ptr<LoopbackWorld> world_;
  int rank_;
  const MemoryOps& memory_;
  std::chrono::milliseconds timeout_{std::chrono::seconds(60)};
};

}  // namespace

std::shared_ptr<LoopbackWorld> make_loopback_world(int size) {
  if (size < 1) throw ConfigError("loopback world needs at least one rank");
  return std::make_shared<LoopbackWorld>(size);
}

std::unique_ptr<Transport> make_loopback_transport(std::shared_ptr<LoopbackWorld> world, int rank,
                                                   const MemoryOps& memory) {
  if (world == nullptr) throw ConfigError("loopback transport: no world (make_loopback_world)");
  if (rank < 0 || rank >= world->size) {
    throw ConfigError("loopback rank " + std::to_string(rank) + " outside world of " +
                      std::to_string(world->size));
  }
  return std::make_unique<LoopbackTransport>(std::move(world), rank, memory);
}

}  // namespace ciera
