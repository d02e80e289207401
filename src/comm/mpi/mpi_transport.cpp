// Open MPI transport. Collectives are started nonblocking and polled against a deadline: a dead
// or stalled peer then surfaces as a CommError on every surviving rank instead of a hang
// (Open MPI reports nothing by itself when a peer vanishes mid-collective). Polling backs off
// from yielding to short sleeps, so oversubscribed ranks do not steal each other's cores.
#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "ciera/mpi.hpp"

namespace ciera {
namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

int checked_count(uint64_t bytes, const char* what) {
  if (bytes > static_cast<uint64_t>(INT_MAX)) {
    throw CommError(std::string("MPI ") + what + ": " + std::to_string(bytes) +
                    " bytes exceed MPI's per-rank count limit of 2 GiB");
  }
  return static_cast<int>(bytes);
}

class MpiTransport final : public Transport {
 public:
  explicit MpiTransport(MPI_Comm comm) {
    if (const char* c = std::getenv("CIERA_MPI_CHANNELS")) channels_ = std::max(1, std::atoi(c));
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) throw CommError("MPI transport: MPI is not initialised");
    check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiTransport() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // A communicator whose collective timed out may have operations in flight; leave it.
    if (!finalized && !broken_) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "mpi"; }

  void allgather(const void* in, size_t bytes, void* out) override {
    const int count = checked_count(bytes, "allgather");
    const void* send = in == static_cast<char*>(out) + rank_ * bytes ? MPI_IN_PLACE : in;
    MPI_Request request;
    check(MPI_Iallgather(send, count, MPI_BYTE, out, count, MPI_BYTE, comm_, &request),
          "MPI_Iallgather");
    wait(request, "MPI_Iallgather");
  }

  // Large exchanges are cut into `channels_` slices, each its own nonblocking collective, all in
  // flight at once: one collective at a time leaves TCP links idle between the algorithm's
  // rounds (like NCCL's channels, several transfers keep every link busy).
  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    const AllgathervCall call{in, out, counts, displs};
    allgatherv_many({&call, 1}, {});
  }

  void allgatherv_many(std::span<const AllgathervCall> calls,
                       const std::function<void(size_t)>& done = {}) override {
    requests_.clear();
    counts_.clear();
    displs_.clear();
    size_t slices = 0;
    for (const AllgathervCall& c : calls) slices += static_cast<size_t>(channels_for(c));
    // Reserve first: MPI reads the count arrays until the requests complete.
    counts_.reserve(slices * size_);
    displs_.reserve(slices * size_);
    std::vector<size_t> first_request;
    for (const AllgathervCall& c : calls) {
      first_request.push_back(requests_.size());
      start_allgatherv(c);
    }
    first_request.push_back(requests_.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      for (size_t r = first_request[i]; r < first_request[i + 1]; ++r) wait(requests_[r], "MPI_Iallgatherv");
      if (done) done(i);
    }
  }

 private:
  int channels_for(const AllgathervCall& c) const {
    uint64_t total = 0;
    for (int r = 0; r < size_; ++r) total += c.counts[r];
    const int channels = total >= kChannelThresholdBytes ? channels_ : 1;
    return c.max_channels > 0 ? std::min(channels, c.max_channels) : channels;
  }

  void start_allgatherv(const AllgathervCall& call) {
    const void* in = call.in;
    void* out = call.out;
    const std::span<const uint64_t> counts = call.counts;
    const std::span<const uint64_t> displs = call.displs;
    const int channels = channels_for(call);
    const bool in_place = in == static_cast<char*>(out) + displs[rank_];
    for (int c = 0; c < channels; ++c) {
      const size_t at = counts_.size();
      counts_.resize(at + size_);
      displs_.resize(at + size_);
      requests_.emplace_back();
      int* slice_counts = counts_.data() + at;
      int* slice_displs = displs_.data() + at;
      for (int r = 0; r < size_; ++r) {
        const uint64_t begin = counts[r] * c / channels;
        const uint64_t end = counts[r] * (c + 1) / channels;
        slice_counts[r] = checked_count(end - begin, "allgatherv");
        slice_displs[r] = checked_count(displs[r] + begin, "allgatherv displacement");
      }
      const void* send = in_place ? MPI_IN_PLACE
                                  : static_cast<const char*>(in) + counts[rank_] * c / channels;
      check(MPI_Iallgatherv(send, slice_counts[rank_], MPI_BYTE, out, slice_counts, slice_displs,
                            MPI_BYTE, comm_, &requests_.back()),
            "MPI_Iallgatherv");
    }
  }

 public:

  void barrier() override {
    MPI_Request request;
    check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
    wait(request, "MPI_Ibarrier");
  }

  void set_timeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

 private:
  void check(int code, const char* what) {
    if (broken_) throw CommError(std::string("MPI transport is unusable after an earlier failure"));
    if (code != MPI_SUCCESS) {
      broken_ = true;
      throw CommError(std::string(what) + " failed on rank " + std::to_string(rank_) + ": " +
                      mpi_error_text(code));
    }
  }

  void wait(MPI_Request& request, const char* what) {
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(0);
    for (;;) {
      int done = 0;
      const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (code != MPI_SUCCESS) {
        broken_ = true;
        throw CommError(std::string(what) + " failed on rank " + std::to_string(rank_) + ": " +
                        mpi_error_text(code));
      }
      if (done) return;
      if (timeout_.count() > 0 && std::chrono::steady_clock::now() - start > timeout_) {
        broken_ = true;
        throw CommError(std::string(what) + " on rank " + std::to_string(rank_) +
                        " did not complete within " + std::to_string(timeout_.count()) +
                        " ms: a peer is dead or stalled");
      }
      if (pause.count() == 0) {
        sched_yield();
        pause = std::chrono::microseconds(1);
      } else {
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(200));
      }
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  bool broken_ = false;
  std::chrono::milliseconds timeout_{std::chrono::seconds(120)};
  static constexpr uint64_t kChannelThresholdBytes = 1 << 20;
  int channels_ = 8;
  std::vector<int> counts_, displs_;
  std::vector<MPI_Request> requests_;
};

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(MPI_Comm comm) {
  return std::make_unique<MpiTransport>(comm);
}

}  // namespace ciera
