// The engine's state, shared by its parts: engine.cpp (public API, setup), scheduler.cpp (the
// communication thread: rounds of control, payload and verdict exchanges) and codec_tasks.cpp
// (encoding and decoding on the worker threads).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ciera/backend.hpp"
#include "ciera/codec.hpp"
#include "ciera/engine.hpp"
#include "common/adaptive_switch.hpp"
#include "common/thread_pool.hpp"
#include "engine/control.hpp"
#include "engine/envelope.hpp"
#include "engine/memory_ops.hpp"
#include "engine/staged_transport.hpp"

namespace ciera {

struct BucketState {
  explicit BucketState(const MemoryOps& memory) : send(memory), recv(memory) {}

  BucketLayout layout;
  uint32_t value_bytes = 0;
  uint64_t step = 0;  // gathers completed (agreed by all ranks)
  bool cold = false;  // set by reset_caches(): peers must resynchronise with this rank
  // reset_caches() made every codec of the bucket and no gather has completed since (a failed
  // one leaves the bucket cold, its next gather a key-frame round): another reset keeps them. (Made
  // again, the decoders would move one more epoch ahead each time, while a peer's encoder moves one
  // per key-frame round: three resets in a row left this rank's decoders ahead of every frame its
  // peers could send.)
  bool reset_since_gather = false;
  bool busy = false;
  double last_gather_s = 0;  // this rank's time for the previous gather (0: none yet)
  bool last_compressed = false;
  std::vector<uint64_t> my_param_offset;  // byte offset of each param in this rank's input
  SendLayout send_layout;                 // this rank's envelope and slots in `send`
  std::vector<uint8_t> envelope_header;   // where pack() builds the header (host memory)
  std::vector<uint64_t> payload_bytes;    // encoded length per param (this step)
  // Policies in the forms the hot paths want (refresh_policies()). In a raw-warmup gather of a
  // bucket with delta or peer-scheme parameters, those go coded (a value-delta frame is small
  // from the second gather on; the peer schemes have no warmup) while its ciera parameters go
  // raw: `ciera_params[k]` marks those, and both sides know it from the agreed step, so the
  // envelope needs no per-parameter flag.
  bool skips_warmup = false;
  // [param]: 1 where the policy is lossy (the sender gathers its own reconstruction).
  std::vector<uint8_t> lossy_params;
  bool has_lossy = false;
  std::vector<uint8_t> ciera_params;  // [param]: 1 where the policy is kCiera
  // Set when a delta parameter sits on a backend that cannot code value-delta streams (through
  // set_policy); every gather of the bucket then fails with it, on every rank.
  std::string policy_error;
  std::vector<std::unique_ptr<PayloadEncoder>> encoders;               // [param]
  std::vector<std::vector<std::unique_ptr<PayloadDecoder>>> decoders;  // [peer][param]
  // Streams (docs/format.md, "Streams"): parameter k of rank r sends stream
  // (first_stream_param + k) * world + r. The epoch the next encoder of each parameter starts
  // at, and the epoch the next decoder of each peer's parameter expects: a replacement codec
  // (set_policy, reset_caches) starts one epoch past the one it replaces, so nothing its
  // predecessor sent can pass for it.
  uint32_t first_stream_param = 0;
  std::vector<uint32_t> encoder_epoch;               // [param]
  std::vector<std::vector<uint32_t>> decoder_epoch;  // [peer][param]
  PayloadBuffer send;                        // this rank's slots, then its envelope
  PayloadBuffer recv;                        // every rank's envelope, back to back
  std::vector<uint64_t> max_envelope_bytes;  // per rank
};

// One gather of one bucket, from start() to its promise.
struct Gather {
  CompressedAllgather::Ticket ticket = 0;
  size_t bucket = 0;
  const std::byte* in = nullptr;  // payload memory
  std::byte* out = nullptr;       // payload memory
  uint64_t slot_stride = 0;       // 0: ranks' parts back to back (layout.rank_offset)
  // Where rank r's part of the output begins: bytes into `out`, and the address.
  uint64_t slot_offset(const BucketLayout& layout, int r) const {
    return slot_stride ? static_cast<uint64_t>(r) * slot_stride : layout.rank_offset(r);
  }
  std::byte* slot(const BucketLayout& layout, int r) const { return out + slot_offset(layout, r); }
  // Waited for before anything reads `in` (the caller's stream reaching start()); null: ready.
  std::unique_ptr<InputFence> ready;
  void wait_for_input() const {
    if (ready) ready->wait();
  }
  std::string local_error;        // misuse found at start(); every rank learns of it
  TaskGroup encoding;
  bool sends_raw = false;  // this rank sends this gather raw (warmup or adaptive)
  bool packed = false;     // the envelope has been packed in the bucket's `send`
  bool direct = false;     // every rank sends raw: gathered straight from input to output
  uint64_t envelope_bytes = 0;
  uint64_t step = 0;                   // agreed by all ranks in the control exchange
  std::vector<ControlRecord> control;  // every rank's record for this gather
  Verdict verdict{};                   // this rank's decode outcome
  std::mutex verdict_mutex;
  TaskGroup decoding;
  std::chrono::steady_clock::time_point decode_started;
  std::promise<GatherStats> promise;
  // A failed gather reaches its waiter as data, and the waiter throws a fresh exception of the
  // same kind on its own thread: an exception object handed across threads is destroyed by
  // whichever thread lets go of it last, through reference counts in libstdc++ that
  // ThreadSanitizer cannot see (it reports the destructor as racing with the waiter's what()).
  enum class Failure { kNone, kComm, kConfig, kFormat, kInvalidArgument, kOther };
  Failure failure = Failure::kNone;
  std::string failure_text;
  GatherStats stats;
  std::chrono::steady_clock::time_point started;
};

struct CompressedAllgather::Impl {
  // `local_error`: a problem the caller found on this rank before (the peers learn of it in the
  // agreement, with the constructor's own).
  Impl(Transport& t, EngineConfig c, std::vector<BucketLayout> layouts,
       std::shared_ptr<const CodecBackend> b, std::string local_error);
  ~Impl();

  // Setup (engine.cpp).
  // Set-up: every bucket's state and codecs; "" or what failed on this rank, naming the bucket.
  std::string make_buckets(std::vector<BucketLayout> layouts, const std::vector<uint32_t>& epochs);
  // One bucket's, appended to `buckets`; its parameters' streams follow `stream_params` (the
  // parameters of the buckets before it), which it advances.
  void make_bucket(BucketLayout layout, const std::vector<uint32_t>& epochs,
                   uint32_t& stream_params);
  void make_codecs(BucketState& s, size_t param, bool at_setup = false);
  void release_codecs(BucketState& s, size_t param);
  void refresh_policies(BucketState& s) const;
  // "" if this rank's backend can code every parameter of `layout` as its policy asks, else
  // "parameter k: ..." naming the first it cannot.
  std::string unsupported_policy(const BucketLayout& layout) const;
  StreamIdentity stream_of(const BucketState& s, int sender, size_t param, uint32_t epoch) const;
  void size_buffers(BucketState& s);
  bool warmup_raw(uint64_t step) const {
    return config.warmup == WarmupMode::kRaw && step < config.warmup_steps;
  }
  // Whether the gather at `step` sends this bucket raw (then every parameter travels as is).
  bool send_raw(const BucketState& s, uint64_t step) const;
  // The parameters that travel raw in a gather at `step` that is not all raw (empty: none
  // beyond the raw-policy ones, which have no codecs): the ciera ones during raw warmup.
  std::span<const uint8_t> warmup_raw_params(const BucketState& s, uint64_t step) const {
    return warmup_raw(step) ? std::span<const uint8_t>(s.ciera_params) : std::span<const uint8_t>();
  }

  // Worker-thread work (codec_tasks.cpp).
  void encode(Gather& g, BucketState& s, bool raw);
  uint64_t pack(BucketState& s, uint64_t step, bool raw);
  void start_decode(Gather& g);
  void decode_envelope(Gather& g, int peer, uint64_t envelope_offset, uint64_t envelope_bytes);

  // The communication thread (scheduler.cpp).
  void comm_loop();
  void run_round(std::vector<std::shared_ptr<Gather>>& round);
  void fail_round(std::vector<std::shared_ptr<Gather>>& round, std::exception_ptr error);
  void prepare(Gather& g);
  void settle_mode(Gather& g);
  ControlRecord make_record(const Gather& g, uint32_t flags) const;
  size_t exchange_controls(std::span<Gather* const> gathers, uint32_t flags);
  bool needs_resync(const Gather& g) const;
  void resynchronise(Gather& g);
  void exchange_and_decode(std::span<Gather* const> gathers);
  std::vector<std::string> exchange_verdicts(std::span<Gather* const> gathers);
  void finish(Gather& g);
  template <typename F>
  void timed(std::span<Gather* const> gathers, F&& collective);

  Transport::User user;  // first: given back after everything below has stopped
  std::shared_ptr<const CodecBackend> backend;
  const MemoryOps& memory;  // every payload byte the engine moves goes through here
  // The caller's transport; with a backend whose memory is not host memory, wrapped so that
  // the engine's host records travel through payload memory (engine/staged_transport.hpp).
  std::unique_ptr<StagedTransport> staged;
  Transport& transport;
  EngineConfig config;
  int rank = 0;
  int world = 1;
  std::vector<BucketState> buckets;
  AdaptiveSwitch adaptive;  // used from the comm thread, and from start() between gathers
  ThreadPool pool;

  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::shared_ptr<Gather>> queue;
  std::map<Ticket, std::shared_ptr<Gather>> pending;
  bool stopping = false;
  // After a CommError the engine fails every later gather with this. The communication
  // thread's alone: no lock.
  std::string broken;
  // Which exchange the communication thread is in, for a CommError's text: what a rank was
  // waiting for when a peer failed it.
  const char* phase = "";
  std::thread comm;
};

}  // namespace ciera
