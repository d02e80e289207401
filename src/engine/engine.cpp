// The compressed allgather engine: setup and the public API. The protocol's parts live beside
// this file (docs/format.md, "Engine protocol"): agreement.cpp (configuration agreement at
// construction), control.cpp (control records and verdicts), envelope.cpp (the per-bucket wire
// unit), scheduler.cpp (rounds on the communication thread), codec_tasks.cpp (encoding and
// decoding on worker threads), memory_ops.hpp (every payload byte moved).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

#include "ciera/error.hpp"
#include "common/bytes.hpp"
#include "engine/agreement.hpp"
#include "engine/engine_impl.hpp"

namespace ciera {

CompressedAllgather::Impl::Impl(Transport& t, EngineConfig c, std::vector<BucketLayout> layouts,
                                std::shared_ptr<const CodecBackend> b, std::string local_error)
    : user(t, "CompressedAllgather", /*exclusive=*/true),
      backend(std::move(b)),
      memory(backend->memory()),
      staged(backend->host_memory() ? nullptr : std::make_unique<StagedTransport>(t, memory)),
      transport(staged ? *staged : t),
      config(std::move(c)),
      rank(t.rank()),
      world(t.size()),
      pool(std::min(config.worker_threads, kMaxWorkerThreads)) {  // more: refused below
  // An engine calls its transport from a thread of its own (its communication thread).
  if (const std::string problem = t.threading_problem(); !problem.empty())
    throw ConfigError("CompressedAllgather: " + problem);
  // A timeout <= 0 is refused in the agreement below, which then waits the default.
  transport.set_timeout(config.timeout.count() > 0 ? config.timeout : EngineConfig{}.timeout);
  // Local problems are not thrown yet: every rank first learns of them in the agreement, so
  // that all fail together rather than some waiting forever for the others.
  try {
    if (!local_error.empty()) throw ConfigError(local_error);
    if (config.timeout.count() <= 0) {
      throw ConfigError("timeout must be > 0 ms, got " + std::to_string(config.timeout.count()) +
                        " ms");
    }
    if (config.worker_threads > kMaxWorkerThreads) {
      throw ConfigError("worker_threads must be at most " + std::to_string(kMaxWorkerThreads) +
                        ", got " + std::to_string(config.worker_threads));
    }
    // Out of range, it would pass the agreement as kKeyFrames (agreement.cpp names the two) and
    // run as neither here: no raw warmup (engine_impl.hpp) and no key-frame warmup.
    if (config.warmup != WarmupMode::kRaw && config.warmup != WarmupMode::kKeyFrames) {
      throw ConfigError("warmup mode " + std::to_string(static_cast<int>(config.warmup)) +
                        " does not exist (0: raw, 1: key frames)");
    }
    config.codec.warmup_steps = config.warmup == WarmupMode::kKeyFrames ? config.warmup_steps : 0;
    config.codec.validate();
    for (const BucketLayout& l : layouts) {
      l.validate();
      if (l.ranks() != world) {
        throw ConfigError("bucket '" + l.name + "' describes " + std::to_string(l.ranks()) +
                          " ranks but the transport has " + std::to_string(world));
      }
      if (std::string why = unsupported_policy(l); !why.empty()) {
        throw ConfigError("bucket '" + l.name + "' " + why);
      }
    }
  } catch (const Error& e) {
    local_error = e.what();
  }
  agree_on_configuration(transport, config, layouts, local_error);
  const std::vector<uint32_t> epochs = exchange_stream_epochs(transport, new_stream_epoch());
  agree_on_set_up(transport, make_buckets(std::move(layouts), epochs));
  comm = std::thread([this] { comm_loop(); });
}

std::string CompressedAllgather::Impl::make_buckets(std::vector<BucketLayout> layouts,
                                                    const std::vector<uint32_t>& epochs) {
  buckets.reserve(layouts.size());
  uint32_t stream_params = 0;  // parameters of the buckets before this one
  for (BucketLayout& layout : layouts) {
    const std::string name = layout.name;
    try {
      make_bucket(std::move(layout), epochs, stream_params);
    } catch (const std::exception& e) {
      // Out of memory for its codec state, most likely, and maybe on this rank alone.
      return "bucket '" + name + "': " + e.what();
    }
  }
  return "";
}

void CompressedAllgather::Impl::make_bucket(BucketLayout layout,
                                            const std::vector<uint32_t>& epochs,
                                            uint32_t& stream_params) {
  BucketState& s = buckets.emplace_back(memory);
  s.layout = std::move(layout);
  s.value_bytes = dtype_info(s.layout.dtype).value_bytes;
  const size_t params = s.layout.params();
  s.encoders.resize(params);
  s.decoders.resize(static_cast<size_t>(world));
  for (auto& peer : s.decoders) peer.resize(params);
  s.first_stream_param = stream_params;
  stream_params += static_cast<uint32_t>(params);
  s.encoder_epoch.assign(params, epochs[rank]);
  for (int p = 0; p < world; ++p) s.decoder_epoch.emplace_back(params, epochs[p]);
  s.payload_bytes.assign(params, 0);
  s.my_param_offset.resize(params);
  refresh_policies(s);
  uint64_t offset = 0;
  for (size_t k = 0; k < params; ++k) {
    s.my_param_offset[k] = offset;
    offset += s.layout.shard_values[rank][k] * s.value_bytes;
    make_codecs(s, k, /*at_setup=*/true);
  }
  size_buffers(s);
}

CompressedAllgather::Impl::~Impl() {
  {
    std::lock_guard lock(mutex);
    stopping = true;
  }
  wake.notify_all();
  comm.join();
}

StreamIdentity CompressedAllgather::Impl::stream_of(const BucketState& s, int sender,
                                                    size_t param, uint32_t epoch) const {
  // Wraps only past 2^32 streams, far beyond any model; a stream id need only differ among the
  // streams one decoder could be handed by mistake.
  const uint64_t id = (uint64_t{s.first_stream_param} + param) * static_cast<uint64_t>(world) +
                      static_cast<uint64_t>(sender);
  return {.stream = static_cast<uint32_t>(id), .epoch = epoch};
}

// Makes parameter k's codecs (setup), or replaces them (set_policy, reset_caches). A replacement
// starts one epoch past the one it replaces; its decoders also accept a later one, as after a
// requested resynchronisation: the sender's encoder may have moved on in key-frame rounds whose
// frames this side never decoded (raw warmup, adaptive raw steps).
// A delta parameter's codecs keep the previous values (StreamKind::kValueDelta); a ciera
// parameter's the exponents; a peer scheme's what it needs (policy_stream_kind()). Switching
// between them is a replacement like any other: the new stream starts with a key frame. A
// parameter whose stream the backend cannot code gets no codecs (its bucket's gathers fail with
// policy_error before anything would use them).
void CompressedAllgather::Impl::make_codecs(BucketState& s, size_t k, bool at_setup) {
  CodecConfig codec = config.codec;
  codec.dtype = s.layout.dtype;
  const ShardPolicy policy = s.layout.policy[k];
  const bool coded = coded_policy(policy) && backend->codes(policy_stream_kind(policy));
  if (coded) codec.stream_kind = policy_stream_kind(policy);
  // The old codecs go before the new ones are made, so that a switch never holds both: a
  // selection that fits the cache budget fits it at every moment of the switch too.
  release_codecs(s, k);
  s.encoders[k] = coded ? backend->make_encoder(codec, s.layout.shard_values[rank][k],
                                                stream_of(s, rank, k, s.encoder_epoch[k]))
                        : nullptr;
  for (int p = 0; p < world; ++p) {
    auto& decoder = s.decoders[p][k];
    decoder = coded && p != rank
                  ? backend->make_decoder(codec, s.layout.shard_values[p][k],
                                          stream_of(s, p, k, s.decoder_epoch[p][k]))
                  : nullptr;
    if (decoder && !at_setup) decoder->request_resync();
  }
}

// Drops parameter k's codecs; the next ones it gets start one epoch past these.
void CompressedAllgather::Impl::release_codecs(BucketState& s, size_t k) {
  if (s.encoders[k]) s.encoder_epoch[k] = s.encoders[k]->epoch() + 1;
  s.encoders[k].reset();
  for (int p = 0; p < world; ++p) {
    auto& decoder = s.decoders[p][k];
    if (decoder) s.decoder_epoch[p][k] = decoder->epoch() + 1;
    decoder.reset();
  }
}

void CompressedAllgather::Impl::refresh_policies(BucketState& s) const {
  const auto& policy = s.layout.policy;
  s.skips_warmup = std::any_of(policy.begin(), policy.end(), [](ShardPolicy p) {
    return coded_policy(p) && p != ShardPolicy::kCiera;
  });
  s.ciera_params.resize(policy.size());
  s.lossy_params.resize(policy.size());
  for (size_t k = 0; k < policy.size(); ++k) {
    s.ciera_params[k] = policy[k] == ShardPolicy::kCiera;
    s.lossy_params[k] = lossy_policy(policy[k]);
  }
  s.has_lossy = std::any_of(policy.begin(), policy.end(), lossy_policy);
  s.policy_error = unsupported_policy(s.layout);
}

std::string CompressedAllgather::Impl::unsupported_policy(const BucketLayout& layout) const {
  for (size_t k = 0; k < layout.params(); ++k) {
    const ShardPolicy policy = layout.policy[k];
    if (coded_policy(policy) && !backend->codes(policy_stream_kind(policy))) {
      // Short: a gather's local error travels in an 80-byte field (control.hpp).
      return "parameter " + std::to_string(k) + ": " + std::string(shard_policy_name(policy)) +
             " policy is not supported on the " + std::string(backend->name()) + " codec backend";
    }
  }
  return "";
}

// Sizes the send buffer's slots and the receive buffer for the bucket's current policies (at
// setup, and when a policy changes: a parameter switched to CIERA may need more than its raw
// bytes).
void CompressedAllgather::Impl::size_buffers(BucketState& s) {
  std::vector<uint64_t> slot_bytes(s.layout.params());
  for (size_t k = 0; k < slot_bytes.size(); ++k) {
    slot_bytes[k] = std::max<uint64_t>(s.layout.shard_values[rank][k] * s.value_bytes,
                                       s.encoders[k] ? s.encoders[k]->max_payload_bytes() : 0);
  }
  lay_out_send_buffer(slot_bytes, s.send_layout);
  s.envelope_header.resize(envelope_header_bytes(s.layout.params()));
  s.send.reserve(s.send_layout.buffer_bytes);
  s.max_envelope_bytes.resize(static_cast<size_t>(world));
  uint64_t recv = 0;
  for (int r = 0; r < world; ++r) {
    recv += s.max_envelope_bytes[r] = envelope_bound(s.layout, r, config.codec.block_values);
  }
  s.recv.reserve(recv);
}

bool CompressedAllgather::Impl::send_raw(const BucketState& s, uint64_t step) const {
  // Delta and peer-scheme parameters skip raw warmup (warmup_raw_params() sends the ciera ones raw meanwhile).
  if (warmup_raw(step) && !s.skips_warmup) return true;
  if (std::none_of(s.layout.policy.begin(), s.layout.policy.end(), coded_policy)) return true;
  return config.adaptive && step >= config.warmup_steps &&
         !adaptive.compress(step - config.warmup_steps);
}

// ---- Public API ---------------------------------------------------------------------------------
// Misuse a rank can see alone is std::invalid_argument, thrown at once (include/ciera/engine.hpp).

namespace {

void check_bucket(const char* method, size_t bucket, size_t buckets) {
  if (bucket >= buckets) {
    throw std::invalid_argument(std::string(method) + ": bucket " + std::to_string(bucket) +
                                " does not exist (" + std::to_string(buckets) + " buckets)");
  }
}

// start()'s output size: the parts back to back, or the last rank's part at its slot.
uint64_t output_bytes(const BucketLayout& layout, uint64_t slot_stride) {
  if (slot_stride == 0) return layout.total_bytes();
  const int last = layout.ranks() - 1;
  return static_cast<uint64_t>(last) * slot_stride + layout.rank_bytes(last);
}

// "" unless `input` shares bytes with `output` anywhere but exactly at this rank's part (in
// place): elsewhere the gather would overwrite the input while reading it, or write this
// rank's part into another's, and return a wrong output with no error.
std::string overlap_error(std::span<const std::byte> input, std::span<std::byte> output,
                          uint64_t own_offset) {
  if (!ranges_overlap(input.data(), input.size(), output.data(), output.size())) return "";
  const auto in = reinterpret_cast<uintptr_t>(input.data());
  const auto out = reinterpret_cast<uintptr_t>(output.data());
  if (in == out + own_offset) return "";
  const auto at = static_cast<int64_t>(in - out);  // wraps to negative where input starts first
  // Short: the control record's error text (kErrorTextBytes) holds 79 characters, which this
  // fits for offsets below 10^15 bytes.
  return "input overlaps output byte " + std::to_string(at) + ", own part at " +
         std::to_string(own_offset);
}

// "" unless some rank's part would not fit its slot (slots overlapping).
std::string slot_error(const BucketLayout& layout, uint64_t slot_stride) {
  if (slot_stride == 0) return "";
  const auto last = static_cast<uint64_t>(layout.ranks() - 1);
  if (last > 0 && slot_stride > (UINT64_MAX - layout.rank_bytes(layout.ranks() - 1)) / last) {
    return "slot stride of " + std::to_string(slot_stride) + " bytes overflows the output size";
  }
  for (int r = 0; r < layout.ranks(); ++r) {
    if (layout.rank_bytes(r) > slot_stride) {
      return "slot stride of " + std::to_string(slot_stride) + " bytes is less than rank " +
             std::to_string(r) + "'s " + std::to_string(layout.rank_bytes(r)) + " bytes";
    }
  }
  return "";
}

}  // namespace

CompressedAllgather::CompressedAllgather(Transport& transport, EngineConfig config,
                                         std::vector<BucketLayout> buckets,
                                         std::shared_ptr<const CodecBackend> backend)
    // A null backend fails every rank in the agreement (thrown here alone, it left the peers
    // waiting there until the timeout); the host backend stands in until then.
    : impl_(std::make_unique<Impl>(transport, std::move(config), std::move(buckets),
                                   backend ? backend : host_codec_backend(),
                                   backend ? "" : "the codec backend is null")) {}

CompressedAllgather::~CompressedAllgather() = default;

CompressedAllgather::Ticket CompressedAllgather::start(size_t bucket,
                                                       std::span<const std::byte> input,
                                                       std::span<std::byte> output,
                                                       uintptr_t stream, uint64_t slot_stride) {
  return begin(bucket, input, output, stream, slot_stride, "");
}

void CompressedAllgather::refuse(size_t bucket, const std::string& reason) {
  wait(begin(bucket, {}, {}, 0, 0, reason.empty() ? "refused by its caller" : reason));
  throw std::logic_error("refuse: a refused gather of bucket " + std::to_string(bucket) +
                         " completed");
}

CompressedAllgather::Ticket CompressedAllgather::begin(size_t bucket,
                                                       std::span<const std::byte> input,
                                                       std::span<std::byte> output,
                                                       uintptr_t stream, uint64_t slot_stride,
                                                       std::string refusal) {
  Impl& m = *impl_;
  check_bucket("start", bucket, m.buckets.size());
  // From a transport call, wait() is refused (it would wait for itself), so run() would leave
  // this gather writing into the caller's buffers after it threw: refused before it starts.
  if (on_communication_thread()) {
    throw std::invalid_argument(
        "start: called on the engine's communication thread (from a "
        "transport call)");
  }
  BucketState& s = m.buckets[bucket];
  auto g = std::make_shared<Gather>();
  g->ready = m.backend->fence(stream);  // before anything changes: it may throw
  g->bucket = bucket;
  g->in = input.data();
  g->out = output.data();
  g->slot_stride = slot_stride;
  g->started = std::chrono::steady_clock::now();
  {
    // Under the lock: set_policy() on another thread rewrites the layout's policies and the
    // bucket's policy_error, and refuses only once the bucket is busy.
    std::lock_guard lock(m.mutex);
    if (s.busy) {
      throw std::invalid_argument("start: bucket " + std::to_string(bucket) +
                                  " already has a gather in flight");
    }
    // Wrong sizes are not thrown here: the peers are about to gather with this rank, so every
    // rank learns of the problem in the control exchange and fails alike.
    if (!refusal.empty()) {
      g->local_error = std::move(refusal);
    } else if (!s.policy_error.empty()) {
      g->local_error = s.policy_error;
    } else if (input.size() != s.layout.rank_bytes(m.rank)) {
      g->local_error = "input is " + std::to_string(input.size()) +
                       " bytes, the layout gives this rank " +
                       std::to_string(s.layout.rank_bytes(m.rank));
    } else if (std::string slots = slot_error(s.layout, slot_stride); !slots.empty()) {
      g->local_error = slots;
    } else if (output.size() != output_bytes(s.layout, slot_stride)) {
      g->local_error = "output is " + std::to_string(output.size()) +
                       " bytes, the bucket gathers " +
                       std::to_string(output_bytes(s.layout, slot_stride)) +
                       (slot_stride ? " at a slot stride of " + std::to_string(slot_stride) : "");
    } else if (std::string overlap =
                   overlap_error(input, output,
                                 slot_stride ? static_cast<uint64_t>(m.rank) * slot_stride
                                             : s.layout.rank_offset(m.rank));
               !overlap.empty()) {
      g->local_error = overlap;
    }
    s.busy = true;
    // Unique across engines: another engine's ticket is unknown here, not one of this engine's.
    static std::atomic<Ticket> next_ticket{1};
    g->ticket = next_ticket.fetch_add(1, std::memory_order_relaxed);
    m.pending[g->ticket] = g;
    g->sends_raw = m.send_raw(s, s.step);
  }
  try {
    if (g->local_error.empty() && !g->sends_raw) {
      try {
        m.encode(*g, s, false);
      } catch (const std::exception& e) {
        // Encoding could not be handed to the workers (out of memory). The gather is queued all
        // the same, failing, so that the peers learn of it in the control exchange and the
        // bucket is not left busy; the tasks already handed over read the input, so they finish
        // first.
        g->encoding.settle();
        g->local_error = std::string("encoding could not start: ") + e.what();
      }
    }
    std::lock_guard lock(m.mutex);
    m.queue.push_back(g);
  } catch (...) {
    // Not even the failing gather could be queued (out of memory again): the bucket is left as
    // it was before this call and the error goes to the caller; the peers, told nothing, wait
    // for this rank's gather until the timeout.
    g->encoding.settle();
    std::lock_guard lock(m.mutex);
    s.busy = false;
    s.cold = true;  // the encoders may have moved on to a frame no peer saw: resynchronise
    m.pending.erase(g->ticket);
    throw;
  }
  m.wake.notify_all();
  return g->ticket;
}

GatherStats CompressedAllgather::wait(Ticket ticket) {
  if (on_communication_thread()) {
    throw std::invalid_argument(
        "wait: called on the engine's communication thread (from a "
        "transport call), it would wait for itself");
  }
  std::shared_ptr<Gather> g;
  {
    std::lock_guard lock(impl_->mutex);
    auto it = impl_->pending.find(ticket);
    if (it == impl_->pending.end()) {
      throw std::invalid_argument("wait: ticket " + std::to_string(ticket) +
                                  " is unknown or already waited for");
    }
    g = it->second;
    impl_->pending.erase(it);
  }
  GatherStats stats = g->promise.get_future().get();
  switch (g->failure) {
    case Gather::Failure::kNone: return stats;
    case Gather::Failure::kComm: throw CommError(g->failure_text);
    case Gather::Failure::kConfig: throw ConfigError(g->failure_text);
    case Gather::Failure::kFormat: throw FormatError(g->failure_text);
    case Gather::Failure::kInvalidArgument: throw std::invalid_argument(g->failure_text);
    case Gather::Failure::kOther: break;
  }
  throw Error(g->failure_text);
}

GatherStats CompressedAllgather::run(size_t bucket, std::span<const std::byte> input,
                                     std::span<std::byte> output, uintptr_t stream,
                                     uint64_t slot_stride) {
  return wait(start(bucket, input, output, stream, slot_stride));
}

void CompressedAllgather::reset_caches() {
  std::lock_guard lock(impl_->mutex);
  for (size_t b = 0; b < impl_->buckets.size(); ++b) {
    if (impl_->buckets[b].busy) {
      throw std::invalid_argument("reset_caches: bucket " + std::to_string(b) +
                                  " has a gather in flight");
    }
  }
  for (BucketState& s : impl_->buckets) {
    // Kept from an earlier reset otherwise. A gather that failed since may have moved them on:
    // the bucket is cold, so its next gather resynchronises every codec (resynchronise()).
    if (!s.reset_since_gather) {
      for (size_t k = 0; k < s.layout.params(); ++k) impl_->make_codecs(s, k);
    }
    s.reset_since_gather = true;
    s.cold = true;
    s.step = 0;
  }
}

void CompressedAllgather::set_policy(size_t bucket, size_t param, ShardPolicy policy) {
  std::lock_guard lock(impl_->mutex);
  check_bucket("set_policy", bucket, impl_->buckets.size());
  BucketState& s = impl_->buckets[bucket];
  if (param >= s.layout.params()) {
    throw std::invalid_argument("set_policy: bucket " + std::to_string(bucket) +
                                " has no parameter " + std::to_string(param) + " (" +
                                std::to_string(s.layout.params()) + " parameters)");
  }
  if (!is_shard_policy(policy)) {
    throw std::invalid_argument("set_policy: unknown policy " +
                                std::to_string(static_cast<int>(policy)));
  }
  if (s.busy) {
    throw std::invalid_argument("set_policy: bucket " + std::to_string(bucket) +
                                " has a gather in flight");
  }
  if (s.layout.policy[param] == policy) return;
  s.layout.policy[param] = policy;
  try {
    impl_->make_codecs(s, param);
  } catch (...) {
    // The old codecs are gone (released first) and the new ones could not be made (memory):
    // the parameter goes raw, which needs none. Its policy now differs from the peers', so the
    // bucket's next gather fails on every rank (the policy digest) rather than going on unlike.
    s.layout.policy[param] = ShardPolicy::kRaw;
    impl_->release_codecs(s, param);
    impl_->refresh_policies(s);
    impl_->size_buffers(s);
    throw;
  }
  impl_->refresh_policies(s);
  impl_->size_buffers(s);
}

BucketLayout CompressedAllgather::bucket(size_t index) const {
  std::lock_guard lock(impl_->mutex);
  check_bucket("bucket", index, impl_->buckets.size());
  return impl_->buckets[index].layout;
}
size_t CompressedAllgather::bucket_count() const { return impl_->buckets.size(); }
bool CompressedAllgather::on_communication_thread() const noexcept {
  return impl_->comm.get_id() == std::this_thread::get_id();
}
int CompressedAllgather::rank() const { return impl_->rank; }
int CompressedAllgather::world_size() const { return impl_->world; }
const CodecBackend& CompressedAllgather::backend() const { return *impl_->backend; }

size_t CompressedAllgather::cache_bytes() const {
  std::lock_guard lock(impl_->mutex);  // set_policy() and reset_caches() replace the codecs
  size_t bytes = 0;
  for (const BucketState& s : impl_->buckets) {
    for (const auto& e : s.encoders) bytes += e ? e->cache_bytes() : 0;
    for (const auto& peer : s.decoders) {
      for (const auto& d : peer) bytes += d ? d->cache_bytes() : 0;
    }
  }
  return bytes;
}

}  // namespace ciera
