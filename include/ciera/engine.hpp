// The compressed allgather engine (paper §3, Figure 7b): gathers buckets of parameter shards over
// a Transport, each shard as raw bytes, through the exponent-reuse codec (policy ciera) or as
// value-delta frames (policy delta), into exactly the rank-major buffer an uncompressed
// allgather produces.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ciera/backend.hpp"
#include "ciera/config.hpp"
#include "ciera/dtype.hpp"
#include "ciera/transport.hpp"

namespace ciera {

// What ciera-policy shards send during warmup. Delta-policy shards have no warmup: their first
// gather is a key frame and every later one a value-delta frame, which is small from the start.
enum class WarmupMode : uint8_t {
  kRaw = 0,        // raw bytes; exponent reuse starts with a key frame after warmup (cheapest)
  kKeyFrames = 1,  // stateless key frames (all exponents entropy-coded)
};

// The shards gathered in one collective: all parameters of one layer or module, as FSDP gathers
// one parameter group. Rank r's input is its shards of parameters 0..K-1, concatenated; the
// output is every rank's input, concatenated in rank order (the layout of an uncompressed
// allgather; ranks may hold different amounts, including none). Every rank passes the same layout.
struct BucketLayout {
  std::string name;
  DType dtype = DType::kBF16;
  // shard_values[r][k]: values of parameter k held by rank r.
  std::vector<std::vector<uint64_t>> shard_values;
  // policy[k]: how parameter k travels. kDelta needs a backend whose coders take value-delta
  // streams (CodecBackend::codes; the host's and the CUDA one's do): elsewhere it is a
  // ConfigError on every rank.
  std::vector<ShardPolicy> policy;

  // Parameters of `param_values[k]` values sharded as FSDP does: ceil(n / ranks) values per rank,
  // the last ranks short or empty.
  static BucketLayout fsdp_split(std::string name, DType dtype, std::vector<uint64_t> param_values,
                                 int ranks, ShardPolicy policy = ShardPolicy::kCiera);

  int ranks() const { return static_cast<int>(shard_values.size()); }
  size_t params() const { return policy.size(); }
  uint64_t rank_values(int rank) const;
  uint64_t rank_bytes(int rank) const;
  uint64_t total_bytes() const;
  // Byte offset of rank r's input inside the output.
  uint64_t rank_offset(int rank) const;
  // Throws ConfigError if the layout is inconsistent (shape, sizes, policies).
  void validate() const;
};

struct EngineConfig {
  // dtype comes from each bucket, stream_kind from each parameter's policy; codec.warmup_steps
  // is set from below.
  CodecConfig codec;
  uint32_t warmup_steps = 30;  // per bucket: gathers before exponent reuse starts (not delta)
  WarmupMode warmup = WarmupMode::kRaw;
  // Time compressed and raw gathers after warmup and keep the faster, re-probing every few
  // hundred gathers (for links so fast, or cores so few, that coding does not pay). One choice
  // for the whole engine, from the summed typical times of the buckets measured both ways
  // (common/adaptive_switch.hpp); it may change at any gather whose time tips the sums, not only
  // at a probe. Each gather's mode is read when it starts, so with several buckets in flight two
  // ranks may gather one bucket in different modes around a change: exact all the same (every
  // envelope says how it is coded), and that gather's time is not sampled.
  bool adaptive = false;
  unsigned worker_threads = 2;  // encode/decode threads, at most kMaxWorkerThreads
  // A collective waits this long for its peers before every rank fails with CommError.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
};

// One gather of one bucket, as seen by this rank.
struct GatherStats {
  uint64_t step = 0;             // this bucket's gather count, agreed by all ranks
  bool warmup = false;           // a warmup gather (with WarmupMode::kRaw, CIERA shards went raw)
  bool compressed = false;       // this rank's envelope carried codec frames (CIERA or delta)
  bool resynchronised = false;   // a key-frame round ran (cold rank, steps out of step, bad payload)
  uint64_t raw_bytes = 0;        // the gathered output
  // All ranks' payloads together (both exchanges of a gather re-sent as key frames after a bad
  // payload): the bytes that stand for the bucket's values. The transport also carried
  // control_bytes for the gather.
  uint64_t wire_bytes = 0;
  uint64_t local_payload_bytes = 0;                                // this rank's part of wire_bytes
  // All ranks' control records and verdicts (docs/format.md, "Engine protocol") of the rounds the
  // gather took part in, each round's shared among its gathers: fixed-size records, a few KiB
  // per round, which a plain allgather does not send. wire_bytes + control_bytes is all the
  // engine sent for the gather.
  uint64_t control_bytes = 0;
  double encode_s = 0, exchange_s = 0, decode_s = 0, total_s = 0;  // wall time on this rank
};

// Errors. Misuse this rank can see alone (a bucket, parameter, ticket or policy that does not
// exist; a call that conflicts with a gather in flight) throws std::invalid_argument at once and
// changes nothing. Problems the peers must learn of too, because they are about to gather with
// this rank (configuration or layout mismatches, wrong buffer sizes, bad payloads, dead peers),
// throw ConfigError or CommError on every rank: with the same text where the ranks agree on the
// fact, with each rank's own where they cannot (a dead peer: one rank times out, another sees the
// connection close; a control record damaged in transit: the rank that read it names the sender,
// its peers time out). A ConfigError fails that
// gather only; the next one works. A CommError is final: the transport may be left
// mid-collective (a peer gone, a timeout, ranks gathering in different orders), so every later
// gather throws CommError too, saying that the engine gathers no more and naming the first
// failure; a new engine, on a new transport, is the way on.
class CompressedAllgather {
 public:
  // Checks with one collective that every rank has the same configuration and bucket layouts,
  // and throws ConfigError on every rank, naming the difference, if not (or if any rank's
  // configuration or layouts are invalid, or its backend null). `transport` must outlive the
  // engine and must not be used by anyone else while the engine exists: a transport in use by
  // another engine is a ConfigError on this rank alone (it cannot reach its peers through a
  // transport another engine is using; they time out in the agreement).
  //
  // `backend` says where payloads live and what codes them (include/ciera/backend.hpp): host
  // memory and the CPU coders by default; ciera::cuda::codec_backend(device) for device memory
  // and the GPU coders (then every buffer passed to start() is device memory, and `transport`
  // is handed device memory only). Ranks may use different backends: the payloads are the same.
  CompressedAllgather(Transport& transport, EngineConfig config, std::vector<BucketLayout> buckets,
                      std::shared_ptr<const CodecBackend> backend = host_codec_backend());
  ~CompressedAllgather();
  CompressedAllgather(const CompressedAllgather&) = delete;
  CompressedAllgather& operator=(const CompressedAllgather&) = delete;

  using Ticket = uint64_t;

  // Starts gathering `bucket`: `input` is this rank's shards (layout.rank_bytes(rank) bytes),
  // `output` receives layout.total_bytes(). In place: `input` may be this rank's slot of
  // `output`; an input that overlaps the output anywhere else is refused (ConfigError from
  // wait(), on every rank). Both must stay valid until wait() returns, and also past the
  // engine's destruction when no wait() comes: ~CompressedAllgather finishes every gather in
  // flight into them (waiting for the peers up to config.timeout), so declare the buffers before
  // the engine, or wait() for the ticket before they go. Encoding starts at once on worker threads;
  // gathers complete in start order, which must be the same on every rank. One gather per
  // bucket may be in flight.
  // `stream`: with a device backend, the caller's stream (a cudaStream_t, as an integer) on
  // which the input is being produced: the gather reads the input only once the work enqueued
  // there before start() is done, and start() itself never waits for it (encoding begins on
  // the engine's own streams as soon as it is). For the CUDA backend 0 is CUDA's default
  // stream, as torch reports it, and is waited for like any other. When wait() returns, the
  // output is complete in device memory, for any stream to read. The host backend has no
  // streams: pass 0.
  // Throws std::invalid_argument if `bucket` does not exist or already has a gather in flight,
  // if `stream` is not 0 on a backend without streams (the host's), or if called on the
  // engine's communication thread (from inside a transport call).
  // A wrong input or output size is not thrown here: wait() throws ConfigError for it on every
  // rank.
  // `slot_stride` (the same on every rank): 0 (the default) puts the ranks' parts of `output` back
  // to back, as layout.rank_offset() gives. Otherwise rank r's part begins r * slot_stride bytes
  // into `output` (slot_stride at least layout.rank_bytes() of every rank), which then spans (ranks
  // - 1) * slot_stride + rank_bytes(ranks - 1) bytes; the bytes between the parts are neither read
  // nor written. So a gather lands in a caller's interleaved buffer without a copy: DeepSpeed's
  // coalesced fetch, whose output holds each rank's partitions of several parameters, one engine
  // bucket each.
  Ticket start(size_t bucket, std::span<const std::byte> input, std::span<std::byte> output,
               uintptr_t stream = 0, uint64_t slot_stride = 0);
  // Blocks until the gather is done. Throws CommError / ConfigError (the same on every rank)
  // if it failed; output is then unspecified.
  // Throws std::invalid_argument if `ticket` was not returned by this engine's start() (tickets
  // are unique across engines) or was waited for, or if called on the engine's communication
  // thread (from inside a transport call), where it would wait for itself for ever.
  GatherStats wait(Ticket ticket);
  // start() then wait(); throws what they throw.
  GatherStats run(size_t bucket, std::span<const std::byte> input, std::span<std::byte> output,
                  uintptr_t stream = 0, uint64_t slot_stride = 0);

  // Takes part in the bucket's next gather only to refuse it: the gather fails with a
  // ConfigError on every rank, naming this rank and `reason` (in full on this rank; the peers'
  // text holds at most 79 bytes: its first 76 and "..." where it was cut). For arguments that a
  // layer above the engine finds wrong before it has buffers to pass (a null pointer, memory of the
  // wrong kind): thrown on this rank alone, they would leave its peers waiting for it until the
  // timeout. Throws std::invalid_argument, on this rank alone, as start() does.
  [[noreturn]] void refuse(size_t bucket, const std::string& reason);

  // Forgets all codec state, as after a restart. The next gather of each bucket is detected as
  // cold by every rank and runs a key-frame round.
  // Throws std::invalid_argument if any bucket has a gather in flight.
  void reset_caches();

  // Changes a parameter's policy on this rank's view; all ranks must make the same changes before
  // the bucket's next gather (checked there: ConfigError on every rank). Codec state of the
  // parameter is dropped and restarted (its next frame is a key frame), in a new epoch of its
  // streams. A rank that switches between two coded policies and back alone (ciera, delta, ciera)
  // ends with the peers' policy but not their epochs, which the check does not see: the next
  // gather fails with a CommError on every rank and the engine gathers no more. (Through raw,
  // which has no codecs, the next gather's key-frame round recovers. The selectors of ciera.torch
  // and ciera.deepspeed make every change on every rank.) kDelta on a backend that
  // cannot code it is recorded too, and the bucket's next gather fails with a ConfigError naming
  // the parameter and the backend on every rank (until the policy is changed back).
  // Throws std::invalid_argument if `bucket` or `param` does not exist, `policy` is not a
  // ShardPolicy value, or the bucket has a gather in flight.
  void set_policy(size_t bucket, size_t param, ShardPolicy policy);

  // A copy of the bucket's layout, its policies as set_policy() left them (taken under the lock
  // set_policy() writes them under, so another thread's switch is seen whole or not at all).
  // Throws std::invalid_argument if `index` does not exist.
  BucketLayout bucket(size_t index) const;
  size_t bucket_count() const;
  int rank() const;
  int world_size() const;
  // Bytes of codec state held by this rank (encoder copies plus peer caches: exponents for
  // ciera parameters, previous values for delta ones), in the backend's memory.
  size_t cache_bytes() const;
  const CodecBackend& backend() const;
  // Whether the caller is this engine's communication thread: inside one of its transport's
  // calls (a Python transport's callables run there). The engine cannot be destroyed there (its
  // destructor joins that thread), nor waited for.
  bool on_communication_thread() const noexcept;

 private:
  // start(), or with a non-empty `refusal` refuse()'s gather.
  Ticket begin(size_t bucket, std::span<const std::byte> input, std::span<std::byte> output,
               uintptr_t stream, uint64_t slot_stride, std::string refusal);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ciera
