// NCCL transport (include/ciera/nccl.hpp; README.md beside this file). Every collective is
// enqueued on a CUDA stream the transport owns, on a non-blocking communicator, and then polled
// (cudaEventQuery / cudaStreamQuery and ncclCommGetAsyncError) against the transport's timeout:
// NCCL itself waits forever for a peer that is dead or stopped, so a collective past the
// deadline aborts the communicator (ncclCommAbort makes the kernels waiting for the peer quit)
// and throws CommError on this rank; every surviving rank does the same within its timeout.
#include <cuda_runtime.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ciera/nccl.hpp"
#include "comm/nccl/allgatherv_plan.hpp"
#include "comm/nccl/library.hpp"
#include "common/checked.hpp"
#include "common/poll.hpp"

namespace ciera::nccl {
namespace {

using detail::Library;
using Clock = std::chrono::steady_clock;

// When a wait gives up: `timeout` from now; never for a zero timeout.
class Deadline {
 public:
  explicit Deadline(std::chrono::milliseconds timeout)
      : timeout_(timeout), end_(Clock::now() + timeout) {}
  bool passed() const { return timeout_.count() > 0 && Clock::now() >= end_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  std::chrono::milliseconds timeout_;
  Clock::time_point end_;
};

// Calls `ready` until it returns true (then true) or the deadline passes (then false). It yields
// for the first 100 us (collectives of small records complete in tens of microseconds), then
// sleeps with pauses growing to 100 us, so that ranks sharing cores do not steal each other's.
template <typename Ready>
bool poll_until(Ready&& ready, const Deadline& deadline) {
  const auto start = Clock::now();
  auto pause = std::chrono::microseconds(1);
  for (;;) {
    if (ready()) return true;
    if (deadline.passed()) return false;
    if (Clock::now() - start < std::chrono::microseconds(100)) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(100));
    }
  }
}

// Makes `device` current on the calling thread and puts the caller's device back after: the
// engine calls the transport from its own threads, and a caller's current device is its own.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    error_ = previous_ == device ? cudaSuccess : cudaSetDevice(device);
    if (error_ != cudaSuccess) cudaGetLastError();  // not sticky: clear it
  }
  ~DeviceScope() {
    if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int device_;
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// The communicator's configuration, written in the dialect of NCCL 2.14, the oldest this
// transport loads, whatever nccl.h it was compiled with. The library in the process may be
// older than the header (torch ships its own NCCL; the build uses nvidia-nccl-cu13's header):
// NCCL reads `size` first and copies at most its own sizeof(ncclConfig_t), and takes every field
// past `size`, or newer than `version`, from its own defaults. So declaring the struct as 2.14's
// (size up to `blocking`, version 2.14.0) and setting only `blocking` means every NCCL from 2.14
// on reads exactly what we meant, and no field a newer header added (with defaults an older
// library might not accept) is ever read.
ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.size = offsetof(ncclConfig_t, blocking) + sizeof(config.blocking);
  config.version = NCCL_VERSION(2, 14, 0);
  // Non-blocking: set-up, group ends and finalize return ncclInProgress at once instead of
  // waiting in NCCL (for peers that may never come); the transport polls them against its
  // deadline.
  config.blocking = 0;
  return config;
}

constexpr size_t kStagingAlignment = 256;
constexpr size_t kBarrierBytes = 4;
constexpr std::chrono::milliseconds kFinalizeBound{120000};
// How long fail() waits for the streams to drain after ncclCommAbort: aborted kernels quit at
// once, so this bounds only a local copy that overran; an abort must never become a hang.
constexpr std::chrono::milliseconds kAbortDrainBound{10000};

// `bytes` rounded up to kStagingAlignment; nullopt where that passes 2^64 - 1.
std::optional<uint64_t> align_up(uint64_t bytes) {
  uint64_t padded = 0;
  if (__builtin_add_overflow(bytes, kStagingAlignment - 1, &padded)) return std::nullopt;
  return padded / kStagingAlignment * kStagingAlignment;
}

std::string cuda_text(cudaError_t e) { return cudaGetErrorString(e); }

class NcclTransport final : public Transport {
 public:
  NcclTransport(const Library& nccl, const UniqueId& id, int rank, int size, const Options& options)
      : nccl_(nccl), rank_(rank), size_(size), device_(options.device), timeout_(options.timeout) {
    try {
      set_up(id);
    } catch (...) {
      release();
      throw;
    }
  }

  // Finalizes a healthy communicator (abort if that does not finish within the timeout), aborts
  // a broken one; never throws, never waits past the timeout.
  ~NcclTransport() override {
    shut_down();
    release();
  }

  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "nccl"; }

  // ncclAllGather; in place when in == out + rank * bytes.
  void allgather(const void* in, size_t bytes, void* out) override {
    usable();
    if (bytes == 0) return;
    const std::optional<uint64_t> gathered = checked_product(bytes, static_cast<uint64_t>(size_));
    if (!gathered) {  // before anything is enqueued, as plan_allgatherv's checks
      throw std::invalid_argument("NCCL allgather: " + std::to_string(bytes) +
                                  " bytes from each of " + std::to_string(size_) +
                                  " ranks is more than 2^64 - 1 bytes");
    }
    const uint64_t total = *gathered;
    const DeviceScope scope(device_);
    const Deadline deadline(timeout_);
    const bool out_on_device = on_device(out);
    std::byte* d_out = out_on_device ? static_cast<std::byte*>(out) : staging(total);
    std::byte* own_slot = d_out + static_cast<uint64_t>(rank_) * bytes;
    const void* d_in = in;
    if (!on_device(in)) {
      copy_in(own_slot, in, bytes);
      d_in = own_slot;  // then in place
    }
    enqueue("ncclAllGather", nccl_.all_gather(d_in, d_out, bytes, ncclUint8, comm_, stream_),
            deadline);
    wait_done("ncclAllGather", deadline, nullptr);
    if (!out_on_device) {
      const detail::OutputRange whole{0, total};
      copy_out(static_cast<std::byte*>(out), d_out, {&whole, 1}, "ncclAllGather", deadline);
    }
  }

  void allgatherv(const void* in, void* out, std::span<const uint64_t> counts,
                  std::span<const uint64_t> displs) override {
    const AllgathervCall call{in, out, counts, displs};
    allgatherv_many({&call, 1}, {});
  }

  // Each call is one ncclAllGather when its counts are equal and rank-major, else one
  // ncclBroadcast per contributing rank in one group (allgatherv_plan.hpp; README.md says why
  // broadcasts and not sends and receives). All calls are enqueued at once, each followed by an
  // event, and reported in order as their events complete.
  void allgatherv_many(std::span<const AllgathervCall> calls,
                       const std::function<void(size_t)>& done) override {
    usable();
    std::vector<detail::AllgathervPlan> plans;  // misuse throws here, before anything is enqueued
    plans.reserve(calls.size());
    for (const AllgathervCall& c : calls)
      plans.push_back(detail::plan_allgatherv(c.counts, c.displs, size_));
    const DeviceScope scope(device_);
    const Deadline deadline(timeout_);

    // Where each output lives on the device: the caller's buffer, or its slice of the staging.
    std::vector<std::byte*> d_out(calls.size(), nullptr);
    std::vector<size_t> staged_at(calls.size(), SIZE_MAX);
    size_t staging_total = 0;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (plans[i].empty()) continue;
      if (on_device(calls[i].out)) {
        d_out[i] = static_cast<std::byte*>(calls[i].out);
      } else {
        staged_at[i] = staging_total;
        const std::optional<uint64_t> slot = align_up(plans[i].extent);
        if (!slot || __builtin_add_overflow(staging_total, *slot, &staging_total)) {
          // Still nothing enqueued: a misuse, as plan_allgatherv's.
          throw std::invalid_argument("NCCL allgatherv: the staged outputs of calls 1.." +
                                      std::to_string(i + 1) + " need more than 2^64 - 1 bytes");
        }
      }
    }
    std::byte* base = staging_total > 0 ? staging(staging_total) : nullptr;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (staged_at[i] != SIZE_MAX) d_out[i] = base + staged_at[i];
    }

    // Inputs first, while the stream is still idle: a copy from pageable host memory may wait
    // for the stream, and must never wait behind a collective that could hang.
    const auto me = static_cast<size_t>(rank_);
    std::vector<const void*> d_in(calls.size(), nullptr);
    for (size_t i = 0; i < calls.size(); ++i) {
      const uint64_t own = calls[i].counts[me];
      if (own == 0) continue;
      std::byte* own_slot = d_out[i] + calls[i].displs[me];
      d_in[i] = calls[i].in;
      if (!on_device(calls[i].in)) {
        copy_in(own_slot, calls[i].in, own);
        d_in[i] = own_slot;
      }
    }

    events(calls.size());
    for (size_t i = 0; i < calls.size(); ++i) {
      const detail::AllgathervPlan& plan = plans[i];
      if (plan.single_allgather) {
        enqueue("ncclAllGather (allgatherv)",
                nccl_.all_gather(d_in[i], d_out[i] + plan.allgather_offset, plan.allgather_bytes,
                                 ncclUint8, comm_, stream_),
                deadline);
      } else if (!plan.broadcasts.empty()) {
        enqueue_broadcasts(plan, d_in[i], d_out[i], deadline);
      }
      cuda("cudaEventRecord", cudaEventRecord(events_[i], stream_));
    }

    // Completion, in call order, each call given the whole timeout from the one before (the
    // timeout bounds a wait without progress, not a batch of any size). A callback that throws
    // does not leave collectives in flight on the caller's buffers: the rest are waited for, then
    // its exception goes on.
    std::exception_ptr callback_error;
    for (size_t i = 0; i < calls.size(); ++i) {
      const std::string what =
          std::string(plans[i].single_allgather ? "ncclAllGather" : "ncclBroadcast group") +
          " (allgatherv, call " + std::to_string(i + 1) + " of " + std::to_string(calls.size()) +
          ")";
      try {
        const Deadline waiting(timeout_);
        wait_done(what, waiting, events_[i]);
        if (staged_at[i] != SIZE_MAX) {
          copy_out(static_cast<std::byte*>(calls[i].out), d_out[i], plans[i].written, what,
                   waiting);
        }
      } catch (const CommError&) {
        if (callback_error) std::rethrow_exception(callback_error);
        throw;
      }
      if (done && !callback_error) {
        try {
          done(i);
        } catch (...) {
          callback_error = std::current_exception();
        }
      }
    }
    if (callback_error) std::rethrow_exception(callback_error);
  }

  // A one-element ncclAllReduce: it completes on a rank only once every rank has entered it.
  void barrier() override {
    usable();
    const DeviceScope scope(device_);
    const Deadline deadline(timeout_);
    std::byte* word = staging(kBarrierBytes);
    enqueue("ncclAllReduce (barrier)",
            nccl_.all_reduce(word, word, 1, ncclInt32, ncclSum, comm_, stream_), deadline);
    wait_done("ncclAllReduce (barrier)", deadline, nullptr);
  }

  // A negative timeout is std::invalid_argument (Transport's contract, and make_transport's):
  // Deadline would read it as "wait forever".
  void set_timeout(std::chrono::milliseconds timeout) override {
    timeout_ = checked_timeout(timeout, "NCCL transport set_timeout");
  }
  std::chrono::milliseconds timeout() const override { return timeout_; }

 private:
  // ---- Set-up and shut-down ------------------------------------------------------------------

  void set_up(const UniqueId& id) {
    const DeviceScope scope(device_);
    if (scope.error() != cudaSuccess) {
      throw CommError("NCCL transport set-up on rank " + where() + ": CUDA device " +
                      std::to_string(device_) + " is not usable: " + cuda_text(scope.error()));
    }
    cuda("cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cuda("cudaStreamCreateWithFlags",
         cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    ncclUniqueId uid;
    static_assert(sizeof(uid) == sizeof(id.bytes), "ncclUniqueId is 128 bytes");
    std::memcpy(&uid, id.bytes.data(), sizeof(uid));
    // The barrier's word now, not at the first barrier: a barrier then allocates nothing (and
    // cannot fail for memory) between collectives.
    staging(kBarrierBytes);
    ncclConfig_t config = non_blocking_config();
    const Deadline deadline(timeout_);
    constexpr const char* what =
        "ncclCommInitRankConfig (communicator set-up; every rank must join)";
    const ncclResult_t started = nccl_.comm_init_rank_config(&comm_, size_, uid, rank_, &config);
    if (started != ncclSuccess && started != ncclInProgress) fail(what, nccl_problem(started));
    wait_ready(what, deadline);
  }

  void shut_down() noexcept {
    if (comm_ == nullptr) return;  // never set up, or aborted when it failed
    const DeviceScope scope(device_);
    bool finalized = false;
    try {
      // Finalizing waits for this rank's own work only, so it is quick; even with no timeout
      // (wait forever) a destructor gives up after kFinalizeBound and aborts.
      const Deadline deadline(timeout_.count() > 0 ? timeout_ : kFinalizeBound);
      const ncclResult_t started = nccl_.comm_finalize(comm_);
      ncclResult_t state = started;
      if (started == ncclSuccess || started == ncclInProgress) {
        poll_until(
            [&] {
              if (nccl_.comm_get_async_error(comm_, &state) != ncclSuccess)
                state = ncclInternalError;
              return state != ncclInProgress;
            },
            deadline);
      }
      finalized = state == ncclSuccess;
    } catch (...) {
    }
    if (finalized) {
      nccl_.comm_destroy(comm_);
    } else {
      nccl_.comm_abort(comm_);  // a peer stopped mid-finalize, or NCCL failed: let go regardless
    }
    comm_ = nullptr;
  }

  // Never waits, for the device or a peer: called from the destructor and set-up's failure path,
  // which may run while a stopped peer holds a kernel on this GPU (torch's own NCCL kernel, or
  // another rank-thread's). cudaFree would wait for every kernel on the device; the staging is
  // freed stream-ordered instead, and cudaStreamDestroy and cudaEventDestroy return at once (the
  // driver releases them when their work is done).
  void release() noexcept {
    const DeviceScope scope(device_);
    if (staging_ != nullptr) {
      // Only stream_ and copy_stream_ ever used the staging. After a failed copy_out the copy
      // stream may still be reading it: order the free after whatever it holds.
      cudaEvent_t copies_done = nullptr;
      if (copy_stream_ != nullptr &&
          cudaEventCreateWithFlags(&copies_done, cudaEventDisableTiming) == cudaSuccess) {
        if (cudaEventRecord(copies_done, copy_stream_) == cudaSuccess)
          cudaStreamWaitEvent(stream_, copies_done, 0);
        cudaEventDestroy(copies_done);
      }
      cudaFreeAsync(staging_, stream_);
      staging_ = nullptr;
      staging_bytes_ = 0;
    }
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    events_.clear();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    stream_ = copy_stream_ = nullptr;
    (void)cudaGetLastError();  // leave no status behind for the caller's next launch check
  }

  // ---- Enqueueing and waiting ----------------------------------------------------------------

  void usable() const {
    if (broken_) {
      throw CommError("NCCL transport (rank " + where() +
                      ") is unusable after an earlier failure: " + reason_);
    }
  }

  std::string where() const { return std::to_string(rank_) + " of " + std::to_string(size_); }

  std::string nccl_problem(ncclResult_t result) const {
    std::string text = nccl_.error_text(result);
    if (result == ncclInvalidUsage) {
      text += " (several ranks on one GPU need NCCL " + detail::kOldestMultiRankGpu.text() +
              " or newer and NCCL_MULTI_RANK_GPU_ENABLE=1; loaded: " + nccl_.version.text() + ")";
    }
    return text;
  }

  // Marks the transport broken, aborts the communicator (kernels waiting for a peer quit) and
  // throws CommError naming the operation, this rank, the problem and NCCL's last error.
  [[noreturn]] void fail(const std::string& what, const std::string& problem) {
    std::string last;
    bool drained = true;
    if (comm_ != nullptr) {
      // ncclGetLastError ignores its argument: its text is the process's last NCCL error, which
      // may be another communicator's (torch's, in the same process), so it is labelled as such.
      if (const char* text = nccl_.get_last_error(comm_); text != nullptr) last = text;
      nccl_.comm_abort(comm_);
      comm_ = nullptr;
      // The aborted kernels (stream_) and the copies of staged outputs into the caller's buffer
      // (copy_stream_) leave their streams shortly; the caller may free or reuse its buffers once
      // this throws, so wait for both, within a bound: an abort must never become a hang.
      drained = poll_until([&] { return stream_idle(stream_) && stream_idle(copy_stream_); },
                           Deadline(kAbortDrainBound));
    }
    broken_ = true;
    reason_ = what + " on rank " + where() + ": " + problem;
    if (!last.empty()) {
      reason_ +=
          " (NCCL's last error in this process, which may be another communicator's: " + last + ")";
    }
    if (!drained) {
      reason_ += "; work this transport enqueued on the caller's buffers was still running " +
                 std::to_string(kAbortDrainBound.count()) + " ms after ncclCommAbort";
    }
    throw CommError(reason_);
  }

  // Whether `stream` has no work left; an error (the context is gone) counts as idle: nothing
  // more runs there. Leaves no status behind.
  static bool stream_idle(cudaStream_t stream) {
    if (stream == nullptr) return true;  // never made (cudaStreamQuery would read the default)
    const cudaError_t e = cudaStreamQuery(stream);
    if (e != cudaSuccess) (void)cudaGetLastError();
    return e != cudaErrorNotReady;
  }

  void cuda(const char* what, cudaError_t e) {
    if (e != cudaSuccess) fail(what, "CUDA error: " + cuda_text(e));
  }

  // Whether `p` is device memory of this transport's device, which NCCL can use as it is.
  // Anything else (host memory, pageable or pinned, managed memory, another device's) is staged.
  bool on_device(const void* p) const {
    if (p == nullptr) return false;
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      cudaGetLastError();  // older runtimes report plain host memory as an error: clear it
      return false;
    }
    return attributes.type == cudaMemoryTypeDevice && attributes.device == device_;
  }

  // Device memory of at least `bytes` bytes (the previous contents are not kept), growing by
  // doubling. Stream-ordered on stream_, from the device's default pool (as src/cuda's backend):
  // cudaMalloc and cudaFree may wait for the whole device, and so, on a shared GPU, for a peer's
  // kernel that waits for this rank. The buffer a larger one replaces is freed at once on stream_:
  // its every use is complete or before the free on stream_ (collectives, input copies), or a
  // staged-output copy on copy_stream_ that the host saw complete before its call returned
  // (copy_out; a copy_out that did not breaks the transport, and no call reaches here again).
  // cudaMallocAsync's blocks are 256-byte aligned whatever their size; the slots in it are
  // aligned by their callers.
  std::byte* staging(uint64_t bytes) {
    if (bytes <= staging_bytes_) return staging_;
    const uint64_t grown = std::max(bytes, 2 * staging_bytes_);
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, grown, stream_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail("staging",
           "cannot allocate " + std::to_string(grown) + " bytes of device memory: " + cuda_text(e));
    }
    std::byte* replaced = staging_;
    staging_ = static_cast<std::byte*>(p);
    staging_bytes_ = grown;
    if (replaced != nullptr)
      cuda("cudaFreeAsync (the smaller staging)", cudaFreeAsync(replaced, stream_));
    return staging_;
  }

  void copy_in(void* d_dst, const void* src, size_t bytes) {
    cuda("cudaMemcpyAsync (staging an input)",
         cudaMemcpyAsync(d_dst, src, bytes, cudaMemcpyDefault, stream_));
  }

  // Copies the written ranges of a completed collective's staged output back to the caller, on
  // the copy stream (the main stream may still hold later collectives).
  void copy_out(std::byte* out, const std::byte* d_out, std::span<const detail::OutputRange> ranges,
                const std::string& what, const Deadline& deadline) {
    for (const detail::OutputRange& r : ranges) {
      cuda("cudaMemcpyAsync (staged output)",
           cudaMemcpyAsync(out + r.offset, d_out + r.offset, r.bytes, cudaMemcpyDefault,
                           copy_stream_));
    }
    const bool copied = poll_until(
        [&] {
          const cudaError_t e = cudaStreamQuery(copy_stream_);
          if (e == cudaErrorNotReady) {
            (void)cudaGetLastError();  // not an error: leave no status for a later launch check
            return false;
          }
          cuda("cudaStreamQuery (staged output)", e);
          return true;
        },
        deadline);
    // A local copy overran, no peer: says so. It still breaks the transport (fail): the copy may
    // yet write the caller's buffer, and the staging it reads cannot be reused meanwhile.
    if (!copied) {
      fail(what + " (copying the staged output back)",
           "the copy of the staged output back to the caller's buffer did not complete within " +
               std::to_string(deadline.timeout().count()) + " ms");
    }
  }

  std::string timed_out(const Deadline& deadline, ncclResult_t state) const {
    return "did not complete within " + std::to_string(deadline.timeout().count()) +
           " ms: a peer is dead or stalled (ncclCommGetAsyncError: " + nccl_.error_text(state) +
           ")";
  }

  // After an NCCL call: an error fails; ncclInProgress (the non-blocking communicator still
  // enqueueing) is waited for, since no other call may be made on the communicator until then.
  void enqueue(const std::string& what, ncclResult_t result, const Deadline& deadline) {
    if (result != ncclSuccess && result != ncclInProgress) fail(what, nccl_problem(result));
    wait_ready(what, deadline);
  }

  void enqueue_broadcasts(const detail::AllgathervPlan& plan, const void* d_in, std::byte* d_out,
                          const Deadline& deadline) {
    ncclResult_t first_error = nccl_.group_start();
    for (const detail::BroadcastStep& b : plan.broadcasts) {
      if (first_error != ncclSuccess) break;
      // The root sends from its input (in place when that is its slot of the output); the
      // others' send buffer is ignored.
      const void* send = b.root == rank_ ? d_in : d_out + b.offset;
      first_error =
          nccl_.broadcast(send, d_out + b.offset, b.bytes, ncclUint8, b.root, comm_, stream_);
    }
    const ncclResult_t ended = nccl_.group_end();  // closes the group even after an error
    enqueue("ncclBroadcast group (allgatherv)", first_error != ncclSuccess ? first_error : ended,
            deadline);
  }

  // One look at the communicator: false while an operation is in progress, true once none is;
  // an NCCL error fails. `state` keeps the last status, for a timeout's text.
  bool settled(const std::string& what, ncclResult_t& state) {
    const ncclResult_t queried = nccl_.comm_get_async_error(comm_, &state);
    if (queried != ncclSuccess)
      fail(what, "ncclCommGetAsyncError failed: " + nccl_.error_text(queried));
    if (state == ncclInProgress) return false;
    if (state != ncclSuccess) fail(what, nccl_problem(state));
    return true;
  }

  // Polls until the communicator has no operation in progress (set-up, enqueue).
  void wait_ready(const std::string& what, const Deadline& deadline) {
    ncclResult_t state = ncclInProgress;
    const bool ready = poll_until([&] { return settled(what, state); }, deadline);
    if (!ready) fail(what, timed_out(deadline, state));
  }

  // Polls until the work enqueued before `event` (or everything on the stream, for a null event)
  // has completed, or NCCL reports an error, or the deadline passes.
  void wait_done(const std::string& what, const Deadline& deadline, cudaEvent_t event) {
    ncclResult_t state = ncclSuccess;
    const bool done = poll_until(
        [&] {
          if (!settled(what, state)) return false;
          const cudaError_t e = event != nullptr ? cudaEventQuery(event) : cudaStreamQuery(stream_);
          if (e == cudaErrorNotReady) {
            (void)cudaGetLastError();  // as PyTorch's CUDAEvent::query: leave no status behind
            return false;
          }
          cuda("cudaEventQuery", e);
          return true;
        },
        deadline);
    if (!done) fail(what, timed_out(deadline, state));
  }

  // At least `count` events, made on this transport's device.
  void events(size_t count) {
    while (events_.size() < count) {
      cudaEvent_t e = nullptr;
      cuda("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      events_.push_back(e);
    }
  }

  const Library& nccl_;
  const int rank_;
  const int size_;
  const int device_;
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;       // collectives, and the copies that stage inputs
  cudaStream_t copy_stream_ = nullptr;  // staged outputs back to the caller
  std::vector<cudaEvent_t> events_;     // one per call of allgatherv_many
  std::byte* staging_ = nullptr;        // stream-ordered on stream_ (staging(), release())
  uint64_t staging_bytes_ = 0;
  bool broken_ = false;
  std::string reason_;  // why it broke
};

}  // namespace

UniqueId make_unique_id() {
  const Library& nccl = detail::library();
  ncclUniqueId uid;
  if (const ncclResult_t r = nccl.get_unique_id(&uid); r != ncclSuccess) {
    throw CommError("ncclGetUniqueId failed: " + nccl.error_text(r));
  }
  UniqueId id;
  std::memcpy(id.bytes.data(), &uid, sizeof(uid));
  return id;
}

bool available(std::string* why) {
  std::string missing;
  try {
    detail::library();
  } catch (const CommError& e) {
    missing = e.what();
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) cudaGetLastError();
  const std::string no_device = e != cudaSuccess ? "no usable CUDA device: " + cuda_text(e)
                                : count == 0     ? "no CUDA device"
                                                 : "";
  if (!no_device.empty()) missing += (missing.empty() ? "" : "; ") + no_device;
  if (why) *why = missing;
  return missing.empty();
}

std::string library_version() { return detail::library().version.text(); }

std::unique_ptr<Transport> make_transport(const UniqueId& id, int rank, int size, Options options) {
  if (size < 1)
    throw std::invalid_argument("NCCL transport: size must be at least 1, not " +
                                std::to_string(size));
  if (rank < 0 || rank >= size) {
    throw std::invalid_argument("NCCL transport: rank " + std::to_string(rank) + " is not in 0.." +
                                std::to_string(size - 1));
  }
  if (options.device < 0)
    throw std::invalid_argument("NCCL transport: device " + std::to_string(options.device) +
                                " does not exist");
  checked_timeout(options.timeout, "NCCL transport");
  return std::make_unique<NcclTransport>(detail::library(), id, rank, size, options);
}

}  // namespace ciera::nccl
