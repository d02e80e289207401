// The compressed allgather engine. One gather of one bucket (docs/format.md, "Engine protocol"):
//
//   encode   this rank's shards into one bucket frame (worker threads; starts at start())
//   control  allgather of fixed-size control records: frame sizes, steps, cold flags, policy
//            digests and any local error. Peers out of step or cold -> key-frame round.
//   payload  allgatherv of the bucket frames, sized exactly (no padding to the maximum)
//   decode   every peer's frame into the output (worker threads)
//   verdict  allgather of per-rank decode verdicts: all ranks agree that every shard was
//            reconstructed exactly; otherwise all re-send key frames once, then fail together.
//
// All collectives run on one communication thread, in start() order, so that the order is the
// same on every rank and the caller's thread only waits where it asks to (paper §3.3: encoding
// overlaps earlier work, decoding is the only codec work on the critical path).
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ciera/codec.hpp"
#include "ciera/engine.hpp"
#include "ciera/error.hpp"
#include "ciera/version.hpp"
#include "common/bytes.hpp"
#include "common/checksum.hpp"
#include "common/huge_pages.hpp"
#include "engine/adaptive.hpp"
#include "engine/thread_pool.hpp"

namespace ciera {
namespace {

// ---- Wire records (docs/format.md, "Engine protocol") ------------------------------------------

constexpr uint32_t kFrameMagic = 0x42454943;    // "CIEB"
constexpr uint32_t kControlMagic = 0x43454943;  // "CIEC"
constexpr uint8_t kProtocolVersion = 1;
constexpr size_t kFrameHeaderBytes = 24;        // + 8 bytes per parameter
constexpr uint8_t kFrameWarmupRaw = 1;
constexpr size_t kMessageBytes = 80;

enum ControlFlags : uint32_t { kCold = 1, kLocalError = 2, kKeyRound = 4, kRaw = 8 };

struct ControlRecord {  // 128 bytes, little-endian host layout
  uint32_t magic;
  uint32_t version;
  uint32_t bucket;
  uint32_t flags;
  uint64_t step;
  uint64_t frame_bytes;
  uint64_t policy_digest;
  uint32_t previous_us;          // this rank's duration of its previous gather of the bucket
  uint32_t previous_compressed;  // whether that gather was compressed
  char message[kMessageBytes];
};
static_assert(sizeof(ControlRecord) == 128);

struct Verdict {  // 128 bytes
  int32_t failed;  // 0: every shard decoded exactly
  int32_t peer;
  int32_t param;
  int32_t reserved;
  char message[112];
};
static_assert(sizeof(Verdict) == 128);

void copy_message(char* dst, size_t capacity, const std::string& text) {
  std::memset(dst, 0, capacity);
  std::memcpy(dst, text.data(), std::min(text.size(), capacity - 1));
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) {
    if (!s.empty()) s += ',';
    s += std::to_string(r);
  }
  return s;
}

// ---- Configuration agreement --------------------------------------------------------------------

// One "key=value" line per fact every rank must agree on, in a fixed order.
std::vector<std::pair<std::string, std::string>> describe(const EngineConfig& c,
                                                          const std::vector<BucketLayout>& buckets,
                                                          int world) {
  std::vector<std::pair<std::string, std::string>> facts;
  facts.emplace_back("format_version", std::to_string(kFormatVersion));
  facts.emplace_back("protocol_version", std::to_string(kProtocolVersion));
  facts.emplace_back("world_size", std::to_string(world));
  facts.emplace_back("block_values", std::to_string(c.codec.block_values));
  facts.emplace_back("change_detection", std::string(change_detection_name(c.codec.detection)));
  facts.emplace_back("exponent_coding", std::string(exponent_coding_name(c.codec.coding)));
  facts.emplace_back("content_checksum", c.codec.content_checksum ? "on" : "off");
  facts.emplace_back("warmup_steps", std::to_string(c.warmup_steps));
  facts.emplace_back("warmup_mode", c.warmup == WarmupMode::kRaw ? "raw" : "key_frames");
  facts.emplace_back("adaptive", c.adaptive ? "on" : "off");
  facts.emplace_back("buckets", std::to_string(buckets.size()));
  for (size_t b = 0; b < buckets.size(); ++b) {
    const BucketLayout& l = buckets[b];
    const std::string p = "bucket[" + std::to_string(b) + "].";
    facts.emplace_back(p + "name", l.name);
    facts.emplace_back(p + "dtype", std::string(dtype_name(l.dtype)));
    facts.emplace_back(p + "ranks", std::to_string(l.ranks()));
    facts.emplace_back(p + "params", std::to_string(l.params()));
    std::string policy;
    for (ShardPolicy s : l.policy) policy += s == ShardPolicy::kCiera ? 'c' : 'r';
    facts.emplace_back(p + "policy", policy);
    for (int r = 0; r < l.ranks(); ++r) {
      std::string sizes;
      for (uint64_t v : l.shard_values[r]) {
        if (!sizes.empty()) sizes += ',';
        sizes += std::to_string(v);
      }
      facts.emplace_back(p + "shard_values[rank " + std::to_string(r) + "]", sizes);
    }
  }
  return facts;
}

std::string serialise(const std::vector<std::pair<std::string, std::string>>& facts) {
  std::string s;
  for (const auto& [k, v] : facts) s += k + "=" + v + "\n";
  return s;
}

std::map<std::string, std::string> parse_facts(const std::string& text) {
  std::map<std::string, std::string> facts;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) facts[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return facts;
}

std::string shorten(const std::string& s) { return s.size() > 80 ? s.substr(0, 77) + "..." : s; }

// Exchanges every rank's description; throws ConfigError (the same text on every rank) if any
// rank reported a local error or any fact differs from rank 0's.
void agree_on_configuration(Transport& t, const std::string& mine) {
  const int world = t.size();
  uint64_t my_length = mine.size();
  std::vector<uint64_t> lengths(static_cast<size_t>(world));
  t.allgather(&my_length, sizeof my_length, lengths.data());
  std::vector<uint64_t> displs(static_cast<size_t>(world));
  uint64_t total = 0;
  for (int r = 0; r < world; ++r) {
    displs[r] = total;
    total += lengths[r];
  }
  std::string all(total, '\0');
  t.allgatherv(mine.data(), all.data(), lengths, displs);
  std::vector<std::map<std::string, std::string>> facts;
  for (int r = 0; r < world; ++r) facts.push_back(parse_facts(all.substr(displs[r], lengths[r])));
  for (int r = 0; r < world; ++r) {
    if (auto it = facts[r].find("error"); it != facts[r].end()) {
      throw ConfigError("configuration rejected on rank " + std::to_string(r) + ": " + it->second);
    }
  }
  // Report the first differing fact in rank 0's order, with which ranks hold which value.
  std::istringstream order(all.substr(0, lengths[0]));
  std::string line;
  std::vector<std::string> keys;
  while (std::getline(order, line)) keys.push_back(line.substr(0, line.find('=')));
  for (int r = 1; r < world; ++r) {
    for (const auto& [k, v] : facts[r]) {
      if (!facts[0].count(k)) keys.push_back(k);
    }
  }
  for (const std::string& key : keys) {
    std::map<std::string, std::vector<int>> holders;
    for (int r = 0; r < world; ++r) {
      auto it = facts[r].find(key);
      holders[it == facts[r].end() ? "<absent>" : it->second].push_back(r);
    }
    if (holders.size() > 1) {
      std::string text = "configuration mismatch across ranks: " + key + " is";
      bool first = true;
      for (const auto& [value, ranks] : holders) {
        text += std::string(first ? " " : "; ") + "'" + shorten(value) + "' on rank" +
                (ranks.size() > 1 ? "s " : " ") + join_ranks(ranks);
        first = false;
      }
      throw ConfigError(text);
    }
  }
}

uint64_t policy_digest(const BucketLayout& layout) {
  return checksum64(layout.policy.data(), layout.policy.size() * sizeof(ShardPolicy));
}

}  // namespace

// ---- Engine state -------------------------------------------------------------------------------

struct BucketState {
  BucketLayout layout;
  uint32_t value_bytes = 0;
  uint64_t step = 0;   // gathers completed (agreed by all ranks)
  bool cold = false;   // set by reset_caches(): peers must resynchronise with this rank
  bool busy = false;
  double last_gather_s = 0;      // this rank's time for the previous gather (0: none yet)
  bool last_compressed = false;
  std::vector<uint64_t> my_param_offset;          // byte offset of each param in this rank's input
  uint64_t frame_offset = 0;                      // where the frame starts in `send`
  std::vector<uint64_t> slot_offset;              // offset of each param's slot in `send`
  std::vector<uint64_t> payload_bytes;            // encoded length per param (this step)
  std::vector<std::unique_ptr<ShardEncoder>> encoders;                 // [param]
  std::vector<std::vector<std::unique_ptr<ShardDecoder>>> decoders;    // [peer][param]
  // Cache-line aligned: each slot starts on a line, so that the encoder can stream a large
  // payload's sign-mantissa plane past the caches (docs/format.md, "Padding").
  std::vector<std::byte, HugePageAllocator<std::byte>> send;
  std::vector<std::byte, HugePageAllocator<std::byte>> recv;
  std::vector<uint64_t> max_frame_bytes;          // per rank

  // Places the frame header and one slot per parameter, each large enough for the raw shard or
  // its largest payload, in `send`. Slots start on cache lines; the frame starts where its first
  // slot is exactly where assemble_frame packs the first payload, so that one never moves.
  void lay_out_slots(int rank) {
    constexpr uint64_t kLine = 64;
    const uint64_t header = kFrameHeaderBytes + 8 * layout.params();
    frame_offset = (kLine - header % kLine) % kLine;
    uint64_t slot = frame_offset + header;
    for (size_t k = 0; k < layout.params(); ++k) {
      slot = (slot + kLine - 1) / kLine * kLine;
      slot_offset[k] = slot;
      slot += std::max<uint64_t>(layout.shard_values[rank][k] * value_bytes,
                                 encoders[k] ? encoders[k]->max_payload_bytes() : 0);
    }
    send.resize(slot);
  }
};

struct Op {
  CompressedAllgather::Ticket ticket = 0;
  size_t bucket = 0;
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
  std::string local_error;  // misuse found at start(); every rank learns of it
  TaskGroup encoding;
  bool encoded_warmup_raw = false;  // this rank sends this gather raw (warmup or adaptive)
  bool assembled = false;     // the frame has been packed in the bucket's `send`
  bool direct = false;        // every rank sends raw: gathered straight from input to output
  uint64_t frame_bytes = 0;
  uint64_t step = 0;          // agreed by all ranks in the control exchange
  std::vector<ControlRecord> control;  // every rank's record for this gather
  Verdict verdict{};          // this rank's decode outcome
  std::mutex verdict_mutex;
  TaskGroup decoding;
  std::chrono::steady_clock::time_point decode_started;
  std::promise<GatherStats> promise;
  GatherStats stats;
  std::chrono::steady_clock::time_point started;
};

// Gathers processed together share one control exchange, one batched payload exchange and one
// verdict exchange (see run_group).
constexpr size_t kMaxGroup = 8;
struct GroupControl {
  uint32_t magic;
  uint32_t count;  // gathers this rank has encoded and ready, at most kMaxGroup
  uint64_t reserved;
  ControlRecord records[kMaxGroup];
};
struct GroupVerdict {
  Verdict verdicts[kMaxGroup];
};

struct CompressedAllgather::Impl {
  Impl(Transport& t, EngineConfig c, std::vector<BucketLayout> layouts);
  ~Impl();

  void make_codecs(BucketState& s, size_t param);
  uint64_t frame_bound(const BucketState& s, int rank) const;
  bool warmup_raw(uint64_t step) const {
    return config.warmup == WarmupMode::kRaw && step < config.warmup_steps;
  }
  // Whether the gather at `step` sends this bucket raw (then every parameter travels as is).
  bool send_raw(const BucketState& s, uint64_t step) const {
    if (warmup_raw(step)) return true;
    if (std::none_of(s.layout.policy.begin(), s.layout.policy.end(),
                     [](ShardPolicy p) { return p == ShardPolicy::kCiera; })) {
      return true;
    }
    return config.adaptive && step >= config.warmup_steps &&
           !adaptive.compress(step - config.warmup_steps);
  }
  void encode(Op& op, BucketState& s, bool raw);
  uint64_t assemble_frame(BucketState& s, uint64_t step, bool raw);
  void comm_loop();
  void run_group(std::vector<std::shared_ptr<Op>>& group);
  void prepare(Op& op);
  void settle_mode(Op& op);
  ControlRecord make_record(const Op& op, uint32_t flags) const;
  size_t exchange_controls(std::span<Op* const> ops, uint32_t flags);
  void check_records(const Op& op) const;
  bool needs_resync(const Op& op) const;
  void resynchronise(Op& op);
  void exchange_and_decode(std::span<Op* const> ops);
  void start_decode(Op& op);
  std::vector<std::string> exchange_verdicts(std::span<Op* const> ops);
  void finish(Op& op);
  template <typename F>
  void timed(std::span<Op* const> ops, F&& collective);

  Transport& transport;
  EngineConfig config;
  int rank = 0;
  int world = 1;
  std::vector<BucketState> buckets;
  AdaptiveSwitch adaptive;  // used from the comm thread, and from start() between gathers
  ThreadPool pool;

  std::mutex mutex;
  std::condition_variable wake;
  std::deque<std::shared_ptr<Op>> queue;
  std::map<Ticket, std::shared_ptr<Op>> pending;
  Ticket next_ticket = 1;
  bool stopping = false;
  std::string broken;  // after a CommError the engine fails every later gather with this
  std::thread comm;
};

CompressedAllgather::Impl::Impl(Transport& t, EngineConfig c, std::vector<BucketLayout> layouts)
    : transport(t), config(std::move(c)), rank(t.rank()), world(t.size()),
      pool(config.worker_threads) {
  transport.set_timeout(config.timeout);
  // Local problems are not thrown yet: every rank first learns of them in the agreement, so
  // that all fail together rather than some waiting forever for the others.
  std::string local_error;
  try {
    config.codec.warmup_steps = config.warmup == WarmupMode::kKeyFrames ? config.warmup_steps : 0;
    config.codec.validate();
    for (const BucketLayout& l : layouts) {
      l.validate();
      if (l.ranks() != world) {
        throw ConfigError("bucket '" + l.name + "' describes " + std::to_string(l.ranks()) +
                          " ranks but the transport has " + std::to_string(world));
      }
    }
  } catch (const Error& e) {
    local_error = e.what();
  }
  auto facts = describe(config, layouts, world);
  if (!local_error.empty()) facts.insert(facts.begin(), {"error", local_error});
  agree_on_configuration(transport, serialise(facts));

  buckets.resize(layouts.size());
  for (size_t b = 0; b < layouts.size(); ++b) {
    BucketState& s = buckets[b];
    s.layout = std::move(layouts[b]);
    s.value_bytes = dtype_info(s.layout.dtype).value_bytes;
    const size_t params = s.layout.params();
    s.encoders.resize(params);
    s.decoders.resize(static_cast<size_t>(world));
    for (auto& peer : s.decoders) peer.resize(params);
    s.payload_bytes.assign(params, 0);
    s.my_param_offset.resize(params);
    s.slot_offset.resize(params);
    uint64_t offset = 0;
    for (size_t k = 0; k < params; ++k) {
      s.my_param_offset[k] = offset;
      offset += s.layout.shard_values[rank][k] * s.value_bytes;
      make_codecs(s, k);
    }
    s.lay_out_slots(rank);
    s.max_frame_bytes.resize(static_cast<size_t>(world));
    uint64_t recv = 0;
    for (int r = 0; r < world; ++r) recv += s.max_frame_bytes[r] = frame_bound(s, r);
    s.recv.resize(recv);
  }
  comm = std::thread([this] { comm_loop(); });
}

CompressedAllgather::Impl::~Impl() {
  {
    std::lock_guard lock(mutex);
    stopping = true;
  }
  wake.notify_all();
  comm.join();
}

void CompressedAllgather::Impl::make_codecs(BucketState& s, size_t k) {
  CodecConfig codec = config.codec;
  codec.dtype = s.layout.dtype;
  const bool ciera = s.layout.policy[k] == ShardPolicy::kCiera;
  s.encoders[k] = ciera ? std::make_unique<ShardEncoder>(codec, s.layout.shard_values[rank][k]) : nullptr;
  for (int p = 0; p < world; ++p) {
    s.decoders[p][k] = ciera && p != rank
                           ? std::make_unique<ShardDecoder>(codec, s.layout.shard_values[p][k])
                           : nullptr;
  }
}

uint64_t CompressedAllgather::Impl::frame_bound(const BucketState& s, int r) const {
  uint64_t bytes = kFrameHeaderBytes + 8 * s.layout.params();
  for (size_t k = 0; k < s.layout.params(); ++k) {
    const uint64_t n = s.layout.shard_values[r][k];
    bytes += std::max<uint64_t>(n * s.value_bytes,
                                s.layout.policy[k] == ShardPolicy::kCiera
                                    ? max_payload_bytes(s.layout.dtype, n, config.codec.block_values)
                                    : 0);
  }
  return bytes;
}

// Encodes this rank's shards into their slots of `send` on the worker threads. Small shards are
// grouped so a task is worth its scheduling.
void CompressedAllgather::Impl::encode(Op& op, BucketState& s, bool raw) {
  op.encoded_warmup_raw = raw;
  constexpr uint64_t kTaskBytes = 1 << 20;
  const size_t params = s.layout.params();
  size_t first = 0;
  while (first < params) {
    size_t last = first;
    uint64_t bytes = 0;
    while (last < params && (last == first || bytes < kTaskBytes)) {
      bytes += s.layout.shard_values[rank][last] * s.value_bytes;
      ++last;
    }
    pool.submit(op.encoding, [&s, &op, first, last, raw, this] {
      for (size_t k = first; k < last; ++k) {
        const uint64_t shard_bytes = s.layout.shard_values[rank][k] * s.value_bytes;
        const std::byte* src = op.in + s.my_param_offset[k];
        std::byte* slot = s.send.data() + s.slot_offset[k];
        if (raw || !s.encoders[k]) {
          if (shard_bytes) std::memcpy(slot, src, shard_bytes);
          s.payload_bytes[k] = shard_bytes;
        } else {
          const uint64_t capacity = s.encoders[k]->max_payload_bytes();
          s.payload_bytes[k] = s.encoders[k]->encode({src, shard_bytes}, {slot, capacity}).payload_bytes;
        }
      }
    });
    first = last;
  }
}

// Packs the header and the encoded shards into one contiguous frame at s.frame_offset of `send`.
uint64_t CompressedAllgather::Impl::assemble_frame(BucketState& s, uint64_t step, bool raw) {
  uint8_t* frame = reinterpret_cast<uint8_t*>(s.send.data()) + s.frame_offset;
  const size_t params = s.layout.params();
  uint64_t at = kFrameHeaderBytes + 8 * params;
  for (size_t k = 0; k < params; ++k) {
    const uint64_t slot = s.slot_offset[k] - s.frame_offset;
    if (slot != at && s.payload_bytes[k] != 0) std::memmove(frame + at, frame + slot, s.payload_bytes[k]);
    store_le64(frame + kFrameHeaderBytes + 8 * k, s.payload_bytes[k]);
    at += s.payload_bytes[k];
  }
  store_le32(frame, kFrameMagic);
  frame[4] = kProtocolVersion;
  frame[5] = raw ? kFrameWarmupRaw : 0;
  store_le16(frame + 6, 0);
  store_le32(frame + 8, static_cast<uint32_t>(&s - buckets.data()));
  store_le32(frame + 12, static_cast<uint32_t>(params));
  store_le64(frame + 16, step);
  return at;
}

// Submits the decoding of every peer's frame of `op` (and the copy of this rank's own shards)
// to the worker threads; op.decoding completes when all are done, op.verdict holds the outcome.
void CompressedAllgather::Impl::start_decode(Op& op) {
  BucketState& s = buckets[op.bucket];
  const size_t params = s.layout.params();
  const std::vector<ControlRecord>& control = op.control;
  const uint64_t step = op.step;
  std::vector<uint64_t> frame_at(static_cast<size_t>(world));
  uint64_t at = 0;
  for (int r = 0; r < world; ++r) {
    frame_at[r] = at;
    at += control[r].frame_bytes;
  }
  op.verdict = Verdict{};
  op.decode_started = std::chrono::steady_clock::now();
  // Keeps the lowest (peer, parameter) failure, so the report does not depend on thread timing.
  auto fail = [&op](int peer, int param, const std::string& why) {
    std::lock_guard lock(op.verdict_mutex);
    Verdict& v = op.verdict;
    if (v.failed && (v.peer < peer || (v.peer == peer && v.param <= param))) return;
    v.failed = 1;
    v.peer = peer;
    v.param = param;
    copy_message(v.message, sizeof v.message, why);
  };

  // Own shards: straight from the input (nothing to do when gathering in place).
  std::byte* own = op.out + s.layout.rank_offset(rank);
  const uint64_t own_bytes = s.layout.rank_bytes(rank);
  if (own != op.in && own_bytes) {
    pool.submit(op.decoding, [own, &op, own_bytes] { std::memmove(own, op.in, own_bytes); });
  }
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    pool.submit(op.decoding, [&s, &op, fail, p, params, step, frame_offset = frame_at[p],
                              frame_bytes = control[p].frame_bytes] {
      const uint8_t* frame = reinterpret_cast<const uint8_t*>(s.recv.data()) + frame_offset;
      const uint64_t header = kFrameHeaderBytes + 8 * params;
      if (frame_bytes < header || load_le32(frame) != kFrameMagic || frame[4] != kProtocolVersion ||
          load_le32(frame + 8) != op.bucket || load_le32(frame + 12) != params ||
          load_le64(frame + 16) != step) {
        fail(p, -1, "rank " + std::to_string(p) + "'s frame header is malformed or for another gather");
        return;
      }
      const bool raw = (frame[5] & kFrameWarmupRaw) != 0;
      uint64_t offset = header;
      std::byte* dest = op.out + s.layout.rank_offset(p);
      for (size_t k = 0; k < params; ++k) {
        const uint64_t length = load_le64(frame + kFrameHeaderBytes + 8 * k);
        const uint64_t bytes = s.layout.shard_values[p][k] * s.value_bytes;
        if (length > frame_bytes - offset) {
          fail(p, static_cast<int>(k), "rank " + std::to_string(p) + "'s frame is shorter than its shard lengths");
          return;
        }
        const std::byte* payload = reinterpret_cast<const std::byte*>(frame + offset);
        if (raw || !s.decoders[p][k]) {
          if (length != bytes) {
            fail(p, static_cast<int>(k), "raw shard of " + std::to_string(length) + " bytes, expected " + std::to_string(bytes));
            return;
          }
          if (bytes) std::memcpy(dest, payload, bytes);
        } else {
          try {
            s.decoders[p][k]->decode({payload, length}, {dest, bytes});
          } catch (const FormatError& e) {
            fail(p, static_cast<int>(k), e.what());
          }
        }
        offset += length;
        dest += bytes;
      }
      if (offset != frame_bytes) fail(p, -1, "rank " + std::to_string(p) + "'s frame has trailing bytes");
    });
  }
}

template <typename F>
void CompressedAllgather::Impl::timed(std::span<Op* const> ops, F&& collective) {
  const auto t = std::chrono::steady_clock::now();
  collective();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  // A batched exchange serves every gather in it; each is charged the whole wait.
  for (Op* op : ops) op->stats.exchange_s += seconds;
}

// Waits for the gather's encoding and packs its frame (once).
void CompressedAllgather::Impl::prepare(Op& op) {
  if (op.assembled || !op.local_error.empty()) return;
  BucketState& s = buckets[op.bucket];
  if (op.encoded_warmup_raw) {
    // Nothing is encoded for a raw gather: if every rank sends raw, input goes straight to
    // output. The size announced is that of a raw frame, built only if some peer compresses.
    op.frame_bytes = kFrameHeaderBytes + 8 * s.layout.params() + s.layout.rank_bytes(rank);
    return;
  }
  try {
    op.encoding.wait();
  } catch (const std::exception& e) {
    op.local_error = std::string("encoding failed: ") + e.what();
    return;
  }
  op.stats.encode_s = op.encoding.seconds_since(op.started);
  op.frame_bytes = assemble_frame(s, s.step, op.encoded_warmup_raw);
  op.assembled = true;
}

// After a control exchange: decides whether the gather goes direct (every rank raw) and, if
// this rank is raw but a peer compresses, builds the raw frame it announced.
void CompressedAllgather::Impl::settle_mode(Op& op) {
  op.direct = std::all_of(op.control.begin(), op.control.end(),
                          [](const ControlRecord& c) { return (c.flags & kRaw) != 0; });
  if (op.direct || op.assembled || !op.encoded_warmup_raw) return;
  BucketState& s = buckets[op.bucket];
  encode(op, s, true);
  op.encoding.wait();
  const uint64_t frame = assemble_frame(s, op.control[rank].step, true);
  if (frame != op.frame_bytes) throw std::logic_error("raw frame size differs from the announced size");
  op.assembled = true;
}

ControlRecord CompressedAllgather::Impl::make_record(const Op& op, uint32_t flags) const {
  const BucketState& s = buckets[op.bucket];
  ControlRecord r{};
  r.magic = kControlMagic;
  r.version = kProtocolVersion;
  r.bucket = static_cast<uint32_t>(op.bucket);
  r.flags = flags | (s.cold ? uint32_t{kCold} : 0u) | (op.local_error.empty() ? 0u : uint32_t{kLocalError}) |
            (op.encoded_warmup_raw ? uint32_t{kRaw} : 0u);
  r.step = s.step;
  r.frame_bytes = op.local_error.empty() ? op.frame_bytes : 0;
  r.policy_digest = policy_digest(s.layout);
  r.previous_us = static_cast<uint32_t>(std::min(4e9, s.last_gather_s * 1e6));
  r.previous_compressed = s.last_compressed;
  copy_message(r.message, kMessageBytes, op.local_error);
  return r;
}

// One allgather of every rank's records for `ops`. Returns how many leading gathers all ranks
// have ready (each op's `control` is filled for those); throws if ranks disagree on what they
// gather.
size_t CompressedAllgather::Impl::exchange_controls(std::span<Op* const> ops, uint32_t flags) {
  GroupControl mine{};
  mine.magic = kControlMagic;
  mine.count = static_cast<uint32_t>(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) mine.records[i] = make_record(*ops[i], flags);
  std::vector<GroupControl> all(static_cast<size_t>(world));
  timed(ops, [&] { transport.allgather(&mine, sizeof mine, all.data()); });
  size_t ready = kMaxGroup;
  for (int r = 0; r < world; ++r) {
    if (all[r].magic != kControlMagic || all[r].count == 0 || all[r].count > kMaxGroup) {
      throw CommError("rank " + std::to_string(r) + " sent a malformed control record");
    }
    ready = std::min<size_t>(ready, all[r].count);
  }
  for (size_t i = 0; i < ready; ++i) {
    ops[i]->control.resize(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) ops[i]->control[r] = all[r].records[i];
    try {
      check_records(*ops[i]);
    } catch (const ConfigError&) {
      // A gather some rank rejected fails alone: gathers before it proceed, and it and those
      // after it wait for the next round, where it comes first and fails by itself.
      if (i == 0) throw;
      return i;
    }
  }
  return ready;
}

void CompressedAllgather::Impl::check_records(const Op& op) const {
  const BucketState& s = buckets[op.bucket];
  for (int r = 0; r < world; ++r) {
    const ControlRecord& c = op.control[r];
    if (c.magic != kControlMagic || c.version != kProtocolVersion) {
      throw CommError("rank " + std::to_string(r) + " speaks another CIERA protocol version");
    }
    if (c.bucket != op.bucket) {
      throw CommError("gathers out of order: rank " + std::to_string(r) + " is gathering bucket " +
                      std::to_string(c.bucket) + " while rank " + std::to_string(rank) +
                      " gathers bucket " + std::to_string(op.bucket) +
                      " (start() must be called in the same order on every rank)");
    }
  }
  for (int r = 0; r < world; ++r) {
    if (op.control[r].flags & kLocalError) {
      throw ConfigError("rank " + std::to_string(r) + " rejected its gather of bucket '" +
                        s.layout.name + "': " + std::string(op.control[r].message));
    }
  }
  for (int r = 0; r < world; ++r) {
    if (op.control[r].policy_digest != op.control[0].policy_digest) {
      throw ConfigError("shard policies of bucket '" + s.layout.name + "' differ between rank 0 and rank " +
                        std::to_string(r) + " (set_policy must be called the same way on every rank)");
    }
    if (op.control[r].frame_bytes > s.max_frame_bytes[r]) {
      throw CommError("rank " + std::to_string(r) + " announced a frame of " +
                      std::to_string(op.control[r].frame_bytes) + " bytes, above its bound of " +
                      std::to_string(s.max_frame_bytes[r]));
    }
  }
}

// A gather must be re-sent as key frames when some rank is cold, the ranks' step counts differ
// (a restarted rank), or this rank compressed a gather that the agreed step puts in raw warmup.
// (Ranks may otherwise send raw or compressed independently: each frame says which.)
bool CompressedAllgather::Impl::needs_resync(const Op& op) const {
  uint64_t step = 0;
  for (const ControlRecord& c : op.control) step = std::max(step, c.step);
  for (const ControlRecord& c : op.control) {
    if (c.step != step || (c.flags & kCold)) return true;
  }
  return warmup_raw(step) && !op.encoded_warmup_raw;
}

// Every rank re-sends key frames (or raw bytes in warmup) for the agreed step, then the ranks
// exchange fresh control records for this gather alone.
void CompressedAllgather::Impl::resynchronise(Op& op) {
  BucketState& s = buckets[op.bucket];
  uint64_t step = 0;
  for (const ControlRecord& c : op.control) step = std::max(step, c.step);
  op.stats.resynchronised = true;
  s.step = step;
  for (auto& e : s.encoders) {
    if (e) e->request_key_frame();
  }
  op.assembled = false;
  op.encoded_warmup_raw = send_raw(s, step);
  if (!op.encoded_warmup_raw) {
    const auto t = std::chrono::steady_clock::now();
    encode(op, s, false);
    op.encoding.wait();
    op.stats.encode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  prepare(op);
  Op* one[] = {&op};
  exchange_controls(one, kKeyRound);
  settle_mode(op);
}

// Exchanges the frames of `ops` (all in flight together) and decodes each gather as soon as
// its own exchange completes, overlapping the exchanges still in flight (paper §3.3).
void CompressedAllgather::Impl::exchange_and_decode(std::span<Op* const> ops) {
  std::vector<std::vector<uint64_t>> counts(ops.size()), displs(ops.size());
  std::vector<Transport::AllgathervCall> calls;
  for (size_t i = 0; i < ops.size(); ++i) {
    Op& op = *ops[i];
    BucketState& s = buckets[op.bucket];
    uint64_t step = 0;
    for (const ControlRecord& c : op.control) step = std::max(step, c.step);
    op.step = step;
    uint64_t total = 0;
    for (int r = 0; r < world; ++r) {
      counts[i].push_back(op.control[r].frame_bytes);
      displs[i].push_back(total);
      total += op.control[r].frame_bytes;
    }
    if (op.direct) {
      // Every rank raw: the plain allgather of the inputs, exactly what MPI would do.
      for (int r = 0; r < world; ++r) {
        counts[i][r] = s.layout.rank_bytes(r);
        displs[i][r] = s.layout.rank_offset(r);
      }
      op.stats.wire_bytes = s.layout.total_bytes();
      op.stats.local_payload_bytes = s.layout.rank_bytes(rank);
      // As plain MPI would: one transfer. Raw gathers are chosen where links are fast and the
      // cores busy, and there extra channels only add per-message work.
      calls.push_back({op.in, op.out, counts[i], displs[i], 1});
      continue;
    }
    op.stats.wire_bytes = total;
    op.stats.local_payload_bytes = op.control[rank].frame_bytes;
    calls.push_back({s.send.data() + s.frame_offset, s.recv.data(), counts[i], displs[i]});
  }
  timed(ops, [&] {
    transport.allgatherv_many(calls, [&](size_t i) {
      if (!ops[i]->direct) start_decode(*ops[i]);
    });
  });
  for (Op* op : ops) {
    if (op->direct) continue;
    op->decoding.wait();
    op->stats.decode_s += op->decoding.seconds_since(op->decode_started);
  }
}

// Returns, per gather, "" if every rank reconstructed it exactly, else the first failure in
// rank order, worded the same on every rank.
std::vector<std::string> CompressedAllgather::Impl::exchange_verdicts(std::span<Op* const> ops) {
  GroupVerdict mine{};
  for (size_t i = 0; i < ops.size(); ++i) mine.verdicts[i] = ops[i]->verdict;
  std::vector<GroupVerdict> all(static_cast<size_t>(world));
  timed(ops, [&] { transport.allgather(&mine, sizeof mine, all.data()); });
  std::vector<std::string> failures(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    for (int r = 0; r < world; ++r) {
      const Verdict& v = all[r].verdicts[i];
      if (!v.failed) continue;
      failures[i] = "rank " + std::to_string(r) + " could not reconstruct rank " + std::to_string(v.peer) +
                    "'s " + (v.param >= 0 ? "shard of parameter " + std::to_string(v.param) : std::string("frame")) +
                    " in bucket '" + buckets[ops[i]->bucket].layout.name + "': " +
                    std::string(v.message, strnlen(v.message, sizeof v.message));
      break;
    }
  }
  return failures;
}

void CompressedAllgather::Impl::finish(Op& op) {
  BucketState& s = buckets[op.bucket];
  // The slowest rank's time for the previous gather, as every rank reported it here.
  uint32_t slowest_us = 0;
  bool all_reported = true;
  bool same_mode = true;
  for (const ControlRecord& c : op.control) {
    slowest_us = std::max(slowest_us, c.previous_us);
    all_reported = all_reported && c.previous_us > 0;
    same_mode = same_mode && c.previous_compressed == op.control[0].previous_compressed;
  }
  if (config.adaptive && all_reported && same_mode && op.step > config.warmup_steps) {
    std::lock_guard lock(mutex);  // start() reads the switch on the caller's thread
    adaptive.record(op.bucket, op.control[0].previous_compressed != 0, slowest_us * 1e-6);
  }
  s.cold = false;
  s.step = op.step + 1;
  op.stats.step = op.step;
  op.stats.warmup = warmup_raw(op.step);
  op.stats.compressed = !op.encoded_warmup_raw;
  op.stats.raw_bytes = s.layout.total_bytes();
  op.stats.total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - op.started).count();
  s.last_gather_s = op.stats.total_s;
  s.last_compressed = op.stats.compressed;
  {
    std::lock_guard lock(mutex);
    s.busy = false;
  }
  op.promise.set_value(op.stats);
}

// Processes `group` (gathers taken from the queue, in start order). Gathers that not every rank
// has ready yet go back to the front of the queue for the next round.
void CompressedAllgather::Impl::run_group(std::vector<std::shared_ptr<Op>>& group) {
  std::vector<Op*> ops;
  for (auto& op : group) {
    prepare(*op);
    ops.push_back(op.get());
  }
  size_t ready = exchange_controls(ops, 0);
  // The group ends before the first gather that must resynchronise (unless that is the first,
  // which then goes alone) or that failed locally (check_records threw already in that case).
  for (size_t i = 0; i < ready; ++i) {
    if (needs_resync(*ops[i])) {
      ready = i == 0 ? 1 : i;
      break;
    }
  }
  {
    std::lock_guard lock(mutex);
    for (size_t i = group.size(); i-- > ready;) queue.push_front(group[i]);
  }
  group.resize(ready);
  ops.resize(ready);
  if (needs_resync(*ops[0])) {
    resynchronise(*ops[0]);
  } else {
    settle_mode(*ops[0]);
  }
  for (size_t i = 1; i < ops.size(); ++i) settle_mode(*ops[i]);

  exchange_and_decode(ops);
  // Direct gathers cannot fail to decode; only framed ones need a verdict (every rank knows
  // which are which from the control records).
  std::vector<Op*> framed;
  for (Op* op : ops) {
    if (!op->direct) framed.push_back(op);
  }
  const std::vector<std::string> failures =
      framed.empty() ? std::vector<std::string>{} : exchange_verdicts(framed);
  for (size_t i = 0; i < framed.size(); ++i) {
    if (failures[i].empty()) continue;
    // Every rank re-sends this gather as key frames, once; a second failure fails it everywhere.
    Op* one[] = {framed[i]};
    resynchronise(*framed[i]);
    exchange_and_decode(one);
    const std::string again = exchange_verdicts(one)[0];
    if (!again.empty()) throw CommError(again + " (again after a key-frame round)");
  }
  for (Op* op : ops) finish(*op);
}

void CompressedAllgather::Impl::comm_loop() {
  for (;;) {
    std::vector<std::shared_ptr<Op>> group;
    {
      std::unique_lock lock(mutex);
      wake.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) return;
      group.push_back(queue.front());
      queue.pop_front();
    }
    // Gathers already started join the group, and their encoding is waited for: encoding takes
    // milliseconds where a round of exchanges costs at least a network round trip, and one
    // batched round keeps every link busy (paper §3.3: encoding overlaps communication; only
    // decoding is on the critical path).
    {
      std::lock_guard lock(mutex);
      while (group.size() < kMaxGroup && !queue.empty()) {
        group.push_back(queue.front());
        queue.pop_front();
      }
    }
    try {
      if (!broken.empty()) throw CommError(broken);
      run_group(group);
    } catch (...) {
      // Every gather of the group fails the same way. After a CommError the transport may be
      // unusable, so every later gather fails with it too.
      const std::exception_ptr error = std::current_exception();
      try {
        std::rethrow_exception(error);
      } catch (const CommError& e) {
        std::lock_guard lock(mutex);
        broken = e.what();
      } catch (...) {
      }
      for (auto& op : group) {
        try {
          op->encoding.wait();
        } catch (...) {
        }
        {
          std::lock_guard lock(mutex);
          BucketState& s = buckets[op->bucket];
          s.busy = false;
          // Peers may have advanced their codec state; resynchronise next time rather than find
          // out through a failed decode.
          s.cold = true;
        }
        op->promise.set_exception(error);
      }
    }
  }
}

// ---- Public API ---------------------------------------------------------------------------------

CompressedAllgather::CompressedAllgather(Transport& transport, EngineConfig config,
                                         std::vector<BucketLayout> buckets)
    : impl_(std::make_unique<Impl>(transport, std::move(config), std::move(buckets))) {}

CompressedAllgather::~CompressedAllgather() = default;

CompressedAllgather::Ticket CompressedAllgather::start(size_t bucket, std::span<const std::byte> input,
                                                       std::span<std::byte> output) {
  Impl& m = *impl_;
  if (bucket >= m.buckets.size()) {
    throw std::invalid_argument("start: bucket " + std::to_string(bucket) + " does not exist (" +
                                std::to_string(m.buckets.size()) + " buckets)");
  }
  BucketState& s = m.buckets[bucket];
  auto op = std::make_shared<Op>();
  op->bucket = bucket;
  op->in = input.data();
  op->out = output.data();
  op->started = std::chrono::steady_clock::now();
  if (input.size() != s.layout.rank_bytes(m.rank)) {
    op->local_error = "input is " + std::to_string(input.size()) + " bytes, the layout gives this rank " +
                      std::to_string(s.layout.rank_bytes(m.rank));
  } else if (output.size() != s.layout.total_bytes()) {
    op->local_error = "output is " + std::to_string(output.size()) + " bytes, the bucket gathers " +
                      std::to_string(s.layout.total_bytes());
  }
  {
    std::lock_guard lock(m.mutex);
    if (s.busy) {
      throw std::invalid_argument("start: bucket " + std::to_string(bucket) +
                                  " already has a gather in flight");
    }
    s.busy = true;
    op->ticket = m.next_ticket++;
    m.pending[op->ticket] = op;
    op->encoded_warmup_raw = m.send_raw(s, s.step);
  }
  if (op->local_error.empty() && !op->encoded_warmup_raw) m.encode(*op, s, false);
  {
    std::lock_guard lock(m.mutex);
    m.queue.push_back(op);
  }
  m.wake.notify_all();
  return op->ticket;
}

GatherStats CompressedAllgather::wait(Ticket ticket) {
  std::shared_ptr<Op> op;
  {
    std::lock_guard lock(impl_->mutex);
    auto it = impl_->pending.find(ticket);
    if (it == impl_->pending.end()) throw std::invalid_argument("wait: unknown or already waited ticket");
    op = it->second;
    impl_->pending.erase(it);
  }
  return op->promise.get_future().get();
}

GatherStats CompressedAllgather::run(size_t bucket, std::span<const std::byte> input,
                                     std::span<std::byte> output) {
  return wait(start(bucket, input, output));
}

void CompressedAllgather::reset_caches() {
  std::lock_guard lock(impl_->mutex);
  for (BucketState& s : impl_->buckets) {
    if (s.busy) throw std::logic_error("reset_caches: a gather is in flight");
    for (size_t k = 0; k < s.layout.params(); ++k) impl_->make_codecs(s, k);
    s.cold = true;
    s.step = 0;
  }
}

void CompressedAllgather::set_policy(size_t bucket, size_t param, ShardPolicy policy) {
  std::lock_guard lock(impl_->mutex);
  BucketState& s = impl_->buckets.at(bucket);
  if (s.busy) throw std::logic_error("set_policy: a gather of this bucket is in flight");
  if (param >= s.layout.params()) throw std::invalid_argument("set_policy: no such parameter");
  if (s.layout.policy[param] == policy) return;
  s.layout.policy[param] = policy;
  impl_->make_codecs(s, param);
  // A parameter switched to CIERA may need a larger slot than its raw bytes.
  s.lay_out_slots(impl_->rank);
  uint64_t recv = 0;
  for (int r = 0; r < impl_->world; ++r) recv += s.max_frame_bytes[r] = impl_->frame_bound(s, r);
  s.recv.resize(recv);
}

const BucketLayout& CompressedAllgather::bucket(size_t index) const { return impl_->buckets.at(index).layout; }
size_t CompressedAllgather::bucket_count() const { return impl_->buckets.size(); }
int CompressedAllgather::rank() const { return impl_->rank; }
int CompressedAllgather::world_size() const { return impl_->world; }

size_t CompressedAllgather::cache_bytes() const {
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
