// Open MPI transport. Collectives are started nonblocking and polled against a deadline: a dead
// or stalled peer then surfaces as a CommError on every surviving rank instead of a hang
// (Open MPI reports nothing by itself when a peer vanishes mid-collective). Polling backs off
// from yielding to short sleeps, so oversubscribed ranks do not steal each other's cores.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ciera/mpi.hpp"
#include "common/poll.hpp"

namespace ciera {
namespace {

// Set when any MPI transport of this process fails: from then on MPI_Finalize, which waits for
// every peer, could block forever on the one that is gone or stopped (mpi_shutdown()).
std::atomic<bool> g_communication_failed{false};

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

// "rank N" where the launcher says which rank this process is (before MPI knows), else its pid.
std::string process_name() {
  for (const char* variable : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    if (const char* rank = std::getenv(variable)) return std::string("rank ") + rank;
  }
  return "pid " + std::to_string(getpid());
}

// MPI's blocking calls that have no deadline and no nonblocking form to poll wait forever for a
// peer that is stopped or dead before reaching them: Open MPI's MPI_Init_thread and MPI_Finalize
// meet every rank through the launcher (a PMIx fence), and MPI_Comm_split is a collective. Each
// runs while a Watchdog is alive. If the call has not returned within the timeout, the watchdog's
// thread prints one line naming the call and ends this process, the only way out of a call that
// cannot be interrupted: by MPI_Abort where MPI is running (the launcher ends every rank, stopped
// ones too; only from this second thread where MPI allows it, MPI_THREAD_MULTIPLE), by _exit
// while MPI is starting or finishing and MPI_Abort is not allowed (the launcher, seeing a rank end
// before MPI_Finalize, ends the job). A timeout of 0 watches nothing. The line is made before the
// watch starts: MPI's start-up may change the environment while the thread would read it.
class Watchdog {
 public:
  enum class End { kExit, kAbortJob };

  Watchdog(const char* call, std::chrono::milliseconds timeout, int exit_code, End end) {
    if (timeout.count() <= 0) return;
    std::string line = "ciera (" + process_name() + "): error: " + call +
                       " did not return within " + std::to_string(timeout.count()) +
                       " ms: a peer is dead or stalled; ending this process\n";
    thread_ = std::thread([this, line = std::move(line), timeout, exit_code, end] {
      std::unique_lock lock(mutex_);
      if (returned_.wait_for(lock, timeout, [this] { return done_; })) return;
      std::fputs(line.c_str(), stderr);
      int level = MPI_THREAD_SINGLE;
      if (end == End::kAbortJob && MPI_Query_thread(&level) == MPI_SUCCESS &&
          level == MPI_THREAD_MULTIPLE) {
        mpi_abort(exit_code);
      }
      std::fflush(nullptr);  // stdout too: a report may wait in its buffer
      _exit(exit_code);
    });
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    returned_.notify_one();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable returned_;
  bool done_ = false;
  std::thread thread_;
};

int checked_count(uint64_t bytes, const char* what) {
  if (bytes > static_cast<uint64_t>(INT_MAX)) {
    throw CommError(std::string("MPI ") + what + ": " + std::to_string(bytes) +
                    " bytes exceed MPI's per-rank count limit of 2 GiB");
  }
  return static_cast<int>(bytes);
}

// Before any MPI call of a transport's making: MPI started and not finished (either would abort
// the job inside MPI's own checks).
void require_usable_mpi() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw CommError("MPI transport: MPI is not initialised");
  MPI_Finalized(&finalized);
  if (finalized) throw CommError("MPI transport: MPI is finalised (mpi_shutdown or MPI_Finalize)");
}

// MPI_COMM_NULL (what MPI_Comm_split gives a rank of colour MPI_UNDEFINED) is no communicator:
// MPI's own checks would abort the job at the first call on it.
void require_communicator(MPI_Comm comm) {
  if (comm == MPI_COMM_NULL) {
    throw std::invalid_argument(
        "mpi_transport: the communicator is MPI_COMM_NULL (as MPI_Comm_split gives a rank "
        "of colour MPI_UNDEFINED): pass one this rank belongs to");
  }
}

class MpiTransport final : public Transport {
 public:
  MpiTransport(MPI_Comm comm, std::chrono::milliseconds timeout)
      : timeout_(checked_timeout(timeout, "mpi_transport")) {
    require_usable_mpi();
    require_communicator(comm);
    MPI_Comm_rank(comm, &rank_);
    // A collective over `comm`, nonblocking and polled: a peer that never joins is a CommError.
    MPI_Request request;
    check(MPI_Comm_idup(comm, &comm_, &request), "MPI_Comm_idup");
    wait(request, "MPI_Comm_idup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    try {
      agree_on_settings();
    } catch (const ConfigError&) {
      MPI_Comm_free(&comm_);
      throw;
    }
  }
  // The engine calls the transport from its own thread while its caller may call MPI too.
  std::string threading_problem() const override {
    int level = 0;
    MPI_Query_thread(&level);
    if (level >= MPI_THREAD_MULTIPLE) return "";
    return "MPI was initialised with thread level " + std::to_string(level) +
           ", below MPI_THREAD_MULTIPLE (" + std::to_string(MPI_THREAD_MULTIPLE) +
           "), and an engine calls MPI from a thread of its own: initialise with ciera::mpi_init, "
           "or MPI_Init_thread asking for MPI_THREAD_MULTIPLE";
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
    // MPI_Iallgatherv takes int counts and displacements: an output past 2 GiB (a slot stride, or
    // parts of several GiB) goes round the ring, which moves 64-bit spans, whatever was chosen,
    // in batches whose tags fit. Every rank passes the same counts and displacements (this
    // interface's contract; the engine's slot_stride is the same on every rank), so every rank
    // decides alike.
    if (size_ > 1 && !fits_in_ints(calls)) {
      const size_t batch = std::max<uint64_t>(1, kMaxRingTag / ring_tags_per_call());
      for (size_t first = 0; first < calls.size(); first += batch) {
        const size_t n = std::min(batch, calls.size() - first);
        ring_allgatherv(calls.subspan(first, n),
                        done ? std::function<void(size_t)>([&](size_t i) { done(first + i); })
                             : std::function<void(size_t)>());
      }
      return;
    }
    const bool ring = size_ > 1 && ring_tags_fit(calls.size()) && pick(calls) == Algorithm::kRing;
    const Algorithm algorithm = ring ? Algorithm::kRing : Algorithm::kNbc;
    const auto start = std::chrono::steady_clock::now();
    if (algorithm == Algorithm::kRing) {
      ring_allgatherv(calls, done);
    } else {
      nbc_allgatherv(calls, done);
    }
    if (choice_ == Algorithm::kAuto && large(calls)) {
      Trial& t = trials_[algorithm == Algorithm::kRing ? 1 : 0];
      t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      t.bytes += static_cast<double>(total_bytes(calls));
    }
  }

 private:
  // ---- Settings every rank must share ---------------------------------------------------
  // CIERA_MPI_CHANNELS and CIERA_MPI_ALLGATHERV are read on each rank, and ranks that read them
  // differently would make different calls (other slice counts, other tags, ring against direct)
  // and wait out the timeout, blaming a dead peer. Launchers export them to every rank alike, but
  // nothing made them: so each rank reads its own, the ranks gather what they read (one small
  // allgather when the transport is made), and a value that is not understood on any rank, or
  // that differs between ranks, is the same ConfigError on every rank, naming the ranks.
  void agree_on_settings() {
    constexpr int kUnreadable = -1;
    int mine[2] = {8, static_cast<int>(Algorithm::kAuto)};  // channels, algorithm
    if (const char* c = std::getenv("CIERA_MPI_CHANNELS")) {
      char* end = nullptr;
      const long channels = std::strtol(c, &end, 10);
      if (*c == '\0' || *end != '\0' || channels < 1 || channels > 4096) {
        mine[0] = kUnreadable;
      } else {
        mine[0] = static_cast<int>(channels);
      }
    }
    if (const char* a = std::getenv("CIERA_MPI_ALLGATHERV")) {
      const std::string name = a;
      if (name == "ring") {
        mine[1] = static_cast<int>(Algorithm::kRing);
      } else if (name == "nbc") {
        mine[1] = static_cast<int>(Algorithm::kNbc);
      } else if (!name.empty() && name != "auto") {
        mine[1] = kUnreadable;
      }
    }
    std::vector<int> all(2 * static_cast<size_t>(size_));
    MPI_Request request;
    check(MPI_Iallgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, comm_, &request),
          "MPI_Iallgather");
    wait(request, "MPI_Iallgather");
    static constexpr const char* kNames[2] = {"CIERA_MPI_CHANNELS", "CIERA_MPI_ALLGATHERV"};
    static constexpr const char* kAllowed[2] = {"a whole number from 1 to 4096",
                                                "one of: auto, ring, nbc"};
    static constexpr const char* kAlgorithms[3] = {"auto", "ring", "nbc"};
    auto shown = [&](int setting, int value) {
      return setting == 0 ? std::to_string(value)
                          : std::string(kAlgorithms[static_cast<size_t>(value)]);
    };
    for (int setting = 0; setting < 2; ++setting) {
      auto value_of = [&](int r) {
        return all[2 * static_cast<size_t>(r) + static_cast<size_t>(setting)];
      };
      std::string bad, values;
      bool same = true;
      for (int r = 0; r < size_; ++r) {
        if (value_of(r) == kUnreadable) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
        same = same && value_of(r) == value_of(0);
        values += (r == 0 ? "" : ", ") + std::string("rank ") + std::to_string(r) + " " +
                  (value_of(r) == kUnreadable ? "?" : shown(setting, value_of(r)));
      }
      if (!bad.empty()) {
        throw ConfigError(std::string(kNames[setting]) + " is not " + kAllowed[setting] +
                          " on rank(s) " + bad);
      }
      if (!same) {
        throw ConfigError(std::string(kNames[setting]) +
                          " must be the same on every rank (ranks that read it differently make "
                          "different calls and wait for each other): " +
                          values);
      }
    }
    channels_ = mine[0];
    choice_ = static_cast<Algorithm>(mine[1]);
  }

  // ---- Choosing the allgatherv algorithm --------------------------------------------------
  // Over slow links (TCP at a few Gbit/s) the ring wins: one connection per direction, every
  // link busy. Where the "link" is fast and the ranks share cores (shared memory, local veth),
  // the ring's rank-to-rank forwarding waits on the scheduler and MPI's direct exchange wins.
  // Which case applies is measured: the first kTrials large calls alternate the two, then all
  // ranks agree (one allreduce, at the same call on every rank, since every rank sees the same
  // counts) on the one with the lower worst-rank time per byte. CIERA_MPI_ALLGATHERV forces one.
  enum class Algorithm { kAuto, kRing, kNbc };
  struct Trial {
    double seconds = 0, bytes = 0;
  };
  static constexpr int kTrials = 4;

  bool fits_in_ints(std::span<const AllgathervCall> calls) const {
    constexpr uint64_t kMax = INT_MAX;
    for (const AllgathervCall& c : calls) {
      for (int r = 0; r < size_; ++r) {
        const uint64_t count = c.counts[static_cast<size_t>(r)];
        const uint64_t displ = c.displs[static_cast<size_t>(r)];
        if (count > kMax || displ > kMax || count > kMax - displ) return false;
      }
    }
    return true;
  }

  uint64_t total_bytes(std::span<const AllgathervCall> calls) const {
    uint64_t total = 0;
    for (const AllgathervCall& c : calls) {
      for (int r = 0; r < size_; ++r) total += c.counts[static_cast<size_t>(r)];
    }
    return total;
  }
  bool large(std::span<const AllgathervCall> calls) const {
    return total_bytes(calls) >= kChannelThresholdBytes;
  }

  Algorithm pick(std::span<const AllgathervCall> calls) {
    if (choice_ != Algorithm::kAuto) return choice_;
    if (!large(calls)) return chosen_ == Algorithm::kAuto ? Algorithm::kNbc : chosen_;
    if (chosen_ != Algorithm::kAuto) return chosen_;
    if (large_calls_ < kTrials) return large_calls_++ % 2 == 0 ? Algorithm::kNbc : Algorithm::kRing;
    double per_byte[2] = {trials_[0].seconds / trials_[0].bytes, trials_[1].seconds / trials_[1].bytes};
    double worst[2];
    MPI_Request request;
    check(MPI_Iallreduce(per_byte, worst, 2, MPI_DOUBLE, MPI_MAX, comm_, &request), "MPI_Iallreduce");
    wait(request, "MPI_Iallreduce");
    chosen_ = worst[1] < worst[0] ? Algorithm::kRing : Algorithm::kNbc;
    return chosen_;
  }

  void nbc_allgatherv(std::span<const AllgathervCall> calls, const std::function<void(size_t)>& done) {
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

  // ---- Pipelined ring (as gloo and NCCL run allgather) -------------------------------------
  // W - 1 steps; in step s rank r passes block (r - s) mod W to its right neighbour. Each block
  // is cut into `channels_` segments and a segment is forwarded as soon as it has arrived, so
  // every link sends and receives all the time and each rank keeps one connection per
  // direction (instead of one per peer and channel, which made TCP flows fight over the link).
  int ring_segments() const { return channels_; }
  static constexpr uint64_t kMaxRingTag = 32767;  // MPI guarantees tags up to 32767
  // A call's ring takes one tag per step and segment.
  uint64_t ring_tags_per_call() const {
    return static_cast<uint64_t>(size_ - 1) * static_cast<uint64_t>(ring_segments());
  }
  bool ring_tags_fit(size_t calls) const {
    return static_cast<uint64_t>(calls) * ring_tags_per_call() <= kMaxRingTag;
  }

  void ring_allgatherv(std::span<const AllgathervCall> calls, const std::function<void(size_t)>& done) {
    const int left = (rank_ + size_ - 1) % size_;
    const int right = (rank_ + 1) % size_;
    const int segments = ring_segments();
    const int steps = size_ - 1;
    struct Segment {
      char* at;
      int bytes;
    };
    // The segment k of block b of call i, in the output.
    auto segment = [&](size_t i, int block, int k) {
      const AllgathervCall& c = calls[i];
      const uint64_t count = c.counts[static_cast<size_t>(block)];
      const uint64_t begin = count * static_cast<uint64_t>(k) / static_cast<uint64_t>(segments);
      const uint64_t end = count * static_cast<uint64_t>(k + 1) / static_cast<uint64_t>(segments);
      return Segment{static_cast<char*>(c.out) + c.displs[static_cast<size_t>(block)] + begin,
                     checked_count(end - begin, "allgatherv")};
    };
    auto tag = [&](size_t i, int step, int k) {
      return static_cast<int>((i * static_cast<size_t>(steps) + static_cast<size_t>(step)) *
                                  static_cast<size_t>(segments) + static_cast<size_t>(k));
    };
    const size_t per_call = static_cast<size_t>(steps) * static_cast<size_t>(segments);
    std::vector<MPI_Request> recvs(calls.size() * per_call, MPI_REQUEST_NULL);
    std::vector<MPI_Request> sends(calls.size() * per_call, MPI_REQUEST_NULL);
    for (size_t i = 0; i < calls.size(); ++i) {
      const AllgathervCall& c = calls[i];
      const uint64_t own = c.counts[static_cast<size_t>(rank_)];
      char* own_out = static_cast<char*>(c.out) + c.displs[static_cast<size_t>(rank_)];
      if (c.in != own_out && own != 0) std::memcpy(own_out, c.in, own);
      for (int s = 0; s < steps; ++s) {
        const int block = (rank_ - s - 1 + 2 * size_) % size_;
        for (int k = 0; k < segments; ++k) {
          const Segment g = segment(i, block, k);
          check(MPI_Irecv(g.at, g.bytes, MPI_BYTE, left, tag(i, s, k), comm_,
                          &recvs[i * per_call + static_cast<size_t>(s * segments + k)]),
                "MPI_Irecv");
        }
      }
      for (int k = 0; k < segments; ++k) {
        const Segment g = segment(i, rank_, k);
        check(MPI_Isend(g.at, g.bytes, MPI_BYTE, right, tag(i, 0, k), comm_,
                        &sends[i * per_call + static_cast<size_t>(k)]),
              "MPI_Isend");
      }
    }
    // Forward each arrived segment (but the last step's) and report calls as they complete.
    std::vector<int> index(recvs.size());
    std::vector<size_t> received(calls.size(), 0);
    size_t next_done = 0;
    size_t outstanding = recvs.size();
    poll([&]() -> bool {
      int completed = 0;
      const int code = MPI_Testsome(static_cast<int>(recvs.size()), recvs.data(), &completed,
                                    index.data(), MPI_STATUSES_IGNORE);
      if (code != MPI_SUCCESS) fail(code, "MPI_Irecv");
      for (int j = 0; j < (completed == MPI_UNDEFINED ? 0 : completed); ++j) {
        const size_t r = static_cast<size_t>(index[static_cast<size_t>(j)]);
        const size_t i = r / per_call;
        const int s = static_cast<int>(r % per_call) / segments;
        const int k = static_cast<int>(r % per_call) % segments;
        ++received[i];
        --outstanding;
        ++progress_;
        if (s + 1 < steps) {
          const int block = (rank_ - s - 1 + 2 * size_) % size_;
          const Segment g = segment(i, block, k);
          check(MPI_Isend(g.at, g.bytes, MPI_BYTE, right, tag(i, s + 1, k), comm_,
                          &sends[i * per_call + static_cast<size_t>((s + 1) * segments + k)]),
                "MPI_Isend");
        }
      }
      // Calls complete in order once all their segments are in (their sends finish below).
      while (done && next_done < calls.size() && received[next_done] == per_call) done(next_done++);
      return outstanding == 0;
    }, "ring allgatherv (receive)");
    poll([&]() -> bool {
      int all = 0;
      const int code = MPI_Testall(static_cast<int>(sends.size()), sends.data(), &all, MPI_STATUSES_IGNORE);
      if (code != MPI_SUCCESS) fail(code, "MPI_Isend");
      return all != 0;
    }, "ring allgatherv (send)");
    while (done && next_done < calls.size()) done(next_done++);
  }

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
  void alltoallv(const void* in, std::span<const uint64_t> send_counts,
                 std::span<const uint64_t> send_displs, void* out,
                 std::span<const uint64_t> recv_counts,
                 std::span<const uint64_t> recv_displs) override {
    start_alltoallv(in, send_counts, send_displs, out, recv_counts, recv_displs)->finish();
  }

  // One call on every rank, MPI_Ialltoallw: Open MPI's own schedule, measured faster over TCP
  // than all sends posted at once (the link lab, 4 ranks at 1 Gbit/s: 227 against 390 ms for
  // 25 MB per rank, with MPI_Ialltoallv, whose schedule is the same). A part whose count and
  // displacement fit MPI's ints goes as that many MPI_BYTEs; any other as one element of a type
  // that holds its displacement and its bytes in pieces of 1 GiB (part_type). The type is chosen
  // part by part, so a rank whose parts all fit makes the same call as a rank whose parts do not:
  // choosing between two different calls by a rank's own counts alone (as this transport once
  // did) left a rank in MPI's collective while its peers went point to point, and both waited
  // out the timeout.
  std::unique_ptr<PendingExchange> start_alltoallv(const void* in,
                                                   std::span<const uint64_t> send_counts,
                                                   std::span<const uint64_t> send_displs, void* out,
                                                   std::span<const uint64_t> recv_counts,
                                                   std::span<const uint64_t> recv_displs) override {
    // MPI reads the counts, displacements and types until the exchange completes: the pending
    // exchange keeps them, and frees the types it made.
    auto pending = std::make_unique<PendingMpiExchange>(*this);
    // A rank that sends itself other than it expects from itself (its own mistake: the peers'
    // parts are not in question) still takes part, without its own part, and finish() refuses
    // it once the exchange is over: refusing at once would leave its peers in the collective
    // until the timeout, blaming a dead peer. Its output's own part is left as it was.
    const auto own = static_cast<size_t>(rank_);
    if (send_counts[own] != recv_counts[own]) {
      pending->refused = "MPI alltoallv: rank " + std::to_string(rank_) + " sends itself " +
                         std::to_string(send_counts[own]) + " bytes but expects " +
                         std::to_string(recv_counts[own]) + " from itself";
    }
    const std::span<const uint64_t> sides[2][2] = {{send_counts, send_displs},
                                                   {recv_counts, recv_displs}};
    for (int side = 0; side < 2; ++side) {
      auto& [counts, displs, types] = pending->parts[side];
      for (size_t p = 0; p < static_cast<size_t>(size_); ++p) {
        const uint64_t bytes = p == own && !pending->refused.empty() ? 0 : sides[side][0][p];
        const uint64_t at = sides[side][1][p];
        if (bytes <= static_cast<uint64_t>(INT_MAX) && at <= static_cast<uint64_t>(INT_MAX)) {
          counts.push_back(static_cast<int>(bytes));
          displs.push_back(bytes == 0 ? 0 : static_cast<int>(at));
          types.push_back(MPI_BYTE);
        } else {
          counts.push_back(bytes == 0 ? 0 : 1);
          displs.push_back(0);
          types.push_back(bytes == 0 ? MPI_BYTE : part_type(at, bytes, pending->made));
        }
      }
    }
    auto& [sc, sd, st] = pending->parts[0];
    auto& [rc, rd, rt] = pending->parts[1];
    pending->requests.emplace_back();
    check(MPI_Ialltoallw(in, sc.data(), sd.data(), st.data(), out, rc.data(), rd.data(), rt.data(),
                         comm_, &pending->requests.back()),
          "MPI_Ialltoallw");
    return pending;
  }

  // `bytes` bytes from `at` on, as one element of a committed type (kept in `made`, to be freed):
  // hindexed blocks of MPI_BYTE of at most 1 GiB each, displacements in MPI_Aint.
  MPI_Datatype part_type(uint64_t at, uint64_t bytes, std::vector<MPI_Datatype>& made) {
    constexpr uint64_t kPieceBytes = uint64_t{1} << 30;
    std::vector<int> lengths;
    std::vector<MPI_Aint> offsets;
    for (uint64_t done = 0; done < bytes; done += kPieceBytes) {
      lengths.push_back(static_cast<int>(std::min(kPieceBytes, bytes - done)));
      offsets.push_back(static_cast<MPI_Aint>(at + done));
    }
    MPI_Datatype type = MPI_DATATYPE_NULL;
    check(MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(), offsets.data(),
                                   MPI_BYTE, &type),
          "MPI_Type_create_hindexed");
    made.push_back(type);
    check(MPI_Type_commit(&made.back()), "MPI_Type_commit");
    return made.back();
  }

  void barrier() override {
    MPI_Request request;
    check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
    wait(request, "MPI_Ibarrier");
  }

  void set_timeout(std::chrono::milliseconds timeout) override {
    timeout_ = checked_timeout(timeout, "MPI transport set_timeout");
  }
  std::chrono::milliseconds timeout() const override { return timeout_; }

 private:
  void check(int code, const char* what) {
    if (broken_) throw CommError(std::string("MPI transport is unusable after an earlier failure"));
    if (code != MPI_SUCCESS) {
      mark_broken();
      throw CommError(std::string(what) + " failed on rank " + std::to_string(rank_) + ": " +
                      mpi_error_text(code));
    }
  }

  void mark_broken() {
    broken_ = true;
    g_communication_failed = true;
  }

  [[noreturn]] void fail(int code, const char* what) {
    mark_broken();
    throw CommError(std::string(what) + " failed on rank " + std::to_string(rank_) + ": " +
                    mpi_error_text(code));
  }

  void wait(MPI_Request& request, const char* what) {
    poll([&]() -> bool {
      int done = 0;
      const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (code != MPI_SUCCESS) fail(code, what);
      return done != 0;
    }, what);
  }

  // Calls `test` until it returns true or the deadline passes (CommError).
  template <typename Test>
  void poll(Test&& test, const char* what) {
    if (!poll_until(test, timeout_, &progress_)) {
      mark_broken();
      throw CommError(std::string(what) + " on rank " + std::to_string(rank_) +
                      " did not complete within " + std::to_string(timeout_.count()) +
                      " ms: a peer is dead or stalled");
    }
  }

  // An exchange's requests, polled against the transport's deadline by finish().
  struct PendingMpiExchange final : PendingExchange {
    explicit PendingMpiExchange(MpiTransport& t) : transport(t) {}
    ~PendingMpiExchange() override {
      if (!finished && !transport.broken_) {
        try {
          finish();
        } catch (...) {  // an error path already under way: that error is the one that matters
        }
      }
      // After a failure MPI may still read them, and nothing is sent on that transport again.
      if (transport.broken_) return;
      for (MPI_Datatype& type : made) MPI_Type_free(&type);
    }
    void finish() override {
      if (finished) return;
      finished = true;
      transport.poll([&] { return completed(); }, "alltoallv");
      if (!refused.empty()) throw ConfigError(refused);
    }
    bool test() override {
      if (finished) return true;
      if (!completed()) return false;
      if (!refused.empty()) throw ConfigError(refused);
      return true;
    }
    bool completed() {
      int all = 0;
      const int code = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &all,
                                   MPI_STATUSES_IGNORE);
      if (code != MPI_SUCCESS) transport.fail(code, "alltoallv");
      return all != 0;
    }
    MpiTransport& transport;
    std::vector<MPI_Request> requests;
    struct Parts {  // MPI_Ialltoallw's arguments for one side, [0] sent, [1] received
      std::vector<int> counts, displs;
      std::vector<MPI_Datatype> types;
    } parts[2];
    std::vector<MPI_Datatype> made;  // the types part_type made for this exchange
    std::string refused;             // this rank's own counts disagree: finish() throws it
    bool finished = false;
  };

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  bool broken_ = false;
  std::chrono::milliseconds timeout_;
  static constexpr uint64_t kChannelThresholdBytes = 1 << 20;
  int channels_ = 8;
  Algorithm choice_ = Algorithm::kAuto;  // CIERA_MPI_ALLGATHERV
  Algorithm chosen_ = Algorithm::kAuto;  // after the trials
  int large_calls_ = 0;
  Trial trials_[2];                       // [0] nbc, [1] ring
  uint64_t progress_ = 0;                 // completions seen by poll() (resets its back-off)
  std::vector<int> counts_, displs_;
  std::vector<MPI_Request> requests_;
};

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(MPI_Comm comm, std::chrono::milliseconds timeout) {
  return std::make_unique<MpiTransport>(comm, timeout);
}

namespace {

std::string group_text(std::span<const int> group) {
  std::string text = "{";
  for (size_t i = 0; i < group.size(); ++i) text += (i ? ", " : "") + std::to_string(group[i]);
  return text + "}";
}

// Every rank's group, gathered before the split (polled against `timeout`, like the transport's
// collectives), and checked alike on every rank: a group that leaves out its own rank, names a
// rank twice or one outside `comm`, or that one of its members names otherwise (other ranks, or
// another order) is the same ConfigError on every rank. The split alone failed only the ranks
// whose group came out of another size, passed groups named in other orders, and left its peers
// waiting (until the split's watchdog ended the job) for a rank that refused its list alone.
void agree_on_groups(MPI_Comm comm, std::span<const int> ranks, std::chrono::milliseconds timeout) {
  int world = 1;
  MPI_Comm_size(comm, &world);
  // More than `world` ranks names one twice or one outside `comm`: world + 1 of them show it.
  const std::span<const int> sent =
      ranks.first(std::min(ranks.size(), static_cast<size_t>(world) + 1));
  const std::vector<std::string> bytes = mpi_allgather_bytes(
      comm, std::string_view(reinterpret_cast<const char*>(sent.data()), sent.size_bytes()),
      timeout, "the ranks' groups");
  std::vector<std::vector<int>> groups(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const std::string& mine = bytes[static_cast<size_t>(r)];
    std::vector<int>& group = groups[static_cast<size_t>(r)];
    group.resize(mine.size() / sizeof(int));
    std::memcpy(group.data(), mine.data(), group.size() * sizeof(int));
  }
  const auto group_of = [&](int r) -> std::span<const int> {
    return groups[static_cast<size_t>(r)];
  };
  for (int r = 0; r < world; ++r) {
    const std::span<const int> group = group_of(r);
    std::string problem;
    std::vector<bool> seen(static_cast<size_t>(world), false);
    for (const int m : group) {
      if (m < 0 || m >= world) {
        problem = "names rank " + std::to_string(m) +
                  ", which is not a rank of the communicator (" + std::to_string(world) + " ranks)";
      } else if (seen[static_cast<size_t>(m)]) {
        problem = "names rank " + std::to_string(m) + " twice";
      }
      if (!problem.empty()) break;
      seen[static_cast<size_t>(m)] = true;
    }
    if (problem.empty() && !seen[static_cast<size_t>(r)]) problem = "leaves itself out";
    for (size_t k = 0; problem.empty() && k < group.size(); ++k) {
      const std::span<const int> theirs = group_of(group[k]);
      if (!std::equal(group.begin(), group.end(), theirs.begin(), theirs.end())) {
        problem = "names rank " + std::to_string(group[k]) + ", which named " + group_text(theirs);
      }
    }
    if (!problem.empty()) {
      throw ConfigError("mpi_transport: the ranks disagree on the groups: rank " +
                        std::to_string(r) + " named " + group_text(group) + " and " + problem +
                        " (each rank names its own group, in the group's order, and the groups "
                        "partition the communicator)");
    }
  }
}

}  // namespace

std::unique_ptr<Transport> make_mpi_transport(MPI_Comm comm, std::span<const int> ranks,
                                              std::chrono::milliseconds timeout) {
  checked_timeout(timeout, "mpi_transport");
  require_usable_mpi();
  require_communicator(comm);
  agree_on_groups(comm, ranks, timeout);
  int me = 0;
  MPI_Comm_rank(comm, &me);
  const auto at = std::find(ranks.begin(), ranks.end(), me);
  // Groups partition `comm`, so the smallest rank of each names it; the order given is the
  // group's rank order.
  const int color = *std::min_element(ranks.begin(), ranks.end());
  MPI_Comm split = MPI_COMM_NULL;
  int code = MPI_SUCCESS;
  {
    Watchdog watchdog("MPI_Comm_split", timeout, 1, Watchdog::End::kAbortJob);
    code = MPI_Comm_split(comm, color, static_cast<int>(at - ranks.begin()), &split);
  }
  if (code != MPI_SUCCESS)
    throw CommError("mpi_transport: MPI_Comm_split failed: " + mpi_error_text(code));
  int size = 0;
  MPI_Comm_size(split, &size);
  if (static_cast<size_t>(size) != ranks.size()) {
    MPI_Comm_free(&split);
    throw ConfigError("mpi_transport: rank " + std::to_string(me) + " named a group of " +
                      std::to_string(ranks.size()) + " ranks, but " + std::to_string(size) +
                      " ranks joined it (the ranks disagree on the groups)");
  }
  std::unique_ptr<Transport> transport;
  try {
    transport = make_mpi_transport(split, timeout);  // a duplicate of it
  } catch (const CommError&) {
    throw;  // the duplicate timed out or failed: MPI may still use `split`, so leave it
  } catch (...) {
    MPI_Comm_free(&split);
    throw;
  }
  MPI_Comm_free(&split);
  return transport;
}

bool mpi_communication_failed() { return g_communication_failed; }

std::vector<std::string> mpi_allgather_bytes(MPI_Comm comm, std::string_view mine,
                                             std::chrono::milliseconds timeout, const char* what) {
  int world = 1;
  MPI_Comm_size(comm, &world);
  if (mine.size() > static_cast<size_t>(INT_MAX / world)) {
    throw ConfigError(std::string("mpi_allgather_bytes: ") + what + " take " +
                      std::to_string(mine.size()) + " bytes on this rank, more than " +
                      std::to_string(INT_MAX / world) + " (INT_MAX over the ranks)");
  }
  const int length = static_cast<int>(mine.size());
  std::vector<int> lengths(static_cast<size_t>(world)), offsets(static_cast<size_t>(world));
  const std::string gather = std::string("MPI_Iallgather (") + what + ")";
  MPI_Request request;
  int code = MPI_Iallgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm, &request);
  if (code != MPI_SUCCESS) {
    g_communication_failed = true;
    throw CommError(gather + " failed: " + mpi_error_text(code));
  }
  mpi_wait_all({&request, 1}, timeout, gather.c_str());
  int64_t total = 0;
  for (int r = 0; r < world; ++r) {
    offsets[static_cast<size_t>(r)] = static_cast<int>(total);
    total += lengths[static_cast<size_t>(r)];
    if (lengths[static_cast<size_t>(r)] < 0 || total > INT_MAX) {
      throw CommError(gather + ": rank " + std::to_string(r) + " sent an impossible length");
    }
  }
  std::string all(static_cast<size_t>(total), '\0');
  const std::string gatherv = std::string("MPI_Iallgatherv (") + what + ")";
  code = MPI_Iallgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                         MPI_CHAR, comm, &request);
  if (code != MPI_SUCCESS) {
    g_communication_failed = true;
    throw CommError(gatherv + " failed: " + mpi_error_text(code));
  }
  mpi_wait_all({&request, 1}, timeout, gatherv.c_str());
  std::vector<std::string> each(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    each[static_cast<size_t>(r)] = all.substr(static_cast<size_t>(offsets[static_cast<size_t>(r)]),
                                              static_cast<size_t>(lengths[static_cast<size_t>(r)]));
  }
  return each;
}

void mpi_wait_all(std::span<MPI_Request> requests, std::chrono::milliseconds timeout,
                  const char* what) {
  checked_timeout(timeout, std::string("mpi_wait_all (") + what + ")");
  const bool done = poll_until(
      [&] {
        int all = 0;
        const int code = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &all,
                                     MPI_STATUSES_IGNORE);
        if (code != MPI_SUCCESS) {
          g_communication_failed = true;
          throw CommError(std::string(what) + " failed: " + mpi_error_text(code));
        }
        return all != 0;
      },
      timeout, nullptr);
  if (!done) {
    g_communication_failed = true;
    throw CommError(std::string(what) + " did not complete within " +
                    std::to_string(timeout.count()) + " ms: a peer is dead or stalled");
  }
}

int mpi_init(int* argc, char*** argv, std::chrono::milliseconds timeout) {
  int initialized = 0, provided = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&provided);
    return provided;
  }
  // Over TCP, Open MPI 4.1's ob1 sends a message of btl_tcp_min_rdma_pipeline_size (196,608)
  // bytes or more as emulated PUTs closed by a FIN fragment. The sender's request can complete
  // while that FIN still waits in its user-space send queue for a full socket to drain, and only
  // the sender's own progress engine writes it out: a rank that has finished its part of an
  // exchange and waits elsewhere (in gloo, in compute) leaves its peer polling for the FIN until
  // the deadline. The TCP BTL's progress thread writes queued fragments whenever the socket can
  // take them. It only exists in the TCP BTL, so nothing changes where shared memory or another
  // network carries the bytes; a value the caller set (environment, mpirun --mca) is kept. Open
  // MPI's MCA base reads the variable during MPI_Init_thread (processes started later from this
  // one inherit it, as they would any setting of the launcher's).
  setenv("OMPI_MCA_btl_tcp_progress_thread", "1", /*overwrite=*/0);
  Watchdog watchdog("MPI_Init_thread", timeout, 1, Watchdog::End::kExit);
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  return provided;
}

void mpi_shutdown(int abort_code, std::chrono::milliseconds timeout) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  if (g_communication_failed) mpi_abort(abort_code);
  Watchdog watchdog("MPI_Finalize", timeout, abort_code, Watchdog::End::kExit);
  MPI_Finalize();
}

void mpi_abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  // MPI_Abort asks the launcher (mpirun) to end every rank of the job, the stopped ones too; it
  // does not wait for any peer.
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  _exit(code);
}

}  // namespace ciera
